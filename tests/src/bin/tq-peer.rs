//! The second process of the tensor-queue tests: `tq-peer <role> [options]`.
//!
//! Roles:
//! - `checksum --reply P`: receive `Probe`s from the parent ([`tensor_queue::from_parent`]) and
//!   answer each with a `Report` of checksums (computed on the GPU for GPU tensors) sent to `P`;
//! - `hold --reply P`: the same, but keep every tensor and never exit (to be killed);
//! - `send --to P --count N --seed S [--gpu] [--die]`: connect to a receiver at `P` and send `N`
//!   probes; with `--die`, abort right after the last one, without any clean-up;
//! - `double`: started with `spawn_duplex`: answer each number with twice it, until the parent
//!   hangs up;
//! - `soak`: receive `SoakItem`s and check every byte on the GPU, then print the count;
//! - `echo --reply P`: answer each `BenchItem` once its tensors are usable on the stream (round trips);
//! - `usable --reply P`: answer each `BenchItem` once its tensors are usable, synchronising the
//!   stream first (the data is on the GPU and the GPU's work is done: broadcast, set-up);
//! - `drain --reply P --count N [--no-read] [--in-flight K]`: a pipelined consumer: make each item
//!   usable, queue a read of it on the GPU and an event after it, and go on to the next, with at
//!   most K (default 4) reads queued; a watcher thread notes when each event completes, and one
//!   answer with every (sent, read) pair goes back at the end.
//!
//! The benchmark roles also take `--spin-us U` (spin before sleeping in `recv`), `--capacity C`,
//! and `--listen PATH` (bind a receiver there for new channels instead of using the parent's,
//! answering `u64::MAX` once it listens).

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::arg;
use integration_tests::queue::{BenchAck, BenchItem, Probe, Report, SoakItem, checksum, probe};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use ipc_core::{Context, DeviceBuffer, DeviceMemory, Event, Stream};
use kernels::{Kernels, reference};
use tensor_queue::{
    DEFAULT_CAPACITY, DType, Error, MessageInfo, Receiver, Sender, Tensor, from_parent, from_parent_with_capacity,
    monotonic_ns,
};

fn main() {
    integration_tests::init_logging();
    if let Err(error) = run() {
        eprintln!("tq-peer: {error:#}");
        std::process::exit(1);
    }
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
        "double" => double(),
        "echo" | "usable" | "drain" => bench_peer(role, &args),
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
    let mut fds_early = 0;
    loop {
        let item = match items.recv() {
            Ok(item) => item,
            Err(Error::Disconnected) => break,
            Err(error) => return Err(error.into()),
        };
        if count == 1000 {
            fds_early = open_fds();
        }
        // Every byte of the first thousand and of every sixteenth after them.
        if count > 1000 && !count.is_multiple_of(16) {
            count += 1;
            continue;
        }
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
    println!("soak ok {count} fds {fds_early} {}", open_fds());
    Ok(())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count())
}

fn bench_peer(role: &str, args: &[String]) -> Result<()> {
    let reply = arg(args, "--reply").context("--reply <path>")?;
    let number = |name: &str, default: u64| -> Result<u64> {
        arg(args, name).map_or(Ok(default), |v| v.parse().with_context(|| format!("{name} {v}")))
    };
    let capacity = number("--capacity", u64::from(DEFAULT_CAPACITY))? as u32;
    // Ready before anything arrives: context, stream and kernels made, as a serving process would
    // be. The context is held for the whole run: dropping its last handle would destroy it.
    let context = if cuda_sys::is_available() { Some(Context::on_ordinal(0)?) } else { None };
    let acks = Sender::<BenchAck>::connect(reply)?;
    let mut items = match arg(args, "--listen") {
        Some(path) => {
            let items = Receiver::<BenchItem>::bind_with_capacity(path, capacity)?;
            acks.send(&BenchAck { id: u64::MAX, ..Default::default() })?;
            items
        }
        None => from_parent_with_capacity::<BenchItem>(capacity)?,
    };
    let spin = Duration::from_micros(number("--spin-us", 0)?);
    items.set_spin(spin);
    acks.set_spin(spin);
    if let Some(context) = &context {
        // One stream for every sender's tensors, made before the first message: the consumer's
        // reads are queued on it, after the waits for the producers' work.
        items.set_stream(Arc::new(Stream::new(context)?))?;
        Kernels::get(context)?;
    }
    if role == "drain" {
        let read = !args.iter().any(|a| a == "--no-read");
        let limit = number("--in-flight", 4)?.max(1) as usize;
        return drain(items, &acks, number("--count", 0)?, context.as_ref(), read, limit);
    }
    while let Some((item, info)) = next_item(&mut items)? {
        if role == "usable" {
            for tensor in &item.tensors {
                if let Some(stream) = tensor.stream() {
                    stream.synchronize()?;
                }
            }
        }
        let usable_ns = monotonic_ns();
        let stages_ns = vec![info.sent_ns, info.encoded_ns, info.arrived_ns, info.imported_ns, info.decoded_ns];
        acks.send(&BenchAck { id: item.id, usable_ns, stages_ns, ..Default::default() })?;
    }
    Ok(())
}

/// The next item, however long it takes, or `None` once every sender is gone. Each idle second
/// it prints the errors of connections the receiver closed, so a peer waiting on a message that
/// will never come says why.
fn next_item(items: &mut Receiver<BenchItem>) -> Result<Option<(BenchItem, MessageInfo)>> {
    loop {
        match items.recv_with_info(Some(Duration::from_secs(1))) {
            Ok(received) => return Ok(Some(received)),
            Err(Error::Timeout) => items.take_errors().iter().for_each(|error| eprintln!("tq-peer: {error}")),
            Err(Error::Disconnected) => return Ok(None),
            Err(error) => return Err(error.into()),
        }
    }
}

/// The streaming consumer: `count` items, each made usable and read on the GPU (or summed on the
/// CPU for host tensors) without waiting; a watcher thread stamps when each read is done.
fn drain(
    mut items: Receiver<BenchItem>,
    acks: &Sender<BenchAck>,
    count: u64,
    context: Option<&Arc<Context>>,
    read: bool,
    limit: usize,
) -> Result<()> {
    let gpu = match context {
        Some(context) => {
            // The stream set above, which every sender's tensors are ordered on.
            let stream = items.work_stream(&context.device().uuid()?)?;
            let counter = DeviceBuffer::alloc(context, 8)?;
            Some((context.clone(), stream, Kernels::get(context)?, counter))
        }
        None => None,
    };
    let (done, watched) = mpsc::channel::<(u64, Option<Event>)>();
    let (recycle, recycled) = mpsc::channel::<Event>();
    let watcher = std::thread::spawn(move || -> Result<Vec<(u64, u64)>> {
        let mut completions = Vec::new();
        for (sent_ns, event) in watched {
            if let Some(event) = event {
                event.synchronize()?;
                let _ = recycle.send(event);
            }
            completions.push((sent_ns, monotonic_ns()));
        }
        Ok(completions)
    });
    let mut host_sum = 0u64;
    let mut events = 0;
    // CPU time per step, in total: receive (waiting included), read, completion event, drop.
    let mut steps_ns = [0u64; 4];
    let mut lap = {
        let mut last = monotonic_ns();
        move |step: &mut u64| {
            let now = monotonic_ns();
            *step += now - last;
            last = now;
        }
    };
    for received in 0..count {
        lap(&mut steps_ns[3]);
        let (item, info) =
            next_item(&mut items)?.with_context(|| format!("the producer left after {received} items"))?;
        lap(&mut steps_ns[0]);
        let event = match &gpu {
            Some((context, stream, kernels, counter)) => {
                if read {
                    for tensor in &item.tensors {
                        kernels.read(&tensor.cuda_view()?, 0, tensor.nbytes(), counter, stream)?;
                    }
                }
                lap(&mut steps_ns[1]);
                // At most `limit` events, so at most `limit` reads queued on the GPU: a bounded
                // queue keeps latency bounded.
                let event = match recycled.try_recv() {
                    Ok(event) => event,
                    Err(_) if events < limit => {
                        events += 1;
                        Event::new(context)?
                    }
                    Err(_) => recycled.recv()?,
                };
                event.record(stream)?;
                Some(event)
            }
            None => {
                for tensor in item.tensors.iter().filter(|_| read) {
                    host_sum = host_sum.wrapping_add(reference::word_sum(&tensor.to_vec::<u8>()?));
                }
                lap(&mut steps_ns[1]);
                None
            }
        };
        done.send((info.sent_ns, event))?;
        lap(&mut steps_ns[2]);
        drop(item);
    }
    lap(&mut steps_ns[3]);
    drop(done);
    let completions = watcher.join().map_err(|_| anyhow::anyhow!("the watcher panicked"))??;
    let usable_ns = completions.last().map_or(0, |&(_, at)| at);
    std::hint::black_box(host_sum);
    let flat: Vec<i64> = completions.iter().flat_map(|&(sent, done)| [sent as i64, done as i64]).collect();
    let completions = Some(Tensor::from_slice(&flat, DType::I64, &[completions.len() as u64, 2])?);
    acks.send(&BenchAck { id: count, usable_ns, completions, stages_ns: steps_ns.to_vec() })?;
    // Stay until the producer hangs up, so its last leases come back through a live peer.
    while !matches!(items.recv(), Err(Error::Disconnected)) {}
    Ok(())
}

fn double() -> Result<()> {
    let (mut numbers, answers) = tensor_queue::from_parent_duplex::<u64, u64>()?;
    loop {
        match numbers.recv() {
            Ok(n) => answers.send(&(n * 2))?,
            Err(Error::Disconnected) => return Ok(()),
            Err(error) => return Err(error.into()),
        }
    }
}
