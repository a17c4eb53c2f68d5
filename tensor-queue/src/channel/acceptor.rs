//! A bound receiver's accept thread: it checks and greets new connections, so senders can start
//! before the first `recv`, and hands each to `recv` (rung through a doorbell socket, which
//! `recv` polls with its connections).
//!
//! Over TCP each handshake runs on a thread of its own, bounded by the handshake timeout: a
//! connector that says nothing, or the wrong thing, delays no other.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ipc_core::seqpacket::{Connection, Listener};
use ipc_core::tcp::{Secret, TcpListener};

use super::link::Link;
use super::lock;
use super::receiver::ReceiverOptions;
use crate::wire::Frame;
use crate::{Error, Result};

/// Handshakes over TCP that may run at once; connectors beyond are closed at once.
const MAX_HANDSHAKES: usize = 64;

/// What a receiver listens on.
pub(super) enum Listening {
    Unix(Listener),
    Tcp(TcpListener, Secret),
}

/// What the accept thread hands to `recv`.
#[derive(Default)]
pub(super) struct Handed {
    /// Checked and greeted connections.
    pub links: Vec<Link>,
    /// Connections refused, for `take_errors`.
    pub refused: Vec<Error>,
}

/// A bound receiver's accept thread (see the module docs).
pub(super) struct Acceptor {
    listening: Arc<Listening>,
    pub(super) doorbell: Connection,
    closed: Arc<AtomicBool>,
    pub(super) handed: Arc<Mutex<Handed>>,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    pub(super) fn start(listening: Listening, options: ReceiverOptions) -> Result<Acceptor> {
        let (doorbell, bell) = Connection::pair()?;
        let bell = Arc::new(bell);
        let closed = Arc::new(AtomicBool::new(false));
        let listening = Arc::new(listening);
        let handed = Arc::new(Mutex::new(Handed::default()));
        let (stop, listener, handing) = (closed.clone(), listening.clone(), handed.clone());
        let handshakes = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::Builder::new()
            .name("tq-accept".into())
            .spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let wait = Some(Duration::from_millis(100));
                    let accepted = match &*listener {
                        Listening::Unix(unix) => unix.accept(wait).map(|connection| {
                            // A peer of another user is told why and dropped here, and `recv`
                            // hears of it (`take_errors`).
                            if let Err(error) = Link::check_peer(&connection) {
                                let close = Frame::Close { read_up_to: 0, reason: error.to_string() };
                                let _ = connection.try_send(&close.encode(), &[]);
                            }
                            Some(Link::new(Box::new(connection)))
                        }),
                        Listening::Tcp(tcp, secret) => tcp.accept_unverified(wait).map(|unverified| {
                            if handshakes.load(Ordering::Acquire) >= MAX_HANDSHAKES {
                                tracing::warn!(peer = %unverified.peer_addr(), "too many handshakes at once; closed");
                                return None;
                            }
                            handshakes.fetch_add(1, Ordering::AcqRel);
                            let (secret, options, handing, bell, running) =
                                (secret.clone(), options.clone(), handing.clone(), bell.clone(), handshakes.clone());
                            let spawned = std::thread::Builder::new().name("tq-handshake".into()).spawn(move || {
                                let outcome = unverified
                                    .verify(&secret)
                                    .map_err(Error::from)
                                    .and_then(|link| Link::new(Box::new(link)));
                                hand_over(outcome, &options, &handing, &bell);
                                running.fetch_sub(1, Ordering::AcqRel);
                            });
                            if spawned.is_err() {
                                handshakes.fetch_sub(1, Ordering::AcqRel);
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
                        Err(error) => {
                            tracing::warn!(%error, "accept failed");
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                }
            })
            .map_err(|e| Error::Protocol(format!("spawning the accept thread: {e}")))?;
        Ok(Acceptor { listening, doorbell, closed, handed, thread: Some(thread) })
    }

    /// The socket file, for a receiver bound to a Unix socket.
    pub(super) fn path(&self) -> Option<&Path> {
        match &*self.listening {
            Listening::Unix(listener) => Some(listener.path()),
            Listening::Tcp(..) => None,
        }
    }

    /// The address, for a receiver bound to TCP.
    pub(super) fn local_addr(&self) -> Option<SocketAddr> {
        match &*self.listening {
            Listening::Tcp(listener, _) => listener.local_addr().ok(),
            Listening::Unix(_) => None,
        }
    }

    /// Stops and joins the accept thread: after this, everything it accepted is handed over.
    pub(super) fn stop(&mut self) {
        self.closed.store(true, Ordering::Release);
        if let Listening::Unix(listener) = &*self.listening {
            listener.wake();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Greets a checked connection and hands it to `recv`, or records why it was refused; rings
/// the doorbell either way. Whether the receiver is still there.
fn hand_over(outcome: Result<Link>, options: &ReceiverOptions, handed: &Mutex<Handed>, bell: &Connection) -> bool {
    let ring: &[u8] = match outcome {
        Ok(link) => match options.greet(&link) {
            Ok(()) => {
                lock(handed).links.push(link);
                b"c"
            }
            Err(error) => {
                // It hung up already: nothing to report.
                tracing::warn!(%error, "a new connection failed");
                return true;
            }
        },
        Err(error) => {
            tracing::warn!(%error, "refused a connection");
            lock(handed).refused.push(error);
            b"r"
        }
    };
    bell.send(ring, &[]).is_ok()
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        // Stopped and joined, so the listener (and with it the socket file) goes now, not when
        // the thread next wakes: a receiver that exits cleanly leaves no socket file behind.
        self.stop();
    }
}
