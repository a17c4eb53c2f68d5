//! The second process of `tests/tests/outside_round5.rs`: an outside user's program that uses only
//! the public API of tensor-queue over local (Unix socket) channels, which carry their
//! per-message traffic through shared-memory rings unless `TQ_RINGS=0`. Each mode is one role;
//! it reports on stdout, one line a step, and checks what it receives itself.
//!
//! Messages are `(sender, index, tensors)`: a tensor of message `index` holds
//! `kernels::reference::pattern(len, index)`.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use integration_tests::{arg, number};
use kernels::reference::pattern;
use tensor_queue::{DType, Error, Receiver, Sender, Tensor};

/// One message: which sender (of the process or test), its index, its tensors.
type Msg = (u32, u64, Vec<Tensor>);

/// Prints one line and flushes it, so the test sees each step as it happens.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Connects, retrying while the other side is not bound yet, and waits for its greeting.
fn connect(path: &str) -> Result<Sender<Msg>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Sender::<Msg>::connect(path) {
            Ok(sender) => {
                sender.wait_ready(Duration::from_secs(60)).context("wait_ready")?;
                return Ok(sender);
            }
            // Not bound yet: try again; anything else is the answer.
            Err(Error::NoReceiver { .. }) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e).context("connect"),
        }
    }
}

/// Message `index` of sender `id`: a tensor of `len` pattern bytes when `index % every == 0`.
fn message(id: u32, index: u64, len: usize, every: u64) -> Result<Msg> {
    let tensors = if every != 0 && index.is_multiple_of(every) {
        vec![Tensor::from_bytes(&pattern(len, index), DType::U8, &[len as u64])?]
    } else {
        vec![]
    };
    Ok((id, index, tensors))
}

/// The size of message `index` in the mixed stream: tiny, 100 KB, 10 MB in turn.
fn mixed_len(index: u64) -> usize {
    [16, 100_000, 10_000_000][(index % 3) as usize]
}

/// How many tensors message `index` of the "wide" stream has: a cycle around the rings' size.
fn wide_count(index: u64) -> usize {
    [0, 1, 500, 2300, 2500, 2700, 3000, 10_000][(index % 8) as usize]
}

/// Whether `msg`'s tensors are exactly what its sender put in it.
fn intact(msg: &Msg, len: impl Fn(u64) -> usize, every: u64) -> Result<bool> {
    let (_, index, tensors) = msg;
    let expected = every != 0 && index.is_multiple_of(every);
    if tensors.len() != usize::from(expected) {
        return Ok(false);
    }
    for tensor in tensors {
        if tensor.to_bytes()? != pattern(len(*index), *index) {
            return Ok(false);
        }
    }
    Ok(true)
}

fn kill_myself() -> Result<()> {
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL)?;
    bail!("still alive after SIGKILL")
}

/// Waits until the test closes our stdin (or kills us).
fn wait_for_stdin() {
    let mut line = String::new();
    while std::io::stdin().lock().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
}

/// Open descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// This process's resident memory in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok()))
        .unwrap_or(0)
}

/// Mappings of this process.
fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0)
}

/// Lowers this process's soft RLIMIT_NOFILE to `limit` (the hard limit stays).
fn lower_fd_limit(limit: u64) -> Result<()> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let hard = getrlimit(Resource::Nofile).maximum;
    Ok(setrlimit(Resource::Nofile, Rlimit { current: Some(limit), maximum: hard })?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("");
    // Any mode: `--fd-limit N` runs it with at most N descriptors.
    if let Some(limit) = arg(&args, "--fd-limit") {
        lower_fd_limit(limit.parse()?)?;
    }
    let to = || arg(&args, "--to").context("--to PATH");
    match mode {
        // Sends `--count` messages as sender `--id` (a `--len`-byte tensor every `--every`), saying "sent I" after
        // each send returned. With `--kill-after K` it SIGKILLs itself right after send K
        // returned (after `wait_written`, saying "written true|false", with `--wait-written`);
        // else it says "done" (then "released true|false" after `wait_released(60 s)` with
        // `--wait-released`) and, with `--exit`, exits, or waits for stdin to close.
        "burst" => {
            let sender = connect(&to()?)?;
            let (count, len, every) =
                (number(&args, "--count", 1000)?, number(&args, "--len", 64)? as usize, number(&args, "--every", 1)?);
            let kill_after = arg(&args, "--kill-after").map(|k| k.parse::<u64>()).transpose()?;
            let (quiet, id) = (args.iter().any(|a| a == "--quiet"), number(&args, "--id", 0)? as u32);
            say("ready");
            for index in 0..count {
                sender.send(&message(id, index, len, every)?)?;
                if kill_after == Some(index) {
                    if args.iter().any(|a| a == "--wait-written") {
                        say(&format!("written {}", sender.wait_written(Duration::from_secs(30))));
                    }
                    kill_myself()?;
                }
                if !quiet {
                    say(&format!("sent {index}"));
                }
            }
            say("done");
            if args.iter().any(|a| a == "--wait-released") {
                say(&format!("released {}", sender.wait_released(Duration::from_secs(60))));
            }
            if args.iter().any(|a| a == "--exit") {
                return Ok(()); // drops the sender: the README says `main` may return right after a send
            }
            wait_for_stdin();
        }
        // `--threads` senders of this process, one per thread, each its own connection, each
        // sending `--count` messages; says "done" once every thread finished.
        "threads" => {
            let path = to()?;
            let (threads, count, len, every) = (
                number(&args, "--threads", 4)? as u32,
                number(&args, "--count", 1000)?,
                number(&args, "--len", 64)? as usize,
                number(&args, "--every", 1)?,
            );
            let spread = args.iter().any(|a| a == "--spread");
            let workers: Vec<_> = (0..threads)
                .map(|id| {
                    // `--spread`: thread I sends to `PATH-I` instead.
                    let path = if spread { format!("{path}-{id}") } else { path.clone() };
                    std::thread::spawn(move || -> Result<()> {
                        let sender = connect(&path)?;
                        for index in 0..count {
                            sender
                                .send(&message(id, index, len, every)?)
                                .with_context(|| format!("sender {id} message {index}"))?;
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
                        say(&format!("thread {id} typed {:?}", error.downcast_ref::<Error>()));
                    }
                }
            }
            say("done");
            if failed {
                bail!("a sender thread failed");
            }
        }
        // Tiny, 100 KB and 10 MB tensors interleaved on one channel, `--count` messages.
        "mixed" => {
            let sender = connect(&to()?)?;
            for index in 0..number(&args, "--count", 30)? {
                let len = mixed_len(index);
                let tensor = Tensor::from_bytes(&pattern(len, index), DType::U8, &[len as u64])?;
                sender.send(&(0, index, vec![tensor]))?;
            }
            say("done");
            wait_for_stdin();
        }
        // Connects (without waiting for the greeting, or after it with `--ready`) and SIGKILLs
        // itself at once: a sender that joined and died before sending anything.
        "connect-die" => {
            let sender = Sender::<Msg>::connect(to()?)?;
            if args.iter().any(|a| a == "--ready") {
                sender.wait_ready(Duration::from_secs(30))?;
            }
            kill_myself()?;
        }
        // Messages of many tiny tensors, so that their frames are around and beyond the rings'
        // size: message I has `wide_count(I)` tensors of 8 pattern bytes each; `--count` of them.
        "wide" => {
            let sender = connect(&to()?)?;
            for index in 0..number(&args, "--count", 14)? {
                let tensors = (0..wide_count(index))
                    .map(|_| Tensor::from_bytes(&pattern(8, index), DType::U8, &[8]))
                    .collect::<tensor_queue::Result<Vec<_>>>()?;
                sender.send(&(0, index, tensors))?;
            }
            say("done");
            wait_for_stdin();
        }
        // A sender that meets a full queue: `try_send`, then `send_timeout` (50 ms) while the
        // receiver does not read, until each of its `--count` messages is in. Says how often each
        // answered "no room", typed (`Full`, `Timeout`); any other error ends it.
        "credits" => {
            let sender = connect(&to()?)?;
            let (id, count) = (number(&args, "--id", 0)? as u32, number(&args, "--count", 500)?);
            let (mut full, mut timeouts) = (0u64, 0u64);
            say("ready");
            for index in 0..count {
                let msg = message(id, index, 32, 2)?;
                loop {
                    match sender.try_send(&msg) {
                        Ok(()) => break,
                        Err(Error::Full) => full += 1,
                        Err(other) => bail!("try_send {index}: {other:?}"),
                    }
                    match sender.send_timeout(&msg, Duration::from_millis(50)) {
                        Ok(()) => break,
                        Err(Error::Timeout) => timeouts += 1,
                        Err(other) => bail!("send_timeout {index}: {other:?}"),
                    }
                }
            }
            say(&format!("full {full} timeout {timeouts}"));
            say("done");
        }
        // Binds `--to` (capacity `--capacity`), says "bound", receives and checks each message
        // ("got SENDER INDEX" or "bad SENDER INDEX", bad also out of its sender's order; `--mixed` for the mixed stream's sizes),
        // with `--stop-after N` stops reading after N messages ("stopped") until killed, with
        // `--drop-after N` drops the receiver after N ("dropped", then "held N whole true|false"),
        // and "end" at the end of the stream (after `--senders` senders left), then "error E"
        // for each of `take_errors`. A message refused alone is counted ("rejected N" at the end).
        // With `--quiet` only "count N" and "rejected N" at the end, not each message.
        "receive" => {
            let path = to()?;
            let mut receiver =
                Receiver::<Msg>::builder().capacity(number(&args, "--capacity", 64)? as u32).bind(&path)?;
            // `--senders 0`: no count; the stream ends when every sender that joined has left.
            match number(&args, "--senders", 1)? {
                0 => {}
                senders => receiver.expect_senders(senders as usize),
            }
            let (mixed, quiet) = (args.iter().any(|a| a == "--mixed"), args.iter().any(|a| a == "--quiet"));
            let (len, every) = (number(&args, "--len", 64)? as usize, number(&args, "--every", 1)?);
            let stop_after = arg(&args, "--stop-after").map(|k| k.parse::<u64>()).transpose()?;
            let drop_after = arg(&args, "--drop-after").map(|k| k.parse::<u64>()).transpose()?;
            say("bound");
            let mut held = Vec::new();
            let (mut count, mut rejected) = (0u64, 0u64);
            let mut next = std::collections::BTreeMap::new();
            loop {
                match receiver.recv_timeout(Duration::from_secs(60)) {
                    Ok(msg) => {
                        // `--mixed`: sender 0's messages are the mixed stream.
                        let ok = if mixed && msg.0 == 0 {
                            intact(&msg, mixed_len, 1)?
                        } else {
                            intact(&msg, |_| len, every)?
                        };
                        count += 1;
                        // Each sender's messages in order, none repeated (a gap is a loss, which
                        // the count shows, or a message refused alone).
                        let expected = next.entry(msg.0).or_insert(0u64);
                        let ok = ok && msg.1 >= *expected;
                        *expected = msg.1 + 1;
                        if !ok {
                            say(&format!("bad {} {}", msg.0, msg.1));
                        } else if !quiet {
                            say(&format!("got {} {}", msg.0, msg.1));
                        }
                        held.push(msg);
                        held.truncate(16); // holds its first few, as a consumer that keeps some does
                        if drop_after == Some(count) {
                            // Drops the receiver but keeps its process and what it holds.
                            drop(receiver);
                            say("dropped");
                            std::thread::sleep(Duration::from_millis(500));
                            let whole = held.iter().all(|m| intact(m, |_| len, every).unwrap_or(false));
                            say(&format!("held {} whole {whole}", held.len()));
                            wait_for_stdin();
                            return Ok(());
                        }
                        if stop_after == Some(count) {
                            say("stopped");
                            wait_for_stdin(); // stops reading, holding what it has, until killed
                            return Ok(());
                        }
                    }
                    Err(Error::Disconnected) => break,
                    // About one message only: the next `recv` goes on with the next.
                    Err(error @ (Error::Rejected { .. } | Error::ProducerFailed { .. })) => {
                        rejected += 1;
                        if !quiet {
                            say(&format!("rejected {error:?}"));
                        }
                    }
                    Err(other) => {
                        say(&format!("recv error {other:?}"));
                        break;
                    }
                }
            }
            say(&format!("count {count}"));
            say(&format!("rejected {rejected}"));
            say("end");
            for error in receiver.take_errors() {
                say(&format!("error {error:?}"));
            }
            wait_for_stdin();
        }
        // Binds `--to` and receives for ever from whoever connects (checking each message, a
        // `--len`-byte tensor every `--every`); each line "report" on stdin is answered with
        // "report COUNT BAD FDS MAPS RSS" (messages so far, wrong ones, open descriptors,
        // mappings, resident KiB).
        "serve" => {
            let mut receiver =
                Receiver::<Msg>::builder().capacity(number(&args, "--capacity", 64)? as u32).bind(to()?)?;
            let (len, every) = (number(&args, "--len", 64)? as usize, number(&args, "--every", 1)?);
            let (asks, asked) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in std::io::stdin().lock().lines().map_while(std::result::Result::ok) {
                    if asks.send(line).is_err() {
                        break;
                    }
                }
            });
            say("bound");
            let (mut count, mut bad) = (0u64, 0u64);
            loop {
                match receiver.recv_timeout(Duration::from_millis(20)) {
                    Ok(msg) => {
                        count += 1;
                        bad += u64::from(!intact(&msg, |_| len, every)?);
                    }
                    Err(Error::Timeout | Error::Disconnected) => {}
                    Err(other) => say(&format!("recv error {other:?}")),
                }
                match asked.try_recv() {
                    Ok(_) => say(&format!("report {count} {bad} {} {} {}", open_fds(), mappings(), rss_kib())),
                    Err(std::sync::mpsc::TryRecvError::Empty) => {}
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return Ok(()),
                }
            }
        }
        // Opens and closes `--rounds` channels (bind, connect, one message with a tensor both
        // ways of use, drop both) and says the open descriptors and mappings before and after.
        "churn" => {
            let rounds = number(&args, "--rounds", 300)?;
            let dir = std::env::temp_dir();
            let warm_up = |i: u64| -> Result<()> {
                let path = dir.join(format!("outside5-churn-{}-{i}.sock", std::process::id()));
                let mut receiver = Receiver::<Msg>::bind(&path)?;
                let sender = Sender::<Msg>::connect(&path)?;
                sender.send(&message(0, i, 4096, 1)?)?;
                let msg = receiver.recv_timeout(Duration::from_secs(30))?;
                if !intact(&msg, |_| 4096, 1)? {
                    bail!("round {i}: wrong data");
                }
                drop(msg);
                sender.wait_released(Duration::from_secs(30)).then_some(()).context("not released")?;
                drop(sender);
                drop(receiver);
                Ok(())
            };
            // One round first, so that what the library keeps for the process's life is there.
            warm_up(u64::MAX / 2)?;
            let (fds, maps) = (open_fds(), mappings());
            for i in 0..rounds {
                warm_up(i)?;
            }
            // Threads of dropped connections may still be closing: settle, within a bound.
            let deadline = Instant::now() + Duration::from_secs(10);
            while (open_fds() > fds || mappings() > maps) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            say(&format!("fds {fds} {}", open_fds()));
            say(&format!("maps {maps} {}", mappings()));
            say("done");
            wait_for_stdin();
        }
        other => bail!("unknown mode {other:?}"),
    }
    Ok(())
}
