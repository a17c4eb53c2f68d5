//! Whether another process still runs, through a pidfd: a descriptor of the process itself, which
//! a recycled process id cannot confuse, and which `poll` reports readable when it exits.
//!
//! Open the handle while the process is known to run (say, right after reading its id from a
//! live connection's `SO_PEERCRED`): the id alone could name a newer process once the old one is
//! reaped; from then on the handle follows the process it was opened for.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, pidfd_open};

use crate::{Error, Result};

/// Another process, watched through a pidfd; readable (for `poll`) once it has exited.
#[derive(Debug)]
pub struct ProcessHandle {
    fd: OwnedFd,
    pid: u32,
}

impl ProcessHandle {
    /// Opens a handle on process `pid`.
    ///
    /// [`Error::ProcessUnwatchable`] when pidfds are not available here (no `pidfd_open` before
    /// Linux 5.3, or a sandbox forbids it) or `pid` is 0 (what `SO_PEERCRED` reports for a peer
    /// in another PID namespace): fall back on another test, such as the connection's hang-up.
    /// [`Error::NoSuchProcess`] when no process has that id (any more).
    pub fn open(pid: u32) -> Result<ProcessHandle> {
        let raw = i32::try_from(pid).map_err(|_| Error::InvalidArgument(format!("{pid} is not a process id")))?;
        let Some(id) = Pid::from_raw(raw) else {
            return Err(Error::ProcessUnwatchable {
                pid,
                reason: "its id is not visible here (it runs in another PID namespace)",
            });
        };
        match pidfd_open(id, PidfdFlags::empty()) {
            Ok(fd) => Ok(ProcessHandle { fd, pid }),
            Err(Errno::SRCH) => Err(Error::NoSuchProcess { pid }),
            Err(Errno::NOSYS) => {
                Err(Error::ProcessUnwatchable { pid, reason: "this kernel has no pidfd_open (Linux 5.3 or later has)" })
            }
            Err(Errno::PERM | Errno::ACCESS) => {
                Err(Error::ProcessUnwatchable { pid, reason: "pidfd_open is not permitted here (sandbox policy)" })
            }
            Err(e) => Err(Error::os("pidfd_open", e)),
        }
    }

    /// The process id the handle was opened for.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process has not exited yet (a zombie, exited but not reaped, has exited).
    pub fn is_alive(&self) -> Result<bool> {
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
        loop {
            match poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })) {
                Ok(ready) => return Ok(ready == 0),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(Error::os("poll on a pidfd", e)),
            }
        }
    }
}

impl AsFd for ProcessHandle {
    /// The pidfd, to put in a poll set: it becomes readable when the process exits.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_handle_sees_its_process_exit() {
        let mut child = std::process::Command::new("sleep").arg("10").spawn().unwrap();
        let handle = ProcessHandle::open(child.id()).unwrap();
        assert_eq!(handle.pid(), child.id());
        assert!(handle.is_alive().unwrap());
        child.kill().unwrap();
        // Readable in a poll set of the caller's own once the process has exited.
        let readable = crate::seqpacket::wait_readable(handle.as_fd(), Duration::from_secs(10)).unwrap();
        assert!(readable, "the pidfd became readable");
        assert!(!handle.is_alive().unwrap(), "exited, not yet reaped");
        child.wait().unwrap();
        assert!(!handle.is_alive().unwrap(), "reaped");
    }

    #[test]
    fn what_cannot_be_watched_is_a_typed_error() {
        assert!(matches!(ProcessHandle::open(0), Err(Error::ProcessUnwatchable { pid: 0, .. })));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        // The id is free now (unless reused at once, which needs a wrap of the whole pid space).
        assert!(matches!(ProcessHandle::open(pid), Err(Error::NoSuchProcess { .. })));
        assert!(ProcessHandle::open(std::process::id()).unwrap().is_alive().unwrap());
    }
}
