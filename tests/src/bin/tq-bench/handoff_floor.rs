//! The floor of a stream-ordered GPU hand-off on one GPU (part of section `floor` where there is
//! a GPU): the C socket floor's ping-pong plus the least GPU work a hand-off that keeps the
//! guarantees needs, with nothing of the channel.
//!
//! Per round trip, the producer (this process) queues a write of the trip's number to a word of
//! shared device memory on its stream (`cuStreamWriteValue64`: "my work before this is done") and
//! sends the number in a 64-byte SOCK_SEQPACKET packet; the consumer ([`PEER_FLAG`], a second
//! process) reads it, queues a wait for that value on its own stream (`cuStreamWaitValue64`: the
//! data is usable on its stream), queues a write of the number to a second word (the release:
//! "my reads are done", which a producer can poll without any message) and answers with a
//! packet. These are the driver calls the channel itself makes per hand-off (`memory/signal.rs`);
//! the channel's round trip also carries the descriptor, checks it, and returns the lease, and
//! this floor says how much of its time is that work rather than the socket and the driver.
//!
//! Blocking and spinning variants, as the C floor's: blocking `recv`, or non-blocking `recv`
//! in a loop on both sides.

use std::os::fd::{AsFd as _, AsRawFd as _};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use integration_tests::{arg, socket_path};
use ipc_core::seqpacket::{Connection, Listener};
use ipc_core::{Context, Stream, VmmAllocation};
use serde_json::{Value, json};
use tensor_queue::monotonic_ns;

use ipc_core::DeviceMemory as _;

use super::summary;

/// The first argument of the consumer process.
pub const PEER_FLAG: &str = "--handoff-floor-peer";

const WARMUP: usize = 2000;
const TRIPS: usize = 20_000;
/// The number that ends the consumer's loop.
const END: u64 = u64::MAX;
/// Where the words lie in the shared allocation.
const SIGNAL_WORD: usize = 0;
const RELEASE_WORD: usize = 8;

/// One 64-byte packet, whole or not at all (SOCK_SEQPACKET); `spin` reads without blocking until
/// one is there.
fn take(connection: &Connection, spin: bool) -> Result<u64> {
    let mut packet = [0u8; 64];
    let n = if spin {
        loop {
            if let Some((n, _)) = connection.try_recv(&mut packet)? {
                break n;
            }
        }
    } else {
        connection.recv(&mut packet)?.0
    };
    ensure!(n == 64, "a hand-off floor packet of {n} bytes");
    Ok(u64::from_le_bytes(packet[..8].try_into()?))
}

fn put(connection: &Connection, value: u64) -> Result<()> {
    let mut packet = [0u8; 64];
    packet[..8].copy_from_slice(&value.to_le_bytes());
    Ok(connection.send(&packet, &[])?)
}

/// The round trips of one variant, in nanoseconds, sorted out by [`summary`]: p50, p99, p99.9.
fn ping_pong(context: &std::sync::Arc<Context>, spin: bool) -> Result<Value> {
    let path = socket_path("handoff-floor");
    let listener = Listener::bind(&path)?;
    let mut child = Command::new(std::env::current_exe()?)
        .args([PEER_FLAG, "--to", &path.to_string_lossy(), "--spin", if spin { "1" } else { "0" }])
        .stdin(Stdio::null())
        .spawn()
        .context("starting the hand-off floor's consumer")?;
    let result = (|| {
        let connection = listener.accept(Some(Duration::from_secs(60)))?;
        let words = VmmAllocation::new(context, 1)?;
        let fd = words.export()?;
        connection.send(&(words.len() as u64).to_le_bytes(), &[fd.as_fd()])?;
        let stream = Stream::new(context)?;
        let mut times = Vec::with_capacity(TRIPS);
        for trip in 1..=(WARMUP + TRIPS) as u64 {
            let start = monotonic_ns();
            stream.write_value64(&words, SIGNAL_WORD, trip)?;
            put(&connection, trip)?;
            ensure!(take(&connection, spin)? == trip, "the hand-off floor's consumer answered out of order");
            if trip > WARMUP as u64 {
                times.push(monotonic_ns() - start);
            }
        }
        put(&connection, END)?;
        // The consumer synchronizes its stream before it exits: its last release is written.
        let status = child.wait()?;
        ensure!(status.success(), "the hand-off floor's consumer exited with {status}");
        let released = stream.read_value64(&words, RELEASE_WORD)?;
        ensure!(released == (WARMUP + TRIPS) as u64, "the consumer released {released} hand-offs");
        Ok(summary(&mut times))
    })();
    if result.is_err() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_file(&path);
    result
}

/// Both variants on GPU 0 (the benchmark's device): `{p50_us, p99_us, spin_p50_us, ...}`, keys as
/// the C socket floor's.
pub fn measure(context: &std::sync::Arc<Context>) -> Result<Value> {
    let blocking = ping_pong(context, false)?;
    let spinning = ping_pong(context, true)?;
    Ok(json!({
        "p50_us": blocking["p50_us"], "p99_us": blocking["p99_us"], "p999_us": blocking["p999_us"],
        "spin_p50_us": spinning["p50_us"], "spin_p99_us": spinning["p99_us"], "spin_p999_us": spinning["p999_us"],
        "trips": TRIPS,
    }))
}

/// The consumer process: maps the producer's words, then waits, releases and answers per trip.
pub fn peer() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = arg(&args, "--to").context("--to <path>")?;
    let spin = arg(&args, "--spin").as_deref() == Some("1");
    let context = Context::on_ordinal(0)?;
    let stream = Stream::new(&context)?;
    let connection = Connection::connect(path)?;
    let mut len = [0u8; 8];
    let (n, fds) = connection.recv(&mut len)?;
    ensure!(n == 8 && fds.len() == 1, "the hand-off floor's set-up packet");
    let len = u64::from_le_bytes(len) as usize;
    let words = VmmAllocation::import(&context, fds[0].as_raw_fd(), len)?;
    loop {
        let trip = take(&connection, spin)?;
        if trip == END {
            break;
        }
        stream.wait_value64(&words, SIGNAL_WORD, trip)?;
        stream.write_value64(&words, RELEASE_WORD, trip)?;
        put(&connection, trip)?;
    }
    stream.synchronize()?;
    Ok(())
}
