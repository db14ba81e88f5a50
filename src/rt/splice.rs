//! io_uring splice: moves bytes between a socket and a pipe inside the kernel, so a relay never
//! copies them through user space. Used by the L4 forwarding (`crate::l4`), which joins a
//! client and a replica socket through a pair of pipes from its per-worker pool.
//!
//! The kernel runs splice requests on its io_uring worker threads (they cannot be polled), so
//! a caller that may wait long for data first waits for readability with `op::poll`, which
//! costs no thread, and splices once bytes are there.
//!
//! The future here is the smallest piece of `op`'s operation pattern: a splice owns no user
//! memory, so dropping it before completion only has to hand its slot back to the runtime,
//! which cancels it.

#![forbid(unsafe_code)]

use super::{abandon_slot, poll_slot, submit};
use io_uring::{opcode, types::Fd};
use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Pipe flag for `splice`: move pages rather than copy where the kernel can.
pub const SPLICE_F_MOVE: u32 = 1;

/// A submitted splice; cancelled if dropped before it completes.
struct SpliceOp {
    slot: u32,
    done: bool,
}

impl Future for SpliceOp {
    type Output = i32;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<i32> {
        match poll_slot(self.slot, cx) {
            Poll::Ready((res, _flags)) => {
                self.done = true;
                Poll::Ready(res)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for SpliceOp {
    fn drop(&mut self) {
        if !self.done {
            abandon_slot(self.slot, None);
        }
    }
}

/// Move up to `len` bytes from `fd_in` to `fd_out`, one of which must be a pipe. Returns the
/// bytes moved; 0 means end of file on `fd_in` (or an empty pipe whose writers are gone).
pub async fn splice(fd_in: RawFd, fd_out: RawFd, len: u32) -> io::Result<usize> {
    let entry = opcode::Splice::new(Fd(fd_in), -1, Fd(fd_out), -1, len)
        .flags(SPLICE_F_MOVE)
        .build();
    let res = SpliceOp {
        slot: submit(entry),
        done: false,
    }
    .await;
    if res >= 0 {
        Ok(res as usize)
    } else {
        Err(io::Error::from_raw_os_error(-res))
    }
}

/// Whether this kernel's io_uring has IORING_OP_SPLICE.
pub fn supported() -> bool {
    let Ok(ring) = io_uring::IoUring::new(2) else {
        return false;
    };
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).is_ok() && probe.is_supported(opcode::Splice::CODE)
}
