//! Robustness of `kvlb serve` beyond the happy path: stale pooled upstream connections,
//! upstream `Connection: close`, malformed upstream responses, HTTP/1.0 clients, heads that
//! arrive a byte at a time, large response heads, idle and closing client connections, and
//! many concurrent clients over two workers.

#[path = "support/mod.rs"]
mod support;

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use support::digest::{payload, sha256_hex};
use support::{show_bytes, Backend, HttpConn, Kvlb};

fn proxied_to(backend: &Backend, extra: &[&str]) -> Kvlb {
    let url = backend.url();
    let mut args = vec!["--replica", url.as_str(), "--workers", "1"];
    args.extend_from_slice(extra);
    Kvlb::serve(&args)
}

fn expect_ok(resp: &support::Response, kvlb: &Kvlb, what: &str) {
    assert_eq!(
        resp.status,
        200,
        "{what}: expected 200, got:\n{}\nkvlb stderr:\n{}",
        resp.describe(),
        kvlb.stderr()
    );
}

#[test]
fn stale_pooled_upstream_connection_is_not_used_for_a_post() {
    // The backend silently closes a kept-alive connection after 300 ms idle, as servers do.
    let backend = Backend::start_with(&["--idle-close-ms", "300"]);
    let kvlb = proxied_to(&backend, &[]);
    let body = br#"{"model":"m","prompt":"first"}"#;
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("POST", "/echo", &[], body)
        .expect("first POST");
    expect_ok(&resp, &kvlb, "first POST");
    std::thread::sleep(Duration::from_millis(900));
    let body = br#"{"model":"m","prompt":"second"}"#;
    let resp = conn
        .request("POST", "/echo", &[], body)
        .unwrap_or_else(|e| panic!("POST after the upstream closed its idle connection: {e}"));
    expect_ok(
        &resp,
        &kvlb,
        "POST after the backend closed the pooled upstream connection (stale connection reused?)",
    );
    assert_eq!(resp.body, body);
}

#[test]
fn stale_pooled_upstream_connection_is_not_used_for_a_get() {
    let backend = Backend::start_with(&["--idle-close-ms", "300"]);
    let kvlb = proxied_to(&backend, &[]);
    expect_ok(&kvlb.get("/echo"), &kvlb, "first GET");
    std::thread::sleep(Duration::from_millis(900));
    expect_ok(
        &kvlb.get("/echo"),
        &kvlb,
        "GET after the backend closed the pooled upstream connection",
    );
}

#[test]
fn upstream_connection_close_is_honoured() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("POST", "/echo?conn_close=1", &[], b"one")
        .expect("POST with upstream Connection: close");
    expect_ok(&resp, &kvlb, "upstream answered with Connection: close");
    assert_eq!(resp.body, b"one");
    // Right away: the closed upstream connection must not be reused.
    let resp = conn
        .request("POST", "/echo", &[], b"two")
        .unwrap_or_else(|e| panic!("request after an upstream Connection: close: {e}"));
    expect_ok(&resp, &kvlb, "request after an upstream Connection: close");
    assert_eq!(resp.body, b"two");
    assert_eq!(
        resp.header("x-got-connection-count"),
        Some("1"),
        "expected a fresh upstream connection"
    );
}

/// What a client of a replica that sent malformed bytes may see.
enum Outcome {
    /// Content-Length with Transfer-Encoding: RFC 9112 section 6.1 lets an intermediary
    /// either reject it (502) or forward it framed by Transfer-Encoding with the
    /// Content-Length removed.
    ChunkedOnlyAllowed,
    /// Only a 502 JSON error is right (the head itself is bad).
    OnlyBadGateway,
    /// The head may already have been forwarded: a 502, or the connection closed before a
    /// complete response; never garbage parsed as a response, never a hang.
    TruncationAllowed,
}

fn malformed_upstream(kind: &str, outcome: Outcome) {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send_request("GET", &format!("/raw?kind={kind}"), &[], b"")
        .unwrap();
    let result = conn.read_response("GET");
    match (&result, &outcome) {
        (Ok(resp), _) if resp.status == 502 && resp.is_json_error() => {}
        (Ok(resp), Outcome::ChunkedOnlyAllowed)
            if resp.status == 200
                && resp.header("content-length").is_none()
                && resp.framing == support::client::Framing::Chunked
                && resp.body.is_empty() => {}
        (Err(e), Outcome::TruncationAllowed)
            if matches!(
                e.kind(),
                ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
            ) => {}
        (Ok(resp), _) => panic!(
            "replica sent malformed response {kind:?}; client got instead of a 502:\n{}",
            resp.describe()
        ),
        (Err(e), _) => panic!(
            "replica sent malformed response {kind:?}; client read failed with {:?}: {e}\n\
             kvlb stderr:\n{}",
            e.kind(),
            kvlb.stderr()
        ),
    }
    let (more, _) = conn.read_for(Duration::from_millis(500));
    assert!(
        !String::from_utf8_lossy(&more).contains("smuggled"),
        "bytes of the replica's malformed response reached the client: {}",
        show_bytes(&more)
    );
    expect_ok(&kvlb.get("/echo"), &kvlb, "normal request afterwards");
}

#[test]
fn upstream_response_with_content_length_and_transfer_encoding_is_not_ambiguous() {
    malformed_upstream("cl_te", Outcome::ChunkedOnlyAllowed);
}

#[test]
fn upstream_response_with_conflicting_content_lengths_gets_502() {
    malformed_upstream("dup_cl", Outcome::OnlyBadGateway);
}

#[test]
fn upstream_response_with_bad_status_line_gets_502() {
    malformed_upstream("bad_status", Outcome::OnlyBadGateway);
}

#[test]
fn upstream_garbage_gets_502() {
    malformed_upstream("garbage", Outcome::OnlyBadGateway);
}

#[test]
fn upstream_bad_chunk_size_is_not_passed_through() {
    malformed_upstream("bad_chunk", Outcome::OnlyBadGateway);
}

#[test]
fn upstream_short_body_is_not_completed() {
    malformed_upstream("short_cl", Outcome::TruncationAllowed);
}

#[test]
fn http10_client_gets_a_body_it_can_read() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /chunked?n=3&size=1000 HTTP/1.0\r\n\r\n")
        .unwrap();
    let resp = conn.read_response("GET").expect("response to HTTP/1.0");
    expect_ok(&resp, &kvlb, "HTTP/1.0 GET /chunked");
    let te = resp.header("transfer-encoding").unwrap_or("");
    assert!(
        !te.to_ascii_lowercase().contains("chunked"),
        "chunked coding sent to an HTTP/1.0 client:\n{}",
        resp.describe()
    );
    assert_eq!(resp.body.len(), 3000);
    assert_eq!(
        resp.header("x-body-sha256"),
        Some(sha256_hex(&resp.body).as_str())
    );
}

#[test]
fn request_arriving_one_byte_at_a_time_is_served() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let body = b"{\"prompt\":\"dribbled\"}";
    let raw = format!(
        "POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut bytes = raw.into_bytes();
    bytes.extend_from_slice(body);
    for b in &bytes {
        conn.send(std::slice::from_ref(b)).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let resp = conn.read_response("POST").expect("response");
    expect_ok(&resp, &kvlb, "byte-at-a-time POST");
    assert_eq!(resp.body, body);
}

#[test]
fn large_response_head_is_forwarded() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    // 24 KB in 8 fields: more than one read of the replica's socket, well under the 64 KiB
    // response-head limit and the field-count limit.
    let resp = kvlb.get("/bigheaders?size=24000&fields=8");
    expect_ok(&resp, &kvlb, "24 KB response head");
    let pads = resp
        .headers
        .iter()
        .filter(|(n, _)| n.starts_with("x-pad-"))
        .count();
    assert_eq!(pads, 8, "response header fields lost");
    assert!(resp
        .headers
        .iter()
        .all(|(n, v)| !n.starts_with("x-pad-") || v.len() == 2986));
    assert_eq!(resp.body, b"big headers\n");
}

#[test]
fn client_connection_close_is_honoured() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("GET", "/echo", &[("Connection", "close")], b"")
        .expect("GET with Connection: close");
    expect_ok(&resp, &kvlb, "GET with Connection: close");
    let (more, closed) = conn.read_for(Duration::from_secs(3));
    assert!(
        more.is_empty(),
        "bytes after the response: {}",
        show_bytes(&more)
    );
    assert!(
        closed,
        "connection kept open after the client sent Connection: close"
    );
}

#[test]
fn idle_client_connection_is_closed_after_idle_timeout() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &["--idle-timeout", "1s"]);
    let mut conn = HttpConn::connect(kvlb.listen);
    expect_ok(
        &conn.request("GET", "/echo", &[], b"").unwrap(),
        &kvlb,
        "first",
    );
    std::thread::sleep(Duration::from_millis(300));
    expect_ok(
        &conn
            .request("GET", "/echo", &[], b"")
            .expect("second request within the idle timeout"),
        &kvlb,
        "second",
    );
    let idle_from = Instant::now();
    let (more, closed) = conn.read_for(Duration::from_secs(5));
    assert!(
        closed,
        "idle connection still open after 5 s with --idle-timeout 1s"
    );
    assert!(
        idle_from.elapsed() >= Duration::from_millis(800),
        "closed after {} ms idle",
        idle_from.elapsed().as_millis()
    );
    // Closing silently is usual; a 408 is allowed.
    assert!(
        more.is_empty() || more.starts_with(b"HTTP/1.1 408"),
        "unexpected bytes on an idle connection: {}",
        show_bytes(&more)
    );
}

#[test]
fn concurrent_clients_over_two_workers_get_their_own_bodies() {
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&["--replica", url.as_str(), "--workers", "2"]);
    let listen = kvlb.listen;
    let started = Instant::now();
    let threads: Vec<_> = (0..16u64)
        .map(|t| {
            std::thread::spawn(move || -> Result<(), String> {
                let mut conn = HttpConn::connect(listen);
                for i in 0..12u64 {
                    let seed = t * 1000 + i;
                    let len = ((seed * 7919) % 150_000) as usize;
                    let body = payload(len, seed);
                    let resp = if i % 3 == 2 {
                        conn.request("GET", "/chunked?n=4&size=5000", &[], b"")
                    } else {
                        conn.request("POST", &format!("/echo?t={t}&i={i}"), &[], &body)
                    }
                    .map_err(|e| format!("client {t} request {i}: {e}"))?;
                    if resp.status != 200 {
                        return Err(format!("client {t} request {i}:\n{}", resp.describe()));
                    }
                    let want = if i % 3 == 2 {
                        resp.header("x-body-sha256").unwrap_or("").to_string()
                    } else {
                        sha256_hex(&body)
                    };
                    if sha256_hex(&resp.body) != want {
                        return Err(format!("client {t} request {i}: body mixed up"));
                    }
                    if i % 3 != 2
                        && resp.header("x-got-path") != Some(format!("/echo?t={t}&i={i}").as_str())
                    {
                        return Err(format!(
                            "client {t} request {i}: answer to another request:\n{}",
                            resp.describe()
                        ));
                    }
                }
                Ok(())
            })
        })
        .collect();
    let errors: Vec<String> = threads
        .into_iter()
        .filter_map(|t| t.join().unwrap().err())
        .collect();
    assert!(
        errors.is_empty(),
        "{} of 16 clients failed:\n{}\nkvlb stderr:\n{}",
        errors.len(),
        errors.join("\n"),
        kvlb.stderr()
    );
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn chunked_request_arriving_one_byte_at_a_time_is_served() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let raw = b"POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n3;x=y\r\nefg\r\n0\r\n\r\n";
    for b in raw.iter() {
        conn.send(std::slice::from_ref(b)).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let resp = conn.read_response("POST").expect("response");
    expect_ok(&resp, &kvlb, "byte-at-a-time chunked POST");
    assert_eq!(resp.body, b"abcdefg");
}

#[test]
fn transfer_encoding_is_case_insensitive() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"POST /echo HTTP/1.1\r\nHost: kvlb.test\r\ntransfer-encoding: Chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        .unwrap();
    let resp = conn.read_response("POST").expect("response");
    expect_ok(&resp, &kvlb, "Transfer-Encoding: Chunked");
    assert_eq!(resp.body, b"hello");
}

#[test]
fn empty_post_body_is_forwarded() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("POST", "/echo", &[("Content-Length", "0")], b"")
        .expect("POST");
    expect_ok(&resp, &kvlb, "POST with Content-Length: 0");
    assert_eq!(resp.header("x-got-body-len"), Some("0"));
    let resp = conn.request("GET", "/echo", &[], b"").expect("GET after");
    expect_ok(&resp, &kvlb, "GET after an empty POST");
}

#[test]
fn long_request_target_is_forwarded() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let path = format!("/echo?q={}", "k".repeat(10_000));
    let resp = support::client::get(kvlb.listen, &path);
    expect_ok(&resp, &kvlb, "10 KB request target");
    assert_eq!(resp.header("x-got-path"), Some(path.as_str()));
}

#[test]
fn chunked_body_at_the_limit_is_served() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &["--max-body-bytes", "1000"]);
    let mut raw =
        b"POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..4 {
        raw.extend_from_slice(b"fa\r\n");
        raw.extend_from_slice(&[b'e'; 250]);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(&raw).unwrap();
    let resp = conn.read_response("POST").expect("response");
    expect_ok(
        &resp,
        &kvlb,
        "1000-byte chunked body with --max-body-bytes 1000",
    );
    assert_eq!(resp.body.len(), 1000);
}

#[test]
fn expect_100_continue_with_too_large_body_gets_413_without_the_body() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &["--max-body-bytes", "1000"]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(
        b"POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n",
    )
    .unwrap();
    conn.set_read_timeout(Duration::from_secs(3));
    let resp = conn.read_response("POST").unwrap_or_else(|e| {
        panic!("no final answer to an oversized Expect: 100-continue request within 3 s: {e}")
    });
    assert_eq!(resp.status, 413, "{}", resp.describe());
    assert!(
        resp.interim.is_empty(),
        "100 Continue invited a body that is then refused: {:?}",
        resp.interim
    );
    assert_eq!(
        backend.stats().requests,
        1,
        "oversized request reached the backend"
    );
}

#[test]
fn max_connections_refuses_extra_clients_and_recovers() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &["--max-connections", "2"]);
    let mut held: Vec<HttpConn> = (0..2)
        .map(|i| {
            let mut c = HttpConn::connect(kvlb.listen);
            let resp = c
                .request("GET", "/echo", &[], b"")
                .expect("held connection");
            expect_ok(&resp, &kvlb, &format!("held connection {i}"));
            c
        })
        .collect();
    // A third client is not served while two are open: refused, closed, or a 503.
    let third = HttpConn::try_connect(kvlb.listen).ok().and_then(|mut c| {
        c.set_read_timeout(Duration::from_secs(3));
        c.request("GET", "/echo", &[], b"").ok()
    });
    if let Some(resp) = &third {
        assert!(
            resp.status == 503 && resp.is_json_error(),
            "third connection with --max-connections 2 got:\n{}",
            resp.describe()
        );
    }
    // Once one client leaves, a new one is served.
    drop(held.pop());
    let served = support::wait_until(Duration::from_secs(3), || {
        HttpConn::try_connect(kvlb.listen)
            .ok()
            .and_then(|mut c| {
                c.set_read_timeout(Duration::from_secs(2));
                c.request("GET", "/echo", &[], b"").ok()
            })
            .is_some_and(|r| r.status == 200)
    });
    assert!(served, "no client served after a held connection closed");
    // The remaining held connection still works.
    let resp = held[0].request("GET", "/echo", &[], b"").expect("held");
    expect_ok(&resp, &kvlb, "remaining held connection");
}

#[test]
fn upstream_chunk_extensions_and_trailer_are_handled() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("GET", "/chunked?n=5&size=777&ext=1&trailer=1", &[], b"")
        .unwrap_or_else(|e| panic!("chunked response with extensions and a trailer: {e}"));
    expect_ok(
        &resp,
        &kvlb,
        "chunked response with extensions and a trailer",
    );
    assert_eq!(resp.body.len(), 5 * 777);
    assert_eq!(
        resp.header("x-body-sha256"),
        Some(sha256_hex(&resp.body).as_str())
    );
    let resp = conn
        .request("GET", "/echo", &[], b"")
        .unwrap_or_else(|e| panic!("request after a response trailer: {e}"));
    expect_ok(&resp, &kvlb, "request after a response trailer");
}

#[test]
fn head_answered_with_transfer_encoding_has_no_body() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.set_read_timeout(Duration::from_secs(4));
    let resp = conn
        .request("HEAD", "/chunked", &[], b"")
        .unwrap_or_else(|e| panic!("HEAD answered with Transfer-Encoding: chunked: {e}"));
    expect_ok(&resp, &kvlb, "HEAD /chunked");
    let (stray, _) = conn.read_for(Duration::from_millis(300));
    assert!(
        stray.is_empty(),
        "body bytes after HEAD: {}",
        show_bytes(&stray)
    );
    let resp = conn
        .request("GET", "/echo", &[], b"")
        .unwrap_or_else(|e| panic!("request after HEAD /chunked (proxy waiting for a body?): {e}"));
    expect_ok(&resp, &kvlb, "request after HEAD /chunked");
}

#[test]
fn not_modified_with_content_length_has_no_body() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.set_read_timeout(Duration::from_secs(4));
    let resp = conn
        .request("GET", "/status?code=304&cl=100", &[], b"")
        .unwrap_or_else(|e| panic!("304 announcing Content-Length: 100: {e}"));
    assert_eq!(resp.status, 304, "{}", resp.describe());
    let resp = conn.request("GET", "/echo", &[], b"").unwrap_or_else(|e| {
        panic!("request after a 304 with Content-Length (proxy waiting for a body?): {e}")
    });
    expect_ok(&resp, &kvlb, "request after a 304 with Content-Length");
}

#[test]
fn pipelined_slow_request_keeps_responses_in_order() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(
        b"GET /slow?ms=600 HTTP/1.1\r\nHost: kvlb.test\r\n\r\nGET /echo?second HTTP/1.1\r\nHost: kvlb.test\r\n\r\n",
    )
    .unwrap();
    let first = conn.read_response("GET").expect("first pipelined response");
    expect_ok(&first, &kvlb, "first pipelined (slow) request");
    assert_eq!(
        first.body,
        b"slow done\n",
        "responses out of order:\n{}",
        first.describe()
    );
    let second = conn
        .read_response("GET")
        .expect("second pipelined response");
    expect_ok(&second, &kvlb, "second pipelined request");
    assert_eq!(second.header("x-got-path"), Some("/echo?second"));
}

#[test]
fn request_pipelined_after_connection_close_is_not_served() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(
        b"GET /echo?first HTTP/1.1\r\nHost: kvlb.test\r\nConnection: close\r\n\r\nGET /echo?after-close HTTP/1.1\r\nHost: kvlb.test\r\n\r\n",
    )
    .unwrap();
    let first = conn.read_response("GET").expect("first response");
    expect_ok(&first, &kvlb, "request with Connection: close");
    let (more, closed) = conn.read_for(Duration::from_secs(2));
    assert!(
        more.is_empty(),
        "request after Connection: close was answered: {}",
        show_bytes(&more)
    );
    assert!(closed, "connection not closed after Connection: close");
    let stats = backend.stats();
    assert_eq!(
        stats.requests, 2,
        "the backend saw the request after Connection: close"
    );
}

#[test]
fn client_leaving_mid_stream_stops_the_upstream_stream() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send_request("GET", "/sse?n=50&interval_ms=100", &[], b"")
        .unwrap();
    let (_, status, _, _) = conn.read_head().expect("stream head");
    assert_eq!(status, 200);
    // Read a couple of events, then leave (like a user pressing stop).
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("\"i\": 1") {
        let chunk = conn.read_some().expect("events");
        assert!(!chunk.is_empty(), "stream ended early");
        got.extend_from_slice(&chunk);
    }
    drop(conn);
    let stopped = support::wait_until(Duration::from_millis(2000), || backend.stats().aborted >= 1);
    assert!(
        stopped,
        "backend still streaming 2 s after the client left (the stream lasts 5 s): {:?}",
        backend.stats()
    );
}

#[test]
fn long_pipelined_burst_is_answered_in_order() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let n = 200;
    let mut raw = Vec::new();
    for i in 0..n {
        raw.extend_from_slice(
            format!("GET /echo?n={i} HTTP/1.1\r\nHost: kvlb.test\r\n\r\n").as_bytes(),
        );
    }
    conn.send(&raw).expect("send the burst");
    for i in 0..n {
        let resp = conn.read_response("GET").unwrap_or_else(|e| {
            panic!(
                "pipelined response {i} of {n}: {e}\nkvlb stderr:\n{}",
                kvlb.stderr()
            )
        });
        expect_ok(&resp, &kvlb, "pipelined GET");
        assert_eq!(
            resp.header("x-got-path"),
            Some(format!("/echo?n={i}").as_str())
        );
    }
}

#[test]
fn many_simultaneous_connections_are_all_served() {
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&["--replica", url.as_str(), "--workers", "2"]);
    // 200 clients connect and send at once, then read.
    let mut conns: Vec<HttpConn> = (0..200).map(|_| HttpConn::connect(kvlb.listen)).collect();
    for (i, c) in conns.iter_mut().enumerate() {
        c.send_request(
            "POST",
            &format!("/echo?c={i}"),
            &[],
            format!("client {i}").as_bytes(),
        )
        .expect("send");
    }
    for (i, c) in conns.iter_mut().enumerate() {
        let resp = c
            .read_response("POST")
            .unwrap_or_else(|e| panic!("client {i} of 200: {e}\nkvlb stderr:\n{}", kvlb.stderr()));
        expect_ok(&resp, &kvlb, "simultaneous client");
        assert_eq!(resp.body, format!("client {i}").as_bytes());
    }
}

#[test]
fn request_pipelined_while_the_first_is_in_flight_is_answered_after_it() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /slow?ms=500 HTTP/1.1\r\nHost: kvlb.test\r\n\r\n")
        .unwrap();
    // The second request arrives while kvlb waits on the replica for the first.
    std::thread::sleep(Duration::from_millis(150));
    conn.send(b"GET /echo?second HTTP/1.1\r\nHost: kvlb.test\r\n\r\n")
        .unwrap();
    let first = conn.read_response("GET").expect("first response");
    expect_ok(
        &first,
        &kvlb,
        "slow request with a request pipelined behind it",
    );
    assert_eq!(first.body, b"slow done\n", "{}", first.describe());
    let second = conn.read_response("GET").expect("second response");
    expect_ok(
        &second,
        &kvlb,
        "request pipelined while the first was in flight",
    );
    assert_eq!(second.header("x-got-path"), Some("/echo?second"));
    // And the connection still serves.
    let third = conn.request("GET", "/echo?third", &[], b"").expect("third");
    expect_ok(&third, &kvlb, "request after the pipelined pair");
}

#[test]
fn client_leaving_after_pipelining_still_cancels_the_request_in_flight() {
    let backend = Backend::start();
    let kvlb = proxied_to(&backend, &[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /slow?ms=3000 HTTP/1.1\r\nHost: kvlb.test\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    conn.send(b"GET /echo?second HTTP/1.1\r\nHost: kvlb.test\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    drop(conn);
    let cancelled =
        support::wait_until(Duration::from_millis(2000), || backend.stats().aborted >= 1);
    assert!(
        cancelled,
        "backend still serving 2 s after the client left (the slow request takes 3 s): {:?}",
        backend.stats()
    );
}
