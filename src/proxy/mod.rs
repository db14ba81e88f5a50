//! A client connection's life: read a request (head strictly parsed, body de-chunked in place),
//! select a replica, forward over a pooled keep-alive connection, and relay the response as it
//! arrives (SSE chunks are never held back). Errors before the first response byte become
//! OpenAI-style JSON errors; a client that goes away cancels its replica request by closing
//! that connection.
//!
//! Buffers come from the worker's pool and go back to it, so a warm keep-alive connection
//! allocates nothing per request.
//!
//! The phases of a request, in order, each in its own file:
//! - `read`: the head and body received from the client, and the local errors and refusals;
//! - `route`: kvlb's own probes, the choice of a replica, the wait for capacity;
//! - `forward`: the request sent upstream and the response head read back (or the failure
//!   answered);
//! - `relay`: the response body relayed to the client;
//! - `log`: the access log line.
//!
//! This file holds the connection loop that runs them and the types they share (`Conn`,
//! `End`); `watch` receives from the client, `in_flight` counts a request at its replica.

#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use crate::http::request::{self, Method, RequestHead};
use crate::http::{ErrorShape, HttpError};
use crate::metrics;
use crate::models::ModelKey;
use crate::rt::op;
use crate::worker::{InFlight, Leg, ModelRoute, RequestModel, Worker};
use forward::{fail, forward, rebuild_upstream_head, Forwarded};
use log::{log_request, LogState};
use read::{
    body_in_hand, consume_request, read_body, recv_client, refuse_request, refuse_unread,
    release_body, send_local_error,
};
use route::{models_answer, probe_state, route, wait_for_capacity, Route};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use watch::ClientWatch;

mod forward;
mod log;
mod pd;
mod read;
mod relay;
mod route;
mod watch;

struct Conn {
    fd: RawFd,
    /// The `x-kvlb-decision` line of the current request (when explain is on).
    explain: [u8; 256],
    explain_len: usize,
    client_ip: Option<IpAddr>,
    cbuf: Vec<u8>,
    obuf: Vec<u8>,
    ubuf: Vec<u8>,
    /// All receives from the client go through here (see `watch`).
    watch: ClientWatch,
    /// What the access log says of the current request (set as it goes).
    log: LogState,
    /// Body bytes the current request holds of the worker's and kvlb's body memory.
    reserved: usize,
    /// The shape of kvlb's own error answers to the current request (its API's).
    shape: ErrorShape,
}

/// Answer a connection over the limit with 503 and close it.
pub async fn refuse(w: Rc<Worker>, fd: RawFd) {
    w.stats().local_error(503);
    let _ = op::send_static(fd, HttpError::Overloaded.response()).await;
    op::close(fd);
}

pub async fn serve_connection(w: Rc<Worker>, fd: RawFd, peer: Option<SocketAddr>) {
    w.open.set(w.open.get() + 1);
    metrics::add(&w.stats().open_connections, 1);
    let mut conn = Conn {
        fd,
        explain: [0; 256],
        explain_len: 0,
        client_ip: peer.map(|p| p.ip()),
        cbuf: w.take_buf(),
        obuf: w.take_buf(),
        ubuf: w.take_buf(),
        watch: ClientWatch::new(fd),
        log: LogState::default(),
        reserved: 0,
        shape: ErrorShape::OpenAi,
    };
    let _ = connection_loop(&w, &mut conn).await;
    release_body(&w, &mut conn);
    if let Some(b) = conn.watch.finish() {
        w.give_buf(b);
    }
    // Safety: linger-free close of our own socket; shutdown first so a client still sending
    // sees the end instead of a reset where possible.
    unsafe { libc::shutdown(fd, libc::SHUT_WR) };
    op::close(fd);
    w.give_buf(std::mem::take(&mut conn.cbuf));
    w.give_buf(std::mem::take(&mut conn.obuf));
    w.give_buf(std::mem::take(&mut conn.ubuf));
    w.open.set(w.open.get() - 1);
    metrics::sub(&w.stats().open_connections, 1);
}

/// Why a connection ends.
enum End {
    /// Close the client connection.
    Close,
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(crate::rt::now())
        .max(Duration::from_millis(1))
}

async fn connection_loop(w: &Rc<Worker>, conn: &mut Conn) -> End {
    loop {
        // The configuration in force for this request (a reload may change it between two).
        let shared_cfg = w.cfg();
        let cfg = &*shared_cfg;
        release_body(w, conn);
        // Wait for the first bytes of the next request.
        if conn.cbuf.is_empty() {
            if w.draining.get() {
                return End::Close;
            }
            let slot = w.idle_client_enter(conn.fd);
            // Idle: the buffers go back to the worker's pool until the client sends again.
            w.give_buf(std::mem::take(&mut conn.cbuf));
            w.give_buf(std::mem::take(&mut conn.obuf));
            w.give_buf(std::mem::take(&mut conn.ubuf));
            conn.watch.wait_ready(cfg.timeouts.idle).await;
            conn.cbuf = w.take_buf();
            conn.obuf = w.take_buf();
            conn.ubuf = w.take_buf();
            let r = conn
                .watch
                .recv_into(&mut conn.cbuf, cfg.timeouts.idle)
                .await;
            w.idle_client_leave(slot);
            match r {
                Ok(n) if n > 0 => {}
                _ => return End::Close,
            }
        }
        let received_at = crate::rt::now();
        conn.log = LogState::default();
        conn.shape = ErrorShape::OpenAi;
        let deadline = received_at + cfg.timeouts.client;
        let max_head = cfg.limits.max_header_bytes;

        // The head.
        let mut scanned: usize = 0;
        let head_end = loop {
            let from = scanned.saturating_sub(3);
            if let Some(e) = request::find_head_end(&conn.cbuf[from..]) {
                let e = e + from;
                if e > max_head {
                    return send_local_error(w, conn, HttpError::HeaderTooLarge).await;
                }
                break e;
            }
            scanned = conn.cbuf.len();
            if scanned > max_head {
                return send_local_error(w, conn, HttpError::HeaderTooLarge).await;
            }
            match recv_client(conn, deadline).await {
                Ok(0) => return End::Close,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    return send_local_error(w, conn, HttpError::RequestTimeout).await
                }
                Err(_) => return End::Close,
            }
        };
        let head =
            match request::parse_request(&conn.cbuf, head_end, conn.client_ip, &mut conn.obuf) {
                Ok(h) => h,
                Err(e) => return send_local_error(w, conn, e).await,
            };
        conn.shape = ErrorShape::of_target(&conn.cbuf[head.target.0..head.target.1]);

        // kvlb's own probes answer without a key.
        if let Some(probe) = probe_state(w, cfg, conn, &head) {
            let reply = probe.response(head.method == Method::Head);
            conn.log.status = probe.status();
            log_request(w, conn, Some((&head, head.head_len)), &[], received_at);
            let sent = op::send_static(conn.fd, reply).await.is_ok();
            consume_request(conn, head.head_len);
            if sent && head.keep_alive && !w.draining.get() {
                continue;
            }
            return End::Close;
        }

        // Client API keys, when configured: checked on the head, so a client without a key
        // is never invited to send a body (no 100 Continue) and never has one buffered.
        if !cfg.api_keys.is_empty()
            && !cfg
                .api_keys
                .accepts(&conn.cbuf[head.bearer.0..head.bearer.1])
        {
            metrics::add(&w.stats().requests, 1);
            // Logged first: the refusal drops the request's bytes from cbuf.
            conn.log.status = HttpError::Unauthorized.status();
            log_request(w, conn, Some((&head, head.head_len)), &[], received_at);
            match body_in_hand(conn, &head) {
                Some(req_end) => {
                    match refuse_request(w, conn, HttpError::Unauthorized, &head, req_end).await {
                        true => continue,
                        false => return End::Close,
                    }
                }
                None => return refuse_unread(w, conn, HttpError::UnauthorizedUnread).await,
            }
        }

        // The body, whole, de-chunked in place.
        let (body_end, req_end) = match read_body(w, conn, &head, deadline).await {
            Ok(v) => v,
            Err(end) => return end,
        };
        metrics::add(&w.stats().requests, 1);

        w.refresh();
        // The fleet's models, answered by kvlb itself once the replicas' lists are known.
        if let Some(status) = models_answer(w, conn, &head) {
            if status != 200 {
                w.stats().local_error(status);
            }
            conn.log.status = status;
            log_request(w, conn, Some((&head, body_end)), &[], received_at);
            match send_answer(w, conn, &head, req_end).await {
                true => continue,
                false => return End::Close,
            }
        }
        // Hash the prompt's prefix blocks once (no allocation: the worker's buffers are reused).
        let parsed = head.method == Method::Post
            && w.hash_prompt(
                &conn.cbuf[head.target.0..head.target.1],
                &conn.cbuf[head.head_len..body_end],
            );
        // Only replicas serving the request's model may take it; a model none serves is
        // OpenAI's 404.
        let (model, class) = w.request_model(&conn.cbuf[head.head_len..body_end], parsed);
        conn.log.model = Some(class.label);
        let model = match model {
            RequestModel::Route(key) => Ok(ModelRoute {
                key,
                class,
                adapter: None,
                pin: None,
                leg: Leg::Whole,
            }),
            RequestModel::Adapter(i) => {
                let route = ModelRoute {
                    key: ModelKey::Named(w.shared.on_demand.adapters[i].key),
                    class,
                    adapter: Some(i as u16),
                    pin: None,
                    leg: Leg::Whole,
                };
                // No replica holds it or may load it now: say why.
                match w.fill_candidates(&[], route) {
                    (0, 0) => Err((503, w.adapter_unavailable(i))),
                    _ => Ok(route),
                }
            }
            RequestModel::NotServed => {
                crate::model_watch::NOT_FOUND.fetch_add(1, Relaxed);
                Err((404, String::new()))
            }
        };
        let model = match model {
            // A conversation continued: to the replica that stored its previous response.
            Ok(model) => ModelRoute {
                pin: w.response_pin(
                    head.method,
                    &conn.cbuf[head.target.0..head.target.1],
                    &conn.cbuf[head.head_len..body_end],
                ),
                ..model
            },
            Err((status, why)) => {
                let served =
                    refuse_unserved(w, conn, &head, body_end, req_end, received_at, status, &why);
                match served.await {
                    true => continue,
                    false => return End::Close,
                }
            }
        };
        // A model with prefill and decode replicas: prefilled on one, continued on the other.
        let (mut model, mut body_end, mut req_end) = (model, body_end, req_end);
        // A replica chosen already for the first attempt (`pd::Prefilled::Direct`).
        let mut preset = None;
        if w.has_prefill.get() && pd::eligible(conn, &head, parsed) {
            match pd::prefill(
                w,
                conn,
                &head,
                head_end,
                body_end,
                req_end,
                parsed,
                model,
                received_at,
            )
            .await
            {
                Ok(pd::Prefilled::Decode {
                    body_end: b,
                    req_end: r,
                    prefill,
                    sent,
                }) => {
                    (body_end, req_end) = (b, r);
                    model.leg = Leg::Decode;
                    conn.log.prefill = Some(prefill);
                    if let Some((routed, up)) = sent {
                        preset = Some((routed, conn.explain_len, Some(up)));
                    }
                }
                Ok(pd::Prefilled::Whole) => {}
                Ok(pd::Prefilled::Direct(routed, explain_len)) => {
                    preset = Some((routed, explain_len, None))
                }
                Ok(pd::Prefilled::Unavailable(why)) => {
                    let served =
                        refuse_unserved(w, conn, &head, body_end, req_end, received_at, 503, why);
                    match served.await {
                        true => continue,
                        false => return End::Close,
                    }
                }
                Err(end) => return end,
            }
        }
        let body_len = body_end - head.head_len;
        // Select and forward; a failure at connect time or an immediate 503 is retried on
        // another replica while nothing has reached the client.
        let mut tried = [usize::MAX; MAX_ATTEMPTS];
        let mut attempts = 0;
        let max_attempts = (cfg.health.retries as usize + 1).min(MAX_ATTEMPTS);
        let mut last_failure = None;
        let outcome = loop {
            if attempts > 0 {
                rebuild_upstream_head(conn, head_end);
            }
            let mut sent = None;
            let chosen = match preset.take() {
                Some((routed, explain_len, up)) => {
                    sent = up;
                    Route::To(routed, explain_len)
                }
                None => route(w, conn, &head, body_end, parsed, &tried[..attempts], model),
            };
            let (routed, explain_len) = match chosen {
                Route::To(r, e) => (r, e),
                Route::AllBusy => match wait_for_capacity(w, &tried[..attempts], model).await {
                    Ok(()) => continue,
                    Err(e) => {
                        // Logged first: the refusal drops the request's bytes from cbuf.
                        conn.log.status = e.status();
                        log_request(w, conn, Some((&head, body_end)), &[], received_at);
                        match refuse_request(w, conn, e, &head, req_end).await {
                            true => break Forwarded::Refused,
                            false => return End::Close,
                        }
                    }
                },
                Route::NoneLeft => match last_failure.take() {
                    None => {
                        let e = HttpError::NoReplica;
                        w.stats().local_error(e.status());
                        conn.log.status = e.status();
                        log_request(
                            w,
                            conn,
                            Some((&head, body_end)),
                            &tried[..attempts],
                            received_at,
                        );
                        let _ = op::send_static(conn.fd, e.response_in(conn.shape)).await;
                        return End::Close;
                    }
                    Some((r, f)) => break Forwarded::Failed(r, f, false),
                },
            };
            conn.explain_len = explain_len;
            routed.finish_head(conn, &head, body_len);
            let replica = routed.replica;
            tried[attempts] = replica;
            attempts += 1;
            let may_retry = attempts < max_attempts && !w.draining.get();
            let forwarded = forward(
                w,
                conn,
                routed,
                &head,
                body_end,
                received_at,
                may_retry,
                sent,
            );
            match forwarded.await {
                Forwarded::Failed(r, f, true) if may_retry => {
                    metrics::add(&w.stats().replicas[r].retries, 1);
                    last_failure = Some((r, f));
                    continue;
                }
                other => break other,
            }
        };
        let outcome = match outcome {
            Forwarded::Failed(r, f, _) => fail(w, conn, r, f).await,
            // Answered (429) and the request bytes dropped already (and logged).
            Forwarded::Refused => continue,
            other => other,
        };
        log_request(
            w,
            conn,
            Some((&head, body_end)),
            &tried[..attempts],
            received_at,
        );
        let stats = w.stats();
        stats
            .allocations
            .store(crate::alloc::thread_allocations(), Relaxed);
        let (throttled, short) = crate::rt::multishot_stats();
        stats.recv_throttled.store(throttled, Relaxed);
        stats.recv_buffer_shortages.store(short, Relaxed);

        consume_request(conn, req_end);
        match outcome {
            Forwarded::KeepAlive if head.keep_alive && !w.draining.get() => continue,
            _ => return End::Close,
        }
    }
}

/// Answer a request no replica may take now: 404 for a model none serves (`status`), 503 with
/// `why` otherwise; returns whether the connection carries on.
#[allow(clippy::too_many_arguments)]
async fn refuse_unserved(
    w: &Worker,
    conn: &mut Conn,
    head: &RequestHead,
    body_end: usize,
    req_end: usize,
    received_at: Instant,
    status: u16,
    why: &str,
) -> bool {
    w.stats().local_error(status);
    conn.log.status = status;
    log_request(w, conn, Some((head, body_end)), &[], received_at);
    conn.obuf.clear();
    if status == 404 {
        let name = w.prefix.borrow().model.shown().into_owned();
        crate::http::write_model_not_found_in(&mut conn.obuf, conn.shape, &name);
    } else {
        crate::http::write_error_in(
            &mut conn.obuf,
            conn.shape,
            503,
            "Service Unavailable",
            "service_unavailable",
            why,
            None,
            false,
        );
    }
    send_answer(w, conn, head, req_end).await
}

/// Send kvlb's own answer to the request ending at `req_end`, written in `conn.obuf` (the
/// request logged already), and drop the request; returns whether the connection carries on.
async fn send_answer(
    w: &Worker,
    conn: &mut Conn,
    head: &request::RequestHead,
    req_end: usize,
) -> bool {
    let n = conn.obuf.len();
    let (r, b) = op::send_all(conn.fd, std::mem::take(&mut conn.obuf), 0, n).await;
    conn.obuf = b;
    consume_request(conn, req_end);
    r.is_ok() && head.keep_alive && !w.draining.get()
}

/// Most replicas one request is tried on (the first and its retries).
const MAX_ATTEMPTS: usize = 8;

/// A failure before anything reached the client.
pub(super) enum UpstreamFailure {
    Connect(io::Error),
    /// The replica closed or reset the connection before a response head.
    Closed,
    Timeout,
    Invalid,
    ClientGone,
    /// The replica answered 503 at once (overloaded or shutting down); its answer was dropped
    /// to try another replica, and none was left.
    Unavailable,
    /// A LoRA adapter kvlb was loading there for the request could not be loaded.
    AdapterLoad(String),
}

impl UpstreamFailure {
    /// A failure of the replica (not of the client): counts towards its ejection.
    pub(super) fn counts_against_replica(&self) -> bool {
        !matches!(
            self,
            UpstreamFailure::ClientGone | UpstreamFailure::AdapterLoad(_)
        )
    }
}
