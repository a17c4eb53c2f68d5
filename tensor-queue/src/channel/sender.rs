//! The sending end: leases, credits, fences, chunk and event announcements.

use std::collections::{HashMap, HashSet, VecDeque};
use std::marker::PhantomData;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering as Atomic};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ipc_core::seqpacket::Connection;
use ipc_core::{Event, Stream};
use serde::Serialize;

use super::{Link, lock, monotonic_ns};
use crate::arena::{Chunk, RetireListener, Shared};
use crate::signal::{Signal, signal_after};
use crate::tensor::Storage;
use crate::wire::{ChunkKind, Fence, Frame, MAX_FRAME, TensorDesc};
use crate::{Error, Result, Tensor, side_table};

/// An interprocess event of one connection, exported once.
struct EventSlot {
    id: u32,
    event: Event,
}

/// What the sender keeps for one hand-off until the receiver releases it.
struct Lease {
    storage: Arc<Storage>,
}

#[derive(Default)]
struct SenderState {
    credits: u32,
    announced: HashSet<u64>,
    leases: HashMap<u64, Lease>,
    free_events: Vec<EventSlot>,
    /// Per message sent and not yet covered by a credit, oldest first: its event, if it has one.
    /// A credit means the receiver took the message and so already queued its wait on the
    /// event; only then may the event be recorded again. The pool thus stays within the capacity.
    untaken: VecDeque<Option<EventSlot>>,
    next_event: u32,
    next_lease: u64,
    seq: u64,
    /// Whether the receiver's `Hello` was read: until then only the reader thread reads.
    greeted: bool,
    disconnected: bool,
    /// Leases removed from `leases` whose storage is still being dropped (which may retire a
    /// chunk): still outstanding, so that nothing is announced before the retirement is sent.
    dropping: usize,
}

struct SenderInner {
    link: Link,
    state: Mutex<SenderState>,
    changed: Condvar,
    me: std::sync::Weak<SenderInner>,
    /// How long a send without credits reads the socket itself before it sleeps, in ns.
    spin_ns: AtomicU64,
    /// The buffer a spinning send reads frames into.
    spin_buf: Mutex<Vec<u8>>,
}

impl RetireListener for SenderInner {
    fn retire(&self, chunk: u64) {
        lock(&self.state).announced.remove(&chunk);
        let _ = self.link.send(&Frame::Retire { chunk }, &[]);
    }
}

/// The sending end of a typed channel to one receiver.
///
/// `Sender` is `Sync`: threads may share one. Dropping it closes the sending direction; the
/// connection stays open until the receiver has released every tensor it still holds.
pub struct Sender<T> {
    inner: Arc<SenderInner>,
    _message: PhantomData<fn(&T)>,
}

impl<T: Serialize> Sender<T> {
    /// Connects to the receiver listening at `path`.
    pub fn connect(path: impl AsRef<Path>) -> Result<Sender<T>> {
        Sender::from_connection(Connection::connect(path)?)
    }

    /// A sender over an already connected socket (see [`spawn`](super::spawn)).
    pub fn from_connection(connection: Connection) -> Result<Sender<T>> {
        let link = Link::new(connection)?;
        link.hello(0)?;
        let inner = Arc::new_cyclic(|me| SenderInner {
            link,
            // No credits until the receiver's Hello says how many: until then the receiver is
            // not receiving, which is what a full queue means too.
            state: Mutex::new(SenderState { next_lease: 1, ..Default::default() }),
            changed: Condvar::new(),
            me: me.clone(),
            spin_ns: AtomicU64::new(0),
            spin_buf: Mutex::new(Vec::new()),
        });
        let reader = inner.clone();
        std::thread::Builder::new()
            .name("tq-sender-reader".into())
            .spawn(move || reader.read_releases())
            .map_err(|e| Error::Protocol(format!("spawning the reader thread: {e}")))?;
        Ok(Sender { inner, _message: PhantomData })
    }

    /// Sends `message`. GPU tensors in it must be complete: their devices are synchronised first
    /// (a CPU stall); use [`Sender::send_on`] to avoid it.
    pub fn send(&self, message: &T) -> Result<()> {
        let outgoing = Outgoing::synchronized(message)?;
        self.inner.send_outgoing(&outgoing)
    }

    /// Sends `message` whose GPU tensors were produced by work queued on `stream`; the receiver's
    /// first use is ordered after that work, and no CPU waits.
    pub fn send_on(&self, message: &T, stream: &Stream) -> Result<()> {
        let outgoing = Outgoing::on_stream(message, stream)?;
        self.inner.send_outgoing(&outgoing)
    }

    /// Makes a send that finds no credit left read the receiver's credits and releases itself,
    /// without sleeping, for up to `spin` before it waits for the reader thread.
    ///
    /// Credits come back through a socket read by a thread that sleeps in the kernel, and a
    /// sleeping sender is woken by that thread in turn: two wake-ups between the receiver taking
    /// messages and the sender going on, which bound a streaming producer's rate (`BENCHMARKS.md`).
    /// Spinning costs a busy core while the queue is full. Zero (the default) never spins.
    pub fn set_spin(&self, spin: Duration) {
        self.inner.spin_ns.store(spin.as_nanos().min(u64::MAX as u128) as u64, Atomic::Relaxed);
    }

    /// Hand-offs the receiver still holds.
    pub fn outstanding_leases(&self) -> usize {
        let state = lock(&self.inner.state);
        state.leases.len() + state.dropping
    }

    /// Whether the receiver is still there.
    pub fn is_connected(&self) -> bool {
        !lock(&self.inner.state).disconnected
    }

    /// The receiver's process id.
    pub fn peer_pid(&self) -> u32 {
        self.inner.link.peer_pid
    }
}

fn synchronize_devices(tensors: &[Tensor]) -> Result<()> {
    let mut done = Vec::new();
    for tensor in tensors {
        if let Some(memory) = tensor.storage.chunk.device() {
            let context = memory.context();
            if !done.contains(&context.device().ordinal()) {
                context.synchronize()?;
                done.push(context.device().ordinal());
            }
        }
    }
    Ok(())
}

/// A message encoded once, with what orders its receivers after the producer's work: the same
/// for one receiver or for every receiver of a broadcast.
struct Outgoing<'a> {
    sent_ns: u64,
    payload: Vec<u8>,
    tensors: Vec<Tensor>,
    fencing: Fencing<'a>,
}

/// How the receivers' first use of the GPU tensors is ordered after the producer's work.
enum Fencing<'a> {
    /// Nothing to wait for: no GPU tensors, or their devices were synchronised.
    Done,
    /// A signal word's write, queued once on the producer's stream, which every receiver waits for.
    Signal(Signal),
    /// An interprocess event of each connection, recorded on the stream when sent (the fallback).
    Event(&'a Stream),
}

impl<'a> Outgoing<'a> {
    fn encode<T: Serialize>(message: &T) -> Result<(u64, Vec<u8>, Vec<Tensor>)> {
        let sent_ns = monotonic_ns();
        let (payload, tensors) = side_table::encode(message)?;
        for tensor in &tensors {
            tensor.touched_bytes()?;
        }
        Ok((sent_ns, payload, tensors))
    }

    /// `message` with its GPU tensors' devices synchronised (a CPU stall).
    fn synchronized<T: Serialize>(message: &T) -> Result<Outgoing<'a>> {
        let (sent_ns, payload, tensors) = Outgoing::encode(message)?;
        synchronize_devices(&tensors)?;
        Ok(Outgoing { sent_ns, payload, tensors, fencing: Fencing::Done })
    }

    /// `message` whose GPU tensors were produced by work queued on `stream`: a signal word where
    /// the device supports it and every GPU tensor is on the stream's device, else events.
    fn on_stream<T: Serialize>(message: &T, stream: &'a Stream) -> Result<Outgoing<'a>> {
        let (sent_ns, payload, tensors) = Outgoing::encode(message)?;
        let devices: Vec<i32> =
            tensors.iter().filter_map(|t| t.storage.chunk.device()).map(|m| m.context().device().ordinal()).collect();
        let ordinal = stream.context().device().ordinal();
        let fencing = if devices.is_empty() {
            Fencing::Done
        } else if devices.iter().all(|&d| d == ordinal)
            && let Some(signal) = signal_after(stream)?
        {
            Fencing::Signal(signal)
        } else {
            Fencing::Event(stream)
        };
        Ok(Outgoing { sent_ns, payload, tensors, fencing })
    }
}

impl SenderInner {
    /// Sends the chunk's descriptor or handle the first time this peer needs it.
    fn announce(&self, state: &mut SenderState, chunk: &Chunk) -> Result<()> {
        if state.announced.contains(&chunk.id) {
            return Ok(());
        }
        let device = chunk.device_uuid().unwrap_or_default().0;
        let (kind, legacy, fd) = match chunk.share()? {
            Shared::Fd(fd) if chunk.host().is_some() => (ChunkKind::Host, None, Some(fd)),
            Shared::Fd(fd) => (ChunkKind::Vmm, None, Some(fd)),
            Shared::Legacy(handle) => (ChunkKind::Legacy, Some(handle.to_bytes().to_vec()), None),
        };
        let frame = Frame::Chunk { id: chunk.id, len: chunk.len() as u64, kind, device, legacy };
        self.link.send(&frame, fd.as_slice())?;
        state.announced.insert(chunk.id);
        if kind == ChunkKind::Legacy {
            // Arena chunks live as long as the process; a user buffer may be freed and its
            // address reused, so the receiver must hear when it goes.
            let me: std::sync::Weak<dyn RetireListener> = self.me.clone();
            chunk.announced(me);
        }
        Ok(())
    }

    /// Sends an encoded message to this receiver: waits for a credit, announces what the receiver
    /// has not seen yet, and takes a lease per tensor.
    fn send_outgoing(&self, outgoing: &Outgoing) -> Result<()> {
        let mut state = lock(&self.state);
        if state.credits == 0 && state.greeted && !state.disconnected {
            drop(state);
            self.spin_for_credits();
            state = lock(&self.state);
        }
        while state.credits == 0 && !state.disconnected {
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        if state.disconnected {
            return Err(Error::Disconnected);
        }
        let (fence, event) = match &outgoing.fencing {
            Fencing::Done => (Fence::None, None),
            Fencing::Signal(signal) => {
                self.announce(&mut state, &signal.chunk)?;
                (Fence::Signal { chunk: signal.chunk.id, offset: signal.offset as u64, value: signal.value }, None)
            }
            Fencing::Event(stream) => {
                let slot = self.event_for(&mut state, stream)?;
                (Fence::Event(slot.id), Some(slot))
            }
        };
        let mut descriptors = Vec::with_capacity(outgoing.tensors.len());
        for tensor in &outgoing.tensors {
            self.announce(&mut state, &tensor.storage.chunk)?;
            let lease = state.next_lease;
            state.next_lease += 1;
            let storage = &tensor.storage;
            let on_device = storage.chunk.device().is_some();
            descriptors.push(TensorDesc {
                lease,
                chunk: storage.chunk.id,
                storage_offset: storage.offset as u64,
                storage_len: storage.len as u64,
                view_offset: tensor.offset() as u64,
                dtype: tensor.dtype(),
                fence: if on_device { fence } else { Fence::None },
                shape: tensor.shape().to_vec(),
                strides: tensor.strides().to_vec(),
            });
            state.leases.insert(lease, Lease { storage: storage.clone() });
        }
        state.seq += 1;
        let frame = Frame::Message {
            seq: state.seq,
            sent_ns: outgoing.sent_ns,
            encoded_ns: monotonic_ns(),
            tensors: descriptors,
            payload: outgoing.payload.clone(),
        };
        if let Err(error) = self.link.send(&frame, &[]) {
            let Frame::Message { tensors, .. } = frame else { unreachable!() };
            for desc in tensors {
                state.leases.remove(&desc.lease);
            }
            state.free_events.extend(event);
            return Err(error);
        }
        state.untaken.push_back(event);
        state.credits -= 1;
        Ok(())
    }

    /// A pooled interprocess event, recorded on `stream`.
    fn event_for(&self, state: &mut SenderState, stream: &Stream) -> Result<EventSlot> {
        let slot = match state.free_events.pop() {
            Some(slot) => slot,
            None => {
                let event = Event::interprocess(stream.context())?;
                let id = state.next_event;
                state.next_event += 1;
                let handle = event.export()?.to_bytes().to_vec();
                self.link.send(&Frame::Event { id, handle }, &[])?;
                EventSlot { id, event }
            }
        };
        if let Err(error) = slot.event.record(stream) {
            state.free_events.push(slot);
            return Err(error.into());
        }
        Ok(slot)
    }

    /// The reader thread: releases and credits until the receiver hangs up.
    fn read_releases(self: Arc<Self>) {
        let mut buf = vec![0u8; MAX_FRAME];
        match self.link.recv(&mut buf).and_then(|hello| match hello {
            Some((frame, _)) => Link::check_hello(&frame),
            None => Err(Error::Disconnected),
        }) {
            Ok(capacity) => {
                let mut state = lock(&self.state);
                state.credits = capacity;
                state.greeted = true;
                drop(state);
                self.changed.notify_all();
            }
            Err(error) => {
                tracing::warn!(%error, "the receiver's greeting failed");
                self.disconnect();
                return;
            }
        }
        loop {
            let frame = match self.link.recv(&mut buf) {
                Ok(Some((frame, _))) => frame,
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%error, "closing the connection to the receiver");
                    break;
                }
            };
            if !self.handle(frame) {
                break;
            }
        }
        self.disconnect();
    }

    /// Reads the receiver's frames on the sending thread while no credit is left, for up to the
    /// spin time: the reader thread may take some of them too, which is fine, since credits add
    /// up and releases are independent of each other.
    fn spin_for_credits(&self) {
        let spin = Duration::from_nanos(self.spin_ns.load(Atomic::Relaxed));
        if spin.is_zero() {
            return;
        }
        // One spinning thread is enough; others wait for it (or the reader thread) to see credits.
        let Ok(mut buf) = self.spin_buf.try_lock() else { return };
        let until = Instant::now() + spin;
        buf.resize(MAX_FRAME, 0);
        while Instant::now() < until && lock(&self.state).credits == 0 {
            match self.link.try_recv(&mut buf) {
                Ok(Some(Some((frame, _)))) => {
                    if !self.handle(frame) {
                        return self.disconnect(); // the reader thread then reads the hang-up
                    }
                }
                // A hang-up or an error: the reader thread sees it too and cleans up.
                Ok(Some(None)) | Err(_) => return,
                Ok(None) => std::hint::spin_loop(),
            }
        }
    }

    /// Handles a frame from the receiver: releases and credits. `false`: the frame was not one a
    /// receiver may send, and the connection must close.
    fn handle(&self, frame: Frame) -> bool {
        // Storage is dropped after the lock is let go: dropping a user buffer's chunk sends
        // a retire frame, which takes the lock.
        let mut released = Vec::new();
        let mut state = lock(&self.state);
        match frame {
            Frame::Release { leases } => {
                released.extend(leases.iter().filter_map(|id| state.leases.remove(id)).map(|l| l.storage));
            }
            Frame::Credit { count } => {
                state.credits = state.credits.saturating_add(count);
                for _ in 0..count {
                    if let Some(Some(slot)) = state.untaken.pop_front() {
                        state.free_events.push(slot);
                    }
                }
            }
            other => {
                tracing::warn!(?other, "unexpected frame from a receiver; closing");
                return false;
            }
        }
        state.dropping += released.len();
        drop(state);
        let count = released.len();
        drop(released);
        lock(&self.state).dropping -= count;
        self.changed.notify_all();
        true
    }

    /// The receiver is gone: everything it held comes back now (dropped outside the lock).
    fn disconnect(&self) {
        self.link.shutdown(rustix::net::Shutdown::Both);
        let mut state = lock(&self.state);
        state.disconnected = true;
        let released = std::mem::take(&mut state.leases);
        self.changed.notify_all();
        drop(state);
        drop(released);
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        // Close our direction only: the receiver may still hold tensors, and their releases
        // must still reach the reader thread before the memory can be reused.
        self.inner.link.shutdown(rustix::net::Shutdown::Write);
    }
}

/// One message to several receivers, without copies: each gets the same memory under its own
/// lease, and the memory is reused only when all have released it (the weight-sharing case).
pub struct Broadcast<T> {
    senders: Vec<Sender<T>>,
}

impl<T: Serialize> Broadcast<T> {
    /// A broadcast over these senders.
    pub fn new(senders: Vec<Sender<T>>) -> Broadcast<T> {
        Broadcast { senders }
    }

    /// The senders, one per receiver.
    pub fn senders(&self) -> &[Sender<T>] {
        &self.senders
    }

    /// Sends to every receiver; see [`Sender::send`]. Every receiver is tried; the first error is
    /// returned.
    pub fn send(&self, message: &T) -> Result<()> {
        let outgoing = Outgoing::synchronized(message)?;
        first_error(self.senders.iter().map(|s| s.inner.send_outgoing(&outgoing)))
    }

    /// Sends to every receiver; see [`Sender::send_on`]. The message is encoded once, and one
    /// signal-word write on `stream` orders every receiver.
    pub fn send_on(&self, message: &T, stream: &Stream) -> Result<()> {
        let outgoing = Outgoing::on_stream(message, stream)?;
        first_error(self.senders.iter().map(|s| s.inner.send_outgoing(&outgoing)))
    }
}

fn first_error(results: impl Iterator<Item = Result<()>>) -> Result<()> {
    let mut first = Ok(());
    for result in results {
        if first.is_ok() {
            first = result;
        }
    }
    first
}
