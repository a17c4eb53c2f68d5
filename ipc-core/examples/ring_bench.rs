//! What a shared-memory ring ([`ipc_core::ring`]) saves against the Unix seqpacket socket that
//! carries a channel's frames today, measured in one run between two processes (this program
//! starts itself as the peer):
//! - round trip of a 64-byte record (p50, p99), spinning and blocking, ring against socket;
//! - one-way records per second, streaming.
//!
//! ```text
//! cargo run --release -p ipc-core --example ring_bench [-- --trips N --records N --size B]
//! ```
//! The two processes are not pinned to cores: on a machine with fewer free cores than two,
//! spinning rows measure the scheduler more than the ring.

use std::os::fd::{AsFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

use ipc_core::inherit::{spawn_with_sockets, take_inherited_sockets};
use ipc_core::ring::{self, RingReader, RingWriter, Wakeup};
use ipc_core::seqpacket::Connection;

const SOCKETS: &str = "IPC_CORE_RING_BENCH_SOCKETS";
const CAPACITY: usize = 1 << 20;
const WARM_UP: usize = 1_000;

/// What the peer does for one measurement (the parent names it on the socket).
#[derive(Clone, Copy, Debug)]
enum Mode {
    SocketSpin,
    SocketBlocking,
    RingSpin,
    RingBlocking,
    RingBlockingUnwatched,
    RingDoorbell,
    SocketStream,
    RingStream,
}

const MODES: [Mode; 8] = [
    Mode::SocketSpin,
    Mode::SocketBlocking,
    Mode::RingSpin,
    Mode::RingBlocking,
    Mode::RingBlockingUnwatched,
    Mode::RingDoorbell,
    Mode::SocketStream,
    Mode::RingStream,
];

struct Ends {
    socket: Connection,
    writer: RingWriter,
    reader: RingReader,
    buf: Vec<u8>,
    record: Vec<u8>,
    /// The eventfd our reader sleeps on, and the one our writer rings (the peer's).
    bells: (OwnedFd, OwnedFd),
}

impl Ends {
    /// Both ends of this process to the doorbells (or back to the futex) for `mode`.
    fn ring_doorbells(&mut self, mode: Mode) {
        let on = matches!(mode, Mode::RingDoorbell);
        self.reader.set_doorbell(on.then(|| self.bells.0.try_clone().unwrap())).unwrap();
        self.writer.set_doorbell(on.then(|| self.bells.1.try_clone().unwrap())).unwrap();
    }

    fn send(&mut self, mode: Mode) {
        match mode {
            Mode::SocketSpin | Mode::SocketBlocking | Mode::SocketStream => {
                self.socket.send(&self.record, &[]).unwrap()
            }
            Mode::RingSpin => self.writer.push(&self.record).unwrap(),
            _ => {
                let woken = self.writer.push_waiting(&self.record, None, Some(self.socket.as_fd())).unwrap();
                assert_eq!(woken, Wakeup::Ready);
            }
        }
    }

    fn receive(&mut self, mode: Mode) {
        match mode {
            Mode::SocketSpin => {
                self.buf.resize(65536, 0);
                while self.socket.try_recv(&mut self.buf).unwrap().is_none() {}
            }
            Mode::SocketBlocking | Mode::SocketStream => {
                self.buf.resize(65536, 0);
                assert!(self.socket.recv(&mut self.buf).unwrap().0 > 0, "the peer hung up");
            }
            Mode::RingSpin => while !self.reader.try_pop(&mut self.buf).unwrap() {},
            Mode::RingBlocking | Mode::RingDoorbell | Mode::RingStream => {
                let woken = self.reader.pop(&mut self.buf, None, Some(self.socket.as_fd())).unwrap();
                assert_eq!(woken, Wakeup::Ready);
            }
            Mode::RingBlockingUnwatched => {
                assert_eq!(self.reader.pop(&mut self.buf, None, None).unwrap(), Wakeup::Ready)
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|arg| arg == "--peer") {
        return peer();
    }
    let (mut trips, mut records, mut size) = (20_000usize, 1_000_000usize, 64usize);
    for pair in args.chunks(2) {
        let value: usize = pair.get(1).and_then(|v| v.parse().ok()).expect("a number after each flag");
        match pair[0].as_str() {
            "--trips" => trips = value,
            "--records" => records = value,
            "--size" => size = value,
            other => panic!("unknown argument {other}"),
        }
    }
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.arg("--peer");
    let (mut child, mut sockets) = spawn_with_sockets(&mut command, SOCKETS, 1).unwrap();
    let socket = sockets.pop().unwrap();
    let (writer, reader) = ring::offer(&socket, CAPACITY).unwrap();
    // Each side's reader gets a doorbell, and the other side's writer a duplicate of it.
    let (ours, theirs) = (ring::doorbell().unwrap(), ring::doorbell().unwrap());
    socket.send(b"bells", &[theirs.as_fd(), ours.as_fd()]).unwrap();
    let bells = (ours, theirs);
    let mut ends = Ends { socket, writer, reader, buf: Vec::new(), record: vec![0xab; size], bells };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "ring_bench: {size}-byte records, {trips} round trips, {records} streamed; {} CPUs, load {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    println!();
    println!("| measure | p50 us | p99 us | records/s |");
    println!("| --- | --- | --- | --- |");
    for mode in MODES {
        let count = match mode {
            Mode::SocketStream | Mode::RingStream => records,
            _ => trips,
        };
        ends.ring_doorbells(mode);
        ends.socket.send(format!("{mode:?} {count} {size}").as_bytes(), &[]).unwrap();
        match mode {
            Mode::SocketStream | Mode::RingStream => {
                let start = Instant::now();
                for _ in 0..count {
                    ends.send(mode);
                }
                ends.receive(mode); // the peer's one answer: it has read them all
                let rate = count as f64 / start.elapsed().as_secs_f64();
                println!("| {} | | | {rate:.0} |", name(mode));
            }
            _ => {
                let mut times = Vec::with_capacity(count);
                for trip in 0..WARM_UP + count {
                    let start = Instant::now();
                    ends.send(mode);
                    ends.receive(mode);
                    if trip >= WARM_UP {
                        times.push(start.elapsed());
                    }
                }
                times.sort();
                let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
                println!("| {} | {:.2} | {:.2} | |", name(mode), at(0.50), at(0.99));
            }
        }
    }
    drop(ends);
    assert!(child.wait().unwrap().success());
}

fn name(mode: Mode) -> &'static str {
    match mode {
        Mode::SocketSpin => "round trip, seqpacket socket, spin (try_recv loop)",
        Mode::SocketBlocking => "round trip, seqpacket socket, blocking recv",
        Mode::RingSpin => "round trip, ring, spin (try_pop loop)",
        Mode::RingBlocking => "round trip, ring, blocking pop watching the socket",
        Mode::RingBlockingUnwatched => "round trip, ring, blocking pop, no socket watched",
        Mode::RingDoorbell => "round trip, ring, blocking pop on an eventfd doorbell + the socket",
        Mode::SocketStream => "one-way stream, seqpacket socket (blocking send/recv)",
        Mode::RingStream => "one-way stream, ring (push_waiting / pop, socket watched)",
    }
}

/// The peer: for each mode the parent names, answers every round trip, or reads a stream and
/// answers once.
fn peer() {
    let socket = Connection::from(take_inherited_sockets(SOCKETS).unwrap().pop().unwrap());
    let (writer, reader) = ring::accept(&socket).unwrap();
    let (_, fds) = socket.recv(&mut [0u8; 16]).unwrap();
    let [ours, theirs]: [OwnedFd; 2] = fds.try_into().unwrap();
    let mut ends = Ends { socket, writer, reader, buf: Vec::new(), record: Vec::new(), bells: (ours, theirs) };
    let mut command = [0u8; 128];
    loop {
        let (len, _) = ends.socket.recv(&mut command).unwrap();
        if len == 0 {
            return; // the parent is done
        }
        let text = String::from_utf8_lossy(&command[..len]).into_owned();
        let mut words = text.split(' ');
        let named = words.next().unwrap();
        let mode = MODES.into_iter().find(|mode| format!("{mode:?}") == named).unwrap();
        let count: usize = words.next().unwrap().parse().unwrap();
        ends.record = vec![0xcd; words.next().unwrap().parse().unwrap()];
        ends.ring_doorbells(mode);
        match mode {
            Mode::SocketStream | Mode::RingStream => {
                for _ in 0..count {
                    ends.receive(mode);
                }
                ends.send(mode);
            }
            _ => {
                for _ in 0..WARM_UP + count {
                    ends.receive(mode);
                    ends.send(mode);
                }
            }
        }
        // Leave the socket quiet for the next command (nothing is left on it).
        std::thread::sleep(Duration::from_millis(1));
    }
}
