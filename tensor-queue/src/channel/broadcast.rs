//! One message to several receivers, encoded once.

use serde::Serialize;

use super::outgoing::Outgoing;
use super::sender::{Sender, Wait};
use crate::{Result, Stream};

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

fn first_error(results: impl Iterator<Item = Result<()>>) -> Result<()> {
    let mut first = Ok(());
    for result in results {
        if first.is_ok() {
            first = result;
        }
    }
    first
}
