//! The replica set as it is now: a fixed array of slots, each empty or holding one replica,
//! changed at run time (reload, admin API, DNS discovery) without stopping a worker.
//!
//! Every per-replica structure (loads, per-worker counters, telemetry, the residency bitmask)
//! is indexed by slot and sized once for `capacity` slots, so adding a replica allocates
//! nothing the workers see and removing one frees nothing under them. A slot's replica is
//! behind an atomic pointer (`arc-swap`): workers read it without a lock. A slot goes
//!
//!   empty -> active -> draining -> empty
//!
//! Draining takes no new requests; once nothing is in flight there the control thread empties
//! it (`Fleet::reap_drained`): residency cleared, telemetry stopped, `epoch` bumped so workers
//! close their pooled connections to the old replica instead of reusing them.
//!
//! Health lives here too. Passive: `max_fails` consecutive transport failures (connect errors,
//! resets, timeouts, an immediate 503) eject a replica for `fail_timeout`. Active: a control
//! thread GETs each replica's health path every `health_interval`; `unhealthy_after` failures
//! in a row mark it down, `healthy_after` successes bring it back. A replica coming back gets
//! traffic gradually over `slow_start` (a request considers it with probability growing from
//! 0 to 1), so a cold replica is not flooded the moment it answers.

#![forbid(unsafe_code)]

use crate::config::ReplicaConfig;
use arc_swap::ArcSwapOption;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

pub const EMPTY: u8 = 0;
pub const ACTIVE: u8 = 1;
pub const DRAINING: u8 = 2;

/// One replica's place in the fleet.
pub struct ReplicaSlot {
    spec: ArcSwapOption<ReplicaConfig>,
    state: AtomicU8,
    /// Set with DRAINING when the replica is to be forgotten once idle (not just drained).
    removing: AtomicBool,
    /// Bumped whenever the slot gets a new replica or is emptied.
    pub epoch: AtomicU64,
    /// Transport failures in a row (passive health).
    pub consecutive_failures: AtomicU32,
    /// Ms since start until which the replica is ejected (passive or active health).
    pub down_until_ms: AtomicU64,
    /// The active check's verdict: false while the replica fails its health checks.
    pub check_ok: AtomicBool,
    /// Ms since start when the replica last became available again (slow start from there).
    pub up_since_ms: AtomicU64,
    /// Health checks failed / passed in a row (written by the health thread only).
    pub check_fails: AtomicU32,
    pub check_passes: AtomicU32,
    /// Stops this slot's telemetry threads.
    pub telemetry_stop: ArcSwapOption<StopSignal>,
    /// The replica's own concurrency limit (0: the global `max_in_flight`).
    pub max_in_flight: AtomicU32,
    /// Its `config::Role`, as u8: read per candidate without loading the spec.
    pub role: AtomicU8,
}

impl ReplicaSlot {
    fn new() -> ReplicaSlot {
        ReplicaSlot {
            spec: ArcSwapOption::empty(),
            state: AtomicU8::new(EMPTY),
            removing: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            consecutive_failures: AtomicU32::new(0),
            down_until_ms: AtomicU64::new(0),
            check_ok: AtomicBool::new(true),
            up_since_ms: AtomicU64::new(0),
            check_fails: AtomicU32::new(0),
            check_passes: AtomicU32::new(0),
            telemetry_stop: ArcSwapOption::empty(),
            max_in_flight: AtomicU32::new(0),
            role: AtomicU8::new(0),
        }
    }

    /// The options workers read per request without loading the spec, from `spec`.
    fn set_options(&self, spec: &ReplicaConfig) {
        self.max_in_flight
            .store(spec.max_in_flight.unwrap_or(0), Relaxed);
        self.role.store(spec.role as u8, Relaxed);
    }

    /// Its part in prefill/decode disaggregation.
    pub fn role(&self) -> crate::config::Role {
        crate::config::Role::from_u8(self.role.load(Relaxed))
    }

    pub fn state(&self) -> u8 {
        self.state.load(Relaxed)
    }

    /// The replica in this slot (None when empty).
    pub fn spec(&self) -> Option<Arc<ReplicaConfig>> {
        self.spec.load_full()
    }

    pub fn state_name(&self) -> &'static str {
        match self.state() {
            ACTIVE => "active",
            DRAINING if self.removing.load(Relaxed) => "removing",
            DRAINING => "draining",
            _ => "empty",
        }
    }

    /// Whether requests may go here at `now_ms` (active, not ejected, checks passing).
    pub fn available(&self, now_ms: u64) -> bool {
        self.state() == ACTIVE
            && self.down_until_ms.load(Relaxed) <= now_ms
            && self.check_ok.load(Relaxed)
    }

    /// Slow start: the fraction of requests that should consider this replica at `now_ms`.
    pub fn ramp(&self, now_ms: u64, slow_start_ms: u64) -> f64 {
        let since = self.up_since_ms.load(Relaxed);
        if slow_start_ms == 0 || since == 0 || now_ms >= since + slow_start_ms {
            return 1.0;
        }
        // Never fully zero: a recovered replica must see some traffic to prove itself.
        ((now_ms - since) as f64 / slow_start_ms as f64).max(0.05)
    }

    /// Traffic ramps up again from `now_ms` (recovery, the end of an ejection). Stamped at
    /// least 1 ms: 0 marks the start-up fleet, which takes traffic at once.
    pub fn ramp_from(&self, now_ms: u64) {
        self.up_since_ms.store(now_ms.max(1), Relaxed);
    }

    /// A request there failed in transport. Returns true when that ejects the replica.
    pub fn record_failure(&self, now_ms: u64, max_fails: u32, fail_timeout_ms: u64) -> bool {
        let n = self.consecutive_failures.fetch_add(1, Relaxed) + 1;
        if max_fails > 0 && n >= max_fails {
            self.consecutive_failures.store(0, Relaxed);
            self.down_until_ms.store(now_ms + fail_timeout_ms, Relaxed);
            // Traffic ramps up again once the ejection ends.
            self.ramp_from(now_ms + fail_timeout_ms);
            return true;
        }
        false
    }

    pub fn record_success(&self) {
        if self.consecutive_failures.load(Relaxed) != 0 {
            self.consecutive_failures.store(0, Relaxed);
        }
    }
}

pub struct Fleet {
    slots: Box<[ReplicaSlot]>,
    /// Bumped on every change of the set (workers rebuild what depends on it).
    pub generation: AtomicU64,
}

impl Fleet {
    pub fn new(capacity: usize) -> Fleet {
        Fleet {
            slots: (0..capacity).map(|_| ReplicaSlot::new()).collect(),
            generation: AtomicU64::new(1),
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn slot(&self, i: usize) -> &ReplicaSlot {
        &self.slots[i]
    }

    pub fn slots(&self) -> impl Iterator<Item = (usize, &ReplicaSlot)> {
        self.slots.iter().enumerate()
    }

    /// Whether a replica (active or draining) has `role`.
    pub fn has_role(&self, role: crate::config::Role) -> bool {
        self.slots
            .iter()
            .any(|s| s.state() != EMPTY && s.role() == role)
    }

    /// Whether a prefill replica (active or draining) speaks SGLang's protocol (has a
    /// bootstrap server).
    pub fn has_sglang_prefill(&self) -> bool {
        self.slots.iter().any(|s| {
            s.state() != EMPTY
                && s.role() == crate::config::Role::Prefill
                && s.spec
                    .load()
                    .as_ref()
                    .is_some_and(|r| r.bootstrap_port.is_some())
        })
    }

    /// The slot holding the replica with this URL (active or draining).
    pub fn find(&self, url: &str) -> Option<usize> {
        self.slots.iter().position(|s| {
            s.state() != EMPTY
                && s.spec
                    .load()
                    .as_ref()
                    .is_some_and(|r| same_url(&r.url, url))
        })
    }

    /// Replicas active or draining.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.state() != EMPTY).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Put `spec` in a free slot (only the control thread calls this). Returns the slot.
    pub fn add(&self, spec: ReplicaConfig, now_ms: u64) -> Result<usize, String> {
        if let Some(i) = self.find(&spec.url) {
            let s = &self.slots[i];
            if s.state() == DRAINING {
                // Re-adding a draining replica takes it back.
                s.set_options(&spec);
                s.spec.store(Some(Arc::new(spec)));
                s.removing.store(false, Relaxed);
                s.state.store(ACTIVE, Relaxed);
                self.generation.fetch_add(1, Relaxed);
                return Ok(i);
            }
            return Err(format!("replica {} is already in the fleet", spec.url));
        }
        let i = self
            .slots
            .iter()
            .position(|s| s.state() == EMPTY)
            .ok_or_else(|| {
                format!(
                    "no free replica slot (max_replicas = {}); raise max_replicas and restart",
                    self.slots.len()
                )
            })?;
        let s = &self.slots[i];
        s.set_options(&spec);
        s.spec.store(Some(Arc::new(spec)));
        s.epoch.fetch_add(1, Relaxed);
        s.consecutive_failures.store(0, Relaxed);
        s.down_until_ms.store(0, Relaxed);
        s.check_ok.store(true, Relaxed);
        s.check_fails.store(0, Relaxed);
        s.check_passes.store(0, Relaxed);
        // 0 at start-up: the initial fleet takes traffic at once; later additions ramp up.
        s.up_since_ms.store(now_ms, Relaxed);
        s.removing.store(false, Relaxed);
        s.state.store(ACTIVE, Relaxed);
        self.generation.fetch_add(1, Relaxed);
        Ok(i)
    }

    /// Give slot `i` (holding a replica with the same URL) new options, and take it back if it
    /// was draining, without a moment out of rotation. A changed address makes the workers'
    /// pooled connections to it stale.
    pub fn update(&self, i: usize, spec: ReplicaConfig) {
        let s = &self.slots[i];
        let moved = s
            .spec
            .load()
            .as_ref()
            .is_none_or(|old| old.addr != spec.addr);
        s.set_options(&spec);
        s.spec.store(Some(Arc::new(spec)));
        if moved {
            s.epoch.fetch_add(1, Relaxed);
        }
        s.removing.store(false, Relaxed);
        s.state.store(ACTIVE, Relaxed);
        self.generation.fetch_add(1, Relaxed);
    }

    /// Stop sending new requests to slot `i`; with `remove`, forget it once idle.
    pub fn drain(&self, i: usize, remove: bool) {
        let s = &self.slots[i];
        if s.state() == EMPTY {
            return;
        }
        s.removing
            .store(remove || s.removing.load(Relaxed), Relaxed);
        s.state.store(DRAINING, Relaxed);
        self.generation.fetch_add(1, Relaxed);
    }

    /// Empty the removing slots with nothing in flight (`in_flight(i)`); returns them.
    pub fn reap_drained(&self, in_flight: impl Fn(usize) -> u32) -> Vec<usize> {
        let mut out = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if s.state() == DRAINING && s.removing.load(Relaxed) && in_flight(i) == 0 {
                s.state.store(EMPTY, Relaxed);
                s.removing.store(false, Relaxed);
                s.spec.store(None);
                s.epoch.fetch_add(1, Relaxed);
                if let Some(stop) = s.telemetry_stop.swap(None) {
                    stop.stop();
                }
                out.push(i);
            }
        }
        if !out.is_empty() {
            self.generation.fetch_add(1, Relaxed);
        }
        out
    }
}

/// URLs compare without a trailing slash.
pub fn same_url(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_replica_url;

    fn spec(port: u16) -> ReplicaConfig {
        parse_replica_url("replica", &format!("http://127.0.0.1:{port}")).unwrap()
    }

    #[test]
    fn add_drain_remove_reuse() {
        let f = Fleet::new(2);
        assert_eq!(f.add(spec(1), 10).unwrap(), 0);
        assert_eq!(f.add(spec(2), 10).unwrap(), 1);
        assert!(f
            .add(spec(3), 10)
            .unwrap_err()
            .contains("no free replica slot"));
        assert!(f.add(spec(1), 10).unwrap_err().contains("already"));
        assert_eq!(f.find("http://127.0.0.1:2/"), Some(1));
        let e0 = f.slot(0).epoch.load(Relaxed);
        f.drain(0, true);
        assert!(!f.slot(0).available(20));
        assert_eq!(f.slot(0).state_name(), "removing");
        // Busy: stays.
        assert!(f.reap_drained(|_| 1).is_empty());
        assert_eq!(f.reap_drained(|_| 0), vec![0]);
        assert_eq!(f.slot(0).state(), EMPTY);
        assert!(f.slot(0).spec().is_none());
        assert!(f.slot(0).epoch.load(Relaxed) > e0);
        assert_eq!(f.add(spec(3), 30).unwrap(), 0);
        assert_eq!(f.len(), 2);
    }

    #[test]
    fn re_adding_a_draining_replica_takes_it_back() {
        let f = Fleet::new(2);
        f.add(spec(1), 1).unwrap();
        f.drain(0, false);
        assert_eq!(f.slot(0).state_name(), "draining");
        assert!(f.reap_drained(|_| 0).is_empty(), "drained, not removed");
        assert_eq!(f.add(spec(1), 2).unwrap(), 0);
        assert!(f.slot(0).available(3));
    }

    #[test]
    fn update_keeps_the_replica_in_rotation() {
        let f = Fleet::new(1);
        f.add(spec(1), 1).unwrap();
        let e = f.slot(0).epoch.load(Relaxed);
        let mut changed = spec(1);
        changed.max_in_flight = Some(4);
        f.update(0, changed);
        assert!(f.slot(0).available(2));
        assert_eq!(f.slot(0).max_in_flight.load(Relaxed), 4);
        assert_eq!(
            f.slot(0).epoch.load(Relaxed),
            e,
            "same address: pooled connections stay"
        );
        f.drain(0, true);
        f.update(0, spec(1));
        assert_eq!(f.slot(0).state_name(), "active");
        assert!(f.reap_drained(|_| 0).is_empty());
    }

    #[test]
    fn passive_ejection_and_slow_start() {
        let f = Fleet::new(1);
        f.add(spec(1), 1).unwrap();
        let s = f.slot(0);
        assert!(!s.record_failure(100, 3, 1000));
        s.record_success();
        assert!(!s.record_failure(100, 3, 1000));
        assert!(!s.record_failure(100, 3, 1000));
        assert!(s.record_failure(100, 3, 1000));
        assert!(!s.available(500));
        assert!(s.available(1100));
        assert!(s.ramp(1100, 10_000) < 0.1);
        assert!((s.ramp(6100, 10_000) - 0.5).abs() < 1e-9);
        assert_eq!(s.ramp(11_100, 10_000), 1.0);
        assert_eq!(s.ramp(1100, 0), 1.0);
    }

    #[test]
    fn a_stop_signal_wakes_its_sleepers_at_once() {
        use std::time::Instant;
        let s = Arc::new(StopSignal::new());
        // Unset: a sleep lasts its whole time and says so.
        let t = Instant::now();
        assert!(!s.sleep(Duration::from_millis(30)));
        assert!(t.elapsed() >= Duration::from_millis(30));
        // Set while a thread sleeps for a minute: it wakes at once.
        let sleeper = {
            let s = s.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                (s.sleep(Duration::from_secs(60)), t.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        s.stop();
        let (stopped, slept) = sleeper.join().unwrap();
        assert!(stopped && s.is_stopped());
        assert!(
            slept < Duration::from_secs(30),
            "slept {slept:?} after the stop"
        );
        // Set: sleeping returns at once.
        assert!(s.sleep(Duration::from_secs(60)));
    }
}

/// A flag that stops background threads (a replica slot's telemetry), and wakes them from
/// their sleeps when set: a thread that waits a second between scrapes sleeps that second in
/// one piece, not in polling slices, and still stops at once.
#[derive(Default)]
pub struct StopSignal {
    stopped: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl StopSignal {
    pub fn new() -> StopSignal {
        StopSignal::default()
    }

    /// Set it and wake every thread sleeping on it.
    pub fn stop(&self) {
        self.stopped.store(true, Relaxed);
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.wake.notify_all();
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Relaxed)
    }

    /// Sleep up to `d`, returning early when it is set; true when it is set.
    pub fn sleep(&self, d: Duration) -> bool {
        let guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        // Checked under the lock `stop` takes before notifying: no wake-up is missed.
        let _ = self
            .wake
            .wait_timeout_while(guard, d, |_| !self.stopped.load(Relaxed))
            .unwrap_or_else(|e| e.into_inner());
        self.is_stopped()
    }
}
