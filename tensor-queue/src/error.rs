//! The error type of tensor-queue.

use ipc_core::Uuid;

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
/// use tensor_queue::{DType, Error, Tensor, TensorProblem};
/// match Tensor::from_slice(&[1.0f32, 2.0], DType::F32, &[3]) {
///     Err(Error::Tensor(TensorProblem::LengthMismatch { data_bytes, tensor_bytes })) => {
///         assert_eq!((data_bytes, tensor_bytes), (8, 12))
///     }
///     other => panic!("expected a length mismatch, got {other:?}"),
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
    /// A message whose encoded descriptors and payload exceed the limit, or (over TCP) whose
    /// tensors' bytes do; nothing was sent.
    #[error("a {size}-byte message is over the {limit}-byte limit: {}", too_large_advice(*limit))]
    TooLarge {
        /// The encoded size, or the bytes of its tensors.
        size: usize,
        /// The limit ([`crate::MAX_MESSAGE_BYTES`] for descriptors and payload; 4 GiB for the
        /// tensors' bytes of one message over TCP).
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
    /// A sender on this machine was gone (killed, or exited without waiting: its `Drop` gave up
    /// after a minute) with messages its `send` had accepted but its process never wrote: they
    /// are lost. The cause of an [`Error::ConnectionClosed`] in `Receiver::take_errors`, after
    /// every message it did write. The count is the sender's own (published in the shared
    /// memory of its ring; a sender over TCP, or with `TQ_RINGS=0`, cannot tell it).
    #[error("{count} message(s) the sender had accepted were never written ({why}): they are lost")]
    Unsent {
        /// How many.
        count: u64,
        /// What happened.
        why: String,
    },
    /// A peer was refused at the handshake (by us, or by the peer: see [`Refusal`]).
    #[error("peer refused: {0}")]
    PeerRefused(Refusal),
    /// A state that cannot arise whatever a peer sends, unless this crate has a bug (a signal
    /// word in the wrong kind of memory, a tensor its own sender did not route): nobody can act
    /// on it but by reporting it. (What a peer sent is never this: see [`Error::Violation`] and
    /// [`Error::Frame`]. This was `Error::Protocol` before, which also meant a peer.)
    #[error("internal error in tensor-queue (please report it): {0}")]
    Internal(String),
    /// A message from a sender on another host whose NCCL transfers were under way could not be
    /// received here (`cause`). Refused alone, its transfers would pair with the next message's
    /// receives, so its connection was closed (this is the cause of an
    /// [`Error::ConnectionClosed`]) and the message is lost.
    #[error("message {seq}, with NCCL transfers, could not be received ({cause}): its connection was closed")]
    NcclMessageLost {
        /// The message's sequence number on its connection.
        seq: u64,
        /// Why it could not be received.
        #[source]
        cause: Box<Error>,
    },
    /// A peer sent a frame that is well formed but breaks the protocol at this point (see
    /// [`Violation`]); its connection was closed.
    #[error("the peer broke the protocol: {0}")]
    Violation(#[from] Violation),
    /// An argument that makes no sense, where no caller would act on the reason other than by
    /// fixing the call (and states that cannot arise unless this crate has a bug). Reasons a
    /// caller can act on have variants of their own: [`Error::Tensor`], [`Error::View`],
    /// [`Error::NoParentChannel`], [`Error::NothingToSelect`] and others.
    #[error("invalid: {0}")]
    Invalid(String),
    /// A tensor operation whose arguments do not fit the tensor (see the problem); nothing was
    /// changed.
    #[error("{0}")]
    Tensor(TensorProblem),
    /// A view ([`crate::Tensor::transpose`], `narrow`, `slice`, `expand`, `reshape`, ...) that
    /// cannot be made of this tensor; the tensor is unchanged.
    #[error("{call} of a {shape:?} tensor: {problem}")]
    View {
        /// The call, with its arguments (such as `narrow(0, 4, 2)`).
        call: String,
        /// The shape of the tensor it was called on.
        shape: Vec<u64>,
        /// What is wrong.
        problem: ViewProblem,
    },
    /// [`crate::from_parent`] or [`crate::from_parent_duplex`] found no channel left by the
    /// parent (see the problem): for example, this process was not started by
    /// [`crate::spawn`] (connect to an endpoint instead).
    #[error("{0}")]
    NoParentChannel(ParentProblem),
    /// The child could not be started at all ([`crate::spawn`] and the others): `source` says
    /// why (a [`std::io::ErrorKind::NotFound`] program, say).
    #[error("starting the child {program}: {source}")]
    ChildNotStarted {
        /// The program, as the command named it.
        program: String,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// A [`crate::channel::Select`] with no source left to wait for (all were removed).
    #[error("the Select has nothing to wait for")]
    NothingToSelect,
    /// The async API was used outside a tokio runtime (with IO enabled).
    #[error("the async API needs a tokio runtime (with IO enabled)")]
    NoRuntime,
    /// A [`crate::route::Routing`] with more per-source landings than a receiver keeps.
    #[error("{count} per-source landings; at most {max}")]
    TooManySources {
        /// How many were given.
        count: usize,
        /// The most accepted ([`crate::route::MAX_SOURCES`]).
        max: usize,
    },
    /// The NCCL communicator with a peer failed earlier: no more transfers go over it (the
    /// connection is closed, or about to be).
    #[error("the NCCL communicator with the peer failed: {why}")]
    NcclFailed {
        /// What failed first.
        why: String,
    },
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
    /// The peer's greeting was no tensor-queue greeting (something else listens there).
    #[error("the peer is not a tensor-queue receiver: {0}")]
    NotAReceiver(String),
}

impl From<TensorProblem> for Error {
    fn from(problem: TensorProblem) -> Error {
        Error::Tensor(problem)
    }
}

/// What to do about a message over `limit` (see [`Error::TooLarge`]).
fn too_large_advice(limit: usize) -> &'static str {
    match limit {
        crate::wire::MAX_MESSAGE_BYTES => "put bulk data in tensors",
        _ => "its tensors' bytes are over what one message carries over TCP: send them in several messages",
    }
}

impl Error {
    /// An [`Error::Internal`]: `what` cannot happen unless this crate has a bug.
    pub(crate) fn internal(what: impl std::fmt::Display) -> Error {
        Error::Internal(what.to_string())
    }

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
    /// A sender on another host began a run of host bytes in the middle of a frame's parts, or
    /// before its greeting.
    #[error("a run of host bytes inside a frame, or before the greeting")]
    BulkOutOfPlace,
    /// A sender on another host sent host bytes as a frame: they only travel as a run of bytes
    /// between frames.
    #[error("host bytes in a frame, not a run of bytes")]
    FramedBytes,
    /// A sender on another host sent a second run of host bytes before the message of the first.
    #[error("two runs of host bytes for one message")]
    SecondBulkRun,
    /// A sender on another host began a run of host bytes longer than one message may carry
    /// (4 GiB).
    #[error("a run of {len} bytes of host tensors, more than one message may carry")]
    BulkTooLong {
        /// The run's length in bytes.
        len: u64,
    },
    /// A sender on another host set up the same NCCL communicator twice.
    #[error("communicator {id} set up twice")]
    CommunicatorTwice {
        /// The sender's id for the communicator.
        id: u32,
    },
    /// A sender on another host set up more NCCL communicators than a connection keeps.
    #[error("more than {max} communicators")]
    TooManyCommunicators {
        /// The most a connection keeps.
        max: usize,
    },
    /// A peer on this machine sent a frame of the link's own (the rings' set-up, a marker)
    /// where none belongs.
    #[error("a link frame out of place: {what}")]
    LinkFrameOutOfPlace {
        /// Which frame, and where.
        what: String,
    },
    /// A peer on this machine wrote a frame on the socket without its marker on the ring (after
    /// the switch, the ring orders every frame).
    #[error("a frame on the socket without its marker on the ring")]
    UnmarkedSocketFrame,
    /// A peer on this machine broke the shared-memory ring between the two processes (it shares
    /// the memory and wrote what the ring's rules forbid).
    #[error("the shared-memory ring is unusable: {why}")]
    CorruptRing {
        /// The ring's own account of what is wrong.
        why: String,
    },
    /// A sender on another host set up an NCCL communicator for a GPU this process does not
    /// have (its `Hello` said which it has).
    #[error("a communicator for GPU {target}, which this process does not have")]
    CommunicatorForAbsentGpu {
        /// The GPU named.
        target: Uuid,
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
    /// An empty endpoint: neither a socket path nor a TCP address.
    #[error("the endpoint is empty: give a socket path or tcp://host:port")]
    Empty,
    /// A TCP endpoint without a port: add `:PORT` (when binding, port 0 picks a free one).
    #[error("a TCP endpoint needs a port: tcp://host:PORT (when binding, port 0 picks a free one)")]
    NoPort,
    /// A TCP endpoint whose port (given) is not a number from 0 to 65535.
    #[error("the port `{0}` is not a number from 0 to 65535")]
    BadPort(String),
    /// An endpoint with a NUL byte, which no file name or host name holds.
    #[error("an endpoint cannot hold a NUL byte")]
    NulByte,
    /// A TCP endpoint whose IPv6 address is not written `[ADDRESS]:PORT` (a bracket missing,
    /// text between the bracket and the port, no address).
    #[error("an IPv6 address is written in brackets: tcp://[ADDRESS]:PORT")]
    Ipv6Brackets,
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

/// What is wrong with a tensor operation's arguments ([`Error::Tensor`]).
///
/// ```
/// use tensor_queue::{DType, Error, Tensor, TensorProblem};
/// let t = Tensor::from_slice(&[1i32, 2, 3, 4], DType::I32, &[2, 2]).unwrap();
/// match t.get::<f32>(&[0, 0]) {
///     Err(Error::Tensor(TensorProblem::DTypeMismatch { dtype, element })) => {
///         assert_eq!((dtype.as_str(), element), ("I32", "f32"))
///     }
///     other => panic!("expected a dtype mismatch, got {other:?}"),
/// }
/// let strided = t.transpose(0, 1).unwrap();
/// assert!(matches!(strided.host_elements::<i32>(), Err(Error::Tensor(TensorProblem::NotContiguous { .. }))));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorProblem {
    /// Data of `data_bytes` bytes given for a tensor of `tensor_bytes`.
    #[error("{data_bytes} bytes of data for {tensor_bytes} bytes of tensor")]
    LengthMismatch {
        /// The bytes given.
        data_bytes: usize,
        /// The bytes of the tensor.
        tensor_bytes: usize,
    },
    /// Elements of a Rust type that do not hold the tensor's dtype (such as `f32` for
    /// [`crate::DType::F64`]).
    #[error("{element} elements cannot hold {dtype}")]
    DTypeMismatch {
        /// The tensor's dtype, as its `Debug` writes it (`F64`; the tensor's `dtype()` is the
        /// value). A name, not a `DType`: the error imports nothing of the tensor folder.
        dtype: String,
        /// The Rust element type asked for.
        element: &'static str,
    },
    /// One element's bytes of the wrong length for the dtype.
    #[error("{len} bytes for a {size}-byte element")]
    ElementBytes {
        /// The bytes given.
        len: usize,
        /// The bytes of one element of the tensor's dtype.
        size: usize,
    },
    /// A call that needs a contiguous tensor, on a strided view: copy it first
    /// ([`crate::Tensor::contiguous`], or `to_vec`).
    #[error("{call} needs a contiguous tensor (make one with contiguous())")]
    NotContiguous {
        /// The call.
        call: &'static str,
    },
    /// A call for host tensors, on a GPU tensor.
    #[error("not a host tensor")]
    NotHost,
    /// A call for GPU tensors, on a host tensor.
    #[error("not a GPU tensor")]
    NotCuda,
    /// A copy between two devices (`None`: host memory), where `copy_into` copies within one.
    #[error(
        "copy_into moves data within one device ({}, to {}): use to_bytes and from_bytes_cuda, or a channel, across devices",
        device(from),
        device(to)
    )]
    AcrossDevices {
        /// The device of the source (`None`: host).
        from: Option<Uuid>,
        /// The device of the destination (`None`: host).
        to: Option<Uuid>,
    },
    /// A copy into a view whose elements share memory (a dimension of size above 1 with
    /// stride 0, as [`crate::Tensor::expand`] makes): which write lands would be a race.
    #[error("copy into a {shape:?} view with strides {strides:?}: its elements share memory (stride 0)")]
    AliasedDestination {
        /// The destination's shape.
        shape: Vec<u64>,
        /// The destination's strides, in elements.
        strides: Vec<i64>,
    },
    /// A copy into a tensor of another dtype or shape.
    #[error("copy of a {src_dtype} {src_shape:?} tensor into a {dst_dtype} {dst_shape:?} one")]
    CopyMismatch {
        /// The source's dtype, as its `Debug` writes it.
        src_dtype: String,
        /// The source's shape.
        src_shape: Vec<u64>,
        /// The destination's dtype, as its `Debug` writes it.
        dst_dtype: String,
        /// The destination's shape.
        dst_shape: Vec<u64>,
    },
    /// An element index of the wrong length, or outside the shape.
    #[error("index {index:?} is not inside a tensor of shape {shape:?}")]
    BadIndex {
        /// The index given.
        index: Vec<u64>,
        /// The tensor's shape.
        shape: Vec<u64>,
    },
    /// More dimensions than a tensor may have.
    #[error("has {ndim} dimensions, more than the {max} a tensor may have")]
    TooManyDims {
        /// How many were given.
        ndim: usize,
        /// The most accepted.
        max: usize,
    },
    /// A shape whose bytes do not fit in an address (the product of its sizes overflows).
    #[error("shape {shape:?} is too large")]
    ShapeTooLarge {
        /// The shape.
        shape: Vec<u64>,
    },
    /// A buffer smaller than the shape needs ([`crate::Tensor::from_device_buffer`]).
    #[error("shape {shape:?} needs {needed} bytes; the buffer has {available}")]
    BufferTooSmall {
        /// The shape.
        shape: Vec<u64>,
        /// The bytes it needs.
        needed: usize,
        /// The buffer's length.
        available: usize,
    },
    /// A copy of the tensor into this process's memory could not be allocated (a broadcast
    /// view may have far more elements than memory).
    #[error("{bytes} bytes do not fit in memory")]
    NoMemory {
        /// The bytes the copy needs.
        bytes: usize,
    },
    /// A view whose elements lie outside its storage (its layout arithmetic overflows, or it
    /// reaches past either end).
    #[error("the view reaches outside its storage")]
    OutsideStorage,
    /// A [`crate::DType::Bool`] element given a byte other than 0 or 1 (NumPy and torch read
    /// such a bool as neither true nor false).
    #[error("byte {value} for a Bool element: a Bool is 0 or 1")]
    NotABool {
        /// The first such byte.
        value: u8,
    },
}

/// A device for messages: a GPU's UUID, or the host.
fn device(device: &Option<Uuid>) -> String {
    device.map_or_else(|| "host".to_string(), |uuid| format!("GPU {uuid}"))
}

/// Why a view cannot be made ([`Error::View`]).
///
/// ```
/// use tensor_queue::{DType, Error, Tensor, ViewProblem};
/// let t = Tensor::zeros(DType::F32, &[2, 3]).unwrap();
/// match t.narrow(1, 2, 2) {
///     Err(Error::View { problem: ViewProblem::OutOfRange { dim, size }, .. }) => assert_eq!((dim, size), (1, 3)),
///     other => panic!("expected an out-of-range view, got {other:?}"),
/// }
/// let error = t.transpose(0, 1).unwrap().reshape(&[6]).unwrap_err();
/// assert!(matches!(error, Error::View { problem: ViewProblem::NotContiguous, .. }), "copy with contiguous() first");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ViewProblem {
    /// A dimension the tensor does not have.
    #[error("its dimensions are 0..{ndim}")]
    NoSuchDim {
        /// The dimension named.
        dim: usize,
        /// How many dimensions it has.
        ndim: usize,
    },
    /// A dimension named twice where each may be named once.
    #[error("dimension {dim} is named twice")]
    DimTwice {
        /// The dimension.
        dim: usize,
    },
    /// A permutation that does not name each dimension.
    #[error("name each of its {ndim} dimensions once")]
    NotAPermutation {
        /// How many dimensions it has.
        ndim: usize,
    },
    /// A range or index past the end of a dimension.
    #[error("dimension {dim} has {size} entries")]
    OutOfRange {
        /// The dimension.
        dim: usize,
        /// Its size.
        size: u64,
    },
    /// A slice step of 0.
    #[error("the step must be at least 1")]
    ZeroStep,
    /// A slice whose start lies past its end (clamped to the size).
    #[error("start {start} is past the end {end} of dimension {dim}")]
    StartPastEnd {
        /// The start.
        start: u64,
        /// The end, clamped to the size.
        end: u64,
        /// The dimension.
        dim: usize,
    },
    /// An `expand` to fewer dimensions than the tensor has.
    #[error("expand cannot drop dimensions")]
    DropsDims,
    /// An `expand` of a dimension whose size is neither 1 nor the target.
    #[error("dimension {dim} has size {size}, not {target}; only size-1 dimensions broadcast")]
    NotBroadcastable {
        /// The dimension (of the tensor).
        dim: usize,
        /// Its size.
        size: u64,
        /// The size asked for.
        target: u64,
    },
    /// A `reshape` of a strided tensor: reshape a [`crate::Tensor::contiguous`] copy.
    #[error("only a contiguous tensor can be reshaped without a copy")]
    NotContiguous,
    /// A `reshape` to another number of elements.
    #[error("{numel} elements cannot be seen as that shape")]
    CountMismatch {
        /// The tensor's number of elements.
        numel: u64,
    },
    /// A layout no receiver accepts, or whose arithmetic overflows, or that reaches outside the
    /// storage (the text says which; no caller acts on the difference).
    #[error("{0}")]
    Layout(String),
}

/// Why no channel from the parent could be taken ([`Error::NoParentChannel`]).
///
/// ```
/// use tensor_queue::{Error, ParentProblem};
/// // This doc test was not started by `tensor_queue::spawn`:
/// match tensor_queue::from_parent::<u32>() {
///     Err(Error::NoParentChannel(ParentProblem::NotSpawned { variable })) => assert_eq!(variable, "TENSOR_QUEUE_ENDPOINT"),
///     other => panic!("expected NotSpawned, got {:?}", other.map(|_| ())),
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParentProblem {
    /// This process was not started by [`crate::spawn`] or [`crate::spawn_duplex`]: `variable`
    /// is not set.
    #[error("{variable} is not set: was this process started by tensor_queue::spawn?")]
    NotSpawned {
        /// The variable (`TENSOR_QUEUE_ENDPOINT`).
        variable: &'static str,
    },
    /// The variable does not hold a list of descriptors.
    #[error("{variable}={value:?} is not a list of descriptors (set by tensor_queue::spawn)")]
    NotAList {
        /// The variable (`TENSOR_QUEUE_ENDPOINT`).
        variable: &'static str,
        /// What it holds.
        value: String,
    },
    /// The channel was taken before: `from_parent` works once per process.
    #[error("the channel from the parent was already taken: from_parent works once per process")]
    AlreadyTaken,
    /// A descriptor named by the variable is not the socket `spawn` left.
    #[error("descriptor {fd} from {variable} is not the socket tensor_queue::spawn left")]
    NotASocket {
        /// The variable (`TENSOR_QUEUE_ENDPOINT`).
        variable: &'static str,
        /// The descriptor.
        fd: i32,
    },
    /// This process was started by [`crate::spawn`] (one socket) but took its channel with
    /// [`crate::from_parent_duplex`] (two).
    #[error("this process was started by spawn, not spawn_duplex: use from_parent")]
    NotDuplex,
    /// Anything else that failed taking the sockets (its text).
    #[error("taking the channel from the parent: {0}")]
    Other(String),
}
