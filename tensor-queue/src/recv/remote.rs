//! The receiver's half of the routes from a sender on another host (see `route/network.rs`):
//! host bytes that came over the link, and NCCL receives into this process's memory.
//!
//! A communicator joins (rank 1) when its `Communicator` frame is read, on a worker thread of
//! its own that owns it (`route/worker.rs`): `recv` never calls NCCL, so a sender that stalls in
//! the set-up, or never takes part, holds up nothing but its own messages. A message's receives
//! on one communicator are one job for the worker: `recv` allocates the memory they land in from
//! this process's arena and queues the job; the message waits (parked, on the CPU) until the
//! worker has queued the receives on its stream and made the connection's stream wait for
//! them, so the tensors are ordered on that stream like any others. Nothing on the GPU waits for
//! a receive that is not queued yet: a first version queued the connection stream's wait (on a
//! word the worker would write) at once, and every transfer hung on an H200 pair, as if NCCL's
//! set-up waited for the work queued on the device. The tensors are the receiver's own: they can
//! be forwarded, and nothing is leased from the sender.
//!
//! When the connection ends, each worker finishes the receives queued, gives those still running
//! [`DRAIN_TIMEOUT`] (a sender that exits cleanly finishes them), then aborts the communicator,
//! which ends any receive still waiting for a dead sender. When the receiver is dropped, its
//! workers give up at once. When a worker gives up (a set-up that did not finish within
//! [`JOIN_TIMEOUT`], an NCCL error, the sender gone, the receiver dropped), its receives that
//! did not complete are cut short, and their messages report it (`ProducerFailed`,
//! `Tensor::producer_failed`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ipc_core::nccl::{Communicator, UniqueId};
use ipc_core::{Context, Event, Stream, Uuid};

use super::devices::Devices;
use super::peer::Peer;
use crate::error::{Error, Result};
use crate::fences::liveness::Gone;
use crate::fences::{FenceWait, WordFate};
use crate::links::nccl::{Next, WorkQueue};
use crate::links::wake::Wake;
use crate::memory::arena::Arena;
use crate::route::{Reach, Route};
use crate::sync::lock;
use crate::tensor::Storage;
use crate::wire::{MAX_INLINE_BYTES, TensorDesc};

/// How long a communicator's set-up may take (its messages wait for it on the GPU).
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long receives still running when a connection ends are given to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Communicators one connection may set up (a sender has one per pair of GPUs).
const MAX_COMMUNICATORS: usize = 64;
/// Host bytes start aligned to this in the buffer they land in.
const ALIGN: usize = 16;

/// A connection's state for a sender on another host.
#[derive(Default)]
pub(crate) struct Remote {
    /// Bytes of host tensors for the next message.
    bytes: Vec<u8>,
    communicators: HashMap<u32, Joined>,
}

/// A communicator this receiver joined (rank 1); its worker owns it.
struct Joined {
    target: Uuid,
    comm: Arc<RecvComm>,
}

/// What a communicator's worker and `recv` share.
struct RecvComm {
    id: u32,
    queue: WorkQueue<Receive>,
    wake: Wake,
    /// The connection, once it ended, held open until the worker is done.
    keep_open: Mutex<Option<Arc<Peer>>>,
    /// The receiver is being dropped: the communicator's waits give up.
    abandoned: AtomicBool,
    /// The connection, told when the communicator fails (its liveness, `fences/liveness.rs`).
    peer: Weak<Peer>,
}

/// One message's receives on one communicator.
struct Receive {
    /// Per span: the storage it lands in (held until the receive is done) and its length.
    spans: Vec<(Arc<Storage>, usize)>,
    /// The connection's stream for the landing GPU: it waits for the receives.
    stream: Arc<Stream>,
    fate: Arc<WordFate>,
}

/// A received tensor: its storage, the byte offset of its element 0 there, and its stream.
pub(crate) type Landed = (Arc<Storage>, usize, Option<Arc<Stream>>);

/// Storage received from a remote sender, and where each tensor lies in it.
pub(crate) struct Received {
    /// Per tensor, in the message's order.
    pub tensors: Vec<Landed>,
    pub fences: Vec<FenceWait>,
}

impl Remote {
    /// Appends bytes of the next message's host tensors.
    /// Bytes of host tensors held for a message whose frame has not come yet.
    pub fn unfinished(&self) -> usize {
        self.bytes.len()
    }

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

    /// Joins the sender's communicator `id` on this process's GPU `target`, on a worker thread
    /// (joined when the receiver is dropped). Its waits give up once `peer`'s connection is closed.
    pub fn join(&mut self, devices: &Devices, id: u32, unique_id: &[u8], target: Uuid, peer: Weak<Peer>) -> Result<()> {
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
        let context = devices.context(&target)?;
        let comm = Arc::new(RecvComm {
            id,
            queue: WorkQueue::new(),
            wake: devices.nccl_wake.clone(),
            keep_open: Mutex::new(None),
            abandoned: AtomicBool::new(false),
            peer: peer.clone(),
        });
        let worker = comm.clone();
        let me = Arc::downgrade(&comm);
        let alive = move || {
            peer.upgrade().is_some_and(|peer| peer.link.gone().is_none())
                && me.upgrade().is_some_and(|me| !me.abandoned.load(Ordering::Acquire))
        };
        devices.nccl_workers.spawn("tq-nccl-recv", move || worker.work(&context, &unique_id, alive))?;
        self.communicators.insert(id, Joined { target, comm });
        Ok(())
    }

    /// Lands a message's tensors: host bytes from the link, GPU data through NCCL. `stream`
    /// gives the connection's stream for a GPU. An error rejects the message, or closes the
    /// connection when the message has NCCL transfers (see `Connected::read`).
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
            host.write(allocation.offset, &bytes)?;
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
            let joined =
                self.communicators.get_mut(&id).ok_or_else(|| bad(members[0], format!("unknown communicator {id}")))?;
            let stream = stream(&joined.target)?;
            let arena = Arena::device(&devices.context(&joined.target)?);
            let fate = WordFate::pending();
            let fenced = Arc::new(vec![FenceWait::transfer(fate.clone())]);
            let mut storages = Vec::with_capacity(spans.len());
            for &len in &spans {
                let allocation = arena.allocate(len as usize)?;
                storages.push(Arc::new(Storage::landing(allocation, fenced.clone())));
            }
            // Each receive takes exactly its span's bytes, not the allocation's rounded length:
            // NCCL's P2P and shared-memory transports match a send and a receive by count, so a
            // longer receive would wait for the next message's bytes (its network transport
            // tolerates it, which hid this).
            let receives = storages.iter().zip(&spans).map(|(storage, &len)| (storage.clone(), len as usize));
            let receive = Receive { spans: receives.collect(), stream: stream.clone(), fate: fate.clone() };
            joined.comm.queue.submit(receive).map_err(|e| bad(members[0], e.to_string()))?;
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

    /// The receiver is being dropped: each worker gives up at once (a set-up under way within
    /// about a second), cutting short the receives not done.
    pub fn abandon(&mut self) {
        for (_, joined) in self.communicators.drain() {
            joined.comm.abandoned.store(true, Ordering::Release);
            joined.comm.queue.stop(true);
        }
    }

    /// The connection ended: each worker finishes what is queued and lets its communicator go
    /// (see the module docs). `peer` keeps the connection open until then, so the sender does
    /// not abort sends whose data is still arriving.
    pub fn retire(&mut self, peer: Arc<Peer>) {
        for (_, joined) in self.communicators.drain() {
            *lock(&joined.comm.keep_open) = Some(peer.clone());
            joined.comm.queue.stop(false);
        }
    }
}

impl RecvComm {
    /// The worker: starts the communicator, then issues each message's receives in order.
    fn work(&self, context: &Arc<Context>, unique_id: &UniqueId, alive: impl Fn() -> bool + Send + 'static) {
        let mut running: Vec<(Event, Arc<WordFate>)> = Vec::new();
        let started = Communicator::start(context, unique_id, 2, 1, JOIN_TIMEOUT).and_then(|mut communicator| {
            communicator.watch(alive);
            communicator.wait_until_ready()?;
            Ok((communicator, Stream::new(context)?))
        });
        let (communicator, stream) = match started {
            Ok(started) => started,
            Err(error) => {
                self.report(&error.to_string());
                return self.fail(None, running, error.to_string());
            }
        };
        loop {
            match self.queue.next() {
                Next::Job(receive) => {
                    running.retain(|(event, _)| !event.is_complete().unwrap_or(true));
                    let fate = receive.fate.clone();
                    match self.issue(&communicator, &stream, receive) {
                        Ok(done) => running.push((done, fate)),
                        Err(error) => {
                            fate.cut(); // the wake rings in `fail`
                            self.report(&error.to_string());
                            return self.fail(Some(communicator), running, error.to_string());
                        }
                    }
                }
                Next::Closed => {
                    let deadline = Instant::now() + DRAIN_TIMEOUT;
                    while running.iter().any(|(event, _)| !event.is_complete().unwrap_or(true)) {
                        if Instant::now() >= deadline {
                            return self.fail(Some(communicator), running, "the sender stopped".into());
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    drop(lock(&self.keep_open).take());
                    return; // every receive is done: the communicator finalizes as it drops
                }
                Next::Aborted => return self.fail(Some(communicator), running, "aborted".into()),
            }
        }
    }

    /// Reports to the connection's liveness that the communicator failed (its set-up or a
    /// receive; not when it stops because the connection ended or the receiver is dropped).
    fn report(&self, why: &str) {
        if let Some(peer) = self.peer.upgrade() {
            peer.link.liveness().report(Gone::Nccl(why.into()));
        }
    }

    /// Gives up (see the module docs): receives not done are cut short and those queued
    /// refused, then the communicator is aborted.
    fn fail(&self, communicator: Option<Communicator>, running: Vec<(Event, Arc<WordFate>)>, why: String) {
        tracing::warn!(comm = self.id, %why, "an NCCL communicator with a sender on another host gave up");
        // Which receives completed is decided before the abort, which ends the others early.
        for (event, fate) in &running {
            if !event.is_complete().unwrap_or(false) {
                fate.cut();
            }
        }
        for receive in self.queue.fail(why) {
            receive.fate.cut();
        }
        self.wake.ring();
        if let Some(communicator) = communicator {
            communicator.abort();
        }
        drop(lock(&self.keep_open).take());
    }

    /// Queues one message's receives as one group on `stream`, makes the connection's stream
    /// wait for them, and marks them issued (the message may be delivered). Their memory is held
    /// until they are done.
    fn issue(&self, communicator: &Communicator, stream: &Stream, receive: Receive) -> Result<Event> {
        let mut memories = Vec::with_capacity(receive.spans.len());
        for (storage, len) in &receive.spans {
            let memory =
                storage.chunk.device().ok_or_else(|| Error::Protocol("a device arena in host memory".into()))?;
            memories.push((memory, storage.offset, *len));
        }
        communicator.group(|c| {
            for &(memory, offset, len) in &memories {
                c.recv(memory, offset, len, 0, stream)?;
            }
            Ok(())
        })?;
        for (storage, _) in &receive.spans {
            let landed = Event::new(stream.context())?;
            landed.record(stream)?;
            storage.hold_until(stream, landed);
        }
        let done = Event::new(stream.context())?;
        done.record(stream)?;
        receive.stream.wait_event(&done)?;
        receive.fate.issued();
        self.wake.ring();
        Ok(done)
    }
}
