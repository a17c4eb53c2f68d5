//! One poll set under the transport seam (as ipc-channel's `OsIpcReceiverSet`): descriptors are
//! registered once, each with a token, and a wait says which of them are readable, instead of a
//! `PollFd` list built for every wait.
//!
//! It is an epoll set, level-triggered: a member that stays readable is reported by every wait
//! until it is read, and the set's own descriptor ([`PollSet::fd`]) is readable while any member
//! is, so a set can itself be waited on (with `poll`, another set, or tokio's reactor). Who uses
//! one: a receiver (its sockets, the accept doorbell, the NCCL workers' wake-up and its own
//! pending flag; the set is the receiver's `AsFd`), a sender's reader thread (its socket),
//! [`Select`](crate::channel::Select) (the receivers added to it), and the fence watcher
//! (producers' pidfds).

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::{Timespec, epoll};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// How many ready members one wait reports at most; the others are reported by the next wait
/// (the set is level-triggered, and epoll moves the members it reported behind the others).
const BATCH: usize = 64;

fn os(what: &'static str) -> impl FnOnce(Errno) -> Error {
    move |e| ipc_core::Error::Os { what, source: e.into() }.into()
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waited {
    /// Members are readable: their tokens were given.
    Ready,
    /// The timeout passed with none readable.
    TimedOut,
    /// A signal interrupted the wait before any member was readable.
    Interrupted,
}

/// Descriptors registered once, waited on together (see the module).
#[derive(Debug)]
pub(crate) struct PollSet {
    epoll: OwnedFd,
}

impl PollSet {
    pub fn new() -> Result<PollSet> {
        Ok(PollSet { epoll: epoll::create(epoll::CreateFlags::CLOEXEC).map_err(os("epoll_create"))? })
    }

    /// Adds `fd`: a wait gives `token` while it is readable (or hung up, or in error).
    pub fn add(&self, fd: BorrowedFd<'_>, token: u64) -> Result<()> {
        epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), epoll::EventFlags::IN).map_err(os("epoll_ctl"))
    }

    /// Takes `fd` out of the set (it may stay open for other reasons: the set then no longer
    /// reports it, which it would while any descriptor of the same open file lives).
    pub fn remove(&self, fd: BorrowedFd<'_>) {
        // Fails only for a descriptor that was never added: nothing to take out.
        let _ = epoll::delete(&self.epoll, fd);
    }

    /// Waits up to `timeout` (forever with `None`) until members are readable, and puts their
    /// tokens in `tokens` (emptied first).
    pub fn wait(&self, tokens: &mut Vec<u64>, timeout: Option<Duration>) -> Result<Waited> {
        tokens.clear();
        // A timeout past what the clock counts (`Duration::MAX`: "forever") waits that long.
        let timespec = timeout
            .map(|timeout| Timespec::try_from(ipc_core::deadline::bounded(timeout)))
            .transpose()
            .map_err(|_| Error::Invalid("timeout".into()))?;
        let mut events = [const { MaybeUninit::<epoll::Event>::uninit() }; BATCH];
        match epoll::wait(&self.epoll, &mut events[..], timespec.as_ref()) {
            Ok(([], _)) => Ok(Waited::TimedOut),
            Ok((ready, _)) => {
                tokens.extend(ready.iter().map(|event| event.data.u64()));
                Ok(Waited::Ready)
            }
            Err(Errno::INTR) => Ok(Waited::Interrupted),
            Err(errno) => Err(os("epoll_wait")(errno)),
        }
    }

    /// The set's own descriptor: readable while any member is.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::links::wake::Wake;

    #[test]
    fn a_wait_gives_the_tokens_of_readable_members_until_they_are_read() {
        let set = PollSet::new().unwrap();
        let (a, b) = (Wake::new().unwrap(), Wake::new().unwrap());
        set.add(a.fd(), 7).unwrap();
        set.add(b.fd(), 9).unwrap();
        let mut tokens = vec![1, 2, 3];
        assert_eq!(set.wait(&mut tokens, Some(Duration::ZERO)).unwrap(), Waited::TimedOut);
        assert!(tokens.is_empty(), "emptied first");
        b.ring();
        assert_eq!(set.wait(&mut tokens, Some(Duration::ZERO)).unwrap(), Waited::Ready);
        assert_eq!(tokens, [9]);
        assert_eq!(set.wait(&mut tokens, None).unwrap(), Waited::Ready, "level-triggered: still readable");
        assert_eq!(tokens, [9]);
        b.drain();
        a.ring();
        set.remove(a.fd());
        assert_eq!(set.wait(&mut tokens, Some(Duration::ZERO)).unwrap(), Waited::TimedOut, "a removed member");
    }

    #[test]
    fn the_set_is_readable_while_a_member_is() {
        let (outer, inner) = (PollSet::new().unwrap(), PollSet::new().unwrap());
        let wake = Wake::new().unwrap();
        inner.add(wake.fd(), 1).unwrap();
        outer.add(inner.fd(), 2).unwrap();
        let mut tokens = Vec::new();
        assert_eq!(outer.wait(&mut tokens, Some(Duration::ZERO)).unwrap(), Waited::TimedOut);
        wake.ring();
        assert_eq!(outer.wait(&mut tokens, Some(Duration::from_secs(10))).unwrap(), Waited::Ready);
        assert_eq!(tokens, [2]);
    }
}
