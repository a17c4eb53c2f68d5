//! Which way a GPU tensor travels to a receiver, chosen by topology and reported.
//!
//! # The routes
//! For a tensor on GPU A sent to a receiver whose tensors should land on GPU B
//! ([`Landing`]):
//! 1. **[`Route::SameDevice`]** (A = B): the receiver maps the sender's memory. Zero-copy.
//! 2. **[`Route::PeerMap`]** (B can access A, [`PeerMode::Map`]): the receiver maps the
//!    sender's memory with access for B. Zero-copy; every read crosses the link, and the sender's
//!    memory stays leased until the receiver drops the tensor.
//! 3. **[`Route::PeerCopy`]** (peer access, [`PeerMode::Copy`], the default): the sender's
//!    stream copies the message's tensors into memory on B with the copy engine, after the
//!    producer's work (pushing from the source stream costs a third of a pull's enqueue at small
//!    sizes, `GPU.md`). Tensors that lie close together in one chunk move as one copy, so a
//!    message of many small tensors costs a few copy calls, not one each. The source memory is
//!    the sender's again as soon as the copy is done on the GPU.
//! 4. **[`Route::Staged`]** (no peer access, or no process that sees both GPUs): the sender's
//!    stream copies the data into shared pinned host memory in pieces (4 MiB, 16 MiB above 256 MiB), writing
//!    a word in host memory after each; the receiver's stream waits for each word and copies that
//!    piece onto B, so the two copies overlap. The staging memory is the sender's again once the
//!    receiver's copies are done.
//! 5. **[`Route::Host`]** (the receiver has no GPU, or asked for host memory): the sender's
//!    stream copies into shared host memory; `recv` delivers the message once the copy is done,
//!    without holding up other senders' messages.
//!
//! 6. **[`Route::Nccl`]** (a receiver on another host, over a TCP channel): NCCL moves the
//!    message's GPU tensors, in one group, from the sender's GPU into the receiver's memory on its
//!    landing GPU (for [`Landing::AsSent`], its first GPU). See [`crate::channel`]'s docs on TCP.
//! 7. **[`Route::Tcp`]** (a receiver on another host that takes host tensors): the bytes travel
//!    over the TCP link; a GPU tensor is first copied to host memory by the sender (a CPU wait).
//!    A small message's GPU tensors bound for NCCL take this route too ("small message inline",
//!    see [`inlines`]): the receiver then copies them onto the GPU NCCL would have landed them on.
//!
//! # How it is chosen
//! The receiver's handshake lists its GPUs by UUID, what each can reach, and its [`Routing`]. The
//! sender knows its own GPUs. One pure function decides from both, before anything is
//! sent: a route the receiver's [`Strictness`] refuses is
//! [`Error::RouteRefused`](crate::Error::RouteRefused) at `send`, and nothing else on the
//! channel is affected. Devices are matched by UUID, whatever `CUDA_VISIBLE_DEVICES` each side
//! has. Only a process that sees both GPUs can use a link between them: the sender pushes a copy
//! when it sees B, the receiver maps when it sees A, and when neither does the data is staged.
//! A route slower than the pair allows is logged once per peer and GPU pair at `info`, with why.
//!
//! Every received tensor says how it came ([`Tensor::path`](crate::Tensor::path)).

pub(crate) mod choose;
mod inline;
mod policy;
pub(crate) mod reach;

pub use choose::{Choice, Forbidden, Route};
pub(crate) use choose::{allowed, choose, choose_remote, target};
pub(crate) use inline::inline_choice;
pub use inline::{
    BadThreshold, DEFAULT_INLINE_GPU_UP_TO, INLINE_GPU_ENV, MAX_INLINE_GPU_UP_TO, SMALL_MESSAGE_INLINE,
    inline_threshold, inlines,
};
pub use policy::{Landing, MAX_SOURCES, PeerMode, Routing, Strictness};
pub(crate) use reach::{DeviceReach, LinkReach, MAX_DEVICES, Reach};

/// The staged route's piece size (in a module of its own so that it stays out of the public API
/// while `crate::testing` re-exports it).
pub(crate) mod staging {
    /// The piece size of the staged route for a tensor of `len` bytes: 4 MiB pieces up to 256 MiB,
    /// 16 MiB above (a single-process sweep on an H200 did best with those; below about 1 MiB the
    /// CPU's enqueue cost dominates).
    ///
    /// ```
    /// use tensor_queue::testing::staging_piece;
    /// assert_eq!(staging_piece(64 << 20), 4 << 20);
    /// assert_eq!(staging_piece(1 << 30), 16 << 20);
    /// ```
    pub fn staging_piece(len: usize) -> usize {
        if len > 256 << 20 { 16 << 20 } else { 4 << 20 }
    }
}
pub(crate) use staging::staging_piece;
