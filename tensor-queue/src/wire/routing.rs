//! The codec of the route policy in a receiver's `Hello`: what its GPUs reach ([`Reach`]),
//! where its tensors land ([`Landing`]) and its [`Routing`]. The types are the route decision's
//! (`crate::route`, which knows nothing of bytes); their encoding is the wire's.

use ipc_core::Uuid;

use super::{FrameError, Reader, Writer, decode_bool};
use crate::route::{DeviceReach, Landing, LinkReach, MAX_DEVICES, MAX_SOURCES, PeerMode, Reach, Routing, Strictness};

pub(super) fn encode_reach(w: &mut Writer, reach: &Reach) {
    let devices = &reach.devices[..reach.devices.len().min(MAX_DEVICES)];
    w.u32(devices.len() as u32);
    for device in devices {
        w.bytes(&device.uuid.0);
        w.u8(u8::from(device.stream_ops));
    }
    let links = &reach.links[..reach.links.len().min(MAX_DEVICES * MAX_DEVICES)];
    w.u32(links.len() as u32);
    for link in links {
        w.bytes(&link.from.0);
        w.bytes(&link.to.0);
        w.u8(u8::from(link.peer_access) | u8::from(link.native_atomics) << 1);
        w.u8(match link.nvlink {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        });
        w.u32(link.rank as u32);
    }
}

pub(super) fn decode_reach(r: &mut Reader<'_>) -> Result<Reach, FrameError> {
    let count = r.count("devices", MAX_DEVICES)?;
    let mut devices = Vec::with_capacity(count);
    for _ in 0..count {
        let uuid = Uuid(r.array()?);
        let stream_ops = decode_bool(r, "device flags")?;
        devices.push(DeviceReach { uuid, stream_ops });
    }
    let count = r.count("links", MAX_DEVICES * MAX_DEVICES)?;
    let mut links = Vec::with_capacity(count);
    for _ in 0..count {
        let (from, to) = (Uuid(r.array()?), Uuid(r.array()?));
        let flags = r.u8()?;
        if flags > 3 {
            return Err(FrameError::Invalid("link flags"));
        }
        let nvlink = match r.u8()? {
            0 => None,
            1 => Some(false),
            2 => Some(true),
            _ => return Err(FrameError::Invalid("link kind")),
        };
        let rank = r.u32()? as i32;
        links.push(LinkReach { from, to, peer_access: flags & 1 != 0, native_atomics: flags & 2 != 0, nvlink, rank });
    }
    Ok(Reach { devices, links })
}

pub(super) fn encode_landing(w: &mut Writer, landing: Landing) {
    match landing {
        Landing::AsSent => w.u8(0),
        Landing::Device(uuid) => {
            w.u8(1);
            w.bytes(&uuid.0);
        }
        Landing::Host => w.u8(2),
    }
}

pub(super) fn decode_landing(r: &mut Reader<'_>) -> Result<Landing, FrameError> {
    Ok(match r.u8()? {
        0 => Landing::AsSent,
        1 => Landing::Device(Uuid(r.array()?)),
        2 => Landing::Host,
        _ => return Err(FrameError::Invalid("landing")),
    })
}

pub(super) fn encode_routing(w: &mut Writer, routing: &Routing) {
    encode_landing(w, routing.landing);
    let per_source = &routing.per_source[..routing.per_source.len().min(MAX_SOURCES)];
    w.u32(per_source.len() as u32);
    for (uuid, landing) in per_source {
        w.bytes(&uuid.0);
        encode_landing(w, *landing);
    }
    w.u8(match routing.peer {
        PeerMode::Copy => 0,
        PeerMode::Map => 1,
        PeerMode::Stage => 2,
    });
    w.u8(match routing.strict {
        Strictness::Any => 0,
        Strictness::NoStaging => 1,
        Strictness::ZeroCopy => 2,
    });
}

pub(super) fn decode_routing(r: &mut Reader<'_>) -> Result<Routing, FrameError> {
    let landing = decode_landing(r)?;
    let count = r.count("per-source landings", MAX_SOURCES)?;
    let per_source = (0..count).map(|_| Ok((Uuid(r.array()?), decode_landing(r)?))).collect::<Result<_, _>>()?;
    let peer = match r.u8()? {
        0 => PeerMode::Copy,
        1 => PeerMode::Map,
        2 => PeerMode::Stage,
        _ => return Err(FrameError::Invalid("peer mode")),
    };
    let strict = match r.u8()? {
        0 => Strictness::Any,
        1 => Strictness::NoStaging,
        2 => Strictness::ZeroCopy,
        _ => return Err(FrameError::Invalid("strictness")),
    };
    Ok(Routing { landing, per_source, peer, strict })
}
