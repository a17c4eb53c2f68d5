//! `tq`: tensor-queue's command-line tool.
//!
//! - `tq doctor [--json] [--measure] [--strict]`: what this machine can do, which route each
//!   pair of GPUs takes, and what to fix (tables on stdout, progress on stderr).
//! - `tq version` (or `tq --version`): the version.
//!
//! Exit status: 0, or 1 when `--strict` finds a route slower than its link allows or a broken
//! check, or 2 for a usage error or output that could not be written.
//!
//! The modules, from the top: `doctor` runs the command; `report` puts the sections together
//! and prints them; the sections (`gpus`, `pairs`, `handles`, `host`, `engines`, `inline`) each
//! check one thing; `verdict`, `text` and `output` are the vocabulary, layout and writing they
//! share.

mod doctor;
mod engines;
mod gpus;
mod handles;
mod host;
mod inline;
mod output;
mod pairs;
mod report;
mod text;
mod verdict;

use std::process::ExitCode;
use std::sync::LazyLock;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

/// What `tq version` and `tq --version` print after "tq ": tq's version and the library's.
static VERSION: LazyLock<String> =
    LazyLock::new(|| format!("{} (tensor-queue {})", env!("CARGO_PKG_VERSION"), tensor_queue::VERSION));

/// tensor-queue's command-line tool.
#[derive(Debug, Parser)]
#[command(name = "tq", version = VERSION.as_str(), about = "tensor-queue's command-line tool")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Says what this machine can do for tensor-queue, which route each pair of GPUs takes, and
    /// what to fix.
    Doctor(doctor::DoctorArgs),
    /// Prints tq's version (as `tq --version` does).
    Version,
    /// The second process of `tq doctor`'s handle checks (started by `tq doctor` itself).
    #[command(hide = true)]
    DoctorChild,
}

fn main() -> ExitCode {
    // clap prints help and version itself and ignores a failed write; they go through
    // `output::print` instead, like every other output of tq.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) if matches!(error.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            let what = if error.kind() == ErrorKind::DisplayHelp { "the help" } else { "the version" };
            return output::print("tq", what, &error.render().to_string()).err().unwrap_or(ExitCode::SUCCESS);
        }
        Err(error) => {
            output::warn(error.render().to_string().trim_end());
            return ExitCode::from(2);
        }
    };
    match cli.command {
        Command::Doctor(args) => doctor::run(&args),
        Command::Version => {
            output::print("tq version", "the version", &format!("tq {}\n", *VERSION)).err().unwrap_or(ExitCode::SUCCESS)
        }
        Command::DoctorChild => handles::child_main(),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_arguments_are_consistent() {
        Cli::command().debug_assert();
    }
}
