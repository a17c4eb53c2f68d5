//! A ring of variable-length records in shared memory, one writer and one reader in two
//! processes of one machine, with a futex wake-up that costs a system call only when the other
//! side has said it is going to sleep.
//!
//! This is the per-message control path of issue 26 (design decision 13): a record written here
//! is read by the peer without a socket write, a socket wake-up or a `recvmsg`; a streaming or
//! spinning pair makes no system call at all. The socket stays for what only it can do: set-up,
//! file descriptors, and noticing that the peer is gone.
//!
//! # The shared file
//! One memfd ([`SharedMemory::create`]: sealed against resizing, so the peer cannot shrink it
//! under our mapping and raise `SIGBUS`), made by either side and passed to the other over the
//! Unix socket ([`crate::fd_passing`]); [`RingWriter::fd`] / [`RingReader::fd`] give it,
//! [`RingWriter::open`] / [`RingReader::open`] map it. Its first page is the header, the rest is
//! the data area of `capacity` bytes (a power of two, taken from the file's size, which the seals
//! fix):
//!
//! | offset | word | written by |
//! | --- | --- | --- |
//! | 0 | magic `b"ipcring1"`, then the version (`u32`) and the capacity (`u32`) | the creator, once |
//! | 128 | `head`: bytes ever published (`u64`) | the writer |
//! | 136 | the writer's notices ([`RingWriter::notify`], `u32`) | the writer |
//! | 144 | the writer's tally ([`Tally`], `u64`) | the writer |
//! | 256 | `tail`: bytes ever consumed (`u64`) | the reader |
//! | 264 | the reader's notices ([`RingReader::notify`], `u32`) | the reader |
//! | 384 | the reader sleeps (futex word, `u32`) | the reader (1), the writer (0) |
//! | 512 | the writer sleeps (futex word, `u32`) | the writer (1), the reader (0) |
//!
//! Each side's words have a 128-byte line of their own (two cache lines: the adjacent-line
//! prefetcher would otherwise make neighbours share), so the streaming side never pulls in a
//! line the other side writes, except the one with the counter it must read.
//!
//! A record is a `u32` length and its bytes, padded to 8 bytes. A record never wraps: where it
//! does not fit before the end, the writer puts a padding mark (`u32::MAX`) there and the record
//! at the start, and publishes both with one store of `head`. A record is at most
//! [`RingWriter::max_record`] bytes (half the capacity, less its length word), so one always
//! fits an empty ring.
//!
//! # Waking a sleeper (a flag, then the futex)
//! A side that finds nothing to do and wants to sleep stores 1 in its sleep word, then (after a
//! `SeqCst` fence) looks once more, then `FUTEX_WAIT`s on the word while it is 1. The other side
//! publishes, fences, and only if the word is 1 swaps it to 0 and `FUTEX_WAKE`s. The two fences
//! make it impossible for both to miss each other (the sleeper sees the record, or the publisher
//! sees the flag), so a wake-up is never lost, and a side that is not asleep costs a fence and a
//! load of a line that stays in cache, no system call. The futex is shared (not
//! `FUTEX_PRIVATE`): the kernel keys it by the file and offset, in both processes.
//!
//! # A dead peer: the socket, watched in slices
//! The ring is not the hang-up detector: a futex has no notion of its peer dying. A waiting call
//! ([`RingReader::wait`], [`RingReader::pop`], [`RingWriter::wait_for_room`]) takes a descriptor
//! to watch, the connection's socket, and returns [`Wakeup::Watched`] when the caller should read
//! it (a frame, or the hang-up). The futex wait is cut into slices of [`WATCH_SLICE`]; a slice
//! that ends with nothing new is followed by a `poll` of the socket, so a dead peer is noticed
//! within a slice. A live peer that writes a frame on the socket which the sleeper must see at
//! once calls `notify` ([`RingWriter::notify`], [`RingReader::notify`]) after writing it: that
//! bumps a notice word in the ring and wakes the sleeper, which returns [`Wakeup::Watched`]
//! without a system call of its own. So the fast path of a blocking wait is the futex wait and
//! nothing else; a descriptor that was already readable when the wait began, without a notice,
//! is seen within a slice (read the socket before waiting, as a receiver does anyway).
//!
//! Why slices by default: the futex is the cheapest wake-up (one `FUTEX_WAKE`, one
//! `FUTEX_WAIT`), and polling the socket before each sleep instead cost 1.3 us per wait,
//! measured (`examples/ring_bench.rs`, BENCHMARKS.md). The price of slices: a death is seen up
//! to [`WATCH_SLICE`] (10 ms) late, and an idle sleeper wakes 100 times a second for one `poll`
//! (a few us of CPU each, well under 0.1% of a core). Where that is not wanted, or one thread
//! waits on several rings, an eventfd doorbell polled with the socket replaces the futex
//! (next section): it sees a death at once for 0.1-0.5 us more per round trip.
//!
//! # Several rings, one sleeper: a doorbell
//! A futex wait watches one word, so a thread that serves several rings (a receiver with many
//! senders) or must also wait on other descriptors sleeps in `poll` instead: its process makes
//! one eventfd ([`doorbell`]), gives it to each ring it reads ([`RingReader::set_doorbell`]) and
//! a duplicate to each writer's process ([`RingWriter::set_doorbell`], the descriptor passed over
//! the socket); the writer then rings the eventfd instead of `FUTEX_WAKE`, still only when the
//! reader said it sleeps. [`RingReader::wait`] with a doorbell polls it and the watched socket
//! for the whole timeout (a dead peer is seen at once); a thread with its own poll set calls
//! [`RingReader::prepare_to_sleep`] on each ring, polls, and [`RingReader::awake`] after. A
//! wake-up costs three system calls instead of two: 5.9-6.3 us for a blocking round trip of
//! two processes against the futex's 5.8 (`examples/ring_bench.rs`, BENCHMARKS.md), and a dead
//! peer is seen at once. Streaming and spinning still cost none.
//!
//! # A peer that lies
//! The other process can write any word of the file at any time. So each side keeps its own
//! counter (the writer its `head`, the reader its `tail`) and the capacity in its own memory and
//! never reads them back; what it reads of the other's counter is checked (8-aligned, never more
//! than `capacity` ahead, never behind), every length is read once (atomically) and checked
//! against the capacity and the published bytes before a byte is copied, and copies go through
//! raw pointers into our own buffers, so a peer writing meanwhile tears its own data and nothing
//! else. Each call does a bounded amount of work (at most one padding mark and one record). A
//! check that fails is [`RingError::Corrupt`], and the ring stays broken from then on. The
//! sleep words are only hints: a peer that scribbles on them causes a spurious wake-up or a
//! sleep cut short by its slice, nothing more.
//!
//! Miri cannot run this module (memfd, `mmap`, futex), so the argument is written down: the
//! only pointers formed into the mapping are the header's words at constant offsets below its
//! first page, a length word at `counter % capacity` (8-aligned, so `+ 4 <= capacity`), and a
//! record's bytes at `position + 4 .. position + footprint(len)`, formed only after
//! `len <= capacity / 2 - 4`, `footprint <= published <= capacity` and
//! `position + footprint <= capacity` were checked on values read once into locals (the tests
//! `each_lie_of_the_writer_is_a_typed_error` fail, or crash, without each of them). No Rust
//! reference to shared bytes other than an atomic is ever made, and the mapping cannot shrink
//! under us (the seals).
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use ipc_core::ring::{RingReader, RingWriter, Wakeup};
//! let mut writer = RingWriter::create("doc", 4096)?;
//! // The descriptor would travel to the reader's process over the socket (`fd_passing`).
//! let mut reader = RingReader::open(writer.fd().try_clone_to_owned()?)?;
//! writer.push(b"hello")?;
//! let mut record = Vec::new();
//! let (_peer, socket) = ipc_core::seqpacket::Connection::pair()?;
//! let patience = Some(std::time::Duration::from_secs(1));
//! let woken = reader.pop(&mut record, patience, Some(std::os::fd::AsFd::as_fd(&socket)))?;
//! assert_eq!((woken, record.as_slice()), (Wakeup::Ready, &b"hello"[..]));
//! assert!(!reader.try_pop(&mut record)?, "empty now");
//! # Ok(()) }
//! ```

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, poll};
use rustix::io::Errno;
use rustix::thread::futex;

use crate::host::SharedMemory;
use crate::seqpacket::Connection;
use crate::{Error, Result};

/// The smallest capacity of a ring's data area, in bytes.
pub const MIN_CAPACITY: usize = 4096;
/// The largest capacity of a ring's data area, in bytes (1 GiB).
pub const MAX_CAPACITY: usize = 1 << 30;
/// How long a waiting call sleeps on the futex before it looks at the watched descriptor again:
/// the most a dead peer goes unnoticed (see the module docs).
pub const WATCH_SLICE: Duration = Duration::from_millis(10);

const MAGIC: u64 = u64::from_le_bytes(*b"ipcring1");

/// A number the writer's user publishes beside a ring's records ([`RingWriter::tally`]): what a
/// reader can still learn of the writer after its process died. tensor-queue publishes how
/// many messages `send` accepted, so that a receiver can tell how many a killed sender never
/// wrote.
#[derive(Clone, Debug)]
pub struct Tally {
    memory: Arc<SharedMemory>,
}

impl Tally {
    /// Publishes `value` (release ordering: records pushed before it are visible with it).
    pub fn publish(&self, value: u64) {
        // The mapping is the writer's own, read-write (checked when it was made or opened).
        let _ = self.memory.store_u64(WRITER_TALLY_AT, value);
    }
}
const VERSION: u32 = 1;
const HEADER_LEN: usize = 4096;
const VERSION_AT: usize = 8;
const CAPACITY_AT: usize = 12;
const HEAD_AT: usize = 128;
const WRITER_NOTICES_AT: usize = 136;
const WRITER_TALLY_AT: usize = 144;
const TAIL_AT: usize = 256;
const READER_NOTICES_AT: usize = 264;
const READER_SLEEPS_AT: usize = 384;
const WRITER_SLEEPS_AT: usize = 512;
/// The length word before each record's bytes.
const LENGTH_WORD: usize = 4;
/// Records start at multiples of this, so that their length words are aligned.
const ALIGN: usize = 8;
/// A length word that says "the rest of the data area is unused; the next record is at its start".
const PADDING: u32 = u32::MAX;

/// What went wrong on a ring (its set-up errors are [`crate::Error`]s).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    /// No room for the record now: the reader is behind. Nothing was written; wait for room
    /// ([`RingWriter::wait_for_room`]) and push again.
    #[error("the ring is full: {needed} bytes needed, {free} free (the reader is behind)")]
    Full {
        /// Bytes the record takes in the ring (with its length word, padding and any skip to the
        /// start).
        needed: usize,
        /// Bytes free now.
        free: usize,
    },
    /// A record longer than the ring takes ([`RingWriter::max_record`]); nothing was written.
    #[error("a record of {len} bytes is over this ring's limit of {max} bytes")]
    TooLarge {
        /// The record's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The shared memory breaks the ring's rules: the peer is broken or hostile (it shares the
    /// memory and wrote it). Nothing out of bounds was read or written; the ring stays broken
    /// and the connection should be closed.
    #[error("the ring's shared memory is corrupt ({what}: {value}); the peer is broken or hostile")]
    Corrupt {
        /// Which rule was broken.
        what: &'static str,
        /// The value found.
        value: u64,
    },
    /// A system call of a waiting call failed (`poll` of the watched descriptor, or the futex).
    #[error("{what} failed: {source}")]
    Os {
        /// The call.
        what: &'static str,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
}

/// Why a waiting call returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wakeup {
    /// What was waited for is there: a record to read (for [`RingReader::pop`]: copied into the
    /// caller's buffer), or room to write.
    Ready,
    /// Read the watched descriptor: the peer said so (`notify`), or a sleep slice ended and the
    /// descriptor is readable or hung up (a frame from the peer, or its hang-up). Records the
    /// peer published before it died stay readable.
    Watched,
    /// The timeout passed.
    TimedOut,
}

/// The mapping, the capacity as this process read it once, and the header's words.
#[derive(Debug)]
struct Shared {
    memory: Arc<SharedMemory>,
    capacity: usize,
}

impl Shared {
    fn create(name: &str, capacity: usize) -> Result<Shared> {
        if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
            return Err(Error::InvalidArgument(format!(
                "a ring's capacity must be a power of two from {MIN_CAPACITY} to {MAX_CAPACITY} bytes, not {capacity}"
            )));
        }
        let memory = Arc::new(SharedMemory::create(name, HEADER_LEN + capacity)?);
        let shared = Shared { memory, capacity };
        shared.word64(0).store(MAGIC, Ordering::Relaxed);
        shared.word32(VERSION_AT).store(VERSION, Ordering::Relaxed);
        shared.word32(CAPACITY_AT).store(capacity as u32, Ordering::Release);
        Ok(shared)
    }

    /// Maps a ring file from the peer. The capacity comes from the file's size (fixed by its
    /// seals, which `SharedMemory::from_fd` insists on), never from the words the peer can
    /// rewrite.
    fn open(fd: OwnedFd) -> Result<Shared> {
        let size = rustix::fs::fstat(&fd).map_err(|e| Error::os("fstat of a ring", e))?.st_size as u64;
        let capacity = size.saturating_sub(HEADER_LEN as u64);
        if !capacity.is_power_of_two() || !(MIN_CAPACITY as u64..=MAX_CAPACITY as u64).contains(&capacity) {
            return Err(RingError::Corrupt { what: "file size", value: size }.into());
        }
        let capacity = capacity as usize;
        let memory = Arc::new(SharedMemory::from_fd(fd, HEADER_LEN + capacity)?);
        if !memory.is_writable() {
            return Err(Error::ReadOnlyMemory);
        }
        let shared = Shared { memory, capacity };
        let magic = shared.word64(0).load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(RingError::Corrupt { what: "magic", value: magic }.into());
        }
        let version = shared.word32(VERSION_AT).load(Ordering::Relaxed);
        if version != VERSION {
            return Err(RingError::Corrupt { what: "version", value: version.into() }.into());
        }
        let written = shared.word32(CAPACITY_AT).load(Ordering::Relaxed);
        if written as usize != capacity {
            return Err(
                RingError::Corrupt { what: "capacity word against the file's size", value: written.into() }.into()
            );
        }
        Ok(shared)
    }

    /// The header's 8-byte word at `at` (a constant below [`HEADER_LEN`], 8-aligned).
    fn word64(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at + 8 <= HEADER_LEN && at.is_multiple_of(8));
        // SAFETY: `at` is one of this module's constants, inside the header (the mapping is at
        // least HEADER_LEN bytes, checked when it was made) and 8-aligned (the mapping is page
        // aligned); the word lives as long as `self`. Both processes access it only atomically
        // (a hostile peer's plain writes are outside this process: they change the value, which
        // every reader here checks, and nothing else).
        unsafe { AtomicU64::from_ptr(self.memory.as_ptr().add(at).cast()) }
    }

    /// The header's 4-byte word at `at` (a constant below [`HEADER_LEN`], 4-aligned).
    fn word32(&self, at: usize) -> &AtomicU32 {
        debug_assert!(at + 4 <= HEADER_LEN && at.is_multiple_of(4));
        // SAFETY: as in `word64`, for a 4-aligned word.
        unsafe { AtomicU32::from_ptr(self.memory.as_ptr().add(at).cast()) }
    }

    /// The length word of the record at `position` of the data area (8-aligned, below the
    /// capacity: the callers compute it as a counter modulo the capacity, rounded to 8).
    fn length_word(&self, position: usize) -> &AtomicU32 {
        debug_assert!(position + LENGTH_WORD <= self.capacity && position.is_multiple_of(ALIGN));
        // SAFETY: `position + 4 <= capacity` (a multiple of 8 below a capacity that is a multiple
        // of 8), so the word lies in the data area, which the mapping covers; 4-aligned; accessed
        // only atomically by this process.
        unsafe { AtomicU32::from_ptr(self.data().add(position).cast()) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the mapping is HEADER_LEN + capacity bytes long.
        unsafe { self.memory.as_ptr().add(HEADER_LEN) }
    }

    fn head(&self) -> &AtomicU64 {
        self.word64(HEAD_AT)
    }

    fn tail(&self) -> &AtomicU64 {
        self.word64(TAIL_AT)
    }

    fn reader_sleeps(&self) -> &AtomicU32 {
        self.word32(READER_SLEEPS_AT)
    }

    fn writer_sleeps(&self) -> &AtomicU32 {
        self.word32(WRITER_SLEEPS_AT)
    }

    /// The largest record: one always fits an empty ring, wherever its position.
    fn max_record(&self) -> usize {
        self.capacity / 2 - LENGTH_WORD
    }

    /// Checks a pair of counters read from the shared words: `head` at most `capacity` ahead of
    /// `tail`, never behind it, both 8-aligned.
    fn check_counters(&self, head: u64, tail: u64) -> std::result::Result<(), RingError> {
        if !head.is_multiple_of(ALIGN as u64) {
            return Err(RingError::Corrupt { what: "head not 8-aligned", value: head });
        }
        if !tail.is_multiple_of(ALIGN as u64) {
            return Err(RingError::Corrupt { what: "tail not 8-aligned", value: tail });
        }
        let used = head.wrapping_sub(tail);
        if used > self.capacity as u64 {
            return Err(RingError::Corrupt { what: "head and tail further apart than the capacity", value: used });
        }
        Ok(())
    }
}

/// Bytes a record of `len` takes in the data area.
fn footprint(len: usize) -> usize {
    (LENGTH_WORD + len).next_multiple_of(ALIGN)
}

/// Tells the other side, if it said it is going to sleep, that there is something new.
fn wake_if_sleeping(word: &AtomicU32, doorbell: Option<&OwnedFd>) {
    // Pairs with the sleeper's fence between storing its flag and looking again (module docs).
    fence(Ordering::SeqCst);
    if word.load(Ordering::Relaxed) != 0 && word.swap(0, Ordering::Relaxed) != 0 {
        match doorbell {
            // A failure (never expected for a mapped word) leaves the sleeper to its slice.
            None => drop(futex::wake(word, futex::Flags::empty(), 1)),
            // Non-blocking (set when it was given): a full counter is readable anyway.
            Some(fd) => drop(rustix::io::write(fd, &1u64.to_ne_bytes())),
        }
    }
}

/// A doorbell for a reader that sleeps in `poll` with other descriptors instead of on the
/// ring's futex (see "Several rings, one sleeper" in the module docs): a non-blocking eventfd.
/// Give it to the reader ([`RingReader::set_doorbell`]) and a duplicate to the writer's process,
/// which gives it to its writer ([`RingWriter::set_doorbell`]); one doorbell may serve all the
/// rings a reader waits on.
pub fn doorbell() -> Result<OwnedFd> {
    rustix::event::eventfd(0, rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC)
        .map_err(|e| Error::os("eventfd", e))
}

/// Makes a doorbell from the peer safe to ring: non-blocking, so that a peer that passed a full
/// pipe instead cannot make a push wait.
fn checked_doorbell(fd: OwnedFd) -> Result<OwnedFd> {
    let flags = rustix::fs::fcntl_getfl(&fd).map_err(|e| Error::os("fcntl(F_GETFL) of a doorbell", e))?;
    rustix::fs::fcntl_setfl(&fd, flags | rustix::fs::OFlags::NONBLOCK)
        .map_err(|e| Error::os("fcntl(F_SETFL) of a doorbell", e))?;
    Ok(fd)
}

/// Whether `fd` is readable or hung up, without waiting.
fn watched_ready(fd: BorrowedFd<'_>) -> std::result::Result<bool, RingError> {
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN | PollFlags::RDHUP)];
    loop {
        match poll(&mut fds, Some(&futex::Timespec { tv_sec: 0, tv_nsec: 0 })) {
            Ok(n) => return Ok(n > 0),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(RingError::Os { what: "poll of the watched descriptor", source: e.into() }),
        }
    }
}

/// Waits until `ready` says so, the other side bumps its notice word `notices` past `seen`
/// ([`Wakeup::Watched`]), `timeout` passes, or a futex sleep ends with nothing new and `watch`
/// is readable. Sleeps on the futex word `sleeps` (the module docs say how, and why in slices).
///
/// The fast path makes no system call but the futex wait itself: `watch` is polled only after a
/// sleep that brought nothing (its slice ran out, or a spurious wake-up).
fn wait_on(
    sleeps: &AtomicU32,
    doorbell: Option<BorrowedFd<'_>>,
    notices: &AtomicU32,
    seen: &mut u32,
    mut ready: impl FnMut() -> std::result::Result<bool, RingError>,
    timeout: Option<Duration>,
    watch: Option<BorrowedFd<'_>>,
) -> std::result::Result<Wakeup, RingError> {
    let mut check = || -> std::result::Result<Option<Wakeup>, RingError> {
        if ready()? {
            return Ok(Some(Wakeup::Ready));
        }
        let notice = notices.load(Ordering::Acquire);
        if notice != *seen {
            *seen = notice;
            return Ok(Some(Wakeup::Watched));
        }
        Ok(None)
    };
    let watched = |watch: Option<BorrowedFd<'_>>| match watch {
        Some(fd) => watched_ready(fd),
        None => Ok(false),
    };
    // A deadline too far to represent is no deadline.
    let deadline = timeout.and_then(|timeout| Instant::now().checked_add(timeout));
    loop {
        if let Some(wakeup) = check()? {
            return Ok(wakeup);
        }
        let mut slice = watch.map(|_| WATCH_SLICE);
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(if watched(watch)? { Wakeup::Watched } else { Wakeup::TimedOut });
            }
            slice = Some(slice.map_or(left, |slice| slice.min(left)));
        }
        sleeps.store(1, Ordering::Relaxed);
        // Pairs with the publisher's fence in `wake_if_sleeping`.
        fence(Ordering::SeqCst);
        if let Some(wakeup) = check()? {
            sleeps.store(0, Ordering::Relaxed);
            return Ok(wakeup);
        }
        if let Some(doorbell) = doorbell {
            // One `poll` of the doorbell and the socket, for the whole time left: no slices.
            let left = deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
            let hung_up = ring_doorbell_or_watch(doorbell, watch, left)?;
            sleeps.store(0, Ordering::Relaxed);
            if let Some(wakeup) = check()? {
                return Ok(wakeup);
            }
            if hung_up {
                return Ok(Wakeup::Watched);
            }
            continue;
        }
        let timespec = slice.map(timespec);
        match futex::wait(sleeps, futex::Flags::empty(), 1, timespec.as_ref()) {
            // Woken, the word no longer 1 (woken before we slept), the slice over, a signal.
            Ok(()) | Err(Errno::AGAIN | Errno::TIMEDOUT | Errno::INTR) => {}
            Err(e) => return Err(RingError::Os { what: "futex wait", source: e.into() }),
        }
        sleeps.store(0, Ordering::Relaxed);
        if let Some(wakeup) = check()? {
            return Ok(wakeup);
        }
        if watched(watch)? {
            return Ok(Wakeup::Watched);
        }
    }
}

fn timespec(duration: Duration) -> futex::Timespec {
    futex::Timespec { tv_sec: duration.as_secs().min(i64::MAX as u64) as i64, tv_nsec: duration.subsec_nanos().into() }
}

/// Sleeps in `poll` until the doorbell rings, `watch` is readable or hung up, or `left` passes
/// (`None`: no limit); empties the doorbell. Whether `watch` was the reason.
fn ring_doorbell_or_watch(
    doorbell: BorrowedFd<'_>,
    watch: Option<BorrowedFd<'_>>,
    left: Option<Duration>,
) -> std::result::Result<bool, RingError> {
    let timeout = left.map(timespec);
    let mut fds = vec![PollFd::from_borrowed_fd(doorbell, PollFlags::IN)];
    if let Some(fd) = watch {
        fds.push(PollFd::from_borrowed_fd(fd, PollFlags::IN | PollFlags::RDHUP));
    }
    match poll(&mut fds, timeout.as_ref()) {
        Ok(_) | Err(Errno::INTR) => {}
        Err(e) => return Err(RingError::Os { what: "poll of a doorbell", source: e.into() }),
    }
    let watched = fds.get(1).is_some_and(|fd| !fd.revents().is_empty());
    // Empty the counter (non-blocking: nothing there is no error).
    let _ = rustix::io::read(doorbell, &mut [0u8; 8]);
    Ok(watched)
}

/// The writing end of a ring (see the module docs). One per ring: `&mut self` keeps this
/// process to one writer, the protocol above keeps the peer to reading.
#[derive(Debug)]
pub struct RingWriter {
    shared: Shared,
    /// Bytes published: ours alone, never read back from the shared word.
    head: u64,
    /// The reader's tail as last read (checked), to know the free room without reading its line.
    tail: u64,
    /// Our notices so far ([`RingWriter::notify`]).
    notices: u32,
    /// The reader's notices as last seen.
    seen: u32,
    /// Rung instead of the futex when the reader sleeps ([`RingWriter::set_doorbell`]).
    doorbell: Option<OwnedFd>,
    /// Set by the first corruption found: every later call returns it.
    broken: Option<(&'static str, u64)>,
}

impl RingWriter {
    /// Creates a ring of `capacity` data bytes (a power of two from [`MIN_CAPACITY`] to
    /// [`MAX_CAPACITY`]) to write; give [`RingWriter::fd`] to the reader's process, which maps it
    /// with [`RingReader::open`]. `name` is for debugging (`/proc/<pid>/fd` shows it).
    pub fn create(name: &str, capacity: usize) -> Result<RingWriter> {
        RingWriter::new(Shared::create(name, capacity)?)
    }

    /// Maps a ring that the reader's process created ([`RingReader::create`]) and sent.
    pub fn open(fd: OwnedFd) -> Result<RingWriter> {
        RingWriter::new(Shared::open(fd)?)
    }

    fn new(shared: Shared) -> Result<RingWriter> {
        let head = shared.head().load(Ordering::Acquire);
        let tail = shared.tail().load(Ordering::Acquire);
        shared.check_counters(head, tail)?;
        let notices = shared.word32(WRITER_NOTICES_AT).load(Ordering::Relaxed);
        let seen = shared.word32(READER_NOTICES_AT).load(Ordering::Relaxed);
        Ok(RingWriter { shared, head, tail, notices, seen, doorbell: None, broken: None })
    }

    /// The shared-memory file, to send to the reader's process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.memory.fd()
    }

    /// The writer's tally: a number its user publishes beside the records, which the reader
    /// reads ([`RingReader::tally`]) even after the writer's process died. It lives as long as
    /// the mapping, which it keeps, so another thread may publish while this one waits.
    pub fn tally(&self) -> Tally {
        Tally { memory: self.shared.memory.clone() }
    }

    /// The data area's size in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// The longest record this ring takes: half the capacity, less the length word.
    pub fn max_record(&self) -> usize {
        self.shared.max_record()
    }

    /// Writes `record` and publishes it to the reader, waking the reader if it sleeps.
    /// [`RingError::Full`] if the reader has not made room yet, [`RingError::TooLarge`] over
    /// [`RingWriter::max_record`]: nothing is written then.
    pub fn push(&mut self, record: &[u8]) -> std::result::Result<(), RingError> {
        if let Some((what, value)) = self.broken {
            return Err(RingError::Corrupt { what, value });
        }
        if record.len() > self.max_record() {
            return Err(RingError::TooLarge { len: record.len(), max: self.max_record() });
        }
        let capacity = self.shared.capacity;
        let position = (self.head % capacity as u64) as usize;
        let size = footprint(record.len());
        let skip = if position + size > capacity { capacity - position } else { 0 };
        let needed = skip + size;
        if self.free() < needed {
            self.refresh_tail()?;
            if self.free() < needed {
                return Err(RingError::Full { needed, free: self.free() });
            }
        }
        let mut position = position;
        if skip > 0 {
            self.shared.length_word(position).store(PADDING, Ordering::Relaxed);
            position = 0;
        }
        self.shared.length_word(position).store(record.len() as u32, Ordering::Relaxed);
        // SAFETY: `position + size <= capacity` (a record never wraps: `skip` moved it to the
        // start otherwise), so the bytes lie in the data area; the reader does not read them
        // before `head` covers them (a hostile reader reading or writing them meanwhile tears the
        // record, in memory it shares by its own choice); `record` is our own memory.
        unsafe {
            std::ptr::copy_nonoverlapping(record.as_ptr(), self.shared.data().add(position + LENGTH_WORD), record.len())
        };
        self.head = self.head.wrapping_add(needed as u64);
        self.shared.head().store(self.head, Ordering::Release);
        wake_if_sleeping(self.shared.reader_sleeps(), self.doorbell.as_ref());
        Ok(())
    }

    /// Tells the reader to look at the watched socket: its waiting call returns
    /// [`Wakeup::Watched`] (at once if it sleeps, else at its next wait). Call it after writing a
    /// frame on the socket that the reader must see before its next slice ends.
    pub fn notify(&mut self) {
        self.notices = self.notices.wrapping_add(1);
        self.shared.word32(WRITER_NOTICES_AT).store(self.notices, Ordering::Release);
        wake_if_sleeping(self.shared.reader_sleeps(), self.doorbell.as_ref());
    }

    /// Rings `doorbell` (from the reader's process: [`doorbell`]) instead of the futex when the
    /// reader sleeps, or the futex again with `None`. The reader must use the same
    /// ([`RingReader::set_doorbell`]): a reader polling a doorbell that this writer does not ring
    /// sleeps until its timeout or its watched socket wakes it. The descriptor is made
    /// non-blocking, so that a ring of it never waits.
    pub fn set_doorbell(&mut self, doorbell: Option<OwnedFd>) -> Result<()> {
        self.doorbell = doorbell.map(checked_doorbell).transpose()?;
        Ok(())
    }

    /// Waits until a record of `len` bytes fits ([`Wakeup::Ready`]), the socket `watch` should be
    /// read ([`Wakeup::Watched`]: the reader called [`RingReader::notify`], or a sleep slice
    /// ended with `watch` readable or hung up), or `timeout` passes (`None`: no limit).
    /// [`RingError::TooLarge`] for a record that never fits.
    pub fn wait_for_room(
        &mut self,
        len: usize,
        timeout: Option<Duration>,
        watch: Option<BorrowedFd<'_>>,
    ) -> std::result::Result<Wakeup, RingError> {
        if len > self.max_record() {
            return Err(RingError::TooLarge { len, max: self.max_record() });
        }
        let capacity = self.shared.capacity;
        let size = footprint(len);
        let shared = &self.shared;
        let (head, tail, broken) = (self.head, &mut self.tail, &mut self.broken);
        wait_on(
            shared.writer_sleeps(),
            None,
            shared.word32(READER_NOTICES_AT),
            &mut self.seen,
            || {
                refresh_tail(shared, head, tail, broken)?;
                let position = (head % capacity as u64) as usize;
                let skip = if position + size > capacity { capacity - position } else { 0 };
                Ok(capacity - head.wrapping_sub(*tail) as usize >= skip + size)
            },
            timeout,
            watch,
        )
    }

    /// Pushes `record`, waiting for room as [`RingWriter::wait_for_room`] does: `Ok(Wakeup::Ready)`
    /// once written, or why it was not.
    pub fn push_waiting(
        &mut self,
        record: &[u8],
        timeout: Option<Duration>,
        watch: Option<BorrowedFd<'_>>,
    ) -> std::result::Result<Wakeup, RingError> {
        match self.push(record) {
            Err(RingError::Full { .. }) => {}
            other => return other.map(|()| Wakeup::Ready),
        }
        match self.wait_for_room(record.len(), timeout, watch)? {
            Wakeup::Ready => self.push(record).map(|()| Wakeup::Ready),
            other => Ok(other),
        }
    }

    fn free(&self) -> usize {
        self.shared.capacity - self.head.wrapping_sub(self.tail) as usize
    }

    fn refresh_tail(&mut self) -> std::result::Result<(), RingError> {
        refresh_tail(&self.shared, self.head, &mut self.tail, &mut self.broken)
    }
}

/// Reads the reader's tail and checks it against our `head`.
fn refresh_tail(
    shared: &Shared,
    head: u64,
    tail: &mut u64,
    broken: &mut Option<(&'static str, u64)>,
) -> std::result::Result<(), RingError> {
    if let Some((what, value)) = *broken {
        return Err(RingError::Corrupt { what, value });
    }
    let seen = shared.tail().load(Ordering::Acquire);
    // The tail only moves forward, up to our head.
    let checked = shared.check_counters(head, seen).and_then(|()| {
        if seen.wrapping_sub(*tail) > head.wrapping_sub(*tail) {
            Err(RingError::Corrupt { what: "tail moved backwards", value: seen })
        } else {
            Ok(())
        }
    });
    if let Err(RingError::Corrupt { what, value }) = &checked {
        *broken = Some((what, *value));
    }
    checked?;
    *tail = seen;
    Ok(())
}

/// The reading end of a ring (see the module docs).
#[derive(Debug)]
pub struct RingReader {
    shared: Shared,
    /// Bytes consumed: ours alone, never read back from the shared word.
    tail: u64,
    /// The writer's head as last read (checked).
    head: u64,
    /// Our notices so far ([`RingReader::notify`]).
    notices: u32,
    /// The writer's notices as last seen.
    seen: u32,
    /// Polled instead of sleeping on the futex ([`RingReader::set_doorbell`]).
    doorbell: Option<OwnedFd>,
    /// Set by the first corruption found: every later call returns it.
    broken: Option<(&'static str, u64)>,
}

impl RingReader {
    /// Creates a ring of `capacity` data bytes to read; give [`RingReader::fd`] to the writer's
    /// process, which maps it with [`RingWriter::open`]. As [`RingWriter::create`] otherwise.
    pub fn create(name: &str, capacity: usize) -> Result<RingReader> {
        RingReader::new(Shared::create(name, capacity)?)
    }

    /// Maps a ring that the writer's process created ([`RingWriter::create`]) and sent. Records
    /// it pushed before are read first.
    pub fn open(fd: OwnedFd) -> Result<RingReader> {
        RingReader::new(Shared::open(fd)?)
    }

    fn new(shared: Shared) -> Result<RingReader> {
        let tail = shared.tail().load(Ordering::Acquire);
        let head = shared.head().load(Ordering::Acquire);
        shared.check_counters(head, tail)?;
        let notices = shared.word32(READER_NOTICES_AT).load(Ordering::Relaxed);
        let seen = shared.word32(WRITER_NOTICES_AT).load(Ordering::Relaxed);
        Ok(RingReader { shared, tail, head, notices, seen, doorbell: None, broken: None })
    }

    /// The shared-memory file, to send to the writer's process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.memory.fd()
    }

    /// What the writer last published as its [`Tally`] (0 if nothing): a claim of the peer's,
    /// any value a hostile one likes, for reports only.
    pub fn tally(&self) -> u64 {
        self.shared.word64(WRITER_TALLY_AT).load(Ordering::Acquire)
    }

    /// The data area's size in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// Copies the next record into `out` (replacing what it held) and frees its room:
    /// `Ok(false)` if there is none now. Never sleeps and makes no system call unless the writer
    /// sleeps waiting for room.
    pub fn try_pop(&mut self, out: &mut Vec<u8>) -> std::result::Result<bool, RingError> {
        let Some((position, len, next_tail)) = self.next()? else {
            return Ok(false);
        };
        out.clear();
        out.reserve(len);
        // SAFETY: `position + 4 + len <= capacity` (checked by `next`), so the source lies in the
        // data area; `out` has room for `len` bytes (reserved above) and is our own memory, so the
        // two do not overlap. The writer does not touch published bytes until `tail` passes them
        // (a hostile one tears its own record, nothing else); every byte is initialised (the file
        // is zero-filled), so `set_len` exposes initialised bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.shared.data().add(position + LENGTH_WORD), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        self.tail = next_tail;
        self.shared.tail().store(self.tail, Ordering::Release);
        wake_if_sleeping(self.shared.writer_sleeps(), None);
        Ok(true)
    }

    /// Waits up to `timeout` (`None`: no limit) for the next record and copies it into `out`
    /// ([`Wakeup::Ready`]), unless the socket `watch` should be read first ([`Wakeup::Watched`],
    /// as for [`RingReader::wait`]: read it, then call again; records published before a
    /// hang-up are still delivered).
    pub fn pop(
        &mut self,
        out: &mut Vec<u8>,
        timeout: Option<Duration>,
        watch: Option<BorrowedFd<'_>>,
    ) -> std::result::Result<Wakeup, RingError> {
        // `wait` says Ready only once a record is published, so this runs at most twice (a head
        // that moved back in between is corrupt).
        loop {
            if self.try_pop(out)? {
                return Ok(Wakeup::Ready);
            }
            match self.wait(timeout, watch)? {
                Wakeup::Ready => continue,
                other => return Ok(other),
            }
        }
    }

    /// Waits up to `timeout` (`None`: no limit) until a record is waiting ([`Wakeup::Ready`]), or
    /// the socket `watch` should be read ([`Wakeup::Watched`]: the writer called
    /// [`RingWriter::notify`], or a sleep slice ended with `watch` readable or hung up). Sleeps on
    /// the futex, in slices of [`WATCH_SLICE`] while watching (module docs).
    pub fn wait(
        &mut self,
        timeout: Option<Duration>,
        watch: Option<BorrowedFd<'_>>,
    ) -> std::result::Result<Wakeup, RingError> {
        let shared = &self.shared;
        let (tail, head, broken) = (self.tail, &mut self.head, &mut self.broken);
        wait_on(
            shared.reader_sleeps(),
            self.doorbell.as_ref().map(AsFd::as_fd),
            shared.word32(WRITER_NOTICES_AT),
            &mut self.seen,
            || refresh_head(shared, tail, head, broken),
            timeout,
            watch,
        )
    }

    /// Sleeps in `poll` on `doorbell` (an eventfd from [`doorbell`]) and the watched socket
    /// instead of on the futex, or on the futex again with `None`; the writer must ring the same
    /// ([`RingWriter::set_doorbell`]). Costs more per wake-up than the futex (the writer's
    /// `write`, our `poll` and `read`), and sees a dead peer at once instead of within
    /// [`WATCH_SLICE`]; and one thread can sleep on several rings, with other descriptors:
    /// [`RingReader::prepare_to_sleep`].
    pub fn set_doorbell(&mut self, doorbell: Option<OwnedFd>) -> Result<()> {
        self.doorbell = doorbell.map(checked_doorbell).transpose()?;
        Ok(())
    }

    /// For a thread that sleeps in its own `poll` on several rings' shared doorbell (and
    /// sockets): says to the writer "ring the doorbell for the next record or notice", then
    /// looks once more. `Some` if something is there already (do not sleep then: pop it, or read
    /// the socket); `None`: poll, empty the doorbell, call [`RingReader::awake`] on every ring,
    /// and look again.
    pub fn prepare_to_sleep(&mut self) -> std::result::Result<Option<Wakeup>, RingError> {
        self.shared.reader_sleeps().store(1, Ordering::Relaxed);
        // Pairs with the writer's fence in `wake_if_sleeping`.
        fence(Ordering::SeqCst);
        if refresh_head(&self.shared, self.tail, &mut self.head, &mut self.broken)? {
            self.awake();
            return Ok(Some(Wakeup::Ready));
        }
        let notice = self.shared.word32(WRITER_NOTICES_AT).load(Ordering::Acquire);
        if notice != self.seen {
            self.seen = notice;
            self.awake();
            return Ok(Some(Wakeup::Watched));
        }
        Ok(None)
    }

    /// After a sleep begun with [`RingReader::prepare_to_sleep`]: the writer need not ring any more.
    pub fn awake(&mut self) {
        self.shared.reader_sleeps().store(0, Ordering::Relaxed);
    }

    /// Tells the writer, if it waits for room, to look at the watched socket (as
    /// [`RingWriter::notify`] does the other way).
    pub fn notify(&mut self) {
        self.notices = self.notices.wrapping_add(1);
        self.shared.word32(READER_NOTICES_AT).store(self.notices, Ordering::Release);
        wake_if_sleeping(self.shared.writer_sleeps(), None);
    }

    /// Where the next record's bytes are, how long it is, and the tail after it; `None` if
    /// nothing is published.
    fn next(&mut self) -> std::result::Result<Option<(usize, usize, u64)>, RingError> {
        if let Some((what, value)) = self.broken {
            return Err(RingError::Corrupt { what, value });
        }
        if self.head == self.tail && !refresh_head(&self.shared, self.tail, &mut self.head, &mut self.broken)? {
            return Ok(None);
        }
        let found = self.locate();
        if let Err(RingError::Corrupt { what, value }) = &found {
            self.broken = Some((what, *value));
        }
        found.map(Some)
    }

    /// Finds the record at `tail` (at most one padding mark, then one record) and checks it
    /// against the capacity and the published `head`.
    fn locate(&self) -> std::result::Result<(usize, usize, u64), RingError> {
        let capacity = self.shared.capacity;
        let published = self.head.wrapping_sub(self.tail) as usize; // <= capacity: checked
        let mut position = (self.tail % capacity as u64) as usize;
        let mut consumed = 0;
        let mut len = self.shared.length_word(position).load(Ordering::Relaxed);
        if len == PADDING {
            if position == 0 {
                return Err(RingError::Corrupt { what: "padding at the start of the data area", value: 0 });
            }
            consumed = capacity - position;
            if consumed + footprint(0) > published {
                return Err(RingError::Corrupt { what: "padding without a record after it", value: self.tail });
            }
            position = 0;
            len = self.shared.length_word(0).load(Ordering::Relaxed);
        }
        let len = len as usize;
        if len > self.shared.max_record() {
            return Err(RingError::Corrupt { what: "record length over the limit", value: len as u64 });
        }
        consumed += footprint(len);
        if consumed > published {
            return Err(RingError::Corrupt { what: "record longer than what was published", value: len as u64 });
        }
        if position + footprint(len) > capacity {
            return Err(RingError::Corrupt { what: "record crossing the end of the data area", value: len as u64 });
        }
        Ok((position, len, self.tail.wrapping_add(consumed as u64)))
    }
}

/// Reads the writer's head and checks it against our `tail`: whether anything is published.
fn refresh_head(
    shared: &Shared,
    tail: u64,
    head: &mut u64,
    broken: &mut Option<(&'static str, u64)>,
) -> std::result::Result<bool, RingError> {
    if let Some((what, value)) = *broken {
        return Err(RingError::Corrupt { what, value });
    }
    let seen = shared.head().load(Ordering::Acquire);
    // The head only moves forward.
    let checked = shared.check_counters(seen, tail).and_then(|()| {
        if seen.wrapping_sub(tail) < head.wrapping_sub(tail) {
            Err(RingError::Corrupt { what: "head moved backwards", value: seen })
        } else {
            Ok(())
        }
    });
    if let Err(RingError::Corrupt { what, value }) = &checked {
        *broken = Some((what, *value));
    }
    checked?;
    *head = seen;
    Ok(seen != tail)
}

/// The bytes of the message that carries a pair of rings ([`offer`], [`accept`]).
const OFFER: &[u8] = b"ipc-core ring pair v1";

/// Sets up a ring each way over `connection`: creates both with `capacity` data bytes, sends
/// their files in one message, and returns this side's ends (write, read). The peer calls
/// [`accept`]. A protocol that has its own set-up frames sends [`RingWriter::fd`] and
/// [`RingReader::fd`] in one of them instead.
pub fn offer(connection: &Connection, capacity: usize) -> Result<(RingWriter, RingReader)> {
    let writer = RingWriter::create("ipc-core ring out", capacity)?;
    let reader = RingReader::create("ipc-core ring in", capacity)?;
    connection.send(OFFER, &[writer.fd(), reader.fd()])?;
    Ok((writer, reader))
}

/// The peer's side of [`offer`]: receives the two rings and returns this side's ends (write,
/// read). A message that is not an offer is [`RingError::Corrupt`]; a hang-up is
/// [`Error::PeerGone`].
pub fn accept(connection: &Connection) -> Result<(RingWriter, RingReader)> {
    let mut buf = [0u8; 64];
    let (len, fds) = connection.recv(&mut buf)?;
    if len == 0 {
        return Err(Error::PeerGone);
    }
    let [theirs_out, theirs_in]: [OwnedFd; 2] = match fds.try_into() {
        Ok(fds) if &buf[..len] == OFFER => fds,
        _ => return Err(RingError::Corrupt { what: "ring offer message of length", value: len as u64 }.into()),
    };
    Ok((RingWriter::open(theirs_in)?, RingReader::open(theirs_out)?))
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::os::fd::AsFd;

    use proptest::prelude::*;

    use super::*;

    /// The writer's tally is read by the reader, also once the writer is gone.
    #[test]
    fn the_tally_outlives_the_writer() {
        let writer = RingWriter::create("tally", MIN_CAPACITY).unwrap();
        let reader = RingReader::open(writer.fd().try_clone_to_owned().unwrap()).unwrap();
        assert_eq!(reader.tally(), 0, "nothing published");
        let tally = writer.tally();
        tally.publish(41);
        drop(writer);
        tally.publish(42);
        drop(tally);
        assert_eq!(reader.tally(), 42);
    }

    /// A writer and a reader of one ring in this process (two mappings of one file, as two
    /// processes would have).
    fn pair(capacity: usize) -> (RingWriter, RingReader) {
        let writer = RingWriter::create("test", capacity).unwrap();
        let reader = RingReader::open(writer.fd().try_clone_to_owned().unwrap()).unwrap();
        (writer, reader)
    }

    /// A third mapping of the ring's file: what a hostile peer writes through.
    fn scribbler(writer: &RingWriter) -> SharedMemory {
        let fd = writer.fd().try_clone_to_owned().unwrap();
        SharedMemory::from_fd(fd, HEADER_LEN + writer.capacity()).unwrap()
    }

    fn record(index: usize, len: usize) -> Vec<u8> {
        (0..len).map(|byte| (index * 31 + byte) as u8).collect()
    }

    #[test]
    fn records_wrap_around_the_end_in_order() {
        let (mut writer, mut reader) = pair(MIN_CAPACITY);
        let mut out = Vec::new();
        // Lengths that do not divide the capacity, so records meet the end at every offset.
        for index in 0..5_000 {
            let len = (index * 37) % 300;
            writer.push(&record(index, len)).unwrap();
            assert!(reader.try_pop(&mut out).unwrap(), "record {index}");
            assert_eq!(out, record(index, len), "record {index}");
        }
        assert!(reader.head > 5 * MIN_CAPACITY as u64, "the ring wrapped several times");
        assert!(!reader.try_pop(&mut out).unwrap());
    }

    #[test]
    fn a_full_ring_refuses_until_the_reader_makes_room() {
        let (mut writer, mut reader) = pair(MIN_CAPACITY);
        let mut pushed = 0;
        let error = loop {
            match writer.push(&record(pushed, 100)) {
                Ok(()) => pushed += 1,
                Err(error) => break error,
            }
        };
        assert_eq!(pushed, MIN_CAPACITY / footprint(100));
        // 40 bytes are left before the end: the record would skip them and start over.
        assert!(matches!(error, RingError::Full { needed: 144, free: 40 }), "{error}");
        assert_eq!(
            writer.wait_for_room(100, Some(Duration::ZERO), None).unwrap(),
            Wakeup::TimedOut,
            "no room, and no wait asked for"
        );
        let mut out = Vec::new();
        assert!(reader.try_pop(&mut out).unwrap());
        assert_eq!(out, record(0, 100));
        assert_eq!(writer.wait_for_room(100, Some(Duration::ZERO), None).unwrap(), Wakeup::Ready);
        writer.push(&record(pushed, 100)).unwrap();
        for index in 1..=pushed {
            assert!(reader.try_pop(&mut out).unwrap());
            assert_eq!(out, record(index, 100), "nothing lost by the refusal");
        }
        let max = writer.max_record();
        assert_eq!(max, MIN_CAPACITY / 2 - LENGTH_WORD);
        assert!(
            matches!(writer.push(&vec![0; max + 1]), Err(RingError::TooLarge { len, max: m }) if len == max + 1 && m == max)
        );
        assert!(matches!(writer.wait_for_room(max + 1, None, None), Err(RingError::TooLarge { .. })));
        // The largest record fits an empty ring wherever the counters stand.
        for offset in [0, 8, 1000, MIN_CAPACITY / 2 - 8, MIN_CAPACITY / 2 + 8, MIN_CAPACITY - 8] {
            let (mut writer, mut reader) = pair(MIN_CAPACITY);
            if offset > 0 {
                writer.push(&vec![1; offset - LENGTH_WORD]).unwrap_or_else(|_| {
                    writer.push(&vec![1; offset / 2 - LENGTH_WORD]).unwrap();
                    writer.push(&vec![1; offset / 2 - LENGTH_WORD]).unwrap();
                });
                while reader.try_pop(&mut out).unwrap() {}
            }
            writer.push(&vec![7; max]).unwrap();
            assert!(reader.try_pop(&mut out).unwrap());
            assert_eq!(out, vec![7; max]);
        }
    }

    #[test]
    fn creation_and_opening_check_their_input() {
        for capacity in [0, 1, 4095, 6000, MAX_CAPACITY * 2] {
            assert!(matches!(RingWriter::create("bad", capacity), Err(Error::InvalidArgument(_))), "{capacity}");
        }
        // A file that is not a ring: wrong size, then wrong magic, then unsealed.
        let odd = SharedMemory::create("odd", HEADER_LEN + 5000).unwrap();
        let error = RingReader::open(odd.fd().try_clone_to_owned().unwrap()).unwrap_err();
        assert!(matches!(error, Error::Ring(RingError::Corrupt { what: "file size", .. })), "{error}");
        let blank = SharedMemory::create("blank", HEADER_LEN + MIN_CAPACITY).unwrap();
        let error = RingWriter::open(blank.fd().try_clone_to_owned().unwrap()).unwrap_err();
        assert!(matches!(error, Error::Ring(RingError::Corrupt { what: "magic", .. })), "{error}");
        let unsealed = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&unsealed, (HEADER_LEN + MIN_CAPACITY) as u64).unwrap();
        assert!(matches!(RingReader::open(unsealed), Err(Error::UnsealedSharedMemory)));
        // A read-only descriptor cannot carry the reader's tail.
        let writer = RingWriter::create("ro", MIN_CAPACITY).unwrap();
        let read_only = writer.shared.memory.read_only_fd().unwrap();
        assert!(matches!(RingReader::open(read_only), Err(Error::ReadOnlyMemory)));
        // The reader may create the ring, and records pushed before the other side opens it wait.
        let reader = RingReader::create("reader-made", MIN_CAPACITY).unwrap();
        let mut writer = RingWriter::open(reader.fd().try_clone_to_owned().unwrap()).unwrap();
        writer.push(b"first").unwrap();
        let mut later = RingReader::open(writer.fd().try_clone_to_owned().unwrap()).unwrap();
        let mut out = Vec::new();
        assert!(later.try_pop(&mut out).unwrap() && out == b"first");
        assert!(!later.try_pop(&mut out).unwrap());
        drop(reader);
    }

    #[test]
    fn waiting_ends_on_a_record_a_watched_descriptor_or_the_timeout() {
        let (mut writer, mut reader) = pair(MIN_CAPACITY);
        let (ours, theirs) = Connection::pair().unwrap();
        let mut out = Vec::new();
        let timed_out = reader.pop(&mut out, Some(Duration::from_millis(30)), Some(ours.as_fd())).unwrap();
        assert_eq!(timed_out, Wakeup::TimedOut);
        theirs.send(b"frame", &[]).unwrap();
        assert_eq!(reader.wait(None, Some(ours.as_fd())).unwrap(), Wakeup::Watched, "a frame on the socket");
        let mut buf = [0u8; 8];
        ours.recv(&mut buf).unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                writer.push(b"late").unwrap();
            });
            // Asleep on the futex (likely), woken by the push.
            assert_eq!(reader.pop(&mut out, None, Some(ours.as_fd())).unwrap(), Wakeup::Ready);
        });
        assert_eq!(out, b"late");
        writer.push(b"before the hang-up").unwrap();
        drop(theirs);
        assert_eq!(reader.pop(&mut out, None, Some(ours.as_fd())).unwrap(), Wakeup::Ready, "records come first");
        assert_eq!(out, b"before the hang-up");
        assert_eq!(reader.pop(&mut out, None, Some(ours.as_fd())).unwrap(), Wakeup::Watched, "then the hang-up");
        assert_eq!(ours.recv(&mut buf).unwrap().0, 0);
    }

    #[test]
    fn sleepers_are_woken_by_the_other_side_and_by_notices() {
        let (mut writer, mut reader) = pair(MIN_CAPACITY);
        while writer.push(&[1; 500]).is_ok() {}
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                reader.try_pop(&mut Vec::new()).unwrap();
            });
            assert_eq!(writer.push_waiting(&[2; 500], None, None).unwrap(), Wakeup::Ready);
        });
        let mut out = Vec::new();
        while reader.try_pop(&mut out).unwrap() {}
        assert_eq!(out, [2; 500]);
        // A notice wakes a sleeper with nothing to read and no descriptor to watch (without it,
        // these waits would time out after a minute).
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                writer.notify();
            });
            assert_eq!(reader.wait(Some(Duration::from_secs(60)), None).unwrap(), Wakeup::Watched);
        });
        assert!(!reader.try_pop(&mut out).unwrap(), "a notice is not a record");
        while writer.push(&[3; 500]).is_ok() {}
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                reader.notify();
            });
            assert_eq!(writer.wait_for_room(500, Some(Duration::from_secs(60)), None).unwrap(), Wakeup::Watched);
        });
        // A notice given while nobody waits is seen by the next wait.
        writer.notify();
        assert_eq!(reader.wait(Some(Duration::from_secs(60)), None).unwrap(), Wakeup::Ready, "records first");
        while reader.try_pop(&mut out).unwrap() {}
        assert_eq!(reader.wait(Some(Duration::ZERO), None).unwrap(), Wakeup::Watched, "then the notice");
        assert_eq!(reader.wait(Some(Duration::ZERO), None).unwrap(), Wakeup::TimedOut, "once");
    }

    #[test]
    fn a_doorbell_wakes_a_reader_polling_several_rings_and_sees_a_hang_up_at_once() {
        let bell = doorbell().unwrap();
        let (mut first_writer, mut first) = pair(MIN_CAPACITY);
        let (mut second_writer, mut second) = pair(MIN_CAPACITY);
        for (writer, reader) in [(&mut first_writer, &mut first), (&mut second_writer, &mut second)] {
            reader.set_doorbell(Some(bell.try_clone().unwrap())).unwrap();
            writer.set_doorbell(Some(bell.try_clone().unwrap())).unwrap();
        }
        let mut out = Vec::new();
        let (prepared, go) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let writer = &mut second_writer;
            scope.spawn(move || {
                go.recv().unwrap(); // pushed only once the reader said it sleeps
                writer.push(b"to the second").unwrap();
            });
            // One thread, two rings, one poll (as a receiver with two senders would).
            assert_eq!(first.prepare_to_sleep().unwrap(), None);
            assert_eq!(second.prepare_to_sleep().unwrap(), None);
            prepared.send(()).unwrap();
            let mut fds = [PollFd::new(&bell, PollFlags::IN)];
            poll(&mut fds, Some(&timespec(Duration::from_secs(60)))).unwrap();
            assert!(fds[0].revents().contains(PollFlags::IN), "the doorbell rang");
            rustix::io::read(&bell, &mut [0u8; 8]).unwrap();
            first.awake();
            second.awake();
            assert!(!first.try_pop(&mut out).unwrap());
            assert!(second.try_pop(&mut out).unwrap() && out == b"to the second");
        });
        // A ready ring says so instead of letting its reader sleep.
        first_writer.push(b"here").unwrap();
        assert_eq!(first.prepare_to_sleep().unwrap(), Some(Wakeup::Ready));
        // `wait` with a doorbell: woken by a push, then by the watched socket's hang-up (a
        // 60-second timeout would mean neither woke it).
        assert!(first.try_pop(&mut out).unwrap());
        let (ours, theirs) = Connection::pair().unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                first_writer.push(b"rung").unwrap();
                std::thread::sleep(Duration::from_millis(20));
                drop(theirs);
            });
            let patience = Some(Duration::from_secs(60));
            assert_eq!(first.pop(&mut out, patience, Some(ours.as_fd())).unwrap(), Wakeup::Ready);
            assert_eq!(out, b"rung");
            assert_eq!(first.pop(&mut out, patience, Some(ours.as_fd())).unwrap(), Wakeup::Watched);
        });
        // Back to the futex on both sides.
        first.set_doorbell(None).unwrap();
        first_writer.set_doorbell(None).unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                first_writer.push(b"futex").unwrap();
            });
            assert_eq!(first.pop(&mut out, Some(Duration::from_secs(60)), None).unwrap(), Wakeup::Ready);
        });
    }

    /// A reader's process could pass a full pipe as its doorbell: ringing it must not block.
    #[test]
    fn a_doorbell_that_is_a_full_pipe_does_not_block_the_writer() {
        let (read_end, write_end) = std::io::pipe().unwrap();
        let (mut writer, mut reader) = pair(MIN_CAPACITY);
        writer.set_doorbell(Some(write_end.into())).unwrap();
        let bell = writer.doorbell.as_ref().unwrap();
        while rustix::io::write(bell, &[0u8; 4096]).is_ok() {} // full (non-blocking now)
        assert_eq!(reader.prepare_to_sleep().unwrap(), None);
        writer.push(b"not blocked").unwrap();
        reader.awake();
        let mut out = Vec::new();
        assert!(reader.try_pop(&mut out).unwrap());
        drop(read_end);
    }

    /// Writes `bytes` at `offset` of the ring's file, as a hostile peer would.
    fn scribble(memory: &SharedMemory, offset: usize, bytes: &[u8]) {
        let end = (offset + bytes.len()).min(memory.len());
        memory.write(offset, &bytes[..end - offset]).unwrap();
    }

    #[test]
    fn each_lie_of_the_writer_is_a_typed_error() {
        type Lie = fn(&SharedMemory);
        let cases: [(&str, Lie); 7] = [
            ("head far ahead", |m| m.store_u64(HEAD_AT, 1 << 40).unwrap()),
            ("head unaligned", |m| m.store_u64(HEAD_AT, 12).unwrap()),
            ("length over the limit", |m| {
                m.store_u64(HEAD_AT, 64).unwrap();
                scribble(m, HEADER_LEN, &u32::MAX.wrapping_sub(1).to_le_bytes());
            }),
            ("length past head", |m| {
                m.store_u64(HEAD_AT, 16).unwrap();
                scribble(m, HEADER_LEN, &100u32.to_le_bytes());
            }),
            ("padding at the start", |m| {
                m.store_u64(HEAD_AT, 16).unwrap();
                scribble(m, HEADER_LEN, &PADDING.to_le_bytes());
            }),
            ("head moved backwards", |m| m.store_u64(HEAD_AT, 0).unwrap()),
            ("nothing", |_| {}),
        ];
        for (name, lie) in cases {
            let (mut writer, mut reader) = pair(MIN_CAPACITY);
            writer.push(b"honest").unwrap();
            let mut out = Vec::new();
            if name == "head moved backwards" {
                writer.push(b"second").unwrap();
                assert!(reader.try_pop(&mut out).unwrap() && reader.try_pop(&mut out).unwrap());
            }
            lie(&scribbler(&writer));
            let result = reader.try_pop(&mut out);
            match name {
                "nothing" => assert!(result.unwrap()),
                _ => {
                    assert!(matches!(result, Err(RingError::Corrupt { .. })), "{name}: {result:?}");
                    assert!(
                        matches!(reader.try_pop(&mut out), Err(RingError::Corrupt { .. })),
                        "{name}: the ring stays broken"
                    );
                    assert!(matches!(reader.wait(None, None), Err(RingError::Corrupt { .. })), "{name}: no sleep");
                }
            }
        }
        // A length that fits what was published but crosses the end of the data area: reading it
        // would run past the mapping.
        let (mut writer, mut reader) = pair(MIN_CAPACITY);
        let mut out = Vec::new();
        for _ in 0..(MIN_CAPACITY - 16) / 8 {
            writer.push(&[]).unwrap();
            assert!(reader.try_pop(&mut out).unwrap());
        }
        let memory = scribbler(&writer);
        scribble(&memory, HEADER_LEN + MIN_CAPACITY - 16, &100u32.to_le_bytes());
        memory.store_u64(HEAD_AT, (MIN_CAPACITY - 16 + 200) as u64).unwrap();
        let result = reader.try_pop(&mut out);
        assert!(
            matches!(result, Err(RingError::Corrupt { what: "record crossing the end of the data area", .. })),
            "{result:?}"
        );
        // A length over the limit that fits both the published bytes and the data area.
        let (writer, mut reader) = pair(MIN_CAPACITY);
        let memory = scribbler(&writer);
        scribble(&memory, HEADER_LEN, &((MIN_CAPACITY / 2 + 100) as u32).to_le_bytes());
        memory.store_u64(HEAD_AT, MIN_CAPACITY as u64).unwrap();
        let result = reader.try_pop(&mut out);
        assert!(matches!(result, Err(RingError::Corrupt { what: "record length over the limit", .. })), "{result:?}");

        // A padding mark in the middle with nothing after it.
        let (mut writer, mut reader) = pair(MIN_CAPACITY);
        writer.push(&[0; 100]).unwrap();
        let memory = scribbler(&writer);
        scribble(&memory, HEADER_LEN, &PADDING.to_le_bytes());
        memory.store_u64(HEAD_AT, 8).unwrap();
        let mut out = Vec::new();
        // Position 0 padding is refused first; move the reader's tail to test the other rule.
        reader.tail = 0;
        assert!(matches!(reader.try_pop(&mut out), Err(RingError::Corrupt { .. })));
    }

    #[test]
    fn each_lie_of_the_reader_is_a_typed_error() {
        // Far ahead, unaligned, ahead of what was published, behind what it said before.
        for (lie, after) in [(1u64 << 40, None), (12, None), (24, None), (8, Some(0u64))] {
            let (mut writer, _reader) = pair(MIN_CAPACITY);
            writer.push(&[0; 8]).unwrap(); // head 16
            let memory = scribbler(&writer);
            memory.store_u64(TAIL_AT, lie).unwrap();
            if let Some(after) = after {
                // The writer sees the tail move to 8 (honest so far), then back to 0.
                writer.refresh_tail().unwrap();
                memory.store_u64(TAIL_AT, after).unwrap();
            }
            // What a push does when the ring looks full to it.
            let result = writer.refresh_tail();
            assert!(matches!(result, Err(RingError::Corrupt { .. })), "tail {lie}: {result:?}");
            assert!(matches!(writer.push(b"x"), Err(RingError::Corrupt { .. })), "the ring stays broken");
            assert!(matches!(writer.wait_for_room(1, None, None), Err(RingError::Corrupt { .. })));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Any mix of pushes and pops of any lengths gives the records back whole and in order,
        /// and refuses only what does not fit.
        #[test]
        fn records_of_every_length_come_back_in_order(
            ops in proptest::collection::vec((any::<bool>(), 0usize..=MIN_CAPACITY / 2 - LENGTH_WORD), 1..400),
        ) {
            let (mut writer, mut reader) = pair(MIN_CAPACITY);
            let mut model = VecDeque::new();
            let mut out = Vec::new();
            for (index, (push, len)) in ops.into_iter().enumerate() {
                if push {
                    let bytes = record(index, len);
                    match writer.push(&bytes) {
                        Ok(()) => model.push_back(bytes),
                        Err(RingError::Full { needed, free }) => prop_assert!(needed > free && !model.is_empty()),
                        Err(other) => prop_assert!(false, "{other}"),
                    }
                } else {
                    let popped = reader.try_pop(&mut out).unwrap();
                    prop_assert_eq!(popped, !model.is_empty());
                    if popped {
                        prop_assert_eq!(&out, &model.pop_front().unwrap());
                    }
                }
            }
            while let Some(expected) = model.pop_front() {
                prop_assert!(reader.try_pop(&mut out).unwrap());
                prop_assert_eq!(&out, &expected);
            }
            prop_assert!(!reader.try_pop(&mut out).unwrap());
        }

        /// Random bytes anywhere in the file, between honest pushes and pops: every call returns
        /// a record no longer than the limit, nothing, or a typed error; none panics or hangs.
        #[test]
        fn random_bytes_in_the_shared_memory_give_typed_errors(
            scribbles in proptest::collection::vec(
                (0usize..HEADER_LEN + MIN_CAPACITY, proptest::collection::vec(any::<u8>(), 1..16), 0usize..8),
                1..40,
            ),
            aim_at_words in any::<bool>(),
        ) {
            let (mut writer, mut reader) = pair(MIN_CAPACITY);
            let memory = scribbler(&writer);
            let mut out = Vec::new();
            for (index, (offset, bytes, pushes)) in scribbles.into_iter().enumerate() {
                for push in 0..pushes {
                    let _ = writer.push(&record(index + push, (index * 13 + push * 7) % 200));
                }
                // Half the runs aim at the counters and flags, where the damage is likeliest.
                let offset = if aim_at_words { [HEAD_AT, TAIL_AT, READER_SLEEPS_AT, WRITER_SLEEPS_AT, HEADER_LEN][index % 5] + offset % 8 } else { offset };
                scribble(&memory, offset, &bytes);
                for _ in 0..3 {
                    match reader.try_pop(&mut out) {
                        Ok(_) => prop_assert!(out.len() <= reader.shared.max_record()),
                        Err(RingError::Corrupt { .. }) => {}
                        Err(other) => prop_assert!(false, "{other}"),
                    }
                }
                let waited = reader.wait(Some(Duration::from_millis(1)), None);
                prop_assert!(matches!(waited, Ok(_) | Err(RingError::Corrupt { .. })), "{waited:?}");
                let room = writer.wait_for_room(100, Some(Duration::from_millis(1)), None);
                prop_assert!(matches!(room, Ok(_) | Err(RingError::Corrupt { .. })), "{room:?}");
            }
        }
    }
}
