//! The sending end: the typed API over one connection to a receiver (`send/connection.rs`).

use ipc_core::deadline::deadline;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use ipc_core::seqpacket::Connection;
use ipc_core::{Stream, Uuid};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::links::endpoint::{self, ConnectOptions, Endpoint};
use crate::links::link::Link;
use crate::route::{Choice, Reach, Routing};
use crate::send::connection::{SenderInner, Wait};
use crate::send::outgoing::Outgoing;
pub use crate::send::protocol::Rejection;

/// The sending end of a typed channel to one receiver.
///
/// `Sender` is cheap to clone: clones share the connection, and threads may share one. Dropping
/// the last clone closes the sending direction; the connection stays open until the receiver has
/// released every tensor it still holds. Dropping the last clone first finishes writing what
/// the sends queued (while the receiver lives; see [`Sender::send`]). To a receiver on another
/// host, it also waits (at most a minute) for its NCCL sends to finish, which needs the receiver
/// to have taken their messages.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use std::time::Duration;
/// use tensor_queue::{DType, Error, Sender, Tensor};
/// let sender = Sender::<Vec<Tensor>>::connect("/tmp/queue.sock")?;
/// let worker = sender.clone(); // the same connection, from another thread
/// std::thread::spawn(move || worker.send(&vec![]));
/// match sender.send_timeout(&vec![Tensor::zeros(DType::U8, &[64])?], Duration::from_secs(1)) {
///     Ok(()) => {}
///     Err(Error::Timeout) => eprintln!("the receiver is not keeping up"),
///     Err(other) => return Err(other),
/// }
/// for rejected in sender.take_rejected() {
///     eprintln!("message {} was refused: {}", rejected.seq, rejected.reason);
/// }
/// assert!(sender.wait_released(Duration::from_secs(10)), "the receiver still holds tensors");
/// # Ok(()) }
/// ```
pub struct Sender<T> {
    handle: Arc<Handle>,
    _message: PhantomData<fn(&T)>,
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender { handle: self.handle.clone(), _message: PhantomData }
    }
}

/// Closes the sending direction when the last clone of a [`Sender`] drops.
struct Handle {
    inner: Arc<SenderInner>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // One bound for the whole drop (it was one for each wait: twice as long over TCP).
        let timeout = crate::switches::drop_timeout().unwrap_or(super::SENDER_DROP_TIMEOUT);
        let deadline = std::time::Instant::now() + timeout;
        self.inner.finish_remote(timeout);
        // What the sends queued is written first (while the receiver lives): a program may
        // return from `main` right after its last send. Bounded: a receiver that never reads
        // must not hold this thread for ever.
        if !self.inner.link.wait_written_for(deadline.saturating_duration_since(std::time::Instant::now())) {
            tracing::warn!(
                "a dropped Sender gave up bytes its sends had queued: the receiver took none of them for {timeout:?}"
            );
        }
        // Close our direction only: the receiver may still hold tensors, and their releases
        // must still reach the reader thread before the memory can be reused.
        self.inner.link.shutdown(rustix::net::Shutdown::Write);
    }
}

impl<T: Serialize> Sender<T> {
    /// Connects to the receiver listening at `path`.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Sender};
    /// let path = std::env::temp_dir().join(format!("doc-{}-connect.sock", std::process::id()));
    /// let mut receiver = Receiver::<String>::bind(&path)?; // usually in another process
    /// let sender = Sender::<String>::connect(&path)?;
    /// sender.send(&"hello".to_string())?;
    /// assert_eq!(receiver.recv()?, "hello");
    /// # Ok(()) }
    /// ```
    pub fn connect(endpoint: impl Into<Endpoint>) -> Result<Sender<T>> {
        Sender::connect_options(&endpoint.into(), &ConnectOptions::default())
    }

    /// Connects to the receiver at `endpoint` with `options`: for TCP, the secret to prove and
    /// how long connecting may take.
    ///
    /// ```
    /// # #![allow(deprecated)]
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{ConnectOptions, Receiver, Secret, Sender};
    /// let secret = Secret::from_bytes(*b"a secret of at least 16 bytes")?; // usually TQ_SECRET
    /// let mut receiver = Receiver::<String>::builder().secret(secret.clone()).bind("tcp://127.0.0.1:0")?;
    /// let endpoint = format!("tcp://{}", receiver.local_addr().expect("bound to TCP"));
    /// let mut options = ConnectOptions::default();
    /// options.secret = Some(secret);
    /// options.timeout = Duration::from_secs(5);
    /// let sender = Sender::<String>::connect_with(endpoint, &options)?;
    /// sender.send(&"over TCP".to_string())?;
    /// assert_eq!(receiver.recv()?, "over TCP");
    /// # Ok(()) }
    /// ```
    #[deprecated(note = "use `Sender::builder().secret(..).timeout(..).connect(endpoint)`")]
    pub fn connect_with(endpoint: impl Into<Endpoint>, options: &ConnectOptions) -> Result<Sender<T>> {
        Sender::connect_options(&endpoint.into(), options)
    }

    /// Connects to `endpoint` with `options` (what the builder and the deprecated `connect_with` do).
    pub(super) fn connect_options(endpoint: &Endpoint, options: &ConnectOptions) -> Result<Sender<T>> {
        // Checked before connecting: a bad value costs no connection.
        let inline_up_to =
            crate::route::inline_threshold(options.inline_gpu_up_to).map_err(|bad| Error::Invalid(bad.0))?;
        let sender = Sender::from_link(Link::new(endpoint::connect(endpoint, options)?)?)?;
        sender.inner().set_inline_up_to(inline_up_to);
        Ok(sender)
    }

    /// A sender over an already connected socket (see [`spawn`](super::spawn)).
    pub(crate) fn from_connection(connection: Connection) -> Result<Sender<T>> {
        Sender::from_link(Link::new(Box::new(connection))?)
    }

    fn from_link(link: Link) -> Result<Sender<T>> {
        match link.hello(0, &Reach::default(), &Routing::default()) {
            // A receiver already gone (a child that exited at once): the reader thread sees the
            // hang-up, and `send` says `Disconnected`.
            Ok(()) | Err(Error::Disconnected) => {}
            Err(error) => return Err(error),
        }
        let inner = SenderInner::start(link)?;
        Ok(Sender { handle: Arc::new(Handle { inner }), _message: PhantomData })
    }

    /// Sends `message`, waiting while the receiver's queue is full. GPU tensors in it must be
    /// complete: their devices are synchronised first (a CPU stall); use [`Sender::send_on`] to
    /// avoid it.
    ///
    /// A send waits for a credit (room in the receiver's queue), never for the receiver to read:
    /// what the socket cannot take yet is written by a thread of the connection, in order. So
    /// [`Sender::try_send`] and [`Sender::send_timeout`] return within their promise whatever the
    /// message's size, and two processes that each send a large message to the other before
    /// receiving do not wait for each other. (What is queued so is bounded by the credits: the
    /// receiver's capacity in messages.) Queued messages live in this process until written
    /// ([`Sender::wait_written`] says when): a process killed before that loses them. A receiver
    /// on this machine is told how many (`Error::Unsent`, the cause of an
    /// `Error::ConnectionClosed` from `take_errors`, after every message that was written); one
    /// over TCP, or with `TQ_RINGS=0`, sees only the end of the stream.
    ///
    /// # Limits and errors
    /// A message has any number of tensors, but its encoded descriptors and payload (about 100
    /// bytes per tensor plus the serde bytes) must fit [`MAX_MESSAGE_BYTES`](crate::MAX_MESSAGE_BYTES),
    /// else [`Error::TooLarge`]. Tensors received from another process cannot be sent on
    /// ([`Error::NotSendable`]). A message may nest at most 256 levels of structs, sequences,
    /// maps, enum variants and options, as receivers refuse deeper ones (decoding them would take
    /// the receiving thread's stack), else [`Error::Encode`]. Either way nothing is sent, and the
    /// channel goes on. A receiver
    /// that refuses the message after it was sent (for example a GPU it cannot see) reports it
    /// through [`Sender::take_rejected`]. [`Error::Disconnected`] means the receiver is gone or
    /// closed the channel.
    ///
    /// ```
    /// use serde::{Deserialize, Serialize};
    /// use tensor_queue::{DType, Receiver, Sender, Tensor};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct Batch {
    ///     images: Tensor,
    ///     labels: Vec<u32>,
    /// }
    /// # fn main() -> tensor_queue::Result<()> {
    /// # let path = std::env::temp_dir().join(format!("doc-{}-send.sock", std::process::id()));
    /// # let mut receiver = Receiver::<Batch>::bind(&path)?;
    /// # let sender = Sender::<Batch>::connect(&path)?;
    /// let images = Tensor::zeros(DType::U8, &[2, 28, 28])?;
    /// sender.send(&Batch { images, labels: vec![3, 7] })?;
    /// let batch = receiver.recv()?;
    /// assert_eq!((batch.images.shape(), &batch.labels[..]), (&[2, 28, 28][..], &[3, 7][..]));
    /// # Ok(()) }
    /// ```
    pub fn send(&self, message: &T) -> Result<()> {
        self.inner().send_outgoing(&Outgoing::synchronized(message)?, Wait::Forever)
    }

    /// Sends `message` whose GPU tensors were produced by work queued on `stream`; the receiver's
    /// first use is ordered after that work, and no CPU waits. Limits as for [`Sender::send`].
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Context, DType, Sender, Stream, Tensor};
    /// # let sender = Sender::<Tensor>::connect("/tmp/activations.sock")?;
    /// let stream = Stream::new(&Context::on_ordinal(0)?)?;
    ///
    /// let x = Tensor::empty_cuda(stream.context(), DType::F32, &[1024])?;
    /// x.fill_on(2.0f32, &stream)?; // the producer's work, queued
    /// sender.send_on(&x, &stream)?; // returns at once: the receiver's stream waits for the fill
    /// # Ok(()) }
    /// ```
    pub fn send_on(&self, message: &T, stream: &Stream) -> Result<()> {
        self.inner().send_outgoing(&Outgoing::on_stream(message, stream)?, Wait::Forever)
    }

    /// [`Sender::send`], giving up with [`Error::Timeout`] (nothing sent) when the receiver has no
    /// room for the message within `timeout`.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-send-timeout.sock", std::process::id()));
    /// let _receiver = Receiver::<u32>::bind_with_capacity(&path, 1)?; // never receives
    /// let sender = Sender::<u32>::connect(&path)?;
    /// sender.send_timeout(&1, Duration::from_secs(10))?;
    /// let full = sender.send_timeout(&2, Duration::from_millis(10));
    /// assert!(matches!(full, Err(Error::Timeout)), "nothing was sent");
    /// # Ok(()) }
    /// ```
    pub fn send_timeout(&self, message: &T, timeout: Duration) -> Result<()> {
        if self.refused_at_once(timeout) {
            return Err(Error::Timeout);
        }
        self.inner().send_outgoing(&Outgoing::synchronized(message)?, Wait::Until(deadline(timeout)))
    }

    /// [`Sender::send_on`] with a timeout, as [`Sender::send_timeout`].
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Context, DType, Error, Sender, Stream, Tensor};
    /// # let sender = Sender::<Tensor>::connect("/tmp/frames.sock")?;
    /// let stream = Stream::new(&Context::on_ordinal(0)?)?;
    ///
    /// let frame = Tensor::zeros_cuda(DType::U8, &[1080, 1920, 3], &stream)?;
    /// match sender.send_on_timeout(&frame, &stream, Duration::from_millis(30)) {
    ///     Ok(()) => {}
    ///     Err(Error::Timeout) => eprintln!("the consumer is behind: this frame is dropped"),
    ///     Err(other) => return Err(other),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn send_on_timeout(&self, message: &T, stream: &Stream, timeout: Duration) -> Result<()> {
        if self.refused_at_once(timeout) {
            return Err(Error::Timeout);
        }
        self.inner().send_outgoing(&Outgoing::on_stream(message, stream)?, Wait::Until(deadline(timeout)))
    }

    /// [`Sender::send`] if the receiver has room now, else [`Error::Full`] (nothing sent). With
    /// no room, `Full` comes before the message is encoded or checked, whatever its size.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-try-send.sock", std::process::id()));
    /// let mut receiver = Receiver::<u32>::bind_with_capacity(&path, 1)?;
    /// let sender = Sender::<u32>::connect(&path)?;
    /// sender.wait_ready(Duration::from_secs(10))?; // the credits come with the receiver's greeting
    /// sender.try_send(&1)?;
    /// assert!(matches!(sender.try_send(&2), Err(Error::Full)), "nothing was sent");
    /// assert_eq!(receiver.recv()?, 1);
    /// # Ok(()) }
    /// ```
    pub fn try_send(&self, message: &T) -> Result<()> {
        if self.refused_at_once(Duration::ZERO) {
            return Err(Error::Full);
        }
        self.inner().send_outgoing(&Outgoing::synchronized(message)?, Wait::Never)
    }
}

impl<T> Sender<T> {
    pub(super) fn inner(&self) -> &SenderInner {
        &self.handle.inner
    }

    /// Whether a send that may wait `timeout` is refused before its message is encoded (and its
    /// GPU tensors' devices synchronised): no room now and no time to wait for it. A producer
    /// polling a full queue pays nothing per try (a refused try encoded the whole message;
    /// outside testers, round 9). A closed channel's own error comes from the send itself.
    pub(super) fn refused_at_once(&self, timeout: Duration) -> bool {
        timeout.is_zero() && !self.has_room() && self.is_connected()
    }

    /// Makes a send that finds no credit left read the receiver's credits and releases itself,
    /// without sleeping, for up to `spin` before it waits for the reader thread.
    ///
    /// Credits come back through a socket read by a thread that sleeps in the kernel, and a
    /// sleeping sender is woken by that thread in turn: two wake-ups between the receiver taking
    /// messages and the sender going on, which bound a streaming producer's rate (`BENCHMARKS.md`).
    /// Spinning costs a busy core while the queue is full. Zero (the default) never spins.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-sender-spin.sock", std::process::id()));
    /// # let mut receiver = Receiver::<u64>::bind(&path)?;
    /// # let sender = Sender::<u64>::connect(&path)?;
    /// sender.set_spin(Duration::from_micros(50)); // a producer that streams flat out
    /// for i in 0..100 {
    ///     sender.send(&i)?;
    ///     assert_eq!(receiver.recv()?, i);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn set_spin(&self, spin: Duration) {
        self.inner().set_spin(spin);
    }

    /// Messages whose tensors the receiver still holds (never waits, even while a send does).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{DType, Receiver, Sender, Tensor};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-outstanding.sock", std::process::id()));
    /// # let mut receiver = Receiver::<Tensor>::bind(&path)?;
    /// # let sender = Sender::<Tensor>::connect(&path)?;
    /// sender.send(&Tensor::zeros(DType::F32, &[16])?)?;
    /// let held = receiver.recv()?;
    /// assert_eq!(sender.outstanding_leases(), 1);
    /// drop(held);
    /// assert!(sender.wait_released(Duration::from_secs(10)));
    /// assert_eq!(sender.outstanding_leases(), 0);
    /// # Ok(()) }
    /// ```
    pub fn outstanding_leases(&self) -> usize {
        self.inner().outstanding_leases()
    }

    /// Whether the receiver has room for a message now (a credit is left): then
    /// [`try_send`](Sender::try_send) would not say [`Error::Full`]. A hint, for a caller that
    /// would do costly work to make a message only to have it refused: another thread of this
    /// process may take the room first. False before the receiver's greeting.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-has-room.sock", std::process::id()));
    /// let mut receiver = Receiver::<u32>::bind_with_capacity(&path, 1)?;
    /// let sender = Sender::<u32>::connect(&path)?;
    /// sender.wait_ready(Duration::from_secs(10))?;
    /// assert!(sender.has_room());
    /// sender.send(&1)?;
    /// assert!(!sender.has_room(), "the one message in flight fills the queue");
    /// receiver.recv()?;
    /// # Ok(()) }
    /// ```
    pub fn has_room(&self) -> bool {
        self.inner().has_credit()
    }

    /// Waits up to `timeout` for the receiver's greeting (it has taken the connection and said how
    /// many messages may be in flight): [`Error::Timeout`] if it did not come, the refusal or
    /// [`Error::Disconnected`] if the receiver refused or left first.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-wait-ready.sock", std::process::id()));
    /// let _receiver = Receiver::<u32>::bind(&path)?;
    /// let sender = Sender::<u32>::connect(&path)?;
    /// sender.wait_ready(Duration::from_secs(10))?; // sends from now on find credits
    /// assert!(sender.try_send(&1).is_ok());
    /// # Ok(()) }
    /// ```
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        self.inner().wait_ready(timeout)
    }

    /// Waits up to `timeout` until the receiver holds nothing of this sender's; whether it did.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{DType, Receiver, Sender, Tensor};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-wait-released.sock", std::process::id()));
    /// # let mut receiver = Receiver::<Tensor>::bind(&path)?;
    /// # let sender = Sender::<Tensor>::connect(&path)?;
    /// sender.send(&Tensor::zeros(DType::U8, &[1 << 20])?)?;
    /// let t = receiver.recv()?;
    /// assert!(!sender.wait_released(Duration::from_millis(10)), "the receiver still holds it");
    /// drop(t);
    /// assert!(sender.wait_released(Duration::from_secs(10)));
    /// # Ok(()) }
    /// ```
    pub fn wait_released(&self, timeout: Duration) -> bool {
        self.inner().wait_released(timeout)
    }

    /// Waits up to `timeout` until the bytes of every message sent so far are in the socket
    /// (a large message the receiver has not read yet waits in this process) and, over TCP,
    /// acknowledged by the receiver's machine; whether they are, or the receiver is gone. After
    /// it says true, this process may die at once without losing them: a process that dies
    /// with bytes unread in its socket resets the connection, and the kernel drops what it had
    /// not yet sent. Dropping the last clone waits for the same without a bound, so a
    /// caller that must stay interruptible waits here first, in slices.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-wait-written.sock", std::process::id()));
    /// let mut receiver = Receiver::<Vec<u8>>::bind(&path)?;
    /// let sender = Sender::<Vec<u8>>::connect(&path)?;
    /// sender.send(&vec![7u8; 4 << 20])?; // more than the socket holds
    /// assert!(!sender.wait_written(Duration::from_millis(10)), "the receiver has not read it yet");
    /// assert_eq!(receiver.recv()?.len(), 4 << 20);
    /// assert!(sender.wait_written(Duration::from_secs(10)));
    /// # Ok(()) }
    /// ```
    pub fn wait_written(&self, timeout: Duration) -> bool {
        self.inner().link.wait_written_for(timeout)
    }

    /// Whether the receiver still takes messages. It turns false when the receiver is dropped,
    /// dies or closes the connection, even while it still holds tensors: their memory comes back
    /// when it releases them or its process ends, never before.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::{Duration, Instant};
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-is-connected.sock", std::process::id()));
    /// let mut receiver = Receiver::<u32>::bind(&path)?;
    /// let sender = Sender::<u32>::connect(&path)?;
    /// sender.send(&1)?;
    /// assert_eq!(receiver.recv()?, 1);
    /// drop(receiver);
    /// let deadline = Instant::now() + Duration::from_secs(10);
    /// while sender.is_connected() {
    ///     assert!(Instant::now() < deadline, "the sender hears of it");
    ///     std::thread::sleep(Duration::from_millis(1));
    /// }
    /// assert!(matches!(sender.send(&2), Err(Error::Disconnected)));
    /// # Ok(()) }
    /// ```
    pub fn is_connected(&self) -> bool {
        self.inner().is_connected()
    }

    /// Messages the receiver refused since the last call, oldest first. It held nothing of them.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{DType, Receiver, Sender, Tensor};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-take-rejected.sock", std::process::id()));
    /// # let mut receiver = Receiver::<Tensor>::bind(&path)?;
    /// # let sender = Sender::<Tensor>::connect(&path)?;
    /// sender.send(&Tensor::zeros(DType::U8, &[8])?)?;
    /// drop(receiver.recv()?);
    /// assert!(sender.wait_released(Duration::from_secs(10))); // taken and given back, or refused
    /// let refused = sender.take_rejected();
    /// for rejection in &refused {
    ///     eprintln!("message {} was refused: {}", rejection.seq, rejection.reason);
    /// }
    /// assert!(refused.is_empty(), "this receiver took it");
    /// # Ok(()) }
    /// ```
    pub fn take_rejected(&self) -> Vec<Rejection> {
        self.inner().take_rejected()
    }

    /// The route a tensor on the GPU `source` would take to this receiver (see
    /// [`crate::route`]), decided from the receiver's GPUs and policy as `send` decides it.
    /// Waits up to `timeout` for the receiver's handshake. For a `source` this process cannot
    /// see, the answer assumes no link this process could use to it.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Receiver, Sender, Uuid};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-route.sock", std::process::id()));
    /// # let _receiver = Receiver::<u32>::bind(&path)?;
    /// let sender = Sender::<u32>::connect(&path)?;
    /// match sender.route(&Uuid([7; 16]), Duration::from_secs(10)) {
    ///     Ok(choice) => println!("{} (slower than possible: {:?})", choice.route, choice.slower_because),
    ///     Err(error) => println!("refused: {error}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn route(&self, source: &Uuid, timeout: Duration) -> Result<Choice> {
        self.wait_ready(timeout)?;
        self.inner().route(source, None)
    }

    /// The route a tensor on the GPU `source` takes to this receiver in a message whose GPU
    /// tensors total `gpu_bytes` (each tensor counted by the bytes its view touches). Across hosts
    /// a small message's GPU tensors travel inline over TCP rather than through NCCL: then the
    /// route is [`Route::Tcp`](crate::route::Route::Tcp) onto the GPU NCCL would have used, with
    /// the reason [`SMALL_MESSAGE_INLINE`](crate::route::SMALL_MESSAGE_INLINE) (see
    /// [`SenderBuilder::inline_gpu_up_to`](crate::SenderBuilder::inline_gpu_up_to)). Otherwise
    /// as [`Sender::route`].
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Receiver, Sender, Uuid};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-route-for.sock", std::process::id()));
    /// # let _receiver = Receiver::<u32>::bind(&path)?;
    /// let sender = Sender::<u32>::connect(&path)?;
    /// let choice = sender.route_for(&Uuid([7; 16]), 4096, Duration::from_secs(10))?;
    /// println!("{} ({:?})", choice.route, choice.reason); // on one host: as `route` says
    /// # Ok(()) }
    /// ```
    pub fn route_for(&self, source: &Uuid, gpu_bytes: u64, timeout: Duration) -> Result<Choice> {
        self.wait_ready(timeout)?;
        self.inner().route(source, Some(gpu_bytes))
    }

    /// The threshold of this sender's small messages across hosts: a message whose GPU tensors
    /// total at most this many bytes sends them inline over TCP, without NCCL (0: never). See
    /// [`SenderBuilder::inline_gpu_up_to`](crate::SenderBuilder::inline_gpu_up_to).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-inline-up-to.sock", std::process::id()));
    /// # let _receiver = Receiver::<u32>::bind(&path)?;
    /// let sender = Sender::<u32>::builder().inline_gpu_up_to(0).connect(&path)?;
    /// assert_eq!(sender.inline_gpu_up_to(), 0); // always NCCL across hosts
    /// # Ok(()) }
    /// ```
    pub fn inline_gpu_up_to(&self) -> u64 {
        self.inner().inline_up_to()
    }

    /// The receiver's process id.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-peer-pid.sock", std::process::id()));
    /// let _receiver = Receiver::<u32>::bind(&path)?;
    /// let sender = Sender::<u32>::connect(&path)?;
    /// assert_eq!(sender.peer_pid(), std::process::id()); // the receiver is this process, here
    /// # Ok(()) }
    /// ```
    pub fn peer_pid(&self) -> u32 {
        self.inner().link.peer_pid()
    }
}
