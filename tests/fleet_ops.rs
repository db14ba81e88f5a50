//! Operating the fleet while serving: reload (SIGHUP and the admin API), adding, draining and
//! removing replicas by the admin API (bearer token), retries on connect failure and immediate
//! 503, passive ejection, active health checks. Real processes, real sockets.

#[path = "support/mod.rs"]
mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use support::{wait_until, Backend, HttpConn, Kvlb, TempDir};

const TOKEN: &str = "test-admin-token-0123456789";

/// A raw admin request; returns (status, body).
fn admin(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect admin");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: admin\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}

fn backend_get(b: &Backend, path: &str) {
    let r = support::client::get(b.addr, path);
    assert_eq!(r.status, 200, "backend {path}: {}", r.describe());
}

/// The replica that answered a GET /echo through kvlb.
fn served_by(kvlb: &Kvlb, conn: &mut HttpConn) -> String {
    let r = conn
        .request("GET", "/echo", &[], b"")
        .unwrap_or_else(|e| panic!("request through kvlb: {e}\nkvlb stderr:\n{}", kvlb.stderr()));
    assert_eq!(
        r.status,
        200,
        "{}\nkvlb stderr:\n{}",
        r.describe(),
        kvlb.stderr()
    );
    r.header("x-kvlb-replica").unwrap_or("").to_string()
}

fn replicas_json(kvlb: &Kvlb) -> serde_json::Value {
    kvlb.admin_get("/replicas").json().expect("/replicas JSON")
}

fn replica_urls(kvlb: &Kvlb) -> Vec<String> {
    replicas_json(kvlb)["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["url"].as_str().unwrap().to_string())
        .collect()
}

/// kvlb over two replicas, round robin on one worker, active health checks off, plus `extra`.
fn pair(a: &str, b: &str, extra: &[&str]) -> Kvlb {
    let mut args = vec![
        "--replica",
        a,
        "--replica",
        b,
        "--policy",
        "round_robin",
        "--workers",
        "1",
        "--health-interval",
        "0",
    ];
    args.extend_from_slice(extra);
    Kvlb::serve(&args)
}

fn sighup(kvlb: &Kvlb) {
    // Safety: kill(2) on our own child's pid (not reaped while `kvlb` lives).
    assert_eq!(
        unsafe { libc::kill(kvlb.pid() as libc::pid_t, libc::SIGHUP) },
        0
    );
}

/// Clients requesting in a loop over keep-alive connections until stopped; counts failures.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<std::sync::Mutex<Vec<String>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(addr: SocketAddr, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let threads = (0..clients)
            .map(|_| {
                let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
                std::thread::spawn(move || {
                    let mut conn = HttpConn::connect(addr);
                    while !stop.load(Relaxed) {
                        match conn.request("POST", "/echo", &[], b"{\"prompt\": \"hello\"}") {
                            Ok(r) if r.status == 200 => {
                                ok.fetch_add(1, Relaxed);
                                if r.says_close() {
                                    conn = HttpConn::connect(addr);
                                }
                            }
                            Ok(r) => {
                                failed.lock().unwrap().push(r.describe());
                                conn = HttpConn::connect(addr);
                            }
                            Err(e) => {
                                failed.lock().unwrap().push(e.to_string());
                                conn = HttpConn::connect(addr);
                            }
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                })
            })
            .collect();
        Load {
            stop,
            ok,
            failed,
            threads,
        }
    }

    /// Stop and return (answered, failures).
    fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        let failed = self.failed.lock().unwrap().clone();
        (self.ok.load(Relaxed), failed)
    }
}

#[test]
fn sighup_reload_changes_replicas_and_policy_without_dropping_requests() {
    let (a, b) = (Backend::start(), Backend::start());
    let dir = TempDir::new("reload");
    let file = dir.file("kvlb.toml");
    let write = |replicas: &[&Backend], policy: &str| {
        let mut text = format!("policy = \"{policy}\"\n");
        for r in replicas {
            text.push_str(&format!("[[replica]]\nurl = \"{}\"\n", r.url()));
        }
        std::fs::write(&file, text).unwrap();
    };
    write(&[&a], "least_loaded");
    let path = file.to_str().unwrap().to_string();
    let kvlb = Kvlb::serve(&[
        "--config",
        &path,
        "--workers",
        "2",
        "--health-interval",
        "0",
    ]);
    let load = Load::start(kvlb.listen, 4);
    let mut conn = HttpConn::connect(kvlb.listen);
    assert_eq!(served_by(&kvlb, &mut conn), a.url());

    // Add b, switch to round_robin: both replicas serve, on the same connection.
    write(&[&a, &b], "round_robin");
    sighup(&kvlb);
    assert!(
        wait_until(Duration::from_secs(5), || served_by(&kvlb, &mut conn)
            == b.url()),
        "b never served after the reload; kvlb stderr:\n{}",
        kvlb.stderr()
    );
    assert_eq!(replicas_json(&kvlb)["policy"], "round_robin");
    assert!(
        kvlb.stderr().contains("1 replicas added"),
        "{}",
        kvlb.stderr()
    );

    // A slow request on a, then remove a: it completes; a drains out; b takes everything.
    let listen = kvlb.listen;
    let slow = std::thread::spawn(move || {
        let mut c = HttpConn::connect(listen);
        // round_robin over 2: one of two tries lands on a.
        let mut got = Vec::new();
        for _ in 0..2 {
            got.push(c.request("GET", "/slow?ms=1500", &[], b""));
        }
        got
    });
    std::thread::sleep(Duration::from_millis(300));
    write(&[&b], "round_robin");
    sighup(&kvlb);
    assert!(
        wait_until(Duration::from_secs(10), || replica_urls(&kvlb)
            == vec![b.url()]),
        "a was not removed: {}\nkvlb stderr:\n{}",
        replicas_json(&kvlb),
        kvlb.stderr()
    );
    for r in slow.join().unwrap() {
        let r = r.expect("slow request across the removal");
        assert_eq!(r.status, 200, "{}", r.describe());
    }
    for _ in 0..6 {
        assert_eq!(served_by(&kvlb, &mut conn), b.url());
    }
    let (ok, failed) = load.finish();
    assert!(ok > 50, "only {ok} requests answered under load");
    assert!(
        failed.is_empty(),
        "requests failed across reloads: {failed:?}"
    );
}

#[test]
fn a_bad_reload_is_refused_and_the_old_configuration_keeps_serving() {
    let a = Backend::start();
    let dir = TempDir::new("badreload");
    let file = dir.file("kvlb.toml");
    std::fs::write(
        &file,
        format!(
            "policy = \"round_robin\"\n[[replica]]\nurl = \"{}\"\n",
            a.url()
        ),
    )
    .unwrap();
    let path = file.to_str().unwrap().to_string();
    let kvlb = Kvlb::serve(&["--config", &path, "--health-interval", "0"]);
    std::fs::write(&file, "policy = \"fastest\"\n").unwrap();
    sighup(&kvlb);
    assert!(
        wait_until(Duration::from_secs(5), || kvlb
            .stderr()
            .contains("reload refused")),
        "no refusal logged:\n{}",
        kvlb.stderr()
    );
    assert!(kvlb.stderr().contains("fastest"), "{}", kvlb.stderr());
    let mut conn = HttpConn::connect(kvlb.listen);
    assert_eq!(served_by(&kvlb, &mut conn), a.url());
    assert_eq!(replicas_json(&kvlb)["policy"], "round_robin");
}

/// A directory laid out as the kubelet mounts a ConfigMap: `kvlb.toml` a symlink through
/// `..data`, itself a symlink to a timestamped directory, swapped atomically on update.
struct ConfigMapDir {
    dir: TempDir,
    version: u32,
}

impl ConfigMapDir {
    fn new(name: &str, toml: &str) -> ConfigMapDir {
        let mut m = ConfigMapDir {
            dir: TempDir::new(name),
            version: 0,
        };
        m.update(toml);
        std::os::unix::fs::symlink("..data/kvlb.toml", m.path()).unwrap();
        m
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.file("kvlb.toml")
    }

    /// A new version, as the kubelet writes it: a new directory, then `..data` renamed over.
    fn update(&mut self, toml: &str) {
        self.version += 1;
        let version = format!("..2026_12_05_{}", self.version);
        std::fs::create_dir(self.dir.file(&version)).unwrap();
        std::fs::write(self.dir.file(&version).join("kvlb.toml"), toml).unwrap();
        let tmp = self.dir.file("..data_tmp");
        std::os::unix::fs::symlink(&version, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.file("..data")).unwrap();
    }
}

fn one_replica_toml(url: &str) -> String {
    format!("policy = \"round_robin\"\n[[replica]]\nurl = \"{url}\"\n")
}

/// `watch_config`: a ConfigMap update (the symlink swapped, the path unchanged) reloads, and
/// a bad version is refused and counted while the running configuration keeps serving.
#[test]
fn a_watched_config_file_reloads_when_its_configmap_is_updated() {
    let (a, b) = (Backend::start(), Backend::start());
    let mut map = ConfigMapDir::new("watch", &one_replica_toml(&a.url()));
    let path = map.path().to_str().unwrap().to_string();
    let kvlb = Kvlb::serve(&[
        "--config",
        &path,
        "--watch-config",
        "200ms",
        "--health-interval",
        "0",
    ]);
    let mut conn = HttpConn::connect(kvlb.listen);
    assert_eq!(served_by(&kvlb, &mut conn), a.url());
    map.update(&one_replica_toml(&b.url()));
    assert!(
        wait_until(Duration::from_secs(5), || replica_urls(&kvlb) == [b.url()]),
        "{:?}\n{}",
        replica_urls(&kvlb),
        kvlb.stderr()
    );
    assert!(wait_until(Duration::from_secs(5), || served_by(
        &kvlb,
        &mut HttpConn::connect(kvlb.listen)
    ) == b.url()));
    let applied = |kvlb: &Kvlb| kvlb.metric("kvlb_config_reloads_total", &["result=\"applied\""]);
    assert_eq!(applied(&kvlb), Some(1.0));
    // A bad version: refused, counted, logged; b keeps serving.
    map.update("policy = \"fastest\"\n");
    let refused = || kvlb.metric("kvlb_config_reloads_total", &["result=\"refused\""]);
    assert!(
        wait_until(Duration::from_secs(5), || refused() == Some(1.0)),
        "{}",
        kvlb.stderr()
    );
    assert!(
        kvlb.stderr().contains("reload refused"),
        "{}",
        kvlb.stderr()
    );
    assert_eq!(
        served_by(&kvlb, &mut HttpConn::connect(kvlb.listen)),
        b.url()
    );
    // Unchanged since: no more reloads.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!((applied(&kvlb), refused()), (Some(1.0), Some(1.0)));
}

/// `--check`: the configuration is read and validated, nothing is started.
#[test]
fn check_validates_the_configuration_and_exits() {
    let dir = TempDir::new("check");
    let good = dir.file("good.toml");
    std::fs::write(
        &good,
        "listen = [\"127.0.0.1:0\"]\nreplica_dns = [\"dns://vllm.invalid:8000,kv_events=tcp://{host}:5557\"]\n[[replica]]\nurl = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    let bad = dir.file("bad.toml");
    std::fs::write(&bad, "listen = [\"127.0.0.1:0\"]\npolicy = \"fastest\"\n").unwrap();
    let run = |file: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvlb"))
            .args(["serve", "--check", "--config", file.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let ok = run(&good);
    let out = String::from_utf8_lossy(&ok.stdout);
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        out.contains("configuration ok (listeners 1, replicas 1, DNS sources 1,"),
        "{out}"
    );
    let no = run(&bad);
    assert_eq!(no.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&no.stderr).contains("fastest"));
}

#[test]
fn admin_api_needs_its_token_and_adds_drains_and_removes_replicas() {
    let (a, b) = (Backend::start(), Backend::start());
    let ua = a.url();
    let kvlb = Kvlb::serve(&[
        "--replica",
        &ua,
        "--policy",
        "round_robin",
        "--admin-token",
        TOKEN,
        "--health-interval",
        "0",
        // Added replicas ramp up over slow start: off here, tested on its own below.
        "--slow-start",
        "0",
    ]);
    let add = format!("{{\"url\": \"{}\"}}", b.url());
    let (st, body) = admin(kvlb.admin, "POST", "/replicas", None, &add);
    assert_eq!(st, 401, "{body}");
    assert!(body.contains("\"error\""), "{body}");
    let (st, _) = admin(
        kvlb.admin,
        "POST",
        "/replicas",
        Some("wrong-token-wrong-token"),
        &add,
    );
    assert_eq!(st, 401);
    let (st, body) = admin(kvlb.admin, "POST", "/replicas", Some(TOKEN), "{\"url\": 5}");
    assert_eq!(st, 400, "{body}");
    let (st, body) = admin(
        kvlb.admin,
        "POST",
        "/replicas",
        Some(TOKEN),
        "{\"url\": \"ftp://x\"}",
    );
    assert_eq!(st, 400, "{body}");

    let (st, body) = admin(kvlb.admin, "POST", "/replicas", Some(TOKEN), &add);
    assert_eq!(st, 200, "{body}");
    let (st, body) = admin(kvlb.admin, "POST", "/replicas", Some(TOKEN), &add);
    assert_eq!(st, 409, "adding twice: {body}");
    assert_eq!(replica_urls(&kvlb), vec![ua.clone(), b.url()]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..20 {
        seen.insert(served_by(&kvlb, &mut conn));
    }
    assert_eq!(
        seen.len(),
        2,
        "round robin over the added replica: {seen:?}"
    );

    // Drain a: it stays listed (draining) and gets nothing new.
    let (st, body) = admin(
        kvlb.admin,
        "POST",
        "/replicas/drain",
        Some(TOKEN),
        &format!("{{\"url\": \"{ua}\"}}"),
    );
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("draining"), "{body}");
    for _ in 0..10 {
        assert_eq!(served_by(&kvlb, &mut conn), b.url());
    }
    assert_eq!(replica_urls(&kvlb).len(), 2);
    // Remove it: gone once idle.
    let (st, body) = admin(
        kvlb.admin,
        "DELETE",
        "/replicas",
        Some(TOKEN),
        &format!("{{\"url\": \"{ua}\"}}"),
    );
    assert_eq!(st, 200, "{body}");
    assert!(
        wait_until(Duration::from_secs(5), || replica_urls(&kvlb)
            == vec![b.url()]),
        "{}",
        replicas_json(&kvlb)
    );
    let (st, _) = admin(
        kvlb.admin,
        "DELETE",
        "/replicas",
        Some(TOKEN),
        &format!("{{\"url\": \"{ua}\"}}"),
    );
    assert_eq!(st, 404);
    // And the metrics no longer list it.
    assert_eq!(kvlb.metric("kvlb_replica_up", &[&ua]), None);
    assert_eq!(kvlb.metric("kvlb_replica_up", &[&b.url()]), Some(1.0));
}

#[test]
fn without_a_token_the_changing_endpoints_are_disabled() {
    let a = Backend::start();
    let kvlb = Kvlb::serve(&["--replica", &a.url(), "--health-interval", "0"]);
    let (st, body) = admin(kvlb.admin, "POST", "/reload", Some("anything-anything"), "");
    assert_eq!(st, 403, "{body}");
    assert!(body.contains("admin_token"), "{body}");
}

#[test]
fn a_connect_failure_is_retried_on_another_replica() {
    let b = Backend::start();
    // A port nothing listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let kvlb = pair(&dead, &b.url(), &["--max-fails", "1000"]);
    let mut conn = HttpConn::connect(kvlb.listen);
    for _ in 0..10 {
        assert_eq!(served_by(&kvlb, &mut conn), b.url());
    }
    let retries = kvlb.metric("kvlb_retries_total", &[&dead]).unwrap_or(0.0);
    assert!(
        retries >= 4.0,
        "retries counted: {retries}\n{}",
        kvlb.admin_get("/metrics").body_text()
    );
}

#[test]
fn an_immediate_503_is_retried_elsewhere_and_passed_through_without_retries() {
    let (a, b) = (Backend::start(), Backend::start());
    backend_get(&a, "/set_mode?status=503");
    let kvlb = pair(&a.url(), &b.url(), &["--max-fails", "0"]);
    let mut conn = HttpConn::connect(kvlb.listen);
    for _ in 0..8 {
        assert_eq!(served_by(&kvlb, &mut conn), b.url());
    }
    drop(kvlb);
    let kvlb = pair(&a.url(), &b.url(), &["--max-fails", "0", "--retries", "0"]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let statuses: Vec<u16> = (0..8)
        .map(|_| conn.request("GET", "/echo", &[], b"").unwrap().status)
        .collect();
    assert!(
        statuses.contains(&503) && statuses.contains(&200),
        "{statuses:?}"
    );
}

#[test]
fn consecutive_failures_eject_a_replica() {
    let (a, b) = (Backend::start(), Backend::start());
    backend_get(&a, "/set_mode?status=503");
    let kvlb = pair(
        &a.url(),
        &b.url(),
        &[
            "--retries",
            "0",
            "--max-fails",
            "2",
            "--fail-timeout",
            "60s",
        ],
    );
    let mut conn = HttpConn::connect(kvlb.listen);
    let mut from_a = 0;
    for _ in 0..20 {
        let r = conn.request("GET", "/echo", &[], b"").unwrap();
        if r.status == 503 {
            from_a += 1;
        }
    }
    assert_eq!(from_a, 2, "a should be ejected after 2 failures in a row");
    assert_eq!(kvlb.metric("kvlb_ejections_total", &[&a.url()]), Some(1.0));
    assert_eq!(kvlb.metric("kvlb_replica_up", &[&a.url()]), Some(0.0));
    assert!(kvlb.stderr().contains("ejected"), "{}", kvlb.stderr());
}

#[test]
fn failing_health_checks_take_a_replica_out_and_passing_ones_bring_it_back() {
    let (a, b) = (Backend::start(), Backend::start());
    let kvlb = Kvlb::serve(&[
        "--replica",
        &a.url(),
        "--replica",
        &b.url(),
        "--policy",
        "round_robin",
        "--workers",
        "1",
        "--health-interval",
        "100ms",
        "--unhealthy-after",
        "2",
        "--healthy-after",
        "2",
        "--slow-start",
        "0s",
    ]);
    let mut conn = HttpConn::connect(kvlb.listen);
    backend_get(&a, "/set_health?ok=0");
    assert!(
        wait_until(Duration::from_secs(5), || kvlb
            .metric("kvlb_replica_up", &[&a.url()])
            == Some(0.0)),
        "a not taken out: {}",
        replicas_json(&kvlb)
    );
    for _ in 0..10 {
        assert_eq!(served_by(&kvlb, &mut conn), b.url());
    }
    backend_get(&a, "/set_health?ok=1");
    assert!(
        wait_until(Duration::from_secs(5), || kvlb
            .metric("kvlb_replica_up", &[&a.url()])
            == Some(1.0)),
        "a not back: {}",
        replicas_json(&kvlb)
    );
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..10 {
        seen.insert(served_by(&kvlb, &mut conn));
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    let log = kvlb.stderr();
    assert!(
        log.contains("taken out of rotation") && log.contains("healthy again"),
        "{log}"
    );
}

#[test]
fn client_api_keys_are_checked_and_a_refusal_keeps_the_connection() {
    let a = Backend::start();
    let dir = TempDir::new("keys");
    let keys = dir.file("keys");
    std::fs::write(&keys, "# team keys\nsk-team-one-0001\n\nsk-team-two-0002\n").unwrap();
    let kvlb = Kvlb::serve(&[
        "--replica",
        &a.url(),
        "--api-keys-file",
        keys.to_str().unwrap(),
        "--health-interval",
        "0",
    ]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let r = conn
        .request("POST", "/v1/chat/completions", &[], b"{}")
        .unwrap();
    assert_eq!(r.status, 401, "{}", r.describe());
    assert!(r.is_json_error(), "{}", r.describe());
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let r = conn
        .request(
            "GET",
            "/echo",
            &[("Authorization", "Bearer sk-team-one-0000")],
            b"",
        )
        .expect("same connection after a 401");
    assert_eq!(r.status, 401, "{}", r.describe());
    let r = conn
        .request(
            "GET",
            "/echo",
            &[("Authorization", "Bearer sk-team-two-0002")],
            b"",
        )
        .expect("same connection after two 401s");
    assert_eq!(r.status, 200, "{}", r.describe());
    assert_eq!(
        kvlb.metric("kvlb_local_responses_total", &["401"]),
        Some(2.0)
    );
    assert_eq!(
        a.stats().requests,
        2,
        "refused requests must not reach the replica (1 accepted + this /stats request)"
    );
}

#[test]
fn concurrency_limits_queue_then_refuse_with_429() {
    let a = Backend::start();
    let kvlb = Kvlb::serve(&[
        "--replica",
        &a.url(),
        "--max-in-flight",
        "1",
        "--queue-size",
        "1",
        "--queue-timeout",
        "5s",
        "--health-interval",
        "0",
    ]);
    let listen = kvlb.listen;
    let spawn = |path: &'static str| {
        std::thread::spawn(move || {
            let mut c = HttpConn::connect(listen);
            let t = std::time::Instant::now();
            let r = c.request("GET", path, &[], b"").expect("answer");
            (r, t.elapsed())
        })
    };
    let first = spawn("/slow?ms=600");
    std::thread::sleep(Duration::from_millis(150));
    // Waits in the queue for the slow one to finish, then goes.
    let second = spawn("/echo?queued");
    std::thread::sleep(Duration::from_millis(150));
    assert!(
        wait_until(Duration::from_secs(2), || kvlb
            .metric("kvlb_queue_waiting", &[])
            == Some(1.0)),
        "second request not queued"
    );
    // The queue (1) is full: refused at once.
    let mut c = HttpConn::connect(kvlb.listen);
    let r = c.request("GET", "/echo?third", &[], b"").unwrap();
    assert_eq!(r.status, 429, "{}", r.describe());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(r.is_json_error());
    let (r1, _) = first.join().unwrap();
    assert_eq!(r1.status, 200, "{}", r1.describe());
    let (r2, waited) = second.join().unwrap();
    assert_eq!(r2.status, 200, "{}", r2.describe());
    assert!(
        waited >= Duration::from_millis(300),
        "the queued request did not wait: {waited:?}"
    );
    // The refused connection still serves.
    let r = c.request("GET", "/echo?after", &[], b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.describe());
    drop(kvlb);

    // A short queue timeout: 429 after waiting.
    let kvlb = Kvlb::serve(&[
        "--replica",
        &a.url(),
        "--max-in-flight",
        "1",
        "--queue-timeout",
        "300ms",
        "--health-interval",
        "0",
    ]);
    let listen = kvlb.listen;
    let slow = std::thread::spawn(move || {
        HttpConn::connect(listen).request("GET", "/slow?ms=1500", &[], b"")
    });
    std::thread::sleep(Duration::from_millis(200));
    let t = std::time::Instant::now();
    let r = HttpConn::connect(kvlb.listen)
        .request("GET", "/echo", &[], b"")
        .unwrap();
    assert_eq!(r.status, 429, "{}", r.describe());
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(slow.join().unwrap().unwrap().status, 200);
}

#[test]
fn a_replica_added_while_serving_ramps_up_over_slow_start() {
    let (a, b) = (Backend::start(), Backend::start());
    let kvlb = Kvlb::serve(&[
        "--replica",
        &a.url(),
        "--policy",
        "round_robin",
        "--workers",
        "1",
        "--admin-token",
        TOKEN,
        "--health-interval",
        "0",
        "--slow-start",
        "3s",
    ]);
    let (st, body) = admin(
        kvlb.admin,
        "POST",
        "/replicas",
        Some(TOKEN),
        &format!("{{\"url\": \"{}\"}}", b.url()),
    );
    assert_eq!(st, 200, "{body}");
    let mut conn = HttpConn::connect(kvlb.listen);
    // Just added: considered by about 5% of requests, so it gets far fewer than its half.
    let to_b = (0..40)
        .filter(|_| served_by(&kvlb, &mut conn) == b.url())
        .count();
    assert!(
        to_b < 12,
        "the new replica got {to_b} of 40 requests at once"
    );
    // Once the ramp is over, round robin alternates.
    std::thread::sleep(Duration::from_millis(3200));
    let to_b = (0..20)
        .filter(|_| served_by(&kvlb, &mut conn) == b.url())
        .count();
    assert!((9..=11).contains(&to_b), "after slow start: {to_b} of 20");
}
