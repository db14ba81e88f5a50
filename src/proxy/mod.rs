//! A client connection's life: read a request (head strictly parsed, body de-chunked in place),
//! select a replica, forward over a pooled keep-alive connection, and relay the response as it
//! arrives (SSE chunks are never held back). Errors before the first response byte become
//! OpenAI-style JSON errors; a client that goes away cancels its replica request by closing
//! that connection.
//!
//! Buffers come from the worker's pool and go back to it, so a warm keep-alive connection
//! allocates nothing per request.

#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use crate::http::chunked::ChunkedDecoder;
use crate::http::request::{self, BodyFraming, Method, RequestHead};
use crate::http::response::{self, ClientFraming, ResponseBody, ResponseError};
use crate::http::{write_error, HttpError};
use crate::metrics;
use crate::rt::op;
use crate::rt::select::{select, Either};
use crate::select::Decision;
use crate::worker::{InFlight, Upstream, Worker, SMALL_BODY};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use watch::ClientWatch;

mod watch;
use crate::config::ReplicaConfig;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bodies up to this size are sent upstream in the same write as the head.
const COALESCE_BODY: usize = 16 * 1024;
/// Most bytes of a replica's response head.
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

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
}

/// The parts of a request's access log line learnt on its way (see `crate::access_log`).
#[derive(Default, Clone, Copy)]
struct LogState {
    /// The status sent to the client (0: none yet; 499: the client left first).
    status: u16,
    /// Microseconds from the request received to the replica's response head.
    ttfb_us: Option<u64>,
    reason: Option<&'static str>,
    matched_tokens: u32,
    prompt_tokens: u32,
    /// The response was cut short after its head was sent (`Cut::label`).
    cut: Option<&'static str>,
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

/// Write `x-kvlb-decision: ...\r\n` into `buf`; returns its length (0 if it does not fit).
fn write_decision(buf: &mut [u8; 256], d: &Decision, prompt_tokens: u32) -> usize {
    use std::io::Write;
    let cap = buf.len();
    let mut cur = std::io::Cursor::new(&mut buf[..]);
    let runner_up_ms = if d.runner_up_ttft_s.is_finite() {
        d.runner_up_ttft_s * 1e3
    } else {
        -1.0
    };
    let ok = write!(
        cur,
        "x-kvlb-decision: reason={}; matched_tokens={}; offloaded_blocks={}; prompt_tokens={}; ttft_ms={:.1}; runner_up_ttft_ms={:.1}; spilled={}\r\n",
        d.reason.as_str(),
        d.matched_tokens,
        d.offloaded_blocks,
        prompt_tokens,
        d.ttft_s * 1e3,
        runner_up_ms,
        d.spilled
    )
    .is_ok();
    let n = cur.position() as usize;
    if ok && n < cap {
        n
    } else {
        0
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(crate::rt::now())
        .max(Duration::from_millis(1))
}

/// Receive more client bytes into cbuf before `deadline` (the receive grows it as needed).
async fn recv_client(conn: &mut Conn, deadline: Instant) -> io::Result<usize> {
    conn.watch
        .recv_into(&mut conn.cbuf, remaining(deadline))
        .await
}

async fn send_local_error(w: &Worker, conn: &mut Conn, e: HttpError) -> End {
    w.stats().local_error(e.status());
    conn.log.status = e.status();
    log_request(w, conn, None, &[], crate::rt::now());
    let _ = op::send_static(conn.fd, e.response()).await;
    End::Close
}

/// Write the current request's access log line, when the access log is on. `head` is None
/// when the request could not be parsed; `tried` are the replicas it was sent to, last one
/// last.
fn log_request(
    w: &Worker,
    conn: &Conn,
    head: Option<(&RequestHead, usize)>,
    tried: &[usize],
    received_at: Instant,
) {
    let log = w.access_log.borrow();
    let Some(log) = log.as_ref() else { return };
    let spec = tried.last().and_then(|&r| w.shared.fleet.slot(r).spec());
    // Slices taken with `get`: the request's bytes are still in cbuf here, but a log line
    // must never be able to take a worker down.
    let (method, path, bytes_in): (&[u8], &[u8], usize) = match head {
        Some((h, body_end)) => {
            // The method is the request line's first word (an absolute-form target's path,
            // which `target` is, comes after the scheme and authority).
            let line = conn.cbuf.get(..h.target.0).unwrap_or(b"-");
            let start = line
                .iter()
                .position(|b| !b.is_ascii_whitespace())
                .unwrap_or(line.len());
            let line = &line[start..];
            let end = line.iter().position(|&b| b == b' ').unwrap_or(line.len());
            (
                &line[..end],
                conn.cbuf.get(h.target.0..h.target.1).unwrap_or(b""),
                body_end.saturating_sub(h.head_len),
            )
        }
        None => (b"-", b"", 0),
    };
    log.line(&crate::access_log::Record {
        client: conn.client_ip,
        method,
        path,
        status: conn.log.status,
        cut: conn.log.cut,
        replica: spec.as_ref().map(|s| s.url.as_str()),
        attempts: tried.len() as u32,
        reason: conn.log.reason,
        prompt_tokens: conn.log.prompt_tokens,
        matched_tokens: conn.log.matched_tokens,
        bytes_in,
        ttfb_us: conn.log.ttfb_us,
        total_us: crate::rt::now()
            .saturating_duration_since(received_at)
            .as_micros() as u64,
    });
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
        let body_len = body_end - head.head_len;
        metrics::add(&w.stats().requests, 1);

        w.refresh();
        // Hash the prompt's prefix blocks once (no allocation: the worker's buffers are reused).
        let parsed = head.method == Method::Post
            && w.hash_prompt(
                &conn.cbuf[head.target.0..head.target.1],
                &conn.cbuf[head.head_len..body_end],
            );

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
            let (routed, explain_len) =
                match route(w, conn, &head, body_end, parsed, &tried[..attempts]) {
                    Route::To(r, e) => (r, e),
                    Route::AllBusy => match wait_for_capacity(w, &tried[..attempts]).await {
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
                            let _ = op::send_static(conn.fd, e.response()).await;
                            return End::Close;
                        }
                        Some((r, f)) => break Forwarded::Failed(r, f, false),
                    },
                };
            conn.explain_len = explain_len;
            // The host header falls back to the replica's authority (HTTP/1.0 clients).
            if !head.has_host {
                conn.obuf.extend_from_slice(b"host: ");
                conn.obuf
                    .extend_from_slice(routed.spec.authority.as_bytes());
                conn.obuf.extend_from_slice(b"\r\n");
            }
            request::finish_upstream_head(&mut conn.obuf, head.method, body_len);
            let replica = routed.replica;
            tried[attempts] = replica;
            attempts += 1;
            let may_retry = attempts < max_attempts && !w.draining.get();
            match forward(w, conn, routed, &head, body_end, received_at, may_retry).await {
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

/// Most replicas one request is tried on (the first and its retries).
const MAX_ATTEMPTS: usize = 8;

/// Drop the request that ends at `req_end` from cbuf, keeping pipelined bytes for the next.
fn consume_request(conn: &mut Conn, req_end: usize) {
    let len = conn.cbuf.len();
    conn.cbuf.copy_within(req_end..len, 0);
    conn.cbuf.truncate(len - req_end);
    if conn.cbuf.capacity() > 1 << 20 && conn.cbuf.len() < 16 * 1024 {
        conn.cbuf.shrink_to(16 * 1024);
    }
}

/// What a chunked body reserves ahead of each receive.
const CHUNKED_STEP: usize = 256 * 1024;

/// Hold `total` body bytes for the current request: the growth over what it holds already is
/// taken from the worker's share of `max_body_memory` and from kvlb's total, or refused
/// (false) when either would be exceeded. Bodies up to `SMALL_BODY` take nothing.
fn reserve_body(w: &Worker, conn: &mut Conn, total: usize) -> bool {
    if total <= SMALL_BODY || total <= conn.reserved {
        return true;
    }
    if !w.take_body_memory(total - conn.reserved) {
        return false;
    }
    conn.reserved = total;
    true
}

/// Give back what the current request held of the body memory.
fn release_body(w: &Worker, conn: &mut Conn) {
    if conn.reserved > 0 {
        w.give_body_memory(conn.reserved);
        conn.reserved = 0;
        if conn.cbuf.capacity() > 1 << 20 {
            w.freed_large();
        }
    }
}

/// Where the request ends when its whole body is in cbuf already (a refusal can then keep
/// the connection); None when some of it is still to come.
fn body_in_hand(conn: &Conn, head: &RequestHead) -> Option<usize> {
    match head.body {
        BodyFraming::None => Some(head.head_len),
        BodyFraming::Length(n) => {
            let end = head.head_len as u64 + n;
            (conn.cbuf.len() as u64 >= end).then_some(end as usize)
        }
        BodyFraming::Chunked => None,
    }
}

/// After a refusal whose request body was not read, reading stops here: how long and how much
/// of it kvlb still takes in (and drops) before closing, so the close is not a reset that
/// could destroy the refusal before the client read it.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 16 << 20;

/// Refuse a request on its head, its body unread: send `e` (which says `connection: close`),
/// stop sending, drop what the client still sends for a moment, and close.
async fn refuse_unread(w: &Worker, conn: &mut Conn, e: HttpError) -> End {
    w.stats().local_error(e.status());
    if op::send_static(conn.fd, e.response()).await.is_err() {
        return End::Close;
    }
    // Safety: shutdown(2) of our own socket's sending side; the descriptor stays open.
    unsafe { libc::shutdown(conn.fd, libc::SHUT_WR) };
    let until = crate::rt::now() + LINGER;
    let mut dropped = 0;
    while dropped < LINGER_BYTES && crate::rt::now() < until {
        conn.cbuf.clear();
        match recv_client(conn, until).await {
            Ok(n) if n > 0 => dropped += n,
            _ => break,
        }
    }
    conn.cbuf.clear();
    End::Close
}

/// What kvlb answers to a probe of its own (`liveness_path`, `readiness_path`), if the
/// request is one: GET or HEAD without a body.
fn probe_state(
    w: &Worker,
    cfg: &crate::config::ServeConfig,
    conn: &Conn,
    head: &RequestHead,
) -> Option<ProbeState> {
    if !matches!(head.method, Method::Get | Method::Head) || head.body != BodyFraming::None {
        return None;
    }
    let target = &conn.cbuf[head.target.0..head.target.1];
    let path = match memchr::memchr(b'?', target) {
        Some(q) => &target[..q],
        None => target,
    };
    let is = |p: &Option<String>| p.as_deref().is_some_and(|p| p.as_bytes() == path);
    let state = if is(&cfg.probes.liveness) {
        ProbeState::Live
    } else if is(&cfg.probes.readiness) {
        let now = w.shared.now_ms();
        if w.draining.get() || w.shared.draining.load(Relaxed) {
            ProbeState::Draining
        } else if w.shared.fleet.slots().any(|(_, s)| s.available(now)) {
            ProbeState::Ready
        } else {
            ProbeState::NoReplica
        }
    } else {
        return None;
    };
    Some(state)
}

#[derive(Clone, Copy)]
enum ProbeState {
    Live,
    Ready,
    Draining,
    NoReplica,
}

impl ProbeState {
    fn status(self) -> u16 {
        match self {
            ProbeState::Live | ProbeState::Ready => 200,
            ProbeState::Draining | ProbeState::NoReplica => 503,
        }
    }

    /// The whole response, built once per process.
    fn response(self, head_only: bool) -> &'static [u8] {
        static TABLE: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
        let table = TABLE.get_or_init(|| {
            let mut t = Vec::new();
            for (status, body) in [
                ("200 OK", r#"{"status":"ok"}"#),
                ("200 OK", r#"{"status":"ready"}"#),
                ("503 Service Unavailable", r#"{"status":"draining"}"#),
                ("503 Service Unavailable", r#"{"status":"no replica available"}"#),
            ] {
                for head_only in [false, true] {
                    let mut r = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncache-control: no-store\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    if !head_only {
                        r.push_str(body);
                    }
                    t.push(r.into_bytes());
                }
            }
            t
        });
        &table[self as usize * 2 + head_only as usize]
    }
}

/// Answer a well-formed request with a refusal (401, 429) and drop it; returns whether the
/// connection carries on.
async fn refuse_request(
    w: &Worker,
    conn: &mut Conn,
    e: HttpError,
    head: &RequestHead,
    req_end: usize,
) -> bool {
    w.stats().local_error(e.status());
    conn.log.status = e.status();
    let sent = op::send_static(conn.fd, e.response()).await.is_ok();
    consume_request(conn, req_end);
    sent && head.keep_alive && e.keeps_connection() && !w.draining.get()
}

/// Wait, in the bounded queue, until some replica not in `tried` is below its concurrency
/// limit. Err: the 429 to answer (queue full, or waited `queue_timeout`).
async fn wait_for_capacity(w: &Worker, tried: &[usize]) -> Result<(), HttpError> {
    let cfg = w.cfg();
    let queued = &w.shared.queued;
    if queued.fetch_add(1, Relaxed) >= cfg.queue_size as u64 {
        queued.fetch_sub(1, Relaxed);
        return Err(HttpError::QueueFull);
    }
    metrics::add(&w.stats().queued, 1);
    let deadline = crate::rt::now() + cfg.queue_timeout;
    let mut pause = Duration::from_millis(1);
    let result = loop {
        op::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(8));
        if w.fill_candidates(tried).0 > 0 {
            break Ok(());
        }
        if crate::rt::now() >= deadline || w.draining.get() {
            break Err(HttpError::QueueTimeout);
        }
    };
    queued.fetch_sub(1, Relaxed);
    result
}

enum Route {
    /// Send it there (its concurrency slot taken), with the explain line's length.
    To(Routed, usize),
    /// Every replica left is at its concurrency limit.
    AllBusy,
    /// No replica left to try.
    NoneLeft,
}

/// Choose a replica for the request (not one of `tried`) and account for the decision.
/// Returns None when no replica is left to try.
fn route(
    w: &Worker,
    conn: &mut Conn,
    head: &RequestHead,
    body_end: usize,
    parsed: bool,
    tried: &[usize],
) -> Route {
    let cfg = w.cfg();
    match w.fill_candidates(tried) {
        (0, 0) => return Route::NoneLeft,
        (0, _) => return Route::AllBusy,
        _ => {}
    }
    let choice = w.choose(
        head.method,
        &conn.cbuf[head.target.0..head.target.1],
        &conn.cbuf[head.head_len..body_end],
        body_end - head.head_len,
        parsed,
    );
    let replica = choice.replica;
    let slot = w.shared.fleet.slot(replica);
    let epoch = slot.epoch.load(Relaxed);
    // The slot was emptied since the candidates were read: nothing to send there.
    let Some(spec) = slot.spec() else {
        return Route::NoneLeft;
    };
    // Take a concurrency slot there; another worker may have taken the last one since the
    // candidates were read.
    let cap = match slot.max_in_flight.load(Relaxed) {
        0 => cfg.max_in_flight,
        c => c,
    };
    let in_flight = &w.shared.loads[replica].in_flight;
    if in_flight.fetch_add(1, Relaxed) >= cap && cap > 0 {
        in_flight.fetch_sub(1, Relaxed);
        return Route::AllBusy;
    }
    let mut explain_len = 0;
    if let (Some(d), true) = (choice.decision, cfg.explain) {
        explain_len = write_decision(&mut conn.explain, &d, choice.prompt_tokens);
    }
    conn.log.reason = choice.decision.map(|d| d.reason.as_str());
    conn.log.matched_tokens = choice.decision.map_or(0, |d| d.matched_tokens);
    conn.log.prompt_tokens = choice.prompt_tokens;
    Route::To(
        Routed {
            replica,
            epoch,
            spec,
            prefill_tokens: choice.prefill_tokens(),
            estimate_s: choice.estimate_s(),
        },
        explain_len,
    )
}

/// Write the upstream request head into obuf again (a retry: the previous attempt's buffer
/// holds the failed replica's answer by now).
fn rebuild_upstream_head(conn: &mut Conn, head_end: usize) {
    conn.obuf.clear();
    // The head parsed before, unchanged in cbuf (de-chunking only rewrote the body).
    let _ = request::parse_request(&conn.cbuf, head_end, conn.client_ip, &mut conn.obuf);
}

/// Read the request body; returns (body_end, request_end) offsets in cbuf.
async fn read_body(
    w: &Worker,
    conn: &mut Conn,
    head: &RequestHead,
    deadline: Instant,
) -> Result<(usize, usize), End> {
    let max_body = w.cfg().limits.max_body_bytes;
    let start = head.head_len;
    match head.body {
        BodyFraming::None => Ok((start, start)),
        BodyFraming::Length(n) => {
            if n > max_body as u64 {
                return Err(send_local_error(w, conn, HttpError::BodyTooLarge).await);
            }
            let n = n as usize;
            if !reserve_body(w, conn, n) {
                return Err(refuse_body_memory(w, conn).await);
            }
            if head.expect_continue && conn.cbuf.len() == start {
                let _ = op::send_static(conn.fd, b"HTTP/1.1 100 Continue\r\n\r\n").await;
            }
            // A body that holds body memory gets its buffer at once, at its size: growing it by
            // doubling would leave the smaller copies with the allocator and take up to twice
            // the body. Its pages are touched, and count in RSS, only as bytes arrive. A small
            // body grows its pooled buffer with what arrives.
            let need = start + n;
            if n > SMALL_BODY && conn.cbuf.capacity() < need {
                conn.cbuf.reserve_exact(need - conn.cbuf.len());
            }
            while conn.cbuf.len() < need {
                match recv_client(conn, deadline).await {
                    Ok(0) => return Err(End::Close),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                        return Err(send_local_error(w, conn, HttpError::RequestTimeout).await)
                    }
                    Err(_) => return Err(End::Close),
                }
            }
            Ok((need, need))
        }
        BodyFraming::Chunked => {
            if head.expect_continue && conn.cbuf.len() == start {
                let _ = op::send_static(conn.fd, b"HTTP/1.1 100 Continue\r\n\r\n").await;
            }
            let mut dec = ChunkedDecoder::new();
            let mut write = start;
            let mut read = start;
            loop {
                let fed = {
                    let mut spans = w.spans.borrow_mut();
                    spans.clear();
                    let fed = dec.feed(&conn.cbuf[read..], |s, e| spans.push((s, e)));
                    if let Ok(consumed) = fed {
                        for &(s, e) in spans.iter() {
                            conn.cbuf.copy_within(read + s..read + e, write);
                            write += e - s;
                        }
                        read += consumed;
                    }
                    fed
                };
                if fed.is_err() {
                    return Err(send_local_error(w, conn, HttpError::InvalidChunkedBody).await);
                }
                if write - start > max_body {
                    return Err(send_local_error(w, conn, HttpError::BodyTooLarge).await);
                }
                if dec.is_done() {
                    return Ok((write, read));
                }
                if !reserve_body(w, conn, conn.cbuf.len() - start + CHUNKED_STEP) {
                    return Err(refuse_body_memory(w, conn).await);
                }
                match recv_client(conn, deadline).await {
                    Ok(0) => return Err(End::Close),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                        return Err(send_local_error(w, conn, HttpError::RequestTimeout).await)
                    }
                    Err(_) => return Err(End::Close),
                }
            }
        }
    }
}

/// 503 for a body that would take kvlb past `max_body_memory`: counted, logged (rate-limited),
/// answered before the rest of the body is read.
async fn refuse_body_memory(w: &Worker, conn: &mut Conn) -> End {
    metrics::add(&w.stats().body_memory_refused, 1);
    if let Some(more) = BODY_MEMORY_LOG.allow() {
        let cfg = w.cfg();
        eprintln!(
            "kvlb: worker {}: a request body was refused with 503: bodies in flight hold {} of max_body_memory = {} bytes (this worker {}){}",
            w.id,
            w.shared.body_memory.load(Relaxed),
            cfg.limits.max_body_memory,
            w.body_reserved.get(),
            crate::log_limit::more(more)
        );
    }
    conn.log.status = 503;
    log_request(w, conn, None, &[], crate::rt::now());
    refuse_unread(w, conn, HttpError::BodyMemoryFull).await
}

static BODY_MEMORY_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

enum Forwarded {
    /// Response complete; the client connection may carry another request.
    KeepAlive,
    /// The client connection must close (error, abort, or close-delimited response).
    Close,
    /// Nothing reached the client: the replica failed this way. The flag says whether another
    /// replica may be tried (a connect failure or an immediate 503).
    Failed(usize, UpstreamFailure, bool),
    /// Refused with 429 while queued; answered, the connection carries on.
    Refused,
}

/// A failure before anything reached the client.
enum UpstreamFailure {
    Connect(io::Error),
    /// The replica closed or reset the connection before a response head.
    Closed,
    Timeout,
    Invalid,
    ClientGone,
    /// The replica answered 503 at once (overloaded or shutting down); its answer was dropped
    /// to try another replica, and none was left.
    Unavailable,
}

impl UpstreamFailure {
    /// A failure of the replica (not of the client): counts towards its ejection.
    fn counts_against_replica(&self) -> bool {
        !matches!(self, UpstreamFailure::ClientGone)
    }
}

async fn connect_upstream(w: &Worker, addr: SocketAddr) -> io::Result<RawFd> {
    let fd = op::tcp_socket(&addr)?;
    match op::connect(fd, addr, w.cfg().timeouts.connect).await {
        Ok(()) => Ok(fd),
        Err(e) => {
            op::close(fd);
            Err(e)
        }
    }
}

/// Where a request goes and what kvlb expects of it there.
struct Routed {
    replica: usize,
    /// The slot's epoch when routed (pooled connections must match it).
    epoch: u64,
    spec: Arc<ReplicaConfig>,
    /// Prompt tokens the replica will compute (not resident there).
    prefill_tokens: u64,
    /// cache_aware's time-to-first-token estimate, 0 when the policy makes none.
    estimate_s: f64,
}

async fn forward(
    w: &Worker,
    conn: &mut Conn,
    routed: Routed,
    head: &RequestHead,
    body_end: usize,
    received_at: Instant,
    may_retry: bool,
) -> Forwarded {
    let replica = routed.replica;
    // `route` took the replica's in-flight slot already.
    let mut in_flight = InFlight::new(
        w,
        replica,
        routed.prefill_tokens,
        routed.estimate_s,
        received_at,
        true,
    );
    let stats = w.stats();
    let rc = &stats.replicas[replica];
    let url: &str = &routed.spec.url;
    let body_len = body_end - head.head_len;
    let coalesce = body_len <= COALESCE_BODY;
    let head_len_up = conn.obuf.len();
    if coalesce {
        conn.obuf
            .extend_from_slice(&conn.cbuf[head.head_len..body_end]);
    }
    let cfg = w.cfg();
    let upstream_deadline = crate::rt::now() + cfg.timeouts.upstream;
    let slot = w.shared.fleet.slot(replica);
    let failed = |f: UpstreamFailure, retryable: bool| {
        if f.counts_against_replica()
            && slot.record_failure(
                w.shared.now_ms(),
                cfg.health.max_fails,
                cfg.health.fail_timeout.as_millis() as u64,
            )
        {
            eprintln!(
                "kvlb: replica {url}: {} failures in a row; ejected for {:?}",
                cfg.health.max_fails, cfg.health.fail_timeout
            );
            metrics::add(&rc.ejections, 1);
        }
        Forwarded::Failed(replica, f, retryable)
    };

    // Send the request and read the response head; a pooled connection that turns out to be
    // closed is retried once on a fresh connection (nothing has reached the replica's
    // application then).
    let mut attempt = 0;
    let (mut up, rhead) = loop {
        attempt += 1;
        let (mut up, reused) = match w.pooled_upstream(replica, routed.epoch) {
            Some(up) if attempt == 1 => {
                metrics::add(&rc.reuses, 1);
                (up, true)
            }
            pooled => {
                if let Some(up) = pooled {
                    up.close();
                }
                match connect_upstream(w, routed.spec.addr).await {
                    Ok(fd) => {
                        metrics::add(&rc.connects, 1);
                        (Upstream::new(fd), false)
                    }
                    Err(e) => {
                        conn.obuf.truncate(head_len_up);
                        return failed(UpstreamFailure::Connect(e), true);
                    }
                }
            }
        };
        match send_request(conn, up.fd, head, body_end, coalesce).await {
            Ok(()) => {}
            Err(_) if reused => {
                up.close();
                continue;
            }
            Err(_) => {
                up.close();
                conn.obuf.truncate(head_len_up);
                return failed(UpstreamFailure::Closed, false);
            }
        }
        metrics::add(&rc.bytes_to_replica, (head_len_up + body_len) as u64);
        match read_response_head(w, conn, &mut up, url, head, upstream_deadline).await {
            Ok(h) if h.status == 503 && may_retry => {
                // Overloaded or going away, and nothing sent yet: another replica may do.
                up.close();
                return failed(UpstreamFailure::Unavailable, true);
            }
            Ok(h) => break (up, h),
            Err(UpstreamFailure::Closed) if reused && attempt == 1 => {
                up.close();
                continue;
            }
            Err(f) => {
                up.close();
                conn.obuf.truncate(head_len_up);
                return failed(f, false);
            }
        }
    };
    if rhead.status == 503 {
        let _ = failed(UpstreamFailure::Unavailable, false);
    } else {
        slot.record_success();
    }
    let first_byte = crate::rt::now();
    let ttfb_us = first_byte.duration_since(received_at).as_micros() as u64;
    stats.ttfb.observe_us(ttfb_us);
    conn.log.status = rhead.status;
    conn.log.ttfb_us = Some(ttfb_us);
    let class = (rhead.status / 100).clamp(1, 5) as usize - 1;

    let result = relay_body(w, conn, &mut up, replica, head, &rhead, &mut in_flight).await;
    if let Relayed::Unsent(f) = result {
        // Nothing reached the client: it gets kvlb's 502 instead of a head and no body. Not
        // retried: the replica has taken the request and may have acted on it.
        up.close();
        conn.obuf.clear();
        return failed(f, false);
    }
    metrics::add(&rc.responses[class], 1);
    stats.total.observe_us(
        crate::rt::now()
            .saturating_duration_since(received_at)
            .as_micros() as u64,
    );
    match result {
        Relayed::Complete {
            upstream_reusable,
            client_close,
        } => {
            if upstream_reusable && rhead.reusable {
                w.return_upstream(replica, up, routed.epoch);
            } else {
                up.close();
            }
            if client_close {
                Forwarded::Close
            } else {
                Forwarded::KeepAlive
            }
        }
        Relayed::ClientGone => {
            metrics::add(&rc.client_aborts, 1);
            up.close();
            Forwarded::Close
        }
        Relayed::UpstreamBroken(cut) => {
            up.close();
            metrics::add(&rc.cut[cut as usize], 1);
            conn.log.cut = Some(cut.label());
            if let Some(more) = CUT_LOG.allow() {
                eprintln!(
                    "kvlb: replica {url}: response ({} {}) cut short after its head was sent: {}; the client's connection is closed{}",
                    rhead.status,
                    rhead_framing(&rhead),
                    cut.describe(),
                    crate::log_limit::more(more)
                );
            }
            Forwarded::Close
        }
        Relayed::Unsent(_) => unreachable!("handled above"),
    }
}

static CUT_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

fn rhead_framing(h: &response::ResponseHead) -> &'static str {
    match h.body {
        ResponseBody::None => "without body",
        ResponseBody::Length(_) => "with content-length",
        ResponseBody::Chunked => "chunked",
        ResponseBody::UntilClose => "until close",
    }
}

/// Why a response stopped before its end once its head had reached the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// The replica closed the connection before the body's end.
    Closed = 0,
    /// A receive from the replica failed (reset, or another error).
    Reset = 1,
    /// Invalid chunked framing, or more bytes than the replica declared.
    Malformed = 2,
}

impl Cut {
    /// The `cause` label of `kvlb_cut_responses_total` (`metrics::CUT_CAUSES`).
    pub(crate) fn label(self) -> &'static str {
        metrics::CUT_CAUSES[self as usize]
    }

    fn describe(self) -> &'static str {
        match self {
            Cut::Closed => "the replica closed the connection before the body's end",
            Cut::Reset => "a receive from the replica failed (connection reset)",
            Cut::Malformed => "the replica's body framing was invalid",
        }
    }
}

async fn send_request(
    conn: &mut Conn,
    ufd: RawFd,
    head: &RequestHead,
    body_end: usize,
    coalesce: bool,
) -> io::Result<()> {
    let n = conn.obuf.len();
    let (r, b) = op::send_all(ufd, std::mem::take(&mut conn.obuf), 0, n).await;
    conn.obuf = b;
    r?;
    if !coalesce {
        let (r, b) =
            op::send_all(ufd, std::mem::take(&mut conn.cbuf), head.head_len, body_end).await;
        conn.cbuf = b;
        r?;
    }
    Ok(())
}

async fn read_response_head(
    w: &Worker,
    conn: &mut Conn,
    up: &mut Upstream,
    url: &str,
    head: &RequestHead,
    deadline: Instant,
) -> Result<response::ResponseHead, UpstreamFailure> {
    conn.ubuf.clear();
    let framing = ClientFraming {
        head_request: head.method == Method::Head,
        close: !head.keep_alive || w.draining.get(),
        http10: head.minor_version == 0,
    };
    conn.watch.arm();
    loop {
        let r = {
            let recv = std::pin::pin!(op::recv_multi(
                &mut up.recv,
                &mut conn.ubuf,
                Some(remaining(deadline))
            ));
            match select(recv, conn.watch.gone()).await {
                Either::Left(r) => r,
                Either::Right(()) => return Err(UpstreamFailure::ClientGone),
            }
        };
        match r {
            Ok(0) => return Err(UpstreamFailure::Closed),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::TimedOut => return Err(UpstreamFailure::Timeout),
            Err(_) => return Err(UpstreamFailure::Closed),
        }
        loop {
            match response::parse_response(
                &conn.ubuf,
                MAX_RESPONSE_HEAD,
                url,
                &framing,
                &mut conn.obuf,
            ) {
                Ok(h) if (100..200).contains(&h.status) => {
                    // Interim response (kvlb already handled 100-continue): drop it.
                    let len = conn.ubuf.len();
                    conn.ubuf.copy_within(h.head_len..len, 0);
                    conn.ubuf.truncate(len - h.head_len);
                    if conn.ubuf.is_empty() {
                        break;
                    }
                }
                Ok(h) => {
                    if conn.explain_len > 0 {
                        // Insert the decision line before the head's final empty line.
                        conn.obuf.truncate(conn.obuf.len() - 2);
                        conn.obuf
                            .extend_from_slice(&conn.explain[..conn.explain_len]);
                        conn.obuf.extend_from_slice(b"\r\n");
                    }
                    return Ok(h);
                }
                Err(ResponseError::Partial) => break,
                Err(_) => return Err(UpstreamFailure::Invalid),
            }
        }
    }
}

/// Answer the client for a failure before any response byte was sent.
async fn fail(w: &Worker, conn: &mut Conn, replica: usize, f: UpstreamFailure) -> Forwarded {
    let rc = &w.stats().replicas[replica];
    let spec = w.shared.fleet.slot(replica).spec();
    let url: &str = spec.as_ref().map_or("(removed)", |s| s.url.as_str());
    let (status, reason, kind, msg) = match f {
        UpstreamFailure::ClientGone => {
            metrics::add(&rc.client_aborts, 1);
            conn.log.status = 499;
            return Forwarded::Close;
        }
        UpstreamFailure::Timeout => (
            504,
            "Gateway Timeout",
            "upstream_timeout",
            format!("replica {url} did not answer within the upstream timeout"),
        ),
        UpstreamFailure::Connect(e) => (
            502,
            "Bad Gateway",
            "upstream_error",
            format!("cannot connect to replica {url}: {e}"),
        ),
        UpstreamFailure::Closed => (
            502,
            "Bad Gateway",
            "upstream_error",
            format!("replica {url} closed the connection before answering"),
        ),
        UpstreamFailure::Invalid => (
            502,
            "Bad Gateway",
            "upstream_error",
            format!("replica {url} sent an invalid response head"),
        ),
        UpstreamFailure::Unavailable => (
            503,
            "Service Unavailable",
            "upstream_unavailable",
            format!("replica {url} answered 503 and no other replica was available"),
        ),
    };
    match status {
        504 => metrics::add(&rc.gateway_timeout, 1),
        503 => metrics::add(&rc.unavailable, 1),
        _ => metrics::add(&rc.bad_gateway, 1),
    };
    conn.log.status = status;
    conn.obuf.clear();
    write_error(&mut conn.obuf, status, reason, kind, &msg, Some(url), true);
    let n = conn.obuf.len();
    let (_, b) = op::send_all(conn.fd, std::mem::take(&mut conn.obuf), 0, n).await;
    conn.obuf = b;
    Forwarded::Close
}

enum Relayed {
    Complete {
        upstream_reusable: bool,
        client_close: bool,
    },
    ClientGone,
    /// The response stopped before its end after bytes reached the client.
    UpstreamBroken(Cut),
    /// The replica's body was unusable before any byte reached the client (the head is
    /// still in obuf, unsent).
    Unsent(UpstreamFailure),
}

/// Send obuf (the client head plus any body bytes appended) to the client.
async fn flush_obuf(conn: &mut Conn) -> io::Result<()> {
    let n = conn.obuf.len();
    let (r, b) = op::send_all(conn.fd, std::mem::take(&mut conn.obuf), 0, n).await;
    conn.obuf = b;
    r
}

/// Receive the next piece of the response body while watching for the client going away.
async fn recv_upstream(conn: &mut Conn, up: &mut Upstream) -> Result<usize, Relayed> {
    conn.ubuf.clear();
    let recv = std::pin::pin!(op::recv_multi(&mut up.recv, &mut conn.ubuf, None));
    match select(recv, conn.watch.gone()).await {
        Either::Left(r) => match r {
            Ok(0) => Err(Relayed::UpstreamBroken(Cut::Closed)),
            Err(_) => Err(Relayed::UpstreamBroken(Cut::Reset)),
            Ok(n) => Ok(n),
        },
        Either::Right(_) => Err(Relayed::ClientGone),
    }
}

/// Move the `left` bytes still to come of a response body from the replica to the client by
/// splice through a pooled pipe (`splice_responses_from`): the multishot receive is stopped
/// first (what it already holds is sent as is) and re-armed by the next receive.
async fn splice_body(
    w: &Worker,
    conn: &mut Conn,
    up: &mut Upstream,
    mut left: u64,
    replica: usize,
    in_flight: &mut InFlight<'_>,
) -> Result<(), Relayed> {
    use crate::l4::relay::{give_pipe, splice_exact, take_pipe, Fault};
    let rc = &w.stats().replicas[replica];
    conn.ubuf.clear();
    let ended = up.recv.stop_into(&mut conn.ubuf).await;
    if !conn.ubuf.is_empty() {
        let got = conn.ubuf.len();
        metrics::add(&rc.bytes_from_replica, got as u64);
        in_flight.first_byte();
        if got as u64 > left {
            return Err(Relayed::UpstreamBroken(Cut::Malformed));
        }
        let (r, b) = op::send_all(conn.fd, std::mem::take(&mut conn.ubuf), 0, got).await;
        conn.ubuf = b;
        if r.is_err() {
            return Err(Relayed::ClientGone);
        }
        left -= got as u64;
    }
    if left == 0 {
        return Ok(());
    }
    if let Some(end) = ended {
        return Err(Relayed::UpstreamBroken(match end {
            Ok(_) => Cut::Closed,
            Err(_) => Cut::Reset,
        }));
    }
    let Ok(pipe) = take_pipe() else {
        return Err(Relayed::UpstreamBroken(Cut::Reset));
    };
    let moved = std::cell::Cell::new(0u64);
    let r = splice_exact(up.fd, conn.fd, &pipe, left, |m| {
        moved.set(moved.get() + m as u64)
    })
    .await;
    metrics::add(&rc.bytes_from_replica, moved.get());
    metrics::add(&w.stats().spliced_bytes, moved.get());
    if moved.get() > 0 {
        in_flight.first_byte();
    }
    give_pipe(pipe, r.is_ok());
    match r {
        Ok(()) => Ok(()),
        // The end or a failure of the replica's socket before `left` bytes.
        Err(Fault::Source) => Err(Relayed::UpstreamBroken(Cut::Closed)),
        Err(Fault::Destination) => Err(Relayed::ClientGone),
    }
}

async fn relay_body(
    w: &Worker,
    conn: &mut Conn,
    up: &mut Upstream,
    replica: usize,
    head: &RequestHead,
    rhead: &response::ResponseHead,
    in_flight: &mut InFlight<'_>,
) -> Relayed {
    let rc = &w.stats().replicas[replica];
    let client_close = !head.keep_alive
        || w.draining.get()
        || rhead.body == ResponseBody::UntilClose
        || (head.minor_version == 0 && rhead.body == ResponseBody::Chunked);
    let avail_start = rhead.head_len;
    let avail_end = conn.ubuf.len();
    metrics::add(&rc.bytes_from_replica, avail_end as u64);
    let gone = |e: io::Error| {
        let _ = e;
        Relayed::ClientGone
    };
    if avail_end > avail_start || matches!(rhead.body, ResponseBody::None | ResponseBody::Length(0))
    {
        in_flight.first_byte();
    }
    match rhead.body {
        ResponseBody::None => {
            if let Err(e) = flush_obuf(conn).await {
                return gone(e);
            }
            Relayed::Complete {
                upstream_reusable: avail_end == avail_start,
                client_close,
            }
        }
        ResponseBody::Length(n) => {
            let first = ((avail_end - avail_start) as u64).min(n) as usize;
            conn.obuf
                .extend_from_slice(&conn.ubuf[avail_start..avail_start + first]);
            let mut reusable = avail_end - avail_start == first;
            if let Err(e) = flush_obuf(conn).await {
                return gone(e);
            }
            let mut left = n - first as u64;
            let splice_from = w.cfg().splice_responses_from as u64;
            if splice_from > 0 && left >= splice_from && reusable && w.shared.splice_ok {
                match splice_body(w, conn, up, left, replica, in_flight).await {
                    Ok(()) => left = 0,
                    Err(r) => return r,
                }
            }
            while left > 0 {
                let got = match recv_upstream(conn, up).await {
                    Ok(g) => g,
                    Err(r) => return r,
                };
                in_flight.first_byte();
                metrics::add(&rc.bytes_from_replica, got as u64);
                let take = (got as u64).min(left) as usize;
                if take < got {
                    reusable = false;
                }
                let (r, b) = op::send_all(conn.fd, std::mem::take(&mut conn.ubuf), 0, take).await;
                conn.ubuf = b;
                if let Err(e) = r {
                    return gone(e);
                }
                left -= take as u64;
            }
            Relayed::Complete {
                upstream_reusable: reusable,
                client_close,
            }
        }
        ResponseBody::Chunked => {
            let dechunk = head.minor_version == 0;
            let mut dec = ChunkedDecoder::new();
            let mut start = avail_start;
            let mut reusable = true;
            // Whether the head (and any body) has gone to the client yet.
            let mut sent = false;
            loop {
                let end = conn.ubuf.len();
                let consumed;
                {
                    let mut spans = w.spans.borrow_mut();
                    spans.clear();
                    consumed = match dec.feed(&conn.ubuf[start..end], |s, e| spans.push((s, e))) {
                        Ok(c) => c,
                        Err(_) if !sent => return Relayed::Unsent(UpstreamFailure::Invalid),
                        Err(_) => return Relayed::UpstreamBroken(Cut::Malformed),
                    };
                    if dechunk {
                        for &(s, e) in spans.iter() {
                            conn.obuf
                                .extend_from_slice(&conn.ubuf[start + s..start + e]);
                        }
                    } else {
                        conn.obuf
                            .extend_from_slice(&conn.ubuf[start..start + consumed]);
                    }
                }
                if start + consumed < end {
                    reusable = false;
                }
                if !conn.obuf.is_empty() {
                    if let Err(e) = flush_obuf(conn).await {
                        return gone(e);
                    }
                    conn.obuf.clear();
                    sent = true;
                }
                if dec.is_done() {
                    break;
                }
                match recv_upstream(conn, up).await {
                    Ok(got) => metrics::add(&rc.bytes_from_replica, got as u64),
                    Err(r) => return r,
                };
                in_flight.first_byte();
                start = 0;
            }
            Relayed::Complete {
                upstream_reusable: reusable,
                client_close,
            }
        }
        ResponseBody::UntilClose => {
            conn.obuf
                .extend_from_slice(&conn.ubuf[avail_start..avail_end]);
            if let Err(e) = flush_obuf(conn).await {
                return gone(e);
            }
            loop {
                match recv_upstream(conn, up).await {
                    Ok(got) => {
                        in_flight.first_byte();
                        metrics::add(&rc.bytes_from_replica, got as u64);
                        let (r, b) =
                            op::send_all(conn.fd, std::mem::take(&mut conn.ubuf), 0, got).await;
                        conn.ubuf = b;
                        if let Err(e) = r {
                            return gone(e);
                        }
                    }
                    // The replica's close is this body's end.
                    Err(Relayed::UpstreamBroken(Cut::Closed)) => break,
                    Err(r) => return r,
                }
            }
            Relayed::Complete {
                upstream_reusable: false,
                client_close: true,
            }
        }
    }
}
