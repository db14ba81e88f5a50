//! Canonical prefix of every body form of replica-interfaces.md section 3, and hostile bodies.

#![forbid(unsafe_code)]

use super::*;

/// The two-pass extraction before messages were recorded, kept as the reference the
/// recording path is compared against. Streams the canonical prefix of `body` into `sink` and says which form it took.
///
/// On `Err`, some pieces may already have been emitted: the sink must discard them.
pub(crate) fn reference_extract_prompt(
    endpoint: Endpoint,
    body: &[u8],
    sink: &mut impl PromptSink,
) -> Result<PromptForm, PromptError> {
    let fields = reference_top_level(endpoint, body, sink)?;
    if fields.tokens_emitted {
        return Ok(PromptForm::Tokens);
    }
    if endpoint == Endpoint::Completions && fields.prompt.is_none() {
        return Err(PromptError::MissingField("prompt"));
    }

    let text = &mut |piece: &[u8]| sink.piece(Piece::Text(piece));
    text(super::MODEL);
    if let Some(start) = fields.model {
        string_or_null(&mut Cursor::new(body, start), "model", text)?;
    }
    if let Some(start) = fields.cache_salt {
        let mut c = Cursor::new(body, start);
        if !c.null()? {
            text(super::CACHE_SALT);
            string_or_null(&mut c, "cache_salt", text)?;
        }
    }
    if let Some(start) = fields.tools {
        let mut c = Cursor::new(body, start);
        if !c.null()? {
            if c.peek_token()? != b'[' {
                return Err(PromptError::WrongType("tools"));
            }
            text(super::TOOLS);
            c.value(1, text)?;
        }
    }
    match endpoint {
        Endpoint::Responses => {
            if let Some(start) = fields.instructions {
                system_message(body, start, "instructions", text)?;
            }
            let start = fields.messages.ok_or(PromptError::MissingField("input"))?;
            responses_input(body, start, text)?;
        }
        Endpoint::ChatCompletions | Endpoint::Messages => {
            if let Some(start) = fields.instructions {
                system_message(body, start, "system", text)?;
            }
            let start = fields
                .messages
                .ok_or(PromptError::MissingField("messages"))?;
            messages(body, start, text)?;
        }
        Endpoint::Completions => {
            let start = fields.prompt.ok_or(PromptError::MissingField("prompt"))?;
            text_prompt(body, start, text)?;
        }
    }
    Ok(PromptForm::Text)
}

/// Where the top-level values the prefix is built from start.
#[derive(Default)]
struct ReferenceTopLevel {
    model: Option<usize>,
    cache_salt: Option<usize>,
    tools: Option<usize>,
    messages: Option<usize>,
    instructions: Option<usize>,
    prompt: Option<usize>,
    /// A completions prompt of token ids was emitted during this pass (token mode needs nothing
    /// else from the body, so it takes one pass).
    tokens_emitted: bool,
}

/// First pass: validate the whole body and record where the wanted values start; token-id
/// prompts are emitted on the way.
fn reference_top_level(
    endpoint: Endpoint,
    body: &[u8],
    sink: &mut impl PromptSink,
) -> Result<ReferenceTopLevel, PromptError> {
    let mut c = Cursor::new(body, 0);
    if c.peek_token()? != b'{' {
        // Distinguish "some other JSON" from "not JSON at all" for the metric.
        let at = c.pos;
        c.skip(0)?;
        c.skip_ws();
        return Err(if c.pos == body.len() {
            PromptError::NotAnObject
        } else {
            PromptError::Syntax {
                offset: at.max(c.pos),
            }
        });
    }
    let mut fields = ReferenceTopLevel::default();
    c.object(0, |c, key| {
        c.skip_ws();
        use Endpoint::*;
        let slot = match (key, endpoint) {
            (b"model", _) => Some((&mut fields.model, "model")),
            (b"cache_salt", _) => Some((&mut fields.cache_salt, "cache_salt")),
            (b"tools", _) => Some((&mut fields.tools, "tools")),
            (b"messages", ChatCompletions | Messages) => Some((&mut fields.messages, "messages")),
            (b"input", Responses) => Some((&mut fields.messages, "input")),
            (b"instructions", Responses) => Some((&mut fields.instructions, "instructions")),
            (b"system", Messages) => Some((&mut fields.instructions, "system")),
            (b"prompt", Completions) => Some((&mut fields.prompt, "prompt")),
            _ => None,
        };
        if let Some((slot, name)) = slot {
            if slot.is_some() {
                return Err(PromptError::DuplicateKey(name));
            }
            *slot = Some(c.pos);
            if name == "prompt"
                && endpoint == Endpoint::Completions
                && prompt_form(c.buf, c.pos)? == PromptForm::Tokens
            {
                fields.tokens_emitted = true;
                return token_prompt(c, sink);
            }
            // The big values the second pass reads in full (escapes included) are only skimmed
            // here; the rest is checked now, whatever the second pass does.
            let reread = matches!(
                name,
                "messages" | "input" | "instructions" | "system" | "prompt"
            ) || (name == "tools" && endpoint != Endpoint::Completions);
            if reread {
                return c.skim(1);
            }
        }
        c.skip(1)
    })?;
    c.skip_ws();
    if c.pos != body.len() {
        return Err(c.syntax());
    }
    Ok(fields)
}

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
    assert_eq!(
        Endpoint::from_path(b"/v1/responses"),
        Some(Endpoint::Responses)
    );
    assert_eq!(
        Endpoint::from_path(b"/v1/messages"),
        Some(Endpoint::Messages)
    );
    assert_eq!(Endpoint::from_path(b"/v1/responses/resp_1"), None);
    assert_eq!(Endpoint::from_path(b"/v1/messages/count_tokens"), None);
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
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
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

/// What an extraction produced: its result and the concatenated pieces.
type Extracted = (Result<PromptForm, PromptError>, Vec<u8>, Vec<u32>);

fn extracted_with(
    run: impl FnOnce(&mut dyn FnMut(Piece<'_>)) -> Result<PromptForm, PromptError>,
) -> Extracted {
    let mut text = Vec::new();
    let mut tokens = Vec::new();
    let result = run(&mut |p: Piece<'_>| match p {
        Piece::Text(b) => text.extend_from_slice(b),
        Piece::Token(t) => tokens.push(t),
    });
    if result.is_err() {
        // Pieces before an error are to be discarded: not part of the result.
        text.clear();
        tokens.clear();
    }
    (result, text, tokens)
}

/// A random chat or completions body: any key order, escapes, part arrays, tool calls, odd
/// types and now and then a broken byte.
pub(crate) fn random_body(rng: &mut Rng) -> String {
    let words = [
        "plain text ",
        "line\\n",
        "quote\\\" ",
        "tab\\t",
        "caf\\u00e9 ",
        "\\ud83d\\ude00",
        "back\\\\slash ",
        "\\ud83d lone ",
        "é ",
        "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx ",
    ];
    let text = |rng: &mut Rng| {
        let mut s = String::new();
        for _ in 0..rng.next() % 40 {
            s.push_str(words[rng.next() as usize % words.len()]);
        }
        s
    };
    let mut messages = Vec::new();
    for _ in 0..rng.next() % 8 {
        let mut fields = vec![format!(
            r#""role":"{}""#,
            ["user", "assistant", "system", "tool"][rng.next() as usize % 4]
        )];
        match rng.next() % 8 {
            6 => fields.push(format!(
                r#""content":[{{"type":"tool_use","id":"t","name":"f","input":{{"a":"{}"}},"cache_control":{{"type":"ephemeral"}}}},{{"cache_control":{{}},"type":"tool_result","tool_use_id":"t","content":[{{"type":"text","text":"{}"}},{{"type":"image","cache_control":1}}]}},{{"type":"output_text","text":"{}"}}]"#,
                text(rng),
                text(rng),
                text(rng)
            )),
            7 => fields.push(format!(
                r#""type":"{}","content":[{{"type":"input_text","text":"{}"}}]"#,
                ["message", "function_call", "reasoning"][rng.next() as usize % 3],
                text(rng)
            )),
            0 => fields.push(format!(
                r#""content":[{{"type":"text","text":"{}"}},{{"text":"{}","type":"text"}},{{"type":"image_url","image_url":{{"url":"u{}"}}}},{{"type":"x","y":[1,2]}}]"#,
                text(rng),
                text(rng),
                rng.next() % 9
            )),
            1 => fields.push(r#""content":null"#.to_string()),
            2 => fields.push(format!(
                r#""tool_calls":[{{"id":"c","function":{{"arguments":"{{\"a\":{}}}","name":"f"}}}}]"#,
                rng.next() % 9
            )),
            3 => fields.push(r#""content":5"#.to_string()),
            _ => fields.push(format!(r#""content":"{}""#, text(rng))),
        }
        if rng.next().is_multiple_of(4) {
            fields.push(r#""name":"n""#.to_string());
        }
        if rng.next().is_multiple_of(5) {
            fields.push(r#""tool_call_id":"t1""#.to_string());
        }
        if rng.next().is_multiple_of(50) {
            fields.clear();
        }
        let n = fields.len();
        for i in 0..n {
            fields.swap(i, i + rng.next() as usize % (n - i));
        }
        messages.push(format!("{{{}}}", fields.join(",")));
    }
    let mut top = vec![
        format!(r#""messages":[{}]"#, messages.join(" , ")),
        r#""model":"Qwen/Qwen3-8B""#.to_string(),
        r#""stream":true"#.to_string(),
    ];
    if rng.next().is_multiple_of(2) {
        top.push(r#""tools":[{"type":"function","function":{"name":"run"}}]"#.to_string());
    }
    if rng.next().is_multiple_of(4) {
        top.push(r#""cache_salt":"s""#.to_string());
    }
    if rng.next().is_multiple_of(3) {
        top.push(format!(r#""prompt":["{}","x"]"#, text(rng)));
    }
    if rng.next().is_multiple_of(6) {
        top.push(r#""prompt":[[1,2],[3]]"#.to_string());
    }
    if rng.next().is_multiple_of(20) {
        top.push(r#""messages":[]"#.to_string());
    }
    match rng.next() % 8 {
        0 => top.push(format!(r#""system":"{}""#, text(rng))),
        1 => top.push(format!(
            r#""system":[{{"type":"text","text":"x-anthropic-billing-header: {}"}},{{"text":"{}","type":"text","cache_control":{{"type":"ephemeral"}}}}]"#,
            rng.next(),
            text(rng)
        )),
        2 => top.push(format!(r#""instructions":"{}""#, text(rng))),
        3 => top.push(format!(r#""input":"{}""#, text(rng))),
        4 => top.push(format!(r#""input":[{}]"#, messages.join(","))),
        5 => top.push(r#""instructions":7"#.to_string()),
        _ => {}
    }
    if rng.next().is_multiple_of(20) {
        top.push(r#""messages":"no""#.to_string());
    }
    let n = top.len();
    for i in 0..n {
        top.swap(i, i + rng.next() as usize % (n - i));
    }
    let mut body = format!("{{{}}}", top.join(","));
    if rng.next().is_multiple_of(3) {
        let broken = b"{}[]\":,\\u0\n\x01 ";
        let mut bytes = body.into_bytes();
        for _ in 0..1 + rng.next() % 2 {
            let at = rng.next() as usize % bytes.len();
            let b = broken[rng.next() as usize % broken.len()];
            match rng.next() % 3 {
                0 => bytes[at] = b,
                1 => {
                    bytes.remove(at);
                }
                _ => bytes.insert(at, b),
            }
        }
        if rng.next().is_multiple_of(4) {
            let cut = rng.next() as usize % bytes.len();
            bytes.truncate(cut);
        }
        body = String::from_utf8_lossy(&bytes).into_owned();
    }
    body
}

#[test]
fn recording_path_equals_the_two_pass_reference() {
    let mut rng = Rng(0x0DDB_1A5E_5BAD_5EED);
    let mut scratches: Vec<PromptScratch> = [0, 1, 2, 3, 5, 9, 17, 64, 8192]
        .into_iter()
        .map(PromptScratch::new)
        .collect();
    let mut ok = 0;
    for _ in 0..6000 {
        let body = random_body(&mut rng);
        let body = body.as_bytes();
        for endpoint in [
            Endpoint::ChatCompletions,
            Endpoint::Completions,
            Endpoint::Messages,
            Endpoint::Responses,
        ] {
            let reference =
                extracted_with(|mut s| reference_extract_prompt(endpoint, body, &mut s));
            let stack = extracted_with(|mut s| extract_prompt(endpoint, body, &mut s));
            assert_eq!(stack, reference, "{}", String::from_utf8_lossy(body));
            for scratch in scratches.iter_mut() {
                let with =
                    extracted_with(|mut s| extract_prompt_with(endpoint, body, scratch, &mut s));
                assert_eq!(with, reference, "{}", String::from_utf8_lossy(body));
            }
            ok += reference.0.is_ok() as usize;
        }
    }
    assert!(ok > 2000, "{ok} bodies extracted");
}

/// What a bounded extraction produced: its result and the concatenated pieces (kept on
/// `Unknown` too, to look at; a caller discards them).
type Bounded = (Result<(PromptForm, Extent), PromptError>, Vec<u8>, Vec<u32>);

fn within(
    endpoint: Endpoint,
    body: &[u8],
    scratch: &mut PromptScratch,
    limits: &PromptLimits,
) -> Bounded {
    let mut text = Vec::new();
    let mut tokens = Vec::new();
    let result = extract_prompt_within(
        endpoint,
        body,
        scratch,
        limits,
        &mut |p: Piece<'_>| match p {
            Piece::Text(b) => text.extend_from_slice(b),
            Piece::Token(t) => tokens.push(t),
        },
    );
    (result, text, tokens)
}

#[test]
fn bodies_under_the_bounds_read_as_without_them() {
    let mut rng = Rng(0xB0DE_D0E5_0F0B_0DE5);
    let mut scratches: Vec<PromptScratch> = [0, 3, 17, 8192]
        .into_iter()
        .map(PromptScratch::new)
        .collect();
    let limits = PromptLimits::default();
    let mut ok = 0;
    for _ in 0..4000 {
        let body = random_body(&mut rng);
        let body = body.as_bytes();
        for endpoint in [
            Endpoint::ChatCompletions,
            Endpoint::Completions,
            Endpoint::Messages,
            Endpoint::Responses,
        ] {
            let reference =
                extracted_with(|mut s| reference_extract_prompt(endpoint, body, &mut s));
            for scratch in scratches.iter_mut() {
                let (result, text, tokens) = within(endpoint, body, scratch, &limits);
                let result = result.map(|(form, extent)| {
                    assert_eq!(extent, Extent::Whole, "{}", String::from_utf8_lossy(body));
                    form
                });
                let got = match result {
                    Ok(form) => (Ok(form), text, tokens),
                    Err(e) => (Err(e), Vec::new(), Vec::new()),
                };
                assert_eq!(got, reference, "{}", String::from_utf8_lossy(body));
            }
            ok += reference.0.is_ok() as usize;
        }
    }
    assert!(ok > 1500, "{ok} bodies extracted");
}

#[test]
fn a_bound_cuts_the_canonical_prefix_and_nothing_else() {
    let mut rng = Rng(0x0C07_5407_7B0D_1E55);
    let mut scratches: Vec<PromptScratch> = [0, 2, 9, 8192]
        .into_iter()
        .map(PromptScratch::new)
        .collect();
    let mut seen = [0usize; 6];
    for round in 0..6000 {
        let body = random_body(&mut rng);
        let body = body.as_bytes();
        let pick = |rng: &mut Rng, options: &[usize]| options[rng.next() as usize % options.len()];
        let limits = PromptLimits {
            max_tokens: pick(&mut rng, &[1, 3, 10, 40, 150, usize::MAX]),
            max_messages: pick(&mut rng, &[0, 1, 2, 4, usize::MAX]),
            max_parts: pick(&mut rng, &[0, 1, 3, usize::MAX]),
            max_work: pick(&mut rng, &[0, 5, 20, 80, 400, usize::MAX]),
            max_validated_bytes: pick(&mut rng, &[0, 4, 30, usize::MAX]),
        };
        for endpoint in [
            Endpoint::ChatCompletions,
            Endpoint::Completions,
            Endpoint::Messages,
            Endpoint::Responses,
        ] {
            let reference =
                extracted_with(|mut s| reference_extract_prompt(endpoint, body, &mut s));
            let scratch = &mut scratches[round % 4];
            let (result, text, tokens) = within(endpoint, body, scratch, &limits);
            let shown = || format!("{limits:?} {endpoint:?} {}", String::from_utf8_lossy(body));
            let (Ok(form), want_text, want_tokens) = &reference else {
                // An invalid body may be read up to a bound before its error: nothing to check
                // but that the extraction ends.
                seen[5] += 1;
                continue;
            };
            match result {
                Ok((got, Extent::Whole)) => {
                    assert_eq!(got, *form, "{}", shown());
                    assert_eq!(&text, want_text, "{}", shown());
                    assert_eq!(&tokens, want_tokens, "{}", shown());
                    seen[0] += 1;
                }
                Ok((got, Extent::Prefix(bound))) => {
                    assert_eq!(got, *form, "{}", shown());
                    assert!(
                        want_text.starts_with(&text),
                        "{bound:?} {:?} {}",
                        String::from_utf8_lossy(&text),
                        shown()
                    );
                    assert!(want_tokens.starts_with(&tokens), "{bound:?} {}", shown());
                    if bound == Bound::Tokens {
                        // Text stops at the token bound only when its sink is full (these
                        // closures never are).
                        assert_eq!(*form, PromptForm::Tokens, "{}", shown());
                        assert!(tokens.len() <= limits.max_tokens, "{}", shown());
                    }
                    seen[1 + (bound == Bound::Tokens) as usize] += 1;
                }
                Ok((_, Extent::Unknown(_))) => seen[3] += 1,
                Err(e) => panic!("a valid body failed within bounds: {e:?} {}", shown()),
            }
            if limits.max_validated_bytes < body.len() {
                seen[4] += 1;
            }
        }
    }
    // Every outcome came up often.
    assert!(seen.iter().all(|&n| n > 30), "{seen:?}");
}

/// `n` one-letter user messages, then `tail` (the top-level members after `messages`).
fn many_messages(n: usize, head: &str, tail: &str) -> String {
    let messages = vec![r#"{"role":"user","content":"a"}"#; n].join(",");
    format!(r#"{{{head}"messages":[{messages}]{tail}}}"#)
}

#[test]
fn fields_after_a_cut_message_array_are_still_found() {
    let limits = PromptLimits {
        max_messages: 100,
        ..PromptLimits::default()
    };
    let fields =
        r#""model":"m","cache_salt":"s","tools":[{"type":"function","function":{"name":"f"}}]"#;
    let mut scratch = PromptScratch::new(8192);
    // The bound's prefix: the same fields and exactly the first 100 messages.
    let (want, want_text, _) = within(
        Endpoint::ChatCompletions,
        many_messages(100, &format!("{fields},"), "").as_bytes(),
        &mut scratch,
        &PromptLimits::UNLIMITED,
    );
    assert_eq!(want, Ok((PromptForm::Text, Extent::Whole)));
    for body in [
        many_messages(5000, "", &format!(",{fields}")),
        many_messages(5000, &format!("{fields},"), ""),
        many_messages(
            5000,
            r#""model":"m","#,
            r#","cache_salt":"s","tools":[{"type":"function","function":{"name":"f"}}],"stream":true"#,
        ),
    ] {
        for pieces in [0, 5, 8192] {
            let (got, text, _) = within(
                Endpoint::ChatCompletions,
                body.as_bytes(),
                &mut PromptScratch::new(pieces),
                &limits,
            );
            assert_eq!(
                got,
                Ok((PromptForm::Text, Extent::Prefix(Bound::Messages))),
                "{pieces}"
            );
            assert_eq!(text, want_text, "{pieces}");
        }
    }
    // The rest of the body is skimmed, not validated...
    let broken =
        many_messages(5000, "", r#","model":"m""#).replacen(r#""a"}]"#, r#""a\q",tru}]"#, 1);
    assert!(matches!(chat_err(&broken), PromptError::Syntax { .. }));
    let (got, ..) = within(
        Endpoint::ChatCompletions,
        broken.as_bytes(),
        &mut scratch,
        &limits,
    );
    assert_eq!(got.map(|(_, e)| e), Ok(Extent::Prefix(Bound::Messages)));
    // ...but a body that ends inside it has no prefix.
    let cut = many_messages(5000, r#""model":"m","#, "");
    let (got, ..) = within(
        Endpoint::ChatCompletions,
        &cut.as_bytes()[..cut.len() - 3],
        &mut scratch,
        &limits,
    );
    assert_eq!(
        got,
        Ok((PromptForm::Text, Extent::Unknown(Bound::Messages)))
    );
}

#[test]
fn a_bound_before_the_fields_leaves_no_prefix() {
    let members: String = (0..10_000).map(|i| format!(r#""k{i}":{i},"#)).collect();
    let body = format!(r#"{{{members}"model":"m","messages":[{{"role":"user","content":"a"}}]}}"#);
    let limits = PromptLimits {
        max_work: 1000,
        ..PromptLimits::default()
    };
    let (got, ..) = within(
        Endpoint::ChatCompletions,
        body.as_bytes(),
        &mut PromptScratch::new(64),
        &limits,
    );
    assert_eq!(got, Ok((PromptForm::Text, Extent::Unknown(Bound::Work))));
    let (got, ..) = within(
        Endpoint::ChatCompletions,
        body.as_bytes(),
        &mut PromptScratch::new(64),
        &PromptLimits::default(),
    );
    assert_eq!(got, Ok((PromptForm::Text, Extent::Whole)));
}

#[test]
fn token_ids_and_text_stop_at_the_token_bound() {
    let limits = PromptLimits::for_tokens(1000);
    let mut scratch = PromptScratch::new(64);
    let ids: Vec<String> = (0..5000).map(|i| i.to_string()).collect();
    for body in [
        format!(r#"{{"prompt":[{}],"model":"m"}}"#, ids.join(",")),
        format!(r#"{{"prompt":[[{}],[1]],"model":"m"}}"#, ids.join(",")),
    ] {
        let (got, text, tokens) = within(
            Endpoint::Completions,
            body.as_bytes(),
            &mut scratch,
            &limits,
        );
        assert_eq!(got, Ok((PromptForm::Tokens, Extent::Prefix(Bound::Tokens))));
        assert!(text.is_empty());
        assert_eq!(tokens, (0..1000).collect::<Vec<u32>>());
    }
    // Text stops once its sink is full, at the next check: a 64-byte stretch of a string, a
    // member, a message (`prefix` takes exactly the blocks it wants). Messages the first pass
    // recorded are replayed whole (a cheap copy of at most the scratch's pieces): plain text
    // is read to its end, escape-dense text (scanned again) stops.
    struct Capped(Vec<u8>);
    impl PromptSink for Capped {
        fn piece(&mut self, piece: Piece<'_>) {
            if let Piece::Text(b) = piece {
                self.0.extend_from_slice(b);
            }
        }
        fn full(&self) -> bool {
            self.0.len() >= 4000
        }
    }
    for content in [
        "x".repeat(10_000),
        "\\n".repeat(10_000),
        "é\\u00e9".repeat(3000),
    ] {
        for body in [
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}},{{"role":"user","content":"{content}"}}]}}"#
            ),
            format!(
                r#"{{"messages":[{{"content":"{content}","role":"user"}},{{"role":"user","content":"{content}"}}],"model":"m"}}"#
            ),
        ] {
            let (_, whole, _) = within(
                Endpoint::ChatCompletions,
                body.as_bytes(),
                &mut scratch,
                &PromptLimits::UNLIMITED,
            );
            let mut sink = Capped(Vec::new());
            let got = extract_prompt_within(
                Endpoint::ChatCompletions,
                body.as_bytes(),
                &mut scratch,
                &limits,
                &mut sink,
            );
            let text = sink.0;
            let want = if content.contains('\\') {
                Extent::Prefix(Bound::Tokens)
            } else {
                Extent::Whole
            };
            assert_eq!(got, Ok((PromptForm::Text, want)), "{body:.60}");
            assert!(text.len() >= 4000, "{} bytes: {body:.60}", text.len());
            assert_eq!(
                text.len() < whole.len(),
                want != Extent::Whole,
                "{} bytes: {body:.60}",
                text.len()
            );
            assert!(whole.starts_with(&text), "{body:.60}");
        }
    }
}

#[test]
fn dense_text_stops_at_the_work_bound() {
    let limits = PromptLimits {
        max_work: 10_000,
        ..PromptLimits::default()
    };
    let mut scratch = PromptScratch::new(8192);
    let escapes = "\\t".repeat(100_000);
    let zeros = vec!["0"; 100_000].join(",");
    for body in [
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{escapes}"}}]}}"#),
        format!(r#"{{"messages":[{{"role":"user","content":"{escapes}"}}],"model":"m"}}"#),
        format!(r#"{{"model":"m","tools":[{zeros}],"messages":[]}}"#),
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"x","v":[{zeros}]}}]}}]}}"#
        ),
    ] {
        // A unit of work delivers at most two pieces (a run and an escape, a value and a comma).
        let mut pieces = 0usize;
        let got = extract_prompt_within(
            Endpoint::ChatCompletions,
            body.as_bytes(),
            &mut scratch,
            &limits,
            &mut |_: Piece<'_>| pieces += 1,
        );
        assert_eq!(
            got,
            Ok((PromptForm::Text, Extent::Prefix(Bound::Work))),
            "{body:.60}"
        );
        assert!(pieces <= 2 * 10_000 + 8, "{pieces} pieces: {body:.60}");
    }
}

fn text_of(endpoint: Endpoint, body: &str) -> Vec<u8> {
    match canon(endpoint, body) {
        Ok((PromptForm::Text, text, tokens)) => {
            assert!(tokens.is_empty());
            text
        }
        other => panic!("{body}: {other:?}"),
    }
}

fn responses(body: &str) -> String {
    String::from_utf8(text_of(Endpoint::Responses, body)).unwrap()
}

fn anthropic(body: &str) -> String {
    String::from_utf8(text_of(Endpoint::Messages, body)).unwrap()
}

#[test]
fn responses_instructions_and_input() {
    assert_eq!(
        responses(r#"{"input":"Hi","instructions":"Be brief.","model":"m"}"#),
        "\0model\0m\0role:system\0Be brief.\0role:user\0Hi"
    );
    assert_eq!(
        responses(r#"{"model":"m","instructions":null,"input":"Hi"}"#),
        "\0model\0m\0role:user\0Hi"
    );
    // Message items read as chat messages, whatever their key order and whichever text part
    // type; other items as their canonical JSON.
    let a = responses(
        r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"Hi"}]},
            {"type":"function_call","call_id":"c1","name":"ls","arguments":"{}"},
            {"type":"function_call_output","call_id":"c1","output":"a b"}]}"#,
    );
    assert_eq!(
        a,
        "\0model\0m\0role:user\0Hi\0item\0{\"type\":\"function_call\",\"call_id\":\"c1\",\"name\":\"ls\",\"arguments\":\"{}\"}\0item\0{\"type\":\"function_call_output\",\"call_id\":\"c1\",\"output\":\"a b\"}"
    );
    let b = responses(
        r#"{"input":[{"content":[{"text":"Hi","type":"input_text"}],"type":"message","role":"user"},
            {"type":"function_call","call_id":"c1","name":"ls","arguments":"{}"},
            {"type":"function_call_output","call_id":"c1","output":"a b"}],"model":"m"}"#,
    );
    assert_eq!(a, b);
    // A string input and the same text as an easy message item read alike.
    assert_eq!(
        responses(r#"{"model":"m","input":"Hi"}"#),
        responses(r#"{"model":"m","input":[{"role":"user","content":"Hi"}]}"#)
    );
}

/// Turn `turns` of an agent session on the Responses API, resending its whole history.
fn responses_session(turns: usize) -> String {
    let mut items = Vec::new();
    for t in 0..turns {
        items.push(format!(
            r#"{{"role":"user","content":[{{"type":"input_text","text":"Step {t}: {}"}}]}}"#,
            "y".repeat(t * 41)
        ));
        if t + 1 < turns {
            items.push(format!(
                r#"{{"type":"reasoning","id":"rs_{t}","summary":[],"content":[{{"type":"reasoning_text","text":"think {t}"}}]}}"#
            ));
            items.push(format!(
                r#"{{"type":"function_call","id":"fc_{t}","call_id":"call_{t}","name":"grep","arguments":"{{\"q\":\"{t}\"}}","status":"completed"}}"#
            ));
            items.push(format!(
                r#"{{"type":"function_call_output","call_id":"call_{t}","output":"hit {t}"}}"#
            ));
            items.push(format!(
                r#"{{"type":"message","id":"msg_{t}","role":"assistant","status":"completed","content":[{{"type":"output_text","text":"Done {t}","annotations":[]}}]}}"#
            ));
        }
    }
    format!(
        r#"{{"model":"m","instructions":"You are a coding agent.","tools":[{{"type":"function","name":"grep","parameters":{{}}}}],"input":[{}],"stream":true}}"#,
        items.join(",")
    )
}

#[test]
fn a_responses_session_extends_its_canonical_prefix() {
    for turn in 1..10 {
        let now = responses(&responses_session(turn));
        let next = responses(&responses_session(turn + 1));
        assert!(next.len() > now.len());
        assert!(next.starts_with(&now), "turn {turn}");
    }
}

#[test]
fn anthropic_system_and_blocks() {
    assert_eq!(
        anthropic(
            r#"{"model":"m","system":"Be brief.","messages":[{"role":"user","content":"Hi"}]}"#
        ),
        "\0model\0m\0role:system\0Be brief.\0role:user\0Hi"
    );
    // A per-request billing header block is left out of the system prompt.
    let with_header = |hash: &str| {
        anthropic(&format!(
            r#"{{"model":"m","system":[{{"type":"text","text":"x-anthropic-billing-header: cch={hash};"}},{{"type":"text","text":"You are an agent.","cache_control":{{"type":"ephemeral"}}}}],"messages":[{{"role":"user","content":"Hi"}}]}}"#
        ))
    };
    assert_eq!(with_header("1a2b"), with_header("9f8e"));
    assert_eq!(
        with_header("1a2b"),
        "\0model\0m\0role:system\0You are an agent.\0role:user\0Hi"
    );
    // tool_use as a tool call, tool_result as the call's id and its content.
    assert_eq!(
        anthropic(
            r#"{"model":"m","messages":[
                {"role":"assistant","content":[{"type":"text","text":"Looking."},{"type":"tool_use","id":"toolu_1","name":"ls","input":{"path":"/"}}]},
                {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"bin"},{"type":"text","text":"etc"}]}]}]}"#
        ),
        "\0model\0m\0role:assistant\0Looking.\0tool_call\0ls\0{\"path\":\"/\"}\0role:user\0\0tool_call_id\0toolu_1\0bin\netc"
    );
}

/// Turn `turns` of a coding agent on the Messages API, as such agents send it: the prompt
/// caching marker on the last block of the last message only, so it moves every turn.
fn anthropic_session(turns: usize) -> String {
    let mut messages = Vec::new();
    for t in 0..turns {
        let last = t + 1 == turns;
        let marker = if last {
            r#","cache_control":{"type":"ephemeral"}"#
        } else {
            ""
        };
        if t == 0 {
            messages.push(format!(
                r#"{{"role":"user","content":[{{"type":"text","text":"Fix the bug {}"{marker}}}]}}"#,
                "z".repeat(30)
            ));
        } else {
            messages.push(format!(
                r#"{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"toolu_{t}","content":"out {t}"{marker}}}]}}"#
            ));
        }
        if !last {
            messages.push(format!(
                r#"{{"role":"assistant","content":[{{"type":"thinking","thinking":"plan {t}","signature":"s{t}"}},{{"type":"tool_use","id":"toolu_{}","name":"bash","input":{{"cmd":"make {t}"}}}}]}}"#,
                t + 1
            ));
        }
    }
    format!(
        r#"{{"model":"m","max_tokens":512,"stream":true,"system":[{{"type":"text","text":"x-anthropic-billing-header: cch={turns};"}},{{"type":"text","text":"You are a coding agent.","cache_control":{{"type":"ephemeral"}}}}],"tools":[{{"name":"bash","input_schema":{{"type":"object"}}}}],"messages":[{}]}}"#,
        messages.join(",")
    )
}

#[test]
fn an_anthropic_session_extends_its_canonical_prefix_as_the_marker_moves() {
    for turn in 1..10 {
        let now = anthropic(&anthropic_session(turn));
        let next = anthropic(&anthropic_session(turn + 1));
        assert!(next.len() > now.len());
        assert!(next.starts_with(&now), "turn {turn}:\n{now:?}\n{next:?}");
    }
}

#[test]
fn malformed_agent_bodies_are_errors() {
    let responses_cases: &[(&str, PromptError)] = &[
        (r#"{"model":"m"}"#, PromptError::MissingField("input")),
        (r#"{"input":5}"#, PromptError::WrongType("input")),
        (r#"{"input":[5]}"#, PromptError::WrongType("input[]")),
        (
            r#"{"input":"x","instructions":[1]}"#,
            PromptError::WrongType("instructions"),
        ),
        (
            r#"{"input":[{"content":"x"}]}"#,
            PromptError::MissingField("messages[].role"),
        ),
        (
            r#"{"input":"x","input":"y"}"#,
            PromptError::DuplicateKey("input"),
        ),
    ];
    for (body, want) in responses_cases {
        assert_eq!(
            canon(Endpoint::Responses, body).expect_err(body),
            *want,
            "{body}"
        );
    }
    let messages_cases: &[(&str, PromptError)] = &[
        (
            r#"{"model":"m","system":"s"}"#,
            PromptError::MissingField("messages"),
        ),
        (
            r#"{"system":{},"messages":[]}"#,
            PromptError::WrongType("system"),
        ),
        (
            r#"{"messages":[{"role":"assistant","content":[{"type":"tool_use","input":{}}]}]}"#,
            PromptError::MissingField("messages[].content[].name"),
        ),
        (
            r#"{"messages":[{"role":"user","content":[{"type":"tool_result","content":"x"}]}]}"#,
            PromptError::MissingField("messages[].content[].tool_use_id"),
        ),
        (
            r#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":7}]}]}"#,
            PromptError::WrongType("messages[].content[].content"),
        ),
    ];
    for (body, want) in messages_cases {
        assert_eq!(
            canon(Endpoint::Messages, body).expect_err(body),
            *want,
            "{body}"
        );
    }
}
