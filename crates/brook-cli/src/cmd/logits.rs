//! `brook logits`: the float32 logits of every position of a token sequence, as safetensors.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use brook_core::safetensors::{self, TensorOut};
use brook_core::{Logits, dtype::DType};

/// Write the logits of every position of a token sequence to a safetensors file.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  brook logits --model ./Qwen3-Next-tiny --tokens 1,2,3 --out logits.safetensors"
)]
pub struct Args {
    #[command(flatten)]
    model: super::ModelArgs,
    /// Comma-separated token ids.
    #[arg(long)]
    tokens: String,
    /// Output file; gets tensor `logits`, F32 [T, vocab].
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let tokens = super::parse_tokens(&a.tokens)?;
    let llm = a.model.open()?;
    let mut state = llm.new_state();
    let logits = llm.forward(&mut state, &tokens, Logits::All)?;
    let bytes = safetensors::f32_bytes(&logits);
    let tensor = TensorOut {
        name: "logits".into(),
        dtype: DType::F32,
        shape: vec![tokens.len(), llm.model.cfg.vocab_size],
        data: &bytes,
    };
    safetensors::write(&a.out, &[tensor], &BTreeMap::new())?;
    Ok(())
}
