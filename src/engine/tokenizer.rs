//! The deterministic tokenizer and chat template of the simulated engine.

/// Size of the simulated vocabulary; ids below `FIRST_SPECIAL` are text tokens.
pub const VOCAB_SIZE: u32 = 151_936;
pub const FIRST_SPECIAL: u32 = 151_643;

/// One chat message as the template sees it (content already flattened to text).
#[derive(Debug, Clone, Default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Tool calls of an assistant message, as their JSON text.
    pub tool_calls: Option<String>,
    pub tool_call_id: Option<String>,
}

/// Append the token ids of `text`.
pub fn encode(_text: &str, _out: &mut Vec<u32>) {
    todo!()
}

/// The text of one token id (for generated output).
pub fn decode_token(_id: u32, _out: &mut String) {
    todo!()
}

/// Render `messages` (and `tools`, the request's tools array as JSON text) with the fixed chat
/// template and append the token ids; `add_generation_prompt` appends the assistant header.
pub fn apply_chat_template(
    _messages: &[ChatMessage],
    _tools: Option<&str>,
    _add_generation_prompt: bool,
    _out: &mut Vec<u32>,
) {
    todo!()
}
