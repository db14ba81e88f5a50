//! The data plane's own work on one request of `bench/proxy_bench.sh`, without the sockets:
//! parse the client's head and write the upstream one, hash the chat body's prompt, parse the
//! replica's response head and write the client's. The same request and response bytes as the
//! benchmark (the wrk script's body, nginx's answer), so a change to any of these steps shows
//! here in nanoseconds, which the end-to-end figure (15 us of mostly kernel time per request on
//! a noisy machine) cannot resolve. Prints the fastest of many runs of each step.

use criterion::black_box;
use kvlb::http::request::{find_head_end, finish_upstream_head, parse_request};
use kvlb::http::response::{parse_response, ClientFraming};
use kvlb::prefix::{hash_request, PrefixConfig, PrefixHashes};
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: kvlb::alloc::CountingMiMalloc = kvlb::alloc::CountingMiMalloc;

/// The chat-completions body of bench/lib/chat_completion.lua.
fn bench_body() -> Vec<u8> {
    let lua = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bench/lib/chat_completion.lua"
    ))
    .expect("bench/lib/chat_completion.lua");
    let start = lua.find("[==[\n").expect("body start") + 5;
    let end = lua[start..].find("]==]").expect("body end") + start;
    lua[start..end].trim_end_matches('\n').as_bytes().to_vec()
}

fn fastest(runs: usize, mut run: impl FnMut()) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..runs {
        let start = Instant::now();
        for _ in 0..16 {
            run();
        }
        best = best.min(start.elapsed() / 16);
    }
    best
}

fn main() {
    let body = bench_body();
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:18081\r\nContent-Length: {}\r\n\
         Content-Type: application/json\r\nAccept: application/json\r\n\
         Authorization: Bearer sk-bench-0000000000000000\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let response: &[u8] = b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\n\
        Date: Mon, 30 Nov 2026 04:14:37 GMT\r\nContent-Type: application/json\r\n\
        Content-Length: 391\r\nConnection: keep-alive\r\n\r\n";
    let client = ClientFraming {
        head_request: false,
        close: false,
        http10: false,
    };
    let ip = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let replica = "http://127.0.0.1:18080";
    let cfg = PrefixConfig::default();
    let mut hashes = PrefixHashes::new(&cfg);
    let mut out = Vec::with_capacity(4096);

    let head_end = find_head_end(&request).expect("complete head");
    let mut request_step = || {
        let end = find_head_end(black_box(&request)).unwrap();
        let head = parse_request(&request, end, ip, &mut out).unwrap();
        finish_upstream_head(&mut out, head.method, body.len());
        black_box(out.len());
    };
    let mut prompt_step = || {
        hash_request(b"/v1/chat/completions", black_box(&body), &cfg, &mut hashes).unwrap();
        black_box(hashes.hashes.len());
    };
    let mut out2 = Vec::with_capacity(4096);
    let mut response_step = || {
        let head = parse_response(black_box(response), 64 * 1024, replica, &client, &mut out2);
        black_box(head.unwrap().head_len);
    };
    // Warm, then check the warm path allocates nothing.
    for _ in 0..1000 {
        request_step();
        prompt_step();
        response_step();
    }
    let before = kvlb::alloc::thread_allocations();
    for _ in 0..1000 {
        request_step();
        prompt_step();
        response_step();
    }
    let allocations = kvlb::alloc::thread_allocations() - before;
    assert_eq!(allocations, 0, "the warm request path must not allocate");

    let runs = std::env::var("RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let req = fastest(runs, &mut request_step);
    let prompt = fastest(runs, &mut prompt_step);
    let resp = fastest(runs, &mut response_step);
    println!(
        "request_path: head {} bytes + body {} bytes ({} blocks), response head {} bytes",
        head_end,
        body.len(),
        hashes.hashes.len(),
        response.len()
    );
    println!("request_path: parse request head + write upstream head  {req:>9.2?}");
    println!("request_path: extract + hash the prompt                 {prompt:>9.2?}");
    println!("request_path: parse response head + write client head   {resp:>9.2?}");
    println!(
        "request_path: sum                                       {:>9.2?}  (fastest of {runs} x 16 each; 0 allocations warm)",
        req + prompt + resp
    );
}
