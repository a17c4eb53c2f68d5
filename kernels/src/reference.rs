//! CPU versions of the pattern and the checksum, bit for bit the same as the kernels': what GPU
//! tests compare against, and what host-tensor tests use where there is no GPU.

/// The mixer behind both the pattern and the checksum.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Writes the pattern for `seed` into `bytes` (byte `i` is byte `i % 8` of `splitmix64(seed + i / 8)`).
pub fn fill(bytes: &mut [u8], seed: u64) {
    for (word, chunk) in bytes.chunks_mut(8).enumerate() {
        let value = splitmix64(seed.wrapping_add(word as u64)).to_le_bytes();
        chunk.copy_from_slice(&value[..chunk.len()]);
    }
}

/// The pattern for `seed`, `len` bytes long.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0; len];
    fill(&mut bytes, seed);
    bytes
}

/// The position-sensitive checksum of `bytes`.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().enumerate().fold(0u64, |sum, (i, &b)| sum.wrapping_add(splitmix64(((i as u64) << 8) | b as u64)))
}

/// The sum of `bytes` read as little-endian 64-bit words (a trailing partial word is ignored),
/// as [`crate::Kernels::read`] adds it.
pub fn word_sum(bytes: &[u8]) -> u64 {
    bytes.chunks_exact(8).fold(0u64, |sum, w| sum.wrapping_add(u64::from_le_bytes(w.try_into().unwrap_or_default())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_sees_one_changed_or_moved_byte() {
        let bytes = pattern(1000, 7);
        let sum = checksum(&bytes);
        let mut changed = bytes.clone();
        changed[500] ^= 1;
        assert_ne!(checksum(&changed), sum);
        let mut swapped = bytes.clone();
        swapped.swap(1, 2);
        if bytes[1] != bytes[2] {
            assert_ne!(checksum(&swapped), sum);
        }
        assert_ne!(checksum(&pattern(1000, 8)), sum, "the seed matters");
        assert_eq!(pattern(13, 7)[..], bytes[..13], "a shorter pattern is a prefix");
    }
}
