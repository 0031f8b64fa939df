//! config.json parsing for both families, and refusals that name the field.

mod common;

use brook_core::config::{Arch, LayerKind, QuantSpec};
use brook_core::{Error, ModelConfig};
use serde_json::{Value, json};

fn next_config() -> Value {
    json!({
        "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
        "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": true, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6, "vocab_size": 151936, "tie_word_embeddings": false,
        "eos_token_id": 151645, "bos_token_id": 151643,
        "quantization": {"group_size": 64, "bits": 4,
            "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}
    })
}

fn qwen35_config() -> Value {
    let mut types = Vec::new();
    for _ in 0..10 {
        types.extend([
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ]);
    }
    json!({
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 248056,
        "text_config": {
            "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
            "layer_types": types, "full_attention_interval": 4, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": true,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6, "vocab_size": 248320,
            "eos_token_id": 248044,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": true}
        },
        "vision_config": {"depth": 27, "hidden_size": 1152},
        "tie_word_embeddings": false,
        "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
            "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "language_model.model.layers.0.mlp.shared_expert.down_proj": false}
    })
}

#[test]
fn qwen3_next_flat_config() {
    let c = ModelConfig::from_json(&next_config()).expect("parse");
    assert_eq!(c.arch, Arch::Qwen3Next);
    assert_eq!(c.layer_types.len(), 48);
    assert_eq!(
        c.layer_types
            .iter()
            .filter(|k| **k == LayerKind::Full)
            .count(),
        12
    );
    assert_eq!(c.layer_types[3], LayerKind::Full);
    assert_eq!(c.layer_types[4], LayerKind::Linear);
    assert_eq!(c.rotary_dim, 64);
    assert_eq!(c.rope_theta, 1e7);
    assert_eq!(c.conv_dim(), 8192);
    assert_eq!(c.eos_token_ids, vec![151645]);
    let q = &c.quantization;
    assert_eq!(
        q.spec_for("model.layers.0.mlp.gate"),
        Some(QuantSpec {
            bits: 8,
            group_size: 64
        })
    );
    assert_eq!(
        q.spec_for("model.layers.0.mlp.shared_expert.up_proj"),
        Some(QuantSpec {
            bits: 4,
            group_size: 64
        })
    );
}

#[test]
fn qwen3_5_moe_nested_config_with_rope_parameters() {
    let c = ModelConfig::from_json(&qwen35_config()).expect("parse");
    assert_eq!(c.arch, Arch::Qwen35Moe);
    assert_eq!(c.num_hidden_layers, 40);
    assert_eq!(
        c.layer_types
            .iter()
            .filter(|k| **k == LayerKind::Full)
            .count(),
        10
    );
    assert_eq!((c.rotary_dim, c.rope_theta), (64, 1e7));
    assert!(c.norm_topk_prob, "Qwen3.5 always renormalises");
    assert_eq!(c.eos_token_ids, vec![248044]);
    // Overrides are keyed by canonical names, without `language_model.`.
    let q = &c.quantization;
    assert_eq!(
        q.spec_for("model.layers.0.mlp.gate"),
        Some(QuantSpec {
            bits: 8,
            group_size: 64
        })
    );
    assert_eq!(
        q.spec_for("model.layers.0.mlp.shared_expert.down_proj"),
        None
    );
}

#[test]
fn mlx_lm_saved_rope_parameters_type_key_is_accepted() {
    // mlx-lm renames `rope_type` to `type` in place and saves that.
    let mut v = qwen35_config();
    let rp = v["text_config"]["rope_parameters"]
        .as_object_mut()
        .expect("obj");
    rp.remove("rope_type");
    rp.insert("type".into(), "default".into());
    assert!(ModelConfig::from_json(&v).is_ok());
}

#[test]
fn fixture_configs_parse() {
    for name in common::MODELS {
        let c = ModelConfig::from_dir(&common::fixture(name)).expect(name);
        assert_eq!(c.num_hidden_layers, 4, "{name}");
        assert_eq!(c.linear_ratio(), 4, "{name}");
    }
}

fn field_error(v: Value) -> (String, String) {
    match ModelConfig::from_json(&v) {
        Err(Error::Config { field, reason }) => (field, reason),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn unknown_model_type_is_refused() {
    let mut v = next_config();
    v["model_type"] = "llama".into();
    let e = ModelConfig::from_json(&v).expect_err("refused");
    assert!(matches!(&e, Error::UnknownModelType(t) if t == "llama"));
    assert!(e.to_string().contains("qwen3_next"));
}

#[test]
fn inconsistent_dimensions_name_the_field() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("num_key_value_heads", json!(3), "num_key_value_heads"),
        (
            "linear_num_value_heads",
            json!(20),
            "linear_num_value_heads",
        ),
        ("num_experts_per_tok", json!(600), "num_experts_per_tok"),
        ("partial_rotary_factor", json!(0.3), "partial_rotary_factor"),
        ("hidden_size", json!("big"), "hidden_size"),
        ("hidden_size", json!(0), "hidden_size"),
        ("norm_topk_prob", json!(1), "norm_topk_prob"),
        // Sizes no model has: refused before anything is allocated from them.
        (
            "num_hidden_layers",
            json!(1_000_000_000_000u64),
            "num_hidden_layers",
        ),
        ("num_hidden_layers", json!(1e12), "num_hidden_layers"),
        ("vocab_size", json!(u64::MAX), "vocab_size"),
        ("num_experts", json!(1u64 << 40), "num_experts"),
        ("hidden_size", json!(1u64 << 33), "hidden_size"),
        ("eos_token_id", json!([5, 1 << 30]), "eos_token_id"),
    ];
    for (key, val, want) in cases {
        let mut v = next_config();
        v[key] = val.clone();
        let (field, reason) = field_error(v);
        assert_eq!(field, want, "{key}={val}: {reason}");
    }
    let mut v = qwen35_config();
    v["text_config"]["layer_types"] = json!(["linear_attention"]);
    let (field, reason) = field_error(v);
    assert_eq!(field, "text_config.layer_types");
    assert!(reason.contains("num_hidden_layers"), "{reason}");
    let mut v = next_config();
    v.as_object_mut().expect("obj").remove("vocab_size");
    assert_eq!(field_error(v).0, "vocab_size");
    let mut v = next_config();
    v["mlp_only_layers"] = json!([0]);
    assert!(field_error(v).0.contains("mlp_only_layers"));
    let mut v = next_config();
    v["quantization"]["mode"] = "mxfp4".into();
    assert_eq!(field_error(v).0, "quantization.mode");
}

#[test]
fn malformed_config_json_names_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("config.json"), "{\"model_type\": ").expect("write");
    let e = ModelConfig::from_dir(dir.path()).expect_err("refused");
    assert!(
        matches!(&e, Error::Json { path, .. } if path.ends_with("config.json")),
        "{e}"
    );
}

/// `decode_state_bytes` (what bench counts besides the weights) matches the state a decoded
/// token really moves: every DeltaNet layer's recurrent state and conv rows read and written,
/// every attention layer's cached keys and values read and one new row of each written.
#[test]
fn decode_state_bytes_match_the_state_held() {
    use brook_core::model::state::LayerState;
    use brook_core::{Logits, Model};
    for name in ["next-q4", "qwen35-q4"] {
        let m = Model::open(&common::fixture(name)).expect("open");
        let cfg = &m.cfg;
        let mut st = m.new_state();
        let tokens = [1u32, 5, 9, 2, 7];
        m.forward(&mut st, &tokens, Logits::Last, None)
            .expect("forward");
        let (mut moved, mut kv_row) = (0usize, 0usize);
        for l in &st.layers {
            match l {
                LayerState::Linear { conv, ssm } => moved += 2 * 4 * (conv.len() + ssm.len()),
                LayerState::Full { keys, values } => {
                    let row = keys.len() / tokens.len();
                    kv_row = row;
                    // The cached rows read, one new row of keys and one of values written.
                    moved += 4 * (keys.len() + values.len() + 2 * row);
                }
            }
        }
        assert!(kv_row > 0, "{name}: no attention layer");
        assert_eq!(
            cfg.decode_state_bytes(tokens.len(), 4),
            moved as u64,
            "{name}"
        );
        // bf16 recurrent states halve their share, and nothing else.
        let ssm: usize = st
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Linear { ssm, .. } => ssm.len(),
                LayerState::Full { .. } => 0,
            })
            .sum();
        assert_eq!(
            cfg.decode_state_bytes(tokens.len(), 2),
            (moved - 2 * 2 * ssm) as u64,
            "{name}"
        );
    }
}
