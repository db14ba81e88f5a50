//! Racing two futures: the first to finish wins and the other is dropped, which cancels its
//! pending operations.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

pub enum Either<A, B> {
    Left(A),
    Right(B),
}

pub struct Select<A, B> {
    a: A,
    b: B,
}

/// Poll `a` first, then `b`.
pub fn select<A: Future + Unpin, B: Future + Unpin>(a: A, b: B) -> Select<A, B> {
    Select { a, b }
}

impl<A: Future + Unpin, B: Future + Unpin> Future for Select<A, B> {
    type Output = Either<A::Output, B::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(v) = Pin::new(&mut self.a).poll(cx) {
            return Poll::Ready(Either::Left(v));
        }
        if let Poll::Ready(v) = Pin::new(&mut self.b).poll(cx) {
            return Poll::Ready(Either::Right(v));
        }
        Poll::Pending
    }
}
