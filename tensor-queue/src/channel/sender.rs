//! The sending end: credits, leases, announcements and the thread that reads the receiver's
//! answers.
//!
//! Two locks, never nested the other way round: `state` (credits, leases, events, what the
//! receiver said) is only ever held briefly and never across a socket write, so the reader thread
//! can always take releases and credits, and `is_connected` or `outstanding_leases` never wait
//! for a blocked send; `writer` (announcements and sequence numbers) is held across the writes of
//! one message, so its frames reach the socket whole and in order.

use std::collections::{HashMap, HashSet, VecDeque};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering as Atomic};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ipc_core::seqpacket::Connection;
use ipc_core::{Event, Stream, Uuid};
use serde::Serialize;

use super::endpoint::{self, ConnectOptions, Endpoint};
use super::link::{Link, Read};
use super::lock;
use super::outgoing::{Fencing, Outgoing};
use crate::arena::{Chunk, RetireListener, Shared};
use crate::route::network::{self, SendComms};
use crate::route::{self, Choice, Reach, Routing, choose};
use crate::tensor::Storage;
use crate::wire::{Assembler, ChunkKind, Fence, Frame, MAX_PACKET, TensorDesc};
use crate::{Error, Refusal, Result};

/// A message the receiver refused (see [`Sender::take_rejected`]).
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use std::time::Duration;
/// use tensor_queue::{Context, DType, Sender, Stream, Tensor};
/// let sender = Sender::<Tensor>::connect("/tmp/cpu-only-worker.sock")?; // a receiver without this GPU
/// let stream = Stream::new(&Context::on_ordinal(0)?)?;
/// let x = Tensor::from_slice_cuda(&[1.0f32, 2.0], DType::F32, &[2], &stream)?;
/// sender.send_on(&x, &stream)?;
/// sender.wait_released(Duration::from_secs(10)); // a refused message is given back too
/// for rejected in sender.take_rejected() {
///     eprintln!("message {} refused ({}): sending a host copy", rejected.seq, rejected.reason);
///     sender.send(&Tensor::from_bytes(&x.to_bytes()?, x.dtype(), x.shape())?)?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection {
    /// The message's sequence number on this connection: the first message sent is 1.
    pub seq: u64,
    /// Why, in the receiver's words.
    pub reason: String,
}

/// An interprocess event of one connection, exported once.
struct EventSlot {
    id: u32,
    event: Event,
}

#[derive(Default)]
struct SenderState {
    credits: u32,
    /// Messages sent that no credit has covered yet: a receiver may not grant more than this.
    uncredited: u32,
    /// Per message the receiver may still hold (by `seq`): the storage of its tensors.
    leases: HashMap<u64, Vec<Arc<Storage>>>,
    free_events: Vec<EventSlot>,
    /// Per message sent and not yet covered by a credit, oldest first: its event, if it has one.
    /// A credit means the receiver took the message and so already queued its wait on the
    /// event; only then may the event be recorded again. The pool thus stays within the capacity.
    untaken: VecDeque<Option<EventSlot>>,
    next_event: u32,
    /// Whether the receiver's `Hello` was read: until then only the reader thread reads.
    greeted: bool,
    /// The receiver's GPUs and routing policy, from its `Hello`.
    receiver: Option<Arc<(Reach, Routing)>>,
    /// Why the receiver takes no more messages, once it does not.
    closed: Option<String>,
    /// Why the receiver refused this sender at the handshake, if it did.
    refused: Option<Refusal>,
    rejected: Vec<Rejection>,
    /// Leases removed from `leases` whose storage is still being dropped (which may retire a
    /// chunk): still outstanding, so that nothing is announced before the retirement is sent.
    dropping: usize,
}

/// What only the thread writing a message touches.
#[derive(Default)]
struct Writer {
    announced: HashSet<u64>,
    seq: u64,
}

pub(super) struct SenderInner {
    link: Link,
    /// For a receiver on another host: the NCCL communicators (used under the writer lock).
    comms: Mutex<SendComms>,
    state: Mutex<SenderState>,
    changed: Condvar,
    /// Async sends waiting for what `changed` announces (credits, the greeting, the end).
    wakers: Mutex<Vec<std::task::Waker>>,
    writer: Mutex<Writer>,
    /// Chunks freed since the last write, to retire at the receiver before anything else.
    retired: Mutex<Vec<u64>>,
    me: std::sync::Weak<SenderInner>,
    /// How long a send without credits reads the socket itself before it sleeps, in ns.
    spin_ns: AtomicU64,
    /// The buffer a spinning send reads frames into.
    spin_buf: Mutex<Vec<u8>>,
}

impl RetireListener for SenderInner {
    fn retire(&self, chunk: u64) {
        lock(&self.retired).push(chunk);
        // Sent now if no message is being written (never waiting: this may run on the reader
        // thread, which must not block on a write), else before that message's next frame.
        if let Ok(mut writer) = self.writer.try_lock() {
            let _ = self.flush_retired(&mut writer, false);
        }
    }
}

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
        if self.inner.link.remote {
            // NCCL sends still in flight finish first (bounded): the receiver may be setting up
            // the connection they need, which must not look like a sender gone. Then the NCCL
            // workers end here, on the user's thread: a program that returns from `main` next
            // must not exit under a worker that is still inside NCCL.
            self.inner.wait_released(network::NCCL_TIMEOUT);
            lock(&self.inner.comms).close();
        }
        // What the sends queued is written first (while the receiver lives): a program may
        // return from `main` right after its last send. Bounded: a receiver that never reads
        // must not hold this thread for ever.
        if !self.inner.link.wait_written_for(super::SENDER_DROP_TIMEOUT) {
            tracing::warn!(
                "a dropped Sender gave up bytes its sends had queued: the receiver took none of them for {:?}",
                super::SENDER_DROP_TIMEOUT
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
        Sender::from_link(Link::new(endpoint::connect(endpoint, options)?)?)
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
        let inner = Arc::new_cyclic(|me| SenderInner {
            link,
            comms: Mutex::new(SendComms::default()),
            // No credits until the receiver's Hello says how many: until then the receiver is
            // not receiving, which is what a full queue means too.
            state: Mutex::new(SenderState::default()),
            changed: Condvar::new(),
            wakers: Mutex::new(Vec::new()),
            writer: Mutex::new(Writer::default()),
            retired: Mutex::new(Vec::new()),
            me: me.clone(),
            spin_ns: AtomicU64::new(0),
            spin_buf: Mutex::new(Vec::new()),
        });
        let reader = inner.clone();
        std::thread::Builder::new()
            .name("tq-sender-reader".into())
            .spawn(move || reader.read_answers())
            .map_err(|e| Error::Protocol(format!("spawning the reader thread: {e}")))?;
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
    /// receiver's capacity in messages.)
    ///
    /// # Limits and errors
    /// A message has any number of tensors, but its encoded descriptors and payload (about 100
    /// bytes per tensor plus the serde bytes) must fit [`MAX_MESSAGE_BYTES`](crate::wire::MAX_MESSAGE_BYTES),
    /// else [`Error::TooLarge`]. Tensors received from another process cannot be sent on
    /// ([`Error::NotSendable`]). Either way nothing is sent, and the channel goes on. A receiver
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
        self.inner().send_outgoing(&Outgoing::synchronized(message)?, Wait::Until(Instant::now() + timeout))
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
        self.inner().send_outgoing(&Outgoing::on_stream(message, stream)?, Wait::Until(Instant::now() + timeout))
    }

    /// [`Sender::send`] if the receiver has room now, else [`Error::Full`] (nothing sent).
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
        self.inner().send_outgoing(&Outgoing::synchronized(message)?, Wait::Never)
    }
}

impl<T> Sender<T> {
    pub(super) fn inner(&self) -> &SenderInner {
        &self.handle.inner
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
        self.inner().spin_ns.store(spin.as_nanos().min(u64::MAX as u128) as u64, Atomic::Relaxed);
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
        let state = lock(&self.inner().state);
        state.leases.len() + state.dropping
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
        let deadline = Instant::now() + timeout;
        let inner = self.inner();
        let mut state = lock(&inner.state);
        loop {
            if let Some(refused) = &state.refused {
                return Err(Error::PeerRefused(refused.clone()));
            }
            if state.greeted {
                return Ok(());
            }
            if state.closed.is_some() {
                return Err(Error::Disconnected);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout);
            }
            state = inner.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
        }
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
    /// (a large message the receiver has not read yet waits in this process); whether they are,
    /// or the receiver is gone. Dropping the last clone waits for the same without a bound, so a
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
        lock(&self.inner().state).closed.is_none()
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
        std::mem::take(&mut lock(&self.inner().state).rejected)
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
        let receiver = lock(&self.inner().state).receiver.clone();
        let receiver = receiver.ok_or(Error::Disconnected)?;
        if self.inner().link.remote {
            return Ok(route::choose_remote(source, &receiver.1, &receiver.0)?);
        }
        Ok(choose(source, &receiver.1, &receiver.0, Reach::local())?)
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

/// A message's lease at a sender to another host, held by its NCCL transfers: it ends when the
/// last of them is done (or given up).
struct RemoteLease {
    sender: std::sync::Weak<SenderInner>,
    seq: u64,
}

impl Drop for RemoteLease {
    fn drop(&mut self) {
        if let Some(sender) = self.sender.upgrade() {
            lock(&sender.state).leases.remove(&self.seq);
            sender.changed.notify_all();
        }
    }
}

/// How long a send waits for room.
#[derive(Clone, Copy)]
pub(super) enum Wait {
    Forever,
    Until(Instant),
    Never,
}

impl SenderInner {
    /// See [`Sender::wait_released`].
    fn wait_released(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.state);
        while !state.leases.is_empty() || state.dropping > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    /// Sends an encoded message to this receiver: takes a credit, then announces what the
    /// receiver has not seen yet and writes the message, leasing its tensors' storage.
    pub(super) fn send_outgoing(&self, outgoing: &Outgoing, wait: Wait) -> Result<()> {
        self.take_credit(wait)?;
        self.send_credited(outgoing)
    }

    /// Gives back a credit taken by [`SenderInner::take_credit`] for a message not sent.
    pub(super) fn return_credit(&self) {
        let mut state = lock(&self.state);
        state.credits += 1;
        state.uncredited -= 1;
        drop(state);
        self.changed.notify_all();
    }

    /// Writes `outgoing` for a credit already taken (given back if the write fails).
    pub(super) fn send_credited(&self, outgoing: &Outgoing) -> Result<()> {
        let mut writer = lock(&self.writer);
        let seq = writer.seq + 1;
        let result = self.write_message(&mut writer, outgoing, seq);
        match result {
            Ok(event) => {
                writer.seq = seq;
                lock(&self.state).untaken.push_back(event);
                Ok(())
            }
            Err(error) => {
                let mut state = lock(&self.state);
                if matches!(error, Error::Disconnected) {
                    // A write found the receiver gone before the reader thread read the hang-up:
                    // from this answer on, `is_connected` agrees.
                    state.closed.get_or_insert_with(|| "the receiver is gone".into());
                }
                state.credits += 1;
                state.uncredited -= 1;
                let storage = state.leases.remove(&seq);
                drop(state);
                drop(writer);
                drop(storage); // may retire a user buffer's chunk, which takes the writer lock
                Err(error)
            }
        }
    }

    /// Waits for a credit (see [`Wait`]) and takes it.
    pub(super) fn take_credit(&self, wait: Wait) -> Result<()> {
        let mut state = lock(&self.state);
        if state.credits == 0 && state.greeted && state.closed.is_none() && !matches!(wait, Wait::Never) {
            drop(state);
            self.spin_for_credits();
            state = lock(&self.state);
        }
        loop {
            if let Some(refused) = &state.refused {
                return Err(Error::PeerRefused(refused.clone()));
            }
            if state.closed.is_some() {
                return Err(Error::Disconnected);
            }
            if state.credits > 0 {
                state.credits -= 1;
                state.uncredited += 1;
                return Ok(());
            }
            state = match wait {
                Wait::Never => return Err(Error::Full),
                Wait::Forever => self.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
                Wait::Until(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout);
                    }
                    self.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
    }

    /// Writes one message (and the announcements it needs) under the writer lock; the event it
    /// recorded, if any.
    fn write_message(&self, writer: &mut Writer, outgoing: &Outgoing, seq: u64) -> Result<Option<EventSlot>> {
        if self.link.remote {
            self.write_remote(outgoing, seq)?;
            return Ok(None);
        }
        self.flush_retired(writer, true)?;
        let (fence, event) = match &outgoing.fencing {
            Fencing::Done => (Fence::None, None),
            Fencing::Signal(signal) => {
                self.announce(writer, &signal.chunk)?;
                (Fence::Signal { chunk: signal.chunk.id, offset: signal.offset as u64, value: signal.value }, None)
            }
            Fencing::Event(stream) => {
                let slot = self.event_for(stream)?;
                (Fence::Event(slot.id), Some(slot))
            }
        };
        let give_back = |error: Error, event: Option<EventSlot>| {
            lock(&self.state).free_events.extend(event);
            error
        };
        // What each tensor becomes for this receiver (its route; copies queued now).
        let receiver = lock(&self.state).receiver.clone();
        let receiver = match receiver {
            Some(receiver) => receiver,
            None => return Err(give_back(Error::Disconnected, event)),
        };
        let sent = match route::send::prepare(&outgoing.tensors, outgoing.stream, &receiver, self.link.peer_pid()) {
            Ok(sent) => sent,
            Err(error) => return Err(give_back(error, event)),
        };
        let mut descriptors = Vec::with_capacity(sent.len());
        for (tensor, sent) in outgoing.tensors.iter().zip(&sent) {
            let storage = &sent.storage;
            let tensor_fence = match &sent.fence {
                Some(signal) => {
                    if let Err(error) = self.announce(writer, &signal.chunk) {
                        return Err(give_back(error, event));
                    }
                    Fence::Signal { chunk: signal.chunk.id, offset: signal.offset as u64, value: signal.value }
                }
                None if storage.chunk.device().is_some() => fence,
                None => Fence::None,
            };
            if let Err(error) = self.announce(writer, &storage.chunk) {
                return Err(give_back(error, event));
            }
            descriptors.push(TensorDesc {
                chunk: storage.chunk.id,
                storage_offset: storage.offset as u64,
                storage_len: storage.len as u64,
                view_offset: sent.view_offset as u64,
                dtype: tensor.dtype(),
                fence: tensor_fence,
                route: sent.route,
                target: sent.target,
                span: 0,
                shape: tensor.shape().to_vec(),
                strides: tensor.strides().to_vec(),
            });
        }
        {
            // Under the lock that handling a `Close` takes: either the closing is seen here, or
            // it sees this lease (and gives it back if the message was never read).
            let mut state = lock(&self.state);
            if state.closed.is_some() {
                drop(state);
                return Err(give_back(Error::Disconnected, event));
            }
            if !sent.is_empty() {
                state.leases.insert(seq, sent.into_iter().map(|s| s.storage).collect());
            }
        }
        let frame = Frame::Message {
            seq,
            sent_ns: outgoing.sent_ns,
            encoded_ns: super::monotonic_ns(),
            tensors: descriptors,
            payload: outgoing.payload.clone(),
        };
        match self.link.send(&frame, &[]) {
            Ok(()) => Ok(event),
            Err(error) => Err(give_back(error, event)),
        }
    }

    /// Writes one message to a receiver on another host: new communicators, the host tensors'
    /// bytes, and the message, whose GPU tensors NCCL moves (see `route/network.rs`). Nothing is
    /// leased: host bytes are copied, and NCCL's sources are held until their sends are done.
    fn write_remote(&self, outgoing: &Outgoing, seq: u64) -> Result<()> {
        let receiver = lock(&self.state).receiver.clone().ok_or(Error::Disconnected)?;
        // The message is leased until its NCCL sends are done (nothing else is held: host bytes
        // are copied), so `wait_released` means the data has left this process.
        lock(&self.state).leases.insert(seq, Vec::new());
        let lease: Arc<dyn Send + Sync> = Arc::new(RemoteLease { sender: self.me.clone(), seq });
        let me = self.me.clone();
        let alive = move || me.upgrade().is_some_and(|inner| !inner.link.peer_closed());
        let mut message = {
            let mut comms = lock(&self.comms);
            network::prepare(&outgoing.tensors, outgoing.stream, &receiver, &mut comms, lease, &alive)?
        };
        let frame = Frame::Message {
            seq,
            sent_ns: outgoing.sent_ns,
            encoded_ns: super::monotonic_ns(),
            tensors: std::mem::take(&mut message.descriptors),
            payload: outgoing.payload.clone(),
        };
        // Sends never wait for the receiver (what the socket cannot take yet is queued): a
        // message begun is finished, or the receiver would join its leftover bytes to the next
        // message's.
        let mut begun = false;
        for frame in message.frames.iter().chain(std::iter::once(&frame)) {
            if let Err(error) = self.link.send(frame, &[]) {
                if !begun {
                    // Nothing of it was written: the receiver never heard of its communicators.
                    lock(&self.comms).unwritten(message);
                }
                return Err(error);
            }
            begun = true;
        }
        // A communicator that failed leaves the receiver's receives of this message unpaired
        // (they would wait forever, or pair with a later message's sends): the connection ends,
        // so that both sides let their communicators go.
        message.written().inspect_err(|error| self.hang_up(&format!("an NCCL communicator failed: {error}")))
    }

    /// Sends the chunk's descriptor or handle the first time this peer needs it.
    fn announce(&self, writer: &mut Writer, chunk: &Chunk) -> Result<()> {
        if writer.announced.contains(&chunk.id) {
            return Ok(());
        }
        let device = chunk.device_uuid().unwrap_or_default().0;
        let (kind, legacy, fd) = match chunk.share()? {
            Shared::Fd(fd) if chunk.host().is_some() => (ChunkKind::Host, None, Some(fd)),
            Shared::Fd(fd) => (ChunkKind::Vmm, None, Some(fd)),
            Shared::Legacy(handle) => (ChunkKind::Legacy, Some(handle.to_bytes().to_vec()), None),
        };
        let frame =
            Frame::Chunk { id: chunk.id, len: chunk.len() as u64, kind, device, legacy, writable: chunk.writable };
        self.link.send(&frame, fd.as_slice())?;
        writer.announced.insert(chunk.id);
        // When the chunk goes (a user buffer freed, an idle arena chunk given back), the
        // receiver must drop its mapping: to free the memory, and since a user buffer's address
        // may be reused for other memory.
        let me: std::sync::Weak<dyn RetireListener> = self.me.clone();
        chunk.announced(me);
        Ok(())
    }

    /// Sends the retirements queued since the last write, waiting for room if `wait`, else
    /// keeping what does not fit for later.
    fn flush_retired(&self, writer: &mut Writer, wait: bool) -> Result<()> {
        let retired = std::mem::take(&mut *lock(&self.retired));
        let mut pending = retired.into_iter();
        while let Some(chunk) = pending.next() {
            writer.announced.remove(&chunk);
            let frame = Frame::Retire { chunk };
            let sent = if wait { self.link.send(&frame, &[]).map(|()| true) } else { self.link.try_send(&frame) };
            match sent {
                Ok(true) => {}
                Ok(false) => {
                    let mut retired = lock(&self.retired);
                    retired.push(chunk);
                    retired.extend(pending);
                    return Ok(());
                }
                Err(Error::Disconnected) => return Ok(()), // the receiver maps nothing any more
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// A pooled interprocess event, recorded on `stream` (a new one is announced first).
    fn event_for(&self, stream: &Stream) -> Result<EventSlot> {
        let pooled = lock(&self.state).free_events.pop();
        let slot = match pooled {
            Some(slot) => slot,
            None => {
                let event = Event::interprocess(stream.context())?;
                let id = {
                    let mut state = lock(&self.state);
                    state.next_event += 1;
                    state.next_event
                };
                let handle = event.export()?.to_bytes().to_vec();
                self.link.send(&Frame::Event { id, handle }, &[])?;
                EventSlot { id, event }
            }
        };
        if let Err(error) = slot.event.record(stream) {
            lock(&self.state).free_events.push(slot);
            return Err(error.into());
        }
        Ok(slot)
    }

    /// The reader thread: credits, releases, rejections and closings until the receiver hangs up.
    fn read_answers(self: Arc<Self>) {
        let mut buf = vec![0u8; MAX_PACKET];
        let mut assembler = Assembler::default();
        let greeting = loop {
            match self.link.recv(&mut assembler, &mut buf) {
                Ok(Read::Frame(Frame::Close { reason, .. }, _)) => {
                    break Err(Error::PeerRefused(Refusal::ByPeer(reason)));
                }
                Ok(Read::Frame(frame, _)) => break self.link.check_hello(frame),
                Ok(Read::Nothing) => continue,
                Ok(Read::HungUp) => break Err(Error::Disconnected),
                Err(error) => break Err(error),
            }
        };
        match greeting {
            Ok(greeting) => {
                let mut state = lock(&self.state);
                state.credits = greeting.capacity;
                state.greeted = true;
                state.receiver = Some(Arc::new((greeting.reach, greeting.routing)));
                drop(state);
                self.state_changed();
            }
            Err(error) => {
                tracing::warn!(%error, "the receiver's greeting failed");
                if let Error::PeerRefused(reason) = &error {
                    lock(&self.state).refused = Some(reason.clone());
                }
                return self.hang_up("the receiver's greeting failed");
            }
        }
        loop {
            match self.link.recv(&mut assembler, &mut buf) {
                Ok(Read::Frame(frame, _)) => {
                    if !self.handle(frame) {
                        break;
                    }
                }
                Ok(Read::Nothing) => {}
                Ok(Read::HungUp) => break,
                Err(error) => {
                    tracing::warn!(%error, "closing the connection to the receiver");
                    break;
                }
            }
        }
        self.hang_up("the receiver hung up");
    }

    /// Reads the receiver's frames on the sending thread while no credit is left, for up to the
    /// spin time: the reader thread may take some of them too, which is fine, since credits add
    /// up and releases are independent of each other (and a receiver's frames are never parts).
    fn spin_for_credits(&self) {
        let spin = Duration::from_nanos(self.spin_ns.load(Atomic::Relaxed));
        if spin.is_zero() {
            return;
        }
        // One spinning thread is enough; others wait for it (or the reader thread) to see credits.
        let Ok(mut buf) = self.spin_buf.try_lock() else { return };
        let until = Instant::now() + spin;
        buf.resize(MAX_PACKET, 0);
        let mut assembler = Assembler::default();
        while Instant::now() < until && lock(&self.state).credits == 0 {
            match self.link.try_recv(&mut assembler, &mut buf).map(|(read, _)| read) {
                Ok(Read::Frame(frame, _)) => {
                    if !self.handle(frame) {
                        // The reader thread then reads the hang-up and returns the leases.
                        return self.link.shutdown(rustix::net::Shutdown::Both);
                    }
                }
                // A hang-up or an error: the reader thread sees it too and cleans up.
                Ok(Read::HungUp) | Err(_) => return,
                Ok(Read::Nothing) => std::hint::spin_loop(),
            }
        }
    }

    /// Handles a frame from the receiver. `false`: the frame was not one an honest receiver
    /// sends, and the connection must close.
    fn handle(&self, frame: Frame) -> bool {
        // Storage is dropped after the lock is let go: dropping a user buffer's chunk retires it.
        let mut released = Vec::new();
        let mut state = lock(&self.state);
        match frame {
            Frame::Release { messages } => {
                released.extend(messages.iter().filter_map(|seq| state.leases.remove(seq)));
            }
            Frame::Credit { count } => {
                if count > state.uncredited {
                    tracing::warn!(
                        count,
                        uncredited = state.uncredited,
                        "a receiver granted more than it may; closing"
                    );
                    return false;
                }
                state.credits += count;
                state.uncredited -= count;
                for _ in 0..count {
                    if let Some(Some(slot)) = state.untaken.pop_front() {
                        state.free_events.push(slot);
                    }
                }
            }
            Frame::Rejected { seq, reason } => {
                tracing::warn!(seq, %reason, "the receiver refused a message");
                released.extend(state.leases.remove(&seq));
                state.rejected.push(Rejection { seq, reason });
            }
            Frame::Close { read_up_to, reason } => {
                tracing::info!(%reason, "the receiver closed the channel");
                state.closed.get_or_insert(reason);
                // Messages it never read are ours again; those it read come back by release.
                let unread: Vec<u64> = state.leases.keys().copied().filter(|&seq| seq > read_up_to).collect();
                released.extend(unread.iter().filter_map(|seq| state.leases.remove(seq)));
            }
            other => {
                tracing::warn!(?other, "unexpected frame from a receiver; closing");
                return false;
            }
        }
        state.dropping += released.len();
        drop(state);
        let count = released.len();
        drop(released);
        lock(&self.state).dropping -= count;
        self.state_changed();
        true
    }

    /// The receiver's end is closed (its process is gone, or it released everything and let
    /// go): everything it held comes back now (dropped outside the lock).
    fn hang_up(&self, why: &str) {
        self.link.shutdown(rustix::net::Shutdown::Both);
        lock(&self.comms).abort();
        let mut state: MutexGuard<'_, SenderState> = lock(&self.state);
        state.closed.get_or_insert_with(|| why.to_string());
        let released = std::mem::take(&mut state.leases);
        drop(state);
        drop(released);
        self.state_changed();
    }

    /// Wakes whoever waits for the state to change: blocked threads and async sends.
    fn state_changed(&self) {
        self.changed.notify_all();
        for waker in std::mem::take(&mut *lock(&self.wakers)) {
            waker.wake();
        }
    }

    /// Has `waker` woken at the next change of the state (the async send's wait for credit).
    #[cfg(feature = "tokio")]
    pub(super) fn wake_on_change(&self, waker: &std::task::Waker) {
        let mut wakers = lock(&self.wakers);
        if !wakers.iter().any(|w| w.will_wake(waker)) {
            wakers.push(waker.clone());
        }
    }
}
