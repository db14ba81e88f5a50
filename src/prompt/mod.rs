//! OpenAI request body -> canonical prompt prefix. Pure, no I/O, no allocation.
//!
//! kvlb routes a request to the replica that already holds most of its prompt in KV cache, so
//! it needs a name for "the prompt so far" that is the same for equal prompts however the client
//! wrote the JSON. This module owns that canonical form: it reads the raw body bytes of
//! `POST /v1/completions` or `POST /v1/chat/completions` (replica-interfaces.md section 3) and
//! streams the canonical prefix as pieces into a [`PromptSink`]; `prefix` cuts the stream into
//! blocks and hashes them.
//!
//! # Canonical form
//! Whatever order the keys come in, pieces come out in this order (`\0` is a NUL byte; strings
//! are JSON-decoded: `\n`, `\"`, `\uXXXX`, surrogate pairs, a lone surrogate -> U+FFFD, so equal
//! text is equal bytes however it was escaped):
//! 1. `\0model\0` model, then `\0cache_salt\0` salt when present (not null).
//! 2. `\0tools\0` and the `tools` value canonicalised when present: structural tokens, strings
//!    decoded between quote marks, numbers and literals as written, whitespace dropped.
//! 3. Chat: for each message, in order: `\0role:<role>\0`; the content (a string as is; of a part
//!    array, each `text` part's text with `\n` between text parts, each `image_url` part as
//!    `\0image_url\0<url>\0`, any other part as `\0part\0` + its canonical JSON); for each tool
//!    call `\0tool_call\0<function name>\0<arguments>`; `\0tool_call_id\0<id>`;
//!    `\0name\0<name>`. Nothing follows the last message, so the canonical bytes of a
//!    conversation are a prefix of those of its next turn (same model and tools, more messages).
//! 4. Completions with text: `\0prompt\0<text>` for the string, or for each string of a list.
//!
//! Completions whose `prompt` is token ids (a list of ints, or a list of lists: the first is
//! used) produce [`Piece::Token`]s only, no text: token-mode block hashes must equal the hashes
//! of the same ids in KV events, which know nothing of model or salt.
//!
//! # How
//! Two passes over the borrowed body, never a copy of it: the first validates the whole body
//! and records where the top-level values we need start (`model`, `cache_salt`, `tools`,
//! `messages`, `prompt`), the second emits from those positions in canonical order. Inside a
//! message (and a content part, and a tool call's function) a value is emitted as it is scanned
//! when every field before it in canonical order has been emitted already (`role` before
//! `content`, as clients usually write it), and otherwise recorded and re-scanned at the end of
//! the object. `messages` usually comes first in the body (the OpenAI clients send the caller's
//! keyword order, `messages` before `model`; `tools` anywhere), yet is emitted last: so the
//! first pass extracts it already and records its pieces (body ranges, decoded escapes and
//! markers copied) in scratch space, and the second pass replays them after model, salt and
//! tools, reading the prompt text once. A message whose string `content` comes before its
//! `role` (sorted keys, as Go and serde_json maps write them) is recorded as it is scanned and
//! its entries are moved behind the role's, so it too is read once. Escape-dense messages (a
//! piece every few bytes) and messages past the scratch space are only skimmed in the first
//! pass and scanned again in the second, as before; any error in `messages` falls back to that
//! path too, so results and errors are those of the plain two-pass reading (tested against
//! it). A token-id prompt needs nothing else from the body and is emitted during the first
//! pass. Strings are scanned 64 bytes at a time with SSE2 bit masks, long plain runs with AVX2
//! (see `scan`). Cost: see `prefix`; `benches/prefix.rs` and `benches/routing.rs`
//! (`full_path_part_hash_request_32k_chat`) measure the whole path.
//!
//! Anything that is not such a body (other path, invalid JSON, wrong types, missing fields,
//! duplicate keys we read, nesting deeper than [`MAX_DEPTH`], a cut-short body) is a
//! [`PromptError`], never a panic: the caller forwards it anyway and routes it without prefix
//! affinity. The scanner is iterative, so hostile nesting costs no stack.

mod scan;
#[cfg(test)]
pub(crate) mod tests;

use scan::Cursor;
pub use scan::MAX_DEPTH;
use std::fmt;

/// Which OpenAI endpoint a body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`: `prompt`.
    Completions,
    /// `POST /v1/chat/completions`: `messages`.
    ChatCompletions,
}

impl Endpoint {
    /// The endpoint of a request path (a query string is ignored), or `None` for other paths.
    pub fn from_path(path: &[u8]) -> Option<Endpoint> {
        let path = match path.iter().position(|&b| b == b'?') {
            Some(q) => &path[..q],
            None => path,
        };
        match path {
            b"/v1/completions" => Some(Endpoint::Completions),
            b"/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            _ => None,
        }
    }
}

/// What kind of prefix a body produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptForm {
    /// Canonical text bytes ([`Piece::Text`]).
    Text,
    /// Token ids ([`Piece::Token`]) from a completions prompt given as ids.
    Tokens,
}

/// One piece of the canonical prefix. A body yields text pieces or token pieces, never both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    Text(&'a [u8]),
    Token(u32),
}

/// Receives the canonical prefix as it is extracted. Pieces may be split anywhere: only their
/// concatenation is meaningful. Closures taking a [`Piece`] are sinks.
pub trait PromptSink {
    fn piece(&mut self, piece: Piece<'_>);
}

impl<F: FnMut(Piece<'_>)> PromptSink for F {
    #[inline(always)]
    fn piece(&mut self, piece: Piece<'_>) {
        self(piece)
    }
}

/// Why a body has no canonical prefix. Small and `Copy`: the request path counts these in a
/// metric (see [`PromptError::label`]) and routes the request without prefix affinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptError {
    /// Not `/v1/completions` or `/v1/chat/completions`.
    NotAPromptPath,
    /// The body ends inside a value (or is empty).
    Truncated,
    /// Not JSON at this byte offset.
    Syntax { offset: usize },
    /// Arrays and objects nested deeper than [`MAX_DEPTH`], at this byte offset.
    TooDeep { offset: usize },
    /// The body is JSON but not an object.
    NotAnObject,
    /// A required field is missing (or null).
    MissingField(&'static str),
    /// A field has the wrong JSON type (or a token id is not a u32).
    WrongType(&'static str),
    /// A field the prefix is built from appears twice in one object.
    DuplicateKey(&'static str),
    /// `prompt` is an empty list.
    EmptyPrompt,
}

impl PromptError {
    /// A short stable name, for metric labels.
    pub fn label(&self) -> &'static str {
        match self {
            PromptError::NotAPromptPath => "not_a_prompt_path",
            PromptError::Truncated => "truncated",
            PromptError::Syntax { .. } => "syntax",
            PromptError::TooDeep { .. } => "too_deep",
            PromptError::NotAnObject => "not_an_object",
            PromptError::MissingField(_) => "missing_field",
            PromptError::WrongType(_) => "wrong_type",
            PromptError::DuplicateKey(_) => "duplicate_key",
            PromptError::EmptyPrompt => "empty_prompt",
        }
    }
}

impl fmt::Display for PromptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PromptError::NotAPromptPath => {
                write!(
                    f,
                    "not a prompt path: expected /v1/completions or /v1/chat/completions"
                )
            }
            PromptError::Truncated => write!(f, "request body ends inside a JSON value"),
            PromptError::Syntax { offset } => {
                write!(f, "request body is not valid JSON at byte {offset}")
            }
            PromptError::TooDeep { offset } => write!(
                f,
                "request body nests arrays/objects deeper than {MAX_DEPTH} at byte {offset}"
            ),
            PromptError::NotAnObject => write!(f, "request body is not a JSON object"),
            PromptError::MissingField(field) => write!(f, "request field `{field}` is missing"),
            PromptError::WrongType(field) => {
                write!(f, "request field `{field}` has the wrong type")
            }
            PromptError::DuplicateKey(field) => {
                write!(f, "request field `{field}` appears twice")
            }
            PromptError::EmptyPrompt => write!(f, "request field `prompt` is an empty list"),
        }
    }
}

impl std::error::Error for PromptError {}

const MODEL: &[u8] = b"\x00model\x00";
const CACHE_SALT: &[u8] = b"\x00cache_salt\x00";
const TOOLS: &[u8] = b"\x00tools\x00";
const ROLE: &[u8] = b"\x00role:";
const END: &[u8] = b"\x00";
const PART_SEPARATOR: &[u8] = b"\n";
const IMAGE_URL: &[u8] = b"\x00image_url\x00";
const OTHER_PART: &[u8] = b"\x00part\x00";
const TOOL_CALL: &[u8] = b"\x00tool_call\x00";
const TOOL_CALL_ID: &[u8] = b"\x00tool_call_id\x00";
const NAME: &[u8] = b"\x00name\x00";
const PROMPT: &[u8] = b"\x00prompt\x00";

/// Streams the canonical prefix of `body` into `sink` and says which form it took.
///
/// On `Err`, some pieces may already have been emitted: the sink must discard them.
pub fn extract_prompt(
    endpoint: Endpoint,
    body: &[u8],
    sink: &mut impl PromptSink,
) -> Result<PromptForm, PromptError> {
    let mut entries = [0u64; STACK_ENTRIES];
    let mut arena = [0u8; STACK_ARENA];
    let mut record = Recording::new(body, &mut entries, &mut arena);
    extract(endpoint, body, &mut record, sink)
}

/// [`extract_prompt`] recording into `scratch`, which holds the messages of a whole long
/// conversation (the stack space of [`extract_prompt`] holds a few messages; the rest are
/// scanned twice). Same pieces, same result.
pub fn extract_prompt_with(
    endpoint: Endpoint,
    body: &[u8],
    scratch: &mut PromptScratch,
    sink: &mut impl PromptSink,
) -> Result<PromptForm, PromptError> {
    let mut record = Recording::new(body, &mut scratch.entries, &mut scratch.arena);
    extract(endpoint, body, &mut record, sink)
}

/// Recording space reused across requests (see [`extract_prompt_with`]); sized once.
pub struct PromptScratch {
    entries: Box<[u64]>,
    arena: Box<[u8]>,
}

impl PromptScratch {
    /// Space for `pieces` recorded pieces (about two per escape in the messages, one per
    /// plain run and marker), with 4 bytes of decoded text per piece.
    pub fn new(pieces: usize) -> PromptScratch {
        PromptScratch {
            entries: vec![0u64; pieces].into_boxed_slice(),
            arena: vec![0u8; pieces * 4].into_boxed_slice(),
        }
    }
}

/// Pieces recorded by [`extract_prompt`] on its stack.
const STACK_ENTRIES: usize = 256;
const STACK_ARENA: usize = 1024;

fn extract(
    endpoint: Endpoint,
    body: &[u8],
    record: &mut Recording<'_, '_>,
    sink: &mut impl PromptSink,
) -> Result<PromptForm, PromptError> {
    let fields = top_level(endpoint, body, record, sink)?;
    if fields.tokens_emitted {
        return Ok(PromptForm::Tokens);
    }
    if endpoint == Endpoint::Completions && fields.prompt.is_none() {
        return Err(PromptError::MissingField("prompt"));
    }

    let text = &mut |piece: &[u8]| sink.piece(Piece::Text(piece));
    text(MODEL);
    if let Some(start) = fields.model {
        string_or_null(&mut Cursor::new(body, start), "model", text)?;
    }
    if let Some(start) = fields.cache_salt {
        let mut c = Cursor::new(body, start);
        if !c.null()? {
            text(CACHE_SALT);
            string_or_null(&mut c, "cache_salt", text)?;
        }
    }
    if let Some(start) = fields.tools {
        let mut c = Cursor::new(body, start);
        if !c.null()? {
            if c.peek_token()? != b'[' {
                return Err(PromptError::WrongType("tools"));
            }
            text(TOOLS);
            c.value(1, text)?;
        }
    }
    match endpoint {
        Endpoint::ChatCompletions => {
            let start = fields
                .messages
                .ok_or(PromptError::MissingField("messages"))?;
            if record.complete {
                record.replay(text);
                if let Some(at) = record.resume {
                    messages_from(body, at, text)?;
                }
            } else {
                messages(body, start, text)?;
            }
        }
        Endpoint::Completions => {
            let start = fields.prompt.ok_or(PromptError::MissingField("prompt"))?;
            text_prompt(body, start, text)?;
        }
    }
    Ok(PromptForm::Text)
}

/// The canonical pieces of `messages`, recorded during the first pass so that the second pass
/// replays them instead of scanning the prompt text again (`messages` usually comes before
/// `model` and `tools`, which are emitted first). A piece that lies in the body is recorded as
/// its byte range (adjacent ranges merged), any other (markers, decoded escapes) is copied into
/// the arena. When the space runs out in message `k`, the pieces of messages `0..k` are kept,
/// the rest of the array is only skimmed as before, and the second pass scans from message `k`.
struct Recording<'s, 'b> {
    body: &'b [u8],
    /// Range: start | len << 32. Arena bytes: `INLINE` | offset | len << 32.
    entries: &'s mut [u64],
    arena: &'s mut [u8],
    len: usize,
    arena_len: usize,
    /// A new piece may merge into the last entry only when `len > barrier` (entries before
    /// the barrier are about to be moved as a unit).
    barrier: usize,
    overflowed: bool,
    /// The recorded pieces are those of all messages but the ones from this position on.
    complete: bool,
    resume: Option<usize>,
}

const INLINE: u64 = 1 << 63;
const LEN_MASK: u64 = 0x7fff_ffff;

impl<'s, 'b> Recording<'s, 'b> {
    fn new(body: &'b [u8], entries: &'s mut [u64], arena: &'s mut [u8]) -> Self {
        Recording {
            body,
            entries,
            arena,
            len: 0,
            arena_len: 0,
            barrier: 0,
            overflowed: false,
            complete: false,
            resume: None,
        }
    }

    /// Recording needs offsets and lengths that fit in 31 bits, and some space.
    fn usable(&self) -> bool {
        self.body.len() <= LEN_MASK as usize && !self.entries.is_empty()
    }

    #[inline(always)]
    fn push(&mut self, piece: &[u8]) {
        if self.overflowed || piece.is_empty() {
            return;
        }
        let base = self.body.as_ptr() as usize;
        let at = piece.as_ptr() as usize;
        if at >= base && at + piece.len() <= base + self.body.len() {
            let start = (at - base) as u64;
            if let Some(last) = self.mergeable_last() {
                let (last_start, last_len) = (*last & 0xffff_ffff, *last >> 32 & LEN_MASK);
                if *last & INLINE == 0 && last_start + last_len == start {
                    *last = last_start | (last_len + piece.len() as u64) << 32;
                    return;
                }
            }
            self.entry(start | (piece.len() as u64) << 32);
        } else {
            self.push_copy(piece);
        }
    }

    /// A piece that is not in the body: its bytes go into the arena.
    #[inline(never)]
    fn push_copy(&mut self, piece: &[u8]) {
        let offset = self.arena_len;
        let Some(dst) = self.arena.get_mut(offset..offset + piece.len()) else {
            self.overflowed = true;
            return;
        };
        scan::copy_short(dst, piece);
        self.arena_len += piece.len();
        if let Some(last) = self.mergeable_last() {
            let (last_offset, last_len) = (*last & 0xffff_ffff, *last >> 32 & LEN_MASK);
            if *last & INLINE != 0 && last_offset + last_len == offset as u64 {
                *last = INLINE | last_offset | (last_len + piece.len() as u64) << 32;
                return;
            }
        }
        self.entry(INLINE | offset as u64 | (piece.len() as u64) << 32);
    }

    /// The last entry, when a new piece may merge into it.
    #[inline(always)]
    fn mergeable_last(&mut self) -> Option<&mut u64> {
        if self.len > self.barrier {
            self.entries.get_mut(self.len - 1)
        } else {
            None
        }
    }

    /// Entries from here on are not merged into the ones before.
    #[inline(always)]
    fn seal(&mut self) -> usize {
        self.barrier = self.len;
        self.len
    }

    /// Moves `entries[first..mid]` behind `entries[mid..len]` (a content read before its role).
    fn move_behind(&mut self, first: usize, mid: usize) {
        if !self.overflowed && first <= mid && mid <= self.len {
            self.entries[first..self.len].rotate_left(mid - first);
        }
    }

    #[inline(always)]
    fn entry(&mut self, entry: u64) {
        match self.entries.get_mut(self.len) {
            Some(slot) => {
                *slot = entry;
                self.len += 1;
            }
            None => self.overflowed = true,
        }
    }

    fn replay(&self, text: &mut impl FnMut(&[u8])) {
        for &entry in &self.entries[..self.len] {
            let start = (entry & 0xffff_ffff) as usize;
            let len = (entry >> 32 & LEN_MASK) as usize;
            if entry & INLINE == 0 {
                text(&self.body[start..start + len]);
            } else {
                text(&self.arena[start..start + len]);
            }
        }
    }
}

/// Messages stop being recorded once they average a piece per this many bytes (past some
/// slack for short messages, whose markers are pieces too): prose has one per ~100 bytes,
/// escaped code one per ~10.
const DENSE_BYTES: usize = 32;
const DENSE_SLACK: usize = 2048;

/// First pass over `messages` (the cursor on its value): records its pieces where it can, and
/// otherwise (any error, any value that is not an array of messages) skims it exactly as
/// without recording, leaving the error to the second pass.
fn record_messages(c: &mut Cursor<'_>, record: &mut Recording<'_, '_>) -> Result<(), PromptError> {
    let start = c.pos;
    if record.usable() {
        let recorded = (|| {
            if c.peek_token()? != b'[' {
                return Err(PromptError::WrongType("messages"));
            }
            let mut dense = false;
            c.array(1, |c, _| {
                if record.resume.is_none() && dense {
                    // Escape-dense text: a piece every few bytes costs more to record and
                    // replay than a second scan, so the rest is scanned again.
                    record.resume = Some(c.pos);
                }
                if record.resume.is_some() {
                    return c.skim(MESSAGE_DEPTH - 1);
                }
                let (at, len, arena_len) = (c.pos, record.len, record.arena_len);
                // The last entry may grow by merging with this message's first piece.
                let last = len.checked_sub(1).map(|i| record.entries[i]);
                let result = message_recorded(c, record);
                if record.overflowed {
                    // Out of space: keep the messages before this one.
                    record.len = len;
                    record.arena_len = arena_len;
                    if let Some(last) = last {
                        record.entries[len - 1] = last;
                    }
                    record.resume = Some(at);
                    c.pos = at;
                    return c.skim(MESSAGE_DEPTH - 1);
                }
                dense = record.len * DENSE_BYTES > c.pos - start + DENSE_SLACK;
                result
            })
        })();
        if recorded.is_ok() {
            record.complete = true;
            return Ok(());
        }
        record.len = 0;
        record.arena_len = 0;
        record.barrier = 0;
        record.resume = None;
        record.overflowed = false;
        c.pos = start;
    }
    c.skim(1)
}

/// Where the top-level values the prefix is built from start.
#[derive(Default)]
struct TopLevel {
    model: Option<usize>,
    cache_salt: Option<usize>,
    tools: Option<usize>,
    messages: Option<usize>,
    prompt: Option<usize>,
    /// A completions prompt of token ids was emitted during this pass (token mode needs nothing
    /// else from the body, so it takes one pass).
    tokens_emitted: bool,
}

/// First pass: validate the whole body and record where the wanted values start; token-id
/// prompts are emitted on the way.
fn top_level(
    endpoint: Endpoint,
    body: &[u8],
    record: &mut Recording<'_, '_>,
    sink: &mut impl PromptSink,
) -> Result<TopLevel, PromptError> {
    let mut c = Cursor::new(body, 0);
    if c.peek_token()? != b'{' {
        // Distinguish "some other JSON" from "not JSON at all" for the metric.
        let at = c.pos;
        c.skip(0)?;
        c.skip_ws();
        return Err(if c.pos == body.len() {
            PromptError::NotAnObject
        } else {
            PromptError::Syntax {
                offset: at.max(c.pos),
            }
        });
    }
    let mut fields = TopLevel::default();
    c.object(0, |c, key| {
        c.skip_ws();
        let slot = match key {
            b"model" => Some((&mut fields.model, "model")),
            b"cache_salt" => Some((&mut fields.cache_salt, "cache_salt")),
            b"tools" => Some((&mut fields.tools, "tools")),
            b"messages" => Some((&mut fields.messages, "messages")),
            b"prompt" => Some((&mut fields.prompt, "prompt")),
            _ => None,
        };
        if let Some((slot, name)) = slot {
            if slot.is_some() {
                return Err(PromptError::DuplicateKey(name));
            }
            *slot = Some(c.pos);
            if name == "prompt"
                && endpoint == Endpoint::Completions
                && prompt_form(c.buf, c.pos)? == PromptForm::Tokens
            {
                fields.tokens_emitted = true;
                return token_prompt(c, sink);
            }
            // The big values the second pass reads in full (escapes included) are only skimmed
            // here; the rest is checked now, whatever the second pass does.
            if endpoint == Endpoint::ChatCompletions && name == "messages" {
                return record_messages(c, record);
            }
            let reread = match endpoint {
                Endpoint::ChatCompletions => matches!(name, "messages" | "tools"),
                Endpoint::Completions => name == "prompt",
            };
            if reread {
                return c.skim(1);
            }
        }
        c.skip(1)
    })?;
    c.skip_ws();
    if c.pos != body.len() {
        return Err(c.syntax());
    }
    Ok(fields)
}

/// A string value (emitted decoded) or null (nothing); anything else is the wrong type.
fn string_or_null(
    c: &mut Cursor<'_>,
    field: &'static str,
    text: &mut impl FnMut(&[u8]),
) -> Result<(), PromptError> {
    match c.peek_token()? {
        b'"' => c.string(text),
        b'n' => c.null().map(|_| ()),
        _ => Err(PromptError::WrongType(field)),
    }
}

/// Fields that arrive in any order but are emitted in a fixed one. A field whose turn it is
/// (all earlier ones emitted) is emitted as it is scanned; a field that comes early is recorded
/// and emitted from its recorded position once the object has been read.
struct Stages<const N: usize> {
    /// Fields 0..next have been emitted.
    next: usize,
    /// Where recorded fields start.
    pending: [Option<usize>; N],
}

impl<const N: usize> Stages<N> {
    fn new() -> Self {
        Stages {
            next: 0,
            pending: [None; N],
        }
    }

    /// Field `stage` starts at `pos`: true if it is its turn (emit it now), false if recorded
    /// (the caller skips it).
    fn arrive(
        &mut self,
        stage: usize,
        pos: usize,
        name: &'static str,
    ) -> Result<bool, PromptError> {
        if stage < self.next || self.pending[stage].is_some() {
            return Err(PromptError::DuplicateKey(name));
        }
        if stage == self.next {
            self.next += 1;
            Ok(true)
        } else {
            self.pending[stage] = Some(pos);
            Ok(false)
        }
    }

    /// Recorded fields not emitted yet, in canonical order.
    fn leftovers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (self.next..N).filter_map(move |s| self.pending[s].map(|pos| (s, pos)))
    }
}

// Message fields in canonical order.
const M_ROLE: usize = 0;
const M_CONTENT: usize = 1;
const M_TOOL_CALLS: usize = 2;
const M_TOOL_CALL_ID: usize = 3;
const M_NAME: usize = 4;
const MESSAGE_FIELDS: usize = 5;

/// Depth of a message object's values: top object (1) > messages array (2) > message (3).
const MESSAGE_DEPTH: usize = 3;

fn messages(body: &[u8], start: usize, text: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
    let mut c = Cursor::new(body, start);
    if c.peek_token()? != b'[' {
        return Err(PromptError::WrongType("messages"));
    }
    c.array(1, |c, _| message(c, text))
}

/// The messages from one at `at` (after `[` or a comma) to the end of the array.
fn messages_from(body: &[u8], at: usize, text: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
    let mut c = Cursor::new(body, at);
    loop {
        message(&mut c, text)?;
        match c.peek_token()? {
            b',' => c.pos += 1,
            b']' => return Ok(()),
            _ => return Err(c.syntax()),
        }
    }
}

/// The stage and error name of a message key kvlb reads (None: skipped).
fn message_key(key: &[u8]) -> Option<(usize, &'static str)> {
    Some(match key {
        b"role" => (M_ROLE, "messages[].role"),
        b"content" => (M_CONTENT, "messages[].content"),
        b"tool_calls" => (M_TOOL_CALLS, "messages[].tool_calls"),
        b"tool_call_id" => (M_TOOL_CALL_ID, "messages[].tool_call_id"),
        b"name" => (M_NAME, "messages[].name"),
        _ => return None,
    })
}

fn message(c: &mut Cursor<'_>, text: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[]"));
    }
    let mut stages = Stages::<MESSAGE_FIELDS>::new();
    c.object(MESSAGE_DEPTH - 1, |c, key| {
        c.skip_ws();
        let Some((stage, name)) = message_key(key) else {
            return c.skip(MESSAGE_DEPTH);
        };
        if stages.arrive(stage, c.pos, name)? {
            message_field(c, stage, text)
        } else {
            c.skip(MESSAGE_DEPTH)
        }
    })?;
    if stages.next == M_ROLE && stages.pending[M_ROLE].is_none() {
        return Err(PromptError::MissingField("messages[].role"));
    }
    for (stage, pos) in stages.leftovers() {
        message_field(&mut Cursor::new(c.buf, pos), stage, text)?;
    }
    Ok(())
}

/// [`message`] for the first pass, into `record`. A string `content` that comes before `role`
/// (bodies whose keys are sorted, as Go and serde_json maps write them) is recorded as it is
/// scanned and its entries are moved behind the role's once the role is read, instead of
/// being skipped and scanned again. The same pieces as [`message`] whenever it succeeds; on an
/// error the caller falls back to the plain reading, which reports it.
fn message_recorded(c: &mut Cursor<'_>, record: &mut Recording<'_, '_>) -> Result<(), PromptError> {
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[]"));
    }
    let mut stages = Stages::<MESSAGE_FIELDS>::new();
    // Entries `first..end` of `record` hold a content read before the role.
    let mut early: Option<(usize, usize)> = None;
    c.object(MESSAGE_DEPTH - 1, |c, key| {
        c.skip_ws();
        let Some((stage, name)) = message_key(key) else {
            return c.skip(MESSAGE_DEPTH);
        };
        if stage == M_CONTENT && early.is_some() {
            return Err(PromptError::DuplicateKey(name));
        }
        if stage == M_CONTENT
            && stages.next == M_ROLE
            && stages.pending[M_CONTENT].is_none()
            && c.peek()? == b'"'
        {
            let first = record.seal();
            c.string(&mut |piece: &[u8]| record.push(piece))?;
            early = Some((first, record.seal()));
            return Ok(());
        }
        if stages.arrive(stage, c.pos, name)? {
            message_field(c, stage, &mut |piece: &[u8]| record.push(piece))?;
            if let (M_ROLE, Some((first, end))) = (stage, early) {
                record.move_behind(first, end);
                stages.next = M_TOOL_CALLS;
            }
            Ok(())
        } else {
            c.skip(MESSAGE_DEPTH)
        }
    })?;
    if stages.next == M_ROLE && stages.pending[M_ROLE].is_none() {
        return Err(PromptError::MissingField("messages[].role"));
    }
    for (stage, pos) in stages.leftovers() {
        message_field(
            &mut Cursor::new(c.buf, pos),
            stage,
            &mut |piece: &[u8]| record.push(piece),
        )?;
    }
    Ok(())
}

/// Emits one message field, the cursor on its value.
fn message_field(
    c: &mut Cursor<'_>,
    stage: usize,
    text: &mut impl FnMut(&[u8]),
) -> Result<(), PromptError> {
    match stage {
        M_ROLE => {
            if c.peek_token()? != b'"' {
                return Err(PromptError::WrongType("messages[].role"));
            }
            text(ROLE);
            c.string(text)?;
            text(END);
            Ok(())
        }
        M_CONTENT => match c.peek_token()? {
            b'"' => c.string(text),
            b'n' => c.null().map(|_| ()),
            b'[' => {
                let mut text_parts = 0usize;
                c.array(MESSAGE_DEPTH, |c, _| content_part(c, &mut text_parts, text))
            }
            _ => Err(PromptError::WrongType("messages[].content")),
        },
        M_TOOL_CALLS => match c.peek_token()? {
            b'n' => c.null().map(|_| ()),
            b'[' => c.array(MESSAGE_DEPTH, |c, _| tool_call(c, text)),
            _ => Err(PromptError::WrongType("messages[].tool_calls")),
        },
        M_TOOL_CALL_ID | M_NAME => {
            let (marker, field) = if stage == M_NAME {
                (NAME, "messages[].name")
            } else {
                (TOOL_CALL_ID, "messages[].tool_call_id")
            };
            if c.null()? {
                return Ok(());
            }
            if c.peek_token()? != b'"' {
                return Err(PromptError::WrongType(field));
            }
            text(marker);
            c.string(text)
        }
        _ => c.skip(MESSAGE_DEPTH),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PartType {
    Unknown,
    Text,
    ImageUrl,
    Other,
}

/// Depth of a content part's values: message (3) > content array (4) > part (5).
const PART_DEPTH: usize = MESSAGE_DEPTH + 2;

/// One element of a content array; `text_parts` counts text parts emitted so far in it.
fn content_part(
    c: &mut Cursor<'_>,
    text_parts: &mut usize,
    text: &mut impl FnMut(&[u8]),
) -> Result<(), PromptError> {
    let part_start = c.pos;
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[].content[]"));
    }
    let mut kind = PartType::Unknown;
    let mut text_at = None;
    let mut image_at = None;
    let mut streamed = false;
    c.object(PART_DEPTH - 1, |c, key| {
        c.skip_ws();
        match key {
            b"type" => {
                if kind != PartType::Unknown {
                    return Err(PromptError::DuplicateKey("messages[].content[].type"));
                }
                if c.peek_token()? != b'"' {
                    return Err(PromptError::WrongType("messages[].content[].type"));
                }
                let mut name = [0u8; 10];
                let mut len = 0usize;
                c.string(&mut |p: &[u8]| {
                    for &b in p {
                        if let Some(slot) = name.get_mut(len) {
                            *slot = b;
                        }
                        len += 1;
                    }
                })?;
                kind = match name.get(..len) {
                    Some(b"text") => PartType::Text,
                    Some(b"image_url") => PartType::ImageUrl,
                    _ => PartType::Other,
                };
                Ok(())
            }
            b"text" => {
                if text_at.is_some() {
                    return Err(PromptError::DuplicateKey("messages[].content[].text"));
                }
                text_at = Some(c.pos);
                if kind == PartType::Text {
                    // Its turn: emit while scanning.
                    streamed = true;
                    part_text(c, text_parts, text)
                } else {
                    c.skip(PART_DEPTH)
                }
            }
            b"image_url" => {
                if image_at.is_some() {
                    return Err(PromptError::DuplicateKey("messages[].content[].image_url"));
                }
                image_at = Some(c.pos);
                c.skip(PART_DEPTH)
            }
            _ => c.skip(PART_DEPTH),
        }
    })?;
    let buf = c.buf;
    // A part without "type" is read by its payload, as servers do.
    if kind == PartType::Unknown {
        kind = if text_at.is_some() {
            PartType::Text
        } else if image_at.is_some() {
            PartType::ImageUrl
        } else {
            PartType::Other
        };
    }
    match kind {
        PartType::Text => {
            if !streamed {
                let at = text_at.ok_or(PromptError::MissingField("messages[].content[].text"))?;
                part_text(&mut Cursor::new(buf, at), text_parts, text)?;
            }
        }
        PartType::ImageUrl => {
            let at = image_at.ok_or(PromptError::MissingField("messages[].content[].image_url"))?;
            image_url(&mut Cursor::new(buf, at), text)?;
        }
        _ => {
            text(OTHER_PART);
            Cursor::new(buf, part_start).value(PART_DEPTH - 1, text)?;
        }
    }
    Ok(())
}

/// A text part's `text`, with `\n` before every text part but the first.
fn part_text(
    c: &mut Cursor<'_>,
    text_parts: &mut usize,
    text: &mut impl FnMut(&[u8]),
) -> Result<(), PromptError> {
    if c.peek_token()? != b'"' {
        return Err(PromptError::WrongType("messages[].content[].text"));
    }
    if *text_parts > 0 {
        text(PART_SEPARATOR);
    }
    *text_parts += 1;
    c.string(text)
}

/// `image_url`: `{"url": ..., "detail": ...}` or a bare URL string.
fn image_url(c: &mut Cursor<'_>, text: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
    const FIELD: &str = "messages[].content[].image_url.url";
    match c.peek_token()? {
        b'"' => {
            text(IMAGE_URL);
            c.string(text)?;
            text(END);
            Ok(())
        }
        b'{' => {
            let mut url_at = None;
            c.object(PART_DEPTH, |c, key| {
                c.skip_ws();
                if key == b"url" {
                    if url_at.is_some() {
                        return Err(PromptError::DuplicateKey(FIELD));
                    }
                    url_at = Some(c.pos);
                }
                c.skip(PART_DEPTH + 1)
            })?;
            let at = url_at.ok_or(PromptError::MissingField(FIELD))?;
            let mut u = Cursor::new(c.buf, at);
            if u.peek_token()? != b'"' {
                return Err(PromptError::WrongType(FIELD));
            }
            text(IMAGE_URL);
            u.string(text)?;
            text(END);
            Ok(())
        }
        _ => Err(PromptError::WrongType("messages[].content[].image_url")),
    }
}

// Function fields in canonical order.
const F_NAME: usize = 0;
const F_ARGUMENTS: usize = 1;

/// Depth of a tool call's values: message (3) > tool_calls array (4) > call (5).
const CALL_DEPTH: usize = MESSAGE_DEPTH + 2;

/// One element of `tool_calls`: `\0tool_call\0<name>\0<arguments>`.
fn tool_call(c: &mut Cursor<'_>, text: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[].tool_calls[]"));
    }
    let mut function_at = None;
    c.object(CALL_DEPTH - 1, |c, key| {
        c.skip_ws();
        if key == b"function" {
            if function_at.is_some() {
                return Err(PromptError::DuplicateKey(
                    "messages[].tool_calls[].function",
                ));
            }
            function_at = Some(c.pos);
            // Emitted from here: nothing else of the call is part of the prefix.
            text(TOOL_CALL);
            function(c, text)
        } else {
            c.skip(CALL_DEPTH)
        }
    })?;
    if function_at.is_none() {
        return Err(PromptError::MissingField(
            "messages[].tool_calls[].function",
        ));
    }
    Ok(())
}

/// A tool call's `function`: name, then arguments (a string, or any JSON canonicalised).
fn function(c: &mut Cursor<'_>, text: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
    const DEPTH: usize = CALL_DEPTH + 1;
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[].tool_calls[].function"));
    }
    let mut stages = Stages::<2>::new();
    c.object(DEPTH - 1, |c, key| {
        c.skip_ws();
        let (stage, name) = match key {
            b"name" => (F_NAME, "messages[].tool_calls[].function.name"),
            b"arguments" => (F_ARGUMENTS, "messages[].tool_calls[].function.arguments"),
            _ => return c.skip(DEPTH),
        };
        if stages.arrive(stage, c.pos, name)? {
            function_field(c, stage, text)
        } else {
            c.skip(DEPTH)
        }
    })?;
    if stages.next == F_NAME && stages.pending[F_NAME].is_none() {
        return Err(PromptError::MissingField(
            "messages[].tool_calls[].function.name",
        ));
    }
    for (stage, pos) in stages.leftovers() {
        function_field(&mut Cursor::new(c.buf, pos), stage, text)?;
    }
    Ok(())
}

fn function_field(
    c: &mut Cursor<'_>,
    stage: usize,
    text: &mut impl FnMut(&[u8]),
) -> Result<(), PromptError> {
    if stage == F_NAME {
        if c.peek_token()? != b'"' {
            return Err(PromptError::WrongType(
                "messages[].tool_calls[].function.name",
            ));
        }
        c.string(text)?;
        text(END);
        Ok(())
    } else if c.peek_token()? == b'"' {
        c.string(text)
    } else {
        c.value(CALL_DEPTH + 1, text)
    }
}

/// Looks at a completions `prompt` value's shape: text or token ids.
fn prompt_form(body: &[u8], start: usize) -> Result<PromptForm, PromptError> {
    let mut c = Cursor::new(body, start);
    match c.peek_token()? {
        b'"' => Ok(PromptForm::Text),
        b'[' => {
            c.pos += 1;
            match c.peek_token()? {
                b']' => Err(PromptError::EmptyPrompt),
                b'"' => Ok(PromptForm::Text),
                b'[' | b'-' | b'0'..=b'9' => Ok(PromptForm::Tokens),
                _ => Err(PromptError::WrongType("prompt")),
            }
        }
        b'n' => Err(PromptError::MissingField("prompt")),
        _ => Err(PromptError::WrongType("prompt")),
    }
}

/// A text `prompt`: one string or a list of strings, each as `\0prompt\0<text>`.
fn text_prompt(body: &[u8], start: usize, text: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
    let mut c = Cursor::new(body, start);
    if c.peek_token()? == b'"' {
        text(PROMPT);
        return c.string(text);
    }
    c.array(1, |c, _| {
        if c.peek_token()? != b'"' {
            return Err(PromptError::WrongType("prompt[]"));
        }
        text(PROMPT);
        c.string(text)
    })
}

/// A token `prompt` at the cursor: a list of ids, or a list of lists of which the first is
/// used (the others are checked). Leaves the cursor after the value.
fn token_prompt(c: &mut Cursor<'_>, sink: &mut impl PromptSink) -> Result<(), PromptError> {
    let mut probe = Cursor::new(c.buf, c.pos);
    probe.skip_ws();
    probe.pos += 1;
    let nested = probe.peek_token()? == b'[';
    c.array(1, |c, index| {
        if (c.peek_token()? == b'[') != nested {
            return Err(PromptError::WrongType("prompt[]"));
        }
        if !nested {
            sink.piece(Piece::Token(token_id(c)?));
            return Ok(());
        }
        let mut count = 0usize;
        c.array(2, |c, _| {
            count += 1;
            let id = token_id(c)?;
            if index == 0 {
                sink.piece(Piece::Token(id));
            }
            Ok(())
        })?;
        if count == 0 {
            return Err(PromptError::EmptyPrompt);
        }
        Ok(())
    })
}

/// A token id: a non-negative integer that fits in a u32 (a float, a negative number or a
/// larger one is the wrong type). Digits are read in place, without a second pass.
#[inline]
fn token_id(c: &mut Cursor<'_>) -> Result<u32, PromptError> {
    const WRONG: PromptError = PromptError::WrongType("prompt[]");
    c.skip_ws();
    let buf = c.buf;
    let start = c.pos;
    let mut i = start;
    let mut id: u64 = 0;
    while let Some(&d) = buf.get(i) {
        let digit = d.wrapping_sub(b'0');
        if digit > 9 {
            break;
        }
        id = id * 10 + digit as u64;
        i += 1;
        if i - start > 10 {
            return Err(WRONG);
        }
    }
    match buf.get(i) {
        None => return Err(PromptError::Truncated),
        Some(b'.' | b'e' | b'E') => return Err(WRONG),
        Some(_) => {}
    }
    if i == start {
        return Err(if buf.get(i) == Some(&b'-') {
            WRONG
        } else {
            c.syntax()
        });
    }
    if buf[start] == b'0' && i - start > 1 {
        return Err(PromptError::Syntax { offset: start });
    }
    if id > u32::MAX as u64 {
        return Err(WRONG);
    }
    c.pos = i;
    Ok(id as u32)
}
