//! The second process of `tests/tests/outside_round6.rs`: an outside user's program over local
//! channels, public API only. Each mode is one role; it reports on stdout, one line a step, and
//! checks what it receives itself. Every mode that waits has a watchdog: with no progress for
//! `--stuck` seconds (default 60) it says "stuck AT" and exits with status 3, so a lost wake-up
//! is a failure with a message, never a hung test.

use std::io::BufRead;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use integration_tests::outside6::{Msg, Rng, Waiter, Way, many_tensors, many_tensors_differ};
use integration_tests::program::{connect, say};
use integration_tests::{arg, number};
use kernels::reference::pattern;
use tensor_queue::testing::wire::{
    Assembler, Descriptors, Frame, MAX_PACKET, Source, StorageDesc, ToReceiver, ToSender, packets,
};
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

/// Message `index` of sender `id`: a `len`-byte pattern tensor when `index % every == 0`.
fn message(id: u32, index: u64, len: usize, every: u64) -> Result<Msg> {
    let tensors = if every != 0 && index.is_multiple_of(every) {
        vec![Tensor::from_bytes(&pattern(len, index), DType::U8, &[len as u64])?]
    } else {
        vec![]
    };
    Ok((id, index, tensors))
}

/// Whether `msg` is what `message(msg.0, msg.1, len, every)` made.
fn intact(msg: &Msg, len: usize, every: u64) -> Result<bool> {
    let (_, index, tensors) = msg;
    if tensors.len() != usize::from(every != 0 && index.is_multiple_of(every)) {
        return Ok(false);
    }
    for tensor in tensors {
        if tensor.to_bytes()? != pattern(len, *index) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Exits with status 3 after saying "stuck AT" when `progress` has not moved for `bound`.
fn watchdog(progress: Arc<AtomicU64>, bound: Duration) {
    std::thread::spawn(move || {
        let mut last = (progress.load(Ordering::Relaxed), Instant::now());
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let now = progress.load(Ordering::Relaxed);
            if now != last.0 {
                last = (now, Instant::now());
            } else if last.1.elapsed() > bound {
                say(&format!("stuck {now}"));
                std::process::exit(3);
            }
        }
    });
}

/// Binds `path` (and `path-1` for the ways that wait on several receivers).
fn bind_for(way: Way, path: &str, capacity: u32) -> Result<Vec<Receiver<Msg>>> {
    let mut paths = vec![path.to_string()];
    if way.several() {
        paths.push(format!("{path}-1"));
    }
    paths.iter().map(|p| Ok(Receiver::<Msg>::builder().capacity(capacity).bind(p)?)).collect()
}

/// Waits until the test closes our stdin (or kills us).
fn wait_for_stdin() {
    let mut line = String::new();
    while std::io::stdin().lock().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
}

/// The lies of the "lie" mode, each about one message of many views of one storage.
const LIES: [&str; 10] = [
    "extra-row",            // one row more than the payload names
    "missing-row",          // one row fewer
    "beyond",               // the last row starts at the storage's end
    "huge-shape",           // a row of 2^40 elements
    "negative-stride",      // a row whose elements run before its storage
    "bad-storage-index",    // a row naming a storage record that does not exist
    "storage-beyond-chunk", // the storage record four times longer than its chunk
    "unknown-chunk",        // the storage record in a chunk never announced
    "overlap-rows",         // every row at the same offset (legal views: delivered, or refused)
    "overlap-storages",     // the rows split over two records of the same bytes
];

/// A table row as `lie` edits it: storage record, view offset, shape, strides.
type Row = (u32, u64, Vec<u64>, Vec<i64>);

/// A frame's bytes and the descriptors that came with it.
type Captured = (Vec<u8>, Vec<std::os::fd::OwnedFd>);

/// What a real sender of this process writes for `(0, 0, many_tensors(0, n))`: the frames before
/// the message (chunk announcements, with their descriptors) and the message.
fn capture(n: usize) -> Result<(Vec<Captured>, ToReceiver)> {
    let path = std::env::temp_dir().join(format!("outside6-capture-{}.sock", std::process::id()));
    let listener = ipc_core::seqpacket::Listener::bind(&path)?;
    let (done_tx, done) = std::sync::mpsc::channel::<()>();
    let sending = {
        let path = path.clone();
        std::thread::spawn(move || -> Result<()> {
            let sender = Sender::<Msg>::connect(&path)?;
            sender.send(&(0, 0, many_tensors(0, n)?))?;
            let _ = done.recv_timeout(Duration::from_secs(60)); // alive until captured
            Ok(())
        })
    };
    let connection = listener.accept(Some(Duration::from_secs(30)))?;
    connection.set_recv_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = vec![0u8; MAX_PACKET + 64];
    connection.recv(&mut buf)?; // its Hello
    connection.send(&integration_tests::raw::hello(16, 0x6f75_7436).encode(), &[])?;
    let mut assembler = Assembler::default();
    let mut preamble = Vec::new();
    let message = loop {
        let (len, fds) = connection.recv(&mut buf)?;
        if len == 0 {
            bail!("the sender hung up before its message");
        }
        match assembler.push::<ToReceiver>(&buf[..len], fds) {
            Ok(Some((frame @ ToReceiver::Message { .. }, _))) => break frame,
            Ok(Some((frame, fds))) => preamble.push((frame.encode(), fds)),
            Ok(None) => {}
            Err(error) => bail!("capturing: {error:?} (is TQ_RINGS=0 set?)"),
        }
    };
    drop(done_tx);
    sending.join().map_err(|_| anyhow::anyhow!("the capturing sender panicked"))??;
    Ok((preamble, message))
}

/// The captured message with lie `name` told in its table.
fn lie(name: &str, message: &ToReceiver, preamble: &[Captured]) -> Result<ToReceiver> {
    let ToReceiver::Message { seq, sent_ns, encoded_ns, tensors, payload } = message.clone() else {
        bail!("not a message");
    };
    let chunk_len = preamble
        .iter()
        .find_map(|(bytes, _)| match ToReceiver::decode(bytes) {
            Ok(ToReceiver::Chunk { len, .. }) => Some(len),
            _ => None,
        })
        .unwrap_or(1 << 20);
    let rows = tensors.len();
    let row = |t: &Descriptors, i: usize| (t.tensors()[i], t.shape(i).to_vec(), t.strides(i).to_vec());
    // A copy of the table with `edit` applied to each row and `storages` as its records.
    let rebuild = |storages: Vec<StorageDesc>, keep: usize, edit: &dyn Fn(usize, &mut Row)| {
        let mut table = Descriptors::default();
        for s in storages {
            table.push_storage(s);
        }
        for i in 0..keep {
            let (desc, shape, strides) = row(&tensors, i.min(rows - 1));
            let mut r = (desc.storage, desc.view_offset, shape, strides);
            edit(i, &mut r);
            table.push_tensor(r.0, r.1, desc.dtype, &r.2, &r.3);
        }
        table
    };
    let storages = tensors.storages().to_vec();
    let storage_len = storages[0].len;
    let table = match name {
        "honest" => tensors.clone(),
        "extra-row" => rebuild(storages, rows + 1, &|_, _| {}),
        "missing-row" => rebuild(storages, rows - 1, &|_, _| {}),
        "beyond" => rebuild(storages, rows, &|i, r| {
            if i == rows - 1 {
                r.1 = storage_len;
            }
        }),
        "huge-shape" => rebuild(storages, rows, &|i, r| {
            if i == rows / 2 {
                r.2 = vec![1 << 40];
                r.3 = vec![1];
            }
        }),
        "negative-stride" => rebuild(storages, rows, &|i, r| {
            if i == 3 {
                r.1 = 0;
                r.3 = vec![-1];
            }
        }),
        "bad-storage-index" => {
            let records = storages.len() as u32;
            rebuild(storages, rows, &|i, r| {
                if i == 7 {
                    r.0 = records;
                }
            })
        }
        "storage-beyond-chunk" => {
            let mut storages = storages;
            storages[0].len = chunk_len * 4;
            rebuild(storages, rows, &|_, _| {})
        }
        "unknown-chunk" => {
            let mut storages = storages;
            if let Source::SameDevice { chunk, .. } | Source::Host { chunk, .. } = &mut storages[0].source {
                *chunk += 1000;
            }
            rebuild(storages, rows, &|_, _| {})
        }
        "overlap-rows" => rebuild(storages, rows, &|_, r| r.1 = 0),
        "overlap-storages" => {
            let mut storages = storages;
            storages.push(storages[0]);
            rebuild(storages, rows, &|i, r| {
                if i % 2 == 1 {
                    r.0 = 1;
                }
            })
        }
        other => bail!("unknown lie {other}"),
    };
    Ok(ToReceiver::Message { seq, sent_ns, encoded_ns, tensors: table, payload })
}

/// What a raw sender's connection hears within 5 s after its message: a rejection, the
/// receiver's Close, a hang-up, the message's release (delivered and dropped), or nothing.
fn answer(connection: &ipc_core::seqpacket::Connection) -> String {
    let _ = connection.set_recv_timeout(Some(Duration::from_millis(200)));
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut buf = vec![0u8; MAX_PACKET + 64];
    let mut assembler = Assembler::default();
    while Instant::now() < deadline {
        match connection.recv(&mut buf) {
            Ok((0, _)) => return "hung-up".into(),
            Ok((len, fds)) => match assembler.push::<ToSender>(&buf[..len], fds) {
                Ok(Some((ToSender::Rejected { reason, .. }, _))) => return format!("rejected {reason}"),
                Ok(Some((ToSender::Close { reason, .. }, _))) => return format!("closed {reason}"),
                Ok(Some((ToSender::Release { .. }, _))) => return "released".into(),
                Ok(_) => {}
                // A frame of the link itself (the rings' offer), not ToSender's: not the answer.
                Err(tensor_queue::FrameError::WrongDirection { .. }) => assembler = Assembler::default(),
                Err(error) => return format!("garbled {error:?}"),
            },
            Err(ipc_core::Error::PeerGone) => return "hung-up".into(),
            Err(_) => {} // the short timeout: ask again
        }
    }
    "none".into()
}

fn main() -> Result<()> {
    integration_tests::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("");
    let to = || arg(&args, "--to").context("--to PATH");
    let progress = Arc::new(AtomicU64::new(0));
    watchdog(progress.clone(), Duration::from_secs(number(&args, "--stuck", 60)?));
    match mode {
        // The other end of a ping-pong: binds `--bind` (and `--bind`-1 for select and poll),
        // says "bound", connects to `--to` (two senders with `--two-senders`, used in turn), and
        // `--count` times waits in `--way` for message (0, I), sleeps a random 0-200 us half the
        // time (`--seed`), and answers (1, I) (a 64-byte tensor every 16th). Says "done COUNT
        // IDLE" (IDLE: waits that ended without a message), then waits for stdin to close.
        "pong" => {
            let way = Way::parse(&arg(&args, "--way").context("--way")?).context("unknown --way")?;
            let (count, seed) = (number(&args, "--count", 20_000)?, number(&args, "--seed", 1)?);
            let receivers = bind_for(way, &arg(&args, "--bind").context("--bind PATH")?, 4)?;
            let mut waiter = Waiter::new(way, receivers, seed)?;
            say("bound");
            let path = to()?;
            let mut senders = vec![connect::<Msg>(&path)?];
            if args.iter().any(|a| a == "--two-senders") {
                senders.push(connect::<Msg>(&path)?);
            }
            let mut rng = Rng::new(seed ^ 0xfeed);
            for index in 0..count {
                let msg = waiter.wait().with_context(|| format!("waiting ({way:?}) for round trip {index}"))?;
                if msg.0 != 0 || msg.1 != index || !intact(&msg, 64, 16)? {
                    bail!("round trip {index}: got ({}, {}) with {} tensors", msg.0, msg.1, msg.2.len());
                }
                drop(msg);
                rng.jitter();
                senders[(index % senders.len() as u64) as usize].send(&message(1, index, 64, 16)?)?;
                progress.store(index + 1, Ordering::Relaxed);
            }
            say(&format!("done {count} {}", waiter.idle));
            wait_for_stdin();
        }
        // A sender the test drives by lines on stdin: connects to `--to` as sender `--id`,
        // waits for the greeting, says "ready"; "send I" sends message I (a `--len`-byte tensor
        // every `--every`) and says "sent I"; "exit" (or stdin closed) drops it and exits.
        "manual" => {
            let sender = connect::<Msg>(&to()?)?;
            sender.wait_ready(Duration::from_secs(60)).context("wait_ready")?;
            let (id, len, every) =
                (number(&args, "--id", 0)? as u32, number(&args, "--len", 64)? as usize, number(&args, "--every", 1)?);
            say("ready");
            for line in std::io::stdin().lock().lines() {
                let line = line?;
                progress.fetch_add(1, Ordering::Relaxed);
                if let Some(index) = line.strip_prefix("send ") {
                    let index = index.trim().parse()?;
                    sender.send(&message(id, index, len, every)?)?;
                    say(&format!("sent {index}"));
                } else if line == "exit" {
                    break;
                }
            }
            drop(sender);
            say("left");
        }
        // Streams messages as sender `--id` to `--to` as fast as it can (a `--len`-byte tensor
        // every `--every`), saying "sent I" every `--say-every` sends (default 100), until killed.
        "stream" => {
            let sender = connect::<Msg>(&to()?)?;
            let (id, len, every) =
                (number(&args, "--id", 0)? as u32, number(&args, "--len", 64)? as usize, number(&args, "--every", 1)?);
            let say_every = number(&args, "--say-every", 100)?.max(1);
            say("ready");
            for index in 0.. {
                sender.send(&message(id, index, len, every)?)?;
                progress.store(index, Ordering::Relaxed);
                if index % say_every == 0 {
                    say(&format!("sent {index}"));
                }
            }
        }
        // `--threads` threads, each with a sender of its own connected to `--to` and, without
        // waiting for anything, `--count` messages sent at once (sender id = thread number, a
        // `--len`-byte tensor every `--every`). Says "thread T ok" or "thread T error E" for
        // each, then "done", and returns from `main` (its senders dropped right after their last
        // send) unless `--stay`.
        "burst" => {
            let path = to()?;
            let (threads, count, len, every) = (
                number(&args, "--threads", 8)? as u32,
                number(&args, "--count", 1000)?,
                number(&args, "--len", 64)? as usize,
                number(&args, "--every", 1)?,
            );
            // `--id-base B`: thread T is sender B + T; `--jitter SEED`: a random 0-200 us sleep
            // before half the sends.
            let base = number(&args, "--id-base", 0)? as u32;
            let jitter = arg(&args, "--jitter").map(|s| s.parse::<u64>()).transpose()?;
            let start = Arc::new(std::sync::Barrier::new(threads as usize));
            let workers: Vec<_> = (base..base + threads)
                .map(|id| {
                    let (path, start, progress) = (path.clone(), start.clone(), progress.clone());
                    std::thread::spawn(move || -> Result<()> {
                        let sender = connect::<Msg>(&path)?;
                        let mut rng = jitter.map(|seed| Rng::new(seed ^ u64::from(id)));
                        start.wait(); // every thread's first messages at the same moment
                        for index in 0..count {
                            if let Some(rng) = &mut rng {
                                rng.jitter();
                            }
                            sender
                                .send(&message(id, index, len, every)?)
                                .with_context(|| format!("sender {id} message {index}"))?;
                            progress.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(())
                    })
                })
                .collect();
            let mut failed = false;
            for (id, worker) in workers.into_iter().enumerate() {
                match worker.join().map_err(|_| anyhow::anyhow!("a sender thread panicked"))? {
                    Ok(()) => say(&format!("thread {id} ok")),
                    Err(error) => {
                        failed = true;
                        say(&format!("thread {id} error {error:#}"));
                    }
                }
            }
            say("done");
            if failed {
                bail!("a sender thread failed");
            }
            if args.iter().any(|a| a == "--stay") {
                wait_for_stdin();
            }
        }
        // `--count` messages of `--tensors` small host tensors each (`many_tensors`), as sender
        // `--id`, to `--to`; says "sent I" after each, then "done", and waits for stdin to close
        // (with `--released`, first "released true|false" after `wait_released(60 s)`).
        "many" => {
            let sender = connect::<Msg>(&to()?)?;
            let (id, count, n) =
                (number(&args, "--id", 0)? as u32, number(&args, "--count", 8)?, number(&args, "--tensors", 1024)?);
            for index in 0..count {
                sender.send(&(id, index, many_tensors(index, n as usize)?))?;
                progress.store(index + 1, Ordering::Relaxed);
                say(&format!("sent {index}"));
            }
            say("done");
            if args.iter().any(|a| a == "--released") {
                say(&format!("released {}", sender.wait_released(Duration::from_secs(60))));
            }
            wait_for_stdin();
        }
        // Binds `--to` and receives `--count` many-tensor messages of `--tensors` tensors,
        // holding every one, then checks them all: "ok COUNT" or "bad WHAT".
        "hold-many" => {
            let mut receiver =
                Receiver::<Msg>::builder().capacity(number(&args, "--capacity", 64)? as u32).bind(to()?)?;
            let (count, n) = (number(&args, "--count", 8)?, number(&args, "--tensors", 1024)? as usize);
            say("bound");
            let mut held = Vec::new();
            while (held.len() as u64) < count {
                match receiver.recv() {
                    Ok(msg) => {
                        progress.fetch_add(1, Ordering::Relaxed);
                        held.push(msg);
                    }
                    Err(Error::Disconnected) => break,
                    Err(other) => bail!("after {} messages: {other:?}", held.len()),
                }
            }
            for (next, msg) in (0u64..).zip(&held) {
                if msg.1 != next {
                    say(&format!("bad order: message {} where {next} was due", msg.1));
                    return Ok(());
                }
                if let Some(diff) = many_tensors_differ(msg.1, n, &msg.2) {
                    say(&format!("bad {diff}"));
                    return Ok(());
                }
            }
            say(&format!("ok {}", held.len()));
            wait_for_stdin();
        }
        // A peer that lies in a table of many rows: first captures, as a raw receiver of its own,
        // the frames a real sender of this process writes for one message of `--tensors` views
        // of one storage (run it with TQ_RINGS=0, so that they come on the socket), then replays
        // them to the receiver at `--to` on a fresh raw connection per case: "honest" as
        // captured, then each lie of `LIES`. For each case it says "case NAME" and then what its
        // connection heard within 5 s: "answer NAME rejected|closed|hung-up|released|none ...".
        "lie" => {
            let n = number(&args, "--tensors", 1024)? as usize;
            let (preamble, message) = capture(n)?;
            say(&format!("captured {} frames before the message", preamble.len()));
            let path = to()?;
            let cases = std::iter::once("honest").chain(LIES.iter().copied());
            for name in cases {
                let frame = lie(name, &message, &preamble)?;
                let connection = integration_tests::raw::raw_client(std::path::Path::new(&path));
                for (bytes, fds) in &preamble {
                    let fds: Vec<_> = fds.iter().map(std::os::fd::AsFd::as_fd).collect();
                    connection.send(bytes, &fds)?;
                }
                say(&format!("case {name}"));
                for packet in packets(&frame.encode()) {
                    if connection.send(&packet, &[]).is_err() {
                        break; // closed on us mid-frame: the answer says so
                    }
                }
                say(&format!("answer {name} {}", answer(&connection)));
                progress.fetch_add(1, Ordering::Relaxed);
            }
            say("done");
            wait_for_stdin();
        }
        other => bail!("unknown mode {other:?}"),
    }
    Ok(())
}
