//! The wire form of CUDA IPC handles: the driver's 64 bytes plus what the importer must check.
//!
//! A raw `CUipcMemHandle` means nothing on another machine, and opening one there fails in
//! confusing ways. The envelope carries the machine's boot id, so an import from elsewhere is a
//! clear [`Error::ForeignHost`], and the device UUID, so the importer maps it on the right GPU
//! whatever its `CUDA_VISIBLE_DEVICES`.

use std::fmt;
use std::sync::OnceLock;

use crate::{Error, Result, Uuid};

/// Identifies one boot of one machine (`/proc/sys/kernel/random/boot_id`). Containers on one
/// host share it, as they share the kernel and the GPUs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HostId(pub [u8; 16]);

impl HostId {
    /// This machine's boot id.
    pub fn current() -> Result<HostId> {
        static CURRENT: OnceLock<std::result::Result<HostId, String>> = OnceLock::new();
        CURRENT
            .get_or_init(|| {
                let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                    .map_err(|e| format!("reading /proc/sys/kernel/random/boot_id: {e}"))?;
                let uuid: Uuid = text.trim().parse().map_err(|e: Error| e.to_string())?;
                Ok(HostId(uuid.0))
            })
            .clone()
            .map_err(|message| Error::os("identifying this machine", std::io::Error::other(message)))
    }
}

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// What a handle stands for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(crate) enum HandleKind {
    Memory = 1,
    Event = 2,
}

/// The decoded envelope.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Envelope {
    pub kind: HandleKind,
    pub host: HostId,
    pub device: Uuid,
    pub len: u64,
    pub raw: [u8; 64],
}

const MAGIC: [u8; 4] = *b"CIPH";
const VERSION: u8 = 1;
/// Encoded size: magic, version, kind, two reserved bytes, host, device, length, raw handle.
pub(crate) const ENCODED_LEN: usize = 4 + 1 + 1 + 2 + 16 + 16 + 8 + 64;

impl Envelope {
    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        let mut out = [0u8; ENCODED_LEN];
        out[..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.kind as u8;
        out[8..24].copy_from_slice(&self.host.0);
        out[24..40].copy_from_slice(&self.device.0);
        out[40..48].copy_from_slice(&self.len.to_le_bytes());
        out[48..].copy_from_slice(&self.raw);
        out
    }

    /// Decodes and validates `bytes` as a handle of `kind` made on this machine.
    pub fn decode(bytes: &[u8], kind: HandleKind) -> Result<Envelope> {
        let malformed = |what: &str| Error::MalformedHandle(what.to_string());
        if bytes.len() != ENCODED_LEN {
            return Err(malformed(&format!("{} bytes, expected {ENCODED_LEN}", bytes.len())));
        }
        if bytes[..4] != MAGIC {
            return Err(malformed("bad magic"));
        }
        if bytes[4] != VERSION {
            return Err(malformed(&format!("version {} (this build reads {VERSION})", bytes[4])));
        }
        if bytes[5] != kind as u8 {
            return Err(malformed(&format!("kind {} where {kind:?} was expected", bytes[5])));
        }
        let field = |range: std::ops::Range<usize>| -> [u8; 16] { bytes[range].try_into().unwrap_or_default() };
        let envelope = Envelope {
            kind,
            host: HostId(field(8..24)),
            device: Uuid(field(24..40)),
            len: u64::from_le_bytes(bytes[40..48].try_into().unwrap_or_default()),
            raw: bytes[48..].try_into().map_err(|_| malformed("short raw handle"))?,
        };
        let ours = HostId::current()?;
        if envelope.host != ours {
            return Err(Error::ForeignHost { ours, theirs: envelope.host });
        }
        Ok(envelope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Envelope {
        Envelope {
            kind: HandleKind::Memory,
            host: HostId::current().unwrap(),
            device: Uuid([7; 16]),
            len: 1 << 20,
            raw: [0xab; 64],
        }
    }

    #[test]
    fn round_trip() {
        let envelope = sample();
        assert_eq!(Envelope::decode(&envelope.encode(), HandleKind::Memory).unwrap(), envelope);
    }

    #[test]
    fn rejects_what_is_not_a_handle_of_this_machine() {
        let good = sample().encode();
        let decode = |bytes: &[u8]| Envelope::decode(bytes, HandleKind::Memory).unwrap_err();
        assert!(matches!(decode(&good[..10]), Error::MalformedHandle(_)));
        let mut bad = good;
        bad[0] = b'X';
        assert!(matches!(decode(&bad), Error::MalformedHandle(m) if m.contains("magic")));
        let mut bad = good;
        bad[4] = 9;
        assert!(matches!(decode(&bad), Error::MalformedHandle(m) if m.contains("version 9")));
        let err = Envelope::decode(&good, HandleKind::Event).unwrap_err();
        assert!(matches!(err, Error::MalformedHandle(m) if m.contains("Event")));
        let mut foreign = sample();
        foreign.host.0[0] ^= 0xff;
        let err = decode(&foreign.encode());
        assert!(matches!(err, Error::ForeignHost { .. }));
        assert!(err.to_string().contains("another machine"));
    }
}
