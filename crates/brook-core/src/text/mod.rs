//! Text in, text out: everything between a user's string and the token ids the model sees, and
//! back again, without the model itself.
//!
//! Owns the tokenizer (`tokenizer.json` through the `tokenizers` crate), the chat template
//! (Jinja through minijinja, rendered byte-identically to transformers' `apply_chat_template`),
//! `generation_config.json`, the token sampler and the streaming detokenizer that splits
//! reasoning, content and tool calls. It must not know about weights, backends or HTTP: it
//! takes ids and logits in and gives ids, strings and events out.
//!
//! References it mirrors: transformers (`apply_chat_template`, `tojson`), mlx-lm
//! (`load_config`'s EOS handling, streaming detokenizer), llama.cpp / vLLM (sampler order,
//! penalties), vLLM's `hermes` and `qwen3_coder` tool parsers and `qwen3` reasoning parser.

mod error;
mod generation;
mod isolate;
mod message;
mod pyjson;
mod rng;
mod sampler;
mod stream;
mod strftime;
mod template;
mod tokenizer;
mod tool_parse;

pub use error::{Result, TextError};
pub use generation::{GenerationConfig, eos_ids_from_value};
pub use message::{Content, ContentPart, FunctionCall, Message, MessageToolCall};
pub use sampler::{Sampler, SamplingParams, argmax};
pub use stream::{StopReason, StreamEvent, StreamOptions, TextStream, prompt_opens_reasoning};
pub use template::ChatTemplate;
pub use tokenizer::Tokenizer;
pub use tool_parse::{ToolCall, ToolSchemas};

use std::path::Path;

/// A file of a checkpoint read whole, refused above `max` bytes
/// ([`crate::util::read_capped`]); an error names the file.
pub(crate) fn read_file(path: &Path, max: u64) -> Result<Vec<u8>> {
    crate::util::read_capped(path, max).map_err(io_error(path))
}

/// [`read_file`] as UTF-8 text.
pub(crate) fn read_text(path: &Path, max: u64) -> Result<String> {
    crate::util::read_capped_string(path, max).map_err(io_error(path))
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> TextError + '_ {
    move |source| TextError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// [`read_file`] parsed as JSON.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path, max: u64) -> Result<T> {
    serde_json::from_slice(&read_file(path, max)?).map_err(|source| TextError::Json {
        path: path.to_path_buf(),
        source,
    })
}
