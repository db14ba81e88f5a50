//! Shared support for the data-plane integration tests: real processes and real clients.
//!
//! Each test file includes it with `#[path = "support/mod.rs"] mod support;`. It owns
//! - [`proxy::Kvlb`]: a `kvlb serve` child process, started on port 0, killed on drop;
//! - [`backend::Backend`]: the standard-library Python test replica `tests/py/backend.py`;
//! - [`client::HttpConn`]: a raw HTTP/1.1 client over `std::net::TcpStream` that sends exact
//!   bytes and reads responses framed by content-length, chunked encoding or close;
//! - [`curl`]: runs the `curl` command line client with a time limit;
//! - [`digest`]: SHA-256 and deterministic payloads to check bodies end to end;
//! - [`fleet::ReplicaFleet`]: `kvlb replica --count n` with KV events, and `/replicas` and
//!   `x-kvlb-decision` readers;
//! - [`engines`]: vLLM's and SGLang's own KV event code (tests/py/engines/driver.py) publishing
//!   to kvlb, or decoding a publisher's messages.
//!
//! Every wait is bounded, so a broken proxy fails a test instead of hanging the run.
#![allow(dead_code, unused_imports)]

pub mod backend;
pub mod client;
pub mod curl;
pub mod digest;
pub mod engines;
pub mod fleet;
pub mod proxy;

use std::time::{Duration, Instant};

pub use backend::Backend;
pub use client::{HttpConn, Response};
pub use proxy::Kvlb;

/// Polls `condition` every 20 ms until it holds or `limit` passes; returns whether it held.
pub fn wait_until(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Shows bytes for a failure message: printable ASCII as is, the rest escaped.
pub fn show_bytes(bytes: &[u8]) -> String {
    let mut out = String::new();
    for &b in bytes.iter().take(4096) {
        match b {
            b'\r' => out.push_str("\\r"),
            b'\n' => out.push_str("\\n\n"),
            b'\t' => out.push_str("\\t"),
            0x20..=0x7e => out.push(b as char),
            _ => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    if bytes.len() > 4096 {
        out.push_str(&format!("... ({} bytes in all)", bytes.len()));
    }
    out
}

/// A directory under the system temp dir, removed on drop.
pub struct TempDir {
    pub path: std::path::PathBuf,
}

impl TempDir {
    pub fn new(label: &str) -> TempDir {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("kvlb-test-{label}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    pub fn file(&self, name: &str) -> std::path::PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
