//! Replica metrics scraping end to end: `kvlb serve` polls real HTTP `/metrics` endpoints (a
//! vLLM-shaped and an SGLang-shaped exposition served over 127.0.0.1 sockets), shows the
//! numbers in /replicas and /metrics, and marks a replica stale once its telemetry stops.

#[path = "support/mod.rs"]
mod support;

use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::{wait_until, Kvlb};

const T: Duration = Duration::from_secs(20);

/// An HTTP server answering GET /metrics with `body` (while `up`), 503 otherwise. Its thread
/// stops accepting once dropped.
struct MetricsServer {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    done: Arc<AtomicBool>,
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        // Wake the accept loop so the thread ends.
        let _ = std::net::TcpStream::connect(self.addr);
    }
}

impl MetricsServer {
    fn start(body: &'static str) -> MetricsServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(AtomicBool::new(true));
        let done = Arc::new(AtomicBool::new(false));
        let (up2, done2) = (up.clone(), done.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if done2.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(mut s) = stream else { continue };
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let reply = if up2.load(Ordering::Relaxed) && head.starts_with(b"GET /metrics ") {
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_string()
                };
                let _ = s.write_all(reply.as_bytes());
            }
        });
        MetricsServer { addr, up, done }
    }
}

const VLLM: &str = "# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 3.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 7.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 0.41
";

const SGLANG: &str = "# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\"} 5.0
sglang:num_queue_reqs{model_name=\"m\",tp_rank=\"0\"} 11.0
sglang:token_usage{model_name=\"m\",tp_rank=\"0\"} 0.25
";

fn replicas(kvlb: &Kvlb) -> Vec<Value> {
    let v: Value = serde_json::from_str(&kvlb.admin_get("/replicas").body_text()).unwrap();
    v["replicas"].as_array().unwrap().clone()
}

#[test]
fn scraped_queue_numbers_show_and_silence_goes_stale() {
    let vllm = MetricsServer::start(VLLM);
    let sglang = MetricsServer::start(SGLANG);
    let r0 = format!("http://{},metrics=on", vllm.addr);
    let r1 = format!("http://{},metrics=on", sglang.addr);
    let kvlb = Kvlb::serve(&[
        "--workers",
        "1",
        "--metrics-interval",
        "100ms",
        "--telemetry-stale-after",
        "1s",
        "--replica",
        &r0,
        "--replica",
        &r1,
    ]);
    assert!(
        wait_until(T, || replicas(&kvlb)
            .iter()
            .all(|r| r["telemetry"]["waiting"].is_u64())),
        "no scraped numbers: {:?}",
        replicas(&kvlb)
    );
    let list = replicas(&kvlb);
    let (t0, t1) = (&list[0]["telemetry"], &list[1]["telemetry"]);
    assert_eq!(
        (t0["running"].as_u64(), t0["waiting"].as_u64()),
        (Some(3), Some(7)),
        "{t0}"
    );
    assert_eq!(t0["kv_usage"].as_f64(), Some(0.41), "{t0}");
    assert_eq!(
        (t1["running"].as_u64(), t1["waiting"].as_u64()),
        (Some(5), Some(11)),
        "{t1}"
    );
    assert_eq!(t1["kv_usage"].as_f64(), Some(0.25), "{t1}");
    assert_eq!(t0["stale"], false);
    let r0_url = format!("http://{}", vllm.addr);
    let waiting = kvlb.metric("kvlb_replica_waiting", &[&r0_url]);
    assert_eq!(waiting, Some(7.0));
    assert_eq!(kvlb.metric("kvlb_replica_running", &[&r0_url]), Some(3.0));
    assert_eq!(kvlb.metric("kvlb_replica_kv_usage", &[&r0_url]), Some(0.41));
    assert!(kvlb
        .metric("kvlb_replica_telemetry_age_seconds", &[&r0_url])
        .is_some_and(|a| a < 5.0));

    // Replica 0's metrics stop answering: after telemetry_stale_after it is stale; replica 1
    // is not. It recovers when metrics come back.
    vllm.up.store(false, Ordering::Relaxed);
    assert!(
        wait_until(T, || replicas(&kvlb)[0]["telemetry"]["stale"] == true),
        "replica 0 never went stale: {:?}",
        replicas(&kvlb)
    );
    assert_eq!(replicas(&kvlb)[1]["telemetry"]["stale"], false);
    assert_eq!(
        kvlb.metric("kvlb_replica_telemetry_stale", &[&r0_url]),
        Some(1.0)
    );
    vllm.up.store(true, Ordering::Relaxed);
    assert!(
        wait_until(T, || replicas(&kvlb)[0]["telemetry"]["stale"] == false),
        "replica 0 stayed stale: {:?}",
        replicas(&kvlb)
    );
}
