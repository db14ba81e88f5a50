//! `kvlb replica`: one or more simulated GPU replicas in one process, each speaking vLLM's
//! interfaces (OpenAI HTTP API, /metrics, ZeroMQ KV events) around its own `engine`.
//!
//! Layout: `flags` (command line), `http` (HTTP/1.1 framing), `openai` (request and response
//! bodies), `server` (endpoints and connection threads), `driver` (engine in wall time, output
//! routing, KV event publishing), `metrics` (Prometheus text).

pub mod driver;
pub mod flags;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod server;

use crate::kv_events::publisher::KvEventPublisher;
use driver::Replica;
use std::net::{SocketAddr, TcpListener};

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
        let publisher = match flags.kv_events {
            None => None,
            Some(base) => {
                let pub_addr = format!("tcp://{}", shifted(base, i));
                let replay_addr = flags.kv_replay.map(|r| format!("tcp://{}", shifted(r, i)));
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
        let mut engine = flags.engine.config();
        engine.hash_seed = xxhash_rust::xxh3::xxh3_64_with_seed(&i.to_le_bytes(), flags.seed);
        let id_seed = xxhash_rust::xxh3::xxh3_64_with_seed(b"response-ids", flags.seed ^ i as u64);
        let replica = Replica::new(
            i,
            flags.model.clone(),
            engine,
            flags.time_scale,
            id_seed,
            publisher,
        );
        started.push((listener, replica));
    }
    for (listener, replica) in started {
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
        if let Some(p) = replica.publisher() {
            let (pub_addr, replay) = p.local_addrs();
            line.push_str(&format!(" kv_events=tcp://{pub_addr}"));
            if let Some(r) = replay {
                line.push_str(&format!(" kv_replay=tcp://{r}"));
            }
        }
        eprintln!("{line}");
        let driven = replica.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("replica{}-driver", replica.index))
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
            .and_then(|_| {
                let index = replica.index;
                std::thread::Builder::new()
                    .name(format!("replica{index}-accept"))
                    .spawn(move || server::serve(listener, replica))
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
