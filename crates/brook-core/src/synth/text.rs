//! The text side of a synthetic model: the real tokenizer, chat template and generation
//! config of the family it imitates, so `chat`, `serve`, the web page and OpenAI clients run
//! end to end on random weights (random text, the real pipeline).
//!
//! The files are the committed fixtures (tests/fixtures/tokenizers and templates, whose READMEs
//! say where each came from), embedded in the binary so an installed `brook` needs no
//! checkout. Qwen3.5/3.6 shapes get the Qwen3.5/3.6 vocabulary and the Qwen3.6 template;
//! Qwen3-Next shapes the Qwen3 vocabulary and template. A config whose vocabulary is smaller
//! than the tokenizer's ids (the `tiny` preset) gets none: token ids work without.

use std::io::Read;
use std::path::Path;

use serde_json::{Value, json};

use crate::config::{Arch, ModelConfig};
use crate::error::{Error, Result};

const QWEN36_TOKENIZER_GZ: &[u8] =
    include_bytes!("../../../../tests/fixtures/tokenizers/qwen3.6/tokenizer.json.gz");
const QWEN36_TOKENIZER_CONFIG: &[u8] =
    include_bytes!("../../../../tests/fixtures/templates/qwen3.6/tokenizer_config.json");
const QWEN36_TEMPLATE: &[u8] =
    include_bytes!("../../../../tests/fixtures/templates/qwen3.6/chat_template.jinja");
const QWEN3_TOKENIZER_GZ: &[u8] =
    include_bytes!("../../../../tests/fixtures/tokenizers/qwen3/tokenizer.json.gz");
/// Qwen3's tokenizer_config.json, chat template inside.
const QWEN3_TOKENIZER_CONFIG: &[u8] =
    include_bytes!("../../../../tests/fixtures/templates/qwen3/tokenizer_config.json");

/// Highest token id of each embedded vocabulary (its last added token).
const QWEN36_MAX_ID: usize = 248_076;
const QWEN3_MAX_ID: usize = 151_668;

/// The files written beside a synthetic model: (file name, bytes).
pub fn text_files(cfg: &ModelConfig) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let (gz, config, template, max_id, generation) = match cfg.arch {
        Arch::Qwen35Moe => (
            QWEN36_TOKENIZER_GZ,
            QWEN36_TOKENIZER_CONFIG,
            Some(QWEN36_TEMPLATE),
            QWEN36_MAX_ID,
            // Qwen3.6-35B-A3B's generation_config.json (MODEL.md section 5).
            json!({"bos_token_id": 248044, "do_sample": true, "eos_token_id": [248046, 248044],
                   "pad_token_id": 248044, "temperature": 1.0, "top_k": 20, "top_p": 0.95}),
        ),
        Arch::Qwen3Next => (
            QWEN3_TOKENIZER_GZ,
            QWEN3_TOKENIZER_CONFIG,
            None,
            QWEN3_MAX_ID,
            // Qwen3-Next-80B-A3B-Instruct's generation_config.json.
            json!({"bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
                   "pad_token_id": 151643, "temperature": 0.7, "top_k": 20, "top_p": 0.8}),
        ),
    };
    if cfg.vocab_size <= max_id {
        return Ok(Vec::new());
    }
    let mut tokenizer = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut tokenizer)
        .map_err(|e| Error::Invalid(format!("the embedded tokenizer does not unpack: {e}")))?;
    let mut files = vec![
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", config.to_vec()),
        ("generation_config.json", pretty(&generation)),
    ];
    if let Some(t) = template {
        files.push(("chat_template.jinja", t.to_vec()));
    }
    Ok(files)
}

fn pretty(v: &Value) -> Vec<u8> {
    let mut s = serde_json::to_vec_pretty(v).unwrap_or_default();
    s.push(b'\n');
    s
}

/// Writes [`text_files`] into `dir` (a synthetic container or checkpoint), each through a
/// temporary file and a rename, so a crash never leaves half a tokenizer; files already there
/// are kept. Returns how many were written.
pub fn write_text_files(dir: &Path, cfg: &ModelConfig) -> Result<usize> {
    let mut written = 0;
    for (name, bytes) in text_files(cfg)? {
        let path = dir.join(name);
        if path.exists() {
            continue;
        }
        let tmp = dir.join(format!(".{name}.partial"));
        std::fs::write(&tmp, &bytes).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        written += 1;
    }
    Ok(written)
}
