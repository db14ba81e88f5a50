//! `kvlb serve` configuration: a TOML file and command-line flags (flags win), validated into
//! one `ServeConfig`. Every error names the key (or flag) and the bad value.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyName {
    CacheAware,
    ConsistentHash,
    Random,
    RoundRobin,
    LeastLoaded,
    PowerOfTwo,
}

impl PolicyName {
    pub const NAMES: &'static str =
        "cache_aware, round_robin, least_loaded, power_of_two, consistent_hash, random";

    pub fn parse(s: &str) -> Option<PolicyName> {
        match s {
            "cache_aware" => Some(PolicyName::CacheAware),
            "consistent_hash" => Some(PolicyName::ConsistentHash),
            "random" => Some(PolicyName::Random),
            "round_robin" => Some(PolicyName::RoundRobin),
            "least_loaded" => Some(PolicyName::LeastLoaded),
            "power_of_two" => Some(PolicyName::PowerOfTwo),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::CacheAware => "cache_aware",
            PolicyName::ConsistentHash => "consistent_hash",
            PolicyName::Random => "random",
            PolicyName::RoundRobin => "round_robin",
            PolicyName::LeastLoaded => "least_loaded",
            PolicyName::PowerOfTwo => "power_of_two",
        }
    }
}

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
}

impl ReplicaConfig {
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
            stale_after: Duration::from_secs(30),
            routed_guess_ttl: Duration::from_secs(120),
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

/// The cost model of `cache_aware` (see `estimate` and `select::cache_aware`).
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    pub prefill_a_s: f64,
    pub prefill_b_s: f64,
    pub prefill_c_s: f64,
    pub decode_base_s: f64,
    pub decode_per_seq_s: f64,
    pub decode_per_ctx_token_s: f64,
    pub min_match_tokens: u32,
    pub recompute_weight: f64,
    /// Extra weight of a request's own prefill per request waiting for its first token (fleet
    /// average beyond one): a backlogged fleet values hits more.
    pub backlog_weight: f64,
    /// Prompt tokens a queued request this kvlb did not send stands for (scraped `waiting`).
    pub foreign_request_tokens: u32,
    /// KV usage from which a replica's cache hits count for less (it is evicting).
    pub kv_evict_from: f64,
    /// The share of a hit that still counts at 100% KV usage.
    pub kv_hit_keep_at_full: f64,
    /// Loading a prefix back from an offloaded tier (CPU, disk) costs this fraction of
    /// recomputing it (0..=1).
    pub offload_load_cost: f64,
}

impl Default for CostModel {
    fn default() -> CostModel {
        let e = crate::engine::EngineConfig::default();
        let p = crate::select::CacheAwareConfig::default();
        CostModel {
            prefill_a_s: e.prefill_a_s,
            prefill_b_s: e.prefill_b_s,
            prefill_c_s: e.prefill_c_s,
            decode_base_s: e.decode_base_s,
            decode_per_seq_s: e.decode_per_seq_s,
            decode_per_ctx_token_s: e.decode_per_ctx_token_s,
            min_match_tokens: p.min_match_tokens,
            recompute_weight: p.recompute_weight,
            backlog_weight: p.backlog_weight,
            foreign_request_tokens: p.foreign_request_tokens,
            kv_evict_from: p.kv_evict_from,
            kv_hit_keep_at_full: p.kv_hit_keep_at_full,
            offload_load_cost: p.offload_load_cost,
        }
    }
}

impl CostModel {
    /// The policy configuration these knobs describe.
    pub fn policy_config(&self) -> crate::select::CacheAwareConfig {
        let e = crate::engine::EngineConfig {
            prefill_a_s: self.prefill_a_s,
            prefill_b_s: self.prefill_b_s,
            prefill_c_s: self.prefill_c_s,
            decode_base_s: self.decode_base_s,
            decode_per_seq_s: self.decode_per_seq_s,
            decode_per_ctx_token_s: self.decode_per_ctx_token_s,
            ..Default::default()
        };
        crate::select::CacheAwareConfig {
            model: crate::estimate::TtftModel::from_engine(&e),
            min_match_tokens: self.min_match_tokens,
            recompute_weight: self.recompute_weight,
            backlog_weight: self.backlog_weight,
            foreign_request_tokens: self.foreign_request_tokens,
            kv_evict_from: self.kv_evict_from,
            kv_hit_keep_at_full: self.kv_hit_keep_at_full,
            offload_load_cost: self.offload_load_cost,
            ..Default::default()
        }
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
    /// L7: a response body of known length with at least this many bytes still to come moves
    /// replica -> client by io_uring splice through a pipe instead of through user space
    /// (0, the default: never; see the README for the measurements behind that default).
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

fn bad(key: &str, value: &str, why: &str) -> ConfigError {
    ConfigError(format!("{key} = {value:?}: {why}"))
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
    })
}

/// `URL[,key=value...]` as given to --replica.
pub fn parse_replica_flag(key: &str, v: &str) -> Result<ReplicaConfig, ConfigError> {
    let mut parts = v.split(',');
    let url = parts.next().unwrap_or("");
    let mut r = parse_replica_url(key, url)?;
    for opt in parts {
        let (k, val) = opt
            .split_once('=')
            .ok_or_else(|| bad(key, v, "expected URL[,key=value...]"))?;
        match k {
            "kv_capacity_tokens" => {
                r.kv_capacity_tokens =
                    val.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                        bad(
                            &format!("{key} kv_capacity_tokens"),
                            val,
                            "expected a positive number of tokens",
                        )
                    })?
            }
            "kv_offload_capacity_tokens" => {
                r.kv_offload_capacity_tokens =
                    Some(val.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                        bad(
                            &format!("{key} kv_offload_capacity_tokens"),
                            val,
                            "expected a positive number of tokens",
                        )
                    })?)
            }
            "kv_events" => r.kv_events = Some(parse_zmq_endpoint(&format!("{key} kv_events"), val)?),
            "kv_replay" => r.kv_replay = Some(parse_zmq_endpoint(&format!("{key} kv_replay"), val)?),
            "metrics" => r.metrics = Some(parse_switch(&format!("{key} metrics"), val)?),
            "max_in_flight" => {
                r.max_in_flight = Some(parse_count(&format!("{key} max_in_flight"), val, 0)?)
            }
            _ => {
                return Err(bad(
                    key,
                    v,
                    &format!(
                        "unknown replica option {k:?} (known: kv_capacity_tokens, kv_offload_capacity_tokens, kv_events, kv_replay, metrics, max_in_flight)"
                    ),
                ))
            }
        }
    }
    check_replay(key, &r)?;
    Ok(r)
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
    let available = core_affinity::get_core_ids().map(|c| c.len()).unwrap_or(0);
    if available > 0 {
        if let Some(c) = out.iter().find(|c| **c >= available) {
            return Err(bad(
                key,
                v,
                &format!("core {c} does not exist (this machine has {available})"),
            ));
        }
    }
    Ok(out)
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
            cost_model: CostModel::default(),
            telemetry: TelemetryConfig::default(),
            health: HealthConfig::default(),
            max_replicas: 64,
            admin_token: None,
            replica_dns: Vec::new(),
            dns_servers: Vec::new(),
            api_keys: ApiKeys::default(),
            probes: ProbePaths::default(),
            max_in_flight: 0,
            queue_size: 1024,
            queue_timeout: Duration::from_secs(30),
            tokenizer: None,
            access_log: None,
            chat_template: None,
            token_mode: None,
            max_prompt_tokens: crate::prompt::DEFAULT_MAX_TOKENS,
        }
    }
}

pub const SERVE_HELP: &str = "usage: kvlb serve [options]

  --config FILE            TOML configuration (flags override it)
  --listen ADDR            client listener, repeatable (e.g. 0.0.0.0:8080)
  --mode l7|l4             mode of the --listen addresses: l7 proxies each request (default);
                           l4 routes a connection's first request, then joins the sockets
  --l4-forwarding splice|sockmap   how l4 connections forward (default splice)
  --splice-responses-from SIZE   l7: splice response bodies with at least SIZE left to send
                           (default off)
  --replica URL            replica base URL, repeatable (e.g. http://10.0.0.5:8000)
  --replica URL,kv_capacity_tokens=N   the same, with the replica's KV capacity (default 400000)
  --replica URL,kv_offload_capacity_tokens=N   capacity of its offloaded KV tier (CPU, disk)
                           in tokens (default 8x kv_capacity_tokens)
  --replica URL,kv_events=tcp://HOST:PORT[,kv_replay=tcp://HOST:PORT]
                           the same, subscribing to the replica's KV cache events (and replay)
  --replica URL,metrics=on|off   poll the replica's /metrics (default: on when kv_events is set)
  --metrics-interval DUR   how often each replica's /metrics is polled (default 1s)
  --telemetry-stale-after DUR  no events nor metrics this long: drop the replica's residency (default 30s)
  --routed-guess-ttl DUR   with KV events, routing guesses not confirmed this long are dropped (default 120s)
  --routed-pending-ttl DUR with KV events, a routed request's blocks outlive a BlockRemoved until
                           the replica stores them again, at most this long (default off)
  --policy NAME            cache_aware | round_robin | least_loaded | power_of_two |
                           consistent_hash | random (default cache_aware)
  --explain                add x-kvlb-decision to responses (matched tokens, estimates, reason)
  --min-match-tokens N     cache_aware: shorter prefix matches count as none (default 256)
  --recompute-weight X     cache_aware: weight of prefill against queueing (default 2; 1 = plain TTFT)
  --offload-load-cost X    cache_aware: loading a prefix back from an offloaded tier (CPU, disk)
                           costs this fraction of recomputing it, 0..=1 (default 0.25)
  --prefill-a-s, --prefill-b-s, --prefill-c-s, --decode-base-s, --decode-per-seq-s,
  --decode-per-ctx-token-s SECONDS   cache_aware's cost model (default: 8B model on one H100)
  --workers N              worker threads (default: one per core)
  --cores LIST             cores for the workers, e.g. 0, 2-5, 0,2 (default: worker i on core i)
  --admin ADDR             admin listener for /metrics, /healthz, /replicas (default 127.0.0.1:9100)
  --max-header-bytes SIZE  request head limit, 431 beyond (default 64KiB)
  --max-body-bytes SIZE    request body limit, 413 beyond (default 64MiB)
  --max-body-memory SIZE   most bytes all request bodies in flight may hold; beyond, 503 with
                           Retry-After before a body is read (default 1GiB)
  --max-connections N      client connections per worker (default 65536)
  --client-timeout DUR     time to receive a whole request, 408 beyond (default 30s)
  --idle-timeout DUR       keep-alive idle time (default 60s)
  --connect-timeout DUR    replica connect timeout (default 3s)
  --upstream-timeout DUR   time to the replica's response head, 504 beyond (default 300s)
  --drain-timeout DUR      how long SIGTERM waits for in-flight requests (default 30s)
  --health-path PATH       active health check path (default /health)
  --health-interval DUR    active check period, 0 = off (default 2s)
  --health-timeout DUR     active check timeout (default 1s)
  --unhealthy-after N      failed checks in a row that take a replica out (default 2)
  --healthy-after N        passed checks in a row that put it back (default 2)
  --max-fails N            transport failures in a row that eject a replica, 0 = never (default 3)
  --fail-timeout DUR       how long an ejected replica is skipped (default 10s)
  --slow-start DUR         traffic ramp for a replica back from ejection or newly added (default 10s)
  --retries N              other replicas tried after a connect failure or an immediate 503 (default 1)
  --max-replicas N         replica slots, reloads and admin additions included (default 64)
  --admin-token TOKEN      bearer token for the admin API's changing endpoints (default: disabled);
                           visible in ps: prefer --admin-token-file or KVLB_ADMIN_TOKEN
  --admin-token-file FILE  the same, read from FILE (e.g. a systemd credential)
  --replica-dns SOURCE     replicas from DNS, repeatable: dns://NAME:PORT (A/AAAA) or
                           dns+srv://NAME (SRV), [,interval=5s][,family=ipv4][,kv_events=tcp://{host}:5557]
  --dns-server ADDR        resolver for --replica-dns, repeatable (default: /etc/resolv.conf)
  --api-keys-file FILE     client API keys, one per line (# comments); requests without
                           Authorization: Bearer <key> get 401 (default: no check);
                           or KVLB_API_KEYS in the environment (keys separated by commas)
  --liveness-path PATH     answered 200 by kvlb itself on the client listeners, without an API
                           key, while it runs; off to forward it (default /healthz)
  --readiness-path PATH    the same, 503 while draining or with no replica available
                           (default /readyz)
  --max-in-flight N        requests in flight per replica, 0 = no limit (default 0); per replica:
                           --replica URL,max_in_flight=N
  --queue-size N           requests waiting while every replica is at its limit (default 1024);
                           beyond, 429 with Retry-After
  --queue-timeout DUR      longest wait in that queue before 429 (default 30s)
  --tokenizer PATH         Hugging Face tokenizer.json: chat and text completions prompts are
                           hashed as the engine's token ids (blocks match KV events)
  --chat-template PATH     the model's tokenizer_config.json (chat_template, bos/eos) or a
                           .jinja file (default: beside the tokenizer)
  --access-log PATH        one JSON line per request appended to PATH (default off); reopened
                           on reload, for log rotation
  --max-prompt-tokens N    prompts are read for routing up to N tokens, the longest context of
                           the fleet's models (default 1048576; fixed at start)

SIGHUP (or POST /reload on the admin listener) rereads the configuration: replicas, policy,
limits, timeouts and health settings change without dropping connections or requests.";

const FILE_KEYS: &[&str] = &[
    "listen",
    "replica",
    "policy",
    "workers",
    "cores",
    "admin",
    "max_header_bytes",
    "max_body_bytes",
    "max_body_memory",
    "max_connections",
    "client_timeout",
    "idle_timeout",
    "connect_timeout",
    "upstream_timeout",
    "drain_timeout",
    "explain",
    "cost_model",
    "metrics_interval",
    "telemetry_stale_after",
    "routed_guess_ttl",
    "routed_pending_ttl",
    "health_path",
    "health_interval",
    "health_timeout",
    "unhealthy_after",
    "healthy_after",
    "max_fails",
    "fail_timeout",
    "slow_start",
    "retries",
    "max_replicas",
    "admin_token",
    "admin_token_file",
    "replica_dns",
    "dns_servers",
    "api_keys",
    "api_keys_file",
    "liveness_path",
    "readiness_path",
    "max_in_flight",
    "queue_size",
    "queue_timeout",
    "listener",
    "l4_forwarding",
    "splice_responses_from",
    "tokenizer",
    "chat_template",
    "access_log",
    "max_prompt_tokens",
];

const REPLICA_KEYS: &[&str] = &[
    "url",
    "kv_capacity_tokens",
    "kv_offload_capacity_tokens",
    "kv_events",
    "kv_replay",
    "metrics",
    "max_in_flight",
];

const COST_MODEL_KEYS: &[&str] = &[
    "prefill_a_s",
    "prefill_b_s",
    "prefill_c_s",
    "decode_base_s",
    "decode_per_seq_s",
    "decode_per_ctx_token_s",
    "min_match_tokens",
    "recompute_weight",
    "backlog_weight",
    "foreign_request_tokens",
    "kv_evict_from",
    "kv_hit_keep_at_full",
    "offload_load_cost",
];

fn apply_cost(cfg: &mut ServeConfig, key: &str, v: &str) -> Result<(), ConfigError> {
    let m = &mut cfg.cost_model;
    let secs = |v: &str| -> Result<f64, ConfigError> {
        v.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| bad(key, v, "expected seconds >= 0, e.g. 0.0000335"))
    };
    match key {
        "prefill_a_s" => m.prefill_a_s = secs(v)?,
        "prefill_b_s" => m.prefill_b_s = secs(v)?,
        "prefill_c_s" => m.prefill_c_s = secs(v)?,
        "decode_base_s" => m.decode_base_s = secs(v)?,
        "decode_per_seq_s" => m.decode_per_seq_s = secs(v)?,
        "decode_per_ctx_token_s" => m.decode_per_ctx_token_s = secs(v)?,
        "min_match_tokens" => {
            m.min_match_tokens = v
                .parse()
                .map_err(|_| bad(key, v, "expected a number of tokens"))?
        }
        "recompute_weight" => {
            m.recompute_weight = v
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| bad(key, v, "expected a number > 0 (1 = plain TTFT)"))?
        }
        "backlog_weight" => {
            m.backlog_weight = v
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(key, v, "expected a number >= 0 (0 = off)"))?
        }
        "foreign_request_tokens" => {
            m.foreign_request_tokens = v
                .parse()
                .map_err(|_| bad(key, v, "expected a number of tokens"))?
        }
        "kv_evict_from" | "kv_hit_keep_at_full" | "offload_load_cost" => {
            let x = v
                .parse::<f64>()
                .ok()
                .filter(|x| (0.0..=1.0).contains(x))
                .ok_or_else(|| bad(key, v, "expected a fraction from 0 to 1"))?;
            match key {
                "kv_evict_from" => m.kv_evict_from = x,
                "offload_load_cost" => m.offload_load_cost = x,
                _ => m.kv_hit_keep_at_full = x,
            }
        }
        _ => {
            return Err(ConfigError(format!(
                "unknown key {key:?} (known cost_model keys: {})",
                COST_MODEL_KEYS.join(", ")
            )))
        }
    }
    Ok(())
}

/// Apply one setting given as text (from a flag or a file string).
fn apply(cfg: &mut ServeConfig, key: &str, v: &str) -> Result<(), ConfigError> {
    match key {
        "policy" => {
            cfg.policy = PolicyName::parse(v).ok_or_else(|| {
                bad(
                    key,
                    v,
                    &format!("unknown policy; one of {}", PolicyName::NAMES),
                )
            })?
        }
        "workers" => {
            cfg.workers = v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=1024).contains(n))
                .ok_or_else(|| bad(key, v, "expected a number of workers from 1 to 1024"))?
        }
        "cores" => cfg.cores = Some(parse_cores(key, v)?),
        "admin" => cfg.admin = parse_addr(key, v)?,
        "max_header_bytes" => cfg.limits.max_header_bytes = parse_size(key, v)?,
        "max_body_bytes" => cfg.limits.max_body_bytes = parse_size(key, v)?,
        "max_body_memory" => cfg.limits.max_body_memory = parse_size(key, v)?,
        "liveness_path" => cfg.probes.liveness = parse_probe_path(key, v)?,
        "readiness_path" => cfg.probes.readiness = parse_probe_path(key, v)?,
        "max_connections" => {
            cfg.limits.max_connections = v
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| bad(key, v, "expected a positive number"))?
        }
        "client_timeout" => cfg.timeouts.client = parse_duration(key, v)?,
        "idle_timeout" => cfg.timeouts.idle = parse_duration(key, v)?,
        "connect_timeout" => cfg.timeouts.connect = parse_duration(key, v)?,
        "upstream_timeout" => cfg.timeouts.upstream = parse_duration(key, v)?,
        "drain_timeout" => cfg.timeouts.drain = parse_duration(key, v)?,
        "metrics_interval" => cfg.telemetry.metrics_interval = parse_duration(key, v)?,
        "telemetry_stale_after" => cfg.telemetry.stale_after = parse_duration(key, v)?,
        "routed_guess_ttl" => cfg.telemetry.routed_guess_ttl = parse_duration(key, v)?,
        "routed_pending_ttl" => cfg.telemetry.routed_pending_ttl = parse_duration_or_off(key, v)?,
        "health_path" => {
            if !v.starts_with('/') || v.bytes().any(|b| b <= b' ' || b == 0x7f) {
                return Err(bad(key, v, "expected an absolute path such as /health"));
            }
            cfg.health.path = v.to_string()
        }
        "health_interval" => cfg.health.interval = parse_duration_or_off(key, v)?,
        "health_timeout" => cfg.health.timeout = parse_duration(key, v)?,
        "unhealthy_after" => cfg.health.unhealthy_after = parse_count(key, v, 1)?,
        "healthy_after" => cfg.health.healthy_after = parse_count(key, v, 1)?,
        "max_fails" => cfg.health.max_fails = parse_count(key, v, 0)?,
        "fail_timeout" => cfg.health.fail_timeout = parse_duration(key, v)?,
        "slow_start" => cfg.health.slow_start = parse_duration_or_off(key, v)?,
        "retries" => cfg.health.retries = parse_count(key, v, 0)?,
        "api_keys_file" => {
            let text = std::fs::read_to_string(v)
                .map_err(|e| bad(key, v, &format!("cannot read: {e}")))?;
            cfg.api_keys = ApiKeys::default();
            for line in text.lines().map(str::trim) {
                if !line.is_empty() && !line.starts_with('#') {
                    cfg.api_keys.add(key, line)?;
                }
            }
            if cfg.api_keys.is_empty() {
                return Err(bad(key, v, "the file holds no key"));
            }
        }
        "max_in_flight" => cfg.max_in_flight = parse_count(key, v, 0)?,
        "queue_size" => cfg.queue_size = parse_count(key, v, 0)?,
        "queue_timeout" => cfg.queue_timeout = parse_duration(key, v)?,
        "max_replicas" => {
            cfg.max_replicas = v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=crate::residency::MAX_REPLICAS).contains(n))
                .ok_or_else(|| {
                    bad(
                        key,
                        v,
                        &format!(
                            "expected a number from 1 to {}",
                            crate::residency::MAX_REPLICAS
                        ),
                    )
                })?
        }
        "admin_token" => cfg.admin_token = Some(check_admin_token(key, v)?),
        "admin_token_file" => {
            let text = std::fs::read_to_string(v)
                .map_err(|e| bad(key, v, &format!("cannot read: {e}")))?;
            cfg.admin_token = Some(
                check_admin_token(key, text.trim())
                    .map_err(|e| ConfigError(e.0.replace("<hidden>", &format!("{v:?}"))))?,
            )
        }
        "l4_forwarding" => cfg.l4_forwarding = L4Forwarding::parse(key, v)?,
        "splice_responses_from" => {
            cfg.splice_responses_from = match v.trim() {
                "0" | "off" => 0,
                _ => parse_size(key, v)?,
            }
        }
        "explain" => {
            cfg.explain = match v {
                "true" | "1" | "yes" | "on" => true,
                "false" | "0" | "no" | "off" => false,
                _ => return Err(bad(key, v, "expected true or false")),
            }
        }
        "tokenizer" => cfg.tokenizer = Some(v.to_string()),
        "access_log" => {
            cfg.access_log = match v.trim() {
                "" | "off" => None,
                path => Some(path.to_string()),
            }
        }
        "chat_template" => cfg.chat_template = Some(v.to_string()),
        "max_prompt_tokens" => {
            cfg.max_prompt_tokens = v
                .parse::<usize>()
                .ok()
                .filter(|n| (MIN_PROMPT_TOKENS..=MAX_PROMPT_TOKENS).contains(n))
                .ok_or_else(|| {
                    bad(
                        key,
                        v,
                        &format!(
                            "expected a number of tokens from {MIN_PROMPT_TOKENS} to {MAX_PROMPT_TOKENS}"
                        ),
                    )
                })?
        }
        k if COST_MODEL_KEYS.contains(&k) => apply_cost(cfg, k, v)?,
        _ => return Err(ConfigError(format!("unknown key {key:?}"))),
    }
    Ok(())
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

fn apply_env(cfg: &mut ServeConfig) -> Result<(), ConfigError> {
    if let Ok(v) = std::env::var(ENV_ADMIN_TOKEN) {
        if !v.is_empty() {
            cfg.admin_token = Some(check_admin_token(ENV_ADMIN_TOKEN, v.trim())?);
        }
    }
    if let Ok(v) = std::env::var(ENV_API_KEYS) {
        let mut keys = ApiKeys::default();
        for k in v
            .split([',', '\n'])
            .map(str::trim)
            .filter(|k| !k.is_empty())
        {
            keys.add(ENV_API_KEYS, k)?;
        }
        if !keys.is_empty() {
            cfg.api_keys = keys;
        }
    }
    Ok(())
}

/// A DNS replica source or resolver address, validated as `crate::discovery` will read it
/// (the replica options it carries too).
fn check_dns_setting(key: &str, v: &str) -> Result<(), ConfigError> {
    if key.contains("server") {
        return crate::discovery::parse_dns_server(v)
            .map(|_| ())
            .map_err(|e| bad(key, v, &e.to_string()));
    }
    let src = crate::discovery::DnsSource::parse(v).map_err(|e| bad(key, v, &e.to_string()))?;
    let probe = src.replica_flag("127.0.0.1:1".parse().expect("literal address"));
    parse_replica_flag(key, &probe)?;
    Ok(())
}

/// `max_prompt_tokens` bounds: one text block, and 2^20 token-mode blocks of 16.
const MIN_PROMPT_TOKENS: usize = 64;
const MAX_PROMPT_TOKENS: usize = 1 << 24;

fn parse_count(key: &str, v: &str, min: u32) -> Result<u32, ConfigError> {
    v.parse::<u32>()
        .ok()
        .filter(|n| *n >= min && *n <= 1_000_000)
        .ok_or_else(|| bad(key, v, &format!("expected a whole number >= {min}")))
}

fn toml_scalar(key: &str, v: &toml::Value) -> Result<String, ConfigError> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(bad(
            key,
            &other.to_string(),
            "expected a string or a number",
        )),
    }
}

/// Load a TOML file into `cfg`.
pub fn load_file(cfg: &mut ServeConfig, path: &str) -> Result<(), ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("--config {path:?}: cannot read: {e}")))?;
    apply_toml(cfg, &text).map_err(|e| ConfigError(format!("{path}: {}", e.0)))
}

pub fn apply_toml(cfg: &mut ServeConfig, text: &str) -> Result<(), ConfigError> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError(format!("not valid TOML: {}", e.message())))?;
    // `listen = [...]` (L7) and `[[listener]]` tables together replace the listeners.
    let mut file_l7: Option<Vec<SocketAddr>> = None;
    let mut file_listeners: Option<Vec<(SocketAddr, ListenerMode)>> = None;
    for (key, value) in &table {
        if !FILE_KEYS.contains(&key.as_str()) {
            return Err(ConfigError(format!(
                "unknown key {key:?} (known keys: {})",
                FILE_KEYS.join(", ")
            )));
        }
        match key.as_str() {
            "listen" => {
                let list = match value {
                    toml::Value::Array(a) => a.clone(),
                    toml::Value::String(_) => vec![value.clone()],
                    other => {
                        return Err(bad(
                            "listen",
                            &other.to_string(),
                            "expected a list of addresses",
                        ))
                    }
                };
                let mut addrs = Vec::new();
                for v in list {
                    let s = v.as_str().ok_or_else(|| {
                        bad("listen", &v.to_string(), "expected a string HOST:PORT")
                    })?;
                    addrs.push(parse_addr("listen", s)?);
                }
                file_l7 = Some(addrs);
            }
            "api_keys" => {
                let list = value
                    .as_array()
                    .ok_or_else(|| bad(key, "<hidden>", "expected a list of strings"))?;
                cfg.api_keys = ApiKeys::default();
                for v in list {
                    let s = v
                        .as_str()
                        .ok_or_else(|| bad(key, "<hidden>", "expected strings"))?;
                    cfg.api_keys.add(key, s)?;
                }
            }
            "replica_dns" | "dns_servers" => {
                let list = match value {
                    toml::Value::Array(a) => a.clone(),
                    toml::Value::String(_) => vec![value.clone()],
                    other => {
                        return Err(bad(key, &other.to_string(), "expected a list of strings"))
                    }
                };
                let mut out = Vec::new();
                for v in list {
                    let s = v
                        .as_str()
                        .ok_or_else(|| bad(key, &v.to_string(), "expected a string"))?;
                    check_dns_setting(key, s)?;
                    out.push(s.to_string());
                }
                if key == "replica_dns" {
                    cfg.replica_dns = out;
                } else {
                    cfg.dns_servers = out;
                }
            }
            "listener" => file_listeners = Some(parse_listener_tables(value)?),
            "replica" => {
                let arr = value.as_array().ok_or_else(|| {
                    bad("replica", &value.to_string(), "expected [[replica]] tables")
                })?;
                cfg.replicas.clear();
                for (i, r) in arr.iter().enumerate() {
                    let t = r.as_table().ok_or_else(|| {
                        bad(
                            &format!("replica[{i}]"),
                            &r.to_string(),
                            "expected a table with url = \"http://...\"",
                        )
                    })?;
                    for k in t.keys() {
                        if !REPLICA_KEYS.contains(&k.as_str()) {
                            return Err(ConfigError(format!(
                                "unknown key \"replica[{i}].{k}\" (known keys: {})",
                                REPLICA_KEYS.join(", ")
                            )));
                        }
                    }
                    let url = t.get("url").and_then(|u| u.as_str()).ok_or_else(|| {
                        ConfigError(format!("replica[{i}].url is missing or not a string"))
                    })?;
                    let mut replica = parse_replica_url(&format!("replica[{i}].url"), url)?;
                    if let Some(v) = t.get("kv_capacity_tokens") {
                        let key = format!("replica[{i}].kv_capacity_tokens");
                        replica.kv_capacity_tokens =
                            v.as_integer().filter(|n| *n > 0).ok_or_else(|| {
                                bad(&key, &v.to_string(), "expected a positive number of tokens")
                            })? as u64;
                    }
                    if let Some(v) = t.get("kv_offload_capacity_tokens") {
                        let key = format!("replica[{i}].kv_offload_capacity_tokens");
                        replica.kv_offload_capacity_tokens =
                            Some(v.as_integer().filter(|n| *n > 0).ok_or_else(|| {
                                bad(&key, &v.to_string(), "expected a positive number of tokens")
                            })? as u64);
                    }
                    for (name, slot) in [
                        ("kv_events", &mut replica.kv_events),
                        ("kv_replay", &mut replica.kv_replay),
                    ] {
                        if let Some(v) = t.get(name) {
                            let key = format!("replica[{i}].{name}");
                            let s = v.as_str().ok_or_else(|| {
                                bad(&key, &v.to_string(), "expected a string tcp://HOST:PORT")
                            })?;
                            *slot = Some(parse_zmq_endpoint(&key, s)?);
                        }
                    }
                    if let Some(v) = t.get("metrics") {
                        let key = format!("replica[{i}].metrics");
                        replica.metrics = Some(match v {
                            toml::Value::Boolean(b) => *b,
                            toml::Value::String(s) => parse_switch(&key, s)?,
                            other => {
                                return Err(bad(&key, &other.to_string(), "expected true or false"))
                            }
                        });
                    }
                    if let Some(v) = t.get("max_in_flight") {
                        let key = format!("replica[{i}].max_in_flight");
                        replica.max_in_flight = Some(parse_count(&key, &toml_scalar(&key, v)?, 0)?);
                    }
                    check_replay(&format!("replica[{i}]"), &replica)?;
                    cfg.replicas.push(replica);
                }
            }
            "cost_model" => {
                let t = value.as_table().ok_or_else(|| {
                    bad(
                        "cost_model",
                        &value.to_string(),
                        "expected a [cost_model] table",
                    )
                })?;
                for (k, v) in t {
                    let s = toml_scalar(&format!("cost_model.{k}"), v)?;
                    if !COST_MODEL_KEYS.contains(&k.as_str()) {
                        return Err(ConfigError(format!(
                            "unknown key \"cost_model.{k}\" (known keys: {})",
                            COST_MODEL_KEYS.join(", ")
                        )));
                    }
                    apply_cost(cfg, k, &s).map_err(|e| {
                        ConfigError(e.0.replacen(k.as_str(), &format!("cost_model.{k}"), 1))
                    })?;
                }
            }
            _ => {
                let s = toml_scalar(key, value)?;
                apply(cfg, key, &s)?;
            }
        }
    }
    if file_l7.is_some() || file_listeners.is_some() {
        cfg.listen.clear();
        cfg.listen_modes.clear();
        for a in file_l7.unwrap_or_default() {
            cfg.listen.push(a);
            cfg.listen_modes.push(ListenerMode::L7);
        }
        for (a, m) in file_listeners.unwrap_or_default() {
            cfg.listen.push(a);
            cfg.listen_modes.push(m);
        }
    }
    Ok(())
}

/// `[[listener]]` tables: `address = "HOST:PORT"`, `mode = "l7" | "l4"` (default l7).
fn parse_listener_tables(
    value: &toml::Value,
) -> Result<Vec<(SocketAddr, ListenerMode)>, ConfigError> {
    let arr = value.as_array().ok_or_else(|| {
        bad(
            "listener",
            &value.to_string(),
            "expected [[listener]] tables with address = \"HOST:PORT\"",
        )
    })?;
    let mut out = Vec::new();
    for (i, l) in arr.iter().enumerate() {
        let t = l.as_table().ok_or_else(|| {
            bad(
                &format!("listener[{i}]"),
                &l.to_string(),
                "expected a table with address = \"HOST:PORT\"",
            )
        })?;
        for k in t.keys() {
            if k != "address" && k != "mode" {
                return Err(ConfigError(format!(
                    "unknown key \"listener[{i}].{k}\" (known keys: address, mode)"
                )));
            }
        }
        let key = format!("listener[{i}].address");
        let addr = match t.get("address") {
            Some(toml::Value::String(s)) => parse_addr(&key, s)?,
            Some(other) => {
                return Err(bad(&key, &other.to_string(), "expected a string HOST:PORT"))
            }
            None => return Err(ConfigError(format!("{key} is missing"))),
        };
        let key = format!("listener[{i}].mode");
        let mode = match t.get("mode") {
            Some(toml::Value::String(s)) => ListenerMode::parse(&key, s)?,
            Some(other) => return Err(bad(&key, &other.to_string(), "expected \"l7\" or \"l4\"")),
            None => ListenerMode::L7,
        };
        out.push((addr, mode));
    }
    Ok(out)
}

/// What the command line asked for: Err(None) means --help was printed.
pub fn from_args(args: &[String]) -> Result<ServeConfig, Option<ConfigError>> {
    let mut cfg = ServeConfig::default();
    // The file first, then flags over it.
    let mut i = 0;
    while i < args.len() {
        if args[i] == "--config" {
            let path = args
                .get(i + 1)
                .ok_or_else(|| Some(ConfigError("--config needs a FILE".into())))?;
            load_file(&mut cfg, path).map_err(Some)?;
        } else if args[i] == "-h" || args[i] == "--help" {
            println!("{SERVE_HELP}");
            return Err(None);
        }
        i += 1;
    }
    apply_env(&mut cfg).map_err(Some)?;
    let mut listen_flag = Vec::new();
    let mut mode_flag: Option<ListenerMode> = None;
    let mut replica_flag = Vec::new();
    let mut dns_flag = Vec::new();
    let mut dns_server_flag = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (flag, None),
        };
        if !name.starts_with("--") {
            return Err(Some(ConfigError(format!(
                "unexpected argument {flag:?}\n\n{SERVE_HELP}"
            ))));
        }
        if name == "--explain" && inline.is_none() {
            cfg.explain = true;
            i += 1;
            continue;
        }
        let value = match inline {
            Some(v) => v,
            None => {
                i += 1;
                args.get(i)
                    .cloned()
                    .ok_or_else(|| Some(ConfigError(format!("{name} needs a value"))))?
            }
        };
        i += 1;
        match name {
            "--config" => {}
            "--listen" => listen_flag.push(parse_addr("--listen", &value).map_err(Some)?),
            "--mode" => mode_flag = Some(ListenerMode::parse("--mode", &value).map_err(Some)?),
            "--replica" => {
                replica_flag.push(parse_replica_flag("--replica", &value).map_err(Some)?)
            }
            "--replica-dns" => {
                check_dns_setting("--replica-dns", &value).map_err(Some)?;
                dns_flag.push(value);
            }
            "--dns-server" => {
                check_dns_setting("--dns-server", &value).map_err(Some)?;
                dns_server_flag.push(value);
            }
            _ => {
                let key = name.trim_start_matches("--").replace('-', "_");
                if !(FILE_KEYS.contains(&key.as_str()) || COST_MODEL_KEYS.contains(&key.as_str()))
                    || key == "listen"
                    || key == "replica"
                    || key == "api_keys"
                    || key == "replica_dns"
                    || key == "dns_servers"
                    || key == "listener"
                    || key == "cost_model"
                {
                    return Err(Some(ConfigError(format!(
                        "unknown flag {name}\n\n{SERVE_HELP}"
                    ))));
                }
                apply(&mut cfg, &key, &value)
                    .map_err(|e| Some(ConfigError(e.0.replacen(&key, name, 1))))?;
                if key == "admin_token" {
                    eprintln!("kvlb: warning: --admin-token on the command line is visible to every local user (ps, /proc); use --admin-token-file FILE or {ENV_ADMIN_TOKEN} instead");
                }
            }
        }
    }
    if let Some(mode) = mode_flag {
        if listen_flag.is_empty() {
            return Err(Some(ConfigError(
                "--mode applies to the --listen addresses on the command line; give --listen ADDR too (or mode = \"l4\" in a [[listener]] table)".into(),
            )));
        }
        cfg.listen_modes = vec![mode; listen_flag.len()];
    } else if !listen_flag.is_empty() {
        cfg.listen_modes = vec![ListenerMode::L7; listen_flag.len()];
    }
    if !listen_flag.is_empty() {
        cfg.listen = listen_flag;
    }
    if !replica_flag.is_empty() {
        cfg.replicas = replica_flag;
    }
    if !dns_flag.is_empty() {
        cfg.replica_dns = dns_flag;
    }
    if !dns_server_flag.is_empty() {
        cfg.dns_servers = dns_server_flag;
    }
    if cfg.listen.is_empty() {
        return Err(Some(ConfigError(
            "no listener: give --listen ADDR or listen = [\"ADDR\"] in the file".into(),
        )));
    }
    if cfg.limits.max_body_memory < cfg.limits.max_body_bytes {
        return Err(Some(ConfigError(format!(
            "max_body_memory = {}: below max_body_bytes = {}, a body of the allowed size could never be taken; raise max_body_memory or lower max_body_bytes",
            cfg.limits.max_body_memory, cfg.limits.max_body_bytes
        ))));
    }
    if cfg.replicas.len() > cfg.max_replicas {
        return Err(Some(ConfigError(format!(
            "max_replicas = {}: {} replicas are configured; raise max_replicas",
            cfg.max_replicas,
            cfg.replicas.len()
        ))));
    }
    load_token_mode(&mut cfg).map_err(Some)?;
    if let Some(path) = &cfg.access_log {
        crate::access_log::open(path).map_err(|e| {
            Some(ConfigError(format!(
                "access_log = {path:?}: cannot open it for appending: {e}"
            )))
        })?;
    }
    let mut urls: Vec<&str> = cfg
        .replicas
        .iter()
        .map(|r| r.url.trim_end_matches('/'))
        .collect();
    urls.sort_unstable();
    if let Some(w) = urls.windows(2).find(|w| w[0] == w[1]) {
        return Err(Some(ConfigError(format!(
            "replica = {:?}: listed twice",
            w[0]
        ))));
    }
    Ok(cfg)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn tokenizer_and_chat_template_load_from_flags_and_file() {
        let dir =
            std::env::temp_dir().join(format!("kvlb-config-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        crate::tokenize::fixture::write_chatml(&dir).unwrap();
        let tok = dir.join("tokenizer.json").display().to_string();
        let c = from_args(&args(&format!("--listen 127.0.0.1:0 --tokenizer {tok}"))).unwrap();
        assert!(c.token_mode.as_ref().unwrap().0.has_chat_template());
        let file = dir.join("kvlb.toml");
        std::fs::write(
            &file,
            format!(
                "listen = [\"127.0.0.1:0\"]\ntokenizer = {tok:?}\nchat_template = {:?}\n",
                dir.join("tokenizer_config.json").display().to_string()
            ),
        )
        .unwrap();
        let c = from_args(&args(&format!("--config {}", file.display()))).unwrap();
        assert!(c.token_mode.is_some());
        let e = from_args(&args("--listen 127.0.0.1:0 --chat-template x.json"))
            .unwrap_err()
            .unwrap();
        assert!(
            e.0.contains("chat_template") && e.0.contains("needs tokenizer"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn flags() {
        let c = from_args(&args("--listen 127.0.0.1:0 --replica http://127.0.0.1:8000 --replica http://127.0.0.1:8001/ --policy least_loaded --workers 2 --cores 0-1 --client-timeout 500ms --max-body-bytes 8MiB")).unwrap();
        assert_eq!(c.replicas.len(), 2);
        assert_eq!(c.replicas[1].url, "http://127.0.0.1:8001/");
        assert_eq!(c.replicas[1].addr, "127.0.0.1:8001".parse().unwrap());
        assert_eq!(c.policy, PolicyName::LeastLoaded);
        assert_eq!(c.timeouts.client, Duration::from_millis(500));
        assert_eq!(c.limits.max_body_bytes, 8 << 20);
        assert_eq!(c.cores, Some(vec![0, 1]));
    }

    #[test]
    fn errors_name_key_and_value() {
        let e = from_args(&args("--listen 127.0.0.1:0 --policy fastest"))
            .unwrap_err()
            .unwrap();
        assert!(e.0.contains("--policy") && e.0.contains("fastest"), "{e}");
        let e = from_args(&args("--listen 127.0.0.1:0 --replica ftp://x"))
            .unwrap_err()
            .unwrap();
        assert!(e.0.contains("--replica") && e.0.contains("ftp://x"), "{e}");
        let e = from_args(&args("--listen nowhere")).unwrap_err().unwrap();
        assert!(e.0.contains("nowhere"), "{e}");
        let e = from_args(&args("--listen 127.0.0.1:0 --cores 3-1"))
            .unwrap_err()
            .unwrap();
        assert!(e.0.contains("--cores") && e.0.contains("3-1"), "{e}");
        let e = from_args(&args("--listen 127.0.0.1:0 --client-timeout forever"))
            .unwrap_err()
            .unwrap();
        assert!(
            e.0.contains("--client-timeout") && e.0.contains("forever"),
            "{e}"
        );
    }

    #[test]
    fn replica_kv_events() {
        let c = from_args(&args("--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,kv_events=tcp://127.0.0.1:5557,kv_replay=tcp://localhost:5558,kv_capacity_tokens=1000 --metrics-interval 250ms --telemetry-stale-after 5s")).unwrap();
        let r = &c.replicas[0];
        assert_eq!(r.kv_events.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(r.kv_replay.as_deref(), Some("tcp://localhost:5558"));
        assert_eq!(r.kv_capacity_tokens, 1000);
        assert_eq!(c.telemetry.metrics_interval, Duration::from_millis(250));
        assert_eq!(c.telemetry.stale_after, Duration::from_secs(5));
        assert!(r.scrape_metrics());
        let c = from_args(&args(
            "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000 --replica http://127.0.0.1:8001,metrics=on",
        ))
        .unwrap();
        assert!(!c.replicas[0].scrape_metrics() && c.replicas[1].scrape_metrics());
        let e = from_args(&args(
            "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,metrics=sometimes",
        ))
        .unwrap_err()
        .unwrap();
        assert!(e.0.contains("metrics") && e.0.contains("sometimes"), "{e}");
        for bad_value in [
            "ipc:///tmp/x",
            "tcp://127.0.0.1",
            "tcp://:5557",
            "tcp://h:0",
            "tcp://h:99999",
        ] {
            let e = from_args(&args(&format!(
                "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,kv_events={bad_value}"
            )))
            .unwrap_err()
            .unwrap();
            assert!(e.0.contains("kv_events") && e.0.contains(bad_value), "{e}");
        }
        let e = from_args(&args(
            "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,kv_replay=tcp://h:1",
        ))
        .unwrap_err()
        .unwrap();
        assert!(
            e.0.contains("kv_replay") && e.0.contains("tcp://h:1"),
            "{e}"
        );

        let mut c = ServeConfig::default();
        apply_toml(&mut c, "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_events = \"tcp://127.0.0.1:5557\"\nkv_replay = \"tcp://127.0.0.1:5558\"\nkv_capacity_tokens = 2048\n").unwrap();
        assert_eq!(
            c.replicas[0].kv_events.as_deref(),
            Some("tcp://127.0.0.1:5557")
        );
        assert_eq!(
            c.replicas[0].kv_replay.as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        assert_eq!(c.replicas[0].kv_capacity_tokens, 2048);
        apply_toml(
            &mut c,
            "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nmetrics = true\n",
        )
        .unwrap();
        assert!(c.replicas[0].scrape_metrics());
        let e = apply_toml(
            &mut c,
            "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_events = \"udp://x:1\"\n",
        )
        .unwrap_err();
        assert!(
            e.0.contains("replica[0].kv_events") && e.0.contains("udp://x:1"),
            "{e}"
        );
        let e = apply_toml(
            &mut c,
            "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_events = 5\n",
        )
        .unwrap_err();
        assert!(e.0.contains("replica[0].kv_events"), "{e}");
    }

    #[test]
    fn every_policy_name_parses() {
        for name in PolicyName::NAMES.split(", ") {
            let p = PolicyName::parse(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(p.as_str(), name);
        }
    }

    #[test]
    fn example_file_is_valid() {
        let mut c = ServeConfig::default();
        apply_toml(&mut c, include_str!("../systemd/kvlb.toml")).unwrap();
        assert_eq!(c.replicas.len(), 2);
        assert_eq!(c.listen.len(), 1);
    }

    #[test]
    fn listener_modes() {
        let c = from_args(&args(
            "--listen 127.0.0.1:0 --listen 127.0.0.1:1 --mode l4 --l4-forwarding sockmap",
        ))
        .unwrap();
        assert_eq!(c.listen_modes, vec![ListenerMode::L4, ListenerMode::L4]);
        assert_eq!(c.l4_forwarding, L4Forwarding::Sockmap);
        let c = from_args(&args("--listen 127.0.0.1:0")).unwrap();
        assert_eq!(c.listener_mode(0), ListenerMode::L7);
        assert_eq!(c.l4_forwarding, L4Forwarding::Splice);
        let e = from_args(&args("--listen 127.0.0.1:0 --mode l5"))
            .unwrap_err()
            .unwrap();
        assert!(e.0.contains("--mode") && e.0.contains("l5"), "{e}");
        let e = from_args(&args("--listen 127.0.0.1:0 --l4-forwarding zerocopy"))
            .unwrap_err()
            .unwrap();
        assert!(
            e.0.contains("--l4-forwarding") && e.0.contains("zerocopy"),
            "{e}"
        );
        assert!(from_args(&args("--mode l4")).is_err());

        let mut c = ServeConfig::default();
        apply_toml(
            &mut c,
            "listen = [\"127.0.0.1:8000\"]\nl4_forwarding = \"sockmap\"\n[[listener]]\naddress = \"127.0.0.1:8001\"\nmode = \"l4\"\n[[listener]]\naddress = \"127.0.0.1:8002\"\n",
        )
        .unwrap();
        assert_eq!(c.listen.len(), 3);
        assert_eq!(
            c.listen_modes,
            vec![ListenerMode::L7, ListenerMode::L4, ListenerMode::L7]
        );
        assert_eq!(c.listen[1], "127.0.0.1:8001".parse().unwrap());
        assert_eq!(c.l4_forwarding, L4Forwarding::Sockmap);
        let e = apply_toml(
            &mut c,
            "[[listener]]\naddress = \"127.0.0.1:1\"\nmode = \"l3\"\n",
        )
        .unwrap_err();
        assert!(
            e.0.contains("listener[0].mode") && e.0.contains("l3"),
            "{e}"
        );
        let e = apply_toml(&mut c, "l4_forwarding = \"dma\"").unwrap_err();
        assert!(e.0.contains("l4_forwarding") && e.0.contains("dma"), "{e}");
        let e = apply_toml(&mut c, "[[listener]]\nmode = \"l4\"\n").unwrap_err();
        assert!(e.0.contains("listener[0].address"), "{e}");
        let e = apply_toml(
            &mut c,
            "[[listener]]\naddress = \"127.0.0.1:1\"\nport = 3\n",
        )
        .unwrap_err();
        assert!(e.0.contains("listener[0].port"), "{e}");
        // Flags replace the file's listeners, with their own mode.
        let dir = std::env::temp_dir().join(format!("kvlb-cfg-modes-{}", std::process::id()));
        std::fs::write(
            &dir,
            "[[listener]]\naddress = \"127.0.0.1:8001\"\nmode = \"l4\"\n",
        )
        .unwrap();
        let c = from_args(&args(&format!("--config {}", dir.display()))).unwrap();
        assert_eq!(c.listener_mode(0), ListenerMode::L4);
        let c = from_args(&args(&format!(
            "--config {} --listen 127.0.0.1:0",
            dir.display()
        )))
        .unwrap();
        assert_eq!(c.listener_mode(0), ListenerMode::L7);
        let _ = std::fs::remove_file(&dir);
    }

    #[test]
    fn toml_file() {
        let mut c = ServeConfig::default();
        apply_toml(&mut c, "listen = [\"127.0.0.1:0\"]\npolicy = \"power_of_two\"\nclient_timeout = \"5s\"\nworkers = 1\n[[replica]]\nurl = \"http://127.0.0.1:9000\"\n[[replica]]\nurl = \"http://localhost:9001\"\n").unwrap();
        assert_eq!(c.policy, PolicyName::PowerOfTwo);
        assert_eq!(c.replicas.len(), 2);
        assert_eq!(c.workers, 1);
        let e = apply_toml(&mut c, "policy = \"x\"").unwrap_err();
        assert!(e.0.contains("policy") && e.0.contains("\"x\""), "{e}");
        let e = apply_toml(&mut c, "[[replica]]\nurl = \"http://a:b:c\"").unwrap_err();
        assert!(e.0.contains("replica[0].url"), "{e}");
        let e = apply_toml(&mut c, "bogus = 1").unwrap_err();
        assert!(e.0.contains("bogus"), "{e}");
    }

    #[test]
    fn replica_load_knobs_in_the_cost_model() {
        let mut c = ServeConfig::default();
        apply_toml(
            &mut c,
            "[cost_model]\nforeign_request_tokens = 2048\nkv_evict_from = 0.8\nkv_hit_keep_at_full = 0.25\nbacklog_weight = 0.3\n",
        )
        .unwrap();
        let p = c.cost_model.policy_config();
        assert_eq!(p.backlog_weight, 0.3);
        assert_eq!(p.foreign_request_tokens, 2048);
        assert_eq!(p.kv_evict_from, 0.8);
        assert_eq!(p.kv_hit_keep_at_full, 0.25);
        let e = apply_toml(&mut c, "[cost_model]\nkv_evict_from = 1.5\n").unwrap_err();
        assert!(e.0.contains("kv_evict_from") && e.0.contains("1.5"), "{e}");
        let base = "--listen 127.0.0.1:0 --replica http://127.0.0.1:9000";
        let c = from_args(&args(&format!(
            "{base} --kv-hit-keep-at-full 0.5 --splice-responses-from 4MiB"
        )))
        .unwrap();
        assert_eq!(c.cost_model.kv_hit_keep_at_full, 0.5);
        assert_eq!(c.splice_responses_from, 4 << 20);
        let c = from_args(&args(&format!("{base} --splice-responses-from off"))).unwrap();
        assert_eq!(c.splice_responses_from, 0);
        assert!(from_args(&args(&format!("{base} --splice-responses-from lots"))).is_err());
    }

    #[test]
    fn offload_tier_keys() {
        let mut c = ServeConfig::default();
        assert_eq!(c.cost_model.offload_load_cost, 0.25);
        apply_toml(
            &mut c,
            "[cost_model]\noffload_load_cost = 0.5\n[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_capacity_tokens = 1000\n[[replica]]\nurl = \"http://127.0.0.1:9001\"\nkv_capacity_tokens = 1000\nkv_offload_capacity_tokens = 3000\n",
        )
        .unwrap();
        assert_eq!(c.cost_model.policy_config().offload_load_cost, 0.5);
        assert_eq!(c.replicas[0].kv_offload_capacity_tokens, None);
        assert_eq!(c.replicas[0].offload_capacity_tokens(), 8000);
        assert_eq!(c.replicas[1].offload_capacity_tokens(), 3000);
        for bad in ["1.5", "-0.1", "\"cheap\""] {
            let e = apply_toml(
                &mut c,
                &format!("[cost_model]\noffload_load_cost = {bad}\n"),
            )
            .unwrap_err();
            assert!(e.0.contains("cost_model.offload_load_cost"), "{e}");
        }
        let e = apply_toml(
            &mut c,
            "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_offload_capacity_tokens = 0\n",
        )
        .unwrap_err();
        assert!(e.0.contains("replica[0].kv_offload_capacity_tokens"), "{e}");
        let base =
            "--listen 127.0.0.1:0 --replica http://127.0.0.1:9000,kv_offload_capacity_tokens=";
        let c = from_args(&args(&format!("{base}4096 --offload-load-cost 1"))).unwrap();
        assert_eq!(c.replicas[0].offload_capacity_tokens(), 4096);
        assert_eq!(c.cost_model.offload_load_cost, 1.0);
        let e = from_args(&args(&format!("{base}lots")))
            .unwrap_err()
            .unwrap();
        assert!(e.0.contains("kv_offload_capacity_tokens"), "{e}");
        let e = from_args(&args(&format!("{base}1 --offload-load-cost 2")))
            .unwrap_err()
            .unwrap();
        assert!(e.0.contains("--offload-load-cost"), "{e}");
    }
}

#[cfg(test)]
mod example_file {
    /// The example shipped for systemd parses and means what its comments say.
    #[test]
    fn systemd_example_parses() {
        let mut c = super::ServeConfig::default();
        super::apply_toml(&mut c, include_str!("../systemd/kvlb.toml")).unwrap();
        assert_eq!(c.policy, super::PolicyName::CacheAware);
        assert_eq!(c.replicas.len(), 2);
        assert!(c.replicas[0].kv_events.is_some());
        assert_eq!(c.health.retries, 1);
    }
}
