//! The sender's half of the routes to a receiver on another host (a TCP channel): host bytes
//! over the link ([`Route::Tcp`]) and GPU data through NCCL ([`Route::Nccl`]). The receiver's
//! half is `recv/remote.rs`.
//!
//! # Host bytes
//! A message's host bytes are one bulk run on the link (`ipc_core::tcp::Bulk`), written after
//! its new communicators' frames and before the message's: pieces of the tensors' own storage
//! (none copied in this process; a GPU tensor's bytes are copied to the host first), at
//! [`ALIGN`]ed offsets. The run holds the storages and the message's lease until its last byte
//! is in the socket, so `wait_released` still means the data has left this process. A GPU
//! tensor bound for the receiver's host memory is copied into pageable memory (a CPU wait each);
//! a small message's GPU tensors bound for the receiver's GPU (below) into pinned host memory
//! (the host arena's chunks, registered once and reused), queued on the producer's stream, all
//! of the message's before one wait for them. (Large tensors would register large chunks.)
//!
//! # Small messages inline
//! A message whose GPU tensors (all bound for NCCL) total at most the sender's threshold
//! (`route::inlines`: [`DEFAULT_INLINE_GPU_UP_TO`](crate::route::DEFAULT_INLINE_GPU_UP_TO) by
//! default) goes without NCCL: its GPU tensors' bytes are copied to the host after the producer's
//! work, as for a receiver without a GPU, and travel in the message's bulk run as
//! [`Source::BytesToGpu`] records naming the GPU NCCL would have landed them on. An NCCL pair
//! costs about 75 us a side whatever its size; the copies of a small tensor 10-20 us.
//!
//! # NCCL
//! Each (sender GPU, receiver GPU) pair of a connection gets a communicator of two ranks, the
//! sender rank 0. The sender makes the unique id and sends it in a `Communicator` frame; both
//! sides start NCCL's non-blocking initialisation, and the communicator's worker thread waits for
//! it, so `send` never waits for the receiver to come to `recv` (two processes that each send
//! first and then receive cannot deadlock). Transfers wait in order in its queue, holding their
//! sources.
//!
//! A message's tensors on one GPU move as one NCCL group: tensors that lie within 256 KiB of
//! each other in one chunk move as one span (`send::spans`), so a message of many small tensors
//! is a few transfers, not one each. A worker thread per communicator issues them (NCCL may wait
//! inside a call for the receiver to take part, which it can only do once it has read the
//! message frame: `send` must have written that frame already). The sends run on a stream of
//! the communicator's, which first waits (an event) for the producer's work: the producer's
//! stream never blocks on the receiver, as with `torch.distributed`, which does the same. A
//! transfer holds the message's whole table of tensors (one count, not one per storage), so no
//! tensor's memory goes back to the arena, to be written by the next tensor made there, before
//! the sends are done on the GPU.

use std::sync::Arc;
use std::time::Duration;

use ipc_core::nccl::{Communicator, UniqueId};
use ipc_core::tcp::{Bulk, Piece, SharedBytes};
use ipc_core::{Context, Device, Event, Stream, Uuid};

use super::routes::{CopyStream, describe, group, spans, stream_after};
use crate::error::{Error, Result};
use crate::fences::liveness::{Gone, Liveness};
use crate::links::nccl::{Next, WorkQueue, Workers};
use crate::memory::arena::Arena;
use crate::route::Reach;
use crate::route::Routing;
use crate::route::{choose_remote, inlines};
use crate::tensor::Storage;
use crate::tensor::Tensor;
use crate::wire::{Descriptors, Fence, MAX_INLINE_BYTES, Source, StorageDesc, ToReceiver};

/// How long an NCCL communicator may take to set up, and bounds its waits.
pub(crate) const NCCL_TIMEOUT: Duration = Duration::from_secs(60);

/// Host bytes start at multiples of this in a message's bytes, so every element stays aligned.
const ALIGN: usize = 16;

/// A message as it goes to a receiver on another host: the frames to write before it, and the
/// NCCL transfers to queue once they are all written ([`RemoteMessage::written`]), so that the
/// receiver always has the frames a transfer's set-up needs from it.
pub(crate) struct RemoteMessage {
    pub descriptors: Descriptors,
    /// New communicators' frames.
    pub frames: Vec<ToReceiver>,
    /// The host tensors' bytes (and GPU tensors' copied to the host), written after the frames
    /// straight from the tensors' memory as one bulk run: the message's lease ends once it is
    /// in the socket.
    pub bulk: Option<Bulk>,
    transfers: Vec<(Arc<SendComm>, Transfer)>,
    /// The communicators made for this message (forgotten if it is never written).
    created: Vec<u32>,
}

impl RemoteMessage {
    /// The message and its frames are written: its NCCL sends may go.
    pub fn written(self) -> Result<()> {
        for (comm, transfer) in self.transfers {
            comm.queue.submit(transfer)?;
        }
        Ok(())
    }
}

/// The sender's communicators of one connection.
#[derive(Default)]
pub(crate) struct SendComms {
    next_id: u32,
    pairs: Vec<(Uuid, Uuid, Arc<SendComm>)>,
    workers: Workers,
}

/// One communicator of a connection (rank 0 on the sender's GPU), driven by a worker thread
/// that owns it (see `worker.rs`): `send` only queues transfers, so it never waits for NCCL, and
/// NCCL's waits for the receiver (the set-up, a connection a transfer needs) never hold up the
/// message frame the receiver needs to take part.
pub(crate) struct SendComm {
    pub id: u32,
    queue: WorkQueue<Transfer>,
    /// The connection's liveness (`fences/liveness.rs`), told when the communicator fails.
    liveness: Arc<Liveness>,
}

/// One message's spans on one communicator.
struct Transfer {
    /// Recorded on the producer's stream after its work (`None`: the device was synchronised).
    after: Option<Event>,
    /// (a source storage, byte offset in its chunk memory, length).
    spans: Vec<(Arc<Storage>, usize, usize)>,
    /// The message's tensors: no storage the spans read goes back to its arena (and to another
    /// tensor) before the sends are done.
    sources: Arc<Vec<Tensor>>,
    /// The message's lease at the sender: it ends when every transfer of the message has been
    /// sent (or given up).
    lease: Arc<dyn Send + Sync>,
}

impl SendComms {
    /// The communicator for tensors from `source` landing on `target`: made on first use, its
    /// `Communicator` frame given to `announce` (which sends it before the message).
    fn get(
        &mut self,
        source: Uuid,
        target: Uuid,
        announce: &mut Vec<ToReceiver>,
        created: &mut Vec<u32>,
        alive: &(impl Fn() -> bool + Clone + Send + 'static),
        liveness: &Arc<Liveness>,
    ) -> Result<Arc<SendComm>> {
        if let Some((_, _, comm)) = self.pairs.iter().find(|(s, t, _)| *s == source && *t == target) {
            return Ok(comm.clone());
        }
        let context = Context::primary(Device::by_uuid(&source)?)?;
        let unique_id = UniqueId::new()?;
        self.next_id += 1;
        let id = self.next_id;
        let mut communicator = Communicator::start(&context, &unique_id, 2, 0, NCCL_TIMEOUT)?;
        communicator.watch(alive.clone());
        let stream = Stream::new(&context)?;
        let comm = Arc::new(SendComm { id, queue: WorkQueue::new(), liveness: liveness.clone() });
        let worker = comm.clone();
        self.workers.spawn("tq-nccl-send", move || worker.work(communicator, stream))?;
        announce.push(ToReceiver::Communicator { id, unique_id: unique_id.to_bytes().to_vec(), target: target.0 });
        self.pairs.push((source, target, comm.clone()));
        created.push(id);
        Ok(comm)
    }

    /// Forgets the communicators made for `message`, which was never written (the receiver never
    /// heard of them); its transfers are dropped, and with them its lease.
    pub fn unwritten(&mut self, message: RemoteMessage) {
        self.pairs.retain(|(_, _, comm)| {
            let made = message.created.contains(&comm.id);
            if made {
                comm.queue.stop(true);
            }
            !made
        });
    }

    /// Aborts every communicator (the receiver is gone): queued sends are dropped, and the
    /// sources of those sent come back once the streams drain.
    pub fn abort(&mut self) {
        for (_, _, comm) in self.pairs.drain(..) {
            comm.queue.stop(true);
        }
    }

    /// Lets every communicator go once its queued sends are issued, and waits for the workers
    /// (each finalizes its communicator, bounded by [`NCCL_TIMEOUT`]).
    pub fn close(&mut self) {
        for (_, _, comm) in self.pairs.drain(..) {
            comm.queue.stop(false);
        }
        self.workers.join();
    }
}

impl Drop for SendComms {
    fn drop(&mut self) {
        for (_, _, comm) in &self.pairs {
            comm.queue.stop(false);
        }
    }
}

impl SendComm {
    /// The worker: waits for the set-up, then sends each queued transfer in order.
    fn work(&self, communicator: Communicator, stream: Stream) {
        if let Err(error) = communicator.wait_until_ready() {
            tracing::warn!(%error, comm = self.id, "an NCCL communicator to a receiver failed to set up");
            self.liveness.report(Gone::Nccl(error.to_string()));
            return self.fail(communicator, error.to_string());
        }
        loop {
            match self.queue.next() {
                Next::Job(transfer) => {
                    if let Err(error) = issue(&communicator, &stream, transfer) {
                        tracing::warn!(%error, comm = self.id, "an NCCL send failed");
                        self.liveness.report(Gone::Nccl(error.to_string()));
                        return self.fail(communicator, error.to_string());
                    }
                }
                Next::Closed => return, // the communicator finalizes as it drops
                Next::Aborted => return self.fail(communicator, "the receiver is gone".into()),
            }
        }
    }

    /// Gives up: later sends fail with `why`, queued ones are dropped (their leases end).
    fn fail(&self, communicator: Communicator, why: String) {
        communicator.abort();
        drop(self.queue.fail(why));
    }
}

/// Queues the transfer's sends as one group on `stream`, after the producer's work; its sources
/// go back once they are done.
fn issue(communicator: &Communicator, stream: &Stream, transfer: Transfer) -> Result<()> {
    if let Some(after) = &transfer.after {
        stream.wait_event(after)?;
    }
    let mut sends = Vec::with_capacity(transfer.spans.len());
    for (storage, offset, len) in &transfer.spans {
        let memory = storage.chunk.device().ok_or_else(|| Error::internal("an NCCL send of host memory"))?;
        sends.push((memory, *offset, *len));
    }
    communicator.group(|c| {
        for &(memory, offset, len) in &sends {
            c.send(memory, offset, len, 1, stream)?;
        }
        Ok(())
    })?;
    let done = Event::new(stream.context())?;
    done.record(stream)?;
    crate::memory::arena::drop_after(
        vec![Arc::new(done)],
        Box::new((transfer.spans, transfer.sources, transfer.lease)),
    );
    Ok(())
}

/// What the tensors of a message become for a receiver on another host with `receiver`'s GPUs
/// and policy: descriptors, frames (new communicators, host bytes), and NCCL transfers (after
/// the producer's work on `stream`) that hold `lease` until they are done; or, when its GPU
/// tensors total at most `inline_up_to` bytes, no transfers: their bytes go with the host bytes
/// (see the module docs). New communicators' waits give up once `alive` says the receiver is
/// gone; their failures are reported to `liveness`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare(
    tensors: &Arc<Vec<Tensor>>,
    touched: &[(usize, usize)],
    stream: Option<&Stream>,
    receiver: &(Reach, Routing),
    inline_up_to: u64,
    comms: &mut SendComms,
    lease: Arc<dyn Send + Sync>,
    alive: &(impl Fn() -> bool + Clone + Send + 'static),
    liveness: &Arc<Liveness>,
) -> Result<RemoteMessage> {
    let mut frames = Vec::new();
    let mut created = Vec::new();
    let mut transfers: Vec<(Arc<SendComm>, Transfer)> = Vec::new();
    let (reach, routing) = receiver;
    let mut descriptors = Descriptors::unrouted(tensors.len());
    // Tensors whose bytes go in the run, with the GPU they land on (`None`: host memory).
    let mut inlined: Vec<(usize, Option<Uuid>)> = Vec::new();
    // GPU tensors by (source, target, chunk): each pair of GPUs moves its tensors as one group,
    // and a chunk's tensors as few spans.
    let mut groups: Vec<((Uuid, Uuid, u64), Vec<usize>)> = Vec::new();
    // The receiver's GPU for each source GPU of the message, chosen once.
    let mut targets: Vec<(Uuid, Option<Uuid>)> = Vec::new();
    let mut gpu_bytes = 0u64;
    for (index, tensor) in tensors.iter().enumerate() {
        let chunk = &tensor.storage.chunk;
        let Some(source) = chunk.device_uuid() else {
            inlined.push((index, None));
            continue;
        };
        let target = match targets.iter().find(|(from, _)| *from == source) {
            Some(&(_, target)) => target,
            None => {
                let target = choose_remote(&source, routing, reach)?.target;
                targets.push((source, target));
                target
            }
        };
        match target {
            Some(target) => {
                gpu_bytes = gpu_bytes.saturating_add(inline_len(touched[index]) as u64);
                group(&mut groups, (source, target, chunk.id), index);
            }
            None => inlined.push((index, None)),
        }
    }
    // A small message's GPU tensors go inline too, all of them (in the message's order, so the
    // run is laid out the same whichever way each tensor goes).
    if inlines(gpu_bytes, inline_up_to, routing.strict) {
        for ((_, target, _), members) in groups.drain(..) {
            inlined.extend(members.into_iter().map(|index| (index, Some(target))));
        }
        inlined.sort_unstable_by_key(|&(index, _)| index);
    }
    let (pieces, piece_of) = by_storage(tensors, touched, &inlined);
    // Refused before a byte is copied: a message over the limit must not cost its size first.
    let mut size = 0usize;
    for piece in &pieces {
        size = size.next_multiple_of(ALIGN) + inline_len(piece.touched);
    }
    if size as u64 > MAX_INLINE_BYTES {
        return Err(Error::TooLarge { size, limit: MAX_INLINE_BYTES as usize });
    }
    let bulk = match pieces.is_empty() {
        true => None,
        false => {
            let mut run = Run { pieces: Vec::with_capacity(2 * pieces.len()), len: 0, copying: Vec::new() };
            let mut laid = Vec::with_capacity(pieces.len()); // each piece's record and start
            for piece in &pieces {
                let storage = &tensors[piece.first].storage;
                laid.push(run.inline(storage, piece.touched, piece.target, stream, &mut descriptors)?);
            }
            for (&(index, _), &piece) in inlined.iter().zip(&piece_of) {
                let (record, start) = laid[piece];
                describe(&mut descriptors, &tensors[index], index, record, tensors[index].offset() - start);
            }
            Some(Bulk::new(run.finish()?, Box::new(lease.clone()))?)
        }
    };
    for ((source, target, _), members) in groups {
        let comm = match comms.get(source, target, &mut frames, &mut created, alive, liveness) {
            Ok(comm) => comm,
            Err(error) => {
                comms.unwritten(RemoteMessage { descriptors, frames, bulk: None, transfers, created });
                return Err(error);
            }
        };
        // One transfer per communicator, whatever the chunks its tensors lie in.
        let at = match transfers.iter().position(|(queued, _)| queued.id == comm.id) {
            Some(at) => at,
            None => {
                let after = match stream {
                    // The tests' negative control: sends that do not wait for the producer's work.
                    Some(_) if crate::switches::skip_ordering() => None,
                    Some(stream) => {
                        let produced = Event::new(stream.context())?;
                        produced.record(stream)?;
                        Some(produced)
                    }
                    None => None,
                };
                let transfer = Transfer { after, spans: Vec::new(), sources: tensors.clone(), lease: lease.clone() };
                transfers.push((comm.clone(), transfer));
                transfers.len() - 1
            }
        };
        let transfer = &mut transfers[at].1;
        for span in spans(tensors, touched, &members) {
            // The communicator's records, in order, are its transfers.
            let len = span.high - span.low;
            let source = Source::Nccl { communicator: comm.id };
            let record = descriptors.push_storage(StorageDesc { source, len: len as u64, fence: Fence::None });
            for &(member, elem0) in &span.members {
                describe(&mut descriptors, &tensors[member], member, record, elem0 - span.low);
            }
            let storage = tensors[span.members[0].0].storage.clone();
            // The span is in chunk coordinates; the storage's memory is the whole chunk.
            transfer.spans.push((storage, span.low, len));
        }
    }
    if let Some(index) = descriptors.unrouted_tensor() {
        return Err(Error::internal(format_args!("tensor {index} was not routed")));
    }
    Ok(RemoteMessage { descriptors, frames, bulk, transfers, created })
}

/// Bytes of the run for views of one storage that share bytes (the same tensor twice, slices
/// that overlap): those of the storage that any of them touches.
struct InlinePiece {
    /// The first of the views, in the message's order.
    first: usize,
    /// The bytes of their storage they touch, together.
    touched: (usize, usize),
    /// The receiver's GPU they land on (`None`: host memory); one for a storage's views.
    target: Option<Uuid>,
}

/// The pieces of the run for `inlined` (tensor, landing GPU), in the order of each one's first
/// view, and the piece of each of `inlined`: views of one storage whose bytes overlap go once,
/// as one record, and stay views of one storage at the receiver, as on the local routes. (They
/// went once per view: ten clones of a 32 MiB tensor cost 320 MiB on the wire and at the
/// receiver, a 32 MiB message could be refused as over 4 GiB, and the views came apart: outside
/// tester, Rust round 10.) Views that do not overlap go apart: one piece from the first byte of
/// one to the last of the other would carry the bytes between (two 1 KiB ends of a 1 GiB
/// storage cost 1 GiB: the second outside check). No allocation per tensor: one sort finds them.
fn by_storage(
    tensors: &[Tensor],
    touched: &[(usize, usize)],
    inlined: &[(usize, Option<Uuid>)],
) -> (Vec<InlinePiece>, Vec<usize>) {
    let bytes = |at: usize| touched[inlined[at].0];
    let storage = |at: usize| Arc::as_ptr(&tensors[inlined[at].0].storage) as usize;
    // By storage and first byte: a run of one storage's views each starting (aligned, as
    // `Run::inline` lays it out) before the run's bytes so far end is one piece, led by the
    // first of them in the message.
    let mut sorted: Vec<(usize, usize, usize)> = (0..inlined.len()).map(|at| (storage(at), bytes(at).0, at)).collect();
    sorted.sort_unstable();
    let mut leader = vec![0usize; inlined.len()];
    let mut begin = 0;
    while begin < sorted.len() {
        let (mut next, mut end) = (begin + 1, bytes(sorted[begin].2).1);
        while next < sorted.len() && sorted[next].0 == sorted[begin].0 && sorted[next].1 / ALIGN * ALIGN <= end {
            end = end.max(bytes(sorted[next].2).1);
            next += 1;
        }
        let first = sorted[begin..next].iter().map(|&(_, _, at)| at).min().unwrap_or(sorted[begin].2);
        for &(_, _, at) in &sorted[begin..next] {
            leader[at] = first;
        }
        begin = next;
    }
    let mut pieces: Vec<InlinePiece> = Vec::with_capacity(inlined.len());
    let mut piece_of: Vec<usize> = Vec::with_capacity(inlined.len());
    for (at, &(index, target)) in inlined.iter().enumerate() {
        let piece = match leader[at] {
            first if first == at => {
                pieces.push(InlinePiece { first: index, touched: touched[index], target });
                pieces.len() - 1
            }
            first => {
                let piece = piece_of[first];
                let together = &mut pieces[piece].touched;
                *together = (together.0.min(touched[index].0), together.1.max(touched[index].1));
                piece
            }
        };
        piece_of.push(piece);
    }
    (pieces, piece_of)
}

/// How many bytes [`Run::inline`] appends for views that touch `touched` of their storage:
/// those, from an aligned start.
fn inline_len((start, end): (usize, usize)) -> usize {
    (end - start / ALIGN * ALIGN).max(1)
}

/// A message's host bytes as one bulk run being laid out: pieces of the tensors' own memory
/// (none copied), padding between them, and GPU tensors' bytes copied to the host.
struct Run<'a> {
    pieces: Vec<Piece>,
    /// Bytes laid out so far.
    len: usize,
    /// The streams GPU tensors' copies to the host were queued on, each once: [`Run::finish`]
    /// waits for them.
    copying: Vec<CopyStream<'a>>,
}

/// A run given up halfway (an error) still waits for the copies it queued: the pinned memory
/// they write goes back to the arena when its pieces drop.
impl Drop for Run<'_> {
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

impl<'a> Run<'a> {
    /// Appends the bytes `touched` of `storage` (from an aligned start; a GPU storage's are
    /// copied to the host first, after the producer's work: see the module docs) and records
    /// where they lie in the run, landing in host memory or on the receiver's GPU `target`: the
    /// record, and the storage offset its bytes start at (where its views' offsets count from).
    fn inline(
        &mut self,
        storage: &Arc<Storage>,
        touched: (usize, usize),
        target: Option<Uuid>,
        stream: Option<&'a Stream>,
        descriptors: &mut Descriptors,
    ) -> Result<(u32, usize)> {
        let (start, end) = touched;
        let start = start / ALIGN * ALIGN;
        let at = self.len.next_multiple_of(ALIGN);
        let len = inline_len(touched);
        if (at + len) as u64 > MAX_INLINE_BYTES {
            return Err(Error::TooLarge { size: at + len, limit: MAX_INLINE_BYTES as usize });
        }
        self.pad(at - self.len);
        let have = (end - start).min(len);
        match (storage.chunk.host(), storage.chunk.device()) {
            // Written straight from the storage, which the run holds until then.
            (Some(_), _) => {
                let memory: Arc<dyn SharedBytes> = storage.clone();
                self.pieces.push(Piece::Shared { memory, offset: storage.offset + start, len: have });
            }
            (None, Some(memory)) if target.is_none() => {
                let stream = stream_after(stream, memory.context())?;
                let mut staged = vec![0u8; have];
                stream.copy_to_host(memory, storage.offset + start, &mut staged)?;
                self.pieces.push(Piece::Owned(staged));
            }
            (None, Some(memory)) => {
                let copy = stream_after(stream, memory.context())?;
                let staged = Arc::new(Storage::from_allocation(Arena::host().allocate(have.max(1))?));
                let host = staged.chunk.host().ok_or_else(|| Error::internal("a host arena on a device"))?;
                let pinned = host.registered(copy.context())?;
                copy.copy_async(&pinned, staged.offset, memory, storage.offset + start, have)?;
                if !self.copying.iter().any(|queued| queued.raw() == copy.raw()) {
                    self.copying.push(copy);
                }
                let offset = staged.offset;
                self.pieces.push(Piece::Shared { memory: staged, offset, len: have });
            }
            (None, None) => return Err(Error::internal("a tensor in neither host nor device memory")),
        }
        self.len = at + have;
        self.pad(len - have); // an empty view still takes a byte
        let source = match target {
            Some(target) => Source::BytesToGpu { offset: at as u64, target },
            None => Source::Bytes { offset: at as u64 },
        };
        Ok((descriptors.push_storage(StorageDesc { source, len: len as u64, fence: Fence::None }), start))
    }

    /// The run's pieces, once the copies of GPU tensors' bytes are done (a CPU wait: after the
    /// producer's work).
    fn finish(mut self) -> Result<Vec<Piece>> {
        let waited = self.wait();
        waited.map(|()| std::mem::take(&mut self.pieces))
    }

    /// Waits for every copy queued, each stream's even after one failed (a wait that fails
    /// means the device failed: no copy still runs then); the first failure.
    fn wait(&mut self) -> Result<()> {
        let mut first = Ok(());
        for stream in std::mem::take(&mut self.copying) {
            if let Err(error) = stream.synchronize() {
                first = first.and(Err(error.into()));
            }
        }
        first
    }

    /// Appends `n` (< [`ALIGN`]) zeros.
    fn pad(&mut self, n: usize) {
        if n > 0 {
            self.pieces.push(Piece::Zeros(n));
            self.len += n;
        }
    }
}
