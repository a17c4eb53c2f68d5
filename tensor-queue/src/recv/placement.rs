//! Where a received tensor lands, in one module: each descriptor of a message checked against
//! the connection's chunks and events, and the tensor mapped where it is (ordered after the
//! producer's fence on the connection's stream), mapped over a peer link (ordered through the
//! sender's GPU), copied in from staging memory piece by piece, waited for on the CPU, or taken
//! from a sender on another host (`remote.rs`). The receiver's half of the routes (see
//! [`crate::route`]).

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
use crate::tensor::{Storage, Tensor, TransferPath};
use crate::wire::{Fence, FrameError, TensorDesc};

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

impl Connected {
    /// Refuses a route this receiver's policy forbids (an honest sender never sends one: it
    /// asks `crate::route::choose` first).
    pub(crate) fn check_route(&self, devices: &Devices, index: usize, desc: &TensorDesc) -> Result<()> {
        let strict = devices.routing.strict;
        // Whether the landing was a fallback is the sender's knowledge: the lenient reading here.
        if !route::allowed(desc.route, strict, false) {
            let reason = format!("route {} is refused by this receiver's policy ({strict:?})", desc.route);
            return Err(self.refusal(index, reason));
        }
        Ok(())
    }

    /// Queues the wait for the producer's fence of tensor `index` on `stream`; for a tensor
    /// mapped over a peer link, on this connection's stream for the sender's GPU first (where the
    /// fence lives), which `stream` then waits for.
    pub(crate) fn order_for(
        &mut self,
        devices: &Devices,
        index: usize,
        desc: &TensorDesc,
        chunk: &Arc<Chunk>,
        stream: &Arc<Stream>,
    ) -> Result<Option<FenceWait>> {
        if desc.route != Route::PeerMap {
            return self.order(index, desc, chunk, stream);
        }
        let uuid = chunk.device_uuid().ok_or_else(|| Error::Protocol("a device chunk without a device".into()))?;
        let home = self.stream(devices, &uuid)?;
        let fence = self.order(index, desc, chunk, &home)?;
        let done = Event::new(home.context())?;
        done.record(&home)?;
        stream.wait_event(&done)?;
        Ok(fence)
    }

    /// Allocates staged tensor `index`'s storage on `stream`'s GPU and queues, per piece, the
    /// wait for the producer's host word and the copy out of the staging memory.
    pub(crate) fn copy_in(
        &mut self,
        index: usize,
        desc: &TensorDesc,
        staging: &Arc<Chunk>,
        stream: &Arc<Stream>,
        fences: &mut Vec<FenceWait>,
    ) -> Result<Allocation> {
        let bad = |reason: String| self.refusal(index, reason);
        let (signal, offset, value) = self.host_signal(index, desc)?;
        let (_, producer) = self.producer.as_ref().ok_or_else(|| Error::Protocol("no Hello".into()))?;
        let producer = producer.clone();
        let len = desc.storage_len as usize;
        let allocation = Arena::device(stream.context()).allocate(len)?;
        let destination =
            allocation.chunk.device().ok_or_else(|| Error::Protocol("a device arena in host memory".into()))?;
        let host = staging.host().ok_or_else(|| bad("staged from device memory".into()))?;
        let source = host.registered(stream.context())?;
        let piece = route::staging_piece(len);
        for k in 0..len.div_ceil(piece) {
            if !crate::switches::skip_ordering() {
                let value = value.checked_add(k as u64).ok_or_else(|| bad(format!("signal value {value}")))?;
                fences.push(producer.wait(stream, &signal, offset, value).map_err(|e| match e {
                    Error::Core(ipc_core::Error::OutOfBounds { .. } | ipc_core::Error::InvalidArgument(_)) => {
                        bad(format!("signal word {offset}: {e}"))
                    }
                    other => other,
                })?);
            }
            let at = k * piece;
            let n = piece.min(len - at);
            stream.copy_async(destination, allocation.offset + at, &source, desc.storage_offset as usize + at, n)?;
        }
        Ok(allocation)
    }

    /// Notes the host word a host-route tensor's data waits for; `recv` waits for it on the CPU.
    /// The sender copied the storage in pieces, each followed by the next value of the word (see
    /// `signal::host_signal_pieces`): the data is whole only once the last piece's value is there.
    pub(crate) fn fence_on_cpu(&self, index: usize, desc: &TensorDesc) -> Result<Option<FenceWait>> {
        let (signal, offset, first) = self.host_signal(index, desc)?;
        let (_, producer) = self.producer.as_ref().ok_or_else(|| Error::Protocol("no Hello".into()))?;
        let len = desc.storage_len as usize;
        let pieces = len.div_ceil(route::staging_piece(len)).max(1);
        let value =
            first.checked_add(pieces as u64 - 1).ok_or_else(|| self.refusal(index, format!("signal value {first}")))?;
        producer.wait_on_cpu(&signal, offset, value).map(Some).map_err(|e| match e {
            Error::Core(_) => self.refusal(index, format!("signal word {offset}: {e}")),
            other => other,
        })
    }

    /// The host word, offset and first value a copied tensor's fence names.
    pub(crate) fn host_signal(&self, index: usize, desc: &TensorDesc) -> Result<(Arc<Chunk>, usize, u64)> {
        let bad = |reason: String| self.refusal(index, reason);
        let Fence::Signal { chunk, offset, value } = desc.fence else {
            return Err(bad(format!("a {} tensor without a host signal", desc.route)));
        };
        let signal = self.chunks.get(&chunk).cloned().ok_or_else(|| bad(format!("unknown chunk {chunk}")))?;
        if signal.host().is_none() {
            return Err(bad(format!("signal chunk {chunk} is not host memory")));
        }
        let offset = usize::try_from(offset).map_err(|_| bad(format!("signal offset {offset}")))?;
        Ok((signal, offset, value))
    }

    /// Checks every descriptor of a message against this connection's chunks and events, and
    /// orders the tensors' first use after the producer's work: mapped in place, or copied here
    /// (the staged route) after each piece's fence.
    pub(crate) fn place(
        &mut self,
        devices: &Devices,
        descs: &[TensorDesc],
        payload: Vec<u8>,
        mut info: MessageInfo,
    ) -> Result<Ready> {
        if descs.is_empty() {
            // Nothing to place, and no lease: the sender recorded none, and no release is owed.
            info.imported_ns = monotonic_ns();
            let fences: Fences = Arc::new(Vec::new());
            return Ok(Ready { peer: self.peer.clone(), tensors: Vec::new(), payload, info, fences, on_cpu: false });
        }
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
                        && !crate::switches::skip_ordering()
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
        // The memory a copy lands in is not reused before the copy is done, even if the tensor
        // is dropped at once: each landed storage holds an event recorded after its copies.
        let mut storages = Vec::with_capacity(landed.len());
        for (_, allocation, stream) in landed {
            let done = Event::new(stream.context())?;
            done.record(&stream)?;
            storages.push(Arc::new(Storage::landed(allocation, fences.clone(), &stream, done)));
        }
        // Made after the last step that can fail: a message refused here is released by the
        // refusal (see `Connected::reject`), never twice.
        let lease = Arc::new(ReceivedLease { peer: self.peer.clone(), seq: info.seq, streams, fences: fences.clone() });
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
    pub(crate) fn place_remote(
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
        // Taken out for the call, which needs the connection's streams; put back after.
        let Flavor::Remote(mut remote) = std::mem::replace(&mut self.flavor, Flavor::Local) else {
            return Err(Error::Protocol("a local sender's message on the remote path".into()));
        };
        let received = remote.receive(descs, devices, |uuid| self.stream(devices, uuid), bad);
        self.flavor = Flavor::Remote(remote);
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

    /// Queues `stream`'s wait for the producer's fence of tensor `index`.
    pub(crate) fn order(
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
