//! Waiting on several receivers (or anything else with a descriptor) at once.

use std::cell::Cell;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// Waits until one of several [`Receiver`](super::Receiver)s may make progress, like crossbeam's
/// `Select` or ipc-channel's `IpcReceiverSet`. Anything with a descriptor that becomes readable
/// can join too (a socket, an eventfd, another `Select`).
///
/// [`ready`](Select::ready) says which one to look at; the caller then takes what is there with
/// [`try_recv`](super::Receiver::try_recv) or [`try_iter`](super::Receiver::try_iter). It may
/// wake for work that is not a message (a credit, a release, a sender that came or went), and
/// `try_recv` then answers [`Error::Empty`]: wait again. A receiver whose senders have all gone
/// stays ready, and `try_recv` answers [`Error::Disconnected`]: [`remove`](Select::remove) it.
///
/// The `Select` keeps its own duplicate of each receiver's descriptor
/// ([`AsFd for Receiver`](super::Receiver#impl-AsFd-for-Receiver<T>)), so the receivers stay free
/// to receive. A receiver that is dropped is never ready again.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::channel::Select;
/// use tensor_queue::{Error, Receiver, Sender};
/// # let dir = std::env::temp_dir();
/// # let (a_path, b_path) = (dir.join(format!("doc-{}-select-a.sock", std::process::id())), dir.join(format!("doc-{}-select-b.sock", std::process::id())));
/// let mut numbers = Receiver::<u32>::bind(&a_path)?;
/// let mut words = Receiver::<String>::bind(&b_path)?;
/// let mut select = Select::new();
/// let (n, w) = (select.add(&numbers)?, select.add(&words)?);
/// Sender::<String>::connect(&b_path)?.send(&"hello".to_string())?; // usually other processes
/// loop {
///     match select.ready()? {
///         i if i == n => if let Ok(number) = numbers.try_recv() { println!("{number}") },
///         i if i == w => match words.try_recv() {
///             Ok(word) => { assert_eq!(word, "hello"); break }
///             Err(Error::Empty | Error::Disconnected) => {}
///             Err(other) => return Err(other),
///         },
///         _ => unreachable!(),
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct Select {
    /// Index `i` is what `add` numbered `i`; `None` once removed.
    sources: Vec<Option<OwnedFd>>,
    /// Where the next look starts, so that one busy source does not starve the others.
    next: Cell<usize>,
}

impl Select {
    /// An empty set.
    pub fn new() -> Select {
        Select::default()
    }

    /// Adds a receiver (or any descriptor that becomes readable) and returns its index, which
    /// [`ready`](Select::ready) returns when it is ready.
    pub fn add(&mut self, source: &impl AsFd) -> Result<usize> {
        let fd = source.as_fd().try_clone_to_owned().map_err(|e| ipc_core::Error::Os { what: "dup", source: e })?;
        self.sources.push(Some(fd));
        Ok(self.sources.len() - 1)
    }

    /// Takes the source numbered `index` out; the other indexes stay as they are.
    pub fn remove(&mut self, index: usize) {
        if let Some(slot) = self.sources.get_mut(index) {
            *slot = None;
        }
    }

    /// Waits until a source is ready and returns its index; [`Error::NothingToSelect`] if none is left.
    pub fn ready(&self) -> Result<usize> {
        self.wait(None)?.ok_or(Error::Timeout)
    }

    /// Waits up to `timeout`; [`Error::Timeout`] if nothing became ready.
    pub fn ready_timeout(&self, timeout: Duration) -> Result<usize> {
        self.wait(Some(timeout))?.ok_or(Error::Timeout)
    }

    /// The index of a source that is ready now; [`Error::Empty`] if none is.
    pub fn try_ready(&self) -> Result<usize> {
        self.wait(Some(Duration::ZERO))?.ok_or(Error::Empty)
    }

    fn wait(&self, timeout: Option<Duration>) -> Result<Option<usize>> {
        let indexes: Vec<usize> = (0..self.sources.len()).filter(|&i| self.sources[i].is_some()).collect();
        if indexes.is_empty() {
            return Err(Error::NothingToSelect);
        }
        let mut fds: Vec<PollFd<'_>> =
            indexes.iter().filter_map(|&i| self.sources[i].as_ref()).map(|fd| PollFd::new(fd, PollFlags::IN)).collect();
        let timespec = timeout
            .map(|timeout| Timespec::try_from(timeout).map_err(|_| Error::TimeoutTooLong { timeout }))
            .transpose()?;
        loop {
            match poll(&mut fds, timespec.as_ref()) {
                Ok(0) => return Ok(None),
                Ok(_) => break,
                // A signal: with no deadline, wait on; with one, say nothing is ready yet.
                Err(Errno::INTR) if timeout.is_none() => continue,
                Err(Errno::INTR) => return Ok(None),
                Err(errno) => return Err(ipc_core::Error::Os { what: "poll", source: errno.into() }.into()),
            }
        }
        let start = self.next.get() % fds.len();
        let found = (0..fds.len()).map(|k| (start + k) % fds.len()).find(|&k| !fds[k].revents().is_empty());
        Ok(found.map(|k| {
            self.next.set(k + 1);
            indexes[k]
        }))
    }
}
