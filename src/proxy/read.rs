//! Reading the request, and refusing it: the head and body received from the client (the body
//! de-chunked in place and held against the body memory limits), kvlb's own error answers (a
//! malformed or oversized request, a client too slow, no body memory left), the refusals of a
//! well-formed request (401, 429), and dropping a finished request from the buffer.

#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::log::log_request;
use super::{remaining, Conn, End};
use crate::http::chunked::ChunkedDecoder;
use crate::http::request::{BodyFraming, RequestHead};
use crate::http::HttpError;
use crate::metrics;
use crate::rt::op;
use crate::worker::{Worker, SMALL_BODY};
use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// Receive more client bytes into cbuf before `deadline` (the receive grows it as needed).
pub(super) async fn recv_client(conn: &mut Conn, deadline: Instant) -> io::Result<usize> {
    conn.watch
        .recv_into(&mut conn.cbuf, remaining(deadline))
        .await
}

pub(super) async fn send_local_error(w: &Worker, conn: &mut Conn, e: HttpError) -> End {
    w.stats().local_error(e.status());
    conn.log.status = e.status();
    log_request(w, conn, None, &[], crate::rt::now());
    let _ = op::send_static(conn.fd, e.response_in(conn.shape)).await;
    End::Close
}

/// Drop the request that ends at `req_end` from cbuf, keeping pipelined bytes for the next.
pub(super) fn consume_request(conn: &mut Conn, req_end: usize) {
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
pub(super) fn release_body(w: &Worker, conn: &mut Conn) {
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
pub(super) fn body_in_hand(conn: &Conn, head: &RequestHead) -> Option<usize> {
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
pub(super) async fn refuse_unread(w: &Worker, conn: &mut Conn, e: HttpError) -> End {
    w.stats().local_error(e.status());
    if op::send_static(conn.fd, e.response_in(conn.shape))
        .await
        .is_err()
    {
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

/// Answer a well-formed request with a refusal (401, 429) and drop it; returns whether the
/// connection carries on.
pub(super) async fn refuse_request(
    w: &Worker,
    conn: &mut Conn,
    e: HttpError,
    head: &RequestHead,
    req_end: usize,
) -> bool {
    w.stats().local_error(e.status());
    conn.log.status = e.status();
    let sent = op::send_static(conn.fd, e.response_in(conn.shape))
        .await
        .is_ok();
    consume_request(conn, req_end);
    sent && head.keep_alive && e.keeps_connection() && !w.draining.get()
}

/// Read the request body; returns (body_end, request_end) offsets in cbuf.
pub(super) async fn read_body(
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
