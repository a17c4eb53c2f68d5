//! Errors of NCCL: a library that cannot be used, or a call that failed, in NCCL's own words.

use std::ffi::{CStr, c_char};

use super::{MINIMUM_VERSION, Version, ncclResult_t};

/// How to get a usable NCCL, ending the messages of errors about the library. (The variable is
/// [`LIBRARY_ENV`](super::LIBRARY_ENV), written out because `concat!` takes literals only; a test checks they agree.)
const HOW_TO_INSTALL: &str =
    "install NCCL with `pip install nvidia-nccl-cu13` (or -cu12), or set TQ_NCCL_LIBRARY to the path of a libnccl.so.2";

/// NCCL could not be loaded, or an NCCL call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// No candidate library could be opened.
    #[error(
        "NCCL could not be loaded; tried: {}. To use NCCL (>= {MINIMUM_VERSION}), {HOW_TO_INSTALL}",
        tried.join("; ")
    )]
    LibraryNotFound {
        /// Each candidate tried, in order, with why it did not load.
        tried: Vec<String>,
    },
    /// The library an environment variable names (`TQ_NCCL_LIBRARY`) does not load. It is the
    /// only one tried: a library the user names is never replaced by another.
    #[error(
        "{variable} names {path}, which does not load ({reason}); point {variable} at a libnccl.so.2 of \
         NCCL >= {MINIMUM_VERSION}, or unset it to search the usual places"
    )]
    NamedLibraryNotLoaded {
        /// The variable.
        variable: &'static str,
        /// The path it holds.
        path: String,
        /// The dynamic loader's message.
        reason: String,
    },
    /// A library was opened but lacks a function: it is not NCCL, or not a recent enough one.
    #[error(
        "{library} has no function `{symbol}`, so it is not NCCL >= {MINIMUM_VERSION} ({reason}); {HOW_TO_INSTALL}"
    )]
    SymbolNotFound {
        /// The function looked up.
        symbol: &'static str,
        /// The library that was searched.
        library: String,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The library is an NCCL older than the transport needs.
    #[error(
        "NCCL {found} at {library} is too old: NCCL >= {required} is needed (non-blocking \
         initialisation, ncclCommGetAsyncError and ncclCommAbort); {HOW_TO_INSTALL} >= {required}"
    )]
    VersionTooOld {
        /// The version the library reported.
        found: Version,
        /// The oldest version supported.
        required: Version,
        /// Where the library was found.
        library: String,
    },
    /// An NCCL call returned an error (or, where it was not expected, `ncclInProgress`).
    #[error("{call} failed with {name} ({}): {description}{}", code.0, detail(last_error))]
    Call {
        /// The NCCL function that failed.
        call: &'static str,
        /// The result code.
        code: ncclResult_t,
        /// The code's name in `nccl.h` (`ncclRemoteError`).
        name: &'static str,
        /// The code's description, from `ncclGetErrorString`.
        description: String,
        /// NCCL's message about the last error, from `ncclGetLastError` (may be empty).
        last_error: String,
    },
}

fn detail(last_error: &str) -> String {
    if last_error.is_empty() { String::new() } else { format!(" ({last_error})") }
}

impl NcclError {
    /// Describes `code`, returned by `call`, in NCCL's words.
    pub fn failed(call: &'static str, code: ncclResult_t) -> Self {
        // SAFETY: ncclGetErrorString takes any code and returns a static string (or NULL).
        let description = text(unsafe { super::ncclGetErrorString(code) })
            .unwrap_or_else(|| "NCCL has no description for this code".into());
        // SAFETY: the communicator argument is unused by NCCL (documented: it may be NULL); the
        // returned string lives in thread-local storage until the next NCCL call on this thread,
        // and is copied at once.
        let last_error = text(unsafe { super::ncclGetLastError(std::ptr::null_mut()) }).unwrap_or_default();
        NcclError::Call { call, code, name: result_name(code), description, last_error }
    }

    /// NCCL's result code, when a call was made.
    pub fn code(&self) -> Option<ncclResult_t> {
        match self {
            NcclError::Call { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// The name of `code` in `nccl.h`.
pub fn result_name(code: ncclResult_t) -> &'static str {
    match code {
        ncclResult_t::ncclSuccess => "ncclSuccess",
        ncclResult_t::ncclUnhandledCudaError => "ncclUnhandledCudaError",
        ncclResult_t::ncclSystemError => "ncclSystemError",
        ncclResult_t::ncclInternalError => "ncclInternalError",
        ncclResult_t::ncclInvalidArgument => "ncclInvalidArgument",
        ncclResult_t::ncclInvalidUsage => "ncclInvalidUsage",
        ncclResult_t::ncclRemoteError => "ncclRemoteError",
        ncclResult_t::ncclInProgress => "ncclInProgress",
        _ => "unknown ncclResult_t",
    }
}

fn text(pointer: Result<*const c_char, NcclError>) -> Option<String> {
    let pointer = pointer.ok().filter(|pointer| !pointer.is_null())?;
    // SAFETY: NCCL returned a NUL-terminated string that stays valid at least until the next NCCL
    // call on this thread; it is copied before any.
    Some(unsafe { CStr::from_ptr(pointer) }.to_string_lossy().into_owned())
}

/// Whether a call's outcome is complete or still running on a non-blocking communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The call has finished (`ncclSuccess`).
    Done,
    /// The call continues in the background (`ncclInProgress`, non-blocking communicators only):
    /// poll `ncclCommGetAsyncError` until it reports something else before the next call.
    InProgress,
}

/// Maps the outcome of a raw call named `call` to `Ok(())` on `ncclSuccess`; anything else,
/// `ncclInProgress` included, is an error. For calls on non-blocking communicators use
/// [`check_nonblocking`].
pub fn check(call: &'static str, result: Result<ncclResult_t, NcclError>) -> Result<(), NcclError> {
    match result? {
        ncclResult_t::ncclSuccess => Ok(()),
        code => Err(NcclError::failed(call, code)),
    }
}

/// Maps the outcome of a raw call named `call` on a non-blocking communicator: `ncclSuccess` and
/// `ncclInProgress` are the two [`Progress`] states, anything else an error.
pub fn check_nonblocking(call: &'static str, result: Result<ncclResult_t, NcclError>) -> Result<Progress, NcclError> {
    match result? {
        ncclResult_t::ncclSuccess => Ok(Progress::Done),
        ncclResult_t::ncclInProgress => Ok(Progress::InProgress),
        code => Err(NcclError::failed(call, code)),
    }
}

/// Calls an NCCL function and checks its result: `nccl!(ncclGroupStart())` is
/// `nccl::check("ncclGroupStart", nccl::ncclGroupStart())`. Use it inside an `unsafe` block, as the
/// function itself is unsafe.
#[macro_export]
macro_rules! nccl {
    ($function:ident($($arg:expr),* $(,)?)) => {
        $crate::nccl::check(stringify!($function), $crate::nccl::$function($($arg),*))
    };
}

/// Like [`nccl!`], for calls on non-blocking communicators: gives a [`Progress`] (`Done` or
/// `InProgress`) or the error.
#[macro_export]
macro_rules! nccl_nonblocking {
    ($function:ident($($arg:expr),* $(,)?)) => {
        $crate::nccl::check_nonblocking(stringify!($function), $crate::nccl::$function($($arg),*))
    };
}
