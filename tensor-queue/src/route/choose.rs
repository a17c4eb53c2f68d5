//! The route decision: pure, from the receiver's policy and what each side's GPUs can reach,
//! so that the channels, `tq doctor` and the tests with made-up topologies run the same code.

use std::fmt;

use ipc_core::Uuid;

use super::policy::{Landing, PeerMode, Routing, Strictness};
use super::reach::Reach;

/// How a GPU tensor reaches the receiver.
///
/// ```
/// use tensor_queue::route::Route;
/// assert!(Route::PeerMap.is_zero_copy() && !Route::PeerCopy.is_zero_copy());
/// assert_eq!(Route::Staged.to_string(), "staged through pinned host memory");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Route {
    /// Same GPU: the receiver maps the sender's memory (zero-copy).
    SameDevice,
    /// Another GPU with peer access: the receiver maps the sender's memory for its GPU
    /// (zero-copy; reads cross the link).
    PeerMap,
    /// Another GPU with peer access: the sender's stream copies the data into memory on the
    /// receiver's GPU with the copy engine.
    PeerCopy,
    /// Another GPU without peer access (or none either process can use): the sender copies into
    /// shared pinned host memory and the receiver copies from there, in pipelined pieces.
    Staged,
    /// The receiver gets host tensors: the sender copies into shared host memory.
    Host,
    /// The receiver is on another host (a TCP channel): NCCL moves the data from the sender's
    /// GPU into memory on the receiver's.
    Nccl,
    /// The receiver is on another host and takes host tensors: the bytes travel over the TCP
    /// link (a GPU tensor is first copied to host memory by the sender).
    Tcp,
}

impl Route {
    /// Whether the receiver reads the sender's memory in place.
    pub fn is_zero_copy(self) -> bool {
        matches!(self, Route::SameDevice | Route::PeerMap)
    }

    /// The wire code.
    pub(crate) fn code(self) -> u8 {
        match self {
            Route::SameDevice => 0,
            Route::PeerMap => 1,
            Route::PeerCopy => 2,
            Route::Staged => 3,
            Route::Host => 4,
            Route::Nccl => 5,
            Route::Tcp => 6,
        }
    }

    /// The route of a wire code.
    pub(crate) fn from_code(code: u8) -> Option<Route> {
        [Route::SameDevice, Route::PeerMap, Route::PeerCopy, Route::Staged, Route::Host, Route::Nccl, Route::Tcp]
            .into_iter()
            .find(|r| r.code() == code)
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Route::SameDevice => "same GPU, mapped",
            Route::PeerMap => "mapped over the peer link",
            Route::PeerCopy => "copied over the peer link",
            Route::Staged => "staged through pinned host memory",
            Route::Host => "copied to host memory",
            Route::Nccl => "moved by NCCL to another host's GPU",
            Route::Tcp => "sent as bytes over TCP to another host's memory",
        })
    }
}

/// The route for one source GPU, where it lands, and, when it is slower than the link between
/// the two GPUs allows, why.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Choice {
    /// The route.
    pub route: Route,
    /// The receiver's GPU the tensor is used from (`None`: host memory).
    pub target: Option<Uuid>,
    /// Why a faster route was not taken, when one exists.
    pub slower_because: Option<String>,
    /// Why this route rather than the one the pair of GPUs usually takes, where it is decided
    /// per message: across hosts, a small message's GPU tensors travel inline over TCP
    /// ([`SMALL_MESSAGE_INLINE`](super::SMALL_MESSAGE_INLINE), see [`Sender::route_for`](crate::Sender::route_for)).
    pub reason: Option<String>,
}

/// Why no route is allowed: the receiver's strictness refuses the only one there is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the {route} route is refused by the receiver's policy ({strict:?}): {why}")]
#[non_exhaustive]
pub struct Forbidden {
    /// The route that would be needed.
    pub route: Route,
    /// The policy that refuses it.
    pub strict: Strictness,
    /// Why that route is the one needed.
    pub why: String,
}

/// The route of a tensor on the GPU `source` to a receiver with `routing` and `receiver`'s
/// GPUs, sent by a process whose GPUs are `sender`.
///
/// ```
/// use tensor_queue::route::{Landing, Route, Routing};
/// use tensor_queue::testing::{DeviceReach, LinkReach, Reach, choose};
/// use tensor_queue::Uuid;
/// let (a, b) = (Uuid([1; 16]), Uuid([2; 16]));
/// let gpu = |uuid| DeviceReach { uuid, stream_ops: true };
/// let nvlink = |from, to| LinkReach { from, to, peer_access: true, nvlink: Some(true), rank: 0, native_atomics: true };
/// let both = Reach { devices: vec![gpu(a), gpu(b)], links: vec![nvlink(a, b), nvlink(b, a)] };
/// let only_b = Reach { devices: vec![gpu(b)], links: vec![] };
/// let only_a = Reach { devices: vec![gpu(a)], links: vec![] };
///
/// let default = Routing::default();
/// assert_eq!(choose(&a, &default, &both, &both).unwrap().route, Route::SameDevice);
/// let on_b = Routing::default().land(Landing::Device(b));
/// assert_eq!(choose(&a, &on_b, &both, &both).unwrap().route, Route::PeerCopy);
/// // Each process sees one GPU (CUDA_VISIBLE_DEVICES): neither can use the link.
/// let choice = choose(&a, &default, &only_b, &only_a).unwrap();
/// assert_eq!((choice.route, choice.target), (Route::Staged, Some(b)));
/// assert!(choice.slower_because.is_some());
/// ```
pub fn choose(source: &Uuid, routing: &Routing, receiver: &Reach, sender: &Reach) -> Result<Choice, Forbidden> {
    let (target, fallback) = target(source, routing, receiver);
    let Some(target) = target else {
        let why = if fallback { "the receiver has no GPU" } else { "the receiver asked for host memory" };
        let choice = Choice { route: Route::Host, target: None, slower_because: Some(why.into()), reason: None };
        return check(choice, routing.strict, fallback);
    };
    if routing.peer == PeerMode::Stage {
        let why = "the receiver's policy asks for staging through host memory".to_string();
        return check(
            Choice { route: Route::Staged, target: Some(target), slower_because: Some(why), reason: None },
            routing.strict,
            false,
        );
    }
    if target == *source {
        return Ok(Choice { route: Route::SameDevice, target: Some(target), slower_because: None, reason: None });
    }
    // Peer access as each process's driver reports it: only a process that sees both GPUs knows.
    let receiver_maps = receiver.peer_access(&target, source);
    let sender_pushes = sender.peer_access(source, &target);
    let route = match routing.peer {
        PeerMode::Map if receiver_maps => Route::PeerMap,
        _ if sender_pushes => Route::PeerCopy,
        _ if receiver_maps => Route::PeerMap,
        _ => Route::Staged,
    };
    let slower_because = match route {
        Route::Staged if receiver.sees(source) || sender.sees(&target) => {
            Some("the two GPUs have no peer access to each other".to_string())
        }
        Route::Staged => Some(
            "neither process can use both GPUs (CUDA_VISIBLE_DEVICES), so neither can use a link between them"
                .to_string(),
        ),
        _ if fallback => Some("the receiver cannot use the sender's GPU: the data is copied to one of its own".into()),
        _ => None,
    };
    check(Choice { route, target: Some(target), slower_because, reason: None }, routing.strict, fallback)
}

/// The route of a tensor on the GPU `source` to a receiver on another host (a TCP channel) with
/// `routing` and `receiver`'s GPUs: NCCL onto one of its GPUs, or bytes over TCP into its host
/// memory when it asks for host tensors or has no GPU.
///
/// ```
/// use tensor_queue::route::{Landing, Route, Routing, Strictness};
/// use tensor_queue::testing::{DeviceReach, Reach, choose_remote};
/// use tensor_queue::Uuid;
/// let (here, there) = (Uuid([1; 16]), Uuid([2; 16]));
/// let remote = Reach { devices: vec![DeviceReach { uuid: there, stream_ops: true }], links: vec![] };
/// let choice = choose_remote(&here, &Routing::default(), &remote).unwrap();
/// assert_eq!((choice.route, choice.target), (Route::Nccl, Some(there)));
/// let host = Routing::default().land(Landing::Host);
/// assert_eq!(choose_remote(&here, &host, &remote).unwrap().route, Route::Tcp);
/// assert!(choose_remote(&here, &Routing::default().strict(Strictness::ZeroCopy), &remote).is_err());
/// ```
pub fn choose_remote(source: &Uuid, routing: &Routing, receiver: &Reach) -> Result<Choice, Forbidden> {
    let (target, fallback) = match routing.landing_for(source) {
        Landing::Host => (None, false),
        Landing::Device(target) if receiver.sees(&target) => (Some(target), false),
        // A GPU of another host is never "as sent": its tensors land on the receiver's first GPU.
        Landing::AsSent => (receiver.devices.first().map(|d| d.uuid), false),
        Landing::Device(_) => (receiver.devices.first().map(|d| d.uuid), true),
    };
    let choice = match target {
        Some(target) => Choice {
            route: Route::Nccl,
            target: Some(target),
            slower_because: fallback.then(|| "the receiver's chosen GPU is not one of its own".to_string()),
            reason: None,
        },
        None => {
            let why = if receiver.devices.is_empty() && routing.landing_for(source) != Landing::Host {
                "the receiver has no GPU"
            } else {
                "the receiver asked for host memory"
            };
            let no_gpu = why == "the receiver has no GPU";
            let choice = Choice { route: Route::Tcp, target: None, slower_because: Some(why.into()), reason: None };
            return check(choice, routing.strict, no_gpu);
        }
    };
    check(choice, routing.strict, fallback)
}

/// The receiver's GPU that tensors from `source` land on (`None`: host memory), and whether
/// that is a fallback rather than the policy's own choice (the receiver cannot use `source`).
pub(crate) fn target(source: &Uuid, routing: &Routing, receiver: &Reach) -> (Option<Uuid>, bool) {
    match routing.landing_for(source) {
        Landing::Host => (None, false),
        Landing::Device(target) if receiver.sees(&target) => (Some(target), false),
        Landing::Device(_) | Landing::AsSent if receiver.sees(source) => (Some(*source), false),
        Landing::Device(_) | Landing::AsSent => (receiver.devices.first().map(|d| d.uuid), true),
    }
}

/// Whether `strict` allows `route` (`fallback`: the landing was not the receiver's choice).
pub(crate) fn allowed(route: Route, strict: Strictness, fallback: bool) -> bool {
    match strict {
        Strictness::Any => true,
        Strictness::NoStaging => !(route == Route::Staged || (matches!(route, Route::Host | Route::Tcp) && fallback)),
        Strictness::ZeroCopy => route.is_zero_copy(),
    }
}

/// The choice, unless the receiver's strictness refuses its route. `fallback`: the landing
/// was not the receiver's own choice but what its GPUs left.
fn check(choice: Choice, strict: Strictness, fallback: bool) -> Result<Choice, Forbidden> {
    if !allowed(choice.route, strict, fallback) {
        let why = choice.slower_because.clone().unwrap_or_else(|| "the policy asks for this landing".into());
        return Err(Forbidden { route: choice.route, strict, why });
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::super::reach::{DeviceReach, LinkReach};
    use super::*;

    fn gpu(n: u8) -> Uuid {
        Uuid([n; 16])
    }

    /// A process that sees `gpus`, with every pair linked as `peer` says.
    fn process(gpus: &[u8], peer: impl Fn(u8, u8) -> bool) -> Reach {
        let devices = gpus.iter().map(|&n| DeviceReach { uuid: gpu(n), stream_ops: true }).collect();
        let mut links = Vec::new();
        for &from in gpus {
            for &to in gpus.iter().filter(|&&to| to != from) {
                let peer_access = peer(from, to);
                let nvlink = Some(peer_access);
                links.push(LinkReach {
                    from: gpu(from),
                    to: gpu(to),
                    peer_access,
                    nvlink,
                    rank: 0,
                    native_atomics: false,
                });
            }
        }
        Reach { devices, links }
    }

    fn route(source: u8, routing: &Routing, receiver: &Reach, sender: &Reach) -> Result<Route, Forbidden> {
        choose(&gpu(source), routing, receiver, sender).map(|c| c.route)
    }

    #[test]
    fn across_hosts_nccl_onto_a_gpu_or_bytes_into_host_memory() {
        let remote = process(&[7, 8], |_, _| true);
        let none = Reach::default();
        let here = gpu(1);
        let choice = choose_remote(&here, &Routing::default(), &remote).unwrap();
        assert_eq!((choice.route, choice.target, choice.slower_because), (Route::Nccl, Some(gpu(7)), None));
        let on_8 = Routing::default().land(Landing::Device(gpu(8)));
        assert_eq!(choose_remote(&here, &on_8, &remote).unwrap().target, Some(gpu(8)));
        // A landing GPU the receiver lacks falls back on its first, and says so.
        let on_9 = Routing::default().land(Landing::Device(gpu(9)));
        let choice = choose_remote(&here, &on_9, &remote).unwrap();
        assert_eq!(choice.target, Some(gpu(7)));
        assert!(choice.slower_because.is_some());
        assert!(choose_remote(&here, &on_9.clone().strict(Strictness::NoStaging), &remote).is_ok());
        // Host memory: asked for, or all a receiver without a GPU has.
        let host = Routing::default().land(Landing::Host);
        assert_eq!(choose_remote(&here, &host, &remote).unwrap().route, Route::Tcp);
        assert_eq!(
            choose_remote(&here, &host.clone().strict(Strictness::NoStaging), &remote).unwrap().route,
            Route::Tcp
        );
        assert_eq!(choose_remote(&here, &Routing::default(), &none).unwrap().route, Route::Tcp);
        let refused = choose_remote(&here, &Routing::default().strict(Strictness::NoStaging), &none).unwrap_err();
        assert_eq!((refused.route, refused.why.as_str()), (Route::Tcp, "the receiver has no GPU"));
        // Nothing across hosts is zero-copy.
        assert!(choose_remote(&here, &Routing::default().strict(Strictness::ZeroCopy), &remote).is_err());
        assert!(choose_remote(&here, &host.strict(Strictness::ZeroCopy), &remote).is_err());
    }

    #[test]
    fn nvlink_pair_seen_by_both() {
        let both = process(&[0, 1], |_, _| true);
        let on = |n| Routing::default().land(Landing::Device(gpu(n)));
        assert_eq!(route(0, &Routing::default(), &both, &both), Ok(Route::SameDevice));
        assert_eq!(route(0, &on(0), &both, &both), Ok(Route::SameDevice));
        assert_eq!(route(0, &on(1), &both, &both), Ok(Route::PeerCopy));
        assert_eq!(route(0, &on(1).peer(PeerMode::Map), &both, &both), Ok(Route::PeerMap));
        assert_eq!(route(0, &Routing::default().land(Landing::Host), &both, &both), Ok(Route::Host));
        let choice = choose(&gpu(0), &on(1), &both, &both).unwrap();
        assert_eq!((choice.target, choice.slower_because), (Some(gpu(1)), None));
    }

    #[test]
    fn no_peer_access_stages_and_strict_modes_refuse() {
        let pcie_no_p2p = process(&[0, 1], |_, _| false);
        let on_1 = Routing::default().land(Landing::Device(gpu(1)));
        let choice = choose(&gpu(0), &on_1, &pcie_no_p2p, &pcie_no_p2p).unwrap();
        assert_eq!(choice.route, Route::Staged);
        assert!(choice.slower_because.unwrap().contains("no peer access"));
        let refused = route(0, &on_1.clone().strict(Strictness::NoStaging), &pcie_no_p2p, &pcie_no_p2p).unwrap_err();
        assert_eq!((refused.route, refused.strict), (Route::Staged, Strictness::NoStaging));
        assert!(refused.to_string().contains("staged"), "{refused}");
        assert!(route(0, &on_1.clone().strict(Strictness::ZeroCopy), &pcie_no_p2p, &pcie_no_p2p).is_err());
        let nvlink = process(&[0, 1], |_, _| true);
        assert_eq!(route(0, &on_1.clone().strict(Strictness::NoStaging), &nvlink, &nvlink), Ok(Route::PeerCopy));
        assert!(route(0, &on_1.clone().strict(Strictness::ZeroCopy), &nvlink, &nvlink).is_err(), "a copy");
        let map = on_1.clone().peer(PeerMode::Map).strict(Strictness::ZeroCopy);
        assert_eq!(route(0, &map, &nvlink, &nvlink), Ok(Route::PeerMap));
        let staged = on_1.peer(PeerMode::Stage);
        assert_eq!(route(0, &staged, &nvlink, &nvlink), Ok(Route::Staged), "forced, over a link");
        assert_eq!(route(1, &staged, &nvlink, &nvlink), Ok(Route::Staged), "forced, on the same GPU");
        assert!(route(1, &staged.strict(Strictness::NoStaging), &nvlink, &nvlink).is_err());
    }

    #[test]
    fn differing_visible_devices() {
        let all = process(&[0, 1], |_, _| true);
        let (only_0, only_1) = (process(&[0], |_, _| true), process(&[1], |_, _| true));
        // Disjoint: nobody sees the pair, so staging is the only way, and the reason says why.
        let choice = choose(&gpu(0), &Routing::default(), &only_1, &only_0).unwrap();
        assert_eq!((choice.route, choice.target), (Route::Staged, Some(gpu(1))));
        assert!(choice.slower_because.unwrap().contains("CUDA_VISIBLE_DEVICES"));
        // The sender sees both: it pushes a copy into the receiver's GPU.
        assert_eq!(route(0, &Routing::default(), &only_1, &all), Ok(Route::PeerCopy));
        // Only the receiver sees both: it maps over the link even when a copy was asked for.
        assert_eq!(route(0, &Routing::default().land(Landing::Device(gpu(1))), &all, &only_0), Ok(Route::PeerMap));
        // A landing device the receiver lacks: treated like "as sent".
        assert_eq!(route(0, &Routing::default().land(Landing::Device(gpu(7))), &all, &all), Ok(Route::SameDevice));
    }

    #[test]
    fn receivers_without_gpus_get_host_tensors() {
        let none = Reach::default();
        let sender = process(&[0], |_, _| true);
        let choice = choose(&gpu(0), &Routing::default(), &none, &sender).unwrap();
        assert_eq!((choice.route, choice.target), (Route::Host, None));
        assert_eq!(
            route(0, &Routing::default().strict(Strictness::NoStaging), &none, &sender).unwrap_err().route,
            Route::Host
        );
        let asked = Routing::default().land(Landing::Host).strict(Strictness::NoStaging);
        assert_eq!(
            route(0, &asked, &process(&[0], |_, _| true), &sender),
            Ok(Route::Host),
            "asked for, not a fallback"
        );
    }

    #[test]
    fn per_source_landing() {
        let all = process(&[0, 1, 2], |from, to| from + to != 3); // 1 and 2 have no P2P
        let routing = Routing::default().land(Landing::Device(gpu(2))).land_from(gpu(0), Landing::Device(gpu(1)));
        assert_eq!(route(0, &routing, &all, &all), Ok(Route::PeerCopy));
        assert_eq!(route(1, &routing, &all, &all), Ok(Route::Staged));
        assert_eq!(route(2, &routing, &all, &all), Ok(Route::SameDevice));
        for code in 0..=255u8 {
            assert!(Route::from_code(code).is_none_or(|r| r.code() == code));
        }
    }
}
