//! Model configuration: `config.json` of Qwen3-Next (`qwen3_next`, flat) and Qwen3.5/3.6 MoE
//! (`qwen3_5_moe`, nested `text_config`), plus its MLX `quantization` section.
//!
//! This module is the one place that knows how the two families spell their fields (rope at
//! top level or in `rope_parameters`, `layer_types` or `full_attention_interval`). Everything
//! downstream sees one [`ModelConfig`]. Dimensions are checked for consistency here so the
//! forward pass never meets an impossible shape. Mirrors mlx-lm `qwen3_next.ModelArgs` and
//! `qwen3_5.TextModelArgs`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Which checkpoint family: decides tensor prefixes and the DeltaNet projection layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Arch {
    /// `qwen3_next`: fused, grouped `in_proj_qkvz` / `in_proj_ba`.
    Qwen3Next,
    /// `qwen3_5_moe`: split `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Qwen35Moe,
}

/// The token mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attn`).
    Linear,
    /// Gated softmax attention (`self_attn`).
    Full,
}

/// MLX affine quantization of one module: bits per weight and elements per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

/// The `quantization` section: defaults plus per-module overrides.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Quantization {
    /// Defaults for modules without an override.
    pub default: Option<QuantSpec>,
    /// Module path (canonical, see [`canonical_name`]) → its spec, or `None` where the
    /// checkpoint says the module is not quantized.
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// The spec recorded for module `path` (canonical), if any.
    pub fn spec_for(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(s) => *s,
            None => self.default,
        }
    }
}

/// Everything the forward pass needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub layer_types: Vec<LayerKind>,
    // Gated attention.
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that RoPE rotates (`head_dim × partial_rotary_factor`).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// Whether `q_proj` also produces the output gate (true for every known checkpoint).
    pub attn_output_gate: bool,
    // Gated DeltaNet.
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    // Sparse MoE.
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub quantization: Quantization,
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = crate::util::read_capped_string(&path, crate::util::MAX_CONFIG)
            .map_err(|e| Error::io(&path, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.clone(),
            reason: format!("not valid JSON: {e}"),
        })?;
        Self::from_json(&json).map_err(|e| match e {
            Error::Config { field, reason } => Error::Json {
                path,
                reason: format!("config field `{field}`: {reason}"),
            },
            other => other,
        })
    }

    /// Builds a config from parsed config.json contents.
    pub fn from_json(json: &Value) -> Result<Self> {
        let top = json
            .as_object()
            .ok_or_else(|| Error::config("(root)", "config.json must be a JSON object"))?;
        let model_type = top
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::config("model_type", "missing"))?;
        let (arch, text, prefix) = match model_type {
            "qwen3_next" => (Arch::Qwen3Next, top, ""),
            "qwen3_5_moe" => {
                let text = top
                    .get("text_config")
                    .and_then(Value::as_object)
                    .ok_or_else(|| Error::config("text_config", "missing for qwen3_5_moe"))?;
                (Arch::Qwen35Moe, text, "text_config.")
            }
            "qwen3_5_moe_text" => (Arch::Qwen35Moe, top, ""),
            other => return Err(Error::UnknownModelType(other.to_string())),
        };
        let f = Fields { obj: text, prefix };
        let rope = text.get("rope_parameters").and_then(Value::as_object);
        let rope_f = rope.map(|obj| Fields {
            obj,
            prefix: "rope_parameters.",
        });

        let hidden_size = f.usize("hidden_size")?;
        let num_hidden_layers = f.usize("num_hidden_layers")?;
        let layer_types = layer_types(&f, num_hidden_layers)?;
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None => hidden_size / f.usize("num_attention_heads")?.max(1),
        };
        let partial = match f.opt_f64("partial_rotary_factor")? {
            Some(p) => p,
            None => match &rope_f {
                Some(r) => r.opt_f64("partial_rotary_factor")?.unwrap_or(1.0),
                None => 1.0,
            },
        };
        let rope_theta = match f.opt_f64("rope_theta")? {
            Some(t) => t,
            None => match &rope_f {
                Some(r) => r.opt_f64("rope_theta")?.unwrap_or(10_000.0),
                None => 10_000.0,
            },
        };
        if let Some(scaling) = text.get("rope_scaling").filter(|v| !v.is_null()) {
            let kind = scaling
                .get("rope_type")
                .or_else(|| scaling.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("?");
            if kind != "default" {
                return Err(Error::config(
                    format!("{prefix}rope_scaling"),
                    format!("rope type `{kind}` is not supported yet (only plain RoPE)"),
                ));
            }
        }
        let rotary_dim = (head_dim as f64 * partial).round() as usize;

        let sparse_step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        let mlp_only = text
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .map_or(0, Vec::len);
        if sparse_step != 1 || mlp_only != 0 {
            return Err(Error::config(
                format!("{prefix}decoder_sparse_step / mlp_only_layers"),
                "dense MLP layers are not supported: every layer must be a sparse MoE layer",
            ));
        }

        let eos_token_ids = token_ids(text.get("eos_token_id"))
            .or_else(|| token_ids(top.get("eos_token_id")))
            .unwrap_or_default();
        let bos_token_id = token_ids(text.get("bos_token_id"))
            .or_else(|| token_ids(top.get("bos_token_id")))
            .and_then(|v| v.first().copied());
        let tie = f
            .opt_bool("tie_word_embeddings")?
            .or(top.get("tie_word_embeddings").and_then(Value::as_bool))
            .unwrap_or(false);

        let cfg = ModelConfig {
            arch,
            hidden_size,
            num_hidden_layers,
            vocab_size: f.usize("vocab_size")?,
            rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            tie_word_embeddings: tie,
            layer_types,
            num_attention_heads: f.usize("num_attention_heads")?,
            num_key_value_heads: f.usize("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta,
            attn_output_gate: f.opt_bool("attn_output_gate")?.unwrap_or(true),
            linear_num_key_heads: f.usize("linear_num_key_heads")?,
            linear_num_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_head_dim: f.usize("linear_key_head_dim")?,
            linear_value_head_dim: f.usize("linear_value_head_dim")?,
            linear_conv_kernel_dim: f.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            num_experts: f.usize("num_experts")?,
            num_experts_per_tok: f.usize("num_experts_per_tok")?,
            moe_intermediate_size: f.usize("moe_intermediate_size")?,
            shared_expert_intermediate_size: f.usize("shared_expert_intermediate_size")?,
            norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(true),
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(262_144),
            bos_token_id,
            eos_token_ids,
            quantization: quantization(top)?,
        };
        cfg.validate(prefix)?;
        Ok(cfg)
    }

    fn validate(&self, prefix: &str) -> Result<()> {
        let field = |name: &str| format!("{prefix}{name}");
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("vocab_size", self.vocab_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Error::config(field(name), "must be positive"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(Error::config(
                field("num_key_value_heads"),
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            return Err(Error::config(
                field("linear_num_value_heads"),
                format!(
                    "{} is not a multiple of linear_num_key_heads {}",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return Err(Error::config(
                field("partial_rotary_factor"),
                format!(
                    "gives a rotary dimension of {} for head_dim {}; it must be even and at most head_dim",
                    self.rotary_dim, self.head_dim
                ),
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(Error::config(
                field("num_experts_per_tok"),
                format!(
                    "{} exceeds num_experts {}",
                    self.num_experts_per_tok, self.num_experts
                ),
            ));
        }
        if let Some(&id) = self
            .eos_token_ids
            .iter()
            .chain(&self.bos_token_id)
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return Err(Error::config(
                field("eos_token_id"),
                format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.vocab_size
                ),
            ));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(Error::config(field("rms_norm_eps"), "must be positive"));
        }
        Ok(())
    }

    /// DeltaNet value heads per key head.
    pub fn linear_ratio(&self) -> usize {
        self.linear_num_value_heads / self.linear_num_key_heads
    }

    /// Floats of a DeltaNet layer's carried conv rows: the last K−1 inputs.
    pub fn conv_state_len(&self) -> usize {
        (self.linear_conv_kernel_dim - 1) * self.conv_dim()
    }

    /// Floats of a DeltaNet layer's recurrent state, [nv, dk, dv].
    pub fn ssm_state_len(&self) -> usize {
        self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
    }

    /// Width of the DeltaNet convolution input, q | k | v.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Full-attention layers (the rest are DeltaNet layers).
    pub fn attention_layers(&self) -> usize {
        self.layer_types
            .iter()
            .filter(|k| **k == LayerKind::Full)
            .count()
    }

    /// Bytes of sequence state one decoded token moves besides the weights, with `cached`
    /// positions in the attention layers' caches: each DeltaNet layer's recurrent state read
    /// and written whole (`ssm_bytes` a value: 4 for f32, 2 where the CPU's fast path holds
    /// bf16) and its conv rows read and shifted (f32), each attention layer's cached keys and
    /// values read and one new row of each written (f32).
    pub fn decode_state_bytes(&self, cached: usize, ssm_bytes: usize) -> u64 {
        let full = self.attention_layers();
        let linear = self.num_hidden_layers.saturating_sub(full);
        let delta = 2 * (self.ssm_state_len() * ssm_bytes + self.conv_state_len() * 4);
        let kv = 2 * self.num_key_value_heads * self.head_dim * 4 * (cached + 1);
        (linear * delta + full * kv) as u64
    }
}

/// Canonical tensor/module name: the Qwen3.5 `language_model.` prefix removed, so both
/// families name `model.layers.N…`, `model.embed_tokens`, `model.norm` and `lm_head`.
pub fn canonical_name(name: &str) -> &str {
    name.strip_prefix("language_model.").unwrap_or(name)
}

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| {
                    Error::config(
                        self.name(key),
                        format!("expected a non-negative integer, got {v}"),
                    )
                })?;
                let max = max_of(key);
                if n > max as u64 {
                    return Err(Error::config(
                        self.name(key),
                        format!(
                            "{n} is beyond what any model of this family uses (at most {max} is accepted); the config is corrupt or not for this model"
                        ),
                    ));
                }
                Ok(Some(n as usize))
            }
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| Error::config(self.name(key), "missing"))
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                Error::config(self.name(key), format!("expected a number, got {v}"))
            }),
        }
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                Error::config(self.name(key), format!("expected true or false, got {v}"))
            }),
        }
    }
}

/// The largest value accepted for an integer config field: tens of times what the largest
/// published models of this family use, so every size computed from them (buffers, files,
/// products of several fields) stays far from overflow and from allocating without bound.
fn max_of(key: &str) -> usize {
    match key {
        "num_hidden_layers" => 1024,
        "vocab_size" => 1 << 22,
        "hidden_size" | "moe_intermediate_size" | "num_experts" => 1 << 16,
        "shared_expert_intermediate_size" => 1 << 18,
        "head_dim" | "linear_key_head_dim" | "linear_value_head_dim" => 1 << 12,
        "num_attention_heads"
        | "num_key_value_heads"
        | "linear_num_key_heads"
        | "linear_num_value_heads"
        | "num_experts_per_tok" => 1 << 10,
        "linear_conv_kernel_dim" | "full_attention_interval" | "decoder_sparse_step" => 64,
        "max_position_embeddings" => 1 << 24,
        _ => 1 << 24,
    }
}

fn layer_types(f: &Fields<'_>, n: usize) -> Result<Vec<LayerKind>> {
    if let Some(v) = f.obj.get("layer_types").filter(|v| !v.is_null()) {
        let arr = v
            .as_array()
            .ok_or_else(|| Error::config(f.name("layer_types"), "expected a list"))?;
        if arr.len() != n {
            return Err(Error::config(
                f.name("layer_types"),
                format!("has {} entries but num_hidden_layers is {n}", arr.len()),
            ));
        }
        return arr
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("linear_attention") => Ok(LayerKind::Linear),
                Some("full_attention") => Ok(LayerKind::Full),
                _ => Err(Error::config(
                    format!("{}[{i}]", f.name("layer_types")),
                    format!("expected \"linear_attention\" or \"full_attention\", got {t}"),
                )),
            })
            .collect();
    }
    let interval = f.opt_usize("full_attention_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(Error::config(
            f.name("full_attention_interval"),
            "must be positive",
        ));
    }
    Ok((0..n)
        .map(|i| {
            if (i + 1) % interval == 0 {
                LayerKind::Full
            } else {
                LayerKind::Linear
            }
        })
        .collect())
}

/// Token ids of a config field (one or a list); ids that cannot be token ids (negative, not
/// integers, past u32) are dropped here and ids past the vocabulary refused by `validate`.
fn token_ids(v: Option<&Value>) -> Option<Vec<u32>> {
    let id = |n: &Value| n.as_u64().and_then(|n| u32::try_from(n).ok());
    match v? {
        Value::Number(_) => v.and_then(id).map(|n| vec![n]),
        Value::Array(a) => Some(a.iter().filter_map(id).collect()),
        _ => None,
    }
}

fn quant_spec(field: &str, v: &Value, fallback: Option<QuantSpec>) -> Result<QuantSpec> {
    let obj = v
        .as_object()
        .ok_or_else(|| Error::config(field, format!("expected an object, got {v}")))?;
    let get = |k: &str| obj.get(k).and_then(Value::as_u64);
    let bits = get("bits")
        .map(|b| b as u32)
        .or(fallback.map(|s| s.bits))
        .ok_or_else(|| Error::config(format!("{field}.bits"), "missing"))?;
    let group_size = get("group_size")
        .map(|g| g as usize)
        .or(fallback.map(|s| s.group_size))
        .ok_or_else(|| Error::config(format!("{field}.group_size"), "missing"))?;
    if let Some(mode) = obj.get("mode").and_then(Value::as_str)
        && mode != "affine"
    {
        return Err(Error::config(
            format!("{field}.mode"),
            format!("`{mode}` quantization is not supported; brook reads MLX affine checkpoints"),
        ));
    }
    Ok(QuantSpec { bits, group_size })
}

fn quantization(top: &Map<String, Value>) -> Result<Quantization> {
    let Some(q) = top
        .get("quantization")
        .or_else(|| top.get("quantization_config"))
        .filter(|v| !v.is_null())
    else {
        return Ok(Quantization::default());
    };
    let obj = q
        .as_object()
        .ok_or_else(|| Error::config("quantization", "expected an object"))?;
    let has_default = obj.contains_key("bits") || obj.contains_key("group_size");
    let default = if has_default {
        Some(quant_spec(
            "quantization",
            q,
            Some(QuantSpec {
                bits: 4,
                group_size: 64,
            }),
        )?)
    } else {
        None
    };
    let mut overrides = BTreeMap::new();
    for (k, v) in obj {
        if matches!(k.as_str(), "bits" | "group_size" | "mode") {
            continue;
        }
        let field = format!("quantization.{k}");
        let spec = match v {
            Value::Bool(false) => None,
            Value::Object(_) => Some(quant_spec(&field, v, default)?),
            _ => continue,
        };
        overrides.insert(canonical_name(k).to_string(), spec);
    }
    Ok(Quantization { default, overrides })
}
