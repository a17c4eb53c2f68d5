//! The rules every tensor view obeys, at the sender and the receiver alike: how many dimensions,
//! how many bytes, and the alignment of element 0. The tensor's constructors and views check
//! them, and so does the frame decoder for every descriptor a peer sends (`wire`).

use crate::tensor::dtype::DType;

/// The most dimensions of a tensor.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, MAX_DIMS, Tensor};
/// assert_eq!(Tensor::zeros(DType::U8, &[1; MAX_DIMS])?.shape().len(), MAX_DIMS);
/// assert!(Tensor::zeros(DType::U8, &[1; MAX_DIMS + 1]).is_err());
/// # Ok(()) }
/// ```
pub const MAX_DIMS: usize = 32;
/// The most bytes a view's elements may add up to (256 TiB, more than any machine's memory): a
/// zero-stride view may have far more elements than its storage has bytes, but reading it whole
/// must stay possible to count, allocate and loop over.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, MAX_VIEW_BYTES, Tensor};
/// let one = Tensor::zeros(DType::F32, &[1])?;
/// let huge = one.expand(&[MAX_VIEW_BYTES / 4])?; // still a view of 4 bytes
/// assert_eq!(huge.nbytes() as u64, MAX_VIEW_BYTES);
/// assert!(one.expand(&[MAX_VIEW_BYTES / 4 + 1]).is_err());
/// # Ok(()) }
/// ```
pub const MAX_VIEW_BYTES: u64 = 1 << 48;

/// What every view must satisfy, at the sender and the receiver alike: at most [`MAX_DIMS`]
/// dimensions, elements adding up to at most [`MAX_VIEW_BYTES`], and element 0 at a multiple of
/// the element size from the chunk's (page-aligned) start, so typed reads are aligned.
///
/// ```
/// use tensor_queue::{DType, testing::check_layout};
/// assert!(check_layout(&[2, 3], &[3, 1], DType::F32, 4096).is_ok());
/// assert!(check_layout(&[2, 3], &[3, 1], DType::F32, 4098).is_err()); // element 0 unaligned
/// assert!(check_layout(&[1 << 62], &[0], DType::F32, 0).is_err()); // too many bytes, even at stride 0
/// ```
pub fn check_layout(shape: &[u64], strides: &[i64], dtype: DType, byte_offset: u64) -> Result<(), String> {
    if strides.len() != shape.len() {
        return Err(format!("{} dimensions and {} strides: one stride per dimension", shape.len(), strides.len()));
    }
    if shape.len() > MAX_DIMS {
        return Err(format!("{} dimensions, more than the {MAX_DIMS} a tensor may have", shape.len()));
    }
    let bytes = shape.iter().try_fold(dtype.size() as u64, |n, &d| n.checked_mul(d));
    if bytes.is_none_or(|b| b > MAX_VIEW_BYTES) {
        return Err(format!("shape {shape:?} of {dtype:?} spans more than {MAX_VIEW_BYTES} bytes"));
    }
    if !byte_offset.is_multiple_of(dtype.size() as u64) {
        return Err(format!("element 0 at byte {byte_offset} is not aligned to {dtype:?}'s {} bytes", dtype.size()));
    }
    Ok(())
}
