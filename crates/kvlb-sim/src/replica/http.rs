//! HTTP/1.1 framing of the replica's server over blocking std sockets: request heads (httparse),
//! Content-Length and chunked request bodies, `Expect: 100-continue`, keep-alive and pipelining,
//! and the bytes of responses (fixed-length and chunked). Hostile input becomes a
//! `ReadRequestError` with the status to answer, never a panic.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Largest request head accepted (431 beyond).
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Largest request body accepted (413 beyond).
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// How long a started request may take to arrive completely.
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_HEADERS: usize = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Post,
    Head,
    Other,
}

/// One parsed request.
#[derive(Debug)]
pub struct Request {
    pub method: Method,
    /// Path without the query string.
    pub path: String,
    pub keep_alive: bool,
    pub body: Vec<u8>,
    /// `X-Data-Parallel-Rank: r` (any case), as vLLM and SGLang read it: the rank asked for.
    pub dp_rank: Option<u32>,
}

/// Why no request could be read.
#[derive(Debug)]
pub enum ReadRequestError {
    /// The peer closed the connection between requests (the normal end of keep-alive).
    Closed,
    /// Malformed, oversized or truncated: answer `status` with `message`, then close.
    Bad { status: u16, message: String },
    /// The socket failed; nothing more to say on it.
    Io(io::Error),
}

fn bad(status: u16, message: impl Into<String>) -> ReadRequestError {
    ReadRequestError::Bad {
        status,
        message: message.into(),
    }
}

/// A server-side connection: the socket plus bytes read past the current request.
pub struct Connection {
    pub stream: TcpStream,
    buf: Vec<u8>,
    filled: usize,
}

impl Connection {
    pub fn new(stream: TcpStream) -> Connection {
        let _ = stream.set_nodelay(true);
        Connection {
            stream,
            buf: vec![0; 16 * 1024],
            filled: 0,
        }
    }

    /// Read more bytes; Ok(0) at end of stream.
    fn fill(&mut self) -> io::Result<usize> {
        if self.filled == self.buf.len() {
            let grow = self.buf.len().min(MAX_BODY_BYTES);
            self.buf.resize(self.buf.len() + grow, 0);
        }
        loop {
            match self.stream.read(&mut self.buf[self.filled..]) {
                Ok(n) => {
                    self.filled += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn fill_in_request(&mut self, what: &str) -> Result<(), ReadRequestError> {
        match self.fill() {
            Ok(0) => Err(bad(
                400,
                format!("incomplete request {what}: the connection closed early"),
            )),
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(bad(
                    408,
                    format!(
                        "request {what} not received within {}s",
                        REQUEST_READ_TIMEOUT.as_secs()
                    ),
                ))
            }
            Err(e) => Err(ReadRequestError::Io(e)),
        }
    }

    /// Drop the first `n` buffered bytes (a request just consumed).
    fn consume(&mut self, n: usize) {
        self.buf.copy_within(n..self.filled, 0);
        self.filled -= n;
        if self.buf.len() > 64 * 1024 && self.filled < 16 * 1024 {
            self.buf.truncate(16 * 1024);
            self.buf.shrink_to_fit();
        }
    }

    /// Read the next request. Blocks without limit between requests; a started request must
    /// arrive within 30 s.
    pub fn read_request(&mut self) -> Result<Request, ReadRequestError> {
        let mut timed = false;
        let (head_len, method, path, keep_alive, body_kind, expect_continue, dp_rank) = loop {
            if self.filled > 0 {
                let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
                let mut req = httparse::Request::new(&mut headers);
                match req.parse(&self.buf[..self.filled]) {
                    Ok(httparse::Status::Complete(n)) => {
                        let parsed = head_fields(&req)?;
                        break (
                            n, parsed.0, parsed.1, parsed.2, parsed.3, parsed.4, parsed.5,
                        );
                    }
                    Ok(httparse::Status::Partial) => {
                        if self.filled >= MAX_HEAD_BYTES {
                            return Err(bad(431, "request head too large"));
                        }
                    }
                    Err(httparse::Error::TooManyHeaders) => {
                        return Err(bad(431, "too many request headers"))
                    }
                    Err(e) => return Err(bad(400, format!("malformed request head: {e}"))),
                }
            }
            if self.filled > 0 && !timed {
                let _ = self.stream.set_read_timeout(Some(REQUEST_READ_TIMEOUT));
                timed = true;
            }
            if self.filled == 0 {
                match self.fill() {
                    Ok(0) => return Err(ReadRequestError::Closed),
                    Ok(_) => {}
                    Err(e) => return Err(ReadRequestError::Io(e)),
                }
            } else {
                self.fill_in_request("head")?;
            }
        };
        if !timed {
            let _ = self.stream.set_read_timeout(Some(REQUEST_READ_TIMEOUT));
        }
        let result = self.read_body(head_len, body_kind, expect_continue);
        let _ = self.stream.set_read_timeout(None);
        let (body, consumed) = result?;
        self.consume(consumed);
        Ok(Request {
            method,
            path,
            keep_alive,
            body,
            dp_rank,
        })
    }

    fn read_body(
        &mut self,
        head_len: usize,
        kind: BodyKind,
        expect_continue: bool,
    ) -> Result<(Vec<u8>, usize), ReadRequestError> {
        let mut continued = false;
        let mut send_continue = |conn: &mut Connection| -> Result<(), ReadRequestError> {
            if expect_continue && !continued {
                continued = true;
                conn.stream
                    .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                    .map_err(ReadRequestError::Io)?;
            }
            Ok(())
        };
        match kind {
            BodyKind::None => Ok((Vec::new(), head_len)),
            BodyKind::Length(len) => {
                if len > MAX_BODY_BYTES {
                    return Err(bad(
                        413,
                        format!(
                            "request body of {len} bytes is over the limit of {MAX_BODY_BYTES}"
                        ),
                    ));
                }
                while self.filled < head_len + len {
                    send_continue(self)?;
                    let need = head_len + len;
                    if self.buf.len() < need {
                        self.buf.resize(need, 0);
                    }
                    let have = self.filled - head_len;
                    self.fill_in_request("body").map_err(|e| match e {
                        ReadRequestError::Bad { status: 400, .. } => bad(
                            400,
                            format!("incomplete request body: expected {len} bytes, got {have}"),
                        ),
                        other => other,
                    })?;
                }
                Ok((self.buf[head_len..head_len + len].to_vec(), head_len + len))
            }
            BodyKind::Chunked => {
                let mut body = Vec::new();
                let mut pos = head_len;
                loop {
                    if self.filled - head_len > 2 * MAX_BODY_BYTES {
                        return Err(bad(
                            413,
                            format!("request body is over the limit of {MAX_BODY_BYTES} bytes"),
                        ));
                    }
                    match httparse::parse_chunk_size(&self.buf[pos..self.filled]) {
                        Ok(httparse::Status::Complete((line, size))) => {
                            if size == 0 {
                                pos += line;
                                // Trailer lines until an empty line.
                                loop {
                                    match find_crlf(&self.buf[pos..self.filled]) {
                                        Some(0) => return Ok((body, pos + 2)),
                                        Some(k) => pos += k + 2,
                                        None => {
                                            if self.filled - pos > MAX_HEAD_BYTES {
                                                return Err(bad(431, "chunked trailers too large"));
                                            }
                                            send_continue(self)?;
                                            self.fill_in_request("body")?;
                                        }
                                    }
                                }
                            }
                            let size = usize::try_from(size).unwrap_or(usize::MAX);
                            if size > MAX_BODY_BYTES || body.len() + size > MAX_BODY_BYTES {
                                return Err(bad(
                                    413,
                                    format!(
                                        "request body is over the limit of {MAX_BODY_BYTES} bytes"
                                    ),
                                ));
                            }
                            let end = pos + line + size + 2;
                            if self.filled < end {
                                send_continue(self)?;
                                if self.buf.len() < end {
                                    self.buf.resize(end, 0);
                                }
                                self.fill_in_request("body")?;
                                continue;
                            }
                            if &self.buf[end - 2..end] != b"\r\n" {
                                return Err(bad(
                                    400,
                                    "invalid chunked body: chunk not followed by CRLF",
                                ));
                            }
                            body.extend_from_slice(&self.buf[pos + line..end - 2]);
                            pos = end;
                        }
                        Ok(httparse::Status::Partial) => {
                            if self.filled - pos > 1024 {
                                return Err(bad(
                                    400,
                                    "invalid chunked body: chunk size line too long",
                                ));
                            }
                            send_continue(self)?;
                            self.fill_in_request("body")?;
                        }
                        Err(_) => return Err(bad(400, "invalid chunked body: bad chunk size")),
                    }
                }
            }
        }
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Close after an error answer without destroying it: closing with unread input makes the
    /// kernel send a reset that can discard the answer before the client reads it. So send FIN,
    /// then read and drop what the client still sends, for a short while.
    pub fn lingering_close(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let _ = self
            .stream
            .set_read_timeout(Some(Duration::from_millis(500)));
        let mut sink = [0u8; 16 * 1024];
        let mut total = 0usize;
        while total < 4 * 1024 * 1024 {
            match self.stream.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    }

    /// Whether the peer has closed its side (a non-blocking peek reads end of stream). Bytes of
    /// a pipelined next request do not count as closed.
    pub fn peer_closed(&self) -> bool {
        let mut byte = [0u8; 1];
        // Safety: the fd stays open for the life of `self.stream`; recv writes at most 1 byte
        // into `byte`, which we own; MSG_PEEK leaves the data queued, MSG_DONTWAIT never blocks.
        let r = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                byte.as_mut_ptr() as *mut libc::c_void,
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if r == 0 {
            return true;
        }
        if r < 0 {
            let e = io::Error::last_os_error();
            return !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            );
        }
        false
    }
}

#[derive(Debug, Clone, Copy)]
enum BodyKind {
    None,
    Length(usize),
    Chunked,
}

type HeadFields = (Method, String, bool, BodyKind, bool, Option<u32>);

fn head_fields(req: &httparse::Request) -> Result<HeadFields, ReadRequestError> {
    let method = match req.method.unwrap_or("") {
        "GET" => Method::Get,
        "POST" => Method::Post,
        "HEAD" => Method::Head,
        _ => Method::Other,
    };
    let target = req.path.unwrap_or("/");
    let path = target.split('?').next().unwrap_or("/").to_string();
    let http10 = req.version == Some(0);
    let mut keep_alive = !http10;
    let mut body = BodyKind::None;
    let mut content_length: Option<usize> = None;
    let mut chunked = false;
    let mut expect_continue = false;
    let mut dp_rank = None;
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("x-data-parallel-rank") {
            let v = std::str::from_utf8(h.value).ok().map(str::trim);
            dp_rank = Some(v.and_then(|s| s.parse::<u32>().ok()).ok_or_else(|| {
                bad(
                    400,
                    "X-Data-Parallel-Rank: expected a rank number".to_string(),
                )
            })?);
        }
        if name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value).ok().map(str::trim);
            match v.and_then(|s| s.parse::<usize>().ok()) {
                Some(n) if content_length.is_none() || content_length == Some(n) => {
                    content_length = Some(n)
                }
                _ => {
                    return Err(bad(
                        400,
                        format!(
                            "invalid Content-Length: {:?}",
                            String::from_utf8_lossy(h.value)
                        ),
                    ))
                }
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            let v = String::from_utf8_lossy(h.value).to_ascii_lowercase();
            if v.trim().ends_with("chunked") {
                chunked = true;
            } else if !v.trim().is_empty() && v.trim() != "identity" {
                return Err(bad(501, format!("unsupported Transfer-Encoding: {v:?}")));
            }
        } else if name.eq_ignore_ascii_case("connection") {
            let v = String::from_utf8_lossy(h.value).to_ascii_lowercase();
            if v.contains("close") {
                keep_alive = false;
            } else if v.contains("keep-alive") {
                keep_alive = true;
            }
        } else if name.eq_ignore_ascii_case("expect") {
            expect_continue = h.value.eq_ignore_ascii_case(b"100-continue");
        }
    }
    if chunked {
        body = BodyKind::Chunked;
    } else if let Some(n) = content_length {
        if n > 0 {
            body = BodyKind::Length(n);
        }
    }
    Ok((method, path, keep_alive, body, expect_continue, dp_rank))
}

fn find_crlf(b: &[u8]) -> Option<usize> {
    b.windows(2).position(|w| w == b"\r\n")
}

pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

/// A complete fixed-length response.
pub fn response(status: u16, content_type: Option<&str>, body: &[u8], keep_alive: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(160 + body.len());
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {status} {}\r\nserver: kvlb-replica\r\n",
            reason_phrase(status)
        )
        .as_bytes(),
    );
    if let Some(ct) = content_type {
        out.extend_from_slice(format!("content-type: {ct}\r\n").as_bytes());
    }
    out.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// Head of a chunked server-sent-events response.
pub fn event_stream_head(keep_alive: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(160);
    out.extend_from_slice(
        b"HTTP/1.1 200 OK\r\nserver: kvlb-replica\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n",
    );
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// Append `data: {payload}\n\n` as one HTTP chunk.
pub fn push_sse_chunk(out: &mut Vec<u8>, payload: &str) {
    let len = payload.len() + 8;
    out.extend_from_slice(format!("{len:x}\r\ndata: ").as_bytes());
    out.extend_from_slice(payload.as_bytes());
    out.extend_from_slice(b"\n\n\r\n");
}

/// Append `event: {event}\ndata: {payload}\n\n` (a named server-sent event, as the Responses
/// and Messages APIs send them) as one HTTP chunk.
pub fn push_sse_event(out: &mut Vec<u8>, event: &str, payload: &str) {
    let len = event.len() + payload.len() + 16;
    out.extend_from_slice(format!("{len:x}\r\nevent: {event}\ndata: ").as_bytes());
    out.extend_from_slice(payload.as_bytes());
    out.extend_from_slice(b"\n\n\r\n");
}

/// The zero chunk that ends a chunked body.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, Connection) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, Connection::new(s))
    }

    #[test]
    fn pipelined_length_and_chunked_bodies() {
        let (mut c, mut conn) = pair();
        c.write_all(b"POST /a?x=1 HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcPOST /b HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n3;x=y\r\n!!!\r\n0\r\nT: v\r\n\r\nGET /c HTTP/1.0\r\n\r\n").unwrap();
        let r = conn.read_request().unwrap();
        assert_eq!(
            (r.method, r.path.as_str(), r.body.as_slice(), r.keep_alive),
            (Method::Post, "/a", &b"abc"[..], true)
        );
        let r = conn.read_request().unwrap();
        assert_eq!((r.path.as_str(), r.body.as_slice()), ("/b", &b"hi!!!"[..]));
        let r = conn.read_request().unwrap();
        assert_eq!((r.method, r.keep_alive), (Method::Get, false));
        drop(c);
        assert!(matches!(conn.read_request(), Err(ReadRequestError::Closed)));
    }

    #[test]
    fn truncated_and_garbage_requests() {
        let (mut c, mut conn) = pair();
        c.write_all(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
            .unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        match conn.read_request() {
            Err(ReadRequestError::Bad {
                status: 400,
                message,
            }) => assert!(message.contains("expected 10 bytes, got 3"), "{message}"),
            other => panic!("{other:?}"),
        }
        let (mut c, mut conn) = pair();
        c.write_all(b"\x00\x01\x02garbage\r\n\r\n").unwrap();
        assert!(matches!(
            conn.read_request(),
            Err(ReadRequestError::Bad { status: 400, .. })
        ));
        let (mut c, mut conn) = pair();
        c.write_all(b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n")
            .unwrap();
        assert!(matches!(
            conn.read_request(),
            Err(ReadRequestError::Bad { status: 400, .. })
        ));
        let (mut c, mut conn) = pair();
        c.write_all(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
            .unwrap();
        assert!(matches!(
            conn.read_request(),
            Err(ReadRequestError::Bad { status: 400, .. })
        ));
        let (mut c, mut conn) = pair();
        c.write_all(b"POST / HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n")
            .unwrap();
        assert!(matches!(
            conn.read_request(),
            Err(ReadRequestError::Bad { status: 413, .. })
        ));
    }

    #[test]
    fn sse_chunk_framing() {
        let mut out = Vec::new();
        push_sse_chunk(&mut out, "{}");
        assert_eq!(out, b"a\r\ndata: {}\n\n\r\n");
    }
}
