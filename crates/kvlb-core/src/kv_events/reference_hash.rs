//! The block hashes engines publish, recomputed, for fleets that pin a reproducible scheme
//! (replica-interfaces.md section 1): vLLM's `--prefix-caching-hash-algo sha256_cbor` and
//! SGLang's chained SHA-256 over page tokens. The balancer's own prefix scheme does not depend on
//! these; they let a simulated replica publish the ids a real engine would, and let tests check
//! that a replica's ids line up with its tokens.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use sha2::{Digest, Sha256};

/// vLLM's default seed for the root hash when PYTHONHASHSEED is not set.
pub const VLLM_DEFAULT_SEED: &str = "vllm-none-hash";

/// CBOR head: major type in the top 3 bits, argument in the shortest form.
fn cbor_head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    match n {
        0..=23 => out.push(m | n as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, n as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
}

/// NONE_HASH: SHA-256 of the CBOR text string `seed`; the parent of a prompt's first block.
pub fn vllm_none_hash(seed: &str) -> [u8; 32] {
    let mut cbor = Vec::with_capacity(seed.len() + 9);
    cbor_head(&mut cbor, 3, seed.len() as u64);
    cbor.extend_from_slice(seed.as_bytes());
    Sha256::digest(&cbor).into()
}

/// One block's digest: SHA-256 of the CBOR array `[parent digest (bytes), [tokens...], null]`.
pub fn vllm_block_digest(parent: &[u8; 32], tokens: &[u32]) -> [u8; 32] {
    let mut cbor = Vec::with_capacity(40 + tokens.len() * 5);
    cbor_head(&mut cbor, 4, 3);
    cbor_head(&mut cbor, 2, 32);
    cbor.extend_from_slice(parent);
    cbor_head(&mut cbor, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_head(&mut cbor, 0, t as u64);
    }
    cbor.push(0xf6); // null: no extra keys (no LoRA, multimodal input or cache salt)
    Sha256::digest(&cbor).into()
}

/// The id vLLM publishes for a digest: its last 8 bytes, big-endian.
pub fn vllm_published_id(digest: &[u8; 32]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(b)
}

/// The published ids of every full block of `tokens` from the start of a prompt.
pub fn vllm_block_ids(seed: &str, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = vllm_none_hash(seed);
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            parent = vllm_block_digest(&parent, block);
            vllm_published_id(&parent)
        })
        .collect()
}

/// One SGLang page digest: SHA-256 of the previous page's digest (nothing for the first page)
/// followed by the page's tokens as u32 little-endian.
pub fn sglang_page_digest(prev: Option<&[u8; 32]>, tokens: &[u32]) -> [u8; 32] {
    let mut h = Sha256::new();
    if let Some(prev) = prev {
        h.update(prev);
    }
    for &t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The id SGLang publishes for a digest: its first 8 bytes as a signed big-endian int.
pub fn sglang_published_id(digest: &[u8; 32]) -> i64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(b)
}

/// The published ids of every full page of `tokens` from the start of a prompt.
pub fn sglang_page_ids(tokens: &[u32], page_size: usize) -> Vec<i64> {
    let mut prev: Option<[u8; 32]> = None;
    tokens
        .chunks_exact(page_size.max(1))
        .map(|page| {
            let d = sglang_page_digest(prev.as_ref(), page);
            prev = Some(d);
            sglang_published_id(&d)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> Vec<u32> {
        (1..=32).collect()
    }

    #[test]
    fn vllm_sha256_cbor_vectors() {
        assert_eq!(
            vllm_block_ids(VLLM_DEFAULT_SEED, &tokens(), 16),
            vec![8866452693264111234, 807986237951177663]
        );
        // A partial block has no id.
        assert_eq!(
            vllm_block_ids(VLLM_DEFAULT_SEED, &tokens()[..20], 16).len(),
            1
        );
    }

    #[test]
    fn sglang_vectors() {
        assert_eq!(
            sglang_page_ids(&tokens(), 16),
            vec![8635429971592222890, 1256577331724852459]
        );
    }

    #[test]
    fn cbor_heads_are_shortest() {
        let mut v = Vec::new();
        for n in [0u64, 23, 24, 255, 256, 65535, 65536, 1 << 32] {
            cbor_head(&mut v, 0, n);
        }
        assert_eq!(
            v,
            [
                &[0x00][..],
                &[0x17],
                &[0x18, 24],
                &[0x18, 255],
                &[0x19, 1, 0],
                &[0x19, 0xff, 0xff],
                &[0x1a, 0, 1, 0, 0],
                &[0x1b, 0, 0, 0, 1, 0, 0, 0, 0],
            ]
            .concat()
        );
    }
}
