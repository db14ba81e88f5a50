//! Block hashes of requests: equal prompts hash equal, next turns extend, token mode matches KV
//! event hashing, and the warm path keeps its buffers.

#![forbid(unsafe_code)]

use super::*;
use crate::prompt::extract_prompt;
use crate::prompt::tests::conversation;
use xxhash_rust::xxh3::xxh3_64_with_seed;

const CHAT: &[u8] = b"/v1/chat/completions";
const COMPLETIONS: &[u8] = b"/v1/completions";

fn hashes(path: &[u8], body: &str) -> PrefixHashes {
    let cfg = PrefixConfig::default();
    let mut out = PrefixHashes::new(&cfg);
    hash_request(path, body.as_bytes(), &cfg, &mut out).unwrap_or_else(|e| panic!("{body}: {e}"));
    out
}

/// The canonical text of a chat body, for comparing with the hashes.
fn canonical(body: &str) -> Vec<u8> {
    let mut text = Vec::new();
    extract_prompt(
        Endpoint::ChatCompletions,
        body.as_bytes(),
        &mut |p: Piece<'_>| {
            if let Piece::Text(b) = p {
                text.extend_from_slice(b)
            }
        },
    )
    .unwrap();
    text
}

/// A chat body whose one user message is `content` (a JSON string body, already escaped).
fn chat_with(content: &str) -> String {
    format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}]}}"#)
}

#[test]
fn text_mode_hashes_full_blocks_of_the_canonical_bytes() {
    let body = conversation(6);
    let out = hashes(CHAT, &body);
    let text = canonical(&body);
    assert_eq!(out.mode, PrefixMode::Text);
    assert_eq!(out.block_units, BLOCK_BYTES as u32);
    assert_eq!(out.total_units, text.len());
    assert_eq!(out.est_prompt_tokens as usize, text.len() / 4);
    assert_eq!(out.hashes.len(), text.len() / BLOCK_BYTES);
    let mut expected = Vec::new();
    text_block_hashes(&text, &mut expected);
    assert_eq!(out.hashes, expected);
    // The chain: each hash depends on its parent.
    assert_eq!(
        out.hashes[0],
        chain_hash(TEXT_CHAIN_ROOT, &text[..BLOCK_BYTES])
    );
    assert_eq!(
        out.hashes[1],
        chain_hash(out.hashes[0], &text[BLOCK_BYTES..2 * BLOCK_BYTES])
    );
}

#[test]
fn short_prompts_have_no_full_block() {
    let out = hashes(CHAT, &chat_with("hi"));
    assert!(out.hashes.is_empty());
    assert_eq!(out.total_units, "\0model\0m\0role:user\0hi".len());
}

#[test]
fn escapes_hash_equal_at_every_block_position() {
    // Shift the escaped character across block boundaries.
    for pad in 0..(BLOCK_BYTES + 8) {
        let filler = "a".repeat(pad);
        let tail = "z".repeat(600);
        let literal = hashes(CHAT, &chat_with(&format!("{filler}é😀\\n{tail}")));
        let escaped = hashes(
            CHAT,
            &chat_with(&format!("{filler}\\u00e9\\ud83d\\ude00\\u000a{tail}")),
        );
        assert_eq!(literal.hashes, escaped.hashes, "pad {pad}");
        assert_eq!(literal.total_units, escaped.total_units);
        assert!(literal.hashes.len() >= 2);
    }
}

#[test]
fn key_order_and_whitespace_hash_equal() {
    let long = "w".repeat(700);
    let a = format!(
        r#"{{"model":"m","cache_salt":"s","messages":[{{"role":"user","content":"{long}"}}]}}"#
    );
    let b = format!(
        "{{ \"messages\" : [ {{ \"content\" : \"{long}\" , \"role\" : \"user\" }} ] ,\n\"cache_salt\":\"s\", \"model\" : \"m\" }}"
    );
    let ha = hashes(CHAT, &a);
    assert_eq!(ha.hashes.len(), 2);
    assert_eq!(ha.hashes, hashes(CHAT, &b).hashes);
}

#[test]
fn model_and_salt_isolate_from_the_first_block() {
    let long = "w".repeat(700);
    let body =
        |head: &str| format!(r#"{{{head}"messages":[{{"role":"user","content":"{long}"}}]}}"#);
    let base = hashes(CHAT, &body(r#""model":"m","#));
    let other_model = hashes(CHAT, &body(r#""model":"n","#));
    let salted = hashes(CHAT, &body(r#""model":"m","cache_salt":"a","#));
    let salted_b = hashes(CHAT, &body(r#""model":"m","cache_salt":"b","#));
    for other in [&other_model, &salted, &salted_b] {
        assert_ne!(base.hashes[0], other.hashes[0]);
    }
    assert_ne!(salted.hashes[0], salted_b.hashes[0]);
    // Chained: no later block can coincide either.
    for i in 0..base.hashes.len() {
        assert_ne!(base.hashes[i], other_model.hashes[i]);
    }
}

#[test]
fn next_turn_hashes_extend_the_previous_turn() {
    let mut longest = 0;
    for turn in 1..14 {
        let now = hashes(CHAT, &conversation(turn));
        let next = hashes(CHAT, &conversation(turn + 1));
        assert!(
            next.hashes.starts_with(&now.hashes),
            "turn {turn}: {} then {} hashes",
            now.hashes.len(),
            next.hashes.len()
        );
        longest = next.hashes.len();
    }
    assert!(
        longest > 8,
        "the conversation spans several blocks: {longest}"
    );
}

#[test]
fn completion_forms_hash() {
    let long = "p".repeat(1000);
    let one = hashes(
        COMPLETIONS,
        &format!(r#"{{"model":"m","prompt":"{long}"}}"#),
    );
    let listed = hashes(
        COMPLETIONS,
        &format!(r#"{{"prompt":["{long}"],"model":"m"}}"#),
    );
    assert_eq!(one.mode, PrefixMode::Text);
    assert_eq!(one.hashes.len(), 3);
    assert_eq!(one.hashes, listed.hashes);
    let two = hashes(
        COMPLETIONS,
        &format!(r#"{{"prompt":["{long}","q"],"model":"m"}}"#),
    );
    assert!(two.total_units > one.total_units);
}

#[test]
fn token_mode_equals_token_block_hashes() {
    let ids: Vec<u32> = (0..1000u32)
        .map(|i| i.wrapping_mul(2_654_435_761) >> 8)
        .collect();
    let list = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    for (body, want) in [
        (format!(r#"{{"model":"m","prompt":[{list}]}}"#), &ids[..]),
        (
            format!(r#"{{"prompt":[[{list}],[1,2]],"model":"x"}}"#),
            &ids[..],
        ),
        (
            format!(r#"{{"prompt":[{}]}}"#, "7,".repeat(40) + "7"),
            &[7u32; 41][..],
        ),
    ] {
        let out = hashes(COMPLETIONS, &body);
        assert_eq!(out.mode, PrefixMode::Tokens);
        assert_eq!(out.block_units, DEFAULT_TOKEN_BLOCK);
        assert_eq!(out.total_units, want.len());
        assert_eq!(out.est_prompt_tokens as usize, want.len());
        let mut expected = Vec::new();
        token_block_hashes(want, DEFAULT_TOKEN_BLOCK as usize, &mut expected);
        assert_eq!(expected.len(), want.len() / 16);
        assert_eq!(out.hashes, expected);
    }
    // Other block sizes too, including blocks longer than a text block.
    for block in [1u32, 7, 16, 64, 100, MAX_TOKEN_BLOCK] {
        let cfg = PrefixConfig {
            token_block_size: block,
            ..PrefixConfig::default()
        };
        let mut out = PrefixHashes::new(&cfg);
        let body = format!(r#"{{"model":"m","prompt":[{list}]}}"#);
        hash_request(COMPLETIONS, body.as_bytes(), &cfg, &mut out).unwrap();
        let mut expected = Vec::new();
        token_block_hashes(&ids, block as usize, &mut expected);
        assert_eq!(out.hashes, expected, "block {block}");
        assert_eq!(out.block_units, block);
    }
}

#[test]
fn token_hash_chains_continue_across_events() {
    let ids: Vec<u32> = (1..=64).collect();
    let mut whole = Vec::new();
    token_block_hashes(&ids, 16, &mut whole);
    // A KV event for blocks 3..4 whose parent is block 2.
    let mut first = Vec::new();
    token_block_hashes(&ids[..32], 16, &mut first);
    let mut rest = Vec::new();
    token_block_hashes_from(*first.last().unwrap(), &ids[32..], 16, &mut rest);
    first.extend_from_slice(&rest);
    assert_eq!(first, whole);
    // The first block of tokens 1..16, little-endian u32s, from the token root.
    let bytes: Vec<u8> = (1..=16u32).flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(
        whole[0],
        xxh3_64_with_seed(&xxh3_64(&bytes).to_le_bytes(), TOKEN_CHAIN_ROOT)
    );
    // Nonsense block sizes give nothing rather than a panic.
    let mut none = Vec::new();
    token_block_hashes(&ids, 0, &mut none);
    token_block_hashes(&ids, MAX_TOKEN_BLOCK as usize + 1, &mut none);
    assert!(none.is_empty());
}

#[test]
fn block_cap_limits_hashes_not_length() {
    let cfg = PrefixConfig {
        max_blocks: 3,
        ..PrefixConfig::default()
    };
    let mut out = PrefixHashes::new(&cfg);
    let body = chat_with(&"c".repeat(5000));
    hash_request(CHAT, body.as_bytes(), &cfg, &mut out).unwrap();
    assert_eq!(out.hashes.len(), 3);
    let full = hashes(CHAT, &body);
    assert_eq!(out.hashes[..], full.hashes[..3]);
    assert_eq!(out.total_units, full.total_units);
    let ids = (0..100)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    hash_request(
        COMPLETIONS,
        format!(r#"{{"prompt":[{ids}]}}"#).as_bytes(),
        &cfg,
        &mut out,
    )
    .unwrap();
    assert_eq!(out.hashes.len(), 3);
    assert_eq!(out.total_units, 100);
}

#[test]
fn errors_clear_the_output() {
    let cfg = PrefixConfig::default();
    let mut out = PrefixHashes::new(&cfg);
    let good = conversation(5);
    hash_request(CHAT, good.as_bytes(), &cfg, &mut out).unwrap();
    assert!(!out.hashes.is_empty());
    assert_eq!(
        hash_request(b"/v1/models", good.as_bytes(), &cfg, &mut out),
        Err(PromptError::NotAPromptPath)
    );
    assert!(out.hashes.is_empty());
    hash_request(CHAT, good.as_bytes(), &cfg, &mut out).unwrap();
    let cut = &good.as_bytes()[..good.len() - 3];
    assert_eq!(
        hash_request(CHAT, cut, &cfg, &mut out),
        Err(PromptError::Truncated)
    );
    assert!(out.hashes.is_empty());
    assert_eq!(out.total_units, 0);
}

#[test]
fn warm_requests_keep_their_buffers() {
    let cfg = PrefixConfig::default();
    let mut out = PrefixHashes::new(&cfg);
    let bodies = [
        (CHAT, conversation(12)),
        (CHAT, chat_with(&"x".repeat(2_000_000))), // over the block cap
        (
            COMPLETIONS,
            format!(r#"{{"prompt":[{}]}}"#, vec!["1"; 100_000].join(",")),
        ),
        (CHAT, "{\"messages\":[".to_string()),
    ];
    for (path, body) in &bodies {
        let _ = hash_request(path, body.as_bytes(), &cfg, &mut out);
    }
    let capacity = out.hashes.capacity();
    let block = out.block.as_ptr();
    for i in 0..1000 {
        let (path, body) = &bodies[i % bodies.len()];
        let _ = hash_request(path, body.as_bytes(), &cfg, &mut out);
        assert_eq!(out.hashes.capacity(), capacity);
        assert_eq!(out.block.as_ptr(), block);
    }
    assert_eq!(capacity, MAX_BLOCKS);
}

#[test]
fn config_is_validated() {
    assert!(PrefixConfig::default().validate().is_ok());
    let bad = PrefixConfig {
        token_block_size: 0,
        ..PrefixConfig::default()
    };
    assert!(bad.validate().unwrap_err().contains("token_block_size = 0"));
    let bad = PrefixConfig {
        max_blocks: 0,
        ..PrefixConfig::default()
    };
    assert!(bad.validate().unwrap_err().contains("max_blocks = 0"));
    let bad = PrefixConfig {
        text_blocks: 0,
        ..PrefixConfig::default()
    };
    assert!(bad.validate().unwrap_err().contains("text_blocks = 0"));
    // Unvalidated nonsense still does not panic.
    let cfg = PrefixConfig {
        token_block_size: u32::MAX,
        max_blocks: 0,
        text_blocks: 0,
    };
    let mut out = PrefixHashes::new(&cfg);
    hash_request(COMPLETIONS, br#"{"prompt":[1,2,3]}"#, &cfg, &mut out).unwrap();
    assert!(out.hashes.is_empty());
}

#[test]
fn hashes_equal_the_two_pass_reference_chained_with_xxh3() {
    use crate::prompt::tests::{random_body, reference_extract_prompt, Rng};
    use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};
    let cfg = PrefixConfig::default();
    let mut out = PrefixHashes::new(&cfg);
    let mut rng = Rng(0x005E_ED0F_B10C_4A5E);
    let mut bodies: Vec<String> = (0..3000).map(|_| random_body(&mut rng)).collect();
    bodies.extend((1..40).map(conversation));
    let mut compared = 0;
    for body in &bodies {
        for path in [CHAT, COMPLETIONS] {
            let endpoint = Endpoint::from_path(path).unwrap();
            let mut canonical = Vec::new();
            let mut tokens = false;
            let reference =
                reference_extract_prompt(endpoint, body.as_bytes(), &mut |p: Piece<'_>| match p {
                    Piece::Text(b) => canonical.extend_from_slice(b),
                    Piece::Token(_) => tokens = true,
                });
            let result = hash_request(path, body.as_bytes(), &cfg, &mut out);
            assert_eq!(result.map(|_| ()), reference.map(|_| ()), "{body}");
            if result.is_err() || tokens {
                continue;
            }
            let mut parent = TEXT_CHAIN_ROOT;
            let expect: Vec<u64> = canonical
                .chunks_exact(BLOCK_BYTES)
                .map(|block| {
                    parent = xxh3_64_with_seed(&xxh3_64(block).to_le_bytes(), parent);
                    parent
                })
                .collect();
            assert_eq!(out.hashes, expect, "{body}");
            assert_eq!(out.total_units, canonical.len());
            compared += 1;
        }
    }
    assert!(compared > 1000, "{compared} bodies hashed");
}

/// `n` messages `{"role":"user","content":"a"}`, `model` after them (as the OpenAI Python
/// client orders its body).
fn tiny_messages(n: usize) -> String {
    let messages = vec![r#"{"role":"user","content":"a"}"#; n].join(",");
    format!(r#"{{"messages":[{messages}],"model":"Qwen/Qwen3-8B","stream":false}}"#)
}

#[test]
fn a_million_tiny_messages_hash_at_most_the_bound_in_bounded_work() {
    use crate::prompt::{extract_prompt_within, Bound, PromptLimits, DEFAULT_MAX_MESSAGES};
    let limits = PromptLimits::default();
    // Sized as `kvlb serve` sizes it: token-mode blocks of 16 tokens up to the token bound.
    let cfg = PrefixConfig {
        max_blocks: limits.max_tokens / DEFAULT_TOKEN_BLOCK as usize,
        ..PrefixConfig::default()
    };
    let body = tiny_messages(1_000_000);
    let mut out = PrefixHashes::new(&cfg);
    hash_request_within(CHAT, body.as_bytes(), &cfg, &limits, &mut out).unwrap();
    let bound_blocks = limits.max_tokens * 4 / BLOCK_BYTES;
    assert!(
        out.hashes.len() <= bound_blocks,
        "{} blocks hashed, bound {bound_blocks}",
        out.hashes.len()
    );
    // The blocks of the first messages, exactly: those the same chat cut at the bound hashes.
    let mut first = PrefixHashes::new(&cfg);
    let cut = tiny_messages(DEFAULT_MAX_MESSAGES);
    hash_request(CHAT, cut.as_bytes(), &cfg, &mut first).unwrap();
    assert_eq!(out.hashes.len(), first.hashes.len());
    assert_eq!(out.hashes, first.hashes);
    assert_eq!(out.extent, Extent::Prefix(Bound::Messages));
    assert!(out.est_prompt_tokens as usize >= body.len() / 4);

    // The work, counted: the pieces delivered, the messages read and how far into the
    // messages the pieces come from (the rest of the array is only crossed by the structural
    // skim, to the model after it).
    let mut scratch = PromptScratch::new(RECORDED_PIECES);
    let (mut pieces, mut text) = (0usize, Vec::new());
    let mut reach = 0usize;
    let start = body.as_ptr() as usize;
    let end = start + body.find(r#"],"model""#).unwrap();
    extract_prompt_within(
        Endpoint::ChatCompletions,
        body.as_bytes(),
        &mut scratch,
        &limits,
        &mut |p: Piece<'_>| {
            if let Piece::Text(b) = p {
                pieces += 1;
                text.extend_from_slice(b);
                let at = b.as_ptr() as usize;
                if (start..end).contains(&at) {
                    reach = reach.max(at + b.len() - start);
                }
            }
        },
    )
    .unwrap();
    let messages = text.windows(6).filter(|w| w == b"\0role:").count();
    assert_eq!(messages, DEFAULT_MAX_MESSAGES);
    assert!(pieces <= 4 * DEFAULT_MAX_MESSAGES + 8, "{pieces} pieces");
    assert!(
        reach <= cut.len(),
        "pieces from byte {reach} of {}",
        body.len()
    );
    assert!(text.ends_with(b"\0role:user\0a"));
}

#[test]
fn text_blocks_stop_exactly_at_the_token_bound() {
    use crate::prompt::{Bound, PromptLimits};
    let cfg = PrefixConfig::default();
    let limits = PromptLimits::for_tokens(1000);
    let mut out = PrefixHashes::new(&cfg);
    let many = vec![r#"{"role":"user","content":"a few words"}"#; 500].join(",");
    for body in [
        chat_with(&"plain words ".repeat(2000)),
        chat_with(&"line\\n".repeat(4000)),
        format!(r#"{{"messages":[{many}],"model":"m"}}"#),
    ] {
        let whole = hashes(CHAT, &body);
        hash_request_within(CHAT, body.as_bytes(), &cfg, &limits, &mut out).unwrap();
        assert_eq!(out.extent, Extent::Prefix(Bound::Tokens), "{body:.80}");
        assert_eq!(
            out.hashes[..],
            whole.hashes[..1000 * 4 / BLOCK_BYTES],
            "{body:.80}"
        );
        assert!(out.est_prompt_tokens as usize >= body.len() / 4);
    }
    // Under the bound, as without it.
    let body = chat_with(&"plain words ".repeat(300));
    hash_request_within(CHAT, body.as_bytes(), &cfg, &limits, &mut out).unwrap();
    assert_eq!(out.extent, Extent::Whole);
    assert_eq!(out.hashes, hashes(CHAT, &body).hashes);
}

/// A token-id prompt under an adapter or a salt chains from their root, wherever `model` and
/// `cache_salt` sit in the body; the base model without a salt keeps the plain root. A model
/// is an adapter only once its name is known.
#[test]
fn adapter_and_salt_root_token_prompts() {
    let cfg = PrefixConfig::default();
    let ids: Vec<u32> = (0..64).collect();
    let list = format!("{ids:?}").replace(' ', "");
    let adapters = Arc::new(AdapterNames::new());
    let mut out = PrefixHashes::new(&cfg);
    out.set_adapters(adapters.clone());
    let mut run = |body: String| {
        hash_request(COMPLETIONS, body.as_bytes(), &cfg, &mut out).unwrap();
        assert_eq!(out.mode, PrefixMode::Tokens);
        out.hashes.clone()
    };
    let want = |lora: Option<&str>, salt: Option<&str>| {
        let root = token_root(
            lora.map(|l| name_hash(l.as_bytes())),
            salt.map(|s| name_hash(s.as_bytes())),
        );
        let mut h = Vec::new();
        token_block_hashes_from(root, &ids, 16, &mut h);
        h
    };
    let plain = want(None, None);
    let mut base = Vec::new();
    token_block_hashes(&ids, 16, &mut base);
    assert_eq!(plain, base, "the base model's root is the plain one");
    assert_eq!(run(format!(r#"{{"model":"sql","prompt":{list}}}"#)), plain);
    adapters.insert(b"sql");
    assert_eq!(
        run(format!(r#"{{"model":"sql","prompt":{list}}}"#)),
        want(Some("sql"), None)
    );
    assert_eq!(
        run(format!(r#"{{"prompt":{list},"model":"base:sql"}}"#)),
        want(Some("sql"), None),
        "SGLang's base:adapter, model after the prompt"
    );
    assert_eq!(
        run(format!(r#"{{"model":"other","prompt":{list}}}"#)),
        plain
    );
    assert_eq!(
        run(format!(
            r#"{{"prompt":{list},"cache_salt":"t\u0041","model":"m"}}"#
        )),
        want(None, Some("tA")),
        "the decoded salt"
    );
    assert_eq!(
        run(format!(
            r#"{{"model":"sql","cache_salt":"s","prompt":{list}}}"#
        )),
        want(Some("sql"), Some("s"))
    );
    assert_eq!(
        run(format!(
            r#"{{"model":"m","cache_salt":"","prompt":{list}}}"#
        )),
        plain
    );
    assert_eq!(
        run(format!(
            r#"{{"model":"base","lora_path":"chat","prompt":{list}}}"#
        )),
        want(Some("chat"), None),
        "SGLang's lora_path names an adapter, known or not"
    );
    assert_eq!(
        run(format!(
            r#"{{"model":"sql","lora_path":"chat","prompt":{list}}}"#
        )),
        want(Some("sql"), None),
        "model first, as SGLang resolves it"
    );
    assert_ne!(want(Some("s"), None), want(None, Some("s")), "tagged apart");
}

/// A chat body's adapter and salt give the root a tokenizer's ids are hashed from.
#[test]
fn chat_bodies_carry_their_token_root() {
    let cfg = PrefixConfig::default();
    let adapters = Arc::new(AdapterNames::new());
    adapters.insert(b"sql");
    let mut out = PrefixHashes::new(&cfg);
    out.set_adapters(adapters);
    let body = r#"{"messages":[{"role":"user","content":"hi"}],"model":"sql","cache_salt":"s"}"#;
    hash_request(CHAT, body.as_bytes(), &cfg, &mut out).unwrap();
    assert_eq!(out.mode, PrefixMode::Text);
    assert_eq!(
        out.token_root,
        token_root(Some(name_hash(b"sql")), Some(name_hash(b"s")))
    );
    let body = r#"{"messages":[{"role":"user","content":"hi"}],"model":"base"}"#;
    hash_request(CHAT, body.as_bytes(), &cfg, &mut out).unwrap();
    assert_eq!(out.token_root, TOKEN_CHAIN_ROOT);
}

/// A text prompt longer than the blocks routing learns is hashed up to them and measured past
/// them: the same first blocks as reading it whole, about its whole length, no bound reported.
#[test]
fn text_past_the_routed_blocks_is_measured_not_read() {
    use crate::prompt::{Bound, PromptLimits};
    let limits = PromptLimits::default();
    let cfg = PrefixConfig {
        max_blocks: limits.max_tokens / DEFAULT_TOKEN_BLOCK as usize,
        ..PrefixConfig::default()
    };
    let all = PrefixConfig {
        text_blocks: usize::MAX,
        ..cfg
    };
    let turn = |i: usize, words: usize| {
        let role = ["user", "assistant"][i % 2];
        let text =
            format!("turn {i}: plain words and a line\\n with \\\"quotes\\\" ").repeat(words);
        format!(r#"{{"role":"{role}","content":"{text}"}}"#)
    };
    // One message past the routed blocks; many messages, past the recording space too.
    let one = chat_with(&"plain words, a line\\n ".repeat(40_000));
    let many = (0..40).map(|i| turn(i, 500)).collect::<Vec<_>>().join(",");
    let many = format!(r#"{{"messages":[{many}],"model":"Qwen/Qwen3-8B","max_tokens":64}}"#);
    let mut out = PrefixHashes::new(&cfg);
    let mut whole = PrefixHashes::new(&all);
    for body in [one, many] {
        hash_request_within(CHAT, body.as_bytes(), &all, &limits, &mut whole).unwrap();
        assert!(
            whole.hashes.len() > MAX_ROUTED_BLOCKS,
            "{}",
            whole.hashes.len()
        );
        assert!(!whole.tail_estimated);
        hash_request_within(CHAT, body.as_bytes(), &cfg, &limits, &mut out).unwrap();
        assert_eq!(out.extent, Extent::Whole);
        assert!(out.tail_estimated);
        assert_eq!(out.hashes[..], whole.hashes[..MAX_ROUTED_BLOCKS]);
        assert_eq!(out.mode, PrefixMode::Text);
        // Within 3% of the length read whole, and never under it by more than the estimate's
        // 4 bytes a token allows.
        let (est, exact) = (out.est_prompt_tokens as f64, whole.est_prompt_tokens as f64);
        assert!((est / exact - 1.0).abs() < 0.03, "{est} against {exact}");
        assert_eq!(out.total_units / 4, out.est_prompt_tokens as usize);
        // Unbounded, the same.
        hash_request(CHAT, body.as_bytes(), &cfg, &mut out).unwrap();
        assert_eq!((out.extent, out.tail_estimated), (Extent::Whole, true));
        assert_eq!(out.hashes[..], whole.hashes[..MAX_ROUTED_BLOCKS]);
        // Past max_tokens by that estimate: cut short by the token bound, as when read.
        let short = PromptLimits::for_tokens(MAX_ROUTED_BLOCKS * BLOCK_BYTES / 4 + 1000);
        hash_request_within(CHAT, body.as_bytes(), &cfg, &short, &mut out).unwrap();
        assert_eq!(out.extent, Extent::Prefix(Bound::Tokens));
        assert_eq!(out.hashes[..], whole.hashes[..MAX_ROUTED_BLOCKS]);
    }
    // Up to the routed blocks, as read whole.
    let body = chat_with(&"plain words ".repeat(40_000));
    hash_request_within(CHAT, body.as_bytes(), &cfg, &limits, &mut out).unwrap();
    hash_request_within(CHAT, body.as_bytes(), &all, &limits, &mut whole).unwrap();
    assert!(whole.hashes.len() < MAX_ROUTED_BLOCKS);
    assert_eq!((out.extent, out.tail_estimated), (Extent::Whole, false));
    assert_eq!(out.hashes, whole.hashes);
    assert_eq!(out.est_prompt_tokens, whole.est_prompt_tokens);
    // Token-id prompts are hashed past them (KV events name every block).
    let ids = vec!["7"; (MAX_ROUTED_BLOCKS + 10) * DEFAULT_TOKEN_BLOCK as usize].join(",");
    let body = format!(r#"{{"model":"m","prompt":[{ids}]}}"#);
    hash_request_within(COMPLETIONS, body.as_bytes(), &cfg, &limits, &mut out).unwrap();
    assert_eq!(out.hashes.len(), MAX_ROUTED_BLOCKS + 10);
    assert!(!out.tail_estimated);
}
