//! Host memory the GPU can reach: pinned allocations, and shared-memory files that two processes
//! map and pin, so both can copy to and from the same pages at full speed.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use cuda_sys::{CUdeviceptr, driver};
use rustix::fs::{MemfdFlags, fstat, ftruncate, memfd_create};
use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

use crate::{Context, Error, Result};

/// Pinned (page-locked) host memory from `cuMemHostAlloc`, portable to every context and mapped
/// into the device's address space; freed on drop.
#[derive(Debug)]
pub struct PinnedHostBuffer {
    ptr: *mut u8,
    device_ptr: CUdeviceptr,
    len: usize,
    context: Arc<Context>,
}

// SAFETY: the buffer is owned exclusively, like a `Vec<u8>`; shared access is only through `&self`.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: as above: `&self` gives only shared reads.
unsafe impl Sync for PinnedHostBuffer {}

impl PinnedHostBuffer {
    /// Allocates `len` zeroed bytes.
    pub fn alloc(context: &Arc<Context>, len: usize) -> Result<PinnedHostBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument("a pinned allocation needs at least one byte".into()));
        }
        context.bind()?;
        let mut ptr = std::ptr::null_mut();
        let flags = cuda_sys::CU_MEMHOSTALLOC_PORTABLE | cuda_sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: `ptr` is a valid out-pointer; the context is current.
        unsafe { driver!(cuMemHostAlloc(&mut ptr, len, flags)) }?;
        // SAFETY: `ptr` is a fresh allocation of `len` bytes that nothing else references yet.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
        let mut buffer = PinnedHostBuffer { ptr: ptr.cast(), device_ptr: 0, len, context: context.clone() };
        buffer.device_ptr = device_pointer(context, buffer.ptr)?;
        Ok(buffer)
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes for the life of `self`, and initialised.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

// Devices see this memory at `device_ptr`.
device_memory_fields!(PinnedHostBuffer, ptr: device_ptr, len: len);

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
        crate::release_in(&self.context, || unsafe { driver!(cuMemFreeHost(self.ptr.cast())) });
    }
}

fn device_pointer(context: &Context, host: *mut u8) -> Result<CUdeviceptr> {
    context.bind()?;
    let mut ptr = 0;
    // SAFETY: `host` is pinned and mapped memory; `ptr` is a valid out-pointer.
    unsafe { driver!(cuMemHostGetDevicePointer_v2(&mut ptr, host.cast(), 0)) }?;
    Ok(ptr)
}

/// A shared-memory file (memfd) mapped read-write; its descriptor can be sent to another process
/// ([`crate::fd_passing`]), which maps the same pages with [`SharedMemory::from_fd`].
///
/// Both processes see each other's writes: who writes what, and when, is for the protocol that
/// uses this memory to agree on.
#[derive(Debug)]
pub struct SharedMemory {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by this value and unmapped once; `&self` gives only reads, and
// cross-process writes are ordered by the protocol above this type.
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// Creates `len` zeroed bytes of anonymous shared memory named `name` (for debugging only).
    pub fn create(name: &str, len: usize) -> Result<SharedMemory> {
        let fd = memfd_create(name, MemfdFlags::CLOEXEC).map_err(|e| Error::os("memfd_create", e))?;
        ftruncate(&fd, len as u64).map_err(|e| Error::os("ftruncate", e))?;
        SharedMemory::map(fd, len)
    }

    /// Maps the first `len` bytes of a shared-memory file received from another process.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<SharedMemory> {
        let size = fstat(&fd).map_err(|e| Error::os("fstat", e))?.st_size;
        if (size as u64) < len as u64 {
            return Err(Error::OutOfBounds { offset: 0, count: len, len: size as usize });
        }
        SharedMemory::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<SharedMemory> {
        if len == 0 {
            return Err(Error::InvalidArgument("shared memory needs at least one byte".into()));
        }
        let protection = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: a fresh shared mapping at an address the kernel chooses aliases no Rust object.
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, protection, MapFlags::SHARED, &fd, 0) }
            .map_err(|e| Error::os("mmap", e))?;
        Ok(SharedMemory { fd, ptr: ptr.cast(), len })
    }

    /// The descriptor, to send to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: creation needs a byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is valid for `len` bytes while `self` lives; files are zero-filled.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes access through this process exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Page-locks the mapping and maps it for every context's devices.
    pub fn pin(self, context: &Arc<Context>) -> Result<PinnedSharedMemory> {
        context.bind()?;
        let flags = cuda_sys::CU_MEMHOSTREGISTER_PORTABLE | cuda_sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the range is a live mapping owned by `self`, which the result keeps alive.
        unsafe { driver!(cuMemHostRegister_v2(self.ptr.cast(), self.len, flags)) }?;
        let mut pinned = PinnedSharedMemory { memory: self, device_ptr: 0, context: context.clone() };
        pinned.device_ptr = device_pointer(context, pinned.memory.ptr)?;
        Ok(pinned)
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping is owned and unmapped once; no slice borrowed from it outlives `self`.
        if let Err(error) = unsafe { munmap(self.ptr.cast(), self.len) } {
            tracing::warn!(%error, "munmap of shared memory failed");
        }
    }
}

/// [`SharedMemory`] registered with the driver: copies to and from it run at pinned speed.
#[derive(Debug)]
pub struct PinnedSharedMemory {
    memory: SharedMemory,
    device_ptr: CUdeviceptr,
    context: Arc<Context>,
}

impl PinnedSharedMemory {
    /// The shared memory.
    pub fn memory(&self) -> &SharedMemory {
        &self.memory
    }

    /// The shared memory, writable.
    pub fn memory_mut(&mut self) -> &mut SharedMemory {
        &mut self.memory
    }
}

// Devices see this memory at `device_ptr`.
device_memory_fields!(PinnedSharedMemory, ptr: device_ptr, len: memory.len);

impl Drop for PinnedSharedMemory {
    fn drop(&mut self) {
        // SAFETY: the range was registered in `pin` and is unregistered once, before it is unmapped.
        crate::release_in(&self.context, || unsafe { driver!(cuMemHostUnregister(self.memory.ptr.cast())) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_file_share_bytes() {
        let mut first = SharedMemory::create("test", 4096).unwrap();
        first.as_mut_slice()[..5].copy_from_slice(b"hello");
        let fd = first.fd().try_clone_to_owned().unwrap();
        let second = SharedMemory::from_fd(fd, 4096).unwrap();
        assert_eq!(&second.as_slice()[..5], b"hello");
        assert_eq!(second.as_slice()[5], 0);
    }

    #[test]
    fn a_file_shorter_than_asked_is_refused() {
        let memory = SharedMemory::create("short", 100).unwrap();
        let fd = memory.fd().try_clone_to_owned().unwrap();
        assert!(matches!(SharedMemory::from_fd(fd, 4096), Err(Error::OutOfBounds { len: 100, .. })));
        assert!(matches!(SharedMemory::create("empty", 0), Err(Error::InvalidArgument(_))));
    }
}
