//! The PUB side: bind, accept any number of SUB/XSUB peers, filter by their topic prefixes, and
//! queue each message per subscriber in a bounded queue. A subscriber whose queue is full loses
//! the message (like ZeroMQ's send high-water mark); the publisher never waits for a reader.

#![forbid(unsafe_code)]

use super::wire::{encode_message, Connection, Incoming};
use super::{accept_peers, bind_listener, wake_address, Accepting, HANDSHAKE_TIMEOUT};
use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender, TrySendError};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// ZeroMQ's default send high-water mark, in messages.
pub const DEFAULT_QUEUE_MESSAGES: usize = 1000;

/// How often idle writer threads look at the liveness flags.
const WRITER_POLL: Duration = Duration::from_millis(200);

/// Largest write a writer thread gathers from its queue before sending.
const WRITE_GATHER_BYTES: usize = 256 * 1024;

/// A bound PUB socket. Dropping it closes the listener and every subscriber connection.
pub struct PubServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    accept_thread: Option<JoinHandle<()>>,
}

struct Shared {
    subscribers: Mutex<Vec<Peer>>,
    shutdown: AtomicBool,
    queue_messages: usize,
    dropped: AtomicU64,
}

/// One subscriber as the publishing side sees it.
struct Peer {
    subscriber: Arc<Subscriber>,
    queue: Sender<Arc<Vec<u8>>>,
    stream: TcpStream,
}

/// State shared by a subscriber's reader thread (which applies its subscriptions) and the
/// publisher (which filters with them).
struct Subscriber {
    /// Subscribed topic prefixes with their subscription counts (ZeroMQ counts duplicates).
    prefixes: Mutex<Vec<(Vec<u8>, u32)>>,
    alive: AtomicBool,
}

impl Subscriber {
    fn wants(&self, topic: &[u8]) -> bool {
        let prefixes = self.prefixes.lock().unwrap_or_else(|e| e.into_inner());
        prefixes.iter().any(|(p, _)| topic.starts_with(p))
    }

    fn has_subscriptions(&self) -> bool {
        !self
            .prefixes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    fn subscribe(&self, prefix: &[u8]) {
        let mut prefixes = self.prefixes.lock().unwrap_or_else(|e| e.into_inner());
        match prefixes.iter_mut().find(|(p, _)| p == prefix) {
            Some((_, n)) => *n += 1,
            None => prefixes.push((prefix.to_vec(), 1)),
        }
    }

    fn cancel(&self, prefix: &[u8]) {
        let mut prefixes = self.prefixes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = prefixes.iter().position(|(p, _)| p == prefix) {
            prefixes[i].1 -= 1;
            if prefixes[i].1 == 0 {
                prefixes.swap_remove(i);
            }
        }
    }
}

impl PubServer {
    /// Bind `endpoint` ("tcp://127.0.0.1:0", "tcp://*:5557") with ZeroMQ's default queue of
    /// 1000 messages per subscriber.
    pub fn bind(endpoint: &str) -> io::Result<PubServer> {
        PubServer::bind_with_queue(endpoint, DEFAULT_QUEUE_MESSAGES)
    }

    /// Bind with a queue of `queue_messages` (at least 1) per subscriber.
    pub fn bind_with_queue(endpoint: &str, queue_messages: usize) -> io::Result<PubServer> {
        let listener = bind_listener(endpoint)?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            subscribers: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            queue_messages: queue_messages.max(1),
            dropped: AtomicU64::new(0),
        });
        let accept_shared = shared.clone();
        let accept_thread = thread::Builder::new()
            .name("zmtp-pub-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))?;
        Ok(PubServer {
            shared,
            local_addr,
            accept_thread: Some(accept_thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Queue one message for every subscriber whose prefixes match its first frame. Returns
    /// how many subscribers it was queued for; a subscriber with a full queue misses it.
    pub fn send(&self, frames: &[&[u8]]) -> usize {
        let topic = frames.first().copied().unwrap_or(&[]);
        let mut subscribers = self
            .shared
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        subscribers.retain(|p| p.subscriber.alive.load(Ordering::Acquire));
        let mut wire: Option<Arc<Vec<u8>>> = None;
        let mut queued = 0;
        for peer in subscribers.iter() {
            if !peer.subscriber.wants(topic) {
                continue;
            }
            let bytes = wire
                .get_or_insert_with(|| Arc::new(encode_message(frames)))
                .clone();
            match peer.queue.try_send(bytes) {
                Ok(()) => queued += 1,
                Err(TrySendError::Full(_)) => {
                    self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Disconnected(_)) => {
                    peer.subscriber.alive.store(false, Ordering::Release);
                }
            }
        }
        queued
    }

    /// Connected subscribers that have at least one subscription.
    pub fn subscribed_peers(&self) -> usize {
        let subscribers = self
            .shared
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        subscribers
            .iter()
            .filter(|p| p.subscriber.alive.load(Ordering::Acquire))
            .filter(|p| p.subscriber.has_subscriptions())
            .count()
    }

    /// Topic prefixes subscribed, summed over connected subscribers (duplicates count once per
    /// subscriber).
    pub fn subscriptions(&self) -> usize {
        let subscribers = self
            .shared
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        subscribers
            .iter()
            .filter(|p| p.subscriber.alive.load(Ordering::Acquire))
            .map(|p| {
                p.subscriber
                    .prefixes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .len()
            })
            .sum()
    }

    /// Messages lost so far because a subscriber's queue was full.
    pub fn dropped_messages(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }
}

impl Drop for PubServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&wake_address(self.local_addr), Duration::from_secs(1));
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        let mut subscribers = self
            .shared
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for peer in subscribers.drain(..) {
            peer.subscriber.alive.store(false, Ordering::Release);
            let _ = peer.stream.shutdown(Shutdown::Both);
        }
    }
}

impl Accepting for Shared {
    fn shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    accept_peers(listener, shared, "zmtp-pub-peer", serve_subscriber);
}

/// Handshake, register the subscriber, start its writer, then read its subscriptions until it
/// goes away.
fn serve_subscriber(stream: TcpStream, shared: Arc<Shared>) {
    let Ok(mut conn) =
        Connection::handshake(stream, true, "PUB", &["SUB", "XSUB"], HANDSHAKE_TIMEOUT)
    else {
        return;
    };
    let (Ok(write_stream), Ok(shutdown_stream)) =
        (conn.try_clone_stream(), conn.try_clone_stream())
    else {
        return;
    };
    let subscriber = Arc::new(Subscriber {
        prefixes: Mutex::new(Vec::new()),
        alive: AtomicBool::new(true),
    });
    let (tx, rx) = channel::bounded(shared.queue_messages);
    {
        let mut subscribers = shared.subscribers.lock().unwrap_or_else(|e| e.into_inner());
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        subscribers.push(Peer {
            subscriber: subscriber.clone(),
            queue: tx,
            stream: shutdown_stream,
        });
    }
    let writer_sub = subscriber.clone();
    let writer_shared = shared.clone();
    let spawned = thread::Builder::new()
        .name("zmtp-pub-writer".into())
        .spawn(move || write_loop(write_stream, rx, writer_sub, writer_shared));
    if spawned.is_err() {
        subscriber.alive.store(false, Ordering::Release);
        conn.shutdown();
        return;
    }
    loop {
        match conn.read_incoming(None) {
            Ok(Some(Incoming::Command { name, data })) => match name.as_slice() {
                b"SUBSCRIBE" => subscriber.subscribe(&data),
                b"CANCEL" => subscriber.cancel(&data),
                b"PING" if conn.answer_ping(&data).is_err() => break,
                _ => {}
            },
            Ok(Some(Incoming::Message(frames))) => {
                // ZMTP 3.0 subscriptions: one frame, 0x01 or 0x00 then the prefix. Anything
                // else a subscriber sends is ignored, as libzmq's PUB does.
                if let [frame] = frames.as_slice() {
                    match frame.first() {
                        Some(1) => subscriber.subscribe(&frame[1..]),
                        Some(0) => subscriber.cancel(&frame[1..]),
                        _ => {}
                    }
                }
            }
            Ok(None) | Err(_) => break,
        }
    }
    subscriber.alive.store(false, Ordering::Release);
    conn.shutdown();
}

fn write_loop(
    mut stream: TcpStream,
    queue: Receiver<Arc<Vec<u8>>>,
    subscriber: Arc<Subscriber>,
    shared: Arc<Shared>,
) {
    let mut gathered = Vec::new();
    loop {
        let first = match queue.recv_timeout(WRITER_POLL) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                if !subscriber.alive.load(Ordering::Acquire)
                    || shared.shutdown.load(Ordering::Acquire)
                {
                    return;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return,
        };
        gathered.clear();
        gathered.extend_from_slice(&first);
        while gathered.len() < WRITE_GATHER_BYTES {
            match queue.try_recv() {
                Ok(m) => gathered.extend_from_slice(&m),
                Err(_) => break,
            }
        }
        if stream.write_all(&gathered).is_err() {
            subscriber.alive.store(false, Ordering::Release);
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    }
}
