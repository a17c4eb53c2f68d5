//! `cargo xtask kernels`: compiles `kernels/cu/kernels.cu` with the pinned nvcc into the committed
//! `kernels/kernels.fatbin` (sm_80 and sm_90 machine code plus compute_90 PTX, which newer GPUs
//! JIT-compile). Committed so that no build of the workspace, or of a crate using it, needs nvcc;
//! `--check` (run by `cargo xtask test`) fails when the committed fatbin is not what the source
//! compiles to. nvcc's output is byte-for-byte reproducible for the same source and version.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{toolchain, workspace_root};

const SOURCE: &str = "kernels/cu/kernels.cu";
const OUTPUT: &str = "kernels/kernels.fatbin";
const TARGETS: &[&str] =
    &["arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"];

pub fn run(check: bool) -> Result<()> {
    let nvcc = nvcc()?;
    let fresh = std::env::temp_dir().join(format!("tq-kernels-{}.fatbin", std::process::id()));
    let mut command = Command::new(&nvcc);
    command.args(["--fatbin", "-O3", "-std=c++17"]);
    for target in TARGETS {
        command.args(["-gencode", target]);
    }
    command.arg("-o").arg(&fresh).arg(workspace_root().join(SOURCE));
    crate::run(&mut command)?;
    let built = std::fs::read(&fresh).with_context(|| format!("reading {}", fresh.display()))?;
    let _ = std::fs::remove_file(&fresh);
    let path = workspace_root().join(OUTPUT);
    if check {
        if std::fs::read(&path).unwrap_or_default() != built {
            bail!("{OUTPUT} is stale: run `cargo xtask kernels` and commit the result");
        }
        println!("xtask kernels: {OUTPUT} is up to date");
    } else {
        std::fs::write(&path, built)?;
        println!("xtask kernels: wrote {OUTPUT}");
    }
    Ok(())
}

/// `NVCC` if set, else the pinned toolchain's (installed by `cargo xtask setup`).
fn nvcc() -> Result<PathBuf> {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return Ok(PathBuf::from(nvcc));
    }
    toolchain::setup()?;
    toolchain::installed_nvcc()?.context("the pinned nvcc is missing after `cargo xtask setup`")
}
