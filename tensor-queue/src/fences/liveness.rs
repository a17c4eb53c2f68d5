//! One liveness authority per connection (as iceoryx2 handles dead nodes): whether the peer is
//! gone, and why, asked in one place instead of three clocks deciding separately.
//!
//! Three things learn that a peer is gone, each at its own pace, and each reports here:
//! - the socket: a read finds the end of the stream, or a look without reading finds it closed
//!   with nothing left to read (the link's probe, for waits that do not read: NCCL's);
//! - the producer's pidfd (the fence watcher, `fences/mod.rs`): its process exited;
//! - the NCCL worker of a communicator with the peer: the communicator failed.
//!
//! The connection asks [`Liveness::gone`]: the NCCL communicators' watches (which give up their
//! waits once the peer is gone) and the receiver when a connection ends with a message lost (to
//! say why). The first report is the cause, except that a hang-up is refined by a later report
//! that says more (the process exited): a process that dies closes its sockets first.
//!
//! Reporting changes nothing else: the fence watcher still releases a dead producer's waits
//! itself, and a connection still ends when its socket says so.

use std::fmt;
use std::sync::Mutex;

use crate::sync::lock;

/// Why a peer is gone; displayed as what the peer did ("the sender {gone}").
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Gone {
    /// Its end of the socket is closed (it hung up, or its process ended and the kernel closed it).
    HungUp,
    /// Its process exited (its pidfd said so).
    Exited,
    /// An NCCL communicator with it failed: the transfers it carried are lost.
    Nccl(String),
    /// This side ended the connection, for this reason.
    Closed(String),
}

impl fmt::Display for Gone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Gone::HungUp => f.write_str("hung up or died"),
            Gone::Exited => f.write_str("exited"),
            Gone::Nccl(why) => write!(f, "lost an NCCL communicator ({why})"),
            Gone::Closed(why) => write!(f, "was let go ({why})"),
        }
    }
}

/// Looks at a socket without reading: whether the peer closed it and nothing is left to read.
pub(crate) type Probe = Box<dyn Fn() -> bool + Send + Sync>;

/// The liveness of one connection's peer (see the module).
pub(crate) struct Liveness {
    cause: Mutex<Option<Gone>>,
    probe: Probe,
}

impl Liveness {
    /// A peer not known to be gone; `probe` looks at its socket when nothing was reported yet.
    pub fn new(probe: Probe) -> Liveness {
        Liveness { cause: Mutex::new(None), probe }
    }

    /// Reports that the peer is gone (see the module for which report is the cause).
    pub fn report(&self, gone: Gone) {
        let mut cause = lock(&self.cause);
        match &*cause {
            None => *cause = Some(gone),
            Some(Gone::HungUp) if gone == Gone::Exited => *cause = Some(gone),
            Some(_) => {}
        }
    }

    /// Whether the peer is gone, and why; with nothing reported yet, the socket is looked at.
    pub fn gone(&self) -> Option<Gone> {
        if let Some(cause) = lock(&self.cause).clone() {
            return Some(cause);
        }
        if (self.probe)() {
            self.report(Gone::HungUp);
            return lock(&self.cause).clone();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_report_is_the_cause_and_an_exit_refines_a_hang_up() {
        let liveness = Liveness::new(Box::new(|| false));
        assert_eq!(liveness.gone(), None);
        liveness.report(Gone::HungUp);
        liveness.report(Gone::Nccl("later".into()));
        assert_eq!(liveness.gone(), Some(Gone::HungUp));
        liveness.report(Gone::Exited);
        assert_eq!(liveness.gone(), Some(Gone::Exited));
        liveness.report(Gone::HungUp);
        assert_eq!(liveness.gone(), Some(Gone::Exited), "nothing replaces a definite cause");
    }

    #[test]
    fn a_closed_socket_is_a_hang_up() {
        let liveness = Liveness::new(Box::new(|| true));
        assert_eq!(liveness.gone(), Some(Gone::HungUp));
        let nccl = Liveness::new(Box::new(|| true));
        nccl.report(Gone::Nccl("set-up timed out".into()));
        assert_eq!(nccl.gone(), Some(Gone::Nccl("set-up timed out".into())), "a report comes before the probe");
    }
}
