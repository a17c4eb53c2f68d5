//! Engines for crossing machines: NCCL, which TCP channels use to move GPU tensors between
//! hosts. The row loads it as the channels do (`cuda_sys::nccl`'s search order and version
//! check), so its answer is theirs.

use std::ffi::OsString;

use cuda_sys::nccl::{LIBRARY_CANDIDATES, LIBRARY_ENV, NcclLibrary};

use crate::report::{Check, Verdict};

/// The engines' rows.
pub fn checks() -> Vec<Check> {
    vec![nccl(&|name| std::env::var_os(name))]
}

/// The NCCL row, with the environment read through `env`.
pub fn nccl(env: &dyn Fn(&str) -> Option<OsString>) -> Check {
    let name = "NCCL";
    let named = env(LIBRARY_ENV).filter(|v| !v.is_empty()).is_some();
    match NcclLibrary::open_in(LIBRARY_CANDIDATES, env) {
        Ok(library) => Check::ok(
            name,
            format!(
                "{} from {}: TCP channels move GPU tensors between hosts with it",
                library.version(),
                library.path().display()
            ),
        ),
        Err(error) if named => Check::flagged(
            name,
            format!("{LIBRARY_ENV} does not load: {error}"),
            Verdict::Broken,
            format!("point {LIBRARY_ENV} at a libnccl.so.2 of NCCL 2.19 or later, or unset it"),
        ),
        // Needed only for GPU tensors across hosts: a receiver without it takes host tensors.
        Err(error) => Check::ok(name, format!("not installed (needed only for GPU tensors across hosts): {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_library_that_does_not_load_is_broken() {
        let wrong = nccl(&|name| (name == LIBRARY_ENV).then(|| "/nonexistent/libnccl.so.2".into()));
        assert_eq!(wrong.verdict, Verdict::Broken);
        assert!(wrong.value.contains(LIBRARY_ENV), "{}", wrong.value);
        assert!(wrong.fix.unwrap().contains(LIBRARY_ENV));
        // Found or not, without the variable the row is fine: NCCL is needed across hosts only.
        let default = nccl(&|name| std::env::var_os(name).filter(|_| name != LIBRARY_ENV));
        assert_eq!(default.verdict, Verdict::Ok, "{}", default.value);
    }
}
