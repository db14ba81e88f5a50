//! The systemd unit in `systemd/kvlb.service` and kvlb's side of `Type=notify`:
//! - the unit passes `systemd-analyze verify` without a warning (with ExecStart pointed at the
//!   binary under test, since verify checks that it exists) and `systemd-analyze security`
//!   rates its exposure low;
//! - its SystemCallFilter allows every system call a serving kvlb makes (traced with strace
//!   while it serves requests, scrapes /metrics and drains), io_uring's included;
//! - kvlb sends READY=1 once it serves, RELOADING=1 then READY=1 on SIGHUP, and STOPPING=1 on
//!   SIGTERM to the datagram socket named by NOTIFY_SOCKET (a path or an abstract name), as
//!   systemd would receive them.
//!
//! Needs `systemd-analyze` (Debian package `systemd`) and `strace`; `tests/run.sh` installs both.

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::proxy::{kvlb_bin, wait_timeout};
use support::{client, Backend, TempDir};

fn unit_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/kvlb.service")
}

fn unit_text() -> String {
    std::fs::read_to_string(unit_path()).expect("read systemd/kvlb.service")
}

fn need_tool(name: &str, package: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        found,
        "{name} not found: install the Debian package `{package}` (tests/run.sh does)"
    );
}

/// The unit with ExecStart running the binary under test, written to `dir`.
fn unit_for_test(dir: &TempDir) -> PathBuf {
    let text = unit_text().replace("/usr/local/bin/kvlb", kvlb_bin());
    assert!(
        text.contains(kvlb_bin()),
        "unit has no ExecStart to rewrite"
    );
    let path = dir.file("kvlb.service");
    std::fs::write(&path, text).expect("write unit copy");
    path
}

#[test]
fn unit_passes_systemd_analyze_verify_without_warnings() {
    need_tool("systemd-analyze", "systemd");
    let dir = TempDir::new("unit-verify");
    let unit = unit_for_test(&dir);
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
        .expect("run systemd-analyze verify");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "systemd-analyze verify failed ({}):\n{said}",
        out.status
    );
    // verify exits 0 on unknown keys and bad values and only warns: any output is a finding.
    assert!(
        said.trim().is_empty(),
        "systemd-analyze verify warns:\n{said}"
    );

    // A unit with a misspelt key must make verify speak, or the check above proves nothing.
    let bad = dir.file("kvlb-bad.service");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&unit)
            .unwrap()
            .replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&bad)
        .output()
        .expect("run systemd-analyze verify");
    assert!(
        !out.stderr.is_empty() || !out.status.success(),
        "systemd-analyze verify did not notice an unknown key"
    );
}

#[test]
fn unit_is_typed_notify_with_reload_and_limits() {
    let text = unit_text();
    for line in [
        "Type=notify",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "LimitNOFILE=1048576",
        "LimitMEMLOCK=infinity",
        "DynamicUser=yes",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ] {
        assert!(
            text.lines().any(|l| l.trim() == line),
            "systemd/kvlb.service lacks `{line}`"
        );
    }
    let caps: BTreeSet<&str> = directive_values(&text, "CapabilityBoundingSet")
        .into_iter()
        .flat_map(|v| v.split_whitespace())
        .collect();
    let allowed: BTreeSet<&str> = ["CAP_NET_BIND_SERVICE", "CAP_BPF", "CAP_NET_ADMIN"].into();
    assert!(
        caps.is_subset(&allowed) && !caps.is_empty(),
        "capability bounding set {caps:?} goes beyond {allowed:?}"
    );
}

#[test]
fn unit_security_exposure_is_low() {
    need_tool("systemd-analyze", "systemd");
    let dir = TempDir::new("unit-security");
    let unit = unit_for_test(&dir);
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&unit)
        .output()
        .expect("run systemd-analyze security");
    let text = String::from_utf8_lossy(&out.stdout);
    let exposure: f64 = text
        .lines()
        .find_map(|l| l.split("Overall exposure level for kvlb.service: ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no overall exposure in systemd-analyze security output:\n{text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    // 0 is sealed, 10 is unprotected; "OK" ends at 4.9. The unit scores 2.0 on systemd 252.
    assert!(exposure <= 3.0, "exposure {exposure} > 3.0:\n{text}");
}

/// Every value of `key=` in the unit text, in order.
fn directive_values<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
        .collect()
}

/// The system calls a group (e.g. `@system-service`) expands to, nested groups included.
fn expand_group(group: &str, seen: &mut BTreeSet<String>, out: &mut BTreeSet<String>) {
    if !seen.insert(group.to_string()) {
        return;
    }
    let listing = Command::new("systemd-analyze")
        .args(["syscall-filter", "--no-pager", group])
        .output()
        .expect("run systemd-analyze syscall-filter");
    assert!(
        listing.status.success(),
        "systemd-analyze syscall-filter {group}: {}",
        String::from_utf8_lossy(&listing.stderr)
    );
    let text = String::from_utf8_lossy(&listing.stdout);
    for line in text.lines().skip(1) {
        let entry = line.trim();
        if entry.is_empty() || entry.starts_with('#') {
            continue;
        }
        if entry.starts_with('@') {
            expand_group(entry, seen, out);
        } else {
            out.insert(entry.to_string());
        }
    }
}

/// The set of system calls the unit's SystemCallFilter= lines allow (allow lists added up,
/// then `~` deny lists taken away, which is what systemd does with them in this order).
fn allowed_syscalls(unit: &str) -> BTreeSet<String> {
    let mut allow = BTreeSet::new();
    let mut deny = BTreeSet::new();
    for value in directive_values(unit, "SystemCallFilter") {
        let (negated, list) = match value.strip_prefix('~') {
            Some(rest) => (true, rest),
            None => (false, value),
        };
        let target = if negated { &mut deny } else { &mut allow };
        for item in list.split_whitespace() {
            if item.starts_with('@') {
                expand_group(item, &mut BTreeSet::new(), target);
            } else {
                target.insert(item.to_string());
            }
        }
    }
    assert!(
        !allow.is_empty(),
        "the unit has no SystemCallFilter allow list"
    );
    allow.difference(&deny).cloned().collect()
}

/// A child process killed and reaped on drop.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads a `kvlb serve` child's stderr on a thread; returns (listener, admin) once ready.
fn wait_ready(child: &mut Child, log: &mpsc::Receiver<String>) -> (SocketAddr, SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut listen, mut admin) = (None, None);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match log.recv_timeout(left) {
            Ok(line) => {
                if let Some(a) = line.strip_prefix("kvlb: listening on ") {
                    listen.get_or_insert(a.trim().parse().unwrap());
                } else if let Some(a) = line.strip_prefix("kvlb: admin on ") {
                    admin = Some(a.trim().parse().unwrap());
                } else if line.starts_with("kvlb: ready") {
                    return (listen.expect("listener line"), admin.expect("admin line"));
                }
                seen.push(line);
            }
            Err(_) => panic!(
                "kvlb did not become ready (exit {:?}); stderr:\n{}",
                child.try_wait(),
                seen.join("\n")
            ),
        }
    }
}

fn stderr_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    rx
}

fn sigterm(pid: u32) {
    // Safety: kill(2) on a child process we spawned and have not reaped.
    let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill(SIGTERM)");
}

/// Receives datagrams until one contains `want` or `limit` passes; returns all received.
fn recv_until(sock: &UnixDatagram, want: &str, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match sock.recv(&mut buf) {
            Ok(n) => {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                let done = msg.lines().any(|l| l == want);
                got.push(msg);
                if done {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    got
}

/// Runs `kvlb serve` with NOTIFY_SOCKET=`notify_name` and checks READY=1, a served request,
/// RELOADING=1 then READY=1 on SIGHUP, then STOPPING=1 and exit 0 on SIGTERM.
fn check_notify(sock: &UnixDatagram, notify_name: &str) {
    let backend = Backend::start();
    let url = backend.url();
    let child = Command::new(kvlb_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--workers", "2", "--replica", &url])
        .env("NOTIFY_SOCKET", notify_name)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvlb");
    let mut kvlb = Reaped(child);
    let log = stderr_lines(&mut kvlb.0);
    let (listen, _admin) = wait_ready(&mut kvlb.0, &log);
    let got = recv_until(sock, "READY=1", Duration::from_secs(10));
    assert!(
        got.iter().any(|m| m.lines().any(|l| l == "READY=1")),
        "no READY=1 on {notify_name}; got {got:?}"
    );
    assert!(
        !got.iter().any(|m| m.contains("STOPPING=1")),
        "STOPPING before SIGTERM: {got:?}"
    );
    let resp = client::get(listen, "/echo");
    assert_eq!(resp.status, 200, "{}", resp.describe());

    // SIGHUP (systemctl reload): RELOADING=1 with the monotonic time systemd asks for, then
    // READY=1 once the reload is applied; still serving.
    // Safety: kill(2) on a child process we spawned and have not reaped.
    assert_eq!(
        unsafe { libc::kill(kvlb.0.id() as libc::pid_t, libc::SIGHUP) },
        0
    );
    let got = recv_until(sock, "READY=1", Duration::from_secs(10));
    let reloading = got
        .iter()
        .position(|m| m.lines().any(|l| l == "RELOADING=1"));
    let ready = got.iter().rposition(|m| m.lines().any(|l| l == "READY=1"));
    assert!(
        matches!((reloading, ready), (Some(r), Some(d)) if r <= d),
        "no RELOADING=1 then READY=1 after SIGHUP; got {got:?}"
    );
    assert!(
        got.iter().any(|m| m
            .lines()
            .any(|l| l.starts_with("MONOTONIC_USEC=") && l.len() > 15)),
        "RELOADING without MONOTONIC_USEC: {got:?}"
    );
    let resp = client::get(listen, "/echo");
    assert_eq!(resp.status, 200, "after reload: {}", resp.describe());

    sigterm(kvlb.0.id());
    let got = recv_until(sock, "STOPPING=1", Duration::from_secs(10));
    assert!(
        got.iter().any(|m| m.lines().any(|l| l == "STOPPING=1")),
        "no STOPPING=1 after SIGTERM; got {got:?}"
    );
    let status = wait_timeout(&mut kvlb.0, Duration::from_secs(15));
    assert!(
        status.map(|s| s.success()).unwrap_or(false),
        "kvlb exit after SIGTERM: {status:?}"
    );
}

#[test]
fn notify_socket_path_gets_ready_then_stopping() {
    let dir = TempDir::new("notify");
    let path = dir.file("notify.sock");
    let sock = UnixDatagram::bind(&path).expect("bind notify socket");
    check_notify(&sock, path.to_str().unwrap());
}

#[test]
fn notify_abstract_socket_gets_ready_then_stopping() {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("kvlb-test-notify-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let sock = UnixDatagram::bind_addr(&addr).expect("bind abstract notify socket");
    check_notify(&sock, &format!("@{name}"));
}

#[test]
fn syscall_filter_allows_every_system_call_kvlb_makes() {
    need_tool("systemd-analyze", "systemd");
    need_tool("strace", "strace");
    let allowed = allowed_syscalls(&unit_text());
    for s in ["io_uring_setup", "io_uring_enter", "io_uring_register"] {
        assert!(allowed.contains(s), "the unit's filter refuses {s}");
    }

    let dir = TempDir::new("strace");
    let summary = dir.file("strace.txt");
    let notify = dir.file("notify.sock");
    let _notify_sock = UnixDatagram::bind(&notify).expect("bind notify socket");
    let backend = Backend::start();
    let url = backend.url();
    let child = Command::new("strace")
        .args(["-f", "-qq", "--summary-only", "-o"])
        .arg(&summary)
        .arg("--")
        .arg(kvlb_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--workers", "2", "--replica", &url])
        .env("NOTIFY_SOCKET", &notify)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn strace kvlb serve");
    let mut strace = Reaped(child);
    let log = stderr_lines(&mut strace.0);
    let (listen, admin) = wait_ready(&mut strace.0, &log);
    // Serve: new and reused upstream connections, a POST with a body, /metrics and /replicas.
    for i in 0..20 {
        let mut conn = support::HttpConn::connect(listen);
        for j in 0..3 {
            let body = format!(r#"{{"model":"m","prompt":"request {i} {j}"}}"#);
            let resp = conn
                .request("POST", "/v1/completions", &[], body.as_bytes())
                .expect("request through traced kvlb");
            // The test backend has no /v1/completions: its 404 comes back through kvlb,
            // after the prompt was extracted and routed.
            assert!(
                resp.status == 404 && resp.header("x-kvlb-replica").is_some(),
                "{}",
                resp.describe()
            );
        }
    }
    assert_eq!(client::get(admin, "/metrics").status, 200);
    assert_eq!(client::get(admin, "/replicas").status, 200);

    // SIGTERM kvlb itself (strace's child): it drains and exits, then strace writes the summary.
    let kvlb_pid = std::fs::read_to_string(format!(
        "/proc/{}/task/{}/children",
        strace.0.id(),
        strace.0.id()
    ))
    .expect("read strace's children")
    .split_whitespace()
    .next()
    .and_then(|p| p.parse::<u32>().ok())
    .expect("kvlb pid under strace");
    sigterm(kvlb_pid);
    let status = wait_timeout(&mut strace.0, Duration::from_secs(30));
    assert!(
        status.map(|s| s.success()).unwrap_or(false),
        "strace kvlb serve exit: {status:?}"
    );

    // "% time     seconds  usecs/call     calls    errors syscall" rows; the name is last.
    let text = std::fs::read_to_string(&summary).expect("read strace summary");
    let made: BTreeSet<String> = text
        .lines()
        .filter(|l| {
            l.trim_start()
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit())
        })
        .filter_map(|l| l.split_whitespace().last())
        .filter(|name| *name != "total")
        .map(str::to_string)
        .collect();
    assert!(
        made.contains("io_uring_enter"),
        "the trace shows no io_uring_enter; summary:\n{text}"
    );
    let refused: Vec<&String> = made.difference(&allowed).collect();
    assert!(
        refused.is_empty(),
        "system calls kvlb makes that systemd/kvlb.service's SystemCallFilter refuses: \
         {refused:?}\n(all made: {made:?})"
    );
}
