//! Every `kvlb serve` setting, declared once: a field of `ServeSettings` is a flag (clap,
//! `--kebab-case` of its name) and a key of the TOML file (serde, its name), its doc comment is
//! the help text and the configuration reference (docs/configuration.md, generated from it by
//! `reference_markdown`), and its type is its validation (`values`). `apply` writes a layer of
//! given settings into a `ServeConfig`: the file, then the environment, then the flags.

#![forbid(unsafe_code)]

use super::values::{
    one_or_many, Addr, AffinityTtl, Cores, DnsServer, DnsSource, Dur, DurOrOff, Fraction,
    ListenerTable, LoraAdapterSpec, OffOrPath, ProbePath, ReplicaSpec, Seconds, Secret, Size,
    SizeOrOff, Switch, UrlPath, Whole,
};
use super::{
    bad, check_admin_token, load_token_mode, ApiKeys, ConfigError, Disaggregate, L4Forwarding,
    ListenerMode, PolicyName, ServeConfig, ENV_ADMIN_TOKEN, ENV_API_KEYS, MAX_PROMPT_TOKENS,
    MIN_PROMPT_TOKENS,
};
use clap::{Args, CommandFactory, Parser};
use serde::Deserialize;

/// Flags with no file key: the file itself, an action, and the mode of the `--listen` flags
/// (the file gives each listener its mode in `[[listener]]`).
pub const FLAG_ONLY: &[&str] = &["config", "check", "mode"];

/// Most replica slots (`max_replicas`).
const MAX_SLOTS: u64 = crate::residency::MAX_REPLICAS as u64;
const MIN_PROMPT: u64 = MIN_PROMPT_TOKENS as u64;
const MAX_PROMPT: u64 = MAX_PROMPT_TOKENS as u64;

/// The load balancer: sends each request to the replica where its first token comes soonest.
#[derive(Parser, Deserialize, Default, Debug, Clone, PartialEq)]
#[command(
    name = "kvlb serve",
    disable_version_flag = true,
    args_override_self = true,
    after_long_help = "Environment: KVLB_ADMIN_TOKEN (the admin token) and KVLB_API_KEYS (client \
API keys, separated by commas) apply over the file and under the flags, so that secrets need not \
appear on a command line.\n\nSIGHUP (or POST /reload on the admin listener) rereads the \
configuration: replicas, policy, limits, timeouts and health settings change without dropping \
connections or requests; listen, workers, cores, admin, max_replicas, max_prompt_tokens and \
response_affinity_entries need a restart."
)]
#[serde(deny_unknown_fields, default)]
pub struct ServeSettings {
    /// TOML file holding these settings under their file keys; flags override it.
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<String>,

    /// Check the configuration (the file, the environment, these flags) and exit: 0 and a
    /// summary when kvlb would start with it, 2 and the error when not. Nothing is bound,
    /// resolved or contacted.
    #[arg(long)]
    #[serde(skip)]
    pub check: bool,

    /// Reread the --config file when it changes, checked this often, as SIGHUP does (a
    /// Kubernetes ConfigMap mounted as a directory, a deploy tool rewriting the file). 0 or
    /// off: only on SIGHUP or POST /reload (default: off).
    #[arg(long, value_name = "DUR")]
    pub watch_config: Option<DurOrOff>,

    /// A client listener, repeatable (e.g. 0.0.0.0:8080); port 0 picks one port, shared by
    /// all workers.
    ///
    /// In the file a list of addresses (L7); `[[listener]]` tables give each its own mode.
    /// Flags replace the file's listeners.
    #[arg(long, value_name = "ADDR")]
    #[serde(deserialize_with = "one_or_many")]
    pub listen: Vec<Addr>,

    /// Mode of the --listen addresses: l7 proxies each request; l4 routes a connection's first
    /// request, then joins the sockets (default: l7).
    #[arg(long, value_name = "l7|l4")]
    #[serde(skip)]
    pub mode: Option<ListenerMode>,

    /// How L4 connections move bytes once joined: io_uring splice, or a BPF sockmap program
    /// in the kernel (default: splice).
    #[arg(long, value_name = "splice|sockmap")]
    pub l4_forwarding: Option<L4Forwarding>,

    /// L7: response bodies with at least SIZE still to send move replica to client by splice
    /// instead of through user space (default: off).
    #[arg(long, value_name = "SIZE")]
    pub splice_responses_from: Option<SizeOrOff>,

    /// A replica, repeatable: its base URL (http://10.0.0.5:8000), with options after commas.
    #[arg(long, value_name = "URL[,OPTION=VALUE...]", long_help = super::replica_flag_help())]
    pub replica: Vec<ReplicaSpec>,

    /// Routing policy: cache_aware, round_robin, least_loaded, power_of_two, consistent_hash
    /// (bounded-load hashing of the first block) or random (default: cache_aware).
    #[arg(long, value_name = "NAME")]
    pub policy: Option<PolicyName>,

    /// Models served by prefill and decode replicas (replica option role): priced sends a
    /// request straight to a decode replica when cache_aware finds that cheaper than a prefill
    /// replica and the KV transfer (counting the stall of the sequences decoding there);
    /// always takes both legs (default: priced).
    #[arg(long, value_name = "priced|always")]
    pub disaggregate: Option<Disaggregate>,

    /// Add x-kvlb-decision to responses: matched tokens, estimates, the reason of the choice
    /// (default: false).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub explain: Option<Switch>,

    /// Worker threads, 1 to 1024 (default: one per core).
    #[arg(long, value_name = "N")]
    pub workers: Option<Whole<1, 1024>>,

    /// Cores of the workers, e.g. 0, 2-5, 0,2, among those the process may run on; worker i
    /// runs on the i-th (default: worker i on the i-th allowed core, e.g. of a container's
    /// cpuset; not pinned under a CPU quota smaller than that set).
    #[arg(long, value_name = "LIST")]
    pub cores: Option<Cores>,

    /// Admin listener: /metrics, /healthz, /replicas, /reload (default: 127.0.0.1:9100).
    #[arg(long, value_name = "ADDR")]
    pub admin: Option<Addr>,

    /// Request head limit; 431 beyond (default: 64KiB).
    #[arg(long, value_name = "SIZE")]
    pub max_header_bytes: Option<Size>,

    /// Request body limit; 413 beyond (default: 64MiB).
    #[arg(long, value_name = "SIZE")]
    pub max_body_bytes: Option<Size>,

    /// Most bytes the request bodies in flight may hold, over all workers (a worker's share:
    /// this divided among them, at least one max_body_bytes); beyond, 503 with Retry-After
    /// before the body is read, counted in kvlb_body_memory_refused_total. Bodies up to 16 KiB
    /// take none of it (default: 1GiB).
    #[arg(long, value_name = "SIZE")]
    pub max_body_memory: Option<Size>,

    /// Client connections per worker; 503 beyond (default: 65536).
    #[arg(long, value_name = "N")]
    pub max_connections: Option<Whole<1, { u64::MAX }>>,

    /// Time to receive a whole request once its first byte arrived; 408 beyond (default: 30s).
    #[arg(long, value_name = "DUR")]
    pub client_timeout: Option<Dur>,

    /// Keep-alive idle time between requests (default: 60s).
    #[arg(long, value_name = "DUR")]
    pub idle_timeout: Option<Dur>,

    /// Replica connect timeout (default: 3s).
    #[arg(long, value_name = "DUR")]
    pub connect_timeout: Option<Dur>,

    /// From sending a request to the replica's response head; 504 beyond (default: 300s).
    #[arg(long, value_name = "DUR")]
    pub upstream_timeout: Option<Dur>,

    /// How long SIGTERM waits for in-flight requests (default: 30s).
    #[arg(long, value_name = "DUR")]
    pub drain_timeout: Option<Dur>,

    /// How often each replica's GET /metrics is polled (default: 1s).
    #[arg(long, value_name = "DUR")]
    pub metrics_interval: Option<Dur>,

    /// How often kvlb asks each replica which models it serves (GET /v1/models: base models,
    /// aliases, loaded LoRA adapters), besides when it is added or healthy again; requests
    /// naming a model go only to replicas serving it. 0 or off: never asked, every replica
    /// takes any model unless its `models` option says otherwise (default: 10s).
    #[arg(long, value_name = "DUR")]
    pub models_refresh: Option<DurOrOff>,

    /// No events and no metrics from a replica this long: its residency is dropped and it is
    /// shown as stale (default: 30s).
    #[arg(long, value_name = "DUR")]
    pub telemetry_stale_after: Option<Dur>,

    /// With KV events, blocks kvlb only assumed from its own routing are dropped once this old
    /// unless events confirmed them (default: 120s).
    #[arg(long, value_name = "DUR")]
    pub routed_guess_ttl: Option<Dur>,

    /// With KV events, a routed request's blocks outlive a BlockRemoved until the replica stores
    /// them again, at most this long; 0 or off: a removal always wins (default: off).
    #[arg(long, value_name = "DUR")]
    pub routed_pending_ttl: Option<DurOrOff>,

    /// Active health check path on every replica (default: /health).
    #[arg(long, value_name = "PATH")]
    pub health_path: Option<UrlPath>,

    /// Active health check period; 0 or off: no active checks (default: 2s).
    #[arg(long, value_name = "DUR")]
    pub health_interval: Option<DurOrOff>,

    /// Active health check timeout (default: 1s).
    #[arg(long, value_name = "DUR")]
    pub health_timeout: Option<Dur>,

    /// Failed checks in a row that take a replica out (default: 2).
    #[arg(long, value_name = "N")]
    pub unhealthy_after: Option<Whole<1, 1_000_000>>,

    /// Passed checks in a row that put it back (default: 2).
    #[arg(long, value_name = "N")]
    pub healthy_after: Option<Whole<1, 1_000_000>>,

    /// Transport failures in a row (connect error, reset, timeout, immediate 503) that eject a
    /// replica for fail_timeout; 0: never (default: 3).
    #[arg(long, value_name = "N")]
    pub max_fails: Option<Whole<0, 1_000_000>>,

    /// How long an ejected replica is skipped (default: 10s).
    #[arg(long, value_name = "DUR")]
    pub fail_timeout: Option<Dur>,

    /// A replica back from ejection or newly added gets traffic gradually over this long; 0 or
    /// off: at once (default: 10s).
    #[arg(long, value_name = "DUR")]
    pub slow_start: Option<DurOrOff>,

    /// Other replicas tried after a connect failure or an immediate 503, before anything
    /// reached the client (default: 1).
    #[arg(long, value_name = "N")]
    pub retries: Option<Whole<0, 1_000_000>>,

    /// Replica slots: the most replicas at once, reloads, admin additions and DNS included
    /// (default: 64).
    #[arg(long, value_name = "N")]
    pub max_replicas: Option<Whole<1, MAX_SLOTS>>,

    /// Bearer token the admin API's changing endpoints require (default: they are disabled).
    ///
    /// Visible in ps on a command line: prefer --admin-token-file or KVLB_ADMIN_TOKEN.
    #[arg(long, value_name = "TOKEN")]
    pub admin_token: Option<Secret>,

    /// The admin token, read from FILE (e.g. a systemd credential, %d/admin_token).
    #[arg(long, value_name = "FILE")]
    pub admin_token_file: Option<String>,

    /// Replicas from DNS, repeatable: dns://NAME:PORT (A/AAAA) or dns+srv://NAME (SRV), with
    /// options after commas: interval=5s, family=ipv4, and the replica options with {host}
    /// (e.g. kv_events=tcp://{host}:5557).
    #[arg(long, value_name = "SOURCE")]
    #[serde(deserialize_with = "one_or_many")]
    pub replica_dns: Vec<DnsSource>,

    /// A LoRA adapter kvlb loads on demand, repeatable: NAME=PATH[,base=MODEL]. A request
    /// naming it while no replica has it loaded waits while kvlb loads it once (POST
    /// /v1/load_lora_adapter, vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) on the least
    /// loaded replica serving MODEL (without base: any replica whose models are known), then
    /// goes there; fixed at start.
    #[arg(long, value_name = "NAME=PATH[,base=MODEL]")]
    #[serde(deserialize_with = "one_or_many")]
    pub lora_adapter: Vec<LoraAdapterSpec>,

    /// A resolver for replica_dns, IP[:PORT], repeatable (default: those of /etc/resolv.conf).
    #[arg(long = "dns-server", value_name = "ADDR")]
    #[serde(deserialize_with = "one_or_many")]
    pub dns_servers: Vec<DnsServer>,

    /// Client API keys, one per line (# comments): requests without `Authorization: Bearer
    /// <key>` get 401, decided on the request head (no 100 Continue, no body read without a
    /// key). Also KVLB_API_KEYS in the environment (default: no check).
    #[arg(long, value_name = "FILE")]
    pub api_keys_file: Option<String>,

    /// Answered 200 by kvlb itself on the client listeners, without an API key, while it runs
    /// (draining too); off forwards the path (default: /healthz).
    #[arg(long, value_name = "PATH")]
    pub liveness_path: Option<ProbePath>,

    /// The same, 503 while draining or with no replica available (default: /readyz).
    #[arg(long, value_name = "PATH")]
    pub readiness_path: Option<ProbePath>,

    /// Requests in flight per replica; 0: no limit; a replica's own max_in_flight wins
    /// (default: 0).
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<Whole<0, 1_000_000>>,

    /// Requests that may wait while every replica is at its limit; beyond, 429 with
    /// Retry-After (default: 1024).
    #[arg(long, value_name = "N")]
    pub queue_size: Option<Whole<0, 1_000_000>>,

    /// Longest wait in that queue before 429 (default: 30s).
    #[arg(long, value_name = "DUR")]
    pub queue_timeout: Option<Dur>,

    /// Response ids (`resp_...`) whose replica kvlb remembers, so that a Responses API request
    /// continuing with `previous_response_id` reaches the replica that stored its history;
    /// 8 bytes each, sized at about twice the ids made within the TTL; 0: off (default:
    /// 1048576).
    #[arg(long, value_name = "N")]
    pub response_affinity_entries: Option<Whole<0, 268_435_456>>,

    /// How long a response id's replica is remembered (default: 1h; at most 24d).
    #[arg(long, value_name = "DUR")]
    pub response_affinity_ttl: Option<AffinityTtl>,

    /// A Hugging Face tokenizer.json: chat and text completions prompts are hashed as the
    /// engine's token ids, so blocks match its KV events. Without it, prompts are hashed over
    /// their text.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<String>,

    /// The model's tokenizer_config.json (chat_template, bos/eos) or a .jinja template
    /// (default: the one beside the tokenizer).
    #[arg(long, value_name = "PATH")]
    pub chat_template: Option<String>,

    /// One JSON line per L7 request appended to PATH, reopened on reload for log rotation; off:
    /// none (default: off).
    #[arg(long, value_name = "PATH")]
    pub access_log: Option<OffOrPath>,

    /// Prompts are read for routing up to N tokens (4 canonical bytes a token in text mode):
    /// the longest context of the fleet's models; fixed at start; text mode hashes no more
    /// than the 2,048 blocks (128k tokens) routing learns and estimates the rest (default:
    /// 1048576).
    #[arg(long, value_name = "N")]
    pub max_prompt_tokens: Option<Whole<MIN_PROMPT, MAX_PROMPT>>,

    /// File only: `[[listener]]` tables, `address = "HOST:PORT"` and `mode = "l7" | "l4"`.
    #[arg(skip)]
    pub listener: Vec<ListenerTable>,

    /// File only: client API keys as a list (prefer api_keys_file or KVLB_API_KEYS).
    #[arg(skip)]
    pub api_keys: Vec<Secret>,

    /// File only: `[[model]]` tables, the settings of one model's requests.
    #[arg(skip)]
    pub model: Vec<ModelTable>,

    /// The cost model of cache_aware: `[cost_model]` in the file.
    #[command(
        flatten,
        next_help_heading = "Cost model of cache_aware ([cost_model] in the file)"
    )]
    pub cost_model: CostSettings,
}

/// `[cost_model]`: how fast the replicas are, and two figures only the operator knows. The
/// policy's other parameters are fixed (docs/cost-model.md: what each does and the ablation
/// that fixed it).
#[derive(clap::Args, Deserialize, Default, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CostSettings {
    /// Prefill seconds per prompt token of one replica; set it when the replicas are not an 8B
    /// model on one H100: a prompt's prefill time over its tokens at low load, e.g. from
    /// vLLM's vllm:request_prefill_time_seconds (default: 0.00003).
    #[arg(long, value_name = "SECONDS")]
    pub prefill_s_per_token: Option<Seconds>,

    /// Seconds of one decode step of a small batch (a lone request's inter-token latency); set
    /// it with prefill_s_per_token, e.g. from vllm:inter_token_latency_seconds at low load
    /// (default: 0.008).
    #[arg(long, value_name = "SECONDS")]
    pub decode_step_s: Option<Seconds>,

    /// Prompt tokens a queued request another sender put on a replica stands for (seen in its
    /// /metrics); set it to the mean prompt length of that traffic when several kvlb
    /// instances or other clients share the fleet (default: 1024).
    #[arg(long, value_name = "N")]
    pub foreign_request_tokens: Option<Whole<0, { u32::MAX as u64 }>>,

    /// Loading a prefix back from an offloaded tier (CPU, disk) as a fraction of recomputing
    /// it: 0 = as good as a GPU hit, 1 = no hit; set it when replicas offload KV blocks, to
    /// the tier's load time over the prefill time of the same tokens (default: 0.25).
    #[arg(long, value_name = "F")]
    pub offload_load_cost: Option<Fraction>,

    /// Seconds a request for a LoRA adapter of lora_adapter is taken to lose when sent to a
    /// replica without it, which loads it first: the price of spreading an adapter to one
    /// more replica; the average of the loads kvlb timed is the price when larger
    /// (default: 0.5).
    #[arg(long, value_name = "SECONDS")]
    pub lora_load_s: Option<Seconds>,

    /// Seconds to move one prompt token's KV cache from a prefill replica to a decode replica
    /// (prefill/decode disaggregation): the model's KV bytes per token over the link's bytes
    /// per second, e.g. 131072 / 25e9 for an 8B model over 25 GB/s (default: 0.0000052).
    #[arg(long, value_name = "SECONDS")]
    pub kv_transfer_s_per_token: Option<Seconds>,

    /// Price each replica at the pace kvlb measures from the times to first token of the
    /// streams it sends there (its prefill, queue and decode time over what prefill_s_per_token
    /// and decode_step_s say); false prices every replica at those figures as configured.
    /// kvlb measures and shows the paces either way (/replicas, kvlb_replica_prefill_pace)
    /// (default: true).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub calibrate: Option<Switch>,
}

/// `[[model]]`: the settings of the requests naming one model (file only; `docs/models.md`).
/// A key left out takes the global setting's value.
#[derive(clap::Args, Deserialize, Default, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelTable {
    /// The model's name as requests give it, or a list of its names (vLLM's
    /// --served-model-name aliases); its LoRA adapters take the table too, unless another
    /// table names them.
    #[arg(long, value_name = "NAME")]
    #[serde(deserialize_with = "one_or_many")]
    pub name: Vec<String>,

    /// Routing policy of this model's requests (default: policy).
    #[arg(long, value_name = "NAME")]
    #[serde(default)]
    pub policy: Option<PolicyName>,

    /// Most requests in flight per replica when routing this model's requests; a replica's
    /// own max_in_flight option wins (default: max_in_flight).
    #[arg(long, value_name = "N")]
    #[serde(default)]
    pub max_in_flight: Option<Whole<0, 1_000_000>>,

    /// How long this model's replicas may take to answer (default: upstream_timeout).
    #[arg(long, value_name = "DURATION")]
    #[serde(default)]
    pub upstream_timeout: Option<Dur>,

    /// This model's replicas' speed: an inline table of [cost_model] keys, e.g.
    /// `cost_model = { prefill_s_per_token = 0.0001 }`; a key left out takes [cost_model]'s.
    #[command(flatten)]
    #[serde(default)]
    pub cost_model: CostSettings,
}

/// Settings whose key exists only in the file (`#[arg(skip)]` above): their doc, for the
/// reference. A test checks this list against the fields serde reads.
pub(super) const FILE_ONLY: &[(&str, &str)] = &[
    (
        "listener",
        "`[[listener]]` tables, `address = \"HOST:PORT\"` and `mode = \"l7\" | \"l4\"` (default l7): listeners with their own mode, beside `listen`.",
    ),
    (
        "model",
        "`[[model]]` tables: the settings of one model's requests (their keys below).",
    ),
    (
        "api_keys",
        "client API keys as a list of strings (prefer `api_keys_file` or `KVLB_API_KEYS`: a key written here is readable by whoever can read the file).",
    ),
];

/// Where a layer of settings comes from: errors name its keys as it spells them.
#[derive(Clone, Copy, PartialEq)]
enum Layer {
    File,
    Flags,
}

impl Layer {
    fn name(self, key: &str) -> String {
        match self {
            Layer::File => key.to_string(),
            Layer::Flags => format!("--{}", key.replace('_', "-")),
        }
    }
}

/// Reads a file into `path`'s settings; errors name the path, the key and the value.
fn read_file(path: &str) -> Result<ServeSettings, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("--config {path:?}: cannot read: {e}")))?;
    parse_toml(&text).map_err(|e| ConfigError(format!("{path}: {}", e.0)))
}

fn parse_toml(text: &str) -> Result<ServeSettings, ConfigError> {
    serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.message().trim_end();
        ConfigError(match path.as_str() {
            "." => format!("not valid TOML: {inner}"),
            // A value's parser wrote `"value": why`.
            _ if msg.starts_with('"') => format!("{path} = {msg}"),
            _ => format!("{path}: {msg}"),
        })
    })
}

/// Load a TOML file into `cfg` (without the checks across settings of `from_args`); errors
/// start with the file's path.
pub fn load_file(cfg: &mut ServeConfig, path: &str) -> Result<(), ConfigError> {
    read_file(path)?
        .apply(cfg, Layer::File)
        .map_err(|e| ConfigError(format!("{path}: {}", e.0)))
}

/// Apply a TOML text to `cfg` (without the checks across settings of `from_args`).
pub fn apply_toml(cfg: &mut ServeConfig, text: &str) -> Result<(), ConfigError> {
    parse_toml(text)?.apply(cfg, Layer::File)
}

fn secret(layer: Layer, key: &str, v: &str) -> Result<String, ConfigError> {
    check_admin_token(&layer.name(key), v)
}

fn read_secret_file(layer: Layer, key: &str, path: &str) -> Result<String, ConfigError> {
    let name = layer.name(key);
    std::fs::read_to_string(path).map_err(|e| bad(&name, path, &format!("cannot read: {e}")))
}

impl ServeSettings {
    /// Writes every setting this layer gives into `cfg`; lists replace the earlier layers'.
    fn apply(self, cfg: &mut ServeConfig, layer: Layer) -> Result<(), ConfigError> {
        // Every field by name: a setting added to the declaration and not applied here does not
        // compile (an unused binding is denied by the lint gate).
        let ServeSettings {
            config: _,
            check: _,
            watch_config,
            listen,
            mode,
            l4_forwarding,
            splice_responses_from,
            replica,
            policy,
            disaggregate,
            explain,
            workers,
            cores,
            admin,
            max_header_bytes,
            max_body_bytes,
            max_body_memory,
            max_connections,
            client_timeout,
            idle_timeout,
            connect_timeout,
            upstream_timeout,
            drain_timeout,
            metrics_interval,
            models_refresh,
            telemetry_stale_after,
            routed_guess_ttl,
            routed_pending_ttl,
            health_path,
            health_interval,
            health_timeout,
            unhealthy_after,
            healthy_after,
            max_fails,
            fail_timeout,
            slow_start,
            retries,
            max_replicas,
            admin_token,
            admin_token_file,
            replica_dns,
            lora_adapter,
            dns_servers,
            api_keys_file,
            liveness_path,
            readiness_path,
            max_in_flight,
            queue_size,
            queue_timeout,
            response_affinity_entries,
            response_affinity_ttl,
            tokenizer,
            chat_template,
            access_log,
            max_prompt_tokens,
            listener,
            api_keys,
            model,
            cost_model,
        } = self;
        if !listen.is_empty() || !listener.is_empty() {
            let mode = mode.unwrap_or(ListenerMode::L7);
            cfg.listen = listen.iter().map(|a| a.0).collect();
            cfg.listen_modes = vec![mode; listen.len()];
            for l in &listener {
                cfg.listen.push(l.address.0);
                cfg.listen_modes.push(l.mode.unwrap_or(ListenerMode::L7));
            }
        } else if mode.is_some() {
            return Err(ConfigError(
                "--mode applies to the --listen addresses on the command line; give --listen ADDR too (or mode = \"l4\" in a [[listener]] table)".into(),
            ));
        }
        set(&mut cfg.l4_forwarding, l4_forwarding);
        set(
            &mut cfg.splice_responses_from,
            splice_responses_from.map(|v| v.0),
        );
        if !replica.is_empty() {
            // A data-parallel replica is one replica per rank (`ReplicaConfig::ranks`).
            cfg.replicas = replica.into_iter().flat_map(|r| r.0.ranks()).collect();
        }
        set(&mut cfg.policy, policy);
        set(&mut cfg.disaggregate, disaggregate);
        set(&mut cfg.explain, explain.map(|v| v.0));
        set(&mut cfg.workers, workers.map(|v| v.0 as usize));
        if let Some(c) = cores {
            cfg.cores = Some(c.0);
        }
        set(&mut cfg.admin, admin.map(|v| v.0));
        let l = &mut cfg.limits;
        set(&mut l.max_header_bytes, max_header_bytes.map(|v| v.0));
        set(&mut l.max_body_bytes, max_body_bytes.map(|v| v.0));
        set(&mut l.max_body_memory, max_body_memory.map(|v| v.0));
        set(
            &mut l.max_connections,
            max_connections.map(|v| v.0 as usize),
        );
        let t = &mut cfg.timeouts;
        set(&mut t.client, client_timeout.map(|v| v.0));
        set(&mut t.idle, idle_timeout.map(|v| v.0));
        set(&mut t.connect, connect_timeout.map(|v| v.0));
        set(&mut t.upstream, upstream_timeout.map(|v| v.0));
        set(&mut t.drain, drain_timeout.map(|v| v.0));
        set(&mut cfg.watch_config, watch_config.map(|v| v.0));
        let t = &mut cfg.telemetry;
        set(&mut t.metrics_interval, metrics_interval.map(|v| v.0));
        set(&mut t.models_refresh, models_refresh.map(|v| v.0));
        set(&mut t.stale_after, telemetry_stale_after.map(|v| v.0));
        set(&mut t.routed_guess_ttl, routed_guess_ttl.map(|v| v.0));
        set(&mut t.routed_pending_ttl, routed_pending_ttl.map(|v| v.0));
        let h = &mut cfg.health;
        set(&mut h.path, health_path.map(|v| v.0));
        set(&mut h.interval, health_interval.map(|v| v.0));
        set(&mut h.timeout, health_timeout.map(|v| v.0));
        set(&mut h.unhealthy_after, unhealthy_after.map(|v| v.0 as u32));
        set(&mut h.healthy_after, healthy_after.map(|v| v.0 as u32));
        set(&mut h.max_fails, max_fails.map(|v| v.0 as u32));
        set(&mut h.fail_timeout, fail_timeout.map(|v| v.0));
        set(&mut h.slow_start, slow_start.map(|v| v.0));
        set(&mut h.retries, retries.map(|v| v.0 as u32));
        set(&mut cfg.max_replicas, max_replicas.map(|v| v.0 as usize));
        if let Some(path) = &admin_token_file {
            let text = read_secret_file(layer, "admin_token_file", path)?;
            cfg.admin_token = Some(
                secret(layer, "admin_token_file", text.trim())
                    .map_err(|e| ConfigError(e.0.replace("<hidden>", &format!("{path:?}"))))?,
            );
        } else if let Some(token) = &admin_token {
            cfg.admin_token = Some(secret(layer, "admin_token", &token.0)?);
            if layer == Layer::Flags {
                eprintln!("kvlb: warning: --admin-token on the command line is visible to every local user (ps, /proc); use --admin-token-file FILE or {ENV_ADMIN_TOKEN} instead");
            }
        }
        if !lora_adapter.is_empty() {
            let list: Vec<_> = lora_adapter.into_iter().map(|v| v.0).collect();
            for (i, a) in list.iter().enumerate() {
                if list[..i].iter().any(|b| b.name == a.name) {
                    return Err(bad(
                        &layer.name("lora_adapter"),
                        &a.name,
                        "listed twice (one path each)",
                    ));
                }
            }
            cfg.lora_adapters = list;
        }
        if !replica_dns.is_empty() {
            cfg.replica_dns = replica_dns.into_iter().map(|v| v.0).collect();
        }
        if !dns_servers.is_empty() {
            cfg.dns_servers = dns_servers.into_iter().map(|v| v.0).collect();
        }
        if let Some(path) = &api_keys_file {
            let key = layer.name("api_keys_file");
            let text = read_secret_file(layer, "api_keys_file", path)?;
            let lines = text.lines().map(str::trim);
            let keys =
                ApiKeys::from_list(&key, lines.filter(|l| !l.is_empty() && !l.starts_with('#')))?;
            if keys.is_empty() {
                return Err(bad(&key, path, "the file holds no key"));
            }
            cfg.api_keys = keys;
        } else if !api_keys.is_empty() {
            cfg.api_keys = ApiKeys::from_list("api_keys", api_keys.iter().map(|k| k.0.as_str()))?;
        }
        if let Some(p) = liveness_path {
            cfg.probes.liveness = p.0;
        }
        if let Some(p) = readiness_path {
            cfg.probes.readiness = p.0;
        }
        set(&mut cfg.max_in_flight, max_in_flight.map(|v| v.0 as u32));
        set(&mut cfg.queue_size, queue_size.map(|v| v.0 as u32));
        set(&mut cfg.queue_timeout, queue_timeout.map(|v| v.0));
        set(
            &mut cfg.response_affinity_entries,
            response_affinity_entries.map(|v| v.0 as usize),
        );
        set(
            &mut cfg.response_affinity_ttl,
            response_affinity_ttl.map(|v| v.0),
        );
        if let Some(p) = tokenizer {
            cfg.tokenizer = Some(p);
        }
        if let Some(p) = chat_template {
            cfg.chat_template = Some(p);
        }
        if let Some(p) = access_log {
            cfg.access_log = p.0;
        }
        set(
            &mut cfg.max_prompt_tokens,
            max_prompt_tokens.map(|v| v.0 as usize),
        );
        if !model.is_empty() {
            cfg.model_tables = model;
        }
        cost_model.apply(&mut cfg.cost_model);
        Ok(())
    }
}

impl CostSettings {
    /// Writes the figures given into `m`.
    fn apply(self, m: &mut super::CostModel) {
        let CostSettings {
            prefill_s_per_token,
            decode_step_s,
            foreign_request_tokens,
            offload_load_cost,
            lora_load_s,
            kv_transfer_s_per_token,
            calibrate,
        } = self;
        set(&mut m.prefill_s_per_token, prefill_s_per_token.map(|v| v.0));
        set(&mut m.decode_step_s, decode_step_s.map(|v| v.0));
        set(
            &mut m.foreign_request_tokens,
            foreign_request_tokens.map(|v| v.0 as u32),
        );
        set(&mut m.offload_load_cost, offload_load_cost.map(|v| v.0));
        set(&mut m.lora_load_s, lora_load_s.map(|v| v.0));
        set(
            &mut m.kv_transfer_s_per_token,
            kv_transfer_s_per_token.map(|v| v.0),
        );
        set(&mut m.calibrate, calibrate.map(|v| v.0));
    }
}

/// The `[[model]]` tables over the global settings, checked: every table names a model, no
/// name is in two tables.
fn resolve_models(cfg: &mut ServeConfig) -> Result<(), ConfigError> {
    if cfg.model_tables.len() > super::MAX_MODEL_TABLES {
        return Err(ConfigError(format!(
            "model: {} [[model]] tables; at most {} are taken",
            cfg.model_tables.len(),
            super::MAX_MODEL_TABLES
        )));
    }
    let mut models: Vec<super::ModelConfig> = Vec::with_capacity(cfg.model_tables.len());
    for (i, t) in cfg.model_tables.iter().enumerate() {
        let at = format!("model[{i}].name");
        if t.name.is_empty() {
            return Err(bad(
                &at,
                "[]",
                "a [[model]] table names its model: name = \"NAME\"",
            ));
        }
        for n in &t.name {
            if n.is_empty() || n.len() > crate::models::MODEL_BYTES {
                return Err(bad(
                    &at,
                    n,
                    &format!("a name of 1 to {} bytes", crate::models::MODEL_BYTES),
                ));
            }
            let again = models.iter().any(|m| m.names.contains(n))
                || t.name.iter().filter(|o| *o == n).count() > 1;
            if again {
                return Err(bad(
                    &at,
                    n,
                    "named by two [[model]] tables (one table per model)",
                ));
            }
        }
        let mut cost_model = cfg.cost_model.clone();
        t.cost_model.clone().apply(&mut cost_model);
        models.push(super::ModelConfig {
            names: t.name.clone(),
            policy: t.policy.unwrap_or(cfg.policy),
            cost_model,
            max_in_flight: t.max_in_flight.map_or(cfg.max_in_flight, |v| v.0 as u32),
            upstream_timeout: t.upstream_timeout.map_or(cfg.timeouts.upstream, |v| v.0),
        });
    }
    cfg.models = models;
    Ok(())
}

fn set<T>(slot: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *slot = v;
    }
}

/// Secrets from the environment: over the file, under the flags.
fn apply_env(cfg: &mut ServeConfig) -> Result<(), ConfigError> {
    if let Ok(v) = std::env::var(ENV_ADMIN_TOKEN) {
        if !v.is_empty() {
            cfg.admin_token = Some(check_admin_token(ENV_ADMIN_TOKEN, v.trim())?);
        }
    }
    if let Ok(v) = std::env::var(ENV_API_KEYS) {
        let list = v.split([',', '\n']).map(str::trim);
        let keys = ApiKeys::from_list(ENV_API_KEYS, list.filter(|k| !k.is_empty()))?;
        if !keys.is_empty() {
            cfg.api_keys = keys;
        }
    }
    Ok(())
}

/// The flags of `kvlb serve ARGS`; Err(None): help was printed.
fn parse_flags(args: &[String]) -> Result<ServeSettings, Option<ConfigError>> {
    match ServeSettings::try_parse_from(
        std::iter::once("kvlb serve".to_string()).chain(args.iter().cloned()),
    ) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => {
            print!("{}", e.render());
            Err(None)
        }
        Err(e) => {
            let text = e.render().to_string();
            let text = text.strip_prefix("error: ").unwrap_or(&text);
            Err(Some(ConfigError(text.trim_end().to_string())))
        }
    }
}

/// The flags of `kvlb serve` that act rather than configure.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Actions {
    /// The `--config` file.
    pub config: Option<String>,
    /// `--check`: validate and exit.
    pub check: bool,
}

/// What the command line asked for, over the file it names and the environment, checked
/// across settings. Err(None): --help was printed.
pub fn from_args(args: &[String]) -> Result<ServeConfig, Option<ConfigError>> {
    from_args_with_actions(args).map(|(cfg, _)| cfg)
}

/// `from_args`, and the flags that act.
pub fn from_args_with_actions(
    args: &[String],
) -> Result<(ServeConfig, Actions), Option<ConfigError>> {
    let flags = parse_flags(args)?;
    let actions = Actions {
        config: flags.config.clone(),
        check: flags.check,
    };
    let mut cfg = ServeConfig::default();
    if let Some(path) = &flags.config {
        load_file(&mut cfg, path).map_err(Some)?;
    }
    apply_env(&mut cfg).map_err(Some)?;
    flags.apply(&mut cfg, Layer::Flags).map_err(Some)?;
    validate(&mut cfg).map_err(Some)?;
    Ok((cfg, actions))
}

/// The checks across settings, and what loading them needs (tokenizer, access log).
fn validate(cfg: &mut ServeConfig) -> Result<(), ConfigError> {
    if cfg.listen.is_empty() {
        return Err(ConfigError(
            "no listener: give --listen ADDR or listen = [\"ADDR\"] in the file".into(),
        ));
    }
    if cfg.limits.max_body_memory < cfg.limits.max_body_bytes {
        return Err(ConfigError(format!(
            "max_body_memory = {}: below max_body_bytes = {}, a body of the allowed size could never be taken; raise max_body_memory or lower max_body_bytes",
            cfg.limits.max_body_memory, cfg.limits.max_body_bytes
        )));
    }
    if cfg.replicas.len() > cfg.max_replicas {
        return Err(ConfigError(format!(
            "max_replicas = {}: {} replicas are configured; raise max_replicas",
            cfg.max_replicas,
            cfg.replicas.len()
        )));
    }
    resolve_models(cfg)?;
    load_token_mode(cfg)?;
    if let Some(path) = &cfg.access_log {
        crate::access_log::open(path).map_err(|e| {
            ConfigError(format!(
                "access_log = {path:?}: cannot open it for appending: {e}"
            ))
        })?;
    }
    let mut urls: Vec<&str> = cfg
        .replicas
        .iter()
        .map(|r| r.url.trim_end_matches('/'))
        .collect();
    urls.sort_unstable();
    if let Some(w) = urls.windows(2).find(|w| w[0] == w[1]) {
        return Err(ConfigError(format!("replica = {:?}: listed twice", w[0])));
    }
    // The ranks of one dp_size replica share its URL; the URL listed again is the same engine.
    for (i, r) in cfg.replicas.iter().enumerate() {
        let again = cfg.replicas[..i].iter().any(|o| {
            o.base_url() == r.base_url()
                && (o.dp_rank.is_none()
                    || r.dp_rank.is_none()
                    || o.dp_size != r.dp_size
                    || o.dp_rank == r.dp_rank)
        });
        if again {
            return Err(ConfigError(format!(
                "replica = {:?}: listed twice (a data-parallel engine is one replica with dp_size=N)",
                r.base_url()
            )));
        }
    }
    Ok(())
}

/// The configuration reference (docs/configuration.md, between its generated markers): one
/// row per setting, from the declaration above.
pub fn reference_markdown() -> String {
    let cost: Vec<String> = CostSettings::augment_args(clap::Command::new("cost"))
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    let skipped = FLAG_ONLY;
    let mut out = String::from("| flag | file key | what it does |\n|---|---|---|\n");
    let cmd = ServeSettings::command();
    for a in cmd.get_arguments() {
        let id = a.get_id().as_str();
        let Some(long) = a.get_long() else { continue };
        if long == "help" {
            continue;
        }
        let value = a
            .get_value_names()
            .map(|v| format!(" {}", v[0]))
            .unwrap_or_default();
        let value = if a.get_num_args().is_some_and(|n| n.min_values() == 0) {
            format!("[={}]", value.trim())
        } else {
            value
        };
        let key = if skipped.contains(&id) {
            "(flag only)".to_string()
        } else if cost.iter().any(|c| c == id) {
            format!("`[cost_model]` `{id}`")
        } else {
            format!("`{id}`")
        };
        let help = a
            .get_long_help()
            .or(a.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let flag = format!("--{long}{value}").replace('|', "\\|");
        out.push_str(&format!("| `{flag}` | {key} | {} |\n", one_line(&help)));
    }
    for o in super::REPLICA_OPTIONS {
        let flag = format!("--replica URL,{}={}", o.name, o.value).replace('|', "\\|");
        out.push_str(&format!(
            "| `{flag}` | `[[replica]]` `{}` | {} |\n",
            o.name,
            one_line(o.doc)
        ));
    }
    for (key, doc) in FILE_ONLY {
        out.push_str(&format!("| (file only) | `{key}` | {doc} |\n"));
    }
    for a in ModelTable::augment_args(clap::Command::new("model")).get_arguments() {
        let id = a.get_id().as_str();
        let (key, help) = match cost.iter().any(|c| c == id) {
            true => (
                format!("`[[model]]` `cost_model.{id}`"),
                format!(
                    "`[cost_model]` `{id}` for this model's replicas (default: `[cost_model]`'s)"
                ),
            ),
            false => (
                format!("`[[model]]` `{id}`"),
                a.get_long_help()
                    .or(a.get_help())
                    .map(|h| h.to_string())
                    .unwrap_or_default(),
            ),
        };
        out.push_str(&format!("| (file only) | {key} | {} |\n", one_line(&help)));
    }
    out.push_str(&format!(
        "| (environment) | `{ENV_ADMIN_TOKEN}` | the admin token, over the file and under the flags |\n| (environment) | `{ENV_API_KEYS}` | client API keys separated by commas, over the file and under the flags |\n"
    ));
    out
}

fn one_line(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// The field names serde reads for `T` (the file's keys), for the tests.
#[cfg(test)]
pub(super) fn serde_fields<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    use serde::de::{self, Visitor};
    struct Capture(std::cell::Cell<&'static [&'static str]>);
    #[derive(Debug)]
    struct Stop;
    impl std::fmt::Display for Stop {
        fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("stop")
        }
    }
    impl std::error::Error for Stop {}
    impl de::Error for Stop {
        fn custom<M: std::fmt::Display>(_: M) -> Stop {
            Stop
        }
    }
    impl<'de> de::Deserializer<'de> for &Capture {
        type Error = Stop;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            self.0.set(fields);
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let c = Capture(std::cell::Cell::new(&[]));
    let _ = T::deserialize(&c);
    c.0.get()
}
