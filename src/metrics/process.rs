//! The process's own resources, named as Prometheus client libraries do (kvlb_ prefixed): open
//! descriptors against the limit, resident memory, threads. An operator watches these for
//! leaks; the soak test reads them too.

#![forbid(unsafe_code)]

use super::families::{
    PROCESS_MAX_FDS, PROCESS_OPEN_FDS, PROCESS_RESIDENT_MEMORY, PROCESS_THREADS,
};
use super::{Collector, DescriptorEncoder};
use std::fmt;

/// Reads /proc/self when scraped; a figure that cannot be read is left out, family and all.
#[derive(Debug)]
pub struct ProcessMetrics;

impl Collector for ProcessMetrics {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            // The directory handle itself is one of them.
            let open = dir.count().saturating_sub(1) as u64;
            PROCESS_OPEN_FDS.describe(&mut enc)?.gauge(&[], open)?;
        }
        if let Ok((soft, _)) = crate::limits::nofile_limit() {
            PROCESS_MAX_FDS.describe(&mut enc)?.gauge(&[], soft)?;
        }
        if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
            let field = |name: &str| -> Option<u64> {
                let line = status.lines().find(|l| l.starts_with(name))?;
                line[name.len()..].split_whitespace().next()?.parse().ok()
            };
            if let Some(kib) = field("VmRSS:") {
                PROCESS_RESIDENT_MEMORY
                    .describe(&mut enc)?
                    .gauge(&[], kib * 1024)?;
            }
            if let Some(n) = field("Threads:") {
                PROCESS_THREADS.describe(&mut enc)?.gauge(&[], n)?;
            }
        }
        Ok(())
    }
}
