//! The doctor's vocabulary, which every section uses: how one fact stands ([`Verdict`]), one
//! checked fact ([`Check`]), and the verdicts counted ([`Summary`]).

use serde::Serialize;

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
}
