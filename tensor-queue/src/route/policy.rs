//! What a receiver asks for: where GPU tensors land, how they cross a peer link, and which
//! fallbacks it refuses.

use ipc_core::Uuid;

/// Where a received GPU tensor should land.
///
/// ```
/// use tensor_queue::route::{Landing, Routing};
/// use tensor_queue::Uuid;
/// let gpu1 = Uuid([1; 16]);
/// let routing = Routing::default().land(Landing::Device(gpu1));
/// assert_eq!(routing.landing_for(&Uuid([9; 16])), Landing::Device(gpu1));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Landing {
    /// Where it was sent from: mapped in place (zero-copy) when this process can see that GPU;
    /// else on this process's first GPU (copied by the best route); else in host memory.
    AsSent,
    /// On this GPU of the receiver (by UUID): mapped in place if it is already there, else
    /// copied (or mapped over the link with [`PeerMode::Map`]).
    Device(Uuid),
    /// In host memory: the sender copies the data into shared host memory.
    Host,
}

/// How a tensor crosses to another GPU that can reach its memory directly (NVLink or PCIe P2P),
/// or whether it is staged through host memory whatever the topology.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerMode {
    /// The data is copied by the copy engine into memory on the landing GPU (pushed from the
    /// producer's stream, the cheapest enqueue); the sender's memory is free again as soon as
    /// the copy is done. The default.
    Copy,
    /// The receiver maps the sender's memory for the landing GPU: zero-copy, every read crosses
    /// the link, and the sender's memory stays leased until the tensor is dropped.
    Map,
    /// Staged through shared pinned host memory even where a link or the same GPU would do:
    /// to keep a link free for other traffic, or to try the staged route on any machine.
    Stage,
}

/// Fallbacks a receiver refuses: a message that would need one is refused at `send` with
/// [`Error::RouteRefused`](crate::Error::RouteRefused), and the channel goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Strictness {
    /// Any route (the default).
    Any,
    /// No staging through host memory between two GPUs (a GPU tensor may still land in host
    /// memory where the receiver asked for [`Landing::Host`]).
    NoStaging,
    /// Only zero-copy routes: the same GPU, or a mapping over a peer link. A GPU tensor bound
    /// for host memory is a copy too, and refused.
    ZeroCopy,
}

/// A receiver's routing policy: [`Landing`] for every source GPU or per source GPU, the
/// [`PeerMode`], and the [`Strictness`].
///
/// ```
/// use tensor_queue::route::{Landing, PeerMode, Routing, Strictness};
/// use tensor_queue::Uuid;
/// let (gpu0, gpu1) = (Uuid([0; 16]), Uuid([1; 16]));
/// let routing = Routing::default()
///     .land(Landing::Device(gpu1))
///     .land_from(gpu0, Landing::Host) // what comes from gpu0 lands in host memory
///     .peer(PeerMode::Map)
///     .strict(Strictness::NoStaging);
/// assert_eq!(routing.landing_for(&gpu0), Landing::Host);
/// assert_eq!(routing.landing_for(&gpu1), Landing::Device(gpu1));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Routing {
    /// Where tensors from any GPU land, unless `per_source` says otherwise.
    pub landing: Landing,
    /// Per source GPU (by UUID), where its tensors land.
    pub per_source: Vec<(Uuid, Landing)>,
    /// How tensors cross a peer link.
    pub peer: PeerMode,
    /// Which fallbacks are refused.
    pub strict: Strictness,
}

/// The most per-source entries (more GPUs than any machine has).
pub const MAX_SOURCES: usize = 64;

impl Default for Routing {
    /// [`Landing::AsSent`], [`PeerMode::Copy`], [`Strictness::Any`]: zero-copy where the
    /// receiver sees the sender's GPU, the best copy where it does not, never a refusal.
    fn default() -> Routing {
        Routing { landing: Landing::AsSent, per_source: Vec::new(), peer: PeerMode::Copy, strict: Strictness::Any }
    }
}

impl Routing {
    /// Sets where tensors from any GPU land.
    pub fn land(mut self, landing: Landing) -> Routing {
        self.landing = landing;
        self
    }

    /// Sets where tensors from the GPU `source` land.
    pub fn land_from(mut self, source: Uuid, landing: Landing) -> Routing {
        self.per_source.retain(|(uuid, _)| *uuid != source);
        self.per_source.push((source, landing));
        self
    }

    /// Sets how tensors cross a peer link.
    pub fn peer(mut self, peer: PeerMode) -> Routing {
        self.peer = peer;
        self
    }

    /// Sets which fallbacks are refused.
    pub fn strict(mut self, strict: Strictness) -> Routing {
        self.strict = strict;
        self
    }

    /// Where tensors from `source` land.
    pub fn landing_for(&self, source: &Uuid) -> Landing {
        self.per_source.iter().find(|(uuid, _)| uuid == source).map_or(self.landing, |(_, landing)| *landing)
    }
}
