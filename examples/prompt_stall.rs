//! What one huge prompt costs the other clients of its worker (run by `bench/prompt_stall.sh`).
//!
//! Starts a keep-alive backend (threads, answers every request with a small JSON body) and
//! `KVLB serve --workers 1 --cores PROXY_CORE` in front of it, then on this process's core:
//! one connection sends small chat requests back to back for the whole run while another
//! sends a big body (a million one-word messages, `model` after them, 30 MB: the body the
//! worker used to read in one 90-245 ms piece), WARMUP times first (not counted: fresh memory),
//! then ROUNDS times on `/v1/chat/completions` and ROUNDS times on `/v1/embeddings`, a path
//! kvlb forwards without reading (the floor: what receiving and forwarding 30 MB costs). Prints
//! the small requests' worst and p99 latency during each kind of big request and otherwise.
//!
//! usage: prompt_stall KVLB_BIN [ROUNDS [MESSAGES [PROXY_CORE [WARMUP]]]]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A request on `stream`: head and Content-Length body out, the response head and its
/// Content-Length body in (`buf` keeps what arrived after it).
fn exchange(stream: &mut TcpStream, head: &[u8], body: &[u8], buf: &mut Vec<u8>) {
    stream.write_all(head).expect("send head");
    stream.write_all(body).expect("send body");
    read_message(stream, buf).expect("a response");
}

/// Reads one HTTP message with a Content-Length body from `stream` into `buf`, and drops it;
/// None when the peer closes or fails first.
fn read_message(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
    let mut tmp = [0u8; 65536];
    let mut fill = |stream: &mut TcpStream, buf: &mut Vec<u8>| match stream.read(&mut tmp) {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buf.extend_from_slice(&tmp[..n]);
            Some(())
        }
    };
    loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..p]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < p + 4 + length {
                fill(stream, buf)?;
            }
            buf.drain(..p + 4 + length);
            return Some(length);
        }
        fill(stream, buf)?;
    }
}

/// A backend answering every request (whatever its body) with a small chat completion.
fn backend() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind backend");
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let _ = stream.set_nodelay(true);
                let body = br#"{"id":"chatcmpl-1","object":"chat.completion","choices":[]}"#;
                let mut answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                answer.extend_from_slice(body);
                let mut buf = Vec::new();
                while read_message(&mut stream, &mut buf).is_some() {
                    if stream.write_all(&answer).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `bin serve` with one worker on `core`, in front of `backend`; returns it and its listener.
fn start_kvlb(bin: &str, backend: SocketAddr, core: &str) -> (Kill, SocketAddr) {
    let mut child = Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--workers", "1", "--cores", core])
        .args(["--replica", &format!("http://{backend}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
    let stderr = child.stderr.take().expect("piped stderr");
    let kill = Kill(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut listen = None;
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("kvlb serve did not say it was ready");
        if let Some(a) = line.strip_prefix("kvlb: listening on ") {
            listen = a.split_whitespace().next().and_then(|a| a.parse().ok());
        }
        if line.starts_with("kvlb: ready") {
            break;
        }
    }
    (kill, listen.expect("a listening line"))
}

fn chat_request(path: &str, body: &[u8]) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes()
}

/// `n` one-word user messages, `model` after them (the OpenAI Python client's order).
fn tiny_messages(n: usize) -> Vec<u8> {
    let messages = vec![r#"{"role":"user","content":"a"}"#; n].join(",");
    format!(r#"{{"messages":[{messages}],"model":"Qwen/Qwen3-8B","stream":false}}"#).into_bytes()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// (worst, p99) of `latencies`, in ms.
fn worst_and_p99(latencies: &mut [Duration]) -> (f64, f64) {
    if latencies.is_empty() {
        return (0.0, 0.0);
    }
    latencies.sort();
    let p99 = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
    (ms(*latencies.last().unwrap()), ms(p99))
}

/// A big request's window and kind (0: the chat path, 1: the floor path, 2: warm-up).
type Window = (Instant, Instant, usize);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bin = args
        .get(1)
        .expect("usage: prompt_stall KVLB_BIN [ROUNDS [MESSAGES [PROXY_CORE [WARMUP]]]]");
    let rounds: usize = args.get(2).map_or(5, |v| v.parse().expect("ROUNDS"));
    let messages: usize = args
        .get(3)
        .map_or(1_000_000, |v| v.parse().expect("MESSAGES"));
    let core = args.get(4).map_or("0", String::as_str);
    let warmup: usize = args.get(5).map_or(2, |v| v.parse().expect("WARMUP"));

    let (_kvlb, listen) = start_kvlb(bin, backend(), core);
    let big = tiny_messages(messages);
    // The chat path, whose prompt kvlb reads, and a path it forwards without reading.
    let heads = [
        chat_request("/v1/chat/completions", &big),
        chat_request("/v1/embeddings", &big),
    ];
    let small = tiny_messages(3);
    let small_head = chat_request("/v1/chat/completions", &small);

    // Small requests back to back on their own connection: (start, latency) each.
    let done = Arc::new(AtomicBool::new(false));
    let samples: Arc<Mutex<Vec<(Instant, Duration)>>> = Arc::default();
    let small_loop = {
        let (done, samples) = (done.clone(), samples.clone());
        std::thread::spawn(move || {
            let mut conn = TcpStream::connect(listen).expect("connect");
            conn.set_nodelay(true).unwrap();
            let mut buf = Vec::new();
            let mut mine = Vec::with_capacity(1 << 20);
            while !done.load(Relaxed) {
                let t = Instant::now();
                exchange(&mut conn, &small_head, &small, &mut buf);
                mine.push((t, t.elapsed()));
            }
            *samples.lock().unwrap() = mine;
        })
    };

    // WARMUP big bodies (not counted: the first ones pay for fresh memory), then ROUNDS on
    // each path in turn, 300 ms apart.
    let mut windows: Vec<Window> = Vec::new();
    let mut conn = TcpStream::connect(listen).expect("connect");
    conn.set_nodelay(true).unwrap();
    let mut buf = Vec::new();
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..warmup + 2 * rounds {
        let kind = i % 2;
        let t = Instant::now();
        exchange(&mut conn, &heads[kind], &big, &mut buf);
        // Warm-up windows are kind 2: left out of every figure.
        windows.push((t, Instant::now(), if i < warmup { 2 } else { kind }));
        std::thread::sleep(Duration::from_millis(300));
    }
    done.store(true, Relaxed);
    small_loop.join().expect("small request loop");

    let samples = samples.lock().unwrap();
    let overlaps = |start: Instant, took: Duration, kind: usize| {
        windows
            .iter()
            .any(|&(a, b, k)| k == kind && start < b && start + took > a)
    };
    let stats = |kind: Option<usize>| {
        let mut latencies: Vec<Duration> = samples
            .iter()
            .filter(|&&(start, took)| match kind {
                Some(k) => overlaps(start, took, k),
                None => (0..3).all(|k| !overlaps(start, took, k)),
            })
            .map(|&(_, took)| took)
            .collect();
        let n = latencies.len();
        let (worst, p99) = worst_and_p99(&mut latencies);
        (worst, p99, n)
    };
    let big_ms = |kind: usize| {
        let mut took: Vec<Duration> = windows
            .iter()
            .filter(|w| w.2 == kind)
            .map(|&(a, b, _)| b - a)
            .collect();
        took.sort();
        (ms(took[0]), ms(took[took.len() - 1]))
    };
    if std::env::var("VERBOSE").is_ok() {
        for &(a, b, kind) in windows.iter().filter(|w| w.2 < 2) {
            let worst = samples
                .iter()
                .filter(|&&(s, t)| s < b && s + t > a)
                .map(|&(_, t)| ms(t))
                .fold(0.0, f64::max);
            eprintln!(
                "  path {kind}: big {:.1} ms, worst small during it {worst:.2} ms",
                ms(b - a)
            );
        }
    }
    let (chat_worst, chat_p99, chat_n) = stats(Some(0));
    let (floor_worst, floor_p99, floor_n) = stats(Some(1));
    let (alone_worst, alone_p99, alone_n) = stats(None);
    let (chat_min, chat_max) = big_ms(0);
    println!(
        "{bin}: {:.1} MB chat body x {rounds}: other connection worst {chat_worst:.2} ms \
         (p99 {chat_p99:.2}, {chat_n} requests) during it (it took {chat_min:.1}-{chat_max:.1} ms); \
         the same body on /v1/embeddings (not read): worst {floor_worst:.2} ms (p99 \
         {floor_p99:.2}, {floor_n}); no big request: worst {alone_worst:.2} ms (p99 \
         {alone_p99:.2}, {alone_n})",
        big.len() as f64 / 1e6,
    );
}
