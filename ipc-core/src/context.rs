//! The primary context of a device, retained while any value of this crate uses it.

use std::sync::Arc;

use cuda_sys::{CUcontext, driver};

use crate::device::init;
use crate::{Device, Result};

/// A retained primary context: the address space the process shares with the CUDA runtime
/// (PyTorch, cuBLAS) on one device.
///
/// The driver counts retains: when the last `Context` of a device drops and nothing else in the
/// process retains it, the driver destroys the context and everything in it, and the next
/// retain builds it anew (about 100 ms on an H200). Keep one alive for as long as the process
/// works on the device.
#[derive(Debug)]
pub struct Context {
    raw: CUcontext,
    device: Device,
}

// SAFETY: a CUcontext is a driver handle that may be made current on any thread; the driver
// serialises its own use of it. This type never hands out references into context-owned state.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes `&self` and only passes the handle to the driver.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of `device`.
    pub fn primary(device: Device) -> Result<Arc<Context>> {
        init()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; `device` came from the driver.
        unsafe { driver!(cuDevicePrimaryCtxRetain(&mut raw, device.raw())) }?;
        let context = Arc::new(Context { raw, device });
        context.bind()?;
        Ok(context)
    }

    /// Retains the primary context of the device with this ordinal.
    pub fn on_ordinal(ordinal: i32) -> Result<Arc<Context>> {
        Context::primary(Device::get(ordinal)?)
    }

    /// Makes this context current on the calling thread; every wrapper calls it first.
    pub fn bind(&self) -> Result<()> {
        Ok(self.bind_raw()?)
    }

    pub(crate) fn bind_raw(&self) -> std::result::Result<(), cuda_sys::Error> {
        // SAFETY: `raw` is a retained context, valid until `Drop`.
        unsafe { driver!(cuCtxSetCurrent(self.raw)) }
    }

    /// The context's device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUcontext {
        self.raw
    }

    /// Waits for all work in this context.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments; the context is current.
        unsafe { driver!(cuCtxSynchronize()) }?;
        Ok(())
    }

    /// Lets work in this context read and write `peer`'s memory directly (over NVLink or PCIe).
    /// Enabling it twice is not an error.
    pub fn enable_peer_access(&self, peer: &Context) -> Result<()> {
        self.bind()?;
        // SAFETY: `peer.raw` is a retained context; flags must be 0.
        match unsafe { driver!(cuCtxEnablePeerAccess(peer.raw, 0)) } {
            Err(e) if e.code() == Some(cuda_sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) => Ok(()),
            other => Ok(other?),
        }
    }

    /// `(free, total)` device memory in bytes, as the driver reports it.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: both are valid out-pointers; the context is current.
        unsafe { driver!(cuMemGetInfo_v2(&mut free, &mut total)) }?;
        Ok((free, total))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `primary`; nothing of this crate uses `raw` afterwards,
        // since every user holds an `Arc<Context>`.
        crate::release(unsafe { driver!(cuDevicePrimaryCtxRelease_v2(self.device.raw())) });
    }
}
