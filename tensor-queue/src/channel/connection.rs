//! A receiver's state for one sender's connection, and what each frame from it does: chunk and
//! event announcements, retirements, and messages, checked and ordered after the producer's work.
//!
//! A frame that cannot be trusted (it does not decode, breaks the protocol, or exceeds the
//! credits) closes the connection. A well-formed message that cannot be used here (it names a
//! chunk that could not be mapped, a GPU this process cannot see, a range outside its chunk) is
//! rejected alone: the sender hears why, `recv` reports it, and the connection goes on.

use std::collections::HashMap;
use std::sync::Arc;

use ipc_core::{Context, Device, Event, IpcEventHandle, Stream, Uuid};

use super::fences::{FenceWait, Producer, producer};
use super::imports::{Announced, import};
use super::link::{Link, Read};
use super::peer::Peer;
use super::release::{Fences, ReceivedLease};
use super::remote::{Remote, Wake};
use super::{lock, monotonic_ns};
use crate::arena::{Allocation, Chunk, ChunkMemory};
use crate::route::worker::Workers;
use crate::route::{self, Reach, Route, Routing};
use crate::tensor::Storage;
use crate::wire::{Assembler, Fence, Frame, FrameError, TensorDesc};
use crate::{Error, Result, Tensor, TransferPath};

/// When and how a message arrived, on the machine's monotonic clock (nanoseconds). From a
/// sender on another host (a TCP channel), `sent_ns` and `encoded_ns` are on that host's clock
/// and `sender_pid` is the pid it gave.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{Receiver, Sender};
/// # let path = std::env::temp_dir().join(format!("doc-{}-message-info.sock", std::process::id()));
/// # let mut receiver = Receiver::<u32>::bind(&path)?;
/// # let sender = Sender::<u32>::connect(&path)?;
/// sender.send(&1)?;
/// let (_, info) = receiver.recv_with_info(None)?;
/// // One clock for every process of the machine: the stages are in order, whoever sent.
/// assert!(info.sent_ns <= info.encoded_ns && info.encoded_ns <= info.arrived_ns);
/// assert!(info.arrived_ns <= info.imported_ns && info.imported_ns <= info.decoded_ns);
/// println!("in the socket: {} ns", info.arrived_ns - info.encoded_ns);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MessageInfo {
    /// The sender's process id.
    pub sender_pid: u32,
    /// This process's number for the sender's connection, unique for the life of the process:
    /// it tells apart several senders of one process (which share `sender_pid` and each number
    /// their messages from 1), and a sender that connected again. (`connection`, `seq`) names
    /// one message; so it does in [`crate::Error::Rejected`] and [`crate::Error::ProducerFailed`].
    pub connection: u64,
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

/// What reading a connection found.
pub(super) enum Progress {
    /// Nothing whole was waiting.
    Idle,
    /// A frame was read and handled (an announcement, a part of a longer frame).
    Handled,
    /// The sender's `Hello`: it has joined.
    Greeted,
    /// A message.
    Arrived(Arrival),
    /// The sender hung up.
    HungUp,
}

/// A message read from a connection, for `recv`.
pub(super) enum Arrival {
    /// Validated and ordered; ready to decode.
    Ready(Ready),
    /// Refused: the sender was told, and `recv` reports it.
    Rejected { pid: u32, connection: u64, seq: u64, reason: String },
}

/// A validated message waiting for `recv`.
pub(super) struct Ready {
    pub peer: Arc<Peer>,
    pub tensors: Vec<Tensor>,
    pub payload: Vec<u8>,
    pub info: MessageInfo,
    /// The producer's fences the message waits for: whether its producer failed.
    pub fences: Fences,
    /// Whether some are host words `recv` waits for on the CPU before delivering (host-route
    /// tensors; see `Receiver::must_park`).
    pub on_cpu: bool,
}

/// A sender's storage: (chunk, offset, length).
type StorageKey = (u64, u64, u64);

/// Where a tensor of a message was put.
enum Placed {
    /// The sender's memory, mapped.
    Mapped(Arc<Chunk>, TransferPath, Option<Arc<Stream>>),
    /// Copied into the message's `n`th landed storage, on the stream.
    Landed(usize, TransferPath, Arc<Stream>),
}

impl Placed {
    fn stream(&self) -> Option<&Arc<Stream>> {
        match self {
            Placed::Mapped(_, _, stream) => stream.as_ref(),
            Placed::Landed(_, _, stream) => Some(stream),
        }
    }
}

/// The contexts of the devices received tensors live on, the streams the user chose for them,
/// and where they should land.
pub(super) struct Devices {
    pub routing: Routing,
    contexts: std::sync::Mutex<Vec<(Uuid, Arc<Context>)>>,
    /// Streams set with `Receiver::set_stream`: every connection orders that device's tensors
    /// on it (and so one slow producer delays the others there, the user's choice).
    chosen: std::sync::Mutex<Vec<(Uuid, Arc<Stream>)>>,
    /// The workers of the NCCL communicators joined for senders on other hosts (`remote.rs`),
    /// waited for when the receiver is dropped.
    pub nccl_workers: Workers,
    /// How those workers tell `recv` that a parked message's receives are issued.
    pub nccl_wake: Wake,
}

impl Devices {
    pub fn new(routing: Routing) -> Result<Devices> {
        Ok(Devices {
            routing,
            contexts: Default::default(),
            chosen: Default::default(),
            nccl_workers: Workers::default(),
            nccl_wake: Wake::new()?,
        })
    }

    pub fn context(&self, uuid: &Uuid) -> Result<Arc<Context>> {
        let mut contexts = lock(&self.contexts);
        if let Some((_, context)) = contexts.iter().find(|(u, _)| u == uuid) {
            return Ok(context.clone());
        }
        let context = Context::primary(Device::by_uuid(uuid)?)?;
        contexts.push((*uuid, context.clone()));
        Ok(context)
    }

    pub fn choose(&self, stream: Arc<Stream>) -> Result<()> {
        let uuid = stream.context().device().uuid()?;
        let mut chosen = lock(&self.chosen);
        chosen.retain(|(u, _)| *u != uuid);
        chosen.push((uuid, stream));
        Ok(())
    }

    pub fn chosen(&self, uuid: &Uuid) -> Option<Arc<Stream>> {
        lock(&self.chosen).iter().find(|(u, _)| u == uuid).map(|(_, s)| s.clone())
    }
}

/// The receiver's state for one connection.
pub(super) struct Connected {
    pub peer: Arc<Peer>,
    assembler: Assembler,
    /// The sender's process, known once its `Hello` came.
    pub(super) producer: Option<(u64, Arc<Producer>)>,
    /// Chunks by the sender's id; those that could not be mapped, with why.
    pub(super) chunks: HashMap<u64, Arc<Chunk>>,
    refused: HashMap<u64, String>,
    events: HashMap<u32, Arc<Event>>,
    /// This connection's stream per device: waits for one sender's work never hold up another's.
    streams: Vec<(Uuid, Arc<Stream>)>,
    /// Messages read and not yet covered by a credit: never more than the capacity.
    uncredited: u32,
    /// Messages taken since credits were last returned.
    taken: u32,
    /// The sequence number of the last message read.
    last_seq: u64,
    /// For a sender on another host: its bytes and communicators.
    remote: Remote,
    /// When a packet last came: an unfinished message idle past `UNFINISHED_IDLE` is given up.
    last_packet: std::time::Instant,
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.remote.retire(self.peer.clone());
    }
}

impl Connected {
    pub fn new(link: Link) -> Connected {
        Connected {
            peer: Peer::new(link),
            assembler: Assembler::default(),
            producer: None,
            chunks: HashMap::new(),
            refused: HashMap::new(),
            events: HashMap::new(),
            streams: Vec::new(),
            uncredited: 0,
            taken: 0,
            last_seq: 0,
            remote: Remote::default(),
            last_packet: std::time::Instant::now(),
        }
    }

    /// The bytes of an unfinished message held for this sender (0: none is under way).
    pub fn unfinished(&self) -> usize {
        self.assembler.held() + self.remote.unfinished()
    }

    /// When the unfinished message held for this sender is given up if nothing more comes.
    pub fn unfinished_deadline(&self) -> Option<std::time::Instant> {
        (self.unfinished() > 0).then(|| self.last_packet + super::UNFINISHED_IDLE)
    }

    /// Why the connection ends with a message lost, if one was under way.
    pub fn lost(&self, why: &str) -> Option<Error> {
        // Over TCP the link also holds the piece of a packet still arriving: a sender killed
        // with part of one written lost a message too (issue 21). (Not counted for the idle
        // deadline: a piece read just now after a long quiet is no message idling.)
        let received = (self.unfinished() + self.peer.link.partial()) as u64;
        (received > 0).then(|| Error::Unfinished { received, why: why.into() })
    }

    /// The receiver is being dropped: the NCCL workers of a sender on another host give up now
    /// (see `remote.rs`).
    pub fn abandon(&mut self) {
        self.remote.abandon();
    }

    /// Stops reading this connection: the sender hears why, and that messages after the last one
    /// read are its own again. The sending side stays open for the releases of what is held.
    pub fn close(&self, reason: String) {
        self.peer.close(self.last_seq, reason);
        self.peer.link.shutdown(rustix::net::Shutdown::Read);
    }

    pub fn pid(&self) -> u32 {
        self.peer.link.peer_pid()
    }

    /// Why tensor `index` of a message cannot be used here: the message is rejected alone.
    pub fn refusal(&self, index: usize, reason: String) -> Error {
        Error::Frame { pid: self.pid(), source: FrameError::OutOfBounds { index, reason } }
    }

    /// Counts a message as taken by `recv` (or rejected), returning credits in batches of half
    /// the capacity, which keeps a frame off most hand-offs.
    pub fn took(&mut self, capacity: u32) {
        self.taken += 1;
        if self.taken >= capacity.div_ceil(2) {
            self.peer.credit(self.taken);
            self.uncredited -= self.taken;
            self.taken = 0;
        }
    }

    /// Reads the next packet if one is waiting and does what it says. An error closes the
    /// connection.
    pub fn read(&mut self, buf: &mut [u8], devices: &Devices, capacity: u32) -> Result<Progress> {
        let held = self.assembler.held();
        let (read, fds_lost) = self.peer.link.try_recv(&mut self.assembler, buf)?;
        let (frame, mut fds) = match read {
            Read::Frame(frame, fds) => (frame, fds),
            Read::Nothing if self.assembler.held() > held => {
                self.last_packet = std::time::Instant::now();
                return Ok(Progress::Handled);
            }
            Read::Nothing => return Ok(Progress::Idle),
            Read::HungUp => return Ok(Progress::HungUp),
        };
        self.last_packet = std::time::Instant::now();
        let arrived_ns = monotonic_ns();
        let Some((instance, _)) = &self.producer else {
            let instance = self.peer.link.check_hello(frame)?.instance;
            self.producer = Some((instance, producer(self.pid(), instance, !self.peer.link.remote)));
            return Ok(Progress::Greeted);
        };
        let instance = *instance;
        let remote = self.peer.link.remote;
        match frame {
            Frame::Bytes { data } if remote => self.remote.bytes(data)?,
            Frame::Communicator { id, unique_id, target } if remote => {
                self.remote.join(devices, id, &unique_id, Uuid(target), Arc::downgrade(&self.peer))?;
            }
            Frame::Chunk { .. } | Frame::Event { .. } | Frame::Retire { .. } if remote => {
                return Err(Error::Protocol("a sender on another host announced local memory".into()));
            }
            Frame::Chunk { id, len, kind, device, legacy, .. } => {
                let announced = Announced { id, len: len as usize, kind, device: Uuid(device), legacy, fd: fds.pop() };
                // A descriptor the kernel dropped (our table was full) makes the chunk unusable,
                // not the connection: the messages that use it are refused, and say why.
                let imported = match fds_lost {
                    Some(lost) => Err(lost),
                    None => import(self.pid(), instance, announced, |uuid| devices.context(uuid)),
                };
                match imported {
                    Ok(chunk) => {
                        self.refused.remove(&id);
                        self.chunks.insert(id, chunk);
                    }
                    Err(error) => {
                        tracing::warn!(pid = self.pid(), chunk = id, %error, "could not map a chunk");
                        self.chunks.remove(&id);
                        self.refused.insert(id, error.to_string());
                    }
                }
            }
            Frame::Event { id, handle } => {
                let event = Event::import(&IpcEventHandle::from_bytes(&handle)?)?;
                self.events.insert(id, Arc::new(event));
            }
            Frame::Retire { chunk } => {
                self.chunks.remove(&chunk);
                self.refused.remove(&chunk);
            }
            Frame::Message { seq, sent_ns, encoded_ns, tensors, payload } => {
                if self.uncredited >= capacity {
                    return Err(Error::Protocol(format!("more than the {capacity} messages its credits allow")));
                }
                self.uncredited += 1;
                self.last_seq = seq;
                let info = MessageInfo {
                    sender_pid: self.pid(),
                    connection: self.peer.connection,
                    seq,
                    sent_ns,
                    encoded_ns,
                    arrived_ns,
                    imported_ns: 0,
                    decoded_ns: 0,
                };
                let placed = if remote {
                    self.place_remote(devices, &tensors, payload, info)
                } else {
                    self.place(devices, &tensors, payload, info)
                };
                return Ok(Progress::Arrived(match placed {
                    Ok(ready) => Arrival::Ready(ready),
                    // Its sender has queued the message's NCCL sends already: refused alone, they
                    // would pair with the receives of the next message on those communicators
                    // (its bytes would be another message's, or the transfer would hang). Closing
                    // the connection aborts them on both sides.
                    Err(error) if tensors.iter().any(|d| d.route == Route::Nccl) => {
                        return Err(Error::Protocol(format!(
                            "a message with NCCL transfers could not be received, so its connection cannot go on: {error}"
                        )));
                    }
                    Err(error) => {
                        let reason = error.to_string();
                        self.peer.reject(seq, reason.clone());
                        self.took(capacity);
                        Arrival::Rejected { pid: self.pid(), connection: self.peer.connection, seq, reason }
                    }
                }));
            }
            other => return Err(Error::Protocol(format!("a sender sent {other:?}"))),
        }
        Ok(Progress::Handled)
    }

    /// Checks every descriptor of a message against this connection's chunks and events, and
    /// orders the tensors' first use after the producer's work: mapped in place, or copied here
    /// (the staged route) after each piece's fence.
    fn place(
        &mut self,
        devices: &Devices,
        descs: &[TensorDesc],
        payload: Vec<u8>,
        mut info: MessageInfo,
    ) -> Result<Ready> {
        let mut waits: Vec<(Fence, Arc<Stream>)> = Vec::new(); // one wait per fence and stream
        let mut fences: Vec<FenceWait> = Vec::new();
        let mut placed = Vec::with_capacity(descs.len());
        // Storage copied here, by the sender's (chunk, offset, length): tensors that share the
        // sender's storage share the copy too.
        let mut landed: Vec<(StorageKey, Allocation, Arc<Stream>)> = Vec::new();
        let mut on_cpu = false;
        for (index, desc) in descs.iter().enumerate() {
            self.check_route(devices, index, desc)?;
            let (chunk, path, stream) = self.locate(devices, index, desc)?;
            match desc.route {
                Route::Staged => {
                    let stream = stream.ok_or_else(|| Error::Protocol("a staged tensor without a stream".into()))?;
                    let key = (desc.chunk, desc.storage_offset, desc.storage_len);
                    let at = match landed.iter().position(|(k, _, _)| *k == key) {
                        Some(at) => at,
                        None => {
                            let allocation = self.copy_in(index, desc, &chunk, &stream, &mut fences)?;
                            landed.push((key, allocation, stream.clone()));
                            landed.len() - 1
                        }
                    };
                    placed.push(Placed::Landed(at, path, stream));
                }
                Route::Host => {
                    fences.extend(self.fence_on_cpu(index, desc)?);
                    on_cpu = true;
                    placed.push(Placed::Mapped(chunk, path, None));
                }
                _ => {
                    if let Some(stream) = &stream
                        && desc.fence != Fence::None
                        && !super::switches::skip_ordering()
                        && !waits.iter().any(|(fence, s)| *fence == desc.fence && Arc::ptr_eq(s, stream))
                    {
                        fences.extend(self.order_for(devices, index, desc, &chunk, stream)?);
                        waits.push((desc.fence, stream.clone()));
                    }
                    placed.push(Placed::Mapped(chunk, path, stream));
                }
            }
        }
        // Every stream a wait or a copy was queued on is some tensor's stream too.
        let mut streams: Vec<Arc<Stream>> = Vec::new();
        for stream in placed.iter().filter_map(Placed::stream) {
            if !streams.iter().any(|s| Arc::ptr_eq(s, stream)) {
                streams.push(stream.clone());
            }
        }
        let fences: Fences = Arc::new(fences);
        let lease = Arc::new(ReceivedLease { peer: self.peer.clone(), seq: info.seq, streams, fences: fences.clone() });
        // The memory a copy lands in is not reused before the copy is done, even if the tensor
        // is dropped at once: each landed storage holds an event recorded after its copies.
        let mut storages = Vec::with_capacity(landed.len());
        for (_, allocation, stream) in landed {
            let done = Event::new(stream.context())?;
            done.record(&stream)?;
            storages.push(Arc::new(Storage::landed(allocation, fences.clone(), &stream, done)));
        }
        let mut tensors = Vec::with_capacity(placed.len());
        for (placed, desc) in placed.into_iter().zip(descs) {
            let (storage, path, stream) = match placed {
                Placed::Mapped(chunk, path, stream) => {
                    let (offset, len) = (desc.storage_offset as usize, desc.storage_len as usize);
                    (Arc::new(Storage::received(chunk, offset, len, lease.clone())), path, stream)
                }
                Placed::Landed(at, path, stream) => (storages[at].clone(), path, Some(stream)),
            };
            let (shape, strides) = (desc.shape.clone(), desc.strides.clone());
            let offset = desc.view_offset as usize;
            tensors.push(Tensor::from_parts(storage, desc.dtype, shape, strides, offset, path, stream));
        }
        info.imported_ns = monotonic_ns();
        Ok(Ready { peer: self.peer.clone(), tensors, payload, info, fences, on_cpu })
    }

    /// Lands the tensors of a message from a sender on another host (see `remote.rs`).
    fn place_remote(
        &mut self,
        devices: &Devices,
        descs: &[TensorDesc],
        payload: Vec<u8>,
        mut info: MessageInfo,
    ) -> Result<Ready> {
        for (index, desc) in descs.iter().enumerate() {
            self.check_route(devices, index, desc)?;
        }
        let pid = self.pid();
        let bad = move |index, reason| Error::Frame { pid, source: FrameError::OutOfBounds { index, reason } };
        let mut remote = std::mem::take(&mut self.remote);
        let received = remote.receive(descs, devices, |uuid| self.stream(devices, uuid), bad);
        self.remote = remote;
        let received = received?;
        let mut tensors = Vec::with_capacity(descs.len());
        for ((storage, offset, stream), desc) in received.tensors.into_iter().zip(descs) {
            let path = if desc.route == Route::Nccl { TransferPath::Nccl } else { TransferPath::Tcp };
            let (shape, strides) = (desc.shape.clone(), desc.strides.clone());
            tensors.push(Tensor::from_parts(storage, desc.dtype, shape, strides, offset, path, stream));
        }
        info.imported_ns = monotonic_ns();
        // A message with NCCL receives waits on the CPU until its worker has queued them.
        let on_cpu = !received.fences.is_empty();
        let fences: Fences = Arc::new(received.fences);
        Ok(Ready { peer: self.peer.clone(), tensors, payload, info, fences, on_cpu })
    }

    /// The chunk a descriptor names, checked, with the path it came by and the stream its first
    /// use is ordered on (on the GPU it lands on).
    fn locate(
        &mut self,
        devices: &Devices,
        index: usize,
        desc: &TensorDesc,
    ) -> Result<(Arc<Chunk>, TransferPath, Option<Arc<Stream>>)> {
        let bad = |reason: String| self.refusal(index, reason);
        if let Some(why) = self.refused.get(&desc.chunk) {
            return Err(bad(format!("chunk {} could not be mapped here: {why}", desc.chunk)));
        }
        let chunk =
            self.chunks.get(&desc.chunk).cloned().ok_or_else(|| bad(format!("unknown chunk {}", desc.chunk)))?;
        let end = desc.storage_offset + desc.storage_len; // no overflow: checked by Frame::decode
        if end > chunk.len() as u64 {
            return Err(bad(format!(
                "storage {}..{end} outside chunk {} of {} bytes",
                desc.storage_offset,
                desc.chunk,
                chunk.len()
            )));
        }
        let host = matches!(chunk.memory, ChunkMemory::ImportedHost(_));
        match (desc.route, host) {
            (Route::SameDevice, true) => return Ok((chunk, TransferPath::HostSharedMemory, None)),
            (Route::Host, true) => return Ok((chunk, TransferPath::StagedToHost, None)),
            (Route::Staged, true) => {
                let target = desc.target.ok_or_else(|| bad("a staged tensor without a target GPU".into()))?;
                if !Reach::local().sees(&target) {
                    return Err(bad(format!("the staged tensor's target GPU {target} is not one of this process's")));
                }
                let stream = self.stream(devices, &target)?;
                return Ok((chunk, TransferPath::Staged, Some(stream)));
            }
            (Route::SameDevice | Route::PeerMap | Route::PeerCopy, false) => {}
            (route, _) => {
                let kind = if host { "host" } else { "device" };
                return Err(bad(format!("route {route} with a {kind} chunk")));
            }
        }
        let path = match (&chunk.memory, desc.route) {
            (_, Route::PeerCopy) => TransferPath::PeerCopied,
            (_, Route::PeerMap) => TransferPath::PeerMapped,
            (ChunkMemory::ImportedVmm(_), _) => TransferPath::CudaVmm,
            (ChunkMemory::ImportedLegacy(_), _) => TransferPath::CudaLegacyIpc,
            _ => return Err(Error::Protocol("a local chunk in a peer's table".into())),
        };
        let uuid = chunk.device_uuid().ok_or_else(|| Error::Protocol("a device chunk without a device".into()))?;
        let landing = match desc.route {
            Route::PeerMap => {
                let (target, _) = route::target(&uuid, &devices.routing, Reach::local());
                let target = target.filter(|t| *t != uuid).ok_or_else(|| {
                    bad(format!("mapped over a peer link, but tensors from GPU {uuid} do not land on another GPU here"))
                })?;
                chunk.grant_access(&devices.context(&target)?)?;
                target
            }
            _ => uuid,
        };
        let stream = self.stream(devices, &landing)?;
        Ok((chunk, path, Some(stream)))
    }

    /// This connection's stream for `uuid`'s device (the user's, if one was chosen).
    pub(super) fn stream(&mut self, devices: &Devices, uuid: &Uuid) -> Result<Arc<Stream>> {
        if let Some(chosen) = devices.chosen(uuid) {
            return Ok(chosen);
        }
        if let Some((_, stream)) = self.streams.iter().find(|(u, _)| u == uuid) {
            return Ok(stream.clone());
        }
        let stream = Arc::new(Stream::new(&devices.context(uuid)?)?);
        self.streams.push((*uuid, stream.clone()));
        Ok(stream)
    }

    /// Queues `stream`'s wait for the producer's fence of tensor `index`.
    pub(super) fn order(
        &self,
        index: usize,
        desc: &TensorDesc,
        chunk: &Chunk,
        stream: &Stream,
    ) -> Result<Option<FenceWait>> {
        let bad = |reason: String| self.refusal(index, reason);
        match desc.fence {
            Fence::None => Ok(None),
            Fence::Event(id) => {
                let event = self.events.get(&id).ok_or_else(|| bad(format!("unknown event {id}")))?;
                stream.wait_event(event)?;
                Ok(None)
            }
            Fence::Signal { chunk: signal_chunk, offset, value } => {
                let signal = self
                    .chunks
                    .get(&signal_chunk)
                    .ok_or_else(|| bad(format!("unknown signal chunk {signal_chunk}")))?;
                if signal.device().is_none() {
                    return Err(bad(format!("signal chunk {signal_chunk} is host memory")));
                }
                if signal.device_uuid() != chunk.device_uuid() {
                    return Err(bad(format!("signal chunk {signal_chunk} is on another device than the tensor")));
                }
                let offset = usize::try_from(offset).map_err(|_| bad(format!("signal offset {offset}")))?;
                let (_, producer) = self.producer.as_ref().ok_or_else(|| Error::Protocol("no Hello".into()))?;
                producer.wait(stream, signal, offset, value).map(Some).map_err(|e| match e {
                    Error::Core(ipc_core::Error::OutOfBounds { .. } | ipc_core::Error::InvalidArgument(_)) => {
                        bad(format!("signal word {offset} of chunk {signal_chunk}: {e}"))
                    }
                    other => other,
                })
            }
        }
    }
}
