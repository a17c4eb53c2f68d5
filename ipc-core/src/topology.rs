//! Which device pairs can reach each other's memory, and over what.
//!
//! The driver answers peer access, its performance rank and native atomics. It does not say
//! whether the link is NVLink; NVML (`libnvidia-ml.so.1`, loaded at run time like libcuda) does,
//! and where NVML is missing the interconnect is reported as [`Interconnect::Unknown`].

use std::fmt;

use cuda_sys::nvml::NVML_P2P_STATUS_OK;
use cuda_sys::{CUdevice_P2PAttribute, driver};

use crate::{Device, Result, Uuid};

/// The kind of link between two devices, where the driver tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interconnect {
    /// NVML reports an NVLink path.
    NvLink,
    /// NVML reports no NVLink path (PCIe or through the host).
    NotNvLink,
    /// NVML is not available here.
    Unknown,
}

/// The raw peer attributes of one ordered device pair, as the driver returns them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawPeerAttributes {
    /// `cuDeviceCanAccessPeer`.
    pub can_access_peer: i32,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`.
    pub performance_rank: i32,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
    pub native_atomic: i32,
    /// `nvmlDeviceGetP2PStatus(.., NVML_P2P_CAPS_INDEX_NVLINK)`, if NVML answered.
    pub nvml_nvlink_status: Option<i32>,
}

/// What one device can do with another's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLink {
    /// The accessing device's ordinal.
    pub from: i32,
    /// The accessed device's ordinal.
    pub to: i32,
    /// Whether `from` can map `to`'s memory.
    pub can_access_peer: bool,
    /// The driver's relative rank of the link (higher is faster); 0 without peer access.
    pub performance_rank: i32,
    /// Whether atomics over the link are native.
    pub native_atomics: bool,
    /// The link's kind.
    pub interconnect: Interconnect,
}

impl PeerLink {
    /// Interprets raw attribute values.
    pub fn decode(from: i32, to: i32, raw: RawPeerAttributes) -> PeerLink {
        let can_access_peer = raw.can_access_peer != 0;
        PeerLink {
            from,
            to,
            can_access_peer,
            performance_rank: if can_access_peer { raw.performance_rank } else { 0 },
            native_atomics: can_access_peer && raw.native_atomic != 0,
            interconnect: match raw.nvml_nvlink_status {
                None => Interconnect::Unknown,
                Some(NVML_P2P_STATUS_OK) => Interconnect::NvLink,
                Some(_) => Interconnect::NotNvLink,
            },
        }
    }
}

/// A device as the topology lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSummary {
    /// Ordinal in this process.
    pub ordinal: i32,
    /// The GPU's UUID.
    pub uuid: Uuid,
    /// The GPU's name.
    pub name: String,
}

/// Every visible device and every ordered pair of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// The devices, by ordinal.
    pub devices: Vec<DeviceSummary>,
    /// One entry per ordered pair of distinct devices.
    pub links: Vec<PeerLink>,
}

impl Topology {
    /// Asks the driver (and NVML, where present) about every device pair.
    pub fn query() -> Result<Topology> {
        Topology::query_with(true)
    }

    /// Asks the driver alone about every device pair: everything [`Topology::query`] answers
    /// except the interconnect, which is [`Interconnect::Unknown`]. NVML's initialisation costs
    /// tens of milliseconds, and peer access (what a route needs) is the driver's answer.
    pub fn query_driver() -> Result<Topology> {
        Topology::query_with(false)
    }

    fn query_with(use_nvml: bool) -> Result<Topology> {
        let devices = Device::all()?;
        let mut summaries = Vec::new();
        for device in &devices {
            summaries.push(DeviceSummary { ordinal: device.ordinal(), uuid: device.uuid()?, name: device.name()? });
        }
        let nvml = if use_nvml { nvml::Nvml::open() } else { None };
        let mut links = Vec::new();
        for from in &devices {
            for to in devices.iter().filter(|to| *to != from) {
                let mut raw = RawPeerAttributes::default();
                // SAFETY: the out-pointer is valid; both devices came from the driver.
                unsafe { driver!(cuDeviceCanAccessPeer(&mut raw.can_access_peer, from.raw(), to.raw())) }?;
                raw.performance_rank =
                    peer_attribute(from, to, CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?;
                raw.native_atomic =
                    peer_attribute(from, to, CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)?;
                raw.nvml_nvlink_status = nvml.as_ref().and_then(|nvml| {
                    nvml.nvlink_status(&summaries[from.ordinal() as usize].uuid, &summaries[to.ordinal() as usize].uuid)
                });
                links.push(PeerLink::decode(from.ordinal(), to.ordinal(), raw));
            }
        }
        Ok(Topology { devices: summaries, links })
    }

    /// The link from one ordinal to another.
    pub fn link(&self, from: i32, to: i32) -> Option<&PeerLink> {
        self.links.iter().find(|link| link.from == from && link.to == to)
    }
}

fn peer_attribute(from: &Device, to: &Device, attribute: CUdevice_P2PAttribute) -> Result<i32> {
    let mut value = 0;
    // SAFETY: the out-pointer is valid; both devices came from the driver.
    unsafe { driver!(cuDeviceGetP2PAttribute(&mut value, attribute, from.raw(), to.raw())) }?;
    Ok(value)
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for device in &self.devices {
            writeln!(f, "GPU{} {} {}", device.ordinal, device.name, device.uuid)?;
        }
        for link in &self.links {
            writeln!(
                f,
                "GPU{} -> GPU{}: peer access {}, rank {}, native atomics {}, interconnect {:?}",
                link.from,
                link.to,
                if link.can_access_peer { "yes" } else { "no" },
                link.performance_rank,
                if link.native_atomics { "yes" } else { "no" },
                link.interconnect
            )?;
        }
        Ok(())
    }
}

/// The few NVML calls the topology needs, through `cuda_sys::nvml` (loaded at run time, like the
/// driver).
mod nvml {
    use std::ffi::CString;

    use cuda_sys::nvml::{
        NVML_P2P_CAPS_INDEX_NVLINK, NVML_SUCCESS, nvmlDevice_t, nvmlDeviceGetHandleByUUID, nvmlDeviceGetP2PStatus,
        nvmlInit_v2, nvmlShutdown,
    };

    use crate::Uuid;

    /// NVML, initialised for as long as this lives.
    pub struct Nvml(());

    impl Nvml {
        /// Initialises NVML, or `None` where it is missing or fails.
        pub fn open() -> Option<Nvml> {
            // SAFETY: `nvmlInit_v2` takes no arguments and returns a status code.
            (unsafe { nvmlInit_v2() } == Ok(NVML_SUCCESS)).then_some(Nvml(()))
        }

        fn handle(&self, uuid: &Uuid) -> Option<nvmlDevice_t> {
            let text = CString::new(uuid.to_string()).ok()?;
            let mut handle = std::ptr::null_mut();
            // SAFETY: `text` is NUL-terminated and `handle` a valid out-pointer; NVML is
            // initialised while `self` lives.
            (unsafe { nvmlDeviceGetHandleByUUID(text.as_ptr(), &mut handle) } == Ok(NVML_SUCCESS)).then_some(handle)
        }

        /// NVML's P2P status for NVLink between two devices (0 means an NVLink path exists).
        pub fn nvlink_status(&self, from: &Uuid, to: &Uuid) -> Option<i32> {
            let (from, to) = (self.handle(from)?, self.handle(to)?);
            let mut status = 0;
            // SAFETY: both handles came from NVML; `status` is a valid out-pointer.
            let result = unsafe { nvmlDeviceGetP2PStatus(from, to, NVML_P2P_CAPS_INDEX_NVLINK, &mut status) };
            (result == Ok(NVML_SUCCESS)).then_some(status)
        }
    }

    impl Drop for Nvml {
        fn drop(&mut self) {
            // SAFETY: balances the successful `nvmlInit_v2` in `open`.
            let _ = unsafe { nvmlShutdown() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_an_nvlink_pair() {
        let raw = RawPeerAttributes {
            can_access_peer: 1,
            performance_rank: 0,
            native_atomic: 1,
            nvml_nvlink_status: Some(0),
        };
        let link = PeerLink::decode(0, 1, raw);
        assert!(link.can_access_peer && link.native_atomics);
        assert_eq!(link.interconnect, Interconnect::NvLink);
    }

    #[test]
    fn without_peer_access_rank_and_atomics_mean_nothing() {
        let raw = RawPeerAttributes {
            can_access_peer: 0,
            performance_rank: 3,
            native_atomic: 1,
            nvml_nvlink_status: Some(5),
        };
        let link = PeerLink::decode(1, 0, raw);
        assert!(!link.can_access_peer && !link.native_atomics);
        assert_eq!(link.performance_rank, 0);
        assert_eq!(link.interconnect, Interconnect::NotNvLink);
        let unknown = PeerLink::decode(1, 0, RawPeerAttributes { nvml_nvlink_status: None, ..raw });
        assert_eq!(unknown.interconnect, Interconnect::Unknown);
    }

    #[test]
    fn prints_one_line_per_device_and_link() {
        let topology = Topology {
            devices: vec![DeviceSummary { ordinal: 0, uuid: Uuid([1; 16]), name: "GPU A".into() }],
            links: vec![PeerLink::decode(
                0,
                1,
                RawPeerAttributes {
                    can_access_peer: 1,
                    performance_rank: 1,
                    native_atomic: 0,
                    nvml_nvlink_status: None,
                },
            )],
        };
        let text = topology.to_string();
        assert!(text.contains("GPU0 GPU A GPU-01010101"), "{text}");
        assert!(
            text.contains("GPU0 -> GPU1: peer access yes, rank 1, native atomics no, interconnect Unknown"),
            "{text}"
        );
    }
}
