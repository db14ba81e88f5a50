//! One replay boiled down (`ReplaySummary`, written as JSON by `kvlb replay --json`), and
//! `kvlb replay report`: several summaries side by side as a table, the ratios of one
//! balancer to a baseline and to the best of the others, a combined JSON and an SVG drawn by
//! the simulator's plot (`crate::sim::plot`).
//!
//! Times are the simulated engine's seconds: wall seconds times the replicas' time scale.
//! `hit_rate`, `prefill_tokens` and `max_mean_load` come from the replicas' own counters
//! (`counters`); without `--replica` they are absent. `models` breaks the run down by the
//! model each request named; its hit rates come from the answers' own usage (prompt tokens
//! the engine found cached), as a replica's counters do not tell one model from another.

#![forbid(unsafe_code)]

use super::client::{self, StreamUsage, Streamed};
use super::counters::EngineCounters;
use super::Api;
use crate::sim::report::percentile;
use crate::sim::trace::TraceRequest;
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// What happened to one request (wall seconds).
#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub index: usize,
    /// How late the replayer sent it, after its scheduled time.
    pub late_s: f64,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    /// Mean seconds between its streamed tokens (`Streamed::itl_s`).
    pub itl_s: Option<f64>,
    pub error: Option<String>,
    /// The answer's usage event, when it had one.
    pub usage: Option<StreamUsage>,
}

impl RequestRecord {
    pub fn failed(index: usize, late_s: f64, error: String) -> RequestRecord {
        RequestRecord {
            index,
            late_s,
            ttft_s: None,
            e2e_s: 0.0,
            itl_s: None,
            error: Some(error),
            usage: None,
        }
    }

    /// A streamed answer counts when it is a 200 with an event (Responses, Messages: a text
    /// delta) and its last event (`[DONE]`, `response.completed` or `response.incomplete`,
    /// `message_stop`).
    pub fn from_answer(index: usize, late_s: f64, answer: Result<Streamed, String>) -> Self {
        let a = match answer {
            Ok(a) => a,
            Err(e) => return RequestRecord::failed(index, late_s, e),
        };
        let error = if a.status != 200 {
            let body = String::from_utf8_lossy(&a.body);
            Some(format!(
                "HTTP {}: {}",
                a.status,
                body.chars().take(200).collect::<String>().trim()
            ))
        } else if a.ttft_s.is_none() {
            Some(match a.api {
                Api::Chat | Api::Completions => "200 without any SSE event".into(),
                Api::Responses | Api::Messages => "200 without any text delta event".into(),
            })
        } else if !a.done {
            Some(format!("stream ended before {}", client::end_event(a.api)))
        } else {
            None
        };
        RequestRecord {
            index,
            late_s,
            ttft_s: a.ttft_s,
            e2e_s: a.e2e_s,
            itl_s: a.itl_s,
            error,
            usage: a.usage,
        }
    }
}

/// The run's identity, for the summary.
#[derive(Debug, Clone)]
pub struct RunInfo {
    pub label: String,
    pub target: String,
    pub trace: String,
    pub api: String,
    pub speedup: f64,
    pub time_scale: f64,
    pub wall_s: f64,
    pub cpu_s: f64,
}

/// One replica's share of a replay, from its own counters.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReplicaShare {
    pub url: String,
    pub requests: f64,
    pub prompt_tokens: f64,
    pub prefix_queries_tokens: f64,
    pub prefix_hits_tokens: f64,
    /// Prompt tokens computed (looked up, not found cached).
    pub computed_tokens: f64,
}

/// The requests that named one model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelShare {
    pub model: String,
    pub requests: usize,
    pub ok: usize,
    /// Failed, a replica's 404 for a model it does not serve included.
    pub errors: usize,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    pub e2e_p99_s: Option<f64>,
    /// Prompt tokens the answers' usage counted.
    pub prompt_tokens: u64,
    /// Of those, the tokens found cached (`prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
    /// cached / prompt tokens over the answers whose usage tells cached tokens.
    pub hit_rate: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReplaySummary {
    pub label: String,
    pub target: String,
    pub trace: String,
    pub api: String,
    pub speedup: f64,
    pub time_scale: f64,
    /// Requests sent.
    pub requests: usize,
    /// Answered in full (200, events, the last event: `[DONE]`, `response.completed`, ...).
    pub ok: usize,
    pub errors: usize,
    /// The first few error messages.
    pub error_samples: Vec<String>,
    /// Wall seconds from the first request sent to the last answer.
    pub wall_s: f64,
    /// 99th percentile of how late the replayer sent requests, wall seconds (a busy load
    /// generator shows here).
    pub send_late_p99_wall_s: f64,
    /// CPU seconds the replayer itself used (user + system).
    pub replayer_cpu_s: f64,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    pub ttft_mean_s: Option<f64>,
    pub e2e_p50_s: Option<f64>,
    pub e2e_p99_s: Option<f64>,
    /// Inter-token latency: percentiles over the answered requests of each one's mean time
    /// between streamed tokens (summaries written before it read back as none).
    #[serde(default)]
    pub itl_p50_s: Option<f64>,
    #[serde(default)]
    pub itl_p99_s: Option<f64>,
    /// Prompt tokens found cached / prompt tokens looked up, summed over the replicas.
    pub hit_rate: Option<f64>,
    /// Prompt tokens the replicas counted.
    pub prompt_tokens: Option<f64>,
    /// Prompt tokens the replicas computed.
    pub prefill_tokens: Option<f64>,
    /// Busiest replica's computed prompt tokens over the mean (1 = even).
    pub max_mean_load: Option<f64>,
    /// Busiest replica's request count over the mean.
    pub max_mean_requests: Option<f64>,
    /// Idlest replica's computed prompt tokens over the mean (0 = a replica did none).
    #[serde(default)]
    pub min_mean_load: Option<f64>,
    /// The share of the run's moments (the replicas' queue gauges read every 100 ms) with a
    /// replica idle while another had requests waiting.
    #[serde(default)]
    pub idle_while_queued: Option<f64>,
    /// The sampled moments behind `idle_while_queued`, and per replica how many of them it
    /// sat idle while another queued.
    #[serde(default)]
    pub occupancy: Option<crate::replay::counters::Occupancy>,
    pub replicas: Vec<ReplicaShare>,
    /// Per model named, by name (summaries written before it read back as none).
    #[serde(default)]
    pub models: Vec<ModelShare>,
    /// TTFT of every answered request, sorted (engine seconds).
    pub ttfts_s: Vec<f64>,
}

fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

fn max_over_mean(v: &[f64]) -> Option<f64> {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let max = v.iter().copied().fold(0.0, f64::max);
    (mean > 0.0).then(|| max / mean)
}

fn min_over_mean(v: &[f64]) -> Option<f64> {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    (mean > 0.0).then(|| min / mean)
}

/// The figures of `records` (one model's or all), times scaled by `scale`.
fn model_share(model: &str, scale: f64, records: &[&RequestRecord]) -> ModelShare {
    let ok: Vec<&&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let mut ttfts: Vec<f64> = ok
        .iter()
        .filter_map(|r| r.ttft_s)
        .map(|t| t * scale)
        .collect();
    ttfts.sort_by(f64::total_cmp);
    let mut e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s * scale).collect();
    e2e.sort_by(f64::total_cmp);
    let (mut prompt, mut cached, mut told) = (0u64, 0u64, 0u64);
    for u in ok.iter().filter_map(|r| r.usage) {
        prompt += u.prompt_tokens;
        if let Some(c) = u.cached_tokens {
            cached += c;
            told += u.prompt_tokens;
        }
    }
    ModelShare {
        model: model.to_string(),
        requests: records.len(),
        ok: ok.len(),
        errors: records.len() - ok.len(),
        ttft_p50_s: finite(percentile(&ttfts, 50.0)),
        ttft_p90_s: finite(percentile(&ttfts, 90.0)),
        ttft_p99_s: finite(percentile(&ttfts, 99.0)),
        e2e_p99_s: finite(percentile(&e2e, 99.0)),
        prompt_tokens: prompt,
        cached_tokens: cached,
        hit_rate: (told > 0).then(|| cached as f64 / told as f64),
    }
}

/// One `ModelShare` per model the requests named, by name.
fn per_model(requests: &[TraceRequest], records: &[RequestRecord], scale: f64) -> Vec<ModelShare> {
    let mut by: std::collections::BTreeMap<&str, Vec<&RequestRecord>> = Default::default();
    for r in records {
        let model = requests
            .get(r.index)
            .and_then(|q| q.model.as_deref())
            .unwrap_or("-");
        by.entry(model).or_default().push(r);
    }
    by.iter().map(|(m, rs)| model_share(m, scale, rs)).collect()
}

pub fn summarize(
    info: RunInfo,
    requests: &[TraceRequest],
    records: &[RequestRecord],
    replicas: &[(String, EngineCounters)],
    occupancy: Option<crate::replay::counters::Occupancy>,
) -> ReplaySummary {
    let scale = info.time_scale;
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let mut ttfts: Vec<f64> = ok
        .iter()
        .filter_map(|r| r.ttft_s)
        .map(|t| t * scale)
        .collect();
    ttfts.sort_by(f64::total_cmp);
    let mut e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s * scale).collect();
    e2e.sort_by(f64::total_cmp);
    let mut itls: Vec<f64> = ok
        .iter()
        .filter_map(|r| r.itl_s)
        .map(|t| t * scale)
        .collect();
    itls.sort_by(f64::total_cmp);
    let mut late: Vec<f64> = records.iter().map(|r| r.late_s).collect();
    late.sort_by(f64::total_cmp);
    let mut error_samples: Vec<String> = Vec::new();
    let mut errors: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_some()).collect();
    errors.sort_by_key(|r| r.index);
    for r in &errors {
        let e = r.error.as_deref().unwrap_or("");
        if error_samples.len() < 5 && !error_samples.iter().any(|s| s.ends_with(e)) {
            error_samples.push(format!("request {}: {e}", r.index));
        }
    }
    let shares: Vec<ReplicaShare> = replicas
        .iter()
        .map(|(url, c)| ReplicaShare {
            url: url.clone(),
            requests: c.requests,
            prompt_tokens: c.prompt_tokens,
            prefix_queries_tokens: c.prefix_queries,
            prefix_hits_tokens: c.prefix_hits,
            computed_tokens: c.computed_tokens(),
        })
        .collect();
    let have = !shares.is_empty();
    let queries: f64 = shares.iter().map(|s| s.prefix_queries_tokens).sum();
    let hits: f64 = shares.iter().map(|s| s.prefix_hits_tokens).sum();
    let computed: Vec<f64> = shares.iter().map(|s| s.computed_tokens).collect();
    let reqs: Vec<f64> = shares.iter().map(|s| s.requests).collect();
    let mean = |v: &[f64]| finite(v.iter().sum::<f64>() / v.len() as f64);
    ReplaySummary {
        label: info.label,
        target: info.target,
        trace: info.trace,
        api: info.api,
        speedup: info.speedup,
        time_scale: scale,
        requests: requests.len(),
        ok: ok.len(),
        errors: errors.len(),
        error_samples,
        wall_s: info.wall_s,
        send_late_p99_wall_s: finite(percentile(&late, 99.0)).unwrap_or(0.0),
        replayer_cpu_s: info.cpu_s,
        ttft_p50_s: finite(percentile(&ttfts, 50.0)),
        ttft_p90_s: finite(percentile(&ttfts, 90.0)),
        ttft_p99_s: finite(percentile(&ttfts, 99.0)),
        ttft_mean_s: mean(&ttfts),
        e2e_p50_s: finite(percentile(&e2e, 50.0)),
        e2e_p99_s: finite(percentile(&e2e, 99.0)),
        itl_p50_s: finite(percentile(&itls, 50.0)),
        itl_p99_s: finite(percentile(&itls, 99.0)),
        hit_rate: (have && queries > 0.0).then(|| hits / queries),
        prompt_tokens: have.then(|| shares.iter().map(|s| s.prompt_tokens).sum()),
        prefill_tokens: have.then(|| computed.iter().sum()),
        max_mean_load: if have { max_over_mean(&computed) } else { None },
        max_mean_requests: if have { max_over_mean(&reqs) } else { None },
        min_mean_load: if have { min_over_mean(&computed) } else { None },
        idle_while_queued: occupancy.as_ref().and_then(|o| o.share()),
        occupancy,
        replicas: shares,
        models: per_model(requests, records, scale),
        ttfts_s: ttfts,
    }
}

fn secs(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v < 10.0 => format!("{v:.3}"),
        Some(v) => format!("{v:.1}"),
    }
}

fn ratio(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into())
}

/// An aligned table, one row per summary.
pub fn table(summaries: &[ReplaySummary]) -> String {
    let mut s = String::new();
    let w = summaries
        .iter()
        .map(|x| x.label.len())
        .max()
        .unwrap_or(8)
        .max(8);
    let _ = writeln!(
        s,
        "{:<w$}  {:>8} {:>6}  {:>8} {:>8} {:>8}  {:>8}  {:>8} {:>8}  {:>8}  {:>8} {:>8} {:>6}  {:>7}  requests per replica",
        "balancer",
        "requests",
        "errors",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "e2e_p99",
        "itl_p50",
        "itl_p99",
        "hit_rate",
        "max/mean",
        "min/mean",
        "idle_q",
        "late_ms"
    );
    for x in summaries {
        let per: Vec<String> = x
            .replicas
            .iter()
            .map(|r| format!("{:.0}", r.requests))
            .collect();
        let _ = writeln!(
            s,
            "{:<w$}  {:>8} {:>6}  {:>8} {:>8} {:>8}  {:>8}  {:>8} {:>8}  {:>8}  {:>8} {:>8} {:>6}  {:>7.1}  {}",
            x.label,
            x.requests,
            x.errors,
            secs(x.ttft_p50_s),
            secs(x.ttft_p90_s),
            secs(x.ttft_p99_s),
            secs(x.e2e_p99_s),
            secs(x.itl_p50_s),
            secs(x.itl_p99_s),
            pct(x.hit_rate),
            ratio(x.max_mean_load),
            ratio(x.min_mean_load),
            pct(x.idle_while_queued),
            x.send_late_p99_wall_s * 1000.0,
            if per.is_empty() {
                "-".into()
            } else {
                per.join(" ")
            }
        );
    }
    if summaries.iter().any(|x| x.models.len() > 1) {
        s.push_str(&model_table(summaries));
    }
    s
}

/// A rate as a percentage, `-` when there is none.
fn pct(v: Option<f64>) -> String {
    v.map(|h| format!("{:.1}%", h * 100.0))
        .unwrap_or_else(|| "-".into())
}

/// An aligned table, one row per balancer and model (hit rate from the answers' usage).
pub fn model_table(summaries: &[ReplaySummary]) -> String {
    let mut s = String::new();
    let w = summaries
        .iter()
        .map(|x| x.label.len())
        .max()
        .unwrap_or(8)
        .max(8);
    let wm = summaries
        .iter()
        .flat_map(|x| x.models.iter().map(|m| m.model.len()))
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(
        s,
        "{:<w$}  {:<wm$}  {:>8} {:>6}  {:>8} {:>8} {:>8}  {:>8}",
        "balancer", "model", "requests", "errors", "ttft_p50", "ttft_p90", "ttft_p99", "hit_rate"
    );
    for x in summaries {
        for m in &x.models {
            let _ = writeln!(
                s,
                "{:<w$}  {:<wm$}  {:>8} {:>6}  {:>8} {:>8} {:>8}  {:>8}",
                x.label,
                m.model,
                m.requests,
                m.errors,
                secs(m.ttft_p50_s),
                secs(m.ttft_p90_s),
                secs(m.ttft_p99_s),
                pct(m.hit_rate)
            );
        }
    }
    s
}

/// `other / subject` for a lower-is-better figure.
fn times_lower(subject: Option<f64>, other: Option<f64>) -> Option<f64> {
    match (subject, other) {
        (Some(a), Some(b)) if a > 0.0 => Some(b / a),
        _ => None,
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Comparison {
    pub subject: String,
    pub other: String,
    /// The other's figure over the subject's (above 1: the subject is lower, i.e. better).
    pub ttft_p50_ratio: Option<f64>,
    pub ttft_p99_ratio: Option<f64>,
    pub e2e_p99_ratio: Option<f64>,
    pub subject_hit_rate: Option<f64>,
    pub other_hit_rate: Option<f64>,
}

fn compare(a: &ReplaySummary, b: &ReplaySummary) -> Comparison {
    Comparison {
        subject: a.label.clone(),
        other: b.label.clone(),
        ttft_p50_ratio: times_lower(a.ttft_p50_s, b.ttft_p50_s),
        ttft_p99_ratio: times_lower(a.ttft_p99_s, b.ttft_p99_s),
        e2e_p99_ratio: times_lower(a.e2e_p99_s, b.e2e_p99_s),
        subject_hit_rate: a.hit_rate,
        other_hit_rate: b.hit_rate,
    }
}

fn describe(c: &Comparison, what: &str) -> String {
    let r = |v: Option<f64>| match v {
        Some(v) if v >= 1.0 => format!("{v:.2}x lower"),
        Some(v) if v > 0.0 => format!("{:.2}x HIGHER", 1.0 / v),
        _ => "-".into(),
    };
    format!(
        "{} vs {what} {}: p99 TTFT {}, p50 TTFT {}, p99 e2e {}; hit rate {} vs {}",
        c.subject,
        c.other,
        r(c.ttft_p99_ratio),
        r(c.ttft_p50_ratio),
        r(c.e2e_p99_ratio),
        pct(c.subject_hit_rate),
        pct(c.other_hit_rate)
    )
}

/// Signs that a balancer did not really route: the replicas saw fewer requests than were
/// answered, or a replica got none.
pub fn routing_warnings(summaries: &[ReplaySummary]) -> Vec<String> {
    let mut out = Vec::new();
    for s in summaries.iter().filter(|s| !s.replicas.is_empty()) {
        let seen: f64 = s.replicas.iter().map(|r| r.requests).sum();
        if seen + 0.5 < s.ok as f64 {
            out.push(format!(
                "{}: the replicas counted {seen:.0} requests but {} were answered",
                s.label, s.ok
            ));
        }
        for r in s.replicas.iter().filter(|r| r.requests < 0.5) {
            out.push(format!("{}: replica {} got no request", s.label, r.url));
        }
    }
    out
}

/// The side-by-side report: (text, combined JSON).
pub fn report(
    summaries: &[ReplaySummary],
    failed: &[(String, String)],
    subject: Option<&str>,
    baseline: Option<&str>,
) -> Result<(String, serde_json::Value), String> {
    let mut text = table(summaries);
    for (label, why) in failed {
        let _ = writeln!(text, "{label:<8}  FAILED: {why}");
    }
    for w in routing_warnings(summaries) {
        let _ = writeln!(text, "WARNING: {w}");
    }
    // A named balancer that did not run (it failed, or was not asked for) leaves its ratios out.
    let mut find = |label: &str| {
        let found = summaries.iter().find(|s| s.label == label);
        if found.is_none() {
            let _ = writeln!(text, "(no {label} run: no ratios to it)");
        }
        found
    };
    let subject = match subject {
        Some(l) => find(l),
        None => summaries.first(),
    };
    let baseline = match baseline {
        Some(l) => find(l),
        None => summaries
            .iter()
            .find(|s| s.label.contains("round_robin") || s.label.contains("round-robin")),
    };
    let mut vs_baseline = None;
    let mut vs_best = None;
    if let Some(k) = subject {
        if let Some(b) = baseline.filter(|b| b.label != k.label) {
            let c = compare(k, b);
            let _ = writeln!(text, "{}", describe(&c, "round-robin reference"));
            vs_baseline = Some(c);
        }
        // The best other balancer by p99 TTFT, among those that answered everything.
        let best = summaries
            .iter()
            .filter(|s| s.label != k.label && baseline.is_none_or(|b| b.label != s.label))
            .filter(|s| s.errors == 0 && s.ttft_p99_s.is_some())
            .min_by(|a, b| a.ttft_p99_s.unwrap().total_cmp(&b.ttft_p99_s.unwrap()));
        if let Some(b) = best {
            let c = compare(k, b);
            let _ = writeln!(text, "{}", describe(&c, "best peer (by p99 TTFT)"));
            vs_best = Some(c);
        }
        if let Some(h) = k.hit_rate {
            let top = summaries
                .iter()
                .filter_map(|s| s.hit_rate.map(|r| (r, &s.label)))
                .max_by(|a, b| a.0.total_cmp(&b.0));
            if let Some((r, l)) = top.filter(|(_, l)| **l != k.label) {
                let _ = writeln!(
                    text,
                    "highest hit rate: {l} {:.1}% (kvlb {:.1}%)",
                    r * 100.0,
                    h * 100.0
                );
            }
        }
    }
    let failed_json: Vec<serde_json::Value> = failed
        .iter()
        .map(|(l, w)| serde_json::json!({"label": l, "error": w}))
        .collect();
    let json = serde_json::json!({
        "balancers": summaries,
        "failed": failed_json,
        "vs_baseline": vs_baseline,
        "vs_best_peer": vs_best,
        "warnings": routing_warnings(summaries),
    });
    Ok((text, json))
}

/// The simulator's summary shape, so its plot draws replays too.
fn as_sim_summary(s: &ReplaySummary) -> crate::sim::report::Summary {
    let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
    crate::sim::report::Summary {
        policy: s.label.clone(),
        requests: s.requests,
        finished: s.ok,
        rejected: s.errors,
        ttft_p50_s: nan(s.ttft_p50_s),
        ttft_p90_s: nan(s.ttft_p90_s),
        ttft_p99_s: nan(s.ttft_p99_s),
        ttft_mean_s: nan(s.ttft_mean_s),
        e2e_p50_s: nan(s.e2e_p50_s),
        e2e_p99_s: nan(s.e2e_p99_s),
        itl_p50_s: f64::NAN,
        itl_p99_s: f64::NAN,
        hit_rate: s.hit_rate.unwrap_or(0.0),
        prompt_tokens: s.prompt_tokens.unwrap_or(0.0) as u64,
        prefill_tokens: s.prefill_tokens.unwrap_or(0.0) as u64,
        duplicate_kv_blocks: 0.0,
        max_mean_load: s.max_mean_load.unwrap_or(1.0),
        replica_prefill_tokens: s
            .replicas
            .iter()
            .map(|r| r.computed_tokens as u64)
            .collect(),
        preemptions: 0,
        makespan_s: s.wall_s,
        disaggregated: None,
    }
}

/// The SVG: TTFT CDF per balancer, prompt tokens computed per replica.
pub fn plot(title: &str, summaries: &[ReplaySummary]) -> String {
    let sims: Vec<_> = summaries.iter().map(as_sim_summary).collect();
    let ttfts: Vec<Vec<f64>> = summaries.iter().map(|s| s.ttfts_s.clone()).collect();
    crate::sim::plot::render(title, &sims, &ttfts)
}

/// `kvlb replay report ...`.
pub fn report_main(args: &[String]) -> i32 {
    match report_cli(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvlb replay report: {e}");
            2
        }
    }
}

fn report_cli(args: &[String]) -> Result<(), String> {
    let mut title = "kvlb replay".to_string();
    let (mut subject, mut baseline, mut json_out, mut plot_out) = (None, None, None, None);
    let mut failed = Vec::new();
    let mut files = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if !flag.starts_with("--") {
            files.push(flag.to_string());
            i += 1;
            continue;
        }
        let v = args
            .get(i + 1)
            .ok_or(format!("{flag} needs a value (see kvlb replay --help)"))?
            .clone();
        match flag {
            "--title" => title = v,
            "--kvlb" => subject = Some(v),
            "--baseline" => baseline = Some(v),
            "--json" => json_out = Some(v),
            "--plot" => plot_out = Some(v),
            "--failed" => {
                let (l, w) = v
                    .split_once('=')
                    .ok_or(format!("--failed {v:?}: expected LABEL=REASON"))?;
                failed.push((l.to_string(), w.to_string()));
            }
            other => return Err(format!("unknown option {other:?} (see kvlb replay --help)")),
        }
        i += 2;
    }
    if files.is_empty() && failed.is_empty() {
        return Err("no summaries given (files written by kvlb replay --json)".into());
    }
    let mut summaries = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{f:?}: cannot read: {e}"))?;
        let s: ReplaySummary =
            serde_json::from_str(&text).map_err(|e| format!("{f:?}: not a replay summary: {e}"))?;
        summaries.push(s);
    }
    let (text, json) = report(&summaries, &failed, subject.as_deref(), baseline.as_deref())?;
    print!("{text}");
    if let Some(p) = json_out {
        let body = serde_json::to_string_pretty(&json).expect("report serialises");
        std::fs::write(&p, body + "\n").map_err(|e| format!("--json {p:?}: cannot write: {e}"))?;
    }
    if let Some(p) = plot_out {
        std::fs::write(&p, plot(&title, &summaries))
            .map_err(|e| format!("--plot {p:?}: cannot write: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(index: usize, ttft: f64) -> RequestRecord {
        RequestRecord {
            index,
            late_s: 0.001,
            ttft_s: Some(ttft),
            e2e_s: ttft * 3.0,
            itl_s: Some(ttft / 10.0),
            error: None,
            usage: Some(StreamUsage {
                prompt_tokens: 10,
                cached_tokens: Some(index as u64),
            }),
        }
    }

    fn run(label: &str, ttft: f64, hits: f64) -> ReplaySummary {
        let reqs = vec![
            TraceRequest {
                arrival_s: 0.0,
                prompt_tokens: 10,
                output_tokens: 1,
                block_ids: vec![1],
                model: None,
            };
            3
        ];
        let mut records = vec![record(0, ttft), record(1, ttft * 2.0)];
        records.push(RequestRecord::failed(2, 0.0, "connect: refused".into()));
        let c = |req: f64, q: f64, h: f64| EngineCounters {
            requests: req,
            prompt_tokens: q,
            prefix_queries: q,
            prefix_hits: h,
        };
        summarize(
            RunInfo {
                label: label.into(),
                target: "http://x:1".into(),
                trace: "t".into(),
                api: "chat".into(),
                speedup: 1.0,
                time_scale: 10.0,
                wall_s: 1.0,
                cpu_s: 0.1,
            },
            &reqs,
            &records,
            &[
                ("a".into(), c(2.0, 100.0, hits)),
                ("b".into(), c(0.0, 0.0, 0.0)),
            ],
            Some(crate::replay::counters::Occupancy {
                samples: 4,
                idle_while_queued: 1,
                idle_while_other_queued: vec![0, 1],
            }),
        )
    }

    #[test]
    fn summaries_scale_times_and_use_the_replicas_counters() {
        let s = run("kvlb", 0.1, 40.0);
        assert_eq!((s.requests, s.ok, s.errors), (3, 2, 1));
        assert_eq!(s.ttft_p50_s, Some(1.0));
        assert_eq!(s.ttft_p99_s, Some(2.0));
        assert_eq!(s.hit_rate, Some(0.4));
        assert_eq!(s.prefill_tokens, Some(60.0));
        assert_eq!(s.max_mean_load, Some(2.0));
        assert_eq!(s.min_mean_load, Some(0.0));
        assert_eq!(s.idle_while_queued, Some(0.25));
        assert!(s.error_samples[0].contains("refused"));
        let t = table(std::slice::from_ref(&s));
        let head = t.lines().next().unwrap();
        assert!(head.contains("max/mean min/mean idle_q  late_ms"), "{t}");
        let row = t.lines().nth(1).unwrap();
        assert!(row.contains("    2.00     0.00  25.0%"), "{t}");
        let back: ReplaySummary =
            serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn reports_compare_with_the_baseline_and_the_best_peer() {
        let mut peer = run("peer", 0.2, 10.0);
        peer.errors = 0;
        let mut broken = run("broken", 0.01, 10.0);
        broken.errors = 3;
        let all = vec![
            run("kvlb", 0.1, 40.0),
            run("kvlb-round_robin", 0.4, 0.0),
            peer,
            broken,
        ];
        let (text, json) =
            report(&all, &[("x".into(), "did not start".into())], None, None).unwrap();
        assert!(text.contains("x         FAILED: did not start"), "{text}");
        assert!(
            text.contains("vs round-robin reference kvlb-round_robin: p99 TTFT 4.00x lower"),
            "{text}"
        );
        assert!(
            text.contains("vs best peer (by p99 TTFT) peer: p99 TTFT 2.00x lower"),
            "{text}"
        );
        assert_eq!(json["vs_best_peer"]["other"], "peer");
        assert!(
            text.contains("WARNING: kvlb: replica b got no request"),
            "{text}"
        );
        let (text, _) = report(&all, &[], Some("nope"), None).unwrap();
        assert!(text.contains("(no nope run: no ratios to it)"), "{text}");
        let svg = plot("t", &all);
        assert!(svg.starts_with("<svg") && svg.contains("kvlb-round_robin"));
    }

    #[test]
    fn models_get_their_own_rows_and_hit_rates() {
        let req = |m: &str| TraceRequest {
            arrival_s: 0.0,
            prompt_tokens: 10,
            output_tokens: 1,
            block_ids: vec![1],
            model: Some(m.into()),
        };
        let reqs = vec![req("base"), req("lora"), req("base"), req("lora")];
        // Out of order, as answers arrive; the lora's second request got a 404.
        let records = vec![
            record(2, 0.3),
            record(0, 0.1),
            record(1, 0.2),
            RequestRecord::failed(3, 0.0, "HTTP 404: The model `lora` does not exist.".into()),
        ];
        let s = summarize(
            RunInfo {
                label: "x".into(),
                target: "t".into(),
                trace: "t".into(),
                api: "chat".into(),
                speedup: 1.0,
                time_scale: 10.0,
                wall_s: 1.0,
                cpu_s: 0.0,
            },
            &reqs,
            &records,
            &[],
            None,
        );
        let names: Vec<&str> = s.models.iter().map(|m| m.model.as_str()).collect();
        assert_eq!(names, ["base", "lora"]);
        let (base, lora) = (&s.models[0], &s.models[1]);
        assert_eq!((base.requests, base.ok, base.errors), (2, 2, 0));
        assert_eq!((lora.requests, lora.ok, lora.errors), (2, 1, 1));
        assert_eq!(base.ttft_p50_s, Some(1.0));
        assert_eq!(base.ttft_p99_s, Some(3.0));
        assert_eq!(lora.ttft_p99_s, Some(2.0));
        // Usage: 10 prompt tokens each, cached = the record's index.
        assert_eq!((base.prompt_tokens, base.cached_tokens), (20, 2));
        assert_eq!(base.hit_rate, Some(0.1));
        assert_eq!(lora.hit_rate, Some(0.1));
        let text = table(std::slice::from_ref(&s));
        assert!(text.contains("balancer  model"), "{text}");
        let row = text.lines().find(|l| l.contains(" lora ")).unwrap();
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            ["x", "lora", "2", "1", "2.000", "2.000", "2.000", "10.0%"],
            "{text}"
        );
        // Older summaries (no models) still read back.
        let mut v = serde_json::to_value(&s).unwrap();
        v.as_object_mut().unwrap().remove("models");
        let back: ReplaySummary = serde_json::from_value(v).unwrap();
        assert!(back.models.is_empty());
        assert!(!table(&[back]).contains("balancer  model"));
    }
}
