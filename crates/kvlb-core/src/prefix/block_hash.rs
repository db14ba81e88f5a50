//! XXH3-64 of one 256-byte text block, the hash every text-mode block costs: exactly
//! `xxhash_rust::xxh3::xxh3_64` on 256 bytes (tested against it), unrolled for that length
//! and with AVX-512 or AVX2 where the CPU has it (the crate picks its SIMD at compile time, so
//! a baseline x86_64 build gets SSE2 and a generic stripe loop). Also the chain step
//! `xxh3_64_with_seed(digest as 8 LE bytes, parent)`, exactly the crate's 4..=8-byte path
//! written out for 8 bytes (a dozen integer operations instead of a call through the length
//! dispatch), and [`chain_blocks`], which hashes a run of whole blocks with the CPU check made
//! once per run so that both steps inline into one loop.
//!
//! For inputs over 240 bytes XXH3 accumulates 64-byte stripes against the default secret; 256
//! bytes are three stripes at secret offsets 0, 8, 16 plus the last 64 bytes at offset 121,
//! then the accumulators are merged and avalanched.
//!
//! Cost (`benches/prefix.rs` `hash_only_chat_32k_prose`, 2-core AMD EPYC build machine): about
//! 8 ns per block in a run with AVX-512 (the eight accumulators are one register), chain step
//! included; the chain step's dependency from parent to child (~18 cycles) is most of it.

use super::BLOCK_BYTES;

const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

const INITIAL_ACC: [u64; 8] = [
    PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1,
];

/// (input offset, secret offset) of the stripes a 256-byte input accumulates.
const STRIPES: [(usize, usize); 4] = [(0, 0), (64, 8), (128, 16), (192, 192 - 64 - 7)];

const _: () = assert!(BLOCK_BYTES == 256);

#[inline(always)]
fn read64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

/// `xxh3_64(block)` for a 256-byte block. One block alone takes the AVX2 version (measured
/// faster than AVX-512 for a lone block, whose latency is not hidden behind a next one); runs
/// of blocks go through [`chain_blocks`].
#[inline]
pub fn xxh3_64_block(block: &[u8; BLOCK_BYTES]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // Safety: the CPU supports AVX2, checked just above.
            return unsafe { xxh3_64_block_avx2(block) };
        }
    }
    xxh3_64_block_scalar(block)
}

/// `xxh3_64_with_seed(&digest.to_le_bytes(), parent)`: the chain step from a block's digest
/// and its parent's hash to the block's hash (XXH3's 4..=8-byte path for 8 bytes).
#[inline(always)]
pub fn chain_step(parent: u64, digest: u64) -> u64 {
    let seed = parent ^ ((parent as u32).swap_bytes() as u64) << 32;
    let flip = (read64(&SECRET, 8) ^ read64(&SECRET, 16)).wrapping_sub(seed);
    // input2 + (input1 << 32) with input1, input2 the low and high halves of the digest.
    let keyed = digest.rotate_left(32) ^ flip;
    let mut h = keyed ^ keyed.rotate_left(49) ^ keyed.rotate_left(24);
    h = h.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^= (h >> 35).wrapping_add(8);
    h = h.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^ h >> 28
}

/// Chains the whole 256-byte blocks of `bytes` (a partial tail is ignored) from `parent`,
/// pushing each block's hash onto `out` until `out` holds `max_len` hashes; returns the last
/// hash (`parent` when no block was hashed) and the bytes consumed.
#[inline]
pub fn chain_blocks(parent: u64, bytes: &[u8], out: &mut Vec<u64>, max_len: usize) -> (u64, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // Safety: the CPU supports AVX-512F, checked just above.
            return unsafe { chain_blocks_avx512(parent, bytes, out, max_len) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // Safety: the CPU supports AVX2, checked just above.
            return unsafe { chain_blocks_avx2(parent, bytes, out, max_len) };
        }
    }
    chain_blocks_with(parent, bytes, out, max_len, xxh3_64_block_scalar)
}

#[inline(always)]
fn chain_blocks_with(
    parent: u64,
    bytes: &[u8],
    out: &mut Vec<u64>,
    max_len: usize,
    digest: impl Fn(&[u8; BLOCK_BYTES]) -> u64,
) -> (u64, usize) {
    let mut hash = parent;
    let mut used = 0;
    for block in bytes.chunks_exact(BLOCK_BYTES) {
        if out.len() >= max_len {
            break;
        }
        let Ok(block) = <&[u8; BLOCK_BYTES]>::try_from(block) else {
            break;
        };
        hash = chain_step(hash, digest(block));
        out.push(hash);
        used += BLOCK_BYTES;
    }
    (hash, used)
}

/// [`chain_blocks`] with the AVX-512 block hash inlined.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chain_blocks_avx512(
    parent: u64,
    bytes: &[u8],
    out: &mut Vec<u64>,
    max_len: usize,
) -> (u64, usize) {
    // Safety: this function's caller checked AVX-512F, which the closure's call needs.
    chain_blocks_with(parent, bytes, out, max_len, |b| unsafe {
        xxh3_64_block_avx512(b)
    })
}

/// [`chain_blocks`] with the AVX2 block hash inlined.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chain_blocks_avx2(
    parent: u64,
    bytes: &[u8],
    out: &mut Vec<u64>,
    max_len: usize,
) -> (u64, usize) {
    // Safety: this function's caller checked AVX2, which the closure's call needs.
    chain_blocks_with(parent, bytes, out, max_len, |b| unsafe {
        xxh3_64_block_avx2(b)
    })
}

/// The portable version (and the reference the AVX2 one is tested against).
#[inline]
pub fn xxh3_64_block_scalar(block: &[u8; BLOCK_BYTES]) -> u64 {
    let mut acc = INITIAL_ACC;
    for (input, secret) in STRIPES {
        for i in 0..8 {
            let data = read64(block, input + 8 * i);
            let key = data ^ read64(&SECRET, secret + 8 * i);
            acc[i ^ 1] = acc[i ^ 1].wrapping_add(data);
            acc[i] = acc[i].wrapping_add((key & 0xffff_ffff).wrapping_mul(key >> 32));
        }
    }
    merge(&acc)
}

/// [`xxh3_64_block_scalar`] with the stripes in two 256-bit lanes.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn xxh3_64_block_avx2(block: &[u8; BLOCK_BYTES]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = INITIAL_ACC;
    // Safety: every load reads 32 bytes inside `block` (offsets up to 224) or `SECRET`
    // (offsets up to 121 + 32 + 32 = 185 <= 192); the stores write the 64-byte `acc`.
    unsafe {
        let mut lo = _mm256_loadu_si256(acc.as_ptr() as *const __m256i);
        let mut hi = _mm256_loadu_si256(acc.as_ptr().add(4) as *const __m256i);
        for (input, secret) in STRIPES {
            for (half, lane) in [&mut lo, &mut hi].into_iter().enumerate() {
                let data =
                    _mm256_loadu_si256(block.as_ptr().add(input + 32 * half) as *const __m256i);
                let key =
                    _mm256_loadu_si256(SECRET.as_ptr().add(secret + 32 * half) as *const __m256i);
                let data_key = _mm256_xor_si256(data, key);
                let product = _mm256_mul_epu32(data_key, _mm256_srli_epi64::<32>(data_key));
                // acc[i ^ 1] += data[i]: swap the 64-bit halves of each 128-bit lane.
                let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
                *lane = _mm256_add_epi64(*lane, _mm256_add_epi64(product, swapped));
            }
        }
        _mm256_storeu_si256(acc.as_mut_ptr() as *mut __m256i, lo);
        _mm256_storeu_si256(acc.as_mut_ptr().add(4) as *mut __m256i, hi);
    }
    merge(&acc)
}

/// [`xxh3_64_block_scalar`] with the eight accumulators in one 512-bit register.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn xxh3_64_block_avx512(block: &[u8; BLOCK_BYTES]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = INITIAL_ACC;
    // Safety: every load reads 64 bytes inside `block` (offsets up to 192) or `SECRET`
    // (offsets up to 121 + 64 = 185 <= 192); the store writes the 64-byte `acc`.
    unsafe {
        let mut lanes = _mm512_loadu_si512(acc.as_ptr() as *const __m512i);
        for (input, secret) in STRIPES {
            let data = _mm512_loadu_si512(block.as_ptr().add(input) as *const __m512i);
            let key = _mm512_loadu_si512(SECRET.as_ptr().add(secret) as *const __m512i);
            let data_key = _mm512_xor_si512(data, key);
            let product = _mm512_mul_epu32(data_key, _mm512_srli_epi64::<32>(data_key));
            // acc[i ^ 1] += data[i]: swap the 64-bit halves of each 128-bit lane.
            let swapped = _mm512_shuffle_epi32::<0b01_00_11_10>(data);
            lanes = _mm512_add_epi64(lanes, _mm512_add_epi64(product, swapped));
        }
        _mm512_storeu_si512(acc.as_mut_ptr() as *mut __m512i, lanes);
    }
    merge(&acc)
}

#[inline(always)]
fn merge(acc: &[u64; 8]) -> u64 {
    const MERGE_SECRET: usize = 11;
    let mut result = (BLOCK_BYTES as u64).wrapping_mul(PRIME64_1);
    for i in 0..4 {
        let a = acc[2 * i] ^ read64(&SECRET, MERGE_SECRET + 16 * i);
        let b = acc[2 * i + 1] ^ read64(&SECRET, MERGE_SECRET + 16 * i + 8);
        let product = a as u128 * b as u128;
        result = result.wrapping_add(product as u64 ^ (product >> 64) as u64);
    }
    result ^= result >> 37;
    result = result.wrapping_mul(0x1656_6791_9E37_79F9);
    result ^ result >> 32
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

    #[test]
    fn equals_xxh3_on_256_bytes() {
        let mut block = [0u8; BLOCK_BYTES];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..5000 {
            for b in block.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = if round % 3 == 0 {
                    x as u8 & 0x7f
                } else {
                    x as u8
                };
            }
            if round == 0 {
                block = [0u8; BLOCK_BYTES];
            }
            if round == 1 {
                block = [0xff; BLOCK_BYTES];
            }
            let expect = xxh3_64(&block);
            assert_eq!(xxh3_64_block_scalar(&block), expect, "round {round}");
            assert_eq!(xxh3_64_block(&block), expect, "round {round}");
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // Safety: the CPU supports AVX2.
                assert_eq!(unsafe { xxh3_64_block_avx2(&block) }, expect);
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                // Safety: the CPU supports AVX-512F.
                assert_eq!(unsafe { xxh3_64_block_avx512(&block) }, expect);
            }
        }
    }

    #[test]
    fn chain_step_equals_seeded_xxh3_on_8_bytes() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (parent, digest) = match round {
                0 => (0, 0),
                1 => (!0, !0),
                _ => (x, x.rotate_left(17).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            };
            let expect = xxh3_64_with_seed(&digest.to_le_bytes(), parent);
            assert_eq!(chain_step(parent, digest), expect, "round {round}");
        }
    }

    #[test]
    fn chain_blocks_equals_block_by_block_hashing() {
        let mut bytes = vec![0u8; BLOCK_BYTES * 9 + 100];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for b in bytes.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        for max_len in [0usize, 1, 4, 9, 20] {
            let mut expect = Vec::new();
            let mut hash = 77;
            for block in bytes
                .chunks_exact(BLOCK_BYTES)
                .take(max_len.saturating_sub(2))
            {
                hash = xxh3_64_with_seed(&xxh3_64(block).to_le_bytes(), hash);
                expect.push(hash);
            }
            let mut out = vec![1, 2];
            let (last, used) = chain_blocks(77, &bytes, &mut out, max_len);
            assert_eq!(&out[2.min(out.len())..], &expect[..], "max_len {max_len}");
            assert_eq!(last, hash);
            assert_eq!(used, expect.len() * BLOCK_BYTES);
        }
    }
}
