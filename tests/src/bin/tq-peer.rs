//! The second process of the tensor-queue tests: `tq-peer <role> [options]`.
//!
//! Roles:
//! - `checksum --reply P`: receive `Probe`s from the parent ([`tensor_queue::from_parent`]) and
//!   answer each with a `Report` of checksums (computed on the GPU for GPU tensors) sent to `P`;
//! - `hold --reply P`: the same, but keep every tensor and never exit (to be killed);
//! - `send --to P --count N --seed S [--gpu] [--die]`: connect to a receiver at `P` and send `N`
//!   probes; with `--die`, abort right after the last one, without any clean-up;
//! - `soak`: receive `SoakItem`s and check every byte on the GPU, then print the count;
//! - `echo --reply P`: answer each `BenchItem` once its tensors are usable on the stream (round trips);
//! - `usable --reply P`: answer each `BenchItem` once its tensors are usable, synchronising the
//!   stream first (the data is on the GPU and the GPU's work is done: broadcast, set-up);
//! - `drain --reply P --count N`: take `N` items, synchronise each, and answer once with every
//!   send-to-usable latency (streaming).

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::queue::{BenchAck, BenchItem, Probe, Report, SoakItem, checksum, probe};
use ipc_core::{Context, DeviceBuffer, DeviceMemory, Stream};
use kernels::Kernels;
use tensor_queue::{Error, Sender, from_parent, monotonic_ns};

fn main() {
    if let Err(error) = run() {
        eprintln!("tq-peer: {error:#}");
        std::process::exit(1);
    }
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().context("usage: tq-peer <role> [options]")?.as_str();
    match role {
        "checksum" | "hold" => {
            let reply = arg(&args, "--reply").context("--reply <path>")?;
            answer_probes(&reply, role == "hold")
        }
        "send" => {
            let to = arg(&args, "--to").context("--to <path>")?;
            let count: u64 = arg(&args, "--count").unwrap_or("1".into()).parse()?;
            let seed: u64 = arg(&args, "--seed").unwrap_or("1".into()).parse()?;
            send_probes(&to, count, seed, args.iter().any(|a| a == "--gpu"), args.iter().any(|a| a == "--die"))
        }
        "soak" => soak(),
        "echo" | "usable" | "drain" => {
            let reply = arg(&args, "--reply").context("--reply <path>")?;
            let count: u64 = arg(&args, "--count").unwrap_or("0".into()).parse()?;
            bench_peer(role, &reply, count)
        }
        other => bail!("unknown role {other}"),
    }
}

fn answer_probes(reply: &str, hold: bool) -> Result<()> {
    let mut probes = from_parent::<Probe>()?;
    let reports = Sender::<Report>::connect(reply)?;
    let mut kept = Vec::new();
    loop {
        let probe = match probes.recv() {
            Ok(probe) => probe,
            Err(Error::Disconnected) if hold => loop {
                std::thread::park();
            },
            Err(Error::Disconnected) => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        let checksums = probe.tensors.iter().map(checksum).collect::<Result<Vec<_>>>()?;
        let paths = probe.tensors.iter().map(|t| format!("{:?}", t.path())).collect();
        reports.send(&Report { id: probe.id, checksums, paths, pid: std::process::id() })?;
        if hold {
            kept.push(probe);
        }
    }
}

fn send_probes(to: &str, count: u64, seed: u64, gpu: bool, die: bool) -> Result<()> {
    let sender = Sender::<Probe>::connect(to)?;
    let device = if gpu {
        let context = Context::on_ordinal(0)?;
        let stream = Stream::new(&context)?;
        Some((context, stream))
    } else {
        None
    };
    for i in 0..count {
        let probe = probe(i, seed + i, 4096 + i as usize * 1000, device.as_ref().map(|(c, s)| (c, s)))?;
        match &device {
            Some((_, stream)) => sender.send_on(&probe, stream)?,
            None => sender.send(&probe)?,
        }
    }
    if die {
        if let Some((_, stream)) = &device {
            stream.synchronize()?;
        }
        // Die without any clean-up, as a crash would.
        std::process::abort();
    }
    Ok(())
}

fn soak() -> Result<()> {
    let mut items = from_parent::<SoakItem>()?;
    let mut scratch: Option<DeviceBuffer> = None;
    let mut count = 0u64;
    loop {
        let item = match items.recv() {
            Ok(item) => item,
            Err(Error::Disconnected) => break,
            Err(error) => return Err(error.into()),
        };
        let view = item.tensor.cuda_view()?;
        let stream = item.tensor.stream().context("a GPU tensor has a stream")?;
        let len = item.tensor.nbytes();
        let kernels = Kernels::get(view.context())?;
        if scratch.as_ref().is_none_or(|s| s.len() < len) {
            scratch = Some(DeviceBuffer::alloc(view.context(), len.next_power_of_two())?);
        }
        let scratch = scratch.as_ref().context("scratch")?;
        kernels.fill(scratch, 0, len, item.seed, stream)?;
        let expected = kernels.checksum(scratch, 0, len, stream)?;
        let seen = kernels.checksum(&view, 0, len, stream)?;
        ensure!(seen == expected, "message {count} ({len} bytes, seed {}): {seen:#x} != {expected:#x}", item.seed);
        count += 1;
    }
    println!("soak ok {count}");
    Ok(())
}

fn bench_peer(role: &str, reply: &str, count: u64) -> Result<()> {
    // Ready before anything arrives: context and stream made, as a serving process would be.
    if cuda_sys::is_available() {
        Context::on_ordinal(0)?;
    }
    let mut items = from_parent::<BenchItem>()?;
    let acks = Sender::<BenchAck>::connect(reply)?;
    let mut latencies = Vec::new();
    loop {
        let (item, info) = match items.recv_with_info(None) {
            Ok(received) => received,
            Err(Error::Disconnected) => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        if role != "echo" {
            for tensor in &item.tensors {
                if let Some(stream) = tensor.stream() {
                    stream.synchronize()?;
                }
            }
        }
        let usable_ns = monotonic_ns();
        if role == "drain" {
            latencies.push(usable_ns - info.sent_ns);
            if (latencies.len() as u64) < count {
                continue;
            }
        }
        acks.send(&BenchAck { id: item.id, latencies: std::mem::take(&mut latencies), usable_ns })?;
    }
}
