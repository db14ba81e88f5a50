//! Residency: which prefix blocks each replica holds in its KV cache, as kvlb believes.
//!
//! The selector asks one question per request: "for every replica, how many leading blocks of
//! this prompt are resident there?" (`ResidencyIndex::match_prefix`, or `match_each` for only
//! the replicas holding some of it). It is answered in one pass over the request's chained
//! block hashes against a shared hash table whose value names the replicas holding the block
//! (`table.rs`: up to five replica ids inline in the slot, or a bitmask row for a block many
//! replicas hold): take the first block's holders, keep those holding each next block, note
//! where each one drops, stop when none is left. Workers read without locks or allocation;
//! the table is replaced wholesale (grown, shrunk or cleaned) by an atomic pointer swap
//! (`arc-swap`), so a reader never waits and never sees a half-built table.
//!
//! One control thread owns the truth (`ResidencyWriter`): for each replica the blocks it holds,
//! how many copies (vLLM may store a hash more than once; each BlockRemoved drops one), and
//! their LRU order, trimmed to the replica's capacity (`kv_capacity_tokens / block_tokens`).
//! Two sources feed it:
//!
//! * KV events (BlockStored / BlockRemoved / AllBlocksCleared) -> `insert`, `remove`, `clear`;
//!   a BlockStored that only reports blocks the replica already holds (vLLM's reuse report in
//!   `kv_cache_report_mode = "full"`, told apart by the event thread) -> `refresh`, which
//!   makes them the most recently used without adding a copy;
//! * routing itself: a request sent to replica r will leave its prefix resident on r. Workers
//!   must not write the index, so each pushes a fixed-size record per routed request into its
//!   own bounded lock-free queue (`RoutingLog`, no allocation; a full queue drops the record
//!   and counts it), and the writer drains them (`ResidencyWriter::drain`) every millisecond
//!   (`spawn_writer_thread`) into `route`.
//!
//! The two meet in one race, which the writer settles with *pending* blocks: replica r holds
//! prefix P (stored, one copy); kvlb routes the next turn of that conversation to r; while that
//! request waits in r's queue, r evicts P (BlockRemoved, 0 copies). The queued request will
//! compute P again and store it, so the next turns should still go to r. A block routed to r
//! after its last BlockStored there is pending; a BlockRemoved that leaves a pending block at
//! 0 copies keeps it as a guess, a BlockStored confirms it (no longer pending), a clear drops
//! everything (a restart empties the queue too). A request whose blocks were all cached stores
//! nothing, so its blocks stay pending after it ran: the mark lapses once r has stored as many
//! blocks as it holds since the routing (by then the request has run and its prefix is the
//! freshest part of r's cache, or r's queue is longer than its cache) or `pending_ttl`
//! (default 120 s, the default `routed_guess_ttl`) after kvlb last touched the block; a kept
//! block then ages like every routing guess.
//!
//! Cost (`benches/routing.rs`, `full_path_part_match_prefix_32k_chat`): the 126 hashes of a
//! 32 KiB prompt resident in full on one replica are looked up in 0.4 to 0.9 us at any fleet
//! size from 16 to 1,024 replicas: the work follows the holders of the prompt's first block (a
//! list of at most five ids once past a shared prefix), not the fleet. The walk is linear on
//! purpose: a replica may hold block k without block k-1 (a BlockRemoved of an inner block, an
//! eviction by another prompt), so "leading blocks held" is not monotone in k and a binary
//! search would over-count; the walk stops as soon as no replica is left.
//!
//! Exactness: the table stores full 64-bit hashes and clears bits on removal, so
//! `match_prefix` has no false positives or negatives with respect to the writer's state (the
//! tests compare it with a brute-force model). What the writer believes can still differ from
//! a replica's real cache (routing guesses, events in flight); the estimator treats a match as
//! a likelihood, not a promise.
//!
//! Memory: a table slot is 16 bytes whatever the fleet (key and holders word), plus one row
//! of `ceil(max_replicas / 64)` words for each block held by more than five replicas. It is
//! sized from the distinct hashes actually resident (never more than the sum of the replicas'
//! capacities): each rebuild gives live hashes at most 1/3 of the slots, and the writer
//! rebuilds again before occupied slots (dead ones included) pass 1/2, when live ones fall
//! under 1/8, or when the arena has no fresh row left, so the load factor stays <= 0.5 and a
//! probe always ends. The writer holds, per (replica, block), a 24-byte node (hash, copies,
//! pending mark, last use) in a 32-byte LRU slot whose slab grows to the replica's bound and
//! not past it, and a 4-byte key in a hashbrown table (5 bytes a bucket with its control
//! byte, at up to 7/8 load). Measured (`benches/routing.rs`): one million resident blocks take
//! 74 MiB at 16 to 1,024 replicas (78 bytes a block copy, the shared table 32 MiB of it);
//! 1,024 replicas each at its full capacity of 400k tokens (25,000 blocks of 16 tokens) take
//! the bytes `benches/routing.rs` prints (docs/benchmarks/proxy.md has the figure).
//! `ResidencyIndex::bytes` and `table_bytes` report it for metrics.

#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

mod index;
// One `_mm_prefetch` of a key's home slot ahead of a lookup: the intrinsic takes a raw pointer
// and is unsafe (a hint, it never faults); stable Rust has no safe prefetch.
#[allow(unsafe_code)]
mod table;

#[cfg(test)]
mod tests;

pub use index::{ResidencyConfig, ResidencyIndex, ResidencyWriter, MAX_REPLICAS};

use crossbeam::queue::ArrayQueue;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Block hashes one routing record carries; a longer prompt takes several records.
pub const ROUTED_BLOCKS_PER_RECORD: usize = 30;
/// Leading blocks of a request that routing learns (128k tokens at 64 tokens per block).
pub const MAX_ROUTED_BLOCKS: usize = 2048;

/// One routed request's blocks (or a slice of them): 248 bytes, copied into the queue.
#[derive(Clone, Copy)]
struct RoutedBlocks {
    replica: u16,
    len: u16,
    blocks: [u64; ROUTED_BLOCKS_PER_RECORD],
}

/// How an idle writer thread is woken. After `PARK_AFTER_QUIET_TICKS` ticks without a routing
/// record the writer parks (`parked` set) for up to `PARKED_TICK`; the first record a worker
/// logs then rings it awake. Ringing costs a worker one relaxed load per record while the
/// writer is awake, and one `unpark` (a futex wake) on the first record after a quiet spell.
#[derive(Default)]
pub struct WriterBell {
    parked: AtomicBool,
    thread: std::sync::OnceLock<std::thread::Thread>,
}

impl WriterBell {
    /// Wake the writer if it is parked. A record logged in the instant the writer parks (it
    /// checks the logs after raising `parked`, but without a fence against the worker) waits
    /// for the parked tick's end at most.
    #[inline]
    fn ring(&self) {
        if self.parked.load(Ordering::Relaxed) && self.parked.swap(false, Ordering::AcqRel) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }
}

/// Quiet ticks (no routing record; at 4 periods each) before the writer parks.
pub const PARK_AFTER_QUIET_TICKS: u32 = 64;
/// A parked writer still ticks this often (KV events, guess expiry).
pub const PARKED_TICK: Duration = Duration::from_millis(50);

/// How long a block only routing put on a replica (no KV event confirmed it) stays resident
/// once unused: the default of `routed_guess_ttl`, also the simulator's.
pub const DEFAULT_ROUTED_GUESS_TTL: Duration = Duration::from_secs(120);

/// A worker's log of routing decisions, drained by the residency writer. One producer (the
/// worker), one consumer (the writer); bounded; `record` never blocks or allocates.
pub struct RoutingLog {
    queue: ArrayQueue<RoutedBlocks>,
    dropped: AtomicU64,
    recorded: AtomicU64,
    bell: Arc<WriterBell>,
}

impl RoutingLog {
    /// A log holding up to `records` records (each up to `ROUTED_BLOCKS_PER_RECORD` blocks).
    pub fn new(records: usize) -> RoutingLog {
        RoutingLog::with_bell(records, Arc::default())
    }

    fn with_bell(records: usize, bell: Arc<WriterBell>) -> RoutingLog {
        RoutingLog {
            queue: ArrayQueue::new(records.max(1)),
            dropped: AtomicU64::new(0),
            recorded: AtomicU64::new(0),
            bell,
        }
    }

    /// Note that a request with `blocks` went to `replica`. All-or-nothing: when the queue
    /// lacks room for every record the request needs, nothing is pushed and the request is
    /// counted in `dropped`. Returns whether it was recorded.
    pub fn record(&self, replica: usize, blocks: &[u64]) -> bool {
        let blocks = &blocks[..blocks.len().min(MAX_ROUTED_BLOCKS)];
        if blocks.is_empty() {
            return true;
        }
        let Ok(replica) = u16::try_from(replica) else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        let records = blocks.len().div_ceil(ROUTED_BLOCKS_PER_RECORD);
        // Only this producer adds, so the room seen here can only grow before the pushes.
        if self.queue.capacity() - self.queue.len() < records {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // Last slice first: the writer then touches the prefix last, leaving it the most
        // recently used.
        for k in (0..records).rev() {
            let part = &blocks[k * ROUTED_BLOCKS_PER_RECORD..];
            let part = &part[..part.len().min(ROUTED_BLOCKS_PER_RECORD)];
            let mut rec = RoutedBlocks {
                replica,
                len: part.len() as u16,
                blocks: [0; ROUTED_BLOCKS_PER_RECORD],
            };
            rec.blocks[..part.len()].copy_from_slice(part);
            if self.queue.push(rec).is_err() {
                // Another producer broke the single-producer contract; count and stop.
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        }
        self.recorded.fetch_add(1, Ordering::Relaxed);
        self.bell.ring();
        true
    }

    /// Requests not recorded because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Requests recorded.
    pub fn recorded(&self) -> u64 {
        self.recorded.load(Ordering::Relaxed)
    }

    /// Records waiting for the writer.
    pub fn pending(&self) -> usize {
        self.queue.len()
    }
}

impl ResidencyWriter {
    /// A new routing log (`records` deep) for one worker, drained by this writer.
    pub fn routing_log(&mut self, records: usize) -> Arc<RoutingLog> {
        let log = Arc::new(RoutingLog::with_bell(records, self.bell.clone()));
        self.logs.push(log.clone());
        log
    }

    /// Apply every record waiting in the routing logs as `route` at `now_us` (which also
    /// becomes the time of later `remove`s). Returns the records applied. Records naming a
    /// replica outside the index are skipped.
    pub fn drain(&mut self, now_us: u64) -> usize {
        self.advance_clock(now_us);
        let mut applied = 0;
        for k in 0..self.logs.len() {
            // Bounded by what is there now, so a busy worker cannot keep the writer here.
            let waiting = self.logs[k].queue.len();
            for _ in 0..waiting {
                let Some(rec) = self.logs[k].queue.pop() else {
                    break;
                };
                let blocks = &rec.blocks[..rec.len as usize];
                if self.route(rec.replica as usize, blocks, now_us).is_ok() {
                    applied += 1;
                }
            }
        }
        applied
    }
}

/// What a tick's `on_tick` did beside the routing records (`spawn_writer_thread`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TickWork {
    /// It applied something: the writer stays awake as it does for routing records.
    pub applied: bool,
    /// More is waiting than one tick takes: the next tick runs at once.
    pub more: bool,
}

/// Run `writer` on its own thread: every `period` (up to 4 periods while there is nothing to
/// drain) it drains the routing logs and then calls
/// `on_tick(&mut writer, now_us)` (where KV events get applied; its `TickWork` counts as
/// activity, and `more` runs the next tick at once), until `stop` is set; the
/// thread then returns the writer. `clock` gives the microseconds passed to the writer.
/// After `PARK_AFTER_QUIET_TICKS` ticks with no routing record it parks between ticks for up
/// to `parked_tick` (`PARKED_TICK` in `serve`), and the next record rings it awake
/// (`WriterBell`): an idle kvlb's writer wakes 20 times a second, not 250.
pub fn spawn_writer_thread<C, T>(
    mut writer: ResidencyWriter,
    period: Duration,
    parked_tick: Duration,
    stop: Arc<AtomicBool>,
    clock: C,
    mut on_tick: T,
) -> std::io::Result<JoinHandle<ResidencyWriter>>
where
    C: Fn() -> u64 + Send + 'static,
    T: FnMut(&mut ResidencyWriter, u64) -> TickWork + Send + 'static,
{
    std::thread::Builder::new()
        .name("kvlb-residency".into())
        .spawn(move || {
            // Ticks that found no routing guess in a row: the sleep doubles with them up to
            // 4 periods, so a writer with nothing to do wakes a quarter as often (each wake is
            // a context switch on a core the workers may be using).
            let mut quiet_ticks = 0u32;
            let bell = writer.bell.clone();
            let _ = bell.thread.set(std::thread::current());
            while !stop.load(Ordering::Acquire) {
                let now = clock();
                // Routing guesses first, then what the replicas reported: an event (a removal,
                // a clear) must override a guess made before it, however late the tick runs.
                let applied = writer.drain(now);
                let work = on_tick(&mut writer, now);
                quiet_ticks = if applied == 0 && !work.applied {
                    quiet_ticks.saturating_add(1)
                } else {
                    0
                };
                if work.more {
                    continue;
                }
                if quiet_ticks < PARK_AFTER_QUIET_TICKS {
                    std::thread::sleep(period * (1 << quiet_ticks.min(2)));
                    continue;
                }
                bell.parked.store(true, Ordering::SeqCst);
                if writer.logs.iter().all(|l| l.pending() == 0) {
                    std::thread::park_timeout(parked_tick);
                }
                bell.parked.store(false, Ordering::Relaxed);
            }
            writer.drain(clock());
            writer
        })
}
