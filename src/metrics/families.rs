//! Every metric family kvlb exposes on /metrics, declared once: name (as exposed, counters
//! ending `_total`), label names, help. Only this module can declare a family (`Family`'s
//! constructors are private to `metrics`), and a collector can only write samples through a
//! family declared here. `ALL` lists them in /metrics order; `tests/metrics_exposition.rs`
//! checks a live /metrics against it, and docs/metrics.md names each one.

#![forbid(unsafe_code)]

use super::Family;

// The data plane: per replica, per worker (summed over the workers' `WorkerStats`).
pub static REQUESTS: Family = Family::counter(
    "kvlb_requests_total",
    &["replica", "status"],
    "Responses forwarded from replicas, by replica and status class.",
);
pub static RETRIES: Family = Family::counter(
    "kvlb_retries_total",
    &["replica"],
    "Requests that failed on a replica at connect time or with an immediate 503 and were tried on another.",
);
pub static EJECTIONS: Family = Family::counter(
    "kvlb_ejections_total",
    &["replica"],
    "Times a replica was ejected after consecutive transport failures (passive health).",
);
pub static LOCAL_RESPONSES: Family = Family::counter(
    "kvlb_local_responses_total",
    &["status"],
    "Error responses kvlb answered itself, by status.",
);
pub static CLIENT_ABORTS: Family = Family::counter(
    "kvlb_client_aborts_total",
    &["replica"],
    "Requests whose client went away before the response completed; the replica request was cancelled.",
);
pub static CUT_RESPONSES: Family = Family::counter(
    "kvlb_cut_responses_total",
    &["replica", "cause"],
    "Responses cut short by the replica after their head reached the client (the client's connection is closed), by cause: closed (before the body's end), reset (a receive error), malformed (invalid chunked framing or more bytes than declared).",
);
pub static REPLICA_IN_FLIGHT: Family = Family::gauge(
    "kvlb_replica_in_flight",
    &["replica"],
    "Requests in flight per replica, across workers.",
);
pub static REPLICA_QUEUED_PREFILL_TOKENS: Family = Family::gauge(
    "kvlb_replica_queued_prefill_tokens",
    &["replica"],
    "Estimated prompt tokens routed to each replica and not yet prefilled (no first byte yet).",
);
pub static REPLICA_DECODING: Family = Family::gauge(
    "kvlb_replica_decoding",
    &["replica"],
    "Requests past their first byte (decoding) per replica.",
);
pub static WORKER_IN_FLIGHT: Family = Family::gauge(
    "kvlb_worker_in_flight",
    &["worker"],
    "Requests in flight per worker.",
);
pub static WORKER_CONNECTIONS: Family = Family::gauge(
    "kvlb_worker_connections",
    &["worker"],
    "Open client connections per worker.",
);
pub static WORKER_ACCEPTED: Family = Family::counter(
    "kvlb_worker_accepted_total",
    &["worker"],
    "Client connections accepted per worker.",
);
pub static WORKER_REQUESTS: Family = Family::counter(
    "kvlb_worker_requests_total",
    &["worker"],
    "Requests handled per worker.",
);
pub static WORKER_ALLOCATIONS: Family = Family::counter(
    "kvlb_worker_allocations_total",
    &["worker"],
    "Heap allocations made by each worker thread (flat under steady keep-alive traffic).",
);
pub static WORKER_RECV_THROTTLED: Family = Family::counter(
    "kvlb_worker_recv_throttled_total",
    &["worker"],
    "Client or replica receives paused because kvlb could not pass the bytes on as fast as they came (the rest waited in the socket).",
);
pub static SPLICED_RESPONSE_BYTES: Family = Family::counter(
    "kvlb_spliced_response_bytes_total",
    &["worker"],
    "L7 response body bytes moved replica -> client by splice, never entering user space.",
);
pub static BODY_MEMORY_REFUSED: Family = Family::counter(
    "kvlb_body_memory_refused_total",
    &["worker"],
    "Requests refused with 503 before their body was read because the bodies in flight held max_body_memory (or the worker's share of it).",
);
pub static WORKER_RECV_BUFFER_SHORTAGES: Family = Family::counter(
    "kvlb_worker_recv_buffer_shortages_total",
    &["worker"],
    "Receives that found the worker's provided-buffer ring empty and fell back to a single-shot receive.",
);
pub static BYTES: Family = Family::counter(
    "kvlb_bytes_total",
    &["replica", "direction"],
    "Bytes exchanged with replicas.",
);
pub static UPSTREAM_CONNECTIONS: Family = Family::counter(
    "kvlb_upstream_connections_total",
    &["replica", "kind"],
    "Replica connections used: new (connect) or reused from the keep-alive pool.",
);
pub static TIME_TO_FIRST_BYTE: Family = Family::histogram(
    "kvlb_time_to_first_byte_seconds",
    "From the request fully received to the replica's first response byte.",
);
pub static TIME_TO_FIRST_TOKEN: Family = Family::histogram(
    "kvlb_time_to_first_token_seconds",
    "From the request fully received to the replica's first response body byte.",
);
pub static ESTIMATED_TTFT: Family = Family::histogram(
    "kvlb_estimated_ttft_seconds",
    "cache_aware's time-to-first-token estimate for the replica it chose.",
);
pub static TTFT_OBSERVED_OVER_ESTIMATED: Family = Family::histogram(
    "kvlb_ttft_observed_over_estimated",
    "Observed time to first token divided by cache_aware's estimate (1 = exact).",
);
pub static MATCHED_PREFIX_TOKENS: Family = Family::histogram(
    "kvlb_matched_prefix_tokens",
    "Prompt tokens cache_aware counted as resident on the replica it chose.",
);
pub static DECISIONS: Family = Family::counter(
    "kvlb_decisions_total",
    &["reason"],
    "cache_aware decisions by reason: cache (a resident prefix won), load (queues decided), fallback (no prefix), affinity (to the replica that stored the previous response). A disaggregated request counts its prefill leg only.",
);
pub static HOT_PREFIX_SPILLS: Family = Family::counter(
    "kvlb_hot_prefix_spills_total",
    &[],
    "Requests whose hit on a hot prefix was ignored because its holder was saturated.",
);
pub static LORA_SLOT_WAITS: Family = Family::counter(
    "kvlb_lora_slot_waits_total",
    &[],
    "Requests for a LoRA adapter sent to a replica whose LoRA batch slots (vLLM max_loras) were held by other adapters, as its last /metrics and kvlb's own requests there showed: they wait there for one. Growing: more slots (--max-loras) or more replicas for the adapters.",
);
pub static RESPONSE_AFFINITY: Family = Family::counter(
    "kvlb_response_affinity_total",
    &["outcome"],
    "Requests naming a stored response (previous_response_id, /v1/responses/{id}): routed (to the replica that stored it), unknown (not relayed by this kvlb, or expired or evicted: routed by prefix, the engine answers whether it knows the id), unavailable (its replica is gone or unhealthy: routed elsewhere, where the engine answers not found).",
);
pub static PD_REQUESTS: Family = Family::counter(
    "kvlb_pd_requests_total",
    &["outcome"],
    "Requests of a model served by prefill and decode replicas: disaggregated (prefilled on a prefill replica, continued from its KV cache on a decode replica), no_params (the prefill answer carried no kv_transfer_params: the decode replica computed the prompt), prefill_failed (every prefill replica tried failed or none could take it: sent whole to a decode replica), prefill_refused (the prefill replica answered 4xx: sent whole, so the client gets the engine's own error), direct (computed on a decode replica, which cache_aware priced sooner than a prefill replica and the transfer, counting the stall of the sequences decoding there).",
);
pub static RESPONSE_IDS: Family = Family::counter(
    "kvlb_response_ids_total",
    &["outcome"],
    "Successful Responses API answers relayed: learned (their id and replica remembered), evicted (remembered over a live entry: raise response_affinity_entries), missed (no response id in the body's first bytes).",
);
pub static UNPARSED_PROMPTS: Family = Family::counter(
    "kvlb_unparsed_prompts_total",
    &["reason"],
    "Bodies on a prompt path that were not a prompt kvlb could read; routed by load.",
);
pub static PROMPT_TRUNCATED: Family = Family::counter(
    "kvlb_prompt_truncated_total",
    &["reason"],
    "Prompts whose reading stopped at a bound (max_prompt_tokens, messages, parts, work); routed on the blocks read before it, or by load when the bound came before the fields they start with.",
);
pub static REQUEST_DURATION: Family = Family::histogram(
    "kvlb_request_duration_seconds",
    "From the request fully received to the response fully sent.",
);

// Process-wide figures of the data plane, outside `WorkerStats`.
pub static DRAINING: Family =
    Family::gauge("kvlb_draining", &[], "1 while kvlb drains after SIGTERM.");
pub static QUEUE_WAITING: Family = Family::gauge(
    "kvlb_queue_waiting",
    &[],
    "Requests waiting for a replica below its concurrency limit.",
);
pub static BODY_MEMORY_BYTES: Family = Family::gauge(
    "kvlb_body_memory_bytes",
    &[],
    "Request body bytes held now, over all workers (bounded by max_body_memory).",
);
pub static QUEUED: Family = Family::counter(
    "kvlb_queued_total",
    &[],
    "Requests that waited in the queue.",
);
pub static REPLICA_UP: Family = Family::gauge(
    "kvlb_replica_up",
    &["replica"],
    "1 while the replica takes new requests (active, not ejected, passing health checks).",
);

// L4 mode (`l4`, `l4::sockmap`).
pub static L4_CONNECTIONS: Family = Family::counter(
    "kvlb_l4_connections_total",
    &["forwarding"],
    "L4 connections joined to a replica, by forwarding.",
);
pub static L4_ACTIVE_CONNECTIONS: Family = Family::gauge(
    "kvlb_l4_active_connections",
    &[],
    "L4 connections joined now.",
);
pub static L4_ABORTED_CONNECTIONS: Family = Family::counter(
    "kvlb_l4_aborted_connections_total",
    &[],
    "L4 connections ended by a reset or error.",
);
pub static L4_BYTES: Family = Family::counter(
    "kvlb_l4_bytes_total",
    &["direction"],
    "Bytes forwarded on joined L4 connections (sockmap: counted by the BPF program).",
);
pub static L4_SOCKMAP_JOIN_FAILURES: Family = Family::counter(
    "kvlb_l4_sockmap_join_failures_total",
    &[],
    "Sockmap joins refused by the kernel (socket closing); those connections used splice.",
);
pub static L4_SOCKMAP_LOADED: Family = Family::gauge(
    "kvlb_l4_sockmap_loaded",
    &["program_id"],
    "Whether the sockmap program is loaded and attached (its BPF program id in the label).",
);
pub static L4_SOCKMAP_SOCKETS: Family = Family::gauge(
    "kvlb_l4_sockmap_sockets",
    &[],
    "Sockets in the sockmap now (two per joined connection).",
);
pub static L4_SOCKMAP_PEERS: Family = Family::gauge(
    "kvlb_l4_sockmap_peers",
    &[],
    "Peer entries in the sockmap program's pair map now.",
);

// Token mode (`tokenize`).
pub static TOKENIZED_REQUESTS: Family = Family::counter(
    "kvlb_tokenized_requests_total",
    &[],
    "Requests hashed in token mode with the configured tokenizer and chat template.",
);
pub static TOKENIZE_ERRORS: Family = Family::counter(
    "kvlb_tokenize_errors_total",
    &[],
    "Requests the tokenizer or chat template could not handle; hashed in text mode.",
);
pub static TOKENIZE_SEGMENT_HITS: Family = Family::counter(
    "kvlb_tokenize_segment_hits_total",
    &[],
    "Prompt segments (between special tokens) whose ids came from the worker's cache.",
);
pub static TOKENIZE_SEGMENT_MISSES: Family = Family::counter(
    "kvlb_tokenize_segment_misses_total",
    &[],
    "Prompt segments the tokenizer encoded.",
);

// The access log (`access_log`).
pub static ACCESS_LOG_LINES: Family = Family::counter(
    "kvlb_access_log_lines_total",
    &[],
    "Access log lines written.",
);
pub static ACCESS_LOG_DROPPED_LINES: Family = Family::counter(
    "kvlb_access_log_dropped_lines_total",
    &[],
    "Access log lines dropped because the write failed (disk full, pipe not read).",
);

// The process's own resources (`metrics::process`).
pub static PROCESS_OPEN_FDS: Family =
    Family::gauge("kvlb_process_open_fds", &[], "Open file descriptors.");
pub static PROCESS_MAX_FDS: Family = Family::gauge(
    "kvlb_process_max_fds",
    &[],
    "The open file descriptor limit (soft).",
);
pub static PROCESS_RESIDENT_MEMORY: Family = Family::gauge(
    "kvlb_process_resident_memory_bytes",
    &[],
    "Resident memory size in bytes.",
);
pub static PROCESS_THREADS: Family =
    Family::gauge("kvlb_process_threads", &[], "OS threads in the process.");

// The admin listener itself (`admin`).
pub static ADMIN_CONNECTIONS_REFUSED: Family = Family::counter(
    "kvlb_admin_connections_refused_total",
    &[],
    "Admin connections answered 503 at once (at the limit of connections served at once, or no thread for them).",
);
pub static ADMIN_CONNECTIONS_TIMED_OUT: Family = Family::counter(
    "kvlb_admin_connections_timed_out_total",
    &[],
    "Admin connections closed because their request did not arrive, or their reply was not taken, in time.",
);
pub static CONFIG_RELOADS: Family = Family::counter(
    "kvlb_config_reloads_total",
    &["result"],
    "Configuration reloads (SIGHUP, POST /reload, watch_config) by result: applied, or refused (the running configuration stays; the reason is logged).",
);

// What each replica reports of itself (`telemetry`).
pub static REPLICA_RUNNING: Family = Family::gauge(
    "kvlb_replica_running",
    &["replica"],
    "Requests running on the replica, as its /metrics reports.",
);
pub static REPLICA_WAITING: Family = Family::gauge(
    "kvlb_replica_waiting",
    &["replica"],
    "Requests waiting on the replica, as its /metrics reports.",
);
pub static REPLICA_KV_USAGE: Family = Family::gauge(
    "kvlb_replica_kv_usage",
    &["replica"],
    "KV cache usage of the replica (0..1), as its /metrics reports.",
);
pub static REPLICA_LORA_SLOTS: Family = Family::gauge(
    "kvlb_replica_lora_slots",
    &["replica"],
    "LoRA adapters one batch of the replica may run (vLLM max_lora in vllm:lora_requests_info); absent when not reported.",
);
pub static REPLICA_LORA_ADAPTERS_ACTIVE: Family = Family::gauge(
    "kvlb_replica_lora_adapters_active",
    &["replica"],
    "LoRA adapters with requests on the replica (vLLM running_lora_adapters), as its last /metrics reports; at kvlb_replica_lora_slots or more, a request for another adapter waits for a slot.",
);
pub static REPLICA_TELEMETRY_AGE: Family = Family::gauge(
    "kvlb_replica_telemetry_age_seconds",
    &["replica"],
    "Seconds since the replica's last KV event batch or metrics scrape.",
);
pub static REPLICA_TELEMETRY_STALE: Family = Family::gauge(
    "kvlb_replica_telemetry_stale",
    &["replica"],
    "1 while the replica's residency is dropped for stale telemetry.",
);
pub static REPLICA_KV_EVENTS: Family = Family::counter(
    "kvlb_replica_kv_events_total",
    &["replica"],
    "KV cache events applied from the replica.",
);
pub static REPLICA_KV_EVENT_GAPS: Family = Family::counter(
    "kvlb_replica_kv_event_gaps_total",
    &["replica"],
    "Sequence gaps in the replica's KV event stream.",
);
pub static REPLICA_KV_EVENT_RESTARTS: Family = Family::counter(
    "kvlb_replica_kv_event_restarts_total",
    &["replica"],
    "Times the replica's KV event sequence went backwards (engine restart).",
);
pub static REPLICA_KV_EVENT_DECODE_ERRORS: Family = Family::counter(
    "kvlb_replica_kv_event_decode_errors_total",
    &["replica"],
    "Messages from the replica that were no readable KV event batch (not applied; the next batch shows a gap).",
);
pub static REPLICA_KV_EVENT_WRONG_RANK: Family = Family::counter(
    "kvlb_replica_kv_event_wrong_rank_total",
    &["replica"],
    "Batches on a data-parallel rank's event endpoint whose data_parallel_rank named another rank (not applied).",
);
pub static REPLICA_KV_EVENT_REPLAYS: Family = Family::counter(
    "kvlb_replica_kv_event_replays_total",
    &["replica"],
    "Sequence gaps in the replica's KV event stream filled by replaying the batches it kept.",
);
pub static REPLICA_KV_EVENT_REPLAY_FAILURES: Family = Family::counter(
    "kvlb_replica_kv_event_replay_failures_total",
    &["replica"],
    "Replay requests to the replica that failed or came back without every missing batch (a gap so left clears its residency).",
);
pub static REPLICA_KV_EVENT_CONNECT_FAILURES: Family = Family::counter(
    "kvlb_replica_kv_event_connect_failures_total",
    &["replica"],
    "Attempts to connect to the replica's KV event endpoint that failed (kvlb retries with backoff).",
);
pub static REPLICA_KV_EVENT_REUSE_REPORTS: Family = Family::counter(
    "kvlb_replica_kv_event_reuse_reports_total",
    &["replica"],
    "BlockStored events that only reported blocks the replica already held (vLLM's full report mode): taken as a use, not a copy.",
);
pub static REPLICA_KV_ENGINE_BLOCK_SIZE: Family = Family::gauge(
    "kvlb_replica_kv_engine_block_size",
    &["replica"],
    "The block size (tokens) the replica's KV events use, once one was seen.",
);
pub static REPLICA_KV_OFFLOADED_BLOCKS: Family = Family::counter(
    "kvlb_replica_kv_offloaded_blocks_total",
    &["replica"],
    "Blocks the replica stored on a tier other than GPU.",
);
pub static REPLICA_KV_OFFLOAD_RESIDENT_BLOCKS: Family = Family::gauge(
    "kvlb_replica_kv_offload_resident_blocks",
    &["replica"],
    "Blocks kvlb believes the replica holds in an offloaded tier (CPU, disk) now.",
);
pub static REPLICA_KV_EVENT_SKIPPED: Family = Family::counter(
    "kvlb_replica_kv_event_skipped_total",
    &["replica", "reason"],
    "KV events from the replica that kvlb skipped, by reason: undecodable (the event could not be read; the rest of its batch was applied), block_size (a BlockStored of a block size other than kvlb's token block), malformed (no block, or a token count other than blocks x block size), unknown_parent (a BlockStored whose parent block kvlb does not know), multimodal (blocks, not events: hashed with multimodal items or prompt embeddings, which no request's text or token ids name).",
);
pub static REPLICA_PREFILL_PACE: Family = Family::gauge(
    "kvlb_replica_prefill_pace",
    &["replica"],
    "The replica's prefill time over what the configured cost model prices (1: as configured, 3: three times slower), learned from the times to first token of the streams kvlb sent there and the prefill times a vLLM replica reports in its /metrics; the fleet's pace while it has none.",
);
pub static REPLICA_DECODE_PACE: Family = Family::gauge(
    "kvlb_replica_decode_pace",
    &["replica"],
    "The replica's decode step time over what the configured cost model prices, learned from its streams; follows its prefill pace until measured.",
);
pub static REPLICA_QUEUE_PACE: Family = Family::gauge(
    "kvlb_replica_queue_pace",
    &["replica"],
    "How long the queue a request meets on the replica takes over what the configured cost model prices for it: its prefill pace, plus what kvlb cannot see of that queue (other clients' work, hits evicted before use).",
);
pub static REPLICA_TTFT_OBSERVED_OVER_ESTIMATED: Family = Family::gauge(
    "kvlb_replica_ttft_observed_over_estimated",
    &["replica"],
    "Observed over estimated time to first token of the streams kvlb sent to the replica (moving geometric mean); absent before the first.",
);
pub static REPLICA_CALIBRATION_SAMPLES: Family = Family::counter(
    "kvlb_replica_calibration_samples_total",
    &["replica", "kind"],
    "Samples the replica's pace was learned from: ttft (a stream's first byte against its estimate), decode (a stream's event spacing), metrics (the prefills the replica's own /metrics reported between two scrapes, vLLM's vllm:request_prefill_time_seconds: one sample per scrape that saw prefills finish).",
);
pub static REPLICA_CALIBRATION_METRICS_SKIPPED: Family = Family::counter(
    "kvlb_replica_calibration_metrics_skipped_total",
    &["replica", "reason"],
    "The replica's prefill reports between two scrapes not learned from: reset (a counter went backwards: the replica restarted), no_work (requests finished without computed tokens or seconds reported), own_samples (kvlb's own streams to the replica measured it in the same interval: they time what routing prices, while a replica's prefill times read high when prefills share its steps).",
);
pub static REPLICA_CALIBRATION_OUTLIERS: Family = Family::counter(
    "kvlb_replica_calibration_outliers_total",
    &["replica"],
    "Calibration samples of the replica more than 3x off the pace learned so far, taken as 3x off.",
);
pub static CALIBRATION_SAMPLES_DROPPED: Family = Family::counter(
    "kvlb_calibration_samples_dropped_total",
    &["reason"],
    "Calibration samples not learned from: queue_full (the workers made more between two ticks than the queue holds), stale (their replica's slot had taken another replica since).",
);
pub static LORA_ADAPTERS: Family = Family::gauge(
    "kvlb_lora_adapters_known",
    &[],
    "LoRA adapter names learned from the replicas' KV events and model lists: a token-mode request whose model names one matches only blocks stored under it.",
);
pub static MODEL_REQUESTS: Family = Family::counter(
    "kvlb_model_requests_total",
    &["model", "status"],
    "Requests naming each model, by the status class sent to the client (kvlb's own answers included); names without a label of their own (unknown, or past the first 63) count as other.",
);
pub static MODEL_TIME_TO_FIRST_TOKEN: Family = Family::histogram_by(
    "kvlb_model_time_to_first_token_seconds",
    &["model"],
    "From the request fully received to the replica's first response body byte, by model.",
);
pub static MODEL_PROMPT_TOKENS: Family = Family::counter(
    "kvlb_model_prompt_tokens_total",
    &["model"],
    "Estimated prompt tokens of the requests routed, by model.",
);
pub static MODEL_MATCHED_TOKENS: Family = Family::counter(
    "kvlb_model_matched_tokens_total",
    &["model"],
    "Prompt tokens counted as resident on the replica chosen, by model (over kvlb_model_prompt_tokens_total: the model's expected hit rate).",
);
pub static MODEL_REPLICAS: Family = Family::gauge(
    "kvlb_model_replicas",
    &["model"],
    "Replicas serving each model name (base models, aliases, LoRA adapters), as their GET /v1/models or their models option say; requests naming a model go only to them. The first 256 names have their own label, the rest are summed under model=\"other\".",
);
pub static LORA_LOADS: Family = Family::counter(
    "kvlb_lora_loads_total",
    &["adapter", "result"],
    "LoRA adapters kvlb loaded on demand (lora_adapter) on a replica, once for all the requests that waited for it: result ok, or failed (those requests were answered 503).",
);
pub static MODEL_NOT_FOUND: Family = Family::counter(
    "kvlb_model_not_found_total",
    &[],
    "Requests answered 404 (model_not_found) by kvlb: no replica serves the model they name.",
);
pub static MODEL_LIST_FAILURES: Family = Family::counter(
    "kvlb_model_list_failures_total",
    &[],
    "Replica model lists (GET /v1/models) that could not be read: no answer (the last list is kept) or no list (the replica takes any model).",
);

/// Every family, in the order /metrics shows them.
pub static ALL: &[&Family] = &[
    &REQUESTS,
    &RETRIES,
    &EJECTIONS,
    &LOCAL_RESPONSES,
    &CLIENT_ABORTS,
    &CUT_RESPONSES,
    &REPLICA_IN_FLIGHT,
    &REPLICA_QUEUED_PREFILL_TOKENS,
    &REPLICA_DECODING,
    &WORKER_IN_FLIGHT,
    &WORKER_CONNECTIONS,
    &WORKER_ACCEPTED,
    &WORKER_REQUESTS,
    &WORKER_ALLOCATIONS,
    &WORKER_RECV_THROTTLED,
    &SPLICED_RESPONSE_BYTES,
    &BODY_MEMORY_REFUSED,
    &WORKER_RECV_BUFFER_SHORTAGES,
    &BYTES,
    &UPSTREAM_CONNECTIONS,
    &TIME_TO_FIRST_BYTE,
    &TIME_TO_FIRST_TOKEN,
    &ESTIMATED_TTFT,
    &TTFT_OBSERVED_OVER_ESTIMATED,
    &MATCHED_PREFIX_TOKENS,
    &DECISIONS,
    &HOT_PREFIX_SPILLS,
    &LORA_SLOT_WAITS,
    &RESPONSE_AFFINITY,
    &PD_REQUESTS,
    &RESPONSE_IDS,
    &UNPARSED_PROMPTS,
    &PROMPT_TRUNCATED,
    &REQUEST_DURATION,
    &DRAINING,
    &QUEUE_WAITING,
    &BODY_MEMORY_BYTES,
    &QUEUED,
    &REPLICA_UP,
    &L4_CONNECTIONS,
    &L4_ACTIVE_CONNECTIONS,
    &L4_ABORTED_CONNECTIONS,
    &L4_BYTES,
    &L4_SOCKMAP_JOIN_FAILURES,
    &L4_SOCKMAP_LOADED,
    &L4_SOCKMAP_SOCKETS,
    &L4_SOCKMAP_PEERS,
    &TOKENIZED_REQUESTS,
    &TOKENIZE_ERRORS,
    &TOKENIZE_SEGMENT_HITS,
    &TOKENIZE_SEGMENT_MISSES,
    &ACCESS_LOG_LINES,
    &ACCESS_LOG_DROPPED_LINES,
    &PROCESS_OPEN_FDS,
    &PROCESS_MAX_FDS,
    &PROCESS_RESIDENT_MEMORY,
    &PROCESS_THREADS,
    &ADMIN_CONNECTIONS_REFUSED,
    &ADMIN_CONNECTIONS_TIMED_OUT,
    &CONFIG_RELOADS,
    &REPLICA_RUNNING,
    &REPLICA_WAITING,
    &REPLICA_KV_USAGE,
    &REPLICA_LORA_SLOTS,
    &REPLICA_LORA_ADAPTERS_ACTIVE,
    &REPLICA_TELEMETRY_AGE,
    &REPLICA_TELEMETRY_STALE,
    &REPLICA_KV_EVENTS,
    &REPLICA_KV_EVENT_GAPS,
    &REPLICA_KV_EVENT_RESTARTS,
    &REPLICA_KV_EVENT_DECODE_ERRORS,
    &REPLICA_KV_EVENT_WRONG_RANK,
    &REPLICA_KV_EVENT_REPLAYS,
    &REPLICA_KV_EVENT_REPLAY_FAILURES,
    &REPLICA_KV_EVENT_CONNECT_FAILURES,
    &REPLICA_KV_EVENT_REUSE_REPORTS,
    &REPLICA_KV_ENGINE_BLOCK_SIZE,
    &REPLICA_KV_OFFLOADED_BLOCKS,
    &REPLICA_KV_OFFLOAD_RESIDENT_BLOCKS,
    &REPLICA_KV_EVENT_SKIPPED,
    &REPLICA_PREFILL_PACE,
    &REPLICA_DECODE_PACE,
    &REPLICA_QUEUE_PACE,
    &REPLICA_TTFT_OBSERVED_OVER_ESTIMATED,
    &REPLICA_CALIBRATION_SAMPLES,
    &REPLICA_CALIBRATION_METRICS_SKIPPED,
    &REPLICA_CALIBRATION_OUTLIERS,
    &CALIBRATION_SAMPLES_DROPPED,
    &LORA_ADAPTERS,
    &MODEL_REPLICAS,
    &MODEL_REQUESTS,
    &MODEL_TIME_TO_FIRST_TOKEN,
    &MODEL_PROMPT_TOKENS,
    &MODEL_MATCHED_TOKENS,
    &MODEL_NOT_FOUND,
    &MODEL_LIST_FAILURES,
    &LORA_LOADS,
];
