//! tensor-queue with GPU tensors over real processes; every byte is checked on the GPU. Where
//! there is no GPU each test is reported as ignored with the reason.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::queue::{Probe, Report, SoakItem, checksum, probe, spawn_tq_peer, wait_until};
use integration_tests::{GpuTest, bin_path, run_gpu_tests, socket_path};
use ipc_core::{Context, DeviceBuffer, DeviceMemory, Stream};
use kernels::{Kernels, reference};
use tensor_queue::{Broadcast, DType, Error, Receiver, Sender, Tensor, spawn};

fn main() {
    run_gpu_tests(vec![
        GpuTest { name: "gpu_tensors_cross_zero_copy_and_leases_return", gpus: 1, run: gpu_tensors_cross_zero_copy },
        GpuTest { name: "a_lone_send_on_an_idle_stream_becomes_usable", gpus: 1, run: lone_send_on_idle_stream },
        GpuTest { name: "user_buffers_cross_by_legacy_handle_and_never_go_stale", gpus: 1, run: user_buffers },
        GpuTest { name: "seed_matmul_example_is_ordered", gpus: 1, run: seed_example_is_ordered },
        GpuTest { name: "seed_matmul_example_is_ordered_by_events_too", gpus: 1, run: seed_example_ordered_by_events },
        GpuTest { name: "seed_matmul_example_fails_without_ordering", gpus: 1, run: seed_example_fails_unordered },
        GpuTest { name: "killed_receiver_returns_gpu_leases", gpus: 1, run: killed_receiver_returns_leases },
        GpuTest { name: "killed_sender_leaves_received_gpu_tensors_valid", gpus: 1, run: killed_sender },
        GpuTest { name: "broadcast_one_tensor_to_three_receivers", gpus: 1, run: broadcast_to_three },
        GpuTest { name: "soak_1m_random_sizes_checked_on_the_gpu_no_growth", gpus: 1, run: soak },
        GpuTest { name: "examples_run_on_the_gpu", gpus: 1, run: examples_run },
    ]);
}

fn gpu() -> Result<(Arc<Context>, Stream)> {
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    Ok((context, stream))
}

fn peer(role: &str, env: &[(&str, &str)]) -> Result<(Child, Sender<Probe>, Receiver<Report>)> {
    spawn_tq_peer(role, &[], env)
}

/// One message, its producer's stream idle before and after: the fence must reach the GPU
/// without any later work to carry it (a stream memory write the driver held back hung here).
fn lone_send_on_idle_stream() -> Result<()> {
    let (context, stream) = gpu()?;
    let (mut child, sender, mut reports) = peer("checksum", &[])?;
    let probe = probe(1, 77, 4096, Some((&context, &stream)))?;
    stream.synchronize()?;
    sender.send_on(&probe, &stream)?;
    let report = reports.recv_timeout(Duration::from_secs(20)).context("the receiver never saw the data usable")?;
    ensure!(report.checksums == probe.expected, "{:?} != {:?}", report.checksums, probe.expected);
    drop(sender);
    ensure!(child.wait()?.success());
    Ok(())
}

fn gpu_tensors_cross_zero_copy() -> Result<()> {
    let (context, stream) = gpu()?;
    let (mut child, sender, mut reports) = peer("checksum", &[])?;
    for id in 0..20 {
        let probe = probe(id, 500 + id, 1 + id as usize * 77_777, Some((&context, &stream)))?;
        sender.send_on(&probe, &stream)?; // no synchronisation: ordering is the receiver's stream wait
    }
    for _ in 0..20 {
        let report = reports.recv()?;
        let len = 1 + report.id as usize * 77_777;
        ensure!(
            report.checksums[0] == reference::checksum(&reference::pattern(len, 500 + report.id)),
            "probe {}",
            report.id
        );
        ensure!(report.paths == ["CudaVmm"], "{:?}", report.paths);
    }
    wait_until("every lease back", || sender.outstanding_leases() == 0)?;
    drop(sender);
    ensure!(child.wait()?.success());
    Ok(())
}

fn user_buffers() -> Result<()> {
    let (context, stream) = gpu()?;
    let kernels = Kernels::get(&context)?;
    let (mut child, sender, mut reports) = peer("checksum", &[])?;
    let len = 3 << 20;
    let mut addresses = Vec::new();
    for round in 0..4u64 {
        // A fresh cuMemAlloc each round: the driver often hands back the address just freed.
        let buffer = Arc::new(DeviceBuffer::alloc(&context, len)?);
        addresses.push(buffer.device_ptr());
        kernels.fill(buffer.as_ref(), 0, len, 900 + round, &stream)?;
        let tensor = Tensor::from_device_buffer(buffer, DType::U8, &[len as u64])?;
        let expected = vec![reference::checksum(&reference::pattern(len, 900 + round))];
        sender.send_on(&Probe { id: round, tensors: vec![tensor], expected, note: String::new() }, &stream)?;
        let report = reports.recv()?;
        ensure!(report.paths == ["CudaLegacyIpc"], "{:?}", report.paths);
        ensure!(
            report.checksums[0] == reference::checksum(&reference::pattern(len, 900 + round)),
            "round {round}: the receiver read a stale mapping"
        );
        wait_until("the lease", || sender.outstanding_leases() == 0)?;
    }
    addresses.dedup();
    println!("buffer addresses used: {} distinct of 4", addresses.len());
    drop(sender);
    ensure!(child.wait()?.success());
    Ok(())
}

fn run_example(name: &str, env: &[(&str, &str)]) -> Result<(bool, String)> {
    let path = bin_path(&format!("../examples/{name}"))
        .or_else(|_| bin_path(&format!("examples/{name}")))
        .context("the examples are built (cargo build --examples, or the GPU bundle)")?;
    let output = Command::new(path).envs(env.iter().copied()).stderr(Stdio::inherit()).output()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    println!("{text}");
    Ok((output.status.success(), text))
}

fn seed_example_is_ordered() -> Result<()> {
    let (ok, text) = run_example("seed_matmul", &[])?;
    ensure!(ok && text.contains("matches the reference") && text.contains("CudaVmm"), "{text}");
    Ok(())
}

/// The fallback for devices without stream memory operations: interprocess events.
fn seed_example_ordered_by_events() -> Result<()> {
    let (ok, text) = run_example("seed_matmul", &[("TENSOR_QUEUE_TEST_FORCE_EVENTS", "1")])?;
    ensure!(ok && text.contains("matches the reference"), "{text}");
    Ok(())
}

/// Proves the seed test can fail: with the receiver's stream wait disabled, the consumer reads
/// `x` while the producer's matmuls are still running.
fn seed_example_fails_unordered() -> Result<()> {
    let (ok, text) = run_example("seed_matmul", &[("TENSOR_QUEUE_TEST_SKIP_ORDERING", "1")])?;
    ensure!(!ok && text.contains("MISMATCH"), "without ordering the consumer still saw the final x: {text}");
    Ok(())
}

fn killed_receiver_returns_leases() -> Result<()> {
    let (context, stream) = gpu()?;
    let (mut doomed, to_doomed, mut doomed_reports) = peer("hold", &[])?;
    for id in 0..4 {
        to_doomed.send_on(&probe(id, id, 1 << 20, Some((&context, &stream)))?, &stream)?;
    }
    for _ in 0..4 {
        doomed_reports.recv()?;
    }
    ensure!(to_doomed.outstanding_leases() == 4);
    doomed.kill()?;
    let took = wait_until("leases of the killed receiver", || to_doomed.outstanding_leases() == 0)?;
    println!("GPU leases returned {took:?} after the kill");
    doomed.wait()?;
    let (mut survivor, to_survivor, mut survivor_reports) = peer("checksum", &[])?;
    to_survivor.send_on(&probe(9, 9, 1 << 20, Some((&context, &stream)))?, &stream)?;
    ensure!(survivor_reports.recv()?.checksums[0] == reference::checksum(&reference::pattern(1 << 20, 9)));
    drop(to_survivor);
    ensure!(survivor.wait()?.success());
    Ok(())
}

fn killed_sender() -> Result<()> {
    let path = socket_path("dying-gpu");
    let mut receiver = Receiver::<Probe>::bind(&path)?;
    let mut child = Command::new(bin_path("tq-peer")?)
        .args(["send", "--gpu", "--count", "3", "--seed", "60", "--die", "--to"])
        .arg(&path)
        .spawn()?;
    let probes: Vec<Probe> =
        (0..3).map(|_| receiver.recv_timeout(Duration::from_secs(60))).collect::<Result<_, _>>()?;
    ensure!(matches!(receiver.recv_timeout(Duration::from_secs(60)), Err(Error::Disconnected)));
    ensure!(!child.wait()?.success(), "the sender died");
    for probe in &probes {
        ensure!(checksum(&probe.tensors[0])? == probe.expected[0], "GPU data did not survive its sender");
    }
    Ok(())
}

fn broadcast_to_three() -> Result<()> {
    let (context, stream) = gpu()?;
    let peers = (0..3).map(|_| peer("checksum", &[])).collect::<Result<Vec<_>>>()?;
    let (mut children, mut senders, mut reports) = (Vec::new(), Vec::new(), Vec::new());
    for (child, sender, report) in peers {
        children.push(child);
        senders.push(sender);
        reports.push(report);
    }
    let broadcast = Broadcast::new(senders);
    let len = 256 << 20;
    broadcast.send_on(&probe(1, 77, len, Some((&context, &stream)))?, &stream)?;
    for report in &mut reports {
        let report = report.recv()?;
        ensure!(report.checksums[0] == reference::checksum(&reference::pattern(len, 77)));
        ensure!(report.paths == ["CudaVmm"]);
    }
    wait_until("all leases", || broadcast.senders().iter().all(|s| s.outstanding_leases() == 0))?;
    drop(broadcast);
    for mut child in children {
        ensure!(child.wait()?.success());
    }
    Ok(())
}

fn soak() -> Result<()> {
    let (context, stream) = gpu()?;
    let kernels = Kernels::get(&context)?;
    let mut command = Command::new(bin_path("tq-peer")?);
    command.arg("soak").stdout(Stdio::piped());
    let (child, sender) = spawn::<SoakItem>(&mut command)?;
    let count = 1_000_000u64;
    let mut state = 0xC0FFEEu64;
    let start = Instant::now();
    let mut early = (0, 0);
    for index in 0..count {
        if index == 100_000 {
            early = (open_fds(), tensor_queue::memory::usage().device_bytes);
        }
        state = reference::splitmix64(state);
        let len = 1 + (state % (256 << 10)) as usize;
        let tensor = Tensor::empty_cuda(&context, DType::U8, &[len as u64])?;
        kernels.fill(&tensor.cuda_view()?, 0, len, state, &stream)?;
        sender.send_on(&SoakItem { tensor, seed: state }, &stream)?;
    }
    let late = (open_fds(), tensor_queue::memory::usage().device_bytes);
    drop(sender);
    let output = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    println!(
        "{} in {:.1} s; sender fds {} -> {}, arena {} -> {} bytes",
        text.trim(),
        start.elapsed().as_secs_f64(),
        early.0,
        late.0,
        early.1,
        late.1
    );
    if !output.status.success() || !text.contains(&format!("soak ok {count}")) {
        bail!("the soak failed: {text}");
    }
    let consumer: Vec<usize> = text.split_whitespace().skip(4).filter_map(|n| n.parse().ok()).collect();
    ensure!(consumer.len() == 2 && consumer[1] <= consumer[0] + 2, "the consumer's descriptors grew: {text}");
    ensure!(late.0 <= early.0 + 2, "the sender's descriptors grew: {} -> {}", early.0, late.0);
    // Random sizes up to 256 KiB: the arena may hold a chunk more than it did early on, not more.
    ensure!(late.1 <= early.1 + (64 << 20), "the sender's arena grew: {} -> {} bytes", early.1, late.1);
    Ok(())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count())
}

fn examples_run() -> Result<()> {
    for name in ["nested", "columns", "demo"] {
        let (ok, text) = run_example(name, &[])?;
        ensure!(ok, "example {name} failed: {text}");
    }
    let (ok, text) = run_example("stream_latency", &[])?;
    ensure!(ok && text.contains("items/s"), "{text}");
    Ok(())
}
