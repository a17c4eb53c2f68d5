//! The memory a strided view touches: shared by the pack kernels and the frame validator.

/// The byte range, relative to element 0, that a view with these sizes and strides (in elements)
/// of `elem_size`-byte elements touches: `(low, high)` with `low <= 0 < high`, or `(0, 0)` for an
/// empty view. `None` if the arithmetic overflows.
pub fn strided_byte_span(shape: &[u64], strides: &[i64], elem_size: usize) -> Option<(i64, i64)> {
    if shape.contains(&0) {
        return Some((0, 0));
    }
    let (mut low, mut high) = (0i64, 0i64);
    for (&size, &stride) in shape.iter().zip(strides) {
        let reach = i64::try_from(size - 1).ok()?.checked_mul(stride)?;
        if reach < 0 {
            low = low.checked_add(reach)?;
        } else {
            high = high.checked_add(reach)?;
        }
    }
    let size = i64::try_from(elem_size).ok()?;
    Some((low.checked_mul(size)?, high.checked_add(1)?.checked_mul(size)?))
}

#[cfg(test)]
mod tests {
    use super::strided_byte_span;

    #[test]
    fn spans() {
        assert_eq!(strided_byte_span(&[3, 2], &[1, 3], 4), Some((0, 24)));
        assert_eq!(strided_byte_span(&[4], &[-1], 2), Some((-6, 2)));
        assert_eq!(strided_byte_span(&[4, 0], &[1, 1], 2), Some((0, 0)));
        assert_eq!(strided_byte_span(&[], &[], 8), Some((0, 8)), "a scalar is one element");
        assert_eq!(strided_byte_span(&[u64::MAX], &[2], 1), None);
        assert_eq!(strided_byte_span(&[5], &[0], 4), Some((0, 4)), "broadcast views touch one element");
    }
}
