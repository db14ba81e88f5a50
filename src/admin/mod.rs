//! The admin listener: `/metrics` (Prometheus text), `/healthz` and `/replicas` (JSON), and the
//! changing endpoints, which need `Authorization: Bearer <admin_token>` (disabled without a
//! configured token): `POST /reload`, `POST /replicas` (add: `{"url": ..., options}`),
//! `POST /replicas/drain` and `POST /replicas/remove` or `DELETE /replicas` (`{"url": ...}`).
//! A plain blocking thread: it is off the request path and sees a handful of requests a minute;
//! it listens on loopback unless configured otherwise.

use crate::control::Control;
use crate::metrics;
use crate::worker::Shared;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

pub fn spawn(listener: TcpListener, shared: Arc<Shared>, control: Arc<Control>) {
    std::thread::Builder::new()
        .name("kvlb-admin".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let _ = handle(stream, &shared, &control);
            }
        })
        .expect("spawn admin thread");
}

/// Largest admin request body (a replica description).
const MAX_BODY: usize = 64 * 1024;

type Reply = (u16, &'static str, String);

fn error(status: u16, kind: &str, message: &str) -> Reply {
    let body = serde_json::json!({"error": {"message": message, "type": kind}});
    (status, "application/json", body.to_string())
}

fn handle(mut s: TcpStream, shared: &Shared, control: &Control) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    let head_end = loop {
        let n = s.read(&mut buf[len..])?;
        if n == 0 {
            return Ok(());
        }
        len += n;
        if let Some(p) = buf[..len].windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(p + 4);
        }
        if len == buf.len() {
            break None;
        }
    };
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let reply = match (head_end, req.parse(&buf[..len])) {
        (Some(head_end), Ok(httparse::Status::Complete(_))) => {
            let header = |name: &str| {
                req.headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| String::from_utf8_lossy(h.value).into_owned())
            };
            let content_length =
                header("content-length").and_then(|v| v.trim().parse::<usize>().ok());
            let auth = header("authorization");
            let (method, path) = (
                req.method.unwrap_or("").to_string(),
                req.path.unwrap_or("").to_string(),
            );
            match content_length {
                Some(n) if n > MAX_BODY => {
                    error(413, "invalid_request_error", "admin request body too large")
                }
                n => {
                    let want = head_end + n.unwrap_or(0);
                    if buf.len() < want {
                        buf.resize(want, 0);
                    }
                    while len < want {
                        let got = s.read(&mut buf[len..want])?;
                        if got == 0 {
                            return Ok(());
                        }
                        len += got;
                    }
                    let body = &buf[head_end..want];
                    route(&method, &path, auth.as_deref(), body, shared, control)
                }
            }
        }
        _ => error(400, "invalid_request_error", "malformed request"),
    };
    let (status, ctype, body) = reply;
    let reason = match status {
        200 => "OK",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Payload Too Large",
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

/// Changing endpoints need `Authorization: Bearer <admin_token>`; without a configured token
/// they are disabled.
fn authorized(shared: &Shared, auth: Option<&str>) -> Result<(), Reply> {
    let cfg = shared.cfg();
    let Some(token) = cfg.admin_token.as_deref() else {
        return Err(error(
            403,
            "permission_error",
            "the admin API's changing endpoints are disabled: set admin_token in the configuration",
        ));
    };
    let given = auth
        .and_then(|a| {
            a.strip_prefix("Bearer ")
                .or_else(|| a.strip_prefix("bearer "))
        })
        .map(str::trim)
        .unwrap_or("");
    // Compare in time independent of where the first difference is.
    let same = given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if same {
        Ok(())
    } else {
        Err(error(
            401,
            "authentication_error",
            "missing or wrong admin bearer token",
        ))
    }
}

/// The replica a changing request names: `{"url": "..."}`, plus options when adding.
fn replica_from_body(body: &[u8], with_options: bool) -> Result<String, Reply> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        error(
            400,
            "invalid_request_error",
            &format!("expected a JSON object: {e}"),
        )
    })?;
    let obj = v
        .as_object()
        .ok_or_else(|| error(400, "invalid_request_error", "expected a JSON object"))?;
    let url = obj
        .get("url")
        .and_then(|u| u.as_str())
        .ok_or_else(|| error(400, "invalid_request_error", "missing \"url\" (a string)"))?;
    let mut flag = url.to_string();
    for (k, v) in obj {
        if k == "url" {
            continue;
        }
        if !with_options {
            return Err(error(
                400,
                "invalid_request_error",
                &format!("unexpected key {k:?}"),
            ));
        }
        let text = match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            serde_json::Value::Bool(b) => {
                if *b {
                    "on".into()
                } else {
                    "off".into()
                }
            }
            _ => {
                return Err(error(
                    400,
                    "invalid_request_error",
                    &format!("{k}: expected a string, number or boolean"),
                ))
            }
        };
        if text.contains(',') {
            return Err(error(
                400,
                "invalid_request_error",
                &format!("{k}: commas are not allowed"),
            ));
        }
        flag.push_str(&format!(",{k}={text}"));
    }
    Ok(flag)
}

fn route(
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: &[u8],
    shared: &Shared,
    control: &Control,
) -> Reply {
    let path = path.split('?').next().unwrap_or("");
    match (method, path) {
        ("POST", "/reload") => {
            if let Err(r) = authorized(shared, auth) {
                return r;
            }
            match control.reload() {
                Ok(msg) => {
                    eprintln!("kvlb: admin: {msg}");
                    (200, "application/json", serde_json::json!({"status": "ok", "message": msg}).to_string())
                }
                Err(e) => {
                    eprintln!("kvlb: admin: reload refused: {e}; the running configuration is unchanged");
                    error(400, "invalid_configuration", &format!("reload refused, the running configuration is unchanged: {e}"))
                }
            }
        }
        ("POST", "/replicas") => {
            if let Err(r) = authorized(shared, auth) {
                return r;
            }
            let flag = match replica_from_body(body, true) {
                Ok(f) => f,
                Err(r) => return r,
            };
            let spec = match crate::config::parse_replica_flag("replica", &flag) {
                Ok(s) => s,
                Err(e) => return error(400, "invalid_request_error", &e.0),
            };
            let url = spec.url.clone();
            match control.add(spec) {
                Ok(slot) => {
                    eprintln!("kvlb: admin: replica {url} added (slot {slot})");
                    (200, "application/json", serde_json::json!({"status": "ok", "url": url, "slot": slot}).to_string())
                }
                Err(e) => error(409, "conflict", &e),
            }
        }
        ("POST", "/replicas/drain") | ("POST", "/replicas/remove") | ("DELETE", "/replicas") => {
            if let Err(r) = authorized(shared, auth) {
                return r;
            }
            let url = match replica_from_body(body, false) {
                Ok(f) => f,
                Err(r) => return r,
            };
            let remove = path != "/replicas/drain";
            match control.drain(&url, remove) {
                Ok(slot) => {
                    let what = if remove { "removing (drains first)" } else { "draining" };
                    eprintln!("kvlb: admin: replica {url} {what}");
                    (200, "application/json", serde_json::json!({"status": "ok", "url": url, "slot": slot, "state": shared.fleet.slot(slot).state_name()}).to_string())
                }
                Err(e) => error(404, "not_found", &e),
            }
        }
        ("GET" | "HEAD", _) => get(path, shared),
        _ => error(405, "invalid_request_error", "unsupported method for this admin path (GET /metrics, /healthz, /replicas; POST /reload, /replicas, /replicas/drain, /replicas/remove)"),
    }
}

fn get(path: &str, shared: &Shared) -> Reply {
    match path {
        "/metrics" => {
            let urls: Vec<String> = (0..shared.fleet.capacity())
                .map(|i| {
                    shared
                        .fleet
                        .slot(i)
                        .spec()
                        .map(|r| r.url.clone())
                        .unwrap_or_default()
                })
                .collect();
            let mut text = metrics::render(&shared.workers, &shared.loads, &urls);
            let draining = shared.draining.load(Relaxed) as u8;
            text.push_str("# HELP kvlb_draining 1 while kvlb drains after SIGTERM.\n# TYPE kvlb_draining gauge\n");
            text.push_str(&format!("kvlb_draining {draining}\n"));
            text.push_str("# HELP kvlb_queue_waiting Requests waiting for a replica below its concurrency limit.\n# TYPE kvlb_queue_waiting gauge\n");
            text.push_str(&format!(
                "kvlb_queue_waiting {}\n",
                shared.queued.load(Relaxed)
            ));
            text.push_str("# HELP kvlb_body_memory_bytes Request body bytes held now, over all workers (bounded by max_body_memory).\n# TYPE kvlb_body_memory_bytes gauge\n");
            text.push_str(&format!(
                "kvlb_body_memory_bytes {}\n",
                shared.body_memory.load(Relaxed)
            ));
            let queued: u64 = shared.workers.iter().map(|w| w.queued.load(Relaxed)).sum();
            text.push_str("# HELP kvlb_queued_total Requests that waited in the queue.\n# TYPE kvlb_queued_total counter\n");
            text.push_str(&format!("kvlb_queued_total {queued}\n"));
            let now = shared.now_ms();
            text.push_str("# HELP kvlb_replica_up 1 while the replica takes new requests (active, not ejected, passing health checks).\n# TYPE kvlb_replica_up gauge\n");
            for (i, url) in urls.iter().enumerate() {
                if !url.is_empty() {
                    let up = shared.fleet.slot(i).available(now) as u8;
                    text.push_str(&format!("kvlb_replica_up{{replica=\"{url}\"}} {up}\n"));
                }
            }
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
                .fleet
                .slots()
                .filter_map(|(i, slot)| slot.spec().map(|r| (i, slot, r)))
                .map(|(i, slot, r)| {
                    let load = &shared.loads[i];
                    let responses: u64 = shared
                        .workers
                        .iter()
                        .map(|w| {
                            w.replicas[i]
                                .responses
                                .iter()
                                .map(|c| c.load(Relaxed))
                                .sum::<u64>()
                        })
                        .sum();
                    serde_json::json!({
                        "url": r.url,
                        "slot": i,
                        "address": r.addr.to_string(),
                        "state": slot.state_name(),
                        "in_flight": load.in_flight.load(Relaxed),
                        "available": slot.available(now),
                        "ejected": slot.down_until_ms.load(Relaxed) > now,
                        "health_check_ok": slot.check_ok.load(Relaxed),
                        "responses": responses,
                        "resident_blocks": shared.residency.replica_blocks(i),
                        "reported_blocks": shared.residency.reported_blocks(i),
                        "telemetry": shared.telemetry[i].to_json(now),
                    })
                })
                .collect();
            let body = serde_json::json!({
                "policy": shared.cfg().policy.as_str(),
                "replicas": list,
            });
            (200, "application/json", body.to_string())
        }
        _ => error(
            404,
            "not_found",
            "unknown admin path; try /metrics, /healthz or /replicas",
        ),
    }
}
