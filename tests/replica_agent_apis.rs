//! `kvlb replica` serving the agent APIs as vLLM 0.33 does, end to end over real sockets: the
//! Responses API (JSON and events, the in-memory store, `previous_response_id` and its 404,
//! prefix reuse across turns), Anthropic's Messages API (JSON, events, count_tokens, errors in
//! Anthropic's shape), the pooling endpoints (embeddings, rerank, score) and /detokenize; with
//! the simulated tokenizer and with a Hugging Face tokenizer and chat template made in the test.

#[path = "support/mod.rs"]
mod support;

use kvlb::tokenize::{agent, fixture, ChatTokenizer};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use support::client::HttpConn;
use support::{Response, TempDir};

/// A running `kvlb replica` process, killed on drop (also when a test panics).
struct ReplicaProcess {
    child: Child,
    addr: SocketAddr,
}

impl Drop for ReplicaProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> ReplicaProcess {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .arg("replica")
        .args([
            "--listen",
            "127.0.0.1:0",
            "--time-scale",
            "100",
            "--block-size",
            "16",
        ])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvlb replica");
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let mut addr = None;
    loop {
        let line = lines.next().expect("replica exited before ready").unwrap();
        if line == "kvlb replica: ready" {
            break;
        }
        if let Some(rest) = line.strip_prefix("kvlb replica: replica ") {
            addr = Some(rest.split_whitespace().nth(2).unwrap().parse().unwrap());
        }
    }
    std::thread::spawn(move || for _ in lines {});
    ReplicaProcess {
        child,
        addr: addr.expect("no address line"),
    }
}

/// What these tests read of an answer, beside support's `Response`.
trait Answer {
    /// The body as JSON (a panic naming the body when it is not).
    fn json_value(&self) -> Value;
    fn text(&self) -> String;
    /// The server-sent events of the body: (event name, data as JSON).
    fn events(&self) -> Vec<(String, Value)>;
}

impl Answer for Response {
    fn json_value(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
    fn text(&self) -> String {
        self.body_text()
    }
    fn events(&self) -> Vec<(String, Value)> {
        let text = self.text();
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (head, data) = e.split_once('\n').unwrap_or_else(|| panic!("{e:?}"));
                let name = head
                    .strip_prefix("event: ")
                    .unwrap_or_else(|| panic!("{e:?}"));
                let data = data
                    .strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("{e:?}"));
                (name.to_string(), serde_json::from_str(data).unwrap())
            })
            .collect()
    }
}

/// One request on a new connection, with a JSON content type and `headers`.
fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Response {
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    HttpConn::connect(addr)
        .request(method, path, &all, body.as_bytes())
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Response {
    request_with(addr, method, path, &[], body)
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Response {
    request(addr, "POST", path, &body.to_string())
}

/// Anthropic's client headers (accepted and ignored, as vLLM ignores them).
const ANTHROPIC: [(&str, &str); 2] = [
    ("x-api-key", "sk-unused"),
    ("anthropic-version", "2023-06-01"),
];

/// A few hundred words, so a prompt spans many KV blocks.
fn long_text() -> String {
    "The balancer routes each request to the replica that minimises the estimated time to \
     first token, counting queueing and the prefill of the uncached part of its prompt. "
        .repeat(12)
}

#[test]
fn responses_answer_store_retrieve_and_cancel_like_vllm() {
    let p = start(&["--model", "sim/model"]);
    let a = p.addr;
    let r = post(
        a,
        "/v1/responses",
        &json!({"model": "sim/model", "input": "Say hello.", "instructions": "Be brief.", "max_output_tokens": 5}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.text().starts_with("{\"id\":\"resp_"),
        "the id is the first key: {}",
        r.text()
    );
    let j = r.json_value();
    let id = j["id"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 5 + 32);
    assert_eq!(
        (j["object"].as_str(), j["model"].as_str()),
        (Some("response"), Some("sim/model"))
    );
    assert_eq!(
        (j["instructions"].as_str(), j["max_output_tokens"].as_u64()),
        (Some("Be brief."), Some(5))
    );
    assert!(j["previous_response_id"].is_null());
    assert_eq!(j["tool_choice"], "none");
    let status = j["status"].as_str().unwrap();
    assert!(status == "completed" || status == "incomplete", "{status}");
    assert_eq!(j["incomplete_details"].is_null(), status == "completed");
    let item = &j["output"][0];
    assert_eq!(
        (item["type"].as_str(), item["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert!(item["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(item["content"][0]["type"], "output_text");
    assert!(!item["content"][0]["text"].as_str().unwrap().is_empty());
    let u = &j["usage"];
    let (input, output) = (
        u["input_tokens"].as_u64().unwrap(),
        u["output_tokens"].as_u64().unwrap(),
    );
    assert!(input > 0 && (1..=5).contains(&output), "{u}");
    assert_eq!(u["total_tokens"].as_u64(), Some(input + output));
    assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 0);
    // The prompt is the chat rendering of [system, user], as vLLM renders it.
    let t = post(
        a,
        "/tokenize",
        &json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]}),
    )
    .json_value();
    assert_eq!(t["count"].as_u64(), Some(input));

    // Stored: GET answers the same response; cancelling a finished one is refused.
    let g = request(a, "GET", &format!("/v1/responses/{id}"), "");
    assert_eq!((g.status, g.json_value()), (200, j.clone()));
    let c = request(a, "POST", &format!("/v1/responses/{id}/cancel"), "");
    assert_eq!(c.status, 400);
    assert_eq!(
        c.json_value(),
        json!({"error": {"message": "Cannot cancel a synchronous response.", "type": "invalid_request_error", "param": "response_id", "code": 400}})
    );
    // Unknown ids: vLLM's 404, for GET, cancel and previous_response_id alike.
    let missing = json!({"error": {"message": "Response with id 'resp_nope' not found.", "type": "invalid_request_error", "param": "response_id", "code": 404}});
    for r in [
        request(a, "GET", "/v1/responses/resp_nope", ""),
        request(a, "POST", "/v1/responses/resp_nope/cancel", ""),
        post(
            a,
            "/v1/responses",
            &json!({"input": "x", "previous_response_id": "resp_nope"}),
        ),
    ] {
        assert_eq!((r.status, r.json_value()), (404, missing.clone()));
    }
    // store: false is answered, not stored.
    let r = post(
        a,
        "/v1/responses",
        &json!({"input": "x", "store": false, "max_output_tokens": 2}),
    )
    .json_value();
    let g = request(
        a,
        "GET",
        &format!("/v1/responses/{}", r["id"].as_str().unwrap()),
        "",
    );
    assert_eq!(g.status, 404);
    // Without max_output_tokens the replica's default length (16) ends the answer, as the
    // model's own stop would: completed, not incomplete.
    let d = post(a, "/v1/responses", &json!({"input": "x"})).json_value();
    assert_eq!(
        (d["status"].as_str(), d["max_output_tokens"].as_u64()),
        (Some("completed"), Some(16))
    );
    assert!(d["incomplete_details"].is_null());
    assert_eq!(d["usage"]["output_tokens"], 16);
    // Methods and malformed requests: 4xx with vLLM's error body, and the replica keeps serving.
    assert_eq!(request(a, "GET", "/v1/responses", "").status, 405);
    assert_eq!(
        request(a, "POST", &format!("/v1/responses/{id}"), "").status,
        405
    );
    assert_eq!(
        request(a, "GET", &format!("/v1/responses/{id}/cancel"), "").status,
        405
    );
    for (body, status) in [
        ("{not json", 400),
        ("[1]", 400),
        ("{}", 400),
        (r#"{"input": 5}"#, 400),
        (r#"{"input": [{"type": "item_reference", "id": "x"}]}"#, 400),
        (r#"{"input": "x", "tool_choice": "required"}"#, 400),
        (r#"{"input": "x", "background": true}"#, 400),
        (r#"{"input": "x", "model": "other/model"}"#, 404),
        (r#"{"input": "x", "max_output_tokens": -1}"#, 400),
        (
            r#"{"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}"#,
            400,
        ),
    ] {
        let r = request(a, "POST", "/v1/responses", body);
        assert_eq!(r.status, status, "{body}: {}", r.text());
        let e = r.json_value();
        assert_eq!(
            e["error"]["code"].as_u64(),
            Some(status as u64),
            "{body}: {e}"
        );
        assert!(e["error"]["message"].is_string());
    }
    let e = request(
        a,
        "POST",
        "/v1/responses",
        r#"{"input": [{"type": "item_reference", "id": "x"}]}"#,
    )
    .json_value();
    assert_eq!(
        e["error"]["message"],
        "Unsupported input item type: item_reference"
    );
    assert_eq!(request(a, "GET", "/health", "").status, 200);
}

#[test]
fn responses_stream_vllm_events_in_sequence() {
    let p = start(&[]);
    let a = p.addr;
    let r = post(
        a,
        "/v1/responses",
        &json!({"input": "Tell me a story.", "stream": true, "max_output_tokens": 6}),
    );
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.events();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "response.output_text.delta")
        .count();
    assert!((1..=6).contains(&deltas), "{names:?}");
    let mut wanted = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    wanted.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    wanted.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]);
    let terminal = *names.last().unwrap();
    assert!(
        terminal == "response.completed" || terminal == "response.incomplete",
        "{terminal}"
    );
    wanted.push(terminal);
    assert_eq!(names, wanted);
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"].as_str(), Some(name.as_str()));
        assert_eq!(data["sequence_number"].as_u64(), Some(i as u64), "{data}");
    }
    // The first event carries the response with its id, in progress.
    let created = &events[0].1["response"];
    let id = created["id"].as_str().unwrap();
    assert!(id.starts_with("resp_"));
    assert_eq!(
        (created["status"].as_str(), created["output"].clone()),
        (Some("in_progress"), json!([]))
    );
    assert!(created["usage"].is_null());
    // Deltas add up to the done text, the final output and the usage.
    let item_id = events[2].1["item"]["id"].as_str().unwrap();
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| {
            assert_eq!(d["item_id"].as_str(), Some(item_id));
            d["delta"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(events[4 + deltas].1["text"].as_str(), Some(text.as_str()));
    let done = &events[6 + deltas].1["item"];
    assert_eq!(
        (done["id"].as_str(), done["content"][0]["text"].as_str()),
        (Some(item_id), Some(text.as_str()))
    );
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["id"].as_str(), Some(id));
    assert_eq!(last["output"][0], *done);
    assert_eq!(last["usage"]["output_tokens"].as_u64(), Some(deltas as u64));
    assert_eq!(
        last["status"].as_str() == Some("incomplete"),
        terminal == "response.incomplete"
    );
    // Stored as it ended.
    let g = request(a, "GET", &format!("/v1/responses/{id}"), "");
    assert_eq!(g.json_value(), *last);
}

#[test]
fn previous_response_id_continues_the_conversation_from_the_cache() {
    let p = start(&[]);
    let a = p.addr;
    let question = long_text();
    let first = post(
        a,
        "/v1/responses",
        &json!({"input": question, "instructions": "Answer briefly.", "max_output_tokens": 4}),
    )
    .json_value();
    let first_input = first["usage"]["input_tokens"].as_u64().unwrap();
    assert!(first_input > 200, "{first_input}");
    assert_eq!(first["usage"]["input_tokens_details"]["cached_tokens"], 0);
    let reply = first["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();

    let second = post(
        a,
        "/v1/responses",
        &json!({"input": "And why?", "instructions": "Answer briefly.", "previous_response_id": first["id"], "max_output_tokens": 4}),
    );
    assert_eq!(second.status, 200, "{}", second.text());
    let second = second.json_value();
    assert_eq!(second["previous_response_id"], first["id"]);
    let input = second["usage"]["input_tokens"].as_u64().unwrap();
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The follow-up's prompt starts with the first prompt: its full blocks come from the cache.
    assert!(
        cached >= first_input / 16 * 16 - 16 && cached <= input,
        "cached {cached} of {input} (first {first_input})"
    );
    // Its prompt is the stored conversation, the stored reply, then the new input.
    let t = post(
        a,
        "/tokenize",
        &json!({"messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And why?"},
        ]}),
    )
    .json_value();
    assert_eq!(t["count"].as_u64(), Some(input));

    // A third turn continues from the second (a chain). Instructions do not carry over (vLLM
    // drops the stored system messages), so the client sends them again to keep the prefix.
    let third = post(
        a,
        "/v1/responses",
        &json!({"input": "Thanks.", "instructions": "Answer briefly.", "previous_response_id": second["id"], "max_output_tokens": 2}),
    )
    .json_value();
    let cached = third["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(third["usage"]["input_tokens"].as_u64().unwrap() > input);
    assert!(cached >= input / 16 * 16 - 16, "{}", third["usage"]);
    // Without them, the conversation starts with the user's message: the prefix is lost.
    let fourth = post(
        a,
        "/v1/responses",
        &json!({"input": "Bye.", "previous_response_id": third["id"], "max_output_tokens": 2}),
    )
    .json_value();
    assert!(
        fourth["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            < 16,
        "{}",
        fourth["usage"]
    );
}

#[test]
fn the_store_is_shared_by_the_ranks_of_a_port() {
    let p = start(&["--dp-size", "2"]);
    let a = p.addr;
    let r = request_with(
        a,
        "POST",
        "/v1/responses",
        &[("X-Data-Parallel-Rank", "0")],
        r#"{"input": "hi", "max_output_tokens": 2}"#,
    )
    .json_value();
    let follow = json!({"input": "again", "previous_response_id": r["id"], "max_output_tokens": 2})
        .to_string();
    let f = request_with(
        a,
        "POST",
        "/v1/responses",
        &[("X-Data-Parallel-Rank", "1")],
        &follow,
    );
    assert_eq!(f.status, 200, "{}", f.text());
    let g = request_with(
        a,
        "GET",
        &format!("/v1/responses/{}", r["id"].as_str().unwrap()),
        &[("X-Data-Parallel-Rank", "1")],
        "",
    );
    assert_eq!(g.status, 200);
}

#[test]
fn messages_answer_like_vllm_anthropic() {
    let p = start(&["--model", "sim/model"]);
    let a = p.addr;
    let system = long_text();
    let body = json!({"model": "sim/model", "max_tokens": 5, "system": system,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is a KV cache?"}]}]});
    let r = request_with(a, "POST", "/v1/messages", &ANTHROPIC, &body.to_string());
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json_value();
    assert!(
        j["id"].as_str().unwrap().starts_with("chatcmpl-"),
        "vLLM answers the chat completion's id"
    );
    assert_eq!(
        (j["type"].as_str(), j["role"].as_str(), j["model"].as_str()),
        (Some("message"), Some("assistant"), Some("sim/model"))
    );
    assert_eq!(j["content"][0]["type"], "text");
    assert!(!j["content"][0]["text"].as_str().unwrap().is_empty());
    let stop = j["stop_reason"].as_str().unwrap();
    assert!(stop == "end_turn" || stop == "max_tokens", "{stop}");
    assert!(
        j.get("stop_sequence").is_none(),
        "vLLM leaves the unset stop_sequence out: {j}"
    );
    // The prompt is [system, user] rendered; usage splits it into uncached and cached tokens.
    let count = request_with(
        a,
        "POST",
        "/v1/messages/count_tokens",
        &ANTHROPIC,
        &body.to_string(),
    )
    .json_value();
    let n = count["input_tokens"].as_u64().unwrap();
    assert_eq!(
        count["context_management"]["original_input_tokens"].as_u64(),
        Some(n)
    );
    let t = post(a, "/tokenize", &json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is a KV cache?"}]})).json_value();
    assert_eq!(t["count"].as_u64(), Some(n));
    let u = &j["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        n
    );
    assert!((1..=5).contains(&u["output_tokens"].as_u64().unwrap()));
    // The same request again reads the prompt from the cache.
    let again = request_with(a, "POST", "/v1/messages", &ANTHROPIC, &body.to_string()).json_value();
    assert!(
        again["usage"]["cache_read_input_tokens"].as_u64().unwrap() >= n / 16 * 16 - 16,
        "{}",
        again["usage"]
    );

    // Streaming: vLLM's Anthropic events.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = request_with(a, "POST", "/v1/messages", &ANTHROPIC, &sbody.to_string());
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.events();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "content_block_delta")
        .count();
    assert!((1..=5).contains(&deltas), "{names:?}");
    let mut wanted = vec!["message_start", "content_block_start"];
    wanted.extend(std::iter::repeat_n("content_block_delta", deltas));
    wanted.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, wanted);
    for (name, data) in &events {
        assert_eq!(data["type"].as_str(), Some(name.as_str()));
    }
    let start = &events[0].1["message"];
    assert_eq!(
        (
            start["type"].as_str(),
            start["role"].as_str(),
            start["content"].clone()
        ),
        (Some("message"), Some("assistant"), json!([]))
    );
    assert_eq!(
        start["usage"],
        json!({"input_tokens": n, "output_tokens": 0})
    );
    assert_eq!(
        events[1].1,
        json!({"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0})
    );
    assert_eq!(events[2].1["delta"]["type"], "text_delta");
    let delta = &events[events.len() - 2].1;
    assert!(
        delta["delta"]["stop_reason"].is_string() && delta["delta"]["stop_sequence"].is_null(),
        "{delta}"
    );
    assert_eq!(
        delta["usage"]["output_tokens"].as_u64(),
        Some(deltas as u64)
    );
    assert_eq!(events.last().unwrap().1, json!({"type": "message_stop"}));

    // Errors in Anthropic's shape, with vLLM's error types.
    for (method, path, body, status, kind) in [
        ("POST", "/v1/messages", "{not json".to_string(), 400, "invalid_request_error"),
        ("POST", "/v1/messages", json!({"model": "sim/model", "messages": []}).to_string(), 400, "invalid_request_error"),
        ("POST", "/v1/messages", json!({"model": "sim/model", "max_tokens": 0, "messages": []}).to_string(), 400, "invalid_request_error"),
        ("POST", "/v1/messages", json!({"model": "other", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}).to_string(), 404, "not_found_error"),
        ("POST", "/v1/messages", json!({"model": "sim/model", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}).to_string(), 400, "invalid_request_error"),
        ("POST", "/v1/messages/count_tokens", json!({"messages": []}).to_string(), 400, "invalid_request_error"),
        ("GET", "/v1/messages", String::new(), 405, "invalid_request_error"),
    ] {
        let r = request_with(a, method, path, &ANTHROPIC, &body);
        assert_eq!(r.status, status, "{body}: {}", r.text());
        let e = r.json_value();
        assert_eq!((e["type"].as_str(), e["error"]["type"].as_str()), (Some("error"), Some(kind)), "{e}");
        assert!(e["error"]["message"].is_string());
    }
}

#[test]
fn pooling_endpoints_answer_at_once() {
    let p = start(&["--model", "sim/model"]);
    let a = p.addr;
    let e = post(
        a,
        "/v1/embeddings",
        &json!({"model": "sim/model", "input": ["hello world", "goodbye"]}),
    );
    assert_eq!(e.status, 200, "{}", e.text());
    let e = e.json_value();
    assert_eq!(
        (e["object"].as_str(), e["model"].as_str()),
        (Some("list"), Some("sim/model"))
    );
    assert!(e["id"].as_str().unwrap().starts_with("embd-"));
    let data = e["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(
        (data[1]["index"].as_u64(), data[1]["object"].as_str()),
        (Some(1), Some("embedding"))
    );
    assert_eq!(data[0]["embedding"].as_array().unwrap().len(), 8);
    assert!(e["usage"]["prompt_tokens"].as_u64().unwrap() >= 3);
    let again = post(a, "/v1/embeddings", &json!({"input": "hello world"})).json_value();
    assert_eq!(
        again["data"][0]["embedding"], data[0]["embedding"],
        "deterministic"
    );
    let ids = post(a, "/v1/embeddings", &json!({"input": [[1, 2, 3], [4]]})).json_value();
    assert_eq!(ids["usage"]["prompt_tokens"], 4);

    let body = json!({"model": "sim/model", "query": "prefix cache", "documents": ["weather in Paris", "the prefix cache of a replica"], "top_n": 1});
    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let r = post(a, path, &body);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let r = r.json_value();
        assert!(r["id"].as_str().unwrap().starts_with("score-"));
        assert_eq!(r["results"].as_array().unwrap().len(), 1);
        assert_eq!(r["results"][0]["index"], 1);
        assert_eq!(
            r["results"][0]["document"]["text"],
            "the prefix cache of a replica"
        );
        assert!(r["usage"]["total_tokens"].as_u64().unwrap() > 0);
    }
    for path in ["/score", "/v1/score"] {
        let s = post(
            a,
            path,
            &json!({"queries": "prefix cache", "documents": ["weather", "prefix cache"]}),
        );
        assert_eq!(s.status, 200, "{path}: {}", s.text());
        let s = s.json_value();
        assert_eq!(
            (s["object"].as_str(), s["data"][0]["object"].as_str()),
            (Some("list"), Some("score"))
        );
        assert!(s["data"][1]["score"].as_f64() > s["data"][0]["score"].as_f64());
    }
    let d = post(a, "/detokenize", &json!({"tokens": [0, 1, 2]})).json_value();
    assert_eq!(d["prompt"], " the of and");
    for (path, body, status) in [
        ("/v1/embeddings", json!({"input": []}), 400),
        (
            "/v1/embeddings",
            json!({"input": "x", "model": "nope"}),
            404,
        ),
        ("/rerank", json!({"documents": ["x"]}), 400),
        (
            "/score",
            json!({"queries": ["a", "b"], "documents": ["a", "b", "c"]}),
            400,
        ),
        ("/detokenize", json!({"tokens": [-3]}), 400),
    ] {
        let r = post(a, path, &body);
        assert_eq!(r.status, status, "{path} {body}: {}", r.text());
        assert!(r.json_value()["error"]["message"].is_string());
    }
    assert_eq!(request(a, "GET", "/v1/embeddings", "").status, 405);
}

/// The same APIs with a Hugging Face tokenizer: the prompt ids are exactly the chat template's
/// rendering of the body `kvlb::tokenize::agent` converts, and a template that wants the system
/// prompt first gets inline system messages merged into it.
#[test]
fn hf_tokenizer_prompts_are_the_converted_chat_bodies() {
    let dir = TempDir::new("agent-apis");
    fixture::write_chatml(&dir.path).unwrap();
    let tokenizer = dir.file("tokenizer.json");
    let p = start(&["--tokenizer", tokenizer.to_str().unwrap()]);
    let a = p.addr;
    let t = ChatTokenizer::load(&tokenizer, None).unwrap();
    let chat_ids = |chat: &Value| {
        t.chat_tokens_whole(chat.to_string().as_bytes())
            .unwrap()
            .len() as u64
    };

    let body = json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Tell me a story about a cat."}]}],
        "instructions": "You are a helpful assistant.", "max_output_tokens": 3,
        "tools": [{"type": "function", "name": "get_weather", "description": "The forecast.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]});
    let r = post(a, "/v1/responses", &body).json_value();
    let expected = chat_ids(&agent::responses_to_chat(&body, None).unwrap());
    assert_eq!(r["usage"]["input_tokens"].as_u64(), Some(expected), "{r}");

    let body = json!({"model": "Qwen/Qwen3-8B", "max_tokens": 3, "system": "You are a helpful assistant.",
        "messages": [{"role": "user", "content": "The weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
        "tools": [{"name": "get_weather", "description": "The forecast.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]});
    let expected = chat_ids(&agent::messages_to_chat(&body, false).unwrap());
    let c = post(a, "/v1/messages/count_tokens", &body).json_value();
    assert_eq!(c["input_tokens"].as_u64(), Some(expected), "{c}");
    let m = post(a, "/v1/messages", &body).json_value();
    let u = &m["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        expected
    );

    // /detokenize is the tokenizer's decode.
    let ids = post(
        a,
        "/tokenize",
        &json!({"prompt": "Tell me a story about a cat."}),
    )
    .json_value();
    let d = post(a, "/detokenize", &json!({"tokens": ids["tokens"]})).json_value();
    assert_eq!(d["prompt"], "Tell me a story about a cat.");
    drop(p);

    // A template that refuses a system message after the first: inline system messages are merged.
    let strict = dir.file("strict.jinja");
    std::fs::write(
        &strict,
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    .unwrap();
    let p = start(&[
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--chat-template",
        strict.to_str().unwrap(),
    ]);
    let body = json!({"model": "Qwen/Qwen3-8B", "max_tokens": 2, "system": "Rules.",
        "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "Reminder."}, {"role": "user", "content": "again"}]});
    let strict_t = ChatTokenizer::load(&tokenizer, Some(&strict)).unwrap();
    let merged = agent::messages_to_chat(&body, true).unwrap();
    assert_eq!(merged["messages"][0]["content"], "Rules.Reminder.");
    let expected = strict_t
        .chat_tokens_whole(merged.to_string().as_bytes())
        .unwrap()
        .len() as u64;
    let c = post(p.addr, "/v1/messages/count_tokens", &body);
    assert_eq!(c.status, 200, "{}", c.text());
    assert_eq!(c.json_value()["input_tokens"].as_u64(), Some(expected));
    let m = post(p.addr, "/v1/messages", &body);
    assert_eq!(m.status, 200, "{}", m.text());
    // The same conversation as a chat completion is refused by that template.
    let chat = post(
        p.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]}),
    );
    assert_eq!(chat.status, 400);
}

#[test]
fn hostile_bodies_get_4xx_and_the_replica_keeps_serving() {
    let p = start(&[]);
    let a = p.addr;
    let deep = format!("{}1{}", "[".repeat(5000), "]".repeat(5000));
    let bodies = [
        "".to_string(),
        "null".into(),
        "\"str\"".into(),
        deep.clone(),
        "{\"input\": {\"a\": 1}, \"messages\": 7, \"model\": 3}".into(),
        "{\"input\": [null, 1, \"x\"], \"messages\": [null], \"max_tokens\": 1e99}".into(),
        "{\"input\": \"x\", \"tools\": [1, {\"type\": 2}], \"query\": 1, \"tokens\": [1e30], \"dimensions\": 0}".into(),
        "{\"input\": [{\"type\": \"function_call\"}], \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"tool_use\", \"input\": \"x\"}]}], \"max_tokens\": 3, \"model\": \"m\"}".into(),
        "\u{0}\u{ffff}".into(),
    ];
    for path in [
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/rerank",
        "/score",
        "/detokenize",
    ] {
        for body in &bodies {
            let r = request(a, "POST", path, body);
            assert!(
                (400..500).contains(&r.status),
                "{path} {body:.80}: {} {}",
                r.status,
                r.text()
            );
            assert!(r.json_value().is_object());
        }
    }
    let r = post(
        a,
        "/v1/responses",
        &json!({"input": "still here", "max_output_tokens": 1}),
    );
    assert_eq!(r.status, 200);
}
