//! Softmax attention of one query head over a KV cache (GQA), for decode and prefill alike.
//!
//! Owns the score/softmax/weighted-sum loop of one (token, head) pair; the caller picks the kv
//! head (q head j reads kv head j / (nq/nkv)) and the visible length (causal: cache offset +
//! 1). It must not touch projections, norms or RoPE, nor allocate. Mirrors the inner loops of
//! [`crate::model::attention::forward`].

use crate::cpu::SimdLevel;
use crate::cpu::ops::{plain, simd_fn, softmax};

simd_fn! {
    /// out [hd] = Σ_p softmax_p(scale · q·k_p) v_p over cached positions p < `visible` of kv
    /// head `kvh`, with `keys`/`values` laid out [pos, nkv, hd]. `scores` needs `visible`
    /// elements.
    pub fn attend(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        nkv: usize,
        kvh: usize,
        visible: usize,
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = q.len();
        let scores = &mut scores[..visible];
        for (p, sc) in scores.iter_mut().enumerate() {
            *sc = plain::dot(q, &keys[(p * nkv + kvh) * hd..][..hd]) * scale;
        }
        softmax(scores);
        out.iter_mut().for_each(|o| *o = 0.0);
        for (p, &pr) in scores.iter().enumerate() {
            plain::axpy(pr, &values[(p * nkv + kvh) * hd..][..hd], out);
        }
    }
}
