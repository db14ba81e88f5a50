//! The access log (`access_log = PATH`, off by default): one JSON object per request, one per
//! line, for the questions metrics cannot answer (which client, which request, where it went
//! and why, how long it took).
//!
//! Each worker formats its lines into its own buffer (allocated once, no lock) and writes the
//! buffer with one `write(2)` when it passes [`FLUSH_AT`], at least once a second while lines
//! wait, and when the worker stops. Every worker holds its own descriptor of the file, opened
//! with `O_APPEND`, so whole-buffer writes from several workers never interleave inside a line.
//! The file is reopened on reload (SIGHUP or `POST /reload`), which is how log rotation hands
//! over a new file. A write that fails (disk full, a pipe nobody reads: the descriptor is
//! non-blocking, a worker never waits for it) drops what it held and counts the lines in
//! `kvlb_access_log_dropped_lines_total`.

use crate::metrics::{families, Collector, DescriptorEncoder};
use std::cell::{Cell, RefCell};
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A worker writes its buffer once it holds this much.
pub const FLUSH_AT: usize = 32 * 1024;
/// Lines wait at most about this long in a worker's buffer.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// Longest request target written (longer ones are cut, marked with `...`).
const MAX_PATH: usize = 512;

/// Lines written and dropped, over all workers (for /metrics).
pub static LINES: AtomicU64 = AtomicU64::new(0);
pub static DROPPED: AtomicU64 = AtomicU64::new(0);

/// The access log's counters on /metrics (registered by the admin listener).
#[derive(Debug)]
pub struct AccessLogMetrics;

impl Collector for AccessLogMetrics {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        families::ACCESS_LOG_LINES
            .describe(&mut enc)?
            .counter(&[], LINES.load(Relaxed))?;
        families::ACCESS_LOG_DROPPED_LINES
            .describe(&mut enc)?
            .counter(&[], DROPPED.load(Relaxed))
    }
}

/// Opens `path` for appending (created 0640 if missing), non-blocking.
pub fn open(path: &str) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o640)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    Ok(OwnedFd::from(f))
}

/// What one request's line says. Strings are borrowed from the request and the fleet.
#[derive(Debug, Clone, Copy, Default)]
pub struct Record<'a> {
    pub client: Option<IpAddr>,
    /// The request method as received ("-" when the request line could not be read).
    pub method: &'a [u8],
    /// The request target as received.
    pub path: &'a [u8],
    pub status: u16,
    /// Why the response stopped before its end after its head reached the client (the
    /// `cause` label of `kvlb_cut_responses_total`), None when it was whole.
    pub cut: Option<&'a str>,
    /// The replica that answered (its URL as configured), if one was chosen.
    pub replica: Option<&'a str>,
    /// Replicas tried (1 unless a connect failure or an immediate 503 was retried).
    pub attempts: u32,
    /// The prefill replica that computed the prompt of a disaggregated request (`replica`
    /// then is the decode replica).
    pub prefill_replica: Option<&'a str>,
    /// Why that replica (`Decision::reason`), and the prefix it was found to hold.
    pub reason: Option<&'a str>,
    pub prompt_tokens: u32,
    pub matched_tokens: u32,
    /// Request body bytes.
    pub bytes_in: usize,
    /// Microseconds from the whole request received to the response head, and to the end.
    pub ttfb_us: Option<u64>,
    /// To the replica's first response body byte (a stream's first token).
    pub first_byte_us: Option<u64>,
    /// What the policy expected, when it estimates (cache_aware).
    pub estimate: Option<Estimated>,
    pub total_us: u64,
}

/// One worker's log.
pub struct AccessLog {
    fd: RefCell<Option<OwnedFd>>,
    buf: RefCell<Vec<u8>>,
    /// Lines in `buf`.
    pending: Cell<u64>,
}

impl AccessLog {
    pub fn new(fd: OwnedFd) -> AccessLog {
        AccessLog {
            fd: RefCell::new(Some(fd)),
            buf: RefCell::new(Vec::with_capacity(FLUSH_AT + 4096)),
            pending: Cell::new(0),
        }
    }

    /// Write what is buffered and switch to `fd` (a reopened file).
    pub fn reopen(&self, fd: OwnedFd) {
        self.flush();
        *self.fd.borrow_mut() = Some(fd);
    }

    /// Append the line of `r`; writes the buffer out once it is full.
    pub fn line(&self, r: &Record<'_>) {
        {
            let mut buf = self.buf.borrow_mut();
            write_line(&mut buf, SystemTime::now(), r);
        }
        self.pending.set(self.pending.get() + 1);
        if self.buf.borrow().len() >= FLUSH_AT {
            self.flush();
        }
    }

    /// Whether lines are waiting.
    pub fn has_pending(&self) -> bool {
        self.pending.get() > 0
    }

    /// Write the buffered lines with one `write(2)` (a few if the kernel takes part of it);
    /// what cannot be written now is dropped and counted.
    pub fn flush(&self) {
        let lines = self.pending.replace(0);
        if lines == 0 {
            return;
        }
        let mut buf = self.buf.borrow_mut();
        let fd = self.fd.borrow();
        let mut done = 0;
        if let Some(fd) = fd.as_ref() {
            while done < buf.len() {
                // Safety: write(2) from our own buffer to a descriptor we own.
                let n = unsafe {
                    libc::write(
                        fd.as_raw_fd(),
                        buf[done..].as_ptr() as *const libc::c_void,
                        buf.len() - done,
                    )
                };
                if n > 0 {
                    done += n as usize;
                } else if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                } else {
                    break;
                }
            }
        }
        if done == buf.len() {
            LINES.fetch_add(lines, Relaxed);
        } else {
            // Count the lines not (entirely) written; a part line is ended so the next
            // write starts on a line of its own.
            let lost = buf[done..].iter().filter(|&&b| b == b'\n').count() as u64;
            if done > 0 && buf[done - 1] != b'\n' {
                if let Some(fd) = fd.as_ref() {
                    // Safety: as above, one byte.
                    let _ = unsafe {
                        libc::write(fd.as_raw_fd(), b"\n".as_ptr() as *const libc::c_void, 1)
                    };
                }
            }
            LINES.fetch_add(lines - lost, Relaxed);
            DROPPED.fetch_add(lost, Relaxed);
        }
        buf.clear();
    }
}

/// What cache_aware expected of a request where it sent it, in milliseconds: its estimated
/// time to first token, the queue wait in it, the best other candidate's estimate, and
/// whether a hot prefix's holder was passed over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimated {
    pub ttft_ms: f32,
    pub wait_ms: f32,
    pub runner_up_ms: f32,
    pub spilled: bool,
}

/// Formats `r` as one JSON line at `now`.
pub fn write_line(out: &mut Vec<u8>, now: SystemTime, r: &Record<'_>) {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    out.extend_from_slice(b"{\"time\":\"");
    write_rfc3339_ms(out, since);
    out.extend_from_slice(b"\",\"client\":");
    match r.client {
        Some(ip) => {
            out.push(b'"');
            let _ = write!(out, "{ip}");
            out.push(b'"');
        }
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"method\":");
    json_str(out, r.method);
    out.extend_from_slice(b",\"path\":");
    if r.path.len() > MAX_PATH {
        json_str(out, &r.path[..MAX_PATH]);
        out.pop();
        out.extend_from_slice(b"...\"");
    } else {
        json_str(out, r.path);
    }
    let _ = write!(out, ",\"status\":{},\"cut\":", r.status);
    match r.cut {
        Some(cause) => json_str(out, cause.as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"replica\":");
    match r.replica {
        Some(url) => json_str(out, url.as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
    let _ = write!(out, ",\"attempts\":{}", r.attempts);
    if let Some(url) = r.prefill_replica {
        out.extend_from_slice(b",\"prefill_replica\":");
        json_str(out, url.as_bytes());
    }
    out.extend_from_slice(b",\"reason\":");
    match r.reason {
        Some(reason) => json_str(out, reason.as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
    let _ = write!(
        out,
        ",\"prompt_tokens\":{},\"matched_tokens\":{},\"bytes_in\":{},\"ttfb_ms\":",
        r.prompt_tokens, r.matched_tokens, r.bytes_in
    );
    match r.ttfb_us {
        Some(us) => millis(out, us),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"first_byte_ms\":");
    match r.first_byte_us {
        Some(us) => millis(out, us),
        None => out.extend_from_slice(b"null"),
    }
    match r.estimate {
        Some(e) => {
            let _ = write!(
                out,
                ",\"estimate_ms\":{:.1},\"wait_ms\":{:.1},\"runner_up_ms\":",
                e.ttft_ms, e.wait_ms
            );
            if e.runner_up_ms.is_finite() {
                let _ = write!(out, "{:.1}", e.runner_up_ms);
            } else {
                out.extend_from_slice(b"null");
            }
            let _ = write!(out, ",\"spilled\":{}", e.spilled);
        }
        None => out.extend_from_slice(
            b",\"estimate_ms\":null,\"wait_ms\":null,\"runner_up_ms\":null,\"spilled\":null",
        ),
    }
    out.extend_from_slice(b",\"total_ms\":");
    millis(out, r.total_us);
    out.extend_from_slice(b"}\n");
}

fn millis(out: &mut Vec<u8>, us: u64) {
    let _ = write!(out, "{}.{:03}", us / 1000, us % 1000);
}

/// A JSON string of `s`: printable ASCII as is, `"` and `\` escaped, every other byte as
/// `\u00XX` (a request target is bytes, not necessarily UTF-8).
fn json_str(out: &mut Vec<u8>, s: &[u8]) {
    out.push(b'"');
    for &b in s {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x20..=0x7e => out.push(b),
            _ => {
                let _ = write!(out, "\\u{b:04x}");
            }
        }
    }
    out.push(b'"');
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for a time since the epoch (civil date from days, after Howard
/// Hinnant's algorithm).
fn write_rfc3339_ms(out: &mut Vec<u8>, since_epoch: Duration) {
    let secs = since_epoch.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    let _ = write!(
        out,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since_epoch.subsec_millis()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(r: &Record<'_>, at: Duration) -> String {
        let mut out = Vec::new();
        write_line(&mut out, UNIX_EPOCH + at, r);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn dates_match_known_instants() {
        let mut out = Vec::new();
        for (secs, want) in [
            (0u64, "1970-01-01T00:00:00.000Z"),
            (951_782_400, "2000-02-29T00:00:00.000Z"),
            (1_796_025_722, "2026-11-30T08:02:02.000Z"),
            (4_107_542_399, "2100-02-28T23:59:59.000Z"),
        ] {
            out.clear();
            write_rfc3339_ms(&mut out, Duration::from_secs(secs));
            assert_eq!(std::str::from_utf8(&out).unwrap(), want, "{secs}");
        }
        out.clear();
        write_rfc3339_ms(&mut out, Duration::from_millis(1_500));
        assert_eq!(out, b"1970-01-01T00:00:01.500Z");
    }

    #[test]
    fn a_line_is_one_json_object_with_every_field() {
        let r = Record {
            client: Some("10.1.2.3".parse().unwrap()),
            method: b"POST",
            path: b"/v1/chat/completions?x=\"q\"\\\x01\xff",
            status: 200,
            cut: Some("closed"),
            replica: Some("http://10.0.0.5:8000"),
            attempts: 1,
            prefill_replica: Some("http://10.0.0.6:8000"),
            reason: Some("cache"),
            prompt_tokens: 512,
            matched_tokens: 256,
            bytes_in: 2049,
            ttfb_us: Some(12_345),
            first_byte_us: Some(98_765),
            estimate: Some(Estimated {
                ttft_ms: 80.25,
                wait_ms: 40.0,
                runner_up_ms: f32::INFINITY,
                spilled: true,
            }),
            total_us: 1_234_567,
        };
        let s = line(&r, Duration::from_millis(1_796_025_722_123));
        assert!(s.ends_with('\n') && s.matches('\n').count() == 1, "{s}");
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["time"], "2026-11-30T08:02:02.123Z");
        assert_eq!(v["client"], "10.1.2.3");
        assert_eq!(v["method"], "POST");
        assert_eq!(v["path"], "/v1/chat/completions?x=\"q\"\\\u{1}\u{ff}");
        assert_eq!(v["status"], 200);
        assert_eq!(v["cut"], "closed");
        assert_eq!(v["replica"], "http://10.0.0.5:8000");
        assert_eq!(v["attempts"], 1);
        assert_eq!(v["prefill_replica"], "http://10.0.0.6:8000");
        assert_eq!(v["reason"], "cache");
        assert_eq!(v["prompt_tokens"], 512);
        assert_eq!(v["matched_tokens"], 256);
        assert_eq!(v["bytes_in"], 2049);
        assert_eq!(v["ttfb_ms"], 12.345);
        assert_eq!(v["total_ms"], 1234.567);
        assert_eq!(v["first_byte_ms"], 98.765);
        assert_eq!(v["estimate_ms"], 80.2);
        assert_eq!(v["wait_ms"], 40.0);
        assert!(v["runner_up_ms"].is_null());
        assert_eq!(v["spilled"], true);
        let local = line(
            &Record {
                method: b"-",
                status: 400,
                path: &[b'a'; 600],
                ..Record::default()
            },
            Duration::ZERO,
        );
        let v: serde_json::Value = serde_json::from_str(&local).unwrap();
        assert!(v["client"].is_null() && v["replica"].is_null() && v["ttfb_ms"].is_null());
        assert!(v["estimate_ms"].is_null() && v["first_byte_ms"].is_null());
        // Only a disaggregated request names a prefill replica.
        assert!(v.get("prefill_replica").is_none());
        assert_eq!(v["path"].as_str().unwrap().len(), MAX_PATH + 3);
    }

    #[test]
    fn lines_reach_the_file_whole_and_a_closed_pipe_counts_drops() {
        let dir = std::env::temp_dir().join(format!("kvlb-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("access.log");
        let _ = std::fs::remove_file(&path);
        let log = AccessLog::new(open(path.to_str().unwrap()).unwrap());
        let r = Record {
            method: b"GET",
            path: b"/v1/models",
            status: 200,
            ..Record::default()
        };
        let before = LINES.load(Relaxed);
        for _ in 0..1000 {
            log.line(&r);
        }
        log.flush();
        assert!(!log.has_pending());
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 1000);
        for l in text.lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["path"], "/v1/models");
        }
        assert!(LINES.load(Relaxed) - before >= 1000);

        // A pipe whose reader is gone: the write fails, the lines are counted as dropped.
        let mut fds = [0; 2];
        // Safety: pipe2(2) into our array.
        assert_eq!(
            unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK) },
            0
        );
        // Safety: we own both ends; the read end is closed at once.
        let (r_end, w_end) = unsafe {
            use std::os::fd::FromRawFd;
            (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
        };
        drop(r_end);
        // Writing to a pipe without readers raises SIGPIPE, which the Rust runtime ignores in
        // every binary; said again here so the test does not depend on it.
        // Safety: setting a signal's disposition to ignore.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        log.reopen(w_end);
        let dropped = DROPPED.load(Relaxed);
        log.line(&r);
        log.line(&r);
        log.flush();
        assert!(DROPPED.load(Relaxed) - dropped >= 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
