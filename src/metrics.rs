//! Counters and histograms of the data plane. Each worker writes only its own `WorkerStats`
//! (relaxed atomics on its own cache lines: no locks, no sharing between writers); the admin
//! thread sums them when /metrics is scraped. Replica in-flight counts are the one figure
//! shared by all workers, since `least_loaded` and `power_of_two` read them.
//!
//! A counter with one writer needs no read-modify-write instruction: `add` is a relaxed load
//! and a relaxed store (plain moves on x86), where `fetch_add` is a locked instruction that
//! also orders the core's memory traffic. A request updates about twenty of them; only the
//! figures several workers write (replica in-flight, queued prefill, decoding, queue slots)
//! keep `fetch_add`.

#![forbid(unsafe_code)]

use std::fmt::Write;
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
pub const REASONS: [&str; 3] = ["cache", "load", "fallback"];

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

/// Why a response was cut short after its head reached the client (`proxy::Cut` order).
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

/// Per replica, per worker.
#[derive(Default)]
pub struct ReplicaCounters {
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
    pub decisions: [AtomicU64; 3],
    pub spills: AtomicU64,
    pub prompt_errors: [AtomicU64; 8],
    /// Prompts a bound stopped, by `prompt::Bound` (`Bound::ALL` order).
    pub prompt_truncated: [AtomicU64; 4],
    pub replicas: Vec<ReplicaCounters>,
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
            prompt_errors: Default::default(),
            prompt_truncated: Default::default(),
            replicas: (0..replicas).map(|_| ReplicaCounters::default()).collect(),
        }
    }

    pub fn local_error(&self, status: u16) {
        let i = LOCAL_ERROR_CODES
            .iter()
            .position(|c| *c == status)
            .unwrap_or(LOCAL_ERROR_CODES.len() - 1);
        add(&self.local_errors[i], 1);
    }
}

/// Shared by every worker: requests in flight at one replica.
#[repr(align(128))]
#[derive(Default)]
pub struct ReplicaLoad {
    pub in_flight: AtomicU32,
    /// Estimated prompt tokens routed here whose prefill has not finished (no first byte yet).
    pub queued_prefill_tokens: AtomicU64,
    /// Requests here past their first byte.
    pub decoding: AtomicU32,
}

fn value_histogram(out: &mut String, name: &str, help: &str, hs: &[&ValueHistogram]) {
    family(out, name, "histogram", help);
    let bounds = hs.first().map(|h| h.bounds).unwrap_or(&[]);
    let mut cum = 0u64;
    for (i, b) in bounds.iter().enumerate() {
        cum += hs.iter().map(|h| h.counts[i].load(Relaxed)).sum::<u64>();
        let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
    }
    cum += hs
        .iter()
        .map(|h| h.counts[bounds.len()].load(Relaxed))
        .sum::<u64>();
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
    let sum: u64 = hs.iter().map(|h| h.sum_milli.load(Relaxed)).sum();
    let _ = writeln!(out, "{name}_sum {}", sum as f64 / 1000.0);
    let _ = writeln!(out, "{name}_count {cum}");
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One family with a single unlabelled sample: its HELP and TYPE lines and the value.
pub fn scalar(out: &mut String, name: &str, kind: &str, help: &str, value: u64) {
    family(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

fn histogram(out: &mut String, name: &str, help: &str, hs: &[&Histogram]) {
    family(out, name, "histogram", help);
    let mut cum = 0u64;
    for (i, b) in BUCKETS.iter().enumerate() {
        cum += hs.iter().map(|h| h.counts[i].load(Relaxed)).sum::<u64>();
        let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
    }
    cum += hs
        .iter()
        .map(|h| h.counts[BUCKETS.len()].load(Relaxed))
        .sum::<u64>();
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
    let sum: u64 = hs.iter().map(|h| h.sum_us.load(Relaxed)).sum();
    let _ = writeln!(out, "{name}_sum {}", sum as f64 / 1e6);
    let _ = writeln!(out, "{name}_count {cum}");
}

/// The replica slots in use: (slot, url); empty slots have an empty url.
fn live(urls: &[String]) -> impl Iterator<Item = (usize, &String)> {
    urls.iter().enumerate().filter(|(_, u)| !u.is_empty())
}

/// Prometheus text for the whole process. `replica_urls` has one entry per replica slot.
pub fn render(workers: &[WorkerStats], loads: &[ReplicaLoad], replica_urls: &[String]) -> String {
    let mut out = String::with_capacity(8192);
    let sum = |f: &dyn Fn(&WorkerStats) -> u64| -> u64 { workers.iter().map(f).sum() };

    family(
        &mut out,
        "kvlb_requests_total",
        "counter",
        "Responses forwarded from replicas, by replica and status class.",
    );
    for (r, url) in live(replica_urls) {
        for (c, class) in ["1xx", "2xx", "3xx", "4xx", "5xx"].iter().enumerate() {
            let v = sum(&|w| w.replicas[r].responses[c].load(Relaxed));
            let _ = writeln!(
                out,
                "kvlb_requests_total{{replica=\"{url}\",status=\"{class}\"}} {v}"
            );
        }
        let v = sum(&|w| w.replicas[r].bad_gateway.load(Relaxed));
        let _ = writeln!(
            out,
            "kvlb_requests_total{{replica=\"{url}\",status=\"502\"}} {v}"
        );
        let v = sum(&|w| w.replicas[r].gateway_timeout.load(Relaxed));
        let _ = writeln!(
            out,
            "kvlb_requests_total{{replica=\"{url}\",status=\"504\"}} {v}"
        );
        let v = sum(&|w| w.replicas[r].unavailable.load(Relaxed));
        let _ = writeln!(
            out,
            "kvlb_requests_total{{replica=\"{url}\",status=\"503\"}} {v}"
        );
    }
    family(
        &mut out,
        "kvlb_retries_total",
        "counter",
        "Requests that failed on a replica at connect time or with an immediate 503 and were tried on another.",
    );
    for (r, url) in live(replica_urls) {
        let v = sum(&|w| w.replicas[r].retries.load(Relaxed));
        let _ = writeln!(out, "kvlb_retries_total{{replica=\"{url}\"}} {v}");
    }
    family(
        &mut out,
        "kvlb_ejections_total",
        "counter",
        "Times a replica was ejected after consecutive transport failures (passive health).",
    );
    for (r, url) in live(replica_urls) {
        let v = sum(&|w| w.replicas[r].ejections.load(Relaxed));
        let _ = writeln!(out, "kvlb_ejections_total{{replica=\"{url}\"}} {v}");
    }
    family(
        &mut out,
        "kvlb_local_responses_total",
        "counter",
        "Error responses kvlb answered itself, by status.",
    );
    for (i, code) in LOCAL_ERROR_CODES.iter().enumerate() {
        let v = sum(&|w| w.local_errors[i].load(Relaxed));
        let label = if *code == 0 {
            "other".to_string()
        } else {
            code.to_string()
        };
        let _ = writeln!(out, "kvlb_local_responses_total{{status=\"{label}\"}} {v}");
    }
    family(&mut out, "kvlb_client_aborts_total", "counter", "Requests whose client went away before the response completed; the replica request was cancelled.");
    for (r, url) in live(replica_urls) {
        let v = sum(&|w| w.replicas[r].client_aborts.load(Relaxed));
        let _ = writeln!(out, "kvlb_client_aborts_total{{replica=\"{url}\"}} {v}");
    }
    family(&mut out, "kvlb_cut_responses_total", "counter", "Responses cut short by the replica after their head reached the client (the client's connection is closed), by cause: closed (before the body's end), reset (a receive error), malformed (invalid chunked framing or more bytes than declared).");
    for (r, url) in live(replica_urls) {
        for (c, cause) in CUT_CAUSES.iter().enumerate() {
            let v = sum(&|w| w.replicas[r].cut[c].load(Relaxed));
            let _ = writeln!(
                out,
                "kvlb_cut_responses_total{{replica=\"{url}\",cause=\"{cause}\"}} {v}"
            );
        }
    }
    family(
        &mut out,
        "kvlb_replica_in_flight",
        "gauge",
        "Requests in flight per replica, across workers.",
    );
    for (r, url) in live(replica_urls) {
        let _ = writeln!(
            out,
            "kvlb_replica_in_flight{{replica=\"{url}\"}} {}",
            loads[r].in_flight.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_replica_queued_prefill_tokens",
        "gauge",
        "Estimated prompt tokens routed to each replica and not yet prefilled (no first byte yet).",
    );
    for (r, url) in live(replica_urls) {
        let _ = writeln!(
            out,
            "kvlb_replica_queued_prefill_tokens{{replica=\"{url}\"}} {}",
            loads[r].queued_prefill_tokens.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_replica_decoding",
        "gauge",
        "Requests past their first byte (decoding) per replica.",
    );
    for (r, url) in live(replica_urls) {
        let _ = writeln!(
            out,
            "kvlb_replica_decoding{{replica=\"{url}\"}} {}",
            loads[r].decoding.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_worker_in_flight",
        "gauge",
        "Requests in flight per worker.",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_worker_in_flight{{worker=\"{i}\"}} {}",
            w.in_flight.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_worker_connections",
        "gauge",
        "Open client connections per worker.",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_worker_connections{{worker=\"{i}\"}} {}",
            w.open_connections.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_worker_accepted_total",
        "counter",
        "Client connections accepted per worker.",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_worker_accepted_total{{worker=\"{i}\"}} {}",
            w.accepted.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_worker_requests_total",
        "counter",
        "Requests handled per worker.",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_worker_requests_total{{worker=\"{i}\"}} {}",
            w.requests.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_worker_allocations_total",
        "counter",
        "Heap allocations made by each worker thread (flat under steady keep-alive traffic).",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_worker_allocations_total{{worker=\"{i}\"}} {}",
            w.allocations.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_worker_recv_throttled_total",
        "counter",
        "Client or replica receives paused because kvlb could not pass the bytes on as fast as they came (the rest waited in the socket).",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_worker_recv_throttled_total{{worker=\"{i}\"}} {}",
            w.recv_throttled.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_spliced_response_bytes_total",
        "counter",
        "L7 response body bytes moved replica -> client by splice, never entering user space.",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_spliced_response_bytes_total{{worker=\"{i}\"}} {}",
            w.spliced_bytes.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_body_memory_refused_total",
        "counter",
        "Requests refused with 503 before their body was read because the bodies in flight held max_body_memory (or the worker's share of it).",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_body_memory_refused_total{{worker=\"{i}\"}} {}",
            w.body_memory_refused.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_worker_recv_buffer_shortages_total",
        "counter",
        "Receives that found the worker's provided-buffer ring empty and fell back to a single-shot receive.",
    );
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvlb_worker_recv_buffer_shortages_total{{worker=\"{i}\"}} {}",
            w.recv_buffer_shortages.load(Relaxed)
        );
    }
    family(
        &mut out,
        "kvlb_bytes_total",
        "counter",
        "Bytes exchanged with replicas.",
    );
    for (r, url) in live(replica_urls) {
        let to = sum(&|w| w.replicas[r].bytes_to_replica.load(Relaxed));
        let from = sum(&|w| w.replicas[r].bytes_from_replica.load(Relaxed));
        let _ = writeln!(
            out,
            "kvlb_bytes_total{{replica=\"{url}\",direction=\"to_replica\"}} {to}"
        );
        let _ = writeln!(
            out,
            "kvlb_bytes_total{{replica=\"{url}\",direction=\"from_replica\"}} {from}"
        );
    }
    family(
        &mut out,
        "kvlb_upstream_connections_total",
        "counter",
        "Replica connections used: new (connect) or reused from the keep-alive pool.",
    );
    for (r, url) in live(replica_urls) {
        let c = sum(&|w| w.replicas[r].connects.load(Relaxed));
        let u = sum(&|w| w.replicas[r].reuses.load(Relaxed));
        let _ = writeln!(
            out,
            "kvlb_upstream_connections_total{{replica=\"{url}\",kind=\"new\"}} {c}"
        );
        let _ = writeln!(
            out,
            "kvlb_upstream_connections_total{{replica=\"{url}\",kind=\"reused\"}} {u}"
        );
    }
    let ttfb: Vec<&Histogram> = workers.iter().map(|w| &w.ttfb).collect();
    histogram(
        &mut out,
        "kvlb_time_to_first_byte_seconds",
        "From the request fully received to the replica's first response byte.",
        &ttfb,
    );
    let first: Vec<&Histogram> = workers.iter().map(|w| &w.first_token).collect();
    histogram(
        &mut out,
        "kvlb_time_to_first_token_seconds",
        "From the request fully received to the replica's first response body byte.",
        &first,
    );
    let est: Vec<&Histogram> = workers.iter().map(|w| &w.estimated_ttft).collect();
    histogram(
        &mut out,
        "kvlb_estimated_ttft_seconds",
        "cache_aware's time-to-first-token estimate for the replica it chose.",
        &est,
    );
    let ratio: Vec<&ValueHistogram> = workers.iter().map(|w| &w.ttft_ratio).collect();
    value_histogram(
        &mut out,
        "kvlb_ttft_observed_over_estimated",
        "Observed time to first token divided by cache_aware's estimate (1 = exact).",
        &ratio,
    );
    let matched: Vec<&ValueHistogram> = workers.iter().map(|w| &w.matched_tokens).collect();
    value_histogram(
        &mut out,
        "kvlb_matched_prefix_tokens",
        "Prompt tokens cache_aware counted as resident on the replica it chose.",
        &matched,
    );
    family(
        &mut out,
        "kvlb_decisions_total",
        "counter",
        "cache_aware decisions by reason: cache (a resident prefix won), load (queues decided), fallback (no prefix).",
    );
    for (i, reason) in REASONS.iter().enumerate() {
        let v = sum(&|w| w.decisions[i].load(Relaxed));
        let _ = writeln!(out, "kvlb_decisions_total{{reason=\"{reason}\"}} {v}");
    }
    family(
        &mut out,
        "kvlb_hot_prefix_spills_total",
        "counter",
        "Requests whose hit on a hot prefix was ignored because its holder was saturated.",
    );
    let _ = writeln!(
        out,
        "kvlb_hot_prefix_spills_total {}",
        sum(&|w| w.spills.load(Relaxed))
    );
    family(
        &mut out,
        "kvlb_unparsed_prompts_total",
        "counter",
        "Bodies on a prompt path that were not a prompt kvlb could read; routed by load.",
    );
    for (i, label) in PROMPT_ERRORS.iter().enumerate() {
        let v = sum(&|w| w.prompt_errors[i].load(Relaxed));
        let _ = writeln!(out, "kvlb_unparsed_prompts_total{{reason=\"{label}\"}} {v}");
    }
    family(
        &mut out,
        "kvlb_prompt_truncated_total",
        "counter",
        "Prompts whose reading stopped at a bound (max_prompt_tokens, messages, parts, work); routed on the blocks read before it, or by load when the bound came before the fields they start with.",
    );
    for (i, bound) in crate::prompt::Bound::ALL.iter().enumerate() {
        let v = sum(&|w| w.prompt_truncated[i].load(Relaxed));
        let _ = writeln!(
            out,
            "kvlb_prompt_truncated_total{{reason=\"{}\"}} {v}",
            bound.label()
        );
    }
    let total: Vec<&Histogram> = workers.iter().map(|w| &w.total).collect();
    histogram(
        &mut out,
        "kvlb_request_duration_seconds",
        "From the request fully received to the response fully sent.",
        &total,
    );
    crate::l4::render_metrics(&mut out);
    crate::tokenize::render_metrics(&mut out);
    crate::access_log::render_metrics(&mut out);
    process(&mut out);
    out
}

/// The process's own resources, named as Prometheus client libraries do (kvlb_ prefixed): open
/// descriptors against the limit, resident memory, threads. An operator watches these for
/// leaks; the soak test reads them too.
fn process(out: &mut String) {
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        family(
            out,
            "kvlb_process_open_fds",
            "gauge",
            "Open file descriptors.",
        );
        // The directory handle itself is one of them.
        let _ = writeln!(
            out,
            "kvlb_process_open_fds {}",
            dir.count().saturating_sub(1)
        );
    }
    if let Ok((soft, _)) = crate::limits::nofile_limit() {
        family(
            out,
            "kvlb_process_max_fds",
            "gauge",
            "The open file descriptor limit (soft).",
        );
        let _ = writeln!(out, "kvlb_process_max_fds {soft}");
    }
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        let field = |name: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(name))?;
            line[name.len()..].split_whitespace().next()?.parse().ok()
        };
        if let Some(kib) = field("VmRSS:") {
            family(
                out,
                "kvlb_process_resident_memory_bytes",
                "gauge",
                "Resident memory size in bytes.",
            );
            let _ = writeln!(out, "kvlb_process_resident_memory_bytes {}", kib * 1024);
        }
        if let Some(n) = field("Threads:") {
            family(
                out,
                "kvlb_process_threads",
                "gauge",
                "OS threads in the process.",
            );
            let _ = writeln!(out, "kvlb_process_threads {n}");
        }
    }
}
