//! Responses a replica cuts short: closed mid-body, closed mid-chunk, reset, an invalid chunk
//! after bytes reached the client, the replica killed mid-stream. Each is counted in
//! `kvlb_cut_responses_total{replica,cause}`, logged (stderr, rate-limited) and marked `cut` in
//! the access log; the client sees its connection closed before the response's end. A body
//! that is unusable before any byte reached the client gets kvlb's 502 instead.

#[path = "support/mod.rs"]
mod support;

use serde_json::Value;
use std::io::ErrorKind;
use std::path::Path;
use std::time::Duration;
use support::{wait_until, Backend, HttpConn, Kvlb, TempDir};

fn logged(backend: &Backend, log: &Path) -> Kvlb {
    let url = backend.url();
    Kvlb::serve(&[
        "--replica",
        url.as_str(),
        "--workers",
        "1",
        "--retries",
        "0",
        "--access-log",
        log.to_str().unwrap(),
    ])
}

fn last_line(log: &Path, n: usize) -> Value {
    let read = || -> Vec<Value> {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert!(
        wait_until(Duration::from_secs(5), || read().len() >= n),
        "access log holds {:?}",
        read()
    );
    read().pop().unwrap()
}

/// Sends `path`, expects the connection to end before a complete response, and checks the
/// metric, the access log and the log line name `cause`; then, when the replica lives on, that
/// a whole response is not marked.
fn cut_case(path: &str, cause: &str) {
    let dir = TempDir::new("cut");
    let log = dir.file("access.log");
    let backend = Backend::start();
    let kvlb = logged(&backend, &log);
    let url = backend.url();
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send_request("GET", path, &[], b"").unwrap();
    match conn.read_response("GET") {
        Err(e) => assert!(
            matches!(
                e.kind(),
                ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
            ),
            "{path}: expected a response cut short, got {e}"
        ),
        Ok(r) => panic!("{path}: got a whole response:\n{}", r.describe()),
    }
    let counted = || {
        kvlb.metric(
            "kvlb_cut_responses_total",
            &[&format!("replica=\"{url}\""), &format!("cause=\"{cause}\"")],
        )
    };
    assert!(
        wait_until(Duration::from_secs(3), || counted() == Some(1.0)),
        "{path}: kvlb_cut_responses_total{{cause={cause}}} = {:?}\n{}",
        counted(),
        kvlb.admin_get("/metrics").body_text()
    );
    let all: f64 = ["closed", "reset", "malformed"]
        .iter()
        .map(|c| {
            kvlb.metric("kvlb_cut_responses_total", &[&format!("cause=\"{c}\"")])
                .unwrap_or(0.0)
        })
        .sum();
    assert_eq!(all, 1.0, "{path}: one cut, counted once");
    let line = last_line(&log, 1);
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["cut"], cause, "{path}: access log line {line}");
    assert!(
        wait_until(Duration::from_secs(2), || kvlb
            .stderr()
            .contains("cut short")),
        "{path}: no log line; stderr:\n{}",
        kvlb.stderr()
    );
    if path.starts_with("/die") {
        return;
    }
    let ok = kvlb.get("/echo");
    assert_eq!(ok.status, 200);
    let line = last_line(&log, 2);
    assert_eq!(line["cut"], Value::Null, "{line}");
}

#[test]
fn a_replica_closing_mid_body_is_counted_and_logged_as_cut() {
    cut_case("/raw?kind=short_cl", "closed");
}

#[test]
fn a_replica_closing_mid_chunk_is_counted_and_logged_as_cut() {
    cut_case("/raw?kind=cut_chunk", "closed");
}

#[test]
fn a_replica_resetting_mid_body_is_counted_and_logged_as_cut() {
    cut_case("/raw?kind=reset_mid", "reset");
}

#[test]
fn an_invalid_chunk_after_bytes_reached_the_client_is_counted_as_malformed() {
    cut_case("/raw?kind=late_bad_chunk", "malformed");
}

#[test]
fn a_replica_killed_mid_stream_is_counted_and_logged_as_cut() {
    cut_case("/die?after=headers", "closed");
}

#[test]
fn an_invalid_chunk_before_any_byte_reached_the_client_gets_502() {
    let dir = TempDir::new("cut-502");
    let log = dir.file("access.log");
    let backend = Backend::start();
    let kvlb = logged(&backend, &log);
    let url = backend.url();
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send_request("GET", "/raw?kind=bad_chunk", &[], b"")
        .unwrap();
    let resp = conn
        .read_response("GET")
        .expect("a whole response, not a cut connection");
    assert_eq!(resp.status, 502, "{}", resp.describe());
    assert!(resp.is_json_error(), "{}", resp.describe());
    assert_eq!(resp.header("x-kvlb-replica"), Some(url.as_str()));
    assert_eq!(
        kvlb.metric(
            "kvlb_requests_total",
            &[&format!("replica=\"{url}\""), "status=\"502\""]
        ),
        Some(1.0)
    );
    assert_eq!(
        kvlb.metric(
            "kvlb_requests_total",
            &[&format!("replica=\"{url}\""), "status=\"2xx\""]
        ),
        Some(0.0),
        "the replica's 200 head never reached the client"
    );
    let line = last_line(&log, 1);
    assert_eq!(line["status"], 502, "{line}");
}
