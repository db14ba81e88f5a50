//! kvlb's fuzz targets share their invariants here, so that `tests/ops_fuzz_corpus.rs` replays
//! the seed corpora and every kept finding through the very same checks in a plain
//! `cargo test`.

pub mod checks;
