//! Exact decision sequences of the cost model, and seeded simulations of herding: pure code,
//! the residency writer fed synchronously from the routing log.

#![forbid(unsafe_code)]

use super::*;
use crate::http::request::Method;
use crate::residency::{ResidencyConfig, ResidencyWriter};
use crate::select::{LeastLoaded, Rng};

const BT: u32 = 64;

fn fleet(replicas: usize) -> (Arc<ResidencyIndex>, ResidencyWriter) {
    ResidencyIndex::new(ResidencyConfig {
        max_replicas: replicas,
        block_tokens: BT,
        kv_capacity_tokens: 400_000,
    })
    .unwrap()
}

fn blocks(n: u64) -> Vec<u64> {
    (1..=n).collect()
}

fn req<'a>(blocks: &'a [u64], prompt_tokens: u32, now_us: u64) -> RequestView<'a> {
    RequestView {
        method: Method::Post,
        path: b"/v1/chat/completions",
        body: b"{}",
        blocks,
        block_tokens: BT,
        prompt_tokens,
        now_us,
    }
}

/// Candidates with `tokens` queued, each sent 1000 requests (after `busy`: 100 a second, so
/// that any prefill there holds some up and weighs `prefill_weight`).
fn queued(tokens: &[u64]) -> Vec<Candidate> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, &q)| Candidate {
            replica: i,
            in_flight: (q > 0) as u32,
            queued_prefill_tokens: q,
            decoding: 0,
            routed: 1000,
            ..Default::default()
        })
        .collect()
}

/// `p` after one request (without prefix) saw `replicas` replicas sent none yet.
fn busy(mut p: CacheAware, replicas: usize) -> CacheAware {
    let c: Vec<Candidate> = (0..replicas)
        .map(|replica| Candidate {
            replica,
            ..Default::default()
        })
        .collect();
    p.select(&req(&[], 1, 0), &c, 0);
    p
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-5
}

#[test]
fn equal_queues_the_longest_match_wins() {
    let (idx, mut w) = fleet(4);
    let prompt = blocks(32); // 2048 tokens
    w.insert(1, &prompt[..8], 0).unwrap();
    w.insert(2, &prompt[..24], 0).unwrap();
    w.insert(3, &prompt[..16], 0).unwrap();
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    let c = queued(&[1000, 1000, 1000, 1000]);
    for random in 0..4 {
        assert_eq!(p.select(&req(&prompt, 2048, 0), &c, random), 2);
    }
    let d = p.last_decision();
    // wait 35.07 ms on each; r2 prefills 512 after 1536 cached (24.28 ms), r3 1024 after
    // 1024 (40.29 ms).
    assert_eq!(
        (d.replica, d.matched_tokens, d.reason),
        (2, 1536, Reason::Cache)
    );
    assert!(close(d.ttft_s, 0.059_351), "{}", d.ttft_s);
    assert!(
        close(d.runner_up_ttft_s, 0.075_366),
        "{}",
        d.runner_up_ttft_s
    );
    assert!(!d.spilled);
}

#[test]
fn a_short_match_is_ignored_and_the_least_loaded_wins() {
    let (idx, mut w) = fleet(3);
    let prompt = blocks(32);
    w.insert(0, &prompt[..3], 0).unwrap(); // 192 tokens < 256
    let c = queued(&[600, 500, 1000]);
    let mut p = CacheAware::new(idx.clone(), CacheAwareConfig::default()).unwrap();
    assert_eq!(p.select(&req(&prompt, 2048, 0), &c, 0), 1);
    let d = p.last_decision();
    assert_eq!((d.matched_tokens, d.reason), (0, Reason::Load));
    // Counted, the 192 tokens (5.9 ms) would outweigh 100 more queued tokens (3.4 ms).
    let greedy = CacheAwareConfig {
        min_match_tokens: 0,
        ..CacheAwareConfig::default()
    };
    let mut p = CacheAware::new(idx, greedy).unwrap();
    assert_eq!(p.select(&req(&prompt, 2048, 0), &c, 0), 0);
    assert_eq!(p.last_decision().matched_tokens, 192);
}

#[test]
fn a_much_deeper_warm_queue_loses_to_a_cold_idle_replica() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(32);
    w.insert(0, &prompt[..24], 0).unwrap(); // 1536 of 2048 tokens resident on r0
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    // r0 has 16k tokens queued: 574.6 ms of waiting + 24.3 ms of prefill = 598.9 ms;
    // r1 is idle and cold: 71.5 ms.
    assert_eq!(
        p.select(&req(&prompt, 2048, 0), &queued(&[16_384, 0]), 0),
        1
    );
    let d = p.last_decision();
    assert_eq!((d.matched_tokens, d.reason), (0, Reason::Load));
    assert!(close(d.ttft_s, 0.071_539), "{}", d.ttft_s);
    assert!(close(d.runner_up_ttft_s, 0.598_9), "{}", d.runner_up_ttft_s);
    // With 1000 tokens queued instead (35.1 ms), the hit still pays: 59.4 ms vs 71.5 ms.
    assert_eq!(p.select(&req(&prompt, 2048, 0), &queued(&[1000, 0]), 0), 0);
    assert!(close(p.last_decision().ttft_s, 0.059_351));
    // Decoders count too: 200 sequences decoding on r0 cost it 25.6 ms more per step.
    let mut c = queued(&[1000, 0]);
    c[0].decoding = 200;
    c[0].in_flight = 201;
    assert_eq!(p.select(&req(&prompt, 2048, 0), &c, 0), 1);
}

#[test]
fn ties_are_broken_by_random_and_no_prefix_falls_back_to_load() {
    let (idx, _w) = fleet(4);
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    let prompt = blocks(8);
    let c = queued(&[0, 0, 0, 0]);
    let picks: Vec<usize> = (0..8)
        .map(|r| p.select(&req(&prompt, 512, 0), &c, r))
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    assert_eq!(p.last_decision().reason, Reason::Load);
    // Only the two equal least loaded share: random 0 -> r1, random 1 -> r3.
    let c = queued(&[900, 100, 500, 100]);
    assert_eq!(p.select(&req(&[], 512, 0), &c, 0), 1);
    assert_eq!(p.select(&req(&[], 512, 0), &c, 1), 3);
    assert_eq!(p.last_decision().reason, Reason::Fallback);
    // Candidates may be a subset of the fleet, in any order.
    let sub = [c[2], c[0]];
    assert_eq!(p.select(&req(&prompt, 512, 0), &sub, 7), 0);
    assert_eq!(p.last_decision().replica, 2);
    assert_eq!(p.select(&req(&prompt, 512, 0), &[], 7), 0);
}

#[test]
fn bad_knobs_are_named() {
    let (idx, _w) = fleet(1);
    let cfg = CacheAwareConfig {
        hot_spill_wait_s: f64::NAN,
        ..CacheAwareConfig::default()
    };
    let err = CacheAware::new(idx, cfg).err().unwrap();
    assert!(err.contains("hot_spill_wait_s"), "{err}");
    for bad in [-0.5, f64::INFINITY, f64::NAN] {
        let (idx, _w) = fleet(1);
        let cfg = CacheAwareConfig {
            backlog_weight: bad,
            ..CacheAwareConfig::default()
        };
        let err = CacheAware::new(idx, cfg).err().unwrap();
        assert!(err.contains("backlog_weight"), "{err}");
    }
}

#[test]
fn a_backlogged_fleet_keeps_a_session_on_its_history() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(32);
    w.insert(0, &prompt[..24], 0).unwrap(); // 1536 of 2048 tokens resident on r0
    let mut p = busy(
        CacheAware::new(idx, CacheAwareConfig::default()).unwrap(),
        2,
    );
    // r0 has 4000 tokens more queued than r1 (about 140 ms), more than weight 2 puts on the
    // 47 ms its hit saves: with one request waiting on each, the cold replica wins.
    let backlog = |waiting: u32| {
        let mut c = queued(&[20_000, 16_000]);
        for c in &mut c {
            c.in_flight = waiting;
        }
        c
    };
    assert_eq!(p.select(&req(&prompt, 2048, 0), &backlog(1), 0), 1);
    assert_eq!(p.last_decision().reason, Reason::Load);
    // 20 waiting on each: the weight is 2 + 0.1 * 19 = 3.9, and the hit is worth 184 ms.
    let cfg = CacheAwareConfig::default();
    assert!(close(prefill_weight(&cfg, 20.0), 3.9));
    assert!(close(prefill_weight(&cfg, 0.5), 2.0));
    assert_eq!(p.select(&req(&prompt, 2048, 0), &backlog(20), 0), 0);
    let d = p.last_decision();
    assert_eq!((d.matched_tokens, d.reason), (1536, Reason::Cache));
    // Decoders are not waiting: 20 in flight of which 19 decode is no backlog.
    let mut c = backlog(20);
    for c in &mut c {
        c.decoding = 19;
    }
    assert_eq!(p.select(&req(&prompt, 2048, 0), &c, 0), 1);
    // backlog_weight 0 is the weight-2 policy whatever the backlog.
    let (idx, mut w) = fleet(2);
    w.insert(0, &prompt[..24], 0).unwrap();
    let flat = CacheAwareConfig {
        backlog_weight: 0.0,
        ..CacheAwareConfig::default()
    };
    let mut p = CacheAware::new(idx, flat).unwrap();
    assert_eq!(p.select(&req(&prompt, 2048, 0), &backlog(20), 0), 1);
}

// ---------------------------------------------------------------------------------------
// Simulation: replicas are FIFO prefill servers (the estimator's own timing, no decode),
// queued prefill tokens drain as their prefills finish, and every routed request is learned
// through the routing log, drained synchronously after each decision.

struct SimRequest {
    at_s: f64,
    session: usize,
    turn: usize,
    blocks: Vec<u64>,
}

#[derive(Default, Clone)]
struct SimReplica {
    pending: Vec<(f64, u64)>,
    busy_until: f64,
    routed_tokens: u64,
    computed_tokens: u64,
    routed: u64,
}

#[derive(Debug)]
#[allow(dead_code)] // every field is printed; some are only read by people
struct SimReport {
    /// max / mean of prompt tokens routed per replica
    spread: f64,
    /// max / mean of prompt tokens actually prefilled per replica
    work_spread: f64,
    /// follow-up turns sent to the replica of the session's previous turn
    returns: f64,
    hit_rate: f64,
    ttft_p50: f64,
    ttft_p99: f64,
    spills: usize,
    holders_of_first_blocks: usize,
    /// prefill busy time / (replicas x span)
    utilisation: f64,
}

#[allow(clippy::too_many_arguments)]
fn simulate(
    replicas: usize,
    requests: &[SimRequest],
    mut policy: impl FnMut(&RequestView<'_>, &[Candidate], u64) -> usize,
    log: &RoutingLog,
    idx: &ResidencyIndex,
    w: &mut ResidencyWriter,
    spilled: impl Fn() -> bool,
    hot_blocks: usize,
) -> SimReport {
    let model = TtftModel::default();
    let mut reps = vec![SimReplica::default(); replicas];
    let mut rng = Rng::new(42);
    let mut last_replica = vec![usize::MAX; requests.iter().map(|r| r.session + 1).max().unwrap()];
    let (mut follow_ups, mut returned, mut spills) = (0, 0, 0);
    let (mut prompt_sum, mut cached_sum) = (0u64, 0u64);
    let mut busy = 0.0;
    let mut ttfts = Vec::with_capacity(requests.len());
    let mut resident = vec![0u32; replicas];
    let mut cands = Vec::with_capacity(replicas);
    for r in requests {
        let now = r.at_s;
        cands.clear();
        for (i, rep) in reps.iter_mut().enumerate() {
            rep.pending.retain(|(finish, _)| *finish > now);
            cands.push(Candidate {
                replica: i,
                in_flight: rep.pending.len() as u32,
                queued_prefill_tokens: rep.pending.iter().map(|p| p.1).sum(),
                decoding: 0,
                routed: rep.routed,
                ..Default::default()
            });
        }
        let prompt = r.blocks.len() as u32 * BT;
        let view = req(&r.blocks, prompt, (now * 1e6) as u64);
        idx.match_prefix(&r.blocks, &mut resident);
        let chosen = cands[policy(&view, &cands, rng.next_u64())].replica;
        spills += spilled() as usize;
        // The replica really reuses whatever it holds, however short.
        let cached = resident[chosen] * BT;
        let rep = &mut reps[chosen];
        let start = rep.busy_until.max(now);
        let service = model.prefill_seconds(cached, prompt, 0);
        busy += service;
        rep.busy_until = start + service;
        // The data plane counts what the request will compute: its uncached tokens.
        rep.pending
            .push((rep.busy_until, (prompt - cached.min(prompt)) as u64));
        rep.routed_tokens += prompt as u64;
        rep.routed += 1;
        rep.computed_tokens += (prompt - cached.min(prompt)) as u64;
        ttfts.push(rep.busy_until - now);
        prompt_sum += prompt as u64;
        cached_sum += cached.min(prompt) as u64;
        if r.turn > 0 {
            follow_ups += 1;
            returned += (last_replica[r.session] == chosen) as usize;
        }
        last_replica[r.session] = chosen;
        // Our own policy records into `log`; the baselines are taught here the same way.
        if log.pending() == 0 {
            log.record(chosen, &r.blocks);
        }
        w.drain((now * 1e6) as u64);
    }
    let probe: Vec<u64> = requests[0].blocks[..hot_blocks].to_vec();
    idx.match_prefix(&probe, &mut resident);
    let ratio = |v: Vec<u64>| {
        let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
        *v.iter().max().unwrap() as f64 / mean
    };
    ttfts.sort_by(|a, b| a.total_cmp(b));
    SimReport {
        spread: ratio(reps.iter().map(|r| r.routed_tokens).collect()),
        work_spread: ratio(reps.iter().map(|r| r.computed_tokens).collect()),
        returns: returned as f64 / follow_ups.max(1) as f64,
        hit_rate: cached_sum as f64 / prompt_sum as f64,
        ttft_p50: ttfts[ttfts.len() / 2],
        ttft_p99: ttfts[ttfts.len() * 99 / 100],
        spills,
        holders_of_first_blocks: resident
            .iter()
            .filter(|&&m| m as usize == hot_blocks)
            .count(),
        utilisation: busy / (replicas as f64 * requests.last().unwrap().at_s),
    }
}

fn chain(prev: u64, salt: u64) -> u64 {
    let mut z = prev ^ salt.wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

/// Mooncake-like conversations: every prompt starts with the same 8-block (512-token) system
/// block, whose first hash is 0 as in the trace; each turn extends the session's previous
/// prompt by 8..48 blocks.
fn conversations(sessions: usize, span_s: f64, seed: u64) -> Vec<SimRequest> {
    let mut rng = Rng::new(seed);
    let mut unit = || (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let mut system = vec![0u64];
    for i in 1..8 {
        system.push(chain(system[i - 1], 0));
    }
    let mut out = Vec::new();
    for s in 0..sessions {
        let mut at = unit() * span_s;
        let turns = 1 + (unit() * 5.0) as usize;
        let mut blocks = system.clone();
        for t in 0..turns {
            let new = 8 + (unit() * 40.0) as usize;
            for j in 0..new {
                let prev = *blocks.last().unwrap();
                blocks.push(chain(
                    prev,
                    ((s as u64) << 32) | ((t as u64) << 16) | j as u64,
                ));
            }
            out.push(SimRequest {
                at_s: at,
                session: s,
                turn: t,
                blocks: blocks.clone(),
            });
            at += 3.0 + unit() * 12.0;
        }
    }
    out.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out
}

fn run_cache_aware(
    replicas: usize,
    requests: &[SimRequest],
    cfg: CacheAwareConfig,
    hot_blocks: usize,
) -> SimReport {
    let (idx, mut w) = fleet(replicas);
    let log = w.routing_log(4096);
    let mut p = CacheAware::new(idx.clone(), cfg)
        .unwrap()
        .with_routing_log(log.clone());
    let last = std::cell::Cell::new(false);
    let report = simulate(
        replicas,
        requests,
        |v, c, r| {
            let i = p.select(v, c, r);
            last.set(p.last_decision().spilled);
            i
        },
        &log,
        &idx,
        &mut w,
        || last.get(),
        hot_blocks,
    );
    assert_eq!(log.dropped(), 0);
    report
}

fn run_baseline(
    replicas: usize,
    requests: &[SimRequest],
    policy: &mut dyn Policy,
    hot_blocks: usize,
) -> SimReport {
    let (idx, mut w) = fleet(replicas);
    let log = w.routing_log(4096);
    simulate(
        replicas,
        requests,
        |v, c, r| policy.select(v, c, r),
        &log,
        &idx.clone(),
        &mut w,
        || false,
        hot_blocks,
    )
}

/// The longest resident prefix wins, ties to the first replica: what chasing matches does.
struct LongestMatch(Arc<ResidencyIndex>, Vec<u32>);

impl Policy for LongestMatch {
    fn name(&self) -> &'static str {
        "longest_match"
    }
    fn select(&mut self, req: &RequestView<'_>, c: &[Candidate], _: u64) -> usize {
        self.0.match_prefix(req.blocks, &mut self.1);
        (0..c.len())
            .rev()
            .max_by_key(|&i| self.1[c[i].replica])
            .unwrap()
    }
}

#[test]
fn herding_a_shared_first_block_spreads_and_sessions_come_back() {
    // 700 conversations starting over 60 s: 2106 requests. Least-loaded keeps the replicas'
    // prefill 60% busy on average, with bursts beyond capacity.
    let requests = conversations(700, 60.0, 7);
    let ours = run_cache_aware(4, &requests, CacheAwareConfig::default(), 8);
    let plain = CacheAwareConfig {
        recompute_weight: 1.0,
        ..CacheAwareConfig::default()
    };
    let greedy_ttft = run_cache_aware(4, &requests, plain, 8);
    let (idx, _) = fleet(4);
    let longest = run_baseline(4, &requests, &mut LongestMatch(idx, vec![0; 4]), 8);
    let least = run_baseline(4, &requests, &mut LeastLoaded::new(0), 8);
    println!("requests {}", requests.len());
    println!("cache_aware   {ours:?}");
    println!("weight 1      {greedy_ttft:?}");
    println!("longest_match {longest:?}");
    println!("least_loaded  {least:?}");
    assert!(ours.spread < 1.5, "{ours:?}");
    assert!(ours.returns > 0.85, "{ours:?}");
    assert_eq!(ours.holders_of_first_blocks, 4);
    assert!(
        ours.hit_rate > least.hit_rate + 0.2,
        "{ours:?} vs {least:?}"
    );
    assert!(ours.ttft_p99 < least.ttft_p99, "{ours:?} vs {least:?}");
    // The trace's property: chasing the longest match sends nearly everything to one replica.
    assert!(longest.spread > 3.0, "{longest:?}");
}

/// Agent-style traffic: every request starts with the same 128-block (8192-token) preamble
/// and adds a unique 4..16-block tail; Poisson arrivals at `rate` per second for `span_s`.
fn agents(rate: f64, span_s: f64, seed: u64) -> Vec<SimRequest> {
    let mut rng = Rng::new(seed);
    let mut unit = || ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let mut preamble = vec![chain(99, 0)];
    for i in 1..128 {
        preamble.push(chain(preamble[i - 1], 0));
    }
    let (mut at, mut out) = (0.0, Vec::new());
    while at < span_s {
        at += -unit().ln() / rate;
        let mut blocks = preamble.clone();
        let tail = 4 + (unit() * 13.0) as usize;
        for j in 0..tail {
            let prev = *blocks.last().unwrap();
            blocks.push(chain(prev, ((out.len() as u64) << 16) | j as u64));
        }
        let session = out.len();
        out.push(SimRequest {
            at_s: at,
            session,
            turn: 0,
            blocks,
        });
    }
    out
}

#[test]
fn a_hot_preamble_spreads_as_its_load_needs() {
    let no_spill = CacheAwareConfig {
        hot_spill_wait_s: f64::INFINITY,
        ..CacheAwareConfig::default()
    };
    // Light: 4 requests/s need a tenth of one replica; the preamble stays where it is.
    let light = agents(4.0, 60.0, 3);
    let ours = run_cache_aware(4, &light, CacheAwareConfig::default(), 128);
    println!("light, cache_aware {ours:?}");
    assert!(ours.holders_of_first_blocks <= 2, "{ours:?}");
    assert!(ours.hit_rate > 0.85, "{ours:?}");
    // Heavy: 80 requests/s need about 2.6 replicas even with every preamble cached.
    let heavy = agents(80.0, 30.0, 4);
    let ours = run_cache_aware(4, &heavy, CacheAwareConfig::default(), 128);
    let herd = run_cache_aware(4, &heavy, no_spill, 128);
    let least = run_baseline(4, &heavy, &mut LeastLoaded::new(0), 128);
    println!("heavy ({} requests), cache_aware {ours:?}", heavy.len());
    println!("heavy, no hot spill {herd:?}");
    println!("heavy, least_loaded {least:?}");
    assert!(ours.holders_of_first_blocks >= 3, "{ours:?}");
    assert!(ours.spread < 1.5, "{ours:?}");
    // Each holder's prefill weighs by the requests it holds up there: a holder sent many
    // loses new work to one sent few before any spill is needed.
    assert!(ours.ttft_p99 <= herd.ttft_p99, "{ours:?} vs {herd:?}");
    assert!(herd.spread < 1.5, "{herd:?}");
    // Once every replica holds the preamble there is nothing left to gain over least-loaded;
    // the estimate from queued tokens misses part of the simulated per-request fixed costs.
    assert!(
        ours.ttft_p99 < least.ttft_p99 * 1.2,
        "{ours:?} vs {least:?}"
    );
}

/// The Mooncake conversation trace (`traces/` in the checkout), each 512-token block id
/// expanded into eight 64-token blocks, arrivals compressed `speedup` times.
fn mooncake(speedup: f64) -> Vec<SimRequest> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../traces/mooncake_conversation_trace.jsonl"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(session, line)| {
            mooncake_request(line, session, speedup)
                .unwrap_or_else(|| panic!("{path}: not a Mooncake request: {line}"))
        })
        .collect()
}

fn mooncake_request(line: &str, session: usize, speedup: f64) -> Option<SimRequest> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let at_s = v["timestamp"].as_f64()? / 1000.0 / speedup;
    let mut blocks = Vec::new();
    for id in v["hash_ids"].as_array()? {
        let id = id.as_u64()?;
        for j in 0..8 {
            blocks.push(chain(id, j));
        }
    }
    Some(SimRequest {
        at_s,
        session,
        turn: 0,
        blocks,
    })
}

#[test]
#[ignore = "replays the 12k-request Mooncake trace: run with --ignored --nocapture"]
fn mooncake_conversation_trace() {
    for speedup in [1.0, 2.0] {
        let requests = mooncake(speedup);
        let ours = run_cache_aware(4, &requests, CacheAwareConfig::default(), 8);
        let least = run_baseline(4, &requests, &mut LeastLoaded::new(0), 8);
        let (idx, _) = fleet(4);
        let longest = run_baseline(4, &requests, &mut LongestMatch(idx, vec![0; 4]), 8);
        println!("mooncake x{speedup}, {} requests", requests.len());
        println!("  cache_aware   {ours:?}");
        println!("  least_loaded  {least:?}");
        println!("  longest_match {longest:?}");
        assert!(ours.spread < 1.5, "{ours:?}");
    }
}

#[test]
fn a_resident_prefix_is_relogged_once_a_second_not_per_request() {
    let (idx, mut w) = fleet(2);
    let log = w.routing_log(64);
    let mut p = CacheAware::new(idx, CacheAwareConfig::default())
        .unwrap()
        .with_routing_log(log.clone());
    let prompt = blocks(8);
    let c = queued(&[0, 0]);
    // Not resident anywhere yet: logged.
    let r = p.select(&req(&prompt, 512, 0), &c, 0);
    assert_eq!(log.recorded(), 1);
    w.drain(0);
    // Resident on r now: the first fully resident request refreshes, the next ones within a
    // second are not logged again.
    for t in 1..100u64 {
        assert_eq!(p.select(&req(&prompt, 512, t * 1000), &c, 0), r);
    }
    assert_eq!(log.recorded(), 2);
    assert_eq!(p.select(&req(&prompt, 512, 1_200_000), &c, 0), r);
    assert_eq!(log.recorded(), 3);
    // A longer prompt (new blocks) is always logged.
    let longer = blocks(12);
    p.select(&req(&longer, 768, 1_200_001), &c, 0);
    assert_eq!(log.recorded(), 4);
}

/// A reported figure scraped at 1 s (fresh for 3 s) with `waiting` and `running` requests not
/// ours and `kv_usage_milli` usage.
fn reported(waiting: u32, running: u32, kv_usage_milli: u32) -> crate::estimate::ReportedLoad {
    crate::estimate::ReportedLoad {
        foreign_waiting: waiting,
        foreign_running: running,
        kv_usage_milli,
        at_ms: 1_000,
        max_age_ms: 3_000,
        lora: Default::default(),
    }
}

#[test]
fn another_instances_requests_move_a_fresh_prompt_elsewhere() {
    let (idx, _w) = fleet(2);
    let prompt = blocks(32);
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    let m = CacheAwareConfig::default().model;
    // Replica 0 runs 6 requests another kvlb instance sent; this one sent nothing anywhere.
    let mut c = queued(&[0, 0]);
    c[0].reported = reported(0, 6, 300);
    for random in 0..8 {
        assert_eq!(p.select(&req(&prompt, 2048, 1_500_000), &c, random), 1);
    }
    let d = p.last_decision();
    assert_eq!(
        (d.replica, d.matched_tokens, d.reason),
        (1, 0, Reason::Load)
    );
    assert!(
        close(d.ttft_s, m.prefill_seconds(0, 2048, 0)),
        "{}",
        d.ttft_s
    );
    // The runner-up prefills beside 6 decoders: 71.5 ms + 9.4 ms (one step, 8 ms + 6 x 30 us +
    // 6 x 4096 x 50 ns).
    assert!(
        close(d.runner_up_ttft_s, m.prefill_seconds(0, 2048, 6)),
        "{}",
        d.runner_up_ttft_s
    );
    assert!(
        close(d.runner_up_ttft_s, 0.080_947),
        "{}",
        d.runner_up_ttft_s
    );
    // Three scrape intervals later the figure no longer counts: the replicas tie again.
    let stale = req(&prompt, 2048, 4_001_000);
    assert_eq!(p.select(&stale, &c, 0), 0);
    assert_eq!(p.select(&stale, &c, 1), 1);
    assert!(close(
        p.last_decision().runner_up_ttft_s,
        m.prefill_seconds(0, 2048, 0)
    ));
}

#[test]
fn reported_waiting_requests_queue_before_a_cache_hit() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(32); // 2048 tokens
    w.insert(0, &prompt[..24], 0).unwrap(); // 1536 resident on replica 0
    let mut p = busy(
        CacheAware::new(idx, CacheAwareConfig::default()).unwrap(),
        2,
    );
    let r = req(&prompt, 2048, 2_000_000);
    // Two foreign waiting requests (2 x 1024 tokens, 71.8 ms of queue) plus 2 x 24.3 ms of
    // prefill: 120.4 ms against 2 x 71.5 ms cold on replica 1. The hit wins.
    let mut c = queued(&[0, 0]);
    c[0].reported = reported(2, 0, 0);
    assert_eq!(p.select(&r, &c, 0), 0);
    let d = p.last_decision();
    assert_eq!((d.matched_tokens, d.reason), (1536, Reason::Cache));
    assert!(close(d.ttft_s, 0.071_830 + 0.024_279), "{}", d.ttft_s);
    // A third: 107.7 ms of queue, the cold replica is cheaper.
    c[0].reported = reported(3, 0, 0);
    assert_eq!(p.select(&r, &c, 0), 1);
    assert_eq!(p.last_decision().reason, Reason::Load);
}

#[test]
fn a_prefill_on_a_replica_nobody_sends_to_delays_nobody() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(32); // 2048 tokens
    w.insert(0, &prompt[..24], 0).unwrap(); // 1536 resident on replica 0
    let mut p = busy(
        CacheAware::new(idx, CacheAwareConfig::default()).unwrap(),
        2,
    );
    // Replica 0: 2048 tokens queued (71.8 ms) and 100 requests a second; its hit leaves
    // 24.3 ms of prefill, at weight 2: 120.4 ms. Replica 1 was sent nothing: its cold
    // 71.5 ms holds nobody up and counts once. It wins.
    let mut c = queued(&[2048, 0]);
    c[1].routed = 0;
    let r = req(&prompt, 2048, 1_000_000);
    assert_eq!(p.select(&r, &c, 0), 1);
    let d = p.last_decision();
    assert_eq!(d.reason, Reason::Load);
    assert!(close(d.ttft_s, 0.071_530), "{}", d.ttft_s);
    // Replica 1 busy too (100 a second): its cold prefill now holds requests up, weighs 2
    // (143.1 ms), and the hit wins.
    c[1].routed = 1000;
    assert_eq!(p.select(&r, &c, 0), 0);
    assert_eq!(p.last_decision().reason, Reason::Cache);
    // Between the two: 2 requests a second over the 71.5 ms it would take hold up 0.14 of
    // one, weight 1.14: 81.7 ms, still below the hit's 120.4 ms.
    let mut p = busy(
        CacheAware::new(p.index.clone(), CacheAwareConfig::default()).unwrap(),
        2,
    );
    c[1].routed = 20;
    assert_eq!(p.select(&r, &c, 0), 1);
}

#[test]
fn each_replica_is_priced_at_its_pace() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(32); // 2048 tokens
    w.insert(0, &prompt[..24], 0).unwrap(); // 1536 resident on replica 0
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    let m = TtftModel::default();
    let r = req(&prompt, 2048, 0);
    let mut c = queued(&[0, 0]);
    let pace = Pace::uniform;
    // Replica 0 prefills 3x slower: its hit leaves 3 x 24.3 = 72.8 ms, more than the 71.5 ms
    // of the cold, fast replica 1.
    c[0].pace = pace(3.0);
    assert_eq!(p.select(&r, &c, 0), 1);
    let d = p.last_decision();
    assert!(close(
        d.runner_up_ttft_s,
        3.0 * m.prefill_seconds(1536, 2048, 0)
    ));
    assert!(close(
        d.ttft_s,
        d.wait.waited_at(d.pace) + d.prefill.at(d.pace) + d.fixed_s
    ));
    // 2x slower: 48.6 ms, the hit wins; the decision carries what calibration learns from.
    c[0].pace = pace(2.0);
    assert_eq!(p.select(&r, &c, 0), 0);
    let d = p.last_decision();
    assert_eq!(d.pace, pace(2.0));
    assert!(close(d.prefill.total(), m.prefill_seconds(1536, 2048, 0)));
    assert!(close(d.ttft_s, 2.0 * d.prefill.total()));
    // Queued work is priced at the pace too: 2048 tokens queued on a 2x replica wait twice
    // the 71.8 ms.
    let c = {
        let mut c = queued(&[2048, 0]);
        c[0].pace = pace(2.0);
        c
    };
    p.select(&req(&[], 1, 0), &c, 1);
    p.select(&r, &c, 0);
    let d = p.last_decision();
    let wait = m.queue_wait(&ReplicaLoad {
        queued_prefill_tokens: 2048,
        decoding: 0,
        in_flight: 1,
    });
    assert!(close(
        if d.replica == 0 {
            d.ttft_s
        } else {
            d.runner_up_ttft_s
        },
        2.0 * (wait + m.prefill_seconds(1536, 2048, 0))
    ));
}

#[test]
fn a_nearly_full_replica_counts_less_of_its_hit() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(32);
    w.insert(0, &prompt[..24], 0).unwrap();
    let mut p = busy(
        CacheAware::new(idx, CacheAwareConfig::default()).unwrap(),
        2,
    );
    let r = req(&prompt, 2048, 2_000_000);
    // Replica 0 has 2048 tokens of our own queued (71.8 ms); replica 1 is idle and cold
    // (score 2 x 71.5 ms = 143.1 ms).
    let mut c = queued(&[2048, 0]);
    let mut pick = |usage: u32| {
        c[0].reported = reported(0, 0, usage);
        let i = p.select(&r, &c, 0);
        let d = p.last_decision();
        (i, d.matched_tokens)
    };
    // Below 90%: the whole hit (score 71.8 + 2 x 24.3 = 120.4 ms).
    assert_eq!(pick(500), (0, 1536));
    assert_eq!(pick(900), (0, 1536));
    // 92%: 90% of it (1382 tokens; 71.8 + 2 x 29.1 = 130.1 ms), still ahead.
    assert_eq!(pick(920), (0, 1382));
    // Full: half of it (768 tokens; 71.8 + 2 x 48.2 = 168.2 ms): the cold replica wins.
    assert_eq!(pick(1000), (1, 0));
    // A stale usage figure keeps the hit whole.
    c[0].reported = reported(0, 0, 1000);
    assert_eq!(p.select(&req(&prompt, 2048, 9_000_000), &c, 0), 0);
    assert_eq!(p.last_decision().matched_tokens, 1536);
}

#[test]
fn kv_knobs_are_validated() {
    let bad = CacheAwareConfig {
        kv_evict_from: 1.5,
        ..Default::default()
    };
    assert!(bad.validate().unwrap_err().contains("kv_evict_from"));
    let bad = CacheAwareConfig {
        kv_hit_keep_at_full: f64::NAN,
        ..Default::default()
    };
    assert!(bad.validate().unwrap_err().contains("kv_hit_keep_at_full"));
}

/// A GPU tier and an offloaded tier (CPU, disk) of `replicas` replicas, and a policy reading
/// both with `offload_load_cost` = `cost`.
fn tiered(replicas: usize, cost: f64) -> (CacheAware, ResidencyWriter, ResidencyWriter) {
    let (gpu, gpu_w) = fleet(replicas);
    let (offload, offload_w) = fleet(replicas);
    let cfg = CacheAwareConfig {
        offload_load_cost: cost,
        ..CacheAwareConfig::default()
    };
    let p = CacheAware::new(gpu, cfg)
        .unwrap()
        .with_offload_tier(offload);
    (p, gpu_w, offload_w)
}

#[test]
fn gpu_hit_beats_offload_hit_beats_cold() {
    let (mut p, mut gpu, mut offload) = tiered(3, 0.25);
    let prompt = blocks(32); // 2048 tokens
    gpu.insert(0, &prompt, 0).unwrap();
    offload.insert(1, &prompt, 0).unwrap();
    let idle = queued(&[0, 0, 0]);
    // Whatever the tie-break number, the GPU holder wins.
    for random in 0..3 {
        assert_eq!(p.select(&req(&prompt, 2048, 0), &idle, random), 0);
    }
    let d = p.last_decision();
    assert_eq!(
        (d.reason, d.matched_tokens, d.offloaded_blocks),
        (Reason::Cache, 2048, 0)
    );
    // Without the GPU holder, the offloaded copy beats the cold replica, at a price.
    let m = CacheAwareConfig::default().model;
    for random in 0..3 {
        assert_eq!(p.select(&req(&prompt, 2048, 0), &idle[1..], random), 0);
    }
    let d = p.last_decision();
    assert_eq!(d.replica, 1);
    assert_eq!((d.reason, d.offloaded_blocks), (Reason::Cache, 32));
    assert_eq!(
        d.matched_tokens, 1536,
        "three quarters of the hit are spared"
    );
    let gpu_hit = m.prefill_seconds(2048, 2048, 0);
    let cold = m.prefill_seconds(0, 2048, 0);
    assert!(
        close(d.ttft_s, gpu_hit + 0.25 * (cold - gpu_hit)),
        "{}",
        d.ttft_s
    );
    assert!(close(d.runner_up_ttft_s, cold), "{}", d.runner_up_ttft_s);
    // Part in GPU, the rest offloaded on replica 2: it beats replica 1 (all offloaded), and
    // only the offloaded part is priced so.
    gpu.insert(2, &prompt[..8], 0).unwrap();
    offload.insert(2, &prompt, 0).unwrap();
    assert_eq!(p.select(&req(&prompt, 2048, 0), &idle[1..], 0), 1);
    let d = p.last_decision();
    assert_eq!((d.replica, d.offloaded_blocks), (2, 24));
    assert_eq!(d.matched_tokens, 512 + 1152);
}

#[test]
fn an_offload_hit_at_full_recompute_cost_loses_to_a_cold_idle_replica() {
    let prompt = blocks(32);
    // Replica 0 holds the prompt offloaded and has 1000 tokens queued (35.1 ms); replica 1 is
    // cold and idle (71.5 ms of prefill).
    let c = queued(&[1000, 0]);
    let (mut p, _gpu, mut offload) = tiered(2, 1.0);
    offload.insert(0, &prompt, 0).unwrap();
    assert_eq!(p.select(&req(&prompt, 2048, 0), &c, 0), 1);
    let d = p.last_decision();
    assert_eq!(
        (d.reason, d.matched_tokens, d.offloaded_blocks),
        (Reason::Load, 0, 0)
    );
    // Loading it back at a quarter of the recompute pays for the queue.
    let (mut p, _gpu, mut offload) = tiered(2, 0.25);
    offload.insert(0, &prompt, 0).unwrap();
    assert_eq!(p.select(&req(&prompt, 2048, 0), &c, 0), 0);
    assert_eq!(p.last_decision().offloaded_blocks, 32);
    // Priced as free (0), the offloaded copy is a GPU hit: the same estimate.
    let (mut free, _gpu, mut offload) = tiered(2, 0.0);
    offload.insert(0, &prompt, 0).unwrap();
    let (gpu_idx, mut gpu_w) = fleet(2);
    gpu_w.insert(0, &prompt, 0).unwrap();
    let mut plain = CacheAware::new(gpu_idx, CacheAwareConfig::default()).unwrap();
    assert_eq!(free.select(&req(&prompt, 2048, 0), &c, 0), 0);
    assert_eq!(plain.select(&req(&prompt, 2048, 0), &c, 0), 0);
    assert!(close(
        free.last_decision().ttft_s,
        plain.last_decision().ttft_s
    ));
}

#[test]
fn an_empty_offloaded_tier_changes_nothing() {
    let prompt = blocks(32);
    let (mut p, mut gpu, _offload) = tiered(3, 0.25);
    let (idx, mut w) = fleet(3);
    let mut plain = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    for r in [&mut gpu, &mut w] {
        r.insert(1, &prompt[..20], 0).unwrap();
        r.insert(2, &prompt[..4], 0).unwrap();
    }
    let c = queued(&[0, 700, 0]);
    for random in 0..4 {
        let a = p.select(&req(&prompt, 2048, 0), &c, random);
        let b = plain.select(&req(&prompt, 2048, 0), &c, random);
        assert_eq!(a, b);
        assert_eq!(p.last_decision(), plain.last_decision());
    }
    assert_eq!(p.config().offload_load_cost, 0.25);
    let bad = CacheAwareConfig {
        offload_load_cost: 1.5,
        ..CacheAwareConfig::default()
    };
    let e = CacheAware::new(fleet(1).0, bad).err().unwrap();
    assert!(e.contains("offload_load_cost"), "{e}");
}

/// `set` reaches every parameter by its name, each a field of its own, and checks the result.
#[test]
fn every_parameter_is_settable_by_name() {
    use crate::select::cache_aware::PARAMETERS;
    let d = CacheAwareConfig::default();
    let mut seen = Vec::new();
    for name in PARAMETERS {
        // 1, or 0.5 for a parameter whose default is 1.
        let mut c = d;
        for v in [1.0, 0.5] {
            c.set(name, v).unwrap_or_else(|e| panic!("{name}: {e}"));
            if c != d {
                break;
            }
        }
        assert_ne!(c, d, "{name} set to 1 and to 0.5 changed nothing");
        assert!(!seen.contains(&c), "{name} sets the same field as another");
        seen.push(c);
    }
    assert_eq!(seen.len(), 25);
    let mut c = d;
    assert!(c
        .set("chunk_tokens", 2.5)
        .unwrap_err()
        .contains("whole number"));
    assert!(c
        .set("kv_evict_from", 2.0)
        .unwrap_err()
        .contains("kv_evict_from"));
    assert!(c
        .set("speed", 1.0)
        .unwrap_err()
        .contains("unknown parameter"));
}

#[test]
fn a_setup_is_paid_before_the_queue_and_the_prefill() {
    let (idx, _w) = fleet(2);
    let prompt = blocks(8);
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    // Both idle: the replica that must load an adapter first loses.
    let mut c = queued(&[0, 0]);
    c[0].setup_us = 500_000;
    for random in 0..4 {
        assert_eq!(p.select(&req(&prompt, 512, 0), &c, random), 1);
    }
    let idle = p.last_decision().ttft_s;
    // A queue longer than the load: the load is worth it, and its estimate includes it.
    let mut c = queued(&[0, 40_000]);
    c[0].setup_us = 500_000;
    assert_eq!(p.select(&req(&prompt, 512, 0), &c, 0), 0);
    assert!(close(p.last_decision().ttft_s, idle + 0.5), "{idle}");
}

#[test]
fn a_warm_replica_whose_lora_slots_are_full_loses_its_hit() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(32); // 2048 tokens, all resident on replica 0
    w.insert(0, &prompt, 0).unwrap();
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    let mut c = queued(&[0, 0]);
    // A free slot there: the hit wins.
    assert_eq!(p.select(&req(&prompt, 2048, 0), &c, 0), 0);
    assert_eq!(p.last_decision().reason, Reason::Cache);
    // Its slots held by other adapters: one request's decode (256 steps of ~8 ms) is more
    // than the 2048-token prefill the hit saves.
    c[0].lora_slot_busy = true;
    for random in 0..4 {
        assert_eq!(p.select(&req(&prompt, 2048, 0), &c, random), 1);
    }
    let d = p.last_decision();
    let wait = CacheAwareConfig::default().model.lora_slot_wait(0);
    assert!(wait > 1.0, "{wait}");
    assert!(d.runner_up_ttft_s > wait, "{d:?}");
    // Both full: the hit decides again.
    c[1].lora_slot_busy = true;
    assert_eq!(p.select(&req(&prompt, 2048, 0), &c, 0), 0);
}

/// Cold start: a burst of requests sharing a long preamble, all arriving before any has its
/// first token, on a fleet nobody has sent to yet. Each one queued on a replica makes that
/// replica's wait, and the preamble it now holds saves less than that wait: the burst
/// spreads over every replica rather than piling on the first holder.
#[test]
fn a_cold_start_burst_spreads_over_the_fleet() {
    let (idx, mut w) = fleet(4);
    let log = w.routing_log(4096);
    let mut p = CacheAware::new(idx, CacheAwareConfig::default())
        .unwrap()
        .with_routing_log(log);
    let preamble = blocks(128); // 8192 tokens
    let mut queued = [0u64; 4];
    let mut routed = [0u64; 4];
    let mut rng = Rng::new(7);
    for k in 0..8u64 {
        let mut b = preamble.clone();
        for j in 0..8 {
            b.push(chain(1000 + k, j));
        }
        let c: Vec<Candidate> = (0..4)
            .map(|r| Candidate {
                replica: r,
                in_flight: (queued[r] > 0) as u32,
                queued_prefill_tokens: queued[r],
                routed: routed[r],
                ..Default::default()
            })
            .collect();
        let view = req(&b, b.len() as u32 * BT, 1000 * k);
        let r = c[p.select(&view, &c, rng.next_u64())].replica;
        let d = p.last_decision();
        queued[r] += (b.len() as u32 * BT - d.matched_tokens) as u64;
        routed[r] += 1;
        // The writer applies the routing log at once (the live writer within a millisecond).
        w.drain(1000 * k);
    }
    assert!(routed.iter().all(|&n| n >= 1), "{routed:?}");
    assert!(routed.iter().all(|&n| n <= 3), "{routed:?}");
}

/// A request that may be disaggregated: a prefill replica's estimate carries the KV transfer,
/// a decode replica's the stall of the sequences it decodes. Idle, the decode replica computes
/// it; decoding, it is worth the transfer; a prefix resident on the prefill replica only tips
/// it there sooner.
#[test]
fn disaggregation_is_priced_against_computing_on_the_decode_replica() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(64); // 4096 tokens
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    let cands = |decoding: u32| {
        vec![
            Candidate {
                replica: 0,
                pd: PdPath::Prefill,
                ..Default::default()
            },
            Candidate {
                replica: 1,
                decoding,
                in_flight: decoding,
                pd: PdPath::Direct,
                ..Default::default()
            },
        ]
    };
    // Idle: the same prefill either way, the transfer only on the prefill path.
    assert_eq!(p.select(&req(&prompt, 4096, 1), &cands(0), 0), 1);
    let d = p.last_decision();
    let transfer = 4096.0 * CacheAwareConfig::default().kv_transfer_s_per_token;
    assert!(close(d.runner_up_ttft_s - d.ttft_s, transfer), "{d:?}");
    // Eight sequences decoding there: each would stall for the whole prefill.
    assert_eq!(p.select(&req(&prompt, 4096, 2), &cands(8), 0), 0);
    // The prefix already on the prefill replica: disaggregated with one sequence decoding.
    w.insert(0, &prompt[..60], 0).unwrap();
    assert_eq!(p.select(&req(&prompt, 4096, 3), &cands(1), 0), 0);
    assert!(p.last_decision().matched_tokens >= 3840);
}

/// The decode leg of a disaggregated request: a decode replica holding the prompt's prefix
/// receives (and adds) less, so it wins while the decode time it would spend and add there
/// is about even; sequences running there, or awaiting their KV, outweigh it.
#[test]
fn the_decode_leg_is_priced_by_what_it_receives_and_the_sequences_beside_it() {
    let (idx, mut w) = fleet(2);
    let prompt = blocks(64); // 4096 tokens
    let mut p = CacheAware::new(idx, CacheAwareConfig::default()).unwrap();
    w.insert(0, &prompt[..60], 0).unwrap();
    let cands = |in_flight: u32, decoding: u32| {
        vec![
            Candidate {
                replica: 0,
                in_flight,
                decoding,
                pd: PdPath::Decode,
                ..Default::default()
            },
            Candidate {
                replica: 1,
                pd: PdPath::Decode,
                ..Default::default()
            },
        ]
    };
    let cfg = CacheAwareConfig::default();
    // Both idle: the holder, its estimate the transfer of what it lacks and one step.
    assert_eq!(p.select(&req(&prompt, 4096, 1), &cands(0, 0), 0), 0);
    let d = p.last_decision();
    let lacks = (4096 - 60 * BT) as f64;
    let step = cfg.model.decode_step_seconds(1);
    assert!(
        close(d.ttft_s, lacks * cfg.kv_transfer_s_per_token + step),
        "{d:?}"
    );
    assert!(close(
        d.runner_up_ttft_s,
        4096.0 * cfg.kv_transfer_s_per_token + step
    ));
    // Sixteen sequences decoding on the holder: the idle one.
    assert_eq!(p.select(&req(&prompt, 4096, 2), &cands(16, 16), 0), 1);
    // Sixteen requests awaiting their KV there count as decoding already.
    assert_eq!(p.select(&req(&prompt, 4096, 3), &cands(16, 0), 0), 1);
    // Priced as whole requests, those would have counted for nothing: the holder again.
    let whole = |mut c: Vec<Candidate>| {
        c.iter_mut().for_each(|c| c.pd = PdPath::Whole);
        c
    };
    assert_eq!(p.select(&req(&prompt, 4096, 4), &whole(cands(16, 0)), 0), 0);
}
