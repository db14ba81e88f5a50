//! The access log (`--access-log PATH`): one JSON line per request, written by the workers
//! within a second, reopened on reload (log rotation), and a file that cannot be opened
//! refused at start with the key named.

#[path = "support/mod.rs"]
mod support;

use serde_json::Value;
use std::path::Path;
use std::time::Duration;
use support::proxy::run_kvlb;
use support::{wait_until, Backend, HttpConn, Kvlb, Response, TempDir};

/// kvlb with one worker in front of `replica`, logging to `log`, with `extra` flags.
fn logged_kvlb(replica: &str, log: &Path, extra: &[&str]) -> Kvlb {
    let mut args = vec![
        "--replica",
        replica,
        "--workers",
        "1",
        "--access-log",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Kvlb::serve(&args)
}

fn post_chat(c: &mut HttpConn, path: &str) -> Response {
    c.request("POST", path, &[("Content-Type", "application/json")], CHAT)
        .unwrap()
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// Waits (up to 5 s: lines are written at least once a second) for `n` lines.
fn wait_lines(path: &Path, n: usize) -> Vec<Value> {
    assert!(
        wait_until(Duration::from_secs(5), || lines(path).len() >= n),
        "{} holds {} lines, expected {n}",
        path.display(),
        lines(path).len()
    );
    lines(path)
}

const CHAT: &[u8] =
    br#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":4}"#;

#[test]
fn every_request_gets_one_json_line_with_where_it_went_and_how_long_it_took() {
    let dir = TempDir::new("access-lines");
    let log = dir.file("access.log");
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = logged_kvlb(&url, &log, &[]);

    let mut c = HttpConn::connect(kvlb.listen);
    let r = post_chat(&mut c, "/v1/chat/completions?trace=\"1\"");
    // The test backend has no chat route: its 404 is what the line must say.
    assert_eq!(r.status, 404, "{}", r.describe());
    let r = c.request("GET", "/echo?x=1", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    // A request kvlb answers itself: Content-Length twice, 400, the connection closed.
    let mut bad = HttpConn::connect(kvlb.listen);
    bad.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab")
        .unwrap();
    let r = bad.read_response("POST").unwrap();
    assert_eq!(r.status, 400, "{}", r.describe());

    let got = wait_lines(&log, 3);
    assert_eq!(got.len(), 3, "{got:?}");
    let chat = &got[0];
    assert_eq!(chat["method"], "POST");
    assert_eq!(chat["path"], "/v1/chat/completions?trace=\"1\"");
    assert_eq!(chat["status"], 404);
    assert_eq!(chat["client"], "127.0.0.1");
    assert_eq!(chat["replica"], url.as_str());
    assert_eq!(chat["attempts"], 1);
    assert_eq!(chat["bytes_in"], CHAT.len());
    assert!(chat["prompt_tokens"].as_u64().unwrap() > 0, "{chat}");
    assert!(chat["reason"].is_string(), "{chat}");
    let (ttfb, total) = (
        chat["ttfb_ms"].as_f64().unwrap(),
        chat["total_ms"].as_f64().unwrap(),
    );
    assert!(ttfb >= 0.0 && total >= ttfb && total < 10_000.0, "{chat}");
    assert!(chat["time"].as_str().unwrap().ends_with('Z'), "{chat}");

    let echo = &got[1];
    assert_eq!(echo["method"], "GET");
    assert_eq!(echo["path"], "/echo?x=1");
    assert_eq!(echo["status"], 200);
    assert_eq!(echo["bytes_in"], 0);
    assert_eq!(echo["prompt_tokens"], 0);

    let local = &got[2];
    assert_eq!(local["status"], 400);
    assert!(
        local["replica"].is_null() && local["ttfb_ms"].is_null(),
        "{local}"
    );
    assert_eq!(local["attempts"], 0);

    assert_eq!(kvlb.metric("kvlb_access_log_lines_total", &[]), Some(3.0));
    assert_eq!(
        kvlb.metric("kvlb_access_log_dropped_lines_total", &[]),
        Some(0.0)
    );
}

#[test]
fn no_replica_left_and_retries_are_logged_too() {
    let dir = TempDir::new("access-failures");
    let log = dir.file("access.log");
    // A replica nobody listens on: connect fails (502 once retries are used up).
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let kvlb = logged_kvlb(&dead_url, &log, &["--retries", "0"]);
    let mut c = HttpConn::connect(kvlb.listen);
    let r = post_chat(&mut c, "/v1/chat/completions");
    assert_eq!(r.status, 502, "{}", r.describe());
    let got = wait_lines(&log, 1);
    assert_eq!(got[0]["status"], 502, "{:?}", got[0]);
    assert_eq!(got[0]["replica"], dead_url.as_str());
    assert_eq!(got[0]["attempts"], 1);
    assert!(got[0]["ttfb_ms"].is_null());
}

#[test]
fn refused_requests_are_logged_even_when_pipelined() {
    let dir = TempDir::new("access-refused");
    let log = dir.file("access.log");
    let keys = dir.file("keys");
    std::fs::write(&keys, "sk-good-0001\n").unwrap();
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = logged_kvlb(&url, &log, &["--api-keys-file", keys.to_str().unwrap()]);
    // Two requests in one write: the first refused (401), the second served.
    let mut c = HttpConn::connect(kvlb.listen);
    c.send(
        b"GET /echo?first HTTP/1.1\r\nHost: x\r\n\r\n\
          GET /echo?second HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-good-0001\r\n\r\n",
    )
    .unwrap();
    assert_eq!(c.read_response("GET").unwrap().status, 401);
    assert_eq!(c.read_response("GET").unwrap().status, 200);
    let got = wait_lines(&log, 2);
    assert_eq!(got[0]["path"], "/echo?first", "{got:?}");
    assert_eq!(got[0]["status"], 401);
    assert!(got[0]["replica"].is_null());
    assert_eq!(got[1]["path"], "/echo?second", "{got:?}");
    assert_eq!(got[1]["status"], 200);
    assert_eq!(got[1]["replica"], url.as_str());
}

#[test]
fn reload_reopens_the_file_for_log_rotation() {
    let dir = TempDir::new("access-rotate");
    let log = dir.file("access.log");
    let rotated = dir.file("access.log.1");
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&[
        "--replica",
        &url,
        "--workers",
        "2",
        "--access-log",
        log.to_str().unwrap(),
    ]);
    let mut c = HttpConn::connect(kvlb.listen);
    assert_eq!(
        c.request("GET", "/echo?before", &[], b"").unwrap().status,
        200
    );
    wait_lines(&log, 1);
    std::fs::rename(&log, &rotated).unwrap();
    // Safety: signalling the child we started.
    assert_eq!(
        unsafe { libc::kill(kvlb.pid() as libc::pid_t, libc::SIGHUP) },
        0
    );
    // The reload reaches a worker with its next request; requests until the new file exists.
    let mut n = 0;
    assert!(
        wait_until(Duration::from_secs(5), || {
            n += 1;
            let mut c = HttpConn::connect(kvlb.listen);
            let _ = c.request("GET", &format!("/echo?after={n}"), &[], b"");
            lines(&log).iter().any(|l| {
                l["path"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("/echo?after="))
            })
        }),
        "no line in the reopened file; stderr:\n{}",
        kvlb.stderr()
    );
    let old = lines(&rotated);
    assert_eq!(old[0]["path"], "/echo?before", "{old:?}");
    assert!(
        lines(&log).iter().all(|l| l["path"] != "/echo?before"),
        "the old line went to the new file"
    );
}

#[test]
fn a_log_file_that_cannot_be_opened_is_refused_at_start() {
    let out = run_kvlb(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--replica",
            "http://127.0.0.1:9",
            "--access-log",
            "/nonexistent-dir/kvlb/access.log",
        ],
        Duration::from_secs(10),
    );
    assert_eq!(out.status.and_then(|s| s.code()), Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("access_log") && out.stderr.contains("/nonexistent-dir"),
        "{}",
        out.stderr
    );
}
