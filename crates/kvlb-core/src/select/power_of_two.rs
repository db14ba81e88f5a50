//! `power_of_two`: sample two distinct replicas at random and take the less loaded one
//! (the first sampled on a tie). Nearly least-loaded quality without every worker converging
//! on the same replica between load updates.

#![forbid(unsafe_code)]

use super::{Candidate, Policy, RequestView};

pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&mut self, _req: &RequestView<'_>, candidates: &[Candidate], random: u64) -> usize {
        let n = candidates.len();
        if n == 1 {
            return 0;
        }
        let a = ((random & 0xffff_ffff) % n as u64) as usize;
        let b = (a + 1 + ((random >> 32) % (n as u64 - 1)) as usize) % n;
        if candidates[b].in_flight < candidates[a].in_flight {
            b
        } else {
            a
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{cands, view, Rng};
    use super::*;

    #[test]
    fn exact_picks() {
        let mut p = PowerOfTwo;
        let c = cands(&[5, 1, 3]);
        // random = 0: a = 0, b = 1 -> 1 (less loaded)
        assert_eq!(p.select(&view(), &c, 0), 1);
        // a = 2, b = (2 + 1 + 1) % 3 = 1 -> 1
        assert_eq!(p.select(&view(), &c, 2 | (1 << 32)), 1);
        // a = 2, b = 0 -> 2 (3 < 5)
        assert_eq!(p.select(&view(), &c, 2), 2);
    }

    #[test]
    fn never_picks_the_most_loaded_of_many() {
        let mut p = PowerOfTwo;
        let mut rng = Rng::new(7);
        let c = cands(&[0, 0, 0, 100]);
        for _ in 0..1000 {
            assert_ne!(p.select(&view(), &c, rng.next_u64()), 3);
        }
    }

    #[test]
    fn two_samples_are_distinct() {
        let mut p = PowerOfTwo;
        let mut rng = Rng::new(3);
        let c = cands(&[1, 0]);
        for _ in 0..100 {
            assert_eq!(p.select(&view(), &c, rng.next_u64()), 1);
        }
    }
}
