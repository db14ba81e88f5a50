//! Relaying the response body to the client as it arrives: by length (copied, or spliced when
//! large), chunked (passed through, or de-chunked for HTTP/1.0) or until the replica closes;
//! and how a response can be cut short once its head was sent.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::UpstreamFailure;
use super::{Conn, InFlight};
use crate::http::chunked::ChunkedDecoder;
use crate::http::request::RequestHead;
use crate::http::response::{self, ResponseBody};
use crate::metrics;
use crate::rt::op;
use crate::rt::select::{select, Either};
use crate::worker::{Upstream, Worker};
use std::io;

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

    pub(super) fn describe(self) -> &'static str {
        match self {
            Cut::Closed => "the replica closed the connection before the body's end",
            Cut::Reset => "a receive from the replica failed (connection reset)",
            Cut::Malformed => "the replica's body framing was invalid",
        }
    }
}

pub(super) enum Relayed {
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

/// Reads the id of the response a replica stored from the first body bytes relayed (the JSON
/// body, or a stream's first event), without holding any back: they are copied into a small
/// buffer on the way (`affinity::response_id`).
pub(super) struct IdWatch {
    /// The replica slot's epoch while an id is looked for.
    epoch: Option<u64>,
    buf: [u8; ID_WINDOW],
    len: usize,
}

/// Body bytes looked at for a response id: the first event of a stream names it in its first
/// hundred bytes.
const ID_WINDOW: usize = 512;

impl IdWatch {
    /// Looks for an id (at the replica slot's `epoch`) or, with None, does nothing.
    pub(super) fn new(epoch: Option<u64>) -> IdWatch {
        IdWatch {
            epoch,
            buf: [0; ID_WINDOW],
            len: 0,
        }
    }

    /// The next de-chunked body bytes.
    fn feed(&mut self, w: &Worker, replica: usize, bytes: &[u8]) {
        let Some(epoch) = self.epoch else {
            return;
        };
        let take = bytes.len().min(ID_WINDOW - self.len);
        self.buf[self.len..self.len + take].copy_from_slice(&bytes[..take]);
        self.len += take;
        if let Some(id) = crate::affinity::response_id(&self.buf[..self.len]) {
            w.learn_response(Some(id), replica, epoch);
            self.epoch = None;
        } else if self.len == ID_WINDOW {
            self.finish(w, replica);
        }
    }

    /// The body ended (or the window is full) without an id: counted as missed.
    pub(super) fn finish(&mut self, w: &Worker, replica: usize) {
        if self.epoch.take().is_some() {
            w.learn_response(None, replica, 0);
        }
    }
}

/// Relays the response body; the bytes go through `ids` on the way.
#[allow(clippy::too_many_arguments)]
pub(super) async fn relay_body(
    w: &Worker,
    conn: &mut Conn,
    up: &mut Upstream,
    replica: usize,
    head: &RequestHead,
    rhead: &response::ResponseHead,
    in_flight: &mut InFlight<'_>,
    ids: &mut IdWatch,
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
            ids.feed(w, replica, &conn.ubuf[avail_start..avail_start + first]);
            in_flight.events(&conn.ubuf[avail_start..avail_start + first]);
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
                ids.feed(w, replica, &conn.ubuf[..take]);
                in_flight.events(&conn.ubuf[..take]);
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
                    for &(s, e) in spans.iter() {
                        ids.feed(w, replica, &conn.ubuf[start + s..start + e]);
                        in_flight.events(&conn.ubuf[start + s..start + e]);
                    }
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
            ids.feed(w, replica, &conn.ubuf[avail_start..avail_end]);
            in_flight.events(&conn.ubuf[avail_start..avail_end]);
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
                        ids.feed(w, replica, &conn.ubuf[..got]);
                        in_flight.events(&conn.ubuf[..got]);
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
