//! `kvlb simulate`: how would each policy do on a real trace? A discrete-event simulation of a
//! fleet of engines — the same engine model `kvlb replica` serves (`crate::engine`) — behind
//! the same selection code `kvlb serve` runs (`crate::select`), fed a request trace; per
//! policy it reports TTFT percentiles, end-to-end latency, prefix-cache hit rate, prefill work,
//! duplicated KV and load imbalance, as a table, JSON and an SVG plot.
//!
//! * `trace`: Mooncake / Azure files and the built-in generators -> requests with block ids;
//! * `fleet`: the event loop (arrivals, engine steps, the data plane's load accounting);
//! * `routed`: what was routed where (estimated uncached tokens, duplicate KV);
//! * `report`: percentiles, table, JSON; `plot`: the SVG.
//!
//! `--residency` says what `cache_aware` learns residency from: its own routing (the default),
//! or routing and the engines' KV events fed back, with or without pending routed blocks
//! (`fleet::ResidencySource`).
//!
//! Deterministic: the same input gives the same output, byte for byte (wall time goes to
//! stderr only).

pub mod fleet;
pub mod plot;
pub mod report;
pub mod routed;
pub mod trace;

use crate::engine::EngineConfig;
use std::time::Instant;

/// Most replicas a simulated fleet may have.
pub const MAX_REPLICAS: u64 = 256;

const HELP: &str = "usage: kvlb simulate --trace FILE|gen:NAME [options]

  --trace SPEC        Mooncake JSONL or Azure CSV file, or a generator:
                      gen:shared-prefix, gen:agent-sessions
  --replicas N        simulated replicas (default 4)
  --speedup X         divide inter-arrival times by X (default 1)
  --policies LIST     comma-separated policies (default: all of them)
  --limit N           only the first N requests of the trace
  --seed N            seed for generators and policy random numbers (default 1)
  --residency SOURCE  what cache_aware learns residency from (default routing):
                      routing         its own routing decisions alone
                      events          routing and the engines' KV events
                      events-pending  as events, and a block routed to a replica since
                                      its last BlockStored there survives a BlockRemoved
                                      (the request waiting there will store it again)
  --host-kv-tokens N  per replica, a host-memory KV tier of N tokens (CPU offloading;
                      default 0 = none): computed blocks are kept in host memory and a
                      prefix the GPU evicted is loaded back instead of recomputed
  --host-load-s-per-token X
                      seconds per token to load KV back from the host tier (default 4e-6)
  --json              print a JSON array, one object per policy, instead of a table
  --plot FILE.svg     write the TTFT CDF and per-replica prefill work as an SVG

policies: round_robin, random, least_loaded, power_of_two, consistent_hash,
          sglang_cache_aware, cache_aware

Each replica is the simulated engine of `kvlb replica` (default configuration: 8B model on
one H100, 400k KV tokens); each policy is the selection code of `kvlb serve`. Per policy:
  ttft_p50/p90/p99_s, e2e_p50/p99_s  time to first token / to the last token (s)
  hit_rate             prompt tokens found in the engines' prefix caches (GPU, or loaded
                       from the host tier) / prompt tokens
  host_hit_rate        of those, the part loaded from the host tier
  prefill_tokens       prompt tokens computed (prompt minus cached)
  duplicate_kv_blocks  mean, over samples every 10 s, of 16-token KV blocks held by more
                       than one replica; estimated from the prompts routed to each replica
                       (LRU-bounded by its KV capacity), not read from the engines
  max_mean_load        the busiest replica's prefill_tokens over the mean (1 = even)
Requests the engine refuses (prompt over the context limit) count as rejected.";

#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub trace: String,
    pub replicas: usize,
    pub speedup: f64,
    pub policies: Vec<String>,
    pub limit: Option<usize>,
    pub seed: u64,
    pub json: bool,
    pub plot: Option<String>,
    pub residency: fleet::ResidencySource,
    /// Per replica: host KV tier tokens (0 = none).
    pub host_kv_tokens: u64,
    pub host_load_s_per_token: f64,
}

/// Parse the command line; `Ok(None)` for `--help`.
pub fn parse_args(args: &[String]) -> Result<Option<Options>, String> {
    let mut o = Options {
        trace: String::new(),
        replicas: 4,
        speedup: 1.0,
        policies: fleet::POLICY_NAMES.iter().map(|s| s.to_string()).collect(),
        limit: None,
        seed: 1,
        json: false,
        plot: None,
        residency: fleet::ResidencySource::Routing,
        host_kv_tokens: 0,
        host_load_s_per_token: EngineConfig::default().host_load_s_per_token,
    };
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        match flag {
            "-h" | "--help" => return Ok(None),
            "--json" => {
                o.json = true;
                i += 1;
                continue;
            }
            _ => {}
        }
        let v = args
            .get(i + 1)
            .ok_or(format!("{flag} needs a value (see kvlb simulate --help)"))?;
        let count = |max: u64| -> Result<u64, String> {
            v.parse::<u64>()
                .ok()
                .filter(|n| (1..=max).contains(n))
                .ok_or(format!(
                    "{flag} {v:?}: expected a whole number from 1 to {max}"
                ))
        };
        match flag {
            "--trace" => o.trace = v.clone(),
            "--replicas" => o.replicas = count(MAX_REPLICAS)? as usize,
            "--speedup" => {
                o.speedup = v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or(format!("--speedup {v:?}: expected a number above 0"))?
            }
            "--policies" => {
                let list: Vec<String> = v
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect();
                if list.is_empty() {
                    return Err("--policies is empty".into());
                }
                for p in &list {
                    if !fleet::POLICY_NAMES.contains(&p.as_str()) {
                        return Err(format!(
                            "--policies: unknown policy {p:?}; known: {}",
                            fleet::POLICY_NAMES.join(", ")
                        ));
                    }
                }
                o.policies = list;
            }
            "--limit" => o.limit = Some(count(u32::MAX as u64)? as usize),
            "--seed" => {
                o.seed = v
                    .parse()
                    .map_err(|_| format!("--seed {v:?}: expected a whole number"))?
            }
            "--plot" => o.plot = Some(v.clone()),
            "--host-kv-tokens" => {
                o.host_kv_tokens = v
                    .parse::<u64>()
                    .ok()
                    .filter(|&n| n == 0 || (16..=1 << 40).contains(&n))
                    .ok_or(format!(
                        "--host-kv-tokens {v:?}: expected 0 (none) or a whole number of tokens from 16 to 2^40"
                    ))?
            }
            "--host-load-s-per-token" => {
                o.host_load_s_per_token = v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or(format!(
                        "--host-load-s-per-token {v:?}: expected a number of seconds >= 0"
                    ))?
            }
            "--residency" => {
                o.residency = fleet::ResidencySource::parse(v).ok_or(format!(
                    "--residency {v:?}: expected one of {}",
                    fleet::ResidencySource::NAMES.join(", ")
                ))?
            }
            other => {
                return Err(format!(
                    "unknown option {other:?} (see kvlb simulate --help)"
                ))
            }
        }
        i += 2;
    }
    if o.trace.is_empty() {
        return Err("--trace is required (a file, gen:shared-prefix or gen:agent-sessions)".into());
    }
    Ok(Some(o))
}

/// Every policy's results, in the order of `Options::policies`.
pub struct Runs {
    pub summaries: Vec<report::Summary>,
    /// Each policy's sorted TTFTs.
    pub ttfts: Vec<Vec<f64>>,
    /// With a host tier, the host tier's share of each policy's hits (else empty).
    pub host_hit_rates: Vec<f64>,
}

/// Run every policy of `o`.
pub fn run(o: &Options) -> Result<Runs, String> {
    let mut t = trace::load(&o.trace, o.limit, o.seed)?;
    if t.requests.is_empty() {
        return Err(format!("--trace {:?}: no requests", o.trace));
    }
    for r in &mut t.requests {
        r.arrival_s /= o.speedup;
    }
    let engine = EngineConfig {
        host_kv_capacity_tokens: o.host_kv_tokens,
        host_load_s_per_token: o.host_load_s_per_token,
        ..EngineConfig::default()
    };
    engine.validate()?;
    let mut summaries = Vec::new();
    let mut ttfts = Vec::new();
    let mut host_hit_rates = Vec::new();
    for name in &o.policies {
        let started = Instant::now();
        let mut policy =
            fleet::RoutingPolicy::build(name, o.replicas, &engine)?.learn_from(o.residency);
        let run = fleet::simulate(&t, o.replicas, &engine, &mut policy, o.seed)?;
        eprintln!(
            "kvlb simulate: {name}: {} requests in {:.2} s wall",
            run.records.len(),
            started.elapsed().as_secs_f64()
        );
        if o.host_kv_tokens > 0 {
            host_hit_rates.push(report::host_hit_rate(&run));
        }
        summaries.push(report::summarize(&run));
        ttfts.push(report::sorted_ttfts(&run));
    }
    Ok(Runs {
        summaries,
        ttfts,
        host_hit_rates,
    })
}

pub fn main(args: Vec<String>) -> i32 {
    let o = match parse_args(&args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{HELP}");
            return 0;
        }
        Err(e) => {
            eprintln!("kvlb simulate: {e}");
            return 2;
        }
    };
    let started = Instant::now();
    let Runs {
        summaries,
        ttfts,
        host_hit_rates,
    } = match run(&o) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvlb simulate: {e}");
            return 1;
        }
    };
    if o.json {
        if o.host_kv_tokens > 0 {
            println!("{}", report::to_json_with_host(&summaries, &host_hit_rates));
        } else {
            println!("{}", report::to_json(&summaries));
        }
    } else {
        let host = if o.host_kv_tokens > 0 {
            format!(", host KV tier {} tokens per replica", o.host_kv_tokens)
        } else {
            String::new()
        };
        println!(
            "{} ({} requests, {} replicas, speedup {}{host})",
            o.trace, summaries[0].requests, o.replicas, o.speedup
        );
        let host = (o.host_kv_tokens > 0).then_some(host_hit_rates.as_slice());
        print!("{}", report::to_table_with_host(&summaries, host));
    }
    if let Some(path) = &o.plot {
        let title = format!(
            "kvlb simulate: {} — {} requests, {} replicas, speedup {}",
            o.trace.rsplit('/').next().unwrap_or(&o.trace),
            summaries[0].requests,
            o.replicas,
            o.speedup
        );
        let svg = plot::render(&title, &summaries, &ttfts);
        if let Err(e) = std::fs::write(path, svg) {
            eprintln!("kvlb simulate: --plot {path:?}: cannot write: {e}");
            return 1;
        }
    }
    eprintln!(
        "kvlb simulate: done in {:.2} s wall",
        started.elapsed().as_secs_f64()
    );
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn residency_source_is_parsed_and_checked() {
        let o = parse_args(&args(&["--trace", "gen:agent-sessions"]))
            .unwrap()
            .unwrap();
        assert_eq!(o.residency, fleet::ResidencySource::Routing);
        for name in fleet::ResidencySource::NAMES {
            let o = parse_args(&args(&["--trace", "x", "--residency", name]))
                .unwrap()
                .unwrap();
            assert_eq!(o.residency.name(), *name);
        }
        let o = parse_args(&args(&[
            "--trace",
            "x",
            "--host-kv-tokens",
            "3200000",
            "--host-load-s-per-token",
            "1e-6",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (o.host_kv_tokens, o.host_load_s_per_token),
            (3_200_000, 1e-6)
        );
        for bad in [
            ["--host-kv-tokens", "8"],
            ["--host-kv-tokens", "-1"],
            ["--host-load-s-per-token", "nan"],
        ] {
            let e = parse_args(&args(&["--trace", "x", bad[0], bad[1]])).unwrap_err();
            assert!(e.contains(bad[0]) && e.contains(bad[1]), "{e}");
        }
        let e = parse_args(&args(&["--trace", "x", "--residency", "oracle"])).unwrap_err();
        assert!(
            e.contains("--residency \"oracle\": expected one of routing, events, events-pending"),
            "{e}"
        );
    }
}
