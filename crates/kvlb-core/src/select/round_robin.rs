//! `round_robin`: each worker cycles through the available replicas. The right policy for
//! stateless services and the baseline kvlb is measured against.

#![forbid(unsafe_code)]

use super::{Candidate, Policy, RequestView};

pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    /// Workers start at different offsets so they do not move in lockstep.
    pub fn new(worker: usize) -> RoundRobin {
        RoundRobin { next: worker }
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&mut self, _req: &RequestView<'_>, candidates: &[Candidate], _random: u64) -> usize {
        let i = self.next % candidates.len();
        self.next = self.next.wrapping_add(1);
        i
    }
}

#[cfg(test)]
mod tests {
    use super::super::{cands, view};
    use super::*;

    #[test]
    fn cycles_in_order() {
        let mut p = RoundRobin::new(0);
        let c = cands(&[5, 0, 9]);
        let picks: Vec<usize> = (0..7).map(|_| p.select(&view(), &c, 0)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2, 0]);
    }

    #[test]
    fn second_worker_starts_offset() {
        let mut p = RoundRobin::new(1);
        let c = cands(&[0, 0]);
        let picks: Vec<usize> = (0..4).map(|_| p.select(&view(), &c, 0)).collect();
        assert_eq!(picks, vec![1, 0, 1, 0]);
    }
}
