//! Cross-process tests that need no GPU: they run for real in CI.

use std::process::Command;

use integration_tests::{Helper, encode_u64s, helper_path};
use ipc_core::SharedMemory;
use kernels::reference;

#[test]
fn shared_memory_crosses_processes_as_a_descriptor() {
    let len = 1 << 20;
    let seed = 5;
    let memory = SharedMemory::create("host-test", len).unwrap();
    memory.write(0, &reference::pattern(len, seed)).unwrap();
    let helper = Helper::spawn(&["shm-check"], &[]).unwrap();
    helper.connection.send(&encode_u64s(&[len as u64, seed]), &[memory.fd()]).unwrap();
    let sum = helper.recv_u64s().unwrap()[0];
    assert_eq!(sum, reference::checksum(&reference::pattern(len, seed)), "the helper read our bytes");
    helper.finish().unwrap();
    let mut back = vec![0u8; len];
    memory.read(0, &mut back).unwrap();
    assert_eq!(back, reference::pattern(len, seed + 1), "we see the helper's writes");
}

#[test]
fn a_missing_driver_is_a_clear_error_in_a_real_process() {
    let output = Command::new(helper_path().unwrap())
        .arg("driver-status")
        .env("CUDA_SYS_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    assert!(output.status.success(), "no crash: {output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("driver error"), "{stdout}");
    assert!(stdout.contains("/nonexistent/libcuda.so.1"), "the error names the library: {stdout}");
}

#[test]
fn a_malformed_handle_is_refused_by_the_importer() {
    let helper = Helper::spawn(&["legacy-import"], &[]).unwrap();
    helper.connection.send(&[0xAB; 40], &[]).unwrap();
    let output = helper.child.wait_with_output().unwrap();
    assert!(!output.status.success(), "the importer reports the bad handle");
}

#[test]
fn a_dead_peer_reads_as_a_hang_up() {
    let mut helper = Helper::spawn(&["shm-check"], &[]).unwrap();
    helper.child.kill().unwrap();
    helper.child.wait().unwrap();
    let error = helper.recv_u64s().expect_err("a dead helper sends nothing");
    assert!(error.to_string().contains("hung up"), "{error}");
}
