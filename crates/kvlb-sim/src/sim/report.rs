//! One policy's run boiled down to the numbers the comparison is about, printed as an aligned
//! table or as JSON (one object per policy).
//!
//! * `ttft_*`, `e2e_*`: percentiles (nearest rank) over requests that finished; a
//!   disaggregated request's first token is its decode replica's.
//! * `itl_*`: percentiles over finished requests of two or more output tokens of each one's
//!   mean time between output tokens (inter-token latency: where a long prefill stalls the
//!   sequences decoding beside it, and what disaggregation protects).
//! * `hit_rate`: prompt tokens the engines found cached / prompt tokens looked up (the
//!   engines' own prefix-cache counters, first admission of each request), in GPU memory or
//!   loaded from a host KV tier; `host_hit_rate` (with a host tier: an extra JSON key and
//!   table column) is the host tier's part of it.
//! * `prefill_tokens`: prompt tokens actually computed (prompt minus cached, per request;
//!   recomputation after a preemption is not included, `preemptions` counts those).
//! * `duplicate_kv_blocks`: mean over samples every 10 s of simulated time of the engine blocks
//!   (16 tokens) believed held by more than one replica, from the prompts routed to each
//!   replica with each replica's KV capacity as an LRU bound (the engines are not opened up
//!   for it, so it is an estimate of the same thing).
//! * `max_mean_load`: the busiest replica's computed prefill tokens over the fleet mean (1 =
//!   perfectly even); in a fleet with prefill and decode replicas, over the replicas other
//!   than decode ones (the prefill pool, and replicas of role both).
//! * `disaggregated` (a fleet with prefill and decode replicas: an extra JSON key and table
//!   column): requests prefilled on a prefill replica and decoded on a decode one; the rest
//!   were computed whole on a decode replica (`--disaggregate priced`) or rejected.
//!
//! In a disaggregated fleet `hit_rate` and `prefill_tokens` are the prompts' lookups and work
//! on the replicas that computed them (a prefill replica, or a decode one directly): the
//! decode legs, which receive their prompt's KV, are left out.
//! * per model (`models`, when requests name models): requests, rejected (no replica serves
//!   the model, or the engine refused), TTFT p50/p99, and the hit rate of its requests (cached
//!   tokens at admission over prompt tokens).

#![forbid(unsafe_code)]

use super::fleet::{RequestRecord, Run};
use super::pd::Role;
use super::trace::Trace;
use serde::Serialize;

/// One policy's requests naming one model.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ModelSummary {
    pub policy: String,
    pub model: String,
    pub requests: usize,
    pub rejected: usize,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    /// Cached prompt tokens at admission / prompt tokens, over its finished requests.
    pub hit_rate: f64,
}

/// `run` by model (`trace` is the trace it ran, for the models), by name; requests naming none
/// under "-".
pub fn per_model(run: &Run, trace: &Trace) -> Vec<ModelSummary> {
    let mut by: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
    for (k, r) in trace.requests.iter().enumerate().take(run.records.len()) {
        by.entry(r.model.as_deref().unwrap_or("-"))
            .or_default()
            .push(k);
    }
    by.into_iter()
        .map(|(model, ks)| {
            let recs: Vec<_> = ks.iter().map(|&k| &run.records[k]).collect();
            let mut ttft: Vec<f64> = recs
                .iter()
                .map(|r| r.ttft_s)
                .filter(|t| t.is_finite())
                .collect();
            ttft.sort_by(f64::total_cmp);
            let done = recs.iter().filter(|r| r.finished);
            let (cached, prompt) = done.fold((0u64, 0u64), |(c, p), r| {
                (c + r.cached_tokens as u64, p + r.prompt_tokens as u64)
            });
            ModelSummary {
                policy: run.policy.clone(),
                model: model.to_string(),
                requests: recs.len(),
                rejected: recs.iter().filter(|r| r.rejected).count(),
                ttft_p50_s: percentile(&ttft, 50.0),
                ttft_p99_s: percentile(&ttft, 99.0),
                hit_rate: if prompt == 0 {
                    0.0
                } else {
                    cached as f64 / prompt as f64
                },
            }
        })
        .collect()
}

/// An aligned table, one row per policy and model.
pub fn model_table(models: &[Vec<ModelSummary>]) -> String {
    let rows = models.iter().flatten();
    let wp = rows
        .clone()
        .map(|m| m.policy.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let wm = rows
        .clone()
        .map(|m| m.model.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let mut out = format!(
        "{:<wp$}  {:<wm$}  {:>8}  {:>8}  {:>8}  {:>8}  {:>8}\n",
        "policy", "model", "requests", "rejected", "ttft_p50", "ttft_p99", "hit_rate"
    );
    for m in rows {
        out.push_str(&format!(
            "{:<wp$}  {:<wm$}  {:>8}  {:>8}  {:>8}  {:>8}  {:>8.3}\n",
            m.policy,
            m.model,
            m.requests,
            m.rejected,
            secs(m.ttft_p50_s),
            secs(m.ttft_p99_s),
            m.hit_rate
        ));
    }
    out
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    pub policy: String,
    pub requests: usize,
    pub finished: usize,
    pub rejected: usize,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub ttft_mean_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_p99_s: f64,
    pub itl_p50_s: f64,
    pub itl_p99_s: f64,
    pub hit_rate: f64,
    pub prompt_tokens: u64,
    pub prefill_tokens: u64,
    pub duplicate_kv_blocks: f64,
    pub max_mean_load: f64,
    pub replica_prefill_tokens: Vec<u64>,
    pub preemptions: u64,
    pub makespan_s: f64,
    /// Requests that took both legs (only for a fleet with prefill and decode replicas).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disaggregated: Option<usize>,
}

/// The `p`-th percentile (0..=100, nearest rank) of sorted `v`; NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Sorted TTFTs (seconds) of the requests that got a first token.
pub fn sorted_ttfts(run: &Run) -> Vec<f64> {
    let mut v: Vec<f64> = run
        .records
        .iter()
        .map(|r| r.ttft_s)
        .filter(|t| t.is_finite())
        .collect();
    v.sort_by(f64::total_cmp);
    v
}

pub fn summarize(run: &Run) -> Summary {
    let ttft = sorted_ttfts(run);
    let sorted = |of: fn(&RequestRecord) -> Option<f64>| {
        let mut v: Vec<f64> = run.records.iter().filter_map(of).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let e2e = sorted(|r| r.finished.then_some(r.e2e_s));
    let itl = sorted(RequestRecord::itl_s);
    let prefill: u64 = run.replica_prefill_tokens.iter().sum();
    let split = run.roles.contains(&Role::Prefill);
    // The replicas that compute prompts: all, or a disaggregated fleet's but decode ones.
    let pool: Vec<u64> = run
        .replica_prefill_tokens
        .iter()
        .zip(&run.roles)
        .filter(|(_, &role)| !split || role != Role::Decode)
        .map(|(&tokens, _)| tokens)
        .collect();
    let mean = pool.iter().sum::<u64>() as f64 / pool.len().max(1) as f64;
    let max = pool.iter().copied().max().unwrap_or(0) as f64;
    Summary {
        policy: run.policy.clone(),
        requests: run.records.len(),
        finished: run.records.iter().filter(|r| r.finished).count(),
        rejected: run.records.iter().filter(|r| r.rejected).count(),
        ttft_p50_s: percentile(&ttft, 50.0),
        ttft_p90_s: percentile(&ttft, 90.0),
        ttft_p99_s: percentile(&ttft, 99.0),
        ttft_mean_s: if ttft.is_empty() {
            f64::NAN
        } else {
            ttft.iter().sum::<f64>() / ttft.len() as f64
        },
        e2e_p50_s: percentile(&e2e, 50.0),
        e2e_p99_s: percentile(&e2e, 99.0),
        itl_p50_s: percentile(&itl, 50.0),
        itl_p99_s: percentile(&itl, 99.0),
        hit_rate: if run.prefix_queries_tokens == 0 {
            0.0
        } else {
            run.prefix_hits_tokens as f64 / run.prefix_queries_tokens as f64
        },
        prompt_tokens: run.prefix_queries_tokens,
        prefill_tokens: prefill,
        duplicate_kv_blocks: if run.duplicate_samples.is_empty() {
            0.0
        } else {
            run.duplicate_samples.iter().sum::<u64>() as f64 / run.duplicate_samples.len() as f64
        },
        max_mean_load: if mean > 0.0 { max / mean } else { 1.0 },
        replica_prefill_tokens: run.replica_prefill_tokens.clone(),
        preemptions: run.preemptions,
        makespan_s: run.makespan_s,
        disaggregated: split.then(|| {
            run.records
                .iter()
                .filter(|r| r.prefill_replica.is_some())
                .count()
        }),
    }
}

/// The summaries as a JSON array, each object with a `host_hit_rate` when `host_hit_rates`
/// are given and its `models` when `models` are (both in the order of `summaries`).
pub fn to_json_with(
    summaries: &[Summary],
    host_hit_rates: Option<&[f64]>,
    models: &[Vec<ModelSummary>],
) -> String {
    let mut v = serde_json::to_value(summaries).unwrap_or_default();
    if let Some(list) = v.as_array_mut() {
        for (k, o) in list.iter_mut().enumerate() {
            let Some(o) = o.as_object_mut() else { continue };
            if let Some(rate) = host_hit_rates.and_then(|h| h.get(k)) {
                o.insert("host_hit_rate".into(), serde_json::json!(rate));
            }
            if let Some(m) = models.get(k) {
                o.insert("models".into(), serde_json::json!(m));
            }
        }
    }
    serde_json::to_string_pretty(&v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// The summaries as a JSON array (non-finite numbers become null).
pub fn to_json(summaries: &[Summary]) -> String {
    serde_json::to_string_pretty(summaries).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// The host tier's share of prompt tokens (tokens loaded from it / prompt tokens looked up).
pub fn host_hit_rate(run: &Run) -> f64 {
    if run.prefix_queries_tokens == 0 {
        0.0
    } else {
        run.host_hits_tokens as f64 / run.prefix_queries_tokens as f64
    }
}

/// As `to_json`, each object with a `host_hit_rate` from `host_hit_rates` (same order).
pub fn to_json_with_host(summaries: &[Summary], host_hit_rates: &[f64]) -> String {
    to_json_with(summaries, Some(host_hit_rates), &[])
}

fn secs(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v < 10.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.1}")
    }
}

/// Inter-token latencies: tens of milliseconds, one more digit than `secs`.
fn fine_secs(v: f64) -> String {
    if v.is_finite() && v < 1.0 {
        format!("{v:.4}")
    } else {
        secs(v)
    }
}

fn tokens(v: u64) -> String {
    if v >= 10_000_000 {
        format!("{:.1}M", v as f64 / 1e6)
    } else if v >= 10_000 {
        format!("{:.0}k", v as f64 / 1e3)
    } else {
        v.to_string()
    }
}

/// An aligned table, one row per policy.
pub fn to_table(summaries: &[Summary]) -> String {
    to_table_with_host(summaries, None)
}

/// As `to_table`, with a `host_hit` column after `hit_rate` when `host_hit_rates` are given
/// (same order as `summaries`).
pub fn to_table_with_host(summaries: &[Summary], host_hit_rates: Option<&[f64]>) -> String {
    let head = [
        "policy",
        "requests",
        "disagg",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "e2e_p99",
        "itl_p50",
        "itl_p99",
        "hit_rate",
        "host_hit",
        "prefill_tok",
        "dup_kv_blk",
        "max/mean",
        "preempt",
    ];
    let mut rows: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for (k, s) in summaries.iter().enumerate() {
        let requests = if s.rejected > 0 {
            format!("{} ({} rej)", s.requests, s.rejected)
        } else {
            s.requests.to_string()
        };
        rows.push(vec![
            s.policy.clone(),
            requests,
            s.disaggregated.map_or(String::new(), |n| n.to_string()),
            secs(s.ttft_p50_s),
            secs(s.ttft_p90_s),
            secs(s.ttft_p99_s),
            secs(s.e2e_p99_s),
            fine_secs(s.itl_p50_s),
            fine_secs(s.itl_p99_s),
            format!("{:.3}", s.hit_rate),
            host_hit_rates.map_or(String::new(), |h| format!("{:.3}", h[k])),
            tokens(s.prefill_tokens),
            format!("{:.0}", s.duplicate_kv_blocks),
            format!("{:.2}", s.max_mean_load),
            s.preemptions.to_string(),
        ]);
    }
    // Optional columns, last first: the host tier's, a disaggregated fleet's.
    let shown = [
        ("host_hit", host_hit_rates.is_some()),
        (
            "disagg",
            summaries.iter().any(|s| s.disaggregated.is_some()),
        ),
    ];
    for (name, shown) in shown {
        let Some(column) = head.iter().position(|&h| h == name).filter(|_| !shown) else {
            continue;
        };
        for row in &mut rows {
            row.remove(column);
        }
    }
    let columns = rows[0].len();
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, v)| {
                if c == 0 {
                    format!("{v:<w$}", w = widths[c])
                } else {
                    format!("{v:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str("(seconds; itl = a request's mean time between output tokens; prefill_tok = prompt tokens computed; dup_kv_blk = mean engine blocks held by more than one replica, estimated from routed prompts; max/mean = busiest replica's prefill over the mean)\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_model_rows_count_each_models_requests_and_rejections() {
        use super::super::fleet::{simulate_serving, RoutingPolicy};
        let (trace, serving) = super::super::trace::two_model_fixture();
        let cfg = crate::engine::EngineConfig::default();
        let mut policy = RoutingPolicy::build("round_robin", 2, &cfg).unwrap();
        let run = simulate_serving(&trace, 2, Some(&serving), &cfg, &[], &mut policy, 1).unwrap();
        let rows = per_model(&run, &trace);
        let names: Vec<(&str, usize, usize)> = rows
            .iter()
            .map(|m| (m.model.as_str(), m.requests, m.rejected))
            .collect();
        assert_eq!(
            names,
            [("-", 1, 0), ("a", 1, 0), ("b", 2, 0), ("nobody", 1, 1)]
        );
        assert!(rows[2].ttft_p50_s > 0.0 && rows[3].ttft_p50_s.is_nan());
    }

    #[test]
    fn inter_token_latency_and_a_disaggregated_fleets_columns() {
        use super::super::fleet::RequestRecord;
        let record = |prefill_replica, ttft_s: f64, e2e_s: f64, output_tokens| RequestRecord {
            prefill_replica,
            ttft_s,
            e2e_s,
            output_tokens,
            finished: true,
            ..RequestRecord::default()
        };
        assert_eq!(record(None, 1.0, 3.0, 5).itl_s(), Some(0.5));
        assert_eq!(
            record(None, 1.0, 1.0, 1).itl_s(),
            None,
            "one token: no spacing"
        );
        let unfinished = RequestRecord {
            finished: false,
            ..record(None, 1.0, 3.0, 5)
        };
        assert_eq!(unfinished.itl_s(), None);
        let run = Run {
            policy: "p".into(),
            records: vec![
                record(Some(0), 1.0, 2.0, 11),
                record(Some(1), 1.0, 3.0, 11),
                record(None, 1.0, 5.0, 11),
            ],
            roles: vec![Role::Prefill, Role::Prefill, Role::Decode],
            replica_prefill_tokens: vec![300, 100, 1000],
            prefix_queries_tokens: 2000,
            prefix_hits_tokens: 600,
            host_hits_tokens: 0,
            preemptions: 0,
            duplicate_samples: vec![],
            makespan_s: 5.0,
        };
        let s = summarize(&run);
        assert_eq!((s.itl_p50_s, s.itl_p99_s), (0.2, 0.4));
        assert_eq!(s.disaggregated, Some(2));
        // The busiest of the prefill replicas over their mean; the decode replica's direct
        // prefills count in the work, not in the balance.
        assert_eq!(s.max_mean_load, 1.5);
        assert_eq!(s.prefill_tokens, 1400);
        let table = to_table(std::slice::from_ref(&s));
        let head: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
        assert_eq!(head[..4], ["policy", "requests", "disagg", "ttft_p50"]);
        assert!(head.contains(&"itl_p50") && head.contains(&"itl_p99"));
        assert!(
            table.lines().nth(1).unwrap().contains(" 0.2000 "),
            "{table}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&to_json(std::slice::from_ref(&s))).unwrap();
        assert_eq!(json[0]["disaggregated"], 2);
        assert_eq!(json[0]["itl_p99_s"], 0.4);
        // A whole fleet: neither the column nor the key.
        let whole = Summary {
            disaggregated: None,
            ..s
        };
        assert!(!to_table(std::slice::from_ref(&whole)).contains("disagg"));
        assert!(!to_json(&[whole]).contains("disaggregated"));
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&[3.0], 90.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
