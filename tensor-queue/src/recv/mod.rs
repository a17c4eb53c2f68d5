//! The receiver's mechanism, below the typed [`Receiver`](crate::Receiver): accepting and
//! greeting senders, one sender's connection and what each frame does, where a received tensor
//! lands, chunks mapped once per process, what the receiver owes each sender, and returning
//! leases. See `docs/ARCHITECTURE.md`.

pub(crate) mod acceptor;
pub(crate) mod connection;
pub(crate) mod connections;
pub(crate) mod devices;
pub(crate) mod imports;
pub(crate) mod peer;
pub(crate) mod placement;
pub(crate) mod readiness;
pub(crate) mod release;
pub(crate) mod remote;
