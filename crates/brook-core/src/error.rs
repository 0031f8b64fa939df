//! The library's error type.
//!
//! Every failure a user, a file or the operating system can cause is a variant here, naming the
//! file, tensor or field involved and, where there is one, what to do next. The binary maps
//! these to exit codes; the library never panics on such input.

use std::path::PathBuf;

/// Result alias used throughout brook-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system error on a named file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A safetensors file whose header or layout is malformed or truncated.
    #[error("{path}: malformed safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },

    /// A config.json (or other JSON file) that cannot be used.
    #[error("{path}: {reason}")]
    Json { path: PathBuf, reason: String },

    /// A config field that is missing, of the wrong kind, or inconsistent with another.
    #[error("config field `{field}`: {reason}")]
    Config { field: String, reason: String },

    /// The config names a model type brook does not run.
    #[error(
        "unsupported model_type `{0}`: brook runs `qwen3_next` and `qwen3_5_moe` (Qwen3-Next, Qwen3.5/3.6 MoE)"
    )]
    UnknownModelType(String),

    /// A tensor the model needs is absent from every checkpoint file.
    #[error("missing tensor `{name}` in {dir}")]
    MissingTensor { name: String, dir: PathBuf },

    /// A tensor whose shape disagrees with the config.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}{hint}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
        hint: String,
    },

    /// A tensor stored in a dtype brook cannot use in that place.
    #[error("tensor `{name}` has dtype {got}, expected {expected}")]
    Dtype {
        name: String,
        expected: String,
        got: String,
    },

    /// A quantized tensor at a bit width or group size MLX never writes.
    #[error(
        "tensor `{name}`: unsupported quantization ({reason}); brook reads MLX affine 2, 3, 4, 5, 6 and 8 bits with group sizes 32, 64 and 128"
    )]
    Quantization { name: String, reason: String },

    /// A checkpoint folder that is not an MLX checkpoint brook understands.
    #[error("{path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },

    /// A bad argument passed through the library API (token out of range, empty prompt, ...).
    #[error("{0}")]
    Invalid(String),

    /// A generation stopped before it produced anything: cancelled, or past its deadline,
    /// while the prompt was still being read.
    #[error("{0}")]
    Stopped(String),

    /// A GPU that is missing, failed, or ran out of memory.
    #[error("GPU: {0}")]
    Device(String),

    /// Tokenizer, chat template or generation-config trouble.
    #[error(transparent)]
    Text(#[from] crate::text::TextError),
}

impl Error {
    /// Wraps an `std::io::Error` with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
