//! The second (and third) process of the cross-device tests (`tests/tests/cross_gpu.rs`,
//! `tests/tests/routes_host.rs`): `tq-cross <role> [options]`.
//!
//! Every role reports on stdout, one line per event, and a watchdog aborts it after
//! `--deadline-s` (default 120) seconds, so no helper outlives its test for long. GPUs are named
//! by UUID (`GPU-...`), never by ordinal: each process may see another `CUDA_VISIBLE_DEVICES`.
//! Messages are [`CrossItem`]s.
//!
//! Roles:
//! - `produce --to P --case C [--gpu UUID] [--threads T] [--count N] [--len L] [--seed S]
//!   [--spin-ms M] [--steps K] [--n N]`: prints `visible <uuids>` and `gpu <uuid>`, connects,
//!   asks `Sender::route` for its GPU and prints `route <Route> target <uuid|host>` (or
//!   `route-error <Error>`), and `Sender::route_for` a 4 KiB message (`route-4k <Route> target
//!   <uuid|host> reason <why|->`), then runs case `C`:
//!   - `views`: one message with a `[256, 1024]` i32 pattern tensor and its strided views
//!     ([`views_of`]), each with the producer's GPU checksum and the CPU reference; with
//!     `--also P2,P3,..`, the same message broadcast to those receivers too (`released` per
//!     receiver).
//!   - `many`: one message of `--count` (1024) separate 4 KiB tensors (`--len`), each its own seed,
//!     dropped once sent; then as many fresh tensors filled with other seeds, which take their
//!     memory at once.
//!   - `sizes`: one message per size of 1 B, 4095 B, 1 MiB + 3, 64 MiB and 256 MiB.
//!   - `mixed`: one message of a 4 KiB GPU tensor, a 4 KiB host tensor and a transposed
//!     `[64, 16]` u8 view of a GPU tensor (small: across hosts its GPU tensors travel inline).
//!   - `seed`: the seed scenario: `--steps` (50) matmuls of `--n` (4096) x `--n` f32 on `x` queued
//!     on the stream and `x` sent with `send_on` at once; then a read of `x` on another stream
//!     that does not wait (`early <checksum>`: what a consumer without ordering may see), a
//!     synchronise, and a `verdict` message with the producer's own checksum (`final <checksum>`).
//!   - `spin-big`: a `--len` (1 GiB) tensor whose fill first spins `--spin-ms` (3000) of GPU
//!     time, sent with `send_on` (`sent 0 0`); then waits to be killed.
//!   - `stream`: `--threads` threads, each with its own `Sender::connect` and stream, send
//!     `--count` messages of one `--len`-byte tensor each (`sent <thread> <index>`).
//!   - `refused`: a GPU tensor with `send_on` must be refused (`outcome refused <route> <strict>
//!     <why>` and `refused-text <Display>`, or `outcome not-refused: <what happened>`), then
//!     `connected <bool>`; then a host tensor message is sent (`sent 0 1`).
//!   - `host`: host tensors only (no CUDA at all): `--count` messages of a pattern tensor and
//!     its strided views; prints `route` for the made-up GPU `--ask` as well.
//!
//!   Then `released` (or `unreleased <n>`) once the receiver gave everything back (30 s at most),
//!   `rejected <seq> <why>` for refused messages, and `done`.
//! - `consume --listen P [--land ..] [--land-from ..] [--peer ..] [--strict ..] [--capacity N]
//!   [--hold N] [--within-s S] [--late-ms M]`: binds a receiver with those options (see
//!   [`routing_from_args`]), prints `visible <uuids>`, `baseline <json>` and `ready`, then one
//!   `report <json>` ([`MsgReport`]) per message, `producer-failed <pid> <seq>`, `recv-error
//!   <what>`, `verdict <id> match|mismatch <seen> <producer>` for verdicts; with `--hold N` it
//!   keeps the first N messages and prints `holding <N>` before it drops them all. On stdin:
//!   `mem` drops what it holds, trims and waits (15 s at most) for its arenas and each GPU's free
//!   memory to return to the baseline, then prints `mem ok <json>` or `mem leak <json>`; `quit`
//!   or the end of stdin ends it (`done`); `rebase` takes the baseline anew (`rebased <json>`),
//!   after one-time set-up such as NCCL's. Messages of kind `warm` are not checked (`warm`).
//!   With `--late-ms`, it sleeps that long before each look for a message.
//! - `forward --listen P --to Q [--land ..] [--senders S] [--count N]`: receives on its GPU
//!   (the landing), checks each message on the GPU, copies each tensor with `Tensor::copy_on`
//!   onto a stream of its own and sends the copies on to `Q` with `send_on`, round robin over
//!   `S` senders (each its own `Sender::connect`); prints `forwarded <n>` and, when its senders
//!   left, `done`.

use std::io::BufRead as _;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::cross::{
    CrossItem, MsgReport, device_name, gpu_checksum, host_pattern_i32, poll_until, received_checksum,
    routing_from_args, seed, views_of, views_reference,
};
use integration_tests::{arg, number};
use ipc_core::{DeviceBuffer, DeviceMemory};
use kernels::{Kernels, reference};
use serde::Serialize;
use tensor_queue::{
    Broadcast, Context, DType, Device, Error, Receiver, Sender, Stream, Tensor, TensorDevice, Uuid, memory,
};

const MIB: usize = 1 << 20;

fn main() {
    if let Err(error) = run() {
        println!("error {error:#}");
        eprintln!("tq-cross: {error:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().context("usage: tq-cross <role> [options]")?.clone();
    let deadline = Duration::from_secs(number(&args, "--deadline-s", 120)?);
    let name = role.clone();
    std::thread::spawn(move || {
        std::thread::sleep(deadline);
        eprintln!("tq-cross {name}: still running after {deadline:?}; aborting");
        std::process::abort();
    });
    match role.as_str() {
        "produce" => produce(&args),
        "consume" => consume(&args),
        "forward" => forward(&args),
        other => bail!("unknown role {other}"),
    }
}

/// The UUIDs of the GPUs this process sees, in its ordinal order (none without a driver).
fn visible() -> Vec<Uuid> {
    if !cuda_sys::is_available() {
        return Vec::new();
    }
    Device::all().map(|all| all.iter().filter_map(|d| d.uuid().ok()).collect()).unwrap_or_default()
}

fn print_visible() -> Vec<Uuid> {
    let uuids = visible();
    let names: Vec<String> = uuids.iter().map(Uuid::to_string).collect();
    println!("visible {}", if names.is_empty() { "none".to_string() } else { names.join(",") });
    uuids
}

/// The context of the GPU `--gpu <uuid>` (else this process's first), with the kernels loaded.
fn gpu_context(args: &[String]) -> Result<Arc<Context>> {
    let device = match arg(args, "--gpu") {
        Some(uuid) => Device::by_uuid(&uuid.parse::<Uuid>()?)?,
        None => Device::get(0)?,
    };
    let context = Context::primary(device)?;
    Kernels::get(&context)?;
    println!("gpu {}", context.device().uuid()?);
    Ok(context)
}

fn json(value: &impl Serialize) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| format!("\"unserialisable: {e}\""))
}

// ---------------------------------------------------------------- produce

fn produce(args: &[String]) -> Result<()> {
    print_visible();
    let to = arg(args, "--to").context("--to <path>")?;
    let case = arg(args, "--case").context("--case <name>")?;
    if case == "host" {
        return produce_host(args, &to);
    }
    let context = gpu_context(args)?;
    let uuid = context.device().uuid()?;
    if case == "stream" {
        return produce_stream(args, &to, &context);
    }
    let sender = Sender::<CrossItem>::connect(&to)?;
    print_route(&sender, &uuid);
    let stream = Stream::new(&context)?;
    let kernels = Kernels::get(&context)?;
    match case.as_str() {
        "views" => {
            let seed = number(args, "--seed", 11)?;
            let base = Tensor::empty_cuda(&context, DType::I32, &[256, 1024])?;
            kernels.fill(&base.cuda_view()?, 0, base.nbytes(), seed, &stream)?;
            let views = views_of(&base)?;
            let reference = views_reference(seed)?;
            let checksums = views.iter().map(|(_, v)| gpu_checksum(v, &stream)).collect::<Result<Vec<_>>>()?;
            ensure!(checksums == reference, "the producer's GPU checksums {checksums:?} != the CPU's {reference:?}");
            let note = views.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(",");
            let tensors = views.into_iter().map(|(_, v)| v).collect();
            let item = CrossItem { id: 0, kind: "data".into(), tensors, checksums, reference, note };
            match arg(args, "--also") {
                // The same message to every receiver: a broadcast, each sender its own route.
                Some(also) => {
                    let mut senders = vec![sender];
                    for endpoint in also.split(',') {
                        senders.push(Sender::<CrossItem>::connect(endpoint)?);
                    }
                    let broadcast = Broadcast::new(senders);
                    broadcast.send_on(&item, &stream)?;
                    println!("sent 0 0");
                    for sender in broadcast.senders() {
                        finish_sender(sender);
                    }
                    println!("done");
                    return Ok(());
                }
                None => sender.send_on(&item, &stream)?,
            }
            println!("sent 0 0");
        }
        "many" => {
            let count = number(args, "--count", 1024)?;
            let len = number(args, "--len", 4096)? as usize;
            let mut tensors = Vec::new();
            let mut reference = Vec::new();
            for i in 0..count {
                let t = Tensor::empty_cuda(&context, DType::U8, &[len as u64])?;
                kernels.fill(&t.cuda_view()?, 0, len, 1000 + i, &stream)?;
                tensors.push(t);
                reference.push(reference::checksum(&reference::pattern(len, 1000 + i)));
            }
            let checksums = tensors.iter().map(|t| gpu_checksum(t, &stream)).collect::<Result<Vec<_>>>()?;
            ensure!(checksums == reference, "the producer's GPU checksums differ from the CPU's");
            let note = format!("{count} x {len} B");
            sender.send_on(&CrossItem { id: 0, kind: "data".into(), tensors, checksums, reference, note }, &stream)?;
            println!("sent 0 0");
            // The message's tensors are dropped now: fresh ones filled with other values take
            // their memory at once (the arena reuses it). A route that does not hold every
            // tensor's memory until its copy or transfer is done delivers these values.
            let mut again = Vec::new();
            for i in 0..count {
                let t = Tensor::empty_cuda(&context, DType::U8, &[len as u64])?;
                kernels.fill(&t.cuda_view()?, 0, len, 9000 + i, &stream)?;
                again.push(t);
            }
            stream.synchronize()?;
            drop(again);
        }
        "sizes" => {
            let sizes = [1, 4095, MIB + 3, 64 * MIB, 256 * MIB];
            for (id, &len) in sizes.iter().enumerate() {
                let seed = 77 + id as u64;
                let t = Tensor::empty_cuda(&context, DType::U8, &[len as u64])?;
                kernels.fill(&t.cuda_view()?, 0, len, seed, &stream)?;
                let reference = vec![reference::checksum(&reference::pattern(len, seed))];
                let checksums = vec![gpu_checksum(&t, &stream)?];
                let note = format!("{len} B");
                let item =
                    CrossItem { id: id as u64, kind: "data".into(), tensors: vec![t], checksums, reference, note };
                sender.send_on(&item, &stream)?;
                println!("sent 0 {id}");
            }
        }
        "mixed" => {
            let seed = number(args, "--seed", 21)?;
            let gpu = Tensor::empty_cuda(&context, DType::U8, &[4096])?;
            kernels.fill(&gpu.cuda_view()?, 0, 4096, seed, &stream)?;
            let host = Tensor::from_slice(&reference::pattern(4096, seed + 1), DType::U8, &[4096])?;
            let base = Tensor::empty_cuda(&context, DType::U8, &[64, 16])?;
            kernels.fill(&base.cuda_view()?, 0, 1024, seed + 2, &stream)?;
            let transposed = base.transpose(0, 1)?;
            let pattern = reference::pattern(1024, seed + 2);
            let packed: Vec<u8> =
                (0..16).flat_map(|j| (0..64).map(move |i| (i, j))).map(|(i, j)| pattern[i * 16 + j]).collect();
            let reference = vec![
                reference::checksum(&reference::pattern(4096, seed)),
                reference::checksum(&reference::pattern(4096, seed + 1)),
                reference::checksum(&packed),
            ];
            let checksums = vec![
                gpu_checksum(&gpu, &stream)?,
                reference::checksum(&host.to_bytes()?),
                gpu_checksum(&transposed, &stream)?,
            ];
            ensure!(checksums == reference, "the producer's checksums {checksums:?} != the CPU's {reference:?}");
            let tensors = vec![gpu, host, transposed];
            let note = "gpu 4 KiB, host 4 KiB, gpu [64, 16] transposed".to_string();
            sender.send_on(&CrossItem { id: 0, kind: "data".into(), tensors, checksums, reference, note }, &stream)?;
            println!("sent 0 0");
        }
        "seed" => produce_seed(args, &sender, &context, &stream, &kernels)?,
        "spin-big" => {
            let len = number(args, "--len", 1 << 30)? as usize;
            let spin = Duration::from_millis(number(args, "--spin-ms", 3000)?);
            let t = Tensor::empty_cuda(&context, DType::U8, &[len as u64])?;
            kernels.spin_then_fill(&t.cuda_view()?, len, 5, spin, &stream)?;
            let reference = vec![reference::checksum(&reference::pattern(len, 5))];
            let item = CrossItem {
                id: 0,
                kind: "data".into(),
                tensors: vec![t],
                checksums: reference.clone(),
                reference,
                note: "spin-big".into(),
            };
            sender.send_on(&item, &stream)?;
            println!("sent 0 0");
            // Waits to be killed with its GPU work (and the staged copy after it) queued.
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        "refused" => {
            let t = Tensor::empty_cuda(&context, DType::U8, &[MIB as u64])?;
            kernels.fill(&t.cuda_view()?, 0, MIB, 3, &stream)?;
            let sum = reference::checksum(&reference::pattern(MIB, 3));
            let item = CrossItem {
                id: 0,
                kind: "data".into(),
                tensors: vec![t],
                checksums: vec![sum],
                reference: vec![sum],
                note: "must be refused".into(),
            };
            match sender.send_on(&item, &stream) {
                Err(Error::RouteRefused(forbidden)) => {
                    println!("outcome refused {:?} {:?} {}", forbidden.route, forbidden.strict, forbidden.why);
                    println!("refused-text {}", Error::RouteRefused(forbidden));
                }
                Ok(()) => println!("outcome not-refused: sent"),
                Err(other) => println!("outcome not-refused: {other:?}"),
            }
            println!("connected {}", sender.is_connected());
            let host = Tensor::from_slice(&reference::pattern(4096, 4), DType::U8, &[4096])?;
            let sum = reference::checksum(&reference::pattern(4096, 4));
            let item = CrossItem {
                id: 1,
                kind: "data".into(),
                tensors: vec![host],
                checksums: vec![sum],
                reference: vec![sum],
                note: "allowed after a refusal".into(),
            };
            sender.send(&item)?;
            println!("sent 0 1");
        }
        other => bail!("unknown case {other}"),
    }
    finish_sender(&sender);
    stream.synchronize()?;
    println!("done");
    Ok(())
}

fn print_route(sender: &Sender<CrossItem>, uuid: &Uuid) {
    match sender.route(uuid, Duration::from_secs(30)) {
        Ok(choice) => println!(
            "route {:?} target {} slower {}",
            choice.route,
            choice.target.map_or("host".to_string(), |t| t.to_string()),
            choice.slower_because.as_deref().unwrap_or("-")
        ),
        Err(Error::RouteRefused(forbidden)) => {
            println!("route-error RouteRefused {:?} {:?} {}", forbidden.route, forbidden.strict, forbidden.why)
        }
        Err(error) => println!("route-error {error:?}"),
    }
    match sender.route_for(uuid, 4096, Duration::from_secs(30)) {
        Ok(choice) => println!(
            "route-4k {:?} target {} reason {}",
            choice.route,
            choice.target.map_or("host".to_string(), |t| t.to_string()),
            choice.reason.as_deref().unwrap_or("-")
        ),
        Err(error) => println!("route-4k-error {error:?}"),
    }
}

fn finish_sender(sender: &Sender<CrossItem>) {
    if sender.wait_released(Duration::from_secs(30)) {
        println!("released");
    } else {
        println!("unreleased {}", sender.outstanding_leases());
    }
    for rejected in sender.take_rejected() {
        println!("rejected {} {}", rejected.seq, rejected.reason);
    }
}

/// The seed scenario on this process's GPU.
fn produce_seed(
    args: &[String],
    sender: &Sender<CrossItem>,
    context: &Arc<Context>,
    stream: &Stream,
    kernels: &Kernels,
) -> Result<()> {
    let n = number(args, "--n", 4096)?;
    let steps = number(args, "--steps", 50)?;
    ensure!(steps % 2 == 0, "an even number of steps leaves the result in x");
    if args.iter().any(|a| a == "--warm-up") {
        // A small message first, so that what the route sets up once (an NCCL communicator) is
        // ready before the race: the negative control must see the send run at once.
        let warm = Tensor::zeros_cuda(DType::U8, &[16], stream)?;
        let item = CrossItem {
            id: 999,
            kind: "warm".into(),
            tensors: vec![warm],
            checksums: vec![],
            reference: vec![],
            note: "warm-up".into(),
        };
        sender.send_on(&item, stream)?;
        ensure!(sender.wait_released(Duration::from_secs(60)), "the warm-up message was not taken");
    }
    let x = Tensor::empty_cuda(context, DType::F32, &[n, n])?;
    let (a, tmp) = (DeviceBuffer::alloc(context, x.nbytes())?, DeviceBuffer::alloc(context, x.nbytes())?);
    a.copy_from_host(0, bytemuck::cast_slice(&seed::shift_matrix(n)))?;
    let xv = x.cuda_view()?;
    xv.copy_from_host(0, bytemuck::cast_slice(&seed::initial(n)))?;
    let expected = reference::checksum(bytemuck::cast_slice(&seed::expected(n, steps)));
    let dims = (n as u32, n as u32, n as u32);
    for step in 0..steps {
        let (from, to): (&dyn DeviceMemory, &dyn DeviceMemory) = if step % 2 == 0 { (&xv, &tmp) } else { (&tmp, &xv) };
        kernels.matmul_f32(&a, from, to, dims, stream)?;
    }
    let item = CrossItem {
        id: 0,
        kind: "data".into(),
        tensors: vec![x.clone()],
        checksums: vec![],
        reference: vec![expected],
        note: format!("{steps} matmuls of {n}x{n}"),
    };
    let sent_at = Instant::now();
    sender.send_on(&item, stream)?; // no synchronisation
    println!("sent 0 0");
    // What a reader that does not wait for the producer's stream sees now: the race window.
    let other = Stream::new(context)?;
    let early = gpu_checksum(&x, &other)?;
    println!("early {early} after {:?}", sent_at.elapsed());
    stream.synchronize()?;
    println!("synchronised after {:?}", sent_at.elapsed());
    let last = gpu_checksum(&x, stream)?;
    println!("final {last} reference {expected}");
    let verdict = CrossItem {
        id: 0,
        kind: "verdict".into(),
        tensors: vec![],
        checksums: vec![last],
        reference: vec![expected],
        note: String::new(),
    };
    sender.send(&verdict)?;
    println!("sent 0 1");
    drop((a, tmp));
    Ok(())
}

/// `--threads` senders in this process, each its own connection and stream.
fn produce_stream(args: &[String], to: &str, context: &Arc<Context>) -> Result<()> {
    let threads = number(args, "--threads", 1)?;
    let count = number(args, "--count", 10)?;
    let len = number(args, "--len", 256 << 10)? as usize;
    let uuid = context.device().uuid()?;
    let first_error = Arc::new(Mutex::new(None::<String>));
    let workers: Vec<_> = (0..threads)
        .map(|thread| {
            let (context, to, first_error) = (context.clone(), to.to_string(), first_error.clone());
            std::thread::spawn(move || {
                let run = || -> Result<()> {
                    let sender = Sender::<CrossItem>::connect(&to)?;
                    if thread == 0 {
                        print_route(&sender, &uuid);
                    }
                    let stream = Stream::new(&context)?;
                    let kernels = Kernels::get(&context)?;
                    for index in 0..count {
                        let seed = (thread << 32) | index;
                        let t = Tensor::empty_cuda(&context, DType::U8, &[len as u64])?;
                        kernels.fill(&t.cuda_view()?, 0, len, seed, &stream)?;
                        let sum = reference::checksum(&reference::pattern(len, seed));
                        let item = CrossItem {
                            id: seed,
                            kind: "data".into(),
                            tensors: vec![t],
                            checksums: vec![sum],
                            reference: vec![sum],
                            note: format!("thread {thread} index {index}"),
                        };
                        sender.send_on_timeout(&item, &stream, Duration::from_secs(30))?;
                        println!("sent {thread} {index}");
                    }
                    finish_sender(&sender);
                    stream.synchronize()?;
                    Ok(())
                };
                if let Err(error) = run() {
                    println!("error thread {thread}: {error:#}");
                    first_error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(format!("{error:#}"));
                }
            })
        })
        .collect();
    for worker in workers {
        if worker.join().is_err() {
            bail!("a producing thread panicked");
        }
    }
    if let Some(error) = first_error.lock().unwrap_or_else(|e| e.into_inner()).take() {
        bail!("{error}");
    }
    println!("done");
    Ok(())
}

/// Host tensors only: no CUDA call at all.
fn produce_host(args: &[String], to: &str) -> Result<()> {
    let sender = Sender::<CrossItem>::connect(to)?;
    if let Some(ask) = arg(args, "--ask") {
        print_route(&sender, &ask.parse::<Uuid>()?);
    }
    let count = number(args, "--count", 3)?;
    for id in 0..count {
        let seed = 40 + id;
        let base = host_pattern_i32(256, 1024, seed)?;
        let views = views_of(&base)?;
        let reference = views_reference(seed)?;
        let checksums =
            views.iter().map(|(_, v)| Ok(reference::checksum(&v.to_bytes()?))).collect::<Result<Vec<_>>>()?;
        let note = views.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(",");
        let tensors = views.into_iter().map(|(_, v)| v).collect();
        sender.send(&CrossItem { id, kind: "data".into(), tensors, checksums, reference, note })?;
        println!("sent 0 {id}");
    }
    finish_sender(&sender);
    println!("done");
    Ok(())
}

// ---------------------------------------------------------------- consume

/// What the consumer's arenas and each visible GPU's free memory are.
#[derive(Debug, Clone, Serialize)]
struct MemorySnapshot {
    host_bytes: usize,
    device_bytes: usize,
    in_use_bytes: usize,
    /// Per visible GPU (by UUID): free bytes as the driver says.
    free: Vec<(String, usize)>,
    /// Open file descriptors.
    fds: usize,
    /// What they are (their `/proc/self/fd` links), so that a leak says what leaked.
    fd_links: Vec<String>,
    /// Taken by `rebase`.
    rebased: bool,
}

fn snapshot(contexts: &[Arc<Context>]) -> Result<MemorySnapshot> {
    let usage = memory::usage();
    let mut free = Vec::new();
    for context in contexts {
        free.push((context.device().uuid()?.to_string(), context.memory_info()?.0));
    }
    let sockets = socket_names();
    let mut fd_links: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.flatten()
                .map(|e| std::fs::read_link(e.path()).map_or_else(|e| e.to_string(), |l| l.display().to_string()))
                .collect()
        })
        .unwrap_or_default();
    for link in &mut fd_links {
        if let Some(name) = link.strip_prefix("socket:[").and_then(|l| l.strip_suffix(']')).and_then(|i| sockets.get(i))
        {
            link.push_str(&format!(" {name}"));
        }
    }
    fd_links.sort();
    Ok(MemorySnapshot {
        host_bytes: usage.host_bytes,
        device_bytes: usage.device_bytes,
        in_use_bytes: usage.in_use_bytes,
        free,
        fds: fd_links.len(),
        fd_links,
        rebased: false,
    })
}

/// What each socket of this process is, by inode: its TCP addresses (hex, as the kernel writes
/// them) and state, or its Unix path.
fn socket_names() -> std::collections::HashMap<String, String> {
    let mut names = std::collections::HashMap::new();
    let tables = [("tcp", 9), ("tcp6", 9), ("udp", 9), ("udp6", 9), ("raw", 9), ("unix", 6), ("netlink", 9)];
    for (table, inode_at) in tables {
        let Ok(text) = std::fs::read_to_string(format!("/proc/self/net/{table}")) else { continue };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if let Some(inode) = fields.get(inode_at) {
                let name = match table {
                    "unix" => format!("unix {}", fields.get(7).unwrap_or(&"(unnamed)")),
                    "netlink" => format!("netlink protocol {} pid {}", fields[1], fields[2]),
                    _ => format!("{table} {} -> {} st {}", fields[1], fields[2], fields[3]),
                };
                names.insert(inode.to_string(), name);
            }
        }
    }
    names
}

/// Free device memory may move by this much for reasons of its own (the driver's bookkeeping).
const FREE_SLACK: usize = 64 * MIB;

fn back_to(now: &MemorySnapshot, base: &MemorySnapshot) -> bool {
    now.host_bytes <= base.host_bytes
        && now.device_bytes <= base.device_bytes
        && now.in_use_bytes <= base.in_use_bytes
        && now.free.iter().zip(&base.free).all(|((_, n), (_, b))| n + FREE_SLACK >= *b)
        // Descriptors are compared from a `rebase` on: before it, one-time set-up opens some.
        && (!base.rebased || now.fds <= base.fds)
}

fn consume(args: &[String]) -> Result<()> {
    let listen = arg(args, "--listen").context("--listen <path>")?;
    let hold = number(args, "--hold", 0)? as usize;
    let within = Duration::from_secs(number(args, "--within-s", 20)?);
    let routing = routing_from_args(args)?;
    let capacity = number(args, "--capacity", u64::from(tensor_queue::DEFAULT_CAPACITY))? as u32;
    let late = Duration::from_millis(number(args, "--late-ms", 0)?);
    let uuids = print_visible();
    // A ready consumer: every visible GPU's context and kernels loaded before anything arrives.
    let contexts =
        uuids.iter().map(|u| Ok(Context::primary(Device::by_uuid(u)?)?)).collect::<Result<Vec<Arc<Context>>>>()?;
    for context in &contexts {
        Kernels::get(context)?;
    }
    memory::trim();
    let mut baseline = snapshot(&contexts)?;
    println!("baseline {}", json(&baseline));
    let mut receiver = Receiver::<CrossItem>::builder().capacity(capacity).routing(routing).bind(&listen)?;
    let (commands, stdin_lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if commands.send(line).is_err() {
                return;
            }
        }
        let _ = commands.send("quit".into());
    });
    println!("ready");
    let mut held: Vec<CrossItem> = Vec::new();
    let mut seen_by_id: std::collections::HashMap<u64, Vec<u64>> = std::collections::HashMap::new();
    let mut holding_said = false;
    loop {
        match stdin_lines.try_recv() {
            Ok(line) if line == "quit" => break,
            Ok(line) if line == "rebase" => {
                held.clear();
                memory::trim();
                std::thread::sleep(Duration::from_secs(1)); // what is being retired settles
                baseline = MemorySnapshot { rebased: true, ..snapshot(&contexts)? };
                println!("rebased {}", json(&baseline));
            }
            Ok(line) if line == "mem" => {
                held.clear();
                let mut now = snapshot(&contexts)?;
                let ok = poll_until(Duration::from_secs(15), || {
                    memory::trim();
                    match snapshot(&contexts) {
                        Ok(s) => {
                            now = s;
                            back_to(&now, &baseline)
                        }
                        Err(_) => false,
                    }
                });
                let verdict = if ok { "ok" } else { "leak" };
                println!("mem {verdict} {}", json(&serde_json::json!({ "now": now, "baseline": baseline })));
            }
            Ok(other) => println!("error unknown command {other}"),
            Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => break,
        }
        for error in receiver.take_errors() {
            println!("conn-error {error:?}");
        }
        // A consumer that comes late: until it reads a message, its sender's transfers wait.
        std::thread::sleep(late);
        match receiver.recv_with_info(Some(Duration::from_millis(50))) {
            Ok((item, info)) => {
                if item.kind == "warm" {
                    println!("warm");
                    continue;
                }
                if item.kind == "verdict" {
                    let seen = seen_by_id.get(&item.id).cloned().unwrap_or_default();
                    let verdict = if !seen.is_empty() && seen == item.checksums { "match" } else { "mismatch" };
                    println!("verdict {} {verdict} {:?} {:?}", item.id, seen, item.checksums);
                    continue;
                }
                let report = check(&item, info.seq, info.sender_pid, within)?;
                seen_by_id.insert(item.id, report.seen.clone());
                println!("report {}", json(&report));
                if hold > 0 && !holding_said {
                    held.push(item);
                    if held.len() >= hold {
                        println!("holding {}", held.len());
                        held.clear();
                        holding_said = true;
                    }
                }
            }
            Err(Error::ProducerFailed { pid, seq, .. }) => println!("producer-failed {pid} {seq}"),
            Err(Error::Timeout) => {}
            // No sender right now; another may still connect.
            Err(Error::Disconnected) => std::thread::sleep(Duration::from_millis(5)),
            Err(error) => println!("recv-error {error:?}"),
        }
    }
    drop(held);
    println!("done");
    Ok(())
}

/// Checks every tensor of `item` against the checksums it carries.
fn check(item: &CrossItem, seq: u64, pid: u32, within: Duration) -> Result<MsgReport> {
    let mut report = MsgReport {
        id: item.id,
        kind: item.kind.clone(),
        seq,
        pid,
        producer: item.checksums.clone(),
        reference: item.reference.clone(),
        note: item.note.clone(),
        ok: true,
        ..MsgReport::default()
    };
    for (i, t) in item.tensors.iter().enumerate() {
        report.paths.push(format!("{:?}", t.path()));
        report.devices.push(device_name(t.device()));
        let stream_device = match t.stream() {
            Some(stream) => stream.context().device().uuid().map_or_else(|e| format!("error {e}"), |u| u.to_string()),
            None => "none".into(),
        };
        report.stream_devices.push(stream_device);
        report.layouts.push(format!("{:?}/{:?}", t.shape(), t.strides()));
        let seen = match received_checksum(t, within) {
            Ok(Some(sum)) => sum,
            Ok(None) => {
                println!("stuck {} tensor {i}: not usable within {within:?}", item.id);
                report.ok = false;
                0
            }
            Err(error) => {
                println!("check-error {} tensor {i}: {error:#}", item.id);
                report.ok = false;
                0
            }
        };
        report.seen.push(seen);
        let mut matches = true;
        for expected in [item.checksums.get(i), item.reference.get(i)].into_iter().flatten() {
            if *expected != seen {
                matches = false;
                report.ok = false;
            }
        }
        // A producer's death may be known a little after the data was read.
        let failed = t.producer_failed() || (!matches && poll_until(Duration::from_secs(2), || t.producer_failed()));
        report.producer_failed |= failed;
    }
    Ok(report)
}

// ---------------------------------------------------------------- forward

fn forward(args: &[String]) -> Result<()> {
    let listen = arg(args, "--listen").context("--listen <path>")?;
    let to = arg(args, "--to").context("--to <path>")?;
    let count = number(args, "--count", 1)? as usize;
    let senders = number(args, "--senders", 2)? as usize;
    let routing = routing_from_args(args)?;
    let uuids = print_visible();
    for uuid in &uuids {
        Kernels::get(&Context::primary(Device::by_uuid(uuid)?)?)?;
    }
    let mut receiver = Receiver::<CrossItem>::builder().routing(routing).bind(&listen)?;
    let onward = (0..senders).map(|_| Sender::<CrossItem>::connect(&to)).collect::<tensor_queue::Result<Vec<_>>>()?;
    println!("ready");
    // One stream of this process per landing GPU, made when first needed.
    let mut streams: Vec<(Uuid, Stream)> = Vec::new();
    let mut forwarded = 0usize;
    let start = Instant::now();
    while forwarded < count {
        ensure!(start.elapsed() < Duration::from_secs(90), "forwarded only {forwarded} of {count} in 90 s");
        let item = match receiver.recv_timeout(Duration::from_millis(100)) {
            Ok(item) => item,
            Err(Error::Timeout | Error::Disconnected) => continue,
            Err(error) => {
                println!("recv-error {error:?}");
                continue;
            }
        };
        let mut copies = Vec::new();
        let mut stream_index = None;
        for t in &item.tensors {
            let TensorDevice::Cuda(uuid) = t.device() else { bail!("a host tensor arrived at the GPU stage") };
            let index = match streams.iter().position(|(u, _)| *u == uuid) {
                Some(index) => index,
                None => {
                    streams.push((uuid, Stream::new(&Context::primary(Device::by_uuid(&uuid)?)?)?));
                    streams.len() - 1
                }
            };
            stream_index = Some(index);
            copies.push(t.copy_on(&streams[index].1)?);
        }
        let report = check(&item, 0, 0, Duration::from_secs(20))?;
        if !report.ok {
            println!("stage-mismatch {}", json(&report));
        }
        if forwarded == 0 {
            println!("stage-paths {:?} devices {:?}", report.paths, report.devices);
        }
        let CrossItem { id, kind, checksums, reference, note, .. } = item; // the received tensors go back here
        let copy = CrossItem { id, kind, tensors: copies, checksums, reference, note };
        let sender = &onward[forwarded % senders];
        match stream_index {
            Some(index) => sender.send_on_timeout(&copy, &streams[index].1, Duration::from_secs(60))?,
            None => sender.send_timeout(&copy, Duration::from_secs(60))?,
        }
        forwarded += 1;
    }
    println!("forwarded {forwarded}");
    for sender in &onward {
        if !sender.wait_released(Duration::from_secs(30)) {
            println!("unreleased {}", sender.outstanding_leases());
        }
    }
    drop(onward);
    println!("done");
    Ok(())
}
