//! The few functions of NVML (`libnvidia-ml.so.1`, the NVIDIA management library) that
//! `ipc_core::topology` needs, loaded like the driver: the library on first use, each function
//! on its first call, and a missing one is an error value ([`NvmlError`]).
//!
//! NVML has no pinned header here, so the four declarations are written by hand from `nvml.h`
//! (its handles are pointers, its enums and `nvmlReturn_t` C ints).

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use crate::shared_library::SharedLibrary;

/// The file name the dynamic loader is asked for.
pub const LIBRARY_NAME: &str = "libnvidia-ml.so.1";

/// `nvmlReturn_t`: `NVML_SUCCESS` (0) or an error code.
#[allow(non_camel_case_types)]
pub type nvmlReturn_t = c_int;
/// `nvmlDevice_t`: an opaque device handle.
#[allow(non_camel_case_types)]
pub type nvmlDevice_t = *mut c_void;
/// `nvmlGpuP2PCapsIndex_t`: which peer-to-peer capability to ask about.
#[allow(non_camel_case_types)]
pub type nvmlGpuP2PCapsIndex_t = c_int;
/// `nvmlGpuP2PStatus_t`: `NVML_P2P_STATUS_OK` (0) or why not.
#[allow(non_camel_case_types)]
pub type nvmlGpuP2PStatus_t = c_int;

/// `NVML_SUCCESS`.
pub const NVML_SUCCESS: nvmlReturn_t = 0;
/// `NVML_P2P_CAPS_INDEX_NVLINK`: peer-to-peer over NVLink.
pub const NVML_P2P_CAPS_INDEX_NVLINK: nvmlGpuP2PCapsIndex_t = 2;
/// `NVML_P2P_STATUS_OK`: the capability is there.
pub const NVML_P2P_STATUS_OK: nvmlGpuP2PStatus_t = 0;

/// NVML or one of its functions could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NvmlError {
    /// The library could not be opened.
    #[error("NVML ({LIBRARY_NAME}) could not be loaded: {reason}")]
    LibraryNotFound {
        /// The dynamic loader's message.
        reason: String,
    },
    /// The library lacks a function.
    #[error("NVML ({LIBRARY_NAME}) has no function `{symbol}`: {reason}")]
    SymbolNotFound {
        /// The function looked up.
        symbol: &'static str,
        /// The dynamic loader's message.
        reason: String,
    },
}

/// The library, once [`library`] has tried to open it.
static LIBRARY: OnceLock<Result<SharedLibrary, NvmlError>> = OnceLock::new();

/// The process's NVML, opened on first use.
pub fn library() -> Result<&'static SharedLibrary, NvmlError> {
    LIBRARY
        .get_or_init(|| SharedLibrary::open(LIBRARY_NAME).map_err(|reason| NvmlError::LibraryNotFound { reason }))
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether this process has tried to load NVML (successfully or not): tests use it to prove
/// that a path (such as sending a message) never pays for NVML.
#[doc(hidden)]
pub fn load_attempted() -> bool {
    LIBRARY.get().is_some()
}

/// The address of the NVML function `symbol` in [`library`].
#[doc(hidden)]
pub fn resolve(symbol: &'static str) -> Result<*const c_void, NvmlError> {
    library()?.symbol(symbol).map_err(|reason| NvmlError::SymbolNotFound { symbol, reason })
}

// The macro's unsafe blocks carry their SAFETY comments, which clippy does not see in an
// expansion (the generated bindings are allowed the same way).
#[allow(non_snake_case, non_camel_case_types, clippy::undocumented_unsafe_blocks)]
mod functions {
    use super::*;

    lazy_functions! {
        library: "NVML (`nvml.h`)", error: super::NvmlError, resolve: super::resolve;
        pub fn nvmlInit_v2() -> nvmlReturn_t;
        pub fn nvmlShutdown() -> nvmlReturn_t;
        pub fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t;
        pub fn nvmlDeviceGetP2PStatus(
            device1: nvmlDevice_t,
            device2: nvmlDevice_t,
            p2pIndex: nvmlGpuP2PCapsIndex_t,
            p2pStatus: *mut nvmlGpuP2PStatus_t,
        ) -> nvmlReturn_t;
    }
}
pub use functions::*;
