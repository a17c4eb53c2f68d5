//! A tensor's sizes and strides in one value, inline for up to [`INLINE`] dimensions: making a
//! tensor from a received row, or cloning one (as sending does for every tensor of a message),
//! then copies two fixed arrays, with no allocation and no call to copy a slice of unknown length.

/// Dimensions held inline; tensors with more keep theirs on the heap.
const INLINE: usize = 4;

/// Sizes and strides (in elements) of one tensor, as many of each.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Dims {
    /// Up to [`INLINE`] dimensions; the entries past `ndim` are zero.
    Inline { ndim: u8, shape: [u64; INLINE], strides: [i64; INLINE] },
    /// More dimensions.
    Heap { shape: Box<[u64]>, strides: Box<[i64]> },
}

impl Dims {
    /// Sizes `shape` and strides `strides` (as many: the callers' layouts are checked).
    pub fn new(shape: &[u64], strides: &[i64]) -> Dims {
        if shape.len() <= INLINE && strides.len() == shape.len() {
            Dims::Inline { ndim: shape.len() as u8, shape: padded(shape), strides: padded(strides) }
        } else {
            Dims::Heap { shape: shape.into(), strides: strides.into() }
        }
    }

    /// The sizes.
    pub fn shape(&self) -> &[u64] {
        match self {
            Dims::Inline { ndim, shape, .. } => &shape[..*ndim as usize],
            Dims::Heap { shape, .. } => shape,
        }
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[i64] {
        match self {
            Dims::Inline { ndim, strides, .. } => &strides[..*ndim as usize],
            Dims::Heap { strides, .. } => strides,
        }
    }
}

/// `values` (at most [`INLINE`]) then zeros: one load per entry, no copy of unknown length.
fn padded<T: Copy + Default>(values: &[T]) -> [T; INLINE] {
    std::array::from_fn(|i| values.get(i).copied().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_dims_give_back_what_they_were_made_of() {
        for ndim in 0..=7 {
            let shape: Vec<u64> = (1..=ndim as u64).collect();
            let strides: Vec<i64> = (0..ndim as i64).map(|d| -d).collect();
            let dims = Dims::new(&shape, &strides);
            assert_eq!(matches!(dims, Dims::Inline { .. }), ndim <= INLINE);
            let copy = dims.clone();
            assert_eq!((copy.shape(), copy.strides()), (&shape[..], &strides[..]));
        }
    }
}
