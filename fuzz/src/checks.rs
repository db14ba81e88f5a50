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
//! - `kv_events`: a decoded batch re-encoded in either event format decodes to the same batch.
//!
//! Included by `tests/ops_fuzz_corpus.rs` too (as a module, by path): it uses only kvlb's own
//! dependencies.

use kvlb::http::chunked::{ChunkError, ChunkedDecoder};
use kvlb::http::request::{find_head_end, finish_upstream_head, parse_request, BodyFraming};
use kvlb::kv_events::{decode::decode_batch, encode::encode_batch, EventFormat, KvEventBatch};
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
    let endpoint = if choice & 1 == 0 {
        Endpoint::Completions
    } else {
        Endpoint::ChatCompletions
    };
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

/// A batch with `ts` compared by its bits (a NaN timestamp is still equal to itself).
fn comparable(batch: &KvEventBatch) -> (u64, String) {
    (
        batch.ts.to_bits(),
        format!("{:?} {:?}", batch.events, batch.dp_rank),
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
