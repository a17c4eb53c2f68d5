//! The benchmark suite: tensor-queue against the anchors, measured in the same run on the same
//! machine. Prints a table of ratios last, writes the full results as JSON and the plots as PNG.
//!
//! `tq-bench [--out DIR] [--floor BIN] [--primitives FILE] [--mps FILE] [--torch SCRIPT] [--python PYTHON] [--only a,b]
//! [--spin-us U] [--capacity C] [--in-flight K] [--items N] [--trips N] [--rtt-runs 1b,1s,16b,16s] [--messages N] [--no-fill]
//! [--no-read]`; on the GPU
//! machine, `bash target/gpu-bundle/bench.sh` (which `cargo xtask bench` runs). Sections:
//! `setup`, `floor` (the C socket floor, and on a GPU the hand-off floor of `handoff_floor.rs`),
//! `torch`, `rtt`, `breakdown`, `stream`, `broadcast`, `cross` (GPU0 -> GPU1 by each route, with its own table printed last; `--cross-anchors SCRIPT` names `cross_anchors.py`, which is
//! otherwise looked for beside `--torch`; see `cross.rs`), `cross-stages` (where one PeerCopy or
//! PeerMap message's time goes, 4 KiB and 1 MiB, beside the cross-GPU hand-off floor; a few
//! seconds; see `cross/stages.rs`), `host-msgs` (`--messages N` small host
//! messages to a receiver process, no GPU needed; see `host_msgs.rs`), `host-many` (one message of
//! 1,024 x 4 KiB host tensors, one-way; no GPU needed; see `host_many.rs`).
//!
//! Every time is the machine's `CLOCK_MONOTONIC` (one clock for all processes), read on the side
//! of the barrier where the data became usable. Without a GPU the same sections run with host
//! tensors (shared memory), and the GPU-only parts say that they were skipped.

mod cross;
mod handoff_floor;
mod host_many;
mod host_msgs;
mod plot;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::queue::{BenchAck, BenchItem, spawn_tq_peer, wait_until};
use integration_tests::{percentile, socket_path};
use ipc_core::{Context, Stream};
use kernels::Kernels;
use plot::Series;
use serde_json::{Value, json};
use tensor_queue::{Broadcast, DType, Receiver, Sender, Tensor, monotonic_ns};

/// Round trips measured after this many unmeasured ones.
const WARMUP: usize = 1000;

/// Command-line options.
struct Options {
    out: PathBuf,
    floor: Option<String>,
    primitives: Option<String>,
    mps: Option<String>,
    torch: Option<String>,
    python: String,
    only: Option<Vec<String>>,
    spin_us: u64,
    capacity: u32,
    in_flight: u64,
    items: u64,
    trips: usize,
    /// Messages per run of section `host-msgs`.
    messages: u64,
    fill: bool,
    read: bool,
    /// Which runs of section `rtt` (`1b`, `1s`, `16b`, `16s`: tensors and blocking or spin);
    /// all by default. For counting one run's system calls (`strace -f -c`).
    rtt_runs: Option<Vec<String>>,
}

impl Options {
    fn parse() -> Result<Options> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
        let number = |name: &str, default: u64| -> Result<u64> {
            value(name).map_or(Ok(default), |v| v.parse().with_context(|| format!("{name} {v}")))
        };
        Ok(Options {
            out: value("--out").map_or_else(|| PathBuf::from("results"), PathBuf::from),
            floor: value("--floor"),
            primitives: value("--primitives"),
            mps: value("--mps"),
            torch: value("--torch"),
            python: value("--python").unwrap_or_else(|| "python3".into()),
            only: value("--only").map(|v| v.split(',').map(str::to_owned).collect()),
            spin_us: number("--spin-us", 1000)?,
            capacity: number("--capacity", 16)? as u32,
            in_flight: number("--in-flight", 4)?,
            items: number("--items", 20_000)?,
            trips: number("--trips", 10_000)? as usize,
            messages: number("--messages", 1_000_000)?,
            fill: !args.iter().any(|a| a == "--no-fill"),
            read: !args.iter().any(|a| a == "--no-read"),
            rtt_runs: value("--rtt-runs").map(|v| v.split(',').map(str::to_owned).collect()),
        })
    }

    fn wants(&self, section: &str) -> bool {
        self.only.as_ref().is_none_or(|only| only.iter().any(|s| s == section))
    }
}

/// One figure of the table.
struct Row {
    name: String,
    value: f64,
    unit: &'static str,
    anchor: String,
    anchor_value: Option<f64>,
    /// Whether a larger value is better (rates) or worse (times, memory).
    larger_is_better: bool,
    /// The target for this figure, if it has one.
    target: Option<f64>,
}

impl Row {
    fn new(name: impl Into<String>, value: f64, unit: &'static str) -> Row {
        Row {
            name: name.into(),
            value,
            unit,
            anchor: "-".into(),
            anchor_value: None,
            larger_is_better: unit == "/s",
            target: None,
        }
    }

    fn against(mut self, anchor: impl Into<String>, value: Option<f64>) -> Row {
        self.anchor = anchor.into();
        self.anchor_value = value;
        self
    }

    fn target(mut self, target: f64) -> Row {
        self.target = Some(target);
        self
    }

    /// Above 1 means tensor-queue is better.
    fn ratio(&self) -> Option<f64> {
        let anchor = self.anchor_value?;
        if self.value == 0.0 || anchor == 0.0 {
            return None;
        }
        Some(if self.larger_is_better { self.value / anchor } else { anchor / self.value })
    }

    fn verdict(&self) -> &'static str {
        match self.target {
            None => "",
            Some(t) if (self.larger_is_better && self.value >= t) || (!self.larger_is_better && self.value <= t) => {
                "met"
            }
            Some(_) => "MISSED",
        }
    }

    fn json(&self) -> Value {
        json!({
            "name": self.name, "value": self.value, "unit": self.unit, "anchor": self.anchor,
            "anchor_value": self.anchor_value, "ratio": self.ratio(), "target": self.target,
            "verdict": self.verdict(),
        })
    }
}

/// Step lines, and a count that updates in place on a terminal (every quarter in a log).
struct Progress {
    step: usize,
    steps: usize,
    tty: bool,
}

impl Progress {
    fn start(&mut self, what: &str) {
        self.step += 1;
        eprintln!("[{}/{}] {what}", self.step, self.steps);
    }

    fn tick(&self, done: usize, total: usize) {
        let every = if self.tty { (total / 50).max(1) } else { (total / 4).max(1) };
        if !done.is_multiple_of(every) || done == 0 {
            return;
        }
        if self.tty {
            eprint!("\r      {done}/{total} ({}%)", done * 100 / total);
        } else {
            eprintln!("      {done}/{total}");
        }
    }

    fn done(&self, summary: &str) {
        if self.tty {
            eprint!("\r\x1b[K");
        }
        eprintln!("      {summary}");
    }
}

/// The GPU side of the producer, when there is a GPU.
struct Gpu {
    context: Arc<Context>,
    stream: Stream,
    kernels: Arc<Kernels>,
}

struct Bench {
    gpu: Option<Gpu>,
    options: Options,
    progress: Progress,
    rows: Vec<Row>,
    json: serde_json::Map<String, Value>,
    latency_plots: Vec<Series>,
    throughput_plots: Vec<Series>,
}

fn main() -> Result<()> {
    integration_tests::init_logging();
    // A consumer process of the cross-device section, or its driver-copy anchor.
    if let Some(result) = cross::child_role() {
        return result;
    }
    if std::env::args().nth(1).as_deref() == Some(handoff_floor::PEER_FLAG) {
        return handoff_floor::peer();
    }
    if std::env::args().nth(1).as_deref() == Some(host_msgs::RECEIVER_FLAG) {
        return host_msgs::receiver();
    }
    if std::env::args().nth(1).as_deref() == Some(host_many::RECEIVER_FLAG) {
        return host_many::receiver();
    }
    let options = Options::parse()?;
    std::fs::create_dir_all(&options.out).with_context(|| format!("creating {}", options.out.display()))?;
    let gpu = match integration_tests::gpu_skip_reason() {
        None => {
            let context = Context::on_ordinal(0)?;
            Some(Gpu { stream: Stream::new(&context)?, kernels: Kernels::get(&context)?, context })
        }
        Some(reason) => {
            eprintln!("tq-bench: {reason}; measuring host tensors only (GPU-only figures are skipped)");
            None
        }
    };
    let machine = machine(gpu.as_ref())?;
    eprintln!("tq-bench on {machine}");
    let sections = [
        "setup",
        "floor",
        "torch",
        "rtt",
        "breakdown",
        "stream",
        "broadcast",
        "cross",
        "cross-stages",
        "host-msgs",
        "host-many",
    ];
    let steps = sections.iter().filter(|s| options.wants(s)).count();
    let mut bench = Bench {
        gpu,
        progress: Progress { step: 0, steps, tty: std::io::stderr().is_terminal() },
        options,
        rows: Vec::new(),
        json: serde_json::Map::new(),
        latency_plots: Vec::new(),
        throughput_plots: Vec::new(),
    };
    bench.json.insert("machine".into(), json!(machine));
    if let Some(path) = &bench.options.primitives {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        bench.json.insert("primitive_costs".into(), json!(text.lines().collect::<Vec<_>>()));
    }
    bench.json.insert(
        "date_unix".into(),
        json!(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs()),
    );
    // Set-up first: this process has allocated and exported nothing yet.
    let mut floor = None;
    let mut torch = None;
    let wanted: Vec<&str> = sections.into_iter().filter(|s| bench.options.wants(s)).collect();
    for section in wanted {
        match section {
            "setup" => bench.setup()?,
            "floor" => floor = bench.floor()?,
            "torch" => torch = bench.torch()?,
            "rtt" => bench.round_trips(floor.as_ref(), torch.as_ref())?,
            "breakdown" => bench.breakdown()?,
            "stream" => bench.streaming(torch.as_ref())?,
            "broadcast" => bench.broadcast()?,
            "cross" => bench.cross()?,
            "cross-stages" => bench.cross_stages()?,
            "host-msgs" => bench.host_msgs()?,
            "host-many" => bench.host_many()?,
            _ => unreachable!(),
        }
    }
    if let Some(path) = bench.options.mps.clone() {
        bench.mps_rows(&path, torch.as_ref())?;
    }
    bench.finish(&machine)
}

fn machine(gpu: Option<&Gpu>) -> Result<String> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let Some(gpu) = gpu else {
        return Ok(format!("no GPU, {cpus} CPUs, host {}", host.trim()));
    };
    let mut driver = 0;
    // SAFETY: a valid out-pointer.
    unsafe { cuda_sys::driver!(cuDriverGetVersion(&mut driver)) }?;
    let device = gpu.context.device();
    let kernel_driver = std::fs::read_to_string("/sys/module/nvidia/version").unwrap_or_default();
    Ok(format!(
        "{} ({}), driver {} (CUDA driver API {driver}), {cpus} CPUs",
        device.name()?,
        device.uuid()?,
        kernel_driver.trim()
    ))
}

/// Runs a program that prints one JSON object last.
fn run_json(mut command: Command) -> Result<Value> {
    let output = command.output().with_context(|| format!("running {command:?}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(output.status.success(), "{command:?} failed: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    let last = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON in the output")?;
    Ok(serde_json::from_str(last)?)
}

/// A peer's next answer; a peer that stops answering fails the run instead of hanging it (its
/// stderr, which this process shares, says why).
fn answer(acks: &mut Receiver<BenchAck>) -> Result<BenchAck> {
    acks.recv_timeout(Duration::from_secs(60)).context("waiting for a benchmark peer's answer")
}

fn field(json: Option<&Value>, key: &str) -> Option<f64> {
    json.and_then(|j| j[key].as_f64())
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// Sorted samples in microseconds as CDF points (at most 1,000 of them).
fn cdf(samples: &[u64]) -> Vec<(f64, f64)> {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let step = (sorted.len() / 1000).max(1);
    let n = sorted.len() as f64;
    sorted.iter().enumerate().step_by(step).map(|(i, &v)| (us(v), (i + 1) as f64 / n)).collect()
}

/// p50, p99 and p99.9 of `samples` in microseconds, as JSON.
fn summary(samples: &mut [u64]) -> Value {
    json!({
        "n": samples.len(),
        "p50_us": us(percentile(samples, 50.0)),
        "p99_us": us(percentile(samples, 99.0)),
        "p999_us": us(percentile(samples, 99.9)),
    })
}

impl Bench {
    /// A `tq-peer` in `role`; its receiver and ours, and both senders, spin for `spin_us` before
    /// sleeping.
    fn peer(&self, role: &str, spin_us: u64, extra: &[&str]) -> Result<(Child, Sender<BenchItem>, Receiver<BenchAck>)> {
        let spin = spin_us.to_string();
        let args: Vec<&str> = ["--spin-us", spin.as_str()].into_iter().chain(extra.iter().copied()).collect();
        let (child, sender, mut acks) = spawn_tq_peer(role, &args, &[])?;
        acks.set_spin(Duration::from_micros(spin_us));
        sender.set_spin(Duration::from_micros(spin_us));
        Ok((child, sender, acks))
    }

    /// A fresh tensor of `bytes` from the arena, written on the GPU (or, for host tensors, its
    /// first word written on the CPU).
    fn tensor(&self, bytes: u64, seed: u64) -> Result<Tensor> {
        match &self.gpu {
            Some(gpu) => {
                let tensor = Tensor::empty_cuda(&gpu.context, DType::U8, &[bytes])?;
                if self.options.fill {
                    gpu.kernels.fill(&tensor.cuda_view()?, 0, bytes as usize, seed, &gpu.stream)?;
                }
                Ok(tensor)
            }
            None => {
                let tensor = Tensor::zeros(DType::U8, &[bytes])?;
                tensor.set::<u8>(&[0], seed as u8)?;
                Ok(tensor)
            }
        }
    }

    fn send(&self, sender: &Sender<BenchItem>, item: &BenchItem) -> Result<()> {
        match &self.gpu {
            Some(gpu) => sender.send_on(item, &gpu.stream)?,
            None => sender.send(item)?,
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        if let Some(gpu) = &self.gpu {
            gpu.stream.synchronize()?;
        }
        Ok(())
    }

    fn finish_peer(child: &mut Child, sender: Sender<BenchItem>) -> Result<()> {
        drop(sender);
        if !child.wait()?.success() {
            bail!("a benchmark peer failed");
        }
        Ok(())
    }

    /// Set-up: the first allocation (a chunk made and exported), then new channels to a running
    /// receiver: connect, first message (chunk and event announced and imported), usable.
    fn setup(&mut self) -> Result<()> {
        self.progress.start("set-up: first allocation, then the first message on 21 new channels");
        let start = Instant::now();
        let first = self.tensor(4096, 1)?;
        self.synchronize()?;
        let allocation_us = start.elapsed().as_secs_f64() * 1e6;
        let path = socket_path("setup");
        let reply = socket_path("setup-reply");
        let mut acks = Receiver::<BenchAck>::bind(&reply)?;
        acks.set_spin(Duration::from_micros(self.options.spin_us));
        let mut command = Command::new(integration_tests::bin_path("tq-peer")?);
        command.args(["usable", "--reply"]).arg(&reply).arg("--listen").arg(&path);
        command.args(["--spin-us", &self.options.spin_us.to_string()]);
        let mut child = command.spawn().context("starting tq-peer")?;
        ensure!(answer(&mut acks)?.id == u64::MAX, "the peer did not say it listens");
        // Holds the receiver's accept loop open between the measured channels.
        let keeper = Sender::<BenchItem>::connect(&path)?;
        let names = ["connect", "send call", "to arrival", "ordering", "decode", "until usable"];
        let mut stages: Vec<Vec<u64>> = vec![Vec::new(); names.len() + 1];
        for round in 0..21 {
            let t0 = monotonic_ns();
            let sender = Sender::<BenchItem>::connect(&path)?;
            let connected = monotonic_ns();
            self.send(&sender, &BenchItem { id: round, tensors: vec![first.clone()] })?;
            let ack = answer(&mut acks)?;
            ensure!(ack.id == round && ack.stages_ns.len() == 5, "unexpected answer {ack:?}");
            let [_, encoded, arrived, imported, decoded] = ack.stages_ns[..] else { unreachable!() };
            let marks = [t0, connected, encoded, arrived, imported, decoded, ack.usable_ns];
            for (i, pair) in marks.windows(2).enumerate() {
                stages[i].push(pair[1].saturating_sub(pair[0]));
            }
            stages[names.len()].push(ack.usable_ns - t0);
            wait_until("the first message's lease", || sender.outstanding_leases() == 0)?;
            self.progress.tick(round as usize + 1, 21);
        }
        drop(keeper);
        child.wait()?;
        let first_total = us(stages[names.len()][0]);
        let mut later: Vec<u64> = stages[names.len()][1..].to_vec();
        let later_p50 = us(percentile(&mut later, 50.0));
        let breakdown: Vec<Value> = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mut rest = stages[i][1..].to_vec();
                json!({ "stage": name, "first_us": us(stages[i][0]), "later_p50_us": us(percentile(&mut rest, 50.0)) })
            })
            .collect();
        let line = names.iter().enumerate().map(|(i, n)| format!("{n} {:.0}", us(stages[i][0]))).collect::<Vec<_>>();
        self.progress.done(&format!(
            "first message {first_total:.0} us ({} us); later channels p50 {later_p50:.0} us",
            line.join(", ")
        ));
        self.rows.push(Row::new("first allocation (64 MiB chunk made + exported)", allocation_us, "us"));
        self.rows.push(
            Row::new("first message on a new channel", first_total, "us")
                .against("before the route work 583-909 us", Some(909.0))
                .target(1000.0),
        );
        // Its parts (issue 26): connect, the sender's first send call, and the receiver's side
        // (to arrival, ordering, decode, until usable), each on the first channel.
        let receive_first: u64 = (2..names.len()).map(|i| stages[i][0]).sum();
        self.rows.push(Row::new("first message: connect", us(stages[0][0]), "us"));
        self.rows.push(Row::new("first message: first send call", us(stages[1][0]), "us"));
        self.rows.push(Row::new("first message: first receive (arrival to usable)", us(receive_first), "us"));
        self.rows.push(Row::new("first message, later new channels, p50", later_p50, "us").target(2000.0));
        self.json.insert("setup".into(), json!({ "allocation_us": allocation_us, "first_us": first_total, "later_p50_us": later_p50, "stages": breakdown }));
        Ok(())
    }

    fn floor(&mut self) -> Result<Option<Value>> {
        self.progress.start("C socket floor (blocking, then spinning)");
        let Some(floor) = &self.options.floor else {
            self.progress.done("skipped: no --floor");
            return Ok(None);
        };
        let mut value = run_json(Command::new(floor))?;
        self.json.insert("socket_floor".into(), value.clone());
        let mut done = format!("p50 {} us, spinning p50 {} us", value["p50_us"], value["spin_p50_us"]);
        // A failed hand-off floor costs its rows, not the run's other sections.
        match self.gpu.as_ref().map(|gpu| handoff_floor::round_trips(&gpu.context)) {
            None => {}
            Some(Err(error)) => done += &format!("; the hand-off floor failed: {error:#}"),
            Some(Ok(handoff)) => {
                done += &format!(
                    "; with the hand-off's GPU work (stream write, wait, release write): p50 {:.2} us, spinning p50 {:.2} us",
                    handoff["p50_us"].as_f64().unwrap_or(0.0),
                    handoff["spin_p50_us"].as_f64().unwrap_or(0.0)
                );
                self.json.insert("handoff_floor".into(), handoff.clone());
                value["handoff"] = handoff;
            }
        }
        self.progress.done(&done);
        Ok(Some(value))
    }

    fn torch(&mut self) -> Result<Option<Value>> {
        self.progress.start("PyTorch torch.multiprocessing anchors (a minute or two)");
        let Some(script) = self.options.torch.clone().filter(|_| self.gpu.is_some()) else {
            self.progress.done("skipped: no GPU or no --torch");
            return Ok(None);
        };
        let mut command = Command::new(&self.options.python);
        command.arg(script);
        let value = run_json(command)?;
        self.progress.done(&format!(
            "SimpleQueue p50 {} us; Queue {} items/s",
            value["simplequeue_rtt_p50_us"], value["queue_items_per_s"]
        ));
        if let Some(quantiles) = value["simplequeue_rtt_quantiles_us"].as_array() {
            let n = quantiles.len().max(2) as f64 - 1.0;
            let points = quantiles.iter().enumerate().filter_map(|(i, q)| Some((q.as_f64()?, i as f64 / n))).collect();
            self.latency_plots.push(Series { label: "torch SimpleQueue, 1 x 4 KB".into(), points });
        }
        self.json.insert("torch".into(), value.clone());
        Ok(Some(value))
    }

    /// Round-trip times in nanoseconds of messages with `count` 4 KB tensors.
    fn trips(&mut self, count: usize, spin: bool) -> Result<Vec<u64>> {
        let spin_us = if spin { self.options.spin_us } else { 0 };
        let (mut child, sender, mut acks) = self.peer("echo", spin_us, &[])?;
        let tensors = (0..count).map(|i| self.tensor(4096, i as u64)).collect::<Result<Vec<_>>>()?;
        self.synchronize()?;
        let total = self.options.trips + WARMUP;
        let mut times = Vec::with_capacity(self.options.trips);
        for id in 0..total as u64 {
            let start = monotonic_ns();
            self.send(&sender, &BenchItem { id, tensors: tensors.clone() })?;
            ensure!(answer(&mut acks)?.id == id, "answers out of order");
            if id >= WARMUP as u64 {
                times.push(monotonic_ns() - start);
            }
            self.progress.tick(id as usize + 1, total);
        }
        Bench::finish_peer(&mut child, sender)?;
        Ok(times)
    }

    fn round_trips(&mut self, floor: Option<&Value>, torch: Option<&Value>) -> Result<()> {
        self.progress.start("round trips: 1 and 16 x 4 KB, blocking and spin-wait receivers");
        let mut runs = Vec::new();
        for (count, spin) in [(1, false), (1, true), (16, false), (16, true)] {
            let mode = if spin { "spin" } else { "blocking" };
            let run = format!("{count}{}", if spin { 's' } else { 'b' });
            if self.options.rtt_runs.as_ref().is_some_and(|runs| !runs.contains(&run)) {
                continue;
            }
            eprintln!("      {count} x 4 KB, {mode} receivers");
            let mut times = self.trips(count, spin)?;
            let stats = summary(&mut times);
            self.latency_plots
                .push(Series { label: format!("tensor-queue, {count} x 4 KB, {mode}"), points: cdf(&times) });
            runs.push((count, spin, stats));
        }
        let get = |count: usize, spin: bool, key: &str| {
            runs.iter().find(|(c, s, _)| *c == count && *s == spin).and_then(|(_, _, v)| v[key].as_f64()).unwrap_or(0.0)
        };
        self.progress.done(&format!(
            "1 x 4 KB p50 {:.1} us blocking, {:.1} us spinning",
            get(1, false, "p50_us"),
            get(1, true, "p50_us")
        ));
        let floor_p50 = field(floor, "p50_us");
        for (spin, mode, floor_key) in [(false, "blocking recv", "p50_us"), (true, "spin-wait recv", "spin_p50_us")] {
            let p50 = get(1, spin, "p50_us");
            self.rows.push(
                Row::new(format!("round trip 1 x 4 KB, {mode}, p50"), p50, "us")
                    .against("torch SimpleQueue p50", field(torch, "simplequeue_rtt_p50_us"))
                    .target(15.0),
            );
            self.rows.push(
                Row::new(format!("round trip 1 x 4 KB, {mode}, p50"), p50, "us")
                    .against("C socket floor, blocking, p50 (target: ratio >= 0.67)", floor_p50)
                    .target(floor_p50.map_or(15.0, |f| 1.5 * f)),
            );
            // Issue 26's rows: same GPU, against the socket floor of the same wait.
            self.rows.push(
                Row::new(format!("round trip 1 x 4 KB, {mode}, p50"), p50, "us")
                    .against(format!("C socket floor, same wait ({floor_key})"), field(floor, floor_key))
                    .target(if spin { 8.0 } else { 20.0 }),
            );
            // The same with the GPU work a stream-ordered hand-off cannot skip (`handoff_floor.rs`).
            self.rows.push(
                Row::new(format!("round trip 1 x 4 KB, {mode}, p50"), p50, "us")
                    .against(
                        format!("GPU hand-off floor: socket + stream write, wait, release write ({floor_key})"),
                        field(floor.map(|f| &f["handoff"]), floor_key),
                    )
                    .target(if spin { 8.0 } else { 20.0 }),
            );
            self.rows.push(
                Row::new(format!("round trip 1 x 4 KB, {mode}, p99"), get(1, spin, "p99_us"), "us")
                    .against("torch SimpleQueue p99", field(torch, "simplequeue_rtt_p99_us"))
                    .target(40.0),
            );
            self.rows.push(
                Row::new(format!("round trip 1 x 4 KB, {mode}, p99.9"), get(1, spin, "p999_us"), "us")
                    .against("torch SimpleQueue p99.9", field(torch, "simplequeue_rtt_p999_us")),
            );
            self.rows.push(
                Row::new(format!("round trip 16 x 4 KB, {mode}, p50"), get(16, spin, "p50_us"), "us")
                    .against("torch SimpleQueue 16 tensors p50", field(torch, "simplequeue_rtt16_p50_us")),
            );
            self.rows.push(
                Row::new(format!("round trip 16 x 4 KB, {mode}, p99"), get(16, spin, "p99_us"), "us")
                    .against("torch SimpleQueue 16 tensors p99", field(torch, "simplequeue_rtt16_p99_us")),
            );
        }
        let json_runs: Vec<Value> =
            runs.iter().map(|(c, s, v)| json!({ "tensors": c, "spin": s, "stats": v })).collect();
        self.json.insert("round_trips".into(), json!(json_runs));
        Ok(())
    }

    /// One hand-off stage by stage (spin-wait receivers), each read on the far side of its
    /// barrier with the shared monotonic clock; the release is timed until the sender sees the
    /// lease back.
    fn breakdown(&mut self) -> Result<()> {
        self.progress.start("per-stage breakdown of one hand-off (2,000 hand-offs)");
        let (mut child, sender, mut acks) = self.peer("echo", self.options.spin_us, &[])?;
        let tensor = self.tensor(4096, 5)?;
        self.synchronize()?;
        let names = [
            "encode (sender)",
            "socket",
            "import + stream wait",
            "decode",
            "answer to sender",
            "release back at sender",
        ];
        let mut stages: Vec<Vec<u64>> = vec![Vec::new(); names.len()];
        let total = 2000 + WARMUP;
        for id in 0..total as u64 {
            self.send(&sender, &BenchItem { id, tensors: vec![tensor.clone()] })?;
            let ack = answer(&mut acks)?;
            let answered = monotonic_ns();
            while sender.outstanding_leases() > 0 {
                std::hint::spin_loop();
            }
            let released = monotonic_ns();
            ensure!(ack.id == id && ack.stages_ns.len() == 5, "unexpected answer {ack:?}");
            if id >= WARMUP as u64 {
                let s = &ack.stages_ns;
                let marks = [
                    s[1] - s[0],
                    s[2] - s[1],
                    s[3] - s[2],
                    s[4] - s[3],
                    answered - ack.usable_ns,
                    released - ack.usable_ns,
                ];
                for (stage, value) in stages.iter_mut().zip(marks) {
                    stage.push(value);
                }
            }
            self.progress.tick(id as usize + 1, total);
        }
        Bench::finish_peer(&mut child, sender)?;
        let rows: Vec<Value> = names
            .iter()
            .zip(&mut stages)
            .map(|(name, values)| json!({ "stage": name, "stats": summary(values) }))
            .collect();
        let line = rows
            .iter()
            .map(|r| {
                format!("{} {:.1}", r["stage"].as_str().unwrap_or(""), r["stats"]["p50_us"].as_f64().unwrap_or(0.0))
            })
            .collect::<Vec<_>>();
        self.progress.done(&format!("p50 us: {}", line.join(", ")));
        for row in &rows {
            let name = format!("stage: {}, p50", row["stage"].as_str().unwrap_or(""));
            self.rows.push(Row::new(name, row["stats"]["p50_us"].as_f64().unwrap_or(0.0), "us"));
        }
        self.json.insert("breakdown".into(), json!(rows));
        Ok(())
    }

    /// Fresh 5 MB tensors as fast as the producer can make them; the consumer makes each usable
    /// and reads it on the GPU without stalling (`tq-peer drain`).
    fn streaming(&mut self, torch: Option<&Value>) -> Result<()> {
        let warmup = 1000u64;
        let items = self.options.items;
        self.progress.start(&format!(
            "streaming {items} fresh 5 MB tensors (after {warmup}), capacity {}, {} reads in flight",
            self.options.capacity, self.options.in_flight
        ));
        let count = (warmup + items).to_string();
        let mut extra = vec!["--count", &count];
        let capacity = self.options.capacity.to_string();
        let in_flight = self.options.in_flight.to_string();
        extra.extend(["--capacity", &capacity, "--in-flight", &in_flight]);
        if !self.options.read {
            extra.push("--no-read");
        }
        let kernel_us = self.kernel_costs()?;
        let (mut child, sender, mut acks) = self.peer("drain", self.options.spin_us, &extra)?;
        let total = (warmup + items) as usize;
        // The producer's CPU time per step, in total: allocate and fill, send.
        let mut producer_ns = [0u64; 2];
        for id in 0..total as u64 {
            let start = monotonic_ns();
            let tensor = self.tensor(5 << 20, id)?;
            let made = monotonic_ns();
            self.send(&sender, &BenchItem { id, tensors: vec![tensor] })?;
            producer_ns[0] += made - start;
            producer_ns[1] += monotonic_ns() - made;
            self.progress.tick(id as usize + 1, total);
        }
        let ack = answer(&mut acks)?;
        let per_item = |ns: u64| (ns as f64 / total as f64 / 100.0).round() / 10.0;
        let cpu = json!({
            "producer": { "allocate_and_fill": per_item(producer_ns[0]), "send": per_item(producer_ns[1]) },
            "consumer": ack.stages_ns.iter().zip(["receive_and_wait", "read", "completion_event", "drop_and_release"])
                .map(|(&ns, name)| (name.to_string(), json!(per_item(ns)))).collect::<serde_json::Map<_, _>>(),
        });
        eprintln!("      CPU us per item: {cpu}");
        Bench::finish_peer(&mut child, sender)?;
        let flat: Vec<i64> = ack.completions.context("no completions")?.to_vec::<i64>()?;
        let completions: Vec<(u64, u64)> = flat.chunks_exact(2).map(|pair| (pair[0] as u64, pair[1] as u64)).collect();
        ensure!(completions.len() == total, "the consumer saw {} of {total} items", completions.len());
        let measured = &completions[warmup as usize..];
        let first_sent = measured.iter().map(|c| c.0).min().unwrap_or(0);
        let last_done = measured.iter().map(|c| c.1).max().unwrap_or(0);
        let rate = measured.len() as f64 / ((last_done - first_sent) as f64 / 1e9);
        let mut latencies: Vec<u64> = measured.iter().map(|&(sent, done)| done - sent).collect();
        let stats = summary(&mut latencies);
        self.progress
            .done(&format!("{rate:.0} items/s, send->read p50 {} us, p99 {} us", stats["p50_us"], stats["p99_us"]));
        // Items finished per 10 ms window.
        let window = 10_000_000u64;
        let mut buckets = vec![0u64; ((last_done - first_sent) / window + 1) as usize];
        for &(_, done) in measured {
            buckets[((done - first_sent) / window) as usize] += 1;
        }
        buckets.pop(); // the last window is partial
        let points = buckets
            .iter()
            .enumerate()
            .map(|(i, &n)| ((i as u64 * window) as f64 / 1e9, n as f64 * 1e9 / window as f64))
            .collect();
        self.throughput_plots.push(Series { label: "tensor-queue, fresh 5 MB tensors".into(), points });
        if let Some(torch_rate) = field(torch, "queue_items_per_s") {
            let end = (last_done - first_sent) as f64 / 1e9;
            self.throughput_plots.push(Series {
                label: "torch mp.Queue (mean of its run)".into(),
                points: vec![(0.0, torch_rate), (end, torch_rate)],
            });
        }
        self.latency_plots
            .push(Series { label: "tensor-queue streaming 5 MB, send -> read done".into(), points: cdf(&latencies) });
        let results = json!({ "items": items, "warmup": warmup, "capacity": self.options.capacity, "in_flight": self.options.in_flight, "fill": self.options.fill, "read": self.options.read, "items_per_s": rate, "latency": stats, "kernel_us": kernel_us, "cpu_us_per_item": cpu });
        self.streaming_rows("stream fresh 5 MB", &results, torch);
        self.json.insert("streaming".into(), results);
        Ok(())
    }

    /// The GPU floor of one streamed item, from this process alone: a 5 MB fill and a 5 MB read,
    /// each launched 500 times back to back on one stream. Per kernel: the CPU's launch call, and
    /// launch and kernel together (whichever is slower). `None` without a GPU.
    fn kernel_costs(&mut self) -> Result<Option<Value>> {
        let Some(gpu) = &self.gpu else { return Ok(None) };
        let bytes = 5usize << 20;
        let tensor = ipc_core::DeviceBuffer::alloc(&gpu.context, bytes)?;
        let counter = ipc_core::DeviceBuffer::alloc(&gpu.context, 8)?;
        let each = |launch: &dyn Fn(u64) -> ipc_core::Result<()>| -> Result<(f64, f64)> {
            launch(0)?;
            gpu.stream.synchronize()?;
            let start = Instant::now();
            for i in 0..500 {
                launch(i)?;
            }
            let launched = start.elapsed();
            gpu.stream.synchronize()?;
            Ok((launched.as_secs_f64() * 1e6 / 500.0, start.elapsed().as_secs_f64() * 1e6 / 500.0))
        };
        let fill = each(&|seed| gpu.kernels.fill(&tensor, 0, bytes, seed, &gpu.stream))?;
        let read = each(&|_| gpu.kernels.read(&tensor, 0, bytes, &counter, &gpu.stream))?;
        eprintln!(
            "      GPU floor per item, back to back in one process: fill 5 MB {:.1} us (launch call {:.1}), read 5 MB {:.1} us (launch call {:.1})",
            fill.1, fill.0, read.1, read.0
        );
        self.rows.push(Row::new("GPU floor: fill 5 MB, back to back", fill.1, "us"));
        self.rows.push(Row::new("GPU floor: read 5 MB, back to back", read.1, "us"));
        Ok(Some(
            json!({ "fill_5mb_us": fill.1, "fill_launch_us": fill.0, "read_5mb_us": read.1, "read_launch_us": read.0 }),
        ))
    }

    /// One 1 GiB tensor to three receivers: the first time (its chunk imported by each), then
    /// again after each rewrite (mapped already: the weight-update case); and the device memory
    /// the receivers' mappings added, as the driver reports it.
    fn broadcast(&mut self) -> Result<()> {
        self.progress.start("broadcast of 1 GiB to 3 receivers: first, then 20 more after rewrites");
        let peers = (0..3).map(|_| self.peer("usable", self.options.spin_us, &[])).collect::<Result<Vec<_>>>()?;
        let mut children = Vec::new();
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for (child, sender, acks) in peers {
            children.push(child);
            senders.push(sender);
            receivers.push(acks);
        }
        let broadcast = Broadcast::new(senders);
        let send = |bench: &Bench, item: &BenchItem| -> Result<()> {
            match &bench.gpu {
                Some(gpu) => broadcast.send_on(item, &gpu.stream)?,
                None => broadcast.send(item)?,
            }
            Ok(())
        };
        // Warm-up: every receiver has had a message, so the figures are the big tensor's.
        send(self, &BenchItem { id: 0, tensors: vec![self.tensor(4096, 8)?] })?;
        for acks in &mut receivers {
            answer(acks)?;
        }
        let mut all_usable = |start: u64| -> Result<u64> {
            let mut last = 0;
            for acks in &mut receivers {
                last = last.max(answer(acks)?.usable_ns);
            }
            Ok(last - start)
        };
        let start = Instant::now();
        let tensor = self.tensor(1 << 30, 7)?;
        self.synchronize()?;
        let allocation_us = start.elapsed().as_secs_f64() * 1e6;
        let used = |bench: &Bench| -> Result<Option<u64>> {
            let Some(gpu) = &bench.gpu else { return Ok(None) };
            let (free, total) = gpu.context.memory_info()?;
            Ok(Some((total - free) as u64))
        };
        let before = used(self)?;
        let start = monotonic_ns();
        send(self, &BenchItem { id: 1, tensors: vec![tensor.clone()] })?;
        let first = all_usable(start)?;
        let extra = used(self)?.zip(before).map(|(after, before)| after.saturating_sub(before));
        let mut again = Vec::new();
        for round in 0..20u64 {
            wait_until("the receivers' leases", || broadcast.senders().iter().all(|s| s.outstanding_leases() == 0))?;
            if let Some(gpu) = &self.gpu {
                gpu.kernels.fill(&tensor.cuda_view()?, 0, 1 << 30, round, &gpu.stream)?;
            }
            self.synchronize()?;
            let start = monotonic_ns();
            send(self, &BenchItem { id: 2 + round, tensors: vec![tensor.clone()] })?;
            again.push(all_usable(start)?);
        }
        drop(broadcast);
        for mut child in children {
            child.wait()?;
        }
        let stats = summary(&mut again);
        let again_p50 = stats["p50_us"].as_f64().unwrap_or(0.0);
        self.progress.done(&format!(
            "first {:.0} us, again p50 {again_p50:.1} us, extra memory {:?} bytes",
            us(first),
            extra
        ));
        let trip = self.json.get("round_trips").and_then(|runs| runs[1]["stats"]["p50_us"].as_f64());
        self.rows.push(Row::new("1 GiB tensor allocated (chunk made + exported)", allocation_us, "us"));
        self.rows.push(
            Row::new("broadcast 1 GiB to 3, first time (3 imports), all usable", us(first), "us")
                .against("1 x 4 KB round trip p50, spin", trip)
                .target(trip.map_or(0.0, |t| 2.0 * t)),
        );
        self.rows.push(
            Row::new("broadcast 1 GiB to 3, mapped already, all usable, p50", again_p50, "us")
                .against("1 x 4 KB round trip p50, spin", trip)
                .target(trip.map_or(0.0, |t| 2.0 * t)),
        );
        if let Some(extra) = extra {
            self.rows.push(
                Row::new("broadcast 1 GiB to 3, extra device memory", extra as f64 / (1 << 20) as f64, "MiB")
                    .against("the tensor itself", Some(1024.0))
                    .target(0.0),
            );
        }
        self.json.insert("broadcast".into(), json!({ "allocation_us": allocation_us, "first_us": us(first), "again": stats, "extra_device_bytes": extra }));
        Ok(())
    }

    /// The streaming figures of a run under MPS (`bench.sh` runs `--only stream` under a private
    /// MPS daemon first), as rows of this table.
    fn mps_rows(&mut self, path: &str, torch: Option<&Value>) -> Result<()> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        let run: Value = serde_json::from_str(&text)?;
        let stream = &run["streaming"];
        let label = format!(
            "under MPS, capacity {}, {} in flight",
            stream["capacity"].as_u64().unwrap_or(0),
            stream["in_flight"].as_u64().unwrap_or(0)
        );
        self.streaming_rows(&format!("stream fresh 5 MB {label}"), stream, torch);
        self.json.insert("streaming_mps".into(), stream.clone());
        Ok(())
    }

    /// The table's rows of one streaming run (`results` as in `bench.json`), named `name`.
    fn streaming_rows(&mut self, name: &str, results: &Value, torch: Option<&Value>) {
        let number = |value: &Value| value.as_f64().unwrap_or(0.0);
        self.rows.push(
            Row::new(format!("{name}, items/s"), number(&results["items_per_s"]), "/s")
                .against("torch mp.Queue items/s", field(torch, "queue_items_per_s"))
                .target(100_000.0),
        );
        self.rows.push(
            Row::new(format!("{name}, send->usable+read p50"), number(&results["latency"]["p50_us"]), "us")
                .against("torch put->usable p50", field(torch, "queue_latency_p50_us")),
        );
        self.rows.push(
            Row::new(format!("{name}, send->usable+read p99"), number(&results["latency"]["p99_us"]), "us")
                .against("torch put->usable p99", field(torch, "queue_latency_p99_us"))
                .target(200.0),
        );
    }

    fn finish(mut self, machine: &str) -> Result<()> {
        self.json.insert("rows".into(), json!(self.rows.iter().map(Row::json).collect::<Vec<_>>()));
        let cross = self.json.get("cross").cloned();
        let cross_stages = self.json.get("cross_stages").cloned();
        let out = &self.options.out;
        std::fs::write(out.join("bench.json"), serde_json::to_string_pretty(&Value::Object(self.json))?)?;
        let title = |what: &str| format!("{what} ({})", machine.split(" (").next().unwrap_or(machine));
        plot::latency_cdf(&out.join("latency.png"), &title("hand-off latency"), &self.latency_plots)?;
        plot::throughput(&out.join("throughput.png"), &title("streaming 5 MB tensors"), &self.throughput_plots)?;
        eprintln!(
            "results: {}",
            ["bench.json", "latency.png", "throughput.png"].map(|f| out.join(f).display().to_string()).join(", ")
        );
        if self.rows.is_empty() {
            cross::print_stages(cross_stages.as_ref());
            cross::print_table(cross.as_ref());
            return Ok(());
        }
        println!("\ntq-bench on {machine}");
        println!("| measure | tensor-queue | anchor | anchor value | ratio | target |");
        println!("| --- | --- | --- | --- | --- | --- |");
        for row in &self.rows {
            let anchor = row.anchor_value.map_or("-".into(), |v| format!("{v:.1}"));
            let ratio = row.ratio().map_or("-".into(), |r| format!("{r:.2}x"));
            let target = row.target.map_or(String::new(), |t| {
                format!("{}{t:.0} {}", if row.larger_is_better { ">= " } else { "<= " }, row.verdict())
            });
            println!(
                "| {} | {:.1} {} | {} | {anchor} | {ratio} | {target} |",
                row.name, row.value, row.unit, row.anchor
            );
        }
        println!("ratio: anchor / ours for times, ours / anchor for rates; above 1 means tensor-queue is better");
        cross::print_stages(cross_stages.as_ref());
        cross::print_table(cross.as_ref());
        Ok(())
    }
}
