//! Views: the same storage seen with another shape, strides and offset, never a copy. Every
//! view is checked to lie inside its storage and to satisfy what receivers accept
//! ([`crate::tensor::layout::check_layout`]), so any view can cross a channel intact.
//!
//! Sizes (`u64`) and strides (`i64`) may come from any caller or, for a received tensor, from a
//! peer, so all layout arithmetic here is checked: a wrapped product can pass for a small one and
//! let a view read outside its storage. A bad argument is an [`Error::View`] naming the call.

use crate::error::{Error, Result, TensorProblem, ViewProblem};
use crate::tensor::Tensor;
use crate::tensor::dtype::DType;

impl Tensor {
    /// A view with dimensions `a` and `b` swapped (no copy).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], DType::I32, &[2, 3])?;
    /// let tt = t.transpose(0, 1)?;
    /// assert_eq!(tt.shape(), [3, 2]);
    /// assert_eq!(tt.to_vec::<i32>()?, [1, 4, 2, 5, 3, 6]);
    /// # Ok(()) }
    /// ```
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        let call = format!("transpose({a}, {b})");
        let ndim = self.shape().len();
        if let Some(dim) = [a, b].into_iter().find(|&d| d >= ndim) {
            return Err(invalid(self, &call, ViewProblem::NoSuchDim { dim, ndim }));
        }
        let (mut shape, mut strides) = (self.shape().to_vec(), self.strides().to_vec());
        shape.swap(a, b);
        strides.swap(a, b);
        checked_view(self, &call, shape, strides, self.offset())
    }

    /// A view with the dimensions reordered: dimension `i` of the result is dimension `dims[i]` of
    /// `self`, and `dims` names every dimension exactly once (no copy).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let nchw = Tensor::zeros(DType::F32, &[8, 3, 32, 32])?;
    /// let nhwc = nchw.permute(&[0, 2, 3, 1])?;
    /// assert_eq!(nhwc.shape(), [8, 32, 32, 3]);
    /// assert_eq!(nhwc.strides(), [3072, 32, 1, 1024]);
    /// # Ok(()) }
    /// ```
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let call = format!("permute({dims:?})");
        let ndim = self.shape().len();
        if dims.len() != ndim {
            return Err(invalid(self, &call, ViewProblem::NotAPermutation { ndim }));
        }
        distinct_dims(self, &call, dims)?;
        let shape = dims.iter().map(|&d| self.shape()[d]).collect();
        let strides = dims.iter().map(|&d| self.strides()[d]).collect();
        checked_view(self, &call, shape, strides, self.offset())
    }

    /// A view of `len` entries of dimension `dim` starting at `start` (no copy).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let batch = Tensor::from_slice(&(0..12).collect::<Vec<i64>>(), DType::I64, &[4, 3])?;
    /// let rows = batch.narrow(0, 1, 2)?; // rows 1 and 2
    /// assert_eq!(rows.to_vec::<i64>()?, [3, 4, 5, 6, 7, 8]);
    /// assert!(rows.is_contiguous(), "a range of rows stays contiguous");
    /// # Ok(()) }
    /// ```
    pub fn narrow(&self, dim: usize, start: u64, len: u64) -> Result<Tensor> {
        let call = format!("narrow({dim}, {start}, {len})");
        let size = dim_size(self, &call, dim)?;
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(invalid(self, &call, ViewProblem::OutOfRange { dim, size }));
        }
        let mut shape = self.shape().to_vec();
        shape[dim] = len;
        let offset = offset_after(self, &call, &shape, [(dim, start)])?;
        checked_view(self, &call, shape, self.strides().to_vec(), offset)
    }

    /// A view of entries `start, start + step, ...` before `end` of dimension `dim` (no copy), like
    /// Python's `t[start:end:step]`: an `end` past the size means up to the size, `step` is at
    /// least 1, and `start == end` gives an empty view. `start` past the (clamped) end is an error.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[0i32, 1, 2, 3, 4, 5, 6], DType::I32, &[7])?;
    /// assert_eq!(t.slice(0, 1, 6, 2)?.to_vec::<i32>()?, [1, 3, 5]); // t[1:6:2]
    /// assert_eq!(t.slice(0, 4, u64::MAX, 1)?.to_vec::<i32>()?, [4, 5, 6]); // t[4:]
    /// # Ok(()) }
    /// ```
    pub fn slice(&self, dim: usize, start: u64, end: u64, step: u64) -> Result<Tensor> {
        let call = format!("slice({dim}, {start}, {end}, {step})");
        let size = dim_size(self, &call, dim)?;
        if step == 0 {
            return Err(invalid(self, &call, ViewProblem::ZeroStep));
        }
        let end = end.min(size);
        if start > end {
            return Err(invalid(self, &call, ViewProblem::StartPastEnd { start, end, dim }));
        }
        let len = (end - start).div_ceil(step);
        let stride = self.strides()[dim];
        // An entry or none never steps: the stride is kept, so that a huge step (meaning "this
        // entry only") cannot overflow it.
        let stride = if len <= 1 {
            stride
        } else {
            i64::try_from(step)
                .ok()
                .and_then(|step| step.checked_mul(stride))
                .ok_or_else(|| invalid(self, &call, layout("the new stride overflows")))?
        };
        let (mut shape, mut strides) = (self.shape().to_vec(), self.strides().to_vec());
        shape[dim] = len;
        strides[dim] = stride;
        let offset = offset_after(self, &call, &shape, [(dim, start)])?;
        checked_view(self, &call, shape, strides, offset)
    }

    /// A view with the listed dimensions reversed (no copy): their strides are negated and element
    /// 0 becomes the last entry of each. Each dimension may be listed once; dimensions of size 0
    /// or 1 read the same either way and are left as they are.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1i32, 2, 3, 4], DType::I32, &[2, 2])?;
    /// let mirrored = t.flip(&[1])?;
    /// assert_eq!(mirrored.to_vec::<i32>()?, [2, 1, 4, 3]);
    /// assert_eq!(mirrored.strides(), [2, -1]);
    /// # Ok(()) }
    /// ```
    pub fn flip(&self, dims: &[usize]) -> Result<Tensor> {
        let call = format!("flip({dims:?})");
        distinct_dims(self, &call, dims)?;
        let mut strides = self.strides().to_vec();
        let mut moves = Vec::with_capacity(dims.len());
        for &d in dims {
            let size = self.shape()[d];
            if size > 1 {
                strides[d] =
                    strides[d].checked_neg().ok_or_else(|| invalid(self, &call, layout("a stride overflows")))?;
                moves.push((d, size - 1));
            }
        }
        let offset = offset_after(self, &call, self.shape(), moves)?;
        checked_view(self, &call, self.shape().to_vec(), strides, offset)
    }

    /// A broadcast view of shape `shape`, like PyTorch's `expand` (no copy): new leading
    /// dimensions may be added, and a dimension of size 1 may take any size; other sizes must stay
    /// as they are. Broadcast dimensions have stride 0, so all their entries are one element:
    /// a write through the view changes every entry that aliases it.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let bias = Tensor::from_slice(&[1.0f32, 2.0, 3.0], DType::F32, &[3])?;
    /// let per_row = bias.expand(&[2, 3])?;
    /// assert_eq!(per_row.strides(), [0, 1]);
    /// assert_eq!(per_row.to_vec::<f32>()?, [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    /// # Ok(()) }
    /// ```
    pub fn expand(&self, shape: &[u64]) -> Result<Tensor> {
        let call = format!("expand({shape:?})");
        let ndim = self.shape().len();
        let Some(added) = shape.len().checked_sub(ndim) else {
            return Err(invalid(self, &call, ViewProblem::DropsDims));
        };
        let mut strides = vec![0i64; shape.len()];
        for (d, (&size, &stride)) in self.shape().iter().zip(self.strides()).enumerate() {
            let target = shape[added + d];
            if target == size {
                strides[added + d] = stride;
            } else if size != 1 {
                return Err(invalid(self, &call, ViewProblem::NotBroadcastable { dim: d, size, target }));
            }
        }
        checked_view(self, &call, shape.to_vec(), strides, self.offset())
    }

    /// A view of entry `index` of dimension `dim`, with that dimension dropped (no copy), like
    /// PyTorch's `select`: selecting from a 1-d tensor gives a 0-d one (a single element).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], DType::I32, &[2, 3])?;
    /// let column = t.select(1, 2)?;
    /// assert_eq!(column.shape(), [2]);
    /// assert_eq!(column.to_vec::<i32>()?, [3, 6]);
    /// # Ok(()) }
    /// ```
    pub fn select(&self, dim: usize, index: u64) -> Result<Tensor> {
        let call = format!("select({dim}, {index})");
        let size = dim_size(self, &call, dim)?;
        if index >= size {
            return Err(invalid(self, &call, ViewProblem::OutOfRange { dim, size }));
        }
        let (mut shape, mut strides) = (self.shape().to_vec(), self.strides().to_vec());
        shape.remove(dim);
        strides.remove(dim);
        let offset = offset_after(self, &call, &shape, [(dim, index)])?;
        checked_view(self, &call, shape, strides, offset)
    }

    /// The same elements with another shape; only for contiguous tensors (no copy).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], DType::I32, &[2, 3])?;
    /// assert_eq!(t.reshape(&[3, 2])?.get::<i32>(&[2, 0])?, 5);
    /// assert!(t.transpose(0, 1)?.reshape(&[6]).is_err(), "strided: reshape a contiguous() copy");
    /// # Ok(()) }
    /// ```
    pub fn reshape(&self, shape: &[u64]) -> Result<Tensor> {
        let call = format!("reshape({shape:?})");
        if !self.is_contiguous() {
            return Err(invalid(self, &call, ViewProblem::NotContiguous));
        }
        // The product is checked: a wrapped one could pass for the right count (found by an
        // outside test: a reshape to [2^55 + 1, 512] of 512 bytes, then a read far outside).
        let count = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        if count != Some(self.numel()) {
            return Err(invalid(self, &call, ViewProblem::CountMismatch { numel: self.numel() }));
        }
        // Checked, unlike `contiguous_strides`: an empty shape such as [0, 2^40, 2^40] has the
        // right count, but row-major strides that overflow.
        let strides = row_major_strides(shape).ok_or_else(|| invalid(self, &call, layout("its strides overflow")))?;
        checked_view(self, &call, shape.to_vec(), strides, self.offset())
    }
}

impl Tensor {
    /// The same storage seen as `dtype` elements with `shape` and `strides` (in elements), element
    /// 0 at `byte_offset` bytes past this tensor's element 0 (no copy). For foreign code that
    /// places its own arrays inside channel memory (the Python package's `tq.shareable()`: torch
    /// tensors carved out of one [`Tensor::empty_cuda`] block) and sends them without a copy. The
    /// view is checked like every other: aligned, inside the storage (its allocation, which may be
    /// rounded up past the tensor's own bytes), and acceptable to receivers.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let block = Tensor::from_slice(&[0u8, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0], DType::U8, &[12])?;
    /// let ints = block.as_layout(DType::I32, &[2], &[1], 4)?; // bytes 4..12 as two i32
    /// assert_eq!(ints.to_vec::<i32>()?, [1, 2]);
    /// assert!(block.as_layout(DType::I32, &[1 << 20], &[1], 4).is_err(), "past the storage's end");
    /// assert!(block.as_layout(DType::I32, &[1], &[1], 2).is_err(), "unaligned");
    /// # Ok(()) }
    /// ```
    pub fn as_layout(&self, dtype: DType, shape: &[u64], strides: &[i64], byte_offset: usize) -> Result<Tensor> {
        let call = format!("as_layout({dtype:?}, {shape:?}, {strides:?}, {byte_offset})");
        let offset = self
            .offset()
            .checked_add(byte_offset)
            .ok_or_else(|| invalid(self, &call, layout("the offset overflows")))?;
        checked_view(&self.with_dtype(dtype), &call, shape.to_vec(), strides.to_vec(), offset)
    }
}

/// The size of dimension `dim`, or an error naming `call`.
fn dim_size(tensor: &Tensor, call: &str, dim: usize) -> Result<u64> {
    let ndim = tensor.shape().len();
    tensor.shape().get(dim).copied().ok_or_else(|| invalid(tensor, call, ViewProblem::NoSuchDim { dim, ndim }))
}

/// Checks that `dims` are dimensions of `tensor`, none named twice.
fn distinct_dims(tensor: &Tensor, call: &str, dims: &[usize]) -> Result<()> {
    let ndim = tensor.shape().len();
    let mut seen = vec![false; ndim];
    for &d in dims {
        match seen.get_mut(d) {
            None => return Err(invalid(tensor, call, ViewProblem::NoSuchDim { dim: d, ndim })),
            Some(true) => return Err(invalid(tensor, call, ViewProblem::DimTwice { dim: d })),
            Some(was) => *was = true,
        }
    }
    Ok(())
}

/// Bytes from the storage's start to the element `moves` reach from element 0, each move being
/// `index` entries along a dimension of `tensor`, for a view of shape `shape`.
fn offset_after(
    tensor: &Tensor,
    call: &str,
    shape: &[u64],
    moves: impl IntoIterator<Item = (usize, u64)>,
) -> Result<usize> {
    // An empty view reads nothing, so it keeps its parent's offset: moved, it could land
    // outside the storage (narrowing a flipped tensor to nothing at its end does) and be
    // refused for no reason.
    if shape.contains(&0) {
        return Ok(tensor.offset());
    }
    let size = i64::try_from(tensor.dtype().size()).ok();
    let start = i64::try_from(tensor.offset()).ok();
    let at = moves.into_iter().try_fold(start, |at, (dim, index)| {
        let bytes = i64::try_from(index).ok()?.checked_mul(tensor.strides()[dim])?.checked_mul(size?)?;
        Some(at?.checked_add(bytes))
    });
    at.flatten()
        .and_then(|at| usize::try_from(at).ok())
        .ok_or_else(|| invalid(tensor, call, layout("element 0 would lie outside the storage")))
}

/// `tensor`'s storage seen with another layout, once the layout is shown to be one every
/// receiver accepts and to lie inside the storage: a view that passes here can be sent.
fn checked_view(tensor: &Tensor, call: &str, shape: Vec<u64>, strides: Vec<i64>, offset: usize) -> Result<Tensor> {
    let at = tensor.storage.offset.checked_add(offset).and_then(|at| u64::try_from(at).ok());
    let at = at.ok_or_else(|| invalid(tensor, call, layout("the offset overflows")))?;
    crate::tensor::layout::check_layout(&shape, &strides, tensor.dtype(), at)
        .map_err(|reason| invalid(tensor, call, ViewProblem::Layout(reason)))?;
    // `Tensor::is_contiguous` works out row-major strides of the sizes unchecked, zeros counted
    // as ones, and `check_layout` bounds only the true product, which a zero makes 0: sizes such
    // as [0, 2^40, 2^40] are refused here so that no view can make that product wrap.
    if row_major_strides(&shape).is_none() {
        return Err(invalid(tensor, call, ViewProblem::Layout(format!("the sizes {shape:?} multiply past i64"))));
    }
    let view = tensor.with_layout(shape, strides, offset);
    view.touched_bytes().map_err(|error| match error {
        Error::Tensor(problem @ TensorProblem::OutsideStorage) => {
            invalid(tensor, call, ViewProblem::Layout(problem.to_string()))
        }
        other => other,
    })?;
    Ok(view)
}

/// An [`Error::View`] for `call` on `tensor`.
fn invalid(tensor: &Tensor, call: &str, problem: ViewProblem) -> Error {
    Error::View { call: call.to_string(), shape: tensor.shape().to_vec(), problem }
}

/// A [`ViewProblem::Layout`] of layout arithmetic that overflows.
fn layout(why: &str) -> ViewProblem {
    ViewProblem::Layout(why.to_string())
}

/// Row-major strides of `shape` (sizes of 0 counted as 1, as `contiguous_strides` does), or `None`
/// if they overflow.
fn row_major_strides(shape: &[u64]) -> Option<Vec<i64>> {
    let mut strides = vec![1i64; shape.len()];
    let mut stride = 1i64;
    for (d, &size) in shape.iter().enumerate().rev() {
        strides[d] = stride;
        stride = stride.checked_mul(i64::try_from(size.max(1)).ok()?)?;
    }
    Some(strides)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::dtype::DType;
    use crate::tensor::layout::MAX_VIEW_BYTES;

    /// Element `(i, j, k)` of [`base`]: its value names its index.
    fn v(i: u64, j: u64, k: u64) -> i32 {
        (100 * i + 10 * j + k) as i32
    }

    /// A contiguous `[2, 3, 4]` i32 tensor holding `v(i, j, k)`.
    fn base() -> Tensor {
        let data: Vec<i32> = (0..2).flat_map(|i| (0..3).flat_map(move |j| (0..4).map(move |k| v(i, j, k)))).collect();
        Tensor::from_slice(&data, DType::I32, &[2, 3, 4]).unwrap()
    }

    /// The elements in row-major order, through `to_bytes`.
    fn values(t: &Tensor) -> Vec<i32> {
        bytemuck::pod_collect_to_vec(&t.to_bytes().unwrap())
    }

    /// The message of an `Error::View`; anything else fails the test.
    fn invalid(result: Result<Tensor>) -> String {
        match result {
            Err(error @ Error::View { .. }) => error.to_string(),
            other => panic!("expected Error::View, got {other:?}"),
        }
    }

    fn layout(t: &Tensor) -> (&[u64], &[i64], usize) {
        (t.shape(), t.strides(), t.offset())
    }

    #[test]
    fn transpose_swaps_two_dimensions() {
        let t = base().transpose(0, 2).unwrap();
        assert_eq!(layout(&t), (&[4u64, 3, 2][..], &[1i64, 4, 12][..], 0));
        assert_eq!(t.get::<i32>(&[3, 1, 0]).unwrap(), v(0, 1, 3));
        let expected: Vec<i32> =
            (0..4).flat_map(|k| (0..3).flat_map(move |j| (0..2).map(move |i| v(i, j, k)))).collect();
        assert_eq!(values(&t), expected);
        assert_eq!(values(&t.transpose(2, 0).unwrap()), values(&base()), "transposing back is the original");
        assert!(invalid(base().transpose(0, 3)).contains("transpose(0, 3)"));
        assert!(base().transpose(usize::MAX, 0).is_err());
    }

    #[test]
    fn permute_reorders_every_dimension() {
        let t = base().permute(&[2, 0, 1]).unwrap();
        assert_eq!(layout(&t), (&[4u64, 2, 3][..], &[1i64, 12, 4][..], 0));
        assert_eq!(t.get::<i32>(&[3, 1, 2]).unwrap(), v(1, 2, 3));
        let expected: Vec<i32> =
            (0..4).flat_map(|k| (0..2).flat_map(move |i| (0..3).map(move |j| v(i, j, k)))).collect();
        assert_eq!(values(&t), expected);
        let back = t.permute(&[1, 2, 0]).unwrap();
        assert_eq!(layout(&back), layout(&base()), "the inverse permutation restores the layout");
        assert!(base().permute(&[0, 1, 2]).unwrap().is_contiguous());
        let scalar = base().select(0, 1).unwrap().select(0, 1).unwrap().select(0, 1).unwrap();
        assert_eq!(
            scalar.permute(&[]).unwrap().get::<i32>(&[]).unwrap(),
            v(1, 1, 1),
            "a 0-d tensor permutes to itself"
        );
    }

    #[test]
    fn permute_refuses_anything_but_a_permutation() {
        assert!(invalid(base().permute(&[0, 1])).contains("permute([0, 1])"));
        assert!(base().permute(&[0, 1, 2, 3]).is_err());
        assert!(invalid(base().permute(&[0, 1, 1])).contains("named twice"));
        assert!(base().permute(&[0, 1, 3]).is_err());
        assert!(base().permute(&[0, 1, usize::MAX]).is_err());
    }

    #[test]
    fn narrow_moves_the_offset_with_checked_arithmetic() {
        let t = base().narrow(2, 1, 2).unwrap();
        assert_eq!(layout(&t), (&[2u64, 3, 2][..], &[12i64, 4, 1][..], 4));
        let expected: Vec<i32> =
            (0..2).flat_map(|i| (0..3).flat_map(move |j| (1..3).map(move |k| v(i, j, k)))).collect();
        assert_eq!(values(&t), expected);
        assert_eq!(values(&base().narrow(0, 1, 1).unwrap()), values(&base())[12..], "rows stay contiguous");
        assert!(invalid(base().narrow(1, 2, 2)).contains("narrow(1, 2, 2)"));
        assert!(base().narrow(3, 0, 1).is_err());
        assert!(base().narrow(0, u64::MAX, 1).is_err(), "start + len overflows");
        assert!(base().narrow(0, 1, u64::MAX).is_err());
        // Regression: the empty view at the end of a flipped dimension was refused, its offset
        // moved before the storage's start.
        let flipped = base().flip(&[2]).unwrap();
        let empty = flipped.narrow(2, 4, 0).unwrap();
        assert_eq!((empty.shape(), empty.numel()), (&[2u64, 3, 0][..], 0));
        assert!(values(&empty).is_empty());
        assert_eq!(
            values(&flipped.narrow(2, 3, 1).unwrap()),
            [v(0, 0, 0), v(0, 1, 0), v(0, 2, 0), v(1, 0, 0), v(1, 1, 0), v(1, 2, 0)]
        );
    }

    #[test]
    fn slice_steps_and_clamps_like_python() {
        let t = base().slice(2, 1, 4, 2).unwrap();
        assert_eq!(layout(&t), (&[2u64, 3, 2][..], &[12i64, 4, 2][..], 4));
        let expected: Vec<i32> =
            (0..2).flat_map(|i| (0..3).flat_map(move |j| [1, 3].map(move |k| v(i, j, k)))).collect();
        assert_eq!(values(&t), expected);
        // An end past the size is the size; a step past it takes the first entry only.
        let t = base().slice(1, 1, u64::MAX, 1).unwrap();
        assert_eq!(layout(&t), (&[2u64, 2, 4][..], &[12i64, 4, 1][..], 16));
        let t = base().slice(2, 2, u64::MAX, u64::MAX).unwrap();
        assert_eq!(layout(&t), (&[2u64, 3, 1][..], &[12i64, 4, 1][..], 8), "a single entry keeps its stride");
        assert_eq!(values(&t), [v(0, 0, 2), v(0, 1, 2), v(0, 2, 2), v(1, 0, 2), v(1, 1, 2), v(1, 2, 2)]);
        let t = base().slice(0, 0, 2, 2).unwrap();
        assert_eq!(values(&t), values(&base())[..12]);
        // Empty slices, at the start, in the middle and at the end.
        for start in [0, 2, 3] {
            let empty = base().slice(1, start, start.min(3), 1).unwrap();
            assert_eq!((empty.shape(), empty.offset()), (&[2u64, 0, 4][..], 0), "start {start}");
            assert!(values(&empty).is_empty());
        }
    }

    #[test]
    fn slice_refuses_bad_arguments_without_overflow() {
        assert!(invalid(base().slice(0, 0, 2, 0)).contains("at least 1"));
        assert!(invalid(base().slice(3, 0, 1, 1)).contains("slice(3, 0, 1, 1)"));
        assert!(invalid(base().slice(1, 2, 1, 1)).contains("past the end"));
        assert!(base().slice(1, 4, u64::MAX, 1).is_err(), "the start is past the clamped end");
        assert!(base().slice(1, u64::MAX, u64::MAX, u64::MAX).is_err());
        assert!(base().slice(usize::MAX, 0, 0, 1).is_err());
    }

    #[test]
    fn flip_negates_strides_and_moves_to_the_last_element() {
        let t = base().flip(&[0, 2]).unwrap();
        assert_eq!(layout(&t), (&[2u64, 3, 4][..], &[-12i64, 4, -1][..], (12 + 3) * 4));
        assert_eq!(t.get::<i32>(&[0, 0, 0]).unwrap(), v(1, 0, 3));
        assert_eq!(t.get::<i32>(&[1, 2, 3]).unwrap(), v(0, 2, 0));
        let expected: Vec<i32> =
            [1, 0].into_iter().flat_map(|i| (0..3).flat_map(move |j| (0..4).rev().map(move |k| v(i, j, k)))).collect();
        assert_eq!(values(&t), expected);
        let back = t.flip(&[2, 0]).unwrap();
        assert_eq!(layout(&back), layout(&base()), "flipping twice restores the layout");
        assert_eq!(layout(&base().flip(&[]).unwrap()), layout(&base()));
        // Dimensions of one entry or none read the same either way.
        let row = base().narrow(1, 1, 1).unwrap();
        assert_eq!(layout(&row.flip(&[1]).unwrap()), layout(&row));
        let empty = base().narrow(2, 0, 0).unwrap();
        let flipped = empty.flip(&[0, 2]).unwrap();
        assert_eq!(layout(&flipped), (&[2u64, 3, 0][..], &[-12i64, 4, 1][..], 0), "an empty view keeps its offset");
    }

    #[test]
    fn flip_refuses_bad_dimensions() {
        assert!(invalid(base().flip(&[3])).contains("flip([3])"));
        assert!(invalid(base().flip(&[1, 1])).contains("named twice"));
        assert!(base().flip(&[usize::MAX]).is_err());
    }

    #[test]
    fn expand_broadcasts_size_one_and_new_dimensions_with_stride_zero() {
        let column = base().narrow(2, 1, 1).unwrap();
        let t = column.expand(&[5, 2, 3, 4]).unwrap();
        assert_eq!(layout(&t), (&[5u64, 2, 3, 4][..], &[0i64, 12, 4, 0][..], 4));
        assert_eq!(t.get::<i32>(&[4, 1, 2, 3]).unwrap(), v(1, 2, 1));
        let expected: Vec<i32> = (0..5)
            .flat_map(|_| (0..2).flat_map(|i| (0..3).flat_map(move |j| (0..4).map(move |_| v(i, j, 1)))))
            .collect();
        assert_eq!(values(&t), expected);
        assert_eq!(layout(&base().expand(&[2, 3, 4]).unwrap()), layout(&base()), "the same shape is the same view");
        // Entries of a broadcast dimension are one element: a write shows in all of them.
        let one = Tensor::from_slice(&[7i32], DType::I32, &[1]).unwrap();
        let wide = one.expand(&[3]).unwrap();
        wide.set(&[2], 9i32).unwrap();
        assert_eq!(values(&wide), [9, 9, 9]);
        let scalar = one.select(0, 0).unwrap();
        assert_eq!(layout(&scalar.expand(&[2, 2]).unwrap()), (&[2u64, 2][..], &[0i64, 0][..], 0));
        assert_eq!(one.expand(&[0]).unwrap().numel(), 0, "a size-1 dimension may become empty");
        // As large as a receiver accepts, and never read whole here.
        let big = one.expand(&[MAX_VIEW_BYTES / 4]).unwrap();
        assert_eq!(big.get::<i32>(&[MAX_VIEW_BYTES / 4 - 1]).unwrap(), 9);
    }

    #[test]
    fn expand_refuses_sizes_that_do_not_broadcast() {
        assert!(invalid(base().expand(&[2, 3, 5])).contains("only size-1 dimensions broadcast"));
        assert!(invalid(base().expand(&[3, 4])).contains("cannot drop dimensions"));
        let one = Tensor::from_slice(&[7i32], DType::I32, &[1]).unwrap();
        assert!(one.expand(&[MAX_VIEW_BYTES / 4 + 1]).is_err(), "more than a receiver accepts");
        assert!(one.expand(&[u64::MAX]).is_err());
        assert!(one.expand(&[u64::MAX, u64::MAX]).is_err(), "the product overflows");
        assert!(one.expand(&[0, 1 << 40, 1 << 40]).is_err(), "empty, but its row-major strides overflow");
        assert!(one.expand(&[1; crate::tensor::layout::MAX_DIMS + 1]).is_err(), "too many dimensions");
    }

    #[test]
    fn select_drops_a_dimension() {
        let t = base().select(1, 2).unwrap();
        assert_eq!(layout(&t), (&[2u64, 4][..], &[12i64, 1][..], 8 * 4));
        let expected: Vec<i32> = (0..2).flat_map(|i| (0..4).map(move |k| v(i, 2, k))).collect();
        assert_eq!(values(&t), expected);
        let scalar = t.select(0, 1).unwrap().select(0, 3).unwrap();
        assert_eq!(layout(&scalar), (&[][..], &[][..], (12 + 8 + 3) * 4));
        assert_eq!(values(&scalar), [v(1, 2, 3)]);
        assert!(invalid(base().select(1, 3)).contains("select(1, 3)"));
        assert!(base().select(3, 0).is_err());
        assert!(scalar.select(0, 0).is_err(), "a 0-d tensor has no dimension to select from");
        assert!(base().select(0, u64::MAX).is_err());
    }

    #[test]
    fn reshape_needs_a_contiguous_tensor_and_the_same_count() {
        let t = base().reshape(&[6, 4]).unwrap();
        assert_eq!(layout(&t), (&[6u64, 4][..], &[4i64, 1][..], 0));
        assert_eq!(values(&t), values(&base()));
        let rows = base().narrow(0, 1, 1).unwrap().reshape(&[12]).unwrap();
        assert_eq!(layout(&rows), (&[12u64][..], &[1i64][..], 48));
        assert!(invalid(base().reshape(&[5, 5])).contains("cannot be seen"));
        assert!(invalid(base().transpose(0, 1).unwrap().reshape(&[24])).contains("contiguous"));
        let empty = base().narrow(0, 0, 0).unwrap();
        assert!(empty.reshape(&[0, 1 << 40, 1 << 40]).is_err(), "the right count, but strides that overflow");
    }

    #[test]
    fn views_of_one_block_travel_together_in_one_message() {
        // What `tq.shareable()` sends: several tensors carved out of one block, in one message.
        let block = Tensor::from_slice(&(0..64u8).collect::<Vec<_>>(), DType::U8, &[64]).unwrap();
        let a = block.as_layout(DType::I32, &[2, 2], &[1, 2], 16).unwrap();
        let b = block.as_layout(DType::U8, &[8], &[1], 40).unwrap();
        let path = std::env::temp_dir().join(format!("tq-views-{}.sock", std::process::id()));
        let mut receiver = crate::channel::Receiver::<Vec<Tensor>>::bind(&path).unwrap();
        let sender = crate::channel::Sender::<Vec<Tensor>>::connect(&path).unwrap();
        sender.send(&vec![a.clone(), b.clone()]).unwrap();
        let got = receiver.recv().unwrap();
        assert_eq!(got[0].to_vec::<i32>().unwrap(), a.to_vec::<i32>().unwrap());
        assert_eq!(got[1].to_vec::<u8>().unwrap(), (40..48u8).collect::<Vec<_>>());
        drop(got);
        assert!(sender.wait_released(std::time::Duration::from_secs(10)));
    }

    #[test]
    fn as_layout_checks_offset_alignment_and_bounds() {
        let block = Tensor::zeros(DType::U8, &[64]).unwrap();
        let grid = block.as_layout(DType::F32, &[2, 2], &[1, 2], 8).unwrap();
        assert_eq!(
            (grid.dtype(), grid.shape(), grid.strides(), grid.offset()),
            (DType::F32, &[2, 2][..], &[1, 2][..], 8)
        );
        assert!(block.as_layout(DType::F32, &[4], &[1], usize::MAX).is_err(), "the offset overflows");
        assert!(block.as_layout(DType::F32, &[4], &[1], 6).is_err(), "unaligned");
        assert!(block.as_layout(DType::F32, &[4], &[-1], 0).is_err(), "reaches before the storage");
        assert!(block.narrow(0, 8, 8).unwrap().as_layout(DType::I64, &[1], &[1], 0).unwrap().offset() == 8);
    }

    #[test]
    fn views_compose() {
        // Flip of a permute of a slice: k in {0, 2}, then (k, i, j), then k reversed.
        let t = base().slice(2, 0, 4, 2).unwrap().permute(&[2, 0, 1]).unwrap().flip(&[0]).unwrap();
        assert_eq!(layout(&t), (&[2u64, 2, 3][..], &[-2i64, 12, 4][..], 8));
        let expected: Vec<i32> =
            [2, 0].into_iter().flat_map(|k| (0..2).flat_map(move |i| (0..3).map(move |j| v(i, j, k)))).collect();
        assert_eq!(values(&t), expected);
        // A slice with a step of a flipped dimension walks it backwards.
        let t = base().flip(&[2]).unwrap().slice(2, 1, 4, 2).unwrap();
        assert_eq!(layout(&t), (&[2u64, 3, 2][..], &[12i64, 4, -2][..], 8));
        assert_eq!(values(&t.select(0, 0).unwrap().select(0, 0).unwrap()), [v(0, 0, 2), v(0, 0, 0)]);
        // Select of a transpose, then an expand of the result.
        let t = base().transpose(1, 2).unwrap().select(0, 1).unwrap().narrow(1, 2, 1).unwrap();
        assert_eq!(values(&t), (0..4).map(|k| v(1, 2, k)).collect::<Vec<_>>());
        let wide = t.expand(&[2, 4, 3]).unwrap();
        assert_eq!(wide.strides(), [0, 1, 0]);
        let expected: Vec<i32> = (0..2).flat_map(|_| (0..4).flat_map(|k| [v(1, 2, k); 3])).collect();
        assert_eq!(values(&wide), expected);
        // Views of views never reach outside the storage: each was checked on its own.
        for view in [&wide, &t] {
            let (start, end) = view.touched_bytes().unwrap();
            assert!(start < end && end <= 24 * 4);
        }
    }
}
