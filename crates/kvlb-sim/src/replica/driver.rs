//! One simulated replica's engine in wall time: the engine behind a mutex, the clock that maps
//! wall time to engine time (engine seconds = wall seconds since start * time scale), and the
//! driver thread that sleeps until the engine's next step ends, advances it, hands each
//! request's outputs to the connection waiting for them, keeps the /metrics counters and
//! publishes the step's KV events as one batch.
//!
//! Connections submit and cancel under the same mutex and wake the driver through a one-slot
//! channel, so a request arriving at an idle engine starts at once.
//!
//! With `--role prefill|decode` the replica also keeps its part in disaggregated prefill
//! (`Disagg`): the engine holds prefills' KV for their decodes (`held_blocks`, `release_held`,
//! which the side channel or, under SGLang's protocol, the bootstrap server calls), and the
//! transfer counters of /metrics.
//!
//! With LoRA on, the replicas behind one port share one `LoraRequestsInfo`: each reports its
//! requests' first outputs and ends to it and sets it after each engine step, as vLLM's front
//! end does for `vllm:lora_requests_info`.

use super::metrics::{self, LoraRequestsInfo, RequestCounters, TransferCounters};
use super::pd::{LocalPrefill, Protocol, Role, TransferFailure};
use super::rooms::Rooms;
use crate::engine::{
    Engine, EngineConfig, EngineError, EngineOutput, EngineRequest, HeldKv, KvTransfer, RequestId,
};
use crate::kv_events::publisher::KvEventPublisher;
use crate::kv_events::{KvEvent, KvEventBatch};
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Maps wall time to engine time.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
    scale: f64,
}

impl Clock {
    pub fn new(start: Instant, scale: f64) -> Clock {
        Clock { start, scale }
    }

    /// Engine seconds at wall instant `at`.
    pub fn engine_time(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.start).as_secs_f64() * self.scale
    }

    /// Wall instant at which the engine reaches `t` (far future for absurd values).
    pub fn wall_time(&self, t: f64) -> Instant {
        let secs = t / self.scale;
        let secs = if secs.is_finite() {
            secs.clamp(0.0, 1.0e9)
        } else {
            1.0e9
        };
        self.start + Duration::from_secs_f64(secs)
    }
}

/// Where a request's outputs go.
struct Route {
    tx: Sender<Vec<EngineOutput>>,
    /// Streamed requests get their outputs after every step; the others once, when finished.
    stream: bool,
    pending: Vec<EngineOutput>,
    submitted_at: f64,
    /// The receiver is gone and the engine was told to cancel.
    cancelled: bool,
    /// The LoRA adapter it runs under.
    lora: Option<Arc<str>>,
    /// It produced an output, so `vllm:lora_requests_info` lists its adapter until it ends.
    listed: bool,
    /// Engine seconds from its arrival to its first scheduling, and from then to its first
    /// token, once it has one (recorded in /metrics when it finishes, as vLLM does).
    phases: Option<(f64, f64)>,
}

struct ReplicaState {
    engine: Engine,
    routes: HashMap<RequestId, Route>,
    counters: RequestCounters,
    /// Engine steps already accounted in `vllm:lora_requests_info`.
    steps_seen: u64,
    /// When a transfer problem (a local prefill or failed fetch of a decode replica) was last
    /// logged, and those not logged since.
    local_prefill_log: (Option<Instant>, u64),
}

/// Least time between two log lines about KV transfer problems (`Replica::log_limited`).
const LOCAL_PREFILL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// A replica's part in disaggregated prefill (`--role`), fixed at start.
#[derive(Debug, Clone, Default)]
pub struct Disagg {
    pub role: Role,
    /// The protocol spoken to the router (`--pd-protocol`).
    pub protocol: Protocol,
    /// Its engine's id, the `remote_engine_id` of its prefill answers (vLLM's
    /// kv_transfer_config.engine_id; a data-parallel rank's ends `_dp{rank}`).
    pub engine_id: String,
    /// Its side channel as decode replicas reach it (prefill role).
    pub side_channel: Option<SocketAddr>,
    /// Engine seconds a prefill's KV stays held for its decode (--kv-hold-timeout x
    /// --time-scale: the timeout is in wall seconds).
    pub hold_s: f64,
    /// KV bytes per token, and the engine seconds a pull's transfer takes per token
    /// (--kv-bytes-per-token / --kv-link-gbps), as every engine time, --time-scale times
    /// faster in wall time.
    pub kv_bytes_per_token: u64,
    pub transfer_s_per_token: f64,
    /// --time-scale: engine seconds per wall second.
    pub time_scale: f64,
    /// SGLang's protocol, prefill role: the rooms of its port, shared by its ranks (the
    /// bootstrap server waits on them), and the wall seconds a room's KV stays held
    /// (--kv-hold-timeout).
    pub rooms: Option<Arc<Rooms>>,
    pub hold_wall_s: f64,
    /// SGLang's protocol, decode role: the port a null `bootstrap_port` stands for (its
    /// --disaggregation-bootstrap-port; None when 0), and the wall seconds a fetch waits for
    /// its room's KV (--kv-wait-timeout).
    pub null_port: Option<u16>,
    pub wait_s: f64,
}

/// One simulated replica: engine, clock, routes, counters and event publisher.
pub struct Replica {
    pub index: u32,
    pub model: String,
    pub max_model_len: u32,
    /// Unix seconds at start (the `created` of /v1/models).
    pub created: u64,
    clock: Clock,
    state: Mutex<ReplicaState>,
    wake_tx: Sender<()>,
    wake_rx: Receiver<()>,
    next_request_id: AtomicU64,
    id_seed: u64,
    publisher: Option<KvEventPublisher>,
    /// Its rank in a data-parallel engine (`--dp-size`): in every event batch, and the
    /// `engine` label of its metrics (0 without).
    pub dp_rank: Option<u32>,
    /// `vllm:lora_requests_info` of its port, shared with the other ranks (LoRA on only).
    lora_info: Option<Arc<Mutex<LoraRequestsInfo>>>,
    /// Its part in disaggregated prefill.
    disagg: Disagg,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Replica {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        index: u32,
        model: String,
        cfg: EngineConfig,
        time_scale: f64,
        id_seed: u64,
        publisher: Option<KvEventPublisher>,
        dp_rank: Option<u32>,
        lora_info: Option<Arc<Mutex<LoraRequestsInfo>>>,
        disagg: Disagg,
    ) -> Arc<Replica> {
        let (wake_tx, wake_rx) = channel::bounded(1);
        let max_model_len = cfg.max_model_len;
        let mut engine = Engine::new(cfg);
        // Without a publisher nobody reads the events: don't record them.
        engine.set_kv_events_enabled(publisher.is_some());
        // Both roles run vLLM's KV connector, which counts external prefix-cache lookups.
        let transfers = disagg.role != Role::Both;
        engine.set_kv_connector(transfers);
        let mut counters = RequestCounters::new(max_model_len, time_scale);
        counters.transfers = transfers.then(TransferCounters::new);
        Arc::new(Replica {
            index,
            model,
            max_model_len,
            created: unix_now() as u64,
            clock: Clock::new(Instant::now(), time_scale),
            state: Mutex::new(ReplicaState {
                engine,
                routes: HashMap::new(),
                counters,
                steps_seen: 0,
                local_prefill_log: (None, 0),
            }),
            wake_tx,
            wake_rx,
            next_request_id: AtomicU64::new(1),
            id_seed,
            publisher,
            dp_rank,
            lora_info,
            disagg,
        })
    }

    /// Its part in disaggregated prefill.
    pub fn disagg(&self) -> &Disagg {
        &self.disagg
    }

    /// Longest prompt + completion its engine takes (max_model_len, or less when the KV
    /// cache is smaller).
    pub fn context_limit(&self) -> u32 {
        self.lock().engine.context_limit()
    }

    /// Tokens per KV block of its engine.
    pub fn block_size(&self) -> u32 {
        self.lock().engine.config().block_size
    }

    pub fn publisher(&self) -> Option<&KvEventPublisher> {
        self.publisher.as_ref()
    }

    /// `vllm:lora_requests_info` of its port (LoRA on only).
    pub fn lora_info(&self) -> Option<&Mutex<LoraRequestsInfo>> {
        self.lora_info.as_deref()
    }

    fn lock(&self) -> MutexGuard<'_, ReplicaState> {
        // A panic elsewhere must not take the replica down: the state stays usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(&self) {
        let _ = self.wake_tx.try_send(());
    }

    pub fn next_request_id(&self) -> RequestId {
        self.next_request_id.fetch_add(1, Ordering::Relaxed)
    }

    /// 128 random-looking bits for response ids.
    pub fn response_random(&self) -> u128 {
        let n = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        xxhash_rust::xxh3::xxh3_128_with_seed(&n.to_le_bytes(), self.id_seed ^ nanos)
    }

    /// Queue `requests` (all or none); their outputs go to `tx`.
    pub fn submit(
        &self,
        requests: Vec<EngineRequest>,
        stream: bool,
        tx: &Sender<Vec<EngineOutput>>,
    ) -> Result<(), EngineError> {
        self.submit_with(requests, stream, tx, KvTransfer::None, None)
    }

    /// `submit`, each request with its part in disaggregated prefill; `arrived`: when the
    /// request reached the replica, if earlier than now (a decode that first pulled its KV:
    /// vLLM's decode instance queues it before the transfer, so its time to first token and
    /// queue time include the transfer).
    pub fn submit_with(
        &self,
        requests: Vec<EngineRequest>,
        stream: bool,
        tx: &Sender<Vec<EngineOutput>>,
        transfer: KvTransfer,
        arrived: Option<Instant>,
    ) -> Result<(), EngineError> {
        let mut st = self.lock();
        let now = self.clock.engine_time(Instant::now());
        let submitted_at = arrived.map_or(now, |at| self.clock.engine_time(at).min(now));
        let mut accepted: Vec<RequestId> = Vec::with_capacity(requests.len());
        for req in requests {
            let id = req.id;
            let lora = req.lora.as_ref().map(|l| l.name.clone());
            if let Err(e) = st.engine.submit_with(now, req, transfer) {
                for id in accepted {
                    st.engine.cancel(now, id);
                    if let Some(r) = st.routes.get_mut(&id) {
                        r.cancelled = true;
                    }
                }
                drop(st);
                self.wake();
                return Err(e);
            }
            st.routes.insert(
                id,
                Route {
                    tx: tx.clone(),
                    stream,
                    pending: Vec::new(),
                    submitted_at,
                    cancelled: false,
                    lora,
                    listed: false,
                    phases: None,
                },
            );
            accepted.push(id);
        }
        drop(st);
        self.wake();
        Ok(())
    }

    /// The client went away: abort these requests. The aborts are accounted under the same
    /// lock, so /metrics never shows a request gone from running but not yet finished.
    pub fn cancel(&self, ids: &[RequestId]) {
        let mut st = self.lock();
        let now = self.clock.engine_time(Instant::now());
        let mut any = false;
        for &id in ids {
            if st.engine.cancel(now, id) {
                any = true;
                if let Some(r) = st.routes.get_mut(&id) {
                    r.cancelled = true;
                }
            }
        }
        if any {
            let (mut outputs, mut touched) = (Vec::new(), Vec::new());
            st.engine.advance(now, &mut outputs);
            route_outputs(&mut st, now, &mut outputs, &mut touched, self.lora_info());
        }
        drop(st);
        self.wake();
    }

    /// A decode request whose client went away while it waited for its remote KV: counted
    /// as an aborted request, as the engines' schedulers hold such a request (vLLM's
    /// WAITING_FOR_REMOTE_KVS, SGLang's transfer queue) and abort it.
    pub fn aborted_awaiting_kv(&self) {
        self.lock()
            .counters
            .finished(crate::engine::FinishReason::Abort);
    }

    /// The blocks held for the remote decode of finished request `id` (prefill role).
    pub fn held_blocks(&self, id: RequestId) -> Option<Vec<u32>> {
        self.lock().engine.held_blocks(id).map(<[u32]>::to_vec)
    }

    /// A decode replica pulled request `id`'s held KV: release it and count the transfer.
    /// None if nothing is held for it (unknown, already pulled or expired).
    pub fn release_held(&self, id: RequestId) -> Option<HeldKv> {
        let mut st = self.lock();
        let now = self.clock.engine_time(Instant::now());
        let held = st.engine.release_held(now, id)?;
        if let Some(t) = st.counters.transfers.as_mut() {
            t.served += 1;
            t.served_tokens += held.tokens as u64;
        }
        drop(st);
        // Freed blocks may let waiting requests in.
        self.wake();
        Some(held)
    }

    /// A pull brought `tokens` tokens of KV (`bytes` bytes, moving for `seconds` wall seconds).
    pub fn kv_pulled(&self, tokens: u32, bytes: u64, seconds: f64) {
        if let Some(t) = self.lock().counters.transfers.as_mut() {
            t.pulled(tokens, bytes, seconds);
        }
    }

    /// A fetch of remote KV failed for `reason` (both protocols; the caller logs it).
    pub fn transfer_failed(&self, reason: TransferFailure) {
        if let Some(t) = self.lock().counters.transfers.as_mut() {
            t.failed(reason);
        }
    }

    /// A decode request is prefilled here for `reason` (`why` says more): count it, and log
    /// it (`log_limited`). A plain request is a decode replica's normal business: counted,
    /// never logged.
    pub fn local_prefill(&self, reason: LocalPrefill, why: &str) {
        if let Some(t) = self.lock().counters.transfers.as_mut() {
            t.local_prefill(reason);
        }
        if reason == LocalPrefill::NoParams {
            return;
        }
        self.log_limited(&format!("prefilling locally ({}): {why}", reason.label()));
    }

    /// Log a KV transfer problem, unless a line went out less than 10 s ago (then count it
    /// for the next line).
    pub fn log_limited(&self, message: &str) {
        let mut st = self.lock();
        let now = Instant::now();
        let (last, quiet) = st.local_prefill_log;
        if last.is_some_and(|at| now.duration_since(at) < LOCAL_PREFILL_LOG_INTERVAL) {
            st.local_prefill_log.1 += 1;
            return;
        }
        st.local_prefill_log = (Some(now), 0);
        drop(st);
        let more = match quiet {
            0 => String::new(),
            n => format!(" ({n} more since the last message)"),
        };
        eprintln!("kvlb replica: replica {}: {message}{more}", self.index);
    }

    pub fn reset_prefix_cache(&self) -> bool {
        let done = self.lock().engine.reset_prefix_cache();
        self.wake();
        done
    }

    pub fn metrics_text(&self) -> String {
        let (stats, counters) = {
            let st = self.lock();
            let mut counters = st.counters.clone();
            counters.preemptions_total = st.engine.preemptions_total();
            counters.host_kv_tier = st.engine.config().host_kv_capacity_tokens > 0;
            (st.engine.stats(), counters)
        };
        metrics::render(&self.model, self.dp_rank.unwrap_or(0), &stats, &counters)
    }

    /// The driver loop; runs forever on its own thread.
    pub fn drive(&self) {
        set_precise_timers();
        let mut outputs: Vec<EngineOutput> = Vec::new();
        let mut events: Vec<KvEvent> = Vec::new();
        let mut touched: Vec<RequestId> = Vec::new();
        loop {
            let next = {
                let mut st = self.lock();
                let now = self.clock.engine_time(Instant::now());
                st.engine.advance(now, &mut outputs);
                route_outputs(&mut st, now, &mut outputs, &mut touched, self.lora_info());
                st.engine.take_kv_events(&mut events);
                st.engine.next_event_time()
            };
            if !events.is_empty() {
                if let Some(p) = &self.publisher {
                    p.publish(&KvEventBatch {
                        ts: unix_now(),
                        events: std::mem::take(&mut events),
                        dp_rank: self.dp_rank.map(i64::from),
                    });
                }
                events.clear();
            }
            match next {
                None => {
                    if self.wake_rx.recv().is_err() {
                        return;
                    }
                }
                Some(t) => {
                    let deadline = self.clock.wall_time(t);
                    loop {
                        let now = Instant::now();
                        if now >= deadline {
                            break;
                        }
                        let left = deadline - now;
                        if left < Duration::from_micros(20) {
                            // Below timer precision: yield until the step ends.
                            match self.wake_rx.try_recv() {
                                Ok(()) => break,
                                Err(TryRecvError::Empty) => std::thread::yield_now(),
                                Err(TryRecvError::Disconnected) => return,
                            }
                            continue;
                        }
                        match self.wake_rx.recv_timeout(left - Duration::from_micros(10)) {
                            Ok(()) => break,
                            Err(RecvTimeoutError::Timeout) => {}
                            Err(RecvTimeoutError::Disconnected) => return,
                        }
                    }
                }
            }
        }
    }
}

/// Hand `outputs` to their routes and update the counters; with `lora_info`, list the
/// adapters of requests with outputs and, when the engine ran a step, set the gauge.
fn route_outputs(
    st: &mut ReplicaState,
    now: f64,
    outputs: &mut Vec<EngineOutput>,
    touched: &mut Vec<RequestId>,
    lora_info: Option<&Mutex<LoraRequestsInfo>>,
) {
    touched.clear();
    let ReplicaState {
        engine,
        routes,
        counters,
        steps_seen,
        ..
    } = st;
    // Taken after the replica's state: nobody holding it takes a replica's.
    let mut lora_info = lora_info.map(|m| m.lock().unwrap_or_else(|p| p.into_inner()));
    for out in outputs.drain(..) {
        let id = match &out {
            EngineOutput::FirstToken {
                id, t, scheduled, ..
            } => {
                if let Some(r) = routes.get_mut(id) {
                    counters.ttft.observe(t - r.submitted_at);
                    r.phases = Some((scheduled - r.submitted_at, t - scheduled));
                }
                *id
            }
            EngineOutput::Token { id, .. } => *id,
            EngineOutput::Finished {
                id,
                reason,
                prompt_tokens,
                cached_tokens,
                ..
            } => {
                counters.finished(*reason);
                if let Some((queue_s, prefill_s)) = routes.get(id).and_then(|r| r.phases) {
                    counters.request_done(
                        queue_s,
                        prefill_s,
                        prompt_tokens.saturating_sub(*cached_tokens),
                    );
                }
                *id
            }
        };
        let finished = matches!(out, EngineOutput::Finished { .. });
        let Some(route) = routes.get_mut(&id) else {
            continue;
        };
        if let (Some(info), Some(adapter)) = (lora_info.as_deref_mut(), &route.lora) {
            if finished && route.listed {
                info.request_finished(adapter);
            } else if !finished && !route.listed {
                route.listed = true;
                info.request_listed(adapter);
            }
        }
        route.pending.push(out);
        if finished {
            if let Some(r) = routes.remove(&id) {
                let _ = r.tx.send(r.pending);
            }
        } else if route.stream && !touched.contains(&id) {
            touched.push(id);
        }
    }
    for id in touched.iter() {
        let Some(route) = routes.get_mut(id) else {
            continue;
        };
        if route.pending.is_empty() {
            continue;
        }
        let batch = std::mem::take(&mut route.pending);
        if route.tx.send(batch).is_err() && !route.cancelled {
            route.cancelled = true;
            engine.cancel(now, *id);
        }
    }
    // vLLM sets the gauge once per engine step, after taking in its outputs.
    if engine.steps_total() != *steps_seen {
        *steps_seen = engine.steps_total();
        if let Some(info) = lora_info.as_deref_mut() {
            info.set(unix_now());
        }
    }
}

/// Let this thread's timed waits end within microseconds instead of the default 50 us slack.
fn set_precise_timers() {
    // Safety: PR_SET_TIMERSLACK takes an integer argument and only changes the calling
    // thread's timer slack; no memory is passed.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_round_trips() {
        let start = Instant::now();
        let c = Clock::new(start, 100.0);
        let at = c.wall_time(8.0);
        assert_eq!(at - start, Duration::from_millis(80));
        assert!((c.engine_time(at) - 8.0).abs() < 1e-9);
        assert!(c.wall_time(f64::INFINITY) > start);
        assert!(c.wall_time(f64::NAN) > start);
        assert_eq!(c.wall_time(-5.0), start);
    }
}
