//! The hot path allocates nothing per request once warm: drive keep-alive traffic through a
//! real `kvlb serve` and read the worker's allocation counter from /metrics before and after.
//! The backend lists its model in /v1/models, so every request is also routed by its model.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A keep-alive backend answering every request with a small JSON body.
fn backend() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            s.set_nodelay(true).unwrap();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 65536];
                let mut served = 0u64;
                loop {
                    // One request: head + Content-Length body.
                    let (head_end, cl, models, responses) = loop {
                        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..p]).to_ascii_lowercase();
                            let cl = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .map(|v| v.trim().parse::<usize>().unwrap())
                                .unwrap_or(0);
                            break (
                                p + 4,
                                cl,
                                head.starts_with("get /v1/models "),
                                head.starts_with("post /v1/responses "),
                            );
                        }
                        match s.read(&mut tmp) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    };
                    while buf.len() < head_end + cl {
                        match s.read(&mut tmp) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    }
                    buf.drain(..head_end + cl);
                    served += 1;
                    // Four ids, again and again: a follow-up naming one finds it.
                    let id = format!(r#"{{"id":"resp_{:032x}","object":"response"}}"#, served % 4);
                    let body: &[u8] = match (models, responses) {
                        (true, _) => br#"{"object":"list","data":[{"id":"m","object":"model","parent":null}]}"#,
                        (_, true) => id.as_bytes(),
                        // With the transfer parameters a prefill replica answers (a decode
                        // leg's answer, or a whole request's, carries none; kvlb reads them
                        // only from a prefill leg's).
                        _ => br#"{"id":"chatcmpl-1","object":"chat.completion","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":1,"tp_size":1}}"#,
                    };
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let mut out = resp.into_bytes();
                    out.extend_from_slice(body);
                    if s.write_all(&out).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

fn start_kvlb(backend: u16, extra: &[&str]) -> (Kill, u16, u16) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--workers",
            "1",
        ])
        .args(["--replica", &format!("http://127.0.0.1:{backend}")])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let guard = Kill(child);
    let mut lines = BufReader::new(stderr).lines();
    let (mut port, mut admin) = (0, 0);
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(a) = line.strip_prefix("kvlb: listening on ") {
            port = a.rsplit(':').next().unwrap().parse().unwrap();
        } else if let Some(a) = line.strip_prefix("kvlb: admin on ") {
            admin = a.rsplit(':').next().unwrap().parse().unwrap();
        } else if line.starts_with("kvlb: ready") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    assert!(port > 0 && admin > 0, "kvlb did not start");
    (guard, port, admin)
}

fn metric(admin: u16, name: &str) -> u64 {
    let mut s = TcpStream::connect(("127.0.0.1", admin)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
        .parse()
        .unwrap()
}

/// The chat path in origin-form, and in absolute-form (rewritten to origin-form upstream, its
/// authority the Host sent), a path whose prompt kvlb does not read (its model is skimmed), and
/// the agent APIs: Responses (its answer's id learned; a follow-up naming an earlier id looked
/// up) and Messages.
const TARGETS: [&str; 6] = [
    "/v1/chat/completions",
    "http://kvlb.example:8000/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/responses",
    "/v1/messages",
];

/// The body sent to `TARGETS[i]`.
fn body_for(i: usize, chat: &str, responses: &str, follow_up: &str, messages: &str) -> String {
    match i {
        3 => responses.to_string(),
        4 => follow_up.to_string(),
        5 => messages.to_string(),
        _ => chat.to_string(),
    }
}

/// Send one POST to `target` on a keep-alive connection and read the whole response.
fn request(s: &mut TcpStream, target: &str, body: &[u8], buf: &mut Vec<u8>) {
    let head = format!(
        "POST {target} HTTP/1.1\r\nHost: kvlb\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    s.write_all(&out).unwrap();
    buf.clear();
    let mut tmp = [0u8; 8192];
    loop {
        let n = s.read(&mut tmp).unwrap();
        assert!(n > 0, "connection closed");
        buf.extend_from_slice(&tmp[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..p]).to_ascii_lowercase();
            assert!(head.starts_with("http/1.1 200"), "{head}");
            let cl: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            if buf.len() >= p + 4 + cl {
                return;
            }
        }
    }
}

#[test]
fn warm_keep_alive_requests_allocate_nothing() {
    let _ = warm_requests_allocate_nothing(&[], 1);
}

/// A model served by prefill and decode replicas: each chat request takes both legs (the
/// prefill leg's body built, its whole answer read, the decode leg's body put in its place),
/// the other paths go whole. Still no allocation.
#[test]
fn warm_disaggregated_requests_allocate_nothing() {
    let (prefill, decode) = (backend(), backend());
    let (p, d) = (
        format!("http://127.0.0.1:{prefill},role=prefill"),
        format!("http://127.0.0.1:{decode},role=decode"),
    );
    let (_kvlb, admin) = warm_requests_allocate_nothing(
        &["--replica", &p, "--replica", &d, "--disaggregate", "always"],
        3,
    );
    // Every request to the two chat targets (799 of the 2,400).
    let disaggregated = metric(admin, "kvlb_pd_requests_total{outcome=\"disaggregated\"}");
    let others: Vec<u64> = ["no_params", "prefill_failed", "prefill_refused", "direct"]
        .iter()
        .map(|o| metric(admin, &format!("kvlb_pd_requests_total{{outcome=\"{o}\"}}")))
        .collect();
    assert_eq!(
        (disaggregated, &others[..]),
        (799, &[0, 0, 0, 0][..]),
        "of 2,400 requests"
    );
}

/// The same under SGLang's protocol: each chat request's body gets a room, its decode leg is
/// sent, its prefill leg exchanged, and the decode replica's answer read from the connection
/// the decode leg went on. Still no allocation.
#[test]
fn warm_sglang_disaggregated_requests_allocate_nothing() {
    let (prefill, decode) = (backend(), backend());
    let (p, d) = (
        format!("http://127.0.0.1:{prefill},role=prefill,bootstrap_port=8998"),
        format!("http://127.0.0.1:{decode},role=decode"),
    );
    let (_kvlb, admin) = warm_requests_allocate_nothing(&["--replica", &p, "--replica", &d], 3);
    let disaggregated = metric(admin, "kvlb_pd_requests_total{outcome=\"disaggregated\"}");
    assert_eq!(disaggregated, 799, "of 2,400 requests");
}

/// With the access log on, each request also formats its line into the worker's buffer, and
/// the buffer is written out (at 32 KiB and every second): still no allocation.
#[test]
fn warm_requests_allocate_nothing_with_the_access_log_on() {
    let dir = std::env::temp_dir().join(format!("kvlb-alloc-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("access.log");
    let _ = warm_requests_allocate_nothing(&["--access-log", path.to_str().unwrap()], 1);
    let logged = std::fs::read_to_string(&path).unwrap().lines().count();
    assert!(logged >= 2000, "only {logged} lines logged");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Drives 2,000 warm requests through `kvlb serve` in front of one backend and `extra`'s
/// replicas (`replicas` serving the model in all); returns kvlb and its admin port.
fn warm_requests_allocate_nothing(extra: &[&str], replicas: u64) -> (Kill, u16) {
    let be = backend();
    let (kvlb, port, admin) = start_kvlb(be, extra);
    let body = format!(
        r#"{{"model":"m","stream":false,"messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"hi"}}]}}"#,
        "You are a helpful assistant. ".repeat(60)
    );
    let mut conns: Vec<TcpStream> = (0..4)
        .map(|_| {
            let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.set_nodelay(true).unwrap();
            s
        })
        .collect();
    let responses = format!(
        r#"{{"model":"m","instructions":"{}","input":[{{"role":"user","content":[{{"type":"input_text","text":"hi"}}]}},{{"type":"function_call","call_id":"c","name":"f","arguments":"{{}}"}}]}}"#,
        "You are a helpful assistant. ".repeat(60)
    );
    let follow_up = r#"{"model":"m","previous_response_id":"resp_00000000000000000000000000000001","input":"more"}"#;
    let messages = format!(
        r#"{{"model":"m","max_tokens":8,"system":[{{"type":"text","text":"x-anthropic-billing-header: cch=1;"}},{{"type":"text","text":"{}","cache_control":{{"type":"ephemeral"}}}}],"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t","content":"ok"}}]}}]}}"#,
        "You are a helpful assistant. ".repeat(60)
    );
    let bodies: Vec<String> = (0..TARGETS.len())
        .map(|i| body_for(i, &body, &responses, follow_up, &messages))
        .collect();
    let mut buf = Vec::new();
    for round in 0..100 {
        for (i, c) in conns.iter_mut().enumerate() {
            let k = (round + i) % TARGETS.len();
            request(c, TARGETS[k], bodies[k].as_bytes(), &mut buf);
        }
    }
    assert_eq!(metric(admin, "kvlb_model_replicas{model=\"m\"}"), replicas);
    let before = metric(admin, "kvlb_worker_allocations_total{worker=\"0\"}");
    let served_before = metric(admin, "kvlb_worker_requests_total{worker=\"0\"}");
    for round in 0..500 {
        for (i, c) in conns.iter_mut().enumerate() {
            let k = (round + i) % TARGETS.len();
            request(c, TARGETS[k], bodies[k].as_bytes(), &mut buf);
        }
    }
    let after = metric(admin, "kvlb_worker_allocations_total{worker=\"0\"}");
    let served = metric(admin, "kvlb_worker_requests_total{worker=\"0\"}") - served_before;
    assert_eq!(served, 2000);
    // The Responses answers' ids were learned, and the follow-ups found theirs.
    assert!(metric(admin, "kvlb_response_ids_total{outcome=\"learned\"}") >= 300);
    assert!(metric(admin, "kvlb_response_affinity_total{outcome=\"routed\"}") >= 300);
    eprintln!(
        "allocations over {served} warm requests: {}",
        after - before
    );
    assert!(
        after - before <= 2,
        "{} allocations for {served} warm keep-alive requests",
        after - before
    );
    // Alive while the caller reads /metrics.
    (kvlb, admin)
}
