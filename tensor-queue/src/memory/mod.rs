//! How much memory this process's tensors hold, and giving it back.
//!
//! Sendable tensors are carved out of large shareable chunks (see [`Tensor::empty_cuda`] and
//! [`Tensor::zeros`]), because exporting and importing memory is expensive. A chunk whose tensors
//! are all gone (dropped here, and released by every receiver) is kept for reuse for the idle
//! release time (one second unless [`set_idle_release`] says otherwise) and then goes back to the
//! driver (device memory) or the kernel (shared memory). [`trim`] gives back every such chunk at
//! once. Receivers that mapped a chunk are told when it goes and unmap it, so the memory is
//! really free, not only in this process.
//!
//! ```
//! let held = tensor_queue::memory::usage();
//! println!("{} bytes of device memory, {} in use", held.device_bytes, held.in_use_bytes);
//! tensor_queue::memory::trim();
//! ```
//!
//! [`Tensor::empty_cuda`]: crate::Tensor::empty_cuda
//! [`Tensor::zeros`]: crate::Tensor::zeros

pub(crate) mod arena;
pub(crate) mod signal;

pub use arena::MemoryUsage;

use std::time::Duration;

/// What this process's arenas hold now. Copies a route makes count where they live: a sender's
/// peer copies (on the receiver's GPU) and staging (shared host memory) in the sender's arenas
/// until the receiver releases them, a receiver's staged landings in its own.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor, memory};
/// let t = Tensor::zeros(DType::F32, &[1024])?;
/// let held = memory::usage();
/// assert!(held.in_use_bytes >= t.nbytes());
/// assert!(held.host_bytes >= t.nbytes(), "host tensors are carved out of shared-memory chunks");
/// # Ok(()) }
/// ```
pub fn usage() -> MemoryUsage {
    crate::memory::arena::usage()
}

/// Gives back every chunk that holds no live tensor now; returns the bytes given back.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor, memory};
/// drop(Tensor::zeros(DType::U8, &[1 << 20])?);
/// // The free chunk would be kept a while for reuse; give it back now.
/// assert!(memory::trim() > 0);
/// assert_eq!(memory::usage().host_bytes, 0);
/// # Ok(()) }
/// ```
pub fn trim() -> usize {
    crate::memory::arena::trim()
}

/// How long a chunk with no live tensor is kept for reuse before it goes back (default one
/// second; zero gives chunks back as soon as they are free, at the cost of exporting a new one,
/// 0.7 ms per 64 MiB on an H200, when memory is needed again).
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use std::time::{Duration, Instant};
/// use tensor_queue::{DType, Tensor, memory};
/// memory::set_idle_release(Duration::ZERO); // allocates rarely: keep nothing idle
/// drop(Tensor::zeros(DType::U8, &[1 << 20])?);
/// let deadline = Instant::now() + Duration::from_secs(10);
/// while memory::usage().host_bytes > 0 {
///     assert!(Instant::now() < deadline, "the free chunk went back by itself");
///     std::thread::sleep(Duration::from_millis(1));
/// }
/// # Ok(()) }
/// ```
pub fn set_idle_release(idle: Duration) {
    crate::memory::arena::set_idle_release(idle)
}
