//! kvlb's Responses API and Anthropic Messages API conversions (`kvlb::tokenize::agent`)
//! against vLLM 0.33.0's own: tests/py/engines/agent_convert.py runs vLLM's
//! `construct_input_messages` / `construct_tool_dicts` (what `OnlineRenderer.render_responses`
//! renders) and `AnthropicServingMessages.to_chat_completion_request`, unmodified, on every case
//! of tests/corpus/agent_conversion.jsonl. Both must refuse a case, or both convert it to the
//! same prompt:
//! * the same `tools` (key order included: templates print them with `tojson`) and, for
//!   Messages, the same `tool_choice`;
//! * the same conversation for the template: vLLM's own chat parser (`parse_chat_messages`,
//!   which vLLM runs on either result before the template) makes the same of kvlb's messages
//!   as of vLLM's, in both content formats ("string" and "openai");
//! * the same template variables (add_generation_prompt, continue_final_message,
//!   reasoning_effort, enable_thinking, chat_template_kwargs), kvlb's read from its chat body
//!   as vLLM's chat completions path reads them.
//!
//! The interpreter and the engine sources come from tests/support/engines.rs, as for the
//! engine event tests: $KVLB_PYTHON, else the repository's .venv (tests/run.sh creates it from
//! tests/py/requirements.txt), and $KVLB_ENGINE_SRC, else what tests/py/engines/fetch.py
//! fetches. Without them the test fails (never a skip).

#[path = "support/mod.rs"]
mod support;

use kvlb::tokenize::agent::{messages_to_chat, responses_to_chat, PreviousTurn};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The interpreter and the engine sources.
fn environment() -> (PathBuf, PathBuf) {
    (support::engines::python(), support::engines::engine_src())
}

/// The corpus cases, each with its line as written (handed to vLLM as it is: the key order of a
/// request is part of it, as Python keeps it).
fn corpus() -> Vec<(String, Value)> {
    let path = repo().join("tests/corpus/agent_conversion.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let case = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{}:{}: not JSON: {e}", path.display(), i + 1));
            (l.to_string(), case)
        })
        .collect()
}

/// Runs vLLM's conversions on `cases`, JSON lines (one answer per case, in order).
fn vllm(python: &Path, src: &Path, cases: &[String]) -> Vec<Value> {
    let script = repo().join("tests/py/engines/agent_convert.py");
    let mut child = Command::new(python)
        .arg(&script)
        .env("KVLB_ENGINE_SRC", src)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", script.display()));
    let mut input = String::new();
    for case in cases {
        input.push_str(case);
        input.push('\n');
    }
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    let written = writer.join().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && written.is_ok(),
        "{} failed ({}; stdin: {written:?}):\n{stderr}",
        script.display(),
        out.status
    );
    let answers: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad answer {l:?}: {e}")))
        .collect();
    assert_eq!(
        answers.len(),
        cases.len(),
        "{} answered {} of {} cases:\n{stderr}",
        script.display(),
        answers.len(),
        cases.len()
    );
    answers
}

/// kvlb's conversion of a corpus case.
fn kvlb_convert(case: &Value) -> Result<Value, String> {
    let body = &case["body"];
    let result = match case["api"].as_str() {
        Some("responses") => {
            let previous = case.get("previous").map(|p| PreviousTurn {
                messages: p["messages"].as_array().cloned().unwrap_or_default(),
                output: p["output"].as_array().cloned().unwrap_or_default(),
            });
            responses_to_chat(body, previous.as_ref())
        }
        Some("messages") => {
            messages_to_chat(body, case["merge_inline_system"].as_bool().unwrap_or(false))
        }
        other => panic!("case {}: unknown api {other:?}", case["name"]),
    };
    result.map_err(|e| e.to_string())
}

/// Where `a` and `b` differ (in key order too when `ordered`), as JSON paths with both sides
/// (at most 12).
fn differences(a: &Value, b: &Value, ordered: bool, path: &str, out: &mut Vec<String>) {
    const LIMIT: usize = 12;
    if out.len() >= LIMIT || identical(a, b) || (!ordered && a == b) {
        return;
    }
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let same_keys = x.len() == y.len() && x.keys().all(|k| y.contains_key(k));
            if ordered && same_keys && !x.keys().eq(y.keys()) {
                let keys =
                    |m: &serde_json::Map<String, Value>| m.keys().cloned().collect::<Vec<_>>();
                out.push(format!(
                    "{path}: key order: vLLM {:?}, kvlb {:?}",
                    keys(x),
                    keys(y)
                ));
            }
            for (k, v) in x {
                let p = format!("{path}.{k}");
                match y.get(k) {
                    Some(w) => differences(v, w, ordered, &p, out),
                    None => out.push(format!("{p}: vLLM {v}, kvlb has no such key")),
                }
            }
            for (k, w) in y {
                if !x.contains_key(k) && out.len() < LIMIT {
                    out.push(format!("{path}.{k}: vLLM has no such key, kvlb {w}"));
                }
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            for (i, (v, w)) in x.iter().zip(y).enumerate() {
                differences(v, w, ordered, &format!("{path}[{i}]"), out);
            }
            if x.len() != y.len() && out.len() < LIMIT {
                out.push(format!("{path}: vLLM {} items, kvlb {}", x.len(), y.len()));
            }
        }
        _ => out.push(format!("{path}: vLLM {a}, kvlb {b}")),
    }
}

/// Equal, with the same key order in every object: a template's `tojson` prints keys in
/// order.
fn identical(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|((k, v), (l, w))| k == l && identical(v, w))
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(v, w)| identical(v, w))
        }
        _ => a == b,
    }
}

/// The head of vLLM's error (a pydantic error lists every union member it tried).
fn short(error: &Value) -> String {
    let text = error.as_str().unwrap_or_default();
    let head: Vec<&str> = text.lines().take(3).collect();
    let mut head = head.join(" | ");
    if head.len() > 400 {
        let cut = (0..=400)
            .rev()
            .find(|&i| head.is_char_boundary(i))
            .unwrap_or(0);
        head.truncate(cut);
        head.push_str(" ...");
    }
    head
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap()
}

/// One field compared: `None` when equal (with the same key order when `ordered`), else the
/// report.
fn compare_as(field: &str, want: &Value, got: &Value, ordered: bool) -> Option<String> {
    if identical(want, got) || (!ordered && want == got) {
        return None;
    }
    let mut diffs = Vec::new();
    differences(want, got, ordered, field, &mut diffs);
    let mut report = format!("  {field} differs:\n");
    for d in diffs {
        let _ = writeln!(report, "    {d}");
    }
    let _ = write!(
        report,
        "    vLLM {field}:\n{}\n    kvlb {field}:\n{}\n",
        indent(&pretty(want)),
        indent(&pretty(got))
    );
    Some(report)
}

/// A field the template prints (tools, messages, the conversation): key order counts, as
/// `tojson` keeps it.
fn compare(field: &str, want: &Value, got: &Value) -> Option<String> {
    compare_as(field, want, got, true)
}

/// `s` indented for a report, cut after 60 lines.
fn indent(s: &str) -> String {
    const LINES: usize = 60;
    let mut out: Vec<String> = s
        .lines()
        .take(LINES)
        .map(|l| format!("      {l}"))
        .collect();
    let total = s.lines().count();
    if total > LINES {
        out.push(format!("      ... ({} more lines)", total - LINES));
    }
    out.join("\n")
}

/// A field of kvlb's chat body, absent read as null (as vLLM's `None`).
fn field(body: &Value, key: &str) -> Value {
    body.get(key).cloned().unwrap_or(Value::Null)
}

/// The content formats vLLM's chat parser renders a conversation in (agent_convert.py).
const CONTENT_FORMATS: [&str; 2] = ["string", "openai"];

/// Runs the corpus cases of `api` through vLLM and kvlb; panics with every mismatch (see the
/// module's doc). The raw messages may differ where vLLM's chat parser evens the difference
/// out (kvlb gives chat `text` parts where vLLM hands the parser Responses `input_text` parts,
/// and leaves out keys the parser drops): those are listed, not failed.
fn check(api: &str) {
    let (python, src) = environment();
    // kvlb keeps a request's key order (serde_json's preserve_order), as vLLM does.
    let probe: Value = serde_json::from_str(r#"{"b": 1, "a": 2}"#).unwrap();
    assert_eq!(
        probe.as_object().unwrap().keys().next().map(String::as_str),
        Some("b"),
        "serde_json sorts object keys here (no preserve_order): kvlb would not keep the key \
         order vLLM prints"
    );
    let (lines, cases): (Vec<String>, Vec<Value>) = corpus()
        .into_iter()
        .filter(|(_, c)| c["api"] == api)
        .unzip();
    assert!(!cases.is_empty(), "no {api} cases in the corpus");
    let answers = vllm(&python, &src, &lines);
    for (case, answer) in cases.iter().zip(&answers) {
        assert_eq!(case["name"], answer["name"], "answers out of order");
    }
    let heads: Vec<String> = cases
        .iter()
        .map(|case| {
            let name = case["name"].as_str().unwrap_or("?");
            match case.get("note").and_then(Value::as_str) {
                Some(note) => format!("case {name} ({note})"),
                None => format!("case {name}"),
            }
        })
        .collect();

    // (case index, report): a mismatch; raw message differences are listed apart.
    let mut reports: Vec<(usize, String)> = Vec::new();
    let mut raw_notes = Vec::new();
    let mut converted: Vec<(usize, String)> = Vec::new();
    let mut both_refused = 0;
    for (i, (case, want)) in cases.iter().zip(&answers).enumerate() {
        let head = &heads[i];
        let got = kvlb_convert(case);
        match (want["ok"].as_bool(), &got) {
            (Some(false), Err(_)) => both_refused += 1,
            (Some(false), Ok(chat)) => reports.push((
                i,
                format!(
                    "{head}: vLLM refuses it ({}), kvlb converts it to\n{}",
                    short(&want["error"]),
                    indent(&pretty(chat))
                ),
            )),
            (Some(true), Err(e)) => reports.push((
                i,
                format!(
                    "{head}: vLLM converts it to\n{}\n  kvlb refuses it: {e}",
                    indent(&pretty(&json!({
                        "messages": want["messages"],
                        "tools": want["tools"],
                    })))
                ),
            )),
            (Some(true), Ok(chat)) => {
                let mut fields = vec![compare("tools", &want["tools"], &field(chat, "tools"))];
                if api == "messages" {
                    // Not a template variable: its key order does not show.
                    fields.push(compare_as(
                        "tool_choice",
                        &want["tool_choice"],
                        &field(chat, "tool_choice"),
                        false,
                    ));
                }
                let fields: Vec<String> = fields.into_iter().flatten().collect();
                if !fields.is_empty() {
                    reports.push((i, format!("{head}:\n{}", fields.concat())));
                }
                // The chat parser rebuilds each message: key order here does not show.
                let raw = compare_as(
                    "messages",
                    &want["messages"],
                    &field(chat, "messages"),
                    false,
                );
                if let Some(r) = raw {
                    raw_notes.push(format!("{head}:\n{r}"));
                }
                let name = case["name"].as_str().unwrap_or("?");
                let request = json!({"name": name, "api": "template", "body": chat});
                converted.push((i, request.to_string()));
            }
            (None, _) => panic!("{head}: bad answer {want}"),
        }
    }

    // kvlb's bodies at vLLM's template stage: the conversation and template variables.
    let requests: Vec<String> = converted.iter().map(|(_, r)| r.clone()).collect();
    let read = if requests.is_empty() {
        Vec::new()
    } else {
        vllm(&python, &src, &requests)
    };
    for ((i, _), got) in converted.iter().zip(&read) {
        let (i, head, want) = (*i, &heads[*i], &answers[*i]);
        if got["ok"] != true {
            reports.push((
                i,
                format!(
                    "{head}: vLLM's chat path refuses the template variables of kvlb's body: {}",
                    short(&got["error"])
                ),
            ));
            continue;
        }
        for format in CONTENT_FORMATS {
            let (w, g) = (&want["conversation"][format], &got["conversation"][format]);
            let label = format!("conversation[{format}]");
            match (w["ok"] == true, g["ok"] == true) {
                (true, true) => {
                    if let Some(r) = compare(&label, &w["messages"], &g["messages"]) {
                        reports.push((i, format!("{head}: what the template renders\n{r}")));
                    }
                }
                (false, false) => {}
                _ => reports.push((
                    i,
                    format!(
                        "{head}: vLLM's chat parser ({format} format) on vLLM's messages: {}; \
                         on kvlb's: {}",
                        outcome(w),
                        outcome(g)
                    ),
                )),
            }
        }
        // Named template variables: their order does not show.
        if let Some(r) = compare_as(
            "chat_template_kwargs",
            &want["chat_template_kwargs"],
            &got["chat_template_kwargs"],
            false,
        ) {
            reports.push((i, format!("{head}: template variables\n{r}")));
        }
    }

    let differing: std::collections::BTreeSet<usize> = reports.iter().map(|(i, _)| *i).collect();
    let alike = converted
        .iter()
        .filter(|(i, _)| !differing.contains(i))
        .count();
    eprintln!(
        "{api}: {} cases: {alike} converted alike, {both_refused} refused by both, {} differ; \
         {} with differences in the raw messages (listed below)",
        cases.len(),
        differing.len(),
        raw_notes.len()
    );
    if !raw_notes.is_empty() {
        eprintln!(
            "raw message differences (not failures: the conversation is compared):\n\n{}",
            raw_notes.join("\n\n")
        );
    }
    reports.sort_by_key(|(i, _)| *i);
    let reports: Vec<String> = reports.into_iter().map(|(_, r)| r).collect();
    assert!(
        reports.is_empty(),
        "{} of {} {api} cases differ from vLLM 0.33.0:\n\n{}",
        differing.len(),
        cases.len(),
        reports.join("\n\n")
    );
}

/// A chat parser answer in a few words: "ok" or the head of its error.
fn outcome(answer: &Value) -> String {
    if answer["ok"] == true {
        "ok".into()
    } else {
        short(&answer["error"])
    }
}

#[test]
fn responses_api_conversion_matches_vllm() {
    check("responses");
}

#[test]
fn messages_api_conversion_matches_vllm() {
    check("messages");
}

/// The corpus stays well-formed: unique names, known APIs, the fields each API reads.
#[test]
fn corpus_cases_are_well_formed() {
    let cases: Vec<Value> = corpus().into_iter().map(|(_, c)| c).collect();
    let mut names = std::collections::HashSet::new();
    for case in &cases {
        let name = case["name"].as_str().expect("every case has a name");
        assert!(names.insert(name.to_string()), "duplicate case {name}");
        assert!(
            case["body"].is_object(),
            "case {name}: body is not an object"
        );
        match case["api"].as_str() {
            Some("responses") => assert!(
                case.get("merge_inline_system").is_none(),
                "case {name}: merge_inline_system is for messages"
            ),
            Some("messages") => assert!(
                case["merge_inline_system"].is_boolean() && case.get("previous").is_none(),
                "case {name}: a messages case says merge_inline_system, and has no previous"
            ),
            other => panic!("case {name}: unknown api {other:?}"),
        }
    }
    for api in ["responses", "messages"] {
        assert!(
            cases.iter().filter(|c| c["api"] == api).count() >= 20,
            "fewer than 20 {api} cases"
        );
    }
}

/// Chat bodies beyond the agent APIs' conversions: tool calls with arguments as JSON strings
/// (valid, invalid, not an object, empty), reasoning, template kwargs and top-level overrides,
/// and continue_final_message.
fn chat_bodies() -> Vec<Value> {
    let call = |id: &str, args: Value| json!({"id": id, "type": "function", "function": {"name": "get_weather", "arguments": args}});
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    vec![
        json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": ""}, {"type": "text", "text": "In Paris"}]},
            {"role": "assistant", "tool_calls": [
                call("c1", json!("{\"city\": \"Paris\", \"unit\": \"celsius\", \"n\": [1, 2.5, null]}")),
                call("c2", json!("not json")),
                call("c3", json!("[1, 2]")),
                call("c4", json!("")),
                call("c5", json!({"city": "Zürich"}))]},
            {"role": "tool", "tool_call_id": "c1", "content": "20"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "Sunny.", "reasoning": "look it up"},
            {"role": "user", "content": "Thanks", "name": "bob"}
        ], "tools": tools}),
        json!({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false,
               "reasoning_effort": "high", "chat_template_kwargs": {"add_generation_prompt": true, "enable_thinking": false}}),
        json!({"messages": [{"role": "user", "content": "Tell me a story"},
                            {"role": "assistant", "content": "Once upon a time "}],
               "add_generation_prompt": false, "continue_final_message": true}),
        json!({"messages": [{"role": "assistant", "tool_calls": []}, {"role": "user", "content": "x"}],
               "chat_template_kwargs": {"tools": [{"type": "function", "function": {"name": "kw"}}]}}),
    ]
}

/// kvlb's rendering of chat bodies (the corpus cases' conversions, and [`chat_bodies`]) with
/// the fixture's Qwen-style template against vLLM's chat parser and template variables
/// rendered by jinja2 as transformers renders them: the same prompt, byte for byte.
#[test]
fn chat_rendering_matches_vllm() {
    let (python, src) = environment();
    let dir = support::TempDir::new("agent-render");
    kvlb::tokenize::fixture::write_chatml(&dir.path).unwrap();
    let tokenizer = kvlb::tokenize::ChatTokenizer::load(&dir.file("tokenizer.json"), None).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.file("tokenizer_config.json")).unwrap())
            .unwrap();
    let template = config["chat_template"].as_str().unwrap();
    let mut special = serde_json::Map::new();
    for key in ["bos_token", "eos_token"] {
        // transformers hands the template the special tokens the tokenizer has.
        if let Some(t) = config[key].as_str() {
            special.insert(key.into(), Value::String(t.into()));
        }
    }
    let mut bodies: Vec<(String, Value)> = Vec::new();
    // Media parts are left out: a text model's prompt has no image placeholders (vLLM's
    // stand-in parser here puts `<image>` where a multimodal model's processor would).
    let media = |chat: &Value| {
        let text = chat["messages"].to_string();
        text.contains("\"image_url\"") || text.contains("\"input_image\"")
    };
    for (_, case) in corpus() {
        if let Ok(chat) =
            kvlb_convert(&case).map_err(|_| ()).and_then(
                |c| {
                    if media(&c) {
                        Err(())
                    } else {
                        Ok(c)
                    }
                },
            )
        {
            bodies.push((case["name"].as_str().unwrap_or("?").to_string(), chat));
        }
    }
    for (i, body) in chat_bodies().into_iter().enumerate() {
        bodies.push((format!("chat_body_{i}"), body));
    }
    let requests: Vec<String> = bodies
        .iter()
        .map(|(name, body)| {
            json!({"name": name, "api": "render", "body": body, "template": template,
                   "special_tokens": special})
            .to_string()
        })
        .collect();
    let answers = vllm(&python, &src, &requests);
    let mut reports = Vec::new();
    let mut rendered = 0;
    for ((name, body), want) in bodies.iter().zip(&answers) {
        let got = tokenizer.render_chat(body.to_string().as_bytes());
        match (want["ok"] == true, &got) {
            (true, Ok(text)) => {
                rendered += 1;
                if want["prompt"].as_str() != Some(text.as_str()) {
                    reports.push(format!(
                        "{name}: prompts differ\n  vLLM: {:?}\n  kvlb: {text:?}",
                        want["prompt"].as_str().unwrap_or_default()
                    ));
                }
            }
            (false, Err(_)) => {}
            (true, Err(e)) => reports.push(format!("{name}: vLLM renders it, kvlb: {e}")),
            (false, Ok(_)) => reports.push(format!(
                "{name}: vLLM refuses it ({}), kvlb renders it",
                short(&want["error"])
            )),
        }
    }
    eprintln!(
        "{} bodies: {rendered} rendered by both, {} differ",
        bodies.len(),
        reports.len()
    );
    assert!(rendered > 80, "only {rendered} bodies rendered");
    assert!(
        reports.is_empty(),
        "{} of {} chat bodies render differently from vLLM 0.33.0:\n\n{}",
        reports.len(),
        bodies.len(),
        reports.join("\n\n")
    );
}
