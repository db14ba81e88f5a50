//! What kvlb knows of each replica from its own reports (KV events, /metrics): one
//! `ReplicaTelemetry` per fleet slot in `Shared`, written by the telemetry threads and the
//! residency writer, read by the admin thread and the cost model. It lives here, with the state
//! it is part of, so that `telemetry` depends on `worker` and not the other way round.

#![forbid(unsafe_code)]

use super::reported;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

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
    /// BlockStored skipped: parent unknown, malformed (token count), or a block size kvlb
    /// cannot map to its token blocks (neither a divisor nor a multiple of kvlb's, or pages
    /// that straddle kvlb's blocks).
    pub skipped_unknown_parent: AtomicU64,
    pub skipped_malformed: AtomicU64,
    pub skipped_block_size: AtomicU64,
    /// Blocks not kept because their hash covers multimodal items or prompt embeddings (vLLM
    /// `extra_keys`), which no request's text or token ids name.
    pub skipped_multimodal: AtomicU64,
    /// Blocks stored under a LoRA adapter, and (from a prompt's start) under a cache salt.
    pub adapter_blocks: AtomicU64,
    pub salted_blocks: AtomicU64,
    /// Messages that were not a valid event batch.
    pub decode_errors: AtomicU64,
    /// Batches of a data-parallel rank's stream whose `data_parallel_rank` named another rank
    /// (not applied: the endpoint is another rank's, or the ports are not offset as assumed).
    pub wrong_rank: AtomicU64,
    /// Sequence gaps seen, gaps filled by replay, engine restarts (sequence went backwards).
    pub gaps: AtomicU64,
    pub replays: AtomicU64,
    pub restarts: AtomicU64,
    /// Connections to the event publisher made.
    pub connects: AtomicU64,
    /// Engine blocks the telemetry loop knows now (its map from engine block hash to kvlb's
    /// hash and copy count, which resolves parents and removals), published after each batch.
    pub engine_blocks: AtomicU64,
    /// The last scrape net of this instance's requests, for the cost model (workers read it).
    pub reported: reported::ReportedLoadCell,
    /// BlockStored events that only reported blocks already held (vLLM's reuse reports in
    /// `kv_cache_report_mode = "full"`: parent none, from the prompt's start, every block
    /// held on that medium), and the blocks of BlockStored events from the prompt's start
    /// counted as a refresh rather than a new copy (those of reuse reports included).
    pub reuse_reports: AtomicU64,
    pub refreshed_blocks: AtomicU64,
    /// The largest block size (tokens) the replica's BlockStored events used, that kvlb can
    /// aggregate or split into its own token blocks (0: none yet). It is the engine's page:
    /// vLLM's partial-block entries are smaller, SGLang's default is 1.
    pub engine_block_size: AtomicU64,
    /// Events of a batch that could not be read (the batch's other events were applied).
    pub skipped_undecodable: AtomicU64,
    /// Replay requests that failed or came back without every missing batch.
    pub replay_failures: AtomicU64,
    /// Attempts to connect to the replica's KV event endpoint that failed.
    pub connect_failures: AtomicU64,
    /// The replica's prefill reports between two scrapes not taken for calibration: across a
    /// counter reset (a restart), or requests without computed tokens or seconds, or while
    /// kvlb's own samples measured the replica (`telemetry::scrape`).
    pub prefill_skipped_reset: AtomicU64,
    pub prefill_skipped_no_work: AtomicU64,
    pub prefill_skipped_own: AtomicU64,
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
            skipped_multimodal: AtomicU64::new(0),
            adapter_blocks: AtomicU64::new(0),
            salted_blocks: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            wrong_rank: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            engine_blocks: AtomicU64::new(0),
            reported: reported::ReportedLoadCell::default(),
            reuse_reports: AtomicU64::new(0),
            refreshed_blocks: AtomicU64::new(0),
            engine_block_size: AtomicU64::new(0),
            skipped_undecodable: AtomicU64::new(0),
            replay_failures: AtomicU64::new(0),
            connect_failures: AtomicU64::new(0),
            prefill_skipped_reset: AtomicU64::new(0),
            prefill_skipped_no_work: AtomicU64::new(0),
            prefill_skipped_own: AtomicU64::new(0),
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
            skipped_multimodal,
            adapter_blocks,
            salted_blocks,
            decode_errors,
            wrong_rank,
            gaps,
            replays,
            restarts,
            connects,
            engine_blocks,
            reuse_reports,
            refreshed_blocks,
            engine_block_size,
            skipped_undecodable,
            replay_failures,
            connect_failures,
            prefill_skipped_reset,
            prefill_skipped_no_work,
            prefill_skipped_own
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
            "lora_slots": r.lora.slots,
            "lora_adapters_active": r.lora.active,
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
            "skipped_multimodal": self.skipped_multimodal.load(Relaxed),
            "adapter_blocks": self.adapter_blocks.load(Relaxed),
            "salted_blocks": self.salted_blocks.load(Relaxed),
            "skipped_undecodable": self.skipped_undecodable.load(Relaxed),
            "decode_errors": self.decode_errors.load(Relaxed),
            "wrong_rank": self.wrong_rank.load(Relaxed),
            "gaps": self.gaps.load(Relaxed),
            "replays": self.replays.load(Relaxed),
            "replay_failures": self.replay_failures.load(Relaxed),
            "connect_failures": self.connect_failures.load(Relaxed),
            "restarts": self.restarts.load(Relaxed),
            "connects": self.connects.load(Relaxed),
            "engine_blocks": self.engine_blocks.load(Relaxed),
            "reported": reported,
            "reuse_reports": self.reuse_reports.load(Relaxed),
            "refreshed_blocks": self.refreshed_blocks.load(Relaxed),
            "engine_block_size": match self.engine_block_size.load(Relaxed) {
                0 => serde_json::Value::Null,
                v => v.into(),
            },
        })
    }
}
