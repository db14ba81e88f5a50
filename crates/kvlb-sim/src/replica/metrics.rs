//! GET /metrics of one simulated replica, in the exact text form vLLM 0.33 exposes (see
//! replica-interfaces.md section 2): the gauges and counters of `EngineStats` (with a host KV
//! tier also vllm:external_prefix_cache_queries_total / _hits_total, the pair vLLM reports
//! for a KV connector such as CPU offloading or LMCache), request
//! successes by finish reason, the time-to-first-token histogram, and the per-request
//! histograms vLLM records when a request finishes: vllm:request_queue_time_seconds (arrival
//! to first scheduling), vllm:request_prefill_time_seconds (first scheduling to first token)
//! and vllm:request_prefill_kv_computed_tokens (prompt tokens not found cached). Pure
//! rendering; the driver feeds the counters.
//!
//! The time-to-first-token histogram holds ENGINE seconds (what the engine model's GPU would
//! report): wall seconds times the replica's time scale. The queue and prefill histograms hold
//! wall seconds, as a GPU time-scale times faster would report them, because `kvlb serve`
//! calibrates on them beside its own wall-clock samples. A replica at `--speed 0.333` reports
//! three times the prefill seconds for the same computed tokens (its step terms are divided by
//! its speed).
//!
//! With `--role prefill|decode`, `TransferCounters` adds the KV transfers of disaggregated
//! prefill, both roles alike (vLLM's NixlConnector exposes its families on both instances):
//! vLLM's `vllm:nixl_xfer_time_seconds` (wall seconds of each pull's transfer),
//! `vllm:nixl_bytes_transferred`, `vllm:nixl_num_failed_transfers` (decode side) and
//! `vllm:nixl_num_kv_expired_reqs` (prefill side), and kvlb's own
//! `kvlb_replica_kv_transfers_served_total` / `_transfer_tokens_served_total` (prefill side),
//! `kvlb_replica_kv_transfers_pulled_total` / `_transfer_tokens_pulled_total`,
//! `kvlb_replica_kv_local_prefills_total{reason}` and
//! `kvlb_replica_kv_transfer_failures_total{reason}` (decode side), and the gauges
//! `kvlb_replica_kv_held_requests` / `kvlb_replica_kv_held_blocks` (prefill side). The
//! external prefix-cache pair is then rendered too, as vLLM does with a KV connector. Both
//! protocols (`--pd-protocol vllm|sglang`) count the same way: a fetch over SGLang's bootstrap
//! server is a pull, a failed one is counted in `vllm:nixl_num_failed_transfers` and by reason
//! (it fails the request instead of prefilling locally).
//!
//! With LoRA on, `LoraRequestsInfo` keeps vLLM's `vllm:lora_requests_info` gauge, one per HTTP
//! port (the ranks of a data-parallel replica share it, as they share vLLM's one output
//! processor). vLLM fills it as follows, quirks included:
//!
//! * Its front end counts, per adapter name, the requests it has seen queued or scheduled and
//!   not yet finished. It learns of both from the engine's events, which reach it with a
//!   request's first output; so an adapter is listed from its request's first token to its
//!   end, and a request that finishes in the step of its first token is never listed.
//! * After every engine step it sets the gauge with labels `max_lora` (`--max-loras`),
//!   `waiting_lora_adapters` and `running_lora_adapters`, both the comma-joined names of every
//!   listed adapter, whether its requests wait or run (so the two are always equal; empty
//!   when none), to the current Unix time (`set_to_current_time`).
//! * prometheus_client keeps every label set ever set, each with the time it was last set:
//!   the current state is the sample with the largest value. Here the last
//!   [`LORA_INFO_LABEL_SETS`] distinct label sets are kept, in the order first set (the order
//!   prometheus_client exposes them).

#![forbid(unsafe_code)]

use super::pd::{LocalPrefill, TransferFailure};
use crate::engine::{EngineStats, FinishReason};
use std::fmt::Write;
use std::sync::Arc;

/// vLLM v1's bucket bounds for vllm:time_to_first_token_seconds.
pub const TTFT_BUCKETS_S: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM v1's bucket bounds for its per-request phase histograms (`request_latency_buckets`:
/// vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds, ...).
pub const REQUEST_LATENCY_BUCKETS_S: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's `build_1_2_5_buckets(max)`: 1, 2, 5, 10, 20, 50, ... up to `max` (the bounds of
/// vllm:request_prefill_kv_computed_tokens, up to `max_model_len`).
pub fn buckets_1_2_5(max: u32) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1u64;
    loop {
        for m in [1u64, 2, 5] {
            if m * scale > max as u64 {
                return out;
            }
            out.push((m * scale) as f64);
        }
        scale *= 10;
    }
}

/// vLLM's bucket bounds for vllm:nixl_xfer_time_seconds (NixlPromMetrics).
pub const NIXL_XFER_TIME_BUCKETS_S: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];

/// vLLM's bucket bounds for vllm:nixl_bytes_transferred: 2^11, 2^13, ... 2^33 bytes.
pub fn nixl_bytes_buckets() -> Vec<f64> {
    (1..25)
        .step_by(2)
        .map(|i| (1u64 << (10 + i)) as f64)
        .collect()
}

/// A Prometheus histogram (non-cumulative counts; rendered cumulative).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    over: u64,
    sum: f64,
}

impl Histogram {
    pub fn new(bounds: &[f64]) -> Histogram {
        Histogram {
            bounds: bounds.to_vec(),
            counts: vec![0; bounds.len()],
            over: 0,
            sum: 0.0,
        }
    }

    /// vLLM's vllm:time_to_first_token_seconds buckets.
    pub fn ttft() -> Histogram {
        Histogram::new(&TTFT_BUCKETS_S)
    }

    /// vLLM's per-request phase buckets (`REQUEST_LATENCY_BUCKETS_S`).
    pub fn request_latency() -> Histogram {
        Histogram::new(&REQUEST_LATENCY_BUCKETS_S)
    }

    pub fn observe(&mut self, v: f64) {
        let v = if v.is_finite() && v > 0.0 { v } else { 0.0 };
        match self.bounds.iter().position(|&le| v <= le) {
            Some(i) => self.counts[i] += 1,
            None => self.over += 1,
        }
        self.sum += v;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.over
    }

    /// Append the family `name` (HELP, TYPE, buckets, count and sum) of engine `engine`
    /// serving `model` (escaped).
    fn render(&self, out: &mut String, name: &str, help: &str, engine: u32, model: &str) {
        let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} histogram\n");
        let mut cumulative = 0u64;
        let les = self.bounds.iter().map(|le| go_float(*le));
        for (le, n) in les
            .chain(["+Inf".to_string()])
            .zip(self.counts.iter().chain(std::iter::once(&self.over)))
        {
            cumulative += n;
            let _ = writeln!(
                out,
                "{name}_bucket{{engine=\"{engine}\",le=\"{le}\",model_name=\"{model}\"}} {}",
                num(cumulative as f64)
            );
        }
        let labels = format!("engine=\"{engine}\",model_name=\"{model}\"");
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", num(cumulative as f64));
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", num(self.sum));
    }
}

/// The requests the replica served: how each finished, its time to first token and, once
/// finished, its phases as vLLM's front end records them (`RequestCounters::request_done`).
/// The driver keeps these beside the engine's own counters.
#[derive(Debug, Clone)]
pub struct RequestCounters {
    pub ttft: Histogram,
    /// Seconds from arrival to first scheduling (vllm:request_queue_time_seconds).
    pub queue_time: Histogram,
    /// Seconds from first scheduling to the first token (vllm:request_prefill_time_seconds).
    pub prefill_time: Histogram,
    /// Prompt tokens not found cached (vllm:request_prefill_kv_computed_tokens).
    pub prefill_kv_computed: Histogram,
    pub finished_stop: u64,
    pub finished_length: u64,
    pub finished_abort: u64,
    /// Copied from the engine when rendering.
    pub preemptions_total: u64,
    /// The engine has a host KV tier: render the external prefix-cache counters.
    pub host_kv_tier: bool,
    /// KV transfers of disaggregated prefill (`--role prefill|decode`; None for the default
    /// role, whose page has none of their families).
    pub transfers: Option<TransferCounters>,
    /// The replicas' --time-scale: the queue and prefill times are recorded in wall seconds.
    pub time_scale: f64,
}

impl RequestCounters {
    /// Counters of an engine taking prompts of up to `max_model_len` tokens.
    pub fn new(max_model_len: u32, time_scale: f64) -> RequestCounters {
        RequestCounters {
            ttft: Histogram::ttft(),
            queue_time: Histogram::request_latency(),
            prefill_time: Histogram::request_latency(),
            prefill_kv_computed: Histogram::new(&buckets_1_2_5(max_model_len)),
            finished_stop: 0,
            finished_length: 0,
            finished_abort: 0,
            preemptions_total: 0,
            host_kv_tier: false,
            transfers: None,
            time_scale,
        }
    }

    pub fn finished(&mut self, reason: FinishReason) {
        match reason {
            FinishReason::Stop => self.finished_stop += 1,
            FinishReason::Length => self.finished_length += 1,
            FinishReason::Abort => self.finished_abort += 1,
        }
    }

    /// A request that had its first token finished: as vLLM's front end does then, record
    /// its queue time (arrival to first scheduling), its prefill time (first scheduling to
    /// first token: its own prefill under whatever batch it shared, preemptions included) and
    /// the prompt tokens it computed (`prompt_tokens - cached_tokens`). The times come in
    /// engine seconds and are recorded in wall seconds, as a GPU `time_scale` times faster
    /// reports them: kvlb calibrates from them beside its own wall-clock samples.
    pub fn request_done(&mut self, queue_s: f64, prefill_s: f64, computed_tokens: u32) {
        let wall = |s: f64| s / self.time_scale.max(f64::MIN_POSITIVE);
        self.queue_time.observe(wall(queue_s));
        self.prefill_time.observe(wall(prefill_s));
        self.prefill_kv_computed.observe(computed_tokens as f64);
    }
}

/// The KV transfers of a replica of `--role prefill|decode` (see the module header).
#[derive(Debug, Clone)]
pub struct TransferCounters {
    /// Prefill side: pulls answered, and the tokens of KV they handed over.
    pub served: u64,
    pub served_tokens: u64,
    /// Decode side: pulls that brought KV, and its tokens.
    pub pulled: u64,
    pub pulled_tokens: u64,
    /// Decode side: fetches that failed (vLLM's protocol: then the request prefilled
    /// locally; SGLang's: the request failed), and by reason (`TransferFailure::ALL` order).
    pub failed: u64,
    pub failures: [u64; 4],
    /// Decode side: requests prefilled locally, by reason (`LocalPrefill::ALL` order).
    pub local_prefills: [u64; 3],
    /// Decode side: wall seconds and bytes of each transfer.
    pub xfer_time: Histogram,
    pub bytes: Histogram,
}

impl TransferCounters {
    pub fn new() -> TransferCounters {
        TransferCounters {
            served: 0,
            served_tokens: 0,
            pulled: 0,
            pulled_tokens: 0,
            failed: 0,
            failures: [0; 4],
            local_prefills: [0; 3],
            xfer_time: Histogram::new(&NIXL_XFER_TIME_BUCKETS_S),
            bytes: Histogram::new(&nixl_bytes_buckets()),
        }
    }

    /// A fetch of remote KV failed for `reason`.
    pub fn failed(&mut self, reason: TransferFailure) {
        self.failed += 1;
        let i = TransferFailure::ALL
            .iter()
            .position(|&r| r == reason)
            .unwrap_or(0);
        self.failures[i] += 1;
    }

    /// A decode request prefilled locally for `reason` (a failed pull is also counted by
    /// [`TransferCounters::failed`]).
    pub fn local_prefill(&mut self, reason: LocalPrefill) {
        let i = LocalPrefill::ALL
            .iter()
            .position(|&r| r == reason)
            .unwrap_or(0);
        self.local_prefills[i] += 1;
    }

    /// A pull brought `tokens` tokens of KV, `bytes` bytes moving for `seconds` wall seconds.
    pub fn pulled(&mut self, tokens: u32, bytes: u64, seconds: f64) {
        self.pulled += 1;
        self.pulled_tokens += tokens as u64;
        self.xfer_time.observe(seconds);
        self.bytes.observe(bytes as f64);
    }

    /// Append the families (after the others), with the engine's held blocks and expiries.
    fn render(&self, out: &mut String, engine: u32, m: &str, stats: &EngineStats) {
        let labels = format!("engine=\"{engine}\",model_name=\"{m}\"");
        let family = |out: &mut String, name: &str, kind: &str, help: &str, value: f64| {
            let _ = write!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {}\n",
                num(value)
            );
        };
        self.xfer_time.render(
            out,
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            engine,
            m,
        );
        self.bytes.render(
            out,
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            engine,
            m,
        );
        family(
            out,
            "vllm:nixl_num_failed_transfers_total",
            "counter",
            "Number of failed NIXL KV Cache transfers.",
            self.failed as f64,
        );
        family(
            out,
            "vllm:nixl_num_kv_expired_reqs_total",
            "counter",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
            stats.kv_holds_expired as f64,
        );
        family(
            out,
            "kvlb_replica_kv_transfers_served_total",
            "counter",
            "KV transfers served to decode replicas over the side channel or bootstrap server (prefill role).",
            self.served as f64,
        );
        family(
            out,
            "kvlb_replica_kv_transfer_tokens_served_total",
            "counter",
            "Tokens of KV served to decode replicas (prefill role).",
            self.served_tokens as f64,
        );
        family(
            out,
            "kvlb_replica_kv_transfers_pulled_total",
            "counter",
            "KV transfers pulled from prefill replicas (decode role).",
            self.pulled as f64,
        );
        family(
            out,
            "kvlb_replica_kv_transfer_tokens_pulled_total",
            "counter",
            "Tokens of KV pulled from prefill replicas: prompt tokens not prefilled here (decode role).",
            self.pulled_tokens as f64,
        );
        family(
            out,
            "kvlb_replica_kv_held_requests",
            "gauge",
            "Finished prefills whose KV blocks are held for a remote decode (prefill role).",
            stats.kv_held_requests as f64,
        );
        family(
            out,
            "kvlb_replica_kv_held_blocks",
            "gauge",
            "KV blocks held for remote decodes until pulled or expired (prefill role).",
            stats.kv_held_blocks as f64,
        );
        let name = "kvlb_replica_kv_local_prefills_total";
        let _ = write!(
            out,
            "# HELP {name} Requests prefilled locally, without KV from a prefill replica, by reason (decode role).\n# TYPE {name} counter\n"
        );
        for (reason, n) in LocalPrefill::ALL.iter().zip(self.local_prefills) {
            let _ = writeln!(
                out,
                "{name}{{engine=\"{engine}\",model_name=\"{m}\",reason=\"{}\"}} {}",
                reason.label(),
                num(n as f64)
            );
        }
        let name = "kvlb_replica_kv_transfer_failures_total";
        let _ = write!(
            out,
            "# HELP {name} Failed fetches of KV from prefill replicas, by reason (decode role, both protocols).\n# TYPE {name} counter\n"
        );
        for (reason, n) in TransferFailure::ALL.iter().zip(self.failures) {
            let _ = writeln!(
                out,
                "{name}{{engine=\"{engine}\",model_name=\"{m}\",reason=\"{}\"}} {}",
                reason.label(),
                num(n as f64)
            );
        }
    }
}

impl Default for TransferCounters {
    fn default() -> TransferCounters {
        TransferCounters::new()
    }
}

impl Default for RequestCounters {
    fn default() -> RequestCounters {
        RequestCounters::new(crate::engine::EngineConfig::default().max_model_len, 1.0)
    }
}

/// Prometheus float text as Python's prometheus_client writes it ("3.0", "0.41", "+Inf").
fn num(v: f64) -> String {
    if v.is_infinite() {
        return if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    if v.is_nan() {
        return "NaN".into();
    }
    format!("{v:?}")
}

/// A sample value as prometheus_client's `floatToGoString` writes it: Python's repr, but from
/// seven integer digits on in Go's exponent form (a Unix time: "1.7123456789012e+09").
fn go_float(v: f64) -> String {
    let s = num(v);
    match s.find('.') {
        Some(dot) if v > 0.0 && v.is_finite() && dot > 6 && !s.contains('e') => {
            let mantissa = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
            format!("{}e+0{}", mantissa.trim_end_matches(['0', '.']), dot - 1)
        }
        _ => s,
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Label sets of `vllm:lora_requests_info` kept (the most recently set).
pub const LORA_INFO_LABEL_SETS: usize = 32;

/// vLLM's `vllm:lora_requests_info` of one HTTP port (see the module header). Pure: the driver
/// reports requests' first outputs and ends, and sets the gauge after each step with the time.
#[derive(Debug, Clone)]
pub struct LoraRequestsInfo {
    /// The `max_lora` label (`--max-loras`).
    max_lora: u32,
    /// Adapters with requests between their first output and their end, in the order they
    /// were (re)listed, each with that number of requests.
    adapters: Vec<(Arc<str>, u32)>,
    /// The label sets set so far (the adapters label), in the order first set, each with the
    /// Unix time it was last set; at most [`LORA_INFO_LABEL_SETS`].
    samples: Vec<(String, f64)>,
    /// The adapters label being built (kept to build the next one in place).
    joined: String,
}

impl LoraRequestsInfo {
    pub fn new(max_lora: u32) -> LoraRequestsInfo {
        LoraRequestsInfo {
            max_lora,
            adapters: Vec::new(),
            samples: Vec::new(),
            joined: String::new(),
        }
    }

    /// A request of `adapter` produced its first output.
    pub fn request_listed(&mut self, adapter: &Arc<str>) {
        match self.adapters.iter_mut().find(|(a, _)| a == adapter) {
            Some((_, n)) => *n += 1,
            None => self.adapters.push((adapter.clone(), 1)),
        }
    }

    /// A request of `adapter` that produced an output finished (or was aborted).
    pub fn request_finished(&mut self, adapter: &str) {
        if let Some(i) = self.adapters.iter().position(|(a, _)| &**a == adapter) {
            self.adapters[i].1 -= 1;
            if self.adapters[i].1 == 0 {
                self.adapters.remove(i);
            }
        }
    }

    /// An engine step ended: set the gauge of the current adapters to `unix_time`.
    pub fn set(&mut self, unix_time: f64) {
        self.joined.clear();
        for (i, (name, _)) in self.adapters.iter().enumerate() {
            if i > 0 {
                self.joined.push(',');
            }
            self.joined.push_str(name);
        }
        if let Some(sample) = self.samples.iter_mut().find(|(l, _)| *l == self.joined) {
            sample.1 = unix_time;
            return;
        }
        if self.samples.len() == LORA_INFO_LABEL_SETS {
            let oldest = (0..self.samples.len())
                .min_by(|&a, &b| self.samples[a].1.total_cmp(&self.samples[b].1))
                .unwrap_or(0);
            self.samples.remove(oldest);
        }
        self.samples.push((self.joined.clone(), unix_time));
    }

    /// Append the family: HELP and TYPE, then a sample per label set kept (none before the
    /// first step, as prometheus_client shows a labelled gauge never set).
    pub fn render(&self, out: &mut String) {
        let name = "vllm:lora_requests_info";
        let _ = write!(
            out,
            "# HELP {name} Running stats on lora requests.\n# TYPE {name} gauge\n"
        );
        for (adapters, t) in &self.samples {
            let a = escape_label(adapters);
            let _ = writeln!(
                out,
                "{name}{{max_lora=\"{}\",waiting_lora_adapters=\"{a}\",running_lora_adapters=\"{a}\"}} {}",
                self.max_lora,
                go_float(*t)
            );
        }
    }
}

/// Render the metrics page of one replica.
pub fn render(model: &str, engine: u32, stats: &EngineStats, counters: &RequestCounters) -> String {
    let m = escape_label(model);
    let labels = format!("engine=\"{engine}\",model_name=\"{m}\"");
    let mut out = String::with_capacity(4096);
    let family = |out: &mut String, name: &str, kind: &str, help: &str, value: f64| {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {}\n",
            num(value)
        );
    };
    family(
        &mut out,
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        stats.num_requests_running as f64,
    );
    family(
        &mut out,
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        stats.num_requests_waiting as f64,
    );
    family(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        stats.kv_cache_usage,
    );
    family(
        &mut out,
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries_tokens as f64,
    );
    family(
        &mut out,
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits_tokens as f64,
    );
    if counters.host_kv_tier || counters.transfers.is_some() {
        family(
            &mut out,
            "vllm:external_prefix_cache_queries_total",
            "counter",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
            stats.external_prefix_cache_queries_tokens as f64,
        );
        family(
            &mut out,
            "vllm:external_prefix_cache_hits_total",
            "counter",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            stats.external_prefix_cache_hits_tokens as f64,
        );
    }
    family(
        &mut out,
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        stats.prompt_tokens_total as f64,
    );
    family(
        &mut out,
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        stats.generation_tokens_total as f64,
    );
    family(
        &mut out,
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        counters.preemptions_total as f64,
    );
    let _ = write!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\n"
    );
    for (reason, n) in [
        ("stop", counters.finished_stop),
        ("length", counters.finished_length),
        ("abort", counters.finished_abort),
    ] {
        let _ = writeln!(
            out,
            "vllm:request_success_total{{engine=\"{engine}\",finished_reason=\"{reason}\",model_name=\"{m}\"}} {}",
            num(n as f64)
        );
    }
    counters.ttft.render(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        engine,
        &m,
    );
    counters.queue_time.render(
        &mut out,
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        engine,
        &m,
    );
    counters.prefill_time.render(
        &mut out,
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        engine,
        &m,
    );
    counters.prefill_kv_computed.render(
        &mut out,
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        engine,
        &m,
    );
    if let Some(t) = &counters.transfers {
        t.render(&mut out, engine, &m, stats);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_as_prometheus_client_writes_them() {
        for (v, text) in [
            (0.0, "0.0"),
            (3.0, "3.0"),
            (0.41, "0.41"),
            (999_999.0, "999999.0"),
            (1_234_567.0, "1.234567e+06"),
            (1_712_345_678.901_234, "1.712345678901234e+09"),
            (1_712_345_678.5, "1.7123456785e+09"),
            (1_700_000_000.0, "1.7e+09"),
            (f64::INFINITY, "+Inf"),
        ] {
            assert_eq!(go_float(v), text);
        }
    }

    fn lora_lines(info: &LoraRequestsInfo) -> Vec<String> {
        let mut text = String::new();
        info.render(&mut text);
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn lora_requests_info_keeps_every_label_set_with_its_last_time() {
        let mut info = LoraRequestsInfo::new(2);
        let (sql, chat): (Arc<str>, Arc<str>) = ("sql".into(), "chat".into());
        // Never set: the family alone, as prometheus_client shows it.
        assert_eq!(
            lora_lines(&info),
            [
                "# HELP vllm:lora_requests_info Running stats on lora requests.",
                "# TYPE vllm:lora_requests_info gauge",
            ]
        );
        info.set(1_700_000_000.0);
        info.request_listed(&sql);
        info.request_listed(&sql);
        info.set(1_700_000_001.0);
        info.request_listed(&chat);
        info.set(1_700_000_002.5);
        info.request_finished("sql");
        info.set(1_700_000_003.0);
        info.request_finished("sql");
        info.set(1_700_000_004.0);
        // An adapter listed again goes to the end.
        info.request_listed(&sql);
        info.set(1_700_000_005.0);
        info.request_finished("chat");
        info.request_finished("sql");
        info.set(1_700_000_006.0);
        let line = |adapters: &str, t: &str| {
            format!("vllm:lora_requests_info{{max_lora=\"2\",waiting_lora_adapters=\"{adapters}\",running_lora_adapters=\"{adapters}\"}} {t}")
        };
        assert_eq!(
            lora_lines(&info)[2..],
            [
                line("", "1.700000006e+09"),
                line("sql", "1.700000001e+09"),
                line("sql,chat", "1.700000003e+09"),
                line("chat", "1.700000004e+09"),
                line("chat,sql", "1.700000005e+09"),
            ]
        );
    }

    #[test]
    fn lora_requests_info_keeps_the_most_recent_label_sets() {
        let mut info = LoraRequestsInfo::new(1);
        let names: Vec<Arc<str>> = (0..40).map(|i| format!("a{i}").into()).collect();
        info.set(1.0);
        for (i, name) in names.iter().enumerate() {
            info.request_listed(name);
            info.set(10.0 + i as f64);
            info.request_finished(name);
        }
        // 41 label sets: the oldest 9 ("" and a0..a7) went. The empty set again evicts a8
        // and comes back last.
        info.set(100.0);
        let lines = lora_lines(&info);
        assert_eq!(lines.len() - 2, LORA_INFO_LABEL_SETS);
        assert!(!lines.iter().any(|l| l.contains("\"a8\"")), "{lines:?}");
        assert!(lines[2].contains("\"a9\"") && lines[2].ends_with(" 19.0"));
        assert!(lines[lines.len() - 2].contains("\"a39\""));
        let last = lines.last().unwrap();
        assert!(last.contains("waiting_lora_adapters=\"\"") && last.ends_with(" 100.0"));
        // Names are escaped like every label value.
        let mut info = LoraRequestsInfo::new(1);
        info.request_listed(&"q\"x".into());
        info.set(1.0);
        assert!(lora_lines(&info)[2].contains("waiting_lora_adapters=\"q\\\"x\""));
    }

    #[test]
    fn renders_vllm_text() {
        let stats = EngineStats {
            num_requests_running: 3,
            num_requests_waiting: 0,
            kv_cache_usage: 0.41,
            prefix_cache_queries_tokens: 81920,
            prefix_cache_hits_tokens: 4096,
            external_prefix_cache_queries_tokens: 77824,
            external_prefix_cache_hits_tokens: 1024,
            prompt_tokens_total: 100,
            generation_tokens_total: 7,
            requests_finished_total: 2,
            ..EngineStats::default()
        };
        let mut c = RequestCounters::default();
        c.ttft.observe(0.003);
        c.ttft.observe(0.3);
        c.ttft.observe(5000.0);
        c.finished(FinishReason::Length);
        let text = render("Qwen/Qwen3-8B", 0, &stats, &c);
        for line in [
            "vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 3.0",
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 0.41",
            "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 81920.0",
            "# TYPE vllm:prefix_cache_hits_total counter",
            "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"Qwen/Qwen3-8B\"} 1.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\",model_name=\"Qwen/Qwen3-8B\"} 0.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.005\",model_name=\"Qwen/Qwen3-8B\"} 1.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.5\",model_name=\"Qwen/Qwen3-8B\"} 2.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"2560.0\",model_name=\"Qwen/Qwen3-8B\"} 2.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"Qwen/Qwen3-8B\"} 3.0",
            "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 3.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert_eq!(c.ttft.count(), 3);
        assert!(!text.contains("external_prefix_cache"), "no host tier");
        // The per-request phases, recorded as requests finish.
        c.request_done(0.01, 0.4, 3000);
        c.request_done(0.0, 1.2, 16);
        let text = render("Qwen/Qwen3-8B", 0, &stats, &c);
        for line in [
            "# TYPE vllm:request_prefill_time_seconds histogram",
            "vllm:request_prefill_time_seconds_bucket{engine=\"0\",le=\"0.3\",model_name=\"Qwen/Qwen3-8B\"} 0.0",
            "vllm:request_prefill_time_seconds_bucket{engine=\"0\",le=\"0.5\",model_name=\"Qwen/Qwen3-8B\"} 1.0",
            "vllm:request_prefill_time_seconds_bucket{engine=\"0\",le=\"1.5\",model_name=\"Qwen/Qwen3-8B\"} 2.0",
            "vllm:request_prefill_time_seconds_bucket{engine=\"0\",le=\"7680.0\",model_name=\"Qwen/Qwen3-8B\"} 2.0",
            "vllm:request_prefill_time_seconds_count{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 2.0",
            "vllm:request_prefill_time_seconds_sum{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 1.6",
            "# TYPE vllm:request_queue_time_seconds histogram",
            "vllm:request_queue_time_seconds_bucket{engine=\"0\",le=\"0.3\",model_name=\"Qwen/Qwen3-8B\"} 2.0",
            "vllm:request_queue_time_seconds_sum{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 0.01",
            "# TYPE vllm:request_prefill_kv_computed_tokens histogram",
            "vllm:request_prefill_kv_computed_tokens_bucket{engine=\"0\",le=\"20.0\",model_name=\"Qwen/Qwen3-8B\"} 1.0",
            "vllm:request_prefill_kv_computed_tokens_bucket{engine=\"0\",le=\"5000.0\",model_name=\"Qwen/Qwen3-8B\"} 2.0",
            "vllm:request_prefill_kv_computed_tokens_sum{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 3016.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // Its token buckets go up to the engine's max_model_len, as vLLM's.
        assert_eq!(buckets_1_2_5(12), [1.0, 2.0, 5.0, 10.0]);
        let max = EngineStats::default();
        let wide = render("m", 0, &max, &RequestCounters::new(2_000_000, 1.0));
        assert!(wide.contains("vllm:request_prefill_kv_computed_tokens_bucket{engine=\"0\",le=\"2e+06\",model_name=\"m\"} 0.0"), "{wide}");
        c.host_kv_tier = true;
        let text = render("Qwen/Qwen3-8B", 0, &stats, &c);
        for line in [
            "vllm:external_prefix_cache_queries_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 77824.0",
            "vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 1024.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn renders_kv_transfers_of_the_pd_roles() {
        let stats = EngineStats {
            kv_held_requests: 2,
            kv_held_blocks: 70,
            kv_holds_expired: 3,
            ..EngineStats::default()
        };
        let mut c = RequestCounters::default();
        let plain = render("m", 0, &stats, &c);
        assert!(!plain.contains("nixl") && !plain.contains("kvlb_replica_kv_"));
        let mut t = TransferCounters::new();
        t.served = 4;
        t.served_tokens = 4000;
        t.pulled(1000, 1000 * 131_072, 0.0052);
        t.failed(TransferFailure::NotFound);
        t.local_prefill(LocalPrefill::PullFailed);
        t.local_prefill(LocalPrefill::NoParams);
        t.local_prefill(LocalPrefill::NoParams);
        c.transfers = Some(t);
        let text = render("m", 0, &stats, &c);
        assert!(text.starts_with(&plain[..plain.find("# HELP vllm:prompt_tokens").unwrap()]));
        for line in [
            "# TYPE vllm:external_prefix_cache_hits_total counter",
            "vllm:nixl_xfer_time_seconds_bucket{engine=\"0\",le=\"0.005\",model_name=\"m\"} 0.0",
            "vllm:nixl_xfer_time_seconds_bucket{engine=\"0\",le=\"0.01\",model_name=\"m\"} 1.0",
            "vllm:nixl_xfer_time_seconds_sum{engine=\"0\",model_name=\"m\"} 0.0052",
            "vllm:nixl_bytes_transferred_bucket{engine=\"0\",le=\"2048.0\",model_name=\"m\"} 0.0",
            "vllm:nixl_bytes_transferred_bucket{engine=\"0\",le=\"5.36870912e+08\",model_name=\"m\"} 1.0",
            "vllm:nixl_bytes_transferred_bucket{engine=\"0\",le=\"8.589934592e+09\",model_name=\"m\"} 1.0",
            "vllm:nixl_bytes_transferred_count{engine=\"0\",model_name=\"m\"} 1.0",
            "# TYPE vllm:nixl_num_failed_transfers_total counter",
            "vllm:nixl_num_failed_transfers_total{engine=\"0\",model_name=\"m\"} 1.0",
            "vllm:nixl_num_kv_expired_reqs_total{engine=\"0\",model_name=\"m\"} 3.0",
            "kvlb_replica_kv_transfers_served_total{engine=\"0\",model_name=\"m\"} 4.0",
            "kvlb_replica_kv_transfer_tokens_served_total{engine=\"0\",model_name=\"m\"} 4000.0",
            "kvlb_replica_kv_transfers_pulled_total{engine=\"0\",model_name=\"m\"} 1.0",
            "kvlb_replica_kv_transfer_tokens_pulled_total{engine=\"0\",model_name=\"m\"} 1000.0",
            "# TYPE kvlb_replica_kv_held_blocks gauge",
            "kvlb_replica_kv_held_blocks{engine=\"0\",model_name=\"m\"} 70.0",
            "kvlb_replica_kv_held_requests{engine=\"0\",model_name=\"m\"} 2.0",
            "kvlb_replica_kv_local_prefills_total{engine=\"0\",model_name=\"m\",reason=\"no_params\"} 2.0",
            "kvlb_replica_kv_local_prefills_total{engine=\"0\",model_name=\"m\",reason=\"invalid_params\"} 0.0",
            "kvlb_replica_kv_local_prefills_total{engine=\"0\",model_name=\"m\",reason=\"pull_failed\"} 1.0",
            "# TYPE kvlb_replica_kv_transfer_failures_total counter",
            "kvlb_replica_kv_transfer_failures_total{engine=\"0\",model_name=\"m\",reason=\"unreachable\"} 0.0",
            "kvlb_replica_kv_transfer_failures_total{engine=\"0\",model_name=\"m\",reason=\"timeout\"} 0.0",
            "kvlb_replica_kv_transfer_failures_total{engine=\"0\",model_name=\"m\",reason=\"not_found\"} 1.0",
            "kvlb_replica_kv_transfer_failures_total{engine=\"0\",model_name=\"m\",reason=\"bad_answer\"} 0.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
}
