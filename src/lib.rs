//! kvlb: a KV-cache-aware load balancer for LLM inference fleets.
//!
//! A request's path: `worker` (pinned io_uring event loop) -> `http` (framing) -> `select`
//! (replica choice) -> `proxy` (forwarding, upstream pool). `engine` and `replica` are the
//! simulated GPU replica; `kv_events` and `zmtp` carry KV cache telemetry.

pub mod access_log;
pub mod admin;
pub mod alloc;
pub mod cli;
pub mod config;
pub mod control;
pub mod demo;
pub mod discovery;
pub mod engine;
pub mod estimate;
pub mod fleet;
pub mod http;
pub mod kv_events;
pub mod l4;
pub mod limits;
pub mod log_limit;
pub mod lru;
pub mod metrics;
pub mod prefix;
pub mod prompt;
pub mod proxy;
pub mod replay;
pub mod replica;
pub mod residency;
pub mod rt;
pub mod select;
pub mod serve;
pub mod sim;
pub mod telemetry;
pub mod tokenize;
pub mod worker;
pub mod zmtp;
