//! Cross-device hand-offs: a producer on GPU 0 sends a message (a 64 MiB tensor, a strided view
//! and 1,024 small tensors) to consumers that each ask for a different route, and each consumer
//! checks every tensor with a checksum computed on its own GPU.
//!
//! `cargo run --release -p tensor-queue --example cross_device [same|copy|map|staged|host ...]`
//!
//! With two GPUs, `copy` and `map` land on GPU 1 over the peer link, `staged` goes through pinned
//! host memory; with one, `staged` is forced onto the same GPU; with none, the message is host
//! tensors and every consumer gets host tensors.

use std::process::Command;
use std::time::Duration;

use kernels::{Kernels, reference};
use serde::{Deserialize, Serialize};
use tensor_queue::route::{Landing, PeerMode, Routing};
use tensor_queue::{Context, DType, Device, DeviceMemory, Receiver, Stream, Tensor, Uuid, monotonic_ns, spawn};

#[derive(Serialize, Deserialize)]
struct Message {
    tensors: Vec<Tensor>,
    /// The producer's checksum of each tensor's bytes, packed in row-major order.
    sums: Vec<u64>,
    sent_ns: u64,
}

type Fallible<T = ()> = Result<T, Box<dyn std::error::Error>>;

const MODE_ENV: &str = "CROSS_DEVICE_MODE";
const TARGET_ENV: &str = "CROSS_DEVICE_TARGET";

fn main() -> Fallible {
    if let Ok(mode) = std::env::var(MODE_ENV) {
        return consumer(&mode);
    }
    let gpus = if tensor_queue::is_gpu_available() { Device::count()? } else { 0 };
    let mut modes: Vec<String> = std::env::args().skip(1).collect();
    if modes.is_empty() {
        modes = ["same", "copy", "map", "staged", "host"].map(String::from).to_vec();
    }
    if gpus < 2 {
        modes.retain(|m| !matches!(m.as_str(), "copy" | "map"));
    }
    // Consumers land on the last GPU: GPU 1 with two, the producer's own with one.
    let target = if gpus > 0 { Some(Device::get(gpus - 1)?.uuid()?) } else { None };
    println!("producer: {gpus} GPU(s); routes to try: {}", modes.join(", "));
    for mode in &modes {
        let mut command = Command::new(std::env::current_exe()?);
        command.env(MODE_ENV, mode);
        if let Some(target) = target {
            command.env(TARGET_ENV, target.to_string());
        }
        let (mut child, sender) = spawn::<Message>(&mut command)?;
        let (message, stream) = make_message(gpus > 0)?;
        if let Some(first) = message.tensors.first().and_then(|t| match t.device() {
            tensor_queue::TensorDevice::Cuda(uuid) => Some(uuid),
            tensor_queue::TensorDevice::Host => None,
        }) {
            let choice = sender.route(&first, Duration::from_secs(30))?;
            println!(
                "producer: {mode}: route {} ({})",
                choice.route,
                choice.slower_because.as_deref().unwrap_or("the best")
            );
        }
        match &stream {
            Some(stream) => sender.send_on(&message, stream)?,
            None => sender.send(&message)?,
        }
        drop(sender);
        if !child.wait()?.success() {
            return Err(format!("the {mode} consumer failed").into());
        }
    }
    Ok(())
}

/// The message, made and checksummed on GPU 0 (or the host), and the stream it was made on.
fn make_message(gpu: bool) -> Fallible<(Message, Option<Stream>)> {
    let sent_ns = monotonic_ns();
    if !gpu {
        let big = Tensor::from_slice(&(0..1 << 20).map(|i| i as f32).collect::<Vec<_>>(), DType::F32, &[1024, 1024])?;
        let view = big.transpose(0, 1)?.narrow(0, 3, 100)?;
        let mut tensors = vec![big, view];
        tensors.extend(
            (0..1024).map(|i| Tensor::from_slice(&[i; 1024], DType::I32, &[1024])).collect::<Result<Vec<_>, _>>()?,
        );
        let sums = tensors.iter().map(|t| Ok(reference::checksum(&t.to_bytes()?))).collect::<Fallible<_>>()?;
        return Ok((Message { tensors, sums, sent_ns }, None));
    }
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    let kernels = Kernels::get(&context)?;
    let big = Tensor::empty_cuda(&context, DType::F32, &[4096, 4096])?;
    let mut tensors = vec![big.clone(), big.transpose(0, 1)?.slice(0, 5, 4000, 3)?];
    tensors
        .extend((0..1024).map(|_| Tensor::empty_cuda(&context, DType::I32, &[1024])).collect::<Result<Vec<_>, _>>()?);
    for (seed, tensor) in tensors.iter().enumerate().filter(|(i, _)| *i != 1) {
        let view = tensor.cuda_view()?;
        kernels.fill(&view, 0, view.len(), seed as u64, &stream)?;
    }
    let mut sums = Vec::with_capacity(tensors.len());
    for tensor in &tensors {
        sums.push(checksum(tensor, &stream)?);
    }
    Ok((Message { tensors, sums, sent_ns }, Some(stream)))
}

/// The checksum of a tensor's elements in row-major order, on the GPU of `stream`.
fn checksum(tensor: &Tensor, stream: &Stream) -> Fallible<u64> {
    let packed = tensor.contiguous_on(stream)?;
    let view = packed.cuda_view()?;
    Ok(Kernels::get(stream.context())?.checksum(&view, 0, packed.nbytes(), stream)?)
}

fn consumer(mode: &str) -> Fallible {
    let target = std::env::var(TARGET_ENV).ok().map(|t| t.parse::<Uuid>()).transpose()?;
    let routing = match (mode, target) {
        ("host", _) | (_, None) => Routing::default().land(Landing::Host),
        ("same", _) => Routing::default(),
        ("copy", Some(t)) => Routing::default().land(Landing::Device(t)),
        ("map", Some(t)) => Routing::default().land(Landing::Device(t)).peer(PeerMode::Map),
        ("staged", Some(t)) => Routing::default().land(Landing::Device(t)).peer(PeerMode::Stage),
        (other, _) => return Err(format!("unknown mode {other}").into()),
    };
    if let Some(target) = target {
        Kernels::get(&Context::primary(Device::by_uuid(&target)?)?)?; // loaded before anything arrives
    }
    let mut receiver = Receiver::<Message>::builder().routing(routing).from_parent()?;
    let message = receiver.recv()?;
    let mut bad = 0;
    for (tensor, expected) in message.tensors.iter().zip(&message.sums) {
        let seen = match tensor.stream() {
            Some(stream) => checksum(tensor, stream)?,
            None => reference::checksum(&tensor.to_bytes()?),
        };
        bad += usize::from(seen != *expected);
    }
    let usable_us = (monotonic_ns() - message.sent_ns) as f64 / 1e3;
    let first = &message.tensors[0];
    println!(
        "consumer {mode}: {} tensors by {:?} onto {:?}, {bad} mismatched, usable {usable_us:.0} us after send (incl. checksums)",
        message.tensors.len(),
        first.path(),
        first.stream().map(|s| s.context().device().ordinal()),
    );
    if bad > 0 {
        std::process::exit(1);
    }
    Ok(())
}
