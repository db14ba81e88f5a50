//! Counters and histograms of the data plane, and the one way kvlb exposes metrics.
//!
//! Each worker writes only its own `WorkerStats` (relaxed atomics on its own cache lines: no
//! locks, no sharing between writers); the admin thread sums them when /metrics is scraped.
//! Replica in-flight counts are the one figure shared by all workers, since `least_loaded` and
//! `power_of_two` read them.
//!
//! A counter with one writer needs no read-modify-write instruction: `add` is a relaxed load
//! and a relaxed store (plain moves on x86), where `fetch_add` is a locked instruction that
//! also orders the core's memory traffic. A request updates about twenty of them; only the
//! figures several workers write (replica in-flight, queued prefill, decoding, queue slots)
//! keep `fetch_add`.
//!
//! Exposition: every family kvlb exposes is declared once, in [`families`] (name, help, type,
//! label names); nothing else can declare one. The modules that own the figures implement
//! prometheus-client's [`Collector`] and, when /metrics is scraped, read their atomics and
//! write each family through [`Family::describe`]; the admin listener registers the collectors
//! in one `Registry` and [`render`] encodes it as Prometheus text (version 0.0.4). Nothing on
//! the request path changes for it: no lock, no allocation, the same relaxed atomics.

#![forbid(unsafe_code)]

mod encode;
pub mod families;
mod process;

pub use encode::{render, Family, Kind, Samples, CONTENT_TYPE};
pub use families::ALL;
pub use process::ProcessMetrics;
pub use prometheus_client::collector::Collector;
pub use prometheus_client::encoding::DescriptorEncoder;
pub use prometheus_client::registry::Registry;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

/// Latency bucket upper bounds, seconds.
pub const BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];
/// The same bounds in microseconds, for `observe_us`.
const BUCKETS_US: [u64; 16] = [
    500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
    2_500_000, 5_000_000, 10_000_000, 30_000_000, 60_000_000,
];

/// Add `n` to a counter only the calling thread writes (a worker's own statistics): a relaxed
/// load and store, no locked instruction. Readers see every update, possibly late.
#[inline(always)]
pub fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Relaxed).wrapping_add(n), Relaxed);
}

/// Take `n` from a counter only the calling thread writes (see `add`).
#[inline(always)]
pub fn sub(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Relaxed).wrapping_sub(n), Relaxed);
}

#[derive(Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_us: AtomicU64,
}

/// Matched-token bucket upper bounds.
pub const TOKEN_BUCKETS: [f64; 10] = [
    0.0, 64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0,
];
/// Observed / estimated time-to-first-token bucket upper bounds.
pub const RATIO_BUCKETS: [f64; 10] = [0.25, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 4.0, 8.0];

/// A histogram over fixed bounds, with values in thousandths for the sum.
pub struct ValueHistogram {
    bounds: &'static [f64],
    counts: [AtomicU64; 11],
    sum_milli: AtomicU64,
}

impl ValueHistogram {
    pub fn new(bounds: &'static [f64; 10]) -> ValueHistogram {
        ValueHistogram {
            bounds,
            counts: Default::default(),
            sum_milli: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        add(&self.counts[i], 1);
        add(&self.sum_milli, (v.max(0.0) * 1000.0) as u64);
    }
}

/// How `cache_aware` decided (index: Reason as usize order cache, load, fallback).
pub const REASONS: [&str; 4] = ["cache", "load", "fallback", "affinity"];
/// How a request of a model with prefill and decode replicas went (`proxy::pd`): computed on a
/// prefill replica and continued from its KV on a decode replica; the prefill answer carried
/// no KV transfer parameters (the decode replica computed the prompt); every prefill replica
/// failed or was busy (the request went whole to a decode replica); the prefill replica
/// refused the request (4xx: sent whole, so the client gets the engine's own answer); computed
/// on a decode replica directly, as the cost model found better.
pub const PD_OUTCOMES: [&str; 5] = [
    "disaggregated",
    "no_params",
    "prefill_failed",
    "prefill_refused",
    "direct",
];
pub const PD_DISAGGREGATED: usize = 0;
pub const PD_NO_PARAMS: usize = 1;
pub const PD_PREFILL_FAILED: usize = 2;
pub const PD_PREFILL_REFUSED: usize = 3;
pub const PD_DIRECT: usize = 4;
/// What became of a request naming a stored response (`previous_response_id`, or the id in a
/// `/v1/responses/{id}` path): sent to the replica that stored it; the id unknown here (another
/// kvlb relayed it, or it expired or was evicted); its replica gone or unhealthy.
pub const AFFINITY_OUTCOMES: [&str; 3] = ["routed", "unknown", "unavailable"];
pub const AFFINITY_ROUTED: usize = 0;
pub const AFFINITY_UNKNOWN: usize = 1;
pub const AFFINITY_UNAVAILABLE: usize = 2;
/// What kvlb learned from a successful Responses API answer it relayed: its id stored; stored
/// over a live entry (the table is small for the TTL); no id in its first bytes.
pub const RESPONSE_ID_OUTCOMES: [&str; 3] = ["learned", "evicted", "missed"];

/// Why a POST body on a prompt path could not be read as a prompt (PromptError labels).
pub const PROMPT_ERRORS: [&str; 8] = [
    "truncated",
    "syntax",
    "too_deep",
    "not_an_object",
    "missing_field",
    "wrong_type",
    "duplicate_key",
    "empty_prompt",
];

/// Status classes, the `status` label of `ReplicaStats::responses` and
/// `ModelStats::responses` (index: `status_class`).
pub const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// The index in `STATUS_CLASSES` of an HTTP status (below 100 counts as 1xx, above 599 as 5xx).
#[inline]
pub fn status_class(status: u16) -> usize {
    (status / 100).clamp(1, 5) as usize - 1
}

/// Why a response was cut short after its head reached the client (`proxy::relay::Cut` order).
pub const CUT_CAUSES: [&str; 3] = ["closed", "reset", "malformed"];

impl Histogram {
    /// Record `us` microseconds (single writer: the worker that owns the histogram).
    pub fn observe_us(&self, us: u64) {
        let i = BUCKETS_US
            .iter()
            .position(|b| us <= *b)
            .unwrap_or(BUCKETS_US.len());
        add(&self.counts[i], 1);
        add(&self.sum_us, us);
    }
}

/// One replica's counters in one worker's `WorkerStats` (the admin thread sums the workers).
#[derive(Default)]
pub struct ReplicaStats {
    /// Responses by status class 1xx..5xx (index 0..4), as forwarded from the replica.
    pub responses: [AtomicU64; 5],
    /// Errors kvlb answered for this replica: 502, 504, and 503 after its 503 could not be
    /// retried elsewhere.
    pub bad_gateway: AtomicU64,
    pub gateway_timeout: AtomicU64,
    pub unavailable: AtomicU64,
    /// Requests that failed here (connect error, immediate 503) and were tried elsewhere.
    pub retries: AtomicU64,
    /// Times passive health checks ejected this replica.
    pub ejections: AtomicU64,
    /// Client went away before the response completed.
    pub client_aborts: AtomicU64,
    /// Responses cut short after their head reached the client, by cause (`CUT_CAUSES`).
    pub cut: [AtomicU64; 3],
    pub bytes_to_replica: AtomicU64,
    pub bytes_from_replica: AtomicU64,
    pub connects: AtomicU64,
    pub reuses: AtomicU64,
}

/// One model label's counters in one worker's `WorkerStats` (labels: `crate::models`).
#[derive(Default)]
pub struct ModelStats {
    /// Requests naming the model, by the class 1xx..5xx of the status sent to the client,
    /// kvlb's own answers included (index 0..4).
    pub responses: [AtomicU64; 5],
    /// From the request received to the first response body byte.
    pub first_token: Histogram,
    /// Estimated prompt tokens, and those resident on the replica chosen.
    pub prompt_tokens: AtomicU64,
    pub matched_tokens: AtomicU64,
}

impl ModelStats {
    /// Counts a request's end with `status` (0: none sent; not counted).
    #[inline]
    pub fn answered(&self, status: u16) {
        if status >= 100 {
            add(&self.responses[status_class(status)], 1);
        }
    }
}

#[repr(align(128))]
pub struct WorkerStats {
    pub accepted: AtomicU64,
    pub open_connections: AtomicU64,
    pub in_flight: AtomicU64,
    pub requests: AtomicU64,
    /// Requests that waited in the queue for a replica below its concurrency limit.
    pub queued: AtomicU64,
    /// Heap allocations made by the worker's thread (published after each request).
    pub allocations: AtomicU64,
    /// Multishot receives throttled because their task fell behind, and stopped for want of a
    /// provided buffer (published after each request, like `allocations`).
    pub recv_throttled: AtomicU64,
    pub recv_buffer_shortages: AtomicU64,
    /// L7 response body bytes moved by splice (`splice_responses_from`).
    pub spliced_bytes: AtomicU64,
    /// Requests refused (503) because bodies in flight held `max_body_memory`.
    pub body_memory_refused: AtomicU64,
    /// kvlb's own error responses by status (400, 408, 413, 431, 501, 503, other).
    pub local_errors: [AtomicU64; 9],
    pub ttfb: Histogram,
    pub total: Histogram,
    /// From the request received to the first response body byte (the first token).
    pub first_token: Histogram,
    pub matched_tokens: ValueHistogram,
    pub estimated_ttft: Histogram,
    pub ttft_ratio: ValueHistogram,
    pub decisions: [AtomicU64; 4],
    pub spills: AtomicU64,
    /// Requests sent to a replica whose LoRA batch slots were held by other adapters.
    pub lora_slot_waits: AtomicU64,
    /// Requests naming a stored response, by `AFFINITY_OUTCOMES`.
    pub affinity: [AtomicU64; 3],
    /// Disaggregated requests, by `PD_OUTCOMES`.
    pub pd: [AtomicU64; 5],
    /// Responses API answers relayed, by `RESPONSE_ID_OUTCOMES`.
    pub response_ids: [AtomicU64; 3],
    pub prompt_errors: [AtomicU64; 8],
    /// Prompts a bound stopped, by `prompt::Bound` (`Bound::ALL` order).
    pub prompt_truncated: [AtomicU64; 4],
    pub replicas: Vec<ReplicaStats>,
    /// Per model label (`crate::models::MAX_MODEL_LABELS` of them).
    pub models: Vec<ModelStats>,
}

pub const LOCAL_ERROR_CODES: [u16; 9] = [400, 401, 408, 413, 429, 431, 501, 503, 0];

impl WorkerStats {
    pub fn new(replicas: usize) -> WorkerStats {
        WorkerStats {
            accepted: AtomicU64::new(0),
            open_connections: AtomicU64::new(0),
            recv_throttled: AtomicU64::new(0),
            spliced_bytes: AtomicU64::new(0),
            body_memory_refused: AtomicU64::new(0),
            recv_buffer_shortages: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            local_errors: Default::default(),
            ttfb: Histogram::default(),
            total: Histogram::default(),
            first_token: Histogram::default(),
            matched_tokens: ValueHistogram::new(&TOKEN_BUCKETS),
            estimated_ttft: Histogram::default(),
            ttft_ratio: ValueHistogram::new(&RATIO_BUCKETS),
            decisions: Default::default(),
            spills: AtomicU64::new(0),
            lora_slot_waits: AtomicU64::new(0),
            affinity: Default::default(),
            pd: Default::default(),
            response_ids: Default::default(),
            prompt_errors: Default::default(),
            prompt_truncated: Default::default(),
            replicas: (0..replicas).map(|_| ReplicaStats::default()).collect(),
            models: (0..crate::models::MAX_MODEL_LABELS)
                .map(|_| ModelStats::default())
                .collect(),
        }
    }

    /// The counters of a request's model label (`ModelClass::label`).
    #[inline]
    pub fn model(&self, label: u16) -> &ModelStats {
        self.models.get(label as usize).unwrap_or(&self.models[0])
    }

    pub fn local_error(&self, status: u16) {
        let i = LOCAL_ERROR_CODES
            .iter()
            .position(|c| *c == status)
            .unwrap_or(LOCAL_ERROR_CODES.len() - 1);
        add(&self.local_errors[i], 1);
    }
}

/// One replica's load gauges, shared by every worker: requests in flight, prefill queued,
/// decoding (what `least_loaded`, `power_of_two` and `cache_aware` read).
#[repr(align(128))]
#[derive(Default)]
pub struct ReplicaGauges {
    pub in_flight: AtomicU32,
    /// Estimated prompt tokens routed here whose prefill has not finished (no first byte yet).
    pub queued_prefill_tokens: AtomicU64,
    /// Requests here past their first byte.
    pub decoding: AtomicU32,
    /// This instance's requests here for LoRA adapters.
    pub lora: OwnLoraCounts,
    /// Requests sent here so far (cache_aware reads their recent rate).
    pub routed: AtomicU64,
}

/// This instance's requests on one replica for LoRA adapters, by the adapter's bit in
/// `estimate::LoraMask`, and the number of bits with requests: raised when a request is sent,
/// lowered when it ends (`worker::in_flight`). A bit's 0 -> 1 and 1 -> 0 steps are each seen by
/// exactly one fetch, so `adapters` never drifts.
pub struct OwnLoraCounts {
    requests: [std::sync::atomic::AtomicU16; crate::estimate::LoraMask::BITS],
    adapters: AtomicU32,
}

impl Default for OwnLoraCounts {
    fn default() -> OwnLoraCounts {
        OwnLoraCounts {
            requests: std::array::from_fn(|_| Default::default()),
            adapters: AtomicU32::new(0),
        }
    }
}

impl OwnLoraCounts {
    /// A request for the adapter whose name hash is `lora` (0: none) was sent.
    pub fn enter(&self, lora: u64) {
        if lora != 0 {
            let b = crate::estimate::LoraMask::bit_index(lora);
            if self.requests[b].fetch_add(1, Relaxed) == 0 {
                self.adapters.fetch_add(1, Relaxed);
            }
        }
    }

    /// That request ended.
    pub fn leave(&self, lora: u64) {
        if lora != 0 {
            let b = crate::estimate::LoraMask::bit_index(lora);
            if self.requests[b].fetch_sub(1, Relaxed) == 1 {
                self.adapters.fetch_sub(1, Relaxed);
            }
        }
    }

    /// What the cost model needs for a request for `lora`.
    #[inline]
    pub fn own(&self, lora: u64) -> crate::estimate::OwnLora {
        crate::estimate::OwnLora {
            holds: self.requests[crate::estimate::LoraMask::bit_index(lora)].load(Relaxed) > 0,
            adapters: self.adapters.load(Relaxed),
        }
    }
}
