//! A mixed fleet in one `kvlb replica` process: `--speed 1,0.25` makes the second replica
//! prefill four times slower, as seen over HTTP and in the prefill seconds its /metrics
//! reports; the startup lines name the speed, and a speed list that fits neither one nor every
//! replica is a command-line error (exit 2).

#[path = "support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::fleet::{completion_body, post, token_prompt, ReplicaFleet};

/// Wall seconds replica `addr` takes to answer a fresh prompt of `tokens` (max_tokens 1).
fn answer_seconds(addr: SocketAddr, tokens: u32, salt: u32) -> f64 {
    let body = completion_body(&token_prompt(tokens, salt));
    let started = Instant::now();
    let r = post(addr, "/v1/completions", &body);
    let took = started.elapsed().as_secs_f64();
    assert_eq!(r.status, 200, "{}", r.describe());
    let usage = &r.json().expect("a JSON answer")["usage"];
    assert_eq!(usage["prompt_tokens"], tokens, "{}", r.describe());
    took
}

#[test]
fn a_replica_at_a_quarter_speed_answers_a_long_prompt_about_4x_slower() {
    // 48k tokens: about 2.5 engine seconds at speed 1, 25 ms of wall time at --time-scale 100;
    // 100 ms at speed 0.25.
    let reps = ReplicaFleet::start(2, &["--speed", "1,0.25", "--time-scale", "100"]);
    let tokens = 48_000;
    // The best of three fresh prompts each (nothing cached), against scheduling noise.
    let best = |r: usize| {
        (0..3)
            .map(|k| answer_seconds(reps.http[r], tokens, 10 * r as u32 + k))
            .fold(f64::INFINITY, f64::min)
    };
    let (fast, slow) = (best(0), best(1));
    let ratio = slow / fast;
    assert!(
        ratio > 2.0 && ratio < 8.0,
        "speed 1: {fast:.3} s, speed 0.25: {slow:.3} s, ratio {ratio:.2} (about 4 expected)"
    );
    // Its /metrics, in wall seconds (a GPU 100 times faster), engine time underneath: the
    // same three prefills of 48k computed tokens, four times the seconds.
    let reported = |r: usize| {
        let text = support::client::get(reps.http[r], "/metrics").body_text();
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        };
        let count = value("vllm:request_prefill_time_seconds_count");
        let computed = value("vllm:request_prefill_kv_computed_tokens_sum");
        assert_eq!((count, computed), (3.0, 3.0 * tokens as f64), "{text}");
        // The wait before the first step is the queue's, not the prefill's.
        assert!(
            value("vllm:request_queue_time_seconds_count") == 3.0,
            "{text}"
        );
        value("vllm:request_prefill_time_seconds_sum")
    };
    let (fast, slow) = (reported(0), reported(1));
    // At speed 1, each what kvlb's default cost model prices (the engine's own timing), over
    // the time scale.
    let model = kvlb::estimate::TtftModel::default().prefill_seconds(0, tokens, 0) / 100.0;
    assert!((fast / 3.0 / model - 1.0).abs() < 0.01, "{fast} {model}");
    assert!((slow / fast - 4.0).abs() < 0.01, "{fast} {slow}");
}

#[test]
fn startup_lines_name_the_speed_and_a_bad_list_exits_2() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .args(["replica", "--listen", "127.0.0.1:0", "--count", "2"])
        .args(["--speed", "1,0.33x0.5", "--timing-spread", "0.1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvlb replica");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut replicas = Vec::new();
    let ready = loop {
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(line) if line == "kvlb replica: ready" => break true,
            Ok(line) if line.starts_with("kvlb replica: replica ") => replicas.push(line),
            Ok(_) => {}
            Err(_) => break false,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(ready, "not ready; said {replicas:?}");
    assert_eq!(replicas.len(), 2, "{replicas:?}");
    assert!(!replicas[0].contains("speed="), "{}", replicas[0]);
    assert!(
        replicas[1].starts_with("kvlb replica: replica 1 on ")
            && replicas[1].ends_with(" speed=0.33x0.5"),
        "{}",
        replicas[1]
    );

    let out = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .args(["replica", "--listen", "127.0.0.1:0", "--count", "3"])
        .args(["--speed", "1,0.5"])
        .output()
        .expect("run kvlb replica");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--speed") && err.contains("--count 3"),
        "{err}"
    );
}
