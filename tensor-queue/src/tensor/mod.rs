//! The tensor: storage (GPU memory, or host memory that can be shared), a dtype, a shape, strides
//! and a byte offset. Views share storage.

pub(crate) mod convert;
pub(crate) mod copy;
mod dims;
pub(crate) mod dtype;
pub(crate) mod layout;
mod view;

use std::sync::Arc;

use ipc_core::layout::strided_byte_span;
use ipc_core::{Context, DeviceBuffer, DeviceMemory, Event, SharedMemory, Stream, Uuid};

use crate::error::{Error, Result, TensorProblem};
use crate::fences::{Fences, failed};
use crate::memory::arena::{Allocation, Arena, Chunk, ChunkMemory};
use crate::tensor::dims::Dims;
use crate::tensor::dtype::{DType, Element};
use ipc_core::SharedElements as HostElements;

/// Where a tensor's bytes are.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor, TensorDevice};
/// let t = Tensor::zeros(DType::F32, &[4])?;
/// match t.device() {
///     TensorDevice::Host => assert_eq!(t.to_vec::<f32>()?, [0.0; 4]), // readable on the CPU
///     TensorDevice::Cuda(uuid) => println!("on GPU {uuid}: read it with to_vec"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorDevice {
    /// Host memory (shared memory, reachable by other processes).
    Host,
    /// GPU memory of the device with this UUID.
    Cuda(Uuid),
}

/// How a tensor reached this process: every received tensor reports its path.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor, TransferPath};
/// fn route(t: &Tensor) -> &'static str {
///     match t.path() {
///         TransferPath::Local => "made here",
///         TransferPath::HostSharedMemory => "host memory of the sender",
///         TransferPath::CudaVmm | TransferPath::CudaLegacyIpc => "GPU memory of the sender",
///         _ => "a route added later", // the enum is non-exhaustive
///     }
/// }
/// assert_eq!(route(&Tensor::zeros(DType::U8, &[1])?), "made here");
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferPath {
    /// Allocated here, not received.
    Local,
    /// Host memory mapped from the sender's shared-memory file (zero-copy).
    HostSharedMemory,
    /// The sender's VMM memory on the same GPU, mapped from a file descriptor (zero-copy).
    CudaVmm,
    /// The sender's `cuMemAlloc` buffer on the same GPU, opened from a legacy IPC handle (zero-copy).
    CudaLegacyIpc,
    /// The sender's memory on another GPU, mapped for the receiver's GPU over the peer link
    /// (zero-copy; [`crate::route::Route::PeerMap`]).
    PeerMapped,
    /// Copied by the sender's stream over the peer link into memory on the receiver's GPU
    /// ([`crate::route::Route::PeerCopy`]).
    PeerCopied,
    /// Staged through shared pinned host memory and copied onto the receiver's GPU
    /// ([`crate::route::Route::Staged`]).
    Staged,
    /// A GPU tensor copied by the sender into shared host memory ([`crate::route::Route::Host`]).
    StagedToHost,
    /// Moved by NCCL from a sender on another host into memory on this process's GPU
    /// ([`crate::route::Route::Nccl`]).
    Nccl,
    /// Bytes sent over the TCP link by a sender on another host, into this process's host
    /// memory ([`crate::route::Route::Tcp`]); for a GPU tensor of a small message (see
    /// [`SenderBuilder::inline_gpu_up_to`](crate::SenderBuilder::inline_gpu_up_to)), then copied
    /// onto this process's GPU on the tensor's stream.
    Tcp,
}

/// What a received message's tensors hold: the message's lease on the sender's memory, returned
/// when the last of them drops (implemented by the receiver, `recv/release.rs`, so that the
/// tensor needs nothing above it).
pub(crate) trait Lease: Send + Sync {
    /// Whether the producer died before its work on these tensors was done.
    fn producer_failed(&self) -> bool;
}

/// A contiguous run of bytes in a chunk, kept alive while any view of it lives.
pub(crate) struct Storage {
    pub chunk: Arc<Chunk>,
    pub offset: usize,
    pub len: usize,
    /// Held for its `Drop`: the allocation or the lease goes back when the storage dies.
    origin: Origin,
    /// Events after GPU work on other streams that uses the storage (`Tensor::record_stream`),
    /// at most one per stream (the latest covers the earlier ones): the memory goes back only
    /// once they are complete. Shared: one event recorded after a message's copies holds every
    /// storage they read or write.
    uses: std::sync::Mutex<Vec<(usize, Arc<Event>)>>,
}

impl Drop for Storage {
    fn drop(&mut self) {
        let uses: Vec<Arc<Event>> = std::mem::take(self.uses.get_mut().unwrap_or_else(|e| e.into_inner()))
            .into_iter()
            .map(|(_, e)| e)
            .collect();
        if uses.iter().all(|event| event.is_complete().unwrap_or(true)) {
            return;
        }
        let origin = std::mem::replace(&mut self.origin, Origin::User);
        crate::memory::arena::drop_after(uses, Box::new(origin));
    }
}

/// Who gets the storage back when the last view drops.
enum Origin {
    /// The arena this process allocated from.
    Arena(#[expect(dead_code, reason = "held for its Drop")] Allocation),
    /// Nobody: a whole user buffer, freed with the chunk.
    User,
    /// The sender, through a release message.
    Received(Arc<dyn Lease>),
    /// This process's arena: a received tensor copied here (the sender's memory went back when
    /// the copy was done); the producer's fences say whether the copy read finished data.
    Landed(#[expect(dead_code, reason = "held for its Drop")] Allocation, Fences),
}

/// A host storage's bytes go into a TCP bulk run straight from its mapping (see
/// `send/network.rs`); the run holds the storage until they are written.
impl ipc_core::tcp::SharedBytes for Storage {
    fn shared_memory(&self) -> Option<&SharedMemory> {
        self.chunk.host()
    }
}

impl Storage {
    /// Storage that owns an arena allocation.
    pub fn from_allocation(allocation: Allocation) -> Storage {
        Storage::new(allocation.chunk.clone(), allocation.offset, allocation.len, Origin::Arena(allocation))
    }

    /// Storage received by a copy into this process's arena, queued on `stream` and done when
    /// `copied` (recorded after it) is complete: the memory is not reused before.
    pub fn landed(allocation: Allocation, fences: Fences, stream: &Stream, copied: Arc<Event>) -> Storage {
        let storage = Storage::landing(allocation, fences);
        storage.hold_until(stream, copied);
        storage
    }

    /// Storage that data will land in, in this process's arena; whoever queues the copy into it
    /// holds it ([`Storage::hold_until`]) until the copy is done.
    pub fn landing(allocation: Allocation, fences: Fences) -> Storage {
        Storage::new(allocation.chunk.clone(), allocation.offset, allocation.len, Origin::Landed(allocation, fences))
    }

    /// Keeps the memory from going back (to the arena, or to the sender) until `event`, recorded
    /// on `stream` after work that uses it, is complete. It replaces an earlier event of that
    /// stream, and events already complete are forgotten, so memory used again and again holds
    /// few.
    pub fn hold_until(&self, stream: &Stream, event: Arc<Event>) {
        let key = stream.raw() as usize;
        let mut uses = crate::sync::lock(&self.uses);
        uses.retain(|(k, e)| *k != key && !e.is_complete().unwrap_or(true));
        uses.push((key, event));
    }

    pub fn received(chunk: Arc<Chunk>, offset: usize, len: usize, lease: Arc<dyn Lease>) -> Storage {
        Storage::new(chunk, offset, len, Origin::Received(lease))
    }

    /// Storage over all of `chunk` that gives nothing back when it dies (the chunk goes with its
    /// last holder): views of memory that other storages own, for the in-process floor of
    /// `testing::serde_floor`.
    pub fn whole_chunk(chunk: Arc<Chunk>) -> Storage {
        let len = chunk.len();
        Storage::new(chunk, 0, len, Origin::User)
    }

    fn new(chunk: Arc<Chunk>, offset: usize, len: usize, origin: Origin) -> Storage {
        Storage { chunk, offset, len, origin, uses: std::sync::Mutex::new(Vec::new()) }
    }
}

/// An n-dimensional view of typed memory that can be sent to other processes.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor};
/// let t = Tensor::from_slice(&[0i32, 1, 2, 3, 4, 5], DType::I32, &[2, 3])?;
/// let view = t.transpose(0, 1)?.flip(&[0])?; // no copy: strides and an offset
/// assert_eq!(view.to_vec::<i32>()?, [2, 5, 1, 4, 0, 3]);
/// assert_eq!(t.expand(&[4, 2, 3])?.numel(), 24); // broadcast with stride 0
/// # Ok(()) }
/// ```
pub struct Tensor {
    pub(crate) storage: Arc<Storage>,
    dtype: DType,
    /// Sizes and strides, inline for a few dimensions (see `dims.rs`).
    dims: Dims,
    /// Bytes from the storage's start to element 0.
    offset: usize,
    path: TransferPath,
    stream: Option<Arc<Stream>>,
}

/// A copy of the view: the storage's count, and the dimensions copied whole (inline ones as two
/// fixed arrays; sending clones every tensor of a message).
impl Clone for Tensor {
    fn clone(&self) -> Tensor {
        Tensor {
            storage: self.storage.clone(),
            dtype: self.dtype,
            dims: self.dims.clone(),
            offset: self.offset,
            path: self.path,
            stream: self.stream.clone(),
        }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape())
            .field("strides", &self.strides())
            .field("offset", &self.offset)
            .field("device", &self.device())
            .field("path", &self.path)
            .finish()
    }
}

/// Row-major strides of a contiguous tensor of `shape`.
///
/// Saturating: an empty tensor may have sizes whose product overflows (a peer can send
/// `[0, 2^40, 2^40]`), and asking whether it is contiguous must not overflow then.
///
/// ```
/// use tensor_queue::contiguous_strides;
/// assert_eq!(contiguous_strides(&[2, 3, 4]), [12, 4, 1]);
/// assert_eq!(contiguous_strides(&[0, 1 << 40, 1 << 40]), [i64::MAX, 1 << 40, 1]); // saturated
/// ```
pub fn contiguous_strides(shape: &[u64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        let size = i64::try_from(shape[d + 1].max(1)).unwrap_or(i64::MAX);
        strides[d] = strides[d + 1].saturating_mul(size);
    }
    strides
}

fn byte_len(dtype: DType, shape: &[u64]) -> Result<usize> {
    if shape.len() > crate::tensor::layout::MAX_DIMS {
        return Err(TensorProblem::TooManyDims { ndim: shape.len(), max: crate::tensor::layout::MAX_DIMS }.into());
    }
    shape
        .iter()
        .try_fold(dtype.size() as u64, |n, &d| n.checked_mul(d))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| TensorProblem::ShapeTooLarge { shape: shape.to_vec() }.into())
}

/// Whether elements of `T` hold `dtype`: a [`TensorProblem::DTypeMismatch`] if not.
/// Refuses element bytes a `dtype` tensor cannot hold: a [`DType::Bool`] is 0 or 1. Checked
/// where this crate writes a caller's values (made from data, `set`, `fill`); the bytes of a
/// received tensor are the sender's, as they were.
pub(crate) fn check_values(dtype: DType, bytes: &[u8]) -> Result<()> {
    match bytes.iter().find(|&&b| b > 1) {
        Some(&value) if dtype == DType::Bool => Err(TensorProblem::NotABool { value }.into()),
        _ => Ok(()),
    }
}

pub(crate) fn check_element<T: Element>(dtype: DType) -> Result<()> {
    if !T::matches(dtype) {
        return Err(
            TensorProblem::DTypeMismatch { dtype: format!("{dtype:?}"), element: std::any::type_name::<T>() }.into()
        );
    }
    Ok(())
}

impl Tensor {
    fn with_storage(storage: Storage, dtype: DType, shape: &[u64]) -> Tensor {
        Tensor {
            storage: Arc::new(storage),
            dtype,
            dims: Dims::new(shape, &contiguous_strides(shape)),
            offset: 0,
            path: TransferPath::Local,
            stream: None,
        }
    }

    pub(crate) fn from_parts(
        storage: Arc<Storage>,
        dtype: DType,
        shape: &[u64],
        strides: &[i64],
        offset: usize,
        path: TransferPath,
        stream: Option<Arc<Stream>>,
    ) -> Tensor {
        Tensor { storage, dtype, dims: Dims::new(shape, strides), offset, path, stream }
    }

    fn from_arena(arena: &Arc<Arena>, dtype: DType, shape: &[u64]) -> Result<Tensor> {
        let allocation = arena.allocate(byte_len(dtype, shape)?)?;
        let storage =
            Storage::new(allocation.chunk.clone(), allocation.offset, allocation.len, Origin::Arena(allocation));
        Ok(Tensor::with_storage(storage, dtype, shape))
    }

    /// A zero-filled host tensor in shared memory. Receivers map it read-only: they can read it
    /// but neither write it nor map it writable (see [`Tensor::zeros_writable`]).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-zeros.sock", std::process::id()));
    /// # let mut receiver = tensor_queue::Receiver::<tensor_queue::Tensor>::bind(&path)?;
    /// # let sender = tensor_queue::Sender::<tensor_queue::Tensor>::connect(&path)?;
    /// let t = Tensor::zeros(DType::I64, &[2, 2])?;
    /// t.set(&[0, 1], 7i64)?; // writable here
    /// sender.send(&t)?;
    /// let received = receiver.recv()?;
    /// assert_eq!(received.to_vec::<i64>()?, [0, 7, 0, 0]);
    /// assert!(matches!(received.set(&[0, 0], 1i64), Err(tensor_queue::Error::ReadOnly)), "read-only for receivers");
    /// # Ok(()) }
    /// ```
    pub fn zeros(dtype: DType, shape: &[u64]) -> Result<Tensor> {
        Tensor::zeros_in(&Arena::host(), dtype, shape)
    }

    /// A zero-filled host tensor in shared memory that receivers may write too (for example,
    /// workers that each fill a part of one result). Its chunk is shared writable with every
    /// receiver of any tensor in it: use it only for memory meant to be written by peers.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-zeros-writable.sock", std::process::id()));
    /// # let mut receiver = tensor_queue::Receiver::<tensor_queue::Tensor>::bind(&path)?;
    /// # let sender = tensor_queue::Sender::<tensor_queue::Tensor>::connect(&path)?;
    /// let result = Tensor::zeros_writable(DType::F32, &[2])?;
    /// sender.send(&result.narrow(0, 1, 1)?)?; // a worker's part of the result
    /// let part = receiver.recv()?; // in the worker
    /// part.set(&[0], 5.0f32)?;
    /// assert_eq!(result.to_vec::<f32>()?, [0.0, 5.0]); // one memory: the sender sees the write
    /// # Ok(()) }
    /// ```
    pub fn zeros_writable(dtype: DType, shape: &[u64]) -> Result<Tensor> {
        Tensor::zeros_in(&Arena::host_writable(), dtype, shape)
    }

    fn zeros_in(arena: &Arc<Arena>, dtype: DType, shape: &[u64]) -> Result<Tensor> {
        let tensor = Tensor::from_arena(arena, dtype, shape)?;
        let (memory, at) = tensor.host_storage()?;
        memory.fill(at, tensor.storage.len, 0)?;
        Ok(tensor)
    }

    /// A host tensor holding `data`, shaped `shape`.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], DType::F32, &[2, 3])?;
    /// assert_eq!(t.get::<f32>(&[1, 0])?, 4.0);
    /// assert!(Tensor::from_slice(&[1.0f64], DType::F32, &[1]).is_err(), "the element type must match");
    /// # Ok(()) }
    /// ```
    pub fn from_slice<T: Element>(data: &[T], dtype: DType, shape: &[u64]) -> Result<Tensor> {
        check_element::<T>(dtype)?;
        Tensor::from_bytes(bytemuck::cast_slice(data), dtype, shape)
    }

    /// A host tensor of any dtype from its row-major bytes (little-endian, as the GPU has them).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// // bf16 has no Rust type: its bits are given as bytes.
    /// let one = 0x3f80u16; // 1.0 in bf16
    /// let bytes: Vec<u8> = [one, one].iter().flat_map(|x| x.to_le_bytes()).collect();
    /// let t = Tensor::from_bytes(&bytes, DType::BF16, &[2])?;
    /// assert_eq!(t.to_vec::<u16>()?, [one, one]);
    /// # Ok(()) }
    /// ```
    pub fn from_bytes(bytes: &[u8], dtype: DType, shape: &[u64]) -> Result<Tensor> {
        let tensor = Tensor::from_arena(&Arena::host(), dtype, shape)?;
        if bytes.len() != tensor.nbytes() {
            return Err(TensorProblem::LengthMismatch { data_bytes: bytes.len(), tensor_bytes: tensor.nbytes() }.into());
        }
        check_values(dtype, bytes)?;
        let (memory, at) = tensor.host_storage()?;
        memory.write(at, bytes)?;
        Ok(tensor)
    }

    /// An uninitialised tensor in shareable memory on `context`'s device.
    ///
    /// The process's first such tensor on a device pays, once, for what sending from that
    /// device needs: a memory chunk and a block of signal words, each exported (about 0.7 ms
    /// apiece on an H200), so that the first message of a channel does not.
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Context, DType, Sender, Stream, Tensor};
    /// let sender = Sender::<Tensor>::connect("/tmp/activations.sock")?;
    /// let stream = Stream::new(&Context::on_ordinal(0)?)?;
    /// let out = Tensor::empty_cuda(stream.context(), DType::F32, &[1024, 1024])?;
    /// out.fill_on(1.0f32, &stream)?; // or your own kernel, writing through `out.cuda_view()?`
    /// sender.send_on(&out, &stream)?; // the receiver's use waits for the fill; this thread does not
    /// # Ok(()) }
    /// ```
    pub fn empty_cuda(context: &Arc<Context>, dtype: DType, shape: &[u64]) -> Result<Tensor> {
        // A tensor made to be sent: the device's signal words are made now (once per process),
        // not by the first message.
        crate::memory::signal::prepare(context);
        Tensor::from_arena(&Arena::device(context), dtype, shape)
    }

    /// Wraps a `cuMemAlloc` buffer made elsewhere; it is sent through a legacy IPC handle.
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::sync::Arc;
    /// use ipc_core::DeviceBuffer;
    /// use tensor_queue::{Context, DType, Sender, Tensor};
    /// let sender = Sender::<Tensor>::connect("/tmp/buffers.sock")?;
    /// let buffer = Arc::new(DeviceBuffer::alloc(&Context::on_ordinal(0)?, 4096 * 4)?); // made by other code
    /// let t = Tensor::from_device_buffer(buffer, DType::F32, &[4096])?;
    /// sender.send(&t)?; // no copy: the receiver opens the buffer itself
    /// # Ok(()) }
    /// ```
    pub fn from_device_buffer(buffer: Arc<DeviceBuffer>, dtype: DType, shape: &[u64]) -> Result<Tensor> {
        let len = byte_len(dtype, shape)?;
        if len > buffer.len() {
            return Err(
                TensorProblem::BufferTooSmall { shape: shape.to_vec(), needed: len, available: buffer.len() }.into()
            );
        }
        let chunk = Chunk::new(ChunkMemory::Legacy(buffer))?;
        let storage = Storage::new(chunk.clone(), 0, chunk.len(), Origin::User);
        Ok(Tensor::with_storage(storage, dtype, shape))
    }

    /// The element type.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F16, &[8])?;
    /// assert_eq!(t.dtype(), DType::F16);
    /// assert_eq!(t.nbytes(), 8 * t.dtype().size());
    /// # Ok(()) }
    /// ```
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Sizes of each dimension.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F32, &[2, 3, 4])?;
    /// assert_eq!(t.shape(), [2, 3, 4]);
    /// assert_eq!(t.select(1, 0)?.shape(), [2, 4]);
    /// # Ok(()) }
    /// ```
    pub fn shape(&self) -> &[u64] {
        self.dims.shape()
    }

    /// Strides of each dimension, in elements.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F32, &[2, 3])?;
    /// assert_eq!(t.strides(), [3, 1]); // in elements, not bytes
    /// assert_eq!(t.transpose(0, 1)?.strides(), [1, 3]);
    /// # Ok(()) }
    /// ```
    pub fn strides(&self) -> &[i64] {
        self.dims.strides()
    }

    /// Bytes from the storage's start to element 0.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F32, &[4, 4])?;
    /// assert_eq!(t.offset(), 0);
    /// assert_eq!(t.narrow(0, 1, 2)?.offset(), 16); // in bytes: one row of four f32
    /// # Ok(()) }
    /// ```
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of elements.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F32, &[2, 3])?;
    /// assert_eq!(t.numel(), 6);
    /// assert_eq!(t.select(0, 1)?.select(0, 2)?.numel(), 1); // a 0-d tensor holds one element
    /// # Ok(()) }
    /// ```
    pub fn numel(&self) -> u64 {
        self.shape().iter().product()
    }

    /// Bytes of the elements (as if contiguous).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F32, &[2, 3])?;
    /// assert_eq!(t.nbytes(), 24);
    /// assert_eq!(t.expand(&[10, 2, 3])?.nbytes(), 240); // as if contiguous, though it shares t's 24 bytes
    /// # Ok(()) }
    /// ```
    pub fn nbytes(&self) -> usize {
        self.numel() as usize * self.dtype.size()
    }

    /// Whether elements are laid out row-major without gaps.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F32, &[2, 3])?;
    /// assert!(t.is_contiguous());
    /// let tt = t.transpose(0, 1)?;
    /// assert!(!tt.is_contiguous());
    /// assert!(tt.contiguous()?.is_contiguous()); // a packed copy
    /// # Ok(()) }
    /// ```
    pub fn is_contiguous(&self) -> bool {
        self.shape()
            .iter()
            .zip(self.strides().iter().zip(contiguous_strides(self.shape())))
            .all(|(&n, (&s, c))| n <= 1 || s == c)
    }

    /// Where the bytes are. A tensor mapped over a peer link ([`TransferPath::PeerMapped`]) is
    /// on the sender's GPU but used from the receiver's: launch kernels on the device of
    /// [`Tensor::stream`], where it is mapped (copies made with `copy_on` or `contiguous_on` land
    /// there too).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor, TensorDevice};
    /// assert_eq!(Tensor::zeros(DType::U8, &[16])?.device(), TensorDevice::Host);
    /// # Ok(()) }
    /// ```
    pub fn device(&self) -> TensorDevice {
        match self.storage.chunk.device_uuid() {
            Some(uuid) => TensorDevice::Cuda(uuid),
            None => TensorDevice::Host,
        }
    }

    /// How this tensor reached this process.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor, TransferPath};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-path.sock", std::process::id()));
    /// # let mut receiver = tensor_queue::Receiver::<tensor_queue::Tensor>::bind(&path)?;
    /// # let sender = tensor_queue::Sender::<tensor_queue::Tensor>::connect(&path)?;
    /// let t = Tensor::from_slice(&[1u8, 2, 3], DType::U8, &[3])?;
    /// assert_eq!(t.path(), TransferPath::Local);
    /// sender.send(&t)?;
    /// let received = receiver.recv()?;
    /// assert_eq!(received.path(), TransferPath::HostSharedMemory); // the sender's pages, not a copy
    /// # Ok(()) }
    /// ```
    pub fn path(&self) -> TransferPath {
        self.path
    }

    /// For a received GPU tensor: the stream its first use is ordered on (its sender's stream in
    /// the receiver, or the one set with `Receiver::set_stream`). Work on another stream must be
    /// ordered after this one by the user.
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// # let mut receiver = tensor_queue::Receiver::<tensor_queue::Tensor>::bind("/tmp/activations.sock")?;
    /// let x = receiver.recv()?; // a GPU tensor
    /// let stream = x.stream().expect("received GPU tensors are ordered on a stream").clone();
    /// let y = x.copy_on(&stream)?; // your kernels go on `stream` too: after the producer's work
    /// stream.synchronize()?;
    /// # drop(y); Ok(()) }
    /// ```
    pub fn stream(&self) -> Option<&Arc<Stream>> {
        self.stream.as_ref()
    }

    /// For a received GPU tensor: whether its producer died before its GPU work on the tensor
    /// was done, so the bytes are not what it meant to send. `recv` refuses such messages when
    /// the death is known by then ([`Error::ProducerFailed`]); this tells about a death that came
    /// later. Work ordered after the tensor still runs (it is not left waiting forever) but reads
    /// whatever the memory held.
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// # let mut receiver = tensor_queue::Receiver::<tensor_queue::Tensor>::bind("/tmp/activations.sock")?;
    /// let x = receiver.recv()?;
    /// let y = x.to_vec::<f32>()?; // waits for the producer's work, or for its death
    /// if x.producer_failed() {
    ///     eprintln!("the producer died before x was written: dropping the {} values", y.len());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn producer_failed(&self) -> bool {
        match &self.storage.origin {
            Origin::Received(lease) => lease.producer_failed(),
            Origin::Landed(_, fences) => failed(fences),
            _ => false,
        }
    }

    /// The same tensor with another element type (its layout checked by the caller, see
    /// `view.rs`).
    pub(crate) fn with_dtype(&self, dtype: DType) -> Tensor {
        Tensor { dtype, ..self.clone() }
    }

    /// The same storage seen with another layout (checked by the caller, see `view.rs`).
    pub(crate) fn with_layout(&self, shape: Vec<u64>, strides: Vec<i64>, offset: usize) -> Tensor {
        Tensor {
            dims: Dims::new(&shape, &strides),
            offset,
            path: self.path,
            stream: self.stream.clone(),
            storage: self.storage.clone(),
            dtype: self.dtype,
        }
    }

    /// The byte range of the storage this view touches, relative to the storage's start.
    pub(crate) fn touched_bytes(&self) -> Result<(usize, usize)> {
        let (low, high) =
            strided_byte_span(self.shape(), self.strides(), self.dtype.size()).ok_or(TensorProblem::OutsideStorage)?;
        let start = self.offset as i64 + low;
        let end = self.offset as i64 + high;
        if start < 0 || end > self.storage.len as i64 {
            return Err(TensorProblem::OutsideStorage.into());
        }
        Ok((start as usize, end as usize))
    }

    /// The shared memory holding a host tensor's storage, and the storage's first byte in it.
    /// Every access to host data goes through this mapping's bounds-checked methods.
    pub(crate) fn host_storage(&self) -> Result<(&SharedMemory, usize)> {
        let memory = self.storage.chunk.host().ok_or(TensorProblem::NotHost)?;
        Ok((memory, self.storage.offset))
    }

    /// The address of the first element (index `[0, ..., 0]`) of a host tensor, and whether this
    /// process may write through it, for handing the memory to another library (DLPack, NumPy's
    /// array interface) without a copy. The address stays valid while any clone of the tensor
    /// lives; with `strides()` (in elements) it locates every element. A received tensor is
    /// read-only unless its sender made it with [`Tensor::zeros_writable`]: writing through a
    /// read-only address faults.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1i32, 2, 3, 4], DType::I32, &[2, 2])?;
    /// let (first, writable) = t.host_address()?;
    /// let (second_row, _) = t.select(0, 1)?.host_address()?;
    /// assert!(writable, "the sender's own tensor");
    /// assert_eq!(second_row as usize - first as usize, 8); // one row of two i32 further on
    /// // SAFETY: the address of a live, contiguous I32 tensor of four elements.
    /// assert_eq!(unsafe { *(second_row as *const i32) }, 3);
    /// # Ok(()) }
    /// ```
    pub fn host_address(&self) -> Result<(*mut u8, bool)> {
        let writable = self.check_writable().is_ok();
        let (memory, at) = self.host_storage()?;
        // The view's offset lies inside the storage (checked when the view was made or received),
        // so the sum stays inside the mapping.
        Ok((memory.as_ptr().wrapping_add(at + self.offset), writable))
    }

    /// The elements of a contiguous host tensor, typed, in place: copy them out
    /// ([`HostElements::to_vec`](crate::HostElements::to_vec)), or borrow them without a copy
    /// through the `unsafe` [`HostElements::as_slice`](crate::HostElements::as_slice). (This
    /// replaces `Tensor::as_slice`, which was an `unsafe fn` of the tensor.)
    ///
    /// # Safety of `as_slice`
    /// Host tensors are shared memory, written through `&self` and by other processes, so the
    /// compiler cannot see the writes a `&[T]` must never overlap. While the slice lives, nobody
    /// may write its bytes:
    /// - not this process: [`Tensor::set`], [`Tensor::fill`], [`Tensor::copy_into`] (as the
    ///   destination) or a GPU copy into it, on this tensor, a clone or any view of its storage,
    ///   from any thread;
    /// - not another process: the receivers of a [`Tensor::zeros_writable`] tensor, or, for a
    ///   received tensor, its sender, which may go on writing its own memory.
    ///
    /// Where that cannot be promised, copy instead ([`Tensor::to_vec`], [`Tensor::get`]).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1i32, 2, 3, 4], DType::I32, &[2, 2])?;
    /// // SAFETY: `t` has no clone or view, was never sent, and is not written while `s` lives.
    /// let s = unsafe { t.host_elements::<i32>()?.as_slice() };
    /// assert_eq!(s, [1, 2, 3, 4]); // no copy
    /// let strided = t.transpose(0, 1)?;
    /// assert!(strided.host_elements::<i32>().is_err(), "strided: use to_vec");
    /// assert_eq!(t.to_vec::<i32>()?, [1, 2, 3, 4]); // the safe way: a copy
    /// # Ok(()) }
    /// ```
    ///
    /// Safe code cannot hold the slice across a write (each of these fails to compile, E0133):
    /// a write through a clone,
    /// ```compile_fail,E0133
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1.0f32, 2.0], DType::F32, &[2])?;
    /// let other = t.clone();
    /// let view: &[f32] = t.host_elements::<f32>()?.as_slice();
    /// other.set(&[0], 99.0f32)?; // would change view[0] under a live shared borrow
    /// assert_eq!(view[0], 1.0);
    /// # Ok(()) }
    /// ```
    /// through a view of the same storage,
    /// ```compile_fail,E0133
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F32, &[2, 2])?;
    /// let view: &[f32] = t.host_elements::<f32>()?.as_slice();
    /// t.select(0, 1)?.fill(3.0f32)?;
    /// assert_eq!(view[2], 0.0);
    /// # Ok(()) }
    /// ```
    /// by a copy into it,
    /// ```compile_fail,E0133
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::U8, &[4])?;
    /// let view: &[u8] = t.host_elements::<u8>()?.as_slice();
    /// Tensor::from_slice(&[1u8; 4], DType::U8, &[4])?.copy_into(&t)?;
    /// assert_eq!(view, [0; 4]);
    /// # Ok(()) }
    /// ```
    /// by a receiver of writable memory,
    /// ```compile_fail,E0133
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Receiver, Sender, Tensor};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-as-slice-writable.sock", std::process::id()));
    /// let mut receiver = Receiver::<Tensor>::bind(&path)?;
    /// let sender = Sender::<Tensor>::connect(&path)?;
    /// let result = Tensor::zeros_writable(DType::F32, &[2])?;
    /// let mine: &[f32] = result.host_elements::<f32>()?.as_slice();
    /// sender.send(&result)?;
    /// receiver.recv()?.set(&[0], 5.0f32)?; // a worker (another process, usually) writes it
    /// assert_eq!(mine[0], 0.0);
    /// # Ok(()) }
    /// ```
    /// or by the sender of a received tensor.
    /// ```compile_fail,E0133
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Receiver, Sender, Tensor};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-as-slice-received.sock", std::process::id()));
    /// let mut receiver = Receiver::<Tensor>::bind(&path)?;
    /// let sender = Sender::<Tensor>::connect(&path)?;
    /// let t = Tensor::zeros(DType::F32, &[2])?;
    /// sender.send(&t)?;
    /// let received = receiver.recv()?;
    /// let view: &[f32] = received.host_elements::<f32>()?.as_slice();
    /// t.set(&[0], 1.0f32)?; // the sender (another process, usually) writes its own memory
    /// assert_eq!(view[0], 0.0);
    /// # Ok(()) }
    /// ```
    ///
    /// The old `unsafe fn` of the tensor is gone (E0599):
    /// ```compile_fail,E0599
    /// # fn main() -> tensor_queue::Result<()> {
    /// let t = tensor_queue::Tensor::from_slice(&[1.0f32], tensor_queue::DType::F32, &[1])?;
    /// let view: &[f32] = unsafe { t.as_slice::<f32>()? };
    /// # Ok(()) }
    /// ```
    pub fn host_elements<T: Element>(&self) -> Result<HostElements<'_, T>> {
        check_element::<T>(self.dtype)?;
        if !self.is_contiguous() {
            return Err(TensorProblem::NotContiguous { call: "host_elements" }.into());
        }
        let (memory, at) = self.host_storage()?;
        // In range: the view lies in its storage (checked when it was made or received); aligned:
        // allocations are 512-aligned and offsets are element multiples (checked again here).
        Ok(memory.elements::<T>(at + self.offset, self.numel() as usize)?)
    }

    /// The mapping of a host tensor, and the first byte of one element of it there.
    fn element_at(&self, index: &[u64]) -> Result<(&SharedMemory, usize)> {
        let bad_index = || TensorProblem::BadIndex { index: index.to_vec(), shape: self.shape().to_vec() };
        if index.len() != self.shape().len() {
            return Err(bad_index().into());
        }
        let mut at = self.offset as i64;
        for ((&i, &n), &s) in index.iter().zip(self.shape()).zip(self.strides()) {
            if i >= n {
                return Err(bad_index().into());
            }
            at += i as i64 * s * self.dtype.size() as i64;
        }
        let (memory, storage) = self.host_storage()?;
        // Inside the storage: the index is inside the shape, and the view inside the storage.
        let at = usize::try_from(storage as i64 + at).map_err(|_| TensorProblem::OutsideStorage)?;
        Ok((memory, at))
    }

    /// Writes one element of a host tensor from its bytes.
    pub(crate) fn set_bytes(&self, index: &[u64], bytes: &[u8]) -> Result<()> {
        self.check_writable()?;
        if bytes.len() != self.dtype.size() {
            return Err(TensorProblem::ElementBytes { len: bytes.len(), size: self.dtype.size() }.into());
        }
        let (memory, at) = self.element_at(index)?;
        memory.write(at, bytes)?;
        Ok(())
    }

    fn check_writable(&self) -> Result<()> {
        if self.storage.chunk.host().is_some_and(|memory| !memory.is_writable()) {
            return Err(Error::ReadOnly);
        }
        Ok(())
    }

    /// Reads one element of a host tensor.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], DType::I32, &[2, 3])?;
    /// assert_eq!(t.get::<i32>(&[1, 2])?, 6);
    /// assert!(t.get::<i32>(&[2, 0]).is_err(), "outside the shape");
    /// # Ok(()) }
    /// ```
    pub fn get<T: Element>(&self, index: &[u64]) -> Result<T> {
        check_element::<T>(self.dtype)?;
        let (memory, at) = self.element_at(index)?;
        let mut value = T::zeroed();
        memory.read(at, bytemuck::bytes_of_mut(&mut value))?;
        Ok(value)
    }

    /// Writes one element of a host tensor (shared with every holder of the storage). A received
    /// tensor is read-only unless its sender made it with [`Tensor::zeros_writable`].
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::zeros(DType::F32, &[2, 2])?;
    /// let row = t.select(0, 1)?;
    /// row.set(&[0], 3.0f32)?; // through a view: the same storage
    /// assert_eq!(t.to_vec::<f32>()?, [0.0, 0.0, 3.0, 0.0]);
    /// # Ok(()) }
    /// ```
    pub fn set<T: Element>(&self, index: &[u64], value: T) -> Result<()> {
        self.check_writable()?;
        check_element::<T>(self.dtype)?;
        check_values(self.dtype, bytemuck::bytes_of(&value))?;
        let (memory, at) = self.element_at(index)?;
        // Concurrent writers to the same element are the program's to avoid, as with any shared
        // buffer (each gets a torn value at worst, never undefined behaviour).
        memory.write(at, bytemuck::bytes_of(&value))?;
        Ok(())
    }

    /// The elements of a host tensor in row-major order, as bytes (a copy; any strides).
    pub(crate) fn host_bytes(&self) -> Result<Vec<u8>> {
        let (memory, base) = self.host_storage()?;
        // Copied by the mapping's `read`, never through a `&[u8]`: the memory is shared, and
        // others may write it meanwhile (they then get a torn copy, never undefined behaviour
        // of a reference whose bytes changed under it).
        if self.is_contiguous() {
            let mut out = Vec::new();
            out.try_reserve_exact(self.nbytes()).map_err(|_| TensorProblem::NoMemory { bytes: self.nbytes() })?;
            out.resize(self.nbytes(), 0);
            memory.read(base + self.offset, &mut out)?;
            return Ok(out);
        }
        let size = self.dtype.size();
        let mut out = Vec::new();
        // A broadcast view may have far more elements than memory: an error, not an abort.
        out.try_reserve_exact(self.nbytes()).map_err(|_| TensorProblem::NoMemory { bytes: self.nbytes() })?;
        let mut index = vec![0u64; self.shape().len()];
        for _ in 0..self.numel() {
            let at: i64 = index.iter().zip(self.strides()).map(|(&i, &s)| i as i64 * s).sum::<i64>() * size as i64;
            let mut element = [0u8; 16];
            // Every index is inside the shape and the view inside the storage; an element is at
            // most 16 bytes.
            let from = usize::try_from((base + self.offset) as i64 + at).map_err(|_| TensorProblem::OutsideStorage)?;
            memory.read(from, &mut element[..size])?;
            out.extend_from_slice(&element[..size]);
            for d in (0..index.len()).rev() {
                index[d] += 1;
                if index[d] < self.shape()[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Ok(out)
    }

    /// The GPU memory of this tensor, from element 0 to the end of the bytes its view touches
    /// (`nbytes()` for a contiguous tensor), for your own kernels and copies. It borrows the
    /// tensor, so it cannot outlive the memory. Its context is the one to work in: for a tensor
    /// mapped over a peer link ([`TransferPath::PeerMapped`]), the receiving GPU's, where it is
    /// mapped and where [`Tensor::stream`] runs.
    ///
    /// Raw memory carries no ordering: for a received tensor, queue work on [`Tensor::stream`]
    /// (or after it), never on the legacy stream (`DeviceMemory::copy_to_host` runs there), or it
    /// may see the producer's unfinished data. [`Tensor::to_bytes`], [`Tensor::copy_to_host_async`],
    /// [`Tensor::copy_into`] and the other helpers order themselves.
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Context, DType, DeviceMemory, Stream, Tensor};
    /// let stream = Stream::new(&Context::on_ordinal(0)?)?;
    /// let x = Tensor::zeros_cuda(DType::F32, &[256], &stream)?;
    /// let view = x.cuda_view()?;
    /// let (ptr, len) = (view.device_ptr(), view.len()); // arguments for your own kernel on `stream`
    /// assert_eq!(len, x.nbytes());
    /// # let _ = ptr; Ok(()) }
    /// ```
    pub fn cuda_view(&self) -> Result<DeviceView<'_>> {
        let memory = self.storage.chunk.device().ok_or(TensorProblem::NotCuda)?;
        let (_, end) = self.touched_bytes()?;
        let start = self.storage.offset + self.offset;
        Ok(DeviceView {
            ptr: memory.device_ptr() + start as u64,
            len: end.saturating_sub(self.offset),
            // Where work on it runs: for a tensor mapped over a peer link, the GPU it was mapped
            // for (its stream's), not the sender's GPU that holds the bytes; a stream of the
            // latter cannot be used with the former's memory operations.
            context: self.working_context()?,
            _tensor: std::marker::PhantomData,
        })
    }

    /// The storage's device memory and the byte offset of element 0 in it.
    pub(crate) fn device_memory(&self) -> Result<(&dyn DeviceMemory, usize)> {
        let memory = self.storage.chunk.device().ok_or(TensorProblem::NotCuda)?;
        Ok((memory, self.storage.offset + self.offset))
    }

    /// Keeps the storage from going back until `event`, recorded on `stream` after work that
    /// uses the tensor, is complete (see [`Storage::hold_until`]).
    pub(crate) fn hold_until(&self, stream: &Stream, event: Arc<Event>) {
        self.storage.hold_until(stream, event);
    }
}

/// A range of a GPU tensor's storage, usable wherever [`DeviceMemory`] is, for as long as the
/// tensor it was taken from lives.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{Context, DType, DeviceMemory, Stream, Tensor};
/// let stream = Stream::new(&Context::on_ordinal(0)?)?;
/// let x = Tensor::from_slice_cuda(&[1u8, 2, 3, 4], DType::U8, &[4], &stream)?;
/// stream.synchronize()?; // raw memory carries no ordering
/// let mut bytes = [0u8; 4];
/// x.cuda_view()?.copy_to_host(0, &mut bytes)?; // any DeviceMemory method
/// assert_eq!(bytes, [1, 2, 3, 4]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DeviceView<'a> {
    ptr: u64,
    len: usize,
    context: Arc<Context>,
    _tensor: std::marker::PhantomData<&'a Tensor>,
}

impl DeviceMemory for DeviceView<'_> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_share_storage() {
        let data: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let t = Tensor::from_slice(&data, DType::F32, &[3, 4]).unwrap();
        assert_eq!(t.strides(), [4, 1]);
        assert!(t.is_contiguous());
        let tt = t.transpose(0, 1).unwrap();
        assert_eq!((tt.shape(), tt.strides()), (&[4u64, 3][..], &[1i64, 4][..]));
        assert!(!tt.is_contiguous());
        assert_eq!(tt.get::<f32>(&[3, 2]).unwrap(), 11.0);
        let transposed: Vec<f32> = bytemuck::pod_collect_to_vec(&tt.to_bytes().unwrap());
        assert_eq!(transposed[..4], [0.0, 4.0, 8.0, 1.0]);
        let row = t.narrow(0, 1, 1).unwrap();
        assert_eq!(row.to_vec::<f32>().unwrap(), [4.0, 5.0, 6.0, 7.0]);
        row.set(&[0, 0], 40.0f32).unwrap();
        assert_eq!(t.get::<f32>(&[1, 0]).unwrap(), 40.0, "writes through a view reach the original");
        assert!(t.reshape(&[2, 6]).is_ok());
        assert!(tt.reshape(&[12]).is_err(), "a transposed view cannot be reshaped without a copy");
        assert_eq!(contiguous_strides(&[0, 1 << 40, 1 << 40]), [i64::MAX, 1 << 40, 1], "no overflow");
        let bytes = Tensor::zeros(DType::U8, &[512]).unwrap();
        assert!(bytes.reshape(&[(1 << 55) + 1, 512]).is_err(), "a product that wraps to 512 is refused");
        assert!(t.host_elements::<i32>().is_err(), "the element type must match");
        assert!(t.get::<f32>(&[3, 0]).is_err());
        assert_eq!(t.device(), TensorDevice::Host);
        assert_eq!(t.path(), TransferPath::Local);
    }

    #[test]
    fn zeros_are_zero_even_in_reused_memory() {
        let first = Tensor::from_slice(&[7u8; 4096], DType::U8, &[4096]).unwrap();
        drop(first);
        let again = Tensor::zeros(DType::U8, &[4096]).unwrap();
        assert!(again.to_vec::<u8>().unwrap().iter().all(|&b| b == 0));
    }
}
