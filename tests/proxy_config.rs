//! Configuration of `kvlb serve`: bad values exit with status 2 and a message naming the key
//! and the value; a TOML `--config` file works and flags win over it.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use support::proxy::run_kvlb;
use support::{Backend, HttpConn, Kvlb, TempDir};

/// Runs `kvlb serve ARGS` expecting exit status 2 with `key` and `value` in the message.
fn assert_config_error(args: &[&str], keys: &[&str], value: &str) {
    let mut all = vec!["serve", "--admin", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let out = run_kvlb(&all, Duration::from_secs(10));
    let code = out.status.and_then(|s| s.code());
    assert_eq!(
        code,
        Some(2),
        "kvlb {all:?}: expected exit status 2, got {:?}; stderr:\n{}",
        out.status,
        out.stderr
    );
    assert!(
        keys.iter().any(|k| out.stderr.contains(k)),
        "kvlb {all:?}: message does not name the key (any of {keys:?}):\n{}",
        out.stderr
    );
    assert!(
        out.stderr.contains(value),
        "kvlb {all:?}: message does not show the value {value:?}:\n{}",
        out.stderr
    );
}

const REPLICA: &str = "http://127.0.0.1:9";

#[test]
fn unknown_policy_exits_2() {
    assert_config_error(
        &[
            "--listen",
            "127.0.0.1:0",
            "--replica",
            REPLICA,
            "--policy",
            "fastest_wins",
        ],
        &["policy"],
        "fastest_wins",
    );
}

#[test]
fn bad_replica_url_exits_2() {
    assert_config_error(
        &["--listen", "127.0.0.1:0", "--replica", "not a url"],
        &["replica"],
        "not a url",
    );
    assert_config_error(
        &["--listen", "127.0.0.1:0", "--replica", "ftp://127.0.0.1:21"],
        &["replica"],
        "ftp://127.0.0.1:21",
    );
    assert_config_error(
        &[
            "--listen",
            "127.0.0.1:0",
            "--replica",
            "http://127.0.0.1:99999",
        ],
        &["replica"],
        "http://127.0.0.1:99999",
    );
}

#[test]
fn bad_listen_address_exits_2() {
    assert_config_error(
        &["--listen", "127.0.0.1:http", "--replica", REPLICA],
        &["listen"],
        "127.0.0.1:http",
    );
    assert_config_error(
        &["--listen", "localhost-ish", "--replica", REPLICA],
        &["listen"],
        "localhost-ish",
    );
}

#[test]
fn bad_cores_list_exits_2() {
    for bad in ["x", "3-1", "0,,1", "2-"] {
        assert_config_error(
            &[
                "--listen",
                "127.0.0.1:0",
                "--replica",
                REPLICA,
                "--cores",
                bad,
            ],
            &["cores"],
            bad,
        );
    }
}

#[test]
fn bad_duration_and_size_exit_2() {
    assert_config_error(
        &[
            "--listen",
            "127.0.0.1:0",
            "--replica",
            REPLICA,
            "--client-timeout",
            "10 parsecs",
        ],
        &["client-timeout", "client_timeout"],
        "10 parsecs",
    );
    assert_config_error(
        &[
            "--listen",
            "127.0.0.1:0",
            "--replica",
            REPLICA,
            "--max-body-bytes",
            "lots",
        ],
        &["max-body-bytes", "max_body_bytes"],
        "lots",
    );
    assert_config_error(
        &[
            "--listen",
            "127.0.0.1:0",
            "--replica",
            REPLICA,
            "--workers",
            "zero",
        ],
        &["workers"],
        "zero",
    );
}

#[test]
fn bad_value_in_config_file_exits_2() {
    let dir = TempDir::new("badconf");
    let path = dir.file("kvlb.toml");
    std::fs::write(
        &path,
        "listen = [\"127.0.0.1:0\"]\npolicy = \"fastest_wins\"\n\n[[replica]]\nurl = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    assert_config_error(
        &["--config", path.to_str().unwrap()],
        &["policy"],
        "fastest_wins",
    );

    std::fs::write(
        &path,
        "listen = [\"127.0.0.1:0\"]\n\n[[replica]]\nurl = \"gopher://x\"\n",
    )
    .unwrap();
    assert_config_error(
        &["--config", path.to_str().unwrap()],
        &["replica", "url"],
        "gopher://x",
    );
}

#[test]
fn missing_config_file_exits_2() {
    assert_config_error(
        &["--config", "/nonexistent/kvlb-test.toml"],
        &["config"],
        "/nonexistent/kvlb-test.toml",
    );
}

fn write_config(dir: &TempDir, replica: &str, extra: &str) -> String {
    let path = dir.file("kvlb.toml");
    std::fs::write(
        &path,
        format!(
            "listen = [\"127.0.0.1:0\"]\nadmin = \"127.0.0.1:0\"\npolicy = \"round_robin\"\n\
             workers = 1\nclient_timeout = \"5s\"\n{extra}\n\n[[replica]]\nurl = \"{replica}\"\n"
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn config_file_is_used() {
    let backend = Backend::start();
    let dir = TempDir::new("conf");
    let path = write_config(&dir, &backend.url(), "max_body_bytes = 100");
    let kvlb = Kvlb::serve_raw(&["--config", &path]);
    let resp = kvlb.get("/echo");
    assert_eq!(resp.status, 200, "{}", resp.describe());
    assert_eq!(resp.header("x-kvlb-replica"), Some(backend.url().as_str()));
    // max_body_bytes from the file applies.
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("POST", "/echo", &[], &[b'x'; 1000])
        .expect("POST");
    assert_eq!(resp.status, 413, "{}", resp.describe());
}

#[test]
fn flags_override_config_file() {
    let backend = Backend::start();
    let dir = TempDir::new("conf-override");
    let path = write_config(&dir, &backend.url(), "max_body_bytes = 100");
    let kvlb = Kvlb::serve_raw(&["--config", &path, "--max-body-bytes", "100000"]);
    let mut conn = HttpConn::connect(kvlb.listen);
    let resp = conn
        .request("POST", "/echo", &[], &[b'x'; 1000])
        .expect("POST");
    assert_eq!(
        resp.status,
        200,
        "--max-body-bytes 100000 should win over max_body_bytes = 100:\n{}",
        resp.describe()
    );
    assert_eq!(resp.body.len(), 1000);
}

#[test]
fn flag_policy_overrides_config_file_policy() {
    let a = Backend::start();
    let b = Backend::start();
    let dir = TempDir::new("conf-policy");
    let path = dir.file("kvlb.toml");
    std::fs::write(
        &path,
        format!(
            "listen = [\"127.0.0.1:0\"]\nadmin = \"127.0.0.1:0\"\npolicy = \"least_loaded\"\n\
             workers = 1\n\n[[replica]]\nurl = \"{}\"\n\n[[replica]]\nurl = \"{}\"\n",
            a.url(),
            b.url()
        ),
    )
    .unwrap();
    let kvlb = Kvlb::serve_raw(&[
        "--config",
        path.to_str().unwrap(),
        "--policy",
        "round_robin",
    ]);
    let picks: Vec<String> = (0..4)
        .map(|_| {
            let resp = kvlb.get("/echo");
            assert_eq!(resp.status, 200, "{}", resp.describe());
            resp.header("x-kvlb-replica").unwrap_or("").to_string()
        })
        .collect();
    for w in picks.windows(2) {
        assert_ne!(
            w[0], w[1],
            "--policy round_robin did not win over the file: {picks:?}"
        );
    }
}

#[test]
fn two_listeners_both_serve() {
    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&[
        "--listen",
        "127.0.0.1:0",
        "--replica",
        url.as_str(),
        "--workers",
        "2",
    ]);
    assert_eq!(kvlb.listeners.len(), 2, "stderr:\n{}", kvlb.stderr());
    for addr in &kvlb.listeners {
        let resp = support::client::get(*addr, "/echo");
        assert_eq!(resp.status, 200, "listener {addr}: {}", resp.describe());
    }
}

#[test]
fn cores_list_pins_workers_and_serves() {
    let backend = Backend::start();
    let url = backend.url();
    for (cores, workers) in [("0", "1"), ("0-1", "2"), ("0,1", "2")] {
        let kvlb = Kvlb::serve(&[
            "--replica",
            url.as_str(),
            "--workers",
            workers,
            "--cores",
            cores,
        ]);
        let resp = kvlb.get("/echo");
        assert_eq!(
            resp.status,
            200,
            "--cores {cores} --workers {workers}: {}",
            resp.describe()
        );
    }
}

/// The CPUs of a worker thread of the process `pid` (its `Cpus_allowed_list`), once it runs.
fn worker_cpus(pid: u32) -> Option<String> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let dir = task.ok()?.path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if name.trim() == "kvlb-worker-0" {
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            return status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|v| v.trim().to_string());
        }
    }
    None
}

/// Workers are pinned among the CPUs the process may run on (a container's cpuset; here
/// `taskset -c 1`), not to core 0 outside them; `cores` naming a CPU outside them is refused.
#[test]
fn workers_are_pinned_among_the_allowed_cpus() {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipped: needs two CPUs");
        return;
    }
    let dir = TempDir::new("pinned");
    let log = dir.file("stderr");
    let mut child = std::process::Command::new("taskset")
        .args(["-c", "1", env!("CARGO_BIN_EXE_kvlb"), "serve"])
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("taskset");
    // Ready once every worker has pinned itself.
    let ready = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("kvlb: ready")
    };
    assert!(support::wait_until(Duration::from_secs(10), ready));
    let cpus = worker_cpus(child.id());
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(cpus.as_deref(), Some("1"));
    let out = std::process::Command::new("taskset")
        .args(["-c", "1", env!("CARGO_BIN_EXE_kvlb"), "serve"])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--cores",
            "0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("core 0 is not one this process may run on (1)"),
        "{err}"
    );
}
