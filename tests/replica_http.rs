//! `kvlb replica` end to end over real sockets: the binary is started on 127.0.0.1:0 and spoken
//! to with raw HTTP/1.1, so framing details (keep-alive, chunked bodies both ways, bad input)
//! are checked as a balancer would see them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `kvlb replica` process, killed on drop (also when a test panics).
struct ReplicaProcess {
    child: Child,
    addrs: Vec<SocketAddr>,
}

impl Drop for ReplicaProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> ReplicaProcess {
    start_env(args, &[])
}

/// `start` with these environment variables (and no VLLM_ALLOW_RUNTIME_LORA_UPDATING unless
/// given).
fn start_env(args: &[&str], env: &[(&str, &str)]) -> ReplicaProcess {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .arg("replica")
        .env_remove("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        .envs(env.iter().copied())
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvlb replica");
    let stderr = child.stderr.take().unwrap();
    let mut proc = ReplicaProcess {
        child,
        addrs: Vec::new(),
    };
    let mut lines = BufReader::new(stderr).lines();
    loop {
        let line = lines.next().expect("replica exited before ready").unwrap();
        if line == "kvlb replica: ready" {
            break;
        }
        if let Some(rest) = line.strip_prefix("kvlb replica: replica ") {
            let addr = rest.split_whitespace().nth(2).unwrap();
            proc.addrs.push(addr.parse().unwrap());
        }
    }
    // Keep draining stderr so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    proc
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Read one response (content-length or chunked) from `r`.
fn read_response(r: &mut BufReader<TcpStream>) -> Response {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("bad status line {line:?}"))
        .parse()
        .unwrap();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (n, v) = h.split_once(':').unwrap();
        headers.push((n.trim().to_string(), v.trim().to_string()));
    }
    let mut resp = Response {
        status,
        headers,
        body: Vec::new(),
    };
    if resp
        .header("transfer-encoding")
        .is_some_and(|v| v.contains("chunked"))
    {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            resp.body.extend_from_slice(&chunk[..n]);
        }
    } else {
        let n: usize = resp
            .header("content-length")
            .unwrap_or("0")
            .parse()
            .unwrap();
        resp.body.resize(n, 0);
        r.read_exact(&mut resp.body).unwrap();
    }
    resp
}

fn connect(addr: SocketAddr) -> BufReader<TcpStream> {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    BufReader::new(s)
}

fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Response {
    let mut c = connect(addr);
    send(&mut c, method, path, body);
    read_response(&mut c)
}

fn send(c: &mut BufReader<TcpStream>, method: &str, path: &str, body: &str) {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.get_mut().write_all(req.as_bytes()).unwrap();
}

/// Value of a metric line that starts with `prefix` (labels included).
fn metric(addr: SocketAddr, prefix: &str) -> f64 {
    let text = request(addr, "GET", "/metrics", "").text();
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn help_and_bad_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .args(["replica", "--help"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--listen",
        "--count",
        "--kv-events",
        "--kv-replay",
        "--time-scale",
        "--kv-capacity-tokens",
        "--prefill-b-s",
    ] {
        assert!(help.contains(flag), "help lacks {flag}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kvlb"))
        .args(["replica", "--listen", "127.0.0.1:0", "--time-scale", "fast"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--time-scale") && err.contains("fast"),
        "{err}"
    );
}

#[test]
fn endpoints_answer_like_vllm() {
    let p = start(&[
        "--time-scale",
        "100",
        "--model",
        "test/model",
        "--max-model-len",
        "4096",
    ]);
    let a = p.addrs[0];
    let r = request(a, "GET", "/health", "");
    assert_eq!((r.status, r.body.len()), (200, 0));
    let m = request(a, "GET", "/v1/models", "").json();
    assert_eq!(m["data"][0]["id"], "test/model");
    assert_eq!(m["data"][0]["max_model_len"], 4096);
    let t = request(a, "POST", "/tokenize", r#"{"prompt": "hello world"}"#).json();
    assert_eq!(
        t["count"].as_u64().unwrap() as usize,
        t["tokens"].as_array().unwrap().len()
    );
    assert_eq!(t["max_model_len"], 4096);
    let t = request(
        a,
        "POST",
        "/tokenize",
        r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
    )
    .json();
    assert!(t["count"].as_u64().unwrap() > 0);

    let r = request(
        a,
        "POST",
        "/v1/completions",
        r#"{"prompt": "Once upon a time", "max_tokens": 5}"#,
    );
    assert_eq!(r.status, 200);
    assert!(r.header("content-length").is_some());
    let j = r.json();
    assert!(j["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(j["object"], "text_completion");
    assert_eq!(j["model"], "test/model");
    assert_eq!(
        j["usage"]["completion_tokens"].as_u64().unwrap()
            + j["usage"]["prompt_tokens"].as_u64().unwrap(),
        j["usage"]["total_tokens"].as_u64().unwrap()
    );
    assert!(j["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    let reason = j["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(reason == "length" || reason == "stop");
    assert!(j["usage"]["completion_tokens"].as_u64().unwrap() <= 5);

    // A batch of prompts: one choice each; token-id prompts as they are.
    let j = request(
        a,
        "POST",
        "/v1/completions",
        r#"{"prompt": [[1,2,3,4],[5,6,7]], "max_tokens": 2}"#,
    )
    .json();
    assert_eq!(j["choices"].as_array().unwrap().len(), 2);
    assert_eq!(j["usage"]["prompt_tokens"], 7);
    let j = request(
        a,
        "POST",
        "/v1/completions",
        r#"{"prompt": ["a b", "c d"], "n": 2, "max_tokens": 1}"#,
    )
    .json();
    assert_eq!(j["choices"].as_array().unwrap().len(), 4);

    let chat = r#"{"model": "test/model", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}],
        "max_completion_tokens": 3}"#;
    let j = request(a, "POST", "/v1/chat/completions", chat).json();
    assert!(j["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["choices"][0]["message"]["role"], "assistant");
    assert!(j["choices"][0]["message"]["content"].is_string());
    assert!(j["usage"]["completion_tokens"].as_u64().unwrap() <= 3);

    let r = request(a, "GET", "/nope", "");
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], 404);
    let r = request(a, "GET", "/v1/completions", "");
    assert_eq!(r.status, 405);
    assert_eq!(request(a, "POST", "/reset_prefix_cache", "").status, 200);

    let text = request(a, "GET", "/metrics", "").text();
    for family in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds",
    ] {
        assert!(
            text.contains(&format!("# TYPE {family} ")),
            "no {family} in\n{text}"
        );
    }
    assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"test/model\"} 8.0"), "{text}");
    assert!(
        text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"test/model\"} 0.0"),
        "{text}"
    );
}

#[test]
fn streaming_is_chunked_sse_with_done() {
    let p = start(&["--time-scale", "100"]);
    let a = p.addrs[0];
    let r = request(
        a,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 4, "stream_options": {"include_usage": true}}"#,
    );
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    let text = r.text();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let usage = &chunks.last().unwrap()["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=4).contains(&completion));
    let finishes = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_string())
        .count();
    assert_eq!(finishes, 1);
    // Completions stream: one event per token.
    let r = request(
        a,
        "POST",
        "/v1/completions",
        r#"{"prompt": [1,2,3], "stream": true, "max_tokens": 6}"#,
    );
    let text = r.text();
    let n = text.matches("data: {").count();
    assert!((1..=6).contains(&n), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
}

#[test]
fn keep_alive_chunked_request_body_and_expect_continue() {
    let p = start(&["--time-scale", "100"]);
    let mut c = connect(p.addrs[0]);
    for _ in 0..3 {
        send(
            &mut c,
            "POST",
            "/v1/completions",
            r#"{"prompt": "abc", "max_tokens": 1}"#,
        );
        assert_eq!(read_response(&mut c).status, 200);
    }
    let body = r#"{"prompt": "chunked body", "max_tokens": 1}"#;
    let (x, y) = body.split_at(10);
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{x}\r\n{:x}\r\n{y}\r\n0\r\n\r\n",
        x.len(),
        y.len()
    );
    c.get_mut().write_all(req.as_bytes()).unwrap();
    assert_eq!(read_response(&mut c).status, 200);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    c.get_mut().write_all(head.as_bytes()).unwrap();
    let r = read_response(&mut c);
    assert_eq!(r.status, 100);
    c.get_mut().write_all(body.as_bytes()).unwrap();
    assert_eq!(read_response(&mut c).status, 200);
}

#[test]
fn bad_input_gets_4xx_and_the_replica_keeps_serving() {
    let p = start(&["--time-scale", "100", "--max-model-len", "64"]);
    let a = p.addrs[0];
    let cases = [
        ("/v1/completions", "{not json"),
        ("/v1/completions", r#"{"max_tokens": 3}"#),
        ("/v1/completions", r#"{"prompt": {"a": 1}}"#),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": "many"}"#,
        ),
        ("/v1/completions", r#"{"prompt": "x", "stream": 1}"#),
        ("/v1/chat/completions", r#"{"messages": "hi"}"#),
        ("/v1/chat/completions", r#"{"prompt": "hi"}"#),
        ("/tokenize", r#"{"prompt": 3}"#),
    ];
    for (path, body) in cases {
        let r = request(a, "POST", path, body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["type"], "BadRequestError");
        assert_eq!(e["error"]["code"], 400);
        assert!(e["error"]["param"].is_null());
    }
    // Over the context limit: vLLM's message.
    let long: Vec<String> = (0..100).map(|i| i.to_string()).collect();
    let r = request(
        a,
        "POST",
        "/v1/completions",
        &format!("{{\"prompt\": [{}]}}", long.join(",")),
    );
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 64"),
        "{}",
        r.text()
    );

    // Truncated body: the client gives up half way.
    let mut c = connect(a);
    c.get_mut()
        .write_all(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        .unwrap();
    c.get_mut().shutdown(Shutdown::Write).unwrap();
    let r = read_response(&mut c);
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("incomplete"));

    // Garbage bytes.
    let mut c = connect(a);
    c.get_mut()
        .write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n")
        .unwrap();
    let r = read_response(&mut c);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], 400);

    // Bad chunked framing.
    let mut c = connect(a);
    c.get_mut()
        .write_all(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n")
        .unwrap();
    assert_eq!(read_response(&mut c).status, 400);

    // Still serving, on a kept-alive connection after a 400 too.
    let mut c = connect(a);
    send(&mut c, "POST", "/v1/completions", "[]");
    assert_eq!(read_response(&mut c).status, 400);
    send(
        &mut c,
        "POST",
        "/v1/completions",
        r#"{"prompt": "ok", "max_tokens": 1}"#,
    );
    assert_eq!(read_response(&mut c).status, 200);
    assert_eq!(request(a, "GET", "/health", "").status, 200);
}

#[test]
fn repeated_prompt_hits_the_prefix_cache() {
    let p = start(&["--time-scale", "100"]);
    let a = p.addrs[0];
    let prompt: Vec<String> = (0..256).map(|i| (1000 + i).to_string()).collect();
    let body = format!("{{\"prompt\": [{}], \"max_tokens\": 2}}", prompt.join(","));
    let labels = "{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"}";
    let first = request(a, "POST", "/v1/completions", &body).json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let hits_before = metric(a, &format!("vllm:prefix_cache_hits_total{labels}"));
    let second = request(a, "POST", "/v1/completions", &body).json();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 240, "cached {cached}");
    let hits_after = metric(a, &format!("vllm:prefix_cache_hits_total{labels}"));
    assert!(
        hits_after >= hits_before + 240.0,
        "{hits_before} -> {hits_after}"
    );
    assert!(metric(a, &format!("vllm:prefix_cache_queries_total{labels}")) >= 512.0);
    assert!(metric(a, &format!("vllm:prompt_tokens_total{labels}")) >= 512.0);
}

#[test]
fn client_disconnect_mid_stream_cancels_the_request() {
    let p = start(&["--time-scale", "1"]);
    let a = p.addrs[0];
    let mut c = connect(a);
    send(
        &mut c,
        "POST",
        "/v1/completions",
        r#"{"prompt": "a long story", "stream": true, "max_tokens": 5000}"#,
    );
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        c.read_line(&mut line).unwrap();
    }
    let running = "vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"}";
    assert_eq!(metric(a, running), 1.0);
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(a, running) != 0.0 {
        assert!(
            Instant::now() < deadline,
            "request still running after the client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let aborted = metric(
        a,
        "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\"",
    );
    assert_eq!(aborted, 1.0);
    // A non-streaming request whose client leaves is cancelled too.
    let mut c = connect(a);
    send(
        &mut c,
        "POST",
        "/v1/completions",
        r#"{"prompt": "another long story", "max_tokens": 5000}"#,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(a, running) != 1.0 {
        assert!(Instant::now() < deadline, "request never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(c);
    while metric(a, running) != 0.0 {
        assert!(
            Instant::now() < deadline,
            "request still running after the client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let aborted = metric(
        a,
        "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\"",
    );
    assert_eq!(aborted, 2.0);
    assert_eq!(request(a, "GET", "/health", "").status, 200);
}

#[test]
fn sixteen_replicas_in_one_process_answer_concurrently() {
    let p = start(&["--count", "16", "--time-scale", "100"]);
    assert_eq!(p.addrs.len(), 16);
    let mut ports: Vec<u16> = p.addrs.iter().map(|a| a.port()).collect();
    ports.sort();
    ports.dedup();
    assert_eq!(ports.len(), 16);
    let threads: Vec<_> = p
        .addrs
        .iter()
        .map(|&a| {
            std::thread::spawn(move || {
                let mut c = connect(a);
                for i in 0..10 {
                    let body = format!("{{\"prompt\": \"replica question {i}\", \"max_tokens\": 8, \"stream\": {}}}", i % 2 == 0);
                    send(&mut c, "POST", "/v1/completions", &body);
                    assert_eq!(read_response(&mut c).status, 200);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Each replica has its own engine and metrics.
    for &a in &p.addrs {
        let done = metric(
            a,
            "vllm:request_success_total{engine=\"0\",finished_reason=\"length\"",
        ) + metric(
            a,
            "vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"",
        );
        assert_eq!(done, 10.0);
    }
}

#[test]
fn consecutive_ports_with_count() {
    // Find a free run of ports by asking the kernel for one and trying from there.
    for _ in 0..10 {
        let base = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if base > 65_000 {
            continue;
        }
        let out = Command::new(env!("CARGO_BIN_EXE_kvlb"))
            .args([
                "replica",
                "--listen",
                &format!("127.0.0.1:{base}"),
                "--count",
                "3",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut proc = ReplicaProcess {
            child: out,
            addrs: Vec::new(),
        };
        let mut lines = BufReader::new(proc.child.stderr.take().unwrap()).lines();
        let mut got = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if line == "kvlb replica: ready" {
                break;
            }
            // `replica I on HOST:PORT`; other lines (a port of the run taken: `replica I:
            // cannot listen on ...`) end this attempt.
            let addr = line
                .strip_prefix("kvlb replica: replica ")
                .and_then(|rest| rest.split_once(" on "))
                .and_then(|(_, a)| a.trim().parse::<SocketAddr>().ok());
            match addr {
                Some(a) => got.push(a.port()),
                None if line.contains("cannot listen") => break,
                None => {}
            }
        }
        if got.len() == 3 {
            assert_eq!(got, vec![base, base + 1, base + 2]);
            for port in got {
                let a: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
                assert_eq!(request(a, "GET", "/health", "").status, 200);
            }
            return;
        }
        // A port of the run was taken: try another base (the guard kills the process).
    }
    panic!("no free run of 3 ports found");
}

#[test]
fn small_kv_cache_evicts_and_the_prefix_stops_hitting() {
    let p = start(&[
        "--time-scale",
        "100",
        "--kv-capacity-tokens",
        "512",
        "--max-model-len",
        "512",
    ]);
    let a = p.addrs[0];
    let hits = "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"}";
    let body = |start: u32, n: u32| {
        let ids: Vec<String> = (start..start + n).map(|i| i.to_string()).collect();
        format!("{{\"prompt\": [{}], \"max_tokens\": 1}}", ids.join(","))
    };
    let cached = |b: &str| {
        request(a, "POST", "/v1/completions", b).json()["usage"]["prompt_tokens_details"]
            ["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let first = body(1000, 256);
    assert_eq!(cached(&first), 0);
    assert!(cached(&first) >= 240);
    let before = metric(a, hits);
    // A different prompt that needs nearly the whole cache pushes the first one out.
    assert_eq!(cached(&body(50_000, 480)), 0);
    // vLLM frees a request's blocks tail first, so at most the head of the first prompt stays.
    let left = cached(&first);
    assert!(
        left < 240,
        "the first prompt should have been evicted, {left} tokens still hit"
    );
    let after = metric(a, hits);
    assert!(
        after - before < 240.0,
        "hits grew by {} after eviction",
        after - before
    );
    let usage = metric(
        a,
        "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"}",
    );
    assert!((0.0..=1.0).contains(&usage));
}

/// vLLM's model names: aliases, adapters listed with their parent, the 404 of a model not
/// served, runtime loading only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, and an adapter's KV
/// cache apart from the base model's.
#[test]
fn served_names_adapters_and_runtime_loading() {
    let p = start(&[
        "--time-scale",
        "100",
        "--enable-lora",
        "--lora-modules",
        "sql=/adapters/sql",
        "--served-model-name",
        "big",
        "big-latest",
    ]);
    let a = p.addrs[0];
    let list = request(a, "GET", "/v1/models", "").json();
    let cards: Vec<(String, serde_json::Value)> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["id"].as_str().unwrap().to_string(), c["parent"].clone()))
        .collect();
    assert_eq!(
        cards,
        [
            ("big".to_string(), serde_json::Value::Null),
            ("big-latest".to_string(), serde_json::Value::Null),
            ("sql".to_string(), serde_json::json!("big")),
        ]
    );
    let r = request(
        a,
        "POST",
        "/v1/completions",
        r#"{"model": "gpt-4o", "prompt": "x"}"#,
    );
    assert_eq!(r.status, 404, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["message"], "The model `gpt-4o` does not exist.");
    assert_eq!(e["error"]["type"], "NotFoundError");
    assert_eq!(e["error"]["param"], "model");
    assert_eq!(e["error"]["code"], 404);
    // Responses carry the first served name, or the adapter's.
    let r = request(
        a,
        "POST",
        "/v1/completions",
        r#"{"model": "big-latest", "prompt": "x", "max_tokens": 1}"#,
    );
    assert_eq!(r.json()["model"], "big");
    // The same tokens under the adapter share no KV with the base model's.
    let prompt: Vec<String> = (0..256).map(|i| (1000 + i).to_string()).collect();
    let body = |model: &str| {
        format!(
            "{{\"model\": \"{model}\", \"prompt\": [{}], \"max_tokens\": 1}}",
            prompt.join(",")
        )
    };
    let cached = |model: &str| {
        let j = request(a, "POST", "/v1/completions", &body(model)).json();
        assert_eq!(j["model"], model);
        j["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(cached("big"), 0);
    assert!(cached("big") >= 240);
    assert_eq!(cached("sql"), 0);
    assert!(cached("sql") >= 240);
    // Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the load route does not exist.
    let r = request(
        a,
        "POST",
        "/v1/load_lora_adapter",
        r#"{"lora_name": "far", "lora_path": "/f"}"#,
    );
    assert_eq!(r.status, 404, "{}", r.text());
}

#[test]
fn runtime_lora_loading_answers_like_vllm() {
    let p = start_env(
        &[
            "--time-scale",
            "100",
            "--enable-lora",
            "--served-model-name",
            "big",
        ],
        &[("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")],
    );
    let a = p.addrs[0];
    let load = |body: &str| request(a, "POST", "/v1/load_lora_adapter", body);
    let r = load(r#"{"lora_name": "far"}"#);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(
        r.json()["error"]["message"],
        "Both 'lora_name' and 'lora_path' must be provided."
    );
    let r = load(r#"{"lora_name": "big", "lora_path": "/b"}"#);
    assert_eq!(r.status, 400, "{}", r.text());
    let r = load(r#"{"lora_name": "far", "lora_path": "/f"}"#);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.text(), "Success: LoRA adapter 'far' added successfully.");
    let r = load(r#"{"lora_name": "far", "lora_path": "/f"}"#);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("has already been loaded"), "{}", r.text());
    assert_eq!(metric(a, "kvlb_replica_lora_loads_total"), 1.0);
    let r = request(
        a,
        "POST",
        "/v1/completions",
        r#"{"model": "far", "prompt": "x", "max_tokens": 1}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let unload = |body: &str| request(a, "POST", "/v1/unload_lora_adapter", body);
    assert_eq!(unload(r#"{"lora_name": "far"}"#).status, 200);
    assert_eq!(unload(r#"{"lora_name": "far"}"#).status, 404);
    let r = request(
        a,
        "POST",
        "/v1/completions",
        r#"{"model": "far", "prompt": "x"}"#,
    );
    assert_eq!(r.status, 404, "{}", r.text());
}

/// The `vllm:lora_requests_info` samples of /metrics: (adapters label, value), checking that
/// every one has vLLM's three labels, the two adapter labels equal.
fn lora_info_samples(addr: SocketAddr, max_lora: &str) -> Vec<(String, f64)> {
    let text = request(addr, "GET", "/metrics", "").text();
    assert!(
        text.contains("# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n"),
        "{text}"
    );
    assert_eq!(text.matches("# TYPE vllm:lora_requests_info ").count(), 1);
    text.lines()
        .filter_map(|l| l.strip_prefix("vllm:lora_requests_info{"))
        .map(|l| {
            let (labels, value) = l.rsplit_once("} ").unwrap();
            let rest = labels
                .strip_prefix(&format!("max_lora=\"{max_lora}\",waiting_lora_adapters=\""))
                .unwrap_or_else(|| panic!("labels {labels}"));
            let (waiting, running) = rest.split_once("\",running_lora_adapters=\"").unwrap();
            assert_eq!(Some(waiting), running.strip_suffix('"'), "{labels}");
            (waiting.to_string(), value.parse().unwrap())
        })
        .collect()
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Start a long streamed completion of `model` (on data-parallel rank `rank`, if given) and
/// wait for its first token; dropping the connection cancels it.
fn stream_first_token(addr: SocketAddr, model: &str, rank: Option<u32>) -> BufReader<TcpStream> {
    let mut c = connect(addr);
    let body = format!(
        r#"{{"model": "{model}", "prompt": "a long story", "stream": true, "max_tokens": 5000}}"#
    );
    let rank = rank.map_or(String::new(), |r| format!("X-Data-Parallel-Rank: {r}\r\n"));
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\n{rank}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.get_mut().write_all(req.as_bytes()).unwrap();
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        assert!(c.read_line(&mut line).unwrap() > 0, "stream ended");
    }
    c
}

/// --max-loras as vLLM's scheduler applies it, and vllm:lora_requests_info as vLLM 0.33
/// exports it: both adapter labels list every adapter with a request past its first token,
/// every label set ever set stays with the time it was last set, the newest being the state.
#[test]
fn max_loras_and_lora_requests_info() {
    let p = start(&[
        "--enable-lora",
        "--lora-modules",
        "sql=/adapters/sql",
        "chat=/adapters/chat",
    ]);
    let a = p.addrs[0];
    // Before any engine step: the family and no sample.
    assert_eq!(lora_info_samples(a, "1"), []);
    let before = unix_now();
    let sql = stream_first_token(a, "sql", None);
    let samples = lora_info_samples(a, "1");
    let sql_at = samples
        .iter()
        .find(|(adapters, _)| adapters == "sql")
        .unwrap_or_else(|| panic!("no sql sample: {samples:?}"))
        .1;
    assert!(
        sql_at >= before - 0.5 && sql_at <= unix_now() + 0.5,
        "{sql_at}"
    );
    // One adapter slot (vLLM's default --max-loras 1): chat waits while sql runs, and a
    // request only waiting is not listed.
    let chat = std::thread::spawn(move || {
        request(
            a,
            "POST",
            "/v1/completions",
            r#"{"model": "chat", "prompt": "x", "max_tokens": 1}"#,
        )
    });
    let waiting = "vllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"}";
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(a, waiting) != 1.0 {
        assert!(Instant::now() < deadline, "chat never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(metric(a, waiting), 1.0, "chat ran beside sql");
    let samples = lora_info_samples(a, "1");
    assert!(samples.iter().all(|(s, _)| s == "sql"), "{samples:?}");
    // sql's client leaves: chat runs.
    drop(sql);
    let r = chat.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let chat_stream = stream_first_token(a, "chat", None);
    let samples = lora_info_samples(a, "1");
    let at = |name: &str| {
        samples
            .iter()
            .find(|(adapters, _)| adapters == name)
            .unwrap_or_else(|| panic!("no {name:?} sample: {samples:?}"))
            .1
    };
    // The old label sets stay with older times; the newest is the current state.
    assert!(at("sql") >= sql_at && at("sql") < at(""), "{samples:?}");
    assert!(at("") < at("chat"), "{samples:?}");
    let newest = samples.iter().max_by(|x, y| x.1.total_cmp(&y.1)).unwrap();
    assert_eq!(newest.0, "chat");
    drop(chat_stream);

    // Data-parallel ranks: one family, listing the adapters of every rank.
    let p = start(&[
        "--dp-size",
        "2",
        "--enable-lora",
        "--max-loras",
        "3",
        "--lora-modules",
        "sql=/adapters/sql",
        "chat=/adapters/chat",
    ]);
    let a = p.addrs[0];
    let _sql = stream_first_token(a, "sql", Some(1));
    let _chat = stream_first_token(a, "chat", Some(0));
    let samples = lora_info_samples(a, "3");
    let newest = samples.iter().max_by(|x, y| x.1.total_cmp(&y.1)).unwrap();
    assert_eq!(newest.0, "sql,chat", "{samples:?}");
}
