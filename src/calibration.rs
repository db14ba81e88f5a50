//! The calibration's owner in `kvlb serve` (`estimate::calibrate`): on the residency writer's
//! tick it drains the samples the workers queued, learns each replica's pace from them, and
//! publishes the paces the workers price replicas at. A slot that takes another replica
//! starts over at the fleet's pace.

use crate::estimate::calibrate::Calibration;
use crate::worker::Shared;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Samples taken per tick at most (the rest wait for the next tick).
const MAX_SAMPLES_PER_TICK: usize = 4096;
/// The paces are published this often (us) while samples come, and at least this often.
const PUBLISH_EVERY_US: u64 = 100_000;

static DROPPED_LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();

pub struct Calibrator {
    shared: Arc<Shared>,
    /// Samples dropped (queue full, stale) when last logged.
    dropped: (u64, u64),
    calibration: Calibration,
    /// Each slot's epoch as last seen.
    epochs: Vec<u64>,
    last_publish_us: u64,
    fresh: bool,
}

impl Calibrator {
    pub fn new(shared: Arc<Shared>) -> Calibrator {
        let n = shared.fleet.capacity();
        Calibrator {
            calibration: Calibration::new(n),
            epochs: vec![0; n],
            shared,
            dropped: (0, 0),
            last_publish_us: 0,
            fresh: false,
        }
    }

    /// Drain the queued samples; publish when due.
    pub fn on_tick(&mut self, now_us: u64) {
        let now_ms = now_us / 1000;
        for _ in 0..MAX_SAMPLES_PER_TICK {
            let Some(s) = self.shared.samples.pop() else {
                break;
            };
            self.calibration.observe(&s, now_ms);
            self.fresh = true;
        }
        if now_us.saturating_sub(self.last_publish_us) < PUBLISH_EVERY_US {
            return;
        }
        self.last_publish_us = now_us;
        for (r, slot) in self.shared.fleet.slots() {
            let epoch = slot.epoch.load(Relaxed);
            if epoch != self.epochs[r] {
                self.epochs[r] = epoch;
                self.calibration.forget(r, epoch);
                self.fresh = true;
            }
        }
        if self.fresh {
            self.fresh = false;
            self.calibration.publish(&self.shared.pace);
            self.shared
                .samples_stale
                .store(self.calibration.stale(), Relaxed);
        }
        let dropped = (self.shared.samples.dropped(), self.calibration.stale());
        if dropped != self.dropped {
            let (full, stale) = (dropped.0 - self.dropped.0, dropped.1 - self.dropped.1);
            self.dropped = dropped;
            if let Some(held) = DROPPED_LOG.allow() {
                eprintln!(
                    "kvlb: calibration: dropped {full} samples for a full queue and {stale} of replaced replicas{}",
                    crate::log_limit::more(held)
                );
            }
        }
    }
}
