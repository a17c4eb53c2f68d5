//! What `tests/tests/outside_round7.rs` and its second process `outside7-peer` share: the
//! messages of a mixed-size stream over TCP, made from `(sender, index)` alone so that the
//! receiver can check every byte of every message without being told what was sent.

use tensor_queue::{DType, Tensor};

/// `(sender, index, tensors)`: one message of a sender's stream.
pub type Msg = (u32, u64, Vec<Tensor>);

/// The shared secret of the round's TCP channels (`TQ_SECRET` in the peer programs).
pub const KEY: &str = "outside-round7-secret-0123456789abcdef-tcp";

/// The payload sizes of a stream, from 0 bytes up; the last (64 MiB) only where allowed.
pub const SIZES: [usize; 8] = [0, 1, 13, 4096, 65_539, 1 << 20, (4 << 20) + 7, 64 << 20];

/// The payload length of message `index` of `sender` in a stream whose largest size is
/// `SIZES[top]`: a pseudo-random pick, but the largest at every index `3 (mod 1000)`, so that
/// every stream of 4 or more has one.
pub fn len_of(sender: u32, index: u64, top: usize) -> usize {
    if index % 1000 == 3 {
        return SIZES[top];
    }
    let pick = mix(u64::from(sender) << 32 ^ index) % (top as u64 + 1);
    SIZES[pick as usize]
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `len` pseudo-random bytes that only `(sender, index)` makes.
pub fn bytes(sender: u32, index: u64, len: usize) -> Vec<u8> {
    let mut state = mix(u64::from(sender) << 40 ^ index ^ 0x5555) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The message `index` of `sender`: its payload (u8, `len_of` bytes), a few f32 numbers that
/// name it, and an empty i64 tensor of shape `[0, 3]`.
pub fn message(sender: u32, index: u64, top: usize) -> Msg {
    let len = len_of(sender, index, top);
    let payload = Tensor::from_bytes(&bytes(sender, index, len), DType::U8, &[len as u64]).expect("payload");
    let count = (index % 5) as usize;
    let names: Vec<f32> = (0..count).map(|k| sender as f32 * 1000.0 + index as f32 + k as f32 * 0.5).collect();
    let names = Tensor::from_slice(&names, DType::F32, &[count as u64]).expect("names");
    let empty = Tensor::from_slice::<i64>(&[], DType::I64, &[0, 3]).expect("empty");
    (sender, index, vec![payload, names, empty])
}

/// Checks every byte, dtype and shape of a received message against what its
/// `(sender, index)` says it must be; `Err` says what differs.
pub fn check(msg: &Msg, top: usize) -> Result<(), String> {
    let (sender, index, tensors) = msg;
    let want = message(*sender, *index, top);
    if tensors.len() != want.2.len() {
        return Err(format!("sender {sender} message {index}: {} tensors, not {}", tensors.len(), want.2.len()));
    }
    for (k, (got, want)) in tensors.iter().zip(&want.2).enumerate() {
        if got.dtype() != want.dtype() || got.shape() != want.shape() {
            return Err(format!(
                "sender {sender} message {index} tensor {k}: {:?} {:?}, not {:?} {:?}",
                got.dtype(),
                got.shape(),
                want.dtype(),
                want.shape()
            ));
        }
        let got = got.to_bytes().map_err(|e| format!("sender {sender} message {index} tensor {k}: {e}"))?;
        let want = want.to_bytes().expect("own tensor");
        if got != want {
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            return Err(format!(
                "sender {sender} message {index} tensor {k}: {} bytes differ from the sent ones (first at {first:?})",
                got.len()
            ));
        }
    }
    Ok(())
}
