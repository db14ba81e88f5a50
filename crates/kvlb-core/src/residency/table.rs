//! The shared residency table: block hash -> bitmask of the replicas holding that block.
//!
//! Open addressing with linear probing over one flat array of atomics; a slot is
//! `[key, mask word 0, .., mask word W-1]` with `W = ceil(max_replicas / 64)` (1 to 4 words).
//! Key 0 marks an empty slot; the block hash 0 lives in a dedicated side mask instead, so every
//! u64 is a valid block hash and lookups are exact (no false positives).
//!
//! One writer, many readers, no locks:
//! * A slot gets its key once and keeps it for the table's life: the writer fills the mask of
//!   an empty slot first and then publishes the key with `Release`; readers load keys with
//!   `Acquire`. A slot whose mask drops to zero stays keyed ("dead") and is reused if the same
//!   hash comes back; dead slots disappear when the writer rebuilds into a fresh table.
//! * Mask bits change with single atomic `fetch_or` / `fetch_and` operations; a reader sees
//!   each word either before or after a change.
//! * The writer keeps occupied slots (live + dead) at most half of the table, so a probe always
//!   meets an empty slot and readers never loop.

use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) const MAX_WORDS: usize = 4;
const EMPTY: u64 = 0;
pub(crate) const MIN_SLOTS: usize = 1024;

pub(crate) type Mask = [u64; MAX_WORDS];

pub(crate) struct BitTable {
    words: usize,
    stride: usize,
    shift: u32,
    slot_mask: usize,
    cells: Box<[AtomicU64]>,
    zero: [AtomicU64; MAX_WORDS],
}

/// What a bit change did to the table's occupancy, for the writer's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Change {
    /// An empty slot got a key.
    pub new_slot: bool,
    /// The hash went from no replica to some (or the reverse, for a clear).
    pub live_changed: bool,
}

impl BitTable {
    /// A table of `slots` (rounded up to a power of two, at least `MIN_SLOTS`) slots whose
    /// masks have `words` 64-bit words.
    pub(crate) fn new(slots: usize, words: usize) -> BitTable {
        let slots = slots.max(MIN_SLOTS).next_power_of_two();
        let words = words.clamp(1, MAX_WORDS);
        let stride = 1 + words;
        let cells: Box<[AtomicU64]> = (0..slots * stride).map(|_| AtomicU64::new(0)).collect();
        BitTable {
            words,
            stride,
            shift: 64 - slots.trailing_zeros(),
            slot_mask: slots - 1,
            cells,
            zero: Default::default(),
        }
    }

    pub(crate) fn words(&self) -> usize {
        self.words
    }

    pub(crate) fn slots(&self) -> usize {
        self.slot_mask + 1
    }

    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of::<BitTable>() + self.cells.len() * 8
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Fibonacci hashing: block hashes are already uniform, but tests and traces use small
        // sequential ids, which this spreads.
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    /// The slot holding `key`, if any. Readers and the writer.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let mut slot = self.home(key);
        loop {
            let k = self.cells[slot * self.stride].load(Ordering::Acquire);
            if k == key {
                return Some(slot);
            }
            if k == EMPTY {
                return None;
            }
            slot = (slot + 1) & self.slot_mask;
        }
    }

    #[inline]
    fn mask_cells(&self, key: u64, slot: Option<usize>) -> Option<&[AtomicU64]> {
        if key == EMPTY {
            return Some(&self.zero[..self.words]);
        }
        let base = slot? * self.stride + 1;
        Some(&self.cells[base..base + self.words])
    }

    /// Load the replicas holding `key` into `out` (words past `words()` are left alone).
    #[inline]
    pub(crate) fn load_mask(&self, key: u64, out: &mut Mask) -> bool {
        let slot = if key == EMPTY { None } else { self.find(key) };
        match self.mask_cells(key, slot) {
            Some(cells) => {
                for (o, c) in out.iter_mut().zip(cells) {
                    *o = c.load(Ordering::Relaxed);
                }
                true
            }
            None => false,
        }
    }

    /// The replicas holding `key`, as the first `W` mask words (all zero when no replica
    /// does); `W` must be `words()`. The reader's hot loop: no slice of cells is built.
    #[inline(always)]
    pub(crate) fn mask_words<const W: usize>(&self, key: u64) -> [u64; W] {
        debug_assert_eq!(W, self.words);
        let mut out = [0u64; W];
        if key == EMPTY {
            for (o, c) in out.iter_mut().zip(&self.zero) {
                *o = c.load(Ordering::Relaxed);
            }
            return out;
        }
        let mut slot = self.home(key);
        loop {
            let base = slot * self.stride;
            let Some(k) = self.cells.get(base) else {
                return out;
            };
            let k = k.load(Ordering::Acquire);
            if k == key {
                if let Some(cells) = self.cells.get(base + 1..base + 1 + W) {
                    for (o, c) in out.iter_mut().zip(cells) {
                        *o = c.load(Ordering::Relaxed);
                    }
                }
                return out;
            }
            if k == EMPTY {
                return out;
            }
            slot = (slot + 1) & self.slot_mask;
        }
    }

    /// Hint the cache to fetch `key`'s home slot ahead of a lookup.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        let slot = self.home(key);
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let p = self.cells[slot * self.stride..].as_ptr() as *const i8;
            // Safety: prefetching is only a hint; it never faults, whatever the address, and
            // `p` points inside `cells` anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = slot;
    }

    /// Writer only: set replica `r`'s bit of `key`, keying an empty slot if needed.
    pub(crate) fn set_bit(&self, key: u64, r: usize) -> Change {
        let (word, bit) = (r / 64, 1u64 << (r % 64));
        debug_assert!(word < self.words);
        let cells = if key == EMPTY {
            &self.zero[..self.words]
        } else {
            let mut slot = self.home(key);
            loop {
                let k = self.cells[slot * self.stride].load(Ordering::Relaxed);
                if k == key {
                    break;
                }
                if k == EMPTY {
                    // Fill the mask, then publish the key: a reader that sees the key sees
                    // the bit.
                    let base = slot * self.stride;
                    self.cells[base + 1 + word].store(bit, Ordering::Relaxed);
                    self.cells[base].store(key, Ordering::Release);
                    return Change {
                        new_slot: true,
                        live_changed: true,
                    };
                }
                slot = (slot + 1) & self.slot_mask;
            }
            let base = slot * self.stride + 1;
            &self.cells[base..base + self.words]
        };
        let was_empty = cells.iter().all(|c| c.load(Ordering::Relaxed) == 0);
        cells[word].fetch_or(bit, Ordering::Relaxed);
        Change {
            new_slot: false,
            live_changed: was_empty,
        }
    }

    /// Writer only: clear replica `r`'s bit of `key`.
    pub(crate) fn clear_bit(&self, key: u64, r: usize) -> Change {
        let (word, bit) = (r / 64, 1u64 << (r % 64));
        let slot = if key == EMPTY { None } else { self.find(key) };
        let Some(cells) = self.mask_cells(key, slot) else {
            return Change {
                new_slot: false,
                live_changed: false,
            };
        };
        let before = cells[word].fetch_and(!bit, Ordering::Relaxed);
        let now_empty = before & !bit == 0
            && cells
                .iter()
                .enumerate()
                .all(|(i, c)| i == word || c.load(Ordering::Relaxed) == 0);
        Change {
            new_slot: false,
            live_changed: before & bit != 0 && now_empty,
        }
    }

    /// Writer only: every key with a non-empty mask, and the mask, for a rebuild.
    pub(crate) fn for_each_live(&self, mut f: impl FnMut(u64, &Mask)) {
        let mut mask = [0u64; MAX_WORDS];
        if self.load_mask(EMPTY, &mut mask) && mask.iter().any(|w| *w != 0) {
            f(EMPTY, &mask);
        }
        for slot in 0..self.slots() {
            let base = slot * self.stride;
            let key = self.cells[base].load(Ordering::Relaxed);
            if key == EMPTY {
                continue;
            }
            let mut mask = [0u64; MAX_WORDS];
            for (m, c) in mask
                .iter_mut()
                .zip(&self.cells[base + 1..base + 1 + self.words])
            {
                *m = c.load(Ordering::Relaxed);
            }
            if mask.iter().any(|w| *w != 0) {
                f(key, &mask);
            }
        }
    }

    /// Writer only, on a table nobody reads yet: put `key` with `mask`.
    pub(crate) fn put(&self, key: u64, mask: &Mask) {
        for (w, &bits) in mask.iter().enumerate().take(self.words) {
            let mut rest = bits;
            while rest != 0 {
                let b = rest.trailing_zeros() as usize;
                self.set_bit(key, w * 64 + b);
                rest &= rest - 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_masks_and_the_zero_hash() {
        let t = BitTable::new(16, 4);
        assert_eq!(t.slots(), MIN_SLOTS);
        let mut m = [0; MAX_WORDS];
        assert!(!t.load_mask(5, &mut m));
        assert_eq!(
            t.set_bit(5, 200),
            Change {
                new_slot: true,
                live_changed: true
            }
        );
        assert_eq!(
            t.set_bit(5, 3),
            Change {
                new_slot: false,
                live_changed: false
            }
        );
        assert!(t.load_mask(5, &mut m));
        assert_eq!(m, [1 << 3, 0, 0, 1 << 8]);
        assert!(!t.clear_bit(5, 200).live_changed);
        assert!(t.clear_bit(5, 3).live_changed);
        // A dead slot stays keyed and is reused without a new slot.
        assert!(!t.set_bit(5, 1).new_slot);
        // Hash 0 is a block like any other.
        assert!(t.set_bit(0, 7).live_changed);
        assert!(t.load_mask(0, &mut m));
        assert_eq!(m[0], 1 << 7);
        let mut live = vec![];
        t.for_each_live(|k, m| live.push((k, m[0])));
        live.sort();
        assert_eq!(live, vec![(0, 1 << 7), (5, 1 << 1)]);
    }
}
