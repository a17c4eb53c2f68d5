//! `tensor_queue._native`: the Python face of tensor-queue (DESIGN.md decision 12).
//!
//! Python messages are a safe value tree (`value::Value`: no pickle, nothing runs on receipt)
//! carried by the same Rust channels as every other message; arrays cross the language boundary
//! through DLPack (`dlpack`). The Python package `tensor_queue` (beside this crate) re-exports
//! these classes and adds `Queue`, the exception classes and the documentation.

mod channel;
mod dlpack;
mod errors;
mod exchange;
mod gpu;
mod local;
mod shareable;
mod stats;
mod value;

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// What this process's channel memory holds now: `host_bytes`, `device_bytes`, `in_use_bytes`.
#[pyfunction]
fn memory_usage(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let usage = tensor_queue::memory::usage();
    let dict = PyDict::new(py);
    dict.set_item("host_bytes", usage.host_bytes)?;
    dict.set_item("device_bytes", usage.device_bytes)?;
    dict.set_item("in_use_bytes", usage.in_use_bytes)?;
    Ok(dict)
}

/// Gives back every chunk of channel memory that holds no live tensor; returns the bytes.
#[pyfunction]
fn memory_trim(py: Python<'_>) -> usize {
    py.detach(tensor_queue::memory::trim)
}

/// Whether a CUDA driver and at least one GPU are usable in this process.
#[pyfunction]
fn is_gpu_available(py: Python<'_>) -> bool {
    py.detach(tensor_queue::is_gpu_available)
}

/// Adds `stream` (a raw `CUstream`) to the streams whose queued work a tensor received from a
/// channel (at device address `ptr`) waits for before its memory goes back; false when no such
/// tensor starts at `ptr`.
#[pyfunction]
fn record_stream(ptr: u64, stream: usize) -> bool {
    gpu::record_stream(ptr, stream as cuda_sys::CUstream)
}

/// Whether `value`'s type publishes a DLPack C exchange table this extension can use (the fast
/// path for torch tensors; without it arrays go through `__dlpack__`).
#[pyfunction]
fn has_exchange_api(value: &Bound<'_, PyAny>) -> bool {
    exchange::api_of(value).is_some()
}

/// Whether this build has tensor-queue's test switches (the `test-switches` feature: the GPU
/// bundle's test wheel); without them `TENSOR_QUEUE_TEST_SKIP_ORDERING` does nothing.
#[pyfunction]
fn test_switches() -> bool {
    cfg!(feature = "test-switches")
}

/// How many blocks of channel memory torch's `tq.shareable()` pools hold in this process.
#[pyfunction]
fn shareable_blocks() -> usize {
    shareable::block_count()
}

/// The extension's version (the workspace's).
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The module `tensor_queue._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<channel::Sender>()?;
    m.add_class::<channel::Receiver>()?;
    m.add_class::<channel::Broadcast>()?;
    m.add_class::<dlpack::Array>()?;
    m.add_function(wrap_pyfunction!(memory_usage, m)?)?;
    m.add_function(wrap_pyfunction!(memory_trim, m)?)?;
    m.add_function(wrap_pyfunction!(is_gpu_available, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(test_switches, m)?)?;
    m.add_function(wrap_pyfunction!(shareable_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(has_exchange_api, m)?)?;
    m.add_function(wrap_pyfunction!(stats::stats, m)?)?;
    m.add_function(wrap_pyfunction!(stats::reset_stats, m)?)?;
    Ok(())
}
