//! The connecting sides: a SUB client (subscribe to a replica's KV events) and a DEALER client
//! (ask a replica to replay them). Both are blocking with a per-call read timeout; a timeout in
//! the middle of a frame loses nothing. Reconnecting after an error is the caller's business.

#![forbid(unsafe_code)]

use super::wire::{Connection, Handshake, Incoming, PeerVersion};
use super::{connect_stream, Message, HANDSHAKE_TIMEOUT};
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Read the next message within `timeout`, answering PINGs and skipping other commands.
fn recv_message(conn: &mut Connection, timeout: Duration) -> io::Result<Option<Message>> {
    let deadline = Instant::now() + timeout;
    loop {
        match conn.read_incoming(Some(deadline))? {
            None => return Ok(None),
            Some(Incoming::Message(frames)) => return Ok(Some(frames)),
            Some(Incoming::Command { name, data }) => {
                if name == b"PING" {
                    conn.answer_ping(&data)?;
                }
            }
        }
    }
}

fn connect(
    endpoint: &str,
    connect_timeout: Duration,
    socket_type: &'static str,
    accept_peers: &'static [&'static str],
) -> io::Result<Connection> {
    let stream = connect_stream(endpoint, connect_timeout)?;
    Connection::handshake(
        stream,
        false,
        socket_type,
        accept_peers,
        HANDSHAKE_TIMEOUT.min(connect_timeout.max(Duration::from_millis(100))),
    )
    .map_err(|e| io::Error::new(e.kind(), format!("{endpoint}: {e}")))
}

/// A SUB socket connected to one PUB (or XPUB) peer.
pub struct SubClient {
    conn: Connection,
}

impl SubClient {
    /// Connect and handshake within `timeout`. Nothing arrives until `subscribe` is called.
    pub fn connect(endpoint: &str, timeout: Duration) -> io::Result<SubClient> {
        Ok(SubClient {
            conn: connect(endpoint, timeout, "SUB", &["PUB", "XPUB"])?,
        })
    }

    /// Start the handshake of a SUB socket on `stream` (connected, see [`Handshake`]); once
    /// `advance` completes it, [`SubClient::from_handshake`] makes the client.
    pub fn handshake(stream: std::net::TcpStream) -> io::Result<Handshake> {
        Handshake::start(stream, false, "SUB", &["PUB", "XPUB"])
    }

    /// The client of a completed [`SubClient::handshake`].
    pub fn from_handshake(handshake: Handshake) -> SubClient {
        SubClient {
            conn: handshake.finish(),
        }
    }

    /// Receive messages whose first frame starts with `prefix` (empty: everything). Sent as a
    /// SUBSCRIBE command to ZMTP 3.1 peers and as a 0x01-prefixed message to ZMTP 3.0 peers.
    pub fn subscribe(&mut self, prefix: &[u8]) -> io::Result<()> {
        self.subscription(true, prefix)
    }

    /// Undo one `subscribe` of the same prefix.
    pub fn cancel(&mut self, prefix: &[u8]) -> io::Result<()> {
        self.subscription(false, prefix)
    }

    fn subscription(&mut self, on: bool, prefix: &[u8]) -> io::Result<()> {
        if self.conn.peer_version() >= (PeerVersion { major: 3, minor: 1 }) {
            let name = if on { "SUBSCRIBE" } else { "CANCEL" };
            self.conn.send_command(name, prefix)
        } else {
            let mut frame = Vec::with_capacity(prefix.len() + 1);
            frame.push(on as u8);
            frame.extend_from_slice(prefix);
            self.conn.send(&[&frame])
        }
    }

    /// The next message (its frames), or None if none arrives within `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> io::Result<Option<Message>> {
        recv_message(&mut self.conn, timeout)
    }

    /// The next message if it has arrived whole, never waiting (what part of it has arrived
    /// stays buffered for the next call). Ok(None) also means the socket has been read dry.
    pub fn try_recv(&mut self) -> io::Result<Option<Message>> {
        recv_message(&mut self.conn, Duration::ZERO)
    }

    /// Hand a received message back once read: its buffers carry the next messages, so a
    /// subscriber that recycles every message stops allocating once warm.
    pub fn recycle(&mut self, message: Message) {
        self.conn.recycle(message);
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.conn.peer_addr()
    }
}

impl std::os::fd::AsRawFd for SubClient {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.conn.as_raw_fd()
    }
}

/// A DEALER socket connected to one ROUTER peer.
pub struct DealerClient {
    conn: Connection,
}

impl DealerClient {
    /// Connect and handshake within `timeout`.
    pub fn connect(endpoint: &str, timeout: Duration) -> io::Result<DealerClient> {
        Ok(DealerClient {
            conn: connect(endpoint, timeout, "DEALER", &["ROUTER", "DEALER", "REP"])?,
        })
    }

    /// Send one message made of `frames`.
    pub fn send(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        self.conn.send(frames)
    }

    /// The next message (its frames), or None if none arrives within `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> io::Result<Option<Message>> {
        recv_message(&mut self.conn, timeout)
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.conn.peer_addr()
    }
}
