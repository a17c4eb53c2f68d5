//! NCCL's loader, version check and config on any machine: no GPU is needed, and NCCL itself only
//! for the test that loads the pinned one `cargo xtask setup` installs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use cuda_sys::nccl::{
    self, Candidate, HEADER_VERSION, LIBRARY_CANDIDATES, LIBRARY_ENV, MINIMUM_VERSION, NcclError, NcclLibrary, Version,
    WHEEL_LIBRARY, ncclConfig_t, ncclResult_t,
};

fn no_env(_: &str) -> Option<OsString> {
    None
}

#[test]
fn version_numbers_decode_in_both_schemes() {
    assert_eq!(Version::from_code(22803), Some(Version::new(2, 28, 3)));
    assert_eq!(Version::from_code(21903), Some(Version::new(2, 19, 3)));
    assert_eq!(Version::from_code(20900), Some(Version::new(2, 9, 0)));
    // Before 2.9: major*1000 + minor*100 + patch.
    assert_eq!(Version::from_code(2804), Some(Version::new(2, 8, 4)));
    assert_eq!(Version::from_code(-1), None);
    for version in [Version::new(2, 8, 4), Version::new(2, 19, 0), Version::new(2, 28, 3), Version::new(3, 0, 1)] {
        assert_eq!(Version::from_code(version.code() as i32), Some(version), "{version}");
    }
    assert_eq!(MINIMUM_VERSION.code(), 21900);
    assert!(Version::new(2, 18, 6) < MINIMUM_VERSION && MINIMUM_VERSION <= HEADER_VERSION);
    assert!(Version::new(2, 9, 0) > Version::new(2, 8, 4));
    assert_eq!(Version::new(2, 28, 3).to_string(), "2.28.3");
    assert_eq!(HEADER_VERSION.code(), nccl::NCCL_VERSION_CODE);
}

#[test]
fn candidates_are_the_variable_then_the_loader_then_python() {
    assert_eq!(LIBRARY_ENV, "TQ_NCCL_LIBRARY");
    assert_eq!(
        &LIBRARY_CANDIDATES[..3],
        &[
            Candidate::PathInEnv(LIBRARY_ENV),
            Candidate::LoaderName("libnccl.so.2"),
            Candidate::LoaderName("libnccl.so")
        ]
    );
    assert_eq!(LIBRARY_CANDIDATES[3], Candidate::PythonPrefix { variable: "VIRTUAL_ENV", relative: WHEEL_LIBRARY });
    assert_eq!(LIBRARY_CANDIDATES.last(), Some(&Candidate::SitePackages { relative: WHEEL_LIBRARY }));
    assert_eq!(WHEEL_LIBRARY, "nvidia/nccl/lib/libnccl.so.2");
}

#[test]
fn a_missing_library_lists_every_candidate_in_order_and_says_how_to_install() {
    let candidates = [
        Candidate::PathInEnv("CUDA_SYS_TEST_UNSET"),
        Candidate::LoaderName("/nonexistent/libnccl.so.2"),
        Candidate::LoaderName("libnccl-does-not-exist.so"),
    ];
    let error = NcclLibrary::open_in(&candidates, &no_env).expect_err("nothing to load");
    let NcclError::LibraryNotFound { tried } = &error else { panic!("unexpected {error:?}") };
    assert_eq!(tried.len(), 3, "{tried:?}");
    assert!(tried[0].contains("CUDA_SYS_TEST_UNSET is not set"), "{tried:?}");
    assert!(tried[1].starts_with("/nonexistent/libnccl.so.2: "), "{tried:?}");
    assert!(tried[2].starts_with("libnccl-does-not-exist.so: "), "{tried:?}");
    let message = error.to_string();
    assert!(message.contains("pip install nvidia-nccl-cu13"), "{message}");
    assert!(message.contains(LIBRARY_ENV), "{message}");
    assert!(message.contains("2.19.0"), "{message}");
}

#[test]
fn the_variable_pointing_at_a_library_that_is_not_nccl_is_a_missing_symbol() {
    // The real candidate list, with TQ_NCCL_LIBRARY naming the C library: it opens, so it is the
    // one used, and it has no ncclGetVersion.
    let env = |name: &str| (name == LIBRARY_ENV).then(|| OsString::from("libc.so.6"));
    let error = NcclLibrary::open_in(LIBRARY_CANDIDATES, &env).expect_err("libc is not NCCL");
    let NcclError::SymbolNotFound { symbol, library, .. } = &error else { panic!("unexpected {error:?}") };
    assert_eq!((*symbol, library.as_str()), ("ncclGetVersion", "libc.so.6"));
    let message = error.to_string();
    assert!(message.contains("ncclGetVersion") && message.contains("pip install nvidia-nccl-cu13"), "{message}");
}

#[test]
fn a_named_library_that_does_not_load_is_not_replaced_by_one_that_does() {
    // The variable names a file that does not exist, and a later candidate (the C library)
    // opens: the named one is the answer, as a broken library, and the later one is not tried
    // (it would be a missing ncclGetVersion).
    let candidates = [Candidate::PathInEnv(LIBRARY_ENV), Candidate::LoaderName("libc.so.6")];
    let env = |name: &str| (name == LIBRARY_ENV).then(|| OsString::from("/nonexistent/libnccl.so.2"));
    let error = NcclLibrary::open_in(&candidates, &env).expect_err("the named library does not exist");
    let NcclError::NamedLibraryNotLoaded { variable, path, reason } = &error else { panic!("unexpected {error:?}") };
    assert_eq!((*variable, path.as_str()), (LIBRARY_ENV, "/nonexistent/libnccl.so.2"));
    assert!(!reason.is_empty());
    // The real candidate list, with NCCL installed here or not, says the same.
    let error = NcclLibrary::open_in(LIBRARY_CANDIDATES, &env).expect_err("the named library does not exist");
    assert!(matches!(error, NcclError::NamedLibraryNotLoaded { .. }), "{error:?}");
    // An empty variable names nothing: the search goes on.
    let empty = |name: &str| (name == LIBRARY_ENV).then(OsString::new);
    let error = NcclLibrary::open_in(&candidates, &empty).expect_err("libc is not NCCL");
    assert!(matches!(error, NcclError::SymbolNotFound { symbol: "ncclGetVersion", .. }), "{error:?}");
}

#[test]
fn later_candidates_are_tried_when_earlier_ones_do_not_load() {
    let candidates = [Candidate::LoaderName("/nonexistent/libnccl.so.2"), Candidate::LoaderName("libc.so.6")];
    let error = NcclLibrary::open_in(&candidates, &no_env).expect_err("libc is not NCCL");
    assert!(matches!(error, NcclError::SymbolNotFound { symbol: "ncclGetVersion", .. }), "{error:?}");
}

#[test]
fn a_python_environment_is_searched_where_pip_puts_the_wheel() {
    let prefix = std::env::temp_dir().join(format!("cuda-sys-nccl-test-{}", std::process::id()));
    let library = prefix.join("lib/python3.12/site-packages").join(WHEEL_LIBRARY);
    std::fs::create_dir_all(library.parent().unwrap()).unwrap();
    std::fs::write(&library, b"").unwrap();
    let candidate = Candidate::PythonPrefix { variable: "TEST_PREFIX", relative: WHEEL_LIBRARY };
    let env = |name: &str| (name == "TEST_PREFIX").then(|| prefix.clone().into_os_string());
    assert_eq!(candidate.paths(&env), Ok(vec![library.clone()]));
    let reason = candidate.paths(&no_env).expect_err("the variable is not set");
    assert!(reason.contains("TEST_PREFIX is not set"), "{reason}");
    std::fs::remove_file(&library).unwrap();
    let reason = candidate.paths(&env).expect_err("the file is gone");
    assert!(reason.contains("no nvidia/nccl/lib/libnccl.so.2"), "{reason}");
    std::fs::remove_dir_all(&prefix).unwrap();
}

#[test]
fn a_too_old_version_names_both_versions() {
    let error = NcclError::VersionTooOld {
        found: Version::new(2, 18, 5),
        required: MINIMUM_VERSION,
        library: "/opt/old/libnccl.so.2".into(),
    };
    let message = error.to_string();
    for part in ["2.18.5", "2.19.0", "/opt/old/libnccl.so.2", "pip install nvidia-nccl-cu13"] {
        assert!(message.contains(part), "{part} missing from: {message}");
    }
}

#[test]
fn the_config_initializer_is_nccl_config_initializer() {
    let config = ncclConfig_t::initializer();
    assert_eq!(config.size, size_of::<ncclConfig_t>());
    assert_eq!(config.magic, 0xcafe_beef);
    assert_eq!(config.version, 22803);
    assert_eq!((config.blocking, config.minCTAs, config.nvlinkCentricSched), (i32::MIN, i32::MIN, i32::MIN));
    assert!(config.netName.is_null() && config.commName.is_null());
    assert_eq!(ncclConfig_t::default().magic, config.magic);
}

#[test]
fn success_and_progress_check_as_expected() {
    assert_eq!(nccl::check("ncclGroupStart", Ok(ncclResult_t::ncclSuccess)), Ok(()));
    assert_eq!(nccl::check_nonblocking("ncclSend", Ok(ncclResult_t::ncclSuccess)), Ok(nccl::Progress::Done));
    assert_eq!(nccl::check_nonblocking("ncclSend", Ok(ncclResult_t::ncclInProgress)), Ok(nccl::Progress::InProgress));
    assert_eq!(nccl::result_name(ncclResult_t::ncclRemoteError), "ncclRemoteError");
}

/// The `libnccl.so.2` that `cargo xtask setup` installs with the pinned header, if it has run.
fn pinned_library() -> Option<PathBuf> {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.toolchain/venv/lib");
    std::fs::read_dir(lib)
        .ok()?
        .flatten()
        .map(|entry| entry.path().join("site-packages").join(WHEEL_LIBRARY))
        .find(|path| path.is_file())
}

#[test]
fn the_pinned_nccl_loads_and_reports_its_version() {
    let Some(path) = pinned_library() else {
        eprintln!("skipped: no pinned NCCL under .toolchain (run `cargo xtask setup`)");
        return;
    };
    let library = NcclLibrary::open_path(&path).expect("the pinned NCCL loads without a GPU");
    assert_eq!(library.path(), path);
    assert_eq!(library.version(), HEADER_VERSION);
    assert!(library.symbol("ncclCommInitRankConfig").is_ok());
    let error = library.symbol("ncclNoSuchFunction").expect_err("not in NCCL");
    assert!(matches!(error, NcclError::SymbolNotFound { symbol: "ncclNoSuchFunction", .. }));
}
