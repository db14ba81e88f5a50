//! Prefill/decode disaggregation end to end: kvlb in front of `kvlb replica --role prefill`
//! and `kvlb replica --role decode` processes speaking vLLM's kv_transfer_params protocol (the
//! decode replica pulls the prompt's KV from the prefill replica over its side channel). The
//! prefill leg follows the prefix, a failing prefill replica is passed over, none left sends
//! the request whole, other endpoints go whole, and the official OpenAI client works unchanged.

#[path = "support/mod.rs"]
mod support;

use serde_json::{json, Value};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::Duration;
use support::fleet::ReplicaFleet;
use support::proxy::metric_sum;
use support::{wait_until, HttpConn, Kvlb, Response, TempDir};

const T: Duration = Duration::from_secs(20);

/// The replicas' own counts of the transfers (`kvlb replica --role`).
const PULLED: &str = "kvlb_replica_kv_transfers_pulled_total";
const SERVED: &str = "kvlb_replica_kv_transfers_served_total";
const HELD: &str = "kvlb_replica_kv_held_blocks";
const LOCAL_PREFILLS: &str = "kvlb_replica_kv_local_prefills_total";

fn url(a: &SocketAddr) -> String {
    format!("http://{a}")
}

/// Two replicas of `role`, each with its KV events.
fn replicas(role: &str) -> ReplicaFleet {
    ReplicaFleet::start(2, &["--role", role, "--time-scale", "50"])
}

/// `kvlb serve --explain --disaggregate always` with an access log at `log`, in front of
/// `prefill` (given with their KV event streams, role=prefill) and `decode` (role=decode), then
/// `extra` replica specs.
fn serve(prefill: &ReplicaFleet, decode: &ReplicaFleet, log: &Path, extra: &[String]) -> Kvlb {
    serve_with(prefill, decode, log, extra, &["--disaggregate", "always"])
}

fn serve_with(
    prefill: &ReplicaFleet,
    decode: &ReplicaFleet,
    log: &Path,
    extra: &[String],
    args_extra: &[&str],
) -> Kvlb {
    let mut specs: Vec<String> = (0..prefill.http.len())
        .map(|i| {
            format!(
                "{},kv_events={},role=prefill",
                url(&prefill.http[i]),
                prefill.events[i]
            )
        })
        .collect();
    specs.extend(
        decode
            .http
            .iter()
            .map(|a| format!("{},role=decode", url(a))),
    );
    specs.extend_from_slice(extra);
    serve_specs(&specs, log, args_extra)
}

fn chat(system: &str, user: &str, stream: bool) -> Vec<u8> {
    json!({
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 8,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
    .to_string()
    .into_bytes()
}

fn post(kvlb: &Kvlb, path: &str, body: &[u8]) -> Response {
    let mut c = HttpConn::connect(kvlb.listen);
    c.request("POST", path, &[("Content-Type", "application/json")], body)
        .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

/// The access log's lines, once it holds `n` (workers flush at least once a second).
fn log_lines(path: &Path, n: usize) -> Vec<Value> {
    let read = || -> Vec<Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert!(wait_until(T, || read().len() >= n), "{:?}", read());
    read()
}

fn pd_outcome(kvlb: &Kvlb, outcome: &str) -> f64 {
    kvlb.metric(
        "kvlb_pd_requests_total",
        &[&format!("outcome=\"{outcome}\"")],
    )
    .unwrap_or(0.0)
}

/// The sum of `name`'s samples on the replica at `addr`'s /metrics.
fn replica_metric(addr: SocketAddr, name: &str) -> f64 {
    let r = support::client::get(addr, "/metrics");
    metric_sum(&r.body_text(), name, &[]).unwrap_or(0.0)
}

/// Requests a 30k-token prompt from `kvlb` and leaves 300 ms later (while a real-time
/// replica still computes it).
fn send_and_leave(kvlb: &Kvlb) {
    let body = support::fleet::completion_body(&support::fleet::token_prompt(30_000, 7));
    let mut c = HttpConn::connect(kvlb.listen);
    c.send_request(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        &body,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
}

/// The requests the replica at `addr` aborted (its client gone).
fn aborted(addr: SocketAddr) -> f64 {
    let r = support::client::get(addr, "/metrics");
    metric_sum(
        &r.body_text(),
        "vllm:request_success_total",
        &["finished_reason=\"abort\""],
    )
    .unwrap_or(0.0)
}

/// A port nothing listens on (bound once and let go).
fn dead_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
}

/// A streamed chat completion is prefilled on a prefill replica and streamed by a decode
/// replica that pulled its KV; the log names both.
#[test]
fn a_streamed_chat_takes_both_legs() {
    let (prefill, decode) = (replicas("prefill"), replicas("decode"));
    let dir = TempDir::new("pd-stream");
    let log = dir.file("access.log");
    let kvlb = serve(&prefill, &decode, &log, &[]);
    let system = "You are a careful assistant for a large codebase. ".repeat(40);
    let r = post(
        &kvlb,
        "/v1/chat/completions",
        &chat(&system, "Hello.", true),
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    let body = r.body_text();
    assert!(body.contains("data: [DONE]"), "{body}");
    assert!(
        body.contains("\"usage\""),
        "the client's stream_options kept: {body}"
    );
    let decoded_on = r.header("x-kvlb-replica").unwrap().to_string();
    let decode_urls: Vec<String> = decode.http.iter().map(url).collect();
    let prefill_urls: Vec<String> = prefill.http.iter().map(url).collect();
    assert!(decode_urls.contains(&decoded_on), "{decoded_on}");
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), 1.0);
    let line = &log_lines(&log, 1)[0];
    assert_eq!(line["replica"], decoded_on.as_str());
    let prefilled_on = line["prefill_replica"].as_str().unwrap().to_string();
    assert!(prefill_urls.contains(&prefilled_on), "{line}");
    assert!(line["prompt_tokens"].as_u64().unwrap() > 400, "{line}");
    // The decode replica pulled the prompt from that prefill replica, which let its blocks go.
    let p = prefill.http[prefill_urls
        .iter()
        .position(|u| *u == prefilled_on)
        .unwrap()];
    let d = decode.http[decode_urls.iter().position(|u| *u == decoded_on).unwrap()];
    assert_eq!(replica_metric(d, PULLED), 1.0);
    assert_eq!(replica_metric(p, SERVED), 1.0);
    assert!(wait_until(T, || replica_metric(p, HELD) == 0.0));
    // And the decode replica did not compute the prompt (a local prefill is counted apart).
    assert_eq!(replica_metric(d, LOCAL_PREFILLS), 0.0);
}

/// The prefill leg follows the prefix: requests sharing a long system prompt are prefilled
/// where it is resident, a cache hit in kvlb's decision.
#[test]
fn the_prefill_leg_follows_the_prefix() {
    let (prefill, decode) = (replicas("prefill"), replicas("decode"));
    let dir = TempDir::new("pd-prefix");
    let log = dir.file("access.log");
    let kvlb = serve(&prefill, &decode, &log, &[]);
    // Subscribed to the prefill replicas' events (the decode replicas are given none).
    assert!(wait_until(T, || support::fleet::replicas_json(&kvlb)
        .iter()
        .filter(|r| r["role"] == "prefill")
        .all(|r| r["telemetry"]["events_connected"] == true)));
    std::thread::sleep(Duration::from_millis(300));
    let system = "Tools: search(query), open(url), run(cmd). Answer tersely. ".repeat(60);
    let mut decisions = Vec::new();
    for i in 0..6 {
        let r = post(
            &kvlb,
            "/v1/chat/completions",
            &chat(&system, &format!("Question {i}."), i % 2 == 0),
        );
        assert_eq!(r.status, 200, "{}", r.describe());
        decisions.push(r.header("x-kvlb-decision").unwrap().to_string());
        // Let the prefill replica's events land before the next.
        std::thread::sleep(Duration::from_millis(100));
    }
    let lines = log_lines(&log, 6);
    let first = &lines[0]["prefill_replica"];
    for (l, d) in lines.iter().zip(&decisions).skip(1) {
        assert_eq!(&l["prefill_replica"], first, "{lines:?}");
        assert!(d.contains("reason=cache"), "{d}");
    }
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), 6.0);
    drop(kvlb);

    // The decision's estimate is the pair's: the prefill and the KV transfer after it (here
    // a second per 100 tokens of the prompt's 800 or so).
    let log2 = dir.file("access2.log");
    let slow_link = [
        "--disaggregate",
        "always",
        "--kv-transfer-s-per-token",
        "0.01",
    ];
    let kvlb = serve_with(&prefill, &decode, &log2, &[], &slow_link);
    let r = post(
        &kvlb,
        "/v1/chat/completions",
        &chat(&system, "Question 9.", false),
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    let d = r.header("x-kvlb-decision").unwrap();
    let field = |name: &str| -> f64 {
        let v = d.split("; ").find_map(|kv| kv.strip_prefix(name)).unwrap();
        v.trim_start_matches('=').parse().unwrap()
    };
    let transfer_ms = field("prompt_tokens") * 0.01 * 1e3;
    assert!(field("ttft_ms") >= transfer_ms, "{d}");
    // The decode replica's own estimate: it holds none of the prompt, so receives all of it
    // and starts a step later; the pair's is the prefill's with that transfer in its place.
    assert_eq!(field("decode_matched_tokens"), 0.0, "{d}");
    let decode_ms = field("decode_ttft_ms");
    assert!(
        decode_ms >= transfer_ms && decode_ms < transfer_ms + 100.0,
        "{d}"
    );
    let pair_ms = field("ttft_ms") - transfer_ms + decode_ms;
    assert!((field("pair_ttft_ms") - pair_ms).abs() < 0.2, "{d}");
}

/// The decode leg is priced by the sequences on each decode replica: streams sharing a long
/// system prompt, each started while the earlier ones decode, spread over both decode
/// replicas instead of all following the one that holds the prompt.
#[test]
fn the_decode_leg_spreads_running_sequences() {
    let prefill = replicas("prefill");
    // Decoding in real time: each stream runs for a second or more.
    let decode = ReplicaFleet::start(2, &["--role", "decode"]);
    let dir = TempDir::new("pd-decode-load");
    let log = dir.file("access.log");
    let kvlb = serve(&prefill, &decode, &log, &[]);
    let system = "Tools: search(query), open(url), run(cmd). Answer tersely. ".repeat(120);
    let body = |i: usize| {
        let mut b: Value = serde_json::from_slice(&chat(&system, &format!("Q{i}."), true)).unwrap();
        b["max_tokens"] = json!(150);
        b.to_string().into_bytes()
    };
    // One first: its decode replica then holds the prompt.
    assert_eq!(post(&kvlb, "/v1/chat/completions", &body(0)).status, 200);
    let streams: Vec<_> = (1..5)
        .map(|i| {
            let (listen, b) = (kvlb.listen, body(i));
            let t = std::thread::spawn(move || {
                let mut c = HttpConn::connect(listen);
                let r = c
                    .request(
                        "POST",
                        "/v1/chat/completions",
                        &[("Content-Type", "application/json")],
                        &b,
                    )
                    .unwrap();
                assert_eq!(r.status, 200, "{}", r.describe());
            });
            // The next starts once this one decodes.
            std::thread::sleep(Duration::from_millis(300));
            t
        })
        .collect();
    for t in streams {
        t.join().unwrap();
    }
    let lines = log_lines(&log, 5);
    let used: std::collections::BTreeSet<&str> = lines[1..]
        .iter()
        .map(|l| l["replica"].as_str().unwrap())
        .collect();
    assert_eq!(used.len(), 2, "{lines:?}");
}

/// A prefill replica that refuses connections is passed over for another (nothing reached the
/// client); with none left the request goes whole to a decode replica, which computes it.
#[test]
fn a_failing_prefill_replica_is_passed_over_and_none_left_goes_whole() {
    let (prefill, decode) = (replicas("prefill"), replicas("decode"));
    let dir = TempDir::new("pd-fail");
    let log = dir.file("access.log");
    let dead = url(&dead_port());
    // Round-robin: the dead replica's turn comes within three requests (cache_aware would
    // learn the others' pace and might never try it).
    let kvlb = serve_with(
        &prefill,
        &decode,
        &log,
        &[format!("{dead},role=prefill")],
        &["--disaggregate", "always", "--policy", "round_robin"],
    );
    let retries = || {
        kvlb.metric("kvlb_retries_total", &[&format!("replica=\"{dead}\"")])
            .unwrap_or(0.0)
    };
    let mut sent = 0;
    while sent < 8 {
        let r = post(
            &kvlb,
            "/v1/completions",
            &json!({"model": "m", "prompt": format!("{sent} {}", "word ".repeat(300)), "max_tokens": 4})
                .to_string()
                .into_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.describe());
        sent += 1;
    }
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), sent as f64);
    assert!(retries() >= 1.0, "the dead prefill replica was never tried");
    drop(kvlb);

    // Only the dead one: every request goes whole.
    let log2 = dir.file("access2.log");
    let specs: Vec<String> = std::iter::once(format!("{dead},role=prefill"))
        .chain(
            decode
                .http
                .iter()
                .map(|a| format!("{},role=decode", url(a))),
        )
        .collect();
    let mut args = vec![
        "--workers",
        "1",
        "--disaggregate",
        "always",
        "--access-log",
        log2.to_str().unwrap(),
    ];
    for s in &specs {
        args.extend_from_slice(&["--replica", s]);
    }
    let kvlb = Kvlb::serve(&args);
    let r = post(
        &kvlb,
        "/v1/chat/completions",
        &chat("Be brief.", "Hi.", true),
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    assert!(r.body_text().contains("data: [DONE]"));
    assert_eq!(pd_outcome(&kvlb, "prefill_failed"), 1.0);
    let line = &log_lines(&log2, 1)[0];
    assert!(line.get("prefill_replica").is_none(), "{line}");
    assert!(kvlb.stderr().contains("no prefill replica could compute"));
}

/// Endpoints whose answers carry no transfer parameters go whole to a decode replica; a
/// prefill replica is never sent a request whole.
#[test]
fn other_endpoints_go_whole_to_a_decode_replica() {
    let (prefill, decode) = (replicas("prefill"), replicas("decode"));
    let dir = TempDir::new("pd-whole");
    let log = dir.file("access.log");
    let kvlb = serve(&prefill, &decode, &log, &[]);
    let decode_urls: Vec<String> = decode.http.iter().map(url).collect();
    for (path, body) in [
        (
            "/v1/responses",
            json!({"model": "m", "input": "Say hi.", "max_output_tokens": 4}),
        ),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi."}]}),
        ),
        ("/v1/embeddings", json!({"model": "m", "input": "a text"})),
    ] {
        let r = post(&kvlb, path, body.to_string().as_bytes());
        assert_eq!(r.status, 200, "{path}: {}", r.describe());
        let on = r.header("x-kvlb-replica").unwrap();
        assert!(decode_urls.iter().any(|u| u == on), "{path} went to {on}");
    }
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), 0.0);
    let v: Value = serde_json::from_str(&kvlb.admin_get("/replicas").body_text()).unwrap();
    let roles: Vec<&str> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["prefill", "prefill", "decode", "decode"]);
}

/// OpenAI's own client, unchanged, streamed and not, chat and completions, through both legs.
#[test]
fn the_openai_client_through_both_legs() {
    let (prefill, decode) = (replicas("prefill"), replicas("decode"));
    let dir = TempDir::new("pd-openai");
    let log = dir.file("access.log");
    let kvlb = serve(&prefill, &decode, &log, &[]);
    support::backend::run_python(
        r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0, timeout=30)
system = "You answer questions about the repository. " * 30
msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is it?"}]
r = c.chat.completions.create(model="m", messages=msgs, max_tokens=6)
assert r.choices[0].message.content, r
assert r.usage.completion_tokens >= 1, r
chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=6, stream=True,
    stream_options={"include_usage": True}))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert text and chunks[-1].usage is not None, chunks
r = c.completions.create(model="m", prompt=system + "Q:", max_tokens=5)
assert r.choices[0].text is not None, r
s = list(c.completions.create(model="m", prompt=system + "Q2:", max_tokens=5, stream=True))
assert s, s
print("ok")
"#,
        &[&kvlb.url("/v1")],
    );
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), 4.0);
    let pulled: f64 = decode.http.iter().map(|&a| replica_metric(a, PULLED)).sum();
    assert_eq!(pulled, 4.0);
}

/// A client that leaves during the prefill: the prefill replica's connection is closed, so
/// the engine aborts the request, and no decode replica is sent anything.
#[test]
fn a_client_leaving_during_the_prefill_cancels_it() {
    // Real time (an 8B model on one H100): 30k tokens take over a second to prefill.
    let prefill = ReplicaFleet::start(1, &["--role", "prefill", "--time-scale", "1"]);
    let decode = replicas("decode");
    let dir = TempDir::new("pd-cancel");
    let log = dir.file("access.log");
    let kvlb = serve(&prefill, &decode, &log, &[]);
    send_and_leave(&kvlb);
    let p = prefill.http[0];
    assert!(wait_until(T, || aborted(p) == 1.0), "{}", aborted(p));
    let line = &log_lines(&log, 1)[0];
    assert_eq!(line["status"], 499, "{line}");
    assert_eq!(line["replica"], url(&p).as_str(), "{line}");
    let prefill_url = url(&p);
    assert_eq!(
        kvlb.metric(
            "kvlb_client_aborts_total",
            &[&format!("replica=\"{prefill_url}\"")]
        ),
        Some(1.0)
    );
    for &d in &decode.http {
        let r = support::client::get(d, "/metrics");
        let n = metric_sum(&r.body_text(), "vllm:request_success_total", &[]).unwrap_or(0.0);
        assert_eq!(n, 0.0, "a decode replica was sent the request");
    }
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), 0.0);
}

/// `--disaggregate priced` (the default): an idle decode replica computes a prompt itself (no
/// sequence of its own to stall, no transfer); once every decode replica decodes, the prompt is
/// computed on a prefill replica and moved.
#[test]
fn priced_disaggregation_computes_on_an_idle_decode_replica() {
    let prefill = replicas("prefill");
    // Real time: a stream of 400 tokens decodes for about 3 s.
    let decode = ReplicaFleet::start(2, &["--role", "decode", "--time-scale", "1"]);
    let dir = TempDir::new("pd-priced");
    let log = dir.file("access.log");
    let kvlb = serve_with(&prefill, &decode, &log, &[], &[]);
    let long = |i: u32| {
        json!({"model": "m", "prompt": format!("{i} {}", "token ".repeat(400)),
               "max_tokens": 400, "stream": true})
        .to_string()
        .into_bytes()
    };
    // Two streams, one on each idle decode replica, computed there.
    let addr = kvlb.listen;
    let streams: Vec<_> = (0..2u32)
        .map(|i| {
            let body = long(i);
            std::thread::sleep(Duration::from_millis(300));
            std::thread::spawn(move || {
                let mut c = HttpConn::connect(addr);
                c.request(
                    "POST",
                    "/v1/completions",
                    &[("Content-Type", "application/json")],
                    &body,
                )
                .unwrap()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(pd_outcome(&kvlb, "direct"), 2.0);
    // Both decode replicas decode now: the next prompt is disaggregated.
    let r = post(
        &kvlb,
        "/v1/chat/completions",
        &chat(&"Context. ".repeat(300), "Go.", false),
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), 1.0);
    let served: Vec<String> = streams
        .into_iter()
        .map(|t| {
            t.join()
                .unwrap()
                .header("x-kvlb-replica")
                .unwrap()
                .to_string()
        })
        .collect();
    assert_ne!(
        served[0], served[1],
        "the two streams shared a decode replica"
    );
    let lines = log_lines(&log, 3);
    let prefilled = lines
        .iter()
        .filter(|l| l.get("prefill_replica").is_some())
        .count();
    assert_eq!(prefilled, 1, "{lines:?}");
}

// SGLang's protocol: the same body, with kvlb's bootstrap_host/port/room, to both replicas.

/// Two replicas of `role` speaking SGLang's protocol (prefill replicas with their bootstrap
/// servers on ephemeral ports).
fn sglang_replicas(role: &str) -> ReplicaFleet {
    ReplicaFleet::start(
        2,
        &[
            "--role",
            role,
            "--pd-protocol",
            "sglang",
            "--time-scale",
            "50",
        ],
    )
}

/// The `--replica` specs of SGLang prefill replicas (with their bootstrap ports and events)
/// and decode replicas.
fn sglang_specs(prefill: &ReplicaFleet, decode: &ReplicaFleet) -> Vec<String> {
    let mut specs: Vec<String> = (0..prefill.http.len())
        .map(|i| {
            let boot = prefill.bootstrap[i].expect("a bootstrap server");
            format!(
                "{},kv_events={},role=prefill,bootstrap_port={}",
                url(&prefill.http[i]),
                prefill.events[i],
                boot.port()
            )
        })
        .collect();
    specs.extend(
        decode
            .http
            .iter()
            .map(|a| format!("{},role=decode", url(a))),
    );
    specs
}

/// `kvlb serve --explain --workers 1` with an access log at `log`, the replica `specs`, then
/// `extra` flags.
fn serve_specs(specs: &[String], log: &Path, extra: &[&str]) -> Kvlb {
    let mut args = vec![
        "--explain",
        "--workers",
        "1",
        "--access-log",
        log.to_str().unwrap(),
    ];
    for s in specs {
        args.extend_from_slice(&["--replica", s]);
    }
    args.extend_from_slice(extra);
    Kvlb::serve(&args)
}

/// OpenAI's client through SGLang's legs, streamed and not: the decode replica fetches each
/// prompt's KV from the prefill replica's bootstrap server, and the prefill leg follows the
/// prefix. A client's own bootstrap fields are replaced by kvlb's.
#[test]
fn sglangs_protocol_through_both_legs_with_the_openai_client() {
    let (prefill, decode) = (sglang_replicas("prefill"), sglang_replicas("decode"));
    let dir = TempDir::new("pd-sglang");
    let log = dir.file("access.log");
    let kvlb = serve_specs(&sglang_specs(&prefill, &decode), &log, &[]);
    assert!(wait_until(T, || support::fleet::replicas_json(&kvlb)
        .iter()
        .filter(|r| r["role"] == "prefill")
        .all(|r| r["telemetry"]["events_connected"] == true)));
    support::backend::run_python(
        r#"
import sys, time, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0, timeout=30)
system = "You answer questions about the repository. " * 40
for i in range(4):
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}?"}]
    # A room of the client's own would name another request's transfer: replaced.
    extra = {"bootstrap_room": 1, "bootstrap_host": "203.0.113.9", "bootstrap_port": 1}
    if i % 2:
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=6, extra_body=extra)
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1, r
    else:
        chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=6,
            stream=True, stream_options={"include_usage": True}, extra_body=extra))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text and chunks[-1].usage is not None, chunks
    time.sleep(0.1)
print("ok")
"#,
        &[&kvlb.url("/v1")],
    );
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), 4.0);
    let pulled: f64 = decode.http.iter().map(|&a| replica_metric(a, PULLED)).sum();
    let served: f64 = prefill
        .http
        .iter()
        .map(|&a| replica_metric(a, SERVED))
        .sum();
    assert_eq!((pulled, served), (4.0, 4.0));
    let local: f64 = decode
        .http
        .iter()
        .map(|&a| replica_metric(a, LOCAL_PREFILLS))
        .sum();
    assert_eq!(local, 0.0);
    let lines = log_lines(&log, 4);
    let first = &lines[0]["prefill_replica"];
    assert!(first.is_string(), "{lines:?}");
    for l in &lines[1..] {
        assert_eq!(&l["prefill_replica"], first, "{lines:?}");
        assert_eq!(l["reason"], "cache", "{lines:?}");
    }
    let decode_urls: Vec<String> = decode.http.iter().map(url).collect();
    assert!(lines
        .iter()
        .all(|l| decode_urls.iter().any(|u| l["replica"] == u.as_str())));
}

/// A prefill replica that fails (500) after the decode leg was sent: the decode leg is
/// abandoned and both are sent again with another prefill replica and room; with none left
/// the client gets 503 in OpenAI's error shape (an SGLang decode replica computes nothing
/// without a room).
#[test]
fn a_failing_sglang_prefill_is_retried_with_a_new_room() {
    let (prefill, decode) = (sglang_replicas("prefill"), sglang_replicas("decode"));
    let dir = TempDir::new("pd-sglang-fail");
    let failing = support::backend::Backend::start();
    let r = support::client::get(failing.addr, "/set_mode?status=500");
    assert_eq!(r.status, 200);
    let failing_spec = format!(
        "{},role=prefill,bootstrap_port={}",
        failing.url(),
        dead_port().port()
    );
    let mut specs = sglang_specs(&prefill, &decode);
    specs.push(failing_spec.clone());
    // Round-robin: the failing replica's turn comes within three requests (cache_aware
    // would learn the others' pace and might never try it).
    let kvlb = serve_specs(
        &specs,
        &dir.file("access.log"),
        &["--policy", "round_robin"],
    );
    let failing_url = failing.url();
    let retries = || {
        kvlb.metric(
            "kvlb_retries_total",
            &[&format!("replica=\"{failing_url}\"")],
        )
        .unwrap_or(0.0)
    };
    let mut sent = 0;
    while sent < 8 {
        let body = json!({"model": "m", "prompt": format!("{sent} {}", "word ".repeat(300)),
            "max_tokens": 4, "stream": sent % 2 == 0});
        let r = post(&kvlb, "/v1/completions", body.to_string().as_bytes());
        assert_eq!(r.status, 200, "{}", r.describe());
        sent += 1;
    }
    assert!(
        retries() >= 1.0,
        "the failing prefill replica was never tried"
    );
    assert_eq!(pd_outcome(&kvlb, "disaggregated"), sent as f64);
    let pulled: f64 = decode.http.iter().map(|&a| replica_metric(a, PULLED)).sum();
    assert_eq!(pulled, sent as f64);
    drop(kvlb);

    // The failing one alone: 503, and the decode replicas were sent nothing they kept.
    let specs: Vec<String> = std::iter::once(failing_spec)
        .chain(
            decode
                .http
                .iter()
                .map(|a| format!("{},role=decode", url(a))),
        )
        .collect();
    let kvlb = serve_specs(&specs, &dir.file("access2.log"), &[]);
    let r = post(
        &kvlb,
        "/v1/chat/completions",
        &chat("Be brief.", "Hi.", true),
    );
    assert_eq!(r.status, 503, "{}", r.describe());
    let v: Value = serde_json::from_str(&r.body_text()).unwrap();
    assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
    assert_eq!(pd_outcome(&kvlb, "prefill_failed"), 1.0);
    assert!(kvlb.stderr().contains("no prefill replica could compute"));
    let pulled_after: f64 = decode.http.iter().map(|&a| replica_metric(a, PULLED)).sum();
    assert_eq!(pulled_after, sent as f64);
}

/// A client that leaves while its prompt is prefilled: both legs' connections close, the
/// prefill engine aborts the request, the decode replica's request ends without its KV (its
/// client gone, or its room's prefill aborted), and kvlb holds no slot at either.
#[test]
fn a_client_leaving_cancels_both_sglang_legs() {
    let prefill = ReplicaFleet::start(
        1,
        &[
            "--role",
            "prefill",
            "--pd-protocol",
            "sglang",
            "--time-scale",
            "1",
        ],
    );
    let decode = ReplicaFleet::start(
        1,
        &[
            "--role",
            "decode",
            "--pd-protocol",
            "sglang",
            "--time-scale",
            "1",
        ],
    );
    let dir = TempDir::new("pd-sglang-cancel");
    let log = dir.file("access.log");
    let kvlb = serve_specs(&sglang_specs(&prefill, &decode), &log, &[]);
    send_and_leave(&kvlb);
    let (p, d) = (prefill.http[0], decode.http[0]);
    let decode_ended = || aborted(d) + replica_metric(d, "kvlb_replica_kv_transfer_failures_total");
    assert!(
        wait_until(T, || aborted(p) == 1.0 && decode_ended() == 1.0),
        "prefill aborted {}, decode ended {}",
        aborted(p),
        decode_ended()
    );
    let line = &log_lines(&log, 1)[0];
    assert_eq!(line["status"], 499, "{line}");
    assert_eq!(replica_metric(d, PULLED), 0.0);
    let in_flight: Vec<Value> = support::fleet::replicas_json(&kvlb)
        .iter()
        .map(|r| r["in_flight"].clone())
        .collect();
    assert_eq!(in_flight, [json!(0), json!(0)]);
}

/// round_robin takes turns on each leg apart: as many prefill as decode replicas do not make
/// every request take the same pair.
#[test]
fn round_robin_takes_turns_on_each_leg() {
    let (prefill, decode) = (replicas("prefill"), replicas("decode"));
    let dir = TempDir::new("pd-rr");
    let log = dir.file("access.log");
    let args = ["--policy", "round_robin", "--disaggregate", "always"];
    let kvlb = serve_with(&prefill, &decode, &log, &[], &args);
    for i in 0..4 {
        let body =
            json!({"model": "m", "prompt": format!("{i} {}", "word ".repeat(50)), "max_tokens": 2});
        let r = post(&kvlb, "/v1/completions", body.to_string().as_bytes());
        assert_eq!(r.status, 200, "{}", r.describe());
    }
    let lines = log_lines(&log, 4);
    let pairs: std::collections::BTreeSet<(String, String)> = lines
        .iter()
        .map(|l| {
            let p = l["prefill_replica"].as_str().unwrap().to_string();
            (p, l["replica"].as_str().unwrap().to_string())
        })
        .collect();
    let prefills: std::collections::BTreeSet<_> = pairs.iter().map(|p| &p.0).collect();
    let decodes: std::collections::BTreeSet<_> = pairs.iter().map(|p| &p.1).collect();
    assert_eq!((prefills.len(), decodes.len()), (2, 2), "{pairs:?}");
}

/// A decode replica that goes away after its first tokens reached the client: the client's
/// stream ends there (no `[DONE]`, the connection closed), counted as a cut response; the next
/// request is decoded by the other decode replica.
#[test]
fn a_decode_replica_dying_mid_stream_ends_that_stream() {
    let prefill = replicas("prefill");
    // Real time: 400 tokens stream for about 3 s.
    let doomed = ReplicaFleet::start(1, &["--role", "decode", "--time-scale", "1"]);
    let other = ReplicaFleet::start(1, &["--role", "decode", "--time-scale", "50"]);
    let dir = TempDir::new("pd-decode-cut");
    let log = dir.file("access.log");
    let doomed_url = url(&doomed.http[0]);
    let kvlb = serve(
        &prefill,
        &other,
        &log,
        &[format!("{doomed_url},role=decode")],
    );
    // Both decode replicas idle: the one chosen for a stream; send until one lands on the
    // doomed replica (the other answers at once).
    let body =
        json!({"model": "m", "prompt": "word ".repeat(200), "max_tokens": 400, "stream": true})
            .to_string();
    let mut conn = None;
    for _ in 0..8 {
        let mut c = HttpConn::connect(kvlb.listen);
        c.send_request(
            "POST",
            "/v1/completions",
            &[
                ("Content-Type", "application/json"),
                ("Connection", "close"),
            ],
            body.as_bytes(),
        )
        .unwrap();
        let (_, status, _, headers) = c.read_head().unwrap();
        assert_eq!(status, 200);
        let on = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("x-kvlb-replica"))
            .map(|(_, v)| v.as_str());
        if on == Some(doomed_url.as_str()) {
            conn = Some(c);
            break;
        }
        let _ = c.read_until_close();
    }
    let mut c = conn.expect("no stream went to the doomed decode replica in 8 tries");
    let first = c.read_some().unwrap();
    assert!(
        String::from_utf8_lossy(&first).contains("data:"),
        "{first:?}"
    );
    drop(doomed);
    c.set_read_timeout(T);
    let rest = c.read_until_close().unwrap_or_default();
    assert!(
        !String::from_utf8_lossy(&rest).contains("[DONE]"),
        "the stream completed"
    );
    let cut = || {
        kvlb.metric(
            "kvlb_cut_responses_total",
            &[&format!("replica=\"{doomed_url}\"")],
        )
        .unwrap_or(0.0)
    };
    assert!(wait_until(T, || cut() == 1.0), "cut: {}", cut());
    // The fleet carries on without it.
    let r = post(
        &kvlb,
        "/v1/chat/completions",
        &chat("Be brief.", "Hi.", true),
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    assert!(r.body_text().contains("[DONE]"));
}
