//! Opening `libcuda` once and resolving each driver function on its first call.
//!
//! cudarc resolved every symbol eagerly and panicked on drivers that lacked a new one; here a
//! function is looked up only when called, and a missing one is an error for that call alone.

use std::ffi::c_void;
use std::sync::OnceLock;

use libloading::Library;

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
    library: Library,
    path: String,
}

impl Driver {
    /// Opens the first of `candidates` that loads.
    pub fn open(candidates: &[&str]) -> Result<Driver, LoadError> {
        let mut reason = String::from("no candidates");
        for &path in candidates {
            // SAFETY: loading runs the library's initialisers. The candidates name the NVIDIA
            // driver library (or one a user named deliberately), whose initialisers are sound.
            match unsafe { Library::new(path) } {
                Ok(library) => {
                    return Ok(Driver { library, path: path.to_string() });
                }
                Err(error) => reason = error.to_string(),
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
        // SAFETY: the symbol is read as an opaque address; it is called only through the
        // signature bindgen generated for this name (see `driver_functions!`).
        let found = unsafe { self.library.get::<*const c_void>(symbol.as_bytes()) };
        match found {
            Ok(address) => Ok(*address),
            Err(error) => {
                Err(LoadError::SymbolNotFound { symbol, library: self.path.clone(), reason: error.to_string() })
            }
        }
    }
}

/// The process's driver library, opened on first use.
pub fn library() -> Result<&'static Driver, LoadError> {
    static DRIVER: OnceLock<Result<Driver, LoadError>> = OnceLock::new();
    DRIVER
        .get_or_init(|| match std::env::var(LIBRARY_ENV) {
            Ok(path) if !path.is_empty() => Driver::open(&[path.as_str()]),
            _ => Driver::open(LIBRARY_CANDIDATES),
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether the driver loads and `cuInit` succeeds (there is at least one usable GPU).
///
/// The answer is computed once per process.
pub fn is_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    // SAFETY: `cuInit(0)` has no pointer arguments and may be called any number of times.
    *AVAILABLE.get_or_init(|| unsafe { crate::cuInit(0) } == Ok(crate::CUresult::CUDA_SUCCESS))
}

/// One driver function's address, resolved on first use and remembered (errors too).
#[doc(hidden)]
pub struct LazySymbol {
    name: &'static str,
    address: OnceLock<Result<usize, LoadError>>,
}

impl LazySymbol {
    /// A symbol not yet resolved.
    pub const fn new(name: &'static str) -> Self {
        LazySymbol { name, address: OnceLock::new() }
    }

    /// The symbol's address in the driver library.
    pub fn address(&self) -> Result<*const c_void, LoadError> {
        let resolved = self.address.get_or_init(|| library()?.symbol(self.name).map(|address| address as usize));
        match resolved {
            Ok(address) => Ok(*address as *const c_void),
            Err(error) => Err(error.clone()),
        }
    }
}

/// Turns bindgen's list of driver functions into lazily resolved wrappers.
macro_rules! driver_functions {
    ($(pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*) => {$(
        #[doc = concat!("`", stringify!($name), "` of the CUDA driver API, resolved on first use.")]
        ///
        /// # Safety
        /// The contract of the C function of this name in `cuda.h`.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name($($arg: $ty),*) -> Result<$ret, $crate::LoadError> {
            static SYMBOL: $crate::loader::LazySymbol =
                $crate::loader::LazySymbol::new(stringify!($name));
            let address = SYMBOL.address()?;
            // SAFETY: `address` is the driver's function of this exact (versioned) name, and this
            // signature is the one bindgen read for it from the pinned `cuda.h`.
            let function: unsafe extern "C" fn($($ty),*) -> $ret =
                unsafe { std::mem::transmute(address) };
            // SAFETY: the caller upholds the C function's contract.
            Ok(unsafe { function($($arg),*) })
        }
    )*};
}
