//! Replays the fuzz targets' seed corpora and every kept finding (`fuzz/seeds/<target>/`,
//! `fuzz/regressions/<target>/`) through the same invariant checks the fuzz targets run
//! (`fuzz/src/checks.rs`, included here by path), so a plain `cargo test` keeps every fixed
//! finding fixed without building libFuzzer.

#[allow(dead_code)]
#[path = "../fuzz/src/checks.rs"]
mod checks;

use std::path::Path;

/// Runs `check` on every file of the target's seed and regression directories; returns how
/// many inputs it saw. A failing input is named in the panic message.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut seen = 0;
    for dir in ["seeds", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| check(&data));
            assert!(
                outcome.is_ok(),
                "{target}: {} breaks an invariant (see the panic above)",
                path.display()
            );
            seen += 1;
        }
    }
    seen
}

#[test]
fn http_request_corpus() {
    assert!(replay("http_request", checks::http_request) > 0);
}

#[test]
fn chunked_corpus() {
    assert!(replay("chunked", checks::chunked) > 0);
}

#[test]
fn prompt_corpus() {
    assert!(replay("prompt", checks::prompt) > 0);
}

#[test]
fn kv_events_corpus() {
    assert!(replay("kv_events", checks::kv_events) > 0);
}

#[test]
fn dns_corpus() {
    assert!(replay("dns", checks::dns) > 0);
}

#[test]
fn zmtp_corpus() {
    assert!(replay("zmtp", checks::zmtp) > 0);
}

#[test]
fn http_response_corpus() {
    assert!(replay("http_response", checks::http_response) > 0);
}
