//! Decoding KV event batches from every engine variant in replica-interfaces.md section 1, by
//! hand over the msgpack bytes (no intermediate tree):
//! - batch as the positional `[ts, events, dp_rank?, ...]` or as a map
//!   (`ts`, `events`, `data_parallel_rank` or `dp_rank`);
//! - events as maps tagged by "type" (any key order, unknown keys ignored, optional keys
//!   missing) or as positional arrays with the tag first (BlockStored from 5 elements up; extra
//!   trailing elements ignored);
//! - block hashes as unsigned ints (vLLM), signed ints (SGLang; the bit pattern is kept), or
//!   binaries such as 32-byte digests (the last 8 bytes, big-endian);
//! - `token_ids` as ints, or as the bigram pairs `[t_j, t_{j+1}]` SGLang's EAGLE speculative
//!   decoding publishes (the first elements are the raw tokens; each pair must continue the
//!   one before it);
//! - events of a type this build does not know are skipped, so new engines do not break old
//!   balancers.
//!
//! Input is hostile: every length is checked against the bytes left before anything is
//! allocated, nesting is bounded, and every failure is a `DecodeError` naming what was wrong and
//! where. Events are read one at a time: an event whose msgpack is whole but whose content is
//! not an event (a negative token id, a missing key) becomes `KvEvent::Undecodable` with its
//! error and the batch's other events stand; only a payload whose envelope cannot be read (the
//! batch, its event list, an event's msgpack framing) is an error of the whole batch. The decoder does not check the events' meaning (for example that `token_ids` holds
//! `block_hashes.len() * block_size` tokens); that is the consumer's call.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::{BlockKey, KvEvent, KvEventBatch, Medium};
use std::fmt;

/// Why a payload is not a KV event batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    message: String,
}

impl DecodeError {
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad KV event batch: {}", self.message)
    }
}

impl std::error::Error for DecodeError {}

/// Nesting deeper than this is refused rather than followed (unknown values are skipped
/// recursively).
const MAX_DEPTH: u32 = 64;

/// Decode one msgpack payload (the third frame of a KV event message).
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, DecodeError> {
    let mut r = Reader {
        buf: payload,
        pos: 0,
    };
    let batch = r.batch()?;
    if r.pos != payload.len() {
        return Err(r.error(&format!(
            "{} trailing bytes after the batch",
            payload.len() - r.pos
        )));
    }
    Ok(batch)
}

/// A msgpack integer, whichever family it was written in.
#[derive(Debug, Clone, Copy)]
enum Int {
    Unsigned(u64),
    Signed(i64),
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// What [`Reader::extra_keys`] keeps: the strings of block 0's entry, and the first block
/// with a key no request names.
#[derive(Default)]
struct ExtraKeys {
    first_strings: Vec<String>,
    opaque_from: Option<u32>,
}

/// The block key of a map BlockStored. vLLM's block-0 entry lists the adapter name first
/// (when `lora_name` is set), then the cache salt (only from a prompt's start); SGLang names
/// the salt in its own field.
fn block_key(
    lora_name: Option<String>,
    cache_salt: Option<String>,
    parent: Option<u64>,
    extra: Option<ExtraKeys>,
) -> BlockKey {
    let mut key = BlockKey {
        lora_name,
        cache_salt,
        opaque_from: None,
    };
    if let Some(extra) = extra {
        key.opaque_from = extra.opaque_from;
        let mut strings = extra.first_strings.into_iter().peekable();
        if key.lora_name.is_some() && strings.peek() == key.lora_name.as_ref() {
            strings.next();
        }
        if parent.is_none() && key.cache_salt.is_none() {
            key.cache_salt = strings.next();
        }
    }
    // An empty salt is none, to vLLM and SGLang alike.
    key.cache_salt = key.cache_salt.filter(|s| !s.is_empty());
    key
}

fn describe(marker: u8) -> &'static str {
    match marker {
        0x00..=0x7f | 0xcc..=0xcf => "an unsigned int",
        0xe0..=0xff | 0xd0..=0xd3 => "a signed int",
        0x80..=0x8f | 0xde | 0xdf => "a map",
        0x90..=0x9f | 0xdc | 0xdd => "an array",
        0xa0..=0xbf | 0xd9..=0xdb => "a string",
        0xc0 => "nil",
        0xc2 | 0xc3 => "a bool",
        0xc4..=0xc6 => "a binary",
        0xca | 0xcb => "a float",
        0xc7..=0xc9 | 0xd4..=0xd8 => "an extension value",
        _ => "the reserved byte 0xc1",
    }
}

impl<'a> Reader<'a> {
    fn error(&self, what: &str) -> DecodeError {
        DecodeError {
            message: format!("{what} (at byte {} of {})", self.pos, self.buf.len()),
        }
    }

    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn peek(&self) -> Result<u8, DecodeError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.error("payload ends where a value was expected"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.left() < n {
            return Err(self.error(&format!(
                "truncated: {n} bytes needed, {} left",
                self.left()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    fn unexpected(&self, expected: &str, field: &str) -> DecodeError {
        let found = self.buf.get(self.pos).map_or("nothing", |&m| describe(m));
        self.error(&format!("{field}: expected {expected}, found {found}"))
    }

    /// Consume a nil if one is next.
    fn nil(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn is_map(&self) -> bool {
        matches!(self.buf.get(self.pos), Some(0x80..=0x8f | 0xde | 0xdf))
    }

    fn is_array(&self) -> bool {
        matches!(self.buf.get(self.pos), Some(0x90..=0x9f | 0xdc | 0xdd))
    }

    /// A container length, refused when the bytes left cannot hold that many elements
    /// (`min_element_bytes` each).
    fn checked_len(
        &self,
        n: u64,
        min_element_bytes: usize,
        field: &str,
    ) -> Result<usize, DecodeError> {
        if n > (self.left() / min_element_bytes) as u64 {
            return Err(self.error(&format!(
                "{field}: {n} elements announced but only {} bytes left",
                self.left()
            )));
        }
        Ok(n as usize)
    }

    fn array_len(&mut self, field: &str) -> Result<usize, DecodeError> {
        let n = match self.peek()? {
            m @ 0x90..=0x9f => {
                self.pos += 1;
                (m & 0x0f) as u64
            }
            0xdc => {
                self.pos += 1;
                self.be(2)?
            }
            0xdd => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.unexpected("an array", field)),
        };
        self.checked_len(n, 1, field)
    }

    fn map_len(&mut self, field: &str) -> Result<usize, DecodeError> {
        let n = match self.peek()? {
            m @ 0x80..=0x8f => {
                self.pos += 1;
                (m & 0x0f) as u64
            }
            0xde => {
                self.pos += 1;
                self.be(2)?
            }
            0xdf => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.unexpected("a map", field)),
        };
        self.checked_len(n, 2, field)
    }

    fn str(&mut self, field: &str) -> Result<&'a str, DecodeError> {
        let n = match self.peek()? {
            m @ 0xa0..=0xbf => {
                self.pos += 1;
                (m & 0x1f) as usize
            }
            0xd9 => {
                self.pos += 1;
                self.be(1)? as usize
            }
            0xda => {
                self.pos += 1;
                self.be(2)? as usize
            }
            0xdb => {
                self.pos += 1;
                self.be(4)? as usize
            }
            _ => return Err(self.unexpected("a string", field)),
        };
        let start = self.pos;
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes).map_err(|_| {
            let mut e = self.error(&format!("{field}: string is not UTF-8"));
            e.message = format!("{} (string starts at byte {start})", e.message);
            e
        })
    }

    fn bin(&mut self, field: &str) -> Result<&'a [u8], DecodeError> {
        let n = match self.peek()? {
            0xc4 => {
                self.pos += 1;
                self.be(1)?
            }
            0xc5 => {
                self.pos += 1;
                self.be(2)?
            }
            0xc6 => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.unexpected("a binary", field)),
        } as usize;
        self.take(n)
    }

    fn int(&mut self, field: &str) -> Result<Int, DecodeError> {
        let m = self.peek()?;
        let v = match m {
            0x00..=0x7f => {
                self.pos += 1;
                Int::Unsigned(m as u64)
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::Signed(m as i8 as i64)
            }
            0xcc..=0xcf => {
                self.pos += 1;
                Int::Unsigned(self.be(1 << (m - 0xcc))?)
            }
            0xd0..=0xd3 => {
                self.pos += 1;
                let n = 1usize << (m - 0xd0);
                let raw = self.be(n)?;
                let shift = 64 - 8 * n as u32;
                Int::Signed(((raw << shift) as i64) >> shift)
            }
            _ => return Err(self.unexpected("an integer", field)),
        };
        Ok(v)
    }

    fn uint(&mut self, field: &str) -> Result<u64, DecodeError> {
        let at = self.pos;
        match self.int(field)? {
            Int::Unsigned(v) => Ok(v),
            Int::Signed(v) if v >= 0 => Ok(v as u64),
            Int::Signed(v) => {
                self.pos = at;
                Err(self.error(&format!("{field}: expected an unsigned int, found {v}")))
            }
        }
    }

    fn u32(&mut self, field: &str) -> Result<u32, DecodeError> {
        let at = self.pos;
        let v = self.uint(field)?;
        u32::try_from(v).map_err(|_| {
            self.pos = at;
            self.error(&format!("{field}: {v} does not fit in 32 bits"))
        })
    }

    fn i64(&mut self, field: &str) -> Result<i64, DecodeError> {
        let at = self.pos;
        match self.int(field)? {
            Int::Signed(v) => Ok(v),
            Int::Unsigned(v) => i64::try_from(v).map_err(|_| {
                self.pos = at;
                self.error(&format!("{field}: {v} does not fit in a signed 64-bit int"))
            }),
        }
    }

    fn opt_i64(&mut self, field: &str) -> Result<Option<i64>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        self.i64(field).map(Some)
    }

    fn float(&mut self, field: &str) -> Result<f64, DecodeError> {
        match self.peek()? {
            0xca => {
                self.pos += 1;
                Ok(f32::from_bits(self.be(4)? as u32) as f64)
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_bits(self.be(8)?))
            }
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xcf | 0xd0..=0xd3 => match self.int(field)? {
                Int::Unsigned(v) => Ok(v as f64),
                Int::Signed(v) => Ok(v as f64),
            },
            _ => Err(self.unexpected("a number", field)),
        }
    }

    /// A block hash as an opaque 64-bit id: unsigned int, signed int (bit pattern kept) or
    /// binary digest (last 8 bytes, big-endian).
    fn hash(&mut self, field: &str) -> Result<u64, DecodeError> {
        match self.peek()? {
            0xc4..=0xc6 => {
                let at = self.pos;
                let digest = self.bin(field)?;
                if digest.is_empty() {
                    self.pos = at;
                    return Err(self.error(&format!("{field}: empty binary hash")));
                }
                let tail = &digest[digest.len().saturating_sub(8)..];
                Ok(tail.iter().fold(0u64, |acc, &b| (acc << 8) | b as u64))
            }
            _ => match self.int(field) {
                Ok(Int::Unsigned(v)) => Ok(v),
                Ok(Int::Signed(v)) => Ok(v as u64),
                Err(_) => Err(self.unexpected("an int or binary block hash", field)),
            },
        }
    }

    fn opt_hash(&mut self, field: &str) -> Result<Option<u64>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        self.hash(field).map(Some)
    }

    fn hashes(&mut self, field: &str) -> Result<Vec<u64>, DecodeError> {
        let n = self.array_len(field)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.hash(field)?);
        }
        Ok(out)
    }

    /// Token ids: ints, or SGLang's EAGLE bigrams `[t_j, t_{j+1}]` (the first elements are
    /// the raw tokens; each pair's first element must be the previous pair's second).
    fn tokens(&mut self, field: &str) -> Result<Vec<u32>, DecodeError> {
        let n = self.array_len(field)?;
        let mut out = Vec::with_capacity(n);
        if n == 0 || !self.is_array() {
            for _ in 0..n {
                out.push(self.u32(field)?);
            }
            return Ok(out);
        }
        let mut next = None;
        for j in 0..n {
            let at = self.pos;
            let len = self.array_len(field)?;
            if len != 2 {
                self.pos = at;
                return Err(self.error(&format!(
                    "{field}: bigram {j} has {len} elements, want [t_j, t_j+1]"
                )));
            }
            let at = self.pos;
            let first = self.u32(field)?;
            if next.is_some_and(|t| t != first) {
                self.pos = at;
                return Err(self.error(&format!(
                    "{field}: bigram {j} starts with {first}, does not continue bigram {}",
                    j - 1
                )));
            }
            next = Some(self.u32(field)?);
            out.push(first);
        }
        Ok(out)
    }

    fn opt_str(&mut self, field: &str) -> Result<Option<String>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        Ok(Some(self.str(field)?.to_string()))
    }

    /// vLLM's `extra_keys`: nil, or one entry per block, nil or an array of keys (strings:
    /// the adapter name and the cache salt; arrays: multimodal `(identifier, offset)` pairs;
    /// binaries: prompt-embeddings digests).
    fn extra_keys(&mut self) -> Result<Option<ExtraKeys>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        let n = self.array_len("extra_keys")?;
        let mut keys = ExtraKeys::default();
        for i in 0..n {
            if self.nil() {
                continue;
            }
            let m = self.array_len("extra_keys entry")?;
            for _ in 0..m {
                let b = self.peek()?;
                if self.nil() {
                    continue;
                }
                if b & 0xe0 == 0xa0 || matches!(b, 0xd9..=0xdb) {
                    let s = self.str("extra_keys entry")?;
                    if i == 0 {
                        keys.first_strings.push(s.to_string());
                    }
                } else {
                    self.skip(1)?;
                    keys.opaque_from.get_or_insert(i as u32);
                }
            }
        }
        Ok(Some(keys))
    }

    fn opt_medium(&mut self, field: &str) -> Result<Option<Medium>, DecodeError> {
        if self.nil() {
            return Ok(None);
        }
        Ok(Some(Medium::parse(self.str(field)?)))
    }

    /// Skip one value of any type.
    fn skip(&mut self, depth: u32) -> Result<(), DecodeError> {
        if depth > MAX_DEPTH {
            return Err(self.error(&format!("values nested deeper than {MAX_DEPTH}")));
        }
        let m = self.peek()?;
        match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => self.pos += 1,
            0xcc..=0xd3 => {
                self.int("value")?;
            }
            0xca => {
                self.take(5)?;
            }
            0xcb => {
                self.take(9)?;
            }
            0xa0..=0xbf | 0xd9..=0xdb => {
                // Skipped strings need not be UTF-8.
                let n = match m {
                    0xa0..=0xbf => {
                        self.pos += 1;
                        (m & 0x1f) as usize
                    }
                    _ => {
                        self.pos += 1;
                        self.be(1 << (m - 0xd9))? as usize
                    }
                };
                self.take(n)?;
            }
            0xc4..=0xc6 => {
                self.bin("value")?;
            }
            0xd4..=0xd8 => {
                // fixext 1, 2, 4, 8, 16: type byte + data
                self.take(2 + (1usize << (m - 0xd4)))?;
            }
            0xc7..=0xc9 => {
                self.pos += 1;
                let n = self.be(1 << (m - 0xc7))? as usize;
                self.take(1 + n)?;
            }
            0x90..=0x9f | 0xdc | 0xdd => {
                let n = self.array_len("value")?;
                for _ in 0..n {
                    self.skip(depth + 1)?;
                }
            }
            0x80..=0x8f | 0xde | 0xdf => {
                let n = self.map_len("value")?;
                for _ in 0..2 * n {
                    self.skip(depth + 1)?;
                }
            }
            0xc1 => return Err(self.error("the reserved msgpack byte 0xc1")),
        }
        Ok(())
    }

    fn batch(&mut self) -> Result<KvEventBatch, DecodeError> {
        if self.is_map() {
            return self.batch_map();
        }
        let n = self.array_len("batch")?;
        if n < 2 {
            return Err(self.error(&format!(
                "batch: array of {n} elements, want [ts, events, dp_rank]"
            )));
        }
        let ts = self.float("batch ts")?;
        let events = self.events()?;
        let dp_rank = if n >= 3 {
            self.opt_i64("batch dp_rank")?
        } else {
            None
        };
        for _ in 3..n {
            self.skip(1)?;
        }
        Ok(KvEventBatch {
            ts,
            events,
            dp_rank,
        })
    }

    fn batch_map(&mut self) -> Result<KvEventBatch, DecodeError> {
        let n = self.map_len("batch")?;
        let (mut ts, mut events, mut dp_rank) = (None, None, None);
        for _ in 0..n {
            let key = if self.peek()? & 0xe0 == 0xa0 || matches!(self.peek()?, 0xd9..=0xdb) {
                Some(self.str("batch key")?)
            } else {
                self.skip(1)?;
                None
            };
            match key {
                Some("ts") => ts = Some(self.float("batch ts")?),
                Some("events") => events = Some(self.events()?),
                Some("data_parallel_rank" | "dp_rank") => {
                    dp_rank = self.opt_i64("batch dp_rank")?
                }
                _ => self.skip(1)?,
            }
        }
        Ok(KvEventBatch {
            ts: ts.ok_or_else(|| self.error("batch map without \"ts\""))?,
            events: events.ok_or_else(|| self.error("batch map without \"events\""))?,
            dp_rank,
        })
    }

    /// The event list. An event that fails to read is skipped over as a msgpack value and
    /// kept as `Undecodable`; when even that fails, the payload's framing is broken and so is
    /// the batch.
    fn events(&mut self) -> Result<Vec<KvEvent>, DecodeError> {
        let n = self.array_len("batch events")?;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let start = self.pos;
            match self.event() {
                Ok(Some(e)) => out.push(e),
                Ok(None) => {}
                Err(mut e) => {
                    self.pos = start;
                    self.skip(1)?;
                    e.message = format!("event {i}: {}", e.message);
                    out.push(KvEvent::Undecodable(e));
                }
            }
        }
        Ok(out)
    }

    /// One event; None for an event type this build does not know.
    fn event(&mut self) -> Result<Option<KvEvent>, DecodeError> {
        if self.is_map() {
            self.event_map()
        } else if self.is_array() {
            self.event_array()
        } else {
            Err(self.unexpected("a map or an array", "event"))
        }
    }

    fn event_map(&mut self) -> Result<Option<KvEvent>, DecodeError> {
        let start = self.pos;
        let n = self.map_len("event")?;
        let mut ty = None;
        let mut block_hashes = None;
        let mut parent_block_hash = None;
        let mut token_ids = None;
        let mut block_size = None;
        let mut lora_id = None;
        let mut medium = None;
        let mut lora_name = None;
        let mut cache_salt = None;
        let mut extra_keys = None;
        for _ in 0..n {
            let m = self.peek()?;
            if !(m & 0xe0 == 0xa0 || matches!(m, 0xd9..=0xdb)) {
                self.skip(1)?;
                self.skip(1)?;
                continue;
            }
            match self.str("event key")? {
                "type" => ty = Some(self.str("event type")?),
                "block_hashes" => block_hashes = Some(self.hashes("block_hashes")?),
                "parent_block_hash" => parent_block_hash = self.opt_hash("parent_block_hash")?,
                "token_ids" => token_ids = Some(self.tokens("token_ids")?),
                "block_size" => block_size = Some(self.u32("block_size")?),
                "lora_id" => lora_id = self.opt_i64("lora_id")?,
                "medium" => medium = self.opt_medium("medium")?,
                "lora_name" => lora_name = self.opt_str("lora_name")?,
                "cache_salt" => cache_salt = self.opt_str("cache_salt")?,
                "extra_keys" => extra_keys = self.extra_keys()?,
                _ => self.skip(1)?,
            }
        }
        let missing = |r: &Reader, ty: &str, key: &str| {
            let mut e = r.error(&format!("{ty} event without {key:?}"));
            e.message = format!("{} (event starts at byte {start})", e.message);
            e
        };
        match ty {
            Some("BlockStored") => Ok(Some(KvEvent::BlockStored {
                block_hashes: block_hashes
                    .ok_or_else(|| missing(self, "BlockStored", "block_hashes"))?,
                parent_block_hash,
                token_ids: token_ids.ok_or_else(|| missing(self, "BlockStored", "token_ids"))?,
                block_size: block_size.ok_or_else(|| missing(self, "BlockStored", "block_size"))?,
                lora_id,
                medium,
                key: block_key(lora_name, cache_salt, parent_block_hash, extra_keys),
            })),
            Some("BlockRemoved") => Ok(Some(KvEvent::BlockRemoved {
                block_hashes: block_hashes
                    .ok_or_else(|| missing(self, "BlockRemoved", "block_hashes"))?,
                medium,
            })),
            Some("AllBlocksCleared") => Ok(Some(KvEvent::AllBlocksCleared)),
            Some(_) => Ok(None),
            None => Err(missing(self, "map", "type")),
        }
    }

    fn event_array(&mut self) -> Result<Option<KvEvent>, DecodeError> {
        let n = self.array_len("event")?;
        if n == 0 {
            return Err(self.error("event: empty array, want the event type first"));
        }
        let tag = self.str("event type")?;
        let (event, used) = match tag {
            "BlockStored" => {
                if n < 5 {
                    return Err(self.error(&format!(
                        "BlockStored event: array of {n} elements, want at least [\"BlockStored\", \
                         block_hashes, parent_block_hash, token_ids, block_size]"
                    )));
                }
                let block_hashes = self.hashes("block_hashes")?;
                let parent_block_hash = self.opt_hash("parent_block_hash")?;
                let token_ids = self.tokens("token_ids")?;
                let block_size = self.u32("block_size")?;
                let lora_id = if n > 5 {
                    self.opt_i64("lora_id")?
                } else {
                    None
                };
                let medium = if n > 6 {
                    self.opt_medium("medium")?
                } else {
                    None
                };
                let lora_name = if n > 7 {
                    self.opt_str("lora_name")?
                } else {
                    None
                };
                let event = KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    key: BlockKey {
                        lora_name,
                        ..BlockKey::default()
                    },
                };
                (Some(event), n.min(8))
            }
            "BlockRemoved" => {
                if n < 2 {
                    return Err(self.error("BlockRemoved event: array without block_hashes"));
                }
                let block_hashes = self.hashes("block_hashes")?;
                let medium = if n > 2 {
                    self.opt_medium("medium")?
                } else {
                    None
                };
                let event = KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                };
                (Some(event), n.min(3))
            }
            "AllBlocksCleared" => (Some(KvEvent::AllBlocksCleared), 1),
            _ => (None, 1),
        };
        for _ in used..n {
            self.skip(1)?;
        }
        Ok(event)
    }
}
