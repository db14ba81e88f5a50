//! The ROUTER side of a request/reply exchange (KV event replay): accept DEALER peers, hand each
//! request to a handler and write the handler's replies back on the same connection. Since the
//! answer always goes to the connection that asked, no routing identity is needed: the handler
//! sees exactly the frames the DEALER sent.

#![forbid(unsafe_code)]

use super::wire::{Connection, Incoming};
use super::{accept_peers, bind_listener, wake_address, Accepting, Message, HANDSHAKE_TIMEOUT};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Turns one request (its frames) into the reply messages to send back, in order.
pub type RequestHandler = dyn Fn(&[Vec<u8>]) -> Vec<Message> + Send + Sync;

/// Bytes of replies gathered before each write.
const WRITE_GATHER_BYTES: usize = 256 * 1024;

/// A bound ROUTER socket. Dropping it closes the listener and every connection.
pub struct RouterServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    accept_thread: Option<JoinHandle<()>>,
}

struct Shared {
    handler: Box<RequestHandler>,
    shutdown: AtomicBool,
    /// Open connections, to shut them down when the server is dropped.
    peers: Mutex<Vec<TcpStream>>,
}

impl RouterServer {
    /// Bind `endpoint` and serve every request with `handler`.
    pub fn bind<H>(endpoint: &str, handler: H) -> io::Result<RouterServer>
    where
        H: Fn(&[Vec<u8>]) -> Vec<Message> + Send + Sync + 'static,
    {
        let listener = bind_listener(endpoint)?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            handler: Box::new(handler),
            shutdown: AtomicBool::new(false),
            peers: Mutex::new(Vec::new()),
        });
        let accept_shared = shared.clone();
        let accept_thread = thread::Builder::new()
            .name("zmtp-router-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))?;
        Ok(RouterServer {
            shared,
            local_addr,
            accept_thread: Some(accept_thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for RouterServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&wake_address(self.local_addr), Duration::from_secs(1));
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        let mut peers = self.shared.peers.lock().unwrap_or_else(|e| e.into_inner());
        for s in peers.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Accepting for Shared {
    fn shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    accept_peers(listener, shared, "zmtp-router-peer", serve_peer);
}

fn serve_peer(stream: TcpStream, shared: Arc<Shared>) {
    let peer_addr = stream.peer_addr().ok();
    let Ok(mut conn) = Connection::handshake(
        stream,
        true,
        "ROUTER",
        &["DEALER", "REQ", "ROUTER"],
        HANDSHAKE_TIMEOUT,
    ) else {
        return;
    };
    {
        let mut peers = shared.peers.lock().unwrap_or_else(|e| e.into_inner());
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        if let Ok(s) = conn.try_clone_stream() {
            peers.push(s);
        }
    }
    let mut out = Vec::new();
    'serve: loop {
        match conn.read_incoming(None) {
            Ok(Some(Incoming::Message(request))) => {
                out.clear();
                for reply in (shared.handler)(&request) {
                    let frames: Vec<&[u8]> = reply.iter().map(|f| f.as_slice()).collect();
                    super::wire::put_message(&mut out, &frames);
                    if out.len() >= WRITE_GATHER_BYTES {
                        if conn.write_raw(&out).is_err() {
                            break 'serve;
                        }
                        out.clear();
                    }
                }
                if !out.is_empty() && conn.write_raw(&out).is_err() {
                    break;
                }
            }
            Ok(Some(Incoming::Command { name, data })) => {
                if name == b"PING" && conn.answer_ping(&data).is_err() {
                    break;
                }
            }
            Ok(None) | Err(_) => break,
        }
    }
    conn.shutdown();
    let mut peers = shared.peers.lock().unwrap_or_else(|e| e.into_inner());
    peers.retain(|s| s.peer_addr().ok() != peer_addr && s.peer_addr().is_ok());
}
