//! The across-hosts benchmark (`bench.sh --only hosts`): a channel over TCP between two
//! processes of this machine (a TCP channel always moves tensors as between hosts: GPU tensors by
//! NCCL), against `torch.distributed` NCCL send/recv between two processes with the same NCCL
//! settings, measured in the same run by `cross_anchors.py` (parts `nccl` and `nccl_net`).
//!
//! `tq-hosts [--out DIR] [--anchors SCRIPT] [--python PYTHON]` runs everything twice: with NCCL's
//! default transports, and forced onto its network transport (`NCCL_P2P_DISABLE=1
//! NCCL_SHM_DISABLE=1`, what two hosts use). Each run is a producer process on GPU 0 (started
//! with that environment) that starts its consumer (GPU 1, inheriting it):
//! - one-way, 1 x 1 MiB, 4 MiB, 64 MiB, 1 GiB: from just before `send_on` to the data usable on
//!   GPU 1 (the consumer synchronises the tensor's stream and reads `CLOCK_MONOTONIC`, one clock
//!   for both processes), one message in flight; a small host answer comes back on a second TCP
//!   channel;
//! - a 4 KiB round trip: the consumer sends the received tensor back with `send_on` on its
//!   stream, over NCCL, as the anchor's ping-pong does; the producer synchronises it; once more
//!   inline with both receivers spin-waiting (`Receiver::set_spin`), as the anchor's wait spins;
//! - one message of 1,024 x 4 KiB tensors, one-way, against one 4 MiB tensor, and against its
//!   floor: that 4 MiB message plus the message's in-process serde floor (its 1,024 tensors set
//!   aside and made again with no channel, `testing::serde_floor`, timed in the producer);
//! - small messages inline (issue 26): the 4 KiB round trip and a 1 x 4 KiB one-way message as
//!   above travel inline in their TCP frames by default (the senders' default threshold,
//!   `SenderBuilder::inline_gpu_up_to`); the same again through a second pair of senders built
//!   with the threshold at 0 (NCCL, as before), in the same run. Each checks the path its
//!   tensors came by (`Tcp` and `Nccl`).
//!
//! - the floor of a small message inline, measured by this driver with no channel: a pinned
//!   4 KiB device-to-host copy and its wait, a 64-byte loopback TCP ping-pong, and a pinned
//!   host-to-device copy and its wait (both copies on GPU 0, like GPU 1 in kind); the inline rows
//!   are printed against it too, which says how much of their time is the channel's own;
//! - the 64 MiB and 1 GiB one-way rows against their floor: the anchor's time plus half that
//!   loopback TCP round trip (our receiver reads a message's frame before it takes part in its
//!   NCCL transfer; the anchor's receiver posted its receive before the send).
//!
//! `--quick` takes a few samples of each, up to 64 MiB, without anchors: the GPU tests run it to
//! check that both directions work and that both processes exit cleanly (a program that returns
//! from `main` right after its last message must not crash under NCCL's teardown). The driver
//! exits with an error when a run failed.
//!
//! Targets (issue 13): at least 95% of the anchor's GB/s at 64 MiB and 1 GiB, a 4 KiB round trip
//! at most the anchor's, the 1,024-tensor message within 2x of one 4 MiB message. Host tensors
//! over TCP are measured in every run (a third run where there are two GPUs; the only one
//! without), against a plain loopback TCP stream measured in this process (issue 26: 64 MiB and
//! 1 GiB at least half of its GB/s).

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use integration_tests::{arg, percentile, serde_floor_ns};
use kernels::Kernels;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tensor_queue::route::{Landing, Routing};
use tensor_queue::{Context, DType, Device, Receiver, Secret, Sender, Stream, Tensor, monotonic_ns};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// One-way sizes: (bytes, warm-up, measured).
const SIZES: [(u64, usize, usize); 4] = [(MIB, 5, 50), (4 * MIB, 5, 50), (64 * MIB, 2, 20), (GIB, 1, 5)];
const RTT: (usize, usize) = (100, 1000);
/// A round trip's stages, from the two messages' `MessageInfo`: there (encode, frame, place,
/// wait for data, decode), the consumer's turn (from its `recv` returning the message to its
/// `send_on` of the answer), back (the same five), and the producer's wait for the data.
const RTT_STAGES: [&str; 12] =
    ["encode", "frame", "place", "wait", "decode", "turn", "encode", "frame", "place", "wait", "decode", "sync"];
const MANY: (usize, usize) = (5, 30);
/// 1 x 4 KiB one-way: (warm-up, measured).
const SMALL: (usize, usize) = (20, 200);
const SECRET: &str = "tq-hosts benchmark secret (local)";
/// Set in a producer's environment: host tensors even where there are GPUs.
const HOST_TENSORS_ENV: &str = "TQ_HOSTS_HOST_TENSORS";
/// NCCL's network transport between two processes of one host.
const NET: [(&str, &str); 2] = [("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")];

#[derive(Serialize, Deserialize)]
struct Item {
    id: u64,
    sent_ns: u64,
    /// Send the first tensor back (the round trip) instead of a host answer.
    echo: bool,
    /// Send it back through the consumer's sender whose threshold is 0 (NCCL).
    nccl: bool,
    /// The consumer's receiver spins ([`SPIN`]) from the next message on, or stops spinning.
    spin: bool,
    tensors: Vec<Tensor>,
}

/// How long the spin-wait round trip's receivers (both processes') look for a frame without
/// sleeping (`Receiver::set_spin`), as `tq-bench`'s spin rows do: torch's anchor waits spinning
/// too (the NCCL kernel polls on the GPU, and `torch.cuda.synchronize` spins on the CPU).
const SPIN: Duration = Duration::from_millis(1);

/// Where a one-way message's time goes, p50s in us (one clock for both processes): the
/// producer's `send` call; from before `send` to the consumer's `recv` returning the message;
/// from then to its data usable (the consumer synchronised the tensors' streams). Then the
/// receiver's `MessageInfo` splits the time up to `recv` returning: the sender encoding and
/// routing the message (to `encoded_ns`), its frame written and read (to `arrived_ns`), its
/// tensors placed (`imported_ns`: NCCL receives handed to the worker), waiting for their data to
/// be ordered (`taken_ns`: the worker queued the receives), decoding (`decoded_ns`: a message
/// that waited for an NCCL worker was decoded during the wait, so this is then near zero).
#[derive(Serialize)]
struct Stages {
    send_call_us: f64,
    to_recv_us: f64,
    to_usable_us: f64,
    encode_us: f64,
    frame_us: f64,
    place_us: f64,
    wait_us: f64,
    decode_us: f64,
}

#[derive(Serialize, Deserialize)]
struct Answer {
    id: u64,
    /// When the consumer's `recv` returned the message.
    received_ns: u64,
    usable_ns: u64,
    /// The message's `MessageInfo`: encoded, arrived, imported, taken, decoded.
    info_ns: [u64; 5],
    path: String,
    tensors: Vec<Tensor>,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // SAFETY: set before any thread starts; every role reads it through `Secret::from_env`.
    unsafe { std::env::set_var("TQ_SECRET", SECRET) };
    match arg(&args, "--role").as_deref() {
        Some("producer") => producer(args.iter().any(|a| a == "--quick")),
        Some("consumer") => consumer(&args),
        Some(other) => bail!("unknown role {other}"),
        None => driver(&args),
    }
}

fn gpus() -> i32 {
    if tensor_queue::is_gpu_available() { Device::count().unwrap_or(0) } else { 0 }
}

/// Whether this producer or consumer (which inherits its environment) moves GPU tensors.
fn gpu_tensors() -> bool {
    gpus() >= 2 && std::env::var_os(HOST_TENSORS_ENV).is_none()
}

fn driver(args: &[String]) -> Result<()> {
    let gpu = gpus() >= 2;
    let quick = args.iter().any(|a| a == "--quick");
    let mut runs = Vec::new();
    let host: &[(&str, &str)] = &[(HOST_TENSORS_ENV, "1")];
    let envs: Vec<(&str, &[(&str, &str)])> =
        if gpu { vec![("default", &[]), ("net", &NET), ("host", host)] } else { vec![("host", host)] };
    for (name, env) in envs {
        eprintln!("tq-hosts: {name} transports");
        let output = Command::new(std::env::current_exe()?)
            .args(["--role", "producer"])
            .args(quick.then_some("--quick"))
            .envs(env.iter().copied())
            .stderr(Stdio::inherit())
            .output()?;
        let text = String::from_utf8_lossy(&output.stdout);
        let result = text.lines().rev().find_map(|l| l.strip_prefix("result ")).map(serde_json::from_str::<Value>);
        runs.push((name, match result {
            Some(Ok(value)) if output.status.success() => value,
            _ => json!({ "error": format!("the producer failed ({}): {}", output.status, text.lines().last().unwrap_or("")) }),
        }));
    }
    let anchors = match (gpu && !quick, arg(args, "--anchors")) {
        (true, Some(script)) => {
            let python = arg(args, "--python").unwrap_or_else(|| "python3".into());
            let output = Command::new(python)
                .arg(script)
                .env("CROSS_ANCHOR_PARTS", "nccl,nccl_net")
                .stderr(Stdio::inherit())
                .output()?;
            let text = String::from_utf8_lossy(&output.stdout);
            text.lines().last().and_then(|l| serde_json::from_str(l).ok()).unwrap_or(json!({ "error": "no anchors" }))
        }
        _ => json!({ "skipped": "no anchors script, or fewer than 2 GPUs" }),
    };
    let tcp_gbps = match tcp_stream_gbps() {
        Ok(gbps) => Some(gbps),
        Err(error) => {
            eprintln!("tq-hosts: the plain TCP stream failed: {error:#}");
            None
        }
    };
    let floor = match (gpu && !quick).then(inline_floor) {
        Some(Ok(floor)) => Some(floor),
        Some(Err(error)) => {
            eprintln!("tq-hosts: the inline floor failed: {error:#}");
            None
        }
        None => None,
    };
    let table = table(&runs, &anchors, tcp_gbps, floor.as_ref());
    println!("{table}");
    if let Some(out) = arg(args, "--out") {
        std::fs::create_dir_all(&out)?;
        let inline_floor = floor.map(|f| json!({ "d2h_us": f.d2h_us, "h2d_us": f.h2d_us, "tcp_rtt_us": f.tcp_rtt_us }));
        let all = json!({ "runs": runs.iter().map(|(n, v)| json!({ "name": n, "result": v })).collect::<Vec<_>>(), "anchors": anchors, "tcp_stream_gbps": tcp_gbps, "inline_floor": inline_floor });
        std::fs::write(format!("{out}/hosts.json"), serde_json::to_string_pretty(&all)?)?;
        std::fs::write(format!("{out}/hosts.md"), &table)?;
    }
    if let Some((name, run)) = runs.iter().find(|(_, run)| run.get("error").is_some()) {
        bail!("the {name} run failed: {}", run["error"]);
    }
    Ok(())
}

/// A plain loopback TCP stream between two threads of this process: 1 GiB written in 4 MiB
/// pieces, GB/s from the accept to the last byte read (the anchor of host tensors over TCP).
fn tcp_stream_gbps() -> Result<f64> {
    use std::io::Read as _;
    let total = GIB as usize;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut stream = std::net::TcpStream::connect(address)?;
        let piece = vec![1u8; 4 << 20];
        for _ in 0..total / piece.len() {
            stream.write_all(&piece)?;
        }
        Ok(())
    });
    let (mut stream, _) = listener.accept()?;
    let start = Instant::now();
    let mut buf = vec![0u8; 4 << 20];
    let mut read = 0;
    while read < total {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            bail!("the writer stopped after {read} bytes");
        }
        read += n;
    }
    let seconds = start.elapsed().as_secs_f64();
    writer.join().map_err(|_| anyhow::anyhow!("the writer panicked"))??;
    Ok(total as f64 / seconds / 1e9)
}

/// The floor of a small message inline (`inline_floor`), p50 us: its parts, one way, and a round
/// trip.
struct InlineFloor {
    d2h_us: f64,
    h2d_us: f64,
    tcp_rtt_us: f64,
}

impl InlineFloor {
    /// A pinned device-to-host copy and wait, half a TCP round trip, a pinned host-to-device copy
    /// and wait.
    fn one_way(&self) -> f64 {
        self.d2h_us + self.tcp_rtt_us / 2.0 + self.h2d_us
    }

    fn round_trip(&self) -> f64 {
        2.0 * (self.d2h_us + self.h2d_us) + self.tcp_rtt_us
    }
}

/// What a 4 KiB GPU tensor inline across hosts cannot avoid, measured here with no channel: its
/// copy from GPU 0 into pinned host memory and the wait for it, a 64-byte ping-pong between two
/// threads over loopback TCP (blocking reads, `TCP_NODELAY`), and the copy from pinned memory
/// onto the GPU and the wait for it (p50 of each).
fn inline_floor() -> Result<InlineFloor> {
    use ipc_core::{DeviceBuffer, PinnedHostBuffer};
    use std::io::Read as _;
    const TRIPS: usize = 5000;
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    let (device, host) =
        (DeviceBuffer::alloc(&context, 4 * KIB as usize)?, PinnedHostBuffer::alloc(&context, 4 * KIB as usize)?);
    let copies = |to_host: bool| -> Result<f64> {
        let mut times = Vec::with_capacity(TRIPS);
        for _ in 0..TRIPS {
            let start = monotonic_ns();
            if to_host {
                stream.copy_async(&host, 0, &device, 0, 4 * KIB as usize)?;
            } else {
                stream.copy_async(&device, 0, &host, 0, 4 * KIB as usize)?;
            }
            stream.synchronize()?;
            times.push(monotonic_ns() - start);
        }
        Ok(percentile(&mut times, 50.0) as f64 / 1e3)
    };
    let (d2h_us, h2d_us) = (copies(true)?, copies(false)?);
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut stream = std::net::TcpStream::connect(address)?;
        stream.set_nodelay(true)?;
        let mut packet = [0u8; 64];
        for _ in 0..TRIPS {
            stream.read_exact(&mut packet)?;
            stream.write_all(&packet)?;
        }
        Ok(())
    });
    let (mut socket, _) = listener.accept()?;
    socket.set_nodelay(true)?;
    let mut packet = [0u8; 64];
    let mut times = Vec::with_capacity(TRIPS);
    for _ in 0..TRIPS {
        let start = monotonic_ns();
        socket.write_all(&packet)?;
        socket.read_exact(&mut packet)?;
        times.push(monotonic_ns() - start);
    }
    echo.join().map_err(|_| anyhow::anyhow!("the echo thread panicked"))??;
    Ok(InlineFloor { d2h_us, h2d_us, tcp_rtt_us: percentile(&mut times, 50.0) as f64 / 1e3 })
}

/// The rows of the host-tensor run: one-way GB/s against a plain TCP stream's (`tcp_gbps`).
fn host_rows(run: &Value, tcp_gbps: Option<f64>) -> String {
    let mut out = String::new();
    for (bytes, _, _) in SIZES {
        let ours = run["one_way_us"][bytes.to_string()].as_f64();
        let gbps = ours.map(|us| bytes as f64 / (us * 1e3));
        let ratio = gbps.zip(tcp_gbps).map(|(a, b)| a / b);
        let target = if bytes >= 64 * MIB {
            ratio.map_or("n/a".into(), |r| format!(">= 0.50 {}", if r >= 0.5 { "met" } else { "MISSED" }))
        } else {
            String::new()
        };
        out += &format!(
            "| host | 1 x {} host tensor one-way | {} | {} | (plain loopback TCP stream) | {} | {} | {target} |\n",
            size(bytes),
            fmt(ours),
            fmt(gbps),
            fmt(tcp_gbps),
            fmt2(ratio)
        );
    }
    out += &format!("| host | 4 KiB round trip | {} | | | | | |\n", fmt(run["rtt_4k_us"].as_f64()));
    out += &rtt_stage_rows("host", run);
    out += &format!("| host | 1,024 x 4 KiB one-way | {} | | | | | |\n", fmt(run["many_us"].as_f64()));
    out += &stage_row("host", "1,024 x 4 KiB", &run["stages"]["many"]);
    out += &stage_row("host", "1 x 4 MiB", &run["stages"][(4 * MIB).to_string()]);
    out
}

/// The markdown table: ours against the anchor of the same transports, with the targets.
fn table(runs: &[(&str, Value)], anchors: &Value, tcp_gbps: Option<f64>, floor: Option<&InlineFloor>) -> String {
    let mut out = String::from(
        "| transports | what | tensor-queue p50 | GB/s | torch.distributed NCCL p50 | GB/s | ratio | target |\n|---|---|---|---|---|---|---|---|\n",
    );
    for (name, run) in runs {
        if let Some(error) = run.get("error") {
            out += &format!("| {name} | failed: {error} | | | | | | |\n");
            continue;
        }
        if *name == "host" {
            out += &host_rows(run, tcp_gbps);
            continue;
        }
        let anchor = &anchors[if *name == "net" { "nccl_net" } else { "nccl" }];
        for (bytes, _, _) in SIZES {
            let ours = run["one_way_us"][bytes.to_string()].as_f64();
            let theirs = anchor["one_way_p50_us"][bytes.to_string()].as_f64();
            let gbps = |us: Option<f64>| us.map(|us| bytes as f64 / (us * 1e3));
            let ratio = gbps(ours).zip(gbps(theirs)).map(|(a, b)| a / b);
            let target = if bytes >= 64 * MIB {
                ratio.map_or("n/a".into(), |r| format!(">= 0.95 {}", if r >= 0.95 { "met" } else { "MISSED" }))
            } else {
                String::new()
            };
            out += &format!(
                "| {name} | 1 x {} one-way | {} | {} | {} | {} | {} | {target} |\n",
                size(bytes),
                fmt(ours),
                fmt(gbps(ours)),
                fmt(theirs),
                fmt(gbps(theirs)),
                fmt2(ratio)
            );
            // Our receiver learns of a message from its frame before it can take part in NCCL;
            // the anchor's receive is posted before the send. The floor: the anchor's time plus
            // the frame's way (half the loopback TCP round trip measured in this run).
            if let Some(floor) = floor.filter(|_| bytes >= 64 * MIB) {
                let floor_us = theirs.map(|theirs| theirs + floor.tcp_rtt_us / 2.0);
                let ratio = floor_us.zip(ours).map(|(floor, ours)| floor / ours);
                let verdict = ratio.map_or("n/a", |r| if r >= 0.95 { "met" } else { "MISSED" });
                out += &format!(
                    "| {name} | ... 1 x {} one-way, against its floor: the anchor + half the loopback TCP round trip {:.1} (our receiver hears of the message first) | {} | | {} | | {} | >= 0.95 {verdict} |\n",
                    size(bytes),
                    floor.tcp_rtt_us / 2.0,
                    fmt(ours),
                    fmt(floor_us),
                    fmt2(ratio)
                );
            }
        }
        let against = |ours: Option<f64>, theirs: Option<f64>, target: bool| {
            let ratio = ours.zip(theirs).map(|(a, b)| a / b);
            let verdict = ratio.map_or("n/a", |r| if r <= 1.0 { "met" } else { "MISSED" });
            let target = if target { format!("<= anchor {verdict}") } else { "(before: NCCL)".into() };
            (ratio, target)
        };
        let pingpong = anchor["pingpong_4k_p50_us"].as_f64();
        for (key, what, target) in [
            ("rtt_4k_us", "4 KiB round trip, small message inline (default)", true),
            ("rtt_4k_nccl_us", "4 KiB round trip through NCCL (inline_gpu_up_to 0)", false),
            ("rtt_4k_spin_us", "4 KiB round trip inline, spin-wait receivers (torch's anchor waits spinning)", true),
        ] {
            let ours = run[key].as_f64();
            let (ratio, target) = against(ours, pingpong, target);
            out +=
                &format!("| {name} | {what} | {} | | {} | | {} | {target} |\n", fmt(ours), fmt(pingpong), fmt2(ratio));
        }
        if let Some(floor) = floor {
            let ours = run["rtt_4k_us"].as_f64();
            let ratio = ours.map(|ours| ours / floor.round_trip());
            out += &format!(
                "| {name} | 4 KiB round trip inline, against its floor: 2 x (pinned D2H {:.1} + pinned H2D {:.1}, each with its wait) + loopback TCP round trip {:.1} | {} | | {:.1} | | {} | |\n",
                floor.d2h_us,
                floor.h2d_us,
                floor.tcp_rtt_us,
                fmt(ours),
                floor.round_trip(),
                fmt2(ratio)
            );
        }
        out += &rtt_stage_rows(name, run);
        let one_4k = anchor["one_way_p50_us"][(4 * KIB).to_string()].as_f64();
        for (key, what, target) in [
            ("one_way_4k_us", "1 x 4 KiB one-way, small message inline (default)", true),
            ("one_way_4k_nccl_us", "1 x 4 KiB one-way through NCCL (inline_gpu_up_to 0)", false),
        ] {
            let ours = run[key].as_f64();
            let (ratio, target) = against(ours, one_4k, target);
            out += &format!("| {name} | {what} | {} | | {} | | {} | {target} |\n", fmt(ours), fmt(one_4k), fmt2(ratio));
        }
        if let Some(floor) = floor {
            let ours = run["one_way_4k_us"].as_f64();
            out += &format!(
                "| {name} | 1 x 4 KiB one-way inline, against its floor (D2H + half the TCP round trip + H2D) | {} | | {:.1} | | {} | |\n",
                fmt(ours),
                floor.one_way(),
                fmt2(ours.map(|ours| ours / floor.one_way()))
            );
        }
        let (many, one) = (run["many_us"].as_f64(), run["one_way_us"][(4 * MIB).to_string()].as_f64());
        let ratio = many.zip(one).map(|(a, b)| a / b);
        let verdict = ratio.map_or("n/a", |r| if r <= 2.0 { "met" } else { "MISSED" });
        out += &format!(
            "| {name} | 1,024 x 4 KiB one-way | {} | | (ours, 1 x 4 MiB) {} | | {} | <= 2x {verdict} |\n",
            fmt(many),
            fmt(one),
            fmt2(ratio)
        );
        if let Some(floor) = run["many_floor_us"].as_f64().zip(one).map(|(serde, one)| serde + one) {
            out += &format!(
                "| {name} | 1,024 x 4 KiB one-way, against its floor: ours 1 x 4 MiB + the message's in-process serde floor {} (1,024 tensors set aside and made again, no channel) | {} | | {:.1} | | {} | |\n",
                fmt(run["many_floor_us"].as_f64()),
                fmt(many),
                floor,
                fmt2(many.map(|many| many / floor))
            );
        }
        out += &stage_row(name, "1,024 x 4 KiB", &run["stages"]["many"]);
        out += &stage_row(name, "1 x 4 MiB", &run["stages"][(4 * MIB).to_string()]);
    }
    out
}

/// The rows of the 4 KiB round trips' stages (see [`RTT_STAGES`]).
fn rtt_stage_rows(name: &str, run: &Value) -> String {
    let mut out = String::new();
    for (key, what) in [
        ("rtt_4k_us_stages", "inline"),
        ("rtt_4k_nccl_us_stages", "through NCCL"),
        ("rtt_4k_spin_us_stages", "inline, spin-wait receivers"),
    ] {
        if let Some(p50s) = run[key].as_array() {
            let p50s: Vec<String> = p50s.iter().map(|us| fmt(us.as_f64())).collect();
            out += &format!(
                "| {name} | ... 4 KiB round trip {what}, stages p50: there {} / turn / back {} / sync | {} / {} / {} | | | | | |\n",
                RTT_STAGES[..5].join(" / "),
                RTT_STAGES[6..11].join(" / "),
                p50s[..5].join(" / "),
                p50s[5..11].join(" / "),
                p50s[11],
            );
        }
    }
    out
}

/// A row of a one-way message's stages (see [`Stages`]).
fn stage_row(name: &str, what: &str, stages: &Value) -> String {
    let us = |key: &str| fmt(stages[key].as_f64());
    format!(
        "| {name} | ... {what}, stages p50: send call / sent to received / received to usable | {} / {} / {} us | | | | | |\n\
         | {name} | ... {what}, to received p50: encode / frame / place / wait for data / decode | {} / {} / {} / {} / {} us | | | | | |\n",
        us("send_call_us"),
        us("to_recv_us"),
        us("to_usable_us"),
        us("encode_us"),
        us("frame_us"),
        us("place_us"),
        us("wait_us"),
        us("decode_us"),
    )
}

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= GIB => format!("{} GiB", b / GIB),
        b if b >= MIB => format!("{} MiB", b / MIB),
        b => format!("{} KiB", b / KIB),
    }
}

fn fmt(value: Option<f64>) -> String {
    value.map_or("-".into(), |v| format!("{v:.1}"))
}

/// Ratios to two places: the targets (0.95) sit in the second.
fn fmt2(value: Option<f64>) -> String {
    value.map_or("-".into(), |v| format!("{v:.2}"))
}

/// The producer: binds the answers' receiver, starts the consumer, measures, prints `result`.
fn producer(quick: bool) -> Result<()> {
    let gpu = gpu_tensors();
    let context = if gpu { Some(Context::on_ordinal(0)?) } else { None };
    let land = |ordinal: i32| -> Result<Routing> {
        Ok(if gpu {
            Routing::default().land(Landing::Device(Device::get(ordinal)?.uuid()?))
        } else {
            Routing::default()
        })
    };
    // Both receivers have the default capacity, as users' do: one message is in flight at a time
    // anyway, and credits go back every half capacity (a capacity of 2 wrote one per message).
    let mut answers = Receiver::<Answer>::builder().routing(land(0)?).bind("tcp://127.0.0.1:0")?;
    let reply = format!("tcp://{}", answers.local_addr().context("bound to TCP")?);
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--role", "consumer", "--reply", &reply])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let endpoint = loop {
        let line = lines.next().context("the consumer ended before it listened")??;
        if let Some(endpoint) = line.strip_prefix("listening ") {
            break endpoint.to_string();
        }
    };
    let items = Sender::<Item>::builder()
        .secret(Secret::from_env()?)
        .timeout(Duration::from_secs(30))
        .connect(endpoint.as_str())?;
    // The same channel's receiver, from a sender whose small messages still go through NCCL.
    let items_nccl = Sender::<Item>::builder()
        .secret(Secret::from_env()?)
        .timeout(Duration::from_secs(30))
        .inline_gpu_up_to(0)
        .connect(endpoint.as_str())?;
    let stream = match &context {
        Some(context) => Some(Stream::new(context)?),
        None => None,
    };
    let make = |bytes: u64| -> Result<Tensor> {
        match (&context, &stream) {
            (Some(context), Some(stream)) => {
                let t = Tensor::empty_cuda(context, DType::U8, &[bytes])?;
                Kernels::get(context)?.fill(&t.cuda_view()?, 0, bytes as usize, bytes, stream)?;
                Ok(t)
            }
            _ => Ok(Tensor::zeros(DType::U8, &[bytes])?),
        }
    };
    let send = |item: &Item| -> Result<()> {
        let sender = if item.nccl { &items_nccl } else { &items };
        match &stream {
            Some(stream) => sender.send_on(item, stream)?,
            None => sender.send(item)?,
        }
        Ok(())
    };
    let mut id = 0u64;
    // One-way messages of `tensors` (through `items_nccl` with `nccl`); the p50 in us, the
    // path the first tensor came by, and the stages' p50s (see `Stages`).
    let mut one_way_by =
        |tensors: Vec<Tensor>, (warmup, trips): (usize, usize), nccl: bool, answers: &mut Receiver<Answer>| {
            let mut times = Vec::with_capacity(trips);
            let [mut send_call, mut to_recv, mut to_usable] = [(); 3].map(|()| Vec::with_capacity(trips));
            // sent -> encoded -> arrived -> imported -> taken -> decoded.
            let mut steps: [Vec<u64>; 5] = [(); 5].map(|()| Vec::with_capacity(trips));
            let mut path = String::new();
            for i in 0..warmup + trips {
                id += 1;
                // The message is made (its tensors cloned) before the clock starts, and dropped
                // after `send` returned: that is the benchmark's work, not the channel's.
                let mut item = Item { id, sent_ns: 0, echo: false, nccl, spin: false, tensors: tensors.clone() };
                let sent_ns = monotonic_ns();
                item.sent_ns = sent_ns;
                send(&item)?;
                let returned_ns = monotonic_ns();
                drop(item);
                let answer = answers.recv_timeout(Duration::from_secs(60))?;
                if answer.id != id {
                    bail!("answer {} for message {id}", answer.id);
                }
                if i >= warmup {
                    times.push(answer.usable_ns - sent_ns);
                    send_call.push(returned_ns - sent_ns);
                    to_recv.push(answer.received_ns.saturating_sub(sent_ns));
                    to_usable.push(answer.usable_ns.saturating_sub(answer.received_ns));
                    let mut from = sent_ns;
                    for (step, &at) in steps.iter_mut().zip(&answer.info_ns) {
                        step.push(at.saturating_sub(from));
                        from = at;
                    }
                }
                path = answer.path;
            }
            let p50 = |samples: &mut Vec<u64>| percentile(samples, 50.0) as f64 / 1e3;
            let stages = Stages {
                send_call_us: p50(&mut send_call),
                to_recv_us: p50(&mut to_recv),
                to_usable_us: p50(&mut to_usable),
                encode_us: p50(&mut steps[0]),
                frame_us: p50(&mut steps[1]),
                place_us: p50(&mut steps[2]),
                wait_us: p50(&mut steps[3]),
                decode_us: p50(&mut steps[4]),
            };
            Ok::<(f64, String, Stages), anyhow::Error>((p50(&mut times), path, stages))
        };
    let mut one_way = |tensors: Vec<Tensor>, counts: (usize, usize), answers: &mut Receiver<Answer>| {
        one_way_by(tensors, counts, false, answers)
    };
    let mut result = json!({ "gpu": gpu, "one_way_us": {}, "stages": {} });
    for (bytes, warmup, trips) in SIZES {
        if quick && bytes > 64 * MIB {
            continue;
        }
        let (warmup, trips) = if quick {
            (0, 2)
        } else if gpu {
            (warmup, trips)
        } else {
            (1, 3)
        };
        let x = make(bytes)?;
        let (us, _, stages) = one_way(vec![x], (warmup, trips), &mut answers)?;
        result["one_way_us"][bytes.to_string()] = json!(us);
        result["stages"][bytes.to_string()] = serde_json::to_value(stages)?;
        eprintln!("tq-hosts: 1 x {} done", size(bytes));
    }
    let many = (0..1024).map(|_| make(4 * KIB)).collect::<Result<Vec<_>>>()?;
    // What any message of these 1,024 tensors costs in this process, with no channel.
    let mut floor = serde_floor_ns(&many, if quick { (1, 3) } else { (50, 500) })?;
    result["many_floor_us"] = json!(percentile(&mut floor, 50.0) as f64 / 1e3);
    let (us, _, stages) = one_way(many, if quick { (0, 1) } else { MANY }, &mut answers)?;
    result["many_us"] = json!(us);
    result["stages"]["many"] = serde_json::to_value(stages)?;
    // 1 x 4 KiB one-way: inline (the default threshold), then through NCCL (threshold 0).
    let small = make(4 * KIB)?;
    let counts = if quick { (1, 3) } else { SMALL };
    for (key, nccl, wanted) in [("one_way_4k_us", false, "Tcp"), ("one_way_4k_nccl_us", true, "Nccl")] {
        let (us, path, _) = one_way_by(vec![small.clone()], counts, nccl, &mut answers)?;
        if gpu && path != wanted {
            bail!("1 x 4 KiB one-way ({key}) came by {path}, not {wanted}");
        }
        result[key] = json!(us);
    }
    // Round trips: the consumer sends the 4 KiB tensor back on its stream: inline both ways
    // (the default threshold), then through NCCL both ways (threshold 0 on both senders).
    let x = make(4 * KIB)?;
    // Last, inline again with both receivers spinning (the consumer's from the first warm-up
    // message on).
    for (key, nccl, spin, wanted) in [
        ("rtt_4k_us", false, false, "Tcp"),
        ("rtt_4k_nccl_us", true, false, "Nccl"),
        ("rtt_4k_spin_us", false, true, "Tcp"),
    ] {
        answers.set_spin(if spin { SPIN } else { Duration::ZERO });
        let mut trips = Vec::new();
        // Where a round trip's time goes (see `RTT_STAGES`), one vector per stage.
        let mut stages: Vec<Vec<u64>> = vec![Vec::new(); RTT_STAGES.len()];
        let (warmup, measured) = if quick { (1, 3) } else { RTT };
        for i in 0..warmup + measured {
            id += 1;
            let start = Instant::now();
            let sent_ns = monotonic_ns();
            send(&Item { id, sent_ns, echo: true, nccl, spin, tensors: vec![x.clone()] })?;
            let (answer, info) = answers.recv_with_info(Some(Duration::from_secs(60)))?;
            if let Some(back) = answer.tensors.first() {
                if let Some(stream) = back.stream() {
                    stream.synchronize()?;
                }
                let (there, back) = (answer.path.as_str(), format!("{:?}", back.path()));
                if gpu && (there != wanted || back != wanted) {
                    bail!("a 4 KiB round trip ({key}) went by {there} and came back by {back}, not {wanted}");
                }
            }
            let end_ns = monotonic_ns();
            if i >= warmup {
                trips.push(start.elapsed().as_nanos() as u64);
                let [e, a, i, t, d] = answer.info_ns;
                let marks = [
                    sent_ns,
                    e,
                    a,
                    i,
                    t,
                    d,
                    info.sent_ns,
                    info.encoded_ns,
                    info.arrived_ns,
                    info.imported_ns,
                    info.taken_ns,
                    info.decoded_ns,
                    end_ns,
                ];
                for (stage, pair) in stages.iter_mut().zip(marks.windows(2)) {
                    stage.push(pair[1].saturating_sub(pair[0]));
                }
            }
        }
        result[key] = json!(percentile(&mut trips, 50.0) as f64 / 1e3);
        let p50s: Vec<f64> = stages.iter_mut().map(|stage| percentile(stage, 50.0) as f64 / 1e3).collect();
        result[format!("{key}_stages")] = json!(p50s);
    }
    drop((items, items_nccl));
    let _ = child.wait();
    println!("result {result}");
    std::io::stdout().flush()?;
    Ok(())
}

/// The consumer: lands on GPU 1, answers each message once its data is usable.
fn consumer(args: &[String]) -> Result<()> {
    let reply = arg(args, "--reply").context("--reply <endpoint>")?;
    let gpu = gpu_tensors();
    let routing =
        if gpu { Routing::default().land(Landing::Device(Device::get(1)?.uuid()?)) } else { Routing::default() };
    if gpu {
        Kernels::get(&Context::on_ordinal(1)?)?; // contexts ready before anything arrives
    }
    let mut items = Receiver::<Item>::builder().routing(routing).bind("tcp://127.0.0.1:0")?;
    println!("listening tcp://{}", items.local_addr().context("bound to TCP")?);
    std::io::stdout().flush()?;
    let answers = Sender::<Answer>::connect(reply.as_str())?;
    let answers_nccl = Sender::<Answer>::builder().inline_gpu_up_to(0).connect(reply.as_str())?;
    loop {
        let (item, info) = match items.recv_with_info(None) {
            Ok(received) => received,
            Err(tensor_queue::Error::Disconnected) => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        let received_ns = monotonic_ns();
        items.set_spin(if item.spin { SPIN } else { Duration::ZERO });
        let info_ns = [info.encoded_ns, info.arrived_ns, info.imported_ns, info.taken_ns, info.decoded_ns];
        let path = item.tensors.first().map(|t| format!("{:?}", t.path())).unwrap_or_default();
        if item.echo {
            let back = item.tensors;
            let sender = if item.nccl { &answers_nccl } else { &answers };
            match back.first().and_then(Tensor::stream).cloned() {
                Some(stream) => sender.send_on(
                    &Answer { id: item.id, received_ns, usable_ns: 0, info_ns, path, tensors: back },
                    &stream,
                )?,
                None => {
                    sender.send(&Answer { id: item.id, received_ns, usable_ns: 0, info_ns, path, tensors: back })?
                }
            }
            continue;
        }
        let mut synchronized: Vec<*const Stream> = Vec::new();
        for stream in item.tensors.iter().filter_map(Tensor::stream) {
            if !synchronized.contains(&std::sync::Arc::as_ptr(stream)) {
                stream.synchronize()?;
                synchronized.push(std::sync::Arc::as_ptr(stream));
            }
        }
        let usable_ns = monotonic_ns();
        answers.send(&Answer { id: item.id, received_ns, usable_ns, info_ns, path, tensors: Vec::new() })?;
    }
}
