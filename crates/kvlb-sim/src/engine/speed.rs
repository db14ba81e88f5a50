//! Per-replica speed factors of a mixed fleet: `kvlb replica --speed`, `kvlb simulate
//! --speeds` and `kvlb demo --speeds` all parse their list here.
//!
//! A list is comma-separated, one entry per replica or one for all. An entry is `X` (prefill
//! and decode both X times the configured speed: `0.333` is three times slower) or `PxD`
//! (prefill speed P, decode speed D: `0.33x0.5`). Each factor is finite and within
//! [`Speed::MIN`, `Speed::MAX`]. A replica at prefill speed P has every prefill timing term
//! (`prefill_a_s`, `prefill_b_s`, `prefill_c_s`) divided by P, at decode speed D every decode
//! term (`decode_base_s`, `decode_per_seq_s`, `decode_per_ctx_token_s`) divided by D; token
//! counts (chunk size, `max_num_seqs`) stay.

#![forbid(unsafe_code)]

use super::EngineConfig;
use std::fmt;
use std::str::FromStr;

/// One replica's speed: its prefill and decode speed over the configured timing (1 = as
/// configured, 0.5 = twice as slow).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speed {
    pub prefill: f64,
    pub decode: f64,
}

impl Speed {
    /// The configured speed.
    pub const ONE: Speed = Speed {
        prefill: 1.0,
        decode: 1.0,
    };
    /// Slowest factor accepted.
    pub const MIN: f64 = 0.01;
    /// Fastest factor accepted.
    pub const MAX: f64 = 100.0;

    pub fn is_one(&self) -> bool {
        *self == Speed::ONE
    }

    /// `engine` at this speed: its prefill terms divided by `prefill`, its decode terms by
    /// `decode`; everything else as it is.
    pub fn apply(&self, engine: &EngineConfig) -> EngineConfig {
        EngineConfig {
            prefill_a_s: engine.prefill_a_s / self.prefill,
            prefill_b_s: engine.prefill_b_s / self.prefill,
            prefill_c_s: engine.prefill_c_s / self.prefill,
            decode_base_s: engine.decode_base_s / self.decode,
            decode_per_seq_s: engine.decode_per_seq_s / self.decode,
            decode_per_ctx_token_s: engine.decode_per_ctx_token_s / self.decode,
            ..engine.clone()
        }
    }
}

/// `X` when prefill and decode agree, else `PxD`.
impl fmt::Display for Speed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.prefill == self.decode {
            true => write!(f, "{}", self.prefill),
            false => write!(f, "{}x{}", self.prefill, self.decode),
        }
    }
}

impl FromStr for Speed {
    type Err = String;

    fn from_str(s: &str) -> Result<Speed, String> {
        let factor = |v: &str| -> Result<f64, String> {
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && (Speed::MIN..=Speed::MAX).contains(x))
                .ok_or_else(|| {
                    format!(
                        "{s:?}: expected X or PxD, each a number from {} to {}",
                        Speed::MIN,
                        Speed::MAX
                    )
                })
        };
        match s.trim().split_once(['x', 'X']) {
            Some((p, d)) => Ok(Speed {
                prefill: factor(p)?,
                decode: factor(d)?,
            }),
            None => {
                let x = factor(s)?;
                Ok(Speed {
                    prefill: x,
                    decode: x,
                })
            }
        }
    }
}

/// A speed list as given: one speed for every replica, or one per replica. `"1"` (the flags'
/// default) is every replica at the configured speed.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeedList(Vec<Speed>);

impl SpeedList {
    /// The flags' default value.
    pub const DEFAULT: &'static str = "1";

    /// Every replica at the configured speed.
    pub fn one() -> SpeedList {
        SpeedList(vec![Speed::ONE])
    }

    /// The value parser of the flags (clap puts the flag and the value in front of the error).
    pub fn parse(s: &str) -> Result<SpeedList, String> {
        s.parse()
    }

    /// The speeds as given.
    pub fn speeds(&self) -> &[Speed] {
        &self.0
    }

    /// Whether every replica runs at the configured speed.
    pub fn is_one(&self) -> bool {
        self.0.iter().all(Speed::is_one)
    }

    /// Check the list against a fleet of `replicas`: one value, or one per replica; the error
    /// names `flag` and the fleet as `fleet` says it (e.g. `--count 2`).
    pub fn check(&self, replicas: usize, flag: &str, fleet: &str) -> Result<(), String> {
        match self.0.len() {
            1 => Ok(()),
            n if n == replicas => Ok(()),
            n => Err(format!(
                "bad value for {flag}: {self} ({n} speeds for {fleet}; give one for all \
                 replicas or one per replica)"
            )),
        }
    }

    /// Replica `i`'s speed (the one value of a single-valued list for every replica).
    pub fn of(&self, i: usize) -> Speed {
        match self.0.len() {
            1 => self.0[0],
            _ => self.0.get(i).copied().unwrap_or(Speed::ONE),
        }
    }

    /// The speeds of `replicas` replicas, after `check`.
    pub fn per_replica(&self, replicas: usize) -> Vec<Speed> {
        (0..replicas).map(|i| self.of(i)).collect()
    }

    /// The speeds of replicas `range` of the fleet, as a list (for a process serving them).
    pub fn slice(&self, range: std::ops::Range<usize>) -> SpeedList {
        SpeedList(range.map(|i| self.of(i)).collect())
    }
}

/// Comma-separated, as parsed.
impl fmt::Display for SpeedList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{s}")?;
        }
        Ok(())
    }
}

impl FromStr for SpeedList {
    type Err = String;

    fn from_str(s: &str) -> Result<SpeedList, String> {
        let list = s
            .split(',')
            .map(str::parse)
            .collect::<Result<Vec<Speed>, String>>()?;
        Ok(SpeedList(list))
    }
}

/// `timing_spread`'s value parser: a number from 0 to 1.
pub fn timing_spread(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && (0.0..=1.0).contains(x))
        .ok_or_else(|| "expected a number from 0 to 1".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn speeds(s: &str) -> Vec<(f64, f64)> {
        let list: SpeedList = s.parse().unwrap();
        list.speeds()
            .iter()
            .map(|s| (s.prefill, s.decode))
            .collect()
    }

    #[test]
    fn good_lists_parse() {
        assert_eq!(speeds("1"), [(1.0, 1.0)]);
        assert_eq!(speeds("0.333"), [(0.333, 0.333)]);
        assert_eq!(
            speeds("1,1,0.333, 0.333"),
            [(1.0, 1.0), (1.0, 1.0), (0.333, 0.333), (0.333, 0.333)]
        );
        assert_eq!(speeds("0.33x0.5,2"), [(0.33, 0.5), (2.0, 2.0)]);
        assert_eq!(speeds("0.01X100"), [(0.01, 100.0)]);
        let list = SpeedList::parse("1,0.25,0.33x0.5").unwrap();
        assert_eq!(list.to_string(), "1,0.25,0.33x0.5");
        assert!(!list.is_one());
        assert!(SpeedList::parse(SpeedList::DEFAULT).unwrap().is_one());
        assert_eq!(SpeedList::one(), SpeedList::parse("1").unwrap());
        assert!(SpeedList::parse("1,1x1").unwrap().is_one());
    }

    #[test]
    fn bad_values_are_refused() {
        for bad in [
            "", "0", "0.001", "101", "-1", "nan", "inf", "1,", ",1", "x", "1x", "x1", "1x2x3",
            "fast", "1;2",
        ] {
            let e = SpeedList::parse(bad).unwrap_err();
            assert!(e.contains("expected X or PxD"), "{bad:?}: {e}");
        }
        assert!(SpeedList::parse("0.5x0").unwrap_err().contains("0.5x0"));
    }

    #[test]
    fn length_is_one_or_the_fleet() {
        let one = SpeedList::parse("0.5").unwrap();
        one.check(3, "--speed", "--count 3").unwrap();
        assert_eq!(one.per_replica(3), vec![one.of(0); 3]);
        let two = SpeedList::parse("1,0.25").unwrap();
        two.check(2, "--speed", "--count 2").unwrap();
        assert_eq!(two.of(1).prefill, 0.25);
        let e = two.check(3, "--speed", "--count 3").unwrap_err();
        assert!(
            e.contains("--speed") && e.contains("1,0.25") && e.contains("--count 3"),
            "{e}"
        );
        assert_eq!(two.slice(1..2).to_string(), "0.25");
        assert_eq!(one.slice(0..2).to_string(), "0.5,0.5");
    }

    #[test]
    fn a_speed_divides_prefill_and_decode_terms() {
        let base = EngineConfig::default();
        let slow = Speed {
            prefill: 0.5,
            decode: 0.25,
        }
        .apply(&base);
        assert_eq!(slow.prefill_a_s, base.prefill_a_s * 2.0);
        assert_eq!(slow.prefill_b_s, base.prefill_b_s * 2.0);
        assert_eq!(slow.prefill_c_s, base.prefill_c_s * 2.0);
        assert_eq!(slow.decode_base_s, base.decode_base_s * 4.0);
        assert_eq!(slow.decode_per_seq_s, base.decode_per_seq_s * 4.0);
        assert_eq!(
            slow.decode_per_ctx_token_s,
            base.decode_per_ctx_token_s * 4.0
        );
        assert_eq!(
            (slow.max_num_batched_tokens, slow.max_num_seqs),
            (base.max_num_batched_tokens, base.max_num_seqs)
        );
        assert_eq!(slow.host_load_s_per_token, base.host_load_s_per_token);
        assert_eq!(Speed::ONE.apply(&base), base);
    }

    #[test]
    fn timing_spread_is_within_0_and_1() {
        assert_eq!(timing_spread("0"), Ok(0.0));
        assert_eq!(timing_spread("0.2"), Ok(0.2));
        assert_eq!(timing_spread("1"), Ok(1.0));
        for bad in ["-0.1", "1.5", "nan", "x"] {
            assert!(timing_spread(bad).is_err(), "{bad}");
        }
    }
}
