//! A request's presence at its replica, counted from routing to the end of its answer: the
//! loads every worker's policy reads (requests in flight, prefill queued, decoding) and the
//! worker's own in-flight gauge. Shared by the L7 path and the L4 mode.

#![forbid(unsafe_code)]

use crate::estimate::calibrate::MIN_DECODE_EVENTS;
use crate::worker::Worker;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// What the policy expected of a request at its replica: its time-to-first-token estimate,
/// split as calibration needs it (`estimate::calibrate::TtftSample`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Expected {
    /// The estimate's seconds at the configured speed: queue wait, own prefill.
    pub wait: crate::estimate::Seconds,
    pub prefill: crate::estimate::Seconds,
    /// Seconds no pace scales (an adapter load).
    pub fixed_s: f64,
    /// The replica's pace it was priced at.
    pub pace: crate::estimate::Pace,
    /// Seconds of one decode step there at the configured speed, as the policy priced it.
    pub decode_step_s: f64,
}

impl Expected {
    /// The estimate in seconds (0: the policy made none).
    pub fn seconds(&self) -> f64 {
        self.wait.waited_at(self.pace) + self.prefill.at(self.pace) + self.fixed_s
    }
}

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
    expected: Expected,
    /// The replica slot's epoch when the request was counted.
    epoch: u64,
    /// The answer is a successful event stream: its first byte is its first token, and its
    /// time a calibration sample.
    measured: bool,
    first_byte_us: Option<u64>,
    /// Server-sent events relayed so far (a measured stream's), the time of the last, and
    /// whether the bytes so far ended with a line feed (an event's end may straddle two reads).
    events: u32,
    last_event: Option<Instant>,
    trailing_lf: bool,
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
        expected: Expected,
        received_at: Instant,
        slot_taken: bool,
        CountedAs { model_label, lora }: CountedAs,
    ) -> InFlight<'a> {
        let load = &w.shared.loads[replica];
        if !slot_taken {
            load.in_flight.fetch_add(1, Relaxed);
        }
        load.lora.enter(lora);
        load.routed.fetch_add(1, Relaxed);
        load.queued_prefill_tokens
            .fetch_add(prefill_tokens, Relaxed);
        crate::metrics::add(&w.stats().in_flight, 1);
        InFlight {
            w,
            replica,
            prefill_tokens,
            decoding: false,
            received_at,
            expected,
            epoch: w.shared.fleet.slot(replica).epoch.load(Relaxed),
            measured: false,
            first_byte_us: None,
            events: 0,
            last_event: None,
            trailing_lf: false,
            model_label,
            lora,
        }
    }

    /// Microseconds from the request received to its first response body byte, once it came.
    pub(crate) fn first_byte_us(&self) -> Option<u64> {
        self.first_byte_us
    }

    /// Whether the replica has answered (its first byte arrived).
    pub(crate) fn decoding(&self) -> bool {
        self.decoding
    }

    /// The replica answers with a successful event stream: its first body byte is its first
    /// token, so its time measures the estimate (`estimate::calibrate`).
    pub(crate) fn streamed(&mut self) {
        self.measured = true;
    }

    /// The first response body byte arrived: the prefill is done.
    pub(crate) fn first_byte(&mut self) {
        if !self.decoding {
            let stats = self.w.stats();
            let observed = crate::rt::now().saturating_duration_since(self.received_at);
            self.first_byte_us = Some(observed.as_micros() as u64);
            stats.first_token.observe_us(observed.as_micros() as u64);
            stats
                .model(self.model_label)
                .first_token
                .observe_us(observed.as_micros() as u64);
            let estimate_s = self.expected.seconds();
            if estimate_s > 0.0 {
                stats
                    .ttft_ratio
                    .observe(observed.as_secs_f64() / estimate_s);
                if self.measured {
                    self.sample(observed.as_secs_f64());
                }
            }
            let load = &self.w.shared.loads[self.replica];
            load.queued_prefill_tokens
                .fetch_sub(self.prefill_tokens, Relaxed);
            load.decoding.fetch_add(1, Relaxed);
            self.decoding = true;
        }
    }
}

impl InFlight<'_> {
    /// Body bytes of the answer as relayed (de-chunked): a measured stream's events are
    /// counted, each at its end (a blank line), for the decode sample `finished` takes.
    pub(crate) fn events(&mut self, bytes: &[u8]) {
        if !self.measured || bytes.is_empty() {
            return;
        }
        let mut n = memchr::memmem::find_iter(bytes, b"\n\n").count() as u32;
        if self.trailing_lf && bytes[0] == b'\n' {
            n += 1;
        }
        self.trailing_lf = bytes[bytes.len() - 1] == b'\n';
        if n > 0 {
            self.events += n;
            self.last_event = Some(crate::rt::now());
        }
    }

    /// The answer was relayed whole: a measured stream's event spacing is a decode sample
    /// (its first event at the first byte, its last, `[DONE]`, not a token).
    pub(crate) fn finished(&self) {
        use crate::estimate::calibrate::{DecodeSample, Sample};
        let (Some(first_us), Some(last)) = (self.first_byte_us, self.last_event) else {
            return;
        };
        if self.events < MIN_DECODE_EVENTS || self.expected.decode_step_s <= 0.0 {
            return;
        }
        let elapsed = last
            .saturating_duration_since(self.received_at)
            .as_secs_f64()
            - first_us as f64 * 1e-6;
        if elapsed <= 0.0 {
            return;
        }
        self.w.shared.samples.push(Sample::Decode(DecodeSample {
            replica: self.replica as u32,
            epoch: self.epoch,
            steps: self.events - 2,
            step_s: self.expected.decode_step_s as f32,
            elapsed_s: elapsed as f32,
        }));
    }

    /// Hand the first byte's time to the calibration (dropped and counted when its queue is
    /// full).
    fn sample(&self, observed_s: f64) {
        use crate::estimate::calibrate::{Sample, TtftSample};
        let e = &self.expected;
        self.w.shared.samples.push(Sample::Ttft(TtftSample {
            replica: self.replica as u32,
            epoch: self.epoch,
            wait: e.wait,
            prefill: e.prefill,
            fixed_s: e.fixed_s as f32,
            pace: e.pace,
            observed_s: observed_s as f32,
        }));
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
