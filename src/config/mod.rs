//! `kvlb serve` configuration: a TOML file, the environment and command-line flags (in that
//! order, the later winning), declared once in `settings::ServeSettings` and validated into one
//! `ServeConfig`. Every error names the key (or flag) and the bad value; exit status 2.

#![forbid(unsafe_code)]

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

pub mod settings;
mod values;

pub use settings::{
    apply_toml, from_args, from_args_with_actions, load_file, reference_markdown, Actions,
    ServeSettings,
};
pub use values::{parse_replica_flag, replica_flag_help, ReplicaOption, REPLICA_OPTIONS};

/// The policy names live with the policies (`select`), which config builds.
pub use crate::select::PolicyName;

#[cfg(test)]
mod tests;

/// How a listener treats its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerMode {
    /// HTTP/1.1 proxying: every request is routed on its own (see `crate::proxy`).
    L7,
    /// The first request is routed, then client and replica sockets are joined for the
    /// connection's life (see `crate::l4`).
    L4,
}

impl ListenerMode {
    pub fn parse(key: &str, v: &str) -> Result<ListenerMode, ConfigError> {
        match v {
            "l7" | "L7" => Ok(ListenerMode::L7),
            "l4" | "L4" => Ok(ListenerMode::L4),
            _ => Err(bad(
                key,
                v,
                "expected l7 (HTTP proxying) or l4 (joined sockets)",
            )),
        }
    }
}

/// Whether a request that may be disaggregated (`Role`) always is (`serve --disaggregate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disaggregate {
    /// cache_aware prices a prefill replica and the transfer against a decode replica
    /// computing the prompt itself.
    Priced,
    /// Every such request takes both legs.
    Always,
}

impl Disaggregate {
    pub fn parse(key: &str, v: &str) -> Result<Disaggregate, ConfigError> {
        match v {
            "priced" => Ok(Disaggregate::Priced),
            "always" => Ok(Disaggregate::Always),
            _ => Err(bad(key, v, "expected priced or always")),
        }
    }
}

/// How an L4 connection's bytes move between client and replica once joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L4Forwarding {
    /// io_uring splice through a per-worker pipe pool.
    Splice,
    /// A BPF sockmap stream verdict program redirects bytes inside the kernel.
    Sockmap,
}

impl L4Forwarding {
    pub fn parse(key: &str, v: &str) -> Result<L4Forwarding, ConfigError> {
        match v {
            "splice" => Ok(L4Forwarding::Splice),
            "sockmap" => Ok(L4Forwarding::Sockmap),
            _ => Err(bad(key, v, "expected splice or sockmap")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            L4Forwarding::Splice => "splice",
            L4Forwarding::Sockmap => "sockmap",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaConfig {
    /// The URL as configured (echoed in `x-kvlb-replica`).
    pub url: String,
    pub addr: SocketAddr,
    /// host[:port] for a Host header when the client sent none.
    pub authority: String,
    /// KV cache capacity in tokens: bounds what kvlb assumes resident there.
    pub kv_capacity_tokens: u64,
    /// Capacity of the replica's offloaded KV tier (CPU memory, disk, LMCache: blocks its KV
    /// events store with a medium other than GPU), in tokens. None: 8x `kv_capacity_tokens`
    /// (`offload_capacity_tokens`).
    pub kv_offload_capacity_tokens: Option<u64>,
    /// The replica's KV event PUB endpoint (`tcp://HOST:PORT`): kvlb subscribes to it.
    pub kv_events: Option<String>,
    /// The replica's KV event replay ROUTER endpoint (`tcp://HOST:PORT`), used after a gap.
    pub kv_replay: Option<String>,
    /// Poll the replica's GET /metrics: Some(on/off) as configured; None = only when it has
    /// `kv_events` (a real engine; plain HTTP backends need not serve /metrics).
    pub metrics: Option<bool>,
    /// Most requests in flight there (None: the global `max_in_flight`).
    pub max_in_flight: Option<u32>,
    /// Data-parallel ranks behind the URL (`dp_size`, 1: none). `ranks` expands a replica
    /// of N ranks into N, one per rank; the fleet holds those.
    pub dp_size: u32,
    /// This rank of a data-parallel engine (Some only after `ranks`, with `dp_size` > 1):
    /// requests carry `X-Data-Parallel-Rank: r`, events come from the ports + r, and the
    /// name (`url`) is the URL with `#r`.
    pub dp_rank: Option<u32>,
    /// The model names it serves, as configured (None: asked of the replica, `GET /v1/models`;
    /// see `crate::models`).
    pub models: Option<Vec<String>>,
    /// What it does in a prefill/decode disaggregated fleet (`crate::proxy::pd`).
    pub role: Role,
    /// A prefill replica's SGLang bootstrap server port: it speaks SGLang's protocol (None:
    /// vLLM's).
    pub bootstrap_port: Option<u16>,
}

pub use kvlb_core::pd::Role;

/// A LoRA adapter kvlb loads on a replica when a request names it and no replica has it
/// (`lora_adapter`; see `crate::model_watch`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    pub name: String,
    /// What the replica loads it from (`lora_path` of vLLM's `/v1/load_lora_adapter`).
    pub path: String,
    /// The base model it applies to: replicas serving it may load it (None: any replica
    /// whose models are known).
    pub base: Option<String>,
}

/// Most data-parallel ranks of one replica (`dp_size`).
pub const MAX_DP_SIZE: u64 = 64;

/// `tcp://HOST:PORT` with the port moved up by `by`, as engines offset a data-parallel rank's
/// event endpoints (vLLM and SGLang `offset_endpoint_port`); None past port 65535.
pub fn offset_port(endpoint: &str, by: u32) -> Option<String> {
    let (base, port) = endpoint.rsplit_once(':')?;
    let port = port.parse::<u32>().ok()? + by;
    (port <= 65535).then(|| format!("{base}:{port}"))
}

impl ReplicaConfig {
    /// The URL without a rank (`#r`): what the replica's ranks share.
    pub fn base_url(&self) -> &str {
        let url = self.url.split('#').next().unwrap_or(&self.url);
        url.trim_end_matches('/')
    }

    /// One replica per data-parallel rank (itself alone without `dp_size`): rank r named
    /// `URL#r`, its events at `kv_events` port + r and `kv_replay` port + r; capacity and the
    /// in-flight limit are each rank's.
    pub fn ranks(self) -> Vec<ReplicaConfig> {
        if self.dp_size <= 1 {
            return vec![self];
        }
        let base = self.base_url().to_string();
        (0..self.dp_size)
            .map(|r| {
                // Checked at parse time (`check_dp_size`): every rank's ports exist.
                let offset = |e: &Option<String>| {
                    e.as_deref()
                        .map(|e| offset_port(e, r).unwrap_or_else(|| e.to_string()))
                };
                ReplicaConfig {
                    url: format!("{base}#{r}"),
                    kv_events: offset(&self.kv_events),
                    kv_replay: offset(&self.kv_replay),
                    dp_rank: Some(r),
                    ..self.clone()
                }
            })
            .collect()
    }

    /// Whether kvlb polls this replica's /metrics.
    pub fn scrape_metrics(&self) -> bool {
        self.metrics.unwrap_or(self.kv_events.is_some())
    }

    /// Tokens kvlb assumes the replica's offloaded tier holds at most: as configured, else
    /// `DEFAULT_OFFLOAD_CAPACITY_FACTOR` times its GPU capacity.
    pub fn offload_capacity_tokens(&self) -> u64 {
        self.kv_offload_capacity_tokens.unwrap_or(
            self.kv_capacity_tokens
                .saturating_mul(DEFAULT_OFFLOAD_CAPACITY_FACTOR),
        )
    }
}

fn parse_switch(key: &str, v: &str) -> Result<bool, ConfigError> {
    match v {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(bad(key, v, "expected true or false")),
    }
}

/// Replica telemetry (see `crate::telemetry`): metrics scraping and KV event freshness.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// How often each replica's GET /metrics is polled.
    pub metrics_interval: Duration,
    /// How often each replica's GET /v1/models is asked (zero: never; see `crate::models`).
    pub models_refresh: Duration,
    /// No events and no metrics for this long: the replica's residency is dropped and it is
    /// shown as stale.
    pub stale_after: Duration,
    /// On replicas with live KV events, blocks kvlb only assumed from its own routing are
    /// dropped once this old unless events confirmed them. Events confirm token-id prompts
    /// only (chat and text prompts are hashed over their text until a tokenizer is
    /// configured), so the default is long enough for a conversation's next turns.
    pub routed_guess_ttl: Duration,
    /// Blocks of a request routed to a replica stay believed there through a BlockRemoved
    /// until the replica stores them again (the queued request recomputes them), for at most
    /// this long after kvlb last touched them. Zero (the default) turns the rule off: a
    /// removal always overrides what routing assumed.
    pub routed_pending_ttl: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> TelemetryConfig {
        TelemetryConfig {
            metrics_interval: Duration::from_secs(1),
            models_refresh: Duration::from_secs(10),
            stale_after: Duration::from_secs(30),
            routed_guess_ttl: crate::residency::DEFAULT_ROUTED_GUESS_TTL,
            routed_pending_ttl: Duration::ZERO,
        }
    }
}

/// `tcp://HOST:PORT` for a replica's KV event sockets (only TCP; any host, port 1..=65535).
pub fn parse_zmq_endpoint(key: &str, v: &str) -> Result<String, ConfigError> {
    let rest = v
        .strip_prefix("tcp://")
        .ok_or_else(|| bad(key, v, "expected tcp://HOST:PORT, e.g. tcp://10.0.0.5:5557"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad(key, v, "expected tcp://HOST:PORT (no port given)"))?;
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
        }
    };
    if !host_ok {
        return Err(bad(
            key,
            v,
            "invalid host (a name, an IPv4 address or [IPv6])",
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(v.to_string()),
        _ => Err(bad(key, v, "invalid port (1..=65535)")),
    }
}

/// Default KV capacity of a replica: an 8B model on one 80 GB GPU (about 400k tokens).
pub const DEFAULT_KV_CAPACITY_TOKENS: u64 = 400_000;

/// Default capacity of a replica's offloaded KV tier, in multiples of its GPU capacity: large
/// enough that kvlb never evicts what the engine still reports (host memory and disk tiers are
/// usually several times the GPU's KV cache); the engine's own BlockRemoved events do the rest.
pub const DEFAULT_OFFLOAD_CAPACITY_FACTOR: u64 = 8;

/// What an operator sets of `cache_aware`'s cost model (see `estimate` and
/// `select::cache_aware`); docs/cost-model.md says why the policy's other parameters are fixed.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// Prefill seconds per prompt token; the model's fixed and quadratic prefill terms scale
    /// with it.
    pub prefill_s_per_token: f64,
    /// Seconds of one decode step of a small batch; the per-sequence and per-context-token
    /// decode terms scale with it.
    pub decode_step_s: f64,
    /// Prompt tokens a queued request this kvlb did not send stands for (scraped `waiting`).
    pub foreign_request_tokens: u32,
    /// Loading a prefix back from an offloaded tier (CPU, disk) costs this fraction of
    /// recomputing it (0..=1).
    pub offload_load_cost: f64,
    /// Seconds a request for an adapter kvlb loads on demand loses on a replica without it
    /// (at least; the loads kvlb timed, when longer).
    pub lora_load_s: f64,
    /// Seconds to move one prompt token's KV cache from a prefill to a decode replica.
    pub kv_transfer_s_per_token: f64,
    /// Price replicas at their measured pace (`estimate::calibrate`).
    pub calibrate: bool,
}

impl Default for CostModel {
    fn default() -> CostModel {
        let p = crate::select::CacheAwareConfig::default();
        CostModel {
            prefill_s_per_token: p.model.prefill.b,
            decode_step_s: p.model.decode.base,
            foreign_request_tokens: p.foreign_request_tokens,
            offload_load_cost: p.offload_load_cost,
            lora_load_s: 0.5,
            kv_transfer_s_per_token: p.kv_transfer_s_per_token,
            calibrate: p.calibrated,
        }
    }
}

impl CostModel {
    /// The policy configuration these settings describe: the policy's defaults with the
    /// replicas' speed and the two figures above.
    pub fn policy_config(&self) -> crate::select::CacheAwareConfig {
        let p = crate::select::CacheAwareConfig::default();
        crate::select::CacheAwareConfig {
            model: p.model.scaled(self.prefill_s_per_token, self.decode_step_s),
            foreign_request_tokens: self.foreign_request_tokens,
            offload_load_cost: self.offload_load_cost,
            kv_transfer_s_per_token: self.kv_transfer_s_per_token,
            calibrated: self.calibrate,
            ..p
        }
    }

    /// Seconds to move the KV of `tokens` prompt tokens from a prefill to a decode replica.
    pub fn kv_transfer_s(&self, tokens: u32) -> f64 {
        tokens as f64 * self.kv_transfer_s_per_token
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub max_header_bytes: usize,
    pub max_body_bytes: usize,
    /// Most bytes the request bodies being received and forwarded may hold, over all workers
    /// (a worker's share: this divided among them, at least one `max_body_bytes`). Beyond,
    /// 503 with Retry-After before the body is read.
    pub max_body_memory: usize,
    /// Client connections per worker.
    pub max_connections: usize,
}

/// Paths kvlb answers itself on its client listeners, without an API key: probes for
/// Kubernetes and load balancers in front of kvlb. None: off (the path is forwarded).
#[derive(Debug, Clone, PartialEq)]
pub struct ProbePaths {
    /// 200 while kvlb serves (draining included: a liveness probe must not restart it then).
    pub liveness: Option<String>,
    /// 200 while kvlb takes new requests and some replica is available; 503 otherwise.
    pub readiness: Option<String>,
}

impl Default for ProbePaths {
    fn default() -> ProbePaths {
        ProbePaths {
            liveness: Some("/healthz".into()),
            readiness: Some("/readyz".into()),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Timeouts {
    /// To receive a whole request once its first byte arrived (408 after).
    pub client: Duration,
    /// Keep-alive idle time between requests.
    pub idle: Duration,
    pub connect: Duration,
    /// From sending a request to the replica's response head (504 after).
    pub upstream: Duration,
    /// How long SIGTERM waits for in-flight requests.
    pub drain: Duration,
}

/// Replica health: active checks, passive ejection, slow start (see `crate::fleet`).
#[derive(Debug, Clone, PartialEq)]
pub struct HealthConfig {
    /// GET this path on every replica each `interval` (zero interval: no active checks).
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    /// Failed checks in a row before a replica is taken out.
    pub unhealthy_after: u32,
    /// Passed checks in a row before it is put back.
    pub healthy_after: u32,
    /// Transport failures in a row (connect error, reset, timeout, immediate 503) that eject a
    /// replica for `fail_timeout` (0: never eject).
    pub max_fails: u32,
    pub fail_timeout: Duration,
    /// A replica back from ejection or newly added gets traffic gradually over this long.
    pub slow_start: Duration,
    /// Other replicas a request may be retried on when it failed at connect time or got an
    /// immediate 503, before anything reached the client.
    pub retries: u32,
}

impl Default for HealthConfig {
    fn default() -> HealthConfig {
        HealthConfig {
            path: "/health".into(),
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            unhealthy_after: 2,
            healthy_after: 2,
            max_fails: 3,
            fail_timeout: Duration::from_secs(10),
            slow_start: Duration::from_secs(10),
            retries: 1,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServeConfig {
    pub listen: Vec<SocketAddr>,
    /// The mode of each address in `listen` (same order); missing entries are L7.
    pub listen_modes: Vec<ListenerMode>,
    /// How L4 listeners forward once a connection is joined.
    pub l4_forwarding: L4Forwarding,
    /// Prefill/decode disaggregation: priced or always (`proxy::pd`).
    pub disaggregate: Disaggregate,
    /// L7: a response body of known length with at least this many bytes still to come moves
    /// replica -> client by io_uring splice through a pipe instead of through user space
    /// (0, the default: never; docs/benchmarks/l4.md has the measurements behind that default).
    pub splice_responses_from: usize,
    pub replicas: Vec<ReplicaConfig>,
    pub policy: PolicyName,
    pub workers: usize,
    /// Core of each worker (worker i runs on cores[i % len]); None = worker i on core i.
    pub cores: Option<Vec<usize>>,
    pub admin: SocketAddr,
    pub limits: Limits,
    pub timeouts: Timeouts,
    /// Add `x-kvlb-decision` to responses.
    pub explain: bool,
    /// Reread the config file when it changes, checked this often (zero: never).
    pub watch_config: Duration,
    pub cost_model: CostModel,
    pub telemetry: TelemetryConfig,
    pub health: HealthConfig,
    /// Replica slots (the most replicas the fleet can hold at once, reloads included).
    pub max_replicas: usize,
    /// Bearer token the admin API's changing endpoints require (None: they are disabled).
    pub admin_token: Option<String>,
    /// DNS sources of replicas (`dns://NAME:PORT`, `dns+srv://NAME`; see `crate::discovery`),
    /// re-resolved on their interval beside the static list.
    pub replica_dns: Vec<String>,
    /// LoRA adapters loaded on demand (fixed at start).
    pub lora_adapters: Vec<LoraAdapter>,
    /// Resolvers for them (`IP[:PORT]`); empty: those of /etc/resolv.conf.
    pub dns_servers: Vec<String>,
    /// Clients must send `Authorization: Bearer <one of these>` (empty: no check).
    pub api_keys: ApiKeys,
    /// kvlb's own probe paths on the client listeners (no API key needed).
    pub probes: ProbePaths,
    /// Most requests in flight per replica (0: no limit; a replica's own `max_in_flight` wins).
    pub max_in_flight: u32,
    /// Requests that may wait (across workers) while every replica is at its limit; beyond,
    /// 429 with Retry-After.
    pub queue_size: u32,
    /// How long one may wait before 429.
    pub queue_timeout: Duration,
    /// Response ids remembered for conversation affinity (0: off).
    pub response_affinity_entries: usize,
    /// How long a response id's replica is remembered.
    pub response_affinity_ttl: Duration,
    /// `tokenizer = PATH`: a Hugging Face tokenizer.json; chat and text completions requests
    /// are then hashed in token mode (see `crate::tokenize`).
    pub tokenizer: Option<String>,
    /// `chat_template = PATH`: tokenizer_config.json (or a .jinja template); default: the one
    /// beside the tokenizer.
    pub chat_template: Option<String>,
    /// Both, loaded (set when `tokenizer` is).
    pub token_mode: Option<crate::tokenize::SharedTokenizer>,
    /// `access_log = PATH`: one JSON line per request (see `crate::access_log`); None: off.
    pub access_log: Option<String>,
    /// The longest prompt read for routing, in tokens (see `crate::prompt::PromptLimits`).
    pub max_prompt_tokens: usize,
    /// `[[model]]` tables: settings of one model's requests, table `t` of a `ModelClass` at
    /// `models[t - 1]` (see `crate::models`).
    pub models: Vec<ModelConfig>,
    /// The tables as the file gave them (resolved into `models` over the global settings).
    pub(crate) model_tables: Vec<settings::ModelTable>,
}

/// Most `[[model]]` tables.
pub const MAX_MODEL_TABLES: usize = 64;

/// One `[[model]]` table, its unset keys filled from the global settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The names requests give the model (its adapters take the table too).
    pub names: Vec<String>,
    pub policy: PolicyName,
    pub cost_model: CostModel,
    /// Most requests in flight per replica, as `max_in_flight` (0: no limit; a replica's own
    /// `max_in_flight` wins).
    pub max_in_flight: u32,
    pub upstream_timeout: Duration,
}

impl ServeConfig {
    /// The settings of table `table` (a `ModelClass`'s; 0 or a table gone since: none).
    #[inline]
    pub fn model(&self, table: u16) -> Option<&ModelConfig> {
        (table as usize)
            .checked_sub(1)
            .and_then(|t| self.models.get(t))
    }

    /// The routing policy of a request of `table`.
    pub fn model_policy(&self, table: u16) -> crate::select::PolicyName {
        self.model(table).map_or(self.policy, |m| m.policy)
    }

    /// Most requests in flight per replica for a request of `table`, unless the replica
    /// sets its own.
    #[inline]
    pub fn max_in_flight_of(&self, table: u16) -> u32 {
        self.model(table)
            .map_or(self.max_in_flight, |m| m.max_in_flight)
    }

    /// The cost model of a request of `table`.
    #[inline]
    pub fn cost_model_of(&self, table: u16) -> &CostModel {
        self.model(table)
            .map_or(&self.cost_model, |m| &m.cost_model)
    }

    /// The response timeout of a request of `table`.
    #[inline]
    pub fn upstream_timeout_of(&self, table: u16) -> Duration {
        self.model(table)
            .map_or(self.timeouts.upstream, |m| m.upstream_timeout)
    }
}

/// Client API keys, compared without early exit.
#[derive(Clone, PartialEq, Default)]
pub struct ApiKeys {
    keys: Vec<Vec<u8>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.keys.len())
    }
}

impl ApiKeys {
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether `given` is one of the keys (time independent of where a key first differs).
    pub fn accepts(&self, given: &[u8]) -> bool {
        let mut ok = false;
        for k in &self.keys {
            let same = k.len() == given.len()
                && k.iter().zip(given).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
            ok |= same;
        }
        ok
    }

    /// The keys of `list` (each checked; errors name `key`, never the key itself).
    fn from_list<'a>(
        key: &str,
        list: impl IntoIterator<Item = &'a str>,
    ) -> Result<ApiKeys, ConfigError> {
        let mut keys = ApiKeys::default();
        for k in list {
            keys.add(key, k)?;
        }
        Ok(keys)
    }

    fn add(&mut self, key: &str, v: &str) -> Result<(), ConfigError> {
        if v.len() < 8 || v.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(bad(
                key,
                "<hidden>",
                "an API key must be at least 8 printable characters without spaces",
            ));
        }
        self.keys.push(v.as_bytes().to_vec());
        Ok(())
    }
}

/// A configuration error: printed as `kvlb: invalid configuration: {0}`, exit status 2.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `key = "value": why`; with an empty key just `why` (a flag's or a file key's parser, whose
/// caller names the key and shows the value).
fn bad(key: &str, value: &str, why: &str) -> ConfigError {
    match key.trim() {
        "" => ConfigError(why.to_string()),
        key => ConfigError(format!("{key} = {value:?}: {why}")),
    }
}

pub fn parse_addr(key: &str, v: &str) -> Result<SocketAddr, ConfigError> {
    if let Ok(a) = v.parse::<SocketAddr>() {
        return Ok(a);
    }
    match v.to_socket_addrs() {
        Ok(mut it) => it
            .next()
            .ok_or_else(|| bad(key, v, "resolves to no address")),
        Err(_) => Err(bad(key, v, "expected HOST:PORT, e.g. 127.0.0.1:8080")),
    }
}

/// `http://host:port[/]` -> replica.
pub fn parse_replica_url(key: &str, url: &str) -> Result<ReplicaConfig, ConfigError> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        bad(
            key,
            url,
            "expected an http:// URL such as http://10.0.0.5:8000",
        )
    })?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') || authority.contains('@') {
        return Err(bad(key, url, "expected http://HOST:PORT with no path"));
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| bad(key, url, "unterminated IPv6 literal"))?;
        let port = match after.strip_prefix(':') {
            Some(p) => p
                .parse::<u16>()
                .map_err(|_| bad(key, url, "invalid port"))?,
            None if after.is_empty() => 80,
            None => return Err(bad(key, url, "expected http://[IPV6]:PORT")),
        };
        (h, port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (
                h,
                p.parse::<u16>()
                    .map_err(|_| bad(key, url, "invalid port"))?,
            ),
            None => (authority, 80),
        }
    };
    if host.is_empty()
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b':' || b == b'_')
    {
        return Err(bad(key, url, "invalid host"));
    }
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(|e| bad(key, url, &format!("cannot resolve host: {e}")))?
        .next()
        .ok_or_else(|| bad(key, url, "host resolves to no address"))?;
    Ok(ReplicaConfig {
        url: url.to_string(),
        addr,
        authority: authority.to_string(),
        kv_capacity_tokens: DEFAULT_KV_CAPACITY_TOKENS,
        kv_offload_capacity_tokens: None,
        kv_events: None,
        kv_replay: None,
        metrics: None,
        max_in_flight: None,
        dp_size: 1,
        dp_rank: None,
        models: None,
        role: Role::Both,
        bootstrap_port: None,
    })
}

/// A bootstrap server is a prefill replica's (SGLang's decode replicas fetch from it).
fn check_bootstrap_port(key: &str, r: &ReplicaConfig) -> Result<(), ConfigError> {
    match (r.bootstrap_port, r.role) {
        (Some(p), Role::Both | Role::Decode) => Err(bad(
            &format!("{key} bootstrap_port"),
            &p.to_string(),
            "only a replica of role=prefill has a bootstrap server",
        )),
        _ => Ok(()),
    }
}

fn check_replay(key: &str, r: &ReplicaConfig) -> Result<(), ConfigError> {
    match (&r.kv_replay, &r.kv_events) {
        (Some(replay), None) => Err(bad(
            &format!("{key} kv_replay"),
            replay,
            "needs kv_events too (replay only fills gaps in the event stream)",
        )),
        _ => Ok(()),
    }
}

/// With `dp_size` N, rank N-1's event ports (kv_events and kv_replay port + N-1) must exist.
fn check_dp_size(key: &str, r: &ReplicaConfig) -> Result<(), ConfigError> {
    let last = r.dp_size.saturating_sub(1);
    for (name, e) in [("kv_events", &r.kv_events), ("kv_replay", &r.kv_replay)] {
        if let Some(e) = e {
            if offset_port(e, last).is_none() {
                return Err(bad(
                    &format!("{key} dp_size"),
                    &r.dp_size.to_string(),
                    &format!(
                        "rank {last} would publish on {name} port + {last}, past 65535 ({e}); lower {name}'s port"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// `0`, `2-5`, `0,2`, `0-1,4` -> core ids.
pub fn parse_cores(key: &str, v: &str) -> Result<Vec<usize>, ConfigError> {
    let mut out = Vec::new();
    for part in v.split(',') {
        let part = part.trim();
        let err = || bad(key, v, "expected a core list such as 0, 2-5 or 0,2");
        if let Some((a, b)) = part.split_once('-') {
            let a: usize = a.trim().parse().map_err(|_| err())?;
            let b: usize = b.trim().parse().map_err(|_| err())?;
            if a > b || b > 4095 {
                return Err(err());
            }
            out.extend(a..=b);
        } else {
            let c: usize = part.parse().map_err(|_| err())?;
            if c > 4095 {
                return Err(err());
            }
            out.push(c);
        }
    }
    if out.is_empty() {
        return Err(bad(key, v, "empty core list"));
    }
    let allowed = allowed_cores();
    if !allowed.is_empty() {
        if let Some(c) = out.iter().find(|c| !allowed.contains(c)) {
            let list: Vec<String> = allowed.iter().map(|c| c.to_string()).collect();
            return Err(bad(
                key,
                v,
                &format!(
                    "core {c} is not one this process may run on ({})",
                    list.join(",")
                ),
            ));
        }
    }
    Ok(out)
}

/// The CPUs this process may run on (its affinity: a container's cpuset), by id; empty when
/// the system does not say.
pub fn allowed_cores() -> Vec<usize> {
    core_affinity::get_core_ids()
        .map(|ids| ids.into_iter().map(|c| c.id).collect())
        .unwrap_or_default()
}

/// `10s`, `500ms`, `2m`, `1h`, or a bare number of seconds.
pub fn parse_duration(key: &str, v: &str) -> Result<Duration, ConfigError> {
    let v = v.trim();
    let err = || bad(key, v, "expected a duration such as 500ms, 10s or 2m");
    let (num, unit) = match v.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => (&v[..i], &v[i..]),
        None => (v, "s"),
    };
    let n: f64 = num.parse().map_err(|_| err())?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(err()),
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 7.0 * 86400.0 {
        return Err(err());
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A duration where zero (`0`, `0s`, `off`) means "disabled".
fn parse_duration_or_off(key: &str, v: &str) -> Result<Duration, ConfigError> {
    let t = v.trim();
    if t == "off"
        || t.trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse::<f64>()
            == Ok(0.0)
    {
        return Ok(Duration::ZERO);
    }
    parse_duration(key, v).map_err(|_| {
        bad(
            key,
            v,
            "expected a duration such as 500ms, 10s or 2m, or 0 / off",
        )
    })
}

/// `64KiB`, `8MiB`, `1048576`.
pub fn parse_size(key: &str, v: &str) -> Result<usize, ConfigError> {
    let v = v.trim();
    let err = || bad(key, v, "expected a size such as 65536, 64KiB or 8MiB");
    let (num, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => (&v[..i], v[i..].trim()),
        None => (v, ""),
    };
    let n: usize = num.parse().map_err(|_| err())?;
    let mul = match unit {
        "" | "B" => 1,
        "KiB" | "K" | "k" | "KB" => 1024,
        "MiB" | "M" | "MB" => 1024 * 1024,
        "GiB" | "G" | "GB" => 1024 * 1024 * 1024,
        _ => return Err(err()),
    };
    n.checked_mul(mul).filter(|n| *n > 0).ok_or_else(err)
}

impl ServeConfig {
    /// The mode of listener `i` (the index into `listen`).
    pub fn listener_mode(&self, i: usize) -> ListenerMode {
        self.listen_modes
            .get(i)
            .copied()
            .unwrap_or(ListenerMode::L7)
    }
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: Vec::new(),
            listen_modes: Vec::new(),
            l4_forwarding: L4Forwarding::Splice,
            disaggregate: Disaggregate::Priced,
            splice_responses_from: 0,
            replicas: Vec::new(),
            policy: PolicyName::CacheAware,
            workers: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cores: None,
            admin: "127.0.0.1:9100".parse().unwrap(),
            limits: Limits {
                max_header_bytes: 64 * 1024,
                max_body_bytes: 64 * 1024 * 1024,
                max_body_memory: 1024 * 1024 * 1024,
                max_connections: 65536,
            },
            timeouts: Timeouts {
                client: Duration::from_secs(30),
                idle: Duration::from_secs(60),
                connect: Duration::from_secs(3),
                upstream: Duration::from_secs(300),
                drain: Duration::from_secs(30),
            },
            explain: false,
            watch_config: Duration::ZERO,
            cost_model: CostModel::default(),
            telemetry: TelemetryConfig::default(),
            health: HealthConfig::default(),
            max_replicas: 64,
            admin_token: None,
            replica_dns: Vec::new(),
            lora_adapters: Vec::new(),
            dns_servers: Vec::new(),
            api_keys: ApiKeys::default(),
            probes: ProbePaths::default(),
            max_in_flight: 0,
            queue_size: 1024,
            queue_timeout: Duration::from_secs(30),
            response_affinity_entries: 1 << 20,
            response_affinity_ttl: Duration::from_secs(3600),
            tokenizer: None,
            access_log: None,
            chat_template: None,
            token_mode: None,
            max_prompt_tokens: crate::prompt::DEFAULT_MAX_TOKENS,
            models: Vec::new(),
            model_tables: Vec::new(),
        }
    }
}

/// An admin token: at least 16 printable characters without spaces (never echoed in errors).
fn check_admin_token(key: &str, v: &str) -> Result<String, ConfigError> {
    if v.len() < 16 || v.bytes().any(|b| !b.is_ascii_graphic()) {
        return Err(bad(
            key,
            "<hidden>",
            "expected at least 16 printable characters without spaces",
        ));
    }
    Ok(v.to_string())
}

/// A probe path kvlb answers itself: an absolute path without a query, or off.
fn parse_probe_path(key: &str, v: &str) -> Result<Option<String>, ConfigError> {
    match v.trim() {
        "" | "off" => Ok(None),
        p if p.starts_with('/') && !p.contains('?') && p.bytes().all(|b| b > b' ' && b < 0x7f) => {
            Ok(Some(p.to_string()))
        }
        _ => Err(bad(
            key,
            v,
            "expected an absolute path such as /healthz, or off",
        )),
    }
}

/// Secrets from the environment, applied over the file and under the flags, so that they
/// need not appear on a command line (`ps` shows it to every local user).
pub const ENV_ADMIN_TOKEN: &str = "KVLB_ADMIN_TOKEN";
pub const ENV_API_KEYS: &str = "KVLB_API_KEYS";

/// A DNS replica source, validated as `crate::discovery` will read it (the replica options it
/// carries too).
fn check_dns_source(key: &str, v: &str) -> Result<(), ConfigError> {
    let src = crate::discovery::DnsSource::parse(v).map_err(|e| bad(key, v, &e.to_string()))?;
    let probe = src.replica_flag("127.0.0.1:1".parse().expect("literal address"));
    parse_replica_flag(key, &probe)?;
    Ok(())
}

/// A resolver address for DNS sources (`IP[:PORT]`).
fn check_dns_server(key: &str, v: &str) -> Result<(), ConfigError> {
    crate::discovery::parse_dns_server(v)
        .map(|_| ())
        .map_err(|e| bad(key, v, &e.to_string()))
}

/// `max_prompt_tokens` bounds: one text block, and 2^20 token-mode blocks of 16.
const MIN_PROMPT_TOKENS: usize = 64;
const MAX_PROMPT_TOKENS: usize = 1 << 24;

/// Loads `tokenizer` and `chat_template` into `token_mode`; errors name the key and the file.
fn load_token_mode(cfg: &mut ServeConfig) -> Result<(), ConfigError> {
    cfg.token_mode = None;
    let Some(path) = cfg.tokenizer.clone() else {
        if let Some(t) = &cfg.chat_template {
            return Err(bad(
                "chat_template",
                t,
                "needs tokenizer = PATH too (the tokenizer.json the template's text is encoded with)",
            ));
        }
        return Ok(());
    };
    let template = cfg.chat_template.clone();
    let loaded = crate::tokenize::ChatTokenizer::load(
        std::path::Path::new(&path),
        template.as_deref().map(std::path::Path::new),
    )
    .map_err(|e| match &template {
        Some(t) if e.starts_with(&format!("{t}: ")) => bad("chat_template", t, &e[t.len() + 2..]),
        _ => bad(
            "tokenizer",
            &path,
            e.strip_prefix(&format!("{path}: ")).unwrap_or(&e),
        ),
    })?;
    if !loaded.has_chat_template() {
        return Err(bad(
            "tokenizer",
            &path,
            "no chat template beside it (tokenizer_config.json with chat_template, or chat_template.jinja); give chat_template = PATH",
        ));
    }
    cfg.token_mode = Some(crate::tokenize::SharedTokenizer(std::sync::Arc::new(
        loaded,
    )));
    Ok(())
}
