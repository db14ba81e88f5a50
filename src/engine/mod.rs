//! The simulated GPU inference engine: paged KV cache with prefix sharing, continuous batching
//! and a calibrated timing model. Pure: time is passed in (seconds of engine time), no I/O, no
//! clocks, no threads. `kvlb replica` wraps it in HTTP and ZeroMQ; `kvlb simulate` drives it
//! from a discrete-event loop. There is one copy of this model and both use it.

pub mod tokenizer;

use crate::kv_events::KvEvent;

pub type RequestId = u64;

/// Engine parameters. Defaults are calibrated to an 8B model on one H100 (see `Default`).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (vLLM's default 16).
    pub block_size: u32,
    /// KV cache capacity in tokens (rounded down to whole blocks).
    pub kv_capacity_tokens: u64,
    /// Longest prompt + completion accepted.
    pub max_model_len: u32,
    /// Most sequences running at once (vLLM max_num_seqs).
    pub max_num_seqs: u32,
    /// Prefill (and decode) tokens scheduled per engine step (vLLM max_num_batched_tokens).
    pub max_num_batched_tokens: u32,
    /// Prefill time of a step: a + b * new_tokens + c * new_tokens * context_tokens (seconds).
    pub prefill_a_s: f64,
    pub prefill_b_s: f64,
    pub prefill_c_s: f64,
    /// Decode step time: decode_base_s + decode_per_seq_s * batch + decode_per_ctx_token_s * total context.
    pub decode_base_s: f64,
    pub decode_per_seq_s: f64,
    pub decode_per_ctx_token_s: f64,
    /// Seed mixed into the engine's own block hashes (published ids), like vLLM's per-process
    /// hash seed: the balancer must not depend on them.
    pub hash_seed: u64,
}

/// A request handed to the engine.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub id: RequestId,
    pub prompt_tokens: Vec<u32>,
    pub max_tokens: u32,
    /// Mixed into the first block's hash, like vLLM's cache_salt: equal prompts with different
    /// salts share nothing.
    pub cache_salt: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum EngineError {
    /// prompt + max_tokens over max_model_len.
    ContextTooLong {
        prompt_tokens: u32,
        max_tokens: u32,
        max_model_len: u32,
    },
    EmptyPrompt,
    DuplicateId(RequestId),
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineError::ContextTooLong { prompt_tokens, max_tokens, max_model_len } => write!(
                f,
                "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
                prompt_tokens + max_tokens
            ),
            EngineError::EmptyPrompt => write!(f, "The prompt is empty."),
            EngineError::DuplicateId(id) => write!(f, "duplicate request id {id}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// max_tokens reached.
    Length,
    /// The simulated model chose to stop.
    Stop,
    /// Cancelled by the caller.
    Abort,
}

/// What a step produced, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineOutput {
    /// The prompt is fully prefilled and the first output token exists at time `t`.
    FirstToken {
        id: RequestId,
        t: f64,
        token: u32,
        cached_tokens: u32,
    },
    /// A further output token at time `t`.
    Token { id: RequestId, t: f64, token: u32 },
    Finished {
        id: RequestId,
        t: f64,
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
        cached_tokens: u32,
    },
}

/// Gauges and counters in the form vLLM's /metrics reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    pub num_requests_running: u32,
    pub num_requests_waiting: u32,
    /// 0..1
    pub kv_cache_usage: f64,
    /// prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries_total)
    pub prefix_cache_queries_tokens: u64,
    /// of those, tokens found (vllm:prefix_cache_hits_total)
    pub prefix_cache_hits_tokens: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub requests_finished_total: u64,
}

/// The engine. See the module header.
pub struct Engine {
    cfg: EngineConfig,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Engine {
        Engine { cfg }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queue a request at time `now`. Rejects prompts over the context limit.
    pub fn submit(&mut self, _now: f64, _req: EngineRequest) -> Result<(), EngineError> {
        todo!()
    }

    /// Abort a request (the client went away). Its blocks become evictable. Returns whether it
    /// was known. A `Finished { reason: Abort }` is emitted by the next `advance`.
    pub fn cancel(&mut self, _now: f64, _id: RequestId) -> bool {
        todo!()
    }

    /// Engine time at which the step in progress ends, or None when idle with nothing queued.
    pub fn next_event_time(&self) -> Option<f64> {
        todo!()
    }

    /// Run every step that ends at or before `now`, appending what they produced.
    pub fn advance(&mut self, _now: f64, _out: &mut Vec<EngineOutput>) {
        todo!()
    }

    /// Drop every cached block no running request holds (POST /reset_prefix_cache). Emits
    /// AllBlocksCleared. Returns false (and does nothing) while requests are running, as vLLM does.
    pub fn reset_prefix_cache(&mut self) -> bool {
        todo!()
    }

    pub fn stats(&self) -> EngineStats {
        todo!()
    }

    /// Move the KV events produced since the last call into `out`.
    pub fn take_kv_events(&mut self, _out: &mut Vec<KvEvent>) {
        todo!()
    }

    /// Tokens of `prompt` that a request submitted now would find cached.
    pub fn cached_prefix_tokens(&self, _prompt: &[u32], _cache_salt: Option<u64>) -> u32 {
        todo!()
    }
}
