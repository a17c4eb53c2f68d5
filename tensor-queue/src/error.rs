//! The error type of tensor-queue.

use crate::wire::FrameError;

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong sending or receiving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The driver or the operating system failed.
    #[error(transparent)]
    Core(#[from] ipc_core::Error),
    /// The peer is gone (its process exited or it closed the channel). Messages it sent before
    /// were delivered first.
    #[error("the peer disconnected")]
    Disconnected,
    /// `recv_timeout` waited the whole time.
    #[error("no message within the timeout")]
    Timeout,
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
    /// A peer was refused at the handshake.
    #[error("peer refused: {0}")]
    PeerRefused(String),
    /// A peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An argument that makes no sense.
    #[error("invalid: {0}")]
    Invalid(String),
}

impl From<cuda_sys::Error> for Error {
    fn from(error: cuda_sys::Error) -> Self {
        Error::Core(error.into())
    }
}
