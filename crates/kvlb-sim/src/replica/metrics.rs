//! GET /metrics of one simulated replica, in the exact text form vLLM 0.33 exposes (see
//! replica-interfaces.md section 2): the gauges and counters of `EngineStats` (with a host KV
//! tier also vllm:external_prefix_cache_queries_total / _hits_total, the pair vLLM reports
//! for a KV connector such as CPU offloading or LMCache), request
//! successes by finish reason and the time-to-first-token histogram. Pure rendering; the
//! driver feeds the counters.
//!
//! The histogram holds ENGINE seconds (what a real GPU would report): wall seconds times the
//! replica's time scale.

#![forbid(unsafe_code)]

use crate::engine::{EngineStats, FinishReason};
use std::fmt::Write;

/// vLLM v1's bucket bounds for vllm:time_to_first_token_seconds.
pub const TTFT_BUCKETS_S: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// A Prometheus histogram with vLLM's TTFT buckets (non-cumulative counts; rendered cumulative).
#[derive(Debug, Clone, Default)]
pub struct TtftHistogram {
    counts: [u64; TTFT_BUCKETS_S.len()],
    over: u64,
    sum: f64,
}

impl TtftHistogram {
    pub fn observe(&mut self, seconds: f64) {
        let s = if seconds.is_finite() && seconds > 0.0 {
            seconds
        } else {
            0.0
        };
        match TTFT_BUCKETS_S.iter().position(|&le| s <= le) {
            Some(i) => self.counts[i] += 1,
            None => self.over += 1,
        }
        self.sum += s;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.over
    }
}

/// The requests the replica served: how each finished and its time to first token. The driver
/// keeps these beside the engine's own counters.
#[derive(Debug, Clone, Default)]
pub struct RequestCounters {
    pub ttft: TtftHistogram,
    pub finished_stop: u64,
    pub finished_length: u64,
    pub finished_abort: u64,
    /// Copied from the engine when rendering.
    pub preemptions_total: u64,
    /// The engine has a host KV tier: render the external prefix-cache counters.
    pub host_kv_tier: bool,
}

impl RequestCounters {
    pub fn finished(&mut self, reason: FinishReason) {
        match reason {
            FinishReason::Stop => self.finished_stop += 1,
            FinishReason::Length => self.finished_length += 1,
            FinishReason::Abort => self.finished_abort += 1,
        }
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

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
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
    if counters.host_kv_tier {
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
    let name = "vllm:time_to_first_token_seconds";
    let _ = write!(
        out,
        "# HELP {name} Histogram of time to first token in seconds.\n# TYPE {name} histogram\n"
    );
    let h = &counters.ttft;
    let mut cumulative = 0u64;
    for (i, le) in TTFT_BUCKETS_S.iter().enumerate() {
        cumulative += h.counts[i];
        let _ = writeln!(
            out,
            "{name}_bucket{{engine=\"{engine}\",le=\"{}\",model_name=\"{m}\"}} {}",
            num(*le),
            num(cumulative as f64)
        );
    }
    cumulative += h.over;
    let _ = writeln!(
        out,
        "{name}_bucket{{engine=\"{engine}\",le=\"+Inf\",model_name=\"{m}\"}} {}",
        num(cumulative as f64)
    );
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", num(cumulative as f64));
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", num(h.sum));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
        c.host_kv_tier = true;
        let text = render("Qwen/Qwen3-8B", 0, &stats, &c);
        for line in [
            "vllm:external_prefix_cache_queries_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 77824.0",
            "vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 1024.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
}
