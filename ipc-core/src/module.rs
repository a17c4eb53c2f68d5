//! Loaded GPU code: modules from a fatbin image, and launches of their kernels.

use std::ffi::{CString, c_void};
use std::sync::Arc;

use cuda_sys::{CUfunction, CUmodule, driver};

use crate::{Context, Error, Result, Stream};

/// A module loaded from a fatbin, cubin or PTX image; unloaded on drop.
#[derive(Debug)]
pub struct Module {
    raw: CUmodule,
    context: Arc<Context>,
}

// SAFETY: a CUmodule handle may be used from any thread; the driver owns its state.
unsafe impl Send for Module {}
// SAFETY: as above; methods only pass the handle to the driver.
unsafe impl Sync for Module {}

impl Module {
    /// Loads `image` into `context`; the driver picks the machine code for the device, or JIT
    /// compiles the PTX.
    pub fn load(context: &Arc<Context>, image: &[u8]) -> Result<Arc<Module>> {
        if image.is_empty() {
            return Err(Error::InvalidArgument("an empty module image".into()));
        }
        context.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `image` is readable for the call; the driver copies what it keeps.
        unsafe { driver!(cuModuleLoadData(&mut raw, image.as_ptr().cast())) }?;
        Ok(Arc::new(Module { raw, context: context.clone() }))
    }

    /// The kernel called `name` (an `extern "C"` name).
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function> {
        let c_name = CString::new(name).map_err(|_| Error::InvalidArgument(format!("{name:?} has a NUL")))?;
        self.context.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; `c_name` is NUL-terminated; the module is loaded.
        unsafe { driver!(cuModuleGetFunction(&mut raw, self.raw, c_name.as_ptr())) }?;
        Ok(Function { raw, module: self.clone() })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: the module is owned; every `Function` holds an `Arc` to it, so none outlives it.
        crate::release_in(&self.context, || unsafe { driver!(cuModuleUnload(self.raw)) });
    }
}

/// Grid and block sizes of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional launch of 256-thread blocks for grid-stride kernels covering `items`,
    /// capped at 1,024 blocks (enough to fill an H100's 132 multiprocessors several times).
    pub fn for_items(items: u64) -> LaunchConfig {
        const THREADS: u64 = 256;
        let blocks = items.div_ceil(THREADS).clamp(1, 1024) as u32;
        LaunchConfig { grid: (blocks, 1, 1), block: (THREADS as u32, 1, 1), shared_bytes: 0 }
    }
}

/// A kernel of a loaded module.
#[derive(Debug, Clone)]
pub struct Function {
    raw: CUfunction,
    module: Arc<Module>,
}

// SAFETY: a CUfunction handle may be launched from any thread; it lives as long as its module.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// Queues the kernel on `stream`.
    ///
    /// # Safety
    /// `params` must point to one argument per kernel parameter, of its exact type, in order; and
    /// every device address among them must be valid for what the kernel does with it until the
    /// kernel has finished.
    pub unsafe fn launch(&self, stream: &Stream, config: LaunchConfig, params: &mut [*mut c_void]) -> Result<()> {
        self.module.context.bind()?;
        let LaunchConfig { grid, block, shared_bytes } = config;
        // SAFETY: the caller vouches for the parameters; the function and stream are live.
        unsafe {
            driver!(cuLaunchKernel(
                self.raw,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_bytes,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut()
            ))
        }?;
        Ok(())
    }
}
