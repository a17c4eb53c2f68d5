//! The transport seam: a socket speaking frames (`link`), where a receiver listens
//! (`endpoint`), and the worker thread that owns an NCCL communicator (`nccl`). See
//! `docs/ARCHITECTURE.md`.

pub(crate) mod endpoint;
pub(crate) mod link;
pub(crate) mod nccl;
pub(crate) mod poll;
pub(crate) mod rings;
pub(crate) mod wake;
