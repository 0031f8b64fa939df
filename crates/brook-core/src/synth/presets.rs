//! The presets `brook synth` knows: each released model's config.json (shapes, layer
//! pattern, routing), moved unchanged out of the synthetic store.

use serde_json::{Value, json};

use crate::error::{Error, Result};

/// The presets `brook synth` knows, with their checkpoint families.
pub const PRESETS: [&str; 6] = [
    "qwen3.6-35b-a3b",
    "qwen3.5-35b-a3b",
    "qwen3-next-80b-a3b",
    "qwen3.5-122b-a10b",
    "qwen3.5-397b-a17b",
    "tiny",
];

/// config.json of a preset (without the quantization section).
pub fn preset_config(name: &str) -> Result<Value> {
    let layer_types = |n: usize| -> Vec<&'static str> {
        (0..n)
            .map(|i| {
                if (i + 1) % 4 == 0 {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect()
    };
    let qwen35 = |layers: usize,
                  hidden: usize,
                  heads: usize,
                  vheads: usize,
                  experts: usize,
                  topk: usize,
                  inter: usize,
                  bos: bool| {
        let mut text = json!({
            "model_type": "qwen3_5_moe_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "layer_types": layer_types(layers), "full_attention_interval": 4,
            "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": 256,
            "attn_output_gate": true, "linear_num_key_heads": 16, "linear_num_value_heads": vheads,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32", "num_experts": experts, "num_experts_per_tok": topk,
            "moe_intermediate_size": inter, "shared_expert_intermediate_size": inter,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000,
                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": true},
            "rms_norm_eps": 1e-6, "vocab_size": 248320, "tie_word_embeddings": false,
            "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
            "eos_token_id": 248044, "dtype": "bfloat16"
        });
        if bos {
            text["bos_token_id"] = json!(248044);
        }
        json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "tie_word_embeddings": false, "eos_token_id": [248046, 248044],
            "image_token_id": 248056, "video_token_id": 248057,
            "vision_start_token_id": 248053, "vision_end_token_id": 248054
        })
    };
    Ok(match name {
        "qwen3.6-35b-a3b" => qwen35(40, 2048, 16, 32, 256, 8, 512, true),
        "qwen3.5-35b-a3b" => qwen35(40, 2048, 16, 32, 256, 8, 512, false),
        "qwen3.5-122b-a10b" => qwen35(48, 3072, 32, 64, 256, 8, 1024, false),
        "qwen3.5-397b-a17b" => qwen35(60, 4096, 32, 64, 512, 10, 1024, false),
        "qwen3-next-80b-a3b" => json!({
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "hidden_size": 2048, "num_hidden_layers": 48, "full_attention_interval": 4,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
            "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "intermediate_size": 5120,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
            "rope_theta": 10_000_000, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
            "vocab_size": 151936, "tie_word_embeddings": false, "max_position_embeddings": 262144,
            "bos_token_id": 151643, "eos_token_id": [151645, 151643], "torch_dtype": "bfloat16"
        }),
        "tiny" => {
            let mut v = qwen35(4, 256, 4, 8, 16, 4, 128, true);
            let t = &mut v["text_config"];
            t["linear_num_key_heads"] = json!(4);
            t["head_dim"] = json!(64);
            t["linear_key_head_dim"] = json!(32);
            t["linear_value_head_dim"] = json!(32);
            t["vocab_size"] = json!(4096);
            t["eos_token_id"] = json!(4095);
            t["bos_token_id"] = json!(4095);
            v["eos_token_id"] = json!([4095]);
            v
        }
        other => {
            return Err(Error::Invalid(format!(
                "unknown preset `{other}`; choose one of {}",
                PRESETS.join(", ")
            )));
        }
    })
}
