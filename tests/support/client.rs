//! A raw HTTP/1.1 client over `std::net::TcpStream`: sends exact bytes (for framing and
//! smuggling cases) and reads responses framed by content-length, chunked encoding or close.
//!
//! Every read has a timeout; a response that does not arrive is an `Err`, never a hang.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Default bound on one read or write.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// How a response body was delimited on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Framing {
    /// No body by definition (HEAD, 1xx, 204, 304).
    NoBody,
    ContentLength(u64),
    Chunked,
    /// Read until the peer closed.
    Close,
}

/// A parsed response.
#[derive(Debug, Clone)]
pub struct Response {
    pub version: String,
    pub status: u16,
    pub reason: String,
    /// In arrival order, names as sent.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub framing: Framing,
    /// Statuses of interim (1xx) responses that came before this one.
    pub interim: Vec<u16>,
    /// Trailer fields of a chunked body.
    pub trailers: Vec<(String, String)>,
}

impl Response {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// All values of header `name` (case-insensitive), in order.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON, or `None` if it is not JSON.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// Whether the body has the contract's error shape
    /// `{"error":{"message":"...","type":"..."}}`.
    pub fn is_json_error(&self) -> bool {
        match self.json() {
            Some(v) => v["error"]["message"].is_string() && v["error"]["type"].is_string(),
            None => false,
        }
    }

    /// Whether the response asks for or implies closing the connection.
    pub fn says_close(&self) -> bool {
        self.framing == Framing::Close
            || self
                .header_all("connection")
                .iter()
                .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")))
    }

    /// A one-screen description for failure messages.
    pub fn describe(&self) -> String {
        let mut out = format!("{} {} {}\n", self.version, self.status, self.reason);
        for (n, v) in &self.headers {
            out.push_str(&format!("{n}: {v}\n"));
        }
        out.push_str(&format!(
            "[{:?}, {} body bytes, interim {:?}]\n",
            self.framing,
            self.body.len(),
            self.interim
        ));
        if self.body.len() <= 1024 {
            out.push_str(&crate::support::show_bytes(&self.body));
        }
        out
    }
}

/// A status line and headers: (version, status, reason, headers).
pub type Head = (String, u16, String, Vec<(String, String)>);

/// One client connection with its own read buffer.
pub struct HttpConn {
    stream: TcpStream,
    buf: Vec<u8>,
    start: usize,
    /// The peer closed its side (a read returned 0).
    pub eof: bool,
    pub peer: SocketAddr,
}

impl HttpConn {
    /// Connects with `IO_TIMEOUT` on reads and writes; panics if the connect fails.
    pub fn connect(addr: SocketAddr) -> HttpConn {
        HttpConn::try_connect(addr).unwrap_or_else(|e| panic!("connect to {addr} failed: {e}"))
    }

    pub fn try_connect(addr: SocketAddr) -> io::Result<HttpConn> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(HttpConn {
            stream,
            buf: Vec::new(),
            start: 0,
            eof: false,
            peer: addr,
        })
    }

    pub fn set_read_timeout(&mut self, limit: Duration) {
        self.stream
            .set_read_timeout(Some(limit))
            .expect("set_read_timeout");
    }

    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Writes all of `bytes`.
    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)?;
        self.stream.flush()
    }

    /// Sends a request with `Host`, the given headers and (if any) a content-length body.
    pub fn send_request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<()> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.peer);
        let mut has_framing = false;
        for (n, v) in headers {
            if n.eq_ignore_ascii_case("content-length")
                || n.eq_ignore_ascii_case("transfer-encoding")
            {
                has_framing = true;
            }
            req.push_str(&format!("{n}: {v}\r\n"));
        }
        if !has_framing && (!body.is_empty() || method == "POST" || method == "PUT") {
            req.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        req.push_str("\r\n");
        let mut bytes = req.into_bytes();
        bytes.extend_from_slice(body);
        self.send(&bytes)
    }

    /// Sends a request and reads its response.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<Response> {
        self.send_request(method, path, headers, body)?;
        self.read_response(method)
    }

    /// Closes our sending side (the peer reads EOF) but keeps reading.
    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    fn buffered(&self) -> &[u8] {
        &self.buf[self.start..]
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
    }

    /// Reads more bytes into the buffer; returns how many (0 at EOF).
    fn fill(&mut self) -> io::Result<usize> {
        if self.start > 0 && self.start > self.buf.len() / 2 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        let mut tmp = [0u8; 64 * 1024];
        let n = loop {
            match self.stream.read(&mut tmp) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            self.eof = true;
        }
        self.buf.extend_from_slice(&tmp[..n]);
        Ok(n)
    }

    /// One line without its CRLF (a bare LF is accepted too).
    fn read_line(&mut self, limit: usize) -> io::Result<Vec<u8>> {
        loop {
            if let Some(i) = self.buffered().iter().position(|&b| b == b'\n') {
                let mut line = self.buffered()[..i].to_vec();
                self.consume(i + 1);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(line);
            }
            if self.buffered().len() > limit {
                return Err(bad_data(format!(
                    "line longer than {limit} bytes: {}",
                    crate::support::show_bytes(&self.buffered()[..200])
                )));
            }
            if self.fill()? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "connection closed mid-line; got {:?}",
                        crate::support::show_bytes(self.buffered())
                    ),
                ));
            }
        }
    }

    fn read_exact_into(&mut self, n: usize, out: &mut Vec<u8>) -> io::Result<()> {
        let mut left = n;
        while left > 0 {
            if self.buffered().is_empty() && self.fill()? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("connection closed with {left} of {n} body bytes missing"),
                ));
            }
            let take = left.min(self.buffered().len());
            out.extend_from_slice(&self.buffered()[..take]);
            self.consume(take);
            left -= take;
        }
        Ok(())
    }

    /// Reads a status line and headers.
    pub fn read_head(&mut self) -> io::Result<Head> {
        let line = self.read_line(16 * 1024)?;
        let text = String::from_utf8_lossy(&line).into_owned();
        let mut parts = text.splitn(3, ' ');
        let version = parts.next().unwrap_or("").to_string();
        let status: u16 = parts
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad_data(format!("bad status line {text:?}")))?;
        if !version.starts_with("HTTP/1.") {
            return Err(bad_data(format!("bad status line {text:?}")));
        }
        let reason = parts.next().unwrap_or("").to_string();
        let mut headers = Vec::new();
        loop {
            let line = self.read_line(64 * 1024)?;
            if line.is_empty() {
                break;
            }
            let text = String::from_utf8_lossy(&line).into_owned();
            let (n, v) = text
                .split_once(':')
                .ok_or_else(|| bad_data(format!("bad header line {text:?}")))?;
            headers.push((n.to_string(), v.trim().to_string()));
        }
        Ok((version, status, reason, headers))
    }

    /// Reads one response to a request made with `method`, skipping (and recording) 1xx
    /// interim responses. Fails on a framing error, a timeout or an early close.
    pub fn read_response(&mut self, method: &str) -> io::Result<Response> {
        let mut interim = Vec::new();
        let (version, status, reason, headers) = loop {
            let head = self.read_head()?;
            if (100..200).contains(&head.1) && head.1 != 101 {
                interim.push(head.1);
                continue;
            }
            break head;
        };
        let mut resp = Response {
            version,
            status,
            reason,
            headers,
            body: Vec::new(),
            framing: Framing::NoBody,
            interim,
            trailers: Vec::new(),
        };
        if method.eq_ignore_ascii_case("HEAD") || status == 204 || status == 304 {
            return Ok(resp);
        }
        let chunked = resp
            .header_all("transfer-encoding")
            .iter()
            .any(|v| v.to_ascii_lowercase().contains("chunked"));
        if chunked {
            resp.framing = Framing::Chunked;
            self.read_chunked_body(&mut resp)?;
        } else if let Some(cl) = resp.header("content-length") {
            let n: u64 = cl
                .parse()
                .map_err(|_| bad_data(format!("bad content-length {cl:?}")))?;
            resp.framing = Framing::ContentLength(n);
            let mut body = Vec::with_capacity(n as usize);
            self.read_exact_into(n as usize, &mut body)?;
            resp.body = body;
        } else {
            resp.framing = Framing::Close;
            resp.body = self.read_until_close()?;
        }
        Ok(resp)
    }

    fn read_chunked_body(&mut self, resp: &mut Response) -> io::Result<()> {
        loop {
            let line = self.read_line(1024)?;
            let text = String::from_utf8_lossy(&line).into_owned();
            let size_text = text.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_text, 16)
                .map_err(|_| bad_data(format!("bad chunk size line {text:?}")))?;
            if size == 0 {
                loop {
                    let t = self.read_line(64 * 1024)?;
                    if t.is_empty() {
                        return Ok(());
                    }
                    let t = String::from_utf8_lossy(&t).into_owned();
                    if let Some((n, v)) = t.split_once(':') {
                        resp.trailers.push((n.to_string(), v.trim().to_string()));
                    }
                }
            }
            self.read_exact_into(size, &mut resp.body)?;
            let crlf = self.read_line(2)?;
            if !crlf.is_empty() {
                return Err(bad_data("chunk data not followed by CRLF".to_string()));
            }
        }
    }

    /// Reads until the peer closes; fails on timeout.
    pub fn read_until_close(&mut self) -> io::Result<Vec<u8>> {
        while self.fill()? > 0 {}
        let out = self.buffered().to_vec();
        let n = out.len();
        self.consume(n);
        Ok(out)
    }

    /// Waits up to `limit` for whatever arrives: returns the bytes read and whether the peer
    /// closed. A reset counts as closed.
    pub fn read_for(&mut self, limit: Duration) -> (Vec<u8>, bool) {
        let deadline = Instant::now() + limit;
        let mut closed = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            self.stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .expect("set_read_timeout");
            match self.fill() {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(_) => {}
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::TimedOut =>
                {
                    break
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        let _ = self.stream.set_read_timeout(Some(IO_TIMEOUT));
        let out = self.buffered().to_vec();
        let n = out.len();
        self.consume(n);
        (out, closed)
    }

    /// Reads whatever arrives next (at least one byte), with arrival of EOF as an empty vec.
    pub fn read_some(&mut self) -> io::Result<Vec<u8>> {
        if self.buffered().is_empty() {
            self.fill()?;
        }
        let out = self.buffered().to_vec();
        let n = out.len();
        self.consume(n);
        Ok(out)
    }
}

fn bad_data(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// One `GET path` on a new connection; panics with context on failure.
pub fn get(addr: SocketAddr, path: &str) -> Response {
    let mut conn = HttpConn::connect(addr);
    conn.request("GET", path, &[], b"")
        .unwrap_or_else(|e| panic!("GET {path} via {addr} failed: {e}"))
}

/// Sends exact `bytes` on a new connection and reads one response to `method`.
pub fn exchange(addr: SocketAddr, bytes: &[u8], method: &str) -> (HttpConn, io::Result<Response>) {
    let mut conn = HttpConn::connect(addr);
    if let Err(e) = conn.send(bytes) {
        return (conn, Err(e));
    }
    let resp = conn.read_response(method);
    (conn, resp)
}
