//! A doorbell a thread rings for another that waits in `poll`: an eventfd among its sockets.

use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::sync::Arc;

use rustix::event::{EventfdFlags, eventfd};

use crate::error::Result;

/// How NCCL workers tell `recv` that a message's receives are issued (so it may be delivered):
/// an eventfd that `recv` polls with its sockets, so a parked message costs no naps.
#[derive(Clone)]
pub(crate) struct Wake(Arc<OwnedFd>);

impl Wake {
    pub fn new() -> Result<Wake> {
        let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)
            .map_err(|e| ipc_core::Error::Os { what: "eventfd", source: e.into() })?;
        Ok(Wake(Arc::new(fd)))
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    pub fn ring(&self) {
        // Fails only when the counter is full, and then it is readable anyway.
        let _ = rustix::io::write(&*self.0, &1u64.to_ne_bytes());
    }

    /// Clears a ring `recv` has seen.
    pub fn drain(&self) {
        let _ = rustix::io::read(&*self.0, &mut [0u8; 8]);
    }
}
