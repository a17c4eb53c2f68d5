//! One message to several receivers, encoded once.

use ipc_core::deadline::deadline;
use std::time::Duration;

use serde::Serialize;

use super::sender::Sender;
use crate::error::{Error, Result};
use crate::send::connection::Wait;
use crate::send::outgoing::Outgoing;
use ipc_core::Stream;

/// One message to several receivers, without copies: each gets the same memory under its own
/// lease, and the memory is reused only when all have released it (the weight-sharing case).
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{Broadcast, Context, DType, Sender, Stream, Tensor};
/// let stream = Stream::new(&Context::on_ordinal(0)?)?;
/// let senders = (0..3).map(|i| Sender::connect(format!("/tmp/worker-{i}.sock"))).collect::<Result<_, _>>()?;
/// let weights = Broadcast::<Tensor>::new(senders);
/// let w = Tensor::zeros_cuda(DType::BF16, &[4096, 4096], &stream)?;
/// weights.send_on(&w, &stream)?; // one signal write orders all three
/// # Ok(()) }
/// ```
pub struct Broadcast<T> {
    senders: Vec<Sender<T>>,
}

impl<T: Serialize> Broadcast<T> {
    /// A broadcast over these senders.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Broadcast, DType, Receiver, Sender, Tensor};
    /// # let name = |i| format!("doc-{}-broadcast-{i}.sock", std::process::id());
    /// let paths: Vec<_> = (0..3).map(|i| std::env::temp_dir().join(name(i))).collect();
    /// let mut workers = paths.iter().map(Receiver::<Tensor>::bind).collect::<Result<Vec<_>, _>>()?;
    /// let weights = Broadcast::new(paths.iter().map(Sender::connect).collect::<Result<_, _>>()?);
    /// weights.send(&Tensor::from_slice(&[0.5f32; 4], DType::F32, &[4])?)?; // one memory, three leases
    /// for worker in &mut workers {
    ///     assert_eq!(worker.recv()?.to_vec::<f32>()?, [0.5; 4]);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn new(senders: Vec<Sender<T>>) -> Broadcast<T> {
        Broadcast { senders }
    }

    /// The senders, one per receiver.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Broadcast, DType, Receiver, Sender, Tensor};
    /// # let name = |i| format!("doc-{}-senders-{i}.sock", std::process::id());
    /// # let paths: Vec<_> = (0..2).map(|i| std::env::temp_dir().join(name(i))).collect();
    /// # let mut workers = paths.iter().map(Receiver::<Tensor>::bind).collect::<Result<Vec<_>, _>>()?;
    /// # let weights = Broadcast::new(paths.iter().map(Sender::connect).collect::<Result<_, _>>()?);
    /// weights.send(&Tensor::zeros(DType::F32, &[1024])?)?;
    /// let held: Vec<Tensor> = workers.iter_mut().map(|w| w.recv()).collect::<Result<_, _>>()?;
    /// drop(held);
    /// for sender in weights.senders() {
    ///     assert!(sender.wait_released(Duration::from_secs(10)), "pid {} still holds it", sender.peer_pid());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn senders(&self) -> &[Sender<T>] {
        &self.senders
    }

    /// Keeps only the senders for which `keep` says true: for example, to stop sending to
    /// receivers that are gone, whose senders return [`Error::Disconnected`](crate::Error::Disconnected)
    /// from every send.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Broadcast, Error, Receiver, Sender};
    /// # let dir = std::env::temp_dir();
    /// # let a = dir.join(format!("doc-{}-retain-a.sock", std::process::id()));
    /// # let b = dir.join(format!("doc-{}-retain-b.sock", std::process::id()));
    /// let (mut live, gone) = (Receiver::<u32>::bind(&a)?, Receiver::<u32>::bind(&b)?);
    /// let mut everyone = Broadcast::<u32>::new(vec![Sender::connect(&a)?, Sender::connect(&b)?]);
    /// drop(gone);
    /// # let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    /// # while everyone.senders()[1].is_connected() && std::time::Instant::now() < deadline {
    /// #     std::thread::sleep(std::time::Duration::from_millis(1));
    /// # }
    /// assert!(matches!(everyone.send(&1), Err(Error::Disconnected)));
    /// everyone.retain(|sender| sender.is_connected());
    /// everyone.send(&2)?;
    /// assert_eq!((live.recv()?, live.recv()?), (1, 2));
    /// # Ok(()) }
    /// ```
    pub fn retain(&mut self, keep: impl FnMut(&Sender<T>) -> bool) {
        self.senders.retain(keep);
    }

    /// Sends to every receiver; see [`Sender::send`]. Every receiver is tried; the first error is
    /// returned.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Broadcast, Receiver, Sender};
    /// # let dir = std::env::temp_dir();
    /// # let a = dir.join(format!("doc-{}-bc-a.sock", std::process::id()));
    /// # let b = dir.join(format!("doc-{}-bc-b.sock", std::process::id()));
    /// # let (mut first, mut second) = (Receiver::<String>::bind(&a)?, Receiver::<String>::bind(&b)?);
    /// let config = Broadcast::<String>::new(vec![Sender::connect(&a)?, Sender::connect(&b)?]);
    /// config.send(&"lr=0.1".to_string())?; // encoded once, sent to each
    /// assert_eq!(first.recv()?, "lr=0.1");
    /// assert_eq!(second.recv()?, "lr=0.1");
    /// # Ok(()) }
    /// ```
    pub fn send(&self, message: &T) -> Result<()> {
        let outgoing = Outgoing::synchronized(message)?;
        first_error(self.senders.iter().map(|s| s.inner().send_outgoing(&outgoing, Wait::Forever)))
    }

    /// Sends to every receiver; see [`Sender::send_on`]. The message is encoded once, and one
    /// signal-word write on `stream` orders every receiver.
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Broadcast, Context, DType, Sender, Stream, Tensor};
    /// let workers = vec![Sender::connect("/tmp/worker-0.sock")?, Sender::connect("/tmp/worker-1.sock")?];
    /// let weights = Broadcast::<Tensor>::new(workers);
    /// let stream = Stream::new(&Context::on_ordinal(0)?)?;
    /// let w = Tensor::zeros_cuda(DType::BF16, &[4096, 4096], &stream)?;
    /// weights.send_on(&w, &stream)?; // no CPU wait; both receivers wait for the zeroing on the GPU
    /// # Ok(()) }
    /// ```
    pub fn send_on(&self, message: &T, stream: &Stream) -> Result<()> {
        let outgoing = Outgoing::on_stream(message, stream)?;
        first_error(self.senders.iter().map(|s| s.inner().send_outgoing(&outgoing, Wait::Forever)))
    }
}

impl<T: Serialize> Broadcast<T> {
    /// [`Broadcast::send`], giving up with [`Error::Timeout`](crate::Error::Timeout) when some
    /// receiver has no room within `timeout`: then no receiver was sent anything. A receiver that
    /// is gone or refused is skipped (its error is returned once the others were sent to).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Broadcast, Error, Receiver, Sender};
    /// # let dir = std::env::temp_dir();
    /// # let a = dir.join(format!("doc-{}-bct-a.sock", std::process::id()));
    /// # let b = dir.join(format!("doc-{}-bct-b.sock", std::process::id()));
    /// let mut fast = Receiver::<u32>::bind_with_capacity(&a, 1)?;
    /// let _slow = Receiver::<u32>::bind_with_capacity(&b, 1)?; // never receives
    /// let both = Broadcast::<u32>::new(vec![Sender::connect(&a)?, Sender::connect(&b)?]);
    /// both.send_timeout(&1, Duration::from_secs(10))?;
    /// assert_eq!(fast.recv()?, 1);
    /// let full = both.send_timeout(&2, Duration::from_millis(10));
    /// assert!(matches!(full, Err(Error::Timeout)), "the slow one is full");
    /// assert!(matches!(fast.try_recv(), Err(Error::Empty)), "so nobody got it");
    /// # Ok(()) }
    /// ```
    pub fn send_timeout(&self, message: &T, timeout: Duration) -> Result<()> {
        if self.senders.iter().any(|s| s.refused_at_once(timeout)) {
            return Err(Error::Timeout); // all or none: one full receiver refuses it
        }
        self.send_all(&Outgoing::synchronized(message)?, Wait::Until(deadline(timeout)))
    }

    /// [`Broadcast::send_on`] with a timeout, as [`Broadcast::send_timeout`].
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Broadcast, Context, DType, Sender, Stream, Tensor};
    /// let workers = Broadcast::<Tensor>::new(vec![Sender::connect("/tmp/worker-0.sock")?]);
    /// let stream = Stream::new(&Context::on_ordinal(0)?)?;
    /// let w = Tensor::zeros_cuda(DType::F32, &[1024], &stream)?;
    /// workers.send_on_timeout(&w, &stream, Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn send_on_timeout(&self, message: &T, stream: &Stream, timeout: Duration) -> Result<()> {
        if self.senders.iter().any(|s| s.refused_at_once(timeout)) {
            return Err(Error::Timeout);
        }
        self.send_all(&Outgoing::on_stream(message, stream)?, Wait::Until(deadline(timeout)))
    }

    /// Takes a credit of every receiver first (all or none), then writes to each.
    fn send_all(&self, outgoing: &Outgoing, wait: Wait) -> Result<()> {
        let mut credited = Vec::with_capacity(self.senders.len());
        let mut first = Ok(());
        for sender in &self.senders {
            match sender.inner().take_credit(wait) {
                Ok(()) => credited.push(sender),
                Err(Error::Timeout) => {
                    for taken in credited {
                        taken.inner().return_credit();
                    }
                    return Err(Error::Timeout);
                }
                Err(other) => {
                    if first.is_ok() {
                        first = Err(other);
                    }
                }
            }
        }
        let written = first_error(credited.into_iter().map(|s| s.inner().send_credited(outgoing)));
        first.and(written)
    }
}

fn first_error(results: impl Iterator<Item = Result<()>>) -> Result<()> {
    let mut first = Ok(());
    for result in results {
        if first.is_ok() {
            first = result;
        }
    }
    first
}
