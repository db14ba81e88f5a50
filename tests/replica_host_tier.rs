//! The simulated replica's host-memory KV tier end to end: `kvlb replica
//! --host-kv-capacity-tokens` publishes its CPU copies as KV events with medium CPU, a real
//! `kvlb serve` subscribed to it files them in the replica's offloaded tier, and a prompt the
//! GPU evicted is routed back to the replica that holds it in host memory, which loads it
//! instead of recomputing it (cached_tokens and vllm:external_prefix_cache_hits_total).

#[path = "support/mod.rs"]
mod support;

use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;
use support::fleet::{decision, post, tiers, ReplicaFleet};
use support::proxy::metric_sum;
use support::{wait_until, HttpConn, Kvlb};

const T: Duration = Duration::from_secs(20);

fn completion(tokens: &[u32]) -> Vec<u8> {
    json!({"model": "Qwen/Qwen3-8B", "prompt": tokens, "max_tokens": 1})
        .to_string()
        .into_bytes()
}

fn prompt(first: u32, n: u32) -> Vec<u32> {
    (first..first + n).collect()
}

/// A replica's `name` sample (its one engine), read with the support crate's Prometheus reader.
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = HttpConn::connect(addr)
        .request("GET", "/metrics", &[], b"")
        .expect("GET /metrics")
        .body_text();
    metric_sum(&text, name, &["engine=\"0\""]).unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[test]
fn cpu_medium_events_reach_kvlb_and_an_evicted_prompt_is_loaded_back() {
    // 64 GPU blocks of 16 tokens, 1024 host blocks.
    let reps = ReplicaFleet::start(
        2,
        &[
            "--time-scale",
            "50",
            "--kv-capacity-tokens",
            "1024",
            "--max-model-len",
            "1024",
            "--host-kv-capacity-tokens",
            "16384",
        ],
    );
    let replica = |i: usize| format!("http://{},kv_events={}", reps.http[i], reps.events[i]);
    let kvlb = Kvlb::serve(&[
        "--explain",
        "--workers",
        "1",
        "--replica",
        &replica(0),
        "--replica",
        &replica(1),
    ]);
    // Until kvlb's subscription is up events are lost: send replica 0 fresh prompts until
    // a CPU copy is seen, then clear both tiers.
    let mut warm = 0;
    assert!(
        wait_until(T, || {
            warm += 1;
            let r = post(
                reps.http[0],
                "/v1/completions",
                &completion(&prompt(90_000 + warm * 100, 64)),
            );
            assert_eq!(r.status, 200, "{}", r.describe());
            std::thread::sleep(Duration::from_millis(50));
            tiers(&kvlb, 0).1 > 0
        }),
        "kvlb never saw a CPU-medium event from replica 0:\n{}",
        kvlb.stderr()
    );
    assert_eq!(post(reps.http[0], "/reset_prefix_cache", b"").status, 200);
    assert!(
        wait_until(T, || tiers(&kvlb, 0) == (0, 0)),
        "AllBlocksCleared did not clear both tiers: {:?}",
        tiers(&kvlb, 0)
    );

    // Straight to replica 0 (kvlb learns only from its events): P, 32 full blocks, written
    // through to host memory; then E, 1010 tokens in 64 blocks, pushes P out of the GPU.
    let p = prompt(1000, 512);
    let r = post(reps.http[0], "/v1/completions", &completion(&p));
    assert_eq!(r.status, 200, "{}", r.describe());
    assert!(
        wait_until(T, || tiers(&kvlb, 0) == (32, 32)),
        "P not in both tiers: {:?}",
        tiers(&kvlb, 0)
    );
    let r = post(
        reps.http[0],
        "/v1/completions",
        &completion(&prompt(20_000, 1010)),
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    assert!(
        wait_until(T, || tiers(&kvlb, 0) == (63, 32 + 63)),
        "GPU should hold E's 63 full blocks, host P's 32 and E's 63: {:?}",
        tiers(&kvlb, 0)
    );
    assert_eq!(tiers(&kvlb, 1), (0, 0));

    // P through kvlb: the host copy beats the cold replica, and the replica loads it back.
    let hits = "vllm:external_prefix_cache_hits_total";
    let before = metric(reps.http[0], hits);
    let via = post(kvlb.listen, "/v1/completions", &completion(&p));
    assert_eq!(via.status, 200, "{}", via.describe());
    assert_eq!(
        via.header("x-kvlb-replica"),
        Some(format!("http://{}", reps.http[0]).as_str()),
        "{}",
        via.describe()
    );
    assert_eq!(decision(&via).0, "cache", "{}", via.describe());
    let usage = via.json().expect("a JSON completion")["usage"].clone();
    // All but the last prompt token can hit: 31 whole blocks.
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 496,
        "{usage}"
    );
    assert_eq!(metric(reps.http[0], hits) - before, 496.0);
}
