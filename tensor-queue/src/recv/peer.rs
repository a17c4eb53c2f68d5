//! A receiver's side of one sender's connection, shared by the tensors received from it: what it
//! owes the sender (credits, releases, rejections, a closing) and the non-blocking writes that
//! deliver it.
//!
//! A receiver never waits for a sender to read: a sender that stops reading must not stop the
//! receiver, nor the threads that drop received tensors, nor other senders. Frames that do not
//! fit the socket now stay in the outbox (credits add up to one number, releases to one list)
//! and go out with the next write, or from the release thread, which retries stalled peers.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::links::link::Link;
use crate::sync::lock;
use crate::wire::{MAX_RELEASES, ToSender};

/// A sender's connection as the receiving process sees it.
pub(crate) struct Peer {
    pub link: Link,
    /// This process's number for the connection ([`crate::MessageInfo::connection`]).
    pub connection: u64,
    outbox: Mutex<Outbox>,
    /// Who retries the writes once the socket was full: the release thread
    /// (`release::retry_stalled`), passed in so that this module needs nothing above it.
    on_stall: fn(Arc<Peer>),
}

#[derive(Default)]
struct Outbox {
    /// Rejections and the closing, in order; they go before credits and releases.
    control: VecDeque<ToSender>,
    credits: u32,
    releases: Vec<u64>,
    /// Whether the release thread is retrying this peer.
    stalled: bool,
}

impl Peer {
    pub fn new(link: Link, on_stall: fn(Arc<Peer>)) -> Arc<Peer> {
        // Unique for the life of the process: several senders of one process, or one that
        // reconnected, are told apart by it.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let connection = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new(Peer { link, connection, outbox: Mutex::new(Outbox::default()), on_stall })
    }

    /// Returns `count` credits.
    pub fn credit(self: &Arc<Self>, count: u32) {
        self.post(|out| out.credits += count);
    }

    /// Releases these messages.
    pub fn release(self: &Arc<Self>, messages: impl IntoIterator<Item = u64>) {
        self.post(|out| out.releases.extend(messages));
    }

    /// Tells the sender that message `seq` was refused.
    pub fn reject(self: &Arc<Self>, seq: u64, reason: String) {
        self.post(|out| out.control.push_back(ToSender::Rejected { seq, reason }));
    }

    /// Tells the sender that no more messages are taken; `read_up_to` is the last one read.
    pub fn close(self: &Arc<Self>, read_up_to: u64, reason: String) {
        self.post(|out| out.control.push_back(ToSender::Close { read_up_to, reason }));
    }

    fn post(self: &Arc<Self>, add: impl FnOnce(&mut Outbox)) {
        let mut out = lock(&self.outbox);
        add(&mut out);
        if !out.stalled && !self.flush_locked(&mut out) {
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
        loop {
            let frame = if let Some(frame) = out.control.front() {
                frame.clone()
            } else if out.credits > 0 {
                ToSender::Credit { count: out.credits }
            } else if !out.releases.is_empty() {
                ToSender::Release { messages: out.releases[..out.releases.len().min(MAX_RELEASES)].to_vec() }
            } else {
                return true;
            };
            match self.link.try_send(&frame) {
                Ok(true) => match frame {
                    ToSender::Credit { .. } => out.credits = 0,
                    ToSender::Release { messages } => drop(out.releases.drain(..messages.len())),
                    _ => drop(out.control.pop_front()),
                },
                Ok(false) => return false,
                // The sender is gone, and with it what we owed it.
                Err(_) => {
                    *out = Outbox::default();
                    return true;
                }
            }
        }
    }
}
