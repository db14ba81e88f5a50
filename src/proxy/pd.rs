//! Prefill/decode disaggregation: a request whose model has replicas of role `prefill` and
//! `decode` is computed on a prefill replica and continued on a decode replica from the KV
//! cache the prefill replica computed, as vLLM's disaggregated serving expects of its proxy
//! (`kvlb_core::pd` has the bodies):
//!
//! 1. the prefill leg, here: the prefill replica is chosen by the policy among the prefill
//!    replicas (cache_aware: where the prefix is resident and the queue short), sent the body
//!    asking for one token and the KV kept, and its whole answer read;
//! 2. the decode leg, by the caller's usual path: the client's body with the prefill answer's
//!    `kv_transfer_params` replaces the one in `conn.cbuf`, and the request is routed among the
//!    decode replicas and relayed to the client as any request is (streamed, retried while
//!    nothing reached the client).
//!
//! A prefill replica that fails (connect, a closed connection, a timeout, 5xx) before its
//! answer is passed over for another, as a whole request would be: nothing reached the client.
//! When none is left (or every one is at its concurrency limit past `queue_timeout`) the
//! request goes whole to a decode replica, which computes the prompt itself; so does one the
//! prefill replica refused (4xx: the decode replica answers the client with the engine's own
//! error). A client that leaves during the prefill closes the prefill replica's connection
//! (the engine aborts it). Each outcome is counted in `kvlb_pd_requests_total`.
//!
//! SGLang's protocol, where the chosen prefill replica has a `bootstrap_port`
//! (`kvlb_core::pd::sglang_body`): both legs take the same body, the client's with the prefill
//! replica's bootstrap server and a room kvlb draws. The decode leg is sent first (`Sglang`),
//! then the prefill leg is exchanged as above; once the prefill answered, the caller's path
//! reads the decode replica's answer from the connection it was sent on (`Prefilled::Decode`'s
//! `sent`).
//! A prefill that fails closes the decode leg's connection (the engine aborts it) and both
//! go again with another prefill replica and room; none left is a 503, since an SGLang
//! decode replica computes no prompt without a room (and so none is sent one directly).
//!
//! What this leaves to the engines: a prefill replica holds the blocks it computed until the
//! decode replica pulls them, or until its own timeout (vLLM `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`,
//! a lease in newer versions) when the decode leg never reaches one; the protocol has no call
//! for a proxy to release them.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::forward::{
    coalesce_body, count_failure, read_response_head, rebuild_upstream_head, send,
};
use super::log::log_request;
use super::route::{route, wait_for_capacity, Route, Routed};
use super::{remaining, Conn, End, UpstreamFailure, MAX_ATTEMPTS};
use crate::http::request::{Method, RequestHead};
use crate::http::response::ResponseBody;
use crate::metrics;
use crate::rt::op;
use crate::rt::select::{select, Either};
use crate::worker::{Leg, ModelRoute, Upstream, Worker};
use std::io;
use std::time::Instant;

/// Most bytes of a prefill answer (a one-token completion and its transfer parameters).
const MAX_PREFILL_ANSWER: usize = 1 << 20;

/// What the caller does after the prefill leg.
pub(super) enum Prefilled {
    /// Route the request to a decode replica: its body in `conn.cbuf` now ends at `body_end`,
    /// and the request at `req_end`; `prefill` is the replica that computed it. `sent`
    /// (SGLang's protocol): the decode leg went to this routed replica on this connection
    /// (pooled: true) already; forward reads its answer as the first attempt.
    Decode {
        body_end: usize,
        req_end: usize,
        prefill: usize,
        sent: Option<(Routed, (Upstream, bool))>,
    },
    /// Send it whole, as the client sent it.
    Whole,
    /// Computed on this decode replica directly (the cost model found it sooner, or kinder to
    /// the sequences decoding there, than a prefill replica and the transfer): routed already,
    /// its concurrency slot taken; forward it as the first attempt.
    Direct(Routed, usize),
    /// SGLang's protocol, and no prefill (or decode) replica could take the request: an SGLang
    /// decode replica refuses a request without a bootstrap room, so the client gets 503.
    Unavailable(&'static str),
}

/// Whether a request may be disaggregated: a completions or chat completions prompt (the
/// endpoints whose answers carry the transfer parameters) read by kvlb.
pub(super) fn eligible(conn: &Conn, head: &RequestHead, parsed: bool) -> bool {
    if !parsed || head.method != Method::Post {
        return false;
    }
    let target = &conn.cbuf[head.target.0..head.target.1];
    let path = match memchr::memchr(b'?', target) {
        Some(q) => &target[..q],
        None => target,
    };
    matches!(path, b"/v1/completions" | b"/v1/chat/completions")
}

fn count(w: &Worker, outcome: usize) {
    metrics::add(&w.stats().pd[outcome], 1);
}

/// The prefill leg of the request in `conn.cbuf` (module header). Err: the connection ends
/// (the client left; the request was logged).
#[allow(clippy::too_many_arguments)]
pub(super) async fn prefill(
    w: &Worker,
    conn: &mut Conn,
    head: &RequestHead,
    head_end: usize,
    body_end: usize,
    req_end: usize,
    parsed: bool,
    model: ModelRoute,
    received_at: Instant,
) -> Result<Prefilled, End> {
    // cache_aware chooses between the paths (`--disaggregate priced`): a prefill replica (and
    // the transfer after it) or a decode replica computing the prompt itself; other policies
    // always disaggregate.
    let cfg = w.cfg();
    // (Not where an SGLang prefill replica may be chosen: an SGLang decode replica computes
    // no prompt of its own.)
    let priced = cfg.disaggregate == crate::config::Disaggregate::Priced
        && cfg.model_policy(model.class.table) == crate::select::PolicyName::CacheAware
        && !w.has_sglang.get();
    let prefill_model = ModelRoute {
        leg: if priced { Leg::Split } else { Leg::Prefill },
        ..model
    };
    let decode_model = ModelRoute {
        leg: Leg::Decode,
        ..model
    };
    // Disaggregated only where the model has both roles (its other replicas serve it whole).
    let has = |m: ModelRoute| {
        let (free, capped) = w.fill_candidates(&[], m);
        free + capped > 0
    };
    let only_prefill = ModelRoute {
        leg: Leg::Prefill,
        ..model
    };
    if !has(decode_model) || !has(only_prefill) {
        return Ok(Prefilled::Whole);
    }
    let mut body = w.take_buf();
    if !kvlb_core::pd::vllm_prefill_body(&conn.cbuf[head.head_len..body_end], &mut body) {
        // Not a JSON object: the engine answers the client whole.
        w.give_buf(body);
        return Ok(Prefilled::Whole);
    }
    let max_attempts = (cfg.health.retries as usize + 1).min(MAX_ATTEMPTS);
    let mut tried = [usize::MAX; MAX_ATTEMPTS];
    let mut attempts = 0;
    // SGLang's protocol: the decode leg, sent before each prefill leg.
    let mut sglang = Sglang {
        decode: None,
        tried: [usize::MAX; MAX_ATTEMPTS],
        failed: 0,
        body_end,
        req_end,
    };
    let outcome = loop {
        rebuild_upstream_head(conn, head_end);
        let routed = match route(
            w,
            conn,
            head,
            body_end,
            parsed,
            &tried[..attempts],
            prefill_model,
        ) {
            Route::To(r, explain_len) => {
                if w.shared.fleet.slot(r.replica).role() != crate::config::Role::Prefill {
                    w.give_buf(body);
                    count(w, metrics::PD_DIRECT);
                    return Ok(Prefilled::Direct(r, explain_len));
                }
                conn.explain_len = explain_len;
                r
            }
            Route::AllBusy => match wait_for_capacity(w, &tried[..attempts], prefill_model).await {
                Ok(()) => continue,
                Err(_) => break Err(metrics::PD_PREFILL_FAILED),
            },
            Route::NoneLeft => break Err(metrics::PD_PREFILL_FAILED),
        };
        let mut routed = routed;
        // Its estimate (cache_aware's) included the transfer, which comes after its answer:
        // the answer's time measures the rest (a calibration sample).
        let transfer = cfg
            .cost_model_of(model.class.table)
            .kv_transfer_s(conn.log.prompt_tokens);
        routed.expected.fixed_s = (routed.expected.fixed_s - transfer).max(0.0);
        if let Some(port) = routed.spec.bootstrap_port {
            match sglang
                .send_decode(
                    w,
                    conn,
                    head,
                    head_end,
                    parsed,
                    model,
                    &routed,
                    port,
                    &mut body,
                    received_at,
                )
                .await
            {
                Ok(()) => {}
                Err(why) => {
                    drop(routed.in_flight(w, received_at));
                    sglang.release(w, received_at);
                    w.give_buf(body);
                    count(w, metrics::PD_PREFILL_FAILED);
                    log_fallback(why);
                    return Ok(Prefilled::Unavailable(why));
                }
            }
            rebuild_upstream_head(conn, head_end);
        } else if sglang.decode.is_some() {
            // Begun under SGLang's protocol (the body carries a room, a decode replica was
            // chosen for it): a prefill replica of vLLM's cannot take it over. Passed over.
            drop(routed.in_flight(w, received_at));
            tried[attempts] = routed.replica;
            attempts += 1;
            if attempts >= max_attempts {
                break Err(metrics::PD_PREFILL_FAILED);
            }
            continue;
        }
        routed.finish_head(conn, head, body.len());
        let replica = routed.replica;
        tried[attempts] = replica;
        attempts += 1;
        let answer = exchange(w, conn, &routed, head, &body, received_at).await;
        if let Some((decode, Some(up))) = sglang.decode.take() {
            // A prefill replica that refused the request (4xx): the decode replica, sent the
            // same body, answers the client with the engine's own error.
            let status = answer.as_ref().map_or(0, |a| a.status);
            if status == 200 || (400..500).contains(&status) {
                if let Ok(a) = answer {
                    w.give_buf(a.body);
                }
                w.give_buf(body);
                count(
                    w,
                    match status {
                        200 => metrics::PD_DISAGGREGATED,
                        _ => metrics::PD_PREFILL_REFUSED,
                    },
                );
                rebuild_upstream_head(conn, head_end);
                return Ok(Prefilled::Decode {
                    body_end: sglang.body_end,
                    req_end: sglang.req_end,
                    prefill: replica,
                    sent: Some((decode, up)),
                });
            }
            // The prefill failed: its room will not be filled. The decode replica's
            // connection closes (the engine aborts the request and frees what it reserved);
            // another prefill replica and room are tried with it.
            up.0.close();
            sglang.decode = Some((decode, None));
        }
        match answer {
            Ok(answer) if answer.status == 200 => break Ok((replica, answer.body)),
            Ok(answer) if (400..500).contains(&answer.status) => {
                w.give_buf(answer.body);
                break Err(metrics::PD_PREFILL_REFUSED);
            }
            Ok(answer) => {
                w.give_buf(answer.body);
                count_failure(w, &routed, &UpstreamFailure::Unavailable);
            }
            Err(UpstreamFailure::ClientGone) => {
                metrics::add(&w.stats().replicas[replica].client_aborts, 1);
                sglang.release(w, received_at);
                w.give_buf(body);
                conn.log.status = 499;
                log_request(
                    w,
                    conn,
                    Some((head, body_end)),
                    &tried[..attempts],
                    received_at,
                );
                return Err(End::Close);
            }
            Err(f) => count_failure(w, &routed, &f),
        }
        if attempts >= max_attempts || w.draining.get() {
            break Err(metrics::PD_PREFILL_FAILED);
        }
        metrics::add(&w.stats().replicas[replica].retries, 1);
    };
    // The decode leg's head is built again by the caller's path.
    rebuild_upstream_head(conn, head_end);
    let (prefill, answer) = match outcome {
        Ok(v) => v,
        Err(why) => {
            w.give_buf(body);
            count(w, why);
            if sglang.decode.is_some() || w.has_sglang.get() {
                // SGLang's protocol: its decode replicas take no request without a room.
                sglang.release(w, received_at);
                log_fallback(NO_PREFILL);
                return Ok(Prefilled::Unavailable(NO_PREFILL));
            }
            if why == metrics::PD_PREFILL_FAILED {
                log_fallback(
                    "no prefill replica could compute a request; sent whole to a decode replica",
                );
            }
            return Ok(Prefilled::Whole);
        }
    };
    let Some(params) = kvlb_core::pd::kv_transfer_params(&answer) else {
        // The decode replica computes the prompt itself (the engine could not keep the KV).
        count(w, metrics::PD_NO_PARAMS);
        if let Some(more) = NO_PARAMS_LOG.allow() {
            eprintln!(
                "kvlb: a prefill answer carried no kv_transfer_params (is the replica's KV connector configured?); the decode replica computes the prompt{}",
                crate::log_limit::more(more)
            );
        }
        w.give_buf(answer);
        w.give_buf(body);
        return Ok(Prefilled::Decode {
            body_end,
            req_end,
            prefill,
            sent: None,
        });
    };
    let ok = kvlb_core::pd::vllm_decode_body(
        &conn.cbuf[head.head_len..body_end],
        &answer[params],
        &mut body,
    );
    w.give_buf(answer);
    debug_assert!(ok, "the prefill body was built from the same object");
    // The decode leg's body replaces the client's (pipelined bytes after it move along).
    conn.cbuf
        .splice(head.head_len..body_end, body.iter().copied());
    let new_end = head.head_len + body.len();
    let req_end = (req_end + new_end).saturating_sub(body_end);
    w.give_buf(body);
    count(w, metrics::PD_DISAGGREGATED);
    Ok(Prefilled::Decode {
        body_end: new_end,
        req_end,
        prefill,
        sent: None,
    })
}

const NO_PREFILL: &str = "no prefill replica could compute the request";

fn log_fallback(what: &str) {
    if let Some(more) = FALLBACK_LOG.allow() {
        eprintln!("kvlb: {what}{}", crate::log_limit::more(more));
    }
}

/// SGLang's decode leg, kept across prefill attempts: the decode replica (its connection,
/// pooled: true, while the request it was sent waits for its prefill), the decode replicas
/// that failed, and where the request ends in `conn.cbuf` once its body carries a room.
struct Sglang {
    decode: Option<(Routed, Option<(Upstream, bool)>)>,
    tried: [usize; MAX_ATTEMPTS],
    failed: usize,
    body_end: usize,
    req_end: usize,
}

impl Sglang {
    /// Give back the decode replica's concurrency slot (its request, if sent, abandoned).
    fn release(&mut self, w: &Worker, received_at: Instant) {
        if let Some((routed, up)) = self.decode.take() {
            if let Some((up, _)) = up {
                up.close();
            }
            drop(routed.in_flight(w, received_at));
        }
    }

    /// The body both legs take, with a new room and `prefill`'s bootstrap server, in `body`
    /// and in `conn.cbuf`; sent to the decode replica (chosen by decode load the first time,
    /// another after a failure). Err: no decode replica could take it.
    #[allow(clippy::too_many_arguments)]
    async fn send_decode(
        &mut self,
        w: &Worker,
        conn: &mut Conn,
        head: &RequestHead,
        head_end: usize,
        parsed: bool,
        model: ModelRoute,
        prefill: &Routed,
        port: u16,
        body: &mut Vec<u8>,
        received_at: Instant,
    ) -> Result<(), &'static str> {
        let room = w.rooms.borrow_mut().next_u64() & kvlb_core::pd::MAX_BOOTSTRAP_ROOM;
        let host = bootstrap_host(&prefill.spec.authority);
        if !kvlb_core::pd::sglang_body(
            &conn.cbuf[head.head_len..self.body_end],
            host,
            port,
            room,
            body,
        ) {
            return Err("the prefill replica's host cannot be sent as a bootstrap_host");
        }
        conn.cbuf
            .splice(head.head_len..self.body_end, body.iter().copied());
        let new_end = head.head_len + body.len();
        self.req_end = (self.req_end + new_end).saturating_sub(self.body_end);
        self.body_end = new_end;
        let decode_model = ModelRoute {
            leg: Leg::Decode,
            ..model
        };
        loop {
            let routed = match self.decode.take() {
                Some((routed, _)) => routed,
                None => {
                    let tried = &self.tried[..self.failed];
                    match route(w, conn, head, self.body_end, parsed, tried, decode_model) {
                        Route::To(r, _) => r,
                        Route::AllBusy => match wait_for_capacity(w, tried, decode_model).await {
                            Ok(()) => continue,
                            Err(_) => return Err("every decode replica is at its limit"),
                        },
                        Route::NoneLeft => return Err("no decode replica could take the request"),
                    }
                }
            };
            rebuild_upstream_head(conn, head_end);
            routed.finish_head(conn, head, self.body_end - head.head_len);
            let coalesce = coalesce_body(conn, head, self.body_end);
            match send(w, conn, &routed, head, self.body_end, coalesce, false).await {
                Ok(up) => {
                    self.decode = Some((routed, Some(up)));
                    return Ok(());
                }
                Err(f) => {
                    count_failure(w, &routed, &f);
                    drop(routed.in_flight(w, received_at));
                    self.tried[self.failed] = routed.replica;
                    self.failed += 1;
                    if self.failed >= MAX_ATTEMPTS {
                        return Err("no decode replica could take the request");
                    }
                }
            }
        }
    }
}

/// The host of a replica's `host[:port]` (an IPv6 address without its brackets): where its
/// bootstrap server listens, as SGLang's routers take it from the replica's URL.
fn bootstrap_host(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

static FALLBACK_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();
static NO_PARAMS_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

struct Answer {
    status: u16,
    /// Its body, de-chunked (a worker buffer: given back by the caller).
    body: Vec<u8>,
}

/// Send the head in `conn.obuf` and `body` to the routed replica and read its whole answer,
/// counting the request in flight there until then.
async fn exchange(
    w: &Worker,
    conn: &mut Conn,
    routed: &Routed,
    head: &RequestHead,
    body: &[u8],
    received_at: Instant,
) -> Result<Answer, UpstreamFailure> {
    let replica = routed.replica;
    let mut in_flight = routed.in_flight(w, received_at);
    if let Some(i) = routed.load {
        // An adapter kvlb is loading there for the request.
        w.adapter_loaded(i, replica, routed.epoch)
            .await
            .map_err(UpstreamFailure::AdapterLoad)?;
    }
    let rc = &w.stats().replicas[replica];
    let deadline = crate::rt::now() + w.cfg().upstream_timeout_of(routed.class.table);
    conn.obuf.extend_from_slice(body);
    // The body went into obuf after the head: sent as a coalesced one.
    let mut fresh = false;
    let (mut up, rhead) = loop {
        let (mut up, reused) = send(w, conn, routed, head, head.head_len, true, fresh).await?;
        // The head read back writes a client head into obuf: the request's is sent by now.
        match read_response_head(w, conn, &mut up, &routed.spec.url, head, deadline).await {
            Ok(h) => break (up, h),
            // A pooled connection the replica had closed: sent again on a fresh one (the
            // request is still in obuf: a head is written there only once one was read).
            Err(UpstreamFailure::Closed) if reused && !fresh => {
                up.close();
                fresh = true;
            }
            Err(f) => {
                up.close();
                return Err(f);
            }
        }
    };
    // A successful answer comes after the prompt and one token: a time to first token, as a
    // stream's first event is (a calibration sample), timed at its first body byte (a
    // streamed answer's head may come before the token).
    if rhead.status == 200 {
        in_flight.streamed();
    }
    let mut timed = false;
    let mut out = w.take_buf();
    out.clear();
    let mut decoder = kvlb_core::http::chunked::ChunkedDecoder::new();
    let mut from = rhead.head_len;
    let mut got = 0u64;
    let complete = loop {
        let bytes = &conn.ubuf[from.min(conn.ubuf.len())..];
        let done = match rhead.body {
            ResponseBody::None => true,
            ResponseBody::Length(n) => {
                let take = (bytes.len() as u64).min(n - got) as usize;
                out.extend_from_slice(&bytes[..take]);
                got += take as u64;
                got == n
            }
            ResponseBody::Chunked => {
                let fed = decoder.feed(bytes, |a, b| out.extend_from_slice(&bytes[a..b]));
                if fed.is_err() {
                    w.give_buf(out);
                    return Err(UpstreamFailure::Invalid);
                }
                decoder.is_done()
            }
            ResponseBody::UntilClose => {
                out.extend_from_slice(bytes);
                false
            }
        };
        if out.len() > MAX_PREFILL_ANSWER {
            w.give_buf(out);
            return Err(UpstreamFailure::Invalid);
        }
        if !timed && (done || !out.is_empty()) {
            in_flight.first_byte();
            timed = true;
        }
        if done {
            break true;
        }
        conn.ubuf.clear();
        from = 0;
        let r = {
            let recv = std::pin::pin!(op::recv_multi(
                &mut up.recv,
                &mut conn.ubuf,
                Some(remaining(deadline))
            ));
            match select(recv, conn.watch.gone()).await {
                Either::Left(r) => r,
                Either::Right(()) => {
                    w.give_buf(out);
                    return Err(UpstreamFailure::ClientGone);
                }
            }
        };
        match r {
            Ok(0) if rhead.body == ResponseBody::UntilClose => break false,
            Ok(0) => {
                w.give_buf(out);
                return Err(UpstreamFailure::Closed);
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                w.give_buf(out);
                return Err(UpstreamFailure::Timeout);
            }
            Err(_) => {
                w.give_buf(out);
                return Err(UpstreamFailure::Closed);
            }
        }
    };
    in_flight.finished();
    if rhead.status != 503 {
        w.shared.fleet.slot(replica).record_success();
    }
    let class = metrics::status_class(rhead.status);
    metrics::add(&rc.responses[class], 1);
    if complete && rhead.reusable {
        w.return_upstream(replica, up, routed.epoch);
    } else {
        up.close();
    }
    Ok(Answer {
        status: rhead.status,
        body: out,
    })
}
