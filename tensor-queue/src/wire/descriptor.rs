//! A message's descriptor table: one record per storage the receiver builds (a span of a chunk
//! it maps, a copy it lands, an NCCL transfer, a range of the message's host bytes), each with a
//! typed [`Source`] per route and the fence its first use waits for; and one row per tensor
//! (dtype, view offset, shape and strides) naming its record by index. Shapes and strides of all
//! tensors lie in two flat buffers of the table, so neither side allocates per tensor. Here are
//! their encoding and the checks [`ToReceiver::decode`](super::ToReceiver::decode) makes of each record
//! and each tensor.

use ipc_core::Uuid;
use ipc_core::layout::strided_byte_span;

use super::{FrameError, Reader, Writer};
use crate::route::Route;
use crate::tensor::dtype::DType;
use crate::tensor::layout::{MAX_DIMS, check_layout};

const FENCE_NONE: u8 = 0;
const FENCE_EVENT: u8 = 1;
const FENCE_SIGNAL: u8 = 2;

/// The kind of memory a chunk announcement maps.
///
/// ```
/// use tensor_queue::testing::wire::{ChunkKind, Frame, ToReceiver};
/// // A host chunk's announcement: its shared-memory descriptor travels beside the frame.
/// let (kind, legacy) = (ChunkKind::Host, None);
/// let announce = ToReceiver::Chunk { id: 7, len: 64 << 20, kind, device: [0; 16], legacy, writable: false };
/// assert_eq!(ToReceiver::decode(&announce.encode()), Ok(announce));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ChunkKind {
    /// A shared-memory file; its descriptor is attached.
    Host = 1,
    /// VMM device memory; its descriptor is attached.
    Vmm = 2,
    /// A `cuMemAlloc` buffer; the legacy handle is in the frame.
    Legacy = 3,
}

/// Where a storage record's bytes are, one variant per route (see [`crate::route`]): each
/// variant has only the fields its route gives meaning to.
///
/// ```
/// use tensor_queue::route::Route;
/// use tensor_queue::testing::wire::Source;
/// let staged = Source::Staged { chunk: 4, offset: 0, target: tensor_queue::Uuid([1; 16]) };
/// assert_eq!(staged.route(), Route::Staged);
/// assert_eq!(staged.chunk_range(), Some((4, 0)));
/// assert_eq!(Source::Nccl { communicator: 1 }.chunk_range(), None); // no chunk: a transfer
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The sender's memory on this machine, mapped where it is: host memory, or a GPU the
    /// tensor is used on ([`Route::SameDevice`]).
    SameDevice {
        /// The announced chunk.
        chunk: u64,
        /// Where the storage starts in the chunk.
        offset: u64,
    },
    /// The sender's GPU memory, mapped for another GPU over the peer link ([`Route::PeerMap`]).
    PeerMap {
        /// The announced chunk.
        chunk: u64,
        /// Where the storage starts in the chunk.
        offset: u64,
    },
    /// A copy the sender made on the receiver's GPU over the peer link ([`Route::PeerCopy`]).
    PeerCopy {
        /// The announced chunk holding the copy.
        chunk: u64,
        /// Where the copy starts in the chunk.
        offset: u64,
    },
    /// A copy the sender made in shared host memory, used there ([`Route::Host`]).
    Host {
        /// The announced host chunk holding the copy.
        chunk: u64,
        /// Where the copy starts in the chunk.
        offset: u64,
    },
    /// A copy the sender made in shared host memory, which the receiver copies onto its GPU
    /// `target` ([`Route::Staged`]; the sender chose the GPU from the receiver's policy).
    Staged {
        /// The announced host chunk holding the copy.
        chunk: u64,
        /// Where the copy starts in the chunk.
        offset: u64,
        /// The receiver's GPU it lands on.
        target: Uuid,
    },
    /// One NCCL transfer on the communicator `communicator` from a sender on another host
    /// ([`Route::Nccl`]). A message's records of one communicator are its transfers in the order
    /// both sides queue them; the record's length is the transfer's.
    Nccl {
        /// The sender's id for the communicator (its `Communicator` frame).
        communicator: u32,
    },
    /// Bytes of the host tensors that came over TCP before the message ([`ToReceiver::Bytes`](super::ToReceiver::Bytes),
    /// [`Route::Tcp`]), from `offset` on.
    Bytes {
        /// Where the storage starts in the message's bytes.
        offset: u64,
    },
    /// Bytes of a GPU tensor of a small message that came over TCP with the host tensors' (as
    /// [`Source::Bytes`], [`Route::Tcp`]) rather than through NCCL: the receiver copies them onto
    /// its GPU `target` (the sender chose it from the receiver's policy, as for NCCL).
    BytesToGpu {
        /// Where the storage starts in the message's bytes.
        offset: u64,
        /// The receiver's GPU it lands on.
        target: Uuid,
    },
}

/// The wire code of a [`Source::BytesToGpu`] record: the codes below it are the routes' own
/// (`Route::code`), one per route; this one shares [`Route::Tcp`] with [`Source::Bytes`].
const BYTES_TO_GPU: u8 = 7;

impl Source {
    /// The route this source travels by.
    pub fn route(&self) -> Route {
        match self {
            Source::SameDevice { .. } => Route::SameDevice,
            Source::PeerMap { .. } => Route::PeerMap,
            Source::PeerCopy { .. } => Route::PeerCopy,
            Source::Host { .. } => Route::Host,
            Source::Staged { .. } => Route::Staged,
            Source::Nccl { .. } => Route::Nccl,
            Source::Bytes { .. } | Source::BytesToGpu { .. } => Route::Tcp,
        }
    }

    /// For a source in an announced chunk: the chunk and where the storage starts in it.
    pub fn chunk_range(&self) -> Option<(u64, u64)> {
        match *self {
            Source::SameDevice { chunk, offset }
            | Source::PeerMap { chunk, offset }
            | Source::PeerCopy { chunk, offset }
            | Source::Host { chunk, offset }
            | Source::Staged { chunk, offset, .. } => Some((chunk, offset)),
            Source::Nccl { .. } | Source::Bytes { .. } | Source::BytesToGpu { .. } => None,
        }
    }

    /// Where the storage starts in what the source names (a chunk, the message's bytes; an NCCL
    /// transfer is its storage, from 0).
    pub fn offset(&self) -> u64 {
        match *self {
            Source::Nccl { .. } => 0,
            Source::Bytes { offset } | Source::BytesToGpu { offset, .. } => offset,
            _ => self.chunk_range().map_or(0, |(_, offset)| offset),
        }
    }
}

/// One storage of a message: the receiver builds one storage per record, which every tensor
/// naming the record shares.
///
/// ```
/// use tensor_queue::testing::wire::{Fence, Source, StorageDesc};
/// let record = StorageDesc { source: Source::SameDevice { chunk: 1, offset: 4096 }, len: 4096, fence: Fence::None };
/// assert_eq!(record.source.offset(), 4096);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageDesc {
    /// Where the bytes are.
    pub source: Source,
    /// The storage's length.
    pub len: u64,
    /// What the receiver waits for before the first use of the storage's tensors (a host
    /// signal for [`Source::Host`] and [`Source::Staged`]; nothing for NCCL and TCP bytes, which
    /// decoding checks).
    pub fence: Fence,
}

/// One tensor of a message: a view of a storage record. Its shape and strides lie in the
/// table ([`Descriptors::shape`], [`Descriptors::strides`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// The index of its storage record in the message's table.
    pub storage: u32,
    /// Bytes from the storage's start to element 0.
    pub view_offset: u64,
    /// Element type.
    pub dtype: DType,
    /// Its dimensions.
    ndim: u8,
    /// Where its sizes and strides start in the table's flat buffers.
    dims: u32,
}

/// A message's descriptor table: its storage records and its tensors, in the order the payload
/// refers to them.
///
/// ```
/// use tensor_queue::DType;
/// use tensor_queue::testing::wire::{Descriptors, Fence, Frame, FrameError, Source, StorageDesc, ToReceiver};
/// let mut table = Descriptors::default();
/// let storage = table.push_storage(StorageDesc {
///     source: Source::SameDevice { chunk: 1, offset: 512 }, len: 96, fence: Fence::None,
/// });
/// table.push_tensor(storage, 0, DType::F32, &[3, 4], &[4, 1]); // two tensors, one storage
/// table.push_tensor(storage, 48, DType::F32, &[12], &[1]);
/// let message = |tensors| ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors, payload: vec![] }.encode();
/// assert!(ToReceiver::decode(&message(table.clone())).is_ok());
/// table.push_tensor(storage, 48, DType::F32, &[13], &[1]); // 52 bytes of view in the last 48 of storage
/// assert!(matches!(ToReceiver::decode(&message(table.clone())), Err(FrameError::OutOfBounds { index: 2, .. })));
/// ```
#[derive(Clone, Debug, Default)]
pub struct Descriptors {
    storages: Vec<StorageDesc>,
    tensors: Vec<TensorDesc>,
    shapes: Vec<u64>,
    strides: Vec<i64>,
}

/// A tensor row not yet given a storage (see [`Descriptors::unrouted`]).
const UNROUTED: TensorDesc = TensorDesc { storage: u32::MAX, view_offset: 0, dtype: DType::U8, ndim: 0, dims: 0 };

impl PartialEq for Descriptors {
    /// The same records and the same tensors (wherever their dimensions lie in the buffers).
    fn eq(&self, other: &Descriptors) -> bool {
        self.storages == other.storages
            && self.tensors.len() == other.tensors.len()
            && (0..self.tensors.len()).all(|i| {
                let (a, b) = (&self.tensors[i], &other.tensors[i]);
                (a.storage, a.view_offset, a.dtype) == (b.storage, b.view_offset, b.dtype)
                    && self.shape(i) == other.shape(i)
                    && self.strides(i) == other.strides(i)
            })
    }
}

impl Eq for Descriptors {}

impl Descriptors {
    /// A table of `tensors` rows, each still to be given its storage ([`Descriptors::set_tensor`]),
    /// for a sender that routes tensors out of order.
    pub fn unrouted(tensors: usize) -> Descriptors {
        Descriptors {
            storages: Vec::new(),
            tensors: vec![UNROUTED; tensors],
            shapes: Vec::with_capacity(tensors),
            strides: Vec::with_capacity(tensors),
        }
    }

    /// Adds a storage record; its index, for the tensors that name it.
    pub fn push_storage(&mut self, storage: StorageDesc) -> u32 {
        self.storages.push(storage);
        (self.storages.len() - 1) as u32
    }

    /// Adds a tensor, a view of record `storage` (not checked here: [`ToReceiver::decode`](super::ToReceiver::decode)
    /// checks what a peer sends).
    pub fn push_tensor(&mut self, storage: u32, view_offset: u64, dtype: DType, shape: &[u64], strides: &[i64]) {
        self.tensors.push(UNROUTED);
        self.set_tensor(self.tensors.len() - 1, storage, view_offset, dtype, shape, strides);
    }

    /// Describes tensor `index` (of a table made by [`Descriptors::unrouted`]). `strides` has
    /// as many entries as `shape` (the extra ones are not kept).
    ///
    /// # Panics
    /// If `index` is not a row of the table.
    pub fn set_tensor(
        &mut self,
        index: usize,
        storage: u32,
        view_offset: u64,
        dtype: DType,
        shape: &[u64],
        strides: &[i64],
    ) {
        let ndim = shape.len();
        let tail = self.shapes.len().wrapping_sub(ndim);
        let dims = if strides.len() == ndim
            && self.shapes.get(tail..) == Some(shape)
            && self.strides.get(tail..) == Some(strides)
        {
            // The layout of the tensor described last (a message of like tensors): shared, so
            // that encoding sees the rows of a run by their `dims` alone.
            tail as u32
        } else {
            let dims = self.shapes.len() as u32;
            self.shapes.extend_from_slice(shape);
            if strides.len() == ndim {
                self.strides.extend_from_slice(strides); // a tensor's own: one copy
            } else {
                self.strides.extend(strides.iter().copied().chain(std::iter::repeat(0)).take(ndim));
            }
            dims
        };
        self.tensors[index] = TensorDesc { storage, view_offset, dtype, ndim: ndim as u8, dims };
    }

    /// The first tensor not given a storage, if any.
    pub fn unrouted_tensor(&self) -> Option<usize> {
        self.tensors.iter().position(|t| t.storage == UNROUTED.storage)
    }

    /// The storage records.
    pub fn storages(&self) -> &[StorageDesc] {
        &self.storages
    }

    /// The tensors, in the order the payload refers to them.
    pub fn tensors(&self) -> &[TensorDesc] {
        &self.tensors
    }

    /// How many tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the message has no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Tensor `index`'s sizes (empty for an index out of range).
    pub fn shape(&self, index: usize) -> &[u64] {
        self.tensors.get(index).map_or(&[], |t| &self.shapes[t.dims as usize..t.dims as usize + t.ndim as usize])
    }

    /// Tensor `index`'s strides in elements (empty for an index out of range).
    pub fn strides(&self, index: usize) -> &[i64] {
        self.tensors.get(index).map_or(&[], |t| &self.strides[t.dims as usize..t.dims as usize + t.ndim as usize])
    }

    /// Whether some record travels by `route`.
    pub fn uses(&self, route: Route) -> bool {
        self.storages.iter().any(|s| s.source.route() == route)
    }

    /// Storage record `storage` of tensor `index`'s view, for the caller that built the table
    /// (a test that lies about it, say).
    pub fn storage_mut(&mut self, storage: usize) -> Option<&mut StorageDesc> {
        self.storages.get_mut(storage)
    }

    /// Tensor `index`'s row, for the caller that built the table.
    pub fn tensor_mut(&mut self, index: usize) -> Option<&mut TensorDesc> {
        self.tensors.get_mut(index)
    }
}

impl Descriptors {
    /// The run of rows from `index` on (see [`RUN`]): how many (1 for a row alone) and the
    /// step of their view offsets. Rows of a run are views of one record with one dtype and
    /// layout, each `step` bytes after the one before.
    fn run_at(&self, index: usize) -> (u32, u64) {
        let first = &self.tensors[index];
        let like = |t: &TensorDesc| {
            t.storage == first.storage
                && t.dtype == first.dtype
                && t.ndim == first.ndim
                && (t.dims == first.dims
                    || (self.shape_of(t) == self.shape_of(first) && self.strides_of(t) == self.strides_of(first)))
        };
        let Some(step) = self
            .tensors
            .get(index + 1)
            .filter(|next| like(next))
            .and_then(|next| next.view_offset.checked_sub(first.view_offset))
        else {
            return (1, 0);
        };
        let mut repeat = 2u32;
        let mut last = first.view_offset + step;
        for next in &self.tensors[index + 2..] {
            if repeat == u32::MAX || !like(next) || last.checked_add(step) != Some(next.view_offset) {
                break;
            }
            last = next.view_offset;
            repeat += 1;
        }
        (repeat, step)
    }

    fn shape_of(&self, t: &TensorDesc) -> &[u64] {
        &self.shapes[t.dims as usize..t.dims as usize + t.ndim as usize]
    }

    fn strides_of(&self, t: &TensorDesc) -> &[i64] {
        &self.strides[t.dims as usize..t.dims as usize + t.ndim as usize]
    }
}

/// The flag of a row's dimension count that makes it the first of a run: a `u32` count (at
/// least 2) and a `u64` step follow its strides, and the run stands for that many rows of one
/// record, dtype and layout, the view offset of each `step` bytes after the one before (a
/// message of like tensors cut from one storage, or allocated one after the other, is one row).
const RUN: u8 = 0x80;

/// The most tensors of a table that runs may describe: a frame may declare this many tensors,
/// whatever its size, or as many as its bytes hold rows without runs (a sender of a bigger
/// message writes no runs). It bounds what a small frame makes the receiver allocate.
pub const MAX_RUN_TENSORS: usize = 1 << 20;

/// Appends the table.
pub(super) fn encode_table(w: &mut Writer, table: &Descriptors) {
    w.0.reserve(4 + table.storages.len() * MAX_RECORD + 4 + table.tensors.len() * MIN_TENSOR + table.shapes.len() * 16);
    w.u32(table.storages.len() as u32);
    for record in &table.storages {
        encode_storage(w, record);
    }
    w.u32(table.tensors.len() as u32);
    let runs = table.tensors.len() <= MAX_RUN_TENSORS;
    let mut index = 0;
    while index < table.tensors.len() {
        let t = &table.tensors[index];
        let (repeat, step) = if runs { table.run_at(index) } else { (1, 0) };
        w.u32(t.storage);
        w.u64(t.view_offset);
        w.u8(t.dtype as u8);
        w.u8(if repeat > 1 { t.ndim | RUN } else { t.ndim });
        table.shape(index).iter().for_each(|&s| w.u64(s));
        table.strides(index).iter().for_each(|&s| w.u64(s as u64));
        if repeat > 1 {
            w.u32(repeat);
            w.u64(step);
        }
        index += repeat as usize;
    }
}

fn encode_storage(w: &mut Writer, record: &StorageDesc) {
    w.u8(match record.source {
        Source::BytesToGpu { .. } => BYTES_TO_GPU,
        source => source.route().code(),
    });
    w.u64(record.len);
    match record.source {
        Source::SameDevice { chunk, offset }
        | Source::PeerMap { chunk, offset }
        | Source::PeerCopy { chunk, offset }
        | Source::Host { chunk, offset } => {
            w.u64(chunk);
            w.u64(offset);
        }
        Source::Staged { chunk, offset, target } => {
            w.u64(chunk);
            w.u64(offset);
            w.bytes(&target.0);
        }
        Source::Nccl { communicator } => w.u32(communicator),
        Source::Bytes { offset } => w.u64(offset),
        Source::BytesToGpu { offset, target } => {
            w.u64(offset);
            w.bytes(&target.0);
        }
    }
    match record.fence {
        Fence::None => w.u8(FENCE_NONE),
        Fence::Event(id) => {
            w.u8(FENCE_EVENT);
            w.u32(id);
        }
        Fence::Signal { chunk, offset, value } => {
            w.u8(FENCE_SIGNAL);
            w.u64(chunk);
            w.u64(offset);
            w.u64(value);
        }
    }
}

/// The fewest bytes a storage record takes (an NCCL transfer, no fence).
const MIN_RECORD: usize = 1 + 8 + 4 + 1;
/// The most bytes a storage record takes (a staged copy with a signal).
const MAX_RECORD: usize = 1 + 8 + 8 + 8 + 16 + 1 + 24;
/// The fewest bytes a tensor row takes (no dimensions).
const MIN_TENSOR: usize = 4 + 8 + 1 + 1;

/// Decodes and checks a message's table from the rest of the frame (`body` bytes of it).
pub(super) fn decode_table(r: &mut Reader<'_>, body: usize) -> Result<Descriptors, FrameError> {
    // Each record and each row takes at least its minimum: a count beyond what the frame can
    // hold is refused before anything is allocated for it.
    let count = r.count("storage records", body / MIN_RECORD)?;
    let mut storages = Vec::with_capacity(count);
    for index in 0..count {
        storages.push(decode_storage(r, index)?);
    }
    check_disjoint(&storages)?;
    let count = r.count("tensors", (body / MIN_TENSOR).max(MAX_RUN_TENSORS))?;
    // Room for the rows the frame's bytes can hold: a run's rows are made when it is read.
    let room = count.min(body / MIN_TENSOR);
    let mut table =
        Descriptors { storages, tensors: Vec::with_capacity(room), shapes: Vec::new(), strides: Vec::new() };
    while table.tensors.len() < count {
        decode_tensor(r, count, &mut table)?;
    }
    Ok(table)
}

fn decode_storage(r: &mut Reader<'_>, index: usize) -> Result<StorageDesc, FrameError> {
    let bad = |reason: String| FrameError::Storage { index, reason };
    let code = r.u8()?;
    if code == BYTES_TO_GPU {
        let len = r.u64()?;
        let source = Source::BytesToGpu { offset: r.u64()?, target: Uuid(r.array()?) };
        return finish_storage(r, index, source, len);
    }
    let route = Route::from_code(code).ok_or_else(|| bad(format!("unknown route {code}")))?;
    let len = r.u64()?;
    let source = match route {
        Route::SameDevice => Source::SameDevice { chunk: r.u64()?, offset: r.u64()? },
        Route::PeerMap => Source::PeerMap { chunk: r.u64()?, offset: r.u64()? },
        Route::PeerCopy => Source::PeerCopy { chunk: r.u64()?, offset: r.u64()? },
        Route::Host => Source::Host { chunk: r.u64()?, offset: r.u64()? },
        Route::Staged => Source::Staged { chunk: r.u64()?, offset: r.u64()?, target: Uuid(r.array()?) },
        Route::Nccl => Source::Nccl { communicator: r.u32()? },
        Route::Tcp => Source::Bytes { offset: r.u64()? },
    };
    finish_storage(r, index, source, len)
}

/// The rest of a record after its source (its fence), and the checks of the whole record.
fn finish_storage(r: &mut Reader<'_>, index: usize, source: Source, len: u64) -> Result<StorageDesc, FrameError> {
    let bad = |reason: String| FrameError::Storage { index, reason };
    let route = source.route();
    let fence = match r.u8()? {
        FENCE_NONE => Fence::None,
        FENCE_EVENT => Fence::Event(r.u32()?),
        FENCE_SIGNAL => Fence::Signal { chunk: r.u64()?, offset: r.u64()?, value: r.u64()? },
        other => return Err(bad(format!("unknown fence kind {other}"))),
    };
    if source.offset().checked_add(len).is_none() {
        return Err(bad("the storage range overflows".into()));
    }
    // Bytes that came over TCP or through NCCL have no fence the sender could name. (A copy
    // through host memory needs a host word: the receiver checks that against the chunk it
    // names, and refuses the message alone.)
    if matches!(source, Source::Nccl { .. } | Source::Bytes { .. } | Source::BytesToGpu { .. }) && fence != Fence::None
    {
        return Err(bad(format!("a fence on a {route} storage")));
    }
    Ok(StorageDesc { source, len, fence })
}

/// Refuses records that overlap: an honest sender makes one record per span of a chunk (or of
/// the message's bytes), so two over the same bytes are a lie.
fn check_disjoint(storages: &[StorageDesc]) -> Result<(), FrameError> {
    if storages.len() < 2 {
        return Ok(());
    }
    // (space, chunk, start, end, record): chunk-backed records share the chunks' ids; TCP
    // bytes are a space of their own; NCCL transfers have no range.
    let mut ranges: Vec<(u8, u64, u64, u64, usize)> = storages
        .iter()
        .enumerate()
        .filter_map(|(index, s)| {
            let end = s.source.offset() + s.len; // no overflow: checked by decode_storage
            match s.source {
                Source::Nccl { .. } => None,
                Source::Bytes { offset } | Source::BytesToGpu { offset, .. } => Some((1, 0, offset, end, index)),
                _ => s.source.chunk_range().map(|(chunk, offset)| (0, chunk, offset, end, index)),
            }
        })
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((space, chunk, _, end, first), (next_space, next_chunk, start, _, second)) = (pair[0], pair[1]);
        if space == next_space && chunk == next_chunk && start < end {
            let (index, other) = (first.max(second), first.min(second));
            return Err(FrameError::Storage { index, reason: format!("overlaps storage record {other}") });
        }
    }
    Ok(())
}

/// Decodes the row (or run of rows) of the next tensor of a table of `count`, and checks it.
fn decode_tensor(r: &mut Reader<'_>, count: usize, table: &mut Descriptors) -> Result<(), FrameError> {
    let index = table.tensors.len();
    let bad = |reason: String| FrameError::OutOfBounds { index, reason };
    let storage = r.u32()?;
    let view_offset = r.u64()?;
    let code = r.u8()?;
    let dtype = DType::from_code(code).ok_or(FrameError::BadDType(code))?;
    let flags = r.u8()?;
    let ndim = (flags & !RUN) as usize;
    if ndim > MAX_DIMS {
        return Err(FrameError::TooMany { what: "dimensions", count: ndim, max: MAX_DIMS });
    }
    let record = *table
        .storages
        .get(storage as usize)
        .ok_or_else(|| bad(format!("storage record {storage} of a table of {}", table.storages.len())))?;
    let dims = table.shapes.len();
    for _ in 0..ndim {
        table.shapes.push(r.u64()?);
    }
    for _ in 0..ndim {
        table.strides.push(r.u64()? as i64);
    }
    let (repeat, step) = if flags & RUN != 0 { (r.u32()? as usize, r.u64()?) } else { (1, 0) };
    if repeat < 2 && flags & RUN != 0 {
        return Err(bad(format!("a run of {repeat} tensors")));
    }
    if repeat > count - index {
        return Err(FrameError::TooMany { what: "tensors in runs", count: index + repeat, max: count });
    }
    let (shape, strides) = (&table.shapes[dims..], &table.strides[dims..]);
    // Element 0's alignment counts from the chunk's (page-aligned) start, or the transfer's;
    // the rows of a run keep the first's when the step is a multiple of the element size.
    check_layout(shape, strides, dtype, record.source.offset().wrapping_add(view_offset)).map_err(bad)?;
    if !step.is_multiple_of(dtype.size() as u64) {
        return Err(bad(format!("a run's step of {step} bytes is not a multiple of {dtype:?}'s size")));
    }
    let (low, high) = strided_byte_span(shape, strides, dtype.size())
        .ok_or_else(|| bad(format!("shape {shape:?} with strides {strides:?} overflows")))?;
    // The run's rows lie between its first's start and its last's end (steps are not negative).
    let last = i128::from(view_offset) + (repeat as i128 - 1) * i128::from(step);
    let start = i128::from(view_offset) + i128::from(low);
    let end = last + i128::from(high);
    if start < 0 || end > i128::from(record.len) {
        return Err(bad(format!(
            "view bytes {start}..{end} (shape {shape:?}, strides {strides:?}, {dtype:?}, {repeat} rows {step} bytes \
             apart) outside storage record {storage} of {} bytes",
            record.len
        )));
    }
    let row = TensorDesc { storage, view_offset, dtype, ndim: ndim as u8, dims: dims as u32 };
    // In range: the last row's offset is at most the record's length.
    table.tensors.extend((0..repeat as u64).map(|k| TensorDesc { view_offset: view_offset + k * step, ..row }));
    Ok(())
}

/// How a receiver orders its first use of a GPU tensor after the producer's work.
///
/// ```
/// use tensor_queue::DType;
/// use tensor_queue::testing::wire::{Descriptors, Fence, Frame, Source, StorageDesc, ToReceiver};
/// // The producer's stream writes 12 into the word at byte 64 of chunk 3 once the tensor is
/// // written; the receiver's stream waits for that value before the tensor's first use.
/// let fence = Fence::Signal { chunk: 3, offset: 64, value: 12 };
/// let mut tensors = Descriptors::default();
/// let storage = tensors.push_storage(StorageDesc { source: Source::SameDevice { chunk: 3, offset: 4096 }, len: 16, fence });
/// tensors.push_tensor(storage, 0, DType::F32, &[4], &[1]);
/// let frame = ToReceiver::Message { seq: 9, sent_ns: 0, encoded_ns: 0, tensors, payload: vec![] };
/// assert_eq!(ToReceiver::decode(&frame.encode()), Ok(frame));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// Nothing to wait for: a host tensor, or the sender synchronised its device.
    None,
    /// An interprocess event the sender announced (devices without stream memory operations).
    Event(u32),
    /// The 64-bit word at `offset` in chunk `chunk` reaching `value` (`cuStreamWaitValue64`).
    Signal {
        /// The chunk holding the word (announced like any chunk).
        chunk: u64,
        /// The word's offset in the chunk.
        offset: u64,
        /// The value that marks the producer's work as done.
        value: u64,
    },
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::wire::{Frame, ToReceiver};

    fn decode(tensors: Descriptors) -> Result<ToReceiver, FrameError> {
        ToReceiver::decode(
            &ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors, payload: vec![] }.encode(),
        )
    }

    fn mapped(chunk: u64, offset: u64, len: u64) -> StorageDesc {
        StorageDesc { source: Source::SameDevice { chunk, offset }, len, fence: Fence::None }
    }

    #[test]
    fn every_source_round_trips_with_its_own_fields() {
        let signal = Fence::Signal { chunk: 9, offset: 8, value: 7 };
        let sources = [
            (Source::SameDevice { chunk: 1, offset: 0 }, Fence::Event(3)),
            (Source::PeerMap { chunk: 2, offset: 4096 }, signal),
            (Source::PeerCopy { chunk: 3, offset: 512 }, signal),
            (Source::Host { chunk: 4, offset: 1024 }, signal),
            (Source::Staged { chunk: 5, offset: 0, target: Uuid([6; 16]) }, signal),
            (Source::Nccl { communicator: 6 }, Fence::None),
            (Source::Bytes { offset: 32 }, Fence::None),
            (Source::BytesToGpu { offset: 4096, target: Uuid([8; 16]) }, Fence::None),
        ];
        let mut table = Descriptors::default();
        for (source, fence) in sources {
            let storage = table.push_storage(StorageDesc { source, len: 64, fence });
            table.push_tensor(storage, 16, DType::I32, &[2, 2], &[1, 2]);
        }
        let Ok(ToReceiver::Message { tensors, .. }) = decode(table.clone()) else { panic!("refused") };
        assert_eq!(tensors, table);
        assert_eq!(
            tensors.storages().iter().map(|s| s.source.route()).collect::<Vec<_>>(),
            [
                Route::SameDevice,
                Route::PeerMap,
                Route::PeerCopy,
                Route::Host,
                Route::Staged,
                Route::Nccl,
                Route::Tcp,
                Route::Tcp
            ]
        );
        assert_eq!(tensors.storages()[7].source, Source::BytesToGpu { offset: 4096, target: Uuid([8; 16]) });
        assert_eq!((tensors.shape(6), tensors.strides(6)), (&[2, 2][..], &[1, 2][..]));
    }

    #[test]
    fn a_tensor_naming_a_record_the_message_does_not_have_is_refused() {
        let mut table = Descriptors::default();
        let storage = table.push_storage(mapped(1, 0, 64));
        table.push_tensor(storage, 0, DType::U8, &[4], &[1]);
        table.push_tensor(storage + 1, 0, DType::U8, &[4], &[1]);
        assert!(
            matches!(decode(table), Err(FrameError::OutOfBounds { index: 1, reason }) if reason.contains("storage record 1"))
        );
        let mut none = Descriptors::default();
        none.push_tensor(0, 0, DType::U8, &[1], &[1]);
        assert!(matches!(decode(none), Err(FrameError::OutOfBounds { index: 0, .. })));
    }

    #[test]
    fn overlapping_records_are_refused_and_touching_ones_are_not() {
        let table = |records: &[StorageDesc]| {
            let mut table = Descriptors::default();
            records.iter().for_each(|&r| {
                table.push_storage(r);
            });
            decode(table)
        };
        assert!(table(&[mapped(1, 0, 4096), mapped(1, 4096, 4096), mapped(2, 0, 4096)]).is_ok());
        let overlap = table(&[mapped(1, 4096, 4096), mapped(2, 0, 10), mapped(1, 0, 4097)]);
        assert!(
            matches!(overlap, Err(FrameError::Storage { index: 2, reason }) if reason.contains("overlaps storage record 0"))
        );
        // A staged copy and a mapped storage name chunks of one sender: one space of ids.
        let signal = Fence::Signal { chunk: 9, offset: 0, value: 1 };
        let staged = StorageDesc {
            source: Source::Staged { chunk: 1, offset: 100, target: Uuid([1; 16]) },
            len: 8,
            fence: signal,
        };
        assert!(matches!(table(&[mapped(1, 0, 4096), staged]), Err(FrameError::Storage { index: 1, .. })));
        let bytes = |offset, len| StorageDesc { source: Source::Bytes { offset }, len, fence: Fence::None };
        assert!(table(&[bytes(0, 16), bytes(16, 16), mapped(0, 0, 64)]).is_ok(), "bytes are not a chunk's");
        assert!(matches!(table(&[bytes(0, 17), bytes(16, 16)]), Err(FrameError::Storage { index: 1, .. })));
        // Bytes bound for a GPU lie in the same run as host bytes.
        let to_gpu = StorageDesc {
            source: Source::BytesToGpu { offset: 8, target: Uuid([1; 16]) },
            len: 16,
            fence: Fence::None,
        };
        assert!(matches!(table(&[bytes(0, 16), to_gpu]), Err(FrameError::Storage { index: 1, .. })));
        assert!(table(&[bytes(0, 8), to_gpu]).is_ok());
        let nccl = StorageDesc { source: Source::Nccl { communicator: 1 }, len: 64, fence: Fence::None };
        assert!(table(&[nccl, nccl]).is_ok(), "two transfers have no range to overlap");
    }

    #[test]
    fn a_record_with_the_wrong_fence_for_its_route_or_no_room_is_refused() {
        let record = |source, len, fence| {
            let mut table = Descriptors::default();
            table.push_storage(StorageDesc { source, len, fence });
            decode(table)
        };
        let signal = Fence::Signal { chunk: 1, offset: 0, value: 1 };
        let staged = Source::Staged { chunk: 1, offset: 0, target: Uuid([1; 16]) };
        assert!(record(staged, 8, signal).is_ok());
        assert!(record(staged, 8, Fence::None).is_ok(), "refused by the receiver, which knows the chunks");
        assert!(matches!(record(Source::Nccl { communicator: 1 }, 8, signal), Err(FrameError::Storage { .. })));
        assert!(matches!(record(Source::Bytes { offset: 0 }, 8, Fence::Event(2)), Err(FrameError::Storage { .. })));
        let to_gpu = Source::BytesToGpu { offset: 0, target: Uuid([1; 16]) };
        assert!(matches!(record(to_gpu, 8, signal), Err(FrameError::Storage { .. })));
        assert!(record(to_gpu, 8, Fence::None).is_ok());
        let overflowing = record(Source::BytesToGpu { offset: u64::MAX, target: Uuid([1; 16]) }, 8, Fence::None);
        assert!(matches!(overflowing, Err(FrameError::Storage { reason, .. }) if reason.contains("overflows")));
        let overflowing = record(Source::PeerMap { chunk: 1, offset: u64::MAX - 4 }, 8, Fence::None);
        assert!(matches!(overflowing, Err(FrameError::Storage { reason, .. }) if reason.contains("overflows")));
        // An unknown route code: the byte after the record count.
        let mut table = Descriptors::default();
        table.push_storage(mapped(1, 0, 8));
        let mut bytes =
            ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: table, payload: vec![] }.encode();
        bytes[12 + 24 + 4] = 200;
        assert!(
            matches!(ToReceiver::decode(&bytes), Err(FrameError::Storage { index: 0, reason }) if reason.contains("route 200"))
        );
    }

    #[test]
    fn like_rows_travel_as_runs_and_decode_exact_among_rows_of_every_kind() {
        // 1,024 views of one record 4 KiB apart: one row on the wire.
        let mut many = Descriptors::default();
        let storage = many.push_storage(mapped(1, 0, 1024 * 4096));
        for k in 0..1024 {
            many.push_tensor(storage, k * 4096, DType::U8, &[4096], &[1]);
        }
        let bytes =
            ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: many.clone(), payload: vec![] }.encode();
        assert!(bytes.len() < 128, "{} bytes for one run", bytes.len());
        let Ok(ToReceiver::Message { tensors, .. }) = ToReceiver::decode(&bytes) else { panic!("refused") };
        assert_eq!(tensors, many);
        assert_eq!((tensors.tensors()[1023].view_offset, tensors.shape(1023)), (1023 * 4096, &[4096u64][..]));

        // Runs among rows that break them: another record, dtype, shape, stride or step, a
        // transposed view, 0-element tensors, and offsets going down.
        let mut mixed = Descriptors::default();
        let a = mixed.push_storage(mapped(1, 0, 1 << 16));
        let b = mixed.push_storage(mapped(2, 4096, 1 << 16));
        let rows: &[Row] = &[
            (a, 0, DType::F32, &[4, 4], &[4, 1]),
            (a, 64, DType::F32, &[4, 4], &[4, 1]),
            (a, 128, DType::F32, &[4, 4], &[4, 1]),
            (a, 192, DType::F32, &[4, 4], &[1, 4]), // transposed: a row of its own
            (b, 192, DType::F32, &[4, 4], &[4, 1]), // another record
            (b, 256, DType::I64, &[2], &[1]),
            (b, 272, DType::I64, &[2], &[1]),
            (b, 288, DType::I64, &[2], &[1]),
            (b, 320, DType::I64, &[2], &[1]), // another step
            (b, 352, DType::I64, &[2], &[1]),
            (a, 0, DType::U8, &[0], &[1]),
            (a, 0, DType::U8, &[0], &[1]), // step 0
            (a, 0, DType::U8, &[0], &[1]),
            (a, 512, DType::F64, &[3], &[-1]),
            (a, 256, DType::F64, &[3], &[-1]), // down
            (a, 8192, DType::U8, &[], &[]),
            (a, 8193, DType::U8, &[], &[]),
        ];
        for &(storage, offset, dtype, shape, strides) in rows {
            mixed.push_tensor(storage, offset, dtype, shape, strides);
        }
        let Ok(ToReceiver::Message { tensors, .. }) = decode(mixed.clone()) else { panic!("refused") };
        assert_eq!(tensors, mixed);
        for (index, &(storage, offset, dtype, shape, strides)) in rows.iter().enumerate() {
            let row = tensors.tensors()[index];
            assert_eq!((row.storage, row.view_offset, row.dtype), (storage, offset, dtype), "row {index}");
            assert_eq!((tensors.shape(index), tensors.strides(index)), (shape, strides), "row {index}");
        }
    }

    /// A tensor row: (record, view offset, dtype, shape, strides).
    type Row<'a> = (u32, u64, DType, &'a [u64], &'a [i64]);

    /// A message of two like rows (one run) in a record of 64 bytes, and where its run's fields
    /// are in the frame: (the tensor count, the dimension byte, the run's count, its step).
    fn a_run() -> (Vec<u8>, [usize; 4]) {
        let mut table = Descriptors::default();
        let storage = table.push_storage(mapped(1, 0, 64));
        table.push_tensor(storage, 0, DType::F32, &[4], &[1]);
        table.push_tensor(storage, 16, DType::F32, &[4], &[1]);
        let bytes = ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: table, payload: vec![] }.encode();
        // Header 12, times 24, record count 4 and one mapped record of 26 bytes.
        let count = 12 + 24 + 4 + 26;
        let row = count + 4;
        (bytes, [count, row + 13, row + 30, row + 34])
    }

    #[test]
    fn a_run_that_lies_is_refused_with_a_typed_error() {
        let (honest, [count, flags, repeat, step]) = a_run();
        assert_eq!(honest[flags], 1 | RUN);
        assert!(ToReceiver::decode(&honest).is_ok());
        let with = |at: usize, value: &[u8]| {
            let mut bytes = honest.clone();
            bytes[at..at + value.len()].copy_from_slice(value);
            ToReceiver::decode(&bytes)
        };
        let refused = with(repeat, &1u32.to_le_bytes());
        assert!(matches!(refused, Err(FrameError::OutOfBounds { index: 0, reason }) if reason.contains("a run of 1")));
        let refused = with(repeat, &3u32.to_le_bytes());
        assert!(matches!(refused, Err(FrameError::TooMany { what: "tensors in runs", count: 3, max: 2 })));
        let refused = with(repeat, &u32::MAX.to_le_bytes());
        assert!(matches!(refused, Err(FrameError::TooMany { what: "tensors in runs", .. })));
        // The last row past the record's end, whatever the step: no overflow.
        for bad_step in [52u64, 1 << 40, u64::MAX - 3] {
            let refused = with(step, &bad_step.to_le_bytes());
            assert!(matches!(refused, Err(FrameError::OutOfBounds { index: 0, .. })), "step {bad_step}");
        }
        let refused = with(step, &6u64.to_le_bytes());
        assert!(matches!(refused, Err(FrameError::OutOfBounds { reason, .. }) if reason.contains("not a multiple")));
        assert!(with(step, &0u64.to_le_bytes()).is_ok(), "the same view twice");
        // More tensors than runs may describe, in a frame too small to hold them as rows.
        let too_many = (MAX_RUN_TENSORS as u32 + 1).to_le_bytes();
        let refused = with(count, &too_many);
        assert!(matches!(refused, Err(FrameError::TooMany { what: "tensors", max: MAX_RUN_TENSORS, .. })));
        // A count the runs do not reach: the frame ends early.
        assert!(matches!(with(count, &3u32.to_le_bytes()), Err(FrameError::Truncated { .. })));
        // Without its run flag the row is one tensor and the run's fields are read as the payload.
        assert!(with(flags, &[1]).is_err());
    }

    #[test]
    fn a_view_is_checked_against_its_record_and_aligned_from_the_chunk_start() {
        let one = |record: StorageDesc, view_offset, shape: &[u64], strides: &[i64]| {
            let mut table = Descriptors::default();
            let storage = table.push_storage(record);
            table.push_tensor(storage, view_offset, DType::F32, shape, strides);
            decode(table)
        };
        assert!(one(mapped(1, 4096, 64), 0, &[16], &[1]).is_ok());
        assert!(matches!(one(mapped(1, 4096, 64), 4, &[16], &[1]), Err(FrameError::OutOfBounds { index: 0, .. })));
        assert!(matches!(one(mapped(1, 4098, 64), 0, &[4], &[1]), Err(FrameError::OutOfBounds { .. })), "unaligned");
        let bytes = StorageDesc { source: Source::Bytes { offset: 2 }, len: 64, fence: Fence::None };
        assert!(matches!(one(bytes, 0, &[4], &[1]), Err(FrameError::OutOfBounds { .. })), "unaligned in the bytes");
    }

    fn source() -> impl Strategy<Value = (Source, Fence)> {
        let signal = (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(chunk, offset, value)| Fence::Signal {
            chunk,
            offset,
            value,
        });
        let any_fence = prop_oneof![Just(Fence::None), any::<u32>().prop_map(Fence::Event), signal.clone()];
        let at = (0u64..8, (0u64..64).prop_map(|k| k * 4096));
        prop_oneof![
            (at.clone(), any_fence.clone()).prop_map(|((chunk, offset), f)| (Source::SameDevice { chunk, offset }, f)),
            (at.clone(), any_fence.clone()).prop_map(|((chunk, offset), f)| (Source::PeerMap { chunk, offset }, f)),
            (at.clone(), any_fence).prop_map(|((chunk, offset), f)| (Source::PeerCopy { chunk, offset }, f)),
            (at.clone(), signal.clone()).prop_map(|((chunk, offset), f)| (Source::Host { chunk, offset }, f)),
            (at, any::<[u8; 16]>(), signal)
                .prop_map(|((chunk, offset), t, f)| (Source::Staged { chunk, offset, target: Uuid(t) }, f)),
            any::<u32>().prop_map(|communicator| (Source::Nccl { communicator }, Fence::None)),
            (0u64..64).prop_map(|k| (Source::Bytes { offset: k * 4096 }, Fence::None)),
            ((0u64..64), any::<[u8; 16]>())
                .prop_map(|(k, t)| (Source::BytesToGpu { offset: k * 4096, target: Uuid(t) }, Fence::None)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

        /// Any table decodes to itself or is refused with a reason, whatever its records and
        /// views; what decodes re-encodes to the same bytes.
        #[test]
        fn tables_round_trip_or_are_refused(
            records in proptest::collection::vec((source(), 0u64..8192), 0..6),
            tensors in proptest::collection::vec(
                (0u32..7, 0u64..8192, proptest::collection::vec((0u64..5, -3i64..5), 0..4)),
                0..12,
            ),
        ) {
            let mut table = Descriptors::default();
            for ((source, fence), len) in records {
                table.push_storage(StorageDesc { source, len, fence });
            }
            for (storage, view_offset, dims) in tensors {
                let (shape, strides): (Vec<u64>, Vec<i64>) = dims.into_iter().unzip();
                table.push_tensor(storage, view_offset / 4 * 4, DType::F32, &shape, &strides);
            }
            let bytes = ToReceiver::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: table.clone(), payload: vec![] }.encode();
            match ToReceiver::decode(&bytes) {
                Ok(ToReceiver::Message { tensors, .. }) => {
                    prop_assert_eq!(&tensors, &table);
                    for (index, t) in tensors.tensors().iter().enumerate() {
                        let record = tensors.storages()[t.storage as usize];
                        let (low, high) = strided_byte_span(tensors.shape(index), tensors.strides(index), 4).unwrap();
                        prop_assert!(t.view_offset as i64 + low >= 0 && (t.view_offset as i64 + high) as u64 <= record.len);
                    }
                }
                Ok(other) => prop_assert!(false, "decoded as {:?}", other),
                Err(FrameError::OutOfBounds { .. } | FrameError::Storage { .. }) => {}
                Err(other) => prop_assert!(false, "refused without saying which tensor or record: {}", other),
            }
        }
    }
}
