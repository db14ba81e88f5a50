//! The admin listener of `kvlb serve`: /healthz, /metrics (Prometheus text, `kvlb_` names,
//! requests by replica and status, requests in flight) and /replicas (JSON); stalled and
//! surplus admin connections, and changes from several admin connections at once.

#[path = "support/mod.rs"]
mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use support::{wait_until, Backend, HttpConn, Kvlb, Response};

fn two_replicas() -> (Backend, Backend, Kvlb) {
    let a = Backend::start();
    let b = Backend::start();
    let (ua, ub) = (a.url(), b.url());
    let kvlb = Kvlb::serve(&[
        "--replica",
        ua.as_str(),
        "--replica",
        ub.as_str(),
        "--policy",
        "round_robin",
        "--workers",
        "1",
    ]);
    (a, b, kvlb)
}

/// Sample lines (`name{labels} value`) of metrics whose name starts with `kvlb_`.
fn samples(text: &str) -> Vec<(String, String, f64)> {
    text.lines()
        .filter(|l| l.starts_with("kvlb_"))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n.to_string(), rest.trim_end_matches('}').to_string()),
                None => (series.to_string(), String::new()),
            };
            Some((name, labels, value))
        })
        .collect()
}

#[test]
fn healthz_answers_200() {
    let (_a, _b, kvlb) = two_replicas();
    let resp = kvlb.admin_get("/healthz");
    assert_eq!(resp.status, 200, "{}", resp.describe());
}

#[test]
fn metrics_count_requests_by_replica_and_status() {
    let (a, _b, kvlb) = two_replicas();
    for _ in 0..4 {
        assert_eq!(kvlb.get("/echo").status, 200);
    }
    for _ in 0..2 {
        assert_eq!(kvlb.get("/status?code=204").status, 204);
    }
    let resp = kvlb.admin_get("/metrics");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let ctype = resp.header("content-type").unwrap_or("");
    assert!(ctype.starts_with("text/plain"), "content-type {ctype:?}");
    let text = resp.body_text();
    let series = samples(&text);
    assert!(!series.is_empty(), "no kvlb_ samples in /metrics:\n{text}");
    // Every metric family has a kvlb_ name.
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split(' ').nth(2).unwrap_or("");
        assert!(
            name.starts_with("kvlb_"),
            "metric {name} lacks the kvlb_ prefix"
        );
    }
    // A request counter labelled by replica and status: replica a served 2 of the 4 echoes
    // and 1 of the 2 204s (round robin over 2).
    let a_host = a.addr.to_string();
    let by = |status: &str| -> f64 {
        series
            .iter()
            .filter(|(n, l, _)| {
                n.contains("request")
                    && !n.ends_with("_bucket")
                    && !n.ends_with("_sum")
                    && !n.ends_with("_count")
                    && l.contains(&a_host)
                    && l.contains(&format!("\"{status}\""))
            })
            .map(|(_, _, v)| *v)
            .sum()
    };
    // The status label is either the code ("200") or its class ("2xx").
    if by("2xx") > 0.0 || by("200") == 0.0 {
        assert_eq!(
            by("2xx"),
            3.0,
            "expected a kvlb_*request* counter with replica {a_host} and status \"2xx\" = 3 \
             (2 of the 200s, 1 of the 204s):\n{text}"
        );
    } else {
        assert_eq!(
            by("200"),
            2.0,
            "expected a kvlb_*request* counter with replica {a_host} and status \"200\" = 2:\n{text}"
        );
        assert_eq!(
            by("204"),
            1.0,
            "status \"204\" for replica {a_host}:\n{text}"
        );
    }
    let in_flight: Vec<_> = series
        .iter()
        .filter(|(n, _, _)| n.contains("in_flight") || n.contains("inflight"))
        .collect();
    assert!(!in_flight.is_empty(), "no in-flight metric:\n{text}");
    // The gauges may lag the last response by the time it takes the worker to see its write
    // complete; they must settle at 0.
    let settled = wait_until(Duration::from_secs(1), || {
        samples(&kvlb.admin_get("/metrics").body_text())
            .iter()
            .filter(|(n, _, _)| n.contains("in_flight") || n.contains("inflight"))
            .all(|(_, _, v)| *v == 0.0)
    });
    assert!(settled, "requests in flight while idle: {in_flight:?}");
}

#[test]
fn metrics_show_a_request_in_flight() {
    let (_a, _b, kvlb) = two_replicas();
    let listen = kvlb.listen;
    let slow = std::thread::spawn(move || {
        let mut conn = HttpConn::connect(listen);
        conn.request("GET", "/slow?ms=1500", &[], b"")
    });
    let flight = || -> f64 {
        samples(&kvlb.admin_get("/metrics").body_text())
            .iter()
            .filter(|(n, _, _)| n.contains("in_flight") || n.contains("inflight"))
            .map(|(_, _, v)| *v)
            .sum()
    };
    let seen = wait_until(Duration::from_millis(1200), || flight() >= 1.0);
    let resp = slow.join().unwrap().expect("slow request");
    assert_eq!(resp.status, 200);
    assert!(
        seen,
        "in-flight metric never showed the slow request:\n{}",
        kvlb.admin_get("/metrics").body_text()
    );
    assert!(
        wait_until(Duration::from_secs(2), || flight() == 0.0),
        "in-flight metric did not return to 0"
    );
}

#[test]
fn replicas_lists_the_configured_urls_as_json() {
    let (a, b, kvlb) = two_replicas();
    let resp = kvlb.admin_get("/replicas");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    let json = resp
        .json()
        .unwrap_or_else(|| panic!("/replicas is not JSON:\n{}", resp.describe()));
    let mut strings = Vec::new();
    collect_strings(&json, &mut strings);
    for url in [a.url(), b.url()] {
        assert!(
            strings.contains(&url),
            "/replicas does not list {url}: {json}"
        );
    }
}

fn collect_strings(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_strings(x, out)),
        serde_json::Value::Object(o) => o.values().for_each(|x| collect_strings(x, out)),
        _ => {}
    }
}

#[test]
fn admin_unknown_path_is_404() {
    let (_a, _b, kvlb) = two_replicas();
    assert_eq!(kvlb.admin_get("/no-such-admin-page").status, 404);
}

/// The start of a request head without its closing blank line: what a stalled client (or a
/// slow-loris one) leaves kvlb waiting on.
const PARTIAL_HEAD: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: admin\r\n";

/// How long kvlb gives an admin connection to send its request head and body, in all.
const ADMIN_READ_DEADLINE: Duration = Duration::from_secs(5);

/// How many admin connections kvlb serves at once.
const ADMIN_CONNECTION_LIMIT: usize = 64;

/// A connection to `addr` that sent `PARTIAL_HEAD` and then nothing.
fn stalled(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect admin");
    s.write_all(PARTIAL_HEAD).expect("send a partial head");
    s
}

/// Reads `s` until kvlb closes it (EOF or reset) or `limit` passes: the bytes read and, if it
/// closed, when (since `since`).
fn wait_closed(s: &mut TcpStream, since: Instant, limit: Duration) -> (Vec<u8>, Option<Duration>) {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (got, None);
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return (got, Some(since.elapsed())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return (got, Some(since.elapsed())),
        }
    }
}

/// `GET path` on a fresh admin connection, waiting at most `limit` for the answer: the
/// response (or the error) and how long it took.
fn timed_get(
    addr: SocketAddr,
    path: &str,
    limit: Duration,
) -> (std::io::Result<Response>, Duration) {
    let start = Instant::now();
    let resp = HttpConn::try_connect(addr).and_then(|mut conn| {
        conn.set_read_timeout(limit);
        conn.request("GET", path, &[], b"")
    });
    (resp, start.elapsed())
}

#[test]
fn healthz_answers_at_once_while_other_admin_connections_stall() {
    let (_a, _b, kvlb) = two_replicas();
    let stalls: Vec<TcpStream> = (0..6).map(|_| stalled(kvlb.admin)).collect();
    // Let kvlb take them in before the probes.
    std::thread::sleep(Duration::from_millis(200));
    for probe in 0..3 {
        let (resp, took) = timed_get(kvlb.admin, "/healthz", Duration::from_secs(3));
        let resp = resp.unwrap_or_else(|e| {
            panic!(
                "probe {probe}: GET /healthz with {} admin connections stalled: no answer in \
                 {took:?}: {e}",
                stalls.len()
            )
        });
        assert_eq!(resp.status, 200, "probe {probe}: {}", resp.describe());
        assert!(
            took < Duration::from_secs(1),
            "probe {probe}: GET /healthz took {took:?} with {} admin connections stalled",
            stalls.len()
        );
        eprintln!(
            "probe {probe}: 200 in {took:?} with {} admin connections stalled",
            stalls.len()
        );
    }
    drop(stalls);
}

#[test]
fn stalled_admin_connections_are_closed_at_the_deadline() {
    let (_a, _b, kvlb) = two_replicas();
    let start = Instant::now();
    let mut conns: Vec<TcpStream> = (0..2).map(|_| stalled(kvlb.admin)).collect();
    // A trickle: one header byte every 200 ms. No single read waits long, so only a deadline
    // over the whole head ends it.
    let mut trickle = TcpStream::connect(kvlb.admin).expect("connect admin");
    let mut writer = trickle.try_clone().unwrap();
    let trickler = std::thread::spawn(move || {
        let head = format!("GET /healthz HTTP/1.1\r\nx-pad: {}", "a".repeat(200));
        for b in head.bytes() {
            if writer.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let slack = Duration::from_millis(1500);
    for (i, s) in conns.iter_mut().chain([&mut trickle]).enumerate() {
        let (got, closed) = wait_closed(s, start, ADMIN_READ_DEADLINE + slack + slack);
        let closed = closed.unwrap_or_else(|| {
            panic!(
                "connection {i}: still open {:?} after it stalled (deadline {ADMIN_READ_DEADLINE:?})",
                start.elapsed()
            )
        });
        assert!(
            closed >= ADMIN_READ_DEADLINE - Duration::from_millis(500)
                && closed <= ADMIN_READ_DEADLINE + slack,
            "connection {i}: closed after {closed:?}; the deadline is {ADMIN_READ_DEADLINE:?}"
        );
        eprintln!("connection {i}: closed after {closed:?}");
        assert!(
            got.is_empty() || got.starts_with(b"HTTP/1.1 408 "),
            "connection {i}: {}",
            support::show_bytes(&got)
        );
    }
    trickler.join().unwrap();
    let timed_out = kvlb.metric("kvlb_admin_connections_timed_out_total", &[]);
    assert_eq!(
        timed_out,
        Some(3.0),
        "kvlb_admin_connections_timed_out_total:\n{}",
        kvlb.admin_get("/metrics").body_text()
    );
    // kvlb's stderr reaches the test through a pipe and a reader thread.
    let logged = wait_until(Duration::from_secs(2), || {
        kvlb.stderr()
            .lines()
            .any(|l| l.starts_with("kvlb: admin: connection from ") && l.contains(" timed out: "))
    });
    assert!(
        logged,
        "no timeout line in kvlb's stderr:\n{}",
        kvlb.stderr()
    );
}

#[test]
fn admin_connections_over_the_limit_get_503_at_once() {
    let (_a, _b, kvlb) = two_replicas();
    let stalls: Vec<TcpStream> = (0..ADMIN_CONNECTION_LIMIT)
        .map(|_| stalled(kvlb.admin))
        .collect();
    let (resp, took) = timed_get(kvlb.admin, "/healthz", Duration::from_secs(3));
    let resp = resp.unwrap_or_else(|e| {
        panic!("GET /healthz with {ADMIN_CONNECTION_LIMIT} admin connections open: no answer in {took:?}: {e}")
    });
    assert_eq!(resp.status, 503, "{}", resp.describe());
    assert!(resp.is_json_error(), "{}", resp.describe());
    assert!(took < Duration::from_secs(1), "the 503 took {took:?}");
    eprintln!("connection {}: 503 in {took:?}", ADMIN_CONNECTION_LIMIT + 1);
    // Closed connections give their places back (a probe sent before kvlb has seen them
    // close is refused too).
    drop(stalls);
    let mut refused = 1;
    let back = wait_until(Duration::from_secs(2), || {
        match timed_get(kvlb.admin, "/healthz", Duration::from_secs(1)).0 {
            Ok(r) if r.status == 200 => true,
            Ok(r) if r.status == 503 => {
                refused += 1;
                false
            }
            _ => false,
        }
    });
    assert!(
        back,
        "no 200 from /healthz after the stalled connections closed"
    );
    assert_eq!(
        kvlb.metric("kvlb_admin_connections_refused_total", &[]),
        Some(refused as f64),
        "{}",
        kvlb.admin_get("/metrics").body_text()
    );
    let logged = wait_until(Duration::from_secs(2), || {
        kvlb.stderr()
            .lines()
            .any(|l| l.starts_with("kvlb: admin: connection from ") && l.contains(" refused: "))
    });
    assert!(
        logged,
        "no refusal line in kvlb's stderr:\n{}",
        kvlb.stderr()
    );
}

const TOKEN: &str = "test-admin-token-0123456789";

/// `POST path` with the admin token and a JSON body: (status, body).
fn admin_post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut conn = HttpConn::connect(addr);
    let auth = format!("Bearer {TOKEN}");
    let headers = [
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    let resp = conn
        .request("POST", path, &headers, body.as_bytes())
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    (resp.status, resp.body_text())
}

#[test]
fn concurrent_admin_changes_stay_consistent() {
    let a = Backend::start();
    let ua = a.url();
    let kvlb = Kvlb::serve(&[
        "--replica",
        ua.as_str(),
        "--admin-token",
        TOKEN,
        "--health-interval",
        "0",
    ]);
    let admin = kvlb.admin;
    // Six connections add the same replica at once, four more add one each.
    let same = "http://127.0.0.1:9".to_string();
    let urls: Vec<String> = std::iter::repeat_n(same.clone(), 6)
        .chain((1..=4).map(|i| format!("http://127.0.0.{}:9", i + 1)))
        .collect();
    let start = Arc::new(Barrier::new(urls.len()));
    let adds: Vec<_> = urls
        .iter()
        .map(|url| {
            let (start, body) = (start.clone(), format!("{{\"url\": \"{url}\"}}"));
            std::thread::spawn(move || {
                start.wait();
                admin_post(admin, "/replicas", &body)
            })
        })
        .collect();
    let results: Vec<(u16, String)> = adds.into_iter().map(|h| h.join().unwrap()).collect();
    let added_same = results[..6].iter().filter(|(st, _)| *st == 200).count();
    assert_eq!(
        added_same, 1,
        "adding one replica from 6 connections: {results:?}"
    );
    assert!(
        results[..6].iter().all(|(st, _)| *st == 200 || *st == 409),
        "{results:?}"
    );
    assert!(results[6..].iter().all(|(st, _)| *st == 200), "{results:?}");
    let json = kvlb.admin_get("/replicas").json().expect("/replicas JSON");
    let listed = json["replicas"].as_array().unwrap();
    let mut slots: Vec<u64> = listed.iter().map(|r| r["slot"].as_u64().unwrap()).collect();
    slots.sort();
    slots.dedup();
    assert_eq!(listed.len(), 6, "{json}");
    assert_eq!(slots.len(), 6, "two replicas share a slot: {json}");
}
