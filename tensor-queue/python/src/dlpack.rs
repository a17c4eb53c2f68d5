//! Arrays at the language boundary, through DLPack.
//!
//! Sending: the array's `__dlpack__` capsule is read (not consumed: its own destructor gives it
//! back) and its elements are copied once into channel memory; a framework's own memory is never
//! exported. Receiving: the tensor is wrapped in an [`Array`] that keeps the channel memory alive
//! and hands it to NumPy through `__array_interface__` (read-only, no copy), to torch through a
//! DLPack capsule (host tensors copied into memory torch owns, since torch has no read-only
//! tensors and a write to read-only shared memory would kill the process), and to anything else
//! as the `Array` itself (`__dlpack__`, `__array_interface__`).

use std::ffi::{CStr, c_void};

use dlpark::DlpackFlags;
use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned, DLPackVersion,
    DLTensor,
};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};
use tensor_queue::{DType, Error, Tensor, TensorDevice};

use std::sync::Arc;

use cuda_sys::CUstream;

use crate::local::Local;
use crate::value::Framework;
use crate::{exchange, gpu, shareable, stats};

const VERSIONED: &CStr = c"dltensor_versioned";
const LEGACY: &CStr = c"dltensor";

/// Why an object could not be imported as an array.
pub enum ImportError {
    /// Python raised while asking the object.
    Python(PyErr),
    /// The object is an array the channel cannot carry (the text says why, after its location).
    Refused(String),
    /// The array is fine, but this process could not make its copy now (out of memory or of
    /// descriptors): the channel's own error, not the value's fault.
    Failed(Error),
}

impl ImportError {
    /// A tensor that could not be made of an array: its layout's fault (the array's), or the
    /// process's resources'.
    fn not_made(error: Error) -> ImportError {
        match error {
            Error::Tensor(problem) => ImportError::Refused(problem.to_string()),
            other => ImportError::Failed(other),
        }
    }
}

impl From<PyErr> for ImportError {
    fn from(error: PyErr) -> ImportError {
        ImportError::Python(error)
    }
}

/// Whether `value`'s type derives from `numpy.ndarray` (a subclass defined outside NumPy, whose
/// module says nothing of it: it arrived as a plain `Array`; outside tester, Python round 9).
fn derives_from_ndarray(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    for base in value.get_type().mro().iter() {
        let Ok(base) = base.cast_into::<pyo3::types::PyType>() else { continue };
        if base.name()? == "ndarray" && base.module()?.to_str()? == "numpy" {
            return Ok(true);
        }
    }
    Ok(false)
}

fn framework_of(value: &Bound<'_, PyAny>) -> PyResult<Framework> {
    let module = value.get_type().module()?;
    let module = module.to_str()?;
    Ok(if module == "numpy" || module.starts_with("numpy.") {
        if value.hasattr(intern!(value.py(), "__dlpack__"))? { Framework::Numpy } else { Framework::NumpyScalar }
    } else if module == "torch" || module.starts_with("torch.") {
        Framework::Torch
    } else {
        Framework::Other
    })
}

/// What sending a message's arrays needs besides their bytes: the GPUs whose streams its copies
/// were queued on, the stream the caller gave, whether copies are allowed, and the orderings
/// between torch's streams and ours, each queued once per message instead of once per tensor.
#[derive(Default)]
pub struct SendOrder {
    /// The GPUs whose extension streams hold the message's copies (in first-use order).
    pub devices: Vec<Arc<gpu::DeviceState>>,
    /// `send(stream=...)`: GPU arrays are ordered after this stream instead of the current one.
    pub explicit: Option<CUstream>,
    /// `send(copy="never")`: an array that would be copied is refused instead.
    pub never_copy: bool,
    /// (ordinal, producer stream) pairs our stream already waits for.
    waited: Vec<(i32, usize)>,
    /// Producer streams that must wait for our copies before torch may reuse their sources.
    copied_from: Vec<(Arc<gpu::DeviceState>, usize)>,
    /// Sources made for this message (a strided tensor's `contiguous()` copy), kept until the
    /// producer's stream waits for our copies of them.
    keep: Vec<Py<PyAny>>,
}

impl SendOrder {
    /// The order of a `send(stream=explicit, copy="never" if never_copy)`.
    pub fn new(explicit: Option<CUstream>, never_copy: bool) -> SendOrder {
        SendOrder { explicit, never_copy, ..SendOrder::default() }
    }

    fn used(&mut self, state: Arc<gpu::DeviceState>) {
        if !self.devices.iter().any(|d| d.ordinal == state.ordinal) {
            self.devices.push(state);
        }
    }

    /// GPU `ordinal`'s state, its stream ordered after the work queued so far on `producer`.
    fn after_producer(&mut self, ordinal: i32, producer: CUstream) -> Result<Arc<gpu::DeviceState>, String> {
        let state = gpu::device(ordinal)?;
        if !self.waited.contains(&(ordinal, producer as usize)) {
            state.order_after(state.stream.raw(), producer)?;
            self.waited.push((ordinal, producer as usize));
        }
        self.used(state.clone());
        Ok(state)
    }

    /// Work queued on `producer` since the last wait (a `contiguous()` copy) is waited for anew.
    fn producer_moved(&mut self, ordinal: i32, producer: CUstream) {
        self.waited.retain(|&pair| pair != (ordinal, producer as usize));
    }

    /// Queues the producer streams' waits for our copies (torch may reuse a copied source only
    /// after them) and lets the message's temporaries go. Runs once the message is encoded, or
    /// failed to be: copies queued before a failure read their sources all the same.
    pub fn finish(&mut self) -> Result<(), String> {
        let mut result = Ok(());
        for (state, producer) in self.copied_from.drain(..) {
            if let Err(e) = state.order_after(producer as CUstream, state.stream.raw()) {
                // A broken context: wait instead, so no source is reused before it is read.
                let _ = state.stream.synchronize();
                result = Err(e);
            }
        }
        self.keep.clear();
        result
    }
}

/// The tensor for an array (copied into channel memory), `None` for an object that is no array.
pub fn import(value: &Bound<'_, PyAny>, order: &mut SendOrder) -> Result<Option<(Tensor, Framework)>, ImportError> {
    if let Ok(array) = value.cast::<Array>() {
        // A received array sent on: its channel memory goes again, without a copy.
        let array = array.get();
        return Ok(Some((array.tensor.clone(), array.framework)));
    }
    let py = value.py();
    let framework = framework_of(value)?;
    if (framework == Framework::Numpy && value.get_type().name()? != "ndarray")
        || (framework == Framework::Other && derives_from_ndarray(value)?)
    {
        // It would arrive as a plain ndarray: a masked array without its mask, a matrix as 2-d.
        return Err(ImportError::Refused(format!(
            "is a {}, a subclass of numpy.ndarray that would arrive as a plain ndarray without what the \
             subclass adds (send numpy.asarray(x), and a masked array's mask beside it)",
            value.get_type().fully_qualified_name()?
        )));
    }
    let array = match framework {
        // NumPy scalars have no `__dlpack__`; a 0-d array holds the same.
        Framework::NumpyScalar => py.import("numpy")?.call_method1("asarray", (value,))?,
        _ if value.hasattr(intern!(py, "__dlpack__"))? => value.clone(),
        _ => return Ok(None),
    };
    if framework == Framework::Torch && array.getattr(intern!(py, "requires_grad"))?.is_truthy()? {
        return Err(ImportError::Refused("requires grad: send x.detach() (gradients do not cross processes)".into()));
    }
    let (tensor, copied) = match exchange::api_of(&array) {
        Some(api) => {
            stats::SEND_EXCHANGE_API.add(1);
            import_described(&array, api, order)?
        }
        None => {
            stats::SEND_DLPACK_FALLBACK.add(1);
            (import_dlpack(&array, order)?, true)
        }
    };
    if copied {
        stats::SEND_COPIES.add(1);
        stats::SEND_COPY_BYTES.add(tensor.nbytes() as u64);
    } else {
        stats::SEND_ZERO_COPIES.add(1);
        stats::SEND_ZERO_COPY_BYTES.add(tensor.nbytes() as u64);
    }
    Ok(Some((tensor, framework)))
}

/// Refuses an array that would be copied when `copy="never"` was asked.
fn may_copy(order: &SendOrder) -> Result<(), ImportError> {
    if order.never_copy {
        return Err(ImportError::Refused(
            "would be copied into channel memory, and copy=\"never\" was asked (only arrays received from a \
             channel and CUDA tensors made inside `with tensor_queue.shareable():` are sent without a copy)"
                .into(),
        ));
    }
    Ok(())
}

/// A CUDA array that lies inside `tq.shareable()` memory, as a view of it (no copy) ordered after
/// `producer`; `None` for any other array.
fn zero_copy(
    t: &DLTensor,
    layout: &Layout,
    producer: CUstream,
    order: &mut SendOrder,
) -> Result<Option<Tensor>, ImportError> {
    let ptr = t.data as u64 + t.byte_offset;
    let strides = layout.strides.clone().unwrap_or_else(|| tensor_queue::contiguous_strides(&layout.dims));
    let Some(tensor) = shareable::find(ptr, layout.dtype, &layout.dims, &strides) else {
        return Ok(None);
    };
    // The message goes ordered after this extension's stream, which waits for the producer's.
    order.after_producer(t.device.device_id, producer).map_err(ImportError::Refused)?;
    Ok(Some(tensor))
}

/// Through the framework's exchange table: no Python calls. The tensor, and whether it is a copy.
fn import_described(
    array: &Bound<'_, PyAny>,
    api: exchange::Api,
    order: &mut SendOrder,
) -> Result<(Tensor, bool), ImportError> {
    let py = array.py();
    let described = api.describe(array).map_err(|e| refused_export(py, e))?;
    if described.device.device_type != DLDeviceType::CUDA {
        may_copy(order)?;
        // SAFETY: `described` is valid while `array` lives and Python is not re-entered.
        return unsafe { copy_in(&described) }.map(|t| (t, true));
    }
    let ordinal = described.device.device_id;
    let producer = match order.explicit {
        Some(stream) => stream,
        None => api.current_stream(py, ordinal)?,
    };
    // SAFETY: as above.
    let layout = unsafe { layout(&described) }.map_err(ImportError::Refused)?;
    if let Some(tensor) = zero_copy(&described, &layout, producer, order)? {
        return Ok((tensor, false));
    }
    may_copy(order)?;
    if layout.contiguous {
        // SAFETY: as above.
        return unsafe { copy_device(&described, producer, order) }.map(|t| (t, true)).map_err(ImportError::Refused);
    }
    // Strided: the framework makes it contiguous on the same stream first, which our stream must
    // then wait for; the copy is kept until the producer's stream waits for ours.
    let contiguous = array.call_method0("contiguous")?;
    order.producer_moved(ordinal, producer);
    let described = api.describe(&contiguous).map_err(|e| refused_export(py, e))?;
    // SAFETY: `described` is valid while `contiguous` lives (in `order.keep`, past the copy).
    let copied = unsafe { copy_device(&described, producer, order) }.map(|t| (t, true)).map_err(ImportError::Refused);
    order.keep.push(contiguous.unbind());
    copied
}

/// Through `__dlpack__` (other frameworks, older torch): always a copy.
fn import_dlpack(array: &Bound<'_, PyAny>, order: &mut SendOrder) -> Result<Tensor, ImportError> {
    may_copy(order)?;
    let py = array.py();
    let kwargs = PyDict::new(py);
    kwargs.set_item(intern!(py, "max_version"), (1, 0))?;
    let mut cuda = None;
    if let Ok(device) = array.call_method0(intern!(py, "__dlpack_device__")) {
        let (device_type, device_id): (i32, i32) = device.extract()?;
        if device_type == DLDeviceType::CUDA.0 as i32 {
            let state = gpu::device(device_id).map_err(ImportError::Refused)?;
            match order.explicit {
                // The producer orders its current stream's work before ours (the DLPack stream
                // protocol).
                None => kwargs.set_item("stream", state.stream.raw() as usize)?,
                // `send(stream=...)`: ordered after that stream instead (below), not the current
                // one; -1 asks the producer for no ordering of its own.
                Some(_) => kwargs.set_item("stream", -1)?,
            }
            cuda = Some(state);
        } else if device_type != DLDeviceType::CPU.0 as i32 && device_type != DLDeviceType::CUDAHOST.0 as i32 {
            return Err(ImportError::Refused(format!(
                "is an array on DLPack device type {device_type}: host and CUDA arrays only"
            )));
        }
    }
    let capsule = match array.call_method(intern!(py, "__dlpack__"), (), Some(&kwargs)) {
        Ok(capsule) => capsule,
        // Producers older than DLPack 1.0 take no `max_version`.
        Err(error) if error.is_instance_of::<PyTypeError>(py) => {
            kwargs.del_item("max_version")?;
            array.call_method("__dlpack__", (), Some(&kwargs)).map_err(|e| refused_export(py, e))?
        }
        Err(error) => return Err(refused_export(py, error)),
    };
    read_capsule(&capsule, |described| match &cuda {
        // SAFETY: `described` comes from the live capsule.
        None => unsafe { copy_in(described) },
        Some(state) => {
            // The producer may free the memory once the capsule goes, so the copy is waited for
            // here (this fallback cannot order the producer after it).
            let producer = order.explicit.unwrap_or(state.stream.raw());
            // SAFETY: `described` comes from the live capsule.
            let tensor = unsafe { copy_device(described, producer, order) }.map_err(ImportError::Refused)?;
            state.stream.synchronize().map_err(|e| ImportError::Refused(e.to_string()))?;
            Ok(tensor)
        }
    })
}

fn refused_export(py: Python<'_>, error: PyErr) -> ImportError {
    if error.is_instance_of::<PyBufferError>(py) || error.is_instance_of::<pyo3::exceptions::PyRuntimeError>(py) {
        ImportError::Refused(format!("could not be exported through DLPack: {error}"))
    } else {
        ImportError::Python(error)
    }
}

/// Hands the DLTensor of a DLPack capsule to `read`; the capsule stays unconsumed (its
/// destructor calls the producer's deleter).
fn read_capsule(
    capsule: &Bound<'_, PyAny>,
    read: impl FnOnce(&DLTensor) -> Result<Tensor, ImportError>,
) -> Result<Tensor, ImportError> {
    let ptr = capsule.as_ptr();
    // SAFETY: `ptr` is a live object; `PyCapsule_IsValid` checks its type and name without
    // raising, and the capsule's pointer is the managed tensor its name promises (the DLPack
    // protocol). The capsule outlives this function, so the tensor it describes stays alive.
    unsafe {
        if ffi::PyCapsule_IsValid(ptr, VERSIONED.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(ptr, VERSIONED.as_ptr()).cast::<DLManagedTensorVersioned>();
            if managed.is_null() || (*managed).version.major != 1 {
                return Err(ImportError::Refused("is a DLPack array of an unknown major version".into()));
            }
            read(&(*managed).dl_tensor)
        } else if ffi::PyCapsule_IsValid(ptr, LEGACY.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(ptr, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            if managed.is_null() {
                return Err(ImportError::Refused("gave a DLPack capsule without a tensor".into()));
            }
            read(&(*managed).dl_tensor)
        } else {
            Err(ImportError::Refused("has a __dlpack__ that returned no unused DLPack capsule".into()))
        }
    }
}

/// Copies a contiguous CUDA DLTensor into channel memory on its GPU, ordered after `producer`.
///
/// # Safety
/// `t` describes live device memory.
unsafe fn copy_device(t: &DLTensor, producer: CUstream, order: &mut SendOrder) -> Result<Tensor, String> {
    // SAFETY: the caller's promise.
    let Layout { dtype, dims, contiguous, .. } = unsafe { layout(t) }?;
    if !contiguous {
        return Err("is a strided CUDA array: make it contiguous first".into());
    }
    let ptr = t.data as u64 + t.byte_offset;
    let state = order.after_producer(t.device.device_id, producer)?;
    let tensor = gpu::copy_in(&state, ptr, dtype, &dims)?;
    if !order.copied_from.iter().any(|(s, p)| s.ordinal == state.ordinal && *p == producer as usize) {
        order.copied_from.push((state, producer as usize));
    }
    Ok(tensor)
}

/// A DLTensor's element type and layout.
struct Layout {
    dtype: DType,
    dims: Vec<u64>,
    /// In elements; `None`: contiguous by omission.
    strides: Option<Vec<i64>>,
    /// Whether the elements are contiguous (row-major).
    contiguous: bool,
}

/// The layout of `t`.
///
/// # Safety
/// `t` comes from a live DLPack producer (its shape and strides arrays are readable).
unsafe fn layout(t: &DLTensor) -> Result<Layout, String> {
    let dtype = dtype_of(t.dtype).ok_or_else(|| {
        format!(
            "has a DLPack dtype (code {}, {} bits, {} lanes) a tensor cannot hold (bool, uint8, int8, int16, int32, \
             int64, float16, bfloat16, float32, float64)",
            t.dtype.code.0, t.dtype.bits, t.dtype.lanes
        )
    })?;
    let ndim = usize::try_from(t.ndim).map_err(|_| "has a negative number of dimensions".to_string())?;
    let (shape, strides): (&[i64], Option<&[i64]>) = if ndim == 0 {
        (&[], None)
    } else {
        // SAFETY: DLPack gives `ndim` shape entries, and `ndim` strides unless `strides` is null.
        unsafe {
            (
                std::slice::from_raw_parts(t.shape, ndim),
                (!t.strides.is_null()).then(|| std::slice::from_raw_parts(t.strides, ndim)),
            )
        }
    };
    if shape.iter().any(|&n| n < 0) {
        return Err("has a negative extent".into());
    }
    let dims: Vec<u64> = shape.iter().map(|&n| n as u64).collect();
    let standard = tensor_queue::contiguous_strides(&dims);
    let contiguous = strides.is_none_or(|s| s.iter().zip(&standard).zip(&dims).all(|((a, b), &n)| n == 1 || a == b));
    Ok(Layout { dtype, dims, strides: strides.map(<[i64]>::to_vec), contiguous })
}

fn dtype_of(dtype: DLDataType) -> Option<DType> {
    if dtype.lanes != 1 {
        return None;
    }
    Some(match (dtype.code, dtype.bits) {
        (DLDataTypeCode::BOOL, 8) => DType::Bool,
        (DLDataTypeCode::UINT, 8) => DType::U8,
        (DLDataTypeCode::INT, 8) => DType::I8,
        (DLDataTypeCode::INT, 16) => DType::I16,
        (DLDataTypeCode::INT, 32) => DType::I32,
        (DLDataTypeCode::INT, 64) => DType::I64,
        (DLDataTypeCode::FLOAT, 16) => DType::F16,
        (DLDataTypeCode::BFLOAT, 16) => DType::BF16,
        (DLDataTypeCode::FLOAT, 32) => DType::F32,
        (DLDataTypeCode::FLOAT, 64) => DType::F64,
        _ => return None,
    })
}

fn dl_dtype(dtype: DType) -> DLDataType {
    let (code, bits) = match dtype {
        DType::Bool => (DLDataTypeCode::BOOL, 8),
        DType::U8 => (DLDataTypeCode::UINT, 8),
        DType::I8 => (DLDataTypeCode::INT, 8),
        DType::I16 => (DLDataTypeCode::INT, 16),
        DType::I32 => (DLDataTypeCode::INT, 32),
        DType::I64 => (DLDataTypeCode::INT, 64),
        DType::F16 => (DLDataTypeCode::FLOAT, 16),
        DType::BF16 => (DLDataTypeCode::BFLOAT, 16),
        DType::F32 => (DLDataTypeCode::FLOAT, 32),
        DType::F64 => (DLDataTypeCode::FLOAT, 64),
    };
    DLDataType { code, bits, lanes: 1 }
}

/// The name Python users know a dtype by (NumPy's and torch's spelling).
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::Bool => "bool",
        DType::U8 => "uint8",
        DType::I8 => "int8",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F32 => "float32",
        DType::F64 => "float64",
    }
}

/// NumPy's type string, `None` for bfloat16 (NumPy has none).
fn typestr(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "|b1",
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::BF16 => return None,
        DType::F32 => "<f4",
        DType::F64 => "<f8",
    })
}

/// Copies a host DLTensor into a new host tensor (gathering a strided one).
///
/// # Safety
/// `t` describes live host memory, as the DLPack protocol promises for a capsule not yet deleted.
unsafe fn copy_in(t: &DLTensor) -> Result<Tensor, ImportError> {
    if t.device.device_type != DLDeviceType::CPU && t.device.device_type != DLDeviceType::CUDAHOST {
        return Err(ImportError::Refused(format!(
            "is an array on DLPack device type {}: host arrays only",
            t.device.device_type.0
        )));
    }
    // SAFETY: the caller's promise.
    let Layout { dtype, dims, strides, contiguous: is_contiguous } =
        unsafe { layout(t) }.map_err(ImportError::Refused)?;
    let ndim = dims.len();
    let numel: u64 = dims.iter().product();
    if numel == 0 {
        return Tensor::zeros(dtype, &dims).map_err(ImportError::not_made);
    }
    let size = dtype.size();
    // SAFETY: the data pointer plus the byte offset is the first element (DLPack).
    let base = unsafe { t.data.cast::<u8>().add(t.byte_offset as usize) };
    // A broadcast view (stride 0) can name far more elements than memory holds: its copy is
    // refused, never left to abort the process in the allocator.
    let too_large = || {
        ImportError::Refused(format!(
            "needs a copy of {numel} elements of {size} bytes, more than this process can allocate"
        ))
    };
    let nbytes = usize::try_from(numel).ok().and_then(|n| n.checked_mul(size)).ok_or_else(too_large)?;
    if is_contiguous {
        // SAFETY: a contiguous array of `numel` elements starts at `base`.
        let bytes = unsafe { std::slice::from_raw_parts(base, nbytes) };
        return Tensor::from_bytes(bytes, dtype, &dims).map_err(ImportError::not_made);
    }
    let strides = strides.unwrap_or_else(|| tensor_queue::contiguous_strides(&dims));
    let mut gathered = Vec::new();
    gathered.try_reserve_exact(nbytes).map_err(|_| too_large())?;
    let mut index = vec![0u64; ndim];
    for _ in 0..numel {
        let at: i64 = index.iter().zip(&strides).map(|(&i, &s)| i as i64 * s).sum::<i64>() * size as i64;
        // SAFETY: the index lies inside the shape, so the element lies inside the producer's array.
        gathered.extend_from_slice(unsafe { std::slice::from_raw_parts(base.offset(at as isize), size) });
        for d in (0..ndim).rev() {
            index[d] += 1;
            if index[d] < dims[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Tensor::from_bytes(&gathered, dtype, &dims).map_err(ImportError::not_made)
}

/// A received array: channel memory, kept alive while this object or anything made from it lives.
///
/// NumPy takes it without a copy (`numpy.asarray(a)`, read-only); any DLPack consumer takes it
/// through `__dlpack__`. Arrays from frameworks other than NumPy and torch arrive as this type.
#[pyclass(module = "tensor_queue._native", name = "Array", frozen)]
pub struct Array {
    tensor: Local<Tensor>,
    framework: Framework,
}

impl Array {
    fn dlpack_device(&self) -> DLDevice {
        // GPU tensors reach Python as torch tensors (`export_cuda_torch`); an `Array` is a host one
        // (a GPU tensor from a Rust peer to a non-torch receiver fails at `host_address`).
        DLDevice { device_type: DLDeviceType::CPU, device_id: 0 }
    }

    fn dl_tensor(&self, shape: &mut [i64], strides: &mut [i64]) -> PyResult<DLTensor> {
        let (data, _) = self.tensor.host_address().map_err(crate::errors::to_py)?;
        Ok(DLTensor {
            data: data.cast::<c_void>(),
            device: self.dlpack_device(),
            ndim: shape.len() as i32,
            dtype: dl_dtype(self.tensor.dtype()),
            shape: shape.as_mut_ptr(),
            strides: strides.as_mut_ptr(),
            byte_offset: 0,
        })
    }

    /// A DLPack capsule over this array's memory; `versioned` picks the DLPack 1.x struct (with
    /// the read-only flag where the memory is read-only here), else the legacy one.
    fn capsule<'py>(&self, py: Python<'py>, versioned: bool) -> PyResult<Bound<'py, PyAny>> {
        let shape: Vec<i64> = self.tensor.shape().iter().map(|&n| n as i64).collect();
        let strides = self.tensor.strides().to_vec();
        let (_, writable) = self.tensor.host_address().map_err(crate::errors::to_py)?;
        if versioned {
            let mut export = Box::new(Exported {
                managed: DLManagedTensorVersioned {
                    version: DLPackVersion { major: 1, minor: 0 },
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_versioned::<Local<Tensor>>),
                    flags: if writable { DlpackFlags::empty() } else { DlpackFlags::READ_ONLY },
                    dl_tensor: unused_dl_tensor(),
                },
                shape,
                strides,
                _keep: Local::new(Tensor::clone(&self.tensor)),
            });
            export.managed.dl_tensor = self.dl_tensor(&mut export.shape, &mut export.strides)?;
            let managed = Box::into_raw(export).cast::<c_void>();
            // SAFETY: `managed` is the boxed struct (its first field is the DLPack struct); the
            // capsule's destructor deletes it unless a consumer renamed the capsule (took it).
            unsafe { owned_capsule(py, managed, VERSIONED, destroy_versioned_capsule) }
        } else {
            let mut export = Box::new(Exported {
                managed: DLManagedTensor {
                    dl_tensor: unused_dl_tensor(),
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_legacy::<Local<Tensor>>),
                },
                shape,
                strides,
                _keep: Local::new(Tensor::clone(&self.tensor)),
            });
            export.managed.dl_tensor = self.dl_tensor(&mut export.shape, &mut export.strides)?;
            let managed = Box::into_raw(export).cast::<c_void>();
            // SAFETY: as above, with the legacy struct.
            unsafe { owned_capsule(py, managed, LEGACY, destroy_legacy_capsule) }
        }
    }
}

fn unused_dl_tensor() -> DLTensor {
    DLTensor {
        data: std::ptr::null_mut(),
        device: DLDevice { device_type: DLDeviceType::CPU, device_id: 0 },
        ndim: 0,
        dtype: dl_dtype(DType::U8),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// A DLPack struct and what it points into; the struct comes first so that a pointer to it is a
/// pointer to the whole (what the deleter gets back).
#[repr(C)]
struct Exported<M, K> {
    managed: M,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _keep: K,
}

unsafe extern "C" fn delete_versioned<K>(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: `managed` came from `Box::into_raw` of an `Exported` whose first field it is; the
    // DLPack protocol calls the deleter once.
    drop(unsafe { Box::from_raw(managed.cast::<Exported<DLManagedTensorVersioned, K>>()) });
}

unsafe extern "C" fn delete_legacy<K>(managed: *mut DLManagedTensor) {
    // SAFETY: as in `delete_versioned`.
    drop(unsafe { Box::from_raw(managed.cast::<Exported<DLManagedTensor, K>>()) });
}

unsafe extern "C" fn destroy_versioned_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the dying capsule; a capsule still named "dltensor_versioned"
    // was never taken by a consumer, so its tensor is ours to delete (`IsValid` raises nothing).
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()).cast::<DLManagedTensorVersioned>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

unsafe extern "C" fn destroy_legacy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `destroy_versioned_capsule`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// A capsule named `name` over `pointer`, destroyed by `destructor`.
///
/// # Safety
/// `pointer` is what `destructor` expects under `name`; on failure it is leaked (no double free).
unsafe fn owned_capsule<'py>(
    py: Python<'py>,
    pointer: *mut c_void,
    name: &'static CStr,
    destructor: unsafe extern "C" fn(*mut ffi::PyObject),
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `name` is static (capsules keep the pointer); the caller vouches for `pointer`.
    unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyCapsule_New(pointer, name.as_ptr(), Some(destructor))) }
}

#[pymethods]
impl Array {
    /// The extents.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.tensor.shape())
    }

    /// The element type's name (`"float32"`, `"bfloat16"`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.tensor.dtype())
    }

    /// Bytes of the elements.
    #[getter]
    fn nbytes(&self) -> usize {
        self.tensor.nbytes()
    }

    /// How the array came: `"Local"`, `"HostSharedMemory"`, ... (the Rust `TransferPath`).
    #[getter]
    fn path(&self) -> String {
        format!("{:?}", self.tensor.path())
    }

    /// Whether this process may write the memory (received host memory is read-only).
    #[getter]
    fn writable(&self) -> PyResult<bool> {
        Ok(self.tensor.host_address().map_err(crate::errors::to_py)?.1)
    }

    /// NumPy's array interface: the memory without a copy, read-only where it is read-only here.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let typestr = typestr(self.tensor.dtype())
            .ok_or_else(|| PyTypeError::new_err("bfloat16 has no NumPy dtype: take this array with torch"))?;
        let (data, writable) = self.tensor.host_address().map_err(crate::errors::to_py)?;
        let size = self.tensor.dtype().size() as i64;
        let strides: Vec<i64> = self.tensor.strides().iter().map(|s| s * size).collect();
        let dict = PyDict::new(py);
        dict.set_item(intern!(py, "version"), 3)?;
        dict.set_item(intern!(py, "shape"), PyTuple::new(py, self.tensor.shape())?)?;
        dict.set_item(intern!(py, "typestr"), typestr)?;
        dict.set_item(intern!(py, "data"), (data as usize, !writable))?;
        dict.set_item(intern!(py, "strides"), PyTuple::new(py, strides)?)?;
        Ok(dict)
    }

    /// `(device_type, device_id)` as DLPack numbers them.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let device = self.dlpack_device();
        (device.device_type.0 as i32, device.device_id)
    }

    /// A DLPack capsule over the memory (no copy); `copy=True` is refused (copy after taking it).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream; // host memory: nothing to order
        if let Some((device_type, device_id)) = dl_device {
            let own = self.dlpack_device();
            if (device_type, device_id) != (own.device_type.0 as i32, own.device_id) {
                return Err(PyBufferError::new_err("tensor_queue.Array cannot move itself to another device"));
            }
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err("tensor_queue.Array does not copy itself: take it, then copy"));
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        // A legacy capsule cannot say "read-only", and its consumer may write: memory mapped
        // read-only would crash it (NumPy refuses the same for its read-only arrays).
        if !versioned && !self.tensor.host_address().map_err(crate::errors::to_py)?.1 {
            return Err(PyBufferError::new_err(
                "tensor_queue.Array is read-only, which a DLPack capsule before version 1 cannot say: \
                 ask with max_version=(1, 0), or take it with numpy.asarray (read-only) and copy",
            ));
        }
        self.capsule(py, versioned)
    }

    fn __repr__(&self) -> String {
        format!(
            "tensor_queue.Array(shape={:?}, dtype={}, path={:?})",
            self.tensor.shape(),
            self.dtype(),
            self.tensor.path()
        )
    }
}

/// The Python object for a received array, as the framework it left.
/// `ordered`: the stream waits already queued for this message (see `gpu::Lent::new`).
pub fn export<'py>(
    py: Python<'py>,
    tensor: Tensor,
    framework: Framework,
    ordered: &mut Vec<(usize, usize)>,
) -> PyResult<Bound<'py, PyAny>> {
    stats::ARRAYS_RECEIVED.add(1);
    let array = Bound::new(py, Array { tensor: Local::new(tensor), framework })?;
    // Looked up once per process, not once per array.
    static ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static FROM_DLPACK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    match framework {
        Framework::Numpy => ASARRAY.import(py, "numpy", "asarray")?.call1((array,)),
        Framework::NumpyScalar => ASARRAY.import(py, "numpy", "asarray")?.call1((array,))?.get_item(()),
        Framework::Torch if array.get().tensor.device() != TensorDevice::Host => {
            let tensor = array.get().tensor.clone();
            drop(array);
            export_cuda_torch(py, tensor, ordered)
        }
        Framework::Torch => {
            let nbytes = array.get().tensor.nbytes() as u64;
            // Legacy capsule: torch takes it whatever its version; the clone gives torch memory
            // it owns and may write (torch has no read-only tensors).
            let capsule = array.get().capsule(py, false)?;
            let tensor = FROM_DLPACK.import(py, "torch.utils.dlpack", "from_dlpack")?.call1((capsule,))?;
            stats::RECEIVE_COPIES.add(1);
            stats::RECEIVE_COPY_BYTES.add(nbytes);
            tensor.call_method0("clone")
        }
        Framework::Other => Ok(array.into_any()),
    }
}

/// A received CUDA tensor as a torch tensor, without a copy, ordered on torch's current stream.
fn export_cuda_torch<'py>(
    py: Python<'py>,
    tensor: Tensor,
    ordered: &mut Vec<(usize, usize)>,
) -> PyResult<Bound<'py, PyAny>> {
    let failed = |e: String| crate::errors::raise("TensorQueueError", e);
    let ordinal = gpu::ordinal_of(&tensor).map_err(failed)?;
    let api = exchange::torch_api(py)?;
    let consumer: CUstream = match api {
        Some(api) => api.current_stream(py, ordinal)?,
        None => {
            let stream = py.import("torch.cuda")?.call_method1("current_stream", (ordinal,))?;
            stream.getattr("cuda_stream")?.extract::<usize>()? as CUstream
        }
    };
    let shape: Vec<i64> = tensor.shape().iter().map(|&n| n as i64).collect();
    let strides = tensor.strides().to_vec();
    let dtype = dl_dtype(tensor.dtype());
    let lent = gpu::Lent::new(tensor, consumer, ordered).map_err(failed)?;
    let data = lent.ptr().map_err(failed)? as usize as *mut c_void;
    let mut export = Box::new(Exported {
        managed: DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_versioned::<Local<gpu::Lent>>),
            flags: DlpackFlags::empty(),
            dl_tensor: unused_dl_tensor(),
        },
        shape,
        strides,
        _keep: Local::new(lent),
    });
    export.managed.dl_tensor = DLTensor {
        data,
        device: DLDevice { device_type: DLDeviceType::CUDA, device_id: ordinal },
        ndim: export.shape.len() as i32,
        dtype,
        shape: export.shape.as_mut_ptr(),
        strides: export.strides.as_mut_ptr(),
        byte_offset: 0,
    };
    let managed = Box::into_raw(export).cast::<DLManagedTensorVersioned>();
    match api {
        // SAFETY: `managed` is a complete DLPack 1.x tensor; torch takes ownership.
        Some(api) => unsafe { api.wrap(py, managed) },
        None => {
            // SAFETY: as in `Array::capsule`.
            let capsule = unsafe { owned_capsule(py, managed.cast(), VERSIONED, destroy_versioned_capsule) }?;
            py.import("torch")?.call_method1("from_dlpack", (capsule,))
        }
    }
}
