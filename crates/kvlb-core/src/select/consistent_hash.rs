//! `consistent_hash`: consistent hashing with bounded loads on the prompt's first block, the
//! way KubeAI routes (CHWBL). Each replica owns `VIRTUAL_NODES` points on a 64-bit hash ring;
//! the request's first prefix block hashes to a point, and the walk goes clockwise to the first
//! replica whose load is within the bound
//!
//! ```text
//! in_flight <= ceil(LOAD_FACTOR * (total_in_flight + 1) / replicas),   LOAD_FACTOR = 1.25
//! ```
//!
//! Requests sharing a first block (a system prompt) stick to one replica until it is 25 % above
//! the mean, then spill to the next replica on the ring. A request without prefix blocks takes
//! the ring point `random` names. The ring is built once per candidate set and reused while the
//! set stays the same, so a pick is one binary search plus a short walk.

#![forbid(unsafe_code)]

use super::{Candidate, Policy, RequestView};

/// Points each replica owns on the ring (KubeAI's default replication).
pub const VIRTUAL_NODES: u32 = 256;
/// How far above the mean load a replica may go before requests walk past it.
pub const LOAD_FACTOR: f64 = 1.25;

pub struct ConsistentHash {
    /// `(point, index into candidates)`, sorted by point.
    ring: Vec<(u64, usize)>,
    /// The candidates' replica ids the ring was built for.
    built_for: Vec<usize>,
}

/// splitmix64 finaliser: spreads block hashes and node names over the ring.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn node_point(replica: usize, vnode: u32) -> u64 {
    mix(mix(replica as u64) ^ (vnode as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

impl Default for ConsistentHash {
    fn default() -> ConsistentHash {
        ConsistentHash::new()
    }
}

impl ConsistentHash {
    pub fn new() -> ConsistentHash {
        ConsistentHash {
            ring: Vec::new(),
            built_for: Vec::new(),
        }
    }

    fn build(&mut self, candidates: &[Candidate]) {
        if self.built_for.len() == candidates.len()
            && self
                .built_for
                .iter()
                .zip(candidates)
                .all(|(r, c)| *r == c.replica)
        {
            return;
        }
        self.built_for = candidates.iter().map(|c| c.replica).collect();
        self.ring.clear();
        for (i, c) in candidates.iter().enumerate() {
            for v in 0..VIRTUAL_NODES {
                self.ring.push((node_point(c.replica, v), i));
            }
        }
        self.ring.sort_unstable();
    }

    /// The largest in-flight count a replica may have and still take the request.
    pub fn load_bound(candidates: &[Candidate]) -> u64 {
        let total: u64 = candidates.iter().map(|c| c.in_flight as u64).sum();
        (LOAD_FACTOR * (total + 1) as f64 / candidates.len().max(1) as f64).ceil() as u64
    }
}

impl Policy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn select(&mut self, req: &RequestView<'_>, candidates: &[Candidate], random: u64) -> usize {
        if candidates.len() <= 1 {
            return 0;
        }
        self.build(candidates);
        let point = match req.blocks.first() {
            Some(&b) => mix(b),
            None => random,
        };
        let bound = ConsistentHash::load_bound(candidates);
        let start = self.ring.partition_point(|&(p, _)| p < point);
        let len = self.ring.len();
        for k in 0..len {
            let i = self.ring[(start + k) % len].1;
            if candidates[i].in_flight as u64 <= bound {
                return i;
            }
        }
        // Unreachable (the least loaded replica is always within the bound), but a pick is a pick.
        (0..candidates.len())
            .min_by_key(|&i| candidates[i].in_flight)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{cands, view, RequestView};
    use super::*;

    fn with_blocks(blocks: &[u64]) -> RequestView<'_> {
        RequestView { blocks, ..view() }
    }

    /// The replica the ring gives block `b` when every replica is idle.
    fn home(b: u64, n: usize) -> usize {
        ConsistentHash::new().select(&with_blocks(&[b]), &cands(&vec![0; n]), 0)
    }

    #[test]
    fn bound_is_ceil_of_a_quarter_above_the_mean() {
        assert_eq!(ConsistentHash::load_bound(&cands(&[0, 0, 0, 0])), 1);
        // 1.25 * 9 / 4 = 2.8125 -> 3
        assert_eq!(ConsistentHash::load_bound(&cands(&[2, 2, 2, 2])), 3);
        // 1.25 * 41 / 4 = 12.8125 -> 13
        assert_eq!(ConsistentHash::load_bound(&cands(&[40, 0, 0, 0])), 13);
    }

    #[test]
    fn exact_homes_of_blocks() {
        let homes: Vec<usize> = (0..12u64).map(|b| home(b, 4)).collect();
        assert_eq!(homes, vec![3, 1, 3, 3, 0, 0, 2, 2, 0, 3, 1, 0]);
        // Every replica is someone's home.
        for r in 0..4 {
            assert!(homes.contains(&r), "{homes:?}");
        }
    }

    #[test]
    fn same_first_block_same_replica_until_the_bound() {
        let mut p = ConsistentHash::new();
        let h = home(7, 4);
        let mut loads = vec![0u32; 4];
        let mut picks = vec![];
        for _ in 0..8 {
            let i = p.select(&with_blocks(&[7, 99]), &cands(&loads), 0);
            loads[i] += 1;
            picks.push(i);
        }
        // With k requests in flight the bound is ceil(1.25 * (k + 1) / 4): 1, 1, 1, 2, 2, 2,
        // 3, 3. The home (2) takes a request while its load is within it; otherwise the walk
        // goes on clockwise to 3, the next replica on the ring for this point.
        assert_eq!(picks, vec![2, 2, 3, 2, 3, 3, 2, 3]);
        assert_eq!(picks[0], h);
    }

    #[test]
    fn walks_clockwise_past_overloaded_replicas() {
        let h = home(3, 3);
        let mut loads = vec![0u32; 3];
        loads[h] = 10;
        let next = ConsistentHash::new().select(&with_blocks(&[3]), &cands(&loads), 0);
        assert_ne!(next, h);
        // The bound is ceil(1.25 * 11 / 3) = 5: the home is far past it.
        assert_eq!((h, next), (1, 2));
    }

    #[test]
    fn ring_follows_replica_ids_not_positions() {
        // Removing a replica only moves the keys it owned.
        let all = cands(&[0, 0, 0, 0]);
        let without_2: Vec<Candidate> = all.iter().copied().filter(|c| c.replica != 2).collect();
        let mut p = ConsistentHash::new();
        let mut moved = 0;
        for b in 0..200u64 {
            let before = all[p.select(&with_blocks(&[b]), &all, 0)].replica;
            let after = without_2[p.select(&with_blocks(&[b]), &without_2, 0)].replica;
            if before != 2 {
                assert_eq!(before, after, "block {b}");
            } else {
                moved += 1;
            }
        }
        assert!(moved > 20 && moved < 90, "{moved}");
    }

    #[test]
    fn no_blocks_uses_the_random_point_and_one_candidate_is_trivial() {
        let mut p = ConsistentHash::new();
        let c = cands(&[0, 0, 0]);
        let picks: Vec<usize> = [0u64, u64::MAX / 3, u64::MAX / 3 * 2, u64::MAX]
            .iter()
            .map(|&r| p.select(&view(), &c, r))
            .collect();
        assert_eq!(picks, vec![0, 2, 2, 0]);
        assert_eq!(p.select(&with_blocks(&[1]), &cands(&[5]), 0), 0);
    }
}
