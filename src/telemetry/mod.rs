//! Replica telemetry: what the replicas themselves say about their KV caches and queues, as
//! opposed to what kvlb guesses from its own routing.
//!
//! Two sources, both on the telemetry loop (`hub`: one thread for every replica, plus one for
//! name resolution and replays; never on a worker):
//!
//! * `events`: each replica with `kv_events` configured has a subscription to the engine's
//!   ZeroMQ KV event stream (vLLM / SGLang, replica-interfaces.md section 1), turns
//!   BlockStored / BlockRemoved / AllBlocksCleared into residency operations and sends them over
//!   a bounded channel. Sequence gaps are filled by replay when `kv_replay` is configured, else
//!   the replica's residency is cleared and it is marked stale until in-order events resume; a
//!   sequence going backwards (engine restart) clears it.
//! * `scrape`: each replica with `metrics` on (by default those with `kv_events`) has its
//!   GET /metrics polled every `metrics_interval` and publishes
//!   running / waiting requests and KV usage as atomics (`ReplicaTelemetry`) shown in /replicas
//!   and /metrics. With each scrape it also publishes the replica's requests this instance did
//!   not send, and its KV usage (`ReplicaTelemetry::reported`, a sequence lock of atomics, see
//!   `reported`); workers copy that into `select::Candidate::reported` and `cache_aware` adds
//!   it to kvlb's own counts (`estimate::reported`), so several kvlb instances in front of one
//!   fleet see each other's load.
//!
//! `ResidencyFeed` runs inside the residency writer's tick (`spawn_writer_thread`'s
//! `on_tick`): it drains the channel without ever blocking the writer, applies the operations,
//! and keeps event-backed replicas honest: routing guesses there expire after
//! `routed_guess_ttl` unless events confirmed them, and a replica silent (no events, no
//! metrics) for `telemetry_stale_after` loses its residency and is shown stale. An idle engine
//! publishes no events, so on a replica whose metrics are not polled an open event connection
//! counts as a sign of life.
//!
//! # Two tiers: GPU and offloaded
//! Engines that offload KV blocks out of GPU memory (vLLM CPU offloading, LMCache, SGLang's
//! hierarchical cache) say so in the events' `medium` (`CPU`, `DISK`, ...; absent means GPU).
//! A block held only there must be loaded back before use: cheaper than recomputing it, not
//! free, so it must not be counted as a GPU hit. Each operation carries its `Tier`: GPU
//! operations go to the main residency writer as before, offloaded ones to a second
//! `ResidencyIndex` / `ResidencyWriter` pair owned by the same writer thread (inside
//! `ResidencyFeed`, attached with `ResidencyFeed::with_offload_tier`), which `cache_aware`
//! reads only while it holds a block. A BlockRemoved drops the copy on its own medium only;
//! AllBlocksCleared, restarts, unfillable gaps, removals and silence clear both tiers. Routing
//! guesses go to the GPU tier only (a request routed to a replica leaves its prefix in GPU
//! memory), so the offloaded tier holds nothing the events did not report and needs no
//! expiry.
//!
//! # Only token-mode requests match event-derived blocks (for now)
//! Engines report blocks keyed by token ids (16 tokens for vLLM, SGLang's page size, 1 by
//! default); kvlb hashes those token ids with its own chained scheme in its own token blocks
//! (`prefix::token_block_hashes_from`; engine hashes cannot be recomputed and are kept only to
//! link parents and apply removals; pages of another size are aggregated or split, see
//! `events`). Chat and text requests are hashed in 256-byte
//! text blocks (`prefix`, text mode), so events confirm and correct only completions whose
//! prompt is given as token ids. Text requests keep relying on routing guesses, which on
//! event-backed replicas age out after `routed_guess_ttl`; the writer bounds guesses and
//! reported blocks each on their own (`ResidencyWriter`), so a replica's reports do not push
//! them out. With `tokenizer` configured, chat and text prompts are hashed as the engine's
//! token ids and events cover them too.

#![forbid(unsafe_code)]

pub mod events;
mod feed;
mod hub;
pub mod scrape;

#[cfg(test)]
mod tests;

pub use feed::ResidencyFeed;
pub use hub::THREADS;

use crate::kv_events::Medium;
use crate::metrics::{families, Collector, DescriptorEncoder, Family, Kind};
use crate::worker::Shared;
pub use crate::worker::{reported, ReplicaTelemetry, UNKNOWN};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Residency operations queued for the writer; beyond this the telemetry loop waits.
pub const OP_QUEUE: usize = 16_384;

/// Where a replica holds a KV block: GPU memory (free to use) or an offloaded tier (CPU
/// memory, disk, an external cache: loaded back before use).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Gpu,
    Offloaded,
}

impl Tier {
    /// The tier of an event's `medium` (absent means GPU; any other medium, known or not, is
    /// an offloaded tier).
    pub fn of(medium: Option<Medium>) -> Tier {
        match medium {
            None | Some(Medium::Gpu) => Tier::Gpu,
            Some(_) => Tier::Offloaded,
        }
    }
}

/// One change to a replica's residency, in kvlb's own block hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResidencyOp {
    /// One more copy of each block on `tier` (BlockStored).
    Insert {
        replica: usize,
        tier: Tier,
        blocks: Vec<u64>,
    },
    /// One copy fewer of each block on `tier` (BlockRemoved).
    Remove {
        replica: usize,
        tier: Tier,
        blocks: Vec<u64>,
    },
    /// The replica already holds each block on `tier` and just used it: most recent, no copy
    /// added (a BlockStored that reports reused blocks, see `events`).
    Touch {
        replica: usize,
        tier: Tier,
        blocks: Vec<u64>,
    },
    /// The replica holds nothing on any tier (AllBlocksCleared, restart, unfillable gap,
    /// removal).
    Clear { replica: usize },
    /// The replica (newly in this slot) holds at most this many tokens in GPU memory; its
    /// offloaded tier's capacity comes from its configuration
    /// (`ReplicaConfig::offload_capacity_tokens`).
    Capacity { replica: usize, tokens: u64 },
}

/// Starts and stops the telemetry of replica slots (on the telemetry loop, `hub`), and queues
/// residency operations for the writer (from the control thread: capacity of a new replica,
/// clearing a removed one).
#[derive(Clone)]
pub struct Telemetry {
    tx: crossbeam::channel::Sender<ResidencyOp>,
    hub: Arc<hub::Hub>,
}

/// Create the residency feed (run by the writer's tick), start the telemetry loop and, on
/// it, the telemetry of every replica in the fleet.
///
/// The feed applies offloaded-tier operations only once given that tier's writer
/// (`ResidencyFeed::with_offload_tier`); until then it drops them (an offloaded block is never
/// counted as a GPU one).
pub fn start(shared: Arc<Shared>) -> std::io::Result<(ResidencyFeed, Telemetry)> {
    let (tx, rx) = crossbeam::channel::bounded(OP_QUEUE);
    let hub = Arc::new(hub::Hub::spawn(shared.clone(), tx.clone())?);
    let t = Telemetry { tx, hub };
    for (r, slot) in shared.fleet.slots() {
        if slot.spec().is_some() {
            t.spawn_replica(&shared, r)?;
        }
    }
    Ok((ResidencyFeed::new(shared, rx), t))
}

impl Telemetry {
    /// (Re)start slot `r`'s telemetry: its event subscription if it has `kv_events`, its
    /// scrapes if it is polled. Both stop when the slot's `telemetry_stop` is set.
    pub fn spawn_replica(&self, shared: &Arc<Shared>, r: usize) -> std::io::Result<()> {
        let slot = shared.fleet.slot(r);
        if slot.spec().is_none() {
            return Ok(());
        }
        let stop = Arc::new(crate::fleet::StopSignal::new());
        if let Some(old) = slot.telemetry_stop.swap(Some(stop.clone())) {
            old.stop();
        }
        shared.telemetry[r].reset();
        self.hub.start(r, stop)
    }

    /// Queue an operation for the residency writer (waits at most a second when it is full).
    pub fn send(&self, op: ResidencyOp) -> bool {
        self.tx
            .send_timeout(op, std::time::Duration::from_secs(1))
            .is_ok()
    }
}

/// Stop every replica's telemetry.
pub fn stop_all(shared: &Shared) {
    for (_, slot) in shared.fleet.slots() {
        if let Some(stop) = slot.telemetry_stop.swap(None) {
            stop.stop();
        }
    }
}

/// A value of one replica's series at `now_ms`: whole (counts) or not (fractions, seconds).
enum Value {
    Whole(u64),
    Real(f64),
}

/// A family of per-replica series and how to read it from one replica's telemetry.
type Series = (&'static Family, fn(&ReplicaTelemetry, u64) -> Option<Value>);

/// The per-replica telemetry families on /metrics (registered by the admin listener).
pub struct TelemetryMetrics(pub Arc<Shared>);

impl std::fmt::Debug for TelemetryMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TelemetryMetrics")
    }
}

impl Collector for TelemetryMetrics {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let shared = &*self.0;
        let now = shared.now_ms();
        let series: [Series; 19] = [
            (&families::REPLICA_RUNNING, |t, _| {
                known(t.running.load(Relaxed)).map(Value::Whole)
            }),
            (&families::REPLICA_WAITING, |t, _| {
                known(t.waiting.load(Relaxed)).map(Value::Whole)
            }),
            (&families::REPLICA_KV_USAGE, |t, _| {
                known(t.kv_usage_milli.load(Relaxed)).map(|v| Value::Real(v as f64 / 1000.0))
            }),
            (&families::REPLICA_LORA_SLOTS, |t, _| {
                let l = t.reported.load().lora;
                (l.slots > 0).then_some(Value::Whole(l.slots as u64))
            }),
            (&families::REPLICA_LORA_ADAPTERS_ACTIVE, |t, _| {
                let l = t.reported.load().lora;
                (l.slots > 0).then_some(Value::Whole(l.active as u64))
            }),
            (&families::REPLICA_TELEMETRY_AGE, |t, now| {
                t.age_s(now).map(Value::Real)
            }),
            (&families::REPLICA_TELEMETRY_STALE, |t, _| {
                Some(Value::Whole(t.stale() as u64))
            }),
            (&families::REPLICA_KV_EVENTS, |t, _| {
                Some(Value::Whole(t.events_seen.load(Relaxed)))
            }),
            (&families::REPLICA_KV_EVENT_GAPS, |t, _| {
                Some(Value::Whole(t.gaps.load(Relaxed)))
            }),
            (&families::REPLICA_KV_EVENT_RESTARTS, |t, _| {
                Some(Value::Whole(t.restarts.load(Relaxed)))
            }),
            (&families::REPLICA_KV_EVENT_DECODE_ERRORS, |t, _| {
                Some(Value::Whole(t.decode_errors.load(Relaxed)))
            }),
            (&families::REPLICA_KV_EVENT_WRONG_RANK, |t, _| {
                Some(Value::Whole(t.wrong_rank.load(Relaxed)))
            }),
            (&families::REPLICA_KV_EVENT_REPLAYS, |t, _| {
                Some(Value::Whole(t.replays.load(Relaxed)))
            }),
            (&families::REPLICA_KV_EVENT_REPLAY_FAILURES, |t, _| {
                Some(Value::Whole(t.replay_failures.load(Relaxed)))
            }),
            (&families::REPLICA_KV_EVENT_CONNECT_FAILURES, |t, _| {
                Some(Value::Whole(t.connect_failures.load(Relaxed)))
            }),
            (&families::REPLICA_KV_EVENT_REUSE_REPORTS, |t, _| {
                Some(Value::Whole(t.reuse_reports.load(Relaxed)))
            }),
            (&families::REPLICA_KV_ENGINE_BLOCK_SIZE, |t, _| {
                Some(t.engine_block_size.load(Relaxed))
                    .filter(|b| *b > 0)
                    .map(Value::Whole)
            }),
            (&families::REPLICA_KV_OFFLOADED_BLOCKS, |t, _| {
                Some(Value::Whole(t.offloaded_blocks.load(Relaxed)))
            }),
            (&families::REPLICA_KV_OFFLOAD_RESIDENT_BLOCKS, |t, _| {
                Some(Value::Whole(t.offload_resident_blocks.load(Relaxed)))
            }),
        ];
        for (family, value) in series {
            let mut samples = family.describe(&mut enc)?;
            for (r, slot) in shared.fleet.slots() {
                let Some(replica) = slot.spec() else { continue };
                let labels = [replica.url.as_str()];
                match value(&shared.telemetry[r], now) {
                    None => {}
                    Some(Value::Real(v)) => samples.gauge_f64(&labels, v)?,
                    Some(Value::Whole(v)) if family.kind() == Kind::Counter => {
                        samples.counter(&labels, v)?
                    }
                    Some(Value::Whole(v)) => samples.gauge(&labels, v)?,
                }
            }
        }
        let mut samples = families::REPLICA_KV_EVENT_SKIPPED.describe(&mut enc)?;
        for (r, slot) in shared.fleet.slots() {
            let Some(replica) = slot.spec() else { continue };
            let t = &shared.telemetry[r];
            for (reason, v) in [
                ("undecodable", &t.skipped_undecodable),
                ("block_size", &t.skipped_block_size),
                ("malformed", &t.skipped_malformed),
                ("unknown_parent", &t.skipped_unknown_parent),
                ("multimodal", &t.skipped_multimodal),
            ] {
                samples.counter(&[replica.url.as_str(), reason], v.load(Relaxed))?;
            }
        }
        encode_calibration(shared, &mut enc)?;
        families::LORA_ADAPTERS
            .describe(&mut enc)?
            .gauge(&[], shared.adapters.len() as u64)?;
        Ok(())
    }
}

/// Each replica's calibration (`crate::calibration`).
fn encode_calibration(shared: &Shared, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    let replicas = || {
        shared
            .fleet
            .slots()
            .filter_map(|(r, slot)| slot.spec().map(|s| (r, s)))
    };
    let mut samples = families::REPLICA_PREFILL_PACE.describe(enc)?;
    for (r, spec) in replicas() {
        samples.gauge_f64(&[spec.url.as_str()], shared.pace[r].load().prefill as f64)?;
    }
    let mut samples = families::REPLICA_DECODE_PACE.describe(enc)?;
    for (r, spec) in replicas() {
        samples.gauge_f64(&[spec.url.as_str()], shared.pace[r].load().decode as f64)?;
    }
    let mut samples = families::REPLICA_QUEUE_PACE.describe(enc)?;
    for (r, spec) in replicas() {
        samples.gauge_f64(&[spec.url.as_str()], shared.pace[r].load().queue as f64)?;
    }
    let mut samples = families::REPLICA_TTFT_OBSERVED_OVER_ESTIMATED.describe(enc)?;
    for (r, spec) in replicas() {
        if let Some(e) = shared.pace[r].observed_over_estimated() {
            samples.gauge_f64(&[spec.url.as_str()], e)?;
        }
    }
    let mut samples = families::REPLICA_CALIBRATION_SAMPLES.describe(enc)?;
    for (r, spec) in replicas() {
        let p = &shared.pace[r];
        samples.counter(&[spec.url.as_str(), "ttft"], p.ttft_samples.load(Relaxed))?;
        samples.counter(
            &[spec.url.as_str(), "decode"],
            p.decode_samples.load(Relaxed),
        )?;
        samples.counter(
            &[spec.url.as_str(), "metrics"],
            p.metrics_samples.load(Relaxed),
        )?;
    }
    let mut samples = families::REPLICA_CALIBRATION_METRICS_SKIPPED.describe(enc)?;
    for (r, spec) in replicas() {
        let t = &shared.telemetry[r];
        for (reason, v) in [
            ("reset", &t.prefill_skipped_reset),
            ("no_work", &t.prefill_skipped_no_work),
            ("own_samples", &t.prefill_skipped_own),
        ] {
            samples.counter(&[spec.url.as_str(), reason], v.load(Relaxed))?;
        }
    }
    let mut samples = families::REPLICA_CALIBRATION_OUTLIERS.describe(enc)?;
    for (r, spec) in replicas() {
        samples.counter(&[spec.url.as_str()], shared.pace[r].outliers.load(Relaxed))?;
    }
    let mut samples = families::CALIBRATION_SAMPLES_DROPPED.describe(enc)?;
    samples.counter(&["queue_full"], shared.samples.dropped())?;
    samples.counter(&["stale"], shared.samples_stale.load(Relaxed))?;
    Ok(())
}

/// `v` unless it is `UNKNOWN`.
fn known(v: u64) -> Option<u64> {
    (v != UNKNOWN).then_some(v)
}
