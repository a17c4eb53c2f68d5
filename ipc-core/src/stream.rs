//! Streams: ordered queues of GPU work, like threads.

use std::sync::Arc;

use cuda_sys::{CUresult, CUstream, driver};

use crate::error::check_range;
use crate::{Context, DeviceMemory, Error, Event, Result};

/// A non-blocking stream (it does not synchronise with the legacy default stream).
#[derive(Debug)]
pub struct Stream {
    raw: CUstream,
    context: Arc<Context>,
}

// SAFETY: a CUstream handle may be used from any thread; the driver orders work on it.
unsafe impl Send for Stream {}
// SAFETY: as above; methods only pass the handle to the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream in `context`.
    pub fn new(context: &Arc<Context>) -> Result<Stream> {
        context.bind()?;
        let mut raw = std::ptr::null_mut();
        let flags = cuda_sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        unsafe { driver!(cuStreamCreate(&mut raw, flags)) }?;
        Ok(Stream { raw, context: context.clone() })
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// Blocks until all work queued so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.context.bind()?;
        // SAFETY: `raw` is a live stream.
        unsafe { driver!(cuStreamSynchronize(self.raw)) }?;
        Ok(())
    }

    /// Writes `value` to the 64-bit word at `offset` in `memory` once the work queued so far is
    /// done, after a memory fence (that work's writes are visible first).
    pub fn write_value64(&self, memory: &dyn DeviceMemory, offset: usize, value: u64) -> Result<()> {
        let address = word_address(memory, offset)?;
        self.context.bind()?;
        // SAFETY: `address` is an aligned word inside a live allocation; the stream is live.
        unsafe { driver!(cuStreamWriteValue64_v2(self.raw, address, value, 0)) }?;
        Ok(())
    }

    /// Makes later work on this stream wait until the 64-bit word at `offset` in `memory` has
    /// reached `value` (`(int64_t)(word - value) >= 0`), without blocking the CPU.
    pub fn wait_value64(&self, memory: &dyn DeviceMemory, offset: usize, value: u64) -> Result<()> {
        let address = word_address(memory, offset)?;
        self.context.bind()?;
        let geq = cuda_sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ.0;
        // SAFETY: `address` is an aligned word inside a live allocation; the stream is live.
        unsafe { driver!(cuStreamWaitValue64_v2(self.raw, address, value, geq)) }?;
        Ok(())
    }

    /// Reads the 64-bit word at `offset` in `memory` after the work queued on this stream so far,
    /// waiting for it. Unlike [`DeviceMemory::copy_to_host`], which runs on the legacy stream and
    /// so waits for every blocking stream of the context, it waits for nothing else.
    pub fn read_value64(&self, memory: &dyn DeviceMemory, offset: usize) -> Result<u64> {
        let address = word_address(memory, offset)?;
        let mut value = 0u64;
        self.context.bind()?;
        // SAFETY: `address` is an aligned word inside a live allocation; `value` is 8 writable
        // bytes that outlive the copy, since the stream is synchronised before they are read.
        unsafe { driver!(cuMemcpyDtoHAsync_v2((&raw mut value).cast(), address, 8, self.raw)) }?;
        self.synchronize()?;
        Ok(value)
    }

    /// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`, in stream order.
    /// Either side may be any device's memory or mapped pinned host memory (unified addressing).
    pub fn copy_async(
        &self,
        dst: &dyn DeviceMemory,
        dst_offset: usize,
        src: &dyn DeviceMemory,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range(dst_offset, len, dst.len())?;
        check_range(src_offset, len, src.len())?;
        if len == 0 {
            return Ok(());
        }
        self.context.bind()?;
        let (to, from) = (dst.device_ptr() + dst_offset as u64, src.device_ptr() + src_offset as u64);
        // SAFETY: both ranges were checked against live allocations; the stream is live.
        unsafe { driver!(cuMemcpyAsync(to, from, len, self.raw)) }?;
        Ok(())
    }

    /// Copies `src` from the host to `dst` at `offset`, in stream order. The call returns once
    /// `src` is staged (the driver's rule for pageable memory), so `src` may be reused at once.
    pub fn copy_from_host_async(&self, dst: &dyn DeviceMemory, offset: usize, src: &[u8]) -> Result<()> {
        check_range(offset, src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.context.bind()?;
        let to = dst.device_ptr() + offset as u64;
        // SAFETY: the destination range was checked; `src` is readable for the whole call, and a
        // copy from pageable memory is staged before the call returns.
        unsafe { driver!(cuMemcpyHtoDAsync_v2(to, src.as_ptr().cast(), src.len(), self.raw)) }?;
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` of `src` to the host after the work queued on this
    /// stream so far, and waits for them (nothing else: not the legacy stream).
    pub fn copy_to_host(&self, src: &dyn DeviceMemory, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(offset, dst.len(), src.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.context.bind()?;
        let from = src.device_ptr() + offset as u64;
        // SAFETY: the source range was checked; `dst` is writable and outlives the copy, since
        // the stream is synchronised before this returns.
        unsafe { driver!(cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), from, dst.len(), self.raw)) }?;
        self.synchronize()
    }

    /// Sets `count` elements of `value.len()` bytes (1, 2, 4 or 8) at `offset` of `memory` to
    /// `value`, in stream order. `offset` must be aligned to the element size.
    pub fn fill_async(&self, memory: &dyn DeviceMemory, offset: usize, count: usize, value: &[u8]) -> Result<()> {
        let size = value.len();
        let bytes = count.checked_mul(size).ok_or_else(|| Error::InvalidArgument("fill size overflows".into()))?;
        check_range(offset, bytes, memory.len())?;
        let to = memory.device_ptr() + offset as u64;
        if ![1, 2, 4, 8].contains(&size) || !to.is_multiple_of(size as u64) {
            return Err(Error::InvalidArgument(format!("a fill of {size}-byte elements at {to:#x}")));
        }
        if count == 0 {
            return Ok(());
        }
        self.context.bind()?;
        let word = |at: usize| u32::from_le_bytes(value[at..at + 4].try_into().unwrap_or_default());
        let stream = self.raw;
        match size {
            // SAFETY: the range was checked against a live allocation; the stream is live.
            1 => unsafe { driver!(cuMemsetD8Async(to, value[0], count, stream)) }?,
            // SAFETY: as above, and `to` is 2-byte aligned.
            2 => unsafe { driver!(cuMemsetD16Async(to, u16::from_le_bytes([value[0], value[1]]), count, stream)) }?,
            // SAFETY: as above, and `to` is 4-byte aligned.
            4 => unsafe { driver!(cuMemsetD32Async(to, word(0), count, stream)) }?,
            _ => {
                // An 8-byte value as two 32-bit halves: a 2-D fill one word wide with a pitch of
                // 8 bytes writes every low half, then every high half.
                // SAFETY: `count` rows of 8 bytes were checked; `to` is 8-byte aligned.
                unsafe { driver!(cuMemsetD2D32Async(to, 8, word(0), 1, count, stream)) }?;
                // SAFETY: as above, the high halves of the same rows.
                unsafe { driver!(cuMemsetD2D32Async(to + 4, 8, word(4), 1, count, stream)) }?;
            }
        }
        Ok(())
    }

    /// Makes later work on this stream wait for `event`, without blocking the CPU.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.context.bind()?;
        // SAFETY: both handles are live for the duration of the call.
        unsafe { driver!(cuStreamWaitEvent(self.raw, event.raw(), 0)) }?;
        Ok(())
    }

    /// Whether all queued work has finished.
    pub fn is_idle(&self) -> Result<bool> {
        self.context.bind()?;
        // SAFETY: `raw` is a live stream.
        match unsafe { cuda_sys::cuStreamQuery(self.raw) }.map_err(cuda_sys::Error::from)? {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(cuda_sys::Error::from(cuda_sys::DriverError::new("cuStreamQuery", code)).into()),
        }
    }
}

/// The device address of the aligned 64-bit word at `offset` in `memory`.
fn word_address(memory: &dyn DeviceMemory, offset: usize) -> Result<u64> {
    if offset.checked_add(8).is_none_or(|end| end > memory.len()) {
        return Err(Error::OutOfBounds { offset, count: 8, len: memory.len() });
    }
    let address = memory.device_ptr() + offset as u64;
    if !address.is_multiple_of(8) {
        return Err(Error::InvalidArgument(format!("a 64-bit stream word at {address:#x} is not 8-byte aligned")));
    }
    Ok(address)
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: `raw` is live and owned; queued work still completes after destruction.
        crate::release_in(&self.context, || unsafe { driver!(cuStreamDestroy_v2(self.raw)) });
    }
}
