//! The floor of a stream-ordered GPU hand-off (no channel): the C socket floor's ping-pong plus
//! the least GPU work a hand-off that keeps the guarantees needs.
//!
//! Per trip, the producer (this process, GPU 0) queues a write of the trip's number to a word of
//! shared device memory on its stream (`cuStreamWriteValue64`: "my work before this is done") and
//! sends the number in a 64-byte SOCK_SEQPACKET packet; the consumer ([`PEER_FLAG`], a second
//! process) reads it, queues a wait for that value on its own stream (`cuStreamWaitValue64`),
//! queues a write of the number to a second word (the release: "my reads are done", which a
//! producer can poll without any message) and answers with a packet. These are the driver calls
//! the channel itself makes per hand-off (`memory/signal.rs`); the channel's hand-off also
//! carries and checks the descriptor and returns the lease, and this floor says how much of its
//! time is that work rather than the socket and the driver.
//!
//! Two uses:
//! - same GPU, round trip ([`round_trips`], section `floor`): blocking and spinning variants, as
//!   the C floor's, the consumer on GPU 0;
//! - cross-GPU, one-way to usable ([`cross_one_way`], section `cross`): the consumer on GPU 1,
//!   spinning, also pulls the producer's bytes into its own buffer after the wait
//!   (`cuMemcpyAsync` over the peer mapping, PeerCopy's copy) and synchronizes its stream, then
//!   reads `CLOCK_MONOTONIC` (one clock for both processes) and answers with it.

use std::os::fd::{AsFd as _, AsRawFd as _};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use integration_tests::{arg, socket_path};
use ipc_core::seqpacket::{Connection, Listener};
use ipc_core::{Context, DeviceBuffer, Stream, VmmAllocation};
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

/// One 64-byte packet (a trip's number and a clock reading), whole or not at all
/// (SOCK_SEQPACKET); `spin` reads without blocking until one is there.
fn take(connection: &Connection, spin: bool) -> Result<(u64, u64)> {
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
    Ok((u64::from_le_bytes(packet[..8].try_into()?), u64::from_le_bytes(packet[8..16].try_into()?)))
}

fn put(connection: &Connection, trip: u64, clock_ns: u64) -> Result<()> {
    let mut packet = [0u8; 64];
    packet[..8].copy_from_slice(&trip.to_le_bytes());
    packet[8..16].copy_from_slice(&clock_ns.to_le_bytes());
    Ok(connection.send(&packet, &[])?)
}

/// What one measurement asks of its consumer.
struct Variant {
    spin: bool,
    /// The consumer's GPU.
    ordinal: i32,
    /// Bytes the consumer pulls per trip (0: none, and the time is the round trip).
    bytes: usize,
    warmup: usize,
    trips: usize,
}

/// Per trip, in nanoseconds: the round trip (`bytes` 0), else send call to usable on the
/// consumer's GPU.
fn measure_variant(context: &Arc<Context>, variant: &Variant) -> Result<Vec<u64>> {
    let path = socket_path("handoff-floor");
    let listener = Listener::bind(&path)?;
    let mut child = Command::new(std::env::current_exe()?)
        .args([PEER_FLAG, "--to", &path.to_string_lossy()])
        .args(["--spin", if variant.spin { "1" } else { "0" }, "--ordinal", &variant.ordinal.to_string()])
        .stdin(Stdio::null())
        .spawn()
        .context("starting the hand-off floor's consumer")?;
    let result = (|| {
        let connection = listener.accept(Some(Duration::from_secs(60)))?;
        let words = VmmAllocation::new(context, 1)?;
        let data = VmmAllocation::new(context, variant.bytes.max(1))?;
        let (words_fd, data_fd) = (words.export()?, data.export()?);
        let mut setup = [0u8; 24];
        setup[..8].copy_from_slice(&(words.len() as u64).to_le_bytes());
        setup[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
        setup[16..].copy_from_slice(&(variant.bytes as u64).to_le_bytes());
        connection.send(&setup, &[words_fd.as_fd(), data_fd.as_fd()])?;
        let stream = Stream::new(context)?;
        let total = (variant.warmup + variant.trips) as u64;
        let mut times = Vec::with_capacity(variant.trips);
        for trip in 1..=total {
            let start = monotonic_ns();
            stream.write_value64(&words, SIGNAL_WORD, trip)?;
            put(&connection, trip, 0)?;
            let (answered, usable_ns) = take(&connection, variant.spin)?;
            ensure!(answered == trip, "the hand-off floor's consumer answered out of order");
            let end = if variant.bytes == 0 { monotonic_ns() } else { usable_ns };
            if trip > variant.warmup as u64 {
                times.push(end.saturating_sub(start));
            }
        }
        put(&connection, END, 0)?;
        // The consumer synchronizes its stream before it exits: its last release is written.
        let status = child.wait()?;
        ensure!(status.success(), "the hand-off floor's consumer exited with {status}");
        let released = stream.read_value64(&words, RELEASE_WORD)?;
        ensure!(released == total, "the consumer released {released} hand-offs of {total}");
        Ok(times)
    })();
    if result.is_err() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_file(&path);
    result
}

/// Same GPU, both waits: `{p50_us, p99_us, spin_p50_us, ...}`, keys as the C socket floor's.
pub fn round_trips(context: &Arc<Context>) -> Result<Value> {
    let run = |spin| {
        let variant = Variant { spin, ordinal: 0, bytes: 0, warmup: WARMUP, trips: TRIPS };
        measure_variant(context, &variant).map(|mut times| summary(&mut times))
    };
    let (blocking, spinning) = (run(false)?, run(true)?);
    Ok(json!({
        "p50_us": blocking["p50_us"], "p99_us": blocking["p99_us"], "p999_us": blocking["p999_us"],
        "spin_p50_us": spinning["p50_us"], "spin_p99_us": spinning["p99_us"], "spin_p999_us": spinning["p999_us"],
        "trips": TRIPS,
    }))
}

/// GPU 0 -> GPU 1, spinning: one-way to usable of `bytes` (samples in nanoseconds).
pub fn cross_one_way(context: &Arc<Context>, bytes: usize, warmup: usize, trips: usize) -> Result<Vec<u64>> {
    measure_variant(context, &Variant { spin: true, ordinal: 1, bytes: bytes.max(1), warmup, trips })
}

/// The consumer process: maps the producer's words and bytes, then per trip waits, pulls the
/// bytes (if asked), releases and answers.
pub fn peer() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = arg(&args, "--to").context("--to <path>")?;
    let spin = arg(&args, "--spin").as_deref() == Some("1");
    let ordinal: i32 = arg(&args, "--ordinal").unwrap_or_default().parse().context("--ordinal")?;
    let context = Context::on_ordinal(ordinal)?;
    let stream = Stream::new(&context)?;
    let connection = Connection::connect(path)?;
    let mut setup = [0u8; 24];
    let (n, fds) = connection.recv(&mut setup)?;
    ensure!(n == 24 && fds.len() == 2, "the hand-off floor's set-up packet");
    let word = |i: usize| u64::from_le_bytes(setup[i * 8..i * 8 + 8].try_into().unwrap_or_default()) as usize;
    let (words_len, data_len, bytes) = (word(0), word(1), word(2));
    let words = VmmAllocation::import(&context, fds[0].as_raw_fd(), words_len)?;
    let data = VmmAllocation::import(&context, fds[1].as_raw_fd(), data_len)?;
    let landing = if bytes > 0 { Some(DeviceBuffer::alloc(&context, bytes)?) } else { None };
    loop {
        let (trip, _) = take(&connection, spin)?;
        if trip == END {
            break;
        }
        stream.wait_value64(&words, SIGNAL_WORD, trip)?;
        if let Some(landing) = &landing {
            stream.copy_async(landing, 0, &data, 0, bytes)?;
            stream.synchronize()?;
        }
        stream.write_value64(&words, RELEASE_WORD, trip)?;
        put(&connection, trip, monotonic_ns())?;
    }
    stream.synchronize()?;
    Ok(())
}
