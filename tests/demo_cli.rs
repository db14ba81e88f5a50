//! `kvlb demo` end to end, with two models: the real binary starts its two simulated fleets
//! (one per model) and kvlb in front of both, replays the sessions of both models through
//! it, and reports each model's time to first token; no request reaches a replica of the
//! other model. The demo's sessions speaking the Responses and Messages APIs.

use std::process::Command;

#[test]
fn the_demo_shows_two_models_on_one_kvlb() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .args(["demo", "--models", "2", "--sessions", "6", "--turns", "2"])
        .args([
            "--policies",
            "cache_aware,round_robin",
            "--time-scale",
            "50",
        ])
        .output()
        .expect("run kvlb demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Per policy, a row per model with its share of the 12 requests (sessions alternate).
    for model in ["sim-8b", "sim-70b"] {
        let rows: Vec<&str> = stdout
            .lines()
            .filter(|l| l.trim_start().starts_with(model))
            .collect();
        assert_eq!(rows.len(), 2, "{model}:\n{stdout}");
        for row in rows {
            let requests: u32 = row.split_whitespace().nth(1).unwrap().parse().unwrap();
            assert_eq!(requests, 6, "{row}");
        }
    }
    assert!(
        stdout.contains("requests answered by a replica of another model: 0"),
        "{stdout}"
    );
    assert!(stdout.contains("cache_aware vs round_robin"), "{stdout}");
    // One fleet per model, the slower one told to kvlb in a [[model]] table.
    assert!(stderr.contains("2 sim-8b, 2 sim-70b"), "{stderr}");
    let e = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .args(["demo", "--models", "2", "--replicas", "1"])
        .output()
        .unwrap();
    assert!(!e.status.success());
    assert!(
        String::from_utf8_lossy(&e.stderr).contains("more models than --replicas"),
        "{}",
        String::from_utf8_lossy(&e.stderr)
    );
}

#[test]
fn the_demo_sessions_speak_the_responses_and_messages_apis() {
    for (api, says) in [
        ("responses", "Responses API (/v1/responses)"),
        ("messages", "Messages API (/v1/messages)"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvlb"))
            .args(["demo", "--api", api, "--replicas", "2", "--sessions", "4"])
            .args(["--turns", "2", "--policies", "cache_aware,round_robin"])
            .args(["--time-scale", "50"])
            .output()
            .expect("run kvlb demo");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{api}: {stdout}\n{stderr}");
        assert!(stderr.contains(says), "{api}: {stderr}");
        // Every request of both policies answered, with its time to first text.
        for policy in ["cache_aware", "round_robin"] {
            let row = stdout
                .lines()
                .find(|l| l.starts_with(policy))
                .unwrap_or_else(|| panic!("{api}: no {policy} row:\n{stdout}"));
            let cols: Vec<&str> = row.split_whitespace().collect();
            assert_eq!(cols[1], "8", "{api}: {row}");
            let p50: f64 = cols[2].trim_end_matches('s').parse().unwrap();
            assert!(p50 > 0.0, "{api}: {row}");
        }
    }
}
