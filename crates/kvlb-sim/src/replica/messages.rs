//! Anthropic's Messages API as vLLM 0.33 serves it (`vllm/entrypoints/anthropic/`):
//! `POST /v1/messages` (a message, or Anthropic's server-sent events) and
//! `POST /v1/messages/count_tokens`. The `x-api-key` and `anthropic-version` headers are
//! accepted and ignored, as vLLM ignores them.
//!
//! A request is converted to the chat completions body vLLM renders for it
//! ([`crate::tokenize::agent::messages_to_chat`], or
//! [`crate::tokenize::agent::count_tokens_to_chat`] for count_tokens, which does not require
//! `max_tokens`; inline system messages merged into the
//! leading one when the `--tokenizer` template wants the system prompt first, as vLLM probes
//! at start) and tokenized as `/v1/chat/completions` is. The answer is what vLLM's
//! `messages_full_converter` / `message_stream_converter` make of the chat answer: its id is
//! the chat completion's (`chatcmpl-...`, as vLLM's), `stop_reason` `end_turn` or `max_tokens`,
//! `usage.input_tokens` the uncached prompt tokens and `cache_read_input_tokens` the cached
//! ones (the replica reports prompt token details, as vLLM with
//! `--enable-prompt-tokens-details`). The stream is `message_start` (sent with the first
//! token, as vLLM sends it with the chat stream's first chunk), `content_block_start`, one
//! `content_block_delta` per token, `content_block_stop`, `message_delta` (stop reason and
//! usage), `message_stop`; no `ping`.
//!
//! Where this differs from vLLM, on purpose: every error of these two paths, a malformed body
//! included, is in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, the
//! type from the HTTP status as vLLM's `translate_error_type` maps it); vLLM answers a body its
//! request model rejects in the OpenAI error shape.

#![forbid(unsafe_code)]

use super::answer::Single;
use super::driver::Replica;
use super::http::{self, Connection};
use super::models::Served;
use super::openai::{self, ApiError, Usage, HF_TOKENIZER};
use crate::engine::FinishReason;
use crate::tokenize::agent;
use serde_json::{json, Map, Value};
use std::io;
use std::sync::OnceLock;

/// Whether inline system messages are merged into the leading one: the `--tokenizer` template
/// refuses a system message after the first (decided once, as vLLM does at start); never with
/// the simulated template, which renders them anywhere.
fn merge_inline_system() -> bool {
    static MERGE: OnceLock<bool> = OnceLock::new();
    *MERGE.get_or_init(|| match HF_TOKENIZER.get() {
        Some(t) => {
            agent::template_needs_system_first(|body| t.render_chat(body.to_string().as_bytes()))
        }
        None => false,
    })
}

/// vLLM's `translate_error_type`: Anthropic's `error.type` for an HTTP status (the one
/// mapping kvlb's own errors use too).
pub use crate::http::anthropic_error_type as error_type;

/// An error in Anthropic's shape.
pub fn error_body(err: &ApiError) -> String {
    json!({"type": "error", "error": {"type": error_type(err.status), "message": err.message}})
        .to_string()
}

pub(super) fn send_error(
    conn: &mut Connection,
    err: &ApiError,
    keep_alive: bool,
) -> io::Result<()> {
    super::answer::send_json_status(conn, err.status, &error_body(err), keep_alive)
}

/// A body that is not a JSON object of the Messages API's shape.
fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// A request converted and tokenized, its model checked against the served names.
struct Prepared {
    named: super::models::Named,
    model: String,
    prompt: Vec<u32>,
    max_tokens: u32,
    cache_salt: Option<u64>,
    stream: bool,
}

fn convert(served: &Served, body: &[u8], count_only: bool) -> Result<Prepared, ApiError> {
    let request = openai::parse_object(body)?;
    if !count_only && request.get("max_tokens").is_none_or(Value::is_null) {
        return Err(invalid("max_tokens: Field required"));
    }
    let convert = if count_only {
        agent::count_tokens_to_chat
    } else {
        agent::messages_to_chat
    };
    let chat =
        convert(&Value::Object(request.clone()), merge_inline_system()).map_err(|e| match e {
            crate::tokenize::TokenizeError::Body(m) => invalid(m),
            other => invalid(other.to_string()),
        })?;
    let model = request.get("model").and_then(Value::as_str);
    let named = served.check(model)?;
    let bytes = serde_json::to_vec(&chat).map_err(|e| invalid(e.to_string()))?;
    let mut parsed = openai::parse_chat(&bytes)?;
    let prompt = parsed.prompts.pop().unwrap_or_default();
    Ok(Prepared {
        model: served.response_name(&named),
        named,
        prompt,
        max_tokens: parsed.max_tokens,
        cache_salt: parsed.cache_salt,
        stream: parsed.stream,
    })
}

/// `POST /v1/messages/count_tokens`: the prompt's token count, as vLLM answers it.
pub(super) fn count_tokens(served: &Served, body: &[u8]) -> Result<String, ApiError> {
    let p = convert(served, body, true)?;
    let n = p.prompt.len();
    Ok(json!({"input_tokens": n, "context_management": {"original_input_tokens": n}}).to_string())
}

/// `POST /v1/messages`.
pub(super) fn create(
    conn: &mut Connection,
    served: &Served,
    replica: &Replica,
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    let p = match convert(served, body, false) {
        Ok(p) => p,
        Err(e) => return send_error(conn, &e, keep_alive),
    };
    let prompt_len = p.prompt.len() as u64;
    let mut gen = match Single::start(
        replica,
        &p.named,
        p.prompt,
        p.max_tokens,
        p.cache_salt,
        p.stream,
    ) {
        Ok(g) => g,
        Err(e) => return send_error(conn, &e, keep_alive),
    };
    let id = format!("chatcmpl-{:032x}", replica.response_random());
    if p.stream {
        return stream_message(conn, &mut gen, &id, &p.model, prompt_len, keep_alive);
    }
    let mut text = String::new();
    while gen.finish.is_none() {
        for t in gen.next(conn)? {
            text.push_str(&t);
        }
    }
    let body = message_json(&id, &p.model, &text, gen.finish, &gen.usage).to_string();
    super::answer::send_json(conn, &body, keep_alive)
}

/// vLLM's `_to_anthropic_stop_reason` for the simulated engine's finish reasons.
fn stop_reason(finish: Option<FinishReason>) -> Value {
    match finish {
        Some(FinishReason::Length) => json!("max_tokens"),
        Some(FinishReason::Stop) => json!("end_turn"),
        _ => Value::Null,
    }
}

/// vLLM's `_build_anthropic_usage` of a finished answer: the prompt's uncached tokens, the
/// output tokens, the cached prompt tokens.
fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
    })
}

/// vLLM's `messages_full_converter`, dumped without its unset fields (`stop_sequence` and a
/// missing stop reason are left out, as vLLM's `exclude_none` leaves them).
fn message_json(
    id: &str,
    model: &str,
    text: &str,
    finish: Option<FinishReason>,
    usage: &Usage,
) -> Value {
    let mut m = Map::new();
    m.insert("id".into(), json!(id));
    m.insert("type".into(), json!("message"));
    m.insert("role".into(), json!("assistant"));
    m.insert("content".into(), json!([{"type": "text", "text": text}]));
    m.insert("model".into(), json!(model));
    let reason = stop_reason(finish);
    if !reason.is_null() {
        m.insert("stop_reason".into(), reason);
    }
    m.insert("usage".into(), usage_json(usage));
    Value::Object(m)
}

/// vLLM's `message_stream_converter` over the simulated chat stream.
fn stream_message(
    conn: &mut Connection,
    gen: &mut Single<'_>,
    id: &str,
    model: &str,
    prompt_tokens: u64,
    keep_alive: bool,
) -> io::Result<()> {
    conn.write_all(&http::event_stream_head(keep_alive))?;
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    let event = |out: &mut Vec<u8>, v: Value| {
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        http::push_sse_event(out, &kind, &v.to_string());
    };
    let mut started = false;
    let mut block_open = false;
    while gen.finish.is_none() {
        let tokens = gen.next(conn)?;
        out.clear();
        if !started && (!tokens.is_empty() || gen.finish.is_some()) {
            // The chat stream's first chunk (the role) carries the prompt's usage.
            started = true;
            event(
                &mut out,
                json!({"type": "message_start", "message": {"id": id, "type": "message",
                    "role": "assistant", "content": [], "model": model, "stop_reason": null,
                    "stop_sequence": null,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
            );
        }
        for t in tokens {
            if !block_open {
                block_open = true;
                event(
                    &mut out,
                    json!({"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}),
                );
            }
            event(
                &mut out,
                json!({"type": "content_block_delta", "delta": {"type": "text_delta", "text": t}, "index": 0}),
            );
        }
        if !out.is_empty() {
            conn.write_all(&out)?;
        }
    }
    out.clear();
    if block_open {
        event(&mut out, json!({"type": "content_block_stop", "index": 0}));
    }
    event(
        &mut out,
        json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(gen.finish), "stop_sequence": null},
            "usage": usage_json(&gen.usage)}),
    );
    event(&mut out, json!({"type": "message_stop"}));
    out.extend_from_slice(http::LAST_CHUNK);
    conn.write_all(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_types_follow_the_status() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (405, "invalid_request_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (503, "overloaded_error"),
        ] {
            assert_eq!(error_type(status), kind);
        }
        let body: Value = serde_json::from_str(&error_body(&ApiError::not_found("no"))).unwrap();
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": "not_found_error", "message": "no"}})
        );
    }

    #[test]
    fn message_shape() {
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 3,
            cached_tokens: 4,
        };
        let m = message_json("chatcmpl-1", "m", "hi", Some(FinishReason::Stop), &usage);
        assert_eq!(
            m,
            json!({"id": "chatcmpl-1", "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": "hi"}], "model": "m", "stop_reason": "end_turn",
                "usage": {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4}})
        );
        let m = message_json("x", "m", "", Some(FinishReason::Length), &usage);
        assert_eq!(
            (m["stop_reason"].as_str(), m["content"][0]["text"].as_str()),
            (Some("max_tokens"), Some(""))
        );
        assert!(m.get("stop_sequence").is_none());
    }
}
