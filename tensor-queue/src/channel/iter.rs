//! Iterating over a [`Receiver`]: `for message in &mut receiver`, [`Receiver::iter`],
//! [`Receiver::try_iter`] and [`Receiver::into_iter`](IntoIterator::into_iter).
//!
//! # When the iteration ends
//! Each item is what [`Receiver::recv`] returns, except that [`Error::Disconnected`] ends the
//! iteration instead of being an item. So it ends exactly when `recv` would say every sender has
//! gone:
//! - a receiver of one connection ([`spawn`](crate::spawn), [`from_parent`](crate::from_parent),
//!   [`spawn_duplex`](crate::spawn_duplex)): its sender has dropped (or its process ended) and every
//!   message it sent has been received;
//! - a bound receiver: at least one sender has joined, none is connected now, and every message
//!   they sent has been received. That is a moment, not an end, unless the receiver knows no more
//!   senders come: [`Receiver::expect_senders`]`(n)` (it ends only once `n` senders have joined
//!   and all have left) or [`Receiver::stop_accepting`]. Before the first sender joins, the
//!   iteration waits for one.
//!
//! An error about one message ([`Error::Rejected`], [`Error::ProducerFailed`], [`Error::Decode`])
//! is an item, and the next item is the next message. Any other error is the last item: the
//! iteration ends after it (the receiver itself is still there for the caller to look at, for
//! example with [`Receiver::take_errors`]).

use serde::de::DeserializeOwned;

use super::receiver::Receiver;
use crate::error::{Error, Result};

/// What `recv`'s result means for an iterator: an item, and whether the iteration goes on.
fn item<T>(result: Result<T>, finished: &mut bool) -> Option<Result<T>> {
    match result {
        Ok(message) => Some(Ok(message)),
        Err(Error::Disconnected) => {
            *finished = true;
            None
        }
        Err(error) => {
            *finished = !error.about_one_message();
            Some(Err(error))
        }
    }
}

/// Waits for each message in turn; ends when every sender has gone (see the [module](self)).
/// Made by [`Receiver::iter`] or `for message in &mut receiver`.
pub struct Iter<'a, T> {
    receiver: &'a mut Receiver<T>,
    finished: bool,
}

impl<T: DeserializeOwned> Iterator for Iter<'_, T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        if self.finished {
            return None;
        }
        item(self.receiver.recv(), &mut self.finished)
    }
}

impl<T: DeserializeOwned> std::iter::FusedIterator for Iter<'_, T> {}

/// The messages waiting now, without blocking; ends at the first moment none is waiting, or when
/// every sender has gone. Made by [`Receiver::try_iter`].
pub struct TryIter<'a, T> {
    receiver: &'a mut Receiver<T>,
    finished: bool,
}

impl<T: DeserializeOwned> Iterator for TryIter<'_, T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        if self.finished {
            return None;
        }
        match self.receiver.try_recv() {
            Err(Error::Empty) => {
                self.finished = true;
                None
            }
            other => item(other, &mut self.finished),
        }
    }
}

impl<T: DeserializeOwned> std::iter::FusedIterator for TryIter<'_, T> {}

/// [`Iter`] that owns its receiver. Made by `receiver.into_iter()` or `for message in receiver`.
pub struct IntoIter<T> {
    receiver: Receiver<T>,
    finished: bool,
}

impl<T: DeserializeOwned> Iterator for IntoIter<T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        if self.finished {
            return None;
        }
        item(self.receiver.recv(), &mut self.finished)
    }
}

impl<T: DeserializeOwned> std::iter::FusedIterator for IntoIter<T> {}

impl<T: DeserializeOwned> Receiver<T> {
    /// Waits for each message in turn, ending when every sender has gone (exactly when
    /// [`recv`](Receiver::recv) would return [`Error::Disconnected`]; see [`iter`](self) for what that
    /// means with [`expect_senders`](Receiver::expect_senders)). Errors about one message are items
    /// and the iteration goes on after them; any other error is the last item.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-iter.sock", std::process::id()));
    /// let mut receiver = Receiver::<u32>::bind(&path)?;
    /// receiver.expect_senders(1);
    /// let sender = Sender::<u32>::connect(&path)?; // usually in another process
    /// for i in 0..3 {
    ///     sender.send(&i)?;
    /// }
    /// drop(sender);
    /// let mut sum = 0;
    /// for n in receiver.iter() {
    ///     sum += n?;
    /// }
    /// assert_eq!(sum, 3);
    /// # Ok(()) }
    /// ```
    pub fn iter(&mut self) -> Iter<'_, T> {
        Iter { receiver: self, finished: false }
    }

    /// The messages waiting now, without blocking: ends when none is waiting (or every sender has
    /// gone).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-try-iter.sock", std::process::id()));
    /// let mut receiver = Receiver::<u32>::bind(&path)?;
    /// assert_eq!(receiver.try_iter().count(), 0); // nothing yet, and no wait
    /// let sender = Sender::<u32>::connect(&path)?;
    /// sender.send(&7)?;
    /// let first = receiver.recv()?; // waits for it
    /// let rest: Vec<u32> = receiver.try_iter().collect::<Result<_, _>>()?; // whatever else is there
    /// assert_eq!((first, rest.len()), (7, 0));
    /// # Ok(()) }
    /// ```
    pub fn try_iter(&mut self) -> TryIter<'_, T> {
        TryIter { receiver: self, finished: false }
    }
}

impl<'a, T: DeserializeOwned> IntoIterator for &'a mut Receiver<T> {
    type Item = Result<T>;
    type IntoIter = Iter<'a, T>;

    fn into_iter(self) -> Iter<'a, T> {
        self.iter()
    }
}

impl<T: DeserializeOwned> IntoIterator for Receiver<T> {
    type Item = Result<T>;
    type IntoIter = IntoIter<T>;

    fn into_iter(self) -> IntoIter<T> {
        IntoIter { receiver: self, finished: false }
    }
}
