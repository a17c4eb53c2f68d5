//! Compiles `cu/kernels.cu` into one fatbin: sm_80 and sm_90 machine code plus compute_90 PTX
//! (which newer GPUs JIT-compile).
//!
//! nvcc is found through `NVCC`, `CUDA_HOME`/`CUDA_PATH`, `PATH`, or the pinned toolchain that
//! `cargo xtask setup` installs in `.toolchain/`.

use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE: &str = "cu/kernels.cu";
const TARGETS: &[&str] =
    &["arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"];

fn main() {
    for variable in ["NVCC", "CUDA_HOME", "CUDA_PATH", "PATH"] {
        println!("cargo::rerun-if-env-changed={variable}");
    }
    println!("cargo::rerun-if-changed={SOURCE}");
    let Some(nvcc) = find_nvcc() else {
        eprintln!(
            "error: nvcc (the CUDA compiler) was not found, and the `kernels` crate needs it.\n\
             Run `cargo xtask setup` to install the pinned CUDA 13.0.88 compiler from PyPI into \
             .toolchain/, or set NVCC (or CUDA_HOME) to an existing installation."
        );
        std::process::exit(1);
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("kernels.fatbin");
    let mut command = Command::new(&nvcc);
    command.args(["--fatbin", "-O3", "-std=c++17"]);
    for target in TARGETS {
        command.args(["-gencode", target]);
    }
    command.arg("-o").arg(&out).arg(SOURCE);
    let status = command.status().unwrap_or_else(|e| panic!("could not run {}: {e}", nvcc.display()));
    if !status.success() {
        eprintln!("error: {} failed to compile {SOURCE} ({status})", nvcc.display());
        std::process::exit(1);
    }
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return Some(PathBuf::from(nvcc));
    }
    for home in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = std::env::var_os(home) {
            let nvcc = Path::new(&dir).join("bin/nvcc");
            if nvcc.is_file() {
                return Some(nvcc);
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH")
        && let Some(nvcc) = std::env::split_paths(&path).map(|dir| dir.join("nvcc")).find(|p| p.is_file())
    {
        return Some(nvcc);
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.toolchain/venv/lib");
    std::fs::read_dir(lib)
        .ok()?
        .flatten()
        .map(|entry| entry.path().join("site-packages/nvidia/cu13/bin/nvcc"))
        .find(|nvcc| nvcc.is_file())
}
