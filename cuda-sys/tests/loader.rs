//! The loader's error paths, which run on any machine.

use cuda_sys::{Driver, Error, LoadError};

#[test]
fn a_missing_library_is_an_error_naming_what_was_tried() {
    let error = Driver::open(&["/nonexistent/libcuda.so.1", "libcuda-does-not-exist.so"])
        .err()
        .expect("a missing library must not load");
    match &error {
        LoadError::LibraryNotFound { tried, .. } => {
            assert!(tried.contains("/nonexistent/libcuda.so.1"), "{tried}");
            assert!(tried.contains("libcuda-does-not-exist.so"), "{tried}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(error.to_string().contains("CUDA_SYS_LIBCUDA"), "the message says what to do: {error}");
}

#[test]
fn a_missing_symbol_is_an_error_naming_it() {
    // The C library loads everywhere and has no CUDA functions.
    let libc = Driver::open(&["libc.so.6"]).expect("libc loads");
    assert_eq!(libc.path(), "libc.so.6");
    let error = libc.symbol("cuMemAlloc_v2").expect_err("libc has no cuMemAlloc_v2");
    assert!(matches!(error, LoadError::SymbolNotFound { symbol: "cuMemAlloc_v2", .. }));
    assert!(error.to_string().contains("cuMemAlloc_v2"));
    assert!(libc.symbol("malloc").is_ok());
}

#[test]
fn calls_without_a_driver_return_the_load_error() {
    let Err(load_error) = cuda_sys::library() else {
        eprintln!("skipped: a CUDA driver is installed here, so the no-driver path cannot be seen");
        return;
    };
    assert!(!cuda_sys::is_available());
    // SAFETY: cuInit has no pointer arguments.
    let result = unsafe { cuda_sys::driver!(cuInit(0)) };
    assert_eq!(result, Err(Error::Load(load_error.clone())));
    // The versioned alias resolves to the same wrapper and fails the same way.
    let mut pointer = 0;
    // SAFETY: `pointer` is a valid out-pointer; the call cannot reach a driver anyway.
    let result = unsafe { cuda_sys::driver!(cuMemAlloc(&mut pointer, 16)) };
    assert!(matches!(result, Err(Error::Load(LoadError::LibraryNotFound { .. }))));
}

#[test]
fn success_checks_to_ok() {
    assert_eq!(cuda_sys::check("cuInit", Ok(cuda_sys::CUresult::CUDA_SUCCESS)), Ok(()));
}

#[test]
fn nvml_without_the_library_is_an_error_for_each_call() {
    let Err(error) = cuda_sys::nvml::library() else {
        eprintln!("skipped: NVML is installed here, so the missing-library path cannot be seen");
        return;
    };
    assert!(error.to_string().contains("libnvidia-ml.so.1"), "{error}");
    // SAFETY: nvmlInit_v2 has no arguments.
    assert_eq!(unsafe { cuda_sys::nvml::nvmlInit_v2() }, Err(error));
}

#[test]
fn the_shared_loader_reports_a_missing_file_and_symbol() {
    use cuda_sys::shared_library::SharedLibrary;
    let reason = SharedLibrary::open("/nonexistent/libx.so").expect_err("no such file");
    assert!(reason.contains("/nonexistent/libx.so"), "{reason}");
    let libc = SharedLibrary::open("libc.so.6").expect("libc loads");
    assert!(libc.symbol("malloc").is_ok());
    assert!(libc.symbol("cuInit").is_err());
}
