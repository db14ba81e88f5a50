//! L4 forwarding: a client connection on an L4 listener is routed once, on its first request,
//! and then joined to the chosen replica for the connection's life.
//!
//! kvlb reads the first request head (and, on prompt paths, the body the cache-aware prefix
//! hashes), selects a replica with the worker's policy exactly as the L7 path does, connects,
//! sends the bytes it has read verbatim, and from then on only moves bytes: with `splice`
//! (io_uring splice through a per-worker pipe pool, see `relay`) or with `sockmap` (a BPF
//! stream verdict program redirects them inside the kernel, see `sockmap`). Every later request
//! on the connection goes to the same replica, unparsed.
//!
//! Accounting: the connection counts as one request in flight at its replica for its life;
//! the first request's uncached prefill counts as queued there until the replica's first
//! byte (as on the L7 path).

pub mod relay;
pub mod sockmap;

use crate::config::L4Forwarding;
use crate::http::request::{self, BodyFraming, Method};
use crate::http::{write_error, HttpError};
use crate::metrics::{families, Collector, DescriptorEncoder};
use crate::models::ModelKey;
use crate::prompt::PromptError;
use crate::rt::op;
use crate::worker::{CountedAs, InFlight, Worker, SMALL_BODY};
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How long a replica that refused a connection is skipped (as on the L7 path).
/// Process-wide L4 counters, on /metrics through `L4Metrics`.
pub struct L4Stats {
    /// Connections joined, by how: splice, sockmap.
    pub joined: [AtomicU64; 2],
    /// Joined connections open now.
    pub active: AtomicU64,
    /// Connections that ended by an abort (reset or error on either side).
    pub aborted: AtomicU64,
    /// Bytes moved client -> replica and replica -> client after the join.
    pub bytes_up: AtomicU64,
    pub bytes_down: AtomicU64,
    /// Sockmap joins that could not be made (socket already closing) and used splice.
    pub sockmap_join_failures: AtomicU64,
}

pub static STATS: L4Stats = L4Stats {
    joined: [AtomicU64::new(0), AtomicU64::new(0)],
    active: AtomicU64::new(0),
    aborted: AtomicU64::new(0),
    bytes_up: AtomicU64::new(0),
    bytes_down: AtomicU64::new(0),
    sockmap_join_failures: AtomicU64::new(0),
};

/// The L4 mode's figures on /metrics (registered by the admin listener).
#[derive(Debug)]
pub struct L4Metrics;

impl Collector for L4Metrics {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let mut joined = families::L4_CONNECTIONS.describe(&mut enc)?;
        for (i, how) in ["splice", "sockmap"].iter().enumerate() {
            joined.counter(&[how], STATS.joined[i].load(Relaxed))?;
        }
        families::L4_ACTIVE_CONNECTIONS
            .describe(&mut enc)?
            .gauge(&[], STATS.active.load(Relaxed))?;
        families::L4_ABORTED_CONNECTIONS
            .describe(&mut enc)?
            .counter(&[], STATS.aborted.load(Relaxed))?;
        let mut bytes = families::L4_BYTES.describe(&mut enc)?;
        bytes.counter(&["to_replica"], STATS.bytes_up.load(Relaxed))?;
        bytes.counter(&["to_client"], STATS.bytes_down.load(Relaxed))?;
        families::L4_SOCKMAP_JOIN_FAILURES
            .describe(&mut enc)?
            .counter(&[], STATS.sockmap_join_failures.load(Relaxed))?;
        sockmap::encode_metrics(&mut enc)
    }
}

/// The forwarding L4 connections of this process really use: `requested`, unless it is
/// sockmap and the program cannot be loaded here (then splice, said once on stderr).
pub fn effective_forwarding(requested: L4Forwarding) -> L4Forwarding {
    match requested {
        L4Forwarding::Splice => L4Forwarding::Splice,
        L4Forwarding::Sockmap => match sockmap::get() {
            Some(_) => L4Forwarding::Sockmap,
            None => L4Forwarding::Splice,
        },
    }
}

/// What the first request of a connection says about where it should go.
struct Routed {
    replica: usize,
    prefill_tokens: u64,
    expected: crate::worker::Expected,
    /// The first request's model label.
    model_label: u16,
    /// The LoRA adapter the first request runs under (`ModelRoute::lora`; 0: none).
    lora: u64,
}

/// Serve one client connection accepted on an L4 listener.
pub async fn serve_connection(w: Rc<Worker>, fd: RawFd, peer: Option<SocketAddr>) {
    w.open.set(w.open.get() + 1);
    w.stats().open_connections.fetch_add(1, Relaxed);
    let mut buf = w.take_buf();
    let mut ubuf = w.take_buf();
    let outcome = first_request(&w, fd, peer, &mut buf, &mut ubuf).await;
    w.give_buf(ubuf);
    match outcome {
        Some((routed, received_at)) => {
            join(&w, fd, routed, received_at, buf).await;
        }
        None => {
            w.give_buf(buf);
            // Safety: shutdown(2) then close(2) of our own client socket.
            unsafe { libc::shutdown(fd, libc::SHUT_WR) };
            op::close(fd);
        }
    }
    w.open.set(w.open.get() - 1);
    w.stats().open_connections.fetch_sub(1, Relaxed);
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

async fn recv_more(fd: RawFd, buf: &mut Vec<u8>, deadline: Instant) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 4096 {
        buf.reserve(buf.len().max(4096));
    }
    let (r, b) = op::recv(fd, std::mem::take(buf), Some(remaining(deadline))).await;
    *buf = b;
    r
}

async fn local_error(w: &Worker, fd: RawFd, e: HttpError) {
    w.stats().local_error(e.status());
    let _ = op::send_static(fd, e.response()).await;
}

/// Read and route the first request. `buf` ends up holding every byte read from the client
/// (to be sent to the replica verbatim). None: the connection is to be closed (an error was
/// answered, the client left, or kvlb is draining).
async fn first_request(
    w: &Rc<Worker>,
    fd: RawFd,
    peer: Option<SocketAddr>,
    buf: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> Option<(Routed, Instant)> {
    let shared_cfg = w.cfg();
    let cfg = &*shared_cfg;
    if w.draining.get() {
        return None;
    }
    // The first bytes, with the keep-alive idle timeout; drain wakes this receive.
    let slot = w.idle_client_enter(fd);
    let (r, b) = op::recv(fd, std::mem::take(buf), Some(cfg.timeouts.idle)).await;
    w.idle_client_leave(slot);
    *buf = b;
    match r {
        Ok(n) if n > 0 => {}
        _ => return None,
    }
    let received_at = Instant::now();
    let deadline = received_at + cfg.timeouts.client;
    let max_head = cfg.limits.max_header_bytes;
    let mut scanned = 0usize;
    let head_end = loop {
        let from = scanned.saturating_sub(3);
        if let Some(e) = request::find_head_end(&buf[from..]) {
            let e = e + from;
            if e > max_head {
                local_error(w, fd, HttpError::HeaderTooLarge).await;
                return None;
            }
            break e;
        }
        scanned = buf.len();
        if scanned > max_head {
            local_error(w, fd, HttpError::HeaderTooLarge).await;
            return None;
        }
        match recv_more(fd, buf, deadline).await {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                local_error(w, fd, HttpError::RequestTimeout).await;
                return None;
            }
            Err(_) => return None,
        }
    };
    scratch.clear();
    let head = match request::parse_request(buf, head_end, peer.map(|p| p.ip()), scratch) {
        Ok(h) => h,
        Err(e) => {
            local_error(w, fd, e).await;
            return None;
        }
    };
    w.stats().requests.fetch_add(1, Relaxed);
    let path = (head.target.0, head.target.1);

    // The body only matters on prompt paths, where the prefix is hashed from it. A body the
    // client holds back for a 100 Continue, or sends chunked, is not waited for: the replica
    // answers the former and the request is routed by load.
    let prompt_path = head.method == Method::Post && {
        let mut prefix = w.prefix.borrow_mut();
        !matches!(
            crate::prefix::hash_request(&buf[path.0..path.1], b"", &w.shared.prefix, &mut prefix),
            Err(PromptError::NotAPromptPath)
        )
    };
    let mut body_end = head.head_len;
    if prompt_path && !head.expect_continue {
        let length = match head.body {
            BodyFraming::Length(n) if n <= cfg.limits.max_body_bytes as u64 => Some(n),
            _ => None,
        };
        if let Some(n) = length {
            // Body memory the body holds while it is received (as in L7, bodies up to
            // SMALL_BODY take none). Without room it is not waited for: the request is routed
            // by load and the replica gets the body as it comes.
            let held = if n as usize > SMALL_BODY {
                n as usize
            } else {
                0
            };
            if held > 0 && !w.take_body_memory(held) {
                w.stats().body_memory_refused.fetch_add(1, Relaxed);
            } else {
                let need = head.head_len + n as usize;
                while buf.len() < need {
                    let failed = match recv_more(fd, buf, deadline).await {
                        Ok(0) => Some(None),
                        Ok(_) => None,
                        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                            Some(Some(HttpError::RequestTimeout))
                        }
                        Err(_) => Some(None),
                    };
                    if let Some(answer) = failed {
                        w.give_body_memory(held);
                        if let Some(e) = answer {
                            local_error(w, fd, e).await;
                        }
                        return None;
                    }
                }
                body_end = need;
                w.give_body_memory(held);
            }
        }
    }

    w.refresh();
    let path_bytes = &buf[path.0..path.1];
    let body = &buf[head.head_len..body_end];
    let parsed = prompt_path && body_end > head.head_len && w.hash_prompt(path_bytes, body);
    // The connection goes where its first request's model is served (an adapter kvlb loads
    // on demand, once loaded); a model no replica serves goes anywhere, and that replica
    // answers its own 404.
    let (model, class) = w.request_model(body, parsed);
    let (key, adapter) = match model {
        crate::worker::RequestModel::Route(model) => (model, None),
        crate::worker::RequestModel::Adapter(i) => (
            ModelKey::Named(w.shared.on_demand.adapters[i].key),
            Some(i as u16),
        ),
        crate::worker::RequestModel::NotServed => (ModelKey::Any, None),
    };
    let model = crate::worker::ModelRoute {
        key,
        class,
        adapter,
        pin: None,
        leg: crate::worker::Leg::Whole,
    };
    let body_len = match head.body {
        BodyFraming::Length(n) => n.min(u32::MAX as u64) as usize,
        _ => body.len(),
    };
    // An adapter the chosen replica does not hold is loaded there first (routed again when
    // another request's load of it began elsewhere meanwhile).
    let mut choice = None;
    for _ in 0..4 {
        if w.fill_candidates(&[], model).0 == 0 {
            break;
        }
        let c = w.choose(
            head.method,
            path_bytes,
            body,
            body_len,
            parsed,
            class,
            false,
            model.leg,
        );
        let epoch = w.shared.fleet.slot(c.replica).epoch.load(Relaxed);
        match adapter.map(|i| i as usize) {
            Some(i) if !w.adapter_held(i, c.replica, epoch) => {
                if !w.claim_adapter_load(i, c.replica, epoch) {
                    continue;
                }
                if w.adapter_loaded(i, c.replica, epoch).await.is_err() {
                    continue;
                }
                choice = Some(c);
            }
            _ => choice = Some(c),
        }
        break;
    }
    let Some(choice) = choice else {
        local_error(w, fd, HttpError::NoReplica).await;
        return None;
    };
    let m = w.stats().model(class.label);
    crate::metrics::add(&m.prompt_tokens, choice.prompt_tokens as u64);
    crate::metrics::add(
        &m.matched_tokens,
        choice.decision.map_or(0, |d| d.matched_tokens) as u64,
    );
    Some((
        Routed {
            replica: choice.replica,
            prefill_tokens: choice.prefill_tokens(),
            expected: choice.expected(),
            model_label: class.label,
            lora: model.lora(),
        },
        received_at,
    ))
}

/// Connect to the routed replica, send what was read, and relay until the connection ends.
async fn join(w: &Rc<Worker>, cfd: RawFd, routed: Routed, received_at: Instant, buf: Vec<u8>) {
    let replica = routed.replica;
    let mut in_flight = InFlight::new(
        w,
        replica,
        routed.prefill_tokens,
        routed.expected,
        received_at,
        false,
        CountedAs {
            model_label: routed.model_label,
            lora: routed.lora,
        },
    );
    let rc = &w.stats().replicas[replica];
    let slot = w.shared.fleet.slot(replica);
    let Some(spec) = slot.spec() else {
        // The replica left between routing and now.
        w.give_buf(buf);
        drop(in_flight);
        local_error(w, cfd, HttpError::NoReplica).await;
        op::close(cfd);
        return;
    };
    let url: &str = &spec.url;
    let rfd = match w.connect_replica(spec.addr).await {
        Ok(fd) => fd,
        Err(e) => {
            let health = &w.cfg().health;
            slot.record_failure(
                w.shared.now_ms(),
                health.max_fails,
                health.fail_timeout.as_millis() as u64,
            );
            rc.bad_gateway.fetch_add(1, Relaxed);
            bad_gateway(cfd, url, &format!("cannot connect to replica {url}: {e}")).await;
            w.give_buf(buf);
            drop(in_flight);
            shutdown(cfd, libc::SHUT_WR);
            op::close(cfd);
            return;
        }
    };
    rc.connects.fetch_add(1, Relaxed);
    let forwarding = effective_forwarding(w.cfg().l4_forwarding);
    let mut buf = buf;
    if forwarding == L4Forwarding::Sockmap {
        // The program would see a buffer kvlb has partly read whole again (the kernel hands
        // it over from its start): take every queued byte now, so only untouched buffers are
        // queued when the socket enters the map. They go out with the prelude.
        sockmap::take_queued(cfd, &mut buf);
    }
    let prelude = buf.len();
    let (r, buf) = op::send_all(rfd, buf, 0, prelude).await;
    w.give_buf(buf);
    if r.is_err() {
        rc.bad_gateway.fetch_add(1, Relaxed);
        bad_gateway(
            cfd,
            url,
            &format!("replica {url} closed the connection before answering"),
        )
        .await;
        drop(in_flight);
        op::close(rfd);
        op::close(cfd);
        return;
    }
    rc.bytes_to_replica.fetch_add(prelude as u64, Relaxed);
    STATS.active.fetch_add(1, Relaxed);
    let moved = match forwarding {
        L4Forwarding::Sockmap => {
            match sockmap::relay(w, cfd, rfd, prelude as u64, &mut in_flight).await {
                Ok(m) => m,
                Err(()) => {
                    STATS.sockmap_join_failures.fetch_add(1, Relaxed);
                    STATS.joined[0].fetch_add(1, Relaxed);
                    relay::relay(w, cfd, rfd, &mut in_flight).await
                }
            }
        }
        L4Forwarding::Splice => {
            STATS.joined[0].fetch_add(1, Relaxed);
            relay::relay(w, cfd, rfd, &mut in_flight).await
        }
    };
    STATS.active.fetch_sub(1, Relaxed);
    STATS.bytes_up.fetch_add(moved.up, Relaxed);
    STATS.bytes_down.fetch_add(moved.down, Relaxed);
    rc.bytes_to_replica.fetch_add(moved.up, Relaxed);
    rc.bytes_from_replica.fetch_add(moved.down, Relaxed);
    if moved.aborted {
        STATS.aborted.fetch_add(1, Relaxed);
        if moved.client_aborted {
            rc.client_aborts.fetch_add(1, Relaxed);
        }
    }
    drop(in_flight);
    op::close(rfd);
    op::close(cfd);
}

/// Answer the client with kvlb's OpenAI-style 502 naming the replica (nothing was relayed yet).
async fn bad_gateway(cfd: RawFd, url: &str, msg: &str) {
    let mut out = Vec::new();
    write_error(
        &mut out,
        502,
        "Bad Gateway",
        "upstream_error",
        msg,
        Some(url),
        true,
    );
    let n = out.len();
    let _ = op::send_all(cfd, out, 0, n).await;
}

/// What a relay moved, and how it ended.
#[derive(Debug, Default, Clone, Copy)]
pub struct Moved {
    pub up: u64,
    pub down: u64,
    /// Ended by a reset or error rather than by both sides closing.
    pub aborted: bool,
    /// The client was the side that failed.
    pub client_aborted: bool,
}

/// shutdown(2) of one direction of a socket we own.
pub(crate) fn shutdown(fd: RawFd, how: libc::c_int) {
    // Safety: shutdown(2) on a socket owned by the calling connection task.
    unsafe { libc::shutdown(fd, how) };
}
