//! Hand-written CUDA kernels, compiled by nvcc into one fatbin (`kernels.fatbin`, committed, so no
//! build needs nvcc; `cargo xtask kernels` rebuilds it and `--check` tells when `cu/kernels.cu`
//! changed without it) that is embedded here and loaded with `cuModuleLoadData` on first use,
//! once per device.
//!
//! - [`Kernels::fill`] and [`Kernels::checksum`]: a deterministic pattern and a position-sensitive
//!   checksum, which every GPU test uses to prove a receiver sees exactly the sender's bytes
//!   ([`reference`](mod@reference) computes both on the CPU);
//! - [`Kernels::pack`] and [`Kernels::unpack`]: a strided view of up to 8 dimensions (1, 2, 4 or
//!   8-byte elements) into and out of a contiguous buffer;
//! - [`Kernels::read`]: reads a range and adds its words into a device counter, asynchronously
//!   (a consumer's use of a tensor, in benchmarks);
//! - [`Kernels::spin_then_fill`]: runs for a requested time before writing, to prove ordering;
//! - [`Kernels::matmul_f32`]: a plain float32 matrix multiply, for the seed scenario.

pub mod reference;

use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ipc_core::{Context, DeviceBuffer, DeviceMemory, Error, Function, LaunchConfig, Module, Result, Stream};

/// The fatbin nvcc built from `cu/kernels.cu`.
pub static FATBIN: &[u8] = include_bytes!("../kernels.fatbin");

/// The most dimensions a strided view may have.
pub const MAX_DIMS: usize = 8;

/// A strided view's layout, as the pack and unpack kernels take it (the C struct's twin).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StridedLayout {
    shape: [u64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
    ndim: u32,
    elem_size: u32,
    numel: u64,
}

impl StridedLayout {
    /// A layout with these sizes and strides (in elements) of `elem_size`-byte elements.
    pub fn new(shape: &[u64], strides: &[i64], elem_size: usize) -> Result<StridedLayout> {
        if shape.len() != strides.len() || shape.len() > MAX_DIMS {
            return Err(Error::InvalidArgument(format!(
                "{} sizes and {} strides; both must be equal and at most {MAX_DIMS}",
                shape.len(),
                strides.len()
            )));
        }
        if ![1, 2, 4, 8].contains(&elem_size) {
            return Err(Error::InvalidArgument(format!("element size {elem_size} is not 1, 2, 4 or 8")));
        }
        let numel = shape
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .ok_or_else(|| Error::InvalidArgument("the element count overflows".into()))?;
        let mut layout = StridedLayout::zeroed_with(elem_size as u32, numel, shape.len() as u32);
        layout.shape[..shape.len()].copy_from_slice(shape);
        layout.strides[..strides.len()].copy_from_slice(strides);
        Ok(layout)
    }

    fn zeroed_with(elem_size: u32, numel: u64, ndim: u32) -> StridedLayout {
        StridedLayout { elem_size, numel, ndim, ..bytemuck::Zeroable::zeroed() }
    }

    /// The number of elements.
    pub fn numel(&self) -> u64 {
        self.numel
    }

    /// Bytes of the packed (contiguous) form.
    pub fn packed_bytes(&self) -> u64 {
        self.numel * self.elem_size as u64
    }

    /// The byte range, relative to element 0, that the view touches (empty views touch nothing).
    pub fn byte_span(&self) -> Result<(i64, i64)> {
        let ndim = self.ndim as usize;
        ipc_core::layout::strided_byte_span(&self.shape[..ndim], &self.strides[..ndim], self.elem_size as usize)
            .ok_or_else(|| Error::InvalidArgument("the strided extent overflows".into()))
    }

    /// Checks that a view whose element 0 is `offset` bytes into `len` bytes stays inside them.
    fn check_within(&self, offset: usize, len: usize) -> Result<()> {
        let (low, high) = self.byte_span()?;
        let start = offset as i64 + low;
        let end = offset as i64 + high;
        if start < 0 || end > len as i64 {
            return Err(Error::OutOfBounds { offset: start.max(0) as usize, count: (end - start) as usize, len });
        }
        Ok(())
    }
}

/// The kernels, loaded into one device's primary context.
pub struct Kernels {
    fill: Function,
    spin_then_fill: Function,
    checksum: Function,
    sum_words: Function,
    pack: Function,
    unpack: Function,
    matmul: Function,
    /// Where checksums accumulate; one caller at a time.
    scratch: Mutex<DeviceBuffer>,
}

impl Kernels {
    /// The kernels for `context`'s device, loaded on the first call for that device.
    pub fn get(context: &Arc<Context>) -> Result<Arc<Kernels>> {
        /// Loaded kernels by device ordinal.
        type Loaded = Mutex<Vec<(i32, Arc<Kernels>)>>;
        static LOADED: OnceLock<Loaded> = OnceLock::new();
        let ordinal = context.device().ordinal();
        let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, kernels)) = loaded.iter().find(|(o, _)| *o == ordinal) {
            return Ok(kernels.clone());
        }
        let module = Module::load(context, FATBIN)?;
        let kernels = Arc::new(Kernels {
            fill: module.function("fill_pattern")?,
            spin_then_fill: module.function("spin_then_fill")?,
            checksum: module.function("checksum")?,
            sum_words: module.function("sum_words")?,
            pack: module.function("pack_strided")?,
            unpack: module.function("unpack_strided")?,
            matmul: module.function("matmul_f32")?,
            scratch: Mutex::new(DeviceBuffer::alloc(context, 8)?),
        });
        loaded.push((ordinal, kernels.clone()));
        Ok(kernels)
    }

    /// Writes the pattern for `seed` over `len` bytes at `offset`.
    pub fn fill(&self, memory: &dyn DeviceMemory, offset: usize, len: usize, seed: u64, stream: &Stream) -> Result<()> {
        let mut ptr = range(memory, offset, len)?;
        let (mut len, mut seed) = (len as u64, seed);
        let mut params = [arg(&mut ptr), arg(&mut len), arg(&mut seed)];
        // SAFETY: fill_pattern(u8*, u64, u64); the range was checked against the allocation.
        unsafe { self.fill.launch(stream, LaunchConfig::for_items(len.div_ceil(8)), &mut params) }
    }

    /// Like [`Kernels::fill`], but the kernel first spins for `delay` of GPU time.
    pub fn spin_then_fill(
        &self,
        memory: &dyn DeviceMemory,
        len: usize,
        seed: u64,
        delay: Duration,
        stream: &Stream,
    ) -> Result<()> {
        let mut ptr = range(memory, 0, len)?;
        let (mut len, mut seed, mut ns) = (len as u64, seed, delay.as_nanos() as u64);
        let mut params = [arg(&mut ptr), arg(&mut len), arg(&mut seed), arg(&mut ns)];
        // Few enough blocks to be resident at once, so the delay is paid once, not per wave.
        let config = LaunchConfig { grid: (64, 1, 1), ..LaunchConfig::for_items(1) };
        // SAFETY: spin_then_fill(u8*, u64, u64, u64); the range was checked.
        unsafe { self.spin_then_fill.launch(stream, config, &mut params) }
    }

    /// The checksum of `len` bytes at `offset`, after the work already queued on `stream`.
    /// Blocks until it is known.
    pub fn checksum(&self, memory: &dyn DeviceMemory, offset: usize, len: usize, stream: &Stream) -> Result<u64> {
        let scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let mut ptr = range(memory, offset, len)?;
        scratch.memset_async(0, stream)?;
        let (mut len, mut out) = (len as u64, scratch.device_ptr());
        let mut params = [arg(&mut ptr), arg(&mut len), arg(&mut out)];
        // SAFETY: checksum(const u8*, u64, u64*); the range was checked; `out` is 8 bytes.
        unsafe { self.checksum.launch(stream, LaunchConfig::for_items(len), &mut params) }?;
        stream.synchronize()?;
        let mut sum = [0u8; 8];
        scratch.copy_to_host(0, &mut sum)?;
        Ok(u64::from_le_bytes(sum))
    }

    /// Reads `len` bytes at `offset` on `stream` and adds them, as little-endian 64-bit words,
    /// into the word at the start of `counter` ([`reference::word_sum`]). The range must be
    /// 8-byte aligned in device memory and a whole number of words. Returns once it is queued.
    pub fn read(
        &self,
        memory: &dyn DeviceMemory,
        offset: usize,
        len: usize,
        counter: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<()> {
        let mut ptr = range(memory, offset, len)?;
        if !ptr.is_multiple_of(8) || !len.is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!("read of {len} bytes at {ptr:#x}: not whole aligned words")));
        }
        let mut out = range(counter, 0, 8)?;
        let mut words = len as u64 / 8;
        let mut params = [arg(&mut ptr), arg(&mut words), arg(&mut out)];
        // SAFETY: sum_words(const u64*, u64, u64*); both ranges were checked, and `ptr` is aligned.
        unsafe { self.sum_words.launch(stream, LaunchConfig::for_items(words), &mut params) }
    }

    /// Packs the strided view whose element 0 is at `src_offset` into `dst` at `dst_offset`.
    pub fn pack(
        &self,
        src: &dyn DeviceMemory,
        src_offset: usize,
        layout: &StridedLayout,
        dst: &dyn DeviceMemory,
        dst_offset: usize,
        stream: &Stream,
    ) -> Result<()> {
        layout.check_within(src_offset, src.len())?;
        let dst = range(dst, dst_offset, layout.packed_bytes() as usize)?;
        self.strided(&self.pack, src.device_ptr() + src_offset as u64, dst, layout, stream)
    }

    /// Unpacks contiguous `src` at `src_offset` into the strided view whose element 0 is at
    /// `dst_offset` of `dst`.
    pub fn unpack(
        &self,
        src: &dyn DeviceMemory,
        src_offset: usize,
        layout: &StridedLayout,
        dst: &dyn DeviceMemory,
        dst_offset: usize,
        stream: &Stream,
    ) -> Result<()> {
        let src = range(src, src_offset, layout.packed_bytes() as usize)?;
        layout.check_within(dst_offset, dst.len())?;
        self.strided(&self.unpack, src, dst.device_ptr() + dst_offset as u64, layout, stream)
    }

    fn strided(&self, kernel: &Function, src: u64, dst: u64, layout: &StridedLayout, stream: &Stream) -> Result<()> {
        if layout.numel == 0 {
            return Ok(());
        }
        let (mut src, mut dst, mut layout) = (src, dst, *layout);
        let mut params = [arg(&mut src), arg(&mut dst), arg(&mut layout)];
        // SAFETY: (const u8*, u8*, StridedLayout by value); both extents were checked by the caller.
        unsafe { kernel.launch(stream, LaunchConfig::for_items(layout.numel), &mut params) }
    }

    /// `c = a * b` for row-major float32 matrices `a` (m x k), `b` (k x n), `c` (m x n).
    pub fn matmul_f32(
        &self,
        a: &dyn DeviceMemory,
        b: &dyn DeviceMemory,
        c: &dyn DeviceMemory,
        (m, n, k): (u32, u32, u32),
        stream: &Stream,
    ) -> Result<()> {
        let floats = |rows: u32, cols: u32| rows as usize * cols as usize * 4;
        let (mut pa, mut pb, mut pc) =
            (range(a, 0, floats(m, k))?, range(b, 0, floats(k, n))?, range(c, 0, floats(m, n))?);
        let (mut m, mut n, mut k) = (m, n, k);
        let config = LaunchConfig { grid: (n.div_ceil(16), m.div_ceil(16), 1), block: (16, 16, 1), shared_bytes: 0 };
        let mut params = [arg(&mut pa), arg(&mut pb), arg(&mut pc), arg(&mut m), arg(&mut n), arg(&mut k)];
        // SAFETY: matmul_f32(const float*, const float*, float*, u32, u32, u32); sizes checked.
        unsafe { self.matmul.launch(stream, config, &mut params) }
    }
}

/// The device address of `offset..offset + len` in `memory`, after a bounds check.
fn range(memory: &dyn DeviceMemory, offset: usize, len: usize) -> Result<u64> {
    match offset.checked_add(len) {
        Some(end) if end <= memory.len() => Ok(memory.device_ptr() + offset as u64),
        _ => Err(Error::OutOfBounds { offset, count: len, len: memory.len() }),
    }
}

fn arg<T>(value: &mut T) -> *mut c_void {
    (value as *mut T).cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fatbin_is_embedded() {
        assert!(FATBIN.len() > 1000);
    }

    #[test]
    fn layouts_are_validated() {
        assert!(StridedLayout::new(&[2; 9], &[1; 9], 4).is_err());
        assert!(StridedLayout::new(&[2, 3], &[3], 4).is_err());
        assert!(StridedLayout::new(&[2, 3], &[3, 1], 3).is_err());
        assert!(StridedLayout::new(&[u64::MAX, 3], &[3, 1], 1).is_err());
        let transposed = StridedLayout::new(&[3, 2], &[1, 3], 4).unwrap();
        assert_eq!(transposed.byte_span().unwrap(), (0, 24));
        assert_eq!(transposed.packed_bytes(), 24);
        let reversed = StridedLayout::new(&[4], &[-1], 2).unwrap();
        assert_eq!(reversed.byte_span().unwrap(), (-6, 2));
        assert!(reversed.check_within(6, 8).is_ok());
        assert!(reversed.check_within(4, 8).is_err());
        assert!(transposed.check_within(8, 24).is_err());
    }
}
