//! The process-wide driver loader with `CUDA_SYS_LIBCUDA` naming a file that does not exist.
//! One test in its own binary (the environment is read once per process). The named path is the
//! only one tried, so the answer is the same on a machine with a driver.

use cuda_sys::{Error, LIBRARY_ENV, LoadError};

#[test]
fn a_named_driver_that_does_not_load_is_the_error_never_replaced() {
    // SAFETY: this binary runs this one test; no other thread reads or writes the environment.
    unsafe { std::env::set_var(LIBRARY_ENV, "/nonexistent/libcuda.so.1") };
    let error = cuda_sys::library().err().expect("the named library does not exist, whatever else is installed");
    let LoadError::LibraryNotFound { tried, .. } = &error else { panic!("unexpected {error:?}") };
    assert_eq!(tried, "/nonexistent/libcuda.so.1", "only the named path is tried");
    assert!(!cuda_sys::is_available());
    // SAFETY: cuInit has no pointer arguments.
    assert_eq!(unsafe { cuda_sys::driver!(cuInit(0)) }, Err(Error::Load(error)));
}
