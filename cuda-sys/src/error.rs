//! Errors of driver calls: the `CUresult` with the driver's own name and description of it.

use std::ffi::{CStr, c_char};

use crate::{CUresult, LoadError};

/// A driver call returned something other than `CUDA_SUCCESS`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed with {name} ({}): {description}", code.0)]
pub struct DriverError {
    /// The driver function that failed.
    pub call: &'static str,
    /// The result code.
    pub code: CUresult,
    /// The code's name, from `cuGetErrorName` (`CUDA_ERROR_INVALID_VALUE`).
    pub name: String,
    /// The code's description, from `cuGetErrorString`.
    pub description: String,
}

impl DriverError {
    /// Describes `code`, returned by `call`, in the driver's words.
    pub fn new(call: &'static str, code: CUresult) -> Self {
        let name = describe(code, crate::cuGetErrorName).unwrap_or_else(|| "unknown CUresult".into());
        let description = describe(code, crate::cuGetErrorString)
            .unwrap_or_else(|| "the driver has no description for this code".into());
        DriverError { call, code, name, description }
    }
}

type Describer = unsafe fn(CUresult, *mut *const c_char) -> Result<CUresult, LoadError>;

fn describe(code: CUresult, describer: Describer) -> Option<String> {
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: `text` is a valid out-pointer; the driver writes a pointer to a static string.
    let result = unsafe { describer(code, &mut text) };
    if result != Ok(CUresult::CUDA_SUCCESS) || text.is_null() {
        return None;
    }
    // SAFETY: on success the driver set `text` to a NUL-terminated string with static lifetime.
    Some(unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
}

/// A driver call that could not be made or that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The library or the function could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The driver returned an error code.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

impl Error {
    /// The driver's result code, when the call was made.
    pub fn code(&self) -> Option<CUresult> {
        match self {
            Error::Driver(error) => Some(error.code),
            Error::Load(_) => None,
        }
    }
}

/// Maps the outcome of a raw call named `call` to `Ok(())` on `CUDA_SUCCESS`.
pub fn check(call: &'static str, result: Result<CUresult, LoadError>) -> Result<(), Error> {
    match result? {
        CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(DriverError::new(call, code).into()),
    }
}

/// Calls a driver function and checks its result: `driver!(cuInit(0))` is
/// `check("cuInit", cuInit(0))`. Use it inside an `unsafe` block, as the function itself is unsafe.
#[macro_export]
macro_rules! driver {
    ($function:ident($($arg:expr),* $(,)?)) => {
        $crate::check(stringify!($function), $crate::$function($($arg),*))
    };
}
