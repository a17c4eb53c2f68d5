//! Host memory the GPU can reach: pinned allocations, and shared-memory files that two processes
//! map and pin, so both can copy to and from the same pages at full speed.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use cuda_sys::{CUdeviceptr, driver};
use rustix::fs::{
    MemfdFlags, Mode, OFlags, SealFlags, fchmod, fcntl_add_seals, fcntl_get_seals, fcntl_getfl, fstat, ftruncate,
    memfd_create,
};
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

    /// Copies `dst.len()` bytes from `offset` into `dst` (through raw pointers: GPU work still
    /// writing the buffer gives a torn copy, never undefined behaviour; synchronize it first for
    /// its data).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        crate::error::check_range(offset, dst.len(), self.len)?;
        // SAFETY: the range lies in the live allocation (checked above); `dst` is another object.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// The bytes.
    ///
    /// # Safety
    /// The GPUs reach this memory through `&self` (it is [`crate::DeviceMemory`]): no copy or
    /// kernel may write it while the slice lives (synchronize the work queued on it first).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes for the life of `self`, and initialised; the
        // caller promises that no GPU work writes it meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    ///
    /// # Safety
    /// As for [`PinnedHostBuffer::as_slice`]: no GPU work may read or write the memory while the
    /// slice lives.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive within the CPU.
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

/// A shared-memory file (memfd) mapped into this process; its descriptor can be sent to another
/// process ([`crate::fd_passing`]), which maps the same pages with [`SharedMemory::from_fd`].
///
/// Both processes see each other's writes: who writes what, and when, is for the protocol that
/// uses this memory to agree on.
///
/// # Why the file is sealed
/// Touching a mapped page beyond the end of its file raises `SIGBUS`, which kills the process. A
/// peer holding the file could shrink it under our mapping, so [`SharedMemory::create`] seals it
/// against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW`, then `F_SEAL_SEAL` so the
/// seals stay as they are), and [`SharedMemory::from_fd`] maps only files sealed against
/// shrinking.
#[derive(Debug)]
pub struct SharedMemory {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
    writable: bool,
    /// Set by [`SharedMemory::registered`]: the pages are locked and mapped for the GPUs until drop.
    registration: std::sync::OnceLock<Registration>,
}

/// A registration of a [`SharedMemory`] mapping with the driver.
#[derive(Debug)]
struct Registration {
    device_ptr: CUdeviceptr,
    context: Arc<Context>,
}

/// A [`SharedMemory`] mapping as the GPUs see it once registered: copies to and from it run at
/// pinned speed, and stream memory operations can wait on and write its words.
#[derive(Debug)]
pub struct RegisteredMemory<'a> {
    device_ptr: CUdeviceptr,
    len: usize,
    context: &'a Arc<Context>,
}

impl crate::DeviceMemory for RegisteredMemory<'_> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.device_ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Arc<Context> {
        self.context
    }
}

// SAFETY: the mapping is owned by this value and unmapped once; `&self` gives only reads, and
// cross-process writes are ordered by the protocol above this type.
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// Creates `len` zeroed bytes of anonymous shared memory named `name` (for debugging only),
    /// mapped read-write and sealed against resizing.
    pub fn create(name: &str, len: usize) -> Result<SharedMemory> {
        let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        let fd = memfd_create(name, flags).map_err(|e| Error::os("memfd_create", e))?;
        ftruncate(&fd, len as u64).map_err(|e| Error::os("ftruncate", e))?;
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| Error::os("sealing shared memory", e))?;
        // A memfd is created with mode 0777, so whoever holds a read-only descriptor could reopen
        // it for writing through /proc/<pid>/fd; owner-read-only stops that (for all but root),
        // while descriptors already open for writing, ours included, keep working.
        fchmod(&fd, Mode::RUSR).map_err(|e| Error::os("chmod 0400 on shared memory", e))?;
        SharedMemory::map(fd, len, true)
    }

    /// Like [`SharedMemory::create`], but for memory only this process writes: once mapped here
    /// read-write, the file is sealed with `F_SEAL_FUTURE_WRITE`, so that no new writable
    /// mapping of it and no `write` to it can ever be made, whoever holds a descriptor of it and
    /// with whatever permissions: a receiver that changes the file's mode, reopens it through
    /// `/proc/self/fd` for writing, maps it shared read-write, writes it, punches holes in it or
    /// `mprotect`s its read-only mapping is refused by the kernel. This mapping stays writable.
    /// (`F_SEAL_WRITE` would refuse this mapping too, and the kernel refuses to add it while a
    /// writable mapping exists; `F_SEAL_SHRINK | F_SEAL_GROW` keep the size, `F_SEAL_SEAL` the
    /// seals.) Read-only descriptors for peers: [`SharedMemory::read_only_fd`].
    ///
    /// ```
    /// # fn main() -> ipc_core::Result<()> {
    /// use ipc_core::SharedMemory;
    /// let mine = SharedMemory::create_write_sealed("doc", 4096)?;
    /// mine.write(0, b"only I write this")?;
    /// let reopened = std::fs::OpenOptions::new()
    ///     .read(true)
    ///     .write(true)
    ///     .open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&mine.fd())));
    /// if let Ok(file) = reopened {
    ///     // Even a descriptor opened for writing (root may) cannot write, nor map writable.
    ///     assert!(std::os::unix::fs::FileExt::write_at(&file, b"x", 0).is_err());
    ///     assert!(SharedMemory::from_fd(file.into(), 4096)?.write(0, b"x").is_err());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn create_write_sealed(name: &str, len: usize) -> Result<SharedMemory> {
        let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        let fd = memfd_create(name, flags).map_err(|e| Error::os("memfd_create", e))?;
        ftruncate(&fd, len as u64).map_err(|e| Error::os("ftruncate", e))?;
        fchmod(&fd, Mode::RUSR).map_err(|e| Error::os("chmod 0400 on shared memory", e))?;
        let memory = SharedMemory::map(fd, len, true)?;
        fcntl_add_seals(&memory.fd, SealFlags::FUTURE_WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| Error::os("sealing shared memory against writes by others", e))?;
        Ok(memory)
    }

    /// Maps the first `len` bytes of a shared-memory file received from another process:
    /// read-write if the descriptor was opened for reading and writing, read-only otherwise.
    ///
    /// The file must be sealed against shrinking ([`Error::UnsealedSharedMemory`] if not), as
    /// files from [`SharedMemory::create`] are, so that its sender cannot crash this process.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<SharedMemory> {
        // Files that cannot be sealed (a regular file) fail with EINVAL: no seals either.
        let seals = fcntl_get_seals(&fd).unwrap_or(SealFlags::empty());
        if !seals.contains(SealFlags::SHRINK) {
            return Err(Error::UnsealedSharedMemory);
        }
        let size = fstat(&fd).map_err(|e| Error::os("fstat", e))?.st_size;
        if (size as u64) < len as u64 {
            return Err(Error::OutOfBounds { offset: 0, count: len, len: size as usize });
        }
        let access = fcntl_getfl(&fd).map_err(|e| Error::os("fcntl(F_GETFL)", e))? & OFlags::RWMODE;
        // A write-sealed file refuses writable shared mappings, whatever the descriptor allows.
        let writable = access == OFlags::RDWR && !seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE);
        SharedMemory::map(fd, len, writable)
    }

    fn map(fd: OwnedFd, len: usize, writable: bool) -> Result<SharedMemory> {
        if len == 0 {
            return Err(Error::InvalidArgument("shared memory needs at least one byte".into()));
        }
        let protection = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        // SAFETY: a fresh shared mapping at an address the kernel chooses aliases no Rust object.
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, protection, MapFlags::SHARED, &fd, 0) }
            .map_err(|e| Error::os("mmap", e))?;
        Ok(SharedMemory { fd, ptr: ptr.cast(), len, writable, registration: std::sync::OnceLock::new() })
    }

    /// The mapping as the GPUs see it: registered with the driver (page-locked, mapped for every
    /// context, read-only if the mapping is) on the first call, in `context`; later calls return
    /// the same registration whatever context they name. It lasts until the memory is dropped.
    pub fn registered(&self, context: &Arc<Context>) -> Result<RegisteredMemory<'_>> {
        if self.registration.get().is_none() {
            context.bind()?;
            let mut flags = cuda_sys::CU_MEMHOSTREGISTER_PORTABLE | cuda_sys::CU_MEMHOSTREGISTER_DEVICEMAP;
            if !self.writable {
                flags |= cuda_sys::CU_MEMHOSTREGISTER_READ_ONLY;
            }
            // One registration per mapping: the lock is held across the driver call.
            static REGISTERING: std::sync::Mutex<()> = std::sync::Mutex::new(());
            let _guard = REGISTERING.lock().unwrap_or_else(|e| e.into_inner());
            if self.registration.get().is_none() {
                // SAFETY: the range is a live mapping owned by `self`; `Drop` unregisters it
                // before unmapping.
                unsafe { driver!(cuMemHostRegister_v2(self.ptr.cast(), self.len, flags)) }?;
                let registration = match device_pointer(context, self.ptr) {
                    Ok(device_ptr) => Registration { device_ptr, context: context.clone() },
                    Err(error) => {
                        // SAFETY: registered just above, and not recorded: undone once, here.
                        crate::release(unsafe { driver!(cuMemHostUnregister(self.ptr.cast())) });
                        return Err(error);
                    }
                };
                let _ = self.registration.set(registration);
            }
        }
        let registration = self.registration.get().ok_or_else(|| Error::InvalidArgument("no registration".into()))?;
        Ok(RegisteredMemory { device_ptr: registration.device_ptr, len: self.len, context: &registration.context })
    }

    /// Reads the 8-byte word at `offset` (a multiple of 8) atomically, with acquire ordering: a
    /// flag that another process or a GPU writes.
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        Ok(self.word(offset)?.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Writes the 8-byte word at `offset` (a multiple of 8) atomically, with release ordering;
    /// [`Error::ReadOnlyMemory`] if the mapping is read-only.
    pub fn store_u64(&self, offset: usize, value: u64) -> Result<()> {
        if !self.writable {
            return Err(Error::ReadOnlyMemory);
        }
        self.word(offset)?.store(value, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    fn word(&self, offset: usize) -> Result<&std::sync::atomic::AtomicU64> {
        crate::error::check_range(offset, 8, self.len)?;
        if !offset.is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!("a word at byte {offset} is not 8-byte aligned")));
        }
        // SAFETY: the range was checked and is aligned (the mapping is page-aligned); the word is
        // only ever accessed atomically (here, by other processes through this protocol, or by
        // GPU stream memory operations), and it lives as long as `self`.
        Ok(unsafe { std::sync::atomic::AtomicU64::from_ptr(self.ptr.add(offset).cast()) })
    }

    /// The descriptor, to send to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A new descriptor of the same file, opened read-only: a process given it maps the memory
    /// read-only, while this one still can write it.
    ///
    /// Read-only holds against the receiver's own system calls only for memory made with
    /// [`SharedMemory::create_write_sealed`] (the kernel's write seal). For memory from
    /// [`SharedMemory::create`], only the file's mode (0400) stands in the way of a reopening
    /// through `/proc` for writing, which root ignores and the file's owner (any process of the
    /// same user) can change.
    pub fn read_only_fd(&self) -> Result<OwnedFd> {
        let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        rustix::fs::open(path.as_str(), OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| Error::os("reopening shared memory read-only", e))
    }

    /// Whether this process mapped the memory writable.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: creation needs a byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte of the mapping (writes through it fault unless [`SharedMemory::is_writable`]).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Copies `dst.len()` bytes from `offset` into `dst` (a copy through raw pointers: other
    /// processes, or other mappings of the file here, may write the memory meanwhile, which
    /// gives a torn copy, never undefined behaviour).
    ///
    /// ```
    /// # fn main() -> ipc_core::Result<()> {
    /// use ipc_core::SharedMemory;
    /// let memory = SharedMemory::create("doc", 4096)?;
    /// memory.write(8, b"hello")?;
    /// let mut back = [0u8; 5];
    /// memory.read(8, &mut back)?;
    /// assert_eq!(&back, b"hello");
    /// assert!(memory.read(4095, &mut back).is_err(), "outside the mapping");
    /// # Ok(()) }
    /// ```
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        crate::error::check_range(offset, dst.len(), self.len)?;
        // SAFETY: the range lies in the live mapping (checked above); `dst` is another object.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` to `offset` ([`Error::ReadOnlyMemory`] if the mapping is read-only); see
    /// [`SharedMemory::read`].
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        if !self.writable {
            return Err(Error::ReadOnlyMemory);
        }
        crate::error::check_range(offset, src.len(), self.len)?;
        // SAFETY: the range lies in the live mapping, which is writable (both checked above);
        // `src` is another object, and no reference into the mapping is handed out safely.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
        Ok(())
    }

    /// Sets `count` bytes from `offset` to `value` ([`Error::ReadOnlyMemory`] if the mapping is
    /// read-only); see [`SharedMemory::write`].
    ///
    /// ```
    /// # fn main() -> ipc_core::Result<()> {
    /// let memory = ipc_core::SharedMemory::create("doc", 4096)?;
    /// memory.fill(4, 3, 0xab)?;
    /// let mut back = [0u8; 8];
    /// memory.read(0, &mut back)?;
    /// assert_eq!(back, [0, 0, 0, 0, 0xab, 0xab, 0xab, 0]);
    /// assert!(memory.fill(4090, 7, 0).is_err(), "outside the mapping");
    /// # Ok(()) }
    /// ```
    pub fn fill(&self, offset: usize, count: usize, value: u8) -> Result<()> {
        if !self.writable {
            return Err(Error::ReadOnlyMemory);
        }
        crate::error::check_range(offset, count, self.len)?;
        // SAFETY: the range lies in the live mapping, which is writable (both checked above), and
        // no reference into the mapping is handed out safely.
        unsafe { std::ptr::write_bytes(self.ptr.add(offset), value, count) };
        Ok(())
    }

    /// The `count` elements of type `T` from byte `offset`, borrowed as a [`SharedElements`]:
    /// copied out safely, or seen in place with its `unsafe` [`SharedElements::as_slice`].
    /// [`Error::OutOfBounds`] outside the mapping, [`Error::InvalidArgument`] where `offset` is not
    /// aligned for `T`.
    ///
    /// ```
    /// # fn main() -> ipc_core::Result<()> {
    /// let memory = ipc_core::SharedMemory::create("doc", 4096)?;
    /// memory.write(8, bytemuck::cast_slice(&[1u32, 2, 3]))?;
    /// let elements = memory.elements::<u32>(8, 3)?;
    /// assert_eq!(elements.to_vec(), [1, 2, 3]); // a copy: always sound
    /// // SAFETY: nothing writes the memory while `view` lives.
    /// let view = unsafe { elements.as_slice() };
    /// assert_eq!(view, [1, 2, 3]);
    /// assert!(memory.elements::<u32>(6, 1).is_err(), "unaligned");
    /// # Ok(()) }
    /// ```
    pub fn elements<T: bytemuck::Pod>(&self, offset: usize, count: usize) -> Result<SharedElements<'_, T>> {
        let bytes =
            count.checked_mul(std::mem::size_of::<T>()).ok_or(Error::OutOfBounds { offset, count, len: self.len })?;
        crate::error::check_range(offset, bytes, self.len)?;
        // The mapping is page-aligned, so the address is aligned where the offset is.
        if !offset.is_multiple_of(std::mem::align_of::<T>()) {
            return Err(Error::InvalidArgument(format!(
                "byte {offset} is not aligned for {}",
                std::any::type_name::<T>()
            )));
        }
        Ok(SharedElements { memory: self, offset, count, element: std::marker::PhantomData })
    }

    /// The bytes, borrowed in place.
    ///
    /// # Safety
    /// The memory is shared: no one may write it while the slice lives, neither this process
    /// (through another mapping of the file, [`SharedMemory::store_u64`], [`SharedMemory::write`]
    /// or [`SharedMemory::as_ptr`]) nor another process that holds the file writable. Where that
    /// cannot be promised, use [`SharedMemory::read`].
    ///
    /// ```compile_fail,E0133
    /// # fn main() -> ipc_core::Result<()> {
    /// let memory = ipc_core::SharedMemory::create("doc", 4096)?;
    /// let bytes: &[u8] = memory.as_slice(); // unsafe: `store_u64` below would write under it
    /// memory.store_u64(0, 7)?;
    /// assert_eq!(bytes[0], 0);
    /// # Ok(()) }
    /// ```
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is valid for `len` bytes while `self` lives; files are zero-filled;
        // the caller promises that nobody writes it meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable; [`Error::ReadOnlyMemory`] if the mapping is read-only.
    ///
    /// # Safety
    /// As for [`SharedMemory::as_slice`]: no one else (another mapping here, another process)
    /// may read or write the memory while the slice lives. Where that cannot be promised, use
    /// [`SharedMemory::write`].
    pub unsafe fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        if !self.writable {
            return Err(Error::ReadOnlyMemory);
        }
        // SAFETY: as in `as_slice`; the pages are mapped writable (checked above), and `&mut self`
        // makes access through this mapping exclusive; the caller promises the rest.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Page-locks the mapping and maps it for every context's devices.
    ///
    /// A read-only mapping is registered read-only for the devices too, which needs a device with
    /// `CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED` (else the driver answers
    /// `CUDA_ERROR_NOT_SUPPORTED`).
    pub fn pin(self, context: &Arc<Context>) -> Result<PinnedSharedMemory> {
        let device_ptr = crate::DeviceMemory::device_ptr(&self.registered(context)?);
        Ok(PinnedSharedMemory { memory: self, device_ptr, context: context.clone() })
    }
}

/// Elements of type `T` in a [`SharedMemory`] mapping, in bounds and aligned (from
/// [`SharedMemory::elements`]). Copying them out ([`SharedElements::to_vec`]) is always sound;
/// seeing them in place ([`SharedElements::as_slice`]) is `unsafe`, because the memory is shared:
/// other mappings and other processes may write it while a `&[T]` lives, which the compiler
/// cannot see.
#[derive(Clone, Copy, Debug)]
pub struct SharedElements<'a, T> {
    memory: &'a SharedMemory,
    offset: usize,
    count: usize,
    element: std::marker::PhantomData<T>,
}

impl<'a, T: bytemuck::Pod> SharedElements<'a, T> {
    /// How many elements.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The elements, copied (through raw pointers, see [`SharedMemory::read`]: a write meanwhile
    /// gives a torn copy, never undefined behaviour).
    pub fn to_vec(&self) -> Vec<T> {
        let mut out = vec![T::zeroed(); self.count];
        let read = self.memory.read(self.offset, bytemuck::cast_slice_mut(&mut out));
        debug_assert!(read.is_ok(), "the range was checked when the elements were made");
        out
    }

    /// The elements, borrowed in place (no copy) for as long as the memory is borrowed.
    ///
    /// # Safety
    /// No one may write these bytes while the slice lives: not this process (through the
    /// mapping's [`SharedMemory::write`], [`SharedMemory::fill`], [`SharedMemory::store_u64`],
    /// [`SharedMemory::as_ptr`], another mapping of the file, or a GPU that has it registered),
    /// nor another process that holds the file writable. Where that cannot be promised, use
    /// [`SharedElements::to_vec`].
    ///
    /// ```compile_fail,E0133
    /// # fn main() -> ipc_core::Result<()> {
    /// let memory = ipc_core::SharedMemory::create("doc", 4096)?;
    /// let view: &[u8] = memory.elements::<u8>(0, 8)?.as_slice(); // unsafe: `fill` writes under it
    /// memory.fill(0, 8, 1)?;
    /// assert_eq!(view[0], 0);
    /// # Ok(()) }
    /// ```
    pub unsafe fn as_slice(&self) -> &'a [T] {
        // SAFETY: the range lies in the live mapping, which `'a` borrows, and is aligned for `T`
        // (both checked by `SharedMemory::elements`); every bit pattern is a `T` (`Pod`), and the
        // file is zero-filled, so the bytes are initialised; the caller promises that nobody
        // writes them while the slice lives.
        unsafe { std::slice::from_raw_parts(self.memory.ptr.add(self.offset).cast::<T>(), self.count) }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        if let Some(registration) = self.registration.get() {
            // SAFETY: registered once in `registered`, unregistered once, before the unmap.
            crate::release_in(&registration.context, || unsafe { driver!(cuMemHostUnregister(self.ptr.cast())) });
        }
        // SAFETY: the mapping is owned and unmapped once; no slice borrowed from it outlives `self`.
        if let Err(error) = unsafe { munmap(self.ptr.cast(), self.len) } {
            tracing::warn!(%error, "munmap of shared memory failed");
        }
    }
}

/// [`SharedMemory`] registered with the driver: copies to and from it run at pinned speed. The
/// registration ends when the memory is dropped (see [`SharedMemory::registered`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_file_share_bytes() {
        let first = SharedMemory::create("test", 4096).unwrap();
        first.write(0, b"hello").unwrap();
        let fd = first.fd().try_clone_to_owned().unwrap();
        let second = SharedMemory::from_fd(fd, 4096).unwrap();
        let mut back = [0u8; 6];
        second.read(0, &mut back).unwrap();
        assert_eq!(&back, b"hello\0");
    }

    #[test]
    fn a_file_shorter_than_asked_is_refused() {
        let memory = SharedMemory::create("short", 100).unwrap();
        let fd = memory.fd().try_clone_to_owned().unwrap();
        assert!(matches!(SharedMemory::from_fd(fd, 4096), Err(Error::OutOfBounds { len: 100, .. })));
        assert!(matches!(SharedMemory::create("empty", 0), Err(Error::InvalidArgument(_))));
    }

    /// A file of `len` bytes that can be sealed but is not.
    fn unsealed_memfd(len: u64) -> OwnedFd {
        let fd = memfd_create("unsealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        ftruncate(&fd, len).unwrap();
        fd
    }

    #[test]
    fn an_unsealed_memfd_is_refused() {
        let fd = unsealed_memfd(4096);
        let peer_copy = fd.try_clone().unwrap();
        assert!(matches!(SharedMemory::from_fd(fd, 4096), Err(Error::UnsealedSharedMemory)));
        // What the refusal prevents: the sender can still shrink the file under a mapping.
        ftruncate(&peer_copy, 0).unwrap();
        let never_sealable = memfd_create("no-sealing", MemfdFlags::CLOEXEC).unwrap();
        ftruncate(&never_sealable, 4096).unwrap();
        assert!(matches!(SharedMemory::from_fd(never_sealable, 4096), Err(Error::UnsealedSharedMemory)));
    }

    #[test]
    fn a_regular_file_is_refused() {
        let path = std::env::temp_dir().join(format!("ipc-core-regular-{}", std::process::id()));
        let file = std::fs::File::create_new(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(4096).unwrap();
        let error = SharedMemory::from_fd(file.into(), 4096).unwrap_err();
        assert!(matches!(error, Error::UnsealedSharedMemory), "{error}");
        assert!(error.to_string().contains("SIGBUS"), "the message says what is at stake: {error}");
    }

    #[test]
    fn created_memory_cannot_be_resized() {
        let memory = SharedMemory::create("sealed", 8192).unwrap();
        let fd = memory.fd().try_clone_to_owned().unwrap();
        assert_eq!(ftruncate(&fd, 4096), Err(rustix::io::Errno::PERM), "shrinking is sealed");
        assert_eq!(ftruncate(&fd, 1 << 20), Err(rustix::io::Errno::PERM), "growing is sealed");
        assert_eq!(fcntl_add_seals(&fd, SealFlags::WRITE), Err(rustix::io::Errno::PERM), "the seals are final");
        assert_eq!(fstat(&fd).unwrap().st_mode & 0o777, 0o400, "no reopening for writing through /proc");
    }

    /// What a receiver of the same user (or root) may try on a read-only descriptor: every
    /// way to write the file is refused once it is write-sealed, and the creator still writes.
    #[test]
    fn write_sealed_memory_cannot_be_made_writable_by_a_holder() {
        let creator = SharedMemory::create_write_sealed("sealed-read-only", 8192).unwrap();
        creator.write(0, b"mine").unwrap();
        let given = creator.read_only_fd().unwrap();
        fchmod(&given, Mode::RUSR | Mode::WUSR).unwrap(); // the owner may
        let path = format!("/proc/self/fd/{}", given.as_raw_fd());
        let reopened = rustix::fs::open(path.as_str(), OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()).unwrap();
        // SAFETY: a fresh mapping, refused or unmapped at once; it aliases no Rust object.
        let shared_rw = unsafe {
            mmap(std::ptr::null_mut(), 8192, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &reopened, 0)
        };
        assert_eq!(shared_rw.err(), Some(rustix::io::Errno::PERM), "no writable shared mapping");
        assert_eq!(rustix::io::pwrite(&reopened, b"evil", 0).err(), Some(rustix::io::Errno::PERM), "no write");
        let punch = rustix::fs::fallocate(
            &reopened,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            0,
            4096,
        );
        assert_eq!(punch.err(), Some(rustix::io::Errno::PERM), "no hole punched");
        assert_eq!(ftruncate(&reopened, 0), Err(rustix::io::Errno::PERM), "no shrinking");
        // SAFETY: as above.
        let read_only =
            unsafe { mmap(std::ptr::null_mut(), 8192, ProtFlags::READ, MapFlags::SHARED, &reopened, 0) }.unwrap();
        // SAFETY: the mapping just made; the call is refused or changes only its protection.
        let upgraded = unsafe {
            rustix::mm::mprotect(read_only, 8192, rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE)
        };
        assert!(upgraded.is_err(), "a read-only mapping cannot be made writable");
        // SAFETY: unmapped once; nothing refers to it.
        unsafe { munmap(read_only, 8192) }.unwrap();
        let reader = SharedMemory::from_fd(reopened, 8192).unwrap();
        assert!(!reader.is_writable(), "mapped read-only whatever the descriptor's mode");
        creator.write(0, b"MINE").unwrap();
        let mut back = [0u8; 4];
        reader.read(0, &mut back).unwrap();
        assert_eq!(&back, b"MINE", "the creator's mapping stays writable, and the holder sees it");
    }

    #[test]
    fn a_read_only_descriptor_maps_read_only_and_sees_writes() {
        let creator = SharedMemory::create("read-only", 4096).unwrap();
        assert!(creator.is_writable());
        creator.write(0, &[7]).unwrap();
        let mut reader = SharedMemory::from_fd(creator.read_only_fd().unwrap(), 4096).unwrap();
        assert!(!reader.is_writable());
        // SAFETY: refused before any slice is made.
        assert!(matches!(unsafe { reader.as_mut_slice() }, Err(Error::ReadOnlyMemory)));
        assert!(matches!(reader.write(0, &[1]), Err(Error::ReadOnlyMemory)));
        let fl = fcntl_getfl(reader.fd()).unwrap();
        assert_eq!(fl & OFlags::RWMODE, OFlags::RDONLY);
        let mut back = [0u8; 2];
        reader.read(0, &mut back).unwrap();
        assert_eq!(back[0], 7);
        creator.write(1, &[9]).unwrap();
        reader.read(0, &mut back).unwrap();
        assert_eq!(back[1], 9, "later writes show through the read-only mapping");
        // SAFETY: a writable shared mapping of the read-only descriptor is refused by the kernel
        // before anything is mapped.
        let writable = unsafe {
            mmap(std::ptr::null_mut(), 4096, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, reader.fd(), 0)
        };
        assert_eq!(writable.err(), Some(rustix::io::Errno::ACCESS));
    }
}
