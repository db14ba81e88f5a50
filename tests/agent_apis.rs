//! The agent APIs through kvlb, in front of real `kvlb replica` processes: the Responses API
//! (`/v1/responses`: prompt read for routing, conversations continued with
//! `previous_response_id` sent to the replica that stored them), Anthropic's Messages API
//! (`/v1/messages`: prompt read, `x-api-key`, kvlb's own errors in Anthropic's shape), the rest
//! of the surface passed through, and each API driven by its official client.

mod support;

use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;
use support::client::HttpConn;
use support::fleet::{decision, replicas_json, ReplicaFleet};
use support::{wait_until, Kvlb};

const T: Duration = Duration::from_secs(20);

/// Four simulated replicas (time 50x faster).
fn four() -> ReplicaFleet {
    ReplicaFleet::start(4, &["--time-scale", "50"])
}

fn url(a: &SocketAddr) -> String {
    format!("http://{a}")
}

/// `kvlb serve --explain` in front of `reps`, with `extra`.
fn serve(reps: &ReplicaFleet, extra: &[&str]) -> Kvlb {
    let urls: Vec<String> = reps.http.iter().map(url).collect();
    let mut args: Vec<&str> = vec!["--explain", "--workers", "1", "--health-interval", "200ms"];
    for u in &urls {
        args.extend_from_slice(&["--replica", u]);
    }
    args.extend_from_slice(extra);
    let kvlb = Kvlb::serve(&args);
    // The replicas' models known: a request's blocks are named the same from the first on.
    assert!(wait_until(T, || support::fleet::replicas_json(&kvlb)
        .iter()
        .all(|r| r["models"].is_array())));
    kvlb
}

fn post(
    conn: &mut HttpConn,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> support::Response {
    let mut h = vec![("Content-Type", "application/json")];
    h.extend_from_slice(headers);
    conn.request("POST", path, &h, body.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

/// A long agent instruction block, shared by every session of a test.
fn instructions() -> String {
    let mut s = String::from("You are a coding agent working in a large repository. ");
    for i in 0..60 {
        s.push_str(&format!(
            "Rule {i}: read the code before changing it, and run the tests. "
        ));
    }
    s
}

/// Each replica's blocks in kvlb's residency index.
fn resident(kvlb: &Kvlb) -> Vec<u64> {
    replicas_json(kvlb)
        .iter()
        .map(|r| r["resident_blocks"].as_u64().unwrap_or(0))
        .collect()
}

/// Waits until kvlb's index holds as many blocks on replica `served` as the prompt of its
/// answer `r` has whole blocks (less one for rounding). The residency writer applies routed
/// prompts within a few milliseconds; a client sending its next turn the instant an answer
/// of two tokens comes back can beat it on a busy machine, where an agent's next turn waits
/// for its tool call.
fn learned(kvlb: &Kvlb, served: usize, r: &support::Response) {
    let header = r.header("x-kvlb-decision").unwrap_or("");
    let prompt: usize = header
        .split(';')
        .find_map(|p| p.trim().strip_prefix("prompt_tokens="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no prompt_tokens in {header:?}"));
    // Text mode: four canonical bytes a token.
    let blocks = (prompt * 4 / kvlb::prefix::BLOCK_BYTES).saturating_sub(1) as u64;
    assert!(
        wait_until(Duration::from_secs(5), || resident(kvlb)[served] >= blocks),
        "replica {served} never held the {blocks} blocks of {header:?} in kvlb's index: {:?}",
        replicas_json(kvlb)
    );
}

/// The input items of turn `turn` of session `session` (the whole history, resent).
fn responses_items(session: usize, turn: usize) -> Vec<Value> {
    let mut items = Vec::new();
    for t in 0..=turn {
        items.push(json!({"role": "user", "content": [{"type": "input_text",
            "text": format!("Session {session} step {t}: look at module {} and report.", t * 7)}]}));
        if t < turn {
            items.push(
                json!({"type": "function_call", "call_id": format!("call_{t}"),
                "name": "read_file", "arguments": format!("{{\"path\":\"src/m{t}.rs\"}}")}),
            );
            items.push(
                json!({"type": "function_call_output", "call_id": format!("call_{t}"),
                "output": "fn main() {}\n".repeat(20)}),
            );
        }
    }
    items
}

#[test]
fn responses_and_messages_sessions_route_on_their_prompt() {
    let reps = four();
    let kvlb = serve(&reps, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let instr = instructions();
    for session in 0..3 {
        let mut home = None;
        for turn in 0..4 {
            let body = json!({"model": "m", "instructions": instr, "store": false,
                "max_output_tokens": 2, "input": responses_items(session, turn)});
            let r = post(&mut conn, "/v1/responses", &[], &body);
            assert_eq!(r.status, 200, "{}", r.describe());
            let (reason, matched) = decision(&r);
            let served = reps.served_by(&r);
            learned(&kvlb, served, &r);
            if turn == 0 {
                assert_ne!(reason, "fallback", "the prompt was read: {}", r.describe());
                home = Some(served);
            } else {
                // The earlier turns are resident where they ran.
                assert_eq!(
                    reason,
                    "cache",
                    "session {session} turn {turn}: {:?}",
                    r.header("x-kvlb-decision")
                );
                assert_eq!(Some(served), home, "session {session} turn {turn}");
                assert!(
                    matched >= 600,
                    "session {session} turn {turn}: matched {matched}"
                );
            }
        }
    }
    // Messages: a Claude-style session, system blocks with a per-request billing header and
    // the prompt caching marker moved to the newest block every turn.
    let mut home = None;
    let mut messages: Vec<Value> = Vec::new();
    for turn in 0..4 {
        for m in messages.iter_mut() {
            for block in m["content"].as_array_mut().unwrap() {
                block.as_object_mut().unwrap().remove("cache_control");
            }
        }
        let text = format!("Step {turn}: {}", "look again. ".repeat(10));
        messages.push(
            json!({"role": "user", "content": [{"type": "text", "text": text,
            "cache_control": {"type": "ephemeral"}}]}),
        );
        let body = json!({"model": "m", "max_tokens": 2, "messages": messages,
            "system": [{"type": "text", "text": format!("x-anthropic-billing-header: cch={turn:05x};")},
                       {"type": "text", "text": instr, "cache_control": {"type": "ephemeral"}}]});
        let r = post(
            &mut conn,
            "/v1/messages",
            &[("anthropic-version", "2023-06-01")],
            &body,
        );
        assert_eq!(r.status, 200, "{}", r.describe());
        let v = r.json().expect("JSON");
        assert_eq!(v["type"], "message", "{v}");
        let (reason, matched) = decision(&r);
        let served = reps.served_by(&r);
        learned(&kvlb, served, &r);
        if turn == 0 {
            assert_ne!(reason, "fallback");
            home = Some(served);
        } else {
            assert_eq!(
                (reason.as_str(), Some(served)),
                ("cache", home),
                "turn {turn}"
            );
            assert!(matched >= 600, "turn {turn}: matched {matched}");
        }
        messages.push(json!({"role": "assistant", "content": [{"type": "tool_use",
            "id": format!("toolu_{turn}"), "name": "bash", "input": {"cmd": format!("ls {turn}")}}]}));
        messages.push(json!({"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": format!("toolu_{turn}"), "content": "a\nb\n"}]}));
    }
}

/// The id of a Responses API answer.
fn response_id(r: &support::Response) -> String {
    let v = r
        .json()
        .unwrap_or_else(|| panic!("not JSON: {}", r.describe()));
    let id = v["id"].as_str().unwrap_or_else(|| panic!("no id: {v}"));
    assert!(id.starts_with("resp_"), "{id}");
    id.to_string()
}

#[test]
fn a_conversation_continued_by_previous_response_id_stays_on_its_replica() {
    let reps = four();
    let kvlb = serve(&reps, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let instr = instructions();
    for stream in [false, true] {
        let first = json!({"model": "m", "instructions": instr, "max_output_tokens": 2,
            "input": format!("Start a task (stream {stream}).")});
        let r = post(&mut conn, "/v1/responses", &[], &first);
        let home = reps.served_by(&r);
        let mut previous = response_id(&r);
        for turn in 1..8 {
            // Short turns: on the prompt alone any replica would do.
            let body = json!({"model": "m", "max_output_tokens": 2, "stream": stream,
                "previous_response_id": previous, "input": format!("Go on with step {turn}.")});
            let r = post(&mut conn, "/v1/responses", &[], &body);
            assert_eq!(r.status, 200, "turn {turn}: {}", r.describe());
            assert_eq!(reps.served_by(&r), home, "turn {turn}");
            assert_eq!(decision(&r).0, "affinity", "turn {turn}");
            previous = if stream {
                // The id comes in the first event; the whole stream was relayed as sent.
                let text = r.body_text();
                // Cut at max_output_tokens: vLLM ends such a stream with response.incomplete.
                assert!(text.contains("event: response.incomplete"), "{text}");
                let start = text.find("\"id\":\"resp_").expect("an id in the stream") + 6;
                text[start..start + text[start..].find('"').unwrap()].to_string()
            } else {
                response_id(&r)
            };
        }
        // The stored response itself, fetched by id, is found where it is.
        let r = conn
            .request("GET", &format!("/v1/responses/{previous}"), &[], b"")
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.describe());
        assert_eq!(reps.served_by(&r), home);
    }
    let routed = kvlb.metric("kvlb_response_affinity_total", &["outcome=\"routed\""]);
    assert_eq!(routed, Some(16.0), "{}", kvlb.get("/metrics").body_text());
    let learned = kvlb.metric("kvlb_response_ids_total", &["outcome=\"learned\""]);
    assert_eq!(learned, Some(16.0));

    // An id no replica stored: routed as any request, the engine's own 404 comes back.
    let body = json!({"model": "m", "previous_response_id": "resp_unknown", "input": "x"});
    let r = post(&mut conn, "/v1/responses", &[], &body);
    assert_eq!(r.status, 404, "{}", r.describe());
    assert!(
        r.header("x-kvlb-replica").is_some(),
        "the engine answered, not kvlb"
    );
    assert_eq!(
        kvlb.metric("kvlb_response_affinity_total", &["outcome=\"unknown\""]),
        Some(1.0)
    );
}

#[test]
fn a_conversation_whose_replica_is_gone_gets_the_engines_not_found() {
    // Two replica processes, so that one can go away.
    let mut fleets: Vec<Option<ReplicaFleet>> = (0..2)
        .map(|_| Some(ReplicaFleet::start(1, &["--time-scale", "50"])))
        .collect();
    let urls: Vec<String> = fleets
        .iter()
        .map(|f| url(&f.as_ref().unwrap().http[0]))
        .collect();
    let kvlb = Kvlb::serve(&[
        "--workers",
        "1",
        "--health-interval",
        "200ms",
        "--replica",
        &urls[0],
        "--replica",
        &urls[1],
    ]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let first = json!({"model": "m", "input": "hi", "max_output_tokens": 2});
    let r = post(&mut conn, "/v1/responses", &[], &first);
    let home_url = r.header("x-kvlb-replica").unwrap().to_string();
    let home = urls.iter().position(|u| *u == home_url).unwrap();
    let id = response_id(&r);
    fleets[home] = None;
    assert!(wait_until(T, || {
        support::fleet::replicas_json(&kvlb)[home]["available"] == json!(false)
    }));
    let body = json!({"model": "m", "previous_response_id": id, "input": "more"});
    let r = post(&mut conn, "/v1/responses", &[], &body);
    assert_eq!(r.status, 404, "{}", r.describe());
    let v = r.json().unwrap();
    assert_eq!(
        v["error"]["message"],
        format!("Response with id '{id}' not found.")
    );
    assert_eq!(r.header("x-kvlb-replica"), Some(urls[1 - home].as_str()));
    assert_eq!(
        kvlb.metric("kvlb_response_affinity_total", &["outcome=\"unavailable\""]),
        Some(1.0)
    );
}

#[test]
fn the_messages_api_takes_x_api_key_and_gets_anthropic_errors() {
    let reps = ReplicaFleet::start(1, &["--time-scale", "50", "--served-model-name", "m"]);
    let urls = [url(&reps.http[0])];
    let kvlb = Kvlb::serve_env(
        &["--workers", "1", "--replica", &urls[0]],
        &[("KVLB_API_KEYS", "client-key-1,client-key-2")],
    );
    let mut conn = HttpConn::connect(kvlb.listen);
    let body =
        json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    // No key: 401 in Anthropic's shape, the connection kept.
    let r = post(&mut conn, "/v1/messages", &[], &body);
    assert_eq!(r.status, 401);
    let v = r.json().unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "authentication_error");
    // Its key as x-api-key, or as a bearer token.
    let r = post(
        &mut conn,
        "/v1/messages",
        &[("x-api-key", "client-key-2")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(r.json().unwrap()["type"], "message");
    let r = post(
        &mut conn,
        "/v1/messages",
        &[("Authorization", "Bearer client-key-1")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    // A model no replica serves: Anthropic's not_found_error from kvlb.
    let wrong =
        json!({"model": "other", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    assert!(wait_until(T, || {
        post(
            &mut conn,
            "/v1/messages",
            &[("x-api-key", "client-key-1")],
            &wrong,
        )
        .status
            == 404
    }));
    let r = post(
        &mut conn,
        "/v1/messages",
        &[("x-api-key", "client-key-1")],
        &wrong,
    );
    let v = r.json().unwrap();
    assert_eq!(v["error"]["type"], "not_found_error", "{v}");
    assert_eq!(v["error"]["message"], "The model `other` does not exist.");
    // OpenAI's paths keep OpenAI's shape; x-api-key works there too.
    let chat =
        json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let r = post(&mut conn, "/v1/chat/completions", &[], &chat);
    assert_eq!(r.status, 401);
    assert_eq!(r.json().unwrap()["error"]["code"], 401);
    let r = post(
        &mut conn,
        "/v1/chat/completions",
        &[("x-api-key", "client-key-1")],
        &chat,
    );
    assert_eq!(r.status, 200, "{}", r.describe());
}

#[test]
fn the_rest_of_the_surface_is_passed_through() {
    let reps = ReplicaFleet::start(2, &["--time-scale", "50"]);
    let kvlb = serve(&reps, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    for (path, body) in [
        ("/v1/embeddings", json!({"model": "m", "input": ["a", "b"]})),
        (
            "/v1/rerank",
            json!({"model": "m", "query": "q", "documents": ["a", "b"]}),
        ),
        (
            "/v1/score",
            json!({"model": "m", "text_1": "q", "text_2": ["a", "b"]}),
        ),
        ("/tokenize", json!({"model": "m", "prompt": "hello there"})),
        ("/detokenize", json!({"model": "m", "tokens": [1, 2, 3]})),
        (
            "/v1/messages/count_tokens",
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ] {
        let r = post(&mut conn, path, &[], &body);
        assert_eq!(r.status, 200, "{path}: {}", r.describe());
        assert!(r.json().is_some(), "{path}: {}", r.describe());
        assert!(r.header("x-kvlb-replica").is_some(), "{path}");
    }
    let r = conn.request("GET", "/v1/models", &[], b"").unwrap();
    assert_eq!(r.status, 200);
    // Paths kvlb does not know are forwarded as they are: the replica answers.
    let r = post(&mut conn, "/v1/audio/transcriptions", &[], &json!({}));
    assert_eq!(r.status, 404, "{}", r.describe());
    assert!(r.header("x-kvlb-replica").is_some());
    let r = post(&mut conn, "/v1/some/future/api", &[], &json!({}));
    assert!(r.header("x-kvlb-replica").is_some(), "{}", r.describe());
}

#[test]
fn the_official_clients_through_kvlb() {
    let reps = four();
    let urls: Vec<String> = reps.http.iter().map(url).collect();
    let mut args = vec!["--explain", "--workers", "1"];
    for u in &urls {
        args.extend_from_slice(&["--replica", u]);
    }
    let kvlb = Kvlb::serve_env(&args, &[("KVLB_API_KEYS", "sk-test-key")]);
    let replicas = urls.join(",");
    // OpenAI's client: responses.create, streamed and not, a conversation of 6 turns by
    // previous_response_id; every follow-up on the replica that stored the first.
    support::backend::run_python(
        r#"
import sys, openai
base, replicas = sys.argv[1], sys.argv[2].split(",")
c = openai.OpenAI(base_url=base, api_key="sk-test-key", max_retries=0, timeout=30)
raw = c.responses.with_raw_response.create(model="m", instructions="Be terse. " * 100,
    input="Start.")
home = raw.headers["x-kvlb-replica"]
prev = raw.parse()
assert prev.id.startswith("resp_") and prev.output_text is not None, prev
for turn in range(1, 6):
    if turn % 2:
        with c.responses.with_streaming_response.create(model="m", input=f"Step {turn}.",
                previous_response_id=prev.id, stream=True) as s:
            assert s.headers["x-kvlb-replica"] == home, (turn, s.headers)
            assert "reason=affinity" in s.headers["x-kvlb-decision"], s.headers
            events = [e for e in s.parse()]
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        assert "response.output_text.delta" in kinds, kinds
        prev = events[-1].response
    else:
        raw = c.responses.with_raw_response.create(model="m", input=f"Step {turn}.",
            previous_response_id=prev.id)
        assert raw.headers["x-kvlb-replica"] == home, (turn, raw.headers)
        prev = raw.parse()
    assert prev.status == "completed", prev
try:
    c.responses.create(model="m", input="x", previous_response_id="resp_nope")
    raise SystemExit("no error for an unknown response")
except openai.NotFoundError:
    pass
print("ok")
"#,
        &[&kvlb.url("/v1"), &replicas],
    );
    // Anthropic's client: messages.create and messages.stream with its x-api-key; the second
    // turn lands where the first ran, with most of it matched.
    support::backend::run_python(
        r#"
import sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="sk-test-key", max_retries=0, timeout=30)
system = [{"type": "text", "text": "You review code carefully. " * 120,
           "cache_control": {"type": "ephemeral"}}]
msgs = [{"role": "user", "content": "Review the first file."}]
raw = c.messages.with_raw_response.create(model="m", max_tokens=4, system=system, messages=msgs)
home = raw.headers["x-kvlb-replica"]
m = raw.parse()
assert m.type == "message" and m.content[0].type == "text", m
msgs += [{"role": "assistant", "content": m.content[0].text},
         {"role": "user", "content": "Now the second."}]
with c.messages.stream(model="m", max_tokens=4, system=system, messages=msgs) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
    h = s.response.headers
assert h["x-kvlb-replica"] == home, h
d = dict(p.strip().split("=") for p in h["x-kvlb-decision"].split(";"))
assert d["reason"] == "cache" and int(d["matched_tokens"]) >= 500, d
assert final.stop_reason in ("end_turn", "max_tokens"), final
try:
    anthropic.Anthropic(base_url=sys.argv[1], api_key="wrong", max_retries=0).messages.create(
        model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    raise SystemExit("no error for a wrong key")
except anthropic.AuthenticationError as e:
    assert e.body["error"]["type"] == "authentication_error", e.body
print("ok")
"#,
        &[&kvlb.url(""), &replicas],
    );
}
