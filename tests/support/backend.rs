//! The Python test replica (`tests/py/backend.py`, standard library only) as a child process:
//! it binds 127.0.0.1:0 and prints its port; killed and reaped on drop. It also exits by
//! itself when its stdin closes, so it cannot outlive a test process that died hard.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::client;

pub fn backend_script() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/backend.py")
}

/// `KVLB_PYTHON` if set, else `python3`.
pub fn python() -> String {
    std::env::var("KVLB_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// Runs a Python script (with `python()`: the official clients installed) with `args`; it
/// must exit 0 and print "ok".
pub fn run_python(script: &str, args: &[&str]) {
    let out = std::process::Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("ok"),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A running test replica.
pub struct Backend {
    child: Child,
    _stdin: Option<ChildStdin>,
    pub addr: SocketAddr,
}

/// The backend's `/stats` counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendStats {
    pub connections_opened: u64,
    pub connections_closed: u64,
    pub requests: u64,
    /// Slow, hanging or streaming requests whose peer closed before the answer was complete.
    pub aborted: u64,
}

impl Backend {
    /// Starts the backend; panics (with its stderr) if it does not print a port in 15 s.
    pub fn start() -> Backend {
        Backend::start_with(&[])
    }

    /// Starts the backend with extra arguments, e.g. `["--idle-close-ms", "300"]`.
    pub fn start_with(args: &[&str]) -> Backend {
        let mut child = Command::new(python())
            .arg("-u")
            .arg(backend_script())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {} {}: {e}", python(), backend_script()));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let (etx, erx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            let _ = etx.send(text);
        });
        let line = rx.recv_timeout(Duration::from_secs(15)).unwrap_or_default();
        let port: u16 = match line.trim().parse() {
            Ok(p) => p,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                let err = erx.recv_timeout(Duration::from_secs(2)).unwrap_or_default();
                panic!("test backend printed {line:?} instead of a port; stderr:\n{err}");
            }
        };
        Backend {
            child,
            _stdin: stdin,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    /// `http://127.0.0.1:PORT`, the replica URL to configure.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Reads `/stats` directly (not through the proxy). The stats request itself counts as
    /// one request and one open connection.
    pub fn stats(&self) -> BackendStats {
        let resp = client::get(self.addr, "/stats");
        let v = resp
            .json()
            .unwrap_or_else(|| panic!("backend /stats not JSON: {}", resp.describe()));
        let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("/stats lacks {k}"));
        BackendStats {
            connections_opened: n("connections_opened"),
            connections_closed: n("connections_closed"),
            requests: n("requests"),
            aborted: n("aborted"),
        }
    }

    /// Whether the process is still running (false after `/die`).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
