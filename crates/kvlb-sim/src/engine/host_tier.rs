//! The host-memory KV tier of the simulated engine: copies of KV blocks kept in CPU memory
//! after they were computed on the GPU, so that a later request whose prefix the GPU has
//! evicted loads it back over PCIe instead of recomputing it. This is what vLLM's CPU
//! offloading (`--kv-offloading-size`, the OffloadingConnector), LMCache's CPU backend and
//! SGLang's hierarchical cache (HiCache) add to an engine.
//!
//! The tier is a set of block hashes bounded by `capacity_blocks`, least recently used evicted
//! first. It holds hashes only: the simulated engine never needs the KV bytes, and the KV
//! events the cache publishes for it (BlockStored / BlockRemoved with medium CPU) are built
//! by `KvCache`, which knows the tokens at the time a block is copied out.
//!
//! Recency: a block is refreshed when it is written (again) and whenever a request's prefix
//! uses it, from either tier.

#![forbid(unsafe_code)]

use super::block_map::BlockMap;
use crate::lru::LruList;

type HostTable = BlockMap;

pub(crate) struct HostTier {
    capacity_blocks: usize,
    /// hash -> its entry in `lru`.
    slot: HostTable,
    lru: LruList<u64>,
}

impl HostTier {
    /// A tier of `capacity_blocks` blocks; 0 is no tier at all (every method is then a no-op
    /// that finds nothing).
    pub(crate) fn new(capacity_blocks: usize) -> HostTier {
        HostTier {
            capacity_blocks,
            slot: HostTable::default(),
            lru: LruList::new(),
        }
    }

    pub(crate) fn is_enabled(&self) -> bool {
        self.capacity_blocks > 0
    }

    pub(crate) fn len(&self) -> usize {
        self.lru.len()
    }

    pub(crate) fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.slot.contains_key(&hash)
    }

    /// Make `hash` the most recently used if the tier holds it; returns whether it does.
    pub(crate) fn touch(&mut self, hash: u64) -> bool {
        match self.slot.get(&hash) {
            Some(&i) => {
                self.lru.touch(i);
                true
            }
            None => false,
        }
    }

    /// Copy `hash` in (or refresh it); returns whether it is new to the tier. The tier may
    /// now be over capacity: `evict_over_capacity` brings it back.
    pub(crate) fn insert(&mut self, hash: u64) -> bool {
        if !self.is_enabled() || self.touch(hash) {
            return false;
        }
        let i = self.lru.push_newest(hash);
        self.slot.insert(hash, i);
        true
    }

    /// Drop least recently used blocks until the tier fits its capacity, appending their
    /// hashes to `evicted`.
    pub(crate) fn evict_over_capacity(&mut self, evicted: &mut Vec<u64>) {
        while self.lru.len() > self.capacity_blocks {
            let Some(oldest) = self.lru.oldest() else {
                break;
            };
            let hash = self.lru.remove(oldest);
            self.slot.remove(&hash);
            evicted.push(hash);
        }
    }

    /// Forget every block.
    pub(crate) fn clear(&mut self) {
        self.slot.clear();
        self.lru.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_lru_with_refresh() {
        let mut host = HostTier::new(2);
        assert!(host.insert(1));
        assert!(host.insert(2));
        assert!(!host.insert(1), "already held: refreshed, not new");
        assert!(host.insert(3));
        let mut evicted = vec![];
        host.evict_over_capacity(&mut evicted);
        assert_eq!(evicted, vec![2], "1 was refreshed after 2");
        assert!(host.contains(1) && host.contains(3) && !host.contains(2));
        assert!(host.touch(1));
        assert!(!host.touch(2));
        host.insert(4);
        host.evict_over_capacity(&mut evicted);
        assert_eq!(evicted, vec![2, 3]);
        assert_eq!(host.len(), 2);
        host.clear();
        assert_eq!(host.len(), 0);
        assert!(!host.contains(1));
    }

    #[test]
    fn zero_capacity_holds_nothing() {
        let mut host = HostTier::new(0);
        assert!(!host.is_enabled());
        assert!(!host.insert(1));
        assert!(!host.contains(1));
        let mut evicted = vec![];
        host.evict_over_capacity(&mut evicted);
        assert!(evicted.is_empty());
    }
}
