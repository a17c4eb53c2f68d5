//! Where a received tensor lands, in one module: each storage record of a message's descriptor
//! table checked against the connection's chunks and events, and its memory mapped where it is
//! (ordered after the producer's fence on the connection's stream), mapped over a peer link
//! (ordered by a wait over the link), copied in from staging memory piece by piece, waited for
//! on the CPU, or taken from a sender on another host (`remote.rs`). One storage per record,
//! shared by the record's tensors: a message of many small tensors costs per record, and per
//! tensor only what the tensor holds. The receiver's half of the routes (see [`crate::route`]).

use std::sync::Arc;

use ipc_core::{Event, Stream, Uuid};

use super::connection::{Connected, Flavor, MessageInfo, Ready};
use super::devices::Devices;
use super::release::ReceivedLease;
use crate::clock::monotonic_ns;
use crate::error::{Error, Result};
use crate::fences::{FenceWait, Fences};
use crate::memory::arena::{Allocation, Arena, Chunk, ChunkMemory};
use crate::route::{self, Reach, Route};
use crate::side_table::{Received, Record};
use crate::tensor::{Storage, TransferPath};
use crate::wire::{Descriptors, Fence, FrameError, Source, StorageDesc};

/// Where a storage record of a message was put, the path it came by, and the stream its
/// tensors' first use is ordered on.
struct Placed {
    memory: Memory,
    path: TransferPath,
    stream: Option<Arc<Stream>>,
}

/// The chunk a record names, where the storage starts in it, the path it came by, and the
/// stream its tensors' first use is ordered on.
struct Located {
    chunk: Arc<Chunk>,
    offset: usize,
    path: TransferPath,
    stream: Option<Arc<Stream>>,
}

/// The memory of a placed record.
enum Memory {
    /// The sender's memory, mapped: (chunk, offset, length).
    Mapped(Arc<Chunk>, usize, usize),
    /// Copied here, on the record's stream.
    Landed(Allocation),
}

/// A record's memory with what its storage needs, made before the message's lease.
enum Prepared {
    /// The sender's memory, mapped: (chunk, offset, length).
    Mapped(Arc<Chunk>, usize, usize),
    /// Copied here on the stream, and the event recorded after the copies.
    Landed(Allocation, Arc<Stream>, Arc<Event>),
}

/// A message's tensors once placed (made when `recv` decodes the message): the producer's fences
/// they wait for, and whether `recv` waits for some of those on the CPU before delivering (see
/// [`Ready`]).
struct Placement {
    tensors: Received,
    fences: Fences,
    on_cpu: bool,
}

impl Connected {
    /// Refuses a route this receiver's policy forbids (an honest sender never sends one: it
    /// asks `crate::route::choose` first).
    pub(crate) fn check_route(&self, devices: &Devices, index: usize, route: Route) -> Result<()> {
        let strict = devices.routing.strict;
        // Whether the landing was a fallback is the sender's knowledge: the lenient reading here.
        if !route::allowed(route, strict, false) {
            let reason = format!("route {route} is refused by this receiver's policy ({strict:?})");
            return Err(self.refusal(index, reason));
        }
        Ok(())
    }

    /// Queues the wait for the producer's fence of storage record `index` on `stream`. For
    /// memory mapped over a peer link, a signal word (on the sender's GPU, like the memory) is
    /// waited for by `stream` itself over the link, once its GPU may reach the word's chunk: no
    /// event and no stream of the sender's GPU per message. An event fence (devices without
    /// stream memory operations) is waited for on this connection's stream for the sender's GPU
    /// first, which `stream` then waits for.
    pub(crate) fn order_for(
        &mut self,
        devices: &Devices,
        index: usize,
        record: &StorageDesc,
        chunk: &Arc<Chunk>,
        stream: &Arc<Stream>,
    ) -> Result<Option<FenceWait>> {
        if !matches!(record.source, Source::PeerMap { .. }) {
            return self.order(index, record.fence, chunk, stream);
        }
        if let Fence::Signal { chunk: word, .. } = record.fence {
            // Once per chunk and GPU (the chunk remembers); a chunk unknown or in host memory is
            // refused by `order`.
            if let Some(signal) = self.chunks.get(&word).filter(|c| c.device().is_some()) {
                signal.grant_access(stream.context())?;
            }
            return self.order(index, record.fence, chunk, stream);
        }
        let uuid = chunk.device_uuid().ok_or_else(|| Error::internal("a device chunk without a device"))?;
        let home = self.stream(devices, &uuid)?;
        let fence = self.order(index, record.fence, chunk, &home)?;
        let done = Event::new(home.context())?;
        done.record(&home)?;
        stream.wait_event(&done)?;
        Ok(fence)
    }

    /// Allocates staged record `index`'s storage on `stream`'s GPU and queues, per piece, the
    /// wait for the producer's host word and the copy out of the staging memory from `offset`.
    pub(crate) fn copy_in(
        &mut self,
        index: usize,
        record: &StorageDesc,
        (staging, offset): (&Arc<Chunk>, usize),
        stream: &Arc<Stream>,
        fences: &mut Vec<FenceWait>,
    ) -> Result<Allocation> {
        let bad = |reason: String| self.refusal(index, reason);
        let (signal, word, value) = self.host_signal(index, record)?;
        let (_, producer) = self.producer.as_ref().ok_or_else(|| Error::internal("no Hello"))?;
        let producer = producer.clone();
        let len = record.len as usize;
        let allocation = Arena::device(stream.context()).allocate(len)?;
        let destination = allocation.chunk.device().ok_or_else(|| Error::internal("a device arena in host memory"))?;
        let host = staging.host().ok_or_else(|| bad("staged from device memory".into()))?;
        let source = host.registered(stream.context())?;
        let piece = route::staging_piece(len);
        for k in 0..len.div_ceil(piece) {
            if !crate::switches::skip_ordering() {
                let value = value.checked_add(k as u64).ok_or_else(|| bad(format!("signal value {value}")))?;
                fences.push(producer.wait(stream, &signal, word, value).map_err(|e| match e {
                    Error::Core(ipc_core::Error::OutOfBounds { .. } | ipc_core::Error::InvalidArgument(_)) => {
                        bad(format!("signal word {word}: {e}"))
                    }
                    other => other,
                })?);
            }
            let at = k * piece;
            let n = piece.min(len - at);
            stream.copy_async(destination, allocation.offset + at, &source, offset + at, n)?;
        }
        Ok(allocation)
    }

    /// Notes the host word a host-route record's data waits for; `recv` waits for it on the CPU.
    /// The sender copied the storage in pieces, each followed by the next value of the word (see
    /// `signal::host_signal_pieces`): the data is whole only once the last piece's value is there.
    pub(crate) fn fence_on_cpu(&self, index: usize, record: &StorageDesc) -> Result<Option<FenceWait>> {
        let (signal, offset, first) = self.host_signal(index, record)?;
        let (_, producer) = self.producer.as_ref().ok_or_else(|| Error::internal("no Hello"))?;
        let len = record.len as usize;
        let pieces = len.div_ceil(route::staging_piece(len)).max(1);
        let value =
            first.checked_add(pieces as u64 - 1).ok_or_else(|| self.refusal(index, format!("signal value {first}")))?;
        producer.wait_on_cpu(&signal, offset, value).map(Some).map_err(|e| match e {
            Error::Core(_) => self.refusal(index, format!("signal word {offset}: {e}")),
            other => other,
        })
    }

    /// The host word, offset and first value a copied record's fence names.
    pub(crate) fn host_signal(&self, index: usize, record: &StorageDesc) -> Result<(Arc<Chunk>, usize, u64)> {
        let bad = |reason: String| self.refusal(index, reason);
        let Fence::Signal { chunk, offset, value } = record.fence else {
            return Err(bad(format!("a {} copy without a host signal", record.source.route())));
        };
        let signal = self.chunks.get(&chunk).cloned().ok_or_else(|| bad(format!("unknown chunk {chunk}")))?;
        if signal.host().is_none() {
            return Err(bad(format!("signal chunk {chunk} is not host memory")));
        }
        let offset = usize::try_from(offset).map_err(|_| bad(format!("signal offset {offset}")))?;
        Ok((signal, offset, value))
    }

    /// Places a message's tensors, from a sender on this machine (mapped, or copied here) or on
    /// another host (landed from its bytes and NCCL transfers). Every storage record's route is
    /// checked against this receiver's policy first.
    pub(crate) fn place(
        &mut self,
        devices: &Devices,
        table: Descriptors,
        payload: Vec<u8>,
        mut info: MessageInfo,
    ) -> Result<Ready> {
        let remote = matches!(self.flavor, Flavor::Remote(_));
        let Placement { tensors, fences, on_cpu } = if !remote && table.tensors().is_empty() {
            // Nothing to place, and no lease: the sender recorded none, and no release is owed.
            // (From another host the message's run of bytes, if any, is taken even so.)
            Placement { tensors: Received::default(), fences: Arc::new(Vec::new()), on_cpu: false }
        } else {
            for (index, record) in table.storages().iter().enumerate() {
                self.check_route(devices, index, record.source.route())?;
            }
            if remote { self.land_remote(devices, table)? } else { self.map_local(devices, table, info.seq)? }
        };
        info.imported_ns = monotonic_ns();
        Ok(Ready { peer: self.peer.clone(), tensors, payload, info, fences, on_cpu })
    }

    /// Checks every storage record of message `seq` from a sender on this machine against this
    /// connection's chunks and events, and orders the first use of its tensors after the
    /// producer's work: mapped in place, or copied here (the staged route) after each piece's
    /// fence. One storage per record, which the record's tensors share.
    fn map_local(&mut self, devices: &Devices, table: Descriptors, seq: u64) -> Result<Placement> {
        let mut waits: Vec<(Fence, Arc<Stream>)> = Vec::new(); // one wait per fence and stream
        let mut fences: Vec<FenceWait> = Vec::new();
        let mut placed = Vec::with_capacity(table.storages().len());
        let mut on_cpu = false;
        for (index, record) in table.storages().iter().enumerate() {
            let Located { chunk, offset, path, stream } = self.locate(devices, index, record)?;
            let memory = match record.source {
                Source::Staged { .. } => {
                    let stream = stream.as_ref().ok_or_else(|| Error::internal("a staged copy without a stream"))?;
                    Memory::Landed(self.copy_in(index, record, (&chunk, offset), stream, &mut fences)?)
                }
                Source::Host { .. } => {
                    fences.extend(self.fence_on_cpu(index, record)?);
                    on_cpu = true;
                    Memory::Mapped(chunk, offset, record.len as usize)
                }
                _ => {
                    if let Some(stream) = &stream
                        && record.fence != Fence::None
                        && !crate::switches::skip_ordering()
                        && !waits.iter().any(|(fence, s)| *fence == record.fence && Arc::ptr_eq(s, stream))
                    {
                        fences.extend(self.order_for(devices, index, record, &chunk, stream)?);
                        waits.push((record.fence, stream.clone()));
                    }
                    Memory::Mapped(chunk, offset, record.len as usize)
                }
            };
            placed.push(Placed { memory, path, stream });
        }
        // Every stream a wait or a copy was queued on is some record's stream too.
        let mut streams: Vec<Arc<Stream>> = Vec::new();
        for stream in placed.iter().filter_map(|p| p.stream.as_ref()) {
            if !streams.iter().any(|s| Arc::ptr_eq(s, stream)) {
                streams.push(stream.clone());
            }
        }
        let fences: Fences = Arc::new(fences);
        // The memory a copy lands in is not reused before the copy is done, even if the tensors
        // are dropped at once: each landed storage holds an event recorded after its copies.
        let mut prepared = Vec::with_capacity(placed.len());
        for Placed { memory, path, stream } in placed {
            let memory = match (memory, &stream) {
                (Memory::Mapped(chunk, offset, len), _) => Prepared::Mapped(chunk, offset, len),
                (Memory::Landed(allocation), Some(stream)) => {
                    let done = Event::new(stream.context())?;
                    done.record(stream)?;
                    Prepared::Landed(allocation, stream.clone(), Arc::new(done))
                }
                (Memory::Landed(_), None) => return Err(Error::internal("a landed copy without a stream")),
            };
            prepared.push((memory, path, stream));
        }
        // Made after the last step that can fail: a message refused here is released by the
        // refusal (see `Connected::reject`), never twice.
        let lease = Arc::new(ReceivedLease { peer: self.peer.clone(), seq, streams, fences: fences.clone() });
        let mut records = Vec::with_capacity(prepared.len());
        for (memory, path, stream) in prepared {
            let storage = Arc::new(match memory {
                Prepared::Mapped(chunk, offset, len) => Storage::received(chunk, offset, len, lease.clone()),
                Prepared::Landed(allocation, on, done) => Storage::landed(allocation, fences.clone(), &on, done),
            });
            records.push(Record { storage, base: 0, path, stream });
        }
        Ok(Placement { tensors: Received::new(table, records)?, fences, on_cpu })
    }

    /// Lands the tensors of a message from a sender on another host (see `remote.rs`).
    fn land_remote(&mut self, devices: &Devices, table: Descriptors) -> Result<Placement> {
        let pid = self.pid();
        let bad = move |index, reason| Error::Frame { pid, source: FrameError::Storage { index, reason } };
        // Taken out for the call, which needs the connection's streams; put back after.
        let Flavor::Remote(mut remote) = std::mem::replace(&mut self.flavor, Flavor::Local) else {
            return Err(Error::internal("a local sender's message on the remote path"));
        };
        let received = remote.receive(&table, devices, |uuid| self.stream(devices, uuid), bad);
        self.flavor = Flavor::Remote(remote);
        let received = received?;
        // A record's storage may start inside memory it shares with others (the message's host
        // bytes): its tensors' offsets count from there.
        let records = received
            .records
            .into_iter()
            .zip(table.storages())
            .map(|((storage, base, stream), desc)| {
                let path = match desc.source {
                    Source::Nccl { .. } => TransferPath::Nccl,
                    _ => TransferPath::Tcp,
                };
                Record { storage, base, path, stream }
            })
            .collect();
        // A message with NCCL receives waits on the CPU until its worker has queued them.
        let on_cpu = !received.fences.is_empty();
        Ok(Placement { tensors: Received::new(table, records)?, fences: Arc::new(received.fences), on_cpu })
    }

    /// The chunk a mapped or copied record names, checked, with where the storage starts in it,
    /// the path it came by and the stream its first use is ordered on (on the GPU it lands on).
    fn locate(&mut self, devices: &Devices, index: usize, record: &StorageDesc) -> Result<Located> {
        let bad = |reason: String| self.refusal(index, reason);
        let route = record.source.route();
        let Some((id, offset)) = record.source.chunk_range() else {
            return Err(bad(format!("route {route} from a sender on this machine")));
        };
        if let Some(why) = self.refused.get(&id) {
            return Err(bad(format!("chunk {id} could not be mapped here: {why}")));
        }
        let chunk = self.chunks.get(&id).cloned().ok_or_else(|| bad(format!("unknown chunk {id}")))?;
        let end = offset + record.len; // no overflow: checked by Frame::decode
        if end > chunk.len() as u64 {
            return Err(bad(format!("storage {offset}..{end} outside chunk {id} of {} bytes", chunk.len())));
        }
        let offset = offset as usize; // at most the chunk's length
        let host = matches!(chunk.memory, ChunkMemory::ImportedHost(_));
        match (record.source, host) {
            (Source::SameDevice { .. }, true) => {
                return Ok(Located { chunk, offset, path: TransferPath::HostSharedMemory, stream: None });
            }
            (Source::Host { .. }, true) => {
                return Ok(Located { chunk, offset, path: TransferPath::StagedToHost, stream: None });
            }
            (Source::Staged { target, .. }, true) => {
                if !Reach::local().sees(&target) {
                    return Err(bad(format!("the staged copy's target GPU {target} is not one of this process's")));
                }
                let stream = self.stream(devices, &target)?;
                return Ok(Located { chunk, offset, path: TransferPath::Staged, stream: Some(stream) });
            }
            (Source::SameDevice { .. } | Source::PeerMap { .. } | Source::PeerCopy { .. }, false) => {}
            _ => {
                let kind = if host { "host" } else { "device" };
                return Err(bad(format!("route {route} with a {kind} chunk")));
            }
        }
        let path = match (&chunk.memory, record.source) {
            (_, Source::PeerCopy { .. }) => TransferPath::PeerCopied,
            (_, Source::PeerMap { .. }) => TransferPath::PeerMapped,
            (ChunkMemory::ImportedVmm(_), _) => TransferPath::CudaVmm,
            (ChunkMemory::ImportedLegacy(_), _) => TransferPath::CudaLegacyIpc,
            _ => return Err(Error::internal("a local chunk in a peer's table")),
        };
        let uuid = chunk.device_uuid().ok_or_else(|| Error::internal("a device chunk without a device"))?;
        let landing = match record.source {
            Source::PeerMap { .. } => {
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
        Ok(Located { chunk, offset, path, stream: Some(stream) })
    }

    /// This connection's stream for `uuid`'s device (the user's, if one was chosen).
    pub(crate) fn stream(&mut self, devices: &Devices, uuid: &Uuid) -> Result<Arc<Stream>> {
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

    /// Queues `stream`'s wait for `fence`, the producer's fence of storage record `index` in
    /// `chunk`.
    pub(crate) fn order(
        &self,
        index: usize,
        fence: Fence,
        chunk: &Chunk,
        stream: &Stream,
    ) -> Result<Option<FenceWait>> {
        let bad = |reason: String| self.refusal(index, reason);
        match fence {
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
                    return Err(bad(format!("signal chunk {signal_chunk} is on another device than the storage")));
                }
                let offset = usize::try_from(offset).map_err(|_| bad(format!("signal offset {offset}")))?;
                let (_, producer) = self.producer.as_ref().ok_or_else(|| Error::internal("no Hello"))?;
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
