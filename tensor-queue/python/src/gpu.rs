//! CUDA tensors at the boundary (torch), ordered by torch's streams with no CPU wait.
//!
//! Sending: a torch CUDA tensor's memory belongs to torch's caching allocator, which frees and
//! reuses it on its own; CUDA leaves it undefined when the owner frees memory another process has
//! open, so it is never exported. It is copied once into channel memory on this extension's
//! stream of that device, which first waits for the work queued on torch's stream (the producer's
//! kernels); torch's stream then waits for the copy, so torch cannot reuse the source before the
//! copy has read it. The message is sent ordered after the copy: the CPU waits for nothing.
//!
//! Receiving: the tensor is handed to torch through DLPack without a copy, after making torch's
//! current stream wait for the tensor's stream. When torch frees it, its memory goes back to the
//! sender only once the work queued by then on the consumer's stream (and on any stream given to
//! `record_stream`) is done.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cuda_sys::{CUdeviceptr, CUstream, driver};
use ipc_core::{Context, DeviceMemory, Event, Stream};
use tensor_queue::{DType, Tensor, TensorDevice};

/// What this process keeps per GPU: its primary context (torch's too) and a stream of its own.
pub struct DeviceState {
    /// The device's ordinal (torch's index).
    pub ordinal: i32,
    /// The primary context.
    pub context: Arc<Context>,
    /// Copies into channel memory and releases run here.
    pub stream: Stream,
    /// The event every ordering records and waits on (reused: a wait takes the event's state
    /// when it is queued, so recording it again later changes no earlier wait). Creating and
    /// destroying one per tensor cost two driver calls each time.
    event: Mutex<Event>,
}

impl DeviceState {
    /// Makes `waiter` wait for the work queued on `stream` so far (raw handles: torch's streams
    /// or ours).
    pub fn order_after(&self, waiter: CUstream, stream: CUstream) -> Result<(), String> {
        let event = self.event.lock().unwrap_or_else(|e| e.into_inner());
        self.context.bind().map_err(|e| e.to_string())?;
        // SAFETY: both streams are live in this context (torch's current stream, or ours), the
        // event too; the lock keeps another thread's record from landing between the two calls.
        unsafe {
            driver!(cuEventRecord(event.raw(), stream)).map_err(|e| e.to_string())?;
            driver!(cuStreamWaitEvent(waiter, event.raw(), 0)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

static DEVICES: OnceLock<Mutex<HashMap<i32, Arc<DeviceState>>>> = OnceLock::new();

/// The state of GPU `ordinal`, made on first use.
pub fn device(ordinal: i32) -> Result<Arc<DeviceState>, String> {
    let devices = DEVICES.get_or_init(Default::default);
    let mut devices = devices.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(state) = devices.get(&ordinal) {
        return Ok(state.clone());
    }
    let context = Context::on_ordinal(ordinal).map_err(|e| format!("GPU {ordinal}: {e}"))?;
    let stream = Stream::new(&context).map_err(|e| format!("GPU {ordinal}: {e}"))?;
    let event = Mutex::new(Event::new(&context).map_err(|e| format!("GPU {ordinal}: {e}"))?);
    let state = Arc::new(DeviceState { ordinal, context, stream, event });
    devices.insert(ordinal, state.clone());
    Ok(state)
}

/// Device memory given by address (torch's), for the copy helpers.
struct Foreign {
    ptr: CUdeviceptr,
    len: usize,
    context: Arc<Context>,
}

impl DeviceMemory for Foreign {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

/// Copies `nbytes` of contiguous device memory at `ptr` on `state`'s GPU into a new channel
/// tensor on `state`'s stream. The caller orders that stream after the producer's first, and the
/// producer's stream after it before the source may be reused (see `dlpack::SendOrder`).
pub fn copy_in(state: &DeviceState, ptr: CUdeviceptr, dtype: DType, dims: &[u64]) -> Result<Tensor, String> {
    let tensor = Tensor::empty_cuda(&state.context, dtype, dims).map_err(|e| e.to_string())?;
    let nbytes = tensor.nbytes();
    let source = Foreign { ptr, len: nbytes, context: state.context.clone() };
    let view = tensor.cuda_view().map_err(|e| e.to_string())?;
    state.stream.copy_async(&view, 0, &source, 0, nbytes).map_err(|e| e.to_string())?;
    drop(view);
    Ok(tensor)
}

/// Ordinals by GPU UUID (finding one enumerates the devices: several driver calls per tensor).
static ORDINALS: OnceLock<Mutex<HashMap<ipc_core::Uuid, i32>>> = OnceLock::new();

/// The ordinal of a received CUDA tensor's GPU.
pub fn ordinal_of(tensor: &Tensor) -> Result<i32, String> {
    let TensorDevice::Cuda(uuid) = tensor.device() else {
        return Err("a host tensor".into());
    };
    let ordinals = ORDINALS.get_or_init(Default::default);
    if let Some(&ordinal) = ordinals.lock().unwrap_or_else(|e| e.into_inner()).get(&uuid) {
        return Ok(ordinal);
    }
    let ordinal = ipc_core::Device::by_uuid(&uuid).map(|d| d.ordinal()).map_err(|e| e.to_string())?;
    ordinals.lock().unwrap_or_else(|e| e.into_inner()).insert(uuid, ordinal);
    Ok(ordinal)
}

/// A received CUDA tensor lent to torch: ordered on `consumer`, and given back on drop only after
/// the work queued on `consumer` (and on every stream added by `record_stream`) by then.
pub struct Lent {
    tensor: Tensor,
    state: Arc<DeviceState>,
    consumer: CUstream,
}

// SAFETY: the raw stream is a handle the driver accepts from any thread.
unsafe impl Send for Lent {}
// SAFETY: as above; nothing mutates through a shared reference.
unsafe impl Sync for Lent {}

/// Streams that `record_stream` added, by the lent tensor's device address.
static RECORDED: OnceLock<Mutex<HashMap<CUdeviceptr, Vec<usize>>>> = OnceLock::new();

fn recorded() -> std::sync::MutexGuard<'static, HashMap<CUdeviceptr, Vec<usize>>> {
    RECORDED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

impl Lent {
    /// Lends `tensor` to work on `consumer` (torch's current stream of its device). `ordered`
    /// lists the (consumer, stream) waits already queued for this message: its tensors landed
    /// before any was handed over, so one wait per pair covers them all.
    pub fn new(tensor: Tensor, consumer: CUstream, ordered: &mut Vec<(usize, usize)>) -> Result<Lent, String> {
        let state = device(ordinal_of(&tensor)?)?;
        if let Some(stream) = tensor.stream() {
            let pair = (consumer as usize, stream.raw() as usize);
            if !ordered.contains(&pair) {
                state.order_after(consumer, stream.raw())?;
                ordered.push(pair);
            }
        }
        let lent = Lent { tensor, state, consumer };
        recorded().insert(lent.ptr()?, Vec::new());
        Ok(lent)
    }

    /// The device address of element 0.
    pub fn ptr(&self) -> Result<CUdeviceptr, String> {
        Ok(self.tensor.cuda_view().map_err(|e| e.to_string())?.device_ptr())
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let extra = self.ptr().ok().and_then(|ptr| recorded().remove(&ptr)).unwrap_or_default();
        let mut ordered = self.state.order_after(self.state.stream.raw(), self.consumer).is_ok();
        for stream in extra {
            ordered &= self.state.order_after(self.state.stream.raw(), stream as CUstream).is_ok();
        }
        if !ordered || self.tensor.record_stream(&self.state.stream).is_err() {
            // Ordering failed (a broken context): wait instead of handing memory back early.
            let _ = self.state.context.synchronize();
        }
    }
}

/// Adds `stream` to the streams whose work the lent tensor at `ptr` waits for before going back;
/// false when no lent tensor starts at `ptr`.
pub fn record_stream(ptr: CUdeviceptr, stream: CUstream) -> bool {
    match recorded().get_mut(&ptr) {
        Some(streams) => {
            streams.push(stream as usize);
            true
        }
        None => false,
    }
}
