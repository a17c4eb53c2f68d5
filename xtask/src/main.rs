//! `cargo xtask`: the project's automation, as ordinary Rust.
//!
//! Every command is safe to run on a fresh machine: `setup` installs what the others need.

mod audit;
mod bundle;
mod codegen;
mod kernels;
mod python;
mod toolchain;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Project automation for the CUDA tensor IPC workspace")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the pinned CUDA compiler (from PyPI) and libclang (for codegen).
    Setup,
    /// Regenerate `cuda-sys/src/bindings.rs` from the pinned `cuda.h`.
    Codegen {
        /// Fail if the committed bindings differ from freshly generated ones.
        #[arg(long)]
        check: bool,
    },
    /// Rebuild the committed `kernels/kernels.fatbin` from `kernels/cu/kernels.cu` with nvcc.
    Kernels {
        /// Fail if the committed fatbin differs from a fresh build.
        #[arg(long)]
        check: bool,
    },
    /// Check the dependency policy (`deny.toml`) with cargo-deny: advisories, licenses, bans, sources.
    Audit,
    /// Build every crate, test and example (debug).
    Build,
    /// Set up, then run everything that runs on this machine (the README's test command): the Rust
    /// tests, then the Python package built into a virtual environment and its pytest suite.
    Test,
    /// Build release GPU tests, examples and benchmarks into `target/gpu-bundle` with a run script.
    GpuBundle,
    /// Set up, then run the two-process demo (on the GPU where there is one, else host tensors).
    Demo,
    /// Build the GPU bundle, then run its benchmark suite here (`bench.sh`): tensor-queue against
    /// the anchors in one run, the table last, JSON and PNG plots in `--out`. Without a GPU it
    /// measures host tensors only.
    Bench {
        /// Where bench.json, latency.png, throughput.png and the primitive costs go.
        #[arg(long, default_value = "target/bench-results")]
        out: PathBuf,
        /// Options passed on to `tq-bench` (for example `--only rtt,stream --spin-us 0`).
        #[arg(last = true)]
        options: Vec<String>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Task::Setup => toolchain::setup(),
        Task::Codegen { check } => codegen::run(check),
        Task::Kernels { check } => kernels::run(check),
        Task::Audit => audit::run_audit(),
        Task::Build => cargo(&["build", "--workspace", "--all-targets"]),
        Task::Test => test(),
        Task::GpuBundle => bundle::build(),
        Task::Demo => {
            println!("xtask demo: building the demo (release; a few minutes on a fresh clone), then running it");
            cargo(&["run", "--release", "-p", "tensor-queue", "--example", "demo"])
        }
        Task::Bench { out, options } => {
            bundle::build()?;
            let script = workspace_root().join("target/gpu-bundle/bench.sh");
            run(Command::new("bash").arg(script).args(options).env("OUT", workspace_root().join(out)))
        }
    }
}

fn test() -> Result<()> {
    toolchain::setup()?;
    codegen::run(true)?;
    kernels::run(true)?;
    // The GPU test binaries note what they skipped here; one line sums it up at the end.
    let skips = workspace_root().join("target/gpu-skips.txt");
    let _ = std::fs::remove_file(&skips);
    let mut tests = cargo_command(&["test", "--workspace", "--all-targets"])?;
    run(tests.env("TQ_GPU_SKIPS", &skips))?;
    // Doc tests are not part of `--all-targets`.
    cargo(&["test", "--workspace", "--doc"])?;
    report_gpu_skips(&skips)?;
    python::test()
}

/// One line for every GPU test the run skipped, with the reason (the same for all of them).
fn report_gpu_skips(skips: &Path) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(skips) else { return Ok(()) };
    let mut count = 0;
    let mut reasons: Vec<&str> = Vec::new();
    for line in text.lines() {
        let (n, reason) = line.split_once('\t').context("a gpu-skips line without a tab")?;
        count += n.parse::<usize>()?;
        if !reasons.contains(&reason) {
            reasons.push(reason);
        }
    }
    println!("{count} GPU tests skipped: {}", reasons.join("; "));
    Ok(())
}

/// The workspace root (the parent of this crate's directory).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Runs cargo in the workspace root.
fn cargo(args: &[&str]) -> Result<()> {
    let mut command = cargo_command(args)?;
    run(&mut command)
}

fn cargo_command(args: &[&str]) -> Result<Command> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command.args(args).current_dir(workspace_root());
    Ok(command)
}

fn run(command: &mut Command) -> Result<()> {
    let status = command.status().with_context(|| format!("could not start {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed with {status}");
    }
    Ok(())
}
