//! brook-core: run huge Mixture-of-Experts language models (Qwen3-Next, Qwen3.5/3.6 MoE) from
//! MLX checkpoints on machines with a few GB of RAM.
//!
//! This crate owns the model config, MLX checkpoint reading, the quantized formats and the
//! forward pass. It depends on no async runtime, HTTP stack, CLI parser or GPU library.

pub mod aligned;
pub mod checkpoint;
pub mod config;
pub mod container;
pub mod cpu;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod experts;
pub mod linear;
pub mod model;
pub mod quant;
pub mod routing;
pub mod safetensors;
pub mod session;
pub mod store;
pub mod synth;
pub mod text;
pub mod util;

pub use checkpoint::{Checkpoint, TensorSource};
pub use config::ModelConfig;
pub use engine::Forward;
pub use error::{Error, Result};
pub use model::{Logits, Model, Stage};
