//! What the replicas themselves say they did, read from their Prometheus `/metrics` (vLLM's
//! names): requests finished, prompt tokens, prefix-cache lookups and hits. Read before and
//! after a replay, the difference is the replay's work per replica, so a hit rate is measured
//! by the engines, not guessed from where a balancer meant to send a request.

#![forbid(unsafe_code)]

use super::client;
use serde::Serialize;
use std::net::SocketAddr;

/// What one replica's engine counted: requests, prompt tokens, prefix-cache lookups and hits
/// (cumulative since it started, or their difference over a replay).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineCounters {
    /// `vllm:request_success_total`, all finish reasons (aborts included).
    pub requests: f64,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: f64,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up in the prefix cache.
    pub prefix_queries: f64,
    /// `vllm:prefix_cache_hits_total`: of those, tokens found cached.
    pub prefix_hits: f64,
}

impl EngineCounters {
    /// Sum the counters in a `/metrics` text (every label set of each name).
    pub fn parse(text: &str) -> EngineCounters {
        let mut c = EngineCounters::default();
        for line in text.lines() {
            if line.starts_with('#') {
                continue;
            }
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let value = || {
                line.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .filter(|v| v.is_finite())
                    .unwrap_or(0.0)
            };
            match &line[..name_end] {
                "vllm:request_success_total" => c.requests += value(),
                "vllm:prompt_tokens_total" => c.prompt_tokens += value(),
                "vllm:prefix_cache_queries_total" => c.prefix_queries += value(),
                "vllm:prefix_cache_hits_total" => c.prefix_hits += value(),
                _ => {}
            }
        }
        c
    }

    /// GET `/metrics` of the replica at `addr`.
    pub fn fetch(addr: SocketAddr) -> Result<EngineCounters, String> {
        let (status, body) = client::http(addr, "GET", "/metrics", b"")?;
        if status != 200 {
            return Err(format!("{addr}/metrics answered {status}"));
        }
        Ok(EngineCounters::parse(&String::from_utf8_lossy(&body)))
    }

    /// `self - before`, counter by counter.
    pub fn since(&self, before: &EngineCounters) -> EngineCounters {
        EngineCounters {
            requests: self.requests - before.requests,
            prompt_tokens: self.prompt_tokens - before.prompt_tokens,
            prefix_queries: self.prefix_queries - before.prefix_queries,
            prefix_hits: self.prefix_hits - before.prefix_hits,
        }
    }

    /// Prompt tokens the replica computed (looked up but not found cached).
    pub fn computed_tokens(&self) -> f64 {
        (self.prefix_queries - self.prefix_hits).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_summed_over_label_sets() {
        let text = "# TYPE vllm:prefix_cache_hits_total counter\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 300.0\n\
            vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 1000.0\n\
            vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 1000.0\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} 2.0\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 3.0\n\
            vllm:request_success_total_extra 9\n\
            vllm:prompt_tokens_total{engine=\"1\"} NaN\n";
        let c = EngineCounters::parse(text);
        assert_eq!(c.requests, 5.0);
        assert_eq!(c.prompt_tokens, 1000.0);
        assert_eq!(c.computed_tokens(), 700.0);
        let later = EngineCounters { requests: 7.0, ..c };
        assert_eq!(later.since(&c).requests, 2.0);
        assert_eq!(
            EngineCounters::parse("garbage\n{ 1"),
            EngineCounters::default()
        );
    }
}
