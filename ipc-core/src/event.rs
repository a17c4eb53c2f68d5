//! Events, within a process and across processes.

use std::sync::Arc;

use cuda_sys::{CUevent, CUevent_flags, CUresult, driver};

use crate::handle::{ENCODED_LEN, Envelope, HandleKind, HostId};
use crate::{Context, Device, Error, Result, Stream, Uuid};

/// A point in a stream's work that other streams (or the CPU) can wait for.
#[derive(Debug)]
pub struct Event {
    raw: CUevent,
    context: Arc<Context>,
    interprocess: bool,
}

// SAFETY: a CUevent handle may be used from any thread; the driver synchronises its state.
unsafe impl Send for Event {}
// SAFETY: as above; methods only pass the handle to the driver.
unsafe impl Sync for Event {}

impl Event {
    /// An ordinary event without timing (the cheapest to record and wait for).
    pub fn new(context: &Arc<Context>) -> Result<Event> {
        Event::create(context, CUevent_flags::CU_EVENT_DISABLE_TIMING.0, false)
    }

    /// An event whose [`Event::synchronize`] puts the waiting thread to sleep instead of
    /// spinning: for background threads that wait while others use the driver.
    pub fn blocking(context: &Arc<Context>) -> Result<Event> {
        let flags = CUevent_flags::CU_EVENT_BLOCKING_SYNC.0 | CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        Event::create(context, flags, false)
    }

    /// An event that can be exported to another process with [`Event::export`].
    pub fn interprocess(context: &Arc<Context>) -> Result<Event> {
        let flags = CUevent_flags::CU_EVENT_INTERPROCESS.0 | CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        Event::create(context, flags, true)
    }

    fn create(context: &Arc<Context>, flags: u32, interprocess: bool) -> Result<Event> {
        context.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        unsafe { driver!(cuEventCreate(&mut raw, flags)) }?;
        Ok(Event { raw, context: context.clone(), interprocess })
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// The event's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Captures the work queued on `stream` so far.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.context.bind()?;
        // SAFETY: both handles are live.
        unsafe { driver!(cuEventRecord(self.raw, stream.raw())) }?;
        Ok(())
    }

    /// Blocks the CPU until the captured work has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.context.bind()?;
        // SAFETY: `raw` is live.
        unsafe { driver!(cuEventSynchronize(self.raw)) }?;
        Ok(())
    }

    /// Whether the captured work has finished.
    pub fn is_complete(&self) -> Result<bool> {
        self.context.bind()?;
        // SAFETY: `raw` is live.
        match unsafe { cuda_sys::cuEventQuery(self.raw) }.map_err(cuda_sys::Error::from)? {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(cuda_sys::Error::from(cuda_sys::DriverError::new("cuEventQuery", code)).into()),
        }
    }

    /// The handle another process opens with [`Event::import`].
    pub fn export(&self) -> Result<IpcEventHandle> {
        if !self.interprocess {
            return Err(Error::InvalidArgument("only events made with Event::interprocess can be exported".into()));
        }
        self.context.bind()?;
        let mut handle = cuda_sys::CUipcEventHandle::default();
        // SAFETY: `handle` is a valid out-pointer; the event is interprocess.
        unsafe { driver!(cuIpcGetEventHandle(&mut handle, self.raw)) }?;
        Ok(IpcEventHandle(Envelope {
            kind: HandleKind::Event,
            host: HostId::current()?,
            device: self.context.device().uuid()?,
            len: 0,
            raw: handle.reserved.map(|b| b as u8),
        }))
    }

    /// Opens another process's event, on the device it was made on.
    pub fn import(handle: &IpcEventHandle) -> Result<Event> {
        let context = Context::primary(Device::by_uuid(&handle.0.device)?)?;
        let raw_handle = cuda_sys::CUipcEventHandle { reserved: handle.0.raw.map(|b| b as _) };
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the handle bytes are passed by value.
        unsafe { driver!(cuIpcOpenEventHandle(&mut raw, raw_handle)) }?;
        Ok(Event { raw, context, interprocess: true })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: `raw` is live and owned (imported events are destroyed the same way).
        crate::release_in(&self.context, || unsafe { driver!(cuEventDestroy_v2(self.raw)) });
    }
}

/// An interprocess event handle in wire form: the driver's 64 bytes with the machine and device.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct IpcEventHandle(Envelope);

impl IpcEventHandle {
    /// Size of [`IpcEventHandle::to_bytes`].
    pub const ENCODED_LEN: usize = ENCODED_LEN;

    /// The bytes to send to another process.
    pub fn to_bytes(&self) -> [u8; ENCODED_LEN] {
        self.0.encode()
    }

    /// Decodes bytes from [`IpcEventHandle::to_bytes`], checking they were made on this machine.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcEventHandle> {
        Envelope::decode(bytes, HandleKind::Event).map(IpcEventHandle)
    }

    /// The device the event belongs to.
    pub fn device(&self) -> Uuid {
        self.0.device
    }
}
