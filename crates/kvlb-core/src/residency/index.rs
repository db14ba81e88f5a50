//! `ResidencyIndex` (the read side every worker shares) and `ResidencyWriter` (the one
//! control-thread owner of the truth: per-replica counts, LRU order, capacity and pending
//! marks).

#![forbid(unsafe_code)]

use super::table::{
    decode, inline_id, inline_len, BitTable, Holders, ID_LIMIT, INLINE, MIN_ROWS, MIN_SLOTS,
};
use crate::lru::LruList;
use arc_swap::ArcSwap;
use hashbrown::HashTable;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Most replicas one index tracks (replica ids are 12 bits in the shared table).
pub const MAX_REPLICAS: usize = ID_LIMIT;

/// How long a routed block may stay pending (see `ResidencyWriter::route`) unless
/// `set_pending_ttl` says otherwise: the default `routed_guess_ttl`, the age at which the
/// guesses routing alone made expire on replicas with KV events.
pub const DEFAULT_PENDING_TTL: Duration = Duration::from_secs(120);

/// Sizing of a residency index.
#[derive(Debug, Clone, PartialEq)]
pub struct ResidencyConfig {
    /// Replicas tracked, 1..=4096 (indices 0..max_replicas). Fixes the width of the
    /// shared table's overflow rows (blocks held by more than a few replicas).
    pub max_replicas: usize,
    /// Prompt tokens one block hash covers (the prefix hasher's block size).
    pub block_tokens: u32,
    /// KV cache capacity of a replica in tokens, unless `set_capacity_tokens` says otherwise
    /// (default 400,000: the simulated 8B-on-H100 engine).
    pub kv_capacity_tokens: u64,
}

impl Default for ResidencyConfig {
    fn default() -> ResidencyConfig {
        ResidencyConfig {
            max_replicas: 64,
            block_tokens: 64,
            kv_capacity_tokens: 400_000,
        }
    }
}

impl ResidencyConfig {
    /// Check the sizing; the error names the field and its bad value.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_REPLICAS).contains(&self.max_replicas) {
            return Err(format!(
                "residency max_replicas must be 1..={MAX_REPLICAS} (replica ids are 12 bits in \
                 the shared table), got {}",
                self.max_replicas
            ));
        }
        if self.block_tokens == 0 {
            return Err("residency block_tokens must be at least 1, got 0".into());
        }
        if self.kv_capacity_tokens < self.block_tokens as u64 {
            return Err(format!(
                "residency kv_capacity_tokens must hold one block of {} tokens, got {}",
                self.block_tokens, self.kv_capacity_tokens
            ));
        }
        Ok(())
    }

    fn capacity_blocks(&self, tokens: u64) -> usize {
        (tokens / self.block_tokens.max(1) as u64).max(1) as usize
    }
}

/// Which replicas hold which prefix blocks. Shared (`Arc`) by every worker: reads take no lock
/// and allocate nothing. Only the paired `ResidencyWriter` changes it.
pub struct ResidencyIndex {
    table: ArcSwap<BitTable>,
    max_replicas: usize,
    replica_blocks: Box<[AtomicUsize]>,
    /// Of those, the blocks the replica reported (KV events); the rest are routing guesses.
    reported_blocks: Box<[AtomicUsize]>,
    bytes: AtomicUsize,
    table_bytes: AtomicUsize,
    distinct: AtomicUsize,
    rebuilds: AtomicU64,
}

impl ResidencyIndex {
    /// A new empty index and its only writer.
    pub fn new(cfg: ResidencyConfig) -> Result<(Arc<ResidencyIndex>, ResidencyWriter), String> {
        cfg.validate()?;
        let words = cfg.max_replicas.div_ceil(64);
        let table = BitTable::new(MIN_SLOTS, words, MIN_ROWS);
        let index = Arc::new(ResidencyIndex {
            max_replicas: cfg.max_replicas,
            replica_blocks: (0..cfg.max_replicas).map(|_| AtomicUsize::new(0)).collect(),
            reported_blocks: (0..cfg.max_replicas).map(|_| AtomicUsize::new(0)).collect(),
            bytes: AtomicUsize::new(0),
            table_bytes: AtomicUsize::new(0),
            distinct: AtomicUsize::new(0),
            rebuilds: AtomicU64::new(0),
            table: ArcSwap::from_pointee(table),
        });
        let cfg_replicas = cfg.max_replicas;
        let writer = ResidencyWriter {
            index: index.clone(),
            replicas: (0..cfg.max_replicas)
                .map(|_| ReplicaBlocks::new(cfg.kv_capacity_tokens))
                .collect(),
            reported_block_tokens: cfg.block_tokens,
            cfg,
            occupied: 0,
            live: 0,
            replica_bytes: vec![0; cfg_replicas],
            writer_bytes: 0,
            logs: Vec::new(),
            bell: Arc::new(super::WriterBell::default()),
            pending_ttl_us: DEFAULT_PENDING_TTL.as_micros() as u64,
            clock_us: 0,
        };
        writer.publish_bytes();
        Ok((index, writer))
    }

    pub fn max_replicas(&self) -> usize {
        self.max_replicas
    }

    /// For every replica `r < out.len()`, the number of leading blocks of `blocks` resident on
    /// `r`, in one pass over `blocks` that stops as soon as no replica holds the prefix so far.
    /// `out` entries past `max_replicas()` are 0. Lock-free, allocation-free.
    pub fn match_prefix(&self, blocks: &[u64], out: &mut [u32]) {
        out.fill(0);
        let n = out.len().min(self.max_replicas);
        self.match_each(blocks, n, |r, depth| {
            if let Some(o) = out.get_mut(r) {
                *o = depth;
            }
        });
    }

    /// The replicas `r < n` holding at least the first block of `blocks`, each with the number
    /// of leading blocks it holds, given to `emit(replica, blocks)` once each, in no particular
    /// order. The work grows with the prompt's length and with the replicas holding its first
    /// blocks, not with the fleet. Lock-free, allocation-free.
    pub fn match_each(&self, blocks: &[u64], n: usize, emit: impl FnMut(usize, u32)) {
        let n = n.min(self.max_replicas);
        if n == 0 || blocks.is_empty() {
            return;
        }
        let table = self.table.load();
        match_holders(&table, blocks, n, emit);
    }

    /// Blocks resident on replica `r` (0 for an unknown replica).
    pub fn replica_blocks(&self, r: usize) -> usize {
        self.replica_blocks
            .get(r)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Of `replica_blocks(r)`, those replica `r` reported itself (KV events); the others are
    /// kvlb's routing guesses.
    pub fn reported_blocks(&self, r: usize) -> usize {
        self.reported_blocks
            .get(r)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Distinct block hashes resident on at least one replica.
    pub fn distinct_blocks(&self) -> usize {
        self.distinct.load(Ordering::Relaxed)
    }

    /// Bytes held by the index: the shared table plus the writer's per-replica state.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes of the shared table alone (the part readers touch).
    pub fn table_bytes(&self) -> usize {
        self.table_bytes.load(Ordering::Relaxed)
    }

    /// Times the shared table was rebuilt (grown, shrunk or cleaned of dead slots).
    pub fn rebuilds(&self) -> u64 {
        self.rebuilds.load(Ordering::Relaxed)
    }
}

/// [`ResidencyIndex::match_each`]: the holders of the first block, then, block after block,
/// those of them still holding it. While the survivors are many (the first block's holders an
/// arena row) they are a bitmask ANDed with each block's row; the first block held inline by a
/// few replicas turns them into a list of at most `INLINE` ids, each then checked against the
/// next blocks' holders (a compare per inline id, one word of a row).
#[inline(always)]
fn match_holders(table: &BitTable, blocks: &[u64], n: usize, mut emit: impl FnMut(usize, u32)) {
    const AHEAD: usize = 16;
    for &h in blocks.iter().take(AHEAD) {
        table.prefetch(h);
    }
    let full = blocks.len().min(u32::MAX as usize) as u32;
    let mut ids = [0usize; INLINE];
    let mut len = 0;
    let mut i = 1;
    match decode(table.holders(blocks[0])) {
        Holders::Inline(w) => {
            for k in 0..inline_len(w) {
                let r = inline_id(w, k);
                if r < n {
                    ids[len] = r;
                    len += 1;
                }
            }
        }
        Holders::Row(row) => {
            let words = table.words().min(n.div_ceil(64));
            let mut alive = [0u64; ID_LIMIT / 64];
            for (w, (a, c)) in alive.iter_mut().zip(table.row(row)).enumerate().take(words) {
                let bits = (n - w * 64).min(64);
                let keep = if bits == 64 { !0 } else { (1u64 << bits) - 1 };
                *a = c.load(Ordering::Relaxed) & keep;
            }
            if alive.iter().all(|&a| a == 0) {
                return;
            }
            let emit_bits = |emit: &mut dyn FnMut(usize, u32), w: usize, mut bits: u64, d: u32| {
                while bits != 0 {
                    emit(w * 64 + bits.trailing_zeros() as usize, d);
                    bits &= bits - 1;
                }
            };
            loop {
                let Some(&h) = blocks.get(i) else {
                    for (w, &a) in alive.iter().enumerate().take(words) {
                        emit_bits(&mut emit, w, a, full);
                    }
                    return;
                };
                if let Some(&next) = blocks.get(i + AHEAD) {
                    table.prefetch(next);
                }
                match decode(table.holders(h)) {
                    Holders::Row(row) => {
                        let cells = table.row(row);
                        let mut any = 0;
                        for (w, a) in alive.iter_mut().enumerate().take(words) {
                            let kept = *a & cells.get(w).map_or(0, |c| c.load(Ordering::Relaxed));
                            emit_bits(&mut emit, w, *a & !kept, i as u32);
                            *a = kept;
                            any |= kept;
                        }
                        if any == 0 {
                            return;
                        }
                        i += 1;
                    }
                    Holders::Inline(word) => {
                        // At most INLINE survivors: move them to the list.
                        for k in 0..inline_len(word) {
                            let r = inline_id(word, k);
                            let (w, bit) = (r / 64, 1u64 << (r % 64));
                            if alive.get(w).is_some_and(|a| a & bit != 0) {
                                alive[w] &= !bit;
                                ids[len] = r;
                                len += 1;
                            }
                        }
                        for (w, &a) in alive.iter().enumerate().take(words) {
                            emit_bits(&mut emit, w, a, i as u32);
                        }
                        i += 1;
                        break;
                    }
                }
            }
        }
    }
    while len > 0 {
        let Some(&h) = blocks.get(i) else { break };
        if let Some(&next) = blocks.get(i + AHEAD) {
            table.prefetch(next);
        }
        let word = table.holders(h);
        let mut k = 0;
        while k < len {
            if table.has(word, ids[k]) {
                k += 1;
            } else {
                emit(ids[k], i as u32);
                len -= 1;
                ids[k] = ids[len];
            }
        }
        i += 1;
    }
    for &r in &ids[..len] {
        emit(r, full);
    }
}

/// One (replica, block) the writer knows of.
#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    /// Copies the replica reported (KV events); 0 when only routing says it is there.
    count: u32,
    /// 0, or the block is pending: a request for it was routed here after its last
    /// BlockStored, when the replica's store counter read `mark >> 1` (31 bits, wrapping; the
    /// low bit is set so that a mark is never 0). Lives in what was padding: no memory added.
    pending: u32,
    last_used_us: u64,
}

const _: () = assert!(std::mem::size_of::<Node>() == 24);

/// The pending mark of a replica whose store counter reads `stored`.
fn pending_mark(stored: u32) -> u32 {
    (stored << 1) | 1
}

/// Blocks stored on a replica (counter now `stored`) since `mark` was taken, modulo 2^31.
fn stored_since(stored: u32, mark: u32) -> u32 {
    pending_mark(stored).wrapping_sub(mark) >> 1
}

/// What an `apply` learns about its blocks.
#[derive(Clone, Copy, PartialEq)]
enum Learned {
    /// BlockStored: one more copy each, confirmed (no longer pending).
    Stored,
    /// A guess: refreshed or added without a copy, pending marks left as they are.
    Guessed,
    /// A request was routed there: a guess, and pending until the next BlockStored.
    Routed,
    /// The replica reported blocks it already holds (a reuse report): refreshed and confirmed
    /// with at least one copy, no copy added.
    Refreshed,
}

/// Block hashes are uniform already; mix once more so that sequential ids (traces, tests)
/// spread too. Much cheaper than SipHash on the writer's path.
#[inline]
fn mix(hash: u64) -> u64 {
    let x = hash.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^ (x >> 29)
}

/// A key of `ReplicaBlocks::map`: the node's index in its list, this bit set for the
/// confirmed list.
const CONFIRMED: u32 = 1 << 31;

/// The list a map key points into, and the node's index there.
fn list_of<'a>(
    guesses: &'a LruList<Node>,
    confirmed: &'a LruList<Node>,
    key: u32,
) -> (&'a LruList<Node>, u32) {
    if key & CONFIRMED != 0 {
        (confirmed, key & !CONFIRMED)
    } else {
        (guesses, key)
    }
}

/// A replica's resident blocks, in two LRU lists: **guesses** (no reported copy: routing alone
/// says they are there) and **confirmed** blocks (the replica reported at least one copy). Each
/// list is bounded on its own by the replica's capacity (`ResidencyWriter::bounds`): guesses
/// in blocks of the index's `block_tokens` (they model the engine's cache), confirmed blocks in
/// blocks of the engine's own size (`set_reported_block_tokens`: they leave when the engine
/// reports them removed, the bound only caps memory if removals are lost). Kept apart, a replica whose
/// events fill its confirmed list (token blocks) never pushes out the guesses of requests
/// hashed another way (text blocks of chat prompts without a tokenizer), and guesses age out
/// without a pass over the confirmed blocks.
struct ReplicaBlocks {
    /// The replica's KV capacity in tokens.
    capacity_tokens: u64,
    /// Node keys (see `CONFIRMED`) by the node's hash: 4 bytes a bucket (and a control byte),
    /// the hash itself read from the node.
    map: HashTable<u32>,
    guesses: LruList<Node>,
    confirmed: LruList<Node>,
    /// Blocks the replica reported stored (every copy), wrapping: the clock of pending marks.
    stored: u32,
}

impl ReplicaBlocks {
    fn new(capacity_tokens: u64) -> ReplicaBlocks {
        ReplicaBlocks {
            capacity_tokens,
            map: HashTable::new(),
            guesses: LruList::new(),
            confirmed: LruList::new(),
            stored: 0,
        }
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn bytes(&self) -> usize {
        // hashbrown: one control byte plus the u32 node key per bucket (`capacity` is 7/8 of
        // the buckets past 8).
        let buckets = match self.map.capacity() {
            0 => 0,
            c if c < 8 => (c + 1).next_power_of_two(),
            c => (c * 8 / 7).next_power_of_two(),
        };
        buckets * 5 + self.guesses.bytes() + self.confirmed.bytes()
    }

    /// The list a map key points into, and the node's index there.
    fn list(&self, key: u32) -> (&LruList<Node>, u32) {
        list_of(&self.guesses, &self.confirmed, key)
    }

    /// The key of the node holding `hash`, if any.
    fn get(&self, hash: u64) -> Option<u32> {
        let (guesses, confirmed) = (&self.guesses, &self.confirmed);
        self.map
            .find(mix(hash), |&k| {
                let (list, i) = list_of(guesses, confirmed, k);
                list.get(i).hash == hash
            })
            .copied()
    }

    /// Point the map entry of `hash` at `to` instead of `from`, or remove it (`to` None).
    fn rekey(&mut self, hash: u64, from: u32, to: Option<u32>) {
        if let Ok(entry) = self.map.find_entry(mix(hash), |&k| k == from) {
            match to {
                Some(to) => *entry.into_mut() = to,
                None => {
                    entry.remove();
                }
            }
        }
    }

    fn list_mut(&mut self, key: u32) -> (&mut LruList<Node>, u32) {
        if key & CONFIRMED != 0 {
            (&mut self.confirmed, key & !CONFIRMED)
        } else {
            (&mut self.guesses, key)
        }
    }

    fn node(&self, key: u32) -> &Node {
        let (list, i) = self.list(key);
        list.get(i)
    }

    fn node_mut(&mut self, key: u32) -> &mut Node {
        let (list, i) = self.list_mut(key);
        list.get_mut(i)
    }

    /// Mark the node used at `now_us` (most recent of its list).
    fn touch(&mut self, key: u32, now_us: u64) {
        let (list, i) = self.list_mut(key);
        list.get_mut(i).last_used_us = now_us;
        list.touch(i);
    }

    /// Add `node` (its hash not present) as the most recent of the list its count picks;
    /// returns its key.
    fn add(&mut self, node: Node, bounds: (usize, usize)) -> u32 {
        let key = self.push(node, bounds);
        let (guesses, confirmed) = (&self.guesses, &self.confirmed);
        self.map.insert_unique(mix(node.hash), key, |&k| {
            let (list, i) = list_of(guesses, confirmed, k);
            mix(list.get(i).hash)
        });
        key
    }

    /// Put `node` in the list its count picks, as the most recent there (the map untouched);
    /// `bounds` (guesses, confirmed) cap the lists' slabs. Returns its key.
    fn push(&mut self, node: Node, bounds: (usize, usize)) -> u32 {
        if node.count > 0 {
            self.confirmed.push_newest_within(node, bounds.1) | CONFIRMED
        } else {
            self.guesses.push_newest_within(node, bounds.0)
        }
    }

    /// Remove the node from its list (not from the map).
    fn unlink(&mut self, key: u32) -> Node {
        let (list, i) = self.list_mut(key);
        list.remove(i)
    }

    fn drop_node(&mut self, key: u32) -> u64 {
        let hash = self.unlink(key).hash;
        self.rekey(hash, key, None);
        hash
    }

    /// Move the node to the list its count now picks, as the most recent there; returns its
    /// key.
    fn relist(&mut self, key: u32, bounds: (usize, usize)) -> u32 {
        let confirmed = self.node(key).count > 0;
        if confirmed == (key & CONFIRMED != 0) {
            return key;
        }
        let node = self.unlink(key);
        let to = self.push(node, bounds);
        self.rekey(node.hash, key, Some(to));
        to
    }

    fn iter(&self) -> impl Iterator<Item = &Node> + '_ {
        self.guesses.iter().chain(self.confirmed.iter())
    }

    fn clear(&mut self) {
        self.map = HashTable::new();
        self.guesses.clear();
        self.confirmed.clear();
        self.stored = 0;
    }
}

/// The single writer of a `ResidencyIndex`: keeps, per replica, how many copies of each block
/// it holds and their LRU order, evicts beyond capacity, and publishes replica bits to the
/// shared table. Lives on one control thread (it is `Send`, not shared).
pub struct ResidencyWriter {
    index: Arc<ResidencyIndex>,
    cfg: ResidencyConfig,
    replicas: Vec<ReplicaBlocks>,
    /// Keyed slots of the current table (live + dead).
    occupied: usize,
    /// Slots whose mask is not empty.
    live: usize,
    /// `ReplicaBlocks::bytes` of each replica as last published, and their sum.
    replica_bytes: Vec<usize>,
    writer_bytes: usize,
    pub(super) logs: Vec<Arc<super::RoutingLog>>,
    /// Wakes the writer thread when a routing log gets a record while it is parked.
    pub(super) bell: Arc<super::WriterBell>,
    /// Tokens per block the replicas report (KV events): sizes the confirmed lists.
    reported_block_tokens: u32,
    /// Longest a block stays pending after it was last touched (0: the rule is off).
    pending_ttl_us: u64,
    /// The latest time any call gave the writer (`remove` runs at it).
    clock_us: u64,
}

impl ResidencyWriter {
    pub fn index(&self) -> &Arc<ResidencyIndex> {
        &self.index
    }

    pub fn config(&self) -> &ResidencyConfig {
        &self.cfg
    }

    /// Blocks replica `r` may hold.
    pub fn capacity_blocks(&self, r: usize) -> usize {
        self.replicas.get(r).map_or(0, |_| self.bounds(r).0)
    }

    /// Replica `r`'s bounds, from its capacity in tokens: on guesses (blocks of the index's
    /// `block_tokens`) and on reported blocks (blocks of `reported_block_tokens`).
    fn bounds(&self, r: usize) -> (usize, usize) {
        let tokens = self.replicas[r].capacity_tokens;
        let reported = (tokens / self.reported_block_tokens as u64).max(1) as usize;
        (self.cfg.capacity_blocks(tokens), reported)
    }

    /// Set replica `r`'s KV capacity (tokens; at least one block), evicting what no longer
    /// fits. Errors on an unknown replica.
    pub fn set_capacity_tokens(&mut self, r: usize, tokens: u64) -> Result<(), String> {
        self.check_replica(r)?;
        self.replicas[r].capacity_tokens = tokens;
        self.evict(r);
        self.finish(r);
        Ok(())
    }

    /// Tokens per block in what the replicas report (the engines' KV block size, 16 for
    /// vLLM; default: the index's `block_tokens`): a replica holds its capacity in tokens over
    /// this many reported blocks. Applies to every replica's confirmed list at once.
    pub fn set_reported_block_tokens(&mut self, tokens: u32) {
        self.reported_block_tokens = tokens.max(1);
        for r in 0..self.replicas.len() {
            self.evict(r);
            self.finish(r);
        }
    }

    /// Replica `r`'s bound on reported blocks.
    pub fn confirmed_capacity_blocks(&self, r: usize) -> usize {
        self.replicas.get(r).map_or(0, |_| self.bounds(r).1)
    }

    /// How long a routed block may stay pending after kvlb last touched it; zero turns the
    /// pending rule off (a BlockRemoved then always drops a block at 0 copies).
    pub fn set_pending_ttl(&mut self, ttl: Duration) {
        self.pending_ttl_us = ttl.as_micros().min(u64::MAX as u128) as u64;
    }

    pub fn pending_ttl(&self) -> Duration {
        Duration::from_micros(self.pending_ttl_us)
    }

    /// Replica `r` stored `blocks` (one more copy of each; KV events' BlockStored). Blocks are
    /// touched last to first, so the prefix ends up most recently used and leaves are evicted
    /// first, as vLLM does. A stored block is confirmed: no longer pending.
    pub fn insert(&mut self, r: usize, blocks: &[u64], now_us: u64) -> Result<(), String> {
        self.apply(r, blocks, now_us, Learned::Stored)
    }

    /// Blocks believed resident on replica `r` without a report: present blocks are
    /// refreshed, missing ones added without a copy count (a later BlockStored gives them
    /// their real count; a BlockRemoved drops them). Pending marks are left as they are, so
    /// this is also how confirmed blocks are kept from ageing. A request actually sent to `r`
    /// goes through `route`.
    pub fn insert_routed(&mut self, r: usize, blocks: &[u64], now_us: u64) -> Result<(), String> {
        self.apply(r, blocks, now_us, Learned::Guessed)
    }

    /// Replica `r` reported that it holds `blocks` and just used them, without storing a new
    /// copy (vLLM's `kv_cache_report_mode = "full"` re-sends BlockStored for the blocks a
    /// request reused from its prefix cache). Present blocks are touched (last to first, as
    /// `insert`) and confirmed: a block known only as a guess gets one copy, a confirmed one
    /// keeps its count; missing blocks (dropped by the bound) come back with one copy. Pending
    /// marks are cleared, as by a store; the store counter of pending marks does not move.
    pub fn refresh(&mut self, r: usize, blocks: &[u64], now_us: u64) -> Result<(), String> {
        self.apply(r, blocks, now_us, Learned::Refreshed)
    }

    /// A request for `blocks` was sent to replica `r`: as `insert_routed`, and every block
    /// is *pending* there until `r` reports it stored. The request may wait in `r`'s queue
    /// while `r` evicts those blocks; it will compute them again when it runs, so a
    /// BlockRemoved that leaves a pending block at 0 copies keeps it (as a guess) instead of
    /// dropping it. The mark lapses once `r` has stored as many blocks as it holds since the
    /// routing (the request has run by then, or `r`'s queue is longer than its cache), or
    /// once the block was last touched `pending_ttl` ago; a kept block then ages like any
    /// other guess (`expire`, `expire_guesses`).
    pub fn route(&mut self, r: usize, blocks: &[u64], now_us: u64) -> Result<(), String> {
        let learned = if self.pending_ttl_us == 0 {
            Learned::Guessed
        } else {
            Learned::Routed
        };
        self.apply(r, blocks, now_us, learned)
    }

    fn apply(
        &mut self,
        r: usize,
        blocks: &[u64],
        now_us: u64,
        learned: Learned,
    ) -> Result<(), String> {
        self.check_replica(r)?;
        self.clock_us = self.clock_us.max(now_us);
        let bounds = self.bounds(r);
        let rb = &mut self.replicas[r];
        if learned == Learned::Stored {
            rb.stored = rb.stored.wrapping_add(blocks.len() as u32);
        }
        let mark = match learned {
            Learned::Routed => pending_mark(rb.stored),
            _ => 0,
        };
        for &hash in blocks.iter().rev() {
            let rb = &mut self.replicas[r];
            match rb.get(hash) {
                Some(key) => {
                    let node = rb.node_mut(key);
                    let key = match learned {
                        Learned::Stored => {
                            node.count += 1;
                            node.pending = 0;
                            rb.relist(key, bounds)
                        }
                        Learned::Routed => {
                            node.pending = mark;
                            key
                        }
                        Learned::Refreshed => {
                            node.count = node.count.max(1);
                            node.pending = 0;
                            rb.relist(key, bounds)
                        }
                        Learned::Guessed => key,
                    };
                    rb.touch(key, now_us);
                }
                None => {
                    rb.add(
                        Node {
                            hash,
                            count: matches!(learned, Learned::Stored | Learned::Refreshed) as u32,
                            pending: mark,
                            last_used_us: now_us,
                        },
                        bounds,
                    );
                    self.set_bit(hash, r);
                }
            }
        }
        self.evict(r);
        self.finish(r);
        Ok(())
    }

    /// Replica `r` dropped one copy of `hash` (BlockRemoved); the block stops being resident
    /// when no copy is left, unless it is pending (`route`). Unknown hashes are ignored. Runs
    /// at the latest time the writer was given (`remove_at` names it).
    pub fn remove(&mut self, r: usize, hash: u64) -> Result<(), String> {
        self.remove_at(r, hash, self.clock_us)
    }

    /// `remove` at `now_us`.
    pub fn remove_at(&mut self, r: usize, hash: u64, now_us: u64) -> Result<(), String> {
        self.remove_many(r, &[hash], now_us)
    }

    /// `remove` of each of `hashes` at `now_us` (one BlockRemoved event's blocks), publishing
    /// the replica's counters once.
    pub fn remove_many(&mut self, r: usize, hashes: &[u64], now_us: u64) -> Result<(), String> {
        self.check_replica(r)?;
        self.clock_us = self.clock_us.max(now_us);
        let ttl = self.pending_ttl_us;
        let bounds = self.bounds(r);
        let capacity = bounds.1;
        for &hash in hashes {
            let rb = &mut self.replicas[r];
            let Some(key) = rb.get(hash) else {
                continue;
            };
            let stored = rb.stored;
            let node = rb.node_mut(key);
            node.count = node.count.saturating_sub(1);
            if node.count == 0 {
                let pending = node.pending != 0
                    && now_us.saturating_sub(node.last_used_us) < ttl
                    && (stored_since(stored, node.pending) as usize) < capacity;
                if pending {
                    // Kept as a guess: the request routed here will store it again.
                    rb.relist(key, bounds);
                } else {
                    rb.drop_node(key);
                    self.clear_bit(hash, r);
                }
            }
        }
        // A block kept as a guess may take the guesses one over their bound.
        self.evict(r);
        self.finish(r);
        Ok(())
    }

    /// Replica `r` holds nothing any more (AllBlocksCleared, restart, removal from the fleet).
    pub fn clear(&mut self, r: usize) -> Result<(), String> {
        self.check_replica(r)?;
        let mut rb = std::mem::replace(&mut self.replicas[r], ReplicaBlocks::new(0));
        for node in rb.iter() {
            self.clear_bit(node.hash, r);
        }
        rb.clear();
        self.replicas[r] = rb;
        self.finish(r);
        Ok(())
    }

    /// Drop the guesses of replica `r` (blocks without a reported copy, pending or not) not
    /// used since `before_us`; blocks events reported stay whatever their age. Walks the
    /// guesses from the oldest and stops at the first recent one. Returns how many were
    /// dropped.
    pub fn expire_guesses(&mut self, r: usize, before_us: u64) -> Result<usize, String> {
        self.check_replica(r)?;
        self.clock_us = self.clock_us.max(before_us);
        let mut dropped = 0;
        loop {
            let rb = &mut self.replicas[r];
            let Some(i) = rb.guesses.oldest() else { break };
            if rb.guesses.get(i).last_used_us >= before_us {
                break;
            }
            let hash = rb.drop_node(i);
            self.clear_bit(hash, r);
            dropped += 1;
        }
        self.finish(r);
        Ok(dropped)
    }

    /// Whether `hash` is pending on replica `r` (routed there since its last BlockStored).
    pub fn is_pending(&self, r: usize, hash: u64) -> bool {
        self.replicas
            .get(r)
            .and_then(|b| b.get(hash).map(|k| b.node(k).pending != 0))
            .unwrap_or(false)
    }

    /// Whether the writer's truth says `r` holds `hash` (tests and debugging).
    pub fn holds(&self, r: usize, hash: u64) -> bool {
        self.replicas.get(r).is_some_and(|b| b.get(hash).is_some())
    }

    /// Copies of `hash` replica `r` reported (0 when only routing put it there or absent).
    pub fn copies(&self, r: usize, hash: u64) -> u32 {
        self.replicas
            .get(r)
            .and_then(|b| b.get(hash).map(|k| b.node(k).count))
            .unwrap_or(0)
    }

    /// The writer's time is at least `now_us` (what `remove` runs at).
    pub(super) fn advance_clock(&mut self, now_us: u64) {
        self.clock_us = self.clock_us.max(now_us);
    }

    fn check_replica(&self, r: usize) -> Result<(), String> {
        if r < self.cfg.max_replicas {
            Ok(())
        } else {
            Err(format!(
                "replica {r} is outside the residency index (max_replicas {})",
                self.cfg.max_replicas
            ))
        }
    }

    /// Bound each of replica `r`'s lists by its capacity, dropping the least recently used.
    fn evict(&mut self, r: usize) {
        let (guesses, confirmed) = self.bounds(r);
        loop {
            let rb = &mut self.replicas[r];
            let key = if rb.guesses.len() > guesses {
                rb.guesses.oldest()
            } else if rb.confirmed.len() > confirmed {
                rb.confirmed.oldest().map(|i| i | CONFIRMED)
            } else {
                None
            };
            let Some(key) = key else { break };
            let hash = rb.drop_node(key);
            self.clear_bit(hash, r);
        }
    }

    fn set_bit(&mut self, hash: u64, r: usize) {
        let mut table = self.index.table.load();
        if table.rows_free() == 0 {
            // The next block to go past `INLINE` holders needs a row: a fresh arena first.
            drop(table);
            self.rebuild();
            table = self.index.table.load();
        }
        let change = table.set_bit(hash, r);
        self.occupied += change.new_slot as usize;
        self.live += change.live_changed as usize;
        if self.occupied * 2 > table.slots() {
            drop(table);
            self.rebuild();
        }
    }

    fn clear_bit(&mut self, hash: u64, r: usize) {
        let table = self.index.table.load();
        if table.clear_bit(hash, r).live_changed {
            self.live -= 1;
            if self.live * 8 < table.slots() && table.slots() > MIN_SLOTS {
                drop(table);
                self.rebuild();
            }
        }
    }

    /// Copy the live keys into a fresh table sized for them (load at most 1/3, twice the
    /// overflow rows in use, blocks back inline where they fit) and publish it
    /// with one pointer swap. Readers holding the old table finish on it; it is freed when the
    /// last of them lets go. Never blocks a reader.
    fn rebuild(&mut self) {
        let old = self.index.table.load_full();
        let mut rows = 0;
        old.for_each_live(|_, word| rows += (old.holder_count(word) > INLINE) as usize);
        let fresh = BitTable::new(self.live * 3, old.words(), rows * 2 + MIN_ROWS);
        let mut occupied = 0;
        old.for_each_live(|key, word| {
            fresh.put(key, &old, word);
            occupied += (key != 0) as usize;
        });
        self.occupied = occupied;
        self.index.table.store(Arc::new(fresh));
        self.index.rebuilds.fetch_add(1, Ordering::Relaxed);
    }

    /// Publish the counters readers see after a change to replica `r`.
    fn finish(&mut self, r: usize) {
        self.index.replica_blocks[r].store(self.replicas[r].len(), Ordering::Relaxed);
        self.index.reported_blocks[r].store(self.replicas[r].confirmed.len(), Ordering::Relaxed);
        self.index.distinct.store(self.live, Ordering::Relaxed);
        let now = self.replicas[r].bytes();
        self.writer_bytes = self.writer_bytes + now - self.replica_bytes[r];
        self.replica_bytes[r] = now;
        self.publish_bytes();
    }

    fn publish_bytes(&self) {
        let table = self.index.table.load().bytes();
        self.index.table_bytes.store(table, Ordering::Relaxed);
        let fixed = std::mem::size_of::<ResidencyIndex>()
            + std::mem::size_of::<ResidencyWriter>()
            + self.replicas.capacity() * std::mem::size_of::<ReplicaBlocks>();
        self.index
            .bytes
            .store(table + self.writer_bytes + fixed, Ordering::Relaxed);
    }
}
