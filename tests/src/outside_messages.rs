//! The messages of `tests/tests/outside_messages.rs` and of its second process
//! `outside-msg-peer`: how each side makes them and checks them, using only tensor-queue's public
//! API. Contents are a function of a message id, so the checking side rebuilds what was meant
//! locally and compares dtype, shape and every byte (and, where the route keeps layouts, strides).

use anyhow::{Context as _, Result, bail, ensure};
use serde::{Deserialize, Serialize};
use tensor_queue::{DType, Stream, Tensor};

/// Small tensors per [`Many`] message.
pub const SMALL: usize = 1024;

/// A message with many tensors: [`SMALL`] small ones of every dtype, and views of one storage.
#[derive(Debug, Serialize, Deserialize)]
pub struct Many {
    /// Which message (the contents follow from it).
    pub id: u64,
    /// Small tensors, each its own storage.
    pub small: Vec<Tensor>,
    /// Views of one storage, zero-size tensors and tensors of the most dimensions.
    pub views: Vec<Tensor>,
}

/// A message a consumer holds: tensors, or none (`tensors` empty for every third id).
#[derive(Debug, Serialize, Deserialize)]
pub struct Held {
    /// Which message.
    pub id: u64,
    /// Its tensors.
    pub tensors: Vec<Tensor>,
}

/// A message of one of several senders: who sent it, its place in that sender's order, and a
/// tensor on every other one.
#[derive(Debug, Serialize, Deserialize)]
pub struct Tagged {
    /// The sending process.
    pub pid: u32,
    /// The sender within that process.
    pub sender: u32,
    /// Its place in that sender's sequence, from 0.
    pub seq: u64,
    /// A tensor whose bytes follow from (pid, sender, seq), on odd `seq`.
    pub tensor: Option<Tensor>,
}

/// What goes over TCP: a [`Many`] and tensors of odd byte sizes.
#[derive(Debug, Serialize, Deserialize)]
pub struct OverTcp {
    /// Many tensors and views.
    pub many: Many,
    /// 1 byte, 4095 bytes, 1 MiB + 3 bytes, and a transposed view of an odd-sized storage.
    pub odd: Vec<Tensor>,
}

/// Byte `j` of the tensor keyed `key` (Bool tensors hold 0 or 1).
pub fn byte(key: u64, j: usize, dtype: DType) -> u8 {
    let b = ((key.wrapping_mul(131) + j as u64 * 7 + key / 7) % 251) as u8;
    if dtype == DType::Bool { b & 1 } else { b }
}

/// A tensor of `dtype` and `shape` whose bytes are [`byte`]`(key, ..)`, on `stream`'s GPU or
/// on the host.
pub fn patterned(key: u64, dtype: DType, shape: &[u64], stream: Option<&Stream>) -> Result<Tensor> {
    let len = shape.iter().product::<u64>() as usize * dtype.size();
    let bytes: Vec<u8> = (0..len).map(|j| byte(key, j, dtype)).collect();
    Ok(match stream {
        Some(stream) => Tensor::from_bytes_cuda(&bytes, dtype, shape, stream)?,
        None => Tensor::from_bytes(&bytes, dtype, shape)?,
    })
}

/// Small tensor `i` of message `id`: dtypes in turn, 1 to 7 elements, 1 to 3 dimensions.
pub fn small(id: u64, i: usize, stream: Option<&Stream>) -> Result<Tensor> {
    let dtype = DType::ALL[i % DType::ALL.len()];
    let n = (i % 7 + 1) as u64;
    let shape: Vec<u64> = match i % 3 {
        0 => vec![n],
        1 => vec![1, n],
        _ => vec![n, 1, 1],
    };
    patterned(id * 10_000 + i as u64, dtype, &shape, stream)
}

/// Views of one `[64, 64]` i32 storage (rows, strided columns, two overlapping ranges, a
/// transpose, a permutation, a flip, a broadcast, a 0-d element, an empty view, a reinterpreting
/// layout), separate zero-size tensors, and tensors of [`tensor_queue::MAX_DIMS`]
/// dimensions with a view of one.
pub fn views(id: u64, stream: Option<&Stream>) -> Result<Vec<Tensor>> {
    let base = patterned(id, DType::I32, &[64, 64], stream)?;
    let max = tensor_queue::MAX_DIMS;
    let mut deep_shape = vec![1u64; max - 2];
    deep_shape.extend([2, 3]);
    let deep = patterned(id + 1, DType::I16, &deep_shape, stream)?;
    let empty_f32 = match stream {
        Some(stream) => Tensor::zeros_cuda(DType::F32, &[0], stream)?,
        None => Tensor::zeros(DType::F32, &[0])?,
    };
    let empty_3d = match stream {
        Some(stream) => Tensor::zeros_cuda(DType::U8, &[3, 0, 2], stream)?,
        None => Tensor::zeros(DType::U8, &[3, 0, 2])?,
    };
    Ok(vec![
        base.clone(),
        base.narrow(0, 3, 10)?,
        base.slice(1, 1, 64, 3)?,
        base.narrow(0, 0, 40)?,
        base.narrow(0, 20, 44)?,
        base.transpose(0, 1)?,
        base.reshape(&[4, 16, 64])?.permute(&[2, 0, 1])?,
        base.flip(&[0, 1])?,
        base.select(0, 7)?.select(0, 9)?,
        base.narrow(1, 5, 1)?.expand(&[64, 8])?,
        base.slice(0, 5, 5, 1)?,
        base.as_layout(DType::U8, &[16], &[1], 400)?,
        base.as_layout(DType::I16, &[8], &[2], 8)?,
        empty_f32,
        empty_3d,
        deep.clone(),
        deep.transpose(0, max - 1)?,
        deep.transpose(max - 2, max - 1)?,
    ])
}

/// 1,024 tensors of one `[64, 64]` i32 storage: 500 clones of it, 500 of its rows (some twice)
/// and 24 single elements.
pub fn shared_storage(id: u64) -> Result<Vec<Tensor>> {
    let base = patterned(id, DType::I32, &[64, 64], None)?;
    let mut tensors = vec![base.clone(); 500];
    for i in 0..500 {
        tensors.push(base.narrow(0, i % 64, 1)?);
    }
    for i in 0..24 {
        tensors.push(base.select(0, i)?.select(0, 63 - i)?);
    }
    Ok(tensors)
}

/// Checks tensors received as [`shared_storage`]`(id)`.
pub fn check_shared_storage(id: u64, got: &[Tensor]) -> Result<()> {
    let expected = shared_storage(id)?;
    ensure!(got.len() == expected.len(), "{} tensors of one storage, expected {}", got.len(), expected.len());
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        check_tensor(&format!("tensor {i} of one storage"), g, e, true)?;
    }
    Ok(())
}

/// How many tensors [`mixed_storages`] makes (issue 26's many-tensor message).
pub const MIXED: usize = 1024;

/// Message `id` of [`MIXED`] host tensors: 300 views of one `i32` storage (rows, single
/// elements, a transposed block), 300 views of another (`f64`, strided slices and columns) and
/// 424 tensors of their own storage (dtypes in turn, 1 to 3 dimensions), interleaved so that
/// neighbours in the message name different storages; then 128 of them replaced by runs of
/// like views broken by other rows (see the end).
pub fn mixed_storages(id: u64) -> Result<Vec<Tensor>> {
    let a = patterned(id * 3, DType::I32, &[64, 64], None)?;
    let b = patterned(id * 3 + 1, DType::F64, &[32, 96], None)?;
    let mut tensors = Vec::with_capacity(MIXED);
    for i in 0..MIXED as u64 {
        tensors.push(match i % 4 {
            0 => match i % 3 {
                0 => a.narrow(0, i % 64, 1)?,
                1 => a.select(0, i % 64)?.select(0, 63 - i % 64)?,
                _ => a.transpose(0, 1)?.narrow(0, i % 60, 4)?,
            },
            1 => match i % 3 {
                0 => b.slice(1, i % 5, 96, 3)?,
                1 => b.select(1, i % 96)?,
                _ => b.narrow(0, i % 30, 2)?.transpose(0, 1)?,
            },
            _ => small(id * 10_000 + i, i as usize, None)?,
        });
    }
    // 256 + 256 + 512 so far: trade 88 own-storage tensors for views, for 300 / 300 / 424.
    for k in 0..88u64 {
        let at = (2 + 4 * k) as usize; // an own-storage tensor's place
        tensors[at] = if k % 2 == 0 { a.narrow(1, k % 64, 1)? } else { b.narrow(1, k % 96, 1)? };
    }
    // The last 128 places: like views one after the other, which the table sends as runs (one
    // row for many), broken by rows that differ in step, layout, dtype or storage: 24 rows of
    // `a`, 8 of them again backwards, 24 single elements of a column of `b`, 16 empty views, 16
    // times one view, 16 transposed blocks, and 24 tensors of their own between them.
    let mut runs = Vec::with_capacity(128);
    for k in 0..24 {
        runs.push(a.select(0, k)?);
    }
    for k in 0..8 {
        runs.push(a.select(0, 40 - k)?);
    }
    for k in 0..24 {
        runs.push(if k % 6 == 5 {
            small(id * 10_000 + 5_000 + k, k as usize, None)?
        } else {
            b.select(1, 7)?.select(0, k)?
        });
    }
    for k in 0..16 {
        runs.push(a.narrow(0, k, 0)?);
    }
    for _ in 0..16 {
        runs.push(b.narrow(0, 3, 2)?);
    }
    for k in 0..16 {
        runs.push(a.narrow(0, 2 * k, 2)?.transpose(0, 1)?);
    }
    for k in 0..24 {
        runs.push(small(id * 10_000 + 6_000 + k, k as usize, None)?);
    }
    tensors.splice(MIXED - runs.len().., runs);
    Ok(tensors)
}

/// Checks tensors received as [`mixed_storages`]`(id)`: every dtype, shape, stride and byte.
pub fn check_mixed_storages(id: u64, got: &[Tensor]) -> Result<()> {
    let expected = mixed_storages(id)?;
    ensure!(got.len() == expected.len(), "{} tensors, expected {}", got.len(), expected.len());
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        check_tensor(&format!("message {id} tensor {i}"), g, e, true)?;
    }
    Ok(())
}

/// Message `id` of [`Many`], on `stream`'s GPU or on the host.
pub fn many(id: u64, stream: Option<&Stream>) -> Result<Many> {
    let small = (0..SMALL).map(|i| small(id, i, stream)).collect::<Result<_>>()?;
    Ok(Many { id, small, views: views(id, stream)? })
}

/// Tensors of odd byte sizes for message `id`.
pub fn odd(id: u64) -> Result<Vec<Tensor>> {
    let storage = patterned(id + 7, DType::U8, &[1021, 3], None)?;
    Ok(vec![
        patterned(id + 1, DType::U8, &[1], None)?,
        patterned(id + 2, DType::U8, &[4095], None)?,
        patterned(id + 3, DType::U8, &[(1 << 20) + 3], None)?,
        storage.transpose(0, 1)?,
        storage.slice(0, 1, 1021, 2)?,
    ])
}

/// Message `id` of [`Held`]: no tensor for every third id, else one to three of up to 5,000 bytes.
pub fn held(id: u64) -> Result<Held> {
    let count = if id.is_multiple_of(3) { 0 } else { id % 3 + (id % 2) };
    let tensors = (0..count)
        .map(|k| patterned(id * 4 + k, DType::U8, &[(id * 37 + k) % 5000 + 1], None))
        .collect::<Result<_>>()?;
    Ok(Held { id, tensors })
}

/// Message `seq` of sender `sender` of process `pid`.
pub fn tagged(pid: u32, sender: u32, seq: u64) -> Result<Tagged> {
    let tensor = (seq % 2 == 1).then(|| patterned(tag_key(pid, sender, seq), DType::I64, &[3, 5], None)).transpose()?;
    Ok(Tagged { pid, sender, seq, tensor })
}

fn tag_key(pid: u32, sender: u32, seq: u64) -> u64 {
    (u64::from(pid) << 24) ^ (u64::from(sender) << 16) ^ seq
}

/// Checks that `got` holds what `expected` (made locally) holds: dtype, shape, every element,
/// and the strides too where `strides`.
pub fn check_tensor(what: &str, got: &Tensor, expected: &Tensor, strides: bool) -> Result<()> {
    ensure!(got.dtype() == expected.dtype(), "{what}: dtype {:?}, expected {:?}", got.dtype(), expected.dtype());
    ensure!(got.shape() == expected.shape(), "{what}: shape {:?}, expected {:?}", got.shape(), expected.shape());
    if strides {
        ensure!(
            got.strides() == expected.strides(),
            "{what}: strides {:?}, expected {:?}",
            got.strides(),
            expected.strides()
        );
    }
    let (got_bytes, expected_bytes) = (got.to_bytes().context(what.to_string())?, expected.to_bytes()?);
    if got_bytes != expected_bytes {
        let at = got_bytes.iter().zip(&expected_bytes).position(|(a, b)| a != b);
        bail!(
            "{what}: {} bytes differ from the {} expected (first difference at {at:?})",
            got_bytes.len(),
            expected_bytes.len()
        );
    }
    Ok(())
}

/// Checks a received [`Many`] against the one its id makes here.
pub fn check_many(got: &Many, strides: bool) -> Result<()> {
    let expected = many(got.id, None)?;
    ensure!(got.small.len() == SMALL, "message {}: {} small tensors, expected {SMALL}", got.id, got.small.len());
    ensure!(got.views.len() == expected.views.len(), "message {}: {} views", got.id, got.views.len());
    for (i, (g, e)) in got.small.iter().zip(&expected.small).enumerate() {
        check_tensor(&format!("message {} small tensor {i}", got.id), g, e, strides)?;
    }
    for (i, (g, e)) in got.views.iter().zip(&expected.views).enumerate() {
        check_tensor(&format!("message {} view {i}", got.id), g, e, strides)?;
    }
    Ok(())
}

/// Checks a received [`Held`].
pub fn check_held(got: &Held) -> Result<()> {
    let expected = held(got.id)?;
    ensure!(got.tensors.len() == expected.tensors.len(), "message {}: {} tensors", got.id, got.tensors.len());
    for (k, (g, e)) in got.tensors.iter().zip(&expected.tensors).enumerate() {
        check_tensor(&format!("held message {} tensor {k}", got.id), g, e, true)?;
    }
    Ok(())
}

/// Checks a received [`Tagged`]'s tensor.
pub fn check_tagged(got: &Tagged) -> Result<()> {
    let expected = tagged(got.pid, got.sender, got.seq)?;
    match (&got.tensor, &expected.tensor) {
        (None, None) => Ok(()),
        (Some(g), Some(e)) => {
            check_tensor(&format!("pid {} sender {} seq {}", got.pid, got.sender, got.seq), g, e, true)
        }
        _ => bail!(
            "pid {} sender {} seq {}: a tensor where none was sent, or none where one was",
            got.pid,
            got.sender,
            got.seq
        ),
    }
}

/// Checks a received [`OverTcp`]: values and shapes (the TCP route need not keep strides).
pub fn check_over_tcp(got: &OverTcp) -> Result<()> {
    check_many(&got.many, false)?;
    let expected = odd(got.many.id)?;
    ensure!(got.odd.len() == expected.len(), "{} odd-sized tensors", got.odd.len());
    for (i, (g, e)) in got.odd.iter().zip(&expected).enumerate() {
        check_tensor(&format!("odd-sized tensor {i}"), g, e, false)?;
    }
    Ok(())
}

/// A small deterministic generator (xorshift64*), so that an order chosen at random can be
/// replayed from its seed.
pub struct Shuffle(u64);

impl Shuffle {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Shuffle {
        Shuffle(seed | 1)
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// `items` in a random order (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}
