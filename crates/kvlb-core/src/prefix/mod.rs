//! Prompt prefix -> fixed-size blocks with chained 64-bit hashes. Pure, no I/O, and no
//! allocation per request: a worker keeps one [`PrefixHashes`] whose buffers are sized once;
//! [`hash_request`] clears and refills it (the hash vector's capacity never changes once warm,
//! the block buffer is a fixed array).
//!
//! A block's hash covers the block and, through its parent, everything before it:
//! `hash_i = xxh3_64_with_seed(xxh3_64(block_i) as 8 LE bytes, hash_{i-1})`, with `hash_{-1}` a
//! fixed root per mode. (Seeding the block hash itself with the parent would do as well, but
//! xxh3 derives a fresh 192-byte secret from the seed for inputs over 240 bytes: hashing the
//! block unseeded and folding the parent into its 8-byte digest halves the cost, 3.4 -> 2.0 us
//! per 32 KiB here.)
//! Two prompts share their first `k` hashes exactly when they share their first `k` blocks, so
//! the longest run of a request's hashes that a replica holds is its cached prefix. Only full
//! blocks are hashed; the partial tail counts in [`PrefixHashes::total_units`] but has no hash.
//!
//! # Text mode: [`BLOCK_BYTES`] = 256 canonical bytes
//! Chat bodies and text completions are hashed over the canonical bytes that
//! [`crate::prompt`] extracts (model, salt, tools, then messages or prompt text). 256 bytes is about 64 tokens (3-4 bytes per token for English and
//! code). Why not finer: vLLM's KV blocks are 16 tokens, but what the balancer needs is not
//! the engine's page but "how much of this prompt would prefill be spared"; a miss at block
//! granularity misjudges at most one block (~64 tokens, well under a millisecond of prefill),
//! while 4x finer blocks would mean 4x the hashes, lookups and index memory per request (a
//! 32 KiB prompt is 128 hashes here, 512 at 64 bytes). Why not coarser: a short shared system
//! prompt (a few hundred bytes) must still be seen, and the divergence point of two
//! conversations is lost to within one block. sglang-router's character radix tree has exact
//! resolution but pays 15-18 us per request and kilobytes per leaf; a fixed block and a hash
//! probe per block keep the lookup at memory speed.
//!
//! A text prompt is hashed up to [`PrefixConfig::text_blocks`] blocks, the ones routing learns
//! ([`MAX_ROUTED_BLOCKS`]): no text block past them is ever resident. The extraction stops
//! there as at a full sink, and the rest of the prompt is measured from the body's bytes after
//! the last piece hashed ([`PrefixHashes::tail_estimated`]), not counted as cut short.
//!
//! # Token mode: `block_size` token ids (default 16)
//! A completions `prompt` given as token ids is hashed in blocks of
//! [`PrefixConfig::token_block_size`] ids, each id as 4 little-endian bytes, chained from
//! [`TOKEN_CHAIN_ROOT`]. [`token_block_hashes`] is the same function for the `token_ids` of KV
//! cache events, so a `BlockStored` block and a token-mode request name equal tokens with equal
//! hashes (engine hashes themselves cannot be recomputed; see replica-interfaces.md section 1).
//! A prompt's first block chains from [`token_root`] of the LoRA adapter its `model` names
//! and its `cache_salt` (see `identity`): the same root a KV event's adapter and salt give,
//! [`TOKEN_CHAIN_ROOT`] for the base model without a salt. Since `model` and `cache_salt` may
//! follow the prompt in the body, the sink keeps each token block's digest and the chain steps
//! run once the body is read.
//!
//! # Cost
//! `benches/routing.rs`, fastest samples (criterion's `sample.json`) on the 2-core build
//! machine under load, AMD EPYC with AVX-512: a 32 KiB chat body (8k tokens of prose, 16
//! messages, keys sorted) is extracted and cut into 128 block hashes in about 4.0 us
//! (`full_path_part_hash_request_32k_chat`; 5.0 us before the chain step was written out, the
//! AVX-512 block hash added and content-before-role messages read once). The hashing is about
//! 1 us of that: each block costs its 256-byte XXH3 (AVX-512: the eight accumulators are one
//! register; AVX2 otherwise) plus the chain step, whose ~18-cycle dependency from parent to
//! child is the floor of a chained hash. Whole blocks are hashed straight from the body; only
//! a block that straddles pieces is copied into the block buffer. `benches/prefix.rs` adds
//! JSON-escaped code (an escape every 18 bytes), slower to decode. The counting allocator sees
//! zero allocations over 1000 warm requests.

#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

// SIMD (AVX2, AVX-512) xxh3 of whole blocks, behind runtime CPU feature checks: calling a
// `#[target_feature]` function is unsafe. The one module of prefix that may use it.
#[allow(unsafe_code)]
mod block_hash;
mod identity;
#[cfg(test)]
mod tests;

pub use identity::{name_hash, token_root, AdapterNames, Learned};

use crate::models::ModelName;
use crate::prompt::{
    extract_prompt_within, Bound, Endpoint, Extent, Field, Piece, PromptError, PromptForm,
    PromptLimits, PromptScratch, PromptSink,
};
use crate::residency::MAX_ROUTED_BLOCKS;
use std::sync::Arc;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Canonical bytes per text-mode block (see the module header for the choice).
pub const BLOCK_BYTES: usize = 256;
/// Default cap on hashed blocks per request: 1 MiB of text or 64k tokens at the defaults
/// (`kvlb serve` sizes it from `max_prompt_tokens`). The prompt beyond it still counts in
/// `total_units`.
pub const MAX_BLOCKS: usize = 4096;
/// Default token-mode block: vLLM's and SGLang's usual KV block (page) size.
pub const DEFAULT_TOKEN_BLOCK: u32 = 16;
/// Largest token-mode block accepted (the fixed block buffer holds this many ids).
pub const MAX_TOKEN_BLOCK: u32 = 1024;
/// Parent of the first block of a text-mode prompt.
pub const TEXT_CHAIN_ROOT: u64 = u64::from_be_bytes(*b"kvlbtext");
/// Parent of the first block of a token-mode prompt (and of a KV event with no parent).
pub const TOKEN_CHAIN_ROOT: u64 = u64::from_be_bytes(*b"kvlbtokn");

const BLOCK_BUFFER: usize = MAX_TOKEN_BLOCK as usize * 4;
const _: () = assert!(BLOCK_BUFFER >= BLOCK_BYTES);

/// How requests are cut into blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Token ids per block in token mode; must match the engines' KV block size for token-mode
    /// requests to line up with KV events. 1..=[`MAX_TOKEN_BLOCK`].
    pub token_block_size: u32,
    /// Blocks hashed per request at most.
    pub max_blocks: usize,
    /// Text-mode blocks hashed at most, however long the prompt: routing learns a request's
    /// first [`MAX_ROUTED_BLOCKS`] blocks and no text-mode block is resident otherwise, so a
    /// block past them is never found. The rest of such a prompt is skimmed and measured, not
    /// read: see [`PrefixHashes::tail_estimated`]. Token mode hashes up to `max_blocks`, since
    /// KV events name every block a replica stores.
    pub text_blocks: usize,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            token_block_size: DEFAULT_TOKEN_BLOCK,
            max_blocks: MAX_BLOCKS,
            text_blocks: MAX_ROUTED_BLOCKS,
        }
    }
}

impl PrefixConfig {
    /// Checks the values, naming the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if self.token_block_size == 0 || self.token_block_size > MAX_TOKEN_BLOCK {
            return Err(format!(
                "token_block_size = {}: must be 1..={MAX_TOKEN_BLOCK} (the engines' KV block size, usually 16)",
                self.token_block_size
            ));
        }
        if self.text_blocks == 0 {
            return Err(format!(
                "text_blocks = 0: must be at least 1 (default {MAX_ROUTED_BLOCKS})"
            ));
        }
        if self.max_blocks == 0 || self.max_blocks > 1 << 20 {
            return Err(format!(
                "max_blocks = {}: must be 1..={} (default {MAX_BLOCKS})",
                self.max_blocks,
                1 << 20
            ));
        }
        Ok(())
    }

    /// Token block size as used: out-of-range values are clamped, never a panic.
    fn token_block(&self) -> usize {
        self.token_block_size.clamp(1, MAX_TOKEN_BLOCK) as usize
    }
}

/// What the blocks of a request are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixMode {
    /// [`BLOCK_BYTES`] canonical text bytes per block.
    Text,
    /// `token_block_size` token ids per block.
    Tokens,
}

/// One request's prefix, in a per-worker buffer reused across requests.
pub struct PrefixHashes {
    pub mode: PrefixMode,
    /// Chained hashes of the full blocks, first block first (at most `max_blocks`).
    pub hashes: Vec<u64>,
    /// Bytes (text mode) or token ids (token mode) per block.
    pub block_units: u32,
    /// Length of the whole prompt in bytes or tokens, tail and uncapped blocks included.
    pub total_units: usize,
    /// Prompt tokens: exact in token mode, canonical bytes / 4 in text mode (for a prompt a
    /// bound cut short, the body's length / 4 when that is more).
    pub est_prompt_tokens: u32,
    /// How much of the prompt was read (see [`hash_request_within`]).
    pub extent: Extent,
    /// A text-mode prompt ran past [`PrefixConfig::text_blocks`]: its blocks were hashed up to
    /// them and the rest of the body was skimmed, not read. `total_units` and
    /// `est_prompt_tokens` count the canonical bytes read plus the body's bytes after the last
    /// piece hashed. `extent` stays [`Extent::Whole`] (no bound stopped it: routing has every
    /// block it can use) unless that count passes `max_tokens`: then [`Bound::Tokens`], as when
    /// the prompt is read that far.
    pub tail_estimated: bool,
    /// The parent of the first token-mode block: [`token_root`] of the adapter the request's
    /// `model` names and its `cache_salt` (set in either mode, for a caller that hashes the
    /// prompt's tokens itself, as with a tokenizer).
    pub token_root: u64,
    /// The request's decoded `model` (routing by model reads it; empty when none).
    pub model: ModelName,
    /// The adapter names requests are checked against (none: every model is a base model).
    adapters: Option<Arc<AdapterNames>>,
    /// The block being filled, when pieces do not end on a block boundary.
    block: Box<[u8; BLOCK_BUFFER]>,
    /// Where extraction records the messages during its first pass.
    scratch: PromptScratch,
}

/// Pieces of a conversation recorded in one pass (see [`extract_prompt_with`]): a run of text
/// and an escape are two, so this holds ~4000 escapes, far more than a 32 KiB body of code.
const RECORDED_PIECES: usize = 8192;

impl PrefixHashes {
    /// Buffers for requests under `cfg`: the only allocation; later requests reuse them.
    pub fn new(cfg: &PrefixConfig) -> PrefixHashes {
        PrefixHashes {
            mode: PrefixMode::Text,
            hashes: Vec::with_capacity(cfg.max_blocks),
            block_units: BLOCK_BYTES as u32,
            total_units: 0,
            est_prompt_tokens: 0,
            extent: Extent::Whole,
            tail_estimated: false,
            token_root: TOKEN_CHAIN_ROOT,
            model: ModelName::default(),
            adapters: None,
            block: Box::new([0u8; BLOCK_BUFFER]),
            scratch: PromptScratch::new(RECORDED_PIECES),
        }
    }

    /// Checks requests' `model` against `adapters` from now on.
    pub fn set_adapters(&mut self, adapters: Arc<AdapterNames>) {
        self.adapters = Some(adapters);
    }

    /// Forgets the last request (capacity and adapters are kept).
    pub fn clear(&mut self) {
        self.mode = PrefixMode::Text;
        self.hashes.clear();
        self.block_units = BLOCK_BYTES as u32;
        self.total_units = 0;
        self.est_prompt_tokens = 0;
        self.extent = Extent::Whole;
        self.tail_estimated = false;
        self.token_root = TOKEN_CHAIN_ROOT;
        self.model.clear();
    }
}

/// Hash of one block given its parent's hash (see the module header).
#[inline]
pub fn chain_hash(parent: u64, block: &[u8]) -> u64 {
    block_hash::chain_step(parent, block_digest(block))
}

/// xxh3 of one block, before the chain step folds in its parent.
#[inline]
fn block_digest(block: &[u8]) -> u64 {
    match <&[u8; BLOCK_BYTES]>::try_from(block) {
        Ok(text_block) => block_hash::xxh3_64_block(text_block),
        Err(_) => xxh3_64(block),
    }
}

/// Appends to `out` the chained hashes of the full `block_size`-token blocks of `tokens`, from
/// the start of a prompt: exactly the hashes a token-mode request with these ids gets. The
/// partial tail is ignored; `block_size` outside 1..=[`MAX_TOKEN_BLOCK`] yields nothing.
pub fn token_block_hashes(tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    token_block_hashes_from(TOKEN_CHAIN_ROOT, tokens, block_size, out);
}

/// As [`token_block_hashes`], continuing a chain whose last block hashed to `parent` (for a KV
/// event whose `parent_block_hash` is a known block).
pub fn token_block_hashes_from(parent: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    if block_size == 0 || block_size > MAX_TOKEN_BLOCK as usize {
        return;
    }
    let mut bytes = [0u8; BLOCK_BUFFER];
    let mut hash = parent;
    for block in tokens.chunks_exact(block_size) {
        for (slot, id) in bytes.chunks_exact_mut(4).zip(block) {
            slot.copy_from_slice(&id.to_le_bytes());
        }
        hash = chain_hash(hash, &bytes[..block_size * 4]);
        out.push(hash);
    }
}

/// Appends to `out` the chained text-mode hashes of `canonical` (canonical prompt bytes, as
/// `prompt::extract_prompt` emits them), full blocks only.
pub fn text_block_hashes(canonical: &[u8], out: &mut Vec<u64>) {
    block_hash::chain_blocks(TEXT_CHAIN_ROOT, canonical, out, usize::MAX);
}

/// Extracts the canonical prefix of an OpenAI request and hashes it into `out`.
///
/// `path` picks the endpoint (`/v1/completions` or `/v1/chat/completions`, query ignored);
/// other paths are `Err(NotAPromptPath)`. On `Err`, `out` is cleared. Allocates nothing once
/// `out` has served a request under the same `cfg.max_blocks`. Reads the whole body, however
/// long: a server bounds the work with [`hash_request_within`].
pub fn hash_request(
    path: &[u8],
    body: &[u8],
    cfg: &PrefixConfig,
    out: &mut PrefixHashes,
) -> Result<(), PromptError> {
    hash_request_within(path, body, cfg, &PromptLimits::UNLIMITED, out)
}

/// [`hash_request`] within `limits` ([`crate::prompt::extract_prompt_within`]): `out.extent`
/// says whether a bound stopped the extraction. With [`Extent::Prefix`], `out` holds the
/// blocks of the prompt's first part, at most `limits.max_tokens` worth (`total_units` counts
/// what was read); with [`Extent::Unknown`] it holds nothing, as after an error.
pub fn hash_request_within(
    path: &[u8],
    body: &[u8],
    cfg: &PrefixConfig,
    limits: &PromptLimits,
    out: &mut PrefixHashes,
) -> Result<(), PromptError> {
    out.clear();
    let endpoint = Endpoint::from_path(path).ok_or(PromptError::NotAPromptPath)?;
    let token_block = cfg.token_block();
    // Exactly the blocks of the first `max_tokens` (4 bytes a token); the extraction stops at
    // its next check once they are hashed (`PromptSink::full`).
    let bound_blocks = cfg
        .max_blocks
        .min(limits.max_tokens.saturating_mul(4) / BLOCK_BYTES);
    // Fewer blocks than the bounds allow: a stop there is no bound's, only routing's.
    let routed_stop = cfg.text_blocks < bound_blocks;
    let body_at = body.as_ptr() as usize;
    let mut chain = BlockChain {
        hashes: &mut out.hashes,
        block: &mut out.block,
        fill: 0,
        token_block_bytes: token_block * 4,
        text_hash: TEXT_CHAIN_ROOT,
        max_blocks: cfg.max_blocks,
        max_text_blocks: bound_blocks.min(cfg.text_blocks),
        units: 0,
        body: (body_at, body_at + body.len()),
        mark: None,
        model: &mut out.model,
        salt: None,
        lora_path: None,
    };
    let result = extract_prompt_within(endpoint, body, &mut out.scratch, limits, &mut chain);
    // The adapter `model` names, else SGLang's explicit `lora_path`.
    let lora = match (&out.adapters, chain.model.get()) {
        (Some(names), Some(model)) => names.adapter_of(model).map(name_hash),
        _ => None,
    }
    .or_else(|| chain.lora_path.as_ref().map(|h| h.digest()));
    let salt = chain.salt.as_ref().map(|s| s.digest());
    match result {
        Ok((_, extent @ Extent::Unknown(_))) => {
            out.clear();
            out.extent = extent;
            Ok(())
        }
        Ok((form, mut extent)) => {
            let mut units = chain.units;
            if form == PromptForm::Text && extent == Extent::Prefix(Bound::Tokens) && routed_stop {
                // Stopped at the blocks routing uses: the body's bytes after the last piece
                // hashed stand for the rest of the prompt, at the same 4 bytes a token (JSON
                // escapes and the fields after the prompt make it a little more).
                units = match chain.mark {
                    Some((read, at)) => read.saturating_add(body.len().saturating_sub(at)),
                    None => units.max(body.len()),
                };
                extent = Extent::Whole;
                out.tail_estimated = true;
            }
            if form == PromptForm::Text && units > limits.max_tokens.saturating_mul(4) {
                // Read whole (a last string past the bound), hashed up to it.
                extent = Extent::Prefix(Bound::Tokens);
            }
            out.total_units = units;
            out.token_root = token_root(lora, salt);
            if form == PromptForm::Tokens {
                // The sink kept each block's digest: chain them from the root the adapter and
                // the salt give, known only once the body was read.
                let mut hash = out.token_root;
                for h in out.hashes.iter_mut() {
                    hash = block_hash::chain_step(hash, *h);
                    *h = hash;
                }
            }
            let (mode, block_units, tokens) = match form {
                PromptForm::Text => (PrefixMode::Text, BLOCK_BYTES as u32, units / 4),
                PromptForm::Tokens => (PrefixMode::Tokens, token_block as u32, units),
            };
            let tokens = match (form, extent) {
                // The rest of the body stands for the rest of the prompt, as for a body that
                // is no prompt.
                (PromptForm::Text, Extent::Prefix(_)) => tokens.max(body.len() / 4),
                _ => tokens,
            };
            out.mode = mode;
            out.block_units = block_units;
            out.est_prompt_tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
            out.extent = extent;
            Ok(())
        }
        Err(e) => {
            out.clear();
            Err(e)
        }
    }
}

/// `dst.copy_from_slice(src)` for the short pieces text arrives in (runs between escapes,
/// decoded escapes, markers) without a call to `memcpy`: two overlapping fixed-size moves.
#[inline(always)]
fn copy_small(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    if n != dst.len() {
        return;
    }
    match n {
        0 => {}
        1..=3 => {
            dst[0] = src[0];
            dst[n / 2] = src[n / 2];
            dst[n - 1] = src[n - 1];
        }
        4..=7 => {
            let mut a = [0u8; 4];
            let mut b = [0u8; 4];
            a.copy_from_slice(&src[..4]);
            b.copy_from_slice(&src[n - 4..]);
            dst[..4].copy_from_slice(&a);
            dst[n - 4..].copy_from_slice(&b);
        }
        8..=16 => {
            let mut a = [0u8; 8];
            let mut b = [0u8; 8];
            a.copy_from_slice(&src[..8]);
            b.copy_from_slice(&src[n - 8..]);
            dst[..8].copy_from_slice(&a);
            dst[n - 8..].copy_from_slice(&b);
        }
        17..=32 => {
            let mut a = [0u8; 16];
            let mut b = [0u8; 16];
            a.copy_from_slice(&src[..16]);
            b.copy_from_slice(&src[n - 16..]);
            dst[..16].copy_from_slice(&a);
            dst[n - 16..].copy_from_slice(&b);
        }
        _ => dst.copy_from_slice(src),
    }
}

/// The sink that cuts the piece stream into blocks and chains their hashes.
struct BlockChain<'a> {
    hashes: &'a mut Vec<u64>,
    block: &'a mut [u8; BLOCK_BUFFER],
    /// Bytes of `block` holding the current partial block.
    fill: usize,
    token_block_bytes: usize,
    /// Last text-mode hash (the parent of the next block).
    text_hash: u64,
    max_blocks: usize,
    /// Text-mode blocks hashed at most (at most `max_blocks`).
    max_text_blocks: usize,
    /// Bytes or tokens seen, whether hashed or not.
    units: usize,
    /// The body's address range, to tell its pieces from decoded ones.
    body: (usize, usize),
    /// At the last piece from the body that completed a text block: `units` with it, and
    /// the body offset just after it (where the prompt read so far ends in the body).
    mark: Option<(usize, usize)>,
    /// The decoded `model` (past [`crate::models::MODEL_BYTES`]: longer than any adapter
    /// name kept, so none).
    model: &'a mut ModelName,
    /// The decoded `cache_salt` and `lora_path`, hashed as they come.
    salt: Option<Xxh3>,
    lora_path: Option<Xxh3>,
}

impl BlockChain<'_> {
    #[inline]
    fn tokens_full(&self) -> bool {
        self.hashes.len() >= self.max_blocks
    }

    #[inline]
    fn text_full(&self) -> bool {
        self.hashes.len() >= self.max_text_blocks
    }

    /// Appends text; most pieces are small and only land in the partial block.
    #[inline(always)]
    fn text(&mut self, bytes: &[u8]) {
        self.units += bytes.len();
        let fill = self.fill;
        let end = fill + bytes.len();
        if end < BLOCK_BYTES {
            // Past the block cap the partial block still fills but is never hashed.
            copy_small(&mut self.block[fill..end], bytes);
            self.fill = end;
        } else {
            self.text_blocks(bytes);
        }
    }

    /// Appends text that completes at least one block.
    #[inline(never)]
    fn text_blocks(&mut self, mut bytes: &[u8]) {
        if self.text_full() {
            self.fill = 0;
            return;
        }
        let end = bytes.as_ptr() as usize + bytes.len();
        if end > self.body.0 && end <= self.body.1 {
            self.mark = Some((self.units, end - self.body.0));
        }
        let fill = self.fill;
        if fill > 0 {
            let (head, rest) = bytes.split_at(BLOCK_BYTES - fill);
            self.block[fill..BLOCK_BYTES].copy_from_slice(head);
            self.text_hash = chain_hash(self.text_hash, &self.block[..BLOCK_BYTES]);
            self.hashes.push(self.text_hash);
            self.fill = 0;
            bytes = rest;
        }
        // Whole blocks straight from the body, no copy (most pieces of escaped text hold none).
        if bytes.len() >= BLOCK_BYTES {
            let (hash, used) =
                block_hash::chain_blocks(self.text_hash, bytes, self.hashes, self.max_text_blocks);
            self.text_hash = hash;
            bytes = &bytes[used..];
        }
        if self.text_full() {
            self.fill = 0;
        } else {
            self.block[..bytes.len()].copy_from_slice(bytes);
            self.fill = bytes.len();
        }
    }

    #[inline]
    fn token(&mut self, id: u32) {
        self.units += 1;
        if self.tokens_full() {
            return;
        }
        let fill = self.fill;
        self.block[fill..fill + 4].copy_from_slice(&id.to_le_bytes());
        self.fill = fill + 4;
        if self.fill == self.token_block_bytes {
            // The digest only: the chain's root is known once the body is read.
            self.hashes
                .push(block_digest(&self.block[..self.token_block_bytes]));
            self.fill = 0;
        }
    }
}

impl PromptSink for BlockChain<'_> {
    #[inline(always)]
    fn piece(&mut self, piece: Piece<'_>) {
        match piece {
            Piece::Text(bytes) => self.text(bytes),
            Piece::Token(id) => self.token(id),
        }
    }

    #[inline]
    fn field(&mut self, field: Field, piece: &[u8]) {
        match field {
            Field::Model => self.model.push(piece),
            // An empty salt is none, to vLLM and SGLang alike.
            Field::CacheSalt if piece.is_empty() => {}
            Field::CacheSalt => self.salt.get_or_insert_with(Xxh3::new).update(piece),
            Field::LoraPath if piece.is_empty() => {}
            Field::LoraPath => self.lora_path.get_or_insert_with(Xxh3::new).update(piece),
        }
    }

    /// Text past its last block: the extraction may stop.
    #[inline(always)]
    fn full(&self) -> bool {
        self.text_full()
    }
}
