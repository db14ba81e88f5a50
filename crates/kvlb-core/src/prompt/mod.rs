//! API request body -> canonical prompt prefix. Pure, no I/O, no allocation.
//!
//! kvlb routes a request to the replica that already holds most of its prompt in KV cache, so
//! it needs a name for "the prompt so far" that is the same for equal prompts however the client
//! wrote the JSON. This module owns that canonical form: it reads the raw body bytes of
//! `POST /v1/completions` or `POST /v1/chat/completions` (replica-interfaces.md section 3),
//! `POST /v1/responses` (OpenAI's Responses API) or `POST /v1/messages` (Anthropic's Messages
//! API) and streams the canonical prefix as pieces into a [`PromptSink`]; `prefix` cuts the
//! stream into blocks and hashes them.
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
//! 5. Responses: `instructions` as a system message (`\0role:system\0<text>`, as vLLM renders
//!    it), then `input`: a string as a user message; of a list, each item whose `type` is absent
//!    or `message` as a chat message, any other item (function calls and their outputs,
//!    reasoning, ...) as `\0item\0` + its canonical JSON.
//! 6. Messages: `system` as a system message (a string, or its blocks as content parts; a text
//!    block starting with `x-anthropic-billing-header`, a per-request hash some agents send, is
//!    left out as vLLM leaves it out), then `messages` as chat messages.
//!
//! In content parts, `input_text` and `output_text` parts are text parts; Anthropic's
//! `tool_use` block is `\0tool_call\0<name>\0<canonical input>`, its `tool_result` block
//! `\0tool_call_id\0<tool_use_id>\0` + its content (a string, or text blocks with `\n` between
//! them and other blocks as below); any other part's canonical JSON leaves out its
//! `cache_control` member, the prompt caching marker agents move to the newest block every
//! turn. So each of the three conversational APIs has the prefix property of chat: a turn's
//! canonical bytes are a prefix of the next turn's. A Responses request that continues with
//! `previous_response_id` carries only its new input: its history is on the replica that
//! stored the previous response, where kvlb sends it (`affinity`).
//!
//! Completions whose `prompt` is token ids (a list of ints, or a list of lists: the first is
//! used) produce [`Piece::Token`]s only, no text: token-mode block hashes must equal the hashes
//! of the same ids in KV events. The decoded `model` and `cache_salt`, which name a block's
//! adapter and salt, go to [`PromptSink::field`] in either form.
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
//!
//! # Bounds
//! The work is linear in the body, 3-9 ns a byte where the body is dense with structure or
//! escapes, and a worker does it in one piece before the routing decision: unbounded, one body
//! of a million tiny messages (30 MB) held up its worker's other clients for 90-245 ms.
//! [`extract_prompt_within`] stops at the first of these [`PromptLimits`] and says which
//! ([`Bound`]); the pieces emitted until then are exactly the first ones of the canonical
//! prefix, so a request cut short still routes on its first blocks:
//! - `max_tokens`: as many token ids; text stops once its sink is full ([`PromptSink::full`]:
//!   `prefix` hashes 4 canonical bytes a token, the text-mode estimate). Set from the longest
//!   context a model of the fleet holds: blocks beyond it name KV that no replica can hold.
//! - `max_messages` messages and `max_parts` content parts and tool calls: 4096 and 16384, far
//!   above real conversations (the Mooncake chat trace's longest runs 43 turns; agent sessions
//!   reach a few hundred tool calls before their context fills) and a millisecond or two of
//!   the densest messages.
//! - `max_work` units of scanning in each pass: one a 64-byte stretch of a string that is not
//!   plain text, one an escape, one a token of canonical JSON (tools, other parts), four an
//!   object member. Bounds escape- and structure-dense text below the token bound (a unit costs
//!   3-9 ns; ordinary text has one per 10-100 bytes), charged where the scanner loops anyway.
//! - `max_validated_bytes`: values the prefix is not built from are validated up to this many
//!   bytes in all, then crossed with the structural skim ([`scan::close_levels`]: strings and
//!   brackets from bit masks, about 0.1 ns a byte, nothing checked).
//!
//! When a bound stops the first pass inside `messages`, the rest of the array is crossed with
//! the structural skim to find the top-level fields after it (model, salt and tools come first
//! in the canonical form but often last in the body), with `TAIL_WORK` members to read them.
//! A bound reached at the top level before those fields are known leaves no prefix at all
//! ([`Extent::Unknown`]). Bodies under every bound give exactly what they gave before;
//! [`extract_prompt`] and [`extract_prompt_with`] have no bounds.

#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

// SIMD (SSE2, AVX2) scans for JSON string ends and escapes, behind runtime CPU feature
// checks: the intrinsics and `#[target_feature]` functions are unsafe. The one module of
// prompt that may use it.
#[allow(unsafe_code)]
mod scan;
#[cfg(test)]
pub(crate) mod tests;

pub use scan::MAX_DEPTH;
use scan::{Cursor, Emit, STOP};
use std::fmt;

/// Which API endpoint a body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`: `prompt`.
    Completions,
    /// `POST /v1/chat/completions`: `messages`.
    ChatCompletions,
    /// `POST /v1/responses` (OpenAI's Responses API): `instructions` and `input`.
    Responses,
    /// `POST /v1/messages` (Anthropic's Messages API): `system` and `messages`.
    Messages,
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
            b"/v1/responses" => Some(Endpoint::Responses),
            b"/v1/messages" => Some(Endpoint::Messages),
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

    /// A piece of the decoded `model`, `cache_salt` or `lora_path` string, which name a block
    /// besides its tokens (the adapter and the salt): given for both forms once the first pass has read
    /// the body, each field's pieces in order (a token-id prompt's tokens come before them).
    #[inline(always)]
    fn field(&mut self, _field: Field, _piece: &[u8]) {}

    /// True once the sink wants no more text: [`extract_prompt_within`] then stops at its next
    /// check ([`Bound::Tokens`]; a few more pieces may come before it).
    #[inline(always)]
    fn full(&self) -> bool {
        false
    }
}

impl<F: FnMut(Piece<'_>)> PromptSink for F {
    #[inline(always)]
    fn piece(&mut self, piece: Piece<'_>) {
        self(piece)
    }
}

/// A top-level string field given to [`PromptSink::field`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Model,
    CacheSalt,
    /// SGLang's `lora_path`: the adapter's name, when `model` names none.
    LoraPath,
}

/// The bound that stopped an extraction (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// `max_tokens`: token ids, or a full sink ([`PromptSink::full`]).
    Tokens,
    /// `max_messages`.
    Messages,
    /// `max_parts`: content parts and tool calls.
    Parts,
    /// `max_work`: escapes, stretches of strings, JSON tokens and object members.
    Work,
}

impl Bound {
    pub const ALL: [Bound; 4] = [Bound::Tokens, Bound::Messages, Bound::Parts, Bound::Work];

    /// A short stable name, for metric labels.
    pub fn label(self) -> &'static str {
        match self {
            Bound::Tokens => "tokens",
            Bound::Messages => "messages",
            Bound::Parts => "parts",
            Bound::Work => "work",
        }
    }
}

/// Bounds on one extraction (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLimits {
    /// Longest prompt read: a token-id prompt stops after this many ids (text stops when the
    /// sink is full: [`crate::prefix::hash_request_within`] takes 4 bytes a token).
    pub max_tokens: usize,
    /// Messages of a chat read at most.
    pub max_messages: usize,
    /// Content parts and tool calls read at most, over all messages.
    pub max_parts: usize,
    /// Units of scanning at most, in each of the two passes (see the module header).
    pub max_work: usize,
    /// Bytes of values validated without being read (all of them together); past them such
    /// values are crossed with the structural skim.
    pub max_validated_bytes: usize,
}

/// Default `max_tokens`: the longest context of current models (1M tokens).
pub const DEFAULT_MAX_TOKENS: usize = 1 << 20;
/// Default `max_messages`.
pub const DEFAULT_MAX_MESSAGES: usize = 4096;
/// Default `max_parts`.
pub const DEFAULT_MAX_PARTS: usize = 16384;
/// Default `max_work`: about 2.5 ms of the densest input a pass, and above the units of 1M
/// tokens of JSON-escaped code (an escape every 18 bytes).
pub const DEFAULT_MAX_WORK: usize = 1 << 19;
/// Default `max_validated_bytes`: about 1 ms of the densest JSON.
pub const DEFAULT_MAX_VALIDATED_BYTES: usize = 256 << 10;

/// Work units of an object member: reading a key and skipping a small value costs about four
/// times an escape (20 ns against 5).
const MEMBER_WORK: usize = 4;

/// Members of the top-level object the first pass may still read after a bound stopped it in
/// `messages` (the fields that follow it; an OpenAI request has a few dozen at most).
const TAIL_WORK: usize = 1024;

impl Default for PromptLimits {
    fn default() -> Self {
        PromptLimits::for_tokens(DEFAULT_MAX_TOKENS)
    }
}

impl PromptLimits {
    /// No bounds: what [`extract_prompt`] reads.
    pub const UNLIMITED: PromptLimits = PromptLimits {
        max_tokens: usize::MAX,
        max_messages: usize::MAX,
        max_parts: usize::MAX,
        max_work: usize::MAX,
        max_validated_bytes: usize::MAX,
    };

    /// The default bounds with prompts of at most `max_tokens` tokens.
    pub fn for_tokens(max_tokens: usize) -> PromptLimits {
        PromptLimits {
            max_tokens,
            max_messages: DEFAULT_MAX_MESSAGES,
            max_parts: DEFAULT_MAX_PARTS,
            max_work: DEFAULT_MAX_WORK,
            max_validated_bytes: DEFAULT_MAX_VALIDATED_BYTES,
        }
    }
}

/// How much of a body's prompt [`extract_prompt_within`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// All of it.
    Whole,
    /// The bound stopped it: the pieces are the first ones of the canonical prefix.
    Prefix(Bound),
    /// The bound stopped it before the fields the prefix starts with were all found: the sink
    /// must discard the pieces, the request has no prefix.
    Unknown(Bound),
}

/// Why a body has no canonical prefix. Small and `Copy`: the request path counts these in a
/// metric (see [`PromptError::label`]) and routes the request without prefix affinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptError {
    /// Not one of the prompt paths of [`Endpoint`].
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
                    "not a prompt path: expected /v1/completions, /v1/chat/completions, /v1/responses or /v1/messages"
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
const SYSTEM_ROLE: &[u8] = b"\x00role:system\x00";
const USER_ROLE: &[u8] = b"\x00role:user\x00";
const ITEM: &[u8] = b"\x00item\x00";
/// The member of a content block that clients move from turn to turn (Anthropic's prompt
/// caching marker): left out of a block's canonical JSON.
const CACHE_CONTROL: &[u8] = b"cache_control";
/// The start of a system block whose text changes with every request (a per-request hash
/// some agents send): such a block is left out, as vLLM leaves it out of the prompt.
const BILLING_HEADER: &[u8] = b"\"x-anthropic-billing-header";

/// Calls `emit` with the decoded pieces of the string member `key` of the JSON object `body`
/// (the last one, as the engines' JSON parsers keep the last of duplicate keys), skimming the
/// other members' values without decoding them (~0.1 ns a byte). Emits nothing when the body
/// is no object, the member is absent or no string, or the object breaks off before it.
pub fn top_level_string(body: &[u8], key: &[u8], emit: &mut impl FnMut(&[u8])) {
    let mut c = Cursor::new(body, 0);
    if !matches!(c.peek_token(), Ok(b'{')) {
        return;
    }
    let mut last = None;
    let whole = c.object(0, |c, k| {
        if k == key && c.peek_token()? == b'"' {
            last = Some(c.pos);
        }
        c.skim_fast()
    });
    if let (Ok(()), Some(at)) = (whole, last) {
        let _ = Cursor::new(body, at).string(emit);
    }
}

/// Calls `visit(key, member, value)` for each member of the JSON object `body`, in order:
/// `member` is the bytes from after the `{` or `,` before it to the end of its value (its
/// whitespace, key, colon and value), `value` the value's. Values are skimmed, not validated
/// (as [`top_level_string`]). Returns false when `body` is no object or breaks off; `visit` may
/// have been called for the members before that point.
pub fn top_level_members(
    body: &[u8],
    visit: &mut impl FnMut(&[u8], std::ops::Range<usize>, std::ops::Range<usize>),
) -> bool {
    let mut c = Cursor::new(body, 0);
    if !matches!(c.peek_token(), Ok(b'{')) {
        return false;
    }
    let mut start = c.pos + 1;
    let whole = c.object(0, |c, k| {
        c.peek_token()?;
        let from = c.pos;
        c.skim_fast()?;
        visit(k, start..c.pos, from..c.pos);
        // The next member starts after the comma that follows (if one does).
        let mut next = Cursor::new(c.buf, c.pos);
        if next.peek_token()? == b',' {
            start = next.pos + 1;
        }
        Ok(())
    });
    whole.is_ok() && body[c.pos..].iter().all(u8::is_ascii_whitespace)
}

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
    extract(endpoint, body, &mut record, &PromptLimits::UNLIMITED, sink).map(|(form, _)| form)
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
    extract(endpoint, body, &mut record, &PromptLimits::UNLIMITED, sink).map(|(form, _)| form)
}

/// [`extract_prompt_with`] within `limits`: stops at the first bound reached and says how much
/// it read. Under every bound, the same pieces and result. With [`Extent::Unknown`] the sink
/// must discard what it got, as on `Err`.
pub fn extract_prompt_within(
    endpoint: Endpoint,
    body: &[u8],
    scratch: &mut PromptScratch,
    limits: &PromptLimits,
    sink: &mut impl PromptSink,
) -> Result<(PromptForm, Extent), PromptError> {
    let mut record = Recording::new(body, &mut scratch.entries, &mut scratch.arena);
    extract(endpoint, body, &mut record, limits, sink)
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
    limits: &PromptLimits,
    sink: &mut impl PromptSink,
) -> Result<(PromptForm, Extent), PromptError> {
    let mut budget = Budget::new(limits);
    let fields = match top_level(endpoint, body, record, &mut budget, sink) {
        Ok(fields) => fields,
        Err(e) => {
            return match budget.stopped {
                Some(bound) => Ok((PromptForm::Text, Extent::Unknown(bound))),
                None => Err(e),
            }
        }
    };
    for (field, start) in [
        (Field::Model, fields.model),
        (Field::CacheSalt, fields.cache_salt),
        (Field::LoraPath, fields.lora_path),
    ] {
        // Validated by the first pass; a value of the wrong type names nothing here (and is
        // the text form's error below for model and salt; SGLang's batch form of lora_path, a
        // list, names no one adapter).
        if let Some(start) = start {
            let mut c = Cursor::new(body, start);
            let _ = string_or_null(&mut c, "field", &mut |p: &[u8]| sink.field(field, p));
        }
    }
    if fields.tokens_emitted {
        let extent = budget.stopped.map_or(Extent::Whole, Extent::Prefix);
        return Ok((PromptForm::Tokens, extent));
    }
    if endpoint == Endpoint::Completions && fields.prompt.is_none() {
        return Err(PromptError::MissingField("prompt"));
    }
    budget.second_pass(record.complete);
    let text = &mut Emitter {
        sink,
        budget: &mut budget,
    };
    let emitted = second_pass(endpoint, body, &fields, record, text);
    match (budget.stopped, emitted) {
        (Some(bound), _) => Ok((PromptForm::Text, Extent::Prefix(bound))),
        (None, Ok(())) => Ok((PromptForm::Text, Extent::Whole)),
        (None, Err(e)) => Err(e),
    }
}

/// Emits the canonical prefix from the positions the first pass found.
fn second_pass(
    endpoint: Endpoint,
    body: &[u8],
    fields: &TopLevel,
    record: &Recording<'_, '_>,
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    text.emit(MODEL);
    if let Some(start) = fields.model {
        string_or_null(&mut Cursor::new(body, start), "model", text)?;
    }
    if let Some(start) = fields.cache_salt {
        let mut c = Cursor::new(body, start);
        if !c.null()? {
            text.emit(CACHE_SALT);
            string_or_null(&mut c, "cache_salt", text)?;
        }
    }
    if let Some(start) = fields.tools {
        let mut c = Cursor::new(body, start);
        if !c.null()? {
            if c.peek_token()? != b'[' {
                return Err(PromptError::WrongType("tools"));
            }
            text.emit(TOOLS);
            c.value_to(1, text)?;
        }
    }
    match endpoint {
        Endpoint::Responses => {
            if let Some(start) = fields.instructions {
                system_message(body, start, "instructions", text)?;
            }
            let start = fields.messages.ok_or(PromptError::MissingField("input"))?;
            responses_input(body, start, text)?;
        }
        Endpoint::ChatCompletions | Endpoint::Messages => {
            if let Some(start) = fields.instructions {
                system_message(body, start, "system", text)?;
            }
            let start = fields
                .messages
                .ok_or(PromptError::MissingField("messages"))?;
            if record.complete {
                record.replay(text);
                if let Some((at, index)) = record.resume {
                    messages_from(body, at, index, text)?;
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
    Ok(())
}

/// What an extraction may still do, shared by its two passes (see the module header).
struct Budget {
    limits: PromptLimits,
    /// Token ids still to be read.
    ids_left: usize,
    /// Content parts and tool calls read.
    parts: usize,
    /// Pieces and members still to be read in this pass.
    work_left: usize,
    /// Bytes of values not read that may still be validated.
    validate_left: usize,
    /// The last values crossed with the structural skim, (start, end): a field read after the
    /// ones that follow it is skipped once a pass, and both passes skip it.
    skimmed: [(usize, usize); 2],
    /// The bound that stopped the extraction; scanning ends at the next check.
    stopped: Option<Bound>,
}

impl Budget {
    fn new(limits: &PromptLimits) -> Budget {
        Budget {
            limits: *limits,
            ids_left: limits.max_tokens,
            parts: 0,
            work_left: limits.max_work,
            validate_left: limits.max_validated_bytes,
            skimmed: [(usize::MAX, 0); 2],
            stopped: None,
        }
    }

    /// Fresh work for the second pass; the parts count carries over from the recorded messages
    /// (and restarts when the second pass reads the messages from the first).
    fn second_pass(&mut self, recorded: bool) {
        self.work_left = self.limits.max_work;
        if !recorded {
            self.parts = 0;
        }
    }

    /// Stops the extraction at `bound` (the first one reached stays); returns [`STOP`]. The
    /// counters go to zero, so that every later piece, member or id takes the slow path, which
    /// sees the stop.
    #[cold]
    fn stop(&mut self, bound: Bound) -> PromptError {
        self.stopped.get_or_insert(bound);
        self.work_left = 0;
        self.ids_left = 0;
        STOP
    }

    /// The first pass goes on after a bound stopped it in `messages`: the second pass reads
    /// them again within the same bounds, and `TAIL_WORK` members are left for the fields
    /// after the array (the first pass spends no ids of a chat).
    fn resume_first_pass(&mut self) {
        self.stopped = None;
        self.work_left = TAIL_WORK * MEMBER_WORK;
        self.ids_left = self.limits.max_tokens;
    }

    /// `units` of work: what the scanner charges ([`Emit::charge`]), a part, or
    /// [`MEMBER_WORK`] a member read.
    #[inline(always)]
    fn work(&mut self, units: usize) -> Result<(), PromptError> {
        match self.work_left.checked_sub(units) {
            Some(left) => {
                self.work_left = left;
                Ok(())
            }
            None => Err(self.out_of_work()),
        }
    }

    #[cold]
    fn out_of_work(&mut self) -> PromptError {
        if self.stopped.is_none() {
            self.stop(Bound::Work);
        }
        STOP
    }

    #[inline]
    fn message(&mut self, index: usize) -> Result<(), PromptError> {
        if self.stopped.is_some() {
            return Err(STOP);
        }
        if index >= self.limits.max_messages {
            return Err(self.stop(Bound::Messages));
        }
        Ok(())
    }

    #[inline]
    fn part(&mut self) -> Result<(), PromptError> {
        self.work(1)?;
        if self.parts >= self.limits.max_parts {
            return Err(self.stop(Bound::Parts));
        }
        self.parts += 1;
        Ok(())
    }

    /// Skips a value that is not emitted ([`Cursor::skip`], or [`Cursor::skim`] without
    /// `check`) while validated bytes are left; a value longer than what is left is crossed
    /// with the structural skim instead.
    fn skip(&mut self, c: &mut Cursor<'_>, depth: usize, check: bool) -> Result<(), PromptError> {
        if self.stopped.is_some() {
            return Err(STOP);
        }
        c.skip_ws();
        if self.validate_left == 0 {
            return self.skim(c);
        }
        let start = c.pos;
        let end = start.saturating_add(self.validate_left);
        if end >= c.buf.len() {
            let skipped = if check { c.skip(depth) } else { c.skim(depth) };
            self.validate_left -= c.pos.saturating_sub(start).min(self.validate_left);
            return skipped;
        }
        // Walked on a body cut where the allowance ends: running out of it is running out
        // of the allowance.
        let mut cut = Cursor::new(&c.buf[..end], start);
        match if check {
            cut.skip(depth)
        } else {
            cut.skim(depth)
        } {
            Ok(()) => {
                c.pos = cut.pos;
                self.validate_left -= cut.pos - start;
                Ok(())
            }
            Err(PromptError::Truncated) => {
                self.validate_left = 0;
                self.skim(c)
            }
            Err(e) => Err(e),
        }
    }

    /// [`Cursor::skim_fast`], remembering where the value ends.
    fn skim(&mut self, c: &mut Cursor<'_>) -> Result<(), PromptError> {
        let start = c.pos;
        if let Some(&(_, end)) = self.skimmed.iter().find(|(at, _)| *at == start) {
            c.pos = end;
            return Ok(());
        }
        c.skim_fast()?;
        self.skimmed = [(start, c.pos), self.skimmed[0]];
        Ok(())
    }
}

/// What the readers of messages, parts and calls emit into: an [`Emit`] that also counts
/// messages, parts and members and skips what is not read. Closures count nothing.
trait Reader: Emit {
    /// Before message `index` of `messages`.
    #[inline(always)]
    fn message(&mut self, _index: usize) -> Result<(), PromptError> {
        Ok(())
    }

    /// Before a content part or a tool call.
    #[inline(always)]
    fn part(&mut self) -> Result<(), PromptError> {
        Ok(())
    }

    /// Before each member of an object.
    #[inline(always)]
    fn member(&mut self) -> Result<(), PromptError> {
        Ok(())
    }

    /// Skips a value that is not emitted.
    #[inline(always)]
    fn skip(&mut self, c: &mut Cursor<'_>, depth: usize) -> Result<(), PromptError> {
        c.skip(depth)
    }
}

impl<F: FnMut(&[u8])> Reader for F {}

/// The second pass's reader: pieces go to the sink, and where the scanner is charged (and
/// where a member, a part or a message starts) the budget and the sink's fullness are checked.
struct Emitter<'a, S: PromptSink> {
    sink: &'a mut S,
    budget: &'a mut Budget,
}

impl<S: PromptSink> Emitter<'_, S> {
    /// Ok while the sink wants more text.
    #[inline(always)]
    fn room(&mut self) -> Result<(), PromptError> {
        if self.sink.full() {
            return Err(self.budget.stop(Bound::Tokens));
        }
        Ok(())
    }
}

impl<S: PromptSink> Emit for Emitter<'_, S> {
    #[inline(always)]
    fn emit(&mut self, piece: &[u8]) {
        self.sink.piece(Piece::Text(piece));
    }

    #[inline(always)]
    fn charge(&mut self, units: usize) -> bool {
        self.budget.work(units).is_ok() && self.room().is_ok()
    }

    #[inline(always)]
    fn stopped(&self) -> bool {
        self.budget.stopped.is_some()
    }
}

impl<S: PromptSink> Reader for Emitter<'_, S> {
    #[inline(always)]
    fn message(&mut self, index: usize) -> Result<(), PromptError> {
        self.budget.message(index)?;
        self.room()
    }

    #[inline(always)]
    fn part(&mut self) -> Result<(), PromptError> {
        self.budget.part()?;
        self.room()
    }

    #[inline(always)]
    fn member(&mut self) -> Result<(), PromptError> {
        self.budget.work(MEMBER_WORK)?;
        self.room()
    }

    fn skip(&mut self, c: &mut Cursor<'_>, depth: usize) -> Result<(), PromptError> {
        self.budget.skip(c, depth, true)
    }
}

/// The first pass's reader: pieces of messages go into the recording while the budget lasts
/// (the sink is the second pass's).
struct Recorder<'r, 's, 'b> {
    record: &'r mut Recording<'s, 'b>,
    budget: &'r mut Budget,
    /// Where the message ends, once its members are all read (the fields read after them
    /// come from their own cursors).
    message_end: Option<usize>,
}

impl Emit for Recorder<'_, '_, '_> {
    #[inline(always)]
    fn emit(&mut self, piece: &[u8]) {
        self.record.push(piece);
    }

    #[inline(always)]
    fn charge(&mut self, units: usize) -> bool {
        self.budget.work(units).is_ok()
    }

    #[inline(always)]
    fn stopped(&self) -> bool {
        self.budget.stopped.is_some()
    }
}

impl Reader for Recorder<'_, '_, '_> {
    #[inline(always)]
    fn part(&mut self) -> Result<(), PromptError> {
        self.budget.part()
    }

    #[inline(always)]
    fn member(&mut self) -> Result<(), PromptError> {
        self.budget.work(MEMBER_WORK)
    }

    fn skip(&mut self, c: &mut Cursor<'_>, depth: usize) -> Result<(), PromptError> {
        self.budget.skip(c, depth, true)
    }
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
    /// The recorded pieces are those of all messages but the ones from this position on
    /// (and this index in the array).
    complete: bool,
    resume: Option<(usize, usize)>,
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

    /// Emits the recorded pieces (their scanning was charged in the first pass; a full sink
    /// stops the second pass at its next check after them).
    fn replay(&self, text: &mut impl Reader) {
        for &entry in &self.entries[..self.len] {
            if text.stopped() {
                return;
            }
            let start = (entry & 0xffff_ffff) as usize;
            let len = (entry >> 32 & LEN_MASK) as usize;
            if entry & INLINE == 0 {
                text.emit(&self.body[start..start + len]);
            } else {
                text.emit(&self.arena[start..start + len]);
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
/// without recording, leaving the error to the second pass. A bound reached in message `k`
/// keeps the messages before it (the second pass reads on from `k`, within the same bounds)
/// and crosses the rest of the array with the structural skim.
fn record_messages(
    c: &mut Cursor<'_>,
    record: &mut Recording<'_, '_>,
    budget: &mut Budget,
) -> Result<(), PromptError> {
    let start = c.pos;
    if record.usable() {
        // Where the structural skim starts when a bound stopped the array: at the message it
        // stopped in, or after it when it was read to its end.
        let mut stopped_at = None;
        let recorded = (|| {
            if c.peek_token()? != b'[' {
                return Err(PromptError::WrongType("messages"));
            }
            let mut dense = false;
            c.array(1, |c, index| {
                if index >= budget.limits.max_messages {
                    stopped_at = Some(c.pos);
                    record.resume.get_or_insert((c.pos, index));
                    return Err(budget.stop(Bound::Messages));
                }
                if record.resume.is_none() && dense {
                    // Escape-dense text: a piece every few bytes costs more to record and
                    // replay than a second scan, so the rest is scanned again.
                    record.resume = Some((c.pos, index));
                }
                if record.resume.is_some() {
                    return budget.skip(c, MESSAGE_DEPTH - 1, false);
                }
                let (at, len, arena_len, parts) =
                    (c.pos, record.len, record.arena_len, budget.parts);
                // The last entry may grow by merging with this message's first piece.
                let last = len.checked_sub(1).map(|i| record.entries[i]);
                let mut rec = Recorder {
                    record,
                    budget,
                    message_end: None,
                };
                let result = message_recorded(c, &mut rec);
                let message_end = rec.message_end;
                if record.overflowed || budget.stopped.is_some() {
                    // Out of space, or a bound: keep the messages before this one.
                    record.len = len;
                    record.arena_len = arena_len;
                    if let Some(last) = last {
                        record.entries[len - 1] = last;
                    }
                    budget.parts = parts;
                    record.resume = Some((at, index));
                    if budget.stopped.is_some() {
                        stopped_at = Some(message_end.unwrap_or(at));
                        return Err(STOP);
                    }
                    if let (Ok(()), Some(end)) = (&result, message_end) {
                        // Read to its end already (so skimming it would find it valid).
                        c.pos = end;
                        return Ok(());
                    }
                    c.pos = at;
                    return budget.skip(c, MESSAGE_DEPTH - 1, false);
                }
                dense = record.len * DENSE_BYTES > c.pos - start + DENSE_SLACK;
                result
            })
        })();
        if let Some(at) = stopped_at {
            // Past the bound: on to the end of the array, and a little work for the fields
            // after it. (A skim that finds no end leaves the stop, and so no prefix.)
            c.pos = scan::close_levels(c.buf, at, 1)?;
            budget.resume_first_pass();
            record.complete = true;
            return Ok(());
        }
        if recorded.is_ok() {
            record.complete = true;
            return Ok(());
        }
        record.len = 0;
        record.arena_len = 0;
        record.barrier = 0;
        record.resume = None;
        record.overflowed = false;
        budget.parts = 0;
        c.pos = start;
    }
    budget.skip(c, 1, false)
}

/// Where the top-level values the prefix is built from start.
#[derive(Default)]
struct TopLevel {
    model: Option<usize>,
    cache_salt: Option<usize>,
    /// SGLang's adapter field (a name, despite its name), read for [`PromptSink::field`] only.
    lora_path: Option<usize>,
    tools: Option<usize>,
    /// Chat's and Messages' `messages`, the Responses API's `input`.
    messages: Option<usize>,
    /// The Responses API's `instructions`, Messages' `system`.
    instructions: Option<usize>,
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
    budget: &mut Budget,
    sink: &mut impl PromptSink,
) -> Result<TopLevel, PromptError> {
    let mut c = Cursor::new(body, 0);
    if c.peek_token()? != b'{' {
        // Distinguish "some other JSON" from "not JSON at all" for the metric.
        let at = c.pos;
        budget.skip(&mut c, 0, true)?;
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
    let members = c.object(0, |c, key| {
        budget.work(MEMBER_WORK)?;
        c.skip_ws();
        use Endpoint::*;
        let slot = match (key, endpoint) {
            (b"model", _) => Some((&mut fields.model, "model")),
            (b"cache_salt", _) => Some((&mut fields.cache_salt, "cache_salt")),
            (b"lora_path", _) => Some((&mut fields.lora_path, "lora_path")),
            (b"tools", _) => Some((&mut fields.tools, "tools")),
            (b"messages", ChatCompletions | Messages) => Some((&mut fields.messages, "messages")),
            (b"input", Responses) => Some((&mut fields.messages, "input")),
            (b"instructions", Responses) => Some((&mut fields.instructions, "instructions")),
            (b"system", Messages) => Some((&mut fields.instructions, "system")),
            (b"prompt", Completions) => Some((&mut fields.prompt, "prompt")),
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
                return token_prompt_within(c, budget, sink);
            }
            // The big values the second pass reads in full (escapes included) are only skimmed
            // here; the rest is checked now, whatever the second pass does.
            if name == "messages" {
                return record_messages(c, record, budget);
            }
            // (A completions prompt of token ids leaves `tools` unread: checked here.)
            let reread = matches!(name, "input" | "instructions" | "system" | "prompt")
                || (name == "tools" && endpoint != Endpoint::Completions);
            if reread {
                return budget.skip(c, 1, false);
            }
        }
        budget.skip(c, 1, true)
    });
    match members {
        // A token prompt needs nothing else from the body.
        Err(_) if fields.tokens_emitted && budget.stopped.is_some() => return Ok(fields),
        result => result?,
    }
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
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    match c.peek_token()? {
        b'"' => c.string_to(text),
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

fn messages(body: &[u8], start: usize, text: &mut impl Reader) -> Result<(), PromptError> {
    let mut c = Cursor::new(body, start);
    if c.peek_token()? != b'[' {
        return Err(PromptError::WrongType("messages"));
    }
    c.array(1, |c, index| {
        text.message(index)?;
        message(c, text)
    })
}

/// The messages from the one at `at` (after `[` or a comma), message `index` of the array, to
/// the end of the array.
fn messages_from(
    body: &[u8],
    at: usize,
    mut index: usize,
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    let mut c = Cursor::new(body, at);
    loop {
        text.message(index)?;
        message(&mut c, text)?;
        index += 1;
        match c.peek_token()? {
            b',' => c.pos += 1,
            b']' => return Ok(()),
            _ => return Err(c.syntax()),
        }
    }
}

/// A system message: the Responses API's `instructions` (a string; vLLM renders it as one) or
/// Anthropic's `system` (a string, or text blocks read as a message's content parts, a block
/// whose text starts with [`BILLING_HEADER`] left out); null is none.
fn system_message(
    body: &[u8],
    start: usize,
    field: &'static str,
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    let mut c = Cursor::new(body, start);
    match c.peek_token()? {
        b'n' => c.null().map(|_| ()),
        b'"' => {
            text.emit(SYSTEM_ROLE);
            c.string_to(text)
        }
        b'[' if field == "system" => {
            text.emit(SYSTEM_ROLE);
            let mut text_parts = 0usize;
            c.array(1, |c, _| {
                if billing_header(c.buf, c.pos) {
                    return text.skip(c, 2);
                }
                content_part(c, &mut text_parts, text)
            })
        }
        _ => Err(PromptError::WrongType(field)),
    }
}

/// Whether the block at `at` is a text block whose text starts with [`BILLING_HEADER`] (as
/// written: such headers hold no escapes). Anything unreadable is not: the reader reports it.
fn billing_header(buf: &[u8], at: usize) -> bool {
    let mut c = Cursor::new(buf, at);
    let mut found = false;
    let read = c.peek_token() == Ok(b'{')
        && c.object(2, |c, key| {
            if key == b"text" {
                c.skip_ws();
                found = buf[c.pos..].starts_with(BILLING_HEADER);
            }
            c.skim_fast()
        })
        .is_ok();
    read && found
}

/// The Responses API's `input`: a string (one user message), or a list of items.
fn responses_input(body: &[u8], start: usize, text: &mut impl Reader) -> Result<(), PromptError> {
    let mut c = Cursor::new(body, start);
    match c.peek_token()? {
        b'"' => {
            text.message(0)?;
            text.emit(USER_ROLE);
            c.string_to(text)
        }
        b'[' => c.array(1, |c, index| {
            text.message(index)?;
            response_item(c, text)
        }),
        _ => Err(PromptError::WrongType("input")),
    }
}

/// One input item: a message (`type` absent or "message") as a chat message; any other item
/// (function calls and their outputs, reasoning, ...) as [`ITEM`] and its canonical JSON.
fn response_item(c: &mut Cursor<'_>, text: &mut impl Reader) -> Result<(), PromptError> {
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("input[]"));
    }
    let mut probe = Cursor::new(c.buf, c.pos);
    let mut message_type = true;
    let _ = probe.object(MESSAGE_DEPTH - 1, |p, key| {
        if key == b"type" && p.peek_token()? == b'"' {
            let mut name = [0u8; 8];
            message_type = short_string(p, &mut name)? == Some(b"message");
            return Ok(());
        }
        p.skim_fast()
    });
    if message_type {
        message(c, text)
    } else {
        text.emit(ITEM);
        c.value_to(MESSAGE_DEPTH - 1, text)
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

fn message(c: &mut Cursor<'_>, text: &mut impl Reader) -> Result<(), PromptError> {
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[]"));
    }
    let mut stages = Stages::<MESSAGE_FIELDS>::new();
    c.object(MESSAGE_DEPTH - 1, |c, key| {
        text.member()?;
        c.skip_ws();
        let Some((stage, name)) = message_key(key) else {
            return text.skip(c, MESSAGE_DEPTH);
        };
        if stages.arrive(stage, c.pos, name)? {
            message_field(c, stage, text)
        } else {
            text.skip(c, MESSAGE_DEPTH)
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
fn message_recorded(c: &mut Cursor<'_>, rec: &mut Recorder<'_, '_, '_>) -> Result<(), PromptError> {
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[]"));
    }
    let mut stages = Stages::<MESSAGE_FIELDS>::new();
    // Entries `first..end` of the recording hold a content read before the role.
    let mut early: Option<(usize, usize)> = None;
    c.object(MESSAGE_DEPTH - 1, |c, key| {
        rec.member()?;
        c.skip_ws();
        let Some((stage, name)) = message_key(key) else {
            return rec.skip(c, MESSAGE_DEPTH);
        };
        if stage == M_CONTENT && early.is_some() {
            return Err(PromptError::DuplicateKey(name));
        }
        if stage == M_CONTENT
            && stages.next == M_ROLE
            && stages.pending[M_CONTENT].is_none()
            && c.peek()? == b'"'
        {
            let first = rec.record.seal();
            c.string_to(rec)?;
            early = Some((first, rec.record.seal()));
            return Ok(());
        }
        if stages.arrive(stage, c.pos, name)? {
            message_field(c, stage, rec)?;
            if let (M_ROLE, Some((first, end))) = (stage, early) {
                rec.record.move_behind(first, end);
                stages.next = M_TOOL_CALLS;
            }
            Ok(())
        } else {
            rec.skip(c, MESSAGE_DEPTH)
        }
    })?;
    rec.message_end = Some(c.pos);
    if stages.next == M_ROLE && stages.pending[M_ROLE].is_none() {
        return Err(PromptError::MissingField("messages[].role"));
    }
    for (stage, pos) in stages.leftovers() {
        message_field(&mut Cursor::new(c.buf, pos), stage, rec)?;
    }
    Ok(())
}

/// Emits one message field, the cursor on its value.
fn message_field(
    c: &mut Cursor<'_>,
    stage: usize,
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    match stage {
        M_ROLE => {
            if c.peek_token()? != b'"' {
                return Err(PromptError::WrongType("messages[].role"));
            }
            text.emit(ROLE);
            c.string_to(text)?;
            text.emit(END);
            Ok(())
        }
        M_CONTENT => match c.peek_token()? {
            b'"' => c.string_to(text),
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
            text.emit(marker);
            c.string_to(text)
        }
        _ => text.skip(c, MESSAGE_DEPTH),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PartType {
    Unknown,
    Text,
    ImageUrl,
    ToolUse,
    ToolResult,
    Other,
}

/// Depth of a content part's values: message (3) > content array (4) > part (5).
const PART_DEPTH: usize = MESSAGE_DEPTH + 2;

/// Where the members of a content part that kvlb reads start.
#[derive(Default)]
struct PartFields {
    text: Option<usize>,
    image_url: Option<usize>,
    name: Option<usize>,
    input: Option<usize>,
    tool_use_id: Option<usize>,
    content: Option<usize>,
}

/// One element of a content array; `text_parts` counts text parts emitted so far in it.
fn content_part(
    c: &mut Cursor<'_>,
    text_parts: &mut usize,
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    text.part()?;
    let part_start = c.pos;
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[].content[]"));
    }
    let mut kind = PartType::Unknown;
    let mut at = PartFields::default();
    let mut streamed = false;
    c.object(PART_DEPTH - 1, |c, key| {
        text.member()?;
        c.skip_ws();
        let (slot, name) = match key {
            b"type" => {
                if kind != PartType::Unknown {
                    return Err(PromptError::DuplicateKey("messages[].content[].type"));
                }
                kind = part_type(c)?;
                return Ok(());
            }
            b"text" => {
                if at.text.is_some() {
                    return Err(PromptError::DuplicateKey("messages[].content[].text"));
                }
                at.text = Some(c.pos);
                if kind == PartType::Text {
                    // Its turn: emit while scanning.
                    streamed = true;
                    return part_text(c, text_parts, text);
                }
                return text.skip(c, PART_DEPTH);
            }
            b"image_url" => (&mut at.image_url, "messages[].content[].image_url"),
            b"name" => (&mut at.name, "messages[].content[].name"),
            b"input" => (&mut at.input, "messages[].content[].input"),
            b"tool_use_id" => (&mut at.tool_use_id, "messages[].content[].tool_use_id"),
            b"content" => (&mut at.content, "messages[].content[].content"),
            _ => return text.skip(c, PART_DEPTH),
        };
        if slot.is_some() {
            return Err(PromptError::DuplicateKey(name));
        }
        *slot = Some(c.pos);
        text.skip(c, PART_DEPTH)
    })?;
    let buf = c.buf;
    // A part without "type" is read by its payload, as servers do.
    if kind == PartType::Unknown {
        kind = if at.text.is_some() {
            PartType::Text
        } else if at.image_url.is_some() {
            PartType::ImageUrl
        } else {
            PartType::Other
        };
    }
    match kind {
        PartType::Text => {
            if !streamed {
                let at = at
                    .text
                    .ok_or(PromptError::MissingField("messages[].content[].text"))?;
                part_text(&mut Cursor::new(buf, at), text_parts, text)?;
            }
        }
        PartType::ImageUrl => {
            let at = at
                .image_url
                .ok_or(PromptError::MissingField("messages[].content[].image_url"))?;
            image_url(&mut Cursor::new(buf, at), text)?;
        }
        PartType::ToolUse => {
            const NAME_FIELD: &str = "messages[].content[].name";
            let name = at.name.ok_or(PromptError::MissingField(NAME_FIELD))?;
            let input = at
                .input
                .ok_or(PromptError::MissingField("messages[].content[].input"))?;
            let mut n = Cursor::new(buf, name);
            if n.peek_token()? != b'"' {
                return Err(PromptError::WrongType(NAME_FIELD));
            }
            text.emit(TOOL_CALL);
            n.string_to(text)?;
            text.emit(END);
            Cursor::new(buf, input).value_to(PART_DEPTH, text)?;
        }
        PartType::ToolResult => {
            const ID_FIELD: &str = "messages[].content[].tool_use_id";
            let id = at.tool_use_id.ok_or(PromptError::MissingField(ID_FIELD))?;
            let mut i = Cursor::new(buf, id);
            if i.peek_token()? != b'"' {
                return Err(PromptError::WrongType(ID_FIELD));
            }
            text.emit(TOOL_CALL_ID);
            i.string_to(text)?;
            text.emit(END);
            if let Some(content) = at.content {
                tool_result_content(&mut Cursor::new(buf, content), text)?;
            }
        }
        _ => {
            text.emit(OTHER_PART);
            object_without(
                &mut Cursor::new(buf, part_start),
                PART_DEPTH - 1,
                CACHE_CONTROL,
                text,
            )?;
        }
    }
    Ok(())
}

/// A content part's `type`, the cursor on its value.
fn part_type(c: &mut Cursor<'_>) -> Result<PartType, PromptError> {
    if c.peek_token()? != b'"' {
        return Err(PromptError::WrongType("messages[].content[].type"));
    }
    let mut name = [0u8; 12];
    Ok(match short_string(c, &mut name)? {
        Some(b"text" | b"input_text" | b"output_text") => PartType::Text,
        Some(b"image_url") => PartType::ImageUrl,
        Some(b"tool_use") => PartType::ToolUse,
        Some(b"tool_result") => PartType::ToolResult,
        _ => PartType::Other,
    })
}

/// The string at the cursor, decoded into `buf`: None when it does not fit (no name kvlb
/// looks for is that long).
fn short_string<'b>(
    c: &mut Cursor<'_>,
    buf: &'b mut [u8],
) -> Result<Option<&'b [u8]>, PromptError> {
    let mut len = 0usize;
    c.string(&mut |p: &[u8]| {
        if let Some(dst) = buf.get_mut(len..len + p.len()) {
            dst.copy_from_slice(p);
        }
        len += p.len();
    })?;
    Ok(buf.get(..len))
}

/// A `tool_result` block's `content`: a string, or blocks whose text parts give their text
/// (`\n` between them) and any other block its canonical JSON without `cache_control`.
fn tool_result_content(c: &mut Cursor<'_>, text: &mut impl Reader) -> Result<(), PromptError> {
    const FIELD: &str = "messages[].content[].content";
    const DEPTH: usize = PART_DEPTH + 1;
    match c.peek_token()? {
        b'"' => c.string_to(text),
        b'n' => c.null().map(|_| ()),
        b'[' => {
            let mut text_parts = 0usize;
            c.array(PART_DEPTH, |c, _| {
                text.part()?;
                if c.peek_token()? != b'{' {
                    return Err(PromptError::WrongType("messages[].content[].content[]"));
                }
                let start = c.pos;
                let mut is_text = false;
                let mut text_at = None;
                c.object(DEPTH, |c, key| {
                    text.member()?;
                    c.skip_ws();
                    match key {
                        b"type" => is_text = part_type(c)? == PartType::Text,
                        b"text" => {
                            text_at = Some(c.pos);
                            text.skip(c, DEPTH + 1)?;
                        }
                        _ => text.skip(c, DEPTH + 1)?,
                    }
                    Ok(())
                })?;
                match (is_text, text_at) {
                    (true, Some(at)) => {
                        part_text(&mut Cursor::new(c.buf, at), &mut text_parts, text)
                    }
                    _ => {
                        text.emit(OTHER_PART);
                        object_without(&mut Cursor::new(c.buf, start), DEPTH, CACHE_CONTROL, text)
                    }
                }
            })
        }
        _ => Err(PromptError::WrongType(FIELD)),
    }
}

/// The object at the cursor in canonical JSON (as [`Cursor::value_to`] writes it) without its
/// member `drop` (at its top level only).
fn object_without(
    c: &mut Cursor<'_>,
    depth: usize,
    drop: &[u8],
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    c.expect(b'{')?;
    text.emit(b"{");
    let mut first = true;
    if c.peek_token()? != b'}' {
        loop {
            let key_at = c.pos;
            let mut key = [0u8; 16];
            let len = c.object_key(&mut key)?;
            if len == drop.len() && key.get(..len) == Some(drop) {
                text.skip(c, depth + 1)?;
            } else {
                if !first {
                    text.emit(b",");
                }
                first = false;
                text.emit(b"\"");
                Cursor::new(c.buf, key_at).string_to(text)?;
                text.emit(b"\":");
                c.value_to(depth + 1, text)?;
            }
            match c.peek_token()? {
                b',' => c.pos += 1,
                b'}' => break,
                _ => return Err(c.syntax()),
            }
        }
    }
    c.pos += 1;
    text.emit(b"}");
    Ok(())
}

/// A text part's `text`, with `\n` before every text part but the first.
fn part_text(
    c: &mut Cursor<'_>,
    text_parts: &mut usize,
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    if c.peek_token()? != b'"' {
        return Err(PromptError::WrongType("messages[].content[].text"));
    }
    if *text_parts > 0 {
        text.emit(PART_SEPARATOR);
    }
    *text_parts += 1;
    c.string_to(text)
}

/// `image_url`: `{"url": ..., "detail": ...}` or a bare URL string.
fn image_url(c: &mut Cursor<'_>, text: &mut impl Reader) -> Result<(), PromptError> {
    const FIELD: &str = "messages[].content[].image_url.url";
    match c.peek_token()? {
        b'"' => {
            text.emit(IMAGE_URL);
            c.string_to(text)?;
            text.emit(END);
            Ok(())
        }
        b'{' => {
            let mut url_at = None;
            c.object(PART_DEPTH, |c, key| {
                text.member()?;
                c.skip_ws();
                if key == b"url" {
                    if url_at.is_some() {
                        return Err(PromptError::DuplicateKey(FIELD));
                    }
                    url_at = Some(c.pos);
                }
                text.skip(c, PART_DEPTH + 1)
            })?;
            let at = url_at.ok_or(PromptError::MissingField(FIELD))?;
            let mut u = Cursor::new(c.buf, at);
            if u.peek_token()? != b'"' {
                return Err(PromptError::WrongType(FIELD));
            }
            text.emit(IMAGE_URL);
            u.string_to(text)?;
            text.emit(END);
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
fn tool_call(c: &mut Cursor<'_>, text: &mut impl Reader) -> Result<(), PromptError> {
    text.part()?;
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[].tool_calls[]"));
    }
    let mut function_at = None;
    c.object(CALL_DEPTH - 1, |c, key| {
        text.member()?;
        c.skip_ws();
        if key == b"function" {
            if function_at.is_some() {
                return Err(PromptError::DuplicateKey(
                    "messages[].tool_calls[].function",
                ));
            }
            function_at = Some(c.pos);
            // Emitted from here: nothing else of the call is part of the prefix.
            text.emit(TOOL_CALL);
            function(c, text)
        } else {
            text.skip(c, CALL_DEPTH)
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
fn function(c: &mut Cursor<'_>, text: &mut impl Reader) -> Result<(), PromptError> {
    const DEPTH: usize = CALL_DEPTH + 1;
    if c.peek_token()? != b'{' {
        return Err(PromptError::WrongType("messages[].tool_calls[].function"));
    }
    let mut stages = Stages::<2>::new();
    c.object(DEPTH - 1, |c, key| {
        text.member()?;
        c.skip_ws();
        let (stage, name) = match key {
            b"name" => (F_NAME, "messages[].tool_calls[].function.name"),
            b"arguments" => (F_ARGUMENTS, "messages[].tool_calls[].function.arguments"),
            _ => return text.skip(c, DEPTH),
        };
        if stages.arrive(stage, c.pos, name)? {
            function_field(c, stage, text)
        } else {
            text.skip(c, DEPTH)
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
    text: &mut impl Reader,
) -> Result<(), PromptError> {
    if stage == F_NAME {
        if c.peek_token()? != b'"' {
            return Err(PromptError::WrongType(
                "messages[].tool_calls[].function.name",
            ));
        }
        c.string_to(text)?;
        text.emit(END);
        Ok(())
    } else if c.peek_token()? == b'"' {
        c.string_to(text)
    } else {
        c.value_to(CALL_DEPTH + 1, text)
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
fn text_prompt(body: &[u8], start: usize, text: &mut impl Reader) -> Result<(), PromptError> {
    let mut c = Cursor::new(body, start);
    if c.peek_token()? == b'"' {
        text.emit(PROMPT);
        return c.string_to(text);
    }
    c.array(1, |c, _| {
        if c.peek_token()? != b'"' {
            return Err(PromptError::WrongType("prompt[]"));
        }
        text.emit(PROMPT);
        c.string_to(text)
    })
}

/// [`token_prompt_within`] without bounds.
#[cfg(test)]
fn token_prompt(c: &mut Cursor<'_>, sink: &mut impl PromptSink) -> Result<(), PromptError> {
    token_prompt_within(c, &mut Budget::new(&PromptLimits::UNLIMITED), sink)
}

/// A token `prompt` at the cursor: a list of ids, or a list of lists of which the first is
/// used (the others are checked). Leaves the cursor after the value. Every id read counts
/// against the budget's ids, the unused lists' too.
fn token_prompt_within(
    c: &mut Cursor<'_>,
    budget: &mut Budget,
    sink: &mut impl PromptSink,
) -> Result<(), PromptError> {
    let mut probe = Cursor::new(c.buf, c.pos);
    probe.skip_ws();
    probe.pos += 1;
    let nested = probe.peek_token()? == b'[';
    let ids = budget.ids_left;
    if !nested {
        // The common form, as `Cursor::array` reads it, in one loop.
        c.expect(b'[')?;
        if c.peek_token()? == b']' {
            c.pos += 1;
            return Ok(());
        }
        let mut index = 0usize;
        loop {
            if c.peek_token()? == b'[' {
                return Err(PromptError::WrongType("prompt[]"));
            }
            if index >= ids {
                return Err(budget.stop(Bound::Tokens));
            }
            sink.piece(Piece::Token(token_id(c)?));
            index += 1;
            match c.peek_token()? {
                b',' => c.pos += 1,
                b']' => {
                    c.pos += 1;
                    return Ok(());
                }
                _ => return Err(c.syntax()),
            }
        }
    }
    // Ids of the lists before this one.
    let mut read = 0usize;
    c.array(1, |c, index| {
        if c.peek_token()? != b'[' {
            return Err(PromptError::WrongType("prompt[]"));
        }
        let mut count = 0usize;
        c.array(2, |c, _| {
            if read + count >= ids {
                return Err(budget.stop(Bound::Tokens));
            }
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
        read += count;
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
