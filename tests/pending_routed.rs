//! Routed blocks stay believed until the engine had its chance to store them: `kvlb serve`
//! subscribed to two real ZeroMQ KV event publishers (kvlb's own `KvEventPublisher`, the wire
//! of replica-interfaces.md section 1), one per simulated replica, token-id prompts so that
//! the blocks kvlb routes and the blocks the events name are the same hashes.
//!
//! Replica A stores prompt P; a request with P goes to A; A then evicts P (BlockRemoved)
//! before storing anything of it again. The request routed there will compute P again, so
//! the next request with P still goes to A for the cache. Without a routed request between
//! the store and the removal, the removal is believed and the next request goes by load.
//! The rule is opt-in (`routed_pending_ttl`, off by default); this test turns it on.

#[path = "support/mod.rs"]
mod support;

use kvlb::kv_events::{EventFormat, KvEvent, Medium};
use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;
use support::fleet::{batch, decision, replicas_json, serve_with_publishers, ReplicaFleet};
use support::{wait_until, HttpConn, Kvlb};

const T: Duration = Duration::from_secs(20);
/// Prompt tokens (64 blocks of 16).
const PROMPT: u32 = 1024;
const BLOCKS: u64 = PROMPT as u64 / 16;

/// The engine's block ids of a prompt (opaque to kvlb, which hashes the token ids).
fn engine_ids(base: u64) -> Vec<u64> {
    (0..BLOCKS).map(|i| base + i).collect()
}

fn stored(tokens: &[u32], base: u64) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (0..tokens.len() as u64 / 16).map(|i| base + i).collect(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: 16,
        lora_id: None,
        key: Default::default(),
        medium: Some(Medium::Gpu),
    }
}

fn removed(base: u64) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: engine_ids(base),
        medium: Some(Medium::Gpu),
    }
}

fn prompt(salt: u32) -> Vec<u32> {
    (0..PROMPT)
        .map(|i| 1000 + (i * 7 + salt * 131) % 30_000)
        .collect()
}

fn body(tokens: &[u32]) -> Vec<u8> {
    json!({"model": "Qwen/Qwen3-8B", "prompt": tokens, "max_tokens": 1})
        .to_string()
        .into_bytes()
}

fn post(addr: SocketAddr, body: &[u8]) -> support::Response {
    let mut c = HttpConn::connect(addr);
    let r = c
        .request(
            "POST",
            "/v1/completions",
            &[("Content-Type", "application/json")],
            body,
        )
        .unwrap_or_else(|e| panic!("POST /v1/completions to {addr}: {e}"));
    assert_eq!(r.status, 200, "{}", r.describe());
    r
}

/// Give the residency writer time to apply the routing record of the request just answered
/// (it drains the workers' logs every 1-4 ms; nothing reports that it did).
fn let_the_writer_learn_the_routing() {
    std::thread::sleep(Duration::from_millis(100));
}

fn resident(kvlb: &Kvlb, r: usize) -> u64 {
    replicas_json(kvlb)[r]["resident_blocks"]
        .as_u64()
        .unwrap_or(u64::MAX)
}

#[test]
fn a_removal_while_a_routed_request_waits_keeps_the_prefix_on_its_replica() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let (kvlb, pubs) = serve_with_publishers(
        &reps,
        &[EventFormat::Map, EventFormat::Map],
        &["--routed-pending-ttl", "120s"],
    );
    let url = |i: usize| format!("http://{}", reps.http[i]);
    let a = &pubs[0];
    // Events are applied in order: once a marker prompt's blocks show up on A, everything
    // published before it was applied too. Marker k has k blocks, so the count A reaches
    // (`expect` blocks of the prompts plus 1 + 2 + ... + k) is never one it went through.
    let mut k = 0u64;
    let mut publish_then_mark = |events: Vec<KvEvent>, expect: u64| {
        k += 1;
        let marker: Vec<u32> = (0..16 * k as u32)
            .map(|i| 20_000 + (i * 13 + k as u32 * 977) % 9000)
            .collect();
        let mut events = events;
        events.push(stored(&marker, 0x9000_0000 + k * 0x1000));
        a.publish(&batch(events));
        let want = expect + k * (k + 1) / 2;
        assert!(
            wait_until(T, || resident(&kvlb, 0) == want),
            "A's events not applied: {} resident, {want} expected\n{}",
            resident(&kvlb, 0),
            kvlb.stderr()
        );
    };

    // Without a routed request between store and removal, the removal is believed: Q stored
    // on A, then removed; the next request with Q goes by load.
    let q = prompt(2);
    publish_then_mark(vec![stored(&q, 0xf000)], BLOCKS);
    publish_then_mark(vec![removed(0xf000)], 0);
    let cold = post(kvlb.listen, &body(&q));
    let (reason, matched) = decision(&cold);
    assert_eq!(
        (reason.as_str(), matched),
        ("load", 0),
        "{}",
        cold.describe()
    );
    // That request left Q as a routing guess on whichever replica it went to.
    let guessed = if cold.header("x-kvlb-replica") == Some(url(0).as_str()) {
        BLOCKS
    } else {
        0
    };

    // A stores P; a request with P is routed there for the cache.
    let p = prompt(1);
    publish_then_mark(vec![stored(&p, 0xe000)], guessed + BLOCKS);
    let via = post(kvlb.listen, &body(&p));
    assert_eq!(
        via.header("x-kvlb-replica"),
        Some(url(0).as_str()),
        "{}",
        via.describe()
    );
    assert_eq!(
        decision(&via),
        ("cache".to_string(), PROMPT as u64),
        "{}",
        via.describe()
    );

    let_the_writer_learn_the_routing();
    // A evicts P before storing any of it again: P stays believed on A (the request routed
    // there computes it again), so the next request with P goes to A for the cache.
    publish_then_mark(vec![removed(0xe000)], guessed + BLOCKS);
    let next = post(kvlb.listen, &body(&p));
    assert_eq!(
        next.header("x-kvlb-replica"),
        Some(url(0).as_str()),
        "{}",
        next.describe()
    );
    assert_eq!(
        decision(&next),
        ("cache".to_string(), PROMPT as u64),
        "{}",
        next.describe()
    );

    let_the_writer_learn_the_routing();
    // A stores P again (the routed requests ran): confirmed, no longer pending, so the
    // removal that follows is believed and the next request with P goes by load.
    publish_then_mark(vec![stored(&p, 0xe000), removed(0xe000)], guessed);
    let after = post(kvlb.listen, &body(&p));
    let (reason, matched) = decision(&after);
    assert_eq!(
        (reason.as_str(), matched),
        ("load", 0),
        "{}",
        after.describe()
    );
}
