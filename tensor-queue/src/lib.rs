//! Typed channels between processes that carry CUDA and host tensors: zero-copy on the same GPU,
//! stream-ordered, lifetime-safe.
//!
//! ```no_run
//! use serde::{Deserialize, Serialize};
//! use tensor_queue::{DType, Receiver, Sender, Tensor};
//!
//! #[derive(Serialize, Deserialize)]
//! struct Batch { x: Tensor, step: u64 }
//!
//! # fn main() -> tensor_queue::Result<()> {
//! let mut receiver = Receiver::<Batch>::bind("/tmp/batches.sock")?;   // in one process
//! let sender = Sender::<Batch>::connect("/tmp/batches.sock")?;        // in another
//! sender.send(&Batch { x: Tensor::from_slice(&[1.0f32, 2.0], DType::F32, &[2])?, step: 1 })?;
//! let batch = receiver.recv()?;
//! assert_eq!(batch.x.to_vec::<f32>()?, [1.0, 2.0]);
//! println!("arrived by {:?}", batch.x.path());                          // HostSharedMemory
//! # Ok(()) }
//! ```
//!
//! - [`Tensor`]: storage, dtype, shape, strides and offset; views share storage. Host tensors live
//!   in shared memory; GPU tensors in exported VMM chunks ([`Tensor::empty_cuda`]) or in a
//!   `cuMemAlloc` buffer of your own ([`Tensor::from_device_buffer`]).
//! - [`Sender`] / [`Receiver`]: messages are any serde type with tensors anywhere inside; bounded,
//!   several senders per receiver; [`Broadcast`] for one message to many without copies;
//!   [`spawn`] / [`from_parent`] for a child with a channel.
//! - Across GPUs: a tensor for a receiver on another GPU is copied over NVLink or PCIe peer
//!   access, mapped over the link, staged through pinned host memory, or delivered as a host
//!   tensor, chosen by topology and the receiver's [`route::Routing`], and reported on every
//!   received tensor ([`Tensor::path`]); see [`route`].
//! - See [`channel`] for the hand-off protocol, the ordering mechanism and why it was chosen.
//!
//! This crate has no `unsafe` code (`forbid(unsafe_code)`): raw memory, descriptors and the
//! driver are ipc-core's, behind safe types.

#![forbid(unsafe_code)]

pub mod channel;
mod clock;
mod error;
mod fences;
mod links;
pub mod memory;
mod nesting;
mod recv;
pub mod route;
mod secret;
mod send;
mod side_table;
mod switches;
mod sync;
mod tensor;
mod wire;

#[allow(deprecated)] // still offered, deprecated where it is defined
pub use channel::from_parent_with;
pub use channel::{
    Broadcast, ConnectOptions, DEFAULT_CAPACITY, Endpoint, EndpointProblem, MessageInfo, Receiver, ReceiverBuilder,
    ReceiverOptions, Rejection, Sender, SenderBuilder, SpawnStep, from_parent, from_parent_duplex,
    from_parent_with_capacity, is_spawned_child, monotonic_ns, spawn, spawn_duplex, spawn_ready, spawn_timeout,
};
pub use error::{Error, ParentProblem, Refusal, Result, TensorProblem, ViewProblem, Violation};
pub use tensor::convert::NativeElement;
pub use tensor::copy::HostCopy;
pub use tensor::dtype::{DType, Element};
pub use tensor::layout::{MAX_DIMS, MAX_VIEW_BYTES};
pub use tensor::{DeviceView, Tensor, TensorDevice, TransferPath, contiguous_strides};
pub use wire::{FrameError, MAX_MESSAGE_BYTES};

/// A contiguous host tensor's elements in its shared memory ([`Tensor::host_elements`]): copied
/// out safely, or borrowed in place with the `unsafe` `as_slice`.
pub use ipc_core::SharedElements as HostElements;
/// The variable a TCP secret is read from where none is given, and a secret's shortest length.
pub use ipc_core::tcp::{MIN_SECRET_LEN, SECRET_ENV};
/// What a GPU program needs besides the channel, so that one crate is enough: devices by ordinal
/// or UUID, their primary contexts, streams, and the [`DeviceMemory`] methods of
/// [`Tensor::cuda_view`].
pub use ipc_core::{Context, Device, DeviceMemory, Stream, Uuid};
pub use secret::Secret;

/// This crate's version (`Cargo.toml`'s), for tools that report it, such as `tq version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Whether a CUDA driver and at least one GPU are usable here (without one, use host tensors).
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{Context, DType, Stream, Tensor, is_gpu_available};
/// let data = [1.0f32, 2.0, 3.0];
/// let x = if is_gpu_available() {
///     let stream = Stream::new(&Context::on_ordinal(0)?)?;
///     Tensor::from_slice_cuda(&data, DType::F32, &[3], &stream)?
/// } else {
///     Tensor::from_slice(&data, DType::F32, &[3])?
/// };
/// assert_eq!(x.to_vec::<f32>()?, data); // the same calls read either
/// # Ok(()) }
/// ```
pub fn is_gpu_available() -> bool {
    ipc_core::is_available()
}

/// What the workspace's own tests and tools (the `tq` CLI's doctor) drive directly: the pure
/// route decision and what it decides from. Not part of the API: it changes without notice.
///
/// These left the public API (each fails to compile, E0603):
/// ```compile_fail,E0603
/// use tensor_queue::route::choose;
/// ```
/// ```compile_fail,E0603
/// use tensor_queue::route::Reach;
/// ```
/// ```compile_fail,E0603
/// let _ = tensor_queue::channel::TCP_PREFIX;
/// ```
/// ```compile_fail,E0603
/// use tensor_queue::wire::Frame;
/// ```
/// ```compile_fail,E0624
/// let (a, _b) = ipc_core::seqpacket::Connection::pair().unwrap();
/// let _ = tensor_queue::Sender::<u8>::from_connection(a);
/// ```
#[doc(hidden)]
pub mod testing {
    /// The environment variable that keeps local links on the socket when `0` (before/after
    /// measurements, tests): see `docs/ARCHITECTURE.md`, "Per-message frames through rings".
    pub use crate::links::rings::RINGS_ENV;
    pub use crate::route::choose::{choose, choose_remote};
    pub use crate::route::reach::{DeviceReach, LinkReach, MAX_DEVICES, Reach};
    pub use crate::route::staging::staging_piece;
    pub use crate::side_table::serde_floor;
    pub use crate::tensor::layout::check_layout;

    /// The frame format, for tests and tools that speak the wire by hand (hostile and
    /// outside peers): the frames each way and how they are cut into packets.
    pub mod wire {
        pub use crate::wire::{
            Answer, Assembler, BYTES_FRAME, ChunkKind, Descriptors, Fence, Frame, FrameError, Hello, LEGACY_HANDLE_LEN,
            LinkFrame, MAGIC, MAX_INLINE_BYTES, MAX_MESSAGE_BYTES, MAX_PACKET, MAX_REASON, MAX_RELEASES,
            MAX_RUN_TENSORS, Source, StorageDesc, TensorDesc, ToReceiver, ToSender, VERSION, packets,
        };
    }
}

/// The README's program, run as a doctest so that it stays true.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
