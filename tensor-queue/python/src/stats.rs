//! Counters of what this process's channels did, copies above all (`tq.stats()`).

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// One counter of `tq.stats()`.
pub struct Counter(AtomicU64);

impl Counter {
    const fn new() -> Counter {
        Counter(AtomicU64::new(0))
    }

    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
}

/// Messages sent (a broadcast counts once per receiver).
pub static MESSAGES_SENT: Counter = Counter::new();
/// Messages received.
pub static MESSAGES_RECEIVED: Counter = Counter::new();
/// Arrays sent.
pub static ARRAYS_SENT: Counter = Counter::new();
/// Arrays received.
pub static ARRAYS_RECEIVED: Counter = Counter::new();
/// Arrays copied into channel memory at `send` (a framework's own memory is never exported).
pub static SEND_COPIES: Counter = Counter::new();
/// Their bytes.
pub static SEND_COPY_BYTES: Counter = Counter::new();
/// CUDA arrays sent without a copy (made inside `tq.shareable()`: they lie in channel memory).
pub static SEND_ZERO_COPIES: Counter = Counter::new();
/// Their bytes.
pub static SEND_ZERO_COPY_BYTES: Counter = Counter::new();
/// Arrays taken through a framework's DLPack C exchange table (torch: no Python calls).
pub static SEND_EXCHANGE_API: Counter = Counter::new();
/// Arrays taken through `__dlpack__` (other frameworks, older torch; a GPU copy waits on the CPU).
pub static SEND_DLPACK_FALLBACK: Counter = Counter::new();
/// Arrays copied at receipt (host tensors handed to torch, which has no read-only tensors).
pub static RECEIVE_COPIES: Counter = Counter::new();
/// Their bytes.
pub static RECEIVE_COPY_BYTES: Counter = Counter::new();

const ALL: [(&str, &Counter); 12] = [
    ("messages_sent", &MESSAGES_SENT),
    ("messages_received", &MESSAGES_RECEIVED),
    ("arrays_sent", &ARRAYS_SENT),
    ("arrays_received", &ARRAYS_RECEIVED),
    ("send_copies", &SEND_COPIES),
    ("send_copy_bytes", &SEND_COPY_BYTES),
    ("send_zero_copies", &SEND_ZERO_COPIES),
    ("send_zero_copy_bytes", &SEND_ZERO_COPY_BYTES),
    ("send_exchange_api", &SEND_EXCHANGE_API),
    ("send_dlpack_fallback", &SEND_DLPACK_FALLBACK),
    ("receive_copies", &RECEIVE_COPIES),
    ("receive_copy_bytes", &RECEIVE_COPY_BYTES),
];

/// This process's counters since it started (or since `reset_stats`).
#[pyfunction]
pub fn stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let dict = PyDict::new(py);
    for (name, counter) in ALL {
        dict.set_item(name, counter.0.load(Ordering::Relaxed))?;
    }
    Ok(dict)
}

/// Sets every counter of `stats()` back to zero.
#[pyfunction]
pub fn reset_stats() {
    for (_, counter) in ALL {
        counter.0.store(0, Ordering::Relaxed);
    }
}
