//! The benchmark suite: tensor-queue against the anchors, measured in the same run on the same
//! machine, printed as a table of ratios (last) and written as JSON.
//!
//! `tq-bench [--json FILE] [--floor BIN] [--torch SCRIPT] [--python PYTHON]`, on the GPU machine:
//! `bash target/gpu-bundle/bench.sh`. Every figure is the machine's monotonic clock read on the
//! side of the barrier where the data became usable (the consumer's stream synchronised, or its
//! wait enqueued for round trips, as PyTorch's consumer synchronises in its anchor).

use std::process::{Child, Command};
use std::time::Instant;

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::percentile;
use integration_tests::queue::{BenchAck, BenchItem, spawn_tq_peer};
use ipc_core::{Context, Stream};
use kernels::Kernels;
use tensor_queue::{Broadcast, DType, Receiver, Sender, Tensor, monotonic_ns};

/// One figure of the table.
struct Row {
    name: String,
    value: f64,
    unit: &'static str,
    anchor: String,
    anchor_value: Option<f64>,
    /// Whether a larger value is better (throughput) or worse (latency, memory).
    larger_is_better: bool,
}

impl Row {
    fn ratio(&self) -> Option<f64> {
        let anchor = self.anchor_value?;
        if self.value == 0.0 || anchor == 0.0 {
            return None;
        }
        Some(if self.larger_is_better { self.value / anchor } else { anchor / self.value })
    }
}

struct Bench {
    context: std::sync::Arc<Context>,
    stream: Stream,
    kernels: std::sync::Arc<Kernels>,
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(reason) = integration_tests::gpu_skip_reason() {
        println!("tq-bench: skipped, {reason}");
        return Ok(());
    }
    let context = Context::on_ordinal(0)?;
    let bench = Bench { stream: Stream::new(&context)?, kernels: Kernels::get(&context)?, context };
    let mut driver = 0;
    // SAFETY: a valid out-pointer.
    unsafe { cuda_sys::driver!(cuDriverGetVersion(&mut driver)) }?;
    let machine =
        format!("{} ({}), CUDA driver API {driver}", bench.context.device().name()?, bench.context.device().uuid()?);
    eprintln!("tq-bench on {machine}");

    // Set-up first: this process has exported nothing yet.
    eprintln!("[1/7] set-up: first message on a new channel");
    let setup = bench.first_message()?;
    eprintln!("[2/7] C socket floor");
    let floor = match arg(&args, "--floor") {
        Some(floor) => Some(run_json(Command::new(floor))?),
        None => None,
    };
    eprintln!("[3/7] PyTorch anchors (this takes a while)");
    let torch = match arg(&args, "--torch") {
        Some(script) => {
            let mut command = Command::new(arg(&args, "--python").unwrap_or("python3".into()));
            command.arg(script);
            Some(run_json(command)?)
        }
        None => None,
    };
    eprintln!("[4/7] round trips, one 4 KB tensor");
    let mut one = bench.round_trips(1, 10_000)?;
    eprintln!("[5/7] round trips, sixteen 4 KB tensors");
    let mut sixteen = bench.round_trips(16, 10_000)?;
    eprintln!("[6/7] streaming fresh 5 MB tensors");
    let (items_per_s, mut stream_latency) = bench.streaming(5_000)?;
    eprintln!("[7/7] broadcast of 1 GiB to 3 receivers");
    let (broadcast_us, extra_bytes) = bench.broadcast()?;

    let us = |ns: u64| ns as f64 / 1000.0;
    let field = |json: &Option<serde_json::Value>, key: &str| json.as_ref().and_then(|j| j[key].as_f64());
    let one_p50 = us(percentile(&mut one, 50.0));
    let rows = vec![
        Row {
            name: "round trip, 1 x 4 KB, p50".into(),
            value: one_p50,
            unit: "us",
            anchor: "torch SimpleQueue p50".into(),
            anchor_value: field(&torch, "simplequeue_rtt_p50_us"),
            larger_is_better: false,
        },
        Row {
            name: "round trip, 1 x 4 KB, p50".into(),
            value: one_p50,
            unit: "us",
            anchor: "C SEQPACKET ping-pong p50".into(),
            anchor_value: field(&floor, "p50_us"),
            larger_is_better: false,
        },
        Row {
            name: "round trip, 1 x 4 KB, p99".into(),
            value: us(percentile(&mut one, 99.0)),
            unit: "us",
            anchor: "torch SimpleQueue p99".into(),
            anchor_value: field(&torch, "simplequeue_rtt_p99_us"),
            larger_is_better: false,
        },
        Row {
            name: "round trip, 1 x 4 KB, p99.9".into(),
            value: us(percentile(&mut one, 99.9)),
            unit: "us",
            anchor: "C SEQPACKET ping-pong p99.9".into(),
            anchor_value: field(&floor, "p999_us"),
            larger_is_better: false,
        },
        Row {
            name: "round trip, 16 x 4 KB, p50".into(),
            value: us(percentile(&mut sixteen, 50.0)),
            unit: "us",
            anchor: "1 x 4 KB p50 (same run)".into(),
            anchor_value: Some(one_p50),
            larger_is_better: false,
        },
        Row {
            name: "round trip, 16 x 4 KB, p99".into(),
            value: us(percentile(&mut sixteen, 99.0)),
            unit: "us",
            anchor: "-".into(),
            anchor_value: None,
            larger_is_better: false,
        },
        Row {
            name: "stream fresh 5 MB, items/s".into(),
            value: items_per_s,
            unit: "1/s",
            anchor: "torch mp.Queue items/s".into(),
            anchor_value: field(&torch, "queue_items_per_s"),
            larger_is_better: true,
        },
        Row {
            name: "stream fresh 5 MB, send->usable p50".into(),
            value: us(percentile(&mut stream_latency, 50.0)),
            unit: "us",
            anchor: "torch put->usable p50".into(),
            anchor_value: field(&torch, "queue_latency_p50_us"),
            larger_is_better: false,
        },
        Row {
            name: "stream fresh 5 MB, send->usable p99".into(),
            value: us(percentile(&mut stream_latency, 99.0)),
            unit: "us",
            anchor: "torch put->usable p99".into(),
            anchor_value: field(&torch, "queue_latency_p99_us"),
            larger_is_better: false,
        },
        Row {
            name: "broadcast 1 GiB to 3, all usable".into(),
            value: broadcast_us,
            unit: "us",
            anchor: "1 x 4 KB round trip p50".into(),
            anchor_value: Some(one_p50),
            larger_is_better: false,
        },
        Row {
            name: "broadcast 1 GiB to 3, extra device memory".into(),
            value: extra_bytes as f64 / (1 << 20) as f64,
            unit: "MiB",
            anchor: "the tensor itself".into(),
            anchor_value: Some(1024.0),
            larger_is_better: false,
        },
        Row {
            name: "first message on a new channel".into(),
            value: us(setup),
            unit: "us",
            anchor: "target 2 ms".into(),
            anchor_value: Some(2000.0),
            larger_is_better: false,
        },
    ];

    let json = serde_json::json!({
        "machine": machine,
        "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs(),
        "rows": rows.iter().map(|r| serde_json::json!({
            "name": r.name, "value": r.value, "unit": r.unit, "anchor": r.anchor,
            "anchor_value": r.anchor_value, "ratio": r.ratio(),
        })).collect::<Vec<_>>(),
        "anchors": { "torch": torch, "socket_floor": floor },
        "samples_us": {
            "round_trip_1": one.iter().map(|&n| us(n)).collect::<Vec<_>>(),
            "stream_latency": stream_latency.iter().map(|&n| us(n)).collect::<Vec<_>>(),
        },
    });
    if let Some(path) = arg(&args, "--json") {
        std::fs::write(&path, serde_json::to_string_pretty(&json)?)?;
    }
    println!("\ntq-bench on {machine}");
    println!("| measure | tensor-queue | anchor | anchor value | ratio (anchor/ours, or ours/anchor for rates) |");
    println!("| --- | --- | --- | --- | --- |");
    for row in &rows {
        let anchor = row.anchor_value.map_or("-".into(), |v| format!("{v:.1}"));
        let ratio = row.ratio().map_or("-".into(), |r| format!("{r:.2}x"));
        println!("| {} | {:.1} {} | {} | {anchor} | {ratio} |", row.name, row.value, row.unit, row.anchor);
    }
    Ok(())
}

/// Runs a program that prints one JSON object last.
fn run_json(mut command: Command) -> Result<serde_json::Value> {
    let output = command.output().with_context(|| format!("running {command:?}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success(), "{command:?} failed: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    let last = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON in the output")?;
    Ok(serde_json::from_str(last)?)
}

impl Bench {
    fn peer(&self, role: &str, extra: &[&str]) -> Result<(Child, Sender<BenchItem>, Receiver<BenchAck>)> {
        spawn_tq_peer(role, extra, &[])
    }

    fn tensor(&self, bytes: u64, seed: u64) -> Result<Tensor> {
        let tensor = Tensor::empty_cuda(&self.context, DType::U8, &[bytes])?;
        self.kernels.fill(&tensor.cuda_view()?, 0, bytes as usize, seed, &self.stream)?;
        Ok(tensor)
    }

    fn finish(child: &mut Child, sender: Sender<BenchItem>) -> Result<()> {
        drop(sender);
        if !child.wait()?.success() {
            bail!("a benchmark peer failed");
        }
        Ok(())
    }

    /// Nanoseconds from `send` of the first message of a fresh process (its chunk exported, the
    /// peer importing it) to the peer having the data usable on its GPU.
    fn first_message(&self) -> Result<u64> {
        let (mut child, sender, mut acks) = self.peer("usable", &[])?;
        let start = monotonic_ns();
        let tensor = self.tensor(4096, 1)?;
        sender.send_on(&BenchItem { id: 0, tensors: vec![tensor] }, &self.stream)?;
        let ack = acks.recv()?;
        Bench::finish(&mut child, sender)?;
        Ok(ack.usable_ns - start)
    }

    /// Round-trip times in nanoseconds of messages with `count` 4 KB tensors, after a warm-up.
    fn round_trips(&self, count: usize, trips: usize) -> Result<Vec<u64>> {
        let (mut child, sender, mut acks) = self.peer("echo", &[])?;
        let tensors = (0..count).map(|i| self.tensor(4096, i as u64)).collect::<Result<Vec<_>>>()?;
        self.stream.synchronize()?;
        let mut times = Vec::with_capacity(trips);
        for id in 0..(trips + 1000) as u64 {
            let start = Instant::now();
            sender.send_on(&BenchItem { id, tensors: tensors.clone() }, &self.stream)?;
            ensure!(acks.recv()?.id == id, "answers out of order");
            if id >= 1000 {
                times.push(start.elapsed().as_nanos() as u64);
            }
        }
        Bench::finish(&mut child, sender)?;
        Ok(times)
    }

    /// Items per second and send-to-usable latencies of freshly allocated 5 MB tensors.
    fn streaming(&self, items: u64) -> Result<(f64, Vec<u64>)> {
        let (mut child, sender, mut acks) = self.peer("drain", &["--count", &items.to_string()])?;
        let start = monotonic_ns();
        for id in 0..items {
            let tensor = self.tensor(5 << 20, id)?;
            sender.send_on(&BenchItem { id, tensors: vec![tensor] }, &self.stream)?;
        }
        let ack = acks.recv()?;
        let seconds = (ack.usable_ns - start) as f64 / 1e9;
        Bench::finish(&mut child, sender)?;
        Ok((items as f64 / seconds, ack.latencies))
    }

    /// Microseconds until three receivers can all use one 1 GiB tensor, and the device memory the
    /// hand-off added (as the driver reports it, after every receiver is ready).
    fn broadcast(&self) -> Result<(f64, u64)> {
        let peers = (0..3).map(|_| self.peer("usable", &[])).collect::<Result<Vec<_>>>()?;
        let tensor = self.tensor(1 << 30, 7)?;
        self.stream.synchronize()?;
        let mut children = Vec::new();
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for (child, sender, acks) in peers {
            children.push(child);
            senders.push(sender);
            receivers.push(acks);
        }
        let broadcast = Broadcast::new(senders);
        // Warm-up: each receiver makes its stream and maps a small tensor, so the figure below is
        // the hand-off's and not the receivers' first use of the GPU.
        broadcast.send_on(&BenchItem { id: 0, tensors: vec![self.tensor(4096, 8)?] }, &self.stream)?;
        for acks in &mut receivers {
            acks.recv()?;
        }
        let used = || -> Result<u64> {
            let (free, total) = self.context.memory_info()?;
            Ok((total - free) as u64)
        };
        let before = used()?;
        let start = monotonic_ns();
        broadcast.send_on(&BenchItem { id: 1, tensors: vec![tensor] }, &self.stream)?;
        let mut last = 0;
        for acks in &mut receivers {
            last = last.max(acks.recv()?.usable_ns);
        }
        let after = used()?;
        drop(broadcast);
        for mut child in children {
            child.wait()?;
        }
        Ok(((last - start) as f64 / 1000.0, after.saturating_sub(before)))
    }
}
