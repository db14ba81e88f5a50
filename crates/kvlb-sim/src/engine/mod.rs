//! The simulated GPU inference engine: paged KV cache with prefix sharing, continuous batching
//! and a calibrated timing model. Pure: time is passed in (seconds of engine time), no I/O, no
//! clocks, no threads. `kvlb replica` wraps it in HTTP and ZeroMQ; `kvlb simulate` drives it
//! from a discrete-event loop. There is one copy of this model and both use it.
//!
//! The model follows vLLM v1 wherever the balancer can observe it:
//!
//! * **Steps.** The engine runs one step at a time. A step's duration comes from the timing
//!   model (`timing.rs`); its outputs appear at its end. A `submit` on an idle engine starts a
//!   step at once, at `now`; afterwards each step starts when the previous one ends, while
//!   there is work. `advance(now)` runs every step ending at or before `now`;
//!   `next_event_time` says when the step in progress ends. A request only joins steps that
//!   start at or after its submit time, even when the caller advances late.
//! * **Scheduling** (continuous batching, chunked prefill). Each step first serves running
//!   requests in admission order, each taking what it still needs (one decode token, or the
//!   next chunk of its prompt) from the `max_num_batched_tokens` budget; then admits waiting
//!   requests first-come first-served while budget and `max_num_seqs` last.
//! * **KV cache** (`kv_cache.rs`). Admission looks up the request's chained block hashes:
//!   the longest cached run of whole blocks, at most all but the last prompt token, is a
//!   prefix hit (`cached_tokens`); the request then holds those blocks plus fresh ones for the
//!   rest of its prompt. If they do not fit the waiting queue stops there (head of line).
//!   A running request grows by one block every `block_size` tokens; when no block is free
//!   the newest running request is preempted (vLLM's recompute policy): it frees its blocks
//!   (they stay cached), goes back to the front of the queue with its generated tokens, and
//!   recomputes them on re-admission, where its own cached blocks usually hit. A request
//!   finishing or cancelled releases its blocks; they stay cached until evicted.
//! * **Host tier** (`host_tier.rs`; off unless `host_kv_capacity_tokens` > 0). Like vLLM's
//!   CPU offloading (OffloadingConnector), LMCache's CPU backend and SGLang HiCache with their
//!   default write-through policy, every block registered on the GPU is also copied to host
//!   memory (the copy runs beside compute and costs no step time), which keeps the
//!   `host_kv_capacity_tokens` most recently used blocks. Admission matches the longest GPU
//!   prefix, then continues the match in the host tier (still at most all but the last prompt
//!   token); host-hit blocks get fresh GPU blocks, are registered and announced on the GPU
//!   like computed ones, and the step that admits the request pays `host_load_s_per_token`
//!   per loaded token for the copy back over PCIe (vLLM loads asynchronously while other
//!   requests run; charging the admitting step is the simpler, slightly pessimistic model).
//!   A request's prefix refreshes the host copies it uses, from either tier, last block first
//!   so that the head of a prefix is evicted last.
//! * **LoRA adapters** (off unless `max_loras` > 0). As vLLM's scheduler, admission keeps the
//!   adapters of the running requests (scheduled this step or not) to at most `max_loras`
//!   (`--max-loras`, vLLM's default 1): a waiting request of an adapter not among them while
//!   there are `max_loras` of them is skipped, keeps its place in the queue and the requests
//!   behind it are still considered (no head-of-line blocking); base-model requests are never
//!   held back. The GPU holds `max_loras` adapters (vLLM's LRU adapter manager, touched by
//!   every step that runs them); the step that first runs an adapter not in a GPU slot takes
//!   `lora_switch_s` longer per such adapter (its weights copied from host memory), evicting
//!   the least recently run one.
//! * **Disaggregated prefill** (`KvTransfer`, given with `submit_with`; vLLM's NixlConnector).
//!   A prefill for a remote decode keeps its blocks referenced when it finishes: unevictable,
//!   counted in the cache usage and out of preemption's reach, until `release_held` (the
//!   decode instance pulled them) or its hold times out (`advance` releases it then and counts
//!   it). An aborted one frees them at once, as vLLM returns no KV for it. Requests that do not
//!   fit for held blocks wait; the engine tries again only when blocks come back (a release,
//!   a timeout) or the queue's head leaves, and `next_event_time` names the next timeout. A
//!   decode whose prompt KV arrived from a prefill instance is admitted with it as computed,
//!   past its own GPU hit, but for the last prompt token: its first step computes that one
//!   token. The transfer's time is the caller's (`kvlb replica` waits it out before
//!   submitting). Its blocks are registered and announced like computed ones.
//! * **KV events.** Blocks are registered and announced (BlockStored) when the step that
//!   fills them is scheduled, as vLLM does; one event covers the consecutive blocks one
//!   request fills in one step. Reused blocks announce nothing; every eviction is one
//!   BlockRemoved; `reset_prefix_cache` emits AllBlocksCleared. With a host tier, blocks new
//!   to it follow their GPU BlockStored in a BlockStored with medium CPU, and host LRU
//!   evictions are a BlockRemoved with medium CPU; AllBlocksCleared clears both tiers.
//! * **Outputs.** The step that computes a request's last prompt token emits FirstToken (with
//!   the start of the first step the request was admitted into: vLLM's `scheduled_ts`);
//!   each later step one Token; the step producing token `max_tokens` also emits Finished
//!   with reason Length (the simulated model never stops early). Generated ids are a hash of
//!   the request id and position: deterministic, text ids only.
//! * **Counters** as vLLM's /metrics: prefix-cache queries and hits count each request's
//!   first admission only (vLLM counts re-admissions after preemption apart); prompt tokens
//!   count at the first token; finished requests include aborts. As in vLLM with a KV
//!   connector (CPU offloading, LMCache), `prefix_cache_*` are the GPU cache's own lookups and
//!   the host tier has its own pair (`vllm:external_prefix_cache_queries_total` / `_hits_`):
//!   queried are the prompt tokens past the GPU hit, hit the tokens loaded from host (or
//!   received from a prefill instance; `set_kv_connector` counts the pair without a host
//!   tier). A request's `cached_tokens` (the OpenAI usage
//!   `prompt_tokens_details.cached_tokens`) is the GPU hit plus the external one, as vLLM's
//!   `num_cached_tokens` counts both.
//!
//! Cost per step is O(running requests) plus the blocks that change hands; admission costs
//! O(prompt blocks) once per request. Nothing allocates per token except the KV events
//! themselves (turn them off with `set_kv_events_enabled(false)` when nobody listens).

#![forbid(unsafe_code)]

mod block_map;
mod host_tier;
mod kv_cache;
mod speed;
mod timing;
pub mod tokenizer;

pub use speed::{timing_spread, Speed, SpeedList};

use crate::kv_events::KvEvent;
use crate::select::Rng;
use kv_cache::KvCache;
use std::collections::{BTreeSet, HashMap, VecDeque};
use timing::StepWork;

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
    /// Host-memory KV tier capacity in tokens (rounded down to whole blocks); 0 = no host tier.
    pub host_kv_capacity_tokens: u64,
    /// Seconds per token to copy KV back from the host tier to the GPU, added to the step that
    /// admits a request with a host hit.
    pub host_load_s_per_token: f64,
    /// Most LoRA adapters among the running requests, and adapters held on the GPU (vLLM
    /// `max_loras`); 0 = no limit and no adapter switch cost.
    pub max_loras: u32,
    /// Seconds added to a step for each adapter it runs that is not in a GPU slot (copying its
    /// weights from host memory); only with `max_loras` > 0.
    pub lora_switch_s: f64,
    /// Step-time jitter: each step's duration is multiplied by exp(spread * N(0,1) -
    /// spread^2 / 2), a lognormal factor of mean 1; 0 = none (then no random number is drawn).
    pub timing_spread: f64,
    /// Seed of the jitter's random numbers (give each replica its own).
    pub timing_seed: u64,
    /// KV cache bytes per token (all layers, K and V): what moving a request's KV to another
    /// instance transfers per token (disaggregated prefill). The engine itself does not use it.
    pub kv_bytes_per_token: u64,
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
    /// The LoRA adapter it runs under: its KV events name it.
    pub lora: Option<LoraRef>,
}

/// A request's part in disaggregated prefill, as vLLM's KV connectors (NixlConnector) play it
/// from `kv_transfer_params`. Given with [`Engine::submit_with`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum KvTransfer {
    /// An ordinary request.
    #[default]
    None,
    /// A prefill for a remote decode (`do_remote_decode`): when it finishes (not when it is
    /// aborted) its blocks stay held, unevictable and counted in the cache usage, until
    /// [`Engine::release_held`] (the decode instance pulled them) or for `hold_s` engine
    /// seconds (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT), whichever comes first.
    Hold { hold_s: f64 },
    /// A decode whose first `tokens` prompt tokens arrived as KV from a prefill instance
    /// (`do_remote_prefill`): its first admission treats them as computed, like a prefix hit
    /// past the GPU's own, except the last prompt token, which it computes for its logits.
    Received { tokens: u32 },
}

/// The KV a finished [`KvTransfer::Hold`] request held, as `release_held` hands it over.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldKv {
    /// Tokens whose KV the blocks hold (the prompt, plus all but the last generated token).
    pub tokens: u32,
    /// The physical blocks, in sequence order (free again once released).
    pub blocks: Vec<u32>,
}

/// A LoRA adapter as vLLM's KV events name it (`lora_id`, `lora_name`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraRef {
    pub id: i64,
    pub name: std::sync::Arc<str>,
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
    /// The prompt is fully prefilled and the first output token exists at time `t`; the
    /// request was first scheduled (admitted into a step) at `scheduled`.
    FirstToken {
        id: RequestId,
        t: f64,
        token: u32,
        cached_tokens: u32,
        scheduled: f64,
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
    /// prompt tokens past the GPU hit looked up in the host tier
    /// (vllm:external_prefix_cache_queries_total); 0 without a host tier
    pub external_prefix_cache_queries_tokens: u64,
    /// of those, tokens loaded from the host tier (vllm:external_prefix_cache_hits_total)
    pub external_prefix_cache_hits_tokens: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub requests_finished_total: u64,
    /// Finished requests whose blocks are held for a remote decode (`KvTransfer::Hold`).
    pub kv_held_requests: u32,
    /// Their blocks (a block two holds share counts twice).
    pub kv_held_blocks: u64,
    /// Holds that ended by their timeout, not by a pull (vllm:nixl_num_kv_expired_reqs).
    pub kv_holds_expired: u64,
}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
}

/// One request the engine knows (waiting or running).
struct Request {
    id: RequestId,
    /// The prompt, then every generated token (the last one not yet in the KV cache).
    tokens: Vec<u32>,
    prompt_len: u32,
    max_tokens: u32,
    /// Hash of the empty prefix (engine seed and cache salt).
    root: u64,
    /// The adapter it runs under.
    lora: Option<LoraRef>,
    /// Hashes of the full blocks of `tokens` computed so far (a prefix of them).
    block_hashes: Vec<u64>,
    /// Physical blocks held, in sequence order (empty while waiting).
    blocks: Vec<u32>,
    /// `blocks[..num_stored]` are registered in the prefix cache.
    num_stored: u32,
    /// Tokens whose KV is computed (or scheduled in the step in progress).
    computed: u32,
    completion: u32,
    /// Prompt tokens found cached at the first admission.
    cached_tokens: u32,
    admitted: bool,
    arrival: f64,
    /// Start of the first step it was admitted into (None until then; a re-admission after
    /// preemption keeps it, as vLLM's `scheduled_ts`).
    scheduled_at: Option<f64>,
    phase: Phase,
    /// Its part in disaggregated prefill.
    transfer: KvTransfer,
}

impl Request {
    /// Make sure `block_hashes` covers the first `n` full blocks of `tokens`.
    fn hash_blocks(&mut self, n: usize, block_size: usize) {
        while self.block_hashes.len() < n {
            let i = self.block_hashes.len();
            let parent = if i == 0 {
                self.root
            } else {
                self.block_hashes[i - 1]
            };
            let tokens = &self.tokens[i * block_size..(i + 1) * block_size];
            self.block_hashes.push(kv_cache::block_hash(parent, tokens));
        }
    }

    /// Register the blocks that are full once `upto` tokens are computed, announcing them in
    /// one BlockStored.
    fn store_full_blocks(&mut self, kv: &mut KvCache, upto: u32, block_size: u32) {
        let full = (upto / block_size) as usize;
        let from = self.num_stored as usize;
        if full <= from {
            return;
        }
        self.hash_blocks(full, block_size as usize);
        let parent = if from == 0 {
            None
        } else {
            Some(self.block_hashes[from - 1])
        };
        let bs = block_size as usize;
        kv.store(
            &self.blocks[from..full],
            &self.block_hashes[from..full],
            parent,
            &self.tokens[from * bs..full * bs],
            self.lora.as_ref(),
        );
        self.num_stored = full as u32;
    }

    /// Drop every block (most recent first, so the tail is evicted before the head).
    fn release_blocks(&mut self, kv: &mut KvCache) {
        for &block in self.blocks.iter().rev() {
            kv.release(block);
        }
        self.blocks.clear();
        self.num_stored = 0;
    }
}

struct Slot {
    /// Bumped whenever the slot is emptied, so a step never touches a successor request.
    generation: u32,
    request: Option<Request>,
}

/// The blocks of a finished `KvTransfer::Hold` request, waiting for their pull.
struct Held {
    blocks: Vec<u32>,
    tokens: u32,
    /// Engine time its hold times out.
    expires: f64,
}

/// An engine time ordered as a key (by `total_cmp`).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Deadline(f64);

impl Eq for Deadline {}

impl PartialOrd for Deadline {
    fn partial_cmp(&self, other: &Deadline) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Deadline {
    fn cmp(&self, other: &Deadline) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// One request's share of the step in progress.
#[derive(Debug, Clone, Copy)]
struct Scheduled {
    slot: u32,
    generation: u32,
    new_tokens: u32,
}

/// What the last planned step did (for tests and introspection).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct StepRecord {
    start: f64,
    end: f64,
    work: StepWork,
}

/// The engine. See the module header.
pub struct Engine {
    cfg: EngineConfig,
    kv: KvCache,
    /// Longest prompt + completion accepted: max_model_len, or the whole cache if smaller.
    context_limit: u32,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    by_id: HashMap<RequestId, u32>,
    /// FIFO; preempted requests go back to the front.
    waiting: VecDeque<u32>,
    /// In admission order; preemption takes the newest (last).
    running: Vec<u32>,
    /// The step in progress: its scheduled work and end time.
    scheduled: Vec<Scheduled>,
    step_end: Option<f64>,
    last_step: StepRecord,
    /// End of the last step: the next one never starts earlier.
    clock: f64,
    /// Abort notices for the next `advance`.
    pending: Vec<EngineOutput>,
    counters: EngineStats,
    preemptions: u64,
    /// Steps completed.
    steps: u64,
    /// While admitting: the adapter ids of the running requests (vLLM's `scheduled_loras`).
    step_loras: Vec<i64>,
    /// Adapters in GPU slots (at most `max_loras`): id and the step that last ran it.
    gpu_loras: Vec<(i64, u64)>,
    /// The step-time jitter's random numbers (`timing_spread`, seeded by `timing_seed`).
    jitter: Rng,
    /// Finished requests' blocks held for a remote decode, and their timeouts in order.
    held: HashMap<RequestId, Held>,
    hold_deadlines: BTreeSet<(Deadline, RequestId)>,
    /// Idle with requests waiting that did not fit: held blocks fill the cache, and only a
    /// hold ending (or the queue's head leaving) changes that. No step is tried until then.
    stalled: bool,
    /// Count external prefix-cache lookups for every request, as vLLM does with a KV connector
    /// (a host tier, or disaggregated prefill).
    kv_connector: bool,
}

/// Deterministic "model output": a text token from the request id and position.
fn sample_token(id: RequestId, index: u32) -> u32 {
    let mut z = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64).wrapping_add(0x632B_E59B);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % tokenizer::FIRST_SPECIAL as u64) as u32
}

impl Engine {
    /// An engine with `cfg`. Out-of-range values are clamped to the nearest working one
    /// (at least one block, one sequence, one token per step, no more sequences than tokens
    /// per step); use
    /// [`EngineConfig::validate`] first to reject them with a message instead.
    pub fn new(cfg: EngineConfig) -> Engine {
        let block_size = cfg.block_size.max(1);
        let num_blocks =
            (cfg.kv_capacity_tokens / block_size as u64).clamp(1, u32::MAX as u64 / 2) as u32;
        let capacity = (num_blocks as u64 * block_size as u64).min(u32::MAX as u64) as u32;
        let host_blocks =
            (cfg.host_kv_capacity_tokens / block_size as u64).min(u32::MAX as u64 / 2) as u32;
        let cfg = EngineConfig {
            block_size,
            max_model_len: cfg.max_model_len.max(1),
            max_num_seqs: cfg.max_num_seqs.clamp(1, cfg.max_num_batched_tokens.max(1)),
            max_num_batched_tokens: cfg.max_num_batched_tokens.max(1),
            ..cfg
        };
        let timing_seed = cfg.timing_seed;
        Engine {
            context_limit: cfg.max_model_len.min(capacity),
            kv: KvCache::new(num_blocks, block_size, host_blocks),
            cfg,
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_id: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            scheduled: Vec::new(),
            step_end: None,
            last_step: StepRecord::default(),
            clock: f64::NEG_INFINITY,
            pending: Vec::new(),
            counters: EngineStats::default(),
            preemptions: 0,
            steps: 0,
            step_loras: Vec::new(),
            gpu_loras: Vec::new(),
            jitter: Rng::new(timing_seed),
            held: HashMap::new(),
            hold_deadlines: BTreeSet::new(),
            stalled: false,
            kv_connector: false,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Longest prompt + completion accepted: `max_model_len`, or the KV capacity if smaller.
    pub fn context_limit(&self) -> u32 {
        self.context_limit
    }

    /// Running requests sent back to the waiting queue because the KV cache ran out.
    pub fn preemptions_total(&self) -> u64 {
        self.preemptions
    }

    /// Engine steps completed so far.
    pub fn steps_total(&self) -> u64 {
        self.steps
    }

    /// Whether KV events are recorded (default on). A driver that never calls
    /// `take_kv_events` turns them off, or they accumulate.
    pub fn set_kv_events_enabled(&mut self, enabled: bool) {
        self.kv.set_events_enabled(enabled);
    }

    /// Count the external prefix-cache pair (`external_prefix_cache_*`) for every request, as
    /// vLLM does with a KV connector: tokens past the GPU hit are queried, those loaded from
    /// the host tier or received from a prefill instance hit. On by itself with a host tier.
    pub fn set_kv_connector(&mut self, on: bool) {
        self.kv_connector = on;
    }

    fn counts_external(&self) -> bool {
        self.kv_connector || self.kv.host_enabled()
    }

    /// Queue a request at time `now`. Rejects prompts over the context limit.
    /// `max_tokens` 0 is served as 1 (every request produces a first token).
    pub fn submit(&mut self, now: f64, req: EngineRequest) -> Result<(), EngineError> {
        self.submit_with(now, req, KvTransfer::None)
    }

    /// `submit` for a request with a part in disaggregated prefill (`KvTransfer`).
    pub fn submit_with(
        &mut self,
        now: f64,
        req: EngineRequest,
        transfer: KvTransfer,
    ) -> Result<(), EngineError> {
        let now = self.sane_time(now);
        if req.prompt_tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if self.by_id.contains_key(&req.id) || self.held.contains_key(&req.id) {
            return Err(EngineError::DuplicateId(req.id));
        }
        let prompt_tokens = u32::try_from(req.prompt_tokens.len()).unwrap_or(u32::MAX);
        let total = prompt_tokens as u64 + req.max_tokens.max(1) as u64;
        if total > self.context_limit as u64 {
            return Err(EngineError::ContextTooLong {
                prompt_tokens,
                max_tokens: req.max_tokens,
                max_model_len: self.context_limit,
            });
        }
        let bs = self.cfg.block_size as usize;
        let mut request = Request {
            id: req.id,
            prompt_len: prompt_tokens,
            tokens: req.prompt_tokens,
            max_tokens: req.max_tokens.max(1),
            root: kv_cache::root_hash(self.cfg.hash_seed, req.cache_salt),
            lora: req.lora,
            block_hashes: Vec::with_capacity(prompt_tokens as usize / bs + 1),
            blocks: Vec::new(),
            num_stored: 0,
            computed: 0,
            completion: 0,
            cached_tokens: 0,
            admitted: false,
            arrival: now,
            scheduled_at: None,
            phase: Phase::Waiting,
            transfer,
        };
        request.hash_blocks(prompt_tokens as usize / bs, bs);
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize].request = Some(request);
                slot
            }
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    request: Some(request),
                });
                (self.slots.len() - 1) as u32
            }
        };
        self.by_id.insert(req.id, slot);
        self.waiting.push_back(slot);
        if self.step_end.is_none() && !self.stalled {
            let start = self.clock.max(now);
            self.expire_holds(start);
            self.plan_step(start);
            self.note_stall(start);
        }
        Ok(())
    }

    /// Abort a request (the client went away). Its blocks become evictable. Returns whether it
    /// was known. A `Finished { reason: Abort }` is emitted by the next `advance`.
    pub fn cancel(&mut self, now: f64, id: RequestId) -> bool {
        let now = self.sane_time(now);
        let Some(slot) = self.by_id.get(&id).copied() else {
            return false;
        };
        let mut request = self.take_slot(slot);
        match request.phase {
            Phase::Running => {
                self.running.retain(|&s| s != slot);
                request.release_blocks(&mut self.kv);
            }
            Phase::Waiting => {
                self.waiting.retain(|&s| s != slot);
                // The queue's head may have changed: try again from now.
                self.unstall(now);
            }
        }
        self.counters.requests_finished_total += 1;
        self.pending.push(EngineOutput::Finished {
            id,
            t: now,
            reason: FinishReason::Abort,
            prompt_tokens: request.prompt_len,
            completion_tokens: request.completion,
            cached_tokens: request.cached_tokens,
        });
        true
    }

    /// Engine time at which the step in progress ends, or None when idle with nothing queued.
    /// (When a caller submitted while a finished step was not yet advanced past, the engine
    /// may be idle with requests queued: then it is the time the next step can start.) When
    /// idle, the first hold timeout counts too; requests that did not fit for held blocks wait
    /// for it (or for `release_held`).
    pub fn next_event_time(&self) -> Option<f64> {
        if let Some(end) = self.step_end {
            return Some(end);
        }
        let expiry = self.next_hold_deadline();
        let queued = match (self.stalled, self.waiting.front()) {
            (false, Some(&slot)) => Some(self.clock.max(self.request(slot).arrival)),
            _ => None,
        };
        match (queued, expiry) {
            (Some(q), Some(x)) => Some(q.min(x)),
            (q, x) => q.or(x),
        }
    }

    /// Blocks held for the remote decode of finished request `id` (`KvTransfer::Hold`), in
    /// sequence order; None if it holds none (unknown, not finished, released or expired).
    pub fn held_blocks(&self, id: RequestId) -> Option<&[u32]> {
        self.held.get(&id).map(|h| h.blocks.as_slice())
    }

    /// The remote decode pulled request `id`'s KV at time `now`: release its held blocks
    /// (they stay cached until evicted) and say what they held. None if it holds none.
    pub fn release_held(&mut self, now: f64, id: RequestId) -> Option<HeldKv> {
        let now = self.sane_time(now);
        let held = self.held.remove(&id)?;
        self.hold_deadlines.remove(&(Deadline(held.expires), id));
        Some(self.free_held(held, now))
    }

    fn next_hold_deadline(&self) -> Option<f64> {
        self.hold_deadlines.first().map(|(d, _)| d.0)
    }

    /// Release the holds timing out at or before `upto`, first to last.
    fn expire_holds(&mut self, upto: f64) {
        while let Some(&(deadline, id)) = self.hold_deadlines.first() {
            if deadline.0 > upto {
                break;
            }
            self.hold_deadlines.pop_first();
            if let Some(held) = self.held.remove(&id) {
                self.counters.kv_holds_expired += 1;
                self.free_held(held, deadline.0);
            }
        }
    }

    /// Give back a hold's blocks at time `at` (tail first, as a finishing request does).
    fn free_held(&mut self, held: Held, at: f64) -> HeldKv {
        for &block in held.blocks.iter().rev() {
            self.kv.release(block);
        }
        self.counters.kv_held_requests -= 1;
        self.counters.kv_held_blocks -= held.blocks.len() as u64;
        self.unstall(at);
        HeldKv {
            tokens: held.tokens,
            blocks: held.blocks,
        }
    }

    /// After planning at `start`: no step although the queue's head had arrived means its
    /// blocks did not fit, which only held blocks cause (with none held, every block is free
    /// or evictable when nothing runs).
    fn note_stall(&mut self, start: f64) {
        self.stalled = self.step_end.is_none()
            && !self.held.is_empty()
            && self
                .waiting
                .front()
                .is_some_and(|&slot| self.request(slot).arrival <= start);
    }

    /// Blocks came back or the queue changed at `at`: a stalled engine tries again, from then.
    fn unstall(&mut self, at: f64) {
        if self.stalled {
            self.stalled = false;
            self.clock = self.clock.max(at);
        }
    }

    /// Run every step that ends at or before `now`, appending what they produced; release the
    /// holds timing out by then.
    pub fn advance(&mut self, now: f64, out: &mut Vec<EngineOutput>) {
        out.append(&mut self.pending);
        loop {
            match self.step_end {
                Some(end) if end <= now => {
                    self.step_end = None;
                    self.clock = end;
                    self.finish_step(end, out);
                    self.expire_holds(end);
                    self.plan_step(end);
                }
                Some(_) => break,
                None => {
                    let Some(&slot) = self.waiting.front() else {
                        break;
                    };
                    if self.stalled {
                        // Nothing fit when last tried: only a hold ending frees blocks.
                        match self.next_hold_deadline() {
                            Some(x) if x <= now => {
                                self.expire_holds(x);
                                continue;
                            }
                            _ => break,
                        }
                    }
                    let start = self.clock.max(self.request(slot).arrival);
                    if start > now {
                        break;
                    }
                    self.expire_holds(start);
                    self.plan_step(start);
                    if self.step_end.is_none() {
                        self.note_stall(start);
                        break;
                    }
                }
            }
        }
        self.expire_holds(now);
    }

    /// Drop every cached block no running request holds (POST /reset_prefix_cache). Emits
    /// AllBlocksCleared. Returns false (and does nothing) while requests are running or blocks
    /// are held for a remote decode, as vLLM does while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.running.is_empty() || !self.held.is_empty() {
            return false;
        }
        self.kv.clear();
        true
    }

    pub fn stats(&self) -> EngineStats {
        let blocks = self.kv.num_blocks().max(1) as f64;
        EngineStats {
            num_requests_running: self.running.len() as u32,
            num_requests_waiting: self.waiting.len() as u32,
            kv_cache_usage: (blocks - self.kv.num_free() as f64) / blocks,
            ..self.counters
        }
    }

    /// Move the KV events produced since the last call into `out`.
    pub fn take_kv_events(&mut self, out: &mut Vec<KvEvent>) {
        self.kv.take_events(out);
    }

    /// Tokens of `prompt` that a request submitted now would find cached.
    pub fn cached_prefix_tokens(&self, prompt: &[u32], cache_salt: Option<u64>) -> u32 {
        if prompt.is_empty() {
            return 0;
        }
        let bs = self.cfg.block_size as usize;
        let max_hit = (prompt.len() - 1) / bs;
        let mut parent = kv_cache::root_hash(self.cfg.hash_seed, cache_salt);
        let mut hits = 0;
        for block in prompt.chunks_exact(bs).take(max_hit) {
            parent = kv_cache::block_hash(parent, block);
            if self.kv.lookup(parent).is_none() {
                break;
            }
            hits += 1;
        }
        (hits * bs) as u32
    }

    /// Tokens of `prompt` past its GPU hit (`cached_prefix_tokens`) that a request submitted
    /// now would load from the host tier.
    pub fn host_prefix_tokens(&self, prompt: &[u32], cache_salt: Option<u64>) -> u32 {
        if prompt.is_empty() || !self.kv.host_enabled() {
            return 0;
        }
        let bs = self.cfg.block_size as usize;
        let max_hit = (prompt.len() - 1) / bs;
        let mut parent = kv_cache::root_hash(self.cfg.hash_seed, cache_salt);
        let (mut gpu, mut host) = (true, 0);
        for block in prompt.chunks_exact(bs).take(max_hit) {
            parent = kv_cache::block_hash(parent, block);
            if gpu && self.kv.lookup(parent).is_some() {
                continue;
            }
            gpu = false;
            if !self.kv.host_contains(parent) {
                break;
            }
            host += 1;
        }
        (host * bs) as u32
    }

    /// Blocks held in the host tier, and its capacity in blocks (0 without one).
    pub fn host_kv_blocks(&self) -> (usize, usize) {
        (self.kv.host_len(), self.kv.host_capacity_blocks())
    }

    /// A time that is a number: NaN and infinities become the engine's current time.
    fn sane_time(&self, now: f64) -> f64 {
        if now.is_finite() {
            now
        } else if self.clock.is_finite() {
            self.clock
        } else {
            0.0
        }
    }

    fn request(&self, slot: u32) -> &Request {
        self.slots[slot as usize]
            .request
            .as_ref()
            .expect("slot holds a request")
    }

    /// Empty `slot`, returning its request.
    fn take_slot(&mut self, slot: u32) -> Request {
        let entry = &mut self.slots[slot as usize];
        let request = entry.request.take().expect("slot holds a request");
        entry.generation = entry.generation.wrapping_add(1);
        self.free_slots.push(slot);
        self.by_id.remove(&request.id);
        request
    }

    /// Schedule the step starting at `start`, vLLM v1 style: running requests first (decode
    /// tokens and the next chunks of partial prefills, in admission order, each taking what
    /// is left of the token budget), then waiting requests that arrived by `start`, FCFS,
    /// while budget and sequence slots last and their blocks fit, skipping those of an adapter
    /// over `max_loras`. No step when nothing fits.
    fn plan_step(&mut self, start: f64) {
        debug_assert!(self.step_end.is_none());
        self.scheduled.clear();
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut work = StepWork::default();
        let mut preempted = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let (computed, remaining, decoding) = {
                let r = self.request(slot);
                let remaining = r.tokens.len() as u32 - r.computed;
                (r.computed, remaining, r.completion > 0 && remaining == 1)
            };
            let new = remaining.min(budget);
            let needed = (computed + new).div_ceil(bs) as usize;
            // Grow by whole blocks; when none is free, preempt the newest running request
            // (possibly this one), as vLLM does.
            let mut self_preempted = false;
            loop {
                let missing = needed.saturating_sub(self.request(slot).blocks.len());
                if missing as u32 <= self.kv.num_free() {
                    let Engine { kv, slots, .. } = self;
                    let r = slots[slot as usize]
                        .request
                        .as_mut()
                        .expect("running request");
                    for _ in 0..missing {
                        r.blocks.push(kv.allocate().expect("free block counted"));
                    }
                    break;
                }
                let victim = self.running.pop().expect("a running request to preempt");
                self.preempt(victim);
                preempted = true;
                if victim == slot {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            let generation = self.slots[slot as usize].generation;
            let Engine { kv, slots, .. } = self;
            let r = slots[slot as usize]
                .request
                .as_mut()
                .expect("running request");
            r.store_full_blocks(kv, computed + new, bs);
            self.scheduled.push(Scheduled {
                slot,
                generation,
                new_tokens: new,
            });
            if decoding {
                work.add_decode(computed + 1);
            } else {
                work.add_prefill(computed, new);
            }
            budget -= new;
            i += 1;
        }

        // The adapters of every running request, scheduled in this step or not (vLLM's
        // `scheduled_loras`): they bound which adapters' requests may be admitted.
        let max_loras = self.cfg.max_loras as usize;
        if max_loras > 0 && !preempted && !self.waiting.is_empty() {
            let Engine {
                slots,
                running,
                step_loras,
                ..
            } = self;
            step_loras.clear();
            for &slot in running.iter() {
                let lora = slots[slot as usize]
                    .request
                    .as_ref()
                    .and_then(|r| r.lora.as_ref());
                if let Some(lora) = lora {
                    if !step_loras.contains(&lora.id) {
                        step_loras.push(lora.id);
                    }
                }
            }
        }

        // Like vLLM, admit nobody in a step that had to preempt.
        let mut k = 0;
        while !preempted && budget > 0 && (self.running.len() as u32) < self.cfg.max_num_seqs {
            let Some(&slot) = self.waiting.get(k) else {
                break;
            };
            let r = self.request(slot);
            if r.arrival > start {
                break;
            }
            let lora = r.lora.as_ref().map(|l| l.id);
            let new_lora = match lora {
                Some(id) if max_loras > 0 => !self.step_loras.contains(&id),
                _ => false,
            };
            if new_lora && self.step_loras.len() >= max_loras {
                // Another adapter would exceed max_loras: skip it, keeping its place.
                k += 1;
                continue;
            }
            let Some((computed, loaded)) = self.admit(slot) else {
                break;
            };
            work.add_host_load(loaded);
            if let (true, Some(id)) = (new_lora, lora) {
                self.step_loras.push(id);
            }
            self.waiting.remove(k);
            self.running.push(slot);
            let generation = self.slots[slot as usize].generation;
            let Engine { kv, slots, .. } = self;
            let r = slots[slot as usize]
                .request
                .as_mut()
                .expect("admitted request");
            r.scheduled_at.get_or_insert(start);
            let remaining = r.tokens.len() as u32 - computed;
            let new = remaining.min(budget);
            r.store_full_blocks(kv, computed + new, bs);
            let decoding = r.completion > 0 && remaining == 1;
            self.scheduled.push(Scheduled {
                slot,
                generation,
                new_tokens: new,
            });
            if decoding {
                work.add_decode(computed + 1);
            } else {
                work.add_prefill(computed, new);
            }
            budget -= new;
        }

        if self.scheduled.is_empty() {
            return;
        }
        if max_loras > 0 {
            work.add_lora_switches(self.activate_loras());
        }
        let end = start + self.cfg.step_seconds(&work) * self.jitter_factor();
        self.step_end = Some(end);
        self.last_step = StepRecord { start, end, work };
    }

    /// The next step's duration factor: exp(spread * z - spread^2 / 2) for a standard normal
    /// z (Box-Muller), of mean 1; exactly 1, drawing nothing, without a spread.
    fn jitter_factor(&mut self) -> f64 {
        let spread = self.cfg.timing_spread;
        if spread <= 0.0 {
            return 1.0;
        }
        // u1 in (0, 1], u2 in [0, 1), from the top 53 bits.
        let unit = |x: u64| (x >> 11) as f64 / (1u64 << 53) as f64;
        let u1 = 1.0 - unit(self.jitter.next_u64());
        let u2 = unit(self.jitter.next_u64());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (spread * z - 0.5 * spread * spread).exp()
    }

    /// Put the adapters of the step's requests in GPU slots, as vLLM's LRU adapter manager does
    /// before every forward pass: an adapter already there is touched; another takes a free
    /// slot or the least recently run adapter's. Returns how many adapters were not there.
    /// (Admission keeps a step's adapters to `max_loras`, so a step never evicts its own.)
    fn activate_loras(&mut self) -> u32 {
        let Engine {
            scheduled,
            slots,
            gpu_loras,
            cfg,
            steps,
            ..
        } = self;
        let mut switches = 0;
        for s in scheduled.iter() {
            let lora = slots[s.slot as usize]
                .request
                .as_ref()
                .and_then(|r| r.lora.as_ref());
            let Some(lora) = lora else { continue };
            if let Some(held) = gpu_loras.iter_mut().find(|(id, _)| *id == lora.id) {
                held.1 = *steps;
                continue;
            }
            switches += 1;
            if gpu_loras.len() < cfg.max_loras as usize {
                gpu_loras.push((lora.id, *steps));
            } else if let Some(lru) = gpu_loras.iter_mut().min_by_key(|(_, used)| *used) {
                *lru = (lora.id, *steps);
            }
        }
        switches
    }

    /// Give the waiting request in `slot` its blocks: the cached prefix (a prefix hit, at most
    /// all but the last token, in whole blocks: the GPU run, then its continuation in the host
    /// tier) plus fresh blocks for the rest of its tokens, host hits included. On its first
    /// admission, KV received from a prefill instance (`KvTransfer::Received`) counts as
    /// computed too, up to all but the last prompt token (vLLM recomputes that one for its
    /// logits); its blocks are registered with the first step's, as host hits are. Returns the
    /// tokens already computed (GPU, host and received) and those of them loaded from host, or
    /// None (nothing changed) when the blocks do not fit.
    fn admit(&mut self, slot: u32) -> Option<(u32, u32)> {
        let bs = self.cfg.block_size;
        let counts_external = self.counts_external();
        let Engine {
            kv,
            slots,
            counters,
            ..
        } = self;
        let r = slots[slot as usize]
            .request
            .as_mut()
            .expect("waiting request");
        debug_assert!(r.blocks.is_empty());
        let seq_len = r.tokens.len() as u32;
        r.hash_blocks((seq_len / bs) as usize, bs as usize);
        let max_hit = ((seq_len - 1) / bs) as usize;
        let mut evictable_hits = 0;
        for &hash in &r.block_hashes[..max_hit] {
            let Some(block) = kv.lookup(hash) else { break };
            evictable_hits += kv.is_free(block) as u32;
            r.blocks.push(block);
        }
        let hits = r.blocks.len() as u32;
        let host_hits = r.block_hashes[hits as usize..max_hit]
            .iter()
            .take_while(|&&hash| kv.host_contains(hash))
            .count() as u32;
        let missing = seq_len.div_ceil(bs) - hits;
        if missing > kv.num_free() - evictable_hits {
            r.blocks.clear();
            return None;
        }
        for &block in &r.blocks {
            kv.touch(block);
        }
        for _ in 0..missing {
            r.blocks.push(kv.allocate().expect("free block counted"));
        }
        if kv.host_enabled() {
            // Last to first: the head of the prefix stays the most recent part.
            for &hash in r.block_hashes[..(hits + host_hits) as usize].iter().rev() {
                kv.host_touch(hash);
            }
        }
        // KV from a prefill instance arrives once: a re-admission after preemption finds
        // what of it was registered in the prefix cache, like any other request.
        let received = match r.transfer {
            KvTransfer::Received { tokens } if !r.admitted => tokens.min(r.prompt_len - 1),
            _ => 0,
        };
        let local = (hits + host_hits) * bs;
        // Host blocks the received KV covers need no loading.
        let loaded = local.saturating_sub(received.max(hits * bs));
        // Host hits and received blocks are registered on the GPU with the blocks the first
        // step computes.
        r.num_stored = hits;
        r.computed = local.max(received);
        r.phase = Phase::Running;
        if !r.admitted {
            // vLLM counts a request's lookup once; re-admissions after preemption are
            // counted apart (not in these counters).
            r.admitted = true;
            r.cached_tokens = r.computed;
            counters.prefix_cache_queries_tokens += r.prompt_len as u64;
            counters.prefix_cache_hits_tokens += (hits * bs) as u64;
            if counts_external {
                counters.external_prefix_cache_queries_tokens += (r.prompt_len - hits * bs) as u64;
                counters.external_prefix_cache_hits_tokens += (r.computed - hits * bs) as u64;
            }
        }
        Some((r.computed, loaded))
    }

    /// Send a running request (already out of `running`) back to the front of the queue; it
    /// keeps its generated tokens and recomputes them on re-admission.
    fn preempt(&mut self, slot: u32) {
        let Engine { kv, slots, .. } = self;
        let r = slots[slot as usize]
            .request
            .as_mut()
            .expect("running request");
        r.release_blocks(kv);
        r.computed = 0;
        r.phase = Phase::Waiting;
        self.waiting.push_front(slot);
        self.preemptions += 1;
    }

    /// Keep the blocks of `request`, just finished, for its remote decode until `expires`.
    fn hold(&mut self, mut request: Request, expires: f64) {
        let blocks = std::mem::take(&mut request.blocks);
        self.counters.kv_held_requests += 1;
        self.counters.kv_held_blocks += blocks.len() as u64;
        self.hold_deadlines.insert((Deadline(expires), request.id));
        self.held.insert(
            request.id,
            Held {
                blocks,
                tokens: request.computed,
                expires,
            },
        );
    }

    /// Apply the step that ended at `t`: every request whose known tokens are now all in the
    /// KV cache samples its next token.
    fn finish_step(&mut self, t: f64, out: &mut Vec<EngineOutput>) {
        self.steps += 1;
        let mut any_finished = false;
        for k in 0..self.scheduled.len() {
            let s = self.scheduled[k];
            let entry = &mut self.slots[s.slot as usize];
            if entry.generation != s.generation {
                continue; // cancelled during the step
            }
            let Some(r) = entry.request.as_mut() else {
                continue;
            };
            r.computed += s.new_tokens;
            if r.computed as usize != r.tokens.len() {
                continue; // a prefill chunk that is not the last
            }
            let token = sample_token(r.id, r.completion);
            if r.completion == 0 {
                out.push(EngineOutput::FirstToken {
                    id: r.id,
                    t,
                    token,
                    cached_tokens: r.cached_tokens,
                    scheduled: r.scheduled_at.unwrap_or(t),
                });
                self.counters.prompt_tokens_total += r.prompt_len as u64;
            } else {
                out.push(EngineOutput::Token { id: r.id, t, token });
            }
            r.completion += 1;
            self.counters.generation_tokens_total += 1;
            if r.completion < r.max_tokens {
                r.tokens.push(token);
                continue;
            }
            out.push(EngineOutput::Finished {
                id: r.id,
                t,
                reason: FinishReason::Length,
                prompt_tokens: r.prompt_len,
                completion_tokens: r.completion,
                cached_tokens: r.cached_tokens,
            });
            self.counters.requests_finished_total += 1;
            let mut request = self.take_slot(s.slot);
            match request.transfer {
                KvTransfer::Hold { hold_s } => self.hold(request, t + hold_s),
                _ => request.release_blocks(&mut self.kv),
            }
            any_finished = true;
        }
        if any_finished {
            let slots = &self.slots;
            self.running
                .retain(|&s| slots[s as usize].request.is_some());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::Medium;

    /// Small blocks and simple round numbers, so expectations can be computed by hand.
    fn small(capacity_tokens: u64) -> EngineConfig {
        EngineConfig {
            block_size: 4,
            kv_capacity_tokens: capacity_tokens,
            max_model_len: 1000,
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            prefill_a_s: 0.010,
            prefill_b_s: 0.001,
            prefill_c_s: 0.0,
            decode_base_s: 0.005,
            decode_per_seq_s: 0.0,
            decode_per_ctx_token_s: 0.0,
            hash_seed: 0,
            host_kv_capacity_tokens: 0,
            host_load_s_per_token: 0.0,
            max_loras: 0,
            lora_switch_s: 0.0,
            timing_spread: 0.0,
            timing_seed: 0,
            kv_bytes_per_token: 1024,
        }
    }

    fn request(id: RequestId, prompt: &[u32], max_tokens: u32) -> EngineRequest {
        EngineRequest {
            id,
            prompt_tokens: prompt.to_vec(),
            max_tokens,
            cache_salt: None,
            lora: None,
        }
    }

    fn tokens(from: u32, n: u32) -> Vec<u32> {
        (from..from + n).collect()
    }

    /// Advance step by step until idle; every output.
    fn run(engine: &mut Engine) -> Vec<EngineOutput> {
        let mut out = vec![];
        while let Some(t) = engine.next_event_time() {
            engine.advance(t, &mut out);
        }
        engine.advance(f64::MAX, &mut out);
        out
    }

    fn first_token(out: &[EngineOutput], id: RequestId) -> (f64, u32) {
        out.iter()
            .find_map(|o| match *o {
                EngineOutput::FirstToken {
                    id: i,
                    t,
                    cached_tokens,
                    ..
                } if i == id => Some((t, cached_tokens)),
                _ => None,
            })
            .expect("a first token")
    }

    fn finished(out: &[EngineOutput], id: RequestId) -> (FinishReason, u32, u32) {
        out.iter()
            .find_map(|o| match *o {
                EngineOutput::Finished {
                    id: i,
                    reason,
                    completion_tokens,
                    cached_tokens,
                    ..
                } if i == id => Some((reason, completion_tokens, cached_tokens)),
                _ => None,
            })
            .expect("a finish")
    }

    fn events(engine: &mut Engine) -> Vec<KvEvent> {
        let mut ev = vec![];
        engine.take_kv_events(&mut ev);
        ev
    }

    fn stored(ev: &[KvEvent]) -> Vec<(Vec<u64>, Option<u64>, Vec<u32>)> {
        ev.iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    ..
                } => Some((block_hashes.clone(), *parent_block_hash, token_ids.clone())),
                _ => None,
            })
            .collect()
    }

    fn removed(ev: &[KvEvent]) -> Vec<u64> {
        ev.iter()
            .flat_map(|e| match e {
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    assert_eq!(*medium, Some(Medium::Gpu));
                    block_hashes.clone()
                }
                _ => vec![],
            })
            .collect()
    }

    #[test]
    fn one_request_timeline() {
        let mut e = Engine::new(small(1000));
        assert_eq!(e.next_event_time(), None);
        e.submit(1.0, request(1, &tokens(0, 10), 3)).unwrap();
        // A submit on an idle engine starts a step at once: prefill of 10 tokens.
        let prefill_end = 1.0 + 0.010 + 0.010;
        assert!((e.next_event_time().unwrap() - prefill_end).abs() < 1e-12);
        let out = run(&mut e);
        assert_eq!(out.len(), 4, "{out:?}");
        let (t0, cached) = first_token(&out, 1);
        assert!((t0 - prefill_end).abs() < 1e-12);
        assert_eq!(cached, 0);
        let times: Vec<f64> = out
            .iter()
            .map(|o| match *o {
                EngineOutput::FirstToken { t, .. }
                | EngineOutput::Token { t, .. }
                | EngineOutput::Finished { t, .. } => t,
            })
            .collect();
        assert!((times[1] - (prefill_end + 0.005)).abs() < 1e-12);
        assert!((times[2] - (prefill_end + 0.010)).abs() < 1e-12);
        assert_eq!(times[3], times[2]);
        assert_eq!(finished(&out, 1), (FinishReason::Length, 3, 0));
        assert_eq!(e.next_event_time(), None);
        let s = e.stats();
        assert_eq!((s.num_requests_running, s.num_requests_waiting), (0, 0));
        assert_eq!(s.kv_cache_usage, 0.0);
    }

    #[test]
    fn first_token_says_when_the_request_was_first_scheduled() {
        let scheduled = |out: &[EngineOutput], id| {
            out.iter()
                .find_map(|o| match *o {
                    EngineOutput::FirstToken {
                        id: i, scheduled, ..
                    } if i == id => Some(scheduled),
                    _ => None,
                })
                .expect("a first token")
        };
        // One sequence at a time: the second request waits for the first to finish.
        let mut e = Engine::new(EngineConfig {
            max_num_seqs: 1,
            ..small(1000)
        });
        e.submit(1.0, request(1, &tokens(0, 10), 2)).unwrap();
        e.submit(1.0, request(2, &tokens(100, 10), 2)).unwrap();
        let out = run(&mut e);
        assert_eq!(scheduled(&out, 1), 1.0);
        // Request 1: a 20 ms prefill step and a 5 ms decode step; request 2 starts then.
        assert!((scheduled(&out, 2) - 1.025).abs() < 1e-12, "{out:?}");
        let (t2, _) = first_token(&out, 2);
        assert!((t2 - scheduled(&out, 2) - 0.020).abs() < 1e-12);
    }

    #[test]
    fn max_tokens_is_honoured_exactly() {
        let mut e = Engine::new(small(10_000));
        for (id, n) in [(1, 1), (2, 2), (3, 17), (4, 100)] {
            e.submit(0.0, request(id, &tokens(id as u32 * 1000, 7), n))
                .unwrap();
        }
        let out = run(&mut e);
        for (id, n) in [(1, 1), (2, 2), (3, 17), (4, 100)] {
            let produced = out
                .iter()
                .filter(|o| {
                    matches!(o, EngineOutput::FirstToken { id: i, .. }
                        | EngineOutput::Token { id: i, .. } if *i == id)
                })
                .count();
            assert_eq!(produced, n as usize);
            assert_eq!(finished(&out, id), (FinishReason::Length, n, 0));
        }
        // Generated tokens are text tokens.
        assert!(out.iter().all(|o| match *o {
            EngineOutput::Token { token, .. } | EngineOutput::FirstToken { token, .. } =>
                token < tokenizer::FIRST_SPECIAL,
            _ => true,
        }));
    }

    #[test]
    fn prefix_hit_on_second_identical_prompt() {
        let mut e = Engine::new(small(1000));
        let prompt = tokens(0, 18); // 4 full blocks + 2 tokens
        e.submit(0.0, request(1, &prompt, 2)).unwrap();
        let out = run(&mut e);
        assert_eq!(first_token(&out, 1).1, 0);
        assert_eq!(e.cached_prefix_tokens(&prompt, None), 16);
        e.submit(10.0, request(2, &prompt, 2)).unwrap();
        let out = run(&mut e);
        assert_eq!(first_token(&out, 2).1, 16);
        assert_eq!(finished(&out, 2).2, 16);
    }

    #[test]
    fn cached_tokens_counts_whole_blocks_only() {
        let mut e = Engine::new(small(1000));
        e.submit(0.0, request(1, &tokens(0, 14), 1)).unwrap(); // blocks 0..3 full, 2 left over
        run(&mut e);
        // Same first 14 tokens plus more: the 3 full blocks hit, the partial one does not.
        let mut longer = tokens(0, 14);
        longer.extend([900, 901, 902, 903, 904]);
        assert_eq!(e.cached_prefix_tokens(&longer, None), 12);
        e.submit(1.0, request(2, &longer, 1)).unwrap();
        assert_eq!(first_token(&run(&mut e), 2).1, 12);
        // A prompt that is exactly the cached blocks still recomputes its last token: the
        // last block cannot hit.
        let exact = tokens(0, 12);
        assert_eq!(e.cached_prefix_tokens(&exact, None), 8);
        e.submit(2.0, request(3, &exact, 1)).unwrap();
        assert_eq!(first_token(&run(&mut e), 3).1, 8);
        // A prompt diverging inside block 1 hits block 0 only.
        let mut diverging = tokens(0, 14);
        diverging[5] = 777;
        assert_eq!(e.cached_prefix_tokens(&diverging, None), 4);
    }

    #[test]
    fn salt_isolates() {
        let mut e = Engine::new(small(1000));
        let prompt = tokens(0, 20);
        let salted = |id, salt| EngineRequest {
            cache_salt: salt,
            lora: None,
            ..request(id, &prompt, 1)
        };
        e.submit(0.0, salted(1, Some(7))).unwrap();
        run(&mut e);
        assert_eq!(e.cached_prefix_tokens(&prompt, None), 0);
        assert_eq!(e.cached_prefix_tokens(&prompt, Some(8)), 0);
        assert_eq!(e.cached_prefix_tokens(&prompt, Some(7)), 16);
        e.submit(1.0, salted(2, None)).unwrap();
        assert_eq!(first_token(&run(&mut e), 2).1, 0);
        e.submit(2.0, salted(3, Some(7))).unwrap();
        assert_eq!(first_token(&run(&mut e), 3).1, 16);
    }

    #[test]
    fn blocks_stored_under_an_adapter_name_it() {
        let mut e = Engine::new(small(1000));
        let lora = LoraRef {
            id: 3,
            name: "sql-lora".into(),
        };
        e.submit(
            0.0,
            EngineRequest {
                cache_salt: Some(11),
                lora: Some(lora.clone()),
                ..request(1, &tokens(0, 20), 1)
            },
        )
        .unwrap();
        e.submit(1.0, request(2, &tokens(500, 20), 1)).unwrap();
        run(&mut e);
        let named: Vec<(Option<i64>, Option<String>)> = events(&mut e)
            .iter()
            .filter_map(|ev| match ev {
                KvEvent::BlockStored { lora_id, key, .. } => {
                    Some((*lora_id, key.lora_name.clone()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            named,
            [(Some(3), Some("sql-lora".to_string())), (None, None)],
            "the adapter's blocks name it, the base model's do not"
        );
    }

    /// A request of `adapter` (its id and name), or of the base model.
    fn lora_request(
        id: RequestId,
        adapter: Option<i64>,
        prompt: &[u32],
        max_tokens: u32,
    ) -> EngineRequest {
        EngineRequest {
            lora: adapter.map(|a| LoraRef {
                id: a,
                name: format!("adapter-{a}").into(),
            }),
            ..request(id, prompt, max_tokens)
        }
    }

    fn finish_time(out: &[EngineOutput], id: RequestId) -> f64 {
        out.iter()
            .find_map(|o| match *o {
                EngineOutput::Finished { id: i, t, .. } if i == id => Some(t),
                _ => None,
            })
            .expect("a finish")
    }

    /// Adapter A runs a long request; then come, in this order, a request of adapter B, one of
    /// the base model and one of A. Returns the outputs and the engine.
    fn two_adapters(max_loras: u32) -> (Vec<EngineOutput>, Engine) {
        let mut e = Engine::new(EngineConfig {
            max_loras,
            ..small(10_000)
        });
        e.submit(0.0, lora_request(1, Some(1), &tokens(0, 8), 50))
            .unwrap();
        e.submit(0.001, lora_request(2, Some(2), &tokens(100, 8), 2))
            .unwrap();
        e.submit(0.001, lora_request(3, None, &tokens(200, 8), 2))
            .unwrap();
        e.submit(0.001, lora_request(4, Some(1), &tokens(300, 8), 2))
            .unwrap();
        let mut out = vec![];
        e.advance(0.1, &mut out);
        (out, e)
    }

    #[test]
    fn max_loras_holds_another_adapter_back_without_blocking_the_queue() {
        let (mut out, mut e) = two_adapters(1);
        // At 0.1 the base request and A's second one are done; B still waits for A.
        assert!(out
            .iter()
            .all(|o| !matches!(o, EngineOutput::FirstToken { id: 2, .. })));
        let s = e.stats();
        assert_eq!((s.num_requests_running, s.num_requests_waiting), (1, 1));
        out.extend(run(&mut e));
        let a_done = finish_time(&out, 1);
        // B is admitted by the step that starts when A has finished: its prefill alone.
        let (b_first, _) = first_token(&out, 2);
        assert!(
            (b_first - (a_done + 0.010 + 0.008)).abs() < 1e-12,
            "{b_first} vs {a_done}"
        );
        // Neither the base model's request nor A's second one queued behind B.
        for id in [3, 4] {
            assert!(finish_time(&out, id) < a_done, "{id}: {out:?}");
        }
        assert!(first_token(&out, 3).0 < 0.05 && first_token(&out, 4).0 < 0.05);
    }

    #[test]
    fn enough_lora_slots_or_no_limit_run_adapters_together() {
        for max_loras in [2, 0] {
            let (mut out, mut e) = two_adapters(max_loras);
            assert_eq!(e.stats().num_requests_waiting, 0, "max_loras {max_loras}");
            out.extend(run(&mut e));
            let a_done = finish_time(&out, 1);
            for id in [2, 3, 4] {
                assert!(finish_time(&out, id) < a_done, "max_loras {max_loras}");
            }
        }
    }

    #[test]
    fn a_step_pays_for_each_adapter_it_brings_onto_the_gpu() {
        let cfg = EngineConfig {
            max_loras: 2,
            lora_switch_s: 0.5,
            ..small(10_000)
        };
        let mut e = Engine::new(cfg);
        // On an idle engine a submit starts a step at once: its duration is what it cost.
        let mut t = 0.0;
        let mut step = |e: &mut Engine, id: RequestId, adapter: Option<i64>| {
            t += 10.0;
            e.submit(
                t,
                lora_request(id, adapter, &tokens(id as u32 * 100, 10), 3),
            )
            .unwrap();
            let d = e.next_event_time().unwrap() - t;
            let out = run(e);
            (d, out)
        };
        let prefill = 0.010 + 0.010;
        let (d, out) = step(&mut e, 1, Some(1));
        assert!((d - (prefill + 0.5)).abs() < 1e-12, "{d}");
        // Its decode steps run the adapter already in its slot.
        let (first, _) = first_token(&out, 1);
        assert!((finish_time(&out, 1) - first - 2.0 * 0.005).abs() < 1e-12);
        // A second request of the same adapter, and the base model, pay nothing.
        for (id, adapter) in [(2, Some(1)), (3, None)] {
            let (d, _) = step(&mut e, id, adapter);
            assert!((d - prefill).abs() < 1e-12, "{id}: {d}");
        }
        // Two slots, least recently run evicted: B loads; A stays; C evicts B, not A.
        let expected = [
            (4, 2, 0.5),
            (5, 1, 0.0),
            (6, 3, 0.5),
            (7, 1, 0.0),
            (8, 2, 0.5),
        ];
        for (id, adapter, cost) in expected {
            let (d, _) = step(&mut e, id, Some(adapter));
            assert!((d - prefill - cost).abs() < 1e-12, "{id}: {d}");
        }
        // One slot: every change of adapter pays.
        let mut e = Engine::new(EngineConfig {
            max_loras: 1,
            lora_switch_s: 0.5,
            ..small(10_000)
        });
        for (id, adapter, cost) in [(1, 1, 0.5), (2, 1, 0.0), (3, 2, 0.5), (4, 1, 0.5)] {
            let (d, _) = step(&mut e, id, Some(adapter));
            assert!((d - prefill - cost).abs() < 1e-12, "{id}: {d}");
        }
        // Without a limit there is no switch cost.
        let mut e = Engine::new(EngineConfig {
            lora_switch_s: 0.5,
            ..small(10_000)
        });
        for (id, adapter) in [(1, 1), (2, 2), (3, 3)] {
            let (d, _) = step(&mut e, id, Some(adapter));
            assert!((d - prefill).abs() < 1e-12, "{id}: {d}");
        }
    }

    #[test]
    fn a_batch_with_two_new_adapters_pays_twice() {
        let mut e = Engine::new(EngineConfig {
            max_loras: 2,
            lora_switch_s: 0.5,
            ..small(10_000)
        });
        // Queued together while the engine is busy, admitted into its next step.
        e.submit(0.0, lora_request(1, None, &tokens(0, 10), 1))
            .unwrap();
        e.submit(0.0, lora_request(2, Some(1), &tokens(100, 10), 1))
            .unwrap();
        e.submit(0.0, lora_request(3, Some(2), &tokens(200, 10), 1))
            .unwrap();
        let mut out = vec![];
        e.advance(0.02, &mut out);
        assert_eq!(e.stats().num_requests_running, 2);
        let end = e.next_event_time().unwrap();
        assert!((end - (0.02 + 0.010 + 0.020 + 1.0)).abs() < 1e-12, "{end}");
        assert_eq!(e.last_step.work.lora_switches, 2);
    }

    #[test]
    fn block_stored_events_chain() {
        let mut e = Engine::new(EngineConfig {
            max_num_batched_tokens: 6,
            ..small(1000)
        });
        // 13 prompt tokens prefilled 6 + 6 + 1, then 4 decode steps: KV reaches 16 tokens.
        e.submit(0.0, request(1, &tokens(100, 13), 5)).unwrap();
        let out = run(&mut e);
        assert_eq!(finished(&out, 1).1, 5);
        let ev = events(&mut e);
        let st = stored(&ev);
        // Blocks become full at 4 (step 1), 8 and 12 (step 2), 16 (4th decode).
        let sizes: Vec<usize> = st.iter().map(|s| s.0.len()).collect();
        assert_eq!(sizes, vec![1, 2, 1]);
        assert_eq!(st[0].1, None);
        assert_eq!(st[1].1, Some(st[0].0[0]));
        assert_eq!(st[2].1, Some(st[1].0[1]));
        assert_eq!(st[0].2, tokens(100, 4));
        assert_eq!(st[1].2, tokens(104, 8));
        // The last block holds the prompt's last token then three generated ones.
        assert_eq!(st[2].2[0], 112);
        assert!(st[2].2[1..].iter().all(|&t| t < tokenizer::FIRST_SPECIAL));
        for e in &ev {
            if let KvEvent::BlockStored {
                block_size,
                medium,
                lora_id,
                token_ids,
                block_hashes,
                ..
            } = e
            {
                assert_eq!(*block_size, 4);
                assert_eq!(*medium, Some(Medium::Gpu));
                assert_eq!(*lora_id, None);
                assert_eq!(token_ids.len(), block_hashes.len() * 4);
            }
        }
        // The hashes are the engine's own: another seed gives other ids, same structure.
        let mut other = Engine::new(EngineConfig {
            hash_seed: 99,
            max_num_batched_tokens: 6,
            ..small(1000)
        });
        other.submit(0.0, request(1, &tokens(100, 13), 1)).unwrap();
        run(&mut other);
        let st2 = stored(&events(&mut other));
        assert_ne!(st2[0].0[0], st[0].0[0]);
        assert_eq!(st2[0].2, st[0].2);
    }

    #[test]
    fn reused_blocks_emit_nothing_new() {
        let mut e = Engine::new(small(1000));
        e.submit(0.0, request(1, &tokens(0, 16), 1)).unwrap();
        run(&mut e);
        let first = stored(&events(&mut e));
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].0.len(), 4);
        // The same 16 tokens plus 4: all four blocks hit, only block 4 is announced.
        let mut longer = tokens(0, 16);
        longer.extend([50, 51, 52, 53]);
        e.submit(1.0, request(2, &longer, 1)).unwrap();
        assert_eq!(first_token(&run(&mut e), 2).1, 16);
        let second = stored(&events(&mut e));
        assert_eq!(second.len(), 1);
        assert_eq!(second[0].0.len(), 1);
        assert_eq!(
            second[0].1,
            Some(first[0].0[3]),
            "parent is the last hit block"
        );
        // Exactly the 16 tokens again: the last token is always recomputed, so block 3 is
        // computed again into a new physical block and announced again (same hash, as vLLM).
        e.submit(2.0, request(3, &tokens(0, 16), 1)).unwrap();
        assert_eq!(first_token(&run(&mut e), 3).1, 12);
        let third = stored(&events(&mut e));
        assert_eq!(third.len(), 1);
        assert_eq!(third[0].0, vec![first[0].0[3]]);
        assert_eq!(third[0].1, Some(first[0].0[2]));
    }

    #[test]
    fn lru_evicts_least_recently_used_unheld_block_first() {
        // 7 blocks of 4 tokens.
        let mut e = Engine::new(small(28));
        e.submit(0.0, request(1, &tokens(0, 8), 1)).unwrap(); // A0 A1
        run(&mut e);
        e.submit(1.0, request(2, &tokens(100, 8), 1)).unwrap(); // B0 B1
        run(&mut e);
        e.submit(2.0, request(3, &tokens(200, 8), 1)).unwrap(); // C0 C1
        run(&mut e);
        let st = stored(&events(&mut e));
        let b = &st[1].0;
        assert_eq!(
            st.iter().map(|s| s.0.len()).collect::<Vec<_>>(),
            vec![2, 2, 2]
        );
        // Use A again (both blocks hit, the partial ninth token takes the unused block):
        // B is now the least recently used.
        e.submit(3.0, request(4, &tokens(0, 9), 1)).unwrap();
        assert_eq!(first_token(&run(&mut e), 4).1, 8);
        assert!(removed(&events(&mut e)).is_empty());
        // A new 8-token prompt needs two blocks: B goes, its tail block first.
        e.submit(4.0, request(5, &tokens(300, 8), 1)).unwrap();
        run(&mut e);
        assert_eq!(removed(&events(&mut e)), vec![b[1], b[0]]);
        assert_eq!(e.cached_prefix_tokens(&tokens(100, 9), None), 0);
        assert_eq!(e.cached_prefix_tokens(&tokens(0, 9), None), 8);
        assert_eq!(e.cached_prefix_tokens(&tokens(200, 9), None), 8);
    }

    #[test]
    fn held_blocks_are_never_evicted() {
        // 12 blocks; a long-running request holds 3 to 8 of them while others churn.
        let mut e = Engine::new(small(48));
        e.submit(0.0, request(1, &tokens(0, 12), 20)).unwrap();
        for id in 2..6u64 {
            e.submit(0.0, request(id, &tokens(1000 * id as u32, 16), 1))
                .unwrap();
        }
        let mut held = std::collections::HashSet::new();
        let mut out = vec![];
        let mut evictions = 0;
        while let Some(t) = e.next_event_time() {
            e.advance(t, &mut out);
            let ev = events(&mut e);
            let running = !out
                .iter()
                .any(|o| matches!(o, EngineOutput::Finished { id: 1, .. }));
            for (hashes, parent, token_ids) in stored(&ev) {
                let mine = match parent {
                    None => token_ids[0] == 0,
                    Some(p) => held.contains(&p),
                };
                if mine {
                    held.extend(hashes);
                }
            }
            for h in removed(&ev) {
                evictions += 1;
                assert!(!running || !held.contains(&h), "a held block was evicted");
            }
        }
        assert_eq!(e.preemptions_total(), 0);
        assert_eq!(held.len(), 7, "prompt and generated blocks of request 1");
        assert!(evictions > 0, "the churn evicted something");
        assert_eq!(finished(&out, 1).1, 20);
    }

    #[test]
    fn ttft_grows_with_uncached_tokens() {
        let cfg = EngineConfig::default();
        let ttft = |n: u32| {
            let mut e = Engine::new(cfg.clone());
            e.submit(0.0, request(1, &tokens(0, n), 1)).unwrap();
            first_token(&run(&mut e), 1).0
        };
        let (t1, t2, t3) = (ttft(100), ttft(2000), ttft(20_000));
        assert!(t1 < t2 && t2 < t3, "{t1} {t2} {t3}");
        assert!((0.005..0.03).contains(&t1), "{t1}");
        assert!((0.5..1.0).contains(&t3), "{t3}");
        // It matches the closed form for an idle engine.
        assert!((t3 - cfg.prefill_seconds(0, 20_000)).abs() < 1e-9);
    }

    #[test]
    fn ttft_drops_for_a_warm_prefix() {
        let mut e = Engine::new(EngineConfig::default());
        let mut prompt = tokens(0, 10_000);
        e.submit(0.0, request(1, &prompt, 1)).unwrap();
        let cold = first_token(&run(&mut e), 1).0;
        prompt.extend(tokens(50_000, 200));
        e.submit(100.0, request(2, &prompt, 1)).unwrap();
        let (t, cached) = first_token(&run(&mut e), 2);
        assert_eq!(cached, 10_000 / 16 * 16);
        let warm = t - 100.0;
        assert!(warm < cold / 5.0, "warm {warm} cold {cold}");
        let expected = EngineConfig::default().prefill_seconds(cached, 10_200 - cached);
        assert!((warm - expected).abs() < 1e-9);
    }

    #[test]
    fn ttft_grows_with_queue_depth() {
        let mut e = Engine::new(EngineConfig::default());
        for id in 0..8u64 {
            e.submit(0.0, request(id, &tokens(id as u32 * 10_000, 4000), 20))
                .unwrap();
        }
        assert_eq!(e.stats().num_requests_waiting, 7);
        let out = run(&mut e);
        let ttfts: Vec<f64> = (0..8).map(|id| first_token(&out, id).0).collect();
        for w in ttfts.windows(2) {
            assert!(w[0] <= w[1], "{ttfts:?}");
        }
        assert!(ttfts[7] > 3.0 * ttfts[0], "{ttfts:?}");
    }

    #[test]
    fn chunked_prefill_respects_the_budget() {
        let cfg = EngineConfig {
            max_num_batched_tokens: 1000,
            max_model_len: 10_000,
            ..small(100_000)
        };
        let mut e = Engine::new(cfg.clone());
        e.submit(0.0, request(1, &tokens(0, 2500), 5)).unwrap();
        e.submit(0.0, request(2, &tokens(10_000, 300), 5)).unwrap();
        let mut steps = vec![];
        let mut out = vec![];
        while let Some(t) = e.next_event_time() {
            steps.push(e.last_step);
            e.advance(t, &mut out);
        }
        assert!(steps
            .iter()
            .all(|s| s.work.prefill_tokens + s.work.decode_seqs <= 1000));
        // 2500 tokens in three chunks (1000, 1000, 500); request 2 fits into the third.
        let prefill: Vec<u64> = steps.iter().map(|s| s.work.prefill_tokens).collect();
        assert_eq!(&prefill[..3], &[1000, 1000, 800]);
        assert_eq!(steps[0].work.decode_seqs, 0);
        // Request 2 arrived with 1, but waited for the budget.
        assert!(first_token(&out, 2).0 >= steps[2].end);
        // A step with prefill and decode pays both parts.
        let mixed = steps
            .iter()
            .find(|s| s.work.prefill_tokens > 0 && s.work.decode_seqs > 0);
        if let Some(s) = mixed {
            let d = s.end - s.start;
            let expected = 0.010 + 0.001 * s.work.prefill_tokens as f64 + 0.005;
            assert!((d - expected).abs() < 1e-12);
        }
        for w in steps.windows(2) {
            assert!(w[0].end <= w[1].start + 1e-12, "steps do not overlap");
        }
    }

    #[test]
    fn reset_clears_cache_and_is_refused_while_running() {
        let mut e = Engine::new(small(1000));
        e.submit(0.0, request(1, &tokens(0, 12), 3)).unwrap();
        assert!(!e.reset_prefix_cache());
        run(&mut e);
        assert_eq!(e.cached_prefix_tokens(&tokens(0, 12), None), 8);
        events(&mut e);
        assert!(e.reset_prefix_cache());
        assert_eq!(events(&mut e), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(e.cached_prefix_tokens(&tokens(0, 12), None), 0);
        // Cleared blocks are reused without removal events.
        e.submit(1.0, request(2, &tokens(500, 900), 1)).unwrap();
        run(&mut e);
        assert!(removed(&events(&mut e)).is_empty());
    }

    #[test]
    fn cancel_frees_blocks_and_reports_abort() {
        let mut e = Engine::new(small(1000));
        e.submit(0.0, request(1, &tokens(0, 20), 50)).unwrap();
        e.submit(0.0, request(2, &tokens(100, 20), 50)).unwrap();
        let mut out = vec![];
        e.advance(0.1, &mut out);
        assert!(e.stats().kv_cache_usage > 0.0);
        assert_eq!(e.stats().num_requests_running, 2);
        assert!(e.cancel(0.1, 1));
        assert!(!e.cancel(0.1, 1), "already gone");
        assert!(!e.cancel(0.1, 77));
        assert!(e.cancel(0.1, 2));
        assert_eq!(e.stats().kv_cache_usage, 0.0);
        assert_eq!(e.stats().num_requests_running, 0);
        out.clear();
        e.advance(0.1, &mut out);
        assert_eq!(out.len(), 2);
        let (reason, completion, _) = finished(&out, 1);
        assert_eq!(reason, FinishReason::Abort);
        assert!(completion > 0);
        // The blocks stay cached; the id can be reused; nothing more comes from the step.
        assert_eq!(e.cached_prefix_tokens(&tokens(0, 20), None), 16);
        e.submit(0.1, request(1, &tokens(0, 20), 1)).unwrap();
        let out = run(&mut e);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(first_token(&out, 1).1, 16);
        // Cancelling a waiting request.
        let mut e = Engine::new(EngineConfig {
            max_num_seqs: 1,
            ..small(1000)
        });
        e.submit(0.0, request(1, &tokens(0, 20), 5)).unwrap();
        e.submit(0.0, request(2, &tokens(100, 20), 5)).unwrap();
        assert_eq!(e.stats().num_requests_waiting, 1);
        assert!(e.cancel(0.0, 2));
        assert_eq!(e.stats().num_requests_waiting, 0);
        let out = run(&mut e);
        assert_eq!(finished(&out, 2), (FinishReason::Abort, 0, 0));
        assert_eq!(finished(&out, 1).0, FinishReason::Length);
    }

    #[test]
    fn rejects_bad_requests() {
        let mut e = Engine::new(small(10_000));
        assert_eq!(
            e.submit(0.0, request(1, &tokens(0, 990), 11)),
            Err(EngineError::ContextTooLong {
                prompt_tokens: 990,
                max_tokens: 11,
                max_model_len: 1000
            })
        );
        assert!(e.submit(0.0, request(1, &tokens(0, 990), 10)).is_ok());
        assert_eq!(
            e.submit(0.0, request(1, &tokens(0, 5), 1)),
            Err(EngineError::DuplicateId(1))
        );
        assert_eq!(
            e.submit(0.0, request(2, &[], 1)),
            Err(EngineError::EmptyPrompt)
        );
        // The KV capacity caps the context too.
        let mut tiny = Engine::new(small(40));
        assert_eq!(tiny.context_limit(), 40);
        assert!(matches!(
            tiny.submit(0.0, request(1, &tokens(0, 39), 2)),
            Err(EngineError::ContextTooLong {
                max_model_len: 40,
                ..
            })
        ));
        let msg = EngineError::ContextTooLong {
            prompt_tokens: 990,
            max_tokens: 11,
            max_model_len: 1000,
        }
        .to_string();
        assert!(msg.contains("1001 tokens"), "{msg}");
    }

    #[test]
    fn stats_counters() {
        let mut e = Engine::new(small(1000));
        e.submit(0.0, request(1, &tokens(0, 18), 3)).unwrap();
        run(&mut e);
        e.submit(1.0, request(2, &tokens(0, 18), 4)).unwrap();
        let s = e.stats();
        assert_eq!((s.num_requests_running, s.num_requests_waiting), (1, 0));
        assert!(s.kv_cache_usage > 0.0 && s.kv_cache_usage <= 1.0);
        run(&mut e);
        let s = e.stats();
        assert_eq!(s.prefix_cache_queries_tokens, 36);
        assert_eq!(s.prefix_cache_hits_tokens, 16);
        assert_eq!(s.prompt_tokens_total, 36);
        assert_eq!(s.generation_tokens_total, 7);
        assert_eq!(s.requests_finished_total, 2);
        assert_eq!(s.kv_cache_usage, 0.0);
    }

    #[test]
    fn preemption_recomputes_and_still_finishes() {
        // 10 blocks of 4 = 40 tokens; three requests of 8 + 12 tokens each cannot all grow.
        let mut e = Engine::new(small(40));
        for id in 1..=3u64 {
            e.submit(0.0, request(id, &tokens(id as u32 * 100, 8), 12))
                .unwrap();
        }
        let out = run(&mut e);
        assert!(e.preemptions_total() > 0);
        for id in 1..=3 {
            assert_eq!(finished(&out, id).1, 12);
            let n = out
                .iter()
                .filter(|o| matches!(o, EngineOutput::Token { id: i, .. } if *i == id))
                .count();
            assert_eq!(n, 11, "no token is emitted twice after recompute");
        }
        let s = e.stats();
        assert_eq!(
            s.prefix_cache_queries_tokens, 24,
            "re-admissions are not counted"
        );
        assert_eq!(s.generation_tokens_total, 36);
        assert_eq!(s.kv_cache_usage, 0.0);
    }

    #[test]
    fn late_driver_does_not_pull_requests_into_past_steps() {
        let mut e = Engine::new(small(1000));
        e.submit(0.0, request(1, &tokens(0, 10), 1)).unwrap(); // ends at 0.02
                                                               // The driver submits at 0.5 before advancing past the finished step.
        e.submit(0.5, request(2, &tokens(100, 10), 1)).unwrap();
        let mut out = vec![];
        e.advance(0.5, &mut out);
        assert_eq!(e.next_event_time(), Some(0.5 + 0.020));
        let out = run(&mut e);
        assert!((first_token(&out, 2).0 - 0.52).abs() < 1e-12);
    }

    #[test]
    fn hostile_times_do_not_break_the_engine() {
        let mut e = Engine::new(small(1000));
        e.submit(f64::NAN, request(1, &tokens(0, 10), 2)).unwrap();
        assert!(e.next_event_time().unwrap().is_finite());
        e.submit(f64::INFINITY, request(2, &tokens(50, 10), 2))
            .unwrap();
        let mut out = vec![];
        e.advance(f64::NAN, &mut out);
        assert!(out.is_empty());
        let out = run(&mut e);
        assert_eq!(finished(&out, 1).1, 2);
        assert_eq!(finished(&out, 2).1, 2);
        assert!(!e.cancel(f64::NAN, 1));
    }

    #[test]
    fn engine_moves_between_threads() {
        fn send<T: Send + 'static>() {}
        send::<Engine>();
    }

    #[test]
    fn deterministic() {
        let go = || {
            let mut e = Engine::new(EngineConfig {
                kv_capacity_tokens: 20_000,
                ..EngineConfig::default()
            });
            let mut out = vec![];
            let mut ev = vec![];
            for id in 0..60u64 {
                let t = id as f64 * 0.05;
                e.advance(t, &mut out);
                let shared = (id % 3) as u32 * 100_000;
                let mut prompt = tokens(shared, 1500);
                prompt.extend(tokens(1_000_000 + id as u32 * 1000, 300));
                e.submit(t, request(id, &prompt, 30 + (id as u32 % 7)))
                    .unwrap();
                if id % 11 == 5 {
                    e.cancel(t, id - 1);
                }
                e.take_kv_events(&mut ev);
            }
            out.extend(run(&mut e));
            e.take_kv_events(&mut ev);
            (out, ev, e.stats())
        };
        let (a, b) = (go(), go());
        assert_eq!(a, b);
        assert!(
            !removed(&a.1).is_empty(),
            "the run was small enough to evict"
        );
    }

    #[test]
    fn throughput_smoke() {
        // 1000 requests of 2000 tokens sharing some prefixes; not timed, just exercised (it
        // takes well under a second in an optimised build).
        let mut e = Engine::new(EngineConfig::default());
        e.set_kv_events_enabled(false);
        let mut out = vec![];
        let mut prompt = Vec::with_capacity(2000);
        for id in 0..1000u64 {
            let t = id as f64 * 0.05;
            e.advance(t, &mut out);
            prompt.clear();
            prompt.extend(tokens((id % 10) as u32 * 10_000, 1000));
            prompt.extend(tokens(200_000 + id as u32 * 1000, 1000));
            e.submit(t, request(id, &prompt, 100)).unwrap();
        }
        out.extend(run(&mut e));
        let finishes = out
            .iter()
            .filter(|o| matches!(o, EngineOutput::Finished { .. }))
            .count();
        assert_eq!(finishes, 1000);
        let s = e.stats();
        assert_eq!(s.generation_tokens_total, 100_000);
        assert!(s.prefix_cache_hits_tokens > 900 * 992);
    }

    fn with_host(gpu_tokens: u64, host_tokens: u64) -> EngineConfig {
        EngineConfig {
            host_kv_capacity_tokens: host_tokens,
            host_load_s_per_token: 0.0002,
            ..small(gpu_tokens)
        }
    }

    type Stored = (Vec<u64>, Option<u64>, Vec<u32>);

    /// BlockStored events on `medium`: (hashes, parent, tokens).
    fn stored_on(ev: &[KvEvent], on: Medium) -> Vec<Stored> {
        ev.iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    medium,
                    ..
                } if *medium == Some(on) => {
                    Some((block_hashes.clone(), *parent_block_hash, token_ids.clone()))
                }
                _ => None,
            })
            .collect()
    }

    fn removed_on(ev: &[KvEvent], on: Medium) -> Vec<u64> {
        ev.iter()
            .flat_map(|e| match e {
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } if *medium == Some(on) => block_hashes.clone(),
                _ => vec![],
            })
            .collect()
    }

    #[test]
    fn host_tier_keeps_gpu_evictions_and_loads_them_back() {
        // 10 GPU blocks of 4 tokens, 100 host blocks.
        let prompt = tokens(0, 18); // 4 full blocks + 2 tokens
        let mut e = Engine::new(with_host(40, 400));
        e.submit(0.0, request(1, &prompt, 1)).unwrap();
        let cold = first_token(&run(&mut e), 1).0;
        let ev = events(&mut e);
        let gpu = stored_on(&ev, Medium::Gpu);
        assert_eq!(gpu.len(), 1);
        assert_eq!(gpu[0].0.len(), 4);
        assert_eq!(
            stored_on(&ev, Medium::Cpu),
            gpu,
            "written through: same blocks, parent and tokens"
        );
        let h = gpu[0].0.clone();
        // A prompt of 25 tokens takes 7 blocks: the 5 never used, the partial block and
        // block 3 of the first prompt (a request frees its tail first).
        e.submit(1.0, request(2, &tokens(500, 25), 1)).unwrap();
        run(&mut e);
        let ev = events(&mut e);
        assert_eq!(removed_on(&ev, Medium::Gpu), vec![h[3]]);
        assert!(removed_on(&ev, Medium::Cpu).is_empty());
        assert_eq!(e.cached_prefix_tokens(&prompt, None), 12);
        assert_eq!(e.host_prefix_tokens(&prompt, None), 4, "block 3 is in host");
        // The GPU prefix continues into the host tier: 16 tokens cached, 4 of them loaded.
        e.submit(10.0, request(3, &prompt, 1)).unwrap();
        let (t, cached) = first_token(&run(&mut e), 3);
        assert_eq!(cached, 16);
        let prefill_2 = 0.010 + 0.002;
        assert!((t - 10.0 - (prefill_2 + 4.0 * 0.0002)).abs() < 1e-12, "{t}");
        assert!(t - 10.0 < cold);
        // The loaded block is registered on the GPU again (medium GPU, parent block 2); host
        // already holds it, so nothing new is stored there.
        let ev = events(&mut e);
        assert_eq!(
            stored_on(&ev, Medium::Gpu),
            vec![(vec![h[3]], Some(h[2]), tokens(12, 4))]
        );
        assert!(stored_on(&ev, Medium::Cpu).is_empty());
        assert_eq!(e.cached_prefix_tokens(&prompt, None), 16);
        // Push the whole prompt out of the GPU: 37 tokens need all 10 blocks.
        e.submit(20.0, request(4, &tokens(900, 37), 1)).unwrap();
        run(&mut e);
        events(&mut e);
        assert_eq!(e.cached_prefix_tokens(&prompt, None), 0);
        assert_eq!(e.host_prefix_tokens(&prompt, None), 16);
        e.submit(30.0, request(5, &prompt, 1)).unwrap();
        let out = run(&mut e);
        let (t, cached) = first_token(&out, 5);
        assert_eq!(cached, 16);
        assert_eq!(finished(&out, 5).2, 16);
        let warm = t - 30.0;
        assert!((warm - (prefill_2 + 16.0 * 0.0002)).abs() < 1e-12, "{warm}");
        assert!(
            warm < cold / 1.5,
            "loading is cheaper than recompute: {warm} vs {cold}"
        );
        let ev = events(&mut e);
        assert_eq!(stored_on(&ev, Medium::Gpu)[0].0, h);
        // Counters: the GPU pair sees GPU hits only, the external pair the host tier's.
        let s = e.stats();
        assert_eq!(s.prefix_cache_queries_tokens, 18 + 25 + 18 + 37 + 18);
        assert_eq!(s.prefix_cache_hits_tokens, 12);
        assert_eq!(
            s.external_prefix_cache_queries_tokens,
            18 + 25 + (18 - 12) + 37 + 18
        );
        assert_eq!(s.external_prefix_cache_hits_tokens, 4 + 16);
        // Without a host tier the same sequence recomputes.
        let mut plain = Engine::new(small(40));
        for (id, at, p) in [
            (1, 0.0, &prompt),
            (4, 20.0, &tokens(900, 37)),
            (5, 30.0, &prompt),
        ] {
            plain.submit(at, request(id, p, 1)).unwrap();
            let out = run(&mut plain);
            if id == 5 {
                assert_eq!(first_token(&out, 5), (30.0 + cold, 0));
            }
        }
        assert!(stored_on(&events(&mut plain), Medium::Cpu).is_empty());
        assert_eq!(plain.stats().external_prefix_cache_queries_tokens, 0);
    }

    #[test]
    fn host_tier_is_bounded_lru_and_cleared_with_the_gpu() {
        // 2 host blocks: a prompt of 4 full blocks keeps its head there.
        let mut e = Engine::new(with_host(1000, 8));
        assert_eq!(e.host_kv_blocks(), (0, 2));
        e.submit(0.0, request(1, &tokens(0, 18), 1)).unwrap();
        run(&mut e);
        let ev = events(&mut e);
        let h = stored_on(&ev, Medium::Cpu)[0].0.clone();
        assert_eq!(h.len(), 4);
        assert_eq!(removed_on(&ev, Medium::Cpu), vec![h[3], h[2]]);
        assert_eq!(e.host_kv_blocks(), (2, 2));
        // Another prompt takes the host tier over; its removals name the first one's blocks.
        e.submit(1.0, request(2, &tokens(100, 9), 1)).unwrap();
        run(&mut e);
        let ev = events(&mut e);
        assert_eq!(stored_on(&ev, Medium::Cpu).len(), 1);
        assert_eq!(removed_on(&ev, Medium::Cpu), vec![h[1], h[0]]);
        assert_eq!(e.host_kv_blocks(), (2, 2));
        // reset clears both tiers with one AllBlocksCleared.
        assert!(e.reset_prefix_cache());
        assert_eq!(events(&mut e), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(e.host_kv_blocks(), (0, 2));
        assert_eq!(e.host_prefix_tokens(&tokens(100, 9), None), 0);
        // A host load is charged to the step that admits the request, on top of its prefill.
        let cfg = EngineConfig {
            host_load_s_per_token: 0.5,
            ..with_host(1000, 8)
        };
        let mut work = StepWork::default();
        work.add_prefill(16, 2);
        let plain = cfg.step_seconds(&work);
        work.add_host_load(16);
        assert!((cfg.step_seconds(&work) - plain - 8.0).abs() < 1e-12);
    }

    /// The scale the simulator needs: an hour of traffic for four replicas, 12k requests of
    /// about 12k prompt tokens (shared prefixes) and 343 output tokens, KV events on.
    /// `cargo test --release --lib engine::tests::hour_of_four_replicas -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn hour_of_four_replicas() {
        let started = std::time::Instant::now();
        let mut replicas: Vec<Engine> = (0..4)
            .map(|_| Engine::new(EngineConfig::default()))
            .collect();
        let (mut out, mut ev) = (vec![], vec![]);
        let mut prompt = Vec::new();
        let mut seed = 1u64;
        let mut finished = 0;
        let mut events = 0;
        for id in 0..12_000u64 {
            let t = id as f64 * 0.3;
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (seed >> 33) as u32;
            prompt.clear();
            prompt.extend(tokens(0, 1024)); // shared system prompt
            prompt.extend(tokens(100_000 + (r % 200) * 20_000, 4000)); // one of 200 documents
            prompt.extend(tokens(10_000_000 + id as u32 * 10_000, 3000 + r % 8000));
            let engine = &mut replicas[(r % 4) as usize];
            engine.submit(t, request(id, &prompt, 343)).unwrap();
            for e in replicas.iter_mut() {
                e.advance(t, &mut out);
                e.take_kv_events(&mut ev);
            }
            finished += out
                .iter()
                .filter(|o| matches!(o, EngineOutput::Finished { .. }))
                .count();
            events += ev.len();
            out.clear();
            ev.clear();
        }
        for e in replicas.iter_mut() {
            out.extend(run(e));
            e.take_kv_events(&mut ev);
        }
        finished += out
            .iter()
            .filter(|o| matches!(o, EngineOutput::Finished { .. }))
            .count();
        events += ev.len();
        assert_eq!(finished, 12_000);
        let s: Vec<EngineStats> = replicas.iter().map(|e| e.stats()).collect();
        let hits: u64 = s.iter().map(|s| s.prefix_cache_hits_tokens).sum();
        let queries: u64 = s.iter().map(|s| s.prefix_cache_queries_tokens).sum();
        let preempted: u64 = replicas.iter().map(|e| e.preemptions_total()).sum();
        println!(
            "{:.2} s wall, {events} KV events, hit rate {:.2}, {preempted} preemptions",
            started.elapsed().as_secs_f64(),
            hits as f64 / queries as f64
        );
    }

    /// A replica at speed 0.5 takes exactly twice as long for the same prefill, chunked or
    /// not, and its decode at decode speed 0.25 four times as long.
    #[test]
    fn a_replica_at_half_speed_prefills_in_twice_the_time() {
        let base = EngineConfig::default();
        let time_to = |cfg: EngineConfig, prompt: u32, max_tokens: u32| {
            let mut e = Engine::new(cfg);
            e.submit(0.0, request(1, &tokens(0, prompt), max_tokens))
                .unwrap();
            let out = run(&mut e);
            let end = out
                .iter()
                .find_map(|o| match *o {
                    EngineOutput::Finished { t, .. } => Some(t),
                    _ => None,
                })
                .unwrap();
            (first_token(&out, 1).0, end)
        };
        let half = Speed {
            prefill: 0.5,
            decode: 0.25,
        };
        for prompt in [2000, 20_000] {
            let (fast, fast_end) = time_to(base.clone(), prompt, 10);
            let (slow, slow_end) = time_to(half.apply(&base), prompt, 10);
            assert!(fast > 0.0);
            assert_eq!(slow, 2.0 * fast, "{prompt} tokens");
            // Nine decode steps after the first token, each four times as long.
            let (fast_decode, slow_decode) = (fast_end - fast, slow_end - slow);
            assert!(
                (slow_decode - 4.0 * fast_decode).abs() < 1e-12,
                "{slow_decode} vs {fast_decode}"
            );
        }
        // What the speed does not touch: the chunking of the prompt.
        let slow = "0.5".parse::<Speed>().unwrap().apply(&base);
        assert_eq!(slow.max_num_batched_tokens, base.max_num_batched_tokens);
    }

    /// Timing spread: the step times scatter, their mean stays within a few percent of the
    /// model, and the same seed gives the same times.
    #[test]
    fn timing_spread_keeps_the_mean_and_is_deterministic() {
        let steps = 4000;
        let times = |spread: f64, seed: u64| {
            let mut e = Engine::new(EngineConfig {
                timing_spread: spread,
                timing_seed: seed,
                ..EngineConfig::default()
            });
            e.submit(0.0, request(1, &tokens(0, 100), steps)).unwrap();
            let out = run(&mut e);
            let mut t: Vec<f64> = out
                .iter()
                .filter_map(|o| match *o {
                    EngineOutput::FirstToken { t, .. } | EngineOutput::Token { t, .. } => Some(t),
                    _ => None,
                })
                .collect();
            t.insert(0, 0.0);
            t.windows(2).map(|w| w[1] - w[0]).collect::<Vec<f64>>()
        };
        let plain = times(0.0, 7);
        assert_eq!(plain, times(0.0, 8), "no spread: no randomness");
        for spread in [0.1, 0.3] {
            let jittered = times(spread, 7);
            assert_eq!(jittered.len(), plain.len());
            assert_eq!(jittered, times(spread, 7), "deterministic for a seed");
            assert_ne!(jittered, times(spread, 8), "another seed, other times");
            let ratio: f64 = jittered.iter().sum::<f64>() / plain.iter().sum::<f64>();
            assert!(
                (0.97..=1.03).contains(&ratio),
                "spread {spread}: mean ratio {ratio}"
            );
            // The steps really scatter: the ratios' log has about the spread's deviation.
            let logs: Vec<f64> = jittered
                .iter()
                .zip(&plain)
                .map(|(j, p)| (j / p).ln())
                .collect();
            let mean = logs.iter().sum::<f64>() / logs.len() as f64;
            let sd =
                (logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / logs.len() as f64).sqrt();
            assert!(
                (sd / spread - 1.0).abs() < 0.1,
                "spread {spread}: log deviation {sd}"
            );
        }
        let bad = EngineConfig {
            timing_spread: 1.5,
            ..EngineConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("timing_spread"));
    }

    fn hold(hold_s: f64) -> KvTransfer {
        KvTransfer::Hold { hold_s }
    }

    #[test]
    fn a_prefill_for_a_remote_decode_holds_its_blocks_until_pulled() {
        let mut e = Engine::new(small(1000)); // 250 blocks of 4 tokens
        let prompt = tokens(0, 18); // 4 full blocks + 2 tokens: 5 blocks
        e.submit_with(0.0, request(1, &prompt, 1), hold(100.0))
            .unwrap();
        let mut out = vec![];
        e.advance(1.0, &mut out);
        assert_eq!(finished(&out, 1), (FinishReason::Length, 1, 0));
        let blocks = e.held_blocks(1).expect("held").to_vec();
        assert_eq!(blocks.len(), 5);
        let s = e.stats();
        assert_eq!((s.kv_held_requests, s.kv_held_blocks), (1, 5));
        assert_eq!(s.kv_cache_usage, 5.0 / 250.0, "held blocks are in use");
        assert!(!e.reset_prefix_cache(), "no reset while blocks are held");
        // The next hold timeout is the engine's next event, idle as it is.
        assert_eq!(e.next_event_time(), Some(out_time(&out) + 100.0));
        // Its full blocks are cached for others meanwhile.
        assert_eq!(e.cached_prefix_tokens(&prompt, None), 16);
        e.submit(2.0, request(2, &prompt, 1)).unwrap();
        e.advance(3.0, &mut out);
        assert_eq!(first_token(&out, 2).1, 16);
        assert_eq!(
            e.stats().kv_held_blocks,
            5,
            "a prefix hit does not free the hold"
        );
        // The pull releases them, once.
        let pulled = e.release_held(4.0, 1).expect("held");
        assert_eq!(pulled, HeldKv { tokens: 18, blocks });
        assert_eq!(e.release_held(4.0, 1), None);
        assert_eq!(e.held_blocks(1), None);
        let s = e.stats();
        assert_eq!((s.kv_held_requests, s.kv_held_blocks), (0, 0));
        assert_eq!((s.kv_cache_usage, s.kv_holds_expired), (0.0, 0));
        assert_eq!(e.next_event_time(), None);
        assert_eq!(e.cached_prefix_tokens(&prompt, None), 16, "still cached");
        assert!(e.reset_prefix_cache());
        // A held id is not reused while held; a finished plain request's id is free.
        e.submit_with(5.0, request(3, &prompt, 1), hold(100.0))
            .unwrap();
        e.advance(6.0, &mut out);
        assert_eq!(
            e.submit(6.0, request(3, &prompt, 1)),
            Err(EngineError::DuplicateId(3))
        );
    }

    fn out_time(out: &[EngineOutput]) -> f64 {
        out.iter()
            .find_map(|o| match *o {
                EngineOutput::Finished { t, .. } => Some(t),
                _ => None,
            })
            .expect("a finish")
    }

    #[test]
    fn a_hold_times_out_and_counts() {
        let mut e = Engine::new(small(1000));
        e.submit_with(0.0, request(1, &tokens(0, 10), 1), hold(5.0))
            .unwrap();
        let mut out = vec![];
        e.advance(1.0, &mut out);
        let done = out_time(&out);
        assert_eq!(e.stats().kv_held_blocks, 3);
        e.advance(done + 4.9, &mut out);
        assert!(e.held_blocks(1).is_some());
        e.advance(done + 5.0, &mut out);
        assert_eq!(e.held_blocks(1), None);
        let s = e.stats();
        assert_eq!((s.kv_held_blocks, s.kv_holds_expired), (0, 1));
        assert_eq!(s.kv_cache_usage, 0.0);
        assert_eq!(e.release_held(10.0, 1), None, "expired: nothing to pull");
        assert_eq!(e.next_event_time(), None);
        // Aborted before it finished: nothing is held.
        e.submit_with(20.0, request(2, &tokens(0, 10), 5), hold(5.0))
            .unwrap();
        assert!(e.cancel(20.001, 2));
        e.advance(21.0, &mut out);
        assert_eq!(e.held_blocks(2), None);
        assert_eq!(e.stats().kv_cache_usage, 0.0);
        assert_eq!(e.stats().kv_holds_expired, 1);
    }

    #[test]
    fn requests_wait_for_held_blocks_without_spinning() {
        // 10 blocks; a hold of 5 leaves 5, and a 25-token prompt needs 7.
        let mut e = Engine::new(small(40));
        e.submit_with(0.0, request(1, &tokens(0, 18), 1), hold(50.0))
            .unwrap();
        let mut out = vec![];
        e.advance(1.0, &mut out);
        let expires = out_time(&out) + 50.0;
        e.submit(2.0, request(2, &tokens(500, 25), 1)).unwrap();
        let s = e.stats();
        assert_eq!((s.num_requests_running, s.num_requests_waiting), (0, 1));
        // Nothing to do until the hold ends: the next event is its timeout, not now.
        assert_eq!(e.next_event_time(), Some(expires));
        e.advance(expires - 1.0, &mut out);
        assert_eq!(e.stats().num_requests_waiting, 1);
        let out = run(&mut e);
        let (t, _) = first_token(&out, 2);
        assert!(
            (t - (expires + 0.010 + 0.025)).abs() < 1e-9,
            "{t} vs {expires}"
        );
        assert_eq!(e.stats().kv_holds_expired, 1);
        // A pull frees them as well, and the waiting request starts then.
        let mut e = Engine::new(small(40));
        e.submit_with(0.0, request(1, &tokens(0, 18), 1), hold(50.0))
            .unwrap();
        let mut out = vec![];
        e.advance(1.0, &mut out);
        e.submit(2.0, request(2, &tokens(500, 25), 1)).unwrap();
        assert!(e.release_held(3.0, 1).is_some());
        assert_eq!(e.next_event_time(), Some(3.0));
        let (t, _) = first_token(&run(&mut e), 2);
        assert!((t - 3.035).abs() < 1e-9, "{t}");
        assert_eq!(e.stats().kv_holds_expired, 0);
    }

    #[test]
    fn received_kv_is_admitted_as_computed_but_the_last_token() {
        let prompt = tokens(0, 18);
        let received = |tokens| KvTransfer::Received { tokens };
        let mut e = Engine::new(small(1000));
        e.set_kv_connector(true);
        e.submit_with(1.0, request(1, &prompt, 3), received(18))
            .unwrap();
        // One step prefills the last prompt token alone.
        assert!((e.next_event_time().unwrap() - (1.0 + 0.010 + 0.001)).abs() < 1e-12);
        let out = run(&mut e);
        assert_eq!(first_token(&out, 1).1, 17);
        assert_eq!(finished(&out, 1), (FinishReason::Length, 3, 17));
        // Its blocks are registered and announced as computed ones.
        let ev = events(&mut e);
        let st = stored(&ev);
        assert_eq!(
            st.len(),
            2,
            "the prompt's blocks, then the one decoding fills"
        );
        assert_eq!(st[0].0.len(), 4);
        assert_eq!(st[0].2, tokens(0, 16));
        assert_eq!(e.cached_prefix_tokens(&prompt, None), 16);
        let s = e.stats();
        assert_eq!(
            (s.prefix_cache_queries_tokens, s.prefix_cache_hits_tokens),
            (18, 0)
        );
        assert_eq!(
            (
                s.external_prefix_cache_queries_tokens,
                s.external_prefix_cache_hits_tokens
            ),
            (18, 17)
        );
        assert_eq!(s.prompt_tokens_total, 18);
        // The GPU's own hit comes first; the transfer covers the rest.
        e.submit_with(10.0, request(2, &prompt, 1), received(18))
            .unwrap();
        assert_eq!(first_token(&run(&mut e), 2).1, 17);
        let s = e.stats();
        assert_eq!(s.prefix_cache_hits_tokens, 16);
        assert_eq!(s.external_prefix_cache_queries_tokens, 18 + 2);
        assert_eq!(s.external_prefix_cache_hits_tokens, 17 + 1);
        // Less KV than prompt: the rest is computed; more: capped at the prompt.
        let mut e = Engine::new(small(1000));
        e.submit_with(0.0, request(1, &prompt, 1), received(8))
            .unwrap();
        assert!((e.next_event_time().unwrap() - (0.010 + 0.010)).abs() < 1e-12);
        assert_eq!(first_token(&run(&mut e), 1).1, 8);
        assert_eq!(
            e.stats().external_prefix_cache_queries_tokens,
            0,
            "no connector: no external counters"
        );
        let mut e = Engine::new(small(1000));
        e.submit_with(0.0, request(1, &tokens(0, 5), 1), received(500))
            .unwrap();
        assert_eq!(first_token(&run(&mut e), 1).1, 4);
    }
}
