//! The deterministic tokenizer and chat template of the simulated engine.
//!
//! The simulated replica needs token ids that behave like a real tokenizer's where the balancer
//! and the KV cache can see it: the same text always gives the same ids, about 4 bytes of
//! English make one token (so prompt lengths, and therefore timings, are realistic), and a
//! longer conversation's prompt starts with the tokens of the shorter one (so prefix caching
//! works across turns). It is not a language model vocabulary: generated text is a word list.
//!
//! # Pieces
//!
//! `encode` cuts the text into pieces, scanning characters left to right. A new piece starts
//! at the first character, at every whitespace character (`char::is_whitespace`), and at any
//! character that would make the current piece longer than [`MAX_PIECE_BYTES`] (5) bytes. A
//! character is never split (a UTF-8 character has at most 4 bytes, so every piece fits). The id of a piece is
//! `xxh3_64(piece bytes) % FIRST_SPECIAL`, so text ids are always below [`FIRST_SPECIAL`] and
//! `encode` never produces a special token.
//!
//! English prose averages about 3.8 bytes per piece (a word with its leading space is one
//! piece up to 4 letters, two up to 9); real BPE vocabularies of 8B models give 4-4.5, so
//! prompt lengths come out realistic (tested below on a sample paragraph). A limit of 4 bytes
//! would give about 3.2, 6 about 4.2.
//!
//! # Extension property
//!
//! Whether a piece boundary lies before a character depends only on that character and on the
//! bytes since the previous boundary, never on what follows. Hence, for texts `B = A + C`:
//!
//! * every piece boundary of `A` except its end is a piece boundary of `B`, so all pieces of
//!   `A` but the last are pieces of `B`;
//! * `ids(A)` is a prefix of `ids(B)` exactly when the end of `A` is a piece boundary of `B`:
//!   `C` is empty, or `C` starts with a whitespace character, or the last piece of `A` plus
//!   the first character of `C` would exceed [`MAX_PIECE_BYTES`];
//! * when `C` starts with whitespace (or is empty), more strongly `ids(B) = ids(A) ++ ids(C)`.
//!
//! Special tokens are never produced by `encode`; the chat template inserts them between
//! separately encoded segments, so a segment always ends at a piece boundary.
//!
//! # Chat template
//!
//! ChatML as Qwen uses it, with the special ids `<|im_start|>` = [`IM_START`] and
//! `<|im_end|>` = [`IM_END`]. Each message renders as
//! `<|im_start|>{role}\n{content}<|im_end|>\n`, where `{role}\n` and `{content}` are encoded
//! as separate segments (a real BPE tokenizer also keeps the header apart from the content).
//! An assistant message's `tool_calls` JSON is appended to its content as
//! `\n<tool_call>\n{json}\n</tool_call>`; a tool message's content is wrapped in
//! `<tool_response>\n...\n</tool_response>`. Tools, when given, come first as a system block
//! holding the tools JSON. `add_generation_prompt` appends `<|im_start|>assistant\n`.
//!
//! Because every message is rendered on its own and the generation prompt is exactly the
//! start of a rendered assistant message, the prompt of the next turn (earlier messages + the
//! assistant reply + a new user message) starts with every token of the previous turn's
//! prompt, generation prompt included.

#![forbid(unsafe_code)]

use xxhash_rust::xxh3::xxh3_64;

/// Size of the simulated vocabulary; ids below `FIRST_SPECIAL` are text tokens.
pub const VOCAB_SIZE: u32 = 151_936;
pub const FIRST_SPECIAL: u32 = 151_643;

/// `<|endoftext|>` (Qwen's id).
pub const END_OF_TEXT: u32 = FIRST_SPECIAL;
/// `<|im_start|>` (Qwen's id).
pub const IM_START: u32 = FIRST_SPECIAL + 1;
/// `<|im_end|>` (Qwen's id).
pub const IM_END: u32 = FIRST_SPECIAL + 2;

/// Longest piece in bytes (see the module header).
pub const MAX_PIECE_BYTES: usize = 5;

/// One chat message as the template sees it (content already flattened to text).
#[derive(Debug, Clone, Default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Tool calls of an assistant message, as their JSON text.
    pub tool_calls: Option<String>,
    pub tool_call_id: Option<String>,
}

/// Calls `piece` with the byte range of every piece of `text`, in order.
fn for_each_piece(text: &str, mut piece: impl FnMut(usize, usize)) {
    let mut start = 0;
    for (at, ch) in text.char_indices() {
        if at > start && (ch.is_whitespace() || at - start + ch.len_utf8() > MAX_PIECE_BYTES) {
            piece(start, at);
            start = at;
        }
    }
    if start < text.len() {
        piece(start, text.len());
    }
}

/// The id of one piece.
fn piece_id(piece: &[u8]) -> u32 {
    (xxh3_64(piece) % FIRST_SPECIAL as u64) as u32
}

/// Append the token ids of `text`.
pub fn encode(text: &str, out: &mut Vec<u32>) {
    let bytes = text.as_bytes();
    out.reserve(text.len() / 3 + 1);
    for_each_piece(text, |start, end| out.push(piece_id(&bytes[start..end])));
}

/// Number of tokens `encode(text)` would append.
pub fn count_tokens(text: &str) -> usize {
    let mut n = 0;
    for_each_piece(text, |_, _| n += 1);
    n
}

/// Words generated tokens decode to (each with its leading space).
const WORDS: [&str; 64] = [
    " the", " of", " and", " to", " a", " in", " is", " that", " for", " it", " as", " was",
    " with", " be", " by", " on", " not", " he", " this", " are", " or", " his", " from", " at",
    " which", " but", " have", " an", " had", " they", " you", " were", " their", " one", " all",
    " we", " can", " her", " has", " there", " been", " if", " more", " when", " will", " would",
    " who", " so", " no", " model", " cache", " token", " prefix", " block", " request",
    " replica", " time", " first", " data", " system", " value", " result", ".", ",",
];

/// The text of one token id (for generated output).
pub fn decode_token(id: u32, out: &mut String) {
    match id {
        END_OF_TEXT => out.push_str("<|endoftext|>"),
        IM_START => out.push_str("<|im_start|>"),
        IM_END => out.push_str("<|im_end|>"),
        id if id >= FIRST_SPECIAL => out.push_str("<|special|>"),
        id => out.push_str(WORDS[(id as usize) % WORDS.len()]),
    }
}

/// Render `messages` (and `tools`, the request's tools array as JSON text) with the fixed chat
/// template and append the token ids; `add_generation_prompt` appends the assistant header.
pub fn apply_chat_template(
    messages: &[ChatMessage],
    tools: Option<&str>,
    add_generation_prompt: bool,
    out: &mut Vec<u32>,
) {
    if let Some(tools) = tools {
        out.push(IM_START);
        encode_header("system", out);
        encode(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
            out,
        );
        encode(tools, out);
        encode(
            "\n</tools>\n\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags.",
            out,
        );
        out.push(IM_END);
        encode("\n", out);
    }
    for message in messages {
        out.push(IM_START);
        encode_header(&message.role, out);
        if message.role == "tool" {
            encode("<tool_response>\n", out);
            encode(&message.content, out);
            encode("\n</tool_response>", out);
        } else {
            encode(&message.content, out);
        }
        if let Some(calls) = &message.tool_calls {
            encode("\n<tool_call>\n", out);
            encode(calls, out);
            encode("\n</tool_call>", out);
        }
        out.push(IM_END);
        encode("\n", out);
    }
    if add_generation_prompt {
        out.push(IM_START);
        encode_header("assistant", out);
    }
}

/// `{role}\n`, as one segment.
fn encode_header(role: &str, out: &mut Vec<u32>) {
    encode(role, out);
    encode("\n", out);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small seeded generator (splitmix64), so the property tests need no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    const ALPHABET: [char; 14] = [
        'a', 'b', 'z', 'Q', '7', '.', ' ', '\n', '\t', 'é', 'ß', '中', '😀', '\u{3000}',
    ];

    fn random_text(rng: &mut Rng, max_chars: usize) -> String {
        let n = rng.below(max_chars + 1);
        (0..n)
            .map(|_| ALPHABET[rng.below(ALPHABET.len())])
            .collect()
    }

    fn ids(text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        encode(text, &mut out);
        out
    }

    fn boundaries(text: &str) -> Vec<usize> {
        let mut b = vec![0];
        for_each_piece(text, |_, end| b.push(end));
        b
    }

    #[test]
    fn same_text_same_ids_and_all_below_first_special() {
        let text = "Hello, world! Ünïcödé 中文 😀 and\ttabs\nnewlines";
        assert_eq!(ids(text), ids(text));
        assert!(ids(text).iter().all(|&id| id < FIRST_SPECIAL));
        assert_eq!(ids(text).len(), count_tokens(text));
        assert!(ids("").is_empty());
    }

    #[test]
    fn pieces_never_split_characters_and_start_at_whitespace() {
        let mut rng = Rng(1);
        for _ in 0..2000 {
            let text = random_text(&mut rng, 40);
            let mut prev_end = 0;
            for_each_piece(&text, |start, end| {
                assert_eq!(start, prev_end);
                prev_end = end;
                let piece = &text[start..end]; // panics if a char were split
                assert!(piece.len() <= MAX_PIECE_BYTES);
                assert!(piece.chars().skip(1).all(|c| !c.is_whitespace()));
            });
            assert_eq!(prev_end, text.len());
        }
    }

    #[test]
    fn extension_property_holds_for_random_splits() {
        let mut rng = Rng(0x5eed);
        let mut prefix_cases = 0;
        for _ in 0..5000 {
            let b = random_text(&mut rng, 30);
            let char_ends: Vec<usize> = b
                .char_indices()
                .map(|(i, _)| i)
                .chain(std::iter::once(b.len()))
                .collect();
            let cut = char_ends[rng.below(char_ends.len())];
            let (a, c) = b.split_at(cut);
            let (ids_a, ids_b) = (ids(a), ids(&b));
            let at_boundary = boundaries(&b).contains(&cut);
            // Every boundary of A but its end is a boundary of B.
            let bb = boundaries(&b);
            let inner = boundaries(a).into_iter().filter(|&x| x < a.len());
            assert!(inner.into_iter().all(|x| bb.contains(&x)), "{b:?} at {cut}");
            // ids(A) is a prefix of ids(B) exactly when A ends at a piece boundary of B.
            assert_eq!(ids_b.starts_with(&ids_a), at_boundary, "{b:?} at {cut}");
            if at_boundary {
                prefix_cases += 1;
            }
            if c.is_empty() || c.starts_with(char::is_whitespace) {
                assert!(at_boundary);
                let mut joined = ids_a.clone();
                joined.extend(ids(c));
                assert_eq!(ids_b, joined, "{b:?} at {cut}");
            }
        }
        assert!(prefix_cases > 1000);
    }

    #[test]
    fn english_averages_about_four_bytes_per_token() {
        let text = "The balancer routes each request to the replica that minimises the \
            estimated time to first token, counting the time a request waits in the queue and \
            the time needed to prefill the part of its prompt that is not already cached. A \
            replica that already holds a long shared prefix in its key value cache can answer \
            much sooner than an idle replica that must compute everything from scratch, so \
            chasing cache hits usually pays, until one replica becomes a hot spot.";
        let per_token = text.len() as f64 / count_tokens(text) as f64;
        assert!(
            (3.5..=4.5).contains(&per_token),
            "{per_token} bytes per token"
        );
    }

    #[test]
    fn decode_gives_text_for_every_id() {
        let mut s = String::new();
        for id in [
            0,
            1,
            12345,
            FIRST_SPECIAL - 1,
            IM_START,
            IM_END,
            END_OF_TEXT,
            VOCAB_SIZE - 1,
        ] {
            s.clear();
            decode_token(id, &mut s);
            assert!(!s.is_empty());
        }
        s.clear();
        decode_token(IM_START, &mut s);
        assert_eq!(s, "<|im_start|>");
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    fn render(messages: &[ChatMessage], tools: Option<&str>, gen: bool) -> Vec<u32> {
        let mut out = Vec::new();
        apply_chat_template(messages, tools, gen, &mut out);
        out
    }

    #[test]
    fn template_shape() {
        let out = render(&[msg("user", "hi")], None, true);
        let mut expected = vec![IM_START];
        encode("user", &mut expected);
        encode("\n", &mut expected);
        encode("hi", &mut expected);
        expected.push(IM_END);
        encode("\n", &mut expected);
        expected.push(IM_START);
        encode("assistant", &mut expected);
        encode("\n", &mut expected);
        assert_eq!(out, expected);
        assert_eq!(out.iter().filter(|&&t| t >= FIRST_SPECIAL).count(), 3);
        // Tools come first, as a system block.
        let with_tools = render(&[msg("user", "hi")], Some(r#"[{"type":"function"}]"#), true);
        assert_eq!(with_tools[0], IM_START);
        assert!(with_tools.ends_with(&out));
        assert!(with_tools.len() > out.len() + 10);
    }

    #[test]
    fn next_turn_starts_with_previous_prompt() {
        let mut rng = Rng(42);
        let tools = r#"[{"type":"function","function":{"name":"get_weather","parameters":{}}}]"#;
        for round in 0..300 {
            let tools = if round % 3 == 0 { Some(tools) } else { None };
            let mut conversation = vec![];
            if round % 2 == 0 {
                conversation.push(msg("system", &random_text(&mut rng, 20)));
            }
            conversation.push(msg("user", &random_text(&mut rng, 30)));
            for _turn in 0..4 {
                let prompt = render(&conversation, tools, true);
                let mut reply = msg("assistant", &random_text(&mut rng, 30));
                if rng.below(3) == 0 {
                    reply.tool_calls = Some(r#"[{"name":"get_weather","arguments":"{}"}]"#.into());
                    conversation.push(reply);
                    let mut result = msg("tool", &random_text(&mut rng, 10));
                    result.tool_call_id = Some("call_1".into());
                    conversation.push(result);
                } else {
                    conversation.push(reply);
                }
                conversation.push(msg("user", &random_text(&mut rng, 30)));
                let next = render(&conversation, tools, true);
                assert!(next.starts_with(&prompt), "round {round}");
                assert!(next.len() > prompt.len());
            }
        }
    }
}
