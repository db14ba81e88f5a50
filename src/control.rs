//! The control plane: everything that changes the running configuration or the fleet, off the
//! request path and serialised by one mutex (signals and admin requests may arrive together).
//!
//! * Reload (SIGHUP, `POST /reload`): reread the configuration as at start-up (the same file
//!   and flags), validate it whole, diff the replica lists, check there are slots for the
//!   additions, and only then apply: additions enter free slots, removed replicas drain
//!   (no new requests; in-flight ones finish) and leave once idle, changed replica options
//!   take effect in place, and the new policy, limits, timeouts and health settings are put in
//!   force by one atomic swap. Workers pick the new configuration up at their next request
//!   (`Worker::refresh`); connections and requests in flight are untouched. A configuration
//!   that fails validation is refused with its error and the old one keeps running. Listeners,
//!   workers, cores, the admin address and `max_replicas` are fixed for the process's life: a
//!   change to them is reported and left for a restart.
//! * The admin API's add, drain and remove of single replicas.
//! * The health thread: active checks (GET `health_path` on every replica each
//!   `health_interval`, in parallel), and emptying the slots of removed replicas once nothing
//!   is in flight there.

#![forbid(unsafe_code)]

use crate::config::{self, ReplicaConfig, ServeConfig};
use crate::fleet::{same_url, ACTIVE, EMPTY};
use crate::telemetry::{ResidencyOp, Telemetry};
use crate::worker::Shared;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Reloads applied and refused (`kvlb_config_reloads_total`).
pub static RELOADS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

pub struct Control {
    shared: Arc<Shared>,
    /// The `kvlb serve` arguments, reread on reload.
    args: Vec<String>,
    telemetry: Telemetry,
    lock: Mutex<()>,
    /// Per DNS source (`replica_dns`, in order): the URLs it put in the fleet.
    discovered: Mutex<Vec<Vec<String>>>,
}

impl Control {
    pub fn new(shared: Arc<Shared>, args: Vec<String>, telemetry: Telemetry) -> Control {
        Control {
            shared,
            args,
            telemetry,
            lock: Mutex::new(()),
            discovered: Mutex::new(Vec::new()),
        }
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reread the configuration and apply it. Ok: what changed, one line. Err: why it was
    /// refused (nothing changed).
    pub fn reload(&self) -> Result<String, String> {
        let r = self.reload_counted();
        RELOADS[r.is_err() as usize].fetch_add(1, Relaxed);
        r
    }

    fn reload_counted(&self) -> Result<String, String> {
        let _g = self.guard();
        let mut new = match config::from_args(&self.args) {
            Ok(c) => c,
            Err(None) => return Err("the arguments ask for --help".into()),
            Err(Some(e)) => return Err(e.0),
        };
        new.cost_model.policy_config().validate()?;
        let old = self.shared.cfg();
        let fleet = &self.shared.fleet;

        // Keys fixed for the process's life keep their running values.
        let mut restart_only = Vec::new();
        if new.listen != old.listen {
            restart_only.push("listen");
            new.listen = old.listen.clone();
        }
        if new.workers != old.workers {
            restart_only.push("workers");
            new.workers = old.workers;
        }
        if new.cores != old.cores {
            restart_only.push("cores");
            new.cores = old.cores.clone();
        }
        if new.admin != old.admin {
            restart_only.push("admin");
            new.admin = old.admin;
        }
        if new.max_replicas != old.max_replicas {
            restart_only.push("max_replicas");
            new.max_replicas = old.max_replicas;
        }
        if new.max_prompt_tokens != old.max_prompt_tokens {
            restart_only.push("max_prompt_tokens");
            new.max_prompt_tokens = old.max_prompt_tokens;
        }
        if new.response_affinity_entries != old.response_affinity_entries {
            restart_only.push("response_affinity_entries");
            new.response_affinity_entries = old.response_affinity_entries;
        }

        // The replica diff: by URL.
        let mut adds = Vec::new();
        let mut updates = Vec::new();
        for r in &new.replicas {
            match fleet.find(&r.url) {
                None => adds.push(r.clone()),
                Some(i) => {
                    let slot = fleet.slot(i);
                    let current = slot.spec();
                    let same = current.as_deref().is_some_and(|c| c == r);
                    if !same || slot.state() != ACTIVE {
                        updates.push((i, r.clone()));
                    }
                }
            }
        }
        if new.replica_dns != old.replica_dns || new.dns_servers != old.dns_servers {
            restart_only.push("replica_dns/dns_servers");
            new.replica_dns = old.replica_dns.clone();
            new.dns_servers = old.dns_servers.clone();
        }
        let discovered: Vec<String> = self.discovered_urls();
        let removes: Vec<usize> = fleet
            .slots()
            .filter(|(_, s)| s.state() == ACTIVE)
            .filter(|(_, s)| {
                let url = s.spec().map(|r| r.url.clone()).unwrap_or_default();
                !new.replicas.iter().any(|r| same_url(&r.url, &url))
                    && !discovered.iter().any(|d| same_url(d, &url))
            })
            .map(|(i, _)| i)
            .collect();
        let free = fleet.slots().filter(|(_, s)| s.state() == EMPTY).count();
        if adds.len() > free {
            return Err(format!(
                "{} replicas to add but {free} free slots (max_replicas = {}; removed replicas \
                 free theirs once idle); raise max_replicas and restart",
                adds.len(),
                fleet.capacity()
            ));
        }

        // Commit.
        let now = self.shared.now_ms();
        let (n_add, n_update, n_remove) = (adds.len(), updates.len(), removes.len());
        for r in adds {
            self.add_locked(r, now)?;
        }
        for (i, r) in updates {
            self.update_locked(i, r);
        }
        for i in removes {
            fleet.drain(i, true);
        }
        let policy = new.policy.as_str();
        let tables = new.models.len();
        self.shared.set_cfg(new);
        let mut msg = format!(
            "reloaded: {n_add} replicas added, {n_update} updated, {n_remove} draining out; policy {policy}"
        );
        if tables > 0 {
            msg.push_str(&format!("; {tables} [[model]] tables"));
        }
        if !restart_only.is_empty() {
            msg.push_str(&format!(
                "; {} changed but take effect only after a restart",
                restart_only.join(", ")
            ));
        }
        Ok(msg)
    }

    fn discovered_urls(&self) -> Vec<String> {
        let d = self.discovered.lock().unwrap_or_else(|p| p.into_inner());
        d.iter().flatten().cloned().collect()
    }

    /// Start one discovery thread per `replica_dns` source; each keeps the fleet's share of
    /// that source equal to what DNS answers. The handles stop their threads when dropped.
    pub fn start_discovery(
        self: &Arc<Self>,
        stop: Arc<AtomicBool>,
    ) -> Result<Vec<crate::discovery::Discovery>, String> {
        let cfg = self.shared.cfg();
        if cfg.replica_dns.is_empty() {
            return Ok(Vec::new());
        }
        let resolvers = crate::discovery::resolvers(&cfg.dns_servers).map_err(|e| e.to_string())?;
        *self.discovered.lock().unwrap_or_else(|p| p.into_inner()) =
            vec![Vec::new(); cfg.replica_dns.len()];
        let mut handles = Vec::new();
        for (k, spec) in cfg.replica_dns.iter().enumerate() {
            let source = crate::discovery::DnsSource::parse(spec).map_err(|e| e.to_string())?;
            let me = self.clone();
            let src = source.clone();
            handles.push(
                crate::discovery::Discovery::start(
                    source,
                    resolvers.clone(),
                    crate::discovery::DEFAULT_TIMEOUT,
                    stop.clone(),
                    move |addrs| me.sync_discovered(k, &src, addrs),
                )
                .map_err(|e| format!("cannot start DNS discovery for {spec}: {e}"))?,
            );
        }
        Ok(handles)
    }

    /// Make source `k`'s replicas in the fleet those at `addrs`.
    fn sync_discovered(
        &self,
        k: usize,
        source: &crate::discovery::DnsSource,
        addrs: &[std::net::SocketAddr],
    ) {
        let _g = self.guard();
        let mut wanted = Vec::new();
        for a in addrs {
            match config::parse_replica_flag("replica_dns", &source.replica_flag(*a)) {
                Ok(r) => wanted.extend(r.ranks()),
                Err(e) => eprintln!("kvlb: discovery {}: {a}: {e}", source.spec),
            }
        }
        let mut discovered = self.discovered.lock().unwrap_or_else(|p| p.into_inner());
        let Some(mine) = discovered.get_mut(k) else {
            return;
        };
        let now = self.shared.now_ms();
        let fleet = &self.shared.fleet;
        // Gone from DNS: drain out (only what this source added).
        mine.retain(|url| {
            if wanted.iter().any(|r| same_url(&r.url, url)) {
                return true;
            }
            if let Some(i) = fleet.find(url) {
                fleet.drain(i, true);
                eprintln!(
                    "kvlb: discovery {}: replica {url} left; draining out",
                    source.spec
                );
            }
            false
        });
        for r in wanted {
            if mine.iter().any(|u| same_url(u, &r.url)) {
                continue;
            }
            if let Some(i) = fleet.find(&r.url) {
                if fleet.slot(i).state() == ACTIVE {
                    // Listed statically (or by another source) already: not ours.
                    continue;
                }
            }
            let url = r.url.clone();
            match self.add_locked(r, now) {
                Ok(slot) => {
                    eprintln!(
                        "kvlb: discovery {}: replica {url} joined (slot {slot})",
                        source.spec
                    );
                    mine.push(url);
                }
                Err(e) => eprintln!("kvlb: discovery {}: cannot add {url}: {e}", source.spec),
            }
        }
    }

    /// Add one replica (admin API). Returns its slot.
    pub fn add(&self, r: ReplicaConfig) -> Result<usize, String> {
        let _g = self.guard();
        self.add_locked(r, self.shared.now_ms())
    }

    fn add_locked(&self, r: ReplicaConfig, now: u64) -> Result<usize, String> {
        let tokens = r.kv_capacity_tokens;
        // 0 marks the start-up fleet, which takes traffic at once (`ReplicaSlot::ramp_from`);
        // a replica added in kvlb's first millisecond is a later addition all the same.
        let i = self.shared.fleet.add(r, now.max(1))?;
        self.telemetry
            .send(ResidencyOp::Capacity { replica: i, tokens });
        if let Err(e) = self.telemetry.spawn_replica(&self.shared, i) {
            eprintln!("kvlb: replica slot {i}: cannot start its telemetry threads: {e}");
        }
        Ok(i)
    }

    fn update_locked(&self, i: usize, r: ReplicaConfig) {
        let tokens = r.kv_capacity_tokens;
        // New options in place (and a draining replica taken back), never out of rotation.
        self.shared.fleet.update(i, r);
        self.telemetry
            .send(ResidencyOp::Capacity { replica: i, tokens });
        if let Err(e) = self.telemetry.spawn_replica(&self.shared, i) {
            eprintln!("kvlb: replica slot {i}: cannot restart its telemetry threads: {e}");
        }
    }

    /// Stop sending requests to the replica with `url`; with `remove`, forget it once idle.
    pub fn drain(&self, url: &str, remove: bool) -> Result<usize, String> {
        let _g = self.guard();
        let i = self
            .shared
            .fleet
            .find(url)
            .ok_or_else(|| format!("no replica {url} in the fleet"))?;
        self.shared.fleet.drain(i, remove);
        Ok(i)
    }

    /// Empty the slots of removed replicas with nothing in flight.
    fn reap(&self) {
        let _g = self.guard();
        let loads = &self.shared.loads;
        for i in self
            .shared
            .fleet
            .reap_drained(|i| loads[i].in_flight.load(Relaxed))
        {
            self.telemetry.send(ResidencyOp::Clear { replica: i });
            eprintln!("kvlb: replica slot {i} removed (drained)");
        }
    }

    /// Run the health thread until `stop`.
    pub fn spawn_health_thread(self: &Arc<Self>, stop: Arc<AtomicBool>) -> std::io::Result<()> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("kvlb-health".into())
            .spawn(move || {
                let mut next_check = Instant::now();
                while !stop.load(Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                    me.reap();
                    let cfg = me.shared.cfg();
                    if cfg.health.interval.is_zero() || Instant::now() < next_check {
                        continue;
                    }
                    next_check = Instant::now() + cfg.health.interval;
                    me.check_all(&cfg);
                }
            })?;
        Ok(())
    }

    /// One round of active checks, every active replica in parallel.
    fn check_all(&self, cfg: &ServeConfig) {
        let shared = &self.shared;
        let targets: Vec<(usize, Arc<ReplicaConfig>)> = shared
            .fleet
            .slots()
            .filter(|(_, s)| s.state() == ACTIVE)
            .filter_map(|(i, s)| s.spec().map(|r| (i, r)))
            .collect();
        let results: Vec<(usize, Result<(), String>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = targets
                .iter()
                .map(|(i, r)| {
                    let (path, timeout) = (cfg.health.path.as_str(), cfg.health.timeout);
                    (*i, scope.spawn(move || check(r, path, timeout)))
                })
                .collect();
            handles
                .into_iter()
                .map(|(i, h)| (i, h.join().unwrap_or_else(|_| Err("check panicked".into()))))
                .collect()
        });
        let now = shared.now_ms();
        for (i, result) in results {
            let slot = shared.fleet.slot(i);
            let url = slot.spec().map(|r| r.url.clone()).unwrap_or_default();
            match result {
                Ok(()) => {
                    slot.check_fails.store(0, Relaxed);
                    let passes = slot.check_passes.fetch_add(1, Relaxed) + 1;
                    if !slot.check_ok.load(Relaxed) && passes >= cfg.health.healthy_after {
                        slot.ramp_from(now);
                        slot.check_ok.store(true, Relaxed);
                        eprintln!(
                            "kvlb: replica {url}: healthy again; taking traffic (slow start {:?})",
                            cfg.health.slow_start
                        );
                    }
                }
                Err(why) => {
                    slot.check_passes.store(0, Relaxed);
                    let fails = slot.check_fails.fetch_add(1, Relaxed) + 1;
                    if slot.check_ok.load(Relaxed) && fails >= cfg.health.unhealthy_after {
                        slot.check_ok.store(false, Relaxed);
                        eprintln!("kvlb: replica {url}: {fails} health checks failed ({why}); taken out of rotation");
                    }
                }
            }
        }
    }
}

/// GET `path` on the replica: Ok for a 2xx answer within `timeout`.
fn check(r: &ReplicaConfig, path: &str, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut s =
        TcpStream::connect_timeout(&r.addr, timeout).map_err(|e| format!("connect: {e}"))?;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    s.set_write_timeout(Some(left()))
        .map_err(|e| e.to_string())?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nhost: {}\r\nuser-agent: kvlb-health\r\nconnection: close\r\n\r\n",
        r.authority
    );
    s.write_all(req.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut buf = [0u8; 1024];
    let mut len = 0;
    while len < 12 {
        s.set_read_timeout(Some(left()))
            .map_err(|e| e.to_string())?;
        match s.read(&mut buf[len..]) {
            Ok(0) => return Err("closed before answering".into()),
            Ok(n) => len += n,
            Err(e) => return Err(format!("receive: {e}")),
        }
    }
    let line = &buf[..len];
    if line.starts_with(b"HTTP/1.") && line.get(9) == Some(&b'2') {
        Ok(())
    } else {
        let status = String::from_utf8_lossy(&line[..len.min(12)]).into_owned();
        Err(format!("answered {status:?}"))
    }
}
