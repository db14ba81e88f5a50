//! Telemetry runs on a fixed number of threads whatever the fleet's size: `kvlb serve` in
//! front of 4 replicas and in front of 256 (`kvlb replica --count 256`, each publishing KV
//! events and serving /metrics) runs as many threads once it is subscribed to every replica's
//! events and has scraped every replica's /metrics; and the 256th replica's events do reach it.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;
use support::fleet::{completion_body, post, replicas_json, token_prompt, ReplicaFleet};
use support::{wait_until, Kvlb};

const T: Duration = Duration::from_secs(60);

/// `kvlb serve --workers 1` in front of the first `n` replicas of `reps`, each with its
/// events, scraped every 200 ms.
fn serve(reps: &ReplicaFleet, n: usize) -> Kvlb {
    let replicas: Vec<String> = (0..n)
        .map(|i| format!("http://{},kv_events={}", reps.http[i], reps.events[i]))
        .collect();
    let mut args = vec![
        "--workers",
        "1",
        "--metrics-interval",
        "200ms",
        "--max-replicas",
        "256",
    ];
    for r in &replicas {
        args.extend_from_slice(&["--replica", r]);
    }
    Kvlb::serve(&args)
}

/// Waits until `kvlb` is subscribed to every replica's events and has scraped each.
fn wait_live(kvlb: &Kvlb) {
    let live = || {
        replicas_json(kvlb).iter().all(|r| {
            let t = &r["telemetry"];
            t["events_connected"] == true && t["scrapes"].as_u64().unwrap_or(0) > 0
        })
    };
    assert!(
        wait_until(T, live),
        "telemetry not live on every replica: {:?}\n{}",
        replicas_json(kvlb)
            .iter()
            .filter(|r| r["telemetry"]["events_connected"] != true
                || r["telemetry"]["scrapes"].as_u64().unwrap_or(0) == 0)
            .take(3)
            .collect::<Vec<_>>(),
        kvlb.stderr()
    );
}

/// The names of `pid`'s threads, sorted.
fn threads(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("/proc/PID/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn telemetry_threads_do_not_grow_with_the_fleet() {
    let reps = ReplicaFleet::start(256, &[]);
    let small = serve(&reps, 4);
    let large = serve(&reps, 256);
    wait_live(&small);
    wait_live(&large);
    // The model lists and active health checks ask every replica at once on short-lived
    // threads (named after their parent): compare between their rounds.
    let mut last = (Vec::new(), Vec::new());
    let same = wait_until(T, || {
        last = (threads(small.pid()), threads(large.pid()));
        last.0 == last.1
    });
    let (a, b) = last;
    assert!(
        same,
        "threads in front of 4 replicas ({}) and of 256 ({}):\n{a:?}\n{b:?}",
        a.len(),
        b.len()
    );
    assert_eq!(
        a.iter().filter(|n| n.starts_with("kvlb-tel")).count(),
        kvlb::telemetry::THREADS,
        "{a:?}"
    );

    // The last replica's KV events reach the 256-replica instance: a prompt served there is
    // reported resident.
    let last = 255;
    let r = post(
        reps.http[last],
        "/v1/completions",
        &completion_body(&token_prompt(256, 7)),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(
        wait_until(T, || replicas_json(&large)[last]["telemetry"]
            ["events_seen"]
            .as_u64()
            .unwrap_or(0)
            > 0
            && replicas_json(&large)[last]["resident_blocks"]
                .as_u64()
                .unwrap_or(0)
                > 0),
        "no events from replica {last}: {:?}",
        replicas_json(&large)[last]
    );
}
