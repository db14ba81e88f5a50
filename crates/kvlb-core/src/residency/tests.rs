//! Property tests of the residency index against a brute-force model, with a seeded RNG.

#![forbid(unsafe_code)]
#![allow(clippy::disallowed_methods, reason = "the tests time the index")]

use super::*;

/// splitmix64: the tests' seeded source of randomness.
struct TestRng(u64);

impl TestRng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn chain_hash(prev: u64, branch: u64) -> u64 {
    let mut z = prev ^ branch.wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    z ^ (z >> 33)
}

/// A prompt drawn from a tree of prefixes (3 branches a level), so requests share prefixes;
/// its first block is sometimes hash 0.
fn prompt(rng: &mut TestRng, max_len: u64) -> Vec<u64> {
    let len = 1 + rng.below(max_len);
    let mut blocks = Vec::with_capacity(len as usize);
    let mut prev = if rng.below(4) == 0 {
        0
    } else {
        1 + rng.below(3)
    };
    blocks.push(prev);
    for _ in 1..len {
        prev = chain_hash(prev, rng.below(3));
        blocks.push(prev);
    }
    blocks
}

/// One block in the model: hash, copies, last use, and the replica's store count when it
/// became pending (None: not pending).
#[derive(Clone, Copy)]
struct Entry {
    hash: u64,
    count: u32,
    last_used: u64,
    pending: Option<u64>,
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Stored,
    Guessed,
    Routed,
}

/// The writer's semantics, the slow obvious way: per replica, its entries in MRU order and
/// the blocks it reported stored. Guesses (no copy) and confirmed entries (copies) are each
/// bounded by the capacity, the least recent of their kind going first.
struct Model {
    capacity: Vec<usize>,
    lru: Vec<Vec<Entry>>,
    stored: Vec<u64>,
    clock: u64,
    pending_ttl: u64,
}

impl Model {
    fn new(replicas: usize, capacity: usize, pending_ttl: u64) -> Model {
        Model {
            capacity: vec![capacity; replicas],
            lru: vec![Vec::new(); replicas],
            stored: vec![0; replicas],
            clock: 0,
            pending_ttl,
        }
    }

    fn apply(&mut self, r: usize, blocks: &[u64], now: u64, op: Op) {
        self.clock = self.clock.max(now);
        if op == Op::Stored {
            self.stored[r] += blocks.len() as u64;
        }
        let op = if op == Op::Routed && self.pending_ttl == 0 {
            Op::Guessed
        } else {
            op
        };
        for &h in blocks.iter().rev() {
            let list = &mut self.lru[r];
            let mut e = match list.iter().position(|e| e.hash == h) {
                Some(p) => list.remove(p),
                None => Entry {
                    hash: h,
                    count: 0,
                    last_used: now,
                    pending: None,
                },
            };
            e.last_used = now;
            match op {
                Op::Stored => {
                    e.count += 1;
                    e.pending = None;
                }
                Op::Routed => e.pending = Some(self.stored[r]),
                Op::Guessed => {}
            }
            list.insert(0, e);
        }
        self.evict(r);
    }

    fn evict(&mut self, r: usize) {
        let cap = self.capacity[r];
        for confirmed in [false, true] {
            while self.lru[r]
                .iter()
                .filter(|e| (e.count > 0) == confirmed)
                .count()
                > cap
            {
                let p = self.lru[r]
                    .iter()
                    .rposition(|e| (e.count > 0) == confirmed)
                    .unwrap();
                self.lru[r].remove(p);
            }
        }
    }

    fn remove(&mut self, r: usize, h: u64, now: u64) {
        self.clock = self.clock.max(now);
        let (stored, capacity, ttl) = (self.stored[r], self.capacity[r], self.pending_ttl);
        let list = &mut self.lru[r];
        if let Some(p) = list.iter().position(|e| e.hash == h) {
            let e = &mut list[p];
            e.count = e.count.saturating_sub(1);
            let keep = e.pending.is_some_and(|mark| {
                now.saturating_sub(e.last_used) < ttl && ((stored - mark) as usize) < capacity
            });
            if e.count == 0 {
                let e = list.remove(p);
                if keep {
                    // Kept as a guess: the most recent one, its last use unchanged.
                    list.insert(0, e);
                }
            }
            self.evict(r);
        }
    }

    fn clear(&mut self, r: usize) {
        self.lru[r].clear();
        self.stored[r] = 0;
    }

    fn matched(&self, blocks: &[u64]) -> Vec<u32> {
        self.lru
            .iter()
            .map(|list| {
                blocks
                    .iter()
                    .take_while(|h| list.iter().any(|e| e.hash == **h))
                    .count() as u32
            })
            .collect()
    }
}

fn index(replicas: usize, capacity_blocks: u64) -> (Arc<ResidencyIndex>, ResidencyWriter) {
    ResidencyIndex::new(ResidencyConfig {
        max_replicas: replicas,
        block_tokens: 16,
        kv_capacity_tokens: capacity_blocks * 16,
    })
    .unwrap()
}

#[test]
fn matches_the_model_through_inserts_removals_evictions_and_clears() {
    for (replicas, capacity, seed, ttl) in [
        (3, 40, 1, 0),
        (3, 40, 4, 30),
        (70, 25, 2, 60),
        (256, 60, 3, 200),
        (1024, 30, 5, 100),
        (4096, 12, 6, 50),
    ] {
        let (idx, mut w) = index(replicas, capacity as u64);
        w.set_pending_ttl(Duration::from_micros(ttl));
        let mut model = Model::new(replicas, capacity, ttl);
        let mut rng = TestRng(seed);
        let mut out = vec![0u32; replicas + 2];
        let (mut queries, mut mismatches, mut kept) = (0u64, 0u64, 0u64);
        for step in 0..4000u64 {
            let r = rng.below(replicas as u64) as usize;
            let blocks = prompt(&mut rng, 16);
            match rng.below(22) {
                0..=7 => {
                    w.insert(r, &blocks, step).unwrap();
                    model.apply(r, &blocks, step, Op::Stored);
                }
                8..=10 => {
                    w.insert_routed(r, &blocks, step).unwrap();
                    model.apply(r, &blocks, step, Op::Guessed);
                }
                11..=13 => {
                    w.route(r, &blocks, step).unwrap();
                    model.apply(r, &blocks, step, Op::Routed);
                }
                14..=18 => {
                    let h = blocks[rng.below(blocks.len() as u64) as usize];
                    let was_pending = w.is_pending(r, h) && w.copies(r, h) <= 1;
                    // Half at the writer's own clock, half at a time of their own.
                    if step % 2 == 0 {
                        w.remove(r, h).unwrap();
                        model.remove(r, h, model.clock);
                    } else {
                        w.remove_at(r, h, step).unwrap();
                        model.remove(r, h, step);
                    }
                    kept += (was_pending && w.holds(r, h)) as u64;
                }
                19 => {
                    let cap = 1 + rng.below(2 * capacity as u64) as usize;
                    w.set_capacity_tokens(r, cap as u64 * 16).unwrap();
                    model.capacity[r] = cap;
                    model.apply(r, &[], 0, Op::Guessed);
                }
                _ => {
                    w.clear(r).unwrap();
                    model.clear(r);
                }
            }
            for _ in 0..3 {
                let q = prompt(&mut rng, 16);
                idx.match_prefix(&q, &mut out);
                let want = model.matched(&q);
                queries += 1;
                if out[..replicas] != want[..] || out[replicas..].iter().any(|&x| x != 0) {
                    mismatches += 1;
                }
                assert_eq!(out[..replicas], want[..], "step {step} query {q:?}");
                // The sparse form names exactly the replicas with a match, once each.
                let mut sparse = vec![];
                idx.match_each(&q, replicas, |r, d| sparse.push((r, d)));
                sparse.sort();
                let dense: Vec<(usize, u32)> = (0..replicas)
                    .filter(|&r| want[r] > 0)
                    .map(|r| (r, want[r]))
                    .collect();
                assert_eq!(sparse, dense, "step {step} query {q:?}");
            }
            for (r, list) in model.lru.iter().enumerate() {
                assert_eq!(idx.replica_blocks(r), list.len(), "replica {r}");
                let confirmed = list.iter().filter(|e| e.count > 0).count();
                assert_eq!(idx.reported_blocks(r), confirmed, "replica {r}");
                assert!(confirmed <= model.capacity[r]);
                assert!(list.len() - confirmed <= model.capacity[r]);
            }
            for e in model.lru[r].iter().take(4) {
                assert!(w.holds(r, e.hash));
                assert_eq!(w.copies(r, e.hash), e.count);
                assert_eq!(w.is_pending(r, e.hash), e.pending.is_some());
            }
        }
        // No false positives and no false negatives: measured over every query.
        assert_eq!(mismatches, 0, "{mismatches} of {queries}");
        assert!(idx.rebuilds() > 0 || replicas < 10);
        // The pending rule was exercised where it is on (the large fleets see too few
        // operations per replica to be sure of it), and never fires where it is off.
        if replicas <= 256 || ttl == 0 {
            assert_eq!(kept == 0, ttl == 0, "{kept} removals kept a pending block");
        }
    }
}

#[test]
fn copies_are_counted_and_routing_guesses_yield_to_events() {
    let (idx, mut w) = index(2, 100);
    let mut out = [0u32; 2];
    w.insert(0, &[7, 8], 0).unwrap();
    w.insert(0, &[7], 1).unwrap();
    assert_eq!(w.copies(0, 7), 2);
    w.remove(0, 7).unwrap();
    idx.match_prefix(&[7, 8], &mut out);
    assert_eq!(out, [2, 0]);
    w.remove(0, 7).unwrap();
    idx.match_prefix(&[7, 8], &mut out);
    assert_eq!(out, [0, 0]);
    // A routed guess has no copies: one BlockRemoved drops it; BlockStored makes it real.
    w.insert_routed(1, &[7, 8], 2).unwrap();
    w.insert_routed(1, &[7, 8], 3).unwrap();
    assert_eq!(w.copies(1, 7), 0);
    idx.match_prefix(&[7, 8, 9], &mut out);
    assert_eq!(out, [0, 2]);
    w.insert(1, &[8], 4).unwrap();
    assert_eq!(w.copies(1, 8), 1);
    w.remove(1, 7).unwrap();
    w.remove(1, 99).unwrap(); // unknown: ignored
    idx.match_prefix(&[7, 8], &mut out);
    assert_eq!(out, [0, 0]);
    assert!(w.holds(1, 8));
    assert!(w.insert(2, &[1], 0).unwrap_err().contains("replica 2"));
    for ok in [257, 1024, MAX_REPLICAS] {
        assert!(ResidencyIndex::new(ResidencyConfig {
            max_replicas: ok,
            ..ResidencyConfig::default()
        })
        .is_ok());
    }
    let err = ResidencyIndex::new(ResidencyConfig {
        max_replicas: MAX_REPLICAS + 1,
        ..ResidencyConfig::default()
    })
    .err()
    .unwrap();
    assert!(err.contains("max_replicas must be 1..=4096"), "{err}");
}

#[test]
fn a_block_goes_inline_to_overflow_and_back_across_a_large_fleet() {
    let replicas = 1500;
    let (idx, mut w) = index(replicas, 100);
    let p: Vec<u64> = (0..40).map(|i| chain_hash(77, i)).collect();
    let holders = [3usize, 1499, 64, 700, 1024, 5, 1300, 8];
    let mut out = vec![0u32; replicas];
    // Replica k of `holders` holds the first 40 - 4k blocks: a block goes past the inline
    // holders, then back under them, as the prompt goes on.
    for (k, &r) in holders.iter().enumerate() {
        w.insert(r, &p[..40 - 4 * k], 1).unwrap();
    }
    idx.match_prefix(&p, &mut out);
    for (k, &r) in holders.iter().enumerate() {
        assert_eq!(out[r], (40 - 4 * k) as u32, "replica {r}");
    }
    assert_eq!(out.iter().filter(|&&d| d > 0).count(), holders.len());
    // Removals from a block in a row, down to nobody, and back.
    for &r in &holders {
        w.remove(r, p[0]).unwrap();
    }
    idx.match_prefix(&p, &mut out);
    assert!(out.iter().all(|&d| d == 0));
    assert_eq!(idx.distinct_blocks(), 39);
    w.insert(1499, &p[..1], 2).unwrap();
    idx.match_prefix(&p, &mut out);
    assert_eq!(out[1499], 36);
    // Clears, then a fleet-wide prefix held by everybody (one row per block), then rebuilds
    // as blocks come and go.
    for &r in &holders {
        w.clear(r).unwrap();
    }
    assert_eq!(idx.distinct_blocks(), 0);
    for r in 0..replicas {
        w.insert(r, &p[..8], 3).unwrap();
        w.insert(r, &[chain_hash(r as u64, 99)], 3).unwrap();
    }
    idx.match_prefix(&p, &mut out);
    assert!(out.iter().all(|&d| d == 8));
    let mut n = 0;
    idx.match_each(&p, replicas, |_, d| {
        assert_eq!(d, 8);
        n += 1;
    });
    assert_eq!(n, replicas);
    let rebuilds = idx.rebuilds();
    for r in 0..replicas - 2 {
        w.clear(r).unwrap();
    }
    assert!(idx.rebuilds() > rebuilds);
    idx.match_prefix(&p, &mut out);
    assert_eq!(out.iter().filter(|&&d| d == 8).count(), 2);
    assert_eq!(idx.distinct_blocks(), 8 + 2);
}

#[test]
fn a_refresh_touches_and_confirms_without_adding_a_copy() {
    // Capacity 3 blocks: a refresh of the oldest block saves it from the next eviction.
    let (idx, mut w) = index(1, 3);
    let mut out = [0u32; 1];
    w.insert(0, &[1, 2, 3], 0).unwrap();
    w.refresh(0, &[1], 1).unwrap();
    assert_eq!(w.copies(0, 1), 1, "a refresh adds no copy");
    w.insert(0, &[4], 2).unwrap();
    assert!(
        w.holds(0, 1) && !w.holds(0, 3),
        "block 1 was refreshed, 3 is the oldest"
    );
    // One BlockRemoved still drops a refreshed block.
    w.remove(0, 1).unwrap();
    idx.match_prefix(&[1], &mut out);
    assert_eq!(out, [0]);
    // A guess is confirmed with one copy; a missing block comes back with one copy; neither
    // stays pending, so one removal drops it.
    w.route(0, &[5], 3).unwrap();
    assert!(w.is_pending(0, 5));
    w.refresh(0, &[5, 6], 4).unwrap();
    assert_eq!((w.copies(0, 5), w.copies(0, 6)), (1, 1));
    assert!(!w.is_pending(0, 5));
    w.remove(0, 5).unwrap();
    w.remove(0, 6).unwrap();
    assert!(!w.holds(0, 5) && !w.holds(0, 6));
}

#[test]
fn lru_evicts_leaves_before_the_shared_prefix() {
    let (idx, mut w) = index(1, 6);
    let mut out = [0u32];
    w.insert_routed(0, &[1, 2, 3, 4], 0).unwrap();
    w.insert_routed(0, &[1, 2, 5, 6], 1).unwrap();
    // 6 distinct blocks fit. A third prompt on the same prefix evicts the oldest leaves (4, 3).
    w.insert_routed(0, &[1, 2, 9, 10], 2).unwrap();
    assert!(!w.holds(0, 4) && !w.holds(0, 3));
    idx.match_prefix(&[1, 2, 5, 6], &mut out);
    assert_eq!(out, [4]);
    idx.match_prefix(&[1, 2, 3, 4], &mut out);
    assert_eq!(out, [2]);
    // Expiry drops the guesses not used since a time, oldest first.
    assert_eq!(w.expire_guesses(0, 2).unwrap(), 2);
    idx.match_prefix(&[1, 2, 9], &mut out);
    assert_eq!(out, [3]);
    assert_eq!(idx.replica_blocks(0), 4);
}

#[test]
fn memory_stays_bounded_under_a_long_insert_stream() {
    let (replicas, capacity) = (8usize, 2000u64);
    let (idx, mut w) = index(replicas, capacity);
    let mut rng = TestRng(9);
    let mut peak = 0;
    let mut next_hash = 1u64;
    for step in 0..60_000u64 {
        let r = rng.below(replicas as u64) as usize;
        // Fresh blocks every time: the worst case for dead slots and eviction.
        let blocks: Vec<u64> = (0..8)
            .map(|_| {
                next_hash += 1;
                chain_hash(next_hash, 0)
            })
            .collect();
        w.insert_routed(r, &blocks, step).unwrap();
        if step > 10_000 {
            peak = peak.max(idx.bytes());
        }
    }
    let resident: usize = (0..replicas).map(|r| idx.replica_blocks(r)).sum();
    assert_eq!(resident, replicas * capacity as usize);
    assert_eq!(idx.distinct_blocks(), resident);
    let per_block = peak as f64 / resident as f64;
    println!(
        "peak {peak} bytes for {resident} resident blocks: {per_block:.0} B/block, {} rebuilds",
        idx.rebuilds()
    );
    assert!(per_block < 200.0, "{per_block}");
    // Clearing everything gives the table back down to its minimum.
    for r in 0..replicas {
        w.clear(r).unwrap();
    }
    assert_eq!(idx.distinct_blocks(), 0);
    assert!(idx.bytes() < 64 * 1024, "{}", idx.bytes());
}

#[test]
fn routing_log_round_trip_and_drops() {
    let (idx, mut w) = index(4, 10_000);
    let log = w.routing_log(8);
    let long: Vec<u64> = (1..=100).collect(); // 4 records
    assert!(log.record(2, &long));
    assert_eq!(log.pending(), 4);
    assert!(log.record(1, &long));
    // 8 records used: the next request does not fit and is dropped whole.
    assert!(!log.record(3, &[5]));
    assert_eq!((log.recorded(), log.dropped()), (2, 1));
    assert_eq!(w.drain(10), 8);
    let mut out = [0u32; 4];
    idx.match_prefix(&long, &mut out);
    assert_eq!(out, [0, 100, 100, 0]);
    // Very long prompts are learned up to MAX_ROUTED_BLOCKS.
    let (idx, mut w) = index(4, 10_000);
    let log = w.routing_log(1024);
    let huge: Vec<u64> = (1..=5000).collect();
    assert!(log.record(0, &huge));
    w.drain(0);
    let mut out = [0u32; 4];
    idx.match_prefix(&huge, &mut out);
    assert_eq!(out[0] as usize, MAX_ROUTED_BLOCKS);
    // A replica outside the index is skipped by the writer, never a panic.
    assert!(log.record(300, &[1]));
    assert_eq!(w.drain(1), 0);
}

#[test]
fn routed_prefix_ends_most_recently_used() {
    let (idx, mut w) = index(1, 40);
    let log = w.routing_log(64);
    let a: Vec<u64> = (1..=35).collect();
    assert!(log.record(0, &a));
    w.drain(0);
    // 10 more unique blocks evict 5: they must be a's tail, not its prefix.
    let b: Vec<u64> = (100..110).collect();
    assert!(log.record(0, &b));
    w.drain(1);
    let mut out = [0u32];
    idx.match_prefix(&a, &mut out);
    assert_eq!(out, [30]);
}

#[test]
fn readers_on_threads_while_the_writer_churns() {
    for replicas in [130, 1100] {
        readers_on_threads_while_the_writer_churns_with(replicas);
    }
}

fn readers_on_threads_while_the_writer_churns_with(replicas: usize) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (idx, mut w) = index(replicas, 300);
    // Replica 0 holds a pinned prompt the writer never evicts (big capacity, no churn there).
    w.set_capacity_tokens(0, 1_000_000 * 16).unwrap();
    let pinned: Vec<u64> = (0..64).map(|i| chain_hash(12345, i)).collect();
    w.insert(0, &pinned, 0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|t| {
            let (idx, stop, pinned) = (idx.clone(), stop.clone(), pinned.clone());
            std::thread::spawn(move || {
                let mut rng = TestRng(100 + t);
                let mut out = vec![0u32; replicas];
                let mut reads = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    idx.match_prefix(&pinned, &mut out);
                    assert_eq!(out[0], 64, "the pinned prompt vanished");
                    let q = prompt(&mut rng, 24);
                    idx.match_prefix(&q, &mut out);
                    assert!(out.iter().all(|&m| m as usize <= q.len()));
                    reads += 2;
                }
                reads
            })
        })
        .collect();
    let mut rng = TestRng(5);
    let start = std::time::Instant::now();
    let mut ops = 0;
    while ops < 200_000 || (idx.rebuilds() < 20 && start.elapsed().as_secs() < 20) {
        let r = 1 + rng.below(replicas as u64 - 1) as usize;
        let mut blocks = prompt(&mut rng, 24);
        blocks.push(rng.next() | 1); // a fresh leaf: dead slots pile up, rebuilds happen
        match rng.below(10) {
            0 => w.clear(r).unwrap(),
            1..=3 => w.remove(r, blocks[0]).unwrap(),
            _ => w.insert(r, &blocks, ops).unwrap(),
        }
        ops += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(reads > 1000, "{reads}");
    assert!(idx.rebuilds() >= 20, "{}", idx.rebuilds());
}

/// `w` on a writer thread with 1 ms ticks and `parked_tick` parked ones, counting its ticks:
/// (the thread, its stop flag, the tick count).
fn counting_writer(
    w: ResidencyWriter,
    parked_tick: Duration,
) -> (
    JoinHandle<ResidencyWriter>,
    Arc<std::sync::atomic::AtomicBool>,
    Arc<AtomicU64>,
) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let origin = std::time::Instant::now();
    let ticks = Arc::new(AtomicU64::new(0));
    let seen = ticks.clone();
    let handle = spawn_writer_thread(
        w,
        Duration::from_millis(1),
        parked_tick,
        stop.clone(),
        move || origin.elapsed().as_micros() as u64,
        move |_, _| {
            seen.fetch_add(1, Ordering::Relaxed);
            super::TickWork::default()
        },
    )
    .unwrap();
    (handle, stop, ticks)
}

#[test]
fn writer_thread_applies_the_logs_and_returns_on_stop() {
    use std::time::Instant;
    let (idx, mut w) = index(4, 1000);
    let log = w.routing_log(64);
    let (handle, stop, ticks) = counting_writer(w, Duration::from_millis(50));
    assert!(log.record(3, &[11, 12, 13]));
    let mut out = [0u32; 4];
    let deadline = Instant::now() + Duration::from_secs(5);
    while out[3] != 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        idx.match_prefix(&[11, 12, 13], &mut out);
    }
    assert_eq!(out, [0, 0, 0, 3]);
    stop.store(true, Ordering::Release);
    let w = handle.join().unwrap();
    assert!(w.holds(3, 12));
    assert!(ticks.load(Ordering::Relaxed) > 0);
}

#[test]
fn match_prefix_edges() {
    let (idx, mut w) = index(65, 100);
    let mut out = [9u32; 70];
    idx.match_prefix(&[], &mut out);
    assert!(out.iter().all(|&m| m == 0));
    w.insert(64, &[0, 1], 0).unwrap(); // hash 0, second mask word
    w.insert(3, &[0], 0).unwrap();
    idx.match_prefix(&[0, 1, 2], &mut out);
    assert_eq!((out[3], out[64], out[65]), (1, 2, 0));
    let mut short = [0u32; 4];
    idx.match_prefix(&[0, 1], &mut short);
    assert_eq!(short, [0, 0, 0, 1]);
}

#[test]
fn a_block_routed_since_its_last_store_survives_its_removal() {
    const S: u64 = 1_000_000;
    let (idx, mut w) = index(2, 100);
    let mut out = [0u32; 2];
    let p = [7, 8, 9];
    // Replica 0 holds P; the next turn is routed there; it evicts P while the turn is queued.
    w.insert(0, &p, 0).unwrap();
    assert!(!w.is_pending(0, 8));
    w.route(0, &p, S).unwrap();
    assert!(w.is_pending(0, 8) && w.copies(0, 8) == 1);
    for h in p {
        w.remove(0, h).unwrap();
    }
    idx.match_prefix(&p, &mut out);
    assert_eq!(out, [3, 0], "the queued request will store P again");
    assert_eq!((w.copies(0, 8), w.is_pending(0, 8)), (0, true));
    // It runs and stores P: confirmed, no longer pending; the next removal is believed.
    w.insert(0, &p, 2 * S).unwrap();
    assert!(!w.is_pending(0, 8) && w.copies(0, 8) == 1);
    w.remove(0, 9).unwrap();
    idx.match_prefix(&p, &mut out);
    assert_eq!(out, [2, 0]);

    // Without a routed request in between, a removal drops the block.
    w.insert(1, &p, 3 * S).unwrap();
    w.remove(1, 7).unwrap();
    assert!(!w.holds(1, 7));

    // A clear drops pending blocks too (a restart empties the queue).
    w.route(1, &p, 3 * S).unwrap();
    w.clear(1).unwrap();
    assert!(!w.holds(1, 8));

    // Bounded in time: past pending_ttl since kvlb last touched it, a removal drops it.
    let (_idx, mut w) = index(1, 100);
    w.set_pending_ttl(Duration::from_secs(10));
    w.insert(0, &p, 0).unwrap();
    w.route(0, &p, S).unwrap();
    w.remove_at(0, 7, 10 * S).unwrap();
    assert!(w.holds(0, 7));
    w.remove_at(0, 8, 11 * S).unwrap();
    assert!(!w.holds(0, 8));
    // A kept guess ages like any guess; stored blocks do not.
    w.insert(0, &[50], 12 * S).unwrap();
    assert_eq!(w.expire_guesses(0, 12 * S).unwrap(), 1); // block 7 (kept at 0 copies)
    assert!(!w.holds(0, 7) && w.holds(0, 9) && w.holds(0, 50));

    // Bounded in work: once the replica stored as many blocks as it holds since the routing,
    // the request has run (or will find nothing of P anyway): the removal is believed.
    let (_idx, mut w) = index(1, 10);
    w.insert(0, &p, 0).unwrap();
    w.route(0, &p, 0).unwrap();
    let others: Vec<u64> = (100..107).collect();
    w.insert(0, &others, 0).unwrap(); // 7 stored since: 3 + 7 = 10 held, capacity 10
    w.remove(0, 7).unwrap();
    assert!(w.holds(0, 7), "7 stores since the routing, capacity 10");
    w.insert(0, &others[..3], 0).unwrap(); // second copies: 10 stored since, still 10 held
    assert!(w.holds(0, 8));
    w.remove(0, 8).unwrap();
    assert!(!w.holds(0, 8));

    // pending_ttl zero turns the rule off: route is insert_routed.
    let (_idx, mut w) = index(1, 100);
    w.set_pending_ttl(Duration::ZERO);
    w.insert(0, &p, 0).unwrap();
    w.route(0, &p, 0).unwrap();
    assert!(!w.is_pending(0, 7));
    w.remove(0, 7).unwrap();
    assert!(!w.holds(0, 7));
}

#[test]
fn reported_blocks_do_not_push_out_guesses_hashed_another_way() {
    let (idx, mut w) = index(1, 10);
    let mut out = [0u32; 1];
    // A chat prompt routed here (text blocks: only routing knows them)...
    w.route(0, &[101, 102, 103], 0).unwrap();
    // ...then the engine reports a full cache of token blocks.
    let tokens: Vec<u64> = (1000..1010).collect();
    w.insert(0, &tokens, 1).unwrap();
    idx.match_prefix(&[101, 102, 103], &mut out);
    assert_eq!(out, [3], "guesses evicted by reported blocks");
    idx.match_prefix(&tokens, &mut out);
    assert_eq!(out, [10]);
    assert_eq!((idx.reported_blocks(0), idx.replica_blocks(0)), (10, 13));
    // Guesses stay bounded by the capacity among themselves, the least recent going first;
    // the reported blocks stay.
    let more: Vec<u64> = (200..209).collect();
    w.insert_routed(0, &more, 2).unwrap();
    idx.match_prefix(&[101, 102, 103], &mut out);
    assert_eq!(out, [1]);
    idx.match_prefix(&more, &mut out);
    assert_eq!(out, [9]);
    assert_eq!((idx.reported_blocks(0), idx.replica_blocks(0)), (10, 20));
    // Guesses age out without touching the reported blocks.
    assert_eq!(w.expire_guesses(0, 3).unwrap(), 10);
    idx.match_prefix(&tokens, &mut out);
    assert_eq!((out, idx.replica_blocks(0)), ([10], 10));
}

#[test]
fn reported_blocks_are_bounded_in_the_engines_block_size() {
    // Guesses are 64-token text blocks; the engine reports 16-token blocks: a replica of 6,400
    // tokens holds 100 guesses but 400 reported blocks.
    let (idx, mut w) = ResidencyIndex::new(ResidencyConfig {
        max_replicas: 2,
        block_tokens: 64,
        kv_capacity_tokens: 6_400,
    })
    .unwrap();
    w.set_reported_block_tokens(16);
    assert_eq!(
        (w.capacity_blocks(0), w.confirmed_capacity_blocks(0)),
        (100, 400)
    );
    let reported: Vec<u64> = (1..=400).collect();
    w.insert(0, &reported, 1).unwrap();
    let mut out = [0u32; 2];
    idx.match_prefix(&reported, &mut out);
    assert_eq!(out, [400, 0], "a full replica's reports all kept");
    w.insert(0, &[401], 2).unwrap();
    assert!(!w.holds(0, 400) && w.holds(0, 401) && w.holds(0, 1));
    // A capacity set later keeps the ratio.
    w.set_capacity_tokens(1, 1_600).unwrap();
    assert_eq!(
        (w.capacity_blocks(1), w.confirmed_capacity_blocks(1)),
        (25, 100)
    );
}

#[test]
fn an_idle_writer_parks_and_the_next_record_wakes_it_at_once() {
    use std::time::Instant;
    let (idx, mut w) = index(4, 1000);
    let log = w.routing_log(64);
    let bell = w.bell.clone();
    // Parked ticks far longer than the test: only the bell can wake it in time.
    let (handle, stop, ticks) = counting_writer(w, Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !bell.parked.load(Ordering::Relaxed) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        bell.parked.load(Ordering::Relaxed),
        "the writer did not park after {} quiet ticks",
        ticks.load(Ordering::Relaxed)
    );
    // Parked, it does not tick (1 ms periods would make hundreds of ticks here).
    let before = ticks.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(300));
    let parked_ticks = ticks.load(Ordering::Relaxed) - before;
    assert!(parked_ticks <= 2, "{parked_ticks} ticks while parked");
    // A record rings it awake: applied within seconds, not the 60 s parked tick.
    let logged = Instant::now();
    assert!(log.record(2, &[21, 22]));
    let mut out = [0u32; 4];
    while out[2] != 2 && logged.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
        idx.match_prefix(&[21, 22], &mut out);
    }
    assert_eq!(
        out,
        [0, 0, 2, 0],
        "the record was not applied after the bell"
    );
    stop.store(true, Ordering::Release);
    if let Some(t) = bell.thread.get() {
        t.unpark();
    }
    let w = handle.join().unwrap();
    assert!(w.holds(2, 22));
}
