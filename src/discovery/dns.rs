//! A minimal DNS stub client: just enough to find replicas behind a name (A, AAAA, SRV).
//!
//! Two layers:
//! * the codec (pure, no I/O): [`build_query`] and [`parse_response`] turn names into query
//!   packets and response packets into [`Message`]s; [`follow`] walks CNAME chains inside one
//!   response; [`parse_resolv_conf`] reads `nameserver` lines. Every length, count and
//!   compression pointer in a response is checked: a hostile or broken packet gives a
//!   [`DnsError`], never a panic.
//! * the exchange ([`Client`]): one UDP query per try, a socket connected to the server (so
//!   only its datagrams arrive) from a kernel-chosen source port, a random 16-bit id; stray
//!   datagrams with the wrong id or question are ignored until the try's timeout. A truncated
//!   answer (TC bit) is asked again over TCP. SERVFAIL, REFUSED, timeouts and socket errors move
//!   on to the next server; `attempts` rounds go over all servers.
//!
//! No EDNS: answers over UDP are at most 512 bytes, larger ones come back truncated and go
//! over TCP. No cache: callers re-resolve on their own interval.

use crate::select::Rng;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

pub const TYPE_A: u16 = 1;
pub const TYPE_CNAME: u16 = 5;
pub const TYPE_AAAA: u16 = 28;
pub const TYPE_SRV: u16 = 33;
const TYPE_OPT: u16 = 41;
const CLASS_IN: u16 = 1;

pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_REFUSED: u8 = 5;

const HEADER_LEN: usize = 12;
/// A name on the wire is at most 255 bytes (RFC 1035 3.1).
const MAX_NAME_WIRE: usize = 255;
/// Compression pointers followed within one name at most.
const MAX_POINTER_JUMPS: usize = 32;
/// CNAME links followed within one response at most.
pub const MAX_CNAME_CHAIN: usize = 16;
/// Size of a resource record without its name and rdata: type, class, ttl, rdlength.
const RR_FIXED: usize = 10;

/// What went wrong in a DNS exchange or in a packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsError {
    /// A name we were asked to look up is not a valid DNS name.
    BadName(String, &'static str),
    /// The response packet is broken: what, and at which byte offset.
    Malformed(&'static str, usize),
    /// The response's id is not the query's (a stray or spoofed datagram).
    IdMismatch { expected: u16, got: u16 },
    /// The response answers another question than ours.
    QuestionMismatch,
    /// The packet is a query, or has an opcode other than QUERY.
    NotResponse,
    /// The server answered with an error code (SERVFAIL, REFUSED, ...).
    Rcode { server: SocketAddr, rcode: u8 },
    /// No answer within the timeout.
    Timeout(SocketAddr),
    /// A socket error talking to a server.
    Io(SocketAddr, String),
    /// A CNAME chain longer than [`MAX_CNAME_CHAIN`] or looping.
    CnameChain(String),
    /// No resolver address to ask.
    NoServers,
    /// An SRV answer names more distinct targets than the limit given.
    TooManyTargets(usize),
}

impl fmt::Display for DnsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DnsError::BadName(n, why) => write!(f, "invalid DNS name {n:?}: {why}"),
            DnsError::Malformed(what, at) => {
                write!(f, "malformed DNS response: {what} (at byte {at})")
            }
            DnsError::IdMismatch { expected, got } => {
                write!(
                    f,
                    "DNS response id {got} does not match query id {expected}"
                )
            }
            DnsError::QuestionMismatch => f.write_str("DNS response answers another question"),
            DnsError::NotResponse => f.write_str("DNS packet is not a standard query response"),
            DnsError::Rcode { server, rcode } => {
                write!(f, "DNS server {server} answered {}", rcode_name(*rcode))
            }
            DnsError::Timeout(s) => write!(f, "DNS server {s} did not answer in time"),
            DnsError::Io(s, e) => write!(f, "DNS server {s}: {e}"),
            DnsError::CnameChain(n) => write!(f, "CNAME chain from {n:?} is too long or loops"),
            DnsError::TooManyTargets(n) => write!(f, "SRV answer names more than {n} targets"),
            DnsError::NoServers => f.write_str(
                "no DNS server to ask (set dns_servers or a nameserver line in /etc/resolv.conf)",
            ),
        }
    }
}

impl std::error::Error for DnsError {}

pub fn rcode_name(rcode: u8) -> String {
    match rcode {
        RCODE_NOERROR => "NOERROR".into(),
        1 => "FORMERR".into(),
        RCODE_SERVFAIL => "SERVFAIL".into(),
        RCODE_NXDOMAIN => "NXDOMAIN".into(),
        4 => "NOTIMP".into(),
        RCODE_REFUSED => "REFUSED".into(),
        n => format!("RCODE {n}"),
    }
}

/// The data of one resource record (the types kvlb uses; others are kept by type only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RData {
    A(Ipv4Addr),
    Aaaa(Ipv6Addr),
    Cname(String),
    Srv {
        priority: u16,
        weight: u16,
        port: u16,
        target: String,
    },
    Other(u16),
}

impl RData {
    pub fn rtype(&self) -> u16 {
        match self {
            RData::A(_) => TYPE_A,
            RData::Aaaa(_) => TYPE_AAAA,
            RData::Cname(_) => TYPE_CNAME,
            RData::Srv { .. } => TYPE_SRV,
            RData::Other(t) => *t,
        }
    }
}

/// One class-IN resource record. Names are lower case without the trailing dot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub name: String,
    pub ttl: u32,
    pub data: RData,
}

/// A parsed response. When `truncated`, the record sections are left empty: the answer must be
/// asked again over TCP.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    pub rcode: u8,
    pub truncated: bool,
    pub answers: Vec<Record>,
    pub additionals: Vec<Record>,
}

/// Lower-cases `name`, drops one trailing dot and checks it is a host-like DNS name:
/// labels of 1..=63 letters, digits, `-` or `_`, at most 253 characters.
pub fn normalize_name(name: &str) -> Result<String, DnsError> {
    let bad = |why| DnsError::BadName(name.to_string(), why);
    let n = name.strip_suffix('.').unwrap_or(name);
    if n.is_empty() {
        return Err(bad("empty name"));
    }
    if n.len() > 253 {
        return Err(bad("longer than 253 characters"));
    }
    for label in n.split('.') {
        if label.is_empty() {
            return Err(bad("empty label (two dots in a row?)"));
        }
        if label.len() > 63 {
            return Err(bad("a label is longer than 63 characters"));
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(bad("only letters, digits, '-', '_' and '.' are allowed"));
        }
    }
    Ok(n.to_ascii_lowercase())
}

/// A standard query (RD set) for `name`/`qtype`, class IN, with the given id.
pub fn build_query(id: u16, name: &str, qtype: u16) -> Result<Vec<u8>, DnsError> {
    let name = normalize_name(name)?;
    let mut q = Vec::with_capacity(HEADER_LEN + name.len() + 6);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&0x0100u16.to_be_bytes()); // RD
    q.extend_from_slice(&1u16.to_be_bytes()); // QDCOUNT
    q.extend_from_slice(&[0; 6]); // AN, NS, AR
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&CLASS_IN.to_be_bytes());
    Ok(q)
}

fn be16(p: &[u8], at: usize) -> Result<u16, DnsError> {
    match p.get(at..at + 2) {
        Some(b) => Ok(u16::from_be_bytes([b[0], b[1]])),
        None => Err(DnsError::Malformed("packet ends inside a 16-bit field", at)),
    }
}

fn be32(p: &[u8], at: usize) -> Result<u32, DnsError> {
    match p.get(at..at + 4) {
        Some(b) => Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]])),
        None => Err(DnsError::Malformed("packet ends inside a 32-bit field", at)),
    }
}

/// Reads the (possibly compressed) name at `start`. Returns it lower-cased without trailing
/// dot ("" for the root) and the offset just after the name's bytes at `start`.
///
/// Loop protection: a pointer must point strictly before itself, at most
/// [`MAX_POINTER_JUMPS`] pointers are followed, and the expanded name is at most 255 bytes.
pub fn read_name(p: &[u8], start: usize) -> Result<(String, usize), DnsError> {
    let mut name = String::new();
    let mut pos = start;
    let mut end = None;
    let mut jumps = 0;
    let mut wire_len = 1;
    loop {
        let len =
            *p.get(pos)
                .ok_or(DnsError::Malformed("packet ends inside a name", pos))? as usize;
        match len & 0xC0 {
            0x00 if len == 0 => {
                return Ok((name, end.unwrap_or(pos + 1)));
            }
            0x00 => {
                wire_len += len + 1;
                if wire_len > MAX_NAME_WIRE {
                    return Err(DnsError::Malformed("name longer than 255 bytes", pos));
                }
                let label = p
                    .get(pos + 1..pos + 1 + len)
                    .ok_or(DnsError::Malformed("packet ends inside a label", pos))?;
                if !label.iter().all(|b| b.is_ascii_graphic() && *b != b'.') {
                    return Err(DnsError::Malformed(
                        "label with a dot or a non-printable byte",
                        pos,
                    ));
                }
                if !name.is_empty() {
                    name.push('.');
                }
                for b in label {
                    name.push(b.to_ascii_lowercase() as char);
                }
                pos += 1 + len;
            }
            0xC0 => {
                let low = *p
                    .get(pos + 1)
                    .ok_or(DnsError::Malformed("packet ends inside a pointer", pos))?;
                let target = ((len & 0x3F) << 8) | low as usize;
                if target >= pos {
                    return Err(DnsError::Malformed(
                        "compression pointer does not point backwards",
                        pos,
                    ));
                }
                jumps += 1;
                if jumps > MAX_POINTER_JUMPS {
                    return Err(DnsError::Malformed("too many compression pointers", pos));
                }
                if end.is_none() {
                    end = Some(pos + 2);
                }
                pos = target;
            }
            _ => return Err(DnsError::Malformed("unsupported label type", pos)),
        }
    }
}

/// Parses one resource record at `at`; returns it (None when its class is not IN or it is an
/// EDNS OPT record) and the offset after it.
fn read_record(p: &[u8], at: usize) -> Result<(Option<Record>, usize), DnsError> {
    let (name, pos) = read_name(p, at)?;
    let rtype = be16(p, pos)?;
    let class = be16(p, pos + 2)?;
    let ttl = be32(p, pos + 4)?;
    let rdlen = be16(p, pos + 8)? as usize;
    let rd = pos + RR_FIXED;
    let end = rd + rdlen;
    let rdata = p
        .get(rd..end)
        .ok_or(DnsError::Malformed("record data runs past the packet", rd))?;
    if class != CLASS_IN || rtype == TYPE_OPT {
        return Ok((None, end));
    }
    let data = match rtype {
        TYPE_A => match <[u8; 4]>::try_from(rdata) {
            Ok(b) => RData::A(Ipv4Addr::from(b)),
            Err(_) => return Err(DnsError::Malformed("A record data is not 4 bytes", rd)),
        },
        TYPE_AAAA => match <[u8; 16]>::try_from(rdata) {
            Ok(b) => RData::Aaaa(Ipv6Addr::from(b)),
            Err(_) => return Err(DnsError::Malformed("AAAA record data is not 16 bytes", rd)),
        },
        TYPE_CNAME => {
            let (target, after) = read_name(p, rd)?;
            if after != end {
                return Err(DnsError::Malformed(
                    "CNAME name does not fill its record",
                    rd,
                ));
            }
            RData::Cname(target)
        }
        TYPE_SRV => {
            if rdlen < 7 {
                return Err(DnsError::Malformed("SRV record data too short", rd));
            }
            let (target, after) = read_name(p, rd + 6)?;
            if after != end {
                return Err(DnsError::Malformed(
                    "SRV target does not fill its record",
                    rd,
                ));
            }
            RData::Srv {
                priority: be16(p, rd)?,
                weight: be16(p, rd + 2)?,
                port: be16(p, rd + 4)?,
                target,
            }
        }
        t => RData::Other(t),
    };
    Ok((Some(Record { name, ttl, data }), end))
}

/// Parses a response to the query `id`/`qname`/`qtype` (qname as given to [`build_query`]).
/// Checks id, QR, opcode and that the single question is ours; an error rcode is returned in
/// the message, not as an error (the caller decides: NXDOMAIN is an answer, SERVFAIL is not).
pub fn parse_response(p: &[u8], id: u16, qname: &str, qtype: u16) -> Result<Message, DnsError> {
    if p.len() < HEADER_LEN {
        return Err(DnsError::Malformed("shorter than a DNS header", p.len()));
    }
    let got = be16(p, 0)?;
    if got != id {
        return Err(DnsError::IdMismatch { expected: id, got });
    }
    let flags = be16(p, 2)?;
    if flags & 0x8000 == 0 || (flags >> 11) & 0xF != 0 {
        return Err(DnsError::NotResponse);
    }
    let truncated = flags & 0x0200 != 0;
    let rcode = (flags & 0xF) as u8;
    let qd = be16(p, 4)?;
    let an = be16(p, 6)? as usize;
    let ns = be16(p, 8)? as usize;
    let ar = be16(p, 10)? as usize;
    if qd != 1 {
        return Err(DnsError::QuestionMismatch);
    }
    let (name, pos) = read_name(p, HEADER_LEN)?;
    let want = normalize_name(qname)?;
    if name != want || be16(p, pos)? != qtype || be16(p, pos + 2)? != CLASS_IN {
        return Err(DnsError::QuestionMismatch);
    }
    let mut msg = Message {
        rcode,
        truncated,
        ..Message::default()
    };
    if truncated {
        return Ok(msg);
    }
    let mut pos = pos + 4;
    // Every record takes at least 11 bytes: refuse counts the packet cannot hold before
    // looping over them.
    if (an + ns + ar) * (1 + RR_FIXED) > p.len() - pos {
        return Err(DnsError::Malformed("record counts exceed the packet", pos));
    }
    for i in 0..an + ns + ar {
        let (rec, next) = read_record(p, pos)?;
        pos = next;
        if let Some(rec) = rec {
            if i < an {
                msg.answers.push(rec);
            } else if i >= an + ns {
                msg.additionals.push(rec);
            }
        }
    }
    Ok(msg)
}

/// The records of type `rtype` for `name` among `records`, following CNAMEs from `name`.
/// A chain that ends in no data gives an empty list; a loop or a chain longer than
/// [`MAX_CNAME_CHAIN`] gives an error.
pub fn follow<'a>(
    records: &'a [Record],
    name: &str,
    rtype: u16,
) -> Result<Vec<&'a Record>, DnsError> {
    let mut current = name.to_string();
    for _ in 0..=MAX_CNAME_CHAIN {
        let hits: Vec<&Record> = records
            .iter()
            .filter(|r| r.name == current && r.data.rtype() == rtype)
            .collect();
        if !hits.is_empty() {
            return Ok(hits);
        }
        match records.iter().find_map(|r| match &r.data {
            RData::Cname(t) if r.name == current => Some(t),
            _ => None,
        }) {
            Some(next) => current = next.clone(),
            None => return Ok(Vec::new()),
        }
    }
    Err(DnsError::CnameChain(name.to_string()))
}

/// The IP addresses (A and AAAA records) of `name` in `records`, following CNAMEs.
pub fn addresses(records: &[Record], name: &str) -> Result<Vec<IpAddr>, DnsError> {
    let mut out = Vec::new();
    for rtype in [TYPE_A, TYPE_AAAA] {
        for r in follow(records, name, rtype)? {
            match r.data {
                RData::A(a) => out.push(IpAddr::V4(a)),
                RData::Aaaa(a) => out.push(IpAddr::V6(a)),
                _ => {}
            }
        }
    }
    Ok(out)
}

/// The `nameserver` addresses of a resolv.conf text, port 53. Lines with a name that is not
/// an IP address (or a non-numeric IPv6 zone) are skipped.
pub fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split(['#', ';']).next().unwrap_or("");
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        let Some(addr) = words.next() else { continue };
        let (ip, zone) = match addr.split_once('%') {
            Some((ip, zone)) => (ip, zone.parse::<u32>().ok()),
            None => (addr, Some(0)),
        };
        match (ip.parse::<IpAddr>(), zone) {
            (Ok(IpAddr::V6(v6)), Some(scope)) => out.push(SocketAddr::V6(
                std::net::SocketAddrV6::new(v6, 53, 0, scope),
            )),
            (Ok(IpAddr::V4(v4)), Some(0)) => out.push(SocketAddr::new(IpAddr::V4(v4), 53)),
            _ => {}
        }
    }
    out
}

/// A seed from the kernel's random source (falls back to the clock if that fails).
pub fn random_seed() -> u64 {
    let mut buf = [0u8; 8];
    // Safety: buf is a valid, writable 8-byte buffer for the duration of the call.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n == 8 {
        u64::from_ne_bytes(buf)
    } else {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        t.as_nanos() as u64 ^ u64::from(std::process::id()) << 32
    }
}

/// A stub client over a list of recursive resolvers (or an authoritative server).
pub struct Client {
    servers: Vec<SocketAddr>,
    /// Time allowed to one try at one server.
    timeout: Duration,
    /// Rounds over all servers.
    attempts: u32,
    rng: Rng,
}

impl Client {
    /// `timeout` bounds one try at one server; `attempts` rounds go over all servers, so a
    /// query fails after at most `attempts * servers.len() * timeout` (twice that for a
    /// truncated answer's TCP retry).
    pub fn new(servers: Vec<SocketAddr>, timeout: Duration, attempts: u32, seed: u64) -> Client {
        Client {
            servers,
            timeout,
            attempts: attempts.max(1),
            rng: Rng::new(seed),
        }
    }

    /// Asks `name`/`qtype` until a server gives an answer. NOERROR and NXDOMAIN are answers
    /// (check `rcode`); SERVFAIL, REFUSED, other codes, timeouts and socket errors try the
    /// next server. Returns the last error when none answered.
    pub fn query(&mut self, name: &str, qtype: u16) -> Result<Message, DnsError> {
        normalize_name(name)?;
        let mut last = DnsError::NoServers;
        for _ in 0..self.attempts {
            for i in 0..self.servers.len() {
                let server = self.servers[i];
                let id = self.rng.next_u64() as u16;
                match self.exchange(server, id, name, qtype) {
                    Ok(m) if m.rcode == RCODE_NOERROR || m.rcode == RCODE_NXDOMAIN => return Ok(m),
                    Ok(m) => {
                        last = DnsError::Rcode {
                            server,
                            rcode: m.rcode,
                        }
                    }
                    Err(e @ DnsError::BadName(..)) => return Err(e),
                    Err(e) => last = e,
                }
            }
        }
        Err(last)
    }

    fn exchange(
        &self,
        server: SocketAddr,
        id: u16,
        name: &str,
        qtype: u16,
    ) -> Result<Message, DnsError> {
        let query = build_query(id, name, qtype)?;
        let m = udp_exchange(server, &query, id, name, qtype, self.timeout)?;
        if m.truncated {
            return tcp_exchange(server, &query, id, name, qtype, self.timeout);
        }
        Ok(m)
    }
}

fn io_err(server: SocketAddr, e: io::Error) -> DnsError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => DnsError::Timeout(server),
        _ => DnsError::Io(server, e.to_string()),
    }
}

/// One UDP try: datagrams that are not a response to this query (wrong id, other question,
/// unparsable) are dropped and the wait goes on until the deadline.
fn udp_exchange(
    server: SocketAddr,
    query: &[u8],
    id: u16,
    name: &str,
    qtype: u16,
    timeout: Duration,
) -> Result<Message, DnsError> {
    let local: SocketAddr = match server {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let sock = UdpSocket::bind(local).map_err(|e| io_err(server, e))?;
    sock.connect(server).map_err(|e| io_err(server, e))?;
    sock.send(query).map_err(|e| io_err(server, e))?;
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 2048];
    let mut last = DnsError::Timeout(server);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(last);
        }
        sock.set_read_timeout(Some(left))
            .map_err(|e| io_err(server, e))?;
        let n = match sock.recv(&mut buf) {
            Ok(n) => n,
            Err(e) => {
                let e = io_err(server, e);
                return Err(if e == DnsError::Timeout(server) {
                    last
                } else {
                    e
                });
            }
        };
        match parse_response(&buf[..n], id, name, qtype) {
            Ok(m) => return Ok(m),
            // Remember why the last datagram was refused: reported if nothing better arrives.
            Err(e) => last = e,
        }
    }
}

/// One TCP try (after a truncated UDP answer): 2-byte length prefix each way.
fn tcp_exchange(
    server: SocketAddr,
    query: &[u8],
    id: u16,
    name: &str,
    qtype: u16,
    timeout: Duration,
) -> Result<Message, DnsError> {
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&server, timeout).map_err(|e| io_err(server, e))?;
    let left = || {
        let d = deadline.saturating_duration_since(Instant::now());
        Some(d.max(Duration::from_millis(1)))
    };
    s.set_write_timeout(left()).map_err(|e| io_err(server, e))?;
    let mut framed = Vec::with_capacity(query.len() + 2);
    framed.extend_from_slice(&(query.len() as u16).to_be_bytes());
    framed.extend_from_slice(query);
    s.write_all(&framed).map_err(|e| io_err(server, e))?;
    s.set_read_timeout(left()).map_err(|e| io_err(server, e))?;
    let mut len = [0u8; 2];
    s.read_exact(&mut len).map_err(|e| io_err(server, e))?;
    let mut body = vec![0u8; u16::from_be_bytes(len) as usize];
    s.set_read_timeout(left()).map_err(|e| io_err(server, e))?;
    s.read_exact(&mut body).map_err(|e| io_err(server, e))?;
    let m = parse_response(&body, id, name, qtype)?;
    if m.truncated {
        return Err(DnsError::Malformed("truncated answer over TCP", 2));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response header + question for `name`/`qtype` with id 0x1234, then `rest` (records).
    fn response(flags: u16, counts: [u16; 3], name: &str, qtype: u16, rest: &[u8]) -> Vec<u8> {
        let mut p = build_query(0x1234, name, qtype).unwrap();
        p[2..4].copy_from_slice(&flags.to_be_bytes());
        p[6..8].copy_from_slice(&counts[0].to_be_bytes());
        p[8..10].copy_from_slice(&counts[1].to_be_bytes());
        p[10..12].copy_from_slice(&counts[2].to_be_bytes());
        p.extend_from_slice(rest);
        p
    }

    /// A record owned by the question name (pointer to offset 12).
    fn rr(rtype: u16, ttl: u32, rdata: &[u8]) -> Vec<u8> {
        let mut r = vec![0xC0, 12];
        r.extend_from_slice(&rtype.to_be_bytes());
        r.extend_from_slice(&CLASS_IN.to_be_bytes());
        r.extend_from_slice(&ttl.to_be_bytes());
        r.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
        r.extend_from_slice(rdata);
        r
    }

    fn wire_name(n: &str) -> Vec<u8> {
        let mut out = Vec::new();
        for l in n.split('.') {
            out.push(l.len() as u8);
            out.extend_from_slice(l.as_bytes());
        }
        out.push(0);
        out
    }

    #[test]
    fn query_has_id_rd_and_question() {
        let q = build_query(0xBEEF, "Vllm.Default.svc.", TYPE_SRV).unwrap();
        assert_eq!(&q[..4], &[0xBE, 0xEF, 0x01, 0x00]);
        assert_eq!(&q[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&q[12..30], b"\x04vllm\x07default\x03svc\x00");
        assert_eq!(&q[30..], &[0, 33, 0, 1]);
    }

    #[test]
    fn bad_names_are_refused() {
        for n in [
            "",
            ".",
            "a..b",
            "a b",
            &"x".repeat(64),
            &"a.".repeat(130),
            "é.com",
        ] {
            assert!(
                matches!(build_query(1, n, TYPE_A), Err(DnsError::BadName(..))),
                "{n:?}"
            );
        }
    }

    #[test]
    fn parses_a_aaaa_with_compression() {
        let mut rest = rr(TYPE_A, 30, &[127, 0, 0, 2]);
        rest.extend(rr(TYPE_AAAA, 10, &Ipv6Addr::LOCALHOST.octets()));
        let p = response(0x8180, [2, 0, 0], "svc.local", TYPE_A, &rest);
        let m = parse_response(&p, 0x1234, "SVC.local.", TYPE_A).unwrap();
        assert_eq!(m.rcode, RCODE_NOERROR);
        assert_eq!(m.answers.len(), 2);
        assert_eq!(m.answers[0].name, "svc.local");
        assert_eq!(m.answers[0].ttl, 30);
        assert_eq!(
            addresses(&m.answers, "svc.local").unwrap(),
            vec![
                IpAddr::from([127, 0, 0, 2]),
                IpAddr::V6(Ipv6Addr::LOCALHOST)
            ]
        );
    }

    #[test]
    fn parses_srv_and_additional() {
        let mut srv = vec![0, 10, 0, 5, 0x1F, 0x40];
        srv.extend(wire_name("pod-0.svc.local"));
        let mut rest = rr(TYPE_SRV, 5, &srv);
        // Additional: A of pod-0.svc.local, named by a pointer into the SRV rdata.
        // header 12 + question 22 + 4, then the SRV record's pointer 2 + fixed 10 + 6.
        let target_at = 12 + 22 + 4 + 2 + 10 + 6;
        rest.extend_from_slice(&[0xC0 | (target_at >> 8) as u8, target_at as u8]);
        rest.extend_from_slice(&[0, 1, 0, 1, 0, 0, 0, 5, 0, 4, 127, 0, 0, 3]);
        let p = response(0x8180, [1, 0, 1], "_http._tcp.svc.local", TYPE_SRV, &rest);
        let m = parse_response(&p, 0x1234, "_http._tcp.svc.local", TYPE_SRV).unwrap();
        assert_eq!(
            m.answers[0].data,
            RData::Srv {
                priority: 10,
                weight: 5,
                port: 8000,
                target: "pod-0.svc.local".into()
            }
        );
        assert_eq!(m.additionals[0].name, "pod-0.svc.local");
        assert_eq!(
            addresses(&m.additionals, "pod-0.svc.local").unwrap(),
            vec![IpAddr::from([127, 0, 0, 3])]
        );
    }

    #[test]
    fn cname_chain_is_followed_and_loops_refused() {
        let recs = vec![
            Record {
                name: "a".into(),
                ttl: 1,
                data: RData::Cname("b".into()),
            },
            Record {
                name: "b".into(),
                ttl: 1,
                data: RData::Cname("c".into()),
            },
            Record {
                name: "c".into(),
                ttl: 1,
                data: RData::A([127, 0, 0, 9].into()),
            },
        ];
        assert_eq!(
            addresses(&recs, "a").unwrap(),
            vec![IpAddr::from([127, 0, 0, 9])]
        );
        let looped = vec![
            Record {
                name: "a".into(),
                ttl: 1,
                data: RData::Cname("b".into()),
            },
            Record {
                name: "b".into(),
                ttl: 1,
                data: RData::Cname("a".into()),
            },
        ];
        assert_eq!(
            follow(&looped, "a", TYPE_A),
            Err(DnsError::CnameChain("a".into()))
        );
        let dangling = vec![Record {
            name: "a".into(),
            ttl: 1,
            data: RData::Cname("z".into()),
        }];
        assert!(addresses(&dangling, "a").unwrap().is_empty());
    }

    #[test]
    fn rcode_and_truncation_are_reported() {
        let p = response(0x8183, [0, 0, 0], "gone.local", TYPE_A, &[]);
        assert_eq!(
            parse_response(&p, 0x1234, "gone.local", TYPE_A)
                .unwrap()
                .rcode,
            RCODE_NXDOMAIN
        );
        let p = response(0x8182, [0, 0, 0], "x.local", TYPE_A, &[]);
        assert_eq!(
            parse_response(&p, 0x1234, "x.local", TYPE_A).unwrap().rcode,
            RCODE_SERVFAIL
        );
        // TC with garbage after the question: not parsed.
        let p = response(0x8380, [9, 0, 0], "big.local", TYPE_A, &[0xFF; 3]);
        let m = parse_response(&p, 0x1234, "big.local", TYPE_A).unwrap();
        assert!(m.truncated && m.answers.is_empty());
    }

    #[test]
    fn wrong_id_question_or_direction_is_refused() {
        let p = response(0x8180, [0, 0, 0], "a.local", TYPE_A, &[]);
        assert_eq!(
            parse_response(&p, 0x4321, "a.local", TYPE_A),
            Err(DnsError::IdMismatch {
                expected: 0x4321,
                got: 0x1234
            })
        );
        assert_eq!(
            parse_response(&p, 0x1234, "b.local", TYPE_A),
            Err(DnsError::QuestionMismatch)
        );
        assert_eq!(
            parse_response(&p, 0x1234, "a.local", TYPE_AAAA),
            Err(DnsError::QuestionMismatch)
        );
        let q = build_query(0x1234, "a.local", TYPE_A).unwrap();
        assert_eq!(
            parse_response(&q, 0x1234, "a.local", TYPE_A),
            Err(DnsError::NotResponse)
        );
    }

    #[test]
    fn malformed_packets_give_errors() {
        let ok = {
            let rest = rr(TYPE_A, 30, &[127, 0, 0, 2]);
            response(0x8180, [1, 0, 0], "a.local", TYPE_A, &rest)
        };
        assert!(parse_response(&ok, 0x1234, "a.local", TYPE_A).is_ok());
        // Every truncation of a valid packet is an error, not a panic.
        for n in 0..ok.len() {
            assert!(
                parse_response(&ok[..n], 0x1234, "a.local", TYPE_A).is_err(),
                "len {n}"
            );
        }
        // Self-pointing compression pointer as the answer's name.
        let mut p = response(0x8180, [1, 0, 0], "a.local", TYPE_A, &[]);
        let at = p.len();
        p.extend_from_slice(&[0xC0 | (at >> 8) as u8, at as u8]);
        p.extend_from_slice(&[0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 127, 0, 0, 1]);
        assert!(matches!(
            parse_response(&p, 0x1234, "a.local", TYPE_A),
            Err(DnsError::Malformed(..))
        ));
        // Forward pointer.
        let mut p = response(0x8180, [1, 0, 0], "a.local", TYPE_A, &[]);
        p.extend_from_slice(&[0xC0, 0xFF]);
        assert!(matches!(
            parse_response(&p, 0x1234, "a.local", TYPE_A),
            Err(DnsError::Malformed(..))
        ));
        // Label then a pointer back to the label: a loop through a backward pointer.
        let mut p = response(0x8180, [1, 0, 0], "a.local", TYPE_A, &[]);
        let at = p.len();
        p.extend_from_slice(&[1, b'x', 0xC0 | (at >> 8) as u8, at as u8]);
        p.extend_from_slice(&[0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 127, 0, 0, 1]);
        assert!(matches!(
            parse_response(&p, 0x1234, "a.local", TYPE_A),
            Err(DnsError::Malformed(..))
        ));
        // Reserved label type 0x40.
        let mut p = response(0x8180, [1, 0, 0], "a.local", TYPE_A, &[]);
        p.extend_from_slice(&[0x41, 0]);
        assert!(matches!(
            parse_response(&p, 0x1234, "a.local", TYPE_A),
            Err(DnsError::Malformed(..))
        ));
        // A record with 5 bytes of data; rdlength past the end; huge counts.
        let p = response(
            0x8180,
            [1, 0, 0],
            "a.local",
            TYPE_A,
            &rr(TYPE_A, 1, &[1, 2, 3, 4, 5]),
        );
        assert!(parse_response(&p, 0x1234, "a.local", TYPE_A).is_err());
        let mut bad = rr(TYPE_A, 1, &[1, 2, 3, 4]);
        bad[11] = 200;
        let p = response(0x8180, [1, 0, 0], "a.local", TYPE_A, &bad);
        assert!(parse_response(&p, 0x1234, "a.local", TYPE_A).is_err());
        let p = response(0x8180, [0xFFFF, 0xFFFF, 0xFFFF], "a.local", TYPE_A, &[]);
        assert!(parse_response(&p, 0x1234, "a.local", TYPE_A).is_err());
        // SRV whose target overruns its rdata; CNAME with a non-printable label.
        let mut srv = vec![0, 1, 0, 1, 0, 80];
        srv.extend(wire_name("t.local"));
        let mut r = rr(TYPE_SRV, 1, &srv);
        r[11] = 8; // rdlength cut inside the target name
        let p = response(0x8180, [1, 0, 0], "s.local", TYPE_SRV, &r);
        assert!(parse_response(&p, 0x1234, "s.local", TYPE_SRV).is_err());
        let p = response(
            0x8180,
            [1, 0, 0],
            "c.local",
            TYPE_A,
            &rr(TYPE_CNAME, 1, &[1, 0x07, 0]),
        );
        assert!(parse_response(&p, 0x1234, "c.local", TYPE_A).is_err());
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = Rng::new(7);
        let base = {
            let mut srv = vec![0, 1, 0, 1, 0, 80];
            srv.extend(wire_name("t.local"));
            let mut rest = rr(TYPE_SRV, 1, &srv);
            rest.extend(rr(TYPE_CNAME, 1, &[0xC0, 12]));
            response(0x8180, [2, 0, 0], "s.local", TYPE_SRV, &rest)
        };
        for _ in 0..20_000 {
            let mut p = base.clone();
            for _ in 0..1 + rng.next_u64() % 4 {
                let i = (rng.next_u64() as usize) % p.len();
                p[i] = rng.next_u64() as u8;
            }
            let _ = parse_response(&p, 0x1234, "s.local", TYPE_SRV);
        }
    }

    #[test]
    fn resolv_conf_nameservers() {
        let text = "# comment\nsearch default.svc.cluster.local\nnameserver 10.96.0.10\n\
                    nameserver ::1 # local\nnameserver fe80::1%eth0\nnameserver fe80::2%3\n\
                    nameserver dns.example\noptions ndots:5\n";
        let got = parse_resolv_conf(text);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], "10.96.0.10:53".parse().unwrap());
        assert_eq!(got[1], "[::1]:53".parse().unwrap());
        match got[2] {
            SocketAddr::V6(v6) => assert_eq!(v6.scope_id(), 3),
            _ => panic!("expected v6"),
        }
    }
}
