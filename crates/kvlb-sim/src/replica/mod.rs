//! `kvlb replica`: one or more simulated GPU replicas in one process, each speaking vLLM's
//! interfaces (OpenAI HTTP API, /metrics, ZeroMQ KV events) around its own `engine`.
//!
//! Layout: `flags` (command line), `http` (HTTP/1.1 framing), `openai` (request and response
//! bodies), `server` (endpoints and connection threads), `answer` (what endpoints share: JSON
//! answers and errors, one prompt on the engine), `responses` (the Responses API and
//! its store), `messages` (Anthropic's Messages API), `pooling` (embeddings, rerank, score,
//! detokenize), `driver` (engine in wall time, output routing, KV event publishing), `metrics`
//! (Prometheus text).

pub mod answer;
pub mod driver;
pub mod flags;
pub mod http;
pub mod messages;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod pooling;
pub mod responses;
pub mod server;

use crate::kv_events::publisher::KvEventPublisher;
use driver::Replica;
use std::net::{SocketAddr, TcpListener};
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
    let mut started = Vec::with_capacity(flags.count as usize);
    for i in 0..flags.count {
        let addr = shifted(flags.listen, i);
        let listener = match TcpListener::bind(addr) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("kvlb replica: replica {i}: cannot listen on {addr}: {e}");
                return 1;
            }
        };
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
                    match KvEventPublisher::bind(
                        &pub_addr,
                        replay_addr.as_deref(),
                        &flags.kv_events_topic,
                        flags.kv_events_format,
                    ) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            eprintln!(
                                "kvlb replica: replica {i}: cannot bind KV events on {pub_addr} (replay {}): {e}",
                                replay_addr.as_deref().unwrap_or("none")
                            );
                            return 1;
                        }
                    }
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
            engines.push(Replica::new(
                i,
                flags.model.clone(),
                engine,
                flags.time_scale,
                id_seed,
                publisher,
                dp_rank,
                lora_info.clone(),
            ));
        }
        started.push((listener, engines));
    }
    for (listener, engines) in started {
        let replica = engines[0].clone();
        let mut line = match listener.local_addr() {
            Ok(a) => format!("kvlb replica: replica {} on {a}", replica.index),
            Err(e) => {
                eprintln!(
                    "kvlb replica: replica {}: no local address: {e}",
                    replica.index
                );
                return 1;
            }
        };
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
        eprintln!("{line}");
        let mut spawned = Ok(());
        for e in &engines {
            let driven = e.clone();
            let name = match e.dp_rank {
                Some(r) => format!("replica{}-rank{r}-driver", e.index),
                None => format!("replica{}-driver", e.index),
            };
            spawned = std::thread::Builder::new()
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
                .map(|_| ());
            if spawned.is_err() {
                break;
            }
        }
        let served = models::Served::new(
            &flags.model,
            flags.served_names(),
            flags.enable_lora,
            &flags.lora_modules,
            flags.time_scale,
        );
        let ranks = server::Ranks::new(engines, served);
        let spawned = spawned.and_then(|_| {
            let index = replica.index;
            std::thread::Builder::new()
                .name(format!("replica{index}-accept"))
                .spawn(move || server::serve(listener, ranks))
        });
        if let Err(e) = spawned {
            eprintln!("kvlb replica: cannot start threads: {e}");
            return 1;
        }
    }
    eprintln!("kvlb replica: ready");
    loop {
        std::thread::park();
    }
}
