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
//! **Pruning.** Pricing a replica (its prefill with the sequences decoding there, the weight
//! of what it holds up, the disaggregated paths) is most of a decision's work, and with a
//! thousand replicas most of them cannot win. So every replica first gets a lower bound on its
//! score (`Bound`: its queued tokens at the fewest seconds and decode steps a queued token can
//! take, its setup and transfer, and the prompt's prefill past its undiscounted match with
//! nothing decoding; every term left out is at least zero, and the bound is shaded by 1e-9 for
//! rounding). The two best bounds are priced; then, lowest bounds first and 16 at a time,
//! every replica whose bound reaches the best score (plus the tie margin) or the runner-up's,
//! as those fall; and every one whose wait may be short enough to make a hot prefix's holder
//! spill. The others could be neither chosen, nor tied, nor the runner-up, so the decision is
//! the one pricing every replica gives (`set_exhaustive`, which a kvlb-core test and a
//! kvlb-sim test run side by side with the pruned selection: no decision differs). A NaN bound
//! prices everyone. Reading every candidate's load and bounding it stays linear in the fleet.
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
    /// The candidate's index.
    candidate: usize,
    /// It was scored (pass 2); a replica priced only for its wait keeps an infinite score.
    scored: bool,
    /// Its load as the model sees it, and its leading matches in tokens (held in GPU or
    /// offloaded, in GPU) before `min_match_tokens` and the KV-usage discount.
    load: ReplicaLoad,
    held_match: u32,
    gpu_match: u32,
}

/// What pass 1 of `select` keeps of every candidate: the bounds on its wait and score
/// (`Bound`), its load and matches, and its `Estimate` once priced (`NONE` before).
#[derive(Debug, Clone, Copy)]
struct Slot {
    bound: f64,
    bound_wait: f64,
    load: ReplicaLoad,
    held_match: u32,
    gpu_match: u32,
    held_blocks: u32,
    gpu_blocks: u32,
    estimate: u32,
}

const NONE: u32 = u32::MAX;

/// Lower bounds on the wait and the score of a replica holding no useful part of a prompt,
/// for one request: its queued prefill tokens at the fewest seconds a token can take in a
/// queue (whole chunks, no decode step), plus what it must do first and the transfer, plus
/// the prompt's prefill with no sequence decoding beside it. Every other term of a score is
/// at least zero (weights at least 1, paces and model terms at least zero, validated), and
/// each term grows with what it leaves out, so the bound is below the score; it is shaded
/// by a relative 1e-9 besides, far more than the rounding of either. Replicas whose bound
/// exceeds what the best priced replicas cost are never priced: `select` decides as it
/// would with every replica priced (`CacheAware::exhaustive`, the tests' reference).
struct Bound {
    /// Seconds per queued prefill token, at least.
    queue_s_per_token: f64,
    /// Prefill steps per queued token, at least (a whole chunk each).
    steps_per_token: f64,
    /// The prompt's prefill with nothing decoding and the last number of tokens asked
    /// about cached (most replicas hold nothing, or the same shared prefix).
    prefill: (u32, Seconds, f64),
    /// The model's terms are finite and at least zero.
    valid: bool,
}

const SHADE: f64 = 1.0 - 1e-9;

impl Bound {
    fn new(cfg: &CacheAwareConfig, prompt: u32) -> Bound {
        let p = &cfg.model.prefill;
        let chunk = p.chunk_tokens.max(1) as f64;
        let queue_s_per_token = p.a / chunk + p.b + p.c * p.queued_context_tokens as f64;
        let prefill = cfg.model.prefill_parts(0, prompt, 0);
        let valid = [
            p.a,
            p.b,
            p.c,
            cfg.kv_transfer_s_per_token,
            cfg.offload_load_cost,
        ]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0)
            && queue_s_per_token.is_finite()
            && prefill.prefill.is_finite()
            && prefill.prefill >= 0.0
            && prefill.decode.is_finite()
            && prefill.decode >= 0.0;
        Bound {
            queue_s_per_token,
            steps_per_token: 1.0 / chunk,
            prefill: (0, prefill, prefill_steps(&cfg.model, 0, prompt)),
            valid,
        }
    }

    /// (wait, score) bounds of candidate `c` with `load`, holding `held` leading tokens of
    /// the prompt (`gpu` of them in GPU memory) before `min_match_tokens` and the KV-usage
    /// discount, which only lower a match (NaN when its pace is not a positive number: it is
    /// then priced). The prefill it is spared is at most that of `held` tokens, loaded back
    /// from an offloaded tier for free.
    #[allow(clippy::too_many_arguments)]
    fn of(
        &mut self,
        cfg: &CacheAwareConfig,
        c: &Candidate,
        load: &ReplicaLoad,
        prompt: u32,
        held: u32,
        gpu: u32,
        pace: Pace,
    ) -> (f64, f64) {
        let (pq, pp, pd) = (pace.queue as f64, pace.prefill as f64, pace.decode as f64);
        if !(pq >= 0.0
            && pp >= 0.0
            && pd >= 0.0
            && pq.is_finite()
            && pp.is_finite()
            && pd.is_finite())
        {
            return (f64::NAN, f64::NAN);
        }
        let m = &cfg.model;
        let fixed = c.setup_us as f64 * 1e-6 + transfer(cfg, c, prompt, gpu);
        // The queue: its prefill seconds, and a decode step with the replica's sequences
        // for each of its steps (at least one per chunk), and the batch's excess as
        // `queue_wait_parts` counts it.
        let q = load.queued_prefill_tokens as f64;
        let step = m.decode_step_seconds(load.decoding);
        let max_seqs = m.decode.max_num_seqs.max(1) as u64;
        let excess = (load.in_flight as u64 + 1).saturating_sub(max_seqs);
        let excess = if excess > 0 {
            excess as f64 / max_seqs as f64
                * m.decode.mean_output_tokens as f64
                * m.decode_step_seconds(load.decoding.max(1))
        } else {
            0.0
        };
        let wait = q * self.queue_s_per_token * pq
            + (q * self.steps_per_token * step + excess) * pd
            + fixed;
        if self.prefill.0 != held {
            self.prefill = (
                held,
                m.prefill_parts(held, prompt, 0),
                prefill_steps(m, held, prompt),
            );
        }
        let (_, prefill, steps) = self.prefill;
        // Its own prefill: at least as many steps as with nothing decoding, each with a
        // decode step of the replica's sequences.
        let score = wait + prefill.prefill * pp + steps * step * pd;
        (wait * SHADE, score * SHADE)
    }
}

/// The steps of a prefill of `prompt` tokens past `matched` cached ones with nothing decoding
/// (`TtftModel::prefill_parts`): decoding sequences only take room, so never fewer.
fn prefill_steps(m: &TtftModel, matched: u32, prompt: u32) -> f64 {
    let matched = matched.min(prompt.saturating_sub(1));
    let n = (prompt - matched.min(prompt)).max(1) as f64;
    (n / m.prefill_room(0)).ceil().max(1.0)
}

/// `a > b`, or either is NaN: a NaN bound rules nothing out.
#[allow(clippy::neg_cmp_op_on_partial_ord)]
fn exceeds(a: f64, b: f64) -> bool {
    !(a <= b)
}

/// `a > b`, neither NaN: a bound above the reach rules its replica out.
fn above(a: f64, b: f64) -> bool {
    a > b
}

/// The lowest score seen and the next one (ties count twice), as `select` compares them.
#[derive(Default)]
struct Scored {
    best: f64,
    second: f64,
    seen: bool,
}

impl Scored {
    fn add(&mut self, score: f64) {
        if !self.seen {
            (self.best, self.second, self.seen) = (f64::INFINITY, f64::INFINITY, true);
        }
        if score < self.best {
            self.second = self.best;
            self.best = score;
        } else if score < self.second {
            self.second = score;
        }
    }

    /// Replicas scoring up to this may be among the ties of the best or be the runner-up.
    fn reach(&self, epsilon: f64) -> f64 {
        (self.best + epsilon).max(self.second)
    }
}

/// A decode leg's replica: the requests there awaiting their KV decode soon too.
fn decode_leg_load(c: &Candidate, load: ReplicaLoad) -> ReplicaLoad {
    match c.pd {
        PdPath::Decode => ReplicaLoad {
            decoding: load.in_flight.max(load.decoding),
            ..load
        },
        _ => load,
    }
}

/// Seconds to move the KV cache a request needs on `c`: a prefill replica's answer is the
/// KV, which then moves to a decode replica; a decode replica receives what it does not hold
/// of the prompt (`gpu` tokens it holds).
fn transfer(cfg: &CacheAwareConfig, c: &Candidate, prompt: u32, gpu: u32) -> f64 {
    match c.pd {
        PdPath::Prefill => prompt as f64 * cfg.kv_transfer_s_per_token,
        PdPath::Decode => prompt.saturating_sub(gpu) as f64 * cfg.kv_transfer_s_per_token,
        _ => 0.0,
    }
}

/// The useful match of `c` (after `min_match_tokens` and the KV-usage discount) and its wait
/// (its load in `e.load`): queue, adapter slot, setup and transfer.
fn price_wait(cfg: &CacheAwareConfig, e: &mut Estimate, c: &Candidate, prompt: u32, now_ms: u64) {
    (e.matched_tokens, e.gpu_tokens) = if e.held_match < cfg.min_match_tokens.max(1) {
        (0, 0)
    } else {
        let keep = hit_keep(
            &c.reported,
            now_ms,
            cfg.kv_evict_from,
            cfg.kv_hit_keep_at_full,
        );
        (
            (e.held_match as f64 * keep) as u32,
            (e.gpu_match as f64 * keep) as u32,
        )
    };
    let load = e.load;
    let mut wait_parts = cfg.model.queue_wait_parts(&load);
    if c.lora_slot_busy {
        wait_parts = wait_parts + cfg.model.lora_slot_wait_parts(load.decoding);
    }
    let fixed = c.setup_us as f64 * 1e-6 + transfer(cfg, c, prompt, e.gpu_match);
    let pace = if cfg.calibrated {
        c.pace
    } else {
        Pace::CONFIGURED
    };
    e.wait = wait_parts.waited_at(pace) + fixed;
    e.wait_parts = wait_parts;
    e.fixed = fixed;
    e.pace = pace;
    e.weight = 1.0;
    e.decoding = load.decoding;
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
    /// Per candidate, what pass 1 learned; the estimates to score in a round of pass 2.
    slots: Vec<Slot>,
    picked: Vec<u32>,
    hot: Box<[u32; HOT_SLOTS]>,
    hot_window_start_us: u64,
    last: Decision,
    /// When each (replica, last block) was last logged while fully resident: key, time in us.
    logged: Box<[(u64, u64); LOGGED_SLOTS]>,
    arrivals: Arrivals,
    /// Price every replica (no bound prunes any): the tests' reference.
    exhaustive: bool,
}

/// How many requests each replica was sent lately, by a count decaying over
/// `arrival_window_s`, read from `Candidate::routed` (counted over every worker): their rate
/// says how many requests a prefill there would hold up.
struct Arrivals {
    /// Per replica: `Candidate::routed` when last read (`u64::MAX`: never), the decaying
    /// count, and when it was last decayed (us).
    seen: Vec<(u64, f64, u64)>,
    window_s: f64,
    /// The last decay computed: elapsed us and its factor (most replicas were last read at
    /// the same time, so one `exp` serves them all).
    decay: (u64, f64),
}

impl Arrivals {
    fn new(replicas: usize, window_s: f64) -> Arrivals {
        Arrivals {
            seen: vec![(u64::MAX, 0.0, 0); replicas],
            window_s,
            decay: (0, 1.0),
        }
    }

    /// Read `c.routed` at `now_us` (every candidate of a request, before any `weight`).
    #[inline]
    fn update(&mut self, c: &Candidate, now_us: u64) {
        let Some((routed, count, at_us)) = self.seen.get_mut(c.replica) else {
            return;
        };
        if *routed == u64::MAX || c.routed < *routed {
            // First sight, or the slot took another replica: nothing known yet.
            (*routed, *count, *at_us) = (c.routed, 0.0, now_us);
            return;
        }
        let dt = now_us.saturating_sub(*at_us);
        if dt > 0 {
            if self.decay.0 != dt {
                self.decay = (dt, (-(dt as f64) * 1e-6 / self.window_s).exp());
            }
            *count *= self.decay.1;
            *at_us = now_us;
        }
        *count += (c.routed - *routed) as f64;
        *routed = c.routed;
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
            slots: Vec::with_capacity(replicas),
            picked: Vec::with_capacity(replicas),
            index,
            cfg,
            log: None,
            hot: Box::new([0; HOT_SLOTS]),
            hot_window_start_us: 0,
            last: Decision::default(),
            logged: Box::new([(0, 0); LOGGED_SLOTS]),
            arrivals: Arrivals::new(replicas, cfg.arrival_window_s),
            exhaustive: false,
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

    /// Price every replica, as if no bound pruned any: the reference the pruned selection is
    /// tested against (it decides the same, only slower with many replicas).
    pub fn set_exhaustive(&mut self, exhaustive: bool) {
        self.exhaustive = exhaustive;
    }

    /// Pass 2 of `select` for one priced replica: anti-herding (a hot prefix's saturated
    /// holder loses its hit), then its estimate and score. Returns the score its ignored hit
    /// would have had (infinite when none was ignored).
    #[allow(clippy::too_many_arguments)]
    fn score(
        cfg: &CacheAwareConfig,
        hot: &[u32; HOT_SLOTS],
        arrivals: &Arrivals,
        e: &mut Estimate,
        c: &Candidate,
        req: &RequestView<'_>,
        weight: f64,
        min_wait: f64,
    ) -> f64 {
        let prompt = req.prompt_tokens;
        let mut ignored = f64::INFINITY;
        if e.matched_tokens > 0 && e.wait - min_wait > cfg.hot_spill_wait_s {
            let end = e.held_blocks as usize;
            let heat = hot[hot_slot(req.blocks[end - 1])];
            if heat >= cfg.hot_prefix_requests {
                let parts = cfg.model.prefill_parts_tiered(
                    e.gpu_tokens,
                    e.matched_tokens,
                    prompt,
                    e.decoding,
                    cfg.offload_load_cost,
                );
                let credited = parts.at(e.pace);
                let w = arrivals.weight(c, weight, e.wait + credited);
                ignored = e.wait + credited + (w - 1.0) * parts.held_up_at(e.pace);
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
        e.weight = arrivals.weight(c, weight, e.wait + prefill);
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
        ignored
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
        // Pass 1: every replica's load, match and a lower bound on its score (`Bound`), in a
        // compact slot; a full `Estimate` only for the replicas priced below.
        self.slots.clear();
        self.estimates.clear();
        let mut longest = 0u32;
        let mut waiting = 0u64;
        let now_ms = req.now_us / 1000;
        let now_us = req.now_us;
        let mut bound = Bound::new(&cfg, prompt);
        let mut price_all = self.exhaustive || !bound.valid;
        let (mut first, mut second) = ((f64::INFINITY, usize::MAX), (f64::INFINITY, usize::MAX));
        for (i, c) in candidates.iter().enumerate() {
            self.arrivals.update(c, now_us);
            let own = ReplicaLoad {
                queued_prefill_tokens: c.queued_prefill_tokens,
                decoding: c.decoding,
                in_flight: c.in_flight,
            };
            let load = decode_leg_load(
                c,
                combined_load(own, &c.reported, now_ms, cfg.foreign_request_tokens),
            );
            waiting += load.in_flight.saturating_sub(load.decoding) as u64;
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
            if held >= cfg.min_match_tokens.max(1) {
                longest = longest.max(held_blocks);
            }
            let pace = if cfg.calibrated {
                c.pace
            } else {
                Pace::CONFIGURED
            };
            let (bound_wait, lower) = bound.of(&cfg, c, &load, prompt, held, gpu, pace);
            if lower.is_nan() {
                price_all = true;
            }
            if lower < second.0 {
                second = if lower < first.0 { first } else { (lower, i) };
                if lower < first.0 {
                    first = (lower, i);
                }
            }
            self.slots.push(Slot {
                bound: lower,
                bound_wait,
                load,
                held_match: held,
                gpu_match: gpu,
                held_blocks,
                gpu_blocks,
                estimate: NONE,
            });
        }
        let weight = prefill_weight(&cfg, waiting as f64 / candidates.len() as f64);
        // Pass 2, over the replicas that may be chosen, tied with the chosen one or be the
        // runner-up: first the two best bounds (every replica when `price_all`), then every
        // replica whose bound reaches what the priced ones score, until none is left. A hot
        // prefix's holder loses its hit when its wait exceeds the shortest one by
        // `hot_spill_wait_s`: before any is scored, the waits that may decide that are known
        // (a bound says how short a wait can be). A replica left unscored could be neither
        // chosen, nor tied, nor the runner-up.
        let (hot, arrivals) = (&self.hot, &self.arrivals);
        let (slots, estimates, picked) = (&mut self.slots, &mut self.estimates, &mut self.picked);
        let is_hot = |e: &Estimate| {
            e.matched_tokens > 0
                && hot[hot_slot(req.blocks[e.held_blocks as usize - 1])] >= cfg.hot_prefix_requests
        };
        let price = |slots: &mut [Slot], estimates: &mut Vec<Estimate>, i: usize| -> usize {
            let slot = &mut slots[i];
            if slot.estimate == NONE {
                slot.estimate = estimates.len() as u32;
                let mut e = Estimate {
                    candidate: i,
                    held_blocks: slot.held_blocks,
                    gpu_blocks: slot.gpu_blocks,
                    held_match: slot.held_match,
                    gpu_match: slot.gpu_match,
                    load: slot.load,
                    score: f64::INFINITY,
                    ttft: f64::INFINITY,
                    ..Estimate::default()
                };
                price_wait(&cfg, &mut e, &candidates[i], prompt, now_ms);
                estimates.push(e);
            }
            slot.estimate as usize
        };
        let mut best_ignored = f64::INFINITY;
        let mut scored = Scored::default();
        let (mut hot_wait, mut min_wait) = (f64::NEG_INFINITY, f64::INFINITY);
        let mut reach = f64::INFINITY;
        let mut round = 0;
        loop {
            picked.clear();
            for i in 0..slots.len() {
                let take = if price_all || round > 0 && reach == f64::INFINITY {
                    true
                } else if round == 0 {
                    i == first.1 || i == second.1
                } else {
                    !above(slots[i].bound, reach)
                };
                if !take {
                    continue;
                }
                let k = price(slots, estimates, i);
                let e = &estimates[k];
                if e.scored {
                    continue;
                }
                min_wait = min_wait.min(e.wait);
                if is_hot(e) {
                    hot_wait = hot_wait.max(e.wait);
                }
                picked.push(k as u32);
            }
            if picked.is_empty() {
                break;
            }
            if hot_wait > f64::NEG_INFINITY {
                for i in 0..slots.len() {
                    if slots[i].estimate == NONE
                        && exceeds(hot_wait - slots[i].bound_wait, cfg.hot_spill_wait_s)
                    {
                        let k = price(slots, estimates, i);
                        min_wait = min_wait.min(estimates[k].wait);
                    }
                }
            }
            for &k in picked.iter() {
                let e = &mut estimates[k as usize];
                let c = &candidates[e.candidate];
                let ignored = Self::score(&cfg, hot, arrivals, e, c, req, weight, min_wait);
                best_ignored = best_ignored.min(ignored);
                scored.add(e.score);
                e.scored = true;
            }
            if price_all {
                break;
            }
            reach = if scored.best.is_finite() && scored.second.is_finite() {
                scored.reach(cfg.tie_epsilon_s)
            } else {
                f64::INFINITY
            };
            round += 1;
        }
        // In the candidates' order, as the ties and the runner-up are taken.
        estimates.sort_unstable_by_key(|e| e.candidate);
        let best = scored.best;
        // Ties: the `random`-th of the candidates within epsilon of the best.
        let near = |t: f64| t <= best + cfg.tie_epsilon_s || t.is_nan() && best.is_nan();
        let ties = estimates.iter().filter(|e| near(e.score)).count().max(1);
        let mut k = (random % ties as u64) as usize;
        let mut chosen = 0;
        for (i, e) in estimates.iter().enumerate() {
            if near(e.score) {
                if k == 0 {
                    chosen = i;
                    break;
                }
                k -= 1;
            }
        }
        let runner_up = estimates
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
        let chosen = e.candidate;
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
