//! Token mode for chat prompts end to end: `kvlb replica` processes tokenize chat requests
//! with a Hugging Face tokenizer and ChatML template made in the test (as a real engine would)
//! and publish KV events of those ids; `kvlb serve --tokenizer` hashes chat requests into the
//! same token blocks, so a new conversation that shares a long system prompt with one a
//! replica has served goes to that replica, with the shared tokens counted as matched.

#[path = "support/mod.rs"]
mod support;

use kvlb::tokenize::{fixture, ChatTokenizer};
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::time::Duration;
use support::fleet::{
    decision, post, replica_count_reaches, replicas_json, serve_subscribed, ReplicaFleet,
};
use support::{Kvlb, TempDir};

const T: Duration = Duration::from_secs(20);

fn chat(system: &str, user: &str) -> Vec<u8> {
    json!({
        "model": "Qwen/Qwen3-8B",
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}],
    })
    .to_string()
    .into_bytes()
}

#[test]
fn a_shared_system_prompt_routes_to_the_replica_whose_events_hold_it() {
    let dir = TempDir::new("tokenizer-mode");
    fixture::write_chatml(&dir.path).unwrap();
    let tokenizer_path = dir.file("tokenizer.json");
    let tokenizer_arg = tokenizer_path.to_str().unwrap();
    let reps = ReplicaFleet::start(2, &["--time-scale", "50", "--tokenizer", tokenizer_arg]);
    assert!(
        !reps.notes.iter().any(|l| l.contains("tokenizer")),
        "kvlb replica refused the tokenizer: {:?}",
        reps.notes
    );
    let http = &reps.http;
    let kvlb = serve_subscribed(&reps, "", &["--tokenizer", tokenizer_arg]);

    // Replica 1 serves a conversation with a long system prompt (kvlb not involved).
    let system = "You are a careful assistant for a weather service. Answer in short sentences, \
        cite the forecast you used and never invent a city. "
        .repeat(20);
    let first = chat(&system, "What is the weather in Paris tomorrow?");
    let direct = post(http[1], "/v1/chat/completions", &first);
    assert_eq!(direct.status, 200, "{}", direct.describe());
    assert!(
        replica_count_reaches(&kvlb, 1, "resident_blocks", 32, T),
        "kvlb did not learn replica 1's blocks: {:?}",
        replicas_json(&kvlb)
    );

    // Another conversation with the same system prompt and tools goes to replica 1, and the
    // matched tokens are exactly the full blocks of the shared token prefix.
    let second = chat(&system, "Will it snow in Oslo this weekend?");
    let via = post(kvlb.listen, "/v1/chat/completions", &second);
    assert_eq!(via.status, 200, "{}", via.describe());
    assert_eq!(
        via.header("x-kvlb-replica"),
        Some(format!("http://{}", http[1]).as_str()),
        "{}",
        via.describe()
    );
    let t = ChatTokenizer::load(&tokenizer_path, None).unwrap();
    let (a, b) = (
        t.chat_tokens_whole(&first).unwrap(),
        t.chat_tokens_whole(&second).unwrap(),
    );
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let (reason, matched) = decision(&via);
    assert_eq!(reason, "cache", "{}", via.describe());
    assert_eq!(matched as usize, common / 16 * 16, "{}", via.describe());
    assert!(matched >= 256, "{}", via.describe());

    let metrics = kvlb.admin_get("/metrics").body_text();
    let counter = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from /metrics"))
    };
    assert!(counter("kvlb_tokenized_requests_total") >= 1);
    assert_eq!(counter("kvlb_tokenize_errors_total"), 0);

    // A chat body the template refuses is still routed (text mode) and counted.
    let refused =
        br#"{"model": "m", "max_tokens": 1, "messages": [{"role": "wizard", "content": "hi"}]}"#;
    let r = post(kvlb.listen, "/v1/chat/completions", refused);
    assert!(r.header("x-kvlb-replica").is_some(), "{}", r.describe());
    let metrics = kvlb.admin_get("/metrics").body_text();
    assert!(
        metrics.contains("kvlb_tokenize_errors_total 1"),
        "{metrics}"
    );
}

#[test]
fn bad_tokenizer_files_exit_2_naming_the_key() {
    let dir = TempDir::new("tokenizer-bad");
    std::fs::write(dir.file("tokenizer.json"), "{\"not\": \"a tokenizer\"}").unwrap();
    let missing = dir.file("missing.json");
    let cases: [(Vec<String>, &str); 3] = [
        (
            vec!["--tokenizer".into(), missing.display().to_string()],
            "tokenizer",
        ),
        (
            vec![
                "--tokenizer".into(),
                dir.file("tokenizer.json").display().to_string(),
            ],
            "not a Hugging Face tokenizer.json",
        ),
        (
            vec!["--chat-template".into(), missing.display().to_string()],
            "chat_template",
        ),
    ];
    for (args, says) in cases {
        let mut all = vec!["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"];
        all.extend(args.iter().map(String::as_str));
        let f = match Kvlb::try_serve_raw(&all) {
            Err(f) => f,
            Ok(_) => panic!("kvlb serve {all:?} started"),
        };
        assert_eq!(f.status.and_then(|s| s.code()), Some(2), "{}", f.stderr);
        assert!(f.stderr.contains(says), "{args:?}: {}", f.stderr);
    }
    // A good tokenizer with a broken template.
    fixture::write_chatml(&dir.path).unwrap();
    std::fs::write(dir.file("broken.jinja"), "{% for %}").unwrap();
    let (tok, tpl) = (
        dir.file("tokenizer.json").display().to_string(),
        dir.file("broken.jinja").display().to_string(),
    );
    let f = Kvlb::try_serve_raw(&[
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--tokenizer",
        &tok,
        "--chat-template",
        &tpl,
    ])
    .err()
    .expect("a broken template is refused");
    assert_eq!(f.status.and_then(|s| s.code()), Some(2), "{}", f.stderr);
    assert!(
        f.stderr.contains("chat_template") && f.stderr.contains("does not compile"),
        "{}",
        f.stderr
    );
}

/// $KVLB_PYTHON, else the venv tests/run.sh keeps, else python3.
fn python() -> String {
    std::env::var("KVLB_PYTHON").unwrap_or_else(|_| {
        let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python");
        if std::path::Path::new(venv).exists() {
            venv.to_string()
        } else {
            "python3".to_string()
        }
    })
}

#[test]
fn token_ids_equal_transformers_rendering_and_python_tokenizers() {
    let py = python();
    let has_modules = Command::new(&py)
        .args(["-c", "import tokenizers, jinja2"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    // As the other Python-backed tests: fail, never skip, without the packages.
    assert!(
        has_modules,
        "{py} cannot import tokenizers and jinja2. Run `bash tests/run.sh` once (it creates \
         .venv from tests/py/requirements.txt), or point KVLB_PYTHON at an interpreter that has them."
    );
    let dir = TempDir::new("tokenizer-crosscheck");
    fixture::write_chatml(&dir.path).unwrap();
    let t = ChatTokenizer::load(&dir.file("tokenizer.json"), None).unwrap();
    // Conversations with tools (key order kept), tool calls, unicode and special tokens in
    // content, several turns.
    let bodies: Vec<String> = (0..40)
        .map(|i| {
            let mut messages = vec![json!({"role": "system", "content": format!("You are assistant {i}. Ünïcödé 日本 <|im_end|> ok")})];
            for turn in 0..(i % 5 + 1) {
                messages.push(json!({"role": "user", "content": format!("question {turn}:\n  the weather in Paris? {}", "ab ".repeat(i))}));
                if turn % 2 == 1 {
                    messages.push(json!({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"zeta": 1, "city": "Paris", "alpha": [1.5, null, true]}}}]}));
                    messages.push(json!({"role": "tool", "content": "{\"temp\": 21}"}));
                }
                messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
            }
            messages.push(json!({"role": "user", "content": "and tomorrow?"}));
            // Built as text so the tool schema's keys keep an order serde_json would sort. The
            // tool is given as vLLM dumps it (name, description, parameters), which is what
            // the template sees: hf_chat_tokens.py renders the body's tools as they are.
            let tools = if i % 2 == 0 {
                r#", "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "description": "née"}}}}}]"#
            } else {
                ""
            };
            format!(r#"{{"messages": {}{tools}}}"#, Value::from(messages))
        })
        .collect();
    let mut child = Command::new(&py)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/py/hf_chat_tokens.py"
        ))
        .arg(dir.file("tokenizer.json"))
        .arg(dir.file("tokenizer_config.json"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn python");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        for b in &bodies {
            writeln!(stdin, "{b}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "hf_chat_tokens.py failed");
    let lines: Vec<&str> = std::str::from_utf8(&out.stdout).unwrap().lines().collect();
    assert_eq!(lines.len(), bodies.len());
    let mut cache = kvlb::tokenize::SegmentCache::new(256, 1 << 16);
    let mut ids = Vec::new();
    for (body, line) in bodies.iter().zip(lines) {
        let expected: Vec<u32> = serde_json::from_str(line).unwrap();
        t.request_tokens(
            b"/v1/chat/completions",
            body.as_bytes(),
            &mut cache,
            &mut ids,
        )
        .unwrap();
        assert_eq!(ids, expected, "{body}");
        assert_eq!(t.chat_tokens_whole(body.as_bytes()).unwrap(), expected);
    }
}

/// The Responses and Messages APIs in token mode: kvlb converts their bodies to the chat the
/// engine renders for them (as the replica does, following vLLM), so a request sharing a long
/// instruction block with one a replica has served goes there, the shared full blocks matched.
#[test]
fn agent_api_prompts_hash_to_the_engines_blocks() {
    use kvlb::tokenize::agent;
    let dir = TempDir::new("tokenizer-mode-agents");
    fixture::write_chatml(&dir.path).unwrap();
    let tokenizer_path = dir.file("tokenizer.json");
    let tokenizer_arg = tokenizer_path.to_str().unwrap();
    let reps = ReplicaFleet::start(2, &["--time-scale", "50", "--tokenizer", tokenizer_arg]);
    let http = &reps.http;
    let kvlb = serve_subscribed(&reps, "", &["--tokenizer", tokenizer_arg]);
    let t = ChatTokenizer::load(&tokenizer_path, None).unwrap();
    let system = "You are a coding agent. Read the code before changing it, run the tests after \
        every change and explain what you did in one sentence. "
        .repeat(20);
    // Each API its own instructions: a replica that served one holds nothing of the other's
    // prompt (a few shared blocks would leave the two replicas within a tie of each other).
    let messages_system = format!("Anthropic. {system}");
    let responses = |input: &str| -> Value {
        json!({"model": "Qwen/Qwen3-8B", "instructions": system, "max_output_tokens": 1,
            "tools": [{"type": "function", "name": "read_file", "description": "Read a file.",
                       "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "input": [{"role": "user", "content": [{"type": "input_text", "text": input}]}]})
    };
    let messages = |input: &str| -> Value {
        json!({"model": "Qwen/Qwen3-8B", "max_tokens": 1,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=7f3a;"},
                       {"type": "text", "text": messages_system, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": input}]})
    };
    for (path, served_by, first, second) in [
        (
            "/v1/responses",
            1,
            responses("Fix the parser."),
            responses("Add a test."),
        ),
        (
            "/v1/messages",
            0,
            messages("Fix the parser."),
            messages("Add a test."),
        ),
    ] {
        let direct = post(http[served_by], path, first.to_string().as_bytes());
        assert_eq!(direct.status, 200, "{}", direct.describe());
        assert!(
            replica_count_reaches(&kvlb, served_by, "resident_blocks", 32, T),
            "{path}: kvlb did not learn replica {served_by}'s blocks: {:?}",
            replicas_json(&kvlb)
        );
        let via = post(kvlb.listen, path, second.to_string().as_bytes());
        assert_eq!(via.status, 200, "{}", via.describe());
        assert_eq!(
            via.header("x-kvlb-replica"),
            Some(format!("http://{}", http[served_by]).as_str()),
            "{path}: {}",
            via.describe()
        );
        let tokens = |body: &Value| {
            let chat = match path {
                "/v1/responses" => agent::responses_to_chat(body, None).unwrap(),
                _ => agent::messages_to_chat(body, t.merges_inline_system()).unwrap(),
            };
            t.chat_tokens_whole(chat.to_string().as_bytes()).unwrap()
        };
        let (a, b) = (tokens(&first), tokens(&second));
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        let (reason, matched) = decision(&via);
        assert_eq!(reason, "cache", "{path}: {}", via.describe());
        assert_eq!(
            matched as usize,
            common / 16 * 16,
            "{path}: {}",
            via.describe()
        );
        assert!(matched >= 256, "{path}: {}", via.describe());
    }
    let metrics = kvlb.admin_get("/metrics").body_text();
    assert!(
        metrics.contains("kvlb_tokenize_errors_total 0"),
        "{metrics}"
    );
}
