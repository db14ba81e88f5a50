//! `kvlb replay` with a model per request. A trace line's own `model` goes on the wire as the
//! request's model (checked on a stub that records what it is sent), and `--models` gives the
//! lines naming none a model by weight, one per conversation. Through a real `kvlb serve` in
//! front of two `kvlb replica` processes serving different models (one with a LoRA adapter),
//! the summary breaks the run down per model: requests, errors (a model nobody serves),
//! TTFT and the hit rate the answers' usage reports, and each replica's own request counter
//! equals the requests of the models it serves.

#[path = "support/mod.rs"]
mod support;

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::fleet::{replicas_json, ReplicaFleet};
use support::proxy::run_kvlb_output as run;
use support::{wait_until, Kvlb, TempDir};

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A Mooncake line: `blocks` ids (512 tokens each, the last one 100), one output token.
fn line(ms: u64, ids: &[u64], model: Option<&str>) -> String {
    let tokens = (ids.len() as u64 - 1) * 512 + 100;
    let model = model
        .map(|m| format!(", \"model\": \"{m}\""))
        .unwrap_or_default();
    format!(
        "{{\"timestamp\": {ms}, \"input_length\": {tokens}, \"output_length\": 2, \"hash_ids\": {ids:?}{model}}}\n"
    )
}

/// The summary's per-model rows: name -> row.
fn models(s: &Value) -> BTreeMap<String, Value> {
    s["models"]
        .as_array()
        .unwrap_or_else(|| panic!("no models in {s}"))
        .iter()
        .map(|m| (m["model"].as_str().unwrap().to_string(), m.clone()))
        .collect()
}

fn count(m: &Value, key: &str) -> u64 {
    m[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {m}"))
}

/// A stub that answers every request with vLLM's 404 and keeps the bodies it was sent.
fn recording_stub() -> (SocketAddr, Arc<Mutex<Vec<Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let keep = bodies.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { return };
            c.set_read_timeout(Some(Duration::from_secs(5))).ok();
            let mut got = Vec::new();
            let mut buf = [0u8; 65536];
            let body = loop {
                let Ok(n) = c.read(&mut buf) else { break None };
                if n == 0 {
                    break None;
                }
                got.extend_from_slice(&buf[..n]);
                let Some(p) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                    continue;
                };
                let head = String::from_utf8_lossy(&got[..p]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if got.len() >= p + 4 + len {
                    break Some(got[p + 4..p + 4 + len].to_vec());
                }
            };
            if let Some(b) = body.and_then(|b| serde_json::from_slice(&b).ok()) {
                keep.lock().unwrap().push(b);
            }
            let msg = r#"{"error":{"message":"The model does not exist.","type":"NotFoundError","param":"model","code":404}}"#;
            let _ = write!(
                c,
                "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{msg}",
                msg.len()
            );
        }
    });
    (addr, bodies)
}

#[test]
fn a_lines_model_goes_on_the_wire_and_the_others_get_the_default() {
    let (addr, bodies) = recording_stub();
    let dir = TempDir::new("replay-models-wire");
    let trace = dir.file("t.jsonl");
    let text = [
        line(0, &[0, 1], Some("Qwen/Qwen3-8B")),
        line(10, &[0, 2], None),
        line(20, &[0, 3], Some("sql-lora")),
        line(30, &[0, 4], Some("Qwen/Qwen3-8B")),
    ]
    .concat();
    std::fs::write(&trace, text).unwrap();
    let args = strings(&[
        "replay",
        "--target",
        &format!("http://{addr}"),
        "--trace",
        trace.to_str().unwrap(),
        "--speedup",
        "10",
        "--model",
        "fallback",
        "--json",
        "-",
        "--quiet",
    ]);
    let (ok, stdout, stderr) = run(&args, Duration::from_secs(30));
    assert!(ok, "{stderr}");
    let mut sent: Vec<(String, bool)> = bodies
        .lock()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["model"].as_str().unwrap().to_string(),
                b["stream_options"]["include_usage"] == true,
            )
        })
        .collect();
    sent.sort();
    assert_eq!(
        sent,
        [
            ("Qwen/Qwen3-8B".to_string(), true),
            ("Qwen/Qwen3-8B".to_string(), true),
            ("fallback".to_string(), true),
            ("sql-lora".to_string(), true),
        ]
    );
    // Every 404 is an error of its model.
    let s: Value = serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
    let m = models(&s);
    assert_eq!(
        m.keys().collect::<Vec<_>>(),
        ["Qwen/Qwen3-8B", "fallback", "sql-lora"]
    );
    assert_eq!(
        (
            count(&m["Qwen/Qwen3-8B"], "requests"),
            count(&m["Qwen/Qwen3-8B"], "errors")
        ),
        (2, 2)
    );
    assert_eq!(count(&m["fallback"], "errors"), 1);
    assert!(m["sql-lora"]["ttft_p50_s"].is_null());
    assert!(stdout.lines().any(|l| l.contains("  model  ")), "{stdout}");
    // --models and --model do not go together.
    let (ok, _, stderr) = run(
        &strings(&[
            "replay",
            "--target",
            "http://127.0.0.1:9",
            "--trace",
            "x",
            "--model",
            "a",
            "--models",
            "b=1",
        ]),
        Duration::from_secs(10),
    );
    assert!(!ok && stderr.contains("--models"), "{stderr}");
}

/// Replicas serving `names` (and with `extra`), simulated time 20x.
fn fleet(names: &[&str], extra: &[&str]) -> ReplicaFleet {
    let mut args = vec!["--time-scale", "20"];
    args.extend_from_slice(extra);
    args.push("--served-model-name");
    args.extend_from_slice(names);
    ReplicaFleet::start(1, &args)
}

fn replica_requests(addr: SocketAddr) -> f64 {
    let r = support::HttpConn::connect(addr)
        .request("GET", "/metrics", &[], b"")
        .unwrap();
    support::proxy::metric_sum(&r.body_text(), "vllm:request_success_total", &[]).unwrap()
}

#[test]
fn models_are_assigned_per_conversation_and_reported_per_model() {
    let big = fleet(
        &["Qwen/Qwen3-8B"],
        &["--enable-lora", "--lora-modules", "sql-lora=/adapters/sql"],
    );
    let small = fleet(&["Qwen/Qwen3-0.6B"], &[]);
    let urls: Vec<String> = [big.http[0], small.http[0]]
        .iter()
        .map(|a| format!("http://{a}"))
        .collect();
    let kvlb = Kvlb::serve(&[
        "--workers",
        "1",
        "--health-interval",
        "200ms",
        "--replica",
        &urls[0],
        "--replica",
        &urls[1],
    ]);
    assert!(
        wait_until(Duration::from_secs(20), || replicas_json(&kvlb)
            .iter()
            .all(|r| r["models"].is_array())),
        "kvlb did not learn the models: {:?}",
        replicas_json(&kvlb)
    );
    // 16 conversations of 3 turns behind one system prompt (block 0), each turn extending the
    // last; then 2 lines naming a model nobody serves.
    let dir = TempDir::new("replay-models-fleet");
    let trace = dir.file("t.jsonl");
    let mut text = String::new();
    for turn in 0..3u64 {
        for conv in 0..16u64 {
            let ids: Vec<u64> = std::iter::once(0)
                .chain((0..=turn).map(|k| 1000 * (conv + 1) + k))
                .collect();
            text += &line(turn * 2000 + conv * 50, &ids, None);
        }
    }
    text += &line(7000, &[0, 99], Some("nobody"));
    text += &line(7050, &[0, 98], Some("nobody"));
    std::fs::write(&trace, text).unwrap();
    let replay = |json: &str| -> Value {
        let mut args = strings(&[
            "replay",
            "--target",
            &format!("http://{}", kvlb.listen),
            "--trace",
            trace.to_str().unwrap(),
            "--speedup",
            "10",
            "--time-scale",
            "20",
            "--models",
            "Qwen/Qwen3-8B=2,sql-lora=1,Qwen/Qwen3-0.6B=1",
            "--json",
            json,
            "--quiet",
        ]);
        for u in &urls {
            args.extend(strings(&["--replica", u]));
        }
        let (ok, stdout, stderr) = run(&args, Duration::from_secs(60));
        assert!(ok, "{stderr}\n{stdout}");
        assert!(stdout.lines().any(|l| l.contains("  model  ")), "{stdout}");
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
    };
    let big_before = replica_requests(big.http[0]);
    let small_before = replica_requests(small.http[0]);
    let first = replay(dir.file("a.json").to_str().unwrap());
    let m = models(&first);
    assert_eq!(
        m.keys().collect::<Vec<_>>(),
        ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "nobody", "sql-lora"],
        "{first}"
    );
    let n = |name: &str| count(&m[name], "requests");
    assert_eq!(
        n("Qwen/Qwen3-8B") + n("sql-lora") + n("Qwen/Qwen3-0.6B"),
        48
    );
    for name in ["Qwen/Qwen3-8B", "sql-lora", "Qwen/Qwen3-0.6B"] {
        // A conversation keeps its model: whole conversations of 3 turns.
        assert!(
            n(name) > 0 && n(name) % 3 == 0,
            "{name}: {} requests",
            n(name)
        );
        assert_eq!(count(&m[name], "errors"), 0, "{}", first["error_samples"]);
        let (p50, p99) = (
            m[name]["ttft_p50_s"].as_f64().unwrap(),
            m[name]["ttft_p99_s"].as_f64().unwrap(),
        );
        assert!(0.0 < p50 && p50 <= p99, "{name}: {p50} {p99}");
        // Later turns reuse their conversation's prefix, under its own model.
        let hit = m[name]["hit_rate"].as_f64().unwrap();
        assert!(hit > 0.2 && hit < 1.0, "{name}: hit rate {hit}");
    }
    assert_eq!(
        (n("nobody"), count(&m["nobody"], "errors")),
        (2, 2),
        "kvlb answers 404 for a model nobody serves"
    );
    assert_eq!(first["errors"], 2);
    // Each replica served exactly the requests of its models: the model was on the wire.
    assert_eq!(
        replica_requests(big.http[0]) - big_before,
        (n("Qwen/Qwen3-8B") + n("sql-lora")) as f64
    );
    assert_eq!(
        replica_requests(small.http[0]) - small_before,
        n("Qwen/Qwen3-0.6B") as f64
    );
    // The same assignment again.
    let second = replay(dir.file("b.json").to_str().unwrap());
    let again = models(&second);
    for (name, row) in &m {
        assert_eq!(
            count(row, "requests"),
            count(&again[name], "requests"),
            "{name}"
        );
    }
}
