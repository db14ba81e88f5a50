//! Process resource limits kvlb adjusts for itself at start-up. A proxy holds one descriptor
//! per client connection and one per upstream connection, so the usual soft RLIMIT_NOFILE of
//! 1024 would cap it at a few hundred clients; the hard limit (set by systemd's LimitNOFILE=,
//! or the shell's `ulimit -Hn`) is what the operator meant to allow.

use std::io;

/// The soft and hard RLIMIT_NOFILE of this process.
pub fn nofile_limit() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // Safety: getrlimit(2) writes into the valid rlimit we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // rlim_t is u64 on 64-bit Linux, u32 on some 32-bit targets.
    #[allow(clippy::unnecessary_cast)]
    Ok((lim.rlim_cur as u64, lim.rlim_max as u64))
}

/// Raise the soft RLIMIT_NOFILE to the hard limit; returns the new soft limit. Never lowers
/// it, and needs no privilege (any process may raise its soft limit up to its hard one).
pub fn raise_nofile_limit() -> io::Result<u64> {
    let (soft, hard) = nofile_limit()?;
    if soft >= hard {
        return Ok(soft);
    }
    let lim = libc::rlimit {
        rlim_cur: hard as libc::rlim_t,
        rlim_max: hard as libc::rlim_t,
    };
    // Safety: setrlimit(2) reads the valid rlimit we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(hard)
}

/// `raise_nofile_limit` for start-up: a failure is reported on stderr and kvlb carries on with
/// the limit it has.
pub fn raise_nofile_limit_at_start() {
    if let Err(e) = raise_nofile_limit() {
        eprintln!("kvlb: warning: cannot raise the open-file limit to its hard limit: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raising_leaves_soft_equal_to_hard() {
        let soft = raise_nofile_limit().unwrap();
        let (now_soft, hard) = nofile_limit().unwrap();
        assert_eq!(soft, now_soft);
        assert_eq!(now_soft, hard);
    }
}
