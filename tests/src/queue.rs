//! Messages and checks shared by the tensor-queue tests and their `tq-peer` helper.

use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};
use ipc_core::{Context, DeviceMemory, Stream};
use kernels::{Kernels, reference};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Receiver, Sender, Tensor, TensorDevice, spawn};

use crate::{bin_path, socket_path};

/// Starts `tq-peer <role> --reply <path> <extra>` with a channel to it ([`spawn`]), and the
/// receiver its answers come back on.
pub fn spawn_tq_peer<Request: Serialize, Answer: DeserializeOwned>(
    role: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Result<(Child, Sender<Request>, Receiver<Answer>)> {
    let reply = socket_path(role);
    let answers = Receiver::<Answer>::bind(&reply)?;
    let mut command = Command::new(bin_path("tq-peer")?);
    command.args([role, "--reply"]).arg(&reply).args(extra).envs(env.iter().copied());
    let (child, sender) = spawn::<Request>(&mut command)?;
    Ok((child, sender, answers))
}

/// Polls `done` until it holds (then returns how long that took), for at most 30 seconds.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) -> Result<Duration> {
    let start = Instant::now();
    while !done() {
        ensure!(start.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(start.elapsed())
}

/// What tensor-queue tests send: tensors and the checksums of their elements.
#[derive(Debug, Serialize, Deserialize)]
pub struct Probe {
    /// Message number.
    pub id: u64,
    /// The tensors.
    pub tensors: Vec<Tensor>,
    /// Per tensor: the checksum of its elements in row-major order.
    pub expected: Vec<u64>,
    /// Plain data beside the tensors.
    pub note: String,
}

/// What a helper answers: per tensor, the checksum it saw and the path it reported.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Report {
    /// The probe's number.
    pub id: u64,
    /// Checksums of each tensor's elements, row-major.
    pub checksums: Vec<u64>,
    /// `TransferPath` of each tensor, as text.
    pub paths: Vec<String>,
    /// The helper's process id.
    pub pid: u32,
}

/// One soak message: a fresh GPU tensor filled with the pattern of `seed`.
#[derive(Serialize, Deserialize)]
pub struct SoakItem {
    /// The tensor.
    pub tensor: Tensor,
    /// Its pattern's seed.
    pub seed: u64,
}

/// Checksum of a tensor's elements in row-major order; GPU tensors are checked on the GPU, on
/// the stream the receiver ordered them on.
pub fn checksum(tensor: &Tensor) -> Result<u64> {
    match tensor.device() {
        TensorDevice::Host => Ok(reference::checksum(&tensor.to_bytes()?)),
        TensorDevice::Cuda(_) => {
            ensure!(tensor.is_contiguous(), "GPU probes are contiguous");
            let view = tensor.cuda_view()?;
            let stream = tensor.stream().context("a received GPU tensor has a stream")?;
            Ok(Kernels::get(view.context())?.checksum(&view, 0, tensor.nbytes(), stream)?)
        }
    }
}

/// A probe of one contiguous byte tensor filled with the pattern of `seed`, on the host or (given
/// a context and stream) on the GPU, filled by a kernel queued on that stream.
pub fn probe(id: u64, seed: u64, len: usize, gpu: Option<(&Arc<Context>, &Stream)>) -> Result<Probe> {
    let tensor = match gpu {
        None => Tensor::from_slice(&reference::pattern(len, seed), DType::U8, &[len as u64])?,
        Some((context, stream)) => {
            let tensor = Tensor::empty_cuda(context, DType::U8, &[len as u64])?;
            Kernels::get(context)?.fill(&tensor.cuda_view()?, 0, len, seed, stream)?;
            tensor
        }
    };
    let expected = vec![reference::checksum(&reference::pattern(len, seed))];
    Ok(Probe { id, tensors: vec![tensor], expected, note: format!("seed {seed}") })
}

/// A benchmark request: tensors for the peer to make usable.
#[derive(Serialize, Deserialize)]
pub struct BenchItem {
    /// Message number.
    pub id: u64,
    /// The tensors.
    pub tensors: Vec<Tensor>,
}

/// A benchmark answer.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct BenchAck {
    /// The item's number (`u64::MAX`: the answerer is listening and ready).
    pub id: u64,
    /// `CLOCK_MONOTONIC` when the answerer had the data usable.
    pub usable_ns: u64,
    /// Streaming: a host tensor of `[items, 2]` i64: per item, when it was sent and when the
    /// consumer's read of it was done (too big for a frame, as bulk data should be).
    pub completions: Option<Tensor>,
    /// The item's [`tensor_queue::MessageInfo`] stamps: sent, encoded, arrived, imported, decoded.
    /// Streaming: the consumer's CPU time in total per step: receive (waiting included), read
    /// launch, completion event, drop (the release).
    pub stages_ns: Vec<u64>,
}

/// One message of several tensors, from `tq-fault batch` (the killed-producer cases of
/// `faults_gpu`): tensor `k` holds the pattern of `seed + k`.
#[derive(Serialize, Deserialize)]
pub struct FaultBatch {
    /// The producer's process id, as it knows it.
    pub pid: u32,
    /// The first tensor's pattern seed.
    pub seed: u64,
    /// Fresh GPU tensors of bytes.
    pub tensors: Vec<Tensor>,
}

/// The arguments of `tq-fault batch` (`tests/src/bin/tq-fault.rs`), shared by `faults_gpu` and
/// `faults_host`: one message of `tensors` tensors of `len` bytes to `to`, tensor `k` the pattern
/// of `seed + k`. The other fields are the options, left out at their defaults.
#[derive(Clone, Debug)]
pub struct BatchArgs<'a> {
    /// The receiver's endpoint (a socket path or `tcp://host:port`).
    pub to: &'a str,
    /// How many tensors the message holds.
    pub tensors: usize,
    /// Each tensor's length in bytes.
    pub len: usize,
    /// The first tensor's pattern seed.
    pub seed: u64,
    /// Host tensors instead of GPU tensors (`--host`).
    pub host: bool,
    /// The GPU work before the send (`--spin-us`).
    pub spin: Duration,
    /// Not 0: it SIGKILLs itself this long after its send returned (`--die-after-us`).
    pub die_after_us: u64,
    /// Not 0: a thread SIGKILLs it this long after its send began (`--die-in-send-us`).
    pub die_in_send_us: u64,
    /// How long it may live at most (`--deadline-s`; the helper's default if `None`).
    pub deadline_s: Option<u64>,
}

impl<'a> BatchArgs<'a> {
    /// One message of `tensors` GPU tensors of `len` bytes to `to`, patterns from `seed`.
    pub fn new(to: &'a str, tensors: usize, len: usize, seed: u64) -> BatchArgs<'a> {
        BatchArgs {
            to,
            tensors,
            len,
            seed,
            host: false,
            spin: Duration::ZERO,
            die_after_us: 0,
            die_in_send_us: 0,
            deadline_s: None,
        }
    }

    /// The command line after the program's name.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["batch".to_string()];
        let mut option = |name: &str, value: String| args.extend([name.to_string(), value]);
        option("--to", self.to.to_string());
        option("--tensors", self.tensors.to_string());
        option("--len", self.len.to_string());
        option("--seed", self.seed.to_string());
        if !self.spin.is_zero() {
            option("--spin-us", self.spin.as_micros().to_string());
        }
        if self.die_after_us != 0 {
            option("--die-after-us", self.die_after_us.to_string());
        }
        if self.die_in_send_us != 0 {
            option("--die-in-send-us", self.die_in_send_us.to_string());
        }
        if let Some(deadline) = self.deadline_s {
            option("--deadline-s", deadline.to_string());
        }
        if self.host {
            args.push("--host".into());
        }
        args
    }
}

/// One `recv` of a killed-producer case's receiver, for up to `wait` (`faults_gpu` and
/// `faults_host`): a message of the doomed producer `doomed_pid` goes into `held` (to be judged
/// once it is dead), a refusal (`ProducerFailed` of its one message) counts in `refused`. Whether
/// `recv` said `Disconnected`.
pub fn take_doomed(
    receiver: &mut Receiver<FaultBatch>,
    doomed_pid: u32,
    held: &mut Vec<FaultBatch>,
    refused: &mut usize,
    wait: Duration,
) -> Result<bool> {
    match receiver.recv_with_info(Some(wait)) {
        Ok((batch, info)) => {
            ensure!(info.sender_pid == doomed_pid && batch.pid == doomed_pid, "a message from pid {}", batch.pid);
            held.push(batch);
            Ok(false)
        }
        Err(tensor_queue::Error::ProducerFailed { pid, seq, .. }) => {
            ensure!(pid == doomed_pid && seq == 1, "ProducerFailed for pid {pid} seq {seq}");
            *refused += 1;
            Ok(false)
        }
        Err(tensor_queue::Error::Timeout) => Ok(false),
        Err(tensor_queue::Error::Disconnected) => Ok(true),
        Err(error) => anyhow::bail!("recv: {error:?}"),
    }
}

/// One message of the fault suite (`tq-fault` and `faults_gpu`).
#[derive(Serialize, Deserialize)]
pub struct FaultItem {
    /// The producer's process id, as it knows it.
    pub pid: u32,
    /// The producing thread.
    pub thread: u32,
    /// The message's number on its thread (its sender's `seq` is `index + 1`).
    pub index: u64,
    /// The pattern's seed.
    pub seed: u64,
    /// A fresh GPU tensor of bytes filled with the pattern of `seed`.
    pub tensor: Tensor,
}

/// The seed `tq-fault produce` gives message `index` of `thread` of the producer tagged `tag`.
pub fn fault_seed(tag: u64, thread: u64, index: u64) -> u64 {
    (tag << 40) | (thread << 32) | index
}

/// The seed of a fault-suite run: `TQ_FAULT_SEED` if set (to replay a run), else new; printed
/// with how to replay it.
pub fn case_seed() -> Result<u64> {
    let seed = match std::env::var("TQ_FAULT_SEED") {
        Ok(text) => text.parse().with_context(|| format!("TQ_FAULT_SEED={text:?} is not a number"))?,
        Err(_) => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64 & 0xffff_ffff,
    };
    println!("seed {seed} (replay with TQ_FAULT_SEED={seed})");
    Ok(seed)
}

/// Polls `done` every 200 us for up to `timeout`: how long it took to hold, or `None`.
pub fn wait_for(timeout: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if done() {
            return Some(start.elapsed());
        }
        if start.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
