//! Request heads: parse with httparse, apply RFC 9112's framing rules strictly (the defences
//! against request smuggling), and write the head kvlb sends upstream in the same pass.
//!
//! Requests are always re-framed upstream with a Content-Length (chunked bodies are decoded
//! by kvlb), so a replica never has to agree with kvlb on how a body was delimited. Likewise
//! for what was asked: an absolute-form target (`GET http://host/path`) goes upstream in
//! origin-form with the target's authority as Host (RFC 9112 section 3.2.2), so kvlb routes on
//! the same path the replica serves.

#![forbid(unsafe_code)]

use super::{field, find_byte, Field, HttpError};
use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv6Addr};

/// Most header fields accepted in a request (more is a 431).
pub const MAX_HEADERS: usize = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Head,
    Post,
    Put,
    Delete,
    Options,
    Patch,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    None,
    Length(u64),
    Chunked,
}

/// What the proxy needs to know about a parsed request head.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead {
    /// Bytes of the head, through the empty line.
    pub head_len: usize,
    pub method: Method,
    /// Byte range of the request target in origin-form (path and query) in the buffer: for an
    /// absolute-form target, the path part inside it (`http://host` alone is the `/` of `://`,
    /// without the query), or `*` for `OPTIONS *`.
    pub target: (usize, usize),
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    pub body: BodyFraming,
    /// The client wants the connection kept open after this exchange.
    pub keep_alive: bool,
    /// `Expect: 100-continue` was sent.
    pub expect_continue: bool,
    /// The upstream head has a Host: the client's, or the authority of an absolute-form
    /// target (HTTP/1.0 clients may send neither; the caller adds one).
    pub has_host: bool,
    /// Byte range of the credentials of `Authorization: Bearer <credentials>`, else of the
    /// value of `x-api-key` (Anthropic's clients); empty when neither is sent.
    pub bearer: (usize, usize),
}

fn method_of(m: &str) -> Method {
    match m {
        "GET" => Method::Get,
        "HEAD" => Method::Head,
        "POST" => Method::Post,
        "PUT" => Method::Put,
        "DELETE" => Method::Delete,
        "OPTIONS" => Method::Options,
        "PATCH" => Method::Patch,
        _ => Method::Other,
    }
}

/// Header fields never forwarded (RFC 9110 section 7.6.1), plus the framing fields kvlb
/// rewrites itself, `Expect` (kvlb answers 100-continue itself and sends whole bodies) and a
/// client's `X-Data-Parallel-Rank` (the rank of a data-parallel engine is kvlb's choice, made
/// with that rank's queue and cache; a client's would run the request where kvlb does not
/// count it).
fn not_forwarded(f: Field) -> bool {
    f.hop_by_hop()
        || matches!(
            f,
            Field::TransferEncoding
                | Field::ContentLength
                | Field::Expect
                | Field::DataParallelRank
        )
}

/// Trim optional whitespace (SP / HTAB) at both ends.
fn trim_ows(v: &[u8]) -> &[u8] {
    let mut s = 0;
    let mut e = v.len();
    while s < e && (v[s] == b' ' || v[s] == b'\t') {
        s += 1;
    }
    while e > s && (v[e - 1] == b' ' || v[e - 1] == b'\t') {
        e -= 1;
    }
    &v[s..e]
}

pub(super) fn parse_content_length(v: &[u8]) -> Result<u64, HttpError> {
    let v = trim_ows(v);
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return Err(HttpError::InvalidContentLength);
    }
    let mut n: u64 = 0;
    for d in v {
        n = n * 10 + (d - b'0') as u64;
    }
    Ok(n)
}

/// Does a comma-separated header value contain `token` (case-insensitive)?
pub fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|b| *b == b',')
        .any(|t| trim_ows(t).eq_ignore_ascii_case(token.as_bytes()))
}

/// Is `name` Content-Length or Transfer-Encoding spelt with underscores for some of its dashes
/// (`Content_Length`)? Servers that map field names to variables (CGI and WSGI style) fold
/// `_` and `-` together and would take it for the framing field kvlb did not frame by.
fn framing_lookalike(name: &str) -> bool {
    let n = name.as_bytes();
    let folded = |known: &[u8]| {
        n.len() == known.len()
            && n.iter()
                .zip(known)
                .all(|(&a, &k)| a.eq_ignore_ascii_case(&k) || (a == b'_' && k == b'-'))
    };
    matches!(n.len(), 14 | 17)
        && find_byte(b'_', n).is_some()
        && (folded(b"content-length") || folded(b"transfer-encoding"))
}

/// Does the head in `buf` fold a header line (a line starting with SP or HTAB)?
fn has_obs_fold(head: &[u8]) -> bool {
    memchr::memchr_iter(b'\n', head).any(|nl| matches!(head.get(nl + 1), Some(b' ' | b'\t')))
}

/// Is `v` a valid `Host` value or absolute-URI authority, `uri-host [ ":" port ]` (RFC 9110
/// section 7.2, RFC 3986 section 3.2)? The host is a bracketed IPv6 address or a non-empty
/// reg-name (which covers IPv4 addresses); the port, when the colon is there, 1 to 5 digits up
/// to 65535. Refused although RFC 3986 allows them: an empty host, an empty port, IPvFuture and
/// zone identifiers in brackets, and a comma in a reg-name (no DNS name has one, and some read
/// `Host: a,b` as a list of two). Userinfo (`user@`) is no part of a Host value, and `@` is
/// not a reg-name byte, so it is refused as well.
pub fn valid_host(v: &[u8]) -> bool {
    let (host_ok, port) = if let Some(rest) = v.strip_prefix(b"[") {
        let Some(close) = find_byte(b']', rest) else {
            return false;
        };
        let ip = std::str::from_utf8(&rest[..close])
            .ok()
            .and_then(|s| s.parse::<Ipv6Addr>().ok());
        let port = match &rest[close + 1..] {
            [] => None,
            [b':', port @ ..] => Some(port),
            _ => return false,
        };
        (ip.is_some(), port)
    } else {
        let (host, port) = match find_byte(b':', v) {
            Some(i) => (&v[..i], Some(&v[i + 1..])),
            None => (v, None),
        };
        (valid_reg_name(host), port)
    };
    host_ok && port.is_none_or(valid_port)
}

/// `reg-name = 1*( unreserved / pct-encoded / sub-delims )`, without the comma.
fn valid_reg_name(v: &[u8]) -> bool {
    let mut i = 0;
    while i < v.len() {
        match v[i] {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {}
            b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b';' | b'=' => {}
            b'%' if v.len() > i + 2
                && v[i + 1].is_ascii_hexdigit()
                && v[i + 2].is_ascii_hexdigit() =>
            {
                i += 2;
            }
            _ => return false,
        }
        i += 1;
    }
    !v.is_empty()
}

fn valid_port(v: &[u8]) -> bool {
    (1..=5).contains(&v.len())
        && v.iter().all(u8::is_ascii_digit)
        && v.iter().fold(0u32, |n, d| n * 10 + (d - b'0') as u32) <= 65_535
}

/// The parts of an absolute-form target `http[s]://authority[path][?query]`.
struct Absolute<'a> {
    authority: &'a [u8],
    /// Where the authority starts in the target (after `://`).
    authority_at: usize,
    /// Where the path and query start in the target (its length when there is neither).
    rest: usize,
}

/// Classify a request target that is not origin-form (RFC 9112 section 3.2): `*` for OPTIONS,
/// or an absolute http(s) URI. Authority-form and anything else is refused.
fn absolute_target<'a>(target: &'a [u8], method: &str) -> Result<Option<Absolute<'a>>, HttpError> {
    if target == b"*" {
        return match method {
            "OPTIONS" => Ok(None),
            _ => Err(HttpError::InvalidTarget),
        };
    }
    // scheme = ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ), then "://" (an http(s) URI always
    // has an authority).
    let scheme_len = target
        .iter()
        .position(|&b| !(b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.')))
        .unwrap_or(target.len());
    if scheme_len == 0
        || !target[0].is_ascii_alphabetic()
        || !target[scheme_len..].starts_with(b"://")
    {
        return Err(HttpError::InvalidTarget);
    }
    let scheme = &target[..scheme_len];
    if !(scheme.eq_ignore_ascii_case(b"http") || scheme.eq_ignore_ascii_case(b"https")) {
        return Err(HttpError::UnsupportedScheme);
    }
    let start = scheme_len + 3;
    let end = target[start..]
        .iter()
        .position(|&b| matches!(b, b'/' | b'?'))
        .map_or(target.len(), |p| start + p);
    let authority = &target[start..end];
    if !valid_host(authority) {
        return Err(HttpError::InvalidTargetAuthority);
    }
    Ok(Some(Absolute {
        authority,
        authority_at: start,
        rest: end,
    }))
}

/// Where the head ends (index after the empty line), if it is complete.
pub fn find_head_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(p) = find_byte(b'\n', &buf[i..]) {
        let nl = i + p;
        // "\n\n" or "\n\r\n"
        if nl + 1 < buf.len() && buf[nl + 1] == b'\n' {
            return Some(nl + 2);
        }
        if nl + 2 < buf.len() && buf[nl + 1] == b'\r' && buf[nl + 2] == b'\n' {
            return Some(nl + 3);
        }
        i = nl + 1;
    }
    None
}

/// Parse a complete request head (`buf[..head_end]`, as found by `find_head_end`) and write the
/// upstream head into `out` without its final CRLF: the caller appends Content-Length (if a body
/// goes upstream) and the empty line with `finish_upstream_head`.
pub fn parse_request(
    buf: &[u8],
    head_end: usize,
    client_ip: Option<IpAddr>,
    out: &mut Vec<u8>,
) -> Result<RequestHead, HttpError> {
    let head_bytes = &buf[..head_end];
    // Not initialised: httparse writes the fields it parses (100 of them would be 3 KiB to
    // clear on every request).
    let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let status = match req.parse_with_uninit_headers(head_bytes, &mut headers) {
        Ok(s) => s,
        // httparse rejects a folded line (it cannot start a field name): say which rule it broke.
        Err(_) if has_obs_fold(head_bytes) => return Err(HttpError::ObsFold),
        Err(httparse::Error::TooManyHeaders) => return Err(HttpError::HeaderTooLarge),
        Err(httparse::Error::Version) => return Err(HttpError::BadVersion),
        Err(httparse::Error::HeaderName) | Err(httparse::Error::HeaderValue) => {
            return Err(HttpError::InvalidHeader)
        }
        Err(_) => return Err(HttpError::MalformedRequestLine),
    };
    let head_len = match status {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => return Err(HttpError::MalformedRequestLine),
    };
    let method_str = req.method.unwrap_or("");
    let path = req.path.unwrap_or("");
    let minor_version = req.version.unwrap_or(1);
    // A fragment is no part of a request target (RFC 9112 section 3.2): a `#` would leave
    // kvlb and the replica to guess where the path ends.
    if path.is_empty() || find_byte(b'#', path.as_bytes()).is_some() {
        return Err(HttpError::InvalidTarget);
    }
    let absolute = match path.starts_with('/') {
        true => None,
        false => absolute_target(path.as_bytes(), method_str)?,
    };
    let path_at = path.as_ptr() as usize - buf.as_ptr() as usize;
    // The origin-form target sent upstream, whether a `/` goes before it (an absolute-form
    // target with an empty path), and the range of the buffer kvlb routes and logs on.
    let (origin, slash, target) = match &absolute {
        None => (path.as_bytes(), false, (path_at, path_at + path.len())),
        Some(a) => {
            let rest = &path.as_bytes()[a.rest..];
            match rest.first() {
                Some(b'/') => (rest, false, (path_at + a.rest, path_at + path.len())),
                // `http://host` or `http://host?q`: kvlb sees the `/` of `://`.
                _ => {
                    let slash_at = path_at + a.authority_at - 1;
                    (rest, true, (slash_at, slash_at + 1))
                }
            }
        }
    };
    let method = method_of(method_str);

    let mut content_length: Option<u64> = None;
    // Transfer-Encoding fields, the codings they list (all fields make one list, RFC 9110
    // section 5.3) and the last of them.
    let mut te_fields = 0;
    let mut te_codings = 0;
    let mut te_final: &[u8] = &[];
    let mut host_count = 0;
    let mut conn_close = false;
    let mut conn_keep_alive = false;
    let mut expect_continue = false;
    let mut bearer: &[u8] = &[];
    // Anthropic's clients send their key as `x-api-key`.
    let mut api_key: &[u8] = &[];
    // Names listed in Connection are hop-by-hop too (up to 16 of them).
    let mut conn_named: [&[u8]; 16] = [&[]; 16];
    let mut n_named = 0;

    // Each field named once, for both passes.
    let mut kinds = [Field::Other; MAX_HEADERS];
    for (h, kind) in req.headers.iter().zip(kinds.iter_mut()) {
        *kind = field(h.name);
        if *kind == Field::ContentLength {
            if content_length.is_some() {
                return Err(HttpError::DuplicateContentLength);
            }
            content_length = Some(parse_content_length(h.value)?);
        } else if *kind == Field::TransferEncoding {
            te_fields += 1;
            for coding in h.value.split(|b| *b == b',') {
                te_codings += 1;
                te_final = trim_ows(coding);
            }
        } else if *kind == Field::Other && framing_lookalike(h.name) {
            return Err(HttpError::FramingFieldLookalike);
        } else if *kind == Field::Host {
            // Checked even when an absolute-form target's authority replaces it: a request
            // with an invalid Host is refused whatever its target (RFC 9112 section 3.2).
            if !valid_host(trim_ows(h.value)) {
                return Err(HttpError::InvalidHost);
            }
            host_count += 1;
        } else if *kind == Field::Authorization {
            let v = trim_ows(h.value);
            if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
                bearer = trim_ows(&v[7..]);
            }
        } else if *kind == Field::XApiKey {
            api_key = trim_ows(h.value);
        } else if *kind == Field::Connection {
            for t in h.value.split(|b| *b == b',') {
                let t = trim_ows(t);
                if t.eq_ignore_ascii_case(b"close") {
                    conn_close = true;
                } else if t.eq_ignore_ascii_case(b"keep-alive") {
                    conn_keep_alive = true;
                } else if !t.is_empty()
                    && !t.eq_ignore_ascii_case(b"host")
                    && n_named < conn_named.len()
                {
                    // Host is end to end: a client naming it in Connection must not strip it
                    // from the request the replica receives (which would then be invalid).
                    conn_named[n_named] = t;
                    n_named += 1;
                }
            }
        } else if *kind == Field::Expect {
            if trim_ows(h.value).eq_ignore_ascii_case(b"100-continue") {
                expect_continue = true;
            } else {
                return Err(HttpError::ExpectationFailed);
            }
        }
    }
    let te_seen = te_fields > 0;
    if te_seen && content_length.is_some() {
        return Err(HttpError::ContentLengthWithTransferEncoding);
    }
    if te_seen && minor_version == 0 {
        return Err(HttpError::TransferEncodingInHttp10);
    }
    // RFC 9112 section 6.3: without chunked as the final coding the body's length cannot be
    // known (400); chunked after other codings, or twice, is a list kvlb does not decode (501).
    if te_seen && !te_final.eq_ignore_ascii_case(b"chunked") {
        return Err(HttpError::ChunkedNotFinal);
    }
    if te_codings > 1 {
        return Err(HttpError::UnsupportedTransferEncoding);
    }
    let chunked = te_seen;
    if host_count > 1 {
        return Err(HttpError::DuplicateHost);
    }
    if host_count == 0 && minor_version == 1 {
        return Err(HttpError::MissingHost);
    }
    let body = if chunked {
        BodyFraming::Chunked
    } else {
        match content_length {
            Some(0) | None => BodyFraming::None,
            Some(n) => BodyFraming::Length(n),
        }
    };
    let keep_alive = if minor_version == 1 {
        !conn_close
    } else {
        conn_keep_alive && !conn_close
    };

    // The upstream head.
    out.clear();
    out.extend_from_slice(method_str.as_bytes());
    out.push(b' ');
    if slash {
        out.push(b'/');
    }
    out.extend_from_slice(origin);
    out.extend_from_slice(b" HTTP/1.1\r\n");
    // An absolute-form target names the host: the client's Host fields give way to it.
    if let Some(a) = &absolute {
        out.extend_from_slice(b"host: ");
        out.extend_from_slice(a.authority);
        out.extend_from_slice(b"\r\n");
    }
    let mut xff_written = false;
    for (h, &kind) in req.headers.iter().zip(kinds.iter()) {
        let name = h.name;
        if not_forwarded(kind)
            || (kind == Field::Host && absolute.is_some())
            || conn_named[..n_named]
                .iter()
                .any(|n| n.eq_ignore_ascii_case(name.as_bytes()))
        {
            continue;
        }
        if kind == Field::XForwardedFor {
            if xff_written {
                continue;
            }
            // Join every X-Forwarded-For field in order, then append the client.
            xff_written = true;
            out.extend_from_slice(b"x-forwarded-for: ");
            let mut first = true;
            for (x, _) in req
                .headers
                .iter()
                .zip(kinds.iter())
                .filter(|(_, k)| **k == Field::XForwardedFor)
            {
                let v = trim_ows(x.value);
                if v.is_empty() {
                    continue;
                }
                if !first {
                    out.extend_from_slice(b", ");
                }
                out.extend_from_slice(v);
                first = false;
            }
            if let Some(ip) = client_ip {
                if !first {
                    out.extend_from_slice(b", ");
                }
                super::push_ip(out, ip);
            }
            out.extend_from_slice(b"\r\n");
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    if !xff_written {
        if let Some(ip) = client_ip {
            out.extend_from_slice(b"x-forwarded-for: ");
            super::push_ip(out, ip);
            out.extend_from_slice(b"\r\n");
        }
    }

    if bearer.is_empty() {
        bearer = api_key;
    }
    let bearer_start = if bearer.is_empty() {
        0
    } else {
        bearer.as_ptr() as usize - buf.as_ptr() as usize
    };
    Ok(RequestHead {
        bearer: (bearer_start, bearer_start + bearer.len()),
        head_len,
        method,
        target,
        minor_version,
        body,
        keep_alive,
        expect_continue,
        has_host: host_count == 1 || absolute.is_some(),
    })
}

/// Append Content-Length (when a body goes upstream) and the empty line.
/// The header that sends a request to one rank of a data-parallel engine (vLLM and SGLang
/// read it case-insensitively), written into the upstream head in place.
pub fn push_dp_rank(out: &mut Vec<u8>, rank: u32) {
    out.extend_from_slice(b"x-data-parallel-rank: ");
    super::push_decimal(out, u64::from(rank));
    out.extend_from_slice(b"\r\n");
}

pub fn finish_upstream_head(out: &mut Vec<u8>, method: Method, body_len: usize) {
    if body_len > 0 || matches!(method, Method::Post | Method::Put | Method::Patch) {
        out.extend_from_slice(b"content-length: ");
        super::push_decimal(out, body_len as u64);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &[u8]) -> Result<(RequestHead, String), HttpError> {
        let end = find_head_end(raw).expect("complete head");
        let mut out = Vec::new();
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        parse_request(raw, end, Some(ip), &mut out).map(|h| (h, String::from_utf8(out).unwrap()))
    }

    #[test]
    fn host_named_in_connection_is_still_forwarded() {
        // Found by fuzzing (fuzz/regressions/http_request/connection_names_host).
        let (h, up) = parse(
            b"GET /p HTTP/1.1\r\nHost: a\r\nConnection: close, Host, x-hop\r\nx-hop: 1\r\n\r\n",
        )
        .unwrap();
        assert!(h.has_host);
        assert!(up.contains("\r\nHost: a\r\n"), "{up}");
        assert!(!up.contains("x-hop"), "{up}");
    }

    #[test]
    fn simple_post_with_length() {
        let (h, up) = parse(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\nConnection: keep-alive\r\n\r\n").unwrap();
        assert_eq!(h.body, BodyFraming::Length(12));
        assert!(h.keep_alive);
        assert!(up.starts_with("POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n"));
        assert!(!up.to_ascii_lowercase().contains("content-length"));
        assert!(!up.to_ascii_lowercase().contains("connection"));
        assert!(up.contains("x-forwarded-for: 10.1.2.3\r\n"));
    }

    #[test]
    fn smuggling_cases_are_rejected() {
        let cases: &[(&[u8], HttpError)] = &[
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", HttpError::ContentLengthWithTransferEncoding),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", HttpError::DuplicateContentLength),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", HttpError::DuplicateContentLength),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1,2\r\n\r\n", HttpError::InvalidContentLength),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n", HttpError::InvalidContentLength),
            (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n", HttpError::InvalidContentLength),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", HttpError::ChunkedNotFinal),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n", HttpError::ChunkedNotFinal),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n", HttpError::ChunkedNotFinal),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked,\r\n\r\n", HttpError::ChunkedNotFinal),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \r\n\r\n", HttpError::ChunkedNotFinal),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", HttpError::UnsupportedTransferEncoding),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", HttpError::UnsupportedTransferEncoding),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\nContent-Length: 5\r\n\r\n", HttpError::ContentLengthWithTransferEncoding),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer_Encoding: chunked\r\n\r\n", HttpError::FramingFieldLookalike),
            (b"POST / HTTP/1.1\r\nHost: a\r\ncontent_length: 5\r\n\r\n", HttpError::FramingFieldLookalike),
            (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", HttpError::UnsupportedTransferEncoding),
            (b"POST / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n", HttpError::ObsFold),
            (b"GET / HTTP/9.9\r\nHost: a\r\n\r\n", HttpError::BadVersion),
            (b"GET\r\nHost: a\r\n\r\n", HttpError::MalformedRequestLine),
            (b"GET / HTTP/1.1\r\n\r\n", HttpError::MissingHost),
            (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", HttpError::DuplicateHost),
            (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", HttpError::TransferEncodingInHttp10),
            (b"GET foo HTTP/1.1\r\nHost: a\r\n\r\n", HttpError::InvalidTarget),
        ];
        for (raw, want) in cases {
            match parse(raw) {
                Err(e) => assert_eq!(e, *want, "{}", String::from_utf8_lossy(raw)),
                Ok(_) => panic!("accepted {}", String::from_utf8_lossy(raw)),
            }
        }
    }

    #[test]
    fn host_grammar() {
        for ok in [
            "a",
            "kvlb.test",
            "KVLB.Test.",
            "kvlb.test:8080",
            "a:0",
            "a:65535",
            "a:00080",
            "127.0.0.1",
            "127.0.0.1:80",
            "[::1]",
            "[::1]:8000",
            "[2001:db8::7]",
            "[::ffff:10.1.2.3]:443",
            "xn--bcher-kva.example",
            "a-b_c~d",
            "a%20b",
            "a!$&'()*+;=b",
        ] {
            assert!(valid_host(ok.as_bytes()), "refused {ok:?}");
        }
        for bad in [
            "",
            "a b/c@d",
            "a, b",
            "a,b",
            "user@a",
            "user:pw@a",
            "@a",
            "a:",
            ":80",
            "a:99999",
            "a:65536",
            "a:123456",
            "a:8x",
            "a: 80",
            "a:+80",
            "a:1:2",
            "::1",
            "[::1",
            "[::1]x",
            "[::1]:",
            "[::1]:99999",
            "[]",
            "[a]",
            "[v1.x]",
            "[fe80::1%25eth0]",
            "[::1]]",
            "a/b",
            "a?b",
            "a#b",
            "a\\b",
            "a\"b",
            "a<b>",
            "a%2",
            "a%zz",
            "a\tb",
            "a\x01b",
            "a\x7fb",
            "a\u{e9}b",
        ] {
            assert!(!valid_host(bad.as_bytes()), "accepted {bad:?}");
        }
    }

    #[test]
    fn host_values_are_checked_for_every_request() {
        for host in ["a b/c@d", "a, b", "u@a", "a:99999", "a:", "", "[::1"] {
            let raw = format!("GET /p HTTP/1.1\r\nHost: {host}\r\n\r\n");
            assert_eq!(
                parse(raw.as_bytes()).map(|_| ()),
                Err(HttpError::InvalidHost),
                "{raw}"
            );
            // HTTP/1.0 may leave Host out, not send an invalid one; nor does an absolute-form
            // target's authority make the received one acceptable.
            for line in ["GET /p HTTP/1.0", "GET http://b/p HTTP/1.1"] {
                let raw = format!("{line}\r\nHost: {host}\r\n\r\n");
                assert_eq!(
                    parse(raw.as_bytes()).map(|_| ()),
                    Err(HttpError::InvalidHost),
                    "{raw}"
                );
            }
        }
        // Optional whitespace around the value is no part of it.
        let (h, up) = parse(b"GET /p HTTP/1.1\r\nHost: \t kvlb.test:80 \t\r\n\r\n").unwrap();
        assert!(h.has_host);
        assert!(up.contains("\r\nHost: kvlb.test:80"), "{up}");
    }

    /// The upstream head and the target kvlb sees, for a request line and its headers.
    fn rewritten(line: &str, headers: &str) -> Result<(String, String), HttpError> {
        let raw = format!("{line}\r\n{headers}\r\n");
        parse(raw.as_bytes()).map(|(h, up)| {
            assert!(h.has_host, "{raw}");
            (raw[h.target.0..h.target.1].to_string(), up)
        })
    }

    #[test]
    fn absolute_form_goes_upstream_in_origin_form_with_the_target_host() {
        let cases = [
            (
                "GET http://other.example/v1/models?x=1 HTTP/1.1",
                "/v1/models?x=1",
                "GET /v1/models?x=1 HTTP/1.1\r\nhost: other.example\r\nX-A: 1\r\n",
            ),
            (
                "POST HTTPS://Other.Example:8443/v1/chat/completions HTTP/1.1",
                "/v1/chat/completions",
                "POST /v1/chat/completions HTTP/1.1\r\nhost: Other.Example:8443\r\nX-A: 1\r\n",
            ),
            (
                "GET hTTp://[::1]:8000 HTTP/1.1",
                "/",
                "GET / HTTP/1.1\r\nhost: [::1]:8000\r\nX-A: 1\r\n",
            ),
            (
                "GET http://a?x=/y HTTP/1.1",
                "/",
                "GET /?x=/y HTTP/1.1\r\nhost: a\r\nX-A: 1\r\n",
            ),
            (
                "OPTIONS http://a:80 HTTP/1.1",
                "/",
                "OPTIONS / HTTP/1.1\r\nhost: a:80\r\nX-A: 1\r\n",
            ),
        ];
        for (line, target, head) in cases {
            // The client's Host (one, two cased differently) gives way to the authority.
            let (t, up) = rewritten(line, "Host: kvlb.test\r\nX-A: 1\r\n").unwrap();
            assert_eq!(t, target, "{line}");
            assert!(up.starts_with(head), "{line}: {up}");
            assert_eq!(up.to_ascii_lowercase().matches("host:").count(), 1, "{up}");
            assert!(!up.contains("kvlb.test"), "{up}");
        }
        // HTTP/1.0 may leave Host out: the authority is sent.
        let (t, up) = rewritten("GET http://other.example:8080/echo HTTP/1.0", "").unwrap();
        assert_eq!(t, "/echo");
        assert!(up.starts_with("GET /echo HTTP/1.1\r\nhost: other.example:8080\r\n"));
        // An HTTP/1.1 request still needs one Host.
        assert_eq!(
            rewritten("GET http://a/ HTTP/1.1", "").map(|_| ()),
            Err(HttpError::MissingHost)
        );
        assert_eq!(
            rewritten("GET http://a/ HTTP/1.1", "Host: a\r\nHost: a\r\n").map(|_| ()),
            Err(HttpError::DuplicateHost)
        );
    }

    #[test]
    fn request_target_forms() {
        let cases: &[(&str, HttpError)] = &[
            ("GET ftp://x/ HTTP/1.1", HttpError::UnsupportedScheme),
            ("GET httpx://x/ HTTP/1.1", HttpError::UnsupportedScheme),
            ("GET ws://x/ HTTP/1.1", HttpError::UnsupportedScheme),
            ("GET http:/x HTTP/1.1", HttpError::InvalidTarget),
            ("GET http:x HTTP/1.1", HttpError::InvalidTarget),
            ("GET 1http://x/ HTTP/1.1", HttpError::InvalidTarget),
            ("GET ://x/ HTTP/1.1", HttpError::InvalidTarget),
            ("GET other.example:80 HTTP/1.1", HttpError::InvalidTarget),
            (
                "CONNECT other.example:443 HTTP/1.1",
                HttpError::InvalidTarget,
            ),
            ("GET * HTTP/1.1", HttpError::InvalidTarget),
            ("POST * HTTP/1.1", HttpError::InvalidTarget),
            ("GET *x HTTP/1.1", HttpError::InvalidTarget),
            ("GET http://a/#f HTTP/1.1", HttpError::InvalidTarget),
            ("GET http://a#f HTTP/1.1", HttpError::InvalidTarget),
            ("GET /v1/models#f HTTP/1.1", HttpError::InvalidTarget),
            ("GET http:/// HTTP/1.1", HttpError::InvalidTargetAuthority),
            ("GET http:// HTTP/1.1", HttpError::InvalidTargetAuthority),
            (
                "GET http://u@a/ HTTP/1.1",
                HttpError::InvalidTargetAuthority,
            ),
            (
                "GET http://u:p@a/ HTTP/1.1",
                HttpError::InvalidTargetAuthority,
            ),
            (
                "GET http://a:99999/ HTTP/1.1",
                HttpError::InvalidTargetAuthority,
            ),
            ("GET http://a:/ HTTP/1.1", HttpError::InvalidTargetAuthority),
            (
                "GET http://a,b/ HTTP/1.1",
                HttpError::InvalidTargetAuthority,
            ),
            (
                "GET http://[::1/ HTTP/1.1",
                HttpError::InvalidTargetAuthority,
            ),
            (
                "GET http://a\\b/ HTTP/1.1",
                HttpError::InvalidTargetAuthority,
            ),
        ];
        for (line, want) in cases {
            assert_eq!(
                rewritten(line, "Host: a\r\n").map(|_| ()),
                Err(*want),
                "{line}"
            );
        }
        let (t, up) = rewritten("OPTIONS * HTTP/1.1", "Host: a\r\n").unwrap();
        assert_eq!(t, "*");
        assert!(up.starts_with("OPTIONS * HTTP/1.1\r\nHost: a\r\n"), "{up}");
    }

    #[test]
    fn underscored_names_other_than_the_framing_fields_are_forwarded() {
        let (_, up) = parse(
            b"GET / HTTP/1.1\r\nHost: a\r\nContent_Type: x\r\nContent-Length_: 1\r\nX_Transfer_Encoding: y\r\n\r\n",
        )
        .unwrap();
        for f in [
            "Content_Type: x",
            "Content-Length_: 1",
            "X_Transfer_Encoding: y",
        ] {
            assert!(up.contains(f), "{f} not forwarded: {up}");
        }
    }

    #[test]
    fn a_clients_data_parallel_rank_is_dropped() {
        let (_, up) = parse(
            b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nX-Data-Parallel-Rank: 3\r\n\
              Content-Length: 0\r\n\r\n",
        )
        .unwrap();
        let up = up.to_ascii_lowercase();
        assert!(!up.contains("data-parallel"), "{up}");
        assert!(up.contains("host: a"), "{up}");
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_dropped() {
        let (h, up) = parse(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close, X-Secret\r\nX-Secret: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\nUpgrade: h2c\r\nProxy-Connection: x\r\nX-Ok: yes\r\n\r\n").unwrap();
        assert!(!h.keep_alive);
        let low = up.to_ascii_lowercase();
        for gone in [
            "x-secret",
            "keep-alive",
            "te:",
            "upgrade",
            "proxy-connection",
            "connection",
        ] {
            assert!(!low.contains(gone), "{gone} forwarded: {up}");
        }
        assert!(up.contains("X-Ok: yes"));
    }

    #[test]
    fn forwarded_for_is_appended() {
        let (_, up) = parse(b"GET / HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 1.1.1.1\r\nx-forwarded-for: 2.2.2.2\r\n\r\n").unwrap();
        assert!(
            up.contains("x-forwarded-for: 1.1.1.1, 2.2.2.2, 10.1.2.3\r\n"),
            "{up}"
        );
        assert_eq!(up.matches("x-forwarded-for").count(), 1);
    }

    #[test]
    fn http10_defaults() {
        let (h, up) = parse(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        assert!(!h.keep_alive);
        assert!(!h.has_host);
        assert!(!up.to_ascii_lowercase().contains("host:"));
        let (h, _) = parse(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").unwrap();
        assert!(h.keep_alive);
    }

    #[test]
    fn expect_continue() {
        let (h, up) = parse(
            b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n",
        )
        .unwrap();
        assert!(h.expect_continue);
        assert!(!up.to_ascii_lowercase().contains("expect"));
    }

    #[test]
    fn head_end_detection() {
        assert_eq!(
            find_head_end(b"GET / HTTP/1.1\r\nHost: a\r\n\r\nxyz"),
            Some(27)
        );
        assert_eq!(find_head_end(b"GET / HTTP/1.1\nHost: a\n\nxyz"), Some(24));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\nHost: a\r\n"), None);
    }
}
