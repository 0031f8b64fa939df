//! The small chat model the session, server and CLI tests share (included by path from the
//! other crates' tests, so there is one copy).

use std::io::Read;
use std::path::{Path, PathBuf};

/// A small random model with the real Qwen3.6 vocabulary, tokenizer and chat template, as a
/// container in `dir` (hidden 128, 4 layers, 16 experts).
pub fn chat_model(dir: &Path) -> PathBuf {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut cfg = brook_core::synth::preset_config("tiny").expect("preset");
    let t = &mut cfg["text_config"];
    t["hidden_size"] = 128.into();
    t["vocab_size"] = 248320.into();
    t["eos_token_id"] = 248044.into();
    t["bos_token_id"] = 248044.into();
    cfg["eos_token_id"] = serde_json::json!([248046, 248044]);
    let store = brook_core::synth::SynthModel::from_config("chat", cfg, 4, 11).expect("synth");
    let out = dir.join("chat-model");
    brook_core::container::repack::repack(&store.repack_source(), &out, &mut |_| {})
        .expect("repack");
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(
        std::fs::File::open(fixtures.join("tokenizers/qwen3.6/tokenizer.json.gz"))
            .expect("tokenizer"),
    )
    .read_to_end(&mut json)
    .expect("gunzip");
    std::fs::write(out.join("tokenizer.json"), json).expect("write");
    for f in ["chat_template.jinja", "tokenizer_config.json"] {
        std::fs::copy(fixtures.join("templates/qwen3.6").join(f), out.join(f)).expect("copy");
    }
    out
}
