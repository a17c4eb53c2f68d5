//! The error type of tensor-queue.

use crate::wire::FrameError;

/// Result with this crate's [`Error`].
///
/// ```
/// use tensor_queue::{DType, Result, Tensor};
/// fn ones(n: u64) -> Result<Tensor> {
///     let t = Tensor::zeros(DType::F32, &[n])?;
///     t.fill(1.0f32)?;
///     Ok(t)
/// }
/// assert_eq!(ones(3).unwrap().to_vec::<f32>().unwrap(), [1.0; 3]);
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong sending or receiving.
///
/// ```
/// use tensor_queue::{DType, Error, Tensor};
/// match Tensor::from_slice(&[1.0f32, 2.0], DType::F32, &[3]) {
///     Err(Error::Invalid(why)) => assert_eq!(why, "8 bytes of data for 12 bytes of tensor"),
///     other => panic!("expected Error::Invalid, got {other:?}"),
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The driver or the operating system failed.
    #[error(transparent)]
    Core(#[from] ipc_core::Error),
    /// The peer is gone (its process exited, or it closed or dropped its end). Messages it sent
    /// before were delivered first. The one error for a dead peer, whatever the socket said.
    #[error("the peer disconnected")]
    Disconnected,
    /// `recv_timeout` or `send_timeout` waited the whole time.
    #[error("the timeout passed")]
    Timeout,
    /// `try_send` found the receiver's queue full; nothing was sent.
    #[error("the receiver's queue is full")]
    Full,
    /// The receiver refused one message (it holds nothing of it); the channel goes on. `recv`
    /// returns it for that message; a sender finds it in `Sender::take_rejected`.
    #[error("message {seq} from pid {pid} (connection {connection}) was rejected: {reason}")]
    Rejected {
        /// The sender's process id.
        pid: u32,
        /// The receiver's number for the sender's connection ([`crate::MessageInfo::connection`]).
        connection: u64,
        /// The message's sequence number on its connection.
        seq: u64,
        /// Why.
        reason: String,
    },
    /// The producer of a message died before its GPU work on the message's tensors was done: the
    /// data is not what it meant to send. The message was dropped; `recv` again goes on.
    #[error("the producer (pid {pid}, connection {connection}) died before its GPU work on message {seq} was done")]
    ProducerFailed {
        /// The producer's process id.
        pid: u32,
        /// The receiver's number for the producer's connection ([`crate::MessageInfo::connection`]).
        connection: u64,
        /// The message's sequence number on its connection.
        seq: u64,
    },
    /// A message whose encoded descriptors and payload exceed the limit; nothing was sent.
    #[error("a {size}-byte message is over the {limit}-byte limit: put bulk data in tensors")]
    TooLarge {
        /// The encoded size.
        size: usize,
        /// The limit ([`crate::MAX_MESSAGE_BYTES`]).
        limit: usize,
    },
    /// A tensor that cannot be sent as it is (see the text); nothing was sent.
    #[error("{0}")]
    NotSendable(String),
    /// The receiver's routing policy refuses the only route a tensor of the message could take
    /// (see [`crate::route`]); nothing was sent, and the channel goes on.
    #[error(transparent)]
    RouteRefused(#[from] crate::route::Forbidden),
    /// `try_recv` found nothing waiting.
    #[error("no message is waiting")]
    Empty,
    /// A peer sent a frame that failed validation; its connection was closed.
    #[error("bad frame from pid {pid}: {source}")]
    Frame {
        /// The sender's process id.
        pid: u32,
        /// What was wrong.
        #[source]
        source: FrameError,
    },
    /// The message could not be serialised.
    #[error("encoding the message failed: {0}")]
    Encode(String),
    /// The payload did not decode as the receiver's message type.
    #[error("decoding the message failed (do both sides use the same message type?): {0}")]
    Decode(String),
    /// A receiver closed the connection from one sender because of `cause` (a frame that broke
    /// the protocol, a failed read); its other connections go on (see `Receiver::take_errors`).
    #[error("closed the connection from pid {pid}: {cause}")]
    ConnectionClosed {
        /// The sender's process id.
        pid: u32,
        /// Why.
        #[source]
        cause: Box<Error>,
    },
    /// A sender left a message unfinished (it died or hung up in the middle of it, or sent
    /// nothing more of it for [`crate::channel::UNFINISHED_IDLE`]): that message is lost. The
    /// cause of an [`Error::ConnectionClosed`] in `Receiver::take_errors`.
    #[error("a message was left unfinished after {received} bytes of it had come ({why}): it is lost")]
    Unfinished {
        /// The bytes of it that had come.
        received: u64,
        /// What happened.
        why: String,
    },
    /// A peer was refused at the handshake (by us, or by the peer: see [`Refusal`]).
    #[error("peer refused: {0}")]
    PeerRefused(Refusal),
    /// A peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A peer sent a frame that is well formed but breaks the protocol at this point (see
    /// [`Violation`]); its connection was closed.
    #[error("the peer broke the protocol: {0}")]
    Violation(#[from] Violation),
    /// An argument that makes no sense.
    #[error("invalid: {0}")]
    Invalid(String),
    /// An endpoint that is neither a socket path nor `tcp://host:port` (see the problem for the
    /// fix); nothing was bound or connected.
    #[error("{endpoint}: {problem}")]
    BadEndpoint {
        /// The endpoint, as given.
        endpoint: String,
        /// What is wrong with it.
        problem: EndpointProblem,
    },
    /// A write into a host tensor that is read-only in this process: a received tensor, unless
    /// its sender made it with [`crate::Tensor::zeros_writable`]. Copy it first
    /// ([`crate::Tensor::to_vec`]) to change it here.
    #[error("the tensor is read-only here: its sender shared it read-only")]
    ReadOnly,
    /// A child started by [`crate::spawn_ready`] did not take its channel; it was killed and
    /// reaped. `step` says what happened.
    #[error("the child {program} failed: {step}")]
    ChildNotReady {
        /// The program, as the command named it.
        program: String,
        /// The step that failed.
        step: SpawnStep,
    },
    /// A TCP secret ([`crate::Secret`]) with fewer bytes than the shortest accepted; use a longer
    /// one (for example `openssl rand -hex 32`).
    #[error("{origin} has {len} bytes; a secret needs at least {min}: use a longer one")]
    SecretTooShort {
        /// Where the secret came from: the variable it was read from ([`crate::SECRET_ENV`]), or
        /// `"the secret given"`.
        origin: &'static str,
        /// The secret's length in bytes.
        len: usize,
        /// The shortest length accepted ([`crate::MIN_SECRET_LEN`]).
        min: usize,
    },
    /// No secret was given for a TCP endpoint and the variable it is read from is not set: give
    /// every process the same secret (for example `openssl rand -hex 32`).
    #[error("{variable} is not set: give every process the same secret, for example `openssl rand -hex 32`")]
    SecretNotSet {
        /// The variable ([`crate::SECRET_ENV`]).
        variable: &'static str,
    },
    /// A sender found nothing listening at its endpoint: no socket file there, or no process
    /// accepting on it (the receiver is not bound yet, or has gone).
    #[error("nothing listens at {endpoint} ({cause}); is the receiver bound there and still running?")]
    NoReceiver {
        /// The endpoint connected to, as given.
        endpoint: String,
        /// What the operating system said.
        cause: std::io::Error,
    },
}

/// Why a connection was refused at the handshake.
///
/// ```
/// use tensor_queue::{Error, Refusal};
/// // What a sender's `wait_ready` or `send` returns when the receiver's handshake failed.
/// fn advice(error: &Error) -> Option<String> {
///     match error {
///         Error::PeerRefused(Refusal::OtherUser { uid, .. }) => Some(format!("run both as one user, not uid {uid}")),
///         Error::PeerRefused(Refusal::OtherMachine) => Some("CUDA IPC needs one machine".into()),
///         _ => None,
///     }
/// }
/// let refused = Error::PeerRefused(Refusal::OtherMachine);
/// assert_eq!(refused.to_string(), "peer refused: the peer runs on another machine");
/// assert!(advice(&refused).is_some());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The peer runs as another user (`SO_PEERCRED`): CUDA IPC and shared memory are for
    /// processes of one user.
    #[error("pid {pid} runs as uid {uid}, not {ours}")]
    OtherUser {
        /// The peer's process id.
        pid: u32,
        /// The peer's user id.
        uid: u32,
        /// This process's user id.
        ours: u32,
    },
    /// The peer runs on another machine (another boot id): CUDA IPC works only within one.
    #[error("the peer runs on another machine")]
    OtherMachine,
    /// The peer refused this process, and said why.
    #[error("{0}")]
    ByPeer(String),
}

impl Error {
    /// Whether `recv` can go on after this error with the next message (an iterator or a
    /// `Stream` of messages goes on after it).
    pub(crate) fn about_one_message(&self) -> bool {
        matches!(self, Error::Rejected { .. } | Error::ProducerFailed { .. } | Error::Decode(_))
    }
}

/// How a peer broke the protocol ([`Error::Violation`]): what its frame said that it may not say
/// at that point. A receiver reports it as the cause of [`Error::ConnectionClosed`]; a sender
/// closes the connection (its sends then fail with [`Error::Disconnected`]).
///
/// ```
/// use tensor_queue::{Error, Violation};
/// let error = Error::from(Violation::CreditExceeded { capacity: 8 });
/// assert!(matches!(error, Error::Violation(Violation::CreditExceeded { capacity: 8 })));
/// assert_eq!(error.to_string(), "the peer broke the protocol: a message beyond the 8 its credits allow");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A sender wrote more messages than the receiver's credits allow (its capacity).
    #[error("a message beyond the {capacity} its credits allow")]
    CreditExceeded {
        /// The receiver's capacity.
        capacity: u32,
    },
    /// A receiver granted more credits than messages were sent and not yet credited.
    #[error("{granted} credits granted for {uncredited} messages sent and not yet credited")]
    OverCredited {
        /// Credits in the frame.
        granted: u32,
        /// Messages the sender had sent and not yet had credited.
        uncredited: u32,
    },
    /// A receiver released a message the sender does not lease: never sent, sent without
    /// tensors, already released, or given back by a rejection or a closing.
    #[error("a release of message {seq}, which is not leased")]
    UnknownRelease {
        /// The message's sequence number.
        seq: u64,
    },
    /// A receiver rejected a message that was never sent.
    #[error("a rejection of message {seq}, which was never sent")]
    UnknownRejection {
        /// The message's sequence number.
        seq: u64,
    },
    /// A receiver sent a rejection or a second closing after it closed the connection.
    #[error("a frame after the connection's closing")]
    AfterClose,
    /// A sender on another host announced local memory (a chunk, an event, a retirement).
    #[error("a sender on another host announced local memory")]
    LocalFromRemote,
    /// A sender on this machine sent host bytes or an NCCL communicator, which only travel
    /// between hosts.
    #[error("a sender on this machine sent a frame that only travels between hosts")]
    RemoteFromLocal,
    /// A sender announced a chunk again with another length, kind or device.
    #[error("chunk {id} announced again, differently")]
    ChunkChanged {
        /// The sender's id for the chunk.
        id: u64,
    },
    /// A chunk announcement without the descriptor it needs.
    #[error("chunk {id} came without its descriptor")]
    MissingDescriptor {
        /// The sender's id for the chunk.
        id: u64,
    },
    /// A legacy chunk whose handle disagrees with its announcement.
    #[error("chunk {id}: the handle disagrees with the announcement")]
    HandleMismatch {
        /// The sender's id for the chunk.
        id: u64,
    },
}

/// What is wrong with an endpoint ([`Error::BadEndpoint`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointProblem {
    /// A URL-like endpoint of a scheme other than `tcp` (its scheme, such as `http`): use a socket
    /// path or `tcp://host:port` (for a path that starts this way, write `./` before it).
    #[error(
        "a `{0}://` endpoint is not supported; use a socket path or tcp://host:port (for a path that starts this way, write ./ before it)"
    )]
    Scheme(String),
    /// A TCP endpoint without a port: add `:PORT` (when binding, port 0 picks a free one).
    #[error("a TCP endpoint needs a port: tcp://host:PORT (when binding, port 0 picks a free one)")]
    NoPort,
    /// A TCP endpoint whose port (given) is not a number from 0 to 65535.
    #[error("the port `{0}` is not a number from 0 to 65535")]
    BadPort(String),
}

/// A step of starting a child with a channel at which it failed ([`Error::ChildNotReady`], from
/// [`spawn_ready`](crate::spawn_ready)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpawnStep {
    /// The child did not take its end of the channel ([`from_parent`](crate::from_parent)) within `timeout`; it was
    /// killed and reaped.
    TakeChannel {
        /// How long it was given.
        timeout: std::time::Duration,
    },
    /// The child exited before it took its end of the channel (it fails at start-up, or does
    /// not call [`from_parent`](crate::from_parent)).
    Exited {
        /// How it ended.
        status: std::process::ExitStatus,
    },
}

impl std::fmt::Display for SpawnStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpawnStep::TakeChannel { timeout } => {
                write!(f, "it did not take its channel (from_parent) within {timeout:?}; it was killed")
            }
            SpawnStep::Exited { status } => {
                write!(f, "it ended ({status}) before taking its channel (does it call from_parent?)")
            }
        }
    }
}
