//! Helpers shared by the integration tests: fixture paths and reading reference tensors.
#![allow(dead_code)]

use std::path::PathBuf;

use brook_core::dtype::{self, DType};
use brook_core::safetensors::SafeFile;

/// Every model fixture made by `scripts/make_fixtures.py`.
pub const MODELS: [&str; 8] = [
    "next-f32",
    "next-q4",
    "next-q8",
    "next-mixed",
    "qwen35-f32",
    "qwen35-q4",
    "qwen35-q8",
    "qwen35-mixed",
];

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn fixture(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// Reference tensors of one fixture (`reference.safetensors`).
pub struct Reference(pub SafeFile);

impl Reference {
    pub fn open(name: &str) -> Self {
        Reference(SafeFile::open(&fixture(name).join("reference.safetensors")).expect("reference"))
    }

    pub fn f32(&self, name: &str) -> Vec<f32> {
        let info = self
            .0
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("no {name}"));
        let bytes = self.0.read(info).expect("read");
        let mut out = Vec::new();
        assert!(
            dtype::floats_to_f32(info.dtype, &bytes, &mut out),
            "{name} not float"
        );
        out
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        let info = self
            .0
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(info.dtype, DType::I32);
        let bytes = self.0.read(info).expect("read");
        bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32)
            .collect()
    }
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}
#[path = "rewrite.rs"]
pub mod rewrite;

/// A small random model with the real Qwen3.6 vocabulary, tokenizer and chat template, as a
/// container in `dir` (hidden 128, 4 layers, 16 experts).
pub fn chat_model(dir: &std::path::Path) -> PathBuf {
    use std::io::Read;
    let mut cfg = brook_core::synth::preset_config("tiny").expect("preset");
    let t = &mut cfg["text_config"];
    t["hidden_size"] = 128.into();
    t["vocab_size"] = 248320.into();
    t["eos_token_id"] = 248044.into();
    t["bos_token_id"] = 248044.into();
    cfg["eos_token_id"] = serde_json::json!([248046, 248044]);
    let store = brook_core::synth::SynthStore::from_config("chat", cfg, 4, 11).expect("synth");
    let out = dir.join("chat-model");
    brook_core::container::repack::repack(&store.repack_source(), &out, &mut |_| {})
        .expect("repack");
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(
        std::fs::File::open(fixtures().join("tokenizers/qwen3.6/tokenizer.json.gz"))
            .expect("tokenizer"),
    )
    .read_to_end(&mut json)
    .expect("gunzip");
    std::fs::write(out.join("tokenizer.json"), json).expect("write");
    for f in ["chat_template.jinja", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join("templates/qwen3.6").join(f), out.join(f)).expect("copy");
    }
    out
}
