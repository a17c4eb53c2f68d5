//! What a process's GPUs can reach: its half of the route decision. A receiver sends its own in
//! the handshake; a sender asks the driver for its own.

use std::sync::OnceLock;

use ipc_core::{Interconnect, Topology, Uuid};

/// One GPU a process can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceReach {
    /// The GPU.
    pub uuid: Uuid,
    /// Whether it has 64-bit stream memory operations (how received tensors are ordered).
    pub stream_ops: bool,
}

/// What one GPU (`from`) can do with another's memory (`to`), both visible to the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkReach {
    /// The accessing GPU.
    pub from: Uuid,
    /// The GPU whose memory is accessed.
    pub to: Uuid,
    /// Whether `from` can map `to`'s memory.
    pub peer_access: bool,
    /// NVLink (`Some(true)`), PCIe or through the host (`Some(false)`), or unknown (no NVML).
    pub nvlink: Option<bool>,
    /// The driver's relative performance rank of the link (0 without peer access).
    pub rank: i32,
    /// Whether atomics over the link are native.
    pub native_atomics: bool,
}

/// The GPUs a process can use and what each can reach.
///
/// ```
/// use tensor_queue::testing::{DeviceReach, LinkReach, Reach};
/// use tensor_queue::Uuid;
/// let (a, b) = (Uuid([1; 16]), Uuid([2; 16]));
/// let reach = Reach {
///     devices: vec![DeviceReach { uuid: a, stream_ops: true }, DeviceReach { uuid: b, stream_ops: true }],
///     links: vec![LinkReach { from: b, to: a, peer_access: true, nvlink: Some(true), rank: 0, native_atomics: true }],
/// };
/// assert!(reach.sees(&a) && reach.link(&b, &a).is_some_and(|l| l.peer_access));
/// assert!(reach.link(&a, &b).is_none(), "links are directed");
/// assert!(Reach::default().devices.is_empty(), "a process without GPUs");
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reach {
    /// Its GPUs, in its ordinal order.
    pub devices: Vec<DeviceReach>,
    /// Every ordered pair of its GPUs with what the driver says of it.
    pub links: Vec<LinkReach>,
}

/// The most GPUs a reach lists (the wire's limit).
pub const MAX_DEVICES: usize = 64;

impl Reach {
    /// This process's GPUs as the driver reports them (asked once), or none where there is no
    /// driver or no GPU. Everything a route decision needs, and only that: the driver's answers
    /// (cheap), never NVML's (tens of milliseconds to initialise), so links' `nvlink` is `None`.
    pub fn local() -> &'static Reach {
        static LOCAL: OnceLock<Reach> = OnceLock::new();
        LOCAL.get_or_init(|| Reach::query_or_none(Topology::query_driver))
    }

    /// [`Reach::local`] with each link's `nvlink` asked of NVML where it is present (asked once):
    /// for reports such as `tq doctor`, never for the route of a message (it does not change one).
    pub fn local_with_interconnect() -> &'static Reach {
        static LOCAL: OnceLock<Reach> = OnceLock::new();
        LOCAL.get_or_init(|| Reach::query_or_none(Topology::query))
    }

    fn query_or_none(topology: fn() -> ipc_core::Result<Topology>) -> Reach {
        match Reach::query(topology) {
            Ok(reach) => reach,
            Err(error) => {
                tracing::debug!(%error, "no GPUs here: host routes only");
                Reach::default()
            }
        }
    }

    fn query(topology: fn() -> ipc_core::Result<Topology>) -> ipc_core::Result<Reach> {
        if !ipc_core::is_available() {
            return Ok(Reach::default());
        }
        Ok(Reach::from_topology(&topology()?, |ordinal| {
            let attribute = ipc_core::DeviceAttribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS;
            ipc_core::Device::get(ordinal).and_then(|d| d.attribute(attribute)).is_ok_and(|v| v != 0)
        }))
    }

    /// The reach a topology describes; `stream_ops` says whether the device of an ordinal has
    /// 64-bit stream memory operations.
    pub fn from_topology(topology: &Topology, stream_ops: impl Fn(i32) -> bool) -> Reach {
        let uuid = |ordinal: i32| topology.devices.iter().find(|d| d.ordinal == ordinal).map(|d| d.uuid);
        Reach {
            devices: topology
                .devices
                .iter()
                .take(MAX_DEVICES)
                .map(|d| DeviceReach { uuid: d.uuid, stream_ops: stream_ops(d.ordinal) })
                .collect(),
            links: topology
                .links
                .iter()
                .filter_map(|link| {
                    Some(LinkReach {
                        from: uuid(link.from)?,
                        to: uuid(link.to)?,
                        peer_access: link.can_access_peer,
                        nvlink: match link.interconnect {
                            Interconnect::NvLink => Some(true),
                            Interconnect::NotNvLink => Some(false),
                            _ => None,
                        },
                        rank: link.performance_rank,
                        native_atomics: link.native_atomics,
                    })
                })
                .take(MAX_DEVICES * MAX_DEVICES)
                .collect(),
        }
    }

    /// Whether the process can use the GPU `uuid`.
    pub fn sees(&self, uuid: &Uuid) -> bool {
        self.devices.iter().any(|d| d.uuid == *uuid)
    }

    /// What `from` can do with `to`'s memory, if the process sees both.
    pub fn link(&self, from: &Uuid, to: &Uuid) -> Option<&LinkReach> {
        self.links.iter().find(|l| l.from == *from && l.to == *to)
    }

    /// Whether `from` can map `to`'s memory (a GPU always reaches its own).
    pub fn peer_access(&self, from: &Uuid, to: &Uuid) -> bool {
        (from == to && self.sees(from)) || self.link(from, to).is_some_and(|l| l.peer_access)
    }
}
