//! What is installed: the CUDA driver API version, and whether an NVIDIA library loads.
//!
//! For tools such as `tq doctor`, which report what a machine can do without assuming a GPU.

use std::fmt;
use std::path::PathBuf;

use cuda_sys::driver;

use crate::Result;

/// The CUDA driver API version (`cuDriverGetVersion`): the newest CUDA the driver supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DriverVersion {
    /// Major version (12 for CUDA 12.4).
    pub major: i32,
    /// Minor version (4 for CUDA 12.4).
    pub minor: i32,
}

impl DriverVersion {
    /// Decodes the driver's integer (`1000 * major + 10 * minor`).
    ///
    /// ```
    /// use ipc_core::driver_info::DriverVersion;
    /// assert_eq!(DriverVersion::decode(12040).to_string(), "12.4");
    /// ```
    pub fn decode(raw: i32) -> DriverVersion {
        DriverVersion { major: raw / 1000, minor: (raw % 1000) / 10 }
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The CUDA driver API version. It needs the driver library but not a GPU (no `cuInit`);
/// without the library it is the loader's error.
pub fn driver_version() -> Result<DriverVersion> {
    let mut raw = 0;
    // SAFETY: `raw` is a valid out-pointer; the call has no other arguments.
    unsafe { driver!(cuDriverGetVersion(&mut raw)) }?;
    Ok(DriverVersion::decode(raw))
}

/// A shared library that did not load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name} does not load: {reason}")]
pub struct LibraryMissing {
    /// The name or path that was tried.
    pub name: String,
    /// What the dynamic loader said.
    pub reason: String,
}

/// Whether the NVIDIA library `name` (a file name the dynamic loader searches for, such as
/// `libnccl.so.2`, or a path) loads here, and if so the file it loaded, as `/proc/self/maps`
/// names it (where that is readable; else `name`). The library is unloaded again.
///
/// Loading runs the library's initialisers: use it for NVIDIA's libraries (NCCL, NVML), which
/// are trusted like the driver itself, not for arbitrary files.
pub fn probe_nvidia_library(name: &str) -> std::result::Result<PathBuf, LibraryMissing> {
    let library = cuda_sys::shared_library::SharedLibrary::open(name)
        .map_err(|reason| LibraryMissing { name: name.to_string(), reason })?;
    let path = loaded_path(name).unwrap_or_else(|| PathBuf::from(name));
    drop(library);
    Ok(path)
}

/// The file mapped into this process whose name starts like `name`'s (before `.so`).
fn loaded_path(name: &str) -> Option<PathBuf> {
    let file_name = std::path::Path::new(name).file_name()?.to_str()?;
    let stem = file_name.split(".so").next().filter(|stem| !stem.is_empty())?;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().filter_map(|line| line.split_whitespace().nth(5)).map(PathBuf::from).find(|path| {
        path.file_name()
            .and_then(|f| f.to_str())
            .is_some_and(|f| f.strip_prefix(stem).is_some_and(|rest| rest.starts_with(".so")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode() {
        assert_eq!(DriverVersion::decode(12080), DriverVersion { major: 12, minor: 8 });
        assert_eq!(DriverVersion::decode(11020).to_string(), "11.2");
    }

    #[test]
    fn a_missing_library_is_an_error_not_a_panic() {
        let missing = probe_nvidia_library("libtq-doctor-no-such-library.so.9").unwrap_err();
        assert!(missing.to_string().contains("libtq-doctor-no-such-library.so.9"), "{missing}");
    }

    #[test]
    fn a_loaded_library_is_found_by_its_stem() {
        // libc is mapped into every process under a versioned name.
        let path = loaded_path("libc.so.6").expect("libc is mapped");
        assert!(path.to_string_lossy().contains("libc"), "{path:?}");
    }
}
