//! A connected socket speaking frames: the only place that writes or reads the socket.
//!
//! The socket is a [`Packets`] link: a Unix seqpacket socket on one machine, or an
//! authenticated TCP link between hosts. The protocol above is written once for both; the one
//! difference it sees is [`Link::remote`] (no descriptors cross, every tensor moves as between
//! hosts, and the peer's machine may differ).
//!
//! Frames longer than a packet travel in parts ([`wire::packets`], joined by
//! [`wire::Assembler`]). Writes never hold a lock of the channel's state: a blocked write must
//! never stop the thread that reads the peer's frames, or two honest processes that write to
//! each other at once wait for each other forever.

use std::collections::VecDeque;
use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ipc_core::tcp::Bulk;
use ipc_core::transport::{Packets, Peer};
use ipc_core::{HostId, SharedMemory};
use rustix::event::{PollFd, PollFlags, Timespec, poll};

use super::poll::{PollSet, Waited};
use crate::error::{Error, Refusal, Result};
use crate::fences::liveness::{Gone, Liveness};
use crate::route::{Reach, Routing};
use crate::wire::{self, Assembler, Frame, Hello, MAX_MESSAGE_BYTES, MAX_PACKET};

/// What a read that may find a bulk run found ([`Link::try_recv_or_bulk`]).
#[allow(clippy::large_enum_variant)] // returned at once, never stored
pub(crate) enum Incoming<F> {
    /// A read as [`Link::try_recv`]'s.
    Read(Read<F>, Option<Error>),
    /// A bulk run of host bytes is next (over TCP only), with this many bytes not read yet:
    /// read them with [`Link::try_recv_bulk`].
    Bulk(u64),
}

/// What a read found: frames of the kind `F` that the reader decodes (each side decodes only
/// the frames that travel towards it).
pub(crate) enum Read<F> {
    /// A whole frame and the descriptors that came with it.
    Frame(F, Vec<OwnedFd>),
    /// Nothing whole yet (nothing waiting, or a part of a longer frame).
    Nothing,
    /// The peer closed its end: nothing more will come.
    HungUp,
}

/// A connected socket and who is at the other end.
pub(crate) struct Link {
    connection: Arc<dyn Packets>,
    /// Packets taken and not yet written (see [`Link::send`]).
    outbox: Arc<Mutex<Outbox>>,
    /// Signalled when the outbox empties or breaks.
    drained: Arc<Condvar>,
    /// The peer's process id: as the kernel recorded it at connect time, or for a peer on
    /// another host as its `Hello` said (0 until then).
    peer_pid: AtomicU32,
    /// Whether the peer is across a TCP link: it shares no memory, handle or descriptor with us.
    pub remote: bool,
    /// Whether the peer is gone, and why: the socket, the pidfd watcher and NCCL report to it.
    liveness: Arc<Liveness>,
}

/// Packets of frames a send took that the socket had no room for yet: written in order by a
/// writer thread of the link, before any later frame. What a sender queues here is bounded by
/// its credits (messages the receiver agreed to take) and the announcements they need.
#[derive(Default)]
struct Outbox {
    queue: VecDeque<Queued>,
    /// Whether a writer thread is writing the queue.
    writing: bool,
    /// The peer was found gone while writing: later sends fail.
    broken: bool,
    /// A shutdown of the writing direction asked for while packets were queued.
    close_after: Option<rustix::net::Shutdown>,
}

/// What waits in the outbox: a packet and the descriptors that go with it, or a bulk run of
/// bytes written straight from its memory ([`Link::send_bulk`]).
enum Queued {
    Packet(Vec<u8>, Vec<OwnedFd>),
    Bulk(Bulk),
}

/// A random number drawn once per process: with the pid it names this process for good.
pub(crate) fn instance() -> u64 {
    static INSTANCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *INSTANCE.get_or_init(|| {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one((std::process::id(), crate::clock::monotonic_ns()))
    })
}

impl Link {
    /// A link over `connection`. A local peer must run as this user (`SO_PEERCRED`), the second
    /// lock after the socket file's 0600 mode; a remote one has proven the shared secret.
    pub fn new(connection: Box<dyn Packets>) -> Result<Link> {
        let (pid, remote) = match Link::check_peer(connection.as_ref())? {
            Some(pid) => (pid, false),
            None => (0, true),
        };
        let connection: Arc<dyn Packets> = Arc::from(connection);
        // The probe holds the socket weakly: a liveness kept by a worker never keeps it open.
        let socket = Arc::downgrade(&connection);
        let probe = Box::new(move || socket.upgrade().is_none_or(|socket| closed(&*socket)));
        Ok(Link {
            connection,
            outbox: Arc::default(),
            drained: Arc::default(),
            peer_pid: AtomicU32::new(pid),
            remote,
            liveness: Arc::new(Liveness::new(probe)),
        })
    }

    /// The peer's pid if it is local and runs as this user; `None` for a remote peer.
    pub fn check_peer(connection: &dyn Packets) -> Result<Option<u32>> {
        match connection.peer()? {
            Peer::Remote(_) => Ok(None),
            Peer::Local { pid, uid: theirs } => {
                let uid = rustix::process::getuid().as_raw();
                if theirs != uid {
                    return Err(Error::PeerRefused(Refusal::OtherUser { pid, uid: theirs, ours: uid }));
                }
                Ok(Some(pid))
            }
        }
    }

    /// The peer's process id (see the field).
    pub fn peer_pid(&self) -> u32 {
        self.peer_pid.load(Ordering::Relaxed)
    }

    /// Sends `frame` without waiting for the peer to read: what the socket has no room for is
    /// queued and written by the link's writer thread, in order, before any later frame. So a
    /// send never waits for the receiver (its credits are what bounds a sender, not the
    /// socket), and two processes that each send a large message to the other before
    /// receiving do not wait for each other. [`Error::Disconnected`] once the peer is gone.
    pub fn send(&self, frame: &impl Frame, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let bytes = frame.encode();
        if bytes.len() > MAX_MESSAGE_BYTES {
            return Err(Error::TooLarge { size: bytes.len(), limit: MAX_MESSAGE_BYTES });
        }
        let packets = wire::packets(&bytes);
        let mut out = lock(&self.outbox);
        if out.broken {
            return Err(Error::Disconnected);
        }
        let mut first_unsent = 0;
        if out.queue.is_empty() && !out.writing {
            while first_unsent < packets.len() {
                let fds = if first_unsent == 0 { fds } else { &[] };
                if !self.connection.try_send(&packets[first_unsent], fds).map_err(peer_gone)? {
                    break;
                }
                first_unsent += 1;
            }
        }
        if first_unsent == packets.len() {
            return Ok(());
        }
        for (index, packet) in packets.iter().enumerate().skip(first_unsent) {
            let owned =
                match index {
                    0 => fds.iter().map(|fd| fd.try_clone_to_owned()).collect::<std::io::Result<Vec<_>>>().map_err(
                        |e| ipc_core::Error::Os { what: "duplicating a descriptor to send later", source: e },
                    )?,
                    _ => Vec::new(),
                };
            out.queue.push_back(Queued::Packet(packet.to_vec(), owned));
        }
        self.start_writer(&mut out)
    }

    /// Sends a bulk run of bytes straight from the memory they lie in (over TCP only; see
    /// `ipc_core::tcp`), in order with the frames sent before and after, without waiting for
    /// the peer: what the socket cannot take yet is written by the link's writer thread. The
    /// run's owner is dropped once its last byte is in the socket, or the peer is gone.
    pub fn send_bulk(&self, bulk: Bulk) -> Result<()> {
        let mut out = lock(&self.outbox);
        if out.broken {
            return Err(Error::Disconnected);
        }
        let bulk = match out.queue.is_empty() && !out.writing {
            true => match self.connection.try_send_bulk(bulk).map_err(peer_gone)? {
                Ok(()) => return Ok(()),
                Err(bulk) => bulk,
            },
            false => bulk,
        };
        out.queue.push_back(Queued::Bulk(bulk));
        self.start_writer(&mut out)
    }

    /// Starts the writer thread for what is queued, unless one runs.
    fn start_writer(&self, out: &mut Outbox) -> Result<()> {
        if !out.writing {
            out.writing = true;
            let (connection, outbox, drained) = (self.connection.clone(), self.outbox.clone(), self.drained.clone());
            std::thread::Builder::new()
                .name("tq-link-writer".into())
                .spawn(move || write_queued(&*connection, &outbox, &drained))
                .map_err(|source| ipc_core::Error::Os { what: "spawning a link writer", source })?;
        }
        Ok(())
    }

    /// Sends a small frame if the socket has room now and nothing is queued before it:
    /// `Ok(false)` otherwise (nothing sent).
    pub fn try_send(&self, frame: &impl Frame) -> Result<bool> {
        let bytes = frame.encode();
        if bytes.len() > MAX_PACKET {
            // A string: the frames are this crate's own, small by construction (no caller acts on it).
            return Err(Error::Invalid(format!("a {}-byte control frame", bytes.len())));
        }
        let out = lock(&self.outbox);
        if out.broken {
            return Err(Error::Disconnected);
        }
        if !out.queue.is_empty() || out.writing {
            return Ok(false);
        }
        self.connection.try_send(&bytes, &[]).map_err(peer_gone)
    }

    /// Waits up to `timeout` until every queued packet is written, or the peer is gone: whether
    /// nothing is left queued.
    pub fn wait_written_for(&self, timeout: Duration) -> bool {
        let out = lock(&self.outbox);
        let (out, _) = self
            .drained
            .wait_timeout_while(out, timeout, |out| out.writing && !out.broken)
            .unwrap_or_else(|e| e.into_inner());
        !out.writing || out.broken
    }

    /// Reads the next packet if one is waiting, without sleeping. A packet whose descriptors
    /// the kernel dropped (this process had no room for them) is still read: the error that
    /// says so comes back beside it, for the frame to be refused alone rather than the whole
    /// connection lost.
    pub fn try_recv<F: Frame>(&self, assembler: &mut Assembler, buf: &mut [u8]) -> Result<(Read<F>, Option<Error>)> {
        match self.connection.try_recv(buf) {
            Ok(Some((n, fds))) => Ok((self.join(assembler, &buf[..n], fds)?, None)),
            Ok(None) => Ok((Read::Nothing, None)),
            Err(error @ ipc_core::Error::DescriptorTableFull { received, .. }) if received > 0 => {
                Ok((self.join(assembler, &buf[..received], Vec::new())?, Some(error.into())))
            }
            Err(error) => Err(error.into()),
        }
    }

    /// As [`Link::try_recv`], where a bulk run of host bytes may come (from a sender on another
    /// host): one at the front is reported, for [`Link::try_recv_bulk`] to read.
    pub fn try_recv_or_bulk<F: Frame>(&self, assembler: &mut Assembler, buf: &mut [u8]) -> Result<Incoming<F>> {
        match self.try_recv(assembler, buf) {
            Ok((read, lost)) => Ok(Incoming::Read(read, lost)),
            Err(Error::Core(ipc_core::Error::BulkAhead { left })) => Ok(Incoming::Bulk(left)),
            Err(error) => Err(error),
        }
    }

    /// Reads bytes of the bulk run at the front into `len` bytes at `offset` of `memory`,
    /// without waiting (see [`Link::try_recv_or_bulk`]): how many came (0: none yet).
    /// [`Error::Disconnected`] if the peer hung up in the middle of it.
    pub fn try_recv_bulk(&self, memory: &SharedMemory, offset: usize, len: usize) -> Result<usize> {
        self.connection.try_recv_bulk_into(memory, offset, len).map_err(peer_gone)
    }

    /// Waits for the next packet, on `set`, a poll set in which this link's socket is
    /// registered (and perhaps more: a wake-up of any other member ends the wait with
    /// [`Read::Nothing`]).
    pub fn recv<F: Frame>(&self, set: &PollSet, assembler: &mut Assembler, buf: &mut [u8]) -> Result<Read<F>> {
        let mut tokens = Vec::new();
        loop {
            let (read, _) = self.try_recv(assembler, buf)?;
            // Packets read ahead into this process (TCP) are not seen by the set: read them first.
            if !matches!(read, Read::Nothing) || self.has_buffered() {
                return Ok(read);
            }
            if set.wait(&mut tokens, None)? == Waited::Ready {
                return Ok(Read::Nothing);
            }
        }
    }

    fn join<F: Frame>(&self, assembler: &mut Assembler, packet: &[u8], fds: Vec<OwnedFd>) -> Result<Read<F>> {
        if packet.is_empty() {
            self.liveness.report(Gone::HungUp);
            return Ok(Read::HungUp);
        }
        match assembler.push(packet, fds) {
            Ok(Some((frame, fds))) => Ok(Read::Frame(frame, fds)),
            Ok(None) => Ok(Read::Nothing),
            Err(source) => Err(Error::Frame { pid: self.peer_pid(), source }),
        }
    }

    /// Shuts down one or both directions. The writing direction of a link with packets queued
    /// closes once they are written.
    pub fn shutdown(&self, how: rustix::net::Shutdown) {
        let mut out = lock(&self.outbox);
        if how == rustix::net::Shutdown::Write && out.writing {
            out.close_after = Some(how);
            return;
        }
        drop(out);
        self.connection.shutdown(how);
    }

    /// The socket, for `poll`.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.connection.as_fd()
    }

    /// Whether the peer is gone, and why (see `fences/liveness.rs`): for waits on another engine
    /// (NCCL) that would otherwise wait out their timeout, and to say why a connection ended.
    pub fn gone(&self) -> Option<Gone> {
        self.liveness.gone()
    }

    /// The peer's liveness, for the pidfd watcher and the NCCL workers to report to.
    pub fn liveness(&self) -> &Arc<Liveness> {
        &self.liveness
    }

    /// Whether a whole packet was read ahead and waits in this process, where `poll` on the
    /// socket cannot see it.
    pub fn has_buffered(&self) -> bool {
        self.connection.has_buffered()
    }

    /// Bytes read of a packet that is not whole yet (over TCP a packet arrives in pieces).
    pub fn partial(&self) -> usize {
        self.connection.partial()
    }

    /// Says who we are; a receiver adds how many messages a sender may have in flight, its GPUs
    /// and its routing policy (see [`crate::route`]).
    pub fn hello(&self, capacity: u32, reach: &Reach, routing: &Routing) -> Result<()> {
        let hello = Hello {
            pid: std::process::id(),
            host: HostId::current()?.0,
            capacity,
            instance: instance(),
            reach: reach.clone(),
            routing: routing.clone(),
        };
        self.send(&hello, &[])
    }

    /// Checks the peer's `Hello` (same protocol, checked by decoding, and, over a Unix socket, the
    /// same machine). A remote peer's pid is taken from it.
    pub fn check_hello(&self, hello: Hello) -> Result<Greeting> {
        let Hello { pid, host, capacity, instance, reach, routing } = hello;
        if !self.remote && host != HostId::current()?.0 {
            return Err(Error::PeerRefused(Refusal::OtherMachine));
        }
        if self.remote {
            self.peer_pid.store(pid, Ordering::Relaxed);
        }
        Ok(Greeting { capacity, instance, reach, routing })
    }
}

/// The liveness probe of a link: whether the peer has closed the connection (or its process is
/// gone) and nothing it sent is left to read, without reading.
fn closed(connection: &dyn Packets) -> bool {
    let mut fds = [PollFd::from_borrowed_fd(connection.as_fd(), PollFlags::RDHUP)];
    let closed = match poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })) {
        Ok(_) => fds[0].revents().intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR),
        Err(_) => false,
    };
    closed && !connection.has_buffered() && rustix::io::ioctl_fionread(connection.as_fd()).is_ok_and(|n| n == 0)
}

/// What a peer's `Hello` said.
pub(crate) struct Greeting {
    /// From a receiver: messages a sender may have in flight.
    pub capacity: u32,
    /// With the pid, names the peer process for good.
    pub instance: u64,
    /// From a receiver: its GPUs.
    pub reach: Reach,
    /// From a receiver: its routing policy.
    pub routing: Routing,
}

/// The link's writer thread: writes the queued packets as the socket takes them, however
/// slowly the peer reads, until the queue is empty or the peer is gone.
fn write_queued(connection: &dyn Packets, outbox: &Mutex<Outbox>, drained: &Condvar) {
    let mut fds = [PollFd::from_borrowed_fd(connection.as_fd(), PollFlags::OUT)];
    loop {
        let mut out = lock(outbox);
        let written = match out.queue.pop_front() {
            None => {
                out.writing = false;
                if let Some(how) = out.close_after.take() {
                    connection.shutdown(how);
                }
                drained.notify_all();
                return;
            }
            Some(Queued::Packet(packet, owned)) => {
                let borrowed: Vec<BorrowedFd<'_>> = owned.iter().map(|fd| fd.as_fd()).collect();
                let sent = connection.try_send(&packet, &borrowed);
                drop(borrowed);
                if matches!(sent, Ok(false)) {
                    out.queue.push_front(Queued::Packet(packet, owned));
                }
                sent
            }
            // A run the socket had no room to start goes back to the front; one taken is the
            // connection's to finish, and drops once written.
            Some(Queued::Bulk(bulk)) => match connection.try_send_bulk(bulk) {
                Ok(Ok(())) => Ok(true),
                Ok(Err(bulk)) => {
                    out.queue.push_front(Queued::Bulk(bulk));
                    Ok(false)
                }
                Err(error) => Err(error),
            },
        };
        match written {
            Ok(true) => {}
            Ok(false) => {
                drop(out);
                // The socket may have room while an earlier packet still holds up the next one.
                if !connection.wait_sent(Duration::from_millis(100)) {
                    let _ = poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 100_000_000 }));
                }
            }
            Err(error) => {
                tracing::debug!(%error, "the peer is gone; dropping what was queued for it");
                out.queue.clear();
                out.broken = true;
                out.writing = false;
                drained.notify_all();
                return;
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A write to a peer that is gone is [`Error::Disconnected`], whatever the socket said.
fn peer_gone(error: ipc_core::Error) -> Error {
    match error {
        ipc_core::Error::PeerGone => Error::Disconnected,
        other => other.into(),
    }
}
