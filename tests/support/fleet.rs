//! A fleet of simulated replicas (`kvlb replica --count n` with KV events) for the telemetry
//! and routing tests, killed and reaped on drop (also when a test panics), and the two
//! questions those tests ask `kvlb serve` about it: `/replicas` and `x-kvlb-decision`.

use super::{wait_until, Kvlb, Response};
use kvlb::kv_events::{EventFormat, KvEvent, KvEventBatch, KvEventPublisher};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Longest wait for the replica process to report itself ready.
const READY_WITHIN: Duration = Duration::from_secs(20);

pub struct ReplicaFleet {
    child: Child,
    /// Each replica's HTTP address, by index.
    pub http: Vec<SocketAddr>,
    /// Each replica's KV event endpoint (`tcp://ADDR`), by index.
    pub events: Vec<String>,
    /// Each replica's SGLang bootstrap server (`--role prefill --pd-protocol sglang`).
    pub bootstrap: Vec<Option<SocketAddr>>,
    /// Everything else the process printed before it was ready.
    pub notes: Vec<String>,
}

impl Drop for ReplicaFleet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ReplicaFleet {
    /// `kvlb replica --listen 127.0.0.1:0 --kv-events tcp://127.0.0.1:0 --count n` plus
    /// `extra`, once it has said it is ready.
    pub fn start(n: usize, extra: &[&str]) -> ReplicaFleet {
        let count = n.to_string();
        let mut args = vec![
            "replica",
            "--listen",
            "127.0.0.1:0",
            "--kv-events",
            "tcp://127.0.0.1:0",
            "--count",
            &count,
        ];
        if !extra.contains(&"--served-model-name") {
            // The names the tests' requests use.
            args.extend_from_slice(&["--served-model-name", "Qwen/Qwen3-8B", "m"]);
        }
        args.extend_from_slice(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvlb"))
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvlb replica");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut fleet = ReplicaFleet {
            child,
            http: Vec::new(),
            events: Vec::new(),
            bootstrap: Vec::new(),
            notes: Vec::new(),
        };
        loop {
            let line = lines.recv_timeout(READY_WITHIN).unwrap_or_else(|_| {
                panic!(
                    "kvlb replica {args:?} not ready within {READY_WITHIN:?}; it said: {:?}",
                    fleet.notes
                )
            });
            if line.starts_with("kvlb replica: ready") {
                break;
            }
            // kvlb replica: replica I on ADDR kv_events=tcp://ADDR
            match line.strip_prefix("kvlb replica: replica ") {
                Some(rest) => {
                    let mut words = rest.split_whitespace();
                    let _index = words.next();
                    assert_eq!(words.next(), Some("on"), "{line}");
                    fleet.http.push(words.next().unwrap().parse().unwrap());
                    let ev = words
                        .find_map(|w| w.strip_prefix("kv_events="))
                        .unwrap_or_else(|| panic!("no kv_events in {line:?}"));
                    fleet.events.push(ev.to_string());
                    let boot = words.find_map(|w| w.strip_prefix("bootstrap="));
                    fleet.bootstrap.push(boot.map(|a| a.parse().unwrap()));
                }
                None => fleet.notes.push(line),
            }
        }
        assert_eq!(fleet.http.len(), n);
        fleet
    }
}

/// The `replicas` array of kvlb's `/replicas`.
/// POSTs a JSON `body` to `path` on a new connection to `addr` (kvlb or a replica).
pub fn post(addr: SocketAddr, path: &str, body: &[u8]) -> Response {
    let mut c = super::HttpConn::connect(addr);
    c.request("POST", path, &[("Content-Type", "application/json")], body)
        .unwrap_or_else(|e| panic!("POST {path} to {addr}: {e}"))
}

pub fn replicas_json(kvlb: &Kvlb) -> Vec<Value> {
    let r = kvlb.admin_get("/replicas");
    let v: Value = serde_json::from_str(&r.body_text()).expect("/replicas is JSON");
    v["replicas"].as_array().unwrap().clone()
}

/// Whether `/replicas` shows at least `at_least` in replica `r`'s counter `key` (for example
/// `resident_blocks`) within `within`.
pub fn replica_count_reaches(
    kvlb: &Kvlb,
    r: usize,
    key: &str,
    at_least: u64,
    within: Duration,
) -> bool {
    wait_until(within, || {
        replicas_json(kvlb)[r][key].as_u64().unwrap_or(0) >= at_least
    })
}

/// `reason` and `matched_tokens` of a response's `x-kvlb-decision` (kvlb run with --explain).
pub fn decision(r: &Response) -> (String, u64) {
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

impl ReplicaFleet {
    /// The replica (its index) that served `r`, from `x-kvlb-replica`; `r` must be a 200.
    pub fn served_by(&self, r: &Response) -> usize {
        assert_eq!(r.status, 200, "{}", r.describe());
        let url = r
            .header("x-kvlb-replica")
            .unwrap_or_else(|| panic!("no x-kvlb-replica: {}", r.describe()));
        self.http
            .iter()
            .position(|h| url == format!("http://{h}"))
            .unwrap_or_else(|| panic!("unknown replica {url}"))
    }
}

/// `kvlb serve --explain --workers 1`, then `extra`, then `--replica SPEC` for each of
/// `replicas`.
fn serve_explained(extra: &[&str], replicas: &[String]) -> Kvlb {
    let mut args = vec!["--explain", "--workers", "1"];
    args.extend_from_slice(extra);
    for r in replicas {
        args.extend_from_slice(&["--replica", r]);
    }
    Kvlb::serve(&args)
}

/// `kvlb serve --explain --workers 1` plus `extra` in front of `reps`, each replica with its
/// own KV event stream (`--replica http://ADDR,kv_events=ENDPOINT` followed by
/// `replica_opts`, e.g. `,kv_capacity_tokens=8192`), once kvlb is subscribed to every stream.
pub fn serve_subscribed(reps: &ReplicaFleet, replica_opts: &str, extra: &[&str]) -> Kvlb {
    let replicas: Vec<String> = (0..reps.http.len())
        .map(|i| {
            format!(
                "http://{},kv_events={}{replica_opts}",
                reps.http[i], reps.events[i]
            )
        })
        .collect();
    let kvlb = serve_explained(extra, &replicas);
    wait_subscribed(&kvlb);
    kvlb
}

/// Waits until `kvlb` is connected to every replica's KV event stream (each rank's, for a
/// data-parallel replica), and a little more: the subscription lands on the publisher a
/// little after the connection.
pub fn wait_subscribed(kvlb: &Kvlb) {
    assert!(
        wait_until(READY_WITHIN, || replicas_json(kvlb)
            .iter()
            .all(|r| r["telemetry"]["events_connected"] == true)),
        "kvlb did not subscribe to every replica: {:?}\n{}",
        replicas_json(kvlb),
        kvlb.stderr()
    );
    std::thread::sleep(Duration::from_millis(300));
}

/// `kvlb serve --explain --workers 1` plus `extra` in front of `reps`, replica i subscribed to
/// its own in-process KV event publisher (the wire of replica-interfaces.md section 1) in
/// `formats[i]`, once kvlb has subscribed to every publisher.
pub fn serve_with_publishers(
    reps: &ReplicaFleet,
    formats: &[EventFormat],
    extra: &[&str],
) -> (Kvlb, Vec<KvEventPublisher>) {
    let pubs: Vec<KvEventPublisher> = formats
        .iter()
        .map(|&f| {
            KvEventPublisher::bind("tcp://127.0.0.1:0", None, "", f).expect("bind a KV publisher")
        })
        .collect();
    let replicas: Vec<String> = pubs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "http://{},kv_events=tcp://{}",
                reps.http[i],
                p.local_addrs().0
            )
        })
        .collect();
    let kvlb = serve_explained(extra, &replicas);
    assert!(
        wait_until(READY_WITHIN, || pubs
            .iter()
            .all(|p| p.subscribed_peers() > 0)),
        "kvlb did not subscribe to the publishers:\n{}",
        kvlb.stderr()
    );
    (kvlb, pubs)
}

/// One batch of KV events, as an engine publishes it.
pub fn batch(events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events,
        dp_rank: None,
    }
}

/// (GPU blocks, offloaded blocks) kvlb believes replica `r` holds.
pub fn tiers(kvlb: &Kvlb, r: usize) -> (u64, u64) {
    let all = replicas_json(kvlb);
    (
        all[r]["resident_blocks"].as_u64().unwrap_or(u64::MAX),
        all[r]["telemetry"]["offload_resident_blocks"]
            .as_u64()
            .unwrap_or(u64::MAX),
    )
}

/// `n` token ids, different for each `salt`, for token-mode prompts.
pub fn token_prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n)
        .map(|i| 1000 + (i * 7 + salt * 131) % 30_000)
        .collect()
}

/// A completions request body with `tokens` as its prompt.
pub fn completion_body(tokens: &[u32]) -> Vec<u8> {
    json!({"model": "Qwen/Qwen3-8B", "prompt": tokens, "max_tokens": 1})
        .to_string()
        .into_bytes()
}

/// Replica `r`'s telemetry from /replicas, with its `resident_blocks` beside it.
pub fn telemetry_of(kvlb: &Kvlb, r: usize) -> Value {
    let all = replicas_json(kvlb);
    let mut t = all[r]["telemetry"].clone();
    t["resident_blocks"] = all[r]["resident_blocks"].clone();
    t
}
