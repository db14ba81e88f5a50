//! Polling a replica's Prometheus `/metrics` (replica-interfaces.md section 2) for its queue
//! and KV usage: `parse_metrics` is pure; `Scraper` says what to ask and publishes what came
//! back, while the telemetry loop (`hub`) does the non-blocking HTTP/1.0 GET (1.0 so the reply
//! is never chunked).
//!
//! Names read: vLLM `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc` (older `vllm:gpu_cache_usage_perc`); SGLang
//! `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`. For a replica
//! without `dp_size` labels are ignored: several samples (one per engine) are summed for the
//! request counts and averaged for the usage. For the ranks of a `dp_size` replica the one
//! scrape is split by each series' rank label (`parse_metrics_ranks`: vLLM `engine`, SGLang
//! `dp_rank`) and each rank's figures go to that rank's slot.
//!
//! LoRA batch slots: vLLM's `vllm:lora_requests_info` (when the engine runs with LoRA) is one
//! sample per label set ever set, its value the time it was set; the newest is the engine's
//! state now. Read from it: `max_lora` and the adapters in `running_lora_adapters` (see
//! `estimate::reported`). It has no rank label: every rank of a `dp_size` replica gets it.
//!
//! Each scrape also publishes `ReplicaTelemetry::reported` for the cost model: the replica's
//! queue less this instance's requests there when it asked (`estimate::reported`).
//!
//! Prefill reports, for the calibration (`estimate::calibrate::PrefillSample`): vLLM's
//! `vllm:request_prefill_time_seconds` (`_count`, `_sum`), with the computed tokens of the
//! same requests from `vllm:request_prefill_kv_computed_tokens_sum` where exported (newer
//! vLLM), else `vllm:prompt_tokens_total` less `vllm:prefix_cache_hits_total`. Each is summed
//! over the replica's series (engines, models); for a `dp_size` replica a rank takes its own
//! series, or all of them when they carry no rank label. Between two scrapes that saw requests
//! finish, the deltas are one sample, priced with the cost model of the replica's
//! `[[model]]` table if it serves one (else `[cost_model]`), the replica's running requests
//! (mean of the two scrapes) sharing the steps; a delta across a counter reset (a restart) or
//! with requests but no computed tokens is skipped and counted. So is a delta of an interval in
//! which kvlb's own streams to the replica gave calibration samples: those time what routing
//! prices (the whole wait, as the router sees it), while the replica's prefill times read high
//! when prefills share its steps, so its reports fill in where kvlb's own samples are thin (a
//! replica it sends little to, traffic other senders put there). SGLang has no such histogram:
//! its replicas give no such samples.

#![forbid(unsafe_code)]

use crate::estimate::calibrate::{PrefillBase, PrefillDelta, PrefillSample, PrefillTotals, Sample};
use crate::estimate::{LoraReport, ReportedLoad};
use crate::worker::Shared;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
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
    /// LoRA batch slots and the adapters with requests there.
    pub lora: Option<LoraReport>,
    /// The prefills the replica reports (vLLM's prefill time histogram and token counters).
    pub prefill: Option<PrefillTotals>,
}

/// The series of a replica's prefill reports (module header), in `prefill_totals` order.
const PREFILL_SERIES: [&str; 5] = [
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_kv_computed_tokens_sum",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
];

/// The prefill totals of the sums of `PREFILL_SERIES` (`sum(i)`); None without the prefill
/// time histogram.
fn prefill_totals(sum: impl Fn(usize) -> Option<f64>) -> Option<PrefillTotals> {
    Some(PrefillTotals {
        requests: sum(0)?,
        seconds: sum(1)?,
        computed: sum(2),
        prompt: sum(3),
        hits: sum(4),
    })
}

/// The newest `vllm:lora_requests_info` sample of a scrape (module header).
#[derive(Default)]
struct LoraInfo {
    newest: f64,
    report: Option<LoraReport>,
}

impl LoraInfo {
    fn add(&mut self, labels: &str, set_at: f64) {
        if self.report.is_some() && set_at <= self.newest {
            return;
        }
        let Some(slots) = label_value(labels, "max_lora").and_then(|v| v.parse::<u32>().ok())
        else {
            return;
        };
        let mut report = LoraReport {
            slots,
            ..Default::default()
        };
        let adapters = label_value(labels, "running_lora_adapters").unwrap_or_default();
        for name in adapters.split(',').filter(|n| !n.is_empty()) {
            report.active += 1;
            report
                .names
                .insert(crate::models::name_hash(name.as_bytes()));
        }
        self.newest = set_at;
        self.report = Some(report);
    }
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

/// One sample line -> (metric name, its labels between the braces, value).
fn labeled_sample(line: &str) -> Option<(&str, &str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = "";
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
        let end = end?;
        labels = &rest[1..end];
        rest = &rest[end + 1..];
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, labels, value))
}

/// The data-parallel rank a series is of: vLLM's `engine="r"`, SGLang's `dp_rank="r"`.
pub fn label_rank(labels: &str) -> Option<u32> {
    label_value(labels, "engine")
        .or_else(|| label_value(labels, "dp_rank"))
        .and_then(|v| v.parse().ok())
}

/// The value of label `name` in a sample's `labels` (between the braces), unescaped.
pub fn label_value<'a>(labels: &'a str, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    let mut rest = labels;
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        // The value ends at the first quote not escaped.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end?;
        let key = key.trim().trim_start_matches(',').trim();
        if key == name {
            let raw = &after[..end];
            if !raw.contains('\\') {
                return Some(raw.into());
            }
            let mut out = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                let c = match c {
                    '\\' => match chars.next() {
                        Some('n') => '\n',
                        Some(e) => e,
                        None => break,
                    },
                    c => c,
                };
                out.push(c);
            }
            return Some(out.into());
        }
        rest = after[end + 1..].trim_start_matches(',').trim_start();
    }
    None
}

/// `parse_metrics` split over `n` data-parallel ranks by each series' rank label
/// (`label_rank`): rank r's sample from its series, a series of a rank beyond `n` ignored. A
/// series without the label is the whole engine's, shared: its request counts divided evenly
/// among the ranks, its KV usage and prefill reports each rank's (when it has none of its own).
pub fn parse_metrics_ranks(text: &str, n: usize) -> Vec<MetricsSample> {
    // The four gauges, then PREFILL_SERIES.
    const P: usize = 4;
    const N: usize = P + PREFILL_SERIES.len();
    let mut ranks: Vec<[Acc; N]> = (0..n).map(|_| Default::default()).collect();
    let mut shared: [Acc; N] = Default::default();
    let mut lora = LoraInfo::default();
    for line in text.lines() {
        let Some((name, labels, v)) = labeled_sample(line) else {
            continue;
        };
        let i = match name {
            LORA_INFO => {
                lora.add(labels, v);
                continue;
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" => 0,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => 1,
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" => 2,
            "vllm:gpu_cache_usage_perc" => 3,
            _ => match PREFILL_SERIES.iter().position(|s| *s == name) {
                Some(k) => P + k,
                None => continue,
            },
        };
        match label_rank(labels) {
            Some(r) => {
                if let Some(acc) = ranks.get_mut(r as usize) {
                    acc[i].add(v);
                }
            }
            None => shared[i].add(v),
        }
    }
    let share = |own: &Acc, all: &Acc| match (own.sum(), all.sum()) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0) / n as f64),
    };
    ranks
        .iter()
        .map(|acc| {
            let usage = acc[2]
                .mean()
                .or(shared[2].mean())
                .or(acc[3].mean())
                .or(shared[3].mean());
            let own = acc[P..].iter().any(|a| a.n > 0);
            let prefill = prefill_totals(|k| match own {
                true => acc[P + k].sum(),
                false => shared[P + k].sum(),
            });
            MetricsSample {
                running: share(&acc[0], &shared[0]),
                waiting: share(&acc[1], &shared[1]),
                kv_usage: usage.map(|u| u.clamp(0.0, 1.0)),
                lora: lora.report,
                prefill,
            }
        })
        .collect()
}

/// vLLM's LoRA report (module header).
const LORA_INFO: &str = "vllm:lora_requests_info";

/// Read the queue and KV usage series out of a Prometheus text exposition.
pub fn parse_metrics(text: &str) -> MetricsSample {
    let (mut running, mut waiting) = (Acc::default(), Acc::default());
    let (mut usage, mut usage_old) = (Acc::default(), Acc::default());
    let mut prefill: [Acc; PREFILL_SERIES.len()] = Default::default();
    let mut lora = LoraInfo::default();
    for line in text.lines() {
        let Some((name, labels, v)) = labeled_sample(line) else {
            continue;
        };
        match name {
            LORA_INFO => lora.add(labels, v),
            "vllm:num_requests_running" | "sglang:num_running_reqs" => running.add(v),
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => waiting.add(v),
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" => usage.add(v),
            "vllm:gpu_cache_usage_perc" => usage_old.add(v),
            _ => {
                if let Some(k) = PREFILL_SERIES.iter().position(|s| *s == name) {
                    prefill[k].add(v);
                }
            }
        }
    }
    MetricsSample {
        running: running.sum(),
        waiting: waiting.sum(),
        kv_usage: usage.mean().or(usage_old.mean()).map(|u| u.clamp(0.0, 1.0)),
        lora: lora.report,
        prefill: prefill_totals(|k| prefill[k].sum()),
    }
}

/// The /metrics text of a reply, on 200.
pub(super) fn metrics_body(status: u16, line: String, body: Vec<u8>) -> io::Result<String> {
    if status != 200 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("metrics: {line}"),
        ));
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// GET http://`addr``path` (HTTP/1.0, Host: `authority`) within `timeout` overall: the status,
/// the status line and the body (at most `max` bytes).
pub fn http_get(
    addr: SocketAddr,
    authority: &str,
    path: &str,
    accept: &str,
    timeout: Duration,
    max: usize,
) -> io::Result<(u16, String, Vec<u8>)> {
    http_request(addr, authority, "GET", path, accept, None, timeout, max)
}

/// `method` http://`addr``path` with a JSON `body` if any, as [`http_get`].
#[allow(clippy::too_many_arguments)]
pub fn http_request(
    addr: SocketAddr,
    authority: &str,
    method: &str,
    path: &str,
    accept: &str,
    body: Option<&[u8]>,
    timeout: Duration,
    max: usize,
) -> io::Result<(u16, String, Vec<u8>)> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(&request_bytes(authority, method, path, accept, body))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if reply_complete(&buf, max)? {
            break;
        }
    }
    parse_reply(buf)
}

/// An HTTP/1.0 request: `method` `path`, Host `authority`, a JSON `body` if any.
pub(super) fn request_bytes(
    authority: &str,
    method: &str,
    path: &str,
    accept: &str,
    body: Option<&[u8]>,
) -> Vec<u8> {
    let mut req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {authority}\r\nAccept: {accept}\r\nUser-Agent: kvlb\r\n"
    )
    .into_bytes();
    if let Some(body) = body {
        req.extend_from_slice(
            format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            )
            .as_bytes(),
        );
    }
    req.extend_from_slice(b"\r\n");
    req.extend_from_slice(body.unwrap_or_default());
    req
}

/// Whether the reply received so far (`buf`) is whole before the server closes: framed by its
/// Content-Length and all there (a server may keep an HTTP/1.0 connection open). An error once
/// it is over `max` bytes.
pub(super) fn reply_complete(buf: &[u8], max: usize) -> io::Result<bool> {
    if buf.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("reply over {max} bytes"),
        ));
    }
    Ok(content_length_reached(buf))
}

/// A whole reply: the status, the status line and the body.
pub(super) fn parse_reply(mut buf: Vec<u8>) -> io::Result<(u16, String, Vec<u8>)> {
    let head_end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no HTTP head"))?;
    let head = String::from_utf8_lossy(&buf[..head_end]);
    let line = head.lines().next().unwrap_or("").to_string();
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no HTTP status"))?;
    buf.drain(..head_end + 4);
    Ok((status, line, buf))
}

/// Whether `buf` holds a response head with a Content-Length and that many body bytes.
fn content_length_reached(buf: &[u8]) -> bool {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&buf[..end]);
    head.lines()
        .skip(1)
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())
                .flatten()
        })
        .is_some_and(|n| buf.len() >= end + 4 + n)
}

/// Publish one scrape's figures for slot `r`; `own`: this instance's in flight and decoding
/// there when it asked.
fn publish(shared: &Shared, r: usize, m: &MetricsSample, own: (u64, u64), interval: Duration) {
    let tel = &shared.telemetry[r];
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
    tel.reported.publish(
        ReportedLoad::from_scrape(
            count(m.waiting),
            count(m.running),
            m.kv_usage,
            own.0,
            own.1,
            now_ms,
            interval.as_millis() as u64,
        )
        .with_lora(m.lora.unwrap_or_default()),
    );
    tel.last_metrics_ms.store(now_ms.max(1), Relaxed);
    tel.touch(now_ms);
    tel.scrapes.fetch_add(1, Relaxed);
}

/// One replica's (or rank's) prefill reports between scrapes.
#[derive(Default)]
pub(super) struct PrefillReports {
    base: PrefillBase,
    /// Its running requests at the base's scrape.
    running: f64,
    /// kvlb's own TTFT samples of the slot at the last scrape (`ReplicaPace::ttft_samples`).
    own: u64,
}

/// The cost model slot `r`'s prefills are priced with: its `[[model]]` table's if it serves a
/// model of one, else `[cost_model]`'s.
fn cost_model_of(shared: &Shared, r: usize) -> crate::estimate::TtftModel {
    let cfg = shared.cfg();
    let models = shared.models.load();
    let table = models
        .names_of(r)
        .unwrap_or_default()
        .iter()
        .map(|n| models.class_of(n).table)
        .find(|t| *t > 0)
        .and_then(|t| cfg.model(t));
    table
        .map_or(&cfg.cost_model, |m| &m.cost_model)
        .policy_config()
        .model
}

/// Hand the prefills slot `r`'s scrape `m` reports since the last one to the calibration
/// (module header), or count why not.
pub(super) fn calibrate_prefill(
    shared: &Shared,
    r: usize,
    m: &MetricsSample,
    reports: &mut PrefillReports,
) {
    let Some(totals) = m.prefill else { return };
    let running = m.running.unwrap_or(0.0).max(0.0);
    let own = shared
        .pace
        .get(r)
        .map_or(0, |p| p.ttft_samples.load(Relaxed));
    let measured_here = std::mem::replace(&mut reports.own, own) != own;
    let delta = reports.base.advance(totals);
    let tel = &shared.telemetry[r];
    match delta {
        PrefillDelta::Idle => return,
        PrefillDelta::Reset => {
            tel.prefill_skipped_reset.fetch_add(1, Relaxed);
        }
        PrefillDelta::NoWork => {
            tel.prefill_skipped_no_work.fetch_add(1, Relaxed);
        }
        PrefillDelta::Prefills { .. } if measured_here => {
            tel.prefill_skipped_own.fetch_add(1, Relaxed);
        }
        PrefillDelta::Prefills { .. } => {
            let epoch = shared.fleet.slot(r).epoch.load(Relaxed);
            let decoding = ((reports.running + running) / 2.0).round() as u32;
            let model = cost_model_of(shared, r);
            if let Some(s) = PrefillSample::priced(r as u32, epoch, &delta, &model, decoding) {
                shared.samples.push(Sample::Prefill(s));
            }
        }
    }
    reports.running = running;
}

/// The scrapes of one replica's /metrics: what to ask and how often, and what each answer
/// updates. For rank 0 of a data-parallel engine it scrapes once for all ranks and publishes
/// each rank's share in the slot of that rank (`URL#r`). The telemetry loop (`hub`) does the
/// I/O: `begin` when one is due, `finish` with the body or the error.
pub(super) struct Scraper {
    r: usize,
    pub(super) addr: SocketAddr,
    authority: String,
    pub(super) interval: Duration,
    pub(super) timeout: Duration,
    ranks: usize,
    names: Vec<String>,
    slots: Vec<Option<usize>>,
    own: Vec<(u64, u64)>,
    prefills: Vec<PrefillReports>,
}

impl Scraper {
    /// Slot `r`'s scrapes, as its spec and the configuration say now (None: slot empty).
    pub(super) fn new(r: usize, shared: &Shared) -> Option<Scraper> {
        let replica = shared.fleet.slot(r).spec()?;
        let interval = shared.cfg().telemetry.metrics_interval;
        let ranks = replica.dp_size.max(1) as usize;
        let names: Vec<String> = match replica.dp_rank {
            Some(_) => (0..ranks)
                .map(|k| format!("{}#{k}", replica.base_url()))
                .collect(),
            None => Vec::new(),
        };
        Some(Scraper {
            r,
            addr: replica.addr,
            authority: replica.authority.clone(),
            interval,
            timeout: interval.clamp(Duration::from_millis(200), Duration::from_secs(5)),
            ranks,
            names,
            slots: vec![Some(r)],
            own: Vec::new(),
            prefills: (0..ranks).map(|_| Default::default()).collect(),
        })
    }

    /// The request of a scrape due now; notes this instance's requests there as it goes out.
    pub(super) fn begin(&mut self, shared: &Shared) -> Vec<u8> {
        if !self.names.is_empty() {
            // The ranks' slots, as they are now (a rank may be drained or removed alone).
            self.slots = self.names.iter().map(|n| shared.fleet.find(n)).collect();
        }
        // This instance's requests there as the replica renders its figures (sampled just
        // before asking: those sent earlier have mostly arrived).
        self.own.clear();
        self.own.extend(self.slots.iter().map(|s| {
            s.map_or((0, 0), |i| {
                let l = &shared.loads[i];
                (
                    l.in_flight.load(Relaxed) as u64,
                    l.decoding.load(Relaxed) as u64,
                )
            })
        }));
        request_bytes(&self.authority, "GET", "/metrics", "text/plain", None)
    }

    /// Publish what a scrape returned: the /metrics text, or why there is none.
    pub(super) fn finish(&mut self, shared: &Shared, result: io::Result<String>) {
        match result {
            Ok(text) => {
                let samples = if self.names.is_empty() {
                    vec![parse_metrics(&text)]
                } else {
                    parse_metrics_ranks(&text, self.ranks)
                };
                let each = self
                    .slots
                    .iter()
                    .zip(&samples)
                    .zip(&self.own)
                    .zip(&mut self.prefills);
                for (((slot, m), own), reports) in each {
                    let Some(i) = *slot else { continue };
                    if *m == MetricsSample::default() {
                        // A /metrics without any series we know: not a replica's telemetry.
                        shared.telemetry[i].scrape_errors.fetch_add(1, Relaxed);
                        continue;
                    }
                    publish(shared, i, m, *own, self.interval);
                    calibrate_prefill(shared, i, m, reports);
                }
            }
            Err(_) => {
                for i in self.slots.iter().flatten() {
                    shared.telemetry[*i].scrape_errors.fetch_add(1, Relaxed);
                }
            }
        }
    }

    /// The slot it scrapes for.
    pub(super) fn slot(&self) -> usize {
        self.r
    }
}
