//! The policies' names, as the configuration (file and flags) and the simulator spell them.
//! A name parses from a flag's text (`FromStr`) and from a TOML value read as that text, with
//! the same error, which names the bad value and the choices.

#![forbid(unsafe_code)]

use serde::de::Deserializer;
use serde::Deserialize;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyName {
    CacheAware,
    ConsistentHash,
    Random,
    RoundRobin,
    LeastLoaded,
    PowerOfTwo,
}

impl PolicyName {
    pub const NAMES: &'static str =
        "cache_aware, round_robin, least_loaded, power_of_two, consistent_hash, random";

    pub fn parse(s: &str) -> Option<PolicyName> {
        match s {
            "cache_aware" => Some(PolicyName::CacheAware),
            "consistent_hash" => Some(PolicyName::ConsistentHash),
            "random" => Some(PolicyName::Random),
            "round_robin" => Some(PolicyName::RoundRobin),
            "least_loaded" => Some(PolicyName::LeastLoaded),
            "power_of_two" => Some(PolicyName::PowerOfTwo),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::CacheAware => "cache_aware",
            PolicyName::ConsistentHash => "consistent_hash",
            PolicyName::Random => "random",
            PolicyName::RoundRobin => "round_robin",
            PolicyName::LeastLoaded => "least_loaded",
            PolicyName::PowerOfTwo => "power_of_two",
        }
    }
}

impl FromStr for PolicyName {
    type Err = String;
    fn from_str(s: &str) -> Result<PolicyName, String> {
        PolicyName::parse(s).ok_or_else(|| format!("unknown policy; one of {}", PolicyName::NAMES))
    }
}

/// A file value through `FromStr`: `"value": why` on error.
impl<'de> Deserialize<'de> for PolicyName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::text::from_text(d)
    }
}
