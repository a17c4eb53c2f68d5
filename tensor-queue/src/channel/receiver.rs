//! The receiving end: its connections are polled by the thread that calls `recv`, so a message
//! goes from the socket to the caller with no hand-off between threads.

use std::collections::{HashMap, VecDeque};
use std::io::ErrorKind;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ipc_core::seqpacket::{Connection, Listener};
use ipc_core::{
    Context, Device, Event, ImportedIpcMemory, IpcEventHandle, IpcMemHandle, SharedMemory, Stream, Uuid, VmmAllocation,
};
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use serde::de::DeserializeOwned;

use super::release::{Peer, ReceivedLease};
use super::{DEFAULT_CAPACITY, Link, lock, monotonic_ns, skip_ordering};
use crate::arena::{Chunk, ChunkMemory};
use crate::tensor::Storage;
use crate::wire::{ChunkKind, Fence, Frame, FrameError, MAX_FRAME, TensorDesc};
use crate::{Error, Result, Tensor, TransferPath, side_table};

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
    /// When the receiver read the frame from the socket.
    pub arrived_ns: u64,
    /// When its tensors were mapped, validated and ordered on the receiver's stream.
    pub imported_ns: u64,
    /// When `recv` finished decoding the message.
    pub decoded_ns: u64,
}

/// The receiver's state for one connection.
struct Connected {
    peer: Arc<Peer>,
    /// Whether its `Hello` arrived.
    greeted: bool,
    chunks: HashMap<u64, Arc<Chunk>>,
    events: HashMap<u32, Arc<Event>>,
    /// Messages taken since credits were last returned.
    taken: u32,
}

/// A validated message waiting for `recv`.
struct Ready {
    peer: Arc<Peer>,
    tensors: Vec<Tensor>,
    payload: Vec<u8>,
    info: MessageInfo,
}

/// Per-device context and stream on which received GPU tensors are ordered.
#[derive(Default)]
struct Devices(Mutex<Vec<DeviceStream>>);

/// A device, its primary context, and the stream received tensors of it are ordered on.
type DeviceStream = (Uuid, Arc<Context>, Arc<Stream>);

impl Devices {
    fn get(&self, uuid: &Uuid) -> Result<(Arc<Context>, Arc<Stream>)> {
        let mut devices = lock(&self.0);
        if let Some((_, context, stream)) = devices.iter().find(|(u, _, _)| u == uuid) {
            return Ok((context.clone(), stream.clone()));
        }
        let context = Context::primary(Device::by_uuid(uuid)?)?;
        let stream = Arc::new(Stream::new(&context)?);
        devices.push((*uuid, context.clone(), stream.clone()));
        Ok((context, stream))
    }

    fn set(&self, stream: Arc<Stream>) -> Result<()> {
        let uuid = stream.context().device().uuid()?;
        let mut devices = lock(&self.0);
        devices.retain(|(u, _, _)| *u != uuid);
        devices.push((uuid, stream.context().clone(), stream));
        Ok(())
    }
}

/// A bound receiver's accept thread, which sets up new connections (user check, `Hello`) so that
/// senders can start before the first `recv`, and hands each to `recv` over `doorbell`.
struct Acceptor {
    path: std::path::PathBuf,
    doorbell: Connection,
    closed: Arc<AtomicBool>,
}

impl Acceptor {
    fn start(listener: Listener, capacity: u32) -> Result<Acceptor> {
        let (doorbell, bell) = Connection::pair()?;
        let closed = Arc::new(AtomicBool::new(false));
        let path = listener.path().to_path_buf();
        let stop = closed.clone();
        std::thread::Builder::new()
            .name("tq-accept".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let connection = match listener.accept(Some(Duration::from_millis(100))) {
                        Ok(connection) => connection,
                        Err(ipc_core::Error::Os { source, .. }) if source.kind() == ErrorKind::TimedOut => continue,
                        Err(error) => {
                            tracing::warn!(%error, "accept failed");
                            continue;
                        }
                    };
                    // A refused peer is dropped here; `recv` re-checks the user of every socket.
                    let greeted = Link::new(connection).and_then(|link| link.hello(capacity).map(|()| link));
                    match greeted {
                        Ok(link) => {
                            if bell.send(b"c", &[link.connection.as_fd()]).is_err() {
                                return; // the receiver is gone
                            }
                        }
                        Err(error) => tracing::warn!(%error, "refused a connection"),
                    }
                }
            })
            .map_err(|e| Error::Protocol(format!("spawning the accept thread: {e}")))?;
        Ok(Acceptor { path, doorbell, closed })
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

/// The receiving end of a typed channel; any number of senders may connect.
pub struct Receiver<T> {
    acceptor: Option<Acceptor>,
    connected: Vec<Connected>,
    ready: VecDeque<Ready>,
    devices: Devices,
    capacity: u32,
    errors: Vec<String>,
    /// Whether any sender ever said hello.
    joined: bool,
    /// How long `recv` polls without sleeping before it blocks (zero: it blocks at once).
    spin: Duration,
    buf: Vec<u8>,
    _message: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> Receiver<T> {
    /// Listens at `path` with the default capacity per sender.
    pub fn bind(path: impl AsRef<Path>) -> Result<Receiver<T>> {
        Receiver::bind_with_capacity(path, DEFAULT_CAPACITY)
    }

    /// Listens at `path`; each sender may have `capacity` messages not yet received.
    pub fn bind_with_capacity(path: impl AsRef<Path>, capacity: u32) -> Result<Receiver<T>> {
        let mut receiver = Receiver::new(capacity);
        receiver.acceptor = Some(Acceptor::start(Listener::bind(path)?, receiver.capacity)?);
        Ok(receiver)
    }

    /// A receiver over an already connected socket (see [`super::from_parent`]).
    pub fn from_connection(connection: Connection, capacity: u32) -> Result<Receiver<T>> {
        let mut receiver = Receiver::new(capacity);
        let link = Link::new(connection)?;
        link.hello(receiver.capacity)?;
        receiver.adopt(link);
        Ok(receiver)
    }

    fn new(capacity: u32) -> Receiver<T> {
        Receiver {
            acceptor: None,
            connected: Vec::new(),
            ready: VecDeque::new(),
            devices: Devices::default(),
            capacity: capacity.max(1),
            errors: Vec::new(),
            joined: false,
            spin: Duration::ZERO,
            buf: vec![0; MAX_FRAME],
            _message: PhantomData,
        }
    }

    /// Where senders connect, for a bound receiver.
    pub fn path(&self) -> Option<&Path> {
        self.acceptor.as_ref().map(|acceptor| acceptor.path.as_path())
    }

    /// Makes `recv` poll its sockets without sleeping for up to `spin` before it blocks.
    ///
    /// A blocked `recv` is woken by the kernel, which costs a few microseconds per message (the
    /// socket floor in `BENCHMARKS.md`); spinning takes that off the hand-off's latency at the
    /// price of a busy CPU core while waiting, as iceoryx2's busy-wait mode does. Zero (the
    /// default) never spins.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
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
            if let Some(ready) = self.ready.pop_front() {
                return self.deliver(ready);
            }
            if self.connected.is_empty() && (self.joined || self.acceptor.is_none()) {
                // Connections the accept thread already took may be waiting at the doorbell.
                if self.acceptor.is_some() && self.pump(Some(Duration::ZERO))? {
                    continue;
                }
                return Err(Error::Disconnected);
            }
            if !self.spin.is_zero() && timeout != Some(Duration::ZERO) && self.spin_until_readable(deadline)? {
                continue;
            }
            let wait = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if !self.pump(wait)? {
                return Err(if timeout == Some(Duration::ZERO) { Error::Empty } else { Error::Timeout });
            }
        }
    }

    fn deliver(&mut self, ready: Ready) -> Result<(T, MessageInfo)> {
        let Ready { peer, tensors, payload, mut info } = ready;
        // Credits go back in batches of half the capacity, keeping a frame off most hand-offs.
        if let Some(connected) = self.connected.iter_mut().find(|c| Arc::ptr_eq(&c.peer, &peer)) {
            connected.taken += 1;
            if connected.taken >= self.capacity.div_ceil(2) {
                let _ = peer.link.send(&Frame::Credit { count: connected.taken }, &[]);
                connected.taken = 0;
            }
        }
        let message = side_table::decode(&payload, tensors)?;
        info.decoded_ns = monotonic_ns();
        Ok((message, info))
    }

    /// Errors of connections that were closed (bad frames, refused peers), oldest first.
    pub fn take_errors(&mut self) -> Vec<String> {
        if self.ready.is_empty() {
            // Read what is waiting, so errors of frames already sent are seen.
            let _ = self.pump(Some(Duration::ZERO));
        }
        std::mem::take(&mut self.errors)
    }

    /// The stream received GPU tensors of `device` are ordered on (made on first use).
    pub fn stream(&self, device: &Uuid) -> Result<Arc<Stream>> {
        Ok(self.devices.get(device)?.1)
    }

    /// Orders GPU tensors of `stream`'s device on `stream` from now on.
    pub fn set_stream(&self, stream: Arc<Stream>) -> Result<()> {
        self.devices.set(stream)
    }

    /// Takes a connection whose `Hello` was sent.
    fn adopt(&mut self, link: Link) {
        self.connected.push(Connected {
            peer: Arc::new(Peer { link }),
            greeted: false,
            chunks: HashMap::new(),
            events: HashMap::new(),
            taken: 0,
        });
    }

    /// Looks for frames without sleeping for up to the spin time (or until `deadline`); whether
    /// anything was read.
    fn spin_until_readable(&mut self, deadline: Option<Instant>) -> Result<bool> {
        let start = Instant::now();
        let until = deadline.map_or(start + self.spin, |d| d.min(start + self.spin));
        loop {
            // A non-blocking read per connection: one system call per frame, where a zero-timeout
            // `poll` and then the read would be two.
            if self.read_connections(0..self.connected.len()) || self.accept_waiting()? {
                return Ok(true);
            }
            if Instant::now() >= until {
                return Ok(false);
            }
            std::hint::spin_loop();
        }
    }

    /// Waits up to `wait` (forever with `None`) for sockets to become readable and reads one frame
    /// from each that is. Returns whether anything was readable.
    fn pump(&mut self, wait: Option<Duration>) -> Result<bool> {
        let (listener_ready, readable) = {
            let mut fds = Vec::with_capacity(self.connected.len() + 1);
            if let Some(acceptor) = &self.acceptor {
                fds.push(PollFd::new(&acceptor.doorbell, PollFlags::IN));
            }
            for connected in &self.connected {
                fds.push(PollFd::new(&connected.peer.link.connection, PollFlags::IN));
            }
            let timespec = wait.map(Timespec::try_from).transpose().map_err(|_| Error::Invalid("timeout".into()))?;
            match poll(&mut fds, timespec.as_ref()) {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(Errno::INTR) => return Ok(true),
                Err(errno) => return Err(ipc_core::Error::Os { what: "poll", source: errno.into() }.into()),
            }
            let skip = usize::from(self.acceptor.is_some());
            let listener_ready = skip == 1 && !fds[0].revents().is_empty();
            let readable: Vec<usize> =
                fds[skip..].iter().enumerate().filter(|(_, fd)| !fd.revents().is_empty()).map(|(i, _)| i).collect();
            (listener_ready, readable)
        };
        self.read_connections(readable);
        if listener_ready {
            self.accept_waiting()?;
        }
        Ok(true)
    }

    /// Reads the next frame, if one is waiting, of each of these connections; closes those that
    /// hung up or sent something wrong. Whether any frame or hang-up was read.
    fn read_connections(&mut self, indexes: impl IntoIterator<Item = usize>) -> bool {
        let mut read = false;
        let mut closed = Vec::new();
        for index in indexes {
            match self.read_frame(index) {
                Ok(Some(true)) => read = true,
                Ok(Some(false)) => closed.push(index),
                Ok(None) => {}
                Err(error) => {
                    let connected = &self.connected[index];
                    let message = format!("closed the connection from pid {}: {error}", connected.peer.link.peer_pid);
                    tracing::warn!("{message}");
                    self.errors.push(message);
                    connected.peer.link.shutdown(rustix::net::Shutdown::Both);
                    closed.push(index);
                }
            }
        }
        read |= !closed.is_empty();
        for index in closed.into_iter().rev() {
            // Tensors received from it keep its socket open for their releases.
            self.connected.remove(index);
        }
        read
    }

    /// Adopts the connections the accept thread handed over, if any are waiting. Whether there
    /// were any.
    fn accept_waiting(&mut self) -> Result<bool> {
        let Some(acceptor) = &self.acceptor else { return Ok(false) };
        let Some((_, fds)) = acceptor.doorbell.try_recv(&mut [0u8; 1])? else { return Ok(false) };
        for fd in fds {
            match Link::new(Connection::from(fd)) {
                Ok(link) => self.adopt(link),
                Err(error) => self.errors.push(format!("refused a connection: {error}")),
            }
        }
        Ok(true)
    }

    /// Reads and handles the next frame of connection `index`, without sleeping (after `poll`
    /// the frame is there): `Some(true)` when one was read, `Some(false)` when the sender hung
    /// up, `None` when nothing was waiting.
    fn read_frame(&mut self, index: usize) -> Result<Option<bool>> {
        let connected = &mut self.connected[index];
        let Some(received) = connected.peer.link.try_recv(&mut self.buf)? else { return Ok(None) };
        let Some((frame, mut fds)) = received else {
            return Ok(Some(false));
        };
        let arrived_ns = monotonic_ns();
        if !connected.greeted {
            Link::check_hello(&frame)?;
            connected.greeted = true;
            self.joined = true;
            return Ok(Some(true));
        }
        match frame {
            Frame::Chunk { id, len, kind, device, legacy } => {
                let chunk = import_chunk(&self.devices, id, len as usize, kind, Uuid(device), legacy, fds.pop())?;
                connected.chunks.insert(id, chunk);
            }
            Frame::Event { id, handle } => {
                let event = Event::import(&IpcEventHandle::from_bytes(&handle)?)?;
                connected.events.insert(id, Arc::new(event));
            }
            Frame::Retire { chunk } => {
                connected.chunks.remove(&chunk);
            }
            Frame::Message { seq, sent_ns, encoded_ns, tensors, payload } => {
                let mut waited = Vec::new(); // one stream wait per fence and stream, not per tensor
                let placed = tensors
                    .iter()
                    .enumerate()
                    .map(|(index, desc)| place_tensor(connected, &self.devices, index, desc, &mut waited))
                    .collect::<Result<Vec<_>>>()?;
                let mut streams: Vec<Arc<Stream>> = Vec::new();
                for stream in placed.iter().filter_map(|p| p.stream.as_ref()) {
                    if !streams.iter().any(|s| Arc::ptr_eq(s, stream)) {
                        streams.push(stream.clone());
                    }
                }
                let ids = tensors.iter().map(|desc| desc.lease).collect();
                let lease = Arc::new(ReceivedLease { peer: connected.peer.clone(), ids, streams });
                let tensors = placed.into_iter().zip(&tensors).map(|(p, desc)| p.into_tensor(desc, &lease)).collect();
                let info = MessageInfo {
                    sender_pid: connected.peer.link.peer_pid,
                    seq,
                    sent_ns,
                    encoded_ns,
                    arrived_ns,
                    imported_ns: monotonic_ns(),
                    decoded_ns: 0,
                };
                self.ready.push_back(Ready { peer: connected.peer.clone(), tensors, payload, info });
            }
            other => return Err(Error::Protocol(format!("a sender sent {other:?}"))),
        }
        Ok(Some(true))
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        // Senders see the receiver go; tensors still held keep the write side for releases.
        for connected in &self.connected {
            connected.peer.link.shutdown(rustix::net::Shutdown::Read);
        }
    }
}

fn import_chunk(
    devices: &Devices,
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
            let (context, _) = devices.get(&device)?;
            let fd = fd.ok_or_else(missing_fd)?;
            ChunkMemory::ImportedVmm(VmmAllocation::import(&context, fd.as_fd().as_raw_fd(), len)?)
        }
        ChunkKind::Legacy => {
            let handle = IpcMemHandle::from_bytes(legacy.as_deref().unwrap_or_default())?;
            if handle.len() != len || handle.device() != device {
                return Err(Error::Protocol(format!("chunk {id}: the handle disagrees with the announcement")));
            }
            devices.get(&device)?; // keeps the device's context alive while mapped
            ChunkMemory::ImportedLegacy(ImportedIpcMemory::open(&handle)?)
        }
    };
    Chunk::with_id(id, memory)
}

/// A validated tensor descriptor: its chunk, and the stream its first use is ordered on.
struct Placed {
    chunk: Arc<Chunk>,
    path: TransferPath,
    stream: Option<Arc<Stream>>,
}

impl Placed {
    fn into_tensor(self, desc: &TensorDesc, lease: &Arc<ReceivedLease>) -> Tensor {
        let storage =
            Storage::received(self.chunk, desc.storage_offset as usize, desc.storage_len as usize, lease.clone());
        Tensor::from_parts(
            Arc::new(storage),
            desc.dtype,
            desc.shape.clone(),
            desc.strides.clone(),
            desc.view_offset as usize,
            self.path,
            self.stream,
        )
    }
}

/// Checks a descriptor against the connection's chunks and events, and orders the tensor's first
/// use on the receiver's stream after the producer's work.
fn place_tensor(
    connected: &Connected,
    devices: &Devices,
    index: usize,
    desc: &TensorDesc,
    waited: &mut Vec<(Fence, Arc<Stream>)>,
) -> Result<Placed> {
    let pid = connected.peer.link.peer_pid;
    let bad = |reason: String| Error::Frame { pid, source: FrameError::OutOfBounds { index, reason } };
    let chunk =
        connected.chunks.get(&desc.chunk).cloned().ok_or_else(|| bad(format!("unknown chunk {}", desc.chunk)))?;
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
        ChunkMemory::ImportedVmm(_) => (TransferPath::CudaVmm, Some(devices.get(&chunk_uuid(&chunk)?)?.1)),
        ChunkMemory::ImportedLegacy(_) => (TransferPath::CudaLegacyIpc, Some(devices.get(&chunk_uuid(&chunk)?)?.1)),
        _ => return Err(Error::Protocol("a local chunk in a peer's table".into())),
    };
    if let Some(stream) = &stream
        && desc.fence != Fence::None
        && !skip_ordering()
        && !waited.iter().any(|(fence, s)| *fence == desc.fence && Arc::ptr_eq(s, stream))
    {
        match desc.fence {
            Fence::None => {}
            Fence::Event(id) => {
                let event = connected.events.get(&id).ok_or_else(|| bad(format!("unknown event {id}")))?;
                stream.wait_event(event)?;
            }
            Fence::Signal { chunk: signal_chunk, offset, value } => {
                let signal = connected
                    .chunks
                    .get(&signal_chunk)
                    .ok_or_else(|| bad(format!("unknown signal chunk {signal_chunk}")))?;
                let memory =
                    signal.device().ok_or_else(|| bad(format!("signal chunk {signal_chunk} is host memory")))?;
                if signal.device_uuid() != chunk.device_uuid() {
                    return Err(bad(format!("signal chunk {signal_chunk} is on another device than the tensor")));
                }
                let offset = usize::try_from(offset).map_err(|_| bad(format!("signal offset {offset}")))?;
                stream.wait_value64(memory, offset, value).map_err(|e| match e {
                    ipc_core::Error::OutOfBounds { .. } | ipc_core::Error::InvalidArgument(_) => {
                        bad(format!("signal word {offset} of chunk {signal_chunk}: {e}"))
                    }
                    other => other.into(),
                })?;
            }
        }
        waited.push((desc.fence, stream.clone()));
    }
    Ok(Placed { chunk, path, stream })
}

fn chunk_uuid(chunk: &Chunk) -> Result<Uuid> {
    chunk.device_uuid().ok_or_else(|| Error::Protocol("a device chunk without a device".into()))
}
