//! Offloaded KV blocks end to end: `kvlb serve` subscribed to three real ZeroMQ KV event
//! publishers (kvlb's own `KvEventPublisher`, one per replica, the wire of
//! replica-interfaces.md section 1; replica B's in the older positional encoding) in front of
//! three simulated replicas. Replica A holds a prompt in GPU memory, B only in CPU memory, C
//! nothing: a GPU hit beats an offloaded one, an offloaded one beats a cold replica, and a
//! removal on one medium leaves the other medium's copy alone.

#[path = "support/mod.rs"]
mod support;

use kvlb::kv_events::{KvEvent, Medium};
use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;
use support::fleet::{batch, decision, serve_with_publishers, tiers, ReplicaFleet};
use support::{wait_until, HttpConn};

const T: Duration = Duration::from_secs(20);
/// Prompt tokens (128 blocks of 16).
const PROMPT: u32 = 2048;
const BLOCKS: u64 = PROMPT as u64 / 16;

/// The engine's block ids of the prompt (opaque to kvlb, which hashes the token ids).
fn engine_ids() -> Vec<u64> {
    (0..BLOCKS).map(|i| 0xe000 + i).collect()
}

fn stored(tokens: &[u32], medium: &str) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: engine_ids(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: 16,
        lora_id: None,
        key: Default::default(),
        medium: Some(Medium::parse(medium)),
    }
}

fn removed(medium: Option<&str>) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: engine_ids(),
        medium: medium.map(Medium::parse),
    }
}

fn post(addr: SocketAddr, body: &[u8]) -> support::Response {
    let mut c = HttpConn::connect(addr);
    c.request(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body,
    )
    .unwrap_or_else(|e| panic!("POST /v1/completions to {addr}: {e}"))
}

#[test]
fn gpu_beats_offloaded_beats_cold_and_media_are_removed_apart() {
    let reps = ReplicaFleet::start(3, &["--time-scale", "50"]);
    use kvlb::kv_events::EventFormat::{Array, Map};
    let (kvlb, pubs) = serve_with_publishers(&reps, &[Map, Array, Map], &[]);
    let url = |i: usize| format!("http://{}", reps.http[i]);

    let tokens: Vec<u32> = (0..PROMPT).map(|i| 1000 + (i * 7) % 30_000).collect();
    let body = json!({"model": "Qwen/Qwen3-8B", "prompt": tokens, "max_tokens": 1})
        .to_string()
        .into_bytes();
    let (a, b) = (&pubs[0], &pubs[1]);

    // A holds the prompt in GPU memory, B only offloaded to CPU memory, C nothing.
    a.publish(&batch(vec![stored(&tokens, "GPU")]));
    b.publish(&batch(vec![stored(&tokens, "CPU")]));
    assert!(
        wait_until(T, || tiers(&kvlb, 0) == (BLOCKS, 0)
            && tiers(&kvlb, 1) == (0, BLOCKS)),
        "kvlb did not learn the tiers: A {:?}, B {:?}\n{}",
        tiers(&kvlb, 0),
        tiers(&kvlb, 1),
        kvlb.stderr()
    );
    assert_eq!(tiers(&kvlb, 2), (0, 0));

    // The GPU copy wins.
    let via = post(kvlb.listen, &body);
    assert_eq!(via.status, 200, "{}", via.describe());
    assert_eq!(
        via.header("x-kvlb-replica"),
        Some(url(0).as_str()),
        "{}",
        via.describe()
    );
    let (reason, matched) = decision(&via);
    assert_eq!(reason, "cache", "{}", via.describe());
    assert_eq!(matched, PROMPT as u64, "{}", via.describe());

    // A evicts it from GPU memory (BlockRemoved without a medium means GPU): only B holds it,
    // in CPU memory. Loading it back beats recomputing it on C.
    a.publish(&batch(vec![removed(None)]));
    assert!(
        wait_until(T, || tiers(&kvlb, 0) == (0, 0)),
        "A's removal not applied: {:?}",
        tiers(&kvlb, 0)
    );
    let via = post(kvlb.listen, &body);
    assert_eq!(via.status, 200, "{}", via.describe());
    assert_eq!(
        via.header("x-kvlb-replica"),
        Some(url(1).as_str()),
        "{}",
        via.describe()
    );
    let (reason, matched) = decision(&via);
    assert_eq!(reason, "cache", "{}", via.describe());
    // Counted at 1 - offload_load_cost (0.25) of its size: it is not a free GPU hit.
    assert_eq!(matched, PROMPT as u64 * 3 / 4, "{}", via.describe());
    let explained = via.header("x-kvlb-decision").unwrap_or_default();
    assert!(
        explained.contains(&format!("offloaded_blocks={BLOCKS};")),
        "{}",
        via.describe()
    );

    // B computes it into GPU memory, then drops the CPU copy: the GPU copy stays.
    b.publish(&batch(vec![stored(&tokens, "GPU"), removed(Some("CPU"))]));
    assert!(
        wait_until(T, || tiers(&kvlb, 1).1 == 0),
        "B's CPU removal not applied: {:?}",
        tiers(&kvlb, 1)
    );
    assert_eq!(tiers(&kvlb, 1), (BLOCKS, 0));
    let via = post(kvlb.listen, &body);
    assert_eq!(
        via.header("x-kvlb-replica"),
        Some(url(1).as_str()),
        "{}",
        via.describe()
    );
    assert_eq!(decision(&via), ("cache".to_string(), PROMPT as u64));

    // The offloaded blocks show in /metrics too.
    let metrics = kvlb.admin_get("/metrics").body_text();
    assert!(
        metrics.contains(&format!(
            "kvlb_replica_kv_offloaded_blocks_total{{replica=\"{}\"}} {BLOCKS}",
            url(1)
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvlb_replica_kv_offload_resident_blocks{"),
        "{metrics}"
    );

    // With an offloaded tier in use (C holds another prompt on disk), every request runs the
    // second lookup; a warm worker still allocates nothing per request.
    let other: Vec<u32> = (0..PROMPT).map(|i| 2000 + (i * 11) % 30_000).collect();
    pubs[2].publish(&batch(vec![stored(&other, "DISK")]));
    assert!(
        wait_until(T, || tiers(&kvlb, 2) == (0, BLOCKS)),
        "C's offloaded blocks not applied: {:?}",
        tiers(&kvlb, 2)
    );
    let mut conn = HttpConn::connect(kvlb.listen);
    let mut send = |n: usize| {
        for _ in 0..n {
            let r = conn
                .request(
                    "POST",
                    "/v1/completions",
                    &[("Content-Type", "application/json")],
                    &body,
                )
                .expect("keep-alive request");
            assert_eq!(r.status, 200, "{}", r.describe());
        }
    };
    send(50);
    let allocations = || {
        kvlb.metric("kvlb_worker_allocations_total", &["worker=\"0\""])
            .expect("kvlb_worker_allocations_total in /metrics")
    };
    let before = allocations();
    send(200);
    let grown = allocations() - before;
    assert!(
        grown <= 2.0,
        "{grown} allocations for 200 warm requests with an offloaded tier"
    );
}
