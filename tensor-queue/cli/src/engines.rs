//! Engines for crossing machines: NCCL, which TCP channels use to move GPU tensors between
//! hosts. The row loads it as the channels do (`cuda_sys::nccl`'s search order and version
//! check, a library named by `TQ_NCCL_LIBRARY` used or refused, never replaced), so its answer
//! is theirs.

use std::ffi::OsString;

use cuda_sys::nccl::{LIBRARY_CANDIDATES, LIBRARY_ENV, NcclError, NcclLibrary};
use serde::Serialize;

use crate::verdict::{Check, Verdict};

/// One engine: the row, and what was loaded as fields for scripts.
#[derive(Clone, Debug, Serialize)]
pub struct EngineRow {
    /// The row as the table prints it.
    #[serde(flatten)]
    pub check: Check,
    /// The engine's version, where it loaded.
    pub version: Option<String>,
    /// Where it was loaded from, or the path a variable named that did not load.
    pub path: Option<String>,
    /// The environment variable that named the library, when one did.
    pub named_by: Option<&'static str>,
    /// Why it did not load, in full (every place tried), when it did not.
    pub error: Option<String>,
}

/// The engines' rows.
pub fn checks() -> Vec<EngineRow> {
    vec![nccl(&|name| std::env::var_os(name))]
}

/// The NCCL row, with the environment read through `env`.
pub fn nccl(env: &dyn Fn(&str) -> Option<OsString>) -> EngineRow {
    let name = "NCCL";
    let named = env(LIBRARY_ENV).filter(|v| !v.is_empty());
    let named_by = named.is_some().then_some(LIBRARY_ENV);
    let named_path = named.map(|path| path.to_string_lossy().into_owned());
    match NcclLibrary::open_in(LIBRARY_CANDIDATES, env) {
        Ok(library) => EngineRow {
            check: Check::ok(
                name,
                format!(
                    "{} from {}: TCP channels move GPU tensors between hosts with it",
                    library.version(),
                    library.path().display()
                ),
            ),
            version: Some(library.version().to_string()),
            path: Some(library.path().display().to_string()),
            named_by,
            error: None,
        },
        Err(error) if named_by.is_some() => EngineRow {
            check: Check::flagged(
                name,
                match &error {
                    NcclError::NamedLibraryNotLoaded { path, reason, .. } => {
                        format!("{LIBRARY_ENV}={path} does not load: {reason}")
                    }
                    other => format!(
                        "{LIBRARY_ENV}={} is not a usable NCCL: {}",
                        named_path.as_deref().unwrap_or_default(),
                        other.to_string().split("; ").next().unwrap_or_default()
                    ),
                },
                Verdict::Broken,
                format!("point {LIBRARY_ENV} at a libnccl.so.2 of NCCL 2.19 or later, or unset it"),
            ),
            version: None,
            path: named_path,
            named_by,
            error: Some(error.to_string()),
        },
        // Needed only for GPU tensors across hosts: a receiver without it takes host tensors.
        Err(error) => EngineRow {
            check: Check::ok(
                name,
                format!("not installed (needed only for GPU tensors across hosts): {}", short(&error)),
            ),
            version: None,
            path: None,
            named_by,
            error: Some(error.to_string()),
        },
    }
}

/// What the table says of an NCCL that is not there: where it was looked for, without each
/// place's reason (those are in the JSON's `error`).
fn short(error: &NcclError) -> String {
    match error {
        NcclError::LibraryNotFound { tried } => {
            let places: Vec<&str> =
                tried.iter().map(|t| t.split_once(": ").map_or(t.as_str(), |(place, _)| place)).collect();
            format!("looked for {}; `pip install nvidia-nccl-cu13` or {LIBRARY_ENV} gives it", places.join(", "))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_library_that_does_not_load_is_broken() {
        let wrong = nccl(&|name| (name == LIBRARY_ENV).then(|| "/nonexistent/libnccl.so.2".into()));
        assert_eq!(wrong.check.verdict, Verdict::Broken);
        assert!(wrong.check.value.contains("TQ_NCCL_LIBRARY=/nonexistent/libnccl.so.2"), "{}", wrong.check.value);
        assert!(wrong.check.fix.as_deref().unwrap().contains(LIBRARY_ENV));
        assert_eq!(wrong.path.as_deref(), Some("/nonexistent/libnccl.so.2"));
        assert_eq!((wrong.version, wrong.named_by), (None, Some(LIBRARY_ENV)));
        // A named library that loads but is not NCCL: broken too, never passed over.
        let not_nccl = nccl(&|name| (name == LIBRARY_ENV).then(|| "libc.so.6".into()));
        assert_eq!(not_nccl.check.verdict, Verdict::Broken);
        assert!(not_nccl.check.value.contains("TQ_NCCL_LIBRARY=libc.so.6 is not a usable NCCL"), "{not_nccl:?}");
        assert!(not_nccl.error.unwrap().contains("ncclGetVersion"));
        // Found or not, without the variable the row is fine: NCCL is needed across hosts only.
        let default = nccl(&|name| std::env::var_os(name).filter(|_| name != LIBRARY_ENV));
        assert_eq!(default.check.verdict, Verdict::Ok, "{}", default.check.value);
        assert_eq!(default.version.is_some(), default.path.is_some(), "{default:?}");
    }
}
