//! `kvlb serve`: validate the configuration, probe the kernel, bind listeners, start one pinned
//! worker per core and the admin listener, then wait for signals. SIGTERM or SIGINT drains:
//! listeners close, in-flight requests finish (up to the drain timeout), the process exits 0.

use crate::config::{self, ServeConfig};
use crate::residency::{spawn_writer_thread, ResidencyConfig, ResidencyIndex};
use crate::rt::{self, op};
use crate::worker::{self, Shared};
use std::net::TcpListener;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

pub fn main(args: Vec<String>) -> i32 {
    let (cfg, actions) = match config::from_args_with_actions(&args) {
        Ok(c) => c,
        Err(None) => return 0,
        Err(Some(e)) => {
            eprintln!("kvlb: invalid configuration: {e}");
            return 2;
        }
    };
    if actions.check {
        println!(
            "kvlb: configuration ok (listeners {}, replicas {}, DNS sources {}, model tables {}, policy {})",
            cfg.listen.len(),
            cfg.replicas.len(),
            cfg.replica_dns.len(),
            cfg.models.len(),
            cfg.policy.as_str()
        );
        return 0;
    }
    if let Err(e) = rt::probe_kernel() {
        eprintln!("kvlb: {e}");
        return 1;
    }
    let l4 = (0..cfg.listen.len()).any(|i| cfg.listener_mode(i) == config::ListenerMode::L4);
    if l4 && !rt::splice::supported() {
        eprintln!(
            "kvlb: this kernel's io_uring lacks IORING_OP_SPLICE, which L4 listeners need; \
             kvlb needs Linux 5.19 or later"
        );
        return 1;
    }
    match run(cfg, args, actions.config) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvlb: {e}");
            1
        }
    }
}

fn block_signals() -> libc::sigset_t {
    // Safety: sigset manipulation on a local set; pthread_sigmask affects this thread and the
    // threads it spawns afterwards, which is the intent (signals are taken by sigwait below).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn run(cfg: ServeConfig, args: Vec<String>, config_path: Option<String>) -> Result<(), String> {
    crate::limits::raise_nofile_limit_at_start();
    let sigset = block_signals();
    let n_workers = cfg.workers;

    // Listeners: the first bind resolves port 0; every worker then binds the same address.
    let mut per_worker: Vec<Vec<RawFd>> = vec![Vec::new(); n_workers];
    let mut bound = Vec::new();
    for addr in &cfg.listen {
        let first = worker::bind_listener(*addr, 4096)
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let actual = op::local_addr(first).map_err(|e| format!("getsockname: {e}"))?;
        per_worker[0].push(first);
        for fds in per_worker.iter_mut().skip(1) {
            let fd = worker::bind_listener(actual, 4096)
                .map_err(|e| format!("cannot listen on {actual}: {e}"))?;
            fds.push(fd);
        }
        bound.push(actual);
    }
    let admin = TcpListener::bind(cfg.admin)
        .map_err(|e| format!("cannot bind the admin listener {}: {e}", cfg.admin))?;
    let admin_addr = admin.local_addr().map_err(|e| e.to_string())?;

    if cfg.replicas.is_empty() {
        eprintln!("kvlb: warning: no replicas configured; every request will get 503");
    }
    // Workers are pinned to the cores given, or else to the CPUs the process may run on (a
    // container's cpuset: the exclusive cores of a Kubernetes pod under the static CPU
    // manager). Under a CPU quota smaller than that set (a pod with a CPU limit on shared
    // cores) they are not pinned: the quota, not a core, is theirs.
    let allowed = config::allowed_cores();
    let quota_limited = cfg.cores.is_none()
        && std::thread::available_parallelism().is_ok_and(|p| p.get() < allowed.len());
    let cores: Vec<usize> = match &cfg.cores {
        Some(c) => c.clone(),
        None if allowed.is_empty() || quota_limited => Vec::new(),
        None => allowed,
    };
    if quota_limited {
        eprintln!(
            "kvlb: a CPU quota of {n_workers} CPUs over more allowed cores: workers are not pinned"
        );
    }
    // The residency index: read by every worker's cache_aware policy, written by one thread
    // from the workers' routing logs.
    let (residency, mut writer) = ResidencyIndex::new(ResidencyConfig {
        max_replicas: cfg
            .max_replicas
            .max(cfg.replicas.len())
            .clamp(1, crate::residency::MAX_REPLICAS),
        block_tokens: crate::prefix::BLOCK_BYTES as u32 / 4,
        kv_capacity_tokens: crate::config::DEFAULT_KV_CAPACITY_TOKENS,
    })
    .map_err(|e| format!("residency index: {e}"))?;
    writer.set_pending_ttl(cfg.telemetry.routed_pending_ttl);
    // Guesses are text blocks of about 64 tokens; the replicas' reports arrive as kvlb's
    // token blocks (whatever the engine's page size), so a full replica reports four times as
    // many.
    writer.set_reported_block_tokens(crate::prefix::DEFAULT_TOKEN_BLOCK);
    for (i, r) in cfg.replicas.iter().enumerate() {
        writer
            .set_capacity_tokens(i, r.kv_capacity_tokens)
            .map_err(|e| format!("replica {}: {e}", r.url))?;
    }
    // The offloaded tier: blocks the replicas' KV events report on CPU, disk, ... (loaded back
    // at `offload_load_cost`), written by the telemetry feed on the same writer thread.
    let (offload, mut offload_writer) = ResidencyIndex::new(ResidencyConfig {
        kv_capacity_tokens: crate::config::DEFAULT_KV_CAPACITY_TOKENS
            * crate::config::DEFAULT_OFFLOAD_CAPACITY_FACTOR,
        ..writer.config().clone()
    })
    .map_err(|e| format!("offloaded residency index: {e}"))?;
    offload_writer.set_reported_block_tokens(crate::prefix::DEFAULT_TOKEN_BLOCK);
    for (i, r) in cfg.replicas.iter().enumerate() {
        offload_writer
            .set_capacity_tokens(i, r.offload_capacity_tokens())
            .map_err(|e| format!("replica {}: {e}", r.url))?;
    }
    let logs = (0..n_workers).map(|_| writer.routing_log(4096)).collect();
    let shared = Arc::new(Shared::new(cfg, residency, logs).with_offload_tier(offload));
    let writer_stop = Arc::new(AtomicBool::new(false));
    let epoch = shared.epoch;
    // Replica telemetry (KV events, /metrics): its threads feed the writer's tick.
    let (feed, telemetry) = crate::telemetry::start(shared.clone())
        .map_err(|e| format!("cannot start the telemetry threads: {e}"))?;
    let mut feed = feed.with_offload_tier(offload_writer);
    let control = Arc::new(crate::control::Control::new(
        shared.clone(),
        args,
        telemetry,
    ));
    control
        .spawn_health_thread(writer_stop.clone())
        .map_err(|e| format!("cannot start the health thread: {e}"))?;
    let models = crate::model_watch::spawn(shared.clone(), writer_stop.clone())
        .map_err(|e| format!("cannot start the model discovery thread: {e}"))?;
    // Requests are routed by model from the first one on: the replicas are asked before
    // kvlb listens (one that does not answer in time takes any model until it does).
    let asked_within = shared.cfg().health.timeout + Duration::from_millis(500);
    if !models.wait(asked_within) {
        eprintln!(
            "kvlb: not every replica said which models it serves within {asked_within:?}; \
             those take any model until they do"
        );
    }
    let mut calibrator = crate::calibration::Calibrator::new(shared.clone());
    let writer_thread = spawn_writer_thread(
        writer,
        Duration::from_millis(1),
        crate::residency::PARKED_TICK,
        writer_stop.clone(),
        move || epoch.elapsed().as_micros() as u64,
        move |w, now| {
            let work = feed.on_tick(w, now);
            calibrator.on_tick(now);
            work
        },
    )
    .map_err(|e| format!("cannot start the residency writer: {e}"))?;
    crate::admin::spawn(admin, shared.clone(), control.clone());
    let _watch = crate::config_watch::spawn(shared.clone(), config_path, writer_stop.clone())?;
    let _discovery = control.start_discovery(writer_stop.clone())?;

    let mut wakers = Vec::new();
    let mut handles = Vec::new();
    let (ready_tx, ready_rx) = crossbeam::channel::bounded::<()>(n_workers);
    for (id, listeners) in per_worker.into_iter().enumerate() {
        // Safety: eventfd(2) with valid flags; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
        }
        wakers.push(efd);
        let shared = shared.clone();
        let core = cores.get(id % cores.len().max(1)).copied();
        let ready = ready_tx.clone();
        let h = std::thread::Builder::new()
            .name(format!("kvlb-worker-{id}"))
            .spawn(move || {
                if let Some(core) = core {
                    if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
                        eprintln!(
                            "kvlb: worker {id}: could not pin to core {core}; running unpinned"
                        );
                    }
                }
                let _ = ready.send(());
                crate::accept::run(id, shared, listeners, efd);
            })
            .map_err(|e| format!("cannot start worker {id}: {e}"))?;
        handles.push(h);
    }
    for _ in 0..n_workers {
        let _ = ready_rx.recv();
    }
    for a in &bound {
        eprintln!("kvlb: listening on {a}");
    }
    eprintln!("kvlb: admin on {admin_addr}");
    eprintln!(
        "kvlb: ready ({n_workers} workers, policy {}, {} replicas)",
        shared.cfg().policy.as_str(),
        shared.fleet.len()
    );

    sd_notify("READY=1\nSTATUS=serving");
    loop {
        let mut sig: libc::c_int = 0;
        // Safety: sigwait on the set blocked above, with a valid out pointer.
        let r = unsafe { libc::sigwait(&sigset, &mut sig) };
        if r != 0 {
            continue;
        }
        match sig {
            libc::SIGTERM | libc::SIGINT => break,
            libc::SIGHUP => {
                sd_notify(&format!(
                    "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading",
                    monotonic_usec()
                ));
                match control.reload() {
                    Ok(msg) => eprintln!("kvlb: SIGHUP: {msg}"),
                    Err(e) => eprintln!(
                        "kvlb: SIGHUP: reload refused: {e}; the running configuration is unchanged"
                    ),
                }
                sd_notify("READY=1\nSTATUS=serving");
            }
            _ => {}
        }
    }
    eprintln!(
        "kvlb: draining: no new connections; waiting up to {:?} for in-flight requests",
        shared.cfg().timeouts.drain
    );
    sd_notify("STOPPING=1\nSTATUS=draining");
    shared.draining.store(true, Relaxed);
    for efd in &wakers {
        let one: u64 = 1;
        // Safety: writing 8 bytes from a valid u64 to our own eventfd.
        unsafe { libc::write(*efd, &one as *const u64 as *const libc::c_void, 8) };
    }
    for h in handles {
        let _ = h.join();
    }
    writer_stop.store(true, Relaxed);
    crate::telemetry::stop_all(&shared);
    let _ = writer_thread.join();
    let left: u64 = shared
        .workers
        .iter()
        .map(|w| w.in_flight.load(Relaxed))
        .sum();
    if left > 0 {
        eprintln!("kvlb: drain deadline reached with {left} requests in flight; exiting");
    } else {
        eprintln!("kvlb: drained; exiting");
    }
    Ok(())
}

/// Tell systemd (Type=notify) about a state change, if it is listening.
pub fn sd_notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(_) => return,
    };
    let bytes = path.as_encoded_bytes();
    let r = if let Some(abstract_name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)
            .and_then(|a| sock.send_to_addr(state.as_bytes(), &a))
    } else {
        sock.send_to(state.as_bytes(), std::path::Path::new(&path))
    };
    if let Err(e) = r {
        eprintln!("kvlb: cannot notify systemd: {e}");
    }
}

/// CLOCK_MONOTONIC in microseconds (what systemd wants with RELOADING=1).
fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // Safety: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}
