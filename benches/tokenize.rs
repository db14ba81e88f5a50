//! Per-request cost of token mode (`kvlb::tokenize`) on a 32 KiB chat body: system prompt
//! (~8 KiB), one tool schema, 10 turns, and a new ~200-byte user turn, with the ChatML
//! tokenizer of `tokenize::fixture` (a byte-level BPE, GPT-2 split regex).
//!
//! - `whole`: what an engine does, render + encode the whole prompt (no cache);
//! - `cold`: kvlb with an empty segment cache (every segment encoded), plus block hashing;
//! - `warm`: kvlb with the system prompt, tools and earlier turns cached and a new user turn
//!   each request (only that segment is encoded);
//! - `render`: the template alone (the floor of the warm path).
//!
//! Each warm request has its own final user turn, built outside the timed region.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kvlb::prefix::{PrefixConfig, PrefixHashes};
use kvlb::tokenize::{fill_prefix, fixture, ChatTokenizer, SegmentCache};
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: kvlb::alloc::CountingMiMalloc = kvlb::alloc::CountingMiMalloc;

const CHAT: &[u8] = b"/v1/chat/completions";

const WORDS: &[&str] = &[
    "the",
    "replica",
    "cache",
    "prefix",
    "holds",
    "most",
    "of",
    "this",
    "prompt",
    "so",
    "routing",
    "matters",
    "weather",
    "forecast",
    "city",
    "Paris,",
    "tomorrow.",
    "code",
    "Rust",
];

fn text(seed: u64, len: usize) -> String {
    let mut s = String::new();
    let mut i = seed;
    while s.len() < len {
        i = i
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(WORDS[(i >> 33) as usize % WORDS.len()]);
        s.push(if (i >> 20).is_multiple_of(17) {
            '\n'
        } else {
            ' '
        });
    }
    s
}

/// A ~32 KiB chat body whose last user turn is `last`.
fn body(last: &str) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system", "content": text(1, 8 * 1024)})];
    for turn in 0..10 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": text(10 + turn, 2000)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": last}));
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": text(2, 3000), "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]);
    serde_json::json!({"model": "m", "messages": messages, "tools": tools})
        .to_string()
        .into_bytes()
}

fn bench(c: &mut Criterion) {
    let tokenizer = ChatTokenizer::from_parts(
        fixture::chatml_tokenizer_json(1000).as_bytes(),
        Some(&fixture::chatml_config_json()),
        None,
    )
    .unwrap();
    assert!(tokenizer.segment_wise());
    let cfg = PrefixConfig::default();
    let mut prefix = PrefixHashes::new(&cfg);
    let mut ids = Vec::new();
    let sample = body(&text(99, 200));
    eprintln!(
        "tokenize bench: body {} bytes, {} tokens",
        sample.len(),
        tokenizer.chat_tokens_whole(&sample).unwrap().len()
    );

    let mut g = c.benchmark_group("tokenize_32k_chat");
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(20);
    g.bench_function("whole", |b| {
        b.iter(|| black_box(tokenizer.chat_tokens_whole(black_box(&sample)).unwrap()))
    });
    g.bench_function("render", |b| {
        b.iter(|| black_box(tokenizer.render_chat(black_box(&sample)).unwrap()))
    });
    g.bench_function("cold", |b| {
        b.iter(|| {
            let mut cache = SegmentCache::new(1024, 1 << 20);
            tokenizer
                .request_tokens(CHAT, black_box(&sample), &mut cache, &mut ids)
                .unwrap();
            fill_prefix(&ids, &cfg, &mut prefix);
            black_box(prefix.hashes.len())
        })
    });
    let mut cache = SegmentCache::new(16 * 1024, 1 << 20);
    let mut n = 0u64;
    let mut allocations = (0u64, 0u64);
    g.bench_function("warm", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                n += 1;
                let body = body(&format!("{n} {}", text(1000 + n, 200)));
                let before = kvlb::alloc::thread_allocations();
                let t = Instant::now();
                tokenizer
                    .request_tokens(CHAT, &body, &mut cache, &mut ids)
                    .unwrap();
                fill_prefix(&ids, &cfg, &mut prefix);
                spent += t.elapsed();
                allocations.0 += kvlb::alloc::thread_allocations() - before;
                allocations.1 += 1;
                black_box(prefix.hashes.len());
            }
            spent
        })
    });
    g.finish();
    eprintln!(
        "tokenize bench: warm requests allocate {:.0} times each (template rendering and the new turn's encoding)",
        allocations.0 as f64 / allocations.1.max(1) as f64
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
