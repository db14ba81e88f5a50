//! Publication of a replica's scraped load (`estimate::ReportedLoad`) from the telemetry loop
//! to the workers, by atomics only: a sequence lock whose readers never wait on anything.
//!
//! The writer (the telemetry loop; at a slot change also the control thread) makes
//! the sequence odd, stores the fields, and makes it even again; a reader loads the sequence,
//! the fields, and the sequence again, and keeps the fields when both loads agree on an even
//! value. A reader that keeps meeting a write in progress (a few tries) takes "no figure", which
//! the cost model treats as an old scrape: it never spins for long and never blocks the writer.
//! Two writers at once (the loop publishing while the control thread clears a slot) cannot
//! interleave: a writer enters only by turning an even sequence odd with a compare-and-swap and
//! otherwise skips its publication (the next scrape publishes again).

#![forbid(unsafe_code)]

use crate::estimate::{LoraMask, LoraReport, ReportedLoad};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// Tries a reader makes before giving up on a figure being rewritten.
const READ_TRIES: u32 = 4;

#[derive(Debug, Default)]
pub struct ReportedLoadCell {
    seq: AtomicU64,
    foreign_waiting: AtomicU32,
    foreign_running: AtomicU32,
    kv_usage_milli: AtomicU32,
    at_ms: AtomicU64,
    max_age_ms: AtomicU64,
    lora_slots: AtomicU32,
    lora_active: AtomicU32,
    lora_names: [AtomicU64; 4],
}

impl ReportedLoadCell {
    /// Store `v`; false (nothing stored) when another write is in progress.
    pub fn publish(&self, v: ReportedLoad) -> bool {
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 == 1
            || self
                .seq
                .compare_exchange(s, s + 1, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        // The odd sequence is visible before any field changes.
        fence(Ordering::Release);
        self.foreign_waiting
            .store(v.foreign_waiting, Ordering::Relaxed);
        self.foreign_running
            .store(v.foreign_running, Ordering::Relaxed);
        self.kv_usage_milli
            .store(v.kv_usage_milli, Ordering::Relaxed);
        self.at_ms.store(v.at_ms, Ordering::Relaxed);
        self.max_age_ms.store(v.max_age_ms, Ordering::Relaxed);
        self.lora_slots.store(v.lora.slots, Ordering::Relaxed);
        self.lora_active.store(v.lora.active, Ordering::Relaxed);
        for (a, w) in self.lora_names.iter().zip(v.lora.names.0) {
            a.store(w, Ordering::Relaxed);
        }
        self.seq.store(s + 2, Ordering::Release);
        true
    }

    /// The last figure published (the default, never fresh, while one is being rewritten).
    pub fn load(&self) -> ReportedLoad {
        for _ in 0..READ_TRIES {
            let s1 = self.seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let v = ReportedLoad {
                foreign_waiting: self.foreign_waiting.load(Ordering::Relaxed),
                foreign_running: self.foreign_running.load(Ordering::Relaxed),
                kv_usage_milli: self.kv_usage_milli.load(Ordering::Relaxed),
                at_ms: self.at_ms.load(Ordering::Relaxed),
                max_age_ms: self.max_age_ms.load(Ordering::Relaxed),
                lora: LoraReport {
                    slots: self.lora_slots.load(Ordering::Relaxed),
                    active: self.lora_active.load(Ordering::Relaxed),
                    names: LoraMask(
                        self.lora_names
                            .each_ref()
                            .map(|a| a.load(Ordering::Relaxed)),
                    ),
                },
            };
            // The field loads happen before the second sequence load.
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) == s1 {
                return v;
            }
        }
        ReportedLoad::default()
    }

    /// Forget the figure (the slot got a new replica).
    pub fn clear(&self) {
        // A write in progress (the telemetry loop) makes this miss; retry briefly, it is
        // a handful of stores.
        for _ in 0..1000 {
            if self.publish(ReportedLoad::default()) {
                return;
            }
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn publish_then_load() {
        let c = ReportedLoadCell::default();
        assert_eq!(c.load(), ReportedLoad::default());
        let v = ReportedLoad {
            foreign_waiting: 3,
            foreign_running: 9,
            kv_usage_milli: 950,
            at_ms: 1234,
            max_age_ms: 600,
            lora: LoraReport {
                slots: 2,
                active: 3,
                names: LoraMask([1, 2, 3, 4]),
            },
        };
        assert!(c.publish(v));
        assert_eq!(c.load(), v);
        c.clear();
        assert_eq!(c.load(), ReportedLoad::default());
    }

    #[test]
    fn a_write_in_progress_is_never_read_half_done() {
        let c = ReportedLoadCell::default();
        // Mid-write: readers get no figure, a second writer stays out.
        c.seq.store(1, Ordering::Relaxed);
        assert_eq!(c.load(), ReportedLoad::default());
        assert!(!c.publish(ReportedLoad {
            at_ms: 5,
            ..Default::default()
        }));
        c.seq.store(2, Ordering::Relaxed);
        // Concurrent: every figure read is one that was written whole (all fields equal).
        let c = Arc::new(ReportedLoadCell::default());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (c, stop) = (c.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 1u32;
                while !stop.load(Ordering::Relaxed) {
                    c.publish(ReportedLoad {
                        foreign_waiting: i,
                        foreign_running: i,
                        kv_usage_milli: i,
                        at_ms: i as u64,
                        max_age_ms: i as u64,
                        lora: LoraReport {
                            slots: i,
                            active: i,
                            names: LoraMask([i as u64; 4]),
                        },
                    });
                    i = i.wrapping_add(1).max(1);
                }
            })
        };
        let mut seen = 0;
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while seen < 10_000 && std::time::Instant::now() < until {
            let v = c.load();
            if v.at_ms != 0 {
                seen += 1;
                let i = v.foreign_waiting;
                assert_eq!(
                    (v.foreign_running, v.kv_usage_milli, v.at_ms, v.max_age_ms),
                    (i, i, i as u64, i as u64)
                );
                assert_eq!(
                    (v.lora.slots, v.lora.active, v.lora.names.0),
                    (i, i, [i as u64; 4])
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert!(seen > 0);
    }
}
