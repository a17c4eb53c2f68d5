//! The receiver's half of the routes from a sender on another host (see `route/network.rs`):
//! host bytes that came over the link, and NCCL receives into this process's memory.
//!
//! A communicator joins (rank 1) when its `Communicator` frame is read. A message that uses it
//! waits for the set-up to finish (the sender's side is already under way, so this is short; a
//! sender that never takes part is given [`JOIN_TIMEOUT`], and its connection is then closed).
//! The receives of a message run as one group on the connection's stream for the landing GPU,
//! into memory of this process's arena, so the tensors are the receiver's own: they can be
//! forwarded, and nothing is leased from the sender.
//!
//! When the connection ends, its communicators are retired off the `recv` thread: receives still
//! running are given [`DRAIN_TIMEOUT`] to finish (a sender that exits cleanly finishes them),
//! then the communicator is aborted, which ends any receive still waiting for a dead sender. A
//! message whose receives were cut short reports it (`ProducerFailed`, `Tensor::producer_failed`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_core::nccl::{Communicator, UniqueId};
use ipc_core::{Event, Stream, Uuid};

use super::connection::Devices;
use super::fences::{FenceWait, WordFate};
use super::peer::Peer;
use crate::arena::Arena;
use crate::route::{Reach, Route};
use crate::tensor::Storage;
use crate::wire::{MAX_INLINE_BYTES, TensorDesc};
use crate::{Error, Result};

/// How long a message waits for its communicator's set-up.
pub(crate) const JOIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long receives still running when a connection ends are given to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Communicators one connection may set up (a sender has one per pair of GPUs).
const MAX_COMMUNICATORS: usize = 64;
/// Host bytes start aligned to this in the buffer they land in.
const ALIGN: usize = 16;

/// A connection's state for a sender on another host.
#[derive(Default)]
pub(super) struct Remote {
    /// Bytes of host tensors for the next message.
    bytes: Vec<u8>,
    communicators: HashMap<u32, Joined>,
}

/// A communicator this receiver joined (rank 1).
struct Joined {
    target: Uuid,
    communicator: Communicator,
    ready: bool,
    /// Receives queued and maybe still running: an event after them, and their fate.
    running: Vec<(Event, Arc<WordFate>)>,
}

/// A received tensor: its storage, the byte offset of its element 0 there, and its stream.
pub(super) type Landed = (Arc<Storage>, usize, Option<Arc<Stream>>);

/// Storage received from a remote sender, and where each tensor lies in it.
pub(super) struct Received {
    /// Per tensor, in the message's order.
    pub tensors: Vec<Landed>,
    pub fences: Vec<FenceWait>,
}

impl Remote {
    /// Appends bytes of the next message's host tensors.
    pub fn bytes(&mut self, data: Vec<u8>) -> Result<()> {
        if (self.bytes.len() + data.len()) as u64 > MAX_INLINE_BYTES {
            return Err(Error::Protocol(format!("more than {MAX_INLINE_BYTES} bytes of host tensors for one message")));
        }
        if self.bytes.is_empty() {
            self.bytes = data;
        } else {
            self.bytes.extend_from_slice(&data);
        }
        Ok(())
    }

    /// Joins the sender's communicator `id` on this process's GPU `target`.
    /// Its waits give up once `peer`'s connection is closed.
    pub fn join(
        &mut self,
        devices: &Devices,
        id: u32,
        unique_id: &[u8],
        target: Uuid,
        peer: std::sync::Weak<Peer>,
    ) -> Result<()> {
        if self.communicators.contains_key(&id) {
            return Err(Error::Protocol(format!("communicator {id} was set up twice")));
        }
        if self.communicators.len() >= MAX_COMMUNICATORS {
            return Err(Error::Protocol(format!("more than {MAX_COMMUNICATORS} communicators")));
        }
        if !Reach::local().sees(&target) {
            return Err(Error::Protocol(format!("a communicator for GPU {target}, which this process does not have")));
        }
        let unique_id = UniqueId::try_from(unique_id)?;
        let mut communicator = Communicator::start(&devices.context(&target)?, &unique_id, 2, 1, JOIN_TIMEOUT)?;
        communicator.watch(move || peer.upgrade().is_some_and(|peer| !peer.link.peer_closed()));
        self.communicators.insert(id, Joined { target, communicator, ready: false, running: Vec::new() });
        Ok(())
    }

    /// Lands a message's tensors: host bytes from the link, GPU data through NCCL. `stream`
    /// gives the connection's stream for a GPU. An error rejects the message (or, for a
    /// communicator that cannot be used, closes the connection).
    pub fn receive(
        &mut self,
        descs: &[TensorDesc],
        devices: &Devices,
        mut stream: impl FnMut(&Uuid) -> Result<Arc<Stream>>,
        bad: impl Fn(usize, String) -> Error,
    ) -> Result<Received> {
        let bytes = std::mem::take(&mut self.bytes);
        let mut tensors: Vec<Option<Landed>> = vec![None; descs.len()];
        let mut fences = Vec::new();
        // Host tensors: one allocation for the message's bytes.
        let inline: Vec<usize> = (0..descs.len()).filter(|&i| descs[i].route == Route::Tcp).collect();
        if !inline.is_empty() {
            let allocation = Arena::host().allocate(bytes.len().max(ALIGN))?;
            let host = allocation.chunk.host().ok_or_else(|| Error::Protocol("a host arena on a device".into()))?;
            // SAFETY: the allocation was just made with at least `bytes.len()` bytes and nothing
            // else refers to them yet.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), host.as_ptr().add(allocation.offset), bytes.len()) };
            let storage = Arc::new(Storage::from_allocation(allocation));
            for index in inline {
                let desc = &descs[index];
                let end = desc.storage_offset + desc.storage_len; // no overflow: checked by decoding
                if end > bytes.len() as u64 {
                    return Err(bad(
                        index,
                        format!("bytes {}..{end} of a message that brought {}", desc.storage_offset, bytes.len()),
                    ));
                }
                tensors[index] = Some((storage.clone(), (desc.storage_offset + desc.view_offset) as usize, None));
            }
        }
        // GPU tensors: per communicator, the spans in order, received as one group.
        let mut by_comm: Vec<(u32, Vec<usize>)> = Vec::new();
        for (index, desc) in descs.iter().enumerate().filter(|(_, d)| d.route == Route::Nccl) {
            let id = u32::try_from(desc.chunk).map_err(|_| bad(index, format!("communicator {}", desc.chunk)))?;
            match by_comm.iter_mut().find(|(c, _)| *c == id) {
                Some((_, members)) => members.push(index),
                None => by_comm.push((id, vec![index])),
            }
        }
        for (id, members) in by_comm {
            // Span k's length, from its tensors (which must agree).
            let mut spans: Vec<Option<u64>> = Vec::new();
            for &index in &members {
                let desc = &descs[index];
                let span = desc.span as usize;
                // A transfer is the storage: a lying offset would reach past the memory it lands in.
                if desc.storage_offset != 0 {
                    return Err(bad(
                        index,
                        format!("an NCCL tensor at offset {} of its transfer", desc.storage_offset),
                    ));
                }
                if span >= members.len() {
                    return Err(bad(index, format!("NCCL transfer {span} of {} tensors", members.len())));
                }
                if spans.len() <= span {
                    spans.resize(span + 1, None);
                }
                match spans[span] {
                    Some(len) if len != desc.storage_len => {
                        return Err(bad(
                            index,
                            format!("NCCL transfer {span} of {len} and {} bytes", desc.storage_len),
                        ));
                    }
                    _ => spans[span] = Some(desc.storage_len),
                }
            }
            let spans: Vec<u64> = spans
                .into_iter()
                .enumerate()
                .map(|(k, len)| len.ok_or_else(|| bad(members[0], format!("NCCL transfer {k} has no tensor"))))
                .collect::<Result<_>>()?;
            let joined = self.ready(id).map_err(|e| bad(members[0], e.to_string()))?;
            let target = joined.target;
            let stream = stream(&target)?;
            let arena = Arena::device(&devices.context(&target)?);
            let allocations = spans.iter().map(|&len| arena.allocate(len as usize)).collect::<Result<Vec<_>>>()?;
            let mut receives = Vec::with_capacity(allocations.len());
            for allocation in &allocations {
                let memory =
                    allocation.chunk.device().ok_or_else(|| Error::Protocol("a device arena in host memory".into()))?;
                receives.push((memory, allocation.offset, allocation.len));
            }
            joined.communicator.group(|c| {
                for &(memory, offset, len) in &receives {
                    c.recv(memory, offset, len, 0, &stream)?;
                }
                Ok(())
            })?;
            let fate = WordFate::whole();
            let marker = Event::new(stream.context())?;
            marker.record(&stream)?;
            joined.running.retain(|(event, _)| !event.is_complete().unwrap_or(true));
            joined.running.push((marker, fate.clone()));
            let mut storages = Vec::with_capacity(allocations.len());
            for allocation in allocations {
                let done = Event::new(stream.context())?;
                done.record(&stream)?;
                let fences = Arc::new(vec![FenceWait::transfer(fate.clone())]);
                storages.push(Arc::new(Storage::landed(allocation, fences, &stream, done)));
            }
            for &index in &members {
                let desc = &descs[index];
                let at = (desc.storage_offset + desc.view_offset) as usize;
                tensors[index] = Some((storages[desc.span as usize].clone(), at, Some(stream.clone())));
            }
            fences.push(FenceWait::transfer(fate));
        }
        let tensors = tensors
            .into_iter()
            .enumerate()
            .map(|(index, t)| t.ok_or_else(|| bad(index, format!("route {} from another host", descs[index].route))))
            .collect::<Result<_>>()?;
        Ok(Received { tensors, fences })
    }

    /// The communicator `id`, once its set-up is done (waiting for it, bounded).
    fn ready(&mut self, id: u32) -> Result<&mut Joined> {
        let joined =
            self.communicators.get_mut(&id).ok_or_else(|| Error::Protocol(format!("unknown communicator {id}")))?;
        if !joined.ready {
            joined.communicator.wait_until_ready()?;
            joined.ready = true;
        }
        Ok(joined)
    }

    /// Retires the communicators of a connection that ended, on a thread of its own (see the
    /// module docs); `peer` keeps the connection open until then, so the sender does not abort
    /// sends whose data is still arriving.
    pub fn retire(&mut self, peer: Arc<Peer>) {
        let communicators: Vec<Joined> = self.communicators.drain().map(|(_, joined)| joined).collect();
        if communicators.is_empty() {
            return;
        }
        let spawned = std::thread::Builder::new().name("tq-nccl-retire".into()).spawn(move || {
            let deadline = Instant::now() + DRAIN_TIMEOUT;
            for joined in communicators {
                for (event, fate) in &joined.running {
                    while !event.is_complete().unwrap_or(true) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    if !event.is_complete().unwrap_or(true) {
                        fate.cut();
                    }
                }
                joined.communicator.abort();
            }
            drop(peer);
        });
        if let Err(error) = spawned {
            tracing::warn!(%error, "could not start a thread to retire NCCL communicators");
        }
    }
}
