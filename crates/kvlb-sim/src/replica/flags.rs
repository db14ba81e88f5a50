//! Command-line flags of `kvlb replica` -> a validated `ReplicaFlags`. Pure: no I/O, so every
//! bad flag is tested here. Each flag is declared once, as a field of `ReplicaFlags` or
//! `EngineFlags`: its doc comment is its help, its value parser its validation (errors name the
//! flag and the value); `ReplicaFlags::validate` checks the flags against each other.

#![forbid(unsafe_code)]

use super::pd::{Protocol, Role};
use crate::cli;
use crate::engine::{EngineConfig, SpeedList};
use crate::kv_events::EventFormat;
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser};
use std::net::SocketAddr;

const AFTER_HELP: &str = "\
On start it prints one line per replica to stderr, `kvlb replica: replica I on HOST:PORT`
(plus ` kv_events=tcp://.. kv_replay=tcp://..` when enabled, ` speed=X` or ` speed=PxD`
for a replica not at --speed 1, and ` role=prefill side_channel=HOST:PORT` or ` role=decode`
with --role; ` role=prefill pd_protocol=sglang bootstrap=HOST:PORT` or ` role=decode
pd_protocol=sglang` with --pd-protocol sglang), then `kvlb replica: ready`.
Replica i listens on port + i (likewise the event ports); port 0 gives each its own.
With a host KV tier every computed block is also kept in host memory (KV events with medium
CPU) and a prefix the GPU evicted is loaded back instead of recomputed.
With --enable-lora, /metrics adds vLLM's vllm:lora_requests_info: after every engine step a
sample {max_lora, waiting_lora_adapters, running_lora_adapters} set to the Unix time, both
adapter labels naming every adapter with a request between its first token and its end; the
last 32 label sets stay, the current one has the largest value.
/metrics reports vllm:time_to_first_token_seconds in engine seconds (wall seconds * time scale)
and, as each request finishes, vllm:request_queue_time_seconds (arrival to first scheduling),
vllm:request_prefill_time_seconds (first scheduling to first token) in wall seconds, as a GPU
time-scale times faster would, and vllm:request_prefill_kv_computed_tokens.
Besides /v1/completions and /v1/chat/completions it serves the agent APIs as vLLM does: the
Responses API (/v1/responses, stored in memory per port, the last 10000, for
previous_response_id and GET /v1/responses/ID) and Anthropic's /v1/messages (and
/count_tokens), both rendered with the chat template; /v1/embeddings, /rerank, /score and
/detokenize answer at once, without the engine.
Prefill/decode roles speak vLLM's disaggregated prefill (NixlConnector, as vLLM's proxy and
vllm-router drive it). --role prefill: a completion whose kv_transfer_params has
do_remote_decode true is prefilled and answered with kv_transfer_params {do_remote_prefill,
remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port, tp_size};
its KV blocks stay held (unevictable, in vllm:kv_cache_usage_perc) until a decode replica
pulls them from the side channel (POST /kv/pull {remote_engine_id, remote_request_id}) or
--kv-hold-timeout passes. --role decode: a request whose kv_transfer_params are such an
answer pulls the KV, waits the transfer out (tokens x --kv-bytes-per-token / --kv-link-gbps)
and computes the last prompt token only; without valid params, or when the pull fails, it
prefills locally. Both roles add the vllm:nixl_* and kvlb_replica_kv_* families to /metrics.
--pd-protocol sglang speaks SGLang's disaggregation instead (sgl-router / SMG, mini_lb: the
same body, with bootstrap_host, bootstrap_port and bootstrap_room added, sent to both replicas
at once; kv_transfer_params is then ignored). --role prefill: a request with a bootstrap_room
is prefilled with one output token, answered as asked (streamed or not), and its KV held for
the room until the bootstrap server (--disaggregation-bootstrap-port) hands it to the decode
(POST /kv/pull {bootstrap_room, wait_s}: waits up to wait_s for the room's prefill to finish)
or --kv-hold-timeout passes. --role decode: a request with a bootstrap_room fetches the room's
KV from bootstrap_host:bootstrap_port (null: its own --disaggregation-bootstrap-port), waiting
up to --kv-wait-timeout, waits the transfer out and decodes; if the fetch fails the request
fails with a 500 before any byte is streamed, counted in
kvlb_replica_kv_transfer_failures_total{reason}. A batch (several prompts, n > 1, or the
fields as lists) with a bootstrap_room is refused with a 400, and so is a generation request
without one, as SGLang refuses it.";

/// Simulated GPU replicas that speak vLLM's interfaces (OpenAI HTTP API, /metrics, ZeroMQ KV
/// events).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvlb replica",
    after_help = AFTER_HELP,
    args_override_self = true,
    mut_args = cli::hyphen_values
)]
pub struct ReplicaFlags {
    /// HTTP address of replica 0 (e.g. 127.0.0.1:8000; port 0 = ephemeral); replica i listens
    /// on port + i
    #[arg(long, value_name = "ADDR", value_parser = socket_addr)]
    pub listen: SocketAddr,
    /// Serve N independent replicas on consecutive ports
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = cli::int::<u32, 1, 1024>)]
    pub count: u32,
    /// Per-replica speed factors of a mixed fleet, comma-separated, one for all replicas or one
    /// per replica of --count: X (prefill and decode X times the engine flags' speed; 0.333 =
    /// three times slower) or PxD (prefill speed P, decode speed D, e.g. 0.33x0.5), each from
    /// 0.01 to 100. A replica's prefill terms (--prefill-a-s, -b-s, -c-s) are divided by P, its
    /// decode terms (--decode-*) by D; token counts stay. Every rank of --dp-size gets it
    #[arg(long, value_name = "LIST", default_value = SpeedList::DEFAULT, value_parser = SpeedList::parse)]
    pub speed: SpeedList,
    /// Serve N data-parallel ranks behind the one HTTP port, as vLLM --data-parallel-size: each
    /// rank its own engine and KV cache, chosen by the X-Data-Parallel-Rank header (none:
    /// round-robin), publishing events on the --kv-events and --kv-replay ports + rank with
    /// its data_parallel_rank, metrics with engine="rank" (needs --count 1)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = cli::int::<u32, 1, 64>)]
    pub dp_size: u32,
    /// Its part in disaggregated prefill, as vLLM's kv_role with NixlConnector (or SGLang's
    /// --disaggregation-mode, with --pd-protocol sglang; every replica of --count alike)
    #[arg(long, value_name = "ROLE", default_value = "both", value_parser = role())]
    pub role: Role,
    /// (--role prefill|decode) The disaggregation protocol spoken to the router (every replica
    /// of --count alike)
    #[arg(long, value_name = "PROTOCOL", default_value = "vllm", value_parser = pd_protocol())]
    pub pd_protocol: Protocol,
    /// (--pd-protocol sglang) SGLang's bootstrap port. --role prefill: replica 0's bootstrap
    /// server, where decode replicas fetch a room's KV, on the --listen host; replica i's on
    /// port + i; 0 = ephemeral (the startup line names it; SGLang's own default is 8998).
    /// --role decode: the port a null bootstrap_port stands for (as SGLang fills in its
    /// server's own); 0 = none, such a request is refused with a 400
    #[arg(long, value_name = "PORT", default_value_t = 0, value_parser = cli::int::<u16, 0, 65535>)]
    pub disaggregation_bootstrap_port: u16,
    /// (--role decode --pd-protocol sglang) Wall seconds a decode waits for its room's KV at
    /// the prefill replica's bootstrap server (its prefill may not even have arrived yet)
    /// before failing the request with a 500 (SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT)
    #[arg(long, value_name = "SECONDS", default_value_t = 300.0, value_parser = cli::positive)]
    pub kv_wait_timeout: f64,
    /// (--role prefill, --pd-protocol vllm) Port of replica 0's KV side channel, where decode replicas pull held
    /// KV, on the --listen host; replica i's on port + i; 0 = ephemeral (the startup line
    /// names it, as do the prefill answers' remote_port)
    #[arg(long, value_name = "PORT", default_value_t = 0, value_parser = cli::int::<u16, 0, 65535>)]
    pub side_channel_port: u16,
    /// (--role prefill) Wall seconds a prefill's KV stays held for its decode's pull before it
    /// is freed and counted in vllm:nixl_num_kv_expired_reqs (vLLM's
    /// VLLM_NIXL_ABORT_REQUEST_TIMEOUT; with --pd-protocol sglang, until its room's fetch)
    #[arg(long, value_name = "SECONDS", default_value_t = super::pd::DEFAULT_KV_HOLD_TIMEOUT_S,
          value_parser = cli::positive)]
    pub kv_hold_timeout: f64,
    /// (--role decode) KV link bandwidth from the prefill replicas in GB/s (10^9 bytes per
    /// second, not gigabits): a pull of N tokens takes N x --kv-bytes-per-token / (X x 10^9)
    /// seconds, --time-scale times fewer in wall time as every engine time
    #[arg(long, value_name = "X", default_value_t = super::pd::DEFAULT_KV_LINK_GBPS,
          value_parser = cli::positive)]
    pub kv_link_gbps: f64,
    /// Publish KV cache events (ZeroMQ PUB) on ADDR, port shifted per replica (tcp://*:PORT
    /// binds all interfaces)
    #[arg(long, value_name = "tcp://ADDR", value_parser = tcp_endpoint)]
    pub kv_events: Option<SocketAddr>,
    /// Serve event replay (ZeroMQ ROUTER) on ADDR, port shifted per replica (needs
    /// --kv-events)
    #[arg(long, value_name = "tcp://ADDR", value_parser = tcp_endpoint)]
    pub kv_replay: Option<SocketAddr>,
    /// Event encoding
    #[arg(long, value_name = "FORMAT", default_value = "map", value_parser = event_format())]
    pub kv_events_format: EventFormat,
    /// Topic frame of every event message (default: empty)
    #[arg(
        long,
        value_name = "TOPIC",
        default_value = "",
        hide_default_value = true
    )]
    pub kv_events_topic: String,
    /// Engine seconds per wall second (100 = 100x faster)
    #[arg(long, value_name = "X", default_value_t = 1.0, value_parser = cli::positive)]
    pub time_scale: f64,
    /// The model (its path: the `root` of /v1/models; also its name unless
    /// --served-model-name gives others)
    #[arg(long, value_name = "NAME", default_value = "Qwen/Qwen3-8B", value_parser = model_name)]
    pub model: String,
    /// The names it serves the model under, as vLLM: responses carry the first, requests may
    /// name any (default: --model)
    #[arg(long, value_name = "NAME", num_args = 1.., value_parser = model_name)]
    pub served_model_name: Vec<String>,
    /// Serve LoRA adapters (--lora-modules, and /v1/load_lora_adapter when
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING is true): a request naming one is computed under it,
    /// its KV cache apart from the base model's
    #[arg(long)]
    pub enable_lora: bool,
    /// LoRA adapters loaded at start, NAME=PATH (needs --enable-lora)
    #[arg(long, value_name = "NAME=PATH", num_args = 1.., value_parser = lora_module)]
    pub lora_modules: Vec<(String, String)>,
    /// Most LoRA adapters in a batch, as vLLM --max-loras (with --enable-lora): a request of
    /// another adapter waits, without holding back the requests behind it, while this many
    /// have running requests; the GPU holds this many adapters, and a step running one it
    /// does not hold takes --lora-switch-s longer
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = cli::int::<u32, 1, { u32::MAX as u64 }>)]
    pub max_loras: u32,
    /// Seed of response ids and of the engine's block hash ids
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = cli::int::<u64, 0, { u64::MAX }>)]
    pub seed: u64,
    /// Hugging Face tokenizer.json: text prompts get its ids, chat prompts its chat template's
    /// (default: the simulated tokenizer)
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<String>,
    /// tokenizer_config.json or .jinja (default: beside the tokenizer; needs --tokenizer)
    #[arg(long, value_name = "PATH")]
    pub chat_template: Option<String>,
    #[command(flatten)]
    pub engine: EngineFlags,
}

/// The simulated engine's flags; defaults are `EngineConfig::default()`, the calibrated 8B
/// model on one H100.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Engine")]
pub struct EngineFlags {
    /// Longest prompt + completion in tokens
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().max_model_len,
          value_parser = cli::int::<u32, 1, { u32::MAX as u64 }>)]
    pub max_model_len: u32,
    /// KV cache capacity in tokens
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().kv_capacity_tokens,
          value_parser = cli::int::<u64, 1, { u64::MAX }>)]
    pub kv_capacity_tokens: u64,
    /// Tokens per KV block
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().block_size,
          value_parser = cli::int::<u32, 1, { 1 << 16 }>)]
    pub block_size: u32,
    /// Most sequences running at once
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().max_num_seqs,
          value_parser = cli::int::<u32, 1, { u32::MAX as u64 }>)]
    pub max_num_seqs: u32,
    /// Tokens scheduled per engine step
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().max_num_batched_tokens,
          value_parser = cli::int::<u32, 1, { u32::MAX as u64 }>)]
    pub max_num_batched_tokens: u32,
    /// Prefill step seconds, fixed part: a step takes a + b*new + c*new*context
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().prefill_a_s,
          value_parser = cli::non_negative)]
    pub prefill_a_s: f64,
    /// Prefill seconds per new token (b)
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().prefill_b_s,
          value_parser = cli::non_negative)]
    pub prefill_b_s: f64,
    /// Prefill seconds per new token per context token (c)
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().prefill_c_s,
          value_parser = cli::non_negative)]
    pub prefill_c_s: f64,
    /// Decode step seconds, fixed part: a step takes base + per_seq*batch +
    /// per_ctx_token*context
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().decode_base_s,
          value_parser = cli::non_negative)]
    pub decode_base_s: f64,
    /// Decode seconds per running sequence (per_seq)
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().decode_per_seq_s,
          value_parser = cli::non_negative)]
    pub decode_per_seq_s: f64,
    /// Decode seconds per context token (per_ctx_token)
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().decode_per_ctx_token_s,
          value_parser = cli::non_negative)]
    pub decode_per_ctx_token_s: f64,
    /// Host-memory KV tier (CPU offloading) in tokens; 0 = none
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().host_kv_capacity_tokens,
          value_parser = cli::int::<u64, 0, { u64::MAX }>)]
    pub host_kv_capacity_tokens: u64,
    /// Seconds per token to load KV back from the host tier
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().host_load_s_per_token,
          value_parser = cli::non_negative)]
    pub host_load_s_per_token: f64,
    /// Seconds a step takes longer for each LoRA adapter it runs that is not in one of the
    /// --max-loras GPU slots (copying its weights from host memory; kvlb's own flag)
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().lora_switch_s,
          value_parser = cli::non_negative)]
    pub lora_switch_s: f64,
    /// KV cache bytes per token (all layers, K and V; 128 KiB for the 8B model): what a KV
    /// transfer of --role decode moves per token
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().kv_bytes_per_token,
          value_parser = cli::int::<u64, 0, { u32::MAX as u64 }>)]
    pub kv_bytes_per_token: u64,
    /// Step-time jitter: each engine step's duration is multiplied by a random lognormal
    /// factor of mean 1, exp(X * N(0,1) - X^2/2), seeded by --seed and the replica (and rank);
    /// 0 = every step takes its modelled time
    #[arg(long, value_name = "X", default_value_t = EngineConfig::default().timing_spread,
          value_parser = crate::engine::timing_spread)]
    pub timing_spread: f64,
}

impl EngineFlags {
    /// The engine these flags describe (hash seed 0; each replica sets its own).
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            max_model_len: self.max_model_len,
            kv_capacity_tokens: self.kv_capacity_tokens,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            prefill_a_s: self.prefill_a_s,
            prefill_b_s: self.prefill_b_s,
            prefill_c_s: self.prefill_c_s,
            decode_base_s: self.decode_base_s,
            decode_per_seq_s: self.decode_per_seq_s,
            decode_per_ctx_token_s: self.decode_per_ctx_token_s,
            host_kv_capacity_tokens: self.host_kv_capacity_tokens,
            host_load_s_per_token: self.host_load_s_per_token,
            lora_switch_s: self.lora_switch_s,
            timing_spread: self.timing_spread,
            kv_bytes_per_token: self.kv_bytes_per_token,
            ..EngineConfig::default()
        }
    }
}

/// Engine fields and the flags that set them, to name the flag in validation errors.
const ENGINE_FLAGS: [(&str, &str); 15] = [
    ("host_kv_capacity_tokens", "--host-kv-capacity-tokens"),
    ("host_load_s_per_token", "--host-load-s-per-token"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("kv_capacity_tokens", "--kv-capacity-tokens"),
    ("max_model_len", "--max-model-len"),
    ("max_num_seqs", "--max-num-seqs"),
    ("block_size", "--block-size"),
    ("prefill_a_s", "--prefill-a-s"),
    ("prefill_b_s", "--prefill-b-s"),
    ("prefill_c_s", "--prefill-c-s"),
    ("decode_base_s", "--decode-base-s"),
    ("decode_per_seq_s", "--decode-per-seq-s"),
    ("decode_per_ctx_token_s", "--decode-per-ctx-token-s"),
    ("lora_switch_s", "--lora-switch-s"),
    ("timing_spread", "--timing-spread"),
];

/// Parse `args` (without the `replica` word). `--flag value` and `--flag=value` both work; a
/// repeated flag's last value wins. `--help` comes back as an error of kind `DisplayHelp`
/// (exit status 0), like every parse error ready for `cli::exit_status`.
pub fn parse(args: &[String]) -> Result<ReplicaFlags, clap::Error> {
    cli::parse("kvlb replica", args, ReplicaFlags::validate)
}

impl ReplicaFlags {
    /// The names the model is served under (--served-model-name, else --model).
    pub fn served_names(&self) -> Vec<String> {
        match self.served_model_name.is_empty() {
            true => vec![self.model.clone()],
            false => self.served_model_name.clone(),
        }
    }

    /// The engine of each replica (hash seed 0; each replica sets its own): the engine flags,
    /// with --max-loras when LoRA is on (vLLM has no adapter limit without it).
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            max_loras: if self.enable_lora { self.max_loras } else { 0 },
            ..self.engine.config()
        }
    }

    /// Where replica 0's KV side channel listens (--role prefill, vLLM's protocol): the
    /// --listen host, at --side-channel-port.
    pub fn side_channel(&self) -> Option<SocketAddr> {
        (self.role == Role::Prefill && self.pd_protocol == Protocol::Vllm)
            .then(|| SocketAddr::new(self.listen.ip(), self.side_channel_port))
    }

    /// Where replica 0's bootstrap server listens (--role prefill --pd-protocol sglang): the
    /// --listen host, at --disaggregation-bootstrap-port.
    pub fn bootstrap(&self) -> Option<SocketAddr> {
        (self.role == Role::Prefill && self.pd_protocol == Protocol::Sglang)
            .then(|| SocketAddr::new(self.listen.ip(), self.disaggregation_bootstrap_port))
    }

    /// The checks across flags; the error names the flags.
    pub fn validate(&self) -> Result<(), String> {
        if !self.lora_modules.is_empty() && !self.enable_lora {
            return Err("--lora-modules needs --enable-lora".to_string());
        }
        if let Some((name, _)) = self
            .lora_modules
            .iter()
            .find(|(n, _)| self.served_names().iter().any(|s| s == n))
        {
            return Err(format!(
                "--lora-modules {name}: the name of a served base model"
            ));
        }
        self.speed.check(
            self.count as usize,
            "--speed",
            &format!("--count {}", self.count),
        )?;
        if self.chat_template.is_some() && self.tokenizer.is_none() {
            return Err("--chat-template needs --tokenizer".to_string());
        }
        if self.kv_replay.is_some() && self.kv_events.is_none() {
            return Err("--kv-replay needs --kv-events".to_string());
        }
        if self.dp_size > 1 && self.count > 1 {
            return Err(format!(
                "--dp-size {} needs --count 1 (one data-parallel engine per process)",
                self.dp_size
            ));
        }
        let dp_ephemeral = [self.kv_events, self.kv_replay]
            .iter()
            .flatten()
            .any(|a| a.port() == 0);
        if self.dp_size > 1 && dp_ephemeral {
            return Err(format!(
                "--dp-size {} needs fixed --kv-events / --kv-replay ports (rank r publishes on port + r)",
                self.dp_size
            ));
        }
        let engine = self.engine_config();
        if engine.kv_capacity_tokens < engine.block_size as u64 {
            return Err(format!(
                "bad value for --kv-capacity-tokens: {} (less than one block of {} tokens)",
                engine.kv_capacity_tokens, engine.block_size
            ));
        }
        let host = engine.host_kv_capacity_tokens;
        if host > 0 && host < engine.block_size as u64 {
            return Err(format!(
                "bad value for --host-kv-capacity-tokens: {host} (less than one block of {} tokens; 0 turns the host tier off)",
                engine.block_size
            ));
        }
        if let Err(e) = engine.validate() {
            let named: Vec<&str> = ENGINE_FLAGS
                .iter()
                .filter(|(f, _)| names_field(&e, f))
                .map(|(_, flag)| *flag)
                .collect();
            return Err(format!("invalid engine flags ({}): {e}", named.join(", ")));
        }
        let runs = [
            ("--listen", Some(self.listen)),
            ("--kv-events", self.kv_events),
            ("--kv-replay", self.kv_replay),
            ("--side-channel-port", self.side_channel()),
            ("--disaggregation-bootstrap-port", self.bootstrap()),
        ];
        for (name, addr) in runs {
            if let Some(a) = addr {
                let run = self.count * self.dp_size;
                if a.port() != 0 && a.port() as u32 + run - 1 > 65_535 {
                    return Err(format!(
                        "bad value for {name}: {a} (port + --count {} x --dp-size {} runs past 65535)",
                        self.count, self.dp_size
                    ));
                }
            }
        }
        // Port runs of different sockets must not overlap (e.g. --kv-events :5557 --kv-replay
        // :5558 with --count 2 would give replica 1 the replay port of replica 0).
        for (i, (name_a, a)) in runs.iter().enumerate() {
            for (name_b, b) in runs.iter().skip(i + 1) {
                let (Some(a), Some(b)) = (a, b) else { continue };
                if a.port() == 0 || b.port() == 0 {
                    continue;
                }
                let (pa, pb) = (a.port() as u32, b.port() as u32);
                let run = self.count * self.dp_size;
                if pa < pb + run && pb < pa + run {
                    return Err(format!(
                        "bad value for {name_b}: {b} (ports {pb}..{} overlap {name_a} ports {pa}..{} with --count {})",
                        pb + self.count - 1,
                        pa + self.count - 1,
                        self.count
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Whether `message` names `field` as a whole word (kv_capacity_tokens is not named by
/// host_kv_capacity_tokens).
fn names_field(message: &str, field: &str) -> bool {
    message.match_indices(field).any(|(at, _)| {
        let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
        !message[..at].ends_with(word) && !message[at + field.len()..].starts_with(word)
    })
}

/// `--role`: the roles, each with its help.
fn role() -> impl TypedValueParser<Value = Role> {
    PossibleValuesParser::new([
        PossibleValue::new("both")
            .help("whole requests; kv_transfer_params is ignored (no KV connector)"),
        PossibleValue::new("prefill")
            .help("do_remote_decode: prefill, answer kv_transfer_params, hold the KV for the pull"),
        PossibleValue::new("decode").help(
            "do_remote_prefill: pull the KV from the prefill replica's side channel, then decode",
        ),
    ])
    .map(|name| Role::parse(&name).unwrap_or_default())
}

/// `--pd-protocol`: the protocols, each with its help.
fn pd_protocol() -> impl TypedValueParser<Value = Protocol> {
    PossibleValuesParser::new([
        PossibleValue::new("vllm").help(
            "vLLM's NixlConnector: kv_transfer_params, the prefill answer's params, the side channel",
        ),
        PossibleValue::new("sglang").help(
            "SGLang's: bootstrap_host/port/room in the one body both legs get, the bootstrap server",
        ),
    ])
    .map(|name| match name.as_str() {
        "sglang" => Protocol::Sglang,
        _ => Protocol::Vllm,
    })
}

/// `--kv-events-format`: the encodings, each with its help.
fn event_format() -> impl TypedValueParser<Value = EventFormat> {
    PossibleValuesParser::new([
        PossibleValue::new("map").help("msgpack maps, byte for byte as vLLM 0.33 writes them"),
        PossibleValue::new("array").help("positional arrays (older vLLM)"),
        PossibleValue::new("map-nil").help(
            "the keys of map, nil values included, in the smallest map headers (the form \
             vllm-router 0.1.17's kv_aware was checked against)",
        ),
    ])
    .map(|name| match name.as_str() {
        "array" => EventFormat::Array,
        "map-nil" => EventFormat::MapNil,
        _ => EventFormat::Map,
    })
}

fn lora_module(value: &str) -> Result<(String, String), String> {
    match value.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), path.to_string()))
        }
        _ => Err("expected NAME=PATH".to_string()),
    }
}

fn model_name(value: &str) -> Result<String, String> {
    if value.is_empty() {
        return Err("expected a model name".to_string());
    }
    Ok(value.to_string())
}

fn socket_addr(value: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = value.parse::<SocketAddr>() {
        return Ok(a);
    }
    // "localhost:8000" and other host names: resolve once at start-up.
    use std::net::ToSocketAddrs;
    match value.to_socket_addrs() {
        Ok(mut it) => it.next().ok_or_else(|| "no address".to_string()),
        Err(_) => Err("expected HOST:PORT".to_string()),
    }
}

fn tcp_endpoint(value: &str) -> Result<SocketAddr, String> {
    let expected = || "expected tcp://HOST:PORT".to_string();
    let rest = value.strip_prefix("tcp://").ok_or_else(expected)?;
    // vLLM configs say tcp://*:5557; bind all interfaces then.
    let rest = match rest.strip_prefix("*:") {
        Some(port) => format!("0.0.0.0:{port}"),
        None => rest.to_string(),
    };
    socket_addr(&rest).map_err(|_| expected())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;
    use clap::CommandFactory;

    fn run(args: &[&str]) -> Result<ReplicaFlags, String> {
        let v: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        parse(&v).map_err(|e| e.to_string())
    }

    fn help() -> String {
        ReplicaFlags::command().render_long_help().to_string()
    }

    #[test]
    fn parses_every_flag_form() {
        let f = run(&[
            "--listen",
            "127.0.0.1:0",
            "--count=4",
            "--kv-events",
            "tcp://127.0.0.1:5557",
            "--kv-replay=tcp://127.0.0.1:6557",
            "--kv-events-format",
            "array",
            "--time-scale",
            "100",
            "--block-size",
            "32",
            "--prefill-b-s",
            "1e-5",
        ])
        .unwrap();
        assert_eq!(f.count, 4);
        assert_eq!(f.kv_events.unwrap().port(), 5557);
        assert_eq!(f.kv_replay.unwrap().port(), 6557);
        assert_eq!(f.kv_events_format, EventFormat::Array);
        assert_eq!(f.time_scale, 100.0);
        assert_eq!(f.engine.block_size, 32);
        assert_eq!(f.engine.prefill_b_s, 1e-5);
        assert_eq!(
            f.engine.host_kv_capacity_tokens, 0,
            "no host tier by default"
        );
        let f = run(&[
            "--listen",
            "127.0.0.1:0",
            "--host-kv-capacity-tokens",
            "3200000",
            "--host-load-s-per-token=2e-6",
        ])
        .unwrap();
        assert_eq!(f.engine.host_kv_capacity_tokens, 3_200_000);
        assert_eq!(f.engine.host_load_s_per_token, 2e-6);
        // vLLM's default of one adapter, engaged with --enable-lora only.
        let f = run(&["--listen", "127.0.0.1:0"]).unwrap();
        assert_eq!((f.max_loras, f.engine_config().max_loras), (1, 0));
        let f = run(&["--listen", "127.0.0.1:0", "--enable-lora"]).unwrap();
        assert_eq!(f.engine_config().max_loras, 1);
        assert_eq!(f.engine_config().lora_switch_s, 0.01);
        let f = run(&[
            "--listen",
            "127.0.0.1:0",
            "--enable-lora",
            "--max-loras",
            "4",
            "--lora-switch-s=0.002",
        ])
        .unwrap();
        assert_eq!(f.engine_config().max_loras, 4);
        assert_eq!(f.engine_config().lora_switch_s, 0.002);
        let f = run(&["--listen", "127.0.0.1:0", "--kv-events-format=map-nil"]).unwrap();
        assert_eq!(f.kv_events_format, EventFormat::MapNil);
        let f = run(&["--listen", "127.0.0.1:0", "--kv-events", "tcp://*:7000"]).unwrap();
        assert_eq!(f.kv_events.unwrap().to_string(), "0.0.0.0:7000");
    }

    #[test]
    fn errors_name_flag_and_value() {
        let e = run(&["--listen", "127.0.0.1:0", "--count", "zero"]).unwrap_err();
        assert!(e.contains("--count") && e.contains("zero"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--time-scale", "-1"]).unwrap_err();
        assert!(e.contains("--time-scale") && e.contains("-1"), "{e}");
        let e = run(&["--listen", "nowhere"]).unwrap_err();
        assert!(e.contains("--listen") && e.contains("nowhere"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--kv-events", "127.0.0.1:1"]).unwrap_err();
        assert!(e.contains("--kv-events"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--bogus", "1"]).unwrap_err();
        assert!(e.contains("--bogus"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--kv-events-format", "xml"]).unwrap_err();
        assert!(e.contains("xml"), "{e}");
        let e = run(&["--listen", "127.0.0.1:65535", "--count", "2"]).unwrap_err();
        assert!(e.contains("65535"), "{e}");
        assert!(run(&["--count", "2"]).unwrap_err().contains("--listen"));
        let e = run(&["--listen"]).unwrap_err();
        assert!(
            e.contains("--listen") && e.contains("value is required"),
            "{e}"
        );
        assert!(matches!(parse(&["--help".to_string()]),
            Err(e) if e.kind() == ErrorKind::DisplayHelp));
        let e = run(&[
            "--listen",
            "127.0.0.1:0",
            "--max-num-seqs",
            "512",
            "--max-num-batched-tokens",
            "100",
        ])
        .unwrap_err();
        assert!(
            e.contains("--max-num-batched-tokens") && e.contains("100"),
            "{e}"
        );
        assert!(help().contains("--decode-per-ctx-token-s"));
        assert!(help().contains("--host-kv-capacity-tokens"));
        let e = run(&["--listen", "127.0.0.1:0", "--host-kv-capacity-tokens", "8"]).unwrap_err();
        assert!(
            e.contains("--host-kv-capacity-tokens") && e.contains('8'),
            "{e}"
        );
        let e = run(&["--listen", "127.0.0.1:0", "--max-loras", "0"]).unwrap_err();
        assert!(e.contains("--max-loras") && e.contains('0'), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--lora-switch-s", "-1"]).unwrap_err();
        assert!(e.contains("--lora-switch-s") && e.contains("-1"), "{e}");
        assert!(help().contains("--max-loras") && help().contains("--lora-switch-s"));
        let e = run(&["--listen", "127.0.0.1:0", "--host-load-s-per-token", "-1"]).unwrap_err();
        assert!(e.contains("--host-load-s-per-token"), "{e}");
        let e = run(&[
            "--listen",
            "127.0.0.1:0",
            "--host-kv-capacity-tokens",
            "999999999999999",
        ])
        .unwrap_err();
        assert!(e.contains("--host-kv-capacity-tokens"), "{e}");
        assert!(!e.contains(" --kv-capacity-tokens"), "{e}");
        let e = run(&[
            "--listen",
            "127.0.0.1:8000",
            "--count",
            "2",
            "--kv-events",
            "tcp://127.0.0.1:5557",
            "--kv-replay",
            "tcp://127.0.0.1:5558",
        ])
        .unwrap_err();
        assert!(e.contains("--kv-replay") && e.contains("overlap"), "{e}");
        assert!(run(&[
            "--listen",
            "127.0.0.1:8000",
            "--count",
            "2",
            "--kv-events",
            "tcp://127.0.0.1:8002"
        ])
        .is_ok());
    }

    #[test]
    fn defaults_repeats_and_hyphen_values() {
        // clap checks its definition in debug builds (`cargo test` without --release).
        <ReplicaFlags as clap::CommandFactory>::command().debug_assert();
        let f = run(&["--listen", "127.0.0.1:0"]).unwrap();
        assert_eq!((f.count, f.time_scale, f.seed), (1, 1.0, 0));
        assert_eq!(f.model, "Qwen/Qwen3-8B");
        assert_eq!(f.kv_events_format, EventFormat::Map);
        assert_eq!(f.kv_events_topic, "");
        assert!(f.kv_events.is_none() && f.tokenizer.is_none());
        let d = EngineConfig::default();
        let e = f.engine.config();
        assert_eq!(
            (
                e.max_model_len,
                e.kv_capacity_tokens,
                e.block_size,
                e.prefill_c_s
            ),
            (
                d.max_model_len,
                d.kv_capacity_tokens,
                d.block_size,
                d.prefill_c_s
            )
        );
        assert_eq!(
            (e.decode_per_ctx_token_s, e.host_load_s_per_token),
            (d.decode_per_ctx_token_s, d.host_load_s_per_token)
        );
        // A repeated flag: the last value wins, as before.
        let f = run(&["--listen", "127.0.0.1:0", "--count", "2", "--count=3"]).unwrap();
        assert_eq!(f.count, 3);
        // A value starting with '-' is the flag's (bad) value, not another flag.
        let e = run(&["--listen", "127.0.0.1:0", "--count", "-1"]).unwrap_err();
        assert!(e.contains("--count") && e.contains("-1"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--model", ""]).unwrap_err();
        assert!(e.contains("--model"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--chat-template", "t.jinja"]).unwrap_err();
        assert!(e.contains("--chat-template needs --tokenizer"), "{e}");
        let e = run(&[
            "--listen",
            "127.0.0.1:0",
            "--kv-replay",
            "tcp://127.0.0.1:0",
        ])
        .unwrap_err();
        assert!(e.contains("--kv-replay needs --kv-events"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "stray"]).unwrap_err();
        assert!(e.contains("stray"), "{e}");
    }

    #[test]
    fn prefill_decode_roles() {
        let f = run(&["--listen", "127.0.0.1:8000"]).unwrap();
        assert_eq!(f.role, Role::Both);
        assert_eq!(f.side_channel(), None);
        assert_eq!((f.side_channel_port, f.kv_hold_timeout), (0, 480.0));
        assert_eq!(f.kv_link_gbps, 25.0);
        assert_eq!(f.engine_config().kv_bytes_per_token, 128 * 1024);
        let f = run(&[
            "--listen",
            "127.0.0.1:8000",
            "--role",
            "prefill",
            "--side-channel-port",
            "5600",
            "--kv-hold-timeout=30",
            "--kv-bytes-per-token",
            "147456",
        ])
        .unwrap();
        assert_eq!(f.role, Role::Prefill);
        assert_eq!(f.side_channel(), Some("127.0.0.1:5600".parse().unwrap()));
        assert_eq!(f.kv_hold_timeout, 30.0);
        assert_eq!(f.engine_config().kv_bytes_per_token, 147_456);
        let f = run(&[
            "--listen",
            "127.0.0.1:0",
            "--role=decode",
            "--kv-link-gbps",
            "12.5",
        ])
        .unwrap();
        assert_eq!((f.role, f.kv_link_gbps), (Role::Decode, 12.5));
        assert_eq!(
            f.side_channel(),
            None,
            "a decode replica serves no side channel"
        );
        for (bad, flag, value) in [
            (&["--role", "router"][..], "--role", "router"),
            (
                &["--side-channel-port", "70000"],
                "--side-channel-port",
                "70000",
            ),
            (&["--kv-hold-timeout", "0"], "--kv-hold-timeout", "0"),
            (&["--kv-link-gbps", "-1"], "--kv-link-gbps", "-1"),
            (&["--kv-bytes-per-token", "x"], "--kv-bytes-per-token", "x"),
        ] {
            let mut a = vec!["--listen", "127.0.0.1:0"];
            a.extend_from_slice(bad);
            let e = run(&a).unwrap_err();
            assert!(e.contains(flag) && e.contains(value), "{bad:?}: {e}");
        }
        // Replica i's side channel is on port + i: its run must not cross the HTTP ports'.
        let e = run(&[
            "--listen",
            "127.0.0.1:8000",
            "--count",
            "2",
            "--role",
            "prefill",
            "--side-channel-port",
            "8001",
        ])
        .unwrap_err();
        assert!(
            e.contains("--side-channel-port") && e.contains("overlap"),
            "{e}"
        );
        let h = help();
        for flag in [
            "--role",
            "--side-channel-port",
            "--kv-hold-timeout",
            "--kv-link-gbps",
        ] {
            assert!(h.contains(flag), "{flag}");
        }
        assert!(h.contains("--kv-bytes-per-token") && h.contains("POST /kv/pull"));
    }

    #[test]
    fn sglang_protocol() {
        let f = run(&["--listen", "127.0.0.1:8000", "--role", "prefill"]).unwrap();
        assert_eq!(f.pd_protocol, Protocol::Vllm);
        assert_eq!(
            (f.disaggregation_bootstrap_port, f.kv_wait_timeout),
            (0, 300.0)
        );
        assert_eq!(f.bootstrap(), None);
        let f = run(&[
            "--listen",
            "127.0.0.1:8000",
            "--role",
            "prefill",
            "--pd-protocol",
            "sglang",
            "--disaggregation-bootstrap-port",
            "8998",
        ])
        .unwrap();
        assert_eq!(f.pd_protocol, Protocol::Sglang);
        assert_eq!(f.bootstrap(), Some("127.0.0.1:8998".parse().unwrap()));
        assert_eq!(f.side_channel(), None, "no vLLM side channel with sglang");
        let f = run(&[
            "--listen",
            "127.0.0.1:0",
            "--role=decode",
            "--pd-protocol=sglang",
            "--kv-wait-timeout",
            "0.5",
        ])
        .unwrap();
        assert_eq!((f.role, f.kv_wait_timeout), (Role::Decode, 0.5));
        assert_eq!(f.bootstrap(), None, "a decode replica serves no bootstrap");
        // Meaningless without a role, as the other PD flags: accepted, ignored.
        let f = run(&["--listen", "127.0.0.1:0", "--pd-protocol", "sglang"]).unwrap();
        assert_eq!((f.bootstrap(), f.side_channel()), (None, None));
        for (bad, flag, value) in [
            (&["--pd-protocol", "trtllm"][..], "--pd-protocol", "trtllm"),
            (
                &["--disaggregation-bootstrap-port", "70000"],
                "--disaggregation-bootstrap-port",
                "70000",
            ),
            (&["--kv-wait-timeout", "0"], "--kv-wait-timeout", "0"),
        ] {
            let mut a = vec!["--listen", "127.0.0.1:0"];
            a.extend_from_slice(bad);
            let e = run(&a).unwrap_err();
            assert!(e.contains(flag) && e.contains(value), "{bad:?}: {e}");
        }
        // Replica i's bootstrap server is on port + i: its run must not cross the HTTP ports'.
        let e = run(&[
            "--listen",
            "127.0.0.1:8000",
            "--count",
            "2",
            "--role",
            "prefill",
            "--pd-protocol",
            "sglang",
            "--disaggregation-bootstrap-port",
            "8001",
        ])
        .unwrap_err();
        assert!(
            e.contains("--disaggregation-bootstrap-port") && e.contains("overlap"),
            "{e}"
        );
        let h = help();
        for word in [
            "--pd-protocol",
            "--disaggregation-bootstrap-port",
            "--kv-wait-timeout",
            "bootstrap_room",
            "kvlb_replica_kv_transfer_failures_total",
        ] {
            assert!(h.contains(word), "{word}");
        }
    }

    #[test]
    fn speed_and_timing_spread() {
        let f = run(&["--listen", "127.0.0.1:0"]).unwrap();
        assert!(f.speed.is_one());
        assert_eq!(f.engine_config().timing_spread, 0.0);
        let f = run(&[
            "--listen",
            "127.0.0.1:0",
            "--count",
            "2",
            "--speed",
            "1,0.33x0.5",
            "--timing-spread=0.2",
        ])
        .unwrap();
        assert_eq!(f.speed.to_string(), "1,0.33x0.5");
        assert_eq!((f.speed.of(1).prefill, f.speed.of(1).decode), (0.33, 0.5));
        assert_eq!(f.engine_config().timing_spread, 0.2);
        // One value for every replica, and for a data-parallel replica's ranks.
        let f = run(&["--listen", "127.0.0.1:0", "--count", "3", "--speed", "0.5"]).unwrap();
        assert_eq!(f.speed.per_replica(3), vec![f.speed.of(0); 3]);
        assert!(run(&[
            "--listen",
            "127.0.0.1:0",
            "--dp-size",
            "2",
            "--speed",
            "0.5"
        ])
        .is_ok());
        for (bad, says) in [
            (&["--count", "2", "--speed", "1,1,1"][..], "--count 2"),
            (&["--speed", "1,0.5"], "--count 1"),
            (&["--speed", "0"], "0"),
            (&["--speed", "101"], "101"),
            (&["--speed", "0.5x"], "0.5x"),
        ] {
            let mut a = vec!["--listen", "127.0.0.1:0"];
            a.extend_from_slice(bad);
            let e = run(&a).unwrap_err();
            assert!(e.contains("--speed") && e.contains(says), "{bad:?}: {e}");
        }
        for bad in ["-0.1", "1.5", "nan"] {
            let e = run(&["--listen", "127.0.0.1:0", "--timing-spread", bad]).unwrap_err();
            assert!(e.contains("--timing-spread") && e.contains(bad), "{e}");
        }
        assert!(help().contains("--speed") && help().contains("--timing-spread"));
        // A bad length exits 2, as every parse error.
        let v: Vec<String> = ["--listen", "127.0.0.1:0", "--speed", "1,2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(parse(&v).unwrap_err().exit_code(), 2);
    }
}
