//! `tq doctor`: gathers the report, prints it, and picks the exit status.

use std::io::Write;
use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use tensor_queue::route::Reach;

use crate::report::{Report, Summary};
use crate::{DoctorArgs, engines, gpus, handles, host, pairs};

/// Runs the doctor with `args`.
pub fn run(args: &DoctorArgs) -> ExitCode {
    let report = gather(args.measure);
    let printed = if args.json {
        serde_json::to_string_pretty(&report).map_err(std::io::Error::from).and_then(|json| {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{json}")
        })
    } else {
        std::io::stdout().lock().write_all(report.to_text().as_bytes())
    };
    if let Err(error) = printed {
        eprintln!("tq doctor: could not write the report ({error}); try --json > file");
        return ExitCode::from(2);
    }
    if args.strict && report.summary.strict_fails {
        eprintln!(
            "tq doctor --strict: {} check(s) slower than possible, {} broken; see \"What to do\" above",
            report.summary.slower_than_possible, report.summary.broken
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// Asks everything. Without a GPU the GPU sections say so and the host facts are still checked.
pub fn gather(measure: bool) -> Report {
    let gpu = gpus::facts();
    let mut pair_rows = Vec::new();
    let handle_rows = if gpu.available {
        pair_rows = pairs::pair_rows(Reach::local());
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
    let mut report = Report {
        tq_version: env!("CARGO_PKG_VERSION"),
        cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        gpu,
        pairs: pair_rows,
        handles: handle_rows,
        host: host::checks(),
        engines: engines::checks(),
        summary: Summary::default(),
    };
    report.summary = report.summarize();
    report
}
