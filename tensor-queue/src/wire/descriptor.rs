//! A message's tensor descriptors: what each tensor is (dtype, shape, strides, where its storage
//! lies) and what the receiver waits for before its first use, with their encoding and the
//! checks [`Frame::decode`](super::Frame::decode) makes of each one.

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
/// use tensor_queue::wire::{ChunkKind, Frame};
/// // A host chunk's announcement: its shared-memory descriptor travels beside the frame.
/// let (kind, legacy) = (ChunkKind::Host, None);
/// let announce = Frame::Chunk { id: 7, len: 64 << 20, kind, device: [0; 16], legacy, writable: false };
/// assert_eq!(Frame::decode(&announce.encode()), Ok(announce));
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

/// One tensor of a message.
///
/// ```
/// use tensor_queue::DType;
/// use tensor_queue::route::Route;
/// use tensor_queue::wire::{Fence, Frame, FrameError, TensorDesc};
/// let message = |desc: TensorDesc| {
///     Frame::Message { seq: 1, sent_ns: 0, encoded_ns: 0, tensors: vec![desc], payload: vec![] }.encode()
/// };
/// let desc = TensorDesc {
///     chunk: 1, storage_offset: 512, storage_len: 48, view_offset: 0,
///     dtype: DType::F32, fence: Fence::None, route: Route::SameDevice, target: None, span: 0, shape: vec![3, 4], strides: vec![4, 1],
/// };
/// assert!(Frame::decode(&message(desc.clone())).is_ok());
/// let too_long = TensorDesc { shape: vec![3, 5], ..desc }; // 60 bytes of view in 48 of storage
/// assert!(matches!(Frame::decode(&message(too_long)), Err(FrameError::OutOfBounds { index: 0, .. })));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// The chunk holding the storage.
    pub chunk: u64,
    /// Where the storage starts in the chunk.
    pub storage_offset: u64,
    /// The storage's length.
    pub storage_len: u64,
    /// Bytes from the storage's start to element 0.
    pub view_offset: u64,
    /// Element type.
    pub dtype: DType,
    /// What the receiver's stream waits for before the tensor's first use.
    pub fence: Fence,
    /// How the tensor travels (see [`crate::route`]).
    pub route: Route,
    /// For [`Route::Staged`]: the receiver's GPU the tensor lands on (the sender chose it from
    /// the receiver's policy); `None` for every other route.
    pub target: Option<Uuid>,
    /// For [`Route::Nccl`]: which of the message's NCCL transfers on the communicator `chunk`
    /// holds the storage (they are numbered from 0 in the order both sides queue them), with
    /// `storage_offset` counted from that transfer's start. 0 for every other route.
    pub span: u32,
    /// Sizes.
    pub shape: Vec<u64>,
    /// Strides in elements.
    pub strides: Vec<i64>,
}

/// How a receiver orders its first use of a GPU tensor after the producer's work.
///
/// ```
/// use tensor_queue::DType;
/// use tensor_queue::route::Route;
/// use tensor_queue::wire::{Fence, Frame, TensorDesc};
/// // The producer's stream writes 12 into the word at byte 64 of chunk 3 once the tensor is
/// // written; the receiver's stream waits for that value before the tensor's first use.
/// let fence = Fence::Signal { chunk: 3, offset: 64, value: 12 };
/// let desc = TensorDesc {
///     chunk: 3, storage_offset: 4096, storage_len: 16, view_offset: 0,
///     dtype: DType::F32, fence, route: Route::SameDevice, target: None, span: 0, shape: vec![4], strides: vec![1],
/// };
/// let frame = Frame::Message { seq: 9, sent_ns: 0, encoded_ns: 0, tensors: vec![desc], payload: vec![] };
/// assert_eq!(Frame::decode(&frame.encode()), Ok(frame));
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

/// Appends one tensor's descriptor.
pub(super) fn encode_tensor(w: &mut Writer, t: &TensorDesc) {
    w.u64(t.chunk);
    w.u64(t.storage_offset);
    w.u64(t.storage_len);
    w.u64(t.view_offset);
    w.u8(t.dtype as u8);
    w.u8(t.shape.len() as u8);
    w.u8(t.route.code());
    if let Some(target) = t.target {
        w.bytes(&target.0);
    }
    if t.route == Route::Nccl {
        w.u32(t.span);
    }
    match t.fence {
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
    t.shape.iter().for_each(|&s| w.u64(s));
    t.strides.iter().for_each(|&s| w.u64(s as u64));
}

/// The fewest bytes a tensor descriptor takes (no dimensions, no fence).
pub(super) const MIN_DESC: usize = 4 * 8 + 4;

pub(super) fn decode_tensor(r: &mut Reader<'_>, index: usize) -> Result<TensorDesc, FrameError> {
    let (chunk, storage_offset, storage_len, view_offset) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
    let code = r.u8()?;
    let dtype = DType::from_code(code).ok_or(FrameError::BadDType(code))?;
    let ndim = r.u8()? as usize;
    if ndim > MAX_DIMS {
        return Err(FrameError::TooMany { what: "dimensions", count: ndim, max: MAX_DIMS });
    }
    let route_code = r.u8()?;
    let route = Route::from_code(route_code)
        .ok_or_else(|| FrameError::OutOfBounds { index, reason: format!("unknown route {route_code}") })?;
    let target = if route == Route::Staged { Some(Uuid(r.array()?)) } else { None };
    let span = if route == Route::Nccl { r.u32()? } else { 0 };
    let fence = match r.u8()? {
        FENCE_NONE => Fence::None,
        FENCE_EVENT => Fence::Event(r.u32()?),
        FENCE_SIGNAL => Fence::Signal { chunk: r.u64()?, offset: r.u64()?, value: r.u64()? },
        other => return Err(FrameError::OutOfBounds { index, reason: format!("unknown fence kind {other}") }),
    };
    let shape = (0..ndim).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
    let strides = (0..ndim).map(|_| r.u64().map(|s| s as i64)).collect::<Result<Vec<_>, _>>()?;
    let bad = |reason: String| FrameError::OutOfBounds { index, reason };
    if storage_offset.checked_add(storage_len).is_none() {
        return Err(bad("the storage range overflows".into()));
    }
    check_layout(&shape, &strides, dtype, storage_offset.wrapping_add(view_offset)).map_err(bad)?;
    let (low, high) = strided_byte_span(&shape, &strides, dtype.size())
        .ok_or_else(|| bad(format!("shape {shape:?} with strides {strides:?} overflows")))?;
    let start = i128::from(view_offset) + i128::from(low);
    let end = i128::from(view_offset) + i128::from(high);
    if start < 0 || end > i128::from(storage_len) {
        return Err(bad(format!(
            "view bytes {start}..{end} (shape {shape:?}, strides {strides:?}, {dtype:?}) outside a {storage_len}-byte storage"
        )));
    }
    Ok(TensorDesc {
        chunk,
        storage_offset,
        storage_len,
        view_offset,
        dtype,
        fence,
        route,
        target,
        span,
        shape,
        strides,
    })
}
