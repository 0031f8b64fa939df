//! Softmax attention of query heads over a KV cache (GQA), for decode and prefill alike.
//!
//! Owns the score/softmax/weighted-sum loop of one token's query heads that share a kv head;
//! the caller picks the kv head (q head j reads kv head j / (nq/nkv)), how many of its heads
//! go together, and the visible length (causal: cache offset + 1). It must not touch projections, norms or RoPE, nor allocate. Mirrors the inner loops of
//! [`crate::model::attention::forward`].

use crate::cpu::SimdLevel;
use crate::cpu::kernels::ops::{plain, simd_fn, softmax_act};

/// Positions weighed per block: a block's values (`BLOCK` rows of hd floats) stay in L1/L2
/// across the passes over its dimensions, and the next block's rows are prefetched meanwhile.
pub(super) const BLOCK: usize = 16;

/// outs [G, hd] (+)= Σ_{p in ps} scores[g, p] · v_p for the `W` dimensions at `d`, starting
/// from zero when `ps` starts at 0 and from what `outs` holds otherwise. Each output is summed
/// over p in order with one fused multiply-add per term (as an axpy per position would), so
/// a head's result does not depend on `G`, `W`, the blocks or its company.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weigh<const G: usize, const W: usize>(
    scores: &[f32],
    visible: usize,
    values: &[f32],
    stride: usize,
    d: usize,
    ps: std::ops::Range<usize>,
    outs: &mut [f32],
    hd: usize,
) {
    let mut acc = [[0.0f32; W]; G];
    if ps.start > 0 {
        for (g, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&outs[g * hd + d..][..W]);
        }
    }
    for p in ps {
        let v: &[f32; W] = values[p * stride + d..][..W].try_into().expect("W values");
        for (g, a) in acc.iter_mut().enumerate() {
            let s = scores[g * visible + p];
            for l in 0..W {
                a[l] = s.mul_add(v[l], a[l]);
            }
        }
    }
    for (g, a) in acc.iter().enumerate() {
        outs[g * hd + d..][..W].copy_from_slice(a);
    }
}

/// Asks for the cache lines of `row` ahead of use (no effect off x86-64).
#[inline(always)]
fn prefetch(row: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(16) {
        // SAFETY: a prefetch is a hint; the address is inside `row`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// The rows of the block of positions after the one being weighed, prefetched a few at a
/// time, spread over the block's passes over the dimensions.
pub(super) struct Ahead {
    rows: std::ops::Range<usize>,
    per: usize,
}

impl Ahead {
    /// For the block starting at `p0` of `visible` positions, weighed in `passes` passes.
    #[inline(always)]
    pub(super) fn new(p0: usize, visible: usize, passes: usize) -> Self {
        let rows = p0 + BLOCK..(p0 + 2 * BLOCK).min(visible);
        let per = rows.len().div_ceil(passes.max(1));
        Ahead { rows, per }
    }

    /// Prefetches the next few rows (hd floats each, `stride` apart in `values`).
    #[inline(always)]
    pub(super) fn fetch(&mut self, values: &[f32], stride: usize, hd: usize) {
        for p in self.rows.by_ref().take(self.per) {
            prefetch(&values[p * stride..][..hd]);
        }
    }
}

/// [`weigh`] over every dimension of `G` heads, in blocks of [`BLOCK`] positions: `W` at a
/// time (32 or 16), then 16, then one by one.
#[inline(always)]
fn weigh_heads<const G: usize, const W: usize>(
    scores: &[f32],
    visible: usize,
    values: &[f32],
    stride: usize,
    outs: &mut [f32],
    hd: usize,
) {
    let (dw, d16) = (hd / W * W, hd / 16 * 16);
    for p0 in (0..visible).step_by(BLOCK) {
        let ps = p0..(p0 + BLOCK).min(visible);
        let mut ahead = Ahead::new(p0, visible, dw / W + (d16 - dw) / 16);
        for d in (0..dw).step_by(W) {
            ahead.fetch(values, stride, hd);
            weigh::<G, W>(scores, visible, values, stride, d, ps.clone(), outs, hd);
        }
        for d in (dw..d16).step_by(16) {
            ahead.fetch(values, stride, hd);
            weigh::<G, 16>(scores, visible, values, stride, d, ps.clone(), outs, hd);
        }
        ahead.fetch(values, stride, hd);
    }
    for g in 0..G {
        for d in d16..hd {
            let mut a = 0.0f32;
            for p in 0..visible {
                a = scores[g * visible + p].mul_add(values[p * stride + d], a);
            }
            outs[g * hd + d] = a;
        }
    }
}

/// outs [heads, hd]: for each query head of `qs` [heads, hd] (heads sharing kv head `kvh`),
/// Σ_p softmax_p(scale · q·k_p) v_p over cached positions p < `visible`, with `keys`/`values`
/// laid out [pos, nkv, hd]. Each cached key is read once per four heads, each value once per
/// eight. A head's result does not depend on which heads come with it (a score is one dot
/// product in one order at a level, whichever block computes it). `scores` needs
/// heads·`visible` elements.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    level: SimdLevel,
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
    let stride = nkv * hd;
    let scores = &mut scores[..heads * visible];
    let keys = &keys[kvh * hd..];
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 if level.is_supported() && hd.is_multiple_of(16) => {
            // SAFETY: AVX-512 F is present (the level is supported); every key row read,
            // p·stride..+hd for p < visible, lies inside `keys` (the caller's cache holds
            // `visible` positions), and qs holds heads·hd.
            unsafe { super::avx512_attention::scores(qs, hd, keys, stride, visible, scale, scores) }
        }
        _ => score_rows(level, qs, hd, keys, stride, visible, scale, scores),
    }
    softmax_rows(level, scores, visible);
    let values = &values[kvh * hd..];
    // Heads weighed by the AVX-512 loop; the rest (all of them at other levels) by the plain one.
    let from = match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 if level.is_supported() && hd.is_multiple_of(32) => {
            let from = heads / 8 * 8;
            // SAFETY: AVX-512 F is present; every value row read, p·stride..+hd for p <
            // visible, lies inside `values` (as the keys above); scores and outs hold `from`
            // heads.
            unsafe {
                super::avx512_attention::weigh8(
                    &scores[..from * visible],
                    visible,
                    values,
                    stride,
                    &mut outs[..from * hd],
                    hd,
                )
            };
            from
        }
        _ => 0,
    };
    weigh_from(level, scores, hd, values, stride, visible, outs, from);
}

simd_fn! {
    /// scores [heads, visible] = scale · q_g·k_p, one [`plain::dot`] each; positions
    /// outermost, so each key is read once and stays in L1 for every head.
    fn score_rows(
        qs: &[f32],
        hd: usize,
        keys: &[f32],
        stride: usize,
        visible: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        for p in 0..visible {
            let k = &keys[p * stride..][..hd];
            for (g, qh) in qs.chunks_exact(hd).enumerate() {
                scores[g * visible + p] = plain::dot(qh, k) * scale;
            }
        }
    }
}

simd_fn! {
    /// Softmax of each head's row of `visible` scores, in place.
    fn softmax_rows(scores: &mut [f32], visible: usize) {
        for sg in scores.chunks_exact_mut(visible) {
            softmax_act(sg);
        }
    }
}

simd_fn! {
    /// outs [heads, hd] = Σ_p w_gp v_p for the heads from `from` on (`values` from the kv
    /// head's first element, rows `stride` apart).
    fn weigh_from(
        scores: &[f32],
        hd: usize,
        values: &[f32],
        stride: usize,
        visible: usize,
        outs: &mut [f32],
        from: usize,
    ) {
        let heads = scores.len() / visible;
        let outs = &mut outs[..heads * hd];
        // Heads in eights (each value read once for them), then fours, then singly: 16
        // accumulators of 16 floats stay in registers.
        let (eights, fours) = (heads / 8 * 8, heads / 4 * 4);
        for g0 in (from.min(eights)..eights).step_by(8) {
            let (sc, o) = (&scores[g0 * visible..], &mut outs[g0 * hd..]);
            weigh_heads::<8, 32>(sc, visible, values, stride, o, hd);
        }
        for g0 in (from.max(eights)..fours).step_by(4) {
            let (sc, o) = (&scores[g0 * visible..], &mut outs[g0 * hd..]);
            weigh_heads::<4, 32>(sc, visible, values, stride, o, hd);
        }
        for g in from.max(fours)..heads {
            let (sc, o) = (&scores[g * visible..], &mut outs[g * hd..]);
            weigh_heads::<1, 32>(sc, visible, values, stride, o, hd);
        }
    }
}
