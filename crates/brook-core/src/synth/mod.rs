//! Synthetic checkpoints with the real shapes, names, dtypes and quantization of the released
//! models, generated deterministically on demand, so speed and memory can be measured at full
//! scale without a download.
//!
//! [`SynthModel`] is a [`TensorSource`] whose bytes are computed from (seed, tensor, row): any
//! byte range can be produced independently, so a 42 GB checkpoint or container is written
//! without holding more than a few rows in memory, and the same model written as a checkpoint
//! or directly as a container is byte-identical. Quantized weights are uniform random codes
//! with scales and biases chosen so each dequantized row has mean 0 and standard deviation
//! gain/√in, which keeps activations finite and of realistic size through every layer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::checkpoint::TensorSource;
use crate::config::{Arch, LayerKind, ModelConfig, canonical_name};
use crate::container::{SourceIdentity, repack::RepackSource};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::safetensors::TensorInfo;

mod presets;
mod text;
mod write;
pub use presets::{PRESETS, preset_config};
pub use text::{text_files, write_text_files};
pub use write::{SHARD_BYTES, check_free_space, free_space, prepare_empty, write_checkpoint};

/// How a synthetic tensor's bytes are made.
#[derive(Debug, Clone, Copy)]
enum Fill {
    /// Uniform random codes (packed U32 weight).
    Codes,
    /// Quantization scales for rows of σ = gain/√in at `bits`.
    Scales { gain: f32, inp: usize, bits: u32 },
    /// Quantization biases matching [`Fill::Scales`].
    Biases { gain: f32, inp: usize, bits: u32 },
    /// Floats uniform in [lo, hi].
    Uniform { lo: f32, hi: f32 },
}

#[derive(Debug, Clone)]
struct SynthTensor {
    info: TensorInfo,
    fill: Fill,
    /// Bytes per generated row.
    row_bytes: u64,
    seed: u64,
    /// Seed shared by a module's scales and biases.
    pair_seed: u64,
}

/// A synthetic model served as tensors.
#[derive(Debug)]
pub struct SynthModel {
    pub preset: String,
    pub bits: u32,
    pub config: ModelConfig,
    /// config.json with its quantization section, as mlx-lm writes it.
    pub config_json: Value,
    dir: PathBuf,
    tensors: BTreeMap<String, SynthTensor>,
}

/// Quantization group size of synthetic checkpoints (mlx-lm's default).
pub const GROUP: usize = 64;

impl SynthModel {
    /// The synthetic model `preset` at `bits` (4 or 8) with routers at 8 bits.
    pub fn new(preset: &str, bits: u32, seed: u64) -> Result<Self> {
        Self::from_config(preset, preset_config(preset)?, bits, seed)
    }

    /// A synthetic model of any config.json of the two families (without `quantization`).
    pub fn from_config(preset: &str, mut config_json: Value, bits: u32, seed: u64) -> Result<Self> {
        if bits != 4 && bits != 8 {
            return Err(Error::Invalid(format!("--bits must be 4 or 8, not {bits}")));
        }
        let cfg = ModelConfig::from_json(&config_json)?;
        let prefix = if cfg.arch == Arch::Qwen35Moe {
            "language_model."
        } else {
            ""
        };
        let mut q = serde_json::Map::new();
        q.insert("group_size".into(), json!(GROUP));
        q.insert("bits".into(), json!(bits));
        q.insert("mode".into(), json!("affine"));
        for l in 0..cfg.num_hidden_layers {
            for m in ["mlp.gate", "mlp.shared_expert_gate"] {
                q.insert(
                    format!("{prefix}model.layers.{l}.{m}"),
                    json!({"group_size": GROUP, "bits": 8}),
                );
            }
        }
        config_json["quantization"] = Value::Object(q.clone());
        config_json["quantization_config"] = Value::Object(q);
        let cfg = ModelConfig::from_json(&config_json)?;
        let mut s = SynthModel {
            preset: preset.to_string(),
            bits,
            config: cfg.clone(),
            config_json,
            dir: PathBuf::from(format!("synth:{preset}")),
            tensors: BTreeMap::new(),
        };
        s.build(&cfg, seed);
        Ok(s)
    }

    fn build(&mut self, c: &ModelConfig, seed: u64) {
        let (h, v) = (c.hidden_size, c.vocab_size);
        let b = self.bits;
        self.quantized("model.embed_tokens", &[], v, h, b, (h as f32).sqrt(), seed);
        self.quantized("lm_head", &[], v, h, b, 2.0, seed);
        self.floats("model.norm.weight", &[h], DType::BF16, 0.9, 1.1, seed);
        let (nk, nv, dk, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let (nq, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (e, i, is) = (
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            self.floats(
                &format!("{p}.input_layernorm.weight"),
                &[h],
                DType::BF16,
                0.9,
                1.1,
                seed,
            );
            self.floats(
                &format!("{p}.post_attention_layernorm.weight"),
                &[h],
                DType::BF16,
                0.9,
                1.1,
                seed,
            );
            match c.layer_types[l] {
                LayerKind::Linear => {
                    let a = format!("{p}.linear_attn");
                    match c.arch {
                        Arch::Qwen35Moe => {
                            self.quantized(
                                &format!("{a}.in_proj_qkv"),
                                &[],
                                2 * nk * dk + nv * dv,
                                h,
                                b,
                                1.0,
                                seed,
                            );
                            self.quantized(
                                &format!("{a}.in_proj_z"),
                                &[],
                                nv * dv,
                                h,
                                b,
                                1.0,
                                seed,
                            );
                            self.quantized(&format!("{a}.in_proj_b"), &[], nv, h, b, 1.0, seed);
                            self.quantized(&format!("{a}.in_proj_a"), &[], nv, h, b, 1.0, seed);
                        }
                        Arch::Qwen3Next => {
                            self.quantized(
                                &format!("{a}.in_proj_qkvz"),
                                &[],
                                2 * nk * dk + 2 * nv * dv,
                                h,
                                b,
                                1.0,
                                seed,
                            );
                            self.quantized(
                                &format!("{a}.in_proj_ba"),
                                &[],
                                2 * nv,
                                h,
                                b,
                                1.0,
                                seed,
                            );
                        }
                    }
                    self.floats(
                        &format!("{a}.conv1d.weight"),
                        &[c.conv_dim(), c.linear_conv_kernel_dim, 1],
                        DType::BF16,
                        -0.5,
                        0.5,
                        seed,
                    );
                    let a_log = if c.arch == Arch::Qwen35Moe {
                        DType::F32
                    } else {
                        DType::BF16
                    };
                    self.floats(&format!("{a}.A_log"), &[nv], a_log, 0.0, 1.5, seed);
                    self.floats(&format!("{a}.dt_bias"), &[nv], DType::BF16, -0.5, 0.5, seed);
                    self.floats(
                        &format!("{a}.norm.weight"),
                        &[dv],
                        DType::BF16,
                        0.9,
                        1.1,
                        seed,
                    );
                    self.quantized(&format!("{a}.out_proj"), &[], h, nv * dv, b, 0.5, seed);
                }
                LayerKind::Full => {
                    let a = format!("{p}.self_attn");
                    self.quantized(&format!("{a}.q_proj"), &[], nq * hd * 2, h, b, 1.0, seed);
                    self.quantized(&format!("{a}.k_proj"), &[], nkv * hd, h, b, 1.0, seed);
                    self.quantized(&format!("{a}.v_proj"), &[], nkv * hd, h, b, 1.0, seed);
                    self.quantized(&format!("{a}.o_proj"), &[], h, nq * hd, b, 0.5, seed);
                    self.floats(
                        &format!("{a}.q_norm.weight"),
                        &[hd],
                        DType::BF16,
                        0.9,
                        1.1,
                        seed,
                    );
                    self.floats(
                        &format!("{a}.k_norm.weight"),
                        &[hd],
                        DType::BF16,
                        0.9,
                        1.1,
                        seed,
                    );
                }
            }
            let m = format!("{p}.mlp");
            self.quantized(&format!("{m}.gate"), &[], e, h, 8, 3.0, seed);
            self.quantized(&format!("{m}.shared_expert_gate"), &[], 1, h, 8, 1.0, seed);
            self.quantized(
                &format!("{m}.shared_expert.gate_proj"),
                &[],
                is,
                h,
                b,
                1.0,
                seed,
            );
            self.quantized(
                &format!("{m}.shared_expert.up_proj"),
                &[],
                is,
                h,
                b,
                1.0,
                seed,
            );
            self.quantized(
                &format!("{m}.shared_expert.down_proj"),
                &[],
                h,
                is,
                b,
                0.5,
                seed,
            );
            self.quantized(
                &format!("{m}.switch_mlp.gate_proj"),
                &[e],
                i,
                h,
                b,
                1.0,
                seed,
            );
            self.quantized(&format!("{m}.switch_mlp.up_proj"), &[e], i, h, b, 1.0, seed);
            self.quantized(
                &format!("{m}.switch_mlp.down_proj"),
                &[e],
                h,
                i,
                b,
                0.5,
                seed,
            );
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn quantized(
        &mut self,
        path: &str,
        lead: &[usize],
        out: usize,
        inp: usize,
        bits: u32,
        gain: f32,
        seed: u64,
    ) {
        let groups = inp / GROUP;
        let words = inp * bits as usize / 32;
        let shape = |cols: usize| [lead, &[out, cols]].concat();
        self.add(
            format!("{path}.weight"),
            DType::U32,
            shape(words),
            Fill::Codes,
            words as u64 * 4,
            seed,
        );
        self.add(
            format!("{path}.scales"),
            DType::BF16,
            shape(groups),
            Fill::Scales { gain, inp, bits },
            groups as u64 * 2,
            seed,
        );
        self.add(
            format!("{path}.biases"),
            DType::BF16,
            shape(groups),
            Fill::Biases { gain, inp, bits },
            groups as u64 * 2,
            seed,
        );
    }

    fn floats(&mut self, name: &str, shape: &[usize], dtype: DType, lo: f32, hi: f32, seed: u64) {
        let row = *shape.first().unwrap_or(&1) as u64;
        let numel: usize = shape.iter().product();
        let row_bytes = (numel * dtype.size()) as u64 / row.max(1);
        self.add(
            name.to_string(),
            dtype,
            shape.to_vec(),
            Fill::Uniform { lo, hi },
            row_bytes,
            seed,
        );
    }

    fn add(
        &mut self,
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        fill: Fill,
        row_bytes: u64,
        seed: u64,
    ) {
        let len = (shape.iter().product::<usize>() * dtype.size()) as u64;
        let module = name.rsplit_once('.').map_or(name.as_str(), |(m, _)| m);
        let pair_seed = seed ^ xxhash_rust::xxh3::xxh3_64(module.as_bytes());
        let seed = seed ^ xxhash_rust::xxh3::xxh3_64(name.as_bytes());
        self.tensors.insert(
            name,
            SynthTensor {
                info: TensorInfo {
                    dtype,
                    shape,
                    offset: 0,
                    len,
                },
                fill,
                row_bytes,
                seed,
                pair_seed,
            },
        );
    }

    /// The stored (checkpoint) name of canonical tensor `name`.
    pub fn stored_name(&self, name: &str) -> String {
        match self.config.arch {
            Arch::Qwen35Moe => format!("language_model.{name}"),
            Arch::Qwen3Next => name.to_string(),
        }
    }

    /// generation_config.json of the preset.
    pub fn generation_config(&self) -> Value {
        json!({"eos_token_id": self.config.eos_token_ids, "bos_token_id": self.config.bos_token_id,
               "temperature": 1.0, "top_k": 20, "top_p": 0.95, "do_sample": true})
    }

    /// The source description for repacking straight into a container.
    pub fn repack_source(&self) -> RepackSource<'_> {
        RepackSource {
            store: self,
            config: self.config.clone(),
            config_json: self.config_json.clone(),
            generation_config: Some(self.generation_config()),
            identity: SourceIdentity {
                name: format!("synth:{}:{}bit", self.preset, self.bits),
                files: Vec::new(),
            },
            extra_files: Vec::new(),
        }
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.info.len).sum()
    }
}

impl TensorSource for SynthModel {
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(canonical_name(name)).map(|t| &t.info)
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len as usize];
        self.read_range_into(name, offset, &mut out)?;
        Ok(out)
    }

    fn read_range_into(&self, name: &str, offset: u64, out: &mut [u8]) -> Result<()> {
        let len = out.len() as u64;
        let t = self
            .tensors
            .get(canonical_name(name))
            .ok_or_else(|| Error::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
            })?;
        if offset + len > t.info.len {
            return Err(Error::Invalid(format!(
                "read past the end of tensor `{name}`"
            )));
        }
        let mut row = Vec::new();
        let first = offset / t.row_bytes;
        let last = (offset + len).div_ceil(t.row_bytes);
        let mut at = 0usize;
        for r in first..last {
            let start = offset.saturating_sub(r * t.row_bytes) as usize;
            let end = ((offset + len) - r * t.row_bytes).min(t.row_bytes) as usize;
            let n = end - start;
            if n == t.row_bytes as usize {
                // Whole rows are generated in place; only a partial first or last row is staged.
                fill_row(t, r, &mut out[at..at + n]);
            } else {
                row.resize(t.row_bytes as usize, 0);
                fill_row(t, r, &mut row);
                out[at..at + n].copy_from_slice(&row[start..end]);
            }
            at += n;
        }
        Ok(())
    }
}

fn fill_row(t: &SynthTensor, row: u64, out: &mut [u8]) {
    let mut rng = WyRand(t.seed ^ row.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    match t.fill {
        Fill::Codes => {
            for chunk in out.chunks_mut(8) {
                let v = rng.next().to_le_bytes();
                chunk.copy_from_slice(&v[..chunk.len()]);
            }
        }
        Fill::Scales { gain, inp, bits } | Fill::Biases { gain, inp, bits } => {
            // Uniform codes in [0, n] have standard deviation √((n+1)²−1)/√12.
            let n = ((1u32 << bits) - 1) as f32;
            let code_sd = (((n + 1.0) * (n + 1.0) - 1.0) / 12.0).sqrt();
            let is_bias = matches!(t.fill, Fill::Biases { .. });
            // Scales and biases of one row draw the same jitter (seeded by the module path,
            // not the tensor name) so each bias centres its own scale.
            let mut pair = WyRand(t.pair_seed ^ row.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            for v in out.chunks_exact_mut(2) {
                let jitter = 0.8 + 0.4 * pair.unit();
                let s = gain / (inp as f32).sqrt() / code_sd * jitter;
                let x = if is_bias { -s * n / 2.0 } else { s };
                v.copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        Fill::Uniform { lo, hi } => match t.info.dtype {
            DType::F32 => {
                for v in out.chunks_exact_mut(4) {
                    v.copy_from_slice(&(lo + (hi - lo) * rng.unit()).to_le_bytes());
                }
            }
            _ => {
                for v in out.chunks_exact_mut(2) {
                    let x = half::bf16::from_f32(lo + (hi - lo) * rng.unit());
                    v.copy_from_slice(&x.to_bits().to_le_bytes());
                }
            }
        },
    }
}

/// wyrand: a tiny, fast, well-mixed 64-bit generator (Wang Yi's public-domain design).
struct WyRand(u64);

impl WyRand {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = u128::from(self.0) * u128::from(self.0 ^ 0xe703_7ed1_a0b4_28db);
        ((t >> 64) as u64) ^ (t as u64)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}
