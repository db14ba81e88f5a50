//! The map from a block hash to a block's slot that both tiers of the simulated KV cache keep
//! (`kv_cache` on the GPU, `host_tier` in host memory), with the hasher it needs.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Block hash -> slot index.
pub(crate) type BlockMap = HashMap<u64, u32, BuildHasherDefault<BlockHashHasher>>;

/// Block hashes are already uniformly distributed: the table uses them as they are.
#[derive(Default)]
pub(crate) struct BlockHashHasher(u64);

impl Hasher for BlockHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8)) ^ b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}
