//! A request's presence at its replica, counted from routing to the end of its answer: the
//! loads every worker's policy reads (requests in flight, prefill queued, decoding) and the
//! worker's own in-flight gauge. Shared by the L7 path and the L4 mode.

#![forbid(unsafe_code)]

use crate::worker::Worker;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// What a request in flight is counted under besides its replica.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CountedAs {
    /// Its model label (`ModelClass::label`).
    pub(crate) model_label: u16,
    /// The LoRA adapter it runs under (`ModelRoute::lora`; 0: none).
    pub(crate) lora: u64,
}

/// Counts a request in flight at a replica and on the worker until dropped: first as queued
/// prefill (its estimated uncached tokens), then, from its first response byte, as decoding.
pub(crate) struct InFlight<'a> {
    w: &'a Worker,
    replica: usize,
    prefill_tokens: u64,
    decoding: bool,
    received_at: Instant,
    estimate_s: f64,
    /// The request's model label (`ModelClass::label`).
    model_label: u16,
    /// The LoRA adapter it runs under (`ModelRoute::lora`; 0: none).
    lora: u64,
}

impl<'a> InFlight<'a> {
    /// `slot_taken`: the replica's in-flight count was already raised for this request (the
    /// L7 path takes it while checking the replica's concurrency limit).
    pub(crate) fn new(
        w: &'a Worker,
        replica: usize,
        prefill_tokens: u64,
        estimate_s: f64,
        received_at: Instant,
        slot_taken: bool,
        CountedAs { model_label, lora }: CountedAs,
    ) -> InFlight<'a> {
        let load = &w.shared.loads[replica];
        if !slot_taken {
            load.in_flight.fetch_add(1, Relaxed);
        }
        load.lora.enter(lora);
        load.queued_prefill_tokens
            .fetch_add(prefill_tokens, Relaxed);
        crate::metrics::add(&w.stats().in_flight, 1);
        InFlight {
            w,
            replica,
            prefill_tokens,
            decoding: false,
            received_at,
            estimate_s,
            model_label,
            lora,
        }
    }

    /// Whether the replica has answered (its first byte arrived).
    pub(crate) fn decoding(&self) -> bool {
        self.decoding
    }

    /// The first response body byte arrived: the prefill is done.
    pub(crate) fn first_byte(&mut self) {
        if !self.decoding {
            let stats = self.w.stats();
            let observed = crate::rt::now().saturating_duration_since(self.received_at);
            stats.first_token.observe_us(observed.as_micros() as u64);
            stats
                .model(self.model_label)
                .first_token
                .observe_us(observed.as_micros() as u64);
            if self.estimate_s > 0.0 {
                stats
                    .ttft_ratio
                    .observe(observed.as_secs_f64() / self.estimate_s);
            }
            let load = &self.w.shared.loads[self.replica];
            load.queued_prefill_tokens
                .fetch_sub(self.prefill_tokens, Relaxed);
            load.decoding.fetch_add(1, Relaxed);
            self.decoding = true;
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let load = &self.w.shared.loads[self.replica];
        if self.decoding {
            load.decoding.fetch_sub(1, Relaxed);
        } else {
            load.queued_prefill_tokens
                .fetch_sub(self.prefill_tokens, Relaxed);
        }
        load.in_flight.fetch_sub(1, Relaxed);
        load.lora.leave(self.lora);
        crate::metrics::sub(&self.w.stats().in_flight, 1);
    }
}
