//! The cross-device section (`tq-bench --only cross`): GPU0 -> GPU1 by each route, against
//! anchors measured by the same command in the same run.
//!
//! The producer is this process, on GPU0. Each route gets a consumer process of its own (this
//! binary with [`CONSUMER_FLAG`]) whose receiver lands tensors on GPU1 as the route asks:
//! - `copy`: `Routing::default().land(Landing::Device(gpu1))` (PeerCopy);
//! - `map`: the same with `.peer(PeerMode::Map)` (PeerMap);
//! - `stage`: the same with `.peer(PeerMode::Stage)` (Staged);
//! - `host`: `.land(Landing::Host)` (Host);
//! - `same`: `Landing::AsSent` with the consumer on GPU0 (same GPU, the reference round trip).
//!
//! One-way time: the producer reads `monotonic_ns` just before `send_on` and puts it in the
//! message; the consumer receives, makes the data usable and reads the same clock
//! (`CLOCK_MONOTONIC`, one clock for every process). Usable means: `synchronize` on
//! `t.stream()` (each distinct stream once) for GPU routes; for `map`, a device-to-device copy of
//! the mapped bytes into a GPU1 buffer on `t.stream()`, then `synchronize` (zero-copy bytes are
//! usable once a kernel or copy on GPU1 has read them; tensors lying back to back are copied as
//! one range); for `host`, `recv` returned. The producer reuses its tensors, waits until the
//! consumer gave the previous message back before the next one-way trip, and one message is in
//! flight at a time (capacity 2). Round trips (4 KiB, spinning receivers and senders both sides):
//! from the send call until the consumer's small host answer arrived on a second channel.
//!
//! Anchors: the raw copy engine in one process (`cuMemcpyPeerAsync` + `cuStreamSynchronize`,
//! peer access enabled), the driver's staged peer copy (peer access not enabled, in a fresh
//! process: [`DRIVER_COPY_FLAG`]), a pinned host round (D2H on GPU0, H2D on GPU1, 2 streams,
//! 4 MiB x 4 slots), pinned D2H alone, the hand-off floor with a pull copy (`handoff_floor.rs`:
//! a stream signal, a socket packet, the copy and a sync between two processes, no channel), and
//! `cross_anchors.py` (NCCL send/recv, NCCL without P2P,
//! torch.multiprocessing with `.to('cuda:1')`).

use std::io::{BufRead as _, BufReader, Read as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::{arg, number, percentile, socket_path};
use ipc_core::{DeviceBuffer, Event, PinnedHostBuffer, copy_peer_async};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tensor_queue::route::{Landing, PeerMode, Route, Routing};
use tensor_queue::{Context, Device, DeviceMemory, Error, Sender, Stream, Tensor, TensorDevice, Uuid, monotonic_ns};

use super::{Bench, us};

mod stages;
pub use stages::print_table as print_stages;

/// The hidden first argument of a consumer process.
pub const CONSUMER_FLAG: &str = "--cross-consumer";
/// The hidden first argument of the driver's staged copy anchor (a fresh process).
pub const DRIVER_COPY_FLAG: &str = "--cross-driver-copy";

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// One-way sizes: (bytes, warm-up trips, measured trips).
const SIZES: [(u64, usize, usize); 4] = [(4 * KIB, 20, 200), (MIB, 5, 50), (64 * MIB, 2, 20), (GIB, 1, 5)];
/// The anchors' sizes: the one-way sizes, and 4 MiB (the bytes of 1,024 x 4 KiB, contiguous).
const ANCHOR_SIZES: [(u64, usize, usize); 5] =
    [(4 * KIB, 50, 500), (MIB, 5, 50), (4 * MIB, 5, 50), (64 * MIB, 2, 20), (GIB, 1, 5)];
/// The cross-GPU hand-off floor's sizes: (bytes, warm-up trips, measured trips).
const HANDOFF_FLOOR_SIZES: [(u64, usize, usize); 3] = [(4 * KIB, 200, 2000), (MIB, 50, 500), (64 * MIB, 5, 50)];
/// 4 KiB round trips.
const RTT_WARMUP: usize = 200;
const RTT_TRIPS: usize = 2000;
/// Messages of 1,024 x 4 KiB tensors.
const MANY: usize = 1024;
const MANY_WARMUP: usize = 5;
const MANY_TRIPS: usize = 30;
/// The pinned host round's slots.
const RING_CHUNK: u64 = 4 * MIB;
const RING_SLOTS: usize = 4;
/// The longest wait for one answer of a consumer (the slowest expected is well under a second).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(20);
/// The longest wait for a consumer to start and take its channel.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// A consumer or the driver-copy child aborts itself after this long.
const CHILD_DEADLINE: Duration = Duration::from_secs(300);
/// `cross_anchors.py` is killed (its whole process group) after this long at most; less when
/// the section has used its time ([`SECTION_BUDGET`]).
const PYTHON_TIMEOUT: Duration = Duration::from_secs(240);
/// The whole section should end within this: routes not started by `ROUTES_BUDGET` are skipped,
/// and the Python anchors get what is left (at least 30 s).
const SECTION_BUDGET: Duration = Duration::from_secs(420);
const ROUTES_BUDGET: Duration = Duration::from_secs(240);

/// One message: tensors, and the producer's clock at the send call.
#[derive(Serialize, Deserialize)]
struct CrossMsg {
    id: u64,
    sent_ns: u64,
    tensors: Vec<Tensor>,
}

/// A consumer's answer (`id == u64::MAX`: it is ready).
#[derive(Debug, Default, Serialize, Deserialize)]
struct CrossAck {
    id: u64,
    usable_ns: u64,
    /// `TransferPath` of the first tensor, as `Debug` text.
    path: String,
    /// Where the first tensor's bytes are, and the GPU of its stream (`host` / `none`).
    device: String,
    stream_device: String,
    /// The message's stages on the shared clock (`MessageInfo`): sent, encoded, arrived,
    /// imported, decoded (`recv` returned).
    stages_ns: Vec<u64>,
    /// Why the consumer failed (it exits after saying so).
    error: String,
}

/// The routes measured, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    Copy,
    Map,
    Stage,
    Host,
    Same,
}

const WAYS: [Way; 5] = [Way::Copy, Way::Map, Way::Stage, Way::Host, Way::Same];

impl Way {
    fn arg(self) -> &'static str {
        match self {
            Way::Copy => "copy",
            Way::Map => "map",
            Way::Stage => "stage",
            Way::Host => "host",
            Way::Same => "same",
        }
    }

    fn parse(text: &str) -> Result<Way> {
        WAYS.into_iter().find(|w| w.arg() == text).with_context(|| format!("--route {text}: copy|map|stage|host|same"))
    }

    fn label(self) -> &'static str {
        match self {
            Way::Copy => "PeerCopy",
            Way::Map => "PeerMap",
            Way::Stage => "Staged",
            Way::Host => "Host",
            Way::Same => "same GPU",
        }
    }

    fn expected_route(self) -> Route {
        match self {
            Way::Copy => Route::PeerCopy,
            Way::Map => Route::PeerMap,
            Way::Stage => Route::Staged,
            Way::Host => Route::Host,
            Way::Same => Route::SameDevice,
        }
    }

    fn expected_paths(self) -> &'static [&'static str] {
        match self {
            Way::Copy => &["PeerCopied"],
            Way::Map => &["PeerMapped"],
            Way::Stage => &["Staged"],
            Way::Host => &["StagedToHost"],
            Way::Same => &["CudaVmm", "CudaLegacyIpc"],
        }
    }

    /// The consumer's policy; `land` is GPU1 (GPU0 for `same`).
    fn routing(self, land: Uuid) -> Routing {
        let on_land = Routing::default().land(Landing::Device(land));
        match self {
            Way::Copy => on_land,
            Way::Map => on_land.peer(PeerMode::Map),
            Way::Stage => on_land.peer(PeerMode::Stage),
            Way::Host => Routing::default().land(Landing::Host),
            Way::Same => Routing::default(),
        }
    }
}

fn size_name(bytes: u64) -> String {
    match bytes {
        b if b >= GIB && b % GIB == 0 => format!("{} GiB", b / GIB),
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b => format!("{} KiB", b / KIB),
    }
}

fn p50_us(samples: &mut [u64]) -> f64 {
    us(percentile(samples, 50.0))
}

/// Runs a hidden role when this process was started as one; `None` for an ordinary run.
pub fn child_role() -> Option<Result<()>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first()?.clone();
    if role != CONSUMER_FLAG && role != DRIVER_COPY_FLAG {
        return None;
    }
    std::thread::spawn(move || {
        std::thread::sleep(CHILD_DEADLINE);
        eprintln!("tq-bench {role}: still running after {CHILD_DEADLINE:?}; aborting");
        std::process::abort();
    });
    Some(if args[0] == CONSUMER_FLAG { consumer(&args) } else { driver_copy() })
}

// ---------------------------------------------------------------- the consumer process

/// A range of device memory made of tensors lying back to back (every byte of it is some
/// tensor's, so all of it is mapped).
struct Span {
    ptr: u64,
    len: usize,
    context: Arc<Context>,
}

impl DeviceMemory for Span {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

fn consumer(args: &[String]) -> Result<()> {
    let reply = arg(args, "--reply").context("--reply <path>")?;
    let way = Way::parse(&arg(args, "--route").context("--route <way>")?)?;
    let land: Uuid = arg(args, "--gpu").context("--gpu <uuid>")?.parse()?;
    let spin = Duration::from_micros(number(args, "--spin-us", 0)?);
    let capacity = number(args, "--capacity", 2)? as u32;
    let acks = Sender::<CrossAck>::connect(&reply)?;
    acks.set_spin(spin);
    let fail = |acks: &Sender<CrossAck>, id: u64, error: anyhow::Error| -> Result<()> {
        let _ = acks.send(&CrossAck { id, error: format!("{error:#}"), ..Default::default() });
        Err(error)
    };
    // Ready before anything arrives: contexts, the stream received tensors are ordered on.
    let set_up = || -> Result<(tensor_queue::Receiver<CrossMsg>, Option<Arc<Context>>)> {
        let context = if way == Way::Host { None } else { Some(Context::primary(Device::by_uuid(&land)?)?) };
        let mut items = tensor_queue::Receiver::<CrossMsg>::builder()
            .capacity(capacity)
            .routing(way.routing(land))
            .from_parent()?;
        items.set_spin(spin);
        if let Some(context) = &context {
            items.set_stream(Arc::new(Stream::new(context)?))?;
        }
        Ok((items, context))
    };
    let (mut items, context) = match set_up() {
        Ok(ready) => ready,
        Err(error) => return fail(&acks, u64::MAX, error),
    };
    acks.send(&CrossAck { id: u64::MAX, ..Default::default() })?;
    let mut copy_to: Option<DeviceBuffer> = None;
    loop {
        let (msg, info) = match items.recv_with_info(Some(Duration::from_secs(1))) {
            Ok(received) => received,
            Err(Error::Timeout) => {
                items.take_errors().iter().for_each(|e| eprintln!("tq-bench cross consumer: {e}"));
                continue;
            }
            Err(Error::Disconnected) => return Ok(()),
            Err(error) => return fail(&acks, 0, anyhow::Error::from(error).context("recv")),
        };
        let stages_ns = vec![info.sent_ns, info.encoded_ns, info.arrived_ns, info.imported_ns, info.decoded_ns];
        let usable = if way == Way::Map {
            read_on_gpu(&msg.tensors, context.as_ref(), &mut copy_to)
        } else {
            synchronize_streams(&msg.tensors)
        };
        if let Err(error) = usable {
            return fail(&acks, msg.id, error.context("making the message usable"));
        }
        // Read before the answer's text is made: the UUID look-up is a driver call per message,
        // no part of making the data usable.
        let mut ack = CrossAck { id: msg.id, stages_ns, usable_ns: monotonic_ns(), ..Default::default() };
        if let Some(first) = msg.tensors.first() {
            ack.path = format!("{:?}", first.path());
            ack.device = device_text(first.device());
            ack.stream_device = first
                .stream()
                .map_or("none".into(), |s| s.context().device().uuid().map_or("?".into(), |u| u.to_string()));
        }
        drop(msg);
        acks.send(&ack)?;
    }
}

fn device_text(device: TensorDevice) -> String {
    match device {
        TensorDevice::Host => "host".into(),
        TensorDevice::Cuda(uuid) => uuid.to_string(),
    }
}

/// `synchronize` on each distinct stream of the message's GPU tensors (host tensors: nothing).
fn synchronize_streams(tensors: &[Tensor]) -> Result<()> {
    let mut done: Vec<&Arc<Stream>> = Vec::new();
    for stream in tensors.iter().filter_map(Tensor::stream) {
        if !done.iter().any(|s| Arc::ptr_eq(s, stream)) {
            stream.synchronize()?;
            done.push(stream);
        }
    }
    Ok(())
}

/// The mapped bytes read on the landing GPU: copied into a buffer there on the tensors' stream
/// (ranges of tensors lying back to back as one copy), then `synchronize`.
fn read_on_gpu(tensors: &[Tensor], context: Option<&Arc<Context>>, copy_to: &mut Option<DeviceBuffer>) -> Result<()> {
    let context = context.context("no landing GPU")?;
    let mut spans: Vec<Span> = Vec::new();
    let mut streams: Vec<&Arc<Stream>> = Vec::new();
    for tensor in tensors {
        if tensor.device() == TensorDevice::Host {
            continue;
        }
        let stream = tensor.stream().context("a received GPU tensor without a stream")?;
        if !streams.iter().any(|s| Arc::ptr_eq(s, stream)) {
            streams.push(stream);
        }
        let view = tensor.cuda_view()?;
        match spans.last_mut() {
            Some(last) if last.ptr + last.len as u64 == view.device_ptr() => last.len += view.len(),
            _ => spans.push(Span { ptr: view.device_ptr(), len: view.len(), context: view.context().clone() }),
        }
    }
    let Some(stream) = streams.first() else { return Ok(()) };
    // Tensors ordered on other streams (none with one stream set): those first.
    for other in &streams[1..] {
        other.synchronize()?;
    }
    let total: usize = spans.iter().map(|s| s.len).sum();
    if copy_to.as_ref().is_none_or(|b| b.len() < total) {
        *copy_to = None;
        *copy_to = Some(DeviceBuffer::alloc(context, total.max(1))?);
    }
    let buffer = copy_to.as_ref().context("no buffer")?;
    let mut offset = 0;
    for span in &spans {
        stream.copy_async(buffer, offset, span, 0, span.len)?;
        offset += span.len;
    }
    stream.synchronize()?;
    Ok(())
}

// ---------------------------------------------------------------- anchors in this process

/// `(bytes, p50 us)` of each size.
type Curve = Vec<(u64, f64)>;

fn curve_json(curve: &Curve) -> Value {
    json!(
        curve
            .iter()
            .map(|&(b, t)| json!({ "bytes": b, "p50_us": t, "gbps": b as f64 / (t * 1e3) }))
            .collect::<Vec<_>>()
    )
}

fn curve_at(curve: Option<&Curve>, bytes: u64) -> Option<f64> {
    curve?.iter().find(|(b, _)| *b == bytes).map(|&(_, t)| t)
}

/// `cuMemcpyPeerAsync` GPU0 -> GPU1 on a GPU0 stream, then `cuStreamSynchronize`, wall clock.
fn peer_copy_curve(src: &DeviceBuffer, dst: &DeviceBuffer, stream: &Stream) -> Result<Curve> {
    let mut curve = Vec::new();
    for (bytes, warmup, trips) in ANCHOR_SIZES {
        let mut times = Vec::with_capacity(trips);
        for i in 0..warmup + trips {
            let start = monotonic_ns();
            copy_peer_async(dst, src, bytes as usize, stream)?;
            stream.synchronize()?;
            if i >= warmup {
                times.push(monotonic_ns() - start);
            }
        }
        curve.push((bytes, p50_us(&mut times)));
    }
    Ok(curve)
}

/// The fresh process of the driver's staged copy: peer access never enabled here.
fn driver_copy() -> Result<()> {
    let (ctx0, ctx1) = (Context::on_ordinal(0)?, Context::on_ordinal(1)?);
    let src = DeviceBuffer::alloc(&ctx0, GIB as usize)?;
    let dst = DeviceBuffer::alloc(&ctx1, GIB as usize)?;
    let stream = Stream::new(&ctx0)?;
    let curve = peer_copy_curve(&src, &dst, &stream)?;
    println!("{}", json!({ "driver_staged_copy": curve_json(&curve) }));
    Ok(())
}

/// Buffers of the in-process anchors.
struct Floors {
    src: DeviceBuffer,
    dst: DeviceBuffer,
    s0: Stream,
    s1: Stream,
    ring: PinnedHostBuffer,
    d2h_done: Vec<Event>,
    h2d_done: Vec<Event>,
}

impl Floors {
    fn new(ctx0: &Arc<Context>, ctx1: &Arc<Context>) -> Result<Floors> {
        Ok(Floors {
            src: DeviceBuffer::alloc(ctx0, GIB as usize)?,
            dst: DeviceBuffer::alloc(ctx1, GIB as usize)?,
            s0: Stream::new(ctx0)?,
            s1: Stream::new(ctx1)?,
            ring: PinnedHostBuffer::alloc(ctx0, (RING_CHUNK as usize) * RING_SLOTS)?,
            d2h_done: (0..RING_SLOTS).map(|_| Event::new(ctx0)).collect::<ipc_core::Result<_>>()?,
            h2d_done: (0..RING_SLOTS).map(|_| Event::new(ctx1)).collect::<ipc_core::Result<_>>()?,
        })
    }

    /// `bytes` GPU0 -> pinned host -> GPU1 in 4 MiB pieces through 4 slots, D2H on a GPU0
    /// stream and H2D on a GPU1 stream, overlapped; with `h2d` false, only the D2H half.
    fn ring_once(&self, bytes: u64, h2d: bool) -> Result<u64> {
        let start = monotonic_ns();
        let mut offset = 0u64;
        let mut piece = 0usize;
        while offset < bytes {
            let len = RING_CHUNK.min(bytes - offset) as usize;
            let slot = piece % RING_SLOTS;
            let at = slot * RING_CHUNK as usize;
            if h2d && piece >= RING_SLOTS {
                self.s0.wait_event(&self.h2d_done[slot])?;
            }
            self.s0.copy_async(&self.ring, at, &self.src, offset as usize, len)?;
            if h2d {
                self.d2h_done[slot].record(&self.s0)?;
                self.s1.wait_event(&self.d2h_done[slot])?;
                self.s1.copy_async(&self.dst, offset as usize, &self.ring, at, len)?;
                self.h2d_done[slot].record(&self.s1)?;
            }
            offset += len as u64;
            piece += 1;
        }
        self.s0.synchronize()?;
        self.s1.synchronize()?;
        Ok(monotonic_ns() - start)
    }

    fn ring_curve(&self, h2d: bool) -> Result<Curve> {
        let mut curve = Vec::new();
        for (bytes, warmup, trips) in ANCHOR_SIZES {
            let mut times = Vec::with_capacity(trips);
            for i in 0..warmup + trips {
                let t = self.ring_once(bytes, h2d)?;
                if i >= warmup {
                    times.push(t);
                }
            }
            curve.push((bytes, p50_us(&mut times)));
        }
        Ok(curve)
    }
}

/// The anchors measured in Rust; a failed one is an error text in its place.
#[derive(Default)]
struct Anchors {
    peer: Option<Curve>,
    driver: Option<Curve>,
    ring: Option<Curve>,
    d2h: Option<Curve>,
    python: Value,
    /// The 1,024 x 4 KiB message encoded and decoded in this process with no channel, p50 us.
    many_floor: Option<f64>,
    /// The hand-off floor with a pull copy (`handoff_floor::cross_one_way`): (bytes, p50 us).
    handoff: Vec<(u64, Option<f64>)>,
    errors: Vec<String>,
}

impl Anchors {
    fn note<T>(&mut self, what: &str, result: Result<T>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(error) => {
                eprintln!("      {what}: FAILED: {error:#}");
                self.errors.push(format!("{what}: {error:#}"));
                None
            }
        }
    }

    fn measure(ctx0: &Arc<Context>, ctx1: &Arc<Context>) -> Anchors {
        let mut anchors = Anchors::default();
        let floors = Floors::new(ctx0, ctx1);
        if let Some(floors) = anchors.note("anchor buffers (1 GiB on each GPU, 16 MiB pinned)", floors) {
            let peer = ctx0.enable_peer_access(ctx1).and_then(|()| ctx1.enable_peer_access(ctx0));
            let peer =
                peer.map_err(anyhow::Error::from).and_then(|()| peer_copy_curve(&floors.src, &floors.dst, &floors.s0));
            anchors.peer = anchors.note("raw cuMemcpyPeerAsync (peer access enabled)", peer);
            for (bytes, warmup, trips) in HANDOFF_FLOOR_SIZES {
                let floor = super::handoff_floor::cross_one_way(ctx0, bytes as usize, warmup, trips);
                let p50 =
                    anchors.note(&format!("hand-off floor, {}", size_name(bytes)), floor).map(|mut t| p50_us(&mut t));
                anchors.handoff.push((bytes, p50));
            }
            anchors.ring = anchors.note("pinned host round", floors.ring_curve(true));
            anchors.d2h = anchors.note("pinned D2H", floors.ring_curve(false));
        }
        let driver = driver_copy_child();
        anchors.driver = anchors.note("driver staged copy (fresh process, no peer access)", driver);
        for (name, curve) in
            [("copy engine", &anchors.peer), ("driver staged", &anchors.driver), ("pinned round", &anchors.ring)]
        {
            if let Some(curve) = curve {
                let line: Vec<String> = curve
                    .iter()
                    .map(|&(b, t)| format!("{} {t:.1} us ({:.1} GB/s)", size_name(b), b as f64 / (t * 1e3)))
                    .collect();
                eprintln!("      {name}: {}", line.join(", "));
            }
        }
        anchors
    }

    fn json(&self) -> Value {
        let curve = |c: &Option<Curve>| c.as_ref().map(curve_json);
        json!({
            "peer_copy": curve(&self.peer), "driver_staged_copy": curve(&self.driver),
            "pinned_round_4mib_x4": curve(&self.ring), "pinned_d2h_4mib_slots": curve(&self.d2h),
            "python": self.python, "errors": self.errors,
        })
    }

    /// A figure of the Python anchors: `part.key.bytes` (or `part.key` with `bytes` 0).
    fn python_at(&self, part: &str, key: &str, bytes: u64) -> Option<f64> {
        let value = &self.python[part][key];
        if bytes == 0 { value.as_f64() } else { value[bytes.to_string()].as_f64() }
    }
}

fn driver_copy_child() -> Result<Curve> {
    let mut command = Command::new(std::env::current_exe()?);
    command.arg(DRIVER_COPY_FLAG);
    let out = run_bounded(command, Duration::from_secs(90), "driver-copy")?;
    let value = last_json(&out)?;
    let points = value["driver_staged_copy"].as_array().context("no driver_staged_copy in the child's output")?;
    Ok(points.iter().filter_map(|p| Some((p["bytes"].as_u64()?, p["p50_us"].as_f64()?))).collect())
}

fn last_json(stdout: &str) -> Result<Value> {
    let last = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON line in the output")?;
    Ok(serde_json::from_str(last)?)
}

/// Runs `command` in a process group of its own with its stdout captured and its stderr shown
/// (prefixed with `tag`); after `timeout` the whole group is killed and that is the error.
fn run_bounded(mut command: Command, timeout: Duration, tag: &str) -> Result<String> {
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let mut child = command.spawn().with_context(|| format!("starting {command:?}"))?;
    let mut stdout = child.stdout.take().context("no stdout")?;
    let stderr = child.stderr.take().context("no stderr")?;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let tag = tag.to_string();
    let errors = std::thread::spawn(move || {
        let mut tail = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(std::result::Result::ok) {
            eprintln!("      [{tag}] {line}");
            tail.push(line);
            if tail.len() > 20 {
                tail.remove(0);
            }
        }
        tail.join("\n")
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > timeout {
            kill_group(&mut child);
            bail!("{command:?} did not finish within {timeout:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Children it left behind (Python's helpers) may hold the pipes open: 10 s, then the group goes.
    let until = Instant::now() + Duration::from_secs(10);
    while !(reader.is_finished() && errors.is_finished()) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    if !(reader.is_finished() && errors.is_finished()) {
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
    }
    let text = reader.join().unwrap_or_default();
    let tail = errors.join().unwrap_or_default();
    ensure!(status.success(), "{command:?} failed ({status}): {tail}");
    Ok(text)
}

/// Kills `child`'s process group (it leads one: `process_group(0)`), then reaps it.
fn kill_group(child: &mut Child) {
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
    let _ = child.kill();
    let _ = child.wait();
}

/// `cross_anchors.py`, or why it was not run; never an error.
fn python_anchors(python: &str, script: Option<PathBuf>, timeout: Duration) -> Value {
    let Some(script) = script else {
        return json!({ "skipped": "no cross_anchors.py (pass --cross-anchors SCRIPT, or --torch with it beside)" });
    };
    if !script.is_file() {
        return json!({ "skipped": format!("{} is not a file", script.display()) });
    }
    let mut command = Command::new(python);
    // Each of its three parts gets a third of the time, less a margin.
    let part = (timeout.as_secs() / 3).saturating_sub(5).max(10);
    command.arg(&script).env("CROSS_PART_TIMEOUT_S", part.to_string());
    match run_bounded(command, timeout, "cross_anchors.py").and_then(|out| last_json(&out)) {
        Ok(value) => value,
        Err(error) => json!({ "error": format!("{error:#}") }),
    }
}

// ---------------------------------------------------------------- the routes, producer side

/// The producer's side: GPU0, its stream, the tensors it sends again and again.
struct Producer<'a> {
    stream: &'a Stream,
    gpu0: Uuid,
    gpu1: Uuid,
    spin: Duration,
    sized: Vec<Tensor>,
    many: Vec<Tensor>,
}

/// What one route measured.
#[derive(Default)]
struct RouteRun {
    chosen: String,
    path: String,
    stream_device: String,
    /// Per size of [`SIZES`]: one-way nanoseconds.
    one_way: Vec<(u64, Vec<u64>)>,
    rtt: Vec<u64>,
    many: Vec<u64>,
    notes: Vec<String>,
}

impl RouteRun {
    fn json(&mut self) -> Value {
        let one_way: Vec<Value> = self
            .one_way
            .iter_mut()
            .map(|(bytes, times)| {
                let p50 = p50_us(times);
                json!({ "bytes": bytes, "n": times.len(), "p50_us": p50, "p99_us": us(percentile(times, 99.0)), "gbps": *bytes as f64 / (p50 * 1e3) })
            })
            .collect();
        json!({
            "chosen_route": self.chosen, "path": self.path, "stream_device": self.stream_device,
            "one_way": one_way,
            "rtt_4k": (!self.rtt.is_empty()).then(|| json!({ "n": self.rtt.len(), "p50_us": p50_us(&mut self.rtt), "p99_us": us(percentile(&mut self.rtt, 99.0)) })),
            "many_1024x4k": (!self.many.is_empty()).then(|| json!({ "n": self.many.len(), "p50_us": p50_us(&mut self.many), "p99_us": us(percentile(&mut self.many, 99.0)) })),
            "notes": self.notes,
        })
    }
}

/// A consumer process, killed if still running when this is dropped.
struct Consumer(Child);

impl Drop for Consumer {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

struct Channel {
    sender: Sender<CrossMsg>,
    acks: tensor_queue::Receiver<CrossAck>,
    way: Way,
    /// Whether the previous message's leases are awaited before a one-way trip (turned off,
    /// with a note, if they did not come back within 10 s once).
    await_release: bool,
}

impl Channel {
    fn answer(&mut self, id: u64, what: &str) -> Result<CrossAck> {
        let ack = match self.acks.recv_timeout(ANSWER_TIMEOUT) {
            Ok(ack) => ack,
            Err(Error::Timeout) => {
                bail!("{} consumer: no answer to {what} within {ANSWER_TIMEOUT:?}", self.way.label())
            }
            Err(Error::Disconnected) => {
                bail!("{} consumer: it hung up before answering {what} (it died?)", self.way.label())
            }
            Err(error) => return Err(error.into()),
        };
        ensure!(ack.error.is_empty(), "{} consumer failed on {what}: {}", self.way.label(), ack.error);
        ensure!(ack.id == id, "{} consumer answered {} to {what} (expected {id})", self.way.label(), ack.id);
        Ok(ack)
    }

    /// One message: (one-way ns, round-trip ns, the answer).
    fn trip(&mut self, producer: &Producer, id: u64, tensors: &[Tensor], what: &str) -> Result<(u64, u64, CrossAck)> {
        // The message is made (its tensors cloned) before the clock starts: the benchmark's
        // work, not the channel's (1,024 clones are tens of microseconds).
        let mut msg = CrossMsg { id, sent_ns: 0, tensors: tensors.to_vec() };
        let start = monotonic_ns();
        msg.sent_ns = start;
        self.sender.send_on(&msg, producer.stream).with_context(|| format!("sending {what}"))?;
        let ack = self.answer(id, what)?;
        let back = monotonic_ns();
        ensure!(ack.usable_ns >= start, "the consumer's clock is behind ours: usable {} < sent {start}", ack.usable_ns);
        Ok((ack.usable_ns - start, back - start, ack))
    }

    fn await_release(&mut self, notes: &mut Vec<String>) {
        if self.await_release && !self.sender.wait_released(Duration::from_secs(10)) {
            notes.push("the consumer's leases did not come back within 10 s; later trips do not wait for them".into());
            self.await_release = false;
        }
    }

    /// `warmup + trips` one-way trips of `tensors`; the measured one-way times.
    fn one_way(
        &mut self,
        producer: &Producer,
        next_id: &mut u64,
        tensors: &[Tensor],
        (warmup, trips): (usize, usize),
        what: &str,
        run: &mut RouteRun,
    ) -> Result<Vec<u64>> {
        let mut times = Vec::with_capacity(trips);
        for i in 0..warmup + trips {
            self.await_release(&mut run.notes);
            *next_id += 1;
            let (one_way, _, ack) = self.trip(producer, *next_id, tensors, what)?;
            if run.path.is_empty() {
                run.path = ack.path.clone();
                run.stream_device = ack.stream_device.clone();
            }
            if !self.way.expected_paths().contains(&ack.path.as_str()) {
                let note = format!("{what}: path {} (expected {})", ack.path, self.way.expected_paths().join(" or "));
                if !run.notes.contains(&note) {
                    run.notes.push(note);
                }
            }
            if i >= warmup {
                times.push(one_way);
            }
        }
        Ok(times)
    }
}

/// A consumer process for `way`, started, with the channels to and from it set up and the
/// route the sender chose noted in `run`.
fn open(producer: &Producer, way: Way, run: &mut RouteRun) -> Result<(Consumer, Channel)> {
    let reply = socket_path("cross-answers");
    let acks = tensor_queue::Receiver::<CrossAck>::bind(&reply)?;
    let land = if way == Way::Same { producer.gpu0 } else { producer.gpu1 };
    let mut command = Command::new(std::env::current_exe()?);
    command.arg(CONSUMER_FLAG).arg("--reply").arg(&reply).stdin(Stdio::null());
    command.args(["--route", way.arg(), "--gpu", &land.to_string()]);
    command.args(["--spin-us", &producer.spin.as_micros().to_string(), "--capacity", "2"]);
    let (child, sender) = match tensor_queue::spawn_timeout::<CrossMsg>(&mut command, START_TIMEOUT) {
        Ok(started) => started,
        Err(error) => {
            // A consumer that failed in its set-up said why on the answer channel.
            let mut acks = acks;
            let why = acks.recv_timeout(Duration::from_secs(1)).map(|a| a.error).unwrap_or_default();
            bail!("starting the {} consumer: {error} {why}", way.label());
        }
    };
    let consumer = Consumer(child);
    let mut channel = Channel { sender, acks, way, await_release: true };
    channel.answer(u64::MAX, "set-up")?;
    let choice = channel.sender.route(&producer.gpu0, Duration::from_secs(10))?;
    run.chosen = format!("{:?}", choice.route);
    if choice.route != way.expected_route() {
        run.notes.push(format!(
            "the route chosen is {:?} (expected {:?}){}",
            choice.route,
            way.expected_route(),
            choice.slower_because.as_ref().map_or(String::new(), |why| format!(": {why}"))
        ));
    }
    channel.sender.set_spin(producer.spin);
    channel.acks.set_spin(producer.spin);
    Ok((consumer, channel))
}

/// Closes `channel` and waits (30 s at most) for `consumer` to end, as it does when its channel
/// closes; what went wrong is noted in `run`.
fn close(mut consumer: Consumer, channel: Channel, run: &mut RouteRun) -> Result<()> {
    drop(channel);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match consumer.0.try_wait()? {
            Some(status) if status.success() => break,
            Some(status) => {
                run.notes.push(format!("the consumer exited with {status} after the measurements"));
                break;
            }
            None if Instant::now() > deadline => {
                run.notes.push("the consumer did not exit within 30 s of the end; killed".into());
                break;
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    Ok(())
}

fn run_route(producer: &Producer, way: Way) -> Result<RouteRun> {
    let mut run = RouteRun::default();
    let (consumer, mut channel) = open(producer, way, &mut run)?;
    let mut id = 0u64;
    let sizes: &[(u64, usize, usize)] = if way == Way::Same { &SIZES[..1] } else { &SIZES };
    for (&(bytes, warmup, trips), tensor) in sizes.iter().zip(&producer.sized) {
        let what = format!("1 x {}", size_name(bytes));
        let times =
            channel.one_way(producer, &mut id, std::slice::from_ref(tensor), (warmup, trips), &what, &mut run)?;
        run.one_way.push((bytes, times));
    }
    // Round trips: one message in flight, the next sent as soon as the answer is back.
    let small = std::slice::from_ref(&producer.sized[0]);
    for i in 0..RTT_WARMUP + RTT_TRIPS {
        id += 1;
        let (_, trip, _) = channel.trip(producer, id, small, "a 4 KiB round trip")?;
        if i >= RTT_WARMUP {
            run.rtt.push(trip);
        }
    }
    if way != Way::Same {
        let times =
            channel.one_way(producer, &mut id, &producer.many, (MANY_WARMUP, MANY_TRIPS), "1,024 x 4 KiB", &mut run)?;
        run.many = times;
    }
    close(consumer, channel, &mut run)?;
    Ok(run)
}

// ---------------------------------------------------------------- the table

enum Target {
    /// At least this many GB/s.
    MinGbps(f64),
    /// At most this many microseconds.
    MaxUs(f64),
}

struct CrossRow {
    name: String,
    /// Bytes moved, for GB/s (`None` for round trips).
    bytes: Option<u64>,
    p50_us: Option<f64>,
    anchor: Option<(String, Option<f64>)>,
    others: Vec<(String, Option<f64>)>,
    target: Option<(Target, String)>,
}

impl CrossRow {
    fn gbps(&self, time_us: Option<f64>) -> Option<f64> {
        Some(self.bytes? as f64 / (time_us.filter(|t| *t > 0.0)? * 1e3))
    }

    fn ratio(&self, anchor_us: Option<f64>) -> Option<f64> {
        Some(anchor_us? / self.p50_us.filter(|t| *t > 0.0)?)
    }

    fn verdict(&self) -> Option<(String, bool)> {
        let (target, text) = self.target.as_ref()?;
        let met = match target {
            Target::MinGbps(g) => self.gbps(self.p50_us).is_some_and(|v| v >= *g),
            Target::MaxUs(t) => self.p50_us.is_some_and(|v| v <= *t),
        };
        Some((text.clone(), met))
    }

    fn json(&self) -> Value {
        json!({
            "name": self.name, "bytes": self.bytes, "p50_us": self.p50_us, "gbps": self.gbps(self.p50_us),
            "anchor": self.anchor.as_ref().map(|(n, v)| json!({ "name": n, "us": v, "ratio": self.ratio(*v) })),
            "others": self.others.iter().map(|(n, v)| json!({ "name": n, "us": v, "ratio": self.ratio(*v) })).collect::<Vec<_>>(),
            "target": self.verdict().map(|(t, met)| json!({ "target": t, "met": met })),
        })
    }

    fn markdown(&self) -> String {
        let number = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
        let ratio = |v: Option<f64>| v.map_or("-".to_string(), |r| format!("{r:.2}x"));
        let (anchor, anchor_us) = self.anchor.as_ref().map_or(("-".to_string(), None), |(n, v)| (n.clone(), *v));
        let others: Vec<String> = self
            .others
            .iter()
            .map(|(name, v)| {
                let value = match (self.bytes, v) {
                    (Some(b), Some(_)) if b >= MIB => format!("{} GB/s", number(self.gbps(*v))),
                    (_, Some(t)) => format!("{t:.1} us"),
                    _ => "n/a".into(),
                };
                format!("{name} {value} ({})", ratio(self.ratio(*v)))
            })
            .collect();
        let target =
            self.verdict().map_or(String::new(), |(t, met)| format!("{t} {}", if met { "met" } else { "MISSED" }));
        format!(
            "| {} | {} | {} | {anchor} | {} | {} | {} | {} | {target} |",
            self.name,
            number(self.p50_us),
            number(self.gbps(self.p50_us)),
            number(anchor_us),
            number(self.gbps(anchor_us)),
            ratio(self.ratio(anchor_us)),
            if others.is_empty() { "-".into() } else { others.join("; ") },
        )
    }
}

fn route_label(way: Way, run: Option<&RouteRun>) -> String {
    match run {
        Some(run) if !run.chosen.is_empty() && run.chosen != format!("{:?}", way.expected_route()) => {
            format!("{} (took {}!)", way.label(), run.chosen)
        }
        None => format!("{} (FAILED: see the notes)", way.label()),
        _ => way.label().to_string(),
    }
}

fn rows(runs: &mut [(Way, Option<RouteRun>)], anchors: &Anchors) -> Vec<CrossRow> {
    let p50_of = |times: &mut Vec<u64>| (!times.is_empty()).then(|| p50_us(times));
    let mut same_rtt = None;
    let mut same_one_way = None;
    for (way, run) in runs.iter_mut() {
        if let (Way::Same, Some(run)) = (*way, run.as_mut()) {
            same_rtt = p50_of(&mut run.rtt);
            same_one_way = run.one_way.first_mut().and_then(|(_, t)| p50_of(t));
        }
    }
    let nccl = |bytes: u64| anchors.python_at("nccl", "one_way_p50_us", bytes);
    let nccl_off = |bytes: u64| anchors.python_at("nccl_p2p_off", "one_way_p50_us", bytes);
    let torch_to = |bytes: u64| anchors.python_at("mp_to_cuda1", "one_way_p50_us", bytes);
    let peer = |bytes: u64| curve_at(anchors.peer.as_ref(), bytes);
    let mut rows = Vec::new();
    for (way, run) in runs.iter_mut() {
        let way = *way;
        let label = route_label(way, run.as_ref());
        let mut empty = RouteRun::default();
        let run = run.as_mut().unwrap_or(&mut empty);
        let sizes: &[(u64, usize, usize)] = if way == Way::Same { &SIZES[..1] } else { &SIZES };
        for &(bytes, _, _) in sizes {
            let p50 = run.one_way.iter_mut().find(|(b, _)| *b == bytes).and_then(|(_, t)| p50_of(t));
            let mut row = CrossRow {
                name: format!("{label}, 1 x {}, one-way to usable", size_name(bytes)),
                bytes: Some(bytes),
                p50_us: p50,
                anchor: None,
                others: Vec::new(),
                target: None,
            };
            let python_others = |row: &mut CrossRow| {
                if bytes >= MIB {
                    row.others.push(("NCCL send/recv".into(), nccl(bytes)));
                }
                if bytes == MIB || bytes == 64 * MIB {
                    row.others.push(("torch mp .to('cuda:1')".into(), torch_to(bytes)));
                }
            };
            match way {
                Way::Copy | Way::Map => {
                    row.anchor = Some(("cuMemcpyPeerAsync + sync".into(), peer(bytes)));
                    if let Some(&(_, floor)) = anchors.handoff.iter().find(|(b, _)| *b == bytes) {
                        row.others.push(("hand-off floor: stream signal + socket + pull copy + sync".into(), floor));
                    }
                    python_others(&mut row);
                }
                Way::Stage => {
                    row.anchor = Some(("pinned host round 4 MiB x 4".into(), curve_at(anchors.ring.as_ref(), bytes)));
                    row.others.push(("driver staged peer copy".into(), curve_at(anchors.driver.as_ref(), bytes)));
                    if bytes >= MIB {
                        row.others.push(("NCCL P2P off".into(), nccl_off(bytes)));
                    }
                }
                Way::Host => {
                    row.anchor = Some(("pinned D2H, 4 MiB pieces".into(), curve_at(anchors.d2h.as_ref(), bytes)));
                }
                Way::Same => {}
            }
            row.target = match (way, bytes) {
                (Way::Copy, GIB) => Some((Target::MinGbps(390.0), ">= 390 GB/s".into())),
                // Issue 26's targets (an earlier issue asked 375 and 100).
                (Way::Copy, b) if b == 64 * MIB => Some((Target::MinGbps(370.0), ">= 370 GB/s".into())),
                (Way::Copy, MIB) => Some((Target::MinGbps(80.0), ">= 80 GB/s".into())),
                (Way::Stage, GIB) => Some((Target::MinGbps(50.0), ">= 50 GB/s".into())),
                (Way::Stage, b) if b == 64 * MIB => Some((Target::MinGbps(45.0), ">= 45 GB/s".into())),
                _ => None,
            };
            if way == Way::Map && bytes == 4 * KIB {
                row.others.push(("same GPU 4 KiB one-way".into(), same_one_way));
            }
            rows.push(row);
        }
        let rtt_p50 = p50_of(&mut run.rtt);
        let rtt_p99 = (!run.rtt.is_empty()).then(|| us(percentile(&mut run.rtt, 99.0)));
        let mut rtt = CrossRow {
            name: format!("{label}, 4 KiB round trip p50 (spin)"),
            bytes: None,
            p50_us: rtt_p50,
            anchor: (way != Way::Same).then(|| ("same GPU 4 KiB round trip".to_string(), same_rtt)),
            others: vec![("NCCL 4 KiB ping-pong".into(), anchors.python_at("nccl", "pingpong_4k_p50_us", 0))],
            target: None,
        };
        if way != Way::Same && way != Way::Host {
            rtt.others.push(("cuMemcpyPeerAsync 4 KiB + sync (one way)".into(), peer(4 * KIB)));
        }
        rtt.target = match way {
            Way::Copy => Some((Target::MaxUs(20.0), "<= 20 us".into())),
            Way::Map => same_rtt.map(|s| (Target::MaxUs(1.5 * s), format!("<= 1.5 x same GPU = {:.1} us", 1.5 * s))),
            _ => None,
        };
        rows.push(rtt);
        rows.push(CrossRow {
            name: format!("{label}, 4 KiB round trip p99 (spin)"),
            bytes: None,
            p50_us: rtt_p99,
            anchor: None,
            others: vec![("NCCL 4 KiB ping-pong p99".into(), anchors.python_at("nccl", "pingpong_4k_p99_us", 0))],
            target: None,
        });
        if way != Way::Same {
            let anchor = match way {
                Way::Copy | Way::Map => ("one 4 MiB cuMemcpyPeerAsync + sync", peer(4 * MIB)),
                Way::Stage => ("pinned host round, 4 MiB", curve_at(anchors.ring.as_ref(), 4 * MIB)),
                _ => ("pinned D2H, 4 MiB", curve_at(anchors.d2h.as_ref(), 4 * MIB)),
            };
            rows.push(CrossRow {
                name: format!("{label}, 1,024 x 4 KiB, one-way to usable"),
                bytes: Some(4 * MIB),
                p50_us: p50_of(&mut run.many),
                anchor: Some((anchor.0.into(), anchor.1)),
                others: vec![("in-process floor (serde + 1,024 tensors made, no channel)".into(), anchors.many_floor)],
                // Issue 26: on every cross-device route.
                target: Some((Target::MaxUs(40.0), "<= 40 us".into())),
            });
        }
    }
    rows
}

/// The table of the `cross` section in `bench.json` (`None`: the section did not run), as
/// markdown, printed last.
pub fn print_table(cross: Option<&Value>) {
    let Some(cross) = cross else { return };
    if !print_opening(cross, "cross-device table", "cross-device, GPU0 -> GPU1") {
        return;
    }
    println!(
        "| route, size | one-way p50 us | GB/s | anchor (same run) | anchor us | anchor GB/s | ratio | other anchors: GB/s or us (ratio) | target |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for line in strings_of(cross, "table") {
        println!("{line}");
    }
    println!(
        "one-way: send call -> data usable on GPU1 (consumer synchronised t.stream(); map: copied on GPU1 and synchronised; host: recv returned); round-trip rows show p50/p99 us in the one-way column"
    );
    println!("ratio: anchor time / ours; above 1 means tensor-queue is faster");
    for note in strings_of(cross, "notes") {
        println!("note: {note}");
    }
}

/// Opens a section's printed table: a blank line, then `title` with the section's GPUs, or why
/// the section (`name`) was skipped, and then `false`: nothing more to print.
fn print_opening(section: &Value, name: &str, title: &str) -> bool {
    println!();
    if let Some(reason) = section["skipped"].as_str() {
        println!("{name}: skipped: {reason}");
        return false;
    }
    println!("{title} ({})", section["gpus"].as_str().unwrap_or("?"));
    true
}

/// The strings of `section[key]` (its table's lines, its notes).
fn strings_of<'a>(section: &'a Value, key: &str) -> impl Iterator<Item = &'a str> {
    section[key].as_array().into_iter().flatten().filter_map(Value::as_str)
}

/// Where `cross_anchors.py` is: `--cross-anchors SCRIPT`, else beside `--torch SCRIPT`.
fn anchors_script(torch: Option<&str>) -> Option<PathBuf> {
    let args: Vec<String> = std::env::args().collect();
    arg(&args, "--cross-anchors")
        .map(PathBuf::from)
        .or_else(|| torch.map(|t| Path::new(t).with_file_name("cross_anchors.py")))
}

impl Bench {
    /// The cross-device section; skipped (with why) without 2 GPUs.
    pub(super) fn cross(&mut self) -> Result<()> {
        self.progress.start("cross-device GPU0 -> GPU1: PeerCopy, PeerMap, Staged, Host against their anchors");
        if let Some(reason) = self.two_gpus_missing() {
            self.progress.done(&format!("skipped: {reason}"));
            self.json.insert("cross".into(), json!({ "skipped": reason }));
            return Ok(());
        }
        let gpu = self.gpu.as_ref().context("no GPU")?;
        let ctx0 = gpu.context.clone();
        let ctx1 = Context::on_ordinal(1)?;
        let (gpu0, gpu1) = (ctx0.device().uuid()?, ctx1.device().uuid()?);
        let section_start = Instant::now();
        let gpus = format!("{} {gpu0} -> {} {gpu1}", ctx0.device().name()?, ctx1.device().name()?);
        eprintln!("      {gpus}");

        eprintln!(
            "      anchors: copy engine, pinned host round and pinned D2H here; driver staged copy in a fresh process"
        );
        let started = Instant::now();
        let mut anchors = Anchors::measure(&ctx0, &ctx1);
        eprintln!("      anchors took {:.1} s", started.elapsed().as_secs_f64());

        // The producer's tensors: allocated once (the 1 GiB one too), then sent again and again.
        // The 1,024 small ones first and one after another, so that they lie together.
        let many = (0..MANY).map(|i| self.tensor(4 * KIB, i as u64)).collect::<Result<Vec<_>>>()?;
        let floor = integration_tests::serde_floor_ns(&many, (MANY_WARMUP * 10, MANY_TRIPS * 10));
        anchors.many_floor =
            anchors.note("the 1,024-tensor message's in-process floor", floor).map(|mut t| p50_us(&mut t));
        let sized = SIZES.iter().map(|&(bytes, _, _)| self.tensor(bytes, bytes)).collect::<Result<Vec<_>>>()?;
        self.synchronize()?;
        let gpu = self.gpu.as_ref().context("no GPU")?;
        let producer = Producer {
            stream: &gpu.stream,
            gpu0,
            gpu1,
            spin: Duration::from_micros(self.options.spin_us),
            sized,
            many,
        };
        let mut runs = Vec::new();
        let mut notes = Vec::new();
        let mut routes_json = serde_json::Map::new();
        for way in WAYS {
            if section_start.elapsed() > ROUTES_BUDGET {
                let why = format!("not measured: the section had used {ROUTES_BUDGET:?} already");
                notes.push(format!("{}: {why}", way.label()));
                routes_json.insert(way.arg().into(), json!({ "error": why }));
                runs.push((way, None));
                continue;
            }
            let started = Instant::now();
            eprintln!("      route {} ...", way.label());
            let run = match run_route(&producer, way) {
                Ok(mut run) => {
                    let value = run.json();
                    eprintln!(
                        "      route {}: chose {}, path {}, {:.1} s: {}",
                        way.label(),
                        run.chosen,
                        run.path,
                        started.elapsed().as_secs_f64(),
                        value["one_way"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|v| format!(
                                "{} {:.1} us",
                                size_name(v["bytes"].as_u64().unwrap_or(0)),
                                v["p50_us"].as_f64().unwrap_or(0.0)
                            ))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                    notes.extend(run.notes.iter().map(|n| format!("{}: {n}", way.label())));
                    routes_json.insert(way.arg().into(), value);
                    Some(run)
                }
                Err(error) => {
                    eprintln!("      route {}: FAILED: {error:#}", way.label());
                    notes.push(format!("{} FAILED: {error:#}", way.label()));
                    routes_json.insert(way.arg().into(), json!({ "error": format!("{error:#}") }));
                    None
                }
            };
            runs.push((way, run));
        }
        drop(producer);

        let script = anchors_script(self.options.torch.as_deref());
        eprintln!("      Python anchors: {} (NCCL, NCCL P2P off, torch mp .to('cuda:1'))", self.options.python);
        let started = Instant::now();
        let left =
            SECTION_BUDGET.saturating_sub(section_start.elapsed()).clamp(Duration::from_secs(30), PYTHON_TIMEOUT);
        anchors.python = python_anchors(&self.options.python, script, left);
        eprintln!("      Python anchors took {:.1} s", started.elapsed().as_secs_f64());
        if let Some(why) = anchors.python["skipped"].as_str() {
            notes.push(format!("Python anchors skipped: {why}"));
        }
        if let Some(why) = anchors.python["error"].as_str() {
            notes.push(format!("Python anchors failed: {why}"));
        }
        for part in ["nccl", "nccl_p2p_off", "mp_to_cuda1"] {
            for key in ["error", "warning"] {
                if let Some(why) = anchors.python[part][key].as_str() {
                    notes.push(format!("Python {part}: {key}: {why}"));
                }
            }
        }
        notes.extend(anchors.errors.iter().map(|e| format!("anchor failed: {e}")));

        let table = rows(&mut runs, &anchors);
        let missed = table.iter().filter(|r| r.verdict().is_some_and(|(_, met)| !met)).count();
        self.progress.done(&format!(
            "{} rows, {} targets, {missed} missed",
            table.len(),
            table.iter().filter(|r| r.target.is_some()).count()
        ));
        self.json.insert(
            "cross".into(),
            json!({
                "gpus": gpus,
                "routes": routes_json,
                "anchors": anchors.json(),
                "rows": table.iter().map(CrossRow::json).collect::<Vec<_>>(),
                "table": table.iter().map(CrossRow::markdown).collect::<Vec<_>>(),
                "notes": notes,
            }),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table from made-up figures: every route, one failed, Python anchors partly there.
    #[test]
    fn table_from_figures() {
        let run = |scale: u64| RouteRun {
            one_way: SIZES.iter().map(|&(b, _, _)| (b, vec![b / scale + 5_000; 3])).collect(),
            rtt: vec![15_000, 16_000, 40_000],
            many: vec![30_000; 4],
            ..Default::default()
        };
        let mut runs = vec![
            (Way::Copy, Some(run(400))),
            (Way::Map, Some(run(300))),
            (Way::Stage, Some(run(50))),
            (Way::Host, None),
            (
                Way::Same,
                Some(RouteRun { rtt: vec![10_000; 5], one_way: vec![(4096, vec![4_000])], ..Default::default() }),
            ),
        ];
        let curve: Curve = ANCHOR_SIZES.iter().map(|&(b, _, _)| (b, b as f64 / 395_000.0 + 5.0)).collect();
        let anchors = Anchors {
            peer: Some(curve.clone()),
            ring: Some(curve),
            python: json!({ "nccl": { "one_way_p50_us": { "1048576": 40.0 }, "pingpong_4k_p50_us": 99.0 } }),
            ..Default::default()
        };
        let table = rows(&mut runs, &anchors);
        let lines: Vec<String> = table.iter().map(CrossRow::markdown).collect();
        for line in &lines {
            assert_eq!(line.matches(" | ").count(), 8, "{line}");
        }
        let copy_gib = table.iter().find(|r| r.name == "PeerCopy, 1 x 1 GiB, one-way to usable").expect("row");
        assert_eq!(copy_gib.verdict().map(|(_, met)| met), Some(true));
        let map_rtt = table.iter().find(|r| r.name == "PeerMap, 4 KiB round trip p50 (spin)").expect("row");
        assert_eq!(map_rtt.verdict().map(|(_, met)| met), Some(false)); // 16 us > 1.5 x 10 us
        assert!(table.iter().any(|r| r.name.starts_with("Host") && r.p50_us.is_none()));
        let value = json!({ "gpus": "a -> b", "table": lines, "notes": ["n"] });
        print_table(Some(&value));
        print_table(Some(&json!({ "skipped": "why" })));
        assert_eq!(size_name(64 * MIB), "64 MiB");
        assert_eq!(size_name(4 * KIB), "4 KiB");
    }
}
