//! The committed Qwen3 and Qwen3.5/3.6 tokenizer.json files give exactly the ids tiktoken gives
//! (recorded by scripts/make_tokenizers.py), special tokens in text become their ids, and the
//! added-token table matches MODEL.md section 5.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use brook_core::text::Tokenizer;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct Expected {
    text: String,
    ids: Vec<u32>,
}

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizers")
        .join(name)
}

fn load(name: &str) -> Tokenizer {
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(
        std::fs::File::open(dir(name).join("tokenizer.json.gz")).expect("fixture"),
    )
    .read_to_end(&mut json)
    .expect("gzip");
    Tokenizer::from_bytes(&json).expect("tokenizer loads")
}

fn qwen3() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| load("qwen3"))
}

fn qwen36() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| load("qwen3.6"))
}

fn expected(name: &str) -> Vec<Expected> {
    let text = std::fs::read_to_string(dir(name).join("expected_ids.json")).expect("fixture");
    serde_json::from_str(&text).expect("parses")
}

fn check_ids(tok: &Tokenizer, name: &str) {
    let cases = expected(name);
    assert!(cases.len() >= 20);
    for case in cases {
        let ids = tok.encode(&case.text, false).expect("encodes");
        assert_eq!(ids, case.ids, "{name}: ids of {:?}", case.text);
    }
}

#[test]
fn qwen3_ids_match_tiktoken_reference() {
    check_ids(qwen3(), "qwen3");
}

#[test]
fn qwen36_ids_match_tiktoken_reference() {
    check_ids(qwen36(), "qwen3.6");
}

#[test]
fn hello_world_is_the_known_qwen3_sequence() {
    assert_eq!(
        qwen3().encode("Hello, world!", true).expect("encodes"),
        [9707, 11, 1879, 0]
    );
}

#[test]
fn qwen3_added_tokens_match_model_md() {
    let t = qwen3();
    let table = [
        (151643, "<|endoftext|>"),
        (151644, "<|im_start|>"),
        (151645, "<|im_end|>"),
        (151652, "<|vision_start|>"),
        (151656, "<|video_pad|>"),
        (151657, "<tool_call>"),
        (151658, "</tool_call>"),
        (151663, "<|repo_name|>"),
        (151665, "<tool_response>"),
        (151667, "<think>"),
        (151668, "</think>"),
    ];
    for (id, tok) in table {
        assert_eq!(t.token_to_id(tok), Some(id), "{tok}");
        assert_eq!(t.id_to_token(id).as_deref(), Some(tok));
    }
    assert_eq!(t.vocab_size(), 151_669);
    assert!(t.is_special(151645));
    assert!(!t.is_special(151667), "<think> is special=false");
}

#[test]
fn qwen36_added_tokens_and_think_ids() {
    let t = qwen36();
    for (id, tok) in [
        (248044, "<|endoftext|>"),
        (248045, "<|im_start|>"),
        (248046, "<|im_end|>"),
        (248053, "<|vision_start|>"),
        (248056, "<|image_pad|>"),
        (248057, "<|video_pad|>"),
        (248058, "<tool_call>"),
        (248068, "<think>"),
        (248069, "</think>"),
        (248076, "<|audio_pad|>"),
    ] {
        assert_eq!(t.token_to_id(tok), Some(id), "{tok}");
    }
    assert_eq!(t.vocab_size(), 248_077);
    // MODEL.md: "...<|im_start|>assistant\n<think>\n" ends 248045, 74455, 198, 248068, 198.
    let ids = t
        .encode("<|im_start|>assistant\n<think>\n", false)
        .expect("encodes");
    assert_eq!(ids, [248045, 74455, 198, 248068, 198]);
}

#[test]
fn special_tokens_in_text_become_single_ids() {
    let ids = qwen3()
        .encode("<|im_start|>user\nhi<|im_end|>\n<think>x</think>", false)
        .expect("encodes");
    assert_eq!(ids[0], 151644);
    assert!(ids.contains(&151645) && ids.contains(&151667) && ids.contains(&151668));
}

#[test]
fn decode_skips_only_special_tokens() {
    let t = qwen3();
    let ids = t
        .encode("<|im_start|>a<think>b</think><|im_end|>", false)
        .expect("encodes");
    assert_eq!(t.decode(&ids, true).expect("decodes"), "a<think>b</think>");
    assert_eq!(
        t.decode(&ids, false).expect("decodes"),
        "<|im_start|>a<think>b</think><|im_end|>"
    );
}

#[test]
fn text_in_many_scripts_round_trips() {
    for tok in [qwen3(), qwen36()] {
        for case in expected("qwen3") {
            let ids = tok.encode(&case.text, false).expect("encodes");
            let back = tok.decode(&ids, false).expect("decodes");
            // The normalizer folds "e\u{301}" into "é" (NFC), as tiktoken's reference does.
            let want: String = case.text.replace("e\u{301}", "\u{e9}");
            assert_eq!(back, want);
        }
    }
}

#[test]
fn token_bytes_rebuild_text_exactly() {
    let t = qwen36();
    let text = "emoji 👩‍👩‍👧‍👦 🦀, CJK 漢字, Devanagari नमस्ते";
    let ids = t.encode(text, false).expect("encodes");
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&id| t.token_bytes(id).to_vec())
        .collect();
    assert_eq!(String::from_utf8(bytes).expect("utf8"), text);
    assert!(t.token_bytes(u32::MAX).is_empty());
}

#[test]
fn from_dir_is_none_without_tokenizer_json() {
    let dir = tempfile::tempdir().expect("temp dir");
    let empty = dir.path();
    assert!(Tokenizer::from_dir(empty).expect("no error").is_none());
    std::fs::write(empty.join("tokenizer.json"), b"{not json").expect("write");
    let err = Tokenizer::from_dir(empty).expect_err("bad file is an error");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

/// A minimal byte-level BPE tokenizer.json whose piece "b" has id `b_id`.
fn tiny_json(b_id: u64) -> String {
    format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,
        "added_tokens":[{{"id":3,"content":"<|end|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}],
        "normalizer":null,
        "pre_tokenizer":{{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":true}},
        "post_processor":null,
        "decoder":{{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":true}},
        "model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
        "vocab":{{"a":0,"b":{b_id},"Ġ":2}},"merges":[]}}}}"#
    )
}

#[test]
fn token_ids_are_bounded() {
    let ok = Tokenizer::from_bytes(tiny_json(1).as_bytes()).expect("small ids load");
    assert_eq!(ok.token_bytes(3), b"<|end|>");
    assert_eq!(ok.token_bytes(1), b"b");
    // An id near 2^32 would size the per-token byte table in gigabytes: refused, by name.
    let err = Tokenizer::from_bytes(tiny_json(4_000_000_000).as_bytes())
        .expect_err("a huge id is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("4000000000") && msg.contains("corrupt"),
        "{msg}"
    );
}
