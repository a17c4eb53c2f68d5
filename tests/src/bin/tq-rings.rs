//! The second process of the ring tests (`tests/tests/rings_host.rs`): `tq-rings <role> [options]`.
//! Every role reports on stdout, one line per event; a watchdog aborts it after 60 s.
//!
//! Messages are `(u64, Vec<Tensor>)`: an index and, for every `--every`-th message (0: none),
//! one fresh host tensor of `--len` bytes filled with the pattern of its index (a new chunk,
//! announced on the socket between ring records).
//!
//! Roles:
//! - `burst --to P --count N [--every E --len L]`: sends message 0 (always with a tensor) and
//!   waits until it is released, then sends messages 1 to `N - 1`, waits until the link wrote
//!   them all, prints `sent`, and SIGKILLs itself (its receiver has not read them yet).
//! - `overflow --to P --count N`: as `burst`, then sends messages 1 to `N - 1` without tensors,
//!   more than its ring takes while the receiver does not read: checks that some wait in its
//!   queue (`wait_written` false), prints `queued`, and SIGKILLs itself.
//! - `marker --to P`: with `TENSOR_QUEUE_TEST_DIE_AFTER_MARKER=1`: sends message 0 without
//!   tensors, then message 1 with a tensor (its second send waits for a credit, which comes
//!   after the rings are on), and dies between that tensor's marker and its announcement.
//! - `senders --to P --threads T --count N [--every E --len L]`: `T` threads, each with its own
//!   `Sender`, send `N` messages each, index `1_000_000 * thread + i`; prints `done`.
//! - `quick --to P --count N`: sends `N` messages without tensors (no more than the receiver's
//!   capacity: none waits for a credit), waits until the link wrote them, prints `sent`, and
//!   exits.
//! - `receive --to P`: binds `P` for one sender, prints `bound`, then `got I` per message and
//!   `end` once the sender has gone (with `TENSOR_QUEUE_TEST_LATE_RING_OFFER=1`, its offer of
//!   rings comes 300 ms after its `Hello`).
//! - `rejoin --to P`: binds `P` (for any number of senders), prints `bound`, `got I` per
//!   message and `ended` at the first end of the stream; then, after a line on stdin, one more
//!   `recv` (30 s at most): `got I`, or `error E`.
//! - `pingpong --to P --reply R --count N --seed S [--every E --len L]`: binds `R` for one
//!   sender, prints `bound`, connects to `P`; then `N` times: a blocking `recv` on `R` (message
//!   `i` expected, its tensor checked), a random short pause (none, a spin, a yield or a sleep
//!   of up to 50 us), and message `i` sent back on `P`. Prints `done` once all are released.
//! - `linger --to P --ms M [--kill]`: sends message 0 (a tensor) and waits until it is released
//!   (the rings are on), sends message 1 (a tensor), prints `sent`, sleeps `M` ms while its receiver is
//!   blocked in `recv`, then exits (or SIGKILLs itself with `--kill`).
//! - `scribble --to P`: speaks the wire by hand: greets, takes the receiver's rings, switches to
//!   them, writes garbage into the head of the ring it writes, prints `scribbled`, and waits
//!   until stdin closes.

use std::io::BufRead as _;
use std::os::fd::OwnedFd;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use integration_tests::program::{join_senders, say};
use integration_tests::{arg, number};
use ipc_core::seqpacket::Connection;
use kernels::reference;
use tensor_queue::testing::wire::{Frame, Hello, LinkFrame};
use tensor_queue::{DType, Sender, Tensor};

/// What the ring tests send.
pub type Item = (u64, Vec<Tensor>);

fn main() {
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        eprintln!("tq-rings: watchdog");
        std::process::abort();
    });
    if let Err(error) = run() {
        say(&format!("error {error:#}"));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let to = arg(&args, "--to").context("--to")?;
    let every = number(&args, "--every", 0)?;
    let len = number(&args, "--len", 4096)? as usize;
    match args.first().map(String::as_str) {
        Some("burst") => {
            let sender = Sender::<Item>::connect(&to)?;
            // Message 0 (with a tensor) released: the rings are on by then (their offer comes
            // before any release), so the rest goes through them, not into the socket's buffer.
            sender.send(&item(0, 1, len)?)?;
            ensure!(sender.wait_released(Duration::from_secs(30)), "message 0 not released within 30 s");
            for index in 1..number(&args, "--count", 100)? {
                sender.send(&item(index, every, len)?)?;
            }
            ensure!(sender.wait_written(Duration::from_secs(30)), "not written within 30 s");
            say("sent");
            die()
        }
        Some("overflow") => {
            let sender = Sender::<Item>::connect(&to)?;
            sender.send(&item(0, 1, len)?)?;
            ensure!(sender.wait_released(Duration::from_secs(30)), "message 0 not released within 30 s");
            for index in 1..number(&args, "--count", 20_000)? {
                sender.send(&(index, Vec::new()))?;
            }
            ensure!(!sender.wait_written(Duration::from_millis(200)), "all written: nothing queued to lose");
            say("queued");
            die()
        }
        Some("marker") => {
            let sender = Sender::<Item>::connect(&to)?;
            sender.send(&(0, Vec::new()))?;
            sender.send(&item(1, 1, len)?)?;
            bail!("still alive after the marker")
        }
        Some("senders") => {
            let (threads, count) = (number(&args, "--threads", 4)?, number(&args, "--count", 100)?);
            let threads: Vec<_> = (0..threads)
                .map(|thread| {
                    let to = to.clone();
                    std::thread::spawn(move || -> Result<()> {
                        let sender = Sender::<Item>::connect(&to)?;
                        for i in 0..count {
                            sender.send(&item(1_000_000 * thread + i, every, len)?)?;
                        }
                        ensure!(sender.wait_released(Duration::from_secs(30)), "not released within 30 s");
                        Ok(())
                    })
                })
                .collect();
            join_senders(threads)?;
            say("done");
            Ok(())
        }
        Some("quick") => {
            let sender = Sender::<Item>::connect(&to)?;
            for index in 0..number(&args, "--count", 4)? {
                sender.send(&(index, Vec::new()))?;
            }
            ensure!(sender.wait_written(Duration::from_secs(30)), "not written within 30 s");
            say("sent");
            Ok(())
        }
        Some("receive") => {
            let mut receiver = tensor_queue::Receiver::<Item>::bind(&to)?;
            receiver.expect_senders(1);
            say("bound");
            for item in &mut receiver {
                say(&format!("got {}", item?.0));
            }
            say("end");
            Ok(())
        }
        Some("rejoin") => {
            // No `expect_senders`: the stream ends for the moment whenever every sender has gone.
            let mut receiver = tensor_queue::Receiver::<Item>::bind(&to)?;
            say("bound");
            loop {
                match receiver.recv() {
                    Ok(item) => say(&format!("got {}", item.0)),
                    Err(tensor_queue::Error::Disconnected) => break,
                    Err(error) => return Err(error.into()),
                }
            }
            say("ended");
            std::io::stdin().lines().next().context("stdin closed")??;
            match receiver.recv_timeout(Duration::from_secs(30)) {
                Ok(item) => say(&format!("got {}", item.0)),
                Err(error) => say(&format!("error {error:?}")),
            }
            Ok(())
        }
        Some("pingpong") => {
            let reply = arg(&args, "--reply").context("--reply")?;
            let mut items = tensor_queue::Receiver::<Item>::bind(&reply)?;
            items.expect_senders(1);
            say("bound");
            let sender = Sender::<Item>::connect(&to)?;
            let mut random = number(&args, "--seed", 1)? | 1;
            for index in 0..number(&args, "--count", 1000)? {
                let (got, tensors) = items.recv_timeout(Duration::from_secs(30)).context("no message within 30 s")?;
                ensure!(got == index, "message {got} where {index} was due");
                for tensor in &tensors {
                    ensure!(tensor.to_bytes()? == reference::pattern(len, index), "message {index}'s bytes");
                }
                drop(tensors);
                pause(&mut random);
                sender.send(&item(index, every, len)?)?;
            }
            ensure!(sender.wait_released(Duration::from_secs(30)), "not released within 30 s");
            say("done");
            Ok(())
        }
        Some("linger") => {
            let sender = Sender::<Item>::connect(&to)?;
            sender.send(&item(0, 1, len)?)?;
            ensure!(sender.wait_released(Duration::from_secs(30)), "message 0 not released within 30 s");
            sender.send(&item(1, 1, len)?)?;
            ensure!(sender.wait_written(Duration::from_secs(30)), "not written within 30 s");
            say("sent");
            std::thread::sleep(Duration::from_millis(number(&args, "--ms", 300)?));
            if args.iter().any(|a| a == "--kill") {
                die()
            }
            Ok(())
        }
        Some("scribble") => scribble(&to),
        other => bail!("unknown role {other:?}"),
    }
}

/// Message `index`, with a fresh tensor of `len` bytes if `every` divides it.
pub fn item(index: u64, every: u64, len: usize) -> Result<Item> {
    let tensors = match every != 0 && index.is_multiple_of(every) {
        true => vec![Tensor::from_slice(&reference::pattern(len, index), DType::U8, &[len as u64])?],
        false => Vec::new(),
    };
    Ok((index, tensors))
}

/// A random short pause (xorshift on `state`): none, a spin of up to 20 us, a yield, or a sleep
/// of up to 50 us, so that each side is found now busy, now about to sleep, now asleep.
pub fn pause(state: &mut u64) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    let micros = (*state >> 8) % 50;
    match *state % 4 {
        0 => {}
        1 => {
            let until = std::time::Instant::now() + Duration::from_micros(micros % 20);
            while std::time::Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        2 => std::thread::yield_now(),
        _ => std::thread::sleep(Duration::from_micros(micros)),
    }
}

fn die() -> ! {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    std::process::abort()
}

/// A sender that lies in the memory it shares: see the module.
fn scribble(to: &str) -> Result<()> {
    let connection = Connection::connect(std::path::Path::new(to))?;
    connection.set_recv_timeout(Some(Duration::from_secs(30)))?;
    let hello = Hello {
        pid: std::process::id(),
        host: ipc_core::HostId::current()?.0,
        capacity: 0,
        instance: 11,
        reach: Default::default(),
        routing: Default::default(),
    };
    connection.send(&hello.encode(), &[])?;
    let mut buf = vec![0u8; 1 << 20];
    let rings: Vec<OwnedFd> = loop {
        let (n, fds) = connection.recv(&mut buf)?;
        ensure!(n > 0, "the receiver hung up");
        if LinkFrame::decode(&buf[..n]) == Ok(LinkFrame::Rings) {
            break fds;
        }
    };
    ensure!(rings.len() == 4, "{} descriptors with the rings", rings.len());
    connection.send(&LinkFrame::RingsOn.encode(), &[])?;
    // The ring we write: its first page is the header; `head` is the word at 128.
    let len = rustix::fs::fstat(&rings[0])?.st_size as usize;
    ensure!(len > 4096, "a ring of {len} bytes");
    let memory = ipc_core::SharedMemory::from_fd(rings[0].try_clone()?, len)?;
    // Not 8-aligned, and far past anything published: the receiver's check must refuse it.
    memory.store_u64(128, 0x1234_5677)?;
    // And wake it, as a writer would.
    rustix::io::write(&rings[2], &1u64.to_ne_bytes())?;
    say("scribbled");
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
    }
    Ok(())
}
