//! What clients without a key, or with many large bodies, can make kvlb hold: an API key is
//! checked on the head (401 before any body byte is invited or read), request bodies in flight
//! are bounded by `max_body_memory` (503 beyond, before the body is read), kvlb's own probes
//! answer without a key, and secrets come from files or the environment instead of the
//! command line.

#[path = "support/mod.rs"]
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use support::{wait_until, Backend, HttpConn, Kvlb, TempDir};

const KEY: &str = "sk-hostile-test-0001";

fn keyed(backend: &Backend, dir: &TempDir, extra: &[&str]) -> Kvlb {
    let keys = dir.file("keys");
    std::fs::write(&keys, format!("{KEY}\n")).unwrap();
    let url = backend.url();
    let mut args = vec![
        "--replica",
        url.as_str(),
        "--workers",
        "1",
        "--health-interval",
        "0",
        "--api-keys-file",
        keys.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Kvlb::serve(&args)
}

/// Waits (3 s at most) for `kvlb_body_memory_bytes` to read `want`.
fn wait_body_memory(kvlb: &Kvlb, want: f64) {
    let held = || kvlb.metric("kvlb_body_memory_bytes", &[]);
    assert!(
        wait_until(Duration::from_secs(3), || held() == Some(want)),
        "kvlb_body_memory_bytes = {:?}, expected {want}",
        held()
    );
}

/// Reads until the end of a response head (or `limit`), returning what arrived.
fn read_head(s: &mut TcpStream, limit: Duration) -> String {
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if got.windows(4).any(|w| w == b"\r\n\r\n") {
                    // Give the body a moment to follow.
                    std::thread::sleep(Duration::from_millis(50));
                    if let Ok(n) = s.read(&mut buf) {
                        got.extend_from_slice(&buf[..n]);
                    }
                    break;
                }
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn a_client_without_a_key_gets_401_before_it_sends_its_body() {
    let backend = Backend::start();
    let dir = TempDir::new("hostile-401");
    let kvlb = keyed(&backend, &dir, &[]);
    for expect in ["", "Expect: 100-continue\r\n"] {
        let mut s = TcpStream::connect(kvlb.listen).unwrap();
        // A 60 MiB body announced; not one byte of it sent.
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: kvlb.test\r\nContent-Type: application/json\r\n{expect}Content-Length: 62914560\r\n\r\n"
        )
        .unwrap();
        let got = read_head(&mut s, Duration::from_secs(3));
        assert!(
            got.starts_with("HTTP/1.1 401 "),
            "{expect:?}: expected a 401 before the body, got {got:?}\nkvlb stderr:\n{}",
            kvlb.stderr()
        );
        assert!(
            !got.contains("100 Continue"),
            "a client without a key was invited to send its body: {got:?}"
        );
        let lower = got.to_ascii_lowercase();
        assert!(lower.contains("connection: close"), "{got:?}");
        assert!(lower.contains("www-authenticate: bearer"), "{got:?}");
        assert!(got.contains("\"error\""), "a JSON error body: {got:?}");
    }
    // Nothing was buffered for them, nothing reached the replica.
    assert_eq!(kvlb.metric("kvlb_body_memory_bytes", &[]), Some(0.0));
    assert_eq!(backend.stats().requests, 1, "only the /stats request");
}

#[test]
fn a_client_with_a_key_still_gets_100_continue_and_its_answer() {
    let backend = Backend::start();
    let dir = TempDir::new("hostile-continue");
    let kvlb = keyed(&backend, &dir, &[]);
    let mut s = TcpStream::connect(kvlb.listen).unwrap();
    let body = vec![b'x'; 100_000];
    write!(
        s,
        "POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nAuthorization: Bearer {KEY}\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    let got = read_head(&mut s, Duration::from_secs(3));
    assert!(got.starts_with("HTTP/1.1 100 Continue"), "{got:?}");
    s.write_all(&body).unwrap();
    let got = read_head(&mut s, Duration::from_secs(5));
    assert!(got.starts_with("HTTP/1.1 200 "), "{got:?}");
}

#[test]
fn bodies_in_flight_are_bounded_by_max_body_memory() {
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&[
        "--replica",
        url.as_str(),
        "--workers",
        "1",
        "--health-interval",
        "0",
        "--max-body-bytes",
        "2MiB",
        "--max-body-memory",
        "4MiB",
    ]);
    let head =
        |n: usize| format!("POST /echo HTTP/1.1\r\nHost: kvlb.test\r\nContent-Length: {n}\r\n\r\n");
    // Two bodies of 2 MiB, held open half sent: the memory is full.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(kvlb.listen).unwrap();
        s.write_all(head(2 << 20).as_bytes()).unwrap();
        s.write_all(&vec![b'a'; 1 << 20]).unwrap();
        held.push(s);
    }
    wait_body_memory(&kvlb, (4 << 20) as f64);
    // A third is refused before its body is read.
    let mut s = TcpStream::connect(kvlb.listen).unwrap();
    s.write_all(head(1 << 20).as_bytes()).unwrap();
    let got = read_head(&mut s, Duration::from_secs(3));
    assert!(got.starts_with("HTTP/1.1 503 "), "{got:?}");
    assert!(
        got.to_ascii_lowercase().contains("retry-after: 1"),
        "{got:?}"
    );
    assert!(got.contains("max_body_memory"), "{got:?}");
    assert_eq!(
        kvlb.metric("kvlb_body_memory_refused_total", &[]),
        Some(1.0)
    );
    assert!(
        kvlb.stderr().contains("max_body_memory"),
        "{}",
        kvlb.stderr()
    );
    // Small bodies do not take from it.
    let mut c = HttpConn::connect(kvlb.listen);
    let r = c.request("POST", "/echo", &[], b"small").unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    // The held bodies finish; their memory is given back, and a large body passes again.
    for s in &mut held {
        s.write_all(&vec![b'a'; 1 << 20]).unwrap();
        let got = read_head(s, Duration::from_secs(5));
        assert!(got.starts_with("HTTP/1.1 200 "), "{got:?}");
    }
    drop(held);
    wait_body_memory(&kvlb, 0.0);
    let mut c = HttpConn::connect(kvlb.listen);
    let r = c
        .request("POST", "/echo", &[], &vec![b'b'; 2 << 20])
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
}

#[test]
fn max_body_memory_below_max_body_bytes_is_refused_at_start() {
    let out = std::process::Command::new(support::proxy::kvlb_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--replica",
            "http://127.0.0.1:9",
            "--max-body-memory",
            "1MiB",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max_body_memory"), "{err}");
}

#[test]
fn kvlb_probes_answer_without_a_key_and_replica_paths_stay_protected() {
    let backend = Backend::start();
    let dir = TempDir::new("hostile-probes");
    let kvlb = keyed(&backend, &dir, &[]);
    let mut c = HttpConn::connect(kvlb.listen);
    let r = c.request("GET", "/healthz", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(r.body_text(), r#"{"status":"ok"}"#);
    let r = c.request("GET", "/readyz?verbose=1", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    let r = c.request("HEAD", "/readyz", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    assert!(r.body.is_empty());
    // The replicas' own paths still need the key.
    let r = c.request("GET", "/health", &[], b"").unwrap();
    assert_eq!(r.status, 401, "{}", r.describe());
    let auth = format!("Bearer {KEY}");
    let r = c
        .request("GET", "/health", &[("Authorization", auth.as_str())], b"")
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(
        backend.stats().requests,
        1,
        "probes never reach the replica"
    );
}

#[test]
fn readiness_fails_without_an_available_replica_and_probes_can_be_turned_off() {
    // A replica nobody listens on, failing its active checks.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let kvlb = Kvlb::serve(&[
        "--replica",
        dead.as_str(),
        "--health-interval",
        "100ms",
        "--health-timeout",
        "100ms",
        "--unhealthy-after",
        "1",
        "--liveness-path",
        "/live",
    ]);
    assert!(
        wait_until(Duration::from_secs(5), || kvlb.get("/readyz").status == 503),
        "readiness stayed {}",
        kvlb.get("/readyz").describe()
    );
    assert_eq!(
        kvlb.get("/readyz").body_text(),
        r#"{"status":"no replica available"}"#
    );
    assert_eq!(kvlb.get("/live").status, 200);
    // /healthz is no longer kvlb's: it is forwarded, and the dead replica makes it a 502/503.
    let r = kvlb.get("/healthz");
    assert!(r.status == 502 || r.status == 503, "{}", r.describe());
    let off = Kvlb::serve(&["--replica", dead.as_str(), "--readiness-path", "off"]);
    let r = off.get("/readyz");
    assert!(r.status == 502 || r.status == 503, "{}", r.describe());
}

#[test]
fn secrets_come_from_files_and_the_environment_not_only_the_command_line() {
    let backend = Backend::start();
    let url = backend.url();
    let dir = TempDir::new("hostile-secrets");
    let token_file = dir.file("admin_token");
    std::fs::write(&token_file, "tok-from-a-file-0123456789\n").unwrap();
    let reload = |kvlb: &Kvlb, token: &str| {
        let mut c = HttpConn::connect(kvlb.admin);
        let auth = format!("Bearer {token}");
        c.request("POST", "/reload", &[("Authorization", auth.as_str())], b"")
            .unwrap()
            .status
    };
    // From a file.
    let kvlb = Kvlb::serve(&[
        "--replica",
        url.as_str(),
        "--admin-token-file",
        token_file.to_str().unwrap(),
    ]);
    assert_eq!(reload(&kvlb, "tok-from-a-file-0123456789"), 200);
    assert_eq!(reload(&kvlb, "tok-wrong-0000000000000000"), 401);
    assert!(!kvlb.stderr().contains("visible to every local user"));
    drop(kvlb);
    // From the environment, API keys too.
    let kvlb = Kvlb::serve_env(
        &["--replica", url.as_str()],
        &[
            ("KVLB_ADMIN_TOKEN", "tok-from-the-environment-01"),
            ("KVLB_API_KEYS", "sk-env-key-0001, sk-env-key-0002"),
        ],
    );
    assert_eq!(reload(&kvlb, "tok-from-the-environment-01"), 200);
    let mut c = HttpConn::connect(kvlb.listen);
    assert_eq!(c.request("GET", "/echo", &[], b"").unwrap().status, 401);
    let r = c
        .request(
            "GET",
            "/echo",
            &[("Authorization", "Bearer sk-env-key-0002")],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    drop(kvlb);
    // On the command line it still works, with a warning.
    let kvlb = Kvlb::serve(&[
        "--replica",
        url.as_str(),
        "--admin-token",
        "tok-on-the-command-line-01",
    ]);
    assert_eq!(reload(&kvlb, "tok-on-the-command-line-01"), 200);
    assert!(
        kvlb.stderr().contains("visible to every local user"),
        "{}",
        kvlb.stderr()
    );
    // A file that cannot be read, or holds a short token, stops kvlb at start, without
    // echoing the token.
    std::fs::write(&token_file, "short\n").unwrap();
    for file in [token_file.to_str().unwrap(), "/nonexistent/kvlb-token"] {
        let out = std::process::Command::new(support::proxy::kvlb_bin())
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--replica",
                url.as_str(),
                "--admin-token-file",
                file,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{file}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--admin-token-file"), "{err}");
        assert!(!err.contains("short"), "the token was echoed: {err}");
    }
}

#[test]
fn l4_first_requests_without_room_in_body_memory_are_routed_without_waiting_for_the_body() {
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&[
        "--mode",
        "l4",
        "--replica",
        url.as_str(),
        "--workers",
        "1",
        "--health-interval",
        "0",
        "--max-body-bytes",
        "1MiB",
        "--max-body-memory",
        "1MiB",
    ]);
    let n = 1 << 20;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: kvlb.test\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    );
    // The first body is waited for (to hash its prompt) and holds all of the body memory.
    let mut first = TcpStream::connect(kvlb.listen).unwrap();
    first.write_all(head.as_bytes()).unwrap();
    first.write_all(&vec![b' '; n / 2]).unwrap();
    wait_body_memory(&kvlb, n as f64);
    // The second is not: it is joined to a replica at once and its body streams through.
    let mut second = TcpStream::connect(kvlb.listen).unwrap();
    second.write_all(head.as_bytes()).unwrap();
    assert!(
        wait_until(Duration::from_secs(3), || kvlb
            .metric("kvlb_body_memory_refused_total", &[])
            == Some(1.0)),
        "kvlb_body_memory_refused_total = {:?}",
        kvlb.metric("kvlb_body_memory_refused_total", &[])
    );
    second.write_all(&vec![b' '; n]).unwrap();
    let got = read_head(&mut second, Duration::from_secs(5));
    assert!(
        got.starts_with("HTTP/1.1 404 "),
        "the replica's answer: {got:?}"
    );
    first.write_all(&vec![b' '; n / 2]).unwrap();
    let got = read_head(&mut first, Duration::from_secs(5));
    assert!(
        got.starts_with("HTTP/1.1 404 "),
        "the replica's answer: {got:?}"
    );
    wait_body_memory(&kvlb, 0.0);
}
