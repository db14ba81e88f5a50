//! The admin listener: `/metrics` (Prometheus text), `/healthz` and `/replicas` (JSON). A plain
//! blocking thread: it is off the request path and sees a handful of scrapes a minute.

use crate::metrics;
use crate::worker::Shared;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

pub fn spawn(listener: TcpListener, shared: Arc<Shared>) {
    std::thread::Builder::new()
        .name("kvlb-admin".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let _ = handle(stream, &shared);
            }
        })
        .expect("spawn admin thread");
}

fn handle(mut s: TcpStream, shared: &Shared) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = [0u8; 8192];
    let mut len = 0;
    loop {
        let n = s.read(&mut buf[len..])?;
        if n == 0 {
            return Ok(());
        }
        len += n;
        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") || len == buf.len() {
            break;
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let (status, ctype, body) = match req.parse(&buf[..len]) {
        Ok(httparse::Status::Complete(_)) => {
            route(req.method.unwrap_or(""), req.path.unwrap_or(""), shared)
        }
        _ => (
            400,
            "application/json",
            r#"{"error":{"message":"malformed request","type":"invalid_request_error"}}"#
                .to_string(),
        ),
    };
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Bad Request",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    Ok(())
}

fn route(method: &str, path: &str, shared: &Shared) -> (u16, &'static str, String) {
    let path = path.split('?').next().unwrap_or("");
    if method != "GET" && method != "HEAD" {
        return (
            405,
            "application/json",
            r#"{"error":{"message":"only GET is supported","type":"invalid_request_error"}}"#
                .into(),
        );
    }
    match path {
        "/metrics" => {
            let urls: Vec<String> = shared.cfg.replicas.iter().map(|r| r.url.clone()).collect();
            let mut text = metrics::render(&shared.workers, &shared.loads, &urls);
            let draining = shared.draining.load(Relaxed) as u8;
            text.push_str("# HELP kvlb_draining 1 while kvlb drains after SIGTERM.\n# TYPE kvlb_draining gauge\n");
            text.push_str(&format!("kvlb_draining {draining}\n"));
            crate::telemetry::render_metrics(shared, &mut text);
            (200, "text/plain; version=0.0.4", text)
        }
        "/healthz" => {
            if shared.draining.load(Relaxed) {
                (503, "application/json", r#"{"status":"draining"}"#.into())
            } else {
                (200, "application/json", r#"{"status":"ok"}"#.into())
            }
        }
        "/replicas" => {
            let now = shared.now_ms();
            let list: Vec<serde_json::Value> = shared
                .cfg
                .replicas
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let load = &shared.loads[i];
                    let responses: u64 = shared
                        .workers
                        .iter()
                        .map(|w| w.replicas[i].responses.iter().map(|c| c.load(Relaxed)).sum::<u64>())
                        .sum();
                    serde_json::json!({
                        "url": r.url,
                        "address": r.addr.to_string(),
                        "in_flight": load.in_flight.load(Relaxed),
                        "available": load.down_until_ms.load(Relaxed) <= now,
                        "responses": responses,
                        "resident_blocks": shared.residency.replica_blocks(i),
                        "telemetry": shared.telemetry[i].to_json(now),
                    })
                })
                .collect();
            let body = serde_json::json!({
                "policy": shared.cfg.policy.as_str(),
                "replicas": list,
            });
            (200, "application/json", body.to_string())
        }
        _ => (404, "application/json", r#"{"error":{"message":"unknown admin path; try /metrics, /healthz or /replicas","type":"not_found"}}"#.into()),
    }
}
