//! `tq.shareable()`: torch allocates CUDA tensors from channel memory, so they are sent without a
//! copy and the consumer's writes are visible to the producer.
//!
//! The Python side makes a `torch.cuda.MemPool` over a `torch.cuda.memory.CUDAPluggableAllocator`
//! whose malloc and free are the two C functions below (exported by this extension's shared
//! object). Each call of [`tq_shareable_alloc`] is one segment of torch's pool: a
//! [`Tensor::empty_cuda`] block of channel memory (the arena every channel exports), kept here by
//! its device address until [`tq_shareable_free`]. torch carves its tensors out of those segments
//! and keeps freed blocks cached in the pool; it gives a segment back only when the pool goes (or
//! on `torch.cuda.empty_cache()`), after synchronising the device.
//!
//! Sending: a CUDA array whose bytes lie inside one segment is sent as a view of that segment's
//! block ([`find`]): no copy. The message holds a clone of the block, so a segment torch frees
//! while a consumer still holds a tensor in it stays mapped and valid until every receiver has
//! let go (the channel's leases), as for any channel tensor in Rust.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};

use cuda_sys::CUdeviceptr;
use tensor_queue::{DType, DeviceMemory, Tensor};

use crate::gpu;

/// The blocks torch's pools hold now, by device address.
static BLOCKS: OnceLock<Mutex<BTreeMap<CUdeviceptr, Tensor>>> = OnceLock::new();

fn blocks() -> MutexGuard<'static, BTreeMap<CUdeviceptr, Tensor>> {
    BLOCKS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// A new block of `size` bytes of channel memory on GPU `device`; its device address.
fn allocate(size: isize, device: c_int) -> Result<CUdeviceptr, String> {
    let len = u64::try_from(size).map_err(|_| format!("a negative size {size}"))?.max(1);
    let state = gpu::device(device)?;
    let block = Tensor::empty_cuda(&state.context, DType::U8, &[len]).map_err(|e| e.to_string())?;
    let ptr = block.cuda_view().map_err(|e| e.to_string())?.device_ptr();
    blocks().insert(ptr, block);
    Ok(ptr)
}

/// torch's pluggable-allocator malloc (`void* alloc(ssize_t size, int device, cudaStream_t
/// stream)`): a block of channel memory on GPU `device`, or null (torch then reports that it is
/// out of memory). The block is ready at once; `stream` has nothing to wait for.
#[unsafe(no_mangle)]
pub extern "C" fn tq_shareable_alloc(size: isize, device: c_int, _stream: *mut c_void) -> *mut c_void {
    // No unwinding across the C boundary: a panic is a failed allocation.
    match std::panic::catch_unwind(|| allocate(size, device)) {
        Ok(Ok(ptr)) => ptr as usize as *mut c_void,
        Ok(Err(reason)) => {
            eprintln!(
                "tensor_queue.shareable: could not allocate {size} bytes of channel memory on GPU {device}: {reason}"
            );
            std::ptr::null_mut()
        }
        Err(_) => std::ptr::null_mut(),
    }
}

/// torch's pluggable-allocator free (`void free(void* ptr, ssize_t size, int device, cudaStream_t
/// stream)`): lets go of the block at `ptr`. Its memory goes back to the channel's arena once no
/// message holds it any more; an address this allocator did not give is ignored.
#[unsafe(no_mangle)]
pub extern "C" fn tq_shareable_free(ptr: *mut c_void, _size: isize, _device: c_int, _stream: *mut c_void) {
    let _ = std::panic::catch_unwind(|| blocks().remove(&(ptr as usize as CUdeviceptr)));
}

/// The view of a shareable block that an array with element 0 at `ptr` and this layout is, when
/// its bytes lie inside one block; `None` otherwise (it is copied instead).
pub fn find(ptr: CUdeviceptr, dtype: DType, dims: &[u64], strides: &[i64]) -> Option<Tensor> {
    let blocks = blocks();
    let (&start, block) = blocks.range(..=ptr).next_back()?;
    let offset = usize::try_from(ptr - start).ok()?;
    // `as_layout` checks that the whole view lies inside the block.
    block.as_layout(dtype, dims, strides, offset).ok()
}

/// How many blocks torch's pools hold now in this process (for tests and `tq.stats()`).
pub fn block_count() -> usize {
    blocks().len()
}
