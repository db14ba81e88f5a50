//! Token mode for text prompts: a Hugging Face tokenizer (`tokenizer.json`, the `tokenizers`
//! crate) and the model's chat template (`tokenizer_config.json`, rendered with minijinja) turn
//! a chat or text completions request into the token ids the engine will prefill, so kvlb's
//! block hashes of the request equal the hashes it computes from the replicas' KV events
//! (`BlockStored` token ids, [`prefix::token_block_hashes`]).
//!
//! # What the engine does, and what this module does
//! vLLM and SGLang render `messages` with the chat template (`add_generation_prompt`, `tools`,
//! `bos_token`, `eos_token`, `chat_template_kwargs`) and encode the result without adding
//! special tokens; a text completion's `prompt` is encoded with them (a BOS for Llama-style
//! tokenizers). [`ChatTokenizer::chat_tokens_whole`] and [`ChatTokenizer::completion_tokens_whole`]
//! do exactly that; the simulated replica uses them when given `--tokenizer`.
//!
//! # The warm path: segments between added tokens
//! A Hugging Face tokenizer first splits its input on its added tokens (`<|im_start|>`,
//! `<|eot_id|>`, ...; leftmost-longest), then normalizes, pre-tokenizes and encodes each piece
//! between them on its own. So the ids of a rendered prompt are the concatenation of the ids of
//! its segments and of the added tokens between them. [`ChatTokenizer::request_tokens`] splits
//! the rendered prompt the same way (an Aho-Corasick automaton over the same tokens) and looks
//! each segment up in a per-worker [`SegmentCache`] (xxh3 of the segment -> its ids, a bounded
//! LRU): a system prompt, a tool schema or an earlier turn is tokenized once, and a warm request
//! only tokenizes its new turn. Only tokens without `lstrip`/`rstrip`/`single_word` mark a
//! segment boundary (the others stay inside their segment, where the tokenizer handles them as
//! it would in the whole string).
//!
//! Segment-wise encoding is not safe for every tokenizer: a `Metaspace` pre-tokenizer with
//! `prepend_scheme: "first"` (Llama 2-style SentencePiece conversions, Mistral v1) prepends `▁`
//! only at offset 0 of the whole string, which a segment cannot know. Such tokenizers, and any
//! whose probe at load time (a rendered sample conversation, segment-wise vs whole) disagrees,
//! are encoded whole on every request ([`ChatTokenizer::segment_wise`] says which).
//!
//! # Allocation
//! Honest account: rendering the template allocates (minijinja builds the output string and its
//! values from the parsed body), and so does parsing the body. The segment lookups, the
//! concatenation of cached ids into the worker's id buffer and the block hashing allocate
//! nothing once warm; a cache miss allocates inside the `tokenizers` crate (its `Encoding`).
//! `benches/tokenize.rs` measures cold and warm requests.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

pub mod agent;
mod conversation;
pub mod fixture;
#[cfg(test)]
mod tests;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use kvlb_core::lru::LruList;
use kvlb_core::prefix;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Requests hashed in token mode since start.
pub static TOKENIZED_REQUESTS: AtomicU64 = AtomicU64::new(0);
/// Requests that could not be tokenized (bad body for the template, template error, tokenizer
/// error) and were hashed in text mode instead.
pub static TOKENIZE_ERRORS: AtomicU64 = AtomicU64::new(0);
/// Segments found in a worker's cache.
pub static SEGMENT_HITS: AtomicU64 = AtomicU64::new(0);
/// Segments the tokenizer had to encode.
pub static SEGMENT_MISSES: AtomicU64 = AtomicU64::new(0);

/// Why a request could not be tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// The body is not JSON of the expected shape.
    Body(String),
    /// The chat template failed (including its own `raise_exception`).
    Template(String),
    /// The tokenizer failed.
    Tokenizer(String),
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizeError::Body(m) => write!(f, "request body: {m}"),
            TokenizeError::Template(m) => write!(f, "chat template: {m}"),
            TokenizeError::Tokenizer(m) => write!(f, "tokenizer: {m}"),
        }
    }
}

/// A loaded tokenizer as the configuration holds it: equal only to itself (a reload loads
/// the files again).
#[derive(Clone)]
pub struct SharedTokenizer(pub std::sync::Arc<ChatTokenizer>);

impl PartialEq for SharedTokenizer {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for SharedTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A loaded tokenizer and chat template; shared read-only by every worker.
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: Environment<'static>,
    has_template: bool,
    /// The template's source (transformers checks it names `content` for
    /// `continue_final_message`).
    template_source: String,
    /// The template names the developer role (else vLLM renders developer messages as system
    /// messages).
    names_developer: bool,
    bos_token: String,
    eos_token: String,
    /// The other named special tokens the config sets (`unk_token`, `sep_token`, `pad_token`,
    /// `cls_token`, `mask_token`), which transformers hands the template too.
    special_tokens: Vec<(String, String)>,
    /// Every added token that is matched on raw text, as the tokenizer splits on them.
    added: Option<AhoCorasick>,
    /// Per pattern of `added`: `Some(id)` where the token is a segment boundary.
    added_ids: Vec<Option<u32>>,
    /// Segment-wise encoding equals whole-string encoding for this tokenizer and template.
    segment_wise: bool,
    /// Ids `encode(text, add_special_tokens = true)` puts before and after the text's own
    /// (None: the post-processor does something else; completions are then encoded whole).
    completion_frame: Option<(Vec<u32>, Vec<u32>)>,
    /// The template wants the system prompt first: the Messages API's inline system messages
    /// are merged into it, as vLLM does (`agent::template_needs_system_first`).
    merge_inline_system: bool,
    /// Where it was loaded from, for messages.
    pub source: String,
    /// Distinct for every load (a worker's cache belongs to one).
    load_id: u64,
}

/// Numbers the loads of tokenizers (0 is "none").
static LOADS: AtomicU64 = AtomicU64::new(1);

impl fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("source", &self.source)
            .field("segment_wise", &self.segment_wise)
            .finish()
    }
}

/// A text of `tokenizer_config.json` or a special token given as `{"content": ...}`.
fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(m)) => m
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or("")
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTokenizer {
    /// Loads `tokenizer` (a `tokenizer.json`) and the chat template from `chat_template`: a
    /// `tokenizer_config.json` (its `chat_template`, `bos_token`, `eos_token`) or a `.jinja`
    /// file. Without `chat_template`, `tokenizer_config.json` and then `chat_template.jinja`
    /// beside the tokenizer are tried. The error says which file and why.
    pub fn load(tokenizer: &Path, chat_template: Option<&Path>) -> Result<ChatTokenizer, String> {
        let json = std::fs::read(tokenizer)
            .map_err(|e| format!("{}: cannot read: {e}", tokenizer.display()))?;
        let dir = tokenizer.parent().unwrap_or(Path::new("."));
        let beside = |name: &str| -> Option<PathBuf> {
            let p = dir.join(name);
            p.is_file().then_some(p)
        };
        let template_path = match chat_template {
            Some(p) => Some(p.to_path_buf()),
            None => beside("tokenizer_config.json").or_else(|| beside("chat_template.jinja")),
        };
        let mut config_text = None;
        let mut jinja = None;
        if let Some(p) = &template_path {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("{}: cannot read: {e}", p.display()))?;
            if p.extension().is_some_and(|e| e == "jinja") {
                jinja = Some(text);
                // bos/eos still come from the config beside it, when there is one.
                let cfg = p.parent().map(|d| d.join("tokenizer_config.json"));
                config_text = cfg.and_then(|c| std::fs::read_to_string(c).ok());
            } else {
                config_text = Some(text);
                if chat_template.is_none() {
                    jinja =
                        beside("chat_template.jinja").and_then(|j| std::fs::read_to_string(j).ok());
                }
            }
        }
        let source = match &template_path {
            Some(t) => format!("{} + {}", tokenizer.display(), t.display()),
            None => tokenizer.display().to_string(),
        };
        let mut t = ChatTokenizer::from_parts(&json, config_text.as_deref(), jinja.as_deref())
            .map_err(|e| match &template_path {
                Some(p) if e.starts_with("chat template") || e.starts_with("tokenizer_config") => {
                    format!("{}: {e}", p.display())
                }
                _ => format!("{}: {e}", tokenizer.display()),
            })?;
        t.source = source;
        Ok(t)
    }

    /// As [`ChatTokenizer::load`] from the files' contents: `tokenizer_json` (tokenizer.json),
    /// `config_json` (tokenizer_config.json, optional), `jinja` (a template that overrides the
    /// config's `chat_template`, optional).
    pub fn from_parts(
        tokenizer_json: &[u8],
        config_json: Option<&str>,
        jinja: Option<&str>,
    ) -> Result<ChatTokenizer, String> {
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| format!("not a Hugging Face tokenizer.json: {e}"))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| format!("cannot turn truncation off: {e}"))?;
        tokenizer.with_padding(None);
        let config: serde_json::Map<String, serde_json::Value> = match config_json {
            Some(text) => match serde_json::from_str(text) {
                Ok(serde_json::Value::Object(m)) => m,
                Ok(_) => return Err("tokenizer_config.json: expected a JSON object".into()),
                Err(e) => return Err(format!("tokenizer_config.json: not JSON: {e}")),
            },
            None => serde_json::Map::new(),
        };
        let template = match jinja {
            Some(j) => Some(j.to_string()),
            None => match config.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: the one called "default".
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string),
                Some(_) => {
                    return Err(
                        "tokenizer_config.json: chat_template: expected a string or a list of {name, template}"
                            .into(),
                    )
                }
            },
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let has_template = template.is_some();
        let template_source = template.clone().unwrap_or_default();
        // vLLM's _detect_developer_role_support.
        let names_developer =
            template_source.contains("\"developer\"") || template_source.contains("'developer'");
        if let Some(t) = template {
            env.add_template_owned("chat", t)
                .map_err(|e| format!("chat template: does not compile: {e:#}"))?;
        }
        // The added tokens matched on raw text, as `AddedVocabulary` splits on them.
        let mut patterns = Vec::new();
        let mut added_ids = Vec::new();
        let mut decoder: Vec<(u32, tokenizers::AddedToken)> =
            tokenizer.get_added_tokens_decoder().into_iter().collect();
        decoder.sort_by_key(|(id, _)| *id);
        for (id, tok) in decoder {
            if tok.normalized || tok.content.is_empty() {
                continue;
            }
            let boundary = !(tok.lstrip || tok.rstrip || tok.single_word);
            patterns.push(tok.content.clone());
            added_ids.push(boundary.then_some(id));
        }
        let added = if patterns.is_empty() {
            None
        } else {
            Some(
                AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&patterns)
                    .map_err(|e| format!("added tokens: {e}"))?,
            )
        };
        let mut t = ChatTokenizer {
            tokenizer,
            env,
            has_template,
            template_source,
            names_developer,
            bos_token: token_text(config.get("bos_token")),
            eos_token: token_text(config.get("eos_token")),
            special_tokens: [
                "unk_token",
                "sep_token",
                "pad_token",
                "cls_token",
                "mask_token",
            ]
            .into_iter()
            .filter(|k| config.get(*k).is_some_and(|v| !v.is_null()))
            .map(|k| (k.to_string(), token_text(config.get(k))))
            .collect(),
            added,
            added_ids,
            segment_wise: false,
            completion_frame: None,
            merge_inline_system: true,
            source: String::new(),
            load_id: LOADS.fetch_add(1, Relaxed),
        };
        t.segment_wise = !prepends_only_first(tokenizer_json) && t.probe_segments();
        t.completion_frame = t.probe_completion_frame();
        t.merge_inline_system = agent::template_needs_system_first(|chat| t.render_chat_json(chat));
        Ok(t)
    }

    /// True when requests are encoded segment by segment through the cache.
    pub fn segment_wise(&self) -> bool {
        self.segment_wise
    }

    /// True when a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.has_template
    }

    /// Renders a chat completions body with the template, as vLLM 0.33 does: the messages
    /// rebuilt by vLLM's chat parser (see [`conversation`]: tool call arguments as objects,
    /// reasoning as `reasoning` and `reasoning_content`, content as text), the template
    /// variables vLLM and transformers pass, and for `continue_final_message` the prompt cut
    /// right after the final message's text.
    pub fn render_chat(&self, body: &[u8]) -> Result<String, TokenizeError> {
        if !self.has_template {
            return Err(TokenizeError::Template(
                "none configured (chat_template = PATH to tokenizer_config.json)".into(),
            ));
        }
        let request: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| TokenizeError::Body(format!("not JSON: {e}")))?;
        let request = request
            .as_object()
            .ok_or_else(|| TokenizeError::Body("expected a JSON object".into()))?;
        let messages = match request.get("messages") {
            Some(serde_json::Value::Array(m)) => m,
            _ => return Err(TokenizeError::Body("messages: expected a list".into())),
        };
        let mut messages = conversation::parse_messages(messages)?;
        if !self.names_developer {
            messages = conversation::developer_to_system(messages);
        }
        let (kwargs, continue_final) = conversation::template_variables(request)?;
        let final_text = if continue_final {
            Some(conversation::mark_final(
                &mut messages,
                &self.template_source,
            )?)
        } else {
            None
        };
        // transformers: the special tokens, then the keyword arguments over them; `messages`,
        // `tools` and `documents` always defined.
        let mut ctx: Vec<(String, Value)> = vec![
            ("bos_token".into(), Value::from(self.bos_token.clone())),
            ("eos_token".into(), Value::from(self.eos_token.clone())),
        ];
        for (name, token) in &self.special_tokens {
            ctx.push((name.clone(), Value::from(token.clone())));
        }
        ctx.push(("tools".into(), Value::from(())));
        ctx.push(("documents".into(), Value::from(())));
        for (k, v) in kwargs {
            ctx.push((k, Value::from_serialize(&v)));
        }
        ctx.push(("messages".into(), Value::from_serialize(&messages)));
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(format!("{e:#}")))?;
        let rendered = template
            .render(Value::from_iter(ctx))
            .map_err(|e| TokenizeError::Template(format!("{e:#}")))?;
        match final_text {
            Some(text) => conversation::cut_after_final(rendered, &text),
            None => Ok(rendered),
        }
    }

    /// [`ChatTokenizer::render_chat`] of a chat body already parsed.
    pub fn render_chat_json(&self, chat: &serde_json::Value) -> Result<String, TokenizeError> {
        let body = serde_json::to_vec(chat).map_err(|e| TokenizeError::Body(e.to_string()))?;
        self.render_chat(&body)
    }

    /// Whether the Messages API's inline system messages are merged into the leading one
    /// for this template (vLLM's probe).
    pub fn merges_inline_system(&self) -> bool {
        self.merge_inline_system
    }

    /// The engine's ids for a chat body: the rendered prompt encoded whole, no special tokens
    /// added (the template has them).
    pub fn chat_tokens_whole(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(body)?;
        self.encode(&text, false)
    }

    /// The engine's ids for a text completion's `prompt`: encoded with special tokens.
    pub fn completion_tokens_whole(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode(prompt, true)
    }

    /// `tokenizer.encode(text, add_special_tokens)`, ids only.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Tokenizer(e.to_string()))
    }

    /// The request's prompt ids into `out` (cleared first), through `cache`. `Ok(false)`: this
    /// is not a request token mode handles (another path, or a completions `prompt` already
    /// given as token ids, which [`prefix::hash_request`] hashes as it is).
    pub fn request_tokens(
        &self,
        path: &[u8],
        body: &[u8],
        cache: &mut SegmentCache,
        out: &mut Vec<u32>,
    ) -> Result<bool, TokenizeError> {
        out.clear();
        let path = path.split(|&b| b == b'?').next().unwrap_or(path);
        match path {
            b"/v1/chat/completions" => {
                let text = self.render_chat(body)?;
                self.encode_cached(&text, cache, out)?;
                Ok(true)
            }
            // Converted to the chat vLLM renders for them. A Responses request continuing with
            // `previous_response_id` renders without its stored history: its first blocks
            // (tools, instructions) are still the engine's; routing follows the id anyway.
            b"/v1/responses" | b"/v1/messages" => {
                let request: serde_json::Value = serde_json::from_slice(body)
                    .map_err(|e| TokenizeError::Body(format!("not JSON: {e}")))?;
                let chat = if path == b"/v1/responses" {
                    agent::responses_to_chat(&request, None)?
                } else {
                    agent::messages_to_chat(&request, self.merge_inline_system)?
                };
                let text = self.render_chat_json(&chat)?;
                self.encode_cached(&text, cache, out)?;
                Ok(true)
            }
            b"/v1/completions" => {
                let prompt = match completion_prompt(body)? {
                    Some(p) => p,
                    None => return Ok(false),
                };
                match &self.completion_frame {
                    Some((head, tail)) if self.segment_wise => {
                        out.extend_from_slice(head);
                        self.encode_cached(&prompt, cache, out)?;
                        out.extend_from_slice(tail);
                    }
                    _ => out.extend_from_slice(&self.encode(&prompt, true)?),
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// `encode(text, false)`, appended to `out`: segment by segment through `cache` where that
    /// is safe, whole otherwise.
    pub fn encode_cached(
        &self,
        text: &str,
        cache: &mut SegmentCache,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        if !self.segment_wise {
            out.extend_from_slice(&self.encode(text, false)?);
            return Ok(());
        }
        cache.bind(self);
        let mut start = 0;
        if let Some(added) = &self.added {
            for m in added.find_iter(text) {
                let Some(id) = self.added_ids[m.pattern().as_usize()] else {
                    continue;
                };
                self.segment(&text[start..m.start()], cache, out)?;
                out.push(id);
                start = m.end();
            }
        }
        self.segment(&text[start..], cache, out)
    }

    fn segment(
        &self,
        text: &str,
        cache: &mut SegmentCache,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        if text.is_empty() {
            return Ok(());
        }
        if let Some(ids) = cache.get(text) {
            SEGMENT_HITS.fetch_add(1, Relaxed);
            out.extend_from_slice(ids);
            return Ok(());
        }
        SEGMENT_MISSES.fetch_add(1, Relaxed);
        let enc = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| TokenizeError::Tokenizer(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        cache.insert(text, enc.get_ids());
        Ok(())
    }

    /// Segment-wise and whole encoding agree on sample texts (the template's rendering of a
    /// sample conversation, and the added tokens between words and spaces).
    fn probe_segments(&self) -> bool {
        let mut samples: Vec<String> = Vec::new();
        let mut specials: Vec<String> = self
            .tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| !t.normalized && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        specials.sort();
        specials.truncate(8);
        for s in &specials {
            samples.push(format!("Hello world{s} again {s}\n x{s}{s}  y {s}"));
            samples.push(format!("{s}user\nWhat is 2+2?{s}\n{s}assistant\n"));
        }
        if self.has_template {
            let body = br#"{"messages":[{"role":"system","content":"You are a careful assistant."},{"role":"user","content":"Hello there, how are you?"},{"role":"assistant","content":" Fine, thanks. "},{"role":"user","content":"Tell me a story\n about  a cat."}]}"#;
            if let Ok(text) = self.render_chat(body) {
                samples.push(text);
            }
        }
        samples.iter().all(|s| {
            let mut cache = SegmentCache::new(64, 1 << 16);
            let mut seg = Vec::new();
            // Call the segment path directly: `segment_wise` is not yet decided.
            let mut start = 0;
            if let Some(added) = &self.added {
                for m in added.find_iter(s.as_str()) {
                    let Some(id) = self.added_ids[m.pattern().as_usize()] else {
                        continue;
                    };
                    if self
                        .segment(&s[start..m.start()], &mut cache, &mut seg)
                        .is_err()
                    {
                        return false;
                    }
                    seg.push(id);
                    start = m.end();
                }
            }
            if self.segment(&s[start..], &mut cache, &mut seg).is_err() {
                return false;
            }
            self.encode(s, false).is_ok_and(|whole| whole == seg)
        })
    }

    /// What `add_special_tokens = true` puts around a text's ids, when that is a fixed
    /// prefix and suffix.
    fn probe_completion_frame(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let mut frame: Option<(Vec<u32>, Vec<u32>)> = None;
        for probe in ["Hello world", "a b c. 12", " leading space"] {
            let plain = self.encode(probe, false).ok()?;
            let framed = self.encode(probe, true).ok()?;
            let at = (0..=framed.len().checked_sub(plain.len())?)
                .find(|&i| framed[i..i + plain.len()] == plain[..])?;
            let this = (framed[..at].to_vec(), framed[at + plain.len()..].to_vec());
            if frame.as_ref().is_some_and(|f| *f != this) {
                return None;
            }
            frame = Some(this);
        }
        frame
    }
}

/// True when a `Metaspace` pre-tokenizer prepends `▁` only at the start of the whole input
/// (see the module header): segments would then be encoded differently.
fn prepends_only_first(tokenizer_json: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(tokenizer_json) else {
        return true;
    };
    fn walk(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Object(m) => {
                (m.get("type").and_then(|t| t.as_str()) == Some("Metaspace")
                    && m.get("prepend_scheme").and_then(|s| s.as_str()) == Some("first"))
                    || m.values().any(walk)
            }
            serde_json::Value::Array(a) => a.iter().any(walk),
            _ => false,
        }
    }
    v.get("pre_tokenizer").is_some_and(walk) || v.get("normalizer").is_some_and(walk)
}

/// A completions body's `prompt` when it is text (a string or a list of one string); None when
/// it is token ids.
fn completion_prompt(body: &[u8]) -> Result<Option<String>, TokenizeError> {
    #[derive(serde::Deserialize)]
    struct Completion {
        prompt: Option<serde_json::Value>,
    }
    let c: Completion =
        serde_json::from_slice(body).map_err(|e| TokenizeError::Body(format!("not JSON: {e}")))?;
    match c.prompt {
        Some(serde_json::Value::String(s)) => Ok(Some(s)),
        Some(serde_json::Value::Array(mut a)) if a.len() == 1 && a[0].is_string() => {
            match a.pop() {
                Some(serde_json::Value::String(s)) => Ok(Some(s)),
                _ => Ok(None),
            }
        }
        Some(serde_json::Value::Array(a)) if a.iter().all(|v| v.is_number()) => Ok(None),
        _ => Err(TokenizeError::Body(
            "prompt: expected a string or token ids".into(),
        )),
    }
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC date and time (`%Y %m %d %b %B %H %M %S %y %%`).
#[allow(
    clippy::disallowed_methods,
    reason = "a template asked for the date: the only clock read of a request, in token mode"
)]
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_utc(&format, secs)
}

/// `format` of the UTC time `secs` after the epoch (pure, for tests).
pub fn format_utc(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // Civil date from days since the epoch (H. Hinnant's algorithm).
    let days = (secs / 86400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('b') => out += &name[..3],
            Some('B') => out += name,
            Some('H') => out += &format!("{h:02}"),
            Some('M') => out += &format!("{m:02}"),
            Some('S') => out += &format!("{s:02}"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as transformers defines it for chat templates: Python's `json.dumps` with
/// `ensure_ascii=False` by default, `indent`, `separators` and `sort_keys` (no HTML escaping,
/// unlike Jinja's own filter); keys keep the request's order.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a number or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let item = v.get_item(&Value::from(0)).ok();
            let key = v.get_item(&Value::from(1)).ok();
            match (
                item.as_ref().and_then(|i| i.as_str()),
                key.as_ref().and_then(|k| k.as_str()),
            ) {
                (Some(i), Some(k)) => (i.to_string(), k.to_string()),
                _ => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let value = if sort_keys == Some(true) {
        sorted(&value)
    } else {
        value
    };
    let mut out = Vec::new();
    let formatter = PyFormatter {
        indent: indent.map(String::into_bytes),
        item_sep: item_sep.into_bytes(),
        key_sep: key_sep.into_bytes(),
        level: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    serde::Serialize::serialize(&value, &mut ser)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out).unwrap_or_default();
    if ensure_ascii == Some(true) {
        let mut ascii = String::with_capacity(text.len());
        for c in text.chars() {
            if c.is_ascii() {
                ascii.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    ascii += &format!("\\u{u:04x}");
                }
            }
        }
        return Ok(Value::from(ascii));
    }
    Ok(Value::from(text))
}

/// A copy of `v` with every map's keys sorted.
fn sorted(v: &Value) -> Value {
    match v.kind() {
        minijinja::value::ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter().map(|k| k.collect()).unwrap_or_default();
            keys.sort();
            Value::from_iter(keys.into_iter().map(|k| {
                let item = v.get_item(&k).unwrap_or_default();
                (k, sorted(&item))
            }))
        }
        minijinja::value::ValueKind::Seq => Value::from(
            v.try_iter()
                .map(|items| items.map(|i| sorted(&i)).collect::<Vec<_>>())
                .unwrap_or_default(),
        ),
        _ => v.clone(),
    }
}

/// serde_json output shaped like Python's `json.dumps`.
struct PyFormatter {
    indent: Option<Vec<u8>>,
    item_sep: Vec<u8>,
    key_sep: Vec<u8>,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(indent)?;
            }
        }
        Ok(())
    }
}

impl PyFormatter {
    /// `[` or `{`: one level deeper, nothing in it yet.
    fn open<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    /// `]` or `}`, on its own line when the container held anything (and indenting is on).
    fn close<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }

    /// Before an array value or an object key: the separator unless it is the first.
    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(&self.item_sep)?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    /// Floats as Python's `repr` writes them (`1e-07`, `1e+16`, `2.0`).
    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, f: f64) -> std::io::Result<()> {
        w.write_all(agent::python_float(f).as_bytes())
    }
    fn write_f32<W: ?Sized + std::io::Write>(&mut self, w: &mut W, f: f32) -> std::io::Result<()> {
        self.write_f64(w, f64::from(f))
    }
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(&self.key_sep)
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// The map key is already an xxh3 digest: hash it as it is.
#[derive(Default)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// Default bound on the ids a worker's cache holds (4 MiB of ids).
pub const CACHE_TOKENS: usize = 1 << 20;
/// Default bound on the segments it holds.
pub const CACHE_SEGMENTS: usize = 16 * 1024;

/// One worker's segment text -> token ids cache, least recently used out first. Keys are the
/// xxh3 of the segment seeded with its length (two different segments share a key with
/// probability about 2^-64).
pub struct SegmentCache {
    index: HashMap<u64, u32, BuildHasherDefault<DigestHasher>>,
    order: LruList<u64>,
    /// Ids by LRU slot (vectors are reused when a slot is).
    ids: Vec<Vec<u32>>,
    held_tokens: usize,
    max_tokens: usize,
    max_segments: usize,
    /// The load of the tokenizer the entries belong to (a reload empties the cache).
    owner: u64,
}

impl SegmentCache {
    pub fn new(max_segments: usize, max_tokens: usize) -> SegmentCache {
        SegmentCache {
            index: HashMap::default(),
            order: LruList::new(),
            ids: Vec::new(),
            held_tokens: 0,
            max_tokens,
            max_segments: max_segments.max(1),
            owner: 0,
        }
    }

    /// Segments held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Ids held.
    pub fn tokens(&self) -> usize {
        self.held_tokens
    }

    /// Empties the cache when it was filled by another tokenizer.
    fn bind(&mut self, tokenizer: &ChatTokenizer) {
        let id = tokenizer.load_id;
        if self.owner != id {
            self.index.clear();
            self.order.clear();
            for v in &mut self.ids {
                v.clear();
            }
            self.held_tokens = 0;
            self.owner = id;
        }
    }

    fn key(text: &str) -> u64 {
        xxh3_64_with_seed(text.as_bytes(), text.len() as u64)
    }

    fn get(&mut self, text: &str) -> Option<&[u32]> {
        let slot = *self.index.get(&Self::key(text))?;
        self.order.touch(slot);
        Some(&self.ids[slot as usize])
    }

    fn insert(&mut self, text: &str, ids: &[u32]) {
        if ids.len() > self.max_tokens {
            return;
        }
        while self.index.len() >= self.max_segments
            || self.held_tokens + ids.len() > self.max_tokens
        {
            let Some(old) = self.order.oldest() else {
                break;
            };
            let key = self.order.remove(old);
            self.index.remove(&key);
            self.held_tokens -= self.ids[old as usize].len();
            self.ids[old as usize].clear();
        }
        let key = Self::key(text);
        let slot = self.order.push_newest(key);
        if self.ids.len() <= slot as usize {
            self.ids.resize_with(slot as usize + 1, Vec::new);
        }
        self.ids[slot as usize].extend_from_slice(ids);
        self.held_tokens += ids.len();
        self.index.insert(key, slot);
    }
}

/// Fills `out` with the token-mode hashes of `tokens` under `cfg`, as
/// [`prefix::hash_request`] does for a prompt given as token ids, from the root `out` holds
/// (the request's adapter and salt, as [`prefix::hash_request_within`] found them).
pub fn fill_prefix(tokens: &[u32], cfg: &prefix::PrefixConfig, out: &mut prefix::PrefixHashes) {
    let root = out.token_root;
    out.clear();
    out.token_root = root;
    let block = cfg.token_block_size.clamp(1, prefix::MAX_TOKEN_BLOCK) as usize;
    let hashed = tokens.len().min(cfg.max_blocks.saturating_mul(block));
    prefix::token_block_hashes_from(root, &tokens[..hashed], block, &mut out.hashes);
    out.mode = prefix::PrefixMode::Tokens;
    out.block_units = block as u32;
    out.total_units = tokens.len();
    out.est_prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
}

/// A worker's token-mode buffers: its segment cache and the ids of the request being routed.
pub struct TokenScratch {
    pub cache: SegmentCache,
    pub ids: Vec<u32>,
}

impl Default for TokenScratch {
    fn default() -> Self {
        TokenScratch {
            cache: SegmentCache::new(CACHE_SEGMENTS, CACHE_TOKENS),
            ids: Vec::new(),
        }
    }
}
