//! KV cache events against real libzmq, both ways: kvlb's publisher and replay ROUTER read by a
//! pyzmq SUB / DEALER that decodes with msgspec Structs written from replica-interfaces.md
//! (tests/py/kv_events_spec.py), and kvlb's SUB client and `replay` reading a pyzmq PUB / ROUTER
//! that encodes the way vLLM and SGLang do.
//!
//! Needs Python with pyzmq and msgspec: $KVLB_PYTHON, else .venv/bin/python at the repository
//! root, else python3. Missing modules fail the test with the command that installs them.

use kvlb::kv_events::{
    decode_batch, replay, EventFormat, KvEvent, KvEventBatch, KvEventPublisher, Medium,
};
use kvlb::zmtp::{PubServer, SubClient};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVLB_PYTHON") {
        return p.into();
    }
    let venv = repo().join(".venv/bin/python");
    if venv.exists() {
        return venv;
    }
    "python3".into()
}

/// Fail (never skip) when the interpreter lacks pyzmq or msgspec.
fn require_python_modules() -> PathBuf {
    let py = python();
    let out = Command::new(&py)
        .args(["-c", "import zmq, msgspec"])
        .output();
    let ok = matches!(&out, Ok(o) if o.status.success());
    if !ok {
        let why = match out {
            Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
            Err(e) => e.to_string(),
        };
        panic!(
            "{} cannot import zmq and msgspec ({}). Set up the test Python first: \
             `python3 -m venv .venv && .venv/bin/pip install pyzmq msgspec` at the repository \
             root, or point KVLB_PYTHON at an interpreter that has them.",
            py.display(),
            why.trim()
        );
    }
    py
}

/// The Python side: killed and reaped when dropped, also when a test panics.
struct Script {
    child: Child,
    lines: Receiver<String>,
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Script {
    fn start(args: &[&str]) -> Script {
        let py = require_python_modules();
        let mut child = Command::new(py)
            .arg(repo().join("tests/py/kv_events_spec.py"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the Python side");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Script { child, lines }
    }

    /// The next JSON line, or a panic that says the script died or went quiet.
    fn next_json(&mut self) -> Value {
        match self.lines.recv_timeout(T) {
            Ok(line) => serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("Python printed {line:?}, not JSON: {e}")),
            Err(_) => {
                let status = self.child.try_wait().ok().flatten();
                panic!("no output from the Python side within {T:?} (exit status {status:?})")
            }
        }
    }

    fn check_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("the Python side exited early: {status}");
        }
    }
}

/// The canonical JSON shape tests/py/kv_events_spec.py prints.
fn batch_json(b: &KvEventBatch) -> Value {
    let events: Vec<Value> = b
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                ..
            } => json!({
                "type": "BlockStored",
                "block_hashes": block_hashes,
                "parent_block_hash": parent_block_hash,
                "token_ids": token_ids,
                "block_size": block_size,
                "lora_id": lora_id,
                "medium": medium.map(|m| m.as_str()),
            }),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => json!({
                "type": "BlockRemoved",
                "block_hashes": block_hashes,
                "medium": medium.map(|m| m.as_str()),
            }),
            KvEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
            KvEvent::Undecodable(e) => json!({"type": "Undecodable", "error": e.to_string()}),
        })
        .collect();
    json!({"ts": b.ts, "dp_rank": b.dp_rank, "events": events})
}

fn published_batches() -> Vec<KvEventBatch> {
    vec![
        KvEventBatch {
            ts: 1_764_000_000.125,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![8866452693264111234, 807986237951177663],
                    parent_block_hash: None,
                    token_ids: (1..=32).collect(),
                    block_size: 16,
                    lora_id: None,
                    key: Default::default(),
                    medium: Some(Medium::Gpu),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![807986237951177663],
                    medium: Some(Medium::Gpu),
                },
            ],
            dp_rank: Some(0),
        },
        KvEventBatch {
            ts: 1_764_000_001.0,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![u64::MAX, 0, 1 << 63],
                    parent_block_hash: Some(u64::MAX - 1),
                    token_ids: vec![151_643; 12],
                    block_size: 4,
                    lora_id: Some(3),
                    key: Default::default(),
                    medium: Some(Medium::CpuPinned),
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![1, 2, 3],
                    medium: None,
                },
                KvEvent::AllBlocksCleared,
            ],
            dp_rank: None,
        },
        KvEventBatch {
            ts: 1_764_000_002.5,
            events: vec![],
            dp_rank: Some(7),
        },
    ]
}

fn wait_for_subscriber(publisher: &KvEventPublisher, script: &mut Script) {
    let deadline = Instant::now() + T;
    while publisher.subscribed_peers() == 0 {
        script.check_running();
        assert!(Instant::now() < deadline, "the pyzmq SUB never subscribed");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn pyzmq_subscriber_decodes_what_kvlb_publishes() {
    for (format, name) in [
        (EventFormat::Map, "map"),
        (EventFormat::Array, "array"),
        (EventFormat::MapNil, "map-nil"),
    ] {
        let topic = "kv@pod-3@Qwen/Qwen3-8B";
        let publisher = KvEventPublisher::bind("tcp://127.0.0.1:0", None, topic, format).unwrap();
        let endpoint = format!("tcp://{}", publisher.local_addrs().0);
        let batches = published_batches();
        let count = batches.len().to_string();
        let mut script = Script::start(&["subscribe", &endpoint, name, &count, "kv@"]);
        wait_for_subscriber(&publisher, &mut script);
        for b in &batches {
            publisher.publish(b);
        }
        for (seq, b) in batches.iter().enumerate() {
            let got = script.next_json();
            assert_eq!(got["topic"], topic, "{name}");
            assert_eq!(got["seq"], seq, "{name}");
            assert_eq!(got["batch"], batch_json(b), "{name} batch {seq}");
            // vLLM 0.33's own classes read the map forms: every key they require is there.
            assert_eq!(got["vllm_error"], Value::Null, "{name} batch {seq}");
            if format == EventFormat::Array {
                assert_eq!(got["nil_keys"], json!([]), "{name}: positional, no keys");
            } else {
                // Every BlockStored writes lora_name (always nil here) and its other nil keys,
                // as vLLM 0.33 does: its fields without a default are always written.
                let stored = b
                    .events
                    .iter()
                    .filter(|e| matches!(e, KvEvent::BlockStored { .. }))
                    .count();
                let nils = got["nil_keys"].as_array().unwrap();
                let names = nils.iter().filter(|k| *k == "lora_name").count();
                assert_eq!(names, stored, "{name} batch {seq}: {nils:?}");
            }
        }
    }
}

#[test]
fn kvlb_pub_filters_pyzmq_subscriptions() {
    let server = PubServer::bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", server.local_addr());
    let mut script = Script::start(&["topics", &endpoint, "3", "kv@", "sglang"]);
    let deadline = Instant::now() + T;
    // Both prefixes must have landed before publishing, or ZeroMQ semantics drop messages.
    while server.subscriptions() < 2 {
        script.check_running();
        assert!(Instant::now() < deadline, "the pyzmq SUB never subscribed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let big = vec![0x5Au8; 3 << 20];
    server.send(&[b"other", b"x"]);
    server.send(&[b"kv", b"x"]);
    server.send(&[b"kv@pod", &0u64.to_be_bytes(), &big]);
    server.send(&[b"vllm", b"x"]);
    server.send(&[b"sglang@pod", b""]);
    server.send(&[b"kv@", b"one frame"]);
    let got: Vec<Value> = (0..3).map(|_| script.next_json()).collect();
    assert_eq!(
        got,
        vec![
            json!({"topic": "kv@pod", "sizes": [6, 8, 3 << 20]}),
            json!({"topic": "sglang@pod", "sizes": [10, 0]}),
            json!({"topic": "kv@", "sizes": [3, 9]}),
        ]
    );
}

#[test]
fn pyzmq_dealer_replays_from_kvlb() {
    let topic = "kv@pod-1@m";
    let publisher = KvEventPublisher::bind(
        "tcp://127.0.0.1:0",
        Some("tcp://127.0.0.1:0"),
        topic,
        EventFormat::Map,
    )
    .unwrap();
    let batches = published_batches();
    for b in &batches {
        publisher.publish(b);
    }
    let endpoint = format!("tcp://{}", publisher.local_addrs().1.unwrap());
    let mut script = Script::start(&["replay", &endpoint, "map", "1"]);
    for (seq, b) in batches.iter().enumerate().skip(1) {
        let got = script.next_json();
        assert_eq!(got["topic"], topic);
        assert_eq!(got["seq"], seq);
        assert_eq!(got["batch"], batch_json(b));
    }
    // The vLLM 0.33 end marker: ["", "", 0xFFFFFFFFFFFFFFFF, ""].
    assert_eq!(
        script.next_json(),
        json!({"end": ["", "", "ffffffffffffffff", ""]})
    );
}

#[test]
fn kvlb_clients_read_pyzmq_pub_and_router() {
    let mut script = Script::start(&["serve"]);
    let hello = script.next_json();
    let topic = hello["topic"].as_str().unwrap().to_string();
    let expected = hello["batches"].as_array().unwrap().clone();
    let pub_endpoint = format!("tcp://127.0.0.1:{}", hello["pub"]);
    let router_endpoint = format!("tcp://127.0.0.1:{}", hello["router"]);

    // SUB: the script publishes rounds [other, kv@.. seq 0, 1, ...]; libzmq must filter out
    // "other" by our subscription. Read from the first seq 0 on.
    let mut sub = SubClient::connect(&pub_endpoint, T).unwrap();
    sub.subscribe(b"kv@").unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + T;
    while got.len() < expected.len() {
        assert!(
            Instant::now() < deadline,
            "no full round from the pyzmq PUB"
        );
        let frames = sub.recv(T).unwrap().expect("a message from the pyzmq PUB");
        assert_eq!(frames.len(), 3);
        assert_eq!(
            frames[0],
            topic.as_bytes(),
            "libzmq let a non-matching topic through"
        );
        let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
        if seq == 0 {
            got.clear();
        }
        if seq as usize == got.len() {
            got.push(decode_batch(&frames[2]).unwrap());
        }
    }
    for (seq, b) in got.iter().enumerate() {
        assert_eq!(batch_json(b), expected[seq], "PUB batch {seq}");
    }

    // Replay, new layout first, then the old one (the script alternates per request).
    for (start, layout) in [(0u64, "new"), (2, "old"), (99, "new")] {
        let replayed = replay(&router_endpoint, start, T).unwrap();
        assert_eq!(script.next_json(), json!({"request": start}));
        let want: Vec<(u64, Value)> = expected
            .iter()
            .enumerate()
            .skip(start as usize)
            .map(|(i, b)| (i as u64, b.clone()))
            .collect();
        let have: Vec<(u64, Value)> = replayed
            .iter()
            .map(|(seq, b)| (*seq, batch_json(b)))
            .collect();
        assert_eq!(have, want, "{layout} layout from {start}");
    }
}
