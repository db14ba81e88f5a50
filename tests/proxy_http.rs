//! End-to-end HTTP/1.1 behaviour of `kvlb serve` with real clients (raw sockets and curl) and
//! a real backend process: keep-alive on both sides, request and response body framings,
//! streaming (SSE), bodiless responses, `Expect: 100-continue`, hop-by-hop headers,
//! `X-Forwarded-For`, the `x-kvlb-replica` header and the selection policies.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use support::client::Framing;
use support::curl::{self, curl};
use support::digest::{payload, sha256_hex};
use support::{Backend, HttpConn, Kvlb, TempDir};

/// One backend behind a one-worker proxy with `extra` flags.
fn proxied(extra: &[&str]) -> (Backend, Kvlb) {
    let backend = Backend::start();
    let url = backend.url();
    let mut args = vec!["--replica", url.as_str(), "--workers", "1"];
    args.extend_from_slice(extra);
    let kvlb = Kvlb::serve(&args);
    (backend, kvlb)
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

fn header_u64(resp: &support::Response, name: &str) -> u64 {
    resp.header(name)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("missing or bad {name}:\n{}", resp.describe()))
}

#[test]
fn keep_alive_reuses_client_and_upstream_connections() {
    let (backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let mut counts = Vec::new();
    for i in 0..10 {
        let resp = conn
            .request("GET", &format!("/echo?i={i}"), &[], b"")
            .unwrap_or_else(|e| {
                panic!(
                    "request {i} on the kept-alive client connection failed: {e}\nkvlb stderr:\n{}",
                    kvlb.stderr()
                )
            });
        expect_ok(&resp, &kvlb, &format!("request {i}"));
        assert!(
            !resp.says_close(),
            "request {i}: proxy closes the client connection:\n{}",
            resp.describe()
        );
        counts.push(header_u64(&resp, "x-got-connection-count"));
    }
    assert!(
        counts[1..].iter().any(|&c| c > 1) && *counts.last().unwrap() > 1,
        "upstream connection not reused: x-got-connection-count per request = {counts:?}"
    );
    let stats = backend.stats();
    // One connection for the proxied requests (two at most), one for the stats request, one
    // for kvlb asking the backend for its models at start.
    assert!(
        stats.connections_opened <= 4,
        "backend saw {} connections for 10 sequential requests: {stats:?}",
        stats.connections_opened
    );
}

#[test]
fn keep_alive_with_curl_reuses_both_connections() {
    let (_backend, kvlb) = proxied(&[]);
    let url = kvlb.url("/echo");
    let urls = vec![url.as_str(); 6];
    let mut args = vec!["-i", "-w", "num_connects=%{num_connects}\\n"];
    args.extend(urls);
    let out = curl(&args);
    let text = out.stdout_text();
    assert!(out.success, "curl failed: {}\n{text}", out.stderr);
    let connects: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("num_connects="))
        .collect();
    assert_eq!(
        connects,
        vec!["1", "0", "0", "0", "0", "0"],
        "curl had to reconnect: the proxy did not keep the client connection alive\n{text}"
    );
    let counts: Vec<u64> = text
        .lines()
        .filter_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case("x-got-connection-count")
                .then(|| v.trim().parse().ok())?
        })
        .collect();
    assert_eq!(counts.len(), 6, "expected 6 echo responses:\n{text}");
    assert!(
        *counts.last().unwrap() > 1,
        "upstream connection not reused: {counts:?}"
    );
    let statuses = text
        .lines()
        .filter(|l| l.starts_with("HTTP/1.1 200"))
        .count();
    assert_eq!(statuses, 6, "expected six 200 responses:\n{text}");
}

#[test]
fn content_length_request_body_is_forwarded_intact() {
    let (_backend, kvlb) = proxied(&[]);
    let body = payload(300_000, 1);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request(
            "POST",
            "/echo",
            &[("Content-Type", "application/octet-stream")],
            &body,
        )
        .expect("POST /echo");
    expect_ok(&resp, &kvlb, "POST /echo");
    assert_eq!(
        resp.header("x-got-body-sha256"),
        Some(sha256_hex(&body).as_str())
    );
    assert_eq!(header_u64(&resp, "x-got-body-len"), body.len() as u64);
    assert!(resp.body == body, "echoed body differs");
    // A second body on the same connection.
    let small = b"{\"model\":\"m\",\"prompt\":\"hello\"}";
    let resp = conn
        .request(
            "POST",
            "/echo",
            &[("Content-Type", "application/json")],
            small,
        )
        .expect("second POST");
    expect_ok(&resp, &kvlb, "second POST /echo");
    assert_eq!(resp.body, small);
}

fn chunked_encode(body: &[u8], sizes: &[usize], extensions: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    let mut i = 0;
    while !rest.is_empty() {
        let n = sizes[i % sizes.len()].min(rest.len());
        if extensions && i % 2 == 1 {
            out.extend_from_slice(format!("{n:X};name=value\r\n").as_bytes());
        } else {
            out.extend_from_slice(format!("{n:x}\r\n").as_bytes());
        }
        out.extend_from_slice(&rest[..n]);
        out.extend_from_slice(b"\r\n");
        rest = &rest[n..];
        i += 1;
    }
    out
}

#[test]
fn chunked_request_body_is_forwarded_intact() {
    let (_backend, kvlb) = proxied(&[]);
    let body = payload(200_003, 2);
    let mut conn = HttpConn::connect(kvlb.listen);
    let mut req = format!(
        "POST /echo HTTP/1.1\r\nHost: {}\r\nTransfer-Encoding: chunked\r\n\r\n",
        kvlb.listen
    )
    .into_bytes();
    req.extend(chunked_encode(&body, &[1, 7, 4096, 65536, 333], false));
    req.extend_from_slice(b"0\r\n\r\n");
    conn.send(&req).expect("send");
    let resp = conn.read_response("POST").expect("response");
    expect_ok(&resp, &kvlb, "chunked POST /echo");
    assert_eq!(
        resp.header("x-got-body-sha256"),
        Some(sha256_hex(&body).as_str()),
        "backend received a different body ({} bytes)",
        resp.header("x-got-body-len").unwrap_or("?")
    );
    assert!(resp.body == body, "echoed body differs");
    // The connection stays usable after a chunked body.
    let resp = conn
        .request("GET", "/echo", &[], b"")
        .expect("GET after chunked");
    expect_ok(&resp, &kvlb, "GET after chunked body");
}

#[test]
fn chunked_request_with_extensions_and_trailer_is_accepted() {
    let (_backend, kvlb) = proxied(&[]);
    let body = payload(10_000, 3);
    let mut req = format!(
        "POST /echo HTTP/1.1\r\nHost: {}\r\nTransfer-Encoding: chunked\r\n\r\n",
        kvlb.listen
    )
    .into_bytes();
    req.extend(chunked_encode(&body, &[1000, 2500], true));
    req.extend_from_slice(b"0\r\nx-checksum: abc\r\n\r\n");
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(&req).expect("send");
    let resp = conn.read_response("POST").expect("response");
    expect_ok(&resp, &kvlb, "chunked POST with extensions and a trailer");
    assert_eq!(
        resp.header("x-got-body-sha256"),
        Some(sha256_hex(&body).as_str())
    );
    let resp = conn.request("GET", "/echo", &[], b"").expect("GET after");
    expect_ok(&resp, &kvlb, "GET after trailer");
}

const EIGHT_MIB: usize = 8 * 1024 * 1024;

fn curl_upload(kvlb: &Kvlb, chunked: bool) {
    let dir = TempDir::new("upload");
    let body = payload(EIGHT_MIB, 4);
    let input = dir.file("in.bin");
    let output = dir.file("out.bin");
    let heads = dir.file("heads.txt");
    std::fs::write(&input, &body).unwrap();
    let data_arg = format!("@{}", input.display());
    let url = kvlb.url("/echo");
    let mut args = vec![
        "--data-binary",
        data_arg.as_str(),
        "-H",
        "Content-Type: application/octet-stream",
        "-o",
        output.to_str().unwrap(),
        "-D",
        heads.to_str().unwrap(),
    ];
    if chunked {
        args.extend(["-H", "Transfer-Encoding: chunked"]);
    }
    args.push(url.as_str());
    let out = curl(&args);
    let dump = std::fs::read_to_string(&heads).unwrap_or_default();
    assert!(
        out.success,
        "curl upload failed: {}\n{dump}\nkvlb stderr:\n{}",
        out.stderr,
        kvlb.stderr()
    );
    let (status, headers) = curl::last_head(&dump);
    assert_eq!(status, 200, "{dump}");
    let want = sha256_hex(&body);
    assert_eq!(
        curl::header(&headers, "x-got-body-sha256"),
        Some(want.as_str()),
        "backend received a different body: {dump}"
    );
    if chunked {
        // The backend saw a chunked request or a re-framed one: either way the same bytes.
        assert!(curl::header(&headers, "x-got-body-len") == Some("8388608"));
    }
    let echoed = std::fs::read(&output).unwrap();
    assert_eq!(echoed.len(), EIGHT_MIB, "echoed length");
    assert_eq!(sha256_hex(&echoed), want, "echoed body differs");
}

#[test]
fn eight_mib_content_length_upload_and_echo_via_curl() {
    let (_backend, kvlb) = proxied(&[]);
    curl_upload(&kvlb, false);
}

#[test]
fn eight_mib_chunked_upload_and_echo_via_curl() {
    let (_backend, kvlb) = proxied(&[]);
    curl_upload(&kvlb, true);
}

fn curl_download(kvlb: &Kvlb, path: &str, expected_len: usize) {
    let dir = TempDir::new("download");
    let output = dir.file("out.bin");
    let heads = dir.file("heads.txt");
    let url = kvlb.url(path);
    let out = curl(&[
        "-o",
        output.to_str().unwrap(),
        "-D",
        heads.to_str().unwrap(),
        url.as_str(),
    ]);
    let dump = std::fs::read_to_string(&heads).unwrap_or_default();
    assert!(
        out.success,
        "curl download failed: {}\n{dump}\nkvlb stderr:\n{}",
        out.stderr,
        kvlb.stderr()
    );
    let (status, headers) = curl::last_head(&dump);
    assert_eq!(status, 200, "{dump}");
    let data = std::fs::read(&output).unwrap();
    assert_eq!(data.len(), expected_len, "downloaded length");
    assert_eq!(
        Some(sha256_hex(&data).as_str()),
        curl::header(&headers, "x-body-sha256"),
        "downloaded body differs"
    );
}

#[test]
fn eight_mib_content_length_response_via_curl() {
    // Spliced from 1 MiB on: nearly all of it bypasses user space.
    let (_backend, kvlb) = proxied(&["--splice-responses-from", "1MiB"]);
    curl_download(&kvlb, &format!("/bytes?n={EIGHT_MIB}"), EIGHT_MIB);
    let spliced = kvlb
        .metric("kvlb_spliced_response_bytes_total", &[])
        .expect("kvlb_spliced_response_bytes_total");
    assert!(
        spliced >= (EIGHT_MIB - 1024 * 1024) as f64 && spliced <= EIGHT_MIB as f64,
        "spliced {spliced} of {EIGHT_MIB} bytes"
    );
    // Twice on one connection: the replica connection is reused after a spliced body.
    let mut conn = HttpConn::connect(kvlb.listen);
    for _ in 0..2 {
        let resp = conn
            .request("GET", &format!("/bytes?n={}", 3 * 1024 * 1024), &[], b"")
            .expect("a spliced answer on a kept-alive connection");
        expect_ok(&resp, &kvlb, "spliced GET");
        assert_eq!(resp.body.len(), 3 * 1024 * 1024);
        assert_eq!(
            Some(sha256_hex(&resp.body).as_str()),
            resp.header("x-body-sha256")
        );
    }
}

#[test]
fn eight_mib_content_length_response_through_user_space() {
    let (_backend, kvlb) = proxied(&[]);
    curl_download(&kvlb, &format!("/bytes?n={EIGHT_MIB}"), EIGHT_MIB);
    assert_eq!(
        kvlb.metric("kvlb_spliced_response_bytes_total", &[]),
        Some(0.0)
    );
}

#[test]
fn eight_mib_chunked_response_via_curl() {
    let (_backend, kvlb) = proxied(&[]);
    curl_download(&kvlb, "/chunked?n=128&size=65536", EIGHT_MIB);
}

/// A client that reads an 8 MiB answer slowly: kvlb stops taking the replica's bytes while it
/// cannot pass them on (its receive is throttled, and the rest waits in the replica's socket)
/// and every byte still arrives, in order.
#[test]
fn slow_reader_of_a_large_answer_throttles_the_replica_side_and_loses_nothing() {
    use std::io::{Read, Write};
    // Through user space (the default; a spliced body never meets the receive checked here).
    let (_backend, kvlb) = proxied(&["--splice-responses-from", "off"]);
    let mut s = std::net::TcpStream::connect(kvlb.listen).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    write!(
        s,
        "GET /bytes?n={EIGHT_MIB} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = s.read(&mut chunk).unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&chunk[..n]);
        // About 1 s for the whole answer: far slower than loopback.
        std::thread::sleep(std::time::Duration::from_millis(8));
    }
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head")
        + 4;
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let sha = head
        .lines()
        .find_map(|l| l.strip_prefix("x-body-sha256: "))
        .expect("x-body-sha256")
        .trim()
        .to_string();
    let body = &raw[end..];
    assert_eq!(body.len(), EIGHT_MIB);
    assert_eq!(sha256_hex(body), sha, "the body arrived altered");
    let throttled = kvlb
        .metric("kvlb_worker_recv_throttled_total", &[])
        .expect("kvlb_worker_recv_throttled_total");
    assert!(
        throttled > 0.0,
        "the replica-side receive was never throttled"
    );
}

#[test]
fn sse_events_are_streamed_as_they_are_produced() {
    let (_backend, kvlb) = proxied(&[]);
    // Five events 400 ms apart: the backend needs 1.6 s for the whole stream.
    let (events, ok) = curl::sse_events(&kvlb.url("/sse?n=5&interval_ms=400"), 20);
    let shown = curl::show_events(&events);
    assert!(ok, "curl failed; events:\n{shown}");
    assert_eq!(events.len(), 6, "expected 5 events and [DONE]:\n{shown}");
    assert_eq!(events[5].1, "data: [DONE]");
    let first = events[0].0;
    let third = events[2].0;
    let last = events[5].0;
    // Buffering the stream would deliver every event at once, after 1.6 s.
    assert!(
        first < Duration::from_millis(1500),
        "first event arrived {} ms after the request:\n{shown}",
        first.as_millis()
    );
    assert!(
        third >= first + Duration::from_millis(400),
        "events were not delivered as produced (third event only {} ms after the first):\n{shown}",
        (third - first).as_millis()
    );
    assert!(
        last >= first + Duration::from_millis(1000),
        "stream delivered in a burst:\n{shown}"
    );
}

#[test]
fn content_length_response_arrives_complete() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    for n in [0usize, 1, 65_536, 1_000_003] {
        let resp = conn
            .request("GET", &format!("/bytes?n={n}"), &[], b"")
            .unwrap_or_else(|e| panic!("GET /bytes?n={n}: {e}"));
        expect_ok(&resp, &kvlb, "GET /bytes");
        assert_eq!(resp.body.len(), n);
        assert_eq!(
            resp.header("x-body-sha256"),
            Some(sha256_hex(&resp.body).as_str())
        );
    }
}

#[test]
fn chunked_response_arrives_complete() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("GET", "/chunked?n=50&size=1001", &[], b"")
        .expect("GET /chunked");
    expect_ok(&resp, &kvlb, "GET /chunked");
    assert_eq!(resp.body.len(), 50 * 1001);
    assert_eq!(
        resp.header("x-body-sha256"),
        Some(sha256_hex(&resp.body).as_str())
    );
    // Still usable after the terminating chunk.
    let resp = conn
        .request("GET", "/echo", &[], b"")
        .expect("GET after chunked");
    expect_ok(&resp, &kvlb, "GET after a chunked response");
}

#[test]
fn close_delimited_response_arrives_complete() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("GET", "/close?size=500000", &[], b"")
        .expect("GET /close");
    expect_ok(&resp, &kvlb, "GET /close");
    assert_eq!(
        resp.body.len(),
        500_000,
        "framing {:?}: body truncated or padded",
        resp.framing
    );
    assert_eq!(
        resp.header("x-body-sha256"),
        Some(sha256_hex(&resp.body).as_str())
    );
    // The proxy either re-frames the body (and may keep the connection) or closes after it.
    if resp.framing != Framing::Close && !resp.says_close() {
        let resp = conn.request("GET", "/echo", &[], b"").expect("GET after");
        expect_ok(
            &resp,
            &kvlb,
            "GET after a re-framed close-delimited response",
        );
    }
    // A fresh connection is served either way.
    expect_ok(&kvlb.get("/echo"), &kvlb, "GET on a new connection");
}

/// Sends `method path` on one connection, expects no body, then a normal request.
fn bodiless_then_reuse(method: &str, path: &str, status: u16) {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request(method, path, &[], b"")
        .unwrap_or_else(|e| panic!("{method} {path}: {e}\nkvlb stderr:\n{}", kvlb.stderr()));
    assert_eq!(resp.status, status, "{}", resp.describe());
    assert_eq!(resp.framing, Framing::NoBody);
    // Any stray body bytes would be read as the next status line.
    let (stray, _) = conn.read_for(Duration::from_millis(300));
    assert!(
        stray.is_empty(),
        "bytes after a bodiless {status} response: {}",
        support::show_bytes(&stray)
    );
    let resp = conn
        .request("GET", "/echo", &[], b"")
        .unwrap_or_else(|e| panic!("GET after {method} {path} on the same connection: {e}"));
    expect_ok(&resp, &kvlb, "GET after a bodiless response");
}

#[test]
fn head_response_has_no_body_and_connection_stays_usable() {
    bodiless_then_reuse("HEAD", "/echo", 200);
}

#[test]
fn status_204_has_no_body_and_connection_stays_usable() {
    bodiless_then_reuse("GET", "/status?code=204", 204);
}

#[test]
fn status_304_has_no_body_and_connection_stays_usable() {
    bodiless_then_reuse("GET", "/status?code=304", 304);
}

#[test]
fn expect_100_continue_gets_interim_response_and_body_is_delivered() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let body = b"the body sent after 100 Continue";
    let head = format!(
        "POST /echo HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        kvlb.listen,
        body.len()
    );
    conn.send(head.as_bytes()).expect("send head");
    conn.set_read_timeout(Duration::from_secs(3));
    let (version, status, reason, _) = conn.read_head().unwrap_or_else(|e| {
        panic!(
            "no 100 Continue (nor a final response) within 3 s of a head with \
             `Expect: 100-continue` and no body: {e}\nkvlb stderr:\n{}",
            kvlb.stderr()
        )
    });
    assert_eq!(
        status, 100,
        "expected 100 Continue before the body, got {version} {status} {reason}"
    );
    conn.set_read_timeout(Duration::from_secs(10));
    conn.send(body).expect("send body");
    let resp = conn.read_response("POST").expect("final response");
    expect_ok(&resp, &kvlb, "POST after 100 Continue");
    assert_eq!(resp.body, body);
}

#[test]
fn hop_by_hop_headers_are_not_forwarded() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request(
            "GET",
            "/echo",
            &[
                ("Connection", "keep-alive, X-Private-Hop"),
                ("Keep-Alive", "timeout=5, max=100"),
                ("Proxy-Connection", "keep-alive"),
                ("TE", "trailers, deflate"),
                ("Upgrade", "example-protocol/1"),
                ("Trailer", "x-checksum"),
                ("X-Private-Hop", "secret"),
                ("X-End-To-End", "kept"),
            ],
            b"",
        )
        .expect("GET /echo");
    expect_ok(&resp, &kvlb, "GET /echo with hop-by-hop headers");
    let json = resp
        .header("x-got-headers-json")
        .expect("x-got-headers-json");
    let got: Vec<(String, String)> = serde_json::from_str::<Vec<(String, String)>>(json)
        .expect("headers json")
        .into_iter()
        .map(|(n, v)| (n.to_ascii_lowercase(), v))
        .collect();
    let has = |name: &str| got.iter().any(|(n, _)| n == name);
    for name in [
        "keep-alive",
        "proxy-connection",
        "upgrade",
        "trailer",
        "x-private-hop",
    ] {
        assert!(
            !has(name),
            "hop-by-hop header {name} reached the backend: {got:?}"
        );
    }
    // The proxy may send its own Connection / TE, but not the client's.
    for (n, v) in &got {
        if n == "connection" {
            assert!(
                !v.to_ascii_lowercase().contains("x-private-hop"),
                "client's Connection header forwarded: {got:?}"
            );
        }
        if n == "te" {
            assert!(
                !v.to_ascii_lowercase().contains("deflate"),
                "client's TE header forwarded: {got:?}"
            );
        }
    }
    assert!(has("x-end-to-end"), "end-to-end header dropped: {got:?}");
    assert!(has("host"), "Host dropped: {got:?}");
}

fn forwarded_for(resp: &support::Response) -> Vec<String> {
    resp.header("x-got-x-forwarded-for")
        .unwrap_or("<none>")
        .split(',')
        .map(|s| s.trim().to_string())
        .collect()
}

#[test]
fn x_forwarded_for_is_added() {
    let (_backend, kvlb) = proxied(&[]);
    let resp = kvlb.get("/echo");
    expect_ok(&resp, &kvlb, "GET /echo");
    assert_eq!(
        forwarded_for(&resp),
        vec!["127.0.0.1"],
        "{}",
        resp.describe()
    );
}

#[test]
fn x_forwarded_for_is_appended_to_an_existing_one() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request(
            "GET",
            "/echo",
            &[("X-Forwarded-For", "203.0.113.7, 198.51.100.2")],
            b"",
        )
        .expect("GET /echo");
    expect_ok(&resp, &kvlb, "GET /echo");
    assert_eq!(
        forwarded_for(&resp),
        vec!["203.0.113.7", "198.51.100.2", "127.0.0.1"],
        "{}",
        resp.describe()
    );
}

#[test]
fn replica_header_names_the_configured_replica() {
    let (backend, kvlb) = proxied(&[]);
    let resp = kvlb.get("/echo");
    expect_ok(&resp, &kvlb, "GET /echo");
    assert_eq!(
        resp.header("x-kvlb-replica"),
        Some(backend.url().as_str()),
        "{}",
        resp.describe()
    );
    // On error-free bodiless and streamed responses too.
    let resp = kvlb.get("/status?code=204");
    assert_eq!(resp.header("x-kvlb-replica"), Some(backend.url().as_str()));
    let resp = kvlb.get("/chunked?n=2&size=10");
    assert_eq!(resp.header("x-kvlb-replica"), Some(backend.url().as_str()));
}

/// Two backends behind a one-worker proxy with `--policy policy`.
fn two_replicas(policy: &str) -> (Backend, Backend, Kvlb) {
    let a = Backend::start();
    let b = Backend::start();
    let (ua, ub) = (a.url(), b.url());
    let kvlb = Kvlb::serve(&[
        "--replica",
        ua.as_str(),
        "--replica",
        ub.as_str(),
        "--policy",
        policy,
        "--workers",
        "1",
    ]);
    (a, b, kvlb)
}

fn replica_of(resp: &support::Response, kvlb: &Kvlb) -> String {
    expect_ok(resp, kvlb, "GET /echo");
    resp.header("x-kvlb-replica")
        .unwrap_or_else(|| panic!("no x-kvlb-replica:\n{}", resp.describe()))
        .to_string()
}

#[test]
fn round_robin_alternates_between_two_replicas() {
    let (a, b, kvlb) = two_replicas("round_robin");
    let picks: Vec<String> = (0..6)
        .map(|_| replica_of(&kvlb.get("/echo"), &kvlb))
        .collect();
    for p in &picks {
        assert!(*p == a.url() || *p == b.url(), "unknown replica {p}");
    }
    for w in picks.windows(2) {
        assert_ne!(w[0], w[1], "round_robin did not alternate: {picks:?}");
    }
}

#[test]
fn round_robin_routes_each_request_on_a_kept_alive_connection() {
    let (_a, _b, kvlb) = two_replicas("round_robin");
    let mut conn = HttpConn::connect(kvlb.listen);
    let picks: Vec<String> = (0..4)
        .map(|_| replica_of(&conn.request("GET", "/echo", &[], b"").expect("GET"), &kvlb))
        .collect();
    for w in picks.windows(2) {
        assert_ne!(
            w[0], w[1],
            "requests on one client connection stick to one replica: {picks:?}"
        );
    }
}

/// With one replica busy on a slow request, the next quick requests go to the other one.
fn load_aware_policy_avoids_busy_replica(policy: &str) {
    let (a, b, kvlb) = two_replicas(policy);
    // Plain sequential requests work and name a configured replica.
    for _ in 0..4 {
        let p = replica_of(&kvlb.get("/echo"), &kvlb);
        assert!(p == a.url() || p == b.url(), "unknown replica {p}");
    }
    let listen = kvlb.listen;
    let slow = std::thread::spawn(move || support::client::get(listen, "/slow?ms=2500"));
    // Let the slow request reach its replica.
    std::thread::sleep(Duration::from_millis(400));
    let quick: Vec<String> = (0..5)
        .map(|_| replica_of(&kvlb.get("/echo"), &kvlb))
        .collect();
    let slow = slow.join().expect("slow request thread");
    let busy = replica_of(&slow, &kvlb);
    assert!(
        quick.iter().all(|p| *p != busy),
        "{policy}: quick requests went to {busy}, busy with a slow request: {quick:?}"
    );
}

#[test]
fn least_loaded_avoids_the_busy_replica() {
    load_aware_policy_avoids_busy_replica("least_loaded");
}

#[test]
fn power_of_two_avoids_the_busy_replica() {
    load_aware_policy_avoids_busy_replica("power_of_two");
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let mut raw = Vec::new();
    for i in 0..3 {
        raw.extend_from_slice(
            format!(
                "POST /echo?i={i} HTTP/1.1\r\nHost: kvlb.test\r\nContent-Length: 5\r\n\r\nbody{i}"
            )
            .as_bytes(),
        );
    }
    conn.send(&raw).expect("send three pipelined requests");
    for i in 0..3 {
        let resp = conn.read_response("POST").unwrap_or_else(|e| {
            panic!(
                "pipelined response {i}: {e}\nkvlb stderr:\n{}",
                kvlb.stderr()
            )
        });
        expect_ok(&resp, &kvlb, "pipelined POST");
        assert_eq!(
            resp.body,
            format!("body{i}").as_bytes(),
            "{}",
            resp.describe()
        );
        assert_eq!(
            resp.header("x-got-path"),
            Some(format!("/echo?i={i}").as_str())
        );
    }
}

/// More pipelined bytes than kvlb keeps ahead of the request it serves (64 KiB): it stops
/// reading, the rest waits in the socket, and every request is still answered, in order.
#[test]
fn a_long_pipeline_is_answered_in_order() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let n = 80;
    let body_of = |i: usize| format!("{i:04}").repeat(500);
    let mut raw = Vec::new();
    for i in 0..n {
        let body = body_of(i);
        raw.extend_from_slice(
            format!(
                "POST /echo?i={i} HTTP/1.1\r\nHost: kvlb.test\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        );
    }
    assert!(raw.len() > 128 * 1024);
    let writer = {
        let mut w = conn.stream().try_clone().expect("clone the stream");
        std::thread::spawn(move || {
            use std::io::Write;
            w.write_all(&raw).expect("send the pipeline");
        })
    };
    for i in 0..n {
        let resp = conn.read_response("POST").unwrap_or_else(|e| {
            panic!(
                "pipelined response {i}: {e}\nkvlb stderr:\n{}",
                kvlb.stderr()
            )
        });
        expect_ok(&resp, &kvlb, "pipelined POST");
        assert_eq!(resp.body, body_of(i).as_bytes(), "response {i}");
    }
    writer.join().unwrap();
}

#[test]
fn x_forwarded_for_over_several_lines_keeps_order() {
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request(
            "GET",
            "/echo",
            &[
                ("X-Forwarded-For", "203.0.113.7"),
                ("X-Forwarded-For", "198.51.100.2"),
            ],
            b"",
        )
        .expect("GET /echo");
    expect_ok(&resp, &kvlb, "GET /echo");
    assert_eq!(
        forwarded_for(&resp),
        vec!["203.0.113.7", "198.51.100.2", "127.0.0.1"],
        "{}",
        resp.describe()
    );
}

#[test]
fn absolute_form_request_target_is_accepted() {
    // RFC 9112 section 3.2.2: a server must accept the absolute form.
    let (_backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET http://kvlb.test/echo?abs=1 HTTP/1.1\r\nHost: kvlb.test\r\n\r\n")
        .unwrap();
    let resp = conn.read_response("GET").expect("response");
    expect_ok(&resp, &kvlb, "absolute-form GET");
    let path = resp.header("x-got-path").unwrap_or("");
    assert!(path.ends_with("/echo?abs=1"), "backend saw target {path:?}");
}
