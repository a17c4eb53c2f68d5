//! The receiving end's typed API and its options. Its connections (`recv/connections.rs`) are
//! polled by the thread that calls `recv`, so a message goes from the socket to the caller with no
//! hand-off between threads; this module decodes what they deliver as a `T`.

use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ipc_core::seqpacket::{Connection, Listener};
use ipc_core::tcp::TcpListener;
use ipc_core::{Stream, Uuid};
use serde::de::DeserializeOwned;

use super::DEFAULT_CAPACITY;
use crate::clock::monotonic_ns;
use crate::error::{Error, Result};
use crate::links::endpoint::{self, Endpoint};
use crate::links::link::Link;
use crate::recv::acceptor::{Acceptor, Greeting, Listening};
use crate::recv::connection::{MessageInfo, Ready};
use crate::recv::connections::Connections;
use crate::route::{MAX_SOURCES, Routing};
use crate::secret::Secret;
use crate::side_table;

/// How a receiver is set up, for the deprecated [`Receiver::bind_with`] and
/// [`from_parent_with`](crate::from_parent_with): build receivers with [`Receiver::builder`]
/// instead. Not constructible with a literal (`#[non_exhaustive]`): start from `default()`.
///
/// ```
/// use tensor_queue::route::{Routing, Strictness};
/// use tensor_queue::{DEFAULT_CAPACITY, ReceiverOptions};
/// let mut options = ReceiverOptions::default();
/// assert_eq!(options.capacity, DEFAULT_CAPACITY);
/// options.routing = Routing::default().strict(Strictness::ZeroCopy);
/// ```
///
/// ```compile_fail,E0639
/// use tensor_queue::{route::Routing, ReceiverOptions};
/// let options = ReceiverOptions { capacity: 4, routing: Routing::default(), secret: None };
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceiverOptions {
    /// Messages each sender may have sent and not yet received (at least 1).
    pub capacity: u32,
    /// Where GPU tensors land and which routes are refused (see [`crate::route`]).
    pub routing: Routing,
    /// For a receiver bound to TCP: the secret senders must prove they hold; `None`: the one in
    /// `TQ_SECRET`. Unused for Unix sockets.
    pub secret: Option<Secret>,
}

impl Default for ReceiverOptions {
    fn default() -> ReceiverOptions {
        ReceiverOptions { capacity: DEFAULT_CAPACITY, routing: Routing::default(), secret: None }
    }
}

impl ReceiverOptions {
    /// The options with a capacity of at least 1, or why they cannot be used.
    pub(super) fn checked(mut self) -> Result<ReceiverOptions> {
        self.capacity = self.capacity.max(1);
        if self.routing.per_source.len() > MAX_SOURCES {
            return Err(Error::TooManySources { count: self.routing.per_source.len(), max: MAX_SOURCES });
        }
        Ok(self)
    }

    /// What the receiver says to every sender it greets.
    fn greeting(&self) -> Greeting {
        Greeting { capacity: self.capacity, routing: self.routing.clone() }
    }

    /// Listens at `endpoint`.
    fn listen(&self, endpoint: Endpoint) -> Result<Listening> {
        endpoint.check()?;
        Ok(match endpoint {
            Endpoint::Unix(path) => Listening::Unix(Listener::bind(path)?),
            Endpoint::Tcp(address) => {
                let secret = endpoint::secret(self.secret.as_ref())?;
                Listening::Tcp(TcpListener::bind(address.as_str())?, secret)
            }
        })
    }
}

/// The receiving end of a typed channel; any number of senders may connect.
///
/// ```no_run
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{Error, Receiver, Tensor};
/// let mut receiver = Receiver::<Vec<Tensor>>::bind("/tmp/queue.sock")?;
/// receiver.expect_senders(4); // four independent producers: the stream ends when all four left
/// loop {
///     match receiver.recv() {
///         Ok(tensors) => println!("{} tensors", tensors.len()),
///         Err(Error::Rejected { pid, seq, reason, .. }) => eprintln!("pid {pid} message {seq}: {reason}"),
///         Err(Error::ProducerFailed { pid, .. }) => eprintln!("pid {pid} died before its data was done"),
///         Err(Error::Disconnected) => break,
///         Err(other) => return Err(other),
///     }
/// }
/// # Ok(()) }
/// ```
pub struct Receiver<T> {
    /// The connections `recv` polls, and what was read from them.
    connections: Connections,
    /// The receiver's descriptor registered with tokio's reactor, on first async use.
    #[cfg(feature = "tokio")]
    pub(super) registration: Option<super::asynchronous::Registration>,
    /// The `Stream` has returned its last item.
    #[cfg(feature = "tokio")]
    pub(super) stream_ended: bool,
    _message: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> Receiver<T> {
    /// Listens at `path` with the default capacity per sender.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Sender};
    /// let path = std::env::temp_dir().join(format!("doc-{}-bind.sock", std::process::id()));
    /// let mut receiver = Receiver::<Vec<f32>>::bind(&path)?;
    /// let sender = Sender::<Vec<f32>>::connect(&path)?; // any process of this user on this machine
    /// sender.send(&vec![1.0, 2.0])?;
    /// assert_eq!(receiver.recv()?, [1.0, 2.0]);
    /// # Ok(()) }
    /// ```
    pub fn bind(endpoint: impl Into<Endpoint>) -> Result<Receiver<T>> {
        Receiver::bind_with_capacity(endpoint, DEFAULT_CAPACITY)
    }

    /// Listens at `path`; each sender may have `capacity` messages not yet received.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-bind-capacity.sock", std::process::id()));
    /// let mut receiver = Receiver::<u32>::bind_with_capacity(&path, 2)?;
    /// let sender = Sender::<u32>::connect(&path)?;
    /// sender.wait_ready(Duration::from_secs(10))?;
    /// sender.try_send(&1)?;
    /// sender.try_send(&2)?;
    /// assert!(matches!(sender.try_send(&3), Err(Error::Full)), "a third waits for the receiver");
    /// assert_eq!(receiver.recv()?, 1);
    /// # Ok(()) }
    /// ```
    pub fn bind_with_capacity(endpoint: impl Into<Endpoint>, capacity: u32) -> Result<Receiver<T>> {
        Receiver::bind_options(endpoint.into(), ReceiverOptions { capacity, ..ReceiverOptions::default() })
    }

    /// Listens at `path` with `options`: the capacity per sender, and where GPU tensors land
    /// (see [`crate::route`]).
    ///
    /// ```
    /// # #![allow(deprecated)]
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::route::{Landing, Routing};
    /// use tensor_queue::{DType, Receiver, ReceiverOptions, Sender, Tensor};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-bind-with.sock", std::process::id()));
    /// // A consumer that wants host tensors, whatever GPU they were made on.
    /// let mut options = ReceiverOptions::default();
    /// options.routing = Routing::default().land(Landing::Host);
    /// let mut receiver = Receiver::<Tensor>::bind_with(&path, options)?;
    /// let sender = Sender::<Tensor>::connect(&path)?;
    /// sender.send(&Tensor::from_slice(&[1u8, 2], DType::U8, &[2])?)?;
    /// assert_eq!(receiver.recv()?.to_vec::<u8>()?, [1, 2]);
    /// # Ok(()) }
    /// ```
    #[deprecated(note = "use `Receiver::builder().capacity(..).routing(..).secret(..).bind(endpoint)`")]
    pub fn bind_with(endpoint: impl Into<Endpoint>, options: ReceiverOptions) -> Result<Receiver<T>> {
        Receiver::bind_options(endpoint.into(), options)
    }

    /// Listens at `endpoint` with `options` (what the builder and the deprecated `bind_with` do).
    pub(super) fn bind_options(endpoint: Endpoint, options: ReceiverOptions) -> Result<Receiver<T>> {
        let options = options.checked()?;
        let mut receiver = Receiver::new(&options)?;
        let listening = options.listen(endpoint)?;
        receiver.connections.accept_from(Acceptor::start(listening, options.greeting())?)?;
        Ok(receiver)
    }

    /// A receiver over an already connected socket (see [`super::from_parent`]).
    pub(crate) fn from_connection(connection: Connection, capacity: u32) -> Result<Receiver<T>> {
        Receiver::from_connection_with(connection, ReceiverOptions { capacity, ..ReceiverOptions::default() })
    }

    /// A receiver over an already connected socket, with `options`.
    pub(crate) fn from_connection_with(connection: Connection, options: ReceiverOptions) -> Result<Receiver<T>> {
        let options = options.checked()?;
        let mut receiver = Receiver::new(&options)?;
        let link = Link::new(Box::new(connection))?;
        options.greeting().greet(&link)?;
        receiver.connections.adopt(link)?;
        Ok(receiver)
    }

    fn new(options: &ReceiverOptions) -> Result<Receiver<T>> {
        Ok(Receiver {
            connections: Connections::new(options.capacity, options.routing.clone())?,
            #[cfg(feature = "tokio")]
            registration: None,
            #[cfg(feature = "tokio")]
            stream_ended: false,
            _message: PhantomData,
        })
    }

    /// Where senders connect, for a bound receiver.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::Receiver;
    /// # let path = std::env::temp_dir().join(format!("doc-{}-path.sock", std::process::id()));
    /// let receiver = Receiver::<u32>::bind(&path)?;
    /// let address = receiver.path().expect("a bound receiver has a path"); // what senders connect to
    /// assert_eq!(address, path);
    /// # Ok(()) }
    /// ```
    pub fn path(&self) -> Option<&Path> {
        self.connections.path()
    }

    /// Where senders on other hosts connect, for a receiver bound to TCP (with port 0, the port
    /// the system chose).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Secret};
    /// let secret = Secret::from_bytes(*b"a secret of at least 16 bytes")?;
    /// let receiver = Receiver::<u32>::builder().secret(secret).bind("tcp://127.0.0.1:0")?;
    /// let address = receiver.local_addr().expect("bound to TCP");
    /// assert_ne!(address.port(), 0);
    /// println!("senders connect to tcp://{address}");
    /// # Ok(()) }
    /// ```
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.connections.local_addr()
    }

    /// Where this receiver's GPU tensors land, and which routes it refuses (the policy its
    /// senders were told in the handshake).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::route::{Landing, Routing};
    /// use tensor_queue::Receiver;
    /// # let path = std::env::temp_dir().join(format!("doc-{}-routing.sock", std::process::id()));
    /// let routing = Routing::default().land(Landing::Host);
    /// let receiver = Receiver::<u8>::builder().routing(routing.clone()).bind(&path)?;
    /// assert_eq!(receiver.routing(), &routing);
    /// # Ok(()) }
    /// ```
    pub fn routing(&self) -> &Routing {
        self.connections.routing()
    }

    /// Makes `recv` poll its sockets without sleeping for up to `spin` before it blocks.
    ///
    /// A blocked `recv` is woken by the kernel, which costs a few microseconds per message (the
    /// socket floor in `BENCHMARKS.md`); spinning takes that off the hand-off's latency at the
    /// price of a busy CPU core while waiting, as iceoryx2's busy-wait mode does. Zero (the
    /// default) never spins.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-receiver-spin.sock", std::process::id()));
    /// # let mut receiver = Receiver::<u64>::bind(&path)?;
    /// # let sender = Sender::<u64>::connect(&path)?;
    /// receiver.set_spin(Duration::from_micros(20)); // latency first: spend a core while waiting
    /// for i in 0..100 {
    ///     sender.send(&i)?;
    ///     assert_eq!(receiver.recv()?, i);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn set_spin(&mut self, spin: Duration) {
        self.connections.set_spin(spin);
    }

    /// Waits for the next message.
    ///
    /// Returns [`Error::Disconnected`] when no sender is connected any more (after at least one
    /// was) and every message they sent has been received. For a bound receiver this describes
    /// the moment: a new sender may still connect, and `recv` then waits for it again; make the
    /// end definite with [`Receiver::expect_senders`] or [`Receiver::stop_accepting`].
    ///
    /// Two errors concern one message only, and the next call goes on with the next:
    /// [`Error::Rejected`] (the message could not be used here, for example a tensor on a GPU this
    /// process cannot see, or a payload that is not a `T` or nests deeper than the 256 levels a
    /// [`Sender::send`](crate::Sender::send) allows; its sender is told) and [`Error::ProducerFailed`] (its producer died
    /// before its GPU work on the message was done, so the data is not what it sent).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-recv.sock", std::process::id()));
    /// # let mut receiver = Receiver::<String>::bind(&path)?;
    /// # let sender = Sender::<String>::connect(&path)?;
    /// sender.send(&"first".to_string())?;
    /// sender.send(&"second".to_string())?;
    /// drop(sender);
    /// let mut received = Vec::new();
    /// loop {
    ///     match receiver.recv() {
    ///         Ok(message) => received.push(message),
    ///         Err(Error::Disconnected) => break, // after everything it sent
    ///         Err(other) => return Err(other),
    ///     }
    /// }
    /// assert_eq!(received, ["first", "second"]);
    /// # Ok(()) }
    /// ```
    pub fn recv(&mut self) -> Result<T> {
        self.recv_with_info(None).map(|(message, _)| message)
    }

    /// Waits up to `timeout` for the next message: [`Error::Timeout`] when none came, whatever
    /// the timeout, zero included ([`try_recv`](Receiver::try_recv) is the look that does not
    /// wait, and says [`Error::Empty`]).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::Duration;
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-recv-timeout.sock", std::process::id()));
    /// let mut receiver = Receiver::<u32>::bind(&path)?;
    /// let _sender = Sender::<u32>::connect(&path)?; // connected, but sends nothing
    /// let waited = receiver.recv_timeout(Duration::from_millis(10));
    /// assert!(matches!(waited, Err(Error::Timeout)));
    /// assert!(matches!(receiver.recv_timeout(Duration::ZERO), Err(Error::Timeout)));
    /// # Ok(()) }
    /// ```
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<T> {
        self.recv_with_info(Some(timeout)).map(|(message, _)| message)
    }

    /// The next message if one is waiting.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::{Duration, Instant};
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-try-recv.sock", std::process::id()));
    /// # let mut receiver = Receiver::<u32>::bind(&path)?;
    /// # let sender = Sender::<u32>::connect(&path)?;
    /// assert!(matches!(receiver.try_recv(), Err(Error::Empty)));
    /// sender.send(&5)?;
    /// let deadline = Instant::now() + Duration::from_secs(10);
    /// let n = loop {
    ///     match receiver.try_recv() {
    ///         Ok(n) => break n,
    ///         Err(Error::Empty) => assert!(Instant::now() < deadline), // other work of the loop here
    ///         Err(other) => return Err(other),
    ///     }
    /// };
    /// assert_eq!(n, 5);
    /// # Ok(()) }
    /// ```
    pub fn try_recv(&mut self) -> Result<T> {
        match self.recv_with_info(Some(Duration::ZERO)) {
            Ok((message, _)) => Ok(message),
            // Nothing waiting: for a look that does not wait, that is `Empty`.
            Err(Error::Timeout) => Err(Error::Empty),
            Err(other) => Err(other),
        }
    }

    /// The next message and when each stage of its hand-off happened, waiting up to `timeout`
    /// (`None`: without end; [`Error::Timeout`] when none came, as for
    /// [`recv_timeout`](Receiver::recv_timeout)).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-recv-info.sock", std::process::id()));
    /// # let mut receiver = Receiver::<u32>::bind(&path)?;
    /// # let sender = Sender::<u32>::connect(&path)?;
    /// sender.send(&42)?;
    /// let (n, info) = receiver.recv_with_info(None)?;
    /// assert_eq!((n, info.seq, info.sender_pid), (42, 1, std::process::id()));
    /// println!("from send to decoded: {} ns", info.decoded_ns - info.sent_ns);
    /// # Ok(()) }
    /// ```
    pub fn recv_with_info(&mut self, timeout: Option<Duration>) -> Result<(T, MessageInfo)> {
        // A message from another host waits, parked, while an NCCL worker queues its receives
        // (about 100 us): it is decoded meanwhile, from a copy of its table (its tensors are
        // views of the storage records it keeps). Should another message come first, or the wait
        // end in an error, the copy is dropped and the message is decoded again when delivered.
        let mut early: Option<(u64, u64, T)> = None;
        let next = self.connections.next(timeout, &mut |ready: &Ready| {
            if let Ok(message) = side_table::decode::<T>(&ready.payload, ready.tensors.clone()) {
                early = Some((ready.info.connection, ready.info.seq, message));
            }
        });
        let result = next.and_then(|ready| match early.take() {
            Some((connection, seq, message)) if (connection, seq) == (ready.info.connection, ready.info.seq) => {
                let mut info = ready.info;
                info.decoded_ns = monotonic_ns();
                Ok((message, info))
            }
            _ => self.deliver(ready),
        });
        self.connections.note_pending();
        result
    }

    /// Decodes a message ready to be taken.
    fn deliver(&mut self, ready: Ready) -> Result<(T, MessageInfo)> {
        let Ready { peer, tensors, payload, mut info, .. } = ready;
        // A payload that is not a `T` is refused alone, like any message the receiver cannot
        // use, at this one point whatever the codec: the sender hears why (`take_rejected`),
        // and its tensors, dropped by the decoder, go back to it.
        // Holds the message's lease (its tensors share it) until the sender has been told, so
        // that the refusal reaches it before the release does: `wait_released` then implies
        // `take_rejected` knows.
        let hold = tensors.hold();
        let message = side_table::decode(&payload, tensors).map_err(|error| {
            let cause = match error {
                Error::Decode(cause) => cause,
                other => other.to_string(),
            };
            let reason = undecodable::<T>(&cause);
            peer.reject(info.seq, reason.clone());
            let (pid, connection, seq) = (info.sender_pid, info.connection, info.seq);
            self.connections.report(Error::Rejected { pid, connection, seq, reason: reason.clone() });
            Error::Rejected { pid, connection, seq, reason }
        });
        drop(hold);
        let message = message?;
        info.decoded_ns = monotonic_ns();
        Ok((message, info))
    }

    /// Makes this (bound) receiver's end of stream definite when several independent senders
    /// feed it: once `count` senders have connected, no more may join (a sender beyond, even one
    /// connecting at the same moment, is turned away before it could send anything: its first
    /// send, or `wait_ready`, says [`Error::PeerRefused`](crate::Error::PeerRefused), or its
    /// connect [`Error::NoReceiver`](crate::Error::NoReceiver) once the receiver has stopped
    /// listening), and
    /// `recv` returns [`Error::Disconnected`](crate::Error::Disconnected) only when all of them
    /// have left and every message they sent is received (not in a moment between two senders).
    /// `expect_senders(0)` ends the stream at once.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-expect-senders.sock", std::process::id()));
    /// let mut receiver = Receiver::<u32>::bind(&path)?;
    /// receiver.expect_senders(2);
    /// for worker in 0..2 {
    ///     Sender::<u32>::connect(&path)?.send(&worker)?; // connects, sends and leaves
    /// }
    /// let mut received = Vec::new();
    /// loop {
    ///     match receiver.recv() {
    ///         Ok(worker) => received.push(worker),
    ///         Err(Error::Disconnected) => break, // both came and went: a definite end
    ///         Err(other) => return Err(other),
    ///     }
    /// }
    /// received.sort();
    /// assert_eq!(received, [0, 1]);
    /// # Ok(()) }
    /// ```
    pub fn expect_senders(&mut self, count: usize) {
        self.connections.expect_senders(count);
    }

    /// Lets no more senders join (the socket file goes): `recv` returns
    /// [`Error::Disconnected`](crate::Error::Disconnected) once the senders connected now have
    /// left and every message they sent is received.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-stop-accepting.sock", std::process::id()));
    /// # let mut receiver = Receiver::<u32>::bind(&path)?;
    /// # let sender = Sender::<u32>::connect(&path)?;
    /// sender.send(&1)?;
    /// assert_eq!(receiver.recv()?, 1); // this sender has joined
    /// receiver.stop_accepting()?;
    /// assert!(Sender::<u32>::connect(&path).is_err(), "the socket file is gone");
    /// drop(sender);
    /// assert!(matches!(receiver.recv(), Err(Error::Disconnected)));
    /// # Ok(()) }
    /// ```
    pub fn stop_accepting(&mut self) -> Result<()> {
        self.connections.stop_accepting()
    }

    /// What went wrong since the last call, oldest first, as errors to match on: connections
    /// closed ([`Error::ConnectionClosed`](crate::Error::ConnectionClosed), with the cause),
    /// peers refused ([`Error::PeerRefused`](crate::Error::PeerRefused)) and messages rejected
    /// ([`Error::Rejected`](crate::Error::Rejected), also returned by `recv`). Other senders were
    /// not affected by any of them. The last 1,024 are kept: a receiver that never calls this,
    /// under a storm of refused connectors, keeps a bounded list (each error is also logged).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::time::{Duration, Instant};
    /// use ipc_core::seqpacket::Connection;
    /// use tensor_queue::{Error, Receiver, Sender};
    /// # let path = std::env::temp_dir().join(format!("doc-{}-take-errors.sock", std::process::id()));
    /// # let mut receiver = Receiver::<u32>::bind(&path)?;
    /// # let sender = Sender::<u32>::connect(&path)?;
    /// let rogue = Connection::connect(&path)?; // not a tensor-queue sender
    /// rogue.send(b"not a frame", &[])?;
    /// sender.send(&1)?;
    /// assert_eq!(receiver.recv()?, 1); // other senders go on
    /// let deadline = Instant::now() + Duration::from_secs(10);
    /// let mut errors = receiver.take_errors();
    /// while errors.is_empty() && Instant::now() < deadline {
    ///     errors = receiver.take_errors();
    /// }
    /// assert!(matches!(errors[..], [Error::ConnectionClosed { .. }]), "{errors:?}");
    /// # Ok(()) }
    /// ```
    pub fn take_errors(&mut self) -> Vec<Error> {
        self.connections.take_errors()
    }

    /// A stream of `device` to queue the caller's own work on: the one set with
    /// [`Receiver::set_stream`], if any, else a new stream of that GPU. It is not, in general,
    /// the stream received tensors are ordered on: each sender's tensors have a stream of their
    /// own ([`Tensor::stream`](crate::Tensor::stream)), so that one producer's slow work never
    /// holds up another's; order work after a tensor with
    /// [`Tensor::copy_on`](crate::Tensor::copy_on) or a wait on its stream.
    ///
    /// (Named `stream` before, when it was always the stream tensors were ordered on; the new
    /// name makes code written for that meaning fail to compile instead of reading unfinished
    /// data.)
    ///
    /// ```compile_fail
    /// # fn old(receiver: &tensor_queue::Receiver<tensor_queue::Tensor>, device: &tensor_queue::Uuid) {
    /// let ordered_on = receiver.stream(device); // the old name is gone
    /// # }
    /// ```
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Receiver, Tensor, TensorDevice};
    /// let mut receiver = Receiver::<Tensor>::bind("/tmp/activations.sock")?;
    /// let x = receiver.recv()?;
    /// let TensorDevice::Cuda(device) = x.device() else { panic!("a host tensor") };
    /// let work = receiver.work_stream(&device)?; // a new stream of x's GPU: none was set
    /// let y = x.copy_on(&work)?; // after x's producer, on `work`
    /// # drop(y);
    /// # Ok(()) }
    /// ```
    pub fn work_stream(&self, device: &Uuid) -> Result<Arc<Stream>> {
        let devices = self.connections.devices();
        match devices.chosen(device) {
            Some(stream) => Ok(stream),
            None => Ok(Arc::new(Stream::new(&devices.context(device)?)?)),
        }
    }

    /// Orders GPU tensors of `stream`'s device on `stream` from now on, whichever sender they
    /// come from: work queued on it waits for every producer's fences, so a slow producer then
    /// delays the others' tensors too.
    ///
    /// ```no_run
    /// # fn main() -> tensor_queue::Result<()> {
    /// use std::sync::Arc;
    /// use tensor_queue::{Context, Receiver, Stream, Tensor};
    /// let mut receiver = Receiver::<Tensor>::bind("/tmp/activations.sock")?;
    /// let context = Context::on_ordinal(0)?;
    /// let compute = Arc::new(Stream::new(&context)?);
    /// receiver.set_stream(compute.clone())?; // every sender's tensors, ordered on our one stream
    /// let x = receiver.recv()?;
    /// assert!(Arc::ptr_eq(x.stream().expect("a GPU tensor"), &compute));
    /// # Ok(()) }
    /// ```
    pub fn set_stream(&self, stream: Arc<Stream>) -> Result<()> {
        self.connections.devices().choose(stream)
    }
}

/// Why a payload was refused: the receiver's type, and the codec's cause, which may be empty
/// (an input that ended early says nothing more).
fn undecodable<T>(cause: &str) -> String {
    let cause = cause.trim().trim_end_matches(':').trim();
    let cause =
        if cause.is_empty() || cause == "io error" { "the payload ended before the message did" } else { cause };
    format!(
        "the message does not decode as the receiver's type `{}` (do both sides use the same message type?): {cause}",
        std::any::type_name::<T>()
    )
}

/// A descriptor that becomes readable when [`recv`](Receiver::recv) may make progress: a message
/// or a hang-up arrived, a sender joined, or a message read earlier waits to be taken (also the
/// end of the stream, when `recv` would return [`Error::Disconnected`]). Wait on it with `poll`,
/// epoll, mio or [`Select`](super::Select), then take what is there with
/// [`try_recv`](Receiver::try_recv), which may answer [`Error::Empty`] when what woke it was not
/// a message (a credit or a release): wait again. It is level-triggered: it stays readable until
/// `try_recv` has taken what made it so.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use std::os::fd::AsFd;
/// use rustix::event::{PollFd, PollFlags, poll};
/// use tensor_queue::{Receiver, Sender};
/// # let path = std::env::temp_dir().join(format!("doc-{}-as-fd.sock", std::process::id()));
/// let mut receiver = Receiver::<u32>::bind(&path)?;
/// Sender::<u32>::connect(&path)?.send(&9)?;
/// let value = loop {
///     let mut fds = [PollFd::new(&receiver, PollFlags::IN)]; // with any other descriptors
///     poll(&mut fds, None).expect("poll");
///     if let Ok(value) = receiver.try_recv() {
///         break value;
///     }
/// };
/// assert_eq!(value, 9);
/// # Ok(()) }
/// ```
impl<T> std::os::fd::AsFd for Receiver<T> {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.connections.fd()
    }
}
