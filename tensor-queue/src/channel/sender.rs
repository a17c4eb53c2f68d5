//! The sending end: leases, credits, fences, chunk and event announcements.

use std::collections::{HashMap, HashSet, VecDeque};
use std::marker::PhantomData;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

use ipc_core::seqpacket::Connection;
use ipc_core::{Event, Stream};
use serde::Serialize;

use super::{Link, lock, monotonic_ns};
use crate::arena::{Chunk, RetireListener, Shared};
use crate::signal::signal_after;
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
        self.send_inner(message, None)
    }

    /// Sends `message` whose GPU tensors were produced by work queued on `stream`; the receiver's
    /// first use is ordered after that work, and no CPU waits.
    pub fn send_on(&self, message: &T, stream: &Stream) -> Result<()> {
        self.send_inner(message, Some(stream))
    }

    fn send_inner(&self, message: &T, stream: Option<&Stream>) -> Result<()> {
        let sent_ns = monotonic_ns();
        let (payload, tensors) = side_table::encode(message)?;
        for tensor in &tensors {
            tensor.touched_bytes()?;
        }
        let inner = &self.inner;
        let mut state = lock(&inner.state);
        while state.credits == 0 && !state.disconnected {
            state = inner.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        if state.disconnected {
            return Err(Error::Disconnected);
        }
        let has_device = tensors.iter().any(|t| t.storage.chunk.device().is_some());
        let (fence, event) = match (has_device, stream) {
            (true, Some(stream)) => inner.fence(&mut state, &tensors, stream)?,
            (true, None) => {
                synchronize_devices(&tensors)?;
                (Fence::None, None)
            }
            (false, _) => (Fence::None, None),
        };
        let mut descriptors = Vec::with_capacity(tensors.len());
        for tensor in &tensors {
            inner.announce(&mut state, &tensor.storage.chunk)?;
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
        let frame =
            Frame::Message { seq: state.seq, sent_ns, encoded_ns: monotonic_ns(), tensors: descriptors, payload };
        if let Err(error) = inner.link.send(&frame, &[]) {
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

    /// Marks the end of the work queued on `stream` so far for the receiver: a signal word where
    /// the device supports it and every GPU tensor is on the stream's device, else an event.
    fn fence(
        &self,
        state: &mut SenderState,
        tensors: &[Tensor],
        stream: &Stream,
    ) -> Result<(Fence, Option<EventSlot>)> {
        let ordinal = stream.context().device().ordinal();
        let same_device =
            tensors.iter().filter_map(|t| t.storage.chunk.device()).all(|m| m.context().device().ordinal() == ordinal);
        if same_device && let Some(signal) = signal_after(stream)? {
            self.announce(state, &signal.chunk)?;
            let fence = Fence::Signal { chunk: signal.chunk.id, offset: signal.offset as u64, value: signal.value };
            return Ok((fence, None));
        }
        let slot = self.event_for(state, stream)?;
        Ok((Fence::Event(slot.id), Some(slot)))
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
                lock(&self.state).credits = capacity;
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
                    break;
                }
            }
            state.dropping += released.len();
            drop(state);
            let count = released.len();
            drop(released);
            lock(&self.state).dropping -= count;
            self.changed.notify_all();
        }
        self.disconnect();
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
        first_error(self.senders.iter().map(|s| s.send(message)))
    }

    /// Sends to every receiver; see [`Sender::send_on`].
    pub fn send_on(&self, message: &T, stream: &Stream) -> Result<()> {
        first_error(self.senders.iter().map(|s| s.send_on(message, stream)))
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
