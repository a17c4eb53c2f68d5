//! Device memory from `cuMemAlloc`, its legacy IPC handles, and copies.

use std::sync::Arc;

use cuda_sys::{CUdeviceptr, CUipcMem_flags, driver};

use crate::error::check_range;
use crate::handle::{ENCODED_LEN, Envelope, HandleKind, HostId};
use crate::{Context, Device, Error, Result, Stream, Uuid};

/// Anything that is a range of device memory in a context.
///
/// Methods take `&self` even when they write: the bytes live on the GPU, outside Rust's memory
/// model, and GPU work writes them through the same shared handles.
pub trait DeviceMemory {
    /// The device address of the first byte.
    fn device_ptr(&self) -> CUdeviceptr;
    /// The length in bytes.
    fn len(&self) -> usize;
    /// The context the memory is mapped in.
    fn context(&self) -> &Arc<Context>;

    /// Whether the range is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `dst.len()` bytes from `offset` to the host, waiting for the copy.
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(offset, dst.len(), self.len())?;
        self.context().bind()?;
        let src = self.device_ptr() + offset as u64;
        // SAFETY: the source range was checked against this allocation; `dst` is writable host memory.
        unsafe { driver!(cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())) }?;
        Ok(())
    }

    /// Copies `src` from the host to `offset`, waiting for the copy.
    fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(offset, src.len(), self.len())?;
        self.context().bind()?;
        let dst = self.device_ptr() + offset as u64;
        // SAFETY: the destination range was checked against this allocation; `src` is readable.
        unsafe { driver!(cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())) }?;
        // From pageable memory the call returns once the bytes are staged, possibly before they
        // land, and work on non-blocking streams is not ordered after it: wait for the context.
        self.context().synchronize()
    }

    /// Sets `len` bytes at `offset` to `value`, in stream order.
    fn memset_range_async(&self, offset: usize, len: usize, value: u8, stream: &Stream) -> Result<()> {
        check_range(offset, len, self.len())?;
        self.context().bind()?;
        let dst = self.device_ptr() + offset as u64;
        // SAFETY: the range was checked against this allocation; the stream is live.
        unsafe { driver!(cuMemsetD8Async(dst, value, len, stream.raw())) }?;
        Ok(())
    }

    /// Sets every byte to `value`, in stream order.
    fn memset_async(&self, value: u8, stream: &Stream) -> Result<()> {
        self.context().bind()?;
        // SAFETY: the whole allocation is written; the stream is live.
        unsafe { driver!(cuMemsetD8Async(self.device_ptr(), value, self.len(), stream.raw())) }?;
        Ok(())
    }
}

/// Copies `len` bytes from `src` (on any device) to `dst` (on any device), in `stream` order.
///
/// Between devices with peer access the copy engine moves the bytes over the link (NVLink or PCIe);
/// otherwise the driver stages them through the host.
pub fn copy_peer_async(dst: &dyn DeviceMemory, src: &dyn DeviceMemory, len: usize, stream: &Stream) -> Result<()> {
    check_range(0, len, dst.len())?;
    check_range(0, len, src.len())?;
    stream.context().bind()?;
    // SAFETY: both ranges were checked; both contexts are retained by the memory objects.
    unsafe {
        driver!(cuMemcpyPeerAsync(
            dst.device_ptr(),
            dst.context().raw(),
            src.device_ptr(),
            src.context().raw(),
            len,
            stream.raw()
        ))
    }?;
    Ok(())
}

/// Device memory from `cuMemAlloc`, freed on drop: a `Vec<u8>` on the GPU.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    len: usize,
    context: Arc<Context>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (uninitialised) in `context`.
    pub fn alloc(context: &Arc<Context>, len: usize) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument("a device allocation needs at least one byte".into()));
        }
        context.bind()?;
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current.
        unsafe { driver!(cuMemAlloc_v2(&mut ptr, len)) }?;
        Ok(DeviceBuffer { ptr, len, context: context.clone() })
    }

    /// A legacy IPC handle another process can open with [`ImportedIpcMemory::open`].
    ///
    /// The importer maps the whole allocation; this buffer must outlive its use there.
    pub fn export(&self) -> Result<IpcMemHandle> {
        self.context.bind()?;
        let mut handle = cuda_sys::CUipcMemHandle::default();
        // SAFETY: `handle` is a valid out-pointer; `ptr` is the base of a cuMemAlloc allocation.
        unsafe { driver!(cuIpcGetMemHandle(&mut handle, self.ptr)) }?;
        Ok(IpcMemHandle(Envelope {
            kind: HandleKind::Memory,
            host: HostId::current()?,
            device: self.context.device().uuid()?,
            len: self.len as u64,
            raw: handle.reserved.map(|b| b as u8),
        }))
    }
}

device_memory_fields!(DeviceBuffer, ptr: ptr, len: len);

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` is owned; cuMemFree waits for work on it in flight.
        crate::release_in(&self.context, || unsafe { driver!(cuMemFree_v2(self.ptr)) });
    }
}

/// A legacy IPC memory handle in wire form: the driver's 64 bytes, the allocation's length, the
/// device's UUID and the machine's boot id.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct IpcMemHandle(Envelope);

impl IpcMemHandle {
    /// Size of [`IpcMemHandle::to_bytes`].
    pub const ENCODED_LEN: usize = ENCODED_LEN;

    /// The bytes to send to another process.
    pub fn to_bytes(&self) -> [u8; ENCODED_LEN] {
        self.0.encode()
    }

    /// Decodes bytes from [`IpcMemHandle::to_bytes`], checking they were made on this machine.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcMemHandle> {
        Envelope::decode(bytes, HandleKind::Memory).map(IpcMemHandle)
    }

    /// The allocation's length in bytes.
    pub fn len(&self) -> usize {
        self.0.len as usize
    }

    /// Whether the allocation is empty (never, for a handle from [`DeviceBuffer::export`]).
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The device the memory lives on.
    pub fn device(&self) -> Uuid {
        self.0.device
    }
}

/// Another process's `cuMemAlloc` memory, mapped here; closed when dropped.
///
/// Share it with `Arc` so that the mapping closes when its last user drops it.
#[derive(Debug)]
pub struct ImportedIpcMemory {
    ptr: CUdeviceptr,
    len: usize,
    context: Arc<Context>,
}

impl ImportedIpcMemory {
    /// Opens `handle` on the device it names (found by UUID), enabling peer access lazily.
    ///
    /// The mapping retains the device's primary context; hold a [`Context`] of that device for
    /// the process's working life, or opening after the last mapping closed rebuilds it.
    pub fn open(handle: &IpcMemHandle) -> Result<ImportedIpcMemory> {
        let context = Context::primary(Device::by_uuid(&handle.device())?)?;
        let raw = cuda_sys::CUipcMemHandle { reserved: handle.0.raw.map(|b| b as _) };
        let mut ptr = 0;
        let flags = CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value; context is current.
        unsafe { driver!(cuIpcOpenMemHandle_v2(&mut ptr, raw, flags)) }?;
        Ok(ImportedIpcMemory { ptr, len: handle.len(), context })
    }
}

device_memory_fields!(ImportedIpcMemory, ptr: ptr, len: len);

impl Drop for ImportedIpcMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once, here.
        crate::release_in(&self.context, || unsafe { driver!(cuIpcCloseMemHandle(self.ptr)) });
    }
}
