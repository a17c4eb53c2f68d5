//! The doctor's report: every section's rows, the summary, and how they print as text.

use std::fmt::Write as _;

use serde::Serialize;

use crate::engines::EngineRow;
use crate::gpus::GpuFacts;
use crate::handles::{HandleRow, handles_table};
use crate::inline::InlineReport;
use crate::pairs::{PairRow, pairs_table};
use crate::text::{checks_table, gib, paragraph, table};
use crate::verdict::{Check, Summary, Verdict};

/// What came of `--measure`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Measurement {
    /// `--measure` was not given.
    NotAsked,
    /// `--measure` was given, but there is no GPU here, so nothing was measured.
    NothingMeasured,
    /// Copy bandwidths and handle costs were measured.
    Measured,
}

/// Everything `tq doctor` found; its JSON form is what `--json` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The tq (and tensor-queue) version.
    pub tq_version: &'static str,
    /// `CUDA_VISIBLE_DEVICES` as this process saw it (`None`: unset).
    pub cuda_visible_devices: Option<String>,
    /// What came of `--measure`.
    pub measurement: Measurement,
    /// The driver and the GPUs.
    pub gpu: GpuFacts,
    /// Every ordered pair of GPUs, with the routes tensor-queue takes between them.
    pub pairs: Vec<PairRow>,
    /// Which GPU handle kinds cross between two processes here.
    pub handles: Vec<HandleRow>,
    /// Host and container facts that break IPC.
    pub host: Vec<Check>,
    /// Engines for crossing machines.
    pub engines: Vec<EngineRow>,
    /// Small messages across hosts: the inline threshold this machine suggests (`--measure`).
    pub inline: InlineReport,
    /// The verdicts counted.
    pub summary: Summary,
}

/// The no-GPU notice, on the report's first line.
const NO_GPU: &str = "no GPU or no CUDA driver here, so tensor-queue sends host tensors only.";

impl Report {
    /// Counts the report's verdicts.
    pub fn summarize(&self) -> Summary {
        let pairs = self.pairs.iter().map(|p| p.verdict);
        let gpu = self.gpu.checks.iter().map(|c| c.verdict);
        let handles = self.handles.iter().map(|h| h.verdict);
        let rest = self.host.iter().chain(self.engines.iter().map(|e| &e.check)).map(|c| c.verdict);
        Summary::of(pairs, gpu.chain(handles).chain(rest))
    }

    /// The report as tables, for a terminal: no line wider than `width` characters.
    pub fn to_text(&self, width: usize) -> String {
        let mut out = String::new();
        let title = format!("tq doctor {}: ", self.tq_version);
        if self.gpu.available {
            out += &paragraph(&title, "what this machine can do for tensor-queue", 2, width);
        } else {
            out += &paragraph(&title, NO_GPU, 2, width);
            out += "The host facts below still apply.\n";
        }
        if self.measurement == Measurement::NothingMeasured {
            out += &paragraph(
                "--measure: ",
                "nothing was measured (copy bandwidth and handle costs need a GPU).",
                2,
                width,
            );
        }
        let visible = self.cuda_visible_devices.as_deref().unwrap_or("(unset)");
        let _ = writeln!(out, "\nGPUs (CUDA_VISIBLE_DEVICES={visible})");
        out += &checks_table(&self.gpu.checks, width);
        if !self.gpu.devices.is_empty() {
            let rows = self.gpu.devices.iter().map(|d| {
                vec![d.ordinal.to_string(), d.uuid.clone(), d.name.clone(), format!("{:.1} GiB", gib(d.memory_bytes))]
            });
            out += &table(&["ordinal", "UUID", "name", "memory"], rows, width);
        }
        if !self.pairs.is_empty() {
            out += "\n";
            out += &paragraph(
                "",
                "GPU pairs (routes from tensor_queue::route::choose, one process seeing every GPU here)",
                0,
                width,
            );
            out += &pairs_table(&self.pairs, width);
        }
        out += "\nHandles across two processes\n";
        out += &handles_table(&self.handles, width);
        out += "\nHost and container\n";
        out += &checks_table(&self.host, width);
        out += "\nEngines for crossing machines\n";
        let engines: Vec<Check> = self.engines.iter().map(|e| e.check.clone()).collect();
        out += &checks_table(&engines, width);
        out += &self.inline.to_text(width);
        out += &fixes(self, width);
        let s = &self.summary;
        let summary = format!(
            "{} ok, {} slower than possible, {} broken, {} skipped; --strict would {}.",
            s.ok,
            s.slower_than_possible,
            s.broken,
            s.skipped,
            if s.strict_fails { "fail (exit 1)" } else { "pass" }
        );
        out += "\n";
        out += &paragraph("Summary: ", &summary, 2, width);
        out
    }
}

/// The numbered list of fixes for every row that has one and is not ok.
fn fixes(report: &Report, width: usize) -> String {
    let mut lines = Vec::new();
    let engines = report.engines.iter().map(|e| &e.check);
    let checks = report.gpu.checks.iter().chain(&report.host).chain(engines);
    for check in checks.filter(|c| c.verdict != Verdict::Ok) {
        if let Some(fix) = &check.fix {
            lines.push(format!("{}: {fix}", check.name));
        }
    }
    for pair in report.pairs.iter().filter(|p| p.verdict != Verdict::Ok) {
        if let Some(fix) = &pair.fix {
            lines.push(format!("GPU{} -> GPU{}: {fix}", pair.source, pair.target));
        }
    }
    for handle in report.handles.iter().filter(|h| h.verdict != Verdict::Ok) {
        if let Some(fix) = &handle.fix {
            lines.push(format!("{}: {fix}", handle.label));
        }
    }
    // Rows that share a fix (the driver's, without a GPU) list it once.
    let mut seen = std::collections::HashSet::new();
    lines.retain(|line| seen.insert(line.split_once(": ").map_or(line.as_str(), |(_, fix)| fix).to_string()));
    if lines.is_empty() {
        return String::new();
    }
    let mut out = String::from("\nWhat to do\n");
    for (i, line) in lines.iter().enumerate() {
        let number = format!("  {}. ", i + 1);
        out += &paragraph(&number, line, number.len(), width);
    }
    out
}
