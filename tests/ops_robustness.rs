//! Production robustness of `kvlb serve`, with real processes on loopback:
//! - 10,000 concurrent keep-alive client connections held open while other clients are served
//!   (`KVLB_HELD_CONNECTIONS` changes the number);
//! - slowloris clients trickling a head or a body byte by byte are cut at the client timeout
//!   (the trickle does not extend it; each gets a 408) while other clients are served promptly;
//! - a bounded soak under mixed load (keep-alive and one-shot requests, streams, clients that
//!   leave mid-stream, malformed requests) in which kvlb's resident memory and descriptor count
//!   stay flat (`KVLB_SOAK_SECONDS`, default 60);
//! - every request accounted for (answered or errored, none lost, none hanging) while replicas
//!   (`kvlb replica` processes) are killed and restarted under load;
//! - per-worker accepted, open and in-flight counts in /metrics show both SO_REUSEPORT workers
//!   taking connections.
//!
//! The tests of this file run one at a time (they each load both cores).

#[path = "support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use support::proxy::{kvlb_bin, metric_sum};
use support::{wait_until, Backend, HttpConn, Kvlb};

/// One test at a time: each loads both cores, and the descriptor limit is per process.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Raises this process's RLIMIT_NOFILE (inherited by the kvlb it spawns) to at least `want`
/// when privileges allow, else to the hard limit; returns the soft limit now in force.
fn raise_nofile(want: u64) -> u64 {
    let (soft, hard) = kvlb::limits::nofile_limit().expect("getrlimit");
    if hard < want {
        let lim = libc::rlimit {
            rlim_cur: want as libc::rlim_t,
            rlim_max: want as libc::rlim_t,
        };
        // Safety: setrlimit(2) reads the valid rlimit we pass; raising the hard limit needs
        // CAP_SYS_RESOURCE and simply fails without it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } == 0 {
            return want;
        }
    }
    if soft < hard {
        kvlb::limits::raise_nofile_limit().expect("raise soft RLIMIT_NOFILE")
    } else {
        soft
    }
}

/// One `kvlb replica` process (one simulated vLLM replica), killed and reaped on drop.
struct SimReplica {
    child: Option<Child>,
    addr: SocketAddr,
}

impl SimReplica {
    /// Starts a replica on `port` (0: any), engine time 20x wall time.
    fn start(port: u16) -> SimReplica {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match SimReplica::try_start(port) {
                Ok(r) => return r,
                // The port of a replica just killed may take a moment to be free again.
                Err(e) if Instant::now() < deadline && port != 0 => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("kvlb replica did not start: {e}"),
            }
        }
    }

    fn try_start(port: u16) -> Result<SimReplica, String> {
        let mut child = Command::new(kvlb_bin())
            .args(["replica", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--time-scale", "20", "--max-num-seqs", "1024"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn kvlb replica: {e}"))?;
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut addr = None;
        let mut said = Vec::new();
        loop {
            match rx.recv_timeout(Duration::from_secs(15)) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("kvlb replica: replica 0 on ") {
                        addr = rest.split_whitespace().next().and_then(|a| a.parse().ok());
                    } else if line.starts_with("kvlb replica: ready") {
                        break;
                    }
                    said.push(line);
                }
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(said.join("\n"));
                }
            }
        }
        let addr = addr.ok_or_else(|| said.join("\n"))?;
        Ok(SimReplica {
            child: Some(child),
            addr,
        })
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// SIGKILL, as a crashing engine.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for SimReplica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Makes closing `s` send a reset instead of a FIN, so the client side leaves no TIME_WAIT
/// entry behind. The tests here open tens of thousands of client connections; their TIME_WAIT
/// entries would hold those ephemeral ports for a minute against any later test that binds a
/// listener to a port of the ephemeral range.
fn reset_on_close(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // Safety: setsockopt(2) on an open socket with a valid linger struct and its size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// A client connection that leaves no TIME_WAIT behind (see [`reset_on_close`]).
fn try_connect(addr: SocketAddr) -> std::io::Result<HttpConn> {
    let c = HttpConn::try_connect(addr)?;
    reset_on_close(c.stream());
    Ok(c)
}

fn connect(addr: SocketAddr) -> HttpConn {
    try_connect(addr).unwrap_or_else(|e| panic!("connect to {addr} failed: {e}"))
}

fn metric(kvlb: &Kvlb, name: &str, labels: &[&str]) -> f64 {
    let text = kvlb.admin_get("/metrics").body_text();
    metric_sum(&text, name, labels).unwrap_or_else(|| panic!("/metrics lacks {name} {labels:?}"))
}

/// VmRSS (bytes) and open descriptors of a process.
fn rss_and_fds(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS");
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read fd dir")
        .count();
    (kib * 1024, fds)
}

fn completion_body(i: u64, stream: bool, max_tokens: u32) -> String {
    format!(
        r#"{{"model":"Qwen/Qwen3-8B","prompt":"You are a careful assistant. Request {} of a soak: {}","max_tokens":{max_tokens},"stream":{stream}}}"#,
        i % 50,
        "lorem ipsum ".repeat((i % 7) as usize + 1)
    )
}

#[test]
fn ten_thousand_keep_alive_connections_are_held_while_others_are_served() {
    let _one = serial();
    let started = Instant::now();
    let n = env_u64("KVLB_HELD_CONNECTIONS", 10_000) as usize;
    let limit = raise_nofile(2 * n as u64 + 4096);
    assert!(
        limit >= n as u64 + 1024,
        "RLIMIT_NOFILE {limit} is too low to hold {n} connections (raise the hard limit)"
    );
    let replica = SimReplica::start(0);
    let url = replica.url();
    let kvlb = Kvlb::serve(&["--replica", &url, "--workers", "2"]);

    // Open the connections in waves; each makes one request, then stays open and idle.
    let mut held: Vec<HttpConn> = Vec::with_capacity(n);
    while held.len() < n {
        let wave = (n - held.len()).min(500);
        let mut batch: Vec<HttpConn> = (0..wave)
            .map(|_| {
                let mut c = connect(kvlb.listen);
                c.send_request("GET", "/health", &[], b"").expect("send");
                c
            })
            .collect();
        for c in batch.iter_mut() {
            let resp = c.read_response("GET").unwrap_or_else(|e| {
                panic!(
                    "connection {} of {n}: {e}\nkvlb stderr:\n{}",
                    held.len(),
                    kvlb.stderr()
                )
            });
            assert_eq!(resp.status, 200, "{}", resp.describe());
        }
        held.extend(batch);
    }
    let opened = started.elapsed();
    assert!(
        wait_until(Duration::from_secs(10), || metric(
            &kvlb,
            "kvlb_worker_connections",
            &[]
        ) >= n as f64),
        "kvlb does not report {n} open connections: {}",
        metric(&kvlb, "kvlb_worker_connections", &[])
    );

    // Other clients, on new connections, are served while the 10,000 are held.
    let mut worst = Duration::ZERO;
    for i in 0..200 {
        let t = Instant::now();
        let mut c = connect(kvlb.listen);
        for _ in 0..2 {
            let body = completion_body(i, false, 2);
            let resp = c
                .request("POST", "/v1/completions", &[], body.as_bytes())
                .unwrap_or_else(|e| panic!("new client {i}: {e}\n{}", kvlb.stderr()));
            assert_eq!(resp.status, 200, "{}", resp.describe());
        }
        worst = worst.max(t.elapsed());
    }
    assert!(
        worst < Duration::from_secs(3),
        "a new client took {worst:?} while {n} connections were held"
    );
    // The held connections are still alive: every 50th makes a second request.
    for (i, c) in held.iter_mut().enumerate().step_by(50) {
        let resp = c
            .request("GET", "/health", &[], b"")
            .unwrap_or_else(|e| panic!("held connection {i} unusable: {e}"));
        assert_eq!(resp.status, 200);
    }
    let (rss, fds) = rss_and_fds(kvlb.pid());
    eprintln!(
        "held {n} keep-alive connections (opened in {opened:?}); slowest new client {worst:?}; \
         kvlb RSS {} MiB, {fds} fds; {:?} in all",
        rss >> 20,
        started.elapsed()
    );
    drop(held);
    assert!(
        wait_until(Duration::from_secs(15), || metric(
            &kvlb,
            "kvlb_worker_connections",
            &[]
        ) == 0.0),
        "kvlb still counts open connections after the clients closed"
    );
}

#[test]
fn slowloris_clients_get_408_at_the_client_timeout_without_starving_others() {
    let _one = serial();
    let started = Instant::now();
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&[
        "--replica",
        &url,
        "--workers",
        "2",
        "--client-timeout",
        "2s",
    ]);
    // Half trickle their head, half send a head and trickle the body; one byte each per 100 ms
    // (the head or body would take minutes to complete).
    let n_slow = 200;
    let mut slow: Vec<(TcpStream, Vec<u8>, usize, Option<Duration>)> = (0..n_slow)
        .map(|i| {
            let s = TcpStream::connect(kvlb.listen).expect("connect");
            reset_on_close(&s);
            s.set_nodelay(true).unwrap();
            let mut msg = b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 4000\r\n".to_vec();
            let mut sent = 0;
            if i % 2 == 1 {
                msg.extend_from_slice(b"\r\n");
                (&s).write_all(&msg).unwrap();
                sent = msg.len();
                msg.extend(std::iter::repeat_n(b'x', 4000));
            } else {
                msg.extend(std::iter::repeat_n(b'y', 4000));
            }
            s.set_nonblocking(true).unwrap();
            (s, msg, sent, None)
        })
        .collect();
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let trickler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Relaxed) && t0.elapsed() < Duration::from_secs(8) {
                for (s, msg, sent, closed) in slow.iter_mut() {
                    if closed.is_some() || *sent >= msg.len() {
                        continue;
                    }
                    match (&*s).write(&msg[*sent..*sent + 1]) {
                        Ok(_) => *sent += 1,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => *closed = Some(t0.elapsed()),
                    }
                    // A closed peer shows as EOF (or a reset) on read.
                    let mut b = [0u8; 256];
                    match (&*s).read(&mut b) {
                        Ok(0) => *closed = Some(t0.elapsed()),
                        Err(e) if e.kind() != ErrorKind::WouldBlock => *closed = Some(t0.elapsed()),
                        _ => {}
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            slow
        })
    };
    // Meanwhile normal clients are served promptly.
    let mut worst = Duration::ZERO;
    let mut served = 0;
    while t0.elapsed() < Duration::from_secs(4) {
        let t = Instant::now();
        let mut c = connect(kvlb.listen);
        let resp = c
            .request("POST", "/echo", &[], b"hello")
            .unwrap_or_else(|e| panic!("normal client: {e}\n{}", kvlb.stderr()));
        assert_eq!(resp.status, 200);
        served += 1;
        worst = worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        worst < Duration::from_millis(1000),
        "a normal client waited {worst:?} among {n_slow} slowloris clients"
    );
    // By 2 s (the client timeout) plus slack, kvlb has cut every trickling client.
    assert!(
        wait_until(Duration::from_secs(3), || metric(
            &kvlb,
            "kvlb_local_responses_total",
            &["status=\"408\""]
        ) >= n_slow as f64),
        "408s sent: {} of {n_slow}",
        metric(&kvlb, "kvlb_local_responses_total", &["status=\"408\""])
    );
    stop.store(true, Relaxed);
    let slow = trickler.join().unwrap();
    let latest = slow.iter().filter_map(|s| s.3).max();
    let open = slow.iter().filter(|s| s.3.is_none()).count();
    assert_eq!(
        open,
        0,
        "{open} slowloris connections still open after {:?}",
        t0.elapsed()
    );
    let latest = latest.unwrap();
    assert!(
        latest < Duration::from_millis(4500),
        "the last slowloris connection closed at {latest:?} with --client-timeout 2s"
    );
    eprintln!(
        "{n_slow} slowloris clients cut by {latest:?}; {served} normal requests, slowest \
         {worst:?}; {:?} in all",
        started.elapsed()
    );
}

/// Client outcomes under load.
#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    answered: AtomicU64,
    /// A complete error response (5xx) from kvlb.
    errored: AtomicU64,
    /// The connection ended before the response did (a replica died mid-stream).
    cut: AtomicU64,
    /// No answer within the client's patience: a lost request.
    hanging: AtomicU64,
    /// Anything else (a 4xx to a valid request, a malformed response).
    unexpected: AtomicU64,
}

impl Tally {
    fn record(&self, outcome: &std::io::Result<support::Response>) {
        match outcome {
            Ok(r) if r.status == 200 => self.answered.fetch_add(1, Relaxed),
            Ok(r) if r.status >= 500 => self.errored.fetch_add(1, Relaxed),
            Ok(_) => self.unexpected.fetch_add(1, Relaxed),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                self.hanging.fetch_add(1, Relaxed)
            }
            Err(_) => self.cut.fetch_add(1, Relaxed),
        };
    }

    fn line(&self) -> String {
        format!(
            "sent {}, answered {}, errored {}, cut {}, hanging {}, unexpected {}",
            self.sent.load(Relaxed),
            self.answered.load(Relaxed),
            self.errored.load(Relaxed),
            self.cut.load(Relaxed),
            self.hanging.load(Relaxed),
            self.unexpected.load(Relaxed)
        )
    }
}

/// A client thread: keep-alive requests (a quarter streamed) until `stop`; a new connection
/// after any failure or every 20 requests.
fn load_client(addr: SocketAddr, id: u64, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    let mut i = 0u64;
    let mut conn: Option<HttpConn> = None;
    while !stop.load(Relaxed) {
        i += 1;
        let c = match conn.as_mut() {
            Some(c) => c,
            None => match try_connect(addr) {
                Ok(mut c) => {
                    c.set_read_timeout(Duration::from_secs(20));
                    conn.insert(c)
                }
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            },
        };
        let stream = i.is_multiple_of(4);
        let body = completion_body(id * 1_000_000 + i, stream, if stream { 6 } else { 3 });
        tally.sent.fetch_add(1, Relaxed);
        let outcome = c
            .send_request("POST", "/v1/completions", &[], body.as_bytes())
            .and_then(|_| c.read_response("POST"));
        tally.record(&outcome);
        let keep = matches!(&outcome, Ok(r) if !r.says_close()) && !i.is_multiple_of(20);
        if !keep {
            conn = None;
        }
    }
}

#[test]
fn every_request_is_accounted_for_while_replicas_are_killed_and_restarted() {
    let _one = serial();
    let started = Instant::now();
    let mut replicas: Vec<SimReplica> = (0..3).map(|_| SimReplica::start(0)).collect();
    let urls: Vec<String> = replicas.iter().map(|r| r.url()).collect();
    let mut args = vec!["--workers", "2", "--policy", "least_loaded"];
    for u in &urls {
        args.extend(["--replica", u.as_str()]);
    }
    args.extend(["--connect-timeout", "1s", "--upstream-timeout", "10s"]);
    let kvlb = Kvlb::serve(&args);

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let clients: Vec<_> = (0..8)
        .map(|id| {
            let (stop, tally) = (stop.clone(), tally.clone());
            let addr = kvlb.listen;
            std::thread::spawn(move || load_client(addr, id, stop, tally))
        })
        .collect();
    // Kill one replica at a time (SIGKILL) and bring it back on the same port.
    let chaos_for = Duration::from_secs(env_u64("KVLB_CHAOS_SECONDS", 12));
    let mut kills = 0;
    let t0 = Instant::now();
    while t0.elapsed() < chaos_for {
        std::thread::sleep(Duration::from_millis(700));
        let victim = kills % replicas.len();
        let port = replicas[victim].addr.port();
        replicas[victim].kill();
        kills += 1;
        std::thread::sleep(Duration::from_millis(500));
        replicas[victim] = SimReplica::start(port);
    }
    stop.store(true, Relaxed);
    for c in clients {
        c.join().expect("client thread");
    }
    let during = tally.line();
    let sent = tally.sent.load(Relaxed);
    let answered = tally.answered.load(Relaxed);
    let failed = tally.errored.load(Relaxed) + tally.cut.load(Relaxed);
    assert_eq!(tally.hanging.load(Relaxed), 0, "requests lost: {during}");
    assert_eq!(tally.unexpected.load(Relaxed), 0, "odd answers: {during}");
    assert_eq!(sent, answered + failed, "unaccounted requests: {during}");
    assert!(
        answered > sent / 2,
        "too few answered under chaos: {during}"
    );
    assert!(kills >= 5, "only {kills} replica kills");

    // All replicas back: everything is answered again, and kvlb holds no request.
    let after = Tally::default();
    std::thread::sleep(Duration::from_millis(1200)); // past the one-second skip of a refusing replica
    for i in 0..60 {
        let mut c = connect(kvlb.listen);
        after.sent.fetch_add(1, Relaxed);
        let body = completion_body(i, i % 3 == 0, 3);
        let outcome = c.request("POST", "/v1/completions", &[], body.as_bytes());
        after.record(&outcome);
    }
    assert_eq!(
        after.answered.load(Relaxed),
        60,
        "after the replicas came back: {}",
        after.line()
    );
    assert!(
        wait_until(Duration::from_secs(5), || metric(
            &kvlb,
            "kvlb_worker_in_flight",
            &[]
        ) == 0.0),
        "kvlb still counts requests in flight"
    );
    eprintln!(
        "chaos: {kills} replica kills in {chaos_for:?}: {during}; {:?} in all",
        started.elapsed()
    );
}

/// Mixed load for the soak: keep-alive and one-shot requests, streams, clients leaving
/// mid-stream, malformed requests.
fn soak_client(addr: SocketAddr, id: u64, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    let mut i = 0u64;
    while !stop.load(Relaxed) {
        i += 1;
        match (id + i) % 5 {
            0 | 1 => {
                // Keep-alive burst.
                let Ok(mut c) = try_connect(addr) else {
                    continue;
                };
                for j in 0..10 {
                    tally.sent.fetch_add(1, Relaxed);
                    let body = completion_body(i * 10 + j, j % 3 == 0, 3);
                    let outcome = c.request("POST", "/v1/completions", &[], body.as_bytes());
                    tally.record(&outcome);
                    if outcome.is_err() {
                        break;
                    }
                }
            }
            2 => {
                // One-shot with Connection: close.
                let Ok(mut c) = try_connect(addr) else {
                    continue;
                };
                tally.sent.fetch_add(1, Relaxed);
                let body = completion_body(i, false, 2);
                let outcome = c.request(
                    "POST",
                    "/v1/completions",
                    &[("Connection", "close")],
                    body.as_bytes(),
                );
                tally.record(&outcome);
            }
            3 => {
                // A stream the client leaves after its head.
                let Ok(mut c) = try_connect(addr) else {
                    continue;
                };
                let body = completion_body(i, true, 200);
                let _ = c.send_request("POST", "/v1/completions", &[], body.as_bytes());
                let _ = c.read_head();
            }
            _ => {
                // Malformed: Content-Length with Transfer-Encoding gets a 400.
                let Ok(mut c) = try_connect(addr) else {
                    continue;
                };
                let _ = c.send(
                    b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\
                      Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                );
                if let Ok(r) = c.read_response("POST") {
                    if r.status != 400 {
                        tally.unexpected.fetch_add(1, Relaxed);
                    }
                }
            }
        }
    }
}

#[test]
fn soak_keeps_memory_and_descriptors_flat() {
    let _one = serial();
    let started = Instant::now();
    let total = Duration::from_secs(env_u64("KVLB_SOAK_SECONDS", 60).max(20));
    let replicas: Vec<SimReplica> = (0..2).map(|_| SimReplica::start(0)).collect();
    let mut args = vec!["--workers", "2"];
    let urls: Vec<String> = replicas.iter().map(|r| r.url()).collect();
    for u in &urls {
        args.extend(["--replica", u.as_str()]);
    }
    let kvlb = Kvlb::serve(&args);
    let tally = Arc::new(Tally::default());

    // Load in rounds; between rounds the clients are gone and kvlb is measured at rest.
    let rounds = 6;
    let round = total / rounds;
    let mut samples = Vec::new();
    for r in 0..rounds {
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..6)
            .map(|id| {
                let (stop, tally) = (stop.clone(), tally.clone());
                let addr = kvlb.listen;
                std::thread::spawn(move || soak_client(addr, id + 10 * r as u64, stop, tally))
            })
            .collect();
        std::thread::sleep(round);
        stop.store(true, Relaxed);
        for c in clients {
            c.join().unwrap();
        }
        assert!(
            wait_until(Duration::from_secs(10), || metric(
                &kvlb,
                "kvlb_worker_connections",
                &[]
            ) == 0.0
                && metric(&kvlb, "kvlb_worker_in_flight", &[]) == 0.0),
            "kvlb did not come to rest after round {r}"
        );
        std::thread::sleep(Duration::from_millis(300));
        samples.push(rss_and_fds(kvlb.pid()));
    }
    let line = tally.line();
    assert_eq!(tally.hanging.load(Relaxed), 0, "{line}");
    assert_eq!(tally.unexpected.load(Relaxed), 0, "{line}");
    assert_eq!(
        tally.answered.load(Relaxed),
        tally.sent.load(Relaxed),
        "soak without faults: every request answered ({line})"
    );
    // Round 1 is the warm-up (pools and the residency index fill); compare the last with it.
    let (rss_warm, fds_warm) = samples[1];
    let (rss_end, fds_end) = *samples.last().unwrap();
    let shown: Vec<String> = samples
        .iter()
        .map(|(rss, fds)| format!("{} MiB/{fds} fds", rss >> 20))
        .collect();
    assert!(
        rss_end <= rss_warm + (rss_warm / 5).max(16 << 20),
        "RSS grew from {} to {} MiB: {shown:?}",
        rss_warm >> 20,
        rss_end >> 20
    );
    assert!(
        fds_end <= fds_warm + 24,
        "descriptors grew from {fds_warm} to {fds_end}: {shown:?}"
    );
    eprintln!(
        "soak {total:?}: {line}; at rest after each round: {shown:?}; {:?} in all",
        started.elapsed()
    );
}

#[test]
fn both_reuseport_workers_accept_and_report_their_counts() {
    let _one = serial();
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&["--replica", &url, "--workers", "2"]);
    // 40 requests held in flight on 40 connections, each from its own source port.
    let n = 40;
    let mut conns: Vec<HttpConn> = (0..n).map(|_| connect(kvlb.listen)).collect();
    for c in conns.iter_mut() {
        c.send_request("GET", "/slow?ms=1500", &[], b"").unwrap();
    }
    let text = || kvlb.admin_get("/metrics").body_text();
    assert!(
        wait_until(Duration::from_secs(5), || metric(
            &kvlb,
            "kvlb_worker_in_flight",
            &[]
        ) == n as f64),
        "in flight: {}",
        text()
    );
    let snapshot = text();
    for w in ["0", "1"] {
        let label = format!("worker=\"{w}\"");
        let per = |name: &str| metric_sum(&snapshot, name, &[&label]).unwrap_or(0.0);
        assert!(
            per("kvlb_worker_accepted_total") > 0.0
                && per("kvlb_worker_connections") > 0.0
                && per("kvlb_worker_in_flight") > 0.0,
            "worker {w} took no share of {n} connections:\n{snapshot}"
        );
    }
    assert_eq!(
        metric_sum(&snapshot, "kvlb_worker_accepted_total", &[]),
        Some(n as f64)
    );
    assert_eq!(
        metric_sum(&snapshot, "kvlb_worker_connections", &[]),
        Some(n as f64)
    );
    assert!(metric_sum(&snapshot, "kvlb_process_open_fds", &[]).unwrap_or(0.0) >= n as f64);
    assert!(metric_sum(&snapshot, "kvlb_process_resident_memory_bytes", &[]).unwrap_or(0.0) > 0.0);
    assert!(metric_sum(&snapshot, "kvlb_process_max_fds", &[]).unwrap_or(0.0) > 0.0);
    for c in conns.iter_mut() {
        assert_eq!(c.read_response("GET").unwrap().status, 200);
    }
    assert!(wait_until(Duration::from_secs(5), || metric(
        &kvlb,
        "kvlb_worker_in_flight",
        &[]
    ) == 0.0));
    drop(conns);
    assert!(wait_until(Duration::from_secs(5), || metric(
        &kvlb,
        "kvlb_worker_connections",
        &[]
    ) == 0.0));
}
