//! One way to build each end with options: [`Receiver::builder`] and [`Sender::builder`].

use std::marker::PhantomData;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::child::from_parent_options;
use super::receiver::Receiver;
use super::receiver::ReceiverOptions;
use super::sender::Sender;
use crate::error::Result;
use crate::links::endpoint::{ConnectOptions, Endpoint};
use crate::route::Routing;
use crate::secret::Secret;

/// Builds a [`Receiver`]: set what differs from the defaults, then [`bind`](ReceiverBuilder::bind)
/// (or, in a child started by [`spawn`](crate::spawn), [`from_parent`](ReceiverBuilder::from_parent)).
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::route::{Landing, Routing};
/// use tensor_queue::{DType, Receiver, Sender, Tensor};
/// # let path = std::env::temp_dir().join(format!("doc-{}-builder.sock", std::process::id()));
/// // Two messages in flight per sender, every tensor landing in host memory.
/// let mut receiver = Receiver::<Tensor>::builder()
///     .capacity(2)
///     .routing(Routing::default().land(Landing::Host))
///     .bind(&path)?;
/// let sender = Sender::<Tensor>::connect(&path)?;
/// sender.send(&Tensor::from_slice(&[1u8, 2], DType::U8, &[2])?)?;
/// assert_eq!(receiver.recv()?.to_vec::<u8>()?, [1, 2]);
/// assert_eq!(receiver.routing().landing, Landing::Host);
/// # Ok(()) }
/// ```
#[must_use = "a builder does nothing until `bind` or `from_parent`"]
pub struct ReceiverBuilder<T> {
    options: ReceiverOptions,
    message: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> Receiver<T> {
    /// A builder for a receiver with options: the capacity per sender, the routing policy, and
    /// for TCP the secret.
    pub fn builder() -> ReceiverBuilder<T> {
        ReceiverBuilder { options: ReceiverOptions::default(), message: PhantomData }
    }
}

impl<T: DeserializeOwned> ReceiverBuilder<T> {
    /// Messages each sender may have sent and not yet received (at least 1: 0 is taken as 1;
    /// default [`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY)).
    pub fn capacity(mut self, capacity: u32) -> Self {
        self.options.capacity = capacity;
        self
    }

    /// Where GPU tensors land and which routes are refused (see [`crate::route`]).
    pub fn routing(mut self, routing: Routing) -> Self {
        self.options.routing = routing;
        self
    }

    /// For a receiver bound to TCP: the secret senders must prove they hold (default: the one in
    /// `TQ_SECRET`, [`SECRET_ENV`](crate::SECRET_ENV)). Unused for Unix sockets.
    pub fn secret(mut self, secret: Secret) -> Self {
        self.options.secret = Some(secret);
        self
    }

    /// Listens at `endpoint`: a socket path, or `tcp://host:port`.
    pub fn bind(self, endpoint: impl Into<Endpoint>) -> Result<Receiver<T>> {
        Receiver::bind_options(endpoint.into(), self.options)
    }

    /// In a child started by [`spawn`](crate::spawn): the receiving end of the channel from the
    /// parent, with these options (see [`from_parent`](crate::from_parent)).
    pub fn from_parent(self) -> Result<Receiver<T>> {
        from_parent_options(self.options)
    }
}

impl<T> Clone for ReceiverBuilder<T> {
    fn clone(&self) -> Self {
        ReceiverBuilder { options: self.options.clone(), message: PhantomData }
    }
}

impl<T> std::fmt::Debug for ReceiverBuilder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverBuilder")
            .field("capacity", &self.options.capacity)
            .field("routing", &self.options.routing)
            .field("secret", &self.options.secret)
            .finish()
    }
}

/// Builds a [`Sender`]: set what differs from the defaults, then
/// [`connect`](SenderBuilder::connect).
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use std::time::Duration;
/// use tensor_queue::{Receiver, Secret, Sender};
/// let secret = Secret::from_bytes(*b"a secret of at least 16 bytes")?; // usually TQ_SECRET
/// let mut receiver = Receiver::<String>::builder().secret(secret.clone()).bind("tcp://127.0.0.1:0")?;
/// let endpoint = format!("tcp://{}", receiver.local_addr().expect("bound to TCP"));
/// let sender = Sender::<String>::builder().secret(secret).timeout(Duration::from_secs(5)).connect(endpoint)?;
/// sender.send(&"over TCP".to_string())?;
/// assert_eq!(receiver.recv()?, "over TCP");
/// # Ok(()) }
/// ```
#[must_use = "a builder does nothing until `connect`"]
pub struct SenderBuilder<T> {
    options: ConnectOptions,
    message: PhantomData<fn(T)>,
}

impl<T: Serialize> Sender<T> {
    /// A builder for a sender with options: for TCP, the secret to prove and how long
    /// connecting may take.
    pub fn builder() -> SenderBuilder<T> {
        SenderBuilder { options: ConnectOptions::default(), message: PhantomData }
    }
}

impl<T: Serialize> SenderBuilder<T> {
    /// The secret a TCP receiver expects (default: the one in `TQ_SECRET`,
    /// [`SECRET_ENV`](crate::SECRET_ENV)). Unused for Unix sockets.
    pub fn secret(mut self, secret: Secret) -> Self {
        self.options.secret = Some(secret);
        self
    }

    /// How long connecting and authenticating over TCP may take together (default 10 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = timeout;
        self
    }

    /// Across hosts (a TCP channel to a receiver with GPUs): a message whose GPU tensors total
    /// at most `bytes` (each counted by the bytes its view touches) sends them inline in its TCP
    /// frame, copied to the host after the producer's work and onto the receiver's GPU there,
    /// rather than through an NCCL transfer, whose fixed cost (about 75 us a side) a small
    /// tensor's copies undercut. `0`: always NCCL. Default: the value of
    /// [`INLINE_GPU_ENV`](crate::route::INLINE_GPU_ENV), else
    /// [`DEFAULT_INLINE_GPU_UP_TO`](crate::route::DEFAULT_INLINE_GPU_UP_TO) (64 KiB); `tq doctor
    /// --measure` suggests one for a machine. The receiver gets the same tensors either way
    /// (device, dtype, shape, strides, data), with [`TransferPath::Tcp`](crate::TransferPath::Tcp).
    /// A receiver that refuses staging ([`Strictness::NoStaging`](crate::route::Strictness::NoStaging))
    /// always gets NCCL. Above [`MAX_INLINE_GPU_UP_TO`](crate::route::MAX_INLINE_GPU_UP_TO),
    /// `connect` fails with [`Error::Invalid`](crate::Error::Invalid).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{Error, Receiver, Secret, Sender};
    /// let secret = Secret::from_bytes(*b"a secret of at least 16 bytes")?;
    /// let _receiver = Receiver::<u32>::builder().secret(secret.clone()).bind("tcp://127.0.0.1:0")?;
    /// # let endpoint = format!("tcp://{}", _receiver.local_addr().expect("TCP"));
    /// let sender = Sender::<u32>::builder().secret(secret.clone()).inline_gpu_up_to(256 << 10).connect(&endpoint)?;
    /// assert_eq!(sender.inline_gpu_up_to(), 256 << 10);
    /// let too_much = Sender::<u32>::builder().secret(secret).inline_gpu_up_to(u64::MAX).connect(&endpoint);
    /// assert!(matches!(too_much, Err(Error::Invalid(_))));
    /// # Ok(()) }
    /// ```
    pub fn inline_gpu_up_to(mut self, bytes: u64) -> Self {
        self.options.inline_gpu_up_to = Some(bytes);
        self
    }

    /// Connects to the receiver at `endpoint`: a socket path, or `tcp://host:port`.
    pub fn connect(self, endpoint: impl Into<Endpoint>) -> Result<Sender<T>> {
        Sender::connect_options(&endpoint.into(), &self.options)
    }
}

impl<T> Clone for SenderBuilder<T> {
    fn clone(&self) -> Self {
        SenderBuilder { options: self.options.clone(), message: PhantomData }
    }
}

impl<T> std::fmt::Debug for SenderBuilder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SenderBuilder")
            .field("secret", &self.options.secret)
            .field("timeout", &self.options.timeout)
            .field("inline_gpu_up_to", &self.options.inline_gpu_up_to)
            .finish()
    }
}
