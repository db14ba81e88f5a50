//! What the admin listener puts on /metrics: one `Registry` built at start, holding the
//! collector of every module with figures to show, encoded on each scrape. The data plane's
//! figures (`WorkerStats` summed over the workers, the replicas' shared gauges, the fleet's
//! state) are read here, on the admin side, from `worker::Shared`.

#![forbid(unsafe_code)]

use crate::metrics::{self, families, Collector, DescriptorEncoder, Registry, WorkerStats};
use crate::worker::Shared;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The admin listener's own counters.
#[derive(Debug, Default)]
pub(super) struct AdminCounters {
    /// Connections answered 503 by the accept thread.
    pub refused: AtomicU64,
    /// Connections closed because their request or reply ran out of time.
    pub timed_out: AtomicU64,
}

/// Every collector, in the order /metrics shows them (`metrics::ALL`).
pub(super) fn registry(shared: &Arc<Shared>, admin: &Arc<AdminCounters>) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(DataPlaneMetrics(shared.clone())));
    registry.register_collector(Box::new(crate::l4::L4Metrics));
    registry.register_collector(Box::new(TokenizeMetrics));
    registry.register_collector(Box::new(crate::access_log::AccessLogMetrics));
    registry.register_collector(Box::new(metrics::ProcessMetrics));
    registry.register_collector(Box::new(AdminMetrics(admin.clone())));
    registry.register_collector(Box::new(crate::telemetry::TelemetryMetrics(shared.clone())));
    registry.register_collector(Box::new(crate::model_watch::ModelMetrics(shared.clone())));
    registry
}

/// The token-mode counters of `tokenize` (a crate of its own, below the metrics registry).
#[derive(Debug)]
struct TokenizeMetrics;

impl Collector for TokenizeMetrics {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        use crate::tokenize::{SEGMENT_HITS, SEGMENT_MISSES, TOKENIZED_REQUESTS, TOKENIZE_ERRORS};
        for (family, v) in [
            (&families::TOKENIZED_REQUESTS, &TOKENIZED_REQUESTS),
            (&families::TOKENIZE_ERRORS, &TOKENIZE_ERRORS),
            (&families::TOKENIZE_SEGMENT_HITS, &SEGMENT_HITS),
            (&families::TOKENIZE_SEGMENT_MISSES, &SEGMENT_MISSES),
        ] {
            family.describe(&mut enc)?.counter(&[], v.load(Relaxed))?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct AdminMetrics(Arc<AdminCounters>);

impl Collector for AdminMetrics {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        families::ADMIN_CONNECTIONS_REFUSED
            .describe(&mut enc)?
            .counter(&[], self.0.refused.load(Relaxed))?;
        families::ADMIN_CONNECTIONS_TIMED_OUT
            .describe(&mut enc)?
            .counter(&[], self.0.timed_out.load(Relaxed))?;
        let reloads = &crate::control::RELOADS;
        let mut samples = families::CONFIG_RELOADS.describe(&mut enc)?;
        samples.counter(&["applied"], reloads[0].load(Relaxed))?;
        samples.counter(&["refused"], reloads[1].load(Relaxed))
    }
}

/// The data plane: per replica, per worker, and process-wide.
struct DataPlaneMetrics(Arc<Shared>);

impl fmt::Debug for DataPlaneMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DataPlaneMetrics")
    }
}

impl Collector for DataPlaneMetrics {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let shared = &*self.0;
        let workers = &shared.workers[..];
        let loads = &shared.loads[..];
        // The replica slots in use: (slot, url).
        let urls: Vec<(usize, String)> = (0..shared.fleet.capacity())
            .filter_map(|i| shared.fleet.slot(i).spec().map(|r| (i, r.url.clone())))
            .collect();
        let sum = |f: &dyn Fn(&WorkerStats) -> u64| -> u64 { workers.iter().map(f).sum() };
        // A per-replica family summed over workers, one sample per replica.
        let per_replica = |enc: &mut DescriptorEncoder<'_>,
                           family: &'static metrics::Family,
                           f: &dyn Fn(&WorkerStats, usize) -> u64|
         -> fmt::Result {
            let mut s = family.describe(enc)?;
            for (r, url) in &urls {
                s.counter(&[url], sum(&|w| f(w, *r)))?;
            }
            Ok(())
        };
        // A per-worker family, one sample per worker.
        let per_worker = |enc: &mut DescriptorEncoder<'_>,
                          family: &'static metrics::Family,
                          f: &dyn Fn(&WorkerStats) -> u64|
         -> fmt::Result {
            let mut s = family.describe(enc)?;
            for (i, w) in workers.iter().enumerate() {
                let i = i.to_string();
                match family.kind() {
                    metrics::Kind::Counter => s.counter(&[&i], f(w))?,
                    _ => s.gauge(&[&i], f(w))?,
                }
            }
            Ok(())
        };

        let mut s = families::REQUESTS.describe(&mut enc)?;
        for (r, url) in &urls {
            for (c, class) in metrics::STATUS_CLASSES.iter().enumerate() {
                s.counter(
                    &[url, class],
                    sum(&|w| w.replicas[*r].responses[c].load(Relaxed)),
                )?;
            }
            s.counter(
                &[url, "502"],
                sum(&|w| w.replicas[*r].bad_gateway.load(Relaxed)),
            )?;
            s.counter(
                &[url, "504"],
                sum(&|w| w.replicas[*r].gateway_timeout.load(Relaxed)),
            )?;
            s.counter(
                &[url, "503"],
                sum(&|w| w.replicas[*r].unavailable.load(Relaxed)),
            )?;
        }
        per_replica(&mut enc, &families::RETRIES, &|w, r| {
            w.replicas[r].retries.load(Relaxed)
        })?;
        per_replica(&mut enc, &families::EJECTIONS, &|w, r| {
            w.replicas[r].ejections.load(Relaxed)
        })?;
        let mut s = families::LOCAL_RESPONSES.describe(&mut enc)?;
        for (i, code) in metrics::LOCAL_ERROR_CODES.iter().enumerate() {
            let label = match code {
                0 => "other".to_string(),
                c => c.to_string(),
            };
            s.counter(&[&label], sum(&|w| w.local_errors[i].load(Relaxed)))?;
        }
        per_replica(&mut enc, &families::CLIENT_ABORTS, &|w, r| {
            w.replicas[r].client_aborts.load(Relaxed)
        })?;
        let mut s = families::CUT_RESPONSES.describe(&mut enc)?;
        for (r, url) in &urls {
            for (c, cause) in metrics::CUT_CAUSES.iter().enumerate() {
                s.counter(&[url, cause], sum(&|w| w.replicas[*r].cut[c].load(Relaxed)))?;
            }
        }
        let mut s = families::REPLICA_IN_FLIGHT.describe(&mut enc)?;
        for (r, url) in &urls {
            s.gauge(&[url], loads[*r].in_flight.load(Relaxed) as u64)?;
        }
        let mut s = families::REPLICA_QUEUED_PREFILL_TOKENS.describe(&mut enc)?;
        for (r, url) in &urls {
            s.gauge(&[url], loads[*r].queued_prefill_tokens.load(Relaxed))?;
        }
        let mut s = families::REPLICA_DECODING.describe(&mut enc)?;
        for (r, url) in &urls {
            s.gauge(&[url], loads[*r].decoding.load(Relaxed) as u64)?;
        }
        per_worker(&mut enc, &families::WORKER_IN_FLIGHT, &|w| {
            w.in_flight.load(Relaxed)
        })?;
        per_worker(&mut enc, &families::WORKER_CONNECTIONS, &|w| {
            w.open_connections.load(Relaxed)
        })?;
        per_worker(&mut enc, &families::WORKER_ACCEPTED, &|w| {
            w.accepted.load(Relaxed)
        })?;
        per_worker(&mut enc, &families::WORKER_REQUESTS, &|w| {
            w.requests.load(Relaxed)
        })?;
        per_worker(&mut enc, &families::WORKER_ALLOCATIONS, &|w| {
            w.allocations.load(Relaxed)
        })?;
        per_worker(&mut enc, &families::WORKER_RECV_THROTTLED, &|w| {
            w.recv_throttled.load(Relaxed)
        })?;
        per_worker(&mut enc, &families::SPLICED_RESPONSE_BYTES, &|w| {
            w.spliced_bytes.load(Relaxed)
        })?;
        per_worker(&mut enc, &families::BODY_MEMORY_REFUSED, &|w| {
            w.body_memory_refused.load(Relaxed)
        })?;
        per_worker(&mut enc, &families::WORKER_RECV_BUFFER_SHORTAGES, &|w| {
            w.recv_buffer_shortages.load(Relaxed)
        })?;
        let mut s = families::BYTES.describe(&mut enc)?;
        for (r, url) in &urls {
            let to = sum(&|w| w.replicas[*r].bytes_to_replica.load(Relaxed));
            let from = sum(&|w| w.replicas[*r].bytes_from_replica.load(Relaxed));
            s.counter(&[url, "to_replica"], to)?;
            s.counter(&[url, "from_replica"], from)?;
        }
        let mut s = families::UPSTREAM_CONNECTIONS.describe(&mut enc)?;
        for (r, url) in &urls {
            let new = sum(&|w| w.replicas[*r].connects.load(Relaxed));
            let reused = sum(&|w| w.replicas[*r].reuses.load(Relaxed));
            s.counter(&[url, "new"], new)?;
            s.counter(&[url, "reused"], reused)?;
        }
        let hs: Vec<_> = workers.iter().map(|w| &w.ttfb).collect();
        families::TIME_TO_FIRST_BYTE
            .describe(&mut enc)?
            .latency(&hs)?;
        let hs: Vec<_> = workers.iter().map(|w| &w.first_token).collect();
        families::TIME_TO_FIRST_TOKEN
            .describe(&mut enc)?
            .latency(&hs)?;
        let hs: Vec<_> = workers.iter().map(|w| &w.estimated_ttft).collect();
        families::ESTIMATED_TTFT.describe(&mut enc)?.latency(&hs)?;
        let hs: Vec<_> = workers.iter().map(|w| &w.ttft_ratio).collect();
        families::TTFT_OBSERVED_OVER_ESTIMATED
            .describe(&mut enc)?
            .values(&hs)?;
        let hs: Vec<_> = workers.iter().map(|w| &w.matched_tokens).collect();
        families::MATCHED_PREFIX_TOKENS
            .describe(&mut enc)?
            .values(&hs)?;
        let mut s = families::DECISIONS.describe(&mut enc)?;
        for (i, reason) in metrics::REASONS.iter().enumerate() {
            s.counter(&[reason], sum(&|w| w.decisions[i].load(Relaxed)))?;
        }
        families::HOT_PREFIX_SPILLS
            .describe(&mut enc)?
            .counter(&[], sum(&|w| w.spills.load(Relaxed)))?;
        families::LORA_SLOT_WAITS
            .describe(&mut enc)?
            .counter(&[], sum(&|w| w.lora_slot_waits.load(Relaxed)))?;
        let mut s = families::RESPONSE_AFFINITY.describe(&mut enc)?;
        for (i, label) in metrics::AFFINITY_OUTCOMES.iter().enumerate() {
            s.counter(&[label], sum(&|w| w.affinity[i].load(Relaxed)))?;
        }
        let mut s = families::PD_REQUESTS.describe(&mut enc)?;
        for (i, label) in metrics::PD_OUTCOMES.iter().enumerate() {
            s.counter(&[label], sum(&|w| w.pd[i].load(Relaxed)))?;
        }
        let mut s = families::RESPONSE_IDS.describe(&mut enc)?;
        for (i, label) in metrics::RESPONSE_ID_OUTCOMES.iter().enumerate() {
            s.counter(&[label], sum(&|w| w.response_ids[i].load(Relaxed)))?;
        }
        let mut s = families::UNPARSED_PROMPTS.describe(&mut enc)?;
        for (i, label) in metrics::PROMPT_ERRORS.iter().enumerate() {
            s.counter(&[label], sum(&|w| w.prompt_errors[i].load(Relaxed)))?;
        }
        let mut s = families::PROMPT_TRUNCATED.describe(&mut enc)?;
        for (i, bound) in crate::prompt::Bound::ALL.iter().enumerate() {
            s.counter(
                &[bound.label()],
                sum(&|w| w.prompt_truncated[i].load(Relaxed)),
            )?;
        }
        let hs: Vec<_> = workers.iter().map(|w| &w.total).collect();
        families::REQUEST_DURATION
            .describe(&mut enc)?
            .latency(&hs)?;

        families::DRAINING
            .describe(&mut enc)?
            .gauge(&[], shared.draining.load(Relaxed) as u64)?;
        families::QUEUE_WAITING
            .describe(&mut enc)?
            .gauge(&[], shared.queued.load(Relaxed))?;
        families::BODY_MEMORY_BYTES
            .describe(&mut enc)?
            .gauge(&[], shared.body_memory.load(Relaxed) as u64)?;
        families::QUEUED
            .describe(&mut enc)?
            .counter(&[], sum(&|w| w.queued.load(Relaxed)))?;
        let now = shared.now_ms();
        let mut s = families::REPLICA_UP.describe(&mut enc)?;
        for (r, url) in &urls {
            s.gauge(&[url], shared.fleet.slot(*r).available(now) as u64)?;
        }
        Ok(())
    }
}
