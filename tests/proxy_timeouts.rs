//! Timeouts of `kvlb serve` apply to what they name and nothing else: the client timeout to a
//! client that is sending, the idle timeout to a connection with nothing in flight, the
//! upstream timeout to the wait for a response head (not to a long streamed body), and the
//! connect timeout to a replica that does not complete the TCP handshake.

#[path = "support/mod.rs"]
mod support;

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use support::curl;
use support::{Backend, HttpConn, Kvlb};

fn proxied(extra: &[&str]) -> (Backend, Kvlb) {
    let backend = Backend::start();
    let url = backend.url();
    let mut args = vec!["--replica", url.as_str(), "--workers", "1"];
    args.extend_from_slice(extra);
    let kvlb = Kvlb::serve(&args);
    (backend, kvlb)
}

#[test]
fn client_timeout_does_not_fire_while_the_replica_is_thinking() {
    let (_backend, kvlb) = proxied(&["--client-timeout", "1s"]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request(
            "POST",
            "/slow?ms=2500",
            &[],
            b"{\"prompt\":\"long prefill\"}",
        )
        .expect("slow request");
    assert_eq!(
        resp.status,
        200,
        "a client waiting 2.5 s for its answer was cut by --client-timeout 1s:\n{}",
        resp.describe()
    );
}

#[test]
fn idle_timeout_does_not_fire_while_a_request_is_in_flight() {
    let (_backend, kvlb) = proxied(&["--idle-timeout", "1s"]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("GET", "/slow?ms=2500", &[], b"")
        .expect("slow request");
    assert_eq!(
        resp.status,
        200,
        "a request in flight for 2.5 s was cut by --idle-timeout 1s:\n{}",
        resp.describe()
    );
}

#[test]
fn upstream_timeout_does_not_cut_a_streamed_body() {
    let (_backend, kvlb) = proxied(&["--upstream-timeout", "1s", "--client-timeout", "1s"]);
    // The head arrives at once; the stream then runs 2.1 s, longer than both timeouts.
    let (events, ok) = curl::sse_events(&kvlb.url("/sse?n=8&interval_ms=300"), 20);
    let shown = curl::show_events(&events);
    assert!(ok, "curl failed:\n{shown}\nkvlb stderr:\n{}", kvlb.stderr());
    assert_eq!(events.len(), 9, "stream cut short:\n{shown}");
    assert_eq!(events[8].1, "data: [DONE]");
}

#[test]
fn slow_reading_client_gets_the_whole_body_and_others_are_served() {
    let (_backend, kvlb) = proxied(&[]);
    let mut slow = HttpConn::connect(kvlb.listen);
    let n = 4 * 1024 * 1024;
    slow.send_request("GET", &format!("/bytes?n={n}"), &[], b"")
        .unwrap();
    let (_, status, _, headers) = slow.read_head().expect("head");
    assert_eq!(status, 200);
    let want = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("x-body-sha256"))
        .map(|(_, v)| v.clone())
        .expect("x-body-sha256");
    // While this client reads slowly, the single worker still serves others promptly.
    let mut body = Vec::new();
    let mut other_checked = false;
    let start = Instant::now();
    while body.len() < n {
        let chunk = slow.read_some().expect("read body");
        assert!(
            !chunk.is_empty(),
            "closed after {} of {n} bytes",
            body.len()
        );
        body.extend_from_slice(&chunk);
        if !other_checked && body.len() > 256 * 1024 {
            let t = Instant::now();
            let resp = kvlb.get("/echo");
            assert_eq!(resp.status, 200);
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "another client waited {} ms behind a slow reader",
                t.elapsed().as_millis()
            );
            other_checked = true;
        }
        std::thread::sleep(Duration::from_millis(2));
        assert!(start.elapsed() < Duration::from_secs(60));
    }
    assert_eq!(body.len(), n);
    assert_eq!(support::digest::sha256_hex(&body), want);
}

/// A loopback listener whose accept queue is full, so further handshakes stall: the kernel
/// drops the SYNs of new connections.
struct FullBacklog {
    fd: libc::c_int,
    addr: SocketAddr,
    _fillers: Vec<TcpStream>,
}

impl FullBacklog {
    fn new() -> FullBacklog {
        // Safety: plain socket calls on a descriptor we own; `sa` is a properly initialised
        // sockaddr_in whose size we pass, and `getsockname` writes at most `len` bytes into it.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0, "socket");
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
            sa.sin_port = 0;
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let rc = libc::bind(fd, &sa as *const _ as *const libc::sockaddr, len);
            assert_eq!(rc, 0, "bind");
            assert_eq!(libc::listen(fd, 0), 0, "listen");
            let mut got_len = len;
            let rc = libc::getsockname(fd, &mut sa as *mut _ as *mut libc::sockaddr, &mut got_len);
            assert_eq!(rc, 0, "getsockname");
            let addr = SocketAddr::from(([127, 0, 0, 1], u16::from_be(sa.sin_port)));
            // Fill the accept queue (a backlog of 0 still admits one or two).
            let mut fillers = Vec::new();
            for _ in 0..4 {
                if let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
                    fillers.push(s);
                }
            }
            FullBacklog {
                fd,
                addr,
                _fillers: fillers,
            }
        }
    }

    /// Whether a new connection to it indeed stalls.
    fn stalls(&self) -> bool {
        TcpStream::connect_timeout(&self.addr, Duration::from_millis(500)).is_err()
    }
}

impl Drop for FullBacklog {
    fn drop(&mut self) {
        // Safety: closing the descriptor this value owns, once.
        unsafe {
            libc::close(self.fd);
        }
    }
}

#[test]
fn connect_timeout_bounds_a_stalled_handshake() {
    let blackhole = FullBacklog::new();
    if !blackhole.stalls() {
        eprintln!("skipped: this kernel completes handshakes beyond a full accept queue");
        return;
    }
    let url = format!("http://{}", blackhole.addr);
    let kvlb = Kvlb::serve(&[
        "--replica",
        url.as_str(),
        "--workers",
        "1",
        "--connect-timeout",
        "1s",
    ]);
    let start = Instant::now();
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.set_read_timeout(Duration::from_secs(8));
    let resp = conn
        .request("GET", "/echo", &[], b"")
        .unwrap_or_else(|e| panic!("no answer within 8 s with --connect-timeout 1s: {e}"));
    let waited = start.elapsed();
    assert!(
        [502, 503, 504].contains(&resp.status) && resp.is_json_error(),
        "replica never completes the handshake: expected a JSON 502/504, got:\n{}",
        resp.describe()
    );
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(5),
        "answered after {} ms with --connect-timeout 1s",
        waited.as_millis()
    );
}
