//! How long one engine step takes, and the calibrated defaults of an 8B model on one H100.
//!
//! A step runs the prefill chunks and the decode tokens the scheduler picked. Its duration is
//! the sum of a prefill part (only when it has prefill work) and a decode part (only when it
//! has decode work):
//!
//! ```text
//! prefill = a + b * new_tokens + c * sum_i(new_tokens_i * context_i)
//! decode  = decode_base + decode_per_seq * batch + decode_per_ctx_token * total_context
//! ```
//!
//! A step that admits requests with prefix blocks in the host tier also copies them back:
//! `host_load_s_per_token * loaded_tokens` more (PCIe time, not overlapped in this model).
//! A step that runs LoRA adapters not in a GPU slot (with `max_loras` > 0) copies their
//! weights in first: `lora_switch_s` more per such adapter.
//!
//! With `timing_spread` X > 0 the engine multiplies each step's duration by a random
//! exp(X * N(0,1) - X^2 / 2), lognormal of mean 1 (seeded by `timing_seed`): real step-time
//! jitter. The estimates here (`prefill_seconds`, `decode_step_seconds`) stay its mean.
//! A mixed fleet scales these terms per replica (`speed.rs`).
//!
//! `context_i` is the mean number of keys a token of chunk i attends to: the tokens already in
//! the KV cache plus half the chunk (`computed + (new + 1) / 2`), so that the attention term of
//! a prompt is the same whether it is prefilled in one chunk or several. `total_context` is
//! the sum over decoding sequences of their KV length after the step.

#![forbid(unsafe_code)]

use super::EngineConfig;

/// The work of one step, as the timing model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct StepWork {
    pub prefill_tokens: u64,
    /// sum of new_tokens_i * context_i over prefill chunks
    pub prefill_attention: f64,
    pub decode_seqs: u64,
    pub decode_context: u64,
    /// Tokens of KV copied back from the host tier for requests this step admits.
    pub host_load_tokens: u64,
    /// LoRA adapters this step runs that were not in a GPU slot.
    pub lora_switches: u32,
}

impl StepWork {
    /// Account a prefill chunk of `new` tokens after `computed` tokens already in the cache.
    pub(crate) fn add_prefill(&mut self, computed: u32, new: u32) {
        self.prefill_tokens += new as u64;
        self.prefill_attention += new as f64 * (computed as f64 + (new as f64 + 1.0) / 2.0);
    }

    /// Account `tokens` of KV loaded back from the host tier.
    pub(crate) fn add_host_load(&mut self, tokens: u32) {
        self.host_load_tokens += tokens as u64;
    }

    /// Account `n` adapters copied into GPU slots.
    pub(crate) fn add_lora_switches(&mut self, n: u32) {
        self.lora_switches += n;
    }

    /// Account one decode token of a sequence whose KV holds `context` tokens after the step.
    pub(crate) fn add_decode(&mut self, context: u32) {
        self.decode_seqs += 1;
        self.decode_context += context as u64;
    }
}

impl EngineConfig {
    /// The step timing the balancer's TTFT model is built from (`TtftModel::from_engine`).
    pub fn timing(&self) -> crate::estimate::EngineTiming {
        crate::estimate::EngineTiming {
            prefill_a_s: self.prefill_a_s,
            prefill_b_s: self.prefill_b_s,
            prefill_c_s: self.prefill_c_s,
            decode_base_s: self.decode_base_s,
            decode_per_seq_s: self.decode_per_seq_s,
            decode_per_ctx_token_s: self.decode_per_ctx_token_s,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
        }
    }

    /// Seconds one step doing `work` takes.
    pub(crate) fn step_seconds(&self, work: &StepWork) -> f64 {
        let mut t = 0.0;
        if work.prefill_tokens > 0 {
            t += self.prefill_a_s
                + self.prefill_b_s * work.prefill_tokens as f64
                + self.prefill_c_s * work.prefill_attention;
        }
        if work.decode_seqs > 0 {
            t += self.decode_base_s
                + self.decode_per_seq_s * work.decode_seqs as f64
                + self.decode_per_ctx_token_s * work.decode_context as f64;
        }
        t + self.host_load_s_per_token * work.host_load_tokens as f64
            + self.lora_switch_s * work.lora_switches as f64
    }

    /// Seconds an otherwise idle engine needs to prefill `new_tokens` after `cached_tokens`
    /// found in the prefix cache: the sum of its chunked prefill steps. A building block for
    /// time-to-first-token estimates.
    pub fn prefill_seconds(&self, cached_tokens: u32, new_tokens: u32) -> f64 {
        let budget = self.max_num_batched_tokens.max(1);
        let (mut computed, mut left, mut t) = (cached_tokens, new_tokens, 0.0);
        while left > 0 {
            let chunk = left.min(budget);
            let mut work = StepWork::default();
            work.add_prefill(computed, chunk);
            t += self.step_seconds(&work);
            computed += chunk;
            left -= chunk;
        }
        t
    }

    /// Seconds of one decode step of `batch` sequences holding `total_context` KV tokens.
    pub fn decode_step_seconds(&self, batch: u32, total_context: u64) -> f64 {
        let work = StepWork {
            decode_seqs: batch as u64,
            decode_context: total_context,
            ..StepWork::default()
        };
        self.step_seconds(&work)
    }

    /// Check the parameters; the error names the field and its bad value.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("block_size", self.block_size as f64),
            ("max_model_len", self.max_model_len as f64),
            ("max_num_seqs", self.max_num_seqs as f64),
            ("max_num_batched_tokens", self.max_num_batched_tokens as f64),
        ];
        for (name, v) in positive {
            if v < 1.0 {
                return Err(format!("engine {name} must be at least 1, got {v}"));
            }
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(format!(
                "engine max_num_batched_tokens ({}) must be at least max_num_seqs ({}), or \
                 running sequences would starve",
                self.max_num_batched_tokens, self.max_num_seqs
            ));
        }
        if self.kv_capacity_tokens < self.block_size as u64 {
            return Err(format!(
                "engine kv_capacity_tokens must hold at least one block of {} tokens, got {}",
                self.block_size, self.kv_capacity_tokens
            ));
        }
        if self.kv_capacity_tokens / self.block_size as u64 >= u32::MAX as u64 {
            return Err(format!(
                "engine kv_capacity_tokens is too large: {}",
                self.kv_capacity_tokens
            ));
        }
        if self.host_kv_capacity_tokens / self.block_size as u64 >= u32::MAX as u64 / 2 {
            return Err(format!(
                "engine host_kv_capacity_tokens is too large: {}",
                self.host_kv_capacity_tokens
            ));
        }
        let seconds = [
            ("prefill_a_s", self.prefill_a_s),
            ("prefill_b_s", self.prefill_b_s),
            ("prefill_c_s", self.prefill_c_s),
            ("decode_base_s", self.decode_base_s),
            ("decode_per_seq_s", self.decode_per_seq_s),
            ("decode_per_ctx_token_s", self.decode_per_ctx_token_s),
            ("host_load_s_per_token", self.host_load_s_per_token),
            ("lora_switch_s", self.lora_switch_s),
        ];
        for (name, v) in seconds {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "engine {name} must be a finite number >= 0, got {v}"
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.timing_spread) {
            return Err(format!(
                "engine timing_spread must be from 0 to 1, got {}",
                self.timing_spread
            ));
        }
        Ok(())
    }
}

/// Calibrated to an 8B dense model (Llama-3.1-8B, Qwen3-8B: 32 layers, hidden 4096, 32 query
/// and 8 KV heads of 128) in bf16 on one H100 SXM 80GB under vLLM with its defaults.
///
/// * `block_size` 16: vLLM's default.
/// * `kv_capacity_tokens` 400,000 (25,000 blocks). KV bytes per token = 32 layers x 8 KV heads
///   x 128 dims x 2 (K and V) x 2 bytes = 128 KiB. vLLM takes 90% of 80 GB = 72 GB, minus
///   about 16 GB of weights (8.0 B params * 2 bytes) and a few GB of activations and CUDA
///   graphs, leaving about 50 GB: 50e9 / 131072 = 381k tokens, rounded to 400k (a little more
///   memory for KV with `--gpu-memory-utilization 0.92` gives exactly that).
/// * `max_model_len` 131,072: Llama-3.1-8B's native context (Qwen3-8B reaches it with YaRN).
///   The Mooncake conversation trace that the simulator replays has prompts up to 126k tokens;
///   32,768 would reject about 7% of its requests. The cache still holds three such prompts.
/// * `max_num_seqs` 256 and `max_num_batched_tokens` 8,192: vLLM v1's defaults for the
///   OpenAI server on GPUs with 70 GB or more (chunked prefill always on).
/// * Prefill: about 2 FLOP per parameter per token, 2 * 7.5e9 non-embedding parameters = 15
///   GFLOP per token; H100 bf16 dense peak 989 TFLOP/s, prefill GEMMs reach about 50% of it,
///   so `prefill_b_s` = 15e9 / 5e14 = 3.0e-5 s (33k tokens/s). Attention costs 4 x 32 layers
///   x 4096 (query dims) = 0.52 MFLOP per (query, key) pair; at about 500 TFLOP/s (FlashAttention
///   on H100), `prefill_c_s` = 1.0e-9 s. `prefill_a_s` = 8 ms: one forward pass reads all 16 GB
///   of weights (5 ms at 3.35 TB/s) plus scheduling overhead. Resulting throughput from an
///   empty cache: a 2k-token prompt in 72 ms, an 8k chunk in 287 ms (28.5k tokens/s), a 32k
///   prompt in 1.55 s (21k tokens/s, attention grows). Up to 16k tokens this stays inside
///   25-35k tokens/s, the range prefill-heavy vLLM runs of 8B models on one H100 reach (the
///   figure the arithmetic above gives at 40-60% of peak).
/// * Decode: each step reads all 16 GB of weights; at about 2.8 TB/s achieved (of 3.35 peak)
///   that is 5.7 ms, plus 2-3 ms of scheduler, sampling and launch overhead per step:
///   `decode_base_s` = 8 ms. Each sequence adds its share of compute (15 GFLOP at about 500
///   TFLOP/s = 30 us: `decode_per_seq_s`) and reads its KV: 128 KiB per context token at about
///   2.6 TB/s = 50 ns (`decode_per_ctx_token_s` = 5.0e-8). So batch 1 at 1k context steps in
///   8.1 ms (123 tokens/s for a single stream), batch 32 at 4k context in 15.5 ms, batch 256
///   at 2k context in 42 ms: small batches are bound by the weight read, large ones by
///   compute and KV reads.
/// * `hash_seed` 0: replicas that want vLLM's per-process randomness set their own.
/// * `host_kv_capacity_tokens` 0: no host tier, as vLLM without CPU offloading. A host with
///   1 TiB of RAM per 8 GPUs gives each a few hundred GB: 3,200,000 tokens (8x the GPU's
///   KV) is 420 GB.
/// * `host_load_s_per_token` 4.0e-6: copying 128 KiB of KV per token host -> GPU over PCIe
///   Gen5 x16 (64 GB/s raw, about 50 GB/s for large pinned copies, 25-35 GB/s as offloading
///   connectors achieve with paged blocks of 16 tokens = 2 MiB) at about 33 GB/s:
///   131072 / 33e9 = 4.0 us per token, 250k tokens/s. Recomputing costs 30 us per token
///   plus attention, so a load is about 8x cheaper than recompute for short contexts and
///   more for long ones.
/// * `max_loras` 0: no adapter limit and no switch cost, so the simulator (whose requests run
///   under no adapter) and everything calibrated without adapters are unchanged. `kvlb replica
///   --enable-lora` sets vLLM's default, 1 (`--max-loras`).
/// * `lora_switch_s` 0.01: a rank-16 adapter of this model on all seven projections holds
///   16 x (q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096, gate/up 2 x (4096+14336),
///   down 14336+4096) = 1.3M parameters per layer, 42M over 32 layers, 84 MB in bf16
///   (14 MB on q and v only). Over PCIe at about 30 GB/s that is 3 ms, plus vLLM's per-module
///   work from Python (a slot reset and copies of A and B in each of the 128 wrapped layers:
///   qkv, o, gate_up and down of 32 blocks): about 10 ms in all.
/// * `kv_bytes_per_token` 131,072: the 128 KiB above, what a KV transfer between a prefill and
///   a decode instance moves per token (`kvlb replica --role`).
/// * `timing_spread` 0 (and `timing_seed` 0): every step takes exactly its modelled time.
///   `--timing-spread` turns on the jitter real GPUs show.
///
/// The timing terms are the balancer's calibration (`estimate::calibration`), so the simulator
/// and the balancer's TTFT model agree by construction.
impl Default for EngineConfig {
    fn default() -> EngineConfig {
        use crate::estimate::calibration;
        EngineConfig {
            block_size: 16,
            kv_capacity_tokens: 400_000,
            max_model_len: 131_072,
            max_num_seqs: calibration::MAX_NUM_SEQS,
            max_num_batched_tokens: calibration::MAX_NUM_BATCHED_TOKENS,
            prefill_a_s: calibration::PREFILL_A_S,
            prefill_b_s: calibration::PREFILL_B_S,
            prefill_c_s: calibration::PREFILL_C_S,
            decode_base_s: calibration::DECODE_BASE_S,
            decode_per_seq_s: calibration::DECODE_PER_SEQ_S,
            decode_per_ctx_token_s: calibration::DECODE_PER_CTX_TOKEN_S,
            hash_seed: 0,
            host_kv_capacity_tokens: 0,
            host_load_s_per_token: 4.0e-6,
            max_loras: 0,
            lora_switch_s: 0.01,
            timing_spread: 0.0,
            timing_seed: 0,
            kv_bytes_per_token: 131_072,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::{estimate_ttft, ReplicaLoad, TtftModel};

    #[test]
    fn defaults_are_in_the_calibrated_ranges() {
        let cfg = EngineConfig::default();
        cfg.validate().unwrap();
        let per_s = |n: u32| n as f64 / cfg.prefill_seconds(0, n);
        for n in [2048, 8192, 16384] {
            assert!(
                (25_000.0..=35_000.0).contains(&per_s(n)),
                "{n}: {}",
                per_s(n)
            );
        }
        let small = cfg.decode_step_seconds(1, 1024);
        assert!((0.008..=0.012).contains(&small), "{small}");
        assert!(cfg.decode_step_seconds(64, 64 * 4096) > small * 2.0);
        assert_eq!(cfg.kv_capacity_tokens / cfg.block_size as u64, 25_000);
    }

    #[test]
    fn chunking_does_not_change_attention_cost() {
        let cfg = EngineConfig {
            prefill_a_s: 0.0,
            ..EngineConfig::default()
        };
        let whole = EngineConfig {
            max_num_batched_tokens: 1 << 20,
            ..cfg.clone()
        };
        let (a, b) = (
            cfg.prefill_seconds(0, 20_000),
            whole.prefill_seconds(0, 20_000),
        );
        assert!((a - b).abs() < 1e-9, "{a} vs {b}");
        // Cached tokens make the rest cheaper per token only through attention.
        assert!(cfg.prefill_seconds(10_000, 1000) > cfg.prefill_seconds(0, 1000));
        assert_eq!(cfg.prefill_seconds(5, 0), 0.0);
    }

    #[test]
    fn validate_names_the_field() {
        let bad = EngineConfig {
            max_num_seqs: 0,
            ..EngineConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("max_num_seqs"));
        let bad = EngineConfig {
            decode_base_s: f64::NAN,
            ..EngineConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("decode_base_s"));
        let bad = EngineConfig {
            kv_capacity_tokens: 3,
            ..EngineConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("kv_capacity_tokens"));
        let bad = EngineConfig {
            lora_switch_s: -0.01,
            ..EngineConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("lora_switch_s"));
    }

    #[test]
    fn defaults_match_the_engine_calibration() {
        let m = TtftModel::default();
        let e = EngineConfig::default();
        assert_eq!(m.prefill.a, e.prefill_a_s);
        assert_eq!(m.prefill.b, e.prefill_b_s);
        assert_eq!(m.prefill.c, e.prefill_c_s);
        assert_eq!(m.prefill.chunk_tokens, e.max_num_batched_tokens);
        assert_eq!(m.decode.base, e.decode_base_s);
        assert_eq!(m.decode.per_seq, e.decode_per_seq_s);
        assert_eq!(m.decode.per_ctx_token, e.decode_per_ctx_token_s);
        m.validate().unwrap();
    }

    #[test]
    fn idle_prefill_equals_the_engine() {
        let m = TtftModel::default();
        let e = EngineConfig::default();
        for (cached, new) in [
            (0, 1),
            (0, 2048),
            (0, 8192),
            (0, 20_000),
            (10_000, 1000),
            (512, 40_000),
        ] {
            let ours = estimate_ttft(&ReplicaLoad::default(), cached, cached + new, &m);
            let engine = e.prefill_seconds(cached, new);
            assert!(
                (ours - engine).abs() < 1e-9,
                "{cached}+{new}: {ours} vs {engine}"
            );
        }
    }
}
