//! The `curl` command line client, a real-world HTTP/1.1 peer, run with a time limit.

use std::process::{Command, Stdio};

/// What a curl run produced.
#[derive(Debug)]
pub struct CurlOutput {
    pub success: bool,
    pub code: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl CurlOutput {
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// Base arguments: silent but with errors, HTTP/1.1, no proxy from the environment, and a
/// hard time limit of `max_secs`.
pub fn base_args(max_secs: u32) -> Vec<String> {
    vec![
        "-sS".into(),
        "--http1.1".into(),
        "--noproxy".into(),
        "*".into(),
        "--max-time".into(),
        max_secs.to_string(),
    ]
}

/// Runs `curl` with the base arguments (30 s limit) and `args`.
pub fn curl(args: &[&str]) -> CurlOutput {
    let mut all = base_args(30);
    all.extend(args.iter().map(|s| s.to_string()));
    let out = Command::new("curl")
        .args(&all)
        .stdin(Stdio::null())
        .output()
        .expect("run curl");
    CurlOutput {
        success: out.status.success(),
        code: out.status.code(),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Parses a `curl -D` header dump (possibly several responses) into the last response's
/// (status, headers).
pub fn last_head(dump: &str) -> (u16, Vec<(String, String)>) {
    let mut status = 0;
    let mut headers = Vec::new();
    for line in dump.lines() {
        let line = line.trim_end_matches('\r');
        if line.starts_with("HTTP/") {
            status = line
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            headers.clear();
        } else if let Some((n, v)) = line.split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    (status, headers)
}

/// The first value of `name` (lower case) in parsed headers.
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Streams `url` with `curl -N` and returns each `data:` line with its arrival time, measured
/// from just before curl starts; also whether curl exited successfully.
pub fn sse_events(url: &str, max_secs: u32) -> (Vec<(std::time::Duration, String)>, bool) {
    use std::io::{BufRead, BufReader};
    let mut args = base_args(max_secs);
    args.extend(["-N".to_string(), url.to_string()]);
    let start = std::time::Instant::now();
    let mut child = Command::new("curl")
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn curl");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut events = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        if line.starts_with("data: ") {
            events.push((start.elapsed(), line));
        }
    }
    let ok = child.wait().map(|s| s.success()).unwrap_or(false);
    (events, ok)
}

/// Events as `  123 ms  data: ...` lines for failure messages.
pub fn show_events(events: &[(std::time::Duration, String)]) -> String {
    events
        .iter()
        .map(|(t, l)| format!("{:>5} ms  {l}", t.as_millis()))
        .collect::<Vec<_>>()
        .join("\n")
}
