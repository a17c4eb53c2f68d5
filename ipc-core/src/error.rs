//! The error type of this crate.

use crate::device::Uuid;
use crate::handle::HostId;

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong using the driver through this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The driver could not be loaded, or a call failed.
    #[error(transparent)]
    Cuda(#[from] cuda_sys::Error),
    /// A device ordinal beyond what this process sees.
    #[error("there is no CUDA device {ordinal}: this process sees {count} (check CUDA_VISIBLE_DEVICES)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: i32,
        /// How many devices this process sees.
        count: i32,
    },
    /// No visible device has this UUID.
    #[error("no CUDA device visible to this process has UUID {0} (check CUDA_VISIBLE_DEVICES)")]
    UnknownDevice(Uuid),
    /// A handle made on another machine (or before a reboot): CUDA IPC is local to one machine.
    #[error(
        "the handle was made on another machine (boot id {theirs}, this machine {ours}); CUDA IPC works only between processes of one machine"
    )]
    ForeignHost {
        /// This machine's boot id.
        ours: HostId,
        /// The boot id in the handle.
        theirs: HostId,
    },
    /// Bytes that do not decode as a handle of this crate.
    #[error("malformed handle: {0}")]
    MalformedHandle(String),
    /// A file descriptor that is not open in this process.
    #[error("file descriptor {fd} is not open in this process")]
    BadDescriptor {
        /// The descriptor number.
        fd: i32,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// A range outside a buffer.
    #[error("range {offset}..{end} is outside a buffer of {len} bytes", end = offset.saturating_add(*count))]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Its length.
        count: usize,
        /// The buffer's length.
        len: usize,
    },
    /// An argument that makes no sense for the call.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A shared-memory descriptor from another process that is not sealed against shrinking.
    #[error(
        "the shared-memory descriptor is not sealed against shrinking (F_SEAL_SHRINK): its sender could truncate it and crash this process with SIGBUS; make it with SharedMemory::create"
    )]
    UnsealedSharedMemory,
    /// A write to shared memory that this process mapped read-only.
    #[error("this shared memory is mapped read-only (its descriptor was opened for reading only)")]
    ReadOnlyMemory,
    /// The process at the other end of a connection closed it (`EPIPE` or `ECONNRESET` on send).
    #[error("the peer closed the connection")]
    PeerGone,
    /// A zero-length message while the peer is still connected. It would read like a hang-up,
    /// so it is refused: no message of a well-behaved peer is empty.
    #[error("the peer sent an empty message, which would read like a hang-up; the peer is broken or hostile")]
    EmptyMessage,
    /// A bulk run ([`crate::tcp::Bulk`]) is next in a TCP link's stream where a message was
    /// asked for: read it with [`crate::tcp::TcpLink::try_recv_bulk`], or, where none is
    /// expected, treat the peer as broken.
    #[error("a bulk run of {left} bytes is next in the stream where a message was expected")]
    BulkAhead {
        /// Its bytes not read yet.
        left: u64,
    },
    /// Descriptors sent by the peer were dropped by the kernel because this process has (nearly)
    /// run out of descriptors.
    #[error(
        "descriptors sent by the peer were lost: this process has (nearly) used up its limit of {limit} open files; raise it (`ulimit -n`) or close descriptors"
    )]
    DescriptorTableFull {
        /// The soft limit (`RLIMIT_NOFILE`).
        limit: u64,
        /// The bytes of the message that did arrive (in the caller's buffer): a protocol may
        /// still use them, knowing that the descriptors are lost.
        received: usize,
    },
    /// The listener was stopped with [`crate::seqpacket::Listener::wake`]: it accepts no more
    /// connections.
    #[error("the listener was stopped (Listener::wake) and accepts no more connections")]
    ListenerStopped,
    /// No process has this id (it exited and was reaped, or never existed).
    #[error("there is no process {pid}")]
    NoSuchProcess {
        /// The process id.
        pid: u32,
    },
    /// A process this process cannot watch through a pidfd; fall back on another liveness test
    /// (such as the connection's hang-up).
    #[error("cannot watch process {pid}: {reason}")]
    ProcessUnwatchable {
        /// The process id (0 when the peer's id is not visible in this PID namespace).
        pid: u32,
        /// Why.
        reason: &'static str,
    },
    /// NCCL could not be loaded, or an NCCL call failed (see [`crate::nccl`]).
    #[error(transparent)]
    Nccl(#[from] cuda_sys::nccl::NcclError),
    /// An NCCL communicator did not finish an operation in time: its peer is gone, stalled, or
    /// never came. The communicator has been aborted.
    #[error(
        "NCCL {operation} did not finish within {timeout:?} (is the peer alive and did it make the matching call?); the communicator was aborted"
    )]
    NcclTimeout {
        /// What was waited for (`initialisation`, `ncclSend`, `transfer`).
        operation: &'static str,
        /// How long.
        timeout: std::time::Duration,
    },
    /// A call on an NCCL communicator that was aborted after an earlier error or timeout.
    #[error("the NCCL communicator was aborted after an earlier error or timeout; make a new one")]
    NcclAborted,
    /// A TCP peer failed the challenge-response of [`crate::tcp`]: it holds another secret, spoke
    /// another protocol, sent garbage or replayed an old handshake, or hung up during it. Only
    /// that connection is refused; a listener goes on.
    #[error("refused TCP peer {peer}: {why}")]
    AuthFailed {
        /// The address at the other end.
        peer: std::net::SocketAddr,
        /// What was wrong.
        why: &'static str,
    },
    /// A TCP peer did not finish the challenge-response of [`crate::tcp`] in time (a silent or
    /// stalled connector, or a listener that is not ours). Only that connection is dropped.
    #[error("TCP peer {peer} did not finish the authentication handshake within {timeout:?}")]
    HandshakeTimeout {
        /// The address at the other end.
        peer: std::net::SocketAddr,
        /// How long it was given.
        timeout: std::time::Duration,
    },
    /// The listener dropped a handshake still under way to make room for newer ones (more at
    /// once than it allows from one address, or in all; the oldest go first): the peer was too
    /// slow or silent, not refused for its secret. Only that connection is dropped.
    #[error("dropped the unfinished handshake of TCP peer {peer} after {waited:?}: {why}")]
    HandshakeShed {
        /// The address at the other end.
        peer: std::net::SocketAddr,
        /// How long it had been under way.
        waited: std::time::Duration,
        /// Which bound it made room under.
        why: &'static str,
    },
    /// The TCP listener turned this connector away before the handshake, and said why (an
    /// unauthenticated notice: it proves nothing about the listener).
    #[error("TCP peer {peer} turned the connection away: {why}")]
    TurnedAway {
        /// The address at the other end.
        peer: std::net::SocketAddr,
        /// Why.
        why: crate::tcp::TurnAway,
    },
    /// A message over [`crate::tcp::MAX_MESSAGE`], to send or announced by the peer (which then
    /// is broken or hostile: the link is closed).
    #[error("a message of {len} bytes is over the limit of {max} bytes")]
    MessageTooLarge {
        /// The message's length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A shared-memory ring failed (see [`crate::ring`]).
    #[error(transparent)]
    Ring(#[from] crate::ring::RingError),
    /// An operating-system call failed.
    #[error("{what} failed: {source}")]
    Os {
        /// The operation.
        what: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// The driver's result code, if this is a failed driver call.
    pub fn driver_code(&self) -> Option<cuda_sys::CUresult> {
        match self {
            Error::Cuda(error) => error.code(),
            _ => None,
        }
    }

    pub(crate) fn os(what: &'static str, source: impl Into<std::io::Error>) -> Self {
        Error::Os { what, source: source.into() }
    }
}

/// Checks that `offset..offset + count` lies within `len`.
pub(crate) fn check_range(offset: usize, count: usize, len: usize) -> Result<()> {
    match offset.checked_add(count) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::OutOfBounds { offset, count, len }),
    }
}
