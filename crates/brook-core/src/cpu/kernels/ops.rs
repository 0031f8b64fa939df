//! Vectorized elementwise and reduction helpers of the fast forward pass.
//!
//! Owns dot/axpy-style loops compiled once per [`SimdLevel`] (a `simd_fn!` wrapper compiles one
//! plain-Rust body with AVX-512 or AVX2 enabled, so the compiler vectorizes it at that width),
//! RMSNorm, SwiGLU activation, router softmax + top-k and RoPE. It must not allocate. Each
//! mirrors the function of the same name in [`crate::model::ops`], `moe::route` or
//! `attention::rope`; transcendental functions (exp, sin, cos) are the same scalar std calls
//! as the reference, so only summation order differs.

use crate::config::ModelConfig;
use crate::cpu::SimdLevel;

/// Defines `fn name(level, args..)` running one body compiled for each SIMD level.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident : $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name(level: SimdLevel, $($a: $t),*) $(-> $r)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn v512($($a: $t),*) $(-> $r)? { body($($a),*) }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn v256($($a: $t),*) $(-> $r)? { body($($a),*) }
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU has the features of this level (checked in the guard).
                SimdLevel::Avx512 if level.is_supported() => unsafe { v512($($a),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                SimdLevel::Avx2 if level.is_supported() => unsafe { v256($($a),*) },
                _ => body($($a),*),
            }
        }
    };
}
pub(crate) use simd_fn;

/// Plain loops, written so the compiler vectorizes them; `#[inline(always)]` so that inside a
/// `simd_fn!` body they are compiled at that body's SIMD level.
pub(crate) mod plain {
    /// Σ a_i b_i, with 16 partial sums (one vector at AVX-512).
    #[inline(always)]
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0.0f32; 16];
        let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
        let tail: f32 = ac
            .remainder()
            .iter()
            .zip(bc.remainder())
            .map(|(x, y)| x * y)
            .sum();
        for (x, y) in ac.zip(bc) {
            for l in 0..16 {
                acc[l] = x[l].mul_add(y[l], acc[l]);
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    /// Σ x_i².
    #[inline(always)]
    pub fn sum_sq(x: &[f32]) -> f32 {
        dot(x, x)
    }

    /// y += a·x.
    #[inline(always)]
    pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi = a.mul_add(*xi, *yi);
        }
    }

    /// x ·= a.
    #[inline(always)]
    pub fn scale(a: f32, x: &mut [f32]) {
        for v in x.iter_mut() {
            *v *= a;
        }
    }
}

simd_fn! {
    /// Σ a_i b_i.
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        plain::dot(a, b)
    }
}

simd_fn! {
    /// Σ x_i².
    pub fn sum_sq(x: &[f32]) -> f32 {
        plain::sum_sq(x)
    }
}

simd_fn! {
    /// y += a·x.
    pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        plain::axpy(a, x, y)
    }
}

simd_fn! {
    /// y += x.
    pub fn add(x: &[f32], y: &mut [f32]) {
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi += *xi;
        }
    }
}

simd_fn! {
    /// x ·= a.
    pub fn scale(a: f32, x: &mut [f32]) {
        plain::scale(a, x)
    }
}

simd_fn! {
    /// out = x · inv · w, elementwise.
    fn mul_scaled(x: &[f32], inv: f32, w: &[f32], out: &mut [f32]) {
        for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
            *o = xi * inv * wi;
        }
    }
}

simd_fn! {
    /// out += w ⊙ x (one tap of the depthwise conv over all channels).
    pub fn mul_acc(w: &[f32], x: &[f32], out: &mut [f32]) {
        for ((o, &wi), &xi) in out.iter_mut().zip(w).zip(x) {
            *o = wi.mul_add(xi, *o);
        }
    }
}

/// RMSNorm with weight: out = x / √(mean(x²) + ε) · w (as [`crate::model::ops::rms_norm`]).
pub fn rms_norm(level: SimdLevel, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (sum_sq(level, x) / x.len() as f32 + eps).sqrt();
    mul_scaled(level, x, inv, w, out);
}

/// RMSNorm of every row of x [T, H] into out [T, H].
pub fn rms_norm_rows(level: SimdLevel, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        rms_norm(level, xr, w, eps, or);
    }
}

/// RMSNorm without weight in place, then ·scale (as `rms_norm_scaled_inplace`).
pub fn rms_norm_scaled_inplace(level: SimdLevel, x: &mut [f32], eps: f32, scale_by: f32) {
    let inv = 1.0 / (sum_sq(level, x) / x.len() as f32 + eps).sqrt() * scale_by;
    scale(level, inv, x);
}

/// eˣ in plain f32 arithmetic that vectorizes inside a `simd_fn!` body (libm's `expf` is a
/// call per element, which was 4% of a prefill): x = n·ln 2 + r with |r| ≤ ln 2 / 2 (ln 2 in
/// two parts, so r is exact to f32), e^r by its Taylor series to r⁷ (the rest is under
/// 6e-9 relative, a tenth of an ulp), scaled by 2ⁿ through the exponent bits. Within 2 ulp of
/// `f32::exp` (tested) for x in [-87, 88]; outside it saturates to e⁻⁸⁷ ≈ 1.6e-38 and
/// e⁸⁸ ≈ 1.7e38 instead of reaching 0 or ∞, which changes a sigmoid by less than 2e-38; NaN
/// stays NaN.
#[inline(always)]
pub fn exp_act(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4; // 0x3f31_8000: 9 significant bits, so n·LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4;
    const C: [f32; 8] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
    ];
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = C[7];
    for &c in C[..7].iter().rev() {
        p = p.mul_add(r, c);
    }
    // n is in [-126, 127] after the clamp, so 2ⁿ is a normal float. Its exponent field
    // n + 127 is read off the low mantissa bits of 2²³ + 127 + n (exact) rather than through
    // `as i32`, whose saturating cast LLVM compiled to sixteen scalar conversions per vector
    // (a NaN gives 0 here and p stays NaN, as before).
    p * f32::from_bits((n + 8_388_735.0).to_bits() << 23)
}

/// sigmoid(x) = 1 / (1 + e⁻ˣ) on [`exp_act`], in the reference's order of operations.
#[inline(always)]
fn sigmoid_act(x: f32) -> f32 {
    1.0 / (1.0 + exp_act(-x))
}

simd_fn! {
    /// g ← silu(g) ⊙ u: the SwiGLU activation between an expert's up and down projections.
    pub fn swiglu_act(g: &mut [f32], u: &[f32]) {
        for (gi, ui) in g.iter_mut().zip(u) {
            *gi = *gi * sigmoid_act(*gi) * ui;
        }
    }
}

simd_fn! {
    /// x ← silu(x) = x · sigmoid(x), the DeltaNet convolution's activation (libm's `expf` per
    /// channel was about 20 µs of each decoded layer, 8192 channels on two threads).
    pub fn silu_inplace(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v *= sigmoid_act(*v);
        }
    }
}

/// Gated RMSNorm of one DeltaNet head: out = rms_norm(o; w) ⊙ silu(z).
pub fn gated_rms_norm(
    level: SimdLevel,
    o: &[f32],
    z: &[f32],
    w: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    rms_norm(level, o, w, eps, out);
    silu_gate(level, out, z);
}

simd_fn! {
    /// y ← y ⊙ silu(z).
    fn silu_gate(y: &mut [f32], z: &[f32]) {
        for (yi, &zi) in y.iter_mut().zip(z) {
            *yi *= zi * sigmoid_act(zi);
        }
    }
}

simd_fn! {
    /// x ← x ⊙ sigmoid(gate) (the attention output gate).
    pub fn sigmoid_gate(x: &mut [f32], gate: &[f32]) {
        for (a, &g) in x.iter_mut().zip(gate) {
            *a *= sigmoid_act(g);
        }
    }
}

/// Softmax in place with `exp` for eˣ: the maximum subtracted, the sum taken in order after
/// the exponentials (so they vectorize where `exp` does).
#[inline(always)]
fn softmax_by(x: &mut [f32], exp: impl Fn(f32) -> f32) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    let sum = x.iter().fold(0.0f32, |s, v| s + v);
    x.iter_mut().for_each(|v| *v /= sum);
}

/// Softmax in place on [`exp_act`], for attention scores (inlined into the caller's SIMD
/// level). The router keeps [`softmax`]: libm's exp is monotonic, which its top-k's ties
/// rely on.
#[inline(always)]
pub(crate) fn softmax_act(x: &mut [f32]) {
    softmax_by(x, exp_act);
}

/// Softmax in place (as [`crate::model::ops::softmax`]).
pub fn softmax(x: &mut [f32]) {
    softmax_by(x, f32::exp);
}

/// Router of one token, as `moe::route`: softmax over the logits `p` (in place), the `k`
/// largest (ties: lower index first) into `experts` / `weights` in descending order,
/// renormalised to sum 1 when `norm`. No allocation: one pass over E, keeping the best k
/// seen in order (an expert enters behind every kept one that is not smaller, so among equal
/// values the lower index stays first).
pub fn route_top_k(p: &mut [f32], norm: bool, experts: &mut [usize], weights: &mut [f32]) {
    softmax(p);
    let k = experts.len().min(p.len());
    if k == 0 {
        return;
    }
    let mut kept = 0;
    for (e, &v) in p.iter().enumerate() {
        if kept == k && v.total_cmp(&weights[k - 1]).is_le() {
            continue;
        }
        let at = weights[..kept]
            .iter()
            .position(|w| v.total_cmp(w).is_gt())
            .unwrap_or(kept);
        let end = kept.min(k - 1);
        experts.copy_within(at..end, at + 1);
        weights.copy_within(at..end, at + 1);
        (experts[at], weights[at]) = (e, v);
        kept = (kept + 1).min(k);
    }
    if norm {
        let sum: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|v| *v /= sum);
    }
}

/// The router's probabilities (softmax of the logits `p`, in place) at the given experts
/// `ids`, renormalised when `norm` as [`route_top_k`] renormalises its picks: a replayed
/// routing. `experts` and `weights` take `ids.len()` entries.
pub fn route_given(
    p: &mut [f32],
    norm: bool,
    ids: &[u32],
    experts: &mut [usize],
    weights: &mut [f32],
) {
    softmax(p);
    for ((e, w), &id) in experts.iter_mut().zip(weights.iter_mut()).zip(ids) {
        (*e, *w) = (id as usize, p[id as usize]);
    }
    if norm {
        let sum: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|v| *v /= sum);
    }
}

/// RoPE inverse frequencies θ^(−2j/rotary_dim), in f64 as the reference computes them.
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f64> {
    (0..cfg.rotary_dim / 2)
        .map(|j| cfg.rope_theta.powf(-2.0 * j as f64 / cfg.rotary_dim as f64))
        .collect()
}

/// cos and sin of RoPE's angles at `pos` into `cs` ([cos; sin], 2·inv_freq.len()), computed
/// as `attention::rope` does, once for every head of a token.
pub fn rope_angles(pos: usize, inv_freq: &[f64], cs: &mut [f32]) {
    let half = inv_freq.len();
    for (j, &f) in inv_freq.iter().enumerate() {
        let angle = pos as f64 * f;
        (cs[j], cs[half + j]) = (angle.cos() as f32, angle.sin() as f32);
    }
}

/// Rotates the first `cs.len()` dims of one head by [`rope_angles`]'s `cs` ("rotate half"),
/// as `attention::rope`.
pub fn rope(x: &mut [f32], cs: &[f32]) {
    let half = cs.len() / 2;
    let (cos, sin) = cs.split_at(half);
    for j in 0..half {
        let (x1, x2) = (x[j], x[j + half]);
        x[j] = x1 * cos[j] - x2 * sin[j];
        x[j + half] = x2 * cos[j] + x1 * sin[j];
    }
}
