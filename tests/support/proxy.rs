//! A `kvlb serve` child process for tests: started on port 0, ready when it prints
//! `kvlb: ready` on stderr, killed and reaped on drop (also when the test panics).
//!
//! Stderr is drained by a thread for the whole life of the process and kept, so failure
//! messages can show what the proxy said.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::client::{self, Response};

/// How long `kvlb serve` may take to print `kvlb: ready`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub fn kvlb_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kvlb")
}

/// A running `kvlb serve`.
pub struct Kvlb {
    child: Option<Child>,
    /// The first listener.
    pub listen: SocketAddr,
    /// Every listener, in the order printed.
    pub listeners: Vec<SocketAddr>,
    pub admin: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    exit: Option<ExitStatus>,
}

/// `kvlb serve` exited (or timed out) before it was ready.
#[derive(Debug)]
pub struct StartFailure {
    pub status: Option<ExitStatus>,
    pub stderr: String,
}

impl Kvlb {
    /// `kvlb serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 ARGS...`; panics with the proxy's
    /// stderr if it does not become ready.
    pub fn serve(args: &[&str]) -> Kvlb {
        let mut all = vec!["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"];
        all.extend_from_slice(args);
        Kvlb::serve_raw(&all)
    }

    /// `kvlb serve ARGS...` with nothing added; panics if it does not become ready.
    pub fn serve_raw(args: &[&str]) -> Kvlb {
        Kvlb::try_serve_raw(args).unwrap_or_else(|f| {
            panic!(
                "kvlb serve {args:?} did not become ready (exit: {:?}); stderr:\n{}",
                f.status, f.stderr
            )
        })
    }

    /// `kvlb serve ARGS...`; `Err` if it exits or stays silent before `kvlb: ready`.
    pub fn try_serve_raw(args: &[&str]) -> Result<Kvlb, StartFailure> {
        Kvlb::try_serve_env(args, &[])
    }

    /// `Kvlb::serve` with these variables added to kvlb's environment.
    #[allow(dead_code)]
    pub fn serve_env(args: &[&str], env: &[(&str, &str)]) -> Kvlb {
        let mut all = vec!["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"];
        all.extend_from_slice(args);
        Kvlb::try_serve_env(&all, env).unwrap_or_else(|f| {
            panic!(
                "kvlb serve {all:?} did not become ready (exit: {:?}); stderr:\n{}",
                f.status, f.stderr
            )
        })
    }

    /// `try_serve_raw` with these variables added to kvlb's environment.
    pub fn try_serve_env(args: &[&str], env: &[(&str, &str)]) -> Result<Kvlb, StartFailure> {
        let mut child = Command::new(kvlb_bin())
            .arg("serve")
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvlb");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel::<String>();
        {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    log.lock().unwrap().push(line.clone());
                    let _ = tx.send(line);
                }
            });
        }
        let mut listeners = Vec::new();
        let mut admin = None;
        let deadline = Instant::now() + READY_TIMEOUT;
        let ready = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(a) = line.strip_prefix("kvlb: listening on ") {
                        listeners.push(parse_addr(a, &line));
                    } else if let Some(a) = line.strip_prefix("kvlb: admin on ") {
                        admin = Some(parse_addr(a, &line));
                    } else if line.starts_with("kvlb: ready") {
                        break true;
                    }
                }
                Err(_) => break false,
            }
        };
        if !ready || listeners.is_empty() || admin.is_none() {
            let _ = child.kill();
            let status = wait_timeout(&mut child, Duration::from_secs(5));
            // Let the drain thread collect the last lines.
            std::thread::sleep(Duration::from_millis(50));
            let stderr = log.lock().unwrap().join("\n");
            let stderr = if ready {
                format!("(ready without listener/admin lines)\n{stderr}")
            } else {
                stderr
            };
            return Err(StartFailure { status, stderr });
        }
        Ok(Kvlb {
            child: Some(child),
            listen: listeners[0],
            listeners,
            admin: admin.unwrap(),
            log,
            exit: None,
        })
    }

    /// Everything the proxy wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        if let Some(child) = &self.child {
            // Safety: kill(2) on our own child's pid, which is not reaped yet (we hold the
            // Child and have not waited on it), so the pid cannot have been reused.
            let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            assert_eq!(rc, 0, "kill(SIGTERM) failed");
        }
    }

    /// Waits up to `limit` for the process to exit; `None` if it is still running.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        if self.exit.is_some() {
            return self.exit;
        }
        let child = self.child.as_mut()?;
        let status = wait_timeout(child, limit);
        self.exit = status;
        status
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// `GET path` on the admin listener.
    pub fn admin_get(&self, path: &str) -> Response {
        client::get(self.admin, path)
    }

    /// `GET path` on the (first) proxy listener, on a new connection.
    pub fn get(&self, path: &str) -> Response {
        client::get(self.listen, path)
    }

    /// `http://LISTEN{path}` for curl.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    /// The value of a Prometheus sample whose line starts with `name{` or `name ` and contains
    /// every one of `label_parts`; summed over matching lines. `None` if no line matches.
    pub fn metric(&self, name: &str, label_parts: &[&str]) -> Option<f64> {
        let text = self.admin_get("/metrics").body_text();
        metric_sum(&text, name, label_parts)
    }
}

/// Sums the samples of `name` in Prometheus text whose labels contain all `label_parts`.
pub fn metric_sum(text: &str, name: &str, label_parts: &[&str]) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if !label_parts.iter().all(|p| rest.contains(p)) {
            continue;
        }
        let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            sum = Some(sum.unwrap_or(0.0) + v);
        }
    }
    sum
}

impl Drop for Kvlb {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.exit.is_none() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn parse_addr(text: &str, line: &str) -> SocketAddr {
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("kvlb printed an unparsable address in {line:?}: {e}"))
}

/// Polls `child` until it exits or `limit` passes.
pub fn wait_timeout(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => {}
            Err(_) => return None,
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The result of running `kvlb` to completion.
#[derive(Debug)]
pub struct Exited {
    /// `None` if it had to be killed after the time limit.
    pub status: Option<ExitStatus>,
    pub stderr: String,
}

/// Runs `kvlb ARGS...` to completion within `limit` (a failed test if it does not finish):
/// (exit success, stdout, stderr).
pub fn run_kvlb_output(args: &[String], limit: Duration) -> (bool, String, String) {
    let mut child = Command::new(kvlb_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvlb");
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let status = wait_timeout(&mut child, limit);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let (stdout, stderr) = (out_reader.join().unwrap(), err_reader.join().unwrap());
    assert!(
        status.is_some(),
        "{args:?} did not finish in {limit:?}:\n{stderr}"
    );
    (status.unwrap().success(), stdout, stderr)
}

/// Runs `kvlb ARGS...` (e.g. a `serve` with a bad config), killing it after `limit`.
pub fn run_kvlb(args: &[&str], limit: Duration) -> Exited {
    let mut child = Command::new(kvlb_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvlb");
    let stderr = child.stderr.take().expect("piped stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut text);
        text
    });
    let status = wait_timeout(&mut child, limit);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stderr = reader.join().unwrap_or_default();
    Exited { status, stderr }
}
