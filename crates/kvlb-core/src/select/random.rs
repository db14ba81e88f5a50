//! `random`: a uniformly random replica. The memoryless baseline: it spreads load evenly in
//! expectation and, like round-robin, sprays every shared prefix over the whole fleet.

#![forbid(unsafe_code)]

use super::{Candidate, Policy, RequestView};

pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(&mut self, _req: &RequestView<'_>, candidates: &[Candidate], random: u64) -> usize {
        (random % candidates.len().max(1) as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::super::{cands, view, Rng};
    use super::*;

    #[test]
    fn exact_picks() {
        let mut p = Random;
        let c = cands(&[0, 0, 0]);
        assert_eq!(p.select(&view(), &c, 0), 0);
        assert_eq!(p.select(&view(), &c, 4), 1);
        assert_eq!(p.select(&view(), &c, 8), 2);
        assert_eq!(p.select(&view(), &c, u64::MAX), (u64::MAX % 3) as usize);
        assert_eq!(p.select(&view(), &cands(&[7]), 12345), 0);
    }

    #[test]
    fn exact_sequence_from_a_seed() {
        let mut p = Random;
        let mut rng = Rng::new(42);
        let c = cands(&[9, 0, 3, 1]);
        let picks: Vec<usize> = (0..10)
            .map(|_| p.select(&view(), &c, rng.next_u64()))
            .collect();
        let mut rng = Rng::new(42);
        let expected: Vec<usize> = (0..10).map(|_| (rng.next_u64() % 4) as usize).collect();
        assert_eq!(picks, expected);
        assert_eq!(picks, vec![1, 3, 1, 2, 2, 2, 3, 2, 0, 3]);
    }

    #[test]
    fn ignores_load() {
        let mut p = Random;
        let mut rng = Rng::new(5);
        let c = cands(&[100, 0]);
        let mut seen = [0; 2];
        for _ in 0..1000 {
            seen[p.select(&view(), &c, rng.next_u64())] += 1;
        }
        assert!(seen[0] > 400 && seen[1] > 400, "{seen:?}");
    }
}
