//! Fuzz targets: each takes arbitrary bytes and feeds them to one parser of input brook gets
//! from strangers, the way brook itself would. A target returns normally on every input, an
//! error included; a panic, an abort, a hang or an allocation without bound is a bug.
//!
//! The same functions run under libFuzzer (`fuzz/`, coverage-guided, `cargo fuzz run NAME`)
//! and in this crate's test, which replays the committed corpus and a seeded run of mutations
//! of it in a few seconds per target (docs/FUZZING.md).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use brook_core::text::{ChatTemplate, Message, StreamOptions, TextStream, Tokenizer};

/// A fuzz target: arbitrary bytes in, nothing out; it must return on every input.
pub type Target = fn(&[u8]);

/// Every target by name.
pub const TARGETS: &[(&str, Target)] = &[
    ("safetensors", safetensors),
    ("manifest", manifest),
    ("config", config),
    ("tokenizer", tokenizer),
    ("template_source", template_source),
    ("template_inputs", template_inputs),
    ("chat_request", chat_request),
    ("completion_request", completion_request),
    ("text_stream", text_stream),
];

/// For libFuzzer drivers: puts back the default panic hook. libfuzzer-sys's hook aborts on
/// every panic, even one brook catches on purpose (around the tokenizers crate, which panics
/// on some malformed files); a panic that escapes a target still aborts the run, because the
/// driver checks for it.
pub fn init() {
    drop(std::panic::take_hook());
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// A scratch folder for targets that read files, shared by one process's runs.
fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("tempdir"))
        .path()
}

/// A safetensors file: its header parsed and checked, then every tensor it describes read.
pub fn safetensors(data: &[u8]) {
    let path = scratch().join("fuzz.safetensors");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(f) = brook_core::safetensors::SafeFile::open(&path) {
        for info in f.tensors.values() {
            let _ = f.read(info);
        }
    }
}

/// A container whose `manifest.json` is `data` beside real layer and dense files: opened, and
/// if it opens, one expert of every layer read.
pub fn manifest(data: &[u8]) {
    static DIR: OnceLock<Mutex<PathBuf>> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let out = scratch().join("container");
        let ck = brook_core::Checkpoint::open(&fixtures().join("next-q4")).expect("fixture");
        let src =
            brook_core::container::repack::RepackSource::from_checkpoint(&ck).expect("source");
        brook_core::container::repack::repack(&src, &out, &mut |_| {}).expect("repack");
        Mutex::new(out)
    });
    let dir = dir
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if std::fs::write(dir.join("manifest.json"), data).is_err() {
        return;
    }
    if let Ok(c) = brook_core::container::Container::open(&dir) {
        for layer in 0..c.manifest.experts.layers.len() {
            let _ = c.read_expert(layer, 0);
        }
    }
}

/// `config.json`.
pub fn config(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = brook_core::config::ModelConfig::from_json(&v);
    }
}

/// `tokenizer.json`: loaded, then a text encoded and the ids decoded back.
pub fn tokenizer(data: &[u8]) {
    if let Ok(t) = Tokenizer::from_bytes(data)
        && let Ok(ids) = t.encode("Hello <|im_start|> world 🌊", false)
    {
        let _ = t.decode(&ids, false);
    }
}

fn qwen_tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = fixtures().join("tokenizers/qwen3.6/tokenizer.json.gz");
        let mut json = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(path).expect("fixture"))
            .read_to_end(&mut json)
            .expect("gzip");
        Arc::new(Tokenizer::from_bytes(&json).expect("tokenizer"))
    })
    .clone()
}

fn qwen_template() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| {
        ChatTemplate::from_dir(fixtures().join("templates/qwen3.6"))
            .expect("template")
            .expect("present")
    })
}

/// A chat template's source (what a checkpoint ships), compiled and rendered on a short
/// conversation with a tool.
pub fn template_source(data: &[u8]) {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(t) = ChatTemplate::new(src) {
        let msgs = [
            Message::new("system", "be brief"),
            Message::new("user", "hi"),
            Message::new("assistant", "hello"),
        ];
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
        ];
        let _ = t.render(&msgs, Some(&tools), true, &serde_json::Map::new());
    }
}

/// The Qwen3.6 template over what a request controls: `data` as JSON
/// `{"messages": [...], "tools": [...], "kwargs": {...}}`, or as the text of one user message.
pub fn template_inputs(data: &[u8]) {
    let t = qwen_template();
    let v: serde_json::Value = match serde_json::from_slice(data) {
        Ok(v) => v,
        Err(_) => {
            let text = String::from_utf8_lossy(data);
            let _ = t.render(
                &[Message::new("user", text)],
                None,
                true,
                &serde_json::Map::new(),
            );
            return;
        }
    };
    let Ok(messages) = serde_json::from_value::<Vec<Message>>(v["messages"].clone()) else {
        return;
    };
    let tools = v["tools"].as_array().cloned();
    let kwargs = v["kwargs"].as_object().cloned().unwrap_or_default();
    let _ = t.render(&messages, tools.as_deref(), true, &kwargs);
}

fn json_headers() -> axum::http::HeaderMap {
    let mut h = axum::http::HeaderMap::new();
    h.insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    h
}

/// A `/v1/chat/completions` body: parsed, checked and turned into generation options.
pub fn chat_request(data: &[u8]) {
    use brook_server::request::{ChatRequest, parse_body};
    let body = Ok(axum::body::Bytes::copy_from_slice(data));
    if let Ok(req) = parse_body::<ChatRequest>(&json_headers(), body)
        && req.check().is_ok()
        && let Ok(opts) = req.options(Default::default())
    {
        let _ = qwen_template().render(
            &req.conversation(),
            opts.tools.as_deref(),
            true,
            &opts.template_kwargs,
        );
    }
}

/// A `/v1/completions` body: parsed, checked and turned into generation options.
pub fn completion_request(data: &[u8]) {
    use brook_server::request::{CompletionRequest, parse_body};
    let body = Ok(axum::body::Bytes::copy_from_slice(data));
    if let Ok(req) = parse_body::<CompletionRequest>(&json_headers(), body)
        && req.check().is_ok()
    {
        let _ = req.options(Default::default());
    }
}

/// Generated ids (4 bytes each, any value) through the text stream with reasoning and
/// tool-call parsing on, as the server runs it.
pub fn text_stream(data: &[u8]) {
    let tok = qwen_tokenizer();
    let vocab = tok.vocab_size() as u32;
    let tools = brook_core::text::ToolSchemas::default();
    let mut s = TextStream::new(
        tok,
        StreamOptions {
            stop_strings: vec!["STOP".into()],
            stop_ids: vec![248046],
            starts_in_reasoning: data.first().is_some_and(|b| b & 1 == 1),
            parse_reasoning: true,
            parse_tool_calls: true,
            skip_special: true,
            tools,
            tool_call_id_prefix: "call_".into(),
        },
    );
    for c in data.chunks_exact(4) {
        let raw = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        // Mostly valid ids (what a model emits), sometimes any value.
        let id = if raw >> 31 == 0 {
            raw % vocab.max(1)
        } else {
            raw
        };
        let _ = s.push(id);
    }
    let _ = s.finish();
}
