//! What the simulator believes each replica holds, from the prompts it routed there: per
//! replica, the trace block ids it was sent, least recently used evicted once the replica's KV
//! capacity (in trace blocks) is full. The same belief a data plane builds from its own routing
//! decisions, kept independent of any policy so that every policy is measured alike.
//!
//! It answers two questions the engines cannot be asked without changing them:
//! * the **estimated uncached prompt tokens** of a request on the replica chosen for it (what
//!   the data plane counts as queued prefill until the first token), and
//! * **duplicate KV**: how many engine blocks are held by more than one replica at once. A
//!   trace block of `t` tokens stands for `t / engine_block_size` engine blocks.
//!
//! Touching a prompt refreshes its blocks last to first, so its prefix is the most recent part
//! and is evicted last (as the engine frees a request's tail before its head).

#![forbid(unsafe_code)]

use crate::lru::LruList;
use std::collections::HashMap;

/// One replica's blocks in LRU order.
#[derive(Default)]
struct ReplicaBlocks {
    slot: HashMap<u64, u32>,
    lru: LruList<u64>,
}

impl ReplicaBlocks {
    /// Make `id` the most recent; returns whether it was new.
    fn touch(&mut self, id: u64) -> bool {
        if let Some(&i) = self.slot.get(&id) {
            self.lru.touch(i);
            return false;
        }
        let i = self.lru.push_newest(id);
        self.slot.insert(id, i);
        true
    }

    /// Drop the least recent block.
    fn evict(&mut self) -> Option<u64> {
        let id = self.lru.remove(self.lru.oldest()?);
        self.slot.remove(&id);
        Some(id)
    }
}

/// Every replica's routed blocks and the fleet-wide duplicate count.
pub struct RoutedBlocks {
    replicas: Vec<ReplicaBlocks>,
    capacity_blocks: usize,
    block_tokens: u32,
    engine_block_size: u32,
    /// id -> (replicas holding it, engine blocks it stands for)
    holders: HashMap<u64, (u32, u32)>,
    duplicate_engine_blocks: u64,
}

impl RoutedBlocks {
    /// `replicas` replicas of `kv_capacity_tokens` each; trace blocks of `block_tokens`; the
    /// engine's own blocks of `engine_block_size` tokens.
    pub fn new(
        replicas: usize,
        kv_capacity_tokens: u64,
        block_tokens: u32,
        engine_block_size: u32,
    ) -> RoutedBlocks {
        RoutedBlocks {
            replicas: (0..replicas).map(|_| ReplicaBlocks::default()).collect(),
            capacity_blocks: (kv_capacity_tokens / block_tokens.max(1) as u64).max(1) as usize,
            block_tokens: block_tokens.max(1),
            engine_block_size: engine_block_size.max(1),
            holders: HashMap::new(),
            duplicate_engine_blocks: 0,
        }
    }

    /// Leading tokens of a `prompt_tokens`-token prompt with `ids` believed resident on `replica`.
    pub fn matched_tokens(&self, replica: usize, ids: &[u64], prompt_tokens: u32) -> u32 {
        let held = &self.replicas[replica].slot;
        let blocks = ids.iter().take_while(|id| held.contains_key(id)).count() as u64;
        (blocks * self.block_tokens as u64).min(prompt_tokens as u64) as u32
    }

    /// Note that a prompt of `prompt_tokens` tokens with `ids` was sent to `replica`.
    pub fn route(&mut self, replica: usize, ids: &[u64], prompt_tokens: u32) {
        for (j, &id) in ids.iter().enumerate().rev() {
            if !self.replicas[replica].touch(id) {
                continue;
            }
            let tokens = (prompt_tokens as u64)
                .saturating_sub(j as u64 * self.block_tokens as u64)
                .min(self.block_tokens as u64) as u32;
            let engine_blocks = tokens / self.engine_block_size;
            let h = self.holders.entry(id).or_insert((0, engine_blocks));
            h.0 += 1;
            if h.0 == 2 {
                self.duplicate_engine_blocks += h.1 as u64;
            }
        }
        while self.replicas[replica].slot.len() > self.capacity_blocks {
            let Some(id) = self.replicas[replica].evict() else {
                break;
            };
            if let Some(h) = self.holders.get_mut(&id) {
                h.0 -= 1;
                if h.0 == 1 {
                    self.duplicate_engine_blocks -= h.1 as u64;
                } else if h.0 == 0 {
                    self.holders.remove(&id);
                }
            }
        }
    }

    /// Engine blocks currently believed held by more than one replica.
    pub fn duplicate_engine_blocks(&self) -> u64 {
        self.duplicate_engine_blocks
    }

    /// Trace blocks believed resident on `replica`.
    pub fn replica_blocks(&self, replica: usize) -> usize {
        self.replicas[replica].slot.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_leading_blocks_and_counts_duplicates() {
        // Blocks of 10 tokens, engine blocks of 2, room for 3 blocks per replica.
        let mut r = RoutedBlocks::new(2, 30, 10, 2);
        r.route(0, &[1, 2, 3], 25);
        assert_eq!(r.matched_tokens(0, &[1, 2, 9], 30), 20);
        assert_eq!(
            r.matched_tokens(0, &[1, 2, 3], 22),
            22,
            "capped at the prompt"
        );
        assert_eq!(r.matched_tokens(1, &[1, 2], 20), 0);
        assert_eq!(r.duplicate_engine_blocks(), 0);
        r.route(1, &[1, 2, 7], 30);
        // Blocks 1 and 2 (5 engine blocks each) are on both.
        assert_eq!(r.duplicate_engine_blocks(), 10);
        // Replica 0 fills up: 4, 5 push out the least recent (3, then 2: the prefix is newer).
        r.route(0, &[1, 4, 5], 30);
        assert_eq!(r.replica_blocks(0), 3);
        assert_eq!(r.matched_tokens(0, &[1, 2], 20), 10);
        assert_eq!(r.duplicate_engine_blocks(), 5);
        // Replica 1 takes 4 (now on both) and a partial 8 (3 tokens: 1 engine block), and
        // evicts 7 and 2: blocks 1 and 4 are the duplicates.
        r.route(1, &[1, 4, 8], 23);
        assert_eq!(r.duplicate_engine_blocks(), 10);
        r.route(0, &[8], 3);
        assert_eq!(r.duplicate_engine_blocks(), 11);
    }
}
