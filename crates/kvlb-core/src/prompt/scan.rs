//! The JSON scanner under prompt extraction: a cursor over borrowed body bytes that validates as
//! it goes and never recurses, so hostile input costs at most one linear pass.
//!
//! Strings are decoded while they are scanned and handed out as pieces: runs without escapes are
//! borrowed slices of the body, each escape is decoded into a 4-byte stack buffer. Nothing here
//! allocates. Nesting is tracked in a `u64` bit stack (one bit per level: object or array), which
//! is why the depth limit is [`MAX_DEPTH`] = 64 levels.
//!
//! What kvlb decides not to read (past a bound of the extraction) is crossed with
//! [`close_levels`], a structural skim from bit masks that validates nothing, ten to a hundred
//! times faster than the validating scan on structure-dense input.
//!
//! Strictness follows RFC 8259 where it is cheap: control bytes inside strings, bad escapes,
//! malformed numbers and trailing bytes are errors. Bytes >= 0x80 are passed through unchecked
//! (invalid UTF-8 hashes as the bytes it is; equal bytes still hash equal).

use super::PromptError;

/// Deepest nesting of arrays and objects accepted, counting the top-level object as 1.
pub const MAX_DEPTH: usize = 64;

/// Where decoded pieces go. Any `FnMut(&[u8])` closure is one that never stops. The bounded
/// extraction's sinks are charged for the scanner's work as it goes, where it checks anyway:
/// once per 64-byte stretch of a string that is not plain text (1 + its escapes), once per
/// token of a canonical value. They say when a bound was reached, and the scanner then stops
/// with [`STOP`].
pub trait Emit {
    fn emit(&mut self, piece: &[u8]);

    /// `units` of scanning done; false: stop.
    #[inline(always)]
    fn charge(&mut self, _units: usize) -> bool {
        true
    }

    /// True once the pieces are no longer wanted.
    #[inline(always)]
    fn stopped(&self) -> bool {
        false
    }
}

impl<F: FnMut(&[u8])> Emit for F {
    #[inline(always)]
    fn emit(&mut self, piece: &[u8]) {
        self(piece)
    }
}

/// What a scan returns when its [`Emit`] stopped it: the caller that set the bound knows it
/// from its own state and reads this as "stopped", never as a cut-short body.
pub const STOP: PromptError = PromptError::Truncated;

/// One 64-byte stretch of a string: bit i of each mask describes byte i.
struct ChunkMasks {
    quote: u64,
    backslash: u64,
    /// Bytes below 0x20, which JSON strings may not hold raw.
    control: u64,
}

/// Classifies 64 bytes at once (SSE2, part of every x86_64 CPU).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn classify(chunk: &[u8; 64]) -> ChunkMasks {
    use std::arch::x86_64::*;
    let (mut quote, mut backslash, mut control) = (0u64, 0u64, 0u64);
    // Safety: SSE2 is in the x86_64 baseline, so the intrinsics exist on every CPU this code
    // runs on; each unaligned load reads bytes 16*i..16*i+16 of the 64-byte array.
    unsafe {
        let quotes = _mm_set1_epi8(b'"' as i8);
        let backslashes = _mm_set1_epi8(b'\\' as i8);
        let control_max = _mm_set1_epi8(0x1f);
        for i in 0..4 {
            let v = _mm_loadu_si128(chunk.as_ptr().add(16 * i) as *const __m128i);
            let q = _mm_movemask_epi8(_mm_cmpeq_epi8(v, quotes)) as u16 as u64;
            let b = _mm_movemask_epi8(_mm_cmpeq_epi8(v, backslashes)) as u16 as u64;
            // v <= 0x1f (unsigned) exactly when max(v, 0x1f) == 0x1f.
            let c = _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(v, control_max), control_max))
                as u16 as u64;
            quote |= q << (16 * i);
            backslash |= b << (16 * i);
            control |= c << (16 * i);
        }
    }
    ChunkMasks {
        quote,
        backslash,
        control,
    }
}

/// True if none of the 64 bytes is a quote, a backslash or a control byte: the common case
/// inside long strings, checked with a single mask.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn is_plain(chunk: &[u8; 64]) -> bool {
    use std::arch::x86_64::*;
    // Safety: as in `classify`: SSE2 is baseline on x86_64 and every load is inside `chunk`.
    unsafe {
        let quotes = _mm_set1_epi8(b'"' as i8);
        let backslashes = _mm_set1_epi8(b'\\' as i8);
        let control_max = _mm_set1_epi8(0x1f);
        let mut any = _mm_setzero_si128();
        for i in 0..4 {
            let v = _mm_loadu_si128(chunk.as_ptr().add(16 * i) as *const __m128i);
            let special = _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(v, quotes), _mm_cmpeq_epi8(v, backslashes)),
                _mm_cmpeq_epi8(_mm_max_epu8(v, control_max), control_max),
            );
            any = _mm_or_si128(any, special);
        }
        _mm_movemask_epi8(any) == 0
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn is_plain(chunk: &[u8; 64]) -> bool {
    let m = classify_bytewise(chunk);
    m.quote | m.backslash | m.control == 0
}

/// The end of the run of ASCII digits at `i` (16 bytes a step: a hostile number is as long as
/// the body).
#[inline]
fn digits_end(buf: &[u8], mut i: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        while i + 16 <= buf.len() {
            // Safety: SSE2 is in the x86_64 baseline; the load reads bytes i..i + 16 of `buf`.
            let digits = unsafe {
                let v = _mm_loadu_si128(buf.as_ptr().add(i) as *const __m128i);
                let offset = _mm_sub_epi8(v, _mm_set1_epi8(b'0' as i8));
                let nine = _mm_set1_epi8(9);
                // A digit is 0..=9 after the subtraction: max(d, 9) == 9, unsigned.
                _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(offset, nine), nine)) as u32
            };
            if digits != 0xffff {
                return i + (!digits).trailing_zeros() as usize;
            }
            i += 16;
        }
    }
    while matches!(buf.get(i), Some(b'0'..=b'9')) {
        i += 1;
    }
    i
}

/// Where the first quote, backslash or control byte of `bytes` is (short strings: object keys).
#[inline(always)]
fn first_special(bytes: &[u8]) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        let mut at = 0;
        while at + 16 <= bytes.len() {
            // Safety: SSE2 is in the x86_64 baseline; the load reads bytes at..at + 16, inside
            // `bytes`.
            let mask = unsafe {
                let v = _mm_loadu_si128(bytes.as_ptr().add(at) as *const __m128i);
                let control_max = _mm_set1_epi8(0x1f);
                let special = _mm_or_si128(
                    _mm_or_si128(
                        _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8)),
                        _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8)),
                    ),
                    _mm_cmpeq_epi8(_mm_max_epu8(v, control_max), control_max),
                );
                _mm_movemask_epi8(special) as u32
            };
            if mask != 0 {
                return Some(at + mask.trailing_zeros() as usize);
            }
            at += 16;
        }
        bytes[at..]
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
            .map(|p| at + p)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        bytes
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
    }
}

/// Moves `pos` over whole 64-byte chunks of plain string bytes (with AVX2 where the CPU has
/// it: long prompts are mostly such chunks).
#[inline(always)]
fn skip_plain_chunks(buf: &[u8], pos: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // Safety: the CPU supports AVX2, checked just above.
            return unsafe { skip_plain_chunks_avx2(buf, pos) };
        }
    }
    skip_plain_chunks_sse2(buf, pos)
}

#[inline(always)]
fn skip_plain_chunks_sse2(buf: &[u8], mut pos: usize) -> usize {
    while let Some(Ok(chunk)) = buf.get(pos..pos + 64).map(<&[u8; 64]>::try_from) {
        if !is_plain(chunk) {
            break;
        }
        pos += 64;
    }
    pos
}

/// [`skip_plain_chunks_sse2`] with 32-byte compares.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn skip_plain_chunks_avx2(buf: &[u8], mut pos: usize) -> usize {
    use std::arch::x86_64::*;
    let quotes = _mm256_set1_epi8(b'"' as i8);
    let backslashes = _mm256_set1_epi8(b'\\' as i8);
    let control_max = _mm256_set1_epi8(0x1f);
    while let Some(Ok(chunk)) = buf.get(pos..pos + 64).map(<&[u8; 64]>::try_from) {
        // Safety: both unaligned loads read inside the 64-byte `chunk`.
        let (a, b) = unsafe {
            (
                _mm256_loadu_si256(chunk.as_ptr() as *const __m256i),
                _mm256_loadu_si256(chunk.as_ptr().add(32) as *const __m256i),
            )
        };
        let special = |v: __m256i| {
            _mm256_or_si256(
                _mm256_or_si256(
                    _mm256_cmpeq_epi8(v, quotes),
                    _mm256_cmpeq_epi8(v, backslashes),
                ),
                _mm256_cmpeq_epi8(_mm256_max_epu8(v, control_max), control_max),
            )
        };
        if _mm256_movemask_epi8(_mm256_or_si256(special(a), special(b))) != 0 {
            break;
        }
        pos += 64;
    }
    pos
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn classify(chunk: &[u8; 64]) -> ChunkMasks {
    classify_bytewise(chunk)
}

/// One 64-byte stretch as the structural skim sees it: bit i of each mask describes byte i.
struct StructureMasks {
    quote: u64,
    backslash: u64,
    /// `[` or `{`.
    open: u64,
    /// `]` or `}`.
    close: u64,
}

/// Classifies 64 bytes for [`close_levels`] (SSE2). `[` and `{` are the bytes that OR 0x20
/// makes `{`, `]` and `}` those it makes `}`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn classify_structure(chunk: &[u8; 64]) -> StructureMasks {
    use std::arch::x86_64::*;
    let (mut quote, mut backslash, mut open, mut close) = (0u64, 0u64, 0u64, 0u64);
    // Safety: SSE2 is in the x86_64 baseline; each unaligned load reads bytes 16*i..16*i+16 of
    // the 64-byte array.
    unsafe {
        let quotes = _mm_set1_epi8(b'"' as i8);
        let backslashes = _mm_set1_epi8(b'\\' as i8);
        let case = _mm_set1_epi8(0x20);
        let opens = _mm_set1_epi8(b'{' as i8);
        let closes = _mm_set1_epi8(b'}' as i8);
        for i in 0..4 {
            let v = _mm_loadu_si128(chunk.as_ptr().add(16 * i) as *const __m128i);
            let folded = _mm_or_si128(v, case);
            let mask = |m: __m128i| _mm_movemask_epi8(m) as u16 as u64;
            quote |= mask(_mm_cmpeq_epi8(v, quotes)) << (16 * i);
            backslash |= mask(_mm_cmpeq_epi8(v, backslashes)) << (16 * i);
            open |= mask(_mm_cmpeq_epi8(folded, opens)) << (16 * i);
            close |= mask(_mm_cmpeq_epi8(folded, closes)) << (16 * i);
        }
    }
    StructureMasks {
        quote,
        backslash,
        open,
        close,
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn classify_structure(chunk: &[u8; 64]) -> StructureMasks {
    classify_structure_bytewise(chunk)
}

/// The portable structure classifier (and the reference the SSE2 one is tested against).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn classify_structure_bytewise(chunk: &[u8; 64]) -> StructureMasks {
    let (mut quote, mut backslash, mut open, mut close) = (0u64, 0u64, 0u64, 0u64);
    for (i, &b) in chunk.iter().enumerate() {
        quote |= ((b == b'"') as u64) << i;
        backslash |= ((b == b'\\') as u64) << i;
        open |= (matches!(b, b'[' | b'{') as u64) << i;
        close |= (matches!(b, b']' | b'}') as u64) << i;
    }
    StructureMasks {
        quote,
        backslash,
        open,
        close,
    }
}

/// Bit i of the result is the XOR of bits 0..=i of `x`: from a mask of string quotes, the bytes
/// inside strings (each opening quote included, each closing one not).
#[inline(always)]
fn prefix_xor(mut x: u64) -> u64 {
    x ^= x << 1;
    x ^= x << 2;
    x ^= x << 4;
    x ^= x << 8;
    x ^= x << 16;
    x ^= x << 32;
    x
}

/// The structural skim: from `pos`, outside any string and inside `levels` open arrays or
/// objects, the position just after the bracket that closes the outermost of them. 64 bytes
/// a step with bit masks (strings found from unescaped quotes, brackets in strings ignored,
/// long strings crossed as [`Cursor::string`] crosses them), 0.03-0.3 ns a byte, against 3-9
/// for the validating scan on structure-dense bodies. Nothing is validated (a `]` may close a
/// `{`): it is for what kvlb has decided not to read. Running out of body is
/// [`PromptError::Truncated`].
pub fn close_levels(buf: &[u8], pos: usize, levels: usize) -> Result<usize, PromptError> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("popcnt")
        {
            // Safety: the CPU supports AVX2 and POPCNT, checked just above.
            return unsafe { close_levels_avx2(buf, pos, levels) };
        }
    }
    close_levels_with(buf, pos, levels, classify_structure)
}

/// [`close_levels`] with 32-byte compares and the POPCNT instruction (the baseline build counts
/// bits in software).
///
/// # Safety
/// The CPU must support AVX2 and POPCNT.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn close_levels_avx2(buf: &[u8], pos: usize, levels: usize) -> Result<usize, PromptError> {
    close_levels_with(buf, pos, levels, |chunk| {
        // Safety: this function only runs where AVX2 is supported.
        unsafe { classify_structure_avx2(chunk) }
    })
}

/// [`classify_structure`] with AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn classify_structure_avx2(chunk: &[u8; 64]) -> StructureMasks {
    use std::arch::x86_64::*;
    let quotes = _mm256_set1_epi8(b'"' as i8);
    let backslashes = _mm256_set1_epi8(b'\\' as i8);
    let case = _mm256_set1_epi8(0x20);
    let opens = _mm256_set1_epi8(b'{' as i8);
    let closes = _mm256_set1_epi8(b'}' as i8);
    let (mut quote, mut backslash, mut open, mut close) = (0u64, 0u64, 0u64, 0u64);
    for half in 0..2 {
        // Safety: the unaligned load reads bytes 32*half..32*half+32 of the 64-byte array.
        let v = unsafe { _mm256_loadu_si256(chunk.as_ptr().add(32 * half) as *const __m256i) };
        let folded = _mm256_or_si256(v, case);
        let mask = |m: __m256i| _mm256_movemask_epi8(m) as u32 as u64;
        quote |= mask(_mm256_cmpeq_epi8(v, quotes)) << (32 * half);
        backslash |= mask(_mm256_cmpeq_epi8(v, backslashes)) << (32 * half);
        open |= mask(_mm256_cmpeq_epi8(folded, opens)) << (32 * half);
        close |= mask(_mm256_cmpeq_epi8(folded, closes)) << (32 * half);
    }
    StructureMasks {
        quote,
        backslash,
        open,
        close,
    }
}

#[inline(always)]
fn close_levels_with(
    buf: &[u8],
    mut pos: usize,
    levels: usize,
    classify: impl Fn(&[u8; 64]) -> StructureMasks,
) -> Result<usize, PromptError> {
    let mut depth = levels as u64;
    let mut carry = 0u64;
    // All ones while the previous stretch ended inside a string.
    let mut in_string = 0u64;
    let mut padded = [b' '; 64];
    loop {
        if in_string != 0 && carry == 0 {
            // Inside a string: long plain runs go by at the speed of the string scanner.
            pos = skip_plain_chunks(buf, pos);
        }
        let (chunk, valid) = chunk_at(buf, pos, &mut padded);
        let m = classify(chunk);
        let escaped = if m.backslash | carry == 0 {
            0
        } else {
            escapes(m.backslash, &mut carry).0
        };
        let inside = prefix_xor(m.quote & !escaped) ^ in_string;
        in_string = ((inside as i64) >> 63) as u64;
        let valid_mask = if valid >= 64 { !0 } else { (1u64 << valid) - 1 };
        let open = m.open & !inside & valid_mask;
        let close = m.close & !inside & valid_mask;
        let closes = close.count_ones() as u64;
        if closes >= depth {
            // The depth may reach zero here: at the first close where the closes so far
            // outnumber the opens before it by `depth`.
            let mut left = close;
            while left != 0 {
                let i = left.trailing_zeros();
                left &= left - 1;
                let below = (1u64 << i) - 1;
                let opened = (open & below).count_ones() as u64;
                let closed = (close & below).count_ones() as u64 + 1;
                if closed == depth + opened {
                    return Ok(pos + i as usize + 1);
                }
            }
        }
        depth = depth + open.count_ones() as u64 - closes;
        if valid < 64 {
            return Err(PromptError::Truncated);
        }
        pos += 64;
    }
}

/// The portable classifier (and the reference the SSE2 one is tested against).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn classify_bytewise(chunk: &[u8; 64]) -> ChunkMasks {
    let (mut quote, mut backslash, mut control) = (0u64, 0u64, 0u64);
    for (i, &b) in chunk.iter().enumerate() {
        quote |= ((b == b'"') as u64) << i;
        backslash |= ((b == b'\\') as u64) << i;
        control |= ((b < 0x20) as u64) << i;
    }
    ChunkMasks {
        quote,
        backslash,
        control,
    }
}

const ODD_BITS: u64 = 0xAAAA_AAAA_AAAA_AAAA;

/// From a chunk's backslash mask, the bytes escaped by a backslash (`escaped`) and the
/// backslashes that start an escape (`starts`); `carry` says whether the chunk's first byte is
/// escaped and is updated for the next chunk. Branch-free: runs of backslashes pair up by the
/// parity of where they start (simdjson's escape scanner).
#[inline(always)]
fn escapes(backslash: u64, carry: &mut u64) -> (u64, u64) {
    let potential = backslash & !*carry;
    let maybe_escaped = potential << 1;
    let codes = ((maybe_escaped | ODD_BITS).wrapping_sub(potential)) ^ ODD_BITS;
    let escaped = codes ^ (backslash | *carry);
    let starts = codes & backslash;
    *carry = starts >> 63;
    (escaped, starts)
}

/// The 64 bytes of `buf` from `pos`, padded with spaces past its end, and how many are real.
#[inline(always)]
fn chunk_at<'b>(buf: &'b [u8], pos: usize, padded: &'b mut [u8; 64]) -> (&'b [u8; 64], usize) {
    if let Some(Ok(chunk)) = buf.get(pos..pos + 64).map(<&[u8; 64]>::try_from) {
        return (chunk, 64);
    }
    let rest = buf.get(pos..).unwrap_or(&[]);
    let n = rest.len().min(64);
    padded[..n].copy_from_slice(&rest[..n]);
    (padded, n)
}

/// Where a string's content ends within a chunk: (bits of the chunk inside the string,
/// index of the closing quote if it is in this chunk).
#[inline(always)]
fn string_extent(masks: &ChunkMasks, escaped: u64, valid: usize) -> (u64, Option<usize>) {
    let valid_mask = if valid >= 64 { !0 } else { (1u64 << valid) - 1 };
    let closing = masks.quote & !escaped & valid_mask;
    if closing != 0 {
        let end = closing.trailing_zeros() as usize;
        ((1u64 << end) - 1, Some(end))
    } else {
        (valid_mask, None)
    }
}

#[inline]
fn hex_value(b: u8) -> Option<u16> {
    match b {
        b'0'..=b'9' => Some((b - b'0') as u16),
        b'a'..=b'f' => Some((b - b'a' + 10) as u16),
        b'A'..=b'F' => Some((b - b'A' + 10) as u16),
        _ => None,
    }
}

/// UTF-8 encoding of `c` into `buf`; returns the used prefix.
#[inline]
fn utf8(c: char, buf: &mut [u8; 4]) -> &[u8] {
    c.encode_utf8(buf).as_bytes()
}

const REPLACEMENT: &[u8] = "\u{FFFD}".as_bytes();

/// The byte each one-character escape stands for (0: not one; `\u` is handled apart).
const ESCAPES: [u8; 256] = {
    let mut table = [0u8; 256];
    table[b'"' as usize] = b'"';
    table[b'\\' as usize] = b'\\';
    table[b'/' as usize] = b'/';
    table[b'b' as usize] = 0x08;
    table[b'f' as usize] = 0x0c;
    table[b'n' as usize] = b'\n';
    table[b'r' as usize] = b'\r';
    table[b't' as usize] = b'\t';
    table
};

/// A position in the body. Errors carry absolute body offsets.
pub struct Cursor<'a> {
    pub buf: &'a [u8],
    pub pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8], pos: usize) -> Cursor<'a> {
        Cursor { buf, pos }
    }

    #[inline]
    pub fn skip_ws(&mut self) {
        while let Some(&b) = self.buf.get(self.pos) {
            if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    /// The next byte, without consuming it; running out of bytes means the body was cut short.
    #[inline]
    pub fn peek(&self) -> Result<u8, PromptError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or(PromptError::Truncated)
    }

    /// Skips whitespace and returns the next byte without consuming it.
    #[inline]
    pub fn peek_token(&mut self) -> Result<u8, PromptError> {
        self.skip_ws();
        self.peek()
    }

    #[inline]
    pub fn syntax(&self) -> PromptError {
        PromptError::Syntax { offset: self.pos }
    }

    /// Consumes `want` (after whitespace) or fails.
    #[inline]
    pub fn expect(&mut self, want: u8) -> Result<(), PromptError> {
        if self.peek_token()? == want {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.syntax())
        }
    }

    /// Scans the string starting at the cursor (which must be on its opening quote), passing its
    /// decoded bytes to `emit` in pieces; leaves the cursor after the closing quote.
    ///
    /// 64 bytes at a time: plain runs go out as borrowed slices of the body, each escape is
    /// decoded on its own; the closing quote is found from bit masks, without a branch per byte.
    pub fn string(&mut self, emit: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
        self.string_to(emit)
    }

    /// [`Cursor::string`] into an [`Emit`], which may stop it (with [`STOP`]).
    pub fn string_to(&mut self, emit: &mut impl Emit) -> Result<(), PromptError> {
        if self.peek_token()? != b'"' {
            return Err(self.syntax());
        }
        let buf = self.buf;
        let mut chunk_pos = self.pos + 1;
        // Start of the plain run not emitted yet.
        let mut run = chunk_pos;
        let mut carry = 0u64;
        let mut padded = [b' '; 64];
        loop {
            let (chunk, valid) = chunk_at(buf, chunk_pos, &mut padded);
            let masks = classify(chunk);
            if carry == 0 && valid == 64 && masks.quote | masks.backslash | masks.control == 0 {
                // A plain chunk: the ones after it are likely plain too (short strings and
                // string ends are found without that call).
                chunk_pos = skip_plain_chunks(buf, chunk_pos + 64);
                continue;
            }
            let (escaped, starts) = escapes(masks.backslash, &mut carry);
            let (inside, closing) = string_extent(&masks, escaped, valid);
            if masks.control & inside != 0 {
                let at = chunk_pos + (masks.control & inside).trailing_zeros() as usize;
                return Err(PromptError::Syntax { offset: at });
            }
            let mut starts = starts & inside;
            let mut units = 1;
            while starts != 0 {
                let at = chunk_pos + starts.trailing_zeros() as usize;
                starts &= starts - 1;
                units += 1;
                if at < run {
                    continue; // the second half of a surrogate pair, decoded with the first
                }
                if at > run {
                    emit.emit(&buf[run..at]);
                }
                self.pos = at;
                self.escape(emit)?;
                run = self.pos;
            }
            if let Some(end) = closing {
                let end = chunk_pos + end;
                if end > run {
                    emit.emit(&buf[run..end]);
                }
                self.pos = end + 1;
                return Ok(());
            }
            if valid < 64 {
                self.pos = buf.len();
                return Err(PromptError::Truncated);
            }
            if !emit.charge(units) {
                self.pos = chunk_pos;
                return Err(STOP);
            }
            chunk_pos += 64;
        }
    }

    /// Decodes the escape at the cursor (on its backslash).
    #[inline]
    fn escape(&mut self, emit: &mut impl Emit) -> Result<(), PromptError> {
        let Some(&e) = self.buf.get(self.pos + 1) else {
            return Err(PromptError::Truncated);
        };
        let decoded = ESCAPES[e as usize];
        if decoded == 0 {
            if e == b'u' {
                return self.unicode_escape(emit);
            }
            self.pos += 1;
            return Err(self.syntax());
        }
        emit.emit(&[decoded]);
        self.pos += 2;
        Ok(())
    }

    /// Skips the string starting at the cursor (on its opening quote), checking it as
    /// [`Cursor::string`] does but without decoding it; without `CHECK_ESCAPES`, what follows
    /// each backslash is not checked (for values that a later pass decodes anyway).
    pub fn skip_string<const CHECK_ESCAPES: bool>(&mut self) -> Result<(), PromptError> {
        if self.peek_token()? != b'"' {
            return Err(self.syntax());
        }
        let buf = self.buf;
        let mut chunk_pos = self.pos + 1;
        let mut carry = 0u64;
        let mut padded = [b' '; 64];
        loop {
            let (chunk, valid) = chunk_at(buf, chunk_pos, &mut padded);
            let masks = classify(chunk);
            if carry == 0 && valid == 64 && masks.quote | masks.backslash | masks.control == 0 {
                // A plain chunk: the ones after it are likely plain too (short strings and
                // string ends are found without that call).
                chunk_pos = skip_plain_chunks(buf, chunk_pos + 64);
                continue;
            }
            let (escaped, _) = escapes(masks.backslash, &mut carry);
            let (inside, closing) = string_extent(&masks, escaped, valid);
            if masks.control & inside != 0 {
                let at = chunk_pos + (masks.control & inside).trailing_zeros() as usize;
                return Err(PromptError::Syntax { offset: at });
            }
            // Every escaped byte must name an escape.
            let mut codes = if CHECK_ESCAPES { escaped & inside } else { 0 };
            while codes != 0 {
                let i = codes.trailing_zeros() as usize;
                codes &= codes - 1;
                let code = chunk[i];
                if ESCAPES[code as usize] == 0 {
                    if code != b'u' {
                        return Err(PromptError::Syntax {
                            offset: chunk_pos + i,
                        });
                    }
                    // The backslash is the byte before the code (in the previous chunk for i = 0).
                    self.code_unit(chunk_pos + i - 1)?;
                }
            }
            if let Some(end) = closing {
                self.pos = chunk_pos + end + 1;
                return Ok(());
            }
            if valid < 64 {
                self.pos = buf.len();
                return Err(PromptError::Truncated);
            }
            chunk_pos += 64;
        }
    }

    /// Reads `\uXXXX` at `at`, returning the code unit.
    #[inline]
    fn code_unit(&self, at: usize) -> Result<u16, PromptError> {
        let digits = match self.buf.get(at + 2..at + 6) {
            Some(d) => d,
            None => {
                // Cut short, unless a byte that is present is already wrong.
                let present = self.buf.get(at + 2..).unwrap_or(&[]);
                return match present.iter().position(|&b| hex_value(b).is_none()) {
                    Some(i) => Err(PromptError::Syntax { offset: at + 2 + i }),
                    None => Err(PromptError::Truncated),
                };
            }
        };
        let mut unit = 0u16;
        for (i, &d) in digits.iter().enumerate() {
            let v = hex_value(d).ok_or(PromptError::Syntax { offset: at + 2 + i })?;
            unit = unit << 4 | v;
        }
        Ok(unit)
    }

    /// `\uXXXX`, with surrogate pairs joined; a lone surrogate becomes U+FFFD.
    fn unicode_escape(&mut self, emit: &mut impl Emit) -> Result<(), PromptError> {
        let unit = self.code_unit(self.pos)?;
        self.pos += 6;
        let mut out = [0u8; 4];
        match unit {
            0xD800..=0xDBFF => {
                // A high surrogate: joined only when a low surrogate escape follows at once.
                let next_is_escape = self.buf.get(self.pos) == Some(&b'\\')
                    && self.buf.get(self.pos + 1) == Some(&b'u');
                if next_is_escape {
                    let low = self.code_unit(self.pos)?;
                    if (0xDC00..=0xDFFF).contains(&low) {
                        self.pos += 6;
                        let c =
                            0x10000 + (((unit as u32) - 0xD800) << 10) + ((low as u32) - 0xDC00);
                        let c = char::from_u32(c).unwrap_or('\u{FFFD}');
                        emit.emit(utf8(c, &mut out));
                        return Ok(());
                    }
                }
                emit.emit(REPLACEMENT);
            }
            0xDC00..=0xDFFF => emit.emit(REPLACEMENT),
            _ => {
                let c = char::from_u32(unit as u32).unwrap_or('\u{FFFD}');
                emit.emit(utf8(c, &mut out));
            }
        }
        Ok(())
    }

    /// Scans a number, returning its text (validated against the JSON grammar).
    pub fn number(&mut self) -> Result<&'a [u8], PromptError> {
        self.skip_ws();
        let buf = self.buf;
        let start = self.pos;
        let mut i = start;
        let at = |i: usize| buf.get(i).copied();
        let digits = |i: usize| digits_end(buf, i);
        if at(i) == Some(b'-') {
            i += 1;
        }
        match at(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => i = digits(i + 1),
            None => return Err(PromptError::Truncated),
            Some(_) => return Err(PromptError::Syntax { offset: i }),
        }
        if at(i) == Some(b'.') {
            i += 1;
            match at(i) {
                Some(b'0'..=b'9') => i = digits(i),
                None => return Err(PromptError::Truncated),
                Some(_) => return Err(PromptError::Syntax { offset: i }),
            }
        }
        if matches!(at(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(at(i), Some(b'+' | b'-')) {
                i += 1;
            }
            match at(i) {
                Some(b'0'..=b'9') => i = digits(i),
                None => return Err(PromptError::Truncated),
                Some(_) => return Err(PromptError::Syntax { offset: i }),
            }
        }
        // A number running to the very end of the body may have been cut short; a complete body
        // never ends inside a value (its top level is an object).
        if i == buf.len() {
            return Err(PromptError::Truncated);
        }
        self.pos = i;
        Ok(&buf[start..i])
    }

    /// Scans `true`, `false` or `null`, returning its text.
    fn literal(&mut self) -> Result<&'a [u8], PromptError> {
        let word: &'static [u8] = match self.peek()? {
            b't' => b"true",
            b'f' => b"false",
            _ => b"null",
        };
        let rest = self.buf.get(self.pos..).unwrap_or(&[]);
        for (i, &w) in word.iter().enumerate() {
            match rest.get(i) {
                None => return Err(PromptError::Truncated),
                Some(&b) if b != w => {
                    return Err(PromptError::Syntax {
                        offset: self.pos + i,
                    })
                }
                Some(_) => {}
            }
        }
        let text = &self.buf[self.pos..self.pos + word.len()];
        self.pos += word.len();
        Ok(text)
    }

    /// True (and consumed) if the next value is `null`.
    pub fn null(&mut self) -> Result<bool, PromptError> {
        if self.peek_token()? == b'n' {
            self.literal()?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// [`Cursor::value_to`] with a closure (which never stops it).
    #[cfg(test)]
    pub fn value(&mut self, depth: usize, emit: &mut impl FnMut(&[u8])) -> Result<(), PromptError> {
        self.value_to(depth, emit)
    }

    /// Walks one whole value, validating it, with `depth` levels already open around it, and
    /// writes it canonically into `emit`: structural tokens, strings (decoded, between quote
    /// marks), numbers and literals as written, whitespace dropped. Iterative: hostile nesting
    /// fails at [`MAX_DEPTH`] without growing the call stack. An `emit` that stops ends it
    /// with [`STOP`].
    pub fn value_to(&mut self, depth: usize, emit: &mut impl Emit) -> Result<(), PromptError> {
        self.walk::<true, true>(depth, emit)
    }

    /// Skips one value (validating it), with `depth` levels open around it. Strings are checked
    /// but not decoded.
    #[inline]
    pub fn skip(&mut self, depth: usize) -> Result<(), PromptError> {
        self.walk::<false, true>(depth, &mut |_: &[u8]| {})
    }

    /// Skips one value checking its structure but not its escapes: for a first pass over values
    /// that the second pass reads (and so checks) in full.
    #[inline]
    pub fn skim(&mut self, depth: usize) -> Result<(), PromptError> {
        self.walk::<false, false>(depth, &mut |_: &[u8]| {})
    }

    /// Moves over one value with the structural skim ([`close_levels`]) where it is an array
    /// or an object; a string is skimmed as by [`Cursor::skim`], a number or literal runs to the
    /// next delimiter (found with `memchr`). Validates nothing, nesting included.
    pub fn skim_fast(&mut self) -> Result<(), PromptError> {
        match self.peek_token()? {
            b'"' => self.skip_string::<false>(),
            b'[' | b'{' => {
                self.pos = close_levels(self.buf, self.pos + 1, 1)?;
                Ok(())
            }
            _ => {
                // Up to the delimiter after it, whitespace before that left out.
                let rest = self.buf.get(self.pos..).unwrap_or(&[]);
                let Some(delimiter) = memchr::memchr3(b',', b']', b'}', rest) else {
                    self.pos = self.buf.len();
                    return Err(PromptError::Truncated);
                };
                let value = rest[..delimiter].trim_ascii_end();
                if value.is_empty() {
                    return Err(self.syntax());
                }
                self.pos += value.len();
                Ok(())
            }
        }
    }

    /// [`Cursor::value`] (`EMIT`) or [`Cursor::skip`].
    fn walk<const EMIT: bool, const CHECK_ESCAPES: bool>(
        &mut self,
        depth: usize,
        emit: &mut impl Emit,
    ) -> Result<(), PromptError> {
        // Bit i of `objects` is set when open level i (relative to this value) is an object.
        let mut objects: u64 = 0;
        let mut open = 0usize;
        loop {
            if EMIT && !emit.charge(1) {
                return Err(STOP);
            }
            // Expecting a value.
            match self.peek_token()? {
                c @ (b'{' | b'[') => {
                    if depth + open + 1 > MAX_DEPTH {
                        return Err(PromptError::TooDeep { offset: self.pos });
                    }
                    self.pos += 1;
                    let is_object = c == b'{';
                    emit.emit(if is_object { b"{" } else { b"[" });
                    let close = if is_object { b'}' } else { b']' };
                    if self.peek_token()? == close {
                        self.pos += 1;
                        emit.emit(if is_object { b"}" } else { b"]" });
                    } else {
                        if is_object {
                            objects |= 1 << open;
                        } else {
                            objects &= !(1 << open);
                        }
                        open += 1;
                        if is_object {
                            self.key::<EMIT, CHECK_ESCAPES>(emit)?;
                        }
                        continue;
                    }
                }
                b'"' => {
                    if EMIT {
                        emit.emit(b"\"");
                        self.string_to(emit)?;
                        emit.emit(b"\"");
                    } else {
                        self.skip_string::<CHECK_ESCAPES>()?;
                    }
                }
                b'-' | b'0'..=b'9' => {
                    let number = self.number()?;
                    emit.emit(number)
                }
                b't' | b'f' | b'n' => {
                    let literal = self.literal()?;
                    emit.emit(literal)
                }
                _ => return Err(self.syntax()),
            }
            // After a value: close containers or move to the next element.
            loop {
                if open == 0 {
                    return Ok(());
                }
                let in_object = objects & (1 << (open - 1)) != 0;
                match self.peek_token()? {
                    b',' => {
                        self.pos += 1;
                        emit.emit(b",");
                        if in_object {
                            self.key::<EMIT, CHECK_ESCAPES>(emit)?;
                        }
                        break;
                    }
                    b'}' if in_object => {
                        self.pos += 1;
                        emit.emit(b"}");
                        open -= 1;
                    }
                    b']' if !in_object => {
                        self.pos += 1;
                        emit.emit(b"]");
                        open -= 1;
                    }
                    _ => return Err(self.syntax()),
                }
            }
        }
    }

    /// An object key and its colon, emitted canonically.
    fn key<const EMIT: bool, const CHECK_ESCAPES: bool>(
        &mut self,
        emit: &mut impl Emit,
    ) -> Result<(), PromptError> {
        if EMIT {
            emit.emit(b"\"");
            self.string_to(emit)?;
            emit.emit(b"\"");
        } else {
            self.skip_string::<CHECK_ESCAPES>()?;
        }
        self.expect(b':')?;
        emit.emit(b":");
        Ok(())
    }

    /// Reads an object key into `key` (decoded, truncated to its capacity) and consumes the
    /// colon after it. Returns the decoded length, which exceeds `key.len()` for long keys.
    pub fn object_key(&mut self, key: &mut [u8]) -> Result<usize, PromptError> {
        // Most keys are short and plain: read them in place.
        if self.peek_token()? == b'"' {
            let start = self.pos + 1;
            let window = self
                .buf
                .get(start..self.buf.len().min(start + key.len() + 1))
                .unwrap_or(&[]);
            if let Some(end) = first_special(window) {
                if window[end] == b'"' {
                    copy_short(&mut key[..end], &window[..end]);
                    self.pos = start + end + 1;
                    self.expect(b':')?;
                    return Ok(end);
                }
            }
        }
        let mut len = 0usize;
        self.string(&mut |piece: &[u8]| {
            for &b in piece {
                if let Some(slot) = key.get_mut(len) {
                    *slot = b;
                }
                len += 1;
            }
        })?;
        self.expect(b':')?;
        Ok(len)
    }

    /// Iterates an object's members: calls `member(cursor, key)` with the cursor on each value;
    /// `member` must consume the value. The cursor must be on `{`.
    pub fn object(
        &mut self,
        depth: usize,
        mut member: impl FnMut(&mut Self, &[u8]) -> Result<(), PromptError>,
    ) -> Result<(), PromptError> {
        if depth + 1 > MAX_DEPTH {
            return Err(PromptError::TooDeep { offset: self.pos });
        }
        self.expect(b'{')?;
        if self.peek_token()? == b'}' {
            self.pos += 1;
            return Ok(());
        }
        let mut key = [0u8; KEY_CAPACITY];
        loop {
            let len = self.object_key(&mut key)?;
            // Keys longer than the buffer are none we look for: pass a name that matches nothing.
            let name: &[u8] = if len <= KEY_CAPACITY {
                &key[..len]
            } else {
                b"\x00long"
            };
            member(self, name)?;
            match self.peek_token()? {
                b',' => self.pos += 1,
                b'}' => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(self.syntax()),
            }
        }
    }

    /// Iterates an array's elements: calls `element(cursor, index)` with the cursor on each one;
    /// `element` must consume it. The cursor must be on `[`.
    pub fn array(
        &mut self,
        depth: usize,
        mut element: impl FnMut(&mut Self, usize) -> Result<(), PromptError>,
    ) -> Result<(), PromptError> {
        if depth + 1 > MAX_DEPTH {
            return Err(PromptError::TooDeep { offset: self.pos });
        }
        self.expect(b'[')?;
        if self.peek_token()? == b']' {
            self.pos += 1;
            return Ok(());
        }
        let mut index = 0usize;
        loop {
            element(self, index)?;
            index += 1;
            match self.peek_token()? {
                b',' => self.pos += 1,
                b']' => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(self.syntax()),
            }
        }
    }
}

/// `dst.copy_from_slice(src)` for the few bytes of keys, markers and escapes, without a call
/// to `memcpy`: at most two overlapping fixed-size moves. Slices of different lengths are left
/// alone.
#[inline(always)]
pub fn copy_short(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    if n != dst.len() {
        return;
    }
    match n {
        0 => {}
        1..=3 => {
            dst[0] = src[0];
            dst[n / 2] = src[n / 2];
            dst[n - 1] = src[n - 1];
        }
        4..=7 => {
            let (a, b): ([u8; 4], [u8; 4]) = (
                src[..4].try_into().unwrap_or_default(),
                src[n - 4..].try_into().unwrap_or_default(),
            );
            dst[..4].copy_from_slice(&a);
            dst[n - 4..].copy_from_slice(&b);
        }
        8..=16 => {
            let (a, b): ([u8; 8], [u8; 8]) = (
                src[..8].try_into().unwrap_or_default(),
                src[n - 8..].try_into().unwrap_or_default(),
            );
            dst[..8].copy_from_slice(&a);
            dst[n - 8..].copy_from_slice(&b);
        }
        17..=32 => {
            let (a, b): ([u8; 16], [u8; 16]) = (
                src[..16].try_into().unwrap_or_default(),
                src[n - 16..].try_into().unwrap_or_default(),
            );
            dst[..16].copy_from_slice(&a);
            dst[n - 16..].copy_from_slice(&b);
        }
        _ => dst.copy_from_slice(src),
    }
}

/// Longest object key compared by name; longer keys are skipped as unknown.
const KEY_CAPACITY: usize = 24;

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(json: &str) -> Result<Vec<u8>, PromptError> {
        let mut out = Vec::new();
        let mut c = Cursor::new(json.as_bytes(), 0);
        c.string(&mut |p: &[u8]| out.extend_from_slice(p))?;
        Ok(out)
    }

    #[test]
    fn sse2_and_bytewise_classifiers_agree() {
        let mut chunk = [0u8; 64];
        let mut x = 0x1234_5678_9abc_def0u64;
        for round in 0..2000 {
            for b in chunk.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = if round % 2 == 0 {
                    x as u8
                } else {
                    [b'"', b'\\', 0x1f, 0x20, 0x00, 0x80, 0xff, b'a'][x as usize % 8]
                };
            }
            let fast = classify(&chunk);
            let slow = classify_bytewise(&chunk);
            assert_eq!(fast.quote, slow.quote);
            assert_eq!(fast.backslash, slow.backslash);
            assert_eq!(fast.control, slow.control);
        }
    }

    #[test]
    fn plain_chunk_skipping_agrees_with_the_bytewise_reading() {
        let mut x = 0x51ed_2701_a3b4_c5d6u64;
        for _ in 0..3000 {
            let mut buf = vec![b'a'; 64 * 6 + 17];
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if !x.is_multiple_of(4) {
                let at = (x >> 8) as usize % buf.len();
                buf[at] = [b'"', b'\\', 0x00, 0x1f, 0x7f, 0x20, 0xff][(x >> 40) as usize % 7];
            }
            let start = (x >> 50) as usize % 70;
            let mut expect = start;
            while expect + 64 <= buf.len()
                && buf[expect..expect + 64]
                    .iter()
                    .all(|&b| b != b'"' && b != b'\\' && b >= 0x20)
            {
                expect += 64;
            }
            assert_eq!(skip_plain_chunks(&buf, start), expect);
            assert_eq!(skip_plain_chunks_sse2(&buf, start), expect);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // Safety: the CPU supports AVX2.
                assert_eq!(unsafe { skip_plain_chunks_avx2(&buf, start) }, expect);
            }
        }
    }

    #[test]
    fn escape_masks_match_a_byte_by_byte_reading() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..5000 {
            // Three chunks of backslashes and other bytes, runs of every length.
            let mut backslash = [0u64; 3];
            for m in backslash.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *m = x & (x >> 1 | x >> 3);
            }
            let mut expect_escaped = [0u64; 3];
            let mut expect_starts = [0u64; 3];
            let mut pending = false;
            for i in 0..192 {
                let is_backslash = backslash[i / 64] >> (i % 64) & 1 == 1;
                if pending {
                    expect_escaped[i / 64] |= 1 << (i % 64);
                    pending = false;
                } else if is_backslash {
                    expect_starts[i / 64] |= 1 << (i % 64);
                    pending = true;
                }
            }
            let mut carry = 0;
            for c in 0..3 {
                let (escaped, starts) = escapes(backslash[c], &mut carry);
                assert_eq!(escaped, expect_escaped[c], "chunk {c} of {backslash:x?}");
                assert_eq!(starts, expect_starts[c], "chunk {c} of {backslash:x?}");
            }
        }
    }

    #[test]
    fn skipping_and_decoding_agree_on_validity() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let alphabet: &[u8] = b"\\\\\\\"\"unbtd8D0a\x01 e";
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 150) as usize;
            let mut s = vec![b'"'];
            let mut y = x;
            for _ in 0..len {
                y = y.wrapping_mul(6364136223846793005).wrapping_add(1);
                s.push(alphabet[(y >> 33) as usize % alphabet.len()]);
            }
            let mut a = Cursor::new(&s, 0);
            let mut b = Cursor::new(&s, 0);
            let decoded = a.string(&mut |_| {});
            let skipped = b.skip_string::<true>();
            assert_eq!(
                decoded.is_ok(),
                skipped.is_ok(),
                "{:?}",
                String::from_utf8_lossy(&s)
            );
            let mut c = Cursor::new(&s, 0);
            let skimmed = c.skip_string::<false>();
            if decoded.is_ok() {
                assert_eq!(skimmed, Ok(()));
                assert_eq!(a.pos, c.pos);
                assert_eq!(a.pos, b.pos);
            }
        }
    }

    #[test]
    fn decoding_matches_serde_json() {
        let pieces: &[&str] = &[
            "a",
            "bc",
            " ",
            "é",
            "😀",
            "\\n",
            "\\\"",
            "\\\\",
            "\\/",
            "\\t",
            "\\u00e9",
            "\\u0000",
            "\\uD83D\\uDE00",
            "\\ud83d",
            "\\udc00",
            "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
        ];
        let broken: &[&str] = &["\\x", "\\u12", "\"", "\n", "\\"];
        let mut x = 0x0123_4567_89ab_cdefu64;
        let mut compared = 0;
        for _ in 0..20_000 {
            let mut json = String::from("\"");
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut y = x;
            for _ in 0..(x % 40) {
                y = y
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Mostly valid pieces, now and then one that breaks the string.
                let piece = if (y >> 20).is_multiple_of(16) {
                    broken[(y >> 33) as usize % broken.len()]
                } else {
                    pieces[(y >> 33) as usize % pieces.len()]
                };
                json.push_str(piece);
            }
            json.push('"');
            let ours = decode(&json);
            match serde_json::from_str::<String>(&json) {
                Ok(theirs) => {
                    assert_eq!(ours.as_deref(), Ok(theirs.as_bytes()), "{json}");
                    compared += 1;
                }
                // serde_json rejects lone surrogates, which decode to U+FFFD here (and may
                // report one before another error): nothing to compare.
                Err(e) if e.to_string().contains("surrogate") => {}
                Err(_)
                    if ours
                        .as_ref()
                        .is_ok_and(|b| b.windows(3).any(|w| w == REPLACEMENT)) => {}
                Err(_) => assert!(
                    ours.is_err() || json[..json.len() - 1][1..].contains('"'),
                    "{json}: {ours:?}"
                ),
            }
        }
        assert!(compared > 2000, "{compared} valid strings compared");
    }

    #[test]
    fn first_special_agrees_with_a_byte_by_byte_search() {
        let alphabet: &[u8] = b"ab\\\"\x01\x1f \x7f\xff";
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 70) as usize;
            let mut y = x;
            let bytes: Vec<u8> = (0..len)
                .map(|i| {
                    y = y.wrapping_mul(6364136223846793005).wrapping_add(1);
                    // Mostly plain, so the special byte lands anywhere, or nowhere.
                    if (y >> 60) < 14 && i + 1 != len {
                        b'k'
                    } else {
                        alphabet[(y >> 33) as usize % alphabet.len()]
                    }
                })
                .collect();
            let want = bytes
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20);
            assert_eq!(first_special(&bytes), want, "{bytes:?}");
        }
    }

    #[test]
    fn object_keys_read_as_decoded_strings() {
        let alphabet: &[u8] = b"ab\\\"n\x01 u0";
        let mut x = 0x7f4a_7c15_9e37_79b9u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut json = vec![b' ', b'"'];
            let mut y = x;
            for _ in 0..x % 40 {
                y = y.wrapping_mul(6364136223846793005).wrapping_add(1);
                json.push(alphabet[(y >> 33) as usize % alphabet.len()]);
            }
            json.extend_from_slice(&b"\" : 1"[..(x >> 40) as usize % 6]);
            let mut decoded = Vec::new();
            let mut c = Cursor::new(&json, 0);
            let expect = c
                .string(&mut |p: &[u8]| decoded.extend_from_slice(p))
                .and_then(|_| c.expect(b':'))
                .map(|_| (decoded.len(), c.pos));
            let mut key = [0u8; KEY_CAPACITY];
            let mut k = Cursor::new(&json, 0);
            let got = k.object_key(&mut key).map(|len| (len, k.pos));
            assert_eq!(got, expect, "{:?}", String::from_utf8_lossy(&json));
            if let Ok((len, _)) = got {
                let n = len.min(KEY_CAPACITY);
                assert_eq!(key[..n], decoded[..n]);
            }
        }
    }

    #[test]
    fn long_strings_decode_across_chunks() {
        for pad in 0..130 {
            let prefix = "a".repeat(pad);
            let json = format!(r#""{prefix}\ud83d\ude00\\\"\u00e9\n{prefix}""#);
            assert_eq!(
                decode(&json).unwrap(),
                format!("{prefix}😀\\\"é\n{prefix}").as_bytes(),
                "pad {pad}"
            );
        }
    }

    #[test]
    fn escapes_decode() {
        assert_eq!(decode(r#""a\nb\"c\\d\/e\tf""#).unwrap(), b"a\nb\"c\\d/e\tf");
        assert_eq!(decode(r#""\u00e9""#).unwrap(), "é".as_bytes());
        assert_eq!(decode(r#""\ud83d\ude00""#).unwrap(), "😀".as_bytes());
        assert_eq!(decode(r#""\uD83D\uDE00""#).unwrap(), "😀".as_bytes());
        assert_eq!(decode(r#""\ud83dx""#).unwrap(), "\u{FFFD}x".as_bytes());
        assert_eq!(decode(r#""\ude00""#).unwrap(), "\u{FFFD}".as_bytes());
        assert_eq!(decode(r#""\ud83d""#).unwrap(), "\u{FFFD}".as_bytes());
        assert_eq!(decode(r#""\ud83d\u0041""#).unwrap(), "\u{FFFD}A".as_bytes());
        assert_eq!(decode(r#""\u0000""#).unwrap(), b"\0");
    }

    #[test]
    fn bad_strings_are_errors() {
        assert!(matches!(decode(r#""\x""#), Err(PromptError::Syntax { .. })));
        assert!(matches!(
            decode(r#""\u12g4""#),
            Err(PromptError::Syntax { .. })
        ));
        assert!(matches!(
            decode("\"a\nb\""),
            Err(PromptError::Syntax { .. })
        ));
        assert_eq!(decode(r#""abc"#), Err(PromptError::Truncated));
        assert_eq!(decode(r#""abc\"#), Err(PromptError::Truncated));
        assert_eq!(decode(r#""\u12"#), Err(PromptError::Truncated));
    }

    #[test]
    fn canonical_values_drop_whitespace() {
        let canon = |json: &str| {
            let mut out = Vec::new();
            let mut c = Cursor::new(json.as_bytes(), 0);
            c.value(0, &mut |p: &[u8]| out.extend_from_slice(p))
                .map(|_| out)
        };
        let a = canon(r#"{"a":[1,2.5e3,true,null,{"b":"\u0063"}],"d":{}}"#).unwrap();
        let b =
            canon(" {\n \"a\" : [ 1 , 2.5e3 ,\ttrue , null , { \"b\" : \"c\" } ] , \"d\" : { } } ")
                .unwrap();
        assert_eq!(a, b);
        assert_eq!(a, br#"{"a":[1,2.5e3,true,null,{"b":"c"}],"d":{}}"#);
        for bad in [
            "[1,]",
            "{\"a\" 1}",
            "[01]",
            "[1.]",
            "[-]",
            "[tru]",
            "{]",
            "[}",
            "[1 2]",
        ] {
            assert!(canon(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn structure_classifiers_agree_with_the_bytewise_one() {
        let mut chunk = [0u8; 64];
        let mut x = 0x0bad_cafe_f00d_d00du64;
        for round in 0..2000 {
            for b in chunk.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = if round % 2 == 0 {
                    x as u8
                } else {
                    [b'"', b'\\', b'[', b']', b'{', b'}', 0x5b | 0x80, b'a'][x as usize % 8]
                };
            }
            let slow = classify_structure_bytewise(&chunk);
            let mut fast = vec![classify_structure(&chunk)];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // Safety: the CPU supports AVX2.
                fast.push(unsafe { classify_structure_avx2(&chunk) });
            }
            for m in fast {
                assert_eq!(m.quote, slow.quote);
                assert_eq!(m.backslash, slow.backslash);
                assert_eq!(m.open, slow.open);
                assert_eq!(m.close, slow.close);
            }
        }
    }

    /// Random valid JSON: nesting, strings with escapes, brackets and quotes inside strings,
    /// long plain runs, whitespace.
    fn random_json(x: &mut u64, depth: usize, out: &mut String) {
        fn step(x: &mut u64) -> u64 {
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            *x
        }
        let mut next = || step(x);
        match next() % if depth > 6 { 3 } else { 6 } {
            0 => out.push_str(["0", "-1.5e3", "true", "null", "12345"][next() as usize % 5]),
            1 | 2 => {
                out.push('"');
                for _ in 0..next() % 12 {
                    out.push_str(
                        [
                            "a", "[", "]", "{", "}", "\\\"", "\\\\", "\\n", "\\u005b", " ",
                            "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
                        ][next() as usize % 11],
                    );
                }
                out.push('"');
            }
            3 | 4 => {
                out.push('[');
                for i in 0..step(x) % 5 {
                    if i > 0 {
                        out.push_str(if step(x).is_multiple_of(2) {
                            ","
                        } else {
                            " ,\n "
                        });
                    }
                    random_json(x, depth + 1, out);
                }
                out.push(']');
            }
            _ => {
                out.push('{');
                for i in 0..step(x) % 5 {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(["\"k\"", "\"a]\"", "\"\\\"}\""][step(x) as usize % 3]);
                    out.push_str(if step(x).is_multiple_of(2) {
                        ":"
                    } else {
                        " : "
                    });
                    random_json(x, depth + 1, out);
                }
                out.push('}');
            }
        }
    }

    #[test]
    fn the_structural_skim_ends_values_where_the_scanner_does() {
        let mut x = 0x1357_9bdf_2468_ace0u64;
        let mut containers = 0;
        for _ in 0..20_000 {
            let mut json = String::new();
            random_json(&mut x, 0, &mut json);
            json.push_str(" ,\"after\"");
            let mut walked = Cursor::new(json.as_bytes(), 0);
            walked.skip(0).unwrap_or_else(|e| panic!("{json}: {e:?}"));
            let mut skimmed = Cursor::new(json.as_bytes(), 0);
            skimmed
                .skim_fast()
                .unwrap_or_else(|e| panic!("{json}: {e:?}"));
            assert_eq!(skimmed.pos, walked.pos, "{json}");
            if matches!(json.as_bytes()[0], b'[' | b'{') {
                // The portable classifier in the same loop (the dispatch may take AVX2).
                let portable = close_levels_with(json.as_bytes(), 1, 1, classify_structure);
                assert_eq!(portable, Ok(walked.pos), "{json}");
                containers += 1;
            }
            // Cut anywhere inside the value: the skim runs out of body.
            if walked.pos > 1 {
                let cut = (x as usize) % (walked.pos - 1) + 1;
                if matches!(json.as_bytes()[0], b'[' | b'{' | b'"') {
                    let mut short = Cursor::new(&json.as_bytes()[..cut], 0);
                    assert_eq!(
                        short.skim_fast(),
                        Err(PromptError::Truncated),
                        "{json} cut {cut}"
                    );
                }
            }
        }
        assert!(containers > 5000, "{containers}");
        // From inside an array, past its closing bracket.
        let body = br#"[{"a":"]}"},[1,[2]],"x\"]"] , 3]"#;
        assert_eq!(close_levels(body, 1, 1), Ok(body.len() - 5));
        assert_eq!(close_levels(body, 1, 2), Ok(body.len()));
        assert_eq!(close_levels(body, 1, 3), Err(PromptError::Truncated));
    }

    #[test]
    fn nesting_is_limited_without_recursion() {
        let deep = "[".repeat(100_000);
        let mut c = Cursor::new(deep.as_bytes(), 0);
        assert!(matches!(c.skip(0), Err(PromptError::TooDeep { .. })));
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(Cursor::new(ok.as_bytes(), 0).skip(0).is_ok());
        let too = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert!(Cursor::new(too.as_bytes(), 0).skip(0).is_err());
    }
}
