//! Conversions between tensors and Rust data: the dtype implied by the element type, shapes in
//! `usize`, vectors in and out, a sound way to fill a new host tensor in place, and (behind
//! features) `half`'s `f16`/`bf16` and `ndarray` arrays.

use crate::error::{Error, Result, TensorProblem};
use crate::tensor::dtype::{DType, Element};
use crate::tensor::{Tensor, check_element, check_values};

/// An element type with exactly one dtype, so the dtype can be left out: `f32` is
/// [`DType::F32`], `i64` is [`DType::I64`]. (`u16` is not one: it reads both half types as bits;
/// with the `half` feature, `half::f16` and `half::bf16` are.)
///
/// ```
/// use tensor_queue::{DType, NativeElement};
/// assert_eq!(f32::DTYPE, DType::F32);
/// assert_eq!(u8::DTYPE, DType::U8);
/// ```
pub trait NativeElement: Element {
    /// The dtype of this element type.
    const DTYPE: DType;
}

macro_rules! native {
    ($($t:ty => $d:ident;)*) => {$(
        impl NativeElement for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

native! {
    u8 => U8;
    i8 => I8;
    i16 => I16;
    i32 => I32;
    i64 => I64;
    f32 => F32;
    f64 => F64;
}

#[cfg(feature = "half")]
impl Element for half::f16 {
    fn matches(dtype: DType) -> bool {
        dtype == DType::F16
    }
}

#[cfg(feature = "half")]
impl Element for half::bf16 {
    fn matches(dtype: DType) -> bool {
        dtype == DType::BF16
    }
}

#[cfg(feature = "half")]
native! {
    half::f16 => F16;
    half::bf16 => BF16;
}

/// A `usize` shape as the `u64` dimensions tensors use.
fn dims(shape: &[usize]) -> Vec<u64> {
    shape.iter().map(|&d| d as u64).collect()
}

impl Tensor {
    /// A host tensor holding `data` with `shape`, its dtype implied by `T`.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let t = Tensor::new(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// assert_eq!((t.dtype(), t.shape()), (DType::F32, &[2u64, 3][..]));
    /// assert!(Tensor::new(&[1u8, 2], &[3]).is_err(), "two elements do not make three");
    /// # Ok(()) }
    /// ```
    pub fn new<T: NativeElement>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_slice(data, T::DTYPE, &dims(shape))
    }

    /// A new host tensor of `shape` whose elements `fill` writes, in row-major order, through a
    /// `&mut` slice: the tensor is shared with nobody until `fill` has returned, so the borrow is
    /// sound (unlike writing a tensor others can see). The elements start at zero. Its dtype is
    /// implied by `T`; see [`Tensor::build_as`] to name it.
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::Tensor;
    /// let t = Tensor::build::<f32>(&[2, 3], |data| {
    ///     for (i, x) in data.iter_mut().enumerate() {
    ///         *x = i as f32 * 0.5;
    ///     }
    /// })?;
    /// assert_eq!(t.to_vec::<f32>()?, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
    /// # Ok(()) }
    /// ```
    pub fn build<T: NativeElement>(shape: &[usize], fill: impl FnOnce(&mut [T])) -> Result<Tensor> {
        Tensor::build_as(T::DTYPE, shape, fill)
    }

    /// [`Tensor::build`] with the dtype named, for element types that read several (`u16` for
    /// [`DType::F16`] or [`DType::BF16`] bits, `u8` for [`DType::Bool`]).
    ///
    /// ```
    /// # fn main() -> tensor_queue::Result<()> {
    /// use tensor_queue::{DType, Tensor};
    /// let ones = Tensor::build_as::<u16>(DType::BF16, &[4], |bits| bits.fill(0x3f80))?; // 1.0
    /// assert_eq!(ones.dtype(), DType::BF16);
    /// assert!(Tensor::build_as::<f32>(DType::F64, &[1], |_| ()).is_err());
    /// # Ok(()) }
    /// ```
    pub fn build_as<T: Element>(dtype: DType, shape: &[usize], fill: impl FnOnce(&mut [T])) -> Result<Tensor> {
        check_element::<T>(dtype)?;
        let tensor = Tensor::zeros(dtype, &dims(shape))?;
        // Filled in a buffer of our own, then copied in: a `&mut` into shared memory would need
        // `unsafe` (this crate has none), and the copy is one pass over memory `fill` just wrote.
        let mut elements = Vec::new();
        elements
            .try_reserve_exact(tensor.numel() as usize)
            .map_err(|_| TensorProblem::NoMemory { bytes: tensor.nbytes() })?;
        elements.resize(tensor.numel() as usize, T::zeroed());
        fill(&mut elements);
        check_values(dtype, bytemuck::cast_slice(&elements))?;
        let (memory, at) = tensor.host_storage()?;
        memory.write(at, bytemuck::cast_slice(&elements))?;
        Ok(tensor)
    }
}

/// A one-dimensional host tensor of the elements, the dtype implied by `T`.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor};
/// let t = Tensor::try_from(vec![1i64, 2, 3])?;
/// assert_eq!((t.dtype(), t.shape()), (DType::I64, &[3u64][..]));
/// let back: Vec<i64> = t.try_into()?;
/// assert_eq!(back, [1, 2, 3]);
/// # Ok(()) }
/// ```
impl<T: NativeElement> TryFrom<Vec<T>> for Tensor {
    type Error = Error;

    fn try_from(data: Vec<T>) -> Result<Tensor> {
        Tensor::try_from(data.as_slice())
    }
}

/// A one-dimensional host tensor of the elements, the dtype implied by `T`.
impl<T: NativeElement> TryFrom<&[T]> for Tensor {
    type Error = Error;

    fn try_from(data: &[T]) -> Result<Tensor> {
        Tensor::new(data, &[data.len()])
    }
}

/// The elements in row-major order (copied from the GPU for a GPU tensor); an error if `T` does
/// not read the tensor's dtype.
impl<T: Element> TryFrom<Tensor> for Vec<T> {
    type Error = Error;

    fn try_from(tensor: Tensor) -> Result<Vec<T>> {
        tensor.to_vec()
    }
}

/// The elements in row-major order, as for `TryFrom<Tensor>`.
impl<T: Element> TryFrom<&Tensor> for Vec<T> {
    type Error = Error;

    fn try_from(tensor: &Tensor) -> Result<Vec<T>> {
        tensor.to_vec()
    }
}

/// A host tensor with the array's shape and elements (copied, in logical row-major order
/// whatever the array's layout).
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use ndarray::{Array2, ArrayD};
/// use tensor_queue::Tensor;
/// let array = Array2::from_shape_fn((2, 3), |(i, j)| (i * 10 + j) as f32);
/// let t = Tensor::try_from(&array.t().into_dyn())?; // a transposed view: copied in its own order
/// assert_eq!(t.shape(), [3, 2]);
/// let back = ArrayD::<f32>::try_from(&t)?;
/// assert_eq!(back, array.t().into_dyn());
/// # Ok(()) }
/// ```
#[cfg(feature = "ndarray")]
impl<T: NativeElement, S: ndarray::Data<Elem = T>, D: ndarray::Dimension> TryFrom<&ndarray::ArrayBase<S, D>>
    for Tensor
{
    type Error = Error;

    fn try_from(array: &ndarray::ArrayBase<S, D>) -> Result<Tensor> {
        let mut elements = array.iter();
        Tensor::build::<T>(array.shape(), |data| {
            for (slot, value) in data.iter_mut().zip(&mut elements) {
                *slot = *value;
            }
        })
    }
}

/// The tensor's elements as an array of its shape (copied; from the GPU for a GPU tensor).
#[cfg(feature = "ndarray")]
impl<T: Element> TryFrom<&Tensor> for ndarray::ArrayD<T> {
    type Error = Error;

    fn try_from(tensor: &Tensor) -> Result<ndarray::ArrayD<T>> {
        // Sizes past `usize` or `isize` (ndarray's bound) cannot have been read by `to_vec`.
        let too_large = || Error::from(TensorProblem::ShapeTooLarge { shape: tensor.shape().to_vec() });
        let shape = tensor
            .shape()
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| too_large()))
            .collect::<Result<Vec<usize>>>()?;
        ndarray::ArrayD::from_shape_vec(shape, tensor.to_vec()?).map_err(|_| too_large())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_element_type_is_an_error_both_ways() {
        let t = Tensor::new(&[1.0f64, 2.0], &[2]).unwrap();
        assert!(matches!(
            Vec::<f32>::try_from(&t),
            Err(Error::Tensor(TensorProblem::DTypeMismatch { ref dtype, element: "f32" })) if dtype == "F64"
        ));
        assert_eq!(Vec::<f64>::try_from(t).unwrap(), [1.0, 2.0]);
    }

    #[test]
    fn build_starts_from_zero_and_sees_every_element() {
        let t = Tensor::build::<i32>(&[3, 4], |data| {
            assert_eq!(data.len(), 12);
            assert!(data.iter().all(|&x| x == 0));
            data[11] = 7;
        })
        .unwrap();
        assert_eq!(t.get::<i32>(&[2, 3]).unwrap(), 7);
        let empty = Tensor::build::<f32>(&[0, 5], |data| assert!(data.is_empty())).unwrap();
        assert_eq!(empty.numel(), 0);
    }

    #[cfg(feature = "half")]
    #[test]
    fn half_types_imply_their_dtypes() {
        let t = Tensor::try_from(vec![half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)]).unwrap();
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(t.to_vec::<u16>().unwrap(), [0x3fc0, 0xc000], "bf16 bits");
        let back: Vec<half::bf16> = t.try_into().unwrap();
        assert_eq!(back[0].to_f32(), 1.5);
        let f16 = Tensor::new(&[half::f16::from_f32(1.0)], &[1]).unwrap();
        assert_eq!(f16.dtype(), DType::F16);
        assert!(Vec::<half::f16>::try_from(&Tensor::try_from(vec![half::bf16::ZERO]).unwrap()).is_err());
    }
}
