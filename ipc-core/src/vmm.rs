//! VMM memory (`cuMemCreate`) shared between processes as POSIX file descriptors.
//!
//! A file descriptor travels over a Unix socket ([`crate::fd_passing`]) and needs no ptrace rights,
//! unlike `pidfd_getfd`. Memory imported from one stays alive while any process maps it, so data
//! already received survives the exporter's death.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use cuda_sys::{
    CUdeviceptr, CUmemAccess_flags, CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationHandleType,
    CUmemAllocationProp, CUmemAllocationType, CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType, driver,
};

use crate::{Context, Error, Result};

/// VMM device memory, exportable as a file descriptor: reserved, mapped and readable and
/// writable by its device; unmapped and released on drop.
#[derive(Debug)]
pub struct VmmAllocation {
    handle: CUmemGenericAllocationHandle,
    ptr: CUdeviceptr,
    len: usize,
    context: Arc<Context>,
}

fn location(context: &Context) -> CUmemLocation {
    CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: context.device().ordinal() }
}

fn properties(context: &Context) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: location(context),
        ..Default::default()
    }
}

impl VmmAllocation {
    /// The allocation granularity of `context`'s device: sizes are rounded up to a multiple.
    pub fn granularity(context: &Arc<Context>) -> Result<usize> {
        context.bind()?;
        let mut granularity = 0;
        let flag = CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: both pointers are valid for the call.
        unsafe { driver!(cuMemGetAllocationGranularity(&mut granularity, &properties(context), flag)) }?;
        Ok(granularity)
    }

    /// Allocates at least `len` bytes (rounded up to the granularity) on `context`'s device.
    pub fn new(context: &Arc<Context>, len: usize) -> Result<VmmAllocation> {
        if len == 0 {
            return Err(Error::InvalidArgument("a VMM allocation needs at least one byte".into()));
        }
        let granularity = VmmAllocation::granularity(context)?;
        let len = len.div_ceil(granularity) * granularity;
        let mut handle = 0;
        // SAFETY: `handle` is a valid out-pointer; the properties name this context's device.
        unsafe { driver!(cuMemCreate(&mut handle, len, &properties(context), 0)) }?;
        VmmAllocation::map(context, handle, len)
    }

    /// Imports an allocation another process exported with [`VmmAllocation::export`], mapping
    /// `len` bytes of it on `context`'s device. The descriptor may be closed afterwards; one that
    /// is not open gives [`Error::BadDescriptor`], one that is not a VMM export a driver error.
    pub fn import(context: &Arc<Context>, fd: RawFd, len: usize) -> Result<VmmAllocation> {
        crate::fd_passing::check_open(fd)?;
        let granularity = VmmAllocation::granularity(context)?;
        if len == 0 || !len.is_multiple_of(granularity) {
            return Err(Error::InvalidArgument(format!(
                "an imported VMM length must be a non-zero multiple of {granularity}, not {len}"
            )));
        }
        let mut handle = 0;
        let kind = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // The driver's handle argument for POSIX descriptors is the descriptor number itself.
        let os_handle = fd as usize as *mut std::ffi::c_void;
        // SAFETY: `handle` is a valid out-pointer; `fd` is open for the duration of the call.
        unsafe { driver!(cuMemImportFromShareableHandle(&mut handle, os_handle, kind)) }?;
        VmmAllocation::map(context, handle, len)
    }

    /// Reserves an address range, maps `handle` there and grants read-write access; on failure
    /// undoes what was done and releases `handle`.
    fn map(context: &Arc<Context>, handle: CUmemGenericAllocationHandle, len: usize) -> Result<VmmAllocation> {
        let release_handle = || {
            // SAFETY: `handle` is owned here and not mapped.
            crate::release(unsafe { driver!(cuMemRelease(handle)) });
        };
        if let Err(error) = context.bind() {
            release_handle();
            return Err(error);
        }
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer.
        if let Err(error) = unsafe { driver!(cuMemAddressReserve(&mut ptr, len, 0, 0, 0)) } {
            release_handle();
            return Err(error.into());
        }
        let access = CUmemAccessDesc {
            location: location(context),
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `ptr..ptr+len` was just reserved; `handle` holds at least `len` bytes or the
        // driver refuses the mapping.
        let mapped = unsafe { driver!(cuMemMap(ptr, len, 0, handle, 0)) }
            // SAFETY: the range is mapped; `access` is one valid descriptor.
            .and_then(|()| unsafe { driver!(cuMemSetAccess(ptr, len, &access, 1)) });
        match mapped {
            Ok(()) => Ok(VmmAllocation { handle, ptr, len, context: context.clone() }),
            Err(error) => {
                // SAFETY: unmapping a range that may be unmapped fails harmlessly; the reservation is ours.
                let _ = unsafe { driver!(cuMemUnmap(ptr, len)) };
                // SAFETY: the reservation is ours and no longer mapped.
                crate::release(unsafe { driver!(cuMemAddressFree(ptr, len)) });
                release_handle();
                Err(error.into())
            }
        }
    }

    /// Lets `peer`'s device read and write the mapping too (over NVLink or PCIe peer access):
    /// kernels and copies on that device then use [`crate::DeviceMemory::device_ptr`] directly.
    /// Fails where the two devices have no peer access.
    pub fn grant_access(&self, peer: &Context) -> Result<()> {
        self.context.bind()?;
        let access =
            CUmemAccessDesc { location: location(peer), flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        // SAFETY: the range is mapped by this value; `access` is one valid descriptor.
        unsafe { driver!(cuMemSetAccess(self.ptr, self.len, &access, 1)) }?;
        Ok(())
    }

    /// Exports the allocation as a new file descriptor, to send with [`crate::fd_passing`].
    pub fn export(&self) -> Result<OwnedFd> {
        self.context.bind()?;
        let mut fd: std::ffi::c_int = -1;
        let kind = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX descriptors the driver writes an `int` through the pointer.
        unsafe { driver!(cuMemExportToShareableHandle((&raw mut fd).cast(), self.handle, kind, 0)) }?;
        // SAFETY: on success `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // The driver's descriptor is inheritable: without this, every child started later would
        // hold the allocation (and keep it alive) without knowing.
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC).map_err(|e| Error::os("fcntl(FD_CLOEXEC)", e))?;
        Ok(fd)
    }
}

device_memory_fields!(VmmAllocation, ptr: ptr, len: len);

impl Drop for VmmAllocation {
    fn drop(&mut self) {
        let (ptr, len, handle) = (self.ptr, self.len, self.handle);
        crate::release_in(&self.context, || {
            // SAFETY: the range and handle are owned by this value and released once, in this order.
            unsafe { driver!(cuMemUnmap(ptr, len)) }?;
            // SAFETY: as above; the range is unmapped.
            unsafe { driver!(cuMemAddressFree(ptr, len)) }?;
            // SAFETY: as above; the handle's memory lives on while another process maps it.
            unsafe { driver!(cuMemRelease(handle)) }
        });
    }
}
