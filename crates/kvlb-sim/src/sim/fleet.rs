//! The discrete-event loop: a fleet of engines (`crate::engine`, the model `kvlb replica`
//! serves) behind one selection policy (`crate::select`, the code `kvlb serve` runs), fed a
//! trace.
//!
//! Three kinds of events, in time order: a request arriving (at its trace time), an engine's
//! step ending (`Engine::next_event_time`) and, in a disaggregated fleet, a request's KV
//! arriving at its decode replica (`super::pd::Transfers`). At equal times the engines go
//! first, so a policy sees every output that happened by then, then the transfers. An
//! arrival builds the `RequestView` (block hashes
//! of the trace blocks, 512 tokens each), the candidates with the load the data plane would
//! count (in flight; queued prefill = the estimated uncached prompt tokens until the first
//! token; decoding from the first token until finished), asks the policy, and submits the
//! prompt to the chosen engine at that time. Outputs update the load and the per-request
//! record (TTFT, end-to-end latency, cached tokens).
//!
//! Prefill/decode disaggregation (`super::pd`): a request whose model has prefill and decode
//! replicas goes first to a prefill replica the policy chooses (max_tokens 1, its KV held);
//! when that answer is complete the policy chooses the decode replica (cache_aware the same
//! instance, whose residency covers both legs; any other policy a second instance of its
//! own), the transfer takes prompt tokens x `Pd::transfer_s_per_token`, and then the prefill
//! replica's hold is released and the decode replica gets the request with the KV. As in
//! `kvlb serve`, the prefill leg counts as the request's queued prefill on its replica until
//! its answer, and the decode leg is in flight on its replica from its choice, with nothing
//! to prefill; the prefill answer's time is the calibration sample, the decode leg gives none.
//!
//! The estimate of uncached tokens, and the duplicate-KV measure sampled every
//! `SAMPLE_PERIOD_S` of simulated time, come from `RoutedBlocks` (what was routed where,
//! bounded by each replica's KV capacity); the engines themselves are not opened up.
//!
//! `cache_aware`'s residency writer learns from its routing, and, when asked
//! (`ResidencySource`), from the engines' KV events too, as `kvlb serve` does from replicas
//! that publish them. The engines hash 16-token blocks, the trace 512-token ones: a trace
//! block counts as stored (removed) on a replica when the engine stores (removes) the last
//! full engine block inside it, the block an engine frees first and the one whose presence
//! says the engine computed the whole trace block. Guesses age as the telemetry sweep ages
//! them (`routed_guess_ttl`, checked every `SWEEP_PERIOD_S`).
//!
//! With a host KV tier (`EngineConfig::host_kv_capacity_tokens` > 0) `cache_aware` gets an
//! offloaded tier as `kvlb serve` wires it (`CacheAware::with_offload_tier`): with KV events,
//! the engines' CPU-medium BlockStored / BlockRemoved go there (GPU ones to the GPU tier, as
//! the telemetry feed splits them); learning from routing alone, every prompt routed to a
//! replica is believed in its host tier too (the engine writes every computed block through),
//! LRU-bounded by the host capacity. The data plane's estimate of a request's uncached tokens
//! then also counts what routing put in the replica's host tier (a load costs a few percent
//! of a recompute).
//!
//! Everything is deterministic: time is simulated, and `random` comes from a seeded `Rng`.

#![forbid(unsafe_code)]

use super::pd::{Leg, Pd, Role, Transfers};
use super::routed::RoutedBlocks;
use super::trace::{self, Trace, TraceRequest, TRACE_BLOCK_TOKENS};
use crate::engine::{Engine, EngineConfig, EngineOutput, EngineRequest, KvTransfer, Speed};
use crate::estimate::calibrate::{
    Calibration, DecodeSample, Sample, TtftSample, MIN_DECODE_EVENTS,
};
use crate::estimate::{ReportedLoad, TtftModel};
use crate::http::request::Method;
use crate::kv_events::{KvEvent, Medium};
use crate::replica::pd::DEFAULT_KV_HOLD_TIMEOUT_S;
use crate::residency::{ResidencyConfig, ResidencyIndex, ResidencyWriter};
use crate::select::{
    CacheAware, CacheAwareConfig, Candidate, ConsistentHash, Decision, LeastLoaded, PdPath, Policy,
    PowerOfTwo, Random, RequestView, Rng, RoundRobin, SglangCacheAware,
};
use std::collections::HashMap;
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seconds of simulated time between updates of the fleet's pace, as `kvlb serve` publishes.
const PUBLISH_PERIOD_S: f64 = 0.1;

/// Seconds of simulated time between duplicate-KV samples.
pub const SAMPLE_PERIOD_S: f64 = 10.0;

/// Seconds of simulated time between sweeps of aged routing guesses (with KV events), as the
/// telemetry feed's `SWEEP_PERIOD_US`.
pub const SWEEP_PERIOD_S: f64 = 0.5;

/// What `cache_aware`'s residency writer learns from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResidencySource {
    /// Its own routing alone; the engines' KV events are not fed back.
    Routing,
    /// Routing and the engines' KV events; a BlockRemoved drops a block at 0 copies.
    Events,
    /// Routing and KV events; a block routed to a replica since its last BlockStored there
    /// stays through its removal (`ResidencyWriter::route`).
    EventsPending,
}

impl ResidencySource {
    pub const NAMES: &'static [&'static str] = &["routing", "events", "events-pending"];

    pub fn parse(name: &str) -> Option<ResidencySource> {
        match name {
            "routing" => Some(ResidencySource::Routing),
            "events" => Some(ResidencySource::Events),
            "events-pending" => Some(ResidencySource::EventsPending),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ResidencySource::Routing => "routing",
            ResidencySource::Events => "events",
            ResidencySource::EventsPending => "events-pending",
        }
    }
}

/// Every policy the simulator knows, in report order.
pub const POLICY_NAMES: &[&str] = &[
    "round_robin",
    "random",
    "least_loaded",
    "power_of_two",
    "consistent_hash",
    "sglang_cache_aware",
    "cache_aware",
];

/// The policy called `name` when it needs nothing beside it (every policy but cache_aware).
fn standalone_policy(name: &str) -> Option<Box<dyn Policy>> {
    Some(match name {
        "round_robin" => Box::new(RoundRobin::new(0)),
        "random" => Box::new(Random),
        "least_loaded" => Box::new(LeastLoaded::new(0)),
        "power_of_two" => Box::new(PowerOfTwo),
        "consistent_hash" => Box::new(ConsistentHash::new()),
        "sglang_cache_aware" => Box::new(SglangCacheAware::new()),
        _ => return None,
    })
}

/// Routing-log records per request in flight to the residency writer (it is drained after
/// every decision, so one request's worth would do).
const ROUTING_LOG_RECORDS: usize = 1024;

/// A policy as the data plane would run it, with whatever it keeps beside it. For
/// `cache_aware` that is the residency index, its writer and a routing log, as `kvlb serve`
/// wires them, except that the writer is driven synchronously: after every decision it drains
/// the routing log at the decision's time (no writer thread, so runs are deterministic).
///
/// With `ResidencySource::Routing` the writer learns residency from routing alone (the
/// engines' KV events are not fed back), bounded per replica by the KV capacity plus the
/// prompt tokens routed there and not computed yet (with events too): a queued prompt holds no KV, so while a replica is backlogged its queue must
/// not push out of the router's belief the blocks its cache still holds. Bounded by the KV
/// capacity alone, a fleet at twice the conversation trace's rate (queues of minutes) forgot
/// sessions its replicas still held and sent their next turns elsewhere.
pub struct RoutingPolicy {
    policy: Box<dyn Policy>,
    /// Another instance of the policy for the decode legs of disaggregated requests (None:
    /// `policy` chooses those too, as cache_aware does, whose residency covers both legs). A
    /// policy with a turn counter of its own would otherwise alternate its two legs in step:
    /// round_robin over two prefill and two decode replicas would use one of each.
    decode: Option<Box<dyn Policy>>,
    /// What the policy prices a token's KV transfer at (cache_aware; `PdPath::Prefill`).
    kv_transfer_s_per_token: f64,
    residency: Option<ResidencyWriter>,
    /// The offloaded tier's writer (cache_aware on engines with a host KV tier).
    offload: Option<ResidencyWriter>,
    source: ResidencySource,
    /// With events: the engine hash of the last full engine block of a trace block -> that
    /// trace block's hash (`trace::view_block`), for every prompt submitted.
    engine_blocks: HashMap<u64, u64>,
    /// Scratch for events and the engine hashes of a prompt.
    events: Vec<KvEvent>,
    hashes: Vec<u64>,
    views: Vec<u64>,
    guess_ttl_us: u64,
    /// Seconds between the scrapes of the engines' queue and KV usage fed to the policy as
    /// `Candidate::reported` (what `kvlb serve` reads from a replica's /metrics); 0: none.
    scrape_interval_s: f64,
    /// Candidates carry the pace calibration learned from the requests' first tokens (as
    /// `kvlb serve` measures its streams); false: every replica at the configured speed.
    calibrate: bool,
}

impl RoutingPolicy {
    /// The policy called `name`, for a fleet of `replicas` engines configured as `engine`.
    pub fn build(
        name: &str,
        replicas: usize,
        engine: &EngineConfig,
    ) -> Result<RoutingPolicy, String> {
        RoutingPolicy::build_with(name, replicas, engine, &[])
    }

    /// As `build`, with `cache_aware`'s parameters in `set` (name, value; see
    /// `select::cache_aware::PARAMETERS`) changed after its defaults; other policies have none.
    pub fn build_with(
        name: &str,
        replicas: usize,
        engine: &EngineConfig,
        set: &[(String, f64)],
    ) -> Result<RoutingPolicy, String> {
        let mut residency = None;
        let mut offload = None;
        let mut kv_transfer_s_per_token = 0.0;
        let policy: Box<dyn Policy> = match (standalone_policy(name), name) {
            (Some(policy), _) => policy,
            (None, "cache_aware") => {
                let (index, mut writer) = ResidencyIndex::new(ResidencyConfig {
                    max_replicas: replicas,
                    block_tokens: TRACE_BLOCK_TOKENS,
                    kv_capacity_tokens: engine.kv_capacity_tokens,
                })?;
                let log = writer.routing_log(ROUTING_LOG_RECORDS);
                let cfg = CacheAwareConfig {
                    model: TtftModel::from_engine(&engine.timing()),
                    // Calibrated from the engine like the rest of the model: loading a token
                    // back from the host tier against computing it (its per-token prefill).
                    offload_load_cost: if engine.host_kv_capacity_tokens > 0
                        && engine.prefill_b_s > 0.0
                    {
                        (engine.host_load_s_per_token / engine.prefill_b_s).clamp(0.0, 1.0)
                    } else {
                        CacheAwareConfig::default().offload_load_cost
                    },
                    ..CacheAwareConfig::default()
                };
                let mut cfg = cfg;
                for (k, v) in set {
                    cfg.set(k, *v)?;
                }
                kv_transfer_s_per_token = cfg.kv_transfer_s_per_token;
                residency = Some(writer);
                let mut policy = CacheAware::new(index, cfg)?.with_routing_log(log);
                if engine.host_kv_capacity_tokens > 0 {
                    let (index, writer) = ResidencyIndex::new(ResidencyConfig {
                        max_replicas: replicas,
                        block_tokens: TRACE_BLOCK_TOKENS,
                        kv_capacity_tokens: engine.host_kv_capacity_tokens,
                    })?;
                    offload = Some(writer);
                    policy = policy.with_offload_tier(index.clone());
                }
                Box::new(policy)
            }
            (None, other) => {
                return Err(format!(
                    "unknown policy {other:?}; known: {}",
                    POLICY_NAMES.join(", ")
                ))
            }
        };
        let mut built = RoutingPolicy::with_parts(policy, residency);
        built.offload = offload;
        built.decode = standalone_policy(name);
        built.kv_transfer_s_per_token = kv_transfer_s_per_token;
        Ok(built)
    }

    /// Any other policy, run as it is.
    pub fn from_policy(policy: Box<dyn Policy>) -> RoutingPolicy {
        RoutingPolicy::with_parts(policy, None)
    }

    fn with_parts(policy: Box<dyn Policy>, residency: Option<ResidencyWriter>) -> RoutingPolicy {
        RoutingPolicy {
            policy,
            decode: None,
            kv_transfer_s_per_token: 0.0,
            residency,
            offload: None,
            source: ResidencySource::Routing,
            engine_blocks: HashMap::new(),
            events: Vec::new(),
            hashes: Vec::new(),
            views: Vec::new(),
            guess_ttl_us: crate::residency::DEFAULT_ROUTED_GUESS_TTL.as_micros() as u64,
            scrape_interval_s: 0.0,
            calibrate: true,
        }
    }

    /// Feed the policy each engine's queue and KV usage as scraped every `seconds` (0: never).
    pub fn scrape_every(mut self, seconds: f64) -> RoutingPolicy {
        self.scrape_interval_s = seconds.max(0.0);
        self
    }

    /// Learn residency from `source` (policies without a residency index ignore it).
    pub fn learn_from(mut self, source: ResidencySource) -> RoutingPolicy {
        self.source = source;
        if let Some(w) = &mut self.residency {
            if source == ResidencySource::Events {
                w.set_pending_ttl(Duration::ZERO);
            }
        }
        self
    }

    /// Whether the engines' KV events are fed back.
    pub fn learns_from_events(&self) -> bool {
        self.residency.is_some() && self.source != ResidencySource::Routing
    }

    /// A prompt goes to an engine: remember which engine blocks stand for its trace blocks.
    fn learn_prompt(&mut self, prompt: &[u32], block_ids: &[u64], engine: &EngineConfig) {
        if !self.learns_from_events() {
            return;
        }
        engine_block_hashes(prompt, engine, &mut self.hashes);
        let per_trace = (TRACE_BLOCK_TOKENS / engine.block_size.max(1)) as usize;
        let full = self.hashes.len();
        for (k, &id) in block_ids.iter().enumerate() {
            // The last full engine block inside trace block k.
            let end = ((k + 1) * per_trace).min(full);
            if end > k * per_trace {
                self.engine_blocks
                    .insert(self.hashes[end - 1], trace::view_block(id));
            }
        }
    }

    /// Apply what engine `r` reported since the last call, at `now_us`.
    fn learn_events(&mut self, r: usize, engine: &mut Engine, now_us: u64) {
        let Some(writer) = &mut self.residency else {
            return;
        };
        if self.source == ResidencySource::Routing {
            return;
        }
        self.events.clear();
        engine.take_kv_events(&mut self.events);
        // GPU (or no medium) to the GPU tier, any other medium to the offloaded tier.
        let on_gpu = |medium: &Option<Medium>| medium.is_none_or(|m| m == Medium::Gpu);
        for event in &self.events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } => {
                    self.views.clear();
                    self.views.extend(
                        block_hashes
                            .iter()
                            .filter_map(|h| self.engine_blocks.get(h).copied()),
                    );
                    if self.views.is_empty() {
                        continue;
                    }
                    if on_gpu(medium) {
                        let _ = writer.insert(r, &self.views, now_us);
                    } else if let Some(offload) = &mut self.offload {
                        let _ = offload.insert(r, &self.views, now_us);
                    }
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    for h in block_hashes {
                        if let Some(&view) = self.engine_blocks.get(h) {
                            if on_gpu(medium) {
                                let _ = writer.remove_at(r, view, now_us);
                            } else if let Some(offload) = &mut self.offload {
                                let _ = offload.remove(r, view);
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    let _ = writer.clear(r);
                    if let Some(offload) = &mut self.offload {
                        let _ = offload.clear(r);
                    }
                }
                KvEvent::Undecodable(_) => {}
            }
        }
    }

    /// With events: drop the routing guesses not touched for `routed_guess_ttl`.
    fn sweep(&mut self, replicas: usize, now_us: u64) {
        if !self.learns_from_events() {
            return;
        }
        if let Some(writer) = &mut self.residency {
            for r in 0..replicas {
                let _ = writer.expire_guesses(r, now_us.saturating_sub(self.guess_ttl_us));
            }
        }
    }

    pub fn name(&self) -> &'static str {
        self.policy.name()
    }

    /// Price every replica at the configured speed (no calibration).
    pub fn without_calibration(mut self) -> RoutingPolicy {
        self.calibrate = false;
        self
    }

    fn select(&mut self, req: &RequestView<'_>, candidates: &[Candidate], random: u64) -> usize {
        self.policy.select(req, candidates, random)
    }

    /// Choose the decode replica of a disaggregated request among `candidates`.
    fn select_decode(
        &mut self,
        req: &RequestView<'_>,
        candidates: &[Candidate],
        random: u64,
    ) -> usize {
        match &mut self.decode {
            Some(decode) => decode.select(req, candidates, random),
            None => self.policy.select(req, candidates, random),
        }
    }

    /// A request for `blocks` went to replica `r` at `now_us`. Learning from routing alone,
    /// the offloaded tier believes them there too: the engine writes every block it computes
    /// through to host memory (bounded by the host capacity, least recently used out first).
    /// With KV events the offloaded tier learns from CPU-medium events only, as `kvlb serve`'s.
    fn route_offloaded(&mut self, r: usize, blocks: &[u64], now_us: u64) {
        if self.source != ResidencySource::Routing {
            return;
        }
        if let Some(offload) = &mut self.offload {
            let _ = offload.insert_routed(r, blocks, now_us);
        }
    }

    /// After a decision: replica `r` has `pending_tokens` routed there still to compute. They
    /// do not hold KV yet, so the residency the router learned from routing may keep that
    /// many tokens beyond the KV capacity; then the routing log is drained at `now_us`.
    fn settle(&mut self, r: usize, kv_capacity_tokens: u64, pending_tokens: u64, now_us: u64) {
        self.learn_pending(r, kv_capacity_tokens, pending_tokens);
        if let Some(writer) = &mut self.residency {
            writer.drain(now_us);
        }
    }

    /// Replica `r`'s pending tokens changed (a first token came).
    fn learn_pending(&mut self, r: usize, kv_capacity_tokens: u64, pending_tokens: u64) {
        if let Some(writer) = &mut self.residency {
            // Only an unknown replica fails, and `r` is one of the fleet's.
            let _ = writer.set_capacity_tokens(r, kv_capacity_tokens + pending_tokens);
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RequestRecord {
    /// The replica that answered it (a disaggregated request's decode replica).
    pub replica: u32,
    /// A disaggregated request's prefill replica (None: served whole).
    pub prefill_replica: Option<u32>,
    pub arrival_s: f64,
    /// First token time minus arrival (NaN until it comes, and for rejected requests); a
    /// disaggregated request's first token is its decode replica's.
    pub ttft_s: f64,
    /// Finish time minus arrival.
    pub e2e_s: f64,
    /// Seconds its KV took over the link from the prefill replica (0: served whole).
    pub transfer_s: f64,
    pub prompt_tokens: u32,
    /// Output tokens it got, once finished.
    pub output_tokens: u32,
    /// Prompt tokens the engine found in its prefix cache at admission (a disaggregated
    /// request's prefill replica).
    pub cached_tokens: u32,
    /// What the data plane estimated it would find (from routed blocks).
    pub estimated_cached_tokens: u32,
    pub finished: bool,
    /// The engine refused it (prompt over the context limit, empty prompt), or no replica
    /// serves its model (`replica` is then 0).
    pub rejected: bool,
    /// What a cache_aware policy saw and estimated when it chose the replica (a
    /// disaggregated request's prefill replica, as `kvlb serve` explains it).
    pub decision: Option<Decision>,
    /// The fleet when it arrived, as the engines saw it: per replica, requests running and
    /// waiting (the chosen replica's and the others').
    pub at_arrival: ArrivalState,
}

impl RequestRecord {
    /// Mean seconds between its output tokens (None unless finished with two or more).
    pub fn itl_s(&self) -> Option<f64> {
        (self.finished && self.output_tokens >= 2)
            .then(|| (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) as f64)
    }
}

/// The engines' queues when a request arrived, before it was submitted.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ArrivalState {
    /// The chosen replica's requests running and waiting.
    pub running: u32,
    pub waiting: u32,
    /// Replicas with nothing running or waiting.
    pub idle_replicas: u32,
    /// The fewest requests waiting on any replica.
    pub min_waiting: u32,
}

/// One policy's run over one trace.
pub struct Run {
    pub policy: String,
    pub records: Vec<RequestRecord>,
    /// Each replica's role (all `Role::Both` in a fleet without disaggregation).
    pub roles: Vec<Role>,
    /// Per replica: prompt tokens computed (prompt minus cached, at first admission; a decode
    /// leg's last prompt token is not counted).
    pub replica_prefill_tokens: Vec<u64>,
    /// Summed over the engines: prefix-cache lookups and hits, in tokens (decode legs, whose
    /// prompts were computed on a prefill replica, left out).
    pub prefix_queries_tokens: u64,
    pub prefix_hits_tokens: u64,
    /// Of the hits, tokens loaded from the engines' host tiers (0 without one; decode
    /// replicas' left out); the rest were found in GPU memory.
    pub host_hits_tokens: u64,
    pub preemptions: u64,
    /// Duplicate engine blocks at each sample time.
    pub duplicate_samples: Vec<u64>,
    /// Simulated seconds from the first arrival to the last output.
    pub makespan_s: f64,
}

#[derive(Clone, Copy, Default)]
struct Load {
    in_flight: u32,
    queued_prefill_tokens: u64,
    decoding: u32,
    /// Requests sent there so far.
    routed: u64,
}

/// The fleet a trace runs on.
#[derive(Clone, Copy)]
pub struct Fleet<'a> {
    pub replicas: usize,
    /// Replica `r` serves only the names `serving[r]` (None: every replica every model).
    pub serving: Option<&'a [Vec<String>]>,
    /// The base engine (the policies' cost model), replica `r` running it at `speeds[r]`
    /// (empty: every replica at speed 1).
    pub engine: &'a EngineConfig,
    pub speeds: &'a [Speed],
    /// The replicas' roles and how requests use them.
    pub pd: &'a Pd,
}

impl Fleet<'_> {
    fn check(&self) -> Result<(), String> {
        if self.replicas == 0 {
            return Err("a fleet needs at least one replica".into());
        }
        // (how many were given, if any; what of)
        let per_replica = [
            (self.serving.map(<[_]>::len), "the names of ", ""),
            (Some(self.speeds.len()).filter(|&n| n > 0), "", " speeds"),
            (Some(self.pd.roles.len()).filter(|&n| n > 0), "", " roles"),
        ];
        for (given, before, after) in per_replica {
            if let Some(n) = given.filter(|&n| n != self.replicas) {
                return Err(format!(
                    "{} replicas but {before}{n}{after} given",
                    self.replicas
                ));
            }
        }
        Ok(())
    }

    /// Whether replica `r` serves `model` (a request naming none goes anywhere).
    fn serves(&self, r: usize, model: Option<&str>) -> bool {
        self.serving
            .zip(model)
            .is_none_or(|(names, m)| names[r].iter().any(|n| n == m))
    }
}

/// Simulate `trace` on `replicas` engines of `engine` behind `policy`, every replica serving
/// every model; `seed` drives the policy's random numbers.
pub fn simulate(
    trace: &Trace,
    replicas: usize,
    engine: &EngineConfig,
    policy: &mut RoutingPolicy,
    seed: u64,
) -> Result<Run, String> {
    simulate_serving(trace, replicas, None, engine, &[], policy, seed)
}

/// As `simulate`, replica `r` serving only the names `serving[r]` when `serving` is given, at
/// `speeds[r]` when `speeds` is not empty (`simulate_fleet`).
pub fn simulate_serving(
    trace: &Trace,
    replicas: usize,
    serving: Option<&[Vec<String>]>,
    engine: &EngineConfig,
    speeds: &[Speed],
    policy: &mut RoutingPolicy,
    seed: u64,
) -> Result<Run, String> {
    let fleet = Fleet {
        replicas,
        serving,
        engine,
        speeds,
        pd: &Pd::default(),
    };
    simulate_fleet(trace, &fleet, policy, seed)
}

/// Simulate `trace` on `fleet` behind `policy`; `seed` drives the policy's random numbers.
///
/// With `fleet.serving` the policy is offered only the replicas serving the model a request
/// names (as `kvlb serve` filters its candidates), a request naming a model no replica serves
/// is rejected (kvlb's 404), and one naming none may go to any replica. The engines do not
/// tell models apart: a replica's prefix cache is shared by the names it serves.
///
/// A mixed fleet: replica `r` runs `engine` at `speeds[r]` (`Speed::apply`), while the policy
/// keeps whatever model it was built with (the base `engine`'s, for `RoutingPolicy::build`).
/// With `engine.timing_spread` > 0 each replica's step times scatter with random numbers of
/// its own, seeded by `seed`, the replica and `engine.timing_seed`.
///
/// With prefill and decode replicas (`fleet.pd`), a request whose model has both takes two
/// legs (`super::pd`), or, priced by cache_aware, may be computed whole on a decode replica.
pub fn simulate_fleet(
    trace: &Trace,
    fleet: &Fleet,
    policy: &mut RoutingPolicy,
    seed: u64,
) -> Result<Run, String> {
    fleet.check()?;
    let mut sim = Sim::new(trace, *fleet, policy.learns_from_events(), seed);
    let mut next_sweep = 0.0f64;
    let mut duplicate_samples = Vec::new();
    let mut next_sample = 0.0f64;
    let mut next_arrival = 0usize;
    let mut now = 0.0f64;
    loop {
        let arrival = trace.requests.get(next_arrival).map(|r| r.arrival_s);
        let step = sim.next_step();
        let transfer = sim.transfers.next_time();
        let next = [arrival, step.map(|(_, s)| s), transfer];
        let Some(t) = next.into_iter().flatten().reduce(f64::min) else {
            break;
        };
        while next_sample <= t {
            duplicate_samples.push(sim.routed.duplicate_engine_blocks());
            next_sample += SAMPLE_PERIOD_S;
        }
        if sim.events && next_sweep <= t {
            policy.sweep(fleet.replicas, micros(t));
            while next_sweep <= t {
                next_sweep += SWEEP_PERIOD_S;
            }
        }
        now = now.max(t);
        // At equal times the engines go first, then the transfers, then the arrivals.
        match step {
            Some((i, s)) if s <= t => sim.step(i, s, policy)?,
            _ if transfer.is_some_and(|x| x <= t) => sim.transfer_done(t),
            _ => {
                sim.arrive(next_arrival, t, policy);
                next_arrival += 1;
            }
        }
    }
    Ok(sim.finish(policy.name(), duplicate_samples, now))
}

fn micros(t: f64) -> u64 {
    (t * 1e6) as u64
}

fn millis(t: f64) -> u64 {
    (t * 1e3) as u64
}

/// One run in progress: the engines, the load the data plane counts, what routing put where,
/// and what happened to each request.
struct Sim<'a> {
    trace: &'a Trace,
    fleet: Fleet<'a>,
    /// The engines' KV events are fed back to the policy.
    events: bool,
    engines: Vec<Engine>,
    loads: Vec<Load>,
    /// What routing put in each replica's KV cache, and (write-through: everything it
    /// computed, up to the host capacity) in its host tier when it has one: the estimate of
    /// uncached tokens, the duplicate-KV samples.
    routed: RoutedBlocks,
    routed_host: Option<RoutedBlocks>,
    records: Vec<RequestRecord>,
    replica_prefill_tokens: Vec<u64>,
    rng: Rng,
    /// Scratch: the candidates of a choice, a request's view blocks, a step's outputs.
    candidates: Vec<Candidate>,
    view_blocks: Vec<u64>,
    outputs: Vec<EngineOutput>,
    /// The engines' queues and KV usage as last scraped, and when the next scrape is due.
    reported: Vec<ReportedLoad>,
    next_scrape: f64,
    /// What each request's estimate was made of (cache_aware), until its first token.
    expected: Vec<Option<TtftSample>>,
    /// The decode step the policy priced each request's replica at (0: none).
    decode_step: Vec<f32>,
    calibration: Calibration,
    next_publish: f64,
    /// Consecutive engine steps that produced nothing and ended where they began.
    stalled: u32,
    transfers: Transfers,
    /// The decode legs' prefix-cache lookups, prompt tokens and tokens found (received KV
    /// included), left out of the hit rate: their prompts were computed on prefill replicas.
    decode_lookups: (u64, u64),
}

impl<'a> Sim<'a> {
    fn new(trace: &'a Trace, fleet: Fleet<'a>, events: bool, seed: u64) -> Sim<'a> {
        let (engine, replicas) = (fleet.engine, fleet.replicas);
        let timing_seed = trace::mix(seed ^ 0x5449_4d49_4e47) ^ engine.timing_seed;
        let engines = (0..replicas)
            .map(|r| {
                let speed = fleet.speeds.get(r).copied().unwrap_or(Speed::ONE);
                let mut cfg = speed.apply(engine);
                cfg.timing_seed = trace::mix(timing_seed.wrapping_add(r as u64));
                let mut e = Engine::new(cfg);
                e.set_kv_events_enabled(events);
                // Both roles run a KV connector, as `kvlb replica --role` does.
                e.set_kv_connector(fleet.pd.role(r) != Role::Both);
                e
            })
            .collect();
        let routed_host = (engine.host_kv_capacity_tokens > 0).then(|| {
            RoutedBlocks::new(
                replicas,
                engine.host_kv_capacity_tokens,
                TRACE_BLOCK_TOKENS,
                engine.block_size,
            )
        });
        let routed = RoutedBlocks::new(
            replicas,
            engine.kv_capacity_tokens,
            TRACE_BLOCK_TOKENS,
            engine.block_size,
        );
        let records = trace
            .requests
            .iter()
            .map(|r| RequestRecord {
                arrival_s: r.arrival_s,
                ttft_s: f64::NAN,
                e2e_s: f64::NAN,
                prompt_tokens: r.prompt_tokens,
                ..RequestRecord::default()
            })
            .collect();
        let n = trace.requests.len();
        Sim {
            trace,
            fleet,
            events,
            engines,
            loads: vec![Load::default(); replicas],
            routed,
            routed_host,
            records,
            replica_prefill_tokens: vec![0; replicas],
            rng: Rng::new(trace::mix(seed ^ 0x5345_4c45_4354)),
            candidates: Vec::with_capacity(replicas),
            view_blocks: Vec::new(),
            outputs: Vec::new(),
            reported: vec![ReportedLoad::default(); replicas],
            next_scrape: 0.0,
            expected: vec![None; n],
            decode_step: vec![0.0; n],
            calibration: Calibration::new(replicas),
            next_publish: 0.0,
            stalled: 0,
            transfers: Transfers::default(),
            decode_lookups: (0, 0),
        }
    }

    /// The engine whose step ends first, and when.
    fn next_step(&self) -> Option<(usize, f64)> {
        let mut step: Option<(usize, f64)> = None;
        for (i, e) in self.engines.iter().enumerate() {
            if let Some(t) = e.next_event_time() {
                if step.is_none_or(|(_, best)| t < best) {
                    step = Some((i, t));
                }
            }
        }
        step
    }

    /// Engine `i`'s step ending at `s`: its outputs update loads, records and calibration.
    fn step(&mut self, i: usize, s: f64, policy: &mut RoutingPolicy) -> Result<(), String> {
        let mut outputs = std::mem::take(&mut self.outputs);
        outputs.clear();
        let pending = self.loads[i].queued_prefill_tokens;
        self.engines[i].advance(s, &mut outputs);
        if outputs.is_empty() && self.engines[i].next_event_time() == Some(s) {
            self.stalled += 1;
            if self.stalled > 1000 {
                return Err(format!("replica {i} makes no progress at t = {s} s"));
            }
        } else {
            self.stalled = 0;
        }
        for out in &outputs {
            self.on_output(out, i, s, policy);
        }
        self.outputs = outputs;
        if s >= self.next_publish {
            self.calibration.update_fleet();
            self.next_publish = s + PUBLISH_PERIOD_S;
        }
        if self.events {
            policy.learn_events(i, &mut self.engines[i], micros(s));
        }
        let queued = self.loads[i].queued_prefill_tokens;
        if queued != pending {
            policy.learn_pending(i, self.fleet.engine.kv_capacity_tokens, queued);
        }
        Ok(())
    }

    /// Which leg of request `k` replica `i` runs.
    fn leg_of(&self, k: usize, i: usize) -> Leg {
        match self.records[k].prefill_replica {
            None => Leg::Whole,
            Some(p) if p as usize == i => Leg::Prefill,
            Some(_) => Leg::Decode,
        }
    }

    /// An output of engine `i`, from its step ending at `s`. A first token is a calibration
    /// sample, as a stream's first byte is (a prefill replica's answer too); a finished
    /// answer's token spacing too, as a stream's event spacing is.
    fn on_output(&mut self, out: &EngineOutput, i: usize, s: f64, policy: &mut RoutingPolicy) {
        match *out {
            EngineOutput::FirstToken {
                id,
                t,
                cached_tokens,
                ..
            } => {
                let k = id as usize;
                let leg = self.leg_of(k, i);
                let rec = &mut self.records[k];
                let l = &mut self.loads[i];
                l.queued_prefill_tokens -= queued_tokens(rec, leg);
                l.decoding += 1;
                if leg == Leg::Decode {
                    rec.ttft_s = t - rec.arrival_s;
                    self.decode_lookups.0 += rec.prompt_tokens as u64;
                    self.decode_lookups.1 += cached_tokens as u64;
                    return;
                }
                rec.cached_tokens = cached_tokens;
                if leg == Leg::Whole {
                    rec.ttft_s = t - rec.arrival_s;
                }
                if let Some(mut sample) = self.expected[k].take() {
                    sample.observed_s = (t - rec.arrival_s) as f32;
                    self.calibration.observe(&Sample::Ttft(sample), millis(s));
                }
            }
            EngineOutput::Token { .. } => {}
            EngineOutput::Finished {
                id,
                t,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                let k = id as usize;
                let leg = self.leg_of(k, i);
                let rec = &mut self.records[k];
                let l = &mut self.loads[i];
                if completion_tokens == 0 {
                    // Finished without a first token (an abort): it leaves the queue directly.
                    l.queued_prefill_tokens -= queued_tokens(rec, leg);
                } else {
                    l.decoding -= 1;
                }
                l.in_flight -= 1;
                if leg != Leg::Decode {
                    self.replica_prefill_tokens[i] += (prompt_tokens - cached_tokens) as u64;
                }
                if leg == Leg::Prefill {
                    // The prefill replica's answer is complete: the decode leg goes out.
                    self.route_decode(k, t, policy);
                    return;
                }
                rec.e2e_s = t - rec.arrival_s;
                rec.finished = true;
                rec.output_tokens = completion_tokens;
                let tokens = self.trace.requests[k].output_tokens;
                let elapsed = rec.e2e_s - rec.ttft_s;
                if self.decode_step[k] > 0.0 && tokens >= MIN_DECODE_EVENTS && elapsed > 0.0 {
                    let sample = DecodeSample {
                        replica: i as u32,
                        epoch: 0,
                        steps: tokens - 1,
                        step_s: self.decode_step[k],
                        elapsed_s: elapsed as f32,
                    };
                    self.calibration.observe(&Sample::Decode(sample), millis(s));
                }
            }
        }
    }

    /// Every `interval` seconds (0: never), read each engine's queue and KV usage as a metrics
    /// scrape would.
    fn scrape(&mut self, t: f64, interval: f64) {
        if interval <= 0.0 || self.next_scrape > t {
            return;
        }
        for (r, e) in self.engines.iter().enumerate() {
            let s = e.stats();
            let l = &self.loads[r];
            self.reported[r] = ReportedLoad::from_scrape(
                s.num_requests_waiting as u64,
                s.num_requests_running as u64,
                Some(s.kv_cache_usage),
                l.in_flight as u64,
                l.decoding as u64,
                millis(t),
                millis(interval),
            );
        }
        while self.next_scrape <= t {
            self.next_scrape += interval;
        }
    }

    /// The candidates for `leg` of request `k`: the replicas serving its model whose role the
    /// leg admits, with the load the data plane counts.
    fn fill_candidates(&mut self, k: usize, leg: Leg) {
        let model = self.trace.requests[k].model.as_deref();
        self.candidates.clear();
        for (r, l) in self.loads.iter().enumerate() {
            let role = self.fleet.pd.role(r);
            if !leg.admits(role) || !self.fleet.serves(r, model) {
                continue;
            }
            self.candidates.push(Candidate {
                replica: r,
                in_flight: l.in_flight,
                queued_prefill_tokens: l.queued_prefill_tokens,
                decoding: l.decoding,
                reported: self.reported[r],
                setup_us: 0,
                lora_slot_busy: false,
                pace: self.calibration.pace(r),
                routed: l.routed,
                pd: leg.path(role),
            });
        }
    }

    /// Request `k`'s trace blocks as the data plane hashes them, in `view_blocks`.
    fn hash_view_blocks(&mut self, k: usize) {
        self.view_blocks.clear();
        let ids = &self.trace.requests[k].block_ids;
        self.view_blocks
            .extend(ids.iter().map(|&id| trace::view_block(id)));
    }

    /// The engines' queues now, `r` being the replica chosen.
    fn arrival_state(&self, r: usize) -> ArrivalState {
        let mut at = ArrivalState {
            min_waiting: u32::MAX,
            ..ArrivalState::default()
        };
        for (i, e) in self.engines.iter().enumerate() {
            let s = e.stats();
            if i == r {
                (at.running, at.waiting) = (s.num_requests_running, s.num_requests_waiting);
            }
            at.idle_replicas += (s.num_requests_running + s.num_requests_waiting == 0) as u32;
            at.min_waiting = at.min_waiting.min(s.num_requests_waiting);
        }
        at
    }

    /// Request `k` arrives at `t`: the policy chooses its replica (a disaggregated request's
    /// prefill replica), which gets its prompt at once.
    fn arrive(&mut self, k: usize, t: f64, policy: &mut RoutingPolicy) {
        self.scrape(t, policy.scrape_interval_s);
        let req = &self.trace.requests[k];
        let fleet = self.fleet;
        let serving = (0..fleet.replicas).filter(|&r| fleet.serves(r, req.model.as_deref()));
        let leg = fleet.pd.first_leg(serving, policy.name() == "cache_aware");
        self.fill_candidates(k, leg);
        if self.candidates.is_empty() {
            // No replica serves its model.
            self.records[k].rejected = true;
            return;
        }
        self.hash_view_blocks(k);
        let now_us = micros(t);
        let view = request_view(req, &self.view_blocks, now_us);
        let pick = policy.select(&view, &self.candidates, self.rng.next_u64());
        let chosen = self.candidates[pick.min(self.candidates.len() - 1)];
        let r = chosen.replica;
        // Chosen among prefill and decode replicas: a decode replica computes it whole.
        let prefill_leg = leg != Leg::Whole && fleet.pd.role(r) == Role::Prefill;
        self.records[k].at_arrival = self.arrival_state(r);
        self.records[k].decision = policy.policy.decision();
        let decision = self.records[k].decision.filter(|_| policy.calibrate);
        // A disaggregated request's decode leg is not priced (nor measured), as in kvlb serve.
        self.decode_step[k] = match (prefill_leg, decision) {
            (false, Some(d)) => d.decode_step_s as f32,
            _ => 0.0,
        };
        self.expected[k] = decision.map(|d| {
            let mut fixed_s = d.fixed_s;
            if chosen.pd == PdPath::Prefill {
                // The estimate included the transfer, which comes after the prefill answer:
                // the answer's time measures the rest.
                let transfer = req.prompt_tokens as f64 * policy.kv_transfer_s_per_token;
                fixed_s = (fixed_s - transfer).max(0.0);
            }
            TtftSample {
                replica: r as u32,
                epoch: 0,
                wait: d.wait,
                prefill: d.prefill,
                fixed_s: fixed_s as f32,
                pace: d.pace,
                observed_s: 0.0,
            }
        });
        let mut prompt = Vec::with_capacity(req.prompt_tokens as usize);
        trace::prompt_tokens(req, &mut prompt);
        policy.learn_prompt(&prompt, &req.block_ids, fleet.engine);
        // A prefill leg asks for one token and holds the KV for the decode replica's pull.
        let (max_tokens, transfer) = match prefill_leg {
            true => (
                1,
                KvTransfer::Hold {
                    hold_s: DEFAULT_KV_HOLD_TIMEOUT_S,
                },
            ),
            false => (req.output_tokens, KvTransfer::None),
        };
        let submitted = self.engines[r].submit_with(
            t,
            EngineRequest {
                id: k as u64,
                prompt_tokens: prompt,
                max_tokens,
                cache_salt: None,
                lora: None,
            },
            transfer,
        );
        let capacity = fleet.engine.kv_capacity_tokens;
        let rec = &mut self.records[k];
        rec.replica = r as u32;
        if submitted.is_err() {
            rec.rejected = true;
            policy.settle(r, capacity, self.loads[r].queued_prefill_tokens, now_us);
            return;
        }
        if prefill_leg {
            rec.prefill_replica = Some(r as u32);
        }
        let mut estimated = self
            .routed
            .matched_tokens(r, &req.block_ids, req.prompt_tokens);
        if let Some(host) = &mut self.routed_host {
            estimated = estimated.max(host.matched_tokens(r, &req.block_ids, req.prompt_tokens));
            host.route(r, &req.block_ids, req.prompt_tokens);
        }
        rec.estimated_cached_tokens = estimated;
        self.routed.route(r, &req.block_ids, req.prompt_tokens);
        policy.route_offloaded(r, &self.view_blocks, now_us);
        let l = &mut self.loads[r];
        l.in_flight += 1;
        l.routed += 1;
        l.queued_prefill_tokens += (req.prompt_tokens - estimated) as u64;
        policy.settle(r, capacity, l.queued_prefill_tokens, now_us);
    }

    /// Request `k`'s prefill answer came at `t`: the policy chooses its decode replica among
    /// the decode replicas serving its model (`kvlb serve`'s decode leg), and the KV starts
    /// over the link; the decode replica counts it in flight from now, with nothing to prefill.
    fn route_decode(&mut self, k: usize, t: f64, policy: &mut RoutingPolicy) {
        self.fill_candidates(k, Leg::Decode);
        if self.candidates.is_empty() {
            // Not reached: a request is split only when its model has decode replicas.
            self.records[k].rejected = true;
            return;
        }
        self.hash_view_blocks(k);
        let req = &self.trace.requests[k];
        let now_us = micros(t);
        let view = request_view(req, &self.view_blocks, now_us);
        let pick = policy.select_decode(&view, &self.candidates, self.rng.next_u64());
        let d = self.candidates[pick.min(self.candidates.len() - 1)].replica;
        let rec = &mut self.records[k];
        rec.replica = d as u32;
        rec.transfer_s = req.prompt_tokens as f64 * self.fleet.pd.transfer_s_per_token;
        self.transfers.push(t + rec.transfer_s, k);
        // The decode replica keeps the KV it receives, as a prefill it computed.
        self.routed.route(d, &req.block_ids, req.prompt_tokens);
        if let Some(host) = &mut self.routed_host {
            host.route(d, &req.block_ids, req.prompt_tokens);
        }
        policy.route_offloaded(d, &self.view_blocks, now_us);
        let l = &mut self.loads[d];
        l.in_flight += 1;
        l.routed += 1;
        let capacity = self.fleet.engine.kv_capacity_tokens;
        policy.settle(d, capacity, l.queued_prefill_tokens, now_us);
    }

    /// The next transfer ended at `t`: the decode replica pulled the KV (the prefill
    /// replica's hold ends) and gets the request with it. A hold gone by then (timed out)
    /// leaves the decode replica to compute the prompt itself, as `kvlb replica` does.
    fn transfer_done(&mut self, t: f64) {
        let Some(k) = self.transfers.pop() else {
            return;
        };
        let (p, d) = match self.records[k] {
            RequestRecord {
                prefill_replica: Some(p),
                replica,
                ..
            } => (p as usize, replica as usize),
            _ => return,
        };
        let transfer = match self.engines[p].release_held(t, k as u64) {
            Some(held) => KvTransfer::Received {
                tokens: held.tokens,
            },
            None => KvTransfer::None,
        };
        let req = &self.trace.requests[k];
        let mut prompt = Vec::with_capacity(req.prompt_tokens as usize);
        trace::prompt_tokens(req, &mut prompt);
        let submitted = self.engines[d].submit_with(
            t,
            EngineRequest {
                id: k as u64,
                prompt_tokens: prompt,
                max_tokens: req.output_tokens,
                cache_salt: None,
                lora: None,
            },
            transfer,
        );
        if submitted.is_err() {
            self.records[k].rejected = true;
            self.loads[d].in_flight -= 1;
        }
    }

    /// The run, once every engine is idle: `makespan_s` is the time of the last event.
    fn finish(self, policy: &str, duplicate_samples: Vec<u64>, makespan_s: f64) -> Run {
        let pd = self.fleet.pd;
        let (mut queries, mut hits, mut host_hits) = (0, 0, 0);
        for (r, e) in self.engines.iter().enumerate() {
            let s = e.stats();
            queries += s.prefix_cache_queries_tokens;
            // The GPU hits plus the host tier's (its lookups continue the GPU's), and a
            // decode replica's received KV (its KV connector counts it as external).
            hits += s.prefix_cache_hits_tokens + s.external_prefix_cache_hits_tokens;
            if pd.role(r) != Role::Decode {
                host_hits += s.external_prefix_cache_hits_tokens;
            }
        }
        Run {
            policy: policy.to_string(),
            roles: (0..self.fleet.replicas).map(|r| pd.role(r)).collect(),
            records: self.records,
            replica_prefill_tokens: self.replica_prefill_tokens,
            prefix_queries_tokens: queries - self.decode_lookups.0,
            prefix_hits_tokens: hits - self.decode_lookups.1,
            host_hits_tokens: host_hits,
            preemptions: self.engines.iter().map(|e| e.preemptions_total()).sum(),
            duplicate_samples,
            makespan_s,
        }
    }
}

/// Prompt tokens a leg of `rec` counts as queued prefill until its first token: a decode
/// leg none (its KV was computed elsewhere), others the estimated uncached tokens.
fn queued_tokens(rec: &RequestRecord, leg: Leg) -> u64 {
    match leg {
        Leg::Decode => 0,
        _ => (rec.prompt_tokens - rec.estimated_cached_tokens) as u64,
    }
}

/// What the policy sees of `req` at `now_us`, its blocks hashed as `view_blocks`.
fn request_view<'a>(req: &TraceRequest, view_blocks: &'a [u64], now_us: u64) -> RequestView<'a> {
    RequestView {
        method: Method::Post,
        path: b"/v1/completions",
        body: b"",
        blocks: view_blocks,
        block_tokens: TRACE_BLOCK_TOKENS,
        prompt_tokens: req.prompt_tokens,
        now_us,
    }
}

/// The engine's own hashes of the full blocks of `prompt` (no cache salt), as
/// `crate::engine` computes them: chained xxh3 from a root that mixes in the engine's seed.
fn engine_block_hashes(prompt: &[u32], engine: &EngineConfig, out: &mut Vec<u64>) {
    out.clear();
    let mut parent = xxh3_64_with_seed(b"kvlb-root", engine.hash_seed);
    let mut bytes = Vec::with_capacity(4 * engine.block_size as usize);
    for block in prompt.chunks_exact(engine.block_size.max(1) as usize) {
        bytes.clear();
        for t in block {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        parent = xxh3_64_with_seed(&bytes, parent);
        out.push(parent);
    }
}

#[cfg(test)]
mod tests {
    use super::super::pd::Disaggregate;
    use super::*;
    use std::sync::{Arc, Mutex};

    /// What a policy was shown: prompt tokens, time, candidates.
    type Shown = Arc<Mutex<Vec<(u32, u64, Vec<Candidate>)>>>;

    /// Always replica 0; remembers what it was shown.
    struct Recorder(Shown);

    impl Policy for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn select(&mut self, req: &RequestView<'_>, c: &[Candidate], _random: u64) -> usize {
            self.0
                .lock()
                .unwrap()
                .push((req.prompt_tokens, req.now_us, c.to_vec()));
            0
        }
    }

    fn request(t: f64, ids: &[u64], prompt: u32, output: u32) -> TraceRequest {
        TraceRequest {
            arrival_s: t,
            prompt_tokens: prompt,
            output_tokens: output,
            block_ids: ids.to_vec(),
            model: None,
        }
    }

    #[test]
    fn loads_and_records_follow_the_engine() {
        let trace = Trace {
            name: "t".into(),
            requests: vec![
                request(0.0, &[1, 2, 3, 4], 2000, 50),
                // Arrives while the first is still prefilling: shares its first two blocks.
                request(0.01, &[1, 2, 5], 1200, 5),
                // Long after both finished.
                request(100.0, &[1, 2, 3, 4], 2000, 1),
                // Over the context limit: rejected, still accounted for.
                request(101.0, &[9; 300], 150_000, 1),
            ],
        };
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut policy = RoutingPolicy::from_policy(Box::new(Recorder(seen.clone())));
        let run = simulate(&trace, 2, &EngineConfig::default(), &mut policy, 1).unwrap();
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 4);
        assert_eq!((seen[1].0, seen[1].1), (1200, 10_000));
        // The first request is queued as 2000 uncached tokens on replica 0 when the second comes.
        assert_eq!(
            seen[1].2[0],
            Candidate {
                replica: 0,
                in_flight: 1,
                queued_prefill_tokens: 2000,
                decoding: 0,
                routed: 1,
                ..Default::default()
            }
        );
        assert_eq!(
            seen[1].2[1],
            Candidate {
                replica: 1,
                ..Default::default()
            }
        );
        // Everything drained by the third.
        assert_eq!(
            seen[2].2[0],
            Candidate {
                replica: 0,
                routed: 2,
                ..Default::default()
            }
        );
        let r = &run.records;
        assert!(r[..3]
            .iter()
            .all(|r| r.finished && !r.rejected && r.ttft_s > 0.0));
        assert!(r[3].rejected && !r[3].finished);
        assert_eq!(r[1].estimated_cached_tokens, 1024);
        assert_eq!(r[2].estimated_cached_tokens, 2000);
        assert_eq!(
            r[2].cached_tokens, 1984,
            "all but the last partial 16-token block"
        );
        assert!(r[2].ttft_s < r[0].ttft_s / 5.0);
        assert!(r[0].e2e_s > r[0].ttft_s);
        let computed: u64 = r
            .iter()
            .map(|r| (r.prompt_tokens - r.cached_tokens) as u64)
            .take(3)
            .sum();
        assert_eq!(run.replica_prefill_tokens, vec![computed, 0]);
        assert_eq!(run.prefix_queries_tokens, 5200);
        assert!(run.duplicate_samples.len() >= 10);
        assert!(run.makespan_s >= 100.0);
    }

    #[test]
    fn queued_prompts_do_not_push_resident_ones_out_of_the_routers_belief() {
        // Room for four 512-token trace blocks.
        let engine = EngineConfig {
            kv_capacity_tokens: 2048,
            ..EngineConfig::default()
        };
        let mut policy = RoutingPolicy::build("cache_aware", 1, &engine).unwrap();
        let candidates = [Candidate::default()];
        let route = |policy: &mut RoutingPolicy, ids: &[u64], pending: u64| {
            let blocks: Vec<u64> = ids.iter().map(|&id| trace::view_block(id)).collect();
            let view = RequestView {
                method: Method::Post,
                path: b"/v1/completions",
                body: b"",
                blocks: &blocks,
                block_tokens: TRACE_BLOCK_TOKENS,
                prompt_tokens: 2048,
                now_us: 0,
            };
            assert_eq!(policy.select(&view, &candidates, 0), 0);
            policy.settle(0, engine.kv_capacity_tokens, pending, 0);
        };
        let holds = |policy: &RoutingPolicy, id: u64| {
            let writer = policy.residency.as_ref().unwrap();
            writer.holds(0, trace::view_block(id))
        };
        route(&mut policy, &[1, 2, 3, 4], 2048);
        // The second prompt waits behind the first: both are believed resident.
        route(&mut policy, &[5, 6, 7, 8], 4096);
        assert!((1..=8).all(|id| holds(&policy, id)));
        // Both computed: the cache holds 2048 tokens, the older prompt is gone.
        policy.learn_pending(0, engine.kv_capacity_tokens, 0);
        assert!((1..=4).all(|id| !holds(&policy, id)));
        assert!((5..=8).all(|id| holds(&policy, id)));
    }

    #[test]
    fn engine_events_reach_the_writer_as_trace_blocks() {
        // The hashes the simulator computes are the engine's own.
        let engine = EngineConfig::default();
        let req = request(0.0, &[11, 12, 13], 1300, 1);
        let mut prompt = Vec::new();
        trace::prompt_tokens(&req, &mut prompt);
        let mut mine = Vec::new();
        engine_block_hashes(&prompt, &engine, &mut mine);
        let mut e = Engine::new(engine.clone());
        e.submit(
            0.0,
            EngineRequest {
                id: 0,
                prompt_tokens: prompt.clone(),
                max_tokens: 1,
                cache_salt: None,
                lora: None,
            },
        )
        .unwrap();
        let mut out = Vec::new();
        while let Some(t) = e.next_event_time() {
            e.advance(t, &mut out);
        }
        let mut events = Vec::new();
        e.take_kv_events(&mut events);
        let stored: Vec<u64> = events
            .iter()
            .flat_map(|ev| match ev {
                KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(mine.len(), 1300 / 16);
        assert_eq!(stored[..mine.len()], mine[..]);

        // With events, a trace block is stored when its last full engine block is, and a
        // whole fleet run confirms what it routed.
        for source in [ResidencySource::Events, ResidencySource::EventsPending] {
            let mut policy = RoutingPolicy::build("cache_aware", 1, &engine)
                .unwrap()
                .learn_from(source);
            assert!(policy.learns_from_events());
            let trace = Trace {
                name: "t".into(),
                requests: vec![req.clone(), request(50.0, &[11, 12, 14], 1100, 1)],
            };
            simulate(&trace, 1, &engine, &mut policy, 1).unwrap();
            let w = policy.residency.as_ref().unwrap();
            for id in [11, 12, 13, 14] {
                let h = trace::view_block(id);
                assert_eq!(w.copies(0, h), 1, "{id}");
                // The second request found 11 and 12 cached: nothing stored them again, so
                // they stay pending (until the replica's turnover or pending_ttl).
                let pending = source == ResidencySource::EventsPending && id < 13;
                assert_eq!(w.is_pending(0, h), pending, "{id}");
            }
        }
        let routing = RoutingPolicy::build("cache_aware", 1, &engine).unwrap();
        assert!(!routing.learns_from_events());
        assert!(!RoutingPolicy::build("round_robin", 1, &engine)
            .unwrap()
            .learn_from(ResidencySource::Events)
            .learns_from_events());
    }

    #[test]
    fn a_host_tier_feeds_cache_aware_an_offloaded_tier() {
        // GPU room for 4 trace blocks, host memory for 40.
        let engine = EngineConfig {
            kv_capacity_tokens: 2048,
            host_kv_capacity_tokens: 20_480,
            ..EngineConfig::default()
        };
        let trace = Trace {
            name: "t".into(),
            requests: vec![
                request(0.0, &[1, 2, 3], 1536, 1),
                // Pushes the first prompt out of the GPU, not out of host memory.
                request(50.0, &[4, 5, 6, 7], 1900, 1),
                request(100.0, &[1, 2, 3], 1536, 1),
            ],
        };
        for source in [
            ResidencySource::Routing,
            ResidencySource::Events,
            ResidencySource::EventsPending,
        ] {
            let mut policy = RoutingPolicy::build("cache_aware", 1, &engine)
                .unwrap()
                .learn_from(source);
            let run = simulate(&trace, 1, &engine, &mut policy, 1).unwrap();
            // The third request finds all but its last engine block: the second request's
            // 119 engine blocks left the first one's head (9 blocks, freed last) on the GPU,
            // the other 86 are loaded back from host memory.
            assert_eq!(run.records[2].cached_tokens, 1520, "{source:?}");
            assert_eq!(run.host_hits_tokens, 1520 - 9 * 16, "{source:?}");
            assert_eq!(run.prefix_hits_tokens, 1520, "hits include host hits");
            let offload = policy.offload.as_ref().expect("an offloaded tier");
            let gpu = policy.residency.as_ref().unwrap();
            for id in 1..=7 {
                let view = trace::view_block(id);
                assert!(offload.holds(0, view), "{source:?} {id}");
                if source != ResidencySource::Routing {
                    // CPU-medium events count in the offloaded tier only.
                    assert_eq!(offload.copies(0, view), 1, "{source:?} {id}");
                    assert!(gpu.copies(0, view) <= 1, "{source:?} {id}");
                }
            }
        }
        // Without a host tier there is no offloaded tier.
        let plain = RoutingPolicy::build("cache_aware", 1, &EngineConfig::default()).unwrap();
        assert!(plain.offload.is_none());
    }

    #[test]
    fn every_policy_builds_and_unknown_names_are_refused() {
        for name in POLICY_NAMES {
            let p = RoutingPolicy::build(name, 4, &EngineConfig::default()).unwrap();
            assert_eq!(p.name(), *name);
        }
        let e = RoutingPolicy::build("fastest", 4, &EngineConfig::default())
            .err()
            .unwrap();
        assert!(e.contains("unknown policy \"fastest\""), "{e}");
    }

    /// Two prefill replicas (0, 1), then two decode replicas (2, 3), on a KV link of `gbps`.
    fn two_by_two(disaggregate: Disaggregate, gbps: f64) -> Pd {
        Pd {
            roles: vec![Role::Prefill, Role::Prefill, Role::Decode, Role::Decode],
            disaggregate,
            transfer_s_per_token: crate::replica::pd::transfer_s_per_token(131_072, gbps),
        }
    }

    fn run_on(trace: &Trace, pd: &Pd, policy: &mut RoutingPolicy) -> Run {
        let engine = EngineConfig::default();
        let fleet = Fleet {
            replicas: pd.roles.len(),
            serving: None,
            engine: &engine,
            speeds: &[],
            pd,
        };
        simulate_fleet(trace, &fleet, policy, 1).unwrap()
    }

    /// `n` requests half a second apart, sharing their first trace block.
    fn spaced(n: u64, prompt: u32, output: u32) -> Trace {
        Trace {
            name: "t".into(),
            requests: (0..n)
                .map(|k| request(k as f64 * 0.5, &[1, 100 + k], prompt, output))
                .collect(),
        }
    }

    #[test]
    fn a_disaggregated_request_is_prefilled_on_one_replica_and_decoded_on_another() {
        let trace = spaced(8, 1000, 20);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut policy = RoutingPolicy::from_policy(Box::new(Recorder(seen.clone())));
        let pd = two_by_two(Disaggregate::Always, 25.0);
        let run = run_on(&trace, &pd, &mut policy);
        // Each request was offered the prefill replicas (their estimates adding the transfer),
        // then (once prefilled) the decode replicas, as decode legs.
        let offered: Vec<Vec<(usize, PdPath)>> = seen
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.2.iter().map(|c| (c.replica, c.pd)).collect())
            .collect();
        assert_eq!(offered.len(), 16);
        for legs in offered.chunks(2) {
            assert_eq!(legs[0], [(0, PdPath::Prefill), (1, PdPath::Prefill)]);
            assert_eq!(legs[1], [(2, PdPath::Decode), (3, PdPath::Decode)]);
        }
        let transfer = 1000.0 * 131_072.0 / 25e9;
        for r in &run.records {
            assert_eq!((r.prefill_replica, r.replica), (Some(0), 2), "{r:?}");
            assert!(r.finished && !r.rejected);
            assert!((r.transfer_s - transfer).abs() < 1e-12);
            assert!(r.ttft_s > transfer && r.e2e_s > r.ttft_s);
            assert_eq!(r.output_tokens, 20);
            assert!(r.itl_s().is_some_and(|itl| itl > 0.0));
        }
        // The prompts were computed on the prefill replica: the decode legs' lookups (their
        // KV received) count neither in the hit rate nor in the work.
        assert_eq!(run.prefix_queries_tokens, 8 * 1000);
        let cached: u64 = run.records.iter().map(|r| r.cached_tokens as u64).sum();
        assert_eq!(run.prefix_hits_tokens, cached);
        assert_eq!(
            cached,
            7 * 512,
            "the shared first block, from the second request on"
        );
        assert_eq!(run.replica_prefill_tokens[1..], [0, 0, 0]);
        assert_eq!(run.replica_prefill_tokens[0], 8 * 1000 - cached);
        assert_eq!(run.roles, pd.roles);
        // Every hold was released by its pull: none waited for its 480 s timeout.
        assert!(run.makespan_s < 10.0, "{}", run.makespan_s);
    }

    #[test]
    fn the_transfer_adds_to_the_time_to_first_token() {
        let trace = spaced(6, 4000, 10);
        let ttfts = |gbps: f64| {
            let mut policy =
                RoutingPolicy::build("round_robin", 4, &EngineConfig::default()).unwrap();
            let run = run_on(&trace, &two_by_two(Disaggregate::Always, gbps), &mut policy);
            run.records.iter().map(|r| r.ttft_s).collect::<Vec<f64>>()
        };
        let (fast, slow) = (ttfts(25.0), ttfts(2.5));
        // An idle decode replica: the first token comes one step after the KV, so a link ten
        // times slower adds exactly the difference in transfer time.
        let added = 4000.0 * 131_072.0 * (1.0 / 2.5e9 - 1.0 / 25e9);
        for (f, s) in fast.iter().zip(&slow) {
            assert!(
                (s - f - added).abs() < 1e-9,
                "{f} -> {s}, expected +{added}"
            );
        }
    }

    #[test]
    fn each_leg_has_its_own_turn_under_round_robin() {
        let trace = spaced(8, 1000, 5);
        let mut policy = RoutingPolicy::build("round_robin", 4, &EngineConfig::default()).unwrap();
        let run = run_on(&trace, &two_by_two(Disaggregate::Always, 25.0), &mut policy);
        let legs: Vec<(Option<u32>, u32)> = run
            .records
            .iter()
            .map(|r| (r.prefill_replica, r.replica))
            .collect();
        // Not one prefill and one decode replica in step: each leg cycles over its replicas.
        assert_eq!(
            legs[..4],
            [(Some(0), 2), (Some(1), 3), (Some(0), 2), (Some(1), 3)]
        );
    }

    #[test]
    fn priced_cache_aware_computes_on_an_idle_decode_replica_and_splits_under_load() {
        // A burst of long prompts with long answers: the first ones find the decode replicas
        // idle (computing there costs nobody anything and saves the transfer); once they
        // decode, a prefill there would stall their sequences.
        let burst = Trace {
            name: "t".into(),
            requests: (0..16)
                .map(|k| request(k as f64 * 0.01, &[200 + k; 16], 8000, 300))
                .collect(),
        };
        let split = |disaggregate| {
            let mut policy =
                RoutingPolicy::build("cache_aware", 4, &EngineConfig::default()).unwrap();
            let run = run_on(&burst, &two_by_two(disaggregate, 25.0), &mut policy);
            assert!(run.records.iter().all(|r| r.finished), "{disaggregate:?}");
            run.records
                .iter()
                .map(|r| r.prefill_replica.is_some())
                .collect::<Vec<bool>>()
        };
        let priced = split(Disaggregate::Priced);
        assert!(
            !priced[0],
            "the first request is computed on an idle decode replica"
        );
        let n = priced.iter().filter(|&&d| d).count();
        assert!(n > 0 && n < 16, "{priced:?}");
        assert!(split(Disaggregate::Always).iter().all(|&d| d));
        // Other policies always disaggregate.
        let mut policy = RoutingPolicy::build("least_loaded", 4, &EngineConfig::default()).unwrap();
        let run = run_on(&burst, &two_by_two(Disaggregate::Priced, 25.0), &mut policy);
        assert!(run.records.iter().all(|r| r.prefill_replica.is_some()));
    }

    #[test]
    fn a_fleet_description_must_match_its_size() {
        let trace = spaced(1, 100, 1);
        let engine = EngineConfig::default();
        let pd = two_by_two(Disaggregate::Always, 25.0);
        let fleet = Fleet {
            replicas: 3,
            serving: None,
            engine: &engine,
            speeds: &[],
            pd: &pd,
        };
        let mut policy = RoutingPolicy::build("random", 3, &engine).unwrap();
        let e = simulate_fleet(&trace, &fleet, &mut policy, 1)
            .err()
            .unwrap();
        assert_eq!(e, "3 replicas but 4 roles given");
        let speeds = [Speed::ONE; 2];
        let e = simulate_fleet(
            &trace,
            &Fleet {
                speeds: &speeds,
                pd: &Pd::default(),
                ..fleet
            },
            &mut policy,
            1,
        )
        .err()
        .unwrap();
        assert_eq!(e, "3 replicas but 2 speeds given");
    }

    #[test]
    fn a_request_is_offered_only_the_replicas_serving_its_model() {
        let (trace, serving) = super::super::trace::two_model_fixture();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut policy = RoutingPolicy::from_policy(Box::new(Recorder(seen.clone())));
        let run = simulate_serving(
            &trace,
            2,
            Some(&serving),
            &EngineConfig::default(),
            &[],
            &mut policy,
            1,
        )
        .unwrap();
        let offered: Vec<Vec<usize>> = seen
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.2.iter().map(|c| c.replica).collect())
            .collect();
        assert_eq!(offered, [vec![0, 1], vec![1], vec![0, 1], vec![1]]);
        let r = &run.records;
        assert_eq!(
            r.iter().map(|r| r.replica).collect::<Vec<_>>(),
            [0, 1, 0, 0, 1]
        );
        assert!(r[2].rejected && !r[2].finished, "nobody serves it");
        assert!(r.iter().enumerate().all(|(k, r)| k == 2 || r.finished));
        let e = simulate_serving(
            &trace,
            3,
            Some(&serving),
            &EngineConfig::default(),
            &[],
            &mut policy,
            1,
        )
        .err()
        .expect("a size mismatch is an error");
        assert!(e.contains("3 replicas but the names of 2"), "{e}");
    }
}
