//! The agent APIs as vLLM 0.33 renders them: an OpenAI Responses request (`POST /v1/responses`)
//! or an Anthropic Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`) becomes
//! the chat completions body whose prompt the engine prefills, so token mode (and the simulated
//! replica) tokenize it with the chat template exactly as for `/v1/chat/completions`.
//!
//! # What vLLM does
//! * Responses ([`responses_to_chat`]): vLLM's `construct_input_messages` (instructions as the
//!   first system message; with `previous_response_id`, the stored conversation without its
//!   system messages and the stored response's output texts as assistant messages; then the new
//!   input, whose items are merged as `_construct_message_from_response_item` does),
//!   `construct_tool_dicts` (function tools, and the function tools of a namespace as
//!   `namespace__name`, and each `custom` tool as a function of one string `input`, in chat
//!   format) and the chat template kwargs of
//!   `ResponsesRequest.build_chat_params` (`add_generation_prompt`, `continue_final_message`
//!   for a partial last assistant message, `reasoning_effort` and `enable_thinking`).
//! * Messages ([`messages_to_chat`]): `AnthropicServingMessages.to_chat_completion_request`:
//!   the system prompt (blocks joined with "", Claude Code's `x-anthropic-billing-header`
//!   blocks dropped; inline system messages merged into it when the template wants the system
//!   prompt first), text/image/thinking/tool_use/tool_result blocks, tools (with
//!   `tool_addition`/`tool_removal` blocks applied) and tool choice, thinking and effort.
//!   A `tool_use` block's arguments are `json.dumps(input)`: Python's separators `", "` and
//!   `": "`, non-ASCII escaped, floats as Python prints them, so the rendered prompt (and its
//!   token ids) equals vLLM's.
//!
//! # The chat body
//! The result is a `/v1/chat/completions` body a vLLM server renders to the same prompt:
//! `messages`, and when the source has them `model`, `tools` (`{"type": "function", "function":
//! {name, description, parameters[, strict][, defer_loading]}}`, as vLLM's `FunctionDefinition`
//! dumps it: a missing description or parameters is `null`), `tool_choice`,
//! `chat_template_kwargs`, `cache_salt`, `stream`, `max_tokens`. The template kwargs vLLM adds
//! itself are given the way the chat path reads them: `add_generation_prompt` and
//! `continue_final_message` at the top level (and removed from `chat_template_kwargs`, where
//! vLLM's own values win), `reasoning_effort` and `enable_thinking` inside
//! `chat_template_kwargs`. Text content parts (`input_text`, `output_text`, `refusal`) are given
//! as chat `text` parts, which is what vLLM's chat parser makes of them, and `input_image`
//! parts as they are (with `detail` defaulted to "auto", as vLLM's request model fills it in);
//! keys of an item that the chat parser drops (`type`, `id`, `status`) are left out. Key order
//! follows vLLM's (the template's `tojson` prints keys in order).
//!
//! # Where this differs from vLLM, on purpose
//! * Input vLLM answers with a 500 (an empty assistant message content list, a refusal as the
//!   first part) is a [`TokenizeError::Body`] here.
//! * A `tool_use` block without an id gets `call_0` (vLLM: `call_` and the Unix time, which no
//!   second renderer can reproduce); Anthropic `thinking.type = "disabled"` maps to
//!   `reasoning_effort = "none"` (vLLM probes the template once and may pick "low").
//!
//! Also here, for the simulated replica's `/detokenize`: [`detokenize`] and [`vocab_size`] of a
//! loaded [`crate::ChatTokenizer`]; and Python's `json.dumps`, `repr(float)` and `str()` of
//! JSON values ([`python_json_dumps`], [`python_float`], [`python_repr`]), which vLLM's
//! conversions print into prompts.
//!
//! Pure: no I/O, no clock.

#![forbid(unsafe_code)]

use crate::TokenizeError;
use serde_json::{json, Map, Value};

/// What a stored response contributes to a follow-up (vLLM's msg_store entry and the response's
/// output items).
#[derive(Debug, Clone, Default)]
pub struct PreviousTurn {
    /// The chat messages the stored request was rendered from (its system message included;
    /// the follow-up drops system messages).
    pub messages: Vec<Value>,
    /// The stored response's `output` items.
    pub output: Vec<Value>,
}

/// Claude Code's attribution header: a system block starting with it is dropped (its per-request
/// hash would defeat prefix caching).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

fn body_err(message: impl Into<String>) -> TokenizeError {
    TokenizeError::Body(message.into())
}

/// A JSON value's type as error messages name it.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// `m[key]` when it is a string; None when absent or null; an error for anything else.
fn opt_str<'a>(
    m: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<&'a str>, TokenizeError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(body_err(format!(
            "{at}{key}: expected a string, got {}",
            type_name(v)
        ))),
    }
}

fn opt_bool(m: &Map<String, Value>, key: &str) -> Result<Option<bool>, TokenizeError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(body_err(format!(
            "{key}: expected a boolean, got {}",
            type_name(v)
        ))),
    }
}

/// A positive integer field (`max_output_tokens`, `max_tokens`).
fn opt_positive(m: &Map<String, Value>, key: &str) -> Result<Option<u64>, TokenizeError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) if v >= 1 => Ok(Some(v)),
            _ => Err(body_err(format!(
                "{key}: must be a positive integer, got {n}"
            ))),
        },
        Some(v) => Err(body_err(format!(
            "{key}: expected an integer, got {}",
            type_name(v)
        ))),
    }
}

fn opt_object<'a>(
    m: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<&'a Map<String, Value>>, TokenizeError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o)),
        Some(v) => Err(body_err(format!(
            "{at}{key}: expected an object, got {}",
            type_name(v)
        ))),
    }
}

/// The request's `chat_template_kwargs`: vLLM refuses a template passed in them unless the
/// server trusts request templates (off by default).
fn template_kwargs(m: &Map<String, Value>) -> Result<Option<Map<String, Value>>, TokenizeError> {
    let kwargs = opt_object(m, "chat_template_kwargs", "")?;
    if kwargs.is_some_and(|k| k.get("chat_template").is_some_and(|t| !t.is_null())) {
        return Err(body_err(
            "Chat template is passed with request, but --trust-request-chat-template is not set. \
             Refused request with untrusted chat template.",
        ));
    }
    Ok(kwargs.cloned())
}

/// `cache_salt` as vLLM validates it: a non-empty string of at most 128 characters without
/// `@`, `/`, `\` or NUL.
fn cache_salt(m: &Map<String, Value>) -> Result<Option<Value>, TokenizeError> {
    match opt_str(m, "cache_salt", "")? {
        None => Ok(None),
        Some(s)
            if !s.is_empty() && s.chars().count() <= 128 && !s.contains(['@', '/', '\\', '\0']) =>
        {
            Ok(Some(Value::String(s.to_string())))
        }
        Some(_) => Err(body_err(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', \
             '/', '\\\\', or NUL.",
        )),
    }
}

/// vLLM's chat template kwargs for a reasoning effort: `reasoning_effort`, and `enable_thinking`
/// (false for "none") unless the request set it.
fn add_effort(kwargs: &mut Map<String, Value>, effort: Option<&str>, user_set_thinking: bool) {
    let Some(effort) = effort else { return };
    kwargs.insert("reasoning_effort".into(), Value::String(effort.into()));
    if !user_set_thinking {
        kwargs.insert("enable_thinking".into(), Value::Bool(effort != "none"));
    }
}

// ----- Responses ---------------------------------------------------------------------------

/// A Responses request body -> the chat completions body vLLM renders for it
/// (vLLM's construct_input_messages + construct_tool_dicts + chat_template_kwargs).
///
/// `previous` is what the request's `previous_response_id` names (the caller looks it up;
/// vLLM answers 404 for an unknown id).
pub fn responses_to_chat(
    body: &Value,
    previous: Option<&PreviousTurn>,
) -> Result<Value, TokenizeError> {
    let m = body
        .as_object()
        .ok_or_else(|| body_err("request body: expected a JSON object"))?;
    if m.get("prompt").is_some_and(|p| !p.is_null()) {
        return Err(body_err("prompt template is not supported"));
    }
    let store = opt_bool(m, "store")?.unwrap_or(true);
    if opt_bool(m, "background")?.unwrap_or(false) && !store {
        return Err(body_err("background can only be used when `store` is true"));
    }
    let instructions = opt_str(m, "instructions", "")?;
    let input = match m.get("input") {
        None | Some(Value::Null) => return Err(body_err("input: Field required")),
        Some(v @ (Value::String(_) | Value::Array(_))) => v,
        Some(v) => {
            return Err(body_err(format!(
                "input: expected a string or a list of items, got {}",
                type_name(v)
            )))
        }
    };
    let tools: &[Value] = match m.get("tools") {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(body_err(format!(
                "tools: expected a list, got {}",
                type_name(v)
            )))
        }
    };
    let tool_choice = responses_tool_choice(m.get("tool_choice"), tools)?;
    let chat_tools = responses_tools(tools)?;

    // construct_input_messages
    let mut messages: Vec<Value> = Vec::new();
    if let Some(text) = instructions.filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": text}));
    }
    if let Some(prev) = previous {
        // Instructions do not carry over: the stored system messages are left out.
        messages.extend(
            prev.messages
                .iter()
                .filter(|msg| msg.get("role").and_then(Value::as_str) != Some("system"))
                .cloned(),
        );
        // Only the output messages' texts; reasoning and tool calls are not carried over.
        for item in &prev.output {
            if item.get("type").and_then(Value::as_str) != Some("message") {
                continue;
            }
            let Some(Value::Array(parts)) = item.get("content") else {
                continue;
            };
            for part in parts {
                if let Some(text) = part.get("text").and_then(Value::as_str) {
                    messages.push(json!({"role": "assistant", "content": text}));
                }
            }
        }
    }
    let mut continue_final = false;
    match input {
        Value::String(s) => messages.push(json!({"role": "user", "content": s})),
        Value::Array(items) => {
            messages.extend(input_items(items)?);
            continue_final = items.last().is_some_and(is_partial);
        }
        _ => {}
    }

    // chat_template_kwargs: the request's, with vLLM's own reasoning kwargs.
    let user_kwargs = template_kwargs(m)?;
    let user_set_thinking = user_kwargs
        .as_ref()
        .is_some_and(|k| k.contains_key("enable_thinking"));
    let effort = match opt_object(m, "reasoning", "")? {
        Some(r) => opt_str(r, "effort", "reasoning.")?,
        None => None,
    };
    let had_kwargs = user_kwargs.is_some();
    let mut kwargs = user_kwargs.unwrap_or_default();
    kwargs.remove("add_generation_prompt");
    kwargs.remove("continue_final_message");
    add_effort(&mut kwargs, effort, user_set_thinking);

    let mut chat = Map::new();
    if let Some(model) = opt_str(m, "model", "")? {
        chat.insert("model".into(), Value::String(model.into()));
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(t) = chat_tools {
        chat.insert("tools".into(), Value::Array(t));
    }
    chat.insert("tool_choice".into(), tool_choice);
    if continue_final {
        chat.insert("add_generation_prompt".into(), Value::Bool(false));
        chat.insert("continue_final_message".into(), Value::Bool(true));
    }
    if had_kwargs || !kwargs.is_empty() {
        chat.insert("chat_template_kwargs".into(), Value::Object(kwargs));
    }
    if let Some(salt) = cache_salt(m)? {
        chat.insert("cache_salt".into(), salt);
    }
    if let Some(stream) = opt_bool(m, "stream")? {
        chat.insert("stream".into(), Value::Bool(stream));
    }
    if let Some(n) = opt_positive(m, "max_output_tokens")? {
        chat.insert("max_tokens".into(), n.into());
    }
    Ok(Value::Object(chat))
}

/// vLLM's `should_continue_final_message`: the last input item is a message or reasoning item
/// left `in_progress` or `incomplete`, which the model continues instead of answering.
fn is_partial(item: &Value) -> bool {
    let Some(o) = item.as_object() else {
        return false;
    };
    let kind = o.get("type").and_then(Value::as_str).unwrap_or("message");
    matches!(kind, "message" | "reasoning")
        && matches!(
            o.get("status").and_then(Value::as_str),
            Some("in_progress" | "incomplete")
        )
}

/// `namespace__name`, vLLM's flat name of a namespaced tool.
fn flat_name(namespace: &str, name: &str) -> String {
    format!("{namespace}__{name}")
}

/// One Responses function tool (or a namespace's) as vLLM's `FunctionDefinition` dumps it.
fn chat_function(
    tool: &Map<String, Value>,
    name: String,
    at: &str,
) -> Result<Value, TokenizeError> {
    let mut f = Map::new();
    f.insert("name".into(), Value::String(name));
    let description = opt_str(tool, "description", at)?;
    f.insert(
        "description".into(),
        description.map_or(Value::Null, |d| Value::String(d.into())),
    );
    let parameters = opt_object(tool, "parameters", at)?;
    f.insert(
        "parameters".into(),
        parameters.map_or(Value::Null, |p| Value::Object(p.clone())),
    );
    for key in ["strict", "defer_loading"] {
        if let Some(b) = opt_bool(tool, key).map_err(|e| prefixed(e, at))? {
            f.insert(key.into(), Value::Bool(b));
        }
    }
    Ok(json!({"type": "function", "function": f}))
}

fn prefixed(e: TokenizeError, at: &str) -> TokenizeError {
    match e {
        TokenizeError::Body(m) => TokenizeError::Body(format!("{at}{m}")),
        other => other,
    }
}

/// vLLM's `construct_tool_dicts`: None without tools; else the function tools (and the function
/// tools of namespaces) in chat format, other tool types (web search, MCP, ...) left out.
fn responses_tools(tools: &[Value]) -> Result<Option<Vec<Value>>, TokenizeError> {
    if tools.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}].");
        let t = tool
            .as_object()
            .ok_or_else(|| body_err(format!("tools[{i}]: expected an object")))?;
        let kind = opt_str(t, "type", &at)?
            .ok_or_else(|| body_err(format!("tools[{i}].type: Field required")))?;
        match kind {
            "function" => {
                let name = opt_str(t, "name", &at)?
                    .ok_or_else(|| body_err(format!("tools[{i}].name: Field required")))?;
                out.push(chat_function(t, name.to_string(), &at)?);
            }
            "namespace" => {
                let ns = opt_str(t, "name", &at)?
                    .ok_or_else(|| body_err(format!("tools[{i}].name: Field required")))?;
                let inner = match t.get("tools") {
                    Some(Value::Array(a)) => a,
                    _ => return Err(body_err(format!("tools[{i}].tools: expected a list"))),
                };
                for (j, sub) in inner.iter().enumerate() {
                    let at = format!("tools[{i}].tools[{j}].");
                    let s = sub.as_object().ok_or_else(|| {
                        body_err(format!("tools[{i}].tools[{j}]: expected an object"))
                    })?;
                    if opt_str(s, "type", &at)? != Some("function") {
                        continue;
                    }
                    let name = opt_str(s, "name", &at)?.ok_or_else(|| {
                        body_err(format!("tools[{i}].tools[{j}].name: Field required"))
                    })?;
                    out.push(chat_function(s, flat_name(ns, name), &at)?);
                }
            }
            // custom_tool_as_function_dict: a one-string function shim.
            "custom" => {
                let name = opt_str(t, "name", &at)?
                    .ok_or_else(|| body_err(format!("tools[{i}].name: Field required")))?;
                let mut shim = Map::new();
                if let Some(d) = opt_str(t, "description", &at)? {
                    shim.insert("description".into(), Value::String(d.into()));
                }
                shim.insert("parameters".into(), custom_tool_parameters());
                out.push(chat_function(&shim, name.to_string(), &at)?);
            }
            _ => {}
        }
    }
    Ok(Some(out))
}

/// vLLM's `custom_tool_parameters`: the schema of the function a `custom` tool is shown as.
fn custom_tool_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "input": {"type": "string", "description": "The freeform text payload for this tool."}
        },
        "required": ["input"],
        "additionalProperties": false
    })
}

/// vLLM's `check_tool_usage`, then the chat form of the choice: "auto" and "none" become
/// "none" without tools, "required" or a named tool without tools is an error, a named tool is
/// resolved to its `namespace__name` and given as `{"type": "function", "function": {name}}`.
fn responses_tool_choice(choice: Option<&Value>, tools: &[Value]) -> Result<Value, TokenizeError> {
    let not_found = || body_err("Tool choice 'function' not found in 'tools' parameter.");
    let choice = match choice {
        None | Some(Value::Null) => Value::String("auto".into()),
        Some(v) => v.clone(),
    };
    let named = choice
        .get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| t == "function" || t == "custom");
    match &choice {
        Value::String(s) if !matches!(s.as_str(), "auto" | "none" | "required") => {
            return Err(body_err(format!(
                "tool_choice: expected \"auto\", \"none\", \"required\" or an object, got {s:?}"
            )))
        }
        Value::String(_) | Value::Object(_) => {}
        v => {
            return Err(body_err(format!(
                "tool_choice: expected a string or an object, got {}",
                type_name(v)
            )))
        }
    }
    if tools.is_empty() {
        return match choice.as_str() {
            Some("auto" | "none") => Ok(Value::String("none".into())),
            Some(_) => Err(body_err(
                "Tool choice 'required' must be specified with 'tools' parameter.",
            )),
            None if named => Err(not_found()),
            None => Ok(choice),
        };
    }
    if !named {
        return Ok(choice);
    }
    let name = choice
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(not_found)?;
    // _resolve_named_tool_choice
    let mut exact: Vec<String> = Vec::new();
    let mut local: Vec<(String, String)> = Vec::new();
    for tool in tools {
        if tool.get("type").and_then(Value::as_str) == Some("namespace") {
            let (Some(ns), Some(Value::Array(inner))) =
                (tool.get("name").and_then(Value::as_str), tool.get("tools"))
            else {
                // vLLM gives up resolving and keeps the name as it is.
                exact.push(name.to_string());
                continue;
            };
            for sub in inner {
                if let Some(n) = sub.get("name").and_then(Value::as_str) {
                    exact.push(flat_name(ns, n));
                    local.push((n.to_string(), flat_name(ns, n)));
                }
            }
        } else if let Some(n) = tool.get("name").and_then(Value::as_str) {
            exact.push(n.to_string());
        }
    }
    let resolved = if exact.iter().any(|n| n == name) {
        name.to_string()
    } else {
        let candidates: Vec<&String> = local
            .iter()
            .filter(|(l, _)| l == name)
            .map(|(_, flat)| flat)
            .collect();
        match candidates.as_slice() {
            [one] => (*one).clone(),
            [] => return Err(not_found()),
            many => {
                let list: Vec<&str> = many.iter().map(|s| s.as_str()).collect();
                return Err(body_err(format!(
                    "Tool choice '{name}' is ambiguous: it is defined in more than one namespace \
                     ({}). Select it by its full '<namespace>__<name>' name.",
                    list.join(", ")
                )));
            }
        }
    };
    Ok(json!({"type": "function", "function": {"name": resolved}}))
}

/// Content parts as vLLM's chat parser reads them: text-like parts become `text` parts,
/// `input_image` keeps its type and gets `detail: "auto"` when it has none (as vLLM's request
/// model fills it in); other parts stay as they are.
fn normalize_parts(content: &Value) -> Value {
    let Value::Array(parts) = content else {
        return content.clone();
    };
    Value::Array(
        parts
            .iter()
            .map(|part| {
                let kind = part.get("type").and_then(Value::as_str);
                match kind {
                    Some("input_text" | "output_text" | "text") => {
                        match part.get("text").and_then(Value::as_str) {
                            Some(t) => json!({"type": "text", "text": t}),
                            None => part.clone(),
                        }
                    }
                    Some("refusal") => match part.get("refusal").and_then(Value::as_str) {
                        Some(t) => json!({"type": "text", "text": t}),
                        None => part.clone(),
                    },
                    // Kept as it is, with the model's default detail: the chat parser
                    // reads `input_image` itself and hands `detail` to the template.
                    Some("input_image") => {
                        let mut p = Map::new();
                        let detail = part.get("detail").cloned().unwrap_or(json!("auto"));
                        p.insert("detail".into(), detail);
                        if let Some(o) = part.as_object() {
                            for (k, v) in o {
                                if k != "detail" {
                                    p.insert(k.clone(), v.clone());
                                }
                            }
                        }
                        Value::Object(p)
                    }
                    _ => part.clone(),
                }
            })
            .collect(),
    )
}

fn is_assistant(msg: Option<&Value>) -> bool {
    msg.and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        .is_some_and(|r| r == "assistant")
}

/// `key` of the previous message is unset (absent or null): vLLM merges into it then.
fn unset(msg: &Value, key: &str) -> bool {
    msg.get(key).is_none_or(Value::is_null)
}

/// vLLM's `construct_chat_messages_with_tool_call`: each item becomes a message or is merged
/// into the previous assistant message (tool calls, reasoning, content), within this input only.
fn input_items(items: &[Value]) -> Result<Vec<Value>, TokenizeError> {
    let mut out: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}].");
        let o = item.as_object().ok_or_else(|| {
            body_err(format!(
                "input[{i}]: expected an object, got {}",
                type_name(item)
            ))
        })?;
        let kind = o.get("type").and_then(Value::as_str);
        let prev_assistant = is_assistant(out.last());

        // Function and custom tool calls: into the previous assistant message's tool_calls.
        let tool_call = match kind {
            Some("function_call") => {
                let field = |key: &str| {
                    opt_str(o, key, &at)?
                        .ok_or_else(|| body_err(format!("{at}{key}: Field required")))
                };
                let (name, arguments, call_id) =
                    (field("name")?, field("arguments")?, field("call_id")?);
                let name = match opt_str(o, "namespace", &at)?.filter(|n| !n.is_empty()) {
                    Some(ns) => flat_name(ns, name),
                    None => name.to_string(),
                };
                Some(
                    json!({"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}),
                )
            }
            Some("custom_tool_call") => {
                let call_id = opt_str(o, "call_id", &at)?
                    .ok_or_else(|| body_err(format!("{at}call_id: Field required")))?;
                let name = opt_str(o, "name", &at)?
                    .ok_or_else(|| body_err(format!("{at}name: Field required")))?;
                let input = opt_str(o, "input", &at)?
                    .ok_or_else(|| body_err(format!("{at}input: Field required")))?;
                let arguments = python_json_dumps(&json!({"input": input}), false);
                Some(
                    json!({"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}),
                )
            }
            _ => None,
        };
        if let Some(call) = tool_call {
            if prev_assistant {
                if let Some(prev) = out.last_mut().and_then(Value::as_object_mut) {
                    match prev.get_mut("tool_calls") {
                        None | Some(Value::Null) => {
                            prev.insert("tool_calls".into(), Value::Array(vec![call]));
                            continue;
                        }
                        Some(Value::Array(calls)) => {
                            calls.push(call);
                            continue;
                        }
                        // An unknown tool_calls shape: a new assistant message (vLLM warns).
                        Some(_) => {}
                    }
                }
            }
            out.push(json!({"role": "assistant", "tool_calls": [call]}));
            continue;
        }

        match kind {
            Some("reasoning") => {
                if o.get("encrypted_content").is_some_and(|e| !e.is_null()) {
                    return Err(body_err("Encrypted content is not supported."));
                }
                let summary = match o.get("summary") {
                    Some(Value::Array(s)) => s,
                    _ => return Err(body_err(format!("{at}summary: expected a list"))),
                };
                let first_text = |parts: &[Value], what: &str| -> Result<String, TokenizeError> {
                    match parts[0].get("text") {
                        Some(Value::String(t)) => Ok(t.clone()),
                        _ => Err(body_err(format!("{at}{what}[0].text: expected a string"))),
                    }
                };
                let reasoning = match o.get("content") {
                    Some(Value::Array(c)) if !c.is_empty() => first_text(c, "content")?,
                    None | Some(Value::Null) | Some(Value::Array(_)) if !summary.is_empty() => {
                        first_text(summary, "summary")?
                    }
                    None | Some(Value::Null) | Some(Value::Array(_)) => String::new(),
                    Some(v) => {
                        return Err(body_err(format!(
                            "{at}content: expected a list, got {}",
                            type_name(v)
                        )))
                    }
                };
                if prev_assistant {
                    if let Some(prev) = out.last_mut().and_then(Value::as_object_mut) {
                        if prev.get("reasoning").is_none_or(Value::is_null) {
                            prev.insert("reasoning".into(), Value::String(reasoning));
                            continue;
                        }
                    }
                }
                out.push(json!({"role": "assistant", "reasoning": reasoning}));
            }
            Some("function_call_output" | "custom_tool_call_output") => {
                let content = o.get("output").map_or(Value::Null, normalize_parts);
                let call_id = o.get("call_id").cloned().unwrap_or(Value::Null);
                out.push(json!({"role": "tool", "content": content, "tool_call_id": call_id}));
            }
            _ if o.get("role").and_then(Value::as_str) == Some("assistant") => {
                // Without `type: "message"` only an easy message (input parts) fits: output
                // parts need an output message.
                if kind.is_none() {
                    if let Some(Value::Array(parts)) = o.get("content") {
                        for (j, part) in parts.iter().enumerate() {
                            let t = part.get("type").and_then(Value::as_str);
                            if !matches!(t, Some("input_text" | "input_image" | "input_file")) {
                                return Err(body_err(format!(
                                    "{at}content[{j}]: an assistant item without type \
                                     \"message\" takes input_text, input_image or input_file \
                                     parts"
                                )));
                            }
                        }
                    }
                }
                // An output message (or an easy assistant message): its first part's text.
                let text = match o.get("content") {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Array(parts)) if !parts.is_empty() => match parts[0].get("text") {
                        Some(Value::String(t)) => Some(t.clone()),
                        _ if kind == Some("message") => {
                            return Err(body_err(format!(
                                "{at}content[0]: an assistant message's first part must be \
                                     output_text with a text"
                            )))
                        }
                        _ => None,
                    },
                    Some(Value::Array(_)) if kind == Some("message") => {
                        return Err(body_err(format!(
                            "{at}content: an assistant message needs at least one part"
                        )))
                    }
                    _ => None,
                };
                match text {
                    Some(text) => {
                        if prev_assistant {
                            if let Some(prev) = out.last_mut() {
                                if unset(prev, "content") {
                                    if let Some(p) = prev.as_object_mut() {
                                        p.insert("content".into(), Value::String(text));
                                    }
                                    continue;
                                }
                            }
                        }
                        out.push(json!({"role": "assistant", "content": text}));
                    }
                    None => out.push(chat_message(o, &at)?),
                }
            }
            _ if o.contains_key("role") => out.push(chat_message(o, &at)?),
            _ => {
                let shown = match o.get("type") {
                    Some(Value::String(s)) => s.clone(),
                    _ => "None".into(),
                };
                return Err(body_err(format!("Unsupported input item type: {shown}")));
            }
        }
    }
    Ok(out)
}

/// An input message item as the chat message vLLM's parser makes of it: role, content (text
/// parts normalized) and name.
fn chat_message(o: &Map<String, Value>, at: &str) -> Result<Value, TokenizeError> {
    let role =
        opt_str(o, "role", at)?.ok_or_else(|| body_err(format!("{at}role: Field required")))?;
    let mut msg = Map::new();
    msg.insert("role".into(), Value::String(role.into()));
    match o.get("content") {
        None | Some(Value::Null) => {}
        Some(c @ (Value::String(_) | Value::Array(_))) => {
            msg.insert("content".into(), normalize_parts(c));
        }
        Some(v) => {
            return Err(body_err(format!(
                "{at}content: expected a string or a list of parts, got {}",
                type_name(v)
            )))
        }
    }
    if let Some(Value::String(name)) = o.get("name") {
        msg.insert("name".into(), Value::String(name.clone()));
    }
    Ok(Value::Object(msg))
}

// ----- Anthropic Messages ------------------------------------------------------------------

/// Block types vLLM's `AnthropicContentBlock` accepts.
const BLOCK_TYPES: [&str; 9] = [
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
];

/// Checks a content list (`at` names it in errors): objects of a known type, with the field
/// types vLLM's model requires; tool changes only where `changes_allowed`.
fn check_blocks(blocks: &[Value], at: &str, changes_allowed: bool) -> Result<(), TokenizeError> {
    for (j, block) in blocks.iter().enumerate() {
        let here = format!("{at}[{j}].");
        let b = block.as_object().ok_or_else(|| {
            body_err(format!(
                "{at}[{j}]: expected an object, got {}",
                type_name(block)
            ))
        })?;
        let kind = opt_str(b, "type", &here)?
            .ok_or_else(|| body_err(format!("{here}type: Field required")))?;
        if !BLOCK_TYPES.contains(&kind) {
            return Err(body_err(format!(
                "{here}type: expected one of {}, got {kind:?}",
                BLOCK_TYPES.join(", ")
            )));
        }
        for key in [
            "text",
            "id",
            "tool_use_id",
            "name",
            "thinking",
            "signature",
            "data",
            "tool_name",
        ] {
            opt_str(b, key, &here)?;
        }
        opt_object(b, "input", &here)?;
        opt_object(b, "source", &here)?;
        match b.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(items)) => {
                if let Some(k) = items.iter().position(|i| !i.is_object()) {
                    return Err(body_err(format!("{here}content[{k}]: expected an object")));
                }
            }
            Some(v) => {
                return Err(body_err(format!(
                    "{here}content: expected a string or a list, got {}",
                    type_name(v)
                )))
            }
        }
        if matches!(kind, "tool_addition" | "tool_removal") {
            if !changes_allowed {
                return Err(body_err(format!(
                    "{kind} blocks are only allowed in messages with role \"system\""
                )));
            }
            let tool = opt_object(b, "tool", &here)?
                .ok_or_else(|| body_err(format!("tool is required for {kind} blocks")))?;
            match tool.get("type").and_then(Value::as_str) {
                Some("tool_reference") => {
                    opt_str(tool, "name", &here)?
                        .ok_or_else(|| body_err(format!("{here}tool.name: Field required")))?;
                }
                Some("tool_definition") if kind == "tool_addition" => {
                    let def = opt_object(tool, "definition", &here)?.ok_or_else(|| {
                        body_err(format!("{here}tool.definition: Field required"))
                    })?;
                    check_tool(def, &format!("{here}tool.definition."))?;
                }
                _ if kind == "tool_removal" => {
                    return Err(body_err("tool_removal only accepts a tool_reference"))
                }
                _ => {
                    return Err(body_err(format!(
                        "{here}tool.type: expected tool_reference or tool_definition"
                    )))
                }
            }
        }
    }
    Ok(())
}

/// Checks an Anthropic tool definition (`name`, `input_schema`, optional description, strict,
/// defer_loading).
fn check_tool(t: &Map<String, Value>, at: &str) -> Result<(), TokenizeError> {
    opt_str(t, "name", at)?.ok_or_else(|| body_err(format!("{at}name: Field required")))?;
    opt_str(t, "description", at)?;
    match t.get("input_schema") {
        Some(Value::Object(_)) => {}
        None => return Err(body_err(format!("{at}input_schema: Field required"))),
        Some(_) => return Err(body_err("input_schema must be a dictionary")),
    }
    for key in ["strict", "defer_loading"] {
        opt_bool(t, key).map_err(|e| prefixed(e, at))?;
    }
    Ok(())
}

/// An Anthropic image source as a URL: the URL itself, else a base64 data URI.
fn image_url(source: &Value) -> String {
    if source.get("type").and_then(Value::as_str) == Some("url") {
        return source
            .get("url")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
    }
    let media = source
        .get("media_type")
        .and_then(Value::as_str)
        .unwrap_or("image/jpeg");
    let data = source.get("data").and_then(Value::as_str).unwrap_or("");
    format!("data:{media};base64,{data}")
}

/// Python truthiness of a JSON value (`if x:`).
fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// A text block's text, when it counts for a system prompt (non-empty, not the billing header).
fn system_block_text(block: &Value) -> Option<&str> {
    if block.get("type").and_then(Value::as_str) != Some("text") {
        return None;
    }
    block
        .get("text")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
}

/// vLLM's `_extract_system_text` of a system-role message.
fn system_text(content: &Value) -> Option<String> {
    match content {
        Value::String(s) if s.starts_with(BILLING_HEADER) => None,
        Value::String(s) => Some(s.clone()),
        Value::Array(blocks) => {
            let parts: Vec<&str> = blocks.iter().filter_map(system_block_text).collect();
            (!parts.is_empty()).then(|| parts.concat())
        }
        _ => None,
    }
}

/// An Anthropic Messages body -> the chat completions body vLLM renders for it
/// (AnthropicServingMessages.to_chat_completion_request).
///
/// `merge_inline_system`: the chat template wants the system prompt first
/// ([`template_needs_system_first`]), so system messages inside `messages` are merged into the
/// leading one. `max_tokens` is required, as `AnthropicMessagesRequest` requires it (a
/// `/v1/messages/count_tokens` body goes through [`count_tokens_to_chat`]).
pub fn messages_to_chat(body: &Value, merge_inline_system: bool) -> Result<Value, TokenizeError> {
    convert_messages(body, merge_inline_system, true)
}

/// As [`messages_to_chat`] for a `/v1/messages/count_tokens` body
/// (`AnthropicCountTokensRequest`): `max_tokens` is checked when given, not required.
pub fn count_tokens_to_chat(
    body: &Value,
    merge_inline_system: bool,
) -> Result<Value, TokenizeError> {
    convert_messages(body, merge_inline_system, false)
}

fn convert_messages(
    body: &Value,
    merge_inline_system: bool,
    needs_max_tokens: bool,
) -> Result<Value, TokenizeError> {
    let m = body
        .as_object()
        .ok_or_else(|| body_err("request body: expected a JSON object"))?;
    let model = match m.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => return Err(body_err("model: Model is required")),
        None | Some(Value::Null) => return Err(body_err("model: Field required")),
        Some(v) => {
            return Err(body_err(format!(
                "model: expected a string, got {}",
                type_name(v)
            )))
        }
    };
    let msgs = match m.get("messages") {
        Some(Value::Array(a)) => a,
        None | Some(Value::Null) => return Err(body_err("messages: Field required")),
        Some(v) => {
            return Err(body_err(format!(
                "messages: expected a list, got {}",
                type_name(v)
            )))
        }
    };
    for (i, msg) in msgs.iter().enumerate() {
        let o = msg.as_object().ok_or_else(|| {
            body_err(format!(
                "messages[{i}]: expected an object, got {}",
                type_name(msg)
            ))
        })?;
        let role = opt_str(o, "role", &format!("messages[{i}]."))?
            .ok_or_else(|| body_err(format!("messages[{i}].role: Field required")))?;
        if !matches!(role, "user" | "assistant" | "system") {
            return Err(body_err(format!(
                "messages[{i}].role: expected 'user', 'assistant' or 'system', got {role:?}"
            )));
        }
        match o.get("content") {
            Some(Value::String(_)) => {}
            Some(Value::Array(blocks)) => {
                check_blocks(blocks, &format!("messages[{i}].content"), role == "system")?
            }
            None => return Err(body_err(format!("messages[{i}].content: Field required"))),
            Some(v) => {
                return Err(body_err(format!(
                    "messages[{i}].content: expected a string or a list of blocks, got {}",
                    type_name(v)
                )))
            }
        }
    }
    let system = match m.get("system") {
        None | Some(Value::Null) => None,
        Some(v @ Value::String(_)) => Some(v),
        Some(v @ Value::Array(blocks)) => {
            check_blocks(blocks, "system", false)?;
            Some(v)
        }
        Some(v) => {
            return Err(body_err(format!(
                "system: expected a string or a list of blocks, got {}",
                type_name(v)
            )))
        }
    };
    let max_tokens = match m.get("max_tokens") {
        None | Some(Value::Null) if needs_max_tokens => {
            return Err(body_err("max_tokens: Field required"))
        }
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) if v > 0 => Some(v),
            _ => return Err(body_err("max_tokens: max_tokens must be positive")),
        },
        Some(v) => {
            return Err(body_err(format!(
                "max_tokens: expected an integer, got {}",
                type_name(v)
            )))
        }
    };

    let mut messages: Vec<Value> = Vec::new();
    // _convert_system_message
    let mut system_parts: Vec<String> = Vec::new();
    match system {
        Some(Value::String(s)) if !s.is_empty() => system_parts.push(s.clone()),
        Some(Value::Array(blocks)) => system_parts.extend(
            blocks
                .iter()
                .filter_map(system_block_text)
                .map(str::to_string),
        ),
        _ => {}
    }
    if merge_inline_system {
        for msg in msgs {
            if msg.get("role").and_then(Value::as_str) != Some("system") {
                continue;
            }
            if let Some(text) = msg.get("content").and_then(system_text) {
                if !text.is_empty() {
                    system_parts.push(text);
                }
            }
        }
    }
    if !system_parts.is_empty() {
        messages.push(json!({"role": "system", "content": system_parts.concat()}));
    }
    // _convert_messages
    for msg in msgs {
        let role = msg.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = msg.get("content").unwrap_or(&Value::Null);
        if role == "system" {
            if merge_inline_system {
                continue;
            }
            if let Some(text) = system_text(content).filter(|t| !t.is_empty()) {
                messages.push(json!({"role": "system", "content": text}));
            }
            continue;
        }
        let mut out = Map::new();
        out.insert("role".into(), Value::String(role.into()));
        match content {
            Value::String(s) => {
                out.insert("content".into(), Value::String(s.clone()));
            }
            Value::Array(blocks) => convert_blocks(blocks, role, &mut out, &mut messages),
            _ => {}
        }
        // A user message left without content (only tool results) is not sent.
        if role != "user" || out.contains_key("content") {
            messages.push(Value::Object(out));
        }
    }

    let mut chat = Map::new();
    chat.insert("model".into(), Value::String(model));
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(n) = max_tokens {
        chat.insert("max_tokens".into(), n.into());
    }
    match m.get("stop_sequences") {
        None | Some(Value::Null) => {}
        Some(Value::Array(stops)) if stops.iter().all(Value::is_string) => {
            chat.insert("stop".into(), Value::Array(stops.clone()));
        }
        Some(_) => return Err(body_err("stop_sequences: expected a list of strings")),
    }
    for key in ["temperature", "top_p", "top_k"] {
        match m.get(key) {
            None | Some(Value::Null) => {}
            Some(v @ Value::Number(_)) => {
                chat.insert(key.into(), v.clone());
            }
            Some(v) => {
                return Err(body_err(format!(
                    "{key}: expected a number, got {}",
                    type_name(v)
                )))
            }
        }
    }
    if let Some(salt) = cache_salt(m)? {
        chat.insert("cache_salt".into(), salt);
    }
    let user_kwargs = template_kwargs(m)?;
    if opt_bool(m, "stream")? == Some(true) {
        chat.insert("stream".into(), Value::Bool(true));
        chat.insert(
            "stream_options".into(),
            json!({"include_usage": true, "continuous_usage_stats": true}),
        );
    }

    // _handle_output_config, then _handle_thinking (a disabled thinking wins over an effort).
    let mut effort: Option<String> = None;
    if let Some(cfg) = opt_object(m, "output_config", "")? {
        if let Some(e) = opt_str(cfg, "effort", "output_config.")? {
            if !matches!(e, "low" | "medium" | "high" | "xhigh" | "max") {
                return Err(body_err(format!(
                    "output_config.effort: expected one of low, medium, high, xhigh, max, got {e:?}"
                )));
            }
            effort = Some(e.to_string());
        }
        if let Some(format) = opt_object(cfg, "format", "output_config.")? {
            if let Some(schema) = opt_object(format, "schema", "output_config.format.")? {
                chat.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}),
                );
            }
        }
    }
    if let Some(thinking) = opt_object(m, "thinking", "")? {
        match opt_str(thinking, "type", "thinking.")? {
            Some("disabled") => effort = Some("none".into()),
            Some("enabled") => {
                let budget = thinking
                    .get("budget_tokens")
                    .and_then(Value::as_i64)
                    .filter(|b| *b >= 1024)
                    .ok_or_else(|| {
                        body_err("thinking.budget_tokens: expected an integer of at least 1024")
                    })?;
                let remote_decode = m
                    .get("kv_transfer_params")
                    .and_then(|k| k.get("do_remote_decode"))
                    .is_some_and(|d| truthy(Some(d)));
                if !remote_decode && max_tokens.is_some_and(|mt| budget >= mt) {
                    return Err(body_err(
                        "thinking.budget_tokens must be less than max_tokens",
                    ));
                }
                chat.insert("thinking_token_budget".into(), budget.into());
            }
            Some("adaptive") => {}
            _ => {
                return Err(body_err(
                    "thinking.type: expected 'enabled', 'disabled' or 'adaptive'",
                ))
            }
        }
    }
    if let Some(e) = &effort {
        chat.insert("reasoning_effort".into(), Value::String(e.clone()));
    }
    let user_set_thinking = user_kwargs
        .as_ref()
        .is_some_and(|k| k.contains_key("enable_thinking"));
    let had_kwargs = user_kwargs.is_some();
    let mut kwargs = user_kwargs.unwrap_or_default();
    add_effort(&mut kwargs, effort.as_deref(), user_set_thinking);
    if had_kwargs || !kwargs.is_empty() {
        chat.insert("chat_template_kwargs".into(), Value::Object(kwargs));
    }

    // _convert_tool_choice
    let mut tool_choice: Option<Value> = None;
    if let Some(tc) = opt_object(m, "tool_choice", "")? {
        let disable_parallel = opt_bool(tc, "disable_parallel_tool_use")?.unwrap_or(false);
        chat.insert("parallel_tool_calls".into(), Value::Bool(!disable_parallel));
        let name = opt_str(tc, "name", "tool_choice.")?;
        tool_choice = Some(match opt_str(tc, "type", "tool_choice.")? {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => match name.filter(|n| !n.is_empty()) {
                Some(n) => json!({"type": "function", "function": {"name": n}}),
                None => return Err(body_err("tool_choice.name is required when type is 'tool'")),
            },
            _ => {
                return Err(body_err(
                    "tool_choice.type: expected 'auto', 'any', 'tool' or 'none'",
                ))
            }
        });
    }
    // _convert_tools
    if let Some(tools) = resolve_tools(m, msgs)? {
        let chat_tools: Vec<Value> = tools
            .iter()
            .map(|t| {
                let mut schema = t
                    .get("input_schema")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                if !schema.contains_key("type") {
                    schema.insert("type".into(), json!("object"));
                }
                let mut f = Map::new();
                f.insert("name".into(), t.get("name").cloned().unwrap_or(Value::Null));
                f.insert(
                    "description".into(),
                    t.get("description").cloned().unwrap_or(Value::Null),
                );
                f.insert("parameters".into(), Value::Object(schema));
                for key in ["strict", "defer_loading"] {
                    if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                        f.insert(key.into(), v.clone());
                    }
                }
                json!({"type": "function", "function": f})
            })
            .collect();
        chat.insert(
            "tool_choice".into(),
            tool_choice.take().unwrap_or_else(|| json!("auto")),
        );
        chat.insert("tools".into(), Value::Array(chat_tools));
    } else if let Some(tc) = tool_choice {
        chat.insert("tool_choice".into(), tc);
    }
    Ok(Value::Object(chat))
}

/// vLLM's `_resolve_tools`: `tools`, with the `tool_addition` / `tool_removal` blocks of the
/// messages applied in order (a tool added by reference is no longer deferred).
fn resolve_tools(
    m: &Map<String, Value>,
    msgs: &[Value],
) -> Result<Option<Vec<Map<String, Value>>>, TokenizeError> {
    let declared: Option<Vec<Map<String, Value>>> = match m.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => {
            let mut tools = Vec::with_capacity(list.len());
            for (i, t) in list.iter().enumerate() {
                let o = t
                    .as_object()
                    .ok_or_else(|| body_err(format!("tools[{i}]: expected an object")))?;
                check_tool(o, &format!("tools[{i}]."))?;
                tools.push(o.clone());
            }
            Some(tools)
        }
        Some(v) => {
            return Err(body_err(format!(
                "tools: expected a list, got {}",
                type_name(v)
            )))
        }
    };
    let changes: Vec<&Map<String, Value>> = msgs
        .iter()
        .filter_map(|msg| msg.get("content").and_then(Value::as_array))
        .flatten()
        .filter_map(Value::as_object)
        .filter(|b| {
            matches!(
                b.get("type").and_then(Value::as_str),
                Some("tool_addition" | "tool_removal")
            )
        })
        .collect();
    if changes.is_empty() {
        return Ok(declared);
    }
    // Insertion-ordered by name, as the Python dict.
    let mut tools: Vec<(String, Map<String, Value>)> = declared
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            let name = t
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            (name, t)
        })
        .collect();
    let mut removed: Vec<String> = Vec::new();
    for block in changes {
        let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
        let Some(change) = block.get("tool").and_then(Value::as_object) else {
            continue;
        };
        let name;
        if change.get("type").and_then(Value::as_str) == Some("tool_definition") {
            let def = change
                .get("definition")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            name = def
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            match tools.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = def,
                None => tools.push((name.clone(), def)),
            }
        } else {
            name = change
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let Some(slot) = tools.iter_mut().find(|(n, _)| *n == name) else {
                return Err(body_err(format!(
                    "{kind} references tool '{name}', which is not declared in tools"
                )));
            };
            if kind == "tool_addition" {
                slot.1.insert("defer_loading".into(), Value::Null);
            }
        }
        if kind == "tool_removal" {
            if !removed.contains(&name) {
                removed.push(name);
            }
        } else {
            removed.retain(|r| *r != name);
        }
    }
    Ok(Some(
        tools
            .into_iter()
            .filter(|(n, _)| !removed.contains(n))
            .map(|(_, t)| t)
            .collect(),
    ))
}

/// vLLM's `_convert_message_content` for one user or assistant message: its blocks into `out`
/// (content, reasoning, tool calls), a user's tool results as tool messages into `messages`
/// (before the message itself, as vLLM appends them).
fn convert_blocks(
    blocks: &[Value],
    role: &str,
    out: &mut Map<String, Value>,
    messages: &mut Vec<Value>,
) {
    let mut parts: Vec<Value> = Vec::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    let mut reasoning: Vec<&str> = Vec::new();
    for block in blocks {
        let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "text" => {
                if let Some(t) = block
                    .get("text")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    parts.push(json!({"type": "text", "text": t}));
                }
            }
            "image" => {
                if let Some(source) = block.get("source").filter(|s| truthy(Some(s))) {
                    parts.push(
                        json!({"type": "image_url", "image_url": {"url": image_url(source)}}),
                    );
                }
            }
            "thinking" => {
                if let Some(t) = block.get("thinking").and_then(Value::as_str) {
                    reasoning.push(t);
                }
            }
            "tool_use" => {
                let id = block
                    .get("id")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                    .unwrap_or("call_0");
                let name = block.get("name").and_then(Value::as_str).unwrap_or("");
                let input = match block.get("input") {
                    Some(v @ Value::Object(o)) if !o.is_empty() => v.clone(),
                    _ => json!({}),
                };
                // Key order of vLLM's validated ChatCompletionMessageToolCallParam.
                tool_calls.push(json!({
                    "id": id,
                    "function": {"arguments": python_json_dumps(&input, true), "name": name},
                    "type": "function",
                }));
            }
            "tool_result" => {
                if role == "user" {
                    user_tool_result(block, messages);
                } else {
                    let text = match block.get("content") {
                        Some(c) if truthy(Some(c)) => match c {
                            Value::String(s) => s.clone(),
                            other => python_repr(other),
                        },
                        _ => String::new(),
                    };
                    parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                }
            }
            // redacted_thinking (opaque), tool_reference, tool_addition, tool_removal.
            _ => {}
        }
    }
    if !reasoning.is_empty() {
        out.insert("reasoning".into(), Value::String(reasoning.concat()));
    }
    if !tool_calls.is_empty() {
        out.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    if !parts.is_empty() {
        let single_text =
            parts.len() == 1 && parts[0].get("type").and_then(Value::as_str) == Some("text");
        let content = if single_text {
            parts[0].get("text").cloned().unwrap_or(Value::Null)
        } else {
            Value::Array(parts)
        };
        out.insert("content".into(), content);
    }
}

/// vLLM's `_convert_user_tool_result`: a tool message with the result's text (text blocks joined
/// with "\n"), then a user message with its images and a tool message with its tool references.
fn user_tool_result(block: &Value, messages: &mut Vec<Value>) {
    let id = block
        .get("tool_use_id")
        .and_then(Value::as_str)
        .unwrap_or("");
    let mut text = String::new();
    let mut images: Vec<String> = Vec::new();
    let mut references: Vec<Value> = Vec::new();
    match block.get("content") {
        Some(Value::String(s)) => text = s.clone(),
        Some(Value::Array(items)) => {
            let mut texts: Vec<&str> = Vec::new();
            for item in items.iter().filter(|i| i.is_object()) {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        texts.push(item.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some("image") => {
                        let source = item.get("source").cloned().unwrap_or_else(|| json!({}));
                        let url = image_url(&source);
                        if !url.is_empty() {
                            images.push(url);
                        }
                    }
                    Some("tool_reference") => {
                        let name = item
                            .get("tool_name")
                            .filter(|n| truthy(Some(n)))
                            .or_else(|| item.get("name"))
                            .and_then(Value::as_str)
                            .filter(|n| !n.is_empty());
                        if let Some(n) = name {
                            references.push(json!({"type": "tool_reference", "name": n}));
                        }
                    }
                    _ => {}
                }
            }
            text = texts.join("\n");
        }
        _ => {}
    }
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !images.is_empty() {
        let parts: Vec<Value> = images
            .into_iter()
            .map(|url| json!({"type": "image_url", "image_url": {"url": url}}))
            .collect();
        messages.push(json!({"role": "user", "content": parts}));
    }
    if !references.is_empty() {
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": references}));
    }
}

/// vLLM's `_detect_merge_inline_system`: renders `[system, user, system, user]` without a
/// generation prompt (and again with an empty tools list, as vLLM checks the tool and non-tool
/// templates); an error, or no template at all, means the template wants the system prompt
/// first, so inline system messages must be merged into it. `render` renders a chat
/// completions body, e.g. `|b| tokenizer.render_chat(b.to_string().as_bytes())`.
///
/// vLLM renders with a bare Jinja environment (no `raise_exception`, no `strftime_now`), so a
/// template that calls them unguarded counts as wanting the system prompt first there; `render`
/// decides here.
pub fn template_needs_system_first(
    render: impl Fn(&Value) -> Result<String, TokenizeError>,
) -> bool {
    let messages = json!([
        {"role": "system", "content": "t"},
        {"role": "user", "content": "t"},
        {"role": "system", "content": "t"},
        {"role": "user", "content": "t"},
    ]);
    let plain = json!({"messages": messages, "add_generation_prompt": false});
    let with_tools = json!({"messages": messages, "add_generation_prompt": false, "tools": []});
    render(&plain).is_err() || render(&with_tools).is_err()
}

/// The text of token ids as vLLM's `/detokenize` gives it: the tokenizer's `decode`, special
/// tokens kept.
pub fn detokenize(tokenizer: &crate::ChatTokenizer, ids: &[u32]) -> Result<String, TokenizeError> {
    tokenizer
        .tokenizer
        .decode(ids, false)
        .map_err(|e| TokenizeError::Tokenizer(e.to_string()))
}

/// The vocabulary size of `tokenizer`, added tokens included (ids at or above it are not ids).
pub fn vocab_size(tokenizer: &crate::ChatTokenizer) -> usize {
    tokenizer.tokenizer.get_vocab_size(true)
}

// ----- Python's json.dumps and repr --------------------------------------------------------

/// `json.dumps(value)` with Python's default separators (`", "`, `": "`), keys in order, floats
/// as Python prints them; `ensure_ascii` escapes every non-ASCII character (`\uXXXX`, surrogate
/// pairs above the BMP), as Python's default does.
pub fn python_json_dumps(value: &Value, ensure_ascii: bool) -> String {
    let mut out = String::new();
    dumps_into(value, ensure_ascii, &mut out);
    out
}

fn dumps_into(value: &Value, ensure_ascii: bool, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&python_number(n)),
        Value::String(s) => json_string(s, ensure_ascii, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dumps_into(item, ensure_ascii, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                json_string(k, ensure_ascii, out);
                out.push_str(": ");
                dumps_into(v, ensure_ascii, out);
            }
            out.push('}');
        }
    }
}

fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A JSON number as Python prints it: integers as they are, floats as `repr(float)`.
fn python_number(n: &serde_json::Number) -> String {
    if n.is_f64() {
        n.as_f64().map_or_else(|| n.to_string(), python_float)
    } else {
        n.to_string()
    }
}

/// `repr(f)`: the shortest digits that read back as `f`, in fixed notation when the decimal
/// exponent is in -4..16 (with a `.0` for integral values), else `d.ddde+XX`.
pub fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-5", "1e16".
    let sci = format!("{f:e}");
    let (sign, rest) = match sci.strip_prefix('-') {
        Some(r) => ("-", r),
        None => ("", sci.as_str()),
    };
    let (mantissa, exp) = rest.split_once('e').unwrap_or((rest, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let mut s = String::from(sign);
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                s.push_str(&digits);
                s.push_str(&"0".repeat(int_len - digits.len()));
                s.push_str(".0");
            } else {
                s.push_str(&digits[..int_len]);
                s.push('.');
                s.push_str(&digits[int_len..]);
            }
        } else {
            s.push_str("0.");
            s.push_str(&"0".repeat((-exp - 1) as usize));
            s.push_str(&digits);
        }
        s
    } else {
        let mut s = String::from(sign);
        s.push_str(&digits[..1]);
        if digits.len() > 1 {
            s.push('.');
            s.push_str(&digits[1..]);
        }
        s.push_str(&format!(
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        ));
        s
    }
}

/// `str(value)` of the Python object `json.loads` would make (dicts and lists printed with
/// their `repr`s): what vLLM puts after "Tool result: " for an assistant's tool result.
pub fn python_repr(value: &Value) -> String {
    let mut out = String::new();
    repr_into(value, &mut out);
    out
}

fn repr_into(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("None"),
        Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Value::Number(n) => {
            let text = python_number(n);
            out.push_str(match text.as_str() {
                "NaN" => "nan",
                "Infinity" => "inf",
                "-Infinity" => "-inf",
                t => t,
            });
        }
        Value::String(s) => repr_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr_into(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr_string(k, out);
                out.push_str(": ");
                repr_into(v, out);
            }
            out.push('}');
        }
    }
}

/// `repr(str)`: single quotes unless the text has one and no double quote; backslash escapes
/// for the quote, `\`, `\n`, `\r`, `\t` and other control characters.
fn repr_string(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) || c == '\u{ad}' => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Value {
        responses_to_chat(&body, None).unwrap()
    }

    fn err(r: Result<Value, TokenizeError>) -> String {
        match r {
            Err(TokenizeError::Body(m)) => m,
            other => panic!("expected a body error, got {other:?}"),
        }
    }

    #[test]
    fn responses_string_input_and_instructions() {
        let c = chat(json!({"model": "m", "input": "hi", "instructions": "Be brief."}));
        assert_eq!(
            c["messages"],
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        );
        assert_eq!(c["model"], "m");
        // No tools: "auto" becomes "none", as vLLM's check_tool_usage does.
        assert_eq!(c["tool_choice"], "none");
        assert!(c.get("tools").is_none() && c.get("chat_template_kwargs").is_none());
        // Empty instructions add nothing.
        let c = chat(json!({"input": "hi", "instructions": ""}));
        assert_eq!(c["messages"], json!([{"role": "user", "content": "hi"}]));
    }

    #[test]
    fn responses_message_items_and_parts() {
        let c = chat(json!({"input": [
            {"type": "message", "role": "developer", "content": "rules"},
            {"role": "user", "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "http://x/y.png", "detail": "auto"}
            ]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
            {"role": "user", "content": "next", "name": "bob"},
        ]}));
        assert_eq!(
            c["messages"],
            json!([
                {"role": "developer", "content": "rules"},
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"detail": "auto", "type": "input_image", "image_url": "http://x/y.png"}
                ]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "next", "name": "bob"},
            ])
        );
    }

    #[test]
    fn responses_only_the_first_part_of_an_assistant_message_counts() {
        let c = chat(json!({"input": [
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "one"}, {"type": "output_text", "text": "two"}
            ]},
        ]}));
        assert_eq!(
            c["messages"],
            json!([{"role": "assistant", "content": "one"}])
        );
        // An empty part list is refused (vLLM fails with a 500).
        let e = err(responses_to_chat(
            &json!({"input": [{"type": "message", "role": "assistant", "content": []}]}),
            None,
        ));
        assert!(e.contains("at least one part"), "{e}");
    }

    #[test]
    fn responses_function_calls_merge_into_the_previous_assistant_message() {
        let c = chat(json!({"input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"a\": 1}"},
            {"type": "function_call", "call_id": "c2", "name": "get", "namespace": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ]}));
        assert_eq!(
            c["messages"],
            json!([
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "reasoning": "think", "tool_calls": [
                    {"id": "c1", "function": {"name": "get", "arguments": "{\"a\": 1}"}, "type": "function"},
                    {"id": "c2", "function": {"name": "w__get", "arguments": "{}"}, "type": "function"},
                ]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                {"role": "tool", "content": [{"type": "text", "text": "rain"}], "tool_call_id": "c2"},
                {"role": "assistant", "content": "Sunny."},
            ])
        );
        // Key order as vLLM builds them (the template's tojson prints keys in order).
        let keys: Vec<&String> = c["messages"][1]["tool_calls"][0]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(keys, ["id", "function", "type"]);
    }

    #[test]
    fn responses_assistant_content_fills_a_message_without_content() {
        let c = chat(json!({"input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"role": "assistant", "content": "done"},
            {"role": "assistant", "content": "again"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
            {"type": "reasoning", "summary": []},
        ]}));
        assert_eq!(
            c["messages"],
            json!([
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"}], "content": "done"},
                {"role": "assistant", "content": "again", "reasoning": "sum"},
                {"role": "assistant", "reasoning": ""},
            ])
        );
        // A custom tool call carries its free-form input as JSON (ensure_ascii off).
        let c = chat(json!({"input": [
            {"type": "custom_tool_call", "call_id": "x", "name": "patch", "input": "é\n"},
            {"type": "custom_tool_call_output", "call_id": "x", "output": "ok"},
        ]}));
        assert_eq!(
            c["messages"][0]["tool_calls"][0]["function"]["arguments"],
            "{\"input\": \"é\\n\"}"
        );
        assert_eq!(
            c["messages"][1],
            json!({"role": "tool", "content": "ok", "tool_call_id": "x"})
        );
    }

    #[test]
    fn responses_errors_as_vllm_raises_them() {
        for (body, wanted) in [
            (
                json!({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zz"}]}),
                "Encrypted content is not supported.",
            ),
            (
                json!({"input": [{"type": "item_reference", "id": "x"}]}),
                "Unsupported input item type: item_reference",
            ),
            (
                json!({"input": [{"content": "no role"}]}),
                "Unsupported input item type: None",
            ),
            (
                json!({"input": "x", "tool_choice": "required"}),
                "Tool choice 'required' must be specified with 'tools' parameter.",
            ),
            (
                json!({"input": "x", "tool_choice": {"type": "function", "name": "f"}}),
                "Tool choice 'function' not found in 'tools' parameter.",
            ),
            (
                json!({"input": "x", "prompt": {"id": "p"}}),
                "prompt template is not supported",
            ),
            (
                json!({"input": "x", "background": true, "store": false}),
                "background can only be used when `store` is true",
            ),
            (
                json!({"input": 5}),
                "input: expected a string or a list of items",
            ),
            (json!({"instructions": "x"}), "input: Field required"),
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (
                json!({"input": "x", "chat_template_kwargs": {"chat_template": "{{x}}"}}),
                "--trust-request-chat-template",
            ),
            (json!({"input": "x", "cache_salt": "a/b"}), "cache_salt"),
            (
                json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input[0].call_id: Field required",
            ),
            (json!({"input": [7]}), "input[0]: expected an object"),
            (json!([1, 2]), "expected a JSON object"),
        ] {
            let e = err(responses_to_chat(&body, None));
            assert!(e.contains(wanted), "{body}: {e}");
        }
    }

    #[test]
    fn responses_tools_in_chat_format() {
        let c = chat(json!({"input": "x", "tools": [
            {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "strict": true},
            {"type": "web_search_preview"},
            {"type": "namespace", "name": "fs", "tools": [
                {"type": "function", "name": "read", "description": "Read a file"},
                {"type": "custom", "name": "skip"},
            ]},
        ]}));
        assert_eq!(
            c["tools"],
            json!([
                {"type": "function", "function": {"name": "get_weather", "description": null, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "strict": true}},
                {"type": "function", "function": {"name": "fs__read", "description": "Read a file", "parameters": null}},
            ])
        );
        // The client's key order survives (the template prints the schema with tojson).
        let keys: Vec<&String> = c["tools"][0]["function"]["parameters"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(keys, ["type", "properties", "required"]);
        assert_eq!(c["tool_choice"], "auto");
        // A named choice resolves to the namespaced name; ambiguity is an error.
        let c = chat(
            json!({"input": "x", "tool_choice": {"type": "function", "name": "read"},
            "tools": [{"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read"}]}]}),
        );
        assert_eq!(
            c["tool_choice"],
            json!({"type": "function", "function": {"name": "fs__read"}})
        );
        let e = err(responses_to_chat(
            &json!({"input": "x", "tool_choice": {"type": "function", "name": "read"},
            "tools": [{"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "read"}]},
                      {"type": "namespace", "name": "b", "tools": [{"type": "function", "name": "read"}]}]}),
            None,
        ));
        assert!(
            e.contains("ambiguous") && e.contains("a__read, b__read"),
            "{e}"
        );
        // Only non-function tools: an empty tools list, as vLLM gives the template.
        let c = chat(json!({"input": "x", "tools": [{"type": "web_search_preview"}]}));
        assert_eq!(c["tools"], json!([]));
    }

    #[test]
    fn responses_previous_turn_and_template_kwargs() {
        let prev = PreviousTurn {
            messages: vec![
                json!({"role": "system", "content": "old rules"}),
                json!({"role": "user", "content": "first"}),
            ],
            output: vec![
                json!({"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hidden"}]}),
                json!({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": "reply", "annotations": []}]}),
            ],
        };
        let c = responses_to_chat(
            &json!({"input": "second", "instructions": "new rules", "max_output_tokens": 7, "stream": true,
                    "cache_salt": "s1", "reasoning": {"effort": "low"},
                    "chat_template_kwargs": {"add_generation_prompt": false, "custom": 1}}),
            Some(&prev),
        )
        .unwrap();
        assert_eq!(
            c["messages"],
            json!([
                {"role": "system", "content": "new rules"},
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "reply"},
                {"role": "user", "content": "second"},
            ])
        );
        assert_eq!(
            (c["max_tokens"].as_u64(), c["stream"].as_bool()),
            (Some(7), Some(true))
        );
        assert_eq!(c["cache_salt"], "s1");
        assert_eq!(
            c["chat_template_kwargs"],
            json!({"custom": 1, "reasoning_effort": "low", "enable_thinking": true})
        );
        assert!(c.get("add_generation_prompt").is_none());
        // A partial last assistant message is continued, not answered.
        let c = chat(json!({"input": [
            {"role": "user", "content": "write"},
            {"type": "message", "role": "assistant", "status": "incomplete", "content": [{"type": "output_text", "text": "Once"}]},
        ]}));
        assert_eq!(
            (
                c["add_generation_prompt"].as_bool(),
                c["continue_final_message"].as_bool()
            ),
            (Some(false), Some(true))
        );
        // "none" turns thinking off unless the request says otherwise.
        let c = chat(
            json!({"input": "x", "reasoning": {"effort": "none"}, "chat_template_kwargs": {"enable_thinking": true}}),
        );
        assert_eq!(
            c["chat_template_kwargs"],
            json!({"enable_thinking": true, "reasoning_effort": "none"})
        );
    }

    fn msgs(body: Value, merge: bool) -> Value {
        messages_to_chat(&body, merge).unwrap()
    }

    #[test]
    fn messages_system_prompt_and_inline_system() {
        let body = json!({"model": "m", "max_tokens": 10,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "You are "}, {"type": "text", "text": "Claude."}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
            {"role": "system", "content": "x-anthropic-billing-header: skip"},
            {"role": "user", "content": "again"},
        ]});
        let c = msgs(body.clone(), false);
        assert_eq!(
            c["messages"],
            json!([
                {"role": "system", "content": "You are Claude."},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "Reminder."},
                {"role": "user", "content": "again"},
            ])
        );
        let c = msgs(body, true);
        assert_eq!(
            c["messages"],
            json!([
                {"role": "system", "content": "You are Claude.Reminder."},
                {"role": "user", "content": "hi"},
                {"role": "user", "content": "again"},
            ])
        );
        assert_eq!(
            (c["model"].as_str(), c["max_tokens"].as_i64()),
            (Some("m"), Some(10))
        );
        assert!(c.get("tools").is_none() && c.get("tool_choice").is_none());
    }

    #[test]
    fn messages_blocks_thinking_tool_use_and_results() {
        let c = msgs(
            json!({"model": "m", "max_tokens": 50, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
                ]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm ", "signature": "s"},
                    {"type": "redacted_thinking", "data": "zz"},
                    {"type": "thinking", "thinking": "ok"},
                    {"type": "text", "text": "Calling."},
                    {"type": "tool_use", "id": "tu1", "name": "get", "input": {"city": "Zürich", "n": 2.5, "big": 1e16, "deep": {"b": [true, null]}}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "tu1", "content": [
                        {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                        {"type": "image", "source": {"type": "url", "url": "http://i"}},
                        {"type": "tool_reference", "tool_name": "more"},
                    ]},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "tu2", "content": "plain"},
                    {"type": "text", "text": "thanks"},
                ]},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text", "text": "it's"}]}]},
            ]}),
            false,
        );
        assert_eq!(
            c["messages"],
            json!([
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
                ]},
                {"role": "assistant", "reasoning": "hmm ok", "tool_calls": [
                    {"id": "tu1", "type": "function", "function": {"name": "get",
                        "arguments": "{\"city\": \"Z\\u00fcrich\", \"n\": 2.5, \"big\": 1e+16, \"deep\": {\"b\": [true, null]}}"}},
                ], "content": "Calling."},
                {"role": "tool", "tool_call_id": "tu1", "content": "a\nb"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://i"}}]},
                {"role": "tool", "tool_call_id": "tu1", "content": [{"type": "tool_reference", "name": "more"}]},
                {"role": "tool", "tool_call_id": "tu2", "content": "plain"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': \"it's\"}]"},
            ])
        );
    }

    #[test]
    fn messages_tools_choice_thinking_and_stream() {
        let c = msgs(
            json!({"model": "m", "max_tokens": 2000, "stream": true, "temperature": 0.5,
                "stop_sequences": ["END"], "cache_salt": "abc",
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "tools": [{"name": "get", "input_schema": {"properties": {"q": {"type": "string"}}}, "strict": true}],
                "messages": [{"role": "user", "content": "hi"}]}),
            false,
        );
        assert_eq!(
            c["tools"],
            json!([{"type": "function", "function": {"name": "get", "description": null,
                "parameters": {"properties": {"q": {"type": "string"}}, "type": "object"}, "strict": true}}])
        );
        let keys: Vec<&String> = c["tools"][0]["function"]["parameters"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(
            keys,
            ["properties", "type"],
            "type is added last, as vLLM's validator does"
        );
        assert_eq!(c["tool_choice"], "auto");
        assert_eq!(
            c["stream_options"],
            json!({"include_usage": true, "continuous_usage_stats": true})
        );
        assert_eq!(
            (c["thinking_token_budget"].as_i64(), c["stop"].clone()),
            (Some(1024), json!(["END"]))
        );
        assert_eq!(
            (c["temperature"].as_f64(), c["cache_salt"].as_str()),
            (Some(0.5), Some("abc"))
        );
        for (choice, wanted) in [
            (json!({"type": "any"}), json!("required")),
            (json!({"type": "none"}), json!("none")),
            (
                json!({"type": "tool", "name": "get", "disable_parallel_tool_use": true}),
                json!({"type": "function", "function": {"name": "get"}}),
            ),
        ] {
            let c = msgs(
                json!({"model": "m", "max_tokens": 5, "tool_choice": choice, "tools": [{"name": "get", "input_schema": {}}],
                "messages": [{"role": "user", "content": "hi"}]}),
                false,
            );
            assert_eq!(c["tool_choice"], wanted);
        }
        let c = msgs(
            json!({"model": "m", "max_tokens": 5, "thinking": {"type": "disabled"}, "output_config": {"effort": "high"},
            "messages": [{"role": "user", "content": "hi"}]}),
            false,
        );
        assert_eq!(c["reasoning_effort"], "none");
        assert_eq!(
            c["chat_template_kwargs"],
            json!({"reasoning_effort": "none", "enable_thinking": false})
        );
    }

    #[test]
    fn messages_tool_changes_apply_in_order() {
        let c = msgs(
            json!({"model": "m", "max_tokens": 5, "tools": [
                    {"name": "a", "input_schema": {"type": "object"}, "defer_loading": true},
                    {"name": "b", "input_schema": {"type": "object"}}],
                "messages": [
                    {"role": "system", "content": [
                        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}},
                        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "b"}},
                        {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {"name": "c", "input_schema": {"type": "object"}}}},
                    ]},
                    {"role": "user", "content": "go"}]}),
            false,
        );
        let names: Vec<&str> = c["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["a", "c"]);
        assert!(
            c["tools"][0]["function"].get("defer_loading").is_none(),
            "{}",
            c["tools"][0]
        );
        let e = err(messages_to_chat(
            &json!({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": [
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "zz"}}]}]}),
            false,
        ));
        assert!(e.contains("not declared in tools"), "{e}");
        let e = err(messages_to_chat(
            &json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "zz"}}]}]}),
            false,
        ));
        assert!(
            e.contains("only allowed in messages with role \"system\""),
            "{e}"
        );
    }

    #[test]
    fn messages_errors() {
        for (body, wanted) in [
            (json!({"messages": []}), "model: Field required"),
            (json!({"model": "", "messages": []}), "Model is required"),
            (json!({"model": "m"}), "messages: Field required"),
            (
                json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": 3}]}),
                "messages[0].content",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_use", "input": [1]}]}]}),
                "input: expected an object",
            ),
            (
                json!({"model": "m", "max_tokens": 0, "messages": []}),
                "max_tokens must be positive",
            ),
            (
                json!({"model": "m", "max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 2000}, "messages": []}),
                "budget_tokens must be less than max_tokens",
            ),
            (
                json!({"model": "m", "tool_choice": {"type": "tool"}, "messages": []}),
                "tool_choice.name is required",
            ),
            (
                json!({"model": "m", "tools": [{"name": "x"}], "messages": []}),
                "input_schema: Field required",
            ),
            (
                json!({"model": "m", "tools": [{"name": "x", "input_schema": 1}], "messages": []}),
                "input_schema must be a dictionary",
            ),
        ] {
            // Checked as count_tokens bodies: max_tokens is not required there.
            let e = err(count_tokens_to_chat(&body, false));
            assert!(e.contains(wanted), "{body}: {e}");
        }
        // /v1/messages requires max_tokens (absent or null), as AnthropicMessagesRequest does.
        for body in [
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            json!({"model": "m", "max_tokens": null, "messages": [{"role": "user", "content": "hi"}]}),
        ] {
            let e = err(messages_to_chat(&body, false));
            assert!(e.contains("max_tokens: Field required"), "{body}: {e}");
            assert!(count_tokens_to_chat(&body, false).is_ok(), "{body}");
        }
    }

    #[test]
    fn python_dumps_and_repr() {
        assert_eq!(
            python_json_dumps(
                &json!({"a": [1, -2, 0.1, 1e-5, 1e22, 123456789.125, -0.0], "é": "\u{1F600}\u{7}\"\\"}),
                true
            ),
            r#"{"a": [1, -2, 0.1, 1e-05, 1e+22, 123456789.125, -0.0], "\u00e9": "\ud83d\ude00\u0007\"\\"}"#
        );
        assert_eq!(python_json_dumps(&json!({"é": 1.0}), false), "{\"é\": 1.0}");
        for (f, py) in [
            (1.0, "1.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (2.5e300, "2.5e+300"),
        ] {
            assert_eq!(python_float(f), py);
        }
        assert_eq!(
            python_repr(&json!([{"k": "it's", "q": "say \"x\"", "n": null, "t": true, "f": 1.5}])),
            r#"[{'k': "it's", 'q': 'say "x"', 'n': None, 't': True, 'f': 1.5}]"#
        );
        assert_eq!(
            python_repr(&json!("both ' and \"\n")),
            r#"'both \' and "\n'"#
        );
    }

    #[test]
    fn system_first_detection() {
        // A template that refuses a system message after the first (Qwen's loop.first guard).
        let strict = |b: &Value| {
            let msgs = b["messages"].as_array().unwrap();
            if msgs.iter().skip(1).any(|m| m["role"] == "system") {
                Err(TokenizeError::Template(
                    "System message must be at the beginning.".into(),
                ))
            } else {
                Ok(String::new())
            }
        };
        assert!(template_needs_system_first(strict));
        assert!(!template_needs_system_first(|_| Ok(String::new())));
        // No template at all: merge, as vLLM does.
        assert!(template_needs_system_first(|_| Err(
            TokenizeError::Template("none configured".into())
        )));
        // Only the tools variant fails: merge.
        assert!(template_needs_system_first(|b| match b.get("tools") {
            Some(_) => Err(TokenizeError::Template("x".into())),
            None => Ok(String::new()),
        }));
    }

    #[test]
    fn system_first_with_real_templates() {
        let tok = crate::ChatTokenizer::from_parts(
            crate::fixture::chatml_tokenizer_json(400).as_bytes(),
            Some(&crate::fixture::chatml_config_json()),
            None,
        )
        .unwrap();
        let render = |b: &Value| tok.render_chat(b.to_string().as_bytes());
        // The fixture's template renders a system message anywhere.
        assert!(!template_needs_system_first(render));
        let strict = crate::ChatTokenizer::from_parts(
            crate::fixture::chatml_tokenizer_json(400).as_bytes(),
            None,
            Some("{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}{{ m.content }}{% endfor %}"),
        )
        .unwrap();
        assert!(template_needs_system_first(
            |b: &Value| strict.render_chat(b.to_string().as_bytes())
        ));
        // The converted body renders with the real renderer, tools and tool calls included.
        let c = msgs(
            json!({"model": "m", "max_tokens": 5, "system": "sys",
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "sunny"}]}]}),
            false,
        );
        let text = tok.render_chat(c.to_string().as_bytes()).unwrap();
        assert!(
            text.starts_with("<|im_start|>system\nsys\n\n# Tools"),
            "{text}"
        );
        assert!(
            text.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "),
            "{text}"
        );
        assert!(
            text.contains("<tool_response>\nsunny\n</tool_response>"),
            "{text}"
        );
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
    }
}
