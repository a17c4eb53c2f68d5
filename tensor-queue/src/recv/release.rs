//! Returning a received message's leases to its sender once the receiver's GPU work on them is
//! done.
//!
//! The tensors of one message share a [`ReceivedLease`]. When the last of them drops, the message
//! is released (in a `Release` frame shared with others, see `protocol::Owed` and `peer.rs`): at
//! once if the streams they were ordered on are idle, else
//! through the process's release thread. The dropping thread only queues the release; the release
//! thread records one event per stream for everything queued together (covering the work queued
//! before each drop, and perhaps a little after, which only returns the memory later), waits for
//! it, and sends one frame per sender. It stays awake briefly after each batch, so a consumer that
//! streams messages pays neither a driver call nor a thread wake-up per message. It also retries
//! the writes to senders whose sockets were full (see `peer.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ipc_core::{Event, Stream};

use super::peer::Peer;
use crate::fences::{Fences, failed};
use crate::sync::lock;
use crate::tensor::Lease;

/// Held by the storage of every tensor of one received message; returns the message to its
/// sender when the last of them drops (one release per message, not per tensor).
pub(crate) struct ReceivedLease {
    pub(crate) peer: Arc<Peer>,
    pub(crate) seq: u64,
    /// The streams the message's GPU tensors were ordered on.
    pub(crate) streams: Vec<Arc<Stream>>,
    /// The producer's fences the message waited for (shared with tensors copied out of it).
    pub(crate) fences: Fences,
}

impl Lease for ReceivedLease {
    fn producer_failed(&self) -> bool {
        failed(&self.fences)
    }
}

impl Drop for ReceivedLease {
    fn drop(&mut self) {
        // The common case for a single hand-off: the receiver's work on the tensors is done.
        if self.streams.iter().all(|s| s.is_idle().unwrap_or(false)) {
            return self.peer.release([self.seq]);
        }
        let streams = std::mem::take(&mut self.streams);
        let fences = self.fences.clone();
        Releaser::get().push(PendingRelease { peer: self.peer.clone(), seq: self.seq, streams, _fences: fences });
    }
}

/// A message to release once the work queued on its streams is done.
struct PendingRelease {
    peer: Arc<Peer>,
    seq: u64,
    streams: Vec<Arc<Stream>>,
    /// Kept so their producers stay watched: if one dies, its fences are released, and so the
    /// streams this release waits for.
    _fences: Fences,
}

/// How often the release thread retries writing to senders whose sockets were full.
const RETRY_STALLED: Duration = Duration::from_millis(2);

/// How long releases wait for company before the release thread writes them (see
/// `protocol::Owed`): while messages stream, more come within microseconds and share the frame;
/// once they stop, the sender hears of the last ones this much later.
const FLUSH_DEFERRED: Duration = Duration::from_micros(200);

/// How long the release thread polls an event without sleeping: most release events complete
/// within microseconds, and a sleeping wake-up took 340 us (p50) on an H200 (`tq-bench` breakdown).
const EVENT_POLL: Duration = Duration::from_micros(500);

/// How long the release thread looks for more work after a batch before it sleeps: while
/// messages stream, the next release comes within microseconds, and waking a sleeping thread
/// would cost the dropping thread a system call.
const STAY_AWAKE: Duration = Duration::from_micros(200);

/// At most this many releases are handled together, so that a steady stream of new ones cannot
/// hold back those already done.
const MAX_BATCH: usize = 256;

/// The process's release thread and its queue.
pub(crate) struct Releaser {
    queue: Mutex<Queue>,
    /// Releases queued, readable without the lock (the awake thread watches it).
    queued: AtomicUsize,
    wake: Condvar,
}

#[derive(Default)]
struct Queue {
    pending: Vec<PendingRelease>,
    /// Senders with frames waiting for room in their sockets.
    stalled: Vec<Arc<Peer>>,
    /// Senders with releases waiting for company, to write after [`FLUSH_DEFERRED`].
    deferred: Vec<Arc<Peer>>,
    sleeping: bool,
}

impl Releaser {
    pub(crate) fn get() -> &'static Releaser {
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

    /// Retries `peer`'s writes until its outbox is empty (or the peer is gone).
    fn retry(&self, peer: Arc<Peer>) {
        let mut queue = lock(&self.queue);
        queue.stalled.push(peer);
        if queue.sleeping {
            self.wake.notify_one();
        }
    }

    /// Writes `peer`'s releases after [`FLUSH_DEFERRED`] (unless something else writes them first).
    fn defer(&self, peer: Arc<Peer>) {
        let mut queue = lock(&self.queue);
        queue.deferred.push(peer);
        if queue.sleeping {
            self.wake.notify_one();
        }
    }

    fn push(&self, pending: PendingRelease) {
        let mut queue = lock(&self.queue);
        queue.pending.push(pending);
        self.queued.fetch_add(1, Ordering::Release);
        if queue.sleeping {
            self.wake.notify_one();
        }
    }

    /// The next releases: what is queued now (at most [`MAX_BATCH`]). With `wait`, waits for
    /// some (retrying stalled peers meanwhile); else returns at once, perhaps with none.
    fn next_batch(&self, wait: bool) -> Vec<PendingRelease> {
        if wait {
            let awake_until = Instant::now() + STAY_AWAKE;
            while self.queued.load(Ordering::Acquire) == 0 && Instant::now() < awake_until {
                std::hint::spin_loop();
            }
        }
        let mut queue = lock(&self.queue);
        queue.sleeping = wait;
        while wait && queue.pending.is_empty() {
            if queue.stalled.is_empty() && queue.deferred.is_empty() {
                queue = self.wake.wait(queue).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            let pause = if queue.deferred.is_empty() { RETRY_STALLED } else { FLUSH_DEFERRED };
            queue = self.wake.wait_timeout(queue, pause).unwrap_or_else(|e| e.into_inner()).0;
            drop(queue);
            self.retry_stalled();
            queue = lock(&self.queue);
        }
        queue.sleeping = false;
        let count = queue.pending.len().min(MAX_BATCH);
        self.queued.fetch_sub(count, Ordering::Relaxed);
        queue.pending.drain(..count).collect()
    }

    /// Writes what stalled and deferred peers owe, where their sockets have room now. Without
    /// the queue's lock: a flush takes the peer's outbox lock, under which `retry` takes the
    /// queue's.
    fn retry_stalled(&self) {
        let (mut stalled, deferred) = {
            let mut queue = lock(&self.queue);
            (std::mem::take(&mut queue.stalled), std::mem::take(&mut queue.deferred))
        };
        stalled.extend(deferred);
        if stalled.is_empty() {
            return;
        }
        let still: Vec<Arc<Peer>> = stalled.into_iter().filter(|peer| !peer.flush()).collect();
        lock(&self.queue).stalled.extend(still);
    }

    /// Batches whose events are recorded are polled, never waited on: a stream held up for long
    /// (a consumer's long kernel, a producer that died with work queued) must not hold up the
    /// releases of every other message of the process.
    fn run(&self) {
        // Events, reused: creating one per batch costs more than the hand-off.
        let mut pool: Vec<Event> = Vec::new();
        let mut in_flight: Vec<InFlight> = Vec::new();
        loop {
            let batch = self.next_batch(in_flight.is_empty());
            if !batch.is_empty() {
                in_flight.push(InFlight { events: record_all(&mut pool, &batch), batch, since: Instant::now() });
            }
            let mut waiting = Vec::new();
            let mut done: Vec<PendingRelease> = Vec::new();
            for entry in in_flight.drain(..) {
                if entry.events.iter().all(|event| event.is_complete().unwrap_or(true)) {
                    pool.extend(entry.events);
                    done.extend(entry.batch);
                } else {
                    waiting.push(entry);
                }
            }
            in_flight = waiting;
            let mut frames: Vec<(Arc<Peer>, Vec<u64>)> = Vec::new();
            for pending in done {
                match frames.iter_mut().find(|(peer, _)| Arc::ptr_eq(peer, &pending.peer)) {
                    Some((_, seqs)) => seqs.push(pending.seq),
                    None => frames.push((pending.peer, vec![pending.seq])),
                }
            }
            for (peer, seqs) in frames {
                peer.release(seqs);
            }
            self.retry_stalled();
            // Most release events complete within microseconds: poll those at once, and sleep
            // between polls of the ones that take longer.
            match in_flight.iter().map(|entry| entry.since.elapsed()).min() {
                Some(age) if age < EVENT_POLL => std::thread::yield_now(),
                Some(_) => std::thread::sleep(SLOW_POLL),
                None => {}
            }
        }
    }
}

/// Releases whose streams' events are recorded, waiting for them to complete.
struct InFlight {
    events: Vec<Event>,
    batch: Vec<PendingRelease>,
    since: Instant,
}

/// How often events that did not complete within [`EVENT_POLL`] are polled.
const SLOW_POLL: Duration = Duration::from_micros(200);

/// One event per stream of `batch`, recorded after the work queued on it so far.
fn record_all(pool: &mut Vec<Event>, batch: &[PendingRelease]) -> Vec<Event> {
    let mut streams: Vec<&Arc<Stream>> = Vec::new();
    for stream in batch.iter().flat_map(|pending| &pending.streams) {
        if !streams.iter().any(|s| Arc::ptr_eq(s, stream)) {
            streams.push(stream);
        }
    }
    let mut used = Vec::with_capacity(streams.len());
    for stream in streams {
        match record(pool, stream) {
            Ok(event) => used.push(event),
            Err(error) => {
                tracing::warn!(%error, "could not record a release event; synchronising the stream");
                let _ = stream.synchronize();
            }
        }
    }
    used
}

/// An event recorded on `stream`, from the pool where one of its context is free.
fn record(pool: &mut Vec<Event>, stream: &Stream) -> ipc_core::Result<Event> {
    let event = match pool.iter().position(|event| Arc::ptr_eq(event.context(), stream.context())) {
        Some(at) => pool.swap_remove(at),
        None => Event::new(stream.context())?,
    };
    event.record(stream)?;
    Ok(event)
}

/// Hands a peer whose releases wait for company to the release thread, which writes them soon
/// (after [`FLUSH_DEFERRED`]): what a [`Peer`] calls when it defers them.
pub(crate) fn flush_later(peer: Arc<Peer>) {
    Releaser::get().defer(peer);
}

/// Hands a peer whose socket was full to the release thread, which retries its writes until its
/// outbox is empty (or the peer is gone): what a [`Peer`] calls when it stalls.
pub(crate) fn retry_stalled(peer: Arc<Peer>) {
    Releaser::get().retry(peer);
}
