//! Host and request-target validation against `kvlb serve` (RFC 9112 sections 3.2 and 3.2.2,
//! RFC 9110 section 7.2): an HTTP/1.1 request without Host, with two, or with an invalid Host
//! value is answered 400 and the connection closed; an absolute-form target is forwarded in
//! origin-form with the target's authority as Host, and routed and logged by its path.

#[path = "support/mod.rs"]
mod support;

use serde_json::Value;
use std::time::Duration;
use support::{show_bytes, wait_until, Backend, HttpConn, Kvlb, Response, TempDir};

fn proxied(extra: &[&str]) -> (Backend, Kvlb) {
    let backend = Backend::start();
    let url = backend.url();
    let mut args = vec!["--replica", url.as_str(), "--workers", "1"];
    args.extend_from_slice(extra);
    let kvlb = Kvlb::serve(&args);
    (backend, kvlb)
}

/// Sends `raw` on a new connection: the answer must be a 400 JSON error, the connection
/// closed after it, nothing forwarded to the backend, and kvlb still serving.
fn assert_bad_request(raw: &[u8]) {
    let (backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let _ = conn.send(raw);
    let resp = conn.read_response("GET").unwrap_or_else(|e| {
        panic!(
            "no response to\n{}\n-> {e}\nkvlb stderr:\n{}",
            show_bytes(raw),
            kvlb.stderr()
        )
    });
    assert_eq!(
        resp.status,
        400,
        "request\n{}\ngot:\n{}",
        show_bytes(raw),
        resp.describe()
    );
    assert!(resp.is_json_error(), "{}", resp.describe());
    assert!(resp.says_close(), "{}", resp.describe());
    let (more, closed) = conn.read_for(Duration::from_millis(700));
    assert!(
        more.is_empty() && closed,
        "after the 400 for\n{}\nthe connection sent {:?} and closed={closed}",
        show_bytes(raw),
        show_bytes(&more)
    );
    // Only the stats request itself.
    assert_eq!(
        backend.stats().requests,
        1,
        "a request with a bad Host or target reached the backend:\n{}",
        show_bytes(raw)
    );
    assert_eq!(kvlb.get("/echo").status, 200);
}

/// Sends `raw` on a new connection and reads the (forwarded) answer.
fn forwarded(kvlb: &Kvlb, raw: &[u8], method: &str) -> Response {
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(raw).unwrap();
    conn.read_response(method).unwrap_or_else(|e| {
        panic!(
            "no response to\n{}\n-> {e}\nkvlb stderr:\n{}",
            show_bytes(raw),
            kvlb.stderr()
        )
    })
}

/// The Host values the backend received (from the echo's `x-got-headers-json`).
fn hosts_received(r: &Response) -> Vec<String> {
    let json = r
        .header("x-got-headers-json")
        .unwrap_or_else(|| panic!("no x-got-headers-json: {}", r.describe()));
    let pairs: Vec<(String, String)> = serde_json::from_str(json).unwrap();
    pairs
        .into_iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("host"))
        .map(|(_, v)| v)
        .collect()
}

#[test]
fn http11_request_without_host_is_rejected() {
    assert_bad_request(b"GET /echo HTTP/1.1\r\nX-A: 1\r\n\r\n");
}

#[test]
fn two_host_headers_are_rejected() {
    assert_bad_request(b"GET /echo HTTP/1.1\r\nHost: kvlb.test\r\nHost: other.example\r\n\r\n");
}

#[test]
fn host_with_space_slash_and_at_is_rejected() {
    assert_bad_request(b"GET /echo HTTP/1.1\r\nHost: a b/c@d\r\n\r\n");
}

#[test]
fn host_list_is_rejected() {
    assert_bad_request(b"GET /echo HTTP/1.1\r\nHost: a, b\r\n\r\n");
}

#[test]
fn host_with_userinfo_is_rejected() {
    assert_bad_request(b"GET /echo HTTP/1.1\r\nHost: user:pw@kvlb.test\r\n\r\n");
}

#[test]
fn host_with_bad_port_is_rejected() {
    assert_bad_request(b"GET /echo HTTP/1.1\r\nHost: kvlb.test:99999\r\n\r\n");
}

#[test]
fn host_with_control_character_is_rejected() {
    assert_bad_request(b"GET /echo HTTP/1.1\r\nHost: kvlb\x01test\r\n\r\n");
}

#[test]
fn absolute_form_with_other_scheme_is_rejected() {
    assert_bad_request(b"GET ftp://x/ HTTP/1.1\r\nHost: x\r\n\r\n");
}

#[test]
fn absolute_form_with_userinfo_is_rejected() {
    assert_bad_request(b"GET http://user@other.example/echo HTTP/1.1\r\nHost: kvlb.test\r\n\r\n");
}

#[test]
fn authority_form_outside_connect_is_rejected() {
    assert_bad_request(b"GET other.example:80 HTTP/1.1\r\nHost: other.example:80\r\n\r\n");
}

#[test]
fn asterisk_form_outside_options_is_rejected() {
    assert_bad_request(b"GET * HTTP/1.1\r\nHost: kvlb.test\r\n\r\n");
}

#[test]
fn absolute_form_reaches_the_backend_in_origin_form_with_the_target_host() {
    let (_backend, kvlb) = proxied(&[]);
    let r = forwarded(
        &kvlb,
        b"GET http://other.example/echo?x=1 HTTP/1.1\r\nHost: kvlb.test\r\n\r\n",
        "GET",
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(
        r.header("x-got-path"),
        Some("/echo?x=1"),
        "{}",
        r.describe()
    );
    assert_eq!(hosts_received(&r), ["other.example"], "{}", r.describe());
}

#[test]
fn absolute_form_scheme_is_case_insensitive_and_an_empty_path_is_slash() {
    let (_backend, kvlb) = proxied(&[]);
    // The test backend answers "/" 404, saying what it was asked.
    let r = forwarded(
        &kvlb,
        b"GET HTTPS://Other.Example:8443?x=1 HTTP/1.1\r\nHost: kvlb.test\r\n\r\n",
        "GET",
    );
    assert_eq!(r.status, 404, "{}", r.describe());
    assert_eq!(r.header("x-got-path"), Some("/?x=1"), "{}", r.describe());
    assert_eq!(
        hosts_received(&r),
        ["Other.Example:8443"],
        "{}",
        r.describe()
    );
}

#[test]
fn http10_absolute_form_without_host_gets_the_target_host() {
    let (_backend, kvlb) = proxied(&[]);
    let r = forwarded(
        &kvlb,
        b"GET http://other.example:8080/echo HTTP/1.0\r\n\r\n",
        "GET",
    );
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(r.header("x-got-path"), Some("/echo"), "{}", r.describe());
    assert_eq!(
        hosts_received(&r),
        ["other.example:8080"],
        "{}",
        r.describe()
    );
}

#[test]
fn http10_request_without_host_is_served_with_the_replica_authority() {
    let (backend, kvlb) = proxied(&[]);
    let r = forwarded(&kvlb, b"GET /echo HTTP/1.0\r\n\r\n", "GET");
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(
        hosts_received(&r),
        [backend.addr.to_string()],
        "{}",
        r.describe()
    );
}

/// A chat request whose body is mostly padding outside the prompt, so the prompt's token
/// estimate differs from the body-size estimate kvlb uses for requests it does not hash.
fn chat_request(target: &str) -> Vec<u8> {
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hello there"}}],"max_tokens":4,"user":"{}"}}"#,
        "p".repeat(800)
    );
    format!(
        "POST {target} HTTP/1.1\r\nHost: kvlb.test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn prompt_tokens(r: &Response) -> u64 {
    let d = r
        .header("x-kvlb-decision")
        .unwrap_or_else(|| panic!("no x-kvlb-decision: {}", r.describe()));
    d.split(';')
        .find_map(|p| p.trim().strip_prefix("prompt_tokens="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no prompt_tokens in {d}"))
}

#[test]
fn absolute_form_chat_is_hashed_and_logged_like_origin_form() {
    let dir = TempDir::new("host-target-log");
    let log = dir.file("access.log");
    let (_backend, kvlb) = proxied(&["--explain", "--access-log", log.to_str().unwrap()]);
    // The test backend has no chat route: it answers 404, saying the path it was asked.
    let origin = forwarded(&kvlb, &chat_request("/v1/chat/completions"), "POST");
    assert_eq!(origin.status, 404, "{}", origin.describe());
    let absolute = forwarded(
        &kvlb,
        &chat_request("http://other.example/v1/chat/completions"),
        "POST",
    );
    assert_eq!(absolute.status, 404, "{}", absolute.describe());
    let body_len = chat_request("/").len() as u64;
    let origin_tokens = prompt_tokens(&origin);
    assert!(
        origin_tokens > 0 && origin_tokens < body_len / 8,
        "the origin-form prompt was not hashed: {}",
        origin.describe()
    );
    assert_eq!(
        prompt_tokens(&absolute),
        origin_tokens,
        "the absolute-form chat request was not hashed as a prompt:\n{}",
        absolute.describe()
    );
    assert_eq!(
        absolute.header("x-got-path"),
        Some("/v1/chat/completions"),
        "{}",
        absolute.describe()
    );

    let lines = || -> Vec<Value> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    assert!(
        wait_until(Duration::from_secs(5), || lines().len() >= 2),
        "{:?}",
        lines()
    );
    let got = lines();
    assert_eq!(got[1]["method"], "POST", "{}", got[1]);
    assert_eq!(got[1]["path"], "/v1/chat/completions", "{}", got[1]);
    assert_eq!(got[1]["prompt_tokens"], got[0]["prompt_tokens"], "{got:?}");
}
