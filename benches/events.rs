//! Routing latency under a KV event burst: one replica publishes 100k KV events/s over real
//! ZeroMQ (ZMTP 3.1 over loopback TCP, vLLM's three-frame layout, kvlb's own publisher on its
//! own thread) into kvlb's real telemetry path (subscriber thread -> bounded channel -> the
//! residency writer's tick), while a worker-like thread measures the routing step the
//! workers run per request: read the fleet's loads and reported figures (the candidates),
//! then `cache_aware` (residency lookup + cost model) on a 1024-token token-id prompt.
//!
//! Phases: quiet (no events), burst (100k events/s), quiet again. Prints p50 / p99 / p99.9 of
//! the routing step per phase, the burst / quiet ratio, events applied per second, and
//! whether the writer kept up (events published vs applied, sequence gaps, messages the
//! publisher dropped for a slow subscriber).
//!
//! Run: `bash bench/events_burst.sh` (or `cargo bench --bench events -- SECONDS RATE`).

use kvlb::kv_events::publisher::KvEventPublisher;
use kvlb::kv_events::{EventFormat, KvEvent, KvEventBatch};
use kvlb::prefix::{hash_request, PrefixHashes};
use kvlb::residency::{spawn_writer_thread, ResidencyConfig, ResidencyIndex};
use kvlb::select::{CacheAware, CacheAwareConfig, Candidate, Policy, RequestView, Rng};
use kvlb::worker::Shared;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const REPLICAS: usize = 8;
const PROMPTS: usize = 64;
const PROMPT_TOKENS: usize = 1024;
const BLOCK: usize = 16;
/// Events per published batch (vLLM batches an engine step's events).
const BATCH_EVENTS: usize = 100;

fn tokens(prompt: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| 1000 + ((i * 7 + prompt * 131) % 30_000) as u32)
        .collect()
}

fn body(t: &[u32]) -> Vec<u8> {
    serde_json::json!({"model": "m", "prompt": t, "max_tokens": 1})
        .to_string()
        .into_bytes()
}

fn stored(hash: u64, parent: Option<u64>, token_ids: Vec<u32>) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: vec![hash],
        parent_block_hash: parent,
        token_ids,
        block_size: BLOCK as u32,
        lora_id: None,
        key: Default::default(),
        medium: None,
    }
}

fn batch(events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events,
        dp_rank: None,
    }
}

struct Phase {
    name: &'static str,
    lat_ns: Vec<u32>,
    /// Times the measuring thread was preempted during the phase.
    preempted: i64,
}

/// Involuntary context switches of the calling thread so far.
fn preemptions() -> i64 {
    // Safety: getrusage(2) fills the zeroed struct we own.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut u);
        u.ru_nivcsw
    }
}

impl Phase {
    fn pct(&self, p: f64) -> f64 {
        let i = ((self.lat_ns.len() as f64 - 1.0) * p).round() as usize;
        self.lat_ns[i] as f64 / 1000.0
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let seconds: f64 = args.first().and_then(|s| s.parse().ok()).unwrap_or(4.0);
    let rate: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100_000);

    // Replica 0 publishes; the others are plain HTTP replicas (nothing listens: their
    // metrics scrapes fail, which costs the control threads a refused connect a second).
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    if let Some(c) = cores.get(1) {
        // Threads started from here on (publisher, telemetry, writer) inherit core 1.
        let _ = core_affinity::set_for_current(*c);
    }
    let publisher = KvEventPublisher::bind("tcp://127.0.0.1:0", None, "", EventFormat::Map)
        .expect("bind the event publisher");
    let pub_addr = publisher.local_addrs().0;
    let mut flags = vec!["--listen".to_string(), "127.0.0.1:0".to_string()];
    for r in 0..REPLICAS {
        flags.push("--replica".into());
        flags.push(if r == 0 {
            format!("http://127.0.0.1:9,kv_events=tcp://{pub_addr}")
        } else {
            format!("http://127.0.0.1:{}", 10 + r)
        });
    }
    let cfg = kvlb::config::from_args(&flags).expect("bench configuration");
    let (residency, mut writer) = ResidencyIndex::new(ResidencyConfig {
        max_replicas: REPLICAS,
        block_tokens: BLOCK as u32,
        kv_capacity_tokens: kvlb::config::DEFAULT_KV_CAPACITY_TOKENS,
    })
    .unwrap();
    let log = writer.routing_log(4096);
    let shared = Arc::new(Shared::new(cfg, residency.clone(), vec![log.clone()]));
    let (mut feed, _telemetry) = kvlb::telemetry::start(shared.clone()).expect("telemetry");
    let stop = Arc::new(AtomicBool::new(false));
    let epoch = shared.epoch;
    let writer_thread = spawn_writer_thread(
        writer,
        Duration::from_millis(1),
        kvlb::residency::PARKED_TICK,
        stop.clone(),
        move || epoch.elapsed().as_micros() as u64,
        move |w, now| feed.on_tick(w, now),
    )
    .unwrap();
    let tel = &shared.telemetry[0];
    let t0 = Instant::now();
    while publisher.subscribed_peers() == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "kvlb never subscribed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));

    // Warm prompts: resident on replica 0 (events), and what the routed requests ask for.
    let prefix_cfg = shared.prefix;
    let mut hashed = Vec::new();
    let mut warm_events = 0u64;
    for p in 0..PROMPTS {
        let t = tokens(p, PROMPT_TOKENS);
        let mut events = Vec::new();
        let mut parent = None;
        for (i, chunk) in t.chunks_exact(BLOCK).enumerate() {
            let h = (p as u64) << 32 | i as u64 | 1 << 63;
            events.push(stored(h, parent, chunk.to_vec()));
            parent = Some(h);
        }
        warm_events += events.len() as u64;
        publisher.publish(&batch(events));
        let mut out = PrefixHashes::new(&prefix_cfg);
        hash_request(b"/v1/completions", &body(&t), &prefix_cfg, &mut out).unwrap();
        hashed.push((out.hashes.clone(), out.est_prompt_tokens, out.block_units));
    }
    let t0 = Instant::now();
    while tel.events_seen.load(Relaxed) < warm_events {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "warm events not applied"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    while residency.replica_blocks(0) < PROMPTS * PROMPT_TOKENS / BLOCK {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "warm blocks not resident"
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    // The burst: chains of 64 stored blocks, each removed again 2 batches later (as an
    // engine evicting), paced to `rate` events per second.
    let burst = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicU64::new(0));
    let publisher = Arc::new(publisher);
    let burst_thread = {
        let (burst, stop, published, publisher) = (
            burst.clone(),
            stop.clone(),
            published.clone(),
            publisher.clone(),
        );
        std::thread::spawn(move || {
            let mut next = 1u64 << 48;
            let mut pending: std::collections::VecDeque<Vec<u64>> = Default::default();
            let batches_per_s = (rate as f64 / BATCH_EVENTS as f64).max(1.0);
            let period = Duration::from_secs_f64(1.0 / batches_per_s);
            let mut due = Instant::now();
            let token_chunk: Vec<u32> = (0..BLOCK as u32).map(|i| 5000 + i).collect();
            let mut parent: Option<u64> = None;
            while !stop.load(Relaxed) {
                if !burst.load(Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                    due = Instant::now();
                    continue;
                }
                let now = Instant::now();
                if now < due {
                    std::thread::sleep((due - now).min(Duration::from_micros(500)));
                    continue;
                }
                due += period;
                let mut events = Vec::with_capacity(BATCH_EVENTS);
                let removals = if pending.len() >= 2 {
                    pending.pop_front().unwrap()
                } else {
                    Vec::new()
                };
                let stores = BATCH_EVENTS - removals.len().min(1);
                let mut new = Vec::with_capacity(stores);
                for _ in 0..stores {
                    let h = next;
                    next += 1;
                    if h.is_multiple_of(64) {
                        parent = None;
                    }
                    let mut t = token_chunk.clone();
                    t[0] = (h & 0xffff) as u32;
                    events.push(stored(h, parent, t));
                    parent = Some(h);
                    new.push(h);
                }
                if !removals.is_empty() {
                    events.push(KvEvent::BlockRemoved {
                        block_hashes: removals,
                        medium: None,
                    });
                }
                published.fetch_add(events.len() as u64, Relaxed);
                publisher.publish(&batch(events));
                pending.push_back(new);
            }
        })
    };

    // The measuring thread: what a worker does per request, timed.
    let measure = |name: &'static str, burst_on: bool| -> Phase {
        burst.store(burst_on, Relaxed);
        let (mut policy, mut rng) = (
            CacheAware::new(residency.clone(), CacheAwareConfig::default())
                .unwrap()
                .with_routing_log(log.clone()),
            Rng::new(7),
        );
        let mut candidates: Vec<Candidate> = Vec::with_capacity(REPLICAS);
        let mut lat = Vec::with_capacity(4_000_000);
        let until = Instant::now() + Duration::from_secs_f64(seconds);
        let preempted_before = preemptions();
        let mut k = 0usize;
        while Instant::now() < until {
            let (blocks, prompt_tokens, block_tokens) = &hashed[k % PROMPTS];
            k += 1;
            let start = Instant::now();
            candidates.clear();
            for r in 0..REPLICAS {
                let load = &shared.loads[r];
                candidates.push(Candidate {
                    replica: r,
                    in_flight: load.in_flight.load(Relaxed),
                    queued_prefill_tokens: load.queued_prefill_tokens.load(Relaxed),
                    decoding: load.decoding.load(Relaxed),
                    reported: shared.telemetry[r].reported.load(),
                    setup_us: 0,
                    lora_slot_busy: false,
                    pace: shared.pace[r].load(),
                    routed: load.routed.load(Relaxed),
                    pd: Default::default(),
                });
            }
            let view = RequestView {
                method: kvlb::http::request::Method::Post,
                path: b"/v1/completions",
                body: b"",
                blocks,
                block_tokens: *block_tokens,
                prompt_tokens: *prompt_tokens,
                now_us: shared.epoch.elapsed().as_micros() as u64,
            };
            let i = policy.select(&view, &candidates, rng.next_u64());
            std::hint::black_box(i);
            lat.push(start.elapsed().as_nanos().min(u32::MAX as u128) as u32);
        }
        let preempted = preemptions() - preempted_before;
        lat.sort_unstable();
        Phase {
            name,
            lat_ns: lat,
            preempted,
        }
    };
    // The measuring thread stands for a worker on its own core (core 0); everything else
    // (publisher, subscriber, writer) was started on core 1.
    let (quiet, loud, after, sent, applied_in_burst, lag_s, burst_s, gaps0) =
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Some(c) = cores.first() {
                    let _ = core_affinity::set_for_current(*c);
                }
                let quiet = measure("quiet", false);
                let (seen0, gaps0, t_burst) = (
                    tel.events_seen.load(Relaxed),
                    tel.gaps.load(Relaxed),
                    Instant::now(),
                );
                let loud = measure("burst", true);
                burst.store(false, Relaxed);
                let burst_s = t_burst.elapsed().as_secs_f64();
                let sent = published.load(Relaxed);
                // Let the writer finish what is queued, then compare.
                let t_drain = Instant::now();
                while tel.events_seen.load(Relaxed) - seen0 < sent
                    && t_drain.elapsed() < Duration::from_secs(5)
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let applied = tel.events_seen.load(Relaxed) - seen0;
                let lag_s = t_drain.elapsed().as_secs_f64();
                let after = measure("quiet again", false);
                (quiet, loud, after, sent, applied, lag_s, burst_s, gaps0)
            })
            .join()
            .unwrap()
        });
    stop.store(true, Relaxed);
    kvlb::telemetry::stop_all(&shared);
    let _ = burst_thread.join();
    let _ = writer_thread.join();

    println!(
        "routing step (candidates + cache_aware over {REPLICAS} replicas, {PROMPT_TOKENS}-token \
         token-id prompts, {} resident blocks), {seconds} s per phase:",
        PROMPTS * PROMPT_TOKENS / BLOCK
    );
    for p in [&quiet, &loud, &after] {
        let n = p.lat_ns.len();
        println!(
            "  {:<12} {:>9} routings  p50 {:>6.2} us  p99 {:>6.2} us  p99.9 {:>6.2} us  \
             max {:>8.1} us  preempted {}x",
            p.name,
            n,
            p.pct(0.5),
            p.pct(0.99),
            p.pct(0.999),
            p.pct(1.0),
            p.preempted
        );
    }
    println!(
        "  burst / quiet: p50 x{:.2}, p99 x{:.2}, p99.9 x{:.2}",
        loud.pct(0.5) / quiet.pct(0.5),
        loud.pct(0.99) / quiet.pct(0.99),
        loud.pct(0.999) / quiet.pct(0.999)
    );
    println!(
        "events: {sent} published at {:.0}/s (target {rate}/s), {applied_in_burst} applied \
         ({:.0}/s over the burst), writer {} (caught up {:.2} s after the burst); sequence \
         gaps {}, publisher drops {}, decode errors {}, skipped (unknown parent) {}",
        sent as f64 / burst_s,
        applied_in_burst as f64 / burst_s,
        if applied_in_burst >= sent {
            "kept up"
        } else {
            "fell behind"
        },
        lag_s,
        tel.gaps.load(Relaxed) - gaps0,
        publisher.dropped_messages(),
        tel.decode_errors.load(Relaxed),
        tel.skipped_unknown_parent.load(Relaxed),
    );
}
