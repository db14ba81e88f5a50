//! Checks the test instruments themselves, without the proxy: the Python backend and the raw
//! client and curl helpers talk to each other directly. When a proxy test fails, these passing
//! shows the fault is in the proxy, not in the harness.

#[path = "support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use support::backend::Backend;
use support::client::{self, Framing, HttpConn};
use support::curl::{self, curl};
use support::digest::{payload, sha256_hex};
use support::wait_until;

#[test]
fn backend_echo_keep_alive_and_connection_count() {
    let backend = Backend::start();
    let mut conn = HttpConn::connect(backend.addr);
    for i in 1..=3u64 {
        let body = payload(1000 * i as usize, i);
        let resp = conn.request("POST", "/echo", &[], &body).expect("echo");
        assert_eq!(resp.status, 200);
        assert_eq!(resp.body, body);
        assert_eq!(
            resp.header("x-got-body-sha256"),
            Some(sha256_hex(&body).as_str())
        );
        assert_eq!(
            resp.header("x-got-connection-count"),
            Some(i.to_string().as_str())
        );
        assert_eq!(resp.header("x-got-x-forwarded-for"), Some("<none>"));
    }
}

#[test]
fn backend_decodes_chunked_requests() {
    let backend = Backend::start();
    let mut conn = HttpConn::connect(backend.addr);
    conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3;a=b\r\nabc\r\n2\r\nde\r\n0\r\nx-t: 1\r\n\r\n")
        .unwrap();
    let resp = conn.read_response("POST").unwrap();
    assert_eq!(resp.body, b"abcde");
    assert_eq!(resp.header("x-got-transfer-encoding"), Some("chunked"));
}

#[test]
fn client_reads_every_framing() {
    let backend = Backend::start();
    let mut conn = HttpConn::connect(backend.addr);
    let resp = conn.request("GET", "/bytes?n=70000", &[], b"").unwrap();
    assert_eq!(resp.framing, Framing::ContentLength(70000));
    assert_eq!(
        resp.header("x-body-sha256"),
        Some(sha256_hex(&resp.body).as_str())
    );
    let resp = conn
        .request("GET", "/chunked?n=7&size=333", &[], b"")
        .unwrap();
    assert_eq!(resp.framing, Framing::Chunked);
    assert_eq!(resp.body.len(), 7 * 333);
    assert_eq!(
        resp.header("x-body-sha256"),
        Some(sha256_hex(&resp.body).as_str())
    );
    let resp = conn.request("HEAD", "/echo", &[], b"").unwrap();
    assert_eq!(resp.framing, Framing::NoBody);
    assert_eq!(resp.header("content-length"), Some("11"));
    let resp = conn.request("GET", "/status?code=204", &[], b"").unwrap();
    assert_eq!((resp.status, resp.framing.clone()), (204, Framing::NoBody));
    let resp = conn.request("GET", "/status?code=304", &[], b"").unwrap();
    assert_eq!((resp.status, resp.framing.clone()), (304, Framing::NoBody));
    let resp = conn.request("GET", "/close?size=123456", &[], b"").unwrap();
    assert_eq!(resp.framing, Framing::Close);
    assert_eq!(
        resp.header("x-body-sha256"),
        Some(sha256_hex(&resp.body).as_str())
    );
    assert!(conn.eof);
}

#[test]
fn backend_sends_100_continue() {
    let backend = Backend::start();
    let mut conn = HttpConn::connect(backend.addr);
    conn.send(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n",
    )
    .unwrap();
    let (_, status, _, _) = conn.read_head().unwrap();
    assert_eq!(status, 100);
    conn.send(b"abc").unwrap();
    let resp = conn.read_response("POST").unwrap();
    assert_eq!(resp.body, b"abc");
}

#[test]
fn backend_counts_aborted_slow_requests_and_closed_connections() {
    let backend = Backend::start();
    let mut conn = HttpConn::connect(backend.addr);
    conn.send(b"GET /slow?ms=3000 HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(conn);
    let start = Instant::now();
    assert!(wait_until(Duration::from_secs(2), || backend
        .stats()
        .aborted
        == 1));
    assert!(start.elapsed() < Duration::from_secs(2));
    let stats = backend.stats();
    assert!(stats.connections_closed >= 1, "{stats:?}");
}

#[test]
fn backend_die_variants() {
    let mut backend = Backend::start();
    let (_, resp) = client::exchange(backend.addr, b"GET /die HTTP/1.1\r\nHost: x\r\n\r\n", "GET");
    let err = resp.expect_err("a truncated body is an error");
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
    assert!(wait_until(Duration::from_secs(3), || !backend.is_running()));

    let mut backend = Backend::start();
    let (_, resp) = client::exchange(
        backend.addr,
        b"GET /die?after=nothing HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET",
    );
    assert!(resp.is_err());
    assert!(wait_until(Duration::from_secs(3), || !backend.is_running()));
}

#[test]
fn backend_hang_times_out_on_the_client() {
    let backend = Backend::start();
    let mut conn = HttpConn::connect(backend.addr);
    conn.send(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let (bytes, closed) = conn.read_for(Duration::from_millis(500));
    assert!(bytes.is_empty() && !closed);
    drop(conn);
    assert!(wait_until(Duration::from_secs(2), || backend
        .stats()
        .aborted
        == 1));
}

#[test]
fn curl_sees_backend_keep_alive() {
    let backend = Backend::start();
    let url = format!("{}/echo", backend.url());
    let out = curl(&["-i", "-w", "n=%{num_connects}\\n", &url, &url]);
    assert!(out.success, "{}", out.stderr);
    let text = out.stdout_text();
    assert!(text.contains("n=1\n") && text.contains("n=0\n"), "{text}");
    let dump = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-A: b\r\n\r\n";
    let (status, headers) = curl::last_head(dump);
    assert_eq!(status, 200);
    assert_eq!(curl::header(&headers, "x-a"), Some("b"));
}

#[test]
fn metric_sum_reads_prometheus_text() {
    let text = "# HELP kvlb_requests_total x\n\
                kvlb_requests_total{replica=\"http://a\",status=\"200\"} 3\n\
                kvlb_requests_total{replica=\"http://b\",status=\"200\"} 2\n\
                kvlb_requests_total_other 9\n\
                kvlb_in_flight 0\n";
    use support::proxy::metric_sum;
    assert_eq!(metric_sum(text, "kvlb_requests_total", &[]), Some(5.0));
    assert_eq!(
        metric_sum(text, "kvlb_requests_total", &["http://b"]),
        Some(2.0)
    );
    assert_eq!(metric_sum(text, "kvlb_in_flight", &[]), Some(0.0));
    assert_eq!(metric_sum(text, "kvlb_missing", &[]), None);
}

#[test]
fn curl_streams_backend_sse() {
    let backend = Backend::start();
    let (events, ok) = curl::sse_events(&format!("{}/sse?n=3&interval_ms=300", backend.url()), 10);
    let shown = curl::show_events(&events);
    assert!(ok, "{shown}");
    assert_eq!(events.len(), 4, "{shown}");
    assert!(
        events[2].0 >= events[0].0 + Duration::from_millis(500),
        "{shown}"
    );
}

#[test]
fn smuggling_check_detects_a_lenient_server() {
    // The Python backend itself prefers Transfer-Encoding and then serves the smuggled
    // request: the harness must see that second response, as it would behind a lax proxy.
    let backend = Backend::start();
    let mut conn = HttpConn::connect(backend.addr);
    let smuggled = "GET /echo?smuggled=1 HTTP/1.1\r\nHost: x\r\n\r\n";
    let body = format!("0\r\n\r\n{smuggled}");
    let raw = format!(
        "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n{body}",
        body.len()
    );
    conn.send(raw.as_bytes()).unwrap();
    let first = conn.read_response("POST").unwrap();
    assert_eq!(first.status, 200);
    let (more, _) = conn.read_for(Duration::from_millis(700));
    assert!(String::from_utf8_lossy(&more).contains("smuggled=1"));
}
