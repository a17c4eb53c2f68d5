//! The Python package (`tensor-queue/python`): a virtual environment under `target/`, the package
//! built and installed into it with pip (maturin is its build backend), and its pytest suite.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::{run, workspace_root};

/// What the tests need besides the package (mypy for `stubtest`).
const TEST_PACKAGES: &[&str] = &["maturin>=1.16,<2", "numpy", "pytest", "mypy"];

/// The wheels the GPU bundle carries so that pytest runs there (the machine has no internet; its
/// torch does not bring NumPy, which the tests use).
pub const BUNDLE_TEST_WHEELS: &[&str] = &["pytest", "pluggy", "iniconfig", "packaging", "numpy"];

fn package_dir() -> PathBuf {
    workspace_root().join("tensor-queue/python")
}

fn venv_dir() -> PathBuf {
    workspace_root().join("target/python-venv")
}

fn venv_python() -> PathBuf {
    venv_dir().join("bin/python")
}

/// Makes the virtual environment and installs the test packages into it, once.
fn ensure_venv() -> Result<PathBuf> {
    let python = venv_python();
    if !python.is_file() {
        println!("python: creating a virtual environment in {}", venv_dir().display());
        run(Command::new("python3").args(["-m", "venv"]).arg(venv_dir()))?;
    }
    let stamp = venv_dir().join("tensor-queue-test-packages");
    let wanted = TEST_PACKAGES.join("\n");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
        println!("python: installing {} into it with pip", TEST_PACKAGES.join(", "));
        run(Command::new(&python).args(["-m", "pip", "install", "--quiet", "--upgrade"]).args(TEST_PACKAGES))?;
        std::fs::write(&stamp, wanted).context("writing the package stamp")?;
    }
    Ok(python)
}

/// Builds and installs the package with pip (as a user would), then runs its tests with pytest.
pub fn test() -> Result<()> {
    let python = ensure_venv()?;
    println!("python: building and installing tensor-queue/python with pip (maturin builds the extension)");
    run(Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps"])
        .arg(package_dir())
        .current_dir(workspace_root()))?;
    println!("python: running pytest on tensor-queue/python/tests");
    // The hostile peer of `tests/test_hostile.py`, built by the workspace's tests before this.
    run(Command::new(&python)
        .args(["-m", "pytest", "-q", "-rs"])
        .arg(package_dir().join("tests"))
        .env("TQ_HOSTILE", workspace_root().join("target/debug/tq-hostile"))
        .current_dir(workspace_root()))
}

/// Builds the abi3 test wheel (release, with the `test-switches` feature that the GPU tests'
/// negative controls need; a wheel for users is built without it: `pip install
/// ./tensor-queue/python`) into `out` and downloads the pytest wheels the bundle needs (for the
/// GPU machine's Python 3.12) into `out/test-wheels`.
pub fn bundle_wheels(out: &Path) -> Result<()> {
    let python = ensure_venv()?;
    println!("python: building the abi3 test wheel (release, feature test-switches) with maturin");
    run(Command::new(&python)
        .args(["-m", "maturin", "build", "--release", "--quiet", "-m"])
        .arg(package_dir().join("Cargo.toml"))
        .args(["--features", "test-switches,pyo3/extension-module"])
        .arg("--out")
        .arg(out)
        .current_dir(workspace_root()))?;
    let wheels = out.join("test-wheels");
    if !wheels.is_dir() {
        println!("python: downloading the pytest wheels for Python 3.12");
        run(Command::new(&python)
            .args(["-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", "3.12", "--dest"])
            .arg(&wheels)
            .args(BUNDLE_TEST_WHEELS))?;
    }
    Ok(())
}
