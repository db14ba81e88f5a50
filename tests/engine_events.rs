//! The engines' own KV event code against a real `kvlb serve`: vLLM 0.33.0's
//! vllm/distributed/kv_events.py and SGLang 0.5.23's disaggregation/kv_events.py +
//! mem_cache/events.py, unmodified, behind small import shims (tests/py/engines/driver.py),
//! publishing over real ZeroMQ to kvlb subscribed as it is in production (PUB + replay
//! ROUTER); and kvlb's simulated replica read by vLLM's own msgspec decoder.
//!
//! The engine sources come from the pinned wheels (tests/py/engines/fetch.py: PyPI once, then
//! a cache outside the repository); a failed fetch fails the tests. The Python side needs
//! pyzmq, msgspec and pydantic (tests/py/requirements.txt).

#[path = "support/mod.rs"]
mod support;

use serde_json::{json, Value};
use std::time::Duration;
use support::engines::{EnginePublisher, VllmDecoder};
use support::fleet::{
    completion_body, decision, post, replicas_json, telemetry_of, token_prompt, ReplicaFleet,
};
use support::{wait_until, Kvlb};

const T: Duration = Duration::from_secs(20);

fn resident(kvlb: &Kvlb, r: usize) -> u64 {
    replicas_json(kvlb)[r]["resident_blocks"]
        .as_u64()
        .unwrap_or(u64::MAX)
}

/// Two simulated replicas behind `kvlb serve --explain`: replica 0 without events, replica 1
/// (its HTTP side simulated) with the engine's publisher as its event stream, once kvlb is
/// connected to it.
struct Setup {
    reps: ReplicaFleet,
    kvlb: Kvlb,
}

impl Setup {
    fn new(publisher: &EnginePublisher) -> Setup {
        // Serving the adapters the tests' events and requests name, as an engine started with
        // them lists them in its /v1/models.
        let reps = ReplicaFleet::start(
            2,
            &[
                "--time-scale",
                "50",
                "--enable-lora",
                "--lora-modules",
                "sql-lora=/adapters/sql",
                "chat-lora=/adapters/chat",
            ],
        );
        let r0 = format!("http://{}", reps.http[0]);
        let r1 = publisher.replica_spec(reps.http[1]);
        let kvlb = Kvlb::serve(&[
            "--explain",
            "--workers",
            "1",
            "--replica",
            &r0,
            "--replica",
            &r1,
        ]);
        assert!(
            wait_until(T, || telemetry_of(&kvlb, 1)["events_connected"] == true),
            "kvlb did not connect to the engine's publisher: {}\n{}",
            telemetry_of(&kvlb, 1),
            kvlb.stderr()
        );
        // The subscription lands on the publisher a little after the connection; a batch sent
        // before it is fetched from the replay ROUTER when the next one arrives.
        std::thread::sleep(Duration::from_millis(300));
        Setup { reps, kvlb }
    }

    fn replica1(&self) -> String {
        format!("http://{}", self.reps.http[1])
    }

    /// POSTs `tokens` through kvlb; returns (served by replica 1, reason, matched tokens).
    fn route(&self, tokens: &[u32]) -> (bool, String, u64, String) {
        self.route_body(&completion_body(tokens))
    }

    fn route_body(&self, body: &[u8]) -> (bool, String, u64, String) {
        let r = post(self.kvlb.listen, "/v1/completions", body);
        assert_eq!(r.status, 200, "{}", r.describe());
        let (reason, matched) = decision(&r);
        let on1 = r.header("x-kvlb-replica") == Some(self.replica1().as_str());
        (on1, reason, matched, r.describe())
    }

    fn assert_cached_on_1(&self, tokens: &[u32], at_least: u64, what: &str) {
        let (on1, reason, matched, described) = self.route(tokens);
        assert!(
            on1 && reason == "cache" && matched >= at_least,
            "{what}: want replica 1 for the cache with >= {at_least} tokens matched: {described}\n\
             telemetry: {}",
            telemetry_of(&self.kvlb, 1)
        );
    }

    /// Whether `tokens` under `model` and `salt` are routed to replica 1 for its cache.
    fn cached_as(&self, tokens: &[u32], model: &str, salt: Option<&str>) -> (bool, String) {
        let mut body = json!({"model": model, "prompt": tokens, "max_tokens": 1});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let (on1, reason, matched, described) = self.route_body(body.to_string().as_bytes());
        (on1 && reason == "cache" && matched > 0, described)
    }

    fn assert_not_cached_on_1(&self, tokens: &[u32], what: &str) {
        let (on1, reason, matched, described) = self.route(tokens);
        assert!(
            !(on1 && reason == "cache" && matched > 0),
            "{what}: routed to replica 1 for a cache it no longer holds: {described}\n\
             telemetry: {}",
            telemetry_of(&self.kvlb, 1)
        );
    }
}

/// vLLM, incremental report mode: cache_full_blocks stores a request's blocks in two steps,
/// eviction removes them one BlockRemoved per hash.
#[test]
fn vllm_incremental_store_then_evict() {
    let mut vllm = EnginePublisher::vllm();
    let s = Setup::new(&vllm);
    let a = token_prompt(512, 1);
    vllm.publish(json!([{"type": "store", "tokens": a, "from": 0, "to": 16}]));
    vllm.publish(json!([{"type": "store", "tokens": a, "from": 16, "to": 32}]));
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 32),
        "kvlb did not learn vLLM's stores: {}",
        telemetry_of(&s.kvlb, 1)
    );
    s.assert_cached_on_1(&a, 500, "after the stores");

    let all: Vec<u32> = (0..32).collect();
    vllm.publish(json!([{"type": "evict", "tokens": a, "blocks": all}]));
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 0),
        "kvlb kept evicted blocks: {}",
        telemetry_of(&s.kvlb, 1)
    );
    s.assert_not_cached_on_1(&a, "after the eviction");
}

/// vLLM, "full" kv_cache_report_mode: every prefix-cache hit re-sends BlockStored for the reused
/// blocks (emit_cached_block_events: same hashes, parent None, from block 0), while eviction
/// still sends one BlockRemoved per hash. Once evicted, kvlb must hold none of them.
#[test]
fn vllm_full_report_reuse_then_evict_leaves_no_blocks() {
    let mut vllm = EnginePublisher::vllm();
    let s = Setup::new(&vllm);
    let a = token_prompt(512, 2);
    // Request 1 computes the prompt.
    vllm.publish(json!([{"type": "store", "tokens": a, "from": 0, "to": 16}]));
    vllm.publish(json!([{"type": "store", "tokens": a, "from": 16, "to": 32}]));
    // Requests 2 and 3 hit the prefix cache: reuse reports of all 32 blocks.
    vllm.publish(json!([{"type": "reuse", "tokens": a, "blocks": 32}]));
    vllm.publish(json!([{"type": "reuse", "tokens": a, "blocks": 32}]));
    assert!(
        wait_until(T, || telemetry_of(&s.kvlb, 1)["events_seen"].as_u64()
            >= Some(4)),
        "kvlb did not see the batches: {}",
        telemetry_of(&s.kvlb, 1)
    );
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 32),
        "reuse reports are the same 32 blocks: {}",
        telemetry_of(&s.kvlb, 1)
    );
    s.assert_cached_on_1(&a, 500, "after the reuse reports");

    // The blocks are freed and evicted: one BlockRemoved per hash, each hash once.
    let all: Vec<u32> = (0..32).collect();
    vllm.publish(json!([{"type": "evict", "tokens": a, "blocks": all}]));
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 0),
        "phantom blocks: kvlb still holds evicted blocks after reuse reports: {}",
        telemetry_of(&s.kvlb, 1)
    );
    s.assert_not_cached_on_1(&a, "after the eviction");
}

/// vLLM with LoRA and cache_salt: the adapter (lora_name, and the first entry of each block's
/// extra_keys) and the salt (block 0's extra_keys) enter its block hashes, so vLLM reuses those
/// blocks only for requests of the same adapter and salt. kvlb must match them the same way:
/// the adapter from the request's `model`, learned from the events, the salt from
/// `cache_salt`.
#[test]
fn vllm_lora_and_salt_blocks_match_only_their_requests() {
    let mut vllm = EnginePublisher::vllm();
    let s = Setup::new(&vllm);
    let a = token_prompt(512, 11);
    let b = token_prompt(512, 12);
    vllm.publish(json!([
        {"type": "store", "tokens": a, "from": 0, "to": 32, "lora": "sql-lora"},
        {"type": "store", "tokens": b, "from": 0, "to": 16, "cache_salt": "tenant-a"},
        {"type": "store", "tokens": b, "from": 16, "to": 32, "cache_salt": "tenant-a"}
    ]));
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 64),
        "kvlb did not learn the stores: {}",
        telemetry_of(&s.kvlb, 1)
    );
    let t = telemetry_of(&s.kvlb, 1);
    assert_eq!(t["adapter_blocks"], 32, "{t}");
    assert_eq!(t["salted_blocks"], 16, "{t}");
    assert!(
        wait_until(T, || {
            let said = s.kvlb.stderr();
            // Learned from the replicas' model lists, or else from the events.
            said.contains("sql-lora (adapter of") || said.contains("LoRA adapter \"sql-lora\"")
        }),
        "the adapter learned is not logged:\n{}",
        s.kvlb.stderr()
    );
    // Both adapters the replicas list (one of them also from the events).
    assert_eq!(s.kvlb.metric("kvlb_lora_adapters_known", &[]), Some(2.0));
    let base = "Qwen/Qwen3-8B";
    for (tokens, model, salt, want, what) in [
        (&a, "sql-lora", None, true, "the adapter's own request"),
        (
            &a,
            "Qwen/Qwen3-8B:sql-lora",
            None,
            true,
            "the adapter as SGLang names it",
        ),
        (
            &a,
            base,
            None,
            false,
            "the base model on the adapter's blocks",
        ),
        (
            &a,
            "sql-lora",
            Some("tenant-a"),
            false,
            "the adapter with a salt",
        ),
        (&b, base, Some("tenant-a"), true, "the salt's own request"),
        (&b, base, None, false, "no salt on salted blocks"),
        (&b, base, Some("tenant-b"), false, "another salt"),
        (
            &b,
            "sql-lora",
            Some("tenant-a"),
            false,
            "the adapter on base-model blocks",
        ),
    ] {
        let (cached, described) = s.cached_as(tokens, model, salt);
        assert_eq!(cached, want, "{what}: {described}");
    }
}

/// vLLM with a multimodal item: blocks from the one holding its placeholder on are hashed with
/// the item's identifier, which no request's text or token ids carry. kvlb keeps the blocks
/// before it, and skips and counts the rest.
#[test]
fn vllm_multimodal_blocks_are_skipped_and_counted() {
    let mut vllm = EnginePublisher::vllm();
    let s = Setup::new(&vllm);
    let a = token_prompt(512, 13);
    vllm.publish(json!([
        {"type": "store", "tokens": a, "from": 0, "to": 32, "mm": [[20, "img-0", 3]]}
    ]));
    assert!(
        wait_until(T, || telemetry_of(&s.kvlb, 1)["skipped_multimodal"] == 12),
        "the multimodal blocks were not skipped: {}",
        telemetry_of(&s.kvlb, 1)
    );
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 20),
        "want the 20 blocks before the image: {}",
        telemetry_of(&s.kvlb, 1)
    );
    // The first request only: once routed, its own blocks are kvlb's guesses on replica 1.
    let (on1, reason, matched, described) = s.route(&a);
    assert!(
        on1 && reason == "cache" && matched == 320,
        "want the 320 tokens before the image matched on replica 1: {described}"
    );
    assert!(
        wait_until(T, || s
            .kvlb
            .metric(
                "kvlb_replica_kv_event_skipped_total",
                &["reason=\"multimodal\""]
            )
            .unwrap_or(0.0)
            >= 12.0),
        "not on /metrics"
    );
}

/// SGLang with a cache salt and a LoRA adapter: its recorder names both in every BlockStored
/// (`cache_salt`, `lora_name`) and namespaces its hashes by them. kvlb matches salted pages
/// only for the same salt, and the adapter's only for its `model`.
#[test]
fn sglang_salt_and_lora_pages_match_only_their_requests() {
    let mut sglang = EnginePublisher::sglang(1);
    let s = Setup::new(&sglang);
    let a = token_prompt(320, 14);
    let b = token_prompt(320, 15);
    let lora_key = format!("lora-ns-{}", "0123456789abcdef0123456789abcdef");
    sglang.publish(json!([
        {"type": "store", "node": "a", "tokens": a, "cache_salt": "tenant-a"},
        {"type": "store", "node": "b", "tokens": b, "extra_key": lora_key, "lora_name": "chat-lora"}
    ]));
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) >= 40),
        "kvlb did not learn SGLang's stores: {}",
        telemetry_of(&s.kvlb, 1)
    );
    let base = "Qwen/Qwen3-8B";
    for (tokens, model, salt, want, what) in [
        (&a, base, Some("tenant-a"), true, "the salt's own request"),
        (&a, base, None, false, "no salt on salted pages"),
        (
            &b,
            "Qwen/Qwen3-8B:chat-lora",
            None,
            true,
            "the adapter as SGLang names it",
        ),
        (
            &b,
            base,
            None,
            false,
            "the base model on the adapter's pages",
        ),
    ] {
        let (cached, described) = s.cached_as(tokens, model, salt);
        assert_eq!(cached, want, "{what}: {described}");
    }
}

/// SGLang with its default page_size 1: a radix node of a few hundred tokens is one coalesced
/// BlockStored of block_size 1. kvlb must learn the prefix, and forget it on eviction.
#[test]
fn sglang_page_size_1_node_is_learned() {
    let mut sglang = EnginePublisher::sglang(1);
    let s = Setup::new(&sglang);
    let a = token_prompt(320, 3);
    let produced = sglang.publish(json!([{"type": "store", "node": "a", "tokens": a}]));
    assert_eq!(
        produced,
        json!([{"type": "BlockStored", "hashes": 320, "block_size": 1}]),
        "SGLang's recorder"
    );
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) >= 20),
        "kvlb did not learn SGLang's page_size 1 store: {}",
        telemetry_of(&s.kvlb, 1)
    );
    s.assert_cached_on_1(&a, 300, "after the store");

    let produced = sglang.publish(json!([{"type": "remove", "node": "a"}]));
    assert_eq!(produced, json!([{"type": "BlockRemoved", "hashes": 320}]));
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 0),
        "kvlb kept the evicted node: {}",
        telemetry_of(&s.kvlb, 1)
    );
    s.assert_not_cached_on_1(&a, "after the eviction");
}

/// SGLang with EAGLE: bigram radix keys publish pages of (token, next token) pairs. A batch
/// holding such a store and a normal one: the normal store is applied, and the bigram store is
/// understood as the prefix of the pairs' first tokens.
#[test]
fn sglang_bigram_store_beside_a_normal_one() {
    let mut sglang = EnginePublisher::sglang(16);
    let s = Setup::new(&sglang);
    let normal = token_prompt(256, 4);
    // 257 raw tokens: 256 bigrams, 16 pages of 16 pairs.
    let eagle = token_prompt(257, 5);
    let produced = sglang.publish(json!([
        {"type": "store", "node": "n", "tokens": normal},
        {"type": "store", "node": "e", "tokens": eagle, "bigram": true},
    ]));
    assert_eq!(
        produced,
        json!([
            {"type": "BlockStored", "hashes": 16, "block_size": 16},
            {"type": "BlockStored", "hashes": 16, "block_size": 16},
        ]),
        "SGLang's recorder"
    );
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) >= 16),
        "kvlb dropped the normal store of a batch that also holds bigram pages: {}",
        telemetry_of(&s.kvlb, 1)
    );
    s.assert_cached_on_1(&normal, 240, "the normal store");
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 32),
        "kvlb did not learn the bigram store: {}",
        telemetry_of(&s.kvlb, 1)
    );
    s.assert_cached_on_1(&eagle, 240, "the bigram store");
}

/// kvlb's simulated replica publishes what vLLM's own msgspec classes decode
/// (`msgspec.msgpack.Decoder(KVEventBatch)`), in its default event encoding.
#[test]
fn kvlb_replica_events_decode_with_vllms_own_classes() {
    let reps = ReplicaFleet::start(1, &["--time-scale", "50"]);
    let mut decoder = VllmDecoder::connect(&reps.events[0]);
    // Reads messages for up to `limit`, each decoded by vLLM's classes; true once one holds an
    // event that `want` accepts.
    let mut read_until = |want: &dyn Fn(&Value) -> bool, limit: Duration| {
        let deadline = std::time::Instant::now() + limit;
        let mut found = false;
        while !found {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Some(msg) = decoder.next(left) else { break };
            assert!(
                msg.get("error").is_none(),
                "vLLM's decoder refused kvlb replica's batch: {msg}"
            );
            // msgspec.to_builtins of the batch: [ts, events, dp_rank], events as tagged maps.
            found = msg["batch"][1].as_array().into_iter().flatten().any(want);
        }
        found
    };
    // A message sent before the subscription reached the publisher is lost: compute new
    // prompts until one's BlockStored arrives.
    let stored = (0..5).any(|salt| {
        let direct = post(
            reps.http[0],
            "/v1/completions",
            &completion_body(&token_prompt(256, 6 + salt)),
        );
        assert_eq!(direct.status, 200, "{}", direct.describe());
        read_until(
            &|e| e["type"] == "BlockStored" && e["block_size"] == 16,
            Duration::from_secs(2),
        )
    });
    assert!(stored, "no BlockStored from kvlb replica");
    let reset = post(reps.http[0], "/reset_prefix_cache", b"");
    assert!(reset.status < 300, "{}", reset.describe());
    assert!(
        read_until(&|e| e["type"] == "AllBlocksCleared", T),
        "no AllBlocksCleared from kvlb replica after /reset_prefix_cache"
    );
}

/// A batch no engine code can have written (a msgpack reserved byte as an event, sent through
/// vLLM's publisher): kvlb logs a line naming the replica and the reason, and /metrics
/// counts it.
#[test]
fn an_undecodable_batch_is_logged_and_counted() {
    let mut vllm = EnginePublisher::vllm();
    let s = Setup::new(&vllm);
    let ok = token_prompt(64, 7);
    vllm.publish(json!([{"type": "store", "tokens": ok, "from": 0, "to": 4}]));
    assert!(
        wait_until(T, || resident(&s.kvlb, 1) == 4),
        "{}",
        telemetry_of(&s.kvlb, 1)
    );
    vllm.publish(json!([{"type": "raw", "msgpack_hex": "c1"}]));
    assert!(
        wait_until(T, || telemetry_of(&s.kvlb, 1)["decode_errors"].as_u64()
            >= Some(1)),
        "kvlb did not see the bad batch: {}",
        telemetry_of(&s.kvlb, 1)
    );

    let addr = s.reps.http[1].to_string();
    let names_replica = |l: &str| l.contains(&addr) || l.contains(&vllm.endpoint);
    let names_reason = |l: &str| l.contains("0xc1") || l.contains("reserved byte");
    assert!(
        wait_until(T, || s
            .kvlb
            .stderr()
            .lines()
            .any(|l| names_replica(l) && names_reason(l))),
        "no log line naming replica {addr} (or {}) and the reason (the reserved byte 0xc1):\n{}",
        vllm.endpoint,
        s.kvlb.stderr()
    );

    // Some kvlb_ counter of KV event batches that could not be used (its name says kv or event
    // and error, reject, invalid, malformed, decode or bad), labelled with the replica.
    let counted = |text: &str| {
        text.lines().any(|l| {
            let Some((name, rest)) = l.split_once('{') else {
                return false;
            };
            let bad = ["error", "reject", "invalid", "malformed", "decode", "bad"]
                .iter()
                .any(|w| name.contains(w));
            name.starts_with("kvlb_")
                && (name.contains("kv") || name.contains("event"))
                && bad
                && rest.contains(&addr)
                && rest
                    .rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|v| v >= 1.0)
        })
    };
    let metrics = s.kvlb.admin_get("/metrics").body_text();
    assert!(
        counted(&metrics),
        "no kvlb_ counter of bad KV event batches >= 1 for replica {addr} in /metrics:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("kv") || l.contains("event"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
