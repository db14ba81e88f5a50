//! Prefill/decode disaggregation in the simulated fleet, as `kvlb serve` drives a fleet of
//! `kvlb replica --role` engines (docs/disaggregation.md):
//!
//! * each replica has a role (`Role`, `--roles`): both (whole requests), prefill or decode;
//! * a request whose model has prefill and decode replicas takes two legs (`Leg`): the policy
//!   chooses a prefill replica (`Leg::Prefill`), which computes the prompt and one token and
//!   holds the KV (`KvTransfer::Hold`); once that answer is out the policy chooses a decode
//!   replica (`Leg::Decode`), the KV moves over the link (`Transfers`: prompt tokens times
//!   `Pd::transfer_s_per_token`), the prefill replica's hold is released (the pull), and the
//!   decode replica gets the request with the KV (`KvTransfer::Received`) and decodes it;
//! * with `Disaggregate::Priced` (`kvlb serve --disaggregate priced`, its default) cache_aware
//!   chooses among the prefill and decode replicas at once (`Leg::Split`): a prefill replica
//!   and the transfer (`PdPath::Prefill`), or the prompt computed on a decode replica itself
//!   (`PdPath::Direct`), which then serves the request whole.

#![forbid(unsafe_code)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub use crate::replica::pd::Role;

/// Whether a request that may be disaggregated always is (`kvlb serve --disaggregate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Disaggregate {
    /// cache_aware prices a prefill replica and the transfer against a decode replica
    /// computing the prompt itself; other policies always disaggregate.
    #[default]
    Priced,
    /// Every such request takes both legs.
    Always,
}

impl Disaggregate {
    pub const NAMES: &'static [&'static str] = &["priced", "always"];

    pub fn parse(name: &str) -> Option<Disaggregate> {
        match name {
            "priced" => Some(Disaggregate::Priced),
            "always" => Some(Disaggregate::Always),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Disaggregate::Priced => "priced",
            Disaggregate::Always => "always",
        }
    }
}

/// A fleet's roles and how its requests use them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Pd {
    /// One per replica; empty: every replica of role both.
    pub roles: Vec<Role>,
    pub disaggregate: Disaggregate,
    /// Seconds to move one prompt token's KV from a prefill replica to a decode replica.
    pub transfer_s_per_token: f64,
}

impl Pd {
    /// Replica `r`'s role.
    pub fn role(&self, r: usize) -> Role {
        self.roles.get(r).copied().unwrap_or_default()
    }

    /// Whether the fleet has prefill and decode replicas.
    pub fn is_split(&self) -> bool {
        self.roles.contains(&Role::Prefill) && self.roles.contains(&Role::Decode)
    }

    /// The leg a new request takes among `replicas` (those serving its model): whole unless
    /// they have both roles; then split (priced by cache_aware, when `priced`) or prefill.
    pub(super) fn first_leg(&self, replicas: impl Iterator<Item = usize>, priced: bool) -> Leg {
        let (mut prefill, mut decode) = (false, false);
        for r in replicas {
            match self.role(r) {
                Role::Prefill => prefill = true,
                Role::Decode => decode = true,
                Role::Both => {}
            }
        }
        match (
            prefill && decode,
            priced && self.disaggregate == Disaggregate::Priced,
        ) {
            (false, _) => Leg::Whole,
            (true, true) => Leg::Split,
            (true, false) => Leg::Prefill,
        }
    }
}

pub use kvlb_core::pd::Leg;

/// KV transfers in flight, by the time they end (then by request, for determinism).
#[derive(Default)]
pub(super) struct Transfers(BinaryHeap<Reverse<(u64, usize)>>);

impl Transfers {
    /// Request `k`'s KV arrives at `t` (seconds, >= 0).
    pub(super) fn push(&mut self, t: f64, k: usize) {
        // Non-negative floats order as their bits do.
        self.0.push(Reverse((t.max(0.0).to_bits(), k)));
    }

    /// When the next transfer ends.
    pub(super) fn next_time(&self) -> Option<f64> {
        self.0.peek().map(|Reverse((t, _))| f64::from_bits(*t))
    }

    /// The next transfer to end: its request.
    pub(super) fn pop(&mut self) -> Option<usize> {
        self.0.pop().map(|Reverse((_, k))| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legs_admit_roles_as_kvlb_serve_does() {
        let pd = Pd {
            roles: vec![Role::Prefill, Role::Prefill, Role::Decode, Role::Both],
            ..Pd::default()
        };
        assert!(pd.is_split());
        assert_eq!(pd.first_leg(0..4, false), Leg::Prefill);
        assert_eq!(pd.first_leg(0..4, true), Leg::Split);
        // Without a decode replica among those serving the model: whole.
        assert_eq!(pd.first_leg([0, 1, 3].into_iter(), true), Leg::Whole);
        let always = Pd {
            disaggregate: Disaggregate::Always,
            ..pd.clone()
        };
        assert_eq!(always.first_leg(0..4, true), Leg::Prefill);
        assert!(!Pd::default().is_split());
        assert_eq!(Pd::default().role(7), Role::Both);
        let admitted =
            |leg: Leg| -> Vec<usize> { (0..4).filter(|&r| leg.admits(pd.role(r))).collect() };
        assert_eq!(admitted(Leg::Whole), [2, 3]);
        assert_eq!(admitted(Leg::Split), [0, 1, 2]);
        assert_eq!(admitted(Leg::Prefill), [0, 1]);
        assert_eq!(admitted(Leg::Decode), [2]);
        use crate::select::PdPath;
        assert_eq!(Leg::Split.path(Role::Prefill), PdPath::Prefill);
        assert_eq!(Leg::Split.path(Role::Decode), PdPath::Direct);
        // The prefill leg's estimate adds the transfer too, as kvlb serve's does.
        assert_eq!(Leg::Prefill.path(Role::Prefill), PdPath::Prefill);
        // The decode leg's estimate is the decode replica's own (what it receives, the
        // sequences beside it).
        assert_eq!(Leg::Decode.path(Role::Decode), PdPath::Decode);
        assert_eq!(Leg::Whole.path(Role::Decode), PdPath::Whole);
        for name in Disaggregate::NAMES {
            assert_eq!(Disaggregate::parse(name).unwrap().name(), *name);
        }
    }

    #[test]
    fn transfers_end_in_time_order() {
        let mut t = Transfers::default();
        t.push(2.5, 1);
        t.push(0.5, 7);
        t.push(2.5, 0);
        assert_eq!(t.next_time(), Some(0.5));
        assert_eq!(
            [t.pop(), t.pop(), t.pop(), t.pop()],
            [Some(7), Some(0), Some(1), None]
        );
        assert_eq!(t.next_time(), None);
    }
}
