//! The driver and the GPUs this process sees.

use serde::Serialize;
use tensor_queue::{Device, is_gpu_available};

use crate::verdict::{Check, Verdict};

/// One GPU as this process sees it.
#[derive(Clone, Debug, Serialize)]
pub struct GpuRow {
    /// This process's ordinal for it (under the current `CUDA_VISIBLE_DEVICES`).
    pub ordinal: i32,
    /// Its UUID, as `nvidia-smi -L` prints it.
    pub uuid: String,
    /// Its name.
    pub name: String,
    /// Its memory in bytes.
    pub memory_bytes: u64,
}

/// The driver and the GPUs.
#[derive(Clone, Debug, Serialize)]
pub struct GpuFacts {
    /// Whether a driver and at least one GPU are usable here.
    pub available: bool,
    /// The NVIDIA kernel driver's version (`/proc/driver/nvidia/version`), where readable.
    pub driver_version: Option<String>,
    /// The CUDA driver API version (`cuDriverGetVersion`), where the driver loads.
    pub cuda_driver_api_version: Option<String>,
    /// The rows: driver, CUDA driver API, GPUs.
    pub checks: Vec<Check>,
    /// The GPUs, by ordinal.
    pub devices: Vec<GpuRow>,
}

const NO_GPU_FIX: &str = "no GPU here: tensor-queue sends host tensors only. To use GPUs, install the NVIDIA driver \
                          (in a container: run it with --gpus all or the NVIDIA container toolkit)";

/// Asks the driver what is here. Never fails: what cannot be read is a row that says so.
pub fn facts() -> GpuFacts {
    let driver_version = kernel_driver_version();
    let cuda = ipc_core::driver_info::driver_version();
    let available = is_gpu_available();
    let mut checks = Vec::new();
    checks.push(match &driver_version {
        Some(version) => Check::ok("NVIDIA driver", version.clone()),
        // GPUs that work without the file (WSL, some sandboxes): only the version is unknown.
        None if available => Check::ok("NVIDIA driver", "version unknown (/proc/driver/nvidia/version is absent)"),
        None => {
            Check::flagged("NVIDIA driver", "not loaded (no /proc/driver/nvidia/version)", Verdict::Skipped, NO_GPU_FIX)
        }
    });
    let named = std::env::var_os(cuda_sys::LIBRARY_ENV).filter(|path| !path.is_empty());
    let named = named.map(|path| path.to_string_lossy().into_owned());
    checks.push(driver_api_check(named.as_deref(), cuda.as_ref().map(|v| v.to_string()).map_err(|e| e.to_string())));
    let mut devices = Vec::new();
    if available {
        match gpu_rows() {
            Ok(rows) => {
                checks.push(Check::ok("GPUs", format!("{} visible", rows.len())));
                devices = rows;
            }
            Err(error) => checks.push(Check::flagged(
                "GPUs",
                format!("the driver could not list them: {error}"),
                Verdict::Broken,
                "check `nvidia-smi`; a driver/library version mismatch needs a reboot or a matching libcuda",
            )),
        }
    } else if named.is_some() && cuda.is_err() {
        let value = format!("none: the driver library {} names does not load", cuda_sys::LIBRARY_ENV);
        checks.push(Check::flagged("GPUs", value, Verdict::Skipped, NO_GPU_FIX));
    } else if cuda.is_ok() {
        checks.push(Check::flagged("GPUs", "none usable (cuInit fails)", Verdict::Skipped, NO_GPU_FIX));
    } else {
        checks.push(Check::flagged("GPUs", "none: no CUDA driver here", Verdict::Skipped, NO_GPU_FIX));
    }
    GpuFacts { available, driver_version, cuda_driver_api_version: cuda.ok().map(|v| v.to_string()), checks, devices }
}

/// The CUDA driver API row, from the library `CUDA_SYS_LIBCUDA` names (`named`; `None`: the
/// variable is unset) and what asking its version gave. A library the user named that does not
/// load is broken (the loader never replaces it with the system's); without the variable, no
/// driver only means no GPU here.
fn driver_api_check(named: Option<&str>, version: Result<String, String>) -> Check {
    let name = "CUDA driver API";
    match (version, named) {
        (Ok(version), None) => Check::ok(name, version),
        (Ok(version), Some(path)) => {
            Check::ok(name, format!("{version} (from {path}, named by {})", cuda_sys::LIBRARY_ENV))
        }
        (Err(error), Some(path)) => Check::flagged(
            name,
            format!("{}={path} does not load: {error}", cuda_sys::LIBRARY_ENV),
            Verdict::Broken,
            format!(
                "point {} at the NVIDIA driver's libcuda.so.1, or unset it to use the system's",
                cuda_sys::LIBRARY_ENV
            ),
        ),
        // The loader's first clause names what was tried; the rest (how to fix it) is the fix.
        (Err(error), None) => {
            let short = error.split_once(": ").map_or(error.as_str(), |(first, _)| first);
            Check::flagged(name, short.to_string(), Verdict::Skipped, NO_GPU_FIX)
        }
    }
}

fn gpu_rows() -> ipc_core::Result<Vec<GpuRow>> {
    Device::all()?
        .into_iter()
        .map(|device| {
            Ok(GpuRow {
                ordinal: device.ordinal(),
                uuid: device.uuid()?.to_string(),
                name: device.name()?,
                memory_bytes: device.total_memory()? as u64,
            })
        })
        .collect()
}

/// The version in `/proc/driver/nvidia/version` ("NVRM version: NVIDIA UNIX x86_64 Kernel
/// Module  550.54.15  ...").
fn kernel_driver_version() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    parse_kernel_driver_version(&text)
}

fn parse_kernel_driver_version(text: &str) -> Option<String> {
    let first = text.lines().next()?;
    let version = first.split_whitespace().find(|word| {
        word.contains('.') && word.split('.').all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
    });
    Some(version.unwrap_or(first.trim()).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_kernel_modules_version() {
        let text = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\nGCC version: gcc 12\n";
        assert_eq!(parse_kernel_driver_version(text).as_deref(), Some("550.54.15"));
        assert_eq!(parse_kernel_driver_version("odd line").as_deref(), Some("odd line"));
    }

    #[test]
    fn a_named_driver_library_that_does_not_load_is_broken() {
        let failed = || Err("the CUDA driver library could not be loaded (tried /x/libcuda.so.1): no such file".into());
        let named = driver_api_check(Some("/x/libcuda.so.1"), failed());
        assert_eq!(named.verdict, Verdict::Broken);
        assert!(named.value.starts_with("CUDA_SYS_LIBCUDA=/x/libcuda.so.1 does not load"), "{}", named.value);
        assert!(named.fix.unwrap().contains("CUDA_SYS_LIBCUDA"));
        assert_eq!(driver_api_check(None, failed()).verdict, Verdict::Skipped, "no driver: no GPU, not broken");
        assert_eq!(driver_api_check(Some("/x/libcuda.so.1"), Ok("12.4".into())).verdict, Verdict::Ok);
    }

    #[test]
    fn without_a_gpu_nothing_is_broken() {
        let facts = facts();
        // A CUDA_SYS_LIBCUDA that does not load is broken on purpose (see above).
        if !facts.available && std::env::var_os(cuda_sys::LIBRARY_ENV).is_none() {
            assert!(facts.checks.iter().all(|c| c.verdict != Verdict::Broken), "{:?}", facts.checks);
            assert!(facts.devices.is_empty());
        }
    }
}
