//! Loading the model's tensors into typed structs, named exactly like the checkpoint keys.
//!
//! Owns the one load-time quirk of the forward pass: Qwen3-Next's grouped `in_proj_qkvz` /
//! `in_proj_ba` rows are permuted into the flat Qwen3.5 layout (`in_proj_qkv`, `in_proj_z`,
//! `in_proj_b`, `in_proj_a`), a pure row permutation (MODEL.md §2.4), so DeltaNet code sees one
//! layout. Every tensor's dtype and shape is checked against the config; a mismatch names the
//! tensor.

use crate::checkpoint::TensorSource;
use crate::config::{Arch, LayerKind, ModelConfig};
use crate::dtype::{self, DType};
use crate::error::{Error, Result};
use crate::linear::{Linear, Weights};
use crate::quant;

/// One SwiGLU expert (routed or shared).
#[derive(Debug, Clone)]
pub struct Expert {
    pub gate_proj: Linear, // [I, H]
    pub up_proj: Linear,   // [I, H]
    pub down_proj: Linear, // [H, I]
}

/// Gated DeltaNet weights, in the flat (Qwen3.5) projection layout.
#[derive(Debug, Clone)]
#[allow(non_snake_case)]
pub struct DeltaNetWeights {
    pub in_proj_qkv: Linear, // [2·nk·dk + nv·dv, H]: q heads | k heads | v heads
    pub in_proj_z: Linear,   // [nv·dv, H]
    pub in_proj_b: Linear,   // [nv, H]
    pub in_proj_a: Linear,   // [nv, H]
    pub conv1d: Vec<f32>,    // [conv_dim, K]: weight[c, m]; the newest token meets m = K-1
    pub A_log: Vec<f32>,     // [nv]
    pub dt_bias: Vec<f32>,   // [nv]
    pub norm: Vec<f32>,      // [dv], plain multiplier of the gated RMSNorm
    pub out_proj: Linear,    // [H, nv·dv]
}

/// Gated softmax attention weights.
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    pub q_proj: Linear, // [nq·hd·2, H] with gate, per head: query (hd) then gate (hd)
    pub k_proj: Linear, // [nkv·hd, H]
    pub v_proj: Linear, // [nkv·hd, H]
    pub o_proj: Linear, // [H, nq·hd]
    pub q_norm: Vec<f32>, // [hd], stored as MLX's multiplier (1 + w)
    pub k_norm: Vec<f32>, // [hd]
}

/// The token mixer of a layer.
#[derive(Debug, Clone)]
pub enum Mixer {
    Linear(DeltaNetWeights),
    Full(AttentionWeights),
}

/// The resident part of a sparse MoE block (routed experts live in an expert source).
#[derive(Debug, Clone)]
pub struct MoeWeights {
    pub gate: Linear,               // [E, H] router
    pub shared_expert: Expert,      // width Is
    pub shared_expert_gate: Linear, // [1, H]
}

/// One decoder layer's resident weights.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,          // [H]
    pub post_attention_layernorm: Vec<f32>, // [H]
    pub mixer: Mixer,
    pub mlp: MoeWeights,
}

/// Every resident (dense) weight of the model.
#[derive(Debug, Clone)]
pub struct DenseWeights {
    pub embed_tokens: crate::model::embedding::Embedding, // [V, H]
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,  // [H]
    pub lm_head: Linear, // [V, H]
}

impl DenseWeights {
    /// Moves every 4-bit projection that can take them into 16-row tiles
    /// ([`crate::linear::Order::Tiles`], read by the CPU backend's VNNI kernels): the mixers'
    /// projections, the shared experts and the head; not the embedding (read a row at a time)
    /// nor the 8-bit routers. Returns how many moved.
    pub fn tile(&mut self) -> usize {
        let mut mats: Vec<&mut Linear> = vec![&mut self.lm_head];
        for l in &mut self.layers {
            let se = &mut l.mlp.shared_expert;
            mats.extend([&mut se.gate_proj, &mut se.up_proj, &mut se.down_proj]);
            match &mut l.mixer {
                Mixer::Linear(w) => mats.extend([
                    &mut w.in_proj_qkv,
                    &mut w.in_proj_z,
                    &mut w.in_proj_b,
                    &mut w.in_proj_a,
                    &mut w.out_proj,
                ]),
                Mixer::Full(w) => {
                    mats.extend([&mut w.q_proj, &mut w.k_proj, &mut w.v_proj, &mut w.o_proj])
                }
            }
        }
        mats.into_iter()
            .filter_map(|m| m.tile().then_some(()))
            .count()
    }
}

/// Reads tensors for one model, checking them against its config.
pub struct Loader<'a, S: TensorSource + ?Sized> {
    pub store: &'a S,
    pub cfg: &'a ModelConfig,
}

impl<S: TensorSource + ?Sized> std::fmt::Debug for Loader<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("dir", &self.store.dir())
            .finish()
    }
}

impl<'a, S: TensorSource + ?Sized> Loader<'a, S> {
    pub fn new(store: &'a S, cfg: &'a ModelConfig) -> Self {
        Loader { store, cfg }
    }

    /// Loads every dense weight.
    pub fn dense(&self) -> Result<DenseWeights> {
        self.dense_with(None)
    }

    /// Whether the output head is the embedding table (tied, with no `lm_head` of its own).
    fn tied(&self) -> bool {
        self.cfg.tie_word_embeddings && self.store.info("lm_head.weight").is_none()
    }

    /// Bytes of the embedding table that [`Loader::dense_with`] leaves in its file: the whole
    /// table, or 0 when the output head shares it.
    pub fn embedding_on_disk_bytes(&self) -> Result<u64> {
        if self.tied() {
            return Ok(0);
        }
        let (h, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let layout = self.layout("model.embed_tokens", None, v, h)?;
        Ok(layout.tensors().iter().map(|t| t.1.len).sum())
    }

    /// Like [`Loader::dense`]; with `rows_in = Some(file)` (the file holding the store's
    /// tensors), the embedding table stays there and is read a row at a time, unless the
    /// output head shares it.
    pub fn dense_with(&self, rows_in: Option<&std::path::Path>) -> Result<DenseWeights> {
        use crate::model::embedding::{Embedding, EmbeddingRows};
        let c = self.cfg;
        let (h, v) = (c.hidden_size, c.vocab_size);
        let tied = self.tied();
        let (embed_tokens, lm_head) = match rows_in {
            Some(file) if !tied => {
                let layout = self.layout("model.embed_tokens", None, v, h)?;
                let rows = EmbeddingRows::open(file, &layout, v, h)?;
                (
                    Embedding::Rows(std::sync::Arc::new(rows)),
                    self.linear("lm_head", v, h)?,
                )
            }
            _ => {
                let e = self.linear("model.embed_tokens", v, h)?;
                let head = if tied {
                    e.clone()
                } else {
                    self.linear("lm_head", v, h)?
                };
                (Embedding::Resident(e), head)
            }
        };
        let layers = (0..c.num_hidden_layers)
            .map(|i| self.layer(i))
            .collect::<Result<_>>()?;
        Ok(DenseWeights {
            embed_tokens,
            layers,
            norm: self.floats("model.norm.weight", &[h])?,
            lm_head,
        })
    }

    fn layer(&self, i: usize) -> Result<LayerWeights> {
        let c = self.cfg;
        let h = c.hidden_size;
        let p = format!("model.layers.{i}");
        let mixer = match c.layer_types[i] {
            LayerKind::Linear => Mixer::Linear(self.delta_net(&format!("{p}.linear_attn"))?),
            LayerKind::Full => Mixer::Full(self.attention(&format!("{p}.self_attn"))?),
        };
        let mlp = format!("{p}.mlp");
        Ok(LayerWeights {
            input_layernorm: self.floats(&format!("{p}.input_layernorm.weight"), &[h])?,
            post_attention_layernorm: self
                .floats(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            mixer,
            mlp: MoeWeights {
                gate: self.linear(&format!("{mlp}.gate"), c.num_experts, h)?,
                shared_expert: self.expert_at(
                    &format!("{mlp}.shared_expert"),
                    c.shared_expert_intermediate_size,
                )?,
                shared_expert_gate: self.linear(&format!("{mlp}.shared_expert_gate"), 1, h)?,
            },
        })
    }

    fn expert_at(&self, p: &str, width: usize) -> Result<Expert> {
        let h = self.cfg.hidden_size;
        Ok(Expert {
            gate_proj: self.linear(&format!("{p}.gate_proj"), width, h)?,
            up_proj: self.linear(&format!("{p}.up_proj"), width, h)?,
            down_proj: self.linear(&format!("{p}.down_proj"), h, width)?,
        })
    }

    fn attention(&self, p: &str) -> Result<AttentionWeights> {
        let c = self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let q_out = c.num_attention_heads * hd * if c.attn_output_gate { 2 } else { 1 };
        Ok(AttentionWeights {
            q_proj: self.linear(&format!("{p}.q_proj"), q_out, h)?,
            k_proj: self.linear(&format!("{p}.k_proj"), c.num_key_value_heads * hd, h)?,
            v_proj: self.linear(&format!("{p}.v_proj"), c.num_key_value_heads * hd, h)?,
            o_proj: self.linear(&format!("{p}.o_proj"), h, c.num_attention_heads * hd)?,
            q_norm: self.floats(&format!("{p}.q_norm.weight"), &[hd])?,
            k_norm: self.floats(&format!("{p}.k_norm.weight"), &[hd])?,
        })
    }

    fn delta_net(&self, p: &str) -> Result<DeltaNetWeights> {
        let c = self.cfg;
        let h = c.hidden_size;
        let (nk, nv, dk, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let (key_dim, value_dim) = (nk * dk, nv * dv);
        let (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) = match c.arch {
            Arch::Qwen35Moe => (
                self.linear(&format!("{p}.in_proj_qkv"), 2 * key_dim + value_dim, h)?,
                self.linear(&format!("{p}.in_proj_z"), value_dim, h)?,
                self.linear(&format!("{p}.in_proj_b"), nv, h)?,
                self.linear(&format!("{p}.in_proj_a"), nv, h)?,
            ),
            Arch::Qwen3Next => {
                let qkvz =
                    self.linear(&format!("{p}.in_proj_qkvz"), 2 * key_dim + 2 * value_dim, h)?;
                let ba = self.linear(&format!("{p}.in_proj_ba"), 2 * nv, h)?;
                let (qkv_rows, z_rows, b_rows, a_rows) = grouped_row_maps(c);
                (
                    qkvz.select_rows(&qkv_rows),
                    qkvz.select_rows(&z_rows),
                    ba.select_rows(&b_rows),
                    ba.select_rows(&a_rows),
                )
            }
        };
        let k = c.linear_conv_kernel_dim;
        let conv_name = format!("{p}.conv1d.weight");
        let info = self.store.require(&conv_name)?;
        if info.shape != [c.conv_dim(), k, 1] {
            return Err(shape_err(&conv_name, &[c.conv_dim(), k, 1], &info.shape));
        }
        Ok(DeltaNetWeights {
            in_proj_qkv,
            in_proj_z,
            in_proj_b,
            in_proj_a,
            conv1d: self.floats(&conv_name, &[c.conv_dim(), k, 1])?,
            A_log: self.floats(&format!("{p}.A_log"), &[nv])?,
            dt_bias: self.floats(&format!("{p}.dt_bias"), &[nv])?,
            norm: self.floats(&format!("{p}.norm.weight"), &[dv])?,
            out_proj: self.linear(&format!("{p}.out_proj"), h, value_dim)?,
        })
    }

    /// A float tensor of exactly `shape`, widened to f32.
    pub fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let info = self.store.require(name)?;
        if !info.dtype.is_float() {
            return Err(Error::Dtype {
                name: name.into(),
                expected: "F32, BF16 or F16".into(),
                got: info.dtype.to_string(),
            });
        }
        if info.shape != shape {
            return Err(shape_err(name, shape, &info.shape));
        }
        let bytes = self.store.read(name)?;
        let mut out = Vec::with_capacity(info.numel());
        dtype::floats_to_f32(info.dtype, &bytes, &mut out);
        Ok(out)
    }

    /// Module `path` as a linear layer of logical shape [out, in], float or quantized.
    pub fn linear(&self, path: &str, out: usize, inp: usize) -> Result<Linear> {
        let mut v = self.linear_stack(path, None, out, inp)?;
        Ok(v.remove(0))
    }

    /// Routed expert `e` of layer `layer`, read from the stacked `switch_mlp` tensors.
    pub fn routed_expert(&self, layer: usize, e: usize) -> Result<Expert> {
        let c = self.cfg;
        let (h, i) = (c.hidden_size, c.moe_intermediate_size);
        let p = format!("model.layers.{layer}.mlp.switch_mlp");
        let one = |name: &str, out, inp| -> Result<Linear> {
            Ok(self
                .linear_stack(&format!("{p}.{name}"), Some((e, c.num_experts)), out, inp)?
                .remove(0))
        };
        Ok(Expert {
            gate_proj: one("gate_proj", i, h)?,
            up_proj: one("up_proj", i, h)?,
            down_proj: one("down_proj", h, i)?,
        })
    }

    /// Reads a linear (or, with `expert = Some((e, E))`, slice e of a stacked [E, ..] one).
    fn linear_stack(
        &self,
        path: &str,
        expert: Option<(usize, usize)>,
        out: usize,
        inp: usize,
    ) -> Result<Vec<Linear>> {
        let read = |info: &TensorInfo| -> Result<Vec<u8>> {
            let name = &info.0;
            match expert {
                None => self.store.read(name),
                Some((e, n)) => {
                    let per = info.1.len / n as u64;
                    self.store.read_range(name, e as u64 * per, per)
                }
            }
        };
        let lead = expert.map(|(_, n)| n);
        let weights = match self.layout(path, lead, out, inp)? {
            Layout::Float { dtype, weight } => Weights::Float {
                dtype,
                data: read(&weight)?,
            },
            Layout::Affine {
                spec,
                float,
                weight,
                scales,
                biases,
            } => Weights::Affine {
                spec,
                float,
                packed: read(&weight)?,
                scales: read(&scales)?,
                biases: read(&biases)?,
                order: crate::linear::Order::Rows,
            },
        };
        Ok(vec![Linear {
            out_features: out,
            in_features: inp,
            weights,
        }])
    }

    /// The format of linear `path` [out, inp] (with `lead = Some(E)`, of a stacked [E, ..]
    /// one) and where its tensors are, checked against each other and the config; reads
    /// nothing.
    pub(crate) fn layout(
        &self,
        path: &str,
        lead: Option<usize>,
        out: usize,
        inp: usize,
    ) -> Result<Layout> {
        let lead: Vec<usize> = lead.map(|n| vec![n]).unwrap_or_default();
        let shape = |cols: usize| [lead.as_slice(), &[out, cols]].concat();
        let wname = format!("{path}.weight");
        let sname = format!("{path}.scales");
        let winfo = self.store.require(&wname)?;
        if self.store.info(&sname).is_none() {
            if !winfo.dtype.is_float() {
                return Err(Error::Dtype {
                    name: wname,
                    expected: "a float type (no `.scales` tensor, so not quantized)".into(),
                    got: winfo.dtype.to_string(),
                });
            }
            if winfo.shape != shape(inp) {
                return Err(shape_err(&wname, &shape(inp), &winfo.shape));
            }
            return Ok(Layout::Float {
                dtype: winfo.dtype,
                weight: (wname, winfo.clone()),
            });
        }
        if winfo.dtype != DType::U32 {
            return Err(Error::Dtype {
                name: wname,
                expected: "U32 (packed quantized weights)".into(),
                got: winfo.dtype.to_string(),
            });
        }
        let sinfo = self.store.require(&sname)?;
        let spec = quant::spec_from_shapes(&wname, &winfo.shape, &sinfo.shape, lead.len(), inp)?;
        if let Some(Some(cfg_spec)) = self.cfg.quantization.overrides.get(path)
            && *cfg_spec != spec
        {
            return Err(Error::Quantization {
                name: wname,
                reason: format!(
                    "config.json says {} bits group {}, the tensors hold {} bits group {}",
                    cfg_spec.bits, cfg_spec.group_size, spec.bits, spec.group_size
                ),
            });
        }
        let words = quant::words_per_row(inp, spec.bits);
        if winfo.shape != shape(words) {
            return Err(Error::Shape {
                name: wname,
                expected: shape(words),
                got: winfo.shape.clone(),
                hint: format!(" ({} bits, group {})", spec.bits, spec.group_size),
            });
        }
        let groups = inp / spec.group_size;
        let side = |name: String, float: Option<DType>| -> Result<TensorInfo> {
            let info = self.store.require(&name)?;
            if !info.dtype.is_float() || float.is_some_and(|f| f != info.dtype) {
                return Err(Error::Dtype {
                    name,
                    expected: "a float type, the same for scales and biases".into(),
                    got: info.dtype.to_string(),
                });
            }
            if info.shape != shape(groups) {
                return Err(shape_err(&name, &shape(groups), &info.shape));
            }
            Ok((name, info.clone()))
        };
        let scales = side(sname, None)?;
        let float = scales.1.dtype;
        let biases = side(format!("{path}.biases"), Some(float))?;
        Ok(Layout::Affine {
            spec,
            float,
            weight: (wname, winfo.clone()),
            scales,
            biases,
        })
    }
}

/// A tensor's name and location.
pub(crate) type TensorInfo = (String, crate::safetensors::TensorInfo);

/// How a linear is stored, from [`Loader::layout`].
#[derive(Debug)]
pub(crate) enum Layout {
    Float {
        dtype: DType,
        weight: TensorInfo,
    },
    Affine {
        spec: crate::config::QuantSpec,
        float: DType,
        weight: TensorInfo,
        scales: TensorInfo,
        biases: TensorInfo,
    },
}

impl Layout {
    /// Its tensors: the weights, then the scales and biases when quantized.
    pub(crate) fn tensors(&self) -> Vec<&TensorInfo> {
        match self {
            Layout::Float { weight, .. } => vec![weight],
            Layout::Affine {
                weight,
                scales,
                biases,
                ..
            } => vec![weight, scales, biases],
        }
    }
}

fn shape_err(name: &str, expected: &[usize], got: &[usize]) -> Error {
    Error::Shape {
        name: name.to_string(),
        expected: expected.to_vec(),
        got: got.to_vec(),
        hint: String::new(),
    }
}

/// Row maps from Qwen3-Next's grouped projections to the flat layout:
/// (rows of qkvz forming q|k|v, rows forming z, rows of ba forming b, rows forming a).
fn grouped_row_maps(c: &ModelConfig) -> (Vec<usize>, Vec<usize>, Vec<usize>, Vec<usize>) {
    let (nk, dk, dv, r) = (
        c.linear_num_key_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
        c.linear_ratio(),
    );
    let w = 2 * dk + 2 * r * dv; // rows per key-head group of in_proj_qkvz
    let span = |g: usize, from: usize, len: usize| (g * w + from)..(g * w + from + len);
    let mut qkv: Vec<usize> = (0..nk).flat_map(|g| span(g, 0, dk)).collect();
    qkv.extend((0..nk).flat_map(|g| span(g, dk, dk)));
    qkv.extend((0..nk).flat_map(|g| span(g, 2 * dk, r * dv)));
    let z = (0..nk)
        .flat_map(|g| span(g, 2 * dk + r * dv, r * dv))
        .collect();
    let b = (0..nk).flat_map(|g| (g * 2 * r)..(g * 2 * r + r)).collect();
    let a = (0..nk)
        .flat_map(|g| (g * 2 * r + r)..(g * 2 * r + 2 * r))
        .collect();
    (qkv, z, b, a)
}
