//! The replayer's side of the wire: one blocking HTTP/1.1 exchange per request over its own
//! connection (`Connection: close`), shared with `kvlb demo`.
//!
//! * `stream` sends a request whose answer is a server-sent event stream and times it: time
//!   to the first `data:` event of the body (TTFT) and to the end of the answer. It keeps the
//!   response head, and the body only when asked (the replayer keeps a few bytes, so a few
//!   hundred streams at once cost little memory), and the `usage` of its last event (asked
//!   for with `stream_options.include_usage`);
//! * `http` is a small exchange for admin endpoints (`/metrics`, `/reset_prefix_cache`);
//! * `base_addr` turns `http://HOST:PORT[/]` into a socket address.

#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// A streamed answer.
#[derive(Debug, Clone)]
pub struct Streamed {
    pub status: u16,
    /// The response head (status line and headers) as text.
    pub head: String,
    /// The body (chunk framing removed) when `keep_body`, else its first bytes for a non-200
    /// answer (the error message).
    pub body: Vec<u8>,
    /// Seconds from sending the request to the first `data:` event.
    pub ttft_s: Option<f64>,
    /// Seconds from sending the request to the end of the answer.
    pub e2e_s: f64,
    /// The stream ended with `data: [DONE]`.
    pub done: bool,
    /// The `usage` object of the stream's last events, when one carried it.
    pub usage: Option<StreamUsage>,
}

/// What a streamed answer's `usage` says of its prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamUsage {
    pub prompt_tokens: u64,
    /// `prompt_tokens_details.cached_tokens` (vLLM fills it with
    /// --enable-prompt-tokens-details; absent or null otherwise).
    pub cached_tokens: Option<u64>,
}

/// Bytes of the stream's end kept to find its usage event (a usage chunk is a few hundred).
const LAST_BYTES: usize = 4096;

/// The `usage` of the last `data:` event in `tail` that has one.
fn usage_of(tail: &[u8]) -> Option<StreamUsage> {
    let text = String::from_utf8_lossy(tail);
    text.rsplit("data:").find_map(|event| {
        let json = event.split("\n\n").next()?.trim();
        let v: serde_json::Value = serde_json::from_str(json).ok()?;
        let u = v.get("usage")?;
        Some(StreamUsage {
            prompt_tokens: u.get("prompt_tokens")?.as_u64()?,
            cached_tokens: u
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))
                .and_then(serde_json::Value::as_u64),
        })
    })
}

impl Streamed {
    /// The value of response header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Error bodies kept when the body itself is not.
const ERROR_BODY_BYTES: usize = 1024;

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// POST `body` (JSON) to `path` on `addr` and read the whole streamed answer, within `timeout`.
pub fn stream(
    addr: SocketAddr,
    path: &str,
    body: &[u8],
    timeout: Duration,
    keep_body: bool,
) -> Result<Streamed, String> {
    let t0 = Instant::now();
    let deadline = t0 + timeout;
    let mut s = TcpStream::connect_timeout(&addr, timeout.min(Duration::from_secs(10)))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_nodelay(true).ok();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    s.set_write_timeout(Some(timeout)).ok();
    s.write_all(&req)
        .map_err(|e| format!("send to {addr}: {e}"))?;

    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut tmp = vec![0u8; 16384];
    let mut head: Option<(u16, String)> = None;
    let mut chunked: Option<crate::http::chunked::ChunkedDecoder> = None;
    let mut payload: Vec<u8> = Vec::with_capacity(16384);
    let mut body: Vec<u8> = Vec::new();
    let mut ttft = None;
    // The last payload bytes seen, to find events split across reads without keeping the body.
    let mut tail: Vec<u8> = Vec::with_capacity(64);
    let mut done = false;
    let mut last: Vec<u8> = Vec::with_capacity(LAST_BYTES);
    'read: loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "no complete answer from {addr} within {:.0} s",
                timeout.as_secs_f64()
            ));
        }
        s.set_read_timeout(Some(left)).ok();
        let n = match s.read(&mut tmp) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("read from {addr}: {e}")),
        };
        if n == 0 {
            break;
        }
        let now = Instant::now();
        let mut input = &tmp[..n];
        if head.is_none() {
            buf.extend_from_slice(input);
            let Some(p) = find(&buf, b"\r\n\r\n") else {
                if buf.len() > 256 * 1024 {
                    return Err(format!("{addr}: response head over 256 KiB"));
                }
                continue;
            };
            let text = String::from_utf8_lossy(&buf[..p]).into_owned();
            let status = text
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse::<u16>().ok())
                .ok_or_else(|| format!("{addr}: not an HTTP response: {:?}", first_line(&text)))?;
            if text
                .to_ascii_lowercase()
                .contains("\ntransfer-encoding: chunked")
            {
                chunked = Some(crate::http::chunked::ChunkedDecoder::new());
            }
            head = Some((status, text));
            buf.drain(..p + 4);
            input = &buf;
        }
        payload.clear();
        let mut ended = false;
        if let Some(dec) = chunked.as_mut() {
            dec.feed(input, |a, b| payload.extend_from_slice(&input[a..b]))
                .map_err(|e| format!("{addr}: bad chunked framing: {e:?}"))?;
            ended = dec.is_done();
        } else {
            payload.extend_from_slice(input);
        }
        buf.clear();
        let status = head.as_ref().map(|h| h.0).unwrap_or(0);
        if keep_body {
            body.extend_from_slice(&payload);
        } else if status != 200 && body.len() < ERROR_BODY_BYTES {
            let room = ERROR_BODY_BYTES - body.len();
            body.extend_from_slice(&payload[..payload.len().min(room)]);
        }
        let window_from = tail.len();
        tail.extend_from_slice(&payload);
        if ttft.is_none() && find(&tail[window_from.saturating_sub(4)..], b"data:").is_some() {
            ttft = Some(now.duration_since(t0).as_secs_f64());
        }
        if find(&tail[window_from.saturating_sub(11)..], b"data: [DONE]").is_some() {
            done = true;
        }
        if tail.len() > 32 {
            tail.drain(..tail.len() - 32);
        }
        if status == 200 {
            let keep = payload.len().min(LAST_BYTES);
            let drop = (last.len() + keep).saturating_sub(LAST_BYTES);
            last.drain(..drop);
            last.extend_from_slice(&payload[payload.len() - keep..]);
        }
        if ended {
            break 'read;
        }
    }
    let e2e_s = t0.elapsed().as_secs_f64();
    let (status, head) = head.ok_or_else(|| format!("{addr} closed without a response"))?;
    Ok(Streamed {
        status,
        head,
        body,
        ttft_s: ttft,
        e2e_s,
        done,
        usage: usage_of(&last),
    })
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or("")
}

/// A small blocking HTTP/1.1 exchange (Connection: close): (status, de-chunked body).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, Vec<u8>), String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    s.write_all(&req).map_err(|e| format!("{addr}: {e}"))?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)
        .map_err(|e| format!("{addr}: {e}"))?;
    let p = find(&buf, b"\r\n\r\n").ok_or_else(|| format!("{addr}: no response head"))?;
    let status = String::from_utf8_lossy(&buf[..p])
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| format!("{addr}: not an HTTP response"))?;
    let head = String::from_utf8_lossy(&buf[..p]).to_ascii_lowercase();
    let mut body = buf[p + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        let mut out = Vec::new();
        let mut dec = crate::http::chunked::ChunkedDecoder::new();
        let _ = dec.feed(&body, |a, b| out.extend_from_slice(&body[a..b]));
        body = out;
    }
    Ok((status, body))
}

/// `http://HOST:PORT` (a trailing `/` allowed) -> its first socket address.
pub fn base_addr(url: &str) -> Result<SocketAddr, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url:?}: expected http://HOST:PORT"))?;
    let hostport = rest.trim_end_matches('/');
    if hostport.is_empty() || hostport.contains('/') {
        return Err(format!("{url:?}: expected http://HOST:PORT with no path"));
    }
    hostport
        .to_socket_addrs()
        .map_err(|e| format!("{url:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{url:?}: no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_addresses() {
        assert_eq!(
            base_addr("http://127.0.0.1:8000/").unwrap(),
            "127.0.0.1:8000".parse().unwrap()
        );
        assert!(base_addr("127.0.0.1:8000").is_err());
        assert!(base_addr("http://127.0.0.1:8000/v1").is_err());
        assert!(base_addr("http://").is_err());
    }

    #[test]
    fn streams_are_timed_and_their_end_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let mut got = Vec::new();
            while find(&got, b"\r\n\r\n").is_none() {
                let n = c.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            c.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Kvlb-Replica: r1\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
            std::thread::sleep(Duration::from_millis(30));
            let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n";
            c.write_all(format!("{:x}\r\n", usage.len()).as_bytes())
                .unwrap();
            c.write_all(usage).unwrap();
            c.write_all(b"\r\n").unwrap();
            c.write_all(b"6\r\ndata: \r\n").unwrap();
            c.write_all(b"8\r\n{}\n\ndata\r\n").unwrap();
            c.write_all(b"a\r\n: [DONE]\n\n\r\n0\r\n\r\n").unwrap();
        });
        let r = stream(
            addr,
            "/v1/completions",
            b"{}",
            Duration::from_secs(5),
            false,
        )
        .unwrap();
        server.join().unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-kvlb-replica"), Some("r1"));
        assert!(r.ttft_s.unwrap() >= 0.02, "{:?}", r.ttft_s);
        assert!(r.e2e_s >= r.ttft_s.unwrap());
        assert!(r.done, "[DONE] split across chunks is found");
        assert_eq!(
            r.usage,
            Some(StreamUsage {
                prompt_tokens: 9,
                cached_tokens: Some(4)
            })
        );
        assert_eq!(
            usage_of(b"data: {\"usage\":null}\n\ndata: [DONE]\n\n"),
            None
        );
        assert!(r.body.is_empty());
    }
}
