//! The receiver's half of the routes from a sender on another host (see `route/network.rs`):
//! host bytes that came over the link, and NCCL receives into this process's memory.
//!
//! A message's host bytes come as one bulk run before its frame (see `ipc_core::tcp`): the
//! memory they land in is allocated from the host arena when the run's header is read, and the
//! bytes are read from the socket straight into it as they come.
//!
//! A small message's GPU tensors come in the same run ([`Source::BytesToGpu`]): once the run
//! has landed, each is copied from there onto its GPU on the connection's stream for that GPU,
//! the stream an NCCL-delivered tensor is ordered on, so the tensor is the same to its user
//! either way. The copy is queued (from pinned memory: the host arena's chunk, registered once),
//! never waited for on the CPU; the host bytes are held until it is done.
//!
//! A communicator joins (rank 1) when its `Communicator` frame is read, on a worker thread of
//! its own that owns it (`route/worker.rs`): `recv` never calls NCCL, so a sender that stalls in
//! the set-up, or never takes part, holds up nothing but its own messages. A message's receives
//! on one communicator are one job for the worker: `recv` allocates the memory they land in from
//! this process's arena and queues the job; the message waits (parked, on the CPU) until the
//! worker has queued the receives on its stream and made the connection's stream wait for
//! them, so the tensors are ordered on that stream like any others; `recv` decodes the message
//! meanwhile (`Receiver::recv_with_info`). Nothing on the GPU waits for a receive that is not
//! queued yet: a first version queued the connection stream's wait (on a word the worker would
//! write) at once, and every transfer hung on an H200 pair, as if NCCL's
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
use crate::error::{Error, Result, Violation};
use crate::fences::liveness::Gone;
use crate::fences::{FenceWait, WordFate};
use crate::links::link::Link;
use crate::links::nccl::{Next, WorkQueue};
use crate::links::wake::Wake;
use crate::memory::arena::{Allocation, Arena};
use crate::route::{Reach, Route};
use crate::sync::lock;
use crate::tensor::Storage;
use crate::wire::{Descriptors, MAX_INLINE_BYTES, Source};

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
    /// Where the next message's host bytes land (its bulk run, read straight into it).
    landing: Option<HostLanding>,
    communicators: HashMap<u32, Joined>,
}

/// A message's host bytes, read from the link straight into the memory they are received in.
struct HostLanding {
    allocation: Allocation,
    /// The run's length.
    len: usize,
    /// Bytes of it read so far.
    filled: usize,
}

/// A bulk run's header, counted as bytes of an unfinished message.
const RUN_HEADER: usize = 12;

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

/// A received storage record: the storage, where the record starts in it, and its stream.
pub(crate) type Landed = (Arc<Storage>, usize, Option<Arc<Stream>>);

/// Storage received from a remote sender, per record of the message's table.
pub(crate) struct Received {
    /// Per record, in the table's order.
    pub records: Vec<Landed>,
    pub fences: Vec<FenceWait>,
}

impl Remote {
    /// Bytes of host tensors held for a message whose frame has not come yet.
    pub fn unfinished(&self) -> usize {
        self.landing.as_ref().map_or(0, |landing| RUN_HEADER + landing.filled)
    }

    /// Reads what has come of the bulk run of the next message's host bytes (`left` bytes not
    /// read yet; see `ipc_core::tcp`) straight into the memory they land in, allocated when the
    /// run starts: the bytes read (0: none had come). The allocation is the run's length, which
    /// the sender claims; the pages are backed only as bytes arrive.
    pub fn bulk(&mut self, left: u64, link: &Link) -> Result<usize> {
        if self.landing.as_ref().is_some_and(|landing| landing.filled == landing.len) {
            return Err(Violation::SecondBulkRun.into());
        }
        if self.landing.is_none() {
            if left > MAX_INLINE_BYTES {
                return Err(Violation::BulkTooLong { len: left }.into());
            }
            let len = left as usize;
            let allocation = Arena::host().allocate(len.max(ALIGN))?;
            self.landing = Some(HostLanding { allocation, len, filled: 0 });
        }
        let landing = self.landing.as_mut().ok_or_else(|| Error::internal("no landing"))?;
        if (landing.len - landing.filled) as u64 != left {
            // The byte stream counts a run's bytes itself: what is left is what it said.
            return Err(Error::internal(format_args!(
                "a run with {left} bytes left where {} were expected",
                landing.len - landing.filled
            )));
        }
        let host = landing.allocation.chunk.host().ok_or_else(|| Error::internal("a host arena on a device"))?;
        let at = landing.allocation.offset + landing.filled;
        let read = link.try_recv_bulk(host, at, landing.len - landing.filled)?;
        landing.filled += read;
        Ok(read)
    }

    /// Joins the sender's communicator `id` on this process's GPU `target`, on a worker thread
    /// (joined when the receiver is dropped). Its waits give up once `peer`'s connection is closed.
    pub fn join(&mut self, devices: &Devices, id: u32, unique_id: &[u8], target: Uuid, peer: Weak<Peer>) -> Result<()> {
        if self.communicators.contains_key(&id) {
            return Err(Violation::CommunicatorTwice { id }.into());
        }
        if self.communicators.len() >= MAX_COMMUNICATORS {
            return Err(Violation::TooManyCommunicators { max: MAX_COMMUNICATORS }.into());
        }
        if !Reach::local().sees(&target) {
            return Err(Violation::CommunicatorForAbsentGpu { target }.into());
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

    /// Lands a message's storage records: host bytes from the link, GPU data through NCCL.
    /// `stream` gives the connection's stream for a GPU; `bad` says why record `index` cannot be
    /// used. An error rejects the message, or closes the connection when the message has NCCL
    /// transfers (see `Connected::read`).
    pub fn receive(
        &mut self,
        table: &Descriptors,
        devices: &Devices,
        mut stream: impl FnMut(&Uuid) -> Result<Arc<Stream>>,
        bad: impl Fn(usize, String) -> Error,
    ) -> Result<Received> {
        // The run is complete: its last byte was read before this frame's first.
        let landing = self.landing.take();
        let records = table.storages();
        let mut landed: Vec<Option<Landed>> = vec![None; records.len()];
        let mut fences = Vec::new();
        // Host tensors: where the message's bytes landed, which every bytes record shares; a
        // small message's GPU tensors are copied from there onto their GPUs.
        if table.uses(Route::Tcp) {
            let first = records.iter().position(|r| r.source.route() == Route::Tcp).unwrap_or(0);
            let Some(HostLanding { allocation, len, .. }) = landing else {
                return Err(bad(first, "host bytes, of a message that brought none".into()));
            };
            let storage = Arc::new(Storage::from_allocation(allocation));
            for (index, record) in records.iter().enumerate() {
                let (Source::Bytes { offset } | Source::BytesToGpu { offset, .. }) = record.source else { continue };
                let end = offset + record.len; // no overflow: checked by decoding
                if end > len as u64 {
                    return Err(bad(index, format!("bytes {offset}..{end} of a message that brought {len}")));
                }
                landed[index] = Some(match record.source {
                    Source::BytesToGpu { target, .. } => {
                        if !Reach::local().sees(&target) {
                            let why = format!("bytes for GPU {target}, which is not one of this process's");
                            return Err(bad(index, why));
                        }
                        let stream = stream(&target)?;
                        let copy = onto_gpu(&storage, offset as usize, record.len as usize, &stream)?;
                        (Arc::new(copy), 0, Some(stream))
                    }
                    _ => (storage.clone(), offset as usize, None),
                });
            }
        }
        // GPU tensors: per communicator, its records in order are its transfers, received as one
        // group.
        let mut by_comm: Vec<(u32, Vec<usize>)> = Vec::new();
        for (index, record) in records.iter().enumerate() {
            if let Source::Nccl { communicator } = record.source {
                match by_comm.iter_mut().find(|(c, _)| *c == communicator) {
                    Some((_, members)) => members.push(index),
                    None => by_comm.push((communicator, vec![index])),
                }
            }
        }
        for (id, members) in by_comm {
            let joined =
                self.communicators.get_mut(&id).ok_or_else(|| bad(members[0], format!("unknown communicator {id}")))?;
            let stream = stream(&joined.target)?;
            let arena = Arena::device(&devices.context(&joined.target)?);
            let fate = WordFate::pending();
            let fenced = Arc::new(vec![FenceWait::transfer(fate.clone())]);
            let mut spans = Vec::with_capacity(members.len());
            for &index in &members {
                let len = records[index].len as usize;
                let storage = Arc::new(Storage::landing(arena.allocate(len)?, fenced.clone()));
                landed[index] = Some((storage.clone(), 0, Some(stream.clone())));
                // Each receive takes exactly its transfer's bytes, not the allocation's rounded
                // length: NCCL's P2P and shared-memory transports match a send and a receive by
                // count, so a longer receive would wait for the next message's bytes (its network
                // transport tolerates it, which hid this).
                spans.push((storage, len));
            }
            let receive = Receive { spans, stream: stream.clone(), fate: fate.clone() };
            joined.comm.queue.submit(receive).map_err(|e| bad(members[0], e.to_string()))?;
            fences.push(FenceWait::transfer(fate));
        }
        let records = landed
            .into_iter()
            .enumerate()
            .map(|(index, r)| {
                r.ok_or_else(|| bad(index, format!("route {} from another host", records[index].source.route())))
            })
            .collect::<Result<_>>()?;
        Ok(Received { records, fences })
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

/// A copy onto `stream`'s GPU of `len` bytes at `offset` of `host` (a message's landed run),
/// queued on `stream`; `host` is held until the copy is done, and the copy's memory is not
/// reused before it is: one event, recorded after the copy, holds both.
fn onto_gpu(host: &Arc<Storage>, offset: usize, len: usize, stream: &Stream) -> Result<Storage> {
    let allocation = Arena::device(stream.context()).allocate(len.max(1))?;
    let destination = allocation.chunk.device().ok_or_else(|| Error::internal("a device arena in host memory"))?;
    let memory = host.chunk.host().ok_or_else(|| Error::internal("a host arena on a device"))?;
    let source = memory.registered(stream.context())?;
    stream.copy_async(destination, allocation.offset, &source, host.offset + offset, len)?;
    let copied = Arc::new(Event::new(stream.context())?);
    copied.record(stream)?;
    host.hold_until(stream, copied.clone());
    Ok(Storage::landed(allocation, Arc::new(Vec::new()), stream, copied))
}

impl RecvComm {
    /// The worker: starts the communicator, then issues each message's receives in order.
    fn work(&self, context: &Arc<Context>, unique_id: &UniqueId, alive: impl Fn() -> bool + Send + 'static) {
        let mut running: Vec<(Arc<Event>, Arc<WordFate>)> = Vec::new();
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
    fn fail(&self, communicator: Option<Communicator>, running: Vec<(Arc<Event>, Arc<WordFate>)>, why: String) {
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
    fn issue(&self, communicator: &Communicator, stream: &Stream, receive: Receive) -> Result<Arc<Event>> {
        let mut memories = Vec::with_capacity(receive.spans.len());
        for (storage, len) in &receive.spans {
            let memory = storage.chunk.device().ok_or_else(|| Error::internal("a device arena in host memory"))?;
            memories.push((memory, storage.offset, *len));
        }
        communicator.group(|c| {
            for &(memory, offset, len) in &memories {
                c.recv(memory, offset, len, 0, stream)?;
            }
            Ok(())
        })?;
        // One event after the group: the connection's stream waits for it, and it holds every
        // span's memory until the receives are done.
        let done = Arc::new(Event::new(stream.context())?);
        done.record(stream)?;
        for (storage, _) in &receive.spans {
            storage.hold_until(stream, done.clone());
        }
        receive.stream.wait_event(&done)?;
        receive.fate.issued();
        self.wake.ring();
        Ok(done)
    }
}
