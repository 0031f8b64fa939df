//! Synthetic models talk: `synth` writes the real tokenizer, chat template and generation
//! config of the family a preset imitates, and they load, render and tokenize inside the
//! model's vocabulary.

use brook_core::ModelConfig;
use brook_core::synth::{preset_config, write_text_files};
use brook_core::text::{ChatTemplate, GenerationConfig, Message, Tokenizer};

fn files_for(preset: &str) -> (tempfile::TempDir, ModelConfig, usize) {
    let cfg = ModelConfig::from_json(&preset_config(preset).expect("preset")).expect("config");
    let dir = tempfile::tempdir().expect("tmp");
    let n = write_text_files(dir.path(), &cfg).expect("write");
    (dir, cfg, n)
}

#[test]
fn synthetic_presets_get_their_familys_tokenizer_template_and_generation_config() {
    for (preset, im_end, stops) in [
        ("qwen3.6-35b-a3b", 248046u32, vec![248046u32, 248044]),
        ("qwen3-next-80b-a3b", 151645, vec![151645, 151643]),
    ] {
        let (dir, cfg, n) = files_for(preset);
        assert!(n >= 3, "{preset}: {n} files");
        let tok = Tokenizer::from_dir(dir.path())
            .expect("tokenizer")
            .expect("present");
        let template = ChatTemplate::from_dir(dir.path())
            .expect("template")
            .expect("present");
        let generation = GenerationConfig::from_dir(dir.path())
            .expect("generation config")
            .expect("present");
        let msgs = [Message::new("user", "Why is the sky blue?")];
        let prompt = template
            .render(&msgs, None, true, &Default::default())
            .expect("render");
        let ids = tok.encode(&prompt, false).expect("encode");
        assert!(ids.contains(&im_end), "{preset}: {prompt}");
        assert!(ids.iter().all(|&i| (i as usize) < cfg.vocab_size));
        assert_eq!(
            generation.stop_ids(&cfg.eos_token_ids, None)[..2],
            stops[..]
        );
        // A second write keeps what is there.
        assert_eq!(write_text_files(dir.path(), &cfg).expect("again"), 0);
    }
}

#[test]
fn a_vocabulary_smaller_than_the_tokenizer_gets_no_text_files() {
    let (dir, _, n) = files_for("tiny");
    assert_eq!(n, 0);
    assert!(!dir.path().join("tokenizer.json").exists());
}
