//! HTTP/1.1 framing for both sides of the proxy: request heads (strict, re-framed upstream),
//! the chunked codec, response heads, and the OpenAI-style error responses kvlb sends itself.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

pub mod chunked;
pub mod request;
pub mod response;

use std::sync::OnceLock;

/// Everything kvlb answers itself, each mapped to one status and one message in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpError {
    MalformedRequestLine,
    InvalidTarget,
    UnsupportedScheme,
    InvalidTargetAuthority,
    BadVersion,
    InvalidHeader,
    ObsFold,
    ContentLengthWithTransferEncoding,
    DuplicateContentLength,
    InvalidContentLength,
    TransferEncodingInHttp10,
    ChunkedNotFinal,
    UnsupportedTransferEncoding,
    FramingFieldLookalike,
    InvalidChunkedBody,
    MissingHost,
    DuplicateHost,
    InvalidHost,
    ExpectationFailed,
    HeaderTooLarge,
    BodyTooLarge,
    RequestTimeout,
    NoReplica,
    Overloaded,
    Unauthorized,
    /// 401 for a request whose body was not read (refused on its head): the connection closes.
    UnauthorizedUnread,
    /// Request bodies in flight hold `max_body_memory` (or the worker's share of it).
    BodyMemoryFull,
    QueueFull,
    QueueTimeout,
}

impl HttpError {
    pub const ALL: [HttpError; 29] = [
        HttpError::MalformedRequestLine,
        HttpError::InvalidTarget,
        HttpError::UnsupportedScheme,
        HttpError::InvalidTargetAuthority,
        HttpError::BadVersion,
        HttpError::InvalidHeader,
        HttpError::ObsFold,
        HttpError::ContentLengthWithTransferEncoding,
        HttpError::DuplicateContentLength,
        HttpError::InvalidContentLength,
        HttpError::TransferEncodingInHttp10,
        HttpError::ChunkedNotFinal,
        HttpError::UnsupportedTransferEncoding,
        HttpError::FramingFieldLookalike,
        HttpError::InvalidChunkedBody,
        HttpError::MissingHost,
        HttpError::DuplicateHost,
        HttpError::InvalidHost,
        HttpError::ExpectationFailed,
        HttpError::HeaderTooLarge,
        HttpError::BodyTooLarge,
        HttpError::RequestTimeout,
        HttpError::NoReplica,
        HttpError::Overloaded,
        HttpError::Unauthorized,
        HttpError::UnauthorizedUnread,
        HttpError::BodyMemoryFull,
        HttpError::QueueFull,
        HttpError::QueueTimeout,
    ];

    /// Status code, reason phrase, OpenAI error type and message.
    pub fn parts(self) -> (u16, &'static str, &'static str, &'static str) {
        use HttpError::*;
        match self {
            MalformedRequestLine => (
                400,
                "Bad Request",
                "invalid_request_error",
                "malformed request line",
            ),
            InvalidTarget => (
                400,
                "Bad Request",
                "invalid_request_error",
                "invalid request target: expected a path such as /v1/chat/completions or an http(s) absolute URI",
            ),
            UnsupportedScheme => (
                400,
                "Bad Request",
                "invalid_request_error",
                "unsupported request target scheme: only http:// and https:// absolute URIs are accepted",
            ),
            InvalidTargetAuthority => (
                400,
                "Bad Request",
                "invalid_request_error",
                "invalid host in the absolute request target: expected http(s)://host[:port]/path, without userinfo",
            ),
            BadVersion => (
                400,
                "Bad Request",
                "invalid_request_error",
                "unsupported HTTP version: kvlb speaks HTTP/1.0 and HTTP/1.1",
            ),
            InvalidHeader => (
                400,
                "Bad Request",
                "invalid_request_error",
                "invalid header field",
            ),
            ObsFold => (
                400,
                "Bad Request",
                "invalid_request_error",
                "obsolete line folding in a header field is not allowed",
            ),
            ContentLengthWithTransferEncoding => (
                400,
                "Bad Request",
                "invalid_request_error",
                "Content-Length together with Transfer-Encoding is not allowed",
            ),
            DuplicateContentLength => (
                400,
                "Bad Request",
                "invalid_request_error",
                "more than one Content-Length header",
            ),
            InvalidContentLength => (
                400,
                "Bad Request",
                "invalid_request_error",
                "invalid Content-Length: expected one decimal number",
            ),
            TransferEncodingInHttp10 => (
                400,
                "Bad Request",
                "invalid_request_error",
                "Transfer-Encoding is not allowed in an HTTP/1.0 request",
            ),
            ChunkedNotFinal => (
                400,
                "Bad Request",
                "invalid_request_error",
                "Transfer-Encoding whose final coding is not chunked: the body length cannot be determined",
            ),
            UnsupportedTransferEncoding => (
                501,
                "Not Implemented",
                "invalid_request_error",
                "unsupported Transfer-Encoding: only a single chunked coding is accepted",
            ),
            FramingFieldLookalike => (
                400,
                "Bad Request",
                "invalid_request_error",
                "Content_Length and Transfer_Encoding are not allowed: servers that fold _ into - read them as framing fields",
            ),
            InvalidChunkedBody => (
                400,
                "Bad Request",
                "invalid_request_error",
                "invalid chunked body: bad chunk size or framing",
            ),
            MissingHost => (
                400,
                "Bad Request",
                "invalid_request_error",
                "HTTP/1.1 request without a Host header",
            ),
            DuplicateHost => (
                400,
                "Bad Request",
                "invalid_request_error",
                "more than one Host header",
            ),
            InvalidHost => (
                400,
                "Bad Request",
                "invalid_request_error",
                "invalid Host header: expected host[:port], without userinfo, spaces, commas or a path",
            ),
            ExpectationFailed => (
                417,
                "Expectation Failed",
                "invalid_request_error",
                "only Expect: 100-continue is supported",
            ),
            HeaderTooLarge => (
                431,
                "Request Header Fields Too Large",
                "invalid_request_error",
                "request header section too large",
            ),
            BodyTooLarge => (
                413,
                "Content Too Large",
                "invalid_request_error",
                "request body too large",
            ),
            RequestTimeout => (
                408,
                "Request Timeout",
                "timeout_error",
                "request not received in time",
            ),
            NoReplica => (
                503,
                "Service Unavailable",
                "service_unavailable",
                "no replica available",
            ),
            Overloaded => (
                503,
                "Service Unavailable",
                "service_unavailable",
                "kvlb is at its connection limit",
            ),
            Unauthorized | UnauthorizedUnread => (
                401,
                "Unauthorized",
                "invalid_request_error",
                "missing or invalid API key: send Authorization: Bearer <key> or x-api-key: <key>",
            ),
            BodyMemoryFull => (
                503,
                "Service Unavailable",
                "service_unavailable",
                "kvlb holds as many request bodies as its max_body_memory allows; retry later",
            ),
            QueueFull => (
                429,
                "Too Many Requests",
                "rate_limit_error",
                "every replica is at its concurrency limit and the wait queue is full; retry later",
            ),
            QueueTimeout => (
                429,
                "Too Many Requests",
                "rate_limit_error",
                "every replica stayed at its concurrency limit for the queue timeout; retry later",
            ),
        }
    }

    pub fn status(self) -> u16 {
        self.parts().0
    }

    /// Whether the connection stays open after this error (the request was well-formed and
    /// read whole; only refused).
    pub fn keeps_connection(self) -> bool {
        matches!(
            self,
            HttpError::Unauthorized | HttpError::QueueFull | HttpError::QueueTimeout
        )
    }

    /// The complete response (head and JSON body in OpenAI's shape), built once per process.
    /// Error responses close the connection: after a framing error the byte stream cannot be
    /// trusted.
    pub fn response(self) -> &'static [u8] {
        self.response_in(ErrorShape::OpenAi)
    }

    /// [`HttpError::response`] in the error shape of the request's API.
    pub fn response_in(self, shape: ErrorShape) -> &'static [u8] {
        static TABLES: [OnceLock<Vec<Vec<u8>>>; 2] = [OnceLock::new(), OnceLock::new()];
        let table = TABLES[shape as usize].get_or_init(|| {
            HttpError::ALL
                .iter()
                .map(|e| {
                    let (status, reason, kind, msg) = e.parts();
                    // Refusals of a well-formed request keep the connection; anything else
                    // closes it (after a framing error the byte stream cannot be trusted).
                    let mut r = Vec::with_capacity(256);
                    write_error_in(
                        &mut r,
                        shape,
                        status,
                        reason,
                        kind,
                        msg,
                        None,
                        !e.keeps_connection(),
                    );
                    let extra: &[u8] = match e {
                        HttpError::Unauthorized | HttpError::UnauthorizedUnread => {
                            b"www-authenticate: Bearer\r\n"
                        }
                        HttpError::QueueFull
                        | HttpError::QueueTimeout
                        | HttpError::BodyMemoryFull => b"retry-after: 1\r\n",
                        _ => b"",
                    };
                    let at = r.windows(2).position(|w| w == b"\r\n").map_or(0, |p| p + 2);
                    r.splice(at..at, extra.iter().copied());
                    r
                })
                .collect()
        });
        let idx = HttpError::ALL.iter().position(|e| *e == self).unwrap_or(0);
        &table[idx]
    }
}

/// The shape of the error bodies a client of the request's API expects: OpenAI's
/// `{"error":{"message","type","code"}}`, or on Anthropic's Messages API
/// `{"type":"error","error":{"type","message"}}` (its clients dispatch on `error.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorShape {
    #[default]
    OpenAi = 0,
    Anthropic = 1,
}

impl ErrorShape {
    /// The shape for a request target: Anthropic's under `/v1/messages`, else OpenAI's.
    pub fn of_target(target: &[u8]) -> ErrorShape {
        let path = match find_byte(b'?', target) {
            Some(q) => &target[..q],
            None => target,
        };
        match path.strip_prefix(b"/v1/messages") {
            Some(b"" | [b'/', ..]) => ErrorShape::Anthropic,
            _ => ErrorShape::OpenAi,
        }
    }
}

/// Anthropic's `error.type` for an HTTP status (the vocabulary its clients dispatch on, mapped
/// as vLLM's Messages API maps it).
pub fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// Render an error response. `replica`, when given, is echoed in `x-kvlb-replica`.
pub fn render_error(
    status: u16,
    reason: &str,
    kind: &str,
    message: &str,
    replica: Option<&str>,
    close: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    write_error(&mut out, status, reason, kind, message, replica, close);
    out
}

/// Append an error response to `out` (no allocation once `out` has room).
pub fn write_error(
    out: &mut Vec<u8>,
    status: u16,
    reason: &str,
    kind: &str,
    message: &str,
    replica: Option<&str>,
    close: bool,
) {
    write_error_in(
        out,
        ErrorShape::OpenAi,
        status,
        reason,
        kind,
        message,
        replica,
        close,
    )
}

/// [`write_error`] in `shape`; Anthropic's `error.type` comes from the status (`kind` is
/// OpenAI's).
#[allow(clippy::too_many_arguments)]
pub fn write_error_in(
    out: &mut Vec<u8>,
    shape: ErrorShape,
    status: u16,
    reason: &str,
    kind: &str,
    message: &str,
    replica: Option<&str>,
    close: bool,
) {
    use std::io::Write;
    let body_len = match shape {
        ErrorShape::OpenAi => {
            r#"{"error":{"message":"","type":"","code":}}"#.len()
                + json_escaped_len(message)
                + kind.len()
                + 3
        }
        ErrorShape::Anthropic => {
            r#"{"type":"error","error":{"type":"","message":""}}"#.len()
                + anthropic_error_type(status).len()
                + json_escaped_len(message)
        }
    };
    let _ = write!(
        out,
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {body_len}\r\n"
    );
    if let Some(r) = replica {
        let _ = write!(out, "x-kvlb-replica: {r}\r\n");
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    match shape {
        ErrorShape::OpenAi => {
            out.extend_from_slice(b"\r\n{\"error\":{\"message\":\"");
            json_escape_into(out, message);
            let _ = write!(out, "\",\"type\":\"{kind}\",\"code\":{status}}}}}");
        }
        ErrorShape::Anthropic => {
            out.extend_from_slice(b"\r\n{\"type\":\"error\",\"error\":{\"type\":\"");
            out.extend_from_slice(anthropic_error_type(status).as_bytes());
            out.extend_from_slice(b"\",\"message\":\"");
            json_escape_into(out, message);
            out.extend_from_slice(b"\"}}");
        }
    }
}

/// Append the 404 of a request naming a model no replica serves, in OpenAI's own shape for it
/// (`code` "model_not_found", `param` "model"). Keeps the connection.
pub fn write_model_not_found(out: &mut Vec<u8>, model: &str) {
    write_model_not_found_in(out, ErrorShape::OpenAi, model)
}

/// [`write_model_not_found`] in `shape` (Anthropic's: `not_found_error`, same message).
pub fn write_model_not_found_in(out: &mut Vec<u8>, shape: ErrorShape, model: &str) {
    use std::io::Write;
    let (before, after) = match shape {
        ErrorShape::OpenAi => (
            r#"{"error":{"message":"The model `"#,
            r#"` does not exist.","type":"invalid_request_error","param":"model","code":"model_not_found"}}"#,
        ),
        ErrorShape::Anthropic => (
            r#"{"type":"error","error":{"type":"not_found_error","message":"The model `"#,
            r#"` does not exist."}}"#,
        ),
    };
    let body_len = before.len() + json_escaped_len(model) + after.len();
    let _ = write!(
        out,
        "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {body_len}\r\n\r\n{before}"
    );
    json_escape_into(out, model);
    out.extend_from_slice(after.as_bytes());
}

/// Append a 200 answer of kvlb's own with a JSON `body` (`GET /v1/models`); `head_only` for
/// a HEAD request. Keeps the connection.
pub fn write_json_ok(out: &mut Vec<u8>, body: &[u8], head_only: bool) {
    use std::io::Write;
    let _ = write!(
        out,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    if !head_only {
        out.extend_from_slice(body);
    }
}

/// The header fields kvlb acts on, named once per field by `field` so the framing rules and
/// the rewrite of the head do not compare every name against every known one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    ContentLength,
    TransferEncoding,
    Host,
    Authorization,
    /// Anthropic's API key field, accepted as the client's key.
    XApiKey,
    Connection,
    Expect,
    KeepAlive,
    ProxyConnection,
    Upgrade,
    Te,
    Trailer,
    XForwardedFor,
    ProxyAuthorization,
    ProxyAuthenticate,
    /// The rank of a data-parallel engine a request is for: kvlb picks it, never the client.
    DataParallelRank,
    Other,
}

impl Field {
    /// Hop-by-hop fields (RFC 9110 section 7.6.1) and the proxy-only ones: never forwarded.
    pub fn hop_by_hop(self) -> bool {
        matches!(
            self,
            Field::Connection
                | Field::KeepAlive
                | Field::ProxyConnection
                | Field::Te
                | Field::Upgrade
                | Field::Trailer
                | Field::ProxyAuthorization
                | Field::ProxyAuthenticate
        )
    }
}

/// Which known field `name` is (case-insensitive): one length switch and at most two
/// comparisons, whatever the name.
pub fn field(name: &str) -> Field {
    let n = name.as_bytes();
    let is = |known: &str| n.eq_ignore_ascii_case(known.as_bytes());
    match n.len() {
        2 if is("te") => Field::Te,
        4 if is("host") => Field::Host,
        6 if is("expect") => Field::Expect,
        7 if is("upgrade") => Field::Upgrade,
        7 if is("trailer") => Field::Trailer,
        9 if is("x-api-key") => Field::XApiKey,
        10 if is("connection") => Field::Connection,
        10 if is("keep-alive") => Field::KeepAlive,
        13 if is("authorization") => Field::Authorization,
        14 if is("content-length") => Field::ContentLength,
        15 if is("x-forwarded-for") => Field::XForwardedFor,
        16 if is("proxy-connection") => Field::ProxyConnection,
        17 if is("transfer-encoding") => Field::TransferEncoding,
        18 if is("proxy-authenticate") => Field::ProxyAuthenticate,
        19 if is("proxy-authorization") => Field::ProxyAuthorization,
        20 if is("x-data-parallel-rank") => Field::DataParallelRank,
        _ => Field::Other,
    }
}

/// Where the first byte `needle` of `hay` is (SIMD, for heads and chunk lines).
#[inline]
pub fn find_byte(needle: u8, hay: &[u8]) -> Option<usize> {
    memchr::memchr(needle, hay)
}

/// Append `n` in decimal (what `write!(out, "{n}")` does, without the formatting machinery:
/// this runs for every forwarded request head).
pub fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// Append a client address as `X-Forwarded-For` spells it (IPv4 dotted quad without the
/// formatting machinery; IPv6 through `Display`).
pub fn push_ip(out: &mut Vec<u8>, ip: std::net::IpAddr) {
    match ip {
        std::net::IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                push_decimal(out, octet as u64);
            }
        }
        std::net::IpAddr::V6(_) => {
            use std::io::Write;
            let _ = write!(out, "{ip}");
        }
    }
}

fn json_escaped_len(s: &str) -> usize {
    s.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum()
}

fn json_escape_into(out: &mut Vec<u8>, s: &str) {
    use std::io::Write;
    for b in s.bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0..=0x1f => {
                let _ = write!(out, "\\u{b:04x}");
            }
            _ => out.push(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_names_every_known_field_in_any_case_and_nothing_else() {
        let known = [
            ("content-length", Field::ContentLength),
            ("transfer-encoding", Field::TransferEncoding),
            ("host", Field::Host),
            ("authorization", Field::Authorization),
            ("connection", Field::Connection),
            ("expect", Field::Expect),
            ("keep-alive", Field::KeepAlive),
            ("proxy-connection", Field::ProxyConnection),
            ("upgrade", Field::Upgrade),
            ("te", Field::Te),
            ("trailer", Field::Trailer),
            ("x-forwarded-for", Field::XForwardedFor),
            ("proxy-authorization", Field::ProxyAuthorization),
            ("proxy-authenticate", Field::ProxyAuthenticate),
            ("x-data-parallel-rank", Field::DataParallelRank),
        ];
        for (name, f) in known {
            assert_eq!(field(name), f, "{name}");
            assert_eq!(field(&name.to_ascii_uppercase()), f, "{name}");
            // One byte off, or a byte more or less, is another field.
            let mut off = name.as_bytes().to_vec();
            off[0] ^= 1;
            assert_eq!(field(std::str::from_utf8(&off).unwrap()), Field::Other);
            assert_eq!(field(&name[1..]), Field::Other, "{name}");
            assert_eq!(field(&format!("{name}s")), Field::Other, "{name}");
        }
        for other in ["", "content-type", "accept", "x-request-id", "tes", "hosts"] {
            assert_eq!(field(other), Field::Other, "{other}");
        }
        let hop: Vec<_> = known
            .iter()
            .filter(|(_, f)| f.hop_by_hop())
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(
            hop,
            [
                "connection",
                "keep-alive",
                "proxy-connection",
                "upgrade",
                "te",
                "trailer",
                "proxy-authorization",
                "proxy-authenticate"
            ]
        );
    }

    #[test]
    fn decimal_and_ip_match_display() {
        for n in [
            0u64,
            1,
            9,
            10,
            99,
            100,
            2048,
            65_535,
            u32::MAX as u64,
            u64::MAX,
        ] {
            let mut out = Vec::new();
            push_decimal(&mut out, n);
            assert_eq!(out, n.to_string().into_bytes());
        }
        for ip in [
            "0.0.0.0",
            "127.0.0.1",
            "10.1.2.3",
            "255.255.255.255",
            "::1",
            "2001:db8::7",
        ] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            let mut out = Vec::new();
            push_ip(&mut out, ip);
            assert_eq!(out, ip.to_string().into_bytes());
        }
    }

    #[test]
    fn error_responses_are_valid_json_with_right_length() {
        for e in HttpError::ALL {
            let r = e.response();
            let text = std::str::from_utf8(r).unwrap();
            let (head, body) = text.split_once("\r\n\r\n").unwrap();
            assert!(head.starts_with(&format!("HTTP/1.1 {} ", e.status())));
            let cl: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(cl, body.len(), "{e:?}");
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(v["error"]["message"], e.parts().3);
            assert_eq!(v["error"]["type"], e.parts().2);
            // The same answer in Anthropic's shape for the Messages API.
            let r = std::str::from_utf8(e.response_in(ErrorShape::Anthropic)).unwrap();
            let (a_head, a_body) = r.split_once("\r\n\r\n").unwrap();
            assert_eq!(a_head.lines().count(), head.lines().count(), "{e:?}");
            assert!(
                a_head.contains(&format!("content-length: {}\r", a_body.len()))
                    || a_head.ends_with(&format!("content-length: {}", a_body.len()))
            );
            let v: serde_json::Value = serde_json::from_str(a_body).unwrap();
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["message"], e.parts().3);
            assert_eq!(v["error"]["type"], anthropic_error_type(e.status()));
        }
        let mut out = Vec::new();
        write_model_not_found_in(&mut out, ErrorShape::Anthropic, "a\"b");
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.ends_with(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "not_found_error");
        assert_eq!(v["error"]["message"], "The model `a\"b` does not exist.");
        assert_eq!(
            ErrorShape::of_target(b"/v1/messages"),
            ErrorShape::Anthropic
        );
        assert_eq!(
            ErrorShape::of_target(b"/v1/messages?beta=true"),
            ErrorShape::Anthropic
        );
        assert_eq!(
            ErrorShape::of_target(b"/v1/messages/count_tokens"),
            ErrorShape::Anthropic
        );
        assert_eq!(ErrorShape::of_target(b"/v1/messagesx"), ErrorShape::OpenAi);
        assert_eq!(ErrorShape::of_target(b"/v1/responses"), ErrorShape::OpenAi);
    }

    #[test]
    fn model_not_found_is_openais_404() {
        let mut out = Vec::new();
        write_model_not_found(&mut out, "gpt\"x");
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 404 Not Found\r\n"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["message"], "The model `gpt\"x` does not exist.");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], "model_not_found");
    }

    #[test]
    fn escapes_messages() {
        let r = render_error(
            502,
            "Bad Gateway",
            "upstream_error",
            "a \"q\"\n\u{1}",
            Some("http://x"),
            false,
        );
        let text = String::from_utf8(r).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("x-kvlb-replica: http://x"));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["message"], "a \"q\"\n\u{1}");
        let cl: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(cl, body.len());
    }
}
