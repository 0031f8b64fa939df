//! Gated DeltaNet (`linear_attn`): projections, causal depthwise conv, the gated delta rule
//! (recurrent and chunked), gated RMSNorm and output projection.
//!
//! Mirrors mlx-lm `qwen3_next.Qwen3NextGatedDeltaNet` and `gated_delta.py`: q and k are
//! normalised as q = dk⁻¹·rms_norm(q), k = dk^(−1/2)·rms_norm(k), the decay is
//! α = exp(−exp(A_log)·softplus(a + dt_bias)), β = sigmoid(b), and value head h reads key head
//! h / (nv/nk). The chunked form is the same recurrence solved a chunk at a time (MODEL.md
//! §2.4); tests check the two agree. mlx-lm 0.32 normalises with an RMS ε of 1e-6/dk, which
//! makes q = l2(q)/√dk and k = l2(k) with 1e-6 added to Σx², exactly as HF does.

use crate::config::ModelConfig;
use crate::model::ops::{rms_norm, rms_norm_scaled_inplace, sigmoid, silu, softplus};
use crate::model::weights::DeltaNetWeights;

/// Tokens per chunk of the chunked form (HF and FLA use 64).
pub const CHUNK: usize = 64;

/// How the delta rule is evaluated over several tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeltaMode {
    /// Chunked for multi-token calls, recurrent for one token.
    #[default]
    Auto,
    /// Token by token, always.
    Recurrent,
    /// Chunk by chunk, always.
    Chunked,
}

/// Per-token gate and head inputs of the delta rule for one call.
#[derive(Debug)]
pub struct DeltaInputs<'a> {
    pub q: &'a [f32],    // [T, nk, dk], normalised and scaled
    pub k: &'a [f32],    // [T, nk, dk], normalised
    pub v: &'a [f32],    // [T, nv, dv]
    pub g: &'a [f32],    // [T, nv] log-decay (≤ 0)
    pub beta: &'a [f32], // [T, nv]
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Runs one DeltaNet layer on x[T, H], updating `conv` and `ssm` state, writing out[T, H].
pub fn forward(
    w: &DeltaNetWeights,
    cfg: &ModelConfig,
    conv_state: &mut [f32],
    ssm: &mut [f32],
    x: &[f32],
    mode: DeltaMode,
    out: &mut [f32],
) {
    let h = cfg.hidden_size;
    let t = x.len() / h;
    let (nk, nv, dk, dv) = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    );
    let (cd, kk) = (cfg.conv_dim(), cfg.linear_conv_kernel_dim);
    let key_dim = nk * dk;

    let mut qkv = vec![0.0; t * cd]; // [T, conv_dim] pre-activation
    let mut z = vec![0.0; t * nv * dv];
    let mut b = vec![0.0; t * nv];
    let mut a = vec![0.0; t * nv];
    w.in_proj_qkv.forward_rows(x, &mut qkv);
    w.in_proj_z.forward_rows(x, &mut z);
    w.in_proj_b.forward_rows(x, &mut b);
    w.in_proj_a.forward_rows(x, &mut a);

    // Causal depthwise conv over [state (K-1 rows) ; qkv (T rows)], then SiLU.
    let mut seq = Vec::with_capacity((kk - 1 + t) * cd);
    seq.extend_from_slice(conv_state);
    seq.extend_from_slice(&qkv);
    let mut conv = vec![0.0; t * cd];
    for ti in 0..t {
        for c in 0..cd {
            let acc: f32 = (0..kk)
                .map(|m| w.conv1d[c * kk + m] * seq[(ti + m) * cd + c])
                .sum();
            conv[ti * cd + c] = silu(acc);
        }
    }
    conv_state.copy_from_slice(&seq[t * cd..]);

    let mut q = vec![0.0; t * key_dim];
    let mut k = vec![0.0; t * key_dim];
    let mut v = vec![0.0; t * nv * dv];
    let inv_scale = (dk as f32).powf(-0.5);
    for ti in 0..t {
        let row = &conv[ti * cd..(ti + 1) * cd];
        q[ti * key_dim..(ti + 1) * key_dim].copy_from_slice(&row[..key_dim]);
        k[ti * key_dim..(ti + 1) * key_dim].copy_from_slice(&row[key_dim..2 * key_dim]);
        v[ti * nv * dv..(ti + 1) * nv * dv].copy_from_slice(&row[2 * key_dim..]);
    }
    let eps = 1e-6 / dk as f32;
    for head in q.chunks_exact_mut(dk) {
        rms_norm_scaled_inplace(head, eps, inv_scale * inv_scale);
    }
    for head in k.chunks_exact_mut(dk) {
        rms_norm_scaled_inplace(head, eps, inv_scale);
    }
    let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
    let g: Vec<f32> = (0..t * nv)
        .map(|i| -w.A_log[i % nv].exp() * softplus(a[i] + w.dt_bias[i % nv]))
        .collect();

    let inputs = DeltaInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
        nk,
        nv,
        dk,
        dv,
    };
    let mut o = vec![0.0; t * nv * dv];
    let chunked = match mode {
        DeltaMode::Auto => t > 1,
        DeltaMode::Recurrent => false,
        DeltaMode::Chunked => true,
    };
    if chunked {
        delta_rule_chunked(&inputs, ssm, &mut o);
    } else {
        delta_rule_recurrent(&inputs, ssm, &mut o);
    }

    // Gated RMSNorm per value head: rms_norm(o; w) · silu(z).
    let mut y = vec![0.0; t * nv * dv];
    for ((yh, oh), zh) in y
        .chunks_exact_mut(dv)
        .zip(o.chunks_exact(dv))
        .zip(z.chunks_exact(dv))
    {
        rms_norm(oh, &w.norm, cfg.rms_norm_eps, yh);
        for (yi, &zi) in yh.iter_mut().zip(zh) {
            *yi *= silu(zi);
        }
    }
    w.out_proj.forward_rows(&y, out);
}

/// The gated delta rule one token at a time. `s` is [nv, dk, dv]; `o` is [T, nv, dv].
pub fn delta_rule_recurrent(x: &DeltaInputs<'_>, s: &mut [f32], o: &mut [f32]) {
    let (nk, nv, dk, dv) = (x.nk, x.nv, x.dk, x.dv);
    let r = nv / nk;
    let t = x.g.len() / nv;
    let mut u = vec![0.0; dv];
    for ti in 0..t {
        for h in 0..nv {
            let kh = h / r;
            let q = &x.q[(ti * nk + kh) * dk..][..dk];
            let k = &x.k[(ti * nk + kh) * dk..][..dk];
            let v = &x.v[(ti * nv + h) * dv..][..dv];
            let alpha = x.g[ti * nv + h].exp();
            let beta = x.beta[ti * nv + h];
            let st = &mut s[h * dk * dv..(h + 1) * dk * dv];
            st.iter_mut().for_each(|e| *e *= alpha);
            u.iter_mut().for_each(|e| *e = 0.0);
            for i in 0..dk {
                for j in 0..dv {
                    u[j] += st[i * dv + j] * k[i];
                }
            }
            for j in 0..dv {
                let delta = beta * (v[j] - u[j]);
                for i in 0..dk {
                    st[i * dv + j] += k[i] * delta;
                }
            }
            let oh = &mut o[(ti * nv + h) * dv..][..dv];
            for j in 0..dv {
                oh[j] = (0..dk).map(|i| st[i * dv + j] * q[i]).sum();
            }
        }
    }
}

/// The gated delta rule a chunk of [`CHUNK`] tokens at a time.
///
/// Within a chunk with entering state S₀ and cumulative log-decay γᵢ, the state after token
/// i is e^{γᵢ}S₀ + Σ_{j≤i} e^{γᵢ−γⱼ} kⱼ v'ⱼᵀ, where the pseudo-values solve the unit
/// lower-triangular system v'ᵢ = βᵢvᵢ − βᵢe^{γᵢ}S₀ᵀkᵢ − Σ_{j<i} βᵢ(kᵢ·kⱼ)e^{γᵢ−γⱼ} v'ⱼ
/// (the UT transform of HF's `torch_chunk_gated_delta_rule`, solved by substitution).
pub fn delta_rule_chunked(x: &DeltaInputs<'_>, s: &mut [f32], o: &mut [f32]) {
    let (nk, nv, dk, dv) = (x.nk, x.nv, x.dk, x.dv);
    let r = nv / nk;
    let t = x.g.len() / nv;
    let mut vp = vec![0.0f32; CHUNK * dv]; // pseudo-values v' [c, dv]
    let mut gamma = vec![0.0f32; CHUNK];
    for h in 0..nv {
        let kh = h / r;
        let q = |ti: usize| &x.q[(ti * nk + kh) * dk..][..dk];
        let k = |ti: usize| &x.k[(ti * nk + kh) * dk..][..dk];
        let st = &mut s[h * dk * dv..(h + 1) * dk * dv];
        for start in (0..t).step_by(CHUNK) {
            let c = CHUNK.min(t - start);
            let mut acc = 0.0;
            for i in 0..c {
                acc += x.g[(start + i) * nv + h];
                gamma[i] = acc;
            }
            for i in 0..c {
                let ti = start + i;
                let beta = x.beta[ti * nv + h];
                let (ki, vi) = (k(ti), &x.v[(ti * nv + h) * dv..][..dv]);
                let decay0 = gamma[i].exp();
                for jd in 0..dv {
                    let s0k: f32 = (0..dk).map(|a| st[a * dv + jd] * ki[a]).sum();
                    vp[i * dv + jd] = beta * (vi[jd] - decay0 * s0k);
                }
                for j in 0..i {
                    let a_ij = beta * dot(ki, k(start + j)) * (gamma[i] - gamma[j]).exp();
                    for jd in 0..dv {
                        vp[i * dv + jd] -= a_ij * vp[j * dv + jd];
                    }
                }
            }
            for i in 0..c {
                let ti = start + i;
                let qi = q(ti);
                let decay0 = gamma[i].exp();
                let oh = &mut o[(ti * nv + h) * dv..][..dv];
                for jd in 0..dv {
                    oh[jd] = decay0 * (0..dk).map(|a| st[a * dv + jd] * qi[a]).sum::<f32>();
                }
                for j in 0..=i {
                    let w = dot(qi, k(start + j)) * (gamma[i] - gamma[j]).exp();
                    for jd in 0..dv {
                        oh[jd] += w * vp[j * dv + jd];
                    }
                }
            }
            let last = gamma[c - 1];
            st.iter_mut().for_each(|e| *e *= last.exp());
            for j in 0..c {
                let kj = k(start + j);
                let w = (last - gamma[j]).exp();
                for a in 0..dk {
                    for jd in 0..dv {
                        st[a * dv + jd] += w * kj[a] * vp[j * dv + jd];
                    }
                }
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
