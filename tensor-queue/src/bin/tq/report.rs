//! The doctor's report: verdicts, rows, the summary, and how they print as tables.

use std::fmt::Write as _;

use serde::Serialize;

use crate::gpus::GpuFacts;
use crate::handles::HandleRow;
use crate::pairs::PairRow;

/// How one fact stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// As good as this machine allows.
    Ok,
    /// Works, but slower than the hardware allows (`--strict` fails on a GPU pair that is).
    SlowerThanPossible,
    /// Does not work (`--strict` fails).
    Broken,
    /// Not checked here (no GPU): neither good nor bad.
    Skipped,
}

impl Verdict {
    /// The word the tables print.
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::SlowerThanPossible => "slower than possible",
            Verdict::Broken => "BROKEN",
            Verdict::Skipped => "skipped",
        }
    }
}

/// One checked fact: what it is, what was found, the verdict, and what to do about it.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// What was found.
    pub value: String,
    /// How it stands.
    pub verdict: Verdict,
    /// What to do, when the verdict is not ok.
    pub fix: Option<String>,
}

impl Check {
    /// A fact that is fine.
    pub fn ok(name: &str, value: impl Into<String>) -> Check {
        Check { name: name.into(), value: value.into(), verdict: Verdict::Ok, fix: None }
    }

    /// A fact with a verdict and a fix.
    pub fn flagged(name: &str, value: impl Into<String>, verdict: Verdict, fix: impl Into<String>) -> Check {
        Check { name: name.into(), value: value.into(), verdict, fix: Some(fix.into()) }
    }
}

/// How many rows have each verdict, and whether `--strict` fails.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// Rows that are ok.
    pub ok: usize,
    /// Rows slower than possible.
    pub slower_than_possible: usize,
    /// Broken rows.
    pub broken: usize,
    /// Rows not checked here.
    pub skipped: usize,
    /// Whether `tq doctor --strict` exits non-zero.
    pub strict_fails: bool,
}

impl Summary {
    /// Counts the verdicts of the GPU pairs and of the other checks. `--strict` fails when a
    /// pair is slower than its link allows or anything is broken; a check elsewhere that is
    /// merely slower than possible (a small locked-memory limit, no pidfd) is reported but does
    /// not fail it.
    pub fn of(pairs: impl IntoIterator<Item = Verdict>, checks: impl IntoIterator<Item = Verdict>) -> Summary {
        let mut summary = Summary::default();
        let pairs = pairs.into_iter().map(|v| (v, true));
        for (verdict, pair) in pairs.chain(checks.into_iter().map(|v| (v, false))) {
            match verdict {
                Verdict::Ok => summary.ok += 1,
                Verdict::SlowerThanPossible => summary.slower_than_possible += 1,
                Verdict::Broken => summary.broken += 1,
                Verdict::Skipped => summary.skipped += 1,
            }
            summary.strict_fails |= verdict == Verdict::Broken || (pair && verdict == Verdict::SlowerThanPossible);
        }
        summary
    }
}

/// Everything `tq doctor` found; its JSON form is what `--json` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The tq (and tensor-queue) version.
    pub tq_version: &'static str,
    /// `CUDA_VISIBLE_DEVICES` as this process saw it (`None`: unset).
    pub cuda_visible_devices: Option<String>,
    /// The driver and the GPUs.
    pub gpu: GpuFacts,
    /// Every ordered pair of GPUs, with the routes tensor-queue takes between them.
    pub pairs: Vec<PairRow>,
    /// Which GPU handle kinds cross between two processes here.
    pub handles: Vec<HandleRow>,
    /// Host and container facts that break IPC.
    pub host: Vec<Check>,
    /// Engines for crossing machines.
    pub engines: Vec<Check>,
    /// The verdicts counted.
    pub summary: Summary,
}

impl Report {
    /// Counts the report's verdicts.
    pub fn summarize(&self) -> Summary {
        let pairs = self.pairs.iter().map(|p| p.verdict);
        let gpu = self.gpu.checks.iter().map(|c| c.verdict);
        let handles = self.handles.iter().map(|h| h.verdict);
        let rest = self.host.iter().chain(&self.engines).map(|c| c.verdict);
        Summary::of(pairs, gpu.chain(handles).chain(rest))
    }

    /// The report as tables, for a terminal.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let visible = self.cuda_visible_devices.as_deref().unwrap_or("(unset)");
        let _ = writeln!(out, "tq doctor {}: what this machine can do for tensor-queue\n", self.tq_version);
        if !self.gpu.available {
            out += "No GPU or no CUDA driver here: tensor-queue sends host tensors only. The host facts below still apply.\n\n";
        }
        let _ = writeln!(out, "GPUs (CUDA_VISIBLE_DEVICES={visible})");
        out += &checks_table(&self.gpu.checks);
        if !self.gpu.devices.is_empty() {
            let rows = self.gpu.devices.iter().map(|d| {
                vec![d.ordinal.to_string(), d.uuid.clone(), d.name.clone(), format!("{:.1} GiB", gib(d.memory_bytes))]
            });
            out += &table(&["ordinal", "UUID", "name", "memory"], rows);
        }
        if !self.pairs.is_empty() {
            out += "\nGPU pairs (routes from tensor_queue::route::choose, one process seeing every GPU here)\n";
            out += &crate::pairs::pairs_table(&self.pairs);
        }
        out += "\nHandles across two processes\n";
        out += &crate::handles::handles_table(&self.handles);
        out += "\nHost and container\n";
        out += &checks_table(&self.host);
        out += "\nEngines for crossing machines\n";
        out += &checks_table(&self.engines);
        out += &fixes(self);
        let s = &self.summary;
        let _ = writeln!(
            out,
            "\nSummary: {} ok, {} slower than possible, {} broken, {} skipped; --strict would {}.",
            s.ok,
            s.slower_than_possible,
            s.broken,
            s.skipped,
            if s.strict_fails { "fail (exit 1)" } else { "pass" }
        );
        out
    }
}

/// The numbered list of fixes for every row that has one and is not ok.
fn fixes(report: &Report) -> String {
    let mut lines = Vec::new();
    let checks = report.gpu.checks.iter().chain(&report.host).chain(&report.engines);
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
        let _ = writeln!(out, "  {}. {line}", i + 1);
    }
    out
}

/// Bytes in GiB.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Checks as a table: verdict, check, value.
pub fn checks_table(checks: &[Check]) -> String {
    table(
        &["verdict", "check", "found"],
        checks.iter().map(|c| vec![c.verdict.label().to_string(), c.name.clone(), c.value.clone()]),
    )
}

/// Left-aligned columns, two spaces apart, indented by two, with a header row.
pub fn table(headers: &[&str], rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let rows: Vec<Vec<String>> = rows.into_iter().collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::from(" ");
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, " {cell:<width$} ");
        }
        out += line.trim_end();
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_fails_only_on_slower_or_broken() {
        assert!(!Summary::of([Verdict::Ok], [Verdict::Ok, Verdict::Skipped]).strict_fails);
        assert!(Summary::of([Verdict::Ok, Verdict::SlowerThanPossible], []).strict_fails, "a slow pair");
        assert!(!Summary::of([], [Verdict::SlowerThanPossible]).strict_fails, "a small memlock limit");
        assert!(Summary::of([], [Verdict::Broken]).strict_fails);
        let summary = Summary::of([Verdict::Ok], [Verdict::Skipped, Verdict::Broken]);
        assert_eq!((summary.ok, summary.skipped, summary.broken), (1, 1, 1));
    }

    #[test]
    fn tables_line_up() {
        let text = table(&["a", "long header"], [vec!["wide cell".into(), "x".into()]]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0].find("long header"), lines[1].find('x'));
    }
}
