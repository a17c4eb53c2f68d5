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
//!
//! A local link moves its per-message frames to shared-memory rings after the greeting
//! (`links/rings.rs`: the switch, the markers of frames the socket carries, the doorbells);
//! which path a frame took is this module's business alone.

use std::collections::VecDeque;
use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ipc_core::ring::{RingError, RingReader, RingWriter, Tally, Wakeup};
use ipc_core::tcp::Bulk;
use ipc_core::transport::{Packets, Peer};
use ipc_core::{HostId, SharedMemory};
use rustix::event::{PollFd, PollFlags, Timespec, poll};

use super::poll::{PollSet, Waited};
use super::rings::{self, Ahead, Inbound, Path, Popped};
use crate::error::{Error, Refusal, Result, Violation};
use crate::fences::liveness::{Gone, Liveness};
use crate::route::{Reach, Routing};
use crate::wire::{self, Assembler, Frame, Hello, LinkFrame, MAX_MESSAGE_BYTES, MAX_PACKET};

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
    /// A local link: its own poll set (the socket, and the doorbell of its inbound ring once
    /// there is one), which [`Link::fd`] gives; and the reading side of its rings.
    local: Option<Local>,
}

/// What only a local link has (see the field).
struct Local {
    ready: PollSet,
    inbound: Mutex<Inbound>,
    /// What our side has accepted to send (see [`Link::accepted`]): no lock per message.
    accepted: AtomicU64,
    /// The tally of our ring it is published in, once there is one.
    tally: OnceLock<Tally>,
    /// A receiver's doorbell, from its offer of rings on: with the socket, what its receiver
    /// watches in its own poll set ([`Link::wake_fds`]).
    doorbell: OnceLock<Arc<OwnedFd>>,
}

/// A packet read into the caller's buffer: its length, its descriptors, and the error of those
/// the kernel dropped.
type Packet = (usize, Vec<OwnedFd>, Option<Error>);

/// How often [`Link::wait_written_for`] asks whether the peer's machine acknowledged the bytes.
const ACK_POLL: Duration = Duration::from_micros(100);

/// Tokens in a local link's poll set (only its readiness as a whole is used).
const SOCKET: u64 = 0;
const DOORBELL: u64 = 1;

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
    /// Our ring to the peer, once switched (`links/rings.rs`): frames go there, in order with
    /// the queue; taken out by the writer thread while it waits for room.
    ring: Option<RingWriter>,
    /// Whether frames go to the ring: `ring` may be out with the writer thread.
    rings_on: bool,
}

/// What waits in the outbox: a packet and the descriptors that go with it, or a bulk run of
/// bytes written straight from its memory ([`Link::send_bulk`]).
enum Queued {
    Packet(Vec<u8>, Vec<OwnedFd>),
    Bulk(Bulk),
    /// A ring record: a frame, or the marker of one on the socket.
    Record(Vec<u8>),
}

/// A frame's bytes, if a message may be that long ([`Error::TooLarge`] otherwise).
fn encode_message(frame: &impl Frame) -> Result<Vec<u8>> {
    let bytes = frame.encode();
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(Error::TooLarge { size: bytes.len(), limit: MAX_MESSAGE_BYTES });
    }
    Ok(bytes)
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
        // Without a poll set of its own (no descriptor free for it) a local link stays on the
        // socket, as one over TCP does.
        let local = match remote {
            true => None,
            false => PollSet::new().and_then(|ready| ready.add(connection.as_fd(), SOCKET).map(|()| ready)).ok().map(
                |ready| Local {
                    ready,
                    inbound: Mutex::default(),
                    accepted: AtomicU64::new(0),
                    tally: OnceLock::new(),
                    doorbell: OnceLock::new(),
                },
            ),
        };
        Ok(Link {
            connection,
            outbox: Arc::default(),
            drained: Arc::default(),
            peer_pid: AtomicU32::new(pid),
            remote,
            liveness: Arc::new(Liveness::new(probe)),
            local,
        })
    }

    /// For a receiver, before its `Hello`: offers the sender a ring each way
    /// ([`LinkFrame::Rings`], `links/rings.rs`). A link that cannot make them (no memfd, rings
    /// turned off with [`rings::RINGS_ENV`]) stays on the socket, as one over TCP does.
    pub fn offer_rings(&self) -> Result<()> {
        let Some(local) = &self.local else { return Ok(()) };
        if !rings::enabled() {
            return Ok(());
        }
        let (offer, theirs) = match rings::create().map_err(Error::from).and_then(|(offer, theirs)| {
            local.ready.add(offer.doorbell.as_fd(), DOORBELL)?;
            Ok((offer, theirs))
        }) {
            Ok(offered) => offered,
            Err(error) => {
                tracing::debug!(%error, "no rings for this connection; it stays on the socket");
                return Ok(());
            }
        };
        let _ = local.doorbell.set(offer.doorbell.clone());
        let mut inbound = lock(&local.inbound);
        let fds = [offer.reader.fd(), offer.writer.fd(), offer.doorbell.as_fd(), theirs.as_fd()];
        self.send(&LinkFrame::Rings, &fds)?;
        tracing::debug!(pid = self.peer_pid(), "rings offered");
        inbound.offered = Some(offer);
        Ok(())
    }

    /// Handles a link frame read from the socket before the switch (see `links/rings.rs`).
    fn on_link_frame(&self, local: &Local, inbound: &mut Inbound, frame: LinkFrame, fds: Vec<OwnedFd>) -> Result<()> {
        tracing::debug!(pid = self.peer_pid(), ?frame, fds = fds.len(), "link frame");
        let unexpected =
            |what: &str| -> Result<()> { Err(Violation::LinkFrameOutOfPlace { what: what.into() }.into()) };
        match frame {
            // A sender's side: map the receiver's rings, or say no.
            LinkFrame::Rings if inbound.offered.is_none() && inbound.reader.is_none() => {
                let mapped = match rings::enabled() {
                    true => rings::open(fds).map_err(Error::from).and_then(|(writer, reader, doorbell)| {
                        local.ready.add(doorbell.as_fd(), DOORBELL)?;
                        Ok((writer, reader, doorbell))
                    }),
                    false => Err(Error::Invalid(format!("{}=0", rings::RINGS_ENV))),
                };
                // A receiver gone meanwhile is seen by the reads that follow (its frames first).
                match mapped {
                    Ok((writer, reader, doorbell)) => {
                        inbound.reader = Some(reader);
                        inbound.doorbell = Some(Arc::new(doorbell));
                        let _ = self.rings_out(writer);
                    }
                    Err(error) => {
                        tracing::debug!(%error, "not using the receiver's rings; this connection stays on the socket");
                        let _ = self.send(&LinkFrame::RingsOff, &[]);
                    }
                }
                Ok(())
            }
            // A receiver's side: the sender writes its ring from now on, and reads ours.
            LinkFrame::RingsOn if inbound.offered.is_some() && fds.is_empty() => {
                let Some(rings::Offer { reader, writer, doorbell }) = inbound.offered.take() else { unreachable!() };
                inbound.reader = Some(reader);
                inbound.doorbell = Some(doorbell);
                inbound.path = Path::Ring;
                // A sender gone meanwhile is seen by the reads that follow, its ring drained first.
                let _ = self.rings_out(writer);
                Ok(())
            }
            // A sender's side: the receiver's frames come through its ring from now on.
            LinkFrame::RingsOn if inbound.reader.is_some() && fds.is_empty() => {
                inbound.path = Path::Ring;
                Ok(())
            }
            LinkFrame::RingsOff if inbound.offered.is_some() => {
                if let Some(offer) = inbound.offered.take() {
                    local.ready.remove(offer.doorbell.as_fd());
                }
                Ok(())
            }
            other => unexpected(&format!("a link frame {other:?} out of place")),
        }
    }

    /// For a sender, after `send` took message `seq` (written, or queued for the link's writer
    /// thread): published in the shared memory of the ring to the peer, where a receiver finds
    /// it after this process died. So a SIGKILLed sender's messages that never left its queue
    /// are counted, not taken for a clean goodbye ([`Link::peer_accepted`]). A link without
    /// rings (over TCP, before the switch, `TQ_RINGS=0`) keeps the count for the switch.
    pub fn accepted(&self, seq: u64) {
        if let Some(local) = &self.local {
            // Calls are serialised by the sender's write lock; the one race is with the switch
            // (`rings_out`, on the reader thread): both store, then look at the other's word
            // (`SeqCst`), so at least one of them publishes the last count.
            local.accepted.store(seq, Ordering::SeqCst);
            if let Some(tally) = local.tally.get() {
                tally.publish(seq);
            }
        }
    }

    /// What the peer last published with [`Link::accepted`], if its ring is mapped here: a
    /// claim of the peer's (a liar can only misreport its own losses). A receiver reads it in
    /// the ring it offered too: a sender that switched and died before its `RingsOn` left its
    /// queue published its count there all the same.
    pub fn peer_accepted(&self) -> Option<u64> {
        let local = self.local.as_ref()?;
        let inbound = lock(&local.inbound);
        inbound.reader.as_ref().or(inbound.offered.as_ref().map(|offer| &offer.reader)).map(RingReader::tally)
    }

    /// Sends `RingsOn` on the socket, after which our frames go to `writer`: under the send
    /// lock, so every frame is on one side of it.
    fn rings_out(&self, writer: RingWriter) -> Result<()> {
        if let Some(local) = &self.local {
            let tally = local.tally.get_or_init(|| writer.tally());
            // Until the count published is the last one stored: a `send` that stored a later
            // count before the tally was set, and published it after our load, is not undone.
            loop {
                let seq = local.accepted.load(Ordering::SeqCst);
                tally.publish(seq);
                if local.accepted.load(Ordering::SeqCst) == seq {
                    break;
                }
            }
        }
        let bytes = LinkFrame::RingsOn.encode();
        let mut out = lock(&self.outbox);
        if out.broken {
            return Err(Error::Disconnected);
        }
        self.put_packets(&mut out, &bytes, &[])?;
        out.ring = Some(writer);
        out.rings_on = true;
        Ok(())
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
        let bytes = encode_message(frame)?;
        let mut out = lock(&self.outbox);
        if out.broken {
            return Err(Error::Disconnected);
        }
        if out.rings_on {
            if takes_a_record(&bytes, fds) {
                tracing::trace!(pid = self.peer_pid(), len = bytes.len(), "send: ring record");
                return self.put_record(&mut out, bytes);
            }
            tracing::trace!(pid = self.peer_pid(), len = bytes.len(), fds = fds.len(), "send: marker, then the socket");
            // The marker first: a reader reads the socket only once it popped it.
            self.put_record(&mut out, LinkFrame::OnSocket.encode())?;
            if crate::switches::die_after_marker() {
                die();
            }
        }
        self.put_packets(&mut out, &bytes, fds)
    }

    /// Pushes `record` to the ring, or queues it behind what is queued (or when the ring is full).
    fn put_record(&self, out: &mut Outbox, record: Vec<u8>) -> Result<()> {
        if out.queue.is_empty() && !out.writing {
            let ring = out.ring.as_mut().ok_or(Error::Disconnected)?;
            match ring.push(&record) {
                Ok(()) => return Ok(()),
                Err(RingError::Full { .. }) => {}
                Err(error) => {
                    out.broken = true;
                    return Err(broken_ring(error));
                }
            }
        }
        out.queue.push_back(Queued::Record(record));
        self.start_writer(out)
    }

    /// Writes a frame's packets on the socket, or queues them (see [`Link::send`]).
    fn put_packets(&self, out: &mut Outbox, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        let packets = wire::packets(bytes);
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
        self.start_writer(out)
    }

    /// Sends a bulk run of bytes straight from the memory they lie in (over TCP only; see
    /// `ipc_core::tcp`) and then `frame`, in order with the frames sent before, without waiting
    /// for the peer: what the socket cannot take yet is written by the link's writer thread. The
    /// run's owner is dropped once its last byte is in the socket, or the peer is gone.
    ///
    /// The run and the frame go in one vectored write: the frame (the message the run's bytes
    /// belong to) reaches the peer with them, which costs it one wake-up, not two.
    pub fn send_bulk_then(&self, bulk: Bulk, frame: &impl Frame) -> Result<()> {
        let bytes = encode_message(frame)?;
        let bulk = wire::packets(&bytes).iter().try_fold(bulk, |bulk, packet| bulk.followed_by(packet))?;
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
        let mut out = lock(&self.outbox);
        if out.broken {
            return Err(Error::Disconnected);
        }
        if !out.queue.is_empty() || out.writing {
            return Ok(false);
        }
        if out.rings_on {
            let eligible = takes_a_record(&bytes, &[]);
            let ring = out.ring.as_mut().ok_or(Error::Disconnected)?;
            let pushed = match eligible {
                true => ring.push(&bytes),
                false => ring.push(&LinkFrame::OnSocket.encode()),
            };
            match pushed {
                Ok(()) if eligible => return Ok(true),
                // The marker is out: the frame follows it, queued if the socket is full.
                Ok(()) => return self.put_packets(&mut out, &bytes, &[]).map(|()| true),
                Err(RingError::Full { .. }) => return Ok(false),
                Err(error) => {
                    out.broken = true;
                    return Err(broken_ring(error));
                }
            }
        }
        self.connection.try_send(&bytes, &[]).map_err(peer_gone)
    }

    /// Waits up to `timeout` until every queued packet is written and, over TCP, acknowledged by
    /// the peer's machine, or the peer is gone: whether nothing is left to write. A sender that
    /// dies with bytes unread in its socket (credits, releases) resets the connection, and the
    /// kernel throws away what it had not yet sent; what the peer acknowledged stays readable
    /// there. So bytes count as written only once acknowledged.
    pub fn wait_written_for(&self, timeout: Duration) -> bool {
        let deadline = ipc_core::deadline::deadline(timeout);
        let out = lock(&self.outbox);
        let (out, _) = self
            .drained
            .wait_timeout_while(out, timeout, |out| out.writing && !out.broken)
            .unwrap_or_else(|e| e.into_inner());
        if out.broken {
            return true;
        }
        if out.writing {
            return false;
        }
        drop(out);
        loop {
            if self.connection.unacknowledged() == 0 || self.gone().is_some() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            // Loopback acknowledges within microseconds, another host within a round trip.
            std::thread::sleep(ACK_POLL);
        }
    }

    /// Reads the next packet if one is waiting, without sleeping. A packet whose descriptors
    /// the kernel dropped (this process had no room for them) is still read: the error that
    /// says so comes back beside it, for the frame to be refused alone rather than the whole
    /// connection lost.
    ///
    /// On a local link the frames come from the socket, or after the switch from the peer's ring
    /// in the order it wrote them (`links/rings.rs`): a marker there means "the next frame is
    /// the socket's"; at the socket's end the ring is drained before [`Read::HungUp`].
    pub fn try_recv<F: Frame>(&self, assembler: &mut Assembler, buf: &mut [u8]) -> Result<(Read<F>, Option<Error>)> {
        let Some(local) = &self.local else {
            return match self.read_packet(buf)? {
                Some((n, fds, lost)) => Ok((self.join(assembler, &buf[..n], fds)?, lost)),
                None => Ok((Read::Nothing, None)),
            };
        };
        let mut inbound = lock(&local.inbound);
        let inbound = &mut *inbound;
        loop {
            if inbound.path == Path::Socket {
                let Some((n, fds, lost)) = self.read_packet(buf)? else { return Ok((Read::Nothing, None)) };
                if n > 0
                    && let Some(frame) = LinkFrame::peek(&buf[..n])
                {
                    let frame = frame.map_err(|source| Error::Frame { pid: self.peer_pid(), source })?;
                    self.on_link_frame(local, inbound, frame, fds)?;
                    continue;
                }
                return Ok((self.join(assembler, &buf[..n], fds)?, lost));
            }
            if inbound.owes {
                let (read, lost) = match inbound.ahead.take() {
                    Some(Ahead { bytes, fds, lost }) => (self.owed(assembler, &bytes, fds)?, lost),
                    None => match self.read_packet(buf)? {
                        Some((n, fds, lost)) => (self.owed(assembler, &buf[..n], fds)?, lost),
                        None => {
                            tracing::trace!(pid = self.peer_pid(), "recv: the marker's frame is not on the socket yet");
                            inbound.wait_for_socket();
                            return Ok((Read::Nothing, None));
                        }
                    },
                };
                inbound.owes = matches!(read, Read::Nothing);
                if !inbound.owes {
                    // Records may wait behind it, with the doorbell emptied meanwhile.
                    inbound.socket_frame_read();
                }
                return Ok((read, lost));
            }
            match inbound.pop().map_err(|error| self.corrupt(error))? {
                Popped::Marker => {
                    tracing::trace!(pid = self.peer_pid(), "recv: marker");
                    inbound.owes = true;
                    continue;
                }
                Popped::Record => {
                    tracing::trace!(pid = self.peer_pid(), len = inbound.record.len(), "recv: ring record");
                    let frame =
                        F::decode(&inbound.record).map_err(|source| Error::Frame { pid: self.peer_pid(), source })?;
                    return Ok((Read::Frame(frame, Vec::new()), None));
                }
                Popped::Empty => {}
            }
            if inbound.ahead.is_some() {
                return Err(Violation::UnmarkedSocketFrame.into());
            }
            if inbound.hung_up {
                self.liveness.report(Gone::HungUp);
                return Ok((Read::HungUp, None));
            }
            let look = inbound.time_to_look();
            if inbound.settle(look).map_err(|error| self.corrupt(error))? {
                continue;
            }
            if !look {
                return Ok((Read::Nothing, None));
            }
            // The hang-up, or a frame whose marker is now on the ring (it was pushed first).
            match self.read_packet(buf)? {
                None => return Ok((Read::Nothing, None)),
                Some((0, ..)) => inbound.hung_up = true,
                Some((n, fds, lost)) => inbound.ahead = Some(Ahead { bytes: buf[..n].to_vec(), fds, lost }),
            }
        }
    }

    /// Reads the next packet from the socket if one is waiting: its length in `buf`, its
    /// descriptors, and the error of descriptors the kernel dropped (see [`Link::try_recv`]).
    fn read_packet(&self, buf: &mut [u8]) -> Result<Option<Packet>> {
        match self.connection.try_recv(buf) {
            Ok(Some((n, fds))) => Ok(Some((n, fds, None))),
            Ok(None) => Ok(None),
            Err(error @ ipc_core::Error::DescriptorTableFull { received, .. }) if received > 0 => {
                Ok(Some((received, Vec::new(), Some(error.into()))))
            }
            Err(error) => Err(error.into()),
        }
    }

    /// The socket's packet a marker announced: a frame (or a part of one), never a link frame;
    /// the socket's end here means the peer died between the marker and its frame.
    fn owed<F: Frame>(&self, assembler: &mut Assembler, packet: &[u8], fds: Vec<OwnedFd>) -> Result<Read<F>> {
        if LinkFrame::peek(packet).is_some() {
            return Err(Violation::LinkFrameOutOfPlace { what: "after the switch to the ring".into() }.into());
        }
        self.join(assembler, packet, fds)
    }

    /// A ring the peer broke: this connection ends with [`Violation::CorruptRing`].
    fn corrupt(&self, error: RingError) -> Error {
        Violation::CorruptRing { why: format!("the ring from process {}: {error}", self.peer_pid()) }.into()
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

    /// Waits for the next packet (or a hang-up): a local link on its own poll set, which holds
    /// the socket and the ring's doorbell; a remote one on its socket. `Read::Nothing` when a
    /// wake-up brought nothing whole (part of a longer frame, a doorbell rung for records
    /// another thread took).
    pub fn recv<F: Frame>(&self, assembler: &mut Assembler, buf: &mut [u8]) -> Result<Read<F>> {
        let mut tokens = Vec::new();
        loop {
            let (read, _) = self.try_recv(assembler, buf)?;
            // Packets read ahead into this process (TCP) are not seen by a poll: read them first.
            if !matches!(read, Read::Nothing) || self.has_buffered() {
                return Ok(read);
            }
            let ready = match &self.local {
                Some(local) => local.ready.wait(&mut tokens, None)? == Waited::Ready,
                None => ipc_core::seqpacket::wait_readable(self.connection.as_fd(), Duration::MAX)?,
            };
            tracing::trace!(ready, "link recv: woke");
            if ready {
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

    /// The descriptors a receiver watches in its own poll set for this link's frames, instead
    /// of the link's poll set ([`Link::fd`]): the socket, and on a local link whose rings were
    /// offered (at the greeting, before the receiver takes the link) the doorbell of its ring.
    /// One level of epoll on the wake-up path, not two; the same token for both.
    pub fn wake_fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        let doorbell = self.local.as_ref().and_then(|local| local.doorbell.get()).map(|fd| fd.as_fd());
        std::iter::once(self.connection.as_fd()).chain(doorbell)
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

    /// Whether the peer's ring may hold records not read yet (see `links/rings.rs`): the link's
    /// poll set is readable for them, so a caller that reads one frame per wake-up reads this
    /// link before it sleeps, instead of a poll that would return at once.
    pub fn ring_rung(&self) -> bool {
        self.local.as_ref().is_some_and(|local| lock(&local.inbound).rung())
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

/// Whether a frame, once the rings are on, goes in a ring record of its own; if not, it goes on
/// the socket behind a marker record (a frame with descriptors, or too long for one record).
/// [`Link::send`] and [`Link::try_send`] both ask here.
fn takes_a_record(bytes: &[u8], fds: &[BorrowedFd<'_>]) -> bool {
    fds.is_empty() && wire::ring_eligible(bytes) && bytes.len() <= MAX_PACKET
}

// Two probes of the socket's end, for two questions. `closed` is the reading side's: will
// anything more come? A peer that shut only its writing direction (`RDHUP`) has said all, but
// only once we read what it sent. `hung_up` is the writing side's: will the peer read what we
// write? A peer that shut its writing direction still reads, and what it sent that we have not
// read yet does not matter.

/// The liveness probe of a link: whether the peer has closed the connection (or its process is
/// gone) and nothing it sent is left to read, without reading.
fn closed(connection: &dyn Packets) -> bool {
    let ended = poll_now(connection, PollFlags::RDHUP).intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR);
    ended && !connection.has_buffered() && rustix::io::ioctl_fionread(connection.as_fd()).is_ok_and(|n| n == 0)
}

/// Whether the peer hung up the socket (its process is gone, or it shut both directions).
fn hung_up(connection: &dyn Packets) -> bool {
    poll_now(connection, PollFlags::empty()).intersects(PollFlags::HUP | PollFlags::ERR)
}

/// The socket's events of `asked` (and those always reported) now, without waiting; none if
/// `poll` failed.
fn poll_now(connection: &dyn Packets, asked: PollFlags) -> PollFlags {
    let mut fds = [PollFd::from_borrowed_fd(connection.as_fd(), asked)];
    match poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })) {
        Ok(_) => fds[0].revents(),
        Err(_) => PollFlags::empty(),
    }
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
            Some(Queued::Record(record)) => match out.ring.take() {
                None => Err(ipc_core::Error::PeerGone),
                Some(mut ring) => match ring.push(&record) {
                    Ok(()) => {
                        out.ring = Some(ring);
                        Ok(true)
                    }
                    Err(RingError::Full { .. }) => {
                        // Wait for room outside the lock: senders meanwhile only queue
                        // (`writing`), so nobody needs the ring.
                        let len = record.len();
                        out.queue.push_front(Queued::Record(record));
                        drop(out);
                        let waited = ring.wait_for_room(len, Some(RING_WAIT), Some(connection.as_fd()));
                        out = lock(outbox);
                        out.ring = Some(ring);
                        match waited {
                            Ok(Wakeup::Watched) if hung_up(connection) => Err(ipc_core::Error::PeerGone),
                            Ok(_) => continue,
                            Err(error) => Err(error.into()),
                        }
                    }
                    Err(error) => Err(error.into()),
                },
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

/// How long the writer thread waits for room in a full ring before it looks again.
const RING_WAIT: Duration = Duration::from_millis(100);

/// A write to a ring the peer broke: the connection's sending side ends.
fn broken_ring(error: RingError) -> Error {
    Violation::CorruptRing { why: format!("the ring to the peer: {error}") }.into()
}

/// The test switch of [`crate::switches::die_after_marker`]: this process dies at once.
fn die() -> ! {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    std::process::abort()
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

#[cfg(test)]
mod tests {
    use ipc_core::ring::RingWriter;
    use ipc_core::seqpacket::Connection;

    use super::*;
    use crate::wire::ToReceiver;

    /// A receiver's link whose rings are on, and the sender's end played by hand: its socket and
    /// the ring it writes.
    fn switched() -> (Link, Connection, RingWriter, Assembler, Vec<u8>) {
        let (ours, theirs) = Connection::pair().unwrap();
        let link = Link::new(Box::new(ours)).unwrap();
        link.offer_rings().unwrap();
        let mut buf = vec![0u8; MAX_PACKET];
        let (n, fds) = theirs.recv(&mut buf).unwrap();
        assert_eq!(LinkFrame::decode(&buf[..n]), Ok(LinkFrame::Rings));
        let [to_receiver, _, doorbell, _]: [OwnedFd; 4] = fds.try_into().unwrap();
        let mut ring = RingWriter::open(to_receiver).unwrap();
        ring.set_doorbell(Some(doorbell)).unwrap();
        theirs.send(&LinkFrame::RingsOn.encode(), &[]).unwrap();
        let mut assembler = Assembler::default();
        assert!(matches!(link.try_recv::<ToReceiver>(&mut assembler, &mut buf).unwrap().0, Read::Nothing));
        let (n, _) = theirs.recv(&mut buf).unwrap();
        assert_eq!(LinkFrame::decode(&buf[..n]), Ok(LinkFrame::RingsOn), "the receiver's own switch");
        (link, theirs, ring, assembler, buf)
    }

    fn readable(link: &Link) -> bool {
        let ready = &link.local.as_ref().expect("a local link").ready;
        let mut fds = [PollFd::from_borrowed_fd(ready.fd(), PollFlags::IN)];
        poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap() == 1
    }

    fn next(link: &Link, assembler: &mut Assembler, buf: &mut [u8]) -> Read<ToReceiver> {
        for _ in 0..10_000 {
            match link.try_recv(assembler, buf).unwrap().0 {
                Read::Nothing => std::thread::sleep(Duration::from_micros(20)),
                other => return other,
            }
        }
        panic!("nothing came");
    }

    /// The bug this fixed: a marker popped before its socket frame came emptied the doorbell,
    /// and the record behind the frame then waited in the ring with nothing readable, for a
    /// receiver that reads one frame per wake-up.
    #[test]
    fn records_behind_a_late_socket_frame_keep_the_link_readable() {
        let (link, theirs, mut ring, mut assembler, mut buf) = switched();
        ring.push(&LinkFrame::OnSocket.encode()).unwrap();
        assert!(readable(&link), "the doorbell rang for the marker");
        assert!(matches!(link.try_recv::<ToReceiver>(&mut assembler, &mut buf).unwrap().0, Read::Nothing));
        let event = ToReceiver::Event { id: 3, handle: vec![1; 64] };
        theirs.send(&event.encode(), &[]).unwrap();
        ring.push(&ToReceiver::Retire { chunk: 9 }.encode()).unwrap();
        assert!(matches!(next(&link, &mut assembler, &mut buf), Read::Frame(frame, _) if frame == event));
        assert!(readable(&link), "a record waits: the link must say so");
        assert!(matches!(next(&link, &mut assembler, &mut buf), Read::Frame(ToReceiver::Retire { chunk: 9 }, _)));
    }

    /// At the socket's end the ring is drained first; a marker whose frame never comes ends it.
    #[test]
    fn a_hang_up_delivers_what_the_ring_holds_first() {
        let (link, theirs, mut ring, mut assembler, mut buf) = switched();
        ring.push(&ToReceiver::Retire { chunk: 1 }.encode()).unwrap();
        ring.push(&ToReceiver::Retire { chunk: 2 }.encode()).unwrap();
        ring.push(&LinkFrame::OnSocket.encode()).unwrap();
        drop(theirs);
        for chunk in [1, 2] {
            assert!(
                matches!(next(&link, &mut assembler, &mut buf), Read::Frame(ToReceiver::Retire { chunk: c }, _) if c == chunk)
            );
        }
        assert!(matches!(next(&link, &mut assembler, &mut buf), Read::HungUp));
        assert_eq!(link.gone(), Some(Gone::HungUp));
    }

    /// A frame on the socket without its marker, and a ring that breaks its rules, are typed
    /// errors of this connection.
    #[test]
    fn a_lying_peer_gets_typed_errors() {
        let (link, theirs, _ring, mut assembler, mut buf) = switched();
        theirs.send(&ToReceiver::Retire { chunk: 1 }.encode(), &[]).unwrap();
        let error = loop {
            match link.try_recv::<ToReceiver>(&mut assembler, &mut buf) {
                Ok((Read::Nothing, _)) => std::thread::sleep(Duration::from_micros(20)),
                Ok(_) => panic!("a frame without its marker was taken"),
                Err(error) => break error,
            }
        };
        assert!(matches!(&error, Error::Violation(Violation::UnmarkedSocketFrame)), "{error}");

        let (link, _theirs, ring, mut assembler, mut buf) = switched();
        let memory =
            SharedMemory::from_fd(ring.fd().try_clone_to_owned().unwrap(), 4096 + rings::RING_CAPACITY).unwrap();
        memory.store_u64(128, 12345).unwrap(); // the head, not 8-aligned
        let error = link.try_recv::<ToReceiver>(&mut assembler, &mut buf).err().expect("a typed error");
        assert!(matches!(&error, Error::Violation(Violation::CorruptRing { .. })), "{error}");
    }
}
