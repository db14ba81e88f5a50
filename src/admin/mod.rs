//! The admin listener: `/metrics` (Prometheus text), `/healthz` and `/replicas` (JSON), and the
//! changing endpoints, which need `Authorization: Bearer <admin_token>` (disabled without a
//! configured token): `POST /reload`, `POST /replicas` (add: `{"url": ..., options}`),
//! `POST /replicas/drain` and `POST /replicas/remove` or `DELETE /replicas` (`{"url": ...}`).
//! It is off the request path and listens on loopback unless configured otherwise.
//!
//! One accept thread hands each connection to a short-lived thread of its own (small stack),
//! so a slow or stalled client never holds up another one, a liveness probe least of all. Each
//! connection has `READ_DEADLINE` in all to send its head and body (the read timeout shrinks
//! to what is left of it before every read, so trickling bytes does not extend it) and then
//! `WRITE_DEADLINE` to take the reply; one whose request runs out of time is answered 408 (if
//! that can still be written) and closed. At most `MAX_CONNECTIONS` are served at once: the
//! accept thread answers any beyond that 503 at once and closes it, non-blocking, never waiting
//! on the client.
//! Refusals and timeouts are counted in `/metrics` and logged to stderr, at most one line a
//! second of each.
//!
//! Connections run concurrently: GETs read shared state only, and the changing endpoints go
//! through `Control`, whose methods serialise themselves (one mutex for signals, discovery,
//! the health thread and admin requests), so no lock here stands before a GET. A changing
//! request runs on a helper thread with a full-size stack, as reloading parses the
//! configuration and may load a tokenizer and compile a chat template.

#![forbid(unsafe_code)]

mod metrics;

use crate::control::Control;
use crate::log_limit::LogLimit;
use crate::worker::Shared;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::{AcqRel, Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Admin connections served at once; the accept thread answers any more 503.
const MAX_CONNECTIONS: usize = 64;
/// Time from accept for a connection to send its whole request, head and body.
const READ_DEADLINE: Duration = Duration::from_secs(5);
/// Time for a connection to take its reply.
const WRITE_DEADLINE: Duration = Duration::from_secs(5);
/// Stack of a connection thread: parsing a head and rendering a GET's reply are shallow.
const CONNECTION_STACK_BYTES: usize = 256 * 1024;
/// Stack of the thread that runs a changing request: the default of a Rust thread, as a
/// reload parses the configuration and may load a tokenizer and compile a chat template.
const CHANGE_STACK_BYTES: usize = 2 * 1024 * 1024;

/// The listener's state, shared by the accept thread and the connection threads.
struct Admin {
    shared: Arc<Shared>,
    control: Arc<Control>,
    /// Connections being served (each holds a `Place`).
    open: AtomicUsize,
    /// Refused and timed-out connections, shown on /metrics.
    counters: Arc<metrics::AdminCounters>,
    /// Every family /metrics shows, encoded on each scrape.
    registry: crate::metrics::Registry,
    refused_log: LogLimit,
    timeout_log: LogLimit,
}

/// One of the `MAX_CONNECTIONS` places, given back when dropped (also when the thread
/// panics, or never starts).
struct Place(Arc<Admin>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, AcqRel);
    }
}

/// Prints `kvlb: admin: {line}` unless a line of this kind was printed less than a second ago.
fn log_limited(limit: &LogLimit, line: impl FnOnce() -> String) {
    if let Some(held) = limit.allow() {
        eprintln!("kvlb: admin: {}{}", line(), crate::log_limit::more(held));
    }
}

pub fn spawn(listener: TcpListener, shared: Arc<Shared>, control: Arc<Control>) {
    let counters = Arc::new(metrics::AdminCounters::default());
    let registry = metrics::registry(&shared, &counters);
    let admin = Arc::new(Admin {
        shared,
        control,
        open: AtomicUsize::new(0),
        counters,
        registry,
        refused_log: LogLimit::new(),
        timeout_log: LogLimit::new(),
    });
    std::thread::Builder::new()
        .name("kvlb-admin".into())
        .spawn(move || accept_loop(listener, admin))
        .expect("spawn admin thread");
}

fn accept_loop(listener: TcpListener, admin: Arc<Admin>) {
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                if e.kind() != ErrorKind::Interrupted {
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
        };
        let accepted = Instant::now();
        // Only this thread takes places: the count can only fall until the next accept.
        if admin.open.fetch_add(1, AcqRel) >= MAX_CONNECTIONS {
            admin.open.fetch_sub(1, AcqRel);
            let why = format!(
                "kvlb's admin API serves {MAX_CONNECTIONS} connections at once and is at that \
                 limit; retry later"
            );
            refuse(&stream, peer, &admin, &why);
            continue;
        }
        let place = Place(admin.clone());
        // The thread shares the stream so that, should it not start, it can still be refused.
        let stream = Arc::new(stream);
        let theirs = stream.clone();
        let spawned = std::thread::Builder::new()
            .name("kvlb-admin-conn".into())
            .stack_size(CONNECTION_STACK_BYTES)
            .spawn(move || {
                let place = place;
                serve(&theirs, peer, accepted, &place.0);
            });
        if let Err(e) = spawned {
            // The closure, and with it the place, is dropped already.
            let why =
                format!("kvlb's admin API cannot start a connection thread ({e}); retry later");
            refuse(&stream, peer, &admin, &why);
        }
    }
}

/// Answers 503 (`why` its message) and closes, from the accept thread: non-blocking, never
/// waiting on the client.
fn refuse(s: &TcpStream, peer: SocketAddr, admin: &Admin, why: &str) {
    admin.counters.refused.fetch_add(1, Relaxed);
    log_limited(&admin.refused_log, || {
        format!("connection from {peer} refused: {why}")
    });
    let (status, ctype, body) = error(503, "service_unavailable", why);
    let reply = response(status, ctype, &body);
    if s.set_nonblocking(true).is_err() {
        return;
    }
    // Take in what the client sent already, so that closing with it unread does not reset
    // the connection under the reply (a bounded number of reads, none of them waiting).
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match (&*s).read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
    // One write: a new connection's send buffer takes a short reply whole.
    let _ = (&*s).write(&reply);
    let _ = s.shutdown(Shutdown::Write);
}

/// Why a connection ended before its reply was written.
enum Stop {
    /// The client closed, or the connection failed.
    Gone,
    /// The deadline passed.
    TimedOut,
}

/// Reads into `buf` before `deadline`: the read timeout is what is left of it.
fn read_by(s: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<usize, Stop> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Stop::TimedOut);
        }
        s.set_read_timeout(Some(left)).map_err(|_| Stop::Gone)?;
        match (&*s).read(buf) {
            Ok(n) => return Ok(n),
            // A timeout (or an early wake-up) is checked against the deadline above.
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return Err(Stop::Gone),
        }
    }
}

/// Writes all of `bytes` before `deadline`: the write timeout is what is left of it.
fn write_by(s: &TcpStream, mut bytes: &[u8], deadline: Instant) -> Result<(), Stop> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Stop::TimedOut);
        }
        s.set_write_timeout(Some(left)).map_err(|_| Stop::Gone)?;
        match (&*s).write(bytes) {
            Ok(0) => return Err(Stop::Gone),
            Ok(n) => bytes = &bytes[n..],
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return Err(Stop::Gone),
        }
    }
    Ok(())
}

/// One connection, on its own thread: one request, one reply, close.
fn serve(s: &TcpStream, peer: SocketAddr, accepted: Instant, admin: &Admin) {
    let timed_out = |what: &str| {
        admin.counters.timed_out.fetch_add(1, Relaxed);
        log_limited(&admin.timeout_log, || {
            format!("connection from {peer} timed out: {what}")
        });
    };
    let reply = match handle(s, accepted + READ_DEADLINE, admin) {
        Ok(reply) => reply,
        Err(Stop::Gone) => return,
        Err(Stop::TimedOut) => {
            timed_out(&format!("request not received within {READ_DEADLINE:?}"));
            let (status, ctype, body) = error(408, "timeout_error", "request not received in time");
            let _ = write_by(
                s,
                &response(status, ctype, &body),
                Instant::now() + WRITE_DEADLINE,
            );
            return;
        }
    };
    let (status, ctype, body) = reply;
    if let Err(Stop::TimedOut) = write_by(
        s,
        &response(status, ctype, &body),
        Instant::now() + WRITE_DEADLINE,
    ) {
        timed_out(&format!("reply not taken within {WRITE_DEADLINE:?}"));
    }
}

/// Largest admin request body (a replica description).
const MAX_BODY: usize = 64 * 1024;

type Reply = (u16, &'static str, String);

fn error(status: u16, kind: &str, message: &str) -> Reply {
    let body = serde_json::json!({"error": {"message": message, "type": kind}});
    (status, "application/json", body.to_string())
}

/// Reads one request (by `deadline`) and works out its reply.
fn handle(s: &TcpStream, deadline: Instant, admin: &Admin) -> Result<Reply, Stop> {
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    let head_end = loop {
        let n = read_by(s, &mut buf[len..], deadline)?;
        if n == 0 {
            return Err(Stop::Gone);
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
                        let got = read_by(s, &mut buf[len..want], deadline)?;
                        if got == 0 {
                            return Err(Stop::Gone);
                        }
                        len += got;
                    }
                    let body = &buf[head_end..want];
                    let route = || route(&method, &path, auth.as_deref(), body, admin);
                    if matches!(method.as_str(), "POST" | "DELETE") {
                        on_change_stack(route)
                    } else {
                        route()
                    }
                }
            }
        }
        _ => error(400, "invalid_request_error", "malformed request"),
    };
    Ok(reply)
}

/// Runs a changing request on a thread with a full-size stack, and waits for it.
fn on_change_stack(route: impl FnOnce() -> Reply + Send) -> Reply {
    std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .name("kvlb-admin-ctl".into())
            .stack_size(CHANGE_STACK_BYTES)
            .spawn_scoped(scope, route);
        match thread.map(|t| t.join()) {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => error(500, "internal_error", "the admin request failed"),
            Err(e) => error(
                503,
                "service_unavailable",
                &format!("cannot start a thread for the admin request: {e}"),
            ),
        }
    })
}

/// A whole reply: head and body.
fn response(status: u16, ctype: &str, body: &str) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Bad Request",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
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
            // A list (`models`) is the flag's NAME|NAME.
            serde_json::Value::Array(items) if items.iter().all(|i| i.is_string()) => items
                .iter()
                .filter_map(|i| i.as_str())
                .collect::<Vec<_>>()
                .join("|"),
            _ => {
                return Err(error(
                    400,
                    "invalid_request_error",
                    &format!("{k}: expected a string, number, boolean or list of strings"),
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

fn route(method: &str, path: &str, auth: Option<&str>, body: &[u8], admin: &Admin) -> Reply {
    let (shared, control) = (&*admin.shared, &*admin.control);
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
            if spec.dp_size > 1 {
                // One slot per rank; the ranks added before a refusal stay (each is named).
                let mut added = Vec::new();
                for rank in spec.ranks() {
                    let name = rank.url.clone();
                    match control.add(rank) {
                        Ok(slot) => {
                            eprintln!("kvlb: admin: replica {name} added (slot {slot})");
                            added.push(serde_json::json!({"url": name, "slot": slot}));
                        }
                        Err(e) => {
                            let e = format!("{e} (added before: {})", serde_json::Value::from(added));
                            return error(409, "conflict", &e);
                        }
                    }
                }
                return (200, "application/json", serde_json::json!({"status": "ok", "url": url, "ranks": added}).to_string());
            }
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
        ("GET" | "HEAD", _) => get(path, admin),
        _ => error(405, "invalid_request_error", "unsupported method for this admin path (GET /metrics, /healthz, /replicas; POST /reload, /replicas, /replicas/drain, /replicas/remove)"),
    }
}

fn get(path: &str, admin: &Admin) -> Reply {
    let shared = &*admin.shared;
    match path {
        "/metrics" => (
            200,
            crate::metrics::CONTENT_TYPE,
            crate::metrics::render(&admin.registry),
        ),
        "/healthz" => {
            if shared.draining.load(Relaxed) {
                (503, "application/json", r#"{"status":"draining"}"#.into())
            } else {
                (200, "application/json", r#"{"status":"ok"}"#.into())
            }
        }
        "/replicas" => {
            let calibration_json =
                |p: &crate::estimate::calibrate::ReplicaPace,
                 t: &crate::telemetry::ReplicaTelemetry| {
                    let pace = p.load();
                    serde_json::json!({
                        "prefill_pace": pace.prefill,
                        "decode_pace": pace.decode,
                        "queue_pace": pace.queue,
                        "measured": p.measured(),
                        "ttft_samples": p.ttft_samples.load(Relaxed),
                        "decode_samples": p.decode_samples.load(Relaxed),
                        "metrics_samples": p.metrics_samples.load(Relaxed),
                        "metrics_skipped": {
                            "reset": t.prefill_skipped_reset.load(Relaxed),
                            "no_work": t.prefill_skipped_no_work.load(Relaxed),
                            "own_samples": t.prefill_skipped_own.load(Relaxed),
                        },
                        "outliers": p.outliers.load(Relaxed),
                        "ttft_observed_over_estimated": p.observed_over_estimated(),
                    })
                };
            let now = shared.now_ms();
            let models = shared.models.load();
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
                        "rank": r.dp_rank,
                        "role": r.role.as_str(),
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
                        // The names it serves (null: not known; it takes any model).
                        "models": models
                            .covers(i, slot.epoch.load(Relaxed))
                            .then(|| models.names_of(i))
                            .flatten(),
                        "telemetry": shared.telemetry[i].to_json(now),
                        "calibration": calibration_json(&shared.pace[i], &shared.telemetry[i]),
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
