//! A small ChatML tokenizer made on the spot (a byte-level BPE trained on a few paragraphs,
//! with Qwen's special tokens) and a Qwen2.5-style chat template, so tests and benchmarks run
//! token mode without downloading a model's files.

#![forbid(unsafe_code)]

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, DecoderWrapper, PostProcessorWrapper, PreTokenizerWrapper};
use tokenizers::{Tokenizer, TokenizerBuilder};

/// The text the BPE is trained on.
const CORPUS: &str = "You are a helpful assistant. Answer the user's questions about the weather, \
the stock market and the history of computing. The function get_weather takes a city and a unit \
of temperature, celsius or fahrenheit, and returns the forecast. Tell me a story about a cat who \
learned to code in Rust. The quick brown fox jumps over the lazy dog. {\"type\": \"function\", \
\"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}} 0123456789";

/// Qwen2.5's chat template (tools, tool calls and tool responses), shortened.
pub const CHATML_TEMPLATE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role != "system" %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

/// A `tokenizer.json` (byte-level BPE, `vocab_size` at most, special tokens `<|endoftext|>`,
/// `<|im_start|>`, `<|im_end|>`).
pub fn chatml_tokenizer_json(vocab_size: usize) -> String {
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(|s| AddedToken::from(s, true))
        .to_vec();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(1)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trained = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
    .with_post_processor(Some(ByteLevel::new(false, true, true).into()))
    .with_decoder(Some(ByteLevel::new(false, true, true).into()))
    .build()
    .expect("a BPE tokenizer builds");
    trained
        .train(&mut trainer, CORPUS.split(". ").map(str::to_string))
        .expect("training on a fixed corpus succeeds");
    let mut tokenizer: Tokenizer = trained.into();
    tokenizer.add_special_tokens(&specials);
    tokenizer.to_string(false).expect("a tokenizer serializes")
}

/// A `tokenizer_config.json` holding [`CHATML_TEMPLATE`].
pub fn chatml_config_json() -> String {
    serde_json::json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE,
    })
    .to_string()
}

/// Writes `tokenizer.json` and `tokenizer_config.json` into `dir`.
pub fn write_chatml(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::write(dir.join("tokenizer.json"), chatml_tokenizer_json(1000))?;
    std::fs::write(dir.join("tokenizer_config.json"), chatml_config_json())
}
