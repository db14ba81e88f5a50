//! Routing: kvlb's own probes (liveness, readiness), the choice of a replica and its
//! concurrency slot, the bounded wait when every replica is at its limit, and the
//! `x-kvlb-decision` line.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::Conn;
use crate::config::ReplicaConfig;
use crate::http::request::{BodyFraming, Method, RequestHead};
use crate::http::HttpError;
use crate::metrics;
use crate::models::ModelClass;
use crate::rt::op;
use crate::select::Decision;
use crate::worker::{Leg, ModelRoute, Worker};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

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

/// The fields a decode leg's decision adds to the prefill leg's `x-kvlb-decision` line in
/// `buf[..len]` (replacing those of an earlier decode attempt): the decode replica's held
/// tokens (`decode_matched_tokens`) and estimate (`decode_ttft_ms`: the transfer of what it
/// lacks, its wait, one step) and the pair's (`pair_ttft_ms`: the prefill leg's estimate with
/// this transfer in place of the whole prompt's, `transfer_s`). Returns the new length: `len`
/// when there is no line, the prefill leg's fields alone when the new ones do not fit.
fn append_decode(
    buf: &mut [u8; 256],
    len: usize,
    d: &Decision,
    prefill_ms: Option<f64>,
    transfer_s: f64,
) -> usize {
    use std::io::Write;
    const MARK: &[u8] = b"; decode_matched_tokens=";
    let Some(line) = len.checked_sub(2).filter(|&l| buf[l..len] == *b"\r\n") else {
        return len;
    };
    let end = memchr::memmem::find(&buf[..line], MARK).unwrap_or(line);
    let decode_ms = d.ttft_s * 1e3;
    let pair_ms = prefill_ms.map_or(-1.0, |p| (p - transfer_s * 1e3).max(0.0) + decode_ms);
    let mut cur = std::io::Cursor::new(&mut buf[end..]);
    let ok = write!(
        cur,
        "; decode_matched_tokens={}; decode_ttft_ms={:.1}; pair_ttft_ms={:.1}\r\n",
        d.matched_tokens, decode_ms, pair_ms
    )
    .is_ok();
    match ok {
        true => end + cur.position() as usize,
        false => {
            // Too long for the buffer: the prefill leg's fields alone.
            buf[end..end + 2].copy_from_slice(b"\r\n");
            end + 2
        }
    }
}

/// A request target's path, without its query.
fn target_path(target: &[u8]) -> &[u8] {
    match memchr::memchr(b'?', target) {
        Some(q) => &target[..q],
        None => target,
    }
}

/// What kvlb answers to a probe of its own (`liveness_path`, `readiness_path`), if the
/// request is one: GET or HEAD without a body.
pub(super) fn probe_state(
    w: &Worker,
    cfg: &crate::config::ServeConfig,
    conn: &Conn,
    head: &RequestHead,
) -> Option<ProbeState> {
    if !matches!(head.method, Method::Get | Method::Head) || head.body != BodyFraming::None {
        return None;
    }
    let path = target_path(&conn.cbuf[head.target.0..head.target.1]);
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
pub(super) enum ProbeState {
    Live,
    Ready,
    Draining,
    NoReplica,
}

impl ProbeState {
    pub(super) fn status(self) -> u16 {
        match self {
            ProbeState::Live | ProbeState::Ready => 200,
            ProbeState::Draining | ProbeState::NoReplica => 503,
        }
    }

    /// The whole response, built once per process.
    pub(super) fn response(self, head_only: bool) -> &'static [u8] {
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

/// kvlb's own answer to `GET /v1/models` (the fleet's models, every name once) or
/// `GET /v1/models/{id}` (one of them, or OpenAI's 404), written into `conn.obuf`: Some(status)
/// when kvlb answers, None to forward the request (not that path, or no replica's models are
/// known). The list is built when the replicas' lists change, never per request.
pub(super) fn models_answer(w: &Worker, conn: &mut Conn, head: &RequestHead) -> Option<u16> {
    if !matches!(head.method, Method::Get | Method::Head) {
        return None;
    }
    let path = target_path(&conn.cbuf[head.target.0..head.target.1]);
    let rest = path.strip_prefix(b"/v1/models")?;
    let models = w.shared.models.load();
    if !models.knows_any() {
        return None;
    }
    let head_only = head.method == Method::Head;
    conn.obuf.clear();
    match rest {
        b"" | b"/" => {
            crate::http::write_json_ok(&mut conn.obuf, models.list_json(), head_only);
            Some(200)
        }
        _ => {
            let id = percent_decoded(rest.strip_prefix(b"/")?);
            match models.card(&id) {
                Some(card) => {
                    let body = serde_json::to_vec(&card.raw).unwrap_or_default();
                    crate::http::write_json_ok(&mut conn.obuf, &body, head_only);
                    Some(200)
                }
                None => {
                    let name = String::from_utf8_lossy(&id);
                    crate::http::write_model_not_found_in(&mut conn.obuf, conn.shape, &name);
                    Some(404)
                }
            }
        }
    }
}

/// `%XX` escapes of a path segment decoded (model ids hold `/`, sent as `%2F` or as is).
fn percent_decoded(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            s[i],
            s.get(i + 1).copied().and_then(hex),
            s.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(a), Some(b)) => {
                out.push((a * 16 + b) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// Wait, in the bounded queue, until some replica not in `tried` is below its concurrency
/// limit. Err: the 429 to answer (queue full, or waited `queue_timeout`).
pub(super) async fn wait_for_capacity(
    w: &Worker,
    tried: &[usize],
    model: ModelRoute,
) -> Result<(), HttpError> {
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
        if w.fill_candidates(tried, model).0 > 0 {
            break Ok(());
        }
        if crate::rt::now() >= deadline || w.draining.get() {
            break Err(HttpError::QueueTimeout);
        }
    };
    queued.fetch_sub(1, Relaxed);
    result
}

pub(super) enum Route {
    /// Send it there (its concurrency slot taken), with the explain line's length.
    To(Routed, usize),
    /// Every replica left is at its concurrency limit.
    AllBusy,
    /// No replica left to try.
    NoneLeft,
}

/// Choose a replica for the request (not one of `tried`) and account for the decision.
/// Returns None when no replica is left to try.
pub(super) fn route(
    w: &Worker,
    conn: &mut Conn,
    head: &RequestHead,
    body_end: usize,
    parsed: bool,
    tried: &[usize],
    model: ModelRoute,
) -> Route {
    let cfg = w.cfg();
    match w.fill_candidates(tried, model) {
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
        model.class,
        model.pin.is_some(),
        model.leg,
    );
    let replica = choice.replica;
    let slot = w.shared.fleet.slot(replica);
    let epoch = slot.epoch.load(Relaxed);
    // The slot was emptied since the candidates were read: nothing to send there.
    let Some(spec) = slot.spec() else {
        return Route::NoneLeft;
    };
    // An adapter it does not hold: loaded there first, one load at a time (another request
    // may have started one elsewhere since the candidates were read: routed again, it waits
    // for that one).
    let load = match model.adapter {
        Some(i) if !w.adapter_held(i as usize, replica, epoch) => {
            if !w.claim_adapter_load(i as usize, replica, epoch) {
                return Route::AllBusy;
            }
            Some(i as usize)
        }
        _ => None,
    };
    // Take a concurrency slot there; another worker may have taken the last one since the
    // candidates were read.
    let cap = match slot.max_in_flight.load(Relaxed) {
        0 => cfg.max_in_flight_of(model.class.table),
        c => c,
    };
    let in_flight = &w.shared.loads[replica].in_flight;
    if in_flight.fetch_add(1, Relaxed) >= cap && cap > 0 {
        in_flight.fetch_sub(1, Relaxed);
        return Route::AllBusy;
    }
    let routed = Routed {
        replica,
        epoch,
        spec,
        prefill_tokens: choice.prefill_tokens(),
        expected: choice.expected(),
        class: model.class,
        load,
        lora: model.lora(),
    };
    if model.leg == Leg::Decode {
        // The decode leg of a disaggregated request: the prompt was computed on the prefill
        // replica, whose decision the log keeps; the explain line adds the decode replica's
        // estimate and the pair's. The decode replica computes nothing kvlb could time: its
        // first byte times the whole request.
        if let (Some(d), true) = (choice.decision, cfg.explain) {
            let transfer_s = cfg
                .cost_model_of(model.class.table)
                .kv_transfer_s(choice.prompt_tokens);
            let prefill_ms = conn.log.estimate.map(|e| e.ttft_ms as f64);
            conn.explain_len = append_decode(
                &mut conn.explain,
                conn.explain_len,
                &d,
                prefill_ms,
                transfer_s,
            );
        }
        return Route::To(
            Routed {
                prefill_tokens: 0,
                expected: crate::worker::Expected::default(),
                ..routed
            },
            conn.explain_len,
        );
    }
    let mut explain_len = 0;
    if let (Some(d), true) = (choice.decision, cfg.explain) {
        explain_len = write_decision(&mut conn.explain, &d, choice.prompt_tokens);
    }
    conn.log.reason = choice.decision.map(|d| d.reason.as_str());
    conn.log.estimate = choice.decision.map(|d| crate::access_log::Estimated {
        ttft_ms: (d.ttft_s * 1e3) as f32,
        wait_ms: (d.wait.waited_at(d.pace) * 1e3) as f32,
        runner_up_ms: (d.runner_up_ttft_s * 1e3) as f32,
        spilled: d.spilled,
    });
    conn.log.matched_tokens = choice.decision.map_or(0, |d| d.matched_tokens);
    conn.log.prompt_tokens = choice.prompt_tokens;
    if tried.is_empty() {
        let m = w.stats().model(model.class.label);
        metrics::add(&m.prompt_tokens, choice.prompt_tokens as u64);
        metrics::add(&m.matched_tokens, conn.log.matched_tokens as u64);
    }
    Route::To(routed, explain_len)
}

impl Routed {
    /// End the upstream head in `conn.obuf` for this replica: the Host it falls back to
    /// (HTTP/1.0 clients send none), its data-parallel rank, the body's length.
    pub(super) fn finish_head(&self, conn: &mut Conn, head: &RequestHead, body_len: usize) {
        if !head.has_host {
            conn.obuf.extend_from_slice(b"host: ");
            conn.obuf.extend_from_slice(self.spec.authority.as_bytes());
            conn.obuf.extend_from_slice(b"\r\n");
        }
        if let Some(rank) = self.spec.dp_rank {
            crate::http::request::push_dp_rank(&mut conn.obuf, rank);
        }
        crate::http::request::finish_upstream_head(&mut conn.obuf, head.method, body_len);
    }

    /// The request counted in flight there (`route` took its slot already) from now until the
    /// returned guard drops.
    pub(super) fn in_flight<'w>(
        &self,
        w: &'w Worker,
        received_at: std::time::Instant,
    ) -> crate::worker::InFlight<'w> {
        crate::worker::InFlight::new(
            w,
            self.replica,
            self.prefill_tokens,
            self.expected,
            received_at,
            true,
            crate::worker::CountedAs {
                model_label: self.class.label,
                lora: self.lora,
            },
        )
    }
}

/// Where a request goes and what kvlb expects of it there.
pub(super) struct Routed {
    pub(super) replica: usize,
    /// The slot's epoch when routed (pooled connections must match it).
    pub(super) epoch: u64,
    pub(super) spec: Arc<ReplicaConfig>,
    /// Prompt tokens the replica will compute (not resident there).
    pub(super) prefill_tokens: u64,
    /// cache_aware's time-to-first-token estimate (none when the policy makes none).
    pub(super) expected: crate::worker::Expected,
    /// The request's model label and settings.
    pub(super) class: ModelClass,
    /// A LoRA adapter (`lora_adapter` index) to wait for: being loaded there.
    pub(super) load: Option<usize>,
    /// The LoRA adapter it runs under (`ModelRoute::lora`; 0: none).
    pub(super) lora: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(buf: &[u8; 256], len: usize) -> &str {
        std::str::from_utf8(&buf[..len]).unwrap()
    }

    #[test]
    fn a_decode_leg_adds_its_estimate_and_the_pairs_to_the_decision_line() {
        let mut buf = [0u8; 256];
        let prefill = Decision {
            ttft_s: 0.25,
            ..Decision::default()
        };
        let len = write_decision(&mut buf, &prefill, 4000);
        assert!(len > 0);
        let prefill_line = line(&buf, len).to_owned();
        let decode = Decision {
            matched_tokens: 3000,
            ttft_s: 0.015,
            ..Decision::default()
        };
        // The prefill estimate, 250 ms, held a 20 ms transfer of the whole prompt: 230 ms
        // without it, and 245 ms for the pair with the decode replica's 15 ms.
        let n = append_decode(&mut buf, len, &decode, Some(250.0), 0.020);
        let l = line(&buf, n);
        assert!(l.starts_with("x-kvlb-decision: reason=fallback;"), "{l}");
        let added = "; decode_matched_tokens=3000; decode_ttft_ms=15.0; pair_ttft_ms=245.0\r\n";
        assert!(l.ends_with(added), "{l}");
        // A second decode attempt replaces the first's fields.
        let again = Decision {
            ttft_s: 0.5,
            ..decode
        };
        let m = append_decode(&mut buf, n, &again, None, 0.020);
        let l = line(&buf, m);
        assert_eq!(l.matches("decode_ttft_ms").count(), 1, "{l}");
        assert!(
            l.ends_with("decode_ttft_ms=500.0; pair_ttft_ms=-1.0\r\n"),
            "{l}"
        );
        // No line (explain off, or no estimate for the prefill leg): nothing added.
        assert_eq!(append_decode(&mut [0u8; 256], 0, &decode, None, 0.0), 0);
        // Fields that do not fit: the prefill leg's line as it was.
        let huge = Decision {
            ttft_s: 1e200,
            ..decode
        };
        let k = append_decode(&mut buf, m, &huge, Some(1e200), 0.0);
        assert_eq!(line(&buf, k), prefill_line);
    }
}
