//! A huge prompt through a real `kvlb serve --workers 1 --explain` in front of the test
//! backend: one connection sends a 30 MB chat body of a million one-word messages (`model`
//! after them, as the OpenAI Python client writes its bodies) while another connection's small
//! requests run on the same worker. The assertions read routing facts from the wire, never
//! timings: the big body is routed, on exactly the blocks of its first 4096 messages (a repeat
//! of it matches that many tokens, no more), and counted and logged as cut short; the small
//! requests are all answered. `bench/prompt_stall.sh` measures how long they wait. A prompt
//! longer than the blocks routing learns is hashed up to them and measured past them, not cut
//! short.

#[path = "support/mod.rs"]
mod support;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};
use support::client::HttpConn;
use support::{Backend, Kvlb};

const MODEL: &str = "Qwen/Qwen3-8B";
/// The message bound (`prompt::DEFAULT_MAX_MESSAGES`).
const MAX_MESSAGES: usize = 4096;

/// `n` one-word user messages, `model` after them.
fn tiny_messages(n: usize) -> String {
    let messages = vec![r#"{"role":"user","content":"a"}"#; n].join(",");
    format!(r#"{{"messages":[{messages}],"model":"{MODEL}","stream":false}}"#)
}

/// (matched_tokens, prompt_tokens) of `x-kvlb-decision`.
fn decision(resp: &support::Response) -> (u64, u64) {
    let raw = resp
        .header("x-kvlb-decision")
        .unwrap_or_else(|| panic!("no x-kvlb-decision under --explain: {}", resp.describe()));
    let field = |name: &str| -> u64 {
        raw.split(';')
            .find_map(|p| p.trim().strip_prefix(&format!("{name}=")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in x-kvlb-decision: {raw}"))
    };
    (field("matched_tokens"), field("prompt_tokens"))
}

fn post(conn: &mut HttpConn, body: &[u8]) -> support::Response {
    let resp = conn
        .request(
            "POST",
            "/v1/chat/completions",
            &[("Content-Type", "application/json")],
            body,
        )
        .unwrap_or_else(|e| panic!("chat completion via kvlb failed: {e}"));
    assert!(
        resp.header("x-kvlb-replica").is_some(),
        "not routed: {}",
        resp.describe()
    );
    resp
}

#[test]
fn a_million_message_body_is_routed_on_its_first_blocks_while_others_are_served() {
    let started = Instant::now();
    let backend = Backend::start();
    let kvlb = Kvlb::serve(&["--workers", "1", "--explain", "--replica", &backend.url()]);
    let big = tiny_messages(1_000_000);
    assert!(big.len() > 30_000_000);
    // The canonical prefix read: model, then the first 4096 messages, 12 bytes each.
    let canonical = "\0model\0".len() + MODEL.len() + MAX_MESSAGES * "\0role:user\0a".len();
    let bound_tokens = (canonical / 256 * 64) as u64;

    let big_done = AtomicBool::new(false);
    let (small_answered, first) = std::thread::scope(|scope| {
        let small = scope.spawn(|| {
            let mut conn = HttpConn::connect(kvlb.listen);
            let body = tiny_messages(3);
            let mut answered = 0usize;
            while !big_done.load(Relaxed) && started.elapsed() < Duration::from_secs(20) {
                post(&mut conn, body.as_bytes());
                answered += 1;
            }
            answered
        });
        let mut conn = HttpConn::connect(kvlb.listen);
        let first = post(&mut conn, big.as_bytes());
        big_done.store(true, Relaxed);
        (small.join().unwrap(), first)
    });
    let (_, prompt_tokens) = decision(&first);
    assert!(small_answered > 0, "no small request answered meanwhile");

    // Once the replica is taken to hold what the big request was routed on, the chat of its
    // first 4096 messages matches all of its own blocks...
    let mut conn = HttpConn::connect(kvlb.listen);
    let probe = tiny_messages(MAX_MESSAGES);
    let held = support::wait_until(Duration::from_secs(5), || {
        decision(&post(&mut conn, probe.as_bytes())).0 == bound_tokens
    });
    assert!(
        held,
        "the first 4096 messages never matched {bound_tokens} tokens"
    );
    // ...and the big body again matches exactly those: it hashed no block past the bound.
    let (matched, _) = decision(&post(&mut conn, big.as_bytes()));
    eprintln!(
        "{small_answered} small requests answered during the big one; the big one: \
         {prompt_tokens} prompt tokens, a repeat matched {matched} ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        matched, bound_tokens,
        "the big body hashed more than its first {MAX_MESSAGES} messages"
    );

    assert!(
        prompt_tokens >= (big.len() / 4) as u64,
        "a prompt cut short stands for its whole body: {prompt_tokens} tokens"
    );

    let counted = support::wait_until(Duration::from_secs(5), || {
        kvlb.metric("kvlb_prompt_truncated_total", &["reason=\"messages\""]) == Some(2.0)
    });
    assert!(
        counted,
        "kvlb_prompt_truncated_total{{reason=\"messages\"}}: {:?}",
        kvlb.metric("kvlb_prompt_truncated_total", &["reason=\"messages\""])
    );
    // Logged once: the second one fell within the same 10 s.
    let said = kvlb.stderr();
    let lines: Vec<&str> = said
        .lines()
        .filter(|l| l.contains("kvlb_prompt_truncated_total"))
        .collect();
    assert_eq!(lines.len(), 1, "{said}");
    assert!(lines[0].contains("message bound (4096)"), "{said}");
    assert!(started.elapsed() < Duration::from_secs(28));
}

/// Blocks of a request routing learns (`residency::MAX_ROUTED_BLOCKS`), 64 tokens each.
const ROUTED_TOKENS: u64 = 2048 * 64;

/// A prompt past the routed blocks: routed on them, its whole length estimated, no bound
/// counted.
#[test]
fn a_prompt_past_the_routed_blocks_reports_its_length_and_is_not_cut_short() {
    let backend = Backend::start();
    let kvlb = Kvlb::serve(&["--workers", "1", "--explain", "--replica", &backend.url()]);
    // 800 KB of prose in one message (about 200k tokens, 3,125 blocks), then a second body
    // that shares its first 700 KB and differs after.
    let prose = "plain words of a long prompt, ".repeat(800_000 / 30);
    let chat = |content: &str| {
        format!(r#"{{"messages":[{{"role":"system","content":"{content}"}}],"model":"{MODEL}"}}"#)
    };
    let long = chat(&prose);
    let other = chat(&format!(
        "{}{}",
        &prose[..700_000],
        "another tail ".repeat(8_000)
    ));
    let exact = (prose.len() / 4) as u64;
    let mut conn = HttpConn::connect(kvlb.listen);
    let (_, prompt_tokens) = decision(&post(&mut conn, long.as_bytes()));
    assert!(
        prompt_tokens.abs_diff(exact) * 100 < exact * 3,
        "prompt_tokens={prompt_tokens}, the prompt holds about {exact}"
    );
    // Routed on its first blocks: a repeat matches them all, and the body that shares them.
    let held = support::wait_until(Duration::from_secs(5), || {
        decision(&post(&mut conn, long.as_bytes())).0 == ROUTED_TOKENS
    });
    assert!(held, "a repeat never matched {ROUTED_TOKENS} tokens");
    let (matched, other_tokens) = decision(&post(&mut conn, other.as_bytes()));
    assert_eq!(matched, ROUTED_TOKENS);
    assert!(
        other_tokens.abs_diff(exact) * 100 < exact * 3,
        "{other_tokens}"
    );
    let truncated = kvlb.metric("kvlb_prompt_truncated_total", &[]);
    assert_eq!(truncated.unwrap_or(0.0), 0.0, "kvlb_prompt_truncated_total");
    assert!(
        !kvlb.stderr().contains("kvlb_prompt_truncated_total"),
        "{}",
        kvlb.stderr()
    );
}
