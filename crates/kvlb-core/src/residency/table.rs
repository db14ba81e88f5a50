//! The shared residency table: block hash -> the replicas holding that block.
//!
//! Open addressing with linear probing over one flat array of atomics; a slot is two words,
//! `[key, holders]`. Key 0 marks an empty slot; the block hash 0 lives in a dedicated side
//! word instead, so every u64 is a valid block hash and lookups are exact (no false positives).
//!
//! The holders word is one of two forms (`Holders`):
//! * **inline**: up to `INLINE` replica ids of 12 bits each (bits `12 * i ..`), their number in
//!   bits 60..63. Almost every block is held by one to a few replicas, so the slot is 16 bytes
//!   whatever the fleet's size.
//! * **overflow** (bit 63 set): the index of a row in the table's *arena*, a bitmask of
//!   `words` 64-bit words (`ceil(max_replicas / 64)`), for blocks held by more than `INLINE`
//!   replicas (a system prompt, a tool preamble).
//!
//! One writer, many readers, no locks:
//! * A slot gets its key once and keeps it for the table's life: the writer fills the holders
//!   word of an empty slot first and then publishes the key with `Release`; readers load keys
//!   with `Acquire`. A slot whose holders drop to none stays keyed ("dead") and is reused if
//!   the same hash comes back; dead slots disappear when the writer rebuilds into a fresh table.
//! * An inline word changes by one `Release` store of the whole new word; a reader (`Acquire`)
//!   sees the holders before or after the change, never a mix.
//! * Going from inline to overflow, the writer takes a row never used before in this table
//!   (zero), sets the holders' bits, then stores the overflow word with `Release`: a reader that
//!   sees the row index sees its bits. Row bits then change by single `fetch_or` / `fetch_and`.
//!   A row is never reused within a table, not even when its block goes back to a few holders
//!   or none (a reader may still be reading it): the block keeps its row until the next
//!   rebuild, which puts blocks back inline when they fit, and rows freed that way are
//!   reclaimed with the old table.
//! * The writer keeps occupied slots (live + dead) at most half of the table, and rebuilds
//!   before the arena runs out, so a probe always meets an empty slot and readers never loop.

use std::sync::atomic::{AtomicU64, Ordering};

/// Most replicas a table can name: ids are 12 bits.
pub(crate) const ID_LIMIT: usize = 1 << ID_BITS;
const ID_BITS: u32 = 12;
const ID_MASK: u64 = (1 << ID_BITS) - 1;
/// Replica ids an inline holders word carries.
pub(crate) const INLINE: usize = 5;
const COUNT_SHIFT: u32 = 60;
const OVERFLOW: u64 = 1 << 63;
const EMPTY: u64 = 0;
pub(crate) const MIN_SLOTS: usize = 1024;
/// Arena rows a table starts with (and at least has).
pub(crate) const MIN_ROWS: usize = 64;

/// A holders word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holders {
    /// Up to `INLINE` replica ids (the word itself; `inline_ids` reads them).
    Inline(u64),
    /// An arena row.
    Row(usize),
}

#[inline(always)]
pub(crate) fn decode(word: u64) -> Holders {
    if word & OVERFLOW != 0 {
        Holders::Row((word & 0xffff_ffff) as usize)
    } else {
        Holders::Inline(word)
    }
}

/// Replica ids in an inline word.
#[inline(always)]
pub(crate) fn inline_len(word: u64) -> usize {
    (word >> COUNT_SHIFT) as usize
}

#[inline(always)]
pub(crate) fn inline_id(word: u64, i: usize) -> usize {
    ((word >> (ID_BITS as usize * i)) & ID_MASK) as usize
}

/// Whether an inline word names replica `r`.
#[inline(always)]
pub(crate) fn inline_has(word: u64, r: usize) -> bool {
    (0..inline_len(word)).any(|i| inline_id(word, i) == r)
}

fn inline_word(ids: &[usize]) -> u64 {
    debug_assert!(ids.len() <= INLINE);
    let mut w = (ids.len() as u64) << COUNT_SHIFT;
    for (i, &r) in ids.iter().enumerate() {
        w |= (r as u64 & ID_MASK) << (ID_BITS as usize * i);
    }
    w
}

fn inline_push(word: u64, r: usize) -> u64 {
    let n = inline_len(word);
    debug_assert!(n < INLINE);
    let cleared = word & !(0xf << COUNT_SHIFT);
    cleared | ((n as u64 + 1) << COUNT_SHIFT) | ((r as u64 & ID_MASK) << (ID_BITS as usize * n))
}

/// `word` without replica `r` (the last id takes its place), or `None` if `r` is not there.
fn inline_without(word: u64, r: usize) -> Option<u64> {
    let n = inline_len(word);
    let at = (0..n).find(|&i| inline_id(word, i) == r)?;
    let mut ids = [0usize; INLINE];
    for (i, id) in ids.iter_mut().enumerate().take(n) {
        *id = inline_id(word, i);
    }
    ids[at] = ids[n - 1];
    Some(inline_word(&ids[..n - 1]))
}

pub(crate) struct BitTable {
    /// Mask words of an arena row.
    words: usize,
    shift: u32,
    slot_mask: usize,
    cells: Box<[AtomicU64]>,
    /// Overflow rows, `words` each; `next_row` is the first never used.
    arena: Box<[AtomicU64]>,
    next_row: AtomicU64,
    zero: AtomicU64,
}

/// What a bit change did to the table's occupancy, for the writer's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Change {
    /// An empty slot got a key.
    pub new_slot: bool,
    /// The hash went from no replica to some (or the reverse, for a clear).
    pub live_changed: bool,
}

const NO_CHANGE: Change = Change {
    new_slot: false,
    live_changed: false,
};

impl BitTable {
    /// A table of `slots` (rounded up to a power of two, at least `MIN_SLOTS`) slots and
    /// `rows` (at least `MIN_ROWS`) overflow rows of `words` 64-bit words.
    pub(crate) fn new(slots: usize, words: usize, rows: usize) -> BitTable {
        let slots = slots.max(MIN_SLOTS).next_power_of_two();
        let words = words.clamp(1, ID_LIMIT / 64);
        let rows = rows.max(MIN_ROWS);
        let cells: Box<[AtomicU64]> = (0..slots * 2).map(|_| AtomicU64::new(0)).collect();
        let arena: Box<[AtomicU64]> = (0..rows * words).map(|_| AtomicU64::new(0)).collect();
        BitTable {
            words,
            shift: 64 - slots.trailing_zeros(),
            slot_mask: slots - 1,
            cells,
            arena,
            next_row: AtomicU64::new(0),
            zero: AtomicU64::new(0),
        }
    }

    pub(crate) fn words(&self) -> usize {
        self.words
    }

    pub(crate) fn slots(&self) -> usize {
        self.slot_mask + 1
    }

    /// Arena rows in all, and those never used yet.
    pub(crate) fn rows(&self) -> usize {
        self.arena.len() / self.words
    }

    pub(crate) fn rows_free(&self) -> usize {
        self.rows() - self.next_row.load(Ordering::Relaxed) as usize
    }

    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of::<BitTable>() + (self.cells.len() + self.arena.len()) * 8
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Fibonacci hashing: block hashes are already uniform, but tests and traces use small
        // sequential ids, which this spreads.
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    /// The holders word of `key`'s slot, if any. Readers and the writer.
    #[inline]
    fn cell(&self, key: u64) -> Option<&AtomicU64> {
        if key == EMPTY {
            return Some(&self.zero);
        }
        let mut slot = self.home(key);
        loop {
            let k = self.cells.get(slot * 2)?.load(Ordering::Acquire);
            if k == key {
                return self.cells.get(slot * 2 + 1);
            }
            if k == EMPTY {
                return None;
            }
            slot = (slot + 1) & self.slot_mask;
        }
    }

    /// The holders word of `key` (0, no holder, when absent). The reader's hot path.
    #[inline(always)]
    pub(crate) fn holders(&self, key: u64) -> u64 {
        self.cell(key).map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Row `row`'s words (empty for a row outside the arena).
    #[inline(always)]
    pub(crate) fn row(&self, row: usize) -> &[AtomicU64] {
        self.arena
            .get(row * self.words..(row + 1) * self.words)
            .unwrap_or(&[])
    }

    /// Whether replica `r` is among `word`'s holders.
    #[inline(always)]
    pub(crate) fn has(&self, word: u64, r: usize) -> bool {
        match decode(word) {
            Holders::Inline(w) => inline_has(w, r),
            Holders::Row(row) => self
                .row(row)
                .get(r / 64)
                .is_some_and(|c| c.load(Ordering::Relaxed) & (1 << (r % 64)) != 0),
        }
    }

    /// Hint the cache to fetch `key`'s home slot ahead of a lookup.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        let slot = self.home(key);
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let p = self.cells[slot * 2..].as_ptr() as *const i8;
            // Safety: prefetching is only a hint; it never faults, whatever the address, and
            // `p` points inside `cells` anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = slot;
    }

    /// Writer only: the holders cell of `key`, and the slot to publish the key in when it is
    /// an empty one (its holders word is 0, none, already; the caller fills it first).
    fn cell_or_insert(&self, key: u64) -> (&AtomicU64, Option<usize>) {
        if key == EMPTY {
            return (&self.zero, None);
        }
        let mut slot = self.home(key);
        loop {
            let k = self.cells[slot * 2].load(Ordering::Relaxed);
            if k == key {
                return (&self.cells[slot * 2 + 1], None);
            }
            if k == EMPTY {
                return (&self.cells[slot * 2 + 1], Some(slot));
            }
            slot = (slot + 1) & self.slot_mask;
        }
    }

    /// Writer only: add replica `r` to `key`'s holders, keying an empty slot if needed. Needs
    /// a free arena row when the block has `INLINE` inline holders already (`rows_free`).
    pub(crate) fn set_bit(&self, key: u64, r: usize) -> Change {
        debug_assert!(r < self.words * 64);
        let (cell, fresh) = self.cell_or_insert(key);
        let new_slot = fresh.is_some();
        let word = cell.load(Ordering::Relaxed);
        let change = match decode(word) {
            Holders::Inline(w) if inline_has(w, r) => NO_CHANGE,
            Holders::Inline(w) if inline_len(w) < INLINE => {
                cell.store(inline_push(w, r), Ordering::Release);
                Change {
                    new_slot,
                    live_changed: inline_len(w) == 0,
                }
            }
            Holders::Inline(w) => {
                let row = self.next_row.fetch_add(1, Ordering::Relaxed) as usize;
                let cells = self.row(row);
                assert!(!cells.is_empty(), "residency arena out of rows");
                for i in 0..INLINE {
                    let id = inline_id(w, i);
                    cells[id / 64].fetch_or(1 << (id % 64), Ordering::Relaxed);
                }
                cells[r / 64].fetch_or(1 << (r % 64), Ordering::Relaxed);
                cell.store(OVERFLOW | row as u64, Ordering::Release);
                NO_CHANGE
            }
            Holders::Row(row) => {
                let cells = self.row(row);
                let was_empty = cells.iter().all(|c| c.load(Ordering::Relaxed) == 0);
                cells[r / 64].fetch_or(1 << (r % 64), Ordering::Relaxed);
                Change {
                    new_slot: false,
                    live_changed: was_empty,
                }
            }
        };
        if let Some(slot) = fresh {
            // Holders first, then the key: a reader that sees the key sees the holders.
            self.cells[slot * 2].store(key, Ordering::Release);
        }
        change
    }

    /// Writer only: remove replica `r` from `key`'s holders.
    pub(crate) fn clear_bit(&self, key: u64, r: usize) -> Change {
        let Some(cell) = self.cell(key) else {
            return NO_CHANGE;
        };
        let word = cell.load(Ordering::Relaxed);
        match decode(word) {
            Holders::Inline(w) => match inline_without(w, r) {
                Some(rest) => {
                    cell.store(rest, Ordering::Release);
                    Change {
                        new_slot: false,
                        live_changed: inline_len(rest) == 0,
                    }
                }
                None => NO_CHANGE,
            },
            Holders::Row(row) => {
                let cells = self.row(row);
                let bit = 1u64 << (r % 64);
                let before = cells[r / 64].fetch_and(!bit, Ordering::Relaxed);
                let now_empty = before & bit != 0
                    && before & !bit == 0
                    && cells.iter().all(|c| c.load(Ordering::Relaxed) == 0);
                Change {
                    new_slot: false,
                    live_changed: now_empty,
                }
            }
        }
    }

    /// The holders of a word, as replica ids, to `f`.
    pub(crate) fn for_each_holder(&self, word: u64, mut f: impl FnMut(usize)) {
        match decode(word) {
            Holders::Inline(w) => (0..inline_len(w)).for_each(|i| f(inline_id(w, i))),
            Holders::Row(row) => {
                for (k, c) in self.row(row).iter().enumerate() {
                    let mut rest = c.load(Ordering::Relaxed);
                    while rest != 0 {
                        f(k * 64 + rest.trailing_zeros() as usize);
                        rest &= rest - 1;
                    }
                }
            }
        }
    }

    /// How many replicas a word names.
    pub(crate) fn holder_count(&self, word: u64) -> usize {
        match decode(word) {
            Holders::Inline(w) => inline_len(w),
            Holders::Row(row) => self
                .row(row)
                .iter()
                .map(|c| c.load(Ordering::Relaxed).count_ones() as usize)
                .sum(),
        }
    }

    /// Writer only: every key with at least one holder, and its holders word, for a rebuild.
    pub(crate) fn for_each_live(&self, mut f: impl FnMut(u64, u64)) {
        let zero = self.zero.load(Ordering::Relaxed);
        if self.holder_count(zero) > 0 {
            f(EMPTY, zero);
        }
        for slot in 0..self.slots() {
            let key = self.cells[slot * 2].load(Ordering::Relaxed);
            if key == EMPTY {
                continue;
            }
            let word = self.cells[slot * 2 + 1].load(Ordering::Relaxed);
            if self.holder_count(word) > 0 {
                f(key, word);
            }
        }
    }

    /// Writer only, on a table nobody reads yet: put `key` with the holders `word` names in
    /// `from`.
    pub(crate) fn put(&self, key: u64, from: &BitTable, word: u64) {
        from.for_each_holder(word, |r| {
            self.set_bit(key, r);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holders(t: &BitTable, key: u64) -> Vec<usize> {
        let mut v = vec![];
        t.for_each_holder(t.holders(key), |r| v.push(r));
        v.sort();
        v
    }

    #[test]
    fn keys_holders_and_the_zero_hash() {
        let t = BitTable::new(16, 4, 0);
        assert_eq!(t.slots(), MIN_SLOTS);
        assert_eq!(t.holders(5), 0);
        assert_eq!(
            t.set_bit(5, 200),
            Change {
                new_slot: true,
                live_changed: true
            }
        );
        assert_eq!(t.set_bit(5, 3), NO_CHANGE);
        assert_eq!(holders(&t, 5), vec![3, 200]);
        assert!(!t.clear_bit(5, 200).live_changed);
        assert!(t.clear_bit(5, 3).live_changed);
        // A dead slot stays keyed and is reused without a new slot.
        assert!(!t.set_bit(5, 1).new_slot);
        // Hash 0 is a block like any other.
        assert!(t.set_bit(0, 7).live_changed);
        assert_eq!(holders(&t, 0), vec![7]);
        let mut live = vec![];
        t.for_each_live(|k, w| live.push((k, t.holder_count(w))));
        live.sort();
        assert_eq!(live, vec![(0, 1), (5, 1)]);
    }

    #[test]
    fn inline_to_overflow_and_back_to_none() {
        let t = BitTable::new(16, 64, 0);
        let ids = [4095, 0, 64, 1000, 7, 2048, 9];
        for (k, &r) in ids.iter().enumerate() {
            let c = t.set_bit(42, r);
            assert_eq!(c.live_changed, k == 0);
            assert!(t.has(t.holders(42), r));
        }
        assert!(matches!(decode(t.holders(42)), Holders::Row(0)));
        assert_eq!(t.rows_free(), MIN_ROWS - 1);
        let mut sorted = ids.to_vec();
        sorted.sort();
        assert_eq!(holders(&t, 42), sorted);
        for (k, &r) in ids.iter().enumerate() {
            assert_eq!(t.clear_bit(42, r).live_changed, k == ids.len() - 1);
            assert!(!t.has(t.holders(42), r));
        }
        // The row stays the block's until a rebuild: no row is taken again.
        for &r in &ids {
            t.set_bit(42, r);
        }
        assert_eq!(t.rows_free(), MIN_ROWS - 1);
        // A rebuild puts a block that fits back inline.
        t.clear_bit(42, 9);
        t.clear_bit(42, 2048);
        let fresh = BitTable::new(16, 64, 0);
        t.for_each_live(|k, w| fresh.put(k, &t, w));
        assert!(matches!(decode(fresh.holders(42)), Holders::Inline(_)));
        assert_eq!(holders(&fresh, 42), vec![0, 7, 64, 1000, 4095]);
        assert_eq!(fresh.rows_free(), MIN_ROWS);
    }

    #[test]
    fn inline_removal_keeps_the_others() {
        let w = inline_word(&[1, 2, 3, 4]);
        let w = inline_without(w, 2).unwrap();
        assert_eq!(inline_len(w), 3);
        assert!(inline_has(w, 1) && inline_has(w, 3) && inline_has(w, 4) && !inline_has(w, 2));
        assert_eq!(inline_without(w, 9), None);
        let w = inline_push(w, 4095);
        assert!(inline_has(w, 4095));
        assert_eq!(inline_len(w), 4);
    }
}
