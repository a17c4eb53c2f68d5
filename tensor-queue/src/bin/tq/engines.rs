//! Engines for crossing machines. tensor-queue does not use one yet; the doctor says whether
//! NCCL is installed, so that the answer is ready when it does.

use ipc_core::driver_info::probe_nvidia_library;

use crate::report::{Check, Verdict};

/// The variable that names the NCCL library to try instead of the default names.
pub const NCCL_ENV: &str = "TQ_NCCL_LIBRARY";
/// The names tried when [`NCCL_ENV`] is unset.
pub const NCCL_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The engines' rows.
pub fn checks() -> Vec<Check> {
    vec![nccl(std::env::var(NCCL_ENV).ok().filter(|v| !v.is_empty()).as_deref())]
}

/// The NCCL row: `explicit` is the library named by [`NCCL_ENV`], if any.
pub fn nccl(explicit: Option<&str>) -> Check {
    let name = "NCCL";
    if let Some(path) = explicit {
        return match probe_nvidia_library(path) {
            Ok(found) => Check::ok(name, format!("not used yet; {} loads ({NCCL_ENV})", found.display())),
            Err(missing) => Check::flagged(
                name,
                format!("not used yet; {missing}"),
                Verdict::Broken,
                format!("{NCCL_ENV} names a library that does not load: point it at libnccl.so.2, or unset it"),
            ),
        };
    }
    let mut reasons = Vec::new();
    for candidate in NCCL_NAMES {
        match probe_nvidia_library(candidate) {
            Ok(found) => return Check::ok(name, format!("not used yet; {candidate} loads from {}", found.display())),
            Err(missing) => reasons.push(missing.name),
        }
    }
    Check::ok(
        name,
        format!("not used yet; not installed ({} do not load; set {NCCL_ENV} to a path)", reasons.join(", ")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_is_reported_as_not_used_yet() {
        let check = nccl(None);
        assert!(check.value.starts_with("not used yet"), "{}", check.value);
        assert_eq!(check.verdict, Verdict::Ok);
        let wrong = nccl(Some("/nonexistent/libnccl.so.2"));
        assert_eq!(wrong.verdict, Verdict::Broken);
        assert!(wrong.fix.unwrap().contains(NCCL_ENV));
    }
}
