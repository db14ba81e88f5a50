//! One replica's KV event stream -> residency operations in kvlb's own block hashes.
//!
//! `EventState` is the pure part (no I/O, no clock): it checks sequence numbers and keeps the
//! map from engine block hash to kvlb block hash (with copy counts) that resolves
//! `parent_block_hash` and later removals. `run` is the I/O part: connect a SUB socket (kvlb
//! connects, the engine's PUB binds), subscribe to every topic, read `[topic, seq, payload]`
//! messages, fill gaps by replay, reconnect with backoff when the publisher goes away.
//!
//! Each operation carries the `Tier` of its event's `medium`. The engine-hash map is shared by
//! the tiers: a hash stored on GPU and CPU counts two copies, so it keeps resolving parents and
//! removals while any medium holds it.
//!
//! See the parent module for why only token-mode requests match the hashes produced here.

#![forbid(unsafe_code)]

use super::{ReplicaTelemetry, ResidencyOp, Tier};
use crate::fleet::StopSignal;
use crate::kv_events::{decode_batch, KvEvent, KvEventBatch, Medium};
use crate::log_limit::LogLimit;
use crate::prefix::{token_block_hashes_from, TOKEN_CHAIN_ROOT};
use crate::worker::Shared;
use crate::zmtp::SubClient;
use crossbeam::channel::Sender;
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
}

impl Trouble {
    fn limit(self) -> &'static LogLimit {
        static LIMITS: [LogLimit; 5] = [
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

/// The engine hash's kvlb hash and how many copies the engine reported.
#[derive(Debug, Clone, Copy)]
struct ChainEntry {
    kvlb: u64,
    copies: u32,
}

/// One replica's view of its event stream.
pub struct EventState {
    replica: usize,
    token_block_size: usize,
    last_seq: Option<u64>,
    chain: HashMap<u64, ChainEntry, EngineHashState>,
    hashes: Vec<u64>,
    /// What went wrong in the messages received since `take_troubles`, for `run` to log.
    troubles: Vec<(Trouble, String)>,
}

impl EventState {
    /// `token_block_size`: kvlb's token-mode block (events of another block size cannot match
    /// any request and are skipped).
    pub fn new(replica: usize, token_block_size: u32) -> EventState {
        EventState {
            replica,
            token_block_size: token_block_size as usize,
            last_seq: None,
            chain: HashMap::with_hasher(EngineHashState::new()),
            hashes: Vec::new(),
            troubles: Vec::new(),
        }
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
                    ..
                } => self.stored(
                    block_hashes,
                    *parent_block_hash,
                    token_ids,
                    *block_size,
                    *medium,
                    tel,
                    ops,
                ),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    let mut blocks = Vec::with_capacity(block_hashes.len());
                    for h in block_hashes {
                        if let Some(e) = self.chain.get_mut(h) {
                            blocks.push(e.kvlb);
                            e.copies = e.copies.saturating_sub(1);
                            if e.copies == 0 {
                                self.chain.remove(h);
                            }
                        }
                    }
                    if !blocks.is_empty() {
                        ops.push(ResidencyOp::Remove {
                            replica: self.replica,
                            tier: Tier::of(*medium),
                            blocks,
                        });
                    }
                }
                KvEvent::AllBlocksCleared => self.clear(ops),
                // Counted and reported by `receive`.
                KvEvent::Undecodable(_) => {}
            }
        }
        batch.events.len()
    }

    #[allow(clippy::too_many_arguments)]
    fn stored(
        &mut self,
        block_hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        block_size: u32,
        medium: Option<Medium>,
        tel: &ReplicaTelemetry,
        ops: &mut Vec<ResidencyOp>,
    ) {
        if block_size as usize != self.token_block_size {
            tel.skipped_block_size.fetch_add(1, Relaxed);
            return;
        }
        if block_hashes.is_empty() || token_ids.len() != block_hashes.len() * block_size as usize {
            tel.skipped_malformed.fetch_add(1, Relaxed);
            return;
        }
        let root = match parent {
            None => TOKEN_CHAIN_ROOT,
            Some(p) => match self.chain.get(&p) {
                Some(e) => e.kvlb,
                None => {
                    tel.skipped_unknown_parent.fetch_add(1, Relaxed);
                    return;
                }
            },
        };
        self.hashes.clear();
        token_block_hashes_from(root, token_ids, self.token_block_size, &mut self.hashes);
        if self.hashes.len() != block_hashes.len() {
            tel.skipped_malformed.fetch_add(1, Relaxed);
            return;
        }
        if self.chain.len() + block_hashes.len() > MAX_CHAIN_BLOCKS {
            // A stream that stores without ever removing: start over rather than grow.
            self.clear(ops);
        }
        for (&engine, &kvlb) in block_hashes.iter().zip(&self.hashes) {
            let e = self
                .chain
                .entry(engine)
                .or_insert(ChainEntry { kvlb, copies: 0 });
            e.kvlb = kvlb;
            e.copies = e.copies.saturating_add(1);
        }
        let tier = Tier::of(medium);
        if tier == Tier::Offloaded {
            tel.offloaded_blocks
                .fetch_add(block_hashes.len() as u64, Relaxed);
        }
        ops.push(ResidencyOp::Insert {
            replica: self.replica,
            tier,
            blocks: self.hashes.clone(),
        });
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
        ];
        let n = |i: usize| after[i].saturating_sub(before[i]);
        if n(0) > 0 {
            let size = batch.events.iter().find_map(|e| match e {
                KvEvent::BlockStored { block_size, .. }
                    if *block_size as usize != self.token_block_size =>
                {
                    Some(*block_size)
                }
                _ => None,
            });
            self.trouble(
                Trouble::Skipped,
                format!(
                    "batch {seq}: skipped {} BlockStored of another block size ({} tokens; \
                     kvlb's token block is {})",
                    n(0),
                    size.unwrap_or(0),
                    self.token_block_size
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
                tel.gaps.fetch_add(1, Relaxed);
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
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
const RECV_SLICE: Duration = Duration::from_millis(200);
/// After applying what had arrived, the thread sleeps this long before it waits for more:
/// an engine publishes a batch per scheduler step (a hundred a second and more), and waking
/// for each costs more than the batch itself. Residency learns of stores and evictions at
/// most this much later; kvlb's own routing, which the workers record at once, is not
/// delayed.
pub const EVENT_GATHER: Duration = Duration::from_millis(20);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The event thread of one replica: runs until `stop` is set or the writer is gone.
pub fn run(
    source: EventSource,
    shared: Arc<Shared>,
    ops_tx: Sender<ResidencyOp>,
    stop: Arc<StopSignal>,
) {
    let tel = &shared.telemetry[source.replica];
    let Some(spec) = shared.fleet.slot(source.replica).spec() else {
        return;
    };
    // Without metrics, an open event connection is the only sign of life of an idle engine
    // (an idle engine publishes nothing): count it as fresh telemetry.
    let connection_is_liveness = !spec.scrape_metrics();
    let mut state = EventState::new(source.replica, source.token_block_size);
    let mut backoff = BACKOFF_MIN;
    let mut ops = Vec::new();
    let mut last_error = String::new();
    let mut replay = |from: u64| {
        source
            .replay
            .as_deref()
            .map(|ep| crate::kv_events::replay(ep, from, REPLAY_TIMEOUT))
    };
    while !stop.is_stopped() {
        let mut sub = match SubClient::connect(&source.endpoint, CONNECT_TIMEOUT)
            .and_then(|mut s| s.subscribe(b"").map(|()| s))
        {
            Ok(s) => s,
            Err(e) => {
                let msg = e.to_string();
                if msg != last_error {
                    eprintln!(
                        "kvlb: replica {}: KV events {}: {msg}; retrying",
                        spec.url, source.endpoint
                    );
                    last_error = msg;
                }
                if stop.sleep(backoff) {
                    return;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        last_error.clear();
        backoff = BACKOFF_MIN;
        tel.connects.fetch_add(1, Relaxed);
        tel.events_connected.store(true, Relaxed);
        // Zero right after a message: take what else has arrived, then pause for the next
        // batches to gather (see `EVENT_GATHER`) before blocking again.
        let mut wait = RECV_SLICE;
        while !stop.is_stopped() {
            let frames = match sub.recv(wait) {
                Ok(Some(f)) => f,
                Ok(None) if wait.is_zero() => {
                    wait = RECV_SLICE;
                    if stop.sleep(EVENT_GATHER) {
                        break;
                    }
                    continue;
                }
                Ok(None) => {
                    if connection_is_liveness {
                        tel.touch(shared.now_ms());
                    }
                    continue;
                }
                Err(_) => break,
            };
            wait = Duration::ZERO;
            ops.clear();
            if state.receive(&frames, tel, &mut replay, &mut ops).is_ok() {
                let now = shared.now_ms();
                tel.last_event_ms.store(now.max(1), Relaxed);
                tel.touch(now);
            }
            for (kind, line) in state.take_troubles() {
                if let Some(held) = kind.limit().allow() {
                    eprintln!(
                        "kvlb: replica {}: KV events: {line}{}",
                        spec.url,
                        crate::log_limit::more(held)
                    );
                }
            }
            sub.recycle(frames);
            tel.engine_blocks
                .store(state.known_blocks() as u64, Relaxed);
            for op in ops.drain(..) {
                // Waits while the writer catches up; fails only once the writer has gone.
                if ops_tx.send(op).is_err() {
                    tel.events_connected.store(false, Relaxed);
                    return;
                }
            }
        }
        tel.events_connected.store(false, Relaxed);
    }
}
