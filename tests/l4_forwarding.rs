//! The L4 mode of `kvlb serve` (`--mode l4`) end to end, on both forwarding paths (io_uring
//! splice and the BPF sockmap), with a real kvlb process, the Python test replica and raw
//! client sockets: byte-exact bulk transfers both ways, every request of a connection going to
//! the replica chosen for its first, half-close (also with the replica's last bytes in its FIN
//! segment), client and replica aborts releasing both sockets (checked in /proc/PID/fd) and the
//! sockmap entries, and the sockmap really in use.
//!
//! The sockmap tests need CAP_BPF (root here). Without it they skip with a message; as root a
//! sockmap that does not load fails them.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use support::{wait_until, Backend, HttpConn, Kvlb};

/// kvlb with one L4 listener forwarding by `forwarding`, one worker, in front of `backends`.
fn l4_proxy(forwarding: &str, backends: &[&Backend]) -> Kvlb {
    let urls: Vec<String> = backends.iter().map(|b| b.url()).collect();
    let mut args = vec![
        "--mode",
        "l4",
        "--l4-forwarding",
        forwarding,
        "--workers",
        "1",
    ];
    for u in &urls {
        args.push("--replica");
        args.push(u);
    }
    Kvlb::serve(&args)
}

/// Whether this test should run on `kvlb`'s sockmap path: true when the program loaded; false
/// (after saying why) when it could not for lack of privileges; panics when it could not as
/// root, where it must.
fn sockmap_ready(kvlb: &Kvlb) -> bool {
    let said = wait_until(Duration::from_secs(10), || {
        kvlb.stderr().contains("sockmap forwarding")
    });
    let log = kvlb.stderr();
    assert!(said, "kvlb said nothing about the sockmap program:\n{log}");
    if log.contains("sockmap forwarding ready") {
        return true;
    }
    // Safety: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: the sockmap program needs CAP_BPF (not root):\n{log}");
        return false;
    }
    panic!("running as root, yet the sockmap program did not load:\n{log}");
}

fn proxy_for(forwarding: &str, backends: &[&Backend]) -> Option<Kvlb> {
    let kvlb = l4_proxy(forwarding, backends);
    if forwarding == "sockmap" && !sockmap_ready(&kvlb) {
        return None;
    }
    Some(kvlb)
}

fn metric(kvlb: &Kvlb, name: &str, labels: &[&str]) -> f64 {
    kvlb.metric(name, labels)
        .unwrap_or_else(|| panic!("no {name} {labels:?} in /metrics"))
}

/// Random bytes (xorshift64*), different for each seed.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// (sockets, pipes) among a process's open descriptors.
fn fd_kinds(pid: u32) -> (usize, usize) {
    let mut sockets = 0;
    let mut pipes = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read /proc/PID/fd") {
        let Ok(e) = e else { continue };
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let t = target.to_string_lossy();
        if t.starts_with("socket:") {
            sockets += 1;
        } else if t.starts_with("pipe:") {
            pipes += 1;
        }
    }
    (sockets, pipes)
}

/// One request on a fresh connection, closed afterwards; waits until kvlb has let it go.
fn warm_up(kvlb: &Kvlb) {
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("GET", "/echo", &[], b"")
        .expect("warm-up request");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    drop(conn);
    wait_idle(kvlb, "after the warm-up request");
}

/// Waits until no L4 connection is joined (and the sockmap holds nothing).
fn wait_idle(kvlb: &Kvlb, when: &str) {
    let ok = wait_until(Duration::from_secs(10), || {
        metric(kvlb, "kvlb_l4_active_connections", &[]) == 0.0
            && metric(kvlb, "kvlb_l4_sockmap_sockets", &[]) == 0.0
            && metric(kvlb, "kvlb_l4_sockmap_peers", &[]) == 0.0
    });
    assert!(
        ok,
        "{when}: L4 connections or sockmap entries remain:\n{}\nkvlb stderr:\n{}",
        kvlb.admin_get("/metrics")
            .body_text()
            .lines()
            .filter(|l| l.starts_with("kvlb_l4"))
            .collect::<Vec<_>>()
            .join("\n"),
        kvlb.stderr()
    );
}

fn byte_exact_64mib_each_way(forwarding: &str) {
    let backend = Backend::start();
    let Some(kvlb) = proxy_for(forwarding, &[&backend]) else {
        return;
    };
    let body = random_bytes(64 << 20, 7);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.set_read_timeout(Duration::from_secs(60));
    let resp = conn
        .request("POST", "/echo", &[], &body)
        .unwrap_or_else(|e| panic!("64 MiB echo failed: {e}\nkvlb stderr:\n{}", kvlb.stderr()));
    assert_eq!(resp.status, 200, "{}", resp.describe());
    assert_eq!(resp.header("x-got-body-len"), Some("67108864"));
    assert!(
        resp.body == body,
        "the 64 MiB body came back different ({} bytes)",
        resp.body.len()
    );
    // A second exchange on the same joined connection: the stream stays in step.
    let small = random_bytes(1000, 8);
    let resp = conn.request("POST", "/echo", &[], &small).unwrap();
    assert_eq!(resp.body, small);
    drop(conn);
    wait_idle(&kvlb, "after the 64 MiB exchange");
    let joined = metric(&kvlb, "kvlb_l4_connections_total", &[forwarding]);
    assert_eq!(joined, 1.0, "the connection was not joined by {forwarding}");
    // Per replica: what kvlb sent itself before the join plus what the join moved.
    let up = metric(&kvlb, "kvlb_bytes_total", &["to_replica"]);
    let down = metric(&kvlb, "kvlb_bytes_total", &["from_replica"]);
    assert!(
        up >= (64 << 20) as f64 && down >= (64 << 20) as f64,
        "{forwarding} moved {up} bytes up and {down} down"
    );
    assert!(metric(&kvlb, "kvlb_l4_bytes_total", &["to_client"]) >= (64 << 20) as f64);
}

#[test]
fn splice_moves_64mib_each_way_byte_exact() {
    byte_exact_64mib_each_way("splice");
}

#[test]
fn sockmap_moves_64mib_each_way_byte_exact() {
    byte_exact_64mib_each_way("sockmap");
}

fn requests_follow_the_first(forwarding: &str) {
    let a = Backend::start();
    let b = Backend::start();
    let Some(kvlb) = proxy_for(forwarding, &[&a, &b]) else {
        return;
    };
    let before = (a.stats().requests, b.stats().requests);
    let mut conn = HttpConn::connect(kvlb.listen);
    for i in 1..=6u64 {
        let body = random_bytes(100 * i as usize, i);
        let resp = conn.request("POST", "/echo", &[], &body).unwrap();
        assert_eq!(resp.status, 200, "request {i}: {}", resp.describe());
        assert_eq!(resp.body, body, "request {i}");
        // One replica connection carried them all, in order.
        assert_eq!(
            resp.header("x-got-connection-count"),
            Some(i.to_string().as_str()),
            "request {i}: {}",
            resp.describe()
        );
    }
    drop(conn);
    // The stats calls count themselves: one each.
    let got = (
        a.stats().requests - before.0 - 1,
        b.stats().requests - before.1 - 1,
    );
    assert!(
        got == (6, 0) || got == (0, 6),
        "the six requests of one L4 connection were split between replicas: {got:?}"
    );
    wait_idle(&kvlb, "after the connection closed");
}

#[test]
fn splice_sends_every_request_to_the_first_ones_replica() {
    requests_follow_the_first("splice");
}

#[test]
fn sockmap_sends_every_request_to_the_first_ones_replica() {
    requests_follow_the_first("sockmap");
}

/// One joined connection whose messages switch each direction between copying (small reads,
/// a multishot receive armed) and splicing (bulk) and back, again and again: every echo must
/// come back whole and in order, so no byte the receive still held when a direction switched
/// to splice is lost, duplicated or reordered.
#[test]
fn splice_switches_between_copying_and_splicing_byte_exact() {
    let backend = Backend::start();
    let Some(kvlb) = proxy_for("splice", &[&backend]) else {
        return;
    };
    let mut conn = HttpConn::connect(kvlb.listen);
    let sizes = [
        100,
        300 * 1024,
        200,
        2 << 20,
        50,
        20 * 1024,
        10,
        16 * 1024,
        16 * 1024 - 1,
        1 << 20,
        5,
    ];
    for (i, &len) in sizes.iter().enumerate() {
        let body = random_bytes(len, 1000 + i as u64);
        let resp = conn.request("POST", "/echo", &[], &body).unwrap();
        assert_eq!(
            resp.status,
            200,
            "message {i} ({len} bytes): {}",
            resp.describe()
        );
        assert!(
            resp.body == body,
            "message {i} ({len} bytes) came back altered ({} bytes)",
            resp.body.len()
        );
    }
    drop(conn);
    wait_idle(&kvlb, "after the connection closed");
}

fn half_close(forwarding: &str) {
    let backend = Backend::start();
    let Some(kvlb) = proxy_for(forwarding, &[&backend]) else {
        return;
    };
    // The client half-closes after the join: its FIN must reach the replica, which answers
    // and closes; the answer and then the end must reach the client.
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn.request("POST", "/echo", &[], b"first").unwrap();
    assert_eq!(resp.body, b"first");
    conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nsecond")
        .unwrap();
    conn.shutdown_write();
    let rest = conn.read_until_close().unwrap_or_else(|e| {
        panic!(
            "after the client's half-close the response or the end did not arrive: {e}\nkvlb stderr:\n{}",
            kvlb.stderr()
        )
    });
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.starts_with("HTTP/1.1 200") && text.ends_with("second"),
        "{text}"
    );
    drop(conn);

    // The client half-closes together with its first request (before any join).
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nearly")
        .unwrap();
    conn.shutdown_write();
    let rest = conn.read_until_close().unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.starts_with("HTTP/1.1 200") && text.ends_with("early"),
        "{text}"
    );
    drop(conn);

    // The replica closes first (a close-delimited response): the client sees the end.
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /close?size=100000 HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let rest = conn.read_until_close().unwrap();
    assert!(rest.len() > 100_000, "{} bytes", rest.len());
    drop(conn);
    wait_idle(&kvlb, "after the half-closed connections");
    assert_eq!(metric(&kvlb, "kvlb_l4_aborted_connections_total", &[]), 0.0);
}

#[test]
fn splice_passes_half_close_on() {
    half_close("splice");
}

#[test]
fn sockmap_passes_half_close_on() {
    half_close("sockmap");
}

/// The replica's last bytes come in one segment with its FIN (TCP reports that end before it
/// hands the segment's data on): the bytes must reach the client before the end does.
fn body_with_fin(forwarding: &str) {
    let backend = Backend::start();
    let Some(kvlb) = proxy_for(forwarding, &[&backend]) else {
        return;
    };
    for i in 0..50 {
        let mut conn = HttpConn::connect(kvlb.listen);
        let resp = conn.request("POST", "/echo", &[], b"first").unwrap();
        assert_eq!(resp.body, b"first");
        conn.send(
            b"POST /echo?fin_with_body=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nsecond",
        )
        .unwrap();
        conn.shutdown_write();
        let rest = conn.read_until_close().unwrap();
        let text = String::from_utf8_lossy(&rest);
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("second"),
            "connection {i}: {text}"
        );
    }
    wait_idle(&kvlb, "after the connections");
    assert_eq!(metric(&kvlb, "kvlb_l4_aborted_connections_total", &[]), 0.0);
}

#[test]
fn splice_passes_a_body_that_shares_its_segment_with_the_fin() {
    body_with_fin("splice");
}

#[test]
fn sockmap_passes_a_body_that_shares_its_segment_with_the_fin() {
    body_with_fin("sockmap");
}

/// The process's sockets once idle, before the test's own connections.
fn idle_sockets(kvlb: &Kvlb) -> usize {
    warm_up(kvlb);
    fd_kinds(kvlb.pid()).0
}

fn wait_sockets(kvlb: &Kvlb, baseline: usize, when: &str) {
    wait_idle(kvlb, when);
    let ok = wait_until(Duration::from_secs(10), || {
        fd_kinds(kvlb.pid()).0 <= baseline
    });
    assert!(
        ok,
        "{when}: kvlb holds {} sockets, {baseline} when idle",
        fd_kinds(kvlb.pid()).0
    );
    let pipes = fd_kinds(kvlb.pid()).1;
    assert!(pipes <= 8, "{when}: kvlb holds {pipes} pipe ends");
}

fn client_abort(forwarding: &str) {
    let backend = Backend::start();
    let Some(kvlb) = proxy_for(forwarding, &[&backend]) else {
        return;
    };
    let baseline = idle_sockets(&kvlb);
    let aborted_before = backend.stats().aborted;

    // Mid-stream: the client goes away while the replica keeps sending events.
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /sse?n=100000&interval_ms=2 HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (got, closed) = conn.read_for(Duration::from_millis(300));
    assert!(!closed && got.len() > 100, "no stream: {got:?}");
    assert_eq!(metric(&kvlb, "kvlb_l4_active_connections", &[]), 1.0);
    drop(conn);
    wait_sockets(&kvlb, baseline, "after the client left mid-stream");

    // While the replica is still thinking: the replica must learn the client left.
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(conn);
    wait_sockets(&kvlb, baseline, "after the client left a pending request");
    let ok = wait_until(Duration::from_secs(10), || {
        backend.stats().aborted >= aborted_before + 2
    });
    assert!(
        ok,
        "the replica did not see both clients leave: {:?}",
        backend.stats()
    );
}

#[test]
fn splice_client_abort_releases_both_sockets() {
    client_abort("splice");
}

#[test]
fn sockmap_client_abort_releases_both_sockets_and_entries() {
    client_abort("sockmap");
}

fn replica_abort(forwarding: &str) {
    let mut backend = Backend::start();
    let Some(kvlb) = proxy_for(forwarding, &[&backend]) else {
        return;
    };
    let baseline = idle_sockets(&kvlb);
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GET /die?after=headers HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (got, closed) = conn.read_for(Duration::from_secs(10));
    let text = String::from_utf8_lossy(&got);
    assert!(
        closed && text.starts_with("HTTP/1.1 200") && text.ends_with("partial body"),
        "the client should get the partial answer, then the end: closed={closed} {text:?}\nkvlb stderr:\n{}",
        kvlb.stderr()
    );
    assert!(
        wait_until(Duration::from_secs(5), || !backend.is_running()),
        "backend did not die"
    );
    drop(conn);
    wait_sockets(&kvlb, baseline, "after the replica died");
}

#[test]
fn splice_replica_abort_releases_both_sockets() {
    replica_abort("splice");
}

#[test]
fn sockmap_replica_abort_releases_both_sockets_and_entries() {
    replica_abort("sockmap");
}

#[test]
fn sockmap_is_really_used_when_selected() {
    let backend = Backend::start();
    let Some(kvlb) = proxy_for("sockmap", &[&backend]) else {
        return;
    };
    let loaded = kvlb
        .admin_get("/metrics")
        .body_text()
        .lines()
        .find(|l| l.starts_with("kvlb_l4_sockmap_loaded{"))
        .map(String::from)
        .expect("kvlb_l4_sockmap_loaded in /metrics");
    assert!(loaded.ends_with(" 1"), "{loaded}");
    let id: u32 = loaded
        .split("program_id=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .and_then(|s| s.parse().ok())
        .expect("program id");
    assert!(id > 0, "{loaded}");
    // The kernel agrees, when bpftool is there to ask.
    if let Ok(out) = std::process::Command::new("bpftool")
        .args(["prog", "show", "id", &id.to_string()])
        .output()
    {
        if out.status.success() {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("sk_skb"), "bpftool prog show id {id}: {text}");
        }
    }

    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn.request("POST", "/echo", &[], b"joined").unwrap();
    assert_eq!(resp.body, b"joined");
    // While the connection is open the pair is in the maps.
    assert_eq!(metric(&kvlb, "kvlb_l4_sockmap_sockets", &[]), 2.0);
    assert_eq!(metric(&kvlb, "kvlb_l4_sockmap_peers", &[]), 2.0);
    assert_eq!(
        metric(&kvlb, "kvlb_l4_connections_total", &["sockmap"]),
        1.0
    );
    // A second request moves through the kernel only: the program counts its bytes.
    let body = random_bytes(300_000, 3);
    let resp = conn.request("POST", "/echo", &[], &body).unwrap();
    assert!(resp.body == body);
    drop(conn);
    wait_idle(&kvlb, "after the sockmap connection closed");
    let up = metric(&kvlb, "kvlb_l4_bytes_total", &["to_replica"]);
    let down = metric(&kvlb, "kvlb_l4_bytes_total", &["to_client"]);
    assert!(
        up >= 300_000.0 && down >= 300_000.0,
        "the program redirected {up} bytes up and {down} down"
    );
    assert_eq!(metric(&kvlb, "kvlb_l4_connections_total", &["splice"]), 0.0);
}

#[test]
fn l4_routes_prompts_like_l7_and_answers_errors() {
    let a = Backend::start();
    let kvlb = l4_proxy("splice", &[&a]);
    // A malformed first request gets kvlb's own answer, as on the L7 path.
    let mut conn = HttpConn::connect(kvlb.listen);
    conn.send(b"GARBAGE\r\n\r\n").unwrap();
    let rest = conn.read_until_close().unwrap();
    assert!(
        rest.starts_with(b"HTTP/1.1 400"),
        "{:?}",
        String::from_utf8_lossy(&rest)
    );
    // A chat prompt is hashed and routed by the policy (a decision is counted).
    let body =
        br#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":4}"#;
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("POST", "/v1/chat/completions", &[], body)
        .unwrap();
    assert_eq!(resp.status, 404, "{}", resp.describe());
    let decided: f64 = ["cache", "load", "fallback"]
        .iter()
        .map(|r| kvlb.metric("kvlb_decisions_total", &[r]).unwrap_or(0.0))
        .sum();
    assert!(decided >= 1.0, "no routing decision counted");
    // A replica that refuses connections: 502 naming it.
    drop(a);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn.request("GET", "/echo", &[], b"").unwrap();
    assert_eq!(resp.status, 502, "{}", resp.describe());
}

#[test]
fn file_listeners_mix_l7_and_l4() {
    let backend = Backend::start();
    let dir = support::TempDir::new("l4-config");
    let file = dir.file("kvlb.toml");
    std::fs::write(
        &file,
        format!(
            "listen = [\"127.0.0.1:0\"]\nworkers = 1\nl4_forwarding = \"splice\"\n\
             [[listener]]\naddress = \"127.0.0.1:0\"\nmode = \"l4\"\n\
             [[replica]]\nurl = \"{}\"\n",
            backend.url()
        ),
    )
    .unwrap();
    let path = file.to_string_lossy().to_string();
    let kvlb = Kvlb::serve_raw(&["--config", &path, "--admin", "127.0.0.1:0"]);
    assert_eq!(kvlb.listeners.len(), 2, "{}", kvlb.stderr());
    // The L7 listener rewrites the answer (x-kvlb-replica); the L4 one passes it as it came.
    let l7 = support::client::get(kvlb.listeners[0], "/echo");
    assert!(l7.header("x-kvlb-replica").is_some(), "{}", l7.describe());
    let l4 = support::client::get(kvlb.listeners[1], "/echo");
    assert_eq!(l4.status, 200, "{}", l4.describe());
    assert!(l4.header("x-kvlb-replica").is_none(), "{}", l4.describe());
    assert!(l4.header("server").is_some(), "{}", l4.describe());
    wait_idle(&kvlb, "after the two requests");
    assert_eq!(metric(&kvlb, "kvlb_l4_connections_total", &["splice"]), 1.0);
}

#[test]
fn drain_closes_waiting_l4_connections_and_waits_for_joined_ones() {
    let backend = Backend::start();
    let mut kvlb = Kvlb::serve(&[
        "--mode",
        "l4",
        "--workers",
        "1",
        "--drain-timeout",
        "2s",
        "--replica",
        &backend.url(),
    ]);
    let mut joined = HttpConn::connect(kvlb.listen);
    let resp = joined.request("GET", "/echo", &[], b"").unwrap();
    assert_eq!(resp.status, 200);
    let mut waiting = HttpConn::connect(kvlb.listen);
    std::thread::sleep(Duration::from_millis(100));
    let started = std::time::Instant::now();
    kvlb.terminate();
    // A connection that has not sent its first request is closed at once.
    let (_, closed) = waiting.read_for(Duration::from_secs(1));
    assert!(
        closed,
        "the waiting connection stayed open during the drain"
    );
    // A joined connection keeps working until the drain deadline.
    let resp = joined.request("GET", "/echo", &[], b"").unwrap();
    assert_eq!(
        resp.status, 200,
        "the joined connection stopped during the drain"
    );
    let status = kvlb.wait_exit(Duration::from_secs(10));
    assert!(
        matches!(status, Some(s) if s.success()),
        "kvlb did not exit 0 after the drain: {status:?}\n{}",
        kvlb.stderr()
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(8),
        "drain took {took:?} with a joined connection and a 2 s drain timeout"
    );
}

/// kvlb run as `nobody` (setpriv), killed on drop.
struct Unprivileged {
    child: std::process::Child,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Drop for Unprivileged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn sockmap_without_privileges_falls_back_to_splice_with_one_line() {
    use std::io::BufRead;
    // Safety: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: dropping privileges to check the fallback needs root");
        return;
    }
    let backend = Backend::start();
    let url = backend.url();
    let spawned = std::process::Command::new("setpriv")
        .args(["--reuid", "nobody", "--regid", "nogroup", "--clear-groups"])
        .arg(support::proxy::kvlb_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--mode",
            "l4",
            "--l4-forwarding",
            "sockmap",
            "--workers",
            "2",
            "--replica",
            &url,
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = spawned else {
        eprintln!("skipped: setpriv (util-linux) is not installed");
        return;
    };
    let stderr = child.stderr.take().unwrap();
    let kvlb = Unprivileged {
        child,
        log: Default::default(),
    };
    let log = kvlb.log.clone();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let mut l = log.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
    });
    let text = || kvlb.log.lock().unwrap().clone();
    assert!(
        wait_until(Duration::from_secs(20), || text().contains("kvlb: ready")
            && text().contains("sockmap forwarding")),
        "kvlb as nobody did not start:\n{}",
        text()
    );
    let listen: std::net::SocketAddr = text()
        .lines()
        .find_map(|l| l.strip_prefix("kvlb: listening on "))
        .and_then(|a| a.trim().parse().ok())
        .expect("listening line");
    for i in 0..4 {
        let mut conn = HttpConn::connect(listen);
        let resp = conn.request("POST", "/echo", &[], b"fallback").unwrap();
        assert_eq!(resp.body, b"fallback", "request {i}");
    }
    let log = text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("sockmap forwarding unavailable"))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "expected one clear line about the fallback, got:\n{log}"
    );
    assert!(
        lines[0].contains("L4 connections use splice") && lines[0].contains("not permitted"),
        "{}",
        lines[0]
    );
}
