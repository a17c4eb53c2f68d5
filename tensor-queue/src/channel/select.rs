//! Waiting on several receivers (or anything else with a descriptor) at once.

use std::cell::Cell;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::links::poll::{PollSet, Waited};

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
/// to receive. A receiver that is dropped is never ready again. Each is registered once, in a poll
/// set (epoll) of the `Select`'s own, so a descriptor epoll cannot watch (a regular file) is refused
/// by [`add`](Select::add).
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
    /// The sources, registered once with their index as the token; made by the first `add`.
    set: Option<PollSet>,
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
        let set = match &mut self.set {
            Some(set) => set,
            None => self.set.insert(PollSet::new()?),
        };
        set.add(fd.as_fd(), self.sources.len() as u64)?;
        self.sources.push(Some(fd));
        Ok(self.sources.len() - 1)
    }

    /// Takes the source numbered `index` out; the other indexes stay as they are.
    pub fn remove(&mut self, index: usize) {
        if let (Some(fd), Some(set)) = (self.sources.get_mut(index).and_then(Option::take), &self.set) {
            // Out of the set before it closes: the set would go on reporting it while the
            // receiver's own descriptor of the same file lives.
            set.remove(fd.as_fd());
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
        let set = self.set.as_ref().filter(|_| self.sources.iter().any(Option::is_some));
        let Some(set) = set else {
            return Err(Error::NothingToSelect);
        };
        let mut ready = Vec::new();
        loop {
            match set.wait(&mut ready, timeout)? {
                Waited::TimedOut => return Ok(None),
                Waited::Ready => break,
                // A signal: with no deadline, wait on; with one, say nothing is ready yet.
                Waited::Interrupted if timeout.is_none() => continue,
                Waited::Interrupted => return Ok(None),
            }
        }
        // The first ready from where the last look ended, so one busy source starves no other.
        let n = self.sources.len();
        let start = self.next.get() % n;
        let found = ready.iter().map(|&token| token as usize).min_by_key(|&index| (index + n - start) % n);
        Ok(found.inspect(|&index| self.next.set(index + 1)))
    }
}
