#![forbid(unsafe_code)]

use super::fixture::{chatml_config_json, chatml_tokenizer_json};
use super::*;

fn chatml() -> ChatTokenizer {
    ChatTokenizer::from_parts(
        chatml_tokenizer_json(600).as_bytes(),
        Some(&chatml_config_json()),
        None,
    )
    .unwrap()
}

/// A small deterministic generator (tests take their randomness as a seed).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn text(&mut self, words: usize) -> String {
        const WORDS: [&str; 16] = [
            "the",
            " cat",
            "  learned",
            "\n",
            "Rust",
            "{\"a\": 1}",
            " 42",
            "é",
            "日本",
            " <|im_end|>",
            "\t",
            "weather",
            "<|im_start|>",
            "?!",
            "  ",
            "fahrenheit",
        ];
        (0..words)
            .map(|_| WORDS[self.next() as usize % WORDS.len()])
            .collect()
    }
}

fn random_body(rng: &mut Lcg) -> String {
    let mut messages = vec![serde_json::json!({"role": "system", "content": rng.text(30)})];
    for i in 0..(1 + rng.next() % 5) {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let words = 1 + rng.next() as usize % 20;
        messages.push(serde_json::json!({"role": role, "content": rng.text(words)}));
    }
    let mut body = serde_json::json!({"model": "m", "messages": messages});
    if rng.next().is_multiple_of(2) {
        body["tools"] = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": rng.text(5), "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    }
    body.to_string()
}

#[test]
fn segment_wise_equals_whole_encoding_on_random_conversations() {
    let t = chatml();
    assert!(t.segment_wise(), "a byte-level BPE splits on added tokens");
    let mut cache = SegmentCache::new(64, 4096);
    let mut rng = Lcg(7);
    let mut ids = Vec::new();
    for _ in 0..300 {
        let body = random_body(&mut rng);
        let whole = t.chat_tokens_whole(body.as_bytes()).unwrap();
        assert!(t
            .request_tokens(
                b"/v1/chat/completions",
                body.as_bytes(),
                &mut cache,
                &mut ids
            )
            .unwrap());
        assert_eq!(ids, whole, "{body}");
        // A second time, from the cache.
        t.request_tokens(
            b"/v1/chat/completions",
            body.as_bytes(),
            &mut cache,
            &mut ids,
        )
        .unwrap();
        assert_eq!(ids, whole, "{body}");
    }
    assert!(cache.len() <= 64 && cache.tokens() <= 4096);
}

#[test]
fn completions_text_is_framed_as_the_tokenizer_frames_it() {
    let t = chatml();
    let mut cache = SegmentCache::new(64, 4096);
    let mut ids = Vec::new();
    let body = br#"{"prompt": "The quick <|im_end|> brown fox", "max_tokens": 3}"#;
    assert!(t
        .request_tokens(b"/v1/completions", body, &mut cache, &mut ids)
        .unwrap());
    assert_eq!(
        ids,
        t.completion_tokens_whole("The quick <|im_end|> brown fox")
            .unwrap()
    );
    // Token ids are left to prefix::hash_request.
    assert!(!t
        .request_tokens(
            b"/v1/completions",
            br#"{"prompt": [1, 2]}"#,
            &mut cache,
            &mut ids
        )
        .unwrap());
    assert!(!t
        .request_tokens(b"/v1/models", b"{}", &mut cache, &mut ids)
        .unwrap());
}

#[test]
fn a_warm_system_prompt_is_served_from_the_cache() {
    let t = chatml();
    let mut cache = SegmentCache::new(1024, 1 << 20);
    let mut ids = Vec::new();
    let system = "You are a helpful assistant. ".repeat(50);
    let body = |user: &str| {
        serde_json::json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
            .to_string()
    };
    t.request_tokens(
        b"/v1/chat/completions",
        body("first").as_bytes(),
        &mut cache,
        &mut ids,
    )
    .unwrap();
    let held = cache.len();
    let misses = SEGMENT_MISSES.load(Relaxed);
    t.request_tokens(
        b"/v1/chat/completions",
        body("second question").as_bytes(),
        &mut cache,
        &mut ids,
    )
    .unwrap();
    // Only the new user turn was encoded (other tests may count in parallel: at least 1).
    assert!(SEGMENT_MISSES.load(Relaxed) > misses);
    assert_eq!(cache.len(), held + 1);
    assert_eq!(
        ids,
        t.chat_tokens_whole(body("second question").as_bytes())
            .unwrap()
    );
}

#[test]
fn template_errors_and_bad_bodies_are_errors_not_panics() {
    let t = chatml();
    let mut cache = SegmentCache::new(8, 1024);
    let mut ids = Vec::new();
    for body in [
        &b"not json"[..],
        br#"{"messages": 5}"#,
        br#"{"messages": [{"role": "wizard", "content": "x"}]}"#,
        br#"{"prompt": {"a": 1}}"#,
    ] {
        let path: &[u8] = if body.starts_with(br#"{"prompt"#) {
            b"/v1/completions"
        } else {
            b"/v1/chat/completions"
        };
        assert!(t.request_tokens(path, body, &mut cache, &mut ids).is_err());
    }
    let e = t
        .request_tokens(
            b"/v1/chat/completions",
            br#"{"messages": [{"role": "wizard", "content": "x"}]}"#,
            &mut cache,
            &mut ids,
        )
        .unwrap_err();
    assert!(e.to_string().contains("unknown role wizard"), "{e}");
}

#[test]
fn content_parts_are_joined_with_newlines() {
    let t = chatml();
    let parts = br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]}]}"#;
    let plain = br#"{"messages": [{"role": "user", "content": "a\nb"}]}"#;
    assert_eq!(t.render_chat(parts).unwrap(), t.render_chat(plain).unwrap());
}

#[test]
fn tojson_is_pythons_json_dumps() {
    let mut env = Environment::new();
    env.add_filter("tojson", tojson);
    // Raw JSON text: serde_json's own map would sort the keys before the filter sees them.
    let render = |src: &str, v: &str| {
        let value: Value = serde_json::from_str(v).unwrap();
        env.render_str(src, minijinja::context! { v => value })
            .unwrap()
    };
    let v = r#"{"z": [1, 2.5, "é<>"], "a": {}, "b": [], "c": null, "d": true}"#;
    assert_eq!(
        render("{{ v | tojson }}", v),
        r#"{"z": [1, 2.5, "é<>"], "a": {}, "b": [], "c": null, "d": true}"#
    );
    assert_eq!(
        render("{{ v | tojson(indent=2) }}", r#"{"a": [1], "b": {}}"#),
        "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}"
    );
    assert_eq!(
        render(
            "{{ v | tojson(ensure_ascii=true, sort_keys=true) }}",
            r#"{"b": "é", "a": 1}"#
        ),
        r#"{"a": 1, "b": "\u00e9"}"#
    );
    assert_eq!(
        render(
            "{{ v | tojson(separators=[',', ':']) }}",
            r#"{"a": [1, 2]}"#
        ),
        r#"{"a":[1,2]}"#
    );
}

#[test]
fn strftime_covers_what_templates_ask_for() {
    // 2024-07-26 13:05:09 UTC.
    assert_eq!(format_utc("%d %b %Y", 1_722_000_309), "26 Jul 2024");
    assert_eq!(
        format_utc("%Y-%m-%d %H:%M:%S %B %%", 1_722_000_309),
        "2024-07-26 13:25:09 July %"
    );
}

#[test]
fn metaspace_first_tokenizers_are_encoded_whole() {
    let json = chatml_tokenizer_json(600);
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v["pre_tokenizer"] = serde_json::json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true});
    v["decoder"] = serde_json::Value::Null;
    v["post_processor"] = serde_json::Value::Null;
    let t = ChatTokenizer::from_parts(v.to_string().as_bytes(), Some(&chatml_config_json()), None)
        .unwrap();
    assert!(!t.segment_wise());
    let mut cache = SegmentCache::new(8, 1024);
    let mut ids = Vec::new();
    let body = br#"{"messages": [{"role": "user", "content": "hello world"}]}"#;
    t.request_tokens(b"/v1/chat/completions", body, &mut cache, &mut ids)
        .unwrap();
    assert_eq!(ids, t.chat_tokens_whole(body).unwrap());
    assert!(cache.is_empty());
}

#[test]
fn bad_files_say_what_is_wrong() {
    let e = ChatTokenizer::from_parts(b"{}", None, None).unwrap_err();
    assert!(e.contains("tokenizer.json"), "{e}");
    let json = chatml_tokenizer_json(300);
    let e = ChatTokenizer::from_parts(json.as_bytes(), Some("[1]"), None).unwrap_err();
    assert!(e.contains("tokenizer_config.json"), "{e}");
    let e = ChatTokenizer::from_parts(json.as_bytes(), None, Some("{% if %}")).unwrap_err();
    assert!(e.contains("chat template"), "{e}");
}

#[test]
fn fill_prefix_matches_kv_event_hashes() {
    let t = chatml();
    let body = br#"{"messages": [{"role": "system", "content": "You are a helpful assistant. Tell me a story about a cat who learned to code in Rust."}, {"role": "user", "content": "The quick brown fox"}]}"#;
    let ids = t.chat_tokens_whole(body).unwrap();
    let cfg = kvlb_core::prefix::PrefixConfig::default();
    let mut out = kvlb_core::prefix::PrefixHashes::new(&cfg);
    fill_prefix(&ids, &cfg, &mut out);
    let mut from_events = Vec::new();
    kvlb_core::prefix::token_block_hashes(&ids, 16, &mut from_events);
    assert!(!from_events.is_empty());
    assert_eq!(out.hashes, from_events);
    assert_eq!(out.total_units, ids.len());
    assert_eq!(out.mode, kvlb_core::prefix::PrefixMode::Tokens);
}

/// vLLM's chat parser runs before the template: tool call arguments given as JSON strings are
/// rendered as objects (Qwen-style `arguments | tojson`), a tool-call-only assistant message
/// has `""` content, invalid arguments become `{}`, reasoning is also `reasoning_content`, and
/// `continue_final_message` cuts the prompt right after the final message's text.
#[test]
fn chat_bodies_render_as_vllm_parses_them() {
    let t = chatml();
    let body = br#"{"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "20"}
    ]}"#;
    let text = t.render_chat(body).unwrap();
    assert!(
        text.contains(
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>"
        ),
        "{text}"
    );
    assert!(
        text.contains("{\"name\": \"get_weather\", \"arguments\": {}}"),
        "{text}"
    );
    // Arguments given as an object render the same as their JSON string.
    let object = br#"{"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "20"}
    ]}"#;
    assert_eq!(t.render_chat(object).unwrap(), text);

    // Tool-call-only content is "" (a template concatenating it does not fail), reasoning is
    // handed on as both names.
    let custom = ChatTokenizer::from_parts(
        chatml_tokenizer_json(600).as_bytes(),
        Some(&chatml_config_json()),
        Some("{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ m.reasoning_content }}|{{ m.reasoning }}|{{ m.extra }}]{% endfor %}{{ reasoning_effort }}/{{ enable_thinking }}/{{ continue_final_message }}"),
    )
    .unwrap();
    let text = custom
        .render_chat(br#"{"reasoning_effort": "low", "messages": [{"role": "assistant", "reasoning": "hmm", "extra": 1, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}"#)
        .unwrap();
    assert_eq!(text, "[assistant||hmm|hmm|]low/True/");

    // continue_final_message: the prompt ends right after the final message's text.
    let body = br#"{"add_generation_prompt": false, "continue_final_message": true, "messages": [
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": "Once upon a time"}
    ]}"#;
    let text = t.render_chat(body).unwrap();
    assert!(
        text.ends_with("<|im_start|>assistant\nOnce upon a time"),
        "{text:?}"
    );
    // Both at once is refused, as vLLM refuses it.
    let both =
        br#"{"continue_final_message": true, "messages": [{"role": "assistant", "content": "x"}]}"#;
    assert!(t.render_chat(both).is_err());
}
