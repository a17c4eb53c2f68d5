//! One descriptor that is readable whenever [`Receiver::recv`](super::Receiver::recv) may make
//! progress: what `AsFd for Receiver`, [`Select`](super::Select) and the async receiver wait on.
//!
//! It is an epoll set (level-triggered) of everything `recv` waits for: each connection's socket,
//! the accept thread's doorbell, the NCCL workers' wake-up, and one eventfd of its own that stands
//! for work already inside the process, which no socket shows (messages read but not yet taken,
//! packets a TCP link read ahead, messages parked for their data, and the end of the stream). A
//! connection leaves the set when the receiver lets it go, even if its socket stays open for the
//! releases of tensors still held; the doorbell leaves with its descriptor.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::{EventfdFlags, epoll, eventfd};

use crate::error::Result;

fn os(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> crate::error::Error {
    move |e| ipc_core::Error::Os { what, source: e.into() }.into()
}

pub(crate) struct Readiness {
    epoll: OwnedFd,
    /// Readable while work inside the process waits (see the module).
    pending: OwnedFd,
    /// What `pending` says now, to write it only when it changes.
    flagged: bool,
}

impl Readiness {
    pub fn new() -> Result<Readiness> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(os("epoll_create"))?;
        let pending = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC).map_err(os("eventfd"))?;
        let readiness = Readiness { epoll, pending, flagged: false };
        readiness.watch(readiness.pending.as_fd())?;
        Ok(readiness)
    }

    /// Adds `fd` to the set; readable `fd` makes the set readable.
    pub fn watch(&self, fd: BorrowedFd<'_>) -> Result<()> {
        epoll::add(&self.epoll, fd, epoll::EventData::new_u64(0), epoll::EventFlags::IN).map_err(os("epoll_ctl"))
    }

    /// Takes `fd` out of the set (it may stay open for other reasons).
    pub fn forget(&self, fd: BorrowedFd<'_>) {
        // Fails only for a descriptor that was never added: nothing to take out.
        let _ = epoll::delete(&self.epoll, fd);
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

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}
