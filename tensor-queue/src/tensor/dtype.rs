//! Element types.

use serde::{Deserialize, Serialize};

/// The element type of a tensor.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor};
/// let t = Tensor::zeros(DType::BF16, &[2, 3])?;
/// assert_eq!(t.dtype(), DType::BF16);
/// assert_eq!(t.nbytes(), 6 * DType::BF16.size());
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum DType {
    /// One byte, 0 or 1.
    Bool = 0,
    /// Unsigned 8-bit integer.
    U8 = 1,
    /// Signed 8-bit integer.
    I8 = 2,
    /// Signed 16-bit integer.
    I16 = 3,
    /// Signed 32-bit integer.
    I32 = 4,
    /// Signed 64-bit integer.
    I64 = 5,
    /// IEEE half precision (read as `u16` bits).
    F16 = 6,
    /// bfloat16 (read as `u16` bits).
    BF16 = 7,
    /// IEEE single precision.
    F32 = 8,
    /// IEEE double precision.
    F64 = 9,
}

impl DType {
    /// Every dtype, in code order.
    ///
    /// ```
    /// use tensor_queue::DType;
    /// let two_bytes: Vec<DType> = DType::ALL.into_iter().filter(|d| d.size() == 2).collect();
    /// assert_eq!(two_bytes, [DType::I16, DType::F16, DType::BF16]);
    /// ```
    pub const ALL: [DType; 10] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    ///
    /// ```
    /// use tensor_queue::DType;
    /// assert_eq!(DType::F16.size(), 2);
    /// assert_eq!(DType::Bool.size(), 1); // a whole byte, not a bit
    /// ```
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The dtype with this wire code.
    ///
    /// ```
    /// use tensor_queue::DType;
    /// assert_eq!(DType::from_code(DType::F32 as u8), Some(DType::F32));
    /// assert_eq!(DType::from_code(200), None); // unknown codes are refused, not guessed
    /// ```
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }
}

/// A Rust type that is the element type of a dtype; used for typed views of host tensors.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Element, Result, Tensor};
/// // Generic over the element type: the dtype is checked when the tensor is read.
/// fn first<T: Element>(t: &Tensor) -> Result<T> {
///     t.get(&vec![0; t.shape().len()])
/// }
/// let t = Tensor::from_slice(&[0x3c00u16, 0x4000], DType::F16, &[2])?; // 1.0 and 2.0, as f16 bits
/// assert_eq!(first::<u16>(&t)?, 0x3c00);
/// assert!(first::<f32>(&t).is_err(), "no conversions: f32 does not read f16");
/// # Ok(()) }
/// ```
pub trait Element: bytemuck::Pod {
    /// The dtypes whose elements this type reads (`u16` reads both half types as bits).
    ///
    /// ```
    /// use tensor_queue::{DType, Element};
    /// assert!(u16::matches(DType::F16) && u16::matches(DType::BF16));
    /// assert!(u8::matches(DType::Bool));
    /// assert!(!f32::matches(DType::F64));
    /// ```
    fn matches(dtype: DType) -> bool;
}

macro_rules! element {
    ($($t:ty => $($d:ident)|+;)*) => {$(
        impl Element for $t {
            fn matches(dtype: DType) -> bool {
                matches!(dtype, $(DType::$d)|+)
            }
        }
    )*};
}

element! {
    u8 => U8 | Bool;
    i8 => I8;
    i16 => I16;
    u16 => F16 | BF16;
    i32 => I32;
    i64 => I64;
    f32 => F32;
    f64 => F64;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for dtype in DType::ALL {
            assert_eq!(DType::from_code(dtype as u8), Some(dtype));
        }
        assert_eq!(DType::from_code(10), None);
        assert!(f32::matches(DType::F32) && !f32::matches(DType::I32));
    }
}
