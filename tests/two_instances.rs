//! Two `kvlb serve` instances in front of one fleet of `kvlb replica` processes agree, from
//! the replicas' own reports only (they share nothing with each other):
//!
//! (a) a long prompt sent through instance A lands on some replica r; once r's KV events
//!     reached instance B, the same prompt sent through B lands on r too;
//! (b) while r runs long generations sent through A, instance B (which sent nothing there)
//!     sees r's queue in r's scraped /metrics and sends fresh prompts elsewhere.
//!
//! Prompts are token ids (completions with `prompt` as an array of ints): KV events describe
//! token blocks, which kvlb matches for token-id prompts.

#[path = "support/mod.rs"]
mod support;

use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;
use support::fleet::{replica_count_reaches, replicas_json, token_prompt, ReplicaFleet};
use support::{wait_until, HttpConn, Kvlb};

const T: Duration = Duration::from_secs(15);

/// `kvlb serve` in front of every replica, subscribed to their events, scraping every 100 ms.
fn start_instance(reps: &ReplicaFleet) -> Kvlb {
    let args: Vec<String> = reps
        .http
        .iter()
        .zip(&reps.events)
        .flat_map(|(h, e)| ["--replica".to_string(), format!("http://{h},kv_events={e}")])
        .collect();
    let mut all = vec!["--explain", "--workers", "1", "--metrics-interval", "100ms"];
    all.extend(args.iter().map(String::as_str));
    Kvlb::serve(&all)
}

fn completion(tokens: &[u32], max_tokens: u32) -> Vec<u8> {
    json!({"model": "Qwen/Qwen3-8B", "prompt": tokens, "max_tokens": max_tokens})
        .to_string()
        .into_bytes()
}

fn post(addr: SocketAddr, body: &[u8]) -> support::Response {
    let mut c = HttpConn::connect(addr);
    c.set_read_timeout(T);
    c.request(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body,
    )
    .unwrap_or_else(|e| panic!("POST to {addr}: {e}"))
}

#[test]
fn two_instances_agree_on_cache_and_load() {
    let reps = ReplicaFleet::start(3, &[]);
    let a = start_instance(&reps);
    let b = start_instance(&reps);
    for k in [&a, &b] {
        assert!(
            wait_until(T, || replicas_json(k).iter().all(|r| {
                let t = &r["telemetry"];
                t["events_connected"] == true && t["reported"]["fresh"] == true
            })),
            "not subscribed and scraping: {:?}\n{}",
            replicas_json(k),
            k.stderr()
        );
    }
    // The subscription lands on the publisher a little after the connection.
    std::thread::sleep(Duration::from_millis(300));

    // (a) A long prompt through A lands on r; r publishes its blocks; B follows them.
    let prompt = token_prompt(2048, 1);
    let r = reps.served_by(&post(a.listen, &completion(&prompt, 1)));
    assert!(
        replica_count_reaches(&b, r, "resident_blocks", 128, T),
        "B did not learn replica {r}'s blocks from its events: {:?}",
        replicas_json(&b)
    );
    let via_b = post(b.listen, &completion(&prompt, 1));
    assert_eq!(reps.served_by(&via_b), r, "{}", via_b.describe());
    let decision = via_b.header("x-kvlb-decision").unwrap_or("").to_string();
    assert!(decision.contains("reason=cache"), "{decision}");

    // (b) Six long generations sharing the prompt go through A, to r for its cache.
    let busy: Vec<_> = (0..6u32)
        .map(|i| {
            let mut p = prompt.clone();
            p.extend(token_prompt(32, 100 + i));
            let (listen, body) = (a.listen, completion(&p, 400));
            std::thread::spawn(move || post(listen, &body))
        })
        .collect();
    // B sent none of them, and sees them in r's reported queue.
    assert!(
        wait_until(T, || {
            let rep = &replicas_json(&b)[r]["telemetry"]["reported"];
            rep["fresh"] == true
                && rep["foreign_running"].as_u64().unwrap_or(0)
                    + rep["foreign_waiting"].as_u64().unwrap_or(0)
                    >= 6
        }),
        "B does not see replica {r}'s queue: {:?}",
        replicas_json(&b)
    );
    // A counts them as its own, not twice. A scrape may still find the earlier, finished
    // request running (the replica's figure and A's own count are read a moment apart): the
    // next ones, while the six still decode, must not.
    assert!(
        wait_until(Duration::from_secs(2), || {
            replicas_json(&a)[r]["telemetry"]["reported"]["foreign_running"] == 0
        }),
        "A counts its own requests as foreign: {}",
        replicas_json(&a)[r]["telemetry"]["reported"]
    );
    // Fresh prompts through B avoid r while it is busy (by chance: (2/3)^10, 2%).
    for salt in 0..10 {
        let fresh = post(b.listen, &completion(&token_prompt(1024, 7 + salt), 1));
        let to = reps.served_by(&fresh);
        assert_ne!(
            to,
            r,
            "B sent a fresh prompt to busy replica {r}: {}\n{:?}",
            fresh.describe(),
            replicas_json(&b)[r]
        );
    }
    for h in busy {
        let resp = h.join().unwrap();
        assert_eq!(reps.served_by(&resp), r, "{}", resp.describe());
    }
}
