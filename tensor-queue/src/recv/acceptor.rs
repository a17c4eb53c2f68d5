//! A bound receiver's accept thread: it checks and greets new connections, so senders can start
//! before the first `recv`, and hands each to `recv` (rung through a doorbell socket, which
//! `recv` polls with its connections).
//!
//! Over TCP each handshake runs on a thread of its own, bounded by the handshake timeout: a
//! connector that says nothing, or the wrong thing, delays no other. At most
//! [`MAX_HANDSHAKES_PER_SOURCE`] run at once for one address and [`MAX_HANDSHAKES`] in all; a new
//! connection beyond either bound makes room by dropping the oldest handshake under way (of its
//! address, or of all) that has said nothing yet, else the oldest, which is reported
//! (`ipc_core::Error::HandshakeShed`, in `take_errors`). So silent connections cannot keep an
//! honest sender out: it greets at once and its handshake takes a round trip, while theirs never
//! end and they say nothing; one address cannot take more than its share; and an honest sender
//! shed in a burst of others tries again (`ipc_core::tcp::TcpLink::connect`).

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ipc_core::seqpacket::{Connection, Listener};
use ipc_core::tcp::{HandshakeAbort, Secret, TcpListener, TurnAway, Unverified};
use ipc_core::transport::Packets;

use crate::error::{Error, Result};
use crate::links::link::Link;
use crate::route::{Reach, Routing};
use crate::sync::lock;
use crate::wire::{Frame, ToSender};

/// What a receiver says to every sender it greets: its capacity per sender and its routing (with
/// this process's GPUs, [`Reach::local`]).
#[derive(Clone)]
pub(crate) struct Greeting {
    pub capacity: u32,
    pub routing: Routing,
}

impl Greeting {
    /// On a local link, offers the rings (`links/rings.rs`), then sends the receiver's `Hello`:
    /// the capacity, this process's GPUs, and the routing.
    ///
    /// The offer comes first so that the sender has switched to the rings before the `Hello`
    /// gives it credits: a burst right after `connect` goes by the rings from its first message,
    /// instead of filling the socket while the sender's reader thread has yet to read an offer
    /// that came behind the `Hello` (what the socket cannot take would then wait in the sender
    /// until the receiver reads). A test switch ([`crate::switches::ring_offer_delay`]) sends the
    /// offer late instead, after the `Hello`, as before, to keep the switch from the socket to
    /// the rings in mid-stream tested.
    ///
    /// Once the `Hello` is out the connection is the receiver's, whatever becomes of a late
    /// offer: the sender may already have sent its messages (on the socket) and exited, and the
    /// offer then finds it gone. Those messages are read, then the hang-up, as on any link.
    pub(crate) fn greet(&self, link: &Link) -> Result<()> {
        if let Some(delay) = crate::switches::greeting_delay() {
            std::thread::sleep(delay);
        }
        let late = crate::switches::ring_offer_delay();
        if late.is_none() {
            offer_rings(link);
        }
        link.hello(self.capacity, Reach::local(), &self.routing)?;
        if let Some(delay) = late {
            std::thread::sleep(delay);
            offer_rings(link);
        }
        Ok(())
    }
}

/// Offers the rings; a link that cannot have them stays on the socket, and a sender gone
/// meanwhile is seen by what follows.
fn offer_rings(link: &Link) {
    if let Err(error) = link.offer_rings() {
        tracing::debug!(%error, "no rings for this connection; it stays on the socket");
    }
}

/// Handshakes over TCP that may run at once; a connector beyond makes room by dropping the oldest.
const MAX_HANDSHAKES: usize = 64;
/// Handshakes over TCP from one address that may run at once; beyond, its oldest is dropped.
const MAX_HANDSHAKES_PER_SOURCE: usize = 16;

/// The handshakes under way, oldest first.
#[derive(Default)]
struct Handshakes {
    running: Vec<(u64, HandshakeAbort)>,
    next: u64,
}

impl Handshakes {
    /// Makes room for a handshake from `source` (dropping the oldest beyond a bound) and
    /// records it; its number, for [`Handshakes::finished`].
    fn admit(&mut self, abort: HandshakeAbort) -> u64 {
        let source = abort.peer_addr().ip();
        let same: Vec<usize> =
            (0..self.running.len()).filter(|&i| self.running[i].1.peer_addr().ip() == source).collect();
        // Among those over the bound, the oldest that said nothing yet; else the oldest.
        let victim = |among: Vec<usize>| {
            among.iter().copied().find(|&i| !self.running[i].1.heard_from()).or(among.first().copied())
        };
        let oldest = if same.len() >= MAX_HANDSHAKES_PER_SOURCE {
            victim(same)
        } else if self.running.len() >= MAX_HANDSHAKES {
            victim((0..self.running.len()).collect())
        } else {
            None
        };
        if let Some(at) = oldest {
            let (_, dropped) = self.running.remove(at);
            if dropped.abort() {
                tracing::warn!(peer = %dropped.peer_addr(), "too many handshakes at once; shed one");
            }
        }
        self.next += 1;
        self.running.push((self.next, abort));
        self.next
    }

    fn finished(&mut self, id: u64) {
        self.running.retain(|(i, _)| *i != id);
    }
}

/// What a receiver listens on.
pub(crate) enum Listening {
    Unix(Listener),
    Tcp(TcpListener, Secret),
}

/// What the accept thread hands to `recv`.
#[derive(Default)]
pub(crate) struct Handed {
    /// Checked and greeted connections.
    pub links: Vec<Link>,
    /// Connections refused, for `take_errors` (the last [`MAX_ERRORS_KEPT`]).
    pub refused: VecDeque<Error>,
    /// Connections being greeted: their senders may send as soon as the `Hello` is out, before
    /// they are handed over, so `recv` must not take the end of the stream for final meanwhile.
    pub greeting: usize,
    /// Connections greeted so far (or being greeted).
    pub admitted: usize,
    /// The most connections greeted in all (`Receiver::expect_senders`): one beyond is turned
    /// away before its greeting, so its sender never has a credit to send with. (Counting only
    /// in `recv`, senders connecting at once got in beyond the count, and one of them lost the
    /// messages its `send` had accepted when its connection was dropped; outside tester, Rust
    /// round 9, finding 1.)
    pub limit: Option<usize>,
}

/// A bound receiver's accept thread (see the module docs).
pub(crate) struct Acceptor {
    listening: Arc<Listening>,
    pub(crate) doorbell: Connection,
    closed: Arc<AtomicBool>,
    pub(crate) handed: Arc<Mutex<Handed>>,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    pub(crate) fn start(listening: Listening, options: Greeting) -> Result<Acceptor> {
        let (doorbell, bell) = Connection::pair()?;
        let bell = Arc::new(bell);
        let closed = Arc::new(AtomicBool::new(false));
        let listening = Arc::new(listening);
        let handed = Arc::new(Mutex::new(Handed::default()));
        let (stop, listener, handing) = (closed.clone(), listening.clone(), handed.clone());
        let handshakes = Arc::new(Mutex::new(Handshakes::default()));
        // One descriptor held in reserve: when the table is full, it makes room to accept a
        // connector and tell it why, instead of leaving it to wait in the backlog.
        let mut spare = Reserve::open();
        let thread = std::thread::Builder::new()
            .name("tq-accept".into())
            .spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    if spare.is_none() {
                        // Taken by another thread when it was last freed: as soon as one is free.
                        spare = Reserve::open();
                    }
                    let wait = Some(Duration::from_millis(100));
                    let accepted = match &*listener {
                        Listening::Unix(unix) => unix.accept(wait).map(|connection| {
                            // A peer of another user is told why and dropped here, and `recv`
                            // hears of it (`take_errors`).
                            if let Err(error) = Link::check_peer(&connection) {
                                let close = ToSender::Close { read_up_to: 0, reason: error.to_string() };
                                let _ = connection.try_send(&close.encode(), &[]);
                            }
                            Some(Link::new(Box::new(connection)))
                        }),
                        Listening::Tcp(tcp, secret) => tcp.accept_unverified(wait).map(|unverified| {
                            let abort = match unverified.abort_handle() {
                                Ok(abort) => abort,
                                // Accepted with the last descriptor: none left to duplicate it.
                                Err(ipc_core::Error::Os { source, .. })
                                    if source.raw_os_error().is_some_and(is_table_full) =>
                                {
                                    turn_away(Some(Unwanted::Tcp(unverified)));
                                    return None;
                                }
                                Err(error) => return Some(Err(error.into())),
                            };
                            let id = lock(&handshakes).admit(abort);
                            let (secret, options, handing, bell, running) =
                                (secret.clone(), options.clone(), handing.clone(), bell.clone(), handshakes.clone());
                            let spawned = std::thread::Builder::new().name("tq-handshake".into()).spawn(move || {
                                let outcome = unverified
                                    .verify(&secret)
                                    .map_err(Error::from)
                                    .and_then(|link| Link::new(Box::new(link)));
                                lock(&running).finished(id);
                                hand_over(outcome, &options, &handing, &bell);
                            });
                            if let Err(error) = spawned {
                                lock(&handshakes).finished(id);
                                return Some(Err(ipc_core::Error::Os {
                                    what: "spawning a handshake thread",
                                    source: error,
                                }
                                .into()));
                            }
                            None
                        }),
                    };
                    match accepted {
                        Ok(Some(outcome)) => {
                            if !hand_over(outcome, &options, &handing, &bell) {
                                return; // the receiver is gone
                            }
                        }
                        Ok(None) => {}
                        Err(ipc_core::Error::Os { source, .. }) if source.kind() == ErrorKind::TimedOut => {}
                        Err(_) if stop.load(Ordering::Acquire) => return,
                        Err(ipc_core::Error::Os { source, .. })
                            if source.raw_os_error().is_some_and(is_table_full) && spare.is_some() =>
                        {
                            drop(spare.take());
                            // The turned-away socket stays open (shut down) as the next reserve:
                            // its slot is never free for another thread to take meanwhile, which
                            // left the next connector waiting in the backlog (outside tester,
                            // round 5, B5).
                            spare = turn_away(accept_unwanted(&listener)).map(Reserve::Socket).or_else(Reserve::open);
                        }
                        Err(error) => {
                            tracing::warn!(%error, "accept failed");
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                }
            })
            .map_err(|source| ipc_core::Error::Os { what: "spawning the accept thread", source })?;
        Ok(Acceptor { listening, doorbell, closed, handed, thread: Some(thread) })
    }

    /// The socket file, for a receiver bound to a Unix socket.
    pub(crate) fn path(&self) -> Option<&Path> {
        match &*self.listening {
            Listening::Unix(listener) => Some(listener.path()),
            Listening::Tcp(..) => None,
        }
    }

    /// Whether a connection is being greeted or waits at the doorbell: a sender that `recv`
    /// has not adopted yet may have sent already.
    pub(crate) fn handing_over(&self) -> bool {
        let handed = lock(&self.handed);
        handed.greeting > 0 || !handed.links.is_empty()
    }

    /// The address, for a receiver bound to TCP.
    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        match &*self.listening {
            Listening::Tcp(listener, _) => listener.local_addr().ok(),
            Listening::Unix(_) => None,
        }
    }

    /// Stops and joins the accept thread: after this, everything it accepted is handed over.
    pub(crate) fn stop(&mut self) {
        self.closed.store(true, Ordering::Release);
        if let Listening::Unix(listener) = &*self.listening {
            listener.wake();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Whether an `accept` error says the descriptor table (this process's or the system's) is full.
fn is_table_full(errno: i32) -> bool {
    errno == rustix::io::Errno::MFILE.raw_os_error() || errno == rustix::io::Errno::NFILE.raw_os_error()
}

/// A connector accepted only to be turned away: this process is out of descriptors.
enum Unwanted {
    Unix(Connection),
    Tcp(Unverified),
}

/// Accepts the next connector with the descriptor just freed, to turn it away.
fn accept_unwanted(listening: &Listening) -> Option<Unwanted> {
    match listening {
        Listening::Unix(unix) => unix.accept(Some(Duration::ZERO)).ok().map(Unwanted::Unix),
        Listening::Tcp(tcp, _) => tcp.accept_unverified(Some(Duration::ZERO)).ok().map(Unwanted::Tcp),
    }
}

/// Tells `unwanted` (if one could be accepted) that this process is out of descriptors (a Unix
/// sender hears it as `Error::PeerRefused`); a TCP connector is closed before its handshake.
/// Either way it does not wait in the backlog. The one place that says so in the log. A Unix
/// connection comes back shut down, its descriptor still open, to serve as the next reserve.
fn turn_away(unwanted: Option<Unwanted>) -> Option<Connection> {
    let why = TurnAway::OutOfDescriptors;
    tracing::warn!("{why}");
    match unwanted {
        Some(Unwanted::Unix(connection)) => {
            let close = ToSender::Close { read_up_to: 0, reason: why.to_string() };
            let _ = connection.try_send(&close.encode(), &[]);
            Packets::shutdown(&connection, rustix::net::Shutdown::Both);
            Some(connection)
        }
        Some(Unwanted::Tcp(unverified)) => {
            unverified.turn_away(why);
            None
        }
        None => None,
    }
}

/// The descriptor an accept thread holds in reserve (see [`Acceptor::start`]): held for its
/// slot in the descriptor table only, never read.
#[allow(dead_code)]
enum Reserve {
    File(std::fs::File),
    Socket(Connection),
}

impl Reserve {
    fn open() -> Option<Reserve> {
        std::fs::File::open("/dev/null").ok().map(Reserve::File)
    }
}

/// The most errors a receiver keeps for `take_errors` (connections refused or closed, messages
/// rejected): beyond it the oldest go, so that a receiver whose `take_errors` is never called
/// keeps a bounded list under a storm of refused connectors (each is also logged).
pub(crate) const MAX_ERRORS_KEPT: usize = 1024;

/// Adds `error` to `errors`, dropping the oldest beyond [`MAX_ERRORS_KEPT`].
pub(crate) fn keep_bounded(errors: &mut VecDeque<Error>, error: Error) {
    if errors.len() >= MAX_ERRORS_KEPT {
        errors.pop_front();
    }
    errors.push_back(error);
}

/// Greets a checked connection and hands it to `recv` (also when the greeting failed: see
/// below), or records why it was refused; rings the doorbell either way (`recv` may wait for it,
/// see [`Handed::greeting`]). Whether the receiver is still there.
///
/// The doorbell is rung without waiting: a full one has rings `recv` has yet to read, and each
/// read takes everything handed over so far, this connection too. (Waiting for room held every
/// handshake thread, and the accept thread, until the receiver called `recv`: a receiver not
/// reading yet, under a storm of refused connectors, kept a thread per connector and stopped
/// accepting anyone; outside tester, Python round, finding 1.)
fn hand_over(outcome: Result<Link>, options: &Greeting, handed: &Mutex<Handed>, bell: &Connection) -> bool {
    let ring: &[u8] = match outcome {
        Ok(link) => {
            {
                let mut handed = lock(handed);
                if handed.limit.is_some_and(|limit| handed.admitted >= limit) {
                    drop(handed);
                    let why = "the receiver has every sender it expects (expect_senders)";
                    tracing::info!(pid = link.peer_pid(), "{why}: turned a sender away");
                    let _ = link.try_send(&ToSender::Close { read_up_to: 0, reason: why.into() });
                    link.shutdown(rustix::net::Shutdown::Both);
                    return true;
                }
                handed.admitted += 1;
                handed.greeting += 1;
            }
            let greeted = options.greet(&link);
            // A greeting that fails found the sender gone, but what it sent before it went (its
            // `Hello`, messages) is ours to read: `recv` counts it as a sender that joined and
            // left (`expect_senders` ends), or reads its hang-up. Dropping it here made a
            // receiver waiting for its senders wait for ever.
            match greeted {
                Ok(()) => tracing::debug!(pid = link.peer_pid(), "greeted a new connection; handing it to recv"),
                Err(error) => tracing::debug!(pid = link.peer_pid(), %error, "the greeting failed: the sender is gone"),
            }
            let mut handed = lock(handed);
            handed.greeting -= 1;
            handed.links.push(link);
            b"c"
        }
        Err(error) => {
            tracing::warn!(%error, "refused a connection");
            keep_bounded(&mut lock(handed).refused, error);
            b"r"
        }
    };
    bell.try_send(ring, &[]).is_ok()
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        // Stopped and joined, so the listener (and with it the socket file) goes now, not when
        // the thread next wakes: a receiver that exits cleanly leaves no socket file behind.
        self.stop();
    }
}
