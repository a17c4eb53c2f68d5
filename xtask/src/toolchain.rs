//! The pinned CUDA toolchain: nvcc and `cuda.h` from PyPI, `nccl.h` from PyPI, libclang from Debian.
//!
//! nvcc 13.0.88 matches the GPU machine's 13.0 driver: a newer nvcc emits PTX that driver rejects,
//! and `nvidia-nvvm` must be pinned too or pip pulls a newer one that ptxas refuses.
//!
//! NCCL 2.28.3 is the version torch ships on the GPU machine. Its wheel is installed into the same
//! virtual environment with its own stamp, so changing one pin does not reinstall the other; the
//! wheel also brings `libnccl.so.2`, which the loader tests use where it is present.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{run, workspace_root};

/// The PyPI packages that make up the compiler, pinned.
const PINNED_PACKAGES: &[&str] =
    &["nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88", "nvidia-cuda-crt==13.0.88", "nvidia-cuda-runtime==13.0.96"];

/// The PyPI package whose `include/nccl.h` the NCCL bindings are generated from, pinned.
const PINNED_NCCL_PACKAGE: &str = "nvidia-nccl-cu13==2.28.3";

fn toolchain_dir() -> PathBuf {
    workspace_root().join(".toolchain")
}

fn venv_dir() -> PathBuf {
    toolchain_dir().join("venv")
}

/// `nvidia/cu13` inside the virtual environment, whatever its Python version.
fn cuda_root() -> Result<Option<PathBuf>> {
    let lib = venv_dir().join("lib");
    if !lib.is_dir() {
        return Ok(None);
    }
    for entry in std::fs::read_dir(&lib)? {
        let candidate = entry?.path().join("site-packages/nvidia/cu13");
        if candidate.join("bin/nvcc").is_file() {
            return Ok(Some(candidate));
        }
    }
    Ok(None)
}

/// The nvcc that `setup` installed, if any.
pub fn installed_nvcc() -> Result<Option<PathBuf>> {
    Ok(cuda_root()?.map(|root| root.join("bin/nvcc")))
}

/// The directory holding the pinned `cuda.h`.
pub fn cuda_include_dir() -> Result<PathBuf> {
    match cuda_root()? {
        Some(root) => Ok(root.join("include")),
        None => bail!("the pinned CUDA headers are not installed: run `cargo xtask setup`"),
    }
}

/// `nvidia/nccl` inside the virtual environment, whatever its Python version.
fn nccl_root() -> Result<Option<PathBuf>> {
    let lib = venv_dir().join("lib");
    if !lib.is_dir() {
        return Ok(None);
    }
    for entry in std::fs::read_dir(&lib)? {
        let candidate = entry?.path().join("site-packages/nvidia/nccl");
        if candidate.join("include/nccl.h").is_file() {
            return Ok(Some(candidate));
        }
    }
    Ok(None)
}

/// The directory holding the pinned `nccl.h`.
pub fn nccl_include_dir() -> Result<PathBuf> {
    match nccl_root()? {
        Some(root) => Ok(root.join("include")),
        None => bail!("the pinned NCCL header is not installed: run `cargo xtask setup`"),
    }
}

/// Installs the pinned compiler and NCCL header (each skipped when its installed pin matches) and
/// libclang.
pub fn setup() -> Result<()> {
    let stamp = toolchain_dir().join("pins");
    let wanted = PINNED_PACKAGES.join("\n");
    let current = std::fs::read_to_string(&stamp).unwrap_or_default();
    if current != wanted || installed_nvcc()?.is_none() {
        install_cuda_packages()?;
        std::fs::write(&stamp, &wanted)?;
    }
    let nvcc = installed_nvcc()?.context("nvcc missing after installation")?;
    println!("xtask setup: nvcc at {}", nvcc.display());
    // Installing the compiler recreates the environment, which removes NCCL: the header check
    // below sees that.
    let nccl_stamp = toolchain_dir().join("nccl-pin");
    let current = std::fs::read_to_string(&nccl_stamp).unwrap_or_default();
    if current != PINNED_NCCL_PACKAGE || nccl_root()?.is_none() {
        install_nccl_package()?;
        std::fs::write(&nccl_stamp, PINNED_NCCL_PACKAGE)?;
    }
    println!("xtask setup: nccl.h in {}", nccl_include_dir()?.display());
    ensure_libclang()
}

fn install_cuda_packages() -> Result<()> {
    let venv = venv_dir();
    std::fs::create_dir_all(toolchain_dir())?;
    println!("xtask setup: installing {} into {}", PINNED_PACKAGES.join(" "), venv.display());
    run(Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv))
        .context("python3 with the venv module is needed to install the CUDA compiler")?;
    run(Command::new(venv.join("bin/pip"))
        .args(["install", "--progress-bar", "off", "--disable-pip-version-check"])
        .args(PINNED_PACKAGES))
}

fn install_nccl_package() -> Result<()> {
    println!("xtask setup: installing {PINNED_NCCL_PACKAGE} into {}", venv_dir().display());
    // `python -m pip`, not the `pip` script: the script's first line names the interpreter of the
    // environment it was installed in, which is wrong for an environment that was moved or copied.
    run(Command::new(venv_dir().join("bin/python")).args([
        "-m",
        "pip",
        "install",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "--no-deps",
        PINNED_NCCL_PACKAGE,
    ]))
}

/// bindgen loads libclang at run time; Debian's `libclang-dev` provides it.
fn ensure_libclang() -> Result<()> {
    if libclang_present() {
        return Ok(());
    }
    if !Path::new("/usr/bin/apt-get").exists() {
        bail!("libclang is missing: install your system's libclang (Debian: libclang-dev)");
    }
    println!("xtask setup: installing libclang-dev with apt-get");
    let as_root = is_root();
    let mut update = apt_command(as_root);
    run(update.args(["update", "-qq"]))?;
    let mut install = apt_command(as_root);
    run(install.args(["install", "-y", "-qq", "libclang-dev"]))?;
    if !libclang_present() {
        bail!("libclang-dev installed but no libclang.so found under /usr/lib");
    }
    Ok(())
}

fn apt_command(as_root: bool) -> Command {
    let mut command = if as_root {
        Command::new("apt-get")
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg("apt-get");
        sudo
    };
    command.env("DEBIAN_FRONTEND", "noninteractive");
    command
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|out| out.stdout.trim_ascii() == b"0").unwrap_or(false)
}

fn libclang_present() -> bool {
    if std::env::var_os("LIBCLANG_PATH").is_some() {
        return true;
    }
    let Ok(entries) = std::fs::read_dir("/usr/lib") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name();
        name.to_string_lossy().starts_with("llvm-") && entry.path().join("lib/libclang.so").exists()
    })
}
