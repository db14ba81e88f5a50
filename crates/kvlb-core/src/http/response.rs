//! Response heads from replicas: parse, decide how the body is delimited (RFC 9112 section 6.3),
//! and write the head kvlb sends to the client (hop-by-hop fields dropped, `x-kvlb-replica`
//! added).

#![forbid(unsafe_code)]

use super::request::{has_token, parse_content_length};
use super::{field, Field};
use std::mem::MaybeUninit;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseBody {
    /// HEAD responses, 1xx, 204 and 304.
    None,
    Length(u64),
    Chunked,
    /// Delimited by the replica closing the connection.
    UntilClose,
}

#[derive(Debug, Clone, Copy)]
pub struct ResponseHead {
    pub head_len: usize,
    pub status: u16,
    pub body: ResponseBody,
    /// The replica keeps the connection open afterwards.
    pub reusable: bool,
    /// The body is a server-sent event stream (`Content-Type: text/event-stream`).
    pub event_stream: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseError {
    Partial,
    TooLarge,
    Invalid,
}

/// Most header fields accepted in a replica's response.
const MAX_HEADERS: usize = 128;

/// How the client side wants the head written.
pub struct ClientFraming {
    /// The client's request was HEAD.
    pub head_request: bool,
    /// Close the client connection after this response.
    pub close: bool,
    /// The client speaks HTTP/1.0 (cannot receive chunked).
    pub http10: bool,
}

/// Parse a response head from `buf`; on success write the client-facing head to `out`.
/// Returns `Partial` when more bytes are needed.
pub fn parse_response(
    buf: &[u8],
    max_head: usize,
    replica: &str,
    client: &ClientFraming,
    out: &mut Vec<u8>,
) -> Result<ResponseHead, ResponseError> {
    // Not initialised: httparse writes the fields it parses.
    let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let head_len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return Err(if buf.len() > max_head {
                ResponseError::TooLarge
            } else {
                ResponseError::Partial
            })
        }
        Err(_) => return Err(ResponseError::Invalid),
    };
    let status = resp.code.unwrap_or(0);
    let minor = resp.version.unwrap_or(1);
    let mut content_length: Option<u64> = None;
    // Transfer-Encoding fields seen, and the last coding they list (all make one list).
    let mut te_seen = false;
    let mut te_final: &[u8] = &[];
    let mut close_token = false;
    let mut keep_alive_token = false;
    let mut event_stream = false;
    // Each field named once, for both passes; Connection-named fields are hop-by-hop too.
    let mut kinds = [Field::Other; MAX_HEADERS];
    let mut named: [&[u8]; 16] = [&[]; 16];
    let mut n_named = 0;
    for (h, kind) in resp.headers.iter().zip(kinds.iter_mut()) {
        *kind = field(h.name);
        if *kind == Field::ContentLength {
            let v = parse_content_length(h.value).map_err(|_| ResponseError::Invalid)?;
            if content_length.is_some_and(|c| c != v) {
                return Err(ResponseError::Invalid);
            }
            content_length = Some(v);
        } else if *kind == Field::TransferEncoding {
            te_seen = true;
            for coding in h.value.split(|b| *b == b',') {
                let coding = coding.trim_ascii();
                if !coding.is_empty() {
                    te_final = coding;
                }
            }
        } else if *kind == Field::Other && h.name.eq_ignore_ascii_case("content-type") {
            event_stream = h
                .value
                .get(..17)
                .is_some_and(|v| v.eq_ignore_ascii_case(b"text/event-stream"));
        } else if *kind == Field::Connection {
            close_token |= has_token(h.value, "close");
            keep_alive_token |= has_token(h.value, "keep-alive");
            for t in h.value.split(|b| *b == b',') {
                let t = t.trim_ascii();
                if !t.is_empty() && n_named < named.len() {
                    named[n_named] = t;
                    n_named += 1;
                }
            }
        }
    }
    // RFC 9112 section 6.3: Transfer-Encoding overrides Content-Length, and delimits the body
    // by chunks only when chunked is its final coding; otherwise the body ends at close.
    let chunked = te_seen && te_final.eq_ignore_ascii_case(b"chunked");
    let body =
        if client.head_request || (100..200).contains(&status) || status == 204 || status == 304 {
            ResponseBody::None
        } else if chunked {
            ResponseBody::Chunked
        } else if te_seen {
            ResponseBody::UntilClose
        } else if let Some(n) = content_length {
            ResponseBody::Length(n)
        } else {
            ResponseBody::UntilClose
        };
    // Close wins over keep-alive; HTTP/1.0 keeps alive only when asked, and never after a
    // Transfer-Encoding (RFC 9112 section 6.1: its framing is not to be trusted).
    let conn_close = close_token || (minor == 0 && (!keep_alive_token || te_seen));
    let reusable = !conn_close && body != ResponseBody::UntilClose;

    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    let mut code = [0u8; 3];
    code[0] = b'0' + (status / 100 % 10) as u8;
    code[1] = b'0' + (status / 10 % 10) as u8;
    code[2] = b'0' + (status % 10) as u8;
    out.extend_from_slice(&code);
    out.push(b' ');
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    // A body kvlb must re-delimit for an HTTP/1.0 client is sent until close.
    let dechunk = client.http10 && body == ResponseBody::Chunked;
    for (h, &kind) in resp.headers.iter().zip(kinds.iter()) {
        let n = h.name;
        let hop = matches!(
            kind,
            Field::Connection
                | Field::KeepAlive
                | Field::ProxyConnection
                | Field::Upgrade
                | Field::Te
                | Field::Trailer
        ) || (kind == Field::TransferEncoding && (dechunk || !chunked))
            || (kind == Field::ContentLength && te_seen)
            // A replica naming a framing field in Connection does not strip it: the client
            // frames the body by the head kvlb writes.
            || (!matches!(kind, Field::ContentLength | Field::TransferEncoding)
                && named[..n_named]
                    .iter()
                    .any(|x| x.eq_ignore_ascii_case(n.as_bytes())));
        if hop {
            continue;
        }
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"x-kvlb-replica: ");
    out.extend_from_slice(replica.as_bytes());
    out.extend_from_slice(b"\r\n");
    let client_close = client.close || body == ResponseBody::UntilClose || dechunk;
    if client_close {
        out.extend_from_slice(b"connection: close\r\n");
    } else if client.http10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Ok(ResponseHead {
        head_len,
        status,
        body,
        reusable,
        event_stream,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client() -> ClientFraming {
        ClientFraming {
            head_request: false,
            close: false,
            http10: false,
        }
    }

    #[test]
    fn event_streams_are_told_by_their_content_type() {
        let mut out = Vec::new();
        let mut parse = |head: &str| {
            parse_response(head.as_bytes(), 8192, "http://r", &client(), &mut out)
                .unwrap()
                .event_stream
        };
        assert!(parse(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
        ));
        assert!(parse(
            "HTTP/1.1 200 OK\r\ncontent-type: Text/Event-Stream; charset=utf-8\r\n\r\n"
        ));
        assert!(!parse(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n"
        ));
        assert!(!parse(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event\r\n\r\n"
        ));
        assert!(!parse(
            "HTTP/1.1 200 OK\r\nX-Content-Type: text/event-stream\r\n\r\n"
        ));
    }

    #[test]
    fn framing_rules() {
        let mut out = Vec::new();
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
            8192,
            "http://r",
            &client(),
            &mut out,
        )
        .unwrap();
        assert_eq!(r.body, ResponseBody::Length(5));
        assert!(r.reusable);
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            8192,
            "http://r",
            &client(),
            &mut out,
        )
        .unwrap();
        assert_eq!(r.body, ResponseBody::Chunked);
        assert!(String::from_utf8_lossy(&out).contains("Transfer-Encoding: chunked"));
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
            8192,
            "http://r",
            &client(),
            &mut out,
        )
        .unwrap();
        assert_eq!(r.body, ResponseBody::UntilClose);
        assert!(!r.reusable);
        assert!(String::from_utf8_lossy(&out).contains("connection: close"));
        for s in ["204 No Content", "304 Not Modified"] {
            let raw = format!("HTTP/1.1 {s}\r\nContent-Length: 10\r\n\r\n");
            let r = parse_response(raw.as_bytes(), 8192, "http://r", &client(), &mut out).unwrap();
            assert_eq!(r.body, ResponseBody::None);
        }
        let head = ClientFraming {
            head_request: true,
            close: false,
            http10: false,
        };
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n",
            8192,
            "http://r",
            &head,
            &mut out,
        )
        .unwrap();
        assert_eq!(r.body, ResponseBody::None);
        assert!(String::from_utf8_lossy(&out).contains("Content-Length: 10"));
    }

    #[test]
    fn replica_header_and_hop_by_hop() {
        let mut out = Vec::new();
        parse_response(b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nX-Keep: 2\r\nContent-Length: 0\r\n\r\n", 8192, "http://127.0.0.1:9", &client(), &mut out).unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(s.contains("x-kvlb-replica: http://127.0.0.1:9\r\n"));
        assert!(s.contains("X-Keep: 2"));
        assert!(!s.contains("X-Hop"));
        assert!(!s.to_ascii_lowercase().contains("keep-alive"));
    }

    /// `(body, reusable, client head)` of a replica's head, for a plain HTTP/1.1 client.
    fn framed(raw: &[u8]) -> Result<(ResponseBody, bool, String), ResponseError> {
        let mut out = Vec::new();
        let r = parse_response(raw, 8192, "r", &client(), &mut out)?;
        Ok((r.body, r.reusable, String::from_utf8(out).unwrap()))
    }

    /// Fuzz finding (fuzz/regressions/http_response/cl_plus_sign, cl_nbsp): a Content-Length
    /// of `+3`, or `3` then a no-break space, was read as 3 (Rust's integer parsing and
    /// Unicode trimming) and forwarded as it was, so the client saw a length it may read
    /// otherwise or refuse. Content-Length is digits only, as for requests.
    #[test]
    fn content_length_is_digits_only() {
        for v in [
            "+3",
            "3\u{a0}",
            "0x3",
            "3 3",
            "-3",
            "",
            "3,3",
            "99999999999999999999",
        ] {
            let raw = format!("HTTP/1.1 200 OK\r\nContent-Length: {v}\r\n\r\nabc");
            assert_eq!(
                framed(raw.as_bytes()).unwrap_err(),
                ResponseError::Invalid,
                "{v:?}"
            );
        }
        let ok = framed(b"HTTP/1.1 200 OK\r\nContent-Length: \t003 \r\n\r\nabc").unwrap();
        assert_eq!(ok.0, ResponseBody::Length(3));
    }

    /// Fuzz finding (fuzz/regressions/http_response/te_not_chunked_with_cl,
    /// te_chunked_not_final): `Transfer-Encoding: gzip` with a Content-Length was framed by
    /// the length, the connection kept for the next response (the rest of a close-delimited
    /// body would have been read as that); `chunked, gzip` was framed by chunks while the
    /// client, told `chunked, gzip`, reads until close. RFC 9112 section 6.3: Transfer-Encoding
    /// overrides Content-Length, and only a final chunked delimits by chunks.
    #[test]
    fn transfer_encoding_frames_by_its_final_coding() {
        let (body, reusable, head) =
            framed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\nxx")
                .unwrap();
        assert_eq!((body, reusable), (ResponseBody::UntilClose, false));
        assert!(!head.contains("Content-Length") && head.contains("connection: close"));
        let (body, reusable, head) =
            framed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n").unwrap();
        assert_eq!((body, reusable), (ResponseBody::UntilClose, false));
        assert!(head.contains("connection: close"), "{head}");
        for te in [
            "gzip, chunked",
            "gzip\r\nTransfer-Encoding: chunked",
            "chunked ,",
        ] {
            let raw =
                format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: {te}\r\nContent-Length: 9\r\n\r\n");
            let (body, reusable, head) = framed(raw.as_bytes()).unwrap();
            assert_eq!((body, reusable), (ResponseBody::Chunked, true), "{te:?}");
            assert!(!head.contains("Content-Length"), "{head}");
        }
    }

    /// Fuzz finding (fuzz/regressions/http_response/close_then_keep_alive, http10_te): an
    /// HTTP/1.0 response with `Connection: close` and then `Connection: keep-alive` kept the
    /// connection, and so did one with Transfer-Encoding (RFC 9112 section 6.1: close after).
    #[test]
    fn close_wins_over_keep_alive() {
        let r = framed(b"HTTP/1.0 200 OK\r\nConnection: close\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n");
        assert!(!r.unwrap().1);
        let r = framed(
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        assert_eq!(r.unwrap().0, ResponseBody::Chunked);
        let r = framed(
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        assert!(!r.unwrap().1);
        let r = framed(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n");
        assert!(r.unwrap().1);
    }

    /// Fuzz finding (fuzz/regressions/http_response/connection_names_cl): `Connection:
    /// Content-Length` made kvlb drop the Content-Length from the client's head while it
    /// relayed exactly that many bytes and kept the client's connection: the client, seeing
    /// no length, waited for a close that never came.
    #[test]
    fn connection_does_not_strip_framing_fields() {
        let (body, _, head) = framed(
            b"HTTP/1.1 200 OK\r\nConnection: Content-Length, X-A\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nok",
        )
        .unwrap();
        assert_eq!(body, ResponseBody::Length(2));
        assert!(
            head.contains("Content-Length: 2") && !head.contains("X-A"),
            "{head}"
        );
        let (body, _, head) = framed(
            b"HTTP/1.1 200 OK\r\nConnection: transfer-encoding\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        .unwrap();
        assert_eq!(body, ResponseBody::Chunked);
        assert!(head.contains("Transfer-Encoding: chunked"), "{head}");
    }

    #[test]
    fn partial_and_invalid() {
        let mut out = Vec::new();
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\n", 8192, "r", &client(), &mut out).unwrap_err(),
            ResponseError::Partial
        );
        assert_eq!(
            parse_response(b"garbage\r\n\r\n", 8192, "r", &client(), &mut out).unwrap_err(),
            ResponseError::Invalid
        );
        assert_eq!(
            parse_response(
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                8192,
                "r",
                &client(),
                &mut out
            )
            .unwrap_err(),
            ResponseError::Invalid
        );
    }
}
