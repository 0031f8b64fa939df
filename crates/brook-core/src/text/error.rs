//! The one error type of the text layer. Each variant names the file or input at fault and,
//! where it can, what to do next. It must not carry `anyhow` or boxed errors from other crates
//! in its public shape: messages are flattened to strings so callers can match on variants.

use std::path::PathBuf;

/// Result of every fallible text-layer call.
pub type Result<T, E = TextError> = std::result::Result<T, E>;

/// What went wrong in the text layer.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (tokenizer_config.json, generation_config.json, ...) is not valid JSON.
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A config file parsed but a field has the wrong shape.
    #[error("{path}: field `{field}` {problem}")]
    Config {
        path: PathBuf,
        field: String,
        problem: String,
    },
    /// `tokenizer.json` could not be loaded by the `tokenizers` crate.
    #[error("cannot load tokenizer {path}: {message} (is it a Hugging Face tokenizer.json?)")]
    TokenizerLoad { path: PathBuf, message: String },
    /// Encoding or decoding failed inside the `tokenizers` crate.
    #[error("tokenizer could not {op}: {message}")]
    Tokenizer { op: &'static str, message: String },
    /// The chat template does not compile (a Jinja syntax error).
    #[error("chat template does not compile: {message}")]
    TemplateSyntax { message: String },
    /// The template itself rejected the conversation through `raise_exception(...)`.
    #[error("chat template rejected the conversation: {message}")]
    TemplateRaised { message: String },
    /// Rendering failed for another reason (a filter on the wrong type, ...).
    #[error("chat template failed to render: {message}")]
    TemplateRender { message: String },
    /// The caller passed messages or template arguments that cannot be rendered.
    #[error("invalid chat input: {0}")]
    InvalidInput(String),
    /// Sampling parameters out of range.
    #[error("invalid sampling parameter {name} = {value}: {expected}")]
    Sampling {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
}
