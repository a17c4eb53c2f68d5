//! `tq`: tensor-queue's command-line tool.
//!
//! - `tq doctor [--json] [--measure] [--strict]`: what this machine can do, which route each
//!   pair of GPUs takes, and what to fix (tables on stdout, progress on stderr).
//! - `tq version`: the version.
//!
//! Exit status: 0, or 1 when `--strict` finds a route slower than its link allows or a broken
//! check, or 2 for a usage error or output that could not be written.

mod doctor;
mod engines;
mod gpus;
mod handles;
mod host;
mod pairs;
mod report;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// tensor-queue's command-line tool.
#[derive(Debug, Parser)]
#[command(name = "tq", version, about = "tensor-queue's command-line tool")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Says what this machine can do for tensor-queue, which route each pair of GPUs takes, and
    /// what to fix.
    Doctor(DoctorArgs),
    /// Prints tq's version.
    Version,
    /// The second process of `tq doctor`'s handle checks (started by `tq doctor` itself).
    #[command(hide = true)]
    DoctorChild,
}

/// `tq doctor`'s options.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print the report as JSON, for scripts.
    #[arg(long)]
    pub json: bool,
    /// Also measure copy bandwidth between GPUs and the cost of each handle kind (seconds).
    #[arg(long)]
    pub measure: bool,
    /// Exit 1 when any pair would take a slower route than its link allows or any check is
    /// broken (a deployment gate).
    #[arg(long)]
    pub strict: bool,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Doctor(args) => doctor::run(&args),
        Command::Version => {
            println!("tq {} (tensor-queue {})", env!("CARGO_PKG_VERSION"), env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Command::DoctorChild => handles::child_main(),
    }
}
