//! kvlb's simulation rig: what stands in for a GPU fleet and for its clients, for tests,
//! benches and the demo. `engine` is a simulated vLLM engine (continuous batching, chunked
//! prefill, a prefix cache publishing KV events), `replica` serves it over vLLM's interfaces,
//! `sim` replays a trace through simulated replicas under every policy, `replay` sends a trace
//! through a live balancer, and `demo` puts them together with `kvlb serve`.
//!
//! The rig uses the routing core (`kvlb-core`), ZMTP (`kvlb-zmtp`), the CLI helpers and the
//! tokenizer, never the product crate (`kvlb`), which depends on it for its subcommands.

#![deny(unsafe_code)]

// The modules the rig uses from the crates below, at its own root: `crate::select::...` reads
// as it did in the one crate, and the cycle check (tests/module_cycles.rs) sees through it.
use kvlb_cli as cli;
use kvlb_core::{estimate, http, lru, residency, select};
use kvlb_tokenize as tokenize;

// Unsafe only for single libc calls with no safe std equivalent, each with its safety comment:
// kill(SIGTERM) of the demo's children, getrusage for replay's CPU figure, and in the replica
// prctl(PR_SET_TIMERSLACK) and a MSG_PEEK recv to see a closed peer. `engine` and `sim` forbid it.
#[allow(unsafe_code)]
pub mod demo;
pub mod engine;
#[allow(unsafe_code)]
pub mod replay;
#[allow(unsafe_code)]
pub mod replica;
pub mod sim;

/// The KV events codec (`kvlb-core`) and their ZeroMQ publisher (`kvlb-zmtp`), as one path.
pub mod kv_events {
    pub use kvlb_core::kv_events::*;
    pub use kvlb_zmtp::publisher;
}
