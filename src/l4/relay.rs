//! The splice relay of a joined L4 connection: two pumps, client -> replica and replica ->
//! client, each moving bulk bytes socket -> pipe -> socket with io_uring splice, so they never
//! enter user space, and small reads (requests, answers, stream events) through a pooled
//! buffer, where a copy is cheaper than the kernel worker hop of a splice. Pipes come from a
//! per-worker pool (one pair per connection, returned empty when the connection ends cleanly).
//!
//! End of file on one side shuts down the other side's write half and the other direction
//! keeps going (half-close); an error on either side shuts both sockets down, which also wakes
//! splices the kernel is running, and ends the connection.

use super::{shutdown, InFlight, Moved};
use crate::rt::op;
use crate::rt::splice::splice;
use crate::worker::Worker;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::pin;
use std::task::Poll;

/// Capacity asked of each pipe: one splice moves at most this much.
pub const PIPE_BYTES: usize = 512 * 1024;
/// Idle pipes a worker keeps.
const POOL_MAX: usize = 128;

/// A pipe: bytes spliced into `write` come out of `read`.
pub struct Pipe {
    read: RawFd,
    write: RawFd,
    /// The capacity the kernel granted.
    capacity: usize,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let mut fds = [0 as libc::c_int; 2];
        // Safety: pipe2(2) writes two descriptors into the array we own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // Safety: fcntl(2) on the pipe we just created; failure leaves the default size.
        let got = unsafe { libc::fcntl(fds[1], libc::F_SETPIPE_SZ, PIPE_BYTES as libc::c_int) };
        let capacity = if got > 0 {
            got as usize
        } else {
            // Safety: as above, reading the current size.
            let cur = unsafe { libc::fcntl(fds[1], libc::F_GETPIPE_SZ) };
            cur.max(4096) as usize
        };
        Ok(Pipe {
            read: fds[0],
            write: fds[1],
            capacity,
        })
    }

    fn close(self) {
        op::close(self.read);
        op::close(self.write);
    }
}

thread_local! {
    /// This worker's idle pipes, all empty.
    static POOL: RefCell<Vec<Pipe>> = const { RefCell::new(Vec::new()) };
}

pub(crate) fn take_pipe() -> io::Result<Pipe> {
    match POOL.with(|p| p.borrow_mut().pop()) {
        Some(p) => Ok(p),
        None => Pipe::new(),
    }
}

/// Return a pipe; only an empty one (`clean`) is kept.
pub(crate) fn give_pipe(p: Pipe, clean: bool) {
    if !clean {
        p.close();
        return;
    }
    POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        if pool.len() < POOL_MAX {
            pool.push(p);
        } else {
            p.close();
        }
    });
}

/// Which socket of a pump failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Reading the source failed (reset, error).
    Source,
    /// Writing the destination failed.
    Destination,
}

const READABLE: u32 = (libc::POLLIN | libc::POLLRDHUP) as u32;

/// Reads up to this size are copied through a user buffer rather than spliced: a splice runs
/// on a kernel worker thread (io_uring cannot poll it), and for a small read that hop costs
/// more than the copy (measured with bench/l4_bench.sh: SSE events, small answers).
pub const COPY_BELOW: usize = 16 * 1024;

/// Move bytes from `from` to `to` until end of file on `from` (Ok) or a failure. Small reads
/// are copied through `buf`: a multishot receive stays armed on `from` while the direction is
/// quiet or carries small messages (requests, answers, stream events), so each message costs one
/// completion and one send, no submission and no poll arming for the receive. Once a read
/// brings `COPY_BELOW` or more the direction is carrying bulk: the multishot receive is stopped
/// (what it still delivers goes out first, in order) and the direction switches to splice
/// through `pipe`, and back to copying when a splice brings less than `COPY_BELOW`.
async fn pump(
    from: RawFd,
    to: RawFd,
    pipe: &Pipe,
    buf: &mut Vec<u8>,
    moved: &Cell<u64>,
) -> Result<(), Fault> {
    let mut multi = op::MultiRecv::new(from);
    let mut bulk = false;
    // After a splice that filled the pipe more bytes are likely waiting: splice again at once;
    // otherwise wait for readability first so an idle direction holds no kernel worker.
    let mut hot = false;
    loop {
        if !bulk {
            buf.clear();
            // Where receives fall back to single-shot ones (no provided buffers, or the
            // multishot one stopped), a read must be able to bring `COPY_BELOW` to count as bulk.
            if buf.capacity() < COPY_BELOW {
                buf.reserve(COPY_BELOW);
            }
            match op::recv_multi(&mut multi, buf, None).await {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) => {
                    continue
                }
                Err(_) => return Err(Fault::Source),
            }
            bulk = buf.len() >= COPY_BELOW;
            // Before splicing, the multishot receive must let go of the socket; bytes it took
            // meanwhile are sent first. The end or an error it met ends the direction after.
            let end = if bulk {
                multi.stop_into(buf).await
            } else {
                None
            };
            let n = buf.len();
            let (r, b) = op::send_all(to, std::mem::take(buf), 0, n).await;
            *buf = b;
            if r.is_err() {
                return Err(Fault::Destination);
            }
            moved.set(moved.get() + n as u64);
            match end {
                Some(Ok(_)) => return Ok(()),
                Some(Err(_)) => return Err(Fault::Source),
                None => {}
            }
            hot = bulk;
            continue;
        }
        if !hot && op::poll(from, READABLE).await.is_err() {
            return Err(Fault::Source);
        }
        let n = match splice(from, pipe.write, pipe.capacity as u32).await {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) => {
                hot = false;
                continue;
            }
            Err(_) => return Err(Fault::Source),
        };
        drain_pipe(pipe, to, n, |m| moved.set(moved.get() + m as u64)).await?;
        hot = n == pipe.capacity;
        bulk = n >= COPY_BELOW;
    }
}

/// Splice the `n` bytes in `pipe` out to `to`; `moved` hears of every piece.
async fn drain_pipe(
    pipe: &Pipe,
    to: RawFd,
    mut n: usize,
    mut moved: impl FnMut(usize),
) -> Result<(), Fault> {
    while n > 0 {
        match splice(pipe.read, to, n as u32).await {
            Ok(0) => return Err(Fault::Destination),
            Ok(m) => {
                n -= m;
                moved(m);
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) => {}
            Err(_) => return Err(Fault::Destination),
        }
    }
    Ok(())
}

/// Move exactly `len` bytes from socket `from` to socket `to` through `pipe` by splice (the L7
/// path's large response bodies); `moved` hears of every piece delivered. Waits for
/// readability before each splice from `from` that may find nothing, so no kernel worker sits
/// on an idle socket. Ok leaves the pipe empty; a source that ends early is `Fault::Source`.
pub(crate) async fn splice_exact(
    from: RawFd,
    to: RawFd,
    pipe: &Pipe,
    mut len: u64,
    mut moved: impl FnMut(usize),
) -> Result<(), Fault> {
    let mut hot = false;
    while len > 0 {
        if !hot && op::poll(from, READABLE).await.is_err() {
            return Err(Fault::Source);
        }
        let want = len.min(pipe.capacity as u64) as u32;
        let n = match splice(from, pipe.write, want).await {
            Ok(0) => return Err(Fault::Source),
            Ok(n) => n,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) => {
                hot = false;
                continue;
            }
            Err(_) => return Err(Fault::Source),
        };
        drain_pipe(pipe, to, n, &mut moved).await?;
        len -= n as u64;
        hot = n as u32 == want;
    }
    Ok(())
}

/// Relay between client `cfd` and replica `rfd` until both directions ended or one failed.
/// The caller closes both sockets afterwards.
pub(crate) async fn relay(
    w: &Worker,
    cfd: RawFd,
    rfd: RawFd,
    in_flight: &mut InFlight<'_>,
) -> Moved {
    let (up_pipe, down_pipe) = match (take_pipe(), take_pipe()) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => {
            for p in [a, b].into_iter().flatten() {
                give_pipe(p, true);
            }
            shutdown(cfd, libc::SHUT_RDWR);
            shutdown(rfd, libc::SHUT_RDWR);
            return Moved {
                aborted: true,
                ..Moved::default()
            };
        }
    };
    let mut up_buf = w.take_buf();
    let mut down_buf = w.take_buf();
    let up_moved = Cell::new(0u64);
    let down_moved = Cell::new(0u64);
    let mut failure: Option<(bool, Fault)> = None;
    {
        let mut up = pin!(pump(cfd, rfd, &up_pipe, &mut up_buf, &up_moved));
        let mut down = pin!(pump(rfd, cfd, &down_pipe, &mut down_buf, &down_moved));
        let (mut up_done, mut down_done) = (false, false);
        std::future::poll_fn(|cx| {
            if !up_done {
                if let Poll::Ready(r) = up.as_mut().poll(cx) {
                    up_done = true;
                    match r {
                        // The client finished sending: pass its FIN on.
                        Ok(()) => shutdown(rfd, libc::SHUT_WR),
                        Err(f) => {
                            failure = Some((true, f));
                            return Poll::Ready(());
                        }
                    }
                }
            }
            if !down_done {
                if let Poll::Ready(r) = down.as_mut().poll(cx) {
                    down_done = true;
                    match r {
                        Ok(()) => shutdown(cfd, libc::SHUT_WR),
                        Err(f) => {
                            failure = Some((false, f));
                            return Poll::Ready(());
                        }
                    }
                }
            }
            if down_moved.get() > 0 {
                in_flight.first_byte();
            }
            if up_done && down_done {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        if failure.is_some() {
            // Wake any splice the kernel is still running on these sockets, then drop the
            // pumps (which cancels what is left).
            shutdown(cfd, libc::SHUT_RDWR);
            shutdown(rfd, libc::SHUT_RDWR);
        }
    }
    w.give_buf(up_buf);
    w.give_buf(down_buf);
    let clean = failure.is_none();
    give_pipe(up_pipe, clean);
    give_pipe(down_pipe, clean);
    let client_aborted = match failure {
        // The up pump reads the client; the down pump writes it.
        Some((true, Fault::Source)) | Some((false, Fault::Destination)) => true,
        _ => false,
    };
    Moved {
        up: up_moved.get(),
        down: down_moved.get(),
        aborted: !clean,
        client_aborted,
    }
}
