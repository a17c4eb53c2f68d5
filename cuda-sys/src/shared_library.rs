//! The one way this crate loads a shared library and its functions: the CUDA driver
//! ([`crate::library`]), NCCL ([`crate::nccl::library`]) and NVML ([`crate::nvml::library`]).
//!
//! Nothing is linked. Each library is opened once per process, on its first use, and each
//! function is resolved by name on its own first call (`LazySymbol`, through the
//! `lazy_functions!` wrappers), so a missing library or a missing function is an error value
//! for the calls that need it, never a panic or a failure to start.
//!
//! The policy on where a library comes from also lives here ([`named_path`]): a path the user
//! names in an environment variable (`CUDA_SYS_LIBCUDA`, `TQ_NCCL_LIBRARY`) is the only one
//! tried. If it does not load, that is the error; it is never replaced by a system library.

use std::ffi::{OsString, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// An opened shared library and where it was opened from.
pub struct SharedLibrary {
    library: libloading::Library,
    path: PathBuf,
}

impl std::fmt::Debug for SharedLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLibrary").field("path", &self.path).finish()
    }
}

impl SharedLibrary {
    /// Opens the library at `path` (a path, or a file name the dynamic loader looks up), or
    /// returns the dynamic loader's message.
    ///
    /// Loading runs the library's initialisers: this crate opens only NVIDIA's libraries (the
    /// driver, NCCL, NVML) and ones a user named for them deliberately.
    pub fn open(path: impl AsRef<Path>) -> Result<SharedLibrary, String> {
        let path = path.as_ref();
        // SAFETY: loading runs the library's initialisers. The paths name NVIDIA's libraries (or
        // one a user named in their place deliberately), whose initialisers are sound.
        match unsafe { libloading::Library::new(path) } {
            Ok(library) => Ok(SharedLibrary { library, path: path.to_path_buf() }),
            Err(error) => Err(error.to_string()),
        }
    }

    /// The path or file name this library was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The address of `symbol`, or the dynamic loader's message.
    pub fn symbol(&self, symbol: &str) -> Result<*const c_void, String> {
        // SAFETY: the symbol is read as an opaque address; it is called only through the
        // signature declared for this name (see `lazy_functions!`).
        let found = unsafe { self.library.get::<*const c_void>(symbol.as_bytes()) };
        found.map(|address| *address).map_err(|error| error.to_string())
    }
}

/// The path the environment variable `variable` names (through `env`), where it is set and not
/// empty. Where it is, that path is the only one a loader may try.
pub fn named_path(variable: &str, env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    env(variable).filter(|path| !path.is_empty()).map(PathBuf::from)
}

/// One function's address, resolved on first use and remembered (errors too).
#[doc(hidden)]
pub struct LazySymbol<E> {
    name: &'static str,
    address: OnceLock<Result<usize, E>>,
}

impl<E: Clone> LazySymbol<E> {
    /// A symbol not yet resolved.
    pub const fn new(name: &'static str) -> Self {
        LazySymbol { name, address: OnceLock::new() }
    }

    /// The symbol's address, found by `resolve` (given the symbol's name) on the first call.
    pub fn address(&self, resolve: impl FnOnce(&'static str) -> Result<*const c_void, E>) -> Result<*const c_void, E> {
        let resolved = self.address.get_or_init(|| resolve(self.name).map(|address| address as usize));
        match resolved {
            Ok(address) => Ok(*address as *const c_void),
            Err(error) => Err(error.clone()),
        }
    }
}

/// Turns a list of C function declarations into wrappers that resolve each function on its
/// first call with `$resolve` (`fn(&'static str) -> Result<*const c_void, $error>`) and return
/// `Result<return type, $error>`. `$library` names the library in the wrappers' docs.
macro_rules! lazy_functions {
    (
        library: $library:literal, error: $error:ty, resolve: $resolve:path;
        $(pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*
    ) => {$(
        #[doc = concat!("`", stringify!($name), "` of ", $library, ", resolved on first use.")]
        ///
        /// # Safety
        #[doc = concat!("The contract of the C function of this name in ", $library, ".")]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name($($arg: $ty),*) -> Result<$ret, $error> {
            static SYMBOL: $crate::shared_library::LazySymbol<$error> =
                $crate::shared_library::LazySymbol::new(stringify!($name));
            let address = SYMBOL.address($resolve)?;
            // SAFETY: `address` is the library's function of this exact name, and this signature
            // is the one declared for it (by bindgen from the pinned header, or by hand).
            let function: unsafe extern "C" fn($($ty),*) -> $ret =
                unsafe { std::mem::transmute(address) };
            // SAFETY: the caller upholds the C function's contract.
            Ok(unsafe { function($($arg),*) })
        }
    )*};
}
