//! What names a token-mode block besides its tokens: the LoRA adapter it was computed with and
//! the request's cache salt. An engine never reuses KV across adapters or salts (vLLM folds
//! both into its block hash extra keys, SGLang into its cache namespace), so kvlb folds them
//! into the chain's root: a prompt's first block has parent [`token_root`]`(adapter, salt)`,
//! and every later block inherits it through its parent. The base model without a salt keeps
//! [`TOKEN_CHAIN_ROOT`], so unsalted base-model hashes are those of before.
//!
//! Both sides compute the same root: KV events from the event's `lora_name` and salt (vLLM's
//! first-block `extra_keys`, SGLang's `cache_salt`), requests from `cache_salt` and the
//! adapter their `model` names (vLLM: the adapter's name itself; SGLang: `base:adapter`).
//! Which model names are adapters is learned into an [`AdapterNames`] table, shared without
//! locks between the threads that learn names and the workers that look them up.

use super::{block_hash, TOKEN_CHAIN_ROOT};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use xxhash_rust::xxh3::xxh3_64;

const LORA_TAG: u64 = u64::from_be_bytes(*b"kvlblora");
const SALT_TAG: u64 = u64::from_be_bytes(*b"kvlbsalt");

/// The hash an adapter name or a salt enters the root as: xxh3 of its UTF-8 bytes.
#[inline]
pub fn name_hash(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// The parent of a token-mode prompt's first block under an adapter and a salt (each as its
/// [`name_hash`]); [`TOKEN_CHAIN_ROOT`] for neither. Tagged, so an adapter and a salt of equal
/// bytes give different roots.
#[inline]
pub fn token_root(lora: Option<u64>, salt: Option<u64>) -> u64 {
    let mut root = TOKEN_CHAIN_ROOT;
    if let Some(l) = lora {
        root = block_hash::chain_step(root ^ LORA_TAG, l);
    }
    if let Some(s) = salt {
        root = block_hash::chain_step(root ^ SALT_TAG, s);
    }
    root
}

/// What [`AdapterNames::insert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Learned {
    New,
    Known,
    /// The table holds [`AdapterNames::CAPACITY`] names already: this one is not kept.
    Full,
}

/// The adapter names seen so far (their [`name_hash`]es): an insert-only open-addressing table
/// of atomics, so any thread may learn a name and workers look names up without a lock or an
/// allocation. Names are never forgotten: an adapter unloaded from every replica still names
/// no base-model block.
pub struct AdapterNames {
    slots: Box<[AtomicU64]>,
    len: AtomicUsize,
}

impl Default for AdapterNames {
    fn default() -> Self {
        AdapterNames::new()
    }
}

impl AdapterNames {
    /// Names kept at most (the table is twice as large, so a probe ends within a few slots).
    pub const CAPACITY: usize = 4096;

    pub fn new() -> AdapterNames {
        AdapterNames {
            slots: (0..2 * Self::CAPACITY).map(|_| AtomicU64::new(0)).collect(),
            len: AtomicUsize::new(0),
        }
    }

    /// 0 marks an empty slot: the one hash that is 0 is kept as 1.
    #[inline]
    fn key(hash: u64) -> u64 {
        hash.max(1)
    }

    /// Learns an adapter name.
    pub fn insert(&self, name: &[u8]) -> Learned {
        let key = Self::key(name_hash(name));
        let mask = self.slots.len() - 1;
        let mut i = key as usize & mask;
        loop {
            match self.slots[i].load(Relaxed) {
                k if k == key => return Learned::Known,
                0 => {
                    if self.len.load(Relaxed) >= Self::CAPACITY {
                        return Learned::Full;
                    }
                    match self.slots[i].compare_exchange(0, key, Relaxed, Relaxed) {
                        Ok(_) => {
                            self.len.fetch_add(1, Relaxed);
                            return Learned::New;
                        }
                        Err(k) if k == key => return Learned::Known,
                        Err(_) => {}
                    }
                }
                _ => {}
            }
            i = (i + 1) & mask;
        }
    }

    /// Whether `name` is a known adapter.
    #[inline]
    pub fn contains(&self, name: &[u8]) -> bool {
        if self.len.load(Relaxed) == 0 {
            return false;
        }
        let key = Self::key(name_hash(name));
        let mask = self.slots.len() - 1;
        let mut i = key as usize & mask;
        loop {
            match self.slots[i].load(Relaxed) {
                k if k == key => return true,
                0 => return false,
                _ => i = (i + 1) & mask,
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The adapter a request's `model` names, if any: the model itself when it is a known
    /// adapter (vLLM serves adapters under their own names), else the part after a `:` that
    /// is one (SGLang's `base:adapter`; the base name may hold colons, so each is tried from
    /// the left, as SGLang splits after its served name or else at the first).
    pub fn adapter_of<'m>(&self, model: &'m [u8]) -> Option<&'m [u8]> {
        if self.is_empty() || model.is_empty() {
            return None;
        }
        if self.contains(model) {
            return Some(model);
        }
        let mut rest = model;
        while let Some(at) = rest.iter().position(|&b| b == b':') {
            rest = &rest[at + 1..];
            let name = rest.trim_ascii();
            if !name.is_empty() && self.contains(name) {
                return Some(name);
            }
        }
        None
    }
}
