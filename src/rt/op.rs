//! io_uring operations as futures. Each owns the memory the kernel reads or writes (buffers,
//! socket addresses) until its completion is reaped; see the module header of `rt`.

use super::{
    abandon_slot, multishot_next, poll_slot, recycle_buffer, set_deadline, submit,
    submit_multishot, submit_timeout, submit_with_timeout, take_buffer,
};
use io_uring::{opcode, types::Fd};
use std::any::Any;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// A submitted operation holding `T` (its buffers) until it completes.
struct Op<T: Unpin + 'static> {
    slot: u32,
    data: Option<T>,
    done: bool,
}

impl<T: Unpin + 'static> Op<T> {
    fn new(slot: u32, data: T) -> Op<T> {
        Op {
            slot,
            data: Some(data),
            done: false,
        }
    }
}

impl<T: Unpin + 'static> Future for Op<T> {
    type Output = (i32, u32, T);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match poll_slot(self.slot, cx) {
            Poll::Ready((res, flags)) => {
                self.done = true;
                let data = self.data.take().expect("operation polled after completion");
                Poll::Ready((res, flags, data))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: Unpin + 'static> Drop for Op<T> {
    fn drop(&mut self) {
        if !self.done {
            let keep = self.data.take().map(|d| Box::new(d) as Box<dyn Any>);
            abandon_slot(self.slot, keep);
        }
    }
}

fn errno(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

/// `IORING_RECVSEND_POLL_FIRST` (linux/io_uring.h), in a receive's ioprio field.
const RECVSEND_POLL_FIRST: u16 = 1;

/// A receive in flight, as a named `Unpin` future that can be stored, polled from several
/// places and have its deadline moved (`rt::set_deadline` with `slot()`).
pub struct RecvOp {
    op: Op<Vec<u8>>,
    len: usize,
}

impl RecvOp {
    /// Receive into the spare capacity of `buf` (grown if it has none). `poll_first` skips the
    /// kernel's first, non-blocking attempt when the caller knows nothing has arrived yet (an
    /// answer not asked for yet, the next request of a keep-alive client).
    pub fn start(
        fd: RawFd,
        mut buf: Vec<u8>,
        timeout: Option<Duration>,
        poll_first: bool,
    ) -> RecvOp {
        if buf.capacity() == buf.len() {
            buf.reserve(4096);
        }
        let len = buf.len();
        let spare = (buf.capacity() - len).min(u32::MAX as usize) as u32;
        // Safety: the pointer is inside buf's heap allocation, which `Op` owns until completion.
        let ptr = unsafe { buf.as_mut_ptr().add(len) };
        let ioprio = if poll_first { RECVSEND_POLL_FIRST } else { 0 };
        let entry = opcode::Recv::new(Fd(fd), ptr, spare).ioprio(ioprio).build();
        let slot = match timeout {
            Some(d) => submit_with_timeout(entry, d),
            None => submit(entry),
        };
        RecvOp {
            op: Op::new(slot, buf),
            len,
        }
    }

    pub fn slot(&self) -> u32 {
        self.op.slot
    }
}

impl Future for RecvOp {
    /// Bytes received (0 at end of stream; `ErrorKind::TimedOut` when its deadline passed) and
    /// the buffer, extended by them.
    type Output = (io::Result<usize>, Vec<u8>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let len = self.len;
        match Pin::new(&mut self.op).poll(cx) {
            Poll::Ready((res, _, mut buf)) => Poll::Ready(if res >= 0 {
                // Safety: the kernel initialised `res` bytes after `len`.
                unsafe { buf.set_len(len + res as usize) };
                (Ok(res as usize), buf)
            } else if res == -libc::ECANCELED {
                // Only a passed deadline cancels an operation whose future is still alive.
                (
                    Err(io::Error::new(io::ErrorKind::TimedOut, "receive timed out")),
                    buf,
                )
            } else {
                (Err(errno(res)), buf)
            }),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A multishot receive on one socket: armed once, it stays armed across requests, so waiting
/// for the next request or answer costs no submission and no poll arming (the io_uring
/// counterpart of an edge-triggered epoll registration). Bytes arrive in the worker's provided
/// buffers and are copied into the caller's buffer. When it stops (the kernel ran out of
/// buffers, or kvlb throttled a reader that fell behind) the caller's next receive is a
/// single-shot one and the one after re-arms it.
pub struct MultiRecv {
    fd: RawFd,
    slot: Option<u32>,
}

/// What a multishot receive delivered.
#[derive(Debug)]
pub enum Received {
    /// Bytes appended to the caller's buffer.
    Data(usize),
    /// End of stream.
    Eof,
    /// The deadline passed.
    TimedOut,
    /// An error from the socket.
    Failed(io::Error),
    /// The multishot receive stopped with nothing delivered; the socket may hold data: receive
    /// once the ordinary way.
    Stopped,
}

impl MultiRecv {
    pub fn new(fd: RawFd) -> MultiRecv {
        MultiRecv { fd, slot: None }
    }

    /// Arm it if it is not armed; false where the kernel has no provided buffer rings.
    pub fn arm(&mut self) -> bool {
        if self.slot.is_none() {
            let entry = opcode::RecvMulti::new(Fd(self.fd), super::bufring::GROUP).build();
            self.slot = submit_multishot(entry);
        }
        self.slot.is_some()
    }

    pub fn armed(&self) -> bool {
        self.slot.is_some()
    }

    /// Begin stopping it, keeping every byte: later `poll_recv` calls deliver what was received
    /// before the kernel let go, then `Received::Stopped` (or the end, or an error) and it is
    /// disarmed. Dropping it instead would discard bytes in flight.
    pub fn stop(&mut self) {
        if let Some(slot) = self.slot {
            super::stop_multishot(slot);
        }
    }

    /// Stop it and wait until it has (see `stop`), appending what it still delivers to `buf`.
    /// Returns the end of stream or an error if that is what it met.
    pub async fn stop_into(&mut self, buf: &mut Vec<u8>) -> Option<io::Result<usize>> {
        self.stop();
        while self.armed() {
            match std::future::poll_fn(|cx| self.poll_recv(cx, buf)).await {
                Received::Data(_) | Received::Stopped | Received::TimedOut => {}
                Received::Eof => return Some(Ok(0)),
                Received::Failed(e) => return Some(Err(e)),
            }
        }
        None
    }

    /// Ready once something (bytes, the end, an error, its deadline) is waiting to be taken;
    /// takes nothing. Ready at once when not armed.
    pub fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self.slot {
            Some(slot) if !super::multishot_ready(slot, cx) => Poll::Pending,
            _ => Poll::Ready(()),
        }
    }

    /// Nothing has arrived since the last receive (no data, no end, no error waiting).
    pub fn quiet(&self) -> bool {
        self.slot.is_none_or(super::multishot_quiet)
    }

    /// Move its deadline (None: none). No-op when not armed.
    pub fn set_deadline(&self, after: Option<Duration>) {
        if let Some(slot) = self.slot {
            set_deadline(slot, after);
        }
    }

    /// Deliver what has arrived (every waiting completion, appended to `buf`), or register the
    /// task's waker. Pending when not armed.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>, buf: &mut Vec<u8>) -> Poll<Received> {
        let mut got = 0usize;
        while let Some(slot) = self.slot {
            let Some(c) = multishot_next(slot, cx) else {
                break;
            };
            if c.last {
                self.slot = None;
            }
            let bid = io_uring::cqueue::buffer_select(c.flags);
            if c.res > 0 {
                if let Some(bid) = bid {
                    take_buffer(bid, c.res as usize, buf);
                    got += c.res as usize;
                }
                continue;
            }
            if let Some(bid) = bid {
                recycle_buffer(bid);
            }
            if got > 0 {
                // Deliver the bytes now. It is disarmed: the next receive re-arms it and meets
                // the end or the error again on the socket itself.
                return Poll::Ready(Received::Data(got));
            }
            return Poll::Ready(if c.res == 0 {
                Received::Eof
            } else if c.res == -libc::ECANCELED && !c.throttled {
                Received::TimedOut
            } else if c.res == -libc::ECANCELED || c.res == -libc::ENOBUFS {
                Received::Stopped
            } else {
                Received::Failed(errno(c.res))
            });
        }
        if got > 0 {
            Poll::Ready(Received::Data(got))
        } else {
            Poll::Pending
        }
    }
}

impl Drop for MultiRecv {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            abandon_slot(slot, None);
        }
    }
}

/// Receive into `buf` through `m` (armed here if it is not), waiting at most `timeout`: the
/// bytes received (0 at end of stream; `ErrorKind::TimedOut` past the deadline). Falls back to
/// one ordinary receive when multishot receives are unavailable or stopped.
pub async fn recv_multi(
    m: &mut MultiRecv,
    buf: &mut Vec<u8>,
    timeout: Option<Duration>,
) -> io::Result<usize> {
    if m.arm() {
        let mut waited = false;
        let r = std::future::poll_fn(|cx| {
            let r = m.poll_recv(cx, buf);
            if r.is_pending() && !waited {
                waited = true;
                m.set_deadline(timeout);
            }
            r
        })
        .await;
        match r {
            Received::Data(n) => return Ok(n),
            Received::Eof => return Ok(0),
            Received::TimedOut => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "receive timed out"))
            }
            Received::Failed(e) => return Err(e),
            Received::Stopped => {}
        }
    }
    if buf.capacity() - buf.len() < 4096 {
        buf.reserve(4096);
    }
    let (r, b) = recv(m.fd, std::mem::take(buf), timeout).await;
    *buf = b;
    r
}

/// Receive into the spare capacity of `buf` (which must have some), extending its length.
/// With a timeout the receive is cancelled at the deadline: `ErrorKind::TimedOut`.
pub async fn recv(
    fd: RawFd,
    buf: Vec<u8>,
    timeout: Option<Duration>,
) -> (io::Result<usize>, Vec<u8>) {
    RecvOp::start(fd, buf, timeout, false).await
}

/// Send `buf[range]` once (may be partial).
pub async fn send(
    fd: RawFd,
    buf: Vec<u8>,
    start: usize,
    end: usize,
) -> (io::Result<usize>, Vec<u8>) {
    debug_assert!(start <= end && end <= buf.len());
    // Safety: inside buf's heap allocation, owned by `Op` until completion.
    let ptr = unsafe { buf.as_ptr().add(start) };
    let entry = opcode::Send::new(Fd(fd), ptr, (end - start).min(u32::MAX as usize) as u32)
        .flags(libc::MSG_NOSIGNAL)
        .build();
    let (res, _, buf) = Op::new(submit(entry), buf).await;
    if res >= 0 {
        (Ok(res as usize), buf)
    } else {
        (Err(errno(res)), buf)
    }
}

/// Send all of `buf[start..end]`.
pub async fn send_all(
    fd: RawFd,
    mut buf: Vec<u8>,
    mut start: usize,
    end: usize,
) -> (io::Result<()>, Vec<u8>) {
    while start < end {
        let (r, b) = send(fd, buf, start, end).await;
        buf = b;
        match r {
            Ok(0) => return (Err(io::ErrorKind::WriteZero.into()), buf),
            Ok(n) => start += n,
            Err(e) => return (Err(e), buf),
        }
    }
    (Ok(()), buf)
}

/// Send a static byte string completely (error responses).
pub async fn send_static(fd: RawFd, bytes: &'static [u8]) -> io::Result<()> {
    let mut start = 0;
    while start < bytes.len() {
        let rest = &bytes[start..];
        let entry = opcode::Send::new(Fd(fd), rest.as_ptr(), rest.len() as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build();
        let (res, _, ()) = Op::new(submit(entry), ()).await;
        if res < 0 {
            return Err(errno(res));
        }
        if res == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        start += res as usize;
    }
    Ok(())
}

/// Storage for a peer address filled in by accept.
pub struct AddrBuf {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

impl AddrBuf {
    pub fn new() -> Box<AddrBuf> {
        // Safety: sockaddr_storage is plain old data; all-zero is a valid value.
        Box::new(AddrBuf {
            storage: unsafe { std::mem::zeroed() },
            len: 0,
        })
    }

    pub fn to_socket_addr(&self) -> Option<SocketAddr> {
        sockaddr_to_std(&self.storage)
    }
}

/// The address a socket is bound to.
pub fn local_addr(fd: RawFd) -> io::Result<SocketAddr> {
    let mut b = AddrBuf::new();
    b.len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // Safety: getsockname writes at most `len` bytes into the storage we own.
    let r = unsafe {
        libc::getsockname(
            fd,
            &mut b.storage as *mut _ as *mut libc::sockaddr,
            &mut b.len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    b.to_socket_addr()
        .ok_or_else(|| io::Error::other("unknown address family"))
}

/// Bind `fd` to `addr`.
pub fn bind(fd: RawFd, addr: SocketAddr) -> io::Result<()> {
    let raw = std_to_sockaddr(addr);
    // Safety: raw holds a valid sockaddr of raw.len bytes for addr's family.
    let r = unsafe {
        libc::bind(
            fd,
            &raw.storage as *const _ as *const libc::sockaddr,
            raw.len,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Accept one connection; the peer address lands in `addr` (reused across calls).
pub async fn accept(fd: RawFd, mut addr: Box<AddrBuf>) -> (io::Result<RawFd>, Box<AddrBuf>) {
    addr.len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let sa = &mut addr.storage as *mut libc::sockaddr_storage as *mut libc::sockaddr;
    let lp = &mut addr.len as *mut libc::socklen_t;
    let entry = opcode::Accept::new(Fd(fd), sa, lp)
        .flags(libc::SOCK_CLOEXEC)
        .build();
    let (res, _, addr) = Op::new(submit(entry), addr).await;
    if res >= 0 {
        (Ok(res), addr)
    } else {
        (Err(errno(res)), addr)
    }
}

struct SockAddrRaw {
    storage: libc::sockaddr_storage,
    len: libc::socklen_t,
}

/// Connect `fd` to `addr`, giving up after `timeout`.
pub async fn connect(fd: RawFd, addr: SocketAddr, timeout: Duration) -> io::Result<()> {
    let raw = Box::new(std_to_sockaddr(addr));
    let entry = opcode::Connect::new(
        Fd(fd),
        &raw.storage as *const libc::sockaddr_storage as *const libc::sockaddr,
        raw.len,
    )
    .build();
    let (res, _, _raw) = Op::new(submit_with_timeout(entry, timeout), raw).await;
    if res >= 0 {
        Ok(())
    } else if res == -libc::ECANCELED {
        Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
    } else {
        Err(errno(res))
    }
}

/// A poll in flight, as a named `Unpin` future.
pub struct PollOp {
    op: Op<()>,
}

impl PollOp {
    /// Wait until `fd` reports one of `mask` (poll(2) bits).
    pub fn start(fd: RawFd, mask: u32) -> PollOp {
        PollOp {
            op: Op::new(submit(opcode::PollAdd::new(Fd(fd), mask).build()), ()),
        }
    }
}

impl Future for PollOp {
    /// The bits that fired.
    type Output = io::Result<u32>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.op).poll(cx) {
            Poll::Ready((res, _, ())) if res >= 0 => Poll::Ready(Ok(res as u32)),
            Poll::Ready((res, _, ())) => Poll::Ready(Err(errno(res))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Wait until `fd` reports one of `mask` (poll(2) bits); returns the bits that fired.
pub async fn poll(fd: RawFd, mask: u32) -> io::Result<u32> {
    PollOp::start(fd, mask).await
}

/// Read an eventfd's 8-byte counter.
pub async fn read_eventfd(fd: RawFd) -> io::Result<u64> {
    let buf: Box<[u8; 8]> = Box::new([0; 8]);
    let ptr = buf.as_ptr() as *mut u8;
    let entry = opcode::Read::new(Fd(fd), ptr, 8).build();
    let (res, _, buf) = Op::new(submit(entry), buf).await;
    if res == 8 {
        Ok(u64::from_ne_bytes(*buf))
    } else if res < 0 {
        Err(errno(res))
    } else {
        Err(io::ErrorKind::UnexpectedEof.into())
    }
}

/// Sleep for `d`.
pub async fn sleep(d: Duration) {
    let (_res, _, ()) = Op::new(submit_timeout(d), ()).await;
}

fn std_to_sockaddr(addr: SocketAddr) -> SockAddrRaw {
    // Safety: sockaddr_storage is plain old data; all-zero is a valid value, and it is large
    // and aligned enough for both sockaddr_in and sockaddr_in6.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // Safety: see above; sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // Safety: see above; sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    SockAddrRaw {
        storage,
        len: len as libc::socklen_t,
    }
}

fn sockaddr_to_std(s: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match s.ss_family as i32 {
        libc::AF_INET => {
            // Safety: the family says this storage holds a sockaddr_in.
            let sin = unsafe { &*(s as *const _ as *const libc::sockaddr_in) };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // Safety: the family says this storage holds a sockaddr_in6.
            let sin6 = unsafe { &*(s as *const _ as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
        }
        _ => None,
    }
}

/// A new TCP socket for `addr`'s family, close-on-exec, with TCP_NODELAY.
pub fn tcp_socket(addr: &SocketAddr) -> io::Result<RawFd> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // Safety: plain socket(2) call; the result is checked.
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    set_nodelay(fd);
    Ok(fd)
}

pub fn set_nodelay(fd: RawFd) {
    let one: libc::c_int = 1;
    // Safety: setsockopt with a valid pointer to a c_int and its size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            &one as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Close a descriptor now (a plain syscall: cheaper than a ring round trip for this).
pub fn close(fd: RawFd) {
    // Safety: the caller owns fd and does not use it afterwards.
    unsafe { libc::close(fd) };
}

/// Shut both directions of one of our own listening sockets: its pending accept fails, so the
/// accept loop waiting on it ends (draining).
pub fn shutdown_listener(fd: RawFd) {
    // Safety: shutdown(2) on a descriptor the caller owns; it does not free the descriptor.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}
