//! Gated softmax attention (`self_attn`) with partial RoPE and a KV cache.
//!
//! Mirrors mlx-lm `qwen3_next.Qwen3NextAttention`: `q_proj` yields per head a query and an
//! output gate; q and k get RMSNorm (`q_norm`, `k_norm`, MLX multiplier weights) and RoPE on
//! their first `rotary_dim` dimensions (non-interleaved, "rotate half"); causal softmax with
//! GQA and scale hd^(−1/2); the output is multiplied by sigmoid(gate) before `o_proj`.

use crate::config::ModelConfig;
use crate::model::ops::{rms_norm, sigmoid, softmax};
use crate::model::weights::AttentionWeights;

/// Runs one attention layer on x[T, H] at positions pos0.., appending to the KV cache.
pub fn forward(
    w: &AttentionWeights,
    cfg: &ModelConfig,
    keys: &mut Vec<f32>,
    values: &mut Vec<f32>,
    pos0: usize,
    x: &[f32],
    out: &mut [f32],
) {
    let h = cfg.hidden_size;
    let t = x.len() / h;
    let (nq, nkv, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let gated = cfg.attn_output_gate;
    let q_width = nq * hd * if gated { 2 } else { 1 };
    let mut qg = vec![0.0; t * q_width];
    let mut k = vec![0.0; t * nkv * hd];
    let mut v = vec![0.0; t * nkv * hd];
    w.q_proj.forward_rows(x, &mut qg);
    w.k_proj.forward_rows(x, &mut k);
    w.v_proj.forward_rows(x, &mut v);

    let mut q = vec![0.0; t * nq * hd];
    let mut gate = vec![0.0; t * nq * hd];
    let per_head = q_width / nq;
    for ti in 0..t {
        for head in 0..nq {
            let src = &qg[ti * q_width + head * per_head..][..per_head];
            let dst = (ti * nq + head) * hd;
            rms_norm(
                &src[..hd],
                &w.q_norm,
                cfg.rms_norm_eps,
                &mut q[dst..dst + hd],
            );
            rope(&mut q[dst..dst + hd], pos0 + ti, cfg);
            if gated {
                gate[dst..dst + hd].copy_from_slice(&src[hd..]);
            }
        }
        for head in 0..nkv {
            let at = (ti * nkv + head) * hd;
            let raw = k[at..at + hd].to_vec();
            rms_norm(&raw, &w.k_norm, cfg.rms_norm_eps, &mut k[at..at + hd]);
            rope(&mut k[at..at + hd], pos0 + ti, cfg);
        }
    }
    keys.extend_from_slice(&k);
    values.extend_from_slice(&v);

    let scale = (hd as f32).powf(-0.5);
    let group = nq / nkv;
    let mut attn = vec![0.0; t * nq * hd];
    for ti in 0..t {
        let visible = pos0 + ti + 1;
        let mut scores = vec![0.0; visible];
        for head in 0..nq {
            let kvh = head / group;
            let qh = &q[(ti * nq + head) * hd..][..hd];
            for (p, sc) in scores.iter_mut().enumerate() {
                let kp = &keys[(p * nkv + kvh) * hd..][..hd];
                *sc = qh.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale;
            }
            softmax(&mut scores);
            let oh = &mut attn[(ti * nq + head) * hd..][..hd];
            for (p, &pr) in scores.iter().enumerate() {
                let vp = &values[(p * nkv + kvh) * hd..][..hd];
                for (o, &vv) in oh.iter_mut().zip(vp) {
                    *o += pr * vv;
                }
            }
        }
    }
    if gated {
        for (a, &g) in attn.iter_mut().zip(&gate) {
            *a *= sigmoid(g);
        }
    }
    w.o_proj.forward_rows(&attn, out);
}

/// Rotates the first `rotary_dim` dims of one head in place ("rotate half" layout).
pub fn rope(x: &mut [f32], pos: usize, cfg: &ModelConfig) {
    let half = cfg.rotary_dim / 2;
    for j in 0..half {
        let inv_freq = cfg.rope_theta.powf(-2.0 * j as f64 / cfg.rotary_dim as f64);
        let angle = pos as f64 * inv_freq;
        let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
        let (x1, x2) = (x[j], x[j + half]);
        x[j] = x1 * cos - x2 * sin;
        x[j + half] = x2 * cos + x1 * sin;
    }
}
