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

simd_fn! {
    /// [`attend`] for the query heads `qs` [heads, hd] that share kv head `kvh`, at once: each
    /// cached key and value is read once for all of them (per head, the 8 heads of a kv head
    /// each streamed it from L2). The same operations per head as [`attend`], so the same
    /// results. `scores` needs heads·`visible` elements, `outs` heads·hd.
    pub fn attend_heads(
        qs: &[f32],
        hd: usize,
        keys: &[f32],
        values: &[f32],
        nkv: usize,
        kvh: usize,
        visible: usize,
        scale: f32,
        scores: &mut [f32],
        outs: &mut [f32],
    ) {
        let heads = qs.len() / hd;
        let scores = &mut scores[..heads * visible];
        for p in 0..visible {
            let k = &keys[(p * nkv + kvh) * hd..][..hd];
            for (g, qh) in qs.chunks_exact(hd).enumerate() {
                scores[g * visible + p] = plain::dot(qh, k) * scale;
            }
        }
        for sg in scores.chunks_exact_mut(visible) {
            softmax(sg);
        }
        let outs = &mut outs[..heads * hd];
        outs.iter_mut().for_each(|o| *o = 0.0);
        for p in 0..visible {
            let v = &values[(p * nkv + kvh) * hd..][..hd];
            for (g, og) in outs.chunks_exact_mut(hd).enumerate() {
                plain::axpy(scores[g * visible + p], v, og);
            }
        }
    }
}
