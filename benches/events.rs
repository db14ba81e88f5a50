//! Routing latency under a KV event burst, and how many events kvlb absorbs: PUBLISHERS
//! replicas publish KV events over real ZeroMQ (ZMTP 3.1 over loopback TCP, vLLM's
//! three-frame layout; kvlb connects to each, the bench accepts as their PUB side) into kvlb's
//! real telemetry path (the telemetry loop -> bounded channel -> the residency writer's tick),
//! while a worker-like thread measures the routing step the workers run per request: read the
//! fleet's loads and reported figures (the candidates), then `cache_aware` (residency lookup +
//! cost model) on a 1024-token token-id prompt.
//!
//! Phases: quiet (no events), burst (RATE events/s spread over the publishers, each
//! alternating a batch of 64 chained BlockStored and a batch of 64 BlockRemoved of the same
//! blocks, as an engine filling and evicting), quiet again. Prints p50 / p99 / p99.9 of the
//! routing step per phase, the burst / quiet ratio, events applied per second, and whether
//! kvlb kept up (events published vs applied, sequence gaps). The batches are encoded once
//! (`encode_batch`) and only their sequence numbers patched, so the publishing side costs a
//! write per batch.
//!
//! Run: `bash bench/events_burst.sh` (or `cargo bench --bench events -- SECONDS RATE
//! PUBLISHERS`).

use kvlb::kv_events::{encode_batch, EventFormat, KvEvent, KvEventBatch};
use kvlb::prefix::{hash_request, PrefixHashes};
use kvlb::residency::{spawn_writer_thread, ResidencyConfig, ResidencyIndex};
use kvlb::select::{CacheAware, CacheAwareConfig, Candidate, Policy, RequestView, Rng};
use kvlb::worker::Shared;
use kvlb::zmtp::wire::{encode_message, Connection};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PROMPTS: usize = 64;
const PROMPT_TOKENS: usize = 1024;
const BLOCK: usize = 16;
/// Events per published batch (vLLM batches an engine step's events).
const BATCH_EVENTS: usize = 64;

/// One replica's event stream as the bench publishes it: the PUB end of kvlb's subscription
/// and its next sequence number.
struct Stream {
    conn: Connection,
    seq: u64,
}

impl Stream {
    /// Send `message` (an encoded `[topic, seq, payload]` whose seq frame starts at
    /// `SEQ_AT`) with this stream's next sequence number.
    fn send(&mut self, message: &mut [u8]) {
        message[SEQ_AT..SEQ_AT + 8].copy_from_slice(&self.seq.to_be_bytes());
        self.seq += 1;
        self.conn.write_raw(message).expect("publish");
    }
}

/// Where the sequence number sits in a message with an empty topic: the topic frame's
/// header (2 bytes), the sequence frame's header (2).
const SEQ_AT: usize = 4;

/// `[topic "", seq, payload]` encoded, its seq to be patched.
fn message(payload: &[u8]) -> Vec<u8> {
    let m = encode_message(&[b"", &[0u8; 8], payload]);
    debug_assert_eq!(&m[..SEQ_AT], &[1, 0, 1, 8]);
    m
}

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
    let publishers: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let replicas = publishers.max(8);

    // Replicas 0..PUBLISHERS publish; the others are plain HTTP replicas. Nothing is asked of
    // their HTTP side: their models are given, their /metrics not polled.
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    if let Some(c) = cores.get(1) {
        // Threads started from here on (publisher, telemetry, writer) inherit core 1.
        let _ = core_affinity::set_for_current(*c);
    }
    let listeners: Vec<TcpListener> = (0..publishers)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a publisher"))
        .collect();
    let mut flags = vec![
        "--listen".to_string(),
        "127.0.0.1:0".to_string(),
        "--max-replicas".to_string(),
        replicas.to_string(),
    ];
    for r in 0..replicas {
        flags.push("--replica".into());
        flags.push(match listeners.get(r) {
            Some(l) => format!(
                "http://127.0.0.1:{},kv_events=tcp://{},metrics=off,models=m",
                10 + r,
                l.local_addr().unwrap()
            ),
            None => format!("http://127.0.0.1:{},models=m", 10 + r),
        });
    }
    let cfg = kvlb::config::from_args(&flags).expect("bench configuration");
    let (residency, mut writer) = ResidencyIndex::new(ResidencyConfig {
        max_replicas: replicas,
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
    // kvlb connects to every publisher; each is accepted and handshaken as a PUB socket.
    let t0 = Instant::now();
    let mut streams: Vec<Stream> = listeners
        .iter()
        .map(|l| {
            let (s, _) = l.accept().expect("kvlb connects");
            let conn =
                Connection::handshake(s, true, "PUB", &["SUB", "XSUB"], Duration::from_secs(10))
                    .expect("handshake");
            Stream { conn, seq: 0 }
        })
        .collect();
    let connected = || (0..publishers).all(|r| shared.telemetry[r].events_connected.load(Relaxed));
    while !connected() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "kvlb never subscribed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "{publishers} publishers subscribed in {:.2} s; kvlb runs {} threads",
        t0.elapsed().as_secs_f64(),
        std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
    );
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
        streams[0].send(&mut message(&encode_batch(
            &batch(events),
            EventFormat::Map,
        )));
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

    // The burst: each publisher in turn sends a chain of 64 stored blocks, then (its next
    // turn) their removal, paced to `rate` events per second over all publishers.
    let burst = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicU64::new(0));
    let cycle: Vec<[Vec<u8>; 2]> = (0..publishers)
        .map(|r| {
            let mut stores = Vec::with_capacity(BATCH_EVENTS);
            let mut removals = Vec::with_capacity(BATCH_EVENTS);
            let mut parent = None;
            for i in 0..BATCH_EVENTS {
                let h = 1 << 62 | (r as u64) << 20 | i as u64;
                let t: Vec<u32> = (0..BLOCK as u32)
                    .map(|k| 40_000 + ((r * 977 + i * 31 + k as usize) % 20_000) as u32)
                    .collect();
                stores.push(stored(h, parent, t));
                parent = Some(h);
                removals.push(KvEvent::BlockRemoved {
                    block_hashes: vec![h],
                    medium: None,
                });
            }
            let encode = |events| message(&encode_batch(&batch(events), EventFormat::Map));
            [encode(stores), encode(removals)]
        })
        .collect();
    let burst_thread = {
        let (burst, stop, published) = (burst.clone(), stop.clone(), published.clone());
        let mut cycle = cycle;
        std::thread::spawn(move || {
            let batches_per_s = (rate as f64 / BATCH_EVENTS as f64).max(1.0);
            let period = Duration::from_secs_f64(1.0 / batches_per_s);
            let mut due = Instant::now();
            let mut turn = 0usize;
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
                // Catch up in one go when the thread fell behind (a write blocked).
                while due <= now {
                    due += period;
                    let r = turn % publishers;
                    let which = (turn / publishers) % 2;
                    turn += 1;
                    streams[r].send(&mut cycle[r][which]);
                    published.fetch_add(BATCH_EVENTS as u64, Relaxed);
                }
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
        let mut candidates: Vec<Candidate> = Vec::with_capacity(replicas);
        let mut lat = Vec::with_capacity(4_000_000);
        let until = Instant::now() + Duration::from_secs_f64(seconds);
        let preempted_before = preemptions();
        let mut k = 0usize;
        while Instant::now() < until {
            let (blocks, prompt_tokens, block_tokens) = &hashed[k % PROMPTS];
            k += 1;
            let start = Instant::now();
            candidates.clear();
            for r in 0..replicas {
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
    let sum = |f: fn(&kvlb::telemetry::ReplicaTelemetry) -> &AtomicU64| -> u64 {
        (0..publishers)
            .map(|r| f(&shared.telemetry[r]).load(Relaxed))
            .sum()
    };
    let seen = || sum(|t| &t.events_seen);
    let gaps = || sum(|t| &t.gaps);
    let (quiet, loud, after, sent, by_end, applied, lag_s, burst_s, gaps0) =
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Some(c) = cores.first() {
                    let _ = core_affinity::set_for_current(*c);
                }
                let quiet = measure("quiet", false);
                let (seen0, gaps0, t_burst) = (seen(), gaps(), Instant::now());
                let loud = measure("burst", true);
                burst.store(false, Relaxed);
                let burst_s = t_burst.elapsed().as_secs_f64();
                let by_end = seen() - seen0;
                let sent = published.load(Relaxed);
                // Let kvlb finish what is queued, then compare.
                let t_drain = Instant::now();
                while seen() - seen0 < sent && t_drain.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let applied = seen() - seen0;
                let lag_s = t_drain.elapsed().as_secs_f64();
                let after = measure("quiet again", false);
                (
                    quiet, loud, after, sent, by_end, applied, lag_s, burst_s, gaps0,
                )
            })
            .join()
            .unwrap()
        });
    stop.store(true, Relaxed);
    kvlb::telemetry::stop_all(&shared);
    let _ = burst_thread.join();
    let _ = writer_thread.join();

    println!(
        "routing step (candidates + cache_aware over {replicas} replicas, {PROMPT_TOKENS}-token \
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
        "events: {sent} published by {publishers} publishers at {:.0}/s (target {rate}/s); \
         absorbed {:.0}/s during the burst ({by_end} applied by its end), {applied} in all \
         ({}, {:.2} s after the burst); sequence gaps {}, decode errors {}, skipped \
         (unknown parent) {}",
        sent as f64 / burst_s,
        by_end as f64 / burst_s,
        if applied >= sent {
            "kept up"
        } else {
            "fell behind"
        },
        lag_s,
        gaps() - gaps0,
        sum(|t| &t.decode_errors),
        sum(|t| &t.skipped_unknown_parent),
    );
}
