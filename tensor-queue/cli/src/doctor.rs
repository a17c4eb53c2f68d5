//! `tq doctor`: gathers the report, prints it, and picks the exit status.

use std::process::ExitCode;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tensor_queue::testing::Reach;

use crate::inline::InlineReport;
use crate::output::{print, warn};
use crate::report::{Measurement, Report};
use crate::verdict::Summary;
use crate::{engines, gpus, handles, host, inline, pairs, text};

/// `tq doctor`'s options.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print the report as JSON, for scripts.
    #[arg(long)]
    pub json: bool,
    /// Also measure copy bandwidth between GPUs, the cost of each handle kind, and the
    /// threshold of small messages' inline GPU tensors across hosts (seconds).
    #[arg(long)]
    pub measure: bool,
    /// Exit 1 when any pair would take a slower route than its link allows or any check is
    /// broken (a deployment gate).
    #[arg(long)]
    pub strict: bool,
}

/// Runs the doctor with `args`.
pub fn run(args: &DoctorArgs) -> ExitCode {
    let report = gather(args.measure);
    let text = if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(json) => json + "\n",
            Err(error) => {
                warn(&format!("tq doctor: could not write the report ({error})"));
                return ExitCode::from(crate::output::WRITE_FAILED);
            }
        }
    } else {
        report.to_text(text::width())
    };
    if let Err(status) = print("tq doctor", "the report", &text) {
        return status;
    }
    if args.json && report.measurement == Measurement::NothingMeasured {
        warn("tq doctor --measure: nothing was measured (copy bandwidth and handle costs need a GPU)");
    }
    if args.strict && report.summary.strict_fails {
        warn(&format!(
            "tq doctor --strict: {} check(s) slower than possible, {} broken; see \"What to do\" in the report",
            report.summary.slower_than_possible, report.summary.broken
        ));
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// Asks everything. Without a GPU the GPU sections say so and the host facts are still checked.
pub fn gather(measure: bool) -> Report {
    let gpu = gpus::facts();
    let mut pair_rows = Vec::new();
    let handle_rows = if gpu.available {
        pair_rows = pairs::pair_rows(Reach::local_with_interconnect());
        if measure && !pair_rows.is_empty() {
            let progress = ProgressBar::new(pair_rows.len() as u64).with_style(
                ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len}").unwrap_or(ProgressStyle::default_bar()),
            );
            for row in &mut pair_rows {
                progress.set_message(format!("measuring GPU{} -> GPU{}", row.source, row.target));
                let measured = pairs::measure_copy(row.source, row.target, row.peer_access);
                pairs::apply_measurement(row, measured);
                progress.inc(1);
            }
            progress.finish_and_clear();
        }
        let spinner = ProgressBar::new_spinner().with_message("trying handle kinds across two processes");
        spinner.enable_steady_tick(std::time::Duration::from_millis(100));
        let rows = handles::check(measure);
        spinner.finish_and_clear();
        rows
    } else {
        handles::skipped("no GPU here")
    };
    let inline = match (measure, gpu.available) {
        (true, true) => {
            let spinner = ProgressBar::new_spinner().with_message("timing small messages' inline copies");
            spinner.enable_steady_tick(std::time::Duration::from_millis(100));
            let measured = inline::measure();
            spinner.finish_and_clear();
            measured
        }
        (true, false) => InlineReport::not_measured("no GPU here: nothing measured"),
        (false, _) => InlineReport::not_measured("not measured (tq doctor --measure times it)"),
    };
    let measurement = match (measure, gpu.available) {
        (false, _) => Measurement::NotAsked,
        (true, false) => Measurement::NothingMeasured,
        (true, true) => Measurement::Measured,
    };
    let mut report = Report {
        tq_version: env!("CARGO_PKG_VERSION"),
        cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        measurement,
        gpu,
        pairs: pair_rows,
        handles: handle_rows,
        host: host::checks(),
        engines: engines::checks(),
        inline,
        summary: Summary::default(),
    };
    report.summary = report.summarize();
    report
}
