//! Typed channels: [`Sender`], [`Receiver`], [`Broadcast`], and children started with a channel.
//!
//! # The hand-off
//! 1. `send` serialises the message; tensors go to the side table. A chunk the peer has not seen
//!    is announced first, with its descriptor (once per chunk and peer).
//! 2. For GPU tensors sent with [`Sender::send_on`], an interprocess event is recorded on the
//!    producer's stream; its handle was announced once, when the event was made.
//! 3. The message frame carries one descriptor per tensor: (lease, chunk, offset, length, dtype,
//!    shape, strides, event). The sender keeps the storage alive under that lease.
//! 4. The receiver's connection thread validates the frame, maps nothing new (chunks are cached),
//!    and queues `cuStreamWaitEvent` on the receiver's stream for the device: the consumer's first
//!    use is ordered after the producer's work, and neither CPU waits.
//! 5. When the receiver drops the last view of a tensor, an event is recorded on that stream;
//!    once it completes (the receiver's GPU work on the tensor is done), a release frame returns
//!    the lease. Host tensors are released at once.
//!
//! # Why interprocess events
//! Measured on an H200 (`cargo xtask gpu-bundle`, `primitive-costs`): waiting on an imported
//! interprocess event that is already complete, plus `cuStreamSynchronize`, costs 6.4 us p50 and
//! 13 us p99, and `cuEventRecord` 0.7 us; the wait itself is an asynchronous enqueue. `GPU.md`
//! reported 141 us for the same wait, which was not reproduced here. A wait on a stream memory
//! flag (7-8 us in `GPU.md`) needs a shared flag per message and a write kernel-side, and a
//! completion wait on the sender's side stalls its CPU. Events are exported once and reused from a
//! pool: an event returns to the pool only when every lease of its message is released, which is
//! after the receiver queued its wait, so a re-record can never be waited on by mistake.
//!
//! # Flow control and failure
//! A receiver grants each sender `capacity` messages; `send` blocks when they are used up and
//! resumes when the receiver takes messages out of its queue. A peer that dies closes its socket:
//! the survivor sees the hang-up at once. A dead receiver's leases return to the sender; a dead
//! sender's messages already queued are still delivered, then `recv` returns
//! [`Error::Disconnected`], and tensors already received stay valid (their memory lives while
//! mapped).

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use ipc_core::seqpacket::{Connection, Listener};
use ipc_core::{
    Context, Device, Event, HostId, ImportedIpcMemory, IpcEventHandle, IpcMemHandle, SharedMemory, Stream, Uuid,
    VmmAllocation,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::arena::{Chunk, ChunkMemory, RetireListener, Shared};
use crate::tensor::Storage;
use crate::wire::{ChunkKind, Frame, MAX_FRAME, TensorDesc};
use crate::{Error, Result, Tensor, TransferPath, side_table};

/// Messages a sender may have in flight to a receiver unless the receiver says otherwise.
pub const DEFAULT_CAPACITY: u32 = 16;

/// The environment variable through which [`spawn`] tells a child where its parent listens.
pub const ENDPOINT_ENV: &str = "TENSOR_QUEUE_ENDPOINT";

/// Test-only: when set to `1`, receivers skip the stream wait, so tests can prove that the
/// ordering they check is real (the seed test must fail with it).
pub const SKIP_ORDERING_ENV: &str = "TENSOR_QUEUE_TEST_SKIP_ORDERING";

fn skip_ordering() -> bool {
    static SKIP: OnceLock<bool> = OnceLock::new();
    *SKIP.get_or_init(|| std::env::var(SKIP_ORDERING_ENV).as_deref() == Ok("1"))
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A connected socket speaking frames.
struct Link {
    connection: Connection,
    peer_pid: u32,
}

impl Link {
    fn send(&self, frame: &Frame, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let bytes = frame.encode();
        if bytes.len() > MAX_FRAME {
            return Err(Error::Invalid(format!(
                "a {}-byte frame is over the {MAX_FRAME}-byte limit; put bulk data in tensors",
                bytes.len()
            )));
        }
        Ok(self.connection.send(&bytes, fds)?)
    }

    /// The next frame, or `None` when the peer hung up.
    fn recv(&self, buf: &mut [u8]) -> Result<Option<(Frame, Vec<OwnedFd>)>> {
        let (n, fds) = self.connection.recv(buf)?;
        if n == 0 {
            return Ok(None);
        }
        let frame = Frame::decode(&buf[..n]).map_err(|source| Error::Frame { pid: self.peer_pid, source })?;
        Ok(Some((frame, fds)))
    }

    fn shutdown(&self, how: rustix::net::Shutdown) {
        let _ = rustix::net::shutdown(&self.connection, how);
    }

    /// Exchanges `Hello`s: the peer must be the same user on the same machine. Returns the link
    /// and the capacity the peer granted.
    fn handshake(connection: Connection, capacity: u32) -> Result<(Link, u32)> {
        let credentials = connection.peer_credentials()?;
        let uid = rustix::process::getuid().as_raw();
        if credentials.uid != uid {
            return Err(Error::PeerRefused(format!(
                "pid {} runs as uid {}, not {uid}",
                credentials.pid, credentials.uid
            )));
        }
        let host = HostId::current()?;
        let link = Link { connection, peer_pid: credentials.pid as u32 };
        link.send(&Frame::Hello { pid: std::process::id(), host: host.0, capacity }, &[])?;
        link.connection.set_recv_timeout(Some(Duration::from_secs(30)))?;
        let mut buf = vec![0u8; 256];
        let reply = link.recv(&mut buf)?;
        link.connection.set_recv_timeout(None)?;
        match reply {
            Some((Frame::Hello { host: theirs, capacity, .. }, _)) if theirs == host.0 => Ok((link, capacity)),
            Some((Frame::Hello { .. }, _)) => Err(Error::PeerRefused("the peer runs on another machine".into())),
            Some(_) => Err(Error::Protocol("the first frame was not a Hello".into())),
            None => Err(Error::Disconnected),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sender
// ---------------------------------------------------------------------------------------------

/// An interprocess event of one connection, exported once.
struct EventSlot {
    id: u32,
    event: Event,
}

/// What the sender keeps for one hand-off until the receiver releases it.
struct Lease {
    storage: Arc<Storage>,
    event: Option<Arc<EventSlot>>,
}

#[derive(Default)]
struct SenderState {
    credits: u32,
    announced: HashSet<u64>,
    leases: HashMap<u64, Lease>,
    free_events: Vec<EventSlot>,
    next_event: u32,
    next_lease: u64,
    seq: u64,
    disconnected: bool,
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

    /// A sender over an already connected socket (see [`spawn`]).
    pub fn from_connection(connection: Connection) -> Result<Sender<T>> {
        let (link, capacity) = Link::handshake(connection, 0)?;
        let inner = Arc::new_cyclic(|me| SenderInner {
            link,
            state: Mutex::new(SenderState { credits: capacity, next_lease: 1, ..Default::default() }),
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
        let event = match (has_device, stream) {
            (true, Some(stream)) => Some(Arc::new(inner.event_for(&mut state, stream)?)),
            (true, None) => {
                synchronize_devices(&tensors)?;
                None
            }
            (false, _) => None,
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
                event: event.as_ref().filter(|_| on_device).map(|slot| slot.id),
                shape: tensor.shape().to_vec(),
                strides: tensor.strides().to_vec(),
            });
            let event = event.clone().filter(|_| on_device);
            state.leases.insert(lease, Lease { storage: storage.clone(), event });
        }
        state.seq += 1;
        let frame =
            Frame::Message { seq: state.seq, sent_ns, encoded_ns: monotonic_ns(), tensors: descriptors, payload };
        if let Err(error) = inner.link.send(&frame, &[]) {
            let Frame::Message { tensors, .. } = frame else { unreachable!() };
            for desc in tensors {
                state.leases.remove(&desc.lease);
            }
            return Err(error);
        }
        state.credits -= 1;
        Ok(())
    }

    /// Hand-offs the receiver still holds.
    pub fn outstanding_leases(&self) -> usize {
        lock(&self.inner.state).leases.len()
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
        let device = chunk.device_uuid()?.unwrap_or_default().0;
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
                    for id in leases {
                        let Some(lease) = state.leases.remove(&id) else { continue };
                        if let Some(slot) = lease.event.and_then(|slot| Arc::try_unwrap(slot).ok()) {
                            state.free_events.push(slot);
                        }
                        released.push(lease.storage);
                    }
                }
                Frame::Credit { count } => state.credits = state.credits.saturating_add(count),
                other => {
                    tracing::warn!(?other, "unexpected frame from a receiver; closing");
                    break;
                }
            }
            self.changed.notify_all();
            drop(state);
            drop(released);
        }
        self.link.shutdown(rustix::net::Shutdown::Both);
        let mut state = lock(&self.state);
        state.disconnected = true;
        // The receiver is gone: everything it held comes back now (dropped outside the lock).
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

// ---------------------------------------------------------------------------------------------
// Receiver
// ---------------------------------------------------------------------------------------------

/// The receiver's side of one sender's connection.
struct Peer {
    link: Link,
    chunks: Mutex<HashMap<u64, Arc<Chunk>>>,
    events: Mutex<HashMap<u32, Arc<Event>>>,
}

/// Held by each received tensor's storage; returns the lease when the storage drops.
pub(crate) struct ReceivedLease {
    peer: Arc<Peer>,
    id: u64,
    stream: Option<Arc<Stream>>,
}

impl Drop for ReceivedLease {
    fn drop(&mut self) {
        let Some(stream) = &self.stream else {
            let _ = self.peer.link.send(&Frame::Release { leases: vec![self.id] }, &[]);
            return;
        };
        // Release only once the receiver's GPU work on the tensor (queued on `stream`) is done.
        let event = Event::new(stream.context()).and_then(|event| event.record(stream).map(|()| event));
        match event {
            Ok(event) => releaser().send((self.peer.clone(), self.id, event)).unwrap_or(()),
            Err(error) => {
                tracing::warn!(%error, "could not record a release event; releasing after a stream sync");
                let _ = stream.synchronize();
                let _ = self.peer.link.send(&Frame::Release { leases: vec![self.id] }, &[]);
            }
        }
    }
}

/// The process's release thread: waits for each event, then returns the lease.
/// A lease to return once its event completes.
type PendingRelease = (Arc<Peer>, u64, Event);

fn releaser() -> mpsc::Sender<PendingRelease> {
    static RELEASER: OnceLock<Mutex<mpsc::Sender<PendingRelease>>> = OnceLock::new();
    lock(RELEASER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<PendingRelease>();
        std::thread::Builder::new()
            .name("tq-releaser".into())
            .spawn(move || {
                for (peer, id, event) in rx {
                    if let Err(error) = event.synchronize() {
                        tracing::warn!(%error, "waiting for a release event failed");
                    }
                    let _ = peer.link.send(&Frame::Release { leases: vec![id] }, &[]);
                }
            })
            .expect("spawning the release thread");
        Mutex::new(tx)
    }))
    .clone()
}

/// When and how a message arrived, on the machine's monotonic clock (nanoseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessageInfo {
    /// The sender's process id.
    pub sender_pid: u32,
    /// Sequence number on its connection.
    pub seq: u64,
    /// When the sender called `send`.
    pub sent_ns: u64,
    /// When the sender finished encoding (before the socket write).
    pub encoded_ns: u64,
    /// When the receiver's connection thread read the frame.
    pub arrived_ns: u64,
    /// When its tensors were mapped, validated and ordered on the receiver's stream.
    pub imported_ns: u64,
    /// When `recv` finished decoding the message.
    pub decoded_ns: u64,
}

enum Delivery {
    Joined,
    Message { peer: Arc<Peer>, tensors: Vec<Tensor>, payload: Vec<u8>, info: MessageInfo },
    Gone,
}

/// Per-device context and stream of a receiver.
struct DeviceSlot {
    uuid: Uuid,
    context: Arc<Context>,
    stream: Arc<Stream>,
}

struct ReceiverShared {
    capacity: u32,
    devices: Mutex<Vec<DeviceSlot>>,
    errors: Mutex<Vec<String>>,
    closed: AtomicBool,
}

/// The receiving end of a typed channel; any number of senders may connect.
pub struct Receiver<T> {
    shared: Arc<ReceiverShared>,
    queue: mpsc::Receiver<Delivery>,
    feed: mpsc::Sender<Delivery>,
    live: usize,
    joined: bool,
    path: Option<PathBuf>,
    _message: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> Receiver<T> {
    /// Listens at `path` with the default capacity per sender.
    pub fn bind(path: impl AsRef<Path>) -> Result<Receiver<T>> {
        Receiver::bind_with_capacity(path, DEFAULT_CAPACITY)
    }

    /// Listens at `path`; each sender may have `capacity` messages not yet received.
    pub fn bind_with_capacity(path: impl AsRef<Path>, capacity: u32) -> Result<Receiver<T>> {
        let listener = Listener::bind(path)?;
        let receiver = Receiver::new(capacity, Some(listener.path().to_path_buf()));
        let (shared, feed) = (receiver.shared.clone(), receiver.feed.clone());
        std::thread::Builder::new()
            .name("tq-accept".into())
            .spawn(move || {
                while !shared.closed.load(Ordering::Relaxed) {
                    match listener.accept(Some(Duration::from_millis(100))) {
                        Ok(connection) => spawn_peer(connection, shared.clone(), feed.clone()),
                        Err(ipc_core::Error::Os { source, .. }) if source.kind() == std::io::ErrorKind::TimedOut => {}
                        Err(error) => lock(&shared.errors).push(format!("accept failed: {error}")),
                    }
                }
            })
            .map_err(|e| Error::Protocol(format!("spawning the accept thread: {e}")))?;
        Ok(receiver)
    }

    /// A receiver over an already connected socket (see [`from_parent`]).
    pub fn from_connection(connection: Connection, capacity: u32) -> Result<Receiver<T>> {
        let receiver = Receiver::new(capacity, None);
        spawn_peer(connection, receiver.shared.clone(), receiver.feed.clone());
        Ok(receiver)
    }

    fn new(capacity: u32, path: Option<PathBuf>) -> Receiver<T> {
        let (feed, queue) = mpsc::channel();
        let shared = Arc::new(ReceiverShared {
            capacity: capacity.max(1),
            devices: Mutex::new(Vec::new()),
            errors: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        });
        Receiver { shared, queue, feed, live: 0, joined: false, path, _message: PhantomData }
    }

    /// Where senders connect, for a bound receiver.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Waits for the next message.
    ///
    /// Returns [`Error::Disconnected`] when no sender is connected any more (after at least one
    /// was) and every message they sent has been received. For a bound receiver this describes
    /// the moment: a new sender may still connect, and `recv` then waits for it again.
    pub fn recv(&mut self) -> Result<T> {
        self.recv_with_info(None).map(|(message, _)| message)
    }

    /// Waits up to `timeout` for the next message.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<T> {
        self.recv_with_info(Some(timeout)).map(|(message, _)| message)
    }

    /// The next message if one is waiting.
    pub fn try_recv(&mut self) -> Result<T> {
        self.recv_with_info(Some(Duration::ZERO)).map(|(message, _)| message)
    }

    /// The next message and when each stage of its hand-off happened.
    pub fn recv_with_info(&mut self, timeout: Option<Duration>) -> Result<(T, MessageInfo)> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let delivery = if self.joined && self.live == 0 {
                self.queue.try_recv().map_err(|_| Error::Disconnected)?
            } else {
                match deadline {
                    None => self.queue.recv().map_err(|_| Error::Disconnected)?,
                    Some(deadline) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        match self.queue.recv_timeout(left) {
                            Ok(delivery) => delivery,
                            Err(_) if left.is_zero() => return Err(Error::Empty),
                            Err(_) => return Err(Error::Timeout),
                        }
                    }
                }
            };
            match delivery {
                Delivery::Joined => {
                    self.joined = true;
                    self.live += 1;
                }
                Delivery::Gone => self.live -= 1,
                Delivery::Message { peer, tensors, payload, mut info } => {
                    let _ = peer.link.send(&Frame::Credit { count: 1 }, &[]);
                    let message = side_table::decode(&payload, tensors)?;
                    info.decoded_ns = monotonic_ns();
                    return Ok((message, info));
                }
            }
        }
    }

    /// Errors of connections that were closed (bad frames, refused peers), oldest first.
    pub fn take_errors(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.shared.errors))
    }

    /// The stream received GPU tensors of `device` are ordered on (made on first use).
    pub fn stream(&self, device: &Uuid) -> Result<Arc<Stream>> {
        Ok(self.shared.device_slot(device)?.1)
    }

    /// Orders GPU tensors of `stream`'s device on `stream` from now on.
    pub fn set_stream(&self, stream: Arc<Stream>) -> Result<()> {
        let uuid = stream.context().device().uuid()?;
        let mut devices = lock(&self.shared.devices);
        devices.retain(|slot| slot.uuid != uuid);
        devices.push(DeviceSlot { uuid, context: stream.context().clone(), stream });
        Ok(())
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Relaxed);
    }
}

impl ReceiverShared {
    fn device_slot(&self, uuid: &Uuid) -> Result<(Arc<Context>, Arc<Stream>)> {
        let mut devices = lock(&self.devices);
        if let Some(slot) = devices.iter().find(|slot| slot.uuid == *uuid) {
            return Ok((slot.context.clone(), slot.stream.clone()));
        }
        let context = Context::primary(Device::by_uuid(uuid)?)?;
        let stream = Arc::new(Stream::new(&context)?);
        devices.push(DeviceSlot { uuid: *uuid, context: context.clone(), stream: stream.clone() });
        Ok((context, stream))
    }
}

fn spawn_peer(connection: Connection, shared: Arc<ReceiverShared>, feed: mpsc::Sender<Delivery>) {
    let spawned = std::thread::Builder::new().name("tq-peer".into()).spawn(move || {
        let (link, _) = match Link::handshake(connection, shared.capacity) {
            Ok(handshake) => handshake,
            Err(error) => {
                lock(&shared.errors).push(format!("refused a connection: {error}"));
                return;
            }
        };
        let peer = Arc::new(Peer { link, chunks: Default::default(), events: Default::default() });
        let _ = feed.send(Delivery::Joined);
        if let Err(error) = read_messages(&peer, &shared, &feed) {
            let message = format!("closed the connection from pid {}: {error}", peer.link.peer_pid);
            tracing::warn!("{message}");
            lock(&shared.errors).push(message);
            peer.link.shutdown(rustix::net::Shutdown::Both);
        }
        let _ = feed.send(Delivery::Gone);
    });
    if let Err(error) = spawned {
        tracing::warn!(%error, "could not spawn a connection thread");
    }
}

/// The connection thread: frames until the sender hangs up (`Ok`) or misbehaves (`Err`).
fn read_messages(peer: &Arc<Peer>, shared: &ReceiverShared, feed: &mpsc::Sender<Delivery>) -> Result<()> {
    let mut buf = vec![0u8; MAX_FRAME];
    while let Some((frame, mut fds)) = peer.link.recv(&mut buf)? {
        let arrived_ns = monotonic_ns();
        match frame {
            Frame::Chunk { id, len, kind, device, legacy } => {
                let chunk = import_chunk(shared, id, len as usize, kind, Uuid(device), legacy, fds.pop())?;
                lock(&peer.chunks).insert(id, chunk);
            }
            Frame::Retire { chunk } => {
                lock(&peer.chunks).remove(&chunk);
            }
            Frame::Event { id, handle } => {
                let event = Event::import(&IpcEventHandle::from_bytes(&handle)?)?;
                lock(&peer.events).insert(id, Arc::new(event));
            }
            Frame::Message { seq, sent_ns, encoded_ns, tensors, payload } => {
                let tensors = tensors
                    .iter()
                    .enumerate()
                    .map(|(index, desc)| receive_tensor(peer, shared, index, desc))
                    .collect::<Result<Vec<_>>>()?;
                let info = MessageInfo {
                    sender_pid: peer.link.peer_pid,
                    seq,
                    sent_ns,
                    encoded_ns,
                    arrived_ns,
                    imported_ns: monotonic_ns(),
                    decoded_ns: 0,
                };
                let _ = feed.send(Delivery::Message { peer: peer.clone(), tensors, payload, info });
            }
            other => return Err(Error::Protocol(format!("a sender sent {other:?}"))),
        }
    }
    Ok(())
}

fn import_chunk(
    shared: &ReceiverShared,
    id: u64,
    len: usize,
    kind: ChunkKind,
    device: Uuid,
    legacy: Option<Vec<u8>>,
    fd: Option<OwnedFd>,
) -> Result<Arc<Chunk>> {
    let missing_fd = || Error::Protocol(format!("chunk {id} came without its descriptor"));
    let memory = match kind {
        ChunkKind::Host => ChunkMemory::ImportedHost(SharedMemory::from_fd(fd.ok_or_else(missing_fd)?, len)?),
        ChunkKind::Vmm => {
            let (context, _) = shared.device_slot(&device)?;
            let fd = fd.ok_or_else(missing_fd)?;
            ChunkMemory::ImportedVmm(VmmAllocation::import(&context, std::os::fd::AsRawFd::as_raw_fd(&fd), len)?)
        }
        ChunkKind::Legacy => {
            let handle = IpcMemHandle::from_bytes(legacy.as_deref().unwrap_or_default())?;
            if handle.len() != len || handle.device() != device {
                return Err(Error::Protocol(format!("chunk {id}: the handle disagrees with the announcement")));
            }
            shared.device_slot(&device)?; // keeps the device's context alive while mapped
            ChunkMemory::ImportedLegacy(ImportedIpcMemory::open(&handle)?)
        }
    };
    Ok(Chunk::with_id(id, memory))
}

fn receive_tensor(peer: &Arc<Peer>, shared: &ReceiverShared, index: usize, desc: &TensorDesc) -> Result<Tensor> {
    let bad = |reason: String| Error::Frame {
        pid: peer.link.peer_pid,
        source: crate::wire::FrameError::OutOfBounds { index, reason },
    };
    let chunk =
        lock(&peer.chunks).get(&desc.chunk).cloned().ok_or_else(|| bad(format!("unknown chunk {}", desc.chunk)))?;
    let end = desc.storage_offset + desc.storage_len; // no overflow: checked by Frame::decode
    if end > chunk.len() as u64 {
        return Err(bad(format!(
            "storage {}..{end} outside chunk {} of {} bytes",
            desc.storage_offset,
            desc.chunk,
            chunk.len()
        )));
    }
    let (path, stream) = match &chunk.memory {
        ChunkMemory::ImportedHost(_) => (TransferPath::HostSharedMemory, None),
        ChunkMemory::ImportedVmm(_) => (TransferPath::CudaVmm, Some(shared.device_slot(&chunk_uuid(&chunk)?)?.1)),
        ChunkMemory::ImportedLegacy(_) => {
            (TransferPath::CudaLegacyIpc, Some(shared.device_slot(&chunk_uuid(&chunk)?)?.1))
        }
        _ => return Err(Error::Protocol("a local chunk in a peer's table".into())),
    };
    if let (Some(stream), Some(event_id)) = (&stream, desc.event) {
        let event =
            lock(&peer.events).get(&event_id).cloned().ok_or_else(|| bad(format!("unknown event {event_id}")))?;
        if !skip_ordering() {
            stream.wait_event(&event)?;
        }
    }
    let lease = ReceivedLease { peer: peer.clone(), id: desc.lease, stream: stream.clone() };
    let storage = Storage::received(chunk, desc.storage_offset as usize, desc.storage_len as usize, lease);
    Ok(Tensor::from_parts(
        Arc::new(storage),
        desc.dtype,
        desc.shape.clone(),
        desc.strides.clone(),
        desc.view_offset as usize,
        path,
        stream,
    ))
}

fn chunk_uuid(chunk: &Chunk) -> Result<Uuid> {
    chunk.device_uuid()?.ok_or_else(|| Error::Protocol("a device chunk without a device".into()))
}

// ---------------------------------------------------------------------------------------------
// Children
// ---------------------------------------------------------------------------------------------

/// Starts `command` as a child with a channel to it: the child calls [`from_parent`] for the
/// receiving end. The child is a fresh process (`exec`), never a fork of this one, so this is safe
/// after CUDA is initialised.
pub fn spawn<T: Serialize>(command: &mut Command) -> Result<(Child, Sender<T>)> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("tensor-queue-{}-{n}.sock", std::process::id()));
    let listener = Listener::bind(&path)?;
    let mut child =
        command.env(ENDPOINT_ENV, &path).spawn().map_err(|e| Error::Invalid(format!("starting the child: {e}")))?;
    loop {
        match listener.accept(Some(Duration::from_millis(100))) {
            Ok(connection) => return Ok((child, Sender::from_connection(connection)?)),
            Err(ipc_core::Error::Os { source, .. }) if source.kind() == std::io::ErrorKind::TimedOut => {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(Error::Invalid(format!("the child exited ({status}) before connecting")));
                }
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// In a child started by [`spawn`]: the receiving end of the channel from the parent.
pub fn from_parent<T: DeserializeOwned>() -> Result<Receiver<T>> {
    let path = std::env::var_os(ENDPOINT_ENV).ok_or_else(|| {
        Error::Invalid(format!("{ENDPOINT_ENV} is not set: was this process started by tensor_queue::spawn?"))
    })?;
    Receiver::from_connection(Connection::connect(path)?, DEFAULT_CAPACITY)
}
