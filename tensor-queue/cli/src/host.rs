//! Host and container facts that break IPC: shared memory, locked memory, the socket
//! directory, the PID namespace and pidfds.

use std::path::Path;

use ipc_core::process::ProcessHandle;
use rustix::process::{Resource, getrlimit};

use crate::text::gib;
use crate::verdict::{Check, Verdict};

/// Under this, `/dev/shm` is flagged (Docker's default is 64 MB).
pub const SHM_AT_LEAST: u64 = 1 << 30;
/// Under this (and not unlimited), the locked-memory limit is flagged.
pub const MEMLOCK_AT_LEAST: u64 = 1 << 30;

/// Every host fact, checked.
pub fn checks() -> Vec<Check> {
    vec![shm(Path::new("/dev/shm")), memlock(), socket_dir(&std::env::temp_dir()), pid_namespace(), pidfd()]
}

fn shm(path: &Path) -> Check {
    match rustix::fs::statvfs(path) {
        Ok(stat) => {
            let total = stat.f_blocks.saturating_mul(stat.f_frsize);
            let free = stat.f_bavail.saturating_mul(stat.f_frsize);
            shm_check(total, free)
        }
        Err(error) => Check::flagged(
            "/dev/shm",
            format!("not usable: {error}"),
            Verdict::Broken,
            "host tensors live in shared memory: mount a tmpfs on /dev/shm (in a container: --shm-size=16g or --ipc=host)",
        ),
    }
}

/// The `/dev/shm` verdict for `total` and `free` bytes.
pub fn shm_check(total: u64, free: u64) -> Check {
    let value = format!("{:.1} GiB ({:.1} GiB free)", gib(total), gib(free));
    if total < SHM_AT_LEAST {
        return Check::flagged(
            "/dev/shm",
            value,
            Verdict::Broken,
            "host tensors and staging buffers live in /dev/shm, and it is under 1 GiB (Docker's default is 64 MB): \
             run the container with --shm-size=16g (or --ipc=host)",
        );
    }
    Check::ok("/dev/shm", value)
}

fn memlock() -> Check {
    memlock_check(getrlimit(Resource::Memlock).current)
}

/// The locked-memory verdict for a soft limit in bytes (`None`: unlimited).
///
/// The CUDA driver pins tensor-queue's host memory without counting it against this limit, so
/// tensor-queue works under a small one; it is flagged because what pins memory itself does not
/// (RDMA engines such as NCCL over InfiniBand, `mlock`), as the issue asks.
pub fn memlock_check(limit: Option<u64>) -> Check {
    match limit {
        None => Check::ok("locked memory (RLIMIT_MEMLOCK)", "unlimited"),
        Some(bytes) if bytes >= MEMLOCK_AT_LEAST => {
            Check::ok("locked memory (RLIMIT_MEMLOCK)", format!("{:.1} GiB", gib(bytes)))
        }
        Some(bytes) => Check::flagged(
            "locked memory (RLIMIT_MEMLOCK)",
            format!("{} KiB", bytes >> 10),
            Verdict::SlowerThanPossible,
            "the locked-memory limit is small: RDMA engines and mlock fail under it (the CUDA driver's pinned \
             memory does not count against it): run the container with --ulimit memlock=-1",
        ),
    }
}

/// Whether a Unix socket can be made in `dir` (where tensor-queue's sockets go by default).
fn socket_dir(dir: &Path) -> Check {
    let name = format!("socket directory ({})", dir.display());
    let path = dir.join(format!("tq-doctor-{}.sock", std::process::id()));
    match std::os::unix::net::UnixListener::bind(&path) {
        Ok(listener) => {
            drop(listener);
            let _ = std::fs::remove_file(&path);
            Check::ok(&name, "writable (a Unix socket binds there)")
        }
        Err(error) => Check::flagged(
            &name,
            format!("a Unix socket cannot be made there: {error}"),
            Verdict::Broken,
            "set TMPDIR to a writable directory on a local file system (not a network mount)",
        ),
    }
}

fn pid_namespace() -> Check {
    let ours = std::fs::read_link("/proc/self/ns/pid");
    let init = std::fs::read_link("/proc/1/ns/pid");
    let init_name = std::fs::read_to_string("/proc/1/comm").map(|s| s.trim().to_string()).ok();
    pid_namespace_check(ours.ok().as_deref(), init.ok().as_deref(), init_name.as_deref())
}

/// The PID-namespace fact from `/proc/self/ns/pid`, `/proc/1/ns/pid` and pid 1's name (each
/// `None` where unreadable). Never flagged: tensor-queue works in any namespace; the row says
/// what a peer in another one costs.
pub fn pid_namespace_check(ours: Option<&Path>, init: Option<&Path>, init_name: Option<&str>) -> Check {
    let name = "PID namespace";
    let note = "peers in another PID namespace are seen as pid 0 and cannot be watched by pidfd: \
                a dead one is noticed by its connection's hang-up (share it with --pid=host to watch them)";
    match (ours, init, init_name) {
        (Some(ours), Some(init), _) if ours == init => {
            Check::ok(name, format!("the same as pid 1 ({}): host or shared namespace", ours.display()))
        }
        (Some(ours), Some(_), _) => Check::ok(name, format!("its own ({}), as in a container; {note}", ours.display())),
        (_, _, Some(init)) => {
            let kind = if ["systemd", "init"].contains(&init) { "likely the host's" } else { "likely a container's" };
            Check::ok(name, format!("pid 1 is {init}: {kind}; /proc/1/ns/pid is not readable"))
        }
        _ => Check::ok(name, "unknown (/proc is not readable)"),
    }
}

fn pidfd() -> Check {
    match ProcessHandle::open(std::process::id()) {
        Ok(_) => Check::ok("pidfd", "available (dead peers are noticed at once)"),
        Err(error) => Check::flagged(
            "pidfd",
            format!("unavailable: {error}"),
            Verdict::SlowerThanPossible,
            "a dead peer is noticed later, by its connection's hang-up: use Linux 5.3 or later and allow \
             pidfd_open in the container's seccomp profile",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dockers_default_shm_is_broken() {
        let check = shm_check(64 << 20, 64 << 20);
        assert_eq!(check.verdict, Verdict::Broken);
        assert!(check.fix.unwrap().contains("--shm-size"));
        assert_eq!(shm_check(16 << 30, 1 << 30).verdict, Verdict::Ok);
    }

    #[test]
    fn small_memlock_is_flagged() {
        assert_eq!(memlock_check(None).verdict, Verdict::Ok);
        assert_eq!(memlock_check(Some(8 << 30)).verdict, Verdict::Ok);
        let small = memlock_check(Some(64 << 10));
        assert_eq!((small.verdict, small.value.as_str()), (Verdict::SlowerThanPossible, "64 KiB"));
        assert!(small.fix.unwrap().contains("--ulimit memlock=-1"));
    }

    #[test]
    fn pid_namespaces_are_told_apart() {
        let (a, b) = (Path::new("pid:[1]"), Path::new("pid:[2]"));
        assert!(pid_namespace_check(Some(a), Some(a), None).value.contains("the same as pid 1"));
        assert!(pid_namespace_check(Some(a), Some(b), None).value.contains("its own"));
        assert!(pid_namespace_check(Some(a), None, Some("bash")).value.contains("container"));
        assert!(pid_namespace_check(None, None, None).value.contains("unknown"));
    }

    #[test]
    fn this_machine_answers() {
        let checks = checks();
        assert_eq!(checks.len(), 5);
        assert!(checks[0].name == "/dev/shm" && checks[2].name.starts_with("socket directory"));
    }
}
