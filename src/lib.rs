//! kvlb: a KV-cache-aware load balancer for LLM inference fleets.
//!
//! A request's path: `accept` (a pinned worker thread's io_uring loop and accept loops) ->
//! `proxy` (over `worker`'s state) -> `http` (framing) -> `select` (replica choice) -> `proxy`
//! (forwarding, upstream pool). `engine` and `replica` are the
//! simulated GPU replica; `kv_events` and `zmtp` carry KV cache telemetry.
//!
//! This crate is the product (data plane, control, configuration, admin); the routing core,
//! ZMTP, the CLI helpers, the tokenizer and the simulation rig are crates of their own under
//! `crates/` (docs/design.md, "Crates and layers"), re-exported here under their old paths so
//! that `crate::select::...` inside and `kvlb::select::...` in tests and benches still work.

pub mod accept;
pub mod access_log;
pub mod admin;
pub mod alloc;
pub mod calibration;
pub mod config;
pub mod config_watch;
pub mod control;
pub mod discovery;
pub mod fleet;
pub mod l4;
pub mod limits;
pub mod log_limit;
pub mod metrics;
pub mod model_watch;
pub mod proxy;
pub mod rt;
pub mod serve;
pub mod telemetry;
pub mod worker;

pub use kvlb_cli as cli;
pub use kvlb_core::{
    affinity, estimate, http, lru, models, prefix, prompt, residency, rng, select,
};
pub use kvlb_sim::{demo, engine, replay, replica, sim};
pub use kvlb_tokenize as tokenize;
pub use kvlb_zmtp as zmtp;

/// The KV events codec (`kvlb-core`) and their ZeroMQ publisher and replay client
/// (`kvlb-zmtp`), under one path.
pub mod kv_events {
    pub use kvlb_core::kv_events::*;
    pub use kvlb_zmtp::publisher::{self, replay, KvEventPublisher};
}
