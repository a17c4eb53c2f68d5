//! The per-message path of a local link: a shared-memory ring each way (`ipc_core::ring`,
//! issue 26, design decision 13), so that a credit, a release or a small message costs no socket
//! write, no socket wake-up and no `recvmsg`.
//!
//! After the switch ([`super::link::Link::offer_rings`] and the link frames of
//! [`LinkFrame`](crate::wire::LinkFrame)) each side's ring is its ONE ordered path: a frame the
//! socket must carry (descriptors, a frame longer than a record, one the socket keeps) is
//! announced by a marker record ([`LinkFrame::OnSocket`](crate::wire::LinkFrame::OnSocket)) and
//! written on the socket after it, under the link's send lock; the reader, popping a marker, reads
//! exactly one whole frame from the socket before it pops again. The socket keeps the set-up,
//! descriptors, and the hang-up: on its end the reader drains the ring first (what a producer
//! pushed before it died is delivered), then reports the peer gone.
//!
//! Waking: each side has an eventfd doorbell in its link's poll set, which the peer's writer
//! rings only when this side said it may sleep ([`Inbound::settle`]: it found its ring empty);
//! a stream that keeps the reader busy makes no system call for the rings. A spinning reader
//! finds its ring empty often, so its writer rings once per record it then pushes (the price of
//! a reader that may stop spinning and sleep at any point without telling the link).
//!
//! A blocking message therefore costs the writer's `write` of the doorbell, the reader's wake-up
//! and one `read` that empties the doorbell when the ring is next found empty (three system
//! calls; a socket's floor is two). Four rules keep it there (issue 26; strace of `tq-bench`'s
//! blocking round trip: its main thread made 3.2 system calls a round trip before, 2.0-2.3
//! after, the `recvmsg` of every empty look gone):
//! - a link whose ring may hold records ([`Inbound::rung`], the doorbell readable) is read
//!   before its receiver polls, instead of a poll that would return at once;
//! - the socket is read while the ring is empty only by a reader that was already armed and is
//!   called again ([`Inbound::time_to_look`]), not each time it arms: what the socket holds (the
//!   hang-up, a frame read ahead of its marker) keeps the poll set readable, so the next call
//!   looks;
//! - a rung reader that finds a record already there pops it without emptying the doorbell and
//!   ringing it again ([`Inbound::settle`]);
//! - a receiver watches the socket and the doorbell in its own poll set
//!   ([`super::link::Link::wake_fds`]), a sender's reader thread in the link's, so that a
//!   wake-up crosses one level of epoll, not two.

use std::os::fd::{AsFd as _, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_core::ring::{self, RingError, RingReader, RingWriter};

use crate::wire::{LinkFrame, MAX_PACKET};

/// Each ring's data bytes: the least that lets every one-packet frame fit a record (half of it,
/// so `MAX_PACKET` plus the record's words), and a receiver's credits of small messages fit
/// many times over (a writer that finds its ring full queues behind it, as on a full socket).
/// Pages are touched as records go round: a busy connection holds 512 KiB of shared memory (one
/// ring each way; 1 MiB rings measured the same on the development machine), and 5 descriptors
/// at the receiver (the socket, the link's poll set, two rings, a doorbell) and 6 at the sender
/// (the receiver's doorbell too) where the socket alone took 1.
pub(crate) const RING_CAPACITY: usize = 256 << 10;
const _: () = assert!(RING_CAPACITY / 2 >= MAX_PACKET + 64, "every one-packet frame fits a record");

/// The environment variable that keeps local links on the socket when `0` (for measurements
/// and tests: the frames are the same, only their path differs). Read at each connection's
/// set-up, on both sides: either side can refuse the rings.
pub const RINGS_ENV: &str = "TQ_RINGS";

/// Whether this process uses rings for new local links ([`RINGS_ENV`]).
pub(crate) fn enabled() -> bool {
    std::env::var(RINGS_ENV).as_deref() != Ok("0")
}

/// How long the reader of an empty ring goes without reading the socket: a frame whose marker
/// it has not popped yet, or the hang-up. A reader woken by the socket finds it within this.
const SOCKET_LOOK: Duration = Duration::from_micros(10);

/// What a receiver made for a connection: everything both sides need, so that descriptors
/// cross once, at the greeting (a receiver short of descriptors later loses none of them).
pub(crate) struct Offer {
    /// The ring the sender writes.
    pub reader: RingReader,
    /// The ring the sender reads (ringing the sender's doorbell).
    pub writer: RingWriter,
    /// Ours, rung by the sender: in the link's poll set, and in its receiver's
    /// ([`super::link::Link::wake_fds`]).
    pub doorbell: Arc<OwnedFd>,
}

/// Creates a receiver's rings and both doorbells: the offer, and the sender's doorbell to send
/// with it (then closed here at once: the descriptors a connection holds do not change later,
/// when the process may be short of them).
pub(crate) fn create() -> ipc_core::Result<(Offer, OwnedFd)> {
    let (doorbell, theirs) = (ring::doorbell()?, ring::doorbell()?);
    let mut reader = RingReader::create("tensor-queue ring in", RING_CAPACITY)?;
    reader.set_doorbell(Some(duplicate(&doorbell)?))?;
    let mut writer = RingWriter::create("tensor-queue ring out", RING_CAPACITY)?;
    writer.set_doorbell(Some(duplicate(&theirs)?))?;
    Ok((Offer { reader, writer, doorbell: Arc::new(doorbell) }, theirs))
}

/// A sender's side of a receiver's [`LinkFrame::Rings`] and its four descriptors (the ring to
/// write, the ring to read, the receiver's doorbell, ours): our ends, and our doorbell.
pub(crate) fn open(fds: Vec<OwnedFd>) -> ipc_core::Result<(RingWriter, RingReader, OwnedFd)> {
    let [to_them, from_them, their_doorbell, doorbell]: [OwnedFd; 4] =
        fds.try_into().map_err(|fds: Vec<OwnedFd>| {
            ipc_core::Error::InvalidArgument(format!("{} descriptors with the rings", fds.len()))
        })?;
    let mut writer = RingWriter::open(to_them)?;
    writer.set_doorbell(Some(their_doorbell))?;
    let mut reader = RingReader::open(from_them)?;
    // Non-blocking, as `ring::doorbell` makes them: emptying it must never wait.
    reader.set_doorbell(Some(duplicate(&doorbell)?))?;
    rustix::io::ioctl_fionbio(&doorbell, true)
        .map_err(|e| ipc_core::Error::Os { what: "a doorbell", source: e.into() })?;
    Ok((writer, reader, doorbell))
}

pub(crate) fn duplicate(fd: &OwnedFd) -> ipc_core::Result<OwnedFd> {
    fd.try_clone().map_err(|source| ipc_core::Error::Os { what: "duplicating a ring's descriptor", source })
}

/// Which path the peer's frames take now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// The socket alone: before the switch, on a link without rings, or over TCP.
    Socket,
    /// The ring, with markers for frames on the socket.
    Ring,
}

/// Whether the writer was asked to ring the doorbell. The rule that keeps a reader from
/// sleeping on records: while the ring may hold records, the doorbell is readable (so the
/// link's poll set is), until the reader finds the ring empty; a caller that reads one frame per
/// wake-up (a receiver, one per connection) then never sleeps on a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sleep {
    /// Not asked yet (a new link), and the doorbell is empty.
    Idle,
    /// Asked (the ring was empty): the writer rings at its next record.
    Armed,
    /// Records came since: the doorbell is readable (rung by the writer, or by us where the
    /// writer may not have), emptied when the ring is found empty.
    Rung,
}

/// A packet read from the socket before its marker was popped.
pub(crate) struct Ahead {
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
    pub lost: Option<crate::error::Error>,
}

/// What popping the ring gave.
pub(crate) enum Popped {
    /// A frame's bytes, in [`Inbound::record`].
    Record,
    /// The next frame is on the socket.
    Marker,
    /// Nothing published.
    Empty,
}

/// The reading side of a local link (see the module).
pub(crate) struct Inbound {
    pub path: Path,
    /// A receiver's rings until the sender agrees.
    pub offered: Option<Offer>,
    /// The ring the peer writes, once mapped.
    pub reader: Option<RingReader>,
    /// Our doorbell: in the link's poll set, emptied here.
    pub doorbell: Option<Arc<OwnedFd>>,
    /// A marker was popped: the next frame is the socket's.
    pub owes: bool,
    /// A socket packet read before its marker.
    pub ahead: Option<Ahead>,
    /// The socket ended: the ring is drained, then the peer is gone.
    pub hung_up: bool,
    sleep: Sleep,
    looked: Instant,
    /// The last record popped.
    pub record: Vec<u8>,
}

impl Default for Inbound {
    fn default() -> Inbound {
        Inbound {
            path: Path::Socket,
            offered: None,
            reader: None,
            doorbell: None,
            owes: false,
            ahead: None,
            hung_up: false,
            sleep: Sleep::Idle,
            looked: Instant::now(),
            record: Vec::new(),
        }
    }
}

impl Inbound {
    /// Pops the ring's next record.
    pub fn pop(&mut self) -> Result<Popped, RingError> {
        let Some(reader) = self.reader.as_mut() else { return Ok(Popped::Empty) };
        if !reader.try_pop(&mut self.record)? {
            return Ok(Popped::Empty);
        }
        match self.sleep {
            // The writer rang, or is about to: it saw our flag after publishing.
            Sleep::Armed => self.sleep = Sleep::Rung,
            Sleep::Idle => self.ring_ourselves(),
            Sleep::Rung => {}
        }
        match LinkFrame::peek(&self.record) {
            None => Ok(Popped::Record),
            Some(Ok(LinkFrame::OnSocket)) => Ok(Popped::Marker),
            Some(_) => Err(RingError::Corrupt { what: "a link frame other than a marker on the ring", value: 0 }),
        }
    }

    /// For a reader that found the ring empty and returns "nothing": asks the writer to ring the
    /// doorbell at its next record (emptying the doorbell first if it may have rung). `true` if
    /// a record came meanwhile (pop again).
    ///
    /// With `again`, an armed reader empties the doorbell and asks once more: the writer may
    /// have rung for a record popped before its ring (it rings after publishing), which would
    /// leave the doorbell readable over an empty ring.
    pub fn settle(&mut self, again: bool) -> Result<bool, RingError> {
        let Some(reader) = self.reader.as_mut() else { return Ok(false) };
        if self.sleep == Sleep::Armed && !again {
            return Ok(false);
        }
        // Rung, the doorbell is readable: a record already there (the peer was quick) keeps it
        // so, and is popped without emptying the doorbell now and ringing it again (two system
        // calls saved). Otherwise the doorbell is emptied, and the ring looked at once more below,
        // since the writer may have rung, for a record, into what we emptied.
        if self.sleep == Sleep::Rung && reader.prepare_to_sleep()?.is_some() {
            return Ok(true);
        }
        if self.sleep != Sleep::Idle
            && let Some(doorbell) = &self.doorbell
        {
            // Non-blocking: an empty doorbell is no error.
            let _ = rustix::io::read(doorbell.as_fd(), &mut [0u8; 8]);
        }
        match reader.prepare_to_sleep()? {
            None => {
                self.sleep = Sleep::Armed;
                Ok(false)
            }
            // A record came before our flag was seen: the writer may not ring for it.
            Some(_) => {
                self.ring_ourselves();
                Ok(true)
            }
        }
    }

    /// For a reader that waits for the socket frame a marker announced: empties the doorbell,
    /// so that only the socket wakes it (records behind the frame ring it again, see [`Sleep`]).
    pub fn wait_for_socket(&mut self) {
        if self.sleep == Sleep::Rung
            && let Some(doorbell) = &self.doorbell
        {
            let _ = rustix::io::read(doorbell.as_fd(), &mut [0u8; 8]);
        }
        if self.sleep != Sleep::Armed {
            self.sleep = Sleep::Idle;
        }
    }

    /// After the socket frame a marker announced: the ring is to be looked at again before
    /// any sleep, whatever [`Inbound::wait_for_socket`] emptied.
    pub fn socket_frame_read(&mut self) {
        if self.sleep == Sleep::Idle {
            self.ring_ourselves();
        }
    }

    /// Makes the doorbell readable ourselves (see [`Sleep`]).
    fn ring_ourselves(&mut self) {
        if let Some(doorbell) = &self.doorbell {
            // Fails only when the counter is full, and then it is readable anyway.
            let _ = rustix::io::write(doorbell.as_fd(), &1u64.to_ne_bytes());
        }
        self.sleep = Sleep::Rung;
    }

    /// Whether the ring may hold records the reader has not popped: the doorbell is readable
    /// (or about to be), so a poll set holding it would not sleep. A caller about to sleep reads
    /// such a link first instead of polling ([`Inbound::settle`] then empties the doorbell).
    pub fn rung(&self) -> bool {
        self.reader.is_some() && self.sleep == Sleep::Rung
    }

    /// Whether to read the socket now, while the ring is empty: only once the writer was asked
    /// to ring (the reader said so before, and was woken or called again with nothing new: by
    /// the socket, a spurious wake-up or a spin loop), and at most every [`SOCKET_LOOK`]. A
    /// reader that just emptied its ring arms without looking: the socket's hang-up, or a frame
    /// read ahead of its marker, keeps the link's poll set readable, and the next call looks.
    pub fn time_to_look(&mut self) -> bool {
        if self.sleep != Sleep::Armed {
            return false;
        }
        let now = Instant::now();
        if now.duration_since(self.looked) < SOCKET_LOOK {
            return false;
        }
        self.looked = now;
        true
    }
}
