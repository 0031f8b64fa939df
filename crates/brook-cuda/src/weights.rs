//! Weights in GPU memory: [`Mat`] describes one matrix to the kernels (the `Mat` struct of
//! kernels/common.cu, field for field), [`DenseGpu`] holds the dense core uploaded once.

use std::sync::Arc;

use brook_core::dtype::DType;
use brook_core::linear::{LinearRef, MatRef};
use brook_core::model::Model;
use brook_core::model::weights::Mixer;
use brook_core::{Error, Result};

use crate::gpu::{DevBuf, Gpu};

/// One weight matrix as the kernels see it. Addresses are absolute for dense weights and
/// offsets inside a slot for routed experts.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mat {
    pub w: u64,
    pub s: u64,
    pub b: u64,
    pub rows: i32,
    pub cols: i32,
    /// 0 for float weights.
    pub bits: i32,
    pub group: i32,
    /// Float weights: 0 f32, 1 bf16, 2 f16.
    pub wtype: i32,
    /// Scales and biases: 0 f32, 1 bf16, 2 f16.
    pub stype: i32,
}

impl Mat {
    /// No matrix (the empty second half of a one-matrix launch).
    pub const NONE: Mat = Mat {
        w: 0,
        s: 0,
        b: 0,
        rows: 0,
        cols: 0,
        bits: 0,
        group: 1,
        wtype: 0,
        stype: 0,
    };
}

fn float_code(d: DType, what: &str) -> Result<i32> {
    match d {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Ok(2),
        other => Err(Error::Device(format!(
            "{what}: the CUDA backend reads f32, bf16 and f16 weights, not {}",
            other.name()
        ))),
    }
}

const ALIGN: usize = 256;

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Where each part of a matrix goes inside one contiguous region, and the [`Mat`] with
/// addresses relative to that region's start.
#[derive(Debug, Clone)]
pub struct Placement {
    pub mat: Mat,
    /// (offset, bytes) of weight, scales and biases (the last two empty for floats).
    pub parts: [(usize, usize); 3],
    pub end: usize,
}

/// Lays out `l` starting at byte `at`.
pub fn place(l: &LinearRef<'_>, at: usize, what: &str) -> Result<Placement> {
    let (rows, cols) = (l.out_features as i32, l.in_features as i32);
    Ok(match l.mat {
        MatRef::Float { dtype, data } => {
            let w = align(at);
            Placement {
                mat: Mat {
                    w: w as u64,
                    rows,
                    cols,
                    bits: 0,
                    wtype: float_code(dtype, what)?,
                    ..Mat::NONE
                },
                parts: [(w, data.len()), (0, 0), (0, 0)],
                end: w + data.len(),
            }
        }
        MatRef::Affine {
            spec,
            float,
            packed,
            scales,
            biases,
            ..
        } => {
            let w = align(at);
            let s = align(w + packed.len());
            let b = align(s + scales.len());
            Placement {
                mat: Mat {
                    w: w as u64,
                    s: s as u64,
                    b: b as u64,
                    rows,
                    cols,
                    bits: spec.bits as i32,
                    group: spec.group_size as i32,
                    wtype: 0,
                    stype: float_code(float, what)?,
                },
                parts: [(w, packed.len()), (s, scales.len()), (b, biases.len())],
                end: b + biases.len(),
            }
        }
    })
}

/// The byte slices of `l` in the order of [`Placement::parts`].
pub fn parts<'a>(l: &LinearRef<'a>) -> [&'a [u8]; 3] {
    match l.mat {
        MatRef::Float { data, .. } => [data, &[], &[]],
        MatRef::Affine {
            packed,
            scales,
            biases,
            ..
        } => [packed, scales, biases],
    }
}

/// Copies `l` into `dst` (a slot image) at its placement, in the checkpoint's row order (a
/// matrix the CPU backend moved into 16-row tiles is moved back).
pub fn copy_into(l: &LinearRef<'_>, p: &Placement, dst: &mut [u8]) {
    if let MatRef::Affine {
        spec,
        float,
        order: brook_core::linear::Order::Tiles,
        ..
    } = l.mat
    {
        let [(o0, n0), (o1, n1), (o2, n2)] = p.parts;
        let (a, rest) = dst.split_at_mut(o1);
        let (b, c) = rest.split_at_mut(o2 - o1);
        let out = [&mut a[o0..o0 + n0], &mut b[..n1], &mut c[..n2]];
        let (rows, n) = (l.out_features, l.in_features);
        return brook_core::linear::untile_bytes(spec, float, rows, n, parts(l), out);
    }
    for ((off, len), src) in p.parts.iter().zip(parts(l)) {
        dst[*off..off + len].copy_from_slice(src);
    }
}

/// The dense core in GPU memory.
#[derive(Debug)]
pub struct DenseGpu {
    pub embed: Mat,
    pub head: Mat,
    pub norm: DevBuf,
    pub layers: Vec<LayerGpu>,
    /// Every allocation behind the `Mat`s above.
    _keep: Vec<DevBuf>,
}

#[derive(Debug)]
pub struct LayerGpu {
    pub input_norm: DevBuf,
    pub post_norm: DevBuf,
    pub mixer: MixerGpu,
    pub router: Mat,
    pub shared_gate: Mat,
    pub shared_up: Mat,
    pub shared_down: Mat,
    pub shared_expert_gate: Mat,
}

#[derive(Debug)]
pub enum MixerGpu {
    Delta {
        qkv: Mat,
        z: Mat,
        b: Mat,
        a: Mat,
        out: Mat,
        conv_w: DevBuf,
        a_log: DevBuf,
        dt_bias: DevBuf,
        norm: DevBuf,
    },
    Attn {
        q: Mat,
        k: Mat,
        v: Mat,
        o: Mat,
        q_norm: DevBuf,
        k_norm: DevBuf,
    },
}

/// Uploads one matrix; the returned [`Mat`] has absolute addresses into the buffer.
pub fn upload_linear(gpu: &Arc<Gpu>, l: &LinearRef<'_>, what: &str) -> Result<(Mat, DevBuf)> {
    let mut up = Uploader {
        gpu,
        keep: Vec::new(),
    };
    let m = up.linear(l, what)?;
    let buf = up
        .keep
        .pop()
        .ok_or_else(|| Error::Device("upload kept nothing".into()))?;
    Ok((m, buf))
}

struct Uploader<'g> {
    gpu: &'g Arc<Gpu>,
    keep: Vec<DevBuf>,
}

impl Uploader<'_> {
    fn linear(&mut self, l: &LinearRef<'_>, what: &str) -> Result<Mat> {
        let p = place(l, 0, what)?;
        let mut img = vec![0u8; p.end];
        copy_into(l, &p, &mut img);
        let buf = self.gpu.upload(&img, what)?;
        let base = buf.ptr;
        self.keep.push(buf);
        let mut m = p.mat;
        m.w += base;
        if m.bits > 0 {
            m.s += base;
            m.b += base;
        }
        Ok(m)
    }

    fn floats(&self, v: &[f32], what: &str) -> Result<DevBuf> {
        self.gpu.upload(v, what)
    }
}

impl DenseGpu {
    /// Uploads the model's dense weights.
    pub fn upload(gpu: &Arc<Gpu>, model: &Model) -> Result<DenseGpu> {
        let d = &model.dense;
        let mut up = Uploader {
            gpu,
            keep: Vec::new(),
        };
        let embed = up.linear(&d.embed_tokens.load()?.view(), "embed_tokens")?;
        let head = up.linear(&d.lm_head.view(), "lm_head")?;
        let norm = up.floats(&d.norm, "norm")?;
        let mut layers = Vec::with_capacity(d.layers.len());
        for (i, l) in d.layers.iter().enumerate() {
            let name = |s: &str| format!("layer {i} {s}");
            let mixer = match &l.mixer {
                Mixer::Linear(w) => MixerGpu::Delta {
                    qkv: up.linear(&w.in_proj_qkv.view(), &name("in_proj_qkv"))?,
                    z: up.linear(&w.in_proj_z.view(), &name("in_proj_z"))?,
                    b: up.linear(&w.in_proj_b.view(), &name("in_proj_b"))?,
                    a: up.linear(&w.in_proj_a.view(), &name("in_proj_a"))?,
                    out: up.linear(&w.out_proj.view(), &name("out_proj"))?,
                    conv_w: up.floats(&w.conv1d, &name("conv1d"))?,
                    a_log: up.floats(&w.A_log, &name("A_log"))?,
                    dt_bias: up.floats(&w.dt_bias, &name("dt_bias"))?,
                    norm: up.floats(&w.norm, &name("norm"))?,
                },
                Mixer::Full(w) => MixerGpu::Attn {
                    q: up.linear(&w.q_proj.view(), &name("q_proj"))?,
                    k: up.linear(&w.k_proj.view(), &name("k_proj"))?,
                    v: up.linear(&w.v_proj.view(), &name("v_proj"))?,
                    o: up.linear(&w.o_proj.view(), &name("o_proj"))?,
                    q_norm: up.floats(&w.q_norm, &name("q_norm"))?,
                    k_norm: up.floats(&w.k_norm, &name("k_norm"))?,
                },
            };
            let se = &l.mlp.shared_expert;
            layers.push(LayerGpu {
                input_norm: up.floats(&l.input_layernorm, &name("input_layernorm"))?,
                post_norm: up.floats(
                    &l.post_attention_layernorm,
                    &name("post_attention_layernorm"),
                )?,
                mixer,
                router: up.linear(&l.mlp.gate.view(), &name("mlp.gate"))?,
                shared_gate: up.linear(&se.gate_proj.view(), &name("shared_expert.gate_proj"))?,
                shared_up: up.linear(&se.up_proj.view(), &name("shared_expert.up_proj"))?,
                shared_down: up.linear(&se.down_proj.view(), &name("shared_expert.down_proj"))?,
                shared_expert_gate: up.linear(
                    &l.mlp.shared_expert_gate.view(),
                    &name("shared_expert_gate"),
                )?,
            });
        }
        Ok(DenseGpu {
            embed,
            head,
            norm,
            layers,
            _keep: up.keep,
        })
    }
}
