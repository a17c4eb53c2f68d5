//! The sender's half of the routes: for one receiver, what each tensor of a message becomes,
//! written as the message's descriptor table (one storage record per span). Mapped routes send
//! the tensors' own storage; copy routes queue the copies on the producer's stream (after its
//! work) and send the copies, whose storage is then what the receiver holds.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};

use ipc_core::{Context, Device, Event, Stream, Uuid};

use crate::error::{Error, Result};
use crate::memory::arena::{Arena, Chunk};
use crate::memory::signal::{Signal, host_signal_pieces, signal_on_peer_after};
use crate::route::Reach;
use crate::route::Routing;
use crate::route::staging_piece;
use crate::route::{Choice, Route, choose};
use crate::send::outgoing::LazySignal;
use crate::sync::lock;
use crate::tensor::Storage;
use crate::tensor::Tensor;
use crate::wire::{Descriptors, Fence, Source, StorageDesc};

/// A message as it goes to one receiver: its descriptor table, the chunks to announce first,
/// and the storage the receiver holds until it releases the message.
pub(crate) struct Prepared<'a> {
    pub table: Descriptors,
    /// The chunks the records name (and copies' signal words): announced before the message.
    pub chunks: Vec<Arc<Chunk>>,
    /// What the receiver maps: the tensors' own storage, or the copies of the bytes they touch.
    pub leases: Vec<Arc<Storage>>,
    /// The sources of the copies queued: kept until the copies are done, from when this is
    /// dropped (after the message's frame is written, or on an error).
    pub copied: CopySources<'a>,
}

/// The sources and destinations of a message's copies, by the stream the copies are queued on.
/// Held from before the first copy is queued; when dropped, an event is recorded on each stream
/// and they go to the arenas' thread until it completes. Dropped with the [`Prepared`] message,
/// so that making and recording the event and waking that thread come after the message's frame
/// is written, not between the copies and the receiver. The destinations are held too, because
/// the receiver's lease is not enough: a receiver that dies at once gives its leases back at the
/// hang-up, maybe before the copy ran (the producer's stream busy), and memory a copy still
/// writes must not go to another message.
pub(crate) struct CopySources<'a>(Vec<(CopyStream<'a>, Vec<Arc<Storage>>)>);

impl<'a> CopySources<'a> {
    /// Holds `sources`, read by copies about to be queued on `stream`; where the stream is kept
    /// (see [`CopySources::stream`], [`CopySources::also`]).
    fn hold(&mut self, stream: CopyStream<'a>, sources: Vec<Arc<Storage>>) -> usize {
        match self.0.iter().position(|(s, _)| s.raw() == stream.raw()) {
            Some(at) => {
                self.0[at].1.extend(sources);
                at
            }
            None => {
                self.0.push((stream, sources));
                self.0.len() - 1
            }
        }
    }

    /// The stream held at `at`, to queue the copies on.
    fn stream(&self, at: usize) -> &Stream {
        &self.0[at].0
    }

    /// Holds `more` (the copies' destinations) with what is held at `at`.
    fn also(&mut self, at: usize, more: Vec<Arc<Storage>>) {
        self.0[at].1.extend(more);
    }
}

impl Drop for CopySources<'_> {
    fn drop(&mut self) {
        for (stream, sources) in self.0.drain(..) {
            let done = Event::new(stream.context()).and_then(|done| done.record(&stream).map(|()| done));
            match done {
                Ok(done) => crate::memory::arena::drop_after(vec![Arc::new(done)], Box::new(sources)),
                Err(error) => {
                    // The copies may still read the sources: wait for them rather than free the
                    // memory under them, and keep it for good if even that fails.
                    tracing::warn!(%error, "no event to hold a message's copy sources by; waiting for the copies");
                    if stream.synchronize().is_err() {
                        std::mem::forget(sources);
                    }
                }
            }
        }
    }
}

/// What the receiver waits for before the first use of a GPU tensor mapped where it is.
pub(crate) enum MappedFence<'a> {
    /// Known already: none, or the connection's event.
    Now(Fence),
    /// The message's signal word, queued when the first tensor mapped where it is needs it.
    Signal(&'a LazySignal<'a>),
}

impl MappedFence<'_> {
    /// The fence, queueing the signal's write if it was not yet; its chunk goes to `chunks`
    /// (announced before the message).
    fn resolve(&self, chunks: &mut Vec<Arc<Chunk>>) -> Result<Fence> {
        match self {
            MappedFence::Now(fence) => Ok(*fence),
            MappedFence::Signal(lazy) => {
                let signal = lazy.get()?;
                if !chunks.iter().any(|c| Arc::ptr_eq(c, &signal.chunk)) {
                    chunks.push(signal.chunk.clone());
                }
                Ok(Fence::Signal { chunk: signal.chunk.id, offset: signal.offset as u64, value: signal.value })
            }
        }
    }
}

/// Tensors must lie this close together in one chunk to move as one copy: a copy call costs
/// about 2 us of enqueue, so a gap is worth copying when it moves in less time than that.
const COALESCE_GAP: usize = 256 << 10;

/// What the tensors of a message become for a receiver with `routing` and `reach`: one storage
/// record per span. Tensors mapped where they are share a record when their storages touch in
/// one chunk; copies are queued per span on `stream` (the producer's), or on a stream of the
/// sender's for a message whose devices were synchronised, and the tensors of a span share its
/// copy. The sources of copies are kept until the copies are done. `fence` is what the receiver
/// waits for before the first use of a GPU tensor mapped where it is (the message's fence; a
/// message with none such queues no signal). `touched` is each tensor's bytes of its storage.
pub(crate) fn prepare<'a>(
    tensors: &[Tensor],
    touched: &[(usize, usize)],
    stream: Option<&'a Stream>,
    receiver: &(Reach, Routing),
    peer_pid: u32,
    fence: MappedFence<'_>,
) -> Result<Prepared<'a>> {
    let (reach, routing) = receiver;
    // Tensors by (route, chunk, target): each group becomes few records.
    let mut groups: Vec<(GroupKey, Vec<usize>)> = Vec::new();
    let mut choices: Vec<(Uuid, Choice)> = Vec::new();
    for (index, tensor) in tensors.iter().enumerate() {
        let key = match tensor.storage.chunk.device_uuid() {
            None => (Route::SameDevice, tensor.storage.chunk.id, None),
            Some(source) => {
                // Decided once per source GPU of the message, not per tensor.
                let choice = match choices.iter().find(|(uuid, _)| *uuid == source) {
                    Some((_, choice)) => choice,
                    None => {
                        let choice = choose(&source, routing, reach, Reach::local())?;
                        if let Some(why) = &choice.slower_because {
                            log_slower_once(peer_pid, source, choice.target, choice.route, why);
                        }
                        choices.push((source, choice));
                        &choices[choices.len() - 1].1
                    }
                };
                (choice.route, tensor.storage.chunk.id, choice.target)
            }
        };
        group(&mut groups, key, index);
    }
    let mut prepared = Prepared {
        table: Descriptors::unrouted(tensors.len()),
        chunks: Vec::new(),
        leases: Vec::new(),
        copied: CopySources(Vec::new()),
    };
    for ((route, _, target), members) in groups {
        let chunk = tensors[members[0]].storage.chunk.clone();
        if matches!(route, Route::SameDevice | Route::PeerMap) {
            let fence = if chunk.device().is_some() { fence.resolve(&mut prepared.chunks)? } else { Fence::None };
            map_in_place(tensors, &members, route, fence, &mut prepared);
            prepared.chunks.push(chunk);
            continue;
        }
        let memory = chunk.device().ok_or_else(|| Error::internal("a device route for host memory"))?;
        let spans = spans(tensors, touched, &members);
        // The sources stay until the copies queued on the stream are done (see `CopySources`).
        let sources = members.iter().map(|&i| tensors[i].storage.clone()).collect();
        let at = prepared.copied.hold(stream_after(stream, memory.context())?, sources);
        let stream = prepared.copied.stream(at);
        let mut destinations = Vec::with_capacity(spans.len());
        for span in spans {
            let (storage, signal) = match route {
                Route::PeerCopy => {
                    let target = target.ok_or_else(|| Error::internal("a peer copy without a target"))?;
                    peer_copy(&chunk, &span, stream, &target)?
                }
                _ => stage(&chunk, &span, stream)?,
            };
            let (id, offset) = (storage.chunk.id, storage.offset as u64);
            let source = match (route, target) {
                (Route::PeerCopy, _) => Source::PeerCopy { chunk: id, offset },
                (Route::Staged, Some(target)) => Source::Staged { chunk: id, offset, target },
                (Route::Host, _) => Source::Host { chunk: id, offset },
                (route, _) => return Err(Error::internal(format_args!("route {route} has no copy source"))),
            };
            let fence = Fence::Signal { chunk: signal.chunk.id, offset: signal.offset as u64, value: signal.value };
            let record = prepared.table.push_storage(StorageDesc { source, len: storage.len as u64, fence });
            for &(index, elem0) in &span.members {
                describe(&mut prepared.table, &tensors[index], index, record, elem0 - span.low);
            }
            prepared.chunks.push(signal.chunk.clone());
            prepared.chunks.push(storage.chunk.clone());
            destinations.push(storage.clone());
            prepared.leases.push(storage);
        }
        prepared.copied.also(at, destinations);
    }
    if let Some(index) = prepared.table.unrouted_tensor() {
        return Err(Error::internal(format_args!("tensor {index} was not routed")));
    }
    Ok(prepared)
}

/// Records for `members` (tensors of one chunk mapped where they are, by `route`): one per run
/// of storages that touch or overlap, so that tensors allocated together (or views of one
/// storage) share one record, and the receiver one storage. Each distinct storage is leased.
fn map_in_place(tensors: &[Tensor], members: &[usize], route: Route, fence: Fence, prepared: &mut Prepared) {
    let mut ranges: Vec<(usize, usize, usize)> = members
        .iter()
        .map(|&index| {
            let storage = &tensors[index].storage;
            (storage.offset, storage.offset + storage.len, index)
        })
        .collect();
    ranges.sort_unstable();
    let chunk = tensors[members[0]].storage.chunk.id;
    let mut at = 0;
    while at < ranges.len() {
        // The run of storages from `at` that touch one another.
        let (low, mut high, _) = ranges[at];
        let mut end = at + 1;
        while end < ranges.len() && ranges[end].0 <= high {
            high = high.max(ranges[end].1);
            end += 1;
        }
        let offset = low as u64;
        let source = match route {
            Route::PeerMap => Source::PeerMap { chunk, offset },
            _ => Source::SameDevice { chunk, offset },
        };
        let record = prepared.table.push_storage(StorageDesc { source, len: (high - low) as u64, fence });
        let mut last: Option<&Arc<Storage>> = None;
        for &(start, _, index) in &ranges[at..end] {
            let tensor = &tensors[index];
            describe(&mut prepared.table, tensor, index, record, start - low + tensor.offset());
            // Views of one storage sort together: each storage is leased once.
            if !last.is_some_and(|last| Arc::ptr_eq(last, &tensor.storage)) {
                prepared.leases.push(tensor.storage.clone());
                last = Some(&tensor.storage);
            }
        }
        at = end;
    }
}

/// Describes tensor `index` as a view of storage record `record` from `view_offset` on.
pub(crate) fn describe(table: &mut Descriptors, tensor: &Tensor, index: usize, record: u32, view_offset: usize) {
    table.set_tensor(index, record, view_offset as u64, tensor.dtype(), tensor.shape(), tensor.strides());
}

/// Tensors copied together: (route, source chunk, target GPU).
type GroupKey = (Route, u64, Option<Uuid>);

/// Streams by (device ordinal, key).
type Streams = Mutex<Vec<(i32, usize, Arc<Stream>)>>;

/// Receiver process, source GPU, target GPU.
type PairKey = (u32, Uuid, Option<Uuid>);

/// Bytes of one chunk that move as one copy, and the tensors in them (with the chunk offset of
/// each one's element 0).
pub(crate) struct Span {
    pub low: usize,
    pub high: usize,
    pub members: Vec<(usize, usize)>,
}

/// The spans of the chunk bytes that `members` touch (`touched`: each tensor's bytes of its
/// storage), merged where gaps are small.
pub(crate) fn spans(tensors: &[Tensor], touched: &[(usize, usize)], members: &[usize]) -> Vec<Span> {
    let mut ranges = Vec::with_capacity(members.len());
    for &index in members {
        let tensor = &tensors[index];
        let (start, end) = touched[index];
        let base = tensor.storage.offset;
        // Starts at a multiple of 16, so every element keeps its alignment in the copy.
        ranges.push(((base + start) / 16 * 16, (base + end).max(base + start + 1), index, base + tensor.offset()));
    }
    ranges.sort_unstable();
    let mut spans: Vec<Span> = Vec::new();
    for (low, high, index, elem0) in ranges {
        match spans.last_mut() {
            Some(span) if low <= span.high + COALESCE_GAP => {
                span.high = span.high.max(high);
                span.members.push((index, elem0));
            }
            _ => spans.push(Span { low, high, members: vec![(index, elem0)] }),
        }
    }
    spans
}

/// Copies `span` of `chunk` into the sender's memory on `target` on `stream` (the copy engine,
/// over the peer link), and fences it on that device.
fn peer_copy(chunk: &Chunk, span: &Span, stream: &Stream, target: &Uuid) -> Result<(Arc<Storage>, Arc<Signal>)> {
    let source = chunk.device().ok_or_else(|| Error::internal("a peer copy of host memory"))?;
    let context = context_with_access(source.context(), target)?;
    let allocation = Arena::device(&context).allocate(span.high - span.low)?;
    // VMM memory is reached by its access list, not by context peer access.
    allocation.chunk.grant_access(source.context())?;
    let destination = allocation.chunk.device().ok_or_else(|| Error::internal("a device arena in host memory"))?;
    stream.copy_async(destination, allocation.offset, source, span.low, span.high - span.low)?;
    // The receiver waits on a word of the target device, which this stream writes over the peer
    // link once the copy is done: no event, and no stream of the target device, per message.
    let Some(signal) = signal_on_peer_after(stream, &context)? else {
        return Err(Error::Invalid(
            "the GPUs have no 64-bit stream memory operations; the peer copy route needs them".into(),
        ));
    };
    Ok((Arc::new(Storage::from_allocation(allocation)), Arc::new(signal)))
}

/// Copies `span` of `chunk` into shared host memory on `stream`, in pieces, each followed by the
/// write of the next value of the stream's host signal word.
fn stage(chunk: &Chunk, span: &Span, stream: &Stream) -> Result<(Arc<Storage>, Arc<Signal>)> {
    let source = chunk.device().ok_or_else(|| Error::internal("staging host memory"))?;
    let len = span.high - span.low;
    let allocation = Arena::host().allocate(len)?;
    let host = allocation.chunk.host().ok_or_else(|| Error::internal("a host arena on a device"))?;
    let registered = host.registered(stream.context())?;
    let piece = staging_piece(len);
    let pieces = len.div_ceil(piece);
    let signal = host_signal_pieces(stream, pieces, |k| {
        let at = k * piece;
        let n = piece.min(len - at);
        Ok(stream.copy_async(&registered, allocation.offset + at, source, span.low + at, n)?)
    })?;
    Ok((Arc::new(Storage::from_allocation(allocation)), Arc::new(signal)))
}

/// The primary context of `target`, with peer access from `source`'s context enabled: looked up
/// once per pair and kept, so that a message neither enumerates the devices nor retains and
/// releases a context (the device arena of `target` holds the context for good anyway).
fn context_with_access(source: &Arc<Context>, target: &Uuid) -> Result<Arc<Context>> {
    static ENABLED: Mutex<Vec<(i32, Uuid, Arc<Context>)>> = Mutex::new(Vec::new());
    let ordinal = source.device().ordinal();
    let mut enabled = lock(&ENABLED);
    if let Some((_, _, context)) = enabled.iter().find(|(o, t, _)| *o == ordinal && t == target) {
        return Ok(context.clone());
    }
    let context = Context::primary(Device::by_uuid(target)?)?;
    source.enable_peer_access(&context)?;
    enabled.push((ordinal, *target, context.clone()));
    Ok(context)
}

/// Adds tensor `index` to the group of `key`, keeping the groups in the order first seen.
pub(crate) fn group<K: PartialEq>(groups: &mut Vec<(K, Vec<usize>)>, key: K, index: usize) {
    match groups.iter_mut().find(|(k, _)| *k == key) {
        Some((_, members)) => members.push(index),
        None => groups.push((key, vec![index])),
    }
}

/// The stream that copies out of a device's memory after the producer's work.
pub(crate) enum CopyStream<'a> {
    /// The producer's own stream, which is that device's: ordered after its work already.
    Producer(&'a Stream),
    /// The sender's copy stream of the device, made to wait for the producer's work, if any.
    Own(Arc<Stream>),
}

impl std::ops::Deref for CopyStream<'_> {
    type Target = Stream;
    fn deref(&self) -> &Stream {
        match self {
            CopyStream::Producer(stream) => stream,
            CopyStream::Own(stream) => stream,
        }
    }
}

/// The stream for copies out of `context`'s device after the work queued on `producer`: the
/// producer's stream itself when it is that device's, else the sender's copy stream of the
/// device, waiting for the producer's work (a message whose devices were synchronised has no
/// producer stream, and nothing to wait for).
pub(crate) fn stream_after<'a>(producer: Option<&'a Stream>, context: &Arc<Context>) -> Result<CopyStream<'a>> {
    match producer {
        Some(stream) if Arc::ptr_eq(stream.context(), context) => Ok(CopyStream::Producer(stream)),
        producer => {
            let own = copy_stream(context)?;
            if let Some(producer) = producer {
                // The producer's stream is another device's: the copies wait for its work.
                let produced = Event::new(producer.context())?;
                produced.record(producer)?;
                own.wait_event(&produced)?;
            }
            Ok(CopyStream::Own(own))
        }
    }
}

/// A stream of the sender's own per device: for copies of a message whose devices were
/// synchronised (no producer stream), or whose producer stream is another device's.
pub(crate) fn copy_stream(context: &Arc<Context>) -> Result<Arc<Stream>> {
    static STREAMS: OnceLock<Streams> = OnceLock::new();
    stream_for(&STREAMS, context, 0)
}

/// The stream of `context`'s device for `key` in `streams`, made on first use.
fn stream_for(streams: &'static OnceLock<Streams>, context: &Arc<Context>, key: usize) -> Result<Arc<Stream>> {
    let mut streams = lock(streams.get_or_init(Default::default));
    let ordinal = context.device().ordinal();
    if let Some((_, _, stream)) = streams.iter().find(|(o, k, _)| *o == ordinal && *k == key) {
        return Ok(stream.clone());
    }
    let stream = Arc::new(Stream::new(context)?);
    streams.push((ordinal, key, stream.clone()));
    Ok(stream)
}

/// Logs, once per receiver process and GPU pair, a route slower than the pair allows.
fn log_slower_once(peer_pid: u32, source: Uuid, target: Option<Uuid>, route: Route, why: &str) {
    static LOGGED: Mutex<Option<HashSet<PairKey>>> = Mutex::new(None);
    let mut logged = lock(&LOGGED);
    if logged.get_or_insert_with(HashSet::new).insert((peer_pid, source, target)) {
        let target = target.map_or_else(|| "host memory".to_string(), |t| t.to_string());
        tracing::info!(peer_pid, %source, %target, %route, why, "a slower route than the GPUs' link allows");
    }
}
