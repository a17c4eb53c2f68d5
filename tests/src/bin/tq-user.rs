//! The second process of the reliability tests (`tests/tests/reliability.rs`): `tq-user <role> [options]`.
//!
//! Every role talks back to the test on stdout, one line per event, and reads commands from stdin
//! where it needs them; every wait has a deadline, so a role never outlives its test for long.
//!
//! Roles:
//! - `serve --listen P [--capacity C] --expect N [--hold K] [--deadline-s S]`: bind a receiver of
//!   `Probe`s at `P` (print `ready`), read every tensor of every message; messages whose note starts
//!   with `honest` are counted and checked against their checksums (the first `K` kept), others are
//!   reported as `other <id> <note> ok|bad` (with `--quiet`, only the bad ones); errors of closed connections are printed as
//!   `error: ...`, errors of `recv` as `recv-error: ...`. After `N` honest messages the kept ones are
//!   checked again (`held ok` or `held bad ...`) and `done honest=.. distinct=.. bad=..` is printed.
//! - `forward --to C`: send a tensor of its own to `C`, then forward (with a fresh tensor of its own
//!   beside it) the `Probe` its parent sends; print `forward: ok` or `forward: err <Debug>`, then
//!   `leases <n> after <ms> ms` once its leases are back (or when 10 s have passed).
//! - `collect --count N`: take `N` probes from the parent, keep them all, check them, drop them
//!   together (`dropped <n> in <ms> ms`), then wait for the parent to hang up (`disconnected`).
//! - `drop-receiver`: take one probe from the parent (capacity 1) and keep it (`holding`); then obey
//!   stdin: `drop-receiver`, `drop-tensor`, `exit` (exit without clean-up, still holding).
//! - `hostile --listen P`: a raw receiver: answer the sender's `Hello` with capacity 1, take two
//!   messages playing fair (`two messages`), then send `Credit { count: u32::MAX }` over and over
//!   (`credited <n>`), reading and discarding everything, releasing nothing.
//! - `bind-race --path P --at NS`: at `CLOCK_MONOTONIC` `NS`, bind a receiver at `P` (`won` or
//!   `lost: ...`); a winner prints `got <v>` for each `u64` received and drops the receiver when
//!   stdin closes (`dropped`).
//! - `blob`: receive `Blob`s from the parent and print `blob <id> <tensors> <tensor-sum> <bytes>
//!   <byte-sum> <text-len>` for each, until the parent hangs up (`disconnected`).
//! - `count`: receive probes from the parent, check each, and print `disconnected after <n> bad <b>`.
//! - `hold --count N`: take `N` probes from the parent, keep them (`holding <n>`), and wait to be killed.
//! - `idle --capacity C`: take the channel from the parent and never receive; exit when stdin closes.
//! - `lender --count N --mib M`: note `memory::usage().host_bytes` after a trim, start a `hold`
//!   receiver, send it `N` tensors of `M` MiB, kill it (SIGKILL) once it holds them, print
//!   `leases back in <ms> ms`, then drop its own tensors, trim, and print
//!   `memory <baseline> <while held> <after trim>` (host bytes).

use std::collections::HashSet;
use std::io::BufRead as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::program::say;
use integration_tests::queue::{Probe, checksum, probe};
use integration_tests::{arg, number};
use ipc_core::seqpacket::Listener;
use kernels::reference;
use tensor_queue::testing::wire::{Frame, ToReceiver, ToSender};
use tensor_queue::{Error, Receiver, Sender, Tensor, from_parent, from_parent_with_capacity, monotonic_ns};

/// What the `blob` role receives: an id, tensors, a byte payload and a text payload.
type Blob = (u64, Vec<Tensor>, Vec<u8>, String);

fn main() {
    if let Err(error) = run() {
        say(&format!("failed: {error:#}"));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().context("usage: tq-user <role> [options]")?.as_str();
    let path = |name: &str| arg(&args, name).with_context(|| format!("{name} <path>"));
    match role {
        "serve" => serve(&path("--listen")?, &args),
        "forward" => forward(&path("--to")?),
        "collect" => collect(number(&args, "--count", 1)? as usize),
        "drop-receiver" => drop_receiver(),
        "hostile" => hostile(&path("--listen")?),
        "bind-race" => bind_race(&path("--path")?, number(&args, "--at", 0)?),
        "blob" => blob(),
        "count" => count(),
        "hold" => hold(number(&args, "--count", 1)? as usize),
        "idle" => idle(number(&args, "--capacity", 1)? as u32),
        "lender" => lender(number(&args, "--count", 3)?, number(&args, "--mib", 16)? as usize),
        other => bail!("unknown role {other}"),
    }
}

/// A bound receiver serving honest senders beside whatever else connects.
fn serve(listen: &str, args: &[String]) -> Result<()> {
    let capacity = number(args, "--capacity", u64::from(tensor_queue::DEFAULT_CAPACITY))? as u32;
    let expect = number(args, "--expect", 1)? as usize;
    let hold = number(args, "--hold", 0)? as usize;
    let quiet = args.iter().any(|a| a == "--quiet");
    let deadline = Instant::now() + Duration::from_secs(number(args, "--deadline-s", 60)?);
    let mut receiver = Receiver::<Probe>::bind_with_capacity(listen, capacity)?;
    say("ready");
    let (mut honest, mut bad) = (0usize, 0usize);
    let mut ids = HashSet::new();
    let mut kept = Vec::new();
    while honest < expect {
        if Instant::now() > deadline {
            say(&format!("timeout honest={honest} distinct={} bad={bad}", ids.len()));
            std::process::exit(2);
        }
        for error in receiver.take_errors() {
            say(&format!("error: {error}"));
        }
        let probe = match receiver.recv_timeout(Duration::from_millis(50)) {
            Ok(probe) => probe,
            Err(Error::Timeout | Error::Disconnected) => continue,
            Err(error) => {
                say(&format!("recv-error: {error:?}"));
                continue;
            }
        };
        // Read every byte of whatever arrived, as a user would.
        let sums: Vec<Option<u64>> = probe.tensors.iter().map(|t| checksum(t).ok()).collect();
        let ok = sums.len() == probe.expected.len() && sums.iter().zip(&probe.expected).all(|(s, e)| *s == Some(*e));
        if probe.note.starts_with("honest") {
            honest += 1;
            ids.insert(probe.id);
            if !ok {
                bad += 1;
                say(&format!("bad {} {}: {sums:?} != {:?}", probe.id, probe.note, probe.expected));
            }
            if kept.len() < hold {
                kept.push(probe);
            }
        } else if !quiet || !ok {
            say(&format!("other {} {} {}", probe.id, probe.note, if ok { "ok" } else { "bad" }));
        }
    }
    if hold > 0 {
        let wrong: Vec<u64> = kept
            .iter()
            .filter(|p| p.tensors.iter().zip(&p.expected).any(|(t, e)| checksum(t).ok() != Some(*e)))
            .map(|p| p.id)
            .collect();
        if wrong.is_empty() { say(&format!("held ok {}", kept.len())) } else { say(&format!("held bad {wrong:?}")) }
    }
    for error in receiver.take_errors() {
        say(&format!("error: {error}"));
    }
    say(&format!("done honest={honest} distinct={} bad={bad}", ids.len()));
    Ok(())
}

/// Stage B of a pipeline: sends a tensor of its own to C, then tries to forward what A sent it.
fn forward(to: &str) -> Result<()> {
    let mut from_a = from_parent::<Probe>()?;
    let to_c = Sender::<Probe>::connect(to)?;
    to_c.send(&probe(1, 555, 4096, None)?)?;
    say("sent-own");
    let received = from_a.recv_timeout(Duration::from_secs(30))?;
    let fresh = probe(0, 777, 4096, None)?;
    let forwarded = Probe {
        id: 2,
        tensors: vec![fresh.tensors[0].clone(), received.tensors[0].clone()],
        expected: vec![fresh.expected[0], received.expected[0]],
        note: "forwarded".into(),
    };
    match to_c.send(&forwarded) {
        Ok(()) => say("forward: ok"),
        Err(error) => say(&format!("forward: err {error:?}")),
    }
    drop((forwarded, fresh));
    let start = Instant::now();
    while to_c.outstanding_leases() != 0 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    say(&format!("leases {} after {} ms", to_c.outstanding_leases(), start.elapsed().as_millis()));
    drop(received);
    Ok(())
}

/// A consumer that gathers a batch, then drops it all at once.
fn collect(count: usize) -> Result<()> {
    let mut probes = from_parent::<Probe>()?;
    let mut kept = Vec::with_capacity(count);
    for i in 0..count {
        let probe = probes.recv_timeout(Duration::from_secs(20)).with_context(|| format!("message {i}"))?;
        if checksum(&probe.tensors[0])? != probe.expected[0] {
            say(&format!("bad {}", probe.id));
        }
        kept.push(probe);
    }
    say(&format!("collected {}", kept.len()));
    let start = Instant::now();
    let n = kept.len();
    drop(kept);
    say(&format!("dropped {n} in {} ms", start.elapsed().as_millis()));
    match probes.recv_timeout(Duration::from_secs(20)) {
        Err(Error::Disconnected) => say("disconnected"),
        other => say(&format!("unexpected: {:?}", other.map(|p| p.id))),
    }
    Ok(())
}

/// Holds one tensor of a receiver, then drops the receiver, the tensor, or the whole process.
fn drop_receiver() -> Result<()> {
    let mut receiver = Some(from_parent_with_capacity::<Probe>(1)?);
    let first = receiver.as_mut().context("receiver")?.recv_timeout(Duration::from_secs(20))?;
    let mut held = Some(first.tensors[0].clone());
    drop(first);
    say("holding");
    for line in std::io::stdin().lock().lines() {
        match line?.as_str() {
            "drop-receiver" => {
                drop(receiver.take());
                say("receiver-dropped");
            }
            "drop-tensor" => {
                drop(held.take());
                say("tensor-dropped");
            }
            "exit" => std::process::exit(0),
            other => bail!("unknown command {other}"),
        }
    }
    Ok(())
}

/// A receiver that plays fair for two messages, then grants absurd credit over and over; it
/// never releases anything.
fn hostile(listen: &str) -> Result<()> {
    let listener = Listener::bind(listen)?;
    say("ready");
    let connection = Arc::new(listener.accept(Some(Duration::from_secs(30)))?);
    connection.set_recv_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = vec![0u8; 16 << 20];
    connection.recv(&mut buf)?;
    connection.send(&integration_tests::raw::hello(1, 7).encode(), &[])?;
    let reader = connection.clone();
    let (messages_tx, messages) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut frames, mut count) = (0u64, 0u64);
        while let Ok((n, _fds)) = reader.recv(&mut buf) {
            if n == 0 {
                break;
            }
            frames += 1;
            if let Ok(ToReceiver::Message { .. }) = ToReceiver::decode(&buf[..n]) {
                count += 1;
                let _ = messages_tx.send(count);
            }
        }
        say(&format!("sender hung up after {frames} frames, {count} messages"));
    });
    // Fair play first: one message on the first credit, a second on one more.
    messages.recv_timeout(Duration::from_secs(30)).context("the first message")?;
    connection.send(&ToSender::Credit { count: 1 }.encode(), &[])?;
    messages.recv_timeout(Duration::from_secs(30)).context("the second message")?;
    say("two messages");
    let credit = ToSender::Credit { count: u32::MAX }.encode();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut sent = 0u64;
    while Instant::now() < deadline {
        if connection.send(&credit, &[]).is_err() {
            break;
        }
        sent += 1;
        if sent == 1 || sent.is_multiple_of(10_000) {
            say(&format!("credited {sent}"));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    say(&format!("stopped after {sent} credits"));
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}

/// One contender for a socket path.
fn bind_race(path: &str, at: u64) -> Result<()> {
    while monotonic_ns() < at {
        std::hint::spin_loop();
    }
    let mut receiver = match Receiver::<u64>::bind(path) {
        Ok(receiver) => receiver,
        Err(error) => {
            say(&format!("lost: {error}"));
            return Ok(());
        }
    };
    say("won");
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    std::thread::spawn(move || {
        for _ in std::io::stdin().lock().lines() {}
        flag.store(true, Ordering::SeqCst);
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !closed.load(Ordering::SeqCst) && Instant::now() < deadline {
        match receiver.recv_timeout(Duration::from_millis(20)) {
            Ok(value) => say(&format!("got {value}")),
            Err(Error::Timeout | Error::Disconnected) => {}
            Err(error) => say(&format!("recv-error: {error:?}")),
        }
    }
    drop(receiver);
    say("dropped");
    Ok(())
}

/// Receives messages of every size.
fn blob() -> Result<()> {
    let mut blobs = from_parent::<Blob>()?;
    loop {
        match blobs.recv_timeout(Duration::from_secs(120)) {
            Ok((id, tensors, bytes, text)) => {
                let mut tensor_sum = 0u64;
                for tensor in &tensors {
                    tensor_sum = reference::splitmix64(tensor_sum ^ checksum(tensor)?);
                }
                let byte_sum = reference::checksum(&bytes);
                say(&format!("blob {id} {} {tensor_sum} {} {byte_sum} {}", tensors.len(), bytes.len(), text.len()));
            }
            Err(Error::Disconnected) => {
                say("disconnected");
                return Ok(());
            }
            Err(error) => say(&format!("recv-error: {error:?}")),
        }
    }
}

/// Counts checked probes until every sender is gone.
fn count() -> Result<()> {
    let mut probes = from_parent::<Probe>()?;
    let (mut n, mut bad) = (0u64, 0u64);
    loop {
        match probes.recv_timeout(Duration::from_secs(30)) {
            Ok(probe) => {
                n += 1;
                if probe.tensors.iter().zip(&probe.expected).any(|(t, e)| checksum(t).ok() != Some(*e)) {
                    bad += 1;
                }
            }
            Err(Error::Disconnected) => break,
            Err(error) => {
                say(&format!("recv-error after {n}: {error:?}"));
                break;
            }
        }
    }
    say(&format!("disconnected after {n} bad {bad}"));
    Ok(())
}

/// Keeps `count` probes and waits to be killed.
fn hold(count: usize) -> Result<()> {
    let mut probes = from_parent::<Probe>()?;
    let kept = (0..count).map(|_| probes.recv_timeout(Duration::from_secs(30))).collect::<Result<Vec<_>, _>>()?;
    say(&format!("holding {}", kept.len()));
    std::thread::sleep(Duration::from_secs(120));
    Ok(())
}

/// Takes the channel and never receives.
fn idle(capacity: u32) -> Result<()> {
    let receiver = from_parent_with_capacity::<u64>(capacity)?;
    say("ready");
    for _ in std::io::stdin().lock().lines() {}
    drop(receiver);
    Ok(())
}

/// A sender whose receiver is killed while holding its tensors.
fn lender(count: u64, mib: usize) -> Result<()> {
    use tensor_queue::memory;
    memory::trim();
    let baseline = memory::usage().host_bytes;
    let mut command = std::process::Command::new(std::env::current_exe()?);
    command.args(["hold", "--count", &count.to_string()]).stdout(std::process::Stdio::piped());
    let (mut holder, sender) = tensor_queue::spawn::<Probe>(&mut command)?;
    let lines = std::io::BufReader::new(holder.stdout.take().context("the holder's stdout")?);
    let probes = (0..count).map(|i| probe(i, 70 + i, mib << 20, None)).collect::<Result<Vec<_>>>()?;
    for probe in &probes {
        sender.send(probe)?;
    }
    let said = lines.lines().next().context("the holder said nothing")??;
    ensure!(said == format!("holding {count}"), "the holder said {said}");
    let held = memory::usage().host_bytes;
    holder.kill()?;
    let killed = Instant::now();
    let back = sender.wait_released(Duration::from_secs(10));
    let took = killed.elapsed();
    holder.wait()?;
    ensure!(back, "{} leases still out 10 s after the kill", sender.outstanding_leases());
    say(&format!("leases back in {} ms", took.as_millis()));
    drop(probes);
    drop(sender);
    memory::trim();
    say(&format!("memory {baseline} {held} {}", memory::usage().host_bytes));
    Ok(())
}
