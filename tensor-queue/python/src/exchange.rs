//! torch's DLPack C exchange API (`type(x).__dlpack_c_exchange_api__`): a capsule holding a
//! table of C functions that describe a tensor, give the current stream and wrap a DLPack tensor
//! as a framework tensor, without the Python calls (`__dlpack__`, `torch.cuda.current_stream`,
//! `torch.from_dlpack`) that would cost tens of microseconds per tensor.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use dlpark::ffi::{DLDeviceType, DLManagedTensorVersioned, DLPackExchangeAPI, DLTensor};
use pyo3::ffi;
use pyo3::prelude::*;

const NAME: &std::ffi::CStr = c"dlpack_exchange_api";

/// A framework's exchange table (static in the framework: it lives as long as the process).
#[derive(Clone, Copy)]
pub struct Api(&'static DLPackExchangeAPI);

/// Tables found, by type object address (`None`: the type has none).
static FOUND: OnceLock<Mutex<HashMap<usize, Option<usize>>>> = OnceLock::new();

/// The exchange table of `value`'s type, if it has a DLPack 1.x one.
pub fn api_of(value: &Bound<'_, PyAny>) -> Option<Api> {
    api_of_type(&value.get_type())
}

/// The exchange table of `class`, if it has a DLPack 1.x one.
fn api_of_type(class: &Bound<'_, pyo3::types::PyType>) -> Option<Api> {
    let key = class.as_ptr() as usize;
    let found = FOUND.get_or_init(Default::default);
    if let Some(known) = found.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        // SAFETY: stored from a live table below; tables are static in their framework.
        return known.map(|address| Api(unsafe { &*(address as *const DLPackExchangeAPI) }));
    }
    let table = class.getattr("__dlpack_c_exchange_api__").ok().and_then(|capsule| {
        // SAFETY: `PyCapsule_IsValid` checks type and name without raising; the pointer of a
        // capsule so named is the framework's static table (the DLPack protocol).
        unsafe {
            if ffi::PyCapsule_IsValid(capsule.as_ptr(), NAME.as_ptr()) != 1 {
                return None;
            }
            let table = ffi::PyCapsule_GetPointer(capsule.as_ptr(), NAME.as_ptr()).cast::<DLPackExchangeAPI>();
            let usable = !table.is_null()
                && (*table).header.version.major == 1
                && (*table).dltensor_from_py_object_no_sync.is_some()
                && (*table).current_work_stream.is_some();
            usable.then_some(table as usize)
        }
    });
    found.lock().unwrap_or_else(|e| e.into_inner()).insert(key, table);
    // SAFETY: as above.
    table.map(|address| Api(unsafe { &*(address as *const DLPackExchangeAPI) }))
}

impl Api {
    /// Describes `value` (of this table's type) without taking ownership: valid until control
    /// returns to Python while `value` lives.
    pub fn describe(self, value: &Bound<'_, PyAny>) -> PyResult<DLTensor> {
        let describe = self.0.dltensor_from_py_object_no_sync.expect("checked in api_of");
        // SAFETY: an all-zero DLTensor is a valid out-value (null pointers, zero numbers).
        let mut tensor: DLTensor = unsafe { std::mem::zeroed() };
        // SAFETY: `value` is a live object of the table's type and `tensor` a writable out-value.
        if unsafe { describe(value.as_ptr().cast(), &mut tensor) } != 0 {
            return Err(PyErr::fetch(value.py()));
        }
        Ok(tensor)
    }

    /// The framework's current stream on CUDA device `ordinal`.
    pub fn current_stream(self, py: Python<'_>, ordinal: i32) -> PyResult<cuda_sys::CUstream> {
        let current = self.0.current_work_stream.expect("checked in api_of");
        let mut stream = std::ptr::null_mut();
        // SAFETY: `stream` is a writable out-value; the call holds the GIL, as it may raise.
        if unsafe { current(DLDeviceType::CUDA, ordinal, &mut stream) } != 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(stream.cast())
    }

    /// Wraps `managed` as the framework's tensor (ownership passes to it, success or not).
    ///
    /// # Safety
    /// `managed` is a valid, owned DLPack 1.x tensor.
    pub unsafe fn wrap<'py>(
        self,
        py: Python<'py>,
        managed: *mut DLManagedTensorVersioned,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(wrap) = self.0.managed_tensor_to_py_object_no_sync else {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("the framework cannot wrap DLPack tensors"));
        };
        let mut out = std::ptr::null_mut();
        // SAFETY: the caller vouches for `managed`; `out` is a writable out-value.
        if unsafe { wrap(managed, &mut out) } != 0 {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: on success `out` is a new reference.
        unsafe { Bound::from_owned_ptr_or_err(py, out.cast()) }
    }
}

/// torch's table (its address), once found.
static TORCH: OnceLock<Option<usize>> = OnceLock::new();

/// torch's table, found through `torch.Tensor` (for receipts, where no torch object is at hand)
/// once per process: an import and an attribute lookup per received tensor add up.
pub fn torch_api(py: Python<'_>) -> PyResult<Option<Api>> {
    let address = match TORCH.get() {
        Some(&address) => address,
        None => {
            let tensor_type = py.import("torch")?.getattr("Tensor")?;
            let found = api_of_type(tensor_type.cast::<pyo3::types::PyType>()?).map(|api| api.0 as *const _ as usize);
            *TORCH.get_or_init(|| found)
        }
    };
    // SAFETY: stored from a live table; tables are static in their framework.
    Ok(address.map(|address| Api(unsafe { &*(address as *const DLPackExchangeAPI) })))
}
