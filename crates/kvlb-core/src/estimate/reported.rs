//! What a replica says of its own queue and KV cache (its scraped /metrics), turned into the
//! cost model's inputs beside kvlb's own counts. Pure: the clock is an argument.
//!
//! # Queue: this instance's requests now, everyone else's as last reported
//!
//! kvlb counts its own requests exactly and at once (`ReplicaLoad`: queued prefill tokens,
//! decoding, in flight); a replica's /metrics counts everyone's (`waiting + running`), but only
//! as of the last scrape. Several kvlb instances in front of one fleet each see only their own
//! requests, so each must learn the others' from the replica's figures. The scrape thread
//! therefore stores, with each scrape, the replica's requests that this instance did not send:
//!
//! ```text
//! foreign         = max(waiting + running - own_in_flight_at_scrape, 0)
//! foreign_running = min(foreign, max(running - own_decoding_at_scrape, 0))
//! foreign_waiting = foreign - foreign_running
//! ```
//!
//! and the model sees, while the figure is fresh,
//!
//! ```text
//! in_flight             = own_in_flight + foreign
//! decoding              = own_decoding  + foreign_running
//! queued_prefill_tokens = own_queued    + foreign_waiting * foreign_request_tokens
//! ```
//!
//! That is the replica's reported queue with this instance's part replaced by its current
//! count: requests it sent since the scrape are in `own_*` at once (so two instances that both
//! saw an idle replica do not both keep piling on it: each counts its own sends the moment it
//! makes them, and the other's at the next scrape), and its requests finished since the scrape
//! leave at once. It is never below kvlb's own count (`foreign >= 0`), and with a single
//! instance in front of the fleet `foreign` is about 0, so nothing is counted twice — which a
//! plain `own + reported` would do, and which `max(own, reported)` would miss for the
//! requests sent since the scrape. A request sent before the scrape but not yet arrived
//! counts as own and not as the replica's, so `foreign` errs low by the requests in transit.
//!
//! `foreign_request_tokens` (default 1024) prices a foreign waiting request's prefill: its
//! prompt is unknown here. Foreign running requests are priced as decoding sequences (they
//! slow every step), which is what most of them are.
//!
//! # Age
//!
//! A figure counts while `now_ms - at_ms <= max_age_ms`, where the scrape thread sets
//! `max_age_ms` to `FRESH_SCRAPE_INTERVALS` (3) scrape intervals: one late scrape keeps the
//! last figure in force, while a replica that stopped answering /metrics (or a scrape thread
//! gone) stops counting after three intervals instead of freezing a queue forever. Older
//! figures (and no figure: `at_ms == 0`) add nothing.
//!
//! # KV usage: a near-full replica's hits are worth less
//!
//! vLLM's `kv_cache_usage_perc` and SGLang's `token_usage` count blocks held by running
//! requests; cached blocks nobody holds count as free and are the first to be evicted when a
//! request needs room. Above `kv_evict_from` (default 0.9) the replica is evicting as it
//! admits work, so a prefix resident now may be gone when the request is scheduled (and a
//! residency kvlb only assumed from its routing is likelier to be stale). The matched tokens
//! credited to such a replica are scaled by
//!
//! ```text
//! hit_keep(u) = 1                                                    u <= evict_from
//!             = 1 - (1 - keep_at_full) * (u - evict_from) / (1 - evict_from)   above
//! ```
//!
//! down to `kv_hit_keep_at_full` (default 0.5) at u = 1: blocks running requests hold are
//! shared and safe, so a hit never counts for nothing, but a warm full replica no longer wins
//! on its hit alone against an empty one. Usage is deliberately not a queue penalty as well:
//! the waiting it causes (requests held back for blocks) shows in the reported `waiting`
//! count, which the queue above already prices; penalising usage too would count it twice.
//! Stale or missing usage keeps every hit whole.
//!
//! # LoRA batch slots: an adapter that would wait for one
//!
//! An engine runs the requests of at most `max_loras` adapters in one batch (vLLM
//! `--max-loras`, default 1). While that many adapters have requests running there, a request
//! for any other adapter is skipped by the scheduler (it does not block the queue) until every
//! request of one of them has finished. vLLM reports it in `vllm:lora_requests_info`: its
//! `max_lora` label, and in `running_lora_adapters` the adapters with requests there (vLLM 0.33
//! lists an adapter with only waiting requests too, so the list says "has requests", not
//! "holds a slot"). The scrape keeps the slot count, the number of adapters listed and a
//! 256-bit mask of their name hashes (`LoraMask`); `lora_slot_busy` says a request for an
//! adapter would wait for a slot there: the figure is fresh, the adapters listed fill the
//! slots, and the request's adapter is not among them. The mask may say "among them" for an
//! adapter that is not (two names in one bit: with 8 adapters listed, 3% of the others), which
//! prices the request as today, never worse. This instance's own requests count at once
//! (`OwnLora`, kept by the workers as they send and finish them): an adapter it has requests
//! for there is never kept waiting, and the adapters it has requests for there fill the
//! slots as the report's do (the larger of the two counts). The cost model adds the wait for
//! a slot (`TtftModel::lora_slot_wait`: one request's decode) to the replica's queue.

#![forbid(unsafe_code)]

use super::ReplicaLoad;

/// The adapters with requests on a replica, as a 256-bit mask of their name hashes
/// (`models::name_hash`): a fixed size whatever their number, and one bit test per lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoraMask(pub [u64; 4]);

impl LoraMask {
    /// Bits of the mask.
    pub const BITS: usize = 256;

    /// The bit of the adapter whose name hash is `hash` (the top byte): 0..256.
    #[inline]
    pub fn bit_index(hash: u64) -> usize {
        (hash >> 56) as usize
    }

    fn bit(hash: u64) -> (usize, u64) {
        let b = LoraMask::bit_index(hash);
        (b / 64, 1 << (b % 64))
    }

    /// Add the adapter whose name hash is `hash`.
    pub fn insert(&mut self, hash: u64) {
        let (w, m) = LoraMask::bit(hash);
        self.0[w] |= m;
    }

    /// Whether the adapter may be among those added (never false for one added).
    pub fn may_contain(&self, hash: u64) -> bool {
        let (w, m) = LoraMask::bit(hash);
        self.0[w] & m != 0
    }
}

/// This instance's own requests on a replica for LoRA adapters, counted the moment it sends
/// them (the report is as old as the last scrape): whether it has requests there for the
/// adapter asked about, and for how many adapters (counted by mask bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OwnLora {
    pub holds: bool,
    pub adapters: u32,
}

/// What a replica's /metrics said of its LoRA batch slots (module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoraReport {
    /// Adapters one batch may run (vLLM `max_lora`); 0: not reported.
    pub slots: u32,
    /// Adapters listed with requests there (`running_lora_adapters`).
    pub active: u32,
    /// Their names.
    pub names: LoraMask,
}

/// A figure is used for this many scrape intervals after its scrape.
pub const FRESH_SCRAPE_INTERVALS: u64 = 3;

/// What the last scrape of one replica said, net of this instance's requests (module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReportedLoad {
    /// Requests waiting there that this instance did not send.
    pub foreign_waiting: u32,
    /// Requests running there that this instance did not send.
    pub foreign_running: u32,
    /// KV cache usage in thousandths (0..=1000); 0 when not reported.
    pub kv_usage_milli: u32,
    /// kvlb's clock (ms since start) at the scrape; 0: never scraped.
    pub at_ms: u64,
    /// The figure is ignored once older than this.
    pub max_age_ms: u64,
    /// Its LoRA batch slots (default: not reported).
    pub lora: LoraReport,
}

impl ReportedLoad {
    /// A figure scraped at `at_ms` from a replica reporting `waiting` and `running` requests and
    /// `kv_usage` (0..1; None when absent), while this instance had `own_in_flight` requests
    /// there, `own_decoding` of them past their first token; polled every `interval_ms`.
    pub fn from_scrape(
        waiting: u64,
        running: u64,
        kv_usage: Option<f64>,
        own_in_flight: u64,
        own_decoding: u64,
        at_ms: u64,
        interval_ms: u64,
    ) -> ReportedLoad {
        let (foreign_waiting, foreign_running) =
            foreign_requests(waiting, running, own_in_flight, own_decoding);
        let kv_usage_milli = match kv_usage {
            Some(u) if u.is_finite() => (u.clamp(0.0, 1.0) * 1000.0).round() as u32,
            _ => 0,
        };
        ReportedLoad {
            foreign_waiting,
            foreign_running,
            kv_usage_milli,
            at_ms: at_ms.max(1),
            max_age_ms: interval_ms.saturating_mul(FRESH_SCRAPE_INTERVALS),
            lora: LoraReport::default(),
        }
    }

    /// This figure with the replica's LoRA report.
    pub fn with_lora(self, lora: LoraReport) -> ReportedLoad {
        ReportedLoad { lora, ..self }
    }

    /// Whether a request for the adapter named by `adapter` (its name hash; 0: no adapter)
    /// would wait there for a LoRA batch slot at `now_ms`, given this instance's `own`
    /// requests there (module header). The slot count is the engine's setting and holds
    /// however old the figure; the adapters listed count only while it is fresh.
    #[inline]
    pub fn lora_slot_busy(&self, adapter: u64, now_ms: u64, own: OwnLora) -> bool {
        let l = &self.lora;
        if adapter == 0 || l.slots == 0 || own.holds {
            return false;
        }
        let active = match self.fresh(now_ms) {
            true if l.names.may_contain(adapter) => return false,
            true => l.active.max(own.adapters),
            false => own.adapters,
        };
        active >= l.slots
    }

    /// Whether the figure counts at `now_ms`.
    pub fn fresh(&self, now_ms: u64) -> bool {
        self.at_ms != 0 && now_ms.saturating_sub(self.at_ms) <= self.max_age_ms
    }
}

/// The replica's requests that this instance did not send: (waiting, running), see the module
/// header. Counts beyond `u32::MAX` saturate.
pub fn foreign_requests(
    waiting: u64,
    running: u64,
    own_in_flight: u64,
    own_decoding: u64,
) -> (u32, u32) {
    let foreign = waiting
        .saturating_add(running)
        .saturating_sub(own_in_flight);
    let foreign_running = foreign.min(running.saturating_sub(own_decoding));
    let foreign_waiting = foreign - foreign_running;
    let narrow = |v: u64| v.min(u32::MAX as u64) as u32;
    (narrow(foreign_waiting), narrow(foreign_running))
}

/// The load the cost model sees at `now_ms`: this instance's own `own` plus the replica's
/// other requests from a fresh `reported` figure, each foreign waiting request counted as
/// `foreign_request_tokens` of queued prefill.
pub fn combined_load(
    own: ReplicaLoad,
    reported: &ReportedLoad,
    now_ms: u64,
    foreign_request_tokens: u32,
) -> ReplicaLoad {
    if !reported.fresh(now_ms) {
        return own;
    }
    let foreign = reported
        .foreign_waiting
        .saturating_add(reported.foreign_running);
    ReplicaLoad {
        queued_prefill_tokens: own
            .queued_prefill_tokens
            .saturating_add(reported.foreign_waiting as u64 * foreign_request_tokens as u64),
        decoding: own.decoding.saturating_add(reported.foreign_running),
        in_flight: own.in_flight.saturating_add(foreign),
    }
}

/// The share of a cache hit credited to a replica whose fresh `reported` KV usage is high (see
/// the module header); 1 when the usage is stale, missing or at most `evict_from`.
pub fn hit_keep(reported: &ReportedLoad, now_ms: u64, evict_from: f64, keep_at_full: f64) -> f64 {
    if !reported.fresh(now_ms) {
        return 1.0;
    }
    let u = reported.kv_usage_milli.min(1000) as f64 / 1000.0;
    if u <= evict_from || evict_from >= 1.0 {
        return 1.0;
    }
    let over = (u - evict_from) / (1.0 - evict_from);
    (1.0 - (1.0 - keep_at_full) * over).clamp(keep_at_full.min(1.0), 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own(queued: u64, decoding: u32, in_flight: u32) -> ReplicaLoad {
        ReplicaLoad {
            queued_prefill_tokens: queued,
            decoding,
            in_flight,
        }
    }

    #[test]
    fn an_adapter_waits_for_a_slot_only_when_the_slots_are_full_of_others() {
        use crate::models::name_hash;
        let mut names = LoraMask::default();
        for n in ["sql", "chat"] {
            names.insert(name_hash(n.as_bytes()));
        }
        let at = |slots, active| {
            ReportedLoad::from_scrape(0, 2, None, 0, 0, 1_000, 1_000).with_lora(LoraReport {
                slots,
                active,
                names,
            })
        };
        let (sql, code) = (name_hash(b"sql"), name_hash(b"code"));
        assert_ne!(
            LoraMask::bit(sql),
            LoraMask::bit(code),
            "pick names in distinct bits"
        );
        let none = OwnLora::default();
        // Two slots, both held: another adapter waits, the holders do not.
        assert!(at(2, 2).lora_slot_busy(code, 1_500, none));
        assert!(!at(2, 2).lora_slot_busy(sql, 1_500, none));
        // A free slot, no report, no adapter, or a stale figure: no wait.
        assert!(!at(4, 2).lora_slot_busy(code, 1_500, none));
        assert!(!at(0, 2).lora_slot_busy(code, 1_500, none));
        assert!(!at(2, 2).lora_slot_busy(0, 1_500, none));
        let stale = 1_000 + 3_001;
        assert!(!at(2, 2).lora_slot_busy(code, stale, none));
        // More listed than slots is full.
        assert!(at(1, 2).lora_slot_busy(code, 1_500, none));
        // Our own requests count at once: for the adapter itself (it has a slot there, or is
        // queued behind its own), and as adapters filling the slots, stale report or not.
        let own = |holds, adapters| OwnLora { holds, adapters };
        assert!(!at(2, 2).lora_slot_busy(code, 1_500, own(true, 2)));
        assert!(at(2, 0).lora_slot_busy(code, 1_500, own(false, 2)));
        assert!(at(2, 2).lora_slot_busy(code, stale, own(false, 2)));
        assert!(!at(2, 2).lora_slot_busy(code, stale, own(false, 1)));
        // Every added name is found, whatever the count.
        let mut many = LoraMask::default();
        for i in 0..1000u32 {
            many.insert(name_hash(format!("a{i}").as_bytes()));
        }
        assert!((0..1000u32).all(|i| many.may_contain(name_hash(format!("a{i}").as_bytes()))));
    }

    #[test]
    fn foreign_is_the_reported_queue_less_our_own() {
        // Alone in front of the replica: all 5 are ours, nothing foreign.
        assert_eq!(foreign_requests(2, 3, 5, 3), (0, 0));
        // Another instance runs 4 and queues 1 there besides our 2 decoding.
        assert_eq!(foreign_requests(1, 6, 2, 2), (1, 4));
        // Our requests in transit (sent, not yet counted by the replica) never make it negative.
        assert_eq!(foreign_requests(0, 1, 4, 0), (0, 0));
        // Ours still prefilling show as running there: the foreign total stays right, and
        // running is credited first.
        assert_eq!(foreign_requests(0, 5, 2, 0), (0, 3));
        assert_eq!(foreign_requests(3, 0, 1, 0), (2, 0));
        // Absurd figures saturate instead of overflowing.
        assert_eq!(foreign_requests(u64::MAX, u64::MAX, 0, 0), (0, u32::MAX));
    }

    #[test]
    fn fresh_for_three_intervals_then_ignored() {
        let r = ReportedLoad::from_scrape(4, 2, Some(0.5), 0, 0, 10_000, 200);
        assert_eq!(r.max_age_ms, 600);
        assert!(r.fresh(10_000));
        assert!(r.fresh(10_600));
        assert!(!r.fresh(10_601));
        // A clock read before the scrape's (another thread) counts as fresh.
        assert!(r.fresh(9_000));
        assert!(!ReportedLoad::default().fresh(0));
        assert!(!ReportedLoad::default().fresh(5));
        // Scraped at time 0: stored as 1, still a scrape.
        assert!(ReportedLoad::from_scrape(0, 0, None, 0, 0, 0, 100).fresh(50));
    }

    #[test]
    fn combined_load_adds_foreign_requests_while_fresh() {
        // Replica says 3 waiting + 7 running; we had 2 in flight, 1 decoding, at the scrape.
        let r = ReportedLoad::from_scrape(3, 7, Some(0.4), 2, 1, 1_000, 250);
        assert_eq!((r.foreign_waiting, r.foreign_running), (2, 6));
        assert_eq!(r.kv_usage_milli, 400);
        // Since then we sent 3 more (queued 3000 tokens) and one of ours finished.
        let now = own(3000, 1, 4);
        assert_eq!(
            combined_load(now, &r, 1_500, 1024),
            own(3000 + 2 * 1024, 7, 12)
        );
        // Past 3 intervals: our own count alone.
        assert_eq!(combined_load(now, &r, 1_751, 1024), now);
        assert_eq!(
            combined_load(now, &ReportedLoad::default(), 1_500, 1024),
            now
        );
    }

    #[test]
    fn two_instances_do_not_both_pile_on_an_idle_replica() {
        // Both instances scraped the replica idle; instance A has since sent it 4 requests.
        let scraped = ReportedLoad::from_scrape(0, 0, None, 0, 0, 100, 1000);
        let a_now = combined_load(own(4096, 0, 4), &scraped, 200, 1024);
        assert_eq!(a_now.in_flight, 4, "A counts its own sends at once");
        // B sees them at its next scrape: 4 waiting there, none of them B's.
        let b_next = ReportedLoad::from_scrape(4, 0, None, 0, 0, 1_100, 1000);
        let b_now = combined_load(own(0, 0, 0), &b_next, 1_200, 1024);
        assert_eq!(b_now, own(4 * 1024, 0, 4));
        // And A, scraping the same figure, does not count its own 4 twice.
        let a_next = ReportedLoad::from_scrape(4, 0, None, 4, 0, 1_100, 1000);
        assert_eq!(
            combined_load(own(4096, 0, 4), &a_next, 1_200, 1024).in_flight,
            4
        );
    }

    #[test]
    fn hit_keep_falls_above_evict_from() {
        let at = |u: f64| ReportedLoad::from_scrape(0, 0, Some(u), 0, 0, 1, 1000);
        let keep = |u: f64| hit_keep(&at(u), 10, 0.9, 0.5);
        assert_eq!(keep(0.0), 1.0);
        assert_eq!(keep(0.9), 1.0);
        assert!((keep(0.95) - 0.75).abs() < 1e-9, "{}", keep(0.95));
        assert!((keep(0.98) - 0.6).abs() < 1e-9, "{}", keep(0.98));
        assert_eq!(keep(1.0), 0.5);
        // Usage over 1 is clamped at the scrape.
        assert_eq!(keep(1.7), 0.5);
        // Stale or missing usage keeps the hit whole.
        assert_eq!(hit_keep(&at(1.0), 5_000, 0.9, 0.5), 1.0);
        assert_eq!(hit_keep(&ReportedLoad::default(), 10, 0.9, 0.5), 1.0);
        let no_usage = ReportedLoad::from_scrape(0, 0, None, 0, 0, 1, 1000);
        assert_eq!(hit_keep(&no_usage, 10, 0.9, 0.5), 1.0);
        // evict_from = 1 turns the discount off.
        assert_eq!(hit_keep(&at(1.0), 10, 1.0, 0.5), 1.0);
    }
}
