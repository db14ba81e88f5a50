//! Replica discovery by DNS: the fleet behind a name, re-resolved on an interval.
//!
//! This is what a Kubernetes headless service gives (one record per ready pod), or any DNS
//! zone listing replicas. Two forms of source, written like `--replica` values:
//!
//! ```text
//! dns://NAME:PORT[,key=value...]      A and AAAA records of NAME; each address:PORT is a replica
//! dns+srv://NAME[,key=value...]       SRV records of NAME (e.g. _http._tcp.vllm.default.svc.cluster.local);
//!                                     each target's A/AAAA addresses at the record's port are replicas
//! ```
//!
//! Options of the source itself:
//! * `interval=DURATION` (`500ms`, `5s`, `1m`; default 5s): time between resolutions.
//! * `family=any|ipv4|ipv6` (default `any`): which address records to ask for.
//!
//! Every other option is a replica option copied to each replica found (the keys of
//! `--replica`: see [`REPLICA_OPTIONS`]); `{host}` in a value becomes the replica's address
//! (IPv6 in brackets) and `{port}` its port, e.g. `kv_events=tcp://{host}:5557`.
//! [`DnsSource::replica_flag`] writes the `--replica` value of one found address.
//!
//! SRV details: all targets are used whatever their priority and weight (kvlb balances by its
//! own cost model); a target of `.` (service explicitly unavailable) is skipped. Targets'
//! addresses come from the response's additional section when it has them, else from A/AAAA
//! queries. CNAMEs are followed inside each response.
//!
//! NXDOMAIN is an answer: the fleet is empty. SERVFAIL, timeouts and broken responses are
//! failures: [`Discovery`] keeps the last good set and says so once (then at most once a
//! minute while it lasts).
//!
//! TTLs are not used: a source is re-resolved every `interval` whatever the records' TTL.
//! Asking a caching resolver before the TTL ends costs one cheap round trip and returns the
//! cached answer; making the TTL a lower bound would only slow down noticing scale-ups when a
//! zone's TTL (30 s for CoreDNS' kubernetes plugin by default) exceeds the interval.

pub mod dns;

use dns::{Client, DnsError, RCODE_NXDOMAIN, TYPE_A, TYPE_AAAA, TYPE_SRV};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Time between resolutions when the source sets no `interval`.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
/// A sensible per-try timeout for [`resolve`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// Rounds over all resolvers before a query fails.
pub const ATTEMPTS: u32 = 2;
/// While resolution keeps failing, one log line at most this often.
pub const FAILURE_LOG_PERIOD: Duration = Duration::from_secs(60);
/// Distinct SRV targets one resolution follows at most (each may cost address queries).
pub const MAX_SRV_TARGETS: usize = 4096;
/// Replica options a source may carry (those of `--replica URL,key=value`).
/// (`role` and `bootstrap_port`: one source per pool of a disaggregated fleet, such as a
/// headless service of the prefill pods and one of the decode pods.)
pub const REPLICA_OPTIONS: &[&str] = &[
    "kv_capacity_tokens",
    "kv_events",
    "kv_replay",
    "metrics",
    "role",
    "bootstrap_port",
];

const MIN_INTERVAL: Duration = Duration::from_millis(10);
/// The runner checks its stop flag at least this often while waiting.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Which records name the replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DnsKind {
    /// A and/or AAAA records of the name, each with the source's port.
    A,
    /// SRV records of the name: target and port of each.
    Srv,
}

/// Which address records to ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Any,
    Ipv4,
    Ipv6,
}

impl Family {
    fn qtypes(self) -> &'static [u16] {
        match self {
            Family::Any => &[TYPE_A, TYPE_AAAA],
            Family::Ipv4 => &[TYPE_A],
            Family::Ipv6 => &[TYPE_AAAA],
        }
    }

    fn admits(self, ip: &IpAddr) -> bool {
        match self {
            Family::Any => true,
            Family::Ipv4 => ip.is_ipv4(),
            Family::Ipv6 => ip.is_ipv6(),
        }
    }
}

/// One configured DNS source of replicas.
#[derive(Debug, Clone, PartialEq)]
pub struct DnsSource {
    /// The source as configured (for logs and errors).
    pub spec: String,
    /// The name to query, lower case, no trailing dot.
    pub name: String,
    pub kind: DnsKind,
    /// The replicas' port for [`DnsKind::A`]; 0 for SRV (each record has its port).
    pub port: u16,
    pub family: Family,
    pub interval: Duration,
    /// Replica options in order, values still holding `{host}` / `{port}`.
    pub replica_options: Vec<(String, String)>,
}

/// Why discovery could not be configured or a resolution failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryError {
    /// The source string is invalid.
    Spec { spec: String, why: String },
    /// No usable resolver (bad `dns_servers` entry, or none in /etc/resolv.conf).
    Resolvers(String),
    /// Asking `name` failed.
    Dns { name: String, error: DnsError },
}

impl fmt::Display for DiscoveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiscoveryError::Spec { spec, why } => write!(f, "replica DNS source {spec:?}: {why}"),
            DiscoveryError::Resolvers(why) => write!(f, "DNS resolvers: {why}"),
            DiscoveryError::Dns { name, error } => write!(f, "resolving {name}: {error}"),
        }
    }
}

impl std::error::Error for DiscoveryError {}

/// `500ms`, `5s`, `2m`, or a bare number of seconds.
fn parse_interval(v: &str) -> Option<Duration> {
    let (num, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => v.split_at(i),
        None => (v, "s"),
    };
    let n: u64 = num.parse().ok()?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.checked_mul(60)?),
        _ => return None,
    };
    (MIN_INTERVAL..=Duration::from_secs(86_400))
        .contains(&d)
        .then_some(d)
}

impl DnsSource {
    /// Parses `dns://NAME:PORT[,k=v...]` or `dns+srv://NAME[,k=v...]` (see the module header).
    pub fn parse(spec: &str) -> Result<DnsSource, DiscoveryError> {
        let bad = |why: String| DiscoveryError::Spec {
            spec: spec.to_string(),
            why,
        };
        let mut parts = spec.split(',');
        let head = parts.next().unwrap_or("");
        let (kind, rest) = if let Some(r) = head.strip_prefix("dns+srv://") {
            (DnsKind::Srv, r)
        } else if let Some(r) = head.strip_prefix("dns://") {
            (DnsKind::A, r)
        } else {
            return Err(bad(
                "expected dns://NAME:PORT (A/AAAA records) or dns+srv://NAME (SRV records)".into(),
            ));
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (name, port) = match kind {
            DnsKind::A => {
                let (n, p) = rest.rsplit_once(':').ok_or_else(|| {
                    bad("dns:// needs the replicas' port: dns://NAME:PORT".into())
                })?;
                let port = p
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| bad(format!("invalid port {p:?} (1..=65535)")))?;
                (n, port)
            }
            DnsKind::Srv => {
                if rest.contains(':') {
                    return Err(bad(
                        "dns+srv:// takes no port: each SRV record carries its own".into(),
                    ));
                }
                (rest, 0)
            }
        };
        if name.parse::<IpAddr>().is_ok()
            || name
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<IpAddr>()
                .is_ok()
        {
            return Err(bad(
                "that is an address, not a name: use --replica http://ADDR:PORT".into(),
            ));
        }
        let name = dns::normalize_name(name).map_err(|e| bad(e.to_string()))?;
        let mut source = DnsSource {
            spec: spec.to_string(),
            name,
            kind,
            port,
            family: Family::Any,
            interval: DEFAULT_INTERVAL,
            replica_options: Vec::new(),
        };
        for opt in parts {
            let (k, v) = opt
                .split_once('=')
                .ok_or_else(|| bad(format!("option {opt:?} is not key=value")))?;
            match k {
                "interval" => {
                    source.interval = parse_interval(v).ok_or_else(|| {
                        bad(format!(
                            "interval={v:?}: expected a duration from 10ms to 24h (500ms, 5s, 1m)"
                        ))
                    })?
                }
                "family" => {
                    source.family = match v {
                        "any" => Family::Any,
                        "ipv4" => Family::Ipv4,
                        "ipv6" => Family::Ipv6,
                        _ => return Err(bad(format!("family={v:?}: expected any, ipv4 or ipv6"))),
                    }
                }
                k if REPLICA_OPTIONS.contains(&k) => {
                    if source.replica_options.iter().any(|(o, _)| o == k) {
                        return Err(bad(format!("option {k} given twice")));
                    }
                    source.replica_options.push((k.to_string(), v.to_string()))
                }
                _ => {
                    return Err(bad(format!(
                        "unknown option {k:?} (known: interval, family, {})",
                        REPLICA_OPTIONS.join(", ")
                    )))
                }
            }
        }
        Ok(source)
    }

    /// The `--replica` value for a replica found at `addr`: `http://ADDR[,key=value...]` with
    /// `{host}` and `{port}` filled in.
    pub fn replica_flag(&self, addr: SocketAddr) -> String {
        let host = match addr.ip() {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        let port = addr.port().to_string();
        let mut out = format!("http://{addr}");
        for (k, v) in &self.replica_options {
            out.push(',');
            out.push_str(k);
            out.push('=');
            out.push_str(&v.replace("{host}", &host).replace("{port}", &port));
        }
        out
    }
}

/// A `dns_servers` entry: `IP` (port 53) or `IP:PORT` / `[IPV6]:PORT`.
pub fn parse_dns_server(v: &str) -> Result<SocketAddr, DiscoveryError> {
    if let Ok(a) = v.parse::<SocketAddr>() {
        return Ok(a);
    }
    match v.parse::<IpAddr>() {
        Ok(ip) => Ok(SocketAddr::new(ip, 53)),
        Err(_) => Err(DiscoveryError::Resolvers(format!(
            "dns_servers entry {v:?}: expected IP or IP:PORT, e.g. 10.96.0.10 or 127.0.0.1:5353"
        ))),
    }
}

/// The resolvers to ask: the configured `dns_servers` when any, else the `nameserver` lines
/// of /etc/resolv.conf.
pub fn resolvers(configured: &[String]) -> Result<Vec<SocketAddr>, DiscoveryError> {
    if !configured.is_empty() {
        return configured.iter().map(|s| parse_dns_server(s)).collect();
    }
    let text = std::fs::read_to_string("/etc/resolv.conf").map_err(|e| {
        DiscoveryError::Resolvers(format!(
            "no dns_servers configured and /etc/resolv.conf is unreadable: {e}"
        ))
    })?;
    let found = dns::parse_resolv_conf(&text);
    if found.is_empty() {
        return Err(DiscoveryError::Resolvers(
            "no dns_servers configured and no usable nameserver line in /etc/resolv.conf".into(),
        ));
    }
    Ok(found)
}

fn dns_err(name: &str) -> impl Fn(DnsError) -> DiscoveryError + '_ {
    move |error| DiscoveryError::Dns {
        name: name.to_string(),
        error,
    }
}

/// The addresses of `name` (A/AAAA per `family`), asking the resolvers. NXDOMAIN: none.
fn lookup_addresses(
    client: &mut Client,
    name: &str,
    family: Family,
) -> Result<Vec<IpAddr>, DiscoveryError> {
    let mut out = Vec::new();
    for &qtype in family.qtypes() {
        let m = client.query(name, qtype).map_err(dns_err(name))?;
        if m.rcode == RCODE_NXDOMAIN {
            continue;
        }
        for r in dns::follow(&m.answers, name, qtype).map_err(dns_err(name))? {
            match r.data {
                dns::RData::A(a) => out.push(IpAddr::V4(a)),
                dns::RData::Aaaa(a) => out.push(IpAddr::V6(a)),
                _ => {}
            }
        }
    }
    Ok(out)
}

/// Resolves `source` once: its replicas' addresses, sorted and deduplicated. `timeout`
/// bounds one try at one resolver ([`ATTEMPTS`] rounds over all `resolvers`).
pub fn resolve(
    source: &DnsSource,
    resolvers: &[SocketAddr],
    timeout: Duration,
) -> Result<Vec<SocketAddr>, DiscoveryError> {
    if resolvers.is_empty() {
        return Err(DiscoveryError::Resolvers(DnsError::NoServers.to_string()));
    }
    let mut client = Client::new(resolvers.to_vec(), timeout, ATTEMPTS, dns::random_seed());
    let mut out: Vec<SocketAddr> = Vec::new();
    match source.kind {
        DnsKind::A => {
            for ip in lookup_addresses(&mut client, &source.name, source.family)? {
                out.push(SocketAddr::new(ip, source.port));
            }
        }
        DnsKind::Srv => {
            let name = &source.name;
            let m = client.query(name, TYPE_SRV).map_err(dns_err(name))?;
            if m.rcode != RCODE_NXDOMAIN {
                let mut targets: Vec<(String, u16)> = Vec::new();
                for r in dns::follow(&m.answers, name, TYPE_SRV).map_err(dns_err(name))? {
                    if let dns::RData::Srv { port, target, .. } = &r.data {
                        if !target.is_empty() && *port != 0 {
                            targets.push((target.clone(), *port));
                        }
                    }
                }
                // Addresses the response already carries (additional section, or answers).
                let mut known: Vec<dns::Record> = m.additionals;
                known.extend(m.answers);
                let mut cache: Vec<(String, Vec<IpAddr>)> = Vec::new();
                for (target, port) in targets {
                    if !cache.iter().any(|(t, _)| *t == target) {
                        if cache.len() == MAX_SRV_TARGETS {
                            return Err(DiscoveryError::Dns {
                                name: name.clone(),
                                error: DnsError::TooManyTargets(MAX_SRV_TARGETS),
                            });
                        }
                        let mut ips: Vec<IpAddr> = dns::addresses(&known, &target)
                            .map_err(dns_err(&target))?
                            .into_iter()
                            .filter(|ip| source.family.admits(ip))
                            .collect();
                        if ips.is_empty() {
                            ips = lookup_addresses(&mut client, &target, source.family)?;
                        }
                        cache.push((target.clone(), ips));
                    }
                    let ips = &cache.iter().find(|(t, _)| *t == target).expect("cached").1;
                    out.extend(ips.iter().map(|ip| SocketAddr::new(*ip, port)));
                }
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// What the runner does after one resolution: the new set to publish, a line to log.
#[derive(Debug, Default, PartialEq)]
pub struct Step {
    pub changed: Option<Vec<SocketAddr>>,
    pub log: Option<String>,
}

/// The runner's memory between resolutions (pure: time is an argument): the last good set,
/// and the current failure streak for rate-limited logging.
#[derive(Debug, Default)]
pub struct Tracker {
    current: Option<Vec<SocketAddr>>,
    failures: u64,
    last_log: Option<Instant>,
}

impl Tracker {
    pub fn new() -> Tracker {
        Tracker::default()
    }

    /// The last good set (None before the first success).
    pub fn current(&self) -> Option<&[SocketAddr]> {
        self.current.as_deref()
    }

    pub fn observe(
        &mut self,
        now: Instant,
        result: Result<Vec<SocketAddr>, DiscoveryError>,
    ) -> Step {
        let kept = |c: &Option<Vec<SocketAddr>>| match c {
            Some(s) => format!("keeping the last {} replicas", s.len()),
            None => "no replicas known yet".to_string(),
        };
        match result {
            Err(e) => {
                self.failures += 1;
                let due = match self.last_log {
                    None => true,
                    Some(t) => now.saturating_duration_since(t) >= FAILURE_LOG_PERIOD,
                };
                let log = if self.failures == 1 {
                    Some(format!("resolution failed ({}): {e}", kept(&self.current)))
                } else if due {
                    Some(format!(
                        "still failing after {} tries ({}): {e}",
                        self.failures,
                        kept(&self.current)
                    ))
                } else {
                    None
                };
                if log.is_some() {
                    self.last_log = Some(now);
                }
                Step { changed: None, log }
            }
            Ok(set) => {
                let mut log = None;
                if self.failures > 0 {
                    log = Some(format!(
                        "resolves again after {} failed tries",
                        self.failures
                    ));
                    self.failures = 0;
                    self.last_log = None;
                }
                if self.current.as_ref() == Some(&set) {
                    return Step { changed: None, log };
                }
                let old = self.current.take().unwrap_or_default();
                let added: Vec<String> = set
                    .iter()
                    .filter(|a| !old.contains(a))
                    .map(|a| a.to_string())
                    .collect();
                let removed: Vec<String> = old
                    .iter()
                    .filter(|a| !set.contains(a))
                    .map(|a| a.to_string())
                    .collect();
                let line = format!(
                    "{} replicas (added: [{}], removed: [{}])",
                    set.len(),
                    added.join(" "),
                    removed.join(" ")
                );
                log = Some(match log {
                    Some(l) => format!("{l}; {line}"),
                    None => line,
                });
                self.current = Some(set.clone());
                Step {
                    changed: Some(set),
                    log,
                }
            }
        }
    }
}

/// A thread re-resolving one source every `interval` and calling `on_change` with the new
/// set when it differs from the last one published (the first successful resolution is
/// always published, even if empty). Failures keep the last good set. Stops when `stop` is
/// set (checked every 50 ms while waiting, and before each resolution) or on drop.
pub struct Discovery {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Discovery {
    /// Starts the thread (named `kvlb-dns`); its first resolution is immediate. Log lines go
    /// to stderr prefixed with `kvlb: discovery SPEC:`.
    pub fn start<F>(
        source: DnsSource,
        resolvers: Vec<SocketAddr>,
        timeout: Duration,
        stop: Arc<AtomicBool>,
        mut on_change: F,
    ) -> std::io::Result<Discovery>
    where
        F: FnMut(&[SocketAddr]) + Send + 'static,
    {
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvlb-dns".into())
            .spawn(move || {
                let mut tracker = Tracker::new();
                while !flag.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let result = resolve(&source, &resolvers, timeout);
                    let step = tracker.observe(Instant::now(), result);
                    if let Some(line) = step.log {
                        eprintln!("kvlb: discovery {}: {line}", source.spec);
                    }
                    if let Some(set) = step.changed {
                        on_change(&set);
                    }
                    let next = started + source.interval;
                    loop {
                        if flag.load(Ordering::Relaxed) {
                            return;
                        }
                        let left = next.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        std::thread::sleep(left.min(STOP_POLL));
                    }
                }
            })?;
        Ok(Discovery {
            stop,
            thread: Some(thread),
        })
    }

    /// Sets the stop flag and waits for the thread to end.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn parses_both_forms() {
        let s = DnsSource::parse("dns://vllm.default.svc.cluster.local.:8000").unwrap();
        assert_eq!(s.kind, DnsKind::A);
        assert_eq!(s.name, "vllm.default.svc.cluster.local");
        assert_eq!(s.port, 8000);
        assert_eq!(s.interval, DEFAULT_INTERVAL);
        assert_eq!(s.family, Family::Any);
        let s = DnsSource::parse(
            "dns+srv://_http._tcp.VLLM.default.svc.cluster.local,interval=500ms,family=ipv4,kv_events=tcp://{host}:5557,metrics=on",
        )
        .unwrap();
        assert_eq!(s.kind, DnsKind::Srv);
        assert_eq!(s.name, "_http._tcp.vllm.default.svc.cluster.local");
        assert_eq!(s.port, 0);
        assert_eq!(s.interval, Duration::from_millis(500));
        assert_eq!(s.family, Family::Ipv4);
        assert_eq!(
            s.replica_flag(sa("127.0.0.3:9000")),
            "http://127.0.0.3:9000,kv_events=tcp://127.0.0.3:5557,metrics=on"
        );
        assert_eq!(
            s.replica_flag(sa("[::1]:9000")),
            "http://[::1]:9000,kv_events=tcp://[::1]:5557,metrics=on"
        );
    }

    #[test]
    fn bad_specs_say_why() {
        for (spec, needle) in [
            ("http://x:1", "expected dns://"),
            ("dns://vllm", "needs the replicas' port"),
            ("dns://vllm:0", "invalid port"),
            ("dns://vllm:x", "invalid port"),
            ("dns+srv://_http._tcp.x:80", "takes no port"),
            ("dns://127.0.0.1:80", "not a name"),
            ("dns://a..b:80", "empty label"),
            ("dns://a:80,interval=0s", "interval"),
            ("dns://a:80,interval=5h", "interval"),
            ("dns://a:80,family=v6", "family"),
            ("dns://a:80,bogus=1", "unknown option \"bogus\""),
            ("dns://a:80,metrics", "not key=value"),
            ("dns://a:80,metrics=on,metrics=off", "twice"),
        ] {
            let e = DnsSource::parse(spec).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
            assert!(e.contains(spec), "{spec}: {e}");
        }
    }

    #[test]
    fn dns_server_entries() {
        assert_eq!(parse_dns_server("10.96.0.10").unwrap(), sa("10.96.0.10:53"));
        assert_eq!(
            parse_dns_server("127.0.0.1:5353").unwrap(),
            sa("127.0.0.1:5353")
        );
        assert_eq!(parse_dns_server("[::1]:5353").unwrap(), sa("[::1]:5353"));
        assert_eq!(parse_dns_server("::1").unwrap(), sa("[::1]:53"));
        assert!(parse_dns_server("dns.local").is_err());
        assert_eq!(
            resolvers(&["127.0.0.1:5353".into()]).unwrap(),
            vec![sa("127.0.0.1:5353")]
        );
    }

    #[test]
    fn tracker_publishes_changes_and_rate_limits_failures() {
        let t0 = Instant::now();
        let mut t = Tracker::new();
        let fail = || {
            Err(DiscoveryError::Dns {
                name: "x".into(),
                error: DnsError::Timeout(sa("127.0.0.1:53")),
            })
        };
        // First success is published even when empty.
        let s = t.observe(t0, Ok(vec![]));
        assert_eq!(s.changed, Some(vec![]));
        let a = vec![sa("127.0.0.1:1"), sa("127.0.0.2:1")];
        assert_eq!(t.observe(t0, Ok(a.clone())).changed, Some(a.clone()));
        let s = t.observe(t0, Ok(a.clone()));
        assert_eq!(s, Step::default());
        // A failure streak: one line, then silence until the period has passed.
        let s = t.observe(t0, fail());
        assert!(s.changed.is_none());
        assert!(s.log.unwrap().contains("keeping the last 2 replicas"));
        for i in 1..60 {
            assert_eq!(
                t.observe(t0 + Duration::from_secs(i), fail()),
                Step::default()
            );
        }
        let s = t.observe(t0 + Duration::from_secs(60), fail());
        assert!(s.log.unwrap().contains("still failing after 61 tries"));
        assert_eq!(
            t.observe(t0 + Duration::from_secs(61), fail()),
            Step::default()
        );
        assert_eq!(t.current(), Some(&a[..]));
        // Recovery with the same set: one line, no change.
        let s = t.observe(t0 + Duration::from_secs(62), Ok(a.clone()));
        assert!(s.changed.is_none());
        assert!(s.log.unwrap().contains("after 62 failed tries"));
        // Recovery with another set.
        t.observe(t0, fail());
        let b = vec![sa("127.0.0.2:1")];
        let s = t.observe(t0, Ok(b.clone()));
        assert_eq!(s.changed, Some(b));
        let log = s.log.unwrap();
        assert!(
            log.contains("resolves again") && log.contains("removed: [127.0.0.1:1]"),
            "{log}"
        );
    }
}
