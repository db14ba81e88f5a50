//! One replica's KV event stream -> residency operations in kvlb's own block hashes.
//!
//! `EventState` is the pure part (no I/O, no clock): it checks sequence numbers and keeps the
//! map from engine block hash to kvlb block hash (with copy counts) that resolves
//! `parent_block_hash` and later removals. `run` is the I/O part: connect a SUB socket (kvlb
//! connects, the engine's PUB binds), subscribe to every topic, read `[topic, seq, payload]`
//! messages, fill gaps by replay, reconnect with backoff when the publisher goes away.
//!
//! Each operation carries the `Tier` of its event's `medium`. The engine-hash map is shared by
//! the tiers, with a copy count per tier: a hash stored on GPU and CPU keeps resolving parents
//! and removals while any medium holds it, and a BlockRemoved drops a copy of its own tier
//! only (a removal on a tier that holds no copy changes nothing).
//!
//! # Copies, duplicates and reuse reports
//! vLLM does not de-duplicate its cache (`BlockHashToBlockMap`, NOTE #1): a block filled again
//! with the same content (a request that computed a prefix without looking it up, two
//! identical prompts in one step, a decode that rebuilt a cached block) is a second physical
//! block under the same hash, and each is removed by its own BlockRemoved. So a BlockStored
//! normally adds one copy. In `kv_cache_report_mode = "full"` (per request, so a stream mixes
//! both modes) vLLM also re-sends BlockStored on a prefix-cache hit for the reused blocks,
//! which adds nothing inside vLLM: counted as copies, they would outlive the engine's
//! removals and stay phantom hits for ever. Such a reuse report always has no parent and
//! covers blocks 0..k of the prompt, all cached; a genuine store continuing a cached prefix
//! always names its parent. The rule: in a BlockStored without parent, a block already held
//! on that tier is a refresh (`ResidencyOp::Touch`: most recently used, no copy), any other
//! block a new copy; after a parent every block is a new copy. Reuse reports are then exact,
//! and so is every store after a parent. The one residual error is a genuine duplicate from
//! the prompt's start (the cases above, when the duplicate chain starts at block 0 and the
//! first copy is still held): kvlb counts one copy where the engine has two, so the first
//! removal drops the block while the engine still holds the other copy. That errs toward a
//! missed hit, never a phantom one, and heals: the next full-mode hit on the block re-reports
//! it, and a block kvlb no longer holds counts as a new copy again. `reuse_reports` and
//! `refreshed_blocks` in /replicas count them.
//!
//! # Block sizes
//! kvlb hashes token-mode prompts in blocks of `token_block_size` tokens (B); engines publish
//! their own page size (b) in each BlockStored: 16 for vLLM by default, 1 for SGLang's default
//! page size (one event of N one-token pages, chained across events by `parent_block_hash`),
//! smaller entries for vLLM's partial blocks, 32, 64... Each engine hash in the chain map keeps
//! the token offset at which its page ends, so pages are placed in kvlb's blocks wherever the
//! events cut them:
//! * b a multiple of B: one engine block is b / B kvlb blocks, stored and removed together
//!   (copies counted as for b = B).
//! * B a multiple of b: a kvlb block is resident on a tier while each of its B / b pages holds
//!   a copy there. The page that ends it (its owner) is what the residency writer sees: one
//!   Insert when the block becomes whole, one Remove when any page of it loses its last copy
//!   (a duplicate page keeps it), an Insert again if that page comes back. Pages inside a
//!   block keep their parent, the block's first page (`anchor`, under which `owners` lists the
//!   blocks ending through it: prompts that diverge inside a kvlb block each own one) and
//!   their tokens (inline for one-token pages), so a page from a later event can hash the
//!   block it completes. A page removed inside a block rechecks that block's owners by
//!   walking each back to the block's start (at most B / b steps).
//! * Neither divides, or a page that would straddle kvlb's blocks (mixed sizes in one chain):
//!   skipped, counted in `skipped_block_size`, logged with the batch's other faults.
//!
//! Each replica's first event of each size is logged, and /replicas shows the largest usable
//! size as `engine_block_size`. Memory stays bounded by `MAX_CHAIN_BLOCKS` entries (40 bytes
//! each plus the map's key), one per engine page: with one-token pages, one per cached token.
//! Cost, measured by `a_long_one_token_page_store_is_cheap` (release build, the shared 2-core
//! build machine, fastest of 5): a 32k-token store of one-token pages applies in 1.1-2.2 ms
//! (35-70 us per 1000 tokens: a map insert per page, the kvlb hash per 16 tokens), and the
//! removal of all its pages in 1.5-2.2 ms.
//!
//! See the parent module for why only token-mode requests match the hashes produced here.

#![forbid(unsafe_code)]

use super::{ReplicaTelemetry, ResidencyOp, Tier};
use crate::kv_events::{decode_batch, BlockKey, KvEvent, KvEventBatch, Medium};
use crate::log_limit::LogLimit;
use crate::prefix::token_block_hashes_from;
use crate::prefix::{name_hash, token_root, AdapterNames, Learned};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// Engine blocks remembered per replica; beyond this the map (and the replica's residency) is
/// dropped rather than grow without bound on a stream that never removes.
pub const MAX_CHAIN_BLOCKS: usize = 4 << 20;

/// What a replay request returned: the kept batches with their sequence numbers.
pub type ReplayAnswer = std::io::Result<Vec<(u64, KvEventBatch)>>;

/// Where a message's sequence number stands against the last one applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// Nothing applied yet (first message ever).
    First,
    /// The next one expected.
    InOrder,
    /// Batches `from..to` are missing (`to` is this message's number).
    Gap { from: u64, to: u64 },
    /// Not after the last one: the engine restarted and numbers from 0 again.
    Backwards,
}

/// A kind of fault in a replica's event stream; `run` logs each kind at most once a second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trouble {
    /// A message that is no readable batch (not applied).
    Decode,
    /// Events of an applied batch that were skipped (unreadable, block size, malformed,
    /// unknown parent).
    Skipped,
    /// A sequence gap, filled by replay or not.
    Gap,
    /// The sequence went backwards.
    Restart,
    /// A replay on joining a running stream failed.
    Replay,
    /// A batch of another data-parallel rank (not applied).
    WrongRank,
}

impl Trouble {
    pub(super) fn limit(self) -> &'static LogLimit {
        static LIMITS: [LogLimit; 6] = [
            LogLimit::new(),
            LogLimit::new(),
            LogLimit::new(),
            LogLimit::new(),
            LogLimit::new(),
            LogLimit::new(),
        ];
        &LIMITS[self as usize]
    }
}

/// Hashes the engine's block hashes for the chain map: one seeded multiply-fold per key instead
/// of SipHash's rounds. The hashes come off the wire, so the seed is random per process: a
/// replica cannot pick ids that pile into one bucket.
#[derive(Clone, Copy)]
struct EngineHashState(u64);

impl EngineHashState {
    fn new() -> EngineHashState {
        let s = std::collections::hash_map::RandomState::new();
        EngineHashState(s.hash_one(0x6b76_6c62u64) | 1)
    }
}

impl BuildHasher for EngineHashState {
    type Hasher = EngineHasher;
    fn build_hasher(&self) -> EngineHasher {
        EngineHasher { seed: self.0, v: 0 }
    }
}

struct EngineHasher {
    seed: u64,
    v: u64,
}

impl Hasher for EngineHasher {
    fn finish(&self) -> u64 {
        let p = ((self.v ^ self.seed) as u128) * (0x9e37_79b9_7f4a_7c15u128 ^ self.seed as u128);
        (p as u64) ^ ((p >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.v = self.v.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.v = v;
    }
}

/// One engine block (a page of `len` tokens ending `end` tokens after the prompt's start).
///
/// `kvlb` is the hash of the last kvlb block that ends at or before `end`: the kvlb block
/// itself for a page that ends one (the last of them for a page of several), the chain root of
/// the kvlb block being filled for a page inside one. Pages smaller than kvlb's block
/// (aggregated, see the module header) also keep their parent, the first page of their kvlb
/// block (`anchor`) and, for one-token pages, their token: what a later page needs to hash
/// the kvlb block they share.
#[derive(Debug, Clone, Copy)]
struct ChainEntry {
    kvlb: u64,
    parent: u64,
    anchor: u64,
    end: u32,
    token: u32,
    /// Copies the engine reported on each tier (`tier_slot`).
    copies: [u16; 2],
    len: u16,
    flags: u8,
}

const _: () = assert!(std::mem::size_of::<ChainEntry>() == 40);

/// `ChainEntry::flags`: the entry has a parent.
const HAS_PARENT: u8 = 1;
/// `ChainEntry::flags`: an aggregated kvlb block ending at this page is resident on the tier
/// (`COMPLETE << tier_slot`): every page of it holds a copy there.
const COMPLETE: u8 = 2;

/// Index of a tier in `ChainEntry::copies`.
fn tier_slot(tier: Tier) -> usize {
    match tier {
        Tier::Gpu => 0,
        Tier::Offloaded => 1,
    }
}

/// Block sizes of one replica logged on first sight; skips of other sizes are logged with the
/// batch's other faults (`apply_noting`).
const MAX_SIZES_LOGGED: usize = 16;

/// Whether engine pages of `b` tokens fit kvlb's blocks of `bb`: one divides the other.
fn usable_block_size(b: u32, bb: u32) -> bool {
    b > 0 && b <= u16::MAX as u32 && (bb.is_multiple_of(b) || b.is_multiple_of(bb))
}

/// One replica's view of its event stream.
pub struct EventState {
    replica: usize,
    token_block_size: usize,
    last_seq: Option<u64>,
    chain: HashMap<u64, ChainEntry, EngineHashState>,
    /// Of pages smaller than kvlb's block, those that end one (owners), by the engine hash of
    /// the first page of that block: the kvlb blocks a removal inside the block may end.
    owners: HashMap<u64, Vec<u64>, EngineHashState>,
    /// Tokens of pages of 2 or more tokens that end inside a kvlb block (pages of one token
    /// keep theirs in the entry).
    page_tokens: HashMap<u64, Box<[u32]>, EngineHashState>,
    /// The kvlb hashes of pages that are several kvlb blocks (all but the last are only here).
    spans: HashMap<u64, Box<[u64]>, EngineHashState>,
    /// Block sizes seen (each logged once).
    sizes_seen: Vec<u32>,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
    walk: Vec<u64>,
    recheck: Vec<u64>,
    /// What went wrong in the messages received since `take_troubles`, for `run` to log.
    troubles: Vec<(Trouble, String)>,
    /// Where the adapter names of stored blocks are learned (None: not kept).
    adapters: Option<Arc<AdapterNames>>,
    /// The data-parallel rank whose stream this is (None: any `data_parallel_rank` is taken,
    /// as from an engine that is one rank of an externally balanced DP deployment).
    rank: Option<u32>,
}

/// A BlockStored's fields, as `EventState::stored` takes them.
struct Stored<'a> {
    block_hashes: &'a [u64],
    parent: Option<u64>,
    token_ids: &'a [u32],
    block_size: u32,
    medium: Option<Medium>,
    lora_id: Option<i64>,
    key: &'a BlockKey,
}

impl EventState {
    /// `token_block_size`: kvlb's token-mode block. Events in pages of another size are
    /// aggregated or split into kvlb blocks when one size divides the other, else skipped.
    pub fn new(replica: usize, token_block_size: u32) -> EventState {
        let h = EngineHashState::new();
        EventState {
            replica,
            token_block_size: token_block_size as usize,
            last_seq: None,
            chain: HashMap::with_hasher(h),
            owners: HashMap::with_hasher(h),
            page_tokens: HashMap::with_hasher(h),
            spans: HashMap::with_hasher(h),
            sizes_seen: Vec::new(),
            hashes: Vec::new(),
            tokens: Vec::new(),
            walk: Vec::new(),
            recheck: Vec::new(),
            troubles: Vec::new(),
            adapters: None,
            rank: None,
        }
    }

    /// Learn the adapter name of every block stored under one into `adapters`, for requests
    /// whose `model` names it.
    pub fn learn_adapters(&mut self, adapters: Arc<AdapterNames>) {
        self.adapters = Some(adapters);
    }

    /// Only batches of data-parallel rank `rank` (or without a rank) are applied; others are
    /// counted in `wrong_rank` and noted.
    pub fn with_rank(mut self, rank: Option<u32>) -> EventState {
        self.rank = rank;
        self
    }

    pub fn check_seq(&self, seq: u64) -> SeqCheck {
        match self.last_seq {
            None => SeqCheck::First,
            Some(last) if seq == last.wrapping_add(1) => SeqCheck::InOrder,
            Some(last) if seq > last => SeqCheck::Gap {
                from: last + 1,
                to: seq,
            },
            Some(_) => SeqCheck::Backwards,
        }
    }

    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Engine blocks currently known.
    pub fn known_blocks(&self) -> usize {
        self.chain.len()
    }

    /// Forget every block (the replica's residency is being cleared) and emit the Clear.
    pub fn clear(&mut self, ops: &mut Vec<ResidencyOp>) {
        self.chain.clear();
        self.owners.clear();
        self.page_tokens.clear();
        self.spans.clear();
        ops.push(ResidencyOp::Clear {
            replica: self.replica,
        });
    }

    /// Apply batch `seq` (already checked): push its residency operations to `ops`, count
    /// what it skipped in `tel`. Returns the number of events applied.
    pub fn apply(
        &mut self,
        seq: u64,
        batch: &KvEventBatch,
        tel: &ReplicaTelemetry,
        ops: &mut Vec<ResidencyOp>,
    ) -> usize {
        self.last_seq = Some(seq);
        for event in &batch.events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    medium,
                    lora_id,
                    key,
                } => self.stored(
                    Stored {
                        block_hashes,
                        parent: *parent_block_hash,
                        token_ids,
                        block_size: *block_size,
                        medium: *medium,
                        lora_id: *lora_id,
                        key,
                    },
                    tel,
                    ops,
                ),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => self.removed(block_hashes, Tier::of(*medium), ops),
                KvEvent::AllBlocksCleared => self.clear(ops),
                // Counted and reported by `receive`.
                KvEvent::Undecodable(_) => {}
            }
        }
        batch.events.len()
    }

    /// A BlockRemoved: one copy fewer of each page on `tier`.
    fn removed(&mut self, block_hashes: &[u64], tier: Tier, ops: &mut Vec<ResidencyOp>) {
        let t = tier_slot(tier);
        let bb = self.token_block_size;
        let mut blocks = Vec::with_capacity(block_hashes.len());
        self.recheck.clear();
        for h in block_hashes {
            let Some(e) = self.chain.get_mut(h) else {
                continue;
            };
            // A copy on another medium only: nothing to drop on this one.
            if e.copies[t] == 0 {
                continue;
            }
            e.copies[t] -= 1;
            let e = *e;
            if e.len as usize >= bb {
                // Whole kvlb blocks: one copy of each.
                match self.spans.get(h) {
                    Some(span) => blocks.extend_from_slice(span),
                    None => blocks.push(e.kvlb),
                }
            } else if e.copies[t] == 0 {
                // The last copy of a page: every kvlb block through it is gone.
                let owner = (e.end as usize).is_multiple_of(bb);
                if owner && e.flags & (COMPLETE << t) != 0 {
                    blocks.push(e.kvlb);
                    if let Some(x) = self.chain.get_mut(h) {
                        x.flags &= !(COMPLETE << t);
                    }
                }
                if self.owners.contains_key(&e.anchor) && self.recheck.last() != Some(&e.anchor) {
                    self.recheck.push(e.anchor);
                }
            }
            if e.copies == [0, 0] {
                self.forget(*h, &e);
            }
        }
        let mut fresh = Vec::new();
        for k in 0..self.recheck.len() {
            let anchor = self.recheck[k];
            self.recheck_owners(anchor, t, &mut fresh, &mut blocks);
        }
        self.push_ops(tier, fresh, Vec::new(), blocks, ops);
    }

    /// Drop page `h` (no copy left on any tier) and what hangs on it.
    fn forget(&mut self, h: u64, e: &ChainEntry) {
        self.chain.remove(&h);
        if (e.len as usize) < self.token_block_size {
            if (e.end as usize).is_multiple_of(self.token_block_size) {
                if let Some(list) = self.owners.get_mut(&e.anchor) {
                    list.retain(|&o| o != h);
                    if list.is_empty() {
                        self.owners.remove(&e.anchor);
                    }
                }
            } else if e.len > 1 {
                self.page_tokens.remove(&h);
            }
        } else if e.len as usize > self.token_block_size {
            self.spans.remove(&h);
        }
    }

    /// Whether the aggregated kvlb block ending at page `owner` has a copy of each of its
    /// pages on tier `t` (its pages all known).
    fn owner_complete(&self, owner: u64, t: usize) -> bool {
        let Some(e) = self.chain.get(&owner) else {
            return false;
        };
        let mut e = *e;
        let mut need = self.token_block_size;
        loop {
            if e.copies[t] == 0 {
                return false;
            }
            need = need.saturating_sub(e.len as usize);
            if need == 0 {
                return true;
            }
            if e.flags & HAS_PARENT == 0 {
                return false;
            }
            match self.chain.get(&e.parent) {
                Some(p) => e = *p,
                None => return false,
            }
        }
    }

    /// Bring the owners of the kvlb blocks starting at page `anchor` up to date on tier `t`
    /// (a page inside them was removed or stored again): Insert those now whole, Remove those
    /// no longer.
    fn recheck_owners(&mut self, anchor: u64, t: usize, ins: &mut Vec<u64>, rem: &mut Vec<u64>) {
        let Some(list) = self.owners.get_mut(&anchor) else {
            return;
        };
        let list = std::mem::take(list);
        for &o in &list {
            let complete = self.owner_complete(o, t);
            if let Some(e) = self.chain.get_mut(&o) {
                let was = e.flags & (COMPLETE << t) != 0;
                if complete && !was {
                    e.flags |= COMPLETE << t;
                    ins.push(e.kvlb);
                } else if !complete && was {
                    e.flags &= !(COMPLETE << t);
                    rem.push(e.kvlb);
                }
            }
        }
        if let Some(slot) = self.owners.get_mut(&anchor) {
            *slot = list;
        }
    }

    /// Push the operations of one event: new copies, then refreshed blocks (most recent
    /// last), then removed ones.
    fn push_ops(
        &self,
        tier: Tier,
        fresh: Vec<u64>,
        refreshed: Vec<u64>,
        removed: Vec<u64>,
        ops: &mut Vec<ResidencyOp>,
    ) {
        let replica = self.replica;
        if !fresh.is_empty() {
            ops.push(ResidencyOp::Insert {
                replica,
                tier,
                blocks: fresh,
            });
        }
        if !refreshed.is_empty() {
            ops.push(ResidencyOp::Touch {
                replica,
                tier,
                blocks: refreshed,
            });
        }
        if !removed.is_empty() {
            ops.push(ResidencyOp::Remove {
                replica,
                tier,
                blocks: removed,
            });
        }
    }

    /// Note a BlockStored's block size: published, and logged the first time (per replica
    /// and size). Returns whether kvlb can use it.
    fn note_block_size(&mut self, b: u32, tel: &ReplicaTelemetry) -> bool {
        let bb = self.token_block_size as u32;
        let usable = usable_block_size(b, bb);
        if usable {
            tel.engine_block_size.fetch_max(b as u64, Relaxed);
        }
        if self.sizes_seen.len() < MAX_SIZES_LOGGED && !self.sizes_seen.contains(&b) {
            self.sizes_seen.push(b);
            let how = if !usable {
                "neither size divides the other: these events are skipped (skipped_block_size)"
                    .to_string()
            } else if b == bb {
                "the same as kvlb's".to_string()
            } else if b < bb {
                format!("{} pages make one kvlb block", bb / b)
            } else {
                format!("one page is {} kvlb blocks", b / bb)
            };
            eprintln!(
                "kvlb: replica slot {}: KV events in blocks of {b} tokens (kvlb's token block: \
                 {bb}): {how}",
                self.replica
            );
        }
        usable
    }

    /// The root a prompt's first block chains from: the adapter and salt of the event
    /// (see `crate::prefix::token_root`). An adapter known only by `lora_id` (engines before
    /// `lora_name`) gets a root of its own that no request names.
    fn root_of(key: &BlockKey, lora_id: Option<i64>) -> u64 {
        let lora = match (&key.lora_name, lora_id) {
            (Some(name), _) => Some(name_hash(name.as_bytes())),
            (None, Some(id)) => Some(name_hash(format!("\0lora_id\0{id}").as_bytes())),
            (None, None) => None,
        };
        let salt = key.cache_salt.as_deref().map(|s| name_hash(s.as_bytes()));
        token_root(lora, salt)
    }

    fn learn(&mut self, name: &str) {
        let Some(adapters) = &self.adapters else {
            return;
        };
        match adapters.insert(name.as_bytes()) {
            Learned::Known => {}
            Learned::New => eprintln!(
                "kvlb: replica slot {}: KV events of LoRA adapter {name:?}: requests whose \
                 model names it match its blocks only",
                self.replica
            ),
            Learned::Full => self.trouble(
                Trouble::Skipped,
                format!(
                    "LoRA adapter {name:?} not learned: {} adapter names are known already; \
                     its requests match base-model blocks",
                    AdapterNames::CAPACITY
                ),
            ),
        }
    }

    fn stored(&mut self, event: Stored<'_>, tel: &ReplicaTelemetry, ops: &mut Vec<ResidencyOp>) {
        let Stored {
            mut block_hashes,
            parent,
            mut token_ids,
            block_size,
            medium,
            lora_id,
            key,
        } = event;
        if !self.note_block_size(block_size, tel) {
            tel.skipped_block_size.fetch_add(1, Relaxed);
            return;
        }
        let b = block_size as usize;
        let bb = self.token_block_size;
        let mut n = block_hashes.len();
        if n == 0 || token_ids.len() != n * b {
            tel.skipped_malformed.fetch_add(1, Relaxed);
            return;
        }
        if let Some(name) = &key.lora_name {
            // Continuations carry the adapter too: learn it whichever event comes first.
            self.learn(name);
            tel.adapter_blocks.fetch_add(n as u64, Relaxed);
        }
        if let Some(k) = key.opaque_from {
            // Hashed with multimodal items or prompt embeddings no request's tokens name: not
            // kept (their children then have an unknown parent and are skipped too).
            let k = (k as usize).min(n);
            tel.skipped_multimodal.fetch_add((n - k) as u64, Relaxed);
            if k == 0 {
                return;
            }
            n = k;
            block_hashes = &block_hashes[..n];
            token_ids = &token_ids[..n * b];
        }
        let (start, root) = match parent {
            None => {
                if key.cache_salt.is_some() {
                    tel.salted_blocks.fetch_add(n as u64, Relaxed);
                }
                (0, Self::root_of(key, lora_id))
            }
            Some(p) => match self.chain.get(&p) {
                Some(e) => (e.end as usize, e.kvlb),
                None => {
                    tel.skipped_unknown_parent.fetch_add(1, Relaxed);
                    return;
                }
            },
        };
        if start + n * b > u32::MAX as usize {
            tel.skipped_malformed.fetch_add(1, Relaxed);
            return;
        }
        // Pages must not straddle kvlb blocks: a page of whole blocks starts on a boundary, a
        // smaller one on a multiple of its size (mixed sizes may break either).
        if start % b.min(bb) != 0 || (b > bb && start % bb != 0) {
            tel.skipped_block_size.fetch_add(1, Relaxed);
            return;
        }
        if self.chain.len() + n > MAX_CHAIN_BLOCKS {
            // A stream that stores without ever removing: start over rather than grow. The
            // parent's hash is known already; pages that need the tokens before it in their
            // kvlb block are skipped as of an unknown parent.
            self.clear(ops);
        }
        let tier = Tier::of(medium);
        if b >= bb {
            self.stored_blocks(
                block_hashes,
                parent,
                token_ids,
                b,
                start,
                root,
                tier,
                tel,
                ops,
            );
        } else {
            self.stored_pages(
                block_hashes,
                parent,
                token_ids,
                b,
                start,
                root,
                tier,
                tel,
                ops,
            );
        }
    }

    /// A BlockStored of pages of whole kvlb blocks (`b` a multiple of kvlb's block).
    #[allow(clippy::too_many_arguments)]
    fn stored_blocks(
        &mut self,
        block_hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        b: usize,
        start: usize,
        root: u64,
        tier: Tier,
        tel: &ReplicaTelemetry,
        ops: &mut Vec<ResidencyOp>,
    ) {
        let bb = self.token_block_size;
        let k = b / bb;
        self.hashes.clear();
        token_block_hashes_from(root, token_ids, bb, &mut self.hashes);
        if self.hashes.len() != block_hashes.len() * k {
            tel.skipped_malformed.fetch_add(1, Relaxed);
            return;
        }
        let t = tier_slot(tier);
        // From the prompt's start (no parent), a block already held on this medium is a
        // refresh, not a copy (see the module header); after a parent, every block is one.
        let from_start = parent.is_none();
        let mut fresh = Vec::with_capacity(self.hashes.len());
        let mut refreshed = Vec::new();
        let mut prev = parent;
        for (i, &engine) in block_hashes.iter().enumerate() {
            let span = &self.hashes[i * k..(i + 1) * k];
            let e = self.chain.entry(engine).or_insert(ChainEntry {
                kvlb: 0,
                parent: 0,
                anchor: engine,
                end: 0,
                token: 0,
                copies: [0, 0],
                len: 0,
                flags: 0,
            });
            e.kvlb = span[k - 1];
            e.parent = prev.unwrap_or(0);
            e.flags = if prev.is_some() { HAS_PARENT } else { 0 };
            e.end = (start + (i + 1) * b) as u32;
            e.len = b as u16;
            if from_start && e.copies[t] > 0 {
                refreshed.extend_from_slice(span);
            } else {
                e.copies[t] = e.copies[t].saturating_add(1);
                fresh.extend_from_slice(span);
            }
            if k > 1 && !self.spans.contains_key(&engine) {
                self.spans.insert(engine, span.into());
            }
            prev = Some(engine);
        }
        self.count_stored(tier, fresh.len(), refreshed.len(), tel);
        self.push_ops(tier, fresh, refreshed, Vec::new(), ops);
    }

    fn count_stored(&self, tier: Tier, fresh: usize, refreshed: usize, tel: &ReplicaTelemetry) {
        if tier == Tier::Offloaded {
            tel.offloaded_blocks.fetch_add(fresh as u64, Relaxed);
        }
        if refreshed > 0 {
            tel.refreshed_blocks.fetch_add(refreshed as u64, Relaxed);
            if fresh == 0 {
                tel.reuse_reports.fetch_add(1, Relaxed);
            }
        }
    }

    /// A BlockStored of pages smaller than kvlb's block (`b` divides it): a kvlb block is
    /// resident while each of its pages holds a copy (see the module header).
    #[allow(clippy::too_many_arguments)]
    fn stored_pages(
        &mut self,
        block_hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        b: usize,
        start: usize,
        root: u64,
        tier: Tier,
        tel: &ReplicaTelemetry,
        ops: &mut Vec<ResidencyOp>,
    ) {
        let bb = self.token_block_size;
        let t = tier_slot(tier);
        // The pages before `start` in the kvlb block it falls in: their tokens, whether each
        // holds a copy on this tier, and the block's first page.
        let off = start % bb;
        let mut first_complete = true;
        let mut anchor = block_hashes[0];
        self.tokens.clear();
        if off > 0 {
            self.walk.clear();
            let mut h = parent.unwrap_or(0);
            let mut need = off;
            while need > 0 {
                let Some(e) = self.chain.get(&h) else {
                    tel.skipped_unknown_parent.fetch_add(1, Relaxed);
                    return;
                };
                if e.len as usize > need || (e.flags & HAS_PARENT == 0 && need > e.len as usize) {
                    tel.skipped_malformed.fetch_add(1, Relaxed);
                    return;
                }
                first_complete &= e.copies[t] > 0;
                self.walk.push(h);
                need -= e.len as usize;
                anchor = h;
                h = e.parent;
            }
            for &h in self.walk.iter().rev() {
                let e = &self.chain[&h];
                if e.len == 1 {
                    self.tokens.push(e.token);
                } else if let Some(tokens) = self.page_tokens.get(&h) {
                    self.tokens.extend_from_slice(tokens);
                } else {
                    tel.skipped_unknown_parent.fetch_add(1, Relaxed);
                    return;
                }
            }
        }
        self.tokens.extend_from_slice(token_ids);
        self.hashes.clear();
        token_block_hashes_from(root, &self.tokens, bb, &mut self.hashes);
        let from_start = parent.is_none();
        let mut fresh = Vec::new();
        let mut refreshed = Vec::new();
        let mut refreshed_pages = 0;
        let mut fresh_pages = 0;
        self.recheck.clear();
        let mut prev = parent;
        for (i, &engine) in block_hashes.iter().enumerate() {
            // Where the page starts in the tokens hashed (the first kvlb block's start is 0).
            let pos = off + i * b;
            let blk = pos / bb;
            if pos.is_multiple_of(bb) {
                anchor = engine;
            }
            let owner = (pos + b).is_multiple_of(bb);
            let kvlb = if owner {
                self.hashes[blk]
            } else if blk == 0 {
                root
            } else {
                self.hashes[blk - 1]
            };
            let e = self.chain.entry(engine).or_insert(ChainEntry {
                kvlb: 0,
                parent: 0,
                anchor,
                end: 0,
                token: 0,
                copies: [0, 0],
                len: 0,
                flags: 0,
            });
            let is_new = e.len == 0;
            e.kvlb = kvlb;
            e.parent = prev.unwrap_or(0);
            e.flags = (e.flags & !HAS_PARENT) | if prev.is_some() { HAS_PARENT } else { 0 };
            e.anchor = anchor;
            e.end = (start + (i + 1) * b) as u32;
            e.len = b as u16;
            e.token = if b == 1 { token_ids[i] } else { 0 };
            let was_zero = e.copies[t] == 0;
            if from_start && !was_zero {
                refreshed_pages += 1;
            } else {
                e.copies[t] = e.copies[t].saturating_add(1);
                fresh_pages += 1;
            }
            if owner {
                // Whole when every page holds a copy: those of this event do now; those before
                // it were checked in the walk.
                let complete = blk > 0 || off == 0 || first_complete;
                let done = e.flags & (COMPLETE << t) != 0;
                if complete && done {
                    refreshed.push(kvlb);
                } else if complete {
                    e.flags |= COMPLETE << t;
                    fresh.push(kvlb);
                }
                if is_new {
                    self.owners.entry(anchor).or_default().push(engine);
                }
            } else {
                if b > 1 && !self.page_tokens.contains_key(&engine) {
                    let tokens = &token_ids[i * b..(i + 1) * b];
                    self.page_tokens.insert(engine, tokens.into());
                }
                // A page stored again inside kvlb blocks already known: they may be whole
                // again.
                if was_zero
                    && self.recheck.last() != Some(&anchor)
                    && self.owners.contains_key(&anchor)
                {
                    self.recheck.push(anchor);
                }
            }
            prev = Some(engine);
        }
        let mut removed = Vec::new();
        for k in 0..self.recheck.len() {
            let anchor = self.recheck[k];
            self.recheck_owners(anchor, t, &mut fresh, &mut removed);
        }
        if tier == Tier::Offloaded {
            tel.offloaded_blocks.fetch_add(fresh.len() as u64, Relaxed);
        }
        if refreshed_pages > 0 {
            tel.refreshed_blocks
                .fetch_add(refreshed_pages as u64, Relaxed);
            if fresh_pages == 0 {
                tel.reuse_reports.fetch_add(1, Relaxed);
            }
        }
        self.push_ops(tier, fresh, refreshed, removed, ops);
    }

    /// What went wrong since the last call, each with the line that says so (without the
    /// replica's name), oldest first.
    pub fn take_troubles(&mut self) -> std::vec::Drain<'_, (Trouble, String)> {
        self.troubles.drain(..)
    }

    fn trouble(&mut self, kind: Trouble, line: String) {
        self.troubles.push((kind, line));
    }

    /// `apply`, noting what it skipped: the events the decoder could not read (counted here)
    /// and the stores `apply` refused (counted there). Returns the events applied.
    fn apply_noting(
        &mut self,
        seq: u64,
        batch: &KvEventBatch,
        tel: &ReplicaTelemetry,
        ops: &mut Vec<ResidencyOp>,
    ) -> usize {
        let before = [
            tel.skipped_block_size.load(Relaxed),
            tel.skipped_malformed.load(Relaxed),
            tel.skipped_unknown_parent.load(Relaxed),
            tel.skipped_multimodal.load(Relaxed),
        ];
        let applied = self.apply(seq, batch, tel, ops);
        // One line per batch and reason however many events it skipped: a hostile stream
        // cannot make kvlb format a line per event.
        let skipped = batch
            .events
            .iter()
            .filter(|e| matches!(e, KvEvent::Undecodable(_)))
            .count();
        let first = batch.events.iter().find_map(|e| match e {
            KvEvent::Undecodable(e) => Some(e),
            _ => None,
        });
        if let Some(first) = first {
            tel.skipped_undecodable.fetch_add(skipped as u64, Relaxed);
            let line = if skipped == 1 {
                format!("batch {seq}: skipped {}", first.message())
            } else {
                format!(
                    "batch {seq}: skipped {skipped} events it could not read, the first {}",
                    first.message()
                )
            };
            self.trouble(Trouble::Skipped, line);
        }
        let after = [
            tel.skipped_block_size.load(Relaxed),
            tel.skipped_malformed.load(Relaxed),
            tel.skipped_unknown_parent.load(Relaxed),
            tel.skipped_multimodal.load(Relaxed),
        ];
        let n = |i: usize| after[i].saturating_sub(before[i]);
        if n(0) > 0 {
            let bb = self.token_block_size as u32;
            let unusable = batch.events.iter().find_map(|e| match e {
                KvEvent::BlockStored { block_size, .. } if !usable_block_size(*block_size, bb) => {
                    Some(*block_size)
                }
                _ => None,
            });
            let why = match unusable {
                Some(b) => format!("blocks of {b} tokens, neither a multiple nor a divisor of it"),
                None => "pages that would straddle its blocks".to_string(),
            };
            self.trouble(
                Trouble::Skipped,
                format!(
                    "batch {seq}: skipped {} BlockStored that do not fit kvlb's {bb}-token \
                     blocks ({why})",
                    n(0)
                ),
            );
        }
        if n(1) > 0 {
            self.trouble(
                Trouble::Skipped,
                format!(
                    "batch {seq}: skipped {} malformed BlockStored (no block, or token_ids not \
                     block_size per block)",
                    n(1)
                ),
            );
        }
        if n(2) > 0 {
            self.trouble(
                Trouble::Skipped,
                format!(
                    "batch {seq}: skipped {} BlockStored whose parent block kvlb does not know",
                    n(2)
                ),
            );
        }
        if n(3) > 0 {
            self.trouble(
                Trouble::Skipped,
                format!(
                    "batch {seq}: skipped {} blocks hashed with multimodal items or prompt \
                     embeddings (their extra_keys), which no request's tokens name",
                    n(3)
                ),
            );
        }
        applied.saturating_sub(skipped)
    }

    /// Take one received message: check its number, replay or clear as needed, apply it.
    /// `replay(from)` fetches the kept batches from `from` on (None: no replay configured).
    /// What went wrong is counted in `tel` and noted for `take_troubles`.
    pub fn receive(
        &mut self,
        frames: &[Vec<u8>],
        tel: &ReplicaTelemetry,
        replay: &mut dyn FnMut(u64) -> Option<ReplayAnswer>,
        ops: &mut Vec<ResidencyOp>,
    ) -> Result<usize, String> {
        let (seq, payload) = match frames {
            [.., seq, payload] if seq.len() == 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(seq);
                (u64::from_be_bytes(b), payload)
            }
            _ => {
                tel.decode_errors.fetch_add(1, Relaxed);
                let e = format!(
                    "message of {} frames, want [topic, seq (8 bytes), payload]",
                    frames.len()
                );
                self.trouble(Trouble::Decode, format!("{e}; not applied"));
                return Err(e);
            }
        };
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                // Not applied: the next batch shows a gap, which replay or a clear handles.
                tel.decode_errors.fetch_add(1, Relaxed);
                let e = format!("batch {seq}: {e}");
                self.trouble(Trouble::Decode, format!("{e}; not applied"));
                return Err(e);
            }
        };
        if let (Some(want), Some(got)) = (self.rank, batch.dp_rank) {
            if got != i64::from(want) {
                // Not applied and not numbered: this rank's own batches, when they come, carry
                // on from the last one applied.
                tel.wrong_rank.fetch_add(1, Relaxed);
                let e = format!(
                    "batch {seq}: data_parallel_rank {got}, but this endpoint is rank {want}'s"
                );
                self.trouble(
                    Trouble::WrongRank,
                    format!("{e}; not applied (is kv_events rank 0's endpoint, with rank r on its port + r?)"),
                );
                return Err(e);
            }
        }
        let mut applied = 0;
        match self.check_seq(seq) {
            SeqCheck::InOrder => {
                tel.stale_gap.store(false, Relaxed);
            }
            SeqCheck::First => {
                // Joined a running stream: catch up on what the engine kept, if it can tell.
                if seq > 0 {
                    match replay(0) {
                        Some(Ok(kept)) => {
                            for (s, b) in kept.iter().filter(|(s, _)| *s < seq) {
                                applied += self.apply_noting(*s, b, tel, ops);
                            }
                        }
                        Some(Err(e)) => {
                            tel.replay_failures.fetch_add(1, Relaxed);
                            self.trouble(
                                Trouble::Replay,
                                format!(
                                    "joined at batch {seq}; replay of the earlier batches \
                                     failed: {e}"
                                ),
                            );
                        }
                        None => {}
                    }
                }
            }
            SeqCheck::Backwards => {
                tel.restarts.fetch_add(1, Relaxed);
                tel.stale_gap.store(false, Relaxed);
                let last = self.last_seq.unwrap_or(0);
                self.trouble(
                    Trouble::Restart,
                    format!(
                        "sequence went from {last} back to {seq} (engine restart); residency \
                         cleared"
                    ),
                );
                self.clear(ops);
            }
            SeqCheck::Gap { from, to } => {
                let missing_text = if to - from == 1 {
                    format!("batch {from} missing")
                } else {
                    format!("batches {from} to {} missing", to - 1)
                };
                let outcome = match replay(from) {
                    Some(Ok(kept)) => {
                        let missing: Vec<&(u64, KvEventBatch)> = kept
                            .iter()
                            .filter(|(s, _)| (from..to).contains(s))
                            .collect();
                        let complete = missing.len() as u64 == to - from
                            && missing.iter().zip(from..).all(|((s, _), want)| *s == want);
                        if complete {
                            for (s, b) in missing {
                                applied += self.apply_noting(*s, b, tel, ops);
                            }
                            tel.replays.fetch_add(1, Relaxed);
                            tel.stale_gap.store(false, Relaxed);
                            None
                        } else {
                            tel.replay_failures.fetch_add(1, Relaxed);
                            Some(format!(
                                "replay returned {} of the {} batches",
                                missing.len(),
                                to - from
                            ))
                        }
                    }
                    Some(Err(e)) => {
                        tel.replay_failures.fetch_add(1, Relaxed);
                        Some(format!("replay failed: {e}"))
                    }
                    None => Some("no replay endpoint".to_string()),
                };
                let line = match &outcome {
                    None => format!("{missing_text} (before batch {to}); replay filled the gap"),
                    Some(why) => {
                        format!("{missing_text} (before batch {to}); {why}; residency cleared")
                    }
                };
                self.trouble(Trouble::Gap, line);
                if outcome.is_some() {
                    self.clear(ops);
                    tel.stale_gap.store(true, Relaxed);
                }
                // Counted once the replica's state says what the gap did: a reader that sees
                // the count sees the stale mark (or the replay) too.
                tel.gaps.fetch_add(1, Relaxed);
            }
        }
        applied += self.apply_noting(seq, &batch, tel, ops);
        tel.batches_seen.fetch_add(1, Relaxed);
        tel.events_seen.fetch_add(applied as u64, Relaxed);
        Ok(applied)
    }
}

/// A replica's event endpoints.
#[derive(Debug, Clone)]
pub struct EventSource {
    pub replica: usize,
    pub endpoint: String,
    pub replay: Option<String>,
    pub token_block_size: u32,
    /// The data-parallel rank of the slot (`ReplicaConfig::dp_rank`).
    pub rank: Option<u32>,
}

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an idle event connection counts as a sign of life (replicas not scraped).
pub const RECV_SLICE: Duration = Duration::from_millis(200);
/// After applying what had arrived, the telemetry loop sleeps this long before it waits for
/// more:
/// an engine publishes a batch per scheduler step (a hundred a second and more), and waking
/// for each costs more than the batch itself. Residency learns of stores and evictions at
/// most this much later; kvlb's own routing, which the workers record at once, is not
/// delayed.
pub const EVENT_GATHER: Duration = Duration::from_millis(20);
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How long connections to an event endpoint are refused, while the replica's /metrics
/// answers, before the log says that the engine may be connecting instead of binding.
pub const REFUSED_HINT_AFTER_MS: u64 = 5_000;

/// Whether refused connections since `refused_since_ms` call for the bind-or-connect hint
/// at `now_ms`: they have lasted `REFUSED_HINT_AFTER_MS`, and a scrape of the replica's
/// /metrics succeeded meanwhile (`last_metrics_ms`, 0 for never), so the engine is up. An
/// engine given `tcp://HOST:PORT` connects its PUB socket to that address, and kvlb's
/// connection to the same address is refused for as long as both run.
pub fn refusal_needs_hint(refused_since_ms: u64, now_ms: u64, last_metrics_ms: u64) -> bool {
    now_ms.saturating_sub(refused_since_ms) >= REFUSED_HINT_AFTER_MS
        && last_metrics_ms >= refused_since_ms
        && last_metrics_ms > 0
}
