//! Hostile and malformed requests against `kvlb serve`: request smuggling shapes (CL+TE,
//! duplicate Content-Length, bad chunk sizes, obs-fold), malformed request lines, unsupported
//! transfer codings, size limits (431, 413) and the client timeout (408).
//!
//! Each case must get a JSON error with the right status, must not reach the backend when the
//! head alone is bad, must not let a smuggled second request through, and must leave the proxy
//! serving normal requests on new connections.

#[path = "support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use support::{show_bytes, Backend, HttpConn, Kvlb};

fn proxied(extra: &[&str]) -> (Backend, Kvlb) {
    let backend = Backend::start();
    let url = backend.url();
    let mut args = vec!["--replica", url.as_str(), "--workers", "1"];
    args.extend_from_slice(extra);
    let kvlb = Kvlb::serve(&args);
    (backend, kvlb)
}

/// Whether the head alone is bad (so nothing may reach the backend), or the fault is in the
/// body (a streaming proxy may already have started the upstream request).
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    Head,
    Body,
}

/// Sends `raw` on a new connection and checks the rejection: a status in `allowed`, a JSON
/// error body, no second response, and a proxy that still serves afterwards.
fn assert_rejected(raw: &[u8], allowed: &[u16], fault: Fault, extra: &[&str]) {
    let (backend, kvlb) = proxied(extra);
    let mut conn = HttpConn::connect(kvlb.listen);
    // The peer may close while we still write: the response is what matters.
    let _ = conn.send(raw);
    let resp = conn.read_response("POST").unwrap_or_else(|e| {
        panic!(
            "no response to\n{}\n-> {e}\nkvlb stderr:\n{}",
            show_bytes(raw),
            kvlb.stderr()
        )
    });
    assert!(
        allowed.contains(&resp.status),
        "request\n{}\nexpected status {allowed:?}, got:\n{}",
        show_bytes(raw),
        resp.describe()
    );
    assert!(
        resp.is_json_error(),
        "error body is not {{\"error\":{{\"message\",\"type\"}}}} for\n{}\ngot:\n{}",
        show_bytes(raw),
        resp.describe()
    );
    // Nothing after the error: a smuggled request must not be answered.
    let (more, _closed) = conn.read_for(Duration::from_millis(700));
    assert!(
        more.is_empty(),
        "bytes after the {} error (smuggled request answered?) for\n{}\n---\n{}",
        resp.status,
        show_bytes(raw),
        show_bytes(&more)
    );
    if fault == Fault::Head {
        let stats = backend.stats();
        assert_eq!(
            stats.requests,
            1,
            "a request with a bad head reached the backend ({} requests besides /stats) for\n{}",
            stats.requests - 1,
            show_bytes(raw)
        );
    }
    // The proxy still serves on a new connection.
    let ok = kvlb.get("/echo");
    assert_eq!(
        ok.status,
        200,
        "after rejecting\n{}\na normal request got:\n{}\nkvlb stderr:\n{}",
        show_bytes(raw),
        ok.describe(),
        kvlb.stderr()
    );
}

/// A POST /echo head with `headers` (CRLF-terminated lines) followed by `body`.
fn post(headers: &str, body: &str) -> Vec<u8> {
    format!("POST /echo HTTP/1.1\r\nHost: kvlb.test\r\n{headers}\r\n{body}").into_bytes()
}

const SMUGGLED: &str = "GET /echo?smuggled=1 HTTP/1.1\r\nHost: kvlb.test\r\n\r\n";

#[test]
fn content_length_with_transfer_encoding_is_rejected() {
    let body = format!("0\r\n\r\n{SMUGGLED}");
    let raw = post(
        &format!(
            "Content-Length: {}\r\nTransfer-Encoding: chunked\r\n",
            body.len()
        ),
        &body,
    );
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn transfer_encoding_before_content_length_is_rejected() {
    let body = format!("0\r\n\r\n{SMUGGLED}");
    let raw = post("Transfer-Encoding: chunked\r\nContent-Length: 4\r\n", &body);
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn duplicate_equal_content_length_is_rejected() {
    let raw = post("Content-Length: 5\r\nContent-Length: 5\r\n", "hello");
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn conflicting_content_lengths_are_rejected() {
    let raw = post(
        "Content-Length: 5\r\nContent-Length: 50\r\n",
        &format!("hello{SMUGGLED}"),
    );
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn content_length_list_is_rejected() {
    let raw = post("Content-Length: 1,2\r\n", "ab");
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn non_numeric_content_length_is_rejected() {
    for value in ["+5", "-5", "5 5", "0x5", "abc"] {
        let raw = post(&format!("Content-Length: {value}\r\n"), "hello");
        assert_rejected(&raw, &[400], Fault::Head, &[]);
    }
}

#[test]
fn non_hex_chunk_size_is_rejected() {
    let raw = post("Transfer-Encoding: chunked\r\n", "zz\r\nhello\r\n0\r\n\r\n");
    assert_rejected(&raw, &[400], Fault::Body, &[]);
}

#[test]
fn negative_chunk_size_is_rejected() {
    let raw = post(
        "Transfer-Encoding: chunked\r\n",
        &format!("-5\r\nhello\r\n0\r\n\r\n{SMUGGLED}"),
    );
    assert_rejected(&raw, &[400], Fault::Body, &[]);
}

#[test]
fn overflowing_chunk_size_is_rejected() {
    // 18 hex digits: more than 64 bits; a wrapping parser would read it as 0xff...
    let raw = post(
        "Transfer-Encoding: chunked\r\n",
        &format!("ffffffffffffffffff\r\nhello\r\n0\r\n\r\n{SMUGGLED}"),
    );
    assert_rejected(&raw, &[400], Fault::Body, &[]);
}

#[test]
fn wrapping_chunk_size_is_rejected() {
    // 17 hex digits that wrap to 5 in 64 bits.
    let raw = post(
        "Transfer-Encoding: chunked\r\n",
        &format!("10000000000000005\r\nhello\r\n0\r\n\r\n{SMUGGLED}"),
    );
    assert_rejected(&raw, &[400], Fault::Body, &[]);
}

#[test]
fn obs_fold_header_with_space_is_rejected() {
    let raw = b"GET /echo HTTP/1.1\r\nHost: kvlb.test\r\nX-Folded: one\r\n two\r\n\r\n";
    assert_rejected(raw, &[400], Fault::Head, &[]);
}

#[test]
fn obs_fold_header_with_tab_is_rejected() {
    // A folded Transfer-Encoding is the classic smuggling variant.
    let raw = "POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nContent-Length: 5\r\nX-Padding: a\r\n\tTransfer-Encoding: chunked\r\n\r\nhello";
    assert_rejected(raw.as_bytes(), &[400], Fault::Head, &[]);
}

#[test]
fn request_line_with_method_only_is_rejected() {
    assert_rejected(b"GET\r\nHost: kvlb.test\r\n\r\n", &[400], Fault::Head, &[]);
}

#[test]
fn request_line_with_unknown_version_is_rejected() {
    // 505 HTTP Version Not Supported is the precise answer; 400 is the contract's.
    assert_rejected(
        b"GET /echo HTTP/9.9\r\nHost: kvlb.test\r\n\r\n",
        &[400, 505],
        Fault::Head,
        &[],
    );
}

#[test]
fn garbage_request_line_is_rejected() {
    let mut raw = vec![
        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
    ];
    raw.extend_from_slice(b"\x00\xff\xfe garbage \x7f\r\n\r\n");
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn request_line_with_spaces_in_target_is_rejected() {
    assert_rejected(
        b"GET /echo HTTP/1.1 extra HTTP/1.1\r\nHost: kvlb.test\r\n\r\n",
        &[400],
        Fault::Head,
        &[],
    );
}

#[test]
fn header_name_with_space_before_colon_is_rejected() {
    // RFC 9112 section 5.1: a server must reject whitespace between name and colon.
    let raw = post(
        "Transfer-Encoding : chunked\r\nContent-Length: 5\r\n",
        "hello",
    );
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn unsupported_transfer_coding_is_rejected() {
    // RFC 9112 section 6.3: without chunked as the final coding, 400.
    let raw = post("Transfer-Encoding: gzip\r\n", "hello");
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn chunked_not_last_is_rejected() {
    let raw = post(
        "Transfer-Encoding: chunked, gzip\r\n",
        "5\r\nhello\r\n0\r\n\r\n",
    );
    assert_rejected(&raw, &[400], Fault::Head, &[]);
}

#[test]
fn coding_before_chunked_is_not_implemented() {
    let raw = post(
        "Transfer-Encoding: gzip, chunked\r\n",
        "5\r\nhello\r\n0\r\n\r\n",
    );
    assert_rejected(&raw, &[501], Fault::Head, &[]);
}

#[test]
fn header_section_over_limit_gets_431() {
    let big = "a".repeat(8000);
    let raw = format!("GET /echo HTTP/1.1\r\nHost: kvlb.test\r\nX-Big: {big}\r\n\r\n");
    assert_rejected(
        raw.as_bytes(),
        &[431],
        Fault::Head,
        &["--max-header-bytes", "4096"],
    );
}

#[test]
fn many_small_headers_over_limit_get_431() {
    let mut raw = String::from("GET /echo HTTP/1.1\r\nHost: kvlb.test\r\n");
    for i in 0..400 {
        raw.push_str(&format!("X-H{i}: value\r\n"));
    }
    raw.push_str("\r\n");
    assert_rejected(
        raw.as_bytes(),
        &[431],
        Fault::Head,
        &["--max-header-bytes", "4096"],
    );
}

#[test]
fn header_section_under_limit_is_served() {
    let (_backend, kvlb) = proxied(&["--max-header-bytes", "4096"]);
    let value = "a".repeat(2000);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("GET", "/echo", &[("X-Medium", value.as_str())], b"")
        .expect("GET");
    assert_eq!(resp.status, 200, "{}", resp.describe());
}

#[test]
fn body_over_limit_by_content_length_gets_413() {
    let body = "b".repeat(5000);
    let raw = post(&format!("Content-Length: {}\r\n", body.len()), &body);
    assert_rejected(&raw, &[413], Fault::Head, &["--max-body-bytes", "1000"]);
}

#[test]
fn body_over_limit_by_chunks_gets_413() {
    let mut body = String::new();
    for _ in 0..5 {
        body.push_str(&format!("{:x}\r\n{}\r\n", 1000, "c".repeat(1000)));
    }
    body.push_str("0\r\n\r\n");
    let raw = post("Transfer-Encoding: chunked\r\n", &body);
    assert_rejected(&raw, &[413], Fault::Body, &["--max-body-bytes", "1000"]);
}

#[test]
fn body_at_limit_is_served() {
    let (_backend, kvlb) = proxied(&["--max-body-bytes", "1000"]);
    let body = vec![b'd'; 1000];
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn.request("POST", "/echo", &[], &body).expect("POST");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    assert_eq!(resp.body, body);
}

#[test]
fn stalled_request_head_gets_408_while_others_are_served() {
    let (_backend, kvlb) = proxied(&["--client-timeout", "1s"]);
    let mut stalled = HttpConn::connect(kvlb.listen);
    let start = Instant::now();
    stalled
        .send(b"GET /echo HTTP/1.1\r\nHost: kvlb.test\r\nX-Half: ")
        .expect("send half a head");
    // The single worker is not held by the stalled client.
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let ok = kvlb.get("/echo");
    let served_in = t.elapsed();
    assert_eq!(ok.status, 200, "{}", ok.describe());
    assert!(
        served_in < Duration::from_millis(800),
        "another client waited {} ms while one client stalled",
        served_in.as_millis()
    );
    stalled.set_read_timeout(Duration::from_secs(6));
    let resp = stalled.read_response("GET").unwrap_or_else(|e| {
        panic!(
            "no 408 for a stalled head within 6 s (--client-timeout 1s): {e}\nkvlb stderr:\n{}",
            kvlb.stderr()
        )
    });
    let waited = start.elapsed();
    assert_eq!(resp.status, 408, "{}", resp.describe());
    assert!(resp.is_json_error(), "{}", resp.describe());
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "408 after {} ms with --client-timeout 1s",
        waited.as_millis()
    );
    let (_, closed) = stalled.read_for(Duration::from_secs(2));
    assert!(closed, "connection left open after 408");
}

#[test]
fn stalled_request_body_gets_408() {
    let (_backend, kvlb) = proxied(&["--client-timeout", "1s"]);
    let mut stalled = HttpConn::connect(kvlb.listen);
    stalled
        .send(b"POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nContent-Length: 100\r\n\r\nonly part")
        .expect("send");
    stalled.set_read_timeout(Duration::from_secs(6));
    // The head was complete, so the proxy may have contacted the backend already; the client
    // still gets 408 (or the connection closed) within a few seconds, never a hang.
    match stalled.read_response("POST") {
        Ok(resp) => {
            assert_eq!(resp.status, 408, "{}", resp.describe());
            assert!(resp.is_json_error(), "{}", resp.describe());
        }
        Err(e) => panic!(
            "no 408 for a stalled body within 6 s (--client-timeout 1s): {e}\nkvlb stderr:\n{}",
            kvlb.stderr()
        ),
    }
    assert_eq!(kvlb.get("/echo").status, 200);
}

#[test]
fn overflowing_content_length_is_rejected() {
    let raw = post("Content-Length: 99999999999999999999999\r\n", "hello");
    assert_rejected(&raw, &[400, 413], Fault::Head, &[]);
}

#[test]
fn header_name_with_space_inside_is_rejected() {
    let raw = b"GET /echo HTTP/1.1\r\nHost: kvlb.test\r\nX Bad: 1\r\n\r\n";
    assert_rejected(raw, &[400], Fault::Head, &[]);
}

#[test]
fn bare_cr_in_header_value_is_rejected_or_neutralised() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(
        b"GET /echo HTTP/1.1\r\nHost: kvlb.test\r\nX-A: a\rTransfer-Encoding: chunked\r\n\r\n",
    )
    .unwrap();
    let resp = conn.read_response("GET").expect("response");
    match resp.status {
        400 => assert!(resp.is_json_error(), "{}", resp.describe()),
        200 => {
            // RFC 9112 section 2.2: a bare CR may be replaced by SP; it must not split the line.
            let json = resp.header("x-got-headers-json").unwrap_or("");
            assert!(
                !json.to_ascii_lowercase().contains("\"transfer-encoding\""),
                "bare CR split a header line at the backend: {json}"
            );
        }
        _ => panic!("bare CR in a header value: {}", resp.describe()),
    }
}

#[test]
fn content_length_with_leading_zeros_is_accepted() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nContent-Length: 005\r\n\r\nhello")
        .unwrap();
    let resp = conn.read_response("POST").expect("response");
    // 1*DIGIT: "005" is 5.
    assert_eq!(resp.status, 200, "{}", resp.describe());
    assert_eq!(resp.body, b"hello");
}
