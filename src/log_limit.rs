//! Rate-limited warnings: a fault that a hostile client or a broken replica can repeat at will
//! (a cut response stream, a refused body) is logged at most once a second per kind, and the
//! next line says how many were left out meanwhile. The count of every occurrence lives in
//! /metrics; the log says that it happens and shows one example.
//!
//! A `LogLimit` is a static: any thread may call it, with two relaxed atomics and no lock.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

/// At most one line per this many milliseconds.
const EVERY_MS: u64 = 1000;

pub struct LogLimit {
    /// Milliseconds since the epoch of the last line written (0: none yet).
    last_ms: AtomicU64,
    /// Occurrences left out since then.
    suppressed: AtomicU64,
}

impl LogLimit {
    pub const fn new() -> LogLimit {
        LogLimit {
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether to write a line for an occurrence now: Some(n) with the number of occurrences
    /// left out since the last line, None to leave this one out (it is counted).
    pub fn allow(&self) -> Option<u64> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.allow_at(now)
    }

    /// `allow` at a given time (milliseconds since the epoch), for tests.
    pub fn allow_at(&self, now_ms: u64) -> Option<u64> {
        let last = self.last_ms.load(Relaxed);
        if last != 0 && now_ms < last + EVERY_MS {
            self.suppressed.fetch_add(1, Relaxed);
            return None;
        }
        // One thread wins the slot; the others count themselves out.
        if self
            .last_ms
            .compare_exchange(last, now_ms.max(1), Relaxed, Relaxed)
            .is_err()
        {
            self.suppressed.fetch_add(1, Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Relaxed))
    }
}

impl Default for LogLimit {
    fn default() -> LogLimit {
        LogLimit::new()
    }
}

/// The tail of a rate-limited line: "" or " (N more since the last line)".
pub fn more(suppressed: u64) -> String {
    if suppressed == 0 {
        String::new()
    } else {
        format!(" ({suppressed} more like it since the last line)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_second_and_the_next_says_how_many_were_left_out() {
        let l = LogLimit::new();
        assert_eq!(l.allow_at(10_000), Some(0));
        assert_eq!(l.allow_at(10_001), None);
        assert_eq!(l.allow_at(10_999), None);
        assert_eq!(l.allow_at(11_000), Some(2));
        assert_eq!(l.allow_at(11_500), None);
        assert_eq!(l.allow_at(20_000), Some(1));
        assert_eq!(more(0), "");
        assert_eq!(more(3), " (3 more like it since the last line)");
    }
}
