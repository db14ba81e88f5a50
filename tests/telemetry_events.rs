//! Replica telemetry end to end: `kvlb serve` subscribed to real ZeroMQ KV event publishers
//! (the simulated replica `kvlb replica`, and a pyzmq + msgspec publisher written from
//! replica-interfaces.md, tests/py/kv_publisher.py) learns where prompts are resident from the
//! replicas' own events and routes token-id prompts there; gaps, restarts and clears drop what
//! it learned; a replica's reports do not push out the routing guesses of chat prompts (hashed
//! as text); /replicas shows the replicas' scraped queue numbers.
//!
//! The Python side needs pyzmq and msgspec: $KVLB_PYTHON, else .venv/bin/python at the
//! repository root (tests/run.sh creates it), else python3.

#[path = "support/mod.rs"]
mod support;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;
use support::fleet::{
    completion_body, decision, post, replica_count_reaches, replicas_json, serve_subscribed,
    telemetry_of, token_prompt, ReplicaFleet,
};
use support::{wait_until, Kvlb};

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

#[test]
fn replica_events_steer_token_prompts_and_clears_undo_them() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let kvlb = serve_subscribed(&reps, "", &["--metrics-interval", "200ms"]);

    // Replica 1 computes the prompt (kvlb not involved) and publishes BlockStored.
    let prompt = token_prompt(4096, 1);
    let body = completion_body(&prompt);
    let direct = post(reps.http[1], "/v1/completions", &body);
    assert_eq!(direct.status, 200, "{}", direct.describe());
    assert!(
        replica_count_reaches(&kvlb, 1, "resident_blocks", 256, T),
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

/// A replica's blocks computed under a LoRA adapter are announced under its name (lora_name,
/// as vLLM's events do): kvlb matches them for requests of that adapter only, never for the
/// base model's same tokens.
#[test]
fn replica_events_of_an_adapter_match_only_its_requests() {
    let reps = ReplicaFleet::start(
        2,
        &[
            "--time-scale",
            "50",
            "--enable-lora",
            "--lora-modules",
            "sql-lora=/adapters/sql",
        ],
    );
    let kvlb = serve_subscribed(&reps, "", &[]);
    let prompt = token_prompt(4096, 3);
    let body = |model: &str| {
        serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1})
            .to_string()
            .into_bytes()
    };
    // Replica 1 computes it under the adapter (kvlb not involved).
    let direct = post(reps.http[1], "/v1/completions", &body("sql-lora"));
    assert_eq!(direct.status, 200, "{}", direct.describe());
    assert!(
        replica_count_reaches(&kvlb, 1, "resident_blocks", 256, T),
        "kvlb did not learn replica 1's blocks: {:?}",
        replicas_json(&kvlb)
    );
    let via = post(kvlb.listen, "/v1/completions", &body("sql-lora"));
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
    // The base model's same tokens: nothing of it is resident anywhere.
    let base = post(kvlb.listen, "/v1/completions", &body("Qwen/Qwen3-8B"));
    assert_eq!(base.status, 200, "{}", base.describe());
    let (_, matched) = decision(&base);
    assert_eq!(matched, 0, "{}", base.describe());
}

/// Chat prompts are hashed as text (no tokenizer here), so the replicas' KV events (token
/// blocks) never confirm them: routing guesses are all kvlb knows of where a conversation went.
/// A replica whose events fill kvlb's view of its cache must not push those guesses out.
#[test]
fn a_replicas_reports_do_not_push_out_the_routing_guesses_of_chat_prompts() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    // kvlb is told each replica holds 8,192 tokens: 128 guessed text blocks (64 tokens each),
    // 512 reported blocks (16 tokens each). The replicas really hold 400k.
    let kvlb = serve_subscribed(&reps, ",kv_capacity_tokens=8192", &[]);

    // Turn 1 of a conversation with a 6 KB system prompt (about 23 text blocks) through kvlb.
    let system: Vec<String> = (0..1000).map(|i| format!("w{i}")).collect();
    let system = system.join(" ");
    let turn = |messages: Value| {
        json!({"model": "Qwen/Qwen3-8B", "messages": messages, "max_tokens": 1})
            .to_string()
            .into_bytes()
    };
    let first = post(
        kvlb.listen,
        "/v1/chat/completions",
        &turn(json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "hello"}
        ])),
    );
    let holder = reps.served_by(&first);

    // The holder computes 6,000 tokens of other prompts sent to it directly: its events report
    // 375 blocks, far more than kvlb's bound on guesses there.
    for salt in 0..3 {
        let direct = post(
            reps.http[holder],
            "/v1/completions",
            &completion_body(&token_prompt(2000, 10 + salt)),
        );
        assert_eq!(direct.status, 200, "{}", direct.describe());
    }
    assert!(
        replica_count_reaches(&kvlb, holder, "reported_blocks", 375, T),
        "kvlb did not keep the holder's reported blocks: {:?}",
        replicas_json(&kvlb)
    );
    // /replicas tells the two kinds apart: the conversation's text blocks are guesses.
    let held = &replicas_json(&kvlb)[holder];
    let guesses =
        held["resident_blocks"].as_u64().unwrap() - held["reported_blocks"].as_u64().unwrap();
    assert!(guesses >= 16, "{held}");
    // The event thread's map of engine hashes holds (at least) every block it reported.
    let engine_blocks = held["telemetry"]["engine_blocks"].as_u64().unwrap();
    assert!(
        engine_blocks >= held["reported_blocks"].as_u64().unwrap(),
        "{held}"
    );

    // Turn 2 through kvlb: the holder still counts the conversation's prefix as cached.
    let second = post(
        kvlb.listen,
        "/v1/chat/completions",
        &turn(json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "and then?"}
        ])),
    );
    assert_eq!(reps.served_by(&second), holder, "{}", second.describe());
    let (reason, matched) = decision(&second);
    assert_eq!(reason, "cache", "{}", second.describe());
    assert!(matched >= 1024, "{}", second.describe());
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The test interpreter; fails (never skips) without pyzmq and msgspec.
fn python() -> PathBuf {
    let py: PathBuf = match std::env::var_os("KVLB_PYTHON") {
        Some(p) => p.into(),
        None if repo().join(".venv/bin/python").exists() => repo().join(".venv/bin/python"),
        None => "python3".into(),
    };
    let ok = Command::new(&py)
        .args(["-c", "import zmq, msgspec"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "{} cannot import zmq and msgspec. Run `bash tests/run.sh` once (it creates .venv), or \
         `python3 -m venv .venv && .venv/bin/pip install pyzmq msgspec`, or point KVLB_PYTHON \
         at an interpreter that has them.",
        py.display()
    );
    py
}

/// tests/py/kv_publisher.py: a pyzmq publisher driven by JSON commands.
struct PyPublisher {
    proc: ChildGuard,
    endpoint: String,
    replay: Option<String>,
}

impl PyPublisher {
    fn start(format: &str, replay: bool) -> PyPublisher {
        PyPublisher::start_on(format, replay, 0, "")
    }

    /// On a given PUB port (0: any) with a topic frame.
    fn start_on(format: &str, replay: bool, port: u16, topic: &str) -> PyPublisher {
        let mut cmd = Command::new(python());
        cmd.arg(repo().join("tests/py/kv_publisher.py")).args([
            "--format",
            format,
            "--port",
            &port.to_string(),
            "--topic",
            topic,
        ]);
        if replay {
            cmd.arg("--replay");
        }
        let mut proc = ChildGuard::spawn(cmd, false);
        let hello: Value = serde_json::from_str(&proc.next_line()).unwrap();
        PyPublisher {
            endpoint: hello["endpoint"].as_str().unwrap().to_string(),
            replay: hello["replay"].as_str().map(String::from),
            proc,
        }
    }

    fn command(&mut self, cmd: Value) -> Value {
        let stdin = self.proc.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        let reply: Value = serde_json::from_str(&self.proc.next_line()).unwrap();
        assert_eq!(reply["ok"], true, "publisher said {reply} to {cmd}");
        reply
    }

    fn publish(&mut self, seq: u64, events: Value, send: bool) {
        self.command(json!({"op": "publish", "seq": seq, "events": events, "send": send}));
    }
}

/// BlockStored events for `tokens` in 16-token blocks with SGLang-style signed hashes
/// (`-(first_id + i)`), split in two chained events.
fn stored_events(tokens: &[u32], first_id: i64) -> Value {
    let blocks = tokens.len() / 16;
    let ids: Vec<i64> = (0..blocks as i64).map(|i| -(first_id + i)).collect();
    let half = blocks / 2;
    json!([
        {"type": "BlockStored", "block_hashes": ids[..half], "parent_block_hash": null,
         "token_ids": tokens[..half * 16], "block_size": 16, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": ids[half..], "parent_block_hash": ids[half - 1],
         "token_ids": tokens[half * 16..blocks * 16], "block_size": 16, "medium": "GPU"},
    ])
}

/// Replica 1's events come from the Python publisher (its HTTP side is a simulated replica).
fn spec_publisher_scenario(format: &str, with_replay: bool) {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let mut publisher = PyPublisher::start(format, with_replay);
    let mut r1 = format!("http://{},kv_events={}", reps.http[1], publisher.endpoint);
    if let Some(replay) = &publisher.replay {
        r1.push_str(&format!(",kv_replay={replay}"));
    }
    let r0 = format!("http://{}", reps.http[0]);
    let kvlb = Kvlb::serve(&[
        "--explain",
        "--workers",
        "1",
        "--replica",
        &r0,
        "--replica",
        &r1,
    ]);
    publisher.command(json!({"op": "wait_subscribed"}));

    // seq 0: prompt A stored on replica 1 (signed hashes, chained parent).
    let a = token_prompt(4096, 2);
    publisher.publish(0, stored_events(&a, 1), true);
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 256),
        "{format}: kvlb did not learn prompt A: {}",
        telemetry_of(&kvlb, 1)
    );
    let via = post(kvlb.listen, "/v1/completions", &completion_body(&a));
    assert_eq!(via.status, 200, "{}", via.describe());
    assert_eq!(
        via.header("x-kvlb-replica"),
        Some(r1.split(',').next().unwrap()),
        "{format}: {}",
        via.describe()
    );
    assert_eq!(decision(&via).0, "cache", "{format}: {}", via.describe());

    let b = token_prompt(256, 3);
    if with_replay {
        // seq 1 is kept but never sent; seq 2 shows the gap and replay fills it.
        publisher.publish(1, stored_events(&b, 1000), false);
        publisher.publish(2, json!([]), true);
        assert!(
            wait_until(T, || telemetry_of(&kvlb, 1)["replays"] == 1),
            "{format}: no replay: {}",
            telemetry_of(&kvlb, 1)
        );
        assert!(
            wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 256 + 16),
            "{format}: replayed blocks missing: {}",
            telemetry_of(&kvlb, 1)
        );
        assert_eq!(telemetry_of(&kvlb, 1)["stale"], false);
    } else {
        // seq 2 after 0: a gap with no replay clears replica 1 and marks it stale.
        publisher.publish(2, stored_events(&b, 1000), true);
        assert!(
            wait_until(T, || telemetry_of(&kvlb, 1)["gaps"] == 1),
            "{format}: gap not seen: {}",
            telemetry_of(&kvlb, 1)
        );
        assert_eq!(telemetry_of(&kvlb, 1)["stale"], true);
        assert!(
            wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 16),
            "{format}: only the batch after the gap should be left: {}",
            telemetry_of(&kvlb, 1)
        );
        // The next in-order batch lifts the stale mark.
        publisher.publish(3, json!([]), true);
        assert!(
            wait_until(T, || telemetry_of(&kvlb, 1)["stale"] == false),
            "{format}: still stale: {}",
            telemetry_of(&kvlb, 1)
        );
    }

    // The sequence going backwards (engine restart) drops everything known.
    let c = token_prompt(64, 4);
    publisher.publish(0, stored_events(&c, 5000), true);
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["restarts"] == 1),
        "{format}: restart not seen: {}",
        telemetry_of(&kvlb, 1)
    );
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 4),
        "{format}: residency after restart: {}",
        telemetry_of(&kvlb, 1)
    );
    let again = post(kvlb.listen, "/v1/completions", &completion_body(&a));
    assert_eq!(again.status, 200, "{}", again.describe());
    let (reason, matched) = decision(&again);
    assert!(
        reason != "cache" || matched == 0,
        "{format}: {}",
        again.describe()
    );
}

#[test]
fn spec_publisher_map_encoding_gap_without_replay() {
    spec_publisher_scenario("map", false);
}

#[test]
fn spec_publisher_array_encoding_gap_with_replay() {
    spec_publisher_scenario("array", true);
}

/// The publisher goes away and an engine comes back on the same endpoint numbering from 0
/// again: kvlb reconnects on its own and drops what the old engine had stored.
#[test]
fn reconnects_after_publisher_restart_and_forgets_the_old_engine() {
    let reps = ReplicaFleet::start(1, &["--time-scale", "50"]);
    let mut publisher = PyPublisher::start_on("map", false, 0, "kv@pod-0@Qwen/Qwen3-8B");
    let port: u16 = publisher
        .endpoint
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let r0 = format!("http://{},kv_events={}", reps.http[0], publisher.endpoint);
    let kvlb = Kvlb::serve(&["--explain", "--workers", "1", "--replica", &r0]);
    publisher.command(json!({"op": "wait_subscribed"}));
    let a = token_prompt(512, 5);
    publisher.publish(0, stored_events(&a, 1), true);
    publisher.publish(1, json!([]), true);
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 0)["resident_blocks"] == 32),
        "{}",
        telemetry_of(&kvlb, 0)
    );
    drop(publisher);
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 0)["events_connected"] == false),
        "kvlb did not notice the publisher left: {}",
        telemetry_of(&kvlb, 0)
    );
    let mut restarted = PyPublisher::start_on("map", false, port, "kv@pod-0@Qwen/Qwen3-8B");
    restarted.command(json!({"op": "wait_subscribed"}));
    let b = token_prompt(64, 6);
    restarted.publish(0, stored_events(&b, 1), true);
    assert!(
        wait_until(T, || {
            let t = telemetry_of(&kvlb, 0);
            t["restarts"] == 1 && t["resident_blocks"] == 4
        }),
        "kvlb kept the old engine's blocks: {}",
        telemetry_of(&kvlb, 0)
    );
    assert_eq!(telemetry_of(&kvlb, 0)["connects"], 2);
}

/// The lines of kvlb's stderr that contain every one of `parts`.
fn log_lines_with(kvlb: &Kvlb, parts: &[&str]) -> Vec<String> {
    kvlb.stderr()
        .lines()
        .filter(|l| parts.iter().all(|p| l.contains(p)))
        .map(String::from)
        .collect()
}

/// What a replica's event stream does wrong is logged (naming the replica and the reason) and
/// counted on /metrics; an event kvlb cannot read costs only that event, not its batch.
#[test]
fn unreadable_payloads_and_events_are_logged_counted_and_cost_only_themselves() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let mut publisher = PyPublisher::start("map", false);
    let url = format!("http://{}", reps.http[1]);
    let r1 = format!("{url},kv_events={}", publisher.endpoint);
    let r0 = format!("http://{}", reps.http[0]);
    let kvlb = Kvlb::serve(&[
        "--explain",
        "--workers",
        "1",
        "--replica",
        &r0,
        "--replica",
        &r1,
    ]);
    publisher.command(json!({"op": "wait_subscribed"}));
    let labels = format!("replica=\"{url}\"");
    let metric = |name: &str, extra: &[&str]| {
        let mut parts = vec![labels.as_str()];
        parts.extend_from_slice(extra);
        kvlb.metric(name, &parts)
    };

    // seq 0: bytes that are no msgpack batch at all.
    publisher.command(json!({"op": "publish_raw", "seq": 0, "payload_hex": "c1c1c1"}));
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["decode_errors"] == 1),
        "{}",
        telemetry_of(&kvlb, 1)
    );
    assert!(
        wait_until(T, || !log_lines_with(&kvlb, &[&url, "batch 0", "0xc1"])
            .is_empty()),
        "no log line for the unreadable payload:\n{}",
        kvlb.stderr()
    );
    assert_eq!(
        metric("kvlb_replica_kv_event_decode_errors_total", &[]),
        Some(1.0)
    );

    // seq 1: a BlockStored with a negative token id, then a good one.
    let good = token_prompt(16, 7);
    publisher.publish(
        1,
        json!([
            {"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": null,
             "token_ids": [-5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
             "block_size": 16, "medium": "GPU"},
            {"type": "BlockStored", "block_hashes": [-2], "parent_block_hash": null,
             "token_ids": good, "block_size": 16, "medium": "GPU"},
        ]),
        true,
    );
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 1),
        "the good store was not applied: {}",
        telemetry_of(&kvlb, 1)
    );
    let t = telemetry_of(&kvlb, 1);
    assert_eq!(t["skipped_undecodable"], 1, "{t}");
    assert_eq!(t["decode_errors"], 1, "{t}");
    assert!(
        wait_until(T, || !log_lines_with(
            &kvlb,
            &[
                &url,
                "batch 1",
                "event 0",
                "token_ids: expected an unsigned int"
            ]
        )
        .is_empty()),
        "no log line for the skipped event:\n{}",
        kvlb.stderr()
    );
    assert_eq!(
        metric(
            "kvlb_replica_kv_event_skipped_total",
            &["reason=\"undecodable\""]
        ),
        Some(1.0)
    );

    // seq 3 after 1, no replay endpoint: the gap, and that nothing filled it, are logged.
    publisher.publish(3, json!([]), true);
    assert!(
        wait_until(T, || !log_lines_with(
            &kvlb,
            &[&url, "batch 2 missing", "no replay"]
        )
        .is_empty()),
        "no log line for the gap:\n{}",
        kvlb.stderr()
    );
    assert_eq!(metric("kvlb_replica_kv_event_gaps_total", &[]), Some(1.0));
    // seq 0 again: the engine restarted.
    publisher.publish(0, json!([]), true);
    assert!(
        wait_until(T, || !log_lines_with(
            &kvlb,
            &[&url, "from 3 back to 0", "restart"]
        )
        .is_empty()),
        "no log line for the restart:\n{}",
        kvlb.stderr()
    );
    assert_eq!(
        metric("kvlb_replica_kv_event_restarts_total", &[]),
        Some(1.0)
    );
}

/// SGLang with EAGLE speculative decoding publishes each page's token ids as bigram pairs
/// `[t_j, t_{j+1}]`: kvlb reads them as the raw tokens, so a token prompt matches them.
#[test]
fn sglang_eagle_bigram_stores_match_token_prompts() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let mut publisher = PyPublisher::start("map", false);
    let url = format!("http://{}", reps.http[1]);
    let r1 = format!("{url},kv_events={}", publisher.endpoint);
    let r0 = format!("http://{}", reps.http[0]);
    let kvlb = Kvlb::serve(&[
        "--explain",
        "--workers",
        "1",
        "--replica",
        &r0,
        "--replica",
        &r1,
    ]);
    publisher.command(json!({"op": "wait_subscribed"}));
    // One BlockStored per 16-token page, chained, as SGLang's record_store writes them.
    let prompt = token_prompt(1024, 8);
    let events: Vec<Value> = (0..prompt.len() / 16)
        .map(|p| {
            let pairs: Vec<[u32; 2]> = (p * 16..p * 16 + 16)
                .map(|j| [prompt[j], prompt.get(j + 1).copied().unwrap_or(0)])
                .collect();
            json!({"type": "BlockStored", "block_hashes": [-(p as i64) - 1],
                   "parent_block_hash": if p == 0 { Value::Null } else { json!(-(p as i64)) },
                   "token_ids": pairs, "block_size": 16, "medium": "GPU"})
        })
        .collect();
    publisher.publish(0, Value::Array(events), true);
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 64),
        "kvlb did not learn the bigram pages: {}",
        telemetry_of(&kvlb, 1)
    );
    let via = post(kvlb.listen, "/v1/completions", &completion_body(&prompt));
    assert_eq!(via.status, 200, "{}", via.describe());
    assert_eq!(via.header("x-kvlb-replica"), Some(url.as_str()));
    let (reason, matched) = decision(&via);
    assert_eq!(reason, "cache", "{}", via.describe());
    assert!(matched >= 1000, "{}", via.describe());
}

/// A batch missed in a gap and fetched by replay is read like a live one: its unreadable event
/// is skipped and counted, its other events fill the gap.
#[test]
fn a_replayed_batch_with_an_unreadable_event_still_fills_the_gap() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let mut publisher = PyPublisher::start("map", true);
    let url = format!("http://{}", reps.http[1]);
    let r1 = format!(
        "{url},kv_events={},kv_replay={}",
        publisher.endpoint,
        publisher.replay.as_deref().unwrap()
    );
    let r0 = format!("http://{}", reps.http[0]);
    let kvlb = Kvlb::serve(&["--workers", "1", "--replica", &r0, "--replica", &r1]);
    publisher.command(json!({"op": "wait_subscribed"}));
    publisher.publish(0, json!([]), true);
    // seq 1 is kept but never sent: a store with a negative token id, then a good one.
    publisher.publish(
        1,
        json!([
            {"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": null,
             "token_ids": vec![-5; 16], "block_size": 16, "medium": "GPU"},
            {"type": "BlockStored", "block_hashes": [-2], "parent_block_hash": null,
             "token_ids": token_prompt(16, 9), "block_size": 16, "medium": "GPU"},
        ]),
        false,
    );
    publisher.publish(2, json!([]), true);
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["replays"] == 1),
        "the gap was not filled: {}",
        telemetry_of(&kvlb, 1)
    );
    // The residency writer applies what the event thread sends it a moment later.
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 1),
        "the replayed store is not resident: {}",
        telemetry_of(&kvlb, 1)
    );
    let t = telemetry_of(&kvlb, 1);
    assert_eq!(t["skipped_undecodable"], 1, "{t}");
    assert_eq!(t["replay_failures"], 0, "{t}");
    assert_eq!(t["stale"], false, "{t}");
    assert!(
        wait_until(T, || !log_lines_with(
            &kvlb,
            &[&url, "batch 1 missing", "replay filled"]
        )
        .is_empty()),
        "no log line for the filled gap:\n{}",
        kvlb.stderr()
    );
}

/// SGLang's default page of one token, and vLLM's reuse reports (`kv_cache_report_mode =
/// "full"`), from a real ZeroMQ publisher: one-token pages across two events make kvlb blocks
/// a token-mode request matches; a page removed inside a block drops that block; a reuse
/// report adds no copy, so one eviction empties the replica.
#[test]
fn one_token_pages_and_reuse_reports_from_a_publisher() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let mut publisher = PyPublisher::start("map", false);
    let r1 = format!("http://{},kv_events={}", reps.http[1], publisher.endpoint);
    let r0 = format!("http://{}", reps.http[0]);
    let kvlb = Kvlb::serve(&[
        "--explain",
        "--workers",
        "1",
        "--replica",
        &r0,
        "--replica",
        &r1,
    ]);
    publisher.command(json!({"op": "wait_subscribed"}));
    // 1000 + 3096 tokens, the cut inside a kvlb block; signed hashes as SGLang's.
    let a = token_prompt(4096, 7);
    let ids: Vec<i64> = (0..4096).map(|i| -(1 + i)).collect();
    publisher.publish(
        0,
        json!([
            {"type": "BlockStored", "block_hashes": ids[..1000], "parent_block_hash": null,
             "token_ids": a[..1000], "block_size": 1, "medium": "GPU"},
            {"type": "BlockStored", "block_hashes": ids[1000..], "parent_block_hash": ids[999],
             "token_ids": a[1000..], "block_size": 1, "medium": "GPU"},
        ]),
        true,
    );
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 256),
        "kvlb did not learn the one-token pages: {}",
        telemetry_of(&kvlb, 1)
    );
    assert_eq!(telemetry_of(&kvlb, 1)["engine_block_size"], 1);
    assert_eq!(telemetry_of(&kvlb, 1)["skipped_block_size"], 0);
    let via = post(kvlb.listen, "/v1/completions", &completion_body(&a));
    assert_eq!(via.status, 200, "{}", via.describe());
    assert_eq!(decision(&via).0, "cache", "{}", via.describe());
    // The page of token 2000 (inside kvlb block 125) evicted: that block goes.
    publisher.publish(
        1,
        json!([{"type": "BlockRemoved", "block_hashes": [ids[2000]], "medium": "GPU"}]),
        true,
    );
    assert!(
        wait_until(T, || telemetry_of(&kvlb, 1)["resident_blocks"] == 255),
        "{}",
        telemetry_of(&kvlb, 1)
    );

    // vLLM: a 4-block prompt stored, a reuse report of its first 3 blocks, then eviction.
    let b = token_prompt(64, 8);
    let vids: Vec<i64> = (0..4).map(|i| 100_000 + i).collect();
    publisher.publish(
        2,
        json!([
            {"type": "AllBlocksCleared"},
            {"type": "BlockStored", "block_hashes": vids, "parent_block_hash": null,
             "token_ids": b, "block_size": 16, "medium": "GPU"},
            {"type": "BlockStored", "block_hashes": vids[..3], "parent_block_hash": null,
             "token_ids": b[..48], "block_size": 16, "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": vids, "medium": "GPU"},
        ]),
        true,
    );
    assert!(
        wait_until(T, || {
            let t = telemetry_of(&kvlb, 1);
            t["reuse_reports"] == 1 && t["resident_blocks"] == 0
        }),
        "a reuse report left blocks behind: {}",
        telemetry_of(&kvlb, 1)
    );
}

/// An engine given a concrete host in its event endpoint connects instead of binding, so kvlb's
/// connection to that endpoint is refused for good while the engine's HTTP side answers: kvlb
/// says so in one log line that names the fix, and counts the failed attempts.
#[test]
fn a_refused_event_endpoint_of_a_live_replica_is_explained() {
    let reps = ReplicaFleet::start(1, &["--time-scale", "50"]);
    // A port nothing listens on: bound, then closed.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let url = format!("http://{}", reps.http[0]);
    let spec = format!("{url},kv_events=tcp://{closed}");
    let kvlb = Kvlb::serve(&["--metrics-interval", "200ms", "--replica", &spec]);
    let hint = || log_lines_with(&kvlb, &[&url, "nothing listens", "tcp://*:PORT"]);
    assert!(
        wait_until(Duration::from_secs(30), || !hint().is_empty()),
        "no bind-or-connect hint in the log:\n{}",
        kvlb.stderr()
    );
    assert_eq!(hint().len(), 1, "the hint is given once: {:?}", hint());
    let t = telemetry_of(&kvlb, 0);
    assert!(t["connect_failures"].as_u64().unwrap() >= 2, "{t}");
    let labels = format!("replica=\"{url}\"");
    let failures = kvlb
        .metric("kvlb_replica_kv_event_connect_failures_total", &[&labels])
        .unwrap_or(0.0);
    assert!(failures >= 2.0, "connect failures on /metrics: {failures}");
}
