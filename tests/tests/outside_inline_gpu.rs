//! Small GPU messages across hosts, as a user outside the workspace sees them (issue 26): this
//! process receives over TCP with the public API only, the sender is `outside-inline-peer`, a
//! program of its own that uses only the public API too. Both sides use GPU 0: a small message
//! never needs NCCL (which could not pair two ranks on one GPU), so one GPU is enough. Without a
//! GPU each test is reported as ignored, never as a pass.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::{GpuTest, bin_path, run_gpu_tests};
use tensor_queue::{Context, Receiver, Secret, TensorDevice, TransferPath};

/// The helper's message type and patterns.
#[allow(dead_code, missing_docs, unreachable_pub)]
#[path = "../src/bin/outside-inline-peer.rs"]
mod peer;

const KEY: &str = "outside-inline-tests-secret-0123456789";

fn main() {
    run_gpu_tests(vec![
        GpuTest { name: "small_gpu_messages_cross_tcp_inline_and_exact", gpus: 1, run: small_messages_inline },
        GpuTest { name: "with_the_threshold_at_0_the_route_is_nccl", gpus: 1, run: threshold_zero_says_nccl },
    ]);
}

/// Starts the sender to `endpoint` with `extra` arguments; its stdout lines.
fn sender(endpoint: &str, extra: &[&str]) -> Result<(std::process::Child, mpsc::Receiver<String>)> {
    let mut child = Command::new(bin_path("outside-inline-peer")?)
        .args(["--to", endpoint])
        .args(extra)
        .env("TQ_SECRET", KEY)
        .env_remove(tensor_queue::route::INLINE_GPU_ENV)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting outside-inline-peer")?;
    let out = child.stdout.take().context("stdout")?;
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            eprintln!("  [peer] {line}");
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok((child, lines))
}

fn next_line(lines: &mpsc::Receiver<String>) -> Result<String> {
    let line = lines.recv_timeout(Duration::from_secs(60)).context("the peer said nothing for 60 s")?;
    if line.starts_with("error") {
        bail!("the peer: {line}");
    }
    Ok(line)
}

/// Four messages of three GPU tensors (4 KiB of u8, a transposed f32 view, one i32): each
/// arrives on this process's GPU with `TransferPath::Tcp` (inline: no NCCL) and a stream there,
/// with the shape, strides and bytes sent, in order; the sender's leases all come back.
fn small_messages_inline() -> Result<()> {
    let gpu = Context::on_ordinal(0)?.device().uuid()?;
    let mut receiver = Receiver::<peer::Small>::builder().secret(Secret::from_bytes(KEY)?).bind("tcp://127.0.0.1:0")?;
    let endpoint = format!("tcp://{}", receiver.local_addr().context("bound to TCP")?);
    let (mut child, lines) = sender(&endpoint, &[])?;
    let route = next_line(&lines)?;
    ensure!(route == "route-4k Tcp small message inline", "the sender's route for 4 KiB: {route}");
    for i in 0..4u64 {
        let message = receiver.recv_timeout(Duration::from_secs(60))?;
        ensure!(message.i == i, "message {} where {i} was due", message.i);
        for (k, tensor) in message.tensors.iter().enumerate() {
            ensure!(tensor.path() == TransferPath::Tcp, "message {i} tensor {k} came by {:?}", tensor.path());
            ensure!(tensor.device() == TensorDevice::Cuda(gpu), "message {i} tensor {k} is on {:?}", tensor.device());
            let stream = tensor.stream().context("a received GPU tensor has a stream")?;
            ensure!(stream.context().device().uuid()? == gpu, "its stream is on another GPU");
        }
        let [bytes, matrix, one] = &message.tensors[..] else { bail!("{} tensors", message.tensors.len()) };
        ensure!(bytes.to_bytes()? == peer::bytes_of(i), "message {i}: the u8 tensor's bytes");
        ensure!(
            matrix.shape() == [32, 16] && matrix.strides() == [1, 32],
            "the view: {:?} {:?}",
            matrix.shape(),
            matrix.strides()
        );
        let sent = peer::matrix_of(i);
        let expected: Vec<f32> =
            (0..32).flat_map(|c| (0..16).map(move |r| (r, c))).map(|(r, c)| sent[r * 32 + c]).collect();
        ensure!(matrix.to_vec::<f32>()? == expected, "message {i}: the transposed view's elements");
        ensure!(one.to_vec::<i32>()? == [i as i32], "message {i}: the i32");
        ensure!(!bytes.producer_failed());
    }
    loop {
        let line = next_line(&lines)?;
        if line == "done" {
            break;
        }
        ensure!(!line.starts_with("unreleased"), "the sender's leases: {line}");
    }
    let status = child.wait()?;
    ensure!(status.success(), "the sender exited with {status}");
    ensure!(receiver.take_errors().is_empty(), "errors at the receiver");
    Ok(())
}

/// A sender built with `inline_gpu_up_to(0)` says its 4 KiB messages would go through NCCL (it
/// sends none: NCCL cannot pair two ranks on one GPU).
fn threshold_zero_says_nccl() -> Result<()> {
    let receiver = Receiver::<peer::Small>::builder().secret(Secret::from_bytes(KEY)?).bind("tcp://127.0.0.1:0")?;
    let endpoint = format!("tcp://{}", receiver.local_addr().context("bound to TCP")?);
    let (mut child, lines) = sender(&endpoint, &["--up-to", "0", "--route-only"])?;
    let route = next_line(&lines)?;
    ensure!(route == "route-4k Nccl -", "with the threshold at 0: {route}");
    ensure!(next_line(&lines)? == "done");
    ensure!(child.wait()?.success());
    drop(receiver);
    Ok(())
}
