//! The OpenAI-compatible request and response bodies a vLLM server speaks (replica-interfaces.md
//! section 3): request JSON -> prompt token ids and sampling limits, and the JSON of responses,
//! stream chunks and errors. Pure: no I/O, no clocks (ids and timestamps are passed in). The
//! agent APIs (`responses`, `messages`) tokenize through [`parse_chat`] too.
//!
//! Unknown fields are ignored, as vLLM does. Where this differs from vLLM, on purpose:
//! - the served model name is echoed whatever `model` the client sent (vLLM answers 404 for an
//!   unknown name), so a balancer may use any name;
//! - `max_tokens` defaults to 16 on both endpoints (vLLM's chat default is the rest of the
//!   context), keeping simulated answers short unless asked otherwise;
//! - sampling fields (temperature, stop, logprobs, ...) are accepted and ignored.

#![forbid(unsafe_code)]

use crate::engine::tokenizer::{self, ChatMessage};
use crate::engine::FinishReason;
use serde_json::{json, Map, Value};

/// The Hugging Face tokenizer and chat template given by `kvlb replica --tokenizer`: when
/// set, text prompts are tokenized as a real engine does (`crate::tokenize`, the whole rendered
/// prompt at once) instead of by the simulated tokenizer. Set once at start.
pub static HF_TOKENIZER: std::sync::OnceLock<crate::tokenize::ChatTokenizer> =
    std::sync::OnceLock::new();

/// A text prompt's ids: the configured tokenizer's (with special tokens, as vLLM encodes a
/// completion prompt), else the simulated one's.
pub(super) fn encode_text(s: &str) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::new();
    match HF_TOKENIZER.get() {
        Some(t) => {
            ids = t
                .completion_tokens_whole(s)
                .map_err(|e| ApiError::bad_request(format!("prompt: {e}")))?
        }
        None => tokenizer::encode(s, &mut ids),
    }
    Ok(ids)
}

/// An error answer: HTTP status plus vLLM's `{"error": {...}}` body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault (vLLM's `param`), if any.
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 404,
            kind: "NotFoundError",
            message: message.into(),
            param: None,
        }
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError {
            status: 405,
            kind: "MethodNotAllowedError",
            message: "Method Not Allowed".into(),
            param: None,
        }
    }

    pub fn body(&self) -> String {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}})
            .to_string()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A generation request ready for the engine.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub endpoint: Endpoint,
    /// One token list per prompt; each yields `n` choices.
    pub prompts: Vec<Vec<u32>>,
    pub n: u32,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_salt: Option<u64>,
    /// The `model` named (None: the base model).
    pub model: Option<String>,
    /// `kv_transfer_params` as sent (disaggregated prefill; null is None), checked by the
    /// replica's role (`pd::leg`): a replica of the default role ignores it, as before.
    pub kv_transfer_params: Option<Value>,
    /// SGLang's `bootstrap_host`, `bootstrap_port` and `bootstrap_room` as sent, checked by
    /// a replica of `--pd-protocol sglang` (`pd::bootstrap_leg`); ignored by the others.
    pub bootstrap: BootstrapFields,
}

pub const DEFAULT_MAX_TOKENS: u32 = 16;
const MAX_N: u64 = 128;

pub(super) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!(
            "invalid JSON in request body: {e}"
        ))),
    }
}

pub(super) use crate::tokenize::agent::type_name;

fn opt_bool(m: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::bad_request(format!(
            "{key}: expected a boolean, got {}",
            type_name(v)
        ))),
    }
}

fn opt_int(m: &Map<String, Value>, key: &str, min: u64, max: u64) -> Result<Option<u64>, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) if v >= min && v <= max => Ok(Some(v)),
            _ => Err(ApiError::bad_request(format!(
                "{key}: expected an integer in {min}..={max}, got {n}"
            ))),
        },
        Some(v) => Err(ApiError::bad_request(format!(
            "{key}: expected an integer, got {}",
            type_name(v)
        ))),
    }
}

fn common(
    m: &Map<String, Value>,
    endpoint: Endpoint,
    prompts: Vec<Vec<u32>>,
) -> Result<GenerationRequest, ApiError> {
    let max_tokens = match endpoint {
        Endpoint::Chat => match opt_int(m, "max_completion_tokens", 1, u32::MAX as u64)? {
            Some(v) => Some(v),
            None => opt_int(m, "max_tokens", 1, u32::MAX as u64)?,
        },
        Endpoint::Completions => opt_int(m, "max_tokens", 1, u32::MAX as u64)?,
    };
    let n = opt_int(m, "n", 1, MAX_N)?.unwrap_or(1) as u32;
    let stream = opt_bool(m, "stream")?;
    let include_usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")?,
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "stream_options: expected an object, got {}",
                type_name(v)
            )))
        }
    };
    let cache_salt = match m.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(xxhash_rust::xxh3::xxh3_64(s.as_bytes())),
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "cache_salt: expected a string, got {}",
                type_name(v)
            )))
        }
    };
    let model = match m.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "model: expected a string, got {}",
                type_name(v)
            )))
        }
    };
    Ok(GenerationRequest {
        endpoint,
        prompts,
        n,
        max_tokens: max_tokens.map(|v| v as u32).unwrap_or(DEFAULT_MAX_TOKENS),
        stream,
        include_usage,
        cache_salt,
        model,
        kv_transfer_params: m
            .get("kv_transfer_params")
            .filter(|v| !v.is_null())
            .cloned(),
        bootstrap: BootstrapFields {
            host: m.get("bootstrap_host").cloned(),
            port: m.get("bootstrap_port").cloned(),
            room: m.get("bootstrap_room").cloned(),
        },
    })
}

pub(super) fn token_ids(list: &[Value], what: &str) -> Result<Vec<u32>, ApiError> {
    let mut out = Vec::with_capacity(list.len());
    for v in list {
        match v.as_u64() {
            Some(id) if id < tokenizer::VOCAB_SIZE as u64 => out.push(id as u32),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "{what}: token id {v} is out of vocabulary (0..{})",
                    tokenizer::VOCAB_SIZE
                )))
            }
        }
    }
    Ok(out)
}

/// The `prompt` of /v1/completions or /tokenize: a string, a list of strings, a list of token
/// ids or a list of lists of token ids.
fn completion_prompts(m: &Map<String, Value>) -> Result<Vec<Vec<u32>>, ApiError> {
    let wrong = |v: &Value| {
        ApiError::bad_request(format!(
            "prompt: expected a string, a list of strings, a list of token ids or a list of lists of token ids, got {}",
            type_name(v)
        ))
    };
    match m.get("prompt") {
        None | Some(Value::Null) => Err(ApiError::bad_request("prompt: field required")),
        Some(Value::String(s)) => Ok(vec![encode_text(s)?]),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::bad_request("prompt: must not be an empty list"));
            }
            if items.iter().all(|v| v.is_number()) {
                return Ok(vec![token_ids(items, "prompt")?]);
            }
            let mut prompts = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Value::String(s) => prompts.push(encode_text(s)?),
                    Value::Array(ids) if ids.iter().all(|v| v.is_number()) => {
                        prompts.push(token_ids(ids, "prompt")?)
                    }
                    other => return Err(wrong(other)),
                }
            }
            Ok(prompts)
        }
        Some(other) => Err(wrong(other)),
    }
}

/// Flatten `messages` for the chat template.
fn chat_messages(m: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match m.get("messages") {
        None | Some(Value::Null) => return Err(ApiError::bad_request("messages: field required")),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "messages: expected a list, got {}",
                type_name(v)
            )))
        }
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let Value::Object(msg) = item else {
            return Err(ApiError::bad_request(format!(
                "messages[{i}]: expected an object, got {}",
                type_name(item)
            )));
        };
        let role = match msg.get("role") {
            Some(Value::String(r)) => r.clone(),
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].role: expected a string, got {}",
                    type_name(v)
                )))
            }
            None => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].role: field required"
                )))
            }
        };
        let content = match msg.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut texts: Vec<&str> = Vec::new();
                for (j, part) in parts.iter().enumerate() {
                    match part {
                        Value::Object(p) => {
                            let kind = p.get("type").and_then(Value::as_str).unwrap_or("text");
                            if kind == "text" || kind == "input_text" {
                                match p.get("text") {
                                    Some(Value::String(t)) => texts.push(t),
                                    _ => {
                                        return Err(ApiError::bad_request(format!(
                                            "messages[{i}].content[{j}].text: expected a string"
                                        )))
                                    }
                                }
                            }
                            // image_url, input_audio, ...: no text tokens in this simulation.
                        }
                        Value::String(t) => texts.push(t),
                        v => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content[{j}]: expected an object, got {}",
                                type_name(v)
                            )))
                        }
                    }
                }
                texts.join("\n")
            }
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content: expected a string or a list of parts, got {}",
                    type_name(v)
                )))
            }
        };
        let tool_calls = match msg.get("tool_calls") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Array(_)) => Some(v.to_string()),
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].tool_calls: expected a list, got {}",
                    type_name(v)
                )))
            }
        };
        let tool_call_id = match msg.get("tool_call_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].tool_call_id: expected a string, got {}",
                    type_name(v)
                )))
            }
        };
        out.push(ChatMessage {
            role,
            content,
            tool_calls,
            tool_call_id,
        });
    }
    Ok(out)
}

fn chat_tools(m: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match m.get("tools") {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Array(_)) => Ok(Some(v.to_string())),
        Some(v) => Err(ApiError::bad_request(format!(
            "tools: expected a list, got {}",
            type_name(v)
        ))),
    }
}

fn chat_prompt(m: &Map<String, Value>, add_generation_prompt: bool) -> Result<Vec<u32>, ApiError> {
    let messages = chat_messages(m)?;

    let tools = chat_tools(m)?;
    let mut ids = Vec::new();
    tokenizer::apply_chat_template(&messages, tools.as_deref(), add_generation_prompt, &mut ids);
    Ok(ids)
}

/// POST /v1/completions body.
pub fn parse_completion(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let m = parse_object(body)?;
    let prompts = completion_prompts(&m)?;
    common(&m, Endpoint::Completions, prompts)
}

/// POST /v1/chat/completions body.
pub fn parse_chat(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let m = parse_object(body)?;
    let prompt = match HF_TOKENIZER.get() {
        // From the body as sent: the template's tojson keeps the request's key order.
        Some(t) => t
            .chat_tokens_whole(body)
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
        None => chat_prompt(&m, true)?,
    };
    common(&m, Endpoint::Chat, vec![prompt])
}

/// POST /tokenize body -> the token ids of its `prompt` or `messages`.
pub fn parse_tokenize(body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let m = parse_object(body)?;
    if m.get("messages").is_some_and(|v| !v.is_null()) {
        let add = match m.get("add_generation_prompt") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "add_generation_prompt: expected a boolean, got {}",
                    type_name(v)
                )))
            }
        };
        if let Some(t) = HF_TOKENIZER.get() {
            return t
                .chat_tokens_whole(body)
                .map_err(|e| ApiError::bad_request(e.to_string()));
        }
        return chat_prompt(&m, add);
    }
    let mut prompts = completion_prompts(&m).map_err(|e| {
        if e.message == "prompt: field required" {
            ApiError::bad_request("either prompt or messages is required")
        } else {
            e
        }
    })?;
    if prompts.len() != 1 {
        return Err(ApiError::bad_request("prompt: /tokenize takes one prompt"));
    }
    Ok(prompts.remove(0))
}

pub fn tokenize_response(tokens: &[u32], max_model_len: u32) -> String {
    json!({"count": tokens.len(), "max_model_len": max_model_len, "tokens": tokens, "token_strs": null})
        .to_string()
}

pub fn finish_reason_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
        FinishReason::Abort => "abort",
    }
}

/// Token counts of a whole request (summed over its choices' prompts).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// What the response names itself: id, creation time, model.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    pub fn new(endpoint: Endpoint, random: u128, created: u64, model: &str) -> ResponseMeta {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        ResponseMeta {
            endpoint,
            id: format!("{prefix}-{random:032x}"),
            created,
            model: model.to_string(),
        }
    }
}

/// One finished choice of a non-streaming response.
#[derive(Debug, Clone)]
pub struct ChoiceResult {
    pub text: String,
    pub finish_reason: Option<FinishReason>,
}

/// The body of a non-streaming response; `kv_transfer_params` is a prefill replica's answer
/// to `do_remote_decode` (else null).
pub fn full_response(
    meta: &ResponseMeta,
    choices: &[ChoiceResult],
    usage: &Usage,
    kv_transfer_params: &Value,
) -> String {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let reason = c.finish_reason.map(finish_reason_str);
            match meta.endpoint {
                Endpoint::Completions => json!({
                    "index": i, "text": c.text, "logprobs": null, "finish_reason": reason,
                    "stop_reason": null, "prompt_logprobs": null,
                }),
                Endpoint::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text, "refusal": null,
                        "annotations": null, "audio": null, "function_call": null,
                        "tool_calls": [], "reasoning_content": null},
                    "logprobs": null, "finish_reason": reason, "stop_reason": null,
                }),
            }
        })
        .collect();
    let object = match meta.endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion",
    };
    json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": choices, "service_tier": null, "system_fingerprint": null,
        "usage": usage.json(), "prompt_logprobs": null,
        "kv_transfer_params": kv_transfer_params,
    })
    .to_string()
}

/// One stream chunk for choice `index`: its new `text`, the assistant role on a chat choice's
/// first chunk, and the finish reason on its last.
pub fn stream_chunk(
    meta: &ResponseMeta,
    index: usize,
    text: &str,
    first: bool,
    finish: Option<FinishReason>,
) -> String {
    let reason = finish.map(finish_reason_str);
    match meta.endpoint {
        Endpoint::Completions => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"index": index, "text": text, "logprobs": null, "finish_reason": reason,
                "stop_reason": null}],
        })
        .to_string(),
        Endpoint::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else if text.is_empty() && finish.is_some() {
                json!({})
            } else {
                json!({"content": text})
            };
            json!({
                "id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
                "model": meta.model,
                "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": reason}],
            })
            .to_string()
        }
    }
}

/// The final chunk of `stream_options.include_usage`.
pub fn usage_chunk(meta: &ResponseMeta, usage: &Usage) -> String {
    let object = match meta.endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    };
    json!({"id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": [], "usage": usage.json()})
    .to_string()
}

/// SGLang's bootstrap fields as a request sent them: None when absent, `Some(Null)` when null
/// (read by `pd::bootstrap_leg`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BootstrapFields {
    pub host: Option<Value>,
    pub port: Option<Value>,
    pub room: Option<Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_bodies_with_400() {
        for body in [
            &b"{not json"[..],
            b"[1,2]",
            b"{}",
            b"{\"prompt\": 5}",
            b"{\"prompt\": []}",
            b"{\"prompt\": [1, \"a\"]}",
            b"{\"prompt\": [-1]}",
            b"{\"prompt\": [999999999]}",
            b"{\"prompt\": [1], \"max_tokens\": \"10\"}",
            b"{\"prompt\": [1], \"max_tokens\": 0}",
            b"{\"prompt\": [1], \"max_tokens\": -3}",
            b"{\"prompt\": [1], \"stream\": \"yes\"}",
            b"{\"prompt\": [1], \"n\": 100000}",
            b"{\"prompt\": [1], \"cache_salt\": 7}",
            b"{\"prompt\": [1], \"stream_options\": 7}",
        ] {
            let e = parse_completion(body).unwrap_err();
            assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(body));
            assert!(e.body().contains("\"type\":\"BadRequestError\""));
        }
        for body in [
            &b"{\"messages\": 1}"[..],
            b"{\"messages\": [1]}",
            b"{\"messages\": [{\"content\": \"x\"}]}",
            b"{\"messages\": [{\"role\": \"user\", \"content\": 5}]}",
            b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": 3}]}",
            b"{\"messages\": [], \"tools\": {}}",
        ] {
            assert_eq!(
                parse_chat(body).unwrap_err().status,
                400,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn token_prompts_and_options() {
        let r = parse_completion(
            br#"{"prompt": [[1,2,3],[4,5]], "max_tokens": 7, "n": 2, "stream": true,
                "stream_options": {"include_usage": true}, "cache_salt": "s", "extra": {"x": 1}}"#,
        )
        .unwrap();
        assert_eq!(r.prompts, vec![vec![1, 2, 3], vec![4, 5]]);
        assert_eq!(
            (r.max_tokens, r.n, r.stream, r.include_usage),
            (7, 2, true, true)
        );
        assert_eq!(r.cache_salt, Some(xxhash_rust::xxh3::xxh3_64(b"s")));
        let r = parse_completion(br#"{"prompt": [9, 8]}"#).unwrap();
        assert_eq!(
            (r.prompts.len(), r.max_tokens, r.stream),
            (1, DEFAULT_MAX_TOKENS, false)
        );
        let r = parse_chat(br#"{"messages": [], "max_tokens": 3, "max_completion_tokens": 5}"#)
            .unwrap();
        assert_eq!(r.max_tokens, 5);
    }

    #[test]
    fn response_shapes() {
        let meta = ResponseMeta::new(Endpoint::Chat, 0xab, 1700000000, "m");
        assert!(meta.id.starts_with("chatcmpl-") && meta.id.len() == 9 + 32);
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 2,
            cached_tokens: 4,
        };
        let body: Value = serde_json::from_str(&full_response(
            &meta,
            &[ChoiceResult {
                text: "hi".into(),
                finish_reason: Some(FinishReason::Length),
            }],
            &usage,
            &Value::Null,
        ))
        .unwrap();
        assert_eq!(body["object"], "chat.completion");
        assert!(body["kv_transfer_params"].is_null());
        assert_eq!(body["choices"][0]["message"]["content"], "hi");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(body["usage"]["total_tokens"], 12);
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
        let c: Value = serde_json::from_str(&stream_chunk(&meta, 0, "a", true, None)).unwrap();
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert!(c["choices"][0]["finish_reason"].is_null());
        let e: Value = serde_json::from_str(&ApiError::bad_request("x").body()).unwrap();
        assert_eq!(e["error"]["code"], 400);
    }
}
