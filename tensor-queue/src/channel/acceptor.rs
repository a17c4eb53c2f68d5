//! A bound receiver's accept thread: it checks and greets new connections, so senders can start
//! before the first `recv`, and hands each to `recv` over a doorbell socket.

use std::io::ErrorKind;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ipc_core::seqpacket::{Connection, Listener};

use super::link::Link;
use super::lock;
use super::receiver::ReceiverOptions;
use crate::wire::Frame;
use crate::{Error, Result};

/// A bound receiver's accept thread, which sets up new connections (user check, `Hello`) so that
/// senders can start before the first `recv`, and hands each to `recv` over `doorbell`.
pub(super) struct Acceptor {
    pub(super) listener: Arc<Listener>,
    pub(super) doorbell: Connection,
    pub(super) closed: Arc<AtomicBool>,
    /// Connections the accept thread refused, for `take_errors`.
    pub(super) refused: Arc<Mutex<Vec<Error>>>,
    pub(super) thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    pub(super) fn start(listener: Listener, options: ReceiverOptions) -> Result<Acceptor> {
        let (doorbell, bell) = Connection::pair()?;
        let closed = Arc::new(AtomicBool::new(false));
        let listener = Arc::new(listener);
        let refused = Arc::new(Mutex::new(Vec::new()));
        let (stop, listening, refusals) = (closed.clone(), listener.clone(), refused.clone());
        let thread = std::thread::Builder::new()
            .name("tq-accept".into())
            .spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let connection = match listening.accept(Some(Duration::from_millis(100))) {
                        Ok(connection) => connection,
                        Err(ipc_core::Error::Os { source, .. }) if source.kind() == ErrorKind::TimedOut => continue,
                        Err(_) if stop.load(Ordering::Acquire) => return,
                        Err(error) => {
                            tracing::warn!(%error, "accept failed");
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                    };
                    // A refused peer is told why and dropped here, and `recv` hears of it
                    // (`take_errors`); `recv` re-checks the user of every socket it adopts.
                    let answer = match Link::check_peer(&connection) {
                        Ok(_) => match Link::new(connection).and_then(|link| options.greet(&link).map(|()| link)) {
                            Ok(link) => bell.send(b"c", &[link.fd()]),
                            Err(error) => {
                                tracing::warn!(%error, "a new connection failed");
                                Ok(())
                            }
                        },
                        Err(error) => {
                            tracing::warn!(%error, "refused a connection");
                            let close = Frame::Close { read_up_to: 0, reason: error.to_string() };
                            let _ = connection.try_send(&close.encode(), &[]);
                            lock(&refusals).push(error);
                            bell.send(b"r", &[])
                        }
                    };
                    if answer.is_err() {
                        return; // the receiver is gone
                    }
                }
            })
            .map_err(|e| Error::Protocol(format!("spawning the accept thread: {e}")))?;
        Ok(Acceptor { listener, doorbell, closed, refused, thread: Some(thread) })
    }
}

impl Acceptor {
    /// Stops and joins the accept thread: after this, everything it accepted is at the doorbell.
    pub(super) fn stop(&mut self) {
        self.closed.store(true, Ordering::Release);
        self.listener.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        // Stopped and joined, so the listener (and with it the socket file) goes now, not when
        // the thread next wakes: a receiver that exits cleanly leaves no socket file behind.
        self.stop();
    }
}
