//! Safe RAII types over the CUDA driver API, for processes that share GPU memory.
//!
//! | type | CPU idea it mirrors |
//! | --- | --- |
//! | [`Device`] | a socket on the motherboard, found by ordinal or by [`Uuid`] |
//! | [`Context`] | an address space on that device (the primary context, shared by the process) |
//! | [`Stream`] | a thread: work on it runs in order |
//! | [`Event`] | a flag one stream raises and another waits for; [`IpcEventHandle`] crosses processes |
//! | [`DeviceBuffer`] | a `Vec<u8>` in GPU memory; [`IpcMemHandle`] shares it with another process |
//! | [`VmmAllocation`] | GPU memory that travels as a file descriptor ([`fd_passing`]) |
//! | [`SharedMemory`] / [`PinnedHostBuffer`] | host memory two processes (and the GPU) can see |
//! | [`Module`] / [`Function`] | a loaded shared library of GPU kernels |
//! | [`Topology`] | `lstopo` for GPUs: which pairs reach each other, and how |
//! | [`nccl::Communicator`] | a connected socket between GPUs of different processes or hosts (NCCL) |
//! | [`tcp::TcpLink`] | a TCP connection whose peer proved it holds a shared secret (no encryption) |
//! | [`ring::RingWriter`] / [`ring::RingReader`] | a pipe of records in shared memory between two processes, woken by a futex |
//! | [`process::ProcessHandle`] | `kill -0`, but for the process it was opened for, and pollable |
//!
//! Every type holds an `Arc<Context>`, binds it before each driver call, and releases what it
//! owns in `Drop`.
//!
//! # Errors in `Drop`
//! A failure while releasing cannot be returned. The policy, used by every type here: it is logged
//! with `tracing::warn!` naming the call, and otherwise ignored. `CUDA_ERROR_DEINITIALIZED` (the
//! driver is shutting down at process exit, and frees everything itself) is not logged.

/// Implements [`DeviceMemory`] for a type that keeps its device address, its length and a
/// `context: Arc<Context>` in fields: `device_memory_fields!(Type, ptr: field, len: field.path)`.
macro_rules! device_memory_fields {
    ($type:ty, ptr: $($ptr:ident).+, len: $($len:ident).+) => {
        impl $crate::DeviceMemory for $type {
            fn device_ptr(&self) -> cuda_sys::CUdeviceptr {
                self.$($ptr).+
            }
            fn len(&self) -> usize {
                self.$($len).+
            }
            fn context(&self) -> &std::sync::Arc<$crate::Context> {
                &self.context
            }
        }
    };
}

mod context;
pub mod deadline;
mod device;
pub mod driver_info;
mod error;
mod event;
pub mod fd_passing;
mod handle;
mod host;
pub mod inherit;
pub mod layout;
mod memory;
mod module;
pub mod nccl;
pub mod process;
#[cfg(feature = "tokio")]
pub mod reactor;
pub mod ring;
pub mod seqpacket;
mod stream;
pub mod sync;
pub mod tcp;
pub mod topology;
pub mod transport;
mod vmm;

pub use context::Context;
pub use device::{Device, Uuid};
pub use error::{Error, Result};
pub use event::{Event, IpcEventHandle};
pub use handle::HostId;
pub use host::{PinnedHostBuffer, PinnedSharedMemory, RegisteredMemory, SharedElements, SharedMemory};
pub use memory::{DeviceBuffer, DeviceMemory, ImportedIpcMemory, IpcMemHandle, copy_peer_async};
pub use module::{Function, LaunchConfig, Module};
pub use stream::Stream;
pub use topology::{Interconnect, PeerLink, Topology};
pub use vmm::VmmAllocation;

pub use cuda_sys as sys;

/// A device property to ask [`Device::attribute`] for (the driver's `CUdevice_attribute`), named
/// here so that users of this crate need not name `cuda_sys`.
pub use cuda_sys::CUdevice_attribute as DeviceAttribute;

/// Whether a CUDA driver is loaded and initialises here (asked once).
///
/// ```
/// if !ipc_core::is_available() {
///     println!("no CUDA driver here: host memory only");
/// }
/// ```
pub fn is_available() -> bool {
    cuda_sys::is_available()
}

/// Runs a release call from `Drop` with `context` current, logging a failure (crate policy).
pub(crate) fn release_in(context: &Context, call: impl FnOnce() -> std::result::Result<(), cuda_sys::Error>) {
    release(context.bind_raw().and_then(|()| call()));
}

/// Logs a failed release call from `Drop`, per the crate's policy.
pub(crate) fn release(result: std::result::Result<(), cuda_sys::Error>) {
    if let Err(error) = result
        && error.code() != Some(cuda_sys::CUresult::CUDA_ERROR_DEINITIALIZED)
    {
        tracing::warn!(%error, "releasing a CUDA resource failed");
    }
}
