//! `kvlb replica`: one or more simulated GPU replicas in one process, each speaking vLLM's
//! interfaces (OpenAI HTTP API, /metrics, ZeroMQ KV events) around its own `engine`.
//!
//! Layout: `flags` (command line), `http` (HTTP/1.1 framing), `openai` (request and response
//! bodies), `server` (endpoints and connection threads), `answer` (what endpoints share: JSON
//! answers and errors, one prompt on the engine), `responses` (the Responses API and
//! its store), `messages` (Anthropic's Messages API), `pooling` (embeddings, rerank, score,
//! detokenize), `driver` (engine in wall time, output routing, KV event publishing), `metrics`
//! (Prometheus text), `pd` (disaggregated prefill: what `--role prefill|decode` makes of
//! `kv_transfer_params`, or of SGLang's bootstrap fields with `--pd-protocol sglang`),
//! `side_channel` (where decode replicas pull a prefill's KV) and `bootstrap` (SGLang's
//! bootstrap server on the same HTTP server: rooms, and the decode side's fetch).
//!
//! [`start`] starts the replicas of some flags in this process (tests start them so) and says
//! where each listens; [`main`] prints that and serves until killed.

pub mod answer;
pub mod bootstrap;
pub mod driver;
pub mod flags;
pub mod http;
pub mod messages;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod pd;
pub mod pooling;
pub mod responses;
pub mod rooms;
pub mod server;
pub mod side_channel;

#[cfg(test)]
mod pd_sglang_tests;
#[cfg(test)]
mod pd_tests;

use crate::kv_events::publisher::KvEventPublisher;
use driver::{Disagg, Replica};
use flags::ReplicaFlags;
use pd::{Protocol, Role};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

/// The address of replica `i`: `base` with its port shifted by `i` (0 stays 0, ephemeral).
fn shifted(base: SocketAddr, i: u32) -> SocketAddr {
    let mut a = base;
    if a.port() != 0 {
        a.set_port((a.port() as u32 + i) as u16);
    }
    a
}

/// Entry point of `kvlb replica ARGS`; returns the process exit status.
pub fn main(args: Vec<String>) -> i32 {
    let flags = match flags::parse(&args) {
        Ok(f) => f,
        Err(e) => return crate::cli::exit_status(&e),
    };
    if let Some(path) = &flags.tokenizer {
        let template = flags.chat_template.as_deref().map(std::path::Path::new);
        match crate::tokenize::ChatTokenizer::load(std::path::Path::new(path), template) {
            Ok(t) => {
                let _ = openai::HF_TOKENIZER.set(t);
            }
            Err(e) => {
                eprintln!("kvlb replica: --tokenizer {path}: {e}");
                return 2;
            }
        }
    }
    let started = match start(&flags) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return 1;
        }
    };
    for replica in &started {
        eprintln!("{}", replica.line);
    }
    eprintln!("kvlb replica: ready");
    loop {
        std::thread::park();
    }
}

/// One replica [`start`] started.
#[derive(Clone)]
pub struct Started {
    pub index: u32,
    /// Its HTTP address.
    pub addr: SocketAddr,
    /// Its KV side channel (`--role prefill`, vLLM's protocol), as decode replicas reach it.
    pub side_channel: Option<SocketAddr>,
    /// Its bootstrap server (`--role prefill --pd-protocol sglang`), as decode replicas reach
    /// it: the port a router injects as `bootstrap_port`.
    pub bootstrap: Option<SocketAddr>,
    /// Its engines (one, or the ranks of `--dp-size`).
    pub engines: Vec<Arc<Replica>>,
    /// Its startup line, `kvlb replica: replica I on HOST:PORT ...`.
    pub line: String,
}

/// The address decode replicas reach a side channel bound at `bound` on: itself, or loopback
/// when bound to every interface (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST defaults to localhost).
fn reachable(bound: SocketAddr) -> SocketAddr {
    let ip = match bound.ip() {
        IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, bound.port())
}

/// Start the replicas of `flags` in this process: bind their sockets, start their engine
/// drivers and HTTP (and side channel) threads, which run for the life of the process.
/// `--tokenizer` is the caller's (`main` loads it). The error is the message to print.
pub fn start(flags: &ReplicaFlags) -> Result<Vec<Started>, String> {
    let mut bound = Vec::with_capacity(flags.count as usize);
    for i in 0..flags.count {
        let addr = shifted(flags.listen, i);
        let listener = TcpListener::bind(addr)
            .map_err(|e| format!("kvlb replica: replica {i}: cannot listen on {addr}: {e}"))?;
        // The side channel (vLLM) or the bootstrap server (SGLang): one server, either flag.
        let kv_server = match (flags.side_channel(), flags.bootstrap()) {
            (Some(base), _) => Some((base, "--side-channel-port")),
            (None, Some(base)) => Some((base, "--disaggregation-bootstrap-port")),
            (None, None) => None,
        };
        let side_channel = match kv_server {
            None => None,
            Some((base, flag)) => {
                let at = shifted(base, i);
                let l = TcpListener::bind(at).map_err(|e| {
                    format!("kvlb replica: replica {i}: cannot listen on {at} ({flag}): {e}")
                })?;
                let local = l.local_addr().map_err(|e| {
                    format!("kvlb replica: replica {i}: {flag} has no local address: {e}")
                })?;
                Some((l, reachable(local)))
            }
        };
        // SGLang's rooms: one set per port, shared by its ranks.
        let rooms = flags.bootstrap().map(|_| Arc::new(rooms::Rooms::new()));
        let mut engines = Vec::with_capacity(flags.dp_size as usize);
        // One vllm:lora_requests_info per port: vLLM's ranks share one front end.
        let lora_info = flags
            .enable_lora
            .then(|| Arc::new(Mutex::new(metrics::LoraRequestsInfo::new(flags.max_loras))));
        for rank in 0..flags.dp_size {
            // Replica i's events; rank r of a data-parallel one on the ports + r.
            let shift = i + rank;
            let publisher = match flags.kv_events {
                None => None,
                Some(base) => {
                    let pub_addr = format!("tcp://{}", shifted(base, shift));
                    let replay_addr = flags
                        .kv_replay
                        .map(|r| format!("tcp://{}", shifted(r, shift)));
                    let p = KvEventPublisher::bind(
                        &pub_addr,
                        replay_addr.as_deref(),
                        &flags.kv_events_topic,
                        flags.kv_events_format,
                    )
                    .map_err(|e| {
                        format!(
                            "kvlb replica: replica {i}: cannot bind KV events on {pub_addr} (replay {}): {e}",
                            replay_addr.as_deref().unwrap_or("none")
                        )
                    })?;
                    Some(p)
                }
            };
            // Replica i at its --speed; every rank of it alike.
            let mut engine = flags.speed.of(i as usize).apply(&flags.engine_config());
            engine.hash_seed =
                xxhash_rust::xxh3::xxh3_64_with_seed(&shift.to_le_bytes(), flags.seed);
            engine.timing_seed =
                xxhash_rust::xxh3::xxh3_64_with_seed(b"step-timing", flags.seed ^ shift as u64);
            let id_seed =
                xxhash_rust::xxh3::xxh3_64_with_seed(b"response-ids", flags.seed ^ shift as u64);
            let dp_rank = (flags.dp_size > 1).then_some(rank);
            let mut disagg = disagg(flags, &engine, side_channel.as_ref().map(|s| s.1), dp_rank);
            disagg.rooms = rooms.clone();
            engines.push(Replica::new(
                i,
                flags.model.clone(),
                engine,
                flags.time_scale,
                id_seed,
                publisher,
                dp_rank,
                lora_info.clone(),
                disagg,
            ));
        }
        bound.push((listener, side_channel, engines));
    }
    let mut started = Vec::with_capacity(bound.len());
    for (listener, side_channel, engines) in bound {
        let replica = engines[0].clone();
        let addr = listener.local_addr().map_err(|e| {
            format!(
                "kvlb replica: replica {}: no local address: {e}",
                replica.index
            )
        })?;
        let mut line = format!("kvlb replica: replica {} on {addr}", replica.index);
        for e in &engines {
            let Some(p) = e.publisher() else { continue };
            let (pub_addr, replay) = p.local_addrs();
            line.push_str(&format!(" kv_events=tcp://{pub_addr}"));
            if let Some(r) = replay {
                line.push_str(&format!(" kv_replay=tcp://{r}"));
            }
        }
        let speed = flags.speed.of(replica.index as usize);
        if !speed.is_one() {
            line.push_str(&format!(" speed={speed}"));
        }
        if flags.role != Role::Both {
            line.push_str(&format!(" role={}", flags.role.as_str()));
            if flags.pd_protocol != Protocol::Vllm {
                line.push_str(&format!(" pd_protocol={}", flags.pd_protocol.name()));
            }
        }
        let kv_server_name = match flags.pd_protocol {
            Protocol::Vllm => "side_channel",
            Protocol::Sglang => "bootstrap",
        };
        if let Some((_, at)) = &side_channel {
            line.push_str(&format!(" {kv_server_name}={at}"));
        }
        let cannot = |e: std::io::Error| format!("kvlb replica: cannot start threads: {e}");
        for e in &engines {
            let driven = e.clone();
            let name = match e.dp_rank {
                Some(r) => format!("replica{}-rank{r}-driver", e.index),
                None => format!("replica{}-driver", e.index),
            };
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    // An engine failure must not leave clients waiting forever on a dead replica.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driven.drive()))
                        .is_err()
                    {
                        eprintln!(
                            "kvlb replica: replica {}: engine driver failed; exiting",
                            driven.index
                        );
                        std::process::exit(70);
                    }
                })
                .map_err(cannot)?;
        }
        let kv_server_addr = side_channel.as_ref().map(|s| s.1);
        if let Some((l, _)) = side_channel {
            let ranks = engines.clone();
            let protocol = flags.pd_protocol;
            std::thread::Builder::new()
                .name(format!("replica{}-kv-side-channel", replica.index))
                .spawn(move || side_channel::serve(l, ranks, protocol))
                .map_err(cannot)?;
        }
        let (side_channel_addr, bootstrap_addr) = match flags.pd_protocol {
            Protocol::Vllm => (kv_server_addr, None),
            Protocol::Sglang => (None, kv_server_addr),
        };
        let served = models::Served::new(
            &flags.model,
            flags.served_names(),
            flags.enable_lora,
            &flags.lora_modules,
            flags.time_scale,
        );
        let ranks = server::Ranks::new(engines.clone(), served);
        let index = replica.index;
        std::thread::Builder::new()
            .name(format!("replica{index}-accept"))
            .spawn(move || server::serve(listener, ranks))
            .map_err(cannot)?;
        started.push(Started {
            index,
            addr,
            side_channel: side_channel_addr,
            bootstrap: bootstrap_addr,
            engines,
            line,
        });
    }
    Ok(started)
}

/// The part in disaggregated prefill of a replica (rank `dp_rank`) running `engine`, its side
/// channel (or bootstrap server) reached at `side_channel`; the caller adds SGLang's rooms.
fn disagg(
    flags: &ReplicaFlags,
    engine: &crate::engine::EngineConfig,
    side_channel: Option<SocketAddr>,
    dp_rank: Option<u32>,
) -> Disagg {
    if flags.role == Role::Both {
        return Disagg::default();
    }
    // Unique per process and engine, as vLLM's uuid4 engine ids are: decode replicas check it.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut key = [0u8; 16];
    key[..4].copy_from_slice(&std::process::id().to_le_bytes());
    key[4..8].copy_from_slice(&(engine.hash_seed as u32).to_le_bytes());
    key[8..].copy_from_slice(&nanos.to_le_bytes());
    let id = xxhash_rust::xxh3::xxh3_128_with_seed(&key, engine.hash_seed);
    let engine_id = match dp_rank {
        Some(r) => format!("{id:032x}_dp{r}"),
        None => format!("{id:032x}"),
    };
    Disagg {
        role: flags.role,
        protocol: flags.pd_protocol,
        engine_id,
        side_channel,
        hold_s: flags.kv_hold_timeout * flags.time_scale,
        kv_bytes_per_token: engine.kv_bytes_per_token,
        transfer_s_per_token: pd::transfer_s_per_token(
            engine.kv_bytes_per_token,
            flags.kv_link_gbps,
        ),
        time_scale: flags.time_scale,
        rooms: None,
        hold_wall_s: flags.kv_hold_timeout,
        null_port: (flags.disaggregation_bootstrap_port != 0)
            .then_some(flags.disaggregation_bootstrap_port),
        wait_s: flags.kv_wait_timeout,
    }
}
