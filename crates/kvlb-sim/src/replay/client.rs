//! The replayer's side of the wire: one blocking HTTP/1.1 exchange per request over its own
//! connection (`Connection: close`), shared with `kvlb demo`.
//!
//! * `stream` sends a request whose answer is a server-sent event stream and times it: time
//!   to the first `data:` event of the body (TTFT) and to the end of the answer (`data:
//!   [DONE]`). It keeps the response head, and the body only when asked (the replayer keeps a
//!   few bytes, so a few hundred streams at once cost little memory), and the `usage` of its
//!   last event (asked for with `stream_options.include_usage`). A Responses or Messages
//!   stream is read event by event instead ([`EventReader`]): TTFT at its first text delta,
//!   the end at `response.completed` / `response.incomplete` or `message_stop`, the usage from
//!   its final events;
//! * `http` is a small exchange for admin endpoints (`/metrics`, `/reset_prefix_cache`);
//! * `base_addr` turns `http://HOST:PORT[/]` into a socket address.

#![forbid(unsafe_code)]

use super::Api;
use serde_json::{Map, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// A streamed answer.
#[derive(Debug, Clone)]
pub struct Streamed {
    /// The API the answer was read as.
    pub api: Api,
    pub status: u16,
    /// The response head (status line and headers) as text.
    pub head: String,
    /// The body (chunk framing removed) when `keep_body`, else its first bytes for a non-200
    /// answer (the error message).
    pub body: Vec<u8>,
    /// Seconds from sending the request to the first `data:` event (Responses, Messages: to
    /// the first text delta).
    pub ttft_s: Option<f64>,
    /// Seconds from sending the request to the end of the answer.
    pub e2e_s: f64,
    /// Mean seconds between the stream's events after the first (chat and completions: one
    /// token an event; `[DONE]` aside, a usage event counted as one, which lowers the mean by
    /// a part in the tokens); None with fewer than two.
    pub itl_s: Option<f64>,
    /// The stream ended with its last event ([`end_event`]).
    pub done: bool,
    /// The `usage` object of the stream's last events, when one carried it.
    pub usage: Option<StreamUsage>,
}

/// What a streamed answer's `usage` says of its prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamUsage {
    pub prompt_tokens: u64,
    /// `prompt_tokens_details.cached_tokens` (vLLM fills it with
    /// --enable-prompt-tokens-details; absent or null otherwise); Responses:
    /// `input_tokens_details.cached_tokens`; Messages: `cache_read_input_tokens`.
    pub cached_tokens: Option<u64>,
}

/// The event that ends a complete answer of `api`, as error messages name it.
pub fn end_event(api: Api) -> &'static str {
    match api {
        Api::Chat | Api::Completions => "data: [DONE]",
        Api::Responses => "response.completed or response.incomplete",
        Api::Messages => "message_stop",
    }
}

/// The largest single event an [`EventReader`] keeps (a Responses stream's final event repeats
/// the whole answer); a larger one is skipped.
const MAX_EVENT_BYTES: usize = 8 << 20;

/// Reads a Responses or Messages event stream event by event (`event:` and `data:` lines up to
/// a blank line), keeping only the event being read.
#[derive(Debug)]
pub struct EventReader {
    api: Api,
    /// The bytes of the event being read, carriage returns dropped.
    partial: Vec<u8>,
    /// How far `partial` is known to hold no blank line.
    scanned: usize,
    /// The event being read is over `MAX_EVENT_BYTES`: skipped up to its blank line.
    skipping: bool,
    /// A text delta was seen.
    pub text: bool,
    /// The stream's last event was seen.
    pub done: bool,
    /// Messages: the usage of `message_start`, overlaid with each `message_delta`'s.
    anthropic_usage: Map<String, Value>,
    pub usage: Option<StreamUsage>,
}

impl EventReader {
    pub fn new(api: Api) -> EventReader {
        EventReader {
            api,
            partial: Vec::new(),
            scanned: 0,
            skipping: false,
            text: false,
            done: false,
            anthropic_usage: Map::new(),
            usage: None,
        }
    }

    /// Reads `bytes` of the stream's body; true when they hold its first text delta.
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        let had_text = self.text;
        self.partial
            .extend(bytes.iter().copied().filter(|&b| b != b'\r'));
        loop {
            let from = self.scanned.saturating_sub(1);
            let Some(p) = find(&self.partial[from..], b"\n\n").map(|p| from + p) else {
                self.scanned = self.partial.len();
                if self.partial.len() > MAX_EVENT_BYTES {
                    // Keep the last byte: the blank line may start with it.
                    let cut = self.partial.len() - 1;
                    self.partial.drain(..cut);
                    self.scanned = self.partial.len();
                    self.skipping = true;
                }
                break;
            };
            if !self.skipping {
                let event = String::from_utf8_lossy(&self.partial[..p]).into_owned();
                self.event(&event);
            }
            self.skipping = false;
            self.partial.drain(..p + 2);
            self.scanned = 0;
        }
        self.text && !had_text
    }

    /// One event: its `event:` name (else its data's `type`) and its `data:` lines.
    fn event(&mut self, event: &str) {
        let mut name = None;
        let mut data = String::new();
        for line in event.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                name = Some(v.trim().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if data.is_empty() {
            return;
        }
        let mut parsed: Option<Value> = None;
        let name = match name {
            Some(n) => n,
            None => {
                let v: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                let n = v
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                parsed = Some(v);
                n
            }
        };
        let mut json = || {
            parsed
                .take()
                .unwrap_or_else(|| serde_json::from_str(&data).unwrap_or(Value::Null))
        };
        match (self.api, name.as_str()) {
            (Api::Responses, "response.output_text.delta") => self.text = true,
            (Api::Responses, "response.completed" | "response.incomplete") => {
                self.done = true;
                let v = json();
                let u = &v["response"]["usage"];
                if let Some(prompt) = u.get("input_tokens").and_then(Value::as_u64) {
                    self.usage = Some(StreamUsage {
                        prompt_tokens: prompt,
                        cached_tokens: u
                            .get("input_tokens_details")
                            .and_then(|d| d.get("cached_tokens"))
                            .and_then(Value::as_u64),
                    });
                }
            }
            (Api::Messages, "content_block_delta") if !self.text => {
                self.text = json()["delta"]["type"] == "text_delta";
            }
            (Api::Messages, "message_start") => {
                if let Some(u) = json()["message"].get_mut("usage").map(Value::take) {
                    self.overlay_usage(u);
                }
            }
            (Api::Messages, "message_delta") => {
                if let Some(u) = json().get_mut("usage").map(Value::take) {
                    self.overlay_usage(u);
                }
            }
            (Api::Messages, "message_stop") => {
                self.done = true;
                let u = &self.anthropic_usage;
                let n = |k: &str| u.get(k).and_then(Value::as_u64);
                let cached = n("cache_read_input_tokens");
                self.usage = n("input_tokens").map(|input| StreamUsage {
                    prompt_tokens: input
                        + cached.unwrap_or(0)
                        + n("cache_creation_input_tokens").unwrap_or(0),
                    cached_tokens: cached,
                });
            }
            _ => {}
        }
    }

    /// Anthropic's usage fields of a later event replace the earlier ones (null ones aside).
    fn overlay_usage(&mut self, usage: Value) {
        if let Value::Object(fields) = usage {
            for (k, v) in fields {
                if !v.is_null() {
                    self.anthropic_usage.insert(k, v);
                }
            }
        }
    }
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

/// How many times `needle` occurs in `hay` (not overlapping).
fn count(hay: &[u8], needle: &[u8]) -> u32 {
    let (mut n, mut from) = (0, 0);
    while let Some(at) = find(&hay[from..], needle) {
        n += 1;
        from += at + needle.len();
    }
    n
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// POST `body` (JSON) to `path` on `addr` and read the whole streamed answer of `api`, within
/// `timeout`.
pub fn stream(
    addr: SocketAddr,
    path: &str,
    body: &[u8],
    api: Api,
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
    // Token events (`data:` lines but `[DONE]`) and when the last came, for `itl_s`.
    let (mut token_events, mut last_token_at) = (0u32, None);
    // The last payload bytes seen, to find events split across reads without keeping the body.
    let mut tail: Vec<u8> = Vec::with_capacity(64);
    let mut done = false;
    let mut last: Vec<u8> = Vec::with_capacity(LAST_BYTES);
    let mut events = match api {
        Api::Chat | Api::Completions => None,
        Api::Responses | Api::Messages => Some(EventReader::new(api)),
    };
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
        if let Some(events) = events.as_mut() {
            if status == 200 && events.feed(&payload) {
                ttft = Some(now.duration_since(t0).as_secs_f64());
            }
        } else {
            let window_from = tail.len();
            tail.extend_from_slice(&payload);
            // Events begun in these bytes (one may have started in the last read's).
            let mut new_events = count(&tail[window_from.saturating_sub(4)..], b"data:");
            if ttft.is_none() && new_events > 0 {
                ttft = Some(now.duration_since(t0).as_secs_f64());
            }
            if find(&tail[window_from.saturating_sub(11)..], b"data: [DONE]").is_some() {
                done = true;
                new_events = new_events.saturating_sub(1);
            }
            if status == 200 && new_events > 0 {
                token_events += new_events;
                last_token_at = Some(now);
            }
            if tail.len() > 32 {
                tail.drain(..tail.len() - 32);
            }
        }
        if status == 200 && events.is_none() {
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
    let itl_s = match (ttft, last_token_at) {
        (Some(first), Some(last)) if token_events >= 2 => {
            Some((last.duration_since(t0).as_secs_f64() - first) / (token_events - 1) as f64)
        }
        _ => None,
    };
    let (status, head) = head.ok_or_else(|| format!("{addr} closed without a response"))?;
    let (done, usage) = match events {
        Some(e) => (e.done, e.usage),
        None => (done, usage_of(&last)),
    };
    Ok(Streamed {
        api,
        status,
        head,
        body,
        ttft_s: ttft,
        e2e_s,
        itl_s,
        done,
        usage,
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

    /// Three token events 40 ms apart, `[DONE]` with the last: 40 ms between tokens, an event
    /// split across writes included.
    #[test]
    fn inter_token_latency_is_the_mean_gap_between_token_events() {
        let parts = [
            "data: {\"t\":1}\n\nda",
            "ta: {\"t\":2}\n\n",
            "data: {\"t\":3}\n\ndata: [DONE]\n\n",
        ];
        let (addr, server) = serve_stream(parts.iter().map(|p| (40, p.to_string())).collect());
        let r = stream(
            addr,
            "/v1/completions",
            b"{}",
            Api::Completions,
            Duration::from_secs(5),
            false,
        )
        .unwrap();
        server.join().unwrap();
        assert!(r.done);
        let itl = r.itl_s.expect("an inter-token latency");
        assert!((0.035..0.07).contains(&itl), "{itl}");
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
            Api::Completions,
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

    /// Serves one answer: a chunked event stream written as `parts`, each after its pause.
    fn serve_stream(parts: Vec<(u64, String)>) -> (SocketAddr, std::thread::JoinHandle<()>) {
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
            c.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
            for (pause_ms, part) in parts {
                std::thread::sleep(Duration::from_millis(pause_ms));
                c.write_all(format!("{:x}\r\n{part}\r\n", part.len()).as_bytes())
                    .unwrap();
            }
            c.write_all(b"0\r\n\r\n").unwrap();
        });
        (addr, server)
    }

    /// `stream` of an agent API's answer served as `first`, `text` 60 ms later, then `last`
    /// cut at byte `cut` with 10 ms between its two halves.
    fn stream_split(
        path: &str,
        api: Api,
        (first, text, last): (&str, &str, &str),
        cut: usize,
    ) -> Streamed {
        let (a, b) = last.split_at(cut);
        let (addr, server) = serve_stream(vec![
            (0, first.to_string()),
            (60, text.to_string()),
            (0, a.to_string()),
            (10, b.to_string()),
        ]);
        let r = stream(addr, path, b"{}", api, Duration::from_secs(5), false).unwrap();
        server.join().unwrap();
        r
    }

    fn sse(kind: &str, data: &str) -> String {
        format!("event: {kind}\ndata: {data}\n\n")
    }

    /// A Responses stream as the replica (vLLM) writes it, ending with `end`.
    fn responses_events(end: &str) -> (String, String, String) {
        let first = sse(
            "response.created",
            r#"{"response":{"id":"resp_1","status":"in_progress","usage":null},"sequence_number":0,"type":"response.created"}"#,
        ) + &sse(
            "response.in_progress",
            r#"{"response":{"id":"resp_1","status":"in_progress","usage":null},"sequence_number":1,"type":"response.in_progress"}"#,
        );
        let text = sse(
            "response.output_item.added",
            r#"{"item":{"content":[],"id":"msg_1","role":"assistant","status":"in_progress","type":"message"},"output_index":0,"sequence_number":2,"type":"response.output_item.added"}"#,
        ) + &sse(
            "response.content_part.added",
            r#"{"content_index":0,"item_id":"msg_1","output_index":0,"part":{"annotations":[],"logprobs":[],"text":"","type":"output_text"},"sequence_number":3,"type":"response.content_part.added"}"#,
        ) + &sse(
            "response.output_text.delta",
            r#"{"content_index":0,"delta":"Hello","item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"}"#,
        ) + &sse(
            "response.output_text.delta",
            r#"{"content_index":0,"delta":" world","item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":5,"type":"response.output_text.delta"}"#,
        );
        let last = sse(
            "response.output_text.done",
            r#"{"content_index":0,"item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":6,"text":"Hello world","type":"response.output_text.done"}"#,
        ) + &sse(
            end,
            &format!(
                r#"{{"response":{{"id":"resp_1","output":[{{"content":[{{"annotations":[],"text":"Hello world","type":"output_text"}}],"id":"msg_1","role":"assistant","status":"incomplete","type":"message"}}],"status":"incomplete","usage":{{"input_tokens":30,"input_tokens_details":{{"cached_tokens":16,"cache_write_tokens":0,"input_tokens_per_turn":[],"cached_tokens_per_turn":[]}},"output_tokens":2,"output_tokens_details":{{"reasoning_tokens":0,"tool_output_tokens":0}},"total_tokens":32}}}},"sequence_number":7,"type":"{end}"}}"#
            ),
        );
        (first, text, last)
    }

    #[test]
    fn responses_streams_time_the_first_text_delta_and_end_at_the_final_event() {
        let (first, text, last) = responses_events("response.incomplete");
        // The final event split mid-way across chunks.
        let parts = (first.as_str(), text.as_str(), last.as_str());
        let r = stream_split("/v1/responses", Api::Responses, parts, last.len() / 2);
        assert_eq!(r.status, 200);
        assert!(
            r.ttft_s.unwrap() >= 0.05,
            "TTFT at the first text delta, not response.created: {:?}",
            r.ttft_s
        );
        assert!(r.e2e_s >= r.ttft_s.unwrap());
        assert!(r.done, "response.incomplete ends the answer");
        assert_eq!(
            r.usage,
            Some(StreamUsage {
                prompt_tokens: 30,
                cached_tokens: Some(16)
            })
        );

        // response.completed ends it too; a stream cut before its final event is not done.
        let (first, text, last) = responses_events("response.completed");
        let mut reader = EventReader::new(Api::Responses);
        assert!(!reader.feed(first.as_bytes()));
        assert!(reader.feed(text.as_bytes()), "the first text delta");
        assert!(!reader.done);
        reader.feed(last.as_bytes());
        assert!(reader.done);
        assert_eq!(reader.usage.unwrap().cached_tokens, Some(16));
        let mut cut = EventReader::new(Api::Responses);
        cut.feed((first + &text).as_bytes());
        cut.feed(&last.as_bytes()[..last.len() - 3]);
        assert!(cut.text && !cut.done && cut.usage.is_none());
        // A reasoning delta is not text.
        let mut reasoning = EventReader::new(Api::Responses);
        assert!(!reasoning.feed(
            sse(
                "response.reasoning_text.delta",
                r#"{"delta":"hm","type":"response.reasoning_text.delta"}"#
            )
            .as_bytes()
        ));
    }

    /// A Messages stream as the replica (vLLM) writes it.
    fn messages_events() -> (String, String, String) {
        let first = sse(
            "message_start",
            r#"{"type":"message_start","message":{"id":"chatcmpl-1","type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":30,"output_tokens":0}}}"#,
        ) + &sse(
            "content_block_start",
            r#"{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}"#,
        );
        let text = sse(
            "content_block_delta",
            r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"Hello"},"index":0}"#,
        ) + &sse(
            "content_block_delta",
            r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":" world"},"index":0}"#,
        );
        let last = sse(
            "content_block_stop",
            r#"{"type":"content_block_stop","index":0}"#,
        ) + &sse(
            "message_delta",
            r#"{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"input_tokens":14,"output_tokens":2,"cache_read_input_tokens":16}}"#,
        ) + &sse("message_stop", r#"{"type":"message_stop"}"#);
        (first, text, last)
    }

    #[test]
    fn messages_streams_time_the_first_text_delta_and_end_at_message_stop() {
        let (first, text, last) = messages_events();
        let parts = (first.as_str(), text.as_str(), last.as_str());
        let r = stream_split("/v1/messages", Api::Messages, parts, last.len() - 10);
        assert!(
            r.ttft_s.unwrap() >= 0.05,
            "TTFT at the first text delta, not message_start: {:?}",
            r.ttft_s
        );
        assert!(r.done, "message_stop ends the answer");
        // Prompt tokens: the uncached input tokens plus those read from the cache.
        assert_eq!(
            r.usage,
            Some(StreamUsage {
                prompt_tokens: 30,
                cached_tokens: Some(16)
            })
        );

        // Without message_stop the answer is not complete.
        let mut cut = EventReader::new(Api::Messages);
        cut.feed((first + &text).as_bytes());
        assert!(cut.text && !cut.done && cut.usage.is_none());

        // Anthropic's own shape: the cache counts in message_start, message_delta with the
        // output tokens only; CRLF line ends, no event: lines.
        let mut reader = EventReader::new(Api::Messages);
        let events = [
            r#"{"type":"message_start","message":{"usage":{"input_tokens":5,"cache_creation_input_tokens":10,"cache_read_input_tokens":20,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
        ];
        for e in events {
            assert!(!reader.feed(format!("data: {e}\r\n\r\n").as_bytes()), "{e}");
        }
        assert!(reader.feed(b"data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\r\n\r\n"));
        reader.feed(b"data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":12}}\r\n\r\ndata: {\"type\":\"message_stop\"}\r\n");
        assert!(!reader.done, "the event is complete at its blank line");
        reader.feed(b"\r\n");
        assert!(reader.done);
        assert_eq!(
            reader.usage,
            Some(StreamUsage {
                prompt_tokens: 35,
                cached_tokens: Some(20)
            })
        );
    }
}
