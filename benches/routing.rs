//! Per-request routing cost: the residency lookup (`match_prefix`) and the whole
//! `cache_aware` selection for a 128-block prompt (32 KiB of text at 256 bytes a block) over
//! 16, 64, 256 and 1,024 replicas, against an index holding about one million resident
//! blocks. `full_path_32k_chat` is the whole routing step of one request (a 32 KiB chat body,
//! about 8k tokens, whose message keys are sorted, content before role, extracted and hashed,
//! looked up, a replica selected); the `full_path_part_*` benches are its parts. Block hashing
//! alone is in `benches/prefix.rs`.
//!
//! Memory: for each fleet size the index's bytes per million resident blocks, per block copy
//! (a block held by a replica) and per distinct block; then, once, the index of 1,024
//! replicas each at its full KV capacity (400k tokens, 25,000 blocks of 16 tokens).
//!
//! Run: `cargo bench --bench routing -- --warm-up-time 1 --measurement-time 2 full_path`. On a
//! shared machine compare the fastest samples (criterion's `sample.json`) of runs made in the
//! same sitting.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use kvlb::http::request::Method;
use kvlb::prefix::{hash_request, PrefixConfig, PrefixHashes, BLOCK_BYTES};
use kvlb::residency::{ResidencyConfig, ResidencyIndex, ResidencyWriter};
use kvlb::select::{CacheAware, CacheAwareConfig, Candidate, Policy, RequestView, Rng};
use std::sync::Arc;

// The product's counting allocator, so the bench can show the routing path allocates nothing.
#[global_allocator]
static ALLOCATOR: kvlb::alloc::CountingMiMalloc = kvlb::alloc::CountingMiMalloc;

const RESIDENT: usize = 1_000_000;
/// The full-capacity figure: replicas, tokens each, tokens a block (the engine's).
const FULL_REPLICAS: usize = 1024;
const FULL_TOKENS: u64 = 400_000;
const FULL_BLOCK_TOKENS: u32 = 16;
const PROMPT_BLOCKS: usize = 128;
const BLOCK_TOKENS: u32 = 64;

fn chain(prev: u64, salt: u64) -> u64 {
    let mut z = prev ^ salt.wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

fn prompt(system: &[u64], id: u64, len: usize) -> Vec<u64> {
    let mut blocks = system.to_vec();
    while blocks.len() < len {
        let prev = *blocks.last().unwrap();
        blocks.push(chain(prev, id << 16 | blocks.len() as u64));
    }
    blocks
}

fn system_prompt() -> Vec<u64> {
    let mut system = vec![chain(7, 0)];
    for i in 1..8 {
        system.push(chain(system[i - 1], 0));
    }
    system
}

/// An index over `replicas` replicas filled with ~RESIDENT blocks: every replica holds the
/// shared 8-block system prompt and 128-block conversations of its own; the probe prompt is
/// resident in full on replicas 1 and 2 and for its first 64 blocks on replica 3.
fn populated(replicas: usize) -> (Arc<ResidencyIndex>, ResidencyWriter, Vec<u64>) {
    let per_replica = RESIDENT / replicas;
    let (idx, mut w) = ResidencyIndex::new(ResidencyConfig {
        max_replicas: replicas,
        block_tokens: BLOCK_TOKENS,
        kv_capacity_tokens: per_replica as u64 * BLOCK_TOKENS as u64,
    })
    .unwrap();
    let system = system_prompt();
    let mut id = 1u64;
    for r in 0..replicas {
        for _ in 0..per_replica / (PROMPT_BLOCKS - 8) {
            w.insert(r, &prompt(&system, id, PROMPT_BLOCKS), 0).unwrap();
            id += 1;
        }
    }
    let probe = prompt(&system, u64::MAX >> 16, PROMPT_BLOCKS);
    w.insert(1, &probe, 1).unwrap();
    w.insert(2, &probe, 1).unwrap();
    w.insert(3, &probe[..64], 1).unwrap();
    (idx, w, probe)
}

/// An OpenAI chat body of about `target` bytes: a system prompt, a tool, and turns of prose.
fn chat_body(target: usize) -> String {
    let words = [
        "the", "replica", "cache", "prefix", "holds", "tokens", "request", "queue", "prefill",
        "routing", "agent", "history", "schema", "function", "returns", "value", "when", "under",
    ];
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a careful assistant. ".repeat(40)}),
    ];
    let mut size = 2000;
    let mut k = 0u64;
    while size < target {
        let text: String = (0..300)
            .map(|i| words[((k * 31 + i * 7) % words.len() as u64) as usize])
            .collect::<Vec<_>>()
            .join(" ");
        size += text.len() + 40;
        let role = if k.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        messages.push(serde_json::json!({"role": role, "content": text}));
        k += 1;
    }
    serde_json::json!({
        "model": "Qwen/Qwen3-8B",
        "stream": true,
        "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}],
        "messages": messages,
    })
    .to_string()
}

/// The index's size, per copy and per distinct block.
fn report_memory(what: &str, idx: &ResidencyIndex, replicas: usize) {
    let resident: usize = (0..replicas).map(|r| idx.replica_blocks(r)).sum();
    let distinct = idx.distinct_blocks();
    eprintln!(
        "{what}: {resident} resident blocks ({distinct} distinct), index {:.1} MiB \
         (shared table {:.1} MiB) = {:.1} MiB per million resident blocks; {:.1} bytes per \
         block copy, {:.1} per distinct block",
        idx.bytes() as f64 / (1 << 20) as f64,
        idx.table_bytes() as f64 / (1 << 20) as f64,
        idx.bytes() as f64 / (1 << 20) as f64 / (resident as f64 / 1e6),
        idx.bytes() as f64 / resident as f64,
        idx.bytes() as f64 / distinct as f64,
    );
}

/// 1,024 replicas at full KV capacity: each holds the shared system prompt and its own
/// 128-block conversations, 25,000 blocks in all.
fn full_capacity() {
    let (idx, mut w) = ResidencyIndex::new(ResidencyConfig {
        max_replicas: FULL_REPLICAS,
        block_tokens: FULL_BLOCK_TOKENS,
        kv_capacity_tokens: FULL_TOKENS,
    })
    .unwrap();
    let system = system_prompt();
    let per_replica = (FULL_TOKENS / FULL_BLOCK_TOKENS as u64) as usize;
    let mut id = 1u64;
    for r in 0..FULL_REPLICAS {
        for _ in 0..per_replica.div_ceil(PROMPT_BLOCKS - 8) {
            w.insert(r, &prompt(&system, id, PROMPT_BLOCKS), 0).unwrap();
            id += 1;
        }
    }
    report_memory(
        &format!("{FULL_REPLICAS} replicas at {FULL_TOKENS} tokens each (full capacity)"),
        &idx,
        FULL_REPLICAS,
    );
}

fn routing(c: &mut Criterion) {
    full_capacity();
    let mut group = c.benchmark_group("routing");
    for replicas in [16usize, 64, 256, 1024] {
        let (idx, mut writer, probe) = populated(replicas);
        let log = writer.routing_log(1 << 16);
        report_memory(&format!("{replicas} replicas"), &idx, replicas);
        let mut out = vec![0u32; replicas];
        group.bench_with_input(
            BenchmarkId::new("match_prefix", replicas),
            &probe,
            |b, p| {
                b.iter(|| {
                    idx.match_prefix(black_box(p), &mut out);
                    black_box(out[1])
                })
            },
        );
        // Cold: a different resident conversation each time, so the table's slots come from
        // memory rather than cache (the table is far larger than the caches).
        let per_prompt = RESIDENT / replicas / (PROMPT_BLOCKS - 8);
        let probes: Vec<Vec<u64>> = (0..4096u64)
            .map(|k| {
                let id = 1 + (k * 7919) % (per_prompt * replicas) as u64;
                prompt(&system_prompt(), id, PROMPT_BLOCKS)
            })
            .collect();
        let mut k = 0;
        group.bench_function(BenchmarkId::new("match_prefix_cold", replicas), |b| {
            b.iter(|| {
                k = (k + 1) % probes.len();
                idx.match_prefix(black_box(&probes[k]), &mut out);
                black_box(out[0])
            })
        });
        let mut rng = Rng::new(1);
        let candidates: Vec<Candidate> = (0..replicas)
            .map(|r| Candidate {
                replica: r,
                in_flight: (rng.next_u64() % 8) as u32,
                queued_prefill_tokens: rng.next_u64() % 20_000,
                decoding: (rng.next_u64() % 32) as u32,
                ..Default::default()
            })
            .collect();
        let mut policy = CacheAware::new(idx.clone(), CacheAwareConfig::default())
            .unwrap()
            .with_routing_log(log.clone());
        // Warm up, then count: a warm policy's select (lookup, estimates, routing log record)
        // must not allocate.
        let view = |now_us| RequestView {
            method: Method::Post,
            path: b"/v1/chat/completions",
            body: b"",
            blocks: &probe,
            block_tokens: BLOCK_TOKENS,
            prompt_tokens: PROMPT_BLOCKS as u32 * BLOCK_TOKENS,
            now_us,
        };
        policy.select(&view(0), &candidates, 0);
        let before = kvlb::alloc::thread_allocations();
        for i in 0..10_000u64 {
            black_box(policy.select(&view(i * 1000), &candidates, rng.next_u64()));
        }
        let allocations = kvlb::alloc::thread_allocations() - before;
        eprintln!("{replicas} replicas: {allocations} allocations in 10000 selects");
        assert_eq!(allocations, 0);
        eprintln!(
            "{replicas} replicas: routing log recorded {}, dropped {} (nobody drains it here)",
            log.recorded(),
            log.dropped()
        );
        // The whole routing path of one request: a 32 KiB chat body (about 8k tokens) is
        // extracted and hashed, looked up and a replica selected.
        let body = chat_body(32 * 1024);
        let prefix_cfg = PrefixConfig::default();
        let mut hashes = PrefixHashes::new(&prefix_cfg);
        hash_request(
            b"/v1/chat/completions",
            body.as_bytes(),
            &prefix_cfg,
            &mut hashes,
        )
        .unwrap();
        eprintln!(
            "{replicas} replicas: the chat body is {} bytes, {} blocks, about {} tokens",
            body.len(),
            hashes.hashes.len(),
            hashes.est_prompt_tokens
        );
        writer.insert(1, &hashes.hashes, 2).unwrap();
        writer
            .insert(2, &hashes.hashes[..hashes.hashes.len() / 2], 2)
            .unwrap();
        group.bench_function(BenchmarkId::new("full_path_32k_chat", replicas), |b| {
            let mut now_us = 0;
            b.iter(|| {
                now_us += 1000;
                hash_request(
                    b"/v1/chat/completions",
                    black_box(body.as_bytes()),
                    &prefix_cfg,
                    &mut hashes,
                )
                .unwrap();
                let view = RequestView {
                    method: Method::Post,
                    path: b"/v1/chat/completions",
                    body: body.as_bytes(),
                    blocks: &hashes.hashes,
                    block_tokens: BLOCK_BYTES as u32 / 4,
                    prompt_tokens: hashes.est_prompt_tokens,
                    now_us,
                };
                black_box(policy.select(&view, &candidates, rng.next_u64()))
            })
        });
        // Its parts: extraction and hashing (the same at any replica count, so measured once),
        // the residency lookup of its 128 hashes, and the selection given the hashes.
        if replicas == 16 {
            group.bench_function("full_path_part_hash_request_32k_chat", |b| {
                b.iter(|| {
                    hash_request(
                        b"/v1/chat/completions",
                        black_box(body.as_bytes()),
                        &prefix_cfg,
                        &mut hashes,
                    )
                    .unwrap();
                    black_box(hashes.hashes.len())
                })
            });
        }
        group.bench_function(
            BenchmarkId::new("full_path_part_match_prefix_32k_chat", replicas),
            |b| {
                b.iter(|| {
                    idx.match_prefix(black_box(&hashes.hashes), &mut out);
                    black_box(out[1])
                })
            },
        );
        group.bench_function(
            BenchmarkId::new("full_path_part_select_32k_chat", replicas),
            |b| {
                let mut now_us = 0;
                b.iter(|| {
                    now_us += 1000;
                    let view = RequestView {
                        method: Method::Post,
                        path: b"/v1/chat/completions",
                        body: body.as_bytes(),
                        blocks: black_box(&hashes.hashes),
                        block_tokens: BLOCK_BYTES as u32 / 4,
                        prompt_tokens: hashes.est_prompt_tokens,
                        now_us,
                    };
                    black_box(policy.select(&view, &candidates, rng.next_u64()))
                })
            },
        );
        group.bench_with_input(BenchmarkId::new("select", replicas), &probe, |b, p| {
            let mut now_us = 0;
            b.iter(|| {
                now_us += 1000;
                let view = RequestView {
                    method: Method::Post,
                    path: b"/v1/chat/completions",
                    body: b"",
                    blocks: black_box(p),
                    block_tokens: BLOCK_TOKENS,
                    prompt_tokens: PROMPT_BLOCKS as u32 * BLOCK_TOKENS,
                    now_us,
                };
                black_box(policy.select(&view, &candidates, rng.next_u64()))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, routing);
criterion_main!(benches);
