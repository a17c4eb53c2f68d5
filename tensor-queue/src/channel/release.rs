//! Returning a received message's leases to its sender once the receiver's GPU work on them is
//! done.
//!
//! The tensors of one message share a [`ReceivedLease`]. When the last of them drops, its leases
//! go back in one `Release` frame: at once if the streams they were ordered on are idle, else
//! through the process's release thread. The dropping thread only queues the release; the release
//! thread records one event per stream for everything queued together (covering the work queued
//! before each drop, and perhaps a little after, which only returns the memory later), waits for
//! it, and sends one frame per sender. It stays awake briefly after each batch, so a consumer that
//! streams messages pays neither a driver call nor a thread wake-up per message.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ipc_core::{Event, Stream};

use super::{Link, lock};
use crate::wire::Frame;

/// A sender's connection, shared with the tensors received from it (which send its releases).
pub(crate) struct Peer {
    pub(super) link: Link,
}

/// Held by the storage of every tensor of one received message; returns the message's leases
/// in one frame when the last of them drops (one frame per message, not per tensor).
pub(crate) struct ReceivedLease {
    pub(super) peer: Arc<Peer>,
    pub(super) ids: Vec<u64>,
    /// The streams the message's GPU tensors were ordered on.
    pub(super) streams: Vec<Arc<Stream>>,
}

impl Drop for ReceivedLease {
    fn drop(&mut self) {
        let ids = std::mem::take(&mut self.ids);
        // The common case for a single hand-off: the receiver's work on the tensors is done.
        if self.streams.iter().all(|s| s.is_idle().unwrap_or(false)) {
            return send_release(&self.peer, ids);
        }
        let streams = std::mem::take(&mut self.streams);
        Releaser::get().push(PendingRelease { peer: self.peer.clone(), ids, streams });
    }
}

fn send_release(peer: &Peer, leases: Vec<u64>) {
    // A failed send means the sender is gone, and with it the leases.
    let _ = peer.link.send(&Frame::Release { leases }, &[]);
}

/// Leases to return once the work queued on their streams is done.
struct PendingRelease {
    peer: Arc<Peer>,
    ids: Vec<u64>,
    streams: Vec<Arc<Stream>>,
}

/// How long the release thread polls an event before it sleeps in the driver: most release
/// events complete within microseconds, and a blocking sync's wake-up took 340 us (p50) on an
/// H200 (`tq-bench` breakdown).
const EVENT_POLL: Duration = Duration::from_micros(500);

/// How long the release thread looks for more work after a batch before it sleeps: while
/// messages stream, the next release comes within microseconds, and waking a sleeping thread
/// would cost the dropping thread a system call.
const STAY_AWAKE: Duration = Duration::from_micros(200);

/// At most this many releases are handled together, so that a steady stream of new ones cannot
/// hold back those already done.
const MAX_BATCH: usize = 256;

/// The process's release thread and its queue.
struct Releaser {
    queue: Mutex<Queue>,
    /// Releases queued, readable without the lock (the awake thread watches it).
    queued: AtomicUsize,
    wake: Condvar,
}

#[derive(Default)]
struct Queue {
    pending: Vec<PendingRelease>,
    sleeping: bool,
}

impl Releaser {
    fn get() -> &'static Releaser {
        static RELEASER: OnceLock<&'static Releaser> = OnceLock::new();
        RELEASER.get_or_init(|| {
            let releaser: &'static Releaser = Box::leak(Box::new(Releaser {
                queue: Mutex::new(Queue::default()),
                queued: AtomicUsize::new(0),
                wake: Condvar::new(),
            }));
            std::thread::Builder::new()
                .name("tq-releaser".into())
                .spawn(move || releaser.run())
                .expect("spawning the release thread");
            releaser
        })
    }

    fn push(&self, pending: PendingRelease) {
        let mut queue = lock(&self.queue);
        queue.pending.push(pending);
        self.queued.fetch_add(1, Ordering::Release);
        if queue.sleeping {
            self.wake.notify_one();
        }
    }

    /// The next releases: what is queued now (at most [`MAX_BATCH`]), waiting for some.
    fn next_batch(&self) -> Vec<PendingRelease> {
        let awake_until = Instant::now() + STAY_AWAKE;
        while self.queued.load(Ordering::Acquire) == 0 && Instant::now() < awake_until {
            std::hint::spin_loop();
        }
        let mut queue = lock(&self.queue);
        queue.sleeping = true;
        while queue.pending.is_empty() {
            queue = self.wake.wait(queue).unwrap_or_else(|e| e.into_inner());
        }
        queue.sleeping = false;
        let count = queue.pending.len().min(MAX_BATCH);
        self.queued.fetch_sub(count, Ordering::Relaxed);
        queue.pending.drain(..count).collect()
    }

    fn run(&self) {
        // Blocking-sync events, reused: creating one per batch costs more than the hand-off.
        let mut pool: Vec<Event> = Vec::new();
        loop {
            let batch = self.next_batch();
            let mut streams: Vec<&Arc<Stream>> = Vec::new();
            for stream in batch.iter().flat_map(|pending| &pending.streams) {
                if !streams.iter().any(|s| Arc::ptr_eq(s, stream)) {
                    streams.push(stream);
                }
            }
            let mut used = Vec::with_capacity(streams.len());
            for stream in streams {
                match record(&mut pool, stream) {
                    Ok(event) => used.push(event),
                    Err(error) => {
                        tracing::warn!(%error, "could not record a release event; synchronising the stream");
                        let _ = stream.synchronize();
                    }
                }
            }
            for event in &used {
                if let Err(error) = wait_for(event) {
                    tracing::warn!(%error, "waiting for a release event failed");
                }
            }
            pool.extend(used);
            let mut frames: Vec<(Arc<Peer>, Vec<u64>)> = Vec::new();
            for pending in batch {
                match frames.iter_mut().find(|(peer, _)| Arc::ptr_eq(peer, &pending.peer)) {
                    Some((_, ids)) => ids.extend(pending.ids),
                    None => frames.push((pending.peer, pending.ids)),
                }
            }
            for (peer, ids) in frames {
                send_release(&peer, ids);
            }
        }
    }
}

/// An event recorded on `stream`, from the pool where one of its context is free.
fn record(pool: &mut Vec<Event>, stream: &Stream) -> ipc_core::Result<Event> {
    let event = match pool.iter().position(|event| Arc::ptr_eq(event.context(), stream.context())) {
        Some(at) => pool.swap_remove(at),
        None => Event::blocking(stream.context())?,
    };
    event.record(stream)?;
    Ok(event)
}

/// Waits for `event`, polling first and then sleeping in the driver.
fn wait_for(event: &Event) -> ipc_core::Result<()> {
    let start = Instant::now();
    while start.elapsed() < EVENT_POLL {
        if event.is_complete()? {
            return Ok(());
        }
        std::thread::yield_now();
    }
    event.synchronize()
}
