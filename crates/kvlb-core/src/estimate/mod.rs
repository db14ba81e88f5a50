//! Time-to-first-token model: how long a request would wait for its first token on one
//! replica, given the work already outstanding there and how much of its prompt that replica
//! holds in its KV cache. Pure arithmetic: no clocks, no I/O, no allocation; `select` calls it
//! once per candidate replica per request.
//!
//! # The model
//!
//! A replica runs vLLM-style continuous batching with chunked prefill: every engine step has a
//! budget of `chunk_tokens` (vLLM `max_num_batched_tokens`) tokens, shared by one decode
//! token per running sequence and by prompt chunks, and takes
//!
//! ```text
//! step = [prefill part, when the step prefills]  a + b * new + c * new * context
//!      + [decode part, when sequences decode]    decode_base + per_seq * D + per_ctx * D * ctx
//! ```
//!
//! (the simulated engine, kvlb-sim's `engine/timing.rs`, uses exactly these terms). For a request
//! with `prompt` tokens of which `matched` are resident on the replica (a prefix-cache hit),
//! on a replica with `Q` queued prefill tokens (routed there, first token not yet produced)
//! and `D` decoding sequences:
//!
//! ```text
//! n      = max(prompt - matched, 1)                       uncached tokens (vLLM recomputes at
//!                                                          least the last prompt token)
//! room   = max(chunk_tokens - D, chunk_tokens / 16)       prefill tokens per step
//! dstep  = D > 0 ? decode_base + per_seq * D + per_ctx * D * decode_context_tokens : 0
//! wait   = (Q / room) * (a + dstep)                       steps the queue needs, each paying
//!          + b * Q + c * Q * queued_context_tokens         the fixed costs and the decoders
//!          + slot_wait                                    (see below)
//! own    = ceil(n / room) * (a + dstep)
//!          + b * n + c * n * (matched + (n + 1) / 2)      attention over the cached prefix
//!                                                         and half of its own new tokens
//! ttft   = wait + own
//! ```
//!
//! With no decoders `own` equals the engine's `prefill_seconds(matched, n)` exactly: chunking
//! changes the number of fixed step costs, not the attention total. The queue's own cache hits
//! are unknown here (the data plane counts prompt tokens), so `wait` prices queued tokens as
//! uncached with a typical context: an upper bound that errs towards spreading load.
//!
//! `slot_wait`: when the replica already runs `max_num_seqs` sequences, a new one waits for a
//! slot. With `excess = in_flight + 1 - max_num_seqs > 0`, it waits about
//! `excess / max_num_seqs * mean_output_tokens` decode steps.
//!
//! # Knobs (defaults: the 8B-on-H100 `calibration`, which the simulated engine runs with)
//!
//! | knob | default | meaning |
//! |---|---|---|
//! | `PrefillModel::a` | 0.008 s | fixed cost of a step that prefills (weights read, launch) |
//! | `PrefillModel::b` | 3.0e-5 s | per new prompt token (GEMMs; 33k tokens/s) |
//! | `PrefillModel::c` | 1.0e-9 s | per (new token, context token) pair (attention) |
//! | `PrefillModel::chunk_tokens` | 8192 | step token budget (`max_num_batched_tokens`) |
//! | `PrefillModel::queued_context_tokens` | 4096 | mean context assumed for queued tokens |
//! | `DecodeModel::base` | 0.008 s | fixed cost of a step that decodes |
//! | `DecodeModel::per_seq` | 3.0e-5 s | per decoding sequence in the step |
//! | `DecodeModel::per_ctx_token` | 5.0e-8 s | per KV token read by the decoding sequences |
//! | `DecodeModel::context_tokens` | 4096 | mean KV length of a decoding sequence |
//! | `DecodeModel::max_num_seqs` | 256 | running sequences per replica (`max_num_seqs`) |
//! | `DecodeModel::mean_output_tokens` | 256 | decode steps a running sequence still needs |
//!
//! `TtftModel::from_engine` derives all of them from an engine's `EngineTiming`, so the simulator and
//! the balancer agree by construction; real fleets override them from measurements.
//!
//! `reported` adds what the replicas say of themselves (scraped queue and KV usage) to the
//! load kvlb counts, so several kvlb instances in front of one fleet see each other's work.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

pub mod calibrate;
pub mod reported;

pub use reported::{LoraMask, LoraReport, OwnLora, ReportedLoad};

/// The calibration the defaults come from: an 8B model on one H100 (vLLM, chunked prefill).
/// The simulated engine (`kvlb-sim`'s `EngineConfig::default`) runs with these same numbers, so
/// the simulator and the balancer agree by construction.
pub mod calibration {
    pub const PREFILL_A_S: f64 = 0.008;
    pub const PREFILL_B_S: f64 = 3.0e-5;
    pub const PREFILL_C_S: f64 = 1.0e-9;
    pub const DECODE_BASE_S: f64 = 0.008;
    pub const DECODE_PER_SEQ_S: f64 = 3.0e-5;
    pub const DECODE_PER_CTX_TOKEN_S: f64 = 5.0e-8;
    /// vLLM `max_num_seqs`.
    pub const MAX_NUM_SEQS: u32 = 256;
    /// vLLM `max_num_batched_tokens`.
    pub const MAX_NUM_BATCHED_TOKENS: u32 = 8192;
}

/// An engine's step timing, the terms of `EngineConfig` the model is built from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineTiming {
    pub prefill_a_s: f64,
    pub prefill_b_s: f64,
    pub prefill_c_s: f64,
    pub decode_base_s: f64,
    pub decode_per_seq_s: f64,
    pub decode_per_ctx_token_s: f64,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
}

impl Default for EngineTiming {
    fn default() -> EngineTiming {
        use calibration::*;
        EngineTiming {
            prefill_a_s: PREFILL_A_S,
            prefill_b_s: PREFILL_B_S,
            prefill_c_s: PREFILL_C_S,
            decode_base_s: DECODE_BASE_S,
            decode_per_seq_s: DECODE_PER_SEQ_S,
            decode_per_ctx_token_s: DECODE_PER_CTX_TOKEN_S,
            max_num_seqs: MAX_NUM_SEQS,
            max_num_batched_tokens: MAX_NUM_BATCHED_TOKENS,
        }
    }
}

/// Prefill timing of one replica: `a + b * new + c * new * context` per step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillModel {
    /// Seconds of fixed cost per prefill step.
    pub a: f64,
    /// Seconds per new prompt token.
    pub b: f64,
    /// Seconds per (new token, attended context token) pair.
    pub c: f64,
    /// Tokens one step schedules (vLLM `max_num_batched_tokens`).
    pub chunk_tokens: u32,
    /// Mean context assumed for tokens already queued on a replica.
    pub queued_context_tokens: u32,
}

/// Decode timing of one replica: `base + per_seq * batch + per_ctx_token * total_context`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeModel {
    pub base: f64,
    pub per_seq: f64,
    pub per_ctx_token: f64,
    /// Mean KV tokens of one decoding sequence.
    pub context_tokens: u32,
    /// Sequences a replica runs at once (vLLM `max_num_seqs`).
    pub max_num_seqs: u32,
    /// Decode steps a running sequence is assumed to still need when a slot is awaited.
    pub mean_output_tokens: u32,
}

/// The whole time-to-first-token model.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TtftModel {
    pub prefill: PrefillModel,
    pub decode: DecodeModel,
}

/// What the model needs to know of a replica's outstanding work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplicaLoad {
    /// Prompt tokens routed there whose first token has not come yet.
    pub queued_prefill_tokens: u64,
    /// Sequences decoding there.
    pub decoding: u32,
    /// Requests in flight there (queued + decoding).
    pub in_flight: u32,
}

impl Default for PrefillModel {
    fn default() -> PrefillModel {
        TtftModel::from_engine(&EngineTiming::default()).prefill
    }
}

impl Default for DecodeModel {
    fn default() -> DecodeModel {
        TtftModel::from_engine(&EngineTiming::default()).decode
    }
}

impl TtftModel {
    /// The model of a replica running the simulated engine with `cfg`.
    pub fn from_engine(cfg: &EngineTiming) -> TtftModel {
        TtftModel {
            prefill: PrefillModel {
                a: cfg.prefill_a_s,
                b: cfg.prefill_b_s,
                c: cfg.prefill_c_s,
                chunk_tokens: cfg.max_num_batched_tokens.max(1),
                queued_context_tokens: 4096,
            },
            decode: DecodeModel {
                base: cfg.decode_base_s,
                per_seq: cfg.decode_per_seq_s,
                per_ctx_token: cfg.decode_per_ctx_token_s,
                context_tokens: 4096,
                max_num_seqs: cfg.max_num_seqs.max(1),
                mean_output_tokens: 256,
            },
        }
    }

    /// This model for replicas whose prefill takes `prefill_s_per_token` a token and whose
    /// small-batch decode step takes `decode_step_s`: the prefill terms scale together with
    /// the per-token one and the decode terms with the step (a GPU k times slower is k times
    /// slower in each term); the token counts stay.
    pub fn scaled(self, prefill_s_per_token: f64, decode_step_s: f64) -> TtftModel {
        let ratio = |new: f64, old: f64| if old > 0.0 { new / old } else { 1.0 };
        let (kp, kd) = (
            ratio(prefill_s_per_token, self.prefill.b),
            ratio(decode_step_s, self.decode.base),
        );
        TtftModel {
            prefill: PrefillModel {
                a: self.prefill.a * kp,
                b: prefill_s_per_token,
                c: self.prefill.c * kp,
                ..self.prefill
            },
            decode: DecodeModel {
                base: decode_step_s,
                per_seq: self.decode.per_seq * kd,
                per_ctx_token: self.decode.per_ctx_token * kd,
                ..self.decode
            },
        }
    }

    /// Check the knobs; the error names the knob and its bad value.
    pub fn validate(&self) -> Result<(), String> {
        let seconds = [
            ("prefill.a", self.prefill.a),
            ("prefill.b", self.prefill.b),
            ("prefill.c", self.prefill.c),
            ("decode.base", self.decode.base),
            ("decode.per_seq", self.decode.per_seq),
            ("decode.per_ctx_token", self.decode.per_ctx_token),
        ];
        for (name, v) in seconds {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "ttft model {name} must be a finite number >= 0, got {v}"
                ));
            }
        }
        if self.prefill.chunk_tokens == 0 {
            return Err("ttft model prefill.chunk_tokens must be at least 1, got 0".into());
        }
        if self.decode.max_num_seqs == 0 {
            return Err("ttft model decode.max_num_seqs must be at least 1, got 0".into());
        }
        Ok(())
    }

    /// Prefill tokens per step while `decoding` sequences take their decode token from the
    /// budget (never below 1/16 of the budget: the scheduler keeps prefill moving).
    pub fn prefill_room(&self, decoding: u32) -> f64 {
        let chunk = self.prefill.chunk_tokens.max(1) as f64;
        (chunk - decoding as f64).max(chunk / 16.0).max(1.0)
    }

    /// Seconds the decode part adds to every step while `decoding` sequences run.
    pub fn decode_step_seconds(&self, decoding: u32) -> f64 {
        if decoding == 0 {
            return 0.0;
        }
        let d = &self.decode;
        let batch = decoding as f64;
        d.base + d.per_seq * batch + d.per_ctx_token * batch * d.context_tokens as f64
    }

    /// Seconds a request for a LoRA adapter waits on a replica whose batch slots are all held
    /// by other adapters (`ReportedLoad::lora_slot_busy`), `decoding` sequences running
    /// there: until every request of one of them has finished, priced as one request's whole
    /// decode (`mean_output_tokens` steps). The replica reports no more than which adapters
    /// have requests, so how far along they are is not known.
    pub fn lora_slot_wait(&self, decoding: u32) -> f64 {
        self.lora_slot_wait_parts(decoding).total()
    }

    /// `lora_slot_wait`, all of it decode time.
    pub fn lora_slot_wait_parts(&self, decoding: u32) -> Seconds {
        Seconds {
            prefill: 0.0,
            decode: self.decode.mean_output_tokens as f64
                * self.decode_step_seconds(decoding.max(1)),
        }
    }

    /// Seconds before a new request's own prefill can start on a replica with `load`.
    pub fn queue_wait(&self, load: &ReplicaLoad) -> f64 {
        self.queue_wait_parts(load).total()
    }

    /// `queue_wait`, split into its prefill and decode time.
    pub fn queue_wait_parts(&self, load: &ReplicaLoad) -> Seconds {
        let p = &self.prefill;
        let q = load.queued_prefill_tokens as f64;
        let mut wait = Seconds::default();
        if q > 0.0 {
            let steps = q / self.prefill_room(load.decoding);
            wait.prefill = steps * p.a + p.b * q + p.c * q * p.queued_context_tokens as f64;
            wait.decode = steps * self.decode_step_seconds(load.decoding);
        }
        let max_seqs = self.decode.max_num_seqs.max(1) as u64;
        let excess = (load.in_flight as u64 + 1).saturating_sub(max_seqs);
        if excess > 0 {
            let dstep = self.decode_step_seconds(load.decoding.max(1));
            wait.decode +=
                excess as f64 / max_seqs as f64 * self.decode.mean_output_tokens as f64 * dstep;
        }
        wait
    }

    /// Seconds to prefill the uncached rest of a `prompt_tokens` prompt after `matched_tokens`
    /// found in the cache, while `decoding` sequences share the steps.
    pub fn prefill_seconds(&self, matched_tokens: u32, prompt_tokens: u32, decoding: u32) -> f64 {
        self.prefill_parts(matched_tokens, prompt_tokens, decoding)
            .total()
    }

    /// `prefill_seconds`, split into its prefill and decode time.
    pub fn prefill_parts(&self, matched_tokens: u32, prompt_tokens: u32, decoding: u32) -> Seconds {
        let p = &self.prefill;
        let matched = matched_tokens.min(prompt_tokens.saturating_sub(1));
        let n = (prompt_tokens - matched.min(prompt_tokens)).max(1) as f64;
        let steps = (n / self.prefill_room(decoding)).ceil().max(1.0);
        Seconds {
            prefill: steps * p.a + p.b * n + p.c * n * (matched as f64 + (n + 1.0) / 2.0),
            decode: steps * self.decode_step_seconds(decoding),
        }
    }

    /// Seconds to prefill a `prompt_tokens` prompt whose first `gpu_tokens` are resident in
    /// GPU memory and whose first `held_tokens` (at least `gpu_tokens`) are held in GPU or an
    /// offloaded tier (CPU memory, disk): the prefill of the tokens held nowhere, plus
    /// `load_cost` times what recomputing the offloaded-only part would add to it. `load_cost`
    /// 0 prices the offloaded part as a GPU hit, 1 as no hit.
    pub fn prefill_seconds_tiered(
        &self,
        gpu_tokens: u32,
        held_tokens: u32,
        prompt_tokens: u32,
        decoding: u32,
        load_cost: f64,
    ) -> f64 {
        self.prefill_parts_tiered(gpu_tokens, held_tokens, prompt_tokens, decoding, load_cost)
            .total()
    }

    /// `prefill_seconds_tiered`, split into its prefill and decode time.
    pub fn prefill_parts_tiered(
        &self,
        gpu_tokens: u32,
        held_tokens: u32,
        prompt_tokens: u32,
        decoding: u32,
        load_cost: f64,
    ) -> Seconds {
        let held = held_tokens.max(gpu_tokens);
        let rest = self.prefill_parts(held, prompt_tokens, decoding);
        if held == gpu_tokens {
            return rest;
        }
        let recompute = self.prefill_parts(gpu_tokens, prompt_tokens, decoding) - rest;
        rest + recompute.at_least_zero() * load_cost.clamp(0.0, 1.0)
    }
}

/// Seconds of an estimate, split by what they scale with on a replica: its prefill speed (the
/// prefill terms `a`, `b`, `c`) or its decode speed (the decode steps that share the batch).
/// The model computes them for a replica of the configured speed; `at` prices them on one
/// whose measured [`Pace`] differs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Seconds {
    pub prefill: f64,
    pub decode: f64,
}

impl Seconds {
    /// The seconds on a replica of the configured speed.
    pub fn total(self) -> f64 {
        self.prefill + self.decode
    }

    /// The seconds of a request's own prefill on a replica of pace `pace`.
    pub fn at(self, pace: Pace) -> f64 {
        self.prefill * pace.prefill as f64 + self.decode * pace.decode as f64
    }

    /// The seconds a request's prefill holds up those queued behind it on a replica of pace
    /// `pace`: they meet it as queued work, at the queue's pace when that is the slower, at
    /// the replica's own speed otherwise.
    pub fn held_up_at(self, pace: Pace) -> f64 {
        self.prefill * pace.queue.max(pace.prefill) as f64 + self.decode * pace.decode as f64
    }

    /// The seconds of a queue wait on a replica of pace `pace`.
    pub fn waited_at(self, pace: Pace) -> f64 {
        self.prefill * pace.queue as f64 + self.decode * pace.decode as f64
    }

    fn at_least_zero(self) -> Seconds {
        Seconds {
            prefill: self.prefill.max(0.0),
            decode: self.decode.max(0.0),
        }
    }
}

impl std::ops::Add for Seconds {
    type Output = Seconds;
    fn add(self, o: Seconds) -> Seconds {
        Seconds {
            prefill: self.prefill + o.prefill,
            decode: self.decode + o.decode,
        }
    }
}

impl std::ops::Sub for Seconds {
    type Output = Seconds;
    fn sub(self, o: Seconds) -> Seconds {
        Seconds {
            prefill: self.prefill - o.prefill,
            decode: self.decode - o.decode,
        }
    }
}

impl std::ops::Mul<f64> for Seconds {
    type Output = Seconds;
    fn mul(self, k: f64) -> Seconds {
        Seconds {
            prefill: self.prefill * k,
            decode: self.decode * k,
        }
    }
}

/// How long a replica takes for what the model prices at one second (1: as configured; 3:
/// three times slower): a request's own prefill, its decode steps, and the prefill of the
/// queue it waits behind (which also carries what the model cannot see of that queue: work of
/// other clients, hits that did not hold). `calibrate` measures it per replica.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pace {
    pub prefill: f32,
    pub decode: f32,
    pub queue: f32,
}

impl Pace {
    /// A replica as fast as the model says.
    pub const CONFIGURED: Pace = Pace {
        prefill: 1.0,
        decode: 1.0,
        queue: 1.0,
    };

    /// A replica `k` times slower than the model says in everything.
    pub fn uniform(k: f32) -> Pace {
        Pace {
            prefill: k,
            decode: k,
            queue: k,
        }
    }
}

impl Default for Pace {
    fn default() -> Pace {
        Pace::CONFIGURED
    }
}

/// Estimated seconds to the first token of a `prompt_tokens` prompt, `matched_tokens` of which
/// are resident on a replica with `load`: queueing there plus the uncached prefill.
pub fn estimate_ttft(
    load: &ReplicaLoad,
    matched_tokens: u32,
    prompt_tokens: u32,
    model: &TtftModel,
) -> f64 {
    model.queue_wait(load) + model.prefill_seconds(matched_tokens, prompt_tokens, load.decoding)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle() -> ReplicaLoad {
        ReplicaLoad::default()
    }

    #[test]
    fn numbers_a_reader_can_check() {
        let m = TtftModel::default();
        // 2048 uncached tokens on an idle replica: 8 ms + 61.4 ms + 2.1 ms = 71.5 ms.
        let t = estimate_ttft(&idle(), 0, 2048, &m);
        assert!((t - 0.071_5).abs() < 1e-3, "{t}");
        // The same prompt with 1536 tokens cached: 8 ms + 15.4 ms + 0.9 ms = 24.3 ms.
        let t = estimate_ttft(&idle(), 1536, 2048, &m);
        assert!((t - 0.024_3).abs() < 1e-3, "{t}");
        // 16k queued tokens: 2 steps x 8 ms + 491.5 ms + 67.1 ms = 574.6 ms of waiting.
        let load = ReplicaLoad {
            queued_prefill_tokens: 16_384,
            ..idle()
        };
        assert!((m.queue_wait(&load) - 0.574_6).abs() < 1e-3);
    }

    #[test]
    fn decoders_slow_prefill_down() {
        let m = TtftModel::default();
        let busy = ReplicaLoad {
            decoding: 64,
            in_flight: 64,
            ..idle()
        };
        // One 2k prefill step also runs 64 decodes at 4k context: +8 ms + 1.9 ms + 13.1 ms.
        let quiet = estimate_ttft(&idle(), 0, 2048, &m);
        let loud = estimate_ttft(&busy, 0, 2048, &m);
        assert!((loud - quiet - 0.023_03).abs() < 1e-4, "{}", loud - quiet);
        let queued = |decoding| {
            m.queue_wait(&ReplicaLoad {
                queued_prefill_tokens: 100_000,
                decoding,
                in_flight: decoding,
            })
        };
        // 100k queued tokens: about 12.4 steps, each now 38 ms longer.
        let extra = queued(128) - queued(0);
        assert!((0.45..0.55).contains(&extra), "{extra}");
    }

    #[test]
    fn a_full_replica_adds_a_slot_wait() {
        let m = TtftModel::default();
        let full = ReplicaLoad {
            decoding: 256,
            in_flight: 256,
            ..idle()
        };
        let almost = ReplicaLoad {
            decoding: 255,
            in_flight: 255,
            ..idle()
        };
        assert_eq!(m.queue_wait(&almost), 0.0);
        assert!(m.queue_wait(&full) > 0.0);
    }

    #[test]
    fn monotone_in_queue_and_match() {
        let m = TtftModel::default();
        let mut last = 0.0;
        for q in (0..200_000).step_by(5000) {
            let load = ReplicaLoad {
                queued_prefill_tokens: q,
                ..idle()
            };
            let t = estimate_ttft(&load, 0, 4000, &m);
            assert!(t >= last);
            last = t;
        }
        let mut last = f64::INFINITY;
        for matched in (0..=4000).step_by(64) {
            let t = estimate_ttft(&idle(), matched, 4000, &m);
            assert!(t <= last + 1e-12, "{matched}");
            last = t;
        }
        // A match longer than the prompt is the whole prompt less one token.
        assert_eq!(
            estimate_ttft(&idle(), 9000, 4000, &m),
            estimate_ttft(&idle(), 3999, 4000, &m)
        );
        assert!(estimate_ttft(&idle(), 0, 0, &m).is_finite());
    }

    #[test]
    fn an_offloaded_prefix_costs_its_share_of_the_recompute() {
        let m = TtftModel::default();
        let (prompt, d) = (4096, 2);
        let gpu = m.prefill_seconds(2048, prompt, d);
        let cold = m.prefill_seconds(0, prompt, d);
        // Nothing offloaded beyond the GPU match: the plain prefill, whatever the cost.
        assert_eq!(m.prefill_seconds_tiered(2048, 2048, prompt, d, 0.7), gpu);
        assert_eq!(m.prefill_seconds_tiered(2048, 0, prompt, d, 0.7), gpu);
        // All 2048 offloaded: free at cost 0, a miss at cost 1, in between otherwise.
        assert_eq!(m.prefill_seconds_tiered(0, 2048, prompt, d, 0.0), gpu);
        assert!((m.prefill_seconds_tiered(0, 2048, prompt, d, 1.0) - cold).abs() < 1e-12);
        let quarter = m.prefill_seconds_tiered(0, 2048, prompt, d, 0.25);
        assert!((quarter - (gpu + 0.25 * (cold - gpu))).abs() < 1e-12);
        assert!(gpu < quarter && quarter < cold);
        // Part in GPU, more offloaded: between the GPU-only and the all-GPU prices.
        let mixed = m.prefill_seconds_tiered(1024, 2048, prompt, d, 0.25);
        assert!(gpu < mixed && mixed < m.prefill_seconds(1024, prompt, d));
        // A cost outside 0..=1 is clamped.
        assert_eq!(m.prefill_seconds_tiered(0, 2048, prompt, d, -3.0), gpu);
    }

    #[test]
    fn a_pace_prices_each_part() {
        let s = Seconds {
            prefill: 0.2,
            decode: 0.1,
        };
        let pace = Pace {
            prefill: 2.0,
            decode: 3.0,
            queue: 5.0,
        };
        assert!((s.at(pace) - (0.4 + 0.3)).abs() < 1e-12);
        assert!((s.waited_at(pace) - (1.0 + 0.3)).abs() < 1e-12);
        // Held-up time: at the slower of queue and prefill pace.
        assert!((s.held_up_at(pace) - (1.0 + 0.3)).abs() < 1e-12);
        let quick_queue = Pace { queue: 0.5, ..pace };
        assert!((s.held_up_at(quick_queue) - s.at(quick_queue)).abs() < 1e-12);
        assert_eq!(s.at(Pace::CONFIGURED), s.total());
    }

    #[test]
    fn validate_names_the_knob() {
        let mut m = TtftModel::default();
        m.prefill.b = f64::NAN;
        assert!(m.validate().unwrap_err().contains("prefill.b"));
        let mut m = TtftModel::default();
        m.prefill.chunk_tokens = 0;
        assert!(m.validate().unwrap_err().contains("chunk_tokens"));
    }
}
