//! The client side of a connection: every receive from the client goes through one multishot
//! receive, armed at the connection's first read and kept armed for its life. It is at once
//! the reader of requests, the wait for the next request of a keep-alive client and, while
//! kvlb waits on a replica, the hang-up watch (end of stream or an error: the client went
//! away, so its replica request is cancelled). Per request that is no receive submission and
//! no poll arming, where single-shot receives cost one of each.
//!
//! A client that pipelines (sends its next request before the answer) has those bytes kept
//! for the next round, up to [`PIPELINED_MAX`]; beyond that, and wherever the multishot receive
//! cannot run (no provided buffers, or stopped), a `POLLRDHUP` poll watches for hang-up.
//!
//! Only this type receives from the client socket: two receives pending on one socket would
//! split its bytes between them.

#![forbid(unsafe_code)]

use crate::rt::op::{self, MultiRecv, Received};
use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

const HUP_MASK: u32 = (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) as u32;

/// Pipelined bytes kept while a request is served; past this the watch stops reading (the rest
/// waits in the socket) and watches for hang-up by poll.
const PIPELINED_MAX: usize = 64 * 1024;

pub struct ClientWatch {
    fd: RawFd,
    /// The connection's multishot receive: armed at the first receive and kept armed, so the
    /// wait for the next request and the hang-up watch cost no submission per request.
    recv: MultiRecv,
    /// Hang-up poll, used when the multishot receive cannot watch (stopped, or too many
    /// pipelined bytes).
    hup: Option<op::PollOp>,
    /// Bytes received ahead of the request being served (allocated only if a client pipelines).
    next: Vec<u8>,
    /// The receive saw the end of the stream or an error.
    ended: Option<io::Result<usize>>,
    /// The hang-up poll itself failed: carry on without a watch.
    blind: bool,
}

impl ClientWatch {
    pub fn new(fd: RawFd) -> ClientWatch {
        ClientWatch {
            fd,
            recv: MultiRecv::new(fd),
            hup: None,
            next: Vec::new(),
            ended: None,
            blind: false,
        }
    }

    /// Start watching the client (no-op if already watching). Call once the request has been
    /// read whole, before waiting on the replica.
    pub fn arm(&mut self) {
        if self.recv.armed() || self.hup.is_some() || self.ended.is_some() || self.blind {
            return;
        }
        if self.next.len() >= PIPELINED_MAX || !self.recv.arm() {
            self.hup = Some(op::PollOp::start(self.fd, HUP_MASK));
        }
    }

    /// Resolves when the client has gone away (never, if it stays).
    pub fn gone(&mut self) -> Gone<'_> {
        Gone { watch: self }
    }

    /// Receive more client bytes, appended to `buf`, waiting at most `timeout`. Bytes the watch
    /// already holds come first. Ok(0) at end of stream.
    pub async fn recv_into(&mut self, buf: &mut Vec<u8>, timeout: Duration) -> io::Result<usize> {
        self.hup = None;
        if !self.next.is_empty() {
            let n = self.next.len();
            if buf.is_empty() {
                std::mem::swap(buf, &mut self.next);
            } else {
                buf.extend_from_slice(&self.next);
                self.next.clear();
            }
            return Ok(n);
        }
        if let Some(res) = self.ended.take() {
            return res;
        }
        op::recv_multi(&mut self.recv, buf, Some(timeout)).await
    }

    /// Wait, holding no buffer, until the client has sent something (or left, or `timeout`
    /// passed): what arrived is then taken by `recv_into`. An idle keep-alive connection
    /// thus holds no buffer of its own.
    pub async fn wait_ready(&mut self, timeout: Duration) {
        self.hup = None;
        if !self.next.is_empty() || self.ended.is_some() || !self.recv.arm() {
            return;
        }
        let mut waited = false;
        std::future::poll_fn(|cx| {
            let r = self.recv.poll_ready(cx);
            if r.is_pending() && !waited {
                waited = true;
                self.recv.set_deadline(Some(timeout));
            }
            r
        })
        .await
    }

    /// Hand back the pipelined-bytes buffer when the connection ends, if it has one.
    pub fn finish(mut self) -> Option<Vec<u8>> {
        self.hup = None;
        let b = std::mem::take(&mut self.next);
        (b.capacity() > 0).then_some(b)
    }
}

pub struct Gone<'a> {
    watch: &'a mut ClientWatch,
}

impl Future for Gone<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let w = &mut *self.watch;
        while w.ended.is_none() && w.recv.armed() {
            match w.recv.poll_recv(cx, &mut w.next) {
                // The waker is registered for the next completion.
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Received::Data(_)) => {
                    // Pipelined bytes: kept for the next request. Too many: stop reading (the
                    // bytes still in flight are kept too) and then watch by poll.
                    if w.next.len() >= PIPELINED_MAX {
                        w.recv.stop();
                    }
                    if !w.recv.armed() {
                        w.hup = Some(op::PollOp::start(w.fd, HUP_MASK));
                    }
                }
                Poll::Ready(Received::Eof) => w.ended = Some(Ok(0)),
                Poll::Ready(Received::Failed(e)) => w.ended = Some(Err(e)),
                Poll::Ready(Received::TimedOut | Received::Stopped) => {
                    w.hup = Some(op::PollOp::start(w.fd, HUP_MASK));
                }
            }
        }
        if w.ended.is_some() {
            return Poll::Ready(());
        }
        if let Some(h) = w.hup.as_mut() {
            match Pin::new(h).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(_)) => {
                    w.hup = None;
                    w.ended = Some(Ok(0));
                    return Poll::Ready(());
                }
                Poll::Ready(Err(_)) => {
                    w.hup = None;
                    w.blind = true;
                }
            }
        }
        Poll::Pending
    }
}
