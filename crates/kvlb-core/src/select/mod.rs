//! Replica selection: one small trait, one file per policy. Policies are pure: they see the
//! parsed request, the available replicas with their load, and a random number, and return a
//! choice. Each worker owns its policy instance (`&mut self`, no sharing, no locks); the loads
//! they read are counted across workers by the caller.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

pub mod cache_aware;
mod consistent_hash;
mod least_loaded;
mod policy_name;
mod power_of_two;
mod random;
mod round_robin;
mod sglang_cache_aware;

pub use cache_aware::{CacheAware, CacheAwareConfig, Decision, Reason};
pub use consistent_hash::ConsistentHash;
pub use least_loaded::LeastLoaded;
pub use power_of_two::PowerOfTwo;
pub use random::Random;
pub use round_robin::RoundRobin;
pub use sglang_cache_aware::SglangCacheAware;

use crate::http::request::Method;
pub use crate::rng::Rng;
pub use policy_name::PolicyName;

/// What a policy may look at in a request.
pub struct RequestView<'a> {
    pub method: Method,
    pub path: &'a [u8],
    /// The request body as received so far (the whole body for the L7 path).
    pub body: &'a [u8],
    /// Chained hashes of the prompt's prefix blocks (empty when the body is not a prompt).
    pub blocks: &'a [u64],
    /// Estimated prompt tokens covered by one block.
    pub block_tokens: u32,
    /// Estimated tokens of the whole prompt.
    pub prompt_tokens: u32,
    /// Microseconds on a monotonic clock (passed in so decisions replay in tests).
    pub now_us: u64,
}

/// One replica a request may go to, with the load kvlb knows of.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Candidate {
    /// Index of the replica in the fleet.
    pub replica: usize,
    /// Requests in flight there, counted across every worker.
    pub in_flight: u32,
    /// Prompt tokens routed there whose prefill has not finished (no first byte yet).
    pub queued_prefill_tokens: u64,
    /// Requests there past their first byte (decoding).
    pub decoding: u32,
    /// What the replica last reported of its queue (less this instance's requests) and KV
    /// usage; `cache_aware` adds it to the counts above while fresh (`estimate::reported`).
    pub reported: crate::estimate::ReportedLoad,
    /// Microseconds the replica must spend before it can start this request (a LoRA
    /// adapter to load); `cache_aware` adds them to its wait.
    pub setup_us: u32,
    /// The request is for a LoRA adapter and the replica's LoRA batch slots are all held by
    /// others (`ReportedLoad::lora_slot_busy`): `cache_aware` adds the wait for one.
    pub lora_slot_busy: bool,
    /// The replica's measured pace (`estimate::calibrate`): `cache_aware` prices its work at it.
    pub pace: crate::estimate::Pace,
    /// Requests sent to the replica so far, counted over every worker (`cache_aware` reads its
    /// recent rate).
    pub routed: u64,
    /// How the request would run there when it may be disaggregated.
    pub pd: PdPath,
}

/// Where a request that may be disaggregated (prefill and decode replicas serve its model)
/// would run on a candidate: `cache_aware` prices the two paths against each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PdPath {
    /// As any request (no disaggregation in question).
    #[default]
    Whole,
    /// Prefilled on this prefill replica, its KV then moved to a decode replica: the transfer
    /// adds to the time to first token.
    Prefill,
    /// Computed on this decode replica itself: its running sequences stall meanwhile.
    Direct,
    /// The decode leg of a disaggregated request on this decode replica: it receives the KV
    /// of the prompt it does not hold and decodes beside the sequences running there.
    Decode,
}

pub trait Policy {
    fn name(&self) -> &'static str;

    /// Choose one of `candidates` (never empty); returns an index into `candidates`.
    /// `random` is a fresh uniformly random number.
    fn select(&mut self, req: &RequestView<'_>, candidates: &[Candidate], random: u64) -> usize;

    /// Why the last `select` chose what it did, for policies that estimate (explain header,
    /// decision metrics, the prefill tokens counted as queued on the chosen replica).
    fn decision(&self) -> Option<Decision> {
        None
    }
}

/// What `cache_aware` needs beyond its name: the residency index it reads (and the offloaded
/// tier's, if tracked), the worker's routing log it records into, and its knobs.
pub struct CacheAwareParts {
    pub index: std::sync::Arc<crate::residency::ResidencyIndex>,
    pub offload: Option<std::sync::Arc<crate::residency::ResidencyIndex>>,
    pub log: std::sync::Arc<crate::residency::RoutingLog>,
    pub config: CacheAwareConfig,
}

pub fn build(
    name: PolicyName,
    worker: usize,
    cache_aware: Option<CacheAwareParts>,
) -> Result<Box<dyn Policy>, String> {
    Ok(match name {
        PolicyName::CacheAware => {
            let parts = cache_aware.ok_or("cache_aware needs a residency index")?;
            let policy = CacheAware::new(parts.index, parts.config)?.with_routing_log(parts.log);
            Box::new(match parts.offload {
                Some(offload) => policy.with_offload_tier(offload),
                None => policy,
            })
        }
        PolicyName::RoundRobin => Box::new(RoundRobin::new(worker)),
        PolicyName::LeastLoaded => Box::new(LeastLoaded::new(worker)),
        PolicyName::PowerOfTwo => Box::new(PowerOfTwo),
        PolicyName::ConsistentHash => Box::new(ConsistentHash::new()),
        PolicyName::Random => Box::new(Random),
    })
}

#[cfg(test)]
pub(crate) fn view() -> RequestView<'static> {
    RequestView {
        method: Method::Post,
        path: b"/v1/chat/completions",
        body: b"{}",
        blocks: &[],
        block_tokens: 64,
        prompt_tokens: 1,
        now_us: 0,
    }
}

#[cfg(test)]
pub(crate) fn cands(loads: &[u32]) -> Vec<Candidate> {
    loads
        .iter()
        .enumerate()
        .map(|(i, l)| Candidate {
            replica: i,
            in_flight: *l,
            ..Default::default()
        })
        .collect()
}
