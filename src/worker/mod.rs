//! A worker: one thread pinned to one core, with its own io_uring, its own SO_REUSEPORT
//! listeners, buffer pool, upstream connection pool and policy instance. Workers share
//! nothing but read-mostly atomics (replica loads, drain flag) and their own stats blocks.

use crate::config::ServeConfig;
use crate::metrics::{ReplicaGauges, WorkerStats};
use crate::models::{ModelClass, ModelKey, ModelMap, Resolved};
use crate::rt::op;
use crate::select::{self, Candidate, Policy, Rng};
use std::cell::{Cell, RefCell};
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::{
    AtomicBool,
    Ordering::{Acquire, Relaxed},
};
use std::sync::Arc;
use std::time::Instant;

mod in_flight;
mod replica_telemetry;
pub mod reported;
pub use in_flight::Expected;
pub(crate) use in_flight::{CountedAs, InFlight};
pub use replica_telemetry::{ReplicaTelemetry, UNKNOWN};

/// Request bodies up to this size live in a pooled buffer and hold no body memory (the L7
/// path's `max_body_memory` accounting; the L4 mode reads first bodies by the same rule).
pub(crate) const SMALL_BODY: usize = 16 * 1024;

/// State every worker reads; written by the main and admin threads.
pub struct Shared {
    /// The configuration in force; a reload swaps it whole (read with `cfg()`).
    config: arc_swap::ArcSwap<ServeConfig>,
    /// The replicas, by slot; every per-replica vector below has `fleet.capacity()` entries.
    pub fleet: crate::fleet::Fleet,
    /// Which prefix blocks kvlb believes each replica holds (read by cache_aware).
    pub residency: Arc<crate::residency::ResidencyIndex>,
    /// Which prefix blocks the replicas reported in an offloaded tier (CPU memory, disk):
    /// loaded back at a cost (read by cache_aware; see `crate::telemetry`). None: not tracked.
    pub offload_residency: Option<Arc<crate::residency::ResidencyIndex>>,
    /// Blocks the residency writer could not take because a routing log was full.
    pub routing_logs: Vec<Arc<crate::residency::RoutingLog>>,
    /// How prompts are cut into prefix blocks.
    pub prefix: crate::prefix::PrefixConfig,
    /// The LoRA adapter names learned from the replicas' KV events: a request whose `model`
    /// names one is hashed under it (see `crate::prefix::token_root`).
    pub adapters: Arc<crate::prefix::AdapterNames>,
    /// Which replica serves which model (`crate::model_watch` keeps it up to date).
    pub models: arc_swap::ArcSwap<crate::models::ModelMap>,
    /// The names of the per-model metric labels (given by the model thread).
    pub model_labels: crate::models::ModelLabels,
    /// The LoRA adapters kvlb loads on demand (`lora_adapter`) and their loads.
    pub on_demand: crate::models::OnDemand,
    /// How much of a prompt a worker reads (`max_prompt_tokens`, fixed at start).
    pub prompt_limits: crate::prompt::PromptLimits,
    pub loads: Vec<ReplicaGauges>,
    pub workers: Vec<WorkerStats>,
    pub draining: AtomicBool,
    /// Requests waiting, across workers, for a replica below its concurrency limit.
    pub queued: std::sync::atomic::AtomicU64,
    pub epoch: Instant,
    /// What each replica reports of itself (metrics, KV events); see `crate::telemetry`.
    pub telemetry: Vec<ReplicaTelemetry>,
    /// This kernel's io_uring has splice (L7 response bodies may be spliced).
    pub splice_ok: bool,
    /// Request body bytes held over all workers (bounded by `limits.max_body_memory`).
    pub body_memory: std::sync::atomic::AtomicUsize,
    /// Which replica stored which response (`previous_response_id`), sized at start.
    pub affinity: crate::affinity::AffinityTable,
    /// Each replica's measured pace (`estimate::calibrate`), published by the calibration on
    /// the residency writer's tick.
    pub pace: Vec<crate::estimate::calibrate::ReplicaPace>,
    /// The workers' calibration samples, on their way to that tick.
    pub samples: crate::estimate::calibrate::Samples,
    /// Samples the calibration dropped for their slot's replica having changed since.
    pub samples_stale: std::sync::atomic::AtomicU64,
}

impl Shared {
    pub fn new(
        cfg: ServeConfig,
        residency: Arc<crate::residency::ResidencyIndex>,
        routing_logs: Vec<Arc<crate::residency::RoutingLog>>,
    ) -> Shared {
        let n = cfg.max_replicas.max(cfg.replicas.len());
        let workers = (0..cfg.workers).map(|_| WorkerStats::new(n)).collect();
        // Room for the blocks of the longest prompt read, in the finer (token-mode) blocks.
        let mut prefix = crate::prefix::PrefixConfig::default();
        prefix.max_blocks = cfg
            .max_prompt_tokens
            .div_ceil(prefix.token_block_size as usize)
            .clamp(1, 1 << 20);
        let fleet = crate::fleet::Fleet::new(n);
        for r in &cfg.replicas {
            fleet
                .add(r.clone(), 0)
                .expect("the fleet has a slot for every configured replica");
        }
        Shared {
            fleet,
            residency,
            offload_residency: None,
            routing_logs,
            prefix,
            adapters: Arc::new(crate::prefix::AdapterNames::new()),
            models: arc_swap::ArcSwap::from_pointee(crate::models::ModelMap::empty(n)),
            model_labels: crate::models::ModelLabels::default(),
            on_demand: crate::models::OnDemand::new(
                &cfg.lora_adapters
                    .iter()
                    .map(|a| (a.name.clone(), a.path.clone(), a.base.clone()))
                    .collect::<Vec<_>>(),
                n,
            ),
            prompt_limits: crate::prompt::PromptLimits::for_tokens(cfg.max_prompt_tokens),
            loads: (0..n).map(|_| ReplicaGauges::default()).collect(),
            workers,
            draining: AtomicBool::new(false),
            queued: std::sync::atomic::AtomicU64::new(0),
            epoch: Instant::now(),
            telemetry: (0..n).map(|_| ReplicaTelemetry::default()).collect(),
            splice_ok: crate::rt::splice::supported(),
            body_memory: std::sync::atomic::AtomicUsize::new(0),
            affinity: crate::affinity::AffinityTable::new(cfg.response_affinity_entries),
            pace: (0..n).map(|_| Default::default()).collect(),
            samples: crate::estimate::calibrate::Samples::new(CALIBRATION_SAMPLES),
            samples_stale: std::sync::atomic::AtomicU64::new(0),
            config: arc_swap::ArcSwap::from_pointee(cfg),
        }
    }

    /// Let cache_aware read `offload` as the replicas' offloaded KV tier (its writer belongs
    /// to the telemetry feed, `ResidencyFeed::with_offload_tier`).
    pub fn with_offload_tier(mut self, offload: Arc<crate::residency::ResidencyIndex>) -> Shared {
        self.offload_residency = Some(offload);
        self
    }

    /// The configuration in force now (a lock-free load; cheap, allocation-free).
    pub fn cfg(&self) -> arc_swap::Guard<Arc<ServeConfig>> {
        self.config.load()
    }

    /// Put a new configuration in force (the fleet is changed separately).
    pub fn set_cfg(&self, cfg: ServeConfig) {
        self.config.store(Arc::new(cfg));
        self.fleet
            .generation
            .fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    /// Milliseconds since start, by the worker loop's clock on a worker (see [`crate::rt::now`]).
    pub fn now_ms(&self) -> u64 {
        crate::rt::now()
            .saturating_duration_since(self.epoch)
            .as_millis() as u64
    }
}

/// Calibration samples queued between two ticks of the residency writer at most (a tick
/// drains them; more are dropped and counted).
const CALIBRATION_SAMPLES: usize = 8192;

/// A worker logs prompts cut short by a bound at most this often.
const TRUNCATED_LOG_EVERY_MS: u64 = 10_000;

/// Most idle upstream connections kept per replica per worker.
const MAX_IDLE_UPSTREAM: usize = 256;
/// Buffers kept in the pool; larger ones are shrunk before reuse.
const BUF_CAPACITY: usize = 16 * 1024;
const BUF_KEEP_MAX: usize = 256 * 1024;
/// Buffers a worker's pool keeps: three per connection busy at once (idle keep-alive
/// connections hold none), 16 MiB at most.
const BUF_POOL_MAX: usize = 1024;

/// A keep-alive connection to a replica with its multishot receive, which stays armed while the
/// connection is pooled: if the replica closes it (or sends stray bytes) while it is idle, that
/// shows at the next checkout and the connection is not reused.
pub struct Upstream {
    pub fd: RawFd,
    pub recv: op::MultiRecv,
}

impl Upstream {
    pub fn new(fd: RawFd) -> Upstream {
        Upstream {
            fd,
            recv: op::MultiRecv::new(fd),
        }
    }

    /// Cancel the receive and close the socket (what dropping it does).
    pub fn close(self) {}
}

impl Drop for Upstream {
    fn drop(&mut self) {
        // The receive is cancelled when the field drops next; the kernel keeps its own
        // reference to the socket until then.
        op::close(self.fd);
    }
}

/// Per-worker state, owned by the worker's thread.
pub struct Worker {
    pub id: usize,
    pub shared: Arc<Shared>,
    /// The policy of requests without a `[[model]]` table, then one per table (a
    /// `ModelClass`'s `table` indexes it).
    pub policies: RefCell<Vec<Box<dyn Policy>>>,
    /// The same, for the decode legs of disaggregated requests: a policy with a turn of its
    /// own (round_robin's counter) would otherwise step once per leg, and with as many prefill
    /// as decode replicas send every request to the same pair.
    pub decode_policies: RefCell<Vec<Box<dyn Policy>>>,
    pub rng: RefCell<Rng>,
    /// Idle keep-alive connections per replica slot, with the slot's epoch when they were
    /// opened (a slot given to another replica since then makes them stale).
    idle_upstream: RefCell<Vec<Vec<(Upstream, u64)>>>,
    /// The fleet generation this worker's policy was built for.
    generation: Cell<u64>,
    /// The fleet had a replica of role prefill at `generation`: requests may be disaggregated.
    pub has_prefill: Cell<bool>,
    /// One of them speaks SGLang's protocol: its model's requests always take both legs (an
    /// SGLang decode replica computes no prompt of its own).
    pub has_sglang: Cell<bool>,
    /// Draws SGLang's `bootstrap_room`s: seeded from the OS (unlike `rng`), since a room
    /// another kvlb instance drew too would fail both transfers.
    pub rooms: RefCell<Rng>,
    /// The configuration in force as of `config_generation`: a worker reads it several times a
    /// request, and a plain pointer is cheaper than an `ArcSwap` load each time.
    /// (An `Rc` around the `Arc` on purpose: cloning it touches only this thread's count, not
    /// the `Arc`'s, which every worker shares.)
    #[allow(clippy::redundant_allocation)]
    config: RefCell<Rc<Arc<ServeConfig>>>,
    config_generation: Cell<u64>,
    bufs: RefCell<Vec<Vec<u8>>>,
    /// A buffer above `BUF_KEEP_MAX` was shrunk or freed since the last `give_back` tick.
    freed_large: Cell<bool>,
    /// Request body bytes this worker's connections hold now (see `proxy::read::reserve_body`).
    pub body_reserved: Cell<usize>,
    pub candidates: RefCell<Vec<Candidate>>,
    pub spans: RefCell<Vec<(usize, usize)>>,
    /// The prefix blocks of the request being routed (buffers reused across requests).
    pub prefix: RefCell<crate::prefix::PrefixHashes>,
    /// Token mode's segment cache and id buffer (used when a tokenizer is configured).
    pub tokens: RefCell<crate::tokenize::TokenScratch>,
    idle_clients: RefCell<Vec<RawFd>>,
    free_idle: RefCell<Vec<usize>>,
    pub open: Cell<usize>,
    pub draining: Cell<bool>,
    /// When a prompt cut short by a bound was last logged (ms since start), and how many were
    /// cut since.
    truncated_logged: Cell<Option<u64>>,
    truncated_since: Cell<u64>,
    /// This worker's access log (None: off).
    pub access_log: RefCell<Option<crate::access_log::AccessLog>>,
}

impl Worker {
    /// The configuration in force (re-read after a reload or fleet change; otherwise a
    /// reference count on this thread's own copy of the pointer).
    #[allow(clippy::redundant_allocation)]
    pub fn cfg(&self) -> Rc<Arc<ServeConfig>> {
        let g = self.shared.fleet.generation.load(Acquire);
        if g != self.config_generation.get() {
            *self.config.borrow_mut() = Rc::new(self.shared.config.load_full());
            self.config_generation.set(g);
        }
        self.config.borrow().clone()
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.shared.workers[self.id]
    }

    pub fn take_buf(&self) -> Vec<u8> {
        self.bufs
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(BUF_CAPACITY))
    }

    /// Take `more` bytes of body memory: from this worker's share of `max_body_memory` (that
    /// divided among the workers, at least one `max_body_bytes`) and from kvlb's total. False,
    /// and nothing taken, when either would be exceeded.
    pub fn take_body_memory(&self, more: usize) -> bool {
        let cfg = self.cfg();
        let all = cfg.limits.max_body_memory;
        let share = (all / cfg.workers.max(1))
            .max(cfg.limits.max_body_bytes)
            .min(all);
        if self.body_reserved.get() + more > share {
            return false;
        }
        let held = &self.shared.body_memory;
        if held.fetch_add(more, Relaxed) + more > all {
            held.fetch_sub(more, Relaxed);
            return false;
        }
        self.body_reserved.set(self.body_reserved.get() + more);
        true
    }

    /// Give back `n` bytes taken with `take_body_memory`.
    pub fn give_body_memory(&self, n: usize) {
        if n > 0 {
            self.shared.body_memory.fetch_sub(n, Relaxed);
            self.body_reserved
                .set(self.body_reserved.get().saturating_sub(n));
        }
    }

    /// Note that a large buffer was shrunk or freed: its memory goes back to the system at the
    /// next tick of `every_second`.
    pub fn freed_large(&self) {
        self.freed_large.set(true);
    }

    pub fn give_buf(&self, mut b: Vec<u8>) {
        if b.capacity() == 0 {
            return;
        }
        b.clear();
        if b.capacity() > BUF_KEEP_MAX {
            b.shrink_to(BUF_CAPACITY);
            self.freed_large.set(true);
        }
        let mut bufs = self.bufs.borrow_mut();
        if bufs.len() < BUF_POOL_MAX {
            bufs.push(b);
        }
    }

    /// An idle keep-alive connection to replica slot `r` as of `epoch`, if any. Connections the
    /// replica closed (or sent unasked-for bytes on) while idle are closed and skipped.
    pub fn pooled_upstream(&self, r: usize, epoch: u64) -> Option<Upstream> {
        let mut pool = self.idle_upstream.borrow_mut();
        while let Some((up, e)) = pool[r].pop() {
            // Otherwise opened to the slot's previous replica, or no longer idle-clean.
            if e == epoch && up.recv.quiet() {
                return Some(up);
            }
            up.close();
        }
        None
    }

    pub fn return_upstream(&self, r: usize, up: Upstream, epoch: u64) {
        let mut pool = self.idle_upstream.borrow_mut();
        let current = self.shared.fleet.slot(r).epoch.load(Relaxed);
        if self.draining.get() || pool[r].len() >= MAX_IDLE_UPSTREAM || epoch != current {
            up.close();
        } else {
            pool[r].push((up, epoch));
        }
    }

    /// Pick up a changed fleet or configuration: rebuild the policy (the only per-worker state
    /// that depends on them). Nothing happens, and nothing is allocated, while they are
    /// unchanged.
    pub fn refresh(&self) {
        let g = self.shared.fleet.generation.load(Relaxed);
        if g == self.generation.get() {
            return;
        }
        self.generation.set(g);
        self.has_prefill
            .set(self.shared.fleet.has_role(crate::config::Role::Prefill));
        self.has_sglang.set(self.shared.fleet.has_sglang_prefill());
        let cfg = self.cfg();
        // A reload reopens the access log (log rotation), or turns it on or off; a log that
        // stays on keeps its buffer.
        let fd = open_access_log_fd(self.id, &cfg);
        {
            let mut log = self.access_log.borrow_mut();
            match (log.as_ref(), fd) {
                (Some(kept), Some(fd)) => kept.reopen(fd),
                (Some(old), None) => {
                    old.flush();
                    *log = None;
                }
                (None, fd) => *log = fd.map(crate::access_log::AccessLog::new),
            }
        }
        let both = build_policies(&self.shared, self.id, &cfg)
            .and_then(|p| Ok((p, build_policies(&self.shared, self.id, &cfg)?)));
        match both {
            Ok((p, d)) => {
                *self.policies.borrow_mut() = p;
                *self.decode_policies.borrow_mut() = d;
            }
            Err(e) => eprintln!(
                "kvlb: worker {}: keeping the previous policies: {e}",
                self.id
            ),
        }
        // Close idle connections to replicas that left.
        let mut pool = self.idle_upstream.borrow_mut();
        for (r, conns) in pool.iter_mut().enumerate() {
            let epoch = self.shared.fleet.slot(r).epoch.load(Relaxed);
            let mut i = 0;
            while i < conns.len() {
                if conns[i].1 != epoch {
                    conns.swap_remove(i).0.close();
                } else {
                    i += 1;
                }
            }
        }
    }

    /// Remember a client connection waiting for its next request (so drain can wake it).
    pub fn idle_client_enter(&self, fd: RawFd) -> usize {
        let mut v = self.idle_clients.borrow_mut();
        match self.free_idle.borrow_mut().pop() {
            Some(i) => {
                v[i] = fd;
                i
            }
            None => {
                v.push(fd);
                v.len() - 1
            }
        }
    }

    pub fn idle_client_leave(&self, slot: usize) {
        self.idle_clients.borrow_mut()[slot] = -1;
        self.free_idle.borrow_mut().push(slot);
    }

    /// Fill `candidates` with the replicas a request may go to now, leaving out those in
    /// `tried`; returns how many. Replicas ejected or failing their health checks are left out;
    /// one in slow start is considered by a growing share of requests. If that leaves none,
    /// every active replica not tried is a candidate (better a likely failure than a certain
    /// one).
    /// Replicas at their concurrency limit are left out and counted: returns (candidates,
    /// replicas left out for being at their limit). Only replicas serving `model` are
    /// considered, in every case (see `crate::models`).
    pub fn fill_candidates(&self, tried: &[usize], model: ModelRoute) -> (usize, usize) {
        let now = self.shared.now_ms();
        let cfg = self.cfg();
        let models = self.shared.models.load();
        let gate = model
            .adapter
            .map(|i| self.adapter_gate(&cfg, &models, i as usize, model.class, now));
        // Whether the replica may take the request, and what it must do first (µs): load an
        // adapter it does not hold.
        let serves = |i: usize, slot: &crate::fleet::ReplicaSlot| -> Option<u32> {
            if !model.leg.admits(slot.role()) {
                return None;
            }
            let epoch = slot.epoch.load(Relaxed);
            match &gate {
                None => models.allows(model.key, i, epoch).then_some(0),
                Some(g) => g.setup_us(&models, i, epoch),
            }
        };
        let slow_start_ms = cfg.health.slow_start.as_millis() as u64;
        let mut capped = 0;
        let max_in_flight = cfg.max_in_flight_of(model.class.table);
        let at_cap = |i: usize, slot: &crate::fleet::ReplicaSlot| {
            let cap = match slot.max_in_flight.load(Relaxed) {
                0 => max_in_flight,
                c => c,
            };
            cap > 0 && self.shared.loads[i].in_flight.load(Relaxed) >= cap
        };
        let lora = model.lora();
        let mut c = self.candidates.borrow_mut();
        c.clear();
        let candidate = |i: usize, setup_us: u32| {
            let load = &self.shared.loads[i];
            let reported = self.shared.telemetry[i].reported.load();
            let lora_slot_busy =
                lora != 0 && reported.lora_slot_busy(lora, now, load.lora.own(lora));
            Candidate {
                replica: i,
                in_flight: load.in_flight.load(Relaxed),
                queued_prefill_tokens: load.queued_prefill_tokens.load(Relaxed),
                decoding: load.decoding.load(Relaxed),
                reported,
                setup_us,
                lora_slot_busy,
                pace: self.shared.pace[i].load(),
                routed: load.routed.load(Relaxed),
                pd: model.leg.path(self.shared.fleet.slot(i).role()),
            }
        };
        // A conversation's stored response: its replica alone while it may take requests
        // (slow start or not), waited for at its limit.
        if let Some(pin) = model.pin.filter(|p| !tried.contains(&p.slot)) {
            let slot = self.shared.fleet.slot(pin.slot);
            if self.pin_holds(pin, slot, now) {
                if let Some(setup_us) = serves(pin.slot, slot) {
                    if at_cap(pin.slot, slot) {
                        return (0, 1);
                    }
                    c.push(candidate(pin.slot, setup_us));
                    return (1, 0);
                }
            }
        }
        for (i, slot) in self.shared.fleet.slots() {
            if !slot.available(now) || tried.contains(&i) {
                continue;
            }
            let Some(setup_us) = serves(i, slot) else {
                continue;
            };
            if at_cap(i, slot) {
                capped += 1;
                continue;
            }
            let ramp = slot.ramp(now, slow_start_ms);
            if ramp < 1.0 {
                let u = (self.rng.borrow_mut().next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                if u >= ramp {
                    continue;
                }
            }
            c.push(candidate(i, setup_us));
        }
        if c.is_empty() && capped == 0 {
            for (i, slot) in self.shared.fleet.slots() {
                if slot.state() != crate::fleet::ACTIVE || tried.contains(&i) {
                    continue;
                }
                if let Some(setup_us) = serves(i, slot) {
                    if at_cap(i, slot) {
                        capped += 1;
                    } else {
                        c.push(candidate(i, setup_us));
                    }
                }
            }
        }
        (c.len(), capped)
    }

    /// Whether the replica of `pin` may take the conversation's request now: the same replica
    /// (slot epoch), healthy and not ejected; draining too, as it still serves while it
    /// drains and the conversation works nowhere else.
    fn pin_holds(&self, pin: Pin, slot: &crate::fleet::ReplicaSlot, now_ms: u64) -> bool {
        use crate::fleet::{ACTIVE, DRAINING};
        matches!(slot.state(), ACTIVE | DRAINING)
            && crate::affinity::AffinityTable::same_epoch(pin.epoch, slot.epoch.load(Relaxed))
            && slot.down_until_ms.load(Relaxed) <= now_ms
            && slot.check_ok.load(Relaxed)
    }

    /// The replica that stored the response a request continues (`previous_response_id` of
    /// `POST /v1/responses`, or the id of a `/v1/responses/{id}` path), counted by outcome
    /// (`kvlb_response_affinity_total`); None for any other request, or when the id is unknown
    /// here or its replica cannot take it (routed as any request: the engine that gets it
    /// answers whether it knows the id).
    pub fn response_pin(
        &self,
        method: crate::http::request::Method,
        target: &[u8],
        body: &[u8],
    ) -> Option<Pin> {
        use crate::affinity::{id_hash, MAX_ID};
        let path = match memchr::memchr(b'?', target) {
            Some(q) => &target[..q],
            None => target,
        };
        let mut buf = [0u8; MAX_ID];
        let mut len = 0usize;
        let id: &[u8] = if path == b"/v1/responses" {
            if method != crate::http::request::Method::Post {
                return None;
            }
            crate::prompt::top_level_string(body, b"previous_response_id", &mut |p: &[u8]| {
                if let Some(dst) = buf.get_mut(len..len + p.len()) {
                    dst.copy_from_slice(p);
                }
                len += p.len();
            });
            if len > MAX_ID {
                return None;
            }
            &buf[..len]
        } else {
            let rest = path.strip_prefix(b"/v1/responses/")?;
            match memchr::memchr(b'/', rest) {
                Some(end) => &rest[..end],
                None => rest,
            }
        };
        if id.is_empty() {
            return None;
        }
        let stats = self.stats();
        let now = self.shared.now_ms();
        let ttl = self.cfg().response_affinity_ttl.as_millis() as u64;
        let Some((slot, epoch)) = self.shared.affinity.find(id_hash(id), now, ttl) else {
            crate::metrics::add(&stats.affinity[crate::metrics::AFFINITY_UNKNOWN], 1);
            return None;
        };
        let pin = Pin { slot, epoch };
        if slot < self.shared.loads.len() && self.pin_holds(pin, self.shared.fleet.slot(slot), now)
        {
            crate::metrics::add(&stats.affinity[crate::metrics::AFFINITY_ROUTED], 1);
            Some(pin)
        } else {
            crate::metrics::add(&stats.affinity[crate::metrics::AFFINITY_UNAVAILABLE], 1);
            static LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new();
            if let Some(left_out) = LOG.allow() {
                eprintln!(
                    "kvlb: a request continues a response stored on replica slot {slot}, which                      is gone or unavailable: routed elsewhere, where the engine answers whether                      it knows the id ({left_out} more since the last such line;                      kvlb_response_affinity_total{{outcome=\"unavailable\"}})"
                );
            }
            None
        }
    }

    /// Remembers that the replica in `slot` (at `epoch`) stored the response `id`; counted in
    /// `kvlb_response_ids_total` (a missing id too: `id` None).
    pub fn learn_response(&self, id: Option<&[u8]>, slot: usize, epoch: u64) {
        use crate::affinity::Learned;
        let stats = self.stats();
        let outcome = match id {
            None => 2,
            Some(id) => {
                let ttl = self.cfg().response_affinity_ttl.as_millis() as u64;
                let hash = crate::affinity::id_hash(id);
                match self
                    .shared
                    .affinity
                    .learn(hash, slot, epoch, self.shared.now_ms(), ttl)
                {
                    Learned::Stored => 0,
                    Learned::Evicted => 1,
                    Learned::Off => return,
                }
            }
        };
        crate::metrics::add(&stats.response_ids[outcome], 1);
    }

    /// Which replicas a request for adapter `i` (`lora_adapter`) may go to now.
    fn adapter_gate<'a>(
        &'a self,
        cfg: &ServeConfig,
        models: &ModelMap,
        i: usize,
        class: ModelClass,
        now: u64,
    ) -> AdapterGate<'a> {
        use crate::models::{FAILED, LOADING};
        let a = &self.shared.on_demand.adapters[i];
        let claim = a.claimed();
        let state = a.state.load(Relaxed);
        let mut failed = false;
        if let (FAILED, Some((slot, epoch))) = (state, claim) {
            // Tried again once a pause has passed since the failure.
            match now.saturating_sub(a.failed_at_ms.load(Relaxed)) >= LOAD_RETRY_MS {
                true => a.release(slot, epoch),
                false => failed = true,
            }
        }
        let (policy, cost) = (
            cfg.model_policy(class.table),
            cfg.cost_model_of(class.table),
        );
        // The larger of the operator's figure and the loads kvlb timed: a load also leaves
        // the adapter's prefixes cold there and takes one of the replica's LoRA slots.
        let setup_us = ((cost.lora_load_s * 1e6) as u64)
            .max(self.shared.on_demand.load_us.load(Relaxed))
            .min(u32::MAX as u64) as u32;
        let priced = policy == select::PolicyName::CacheAware;
        let mut gate = AdapterGate {
            a,
            loading: if state == LOADING { claim } else { None },
            failed,
            setup_us,
            others: true,
        };
        // Without a cost model, replicas without it only while none holding it is available.
        if !priced {
            let held = self.shared.fleet.slots().any(|(s, slot)| {
                slot.available(now) && gate.holds(models, s, slot.epoch.load(Relaxed))
            });
            gate.others = !held;
        }
        gate
    }

    /// Why no replica can take a request for adapter `i`: the 503's message.
    pub fn adapter_unavailable(&self, i: usize) -> String {
        let a = &self.shared.on_demand.adapters[i];
        if a.state.load(Relaxed) == crate::models::FAILED {
            let why = a
                .error
                .load_full()
                .map(|e| e.to_string())
                .unwrap_or_default();
            return format!("loading LoRA adapter {} failed: {why}", a.name);
        }
        format!(
            "no replica serving {} is available to load LoRA adapter {}",
            a.base_name.as_deref().unwrap_or("its base model"),
            a.name
        )
    }

    /// Before a request for adapter `i` goes to `slot` (at `epoch`), which `route` found
    /// without it: claims its load there, unless another is in progress. False: the request
    /// must be routed again (the load in progress elsewhere is where it may go).
    pub fn claim_adapter_load(&self, i: usize, slot: usize, epoch: u64) -> bool {
        let a = &self.shared.on_demand.adapters[i];
        if a.claim(slot, epoch) {
            let _ = self
                .shared
                .on_demand
                .jobs
                .send(crate::models::LoadJob::Load(i));
            return true;
        }
        a.claimed() == Some((slot, epoch)) && a.state.load(Relaxed) == crate::models::LOADING
    }

    /// Waits until adapter `i` is loaded on `slot` (at `epoch`), within `upstream_timeout`.
    /// Err: the 503's message.
    pub async fn adapter_loaded(&self, i: usize, slot: usize, epoch: u64) -> Result<(), String> {
        use crate::models::FAILED;
        let a = &self.shared.on_demand.adapters[i];
        let deadline = crate::rt::now() + self.cfg().timeouts.upstream;
        let mut pause = std::time::Duration::from_millis(1);
        loop {
            if a.holds(slot, epoch) {
                return Ok(());
            }
            if a.claimed() != Some((slot, epoch)) {
                return Err(format!(
                    "LoRA adapter {} was not loaded: its replica left the fleet",
                    a.name
                ));
            }
            if a.state.load(Relaxed) == FAILED {
                return Err(self.adapter_unavailable(i));
            }
            if crate::rt::now() >= deadline {
                return Err(format!("LoRA adapter {} is still loading", a.name));
            }
            op::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(20));
        }
    }

    /// Whether the replica `slot` (at `epoch`) holds adapter `i` (listed or loaded by kvlb).
    pub fn adapter_held(&self, i: usize, slot: usize, epoch: u64) -> bool {
        let gate = AdapterGate {
            a: &self.shared.on_demand.adapters[i],
            loading: None,
            failed: false,
            setup_us: 0,
            others: false,
        };
        gate.holds(&self.shared.models.load(), slot, epoch)
    }
}

/// Where a request for an adapter kvlb loads on demand may go: the replicas holding it, and,
/// priced with a load, those serving its base, one load at a time.
struct AdapterGate<'a> {
    a: &'a crate::models::OnDemandAdapter,
    /// The load in progress (slot, epoch).
    loading: Option<(usize, u64)>,
    /// The last load failed a moment ago: only replicas holding it.
    failed: bool,
    /// What a load costs a replica without it, µs.
    setup_us: u32,
    /// Whether replicas without it may take it (no load in progress, or that one).
    others: bool,
}

impl AdapterGate<'_> {
    fn holds(&self, models: &ModelMap, slot: usize, epoch: u64) -> bool {
        self.a.holds(slot, epoch)
            || (models.covers(slot, epoch)
                && models.allows(ModelKey::Named(self.a.key), slot, epoch))
    }

    /// None: not a candidate; else the µs it must spend first.
    fn setup_us(&self, models: &ModelMap, slot: usize, epoch: u64) -> Option<u32> {
        if self.holds(models, slot, epoch) {
            return Some(0);
        }
        let base = models.covers(slot, epoch)
            && self
                .a
                .base
                .is_none_or(|b| models.allows(ModelKey::Named(b), slot, epoch));
        if !base || self.failed || !self.others {
            return None;
        }
        match self.loading {
            None => Some(self.setup_us),
            Some(at) if at == (slot, epoch) => Some(self.setup_us),
            Some(_) => None,
        }
    }
}

impl Worker {
    /// The model the request is routed by: its `model` (read with its prompt when `parsed`,
    /// else skimmed from `body`) as the replicas serve it, or an adapter kvlb is to load; and
    /// its class (metric label, `[[model]]` table).
    pub fn request_model(&self, body: &[u8], parsed: bool) -> (RequestModel, ModelClass) {
        let models = self.shared.models.load();
        let mut prefix = self.prefix.borrow_mut();
        if !models.knows_any() {
            if !self.cfg().models.is_empty() {
                if !parsed {
                    crate::models::top_level_model(body, &mut prefix.model);
                }
                let any = Resolved::Route(ModelKey::Any);
                return (
                    RequestModel::Route(ModelKey::Any),
                    models.class(&prefix.model, any),
                );
            }
            return (RequestModel::Route(ModelKey::Any), ModelClass::default());
        }
        if !parsed {
            crate::models::top_level_model(body, &mut prefix.model);
        }
        if let Some(i) = self.shared.on_demand.find(&prefix.model) {
            let class = models.class_of(&self.shared.on_demand.adapters[i].name);
            return (RequestModel::Adapter(i), class);
        }
        let resolved = models.resolve(&prefix.model);
        let class = models.class(&prefix.model, resolved);
        let model = match resolved {
            Resolved::Route(key) => RequestModel::Route(key),
            Resolved::NotServed(key) => {
                // A replica whose names are not known yet (just added, or listing none) may.
                let open = self.shared.fleet.slots().any(|(i, s)| {
                    s.state() == crate::fleet::ACTIVE && !models.covers(i, s.epoch.load(Relaxed))
                });
                match open {
                    true => RequestModel::Route(key),
                    false => RequestModel::NotServed,
                }
            }
        };
        (model, class)
    }
}

/// A failed on-demand adapter load is tried again by requests this long after it failed.
const LOAD_RETRY_MS: u64 = 2_000;

/// Where a request's model lets it go, and how it is counted and set.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelRoute {
    pub key: ModelKey,
    pub class: ModelClass,
    /// An adapter kvlb loads on demand (`lora_adapter` index): routed by `AdapterGate`.
    pub adapter: Option<u16>,
    /// The replica that stored the response this request continues: the only candidate
    /// while it is available (`Worker::response_pin`).
    pub pin: Option<Pin>,
    /// Which replicas it may go to by their role (prefill/decode disaggregation).
    pub leg: Leg,
}

pub use kvlb_core::pd::Leg;

/// A replica slot and the low bits of its epoch (`affinity::AffinityTable`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub slot: usize,
    pub epoch: u64,
}

impl ModelRoute {
    /// The LoRA adapter the request runs under, by its name hash (0: none): it needs one of
    /// the replica's LoRA batch slots.
    #[inline]
    pub fn lora(&self) -> u64 {
        match self.key {
            ModelKey::Named(h) if self.class.adapter || self.adapter.is_some() => h,
            _ => 0,
        }
    }
}

/// What a request's `model` asks of routing.
pub enum RequestModel {
    Route(ModelKey),
    /// The `lora_adapter` of this index: to a replica holding it, or one of its base that
    /// loads it first.
    Adapter(usize),
    /// No replica serves it, nor may: OpenAI's 404.
    NotServed,
}

/// A routing decision: the replica chosen for a request and why.
pub struct Choice {
    pub replica: usize,
    pub decision: Option<crate::select::Decision>,
    /// Estimated prompt tokens of the request.
    pub prompt_tokens: u32,
}

impl Choice {
    /// Prompt tokens the replica will compute: the prompt less what is resident there.
    pub fn prefill_tokens(&self) -> u64 {
        let matched = self.decision.map(|d| d.matched_tokens).unwrap_or(0);
        self.prompt_tokens.saturating_sub(matched) as u64
    }

    /// The policy's time-to-first-token estimate and what it was made of (none when it makes
    /// none).
    pub fn expected(&self) -> crate::worker::Expected {
        self.decision
            .map(|d| crate::worker::Expected {
                wait: d.wait,
                prefill: d.prefill,
                decode_step_s: d.decode_step_s,
                fixed_s: d.fixed_s,
                pace: d.pace,
            })
            .unwrap_or_default()
    }
}

impl Worker {
    /// A TCP connection to a replica, within the configured connect timeout (L7 and L4 alike).
    pub async fn connect_replica(&self, addr: SocketAddr) -> io::Result<RawFd> {
        let fd = op::tcp_socket(&addr)?;
        match op::connect(fd, addr, self.cfg().timeouts.connect).await {
            Ok(()) => Ok(fd),
            Err(e) => {
                op::close(fd);
                Err(e)
            }
        }
    }

    /// Hash the prompt's prefix blocks into the worker's buffers (no allocation in text mode),
    /// reading at most `shared.prompt_limits` of it. False when the body is not a prompt, or a
    /// bound stopped it before the fields its prefix starts with; malformed prompts are counted
    /// by kind, prompts cut short by bound (and logged now and then). With a tokenizer
    /// configured, chat and text completions prompts read whole are hashed as the engine's
    /// token ids (`crate::tokenize`); a request it cannot tokenize is counted and hashed as
    /// text.
    pub fn hash_prompt(&self, path: &[u8], body: &[u8]) -> bool {
        use crate::prompt::Extent;
        let mut prefix = self.prefix.borrow_mut();
        let text = crate::prefix::hash_request_within(
            path,
            body,
            &self.shared.prefix,
            &self.shared.prompt_limits,
            &mut prefix,
        );
        // Rendering and tokenizing cost far more a byte than reading: only a prompt read whole
        // within the bounds is tokenized.
        let whole = text.is_ok() && prefix.extent == Extent::Whole;
        if let (true, Some(tokenizer)) = (whole, &self.shared.cfg().token_mode) {
            let mut scratch = self.tokens.borrow_mut();
            let scratch = &mut *scratch;
            match tokenizer
                .0
                .request_tokens(path, body, &mut scratch.cache, &mut scratch.ids)
            {
                Ok(true) => {
                    crate::tokenize::fill_prefix(&scratch.ids, &self.shared.prefix, &mut prefix);
                    crate::tokenize::TOKENIZED_REQUESTS.fetch_add(1, Relaxed);
                    return true;
                }
                Ok(false) => {}
                Err(_) => {
                    crate::tokenize::TOKENIZE_ERRORS.fetch_add(1, Relaxed);
                }
            }
        }
        match text {
            Ok(()) => match prefix.extent {
                Extent::Whole => true,
                Extent::Prefix(bound) => {
                    self.prompt_truncated(bound, Some(prefix.hashes.len()), body.len());
                    true
                }
                Extent::Unknown(bound) => {
                    self.prompt_truncated(bound, None, body.len());
                    false
                }
            },
            Err(crate::prompt::PromptError::NotAPromptPath) => false,
            Err(e) => {
                let labels = crate::metrics::PROMPT_ERRORS;
                if let Some(i) = labels.iter().position(|l| *l == e.label()) {
                    crate::metrics::add(&self.stats().prompt_errors[i], 1);
                }
                false
            }
        }
    }

    /// Counts a prompt that `bound` cut short (`blocks` hashed before it, or None: no prefix),
    /// and says so on stderr at most every [`TRUNCATED_LOG_EVERY_MS`].
    fn prompt_truncated(&self, bound: crate::prompt::Bound, blocks: Option<usize>, body: usize) {
        use crate::prompt::Bound;
        let i = Bound::ALL.iter().position(|b| *b == bound).unwrap_or(0);
        crate::metrics::add(&self.stats().prompt_truncated[i], 1);
        let now = self.shared.now_ms();
        let since = self.truncated_since.get() + 1;
        let due = self
            .truncated_logged
            .get()
            .is_none_or(|t| now.saturating_sub(t) >= TRUNCATED_LOG_EVERY_MS);
        if !due {
            self.truncated_since.set(since);
            return;
        }
        self.truncated_logged.set(Some(now));
        self.truncated_since.set(0);
        let limits = &self.shared.prompt_limits;
        let what = match bound {
            Bound::Tokens => format!("max_prompt_tokens ({})", limits.max_tokens),
            Bound::Messages => format!("the message bound ({})", limits.max_messages),
            Bound::Parts => format!("the content part bound ({})", limits.max_parts),
            Bound::Work => "the work bound (escape- or structure-dense JSON)".to_string(),
        };
        let routed = match blocks {
            Some(n) => format!("routed on the {n} blocks before it"),
            None => "routed by load (the fields its prefix starts with were not found)".to_string(),
        };
        eprintln!(
            "kvlb: worker {}: a {body}-byte prompt was read up to {what}, {routed}; \
             {since} cut short since the last such line (kvlb_prompt_truncated_total)",
            self.id
        );
    }

    /// Ask the policy for one of the candidates `fill_candidates` left (at least one), and
    /// count its decision. `hashed`: the worker's prefix buffers hold this request's blocks
    /// (`hash_prompt` returned true); otherwise the body's size (`body_len`, about 4 bytes a
    /// token) stands for its work. `pinned`: the candidates are the one replica that stored
    /// the response the request continues (the decision says `affinity`). `leg`: a decode leg
    /// is chosen by the decode legs' own policy (`decode_policies`).
    #[allow(clippy::too_many_arguments)]
    pub fn choose(
        &self,
        method: crate::http::request::Method,
        path: &[u8],
        body: &[u8],
        body_len: usize,
        hashed: bool,
        class: ModelClass,
        pinned: bool,
        leg: Leg,
    ) -> Choice {
        let prefix = self.prefix.borrow();
        let (blocks, block_tokens, prompt_tokens): (&[u64], u32, u32) = if hashed {
            let block_tokens = match prefix.mode {
                crate::prefix::PrefixMode::Text => prefix.block_units / 4,
                crate::prefix::PrefixMode::Tokens => prefix.block_units,
            };
            (&prefix.hashes, block_tokens, prefix.est_prompt_tokens)
        } else {
            (&[], 0, (body_len / 4).min(u32::MAX as usize) as u32)
        };
        let view = select::RequestView {
            method,
            path,
            body,
            blocks,
            block_tokens,
            prompt_tokens,
            now_us: crate::rt::now()
                .saturating_duration_since(self.shared.epoch)
                .as_micros() as u64,
        };
        let random = self.rng.borrow_mut().next_u64();
        let (replica, decision) = {
            let cands = self.candidates.borrow();
            let mut policies = match leg {
                Leg::Decode => self.decode_policies.borrow_mut(),
                _ => self.policies.borrow_mut(),
            };
            // A table gone since the map was built (a reload): the global policy.
            let t = match class.table as usize {
                t if t < policies.len() => t,
                _ => 0,
            };
            let policy = &mut policies[t];
            let i = policy.select(&view, &cands, random);
            let chosen = &cands[i.min(cands.len() - 1)];
            if chosen.lora_slot_busy {
                crate::metrics::add(&self.stats().lora_slot_waits, 1);
            }
            let mut decision = policy.decision();
            if pinned {
                if let Some(d) = decision.as_mut() {
                    d.reason = select::Reason::Affinity;
                }
            }
            (chosen.replica, decision)
        };
        // The decision metrics describe where prompts were computed: a decode leg's is not one.
        if let Some(d) = decision.filter(|_| leg != Leg::Decode) {
            let stats = self.stats();
            let reason = match d.reason {
                select::Reason::Cache => 0,
                select::Reason::Load => 1,
                select::Reason::Fallback => 2,
                select::Reason::Affinity => 3,
            };
            crate::metrics::add(&stats.decisions[reason], 1);
            if d.spilled {
                crate::metrics::add(&stats.spills, 1);
            }
            stats.matched_tokens.observe(d.matched_tokens as f64);
            stats.estimated_ttft.observe_us((d.ttft_s * 1e6) as u64);
        }
        Choice {
            replica,
            decision,
            prompt_tokens,
        }
    }
}

/// The policies a worker runs under `cfg`: the global one, then each `[[model]]` table's.
fn build_policies(
    shared: &Shared,
    id: usize,
    cfg: &ServeConfig,
) -> Result<Vec<Box<dyn Policy>>, String> {
    let build = |policy, cost: &crate::config::CostModel| {
        let parts = select::CacheAwareParts {
            index: shared.residency.clone(),
            offload: shared.offload_residency.clone(),
            log: shared.routing_logs[id].clone(),
            config: cost.policy_config(),
        };
        select::build(policy, id, Some(parts))
    };
    std::iter::once(build(cfg.policy, &cfg.cost_model))
        .chain(cfg.models.iter().map(|m| build(m.policy, &m.cost_model)))
        .collect()
}

/// Create a listening socket bound to `addr` with SO_REUSEPORT.
pub fn bind_listener(addr: SocketAddr, backlog: i32) -> io::Result<RawFd> {
    let fd = op::tcp_socket(&addr)?;
    let one: libc::c_int = 1;
    for opt in [libc::SO_REUSEADDR, libc::SO_REUSEPORT] {
        // Safety: setsockopt with a valid c_int pointer and size.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                &one as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            op::close(fd);
            return Err(e);
        }
    }
    if let Err(e) = op::bind(fd, addr) {
        op::close(fd);
        return Err(e);
    }
    // Safety: listen(2) on a bound socket we own.
    if unsafe { libc::listen(fd, backlog) } < 0 {
        let e = io::Error::last_os_error();
        op::close(fd);
        return Err(e);
    }
    Ok(fd)
}

impl Worker {
    /// The state of worker `id`, with its own policy (Err: the policy could not be built).
    pub fn new(id: usize, shared: Arc<Shared>) -> Result<Rc<Worker>, String> {
        let n_replicas = shared.fleet.capacity();
        let generation = shared.fleet.generation.load(Relaxed);
        let policies = build_policies(&shared, id, &shared.cfg())?;
        let decode_policies = build_policies(&shared, id, &shared.cfg())?;
        Ok(Rc::new(Worker {
            id,
            policies: RefCell::new(policies),
            decode_policies: RefCell::new(decode_policies),
            rng: RefCell::new(Rng::new(
                0x9e37_79b9_7f4a_7c15 ^ ((id as u64 + 1) << 17) ^ std::process::id() as u64,
            )),
            idle_upstream: RefCell::new((0..n_replicas).map(|_| Vec::new()).collect()),
            generation: Cell::new(generation),
            has_prefill: Cell::new(shared.fleet.has_role(crate::config::Role::Prefill)),
            has_sglang: Cell::new(shared.fleet.has_sglang_prefill()),
            rooms: RefCell::new(Rng::new(os_random())),
            config: RefCell::new(Rc::new(shared.config.load_full())),
            config_generation: Cell::new(0),
            bufs: RefCell::new(Vec::new()),
            freed_large: Cell::new(false),
            body_reserved: Cell::new(0),
            candidates: RefCell::new(Vec::with_capacity(n_replicas)),
            spans: RefCell::new(Vec::with_capacity(64)),
            prefix: RefCell::new({
                let mut prefix = crate::prefix::PrefixHashes::new(&shared.prefix);
                prefix.set_adapters(shared.adapters.clone());
                prefix
            }),
            tokens: RefCell::new(crate::tokenize::TokenScratch::default()),
            idle_clients: RefCell::new(Vec::new()),
            free_idle: RefCell::new(Vec::new()),
            open: Cell::new(0),
            draining: Cell::new(false),
            truncated_logged: Cell::new(None),
            truncated_since: Cell::new(0),
            access_log: RefCell::new(open_access_log(id, &shared.cfg())),
            shared,
        }))
    }

    /// Shut the read side of every connection idling between requests, so that it ends; busy
    /// ones finish their request first (draining).
    pub fn wake_idle_clients(&self) {
        for &fd in self.idle_clients.borrow().iter() {
            if fd >= 0 {
                // Safety: fd is an open client socket owned by a task of this worker.
                unsafe { libc::shutdown(fd, libc::SHUT_RD) };
            }
        }
    }

    /// The worker is done: write the access log's last lines, close the pooled upstream
    /// connections.
    pub fn close(&self) {
        if let Some(log) = self.access_log.borrow().as_ref() {
            log.flush();
        }
        for pool in self.idle_upstream.borrow_mut().drain(..) {
            for (up, _) in pool {
                up.close();
            }
        }
    }

    /// Housekeeping, every `access_log::FLUSH_EVERY`: writes the access log's waiting lines,
    /// and gives the memory of large buffers freed since the last tick back to the system (so
    /// RSS falls back after a burst of large bodies instead of staying at its peak).
    pub fn housekeeping(&self) {
        if let Some(log) = self.access_log.borrow().as_ref() {
            if log.has_pending() {
                log.flush();
            }
        }
        if self.freed_large.replace(false) {
            crate::alloc::give_back_freed_memory();
        }
    }
}

/// The access log of worker `id` under `cfg`, opened (None when off, or when the file cannot
/// be opened: said on stderr, and requests go on unlogged).
fn open_access_log(id: usize, cfg: &ServeConfig) -> Option<crate::access_log::AccessLog> {
    open_access_log_fd(id, cfg).map(crate::access_log::AccessLog::new)
}

/// The file of `open_access_log`, opened for appending.
fn open_access_log_fd(id: usize, cfg: &ServeConfig) -> Option<std::os::fd::OwnedFd> {
    let path = cfg.access_log.as_deref()?;
    match crate::access_log::open(path) {
        Ok(fd) => Some(fd),
        Err(e) => {
            eprintln!("kvlb: worker {id}: access_log {path:?}: {e}; requests are not logged");
            None
        }
    }
}

/// 64 bits from the OS's randomness (std's hash keys are drawn from it per thread).
fn os_random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}
