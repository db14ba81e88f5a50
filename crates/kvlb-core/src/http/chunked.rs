//! An incremental decoder of the chunked transfer coding (RFC 9112 section 7.1), strict enough
//! to stop request smuggling: hex sizes only, at most 16 digits, CRLF (or bare LF) line ends,
//! extensions skipped but bounded, trailers read and dropped.
//!
//! It is fed whatever bytes have arrived and reports the data spans inside them, so a caller
//! can decode in place (request bodies) or just find where a message ends (responses relayed
//! verbatim).

#![forbid(unsafe_code)]

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkError {
    /// A chunk size that is not hex, too long, or missing.
    InvalidSize,
    /// Bytes where CRLF was required, or an oversized extension / trailer line.
    InvalidFraming,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading hex digits of a chunk size.
    Size,
    /// After the size: optional whitespace and extensions until CRLF.
    Ext,
    /// Saw CR ending the size line.
    SizeLf,
    /// Inside chunk data.
    Data,
    /// Expecting CR or LF after data.
    DataEnd,
    /// Expecting LF after CR after data.
    DataLf,
    /// At the start of a trailer line (or the final empty line).
    TrailerStart,
    /// Inside a trailer field line.
    Trailer,
    /// Saw CR of the final empty line.
    FinalLf,
    Done,
}

/// Longest chunk extension or trailer line accepted.
const MAX_LINE: u32 = 4096;

#[derive(Debug, Clone)]
pub struct ChunkedDecoder {
    state: State,
    size: u64,
    digits: u32,
    line: u32,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkedDecoder {
    pub fn new() -> ChunkedDecoder {
        ChunkedDecoder {
            state: State::Size,
            size: 0,
            digits: 0,
            line: 0,
        }
    }

    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Consume `input`; `on_data(start, end)` is called for each data span (offsets in
    /// `input`). Returns how many bytes were consumed: all of `input`, or fewer when the
    /// message ended inside it.
    pub fn feed(
        &mut self,
        input: &[u8],
        mut on_data: impl FnMut(usize, usize),
    ) -> Result<usize, ChunkError> {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            match self.state {
                State::Size => match hex_value(b) {
                    Some(v) => {
                        if self.digits == 16 {
                            return Err(ChunkError::InvalidSize);
                        }
                        self.size = (self.size << 4) | v as u64;
                        self.digits += 1;
                        i += 1;
                    }
                    None => {
                        if self.digits == 0 {
                            return Err(ChunkError::InvalidSize);
                        }
                        match b {
                            b';' | b' ' | b'\t' | b'\r' | b'\n' => {
                                self.state = State::Ext;
                                self.line = 0;
                            }
                            _ => return Err(ChunkError::InvalidSize),
                        }
                    }
                },
                State::Ext => {
                    match b {
                        b'\r' => self.state = State::SizeLf,
                        b'\n' => self.end_size_line(),
                        _ => {
                            self.line += 1;
                            if self.line > MAX_LINE || (b < 0x20 && b != b'\t') || b == 0x7f {
                                return Err(ChunkError::InvalidFraming);
                            }
                        }
                    }
                    i += 1;
                }
                State::SizeLf => {
                    if b != b'\n' {
                        return Err(ChunkError::InvalidFraming);
                    }
                    self.end_size_line();
                    i += 1;
                }
                State::Data => {
                    let avail = (input.len() - i) as u64;
                    let take = avail.min(self.size) as usize;
                    on_data(i, i + take);
                    i += take;
                    self.size -= take as u64;
                    if self.size == 0 {
                        self.state = State::DataEnd;
                    }
                }
                State::DataEnd => {
                    match b {
                        b'\r' => self.state = State::DataLf,
                        b'\n' => self.next_chunk(),
                        _ => return Err(ChunkError::InvalidFraming),
                    }
                    i += 1;
                }
                State::DataLf => {
                    if b != b'\n' {
                        return Err(ChunkError::InvalidFraming);
                    }
                    self.next_chunk();
                    i += 1;
                }
                State::TrailerStart => {
                    match b {
                        b'\r' => self.state = State::FinalLf,
                        b'\n' => {
                            self.state = State::Done;
                            return Ok(i + 1);
                        }
                        b' ' | b'\t' => return Err(ChunkError::InvalidFraming),
                        _ => {
                            self.state = State::Trailer;
                            self.line = 1;
                        }
                    }
                    i += 1;
                }
                State::Trailer => {
                    if b == b'\n' {
                        self.state = State::TrailerStart;
                    } else {
                        self.line += 1;
                        if self.line > MAX_LINE {
                            return Err(ChunkError::InvalidFraming);
                        }
                    }
                    i += 1;
                }
                State::FinalLf => {
                    if b != b'\n' {
                        return Err(ChunkError::InvalidFraming);
                    }
                    self.state = State::Done;
                    return Ok(i + 1);
                }
                State::Done => return Ok(i),
            }
        }
        Ok(i)
    }

    fn end_size_line(&mut self) {
        self.state = if self.size == 0 {
            State::TrailerStart
        } else {
            State::Data
        };
    }

    fn next_chunk(&mut self) {
        self.state = State::Size;
        self.size = 0;
        self.digits = 0;
    }
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(input: &[u8]) -> Result<(Vec<u8>, usize), ChunkError> {
        let mut d = ChunkedDecoder::new();
        let mut out = Vec::new();
        let n = d.feed(input, |s, e| out.extend_from_slice(&input[s..e]))?;
        assert!(d.is_done(), "not done");
        Ok((out, n))
    }

    #[test]
    fn decodes_simple_body() {
        let (out, n) = decode_all(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\nNEXT").unwrap();
        assert_eq!(out, b"hello world");
        assert_eq!(n, b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n".len());
    }

    #[test]
    fn extensions_and_trailers_are_skipped() {
        let (out, _) =
            decode_all(b"5;name=value\r\nhello\r\n0\r\nX-Trailer: 1\r\nY: 2\r\n\r\n").unwrap();
        assert_eq!(out, b"hello");
    }

    #[test]
    fn byte_by_byte_equals_whole() {
        let input = b"a\r\n0123456789\r\n3;x\r\nabc\r\n0\r\nT: v\r\n\r\n";
        let mut d = ChunkedDecoder::new();
        let mut out = Vec::new();
        for (i, b) in input.iter().enumerate() {
            let one = [*b];
            let n = d
                .feed(&one, |s, e| out.extend_from_slice(&one[s..e]))
                .unwrap();
            assert_eq!(n, 1, "byte {i}");
        }
        assert!(d.is_done());
        assert_eq!(out, b"0123456789abc");
    }

    #[test]
    fn rejects_bad_sizes() {
        for bad in [
            &b"zz\r\n"[..],
            b"-5\r\nhello\r\n",
            b"ffffffffffffffffff\r\n",
            b"\r\n",
            b"+5\r\nhello\r\n",
            b"0x5\r\nhello\r\n",
        ] {
            let mut d = ChunkedDecoder::new();
            assert!(
                d.feed(bad, |_, _| {}).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn rejects_missing_crlf_after_data() {
        let mut d = ChunkedDecoder::new();
        assert_eq!(
            d.feed(b"5\r\nhelloX\r\n", |_, _| {}),
            Err(ChunkError::InvalidFraming)
        );
    }

    #[test]
    fn rejects_folded_trailer() {
        let mut d = ChunkedDecoder::new();
        assert!(d.feed(b"0\r\nA: b\r\n c\r\n\r\n", |_, _| {}).is_err());
    }
}
