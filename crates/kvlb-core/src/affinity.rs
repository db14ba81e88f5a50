//! Conversation affinity: which replica stored a response.
//!
//! A Responses API conversation that continues with `previous_response_id` works only on the
//! replica that stored the earlier response (vLLM keeps its response store in the server's
//! memory): anywhere else it fails. kvlb learns each response id from the response it relays
//! and remembers the replica here; a request naming the id goes back there.
//!
//! # The table
//! A fixed array of `AtomicU64`, allocated once, grouped in buckets of [`WAYS`] entries (one
//! cache line). An id's 64-bit hash picks the bucket (low bits) and gives a 28-bit tag (high
//! bits); an entry packs the tag, the replica's slot (12 bits), the low 4 bits of the slot's
//! epoch (a slot reused by another replica since is not the holder) and the time it was
//! learned, in units of [`TICK_MS`] (20 bits, about 48 days, compared modulo). Reads and writes
//! are single relaxed atomic loads and stores, shared by all workers: no lock, no allocation.
//! Two workers writing the same bucket at once may lose one entry (the conversation then routes
//! by its prefix, and the engine answers its own not-found); nothing is ever torn, since an
//! entry is one word.
//!
//! A new id replaces, in its bucket, its own older entry, else an empty or expired one, else
//! the oldest (counted as an eviction: the table is too small for the TTL at this request
//! rate). A lookup finds an entry only while it is younger than the TTL. Two ids of a bucket
//! share a tag once in 2^28 lookups (a false hit sends the request to a replica that answers
//! the same not-found as any other).

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Entries of a bucket: 8 words, one 64-byte cache line.
pub const WAYS: usize = 8;
/// Time unit of an entry's age.
pub const TICK_MS: u64 = 4_000;
/// Most replica slots an entry can name.
pub const MAX_SLOTS: usize = 1 << SLOT_BITS;

const TAG_BITS: u32 = 28;
const SLOT_BITS: u32 = 12;
const EPOCH_BITS: u32 = 4;
const TIME_BITS: u32 = 20;
const TIME_MASK: u64 = (1 << TIME_BITS) - 1;
/// Longest TTL the 20-bit time can tell apart (half its range).
pub const MAX_TTL_MS: u64 = (1 << (TIME_BITS - 1)) * TICK_MS;

/// Where a response id's replica is remembered (see the module header).
pub struct AffinityTable {
    words: Box<[AtomicU64]>,
    /// Buckets - 1 (a power of two).
    mask: usize,
}

/// What [`AffinityTable::learn`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Learned {
    /// Stored in a free, expired or own entry.
    Stored,
    /// Stored over the oldest live entry of its bucket.
    Evicted,
    /// The table has no room (sized 0: affinity off) or the slot is out of range.
    Off,
}

impl AffinityTable {
    /// A table of at least `entries` entries (rounded up to whole buckets, a power of two of
    /// them); 0: none, affinity off.
    pub fn new(entries: usize) -> AffinityTable {
        if entries == 0 {
            return AffinityTable {
                words: Box::new([]),
                mask: 0,
            };
        }
        let buckets = entries.div_ceil(WAYS).next_power_of_two();
        AffinityTable {
            words: (0..buckets * WAYS).map(|_| AtomicU64::new(0)).collect(),
            mask: buckets - 1,
        }
    }

    /// Entries the table holds at most.
    pub fn capacity(&self) -> usize {
        self.words.len()
    }

    /// Remembers that `slot` (at `epoch`) holds the response whose id hashes to `hash`, at
    /// `now_ms` (any monotonic millisecond clock).
    pub fn learn(&self, hash: u64, slot: usize, epoch: u64, now_ms: u64, ttl_ms: u64) -> Learned {
        if self.words.is_empty() || slot >= MAX_SLOTS {
            return Learned::Off;
        }
        let (bucket, tag) = self.place(hash);
        let now = now_ms / TICK_MS;
        let entry = tag << (64 - TAG_BITS)
            | (slot as u64) << (EPOCH_BITS + TIME_BITS)
            | (epoch & ((1 << EPOCH_BITS) - 1)) << TIME_BITS
            | now & TIME_MASK;
        let ttl = ttl_ms.min(MAX_TTL_MS) / TICK_MS;
        let mut victim = 0;
        let mut victim_age = 0;
        let mut live_victim = true;
        for (i, word) in bucket.iter().enumerate() {
            let v = word.load(Relaxed);
            if v == 0 || v >> (64 - TAG_BITS) == tag {
                word.store(entry, Relaxed);
                return Learned::Stored;
            }
            let age = now.wrapping_sub(v) & TIME_MASK;
            if age > ttl {
                if live_victim || age > victim_age {
                    (victim, victim_age, live_victim) = (i, age, false);
                }
            } else if live_victim && age >= victim_age {
                (victim, victim_age) = (i, age);
            }
        }
        bucket[victim].store(entry, Relaxed);
        if live_victim {
            Learned::Evicted
        } else {
            Learned::Stored
        }
    }

    /// The slot and epoch (its low 4 bits) remembered for `hash`, if younger than `ttl_ms`.
    pub fn find(&self, hash: u64, now_ms: u64, ttl_ms: u64) -> Option<(usize, u64)> {
        if self.words.is_empty() {
            return None;
        }
        let (bucket, tag) = self.place(hash);
        let now = now_ms / TICK_MS;
        let ttl = ttl_ms.min(MAX_TTL_MS) / TICK_MS;
        for word in bucket {
            let v = word.load(Relaxed);
            if v != 0 && v >> (64 - TAG_BITS) == tag {
                if now.wrapping_sub(v) & TIME_MASK > ttl {
                    return None;
                }
                let slot = (v >> (EPOCH_BITS + TIME_BITS)) as usize & (MAX_SLOTS - 1);
                let epoch = (v >> TIME_BITS) & ((1 << EPOCH_BITS) - 1);
                return Some((slot, epoch));
            }
        }
        None
    }

    /// Whether `epoch` is the epoch an entry's low bits name.
    pub fn same_epoch(remembered: u64, epoch: u64) -> bool {
        remembered == epoch & ((1 << EPOCH_BITS) - 1)
    }

    fn place(&self, hash: u64) -> (&[AtomicU64], u64) {
        let b = (hash as usize & self.mask) * WAYS;
        // Tag 0 marks an empty entry.
        let tag = (hash >> (64 - TAG_BITS)).max(1);
        (&self.words[b..b + WAYS], tag)
    }
}

/// The hash an id is remembered under.
pub fn id_hash(id: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(id, 0x7265_7370_5f69_6421)
}

/// The response id (`resp_...`) a Responses API body names first, as the value of an `"id"`
/// member (the non-streaming response's first key; the `response` object of a stream's first
/// event): found in `bytes`, the start of the body (not necessarily all of it). Ids longer than
/// `MAX_ID` bytes or holding escapes are not ids kvlb learns.
pub fn response_id(bytes: &[u8]) -> Option<&[u8]> {
    const KEY: &[u8] = b"\"id\"";
    let mut from = 0;
    while let Some(at) = memchr::memmem::find(&bytes[from..], KEY) {
        let mut i = from + at + KEY.len();
        from = i;
        while bytes.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
            i += 1;
        }
        if bytes.get(i) != Some(&b':') {
            continue;
        }
        i += 1;
        while bytes.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
            i += 1;
        }
        if bytes.get(i) != Some(&b'"') {
            continue;
        }
        let start = i + 1;
        let end = start + memchr::memchr2(b'"', b'\\', bytes.get(start..)?)?;
        if bytes[end] != b'"' {
            return None;
        }
        let id = &bytes[start..end];
        return (id.starts_with(b"resp_") && id.len() <= MAX_ID).then_some(id);
    }
    None
}

/// Longest response id learned.
pub const MAX_ID: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_finds_and_forgets() {
        let t = AffinityTable::new(1000);
        assert_eq!(t.capacity(), 1024);
        let h = id_hash(b"resp_1");
        assert_eq!(t.find(h, 0, 60_000), None);
        assert_eq!(t.learn(h, 7, 0x13, 1_000, 60_000), Learned::Stored);
        assert_eq!(t.find(h, 2_000, 60_000), Some((7, 3)));
        assert!(AffinityTable::same_epoch(3, 0x13));
        assert!(!AffinityTable::same_epoch(3, 0x14));
        // Expired after the TTL.
        assert_eq!(t.find(h, 1_000 + 70_000, 60_000), None);
        // Learned again: moved.
        assert_eq!(t.learn(h, 9, 0, 100_000, 60_000), Learned::Stored);
        assert_eq!(t.find(h, 100_000, 60_000), Some((9, 0)));
        let off = AffinityTable::new(0);
        assert_eq!(off.learn(h, 1, 0, 0, 1), Learned::Off);
        assert_eq!(off.find(h, 0, 1), None);
        assert_eq!(t.learn(h, MAX_SLOTS, 0, 0, 1), Learned::Off);
    }

    #[test]
    fn a_full_bucket_evicts_its_oldest_and_reuses_expired_entries_first() {
        let t = AffinityTable::new(WAYS); // one bucket
        let ttl = 3_600_000;
        for i in 0..WAYS as u64 {
            let learned = t.learn(id_hash(&i.to_le_bytes()), i as usize, 0, i * TICK_MS, ttl);
            assert_eq!(learned, Learned::Stored);
        }
        let new = id_hash(b"new");
        assert_eq!(t.learn(new, 99, 0, 9 * TICK_MS, ttl), Learned::Evicted);
        assert_eq!(t.find(id_hash(&0u64.to_le_bytes()), 9 * TICK_MS, ttl), None);
        assert_eq!(t.find(new, 9 * TICK_MS, ttl), Some((99, 0)));
        // Much later everything has expired: no eviction counted.
        let later = 10 * ttl;
        assert_eq!(
            t.learn(id_hash(b"later"), 5, 0, later, ttl),
            Learned::Stored
        );
        assert_eq!(t.find(new, later, ttl), None);
    }

    #[test]
    fn many_ids_are_all_found_while_the_table_has_room() {
        let t = AffinityTable::new(1 << 16);
        let ttl = 3_600_000;
        // A quarter full: a bucket of 8 overflows about once in 30,000 (at 60% it is one
        // entry in 40: size the table at twice the ids alive within the TTL).
        let n = 16_384u64;
        let mut evicted = 0;
        for i in 0..n {
            let id = format!("resp_{i:032x}");
            evicted += (t.learn(id_hash(id.as_bytes()), (i % 4000) as usize, i, 0, ttl)
                == Learned::Evicted) as usize;
        }
        let found = (0..n)
            .filter(|i| {
                let id = format!("resp_{i:032x}");
                t.find(id_hash(id.as_bytes()), 0, ttl) == Some(((i % 4000) as usize, i & 15))
            })
            .count();
        assert_eq!(found + evicted, n as usize);
        assert!(evicted < 20, "{evicted} evicted at 25% load");
    }

    #[test]
    fn response_ids_are_read_from_bodies_and_first_events() {
        assert_eq!(
            response_id(br#"{"id":"resp_abc","created_at":1,"object":"response"}"#),
            Some(&b"resp_abc"[..])
        );
        assert_eq!(
            response_id(
                b"event: response.created\ndata: {\"response\": {\"id\" : \"resp_9\", \"x\": 1}, \"type\": \"response.created\"}"
            ),
            Some(&b"resp_9"[..])
        );
        // Another object's id first: not a response id.
        assert_eq!(response_id(br#"{"id":"msg_1","id2":"resp_1"}"#), None);
        assert_eq!(
            response_id(br#"{"xid":1,"id":"resp_1"}"#),
            Some(&b"resp_1"[..])
        );
        assert_eq!(response_id(br#"{"id":"resp_1"#), None);
        assert_eq!(response_id(br#"{"id":"resp_\u0031"}"#), None);
        assert_eq!(response_id(br#"{"id":5}"#), None);
        let long = format!(r#"{{"id":"resp_{}"}}"#, "a".repeat(MAX_ID));
        assert_eq!(response_id(long.as_bytes()), None);
        assert_eq!(response_id(b""), None);
    }
}
