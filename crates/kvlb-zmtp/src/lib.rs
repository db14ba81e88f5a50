//! ZeroMQ's wire protocol (ZMTP 3.x, NULL mechanism) over std TCP: the PUB and ROUTER sides a
//! replica binds and the SUB and DEALER sides the balancer connects.
//!
//! Why not libzmq or the `zeromq` crate: the balancer carries no async runtime and no C library,
//! and the subset KV cache events need is small: the greeting, READY with Socket-Type/Identity,
//! frames with MORE/LONG flags, and SUBSCRIBE/CANCEL both as ZMTP 3.1 commands and as ZMTP 3.0
//! messages with a leading 0x01/0x00 byte. Everything here is tested against real libzmq (pyzmq)
//! in tests/kv_events_interop.rs.
//!
//! Servers (`PubServer`, `RouterServer`, used by the simulated replicas) accept on a background
//! thread and serve each peer on its own threads. Clients (`SubClient`, `DealerClient`) block
//! with read timeouts, or, for an event loop holding many of them, never block:
//! `wire::Handshake` is resumable and `SubClient::try_recv` takes only what has arrived.
//! Reconnecting is the caller's business.

#![deny(unsafe_code)]

mod client;
mod pub_server;
pub mod publisher;
mod router;
// Two libc calls on the socket's file descriptor (a non-blocking recv, poll): the one module
// here that may use unsafe.
#[allow(unsafe_code)]
pub mod wire;

pub use client::{DealerClient, SubClient};
pub use pub_server::PubServer;
pub use router::RouterServer;

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// A message: its frames, in order.
pub type Message = Vec<Vec<u8>>;

/// How long a peer has to complete the greeting and READY exchange.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// "tcp://host:port", "tcp://*:port" or "host:port" -> "host:port" ("*" means every interface).
pub fn socket_address(endpoint: &str) -> io::Result<String> {
    let rest = match endpoint.split_once("://") {
        Some(("tcp", rest)) => rest,
        Some((scheme, _)) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "zmtp: endpoint {endpoint:?}: transport {scheme:?} unsupported, use tcp://"
                ),
            ))
        }
        None => endpoint,
    };
    match rest.strip_prefix("*:") {
        Some(port) => Ok(format!("0.0.0.0:{port}")),
        None if rest.rsplit_once(':').is_some() => Ok(rest.to_string()),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("zmtp: endpoint {endpoint:?} has no port (want tcp://host:port)"),
        )),
    }
}

/// A server's shared state, as far as its accept loop cares.
trait Accepting: Send + Sync + 'static {
    fn shutting_down(&self) -> bool;
}

/// Accept peers until the server shuts down, serving each on a thread named `name`.
fn accept_peers<S: Accepting>(
    listener: TcpListener,
    shared: std::sync::Arc<S>,
    name: &str,
    serve: fn(TcpStream, std::sync::Arc<S>),
) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(_) if shared.shutting_down() => return,
            Err(_) => {
                // Out of file descriptors and the like: back off instead of spinning.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if shared.shutting_down() {
            return;
        }
        let peer_shared = shared.clone();
        let _ = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || serve(stream, peer_shared));
    }
}

fn bind_listener(endpoint: &str) -> io::Result<TcpListener> {
    let addr = socket_address(endpoint)?;
    TcpListener::bind(&addr)
        .map_err(|e| io::Error::new(e.kind(), format!("zmtp: cannot bind {endpoint:?}: {e}")))
}

/// Connect to the first address of `endpoint` that answers within `timeout`.
fn connect_stream(endpoint: &str, timeout: Duration) -> io::Result<TcpStream> {
    let addr = socket_address(endpoint)?;
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("zmtp: {endpoint:?} resolves to no address"),
    );
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = io::Error::new(e.kind(), format!("zmtp: connect {a}: {e}")),
        }
    }
    Err(last)
}

/// An address a server thread can connect to in order to wake its blocking accept().
fn wake_address(local: SocketAddr) -> SocketAddr {
    let mut a = local;
    if a.ip().is_unspecified() {
        a.set_ip(match a {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(socket_address("tcp://*:5557").unwrap(), "0.0.0.0:5557");
        assert_eq!(socket_address("tcp://127.0.0.1:0").unwrap(), "127.0.0.1:0");
        assert_eq!(socket_address("10.0.0.1:5558").unwrap(), "10.0.0.1:5558");
        assert_eq!(socket_address("tcp://[::1]:5").unwrap(), "[::1]:5");
        assert!(socket_address("ipc:///tmp/x").is_err());
        assert!(socket_address("tcp://host").is_err());
    }
}

#[cfg(test)]
mod loopback_tests;
