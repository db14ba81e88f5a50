//! `kvlb replica`: one or more simulated GPU replicas (HTTP + KV events around `engine`).

/// Entry point of `kvlb replica ARGS`; returns the process exit status.
pub fn main(_args: Vec<String>) -> i32 {
    eprintln!("kvlb replica: not built yet");
    2
}
