//! The client side of a connection while kvlb works on its request: one receive, armed when
//! the request has been read, that is both the hang-up watch (0 bytes or an error: the client
//! went away, so its replica request is cancelled) and, once the answer is out, the wait for
//! the client's next request. One receive per request instead of a receive, a poll and the
//! poll's cancellation.
//!
//! A client that pipelines (sends its next request before the answer) completes the receive
//! with data; that data is kept for the next round and a poll for hang-up (`POLLRDHUP`) watches
//! the rest of the current request, as before.
//!
//! Only this type receives from the client socket: two receives pending on one socket would
//! split its bytes between them.

use crate::rt::{self, op};
use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

const HUP_MASK: u32 = (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) as u32;

pub struct ClientWatch {
    fd: RawFd,
    /// The receive in flight, into the next-request buffer.
    recv: Option<op::RecvOp>,
    /// Hang-up poll, used once the receive has completed with pipelined data.
    hup: Option<op::PollOp>,
    /// Bytes received ahead of the request being served, when `recv` is not in flight; its
    /// allocation travels with the receive while one is.
    next: Vec<u8>,
    /// The receive saw the end of the stream or an error.
    ended: Option<io::Result<usize>>,
    /// The hang-up poll itself failed: carry on without a watch.
    blind: bool,
}

impl ClientWatch {
    pub fn new(fd: RawFd, buf: Vec<u8>) -> ClientWatch {
        ClientWatch {
            fd,
            recv: None,
            hup: None,
            next: buf,
            ended: None,
            blind: false,
        }
    }

    /// Start watching the client (no-op if already watching). Call once the request has been
    /// read whole, before waiting on the replica.
    pub fn arm(&mut self) {
        if self.recv.is_some() || self.hup.is_some() || self.ended.is_some() || self.blind {
            return;
        }
        if self.next.is_empty() {
            let buf = std::mem::take(&mut self.next);
            self.recv = Some(op::RecvOp::start(self.fd, buf, None, true));
        } else {
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
        if let Some(mut r) = self.recv.take() {
            rt::set_deadline(r.slot(), Some(timeout));
            let (res, b) = (&mut r).await;
            self.next = b;
            if !matches!(res, Ok(n) if n > 0) {
                return res;
            }
        } else if let Some(res) = self.ended.take() {
            return res;
        } else if self.next.is_empty() {
            if buf.capacity() - buf.len() < 4096 {
                buf.reserve(4096);
            }
            let (res, b) = op::recv(self.fd, std::mem::take(buf), Some(timeout)).await;
            *buf = b;
            return res;
        }
        let n = self.next.len();
        if buf.is_empty() {
            std::mem::swap(buf, &mut self.next);
        } else {
            buf.extend_from_slice(&self.next);
            self.next.clear();
        }
        Ok(n)
    }

    /// Hand back the next-request buffer when the connection ends (None while a receive still
    /// holds it: it is freed when the kernel lets go).
    pub fn finish(mut self) -> Option<Vec<u8>> {
        self.hup = None;
        self.recv = None;
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
        if w.ended.is_some() {
            return Poll::Ready(());
        }
        if let Some(r) = w.recv.as_mut() {
            match Pin::new(r).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready((res, b)) => {
                    w.recv = None;
                    w.next = b;
                    if !matches!(res, Ok(n) if n > 0) {
                        w.ended = Some(res);
                        return Poll::Ready(());
                    }
                    // Pipelined bytes: keep them, watch for hang-up by poll from now on.
                    w.hup = Some(op::PollOp::start(w.fd, HUP_MASK));
                }
            }
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
