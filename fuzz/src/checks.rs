//! What the fuzz targets check on each input, beyond "no panic". Each function takes the raw
//! fuzz input and panics (with the reason) when an invariant breaks:
//! - `http_request`: a request head kvlb accepts never carries both Content-Length and
//!   Transfer-Encoding, its head ends where the empty line is, its target lies in the buffer,
//!   and the head kvlb writes upstream parses again (one Content-Length, no hop-by-hop field);
//! - `chunked`: the decoder gives the same result however the input is split across reads,
//!   and a body encoded chunked (any chunk sizes, extensions, trailers) decodes back to itself;
//! - `prompt`: extraction with the stack's recording space and with any `PromptScratch` size
//!   agree exactly, a body yields text or tokens as its form says, and an accepted body is JSON
//!   (checked against serde_json);
//! - `kv_events`: a decoded batch re-encoded in either event format decodes to the same batch;
//! - `dns`: a DNS response parses to exactly the records an independent reading finds (names
//!   read at every offset agree with one that follows pointers anywhere and detects loops, so
//!   a compression loop or a pointer past the end is an error), each address is its record's
//!   bytes, work is bounded by the packet's size, and the same packet is refused as the answer
//!   to another id, name or type;
//! - `zmtp`: the SUB side reads a peer's bytes (greeting, READY, frames) the same whether they
//!   arrive at once or in pieces, exactly as an independent frame reader does, refuses frames
//!   over the message bound, and allocates in proportion to what arrived, not to a size a
//!   frame header announces;
//! - `http_response`: a replica's response head is framed as RFC 9112 section 6.3 says (one
//!   valid Content-Length or refused, Transfer-Encoding over it, chunked only as the final
//!   coding, no body for HEAD, 1xx, 204, 304), agrees with httparse on the head, and the head
//!   kvlb writes to the client parses, has no hop-by-hop field and frames the body as kvlb
//!   relays it.
//!
//! Included by `tests/ops_fuzz_corpus.rs` too (as a module, by path): it uses only kvlb's own
//! dependencies.

use kvlb::http::chunked::{ChunkError, ChunkedDecoder};
use kvlb::http::request::{find_head_end, finish_upstream_head, parse_request, BodyFraming};
use kvlb::kv_events::{
    decode::decode_batch, encode::encode_batch, EventFormat, KvEvent, KvEventBatch,
};
use kvlb::prompt::{
    extract_prompt, extract_prompt_with, extract_prompt_within, Endpoint, Extent, Piece,
    PromptForm, PromptLimits, PromptScratch,
};
use std::net::{IpAddr, Ipv4Addr};

/// The names of the header fields of a head (lines after the first, up to the first colon).
fn header_names(head: &[u8]) -> impl Iterator<Item = &[u8]> {
    head.split(|b| *b == b'\n')
        .skip(1)
        .filter_map(|line| line.iter().position(|b| *b == b':').map(|c| &line[..c]))
}

fn count_named(head: &[u8], name: &str) -> usize {
    header_names(head)
        .filter(|n| n.eq_ignore_ascii_case(name.as_bytes()))
        .count()
}

pub fn http_request(data: &[u8]) {
    let Some(end) = find_head_end(data) else {
        return;
    };
    let ip = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7));
    let mut out = Vec::new();
    let Ok(head) = parse_request(data, end, Some(ip), &mut out) else {
        return;
    };
    let raw = &data[..end];
    let cl = count_named(raw, "content-length");
    let te = count_named(raw, "transfer-encoding");
    assert!(
        cl == 0 || te == 0,
        "accepted a head with Content-Length and Transfer-Encoding"
    );
    assert!(cl <= 1, "accepted a head with {cl} Content-Length fields");
    assert_eq!(
        head.head_len, end,
        "parsed head length differs from the empty line's end"
    );
    assert!(
        head.target.0 < head.target.1 && head.target.1 <= end,
        "target range {:?} outside the head",
        head.target
    );
    match head.body {
        BodyFraming::Chunked => assert_eq!(te, 1, "chunked framing without Transfer-Encoding"),
        BodyFraming::Length(n) => assert!(n > 0 && cl == 1, "length {n} without Content-Length"),
        BodyFraming::None => assert_eq!(te, 0, "Transfer-Encoding ignored"),
    }
    if head.minor_version == 0 {
        assert!(te == 0, "HTTP/1.0 request with Transfer-Encoding accepted");
    }

    // The upstream head, finished as the proxy does for a body of `body_len` bytes.
    let body_len = match head.body {
        BodyFraming::Length(n) => n.min(1 << 20) as usize,
        BodyFraming::Chunked => data.len() - end,
        BodyFraming::None => 0,
    };
    finish_upstream_head(&mut out, head.method, body_len);
    let mut fields = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut fields);
    match req.parse(&out) {
        Ok(httparse::Status::Complete(n)) => {
            assert_eq!(n, out.len(), "upstream head has bytes after its end")
        }
        other => panic!(
            "upstream head does not parse ({other:?}): {:?}",
            String::from_utf8_lossy(&out)
        ),
    }
    for hop in [
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "upgrade",
        "expect",
    ] {
        assert_eq!(
            count_named(&out, hop),
            0,
            "upstream head forwards {hop}: {:?}",
            String::from_utf8_lossy(&out)
        );
    }
    assert!(count_named(&out, "content-length") <= 1);
    // Upstream, the target is origin-form (or `*`), the one kvlb routed on, and the Host is
    // one field (the client's, or an absolute-form target's authority).
    let line_target = out.split(|&b| b == b' ').nth(1).unwrap_or(b"");
    let seen = &data[head.target.0..head.target.1];
    assert!(
        line_target.starts_with(b"/") || line_target == b"*",
        "upstream target not in origin-form: {:?}",
        String::from_utf8_lossy(&out)
    );
    assert!(
        line_target == seen || (seen == b"/" && line_target.starts_with(b"/?")),
        "kvlb routed on {:?} but sent {:?} upstream",
        String::from_utf8_lossy(seen),
        String::from_utf8_lossy(line_target)
    );
    assert_eq!(
        count_named(&out, "host"),
        head.has_host as usize,
        "upstream Host fields: {:?}",
        String::from_utf8_lossy(&out)
    );
    if head.has_host {
        // What kvlb sends is a request kvlb itself accepts, framed by its Content-Length.
        // (kvlb adds X-Forwarded-For: a client at the field limit makes a head one field
        // longer than kvlb accepts from clients, which is no limit of the replicas'.)
        let mut again = Vec::new();
        let up = match parse_request(&out, out.len(), None, &mut again) {
            Err(kvlb::http::HttpError::HeaderTooLarge)
                if header_names(&out).count() > kvlb::http::request::MAX_HEADERS =>
            {
                return
            }
            other => other,
        };
        let up = up.unwrap_or_else(|e| {
            panic!(
                "kvlb refuses its own upstream head ({e:?}): {:?}",
                String::from_utf8_lossy(&out)
            )
        });
        let want = if count_named(&out, "content-length") == 1 && body_len > 0 {
            BodyFraming::Length(body_len as u64)
        } else {
            BodyFraming::None
        };
        assert_eq!(up.body, want, "upstream framing");
    }
}

/// Decodes `input` fed in slices of `step` bytes (0: all at once): the error if any, the data
/// bytes, whether the message ended, and how many bytes it took.
fn decode_in_steps(input: &[u8], step: usize) -> (Option<ChunkError>, Vec<u8>, bool, usize) {
    let mut dec = ChunkedDecoder::new();
    let mut data = Vec::new();
    let mut used = 0;
    let step = if step == 0 { input.len().max(1) } else { step };
    for piece in input.chunks(step) {
        match dec.feed(piece, |s, e| data.extend_from_slice(&piece[s..e])) {
            Ok(n) => {
                used += n;
                if dec.is_done() {
                    assert!(n <= piece.len());
                    return (None, data, true, used);
                }
                assert_eq!(n, piece.len(), "stopped early without ending the message");
            }
            // Where in the input the error was is not reported: only that there was one.
            Err(e) => return (Some(e), data, false, 0),
        }
    }
    (None, data, false, used)
}

/// A small deterministic generator for encoding choices.
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

pub fn chunked(data: &[u8]) {
    // 1. Split points do not matter.
    let whole = decode_in_steps(data, 0);
    let step = data.first().map(|b| (*b as usize % 13) + 1).unwrap_or(1);
    for s in [1, step] {
        let split = decode_in_steps(data, s);
        assert_eq!(
            (whole.0, whole.2, whole.3),
            (split.0, split.2, split.3),
            "fed in {s}-byte slices: different outcome"
        );
        assert_eq!(whole.1, split.1, "fed in {s}-byte slices: different data");
    }

    // 2. Encode `data` as a body, with chunk sizes, extensions and trailers chosen from it.
    let mut pick = Choices(
        0x9e37_79b9_7f4a_7c15 ^ data.len() as u64 ^ data.first().copied().unwrap_or(0) as u64,
    );
    let mut wire = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let size = ((pick.next() % 40) as usize + 1).min(data.len() - at);
        let hex = if pick.next().is_multiple_of(2) {
            format!("{size:x}")
        } else {
            format!("{size:X}")
        };
        let zeros = (pick.next() % 3) as usize;
        wire.extend_from_slice("0".repeat(zeros).as_bytes());
        wire.extend_from_slice(hex.as_bytes());
        if pick.next().is_multiple_of(4) {
            wire.extend_from_slice(b";name=\"va;lue\"");
        }
        wire.extend_from_slice(b"\r\n");
        wire.extend_from_slice(&data[at..at + size]);
        wire.extend_from_slice(b"\r\n");
        at += size;
    }
    wire.extend_from_slice(b"0\r\n");
    if pick.next().is_multiple_of(2) {
        wire.extend_from_slice(b"x-trailer: 1\r\n");
    }
    wire.extend_from_slice(b"\r\n");
    let encoded_len = wire.len();
    wire.extend_from_slice(b"GET /next HTTP/1.1\r\n"); // a pipelined request must be left alone
    for s in [0, step] {
        let (err, body, done, used) = decode_in_steps(&wire, s);
        assert_eq!(err, None, "re-encoded body refused");
        assert!(done, "re-encoded body did not end");
        assert_eq!(used, encoded_len, "re-encoded body: end misplaced");
        assert_eq!(body, data, "re-encoded body decodes to different bytes");
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Extracted {
    Text(Vec<u8>, PromptForm),
    Tokens(Vec<u32>, PromptForm),
    Mixed,
}

fn collect(
    result: Result<PromptForm, kvlb::prompt::PromptError>,
    text: Vec<u8>,
    tokens: Vec<u32>,
) -> Result<Extracted, kvlb::prompt::PromptError> {
    let form = result?;
    Ok(match (text.is_empty(), tokens.is_empty()) {
        (_, true) => Extracted::Text(text, form),
        (true, false) => Extracted::Tokens(tokens, form),
        (false, false) => Extracted::Mixed,
    })
}

pub fn prompt(data: &[u8]) {
    let Some((&choice, body)) = data.split_first() else {
        return;
    };
    // Each body is read as one of the OpenAI endpoints and as the agent API of the same shape
    // (completions' top level beside the Responses API's, chat's messages beside Messages').
    let (endpoint, agent) = if choice & 1 == 0 {
        (Endpoint::Completions, Endpoint::Responses)
    } else {
        (Endpoint::ChatCompletions, Endpoint::Messages)
    };
    prompt_as(endpoint, choice, body);
    prompt_as(agent, choice, body);
}

/// [`prompt`] for one endpoint.
fn prompt_as(endpoint: Endpoint, choice: u8, body: &[u8]) {
    let scratch_pieces = [0usize, 1, 2, 3, 8, 64, 1024, 4096][(choice >> 1) as usize % 8];

    let (mut text, mut tokens) = (Vec::new(), Vec::new());
    let on_stack = extract_prompt(endpoint, body, &mut |p: Piece<'_>| match p {
        Piece::Text(t) => text.extend_from_slice(t),
        Piece::Token(t) => tokens.push(t),
    });
    let on_stack = collect(on_stack, text, tokens);

    let (mut text, mut tokens) = (Vec::new(), Vec::new());
    let mut scratch = PromptScratch::new(scratch_pieces);
    let with_scratch =
        extract_prompt_with(endpoint, body, &mut scratch, &mut |p: Piece<'_>| match p {
            Piece::Text(t) => text.extend_from_slice(t),
            Piece::Token(t) => tokens.push(t),
        });
    let with_scratch = collect(with_scratch, text, tokens);
    assert_eq!(
        on_stack, with_scratch,
        "stack recording and a {scratch_pieces}-piece scratch disagree"
    );
    prompt_within_bounds(endpoint, body, scratch_pieces, choice, &on_stack);

    match &on_stack {
        Ok(Extracted::Mixed) => panic!("a body produced text and token pieces"),
        Ok(Extracted::Text(_, form)) => assert_eq!(*form, PromptForm::Text),
        Ok(Extracted::Tokens(_, form)) => assert_eq!(*form, PromptForm::Tokens),
        Err(_) => return,
    }
    // The first pass validates the whole body: what it accepts is JSON. kvlb decodes a lone
    // surrogate escape to U+FFFD where serde_json refuses it; that difference is by design.
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(body) {
        let msg = e.to_string();
        assert!(
            msg.contains("surrogate"),
            "kvlb extracted a prompt from a body serde_json refuses ({msg}): {:?}",
            String::from_utf8_lossy(body)
        );
    }
}

/// The bounded reading: under the default bounds (far above any fuzz input) the same as the
/// unbounded one; under small ones (picked from `choice`) a prefix of it, or no prefix.
fn prompt_within_bounds(
    endpoint: Endpoint,
    body: &[u8],
    scratch_pieces: usize,
    choice: u8,
    whole: &Result<Extracted, kvlb::prompt::PromptError>,
) {
    let run =
        |limits: &PromptLimits| {
            let (mut text, mut tokens) = (Vec::new(), Vec::new());
            let mut scratch = PromptScratch::new(scratch_pieces);
            let result =
                extract_prompt_within(endpoint, body, &mut scratch, limits, &mut |p: Piece<'_>| {
                    match p {
                        Piece::Text(t) => text.extend_from_slice(t),
                        Piece::Token(t) => tokens.push(t),
                    }
                });
            (result, text, tokens)
        };
    let (result, text, tokens) = run(&PromptLimits::default());
    let result = result.map(|(form, extent)| {
        assert_eq!(
            extent,
            Extent::Whole,
            "a fuzz input reached the default bounds"
        );
        form
    });
    assert_eq!(
        &collect(result, text, tokens),
        whole,
        "the bounded reading differs under its bounds"
    );
    let pick = |options: &[usize], shift: u32| options[(choice as usize >> shift) % options.len()];
    let small = PromptLimits {
        max_tokens: pick(&[2, 9, 40, usize::MAX], 4),
        max_messages: pick(&[0, 1, 3, usize::MAX], 6),
        max_parts: pick(&[0, 2, usize::MAX], 3),
        max_work: pick(&[3, 30, usize::MAX], 5),
        max_validated_bytes: pick(&[0, 16, usize::MAX], 2),
    };
    let Ok(whole) = whole else {
        return;
    };
    let (result, text, tokens) = run(&small);
    let (all_text, all_tokens): (&[u8], &[u32]) = match whole {
        Extracted::Text(t, _) => (t, &[]),
        Extracted::Tokens(t, _) => (&[], t),
        Extracted::Mixed => return,
    };
    match result {
        Ok((_, Extent::Whole)) => assert!(
            text == all_text && tokens == all_tokens,
            "{small:?}: read whole, but differently"
        ),
        Ok((_, Extent::Prefix(bound))) => assert!(
            all_text.starts_with(&text) && all_tokens.starts_with(&tokens),
            "{small:?}: cut at {bound:?}, not a prefix"
        ),
        Ok((_, Extent::Unknown(_))) => {}
        Err(e) => panic!("{small:?}: a body read whole without bounds failed within them: {e:?}"),
    }
}

/// A batch with `ts` compared by its bits (a NaN timestamp is still equal to itself), without
/// its undecodable events (which are not encoded).
fn comparable(batch: &KvEventBatch) -> (u64, String) {
    let events: Vec<_> = batch
        .events
        .iter()
        .filter(|e| !matches!(e, KvEvent::Undecodable(_)))
        .collect();
    (
        batch.ts.to_bits(),
        format!("{:?} {:?}", events, batch.dp_rank),
    )
}

pub fn kv_events(data: &[u8]) {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    for format in [EventFormat::Map, EventFormat::Array] {
        let wire = encode_batch(&batch, format);
        let again = decode_batch(&wire).unwrap_or_else(|e| {
            panic!("{format:?}: kvlb cannot decode its own encoding of {batch:?}: {e}")
        });
        assert_eq!(
            comparable(&again),
            comparable(&batch),
            "{format:?}: a re-encoded batch decodes differently"
        );
    }
}

// --- dns -------------------------------------------------------------------------------------

/// How an independent reading of a name (RFC 1035 4.1.4: a pointer may go anywhere in the
/// message) ends. kvlb's `read_name` must give the same name and end, or an error where this
/// says kvlb refuses.
#[derive(Debug, PartialEq, Eq)]
enum RefName {
    /// The name, the offset after its bytes at the start, and whether kvlb refuses it anyway:
    /// a pointer that does not point before itself, or more pointers than kvlb follows.
    Read(String, usize, bool),
    /// A pointer chain that comes back to a pointer already followed.
    Loop,
    /// Runs past the packet, a reserved label type, a bad label byte, longer than 255 bytes.
    Bad,
}

/// Pointers kvlb follows within one name at most (`MAX_POINTER_JUMPS` in dns.rs).
const DNS_MAX_JUMPS: usize = 32;

fn ref_read_name(p: &[u8], start: usize) -> RefName {
    let (mut name, mut pos, mut end) = (String::new(), start, None);
    let mut followed: Vec<usize> = Vec::new();
    let mut wire_len = 1;
    let mut refused = false;
    loop {
        let Some(&len) = p.get(pos) else {
            return RefName::Bad;
        };
        let len = len as usize;
        match len >> 6 {
            0 if len == 0 => return RefName::Read(name, end.unwrap_or(pos + 1), refused),
            0 => {
                wire_len += len + 1;
                let Some(label) = p.get(pos + 1..pos + 1 + len) else {
                    return RefName::Bad;
                };
                if wire_len > 255 || !label.iter().all(|b| b.is_ascii_graphic() && *b != b'.') {
                    return RefName::Bad;
                }
                if !name.is_empty() {
                    name.push('.');
                }
                name.extend(label.iter().map(|b| b.to_ascii_lowercase() as char));
                pos += 1 + len;
            }
            3 => {
                let Some(&low) = p.get(pos + 1) else {
                    return RefName::Bad;
                };
                if followed.contains(&pos) {
                    return RefName::Loop;
                }
                followed.push(pos);
                let target = ((len & 0x3F) << 8) | low as usize;
                refused |= target >= pos || followed.len() > DNS_MAX_JUMPS;
                if followed.len() > DNS_MAX_JUMPS {
                    // kvlb has given up by now: no need to walk the chain to its end.
                    return RefName::Read(name, 0, true);
                }
                end.get_or_insert(pos + 2);
                pos = target;
            }
            _ => return RefName::Bad,
        }
    }
}

/// Reads the name at `at` with kvlb's `read_name` and checks it against the independent
/// reading: the result they agree on (None: an error).
fn dns_name_at(p: &[u8], at: usize) -> Option<(String, usize)> {
    let theirs = kvlb::discovery::dns::read_name(p, at);
    match ref_read_name(p, at) {
        RefName::Read(name, end, false) => {
            assert_eq!(
                theirs,
                Ok((name.clone(), end)),
                "name at {at}: kvlb reads it differently"
            );
            Some((name, end))
        }
        why => {
            assert!(
                theirs.is_err(),
                "name at {at} ({why:?}): kvlb accepted it as {theirs:?}"
            );
            None
        }
    }
}

fn dns_be16(p: &[u8], at: usize) -> Option<u16> {
    p.get(at..at + 2).map(|b| u16::from_be_bytes([b[0], b[1]]))
}

/// The response kvlb must make of `p` as the answer to `id`/`qname`/`qtype`, with the offset of
/// each A and AAAA record's data; or what kind of refusal.
#[derive(Debug, PartialEq, Eq)]
enum DnsRefusal {
    Id,
    NotResponse,
    Question,
    Malformed,
}

type DnsExpected = (kvlb::discovery::dns::Message, Vec<usize>);

fn ref_parse_dns(p: &[u8], id: u16, qname: &str, qtype: u16) -> Result<DnsExpected, DnsRefusal> {
    use kvlb::discovery::dns::{Message, RData, Record};
    use DnsRefusal::*;
    if p.len() < 12 {
        return Err(Malformed);
    }
    if dns_be16(p, 0) != Some(id) {
        return Err(Id);
    }
    let flags = dns_be16(p, 2).unwrap();
    if flags & 0x8000 == 0 || (flags >> 11) & 0xF != 0 {
        return Err(NotResponse);
    }
    let count = |at| dns_be16(p, at).unwrap() as usize;
    if count(4) != 1 {
        return Err(Question);
    }
    let (an, ns, ar) = (count(6), count(8), count(10));
    let (name, pos) = dns_name_at(p, 12).ok_or(Malformed)?;
    let want = kvlb::discovery::dns::normalize_name(qname).map_err(|_| Malformed)?;
    if name != want {
        return Err(Question);
    }
    if dns_be16(p, pos).ok_or(Malformed)? != qtype || dns_be16(p, pos + 2).ok_or(Malformed)? != 1 {
        return Err(Question);
    }
    let mut msg = Message {
        rcode: (flags & 0xF) as u8,
        truncated: flags & 0x0200 != 0,
        ..Message::default()
    };
    let mut data_at = Vec::new();
    if msg.truncated {
        return Ok((msg, data_at));
    }
    let mut pos = pos + 4;
    if (an + ns + ar) * 11 > p.len() - pos {
        return Err(Malformed);
    }
    for i in 0..an + ns + ar {
        let (name, after) = dns_name_at(p, pos).ok_or(Malformed)?;
        let field = |k: usize| dns_be16(p, after + k).ok_or(Malformed);
        let (rtype, class) = (field(0)?, field(2)?);
        let ttl = ((field(4)? as u32) << 16) | field(6)? as u32;
        let (rd, rdlen) = (after + 10, field(8)? as usize);
        let end = rd + rdlen;
        if end > p.len() {
            return Err(Malformed);
        }
        pos = end;
        if class != 1 || rtype == 41 {
            continue;
        }
        let data = match (rtype, rdlen) {
            (1, 4) => RData::A(<[u8; 4]>::try_from(&p[rd..end]).unwrap().into()),
            (28, 16) => RData::Aaaa(<[u8; 16]>::try_from(&p[rd..end]).unwrap().into()),
            (1 | 28, _) => return Err(Malformed),
            (5, _) => match dns_name_at(p, rd) {
                Some((target, after)) if after == end => RData::Cname(target),
                _ => return Err(Malformed),
            },
            (33, 7..) => match dns_name_at(p, rd + 6) {
                Some((target, after)) if after == end => RData::Srv {
                    priority: dns_be16(p, rd).unwrap(),
                    weight: dns_be16(p, rd + 2).unwrap(),
                    port: dns_be16(p, rd + 4).unwrap(),
                    target,
                },
                _ => return Err(Malformed),
            },
            (33, _) => return Err(Malformed),
            (t, _) => RData::Other(t),
        };
        let record = Record { name, ttl, data };
        if i < an {
            msg.answers.push(record);
            data_at.push(rd);
        } else if i >= an + ns {
            msg.additionals.push(record);
            data_at.push(rd);
        }
    }
    Ok((msg, data_at))
}

fn dns_refusal(e: &kvlb::discovery::dns::DnsError) -> DnsRefusal {
    use kvlb::discovery::dns::DnsError;
    match e {
        DnsError::IdMismatch { .. } => DnsRefusal::Id,
        DnsError::NotResponse => DnsRefusal::NotResponse,
        DnsError::QuestionMismatch => DnsRefusal::Question,
        DnsError::Malformed(..) | DnsError::BadName(..) => DnsRefusal::Malformed,
        other => panic!("parse_response gave an exchange error: {other:?}"),
    }
}

/// One name different from `name` that is still a valid name: its first letter changed.
fn other_name(name: &str) -> String {
    let mut other = name.to_string();
    let first = if name.starts_with('x') { "y" } else { "x" };
    other.replace_range(..1, first);
    other
}

pub fn dns(p: &[u8]) {
    use kvlb::discovery::dns::{self, DnsError, RData};
    // Ask the question the packet answers when it names one kvlb could ask, so that parsing
    // goes past the question; else a fixed one it must refuse unless the packet asks it.
    let id = dns_be16(p, 0).unwrap_or(0);
    let asked = (p.len() >= 12).then(|| dns_name_at(p, 12)).flatten();
    let (qname, qtype) = match asked {
        Some((n, end)) if dns::normalize_name(&n).is_ok_and(|v| v == n) => {
            (n, dns_be16(p, end).unwrap_or(dns::TYPE_A))
        }
        _ => ("svc.local".to_string(), dns::TYPE_SRV),
    };
    // A name at every offset of the packet's first 600 bytes (each is a place a record name
    // or a pointer could sit): compression loops and pointers past the end give errors.
    for at in 0..p.len().min(600) {
        dns_name_at(p, at);
    }

    let got = dns::parse_response(p, id, &qname, qtype);
    let want = ref_parse_dns(p, id, &qname, qtype);
    let msg = match (&got, want) {
        (Ok(msg), Ok((expected, data_at))) => {
            assert_eq!(msg, &expected, "records differ from an independent reading");
            // Every address is the 4 or 16 bytes of its record's data in the packet.
            for (rec, &at) in msg.answers.iter().chain(&msg.additionals).zip(&data_at) {
                match rec.data {
                    RData::A(a) => assert_eq!(&p[at..at + 4], &a.octets()),
                    RData::Aaaa(a) => assert_eq!(&p[at..at + 16], &a.octets()),
                    _ => {}
                }
            }
            msg
        }
        (Err(e), Err(why)) => {
            assert_eq!(dns_refusal(e), why, "refused for another reason: {e}");
            return;
        }
        (got, want) => panic!("kvlb: {got:?}; independent reading: {want:?}"),
    };
    // Bounded work by construction: each record takes at least 11 bytes of the packet.
    assert!((msg.answers.len() + msg.additionals.len()) * 11 <= p.len());
    assert!(!msg.truncated || (msg.answers.is_empty() && msg.additionals.is_empty()));

    // The same packet is no answer to another id, name or type.
    let wrong_id = id ^ 0x5a5a;
    assert_eq!(
        dns::parse_response(p, wrong_id, &qname, qtype),
        Err(DnsError::IdMismatch {
            expected: wrong_id,
            got: id
        })
    );
    assert_eq!(
        dns::parse_response(p, id, &other_name(&qname), qtype),
        Err(DnsError::QuestionMismatch),
        "answer to {qname:?} taken for another name's"
    );
    assert_eq!(
        dns::parse_response(p, id, &qname, qtype ^ 0x0100),
        Err(DnsError::QuestionMismatch),
        "answer to type {qtype} taken for another type's"
    );

    // What discovery does with it: the addresses found (through CNAMEs, from SRV targets in
    // the additional section) are those of the message's records.
    let all: Vec<std::net::IpAddr> = msg
        .answers
        .iter()
        .chain(&msg.additionals)
        .filter_map(|r| match r.data {
            RData::A(a) => Some(a.into()),
            RData::Aaaa(a) => Some(a.into()),
            _ => None,
        })
        .collect();
    let mut names = vec![qname.clone()];
    if let Ok(srvs) = dns::follow(&msg.answers, &qname, dns::TYPE_SRV) {
        names.extend(srvs.iter().filter_map(|r| match &r.data {
            RData::Srv { target, .. } => Some(target.clone()),
            _ => None,
        }));
    }
    for name in names.iter().take(16) {
        for records in [&msg.answers, &msg.additionals] {
            if let Ok(found) = dns::addresses(records, name) {
                assert!(
                    found.iter().all(|a| all.contains(a)),
                    "address from nowhere"
                );
            }
        }
    }
}

// --- zmtp ------------------------------------------------------------------------------------

/// The largest single allocation made since the last reset, kept by a fuzz target's counting
/// allocator (`fuzz_targets/zmtp.rs`); left at 0 where none counts (the corpus replay test),
/// which makes the memory check below a no-op there.
pub static LARGEST_ALLOCATION: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Largest message a peer may send (`zmtp::wire::MAX_MESSAGE_BYTES`).
const ZMTP_MAX_MESSAGE: u64 = kvlb::zmtp::wire::MAX_MESSAGE_BYTES as u64;

/// How a read of a peer's bytes ended, after the messages and commands it gave.
#[derive(Debug, PartialEq, Eq)]
enum ZmtpEnd {
    /// The bytes ran out (in the middle of a frame, or between frames).
    Waiting,
    /// A protocol error: the connection is dropped.
    Refused(String),
}

/// What kvlb's SUB side made of `wire`: its first `handshake_len` bytes arrive before the
/// handshake, the rest after it in pieces of the given sizes (cycled). The handshake's error
/// if it failed, else what came after it. PINGs are answered as `SubClient::recv` does;
/// `recycle`: each message is handed back, as a subscriber that recycles does.
fn zmtp_read(
    wire: &[u8],
    handshake_len: usize,
    pieces: &[usize],
    recycle: bool,
) -> Result<(Vec<kvlb::zmtp::wire::Incoming>, ZmtpEnd), String> {
    use kvlb::zmtp::wire::{Connection, Incoming};
    use std::io::Write;
    use std::os::fd::{FromRawFd, IntoRawFd};
    use std::time::{Duration, Instant};

    let (ours, mut peer) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    // Safety: the descriptor is a connected stream socket that nothing else owns; a TcpStream
    // over it only reads, writes, polls and (failing harmlessly) sets TCP_NODELAY.
    let stream = unsafe { std::net::TcpStream::from_raw_fd(ours.into_raw_fd()) };
    let (handshake, rest) = wire.split_at(handshake_len.min(wire.len()));
    peer.write_all(handshake).expect("write to socketpair");
    // With every handshake byte already there, a zero timeout only cuts a short handshake.
    let mut conn = Connection::handshake(stream, false, "SUB", &["PUB", "XPUB"], Duration::ZERO)
        .map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    let mut at = 0;
    let mut sizes = pieces.iter().copied().cycle();
    loop {
        // Everything sent so far has arrived: read it all (a deadline already past only stops
        // the read once the socket is empty).
        loop {
            match conn.read_incoming(Some(Instant::now())) {
                Ok(Some(incoming)) => {
                    if let Incoming::Command { name, data } = &incoming {
                        if name == b"PING" {
                            conn.answer_ping(data).expect("answer PING");
                        }
                    }
                    match incoming {
                        Incoming::Message(m) if recycle => {
                            got.push(Incoming::Message(m.clone()));
                            conn.recycle(m);
                        }
                        other => got.push(other),
                    }
                }
                Ok(None) => break,
                Err(e) => return Ok((got, ZmtpEnd::Refused(e.to_string()))),
            }
        }
        if at == rest.len() {
            return Ok((got, ZmtpEnd::Waiting));
        }
        let n = sizes.next().unwrap_or(rest.len()).clamp(1, rest.len() - at);
        peer.write_all(&rest[at..at + n])
            .expect("write to socketpair");
        at += n;
    }
}

/// An independent reading of the frames after the handshake (ZMTP 3.1 section 2.3.2, kvlb's
/// message bound): the messages and commands, and whether it ends refused.
fn ref_zmtp_frames(mut b: &[u8]) -> (Vec<kvlb::zmtp::wire::Incoming>, bool) {
    use kvlb::zmtp::wire::Incoming;
    let mut out = Vec::new();
    let mut partial: Vec<Vec<u8>> = Vec::new();
    loop {
        if b.len() < 2 {
            return (out, false);
        }
        let flags = b[0];
        if flags & !0x07 != 0 {
            return (out, true);
        }
        let (header, size) = if flags & 0x02 != 0 {
            let Some(s) = b.get(1..9) else {
                return (out, false);
            };
            (9, u64::from_be_bytes(s.try_into().unwrap()))
        } else {
            (2, b[1] as u64)
        };
        let pending: u64 = partial.iter().map(|f| f.len() as u64).sum();
        if size > ZMTP_MAX_MESSAGE - pending {
            return (out, true);
        }
        let Some(body) = b.get(header..header + size as usize) else {
            return (out, false);
        };
        b = &b[header + size as usize..];
        if flags & 0x04 != 0 {
            // A command: never MORE; a name length, the name, data.
            let ok = flags & 0x01 == 0 && !body.is_empty() && body.len() > body[0] as usize;
            if !ok {
                return (out, true);
            }
            let n = body[0] as usize;
            out.push(Incoming::Command {
                name: body[1..1 + n].to_vec(),
                data: body[1 + n..].to_vec(),
            });
            continue;
        }
        partial.push(body.to_vec());
        if flags & 0x01 == 0 {
            out.push(Incoming::Message(std::mem::take(&mut partial)));
        }
    }
}

/// Bytes a frame at the start of `b` takes (header and body), as far as `b` goes.
fn zmtp_frame_len(b: &[u8]) -> usize {
    let size = match b {
        [f, rest @ ..] if f & 0x02 != 0 => rest.get(..8).map_or(0, |s| {
            u64::from_be_bytes(s.try_into().unwrap()).saturating_add(9)
        }),
        [_, s, ..] => *s as u64 + 2,
        _ => 0,
    };
    size.min(b.len() as u64) as usize
}

/// A peer's greeting and READY as a ZMTP 3.x PUB socket sends them.
fn zmtp_pub_handshake(minor: u8) -> Vec<u8> {
    let mut out = kvlb::zmtp::wire::greeting(true).to_vec();
    out[11] = minor;
    let mut props = vec![11];
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&3u32.to_be_bytes());
    props.extend_from_slice(b"PUB");
    out.extend(kvlb::zmtp::wire::encode_command("READY", &props));
    out
}

/// Input: a byte of choices (bit 0: the rest is what follows a PUB peer's handshake, which
/// the check writes, bit 1: its ZMTP minor version, bit 2: recycle messages, bits 4-7: how
/// many piece sizes follow), the piece sizes (each byte + 1), then the peer's bytes.
pub fn zmtp(data: &[u8]) {
    use std::sync::atomic::Ordering;
    let Some((&choice, rest)) = data.split_first() else {
        return;
    };
    let n_sizes = ((choice >> 4) as usize).min(rest.len());
    let (sizes, bytes) = rest.split_at(n_sizes);
    let mut pieces: Vec<usize> = sizes.iter().map(|&s| s as usize + 1).collect();
    if pieces.is_empty() {
        pieces.push(1 + bytes.len() / 3);
    }
    let (wire, handshake_len) = if choice & 1 != 0 {
        let mut w = zmtp_pub_handshake(choice >> 1 & 1);
        let n = w.len();
        w.extend_from_slice(bytes);
        (w, n)
    } else {
        // The greeting and the first frame (READY, or whatever the peer sends instead).
        let hs = 64 + bytes.get(64..).map_or(0, zmtp_frame_len);
        (bytes.to_vec(), hs.min(bytes.len()))
    };
    let recycle = choice & 4 != 0;

    // All of it at once (the handshake reads it all), then in pieces after the handshake.
    LARGEST_ALLOCATION.store(0, Ordering::Relaxed);
    let whole = zmtp_read(&wire, wire.len(), &[1], recycle);
    let largest = LARGEST_ALLOCATION.swap(0, Ordering::Relaxed);
    // Memory follows what the peer sent, not what it announced: a frame header claiming 2^63
    // (or 200 MiB) bytes allocates nothing until they come.
    let bound = 4 * wire.len() + (256 << 10);
    assert!(
        largest <= bound,
        "{} bytes from the peer made kvlb allocate {largest} bytes at once",
        wire.len()
    );
    let split = zmtp_read(&wire, handshake_len, &pieces, recycle);
    // A handshake that fails fails either way, though not always for the same reason: with
    // only its own bytes there, a first frame that is no command runs out instead.
    if whole.is_ok() || split.is_ok() {
        assert_eq!(
            whole, split,
            "the same bytes in pieces of {pieces:?} read differently"
        );
    }
    let largest = LARGEST_ALLOCATION.swap(0, Ordering::Relaxed);
    assert!(
        largest <= bound,
        "in pieces: allocated {largest} bytes at once"
    );

    let Ok((got, end)) = whole else {
        return;
    };
    // A handshake kvlb accepted was a ZMTP 3 greeting with the NULL mechanism and a READY
    // from a PUB or XPUB socket.
    let g = &wire[..64];
    assert!(
        g[0] == 0xFF && g[9] & 1 == 1 && g[10] >= 3,
        "greeting accepted: {g:?}"
    );
    assert!(
        &g[12..16] == b"NULL" && g[16] == 0,
        "mechanism accepted: {g:?}"
    );
    let (first, _) = ref_zmtp_frames(&wire[64..handshake_len]);
    match first.as_slice() {
        [kvlb::zmtp::wire::Incoming::Command { name, data }] if name == b"READY" => {
            let props = kvlb::zmtp::wire::parse_properties(data).expect("READY metadata");
            assert!(props.iter().any(
                |(n, v)| n.eq_ignore_ascii_case("socket-type") && (v == b"PUB" || v == b"XPUB")
            ));
        }
        other => panic!("handshake accepted with {other:?} for READY"),
    }
    // After it, exactly the frames an independent reading finds.
    let (want, refused) = ref_zmtp_frames(&wire[handshake_len..]);
    assert_eq!(got, want, "messages differ from an independent reading");
    assert_eq!(
        matches!(end, ZmtpEnd::Refused(_)),
        refused,
        "kvlb ended {end:?}"
    );
}

// --- http_response ---------------------------------------------------------------------------

/// What a replica's response head says about its framing (RFC 9112 section 6.3), read
/// from httparse's fields independently of kvlb.
struct ResponseModel {
    /// A Content-Length that is not digits, or two that differ: the response is refused.
    invalid_length: bool,
    content_length: Option<u64>,
    /// Transfer-Encoding present, and its final coding (all fields make one list).
    te_seen: bool,
    te_final: Vec<u8>,
    close_token: bool,
    keep_alive_token: bool,
    /// The first 16 names listed in Connection (kvlb drops up to 16 such fields).
    named: Vec<Vec<u8>>,
}

fn trim_ows(v: &[u8]) -> &[u8] {
    let s = v
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(v.len());
    let e = v
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(s, |e| e + 1);
    &v[s..e]
}

fn response_model(headers: &[httparse::Header<'_>]) -> ResponseModel {
    let mut m = ResponseModel {
        invalid_length: false,
        content_length: None,
        te_seen: false,
        te_final: Vec::new(),
        close_token: false,
        keep_alive_token: false,
        named: Vec::new(),
    };
    for h in headers {
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            // 1*DIGIT (RFC 9110 section 8.6), at most 19 of them as for requests.
            let v = trim_ows(h.value);
            if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
                m.invalid_length = true;
                continue;
            }
            let n = std::str::from_utf8(v).unwrap().parse::<u64>().unwrap();
            if m.content_length.is_some_and(|c| c != n) {
                m.invalid_length = true;
            }
            m.content_length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            m.te_seen = true;
            for coding in h.value.split(|b| *b == b',').map(trim_ows) {
                if !coding.is_empty() {
                    m.te_final = coding.to_vec();
                }
            }
        } else if name.eq_ignore_ascii_case(b"connection") {
            for t in h.value.split(|b| *b == b',').map(trim_ows) {
                m.close_token |= t.eq_ignore_ascii_case(b"close");
                m.keep_alive_token |= t.eq_ignore_ascii_case(b"keep-alive");
                if !t.is_empty() && m.named.len() < 16 {
                    m.named.push(t.to_vec());
                }
            }
        }
    }
    m
}

/// Input: a byte of choices (bit 0: the request was HEAD, bit 1: the client connection
/// closes, bit 2: the client speaks HTTP/1.0, bits 3-4: the head size limit), then what the
/// replica sent.
pub fn http_response(data: &[u8]) {
    use kvlb::http::response::{parse_response, ClientFraming, ResponseBody, ResponseError};
    const REPLICA: &str = "http://10.0.0.7:8000";
    let Some((&choice, buf)) = data.split_first() else {
        return;
    };
    let client = ClientFraming {
        head_request: choice & 1 != 0,
        close: choice & 2 != 0,
        http10: choice & 4 != 0,
    };
    let max_head = [16, 256, 8192, 1 << 20][(choice >> 3) as usize % 4];
    let mut out = Vec::new();
    let got = parse_response(buf, max_head, REPLICA, &client, &mut out);

    let mut fields = [httparse::EMPTY_HEADER; 128];
    let mut resp = httparse::Response::new(&mut fields);
    let head_len = match resp.parse(buf) {
        Err(e) => {
            assert_eq!(got.err(), Some(ResponseError::Invalid), "httparse: {e}");
            return;
        }
        Ok(httparse::Status::Partial) => {
            let want = if buf.len() > max_head {
                ResponseError::TooLarge
            } else {
                ResponseError::Partial
            };
            assert_eq!(got.err(), Some(want), "an incomplete head");
            return;
        }
        Ok(httparse::Status::Complete(n)) => n,
    };
    let m = response_model(resp.headers);
    if m.invalid_length {
        assert_eq!(
            got.err(),
            Some(ResponseError::Invalid),
            "an invalid or conflicting Content-Length accepted: {:?}",
            String::from_utf8_lossy(&buf[..head_len])
        );
        return;
    }
    let head = got.unwrap_or_else(|e| {
        panic!(
            "refused ({e:?}) a head httparse reads: {:?}",
            String::from_utf8_lossy(&buf[..head_len])
        )
    });
    let status = resp.code.unwrap();
    assert!(head.head_len == head_len && head.head_len <= buf.len());
    assert_eq!(head.status, status);

    // The framing RFC 9112 section 6.3 gives, in its order: no body for HEAD, 1xx, 204, 304;
    // Transfer-Encoding over Content-Length, chunked only as the final coding, else until
    // close; then Content-Length; else until close.
    let chunked = m.te_final.eq_ignore_ascii_case(b"chunked");
    let body = if client.head_request || (100..200).contains(&status) || matches!(status, 204 | 304)
    {
        ResponseBody::None
    } else if m.te_seen && chunked {
        ResponseBody::Chunked
    } else if m.te_seen {
        ResponseBody::UntilClose
    } else if let Some(n) = m.content_length {
        ResponseBody::Length(n)
    } else {
        ResponseBody::UntilClose
    };
    let shown = || String::from_utf8_lossy(&buf[..head_len]).into_owned();
    assert_eq!(head.body, body, "framing of {:?}", shown());
    // HTTP/1.0 closes unless it asks to keep alive, and always with Transfer-Encoding
    // (RFC 9112 section 6.1); close wins over keep-alive.
    let minor = resp.version.unwrap();
    let close = m.close_token || (minor == 0 && (!m.keep_alive_token || m.te_seen));
    assert_eq!(
        head.reusable,
        !close && body != ResponseBody::UntilClose,
        "reuse of the replica connection after {:?}",
        shown()
    );

    // The head kvlb writes to the client: HTTP/1.1, the same status and reason, no hop-by-hop
    // field, and framed as kvlb relays the body.
    let mut out_fields = [httparse::EMPTY_HEADER; 140];
    let mut again = httparse::Response::new(&mut out_fields);
    assert_eq!(
        again.parse(&out),
        Ok(httparse::Status::Complete(out.len())),
        "the client's head does not parse: {:?}",
        String::from_utf8_lossy(&out)
    );
    assert_eq!((again.code, again.version), (Some(status), Some(1)));
    assert_eq!(again.reason, Some(resp.reason.unwrap_or("")));
    let dechunk = client.http10 && body == ResponseBody::Chunked;
    let client_close = client.close || body == ResponseBody::UntilClose || dechunk;
    let out_text = || String::from_utf8_lossy(&out).into_owned();
    for h in again.headers.iter() {
        let n = h.name.as_bytes();
        for hop in ["keep-alive", "proxy-connection", "upgrade", "te", "trailer"] {
            assert!(!n.eq_ignore_ascii_case(hop.as_bytes()), "{hop} forwarded");
        }
        if n.eq_ignore_ascii_case(b"connection") {
            let want: &[u8] = if client_close {
                b"close"
            } else {
                b"keep-alive"
            };
            assert_eq!(h.value, want, "a Connection field not kvlb's own");
        }
        // Framing fields stay whatever Connection names; kvlb's own Connection is checked above.
        let kept = n.eq_ignore_ascii_case(b"content-length")
            || n.eq_ignore_ascii_case(b"transfer-encoding")
            || n.eq_ignore_ascii_case(b"connection");
        assert!(
            kept || !m.named.iter().any(|x| x.eq_ignore_ascii_case(n)),
            "a field named in Connection forwarded: {}",
            out_text()
        );
        if n.eq_ignore_ascii_case(b"content-length") {
            assert!(
                matches!(body, ResponseBody::Length(_) | ResponseBody::None),
                "a {body:?} response also claims a length: {}",
                out_text()
            );
        }
    }
    assert!(again
        .headers
        .iter()
        .any(|h| h.name == "x-kvlb-replica" && h.value == REPLICA.as_bytes()));
    // kvlb's own reading of that head frames the body as kvlb sends it.
    if resp.headers.len() + 2 <= 128 {
        let plain = ClientFraming {
            head_request: client.head_request,
            close: false,
            http10: false,
        };
        let mut ignored = Vec::new();
        let seen = parse_response(&out, usize::MAX, REPLICA, &plain, &mut ignored)
            .unwrap_or_else(|e| panic!("kvlb refuses its own head ({e:?}): {}", out_text()));
        let want = if dechunk {
            ResponseBody::UntilClose
        } else {
            body
        };
        assert_eq!(seen.body, want, "the client frames {}", out_text());
        assert_eq!(
            seen.reusable,
            !client_close,
            "the client's reuse: {}",
            out_text()
        );
    }
    // The body after a chunked head, as the relay reads it.
    if body == ResponseBody::Chunked {
        let rest = &buf[head_len..];
        let mut dec = kvlb::http::chunked::ChunkedDecoder::new();
        if let Ok(used) = dec.feed(rest, |s, e| assert!(s <= e && e <= rest.len())) {
            assert!(used <= rest.len());
        }
    }
}
