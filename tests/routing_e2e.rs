//! Prefix-aware routing end to end: a real `kvlb replica --count 4` fleet of simulated vLLM
//! replicas behind a real `kvlb serve --workers 2 --explain`, spoken to over loopback sockets.
//!
//! The tests assert routing facts read from the wire (`x-kvlb-replica`, `x-kvlb-decision`, the
//! replicas' own prefix-cache counters, kvlb's metrics), never timings, so they hold on a busy
//! two-core machine:
//! - multi-turn chats stay on the replica that holds their history, as cache decisions;
//! - unrelated chats spread over the fleet;
//! - a shared system prompt followed by long unique tails does not herd onto one replica;
//! - the replicas' prefix-cache hit rate beats round-robin on the same chats;
//! - a body that is not a chat prompt is still forwarded, counted as unparsed and as a fallback.

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::client::HttpConn;
use support::proxy::{kvlb_bin, metric_sum};
use support::Kvlb;

/// Every test must finish well inside this; a stuck workload fails instead of hanging.
const TEST_BUDGET: Duration = Duration::from_secs(28);

/// Simulated time runs this many times faster than a real GPU.
const TIME_SCALE: &str = "20";

/// A running `kvlb replica --count N`: one process, N simulated replicas; killed on drop.
struct ReplicaFleet {
    child: Child,
    addrs: Vec<SocketAddr>,
}

impl ReplicaFleet {
    fn start(count: usize) -> ReplicaFleet {
        let mut child = Command::new(kvlb_bin())
            .arg("replica")
            .args(["--listen", "127.0.0.1:0", "--count", &count.to_string()])
            .args(["--time-scale", TIME_SCALE])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvlb replica");
        let stderr = child.stderr.take().expect("piped stderr");
        // The guard exists before the first read, so a panic below still kills the child.
        let mut fleet = ReplicaFleet {
            child,
            addrs: Vec::new(),
        };
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                // Keep draining after ready so the child never blocks on a full pipe.
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut said = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "kvlb replica not ready within 15 s; stderr:\n{}",
                    said.join("\n")
                )
            });
            said.push(line.clone());
            if line == "kvlb replica: ready" {
                break;
            }
            if let Some(rest) = line.strip_prefix("kvlb replica: replica ") {
                // "I on 127.0.0.1:PORT"
                let addr = rest
                    .split_whitespace()
                    .nth(2)
                    .expect("address in replica line");
                fleet
                    .addrs
                    .push(addr.parse().expect("parsable replica address"));
            }
        }
        assert_eq!(fleet.addrs.len(), count, "replica lines: {said:?}");
        fleet
    }

    fn urls(&self) -> Vec<String> {
        self.addrs.iter().map(|a| format!("http://{a}")).collect()
    }

    /// Sum over the fleet of (prefix_cache_hits_total, prefix_cache_queries_total).
    fn prefix_cache_counters(&self) -> (f64, f64) {
        let mut hits = 0.0;
        let mut queries = 0.0;
        for &addr in &self.addrs {
            let text = support::client::get(addr, "/metrics").body_text();
            hits += metric_sum(&text, "vllm:prefix_cache_hits_total", &[])
                .unwrap_or_else(|| panic!("no vllm:prefix_cache_hits_total from {addr}:\n{text}"));
            queries +=
                metric_sum(&text, "vllm:prefix_cache_queries_total", &[]).unwrap_or_else(|| {
                    panic!("no vllm:prefix_cache_queries_total from {addr}:\n{text}")
                });
        }
        (hits, queries)
    }
}

impl Drop for ReplicaFleet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A replica fleet of four with `kvlb serve --workers 2 --explain EXTRA...` in front.
/// Field order drops the balancer before the replicas.
struct Routed {
    kvlb: Kvlb,
    fleet: ReplicaFleet,
}

fn routed(extra: &[&str]) -> Routed {
    let fleet = ReplicaFleet::start(4);
    let urls = fleet.urls();
    let mut args: Vec<&str> = vec!["--workers", "2", "--explain"];
    for url in &urls {
        args.push("--replica");
        args.push(url);
    }
    args.extend_from_slice(extra);
    let kvlb = Kvlb::serve(&args);
    Routed { kvlb, fleet }
}

/// What `x-kvlb-decision` said about one request.
#[derive(Debug, Clone, Default)]
struct Decision {
    reason: String,
    matched_tokens: u64,
    prompt_tokens: u64,
    raw: String,
}

fn parse_decision(raw: &str) -> Decision {
    let mut d = Decision {
        raw: raw.to_string(),
        ..Decision::default()
    };
    for part in raw.split(';') {
        let Some((k, v)) = part.trim().split_once('=') else {
            continue;
        };
        match k.trim() {
            "reason" => d.reason = v.trim().to_string(),
            "matched_tokens" => d.matched_tokens = v.trim().parse().unwrap_or(0),
            "prompt_tokens" => d.prompt_tokens = v.trim().parse().unwrap_or(0),
            _ => {}
        }
    }
    d
}

/// One routed chat completion as the client saw it.
#[derive(Debug, Clone)]
struct Routing {
    replica: String,
    decision: Decision,
    /// The assistant's answer.
    content: String,
}

/// POSTs a non-streaming chat completion through kvlb on a new connection.
fn chat(kvlb: &Kvlb, messages: &[Value]) -> Routing {
    let body = json!({
        "model": "Qwen/Qwen3-8B",
        "messages": messages,
        "max_tokens": 8,
        "stream": false,
    })
    .to_string();
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request(
            "POST",
            "/v1/chat/completions",
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        )
        .unwrap_or_else(|e| panic!("chat completion via kvlb failed: {e}"));
    assert_eq!(resp.status, 200, "chat completion: {}", resp.describe());
    let replica = resp
        .header("x-kvlb-replica")
        .unwrap_or_else(|| panic!("no x-kvlb-replica: {}", resp.describe()))
        .to_string();
    // Only policies that estimate time to first token explain themselves.
    let decision = resp
        .header("x-kvlb-decision")
        .map(parse_decision)
        .unwrap_or_default();
    let answer = resp
        .json()
        .unwrap_or_else(|| panic!("response is not JSON: {}", resp.describe()));
    let content = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no choices[0].message.content in {answer}"))
        .to_string();
    Routing {
        replica,
        decision,
        content,
    }
}

/// Deterministic prose: `bytes` or a little more of words drawn by a seeded generator, so
/// every seed gives text that differs from its first block on.
fn prose(seed: u64, bytes: usize) -> String {
    const WORDS: &[&str] = &[
        "replica", "prefix", "cache", "token", "block", "queue", "prefill", "decode", "latency",
        "router", "session", "context", "history", "budget", "schedule", "memory", "batch",
        "request", "answer", "policy", "index", "window", "layer", "tensor", "shard", "model",
        "gradient", "vector", "matrix", "kernel", "stream", "buffer", "socket", "worker",
        "balance", "estimate", "measure", "record", "detail", "summary",
    ];
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut out = String::with_capacity(bytes + 16);
    out.push_str(&format!("[{seed:016x}] "));
    while out.len() < bytes {
        let r = next();
        out.push_str(WORDS[(r % WORDS.len() as u64) as usize]);
        out.push_str(if r % 13 == 0 { ". " } else { " " });
    }
    out
}

/// The routing of every turn of every chat: `[session][turn]`.
type SessionLog = Vec<Vec<Routing>>;

/// Runs `sessions` multi-turn chats of `turns` turns on `threads` client threads. Each chat has
/// its own ~3 KB system prompt; each turn resends the history plus the assistant's answer and a
/// new user message. A thread takes its chats turn by turn, interleaved; all threads start their
/// first turns together.
fn run_sessions(
    kvlb: &Kvlb,
    sessions: usize,
    turns: usize,
    threads: usize,
    started: Instant,
) -> SessionLog {
    let log: Arc<Mutex<BTreeMap<usize, Vec<Routing>>>> = Arc::default();
    let barrier = Barrier::new(threads);
    std::thread::scope(|scope| {
        for t in 0..threads {
            let log = Arc::clone(&log);
            let barrier = &barrier;
            scope.spawn(move || {
                let mine: Vec<usize> = (t..sessions).step_by(threads).collect();
                let mut histories: Vec<Vec<Value>> = mine
                    .iter()
                    .map(|&s| {
                        vec![json!({
                            "role": "system",
                            "content": format!(
                                "You are assistant number {s}. Context follows.\n{}",
                                prose(1000 + s as u64, 3000)
                            ),
                        })]
                    })
                    .collect();
                barrier.wait();
                for turn in 0..turns {
                    for (i, &s) in mine.iter().enumerate() {
                        assert!(
                            started.elapsed() < TEST_BUDGET,
                            "workload over budget at chat {s} turn {turn}"
                        );
                        let history = &mut histories[i];
                        history.push(json!({
                            "role": "user",
                            "content": format!(
                                "Turn {turn} of chat {s}: {}",
                                prose(50_000 + (s * 100 + turn) as u64, 200)
                            ),
                        }));
                        let routing = chat(kvlb, history);
                        history.push(json!({"role": "assistant", "content": routing.content}));
                        log.lock().unwrap().entry(s).or_default().push(routing);
                    }
                }
            });
        }
    });
    let log = Arc::try_unwrap(log).unwrap().into_inner().unwrap();
    log.into_values().collect()
}

/// Requests per replica url.
fn counts<'a>(replicas: impl IntoIterator<Item = &'a str>) -> BTreeMap<String, usize> {
    let mut c = BTreeMap::new();
    for r in replicas {
        *c.entry(r.to_string()).or_insert(0) += 1;
    }
    c
}

/// max/mean of requests per replica over all `fleet_size` replicas (unused ones count as 0).
fn max_over_mean(counts: &BTreeMap<String, usize>, fleet_size: usize) -> f64 {
    let total: usize = counts.values().sum();
    let max = counts.values().copied().max().unwrap_or(0);
    max as f64 / (total as f64 / fleet_size as f64)
}

/// cache_aware with `--explain` must explain every decision.
fn assert_explained<'a>(routings: impl IntoIterator<Item = &'a Routing>) {
    for r in routings {
        assert!(
            !r.decision.raw.is_empty(),
            "a response from {} carried no x-kvlb-decision under --explain",
            r.replica
        );
    }
}

/// One line per chat: the replica port and decision of each turn.
fn show_sessions(log: &SessionLog) -> String {
    let mut out = String::new();
    for (s, turns) in log.iter().enumerate() {
        out.push_str(&format!("chat {s:2}:"));
        for r in turns {
            let port = r.replica.rsplit(':').next().unwrap_or("?");
            out.push_str(&format!(
                "  {port}/{}/{}of{}",
                r.decision.reason, r.decision.matched_tokens, r.decision.prompt_tokens
            ));
        }
        out.push('\n');
    }
    for (s, turns) in log.iter().enumerate() {
        for (t, r) in turns.iter().enumerate().skip(1) {
            if r.decision.reason != "cache" || r.replica != turns[t - 1].replica {
                out.push_str(&format!(
                    "chat {s} turn {}: {} <- {}\n",
                    t + 1,
                    r.replica,
                    r.decision.raw
                ));
            }
        }
    }
    out
}

/// Follow-up turns (turn >= 2) that went to the replica of the chat's previous turn, those
/// decided by cache with matched tokens, and the number of follow-ups.
fn stickiness(log: &SessionLog) -> (usize, usize, usize) {
    let mut same = 0;
    let mut cache = 0;
    let mut follow_ups = 0;
    for turns in log {
        for pair in turns.windows(2) {
            follow_ups += 1;
            if pair[1].replica == pair[0].replica {
                same += 1;
            }
            if pair[1].decision.reason == "cache" && pair[1].decision.matched_tokens > 0 {
                cache += 1;
            }
        }
    }
    (same, cache, follow_ups)
}

#[test]
fn multi_turn_chats_stick_to_the_replica_holding_their_history() {
    let started = Instant::now();
    let r = routed(&[]);
    let log = run_sessions(&r.kvlb, 12, 5, 4, started);
    assert_explained(log.iter().flatten());
    let (same, cache, follow_ups) = stickiness(&log);
    let shown = show_sessions(&log);
    eprintln!(
        "stickiness: {same}/{follow_ups} follow-ups on the previous turn's replica, \
         {cache}/{follow_ups} reason=cache with matched tokens ({:.1} s)\n{shown}",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(follow_ups, 12 * 4);
    assert!(
        same * 100 >= follow_ups * 80,
        "only {same}/{follow_ups} follow-up turns stayed on the previous turn's replica \
         (port/reason/matched of prompt per turn):\n{shown}"
    );
    assert!(
        cache * 2 > follow_ups,
        "only {cache}/{follow_ups} follow-up turns were cache decisions with matched tokens:\n{shown}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn distinct_chats_spread_over_the_fleet() {
    let started = Instant::now();
    let r = routed(&[]);
    // One thread per chat: the twelve first turns go out together.
    let log = run_sessions(&r.kvlb, 12, 5, 12, started);
    assert_explained(log.iter().flatten());
    let shown = show_sessions(&log);
    let first = counts(log.iter().map(|turns| turns[0].replica.as_str()));
    let all = counts(log.iter().flatten().map(|t| t.replica.as_str()));
    let ratio = max_over_mean(&all, 4);
    eprintln!(
        "first turns per replica: {first:?}\nall turns per replica: {all:?} (max/mean {ratio:.2}) \
         ({:.1} s)\n{shown}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        first.len() >= 3,
        "12 concurrent unrelated first turns landed on {} replicas {first:?}:\n{shown}",
        first.len()
    );
    assert!(
        ratio <= 2.0,
        "requests per replica {all:?}: max/mean {ratio:.2} > 2:\n{shown}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn shared_head_with_long_unique_tails_stays_balanced() {
    let started = Instant::now();
    let r = routed(&[]);
    let head = format!(
        "You are the shared assistant. Policy text follows.\n{}",
        prose(7, 4096)
    );
    let routings: Mutex<Vec<Routing>> = Mutex::default();
    let barrier = Barrier::new(8);
    std::thread::scope(|scope| {
        for t in 0..8u64 {
            let (kvlb, head, routings, barrier) = (&r.kvlb, &head, &routings, &barrier);
            scope.spawn(move || {
                barrier.wait();
                for i in 0..10u64 {
                    assert!(started.elapsed() < TEST_BUDGET, "workload over budget");
                    let tail = prose(90_000 + t * 100 + i, 4096);
                    let messages = [
                        json!({"role": "system", "content": head}),
                        json!({"role": "user", "content": tail}),
                    ];
                    let routing = chat(kvlb, &messages);
                    routings.lock().unwrap().push(routing);
                }
            });
        }
    });
    let routings = routings.into_inner().unwrap();
    assert_eq!(routings.len(), 80);
    assert_explained(&routings);
    let per_replica = counts(routings.iter().map(|r| r.replica.as_str()));
    let ratio = max_over_mean(&per_replica, 4);
    let reasons = counts(routings.iter().map(|r| r.decision.reason.as_str()));
    let matched: u64 = routings.iter().map(|r| r.decision.matched_tokens).sum();
    eprintln!(
        "shared head: per replica {per_replica:?} (max/mean {ratio:.2}), reasons {reasons:?}, \
         mean matched tokens {:.0} ({:.1} s)",
        matched as f64 / 80.0,
        started.elapsed().as_secs_f64()
    );
    let decisions: Vec<String> = routings
        .iter()
        .map(|r| {
            format!(
                "{} {}",
                r.replica.rsplit(':').next().unwrap_or("?"),
                r.decision.raw
            )
        })
        .collect();
    assert!(
        per_replica.len() >= 3,
        "80 requests with unique tails used only {} replicas {per_replica:?}:\n{}",
        per_replica.len(),
        decisions.join("\n")
    );
    assert!(
        ratio <= 1.5,
        "requests per replica {per_replica:?}: max/mean {ratio:.2} > 1.5 (herding on the shared \
         head):\n{}",
        decisions.join("\n")
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn cache_aware_beats_round_robin_on_replica_prefix_hit_rate() {
    let started = Instant::now();
    let mut rates = Vec::new();
    for policy in ["cache_aware", "round_robin"] {
        // A fresh fleet per policy: both start with empty prefix caches.
        let r = routed(&["--policy", policy]);
        let (hits0, queries0) = r.fleet.prefix_cache_counters();
        let log = run_sessions(&r.kvlb, 12, 5, 4, started);
        let (hits1, queries1) = r.fleet.prefix_cache_counters();
        let (hits, queries) = (hits1 - hits0, queries1 - queries0);
        assert!(
            queries > 0.0,
            "{policy}: replicas counted no prefix-cache queries"
        );
        let rate = hits / queries;
        let (same, _, follow_ups) = stickiness(&log);
        eprintln!(
            "{policy}: prefix-cache hit rate {rate:.3} ({hits} of {queries} tokens), \
             {same}/{follow_ups} follow-ups on the previous replica ({:.1} s)",
            started.elapsed().as_secs_f64()
        );
        rates.push((policy, rate, show_sessions(&log)));
    }
    let (_, cache_aware, ref ca_log) = rates[0];
    let (_, round_robin, ref rr_log) = rates[1];
    assert!(
        cache_aware > round_robin,
        "replica prefix-cache hit rate: cache_aware {cache_aware:.3} <= round_robin \
         {round_robin:.3}\ncache_aware:\n{ca_log}\nround_robin:\n{rr_log}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn invalid_json_is_forwarded_and_counted_as_unparsed_fallback() {
    let started = Instant::now();
    let r = routed(&[]);
    let syntax_before = r
        .kvlb
        .metric("kvlb_unparsed_prompts_total", &["reason=\"syntax\""])
        .unwrap_or(0.0);
    let fallback_before = r
        .kvlb
        .metric("kvlb_decisions_total", &["reason=\"fallback\""])
        .unwrap_or(0.0);

    let mut conn = HttpConn::connect(r.kvlb.listen);
    let resp = conn
        .request(
            "POST",
            "/v1/chat/completions",
            &[("Content-Type", "application/json")],
            br#"{"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"},]}"#,
        )
        .unwrap_or_else(|e| panic!("invalid JSON via kvlb failed: {e}"));
    eprintln!("invalid JSON answered:\n{}", resp.describe());
    assert_eq!(resp.status, 400, "{}", resp.describe());
    let replica = resp
        .header("x-kvlb-replica")
        .unwrap_or_else(|| panic!("no x-kvlb-replica, so not forwarded: {}", resp.describe()));
    assert!(
        r.fleet.urls().iter().any(|u| u == replica),
        "x-kvlb-replica {replica} is not one of {:?}",
        r.fleet.urls()
    );
    let body = resp
        .json()
        .unwrap_or_else(|| panic!("400 body is not JSON: {}", resp.describe()));
    assert_eq!(
        body["error"]["type"], "BadRequestError",
        "not the replica's OpenAI error: {body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("invalid JSON")),
        "not the replica's invalid-JSON error: {body}"
    );
    if let Some(decision) = resp.header("x-kvlb-decision") {
        assert_eq!(parse_decision(decision).reason, "fallback", "{decision}");
    }

    // Metrics are published by the workers; allow them a moment.
    let counted = support::wait_until(Duration::from_secs(5), || {
        let syntax = r
            .kvlb
            .metric("kvlb_unparsed_prompts_total", &["reason=\"syntax\""])
            .unwrap_or(0.0);
        let fallback = r
            .kvlb
            .metric("kvlb_decisions_total", &["reason=\"fallback\""])
            .unwrap_or(0.0);
        syntax >= syntax_before + 1.0 && fallback >= fallback_before + 1.0
    });
    let metrics = r.kvlb.admin_get("/metrics").body_text();
    let relevant: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("kvlb_unparsed_prompts_total") || l.starts_with("kvlb_decisions_total")
        })
        .collect();
    eprintln!(
        "before: syntax {syntax_before}, fallback {fallback_before}; after:\n{}",
        relevant.join("\n")
    );
    assert!(
        counted,
        "kvlb_unparsed_prompts_total{{reason=\"syntax\"}} and kvlb_decisions_total{{reason=\"fallback\"}} \
         did not both increment:\n{}",
        relevant.join("\n")
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}
