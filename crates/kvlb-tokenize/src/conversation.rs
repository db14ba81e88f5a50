//! What vLLM 0.33 hands the chat template of a chat completions body, in the "string" content
//! format (vLLM's `parse_chat_messages`, `safe_apply_chat_template`, and transformers'
//! `apply_chat_template`):
//! * each message rebuilt as vLLM's chat parser rebuilds it: `role`; `content` as the texts of
//!   its parts joined by newlines (empty texts and media parts left out, `""` without content);
//!   an assistant's `tool_calls` and, when it has `reasoning`, both `reasoning` and
//!   `reasoning_content`; a tool message's `tool_call_id`; `name` and `task` when strings; a
//!   developer message's `tools`. Other keys are dropped. Claude Code's billing header line is
//!   cut from system texts.
//! * each tool call's `arguments` parsed into an object (`_postprocess_messages`): a JSON
//!   string is decoded, anything that is not a JSON object (invalid JSON, a list, a number, an
//!   empty string, null) becomes `{}`; an empty `tool_calls` list is dropped.
//! * developer messages become system messages (and are merged into one leading system
//!   message) when the template never names the developer role.
//! * the template variables: the request's tools as vLLM's `ChatCompletionToolsParam` dumps
//!   them, then `chat_template_kwargs` (values null or "auto" left out), then the request's
//!   `add_generation_prompt`, `documents`, `reasoning_effort` and, with an effort and no
//!   `enable_thinking` of the client's, `enable_thinking = effort != "none"`.
//!   `continue_final_message` is not a variable: the final message is rendered and the prompt
//!   cut right after its text, as transformers does.

use crate::TokenizeError;
use serde_json::{Map, Value};

fn body_err(message: impl Into<String>) -> TokenizeError {
    TokenizeError::Body(message.into())
}

/// Claude Code's attribution header: its line is cut from system texts.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// transformers' marker appended to the final message for `continue_final_message`.
pub(crate) const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Named parameters of transformers' `apply_chat_template` that a chat template never sees.
const NOT_VARIABLES: [&str; 11] = [
    "chat_template",
    "continue_final_message",
    "tokenize",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

/// One content part's text in the "string" format (`parse_chat_message_content_part`): `None`
/// for a part that adds no text.
fn part_text(part: &Value, at: &str) -> Result<Option<String>, TokenizeError> {
    let text = |key: &str| match part.get(key) {
        Some(Value::String(s)) => Ok(Some(s.clone())),
        None | Some(Value::Null) => Ok(None),
        Some(_) => Err(body_err(format!("{at}.{key}: expected a string"))),
    };
    match part {
        Value::String(s) => Ok(Some(s.clone())),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("text" | "input_text" | "output_text") => text("text"),
            Some("refusal") => text("refusal"),
            Some("thinking") => text("thinking"),
            // A deferred tool's reference is its name, for the template to expand.
            Some("tool_reference") => text("name"),
            // Media: no text of its own in a text model's prompt.
            _ => Ok(None),
        },
        _ => Err(body_err(format!("{at}: expected a string or an object"))),
    }
}

/// `content` in the "string" format: the texts of its parts joined by newlines.
fn content_text(role: &str, content: Option<&Value>, at: &str) -> Result<String, TokenizeError> {
    let parts: Vec<Value> = match content {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![Value::String(s.clone())],
        Some(Value::Array(a)) => a.clone(),
        Some(_) => {
            return Err(body_err(format!(
                "{at}.content: expected a string or a list of parts"
            )))
        }
    };
    let mut texts = Vec::new();
    for (j, part) in parts.iter().enumerate() {
        let Some(mut text) = part_text(part, &format!("{at}.content[{j}]"))? else {
            continue;
        };
        // _strip_claude_code_billing_header (plain and `text` parts): its line goes, and the
        // part with it if that was all.
        let plain = part.is_string() || part.get("type").and_then(Value::as_str) == Some("text");
        if role == "system" && plain && text.starts_with(BILLING_HEADER) {
            text = text
                .split_once('\n')
                .map(|(_, rest)| rest.to_string())
                .unwrap_or_default();
        }
        // Empty texts are skipped (`if parse_res:`).
        if !text.is_empty() {
            texts.push(text);
        }
    }
    Ok(texts.join("\n"))
}

/// vLLM's chat parser on `messages`: the conversation the template renders.
pub(crate) fn parse_messages(messages: &[Value]) -> Result<Vec<Value>, TokenizeError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let m = message
            .as_object()
            .ok_or_else(|| body_err(format!("{at}: expected an object")))?;
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| body_err(format!("{at}.role: expected a string")))?;
        let mut msg = Map::new();
        msg.insert("role".into(), Value::String(role.into()));
        msg.insert(
            "content".into(),
            Value::String(content_text(role, m.get("content"), &at)?),
        );
        match role {
            "assistant" => {
                if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                    msg.insert("tool_calls".into(), calls.clone());
                }
                if let Some(r) = m.get("reasoning").filter(|r| !r.is_null()) {
                    msg.insert("reasoning".into(), r.clone());
                    msg.insert("reasoning_content".into(), r.clone());
                }
            }
            "tool" => {
                if let Some(id) = m.get("tool_call_id") {
                    msg.insert("tool_call_id".into(), id.clone());
                }
            }
            _ => {}
        }
        for key in ["name", "task"] {
            if let Some(v @ Value::String(_)) = m.get(key) {
                msg.insert(key.into(), v.clone());
            }
        }
        if role == "developer" {
            msg.insert(
                "tools".into(),
                m.get("tools").cloned().unwrap_or(Value::Null),
            );
        }
        out.push(Value::Object(msg));
    }
    postprocess(&mut out)?;
    Ok(out)
}

/// `_postprocess_messages`: tool call arguments as objects.
fn postprocess(conversation: &mut [Value]) -> Result<(), TokenizeError> {
    for message in conversation.iter_mut() {
        let Some(m) = message.as_object_mut() else {
            continue;
        };
        if m.get("role").and_then(Value::as_str) != Some("assistant") {
            continue;
        }
        let Some(Value::Array(calls)) = m.get_mut("tool_calls") else {
            continue;
        };
        if calls.is_empty() {
            // Dropped, so the template takes its plain assistant path.
            m.shift_remove("tool_calls");
            continue;
        }
        for call in calls.iter_mut() {
            let Some(c) = call.as_object_mut() else {
                return Err(body_err("assistant tool_calls entries must be objects."));
            };
            let kind = match c.get("type") {
                None => "function",
                Some(Value::String(s)) => s.as_str(),
                Some(_) => "",
            };
            let function_ok = matches!(c.get("function"), Some(Value::Object(_)));
            if kind != "function" || !function_ok {
                return Err(body_err(
                    "chat completions only support assistant tool_calls of type 'function'.",
                ));
            }
            let Some(Value::Object(f)) = c.get_mut("function") else {
                continue;
            };
            let parsed = match f.get("arguments") {
                Some(Value::Object(o)) if !o.is_empty() => Value::Object(o.clone()),
                Some(Value::String(s)) if !s.is_empty() => {
                    match serde_json::from_str::<Value>(s) {
                        Ok(Value::Object(o)) => Value::Object(o),
                        // Invalid JSON, or JSON that is not an object: an empty object.
                        _ => Value::Object(Map::new()),
                    }
                }
                _ => Value::Object(Map::new()),
            };
            f.insert("arguments".into(), parsed);
        }
    }
    Ok(())
}

/// `_convert_developer_to_system` then `_consolidate_system_messages`, for a template that
/// never names the developer role.
pub(crate) fn developer_to_system(conversation: Vec<Value>) -> Vec<Value> {
    let is_role = |m: &Value, r: &str| m.get("role").and_then(Value::as_str) == Some(r);
    if !conversation.iter().any(|m| is_role(m, "developer")) {
        return conversation;
    }
    let converted: Vec<Value> = conversation
        .into_iter()
        .map(|mut m| {
            if is_role(&m, "developer") {
                if let Some(o) = m.as_object_mut() {
                    o.insert("role".into(), Value::String("system".into()));
                    o.shift_remove("tools");
                }
            }
            m
        })
        .collect();
    let mut system = Vec::new();
    let mut rest = Vec::new();
    let mut consolidate = false;
    for (i, m) in converted.iter().enumerate() {
        if is_role(m, "system") {
            if i > 0 || !system.is_empty() {
                consolidate = true;
            }
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| match p {
                        Value::String(s) => Some(s.clone()),
                        Value::Object(o) => o.get("text").and_then(Value::as_str).map(Into::into),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            if !content.is_empty() {
                system.push(content);
            }
        } else {
            rest.push(m.clone());
        }
    }
    if !consolidate {
        return converted;
    }
    let mut out = vec![serde_json::json!({"role": "system", "content": system.join("\n\n")})];
    out.extend(rest);
    out
}

/// A request tool as vLLM's `ChatCompletionToolsParam.model_dump()`: `type`, `function` with
/// `name`, `description` and `parameters` (null when missing), `strict` and `defer_loading`
/// when set, and the tool's own `defer_loading` when set.
fn chat_tool(tool: &Value) -> Value {
    let Some(t) = tool.as_object() else {
        return tool.clone();
    };
    let Some(Value::Object(f)) = t.get("function") else {
        return tool.clone();
    };
    let mut function = Map::new();
    function.insert("name".into(), f.get("name").cloned().unwrap_or(Value::Null));
    for key in ["description", "parameters"] {
        function.insert(key.into(), f.get(key).cloned().unwrap_or(Value::Null));
    }
    let tool_defer = t.get("defer_loading").filter(|v| !v.is_null());
    if let Some(v) = f.get("strict").filter(|v| !v.is_null()) {
        function.insert("strict".into(), v.clone());
    }
    if let Some(v) = f
        .get("defer_loading")
        .filter(|v| !v.is_null())
        .or(tool_defer)
    {
        function.insert("defer_loading".into(), v.clone());
    }
    let mut out = Map::new();
    out.insert(
        "type".into(),
        t.get("type")
            .cloned()
            .unwrap_or_else(|| Value::String("function".into())),
    );
    out.insert("function".into(), Value::Object(function));
    if let Some(v) = tool_defer {
        out.insert("defer_loading".into(), v.clone());
    }
    Value::Object(out)
}

/// The chat template's variables for `request` besides `messages` and the special tokens, in
/// the order they override each other (later wins); and whether the final message is
/// continued.
pub(crate) fn template_variables(
    request: &Map<String, Value>,
) -> Result<(Vec<(String, Value)>, bool), TokenizeError> {
    let unset = |v: &Value| v.is_null() || v.as_str() == Some("auto");
    let mut kwargs: Map<String, Value> = Map::new();
    // Defaults: the request's tools.
    if let Some(Value::Array(tools)) = request.get("tools") {
        kwargs.insert(
            "tools".into(),
            Value::Array(tools.iter().map(chat_tool).collect()),
        );
    }
    // The client's chat_template_kwargs, then vLLM's own.
    let user = match request.get("chat_template_kwargs") {
        Some(Value::Object(k)) => Some(k),
        None | Some(Value::Null) => None,
        Some(_) => return Err(body_err("chat_template_kwargs: expected an object")),
    };
    for (k, v) in user.into_iter().flatten() {
        if !unset(v) {
            kwargs.insert(k.clone(), v.clone());
        }
    }
    let flag = |key: &str, default: bool| match request.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(body_err(format!("{key}: expected a boolean"))),
    };
    let add_generation_prompt = flag("add_generation_prompt", true)?;
    let continue_final = flag("continue_final_message", false)?;
    if add_generation_prompt && continue_final {
        return Err(body_err(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    kwargs.insert(
        "add_generation_prompt".into(),
        Value::Bool(add_generation_prompt),
    );
    if let Some(d) = request.get("documents").filter(|d| !d.is_null()) {
        kwargs.insert("documents".into(), d.clone());
    }
    let effort = request.get("reasoning_effort").filter(|e| !e.is_null());
    if let Some(e) = effort {
        if !unset(e) {
            kwargs.insert("reasoning_effort".into(), e.clone());
        }
        if !user.is_some_and(|k| k.contains_key("enable_thinking")) {
            kwargs.insert(
                "enable_thinking".into(),
                Value::Bool(e.as_str() != Some("none")),
            );
        }
    }
    let vars = kwargs
        .into_iter()
        .filter(|(k, _)| !NOT_VARIABLES.contains(&k.as_str()))
        .collect();
    Ok((vars, continue_final))
}

/// transformers' `continue_final_message`: the final message's text gets [`CONTINUE_TAG`]
/// before rendering (`Err` when it has none). Returns the text to find again.
pub(crate) fn mark_final(
    conversation: &mut [Value],
    template: &str,
) -> Result<String, TokenizeError> {
    let err = |m: &str| Err(TokenizeError::Template(m.into()));
    let Some(last) = conversation.last_mut().and_then(Value::as_object_mut) else {
        return err("continue_final_message is set but there is no final message");
    };
    let Some(Value::String(text)) = last.get("content").cloned() else {
        return err(
            "continue_final_message is set but the final message has no \"content\" to continue!",
        );
    };
    if !template.contains("content") {
        return err("continue_final_message is set to \"content\" but this is not an accepted field in the chat_template");
    }
    last.insert(
        "content".into(),
        Value::String(format!("{text}{CONTINUE_TAG}")),
    );
    Ok(text)
}

/// The rendered prompt cut right after the final message's text (transformers'
/// `render_jinja_template`).
pub(crate) fn cut_after_final(rendered: String, text: &str) -> Result<String, TokenizeError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(py_strip(text)) || !rendered.contains(tag) {
        return Err(TokenizeError::Template(
            "continue_final_message is set but the final message does not appear in the chat \
             after applying the chat template"
                .into(),
        ));
    }
    let at = rendered.rfind(tag).unwrap_or(0);
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_string())
    } else {
        Ok(py_strip_end(&rendered[..at]).to_string())
    }
}

/// Python's `str.isspace` characters.
fn py_space(c: char) -> bool {
    c.is_whitespace() || matches!(c, '\u{1c}'..='\u{1f}')
}

/// Python's `str.strip()`.
fn py_strip(s: &str) -> &str {
    s.trim_matches(py_space)
}

/// Python's `str.rstrip()`.
fn py_strip_end(s: &str) -> &str {
    s.trim_end_matches(py_space)
}
