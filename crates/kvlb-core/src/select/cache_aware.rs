//! `cache_aware`, the default policy: send each request where its estimated time to first
//! token is lowest, counting the part of its prompt already resident there.
//!
//! For every candidate replica r:
//!
//! ```text
//! matched(r) = min(match_prefix(blocks)[r] * block_tokens, prompt_tokens),
//!              0 when below min_match_tokens (a short hit is not worth following)
//! ttft(r)    = estimate::estimate_ttft(load(r), matched(r), prompt_tokens)
//! ```
//!
//! and the request goes to the argmin (of `wait + recompute_weight * prefill`, see "Work"
//! below). Queueing is in the same unit as the saving, so a cache hit wins while queues are
//! comparable and loses once the warm replica's queue is deeper than what the hit saves.
//!
//! | knob | default | meaning |
//! |---|---|---|
//! | `model` | engine calibration | the TTFT model (`estimate`) |
//! | `min_match_tokens` | 256 | shorter matches count as none |
//! | `recompute_weight` | 2.0 | weight of own prefill against queueing (1 = plain TTFT) |
//! | `backlog_weight` | 0.1 | added to that weight per request waiting per replica beyond one |
//! | `tie_epsilon_s` | 0.001 | scores this close to the best are ties, broken by `random` |
//! | `hot_prefix_requests` | 8 | requests sharing a prefix (per worker, decaying) to be hot |
//! | `hot_window_s` | 10 | the hotness counts halve every this many seconds |
//! | `hot_spill_wait_s` | 0.1 | a hot prefix's holder this much deeper than the shortest wait loses its hit |
//!
//! `kvlb serve` sets only the model's speed (`TtftModel::scaled`), `foreign_request_tokens` and
//! `offload_load_cost`; the rest are fixed at these defaults, each by an ablation in `kvlb
//! simulate --set` (docs/cost-model.md).
//!
//! **Anti-herding.** Left alone, a prefix shared by many requests (a system prompt, an agent's
//! tool preamble) keeps its holder ahead until that holder's queue is as long as the whole
//! saving, while other replicas idle. So each policy instance keeps a small decaying count of
//! how many requests shared each prefix (`hot_*` knobs, one counter per hashed block, no
//! allocation). When a candidate's hit is on a hot prefix and its queue wait exceeds the
//! shortest wait among candidates by more than `hot_spill_wait_s`, the holder counts as
//! saturated and its hit is ignored: the request goes where the load is lowest, the routing
//! log teaches the index that this replica now holds the prefix too, and later requests share
//! it between the holders. A hot prefix thus spreads over as many replicas as its load needs,
//! one spill at a time, and stays on few replicas when the load is light. A session's own
//! history (shared by a handful of its turns) never counts as hot, so multi-turn
//! conversations keep returning to their replica whenever the cost model says so.
//!
//! **Ties.** Candidates within `tie_epsilon_s` of the best share the request: the `random`
//! argument picks one of them, so equal replicas share the load and every decision replays
//! exactly in a test. Time comes in as `RequestView::now_us`.
//!
//! **Work, not only waiting.** The argmin compares `wait + recompute_weight * prefill`
//! (default weight 2), while `Decision` reports the plain TTFT estimate `wait + prefill`: a
//! request's uncached prefill also delays everything queued behind it on that replica, so a
//! cache hit is worth more to the fleet than to the request alone. In the conversation
//! simulation (tests) weight 2 against 1 takes returns to the session's replica from 77% to
//! 93% and p99 TTFT from 0.29 s to 0.22 s; `recompute_weight = 1` is the pure TTFT argmin.
//!
//! **Pace.** Each candidate carries its replica's measured pace (`Candidate::pace`,
//! `estimate::calibrate`): its queue wait is priced at the queue pace, its own prefill at the
//! prefill pace, and the part of the score that stands for the requests a prefill holds up at
//! the slower of the two (they meet it as queued work). `calibrated: false` prices every
//! replica at the configured speed.
//!
//! **Who a prefill delays.** The extra weight of a prefill (`recompute_weight - 1`, plus the
//! backlog term below) is scaled per replica by `min(1, rate * seconds)`: the requests sent to
//! that replica lately (`Candidate::routed`, a count decaying over `arrival_window_s`) times how
//! long this request would hold it. A prefill on a replica nobody sends to delays nobody and
//! counts once.
//!
//! **Backlog.** How many requests a prefill delays grows with the backlog: work done while
//! the fleet is backlogged pushes back every request arriving until the backlog drains, and
//! the requests waiting now (not yet at their first token, fleet mean per candidate) are the
//! best count of that at hand. So the weight is `recompute_weight + backlog_weight *
//! max(0, waiting - 1)` (`prefill_weight`), the same for every candidate: it does not steer
//! fresh prompts between replicas, it only makes a hit (a session's history) count for more
//! against a queue difference when everybody is queueing, and is exactly `recompute_weight`
//! while queues are short. The extra weight is small because queue waits are estimated from
//! queued prefill tokens, which undercount a backlogged replica's real wait (decode steps, a
//! full KV cache): on the Mooncake conversation trace at twice its rate (`kvlb simulate`, a
//! fleet past saturation), 0.1 raises the hit rate from 0.058 to 0.068 and keeps p99 TTFT the
//! best of all policies; 1 keeps more hits (0.072) but lets the busiest replica drift
//! (max/mean prefill 1.07) and p99 with it.
//!
//! **Several kvlb instances, one fleet.** `Candidate` carries kvlb's own counts and, in
//! `reported`, what the replica's /metrics last said of the requests this instance did not send
//! and of its KV usage. While that figure is fresh (three scrape intervals),
//! `estimate::reported::combined_load` adds the foreign requests to the load (foreign running
//! ones as decoders, foreign waiting ones as `foreign_request_tokens` of queued prefill each),
//! and `estimate::reported::hit_keep` scales the matched tokens of a replica above
//! `kv_evict_from` KV usage down towards `kv_hit_keep_at_full` at 100%: it is evicting, its hit
//! may be gone. The reasoning (why own-now plus foreign-at-scrape rather than a max or a sum,
//! why usage discounts hits rather than adding a queue penalty) is in `estimate::reported`.
//! Two instances thus agree: each counts its own requests at once, the other's from the
//! replica's figures, and both read the same residency from the replica's KV events.
//!
//! | knob | default | meaning |
//! |---|---|---|
//! | `foreign_request_tokens` | 1024 | prefill tokens assumed per reported waiting request not ours |
//! | `kv_evict_from` | 0.9 | KV usage above which a replica's hits count for less |
//! | `kv_hit_keep_at_full` | 0.5 | share of a hit still counted at 100% KV usage |
//!
//! **Offloaded KV blocks.** Engines that offload KV blocks out of GPU memory (vLLM's CPU
//! offloading, LMCache, SGLang's hierarchical cache) report them in KV events with a `medium`
//! other than GPU; the telemetry thread keeps them in a second residency index, the offloaded
//! tier (`with_offload_tier`). Such a block must be loaded back before the request can use it:
//! cheaper than recomputing it, not free. Per replica the policy takes
//!
//! ```text
//! gpu(r)  = match_prefix(blocks)[r] over the GPU tier            (as above)
//! held(r) = max(gpu(r), match_prefix(blocks)[r] over the offloaded tier)
//! prefill = prefill(the tokens past held) + offload_load_cost * prefill(the tokens in held, not in gpu)
//! ```
//!
//! (`TtftModel::prefill_seconds_tiered`; `min_match_tokens` and the KV-usage discount apply to
//! `held`). `held` is the larger of the two leading matches, not the offloaded match extended
//! from where the GPU match ends: both come out of one pass each over the request's blocks
//! with no per-replica restart, and they agree in the usual case, where the offloaded tier
//! holds what the GPU evicted and the prefix before it (offloading engines typically copy
//! blocks out as they are computed, prefix first). When the offloaded tier holds only a tail beyond the GPU match, `max` counts the
//! longer of the two runs alone and underestimates the hit; it never overestimates one.
//! While no replica holds any offloaded block (one atomic load, `distinct_blocks`), the second
//! lookup is skipped; when it runs it fills a buffer allocated with the policy.
//! `Decision::offloaded_blocks` says how many of the chosen replica's matched blocks came from
//! the offloaded tier, and `Decision::matched_tokens` counts them at `1 - offload_load_cost` of
//! their size (the work the replica is spared, which the worker subtracts from its queued
//! prefill).
//!
//! | knob | default | meaning |
//! |---|---|---|
//! | `offload_load_cost` | 0.25 | loading an offloaded block back, as a fraction of recomputing it |
//!
//! **Load input.** The policy is only as good as `Candidate::queued_prefill_tokens`. Counting
//! the tokens a request will actually compute there (`prompt_tokens -
//! Decision::matched_tokens`) rather than its whole prompt keeps a warm replica from looking
//! busier than it is; the simulations count that way.
//!
//! Each `select` leaves a `Decision` (`last_decision`) for an explain header and metrics, and,
//! when a routing log is attached, records the request's blocks for the residency writer.

#![forbid(unsafe_code)]

use super::{Candidate, PdPath, Policy, RequestView};
use crate::estimate::reported::{combined_load, hit_keep};
use crate::estimate::{Pace, ReplicaLoad, Seconds, TtftModel};
use crate::residency::{ResidencyIndex, RoutingLog};
use std::sync::Arc;

/// The policy's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// The time-to-first-token model (defaults: the simulated engine's calibration).
    pub model: TtftModel,
    /// Matches shorter than this many tokens count as no match.
    pub min_match_tokens: u32,
    /// Weight of the request's own prefill against queueing in the argmin (1 = plain TTFT).
    /// Above 1, prefill work also counts for the requests it will delay on that replica.
    pub recompute_weight: f64,
    /// Added to `recompute_weight` for each request waiting per candidate (not yet at its
    /// first token, fleet mean) beyond the first: prefill work done while the fleet is
    /// backlogged delays the requests arriving until the backlog drains.
    pub backlog_weight: f64,
    /// Candidates whose score is within this many seconds of the best are equal.
    pub tie_epsilon_s: f64,
    /// A prefix shared by at least this many recent requests (per policy instance) is hot.
    pub hot_prefix_requests: u32,
    /// The hotness counts halve every this many seconds.
    pub hot_window_s: f64,
    /// A hot prefix's holder is saturated when its queue wait exceeds the shortest candidate
    /// wait by more than this many seconds; its hit is then ignored.
    pub hot_spill_wait_s: f64,
    /// Prefill tokens assumed for each request a replica reports waiting that this instance
    /// did not send.
    pub foreign_request_tokens: u32,
    /// Reported KV usage (0..1) above which a replica's cache hits count for less.
    pub kv_evict_from: f64,
    /// The share of a hit still counted at 100% KV usage (0..=1).
    pub kv_hit_keep_at_full: f64,
    /// Loading a block back from an offloaded tier (CPU memory, disk) costs this fraction of
    /// recomputing it (0..=1; 0 prices it as a GPU hit, 1 as no hit at all).
    pub offload_load_cost: f64,
    /// The requests each replica was sent count for this many seconds (a decaying count):
    /// their rate says how many requests a prefill there would hold up.
    pub arrival_window_s: f64,
    /// Price each replica at its measured pace (`Candidate::pace`); false: at the model's
    /// configured speed.
    pub calibrated: bool,
    /// Seconds to move one prompt token's KV cache from a prefill replica to a decode replica
    /// (`PdPath::Prefill`): KV bytes per token over the link's bytes per second.
    pub kv_transfer_s_per_token: f64,
    /// Weight, in the score of a decode leg's replica (`PdPath::Decode`), of the decode time
    /// it spends there and adds to the sequences beside it (1: seconds as they come).
    pub decode_weight: f64,
}

impl Default for CacheAwareConfig {
    fn default() -> CacheAwareConfig {
        CacheAwareConfig {
            model: TtftModel::default(),
            min_match_tokens: 256,
            recompute_weight: 2.0,
            backlog_weight: 0.1,
            tie_epsilon_s: 0.001,
            hot_prefix_requests: 8,
            hot_window_s: 10.0,
            hot_spill_wait_s: 0.1,
            foreign_request_tokens: 1024,
            kv_evict_from: 0.9,
            kv_hit_keep_at_full: 0.5,
            offload_load_cost: 0.25,
            arrival_window_s: 10.0,
            calibrated: true,
            // 128 KiB a token (an 8B model: 32 layers x 8 KV heads x 128 x 2 x 2 bytes) over a
            // 25 GB/s link (RDMA between nodes, as NIXL reaches): 5.24e-6, rounded.
            kv_transfer_s_per_token: 0.0000052,
            decode_weight: 1.0,
        }
    }
}

impl CacheAwareConfig {
    /// Check the knobs; the error names the knob and its bad value.
    pub fn validate(&self) -> Result<(), String> {
        self.model.validate()?;
        if !(self.recompute_weight.is_finite() && self.recompute_weight >= 1.0) {
            return Err(format!(
                "cache_aware recompute_weight must be a finite number >= 1, got {}",
                self.recompute_weight
            ));
        }
        if !(self.backlog_weight.is_finite() && self.backlog_weight >= 0.0) {
            return Err(format!(
                "cache_aware backlog_weight must be a finite number >= 0, got {}",
                self.backlog_weight
            ));
        }
        for (name, v) in [
            ("tie_epsilon_s", self.tie_epsilon_s),
            ("hot_window_s", self.hot_window_s),
            ("hot_spill_wait_s", self.hot_spill_wait_s),
            ("arrival_window_s", self.arrival_window_s),
            ("kv_transfer_s_per_token", self.kv_transfer_s_per_token),
            ("decode_weight", self.decode_weight),
        ] {
            if v.is_nan() || v < 0.0 {
                return Err(format!("cache_aware {name} must be >= 0, got {v}"));
            }
        }
        for (name, v) in [
            ("kv_evict_from", self.kv_evict_from),
            ("kv_hit_keep_at_full", self.kv_hit_keep_at_full),
            ("offload_load_cost", self.offload_load_cost),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("cache_aware {name} must be within 0..=1, got {v}"));
            }
        }
        for (name, v) in [
            ("hot_window_s", self.hot_window_s),
            ("arrival_window_s", self.arrival_window_s),
        ] {
            if v == 0.0 {
                return Err(format!("cache_aware {name} must be > 0, got 0"));
            }
        }
        Ok(())
    }
}

/// Declares every parameter once, by name and field: [`PARAMETERS`] and
/// [`CacheAwareConfig::set`] both come from this list.
macro_rules! parameters {
    ($($name:literal => $kind:ident $($field:ident).+;)*) => {
        /// Every parameter of the policy and of its TTFT model by name: `kvlb simulate --set
        /// NAME=X` changes any of them for an ablation, while `kvlb serve` exposes only the few
        /// an operator sets (docs/cost-model.md says which and why the rest are fixed).
        pub const PARAMETERS: &[&str] = &[$($name),*];

        impl CacheAwareConfig {
            /// Set the parameter `name` (one of [`PARAMETERS`]) to `v`, then check the whole
            /// configuration; whole-number parameters take a whole `v`.
            pub fn set(&mut self, name: &str, v: f64) -> Result<(), String> {
                match name {
                    $($name => self.$($field).+ = parameters!(@$kind name v),)*
                    _ => {
                        return Err(format!(
                            "unknown parameter {name:?}; known: {}",
                            PARAMETERS.join(", ")
                        ))
                    }
                }
                self.validate()
            }
        }
    };
    (@real $name:ident $v:ident) => {
        $v
    };
    (@whole $name:ident $v:ident) => {
        whole_parameter($name, $v)?
    };
}

/// `v` as a whole-number parameter's value.
fn whole_parameter(name: &str, v: f64) -> Result<u32, String> {
    if v.fract() == 0.0 && (0.0..=u32::MAX as f64).contains(&v) {
        Ok(v as u32)
    } else {
        Err(format!("{name} takes a whole number, got {v}"))
    }
}

parameters! {
    "min_match_tokens" => whole min_match_tokens;
    "recompute_weight" => real recompute_weight;
    "backlog_weight" => real backlog_weight;
    "tie_epsilon_s" => real tie_epsilon_s;
    "hot_prefix_requests" => whole hot_prefix_requests;
    "hot_window_s" => real hot_window_s;
    "hot_spill_wait_s" => real hot_spill_wait_s;
    "foreign_request_tokens" => whole foreign_request_tokens;
    "kv_evict_from" => real kv_evict_from;
    "kv_hit_keep_at_full" => real kv_hit_keep_at_full;
    "offload_load_cost" => real offload_load_cost;
    "arrival_window_s" => real arrival_window_s;
    "kv_transfer_s_per_token" => real kv_transfer_s_per_token;
    "decode_weight" => real decode_weight;
    "prefill_a_s" => real model.prefill.a;
    "prefill_b_s" => real model.prefill.b;
    "prefill_c_s" => real model.prefill.c;
    "chunk_tokens" => whole model.prefill.chunk_tokens;
    "queued_context_tokens" => whole model.prefill.queued_context_tokens;
    "decode_base_s" => real model.decode.base;
    "decode_per_seq_s" => real model.decode.per_seq;
    "decode_per_ctx_token_s" => real model.decode.per_ctx_token;
    "context_tokens" => whole model.decode.context_tokens;
    "max_num_seqs" => whole model.decode.max_num_seqs;
    "mean_output_tokens" => whole model.decode.mean_output_tokens;
}

/// Why a replica was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reason {
    /// It holds a useful part of the prompt (in GPU memory or, loaded back at a cost, in an
    /// offloaded tier) and that made it the best estimate.
    Cache,
    /// No useful match counted: chosen for its load.
    Load,
    /// The request carried no prefix blocks: chosen by load alone.
    #[default]
    Fallback,
    /// The request continues a stored response (`previous_response_id`): sent to the
    /// replica that stored it, ahead of any estimate.
    Affinity,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Cache => "cache",
            Reason::Load => "load",
            Reason::Fallback => "fallback",
            Reason::Affinity => "affinity",
        }
    }
}

/// What the last `select` decided, for explain headers and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Decision {
    /// The chosen replica (fleet index, `Candidate::replica`).
    pub replica: usize,
    /// Prompt tokens counted as resident on it: its GPU match, plus its offloaded-only match
    /// at `1 - offload_load_cost` of its size (both after the KV-usage discount).
    pub matched_tokens: u32,
    /// Leading blocks of the prompt the chosen replica holds only in its offloaded tier (CPU,
    /// disk), counted in `matched_tokens` at a discount; 0 when none counted.
    pub offloaded_blocks: u32,
    /// Estimated seconds to first token there: `wait.waited_at(pace) + prefill.at(pace) +
    /// fixed_s`; for a decode leg (`PdPath::Decode`), its wait and transfer and one decode
    /// step (`prefill` is then the prompt it lacks there, priced in the score alone).
    pub ttft_s: f64,
    /// That estimate's seconds at the configured speed (queue wait, own prefill), what no pace
    /// scales (an adapter load), and the replica's pace: what calibration learns from.
    pub wait: Seconds,
    pub prefill: Seconds,
    pub fixed_s: f64,
    pub pace: Pace,
    /// Seconds of one decode step on the chosen replica at the configured speed, with the
    /// sequences decoding there now (what its streams' event spacing is measured against).
    pub decode_step_s: f64,
    /// The best estimate among the other candidates (infinite with a single candidate).
    pub runner_up_ttft_s: f64,
    pub reason: Reason,
    /// A hot prefix's saturated holder had its hit ignored for this request.
    pub spilled: bool,
}

const HOT_SLOTS: usize = 4096;
/// Prompts whose every block is already resident on the replica chosen are logged for the
/// residency writer at most once per this interval (per replica and prefix): enough to keep
/// a hot prefix fresh in the writer's LRU order and TTL, without handing it the same blocks on
/// every request of a hot prefix.
const RELOG_RESIDENT_US: u64 = 1_000_000;
const LOGGED_SLOTS: usize = 4096;

#[derive(Debug, Clone, Copy, Default)]
struct Estimate {
    wait: f64,
    /// The wait's seconds at the configured speed, and the seconds no pace scales.
    wait_parts: Seconds,
    fixed: f64,
    /// The replica's pace (`Candidate::pace`).
    pace: Pace,
    /// The weight of its prefill in `score` (`prefill_weight`, by how busy it is).
    weight: f64,
    /// The prefill's seconds at the configured speed.
    prefill_parts: Seconds,
    /// Sequences decoding there, ours and reported (they slow the request's prefill steps).
    decoding: u32,
    /// Leading prompt tokens held in GPU or offloaded memory (after `min_match_tokens` and
    /// the KV-usage discount), and the GPU part of them.
    matched_tokens: u32,
    gpu_tokens: u32,
    /// Leading blocks held in GPU or offloaded memory, and the GPU part of them.
    held_blocks: u32,
    gpu_blocks: u32,
    ttft: f64,
    /// What the argmin compares: `wait + weight * prefill` (see `prefill_weight`).
    score: f64,
}

pub struct CacheAware {
    index: Arc<ResidencyIndex>,
    cfg: CacheAwareConfig,
    log: Option<Arc<RoutingLog>>,
    matched: Vec<u32>,
    /// The offloaded tier (blocks the replicas reported on CPU, disk, ...) and the buffer its
    /// matches go into, allocated with the policy.
    offload: Option<Arc<ResidencyIndex>>,
    offload_matched: Vec<u32>,
    estimates: Vec<Estimate>,
    hot: Box<[u32; HOT_SLOTS]>,
    hot_window_start_us: u64,
    last: Decision,
    /// When each (replica, last block) was last logged while fully resident: key, time in us.
    logged: Box<[(u64, u64); LOGGED_SLOTS]>,
    arrivals: Arrivals,
}

/// How many requests each replica was sent lately, by a count decaying over
/// `arrival_window_s`, read from `Candidate::routed` (counted over every worker): their rate
/// says how many requests a prefill there would hold up.
struct Arrivals {
    /// Per replica: `Candidate::routed` when last read (`u64::MAX`: never), the decaying
    /// count, and when it was last decayed (us).
    seen: Vec<(u64, f64, u64)>,
    window_s: f64,
}

impl Arrivals {
    fn new(replicas: usize, window_s: f64) -> Arrivals {
        Arrivals {
            seen: vec![(u64::MAX, 0.0, 0); replicas],
            window_s,
        }
    }

    fn update(&mut self, candidates: &[Candidate], now_us: u64) {
        for c in candidates {
            let Some((routed, count, at_us)) = self.seen.get_mut(c.replica) else {
                continue;
            };
            if *routed == u64::MAX || c.routed < *routed {
                // First sight, or the slot took another replica: nothing known yet.
                (*routed, *count, *at_us) = (c.routed, 0.0, now_us);
                continue;
            }
            let dt = now_us.saturating_sub(*at_us);
            if dt > 0 {
                *count *= (-(dt as f64) * 1e-6 / self.window_s).exp();
                *at_us = now_us;
            }
            *count += (c.routed - *routed) as f64;
            *routed = c.routed;
        }
    }

    /// Requests per second sent to `replica` lately.
    fn rate(&self, replica: usize) -> f64 {
        self.seen
            .get(replica)
            .map_or(0.0, |&(_, count, _)| count / self.window_s)
    }

    /// The weight of a prefill on `c` against queueing, when its request would hold the
    /// replica for `seconds`: `full` (`prefill_weight`) when as many requests as that are
    /// expected to arrive there meanwhile, down to 1 (plain TTFT) on a replica nobody sends
    /// to, where the prefill delays nobody.
    fn weight(&self, c: &Candidate, full: f64, seconds: f64) -> f64 {
        let held_up = (self.rate(c.replica) * seconds).clamp(0.0, 1.0);
        1.0 + (full - 1.0) * held_up
    }
}

/// What a second of prefill counts against a second of queueing when the candidates have
/// `waiting` requests each on average that have not reached their first token.
pub fn prefill_weight(cfg: &CacheAwareConfig, waiting: f64) -> f64 {
    cfg.recompute_weight + cfg.backlog_weight * (waiting - 1.0).max(0.0)
}

fn hot_slot(block: u64) -> usize {
    (block.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as usize
}

impl CacheAware {
    /// A policy reading `index` (shared with its writer); `cfg` is validated.
    pub fn new(index: Arc<ResidencyIndex>, cfg: CacheAwareConfig) -> Result<CacheAware, String> {
        cfg.validate()?;
        let replicas = index.max_replicas();
        Ok(CacheAware {
            matched: vec![0; replicas],
            offload: None,
            offload_matched: Vec::new(),
            estimates: Vec::with_capacity(replicas),
            index,
            cfg,
            log: None,
            hot: Box::new([0; HOT_SLOTS]),
            hot_window_start_us: 0,
            last: Decision::default(),
            logged: Box::new([(0, 0); LOGGED_SLOTS]),
            arrivals: Arrivals::new(replicas, cfg.arrival_window_s),
        })
    }

    /// Record every routed request's blocks in `log` (this worker's routing log).
    pub fn with_routing_log(mut self, log: Arc<RoutingLog>) -> CacheAware {
        self.log = Some(log);
        self
    }

    /// Price prefixes `offload` holds (the replicas' offloaded KV tier) at `offload_load_cost`.
    pub fn with_offload_tier(mut self, offload: Arc<ResidencyIndex>) -> CacheAware {
        self.offload_matched = vec![0; offload.max_replicas()];
        self.offload = Some(offload);
        self
    }

    pub fn config(&self) -> &CacheAwareConfig {
        &self.cfg
    }

    /// The decision of the last `select`.
    pub fn last_decision(&self) -> Decision {
        self.last
    }

    /// Requests that recently shared the prefix ending with `block` (this instance's view).
    pub fn prefix_heat(&self, block: u64) -> u32 {
        self.hot[hot_slot(block)]
    }

    fn age_heat(&mut self, now_us: u64) {
        let window_us = (self.cfg.hot_window_s * 1e6) as u64;
        let elapsed = now_us.saturating_sub(self.hot_window_start_us);
        if elapsed < window_us.max(1) {
            return;
        }
        let halvings = (elapsed / window_us.max(1)).min(32) as u32;
        for c in self.hot.iter_mut() {
            *c = c.checked_shr(halvings).unwrap_or(0);
        }
        self.hot_window_start_us = now_us;
    }
}

impl Policy for CacheAware {
    fn decision(&self) -> Option<Decision> {
        Some(self.last)
    }

    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn select(&mut self, req: &RequestView<'_>, candidates: &[Candidate], random: u64) -> usize {
        if candidates.is_empty() {
            self.last = Decision::default();
            return 0;
        }
        let cfg = self.cfg;
        let prompt = req.prompt_tokens;
        let with_prefix = !req.blocks.is_empty() && req.block_tokens > 0;
        if with_prefix {
            self.index.match_prefix(req.blocks, &mut self.matched);
            self.age_heat(req.now_us);
        }
        // The offloaded tier only while some replica holds an offloaded block.
        let offloaded = match &self.offload {
            Some(o) if with_prefix && o.distinct_blocks() > 0 => {
                o.match_prefix(req.blocks, &mut self.offload_matched);
                true
            }
            _ => false,
        };
        // Pass 1: waits and useful matches.
        self.estimates.clear();
        let (mut min_wait, mut longest) = (f64::INFINITY, 0u32);
        let mut waiting = 0u64;
        let now_ms = req.now_us / 1000;
        let now_us = req.now_us;
        self.arrivals.update(candidates, now_us);
        for c in candidates {
            let own = ReplicaLoad {
                queued_prefill_tokens: c.queued_prefill_tokens,
                decoding: c.decoding,
                in_flight: c.in_flight,
            };
            let load = combined_load(own, &c.reported, now_ms, cfg.foreign_request_tokens);
            let gpu_blocks = match self.matched.get(c.replica) {
                Some(&m) if with_prefix => m,
                _ => 0,
            };
            let held_blocks = match self.offload_matched.get(c.replica) {
                Some(&m) if offloaded => m.max(gpu_blocks),
                _ => gpu_blocks,
            };
            let as_tokens = |b: u32| (b as u64 * req.block_tokens as u64).min(prompt as u64) as u32;
            let (held, gpu) = (as_tokens(held_blocks), as_tokens(gpu_blocks));
            let (tokens, gpu_tokens) = if held < cfg.min_match_tokens.max(1) {
                (0, 0)
            } else {
                longest = longest.max(held_blocks);
                let keep = hit_keep(
                    &c.reported,
                    now_ms,
                    cfg.kv_evict_from,
                    cfg.kv_hit_keep_at_full,
                );
                ((held as f64 * keep) as u32, (gpu as f64 * keep) as u32)
            };
            // A decode leg's replica: the requests there awaiting their KV decode soon too.
            let load = match c.pd {
                PdPath::Decode => ReplicaLoad {
                    decoding: load.in_flight.max(load.decoding),
                    ..load
                },
                _ => load,
            };
            let mut wait_parts = cfg.model.queue_wait_parts(&load);
            if c.lora_slot_busy {
                wait_parts = wait_parts + cfg.model.lora_slot_wait_parts(load.decoding);
            }
            // A prefill replica's answer is the KV, which then moves to a decode replica.
            // A decode replica receives what it does not hold of the prompt.
            let transfer = match c.pd {
                PdPath::Prefill => prompt as f64 * cfg.kv_transfer_s_per_token,
                PdPath::Decode => prompt.saturating_sub(gpu) as f64 * cfg.kv_transfer_s_per_token,
                _ => 0.0,
            };
            let fixed = c.setup_us as f64 * 1e-6 + transfer;
            let pace = if cfg.calibrated {
                c.pace
            } else {
                Pace::CONFIGURED
            };
            let wait = wait_parts.waited_at(pace) + fixed;
            min_wait = min_wait.min(wait);
            waiting += load.in_flight.saturating_sub(load.decoding) as u64;
            self.estimates.push(Estimate {
                wait,
                wait_parts,
                fixed,
                pace,
                weight: 1.0,
                prefill_parts: Seconds::default(),
                decoding: load.decoding,
                matched_tokens: tokens,
                gpu_tokens,
                held_blocks,
                gpu_blocks,
                ttft: 0.0,
                score: 0.0,
            });
        }
        let weight = prefill_weight(&cfg, waiting as f64 / candidates.len() as f64);
        // Pass 2: anti-herding, then the estimates.
        let mut best_ignored = f64::INFINITY;
        let mut best = f64::INFINITY;
        for (e, c) in self.estimates.iter_mut().zip(candidates) {
            if e.matched_tokens > 0 && e.wait - min_wait > cfg.hot_spill_wait_s {
                let end = e.held_blocks as usize;
                let heat = self.hot[hot_slot(req.blocks[end - 1])];
                if heat >= cfg.hot_prefix_requests {
                    let parts = cfg.model.prefill_parts_tiered(
                        e.gpu_tokens,
                        e.matched_tokens,
                        prompt,
                        e.decoding,
                        cfg.offload_load_cost,
                    );
                    let credited = parts.at(e.pace);
                    let w = self.arrivals.weight(c, weight, e.wait + credited);
                    let score = e.wait + credited + (w - 1.0) * parts.held_up_at(e.pace);
                    best_ignored = best_ignored.min(score);
                    e.matched_tokens = 0;
                    e.gpu_tokens = 0;
                }
            }
            e.prefill_parts = cfg.model.prefill_parts_tiered(
                e.gpu_tokens,
                e.matched_tokens,
                prompt,
                e.decoding,
                cfg.offload_load_cost,
            );
            let prefill = e.prefill_parts.at(e.pace);
            e.weight = self.arrivals.weight(c, weight, e.wait + prefill);
            e.ttft = e.wait + prefill;
            // The requests it holds up meet it as queued work: at the queue's pace.
            e.score = e.ttft + (e.weight - 1.0) * e.prefill_parts.held_up_at(e.pace);
            if c.pd == PdPath::Direct {
                // A decode replica computing the prompt stalls each sequence it decodes for
                // as long (the inter-token latency disaggregation is there to protect).
                e.score += prefill * e.decoding as f64;
            }
            if c.pd == PdPath::Decode {
                // Its first token comes one step after its KV; the prompt it does not share
                // there stays in the score as recomputing it would cost (the KV it adds to the
                // resource that runs out first, and what a preemption there recomputes), and
                // so do its decode steps and what it adds to each step of those beside it.
                let m = &cfg.model;
                let (d, steps) = (e.decoding, m.decode.mean_output_tokens as f64);
                let own = m.decode_step_seconds(d + 1);
                let added = (own - m.decode_step_seconds(d)) * d as f64;
                e.ttft = e.wait + own;
                e.score += cfg.decode_weight * steps * (own + added);
            }
            if e.score < best {
                best = e.score;
            }
        }
        // Ties: the `random`-th of the candidates within epsilon of the best.
        let near = |t: f64| t <= best + cfg.tie_epsilon_s || t.is_nan() && best.is_nan();
        let ties = self
            .estimates
            .iter()
            .filter(|e| near(e.score))
            .count()
            .max(1);
        let mut k = (random % ties as u64) as usize;
        let mut chosen = 0;
        for (i, e) in self.estimates.iter().enumerate() {
            if near(e.score) {
                if k == 0 {
                    chosen = i;
                    break;
                }
                k -= 1;
            }
        }
        let runner_up = self
            .estimates
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != chosen)
            .map(|(_, e)| (e.score, e.ttft))
            .fold((f64::INFINITY, f64::INFINITY), |a, b| {
                if b.0 < a.0 {
                    b
                } else {
                    a
                }
            })
            .1;
        let e = self.estimates[chosen];
        if with_prefix && longest > 0 {
            // The request shared the prefix ending at block `longest - 1` with earlier ones.
            let slot = hot_slot(req.blocks[longest as usize - 1]);
            self.hot[slot] = self.hot[slot].saturating_add(1);
        }
        let replica = candidates[chosen].replica;
        if let (Some(log), true) = (&self.log, with_prefix) {
            let resident = self.matched.get(replica).copied().unwrap_or(0) as usize;
            let fresh = resident == req.blocks.len() && {
                let key =
                    req.blocks[resident - 1] ^ (replica as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let e = &mut self.logged[hot_slot(key) % LOGGED_SLOTS];
                let fresh = e.0 == key && req.now_us.saturating_sub(e.1) < RELOG_RESIDENT_US;
                if !fresh {
                    *e = (key, req.now_us);
                }
                fresh
            };
            if !fresh {
                log.record(replica, req.blocks);
            }
        }
        // What the replica is spared: the GPU match, and the offloaded-only part at the share
        // loading it back does not cost.
        let offloaded_only = e.matched_tokens.saturating_sub(e.gpu_tokens);
        let spared = e.gpu_tokens as f64 + offloaded_only as f64 * (1.0 - cfg.offload_load_cost);
        self.last = Decision {
            replica,
            matched_tokens: spared.round() as u32,
            offloaded_blocks: if e.matched_tokens > 0 {
                e.held_blocks - e.gpu_blocks
            } else {
                0
            },
            ttft_s: e.ttft,
            wait: e.wait_parts,
            prefill: e.prefill_parts,
            fixed_s: e.fixed,
            pace: e.pace,
            decode_step_s: cfg.model.decode_step_seconds(e.decoding + 1),
            runner_up_ttft_s: runner_up,
            reason: if !with_prefix {
                Reason::Fallback
            } else if spared >= 0.5 {
                Reason::Cache
            } else {
                Reason::Load
            },
            spilled: best_ignored < e.score,
        };
        chosen
    }
}

#[cfg(test)]
mod tests;
