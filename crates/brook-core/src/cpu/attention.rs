//! Softmax attention of query heads over a KV cache (GQA), for decode and prefill alike.
//!
//! Owns the score/softmax/weighted-sum loop of one token's query heads that share a kv head;
//! the caller picks the kv head (q head j reads kv head j / (nq/nkv)), how many of its heads
//! go together, and the visible length (causal: cache offset + 1). It must not touch projections, norms or RoPE, nor allocate. Mirrors the inner loops of
//! [`crate::model::attention::forward`].

use crate::cpu::SimdLevel;
use crate::cpu::ops::{plain, simd_fn, softmax};

simd_fn! {
    /// outs [heads, hd]: for each query head of `qs` [heads, hd] (heads sharing kv head
    /// `kvh`), Σ_p softmax_p(scale · q·k_p) v_p over cached positions p < `visible`, with
    /// `keys`/`values` laid out [pos, nkv, hd]. Each cached key and value is read once for all
    /// the heads (a chunk passes the 8 heads of a kv head: one at a time, each streamed them
    /// from L2). `scores` needs heads·`visible` elements.
    pub fn attend(
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
