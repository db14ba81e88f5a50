//! Replays the request-smuggling corpus (`tests/corpus/smuggling.txt`, its format described at
//! its top) against one `kvlb serve` in front of the test backend. Each mutation must either be
//! refused (the expected status, a JSON error, the connection closed, nothing forwarded) or
//! reach the backend as exactly one request carrying the body kvlb framed: never two requests,
//! never another body.

#[path = "support/mod.rs"]
mod support;

use std::time::Duration;
use support::digest::sha256_hex;
use support::{show_bytes, Backend, HttpConn, Kvlb};

enum Expect {
    Reject(u16),
    Forward(Vec<u8>),
}

impl std::fmt::Display for Expect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Expect::Reject(status) => write!(f, "reject {status}"),
            Expect::Forward(body) => write!(f, "forward {}", show_bytes(body)),
        }
    }
}

struct Case {
    name: String,
    expect: Expect,
    request: Vec<u8>,
}

/// Decodes the corpus escapes: \r \n \t \v \f \0 \xHH \\.
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let (byte, len) = match b.get(i + 1) {
            Some(b'r') => (b'\r', 2),
            Some(b'n') => (b'\n', 2),
            Some(b't') => (b'\t', 2),
            Some(b'v') => (0x0b, 2),
            Some(b'f') => (0x0c, 2),
            Some(b'0') => (0, 2),
            Some(b'\\') => (b'\\', 2),
            Some(b'x') => {
                let hex = s.get(i + 2..i + 4).unwrap_or("");
                let v = u8::from_str_radix(hex, 16)
                    .unwrap_or_else(|_| panic!("bad \\x escape in corpus line {s:?}"));
                (v, 4)
            }
            _ => panic!("unknown escape in corpus line {s:?}"),
        };
        out.push(byte);
        i += len;
    }
    out
}

fn corpus() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/corpus/smuggling.txt");
    let text = std::fs::read_to_string(path).expect("read the smuggling corpus");
    let mut cases = Vec::new();
    let mut block: Vec<&str> = Vec::new();
    for line in text.lines().chain(std::iter::once("")) {
        if !line.trim().is_empty() {
            block.push(line);
            continue;
        }
        if block.is_empty() || block.iter().all(|l| l.starts_with("# ") || *l == "#") {
            block.clear();
            continue;
        }
        let name = block[0]
            .strip_prefix("## ")
            .and_then(|l| l.split(':').next())
            .unwrap_or_else(|| panic!("a case starts with `## name: ...`, not {:?}", block[0]))
            .to_string();
        let expect = match block.get(1).map(|l| l.split_once(' ').unwrap_or((l, ""))) {
            Some(("reject", status)) => Expect::Reject(status.parse().expect("reject STATUS")),
            Some(("forward", body)) => Expect::Forward(unescape(body)),
            other => panic!("{name}: expected `reject STATUS` or `forward BODY`, got {other:?}"),
        };
        let request: Vec<u8> = block[2..].iter().flat_map(|l| unescape(l)).collect();
        assert!(!request.is_empty(), "{name}: no request");
        cases.push(Case {
            name,
            expect,
            request,
        });
        block.clear();
    }
    cases
}

/// Runs one case; Err says what went wrong.
fn check(case: &Case, kvlb: &Kvlb, backend: &Backend) -> Result<(), String> {
    let before = backend.stats().requests;
    let mut conn = HttpConn::connect(kvlb.listen);
    // kvlb may close while a refused request is still being written: the answer is what counts.
    let _ = conn.send(&case.request);
    let resp = conn
        .read_response("POST")
        .map_err(|e| format!("no response: {e}"))?;
    let forwarded = match &case.expect {
        Expect::Reject(status) => {
            if resp.status != *status || !resp.is_json_error() || !resp.says_close() {
                return Err(format!(
                    "expected a {status} JSON error closing the connection, got:\n{}",
                    resp.describe()
                ));
            }
            let (more, closed) = conn.read_for(Duration::from_secs(2));
            if !more.is_empty() || !closed {
                return Err(format!(
                    "after the {status}: closed={closed}, then {}",
                    show_bytes(&more)
                ));
            }
            0
        }
        Expect::Forward(body) => {
            let got = |h: &str| resp.header(h).unwrap_or("").to_string();
            let want_len = body.len().to_string();
            if resp.status != 200
                || got("x-got-method") != "POST"
                || got("x-got-path") != "/echo"
                || got("x-got-body-sha256") != sha256_hex(body)
                || got("x-got-body-len") != want_len
                || got("x-got-content-length") != want_len
                || got("x-got-transfer-encoding") != "<none>"
            {
                return Err(format!(
                    "expected POST /echo to reach the backend with the {}-byte body {} framed by \
                     Content-Length, got:\n{}",
                    body.len(),
                    show_bytes(body),
                    resp.describe()
                ));
            }
            // Nothing else answered: a second request hidden in this one would be.
            let (more, _) = conn.read_for(Duration::from_millis(300));
            if !more.is_empty() {
                return Err(format!(
                    "bytes after the forwarded request's answer: {}",
                    show_bytes(&more)
                ));
            }
            1
        }
    };
    // Besides the stats request itself.
    let reached = backend.stats().requests - before - 1;
    if reached != forwarded {
        return Err(format!(
            "{reached} requests reached the backend, expected {forwarded}"
        ));
    }
    Ok(())
}

#[test]
fn smuggling_mutations_are_refused_or_forwarded_as_one_request() {
    let cases = corpus();
    assert!(
        cases.len() >= 30,
        "only {} cases in the corpus",
        cases.len()
    );
    let mut names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), cases.len(), "case names repeat");

    let backend = Backend::start();
    let url = backend.url();
    let kvlb = Kvlb::serve(&["--replica", url.as_str(), "--workers", "1"]);
    let mut failures = Vec::new();
    for case in &cases {
        if let Err(why) = check(case, &kvlb, &backend) {
            failures.push(format!(
                "{} ({}):\n{}\n-> {why}",
                case.name,
                case.expect,
                show_bytes(&case.request)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n\n{}\n\nkvlb stderr:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n"),
        kvlb.stderr()
    );
}
