//! The receiver's mechanism, below the typed [`Receiver`](crate::Receiver): accepting and
//! greeting senders, the protocol's state machines (`protocol`: what each frame may say, what is
//! owed back), one sender's connection and what each frame does, where a received tensor
//! lands, chunks mapped once per process, what the receiver owes each sender, and returning
//! leases. See `docs/ARCHITECTURE.md`.

pub(crate) mod acceptor;
pub(crate) mod connection;
pub(crate) mod connections;
pub(crate) mod devices;
pub(crate) mod imports;
pub(crate) mod peer;
pub(crate) mod placement;
pub(crate) mod protocol;
pub(crate) mod readiness;
pub(crate) mod release;
pub(crate) mod remote;
