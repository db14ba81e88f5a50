//! Failures around `kvlb serve`: a replica that dies (502), no usable replica (502 / 503), a
//! replica that never answers (504), a client that goes away (the upstream request is
//! cancelled), and SIGTERM (in-flight requests drain, then exit 0).

#[path = "support/mod.rs"]
mod support;

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use support::client;
use support::proxy::run_kvlb;
use support::{wait_until, Backend, HttpConn, Kvlb};

fn proxied(extra: &[&str]) -> (Backend, Kvlb) {
    let backend = Backend::start();
    let url = backend.url();
    let mut args = vec!["--replica", url.as_str(), "--workers", "1"];
    args.extend_from_slice(extra);
    let kvlb = Kvlb::serve(&args);
    (backend, kvlb)
}

fn assert_json_error(resp: &support::Response, status: &[u16], what: &str, kvlb: &Kvlb) {
    assert!(
        status.contains(&resp.status) && resp.is_json_error(),
        "{what}: expected JSON error with status {status:?}, got:\n{}\nkvlb stderr:\n{}",
        resp.describe(),
        kvlb.stderr()
    );
}

/// The sum of every `kvlb_*` sample whose name mentions in-flight requests, or `None` if the
/// metrics expose no such series.
fn in_flight(kvlb: &Kvlb) -> Option<f64> {
    let text = kvlb.admin_get("/metrics").body_text();
    let mut sum = None;
    for line in text.lines().filter(|l| l.starts_with("kvlb_")) {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        if name.contains("in_flight") || name.contains("inflight") {
            if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
                sum = Some(sum.unwrap_or(0.0) + v);
            }
        }
    }
    sum
}

/// A loopback port with nothing listening on it.
fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    addr
}

#[test]
fn replica_dying_before_answering_gets_502() {
    let (mut backend, kvlb) = proxied(&[]);
    let resp = client::get(kvlb.listen, "/die?after=nothing");
    assert_json_error(&resp, &[502], "replica exited without answering", &kvlb);
    assert!(wait_until(Duration::from_secs(3), || !backend.is_running()));
    // The proxy survives its only replica: it answers with an error, not a dropped connection.
    assert_json_error(&kvlb.get("/echo"), &[502, 503], "replica gone", &kvlb);
}

#[test]
fn replica_dying_mid_response_fails_only_that_client() {
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
    let mut backends = [a, b];
    // Four slow requests in flight, spread over both replicas.
    let listen = kvlb.listen;
    let slow: Vec<_> = (0..4)
        .map(|i| {
            std::thread::spawn(move || {
                let mut conn = HttpConn::connect(listen);
                conn.request("GET", &format!("/slow?ms=1500&i={i}"), &[], b"")
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(400));
    // One replica dies after sending a head and part of a body.
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /die HTTP/1.1\r\nHost: kvlb.test\r\n\r\n")
        .unwrap();
    match conn.read_response("GET") {
        Err(e) => assert!(
            e.kind() == std::io::ErrorKind::UnexpectedEof
                || e.kind() == std::io::ErrorKind::ConnectionReset,
            "client of the dying replica should see a truncated response, got: {e}"
        ),
        Ok(resp) => assert_json_error(&resp, &[502], "replica died mid-response", &kvlb),
    }
    assert!(
        wait_until(Duration::from_secs(3), || backends
            .iter_mut()
            .any(|b| !b.is_running())),
        "no backend died"
    );
    let dead = backends.iter_mut().position(|b| !b.is_running()).unwrap();
    let survivor = &backends[1 - dead];
    let results: Vec<_> = slow.into_iter().map(|t| t.join().unwrap()).collect();
    let survivor_url = survivor.url();
    let survivor_served = survivor.stats().requests - 1;
    let mut ok = 0;
    for r in &results {
        match r {
            Ok(resp) if resp.status == 200 => {
                assert_eq!(resp.header("x-kvlb-replica"), Some(survivor_url.as_str()));
                ok += 1;
            }
            Ok(resp) => assert_json_error(resp, &[502], "in flight on the dead replica", &kvlb),
            Err(e) => panic!("a concurrent request failed at the transport level: {e}"),
        }
    }
    assert_eq!(
        ok, survivor_served,
        "every request on the surviving replica must succeed: {results:#?}"
    );
    assert!(
        ok >= 1,
        "no request reached the surviving replica: {results:#?}"
    );
    // The proxy itself is fine: the surviving replica keeps serving.
    let served = (0..4).any(|_| client::get(kvlb.listen, "/echo").status == 200);
    assert!(served, "proxy no longer serves after a replica died");
}

#[test]
fn only_replica_on_a_closed_port_gets_502() {
    let dead = format!("http://{}", closed_port());
    let kvlb = Kvlb::serve(&["--replica", dead.as_str(), "--workers", "1"]);
    let start = Instant::now();
    let resp = kvlb.get("/echo");
    // 502: the replica failed before answering; 503 if the proxy already marked it down.
    assert_json_error(
        &resp,
        &[502, 503],
        "only replica refuses connections",
        &kvlb,
    );
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "refused connection took {} ms to report",
        start.elapsed().as_millis()
    );
    // And again on the same proxy: no crash, same answer.
    assert_json_error(&kvlb.get("/echo"), &[502, 503], "second request", &kvlb);
}

#[test]
fn no_replica_gets_503() {
    match Kvlb::try_serve_raw(&[
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--workers",
        "1",
    ]) {
        Ok(kvlb) => {
            let resp = kvlb.get("/v1/completions");
            assert_json_error(&resp, &[503], "no replica configured", &kvlb);
        }
        Err(f) => {
            // Refusing to start without replicas is a configuration error instead.
            let code = f.status.and_then(|s| s.code());
            assert_eq!(
                code,
                Some(2),
                "kvlb serve without replicas neither served 503 nor exited 2: {f:?}"
            );
            assert!(f.stderr.contains("replica"), "{}", f.stderr);
        }
    }
}

#[test]
fn hanging_replica_gets_504_after_upstream_timeout() {
    let (backend, kvlb) = proxied(&["--upstream-timeout", "1s"]);
    let start = Instant::now();
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.set_read_timeout(Duration::from_secs(8));
    let resp = conn
        .request("GET", "/hang", &[], b"")
        .unwrap_or_else(|e| panic!("no answer for /hang with --upstream-timeout 1s: {e}"));
    let waited = start.elapsed();
    assert_json_error(&resp, &[504], "replica never answers", &kvlb);
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "504 after {} ms with --upstream-timeout 1s",
        waited.as_millis()
    );
    // The proxy gave up on the upstream connection too.
    assert!(
        wait_until(Duration::from_secs(3), || backend.stats().aborted >= 1),
        "the upstream connection of the timed-out request stayed open: {:?}",
        backend.stats()
    );
}

#[test]
fn client_disconnect_cancels_the_upstream_request() {
    let (backend, kvlb) = proxied(&[]);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /slow?ms=3000 HTTP/1.1\r\nHost: kvlb.test\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        wait_until(Duration::from_secs(1), || backend.stats().requests >= 2),
        "the slow request did not reach the backend"
    );
    let dropped_at = Instant::now();
    drop(conn);
    let cancelled = wait_until(Duration::from_millis(2000), || backend.stats().aborted >= 1);
    assert!(
        cancelled,
        "backend still serving 2 s after the client left (the slow request takes 3 s): {:?}",
        backend.stats()
    );
    assert!(dropped_at.elapsed() < Duration::from_millis(2500));
    if in_flight(&kvlb).is_some() {
        assert!(
            wait_until(Duration::from_secs(2), || in_flight(&kvlb) == Some(0.0)),
            "in-flight metric did not return to 0: {:?}",
            in_flight(&kvlb)
        );
    }
}

#[test]
fn sigterm_drains_in_flight_requests_and_exits_zero() {
    let (_backend, mut kvlb) = proxied(&["--drain-timeout", "10s"]);
    let listen = kvlb.listen;
    let slow = std::thread::spawn(move || {
        let mut conn = HttpConn::connect(listen);
        conn.request("GET", "/slow?ms=1500", &[], b"")
    });
    std::thread::sleep(Duration::from_millis(300));
    kvlb.terminate();
    let term_at = Instant::now();
    // New connections are refused once draining has started: the connect fails, or the
    // connection is closed at once. Served or left hanging are both wrong.
    std::thread::sleep(Duration::from_millis(300));
    let new_conn = match HttpConn::try_connect(listen) {
        Err(e) => format!("refused ({e})"),
        Ok(mut conn) => {
            let _ = conn.send(b"GET /echo HTTP/1.1\r\nHost: kvlb.test\r\n\r\n");
            let (bytes, closed) = conn.read_for(Duration::from_secs(1));
            if closed && bytes.is_empty() {
                "closed".to_string()
            } else if closed {
                format!("answered then closed: {}", support::show_bytes(&bytes))
            } else if bytes.is_empty() {
                "accepted and left hanging for 1 s".to_string()
            } else {
                format!("answered: {}", support::show_bytes(&bytes))
            }
        }
    };
    assert!(
        new_conn.starts_with("refused") || new_conn == "closed",
        "a new connection after SIGTERM was {new_conn}\nkvlb stderr:\n{}",
        kvlb.stderr()
    );
    let resp = slow.join().unwrap().unwrap_or_else(|e| {
        panic!(
            "in-flight request failed during drain: {e}\nkvlb stderr:\n{}",
            kvlb.stderr()
        )
    });
    assert_eq!(resp.status, 200, "{}", resp.describe());
    assert_eq!(resp.body, b"slow done\n");
    let status = kvlb.wait_exit(Duration::from_secs(10));
    let stderr = kvlb.stderr();
    let status = status.unwrap_or_else(|| panic!("still running 10 s after SIGTERM:\n{stderr}"));
    assert_eq!(status.code(), Some(0), "exit after SIGTERM:\n{stderr}");
    assert!(term_at.elapsed() < Duration::from_secs(10));
}

#[test]
fn sigterm_with_idle_keep_alive_connection_exits_promptly() {
    let (_backend, mut kvlb) = proxied(&["--drain-timeout", "10s"]);
    let mut idle = HttpConn::connect(kvlb.listen);
    let resp = idle.request("GET", "/echo", &[], b"").unwrap();
    assert_eq!(resp.status, 200);
    kvlb.terminate();
    let start = Instant::now();
    let status = kvlb.wait_exit(Duration::from_secs(8));
    let stderr = kvlb.stderr();
    let status = status.unwrap_or_else(|| {
        panic!("an idle keep-alive connection held the drain for 8 s:\n{stderr}")
    });
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "idle connection delayed exit by {} ms",
        start.elapsed().as_millis()
    );
}

#[test]
fn sigterm_exits_zero_at_drain_timeout_with_a_request_still_running() {
    let (_backend, mut kvlb) = proxied(&["--drain-timeout", "1s"]);
    let listen = kvlb.listen;
    let slow = std::thread::spawn(move || {
        let mut conn = HttpConn::connect(listen);
        conn.set_read_timeout(Duration::from_secs(15));
        conn.request("GET", "/slow?ms=10000", &[], b"")
    });
    std::thread::sleep(Duration::from_millis(300));
    kvlb.terminate();
    let start = Instant::now();
    let status = kvlb.wait_exit(Duration::from_secs(6));
    let stderr = kvlb.stderr();
    let status = status.unwrap_or_else(|| {
        panic!("still running 6 s after SIGTERM with --drain-timeout 1s:\n{stderr}")
    });
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(start.elapsed() >= Duration::from_millis(800));
    // The abandoned client sees its connection end, not a hang.
    let result = slow.join().unwrap();
    assert!(
        !matches!(&result, Ok(r) if r.status == 200),
        "request outlived the drain timeout: {result:?}"
    );
}

#[test]
fn run_kvlb_reports_exit_status() {
    // Harness check: a bad command exits 2 quickly.
    let out = run_kvlb(&["no-such-command"], Duration::from_secs(10));
    assert_eq!(out.status.and_then(|s| s.code()), Some(2), "{out:?}");
}
