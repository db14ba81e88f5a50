//! Replica telemetry: what the replicas themselves say about their KV caches and queues, as
//! opposed to what kvlb guesses from its own routing.
//!
//! Two sources, each on its own control threads (never on a worker):
//!
//! * `events`: one thread per replica with `kv_events` configured subscribes to the engine's
//!   ZeroMQ KV event stream (vLLM / SGLang, replica-interfaces.md section 1), turns
//!   BlockStored / BlockRemoved / AllBlocksCleared into residency operations and sends them over
//!   a bounded channel. Sequence gaps are filled by replay when `kv_replay` is configured, else
//!   the replica's residency is cleared and it is marked stale until in-order events resume; a
//!   sequence going backwards (engine restart) clears it.
//! * `scrape`: one thread per replica (those with `metrics` on, by default those with
//!   `kv_events`) polls GET /metrics every `metrics_interval` and publishes
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
//! Engines report 16-token blocks keyed by token ids; kvlb hashes those token ids with its own
//! chained scheme (`prefix::token_block_hashes_from`; engine hashes cannot be recomputed and are
//! kept only to link parents and apply removals). Chat and text requests are hashed in 256-byte
//! text blocks (`prefix`, text mode), so events confirm and correct only completions whose
//! prompt is given as token ids. Text requests keep relying on routing guesses, which on
//! event-backed replicas age out after `routed_guess_ttl`; the writer bounds guesses and
//! reported blocks each on their own (`ResidencyWriter`), so a replica's reports do not push
//! them out. With `tokenizer` configured, chat and text prompts are hashed as the engine's
//! token ids and events cover them too.

#![forbid(unsafe_code)]

pub mod events;
mod feed;
pub mod reported;
pub mod scrape;

#[cfg(test)]
mod tests;

pub use feed::ResidencyFeed;

use crate::kv_events::Medium;
use crate::metrics::{families, Collector, DescriptorEncoder, Family, Kind};
use crate::worker::Shared;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Residency operations queued for the writer; beyond this the event threads wait.
pub const OP_QUEUE: usize = 16_384;

/// Sentinel of a gauge never measured.
pub const UNKNOWN: u64 = u64::MAX;

/// What kvlb knows of one replica from its own reports. Written by the telemetry threads and
/// the residency writer, read by the admin thread (and later the cost model): plain atomics.
#[derive(Debug)]
pub struct ReplicaTelemetry {
    /// Requests running / waiting on the replica (sum over its engines); `UNKNOWN` until the
    /// first scrape.
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    /// KV cache usage in thousandths (0..=1000), `UNKNOWN` until scraped.
    pub kv_usage_milli: AtomicU64,
    /// `Shared::now_ms` of the last event batch or successful scrape (0: never).
    pub last_update_ms: AtomicU64,
    pub last_event_ms: AtomicU64,
    pub last_metrics_ms: AtomicU64,
    pub scrapes: AtomicU64,
    pub scrape_errors: AtomicU64,
    /// KV events applied, batches received.
    pub events_seen: AtomicU64,
    pub batches_seen: AtomicU64,
    /// Connected to the replica's event publisher right now.
    pub events_connected: AtomicBool,
    /// Residency dropped after a sequence gap that replay could not fill; cleared by the next
    /// in-order batch.
    pub stale_gap: AtomicBool,
    /// Residency dropped because neither events nor metrics came for `telemetry_stale_after`.
    pub stale_silent: AtomicBool,
    /// Blocks stored on a tier other than GPU (BlockStored with a non-GPU medium, counted).
    pub offloaded_blocks: AtomicU64,
    /// Blocks the offloaded tier holds for the replica now (set by the residency writer).
    pub offload_resident_blocks: AtomicU64,
    /// BlockStored skipped: parent unknown, malformed (token count), or a block size other
    /// than kvlb's token block.
    pub skipped_unknown_parent: AtomicU64,
    pub skipped_malformed: AtomicU64,
    pub skipped_block_size: AtomicU64,
    /// Messages that were not a valid event batch.
    pub decode_errors: AtomicU64,
    /// Sequence gaps seen, gaps filled by replay, engine restarts (sequence went backwards).
    pub gaps: AtomicU64,
    pub replays: AtomicU64,
    pub restarts: AtomicU64,
    /// Connections to the event publisher made.
    pub connects: AtomicU64,
    /// Engine blocks the event thread knows now (its map from engine block hash to kvlb's
    /// hash and copy count, which resolves parents and removals), published after each batch.
    pub engine_blocks: AtomicU64,
    /// The last scrape net of this instance's requests, for the cost model (workers read it).
    pub reported: reported::ReportedLoadCell,
}

impl Default for ReplicaTelemetry {
    fn default() -> ReplicaTelemetry {
        ReplicaTelemetry {
            running: AtomicU64::new(UNKNOWN),
            waiting: AtomicU64::new(UNKNOWN),
            kv_usage_milli: AtomicU64::new(UNKNOWN),
            last_update_ms: AtomicU64::new(0),
            last_event_ms: AtomicU64::new(0),
            last_metrics_ms: AtomicU64::new(0),
            scrapes: AtomicU64::new(0),
            scrape_errors: AtomicU64::new(0),
            events_seen: AtomicU64::new(0),
            batches_seen: AtomicU64::new(0),
            events_connected: AtomicBool::new(false),
            stale_gap: AtomicBool::new(false),
            stale_silent: AtomicBool::new(false),
            offloaded_blocks: AtomicU64::new(0),
            offload_resident_blocks: AtomicU64::new(0),
            skipped_unknown_parent: AtomicU64::new(0),
            skipped_malformed: AtomicU64::new(0),
            skipped_block_size: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            engine_blocks: AtomicU64::new(0),
            reported: reported::ReportedLoadCell::default(),
        }
    }
}

impl ReplicaTelemetry {
    /// Forget everything (the slot got a new replica) but `offload_resident_blocks`, which
    /// mirrors the residency writer's state and is cleared with it.
    pub fn reset(&self) {
        let d = ReplicaTelemetry::default();
        macro_rules! copy {
            ($($f:ident),*) => { $( self.$f.store(d.$f.load(Relaxed), Relaxed); )* };
        }
        copy!(
            running,
            waiting,
            kv_usage_milli,
            last_update_ms,
            last_event_ms,
            last_metrics_ms,
            scrapes,
            scrape_errors,
            events_seen,
            batches_seen,
            events_connected,
            stale_gap,
            stale_silent,
            offloaded_blocks,
            skipped_unknown_parent,
            skipped_malformed,
            skipped_block_size,
            decode_errors,
            gaps,
            replays,
            restarts,
            connects,
            engine_blocks
        );
        self.reported.clear();
    }

    pub fn stale(&self) -> bool {
        self.stale_gap.load(Relaxed) || self.stale_silent.load(Relaxed)
    }

    /// Note fresh telemetry at `now_ms` (never stores 0, which means "never").
    pub fn touch(&self, now_ms: u64) {
        self.last_update_ms.store(now_ms.max(1), Relaxed);
    }

    /// Seconds since the last telemetry, None if never.
    pub fn age_s(&self, now_ms: u64) -> Option<f64> {
        match self.last_update_ms.load(Relaxed) {
            0 => None,
            t => Some(now_ms.saturating_sub(t) as f64 / 1000.0),
        }
    }

    /// The replica's entry in /replicas.
    pub fn to_json(&self, now_ms: u64) -> serde_json::Value {
        let gauge = |a: &AtomicU64| match a.load(Relaxed) {
            UNKNOWN => serde_json::Value::Null,
            v => v.into(),
        };
        let kv_usage = match self.kv_usage_milli.load(Relaxed) {
            UNKNOWN => serde_json::Value::Null,
            v => (v as f64 / 1000.0).into(),
        };
        let r = self.reported.load();
        let reported = serde_json::json!({
            "fresh": r.fresh(now_ms),
            "foreign_waiting": r.foreign_waiting,
            "foreign_running": r.foreign_running,
            "kv_usage": r.kv_usage_milli as f64 / 1000.0,
        });
        serde_json::json!({
            "running": gauge(&self.running),
            "waiting": gauge(&self.waiting),
            "kv_usage": kv_usage,
            "age_s": self.age_s(now_ms),
            "stale": self.stale(),
            "stale_gap": self.stale_gap.load(Relaxed),
            "stale_silent": self.stale_silent.load(Relaxed),
            "scrapes": self.scrapes.load(Relaxed),
            "scrape_errors": self.scrape_errors.load(Relaxed),
            "events_connected": self.events_connected.load(Relaxed),
            "events_seen": self.events_seen.load(Relaxed),
            "batches_seen": self.batches_seen.load(Relaxed),
            "offloaded_blocks": self.offloaded_blocks.load(Relaxed),
            "offload_resident_blocks": self.offload_resident_blocks.load(Relaxed),
            "skipped_unknown_parent": self.skipped_unknown_parent.load(Relaxed),
            "skipped_malformed": self.skipped_malformed.load(Relaxed),
            "skipped_block_size": self.skipped_block_size.load(Relaxed),
            "decode_errors": self.decode_errors.load(Relaxed),
            "gaps": self.gaps.load(Relaxed),
            "replays": self.replays.load(Relaxed),
            "restarts": self.restarts.load(Relaxed),
            "connects": self.connects.load(Relaxed),
            "engine_blocks": self.engine_blocks.load(Relaxed),
            "reported": reported,
        })
    }
}

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
    /// The replica holds nothing on any tier (AllBlocksCleared, restart, unfillable gap,
    /// removal).
    Clear { replica: usize },
    /// The replica (newly in this slot) holds at most this many tokens in GPU memory; its
    /// offloaded tier's capacity comes from its configuration
    /// (`ReplicaConfig::offload_capacity_tokens`).
    Capacity { replica: usize, tokens: u64 },
}

/// Starts and stops the telemetry threads of replica slots, and queues residency operations
/// for the writer (from the control thread: capacity of a new replica, clearing a removed one).
#[derive(Clone)]
pub struct Telemetry {
    tx: crossbeam::channel::Sender<ResidencyOp>,
}

/// Create the residency feed (run by the writer's tick) and start the telemetry threads of
/// every replica in the fleet.
///
/// The feed applies offloaded-tier operations only once given that tier's writer
/// (`ResidencyFeed::with_offload_tier`); until then it drops them (an offloaded block is never
/// counted as a GPU one).
pub fn start(shared: Arc<Shared>) -> std::io::Result<(ResidencyFeed, Telemetry)> {
    let (tx, rx) = crossbeam::channel::bounded(OP_QUEUE);
    let t = Telemetry { tx };
    for (r, slot) in shared.fleet.slots() {
        if slot.spec().is_some() {
            t.spawn_replica(&shared, r)?;
        }
    }
    Ok((ResidencyFeed::new(shared, rx), t))
}

impl Telemetry {
    /// Start the threads of slot `r`'s replica (event subscriber if it has `kv_events`, metrics
    /// scraper if it is polled); they stop when the slot's `telemetry_stop` is set.
    pub fn spawn_replica(&self, shared: &Arc<Shared>, r: usize) -> std::io::Result<()> {
        let slot = shared.fleet.slot(r);
        let Some(replica) = slot.spec() else {
            return Ok(());
        };
        let stop = Arc::new(crate::fleet::StopSignal::new());
        if let Some(old) = slot.telemetry_stop.swap(Some(stop.clone())) {
            old.stop();
        }
        shared.telemetry[r].reset();
        if let Some(endpoint) = replica.kv_events.clone() {
            let source = events::EventSource {
                replica: r,
                endpoint,
                replay: replica.kv_replay.clone(),
                token_block_size: shared.prefix.token_block_size,
            };
            let (shared, stop, tx) = (shared.clone(), stop.clone(), self.tx.clone());
            std::thread::Builder::new()
                .name(format!("kvlb-events-{r}"))
                .spawn(move || events::run(source, shared, tx, stop))?;
        }
        if replica.scrape_metrics() {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("kvlb-scrape-{r}"))
                .spawn(move || scrape::run(r, shared, stop))?;
        }
        Ok(())
    }

    /// Queue an operation for the residency writer (waits at most a second when it is full).
    pub fn send(&self, op: ResidencyOp) -> bool {
        self.tx
            .send_timeout(op, std::time::Duration::from_secs(1))
            .is_ok()
    }
}

/// Stop every replica's telemetry threads.
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
        let series: [Series; 10] = [
            (&families::REPLICA_RUNNING, |t, _| {
                known(t.running.load(Relaxed)).map(Value::Whole)
            }),
            (&families::REPLICA_WAITING, |t, _| {
                known(t.waiting.load(Relaxed)).map(Value::Whole)
            }),
            (&families::REPLICA_KV_USAGE, |t, _| {
                known(t.kv_usage_milli.load(Relaxed)).map(|v| Value::Real(v as f64 / 1000.0))
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
        Ok(())
    }
}

/// `v` unless it is `UNKNOWN`.
fn known(v: u64) -> Option<u64> {
    (v != UNKNOWN).then_some(v)
}
