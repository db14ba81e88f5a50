//! kvlb's routing core: everything that decides where a request goes, and the codecs it reads,
//! as pure functions and data structures. No I/O, no clock of its own (time comes in as an
//! argument), no lock (clippy.toml bans them here; each module turns the ban on). One thread:
//! `residency::spawn_writer_thread` runs the residency writer's loop (given its clock); all
//! else runs on its callers' threads.
//!
//! - `prompt`: the prompt a request carries (model, tools, messages), as canonical bytes.
//! - `prefix`: those bytes (or token ids) cut into blocks and hashed, chained.
//! - `residency`: which replica holds which block (a lock-free index, one writer).
//! - `estimate`: the time-to-first-token model of a replica.
//! - `select`: the policies (`cache_aware` and the baselines) and their names.
//! - `http`: HTTP/1.1 request and response heads, chunked bodies.
//! - `kv_events`: vLLM's and SGLang's KV cache events (msgpack), decoded and encoded.
//! - `models`: which replica serves which model (and LoRA adapter), read per request.
//! - `pd`: the two legs' bodies of a prefill/decode disaggregated request.
//! - `affinity`: which replica stored a Responses API response (`previous_response_id`).
//! - `lru`, `rng`: an intrusive LRU list and the policies' xorshift generator.
//!
//! `unsafe` is denied here except in the modules whose SIMD scans and prefetches need it
//! (`prompt::scan`, `prefix::block_hash`, `residency::table`); every other module forbids it.

#![deny(unsafe_code)]

pub mod affinity;
pub mod estimate;
pub mod http;
pub mod kv_events;
pub mod lru;
pub mod models;
pub mod pd;
pub mod prefix;
pub mod prompt;
pub mod residency;
pub mod rng;
pub mod select;
pub mod text;
