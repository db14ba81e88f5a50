//! The OpenAI Responses API as vLLM 0.33 serves it with `VLLM_ENABLE_RESPONSES_API_STORE=1`
//! (`vllm/entrypoints/openai/responses/`): `POST /v1/responses` (a JSON response or vLLM's
//! server-sent events), `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.
//!
//! A request is converted to the chat completions body vLLM renders for it
//! ([`crate::tokenize::agent::responses_to_chat`]) and tokenized exactly as
//! `/v1/chat/completions` is (`openai::parse_chat`: the `--tokenizer` template, else the
//! simulated one), so a follow-up's prompt starts with the stored conversation's and the engine
//! finds that prefix in its KV cache (`usage.input_tokens_details.cached_tokens`).
//!
//! The store keeps what vLLM's does, per port: the response as answered and the chat messages
//! it was rendered from (vLLM's msg_store); `previous_response_id` continues from them. Where
//! vLLM's store grows without bound, this one keeps the last [`STORE_CAPACITY`] responses,
//! oldest out first; every `store: true` request (the default) is stored.
//!
//! Where this differs from vLLM, on purpose:
//! * `max_output_tokens` defaults to 16 (as the replica's chat default; vLLM: the rest of the
//!   context), so answers are short unless asked otherwise; an answer cut by that default ends
//!   as the model's own stop would (`completed`), one cut by the request's
//!   `max_output_tokens` is `incomplete`, as vLLM reports it;
//! * `background: true` is refused (400): the replica answers every request in its connection;
//! * request fields are echoed as sent (`tools`, `reasoning`, `text`, `metadata`, ...; vLLM
//!   echoes them as its request model re-dumps them, with every optional field spelled out);
//!   no reasoning or tool-call parser runs, so the output is one message item;
//! * `GET /v1/responses/{id}?stream=true` answers the stored response as JSON (vLLM replays
//!   the events of background responses only).

#![forbid(unsafe_code)]

use super::answer::{send_error, send_json, unix_secs, Single};
use super::driver::Replica;
use super::http::{self, Connection};
use super::models::{Named, Served};
use super::openai::{self, ApiError, Usage};
use crate::engine::FinishReason;
use crate::tokenize::agent::{self, PreviousTurn};
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::Mutex;

/// Responses kept per port (the oldest goes first).
pub const STORE_CAPACITY: usize = 10_000;

/// One stored response: the response as answered, and the chat messages it was rendered from.
#[derive(Debug, Clone)]
pub struct Stored {
    pub response: Value,
    pub messages: Vec<Value>,
}

impl Stored {
    /// What it contributes to a follow-up.
    fn turn(&self) -> PreviousTurn {
        PreviousTurn {
            messages: self.messages.clone(),
            output: self
                .response
                .get("output")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
        }
    }
}

/// The in-memory store of one port, bounded: the last `capacity` responses by id.
pub struct Store {
    inner: Mutex<StoreInner>,
    capacity: usize,
}

#[derive(Default)]
struct StoreInner {
    by_id: HashMap<String, Stored>,
    /// Ids in the order they were first stored.
    order: VecDeque<String>,
}

impl Store {
    pub fn new(capacity: usize) -> Store {
        Store {
            inner: Mutex::new(StoreInner::default()),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StoreInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Stored> {
        self.lock().by_id.get(id).cloned()
    }

    /// Stores (or replaces) `id`; the oldest response goes when the store is full.
    pub fn put(&self, id: &str, stored: Stored) {
        let mut st = self.lock();
        if st.by_id.insert(id.to_string(), stored).is_none() {
            st.order.push_back(id.to_string());
        }
        while st.order.len() > self.capacity {
            if let Some(old) = st.order.pop_front() {
                st.by_id.remove(&old);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `GET /v1/responses/{id}`: the stored response, or vLLM's 404.
    pub fn retrieve(&self, id: &str) -> Result<String, ApiError> {
        match self.get(id) {
            Some(s) => Ok(s.response.to_string()),
            None => Err(not_found(id)),
        }
    }

    /// `POST /v1/responses/{id}/cancel`: every stored response has finished (nothing runs in
    /// the background here), which vLLM refuses to cancel; an unknown id is vLLM's 404.
    pub fn cancel(&self, id: &str) -> Result<String, ApiError> {
        match self.get(id) {
            Some(_) => Err(ApiError {
                status: 400,
                kind: "invalid_request_error",
                message: "Cannot cancel a synchronous response.".into(),
                param: Some("response_id"),
            }),
            None => Err(not_found(id)),
        }
    }
}

/// vLLM's answer for an unknown response id.
pub fn not_found(id: &str) -> ApiError {
    ApiError {
        status: 404,
        kind: "invalid_request_error",
        message: format!("Response with id '{id}' not found."),
        param: Some("response_id"),
    }
}

/// A request ready for the engine.
struct Prepared {
    request: Map<String, Value>,
    id: String,
    model: String,
    named: Named,
    /// The chat messages the prompt was rendered from (stored for follow-ups).
    messages: Vec<Value>,
    prompt: Vec<u32>,
    max_tokens: u32,
    /// The request set `max_output_tokens` (else the replica's default ends the answer).
    limited: bool,
    cache_salt: Option<u64>,
    stream: bool,
    store: bool,
}

fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
    ApiError {
        param,
        ..ApiError::bad_request(message)
    }
}

fn prepare(
    served: &Served,
    responses: &Store,
    replica: &Replica,
    body: &[u8],
) -> Result<Prepared, ApiError> {
    let request = openai::parse_object(body)?;
    let model = match request.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(v) => {
            return Err(bad(
                format!("model: expected a string, got {}", openai::type_name(v)),
                Some("model"),
            ))
        }
    };
    let named = served.check(model)?;
    if request.get("background").and_then(Value::as_bool) == Some(true) {
        return Err(bad(
            "background: kvlb replica answers every response in its connection; background \
             mode is not supported",
            Some("background"),
        ));
    }
    let store = match request.get("store") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(bad(
                format!("store: expected a boolean, got {}", openai::type_name(v)),
                Some("store"),
            ))
        }
    };
    let previous = match request.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => {
            if request
                .get("previous_input_messages")
                .is_some_and(|p| !p.is_null())
            {
                return Err(ApiError {
                    status: 400,
                    kind: "invalid_request_error",
                    message: "Only one of `previous_input_messages` and `previous_response_id` \
                              can be set."
                        .into(),
                    param: Some("previous_response_id"),
                });
            }
            Some(responses.get(id).ok_or_else(|| not_found(id))?)
        }
        Some(v) => {
            return Err(bad(
                format!(
                    "previous_response_id: expected a string, got {}",
                    openai::type_name(v)
                ),
                Some("previous_response_id"),
            ))
        }
    };
    let id = match request.get("request_id") {
        None | Some(Value::Null) => format!("resp_{:032x}", replica.response_random()),
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(_) => return Err(bad("request_id: expected a string", Some("request_id"))),
    };
    let chat = agent::responses_to_chat(
        &Value::Object(request.clone()),
        previous.map(|p| p.turn()).as_ref(),
    )
    .map_err(|e| bad(body_message(e), Some("input")))?;
    let bytes = serde_json::to_vec(&chat).map_err(|e| bad(e.to_string(), None))?;
    let mut parsed = openai::parse_chat(&bytes)?;
    let prompt = parsed.prompts.pop().unwrap_or_default();
    let max_model_len = replica.max_model_len as usize;
    if prompt.len() >= max_model_len {
        return Err(ApiError {
            status: 400,
            kind: "invalid_request_error",
            message: format!(
                "The engine prompt length {} exceeds the max_model_len {max_model_len}. Please \
                 reduce prompt.",
                prompt.len()
            ),
            param: Some("input"),
        });
    }
    // vLLM caps the output at the rest of the context.
    let room = (max_model_len - prompt.len()).min(u32::MAX as usize) as u32;
    let messages = match chat.get("messages") {
        Some(Value::Array(m)) => m.clone(),
        _ => Vec::new(),
    };
    Ok(Prepared {
        model: served.response_name(&named),
        named,
        id,
        messages,
        prompt,
        max_tokens: parsed.max_tokens.min(room),
        limited: chat.get("max_tokens").is_some(),
        cache_salt: parsed.cache_salt,
        stream: parsed.stream,
        store,
        request,
    })
}

/// The message of a conversion error, without the error kind's prefix.
fn body_message(e: crate::tokenize::TokenizeError) -> String {
    match e {
        crate::tokenize::TokenizeError::Body(m) => m,
        other => other.to_string(),
    }
}

/// `POST /v1/responses`.
pub(super) fn create(
    conn: &mut Connection,
    served: &Served,
    responses: &Store,
    replica: &Replica,
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    let p = match prepare(served, responses, replica, body) {
        Ok(p) => p,
        Err(e) => return send_error(conn, &e, keep_alive),
    };
    let created_at = unix_secs();
    let mut gen = match Single::start(
        replica,
        &p.named,
        p.prompt.clone(),
        p.max_tokens,
        p.cache_salt,
        p.stream,
    ) {
        Ok(g) => g,
        Err(e) => return send_error(conn, &e, keep_alive),
    };
    let fields = Fields {
        request: &p.request,
        id: &p.id,
        created_at,
        model: &p.model,
        max_tokens: p.max_tokens,
    };
    let item_id = format!("msg_{:032x}", replica.response_random());
    let store = |response: Value, messages: Vec<Value>| {
        if p.store {
            responses.put(&p.id, Stored { response, messages });
        }
    };
    if p.stream {
        conn.write_all(&http::event_stream_head(keep_alive))?;
        // Stored before the terminal event goes out: a follow-up may come right after it.
        return stream_events(conn, &mut gen, &fields, &item_id, p.limited, |r| {
            store(r.clone(), p.messages.clone())
        });
    }
    let (response, body) = {
        let mut text = String::new();
        while gen.finish.is_none() {
            for t in gen.next(conn)? {
                text.push_str(&t);
            }
        }
        let status = item_status(gen.finish, p.limited);
        let output = vec![message_item(&item_id, &text, status)];
        let response = fields.response(status, output, usage_json(&gen.usage));
        let body = response.to_string();
        (response, body)
    };
    store(response, p.messages.clone());
    send_json(conn, &body, keep_alive)
}

/// Writes vLLM's event sequence for one generation (created, in_progress, the message item's
/// added / content part / text deltas / done events, then completed or incomplete) and returns
/// `on_final` the final response before the terminal event is written. The stream's last chunk
/// ends the body.
fn stream_events(
    conn: &mut Connection,
    gen: &mut Single<'_>,
    fields: &Fields<'_>,
    item_id: &str,
    limited: bool,
    on_final: impl FnOnce(&Value),
) -> io::Result<()> {
    let mut stream = EventStream::default();
    let mut out = Vec::with_capacity(4096);
    let initial = fields.response("in_progress", Vec::new(), Value::Null);
    stream.push(&mut out, "response.created", json!({"response": initial}));
    stream.push(
        &mut out,
        "response.in_progress",
        json!({"response": initial}),
    );
    conn.write_all(&out)?;
    let mut text = String::new();
    while gen.finish.is_none() {
        let tokens = gen.next(conn)?;
        out.clear();
        for t in tokens {
            if text.is_empty() {
                stream.push(
                    &mut out,
                    "response.output_item.added",
                    json!({"item": message_item(item_id, "", "in_progress"), "output_index": 0}),
                );
                stream.push(
                    &mut out,
                    "response.content_part.added",
                    json!({"content_index": 0, "item_id": item_id, "output_index": 0,
                        "part": text_part("", json!([]))}),
                );
            }
            text.push_str(&t);
            stream.push(
                &mut out,
                "response.output_text.delta",
                json!({"content_index": 0, "delta": t, "item_id": item_id, "logprobs": [],
                    "output_index": 0}),
            );
        }
        if !out.is_empty() {
            conn.write_all(&out)?;
        }
    }
    let status = item_status(gen.finish, limited);
    let mut output = Vec::new();
    out.clear();
    if !text.is_empty() {
        stream.push(
            &mut out,
            "response.output_text.done",
            json!({"content_index": 0, "item_id": item_id, "logprobs": [], "output_index": 0,
                "text": text}),
        );
        stream.push(
            &mut out,
            "response.content_part.done",
            json!({"content_index": 0, "item_id": item_id, "output_index": 0,
                "part": text_part(&text, Value::Null)}),
        );
        let item = message_item(item_id, &text, status);
        stream.push(
            &mut out,
            "response.output_item.done",
            json!({"item": item, "output_index": 0}),
        );
        output.push(item);
    }
    let response = fields.response(status, output, usage_json(&gen.usage));
    let terminal = if status == "incomplete" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    on_final(&response);
    stream.push(&mut out, terminal, json!({"response": response}));
    out.extend_from_slice(http::LAST_CHUNK);
    conn.write_all(&out)
}

/// vLLM's `response_item_status`: a response cut by the request's `max_output_tokens`
/// (`limited`) is incomplete; one the replica's default length ended is complete.
fn item_status(finish: Option<FinishReason>, limited: bool) -> &'static str {
    match finish {
        Some(FinishReason::Length) if limited => "incomplete",
        _ => "completed",
    }
}

/// A `ResponseOutputText` part.
fn text_part(text: &str, logprobs: Value) -> Value {
    json!({"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs})
}

/// The assistant's output message item (its text as one part; no part when there is no text).
fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if text.is_empty() {
        json!([])
    } else {
        json!([text_part(text, Value::Null)])
    };
    json!({"id": id, "content": content, "role": "assistant", "status": status,
        "type": "message", "phase": null})
}

/// vLLM's `ResponseUsage` of a single-turn response.
fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0,
            "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
            "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// What every response object of one request shares.
struct Fields<'a> {
    request: &'a Map<String, Value>,
    id: &'a str,
    created_at: u64,
    model: &'a str,
    max_tokens: u32,
}

impl Fields<'_> {
    /// vLLM's `ResponsesResponse.from_request(...)`, dumped as vLLM dumps it (every field, in
    /// its order; `metrics` left out when unset).
    fn response(&self, status: &str, output: Vec<Value>, usage: Value) -> Value {
        let r = self.request;
        let or = |key: &str, default: Value| match r.get(key) {
            None | Some(Value::Null) => default,
            Some(v) => v.clone(),
        };
        let get = |key: &str| or(key, Value::Null);
        let has_tools = r
            .get("tools")
            .and_then(Value::as_array)
            .is_some_and(|t| !t.is_empty());
        // check_tool_usage: without tools, "auto" (the default) and "none" are "none".
        let tool_choice = match or("tool_choice", json!("auto")) {
            Value::String(s) if !has_tools && (s == "auto" || s == "none") => json!("none"),
            other => other,
        };
        let logprobs_asked = r
            .get("include")
            .and_then(Value::as_array)
            .is_some_and(|i| i.iter().any(|v| v == "message.output_text.logprobs"));
        let top_logprobs = if logprobs_asked {
            or("top_logprobs", json!(0))
        } else {
            Value::Null
        };
        let retention = match get("prompt_cache_retention") {
            Value::String(s) if s == "in-memory" => json!("in_memory"),
            other => other,
        };
        let cache_options = match r.get("prompt_cache_options") {
            Some(Value::Object(o)) => json!({
                "mode": o.get("mode").cloned().unwrap_or(json!("implicit")),
                "ttl": o.get("ttl").cloned().unwrap_or(json!("30m")),
                "comparison_response_id": o.get("comparison_response_id").cloned().unwrap_or(Value::Null),
            }),
            _ => Value::Null,
        };
        let incomplete = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        json!({
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": incomplete,
            "instructions": get("instructions"),
            "metadata": get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": or("parallel_tool_calls", json!(true)),
            "temperature": or("temperature", json!(1.0)),
            "tool_choice": tool_choice,
            "tools": or("tools", json!([])),
            "top_p": or("top_p", json!(1.0)),
            "background": false,
            "max_output_tokens": self.max_tokens,
            "max_tool_calls": get("max_tool_calls"),
            "previous_response_id": get("previous_response_id"),
            "prompt": null,
            "prompt_cache_options": cache_options,
            "prompt_cache_key": get("prompt_cache_key"),
            "prompt_cache_retention": retention,
            "reasoning": get("reasoning"),
            "safety_identifier": get("safety_identifier"),
            "service_tier": or("service_tier", json!("auto")),
            "status": status,
            "text": get("text"),
            "top_logprobs": top_logprobs,
            "truncation": or("truncation", json!("disabled")),
            "usage": usage,
            "user": get("user"),
            "presence_penalty": or("presence_penalty", json!(0.0)),
            "frequency_penalty": or("frequency_penalty", json!(0.0)),
            "kv_transfer_params": null,
            "ec_transfer_params": null,
            "input_messages": null,
            "output_messages": null,
        })
    }
}

/// The events of one stream, numbered from 0 as vLLM numbers them.
#[derive(Default)]
struct EventStream {
    sequence: u64,
}

impl EventStream {
    /// Appends event `kind` (`fields` plus `sequence_number` and `type`) as one chunk. The
    /// openai SDK's event models, which vLLM dumps, declare their fields in alphabetical order.
    fn push(&mut self, out: &mut Vec<u8>, kind: &str, fields: Value) {
        let mut pairs: Vec<(String, Value)> = match fields {
            Value::Object(m) => m.into_iter().collect(),
            _ => Vec::new(),
        };
        pairs.push(("sequence_number".into(), self.sequence.into()));
        pairs.push(("type".into(), kind.into()));
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        self.sequence += 1;
        let event: Map<String, Value> = pairs.into_iter().collect();
        http::push_sse_event(out, kind, &Value::Object(event).to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_keeps_the_last_responses() {
        let s = Store::new(2);
        for id in ["a", "b", "c"] {
            s.put(
                id,
                Stored {
                    response: json!({"id": id}),
                    messages: vec![],
                },
            );
        }
        assert!(s.get("a").is_none());
        assert_eq!(s.len(), 2);
        // Replacing keeps one entry.
        s.put(
            "c",
            Stored {
                response: json!({"id": "c", "v": 2}),
                messages: vec![],
            },
        );
        assert_eq!(s.len(), 2);
        assert_eq!(s.get("c").unwrap().response["v"], 2);
        let e = s.retrieve("zz").unwrap_err();
        assert_eq!(e.status, 404);
        assert_eq!(
            serde_json::from_str::<Value>(&e.body()).unwrap(),
            json!({"error": {"message": "Response with id 'zz' not found.", "type": "invalid_request_error", "param": "response_id", "code": 404}})
        );
        let e = s.cancel("b").unwrap_err();
        assert_eq!(
            (e.status, e.message.as_str()),
            (400, "Cannot cancel a synchronous response.")
        );
    }

    #[test]
    fn response_object_in_vllm_order() {
        let request = json!({"input": "x", "instructions": "i", "temperature": 0.2,
            "prompt_cache_retention": "in-memory"});
        let f = Fields {
            request: request.as_object().unwrap(),
            id: "resp_1",
            created_at: 7,
            model: "m",
            max_tokens: 16,
        };
        let r = f.response(
            "incomplete",
            vec![message_item("msg_1", "hi", "incomplete")],
            Value::Null,
        );
        let keys: Vec<&String> = r.as_object().unwrap().keys().collect();
        assert_eq!(
            keys[..8],
            [
                "id",
                "created_at",
                "incomplete_details",
                "instructions",
                "metadata",
                "model",
                "object",
                "output"
            ]
        );
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(
            (r["tool_choice"].as_str(), r["temperature"].as_f64()),
            (Some("none"), Some(0.2))
        );
        assert_eq!(r["prompt_cache_retention"], "in_memory");
        assert_eq!(r["output"][0]["content"][0]["text"], "hi");
        assert!(r.get("metrics").is_none());
        let mut out = Vec::new();
        let mut s = EventStream::default();
        s.push(
            &mut out,
            "response.created",
            json!({"response": {"id": "r"}}),
        );
        s.push(
            &mut out,
            "response.in_progress",
            json!({"response": {"id": "r"}}),
        );
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("event: response.created\ndata: {\"response\":{\"id\":\"r\"},\"sequence_number\":0,\"type\":\"response.created\"}\n\n"), "{text}");
        assert!(text.contains("\"sequence_number\":1,\"type\":\"response.in_progress\""));
        let mut out = Vec::new();
        s.push(&mut out, "response.output_text.done", json!({"text": "t", "content_index": 0, "item_id": "m", "logprobs": [], "output_index": 0}));
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("{\"content_index\":0,\"item_id\":\"m\",\"logprobs\":[],\"output_index\":0,\"sequence_number\":2,\"text\":\"t\",\"type\":\"response.output_text.done\"}"), "{text}");
    }
}
