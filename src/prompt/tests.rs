//! Canonical prefix of every body form of replica-interfaces.md section 3, and hostile bodies.

use super::*;

/// The canonical form of a body: its form, text bytes and token ids.
fn canon(endpoint: Endpoint, body: &str) -> Result<(PromptForm, Vec<u8>, Vec<u32>), PromptError> {
    canon_bytes(endpoint, body.as_bytes())
}

fn canon_bytes(
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(PromptForm, Vec<u8>, Vec<u32>), PromptError> {
    let mut text = Vec::new();
    let mut tokens = Vec::new();
    let form = extract_prompt(endpoint, body, &mut |p: Piece<'_>| match p {
        Piece::Text(b) => text.extend_from_slice(b),
        Piece::Token(t) => tokens.push(t),
    })?;
    Ok((form, text, tokens))
}

fn chat(body: &str) -> Vec<u8> {
    match canon(Endpoint::ChatCompletions, body) {
        Ok((PromptForm::Text, text, tokens)) => {
            assert!(tokens.is_empty());
            text
        }
        other => panic!("{body}: {other:?}"),
    }
}

fn completion(body: &str) -> Vec<u8> {
    match canon(Endpoint::Completions, body) {
        Ok((PromptForm::Text, text, _)) => text,
        other => panic!("{body}: {other:?}"),
    }
}

fn tokens(body: &str) -> Vec<u32> {
    match canon(Endpoint::Completions, body) {
        Ok((PromptForm::Tokens, text, tokens)) => {
            assert!(text.is_empty(), "token mode emits no text");
            tokens
        }
        other => panic!("{body}: {other:?}"),
    }
}

fn chat_err(body: &str) -> PromptError {
    canon(Endpoint::ChatCompletions, body).expect_err(body)
}

fn completion_err(body: &str) -> PromptError {
    canon(Endpoint::Completions, body).expect_err(body)
}

#[test]
fn paths_pick_the_endpoint() {
    assert_eq!(
        Endpoint::from_path(b"/v1/completions"),
        Some(Endpoint::Completions)
    );
    assert_eq!(
        Endpoint::from_path(b"/v1/chat/completions?x=1"),
        Some(Endpoint::ChatCompletions)
    );
    assert_eq!(Endpoint::from_path(b"/v1/models"), None);
    assert_eq!(Endpoint::from_path(b"/v1/completionsx"), None);
    assert_eq!(Endpoint::from_path(b""), None);
}

#[test]
fn completion_string_prompt() {
    assert_eq!(
        completion(r#"{"model":"m","prompt":"Hello","max_tokens":5,"stream":true}"#),
        b"\0model\0m\0prompt\0Hello"
    );
}

#[test]
fn completion_list_of_strings() {
    assert_eq!(
        completion(r#"{"model":"m","prompt":["a","b c"]}"#),
        b"\0model\0m\0prompt\0a\0prompt\0b c"
    );
    // One string in a list is the same prompt as the bare string.
    assert_eq!(
        completion(r#"{"model":"m","prompt":["abc"]}"#),
        completion(r#"{"model":"m","prompt":"abc"}"#)
    );
    assert_eq!(
        completion_err(r#"{"model":"m","prompt":["a",1]}"#),
        PromptError::WrongType("prompt[]")
    );
}

#[test]
fn completion_token_ids() {
    assert_eq!(tokens(r#"{"model":"m","prompt":[1,2,3]}"#), [1, 2, 3]);
    assert_eq!(
        tokens(r#"{"prompt":[0,4294967295],"model":"m"}"#),
        [0, u32::MAX]
    );
    // A list of lists: the first is the prompt.
    assert_eq!(tokens(r#"{"model":"m","prompt":[[5,6],[7]]}"#), [5, 6]);
    assert_eq!(tokens(r#"{"model":"m","prompt":[ [ 5 , 6 ] ]}"#), [5, 6]);
    // Model and salt do not enter token mode.
    assert_eq!(
        tokens(r#"{"model":"other","cache_salt":"s","prompt":[1,2,3]}"#),
        [1, 2, 3]
    );
    for bad in [
        r#"{"prompt":[-1]}"#,
        r#"{"prompt":[4294967296]}"#,
        r#"{"prompt":[1.5]}"#,
        r#"{"prompt":[1e3]}"#,
        r#"{"prompt":[1,"a"]}"#,
        r#"{"prompt":[1,[2]]}"#,
        r#"{"prompt":[[1],2]}"#,
        r#"{"prompt":[[1],[2,"x"]]}"#,
        r#"{"prompt":[true]}"#,
        r#"{"prompt":{}}"#,
        r#"{"prompt":5}"#,
    ] {
        assert!(
            matches!(
                completion_err(bad),
                PromptError::WrongType(_) | PromptError::Syntax { .. }
            ),
            "{bad}: {:?}",
            completion_err(bad)
        );
    }
    assert_eq!(completion_err(r#"{"prompt":[]}"#), PromptError::EmptyPrompt);
    assert_eq!(
        completion_err(r#"{"prompt":[[]]}"#),
        PromptError::EmptyPrompt
    );
    assert_eq!(
        completion_err(r#"{"prompt":null}"#),
        PromptError::MissingField("prompt")
    );
    assert_eq!(
        completion_err(r#"{"model":"m"}"#),
        PromptError::MissingField("prompt")
    );
}

#[test]
fn chat_string_content() {
    assert_eq!(
        chat(
            r#"{"model":"Qwen/Qwen3-8B","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"stream":true}"#
        ),
        b"\0model\0Qwen/Qwen3-8B\0role:system\0Be brief.\0role:user\0Hi"
    );
}

#[test]
fn chat_part_arrays() {
    let parts = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"one"},{"text":"two","type":"text"}]}]}"#,
    );
    assert_eq!(parts, b"\0model\0m\0role:user\0one\ntwo");
    // One text part is the same as string content.
    assert_eq!(
        chat(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#
        ),
        chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#)
    );
    // A part without a type is read by its payload.
    assert_eq!(
        chat(r#"{"model":"m","messages":[{"role":"user","content":[{"text":"hi"}]}]}"#),
        chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#)
    );
}

#[test]
fn chat_image_parts() {
    let with_image = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is this?"},{"type":"image_url","image_url":{"url":"https://x/cat.png","detail":"high"}},{"type":"text","text":"Be short."}]}]}"#,
    );
    assert_eq!(
        with_image,
        b"\0model\0m\0role:user\0What is this?\0image_url\0https://x/cat.png\0\nBe short."
    );
    // The URL may also be a bare string; the detail does not matter; key order does not.
    let bare = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is this?"},{"image_url":"https://x/cat.png","type":"image_url"},{"type":"text","text":"Be short."}]}]}"#,
    );
    assert_eq!(with_image, bare);
    let other = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/dog.png"}}]}]}"#,
    );
    assert!(other.ends_with(b"\0image_url\0https://x/dog.png\0"));
    // Other part types enter as canonical JSON.
    let audio = chat(
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio", "input_audio":{"data":"AAAA","format":"wav"}}]}]}"#,
    );
    assert!(audio.ends_with(
        b"\0part\0{\"type\":\"input_audio\",\"input_audio\":{\"data\":\"AAAA\",\"format\":\"wav\"}}"
    ));
    assert_eq!(
        chat_err(r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#),
        PromptError::MissingField("messages[].content[].image_url")
    );
    assert_eq!(
        chat_err(r#"{"messages":[{"role":"user","content":[{"type":"text","text":5}]}]}"#),
        PromptError::WrongType("messages[].content[].text")
    );
}

const TOOLS: &str = r#"[{"type":"function","function":{"name":"get_weather","description":"Weather in a city","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;

#[test]
fn chat_tools_are_canonical_json() {
    let body = format!(
        r#"{{"model":"m","tools":{TOOLS},"messages":[{{"role":"user","content":"Paris?"}}]}}"#
    );
    let text = chat(&body);
    let expected = format!("\0model\0m\0tools\0{TOOLS}\0role:user\0Paris?");
    assert_eq!(text, expected.as_bytes());
    // Whitespace and escaping do not matter.
    let spaced = TOOLS
        .replace(',', " ,\n  ")
        .replace(':', " : ")
        .replace("city", "c\\u0069ty");
    let body2 = format!(
        r#"{{ "messages":[{{"role":"user","content":"Paris?"}}], "tools" : {spaced} , "model":"m"}}"#
    );
    assert_eq!(chat(&body2), text);
    // No tools and null tools are the same; other tools differ.
    assert_eq!(
        chat(r#"{"model":"m","tools":null,"messages":[{"role":"user","content":"Paris?"}]}"#),
        chat(r#"{"model":"m","messages":[{"role":"user","content":"Paris?"}]}"#)
    );
    assert_ne!(
        chat(&body.replace("get_weather", "get_time")),
        text,
        "different tools, different prefix"
    );
    assert_eq!(
        chat_err(r#"{"model":"m","tools":{},"messages":[]}"#),
        PromptError::WrongType("tools")
    );
}

#[test]
fn chat_tool_calls_and_tool_messages() {
    let body = r#"{"model":"m","messages":[
        {"role":"user","content":"Weather in Paris?"},
        {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
        {"role":"tool","tool_call_id":"call_1","content":"18C"},
        {"role":"user","name":"ann","content":"Thanks"}]}"#;
    assert_eq!(
        chat(body),
        b"\0model\0m\0role:user\0Weather in Paris?\
          \0role:assistant\0\0tool_call\0get_weather\0{\"city\":\"Paris\"}\
          \0role:tool\x0018C\0tool_call_id\0call_1\
          \0role:user\0Thanks\0name\0ann"
    );
    // Field order inside messages, calls and functions does not matter; nor does the call id.
    let reordered = r#"{"messages":[
        {"content":"Weather in Paris?","role":"user"},
        {"tool_calls":[{"function":{"arguments":"{\"city\":\"Paris\"}","name":"get_weather"},"type":"function","id":"call_9"}],"role":"assistant"},
        {"content":"18C","tool_call_id":"call_1","role":"tool"},
        {"content":"Thanks","name":"ann","role":"user"}],"model":"m"}"#;
    assert_eq!(chat(reordered), chat(body));
    // Arguments given as a JSON object are canonicalised.
    let object_args = chat(
        r#"{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":{ "a" : 1 }}}]}]}"#,
    );
    assert_eq!(
        object_args,
        b"\0model\0m\0role:assistant\0\0tool_call\0f\0{\"a\":1}"
    );
    assert_eq!(
        chat_err(r#"{"messages":[{"role":"assistant","tool_calls":[{"id":"x"}]}]}"#),
        PromptError::MissingField("messages[].tool_calls[].function")
    );
    assert_eq!(
        chat_err(
            r#"{"messages":[{"role":"assistant","tool_calls":[{"function":{"arguments":"{}"}}]}]}"#
        ),
        PromptError::MissingField("messages[].tool_calls[].function.name")
    );
}

#[test]
fn cache_salt_and_model_isolate() {
    let base = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#);
    let salted =
        chat(r#"{"model":"m","cache_salt":"tenant-a","messages":[{"role":"user","content":"x"}]}"#);
    let salted_b =
        chat(r#"{"cache_salt":"tenant-b","model":"m","messages":[{"role":"user","content":"x"}]}"#);
    let other_model = chat(r#"{"model":"n","messages":[{"role":"user","content":"x"}]}"#);
    assert_eq!(salted, b"\0model\0m\0cache_salt\0tenant-a\0role:user\0x");
    assert_ne!(base, salted);
    assert_ne!(salted, salted_b);
    assert_ne!(base, other_model);
    // Different salts or models already differ in the first bytes, so in the first block.
    assert_ne!(salted[..28], salted_b[..28]);
    assert_eq!(
        chat(r#"{"model":"m","cache_salt":null,"messages":[{"role":"user","content":"x"}]}"#),
        base
    );
    // No model at all is allowed (the server's default model).
    assert_eq!(
        chat(r#"{"messages":[{"role":"user","content":"x"}]}"#),
        b"\0model\0\0role:user\0x"
    );
    assert_eq!(
        chat_err(r#"{"model":5,"messages":[]}"#),
        PromptError::WrongType("model")
    );
    assert_eq!(
        chat_err(r#"{"model":"m","cache_salt":[],"messages":[]}"#),
        PromptError::WrongType("cache_salt")
    );
}

#[test]
fn escapes_decode_to_the_same_text() {
    let literal =
        chat(r#"{"model":"m","messages":[{"role":"user","content":"café 😀 \"q\" a/b"}]}"#);
    let escaped = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"caf\u00e9 \ud83d\ude00 \"q\" a\/b"}]}"#,
    );
    let upper = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"caf\u00E9 \uD83D\uDE00 \u0022q\u0022 a\u002fb"}]}"#,
    );
    assert_eq!(literal, escaped);
    assert_eq!(literal, upper);
    assert!(literal.ends_with("café 😀 \"q\" a/b".as_bytes()));
    // Escapes in keys are decoded too.
    assert_eq!(
        chat(
            r#"{"\u006dodel":"m","messages":[{"r\u006fle":"user","content":"café 😀 \"q\" a/b"}]}"#
        ),
        literal
    );
    // A lone surrogate is U+FFFD, like an invalid sequence in any decoder.
    assert!(
        chat(r#"{"model":"m","messages":[{"role":"user","content":"a\ud800b"}]}"#)
            .ends_with("a\u{FFFD}b".as_bytes())
    );
}

/// Every permutation of `items`.
fn permutations<T: Clone>(items: &[T]) -> Vec<Vec<T>> {
    if items.len() <= 1 {
        return vec![items.to_vec()];
    }
    let mut all = Vec::new();
    for i in 0..items.len() {
        let mut rest = items.to_vec();
        let first = rest.remove(i);
        for mut p in permutations(&rest) {
            p.insert(0, first.clone());
            all.push(p);
        }
    }
    all
}

#[test]
fn key_order_does_not_matter() {
    let messages = r#"[{"role":"system","content":"sys"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":"r","name":"f"}]"#;
    let top = [
        r#""model":"m""#.to_string(),
        r#""cache_salt":"s""#.to_string(),
        format!(r#""tools":{TOOLS}"#),
        format!(r#""messages":{messages}"#),
        r#""stream":true"#.to_string(),
    ];
    let expected = chat(&format!("{{{}}}", top.join(",")));
    for p in permutations(&top) {
        assert_eq!(chat(&format!("{{{}}}", p.join(","))), expected);
    }
    // Inside a message too.
    let fields = [
        r#""role":"tool""#,
        r#""content":[{"type":"text","text":"r"}]"#,
        r#""tool_call_id":"c""#,
        r#""name":"f""#,
        r#""extra":{"k":[1,2]}"#,
    ];
    let one = |fields: &[&str]| {
        chat(&format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"q"}},{{{}}}]}}"#,
            fields.join(",")
        ))
    };
    let expected = one(&fields);
    assert!(expected.ends_with(b"\0role:tool\0r\0tool_call_id\0c\0name\0f"));
    for p in permutations(&fields) {
        assert_eq!(one(&p), expected, "{p:?}");
    }
}

#[test]
fn whitespace_does_not_matter() {
    let tight = r#"{"model":"m","tools":[{"a":1}],"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#;
    let loose = " \r\n{ \"model\" :\t\"m\" ,\n \"tools\" : [ { \"a\" : 1 } ] , \"messages\" : [ { \"role\" : \"user\" , \"content\" : [ { \"type\" : \"text\" , \"text\" : \"x\" } ] } ] }\n ";
    assert_eq!(chat(tight), chat(loose));
}

/// A chat body with `turns` user/assistant exchanges (the last user message unanswered).
pub(crate) fn conversation(turns: usize) -> String {
    let mut messages = vec![format!(
        r#"{{"role":"system","content":"You are a careful assistant.\nAnswer with code when asked."}}"#
    )];
    for t in 0..turns {
        if t > 0 {
            messages.push(format!(
                r#"{{"role":"assistant","content":"Answer {t}: \"use\\n{}\" \u00e9"}}"#,
                "x".repeat(t * 37)
            ));
        }
        messages.push(format!(
            r#"{{"content":"Question {t}: why {}?","role":"user"}}"#,
            "y".repeat(t * 53)
        ));
    }
    format!(
        r#"{{"messages":[{}],"model":"m","tools":{TOOLS},"stream":true}}"#,
        messages.join(",")
    )
}

#[test]
fn next_turn_extends_the_canonical_prefix() {
    for turn in 1..12 {
        let now = chat(&conversation(turn));
        let next = chat(&conversation(turn + 1));
        assert!(next.len() > now.len());
        assert!(next.starts_with(&now), "turn {turn}");
    }
}

#[test]
fn malformed_bodies_are_errors() {
    let cases: &[(&str, PromptError)] = &[
        ("", PromptError::Truncated),
        ("   ", PromptError::Truncated),
        ("[1,2]", PromptError::NotAnObject),
        ("\"s\"", PromptError::NotAnObject),
        ("null", PromptError::NotAnObject),
        ("{}", PromptError::MissingField("messages")),
        (r#"{"messages":null}"#, PromptError::WrongType("messages")),
        (r#"{"messages":{}}"#, PromptError::WrongType("messages")),
        (
            r#"{"messages":["hi"]}"#,
            PromptError::WrongType("messages[]"),
        ),
        (
            r#"{"messages":[{"content":"hi"}]}"#,
            PromptError::MissingField("messages[].role"),
        ),
        (
            r#"{"messages":[{"role":1}]}"#,
            PromptError::WrongType("messages[].role"),
        ),
        (
            r#"{"messages":[{"role":"user","content":1}]}"#,
            PromptError::WrongType("messages[].content"),
        ),
        (
            r#"{"messages":[{"role":"user","role":"user"}]}"#,
            PromptError::DuplicateKey("messages[].role"),
        ),
        (
            r#"{"messages":[],"messages":[]}"#,
            PromptError::DuplicateKey("messages"),
        ),
        (r#"{"messages":[]} x"#, PromptError::Syntax { offset: 16 }),
        (r#"{"messages":[],}"#, PromptError::Syntax { offset: 15 }),
        (r#"{"messages":[]"#, PromptError::Truncated),
        (
            "{\"messages\":[{\"role\":\"user\",\"content\":\"a\u{1}\"}]}",
            PromptError::Syntax { offset: 40 },
        ),
        ("nul", PromptError::Truncated),
        ("xyz", PromptError::Syntax { offset: 0 }),
    ];
    for (body, want) in cases {
        assert_eq!(&chat_err(body), want, "{body}");
    }
    // Bad escapes are errors wherever they are, whichever pass reads them.
    for body in [
        r#"{"model":"m","messages":[{"role":"user","content":"a\qb"}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"a","extra":"\q"}]}"#,
        r#"{"model":"m","messages":[],"user":"\q"}"#,
        r#"{"model":"m","messages":[],"prompt":"\q"}"#,
        r#"{"model":"m\q","messages":[]}"#,
        r#"{"model":"m","tools":[{"x":"\u12x4"}],"messages":[]}"#,
    ] {
        assert!(
            matches!(chat_err(body), PromptError::Syntax { .. }),
            "{body}"
        );
    }
    for body in [
        r#"{"model":"m","prompt":"a\qb"}"#,
        r#"{"model":"m\q","prompt":[1,2]}"#,
        r#"{"model":"m","prompt":[1,2],"messages":"\q"}"#,
        r#"{"model":"m","prompt":[1,2],"tools":["\q"]}"#,
    ] {
        assert!(
            matches!(completion_err(body), PromptError::Syntax { .. }),
            "{body}"
        );
    }
    // An empty message list is a valid (if useless) prefix.
    assert_eq!(chat(r#"{"model":"m","messages":[]}"#), b"\0model\0m");
}

#[test]
fn hostile_nesting_is_rejected() {
    let deep = "[".repeat(100_000);
    for body in [
        deep.clone(),
        format!(r#"{{"messages":{deep}"#),
        format!(r#"{{"x":{deep}"#),
        format!(r#"{{"messages":[{{"role":"user","content":{deep}"#),
        "{\"a\":".repeat(100_000),
    ] {
        assert!(
            matches!(chat_err(&body), PromptError::TooDeep { .. }),
            "{:?}",
            chat_err(&body)
        );
    }
    // Deep but within the limit is fine where the value is skipped.
    let ok_depth = MAX_DEPTH - 1;
    let body = format!(
        r#"{{"x":{}{},"model":"m","messages":[]}}"#,
        "[".repeat(ok_depth),
        "]".repeat(ok_depth)
    );
    assert_eq!(chat(&body), b"\0model\0m");
    let body = format!(
        r#"{{"x":{}{},"model":"m","messages":[]}}"#,
        "[".repeat(ok_depth + 1),
        "]".repeat(ok_depth + 1)
    );
    assert!(matches!(chat_err(&body), PromptError::TooDeep { .. }));
}

#[test]
fn every_truncation_is_an_error() {
    let bodies = [
        (Endpoint::ChatCompletions, conversation(3)),
        (
            Endpoint::Completions,
            r#"{"model":"m","prompt":[[1,22,333],[4]],"cache_salt":"\ud83d\ude00"}"#.to_string(),
        ),
        (
            Endpoint::Completions,
            r#"{"model":"m","prompt":["a\"b","c\u00e9"],"n":-1.5e-3,"b":[true,false,null]}"#
                .to_string(),
        ),
        (
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"t"}]}],"model":"m"}"#.to_string(),
        ),
    ];
    for (endpoint, body) in &bodies {
        let bytes = body.as_bytes();
        assert!(canon_bytes(*endpoint, bytes).is_ok(), "{body}");
        for cut in 0..bytes.len() {
            for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
                let got = canon_bytes(endpoint, &bytes[..cut]);
                assert!(got.is_err(), "{endpoint:?} cut at {cut} of {body}: {got:?}");
            }
        }
    }
}

/// xorshift64*, deterministic.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[test]
fn random_and_mutated_bodies_never_panic() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let alphabet = b"{}[]\":,\\u0123456789abcdefnulltrue -.eE\n \xc3\xa9\x00\x1f";
    for _ in 0..20_000 {
        let len = (rng.next() % 64) as usize;
        let body: Vec<u8> = (0..len)
            .map(|_| {
                let r = rng.next();
                if r.is_multiple_of(4) {
                    r as u8 >> 1
                } else {
                    alphabet[(r >> 8) as usize % alphabet.len()]
                }
            })
            .collect();
        let _ = canon_bytes(Endpoint::ChatCompletions, &body);
        let _ = canon_bytes(Endpoint::Completions, &body);
    }
    let seeds = [
        conversation(4),
        r#"{"model":"m","prompt":[[1,2],[3]],"cache_salt":"s"}"#.to_string(),
        r#"{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"user","content":[{"type":"image_url","image_url":"u"},{"type":"x"}]}]}"#.to_string(),
    ];
    for seed in &seeds {
        for _ in 0..3_000 {
            let mut body = seed.as_bytes().to_vec();
            for _ in 0..1 + rng.next() % 3 {
                let at = rng.next() as usize % body.len();
                match rng.next() % 3 {
                    0 => body[at] = alphabet[rng.next() as usize % alphabet.len()],
                    1 => {
                        body.remove(at);
                    }
                    _ => body.insert(at, alphabet[rng.next() as usize % alphabet.len()]),
                }
            }
            let _ = canon_bytes(Endpoint::ChatCompletions, &body);
            let _ = canon_bytes(Endpoint::Completions, &body);
        }
    }
}

#[test]
fn huge_strings_stream_through() {
    let big = "abcdefghij".repeat(1024 * 1024); // 10 MiB
    let body = format!(r#"{{"messages":[{{"role":"user","content":"{big}"}}],"model":"m"}}"#);
    let mut total = 0usize;
    let mut pieces = 0usize;
    let form = extract_prompt(
        Endpoint::ChatCompletions,
        body.as_bytes(),
        &mut |p: Piece<'_>| {
            if let Piece::Text(b) = p {
                total += b.len();
                pieces += 1;
            }
        },
    )
    .unwrap();
    assert_eq!(form, PromptForm::Text);
    assert_eq!(total, "\0model\0m\0role:user\0".len() + big.len());
    assert!(
        pieces < 10,
        "the string comes as one borrowed piece, not copied: {pieces}"
    );
}

#[test]
fn errors_read_well() {
    assert_eq!(
        PromptError::WrongType("messages[].content").to_string(),
        "request field `messages[].content` has the wrong type"
    );
    assert_eq!(PromptError::TooDeep { offset: 3 }.label(), "too_deep");
}
