//! The residency writer's side of telemetry: runs in the writer's tick, never blocks it.
//!
//! Each tick drains up to `MAX_OPS_PER_TICK` queued operations into the writer. Every
//! `SWEEP_PERIOD_US` it also
//! * on replicas whose event stream is connected, expires what kvlb only guessed from its own
//!   routing (blocks without a reported copy) and has not used for `routed_guess_ttl`
//!   (`ResidencyWriter::expire_guesses`, as `kvlb simulate` does); blocks the events reported
//!   stay until the engine reports them removed.
//! * marks replicas silent for `telemetry_stale_after` (no events, no metrics, after having had
//!   some) stale and drops their residency; while stale, routing guesses there expire after
//!   `routed_guess_ttl` too. Replicas that never produced telemetry keep routing guesses as
//!   before.
//!
//! The feed also owns the offloaded tier's writer (`with_offload_tier`): operations on
//! `Tier::Offloaded` go there, clears and silence clear it with the GPU tier, and after each
//! change the replica's `offload_resident_blocks` gauge is refreshed. It holds event-reported
//! blocks only, so the sweep has nothing to expire there.

#![forbid(unsafe_code)]

use super::{ResidencyOp, Tier};
use crate::residency::{ResidencyWriter, TickWork};
use crate::worker::Shared;
use crossbeam::channel::Receiver;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Operations applied per tick at most (the rest wait for the next millisecond).
pub const MAX_OPS_PER_TICK: usize = 4096;
/// How often guesses are expired and staleness checked.
pub const SWEEP_PERIOD_US: u64 = 500_000;

pub struct ResidencyFeed {
    shared: Arc<Shared>,
    ops: Receiver<ResidencyOp>,
    last_sweep_us: u64,
    /// The offloaded tier's writer (None: offloaded operations are dropped).
    offload: Option<ResidencyWriter>,
}

impl ResidencyFeed {
    pub fn new(shared: Arc<Shared>, ops: Receiver<ResidencyOp>) -> ResidencyFeed {
        ResidencyFeed {
            shared,
            ops,
            last_sweep_us: 0,
            offload: None,
        }
    }

    /// Keep the replicas' offloaded blocks in `writer` (the second tier's only writer; its
    /// index is what `cache_aware` reads as the offloaded tier). Capacities already set on it
    /// stand; later `Capacity` operations set it from the replica's configuration.
    pub fn with_offload_tier(mut self, writer: ResidencyWriter) -> ResidencyFeed {
        self.offload = Some(writer);
        self
    }

    /// The offloaded tier's writer, if attached.
    pub fn offload_tier(&self) -> Option<&ResidencyWriter> {
        self.offload.as_ref()
    }

    /// The writer's tick: apply queued operations, then sweep when due. Says whether it
    /// applied any, and whether more wait than a tick takes (the writer then ticks again at
    /// once instead of sleeping: a thousand engines' events need it).
    pub fn on_tick(&mut self, writer: &mut ResidencyWriter, now_us: u64) -> TickWork {
        let mut applied = 0;
        while applied < MAX_OPS_PER_TICK {
            let Ok(op) = self.ops.try_recv() else { break };
            self.apply(writer, op, now_us);
            applied += 1;
        }
        if now_us >= self.last_sweep_us + SWEEP_PERIOD_US {
            self.last_sweep_us = now_us;
            self.sweep(writer, now_us);
        }
        TickWork {
            applied: applied > 0,
            more: applied == MAX_OPS_PER_TICK && !self.ops.is_empty(),
        }
    }

    fn apply(&mut self, writer: &mut ResidencyWriter, op: ResidencyOp, now_us: u64) {
        match op {
            ResidencyOp::Insert {
                replica,
                tier: Tier::Gpu,
                blocks,
            } => {
                let _ = writer.insert(replica, &blocks, now_us);
            }
            ResidencyOp::Insert {
                replica,
                tier: Tier::Offloaded,
                blocks,
            } => {
                if let Some(o) = &mut self.offload {
                    let _ = o.insert(replica, &blocks, now_us);
                    self.publish_offloaded(replica);
                }
            }
            ResidencyOp::Touch {
                replica,
                tier: Tier::Gpu,
                blocks,
            } => {
                let _ = writer.refresh(replica, &blocks, now_us);
            }
            ResidencyOp::Touch {
                replica,
                tier: Tier::Offloaded,
                blocks,
            } => {
                if let Some(o) = &mut self.offload {
                    let _ = o.refresh(replica, &blocks, now_us);
                    self.publish_offloaded(replica);
                }
            }
            ResidencyOp::Remove {
                replica,
                tier: Tier::Offloaded,
                blocks,
            } => {
                if let Some(o) = &mut self.offload {
                    let _ = o.remove_many(replica, &blocks, now_us);
                    self.publish_offloaded(replica);
                }
            }
            ResidencyOp::Remove {
                replica,
                tier: Tier::Gpu,
                blocks,
            } => {
                let _ = writer.remove_many(replica, &blocks, now_us);
            }
            ResidencyOp::Clear { replica } => {
                let _ = writer.clear(replica);
                self.clear_offloaded(replica);
            }
            ResidencyOp::Capacity { replica, tokens } => {
                if let Err(e) = writer.set_capacity_tokens(replica, tokens) {
                    eprintln!("kvlb: replica slot {replica}: {e}");
                }
                if let Some(o) = &mut self.offload {
                    let offload_tokens = match self.shared.fleet.slot(replica).spec() {
                        Some(spec) => spec.offload_capacity_tokens(),
                        None => {
                            tokens.saturating_mul(crate::config::DEFAULT_OFFLOAD_CAPACITY_FACTOR)
                        }
                    };
                    if o.set_capacity_tokens(replica, offload_tokens).is_ok() {
                        self.publish_offloaded(replica);
                    }
                }
            }
        }
    }

    /// Drop replica `r`'s offloaded blocks.
    fn clear_offloaded(&mut self, r: usize) {
        if let Some(o) = &mut self.offload {
            if o.clear(r).is_ok() {
                self.publish_offloaded(r);
            }
        }
    }

    /// Show replica `r`'s offloaded blocks in its telemetry.
    fn publish_offloaded(&self, r: usize) {
        if let (Some(o), Some(tel)) = (&self.offload, self.shared.telemetry.get(r)) {
            tel.offload_resident_blocks
                .store(o.index().replica_blocks(r) as u64, Relaxed);
        }
    }

    fn sweep(&mut self, writer: &mut ResidencyWriter, now_us: u64) {
        let cfg = &self.shared.cfg().telemetry;
        // A reload may turn the pending rule on or off.
        writer.set_pending_ttl(cfg.routed_pending_ttl);
        let ttl_us = cfg.routed_guess_ttl.as_micros() as u64;
        let stale_ms = cfg.stale_after.as_millis() as u64;
        let now_ms = now_us / 1000;
        for r in 0..self.shared.fleet.capacity() {
            let tel = &self.shared.telemetry[r];
            let last = tel.last_update_ms.load(Relaxed);
            let silent = last != 0 && now_ms.saturating_sub(last) > stale_ms;
            if silent && !tel.stale_silent.load(Relaxed) {
                let url = self.shared.fleet.slot(r).spec().map(|s| s.url.clone());
                eprintln!(
                    "kvlb: replica {}: no KV events nor metrics for {:?}; dropping its residency",
                    url.as_deref().unwrap_or("(removed)"),
                    cfg.stale_after
                );
                let _ = writer.clear(r);
                if let Some(o) = &mut self.offload {
                    let _ = o.clear(r);
                    tel.offload_resident_blocks.store(0, Relaxed);
                }
                tel.stale_silent.store(true, Relaxed);
            } else if !silent && tel.stale_silent.load(Relaxed) {
                tel.stale_silent.store(false, Relaxed);
            }
            let events_live = tel.events_connected.load(Relaxed);
            if events_live || silent {
                let _ = writer.expire_guesses(r, now_us.saturating_sub(ttl_us));
            }
        }
    }
}
