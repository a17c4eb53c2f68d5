//! The sender's mechanism, below the typed [`Sender`](crate::Sender): the protocol's state
//! machine (`protocol`, fed the receiver's frames), one connection's I/O around it
//! (`connection`), a message encoded once (`outgoing`), and the routes' sender half for a
//! receiver on this machine (`routes`) and on another host (`network`). See
//! `docs/ARCHITECTURE.md`.

pub(crate) mod connection;
pub(crate) mod network;
pub(crate) mod outgoing;
pub(crate) mod protocol;
pub(crate) mod routes;
