//! The process-wide NCCL loader with `TQ_NCCL_LIBRARY` naming a file that does not exist. One
//! test in its own binary: the environment is set before anything reads it, and the loader's
//! answer is kept for the life of the process.

use cuda_sys::nccl::{self, LIBRARY_ENV, NcclError, ncclUniqueId};

#[test]
fn a_missing_nccl_is_an_error_that_says_how_to_install_it() {
    // SAFETY: this binary runs this one test; no other thread reads or writes the environment.
    unsafe { std::env::set_var(LIBRARY_ENV, "/nonexistent/libnccl.so.2") };
    let error = match nccl::library() {
        Err(error) => error,
        Ok(found) => {
            eprintln!("skipped: NCCL {} is installed here ({})", found.version(), found.path().display());
            return;
        }
    };
    let NcclError::LibraryNotFound { tried } = &error else { panic!("unexpected {error:?}") };
    assert!(tried[0].starts_with("/nonexistent/libnccl.so.2: "), "the variable's path comes first: {tried:?}");
    assert!(tried.iter().any(|line| line.starts_with("libnccl.so.2: ")), "{tried:?}");
    let message = error.to_string();
    assert!(message.contains("pip install nvidia-nccl-cu13") && message.contains(LIBRARY_ENV), "{message}");

    // Every call gives the same error, as a value.
    let mut id = ncclUniqueId::default();
    // SAFETY: `id` is a valid out-pointer; the call cannot reach NCCL anyway.
    let result = unsafe { cuda_sys::nccl!(ncclGetUniqueId(&mut id)) };
    assert_eq!(result, Err(error));
}
