//! A receiver's side of one sender's connection, shared by the tensors received from it: what it
//! owes the sender (credits, releases, rejections, lost announcements, a closing) and the non-blocking writes that
//! deliver it.
//!
//! A receiver never waits for a sender to read: a sender that stops reading must not stop the
//! receiver, nor the threads that drop received tensors, nor other senders. Frames that do not
//! fit the socket now stay in the outbox (credits add up to one number, releases to one list;
//! see `protocol::Owed`) and go out with the next write, or from the release thread, which
//! retries stalled peers. Releases are batched as credits are: while messages stream they wait
//! for a full batch or the next credit, and the release thread writes what is left soon after.

use std::sync::{Arc, Mutex};

use super::protocol::Owed;
use crate::links::link::Link;
use crate::sync::lock;

/// A sender's connection as the receiving process sees it.
pub(crate) struct Peer {
    pub link: Link,
    /// This process's number for the connection ([`crate::MessageInfo::connection`]).
    pub connection: u64,
    outbox: Mutex<Outbox>,
    /// Who retries the writes once the socket was full, and writes releases that wait for
    /// company: the release thread (`release::retry_stalled`, `release::flush_later`), passed
    /// in so that this module needs nothing above it.
    on_stall: fn(Arc<Peer>),
    on_defer: fn(Arc<Peer>),
}

#[derive(Default)]
struct Outbox {
    owed: Owed,
    /// Whether the release thread is retrying this peer.
    stalled: bool,
    /// Whether the release thread will write this peer's releases soon.
    deferred: bool,
}

impl Peer {
    pub fn new(link: Link, on_stall: fn(Arc<Peer>), on_defer: fn(Arc<Peer>)) -> Arc<Peer> {
        // Unique for the life of the process: several senders of one process, or one that
        // reconnected, are told apart by it.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let connection = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new(Peer { link, connection, outbox: Mutex::new(Outbox::default()), on_stall, on_defer })
    }

    /// Returns `count` credits (and the releases owed go with them).
    pub fn credit(self: &Arc<Self>, count: u32) {
        self.post(|owed| owed.credit(count));
    }

    /// Releases these messages: at once with a full batch or other frames owed, else soon (the
    /// release thread writes them, unless more come first).
    pub fn release(self: &Arc<Self>, messages: impl IntoIterator<Item = u64>) {
        self.post(|owed| owed.release(messages));
    }

    /// Tells the sender that message `seq` was refused.
    pub fn reject(self: &Arc<Self>, seq: u64, reason: String) {
        self.post(|owed| owed.reject(seq, reason));
    }

    /// Tells the sender that the descriptor of `chunk`'s announcement was lost (it announces the
    /// chunk again).
    pub fn chunk_lost(self: &Arc<Self>, chunk: u64) {
        self.post(|owed| owed.chunk_lost(chunk));
    }

    /// Tells the sender that no more messages are taken; `read_up_to` is the last one read.
    pub fn close(self: &Arc<Self>, read_up_to: u64, reason: String) {
        self.post(|owed| owed.close(read_up_to, reason));
    }

    fn post(self: &Arc<Self>, add: impl FnOnce(&mut Owed)) {
        let mut out = lock(&self.outbox);
        add(&mut out.owed);
        if out.stalled {
            return; // the release thread writes it once the socket has room
        }
        if out.owed.releases_may_wait() {
            if !out.deferred {
                out.deferred = true;
                (self.on_defer)(self.clone());
            }
            return;
        }
        if !self.flush_locked(&mut out) {
            out.stalled = true;
            (self.on_stall)(self.clone());
        }
    }

    /// Writes what the outbox holds while the socket has room; whether it is empty now.
    pub fn flush(&self) -> bool {
        let mut out = lock(&self.outbox);
        let empty = self.flush_locked(&mut out);
        out.stalled = !empty;
        empty
    }

    fn flush_locked(&self, out: &mut Outbox) -> bool {
        out.deferred = false;
        while let Some(frame) = out.owed.next() {
            match self.link.try_send(&frame) {
                Ok(true) => {
                    tracing::trace!(pid = self.link.peer_pid(), ?frame, "to the sender");
                    out.owed.written(&frame)
                }
                Ok(false) => {
                    tracing::trace!(pid = self.link.peer_pid(), "to the sender: no room, stalled");
                    return false;
                }
                // The sender is gone, and with it what we owed it.
                Err(_) => {
                    out.owed.forget();
                    return true;
                }
            }
        }
        true
    }
}
