//! ZMTP 3.x framing and the NULL-mechanism handshake (rfc 23/ZMTP, rfc 37/ZMTP 3.1): the greeting,
//! READY with its properties, frames with MORE/LONG/COMMAND flags, and a buffered connection that
//! survives read timeouts in the middle of a frame.

use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Frame flag: more frames of the same message follow.
const FLAG_MORE: u8 = 0x01;
/// Frame flag: the size is 8 bytes (big-endian) instead of 1.
const FLAG_LONG: u8 = 0x02;
/// Frame flag: the frame is a command, not message data.
const FLAG_COMMAND: u8 = 0x04;

/// Largest message a peer may send us; anything bigger is treated as hostile.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;
/// Frame buffers a connection keeps for reuse ([`Connection::recycle`]), and the largest kept.
const SPARE_FRAMES: usize = 8;
const SPARE_FRAME_BYTES: usize = 4 << 20;

/// Room a receive asks the kernel to fill at least: a busy publisher's messages arrive a few at
/// a time, one system call for all of them.
const READ_AHEAD: usize = 64 * 1024;

/// Our greeting: signature (as libzmq writes it), version 3.1, NULL mechanism.
pub fn greeting(as_server: bool) -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = as_server as u8;
    g
}

/// What the peer's greeting told us.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PeerVersion {
    pub major: u8,
    pub minor: u8,
}

/// Check a peer's 64-byte greeting: ZMTP 3.x, NULL mechanism.
pub fn parse_greeting(g: &[u8]) -> io::Result<PeerVersion> {
    if g.len() < 64 || g[0] != 0xFF || g[9] & 0x01 == 0 {
        return Err(protocol_error(
            "peer did not send a ZMTP 3 greeting (not a ZeroMQ peer, or ZMTP 1.0 from libzmq < 3)",
        ));
    }
    let (major, minor) = (g[10], g[11]);
    if major < 3 {
        return Err(protocol_error(&format!(
            "peer speaks ZMTP {major}.{minor}; only ZMTP 3.x (libzmq >= 4) is supported"
        )));
    }
    let mechanism = &g[12..32];
    let end = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..end] != b"NULL" {
        return Err(protocol_error(&format!(
            "peer asks for security mechanism {:?}; only NULL is supported",
            String::from_utf8_lossy(&mechanism[..end])
        )));
    }
    Ok(PeerVersion { major, minor })
}

pub fn protocol_error(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("zmtp: {msg}"))
}

/// Append one frame to `out`.
fn put_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// Append a whole multi-frame message to `out`. A message has at least one frame; an empty
/// slice is sent as one empty frame.
pub fn put_message(out: &mut Vec<u8>, frames: &[&[u8]]) {
    if frames.is_empty() {
        put_frame(out, 0, &[]);
        return;
    }
    let last = frames.len() - 1;
    for (i, f) in frames.iter().enumerate() {
        put_frame(out, if i < last { FLAG_MORE } else { 0 }, f);
    }
}

/// The wire bytes of one message.
pub fn encode_message(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    put_message(&mut out, frames);
    out
}

/// The wire bytes of one command frame.
pub fn encode_command(name: &str, data: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(data);
    let mut out = Vec::with_capacity(body.len() + 9);
    put_frame(&mut out, FLAG_COMMAND, &body);
    out
}

/// The READY command's metadata: Socket-Type, and Identity for the routing sockets.
fn ready_properties(socket_type: &str) -> Vec<u8> {
    let mut p = Vec::new();
    let mut prop = |name: &str, value: &[u8]| {
        p.push(name.len() as u8);
        p.extend_from_slice(name.as_bytes());
        p.extend_from_slice(&(value.len() as u32).to_be_bytes());
        p.extend_from_slice(value);
    };
    prop("Socket-Type", socket_type.as_bytes());
    if matches!(socket_type, "DEALER" | "ROUTER" | "REQ" | "REP") {
        prop("Identity", b"");
    }
    p
}

/// Parse READY metadata into (name, value) pairs.
pub fn parse_properties(mut p: &[u8]) -> io::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    while !p.is_empty() {
        let name_len = p[0] as usize;
        if p.len() < 1 + name_len + 4 {
            return Err(protocol_error("READY metadata truncated"));
        }
        let name = String::from_utf8_lossy(&p[1..1 + name_len]).into_owned();
        let v = &p[1 + name_len..];
        let value_len = u32::from_be_bytes([v[0], v[1], v[2], v[3]]) as usize;
        if v.len() < 4 + value_len {
            return Err(protocol_error("READY metadata value truncated"));
        }
        out.push((name, v[4..4 + value_len].to_vec()));
        p = &v[4 + value_len..];
    }
    Ok(out)
}

/// Something read off a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    /// A complete message (all its frames).
    Message(Vec<Vec<u8>>),
    /// A command frame: its name and the bytes after the name.
    Command { name: Vec<u8>, data: Vec<u8> },
}

/// A handshaken ZMTP connection over one TCP stream. Reads are buffered so that a timeout in the
/// middle of a frame loses nothing: the next read continues where the last one stopped.
pub struct Connection {
    stream: TcpStream,
    /// Received bytes: `rbuf[rpos..rend]` is unread, `rbuf[rend..]` room for the next receive
    /// (zeroed once, when the buffer grows, never per receive).
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    partial: Vec<Vec<u8>>,
    /// Frame buffers handed back by [`Connection::recycle`], refilled by the next messages, so
    /// a subscriber that gives each message back receives without allocating.
    spare: Vec<Vec<u8>>,
    peer: PeerVersion,
    peer_socket_type: String,
}

/// A handshake under way: the greeting sent, the peer's greeting and READY awaited. Driven by
/// [`Handshake::advance`], which reads only what has arrived when given a deadline already
/// passed, so an event loop can run many at once; [`Connection::handshake`] drives one to
/// its end, waiting.
pub struct Handshake {
    conn: Connection,
    /// The peer's greeting came and our READY went.
    greeted: bool,
    socket_type: &'static str,
    accept_peers: &'static [&'static str],
}

impl Handshake {
    /// Send the greeting on `stream` (connected; its writes may block, its reads never do).
    pub fn start(
        stream: TcpStream,
        as_server: bool,
        socket_type: &'static str,
        accept_peers: &'static [&'static str],
    ) -> io::Result<Handshake> {
        let _ = stream.set_nodelay(true);
        let mut conn = Connection {
            stream,
            rbuf: Vec::new(),
            rpos: 0,
            rend: 0,
            partial: Vec::new(),
            spare: Vec::new(),
            peer: PeerVersion { major: 0, minor: 0 },
            peer_socket_type: String::new(),
        };
        conn.stream.write_all(&greeting(as_server))?;
        Ok(Handshake {
            conn,
            greeted: false,
            socket_type,
            accept_peers,
        })
    }

    /// Take what has arrived, waiting until `deadline` at most (`None`: as long as it takes):
    /// Ok(true) once the handshake is complete, Ok(false) while it awaits the peer.
    pub fn advance(&mut self, deadline: Option<Instant>) -> io::Result<bool> {
        let conn = &mut self.conn;
        if !self.greeted {
            if !conn.fill_to(64, deadline)? {
                return Ok(false);
            }
            conn.peer = parse_greeting(&conn.rbuf[conn.rpos..conn.rpos + 64])?;
            conn.rpos += 64;
            let ready = encode_command("READY", &ready_properties(self.socket_type));
            conn.stream.write_all(&ready)?;
            self.greeted = true;
        }
        // The peer's first frame must be its READY command: a message frame (even one whose
        // MORE flag promises further frames) is refused at once, not read to its end.
        if !conn.fill_to(1, deadline)? {
            return Ok(false);
        }
        if conn.rbuf[conn.rpos] & FLAG_COMMAND == 0 {
            return Err(protocol_error("peer sent a message before READY"));
        }
        let (name, data) = match conn.read_incoming(deadline)? {
            Some(Incoming::Command { name, data }) => (name, data),
            Some(Incoming::Message(_)) => {
                return Err(protocol_error("peer sent a message before READY"))
            }
            None => return Ok(false),
        };
        if name == b"ERROR" {
            let reason = data.get(1..).unwrap_or(&[]);
            return Err(protocol_error(&format!(
                "peer refused the handshake: {}",
                String::from_utf8_lossy(reason)
            )));
        }
        if name != b"READY" {
            return Err(protocol_error(&format!(
                "expected READY, peer sent command {:?}",
                String::from_utf8_lossy(&name)
            )));
        }
        let props = parse_properties(&data)?;
        let peer_type = props
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("Socket-Type"))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .ok_or_else(|| protocol_error("READY without Socket-Type"))?;
        if !self.accept_peers.contains(&peer_type.as_str()) {
            let err = format!(
                "a {} socket cannot talk to a {peer_type} peer",
                self.socket_type
            );
            let reason = &err.as_bytes()[..err.len().min(255)];
            let mut data = vec![reason.len() as u8];
            data.extend_from_slice(reason);
            let _ = conn.send_command("ERROR", &data);
            return Err(protocol_error(&err));
        }
        conn.peer_socket_type = peer_type;
        Ok(true)
    }

    /// The connection, once `advance` said the handshake is complete.
    pub fn finish(self) -> Connection {
        debug_assert!(!self.conn.peer_socket_type.is_empty());
        self.conn
    }

    /// The socket's descriptor, to wait for it in an event loop.
    pub fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.conn.stream.as_raw_fd()
    }
}

impl Connection {
    /// Greet, exchange READY and check that the peer's socket type is one of `accept_peers`.
    /// The handshake must finish within `timeout`.
    pub fn handshake(
        stream: TcpStream,
        as_server: bool,
        socket_type: &'static str,
        accept_peers: &'static [&'static str],
        timeout: Duration,
    ) -> io::Result<Connection> {
        let deadline = Instant::now() + timeout;
        let mut hs = Handshake::start(stream, as_server, socket_type, accept_peers)?;
        loop {
            if hs.advance(Some(deadline))? {
                return Ok(hs.conn);
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    match hs.greeted {
                        false => "zmtp: no greeting from peer in time",
                        true => "zmtp: no READY from peer in time",
                    },
                ));
            }
        }
    }

    /// The socket's descriptor, to wait for it in an event loop.
    pub fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.stream.as_raw_fd()
    }

    pub fn peer_version(&self) -> PeerVersion {
        self.peer
    }

    pub fn peer_socket_type(&self) -> &str {
        &self.peer_socket_type
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.stream.peer_addr()
    }

    /// A second handle on the same socket (for a writer thread, or to shut it down).
    pub fn try_clone_stream(&self) -> io::Result<TcpStream> {
        self.stream.try_clone()
    }

    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    pub fn write_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    pub fn send(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        self.stream.write_all(&encode_message(frames))
    }

    pub fn send_command(&mut self, name: &str, data: &[u8]) -> io::Result<()> {
        self.stream.write_all(&encode_command(name, data))
    }

    /// Answer a PING with the PONG it asks for (rfc 37: PING is a 2-byte TTL then context).
    pub fn answer_ping(&mut self, ping_data: &[u8]) -> io::Result<()> {
        let context = ping_data.get(2..).unwrap_or(&[]);
        self.send_command("PONG", context)
    }

    /// Read until `n` unread bytes are buffered. Ok(false) on timeout.
    ///
    /// A receive that finds data costs one system call: the socket stays blocking for writers,
    /// reads take what is there (`MSG_DONTWAIT`) and only an empty socket waits, in `poll`
    /// until `deadline`.
    fn fill_to(&mut self, n: usize, deadline: Option<Instant>) -> io::Result<bool> {
        while self.rend - self.rpos < n {
            // Room for `n`, but at most twice what has arrived: a frame's announced size (up
            // to MAX_MESSAGE_BYTES) is no reason to allocate it before its bytes come.
            let want = n.min((self.rend - self.rpos) * 2).max(READ_AHEAD);
            if self.rbuf.len() - self.rpos < want {
                self.rbuf.copy_within(self.rpos..self.rend, 0);
                self.rend -= self.rpos;
                self.rpos = 0;
                if self.rbuf.len() < want {
                    self.rbuf.resize(want, 0);
                }
            }
            let room = &mut self.rbuf[self.rend..];
            // Safety: `room` is valid for writes of `room.len()` bytes for the whole call.
            let got = unsafe {
                libc::recv(
                    self.stream.as_raw_fd(),
                    room.as_mut_ptr().cast(),
                    room.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if got > 0 {
                self.rend += got as usize;
                continue;
            }
            if got == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "zmtp: peer closed the connection",
                ));
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => {
                    if !self.wait_readable(deadline)? {
                        return Ok(false);
                    }
                }
                _ => return Err(e),
            }
        }
        Ok(true)
    }

    /// Wait until the socket has something to read (data, EOF or an error) or `deadline`
    /// passes (Ok(false)). `None` waits as long as it takes.
    fn wait_readable(&self, deadline: Option<Instant>) -> io::Result<bool> {
        loop {
            let timeout_ms = match deadline {
                None => -1,
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(false);
                    }
                    // Rounded up: waking a little late beats spinning on a 0 ms poll.
                    let us = (d - now).as_micros();
                    us.div_ceil(1000).min(i32::MAX as u128) as i32
                }
            };
            let mut pfd = libc::pollfd {
                fd: self.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // Safety: one valid pollfd for the duration of the call.
            let r = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
            if r > 0 {
                return Ok(true);
            }
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }

    /// Give a message returned by [`Connection::read_incoming`] back: its frame buffers (and
    /// the list holding them) are reused for the next messages. Only a few, of bounded size,
    /// are kept.
    pub fn recycle(&mut self, mut message: Vec<Vec<u8>>) {
        // Last frame first: the next message takes them back in frame order, so each frame
        // (topic, sequence number, payload) finds the buffer a frame of its kind had.
        for frame in message.drain(..).rev() {
            self.keep_spare(frame);
        }
        if self.partial.capacity() == 0 {
            self.partial = message;
        }
    }

    fn keep_spare(&mut self, frame: Vec<u8>) {
        if self.spare.len() < SPARE_FRAMES && frame.capacity() <= SPARE_FRAME_BYTES {
            self.spare.push(frame);
        }
    }

    /// Read the next whole message or command. Ok(None) when `deadline` passes first; whatever
    /// part of a frame had arrived stays buffered for the next call. `None` deadline blocks.
    pub fn read_incoming(&mut self, deadline: Option<Instant>) -> io::Result<Option<Incoming>> {
        loop {
            if !self.fill_to(2, deadline)? {
                return Ok(None);
            }
            let flags = self.rbuf[self.rpos];
            if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
                return Err(protocol_error(&format!("bad frame flags {flags:#04x}")));
            }
            let (header, size) = if flags & FLAG_LONG != 0 {
                if !self.fill_to(9, deadline)? {
                    return Ok(None);
                }
                let mut b = [0u8; 8];
                b.copy_from_slice(&self.rbuf[self.rpos + 1..self.rpos + 9]);
                (9, u64::from_be_bytes(b))
            } else {
                (2, self.rbuf[self.rpos + 1] as u64)
            };
            let pending: usize = self.partial.iter().map(|f| f.len()).sum();
            if size > (MAX_MESSAGE_BYTES - pending) as u64 {
                return Err(protocol_error(&format!(
                    "frame of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte message limit"
                )));
            }
            let size = size as usize;
            if !self.fill_to(header + size, deadline)? {
                return Ok(None);
            }
            let mut body = self.spare.pop().unwrap_or_default();
            body.clear();
            body.extend_from_slice(&self.rbuf[self.rpos + header..self.rpos + header + size]);
            debug_assert!(self.rpos + header + size <= self.rend);
            self.rpos += header + size;
            if flags & FLAG_COMMAND != 0 {
                if flags & FLAG_MORE != 0 {
                    return Err(protocol_error("command frame with the MORE flag"));
                }
                let name_len = *body
                    .first()
                    .ok_or_else(|| protocol_error("empty command frame"))?
                    as usize;
                if body.len() < 1 + name_len {
                    return Err(protocol_error("command name truncated"));
                }
                let command = Incoming::Command {
                    name: body[1..1 + name_len].to_vec(),
                    data: body[1 + name_len..].to_vec(),
                };
                self.keep_spare(body);
                return Ok(Some(command));
            }
            self.partial.push(body);
            if flags & FLAG_MORE == 0 {
                return Ok(Some(Incoming::Message(std::mem::take(&mut self.partial))));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_round_trip() {
        let g = greeting(true);
        assert_eq!(
            parse_greeting(&g).unwrap(),
            PeerVersion { major: 3, minor: 1 }
        );
        let mut old = g;
        old[10] = 2;
        assert!(parse_greeting(&old).is_err());
        let mut plain = g;
        plain[12..17].copy_from_slice(b"PLAIN");
        let err = parse_greeting(&plain).unwrap_err().to_string();
        assert!(err.contains("PLAIN"), "{err}");
        assert!(parse_greeting(&[0u8; 64]).is_err());
    }

    /// A handshaken SUB connection and its PUB peer's end of the socket (the peer's greeting
    /// and READY sent, kvlb's read back).
    fn sub_and_peer() -> (Connection, TcpStream) {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        let mut props = vec![11];
        props.extend_from_slice(b"Socket-Type");
        props.extend_from_slice(&3u32.to_be_bytes());
        props.extend_from_slice(b"PUB");
        peer.write_all(&greeting(true)).unwrap();
        peer.write_all(&encode_command("READY", &props)).unwrap();
        let t = Duration::from_secs(5);
        let conn = Connection::handshake(ours, false, "SUB", &["PUB"], t).unwrap();
        let mut theirs = [0u8; 64];
        peer.read_exact(&mut theirs).unwrap();
        (conn, peer)
    }

    /// Fuzz finding (fuzz/regressions/zmtp/): a frame header announcing 200 MiB made the
    /// reader allocate and zero 200 MiB on receiving those 9 bytes (and keep it for the
    /// connection's life). The buffer now grows with what arrives; a large frame still reads
    /// whole when it comes in pieces.
    #[test]
    fn announced_frame_size_is_not_allocated_up_front() {
        let soon = || Some(Instant::now() + Duration::from_millis(20));
        let (mut conn, mut peer) = sub_and_peer();
        peer.write_all(&[FLAG_LONG]).unwrap();
        peer.write_all(&(200u64 << 20).to_be_bytes()).unwrap();
        assert_eq!(conn.read_incoming(soon()).unwrap(), None);
        assert!(
            conn.rbuf.len() <= READ_AHEAD,
            "{} bytes held",
            conn.rbuf.len()
        );

        let (mut conn, mut peer) = sub_and_peer();
        let body: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        let wire = encode_message(&[&body]);
        let mut sent = 0;
        for piece in wire.chunks(64 << 10) {
            assert_eq!(conn.read_incoming(soon()).unwrap(), None);
            assert!(
                conn.rbuf.len() <= 2 * sent + READ_AHEAD,
                "{}",
                conn.rbuf.len()
            );
            peer.write_all(piece).unwrap();
            sent += piece.len();
        }
        let deadline = Some(Instant::now() + Duration::from_secs(5));
        assert_eq!(
            conn.read_incoming(deadline).unwrap(),
            Some(Incoming::Message(vec![body]))
        );
    }

    /// A handshake driven without waiting: nothing happens until the peer's bytes arrive, a
    /// greeting and READY that come a few bytes at a time complete it, and the connection
    /// then reads messages.
    #[test]
    fn a_handshake_advances_with_what_has_arrived() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        let now = || Some(Instant::now());
        let mut hs = Handshake::start(ours, false, "SUB", &["PUB"]).unwrap();
        assert!(!hs.advance(now()).unwrap());
        let mut props = vec![11];
        props.extend_from_slice(b"Socket-Type");
        props.extend_from_slice(&3u32.to_be_bytes());
        props.extend_from_slice(b"PUB");
        let mut wire = greeting(true).to_vec();
        wire.extend_from_slice(&encode_command("READY", &props));
        wire.extend_from_slice(&encode_message(&[b"topic", b"payload"]));
        let until_done = wire.len() - encode_message(&[b"topic", b"payload"]).len();
        let mut done = false;
        for (i, piece) in wire[..until_done].chunks(7).enumerate() {
            assert!(!done, "complete before the READY's last bytes (piece {i})");
            peer.write_all(piece).unwrap();
            let t = Instant::now() + Duration::from_secs(5);
            // What was just written has arrived once the socket is readable.
            assert!(hs.conn.wait_readable(Some(t)).unwrap());
            done = hs.advance(now()).unwrap();
        }
        assert!(done);
        let mut theirs = [0u8; 64];
        peer.read_exact(&mut theirs).unwrap();
        peer.write_all(&wire[until_done..]).unwrap();
        let mut conn = hs.finish();
        assert_eq!(conn.peer_socket_type(), "PUB");
        let deadline = Some(Instant::now() + Duration::from_secs(5));
        assert_eq!(
            conn.read_incoming(deadline).unwrap(),
            Some(Incoming::Message(vec![
                b"topic".to_vec(),
                b"payload".to_vec()
            ]))
        );
    }

    #[test]
    fn frames_short_and_long() {
        let big = vec![7u8; 300];
        let bytes = encode_message(&[b"topic", &big, b""]);
        assert_eq!(&bytes[..7], &[FLAG_MORE, 5, b't', b'o', b'p', b'i', b'c']);
        assert_eq!(bytes[7], FLAG_MORE | FLAG_LONG);
        assert_eq!(&bytes[8..16], &300u64.to_be_bytes());
        assert_eq!(&bytes[bytes.len() - 2..], &[0, 0]);
    }

    #[test]
    fn ready_properties_parse() {
        let props = parse_properties(&ready_properties("DEALER")).unwrap();
        assert_eq!(props[0], ("Socket-Type".to_string(), b"DEALER".to_vec()));
        assert_eq!(props[1], ("Identity".to_string(), Vec::new()));
        assert!(parse_properties(&[11, b'S']).is_err());
        assert!(parse_properties(&[1, b'a', 0, 0, 0, 9, 1]).is_err());
    }
}
