//! xorshift64*: the seeded generator behind the `random` policy, tie breaks, DNS answer
//! shuffling and the simulator's traces. Deterministic for a seed, not for cryptography.

#![forbid(unsafe_code)]

/// xorshift64*: the per-worker source of `random`.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}
