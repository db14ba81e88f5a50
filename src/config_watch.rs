//! `watch_config`: reread the `--config` file when it changes, as SIGHUP does.
//!
//! One thread looks at the file every `watch_config` (read from the running configuration on
//! each turn, so a reload may switch it on or off) and, when the file's identity changed since
//! the last look, sends the process SIGHUP: the reload then takes the same path as any other
//! (the signal loop in `serve`, its log line, systemd's RELOADING notification). The identity
//! is what `stat` says through symlinks: device, inode, size and modification time. A
//! Kubernetes ConfigMap mounted as a directory is updated by swapping a symlink to a new
//! directory, which changes the inode even when the size and time would not; a file rewritten
//! in place changes its time. A ConfigMap mounted with `subPath` is never updated by the
//! kubelet, so there is nothing to see.
//!
//! A file that cannot be read keeps the last identity (said once in the log until it can be
//! read again): a reload would refuse it anyway, and the running configuration stays.

use crate::worker::Shared;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// How often the thread looks while watching is off (a reload may switch it on).
const IDLE: Duration = Duration::from_secs(1);

/// What identifies one version of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

fn identity(path: &str) -> std::io::Result<Identity> {
    let m = std::fs::metadata(path)?;
    Ok(Identity {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
    })
}

/// Watch `path` until `stop`; None when there is no file to watch.
pub fn spawn(
    shared: Arc<Shared>,
    path: Option<String>,
    stop: Arc<AtomicBool>,
) -> Result<Option<std::thread::JoinHandle<()>>, String> {
    let Some(path) = path else {
        if !shared.cfg().watch_config.is_zero() {
            eprintln!("kvlb: watch_config is set but there is no --config file to watch");
        }
        return Ok(None);
    };
    let h = std::thread::Builder::new()
        .name("kvlb-config-watch".into())
        .spawn(move || run(&shared, &path, &stop))
        .map_err(|e| format!("cannot start the config watch thread: {e}"))?;
    Ok(Some(h))
}

fn run(shared: &Shared, path: &str, stop: &AtomicBool) {
    let mut last = identity(path).ok();
    let mut unreadable = false;
    while !stop.load(Relaxed) {
        let every = shared.cfg().watch_config;
        sleep_unless(stop, if every.is_zero() { IDLE } else { every });
        if every.is_zero() {
            // Off: the next look starts from the file as it is then.
            last = identity(path).ok();
            continue;
        }
        match identity(path) {
            Ok(now) => {
                unreadable = false;
                if last != Some(now) {
                    last = Some(now);
                    eprintln!("kvlb: {path} changed; reloading");
                    // Safety: kill(2) on our own pid with a signal the signal loop waits for.
                    unsafe { libc::kill(libc::getpid(), libc::SIGHUP) };
                }
            }
            Err(e) => {
                if !unreadable {
                    eprintln!("kvlb: watch_config: cannot read {path}: {e}; the running configuration stays");
                    unreadable = true;
                }
            }
        }
    }
}

/// Sleep `d`, waking early when `stop` is set.
fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let step = Duration::from_millis(100);
    let mut left = d;
    while !left.is_zero() && !stop.load(Relaxed) {
        let s = left.min(step);
        std::thread::sleep(s);
        left -= s;
    }
}
