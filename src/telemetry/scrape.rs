//! Polling a replica's Prometheus `/metrics` (replica-interfaces.md section 2) for its queue
//! and KV usage: `parse_metrics` is pure; `fetch_metrics` is one HTTP/1.0 GET over std TCP
//! with timeouts (1.0 so the reply is never chunked); `run` is the per-replica thread.
//!
//! Names read: vLLM `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc` (older `vllm:gpu_cache_usage_perc`); SGLang
//! `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`. Labels are
//! ignored; several samples (one per engine / data-parallel rank) are summed for the request
//! counts and averaged for the usage.
//!
//! Each scrape also publishes `ReplicaTelemetry::reported` for the cost model: the replica's
//! queue less this instance's requests there when it asked (`estimate::reported`).

#![forbid(unsafe_code)]

use crate::estimate::ReportedLoad;
use crate::fleet::StopSignal;
use crate::worker::Shared;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest /metrics body read (vLLM's is tens of KiB).
pub const MAX_METRICS_BYTES: usize = 8 << 20;

/// What one scrape said; None where the replica exposes no such series.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MetricsSample {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// KV cache usage, 0..1.
    pub kv_usage: Option<f64>,
}

#[derive(Default)]
struct Acc {
    sum: f64,
    n: u32,
}

impl Acc {
    fn add(&mut self, v: f64) {
        if v.is_finite() {
            self.sum += v;
            self.n += 1;
        }
    }
    fn sum(&self) -> Option<f64> {
        (self.n > 0).then_some(self.sum)
    }
    fn mean(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }
}

/// One sample line -> (metric name, value); None for comments, blanks and malformed lines.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    if rest.starts_with('{') {
        // Skip the labels, minding quoted values that may hold '}' or escaped quotes.
        let mut in_quotes = false;
        let mut escaped = false;
        let mut end = None;
        for (i, c) in rest.char_indices().skip(1) {
            match (in_quotes, escaped, c) {
                (true, true, _) => escaped = false,
                (true, false, '\\') => escaped = true,
                (true, false, '"') => in_quotes = false,
                (false, _, '"') => in_quotes = true,
                (false, _, '}') => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        rest = &rest[end? + 1..];
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, value))
}

/// Read the queue and KV usage series out of a Prometheus text exposition.
pub fn parse_metrics(text: &str) -> MetricsSample {
    let (mut running, mut waiting) = (Acc::default(), Acc::default());
    let (mut usage, mut usage_old) = (Acc::default(), Acc::default());
    for line in text.lines() {
        let Some((name, v)) = sample(line) else {
            continue;
        };
        match name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => running.add(v),
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => waiting.add(v),
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" => usage.add(v),
            "vllm:gpu_cache_usage_perc" => usage_old.add(v),
            _ => {}
        }
    }
    MetricsSample {
        running: running.sum(),
        waiting: waiting.sum(),
        kv_usage: usage.mean().or(usage_old.mean()).map(|u| u.clamp(0.0, 1.0)),
    }
}

/// GET http://`addr`/metrics (Host: `authority`) within `timeout` overall; the body on 200.
pub fn fetch_metrics(addr: SocketAddr, authority: &str, timeout: Duration) -> io::Result<String> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(
        format!("GET /metrics HTTP/1.0\r\nHost: {authority}\r\nAccept: text/plain\r\nUser-Agent: kvlb\r\n\r\n")
            .as_bytes(),
    )?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "metrics: timed out",
            ));
        }
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_METRICS_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("metrics: reply over {MAX_METRICS_BYTES} bytes"),
            ));
        }
    }
    let head_end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "metrics: no HTTP head"))?;
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        let line = head.lines().next().unwrap_or("").to_string();
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("metrics: {line}"),
        ));
    }
    Ok(String::from_utf8_lossy(&buf[head_end + 4..]).into_owned())
}

/// The scrape thread of replica `r`: every `metrics_interval` until `stop`.
pub fn run(r: usize, shared: Arc<Shared>, stop: Arc<StopSignal>) {
    let Some(replica) = shared.fleet.slot(r).spec() else {
        return;
    };
    let tel = &shared.telemetry[r];
    let interval = shared.cfg().telemetry.metrics_interval;
    let timeout = interval.clamp(Duration::from_millis(200), Duration::from_secs(5));
    let mut next = Instant::now();
    while !stop.is_stopped() {
        let now = Instant::now();
        if now < next {
            stop.sleep(next - now);
            continue;
        }
        next = now + interval;
        // This instance's requests there as the replica renders its figures (sampled just
        // before asking: those sent earlier have mostly arrived).
        let own = &shared.loads[r];
        let own_in_flight = own.in_flight.load(Relaxed) as u64;
        let own_decoding = own.decoding.load(Relaxed) as u64;
        match fetch_metrics(replica.addr, &replica.authority, timeout) {
            Ok(text) => {
                let m = parse_metrics(&text);
                if m == MetricsSample::default() {
                    // A /metrics without any series we know: not a replica's telemetry.
                    tel.scrape_errors.fetch_add(1, Relaxed);
                    continue;
                }
                let store = |a: &std::sync::atomic::AtomicU64, v: Option<f64>| {
                    if let Some(v) = v {
                        a.store(v.max(0.0).round() as u64, Relaxed);
                    }
                };
                store(&tel.running, m.running);
                store(&tel.waiting, m.waiting);
                store(&tel.kv_usage_milli, m.kv_usage.map(|u| u * 1000.0));
                let now_ms = shared.now_ms();
                let count = |v: Option<f64>| v.map_or(0, |v| v.max(0.0).round() as u64);
                tel.reported.publish(ReportedLoad::from_scrape(
                    count(m.waiting),
                    count(m.running),
                    m.kv_usage,
                    own_in_flight,
                    own_decoding,
                    now_ms,
                    interval.as_millis() as u64,
                ));
                tel.last_metrics_ms.store(now_ms.max(1), Relaxed);
                tel.touch(now_ms);
                tel.scrapes.fetch_add(1, Relaxed);
            }
            Err(_) => {
                tel.scrape_errors.fetch_add(1, Relaxed);
            }
        }
    }
}
