//! SGLang's disaggregated prefill end to end over real sockets: `--pd-protocol sglang` prefill
//! and decode replicas started in this process on 127.0.0.1:0, sent the one body SGLang's
//! router (SMG, mini_lb) sends both of them, with `bootstrap_host`, `bootstrap_port` and
//! `bootstrap_room` added, at once or one after the other; their /metrics read back.

use super::pd_tests::{events, metric, metrics, post, prompt, replica, sample, send, wait_for};
use super::Started;
use serde_json::{json, Value};
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// One `--pd-protocol sglang` replica of `role`, with `more` flags.
fn sglang(role: &str, more: &[&str]) -> Started {
    let mut args = vec!["--role", role, "--pd-protocol", "sglang"];
    args.extend_from_slice(more);
    replica(&args)
}

/// `body` as SGLang's router sends it to both legs: the prefill replica's bootstrap host and
/// port, and the room.
fn with_room(body: &Value, bootstrap: SocketAddr, room: u64) -> Value {
    let mut b = body.clone();
    b["bootstrap_host"] = json!(bootstrap.ip().to_string());
    b["bootstrap_port"] = json!(bootstrap.port());
    b["bootstrap_room"] = json!(room);
    b
}

/// Send `prefill` to `p` and `decode` to `d` on `path`, the decode `decode_lag` after the
/// prefill (negative: the prefill that long after the decode); both answers, de-chunked.
fn both_legs(
    p: SocketAddr,
    d: SocketAddr,
    path: &str,
    leg: &Value,
    decode_lag: f64,
) -> ((u16, String), (u16, String)) {
    let body = leg.to_string();
    let lag = |s: f64| Duration::from_secs_f64(s.max(0.0));
    std::thread::scope(|scope| {
        let prefill = scope.spawn(|| {
            std::thread::sleep(lag(-decode_lag));
            send(p, "POST", path, &body)
        });
        let decode = scope.spawn(|| {
            std::thread::sleep(lag(decode_lag));
            send(d, "POST", path, &body)
        });
        (prefill.join().unwrap(), decode.join().unwrap())
    })
}

/// A port nobody listens on.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
}

fn error_message(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["error"]["message"].as_str().unwrap().to_string()
}

#[test]
fn both_legs_in_any_order_skip_the_decodes_prefill() {
    let p = sglang("prefill", &[]);
    let d = sglang("decode", &[]);
    let boot = p.bootstrap.unwrap();
    assert!(
        p.line.ends_with(&format!(
            " role=prefill pd_protocol=sglang bootstrap={boot}"
        )),
        "{}",
        p.line
    );
    assert!(p.side_channel.is_none());
    assert!(
        d.line.ends_with(" role=decode pd_protocol=sglang"),
        "{}",
        d.line
    );
    assert!(d.bootstrap.is_none() && d.side_channel.is_none());
    // At once; the decode first, its prefill 300 ms later; the prefill first, its decode 300
    // ms after it answered. A prompt of its own each (no prefix cache hits in between).
    for (i, lag) in [0.0, -0.3, 0.3].into_iter().enumerate() {
        let room = (1u64 << 62) + i as u64;
        let body = json!({"model": "Qwen/Qwen3-8B", "prompt": prompt(1000, 100 + 2000 * i as u32),
            "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}});
        let leg = with_room(&body, boot, room);
        let ((ps, ptext), (ds, dtext)) = if lag > 0.0 {
            // The prefill answers and holds the room's KV until its decode asks.
            let prefill = send(p.addr, "POST", "/v1/completions", &leg.to_string());
            let m = metrics(p.addr);
            assert_eq!(sample(&m, "kvlb_replica_kv_held_requests", ""), 1.0);
            assert_eq!(sample(&m, "kvlb_replica_kv_held_blocks", ""), 63.0); // 1000 / 16
            std::thread::sleep(Duration::from_secs_f64(lag));
            let decode = send(d.addr, "POST", "/v1/completions", &leg.to_string());
            (prefill, decode)
        } else {
            both_legs(p.addr, d.addr, "/v1/completions", &leg, lag)
        };
        assert_eq!((ps, ds), (200, 200), "{ptext}\n{dtext}");
        // The prefill: its one token, streamed as asked.
        let chunks = events(&ptext);
        let texts = chunks
            .iter()
            .filter(|c| c["choices"][0]["text"].is_string());
        assert_eq!(texts.count(), 1, "{ptext}");
        assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 1);
        // The decode: the whole answer, its prompt's KV from the prefill.
        let chunks = events(&dtext);
        let texts = chunks
            .iter()
            .filter(|c| c["choices"][0]["text"].is_string());
        assert_eq!(texts.count(), 5, "{dtext}");
        let usage = &chunks.last().unwrap()["usage"];
        assert_eq!(usage["prompt_tokens"], 1000);
        assert_eq!(usage["completion_tokens"], 5);
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"], 999,
            "lag {lag}"
        );
    }
    let m = metrics(d.addr);
    for (name, value) in [
        ("kvlb_replica_kv_transfers_pulled_total", 3.0),
        ("kvlb_replica_kv_transfer_tokens_pulled_total", 3000.0),
        ("vllm:nixl_bytes_transferred_sum", 3000.0 * 131_072.0),
        ("vllm:nixl_xfer_time_seconds_count", 3.0),
        ("vllm:nixl_num_failed_transfers_total", 0.0),
        ("kvlb_replica_kv_transfer_failures_total", 0.0),
        ("vllm:prompt_tokens_total", 3000.0),
        ("vllm:prefix_cache_hits_total", 0.0),
        ("vllm:external_prefix_cache_queries_total", 3000.0),
        ("vllm:external_prefix_cache_hits_total", 2997.0),
        // Prefill compute skipped: one prompt token computed per request.
        ("vllm:request_prefill_kv_computed_tokens_sum", 3.0),
        ("kvlb_replica_kv_local_prefills_total", 0.0),
    ] {
        assert_eq!(sample(&m, name, ""), value, "{name}");
    }
    let m = metrics(p.addr);
    for (name, value) in [
        ("kvlb_replica_kv_held_blocks", 0.0),
        ("kvlb_replica_kv_held_requests", 0.0),
        ("kvlb_replica_kv_transfers_served_total", 3.0),
        ("kvlb_replica_kv_transfer_tokens_served_total", 3000.0),
        ("vllm:nixl_num_kv_expired_reqs_total", 0.0),
        ("vllm:kv_cache_usage_perc", 0.0),
        ("vllm:generation_tokens_total", 3.0),
    ] {
        assert_eq!(sample(&m, name, ""), value, "{name}");
    }
    // A second fetch of a room fails at once (404 on the bootstrap server): a 500 for the
    // decode's client, before anything is streamed.
    let body = json!({"prompt": prompt(1000, 100), "max_tokens": 5, "stream": true});
    let again = with_room(&body, boot, 1 << 62);
    let (status, text) = send(d.addr, "POST", "/v1/completions", &again.to_string());
    assert_eq!(status, 500, "{text}");
    assert!(error_message(&text).contains("already fetched"), "{text}");
    let m = metrics(d.addr);
    let failures = |reason: &str| {
        sample(
            &m,
            "kvlb_replica_kv_transfer_failures_total",
            &format!("reason=\"{reason}\""),
        )
    };
    assert_eq!(failures("not_found"), 1.0);
    assert_eq!(sample(&m, "vllm:nixl_num_failed_transfers_total", ""), 1.0);
    assert_eq!(sample(&m, "vllm:num_requests_running", ""), 0.0);
}

#[test]
fn a_room_never_prefilled_fails_its_decode_after_the_wait() {
    let p = sglang("prefill", &[]);
    let d = sglang("decode", &["--kv-wait-timeout", "0.5"]);
    let body = json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "stream": true});
    let sent = Instant::now();
    let leg = with_room(&body, p.bootstrap.unwrap(), 42);
    let (status, text) = send(d.addr, "POST", "/v1/chat/completions", &leg.to_string());
    let waited = sent.elapsed();
    // A plain 500 in OpenAI's error shape, not a stream.
    assert_eq!(status, 500, "{text}");
    let err: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(err["error"]["type"], "InternalServerError");
    assert_eq!(err["error"]["code"], 500);
    let message = err["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("bootstrap_room 42") && message.contains("504"),
        "{message}"
    );
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    // A bootstrap server nobody runs: at once.
    let mut leg = leg.clone();
    leg["bootstrap_port"] = json!(closed_port());
    leg["bootstrap_room"] = json!(43);
    let (status, text) = send(d.addr, "POST", "/v1/chat/completions", &leg.to_string());
    assert_eq!(status, 500, "{text}");
    assert!(error_message(&text).contains("bootstrap_room 43"), "{text}");
    let m = metrics(d.addr);
    let failures = |reason: &str| {
        sample(
            &m,
            "kvlb_replica_kv_transfer_failures_total",
            &format!("reason=\"{reason}\""),
        )
    };
    assert_eq!(
        (
            failures("timeout"),
            failures("unreachable"),
            failures("not_found"),
            failures("bad_answer")
        ),
        (1.0, 1.0, 0.0, 0.0)
    );
    assert_eq!(sample(&m, "vllm:nixl_num_failed_transfers_total", ""), 2.0);
    // Nothing reached the engine, nothing fell back to a local prefill.
    assert_eq!(sample(&m, "vllm:prefix_cache_queries_total", ""), 0.0);
    assert_eq!(sample(&m, "vllm:num_requests_waiting", ""), 0.0);
    assert_eq!(sample(&m, "kvlb_replica_kv_local_prefills_total", ""), 0.0);
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfers_pulled_total", ""),
        0.0
    );
    // The prefill replica holds nothing for the room it never saw.
    assert_eq!(metric(p.addr, "kvlb_replica_kv_held_requests"), 0.0);
}

#[test]
fn an_unfetched_room_expires_and_is_counted() {
    // Wall seconds, whatever the time scale (100 here).
    let p = sglang("prefill", &["--kv-hold-timeout", "1"]);
    let d = sglang("decode", &[]);
    let body = json!({"prompt": prompt(200, 7), "max_tokens": 3});
    let leg = with_room(&body, p.bootstrap.unwrap(), 7);
    let sent = Instant::now();
    let (status, answer) = post(p.addr, "/v1/completions", &leg);
    assert_eq!(status, 200, "{answer}");
    // SGLang's prefill makes one token, whatever max_tokens says; no vLLM params.
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    assert_eq!(answer["kv_transfer_params"], Value::Null);
    assert_eq!(metric(p.addr, "kvlb_replica_kv_held_blocks"), 13.0);
    wait_for(p.addr, "vllm:nixl_num_kv_expired_reqs_total", 1.0);
    assert!(sent.elapsed() >= Duration::from_secs(1));
    let m = metrics(p.addr);
    assert_eq!(sample(&m, "kvlb_replica_kv_held_blocks", ""), 0.0);
    assert_eq!(sample(&m, "kvlb_replica_kv_held_requests", ""), 0.0);
    assert_eq!(sample(&m, "vllm:kv_cache_usage_perc", ""), 0.0);
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfers_served_total", ""),
        0.0
    );
    // Its decode comes too late: it fails at once (the room is known to have expired), not
    // after --kv-wait-timeout.
    let asked = Instant::now();
    let (status, text) = send(d.addr, "POST", "/v1/completions", &leg.to_string());
    assert_eq!(status, 500, "{text}");
    assert!(error_message(&text).contains("expired"), "{text}");
    assert!(asked.elapsed() < Duration::from_secs(5));
    let m = metrics(d.addr);
    assert_eq!(
        sample(
            &m,
            "kvlb_replica_kv_transfer_failures_total",
            "reason=\"not_found\""
        ),
        1.0
    );
}

#[test]
fn a_decode_that_gives_up_leaves_its_rooms_kv_held() {
    let p = sglang("prefill", &[]);
    let d = sglang("decode", &[]);
    let body = json!({"prompt": prompt(300, 50), "max_tokens": 4});
    let leg = with_room(&body, p.bootstrap.unwrap(), 99).to_string();
    // The decode leg arrives first and waits at the bootstrap server; its client leaves.
    let mut s = TcpStream::connect(d.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n{leg}",
        leg.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(s);
    // Both sides notice within 100 ms; then the prefill arrives and finishes.
    std::thread::sleep(Duration::from_millis(400));
    let (status, _) = send(p.addr, "POST", "/v1/completions", &leg);
    assert_eq!(status, 200);
    // The abandoned fetch took nothing: the KV waits for another fetch of the room.
    let m = metrics(p.addr);
    assert_eq!(sample(&m, "kvlb_replica_kv_held_requests", ""), 1.0);
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfers_served_total", ""),
        0.0
    );
    let m = metrics(d.addr);
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfers_pulled_total", ""),
        0.0
    );
    assert_eq!(
        sample(&m, "kvlb_replica_kv_transfer_failures_total", ""),
        0.0
    );
    assert_eq!(sample(&m, "vllm:prefix_cache_queries_total", ""), 0.0);
    let (status, out) = post(
        d.addr,
        "/v1/completions",
        &serde_json::from_str(&leg).unwrap(),
    );
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["usage"]["prompt_tokens_details"]["cached_tokens"], 299);
    assert_eq!(out["usage"]["completion_tokens"], 4);
    wait_for(p.addr, "kvlb_replica_kv_held_requests", 0.0);
}

#[test]
fn plain_batch_and_malformed_requests_under_sglang() {
    let p = sglang("prefill", &[]);
    let d = sglang("decode", &[]);
    let boot = p.bootstrap.unwrap();
    let body = json!({"prompt": prompt(100, 3), "max_tokens": 3});
    // Without a room: refused by both, as SGLang's scheduler refuses it; so are vLLM's
    // params, which mean nothing to an SGLang replica. Nothing held, nothing fetched.
    let mut vllm = body.clone();
    vllm["kv_transfer_params"] = json!({"do_remote_decode": true});
    for r in [&p, &d] {
        for b in [&body, &vllm] {
            let (status, out) = post(r.addr, "/v1/completions", b);
            assert_eq!(status, 400, "{out}");
            assert_eq!(out["error"]["param"], "bootstrap_room", "{out}");
        }
    }
    assert_eq!(metric(p.addr, "kvlb_replica_kv_held_requests"), 0.0);
    // Batches, as SGLang's router sends them (the fields as lists), or with one room: 400.
    let mut batch = json!({"prompt": [prompt(10, 1), prompt(10, 2)], "max_tokens": 2,
        "bootstrap_host": ["127.0.0.1", "127.0.0.1"], "bootstrap_port": [boot.port(), boot.port()],
        "bootstrap_room": [1, 2]});
    for r in [&p, &d] {
        let (status, err) = post(r.addr, "/v1/completions", &batch);
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["type"], "BadRequestError");
        assert!(err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("batches are not supported"));
    }
    batch["bootstrap_room"] = json!(5);
    let mut n2 = with_room(&body, boot, 6);
    n2["n"] = json!(2);
    for b in [&batch, &n2] {
        let (status, err) = post(d.addr, "/v1/completions", b);
        assert_eq!(status, 400, "{err}");
    }
    // Malformed fields, and a null port with nothing to stand for it.
    for (key, value, says) in [
        ("bootstrap_room", json!(-1), "bootstrap_room"),
        ("bootstrap_room", json!("5"), "bootstrap_room"),
        ("bootstrap_host", Value::Null, "bootstrap_host"),
        ("bootstrap_port", json!(0), "bootstrap_port"),
        (
            "bootstrap_port",
            Value::Null,
            "--disaggregation-bootstrap-port",
        ),
    ] {
        let mut leg = with_room(&body, boot, 8);
        leg[key] = value;
        let (status, err) = post(d.addr, "/v1/completions", &leg);
        assert_eq!(status, 400, "{key}: {err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{key}: {message}");
    }
    // A prompt the decode's engine refuses is refused before any fetch.
    let mut long = with_room(&body, boot, 9);
    long["max_tokens"] = json!(1_000_000);
    let (status, err) = post(d.addr, "/v1/completions", &long);
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    // Nothing of that was counted as a transfer failure, nor left anything held.
    assert_eq!(
        metric(d.addr, "kvlb_replica_kv_transfer_failures_total"),
        0.0
    );
    assert_eq!(metric(p.addr, "kvlb_replica_kv_held_requests"), 0.0);
    // The bootstrap server itself.
    for (body, status, says) in [
        (json!({}), 400, "bootstrap_room: field required"),
        (
            json!({"remote_engine_id": "e", "remote_request_id": "cmpl-1-1"}),
            400,
            "bootstrap_room",
        ),
        (json!({"bootstrap_room": 1, "wait_s": -1}), 400, "wait_s"),
        (
            json!({"bootstrap_room": 5, "wait_s": 0}),
            504,
            "no prefill of it finished within 0 s",
        ),
    ] {
        let (got, err) = post(boot, "/kv/pull", &body);
        assert_eq!(got, status, "{body}: {err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    let (status, _) = send(boot, "GET", "/kv/pull", "");
    assert_eq!(status, 405);
}

#[test]
fn a_null_port_is_the_decodes_own_and_rooms_span_data_parallel_ranks() {
    let p = sglang("prefill", &["--dp-size", "2"]);
    let boot = p.bootstrap.unwrap();
    let port = boot.port().to_string();
    let d = sglang("decode", &["--disaggregation-bootstrap-port", &port]);
    // Two rooms, one on each rank of the prefill replica (round-robin), their ports null.
    for room in [11, 12] {
        let body = json!({"messages": [{"role": "user", "content": format!("room {room} ").repeat(100)}],
            "max_completion_tokens": 3});
        let mut leg = with_room(&body, boot, room);
        leg["bootstrap_port"] = Value::Null;
        let ((ps, ptext), (ds, dtext)) =
            both_legs(p.addr, d.addr, "/v1/chat/completions", &leg, 0.0);
        assert_eq!((ps, ds), (200, 200), "{ptext}\n{dtext}");
        let out: Value = serde_json::from_str(&dtext).unwrap();
        let prompt_tokens = out["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(
            out["usage"]["prompt_tokens_details"]["cached_tokens"],
            prompt_tokens - 1
        );
        assert_eq!(out["usage"]["completion_tokens"], 3);
    }
    let m = metrics(p.addr);
    for rank in ["engine=\"0\"", "engine=\"1\""] {
        assert_eq!(
            sample(&m, "kvlb_replica_kv_transfers_served_total", rank),
            1.0,
            "{rank}"
        );
        assert_eq!(sample(&m, "kvlb_replica_kv_held_requests", rank), 0.0);
    }
    assert_eq!(
        metric(d.addr, "kvlb_replica_kv_transfers_pulled_total"),
        2.0
    );
}
