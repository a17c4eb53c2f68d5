//! Devices, by ordinal (process-local) and by UUID (the same in every process).

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use cuda_sys::{CUdevice, CUdevice_attribute, driver};

use crate::{Error, Result};

/// Initialises the driver once per process.
pub(crate) fn init() -> Result<()> {
    static INIT: OnceLock<Result<(), cuda_sys::Error>> = OnceLock::new();
    INIT.get_or_init(|| {
        // Before the driver's descriptors and threads (see the function).
        crate::fd_passing::reserve_table();
        // SAFETY: cuInit has no pointer arguments.
        unsafe { driver!(cuInit(0)) }
    })
    .clone()
    .map_err(Error::from)
}

/// A GPU's UUID: how a device is named between processes, whose ordinals may differ
/// (`CUDA_VISIBLE_DEVICES`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Uuid(pub [u8; 16]);

impl fmt::Display for Uuid {
    /// The form `nvidia-smi -L` prints: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU")?;
        for (i, byte) in self.0.iter().enumerate() {
            if matches!(i, 0 | 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Uuid {
    type Err = Error;

    /// Parses the `GPU-...` form (the prefix and dashes are optional).
    fn from_str(text: &str) -> Result<Self> {
        let bad = || Error::InvalidArgument(format!("{text:?} is not a GPU UUID"));
        let hex: Vec<u8> = text.strip_prefix("GPU-").unwrap_or(text).bytes().filter(|&b| b != b'-').collect();
        if hex.len() != 32 {
            return Err(bad());
        }
        let mut bytes = [0u8; 16];
        for (byte, pair) in bytes.iter_mut().zip(hex.chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| bad())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
        }
        Ok(Uuid(bytes))
    }
}

/// A CUDA device as this process sees it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device {
    raw: CUdevice,
    ordinal: i32,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.ordinal)
    }
}

impl Device {
    /// How many devices this process sees.
    pub fn count() -> Result<i32> {
        init()?;
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer.
        unsafe { driver!(cuDeviceGetCount(&mut count)) }?;
        Ok(count)
    }

    /// The device with this process-local ordinal.
    pub fn get(ordinal: i32) -> Result<Device> {
        let count = Device::count()?;
        if !(0..count).contains(&ordinal) {
            return Err(Error::NoSuchDevice { ordinal, count });
        }
        let mut raw = 0;
        // SAFETY: `raw` is a valid out-pointer and the ordinal is in range.
        unsafe { driver!(cuDeviceGet(&mut raw, ordinal)) }?;
        Ok(Device { raw, ordinal })
    }

    /// Every device this process sees, by ordinal.
    pub fn all() -> Result<Vec<Device>> {
        (0..Device::count()?).map(Device::get).collect()
    }

    /// The visible device with this UUID.
    pub fn by_uuid(uuid: &Uuid) -> Result<Device> {
        for device in Device::all()? {
            if device.uuid()? == *uuid {
                return Ok(device);
            }
        }
        Err(Error::UnknownDevice(*uuid))
    }

    /// The ordinal in this process.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUdevice {
        self.raw
    }

    /// The GPU's UUID.
    pub fn uuid(&self) -> Result<Uuid> {
        let mut uuid = cuda_sys::CUuuid::default();
        // SAFETY: `uuid` is a valid out-pointer for a 16-byte CUuuid.
        unsafe { driver!(cuDeviceGetUuid_v2(&mut uuid, self.raw)) }?;
        Ok(Uuid(uuid.bytes.map(|b| b as u8)))
    }

    /// The marketing name (`NVIDIA H200`).
    pub fn name(&self) -> Result<String> {
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds `name.len()` bytes, as the call is told.
        unsafe { driver!(cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, self.raw)) }?;
        let bytes: Vec<u8> = name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// A device attribute.
    pub fn attribute(&self, attribute: CUdevice_attribute) -> Result<i32> {
        let mut value = 0;
        // SAFETY: `value` is a valid out-pointer.
        unsafe { driver!(cuDeviceGetAttribute(&mut value, attribute, self.raw)) }?;
        Ok(value)
    }

    /// Total memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        let mut bytes = 0;
        // SAFETY: `bytes` is a valid out-pointer.
        unsafe { driver!(cuDeviceTotalMem_v2(&mut bytes, self.raw)) }?;
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_round_trips_through_text() {
        let uuid = Uuid([0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 1, 2, 3, 4, 5, 6, 7, 8]);
        let text = uuid.to_string();
        assert_eq!(text, "GPU-12345678-9abc-def0-0102-030405060708");
        assert_eq!(text.parse::<Uuid>().unwrap(), uuid);
        assert!("GPU-1234".parse::<Uuid>().is_err());
        assert!("GPU-zz345678-9abc-def0-0102-030405060708".parse::<Uuid>().is_err());
    }
}
