//! Logging: what the access log says of a request, gathered on its way, and its line.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::Conn;
use crate::http::request::RequestHead;
use crate::worker::Worker;
use std::time::Instant;

/// The parts of a request's access log line learnt on its way (see `crate::access_log`).
#[derive(Default, Clone, Copy)]
pub(super) struct LogState {
    /// The status sent to the client (0: none yet; 499: the client left first).
    pub(super) status: u16,
    /// Microseconds from the request received to the replica's response head.
    pub(super) ttfb_us: Option<u64>,
    pub(super) reason: Option<&'static str>,
    pub(super) matched_tokens: u32,
    pub(super) prompt_tokens: u32,
    /// The response was cut short after its head was sent (`Cut::label`).
    pub(super) cut: Option<&'static str>,
    /// The request's model label, once its model was looked up (counted by model then).
    pub(super) model: Option<u16>,
    /// Microseconds from the request received to the replica's first response body byte.
    pub(super) first_byte_us: Option<u64>,
    /// What cache_aware expected: its estimate there, the queue wait in it, the runner-up's.
    pub(super) estimate: Option<crate::access_log::Estimated>,
    /// The prefill replica of a disaggregated request (`proxy::pd`).
    pub(super) prefill: Option<usize>,
}

/// Write the current request's access log line, when the access log is on, and count its
/// end by model (every request's end passes here). `head` is None when the request could
/// not be parsed; `tried` are the replicas it was sent to, last one last.
pub(super) fn log_request(
    w: &Worker,
    conn: &Conn,
    head: Option<(&RequestHead, usize)>,
    tried: &[usize],
    received_at: Instant,
) {
    if let Some(label) = conn.log.model {
        w.stats().model(label).answered(conn.log.status);
    }
    let log = w.access_log.borrow();
    let Some(log) = log.as_ref() else { return };
    let spec = tried.last().and_then(|&r| w.shared.fleet.slot(r).spec());
    let prefill = conn.log.prefill.and_then(|r| w.shared.fleet.slot(r).spec());
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
        prefill_replica: prefill.as_ref().map(|s| s.url.as_str()),
        reason: conn.log.reason,
        prompt_tokens: conn.log.prompt_tokens,
        matched_tokens: conn.log.matched_tokens,
        bytes_in,
        ttfb_us: conn.log.ttfb_us,
        first_byte_us: conn.log.first_byte_us,
        estimate: conn.log.estimate,
        total_us: crate::rt::now()
            .saturating_duration_since(received_at)
            .as_micros() as u64,
    });
}
