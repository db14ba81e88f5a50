//! SGLang's bootstrap server and its client, as `kvlb replica --pd-protocol sglang` plays them.
//! SGLang's router sends the same body, with `bootstrap_host`, `bootstrap_port` and
//! `bootstrap_room` added, to a prefill and a decode replica at once (`pd::bootstrap_leg`). The
//! prefill replica registers the room ([`Rooms::begin`]), computes the prompt and one token,
//! answers, and holds the KV for the room ([`RoomLease::finished`]); the decode replica asks the
//! prefill replica's bootstrap server for the room's KV ([`fetch`]), which waits for that
//! prefill to finish if it has not yet (it may not even have arrived: the legs race), hands the
//! KV over and frees it ([`Rooms::take`]). It stands in for SGLang's bootstrap handshake and
//! Mooncake/NIXL transfer: one request names the room, the answer hands the KV over; the
//! decode side then waits out the transfer time as vLLM's path does (`side_channel::transfer`).
//!
//! The bootstrap server is the side channel's HTTP server (`side_channel::serve`) on its own
//! port (`--disaggregation-bootstrap-port`), answering (errors in OpenAI's shape):
//!
//! ```text
//! POST /kv/pull HTTP/1.1
//! content-type: application/json
//!
//! {"bootstrap_room": N, "wait_s": S}       wait_s optional: 30 s when absent, at most 3600
//!
//! 200 {"bootstrap_room": N, "num_tokens": T, "block_ids": [..], "block_size": B}
//!                                 the room's prefill finished (now, or within S seconds):
//!                                 the KV is the caller's, freed here
//! 404 NotFoundError               the room's KV was already fetched, its hold expired
//!                                 (--kv-hold-timeout), or its prefill was aborted
//! 504 GatewayTimeoutError         no prefill of the room finished within S seconds
//! 400 BadRequestError             not JSON, or bootstrap_room / wait_s missing or malformed
//! ```
//!
//! A waiting pull whose caller goes away gives up, leaving the KV (when its prefill finishes)
//! held for another fetch or its timeout. Rooms are per port: one bootstrap server serves every
//! data-parallel rank behind it, each hold naming its rank.

#![forbid(unsafe_code)]

use super::driver::Replica;
use super::http::Connection;
use super::openai::{self, type_name, ApiError};
use super::pd::{Bootstrap, TransferFailure, MAX_ROOM};
use super::side_channel::{self, ExchangeError};
use crate::engine::{HeldKv, RequestId};
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a pull waits for its room's prefill when it does not say (`wait_s`), and at most.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
pub const MAX_WAIT_S: f64 = 3600.0;
/// How often a waiting pull checks that its caller is still there.
const CALLER_CHECK_INTERVAL: Duration = Duration::from_millis(50);
/// Ended rooms remembered (to answer a late fetch at once instead of after its wait).
const ENDED_KEPT: usize = 65_536;
/// Beyond the wait the decode asks for: how long it gives the answer to come back.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

/// How a room's KV went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// A decode fetched it.
    Fetched,
    /// Its hold timed out (--kv-hold-timeout) before any fetch.
    Expired,
    /// Its prefill was aborted or refused: no KV came of it.
    Aborted,
}

impl Ended {
    fn says(self) -> &'static str {
        match self {
            Ended::Fetched => "its KV was already fetched",
            Ended::Expired => "its KV hold expired (--kv-hold-timeout) before any fetch",
            Ended::Aborted => "its prefill was aborted or refused",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Live {
    /// Its prefill is on the engine.
    Running,
    /// Its prefill finished: the KV of engine request `id` of rank `rank` is held until `until`.
    Held {
        rank: usize,
        id: RequestId,
        until: Instant,
    },
}

#[derive(Debug, Default)]
struct RoomsState {
    live: HashMap<u64, Live>,
    /// The holds' ends, in order (a held room past its end is expired).
    holds: BTreeSet<(Instant, u64)>,
    ended: HashMap<u64, Ended>,
    ended_order: VecDeque<u64>,
}

impl RoomsState {
    fn end(&mut self, room: u64, how: Ended) {
        if let Some(Live::Held { until, .. }) = self.live.remove(&room) {
            self.holds.remove(&(until, room));
        }
        if self.ended.insert(room, how).is_none() {
            self.ended_order.push_back(room);
        }
        while self.ended_order.len() > ENDED_KEPT {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }

    /// Held rooms past their end are expired (the engine freed their KV and counted it).
    fn sweep(&mut self, now: Instant) {
        while let Some(&(until, room)) = self.holds.first() {
            if until > now {
                break;
            }
            self.holds.pop_first();
            if matches!(self.live.get(&room), Some(Live::Held { until: u, .. }) if *u == until) {
                self.end(room, Ended::Expired);
            }
        }
    }
}

/// The rooms of one prefill replica's port: prefills running or holding KV for a room, and
/// the rooms that ended lately. Prefill connections register and finish them; bootstrap pulls
/// wait on them.
#[derive(Default)]
pub struct Rooms {
    state: Mutex<RoomsState>,
    changed: Condvar,
}

impl std::fmt::Debug for Rooms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("Rooms")
            .field("live", &st.live.len())
            .field("ended", &st.ended.len())
            .finish()
    }
}

/// What a pull of a room got.
#[derive(Debug)]
pub enum Taken {
    /// The KV, now the caller's (counted as served by its replica).
    Kv(HeldKv, u32),
    /// The room ended before: nothing to hand over.
    Ended(Ended),
    /// No prefill of the room finished in time.
    TimedOut,
    /// The caller went away while waiting.
    Gone,
}

impl Rooms {
    pub fn new() -> Rooms {
        Rooms::default()
    }

    fn lock(&self) -> MutexGuard<'_, RoomsState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A prefill of `room` arrived. A 400 when one is already running or holding KV for it.
    pub fn begin(&self, room: u64) -> Result<RoomLease<'_>, ApiError> {
        let mut st = self.lock();
        st.sweep(Instant::now());
        if st.live.contains_key(&room) {
            return Err(ApiError {
                param: Some("bootstrap_room"),
                ..ApiError::bad_request(format!(
                    "bootstrap_room {room}: a prefill of it is already running or holding KV here"
                ))
            });
        }
        // A room used again starts afresh.
        st.ended.remove(&room);
        st.live.insert(room, Live::Running);
        Ok(RoomLease {
            rooms: self,
            room,
            done: false,
        })
    }

    /// Rooms running or holding KV.
    pub fn live(&self) -> usize {
        self.lock().live.len()
    }

    /// Hand over the KV of `room` from `engines` (the ranks behind the port), waiting up to
    /// `wait` for its prefill to finish; `gone` says whether the caller went away.
    pub fn take(
        &self,
        room: u64,
        wait: Duration,
        engines: &[Arc<Replica>],
        gone: impl Fn() -> bool,
    ) -> Taken {
        let deadline = Instant::now() + wait;
        let mut st = self.lock();
        loop {
            let now = Instant::now();
            st.sweep(now);
            match st.live.get(&room).copied() {
                Some(Live::Held { rank, id, .. }) => {
                    // Lock order: rooms, then the replica (the driver never takes the rooms).
                    let held = engines.get(rank).and_then(|e| e.release_held(id));
                    let block_size = engines.get(rank).map_or(0, |e| e.block_size());
                    return match held {
                        Some(kv) => {
                            st.end(room, Ended::Fetched);
                            self.changed.notify_all();
                            Taken::Kv(kv, block_size)
                        }
                        None => {
                            st.end(room, Ended::Expired);
                            Taken::Ended(Ended::Expired)
                        }
                    };
                }
                Some(Live::Running) => {}
                None => {
                    if let Some(&how) = st.ended.get(&room) {
                        return Taken::Ended(how);
                    }
                }
            }
            if now >= deadline {
                return Taken::TimedOut;
            }
            let pause = (deadline - now).min(CALLER_CHECK_INTERVAL);
            st = self
                .changed
                .wait_timeout(st, pause)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            drop(st);
            if gone() {
                return Taken::Gone;
            }
            st = self.lock();
        }
    }
}

/// A prefill's hold on its room while it runs: [`RoomLease::finished`] when it finished, else
/// (refused, aborted, its connection failed) the room ends as aborted when this is dropped, so
/// that a decode waiting for it fails at once.
pub struct RoomLease<'a> {
    rooms: &'a Rooms,
    room: u64,
    done: bool,
}

impl RoomLease<'_> {
    /// The prefill finished as engine request `id` of rank `rank`; `held`: the engine holds its
    /// KV, for `hold` wall seconds (--kv-hold-timeout).
    pub fn finished(mut self, rank: usize, id: RequestId, held: bool, hold: Duration) {
        self.done = true;
        let mut st = self.rooms.lock();
        if held {
            let now = Instant::now();
            let until = now
                .checked_add(hold)
                .unwrap_or(now + Duration::from_secs(365 * 86_400));
            st.live.insert(self.room, Live::Held { rank, id, until });
            st.holds.insert((until, self.room));
        } else {
            st.end(self.room, Ended::Expired);
        }
        drop(st);
        self.rooms.changed.notify_all();
    }
}

impl Drop for RoomLease<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.rooms.lock().end(self.room, Ended::Aborted);
        self.rooms.changed.notify_all();
    }
}

/// Answer one bootstrap pull on `conn` for the ranks `engines` of a port whose rooms are
/// `rooms`: hand over (and free) the room's KV, once its prefill finished.
pub fn pull_answer(
    engines: &[Arc<Replica>],
    rooms: &Rooms,
    body: &[u8],
    conn: &Connection,
) -> Result<String, ApiError> {
    let m = openai::parse_object(body)?;
    let bad = |param: &'static str, message: String| ApiError {
        param: Some(param),
        ..ApiError::bad_request(message)
    };
    let room = match m.get("bootstrap_room") {
        Some(Value::Number(n)) => n.as_u64().filter(|&r| r <= MAX_ROOM).ok_or_else(|| {
            bad(
                "bootstrap_room",
                format!("bootstrap_room: expected an integer in 0..={MAX_ROOM}, got {n}"),
            )
        })?,
        Some(v) if !v.is_null() => {
            return Err(bad(
                "bootstrap_room",
                format!("bootstrap_room: expected an integer, got {}", type_name(v)),
            ))
        }
        _ => {
            return Err(bad(
                "bootstrap_room",
                "bootstrap_room: field required".into(),
            ))
        }
    };
    let wait = match m.get("wait_s") {
        None | Some(Value::Null) => DEFAULT_WAIT,
        Some(Value::Number(n)) => match n.as_f64() {
            Some(s) if s >= 0.0 && s.is_finite() => Duration::from_secs_f64(s.min(MAX_WAIT_S)),
            _ => {
                return Err(bad(
                    "wait_s",
                    format!("wait_s: expected seconds, not negative, got {n}"),
                ))
            }
        },
        Some(v) => {
            return Err(bad(
                "wait_s",
                format!("wait_s: expected a number, got {}", type_name(v)),
            ))
        }
    };
    match rooms.take(room, wait, engines, || conn.peer_closed()) {
        Taken::Kv(held, block_size) => Ok(json!({
            "bootstrap_room": room,
            "num_tokens": held.tokens,
            "block_ids": held.blocks,
            "block_size": block_size,
        })
        .to_string()),
        Taken::Ended(how) => Err(ApiError::not_found(format!(
            "bootstrap_room {room}: {}",
            how.says()
        ))),
        Taken::TimedOut => Err(ApiError {
            status: 504,
            kind: "GatewayTimeoutError",
            message: format!(
                "bootstrap_room {room}: no prefill of it finished within {} s",
                wait.as_secs_f64()
            ),
            param: None,
        }),
        Taken::Gone => Err(ApiError {
            status: 499,
            kind: "ClientClosedRequest",
            message: "the caller went away".into(),
            param: None,
        }),
    }
}

/// The decode leg of a request under SGLang's protocol: fetch the room's KV from the prefill
/// replica's bootstrap server (waiting up to --kv-wait-timeout for its prefill), count it and
/// wait out the transfer. Ok(Ok(tokens)) received; Ok(Err(500)) the fetch failed (counted in
/// `kvlb_replica_kv_transfer_failures_total`; the request fails, as SGLang's decode fails
/// it); Err: the client went away meanwhile (nothing was submitted, nothing is left here).
pub fn fetch(
    conn: &Connection,
    replica: &Replica,
    at: &Bootstrap,
) -> io::Result<Result<u32, ApiError>> {
    let wait_s = replica.disagg().wait_s;
    let body = json!({"bootstrap_room": at.room, "wait_s": wait_s}).to_string();
    let patience = Duration::try_from_secs_f64(wait_s.min(MAX_WAIT_S))
        .unwrap_or(DEFAULT_WAIT)
        .saturating_add(ANSWER_GRACE);
    let target = format!("bootstrap server {}:{}", at.host, at.port);
    let failure = |reason: TransferFailure, why: String| {
        replica.transfer_failed(reason);
        replica.log_limited(&format!(
            "bootstrap_room {}: KV transfer failed ({}): {why}",
            at.room,
            reason.label()
        ));
        Ok(Err(ApiError {
            status: 500,
            kind: "InternalServerError",
            message: format!("KV transfer failed for bootstrap_room {}: {why}", at.room),
            param: None,
        }))
    };
    let (status, answer) =
        match side_channel::exchange(&target, &at.host, at.port, &body, patience, Some(conn)) {
            Ok(a) => a,
            Err(ExchangeError::ClientGone) => {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "client went away while the KV was awaited",
                ))
            }
            Err(ExchangeError::Failed(reason, why)) => return failure(reason, why),
        };
    if status != 200 {
        let message = answer["error"]["message"].as_str().unwrap_or("no message");
        return failure(
            TransferFailure::of_status(status),
            format!("{target}: {status}: {message}"),
        );
    }
    let Some(tokens) = answer["num_tokens"]
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
    else {
        return failure(
            TransferFailure::BadAnswer,
            format!("{target}: answer without num_tokens"),
        );
    };
    side_channel::transfer(conn, replica, tokens)?;
    Ok(Ok(tokens))
}
