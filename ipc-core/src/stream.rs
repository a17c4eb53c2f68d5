//! Streams: ordered queues of GPU work, like threads.

use std::sync::Arc;

use cuda_sys::{CUresult, CUstream, driver};

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
