//! `least_loaded`: the replica with the fewest requests in flight (counted across workers);
//! ties rotate so equal replicas share the work.

#![forbid(unsafe_code)]

use super::{Candidate, Policy, RequestView};

pub struct LeastLoaded {
    rotate: usize,
}

impl LeastLoaded {
    pub fn new(worker: usize) -> LeastLoaded {
        LeastLoaded { rotate: worker }
    }
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn select(&mut self, _req: &RequestView<'_>, candidates: &[Candidate], _random: u64) -> usize {
        let n = candidates.len();
        let start = self.rotate % n;
        self.rotate = self.rotate.wrapping_add(1);
        let mut best = start;
        for k in 1..n {
            let i = (start + k) % n;
            if candidates[i].in_flight < candidates[best].in_flight {
                best = i;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::super::{cands, view};
    use super::*;

    #[test]
    fn picks_fewest_in_flight() {
        let mut p = LeastLoaded::new(0);
        assert_eq!(p.select(&view(), &cands(&[3, 1, 2]), 0), 1);
        assert_eq!(p.select(&view(), &cands(&[0, 4, 4]), 0), 0);
    }

    #[test]
    fn ties_rotate() {
        let mut p = LeastLoaded::new(0);
        let c = cands(&[1, 1, 1]);
        let picks: Vec<usize> = (0..6).map(|_| p.select(&view(), &c, 0)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }
}
