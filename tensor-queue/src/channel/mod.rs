//! Typed channels: [`Sender`], [`Receiver`], [`Broadcast`], and children started with a channel.
//!
//! # The hand-off
//! This is the hand-off of a tensor that the receiver maps where it is; a tensor bound for
//! another GPU, or for host memory, first takes its route ([`crate::route`]: the sender copies
//! it, or the receiver maps it over a peer link or copies it in), and then travels the same way.
//!
//! 1. `send` serialises the message; tensors go to the side table. A chunk the peer has not seen
//!    is announced first, with its descriptor (once per chunk and peer).
//! 2. For GPU tensors sent with [`Sender::send_on`], the producer's stream gets a fence after
//!    its work: the write of the next value of its signal word (see `signal.rs`), or, where the
//!    device lacks stream memory operations, the record of a pooled interprocess event (its handle
//!    announced once, when it was made).
//! 3. The message frame carries one descriptor per tensor: (chunk, offset, length, dtype, shape,
//!    strides, fence); a frame longer than a packet travels in parts. The sender keeps the
//!    tensors' storage alive under the message's lease (its sequence number).
//! 4. The receiver (in the thread that calls `recv`, with no hand-off to another thread) validates
//!    the frame, maps nothing new (chunks are mapped once per process, see `imports.rs`), and
//!    queues the fence's wait on the connection's stream for the device (`cuStreamWaitValue64`
//!    or `cuStreamWaitEvent`): the consumer's first use is ordered after the producer's work, and
//!    neither CPU waits. Each connection has its own stream, so one producer's slow work never
//!    holds up another's tensors (unless the user chose one stream for all, `set_stream`).
//! 5. A message's tensors share one receiver-side lease: when the last view of any of them drops,
//!    the message is released, once the receiver's GPU work on it is done: at once if its
//!    streams are idle, else through a release thread, which records one pooled event per stream
//!    for the releases queued together, polls them, and returns them in one frame per sender
//!    (see `release.rs`). Releases are batched as credits are: one frame carries those of many
//!    messages while messages stream, and the release thread writes what is left within
//!    200 us. A message without tensors holds no lease and needs no release. Holding one tensor
//!    of a message holds the others' memory in the sender: the price of one release per message
//!    instead of one per tensor.
//!
//! # Why signal words, not interprocess events
//! On an H200 a receiver's stream took 140-580 us to get past a wait on an imported interprocess
//! event that was already complete (the set-up breakdown and the warm broadcast in `tq-bench`;
//! `GPU.md` measured 141 us), while `primitive-costs` saw 6 us in a quieter set-up. A stream
//! wait on a 64-bit word in shared device memory costs 7 us (`GPU.md`), needs no per-message
//! handle, and its enqueue costs about what `cuEventRecord` does. Events remain the fallback:
//! they are exported once and reused from a pool; an event returns to the pool when a credit
//! says the receiver took its message, which is after the receiver queued its wait
//! (`cuStreamWaitEvent` waits for the record current at the call), so a re-record can never be
//! waited on by mistake, and the pool never outgrows the capacity.
//!
//! # Waiting
//! `recv` sleeps in `poll` and the kernel wakes it: a few microseconds per hand-off. With
//! [`Receiver::set_spin`] it reads its sockets without sleeping first, which takes the wake-up
//! off the latency and costs a busy core while it waits. Likewise a sender with no credit left
//! waits for its reader thread to see the next credit, and that thread for the kernel; with
//! [`Sender::set_spin`] the sending thread reads the credits itself for a while first.
//!
//! # Flow control
//! A receiver grants each sender `capacity` messages; `send` blocks when they are used up and
//! resumes when the receiver has taken half of them (credits return in batches, to keep frames
//! off the hot path). A receiver reads a sender's frames only as `recv` needs them, so it never
//! holds more than `capacity` messages of one sender, whatever that sender writes: a sender that
//! writes past its credits only fills its own socket (the kernel's flow control holds it back,
//! over Unix sockets and TCP alike) and delays nobody else. A message read beyond the credits
//! granted so far, or a receiver that grants more than was sent, closes the connection. (Since
//! credits are granted as messages are taken, a reader that takes messages as they come cannot
//! tell a sender that ran ahead from one that waited: the bound on memory is what holds.) No
//! thread ever writes to
//! a socket while holding the channel's state (a blocked write must never stop the thread that
//! reads the peer's answers), and a receiver never waits for a sender to read: what does not fit
//! a sender's socket waits in an outbox (`peer.rs`).
//!
//! # Failure
//! - A receiver that refuses one message (a chunk it could not map, a GPU it cannot see, a range
//!   outside its chunk) says so to both sides ([`Error::Rejected`](crate::Error::Rejected) from `recv`,
//!   [`Sender::take_rejected`]) and the connection goes on.
//! - A receiver that stops taking messages (dropped, or closing a connection that broke the
//!   protocol) sends `Close`: `send` returns [`Error::Disconnected`](crate::Error::Disconnected) at once. Its socket stays
//!   open while it holds tensors, whose releases still flow. A sender takes its leases back only
//!   when the receiver's socket closes, which happens when the receiver holds nothing or its
//!   process is gone: a hang-up is not a death, and held memory is never reused.
//! - A sender that dies: its messages already queued are still delivered, then `recv` returns
//!   [`Error::Disconnected`](crate::Error::Disconnected), and tensors already received stay valid (their memory lives while
//!   mapped). If it died with GPU work queued, the waits on its fences are released (see
//!   `fences.rs`) and the messages it never finished are reported: [`Error::ProducerFailed`](crate::Error::ProducerFailed), or
//!   [`Tensor::producer_failed`](crate::Tensor::producer_failed) for one already received.
//!
//! # Across hosts (TCP)
//! A receiver bound to a TCP [`Endpoint`] (`"tcp://0.0.0.0:7000"`) takes senders from other
//! hosts. The link underneath is the other implementation of one seam
//! (`ipc_core::transport::Packets`): the same frames, split into the same packets, each a
//! length-prefixed record on the stream; the protocol above does not know which it runs on,
//! except that no descriptor crosses. Peers prove they hold the shared secret before any frame is
//! read (`ipc_core::tcp`: mutual HMAC-SHA256 challenge-response), and each handshake runs on a
//! thread of its own, bounded by 10 s, so a silent or hostile connector delays nobody. Over TCP
//! every tensor moves as between hosts (the `Nccl` and `Tcp` routes of [`crate::route`]); the
//! receiver's half is `remote.rs`, the sender's `route/network.rs`. Only a worker thread per
//! NCCL communicator calls NCCL (`route/worker.rs`): NCCL may wait inside a call for the other
//! rank, and neither `send` nor `recv` may wait for a peer. The traffic is neither encrypted nor
//! integrity-checked: the secret keeps strangers out, not eavesdroppers.
//!
//! # What a peer can and cannot do (trust model)
//! Over a Unix socket, peers run as the same user on the same machine (checked by `SO_PEERCRED`;
//! the socket file is 0600); over TCP, they hold the shared secret. Every frame is validated, and no frame can crash the receiver, block it, or touch another
//! peer's messages. Sharing is by chunk, not by tensor: a receiver maps the whole chunk (64 MiB of
//! an arena, or the user's buffer) that a tensor lies in, and so can read other tensors of this
//! process in that chunk, including ones sent to other receivers. Host chunks are shared read-only
//! (the receiver gets a read-only descriptor of a file sealed against shrinking and against every
//! new writable mapping and write, `F_SEAL_FUTURE_WRITE`: neither changing its mode, nor reopening
//! it for writing, nor root's rights make it writable), except those made for writing
//! ([`Tensor::zeros_writable`](crate::Tensor::zeros_writable)).
//! GPU memory is mapped read-write: CUDA IPC has no read-only import of a legacy handle, and a
//! receiver's kernels may write a received tensor. Put data that one receiver must not see in a
//! process of its own.

#[cfg(feature = "tokio")]
mod asynchronous;
mod broadcast;
mod builder;
mod child;
pub mod iter;
mod receiver;
mod select;
mod sender;

pub use crate::clock::monotonic_ns;
pub use crate::error::{EndpointProblem, ParentProblem, SpawnStep};
pub use crate::links::endpoint::{ConnectOptions, Endpoint};
pub use crate::recv::connection::{MessageInfo, UNFINISHED_IDLE};
pub use broadcast::Broadcast;
pub use builder::{ReceiverBuilder, SenderBuilder};
#[allow(deprecated)] // still offered, deprecated where it is defined
pub use child::from_parent_with;
pub use child::{
    from_parent, from_parent_duplex, from_parent_with_capacity, spawn, spawn_duplex, spawn_ready, spawn_timeout,
};
pub use receiver::{Receiver, ReceiverOptions};
pub use select::Select;
pub use sender::{Rejection, Sender};

/// Messages a sender may have in flight to a receiver unless the receiver says otherwise.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use std::time::Duration;
/// use tensor_queue::{DEFAULT_CAPACITY, Error, Receiver, Sender};
/// # let path = std::env::temp_dir().join(format!("doc-{}-default-capacity.sock", std::process::id()));
/// let _receiver = Receiver::<u32>::bind(&path)?; // never receives
/// let sender = Sender::<u32>::connect(&path)?;
/// sender.wait_ready(Duration::from_secs(10))?;
/// for i in 0..DEFAULT_CAPACITY {
///     sender.try_send(&i)?;
/// }
/// assert!(matches!(sender.try_send(&0), Err(Error::Full)));
/// # Ok(()) }
/// ```
pub const DEFAULT_CAPACITY: u32 = 16;

/// How long dropping the last clone of a [`Sender`] waits, in all, for its messages still in
/// flight and the bytes its sends queued to be written (a program may return from `main` right
/// after its last send). A receiver that is alive but takes nothing for this long costs the
/// dropping thread no more: what is still unwritten is given up, logged, and the receiver
/// reports the unfinished message ([`UNFINISHED_IDLE`]). [`Sender::wait_written`] waits for a
/// bound of the caller's choice.
pub const SENDER_DROP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The environment variable through which [`spawn`] tells a child the number of the inherited
/// descriptor that is its end of the channel (ask [`is_spawned_child`] instead).
pub(crate) const ENDPOINT_ENV: &str = "TENSOR_QUEUE_ENDPOINT";

/// Whether this process was started by [`spawn`] or [`spawn_duplex`] (so [`from_parent`] or
/// [`from_parent_duplex`] has a channel to take).
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{from_parent, is_spawned_child};
/// // A worker that can also be started by hand, without a parent's channel:
/// if is_spawned_child() {
///     let mut jobs = from_parent::<String>()?;
///     while let Ok(job) = jobs.recv() {
///         println!("{job}");
///     }
/// } else {
///     println!("started by hand: no channel from a parent");
/// }
/// # Ok(()) }
/// ```
///
/// The variable's name is no longer public:
/// ```compile_fail,E0603
/// let _ = tensor_queue::channel::ENDPOINT_ENV;
/// ```
pub fn is_spawned_child() -> bool {
    ipc_core::inherit::has_inherited_sockets(ENDPOINT_ENV)
}
