//! XXH3-64 of one 256-byte text block, the hash every text-mode block costs: exactly
//! `xxhash_rust::xxh3::xxh3_64` on 256 bytes (tested against it), unrolled for that length
//! and with AVX2 where the CPU has it (the crate picks its SIMD at compile time, so a
//! baseline x86_64 build gets SSE2 and a generic stripe loop).
//!
//! For inputs over 240 bytes XXH3 accumulates 64-byte stripes against the default secret; 256
//! bytes are three stripes at secret offsets 0, 8, 16 plus the last 64 bytes at offset 121,
//! then the accumulators are merged and avalanched.

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

/// `xxh3_64(block)` for a 256-byte block.
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
    use xxhash_rust::xxh3::xxh3_64;

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
        }
    }
}
