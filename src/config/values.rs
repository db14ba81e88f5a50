//! The value types of settings. Each parses from a flag's text (`FromStr`, whose error says
//! what is expected; clap adds the flag and the value) and from a TOML value (a string, a
//! number or a boolean, read as that text; the error adds the value and serde_path_to_error
//! the key). One parser per kind of value, so a flag and its file key can never disagree.

#![forbid(unsafe_code)]

use super::{
    bad, check_dns_server, check_dns_source, parse_addr, parse_cores, parse_duration,
    parse_duration_or_off, parse_probe_path, parse_replica_url, parse_size, parse_switch,
    parse_zmq_endpoint, ConfigError, Disaggregate, L4Forwarding, ListenerMode, ReplicaConfig, Role,
    MAX_DP_SIZE,
};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

fn why(e: ConfigError) -> String {
    e.0
}

use kvlb_core::text::from_text;

macro_rules! deserialize_from_text {
    ($($t:ty),* $(,)?) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                from_text(d)
            }
        }
    )*};
}

deserialize_from_text!(
    Addr,
    Dur,
    AffinityTtl,
    DurOrOff,
    Size,
    SizeOrOff,
    Seconds,
    Fraction,
    Switch,
    Cores,
    ListenerMode,
    L4Forwarding,
    Disaggregate,
    ZmqEndpoint,
    LoraAdapterSpec,
    ReplicaUrl,
    UrlPath,
    ProbePath,
    OffOrPath,
    DnsSource,
    DnsServer,
    Secret,
);

impl<'de, const MIN: u64, const MAX: u64> Deserialize<'de> for Whole<MIN, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        from_text(d)
    }
}

/// `HOST:PORT` (a name is resolved once, at load).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Addr(pub SocketAddr);

impl FromStr for Addr {
    type Err = String;
    fn from_str(s: &str) -> Result<Addr, String> {
        parse_addr("", s).map(Addr).map_err(why)
    }
}

/// `500ms`, `10s`, `2m`, `1h` or seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dur(pub Duration);

impl FromStr for Dur {
    type Err = String;
    fn from_str(s: &str) -> Result<Dur, String> {
        parse_duration("", s).map(Dur).map_err(why)
    }
}

/// How long a response id's replica is remembered: a duration above 0, at most 24 days (what
/// the affinity table's clock tells apart).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AffinityTtl(pub Duration);

impl FromStr for AffinityTtl {
    type Err = String;
    fn from_str(s: &str) -> Result<AffinityTtl, String> {
        let d = parse_duration("", s).map_err(why)?;
        let max = Duration::from_millis(kvlb_core::affinity::MAX_TTL_MS);
        if d.is_zero() || d > max {
            return Err(format!(
                "expected a duration above 0 and at most {}d",
                max.as_secs() / 86_400
            ));
        }
        Ok(AffinityTtl(d))
    }
}

/// A duration, or `0` / `off` for none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DurOrOff(pub Duration);

impl FromStr for DurOrOff {
    type Err = String;
    fn from_str(s: &str) -> Result<DurOrOff, String> {
        parse_duration_or_off("", s).map(DurOrOff).map_err(why)
    }
}

/// `65536`, `64KiB`, `8MiB`, `1GiB`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Size(pub usize);

impl FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> Result<Size, String> {
        parse_size("", s).map(Size).map_err(why)
    }
}

/// A size, or `0` / `off` for never.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeOrOff(pub usize);

impl FromStr for SizeOrOff {
    type Err = String;
    fn from_str(s: &str) -> Result<SizeOrOff, String> {
        match s.trim() {
            "0" | "off" => Ok(SizeOrOff(0)),
            _ => parse_size("", s)
                .map(SizeOrOff)
                .map_err(|e| format!("{}, or 0 / off", e.0)),
        }
    }
}

/// A whole number from MIN to MAX.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Whole<const MIN: u64, const MAX: u64>(pub u64);

impl<const MIN: u64, const MAX: u64> FromStr for Whole<MIN, MAX> {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        crate::cli::int::<u64, MIN, MAX>(s.trim()).map(Whole)
    }
}

macro_rules! real {
    ($(#[$doc:meta])* $name:ident, $ok:expr, $why:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct $name(pub f64);

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<$name, String> {
                let ok: fn(f64) -> bool = $ok;
                s.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && ok(*x))
                    .map($name)
                    .ok_or_else(|| $why.to_string())
            }
        }
    };
}

real!(
    /// Seconds of a cost model term, >= 0.
    Seconds,
    |x| x >= 0.0,
    "expected seconds >= 0, e.g. 0.0000335"
);
real!(
    /// A fraction from 0 to 1.
    Fraction,
    |x| (0.0..=1.0).contains(&x),
    "expected a fraction from 0 to 1"
);

/// `true`/`false` (also `on`/`off`, `yes`/`no`, `1`/`0`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Switch(pub bool);

impl FromStr for Switch {
    type Err = String;
    fn from_str(s: &str) -> Result<Switch, String> {
        parse_switch("", s).map(Switch).map_err(why)
    }
}

/// A core list: `0`, `2-5`, `0,2`, `0-1,4`.
#[derive(Debug, Clone, PartialEq)]
pub struct Cores(pub Vec<usize>);

impl FromStr for Cores {
    type Err = String;
    fn from_str(s: &str) -> Result<Cores, String> {
        parse_cores("", s).map(Cores).map_err(why)
    }
}

impl FromStr for ListenerMode {
    type Err = String;
    fn from_str(s: &str) -> Result<ListenerMode, String> {
        ListenerMode::parse("", s).map_err(why)
    }
}

impl FromStr for Disaggregate {
    type Err = String;
    fn from_str(s: &str) -> Result<Disaggregate, String> {
        Disaggregate::parse("", s).map_err(why)
    }
}

impl FromStr for L4Forwarding {
    type Err = String;
    fn from_str(s: &str) -> Result<L4Forwarding, String> {
        L4Forwarding::parse("", s).map_err(why)
    }
}

/// `tcp://HOST:PORT`.
#[derive(Debug, Clone, PartialEq)]
pub struct ZmqEndpoint(pub String);

impl FromStr for ZmqEndpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<ZmqEndpoint, String> {
        parse_zmq_endpoint("", s).map(ZmqEndpoint).map_err(why)
    }
}

/// The model names a replica serves: a list of strings in the file, `NAME|NAME...` in the
/// --replica flag (whose options are separated by commas).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelNames(pub Vec<String>);

impl ModelNames {
    fn checked(names: Vec<String>) -> Result<ModelNames, String> {
        let max = crate::models::MODEL_BYTES;
        if names.is_empty() {
            return Err("expected at least one model name".into());
        }
        for n in &names {
            if n.trim().is_empty() || n.len() > max || n.trim() != n {
                return Err(format!(
                    "{n:?}: a model name is 1 to {max} bytes, without surrounding spaces"
                ));
            }
        }
        Ok(ModelNames(names))
    }
}

impl FromStr for ModelNames {
    type Err = String;
    fn from_str(s: &str) -> Result<ModelNames, String> {
        ModelNames::checked(s.split('|').map(str::to_string).collect())
    }
}

impl<'de> Deserialize<'de> for ModelNames {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let names: Vec<String> = one_or_many(d)?;
        match names.as_slice() {
            // One string is the flag's form.
            [one] => one.parse(),
            _ => ModelNames::checked(names),
        }
        .map_err(de::Error::custom)
    }
}

/// A LoRA adapter kvlb may load: `NAME=PATH[,base=MODEL]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapterSpec(pub crate::config::LoraAdapter);

impl FromStr for LoraAdapterSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<LoraAdapterSpec, String> {
        let err = || {
            format!(
                "{s:?}: expected NAME=PATH[,base=MODEL], e.g. sql=/adapters/sql,base=Qwen/Qwen3-8B"
            )
        };
        let mut parts = s.split(',');
        let (name, path) = parts
            .next()
            .and_then(|p| p.split_once('='))
            .ok_or_else(err)?;
        let mut base = None;
        for opt in parts {
            match opt.split_once('=') {
                Some(("base", b)) if !b.is_empty() && base.is_none() => base = Some(b.to_string()),
                _ => return Err(err()),
            }
        }
        let max = crate::models::MODEL_BYTES;
        if name.is_empty() || name.len() > max || name.trim() != name || path.is_empty() {
            return Err(err());
        }
        Ok(LoraAdapterSpec(crate::config::LoraAdapter {
            name: name.to_string(),
            path: path.to_string(),
            base,
        }))
    }
}

/// A replica's `http://HOST:PORT` alone (a `[[replica]]` table's `url`).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaUrl(pub ReplicaConfig);

impl FromStr for ReplicaUrl {
    type Err = String;
    fn from_str(s: &str) -> Result<ReplicaUrl, String> {
        parse_replica_url("", s).map(ReplicaUrl).map_err(why)
    }
}

/// A replica: `URL[,OPTION=VALUE...]` on the command line, a `[[replica]]` table in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaSpec(pub ReplicaConfig);

impl FromStr for ReplicaSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<ReplicaSpec, String> {
        parse_replica_flag("", s).map(ReplicaSpec).map_err(why)
    }
}

/// One option of a replica: `NAME=VALUE` after its URL on the command line, key `NAME` of its
/// `[[replica]]` table in the file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaOption {
    pub name: &'static str,
    /// What the value looks like (`N`, `tcp://HOST:PORT`).
    pub value: &'static str,
    /// What it does (its doc comment below, on one line).
    pub doc: &'static str,
}

/// Declares the replica options once: each is a field of `ReplicaTable` (the file's keys and
/// the flag's options, both read by serde through the field's type: its validation) and an
/// entry of `REPLICA_OPTIONS` (the help of --replica and the configuration reference).
macro_rules! replica_options {
    ($($(#[doc = $doc:literal])+ $name:ident: $ty:ty = $value:literal;)*) => {
        /// A `[[replica]]` table, or the options of `--replica URL,OPTION=VALUE...`.
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct ReplicaTable {
            url: ReplicaUrl,
            $(#[serde(default, deserialize_with = "present")]
            $name: Option<$ty>,)*
        }

        /// Every replica option, in the order of the declaration.
        pub const REPLICA_OPTIONS: &[ReplicaOption] = &[$(ReplicaOption {
            name: stringify!($name),
            value: $value,
            doc: concat!($($doc),+),
        },)*];
    };
}

replica_options! {
    /// its KV cache in tokens, of each rank with dp_size (default 400000)
    kv_capacity_tokens: Whole<1, { u64::MAX }> = "N";
    /// its offloaded tier (CPU, disk; default 8x kv_capacity_tokens)
    kv_offload_capacity_tokens: Whole<1, { u64::MAX }> = "N";
    /// its KV event publisher (with dp_size: rank 0's; rank r publishes on port + r)
    kv_events: ZmqEndpoint = "tcp://HOST:PORT";
    /// its replay endpoint (with dp_size: rank 0's; rank r answers on port + r)
    kv_replay: ZmqEndpoint = "tcp://HOST:PORT";
    /// poll its /metrics (default: on with kv_events)
    metrics: Switch = "on|off";
    /// its own limit of requests in flight (of each rank with dp_size)
    max_in_flight: Whole<0, 1_000_000> = "N";
    /// data-parallel ranks behind the URL (vLLM --data-parallel-size with its internal load
    /// balancer, SGLang --enable-dp-attention --dp-size): each rank is a replica named URL#r,
    /// sent requests with X-Data-Parallel-Rank: r, its events on the kv_events and kv_replay
    /// ports + r (default 1)
    dp_size: Whole<1, MAX_DP_SIZE> = "N";
    /// the model names it serves, aliases and LoRA adapters included (NAME|NAME on the
    /// command line, a list in the file); requests naming a model go only to replicas serving
    /// it. Default: what the replica lists in its GET /v1/models, asked every models_refresh
    models: ModelNames = "NAME|NAME";
    /// its part in prefill/decode disaggregation: prefill (computes prompts and hands their KV
    /// cache to a decode replica), decode (continues from that KV), or both (default: no
    /// disaggregation). A model with replicas of both roles prefill and decode is served
    /// disaggregated: by vLLM's protocol (kv_transfer_params), or SGLang's where the prefill
    /// replicas name a bootstrap_port
    role: Role = "prefill|decode|both";
    /// with role=prefill, an SGLang replica's bootstrap server port
    /// (--disaggregation-bootstrap-port, 8998 by default): the replica speaks SGLang's
    /// disaggregation (bootstrap_host, bootstrap_port and a bootstrap_room kvlb draws, in the
    /// body sent to it and to a decode replica at once)
    bootstrap_port: Whole<1, 65535> = "PORT";
}

/// A key that is there holds a value (the flag's options are plain text, which has no
/// "none"; an absent key is None by `default`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

impl ReplicaTable {
    /// The replica these options describe, checked across options; errors name `key` (the
    /// flag's or the file's, empty when the caller names it) and the option.
    fn into_config(self, key: &str) -> Result<ReplicaConfig, ConfigError> {
        // Every field by name: an option declared above and not applied here does not compile.
        let ReplicaTable {
            url,
            kv_capacity_tokens,
            kv_offload_capacity_tokens,
            kv_events,
            kv_replay,
            metrics,
            max_in_flight,
            dp_size,
            models,
            role,
            bootstrap_port,
        } = self;
        let mut r = url.0;
        if let Some(n) = kv_capacity_tokens {
            r.kv_capacity_tokens = n.0;
        }
        r.kv_offload_capacity_tokens = kv_offload_capacity_tokens.map(|n| n.0);
        r.kv_events = kv_events.map(|e| e.0);
        r.kv_replay = kv_replay.map(|e| e.0);
        r.metrics = metrics.map(|m| m.0);
        r.max_in_flight = max_in_flight.map(|n| n.0 as u32);
        r.dp_size = dp_size.map_or(1, |n| n.0 as u32);
        r.models = models.map(|m| m.0);
        r.role = role.unwrap_or_default();
        r.bootstrap_port = bootstrap_port.map(|p| p.0 as u16);
        super::check_replay(key, &r)?;
        super::check_bootstrap_port(key, &r)?;
        super::check_dp_size(key, &r)?;
        Ok(r)
    }
}

/// `URL[,OPTION=VALUE...]` as given to --replica (and built by the admin API and DNS
/// discovery): the options go through the same table as the file's.
pub fn parse_replica_flag(key: &str, v: &str) -> Result<ReplicaConfig, ConfigError> {
    let mut parts = v.split(',');
    let url = parts.next().unwrap_or("");
    let mut pairs: Vec<(&str, &str)> = vec![("url", url)];
    for opt in parts {
        let (k, val) = opt
            .split_once('=')
            .ok_or_else(|| bad(key, v, "expected URL[,key=value...]"))?;
        if !REPLICA_OPTIONS.iter().any(|o| o.name == k) {
            let known: Vec<&str> = REPLICA_OPTIONS.iter().map(|o| o.name).collect();
            return Err(bad(
                key,
                v,
                &format!("unknown replica option {k:?} (known: {})", known.join(", ")),
            ));
        }
        if pairs.iter().any(|(seen, _)| *seen == k) {
            // The last would win silently.
            return Err(bad(
                key,
                v,
                &format!("replica option {k:?} given twice (one value each)"),
            ));
        }
        pairs.push((k, val));
    }
    let table: ReplicaTable = serde_path_to_error::deserialize(de::value::MapDeserializer::<
        _,
        de::value::Error,
    >::new(pairs.iter().copied()))
    .map_err(|e| {
        let option = e.path().to_string();
        let value = pairs
            .iter()
            .find(|(k, _)| *k == option)
            .map_or("", |(_, val)| *val);
        let msg = e.into_inner().to_string();
        // A value's parser wrote `"value": why`.
        let reason = msg
            .strip_prefix(&format!("{value:?}: "))
            .unwrap_or(&msg)
            .to_string();
        match option.as_str() {
            "url" => bad(key, url, &reason),
            _ => bad(&format!("{key} {option}"), value, &reason),
        }
    })?;
    table.into_config(key)
}

/// The help of --replica, its options listed from `REPLICA_OPTIONS`.
pub fn replica_flag_help() -> String {
    let options: Vec<String> = REPLICA_OPTIONS
        .iter()
        .map(|o| format!("{}={}, {}", o.name, o.value, o.doc.trim()))
        .collect();
    format!(
        "A replica, repeatable: its base URL (http://10.0.0.5:8000), with options after commas.\n\n\
         Options: {}. In the file `[[replica]]` tables with `url` and these keys. Flags replace \
         the file's replicas. Responses name the URL in x-kvlb-replica.",
        options.join("; ")
    )
}

impl<'de> Deserialize<'de> for ReplicaSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Table;
        impl<'de> Visitor<'de> for Table {
            type Value = ReplicaSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a [[replica]] table with url = \"http://HOST:PORT\"")
            }
            fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<ReplicaSpec, M::Error> {
                let t = ReplicaTable::deserialize(de::value::MapAccessDeserializer::new(map))?;
                t.into_config("")
                    .map(ReplicaSpec)
                    .map_err(|e| de::Error::custom(e.0))
            }
        }
        d.deserialize_map(Table)
    }
}

/// A `[[listener]]` table.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTable {
    /// `HOST:PORT`.
    pub address: Addr,
    /// `l7` (the default) or `l4`.
    pub mode: Option<ListenerMode>,
}

/// An absolute path such as `/health`.
#[derive(Debug, Clone, PartialEq)]
pub struct UrlPath(pub String);

impl FromStr for UrlPath {
    type Err = String;
    fn from_str(s: &str) -> Result<UrlPath, String> {
        if !s.starts_with('/') || s.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err("expected an absolute path such as /health".into());
        }
        Ok(UrlPath(s.to_string()))
    }
}

/// A path kvlb answers itself, or `off`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbePath(pub Option<String>);

impl FromStr for ProbePath {
    type Err = String;
    fn from_str(s: &str) -> Result<ProbePath, String> {
        parse_probe_path("", s).map(ProbePath).map_err(why)
    }
}

/// A file path, or `off` (or empty) for none.
#[derive(Debug, Clone, PartialEq)]
pub struct OffOrPath(pub Option<String>);

impl FromStr for OffOrPath {
    type Err = String;
    fn from_str(s: &str) -> Result<OffOrPath, String> {
        Ok(OffOrPath(match s.trim() {
            "" | "off" => None,
            path => Some(path.to_string()),
        }))
    }
}

/// A DNS replica source: `dns://NAME:PORT` or `dns+srv://NAME`, with options.
#[derive(Debug, Clone, PartialEq)]
pub struct DnsSource(pub String);

impl FromStr for DnsSource {
    type Err = String;
    fn from_str(s: &str) -> Result<DnsSource, String> {
        check_dns_source("", s).map_err(why)?;
        Ok(DnsSource(s.to_string()))
    }
}

/// A resolver: `IP[:PORT]`.
#[derive(Debug, Clone, PartialEq)]
pub struct DnsServer(pub String);

impl FromStr for DnsServer {
    type Err = String;
    fn from_str(s: &str) -> Result<DnsServer, String> {
        check_dns_server("", s).map_err(why)?;
        Ok(DnsServer(s.to_string()))
    }
}

/// A secret (admin token, API key): checked where it is applied, so that no error echoes it.
#[derive(Clone, PartialEq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<hidden>)")
    }
}

impl FromStr for Secret {
    type Err = String;
    fn from_str(s: &str) -> Result<Secret, String> {
        Ok(Secret(s.to_string()))
    }
}

/// A file list that may also be written as one string: `listen = "0.0.0.0:8000"`.
pub fn one_or_many<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct List<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for List<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of strings, or one string")
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::new();
            while let Some(x) = seq.next_element()? {
                out.push(x);
            }
            Ok(out)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<T>, E> {
            T::deserialize(de::value::StrDeserializer::<E>::new(v)).map(|x| vec![x])
        }
    }
    d.deserialize_any(List(std::marker::PhantomData))
}
