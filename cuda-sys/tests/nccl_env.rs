//! The process-wide NCCL loader with `TQ_NCCL_LIBRARY` naming a file that does not exist. One
//! test in its own binary: the environment is set before anything reads it, and the loader's
//! answer is kept for the life of the process. The named path is the only one tried, so the
//! answer is the same on a machine where NCCL is installed (the system's is never taken instead).

use cuda_sys::nccl::{self, LIBRARY_ENV, NcclError, ncclUniqueId};

#[test]
fn a_named_nccl_that_does_not_load_is_the_error_never_replaced() {
    // SAFETY: this binary runs this one test; no other thread reads or writes the environment.
    unsafe { std::env::set_var(LIBRARY_ENV, "/nonexistent/libnccl.so.2") };
    let error = nccl::library().expect_err("the named library does not exist, whatever else is installed");
    let NcclError::NamedLibraryNotLoaded { variable, path, .. } = &error else { panic!("unexpected {error:?}") };
    assert_eq!((*variable, path.as_str()), (LIBRARY_ENV, "/nonexistent/libnccl.so.2"));
    let message = error.to_string();
    assert!(message.contains("/nonexistent/libnccl.so.2") && message.contains("unset it"), "{message}");

    // Every call gives the same error, as a value.
    let mut id = ncclUniqueId::default();
    // SAFETY: `id` is a valid out-pointer; the call cannot reach NCCL anyway.
    let result = unsafe { cuda_sys::nccl!(ncclGetUniqueId(&mut id)) };
    assert_eq!(result, Err(error));
}
