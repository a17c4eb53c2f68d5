//! TCP links between hosts whose peers prove, by challenge-response, that they hold one shared
//! [`Secret`], and then exchange length-prefixed messages.
//!
//! This is the control link for channels across hosts (design decision 10): tensors themselves
//! travel through NCCL, bootstrapped over this link.
//!
//! # What is and is not protected
//! - **Protected: who you talk to.** [`TcpListener::accept`] and [`TcpLink::connect`] return a
//!   link only once the other side has proven that it holds the secret, and each side proves it
//!   to the other (mutual). The secret never crosses the wire; only HMAC-SHA256 answers to fresh
//!   random challenges do, compared in constant time.
//! - **Protected: replay.** Each side's challenge is 32 fresh random bytes, so a recorded
//!   handshake answers an old challenge and is refused.
//! - **Not protected: secrecy and integrity of the traffic.** There is no encryption and no
//!   per-message authentication. Anyone on the network path can read every message, and one who
//!   can inject or rewrite packets can take over an authenticated connection. Use this on a
//!   trusted network (a cluster's private fabric), or run it inside a VPN or an SSH tunnel.
//! - The secret's strength is yours to choose: use at least 16 random bytes (`TQ_SECRET`, for
//!   example `openssl rand -hex 32`). A guessable secret can be found offline from one recorded
//!   handshake.
//!
//! # The handshake (`tq-auth-v1`)
//! Both sides send a greeting `"tq-auth-v1" || role || nonce` (role `C` for the connecting side,
//! `S` for the listener; nonce 32 random bytes). The client then sends
//! `HMAC-SHA256(secret, "tq-auth-v1" || "C" || client nonce || server nonce)`. The listener checks
//! it and only then answers with its own `HMAC-SHA256(secret, "tq-auth-v1" || "S" || server nonce
//! || client nonce)`, which the client checks. So a listener gives an unauthenticated connector
//! nothing computed from the secret; the role byte keeps one side's answer from being reflected
//! as the other's. A listener that sheds the handshake under load ([`HandshakeAbort`]) sends,
//! in place of its answer, the 32 bytes `tq-auth-v1 shed: try again later`, which prove nothing
//! and only make the client try again ([`TcpLink::connect`]).
//!
//! # Framing
//! After the handshake each message is a `u32` little-endian length and that many bytes, at most
//! [`MAX_MESSAGE`]. `TCP_NODELAY` is set. A receiving link's buffer grows with the bytes that
//! arrive (at most twice what came, plus 64 KiB), never with the length a header claims.
//!
//! A **bulk run** ([`Bulk`], [`TcpLink::try_send_bulk`]) carries large bytes without a copy on
//! either side: the length `0xffff_ffff` (no message is that long), a `u64` little-endian length,
//! and that many raw bytes. The sender writes them straight from the memory they lie in (one
//! vectored write of many pieces); the receiver learns the length first
//! ([`TcpLink::bulk_left`]) and reads the bytes straight into memory of its choosing
//! ([`TcpLink::try_recv_bulk`]). Only the few bytes that came with the previous read are
//! copied from the link's buffer.
//!
//! # Refused connections
//! [`TcpListener::accept`] takes one connection and returns its outcome: a link, or the typed
//! error for that connection alone ([`Error::AuthFailed`], [`Error::HandshakeTimeout`]), which it
//! also logs. The failed connection is closed; the listener is unharmed and the caller calls
//! `accept` again. (Looping inside `accept` would hide refusals from a caller that wants to count
//! or rate-limit them, and would give `timeout` two meanings.) Handshakes run one at a time, so a
//! connector that says nothing delays the next one by up to the handshake timeout
//! ([`TcpListener::with_handshake_timeout`]). A server that must not be held up runs each on a
//! thread of its own ([`TcpListener::accept_unverified`], [`Unverified::verify`]) and bounds how
//! many run at once by dropping the oldest ([`Unverified::abort_handle`]).

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::SharedMemory;
use crate::deadline::{bounded, deadline};
use crate::seqpacket::wait_readable;
use crate::sync::CountedCondvar;
use crate::{Error, Result};

/// The largest message [`TcpLink::send`] sends and [`TcpLink::recv`] accepts: 16 MiB.
pub const MAX_MESSAGE: usize = 16 << 20;
/// The environment variable [`Secret::from_env`] reads.
pub const SECRET_ENV: &str = "TQ_SECRET";
/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// How long a listener gives a connection to complete the handshake, unless told otherwise.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`TcpLink::send`] waits for the peer to take a message, unless told otherwise.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// The length word that starts a bulk run (see the module docs).
const BULK_MARK: u32 = u32::MAX;
/// A bulk run's header: the mark and a `u64` length.
const BULK_HEADER: usize = 12;
/// The most pieces one vectored write is given (Linux's `IOV_MAX` is 1,024).
const MAX_IOVECS: usize = 512;

const TAG: &[u8; 10] = b"tq-auth-v1";
const NONCE_LEN: usize = 32;
const HELLO_LEN: usize = TAG.len() + 1 + NONCE_LEN;
const PROOF_LEN: usize = 32;
/// The role byte of a listener's greeting that turns the connector away instead of challenging
/// it (the reason's code follows in the nonce's place): no secret is used, so it proves nothing,
/// but it tells an honest connector why, where a bare hang-up would look like a wrong secret.
const TURNED_AWAY: u8 = b'X';

/// Why a listener turned a connector away before the handshake ([`Unverified::turn_away`],
/// [`Error::TurnedAway`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TurnAway {
    /// The listening process has no descriptor free for another connection.
    #[error(
        "the receiver has used up its descriptors (open files): it cannot take a new connection now; \
         raise its limit (`ulimit -n`) or close descriptors"
    )]
    OutOfDescriptors,
    /// A code this version does not know (a newer listener).
    #[error("the listener turned this connection away (reason code {0})")]
    Other(u8),
}

impl TurnAway {
    fn code(self) -> u8 {
        match self {
            TurnAway::OutOfDescriptors => 1,
            TurnAway::Other(code) => code,
        }
    }

    fn from_code(code: u8) -> TurnAway {
        match code {
            1 => TurnAway::OutOfDescriptors,
            other => TurnAway::Other(other),
        }
    }
}

/// A shared secret of at least [`MIN_SECRET_LEN`] bytes. Its `Debug` shows only its length, and
/// its bytes are overwritten with zeros when it drops (`zeroize`: stores the compiler keeps).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    bytes: Zeroizing<Vec<u8>>,
}

impl Secret {
    /// A secret from bytes; [`Error::InvalidArgument`] if shorter than [`MIN_SECRET_LEN`].
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Secret> {
        let secret = Secret { bytes: Zeroizing::new(bytes.into()) };
        if secret.bytes.len() < MIN_SECRET_LEN {
            return Err(Error::InvalidArgument(format!(
                "a secret needs at least {MIN_SECRET_LEN} bytes; this one has {}",
                secret.bytes.len()
            )));
        }
        Ok(secret)
    }

    /// The secret in `TQ_SECRET` ([`SECRET_ENV`]), its bytes taken as they are.
    pub fn from_env() -> Result<Secret> {
        use std::os::unix::ffi::OsStringExt;
        let value = std::env::var_os(SECRET_ENV).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{SECRET_ENV} is not set: give every process the same secret, for example `openssl rand -hex 32`"
            ))
        })?;
        Secret::from_bytes(value.into_vec()).map_err(|_| {
            Error::InvalidArgument(format!("{SECRET_ENV} holds fewer than {MIN_SECRET_LEN} bytes; use a longer secret"))
        })
    }

    /// HMAC-SHA256 of `role || own nonce || peer nonce` under this secret, tagged with the
    /// protocol version.
    fn answer(&self, role: u8, own: &[u8; NONCE_LEN], peer: &[u8; NONCE_LEN]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.bytes).expect("HMAC takes keys of any length");
        mac.update(TAG);
        mac.update(&[role]);
        mac.update(own);
        mac.update(peer);
        mac
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret").field("len", &self.bytes.len()).finish_non_exhaustive()
    }
}

/// Memory that holds a [`SharedMemory`] mapping (a tensor's storage, say): what a bulk run's
/// pieces are read from, held by the run until it is written.
pub trait SharedBytes: Send + Sync {
    /// The mapping (`None`: this is not host memory, and a run refuses it).
    fn shared_memory(&self) -> Option<&SharedMemory>;
}

impl SharedBytes for SharedMemory {
    fn shared_memory(&self) -> Option<&SharedMemory> {
        Some(self)
    }
}

/// One piece of a [`Bulk`] run.
pub enum Piece {
    /// `len` bytes at `offset` of a mapping, written straight from it.
    Shared {
        /// Held until the run is written.
        memory: Arc<dyn SharedBytes>,
        /// The first byte in the mapping.
        offset: usize,
        /// How many bytes.
        len: usize,
    },
    /// Bytes the run owns (copied from elsewhere, a GPU say).
    Owned(Vec<u8>),
    /// Zeros (padding), at most [`MAX_ZEROS`].
    Zeros(usize),
}

/// The longest [`Piece::Zeros`].
pub const MAX_ZEROS: usize = 4096;
static ZEROS: [u8; MAX_ZEROS] = [0; MAX_ZEROS];

impl Piece {
    fn len(&self) -> usize {
        match self {
            Piece::Shared { len, .. } => *len,
            Piece::Owned(bytes) => bytes.len(),
            Piece::Zeros(n) => *n,
        }
    }

    /// The piece's bytes from `within` on (ranges checked by [`Bulk::new`]).
    fn bytes(&self, within: usize) -> std::io::Result<&[u8]> {
        match self {
            Piece::Shared { memory, offset, len } => {
                let memory =
                    memory.shared_memory().ok_or_else(|| std::io::Error::other("a bulk piece is not host memory"))?;
                if offset.checked_add(*len).is_none_or(|end| end > memory.len()) {
                    return Err(std::io::Error::other("a bulk piece reaches outside its memory"));
                }
                // SAFETY: the range lies in the live mapping (checked above), which `memory`
                // keeps mapped while this borrow lives; the slice is only handed to the kernel
                // to read. Another process writing the memory meanwhile gives torn bytes, as
                // `SharedMemory::read` does.
                Ok(unsafe { std::slice::from_raw_parts(memory.as_ptr().add(offset + within), len - within) })
            }
            Piece::Owned(bytes) => Ok(&bytes[within..]),
            Piece::Zeros(n) => Ok(&ZEROS[within..*n]),
        }
    }
}

/// Bytes a [`TcpLink`] writes as one bulk run straight from the memory they lie in (see the
/// module docs), in pieces held until the last byte is in the socket (or the link breaks);
/// then they are dropped.
pub struct Bulk {
    /// The run's pieces, then the messages that follow it ([`Bulk::followed_by`]).
    pieces: Vec<Piece>,
    /// The run's bytes (what its header says).
    len: u64,
    /// The bytes after the header: the run's, then the messages'.
    total: u64,
    header: [u8; BULK_HEADER],
    /// Bytes of header and pieces written so far.
    written: u64,
    /// The piece the next byte comes from, and how far into it.
    next: (usize, usize),
    /// Whatever else must live until the run is written (a lease, say).
    _keep: Box<dyn Send>,
}

impl Bulk {
    /// A run of `pieces`, in order, keeping `keep` until it is written.
    /// [`Error::InvalidArgument`] for a piece outside its memory, or zeros over [`MAX_ZEROS`].
    pub fn new(pieces: Vec<Piece>, keep: Box<dyn Send>) -> Result<Bulk> {
        for piece in &pieces {
            let fits = match piece {
                Piece::Shared { memory, offset, len } => memory
                    .shared_memory()
                    .is_some_and(|memory| offset.checked_add(*len).is_some_and(|end| end <= memory.len())),
                Piece::Owned(_) => true,
                Piece::Zeros(n) => *n <= MAX_ZEROS,
            };
            if !fits {
                return Err(Error::InvalidArgument("a bulk piece outside its memory, or too many zeros".into()));
            }
        }
        let len = pieces.iter().map(|piece| piece.len() as u64).sum::<u64>();
        let mut header = [0u8; BULK_HEADER];
        header[..4].copy_from_slice(&BULK_MARK.to_le_bytes());
        header[4..].copy_from_slice(&len.to_le_bytes());
        Ok(Bulk { pieces, len, total: len, header, written: 0, next: (0, 0), _keep: keep })
    }

    /// Has `message` follow the run in the same vectored write, framed as [`TcpLink::send`]
    /// frames it: a message that describes the run (or needs it there first) then reaches the
    /// peer with it, in one segment where it fits, instead of a second write that costs the peer
    /// a second wake-up. [`Error::MessageTooLarge`] over [`MAX_MESSAGE`].
    pub fn followed_by(mut self, message: &[u8]) -> Result<Bulk> {
        if message.len() > MAX_MESSAGE {
            return Err(Error::MessageTooLarge { len: message.len() as u64, max: MAX_MESSAGE });
        }
        let mut framed = Vec::with_capacity(4 + message.len());
        framed.extend_from_slice(&(message.len() as u32).to_le_bytes());
        framed.extend_from_slice(message);
        self.total += framed.len() as u64;
        self.pieces.push(Piece::Owned(framed));
        Ok(self)
    }

    /// The bytes of the run (without its header).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the run has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn done(&self) -> bool {
        self.written == BULK_HEADER as u64 + self.total
    }

    /// Writes what the socket takes now (one vectored write of at most [`MAX_IOVECS`] pieces):
    /// the bytes written; `WouldBlock` when none were.
    fn write_to(&mut self, mut stream: &TcpStream) -> std::io::Result<usize> {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(MAX_IOVECS.min(self.pieces.len() + 1));
        let header_done = (self.written as usize).min(BULK_HEADER);
        if header_done < BULK_HEADER {
            slices.push(IoSlice::new(&self.header[header_done..]));
        }
        let (mut piece, mut within) = self.next;
        while slices.len() < MAX_IOVECS && piece < self.pieces.len() {
            if self.pieces[piece].len() > within {
                slices.push(IoSlice::new(self.pieces[piece].bytes(within)?));
            }
            piece += 1;
            within = 0;
        }
        if slices.is_empty() {
            return Ok(0);
        }
        let n = stream.write_vectored(&slices)?;
        drop(slices);
        self.advance(n);
        Ok(n)
    }

    /// Moves past `n` written bytes.
    fn advance(&mut self, mut n: usize) {
        let before = self.written;
        self.written += n as u64;
        n -= (BULK_HEADER as u64).saturating_sub(before).min(n as u64) as usize;
        while n > 0 {
            let (piece, within) = self.next;
            let left = self.pieces[piece].len() - within;
            if n < left {
                self.next = (piece, within + n);
                return;
            }
            n -= left;
            self.next = (piece + 1, 0);
        }
    }
}

impl std::fmt::Debug for Bulk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bulk").field("len", &self.len).field("written", &self.written).finish_non_exhaustive()
    }
}

/// A listening TCP socket that hands out authenticated [`TcpLink`]s.
#[derive(Debug)]
pub struct TcpListener {
    inner: std::net::TcpListener,
    handshake_timeout: Duration,
}

impl TcpListener {
    /// Listens at `addr` (port 0: one the system picks; see [`TcpListener::local_addr`]).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<TcpListener> {
        let inner = std::net::TcpListener::bind(addr).map_err(|e| Error::os("binding a TCP listener", e))?;
        // Non-blocking, so a connection that vanishes between `poll` and `accept` cannot block it.
        inner.set_nonblocking(true).map_err(|e| Error::os("O_NONBLOCK on a TCP listener", e))?;
        Ok(TcpListener { inner, handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT })
    }

    /// How long each connection gets to complete the handshake ([`DEFAULT_HANDSHAKE_TIMEOUT`]
    /// unless set here).
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> TcpListener {
        self.handshake_timeout = timeout;
        self
    }

    /// The address this listener is bound to.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner.local_addr().map_err(|e| Error::os("getsockname", e))
    }

    /// Waits up to `timeout` (forever with `None`) for the next connection, then runs the
    /// handshake with it, for at most the handshake timeout.
    ///
    /// A connection that fails the handshake is closed and logged, and its error returned
    /// ([`Error::AuthFailed`], [`Error::HandshakeTimeout`]); the listener is unharmed: call
    /// `accept` again. No connection within `timeout` is an [`Error::Os`] of kind
    /// [`ErrorKind::TimedOut`].
    pub fn accept(&self, timeout: Option<Duration>, secret: &Secret) -> Result<TcpLink> {
        self.accept_unverified(timeout)?.verify(secret)
    }

    /// Takes the next connection without authenticating it, for a caller that runs each
    /// handshake on a thread of its own ([`Unverified::verify`]), so that a silent connector
    /// delays nobody else.
    pub fn accept_unverified(&self, timeout: Option<Duration>) -> Result<Unverified> {
        let deadline = timeout.map(deadline);
        let (stream, peer) = loop {
            match self.inner.accept() {
                Ok(accepted) => break accepted,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let wait = match remaining(deadline) {
                        Ok(wait) => wait.unwrap_or(Duration::from_secs(3600)),
                        Err(_) => {
                            return Err(Error::os(
                                "accept",
                                std::io::Error::new(ErrorKind::TimedOut, "no peer connected in time"),
                            ));
                        }
                    };
                    wait_readable(self.inner.as_fd(), wait)?;
                }
                // A connector that gave up before we took it, or a signal: take the next one.
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionAborted | ErrorKind::Interrupted) => {}
                Err(e) => return Err(Error::os("accept", e)),
            }
        };
        // Linux does not pass O_NONBLOCK on to accepted sockets; say so anyway.
        stream.set_nonblocking(false).map_err(|e| Error::os("clearing O_NONBLOCK", e))?;
        let progress = Arc::default();
        Ok(Unverified { stream, peer, timeout: self.handshake_timeout, started: Instant::now(), progress })
    }
}

/// A connection taken by [`TcpListener::accept_unverified`] whose peer has not proven anything
/// yet: nothing can be read from or sent to it but the handshake.
#[derive(Debug)]
pub struct Unverified {
    stream: TcpStream,
    peer: SocketAddr,
    timeout: Duration,
    started: Instant,
    progress: Arc<Progress>,
}

/// How far a listener's handshake got, for [`HandshakeAbort`].
#[derive(Debug, Default)]
struct Progress {
    /// [`RUNNING`], [`SHED_STAGE`] or [`ANSWERED`]: whichever of the abort and the listener's answer
    /// comes first wins, so that a handshake is never shed after the connector was told it is in.
    stage: AtomicU8,
    /// The connector's greeting was read ([`HandshakeAbort::heard_from`]).
    heard: AtomicBool,
}

/// [`Progress::stage`] values (`SHED_STAGE`: shed).
const RUNNING: u8 = 0;
const SHED_STAGE: u8 = 1;
const ANSWERED: u8 = 2;

impl Progress {
    fn shed(&self) -> bool {
        self.stage.load(Ordering::Acquire) == SHED_STAGE
    }
}

impl Unverified {
    /// The address at the other end (as it claims).
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// A handle that ends this handshake from another thread: [`Unverified::verify`] then
    /// fails at once with [`Error::HandshakeShed`].
    pub fn abort_handle(&self) -> Result<HandshakeAbort> {
        let stream = self.stream.try_clone().map_err(|e| Error::os("duplicating a TCP socket", e))?;
        Ok(HandshakeAbort { stream, peer: self.peer, started: self.started, progress: self.progress.clone() })
    }

    /// Tells the connector why it is not taken (a greeting that says so in place of the
    /// challenge, written without waiting) and closes the connection.
    pub fn turn_away(self, why: TurnAway) {
        let mut greeting = [0u8; HELLO_LEN];
        greeting[..TAG.len()].copy_from_slice(TAG);
        greeting[TAG.len()] = TURNED_AWAY;
        greeting[TAG.len() + 1] = why.code();
        let _ = self.stream.set_nonblocking(true);
        let _ = (&self.stream).write(&greeting);
    }

    /// Runs the listener's side of the handshake, bounded by the listener's handshake timeout:
    /// the link, or the typed error for this connection (logged, and the connection closed).
    pub fn verify(self, secret: &Secret) -> Result<TcpLink> {
        let Unverified { stream, peer, timeout, started, progress } = self;
        handshake(stream, peer, Side::Listener, secret, started + bounded(timeout), timeout, Some(&progress))
            .map_err(|error| match progress.shed() {
                true => Error::HandshakeShed { peer, waited: started.elapsed(), why: SHED },
                false => error,
            })
            .inspect_err(|error| {
                tracing::warn!(%peer, %error, "refused a TCP connection");
            })
    }
}

const SHED: &str = "more handshakes were under way than the listener allows, and this one was shed (one that said nothing yet, else the oldest)";

/// How many times [`TcpLink::connect`] runs the handshake with a listener that cuts it short.
pub const HANDSHAKE_ATTEMPTS: u32 = 6;

/// What a connector reads when the listener hangs up during the greeting (no secret used yet).
const HUNG_UP_IN_GREETING: &str = "it hung up during the greeting, before any secret was used (a listener \
                                   shedding handshakes under load, a connector that gave up, or another protocol)";
/// What a connector reads when the listener hangs up instead of answering its proof.
const NO_ANSWER: &str = "the listener hung up instead of answering: it refused our answer (do both sides hold the \
                         same TQ_SECRET?)";

/// What a listener sends in place of its answer when it sheds a handshake under load: no HMAC
/// answer is these bytes but by a 2^-256 chance, and it proves nothing (anyone can send it), so
/// all it does is have the connector try again.
const SHED_ANSWER: &[u8; PROOF_LEN] = b"tq-auth-v1 shed: try again later";
/// A connector's [`Error::HandshakeShed`].
const SHED_BY_LISTENER: &str = "the listener had more handshakes under way than it allows, and shed this one";

/// Whether a connector's handshake was cut short by a listener under load (see
/// [`TcpLink::connect`]): shed, or a hang-up in the greeting, before any secret was used. A
/// hang-up after our answer is not: a wrong secret reads so.
fn cut_short(error: &Error) -> bool {
    matches!(error, Error::HandshakeShed { .. })
        || matches!(error, Error::AuthFailed { why, .. } if *why == HUNG_UP_IN_GREETING)
}

/// The pause before handshake attempt `attempt + 1`: random, so that a burst of connectors
/// shed together does not come back together, and growing (1-4 ms, then 2-8, 4-16, ...).
fn retry_pause(attempt: u32) -> Duration {
    let mut random = [0u8; 2];
    let _ = getrandom::fill(&mut random);
    let base = 1_000u64 << attempt.min(10);
    Duration::from_micros(base + u64::from(u16::from_le_bytes(random)) % (3 * base))
}

/// Ends an [`Unverified`] handshake from another thread (see [`Unverified::abort_handle`]).
#[derive(Debug)]
pub struct HandshakeAbort {
    stream: TcpStream,
    peer: SocketAddr,
    started: Instant,
    progress: Arc<Progress>,
}

impl HandshakeAbort {
    /// The address at the other end.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// When the connection was accepted.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Whether the connector has said anything: its greeting was read, or bytes of it wait in
    /// the socket. An honest connector greets as soon as it is connected; one that said nothing
    /// is the one to shed first when handshakes must make room.
    pub fn heard_from(&self) -> bool {
        let mut byte = [0u8; 1];
        // A peek that does not wait: bytes waiting (or the end: it hung up, so it goes anyway).
        let waiting = matches!(
            rustix::net::recv(&self.stream, &mut byte, rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT),
            Ok((1, _))
        );
        // The peek first: the handshake stores `heard` before it reads the greeting, so bytes
        // gone by the peek were marked before they went. (The mark first left a window: not
        // marked yet, then marked and read before the peek.)
        waiting || self.progress.heard.load(Ordering::Acquire)
    }

    /// Ends the handshake: it fails with [`Error::HandshakeShed`], and a connector that already
    /// has the listener's greeting is told so (in place of the listener's answer: it tries
    /// again, see [`TcpLink::connect`]); one that has not sees a hang-up in the greeting. Only
    /// the reading direction is shut here, so that the handshake's thread can still say so.
    /// Nothing (`false`) once the listener has answered: the connector is in, and the link is
    /// its.
    pub fn abort(&self) -> bool {
        let stage = &self.progress.stage;
        if stage.compare_exchange(RUNNING, SHED_STAGE, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return false;
        }
        let _ = self.stream.shutdown(Shutdown::Read);
        true
    }
}

impl AsFd for TcpListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

/// An authenticated TCP connection carrying length-prefixed messages.
///
/// Every method takes `&self`: threads may share a link. A message is written whole or not at
/// all as far as callers can tell: [`TcpLink::try_send`] either takes it (and the link finishes
/// writing it, from a short-lived thread if the socket fills up halfway) or sends nothing, so
/// two threads' messages never interleave and a caller that must not block never does.
#[derive(Debug)]
pub struct TcpLink {
    shared: Arc<Shared>,
    peer: SocketAddr,
    send_timeout: Mutex<Option<Duration>>,
}

/// What the link and its flusher thread share.
#[derive(Debug)]
struct Shared {
    /// Non-blocking after the handshake.
    stream: TcpStream,
    inbox: Mutex<Inbox>,
    outbox: Mutex<Outbox>,
    /// Signalled when the outbox empties or breaks.
    drained: CountedCondvar,
}

/// Bytes read from the socket and not yet returned as messages.
#[derive(Debug, Default)]
struct Inbox {
    data: Vec<u8>,
    start: usize,
    /// A bulk run's bytes not read yet, once its header was taken: it comes before anything
    /// else in the stream.
    bulk_left: Option<u64>,
}

/// The `ioctl` that asks a TCP socket for its send queue's bytes not yet acknowledged
/// (`SIOCOUTQ`, the same number as `TIOCOUTQ`, which differs between architectures).
const SIOCOUTQ: rustix::ioctl::Opcode = linux_raw_sys::ioctl::TIOCOUTQ as rustix::ioctl::Opcode;

/// Bytes of messages already taken that the socket had no room for yet.
#[derive(Debug, Default)]
struct Outbox {
    pending: Vec<u8>,
    /// The rest of a bulk run begun (after `pending`, which is then empty).
    bulk: Option<Bulk>,
    /// Whether a flusher thread is writing `pending`.
    flushing: bool,
    /// Why writing failed for good: later sends fail with it.
    broken: Option<Broken>,
    /// Whether the writing direction closes once `pending` is out.
    close_after: bool,
}

#[derive(Clone, Copy, Debug)]
enum Broken {
    Gone,
}

impl TcpLink {
    /// Connects to a listener at `addr` and runs the handshake; `timeout` bounds both together.
    ///
    /// A listener under load (a burst of connectors) sheds handshakes ([`HandshakeAbort`]): one
    /// that says so, or hangs up during the greeting (before any secret is used), is tried
    /// again after a short random pause that grows, up to [`HANDSHAKE_ATTEMPTS`] times in all
    /// while `timeout` lasts; then the last attempt's error is returned
    /// ([`Error::HandshakeShed`], [`Error::AuthFailed`]). A listener that hangs up after our
    /// answer is not tried again: that is how a wrong secret reads.
    pub fn connect(addr: impl ToSocketAddrs, secret: &Secret, timeout: Duration) -> Result<TcpLink> {
        let deadline = deadline(timeout);
        let peers: Vec<SocketAddr> =
            addr.to_socket_addrs().map_err(|e| Error::os("resolving a TCP address", e))?.collect();
        let mut attempt = 1;
        loop {
            match TcpLink::connect_once(&peers, secret, deadline, timeout) {
                Err(error) if cut_short(&error) && attempt < HANDSHAKE_ATTEMPTS => {
                    let pause = retry_pause(attempt);
                    if remaining(Some(deadline)).ok().flatten().is_none_or(|left| left <= pause) {
                        return Err(error);
                    }
                    tracing::debug!(%error, attempt, "the listener cut the handshake short; trying again");
                    std::thread::sleep(pause);
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    /// One connection and handshake, to the first of `peers` that takes the connection.
    fn connect_once(peers: &[SocketAddr], secret: &Secret, deadline: Instant, timeout: Duration) -> Result<TcpLink> {
        let mut last_error = std::io::Error::new(ErrorKind::NotFound, "the address resolved to nothing");
        for &peer in peers {
            let Ok(Some(left)) = remaining(Some(deadline)) else {
                last_error = std::io::Error::new(ErrorKind::TimedOut, "no listener answered in time");
                break;
            };
            match TcpStream::connect_timeout(&peer, left) {
                Ok(stream) => return handshake(stream, peer, Side::Connector, secret, deadline, timeout, None),
                Err(e) => last_error = e,
            }
        }
        Err(Error::os("connecting over TCP", last_error))
    }

    /// The address of the other end.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The address of this end.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.shared.stream.local_addr().map_err(|e| Error::os("getsockname", e))
    }

    /// How long [`TcpLink::send`] waits for the peer to take a message (`None`: forever), and how
    /// long a message begun is given to finish; [`DEFAULT_SEND_TIMEOUT`] until set.
    pub fn set_send_timeout(&self, timeout: Option<Duration>) {
        *lock(&self.send_timeout) = timeout;
    }

    /// Sends one message of at most [`MAX_MESSAGE`] bytes ([`Error::MessageTooLarge`] beyond,
    /// with nothing sent), waiting until the socket took all of it. [`Error::PeerGone`] if the
    /// peer closed the connection.
    ///
    /// If the send timeout passes first, the stream may end inside a frame, so the link is shut
    /// down: this call fails with an [`Error::Os`] of kind [`ErrorKind::TimedOut`], and later
    /// calls with [`Error::PeerGone`].
    pub fn send(&self, bytes: &[u8]) -> Result<()> {
        let timeout = *lock(&self.send_timeout);
        let deadline = timeout.map(deadline);
        let timed_out = || {
            self.shutdown();
            Error::os(
                "sending over TCP",
                std::io::Error::new(
                    ErrorKind::TimedOut,
                    format!("the peer did not take the message within {timeout:?}; the link is closed"),
                ),
            )
        };
        while !self.try_send(bytes)? {
            let Ok(left) = remaining(deadline) else { return Err(timed_out()) };
            wait_for(self.shared.stream.as_fd(), PollFlags::OUT, left)?;
        }
        let mut outbox = lock(&self.shared.outbox);
        while outbox.busy() && outbox.broken.is_none() {
            let Ok(left) = remaining(deadline) else { return Err(timed_out()) };
            let left = left.unwrap_or(Duration::from_secs(3600));
            outbox = self.shared.drained.wait_timeout(outbox, left);
        }
        match outbox.broken {
            Some(Broken::Gone) => Err(Error::PeerGone),
            None => Ok(()),
        }
    }

    /// Takes one message if the socket has room to start it now, else `Ok(false)` with nothing
    /// sent. A message taken is written whole: what the socket cannot take yet is written by a
    /// short-lived thread of this link, in order, before any later message.
    pub fn try_send(&self, bytes: &[u8]) -> Result<bool> {
        if bytes.len() > MAX_MESSAGE {
            return Err(Error::MessageTooLarge { len: bytes.len() as u64, max: MAX_MESSAGE });
        }
        let mut outbox = lock(&self.shared.outbox);
        if let Some(broken) = outbox.broken {
            return Err(broken.into());
        }
        if !self.shared.ready(&mut outbox)? {
            return Ok(false);
        }
        let header = (bytes.len() as u32).to_le_bytes();
        let written = match (&self.shared.stream).write_vectored(&[IoSlice::new(&header), IoSlice::new(bytes)]) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => 0,
            Err(e) => return Err(self.shared.broke(&mut outbox, e)),
        };
        if written == 0 {
            return Ok(false);
        }
        if written < header.len() + bytes.len() {
            let rest = written.saturating_sub(header.len());
            outbox.pending.extend_from_slice(&header[written.min(header.len())..]);
            outbox.pending.extend_from_slice(&bytes[rest..]);
            self.start_flusher(&mut outbox)?;
        }
        Ok(true)
    }

    /// Takes a bulk run (see the module docs) if the socket has room to start it now, else
    /// gives it back with nothing sent. A run taken is written whole, straight from its memory,
    /// before any later message: what the socket cannot take yet is written by the link's
    /// flusher thread, which drops the run (and its owner) once the last byte is out, or once
    /// the link breaks.
    pub fn try_send_bulk(&self, mut bulk: Bulk) -> Result<std::result::Result<(), Bulk>> {
        let mut outbox = lock(&self.shared.outbox);
        if let Some(broken) = outbox.broken {
            return Err(broken.into());
        }
        if !self.shared.ready(&mut outbox)? {
            return Ok(Err(bulk));
        }
        match bulk.write_to(&self.shared.stream) {
            Ok(0) => return Ok(Err(bulk)),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => return Ok(Err(bulk)),
            Err(e) => return Err(self.shared.broke(&mut outbox, e)),
        }
        outbox.bulk = Some(bulk);
        self.shared.write_pending(&mut outbox)?;
        if outbox.busy() {
            self.start_flusher(&mut outbox)?;
        }
        Ok(Ok(()))
    }

    /// Starts the flusher thread for what is pending, unless one runs.
    fn start_flusher(&self, outbox: &mut Outbox) -> Result<()> {
        if !outbox.flushing {
            outbox.flushing = true;
            let shared = self.shared.clone();
            std::thread::Builder::new()
                .name("tq-tcp-flush".into())
                .spawn(move || shared.flush())
                .map_err(|e| Error::os("spawning a TCP flusher", e))?;
        }
        Ok(())
    }

    /// If a message taken earlier is still being written by the flusher thread (so
    /// [`TcpLink::try_send`] takes nothing), waits up to `timeout` for it to be out and returns
    /// true; false at once when none is.
    pub fn wait_sent(&self, timeout: Duration) -> bool {
        let outbox = lock(&self.shared.outbox);
        if !outbox.flushing {
            return false;
        }
        drop(self.shared.drained.wait_timeout_while(outbox, timeout, |o| o.flushing && o.broken.is_none()));
        true
    }

    /// Receives one message into `buf` (replacing its contents), waiting up to `timeout` (`None`:
    /// forever). [`Error::PeerGone`] once the peer closed the connection; an [`Error::Os`] of
    /// kind [`ErrorKind::TimedOut`] if no whole message came in time (a message begun stays
    /// buffered for the next call). A length over [`MAX_MESSAGE`] closes the link
    /// ([`Error::MessageTooLarge`]).
    pub fn recv(&self, buf: &mut Vec<u8>, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(deadline);
        loop {
            if self
                .try_recv_with(|message| {
                    buf.clear();
                    buf.extend_from_slice(message);
                })?
                .is_some()
            {
                return Ok(());
            }
            let Ok(left) = remaining(deadline) else {
                return Err(Error::os(
                    "receiving over TCP",
                    std::io::Error::new(ErrorKind::TimedOut, format!("no whole message within {timeout:?}")),
                ));
            };
            wait_for(self.shared.stream.as_fd(), PollFlags::IN, left)?;
        }
    }

    /// Hands the next whole message to `take` if one has arrived, without waiting: `Ok(None)`
    /// when none is whole yet. [`Error::PeerGone`] once the peer closed the connection;
    /// [`Error::BulkAhead`] when a bulk run is next (read it with [`TcpLink::try_recv_bulk`]).
    pub fn try_recv_with<R>(&self, take: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        let mut inbox = lock(&self.shared.inbox);
        loop {
            if let Some(left) = inbox.take_bulk_header() {
                return Err(Error::BulkAhead { left });
            }
            let whole = inbox.whole().inspect_err(|_| {
                // A lying length: the stream cannot be trusted past it.
                self.shutdown();
                *inbox = Inbox::default();
            })?;
            if let Some(len) = whole {
                let at = inbox.start + 4;
                let value = take(&inbox.data[at..at + len]);
                inbox.start = at + len;
                return Ok(Some(value));
            }
            if inbox.start > 0 {
                let start = inbox.start;
                inbox.data.drain(..start);
                inbox.start = 0;
            }
            let filled = inbox.data.len();
            // Grown by what arrived, never by what a header claims: a record that says 16 MiB
            // and sends one byte costs one read's worth. Doubling keeps large records cheap.
            let want = READ_SIZE.max(inbox.needed().min(filled));
            inbox.data.resize(filled + want, 0);
            let read = (&self.shared.stream).read(&mut inbox.data[filled..]);
            inbox.data.truncate(filled + *read.as_ref().unwrap_or(&0));
            match read {
                Ok(0) => return Err(Error::PeerGone),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                    return Err(Error::PeerGone);
                }
                Err(e) => return Err(Error::os("receiving over TCP", e)),
            }
        }
    }

    /// Whether a whole message was already read from the socket and waits here, where `poll`
    /// on the socket cannot see it.
    /// A length over the limit counts too: the next read reports it. So do a bulk run's header
    /// and any of its bytes read with it.
    pub fn has_buffered(&self) -> bool {
        let inbox = lock(&self.shared.inbox);
        match inbox.bulk_left {
            Some(left) => left == 0 || inbox.data.len() > inbox.start,
            None => !matches!(inbox.whole(), Ok(None)) || inbox.bulk_header_here(),
        }
    }

    /// Bytes sent that the peer's machine has not acknowledged yet: those this link still writes
    /// (its flusher, a bulk run) and the kernel's send queue (`SIOCOUTQ`). They are not safe
    /// until then: a process that dies with bytes unread in its socket resets the connection,
    /// and the kernel throws its send queue away (the peer never sees those bytes); bytes the
    /// peer's kernel acknowledged stay readable there. 0 once the link broke (nothing more will
    /// be acknowledged).
    pub fn unacknowledged(&self) -> usize {
        let outbox = lock(&self.shared.outbox);
        if outbox.broken.is_some() {
            return 0;
        }
        let queued = outbox.pending.len() + outbox.bulk.as_ref().map_or(0, |_| 1);
        drop(outbox);
        // SAFETY: SIOCOUTQ (TIOCOUTQ) on a TCP socket writes one `c_int`, the bytes of its send
        // queue not yet acknowledged, into the getter's output; the socket is ours and open.
        let unsent = unsafe {
            rustix::ioctl::ioctl(
                &self.shared.stream,
                rustix::ioctl::Getter::<SIOCOUTQ, rustix::ioctl::IoctlOutput>::new(),
            )
        };
        // A socket the kernel no longer reports on is a broken one: nothing will be acknowledged.
        queued + unsent.map_or(0, |n| usize::try_from(n).unwrap_or(0))
    }

    /// How many bytes were read of a message not yet whole (a message arrives in pieces): what
    /// is lost if the peer dies now. 0 while a whole message waits at the front (the next read
    /// takes it). Of a bulk run, the bytes read with its header and not yet taken.
    pub fn partial(&self) -> usize {
        let inbox = lock(&self.shared.inbox);
        match inbox.whole() {
            Ok(None) => inbox.data.len() - inbox.start,
            _ => 0,
        }
    }

    /// The bytes not yet read of the bulk run next in the stream, once its header has been
    /// read (a call here or to [`TcpLink::try_recv_with`] reads it); `None` when the next thing
    /// is a message, or nothing has come.
    pub fn bulk_left(&self) -> Option<u64> {
        let mut inbox = lock(&self.shared.inbox);
        inbox.bulk_left.or_else(|| inbox.take_bulk_header())
    }

    /// As [`TcpLink::try_recv_bulk`], into `len` bytes at `offset` of `memory` (mapped
    /// writable): straight from the socket into the mapping.
    pub fn try_recv_bulk_into(&self, memory: &SharedMemory, offset: usize, len: usize) -> Result<usize> {
        if !memory.is_writable() {
            return Err(Error::ReadOnlyMemory);
        }
        crate::error::check_range(offset, len, memory.len())?;
        if len == 0 {
            return self.try_recv_bulk(&mut []);
        }
        // SAFETY: the range lies in the live, writable mapping (checked above), which `memory`
        // keeps mapped while the slice lives; the slice lives for this call only and is written
        // by the kernel's reads and the copy of bytes read ahead. Other access to the range
        // meanwhile gives torn bytes, as `SharedMemory::write` does.
        let dest = unsafe { std::slice::from_raw_parts_mut(memory.as_ptr().add(offset), len) };
        self.try_recv_bulk(dest)
    }

    /// Reads bytes of the bulk run next in the stream into `dest`, without waiting: the bytes
    /// read (at most `dest.len()`, at most what is left of the run; 0 when none has come). They
    /// go straight from the socket into `dest`, except those read ahead with the run's header.
    /// [`Error::PeerGone`] if the peer closed the connection; [`Error::InvalidArgument`] when no
    /// run is next ([`TcpLink::bulk_left`]).
    pub fn try_recv_bulk(&self, dest: &mut [u8]) -> Result<usize> {
        let mut inbox = lock(&self.shared.inbox);
        let Some(left) = inbox.bulk_left.or_else(|| inbox.take_bulk_header()) else {
            return Err(Error::InvalidArgument("no bulk run is next in the stream".into()));
        };
        let want = dest.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let buffered = (inbox.data.len() - inbox.start).min(want);
        let start = inbox.start;
        dest[..buffered].copy_from_slice(&inbox.data[start..start + buffered]);
        inbox.start += buffered;
        if inbox.start == inbox.data.len() {
            inbox.data.clear();
            inbox.start = 0;
        }
        let mut got = buffered;
        let mut outcome = Ok(());
        while got < want {
            match (&self.shared.stream).read(&mut dest[got..want]) {
                Ok(0) => {
                    outcome = Err(Error::PeerGone);
                    break;
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                    outcome = Err(Error::PeerGone);
                    break;
                }
                Err(e) => {
                    outcome = Err(Error::os("receiving over TCP", e));
                    break;
                }
            }
        }
        let left = left - got as u64;
        inbox.bulk_left = (left > 0).then_some(left);
        outcome.map(|()| got)
    }

    /// Closes both directions: the peer reads the end, and calls here fail.
    pub fn shutdown(&self) {
        let _ = self.shared.stream.shutdown(Shutdown::Both);
    }

    /// Closes the writing direction only: the peer reads the end of what was sent once any
    /// message still being written is out.
    pub fn shutdown_write(&self) {
        let mut outbox = lock(&self.shared.outbox);
        if !outbox.busy() {
            let _ = self.shared.stream.shutdown(Shutdown::Write);
        } else {
            outbox.close_after = true; // the flusher closes it once the rest is out
        }
    }
}

/// Reads are made at least this large, so small messages cost one system call for many.
const READ_SIZE: usize = 64 << 10;

impl Outbox {
    /// Whether bytes taken are still to be written.
    fn busy(&self) -> bool {
        !self.pending.is_empty() || self.bulk.is_some()
    }
}

impl Inbox {
    /// The bytes left of the bulk run at the front, taking its header if it is here whole.
    fn take_bulk_header(&mut self) -> Option<u64> {
        if self.bulk_left.is_some() {
            return self.bulk_left;
        }
        let header = self.data.get(self.start..self.start + BULK_HEADER)?;
        if u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) != BULK_MARK {
            return None;
        }
        let len = u64::from_le_bytes(header[4..].try_into().expect("8 bytes"));
        self.start += BULK_HEADER;
        // A run of no bytes is over as soon as it starts; it is reported once all the same.
        self.bulk_left = Some(len);
        Some(len)
    }

    /// Whether a bulk run's whole header is at the front, not yet taken.
    fn bulk_header_here(&self) -> bool {
        self.bulk_left.is_none()
            && self.data.len() >= self.start + BULK_HEADER
            && self.data[self.start..self.start + 4] == BULK_MARK.to_le_bytes()
    }

    /// The length of the whole message at the front, if one is there (a bulk run's header
    /// counts as one not whole until [`Inbox::take_bulk_header`] takes it).
    fn whole(&self) -> Result<Option<usize>> {
        if self.bulk_left.is_some() {
            return Ok(None);
        }
        let data = &self.data[self.start..];
        let Some(header) = data.get(..4) else { return Ok(None) };
        let len = u32::from_le_bytes(header.try_into().expect("4 bytes")) as usize;
        if len == BULK_MARK as usize {
            return Ok(None);
        }
        if len > MAX_MESSAGE {
            return Err(Error::MessageTooLarge { len: len as u64, max: MAX_MESSAGE });
        }
        Ok((data.len() >= 4 + len).then_some(len))
    }

    /// Bytes still missing for the message at the front.
    fn needed(&self) -> usize {
        let data = &self.data[self.start..];
        match data.get(..4) {
            Some(header) if u32::from_le_bytes(header.try_into().expect("4 bytes")) == BULK_MARK => {
                BULK_HEADER.saturating_sub(data.len())
            }
            Some(header) => {
                (4 + u32::from_le_bytes(header.try_into().expect("4 bytes")) as usize).saturating_sub(data.len())
            }
            None => 4 - data.len(),
        }
    }
}

impl Shared {
    /// Whether a new message or run may start now: nothing is pending, or what was could be
    /// written at once (never while the flusher writes it).
    fn ready(&self, outbox: &mut Outbox) -> Result<bool> {
        if !outbox.busy() {
            return Ok(true);
        }
        if outbox.flushing {
            return Ok(false);
        }
        self.write_pending(outbox)?;
        Ok(!outbox.busy())
    }

    /// Writes what the socket takes of the pending bytes now, then of the bulk run begun.
    fn write_pending(&self, outbox: &mut Outbox) -> Result<()> {
        while !outbox.pending.is_empty() {
            match (&self.stream).write(&outbox.pending) {
                Ok(0) => return Err(self.broke(outbox, std::io::ErrorKind::WriteZero.into())),
                Ok(n) => drop(outbox.pending.drain(..n)),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.broke(outbox, e)),
            }
        }
        while let Some(bulk) = &mut outbox.bulk {
            if bulk.done() {
                outbox.bulk = None; // the owner goes: its memory is free again
                break;
            }
            match bulk.write_to(&self.stream) {
                Ok(0) => return Err(self.broke(outbox, std::io::ErrorKind::WriteZero.into())),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.broke(outbox, e)),
            }
        }
        self.drained.notify_all();
        Ok(())
    }

    /// The flusher thread: writes the pending bytes as the socket takes them, however slowly:
    /// a peer that reads slowly (a consumer busy between two `recv`s) only slows its sender.
    /// A peer that is gone is seen by the socket (a reset, or the keepalive probes of
    /// [`KEEPALIVE`] going unanswered), which ends the wait with an error.
    fn flush(&self) {
        loop {
            let mut outbox = lock(&self.outbox);
            if self.write_pending(&mut outbox).is_err() || !outbox.busy() || outbox.broken.is_some() {
                if outbox.close_after && outbox.broken.is_none() {
                    let _ = self.stream.shutdown(Shutdown::Write);
                }
                outbox.flushing = false;
                self.drained.notify_all();
                return;
            }
            drop(outbox);
            let _ = wait_for(self.stream.as_fd(), PollFlags::OUT, Some(Duration::from_millis(100)));
        }
    }

    /// Marks the outbox broken by `error`, which is returned in this crate's terms.
    fn broke(&self, outbox: &mut Outbox, error: std::io::Error) -> Error {
        let gone = matches!(
            error.kind(),
            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::NotConnected
        );
        outbox.pending.clear();
        outbox.bulk = None;
        self.drained.notify_all();
        if gone {
            outbox.broken = Some(Broken::Gone);
            Error::PeerGone
        } else {
            Error::os("sending over TCP", error)
        }
    }
}

impl From<Broken> for Error {
    fn from(broken: Broken) -> Error {
        match broken {
            Broken::Gone => Error::PeerGone,
        }
    }
}

impl AsFd for TcpLink {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.stream.as_fd()
    }
}

/// Waits until `fd` is ready for `flags` or `timeout` passes (`None`: forever); an error or
/// hang-up counts as ready (the next call reports it).
fn wait_for(fd: BorrowedFd<'_>, flags: PollFlags, timeout: Option<Duration>) -> Result<()> {
    let timespec = timeout.map(|t| Timespec::try_from(bounded(t)).unwrap_or(Timespec { tv_sec: 3600, tv_nsec: 0 }));
    let mut fds = [PollFd::new(&fd, flags)];
    match poll(&mut fds, timespec.as_ref()) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(Error::os("poll", std::io::Error::from(e))),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Clone, Copy)]
enum Side {
    Connector,
    Listener,
}

impl Side {
    fn role(self) -> u8 {
        match self {
            Side::Connector => b'C',
            Side::Listener => b'S',
        }
    }

    fn peer_role(self) -> u8 {
        match self {
            Side::Connector => b'S',
            Side::Listener => b'C',
        }
    }
}

/// Runs `tq-auth-v1` (see the module's docs) on a fresh connection, by `deadline`.
fn handshake(
    stream: TcpStream,
    peer: SocketAddr,
    side: Side,
    secret: &Secret,
    deadline: Instant,
    timeout: Duration,
    listening: Option<&Progress>,
) -> Result<TcpLink> {
    let began = Instant::now();
    stream.set_nodelay(true).map_err(|e| Error::os("TCP_NODELAY", e))?;
    let refused = |why| Error::AuthFailed { peer, why };
    let aborted = || listening.is_some_and(Progress::shed);
    if aborted() {
        // Shed before it started: the connector sees a hang-up in the greeting. (The abort
        // handle's copy of the socket may still be open: close for both.)
        let _ = stream.shutdown(Shutdown::Both);
        return Err(refused(HUNG_UP_IN_GREETING));
    }
    let stopped = |stop, hung_up| {
        if aborted() {
            // Shed (the reading direction was shut): the connector, which has our greeting,
            // reads this in place of our answer. Without waiting: a full socket gets nothing.
            let _ = stream.set_nonblocking(true);
            let _ = (&stream).write(SHED_ANSWER);
            let _ = stream.shutdown(Shutdown::Both);
        }
        match stop {
            Stop::Timeout => Error::HandshakeTimeout { peer, timeout },
            Stop::Gone => refused(hung_up),
            Stop::Os(e) => Error::os("the TCP handshake", e),
        }
    };
    // No secret is used before the answers: a hang-up there is not a secret's fault
    // (`HUNG_UP_IN_GREETING`).
    let deadline = Some(deadline);

    let mut own = [0u8; NONCE_LEN];
    getrandom::fill(&mut own).map_err(|e| Error::os("getrandom", std::io::Error::other(e.to_string())))?;
    let hello = [&TAG[..], &[side.role()], &own].concat();
    write_all_by(&stream, &hello, deadline).map_err(|stop| stopped(stop, HUNG_UP_IN_GREETING))?;

    if let Some(progress) = listening {
        // Heard is stored while the greeting's first byte still waits in the socket: stored
        // after the read, `heard_from` (heard, or bytes waiting) would say false in between.
        peek_by(&stream, deadline).map_err(|stop| stopped(stop, HUNG_UP_IN_GREETING))?;
        progress.heard.store(true, Ordering::Release);
    }
    let mut theirs = [0u8; HELLO_LEN];
    read_exact_by(&stream, &mut theirs, deadline).map_err(|stop| stopped(stop, HUNG_UP_IN_GREETING))?;
    if &theirs[..TAG.len()] != TAG {
        return Err(refused("its greeting is not tq-auth-v1 (another protocol, or garbage)"));
    }
    if matches!(side, Side::Connector) && theirs[TAG.len()] == TURNED_AWAY {
        return Err(Error::TurnedAway { peer, why: TurnAway::from_code(theirs[TAG.len() + 1]) });
    }
    if theirs[TAG.len()] != side.peer_role() {
        return Err(refused("its greeting claims the wrong role (both sides connecting, or both listening?)"));
    }
    let peer_nonce: [u8; NONCE_LEN] = theirs[TAG.len() + 1..].try_into().expect("HELLO_LEN holds a nonce");
    if peer_nonce == own {
        return Err(refused("it sent back our own challenge"));
    }

    let check = |answer: &[u8]| {
        secret
            .answer(side.peer_role(), &peer_nonce, &own)
            .verify_slice(answer)
            .map_err(|_| refused("its answer to our challenge is wrong (a different TQ_SECRET, or a replay)"))
    };
    let mut answer = [0u8; PROOF_LEN];
    let ours = secret.answer(side.role(), &own, &peer_nonce).finalize().into_bytes();
    match side {
        Side::Connector => {
            write_all_by(&stream, &ours, deadline).map_err(|stop| stopped(stop, HUNG_UP_IN_GREETING))?;
            read_exact_by(&stream, &mut answer, deadline).map_err(|stop| stopped(stop, NO_ANSWER))?;
            if answer == *SHED_ANSWER {
                return Err(Error::HandshakeShed { peer, waited: began.elapsed(), why: SHED_BY_LISTENER });
            }
            check(&answer)?;
        }
        Side::Listener => {
            read_exact_by(&stream, &mut answer, deadline)
                .map_err(|stop| stopped(stop, "it hung up instead of answering our challenge"))?;
            check(&answer)?;
            // Answered, unless shed first: then the connector is told so instead (`stopped`),
            // never let in and then cut off.
            if let Some(progress) = listening
                && progress.stage.compare_exchange(RUNNING, ANSWERED, Ordering::AcqRel, Ordering::Acquire).is_err()
            {
                return Err(stopped(Stop::Gone, HUNG_UP_IN_GREETING));
            }
            write_all_by(&stream, &ours, deadline).map_err(|stop| stopped(stop, HUNG_UP_IN_GREETING))?;
        }
    }
    stream.set_nonblocking(true).map_err(|e| Error::os("O_NONBLOCK on a TCP link", e))?;
    keep_alive(&stream).map_err(|e| Error::os("TCP keepalive", std::io::Error::from(e)))?;
    let shared = Shared { stream, inbox: Mutex::default(), outbox: Mutex::default(), drained: CountedCondvar::new() };
    Ok(TcpLink { shared: Arc::new(shared), peer, send_timeout: Mutex::new(Some(DEFAULT_SEND_TIMEOUT)) })
}

/// Keepalive on an authenticated link: (idle time, interval, unanswered probes). A host that
/// vanished (powered off, cut off) is seen within about 25 s of silence; a peer that is alive
/// answers the probes however slowly it reads, so nothing else ever cuts a slow peer.
pub const KEEPALIVE: (Duration, Duration, u32) = (Duration::from_secs(10), Duration::from_secs(5), 3);

fn keep_alive(stream: &TcpStream) -> rustix::io::Result<()> {
    use rustix::net::sockopt;
    let (idle, interval, count) = KEEPALIVE;
    sockopt::set_socket_keepalive(stream, true)?;
    sockopt::set_tcp_keepidle(stream, idle)?;
    sockopt::set_tcp_keepintvl(stream, interval)?;
    sockopt::set_tcp_keepcnt(stream, count)
}

/// Why a read or write by a deadline stopped.
enum Stop {
    Timeout,
    /// The peer closed the connection (end of stream, reset, broken pipe).
    Gone,
    Os(std::io::Error),
}

/// The time left until `deadline` (`None`: no deadline); [`Stop::Timeout`] when none is left.
fn remaining(deadline: Option<Instant>) -> std::result::Result<Option<Duration>, Stop> {
    match deadline {
        None => Ok(None),
        Some(deadline) => match deadline.saturating_duration_since(Instant::now()) {
            left if left.is_zero() => Err(Stop::Timeout),
            left => Ok(Some(left)),
        },
    }
}

/// Sorts an I/O error: `Ok` for those worth retrying (a signal, a socket timeout that the
/// deadline check will judge).
fn retry_or_stop(error: std::io::Error) -> std::result::Result<(), Stop> {
    match error.kind() {
        ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut => Ok(()),
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => Err(Stop::Gone),
        _ => Err(Stop::Os(error)),
    }
}

/// Reads at least one byte into `buf` by `deadline`.
fn read_by(mut stream: &TcpStream, buf: &mut [u8], deadline: Option<Instant>) -> std::result::Result<usize, Stop> {
    loop {
        stream.set_read_timeout(remaining(deadline)?).map_err(Stop::Os)?;
        match stream.read(buf) {
            Ok(0) => return Err(Stop::Gone),
            Ok(n) => return Ok(n),
            Err(e) => retry_or_stop(e)?,
        }
    }
}

/// Waits by `deadline` until a byte can be read, leaving it in the socket.
fn peek_by(stream: &TcpStream, deadline: Option<Instant>) -> std::result::Result<(), Stop> {
    loop {
        stream.set_read_timeout(remaining(deadline)?).map_err(Stop::Os)?;
        match stream.peek(&mut [0u8; 1]) {
            Ok(0) => return Err(Stop::Gone),
            Ok(_) => return Ok(()),
            Err(e) => retry_or_stop(e)?,
        }
    }
}

fn read_exact_by(stream: &TcpStream, buf: &mut [u8], deadline: Option<Instant>) -> std::result::Result<(), Stop> {
    let mut filled = 0;
    while filled < buf.len() {
        filled += read_by(stream, &mut buf[filled..], deadline)?;
    }
    Ok(())
}

fn write_all_by(mut stream: &TcpStream, mut bytes: &[u8], deadline: Option<Instant>) -> std::result::Result<(), Stop> {
    while !bytes.is_empty() {
        stream.set_write_timeout(remaining(deadline)?).map_err(Stop::Os)?;
        match stream.write(bytes) {
            Ok(0) => return Err(Stop::Gone),
            Ok(n) => bytes = &bytes[n..],
            Err(e) => retry_or_stop(e)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_long_enough_and_never_printed() {
        assert!(matches!(Secret::from_bytes(*b"short"), Err(Error::InvalidArgument(_))));
        let secret = Secret::from_bytes(*b"correct horse battery staple").unwrap();
        let shown = format!("{secret:?}");
        assert!(!shown.contains("horse"), "{shown}");
        assert!(shown.contains("28"), "{shown}");
    }
}
