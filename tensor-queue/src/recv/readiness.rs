//! The receiver's poll set ([`PollSet`]): what `recv` waits on, and the one descriptor that is
//! readable whenever [`Receiver::recv`](crate::Receiver::recv) may make progress, which `AsFd for
//! Receiver`, [`Select`](crate::channel::Select) and the async receiver wait on.
//!
//! Its members are registered once: each connection's socket (and ring doorbell), the accept
//! thread's doorbell, the NCCL workers' wake-up, and one eventfd of its own that stands for work
//! already inside the process, which no socket shows (messages read but not yet taken, packets a
//! TCP link read ahead, messages parked for their data, and the end of the stream). A connection
//! leaves the set when the receiver lets it go, even if its socket stays open for the releases
//! of tensors still held; the accept thread's doorbell leaves with its descriptor.
//!
//! A local connection is watched through its socket and its ring's doorbell themselves
//! (`Link::wake_fds`, one token for both), not through its link's own poll set: a wake-up then
//! crosses one level of epoll, not two, and both leave the set with the connection. The doorbell
//! stays readable while the ring may hold records (`links/rings.rs`), so `recv` reads such links
//! before it waits here (`Connections::pump`): a wait that would return at once costs a system
//! call a message. The pending flag is written only when what it says changes, never per
//! message of a stream that `recv` keeps up with.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::{EventfdFlags, eventfd};

use crate::error::Result;
use crate::links::poll::{PollSet, Waited};

/// The token of the pending flag; the others are the caller's to choose.
pub(crate) const PENDING: u64 = 0;

pub(crate) struct Readiness {
    set: PollSet,
    /// Readable while work inside the process waits (see the module).
    pending: OwnedFd,
    /// What `pending` says now, to write it only when it changes.
    flagged: bool,
}

impl Readiness {
    pub fn new() -> Result<Readiness> {
        let pending = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)
            .map_err(|e| ipc_core::Error::Os { what: "eventfd", source: e.into() })?;
        let readiness = Readiness { set: PollSet::new()?, pending, flagged: false };
        readiness.set.add(readiness.pending.as_fd(), PENDING)?;
        Ok(readiness)
    }

    /// Adds `fd` to the set, reported by [`Readiness::wait`] as `token` (not [`PENDING`]).
    pub fn watch(&self, fd: BorrowedFd<'_>, token: u64) -> Result<()> {
        self.set.add(fd, token)
    }

    /// Takes `fd` out of the set (it may stay open for other reasons).
    pub fn forget(&self, fd: BorrowedFd<'_>) {
        self.set.remove(fd);
    }

    /// Says whether work inside the process waits for `recv`.
    pub fn set_pending(&mut self, pending: bool) {
        if pending == self.flagged {
            return;
        }
        // An eventfd write fails only when its counter is full, and then it is readable anyway;
        // a read fails only when it is zero, and then it is not.
        if pending {
            let _ = rustix::io::write(&self.pending, &1u64.to_ne_bytes());
        } else {
            let _ = rustix::io::read(&self.pending, &mut [0u8; 8]);
        }
        self.flagged = pending;
    }

    /// For `recv`: waits up to `timeout` for members to be readable (their tokens in `tokens`).
    /// The pending flag is cleared first: `recv` itself is the work it stands for, and says what
    /// is pending again when it returns.
    pub fn wait(&mut self, tokens: &mut Vec<u64>, timeout: Option<Duration>) -> Result<Waited> {
        self.set_pending(false);
        let waited = self.set.wait(tokens, timeout)?;
        tokens.retain(|&token| token != PENDING);
        Ok(waited)
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.set.fd()
    }
}
