//! KV cache events as vLLM and SGLang publish them (see replica-interfaces.md section 1).
//!
//! The types here are shared by the simulated replica (which encodes and publishes them) and
//! by the balancer's telemetry (which decodes them). Hashes are opaque 64-bit ids whatever the
//! wire form (unsigned, signed or 32-byte digests): the engine hash only links parents and
//! applies removals; content identity comes from `token_ids`.
//!
//! `encode` writes batches as vLLM 0.33 does (map or positional events); `decode` reads every
//! variant vLLM and SGLang send, one event at a time (an event it cannot read is kept as
//! `KvEvent::Undecodable` and the rest of the batch stands); `kvlb_zmtp::publisher` is the
//! engine side over ZeroMQ (PUB + replay ROUTER) plus the balancer's `replay` client;
//! `reference_hash` recomputes engine block ids where a fleet pins a reproducible scheme.

#![forbid(unsafe_code)]

pub mod decode;
pub mod encode;
pub mod reference_hash;

pub use decode::{decode_batch, DecodeError};
pub use encode::encode_batch;

#[cfg(test)]
mod codec_tests;

/// Where a block lives. Anything other than `Gpu` is an offloaded tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    Gpu,
    Cpu,
    CpuPinned,
    Disk,
    Storage,
    External,
    /// A medium name this build does not know; treated as an offloaded tier.
    Other,
}

impl Medium {
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::CpuPinned => "CPU_PINNED",
            Medium::Disk => "DISK",
            Medium::Storage => "STORAGE",
            Medium::External => "EXTERNAL",
            Medium::Other => "OTHER",
        }
    }

    pub fn parse(s: &str) -> Medium {
        match s {
            "GPU" | "gpu" => Medium::Gpu,
            "CPU" | "cpu" => Medium::Cpu,
            "CPU_PINNED" | "cpu_pinned" => Medium::CpuPinned,
            "DISK" | "disk" => Medium::Disk,
            "STORAGE" | "storage" => Medium::Storage,
            "EXTERNAL" | "external" => Medium::External,
            _ => Medium::Other,
        }
    }
}

/// One KV cache event. `token_ids` are the raw tokens whichever form the engine sent them
/// in: plain ids, or SGLang's EAGLE bigrams `(t_j, t_{j+1})`, whose first elements are the raw
/// sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// `block_hashes.len()` consecutive full blocks; `token_ids` holds
    /// `block_hashes.len() * block_size` tokens; `parent_block_hash` is the block before the
    /// first one (None at the start of a prompt).
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<Medium>,
        /// What else names the blocks: adapter, salt, keys no request can name.
        key: BlockKey,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<Medium>,
    },
    AllBlocksCleared,
    /// An event of the batch that could not be read (why, and where in the payload); the
    /// batch's other events stand. The encoder writes nothing for it.
    Undecodable(DecodeError),
}

/// What names a stored block besides its tokens: the parts of vLLM's block hash extra keys and
/// of SGLang's cache namespace that a request also names (its adapter and its cache salt), and
/// where keys begin that no request names (multimodal items, prompt embeddings).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockKey {
    /// The LoRA adapter the blocks were computed with (`lora_name`, vLLM and SGLang).
    pub lora_name: Option<String>,
    /// The salt of the request that stored them: SGLang's `cache_salt`; for vLLM the string
    /// its first block's `extra_keys` holds after the adapter name and the multimodal pairs
    /// (vLLM salts only a prompt's block 0). Never empty: an empty salt is none.
    pub cache_salt: Option<String>,
    /// The first block whose `extra_keys` hold a multimodal `(identifier, offset)` pair or a
    /// prompt-embeddings digest: its hash, and every later one, covers what a request's text or
    /// token ids do not.
    pub opaque_from: Option<u32>,
}

/// One published batch: `[ts, events, dp_rank]` on the wire.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch, as the engine's clock reads.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub dp_rank: Option<i64>,
}

/// Which event encoding a publisher uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventFormat {
    /// msgpack maps tagged by a "type" key (vLLM >= 0.24, SGLang >= 2026-09), byte for byte
    /// what vLLM 0.33's msgspec classes write: every field without a default present, nil
    /// included (a prompt's first block has `parent_block_hash` nil). The default.
    Map,
    /// positional arrays with the tag first (older engines).
    Array,
    /// the keys of `Map`, nil values included, in the smallest map headers (msgspec writes
    /// BlockStored's with a 16-bit one): the form vllm-router 0.1.17's `kv_aware` was checked
    /// against.
    MapNil,
}
