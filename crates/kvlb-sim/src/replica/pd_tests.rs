//! Disaggregated prefill end to end over real sockets: prefill and decode replicas started in
//! this process on 127.0.0.1:0 (`super::start`, as `kvlb replica` starts them), spoken to with
//! raw HTTP/1.1 as vLLM's proxy speaks to them, their /metrics read back.

use super::flags;
use super::Started;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// One replica of `args` (after `--listen 127.0.0.1:0 --time-scale 100`).
pub(super) fn replica(args: &[&str]) -> Started {
    let mut all: Vec<String> = ["--listen", "127.0.0.1:0", "--time-scale", "100"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    all.extend(args.iter().map(|s| s.to_string()));
    let f = flags::parse(&all).expect("flags");
    super::start(&f).expect("replica starts").remove(0)
}

/// Send one request (closing after it); the status and the body, de-chunked.
pub(super) fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, mut rest) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return (status, rest.to_string());
    }
    let mut body = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            return (status, body);
        }
        body.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
}

pub(super) fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = send(addr, "POST", path, &body.to_string());
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

/// The data events of a server-sent-events body, [DONE] left out.
pub(super) fn events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

pub(super) fn metrics(addr: SocketAddr) -> String {
    let (status, text) = send(addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    text
}

/// The sample of `name` whose labels contain `labels` (the sum if several match).
pub(super) fn sample(text: &str, name: &str, labels: &str) -> f64 {
    let found: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(labels))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(!found.is_empty(), "no {name}{{{labels}}} in\n{text}");
    found.iter().sum()
}

pub(super) fn metric(addr: SocketAddr, name: &str) -> f64 {
    sample(&metrics(addr), name, "")
}

/// Wait (up to 10 s) for `name` on `addr` to reach `value`.
pub(super) fn wait_for(addr: SocketAddr, name: &str, value: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(addr, name) != value {
        assert!(Instant::now() < deadline, "{name} never reached {value}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A prompt of `n` token ids.
pub(super) fn prompt(n: u32, from: u32) -> Value {
    json!((from..from + n).collect::<Vec<u32>>())
}

/// What vLLM's proxy adds to the prefill leg.
fn prefill_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

/// The prefill leg of completion `body`, as vLLM's toy proxy makes it.
fn prefill_leg(body: &Value) -> Value {
    let mut leg = body.clone();
    leg["stream"] = json!(false);
    leg["max_tokens"] = json!(1);
    if leg.get("max_completion_tokens").is_some() {
        leg["max_completion_tokens"] = json!(1);
    }
    if let Some(m) = leg.as_object_mut() {
        m.remove("stream_options");
    }
    leg["kv_transfer_params"] = prefill_params();
    leg
}

fn decode_leg(body: &Value, params: &Value) -> Value {
    let mut leg = body.clone();
    leg["kv_transfer_params"] = params.clone();
    leg
}

#[test]
fn a_decode_pulls_the_prefills_kv_and_skips_its_prefill() {
    let p = replica(&["--role", "prefill"]);
    let d = replica(&["--role", "decode"]);
    assert!(p.line.ends_with(&format!(
        " role=prefill side_channel={}",
        p.side_channel.unwrap()
    )));
    assert!(d.line.ends_with(" role=decode") && d.side_channel.is_none());
    let body = json!({"model": "Qwen/Qwen3-8B", "prompt": prompt(1000, 100), "max_tokens": 5,
        "stream": true, "stream_options": {"include_usage": true}});

    // Prefill leg: one token, and where its KV waits.
    let (status, answer) = post(p.addr, "/v1/completions", &prefill_leg(&body));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    let params = &answer["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 63); // 1000 / 16
    assert_eq!(params["remote_engine_id"], p.engines[0].disagg().engine_id);
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], p.side_channel.unwrap().port());
    assert_eq!(params["tp_size"], 1);
    let request_id = params["remote_request_id"].as_str().unwrap();
    assert!(request_id.starts_with(answer["id"].as_str().unwrap()));
    let m = metrics(p.addr);
    assert_eq!(sample(&m, "kvlb_replica_kv_held_blocks", ""), 63.0);
    assert_eq!(sample(&m, "kvlb_replica_kv_held_requests", ""), 1.0);
    assert_eq!(
        sample(&m, "vllm:kv_cache_usage_perc", ""),
        63.0 / 25_000.0,
        "held blocks are in use"
    );

    // Decode leg, streamed: the KV comes over, only the last prompt token is computed.
    let (status, text) = send(
        d.addr,
        "POST",
        "/v1/completions",
        &decode_leg(&body, params).to_string(),
    );
    assert_eq!(status, 200, "{text}");
    let chunks = events(&text);
    let texts = chunks
        .iter()
        .filter(|c| c["choices"][0]["text"].is_string());
    assert_eq!(texts.count(), 5);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], 1000);
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 999);
    let m = metrics(d.addr);
    for (name, labels, value) in [
        ("kvlb_replica_kv_transfers_pulled_total", "", 1.0),
        ("kvlb_replica_kv_transfer_tokens_pulled_total", "", 1000.0),
        ("vllm:nixl_bytes_transferred_count", "", 1.0),
        ("vllm:nixl_bytes_transferred_sum", "", 1000.0 * 131_072.0),
        ("vllm:nixl_xfer_time_seconds_count", "", 1.0),
        ("vllm:nixl_num_failed_transfers_total", "", 0.0),
        ("vllm:prompt_tokens_total", "", 1000.0),
        ("vllm:prefix_cache_hits_total", "", 0.0),
        ("vllm:external_prefix_cache_queries_total", "", 1000.0),
        ("vllm:external_prefix_cache_hits_total", "", 999.0),
        // Prefill compute skipped: one prompt token computed.
        ("vllm:request_prefill_kv_computed_tokens_sum", "", 1.0),
        ("kvlb_replica_kv_local_prefills_total", "", 0.0),
    ] {
        assert_eq!(sample(&m, name, labels), value, "{name}");
    }
    // The transfer took 1000 x 128 KiB at 25 GB/s, 5.2 ms of wall time.
    let xfer = sample(&m, "vllm:nixl_xfer_time_seconds_sum", "");
    assert!((xfer - 1000.0 * 131_072.0 / 25e9).abs() < 1e-9, "{xfer}");

    // The prefill side freed the blocks when it answered the pull.
    let m = metrics(p.addr);
    assert_eq!(sample(&m, "kvlb_replica_kv_held_blocks", ""), 0.0);
    assert_eq!(sample(&m, "kvlb_replica_kv_held_requests", ""), 0.0);
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfers_served_total", ""),
        1.0
    );
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfer_tokens_served_total", ""),
        1000.0
    );
    assert_eq!(sample(&m, "vllm:kv_cache_usage_perc", ""), 0.0);
    assert_eq!(sample(&m, "vllm:nixl_num_kv_expired_reqs_total", ""), 0.0);

    // A second pull of the same KV fails, on the side channel itself...
    let pull = json!({"remote_engine_id": params["remote_engine_id"],
        "remote_request_id": request_id});
    let (status, err) = post(p.side_channel.unwrap(), "/kv/pull", &pull);
    assert_eq!(status, 404);
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no KV held"));
    // ... and for a decode leg, which then prefills locally (its own cache helps it now).
    let (status, answer) = post(
        d.addr,
        "/v1/completions",
        &decode_leg(
            &json!({"prompt": prompt(1000, 100), "max_tokens": 2}),
            params,
        ),
    );
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        992
    );
    let m = metrics(d.addr);
    assert_eq!(
        sample(
            &m,
            "kvlb_replica_kv_local_prefills_total",
            "reason=\"pull_failed\""
        ),
        1.0
    );
    assert_eq!(sample(&m, "vllm:nixl_num_failed_transfers_total", ""), 1.0);
    assert_eq!(
        sample(
            &m,
            "kvlb_replica_kv_transfer_failures_total",
            "reason=\"not_found\""
        ),
        1.0
    );
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfers_pulled_total", ""),
        1.0
    );
}

#[test]
fn chat_legs_and_non_streamed_decodes() {
    let p = replica(&["--role", "prefill"]);
    let d = replica(&["--role", "decode", "--kv-link-gbps", "50"]);
    let body = json!({"messages": [{"role": "user", "content": "word ".repeat(300)}],
        "max_completion_tokens": 4});
    let leg = prefill_leg(&body);
    assert_eq!(leg["max_completion_tokens"], 1);
    let (status, answer) = post(p.addr, "/v1/chat/completions", &leg);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    let params = &answer["kv_transfer_params"];
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_f64().unwrap();
    let (status, out) = post(d.addr, "/v1/chat/completions", &decode_leg(&body, params));
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["usage"]["completion_tokens"], 4);
    assert_eq!(out["kv_transfer_params"], Value::Null);
    assert_eq!(out["usage"]["prompt_tokens"].as_f64(), Some(prompt_tokens));
    let m = metrics(d.addr);
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfer_tokens_pulled_total", ""),
        prompt_tokens
    );
    assert_eq!(
        sample(&m, "vllm:request_prefill_kv_computed_tokens_sum", ""),
        1.0
    );
    wait_for(p.addr, "kvlb_replica_kv_held_blocks", 0.0);
    // A prefill replica serves a request without do_remote_decode whole, holding nothing.
    let (status, out) = post(p.addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200);
    assert_eq!(out["kv_transfer_params"], Value::Null);
    assert_eq!(out["usage"]["completion_tokens"], 4);
    assert_eq!(metric(p.addr, "kvlb_replica_kv_held_requests"), 0.0);
}

#[test]
fn an_unpulled_hold_expires_and_is_counted() {
    // Wall seconds, whatever the time scale (100 here).
    let p = replica(&["--role", "prefill", "--kv-hold-timeout", "1"]);
    let d = replica(&["--role", "decode"]);
    let body = json!({"prompt": prompt(200, 7), "max_tokens": 3});
    let sent = Instant::now();
    let (status, answer) = post(p.addr, "/v1/completions", &prefill_leg(&body));
    assert_eq!(status, 200);
    assert_eq!(metric(p.addr, "kvlb_replica_kv_held_blocks"), 13.0);
    wait_for(p.addr, "vllm:nixl_num_kv_expired_reqs_total", 1.0);
    assert!(sent.elapsed() >= Duration::from_secs(1));
    let m = metrics(p.addr);
    assert_eq!(sample(&m, "kvlb_replica_kv_held_blocks", ""), 0.0);
    assert_eq!(sample(&m, "vllm:kv_cache_usage_perc", ""), 0.0);
    // The decode comes too late: its pull fails and it prefills the prompt itself.
    let params = &answer["kv_transfer_params"];
    let (status, out) = post(d.addr, "/v1/completions", &decode_leg(&body, params));
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let m = metrics(d.addr);
    assert_eq!(
        sample(
            &m,
            "kvlb_replica_kv_local_prefills_total",
            "reason=\"pull_failed\""
        ),
        1.0
    );
    assert_eq!(
        sample(&m, "vllm:request_prefill_kv_computed_tokens_sum", ""),
        200.0
    );
}

#[test]
fn invalid_params_and_plain_requests_prefill_locally() {
    let d = replica(&["--role", "decode"]);
    let body = json!({"prompt": prompt(100, 3), "max_tokens": 2});
    let (status, out) = post(d.addr, "/v1/completions", &body);
    assert_eq!(
        (status, &out["usage"]["completion_tokens"]),
        (200, &json!(2))
    );
    let mut params = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [], "remote_engine_id": "e", "remote_request_id": "cmpl-1-1",
        "remote_host": "127.0.0.1", "remote_port": 9});
    let (status, out) = post(d.addr, "/v1/completions", &decode_leg(&body, &params));
    assert_eq!(status, 200, "{out}");
    params["remote_block_ids"] = json!([1]);
    params["remote_port"] = Value::Null;
    let (status, _) = post(d.addr, "/v1/completions", &decode_leg(&body, &params));
    assert_eq!(status, 200);
    let m = metrics(d.addr);
    let local = |reason: &str| {
        sample(
            &m,
            "kvlb_replica_kv_local_prefills_total",
            &format!("reason=\"{reason}\""),
        )
    };
    assert_eq!(
        (
            local("no_params"),
            local("invalid_params"),
            local("pull_failed")
        ),
        (1.0, 2.0, 0.0)
    );
    assert_eq!(sample(&m, "vllm:nixl_num_failed_transfers_total", ""), 0.0);
    assert_eq!(sample(&m, "vllm:prefix_cache_queries_total", ""), 300.0);
    // Params that are not an object: vLLM's 400, in OpenAI's error shape.
    let (status, err) = post(
        d.addr,
        "/v1/completions",
        &decode_leg(&body, &json!([1, 2])),
    );
    assert_eq!(status, 400);
    assert_eq!(err["error"]["type"], "BadRequestError");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("kv_transfer_params"));
}

#[test]
fn the_side_channel_refuses_what_it_does_not_hold() {
    let p = replica(&["--role", "prefill"]);
    let side = p.side_channel.unwrap();
    let engine_id = p.engines[0].disagg().engine_id.clone();
    for (body, status, says) in [
        (
            json!({"remote_engine_id": "other", "remote_request_id": "cmpl-1-1"}),
            404,
            "not an engine",
        ),
        (
            json!({"remote_engine_id": engine_id, "remote_request_id": "cmpl-1-1"}),
            404,
            "no KV held",
        ),
        (
            json!({"remote_engine_id": engine_id, "remote_request_id": "garbage"}),
            404,
            "no KV held",
        ),
        (
            json!({"remote_engine_id": engine_id}),
            400,
            "remote_request_id",
        ),
        (json!([]), 400, "JSON object"),
    ] {
        let (got, err) = post(side, "/kv/pull", &body);
        assert_eq!(got, status, "{body}: {err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
        assert_eq!(err["error"]["code"], status);
    }
    let (status, _) = send(side, "GET", "/kv/pull", "");
    assert_eq!(status, 405);
    let (status, _) = send(side, "POST", "/elsewhere", "{}");
    assert_eq!(status, 404);
    let (status, _) = send(side, "POST", "/kv/pull", "{not json");
    assert_eq!(status, 400);
}

#[test]
fn a_decode_abandoned_during_its_transfer_leaves_nothing_behind() {
    let p = replica(&["--role", "prefill"]);
    // 0.001 GB/s: 500 tokens of 128 KiB take 66 s to move.
    let d = replica(&["--role", "decode", "--kv-link-gbps", "0.001"]);
    let body = json!({"prompt": prompt(500, 11), "max_tokens": 50, "stream": true});
    let (_, answer) = post(p.addr, "/v1/completions", &prefill_leg(&body));
    let leg = decode_leg(&body, &answer["kv_transfer_params"]).to_string();
    let mut s = TcpStream::connect(d.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n{leg}",
        leg.len()
    )
    .unwrap();
    wait_for(d.addr, "kvlb_replica_kv_transfers_pulled_total", 1.0);
    // Pulled: the prefill side holds nothing any more.
    assert_eq!(metric(p.addr, "kvlb_replica_kv_held_blocks"), 0.0);
    drop(s);
    // Well before the transfer would end, the decode gave up on it and never queued it.
    std::thread::sleep(Duration::from_millis(300));
    let m = metrics(d.addr);
    assert_eq!(sample(&m, "vllm:num_requests_waiting", ""), 0.0);
    assert_eq!(sample(&m, "vllm:num_requests_running", ""), 0.0);
    assert_eq!(sample(&m, "vllm:prefix_cache_queries_total", ""), 0.0);
    assert_eq!(sample(&m, "vllm:kv_cache_usage_perc", ""), 0.0);
    // And it still serves.
    let (status, _) = post(
        d.addr,
        "/v1/completions",
        &json!({"prompt": prompt(20, 1), "max_tokens": 1}),
    );
    assert_eq!(status, 200);
}

#[test]
fn the_default_role_ignores_kv_transfer_params() {
    let r = replica(&[]);
    assert!(!r.line.contains("role=") && r.side_channel.is_none());
    let body = json!({"prompt": prompt(100, 5), "max_tokens": 3});
    let (status, out) = post(r.addr, "/v1/completions", &prefill_leg(&body));
    assert_eq!(status, 200);
    assert_eq!(out["kv_transfer_params"], Value::Null);
    assert_eq!(out["usage"]["completion_tokens"], 1);
    // Not even an invalid form is refused, as before.
    let (status, _) = post(r.addr, "/v1/completions", &decode_leg(&body, &json!(7)));
    assert_eq!(status, 200);
    let m = metrics(r.addr);
    assert!(
        !m.contains("nixl") && !m.contains("kvlb_replica_kv_"),
        "{m}"
    );
    assert!(!m.contains("external_prefix_cache"));
    assert_eq!(sample(&m, "vllm:kv_cache_usage_perc", ""), 0.0);
}
