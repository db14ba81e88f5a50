//! Forwarding upstream: a pooled or fresh connection to the chosen replica, the request sent
//! there, the response head read while watching the client, and the error answered when the
//! replica fails before any response byte reached the client.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::relay::{relay_body, IdWatch, Relayed};
use super::route::Routed;
use super::{remaining, Conn, UpstreamFailure};
use crate::http::request::{self, Method, RequestHead};
use crate::http::response::{self, ClientFraming, ResponseBody, ResponseError};
use crate::http::write_error_in;
use crate::metrics;
use crate::rt::op;
use crate::rt::select::{select, Either};
use crate::worker::{Upstream, Worker};
use std::io;
use std::os::fd::RawFd;
use std::time::Instant;

/// Bodies up to this size are sent upstream in the same write as the head.
const COALESCE_BODY: usize = 16 * 1024;
/// Most bytes of a replica's response head.
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// Write the upstream request head into obuf again (a retry: the previous attempt's buffer
/// holds the failed replica's answer by now).
pub(super) fn rebuild_upstream_head(conn: &mut Conn, head_end: usize) {
    conn.obuf.clear();
    // The head parsed before, unchanged in cbuf (de-chunking only rewrote the body).
    let _ = request::parse_request(&conn.cbuf, head_end, conn.client_ip, &mut conn.obuf);
}

pub(super) enum Forwarded {
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

/// `sent`: the request was sent on this connection already (pooled: true), by SGLang's
/// disaggregated path (`pd`); its head and body are in `conn` as forward would send them.
#[allow(clippy::too_many_arguments)]
pub(super) async fn forward(
    w: &Worker,
    conn: &mut Conn,
    routed: Routed,
    head: &RequestHead,
    body_end: usize,
    received_at: Instant,
    may_retry: bool,
    sent: Option<(Upstream, bool)>,
) -> Forwarded {
    let replica = routed.replica;
    let mut in_flight = routed.in_flight(w, received_at);
    if let Some(i) = routed.load {
        if let Err(why) = w.adapter_loaded(i, replica, routed.epoch).await {
            return Forwarded::Failed(replica, UpstreamFailure::AdapterLoad(why), true);
        }
    }
    let stats = w.stats();
    let rc = &stats.replicas[replica];
    let url: &str = &routed.spec.url;
    let head_len_up = conn.obuf.len();
    let coalesce = coalesce_body(conn, head, body_end);
    let cfg = w.cfg();
    let upstream_deadline = crate::rt::now() + cfg.upstream_timeout_of(routed.class.table);
    let slot = w.shared.fleet.slot(replica);
    let failed = |f: UpstreamFailure, retryable: bool| {
        count_failure(w, &routed, &f);
        Forwarded::Failed(replica, f, retryable)
    };

    // Send the request and read the response head; a pooled connection that turns out to be
    // closed is retried once on a fresh connection (nothing has reached the replica's
    // application then).
    let mut sent = sent;
    let mut fresh = false;
    let (mut up, rhead) = loop {
        let (mut up, reused) = match sent.take() {
            Some(v) => v,
            None => match send(w, conn, &routed, head, body_end, coalesce, fresh).await {
                Ok(v) => v,
                Err(f) => {
                    conn.obuf.truncate(head_len_up);
                    let retryable = matches!(f, UpstreamFailure::Connect(_));
                    return failed(f, retryable);
                }
            },
        };
        match read_response_head(w, conn, &mut up, url, head, upstream_deadline).await {
            Ok(h) if h.status == 503 && may_retry => {
                // Overloaded or going away, and nothing sent yet: another replica may do.
                up.close();
                return failed(UpstreamFailure::Unavailable, true);
            }
            Ok(h) => break (up, h),
            Err(UpstreamFailure::Closed) if reused && !fresh => {
                up.close();
                fresh = true;
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
    let class = metrics::status_class(rhead.status);
    let path = &conn.cbuf[head.target.0..head.target.1];
    let endpoint = path.split(|&b| b == b'?').next().unwrap_or(path);
    // A chat or completions stream's first event is its first token (a Responses or Messages
    // stream may open with events sent before the prefill): a calibration sample.
    if rhead.status == 200
        && rhead.event_stream
        && matches!(endpoint, b"/v1/chat/completions" | b"/v1/completions")
    {
        in_flight.streamed();
    }

    // A Responses API answer names the response the replica stored: learned on the way.
    let creates_response = head.method == Method::Post && endpoint == b"/v1/responses";
    let mut ids = IdWatch::new((rhead.status == 200 && creates_response).then_some(routed.epoch));
    let result = relay_body(
        w,
        conn,
        &mut up,
        replica,
        head,
        &rhead,
        &mut in_flight,
        &mut ids,
    )
    .await;
    if matches!(result, Relayed::Complete { .. }) {
        ids.finish(w, replica);
        in_flight.finished();
    }
    conn.log.first_byte_us = in_flight.first_byte_us();
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

/// A connection to the routed replica for the `attempt`-th send of one request: a pooled one
/// first, a fresh one after (a pooled connection the replica had closed); whether it was pooled.
async fn upstream(w: &Worker, routed: &Routed, attempt: u32) -> io::Result<(Upstream, bool)> {
    let rc = &w.stats().replicas[routed.replica];
    match w.pooled_upstream(routed.replica, routed.epoch) {
        Some(up) if attempt == 1 => {
            metrics::add(&rc.reuses, 1);
            Ok((up, true))
        }
        pooled => {
            if let Some(up) = pooled {
                up.close();
            }
            let fd = w.connect_replica(routed.spec.addr).await?;
            metrics::add(&rc.connects, 1);
            Ok((Upstream::new(fd), false))
        }
    }
}

/// A failure of the routed replica before its answer: counted towards its ejection (passive
/// health) unless the client or an adapter load caused it; the ejection logged.
pub(super) fn count_failure(w: &Worker, routed: &Routed, f: &UpstreamFailure) {
    let cfg = w.cfg();
    let slot = w.shared.fleet.slot(routed.replica);
    if f.counts_against_replica()
        && slot.record_failure(
            w.shared.now_ms(),
            cfg.health.max_fails,
            cfg.health.fail_timeout.as_millis() as u64,
        )
    {
        eprintln!(
            "kvlb: replica {}: {} failures in a row; ejected for {:?}",
            routed.spec.url, cfg.health.max_fails, cfg.health.fail_timeout
        );
        metrics::add(&w.stats().replicas[routed.replica].ejections, 1);
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

/// Append the request's body to its upstream head in `conn.obuf` when it is small enough to go
/// in the same write; whether it was.
pub(super) fn coalesce_body(conn: &mut Conn, head: &RequestHead, body_end: usize) -> bool {
    let coalesce = body_end - head.head_len <= COALESCE_BODY;
    if coalesce {
        conn.obuf
            .extend_from_slice(&conn.cbuf[head.head_len..body_end]);
    }
    coalesce
}

/// Connect to the routed replica (a pooled connection first unless `fresh`) and send the
/// request: its head in `conn.obuf` (the body after it when `coalesce`), its body in
/// `conn.cbuf` otherwise. A pooled connection the send fails on is replaced by a fresh one
/// once (the replica had closed it: nothing reached its application). Ok: the connection
/// and whether it was pooled.
pub(super) async fn send(
    w: &Worker,
    conn: &mut Conn,
    routed: &Routed,
    head: &RequestHead,
    body_end: usize,
    coalesce: bool,
    fresh: bool,
) -> Result<(Upstream, bool), UpstreamFailure> {
    let mut attempt = if fresh { 2 } else { 1 };
    loop {
        let (up, reused) = upstream(w, routed, attempt)
            .await
            .map_err(UpstreamFailure::Connect)?;
        match send_request(conn, up.fd, head, body_end, coalesce).await {
            Ok(()) => {
                let body = if coalesce {
                    0
                } else {
                    body_end - head.head_len
                };
                metrics::add(
                    &w.stats().replicas[routed.replica].bytes_to_replica,
                    (conn.obuf.len() + body) as u64,
                );
                return Ok((up, reused));
            }
            Err(_) => {
                up.close();
                if !reused {
                    return Err(UpstreamFailure::Closed);
                }
                attempt = 2;
            }
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

pub(super) async fn read_response_head(
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
pub(super) async fn fail(
    w: &Worker,
    conn: &mut Conn,
    replica: usize,
    f: UpstreamFailure,
) -> Forwarded {
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
        UpstreamFailure::AdapterLoad(why) => {
            (503, "Service Unavailable", "service_unavailable", why)
        }
    };
    match status {
        504 => metrics::add(&rc.gateway_timeout, 1),
        503 => metrics::add(&rc.unavailable, 1),
        _ => metrics::add(&rc.bad_gateway, 1),
    };
    conn.log.status = status;
    conn.obuf.clear();
    write_error_in(
        &mut conn.obuf,
        conn.shape,
        status,
        reason,
        kind,
        &msg,
        Some(url),
        true,
    );
    let n = conn.obuf.len();
    let (_, b) = op::send_all(conn.fd, std::mem::take(&mut conn.obuf), 0, n).await;
    conn.obuf = b;
    Forwarded::Close
}
