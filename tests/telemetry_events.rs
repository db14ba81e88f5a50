//! Replica telemetry end to end: `kvlb serve` subscribed to real ZeroMQ KV event publishers
//! (the simulated replica `kvlb replica`, and a pyzmq + msgspec publisher written from
//! replica-interfaces.md, tests/py/kv_publisher.py) learns where prompts are resident from the
//! replicas' own events and routes token-id prompts there; gaps, restarts and clears drop what
//! it learned; /replicas shows the replicas' scraped queue numbers.
//!
//! The Python side needs pyzmq and msgspec: $KVLB_PYTHON, else .venv/bin/python at the
//! repository root (tests/run.sh creates it), else python3.

#[path = "support/mod.rs"]
mod support;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;
use support::{wait_until, HttpConn, Kvlb};

const T: Duration = Duration::from_secs(20);

/// A child process killed and reaped on drop (also when a test panics), whose stderr or
/// stdout lines are collected by a thread.
struct ChildGuard {
    child: Child,
    lines: Receiver<String>,
    stdin: Option<ChildStdin>,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ChildGuard {
    fn spawn(mut cmd: Command, read_stderr: bool) -> ChildGuard {
        cmd.stdin(Stdio::piped());
        if read_stderr {
            cmd.stderr(Stdio::piped()).stdout(Stdio::null());
        } else {
            cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
        }
        let mut child = cmd.spawn().expect("spawn child process");
        let (tx, lines) = mpsc::channel();
        let out: Box<dyn std::io::Read + Send> = if read_stderr {
            Box::new(child.stderr.take().unwrap())
        } else {
            Box::new(child.stdout.take().unwrap())
        };
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stdin = child.stdin.take();
        ChildGuard {
            child,
            lines,
            stdin,
        }
    }

    fn next_line(&mut self) -> String {
        match self.lines.recv_timeout(T) {
            Ok(l) => l,
            Err(_) => panic!(
                "no output within {T:?} (exit status {:?})",
                self.child.try_wait().ok().flatten()
            ),
        }
    }
}

/// `kvlb replica --count n` with KV events: each replica's HTTP address and event endpoint.
struct Replicas {
    _proc: ChildGuard,
    http: Vec<SocketAddr>,
    events: Vec<String>,
}

fn start_replicas(n: usize) -> Replicas {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvlb"));
    cmd.args([
        "replica",
        "--listen",
        "127.0.0.1:0",
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--count",
        &n.to_string(),
        "--time-scale",
        "50",
    ]);
    let mut proc = ChildGuard::spawn(cmd, true);
    let (mut http, mut events) = (Vec::new(), Vec::new());
    loop {
        let line = proc.next_line();
        if line.starts_with("kvlb replica: ready") {
            break;
        }
        // kvlb replica: replica I on ADDR kv_events=tcp://ADDR
        if let Some(rest) = line.strip_prefix("kvlb replica: replica ") {
            let mut words = rest.split_whitespace();
            let _index = words.next();
            assert_eq!(words.next(), Some("on"), "{line}");
            http.push(words.next().unwrap().parse().unwrap());
            let ev = words
                .find_map(|w| w.strip_prefix("kv_events="))
                .unwrap_or_else(|| panic!("no kv_events in {line:?}"));
            events.push(ev.to_string());
        }
    }
    assert_eq!(http.len(), n);
    Replicas {
        _proc: proc,
        http,
        events,
    }
}

fn replicas_json(kvlb: &Kvlb) -> Vec<Value> {
    let r = kvlb.admin_get("/replicas");
    let v: Value = serde_json::from_str(&r.body_text()).expect("/replicas is JSON");
    v["replicas"].as_array().unwrap().clone()
}

fn token_prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n)
        .map(|i| 1000 + (i * 7 + salt * 131) % 30_000)
        .collect()
}

fn completion_body(tokens: &[u32]) -> Vec<u8> {
    json!({"model": "Qwen/Qwen3-8B", "prompt": tokens, "max_tokens": 1})
        .to_string()
        .into_bytes()
}

fn post(addr: SocketAddr, path: &str, body: &[u8]) -> support::Response {
    let mut c = HttpConn::connect(addr);
    c.request("POST", path, &[("Content-Type", "application/json")], body)
        .unwrap_or_else(|e| panic!("POST {path} to {addr}: {e}"))
}

/// Decision fields of `x-kvlb-decision` (reason, matched_tokens).
fn decision(r: &support::Response) -> (String, u64) {
    let d = r
        .header("x-kvlb-decision")
        .unwrap_or_else(|| panic!("no x-kvlb-decision: {}", r.describe()))
        .to_string();
    let field = |k: &str| {
        d.split(';')
            .map(str::trim)
            .find_map(|p| p.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .to_string()
    };
    (
        field("reason"),
        field("matched_tokens").parse().unwrap_or(0),
    )
}

#[test]
fn replica_events_steer_token_prompts_and_clears_undo_them() {
    let reps = start_replicas(2);
    let replica_arg = |i: usize| format!("http://{},kv_events={}", reps.http[i], reps.events[i]);
    let (r0, r1) = (replica_arg(0), replica_arg(1));
    let kvlb = Kvlb::serve(&[
        "--explain",
        "--workers",
        "1",
        "--metrics-interval",
        "200ms",
        "--replica",
        &r0,
        "--replica",
        &r1,
    ]);
    assert!(
        wait_until(T, || replicas_json(&kvlb)
            .iter()
            .all(|r| r["telemetry"]["events_connected"] == true)),
        "kvlb did not subscribe to both replicas: {:?}\n{}",
        replicas_json(&kvlb),
        kvlb.stderr()
    );
    // The subscription lands on the publisher a little after the connection.
    std::thread::sleep(Duration::from_millis(300));

    // Replica 1 computes the prompt (kvlb not involved) and publishes BlockStored.
    let prompt = token_prompt(4096, 1);
    let body = completion_body(&prompt);
    let direct = post(reps.http[1], "/v1/completions", &body);
    assert_eq!(direct.status, 200, "{}", direct.describe());
    assert!(
        wait_until(T, || replicas_json(&kvlb)[1]["resident_blocks"]
            .as_u64()
            .unwrap_or(0)
            >= 256),
        "kvlb did not learn replica 1's blocks: {:?}",
        replicas_json(&kvlb)
    );
    assert_eq!(replicas_json(&kvlb)[0]["resident_blocks"], 0);

    // The same prompt through kvlb goes to replica 1 for the cache.
    let via = post(kvlb.listen, "/v1/completions", &body);
    assert_eq!(via.status, 200, "{}", via.describe());
    assert_eq!(
        via.header("x-kvlb-replica"),
        Some(format!("http://{}", reps.http[1]).as_str()),
        "{}",
        via.describe()
    );
    let (reason, matched) = decision(&via);
    assert_eq!(reason, "cache", "{}", via.describe());
    assert!(matched >= 4000, "{}", via.describe());

    // The replica drops its cache (AllBlocksCleared): kvlb forgets it.
    let reset = post(reps.http[1], "/reset_prefix_cache", b"");
    assert!(reset.status < 300, "{}", reset.describe());
    assert!(
        wait_until(T, || replicas_json(&kvlb)[1]["resident_blocks"] == 0),
        "kvlb still believes replica 1 holds blocks: {:?}",
        replicas_json(&kvlb)
    );
    let again = post(kvlb.listen, "/v1/completions", &body);
    assert_eq!(again.status, 200, "{}", again.describe());
    let (reason, matched) = decision(&again);
    assert!(reason != "cache" || matched == 0, "{}", again.describe());

    // Metrics scraped from the replicas show up per replica.
    assert!(
        wait_until(T, || replicas_json(&kvlb).iter().all(|r| {
            let t = &r["telemetry"];
            t["running"].is_u64() && t["waiting"].is_u64() && t["kv_usage"].is_number()
        })),
        "no scraped numbers in /replicas: {:?}",
        replicas_json(&kvlb)
    );
    let metrics = kvlb.admin_get("/metrics").body_text();
    for name in [
        "kvlb_replica_waiting{",
        "kvlb_replica_running{",
        "kvlb_replica_kv_usage{",
        "kvlb_replica_telemetry_age_seconds{",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    let t1 = &replicas_json(&kvlb)[1]["telemetry"];
    assert!(t1["events_seen"].as_u64().unwrap() >= 2, "{t1}");
    assert_eq!(t1["stale"], false, "{t1}");
}
