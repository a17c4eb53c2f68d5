//! Typed channels: [`Sender`], [`Receiver`], [`Broadcast`], and children started with a channel.
//!
//! # The hand-off
//! 1. `send` serialises the message; tensors go to the side table. A chunk the peer has not seen
//!    is announced first, with its descriptor (once per chunk and peer).
//! 2. For GPU tensors sent with [`Sender::send_on`], the producer's stream gets a fence after
//!    its work: the write of the next value of its signal word (see `signal.rs`), or, where the
//!    device lacks stream memory operations, the record of a pooled interprocess event (its handle
//!    announced once, when it was made).
//! 3. The message frame carries one descriptor per tensor: (lease, chunk, offset, length, dtype,
//!    shape, strides, fence). The sender keeps the storage alive under that lease.
//! 4. The receiver (in the thread that calls `recv`, with no hand-off to another thread) validates
//!    the frame, maps nothing new (chunks are cached), and queues the fence's wait on its stream
//!    for the device (`cuStreamWaitValue64` or `cuStreamWaitEvent`): the consumer's first use is
//!    ordered after the producer's work, and neither CPU waits.
//! 5. A message's tensors share one receiver-side lease: when the last view of any of them drops,
//!    one release frame returns them all, once the receiver's GPU work on them is done: at once
//!    if its streams are idle, else through a release thread, which records one pooled event per
//!    stream for the releases queued together, waits for them, and returns them in one frame per
//!    sender (see `release.rs`). Host tensors are released at once. Holding one tensor of a
//!    message holds the others' memory in the sender: the price of one frame per message
//!    instead of one per tensor.
//!
//! # Why signal words, not interprocess events
//! On an H200 a receiver's stream took 140-580 us to get past a wait on an imported interprocess
//! event that was already complete (the set-up breakdown and the warm broadcast in `tq-bench`;
//! `GPU.md` measured 141 us), while `primitive-costs` saw 6 us in a quieter set-up. A stream
//! wait on a 64-bit word in shared device memory costs 7 us (`GPU.md`), needs no per-message
//! handle, and its enqueue costs about what `cuEventRecord` does. Events remain the fallback:
//! they are exported once and reused from a pool; an event returns to the pool when a credit
//! says the receiver took its message, which is after the receiver queued its wait
//! (`cuStreamWaitEvent` waits for the record current at the call), so a re-record can never be
//! waited on by mistake, and the pool never outgrows the capacity.
//!
//! # Waiting
//! `recv` sleeps in `poll` and the kernel wakes it: a few microseconds per hand-off. With
//! [`Receiver::set_spin`] it reads its sockets without sleeping first, which takes the wake-up
//! off the latency and costs a busy core while it waits. Likewise a sender with no credit left
//! waits for its reader thread to see the next credit, and that thread for the kernel; with
//! [`Sender::set_spin`] the sending thread reads the credits itself for a while first.
//!
//! # Flow control and failure
//! A receiver grants each sender `capacity` messages; `send` blocks when they are used up and
//! resumes when the receiver has taken half of them (credits return in batches, to keep frames
//! off the hot path). A peer that dies closes its socket: the survivor sees the hang-up at once.
//! A dead receiver's leases return to the sender; a dead sender's messages already queued are
//! still delivered, then `recv` returns [`Error::Disconnected`], and tensors already received
//! stay valid (their memory lives while mapped).

mod child;
mod receiver;
mod release;
mod sender;

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

use ipc_core::HostId;
use ipc_core::seqpacket::Connection;

pub use child::{from_parent, from_parent_with_capacity, spawn};
pub use receiver::{MessageInfo, Receiver};
pub(crate) use release::ReceivedLease;
pub use sender::{Broadcast, Sender};

use crate::wire::{Frame, MAX_FRAME};
use crate::{Error, Result};

/// Messages a sender may have in flight to a receiver unless the receiver says otherwise.
pub const DEFAULT_CAPACITY: u32 = 16;

/// The environment variable through which [`spawn`] tells a child where its parent listens.
pub const ENDPOINT_ENV: &str = "TENSOR_QUEUE_ENDPOINT";

/// Test-only: when set to `1`, receivers skip the stream wait, so tests can prove that the
/// ordering they check is real (the seed test must fail with it).
pub const SKIP_ORDERING_ENV: &str = "TENSOR_QUEUE_TEST_SKIP_ORDERING";

/// Test-only: when set to `1`, senders order GPU hand-offs with interprocess events even where
/// stream memory operations work, so tests can cover the fallback on any machine.
pub const FORCE_EVENTS_ENV: &str = "TENSOR_QUEUE_TEST_FORCE_EVENTS";

pub(crate) fn force_events() -> bool {
    static FORCE: OnceLock<bool> = OnceLock::new();
    *FORCE.get_or_init(|| std::env::var(FORCE_EVENTS_ENV).as_deref() == Ok("1"))
}

fn skip_ordering() -> bool {
    static SKIP: OnceLock<bool> = OnceLock::new();
    *SKIP.get_or_init(|| std::env::var(SKIP_ORDERING_ENV).as_deref() == Ok("1"))
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A connected socket speaking frames.
struct Link {
    connection: Connection,
    peer_pid: u32,
}

impl Link {
    fn send(&self, frame: &Frame, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let bytes = frame.encode();
        if bytes.len() > MAX_FRAME {
            return Err(Error::Invalid(format!(
                "a {}-byte frame is over the {MAX_FRAME}-byte limit; put bulk data in tensors",
                bytes.len()
            )));
        }
        Ok(self.connection.send(&bytes, fds)?)
    }

    /// The next frame, or `None` when the peer hung up.
    fn recv(&self, buf: &mut [u8]) -> Result<Option<(Frame, Vec<OwnedFd>)>> {
        let (n, fds) = self.connection.recv(buf)?;
        self.decode(&buf[..n], fds)
    }

    /// The next frame if one is waiting (`Ok(None)` if not), without sleeping; `Some(None)` when
    /// the peer hung up.
    #[expect(clippy::type_complexity, reason = "recv's answer, or nothing waiting")]
    fn try_recv(&self, buf: &mut [u8]) -> Result<Option<Option<(Frame, Vec<OwnedFd>)>>> {
        match self.connection.try_recv(buf)? {
            Some((n, fds)) => self.decode(&buf[..n], fds).map(Some),
            None => Ok(None),
        }
    }

    fn decode(&self, bytes: &[u8], fds: Vec<OwnedFd>) -> Result<Option<(Frame, Vec<OwnedFd>)>> {
        if bytes.is_empty() {
            return Ok(None);
        }
        let frame = Frame::decode(bytes).map_err(|source| Error::Frame { pid: self.peer_pid, source })?;
        Ok(Some((frame, fds)))
    }

    fn shutdown(&self, how: rustix::net::Shutdown) {
        let _ = rustix::net::shutdown(&self.connection, how);
    }

    /// Checks that the peer runs as this user (`SO_PEERCRED`), the second lock after the
    /// socket file's 0600 mode.
    fn new(connection: Connection) -> Result<Link> {
        let credentials = connection.peer_credentials()?;
        let uid = rustix::process::getuid().as_raw();
        if credentials.uid != uid {
            return Err(Error::PeerRefused(format!(
                "pid {} runs as uid {}, not {uid}",
                credentials.pid, credentials.uid
            )));
        }
        Ok(Link { connection, peer_pid: credentials.pid as u32 })
    }

    /// Says who we are (and, from a receiver, how many messages the sender may have in flight).
    fn hello(&self, capacity: u32) -> Result<()> {
        self.send(&Frame::Hello { pid: std::process::id(), host: HostId::current()?.0, capacity }, &[])
    }

    /// Checks the peer's `Hello`: same protocol (checked by decoding) and same machine.
    fn check_hello(frame: &Frame) -> Result<u32> {
        match frame {
            Frame::Hello { host, capacity, .. } if *host == HostId::current()?.0 => Ok(*capacity),
            Frame::Hello { .. } => Err(Error::PeerRefused("the peer runs on another machine".into())),
            other => Err(Error::Protocol(format!("the first frame was {other:?}, not a Hello"))),
        }
    }
}
