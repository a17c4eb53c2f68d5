//! The CUDA driver library: where it is looked for, its errors, and its functions, each
//! resolved on its first call through [`crate::shared_library`].
//!
//! cudarc resolved every symbol eagerly and panicked on drivers that lacked a new one; here a
//! function is looked up only when called, and a missing one is an error for that call alone.

use std::ffi::c_void;
use std::sync::OnceLock;

use crate::shared_library::{SharedLibrary, named_path};

/// File names tried, in order, when [`LIBRARY_ENV`] is not set.
pub const LIBRARY_CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// Environment variable naming one driver library to load instead of [`LIBRARY_CANDIDATES`].
pub const LIBRARY_ENV: &str = "CUDA_SYS_LIBCUDA";

/// The driver library or one of its functions could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// None of the candidate libraries could be opened.
    #[error(
        "the CUDA driver library could not be loaded (tried {tried}): {reason}; \
         install the NVIDIA driver, or name the library in {LIBRARY_ENV}"
    )]
    LibraryNotFound {
        /// The file names tried, comma-separated.
        tried: String,
        /// The dynamic loader's message for the last candidate.
        reason: String,
    },
    /// The library was opened but lacks a function (a driver older than the pinned `cuda.h`).
    #[error("the CUDA driver library {library} has no function `{symbol}` (driver too old?): {reason}")]
    SymbolNotFound {
        /// The versioned symbol name, as `cuda.h` maps it (`cuMemAlloc_v2`).
        symbol: &'static str,
        /// The library that was searched.
        library: String,
        /// The dynamic loader's message.
        reason: String,
    },
}

/// An opened driver library.
pub struct Driver {
    library: SharedLibrary,
    path: String,
}

impl Driver {
    /// Opens the first of `candidates` that loads.
    pub fn open(candidates: &[&str]) -> Result<Driver, LoadError> {
        let mut reason = String::from("no candidates");
        for &path in candidates {
            match SharedLibrary::open(path) {
                Ok(library) => return Ok(Driver { library, path: path.to_string() }),
                Err(error) => reason = error,
            }
        }
        Err(LoadError::LibraryNotFound { tried: candidates.join(", "), reason })
    }

    /// The path or file name this library was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The address of `symbol`, or an error naming it.
    pub fn symbol(&self, symbol: &'static str) -> Result<*const c_void, LoadError> {
        self.library.symbol(symbol).map_err(|reason| LoadError::SymbolNotFound {
            symbol,
            library: self.path.clone(),
            reason,
        })
    }
}

/// The process's driver library, opened on first use: the one [`LIBRARY_ENV`] names, where it
/// is set (and nothing else: a named library that does not load is the error), else the first
/// of [`LIBRARY_CANDIDATES`] that loads.
pub fn library() -> Result<&'static Driver, LoadError> {
    static DRIVER: OnceLock<Result<Driver, LoadError>> = OnceLock::new();
    DRIVER
        .get_or_init(|| match named_path(LIBRARY_ENV, &|name| std::env::var_os(name)) {
            Some(path) => Driver::open(&[&path.to_string_lossy()]),
            None => Driver::open(LIBRARY_CANDIDATES),
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The address of the driver function `symbol` in [`library`].
#[doc(hidden)]
pub fn resolve(symbol: &'static str) -> Result<*const c_void, LoadError> {
    library()?.symbol(symbol)
}

/// Whether the driver loads and `cuInit` succeeds (there is at least one usable GPU).
///
/// The answer is computed once per process.
pub fn is_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    // SAFETY: `cuInit(0)` has no pointer arguments and may be called any number of times.
    *AVAILABLE.get_or_init(|| unsafe { crate::cuInit(0) } == Ok(crate::CUresult::CUDA_SUCCESS))
}

/// Turns bindgen's list of driver functions into lazily resolved wrappers.
macro_rules! driver_functions {
    ($($functions:tt)*) => {
        lazy_functions! {
            library: "the CUDA driver API (`cuda.h`)", error: $crate::LoadError, resolve: $crate::driver::resolve;
            $($functions)*
        }
    };
}
