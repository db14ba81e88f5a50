//! `sglang_cache_aware`: sglang-router's documented cache-aware rule, modelled at block
//! granularity so kvlb can be measured against it on the same traces.
//!
//! sglang-router keeps, per worker, an approximate radix tree of the prompts it routed there
//! (characters, never evicted here) and decides:
//!
//! 1. **Imbalanced?** With `load` = requests in flight, if
//!    `max_load - min_load > BALANCE_ABS_THRESHOLD` and `max_load > BALANCE_REL_THRESHOLD *
//!    min_load`, the request goes to the least loaded worker (shortest queue).
//! 2. Otherwise the worker with the **longest prefix match** is found; if
//!    `match_rate = matched / prompt > CACHE_THRESHOLD` the request goes there,
//! 3. else to the worker with the **smallest tree** (the least cached).
//!
//! Either way the prompt is inserted into the chosen worker's tree. Ties go to the first
//! worker. Here a tree is the set of chained block hashes routed to a replica: a block hash
//! names its whole prefix, so "the leading blocks present" is the radix-tree match, and the
//! tree's size is its number of blocks. Matched tokens are `matched_blocks * block_tokens`,
//! capped at the prompt.

#![forbid(unsafe_code)]

use super::{Candidate, Policy, RequestView};
use std::collections::HashSet;

pub const CACHE_THRESHOLD: f64 = 0.3;
pub const BALANCE_ABS_THRESHOLD: u32 = 64;
pub const BALANCE_REL_THRESHOLD: f64 = 1.5;

#[derive(Default)]
pub struct SglangCacheAware {
    /// Per replica id: the block hashes routed there.
    trees: Vec<HashSet<u64>>,
}

impl SglangCacheAware {
    pub fn new() -> SglangCacheAware {
        SglangCacheAware::default()
    }

    fn tree(&mut self, replica: usize) -> &mut HashSet<u64> {
        if self.trees.len() <= replica {
            self.trees.resize_with(replica + 1, HashSet::new);
        }
        &mut self.trees[replica]
    }

    /// Leading blocks of `blocks` in `replica`'s tree.
    pub fn matched_blocks(&self, replica: usize, blocks: &[u64]) -> usize {
        match self.trees.get(replica) {
            Some(tree) => blocks.iter().take_while(|b| tree.contains(b)).count(),
            None => 0,
        }
    }

    /// Blocks in `replica`'s tree.
    pub fn tree_blocks(&self, replica: usize) -> usize {
        self.trees.get(replica).map_or(0, |t| t.len())
    }

    fn choose(&self, req: &RequestView<'_>, candidates: &[Candidate]) -> usize {
        let first_min = |key: &dyn Fn(&Candidate) -> usize| {
            let mut best = 0;
            for (i, c) in candidates.iter().enumerate() {
                if key(c) < key(&candidates[best]) {
                    best = i;
                }
            }
            best
        };
        let max_load = candidates.iter().map(|c| c.in_flight).max().unwrap_or(0);
        let min_load = candidates.iter().map(|c| c.in_flight).min().unwrap_or(0);
        if max_load - min_load > BALANCE_ABS_THRESHOLD
            && max_load as f64 > BALANCE_REL_THRESHOLD * min_load as f64
        {
            return first_min(&|c| c.in_flight as usize);
        }
        let mut best = 0;
        let mut best_blocks = 0;
        for (i, c) in candidates.iter().enumerate() {
            let m = self.matched_blocks(c.replica, req.blocks);
            if m > best_blocks {
                best = i;
                best_blocks = m;
            }
        }
        let matched = (best_blocks as u64 * req.block_tokens as u64).min(req.prompt_tokens as u64);
        let match_rate = matched as f64 / req.prompt_tokens.max(1) as f64;
        if match_rate > CACHE_THRESHOLD {
            best
        } else {
            first_min(&|c| self.tree_blocks(c.replica))
        }
    }
}

impl Policy for SglangCacheAware {
    fn name(&self) -> &'static str {
        "sglang_cache_aware"
    }

    fn select(&mut self, req: &RequestView<'_>, candidates: &[Candidate], _random: u64) -> usize {
        if candidates.len() <= 1 {
            if let Some(c) = candidates.first() {
                self.tree(c.replica).extend(req.blocks.iter().copied());
            }
            return 0;
        }
        let i = self.choose(req, candidates);
        self.tree(candidates[i].replica)
            .extend(req.blocks.iter().copied());
        i
    }
}

#[cfg(test)]
mod tests {
    use super::super::{cands, view, RequestView};
    use super::*;

    fn prompt(blocks: &[u64], tokens: u32) -> RequestView<'_> {
        RequestView {
            blocks,
            block_tokens: 100,
            prompt_tokens: tokens,
            ..view()
        }
    }

    #[test]
    fn empty_trees_tie_to_the_first_then_fill_the_smallest() {
        let mut p = SglangCacheAware::new();
        let c = cands(&[0, 0, 0]);
        let picks: Vec<usize> = (0..4u64)
            .map(|k| p.select(&prompt(&[10 * k + 1, 10 * k + 2], 200), &c, 0))
            .collect();
        // Fresh prompts (no match): the smallest tree, first on ties.
        assert_eq!(picks, vec![0, 1, 2, 0]);
        assert_eq!(p.tree_blocks(0), 4);
    }

    #[test]
    fn follows_a_match_above_the_threshold_only() {
        let mut p = SglangCacheAware::new();
        let c = cands(&[0, 0, 0]);
        assert_eq!(p.select(&prompt(&[1, 2, 3], 300), &c, 0), 0);
        assert_eq!(p.select(&prompt(&[7, 8], 200), &c, 0), 1);
        // Shares 2 of 5 blocks with replica 0: 200 / 500 = 0.4 > 0.3 -> 0.
        assert_eq!(p.select(&prompt(&[1, 2, 4, 5, 6], 500), &c, 0), 0);
        // Shares 1 block of 4: 0.25 -> the smallest tree, replica 2 (empty).
        assert_eq!(p.select(&prompt(&[7, 9, 10, 11], 400), &c, 0), 2);
        // Exactly 0.3 is not above the threshold: 3 of 10 blocks with replica 0 -> smallest (1: 2 blocks).
        let ten = [1, 2, 3, 20, 21, 22, 23, 24, 25, 26];
        assert_eq!(p.select(&prompt(&ten, 1000), &c, 0), 1);
        // The match is capped at the prompt: a partial last block still counts whole up to it.
        assert_eq!(p.select(&prompt(&[1, 2, 3], 250), &c, 0), 0);
    }

    #[test]
    fn longest_match_wins_and_ties_go_first() {
        let mut p = SglangCacheAware::new();
        let c = cands(&[0, 0]);
        p.tree(0).extend([1, 2]);
        p.tree(1).extend([1, 2, 3]);
        assert_eq!(p.select(&prompt(&[1, 2, 3, 4], 400), &c, 0), 1);
        // Both hold [1, 2]: a tie goes to the first.
        assert_eq!(p.select(&prompt(&[1, 2, 9], 300), &c, 0), 0);
    }

    #[test]
    fn imbalance_overrides_the_cache() {
        let req = [1u64, 2, 3, 4];
        let pick = |loads: &[u32]| {
            let mut p = SglangCacheAware::new();
            p.tree(0).extend([1, 2, 3]);
            p.select(&prompt(&req, 400), &cands(loads), 0)
        };
        // Gap 65 > 64 and 100 > 1.5 * 35: imbalanced -> least loaded (replica 2).
        assert_eq!(pick(&[100, 40, 35]), 2);
        // Gap 64 is not above the threshold: the match wins.
        assert_eq!(pick(&[100, 40, 36]), 0);
        // Gap 70 and 100 > 1.5 * 30: imbalanced; the least loaded tie goes to the first.
        assert_eq!(pick(&[100, 30, 30]), 1);
        // Gap 99, but 300 <= 1.5 * 201: balanced, the match wins.
        assert_eq!(pick(&[300, 201, 250]), 0);
        // Imbalanced and the least loaded is the holder: it still goes there.
        assert_eq!(pick(&[0, 100, 100]), 0);
    }

    #[test]
    fn exact_sequence_on_a_shared_system_prompt() {
        // Every prompt starts with block 0 (one block of ten): the match rate is 0.1, so
        // sglang spreads fresh conversations by tree size, then follows each conversation.
        let mut p = SglangCacheAware::new();
        let c = cands(&[0, 0, 0]);
        let conv = |k: u64, turns: u64| -> Vec<u64> {
            let mut v = vec![0];
            v.extend((0..9 + turns).map(|j| 1000 * (k + 1) + j));
            v
        };
        let mut picks = vec![];
        for k in 0..3 {
            picks.push(p.select(&prompt(&conv(k, 0), 1000), &c, 0));
        }
        for k in (0..3).rev() {
            picks.push(p.select(&prompt(&conv(k, 1), 1100), &c, 0));
        }
        assert_eq!(picks, vec![0, 1, 2, 2, 1, 0]);
    }

    #[test]
    fn trees_are_per_replica_id() {
        let mut p = SglangCacheAware::new();
        let c: Vec<Candidate> = cands(&[0, 0, 0, 0])
            .into_iter()
            .filter(|c| c.replica != 0)
            .collect();
        assert_eq!(p.select(&prompt(&[5, 6], 200), &c, 0), 0);
        assert_eq!(p.tree_blocks(1), 2);
        assert_eq!(p.matched_blocks(1, &[5, 6, 7]), 2);
        assert_eq!(p.matched_blocks(0, &[5, 6, 7]), 0);
        assert_eq!(p.select(&prompt(&[5, 6, 8], 300), &c, 0), 0);
    }
}
