//! The paged KV cache of the simulated engine: a fixed pool of `block_size`-token blocks, prefix
//! sharing through chained block hashes, LRU eviction of blocks no running request holds, and
//! the KV events vLLM publishes about them.
//!
//! It mirrors vLLM v1's `BlockPool`:
//! * a block is *cached* once it is full and registered under its hash; a lookup finds it
//!   while it stays cached, held or not;
//! * blocks nobody holds (reference count 0) sit in one free queue, least recently used at the
//!   head; allocation pops the head and, if that block was cached, evicts it (BlockRemoved);
//! * a request frees its blocks in reverse order, so its tail blocks are evicted before its
//!   head blocks (the head is the part other requests are likely to share);
//! * two requests that compute the same content at once hold two physical blocks with the
//!   same hash: both are registered and both are announced (vLLM does the same, which is why
//!   consumers count removals rather than clear a bit).
//!
//! With a host tier (`host_tier.rs`, capacity > 0) the cache also writes every block it
//! registers through to host memory, as vLLM's CPU offloading, LMCache and SGLang HiCache (in
//! their default write-through mode) copy blocks out as they are computed: new host copies
//! are announced in a BlockStored with medium CPU (same parent and tokens as the GPU one),
//! host LRU evictions in a BlockRemoved with medium CPU. A GPU eviction then leaves the host
//! copy, which a later request loads back (`host_contains`). `clear` empties both tiers.
//!
//! Everything is index based (block ids are `u32` into one `Vec`): no allocation per
//! operation beyond the events themselves.

#![forbid(unsafe_code)]

use super::block_map::BlockMap;
use super::host_tier::HostTier;
use crate::kv_events::{BlockKey, KvEvent, Medium};
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// No block.
const NIL: u32 = u32::MAX;

/// Hash of the (empty) prefix before a request's first block: the engine seed and the
/// request's cache salt. Equal prompts with different salts share nothing.
pub(crate) fn root_hash(hash_seed: u64, cache_salt: Option<u64>) -> u64 {
    match cache_salt {
        None => xxh3_64_with_seed(b"kvlb-root", hash_seed),
        Some(salt) => {
            let mut bytes = [0u8; 17];
            bytes[..9].copy_from_slice(b"kvlb-salt");
            bytes[9..].copy_from_slice(&salt.to_le_bytes());
            xxh3_64_with_seed(&bytes, hash_seed)
        }
    }
}

/// Hash of one full block: its parent's hash and its tokens.
pub(crate) fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut hasher = Xxh3::with_seed(parent);
    let mut bytes = [0u8; 256];
    for chunk in tokens.chunks(64) {
        for (i, t) in chunk.iter().enumerate() {
            bytes[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
        }
        hasher.update(&bytes[..4 * chunk.len()]);
    }
    hasher.digest()
}

type BlockTable = BlockMap;

#[derive(Debug, Clone)]
struct Block {
    /// Valid while `cached`.
    hash: u64,
    cached: bool,
    ref_count: u32,
    /// Free-queue links, valid while `ref_count == 0`.
    prev: u32,
    next: u32,
    /// Next block registered under the same hash.
    next_same: u32,
}

pub(crate) struct KvCache {
    block_size: u32,
    blocks: Vec<Block>,
    free_head: u32,
    free_tail: u32,
    num_free: u32,
    /// hash -> first block registered under it (others chained through `next_same`).
    table: BlockTable,
    /// Copies in host memory (disabled at capacity 0).
    host: HostTier,
    /// Scratch for host evictions, kept to avoid an allocation per store.
    host_evicted: Vec<u64>,
    events: Vec<KvEvent>,
    events_enabled: bool,
}

impl KvCache {
    /// `num_blocks` GPU blocks of `block_size` tokens, and a host tier of `host_blocks`
    /// blocks (0: none).
    pub(crate) fn new(num_blocks: u32, block_size: u32, host_blocks: u32) -> KvCache {
        let blocks = (0..num_blocks)
            .map(|i| Block {
                hash: 0,
                cached: false,
                ref_count: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == num_blocks { NIL } else { i + 1 },
                next_same: NIL,
            })
            .collect();
        KvCache {
            block_size,
            blocks,
            free_head: if num_blocks == 0 { NIL } else { 0 },
            free_tail: if num_blocks == 0 { NIL } else { num_blocks - 1 },
            num_free: num_blocks,
            table: BlockTable::with_capacity_and_hasher(num_blocks as usize, Default::default()),
            host: HostTier::new(host_blocks as usize),
            host_evicted: Vec::new(),
            events: Vec::new(),
            events_enabled: true,
        }
    }

    pub(crate) fn num_blocks(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks nobody holds (cached or not): what allocation can use.
    pub(crate) fn num_free(&self) -> u32 {
        self.num_free
    }

    pub(crate) fn set_events_enabled(&mut self, enabled: bool) {
        self.events_enabled = enabled;
        if !enabled {
            self.events.clear();
        }
    }

    pub(crate) fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events);
    }

    /// A cached block holding `hash`, if any.
    pub(crate) fn lookup(&self, hash: u64) -> Option<u32> {
        self.table.get(&hash).copied()
    }

    /// Whether the host tier holds a copy of `hash`.
    pub(crate) fn host_contains(&self, hash: u64) -> bool {
        self.host.contains(hash)
    }

    /// Mark the host copy of `hash` (if any) most recently used: a request's prefix uses it.
    pub(crate) fn host_touch(&mut self, hash: u64) {
        self.host.touch(hash);
    }

    pub(crate) fn host_enabled(&self) -> bool {
        self.host.is_enabled()
    }

    /// Blocks held in the host tier.
    pub(crate) fn host_len(&self) -> usize {
        self.host.len()
    }

    pub(crate) fn host_capacity_blocks(&self) -> usize {
        self.host.capacity_blocks()
    }

    pub(crate) fn is_free(&self, block: u32) -> bool {
        self.blocks[block as usize].ref_count == 0
    }

    /// Take one more reference on a cached block found by `lookup` (a prefix hit).
    pub(crate) fn touch(&mut self, block: u32) {
        if self.blocks[block as usize].ref_count == 0 {
            self.unlink_free(block);
        }
        self.blocks[block as usize].ref_count += 1;
    }

    /// A fresh block with one reference, evicting the least recently used free block if it
    /// was cached. None when every block is held.
    pub(crate) fn allocate(&mut self) -> Option<u32> {
        let block = self.free_head;
        if block == NIL {
            return None;
        }
        self.unlink_free(block);
        if self.blocks[block as usize].cached {
            self.uncache(block);
            if self.events_enabled {
                let hash = self.blocks[block as usize].hash;
                self.events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![hash],
                    medium: Some(Medium::Gpu),
                });
            }
        }
        self.blocks[block as usize].ref_count = 1;
        Some(block)
    }

    /// Drop one reference; a block nobody holds joins the tail of the free queue (most
    /// recently used), staying cached until evicted.
    pub(crate) fn release(&mut self, block: u32) {
        let b = &mut self.blocks[block as usize];
        debug_assert!(b.ref_count > 0);
        b.ref_count -= 1;
        if b.ref_count == 0 {
            self.push_free_tail(block);
        }
    }

    /// Register consecutive newly full `blocks` of one request under `hashes` and announce
    /// them in one BlockStored (`parent` is the hash of the block before the first one,
    /// `tokens` their `blocks.len() * block_size` tokens).
    pub(crate) fn store(
        &mut self,
        blocks: &[u32],
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        lora: Option<&super::LoraRef>,
    ) {
        debug_assert_eq!(blocks.len(), hashes.len());
        debug_assert_eq!(tokens.len(), blocks.len() * self.block_size as usize);
        if blocks.is_empty() {
            return;
        }
        for (&block, &hash) in blocks.iter().zip(hashes) {
            let b = &mut self.blocks[block as usize];
            debug_assert!(!b.cached);
            b.hash = hash;
            b.cached = true;
            let head = self.table.entry(hash).or_insert(NIL);
            b.next_same = *head;
            *head = block;
        }
        if self.events_enabled {
            self.events.push(KvEvent::BlockStored {
                block_hashes: hashes.to_vec(),
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                block_size: self.block_size,
                lora_id: lora.map(|l| l.id),
                key: lora_key(lora),
                medium: Some(Medium::Gpu),
            });
        }
        self.write_through(hashes, parent, tokens, lora);
    }

    /// Copy newly registered blocks to the host tier: blocks it lacks are announced (one
    /// BlockStored with medium CPU per consecutive run of them), blocks it holds are
    /// refreshed, last to first so that the head of a prompt is the most recent part (as a
    /// request frees its tail first on the GPU); then least recently used host blocks beyond
    /// its capacity are dropped (one BlockRemoved with medium CPU).
    fn write_through(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        lora: Option<&super::LoraRef>,
    ) {
        if !self.host.is_enabled() {
            return;
        }
        if self.events_enabled {
            let bs = self.block_size as usize;
            let mut run_start = None;
            for i in 0..=hashes.len() {
                let new = i < hashes.len() && !self.host.contains(hashes[i]);
                match (new, run_start) {
                    (true, None) => run_start = Some(i),
                    (false, Some(start)) => {
                        run_start = None;
                        self.events.push(KvEvent::BlockStored {
                            block_hashes: hashes[start..i].to_vec(),
                            parent_block_hash: if start == 0 {
                                parent
                            } else {
                                Some(hashes[start - 1])
                            },
                            token_ids: tokens[start * bs..i * bs].to_vec(),
                            block_size: self.block_size,
                            lora_id: lora.map(|l| l.id),
                            key: lora_key(lora),
                            medium: Some(Medium::Cpu),
                        });
                    }
                    _ => {}
                }
            }
        }
        for &hash in hashes.iter().rev() {
            self.host.insert(hash);
        }
        self.host.evict_over_capacity(&mut self.host_evicted);
        if !self.host_evicted.is_empty() {
            if self.events_enabled {
                self.events.push(KvEvent::BlockRemoved {
                    block_hashes: self.host_evicted.clone(),
                    medium: Some(Medium::Cpu),
                });
            }
            self.host_evicted.clear();
        }
    }

    /// Forget every cached block (none may be held), in both tiers. Emits AllBlocksCleared.
    pub(crate) fn clear(&mut self) {
        for b in &mut self.blocks {
            debug_assert_eq!(b.ref_count, 0);
            b.cached = false;
            b.next_same = NIL;
        }
        self.table.clear();
        self.host.clear();
        if self.events_enabled {
            self.events.push(KvEvent::AllBlocksCleared);
        }
    }

    /// Remove `block` from the hash table (its chain of same-hash blocks).
    fn uncache(&mut self, block: u32) {
        let hash = self.blocks[block as usize].hash;
        let next = self.blocks[block as usize].next_same;
        self.blocks[block as usize].cached = false;
        self.blocks[block as usize].next_same = NIL;
        let head = self
            .table
            .get_mut(&hash)
            .expect("cached block is in the table");
        if *head == block {
            if next == NIL {
                self.table.remove(&hash);
            } else {
                *head = next;
            }
            return;
        }
        let mut at = *head;
        while self.blocks[at as usize].next_same != block {
            at = self.blocks[at as usize].next_same;
            debug_assert_ne!(at, NIL);
        }
        self.blocks[at as usize].next_same = next;
    }

    fn unlink_free(&mut self, block: u32) {
        let (prev, next) = {
            let b = &self.blocks[block as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.free_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.free_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.num_free -= 1;
    }

    fn push_free_tail(&mut self, block: u32) {
        let tail = self.free_tail;
        {
            let b = &mut self.blocks[block as usize];
            b.prev = tail;
            b.next = NIL;
        }
        if tail == NIL {
            self.free_head = block;
        } else {
            self.blocks[tail as usize].next = block;
        }
        self.free_tail = block;
        self.num_free += 1;
    }
}

/// The block key of blocks stored under `lora`: vLLM names the adapter (`lora_name`).
fn lora_key(lora: Option<&super::LoraRef>) -> BlockKey {
    BlockKey {
        lora_name: lora.map(|l| l.name.to_string()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_and_salt() {
        let root = root_hash(7, None);
        assert_ne!(root, root_hash(8, None));
        assert_ne!(root, root_hash(7, Some(0)));
        assert_ne!(root_hash(7, Some(1)), root_hash(7, Some(0)));
        let a = block_hash(root, &[1, 2, 3, 4]);
        assert_eq!(a, block_hash(root, &[1, 2, 3, 4]));
        assert_ne!(a, block_hash(root, &[1, 2, 3, 5]));
        assert_ne!(block_hash(a, &[1, 2, 3, 4]), a);
        // Chunked hashing equals one-shot hashing of the same bytes.
        let tokens: Vec<u32> = (0..200).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(block_hash(9, &tokens), xxh3_64_with_seed(&bytes, 9));
    }

    #[test]
    fn free_queue_is_lru_and_eviction_announces_removal() {
        let mut kv = KvCache::new(3, 2, 0);
        let a = kv.allocate().unwrap();
        let b = kv.allocate().unwrap();
        kv.store(&[a, b], &[10, 11], None, &[1, 2, 3, 4], None);
        assert_eq!(kv.num_free(), 1);
        kv.release(b);
        kv.release(a); // queue: (unused), b, a
        assert_eq!(kv.num_free(), 3);
        assert_eq!(kv.lookup(10), Some(a));
        let c = kv.allocate().unwrap(); // the never used block
        assert!(c != a && c != b);
        let mut events = vec![];
        kv.take_events(&mut events);
        assert_eq!(events.len(), 1);
        let d = kv.allocate().unwrap();
        assert_eq!(d, b, "least recently freed first");
        kv.take_events(&mut events);
        assert_eq!(
            events[1],
            KvEvent::BlockRemoved {
                block_hashes: vec![11],
                medium: Some(Medium::Gpu)
            }
        );
        assert_eq!(kv.lookup(11), None);
        // A touched block leaves the free queue and is never evicted while held.
        kv.touch(a);
        assert_eq!(kv.allocate(), None);
        assert_eq!(kv.lookup(10), Some(a));
    }

    #[test]
    fn duplicate_hashes_are_counted_per_block() {
        let mut kv = KvCache::new(2, 1, 0);
        let a = kv.allocate().unwrap();
        let b = kv.allocate().unwrap();
        kv.store(&[a], &[5], None, &[1], None);
        kv.store(&[b], &[5], None, &[1], None);
        kv.release(a);
        kv.release(b);
        kv.allocate().unwrap();
        assert!(
            kv.lookup(5).is_some(),
            "the other copy still holds the content"
        );
        kv.allocate().unwrap();
        assert_eq!(kv.lookup(5), None);
        let mut events = vec![];
        kv.take_events(&mut events);
        let removed = events
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockRemoved { .. }))
            .count();
        assert_eq!(removed, 2);
    }
}
