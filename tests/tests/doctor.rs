//! `tq doctor` as a user runs it: a real process, without a GPU (the driver is hidden with
//! `CUDA_SYS_LIBCUDA`, so these tests mean the same on a GPU machine), its text and JSON checked.
//! The route verdicts on made-up topologies are unit tests of the binary
//! (`cargo test -p tensor-queue --bin tq`).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;

/// The `tq` binary. `CARGO_BIN_EXE_tq` exists only for tests of tensor-queue itself, and this
/// crate cannot depend on a binary (artifact dependencies are unstable), so the test asks cargo
/// to build it, as the user would, and takes its path from cargo's own JSON messages: that is
/// right whatever the target directory or profile. `TQ_BIN` names a prebuilt one instead.
fn tq() -> &'static PathBuf {
    static TQ: OnceLock<PathBuf> = OnceLock::new();
    TQ.get_or_init(|| {
        if let Some(path) = std::env::var_os("TQ_BIN") {
            return PathBuf::from(path);
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let output = Command::new(cargo)
            .args(["build", "--quiet", "--package", "tensor-queue", "--bin", "tq", "--message-format=json"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("running cargo to build tq");
        assert!(output.status.success(), "building tq failed:\n{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|message| message["reason"] == "compiler-artifact" && message["target"]["name"] == "tq")
            .find_map(|message| message["executable"].as_str().map(PathBuf::from))
            .expect("cargo reported no tq executable")
    })
}

/// Runs `tq` with `args`, without a CUDA driver.
fn run(args: &[&str]) -> Output {
    Command::new(tq())
        .args(args)
        .env("CUDA_SYS_LIBCUDA", "/nonexistent/libcuda.so.1")
        .env_remove("TQ_NCCL_LIBRARY")
        .output()
        .expect("starting tq")
}

fn doctor_json(extra: &[&str]) -> (Output, Value) {
    let output = run(&[&["doctor", "--json"], extra].concat());
    let json = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", String::from_utf8_lossy(&output.stdout)));
    (output, json)
}

#[test]
fn without_a_gpu_it_says_so_and_exits_0() {
    let output = run(&["doctor"]);
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{text}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(text.contains("No GPU or no CUDA driver here"), "{text}");
    assert!(text.contains("CUDA_VISIBLE_DEVICES="), "{text}");
    for fact in ["/dev/shm", "RLIMIT_MEMLOCK", "socket directory", "PID namespace", "pidfd", "NCCL", "across hosts"] {
        assert!(text.contains(fact), "{fact} is missing:\n{text}");
    }
    assert!(!text.contains("GPU pairs"), "no pairs without GPUs:\n{text}");
    assert!(text.contains("Summary:"), "{text}");
}

#[test]
fn the_json_has_every_section() {
    let (output, json) = doctor_json(&[]);
    assert_eq!(output.status.code(), Some(0));
    for key in ["tq_version", "cuda_visible_devices", "gpu", "pairs", "handles", "host", "engines", "summary"] {
        assert!(json.get(key).is_some(), "{key} is missing: {json:#}");
    }
    assert_eq!(json["gpu"]["available"], false);
    assert_eq!(json["pairs"].as_array().map(Vec::len), Some(0));
    let handles = json["handles"].as_array().unwrap();
    let kinds: Vec<&str> = handles.iter().filter_map(|h| h["kind"].as_str()).collect();
    assert_eq!(kinds, ["legacy_ipc_memory", "vmm_fd", "interprocess_event", "stream_memory_ops"]);
    assert!(handles.iter().all(|h| h["verdict"] == "skipped"), "not tried without a GPU");
    let host: Vec<&str> = json["host"].as_array().unwrap().iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(host.len(), 5, "{host:?}");
    assert!(host[0] == "/dev/shm" && host[1].contains("RLIMIT_MEMLOCK") && host[2].starts_with("socket directory"));
    assert!(host[3] == "PID namespace" && host[4] == "pidfd");
    for check in json["host"].as_array().unwrap() {
        let verdict = check["verdict"].as_str().unwrap();
        assert!(["ok", "slower_than_possible", "broken"].contains(&verdict), "{check}");
        assert!(verdict == "ok" || check["fix"].is_string(), "a flagged fact says what to do: {check}");
    }
    assert_eq!(json["engines"][0]["name"], "NCCL");
    let nccl = json["engines"][0]["value"].as_str().unwrap();
    assert!(nccl.contains("TCP channels") || nccl.starts_with("not installed (needed only"), "{nccl}");
}

/// The decision: without a GPU, `--strict` exits 0 unless a check is broken (a host fact that
/// is only slower than possible, such as a small locked-memory limit, does not fail it), and the
/// JSON's `summary.strict_fails` says in advance which it will be.
#[test]
fn strict_exits_non_zero_exactly_when_something_is_broken() {
    let (output, json) = doctor_json(&["--strict"]);
    let summary = &json["summary"];
    let broken = summary["broken"].as_u64().unwrap();
    assert_eq!(summary["strict_fails"], broken > 0, "without GPU pairs only broken checks fail strict: {summary}");
    assert_eq!(output.status.code(), Some(if broken > 0 { 1 } else { 0 }), "{summary}");
    // A broken fact for sure: NCCL named but missing.
    let output = Command::new(tq())
        .args(["doctor", "--strict"])
        .env("CUDA_SYS_LIBCUDA", "/nonexistent/libcuda.so.1")
        .env("TQ_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("broken"));
    assert!(String::from_utf8_lossy(&output.stdout).contains("TQ_NCCL_LIBRARY does not load"));
}

#[test]
fn version_and_usage_errors() {
    let output = run(&["version"]);
    assert!(output.status.success());
    assert!(String::from_utf8_lossy(&output.stdout).starts_with(&format!("tq {}", env!("CARGO_PKG_VERSION"))));
    let output = run(&["doctor", "--no-such-flag"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("Usage"), "a usage error says what to type");
    let output = run(&["doctor-child"]);
    assert!(!output.status.success(), "the hidden child refuses to run by hand");
}
