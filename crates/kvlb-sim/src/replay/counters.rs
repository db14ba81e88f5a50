//! What the replicas themselves say they did, read from their Prometheus `/metrics` (vLLM's
//! names): requests finished, prompt tokens, prefix-cache lookups and hits. Read before and
//! after a replay, the difference is the replay's work per replica, so a hit rate is measured
//! by the engines, not guessed from where a balancer meant to send a request.

#![forbid(unsafe_code)]

use super::client;
use serde::{Deserialize, Serialize};
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

/// A replica's queue as its `/metrics` gauges tell it: requests running and waiting
/// (`vllm:num_requests_running`, `vllm:num_requests_waiting`, summed over label sets).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueGauges {
    pub running: f64,
    pub waiting: f64,
}

impl QueueGauges {
    pub fn parse(text: &str) -> QueueGauges {
        let mut g = QueueGauges::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let v = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite())
                .unwrap_or(0.0);
            match &line[..name_end] {
                "vllm:num_requests_running" => g.running += v,
                "vllm:num_requests_waiting" => g.waiting += v,
                _ => {}
            }
        }
        g
    }

    /// Neither running nor waiting anything.
    pub fn idle(&self) -> bool {
        self.running < 0.5 && self.waiting < 0.5
    }
}

/// How often, over a replay, a replica sat idle while another had a queue: the fleet's queue
/// gauges sampled at a fixed interval, each sample a moment of the fleet.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Occupancy {
    /// Moments sampled (every replica answered).
    pub samples: u64,
    /// Moments with a replica idle while another had requests waiting.
    pub idle_while_queued: u64,
    /// Per replica (in `--replica` order): moments it was idle while another had requests
    /// waiting.
    pub idle_while_other_queued: Vec<u64>,
}

impl Occupancy {
    pub fn new(replicas: usize) -> Occupancy {
        Occupancy {
            idle_while_other_queued: vec![0; replicas],
            ..Occupancy::default()
        }
    }

    /// One moment of the fleet: each replica's gauges.
    pub fn add(&mut self, fleet: &[QueueGauges]) {
        self.samples += 1;
        let queued = fleet.iter().filter(|g| g.waiting >= 0.5).count();
        let mut any = false;
        for (i, g) in fleet.iter().enumerate() {
            // An idle replica waits for nothing, so any queue is another's.
            if g.idle() && queued > 0 {
                any = true;
                if let Some(n) = self.idle_while_other_queued.get_mut(i) {
                    *n += 1;
                }
            }
        }
        self.idle_while_queued += any as u64;
    }

    /// The share of moments with a replica idle while another queued (None: no moment).
    pub fn share(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.idle_while_queued as f64 / self.samples as f64)
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

    #[test]
    fn a_replica_idle_while_another_queues_is_counted() {
        let g = QueueGauges::parse(
            "vllm:num_requests_running{engine=\"0\"} 2\n\
             vllm:num_requests_running{engine=\"1\"} 1\n\
             vllm:num_requests_waiting{engine=\"0\"} 3\n\
             vllm:num_requests_waiting_extra 9\n",
        );
        assert_eq!(
            g,
            QueueGauges {
                running: 3.0,
                waiting: 3.0
            }
        );
        let idle = QueueGauges::default();
        let busy = QueueGauges {
            running: 4.0,
            waiting: 0.0,
        };
        let queued = QueueGauges {
            running: 4.0,
            waiting: 2.0,
        };
        let mut o = Occupancy::new(3);
        o.add(&[idle, busy, busy]); // busy, nobody waits: fine
        o.add(&[idle, queued, busy]); // idle while replica 1 queues
        o.add(&[busy, queued, queued]); // queues everywhere, nobody idle: fine
        o.add(&[idle, idle, queued]);
        assert_eq!(o.samples, 4);
        assert_eq!(o.idle_while_queued, 2);
        assert_eq!(o.idle_while_other_queued, vec![2, 1, 0]);
        assert_eq!(o.share(), Some(0.5));
        assert_eq!(Occupancy::new(2).share(), None);
    }
}
