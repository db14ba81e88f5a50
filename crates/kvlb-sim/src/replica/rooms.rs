//! The rooms of SGLang's disaggregation protocol on a prefill replica's bootstrap port
//! (`bootstrap`): which room's prefill is running, which holds its KV for the decode replica's
//! fetch, which ended; a fetch waits on them for its room's prefill to finish.

#![forbid(unsafe_code)]

use super::openai::ApiError;
use crate::engine::{HeldKv, RequestId};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a pull waits for its room's prefill when it does not say (`wait_s`), and at most.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
pub const MAX_WAIT_S: f64 = 3600.0;
/// How often a waiting pull checks that its caller is still there.
const CALLER_CHECK_INTERVAL: Duration = Duration::from_millis(50);
/// Ended rooms remembered (to answer a late fetch at once instead of after its wait).
const ENDED_KEPT: usize = 65_536;
/// Beyond the wait the decode asks for: how long it gives the answer to come back.
pub(super) const ANSWER_GRACE: Duration = Duration::from_secs(2);

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
    pub fn says(self) -> &'static str {
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

    /// Hand over the KV of `room`, waiting up to `wait` for its prefill to finish: `release`
    /// frees the request held on a rank (the ranks behind the port) and gives its KV and block
    /// size (None: nothing held there any more); `gone` says whether the caller went away.
    pub fn take(
        &self,
        room: u64,
        wait: Duration,
        release: impl Fn(usize, RequestId) -> Option<(HeldKv, u32)>,
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
                    return match release(rank, id) {
                        Some((kv, block_size)) => {
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
