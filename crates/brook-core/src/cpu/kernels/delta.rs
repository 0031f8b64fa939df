//! The gated delta rule of one DeltaNet value head: the recurrent step (decode) and the
//! chunked form (prefill), on a state S [dk, dv] of f32 (the step also on bf16 bits).
//!
//! Owns the state arithmetic only; the caller normalises q and k, computes the log-decay g
//! and β, and runs heads in parallel. It must not allocate (scratch comes from the caller).
//! Mirrors [`crate::model::delta_net::delta_rule_recurrent`] and `delta_rule_chunked`:
//! the step reads S once for u₀ = Sᵀk and w₀ = Sᵀq and writes it once, using
//! u = αu₀, δ = β(v − u), S' = αS + kδᵀ and o = S'ᵀq = αw₀ + (k·q)δ, which is the reference's
//! decay–read–update–read sequence in one trip through memory instead of four passes.

use crate::cpu::SimdLevel;
use crate::cpu::kernels::ops::{exp_act, plain, simd_fn};
use crate::model::delta_net::CHUNK;

/// Value columns [`step`] gathers at once (two accumulators of this many floats, in L1): a
/// whole row of S at dv = 128.
const STEP_COLS: usize = 128;
const AVX2_COLS: usize = 32;

/// One stored element of the recurrent state: f32 (the exact path), or bf16 bits (the fast
/// path's one-token step, which halves the state's traffic: the 35B reads and writes 63 MB of
/// f32 state a token).
pub trait StateCell: Copy {
    fn get(self) -> f32;
    fn put(v: f32) -> Self;
}

impl StateCell for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
    #[inline(always)]
    fn put(v: f32) -> Self {
        v
    }
}

impl StateCell for u16 {
    #[inline(always)]
    fn get(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn put(v: f32) -> Self {
        bf16_bits(v)
    }
}

/// `v` rounded to bf16 (to nearest, ties to even; NaN stays a quiet NaN of the same sign;
/// subnormal inputs become zeros of their sign, as AVX-512 BF16's `vcvtneps2bf16` does), as
/// bits. Branch-free, so loops of it vectorize.
#[inline(always)]
pub fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let quiet = ((b >> 16) | 0x40) as u16;
    let zero = ((b >> 16) & 0x8000) as u16;
    if v.is_nan() {
        quiet
    } else if b & 0x7F80_0000 == 0 {
        zero
    } else {
        rounded
    }
}

/// The f32 value of bf16 bits `b` (exact).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// The body of [`step`] and [`step_bf16`]: arithmetic in f32 whatever the state's storage.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn step_in<S: StateCell, const COLS: usize>(
    s: &mut [S],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    o: &mut [f32],
    update: impl Fn(&mut [S], &[f32], f32, f32),
) {
    let (dk, dv) = (k.len(), v.len());
    let alpha = g.exp();
    let kq = plain::dot(k, q);
    let mut j0 = 0;
    while j0 < dv {
        let nj = (dv - j0).min(COLS);
        let (mut u, mut w) = ([0.0f32; COLS], [0.0f32; COLS]);
        for i in 0..dk {
            let row = &s[i * dv + j0..i * dv + j0 + nj];
            let (ki, qi) = (k[i], q[i]);
            if let Some(row) = row.first_chunk::<COLS>() {
                // A whole block: a fixed trip count, so u and w stay in registers.
                for j in 0..COLS {
                    let sj = row[j].get();
                    u[j] = sj.mul_add(ki, u[j]);
                    w[j] = sj.mul_add(qi, w[j]);
                }
            } else {
                for ((uj, wj), &sj) in u.iter_mut().zip(w.iter_mut()).zip(row) {
                    let sj = sj.get();
                    *uj = sj.mul_add(ki, *uj);
                    *wj = sj.mul_add(qi, *wj);
                }
            }
        }
        let mut delta = [0.0f32; COLS];
        for j in 0..nj {
            delta[j] = beta * (v[j0 + j] - alpha * u[j]);
            o[j0 + j] = alpha * w[j] + kq * delta[j];
        }
        for i in 0..dk {
            update(
                &mut s[i * dv + j0..i * dv + j0 + nj],
                &delta[..nj],
                k[i],
                alpha,
            );
        }
        j0 += nj;
    }
}

/// One row of the update S' = αS + kδᵀ: row ← α·row + kᵢ·δ, rounded to the storage.
#[inline(always)]
fn update_row<S: StateCell>(row: &mut [S], delta: &[f32], ki: f32, alpha: f32) {
    for (sj, &dj) in row.iter_mut().zip(delta) {
        *sj = S::put(ki.mul_add(dj, alpha * sj.get()));
    }
}

simd_fn! {
    /// One token: S [dk, dv] ← e^g·S + k δᵀ with δ = β(v − e^g·Sᵀk); o [dv] = Sᵀq after the
    /// update. Done [`STEP_COLS`] value columns at a time, row after row: u = Sᵀk and w = Sᵀq
    /// gather in two accumulators while S streams in (whole 512-byte rows at dv = 128, which the
    /// hardware prefetcher follows; 16-column blocks, a 64-byte line per row 512 bytes apart,
    /// ran the 35B's 30 × 2 MiB of state at about half the memory's rate), then S is updated
    /// from L2, so it crosses the memory bus once each way per token.
    pub fn step(
        s: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: f32,
        beta: f32,
        o: &mut [f32],
    ) {
        step_in::<_, STEP_COLS>(s, q, k, v, g, beta, o, update_row)
    }
}

/// [`step`] on a state stored as bf16 bits: each element is read as f32, updated in f32
/// and rounded back with [`bf16_bits`], so one step's only extra error is that rounding of
/// the new state (relative 2⁻⁹ per element); the output is computed from the unrounded
/// update. For `--precision fast`. Where AVX-512 BF16 exists the rounding is one
/// `vcvtneps2bf16` per 16 values (the same bits).
#[allow(clippy::too_many_arguments)]
pub fn step_bf16(
    level: SimdLevel,
    s: &mut [u16],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512 && SimdLevel::has_avx512_bf16() {
        // SAFETY: the CPU has these features (checked just above).
        return unsafe { step_bf16_avx512(s, q, k, v, g, beta, o) };
    }
    #[cfg(target_arch = "x86_64")]
    if level != SimdLevel::Portable && level.is_supported() {
        // SAFETY: AVX2 and AVX-512 both include AVX2, FMA and F16C (checked just above).
        return unsafe { step_bf16_avx2(s, q, k, v, g, beta, o) };
    }
    step_bf16_plain(level, s, q, k, v, g, beta, o)
}

/// [`step_bf16`] on AVX2: the update rounds 16 values at a time with integer instructions
/// ([`update_row_avx2_bf16`]); the compiler's vectorization of [`bf16_bits`] took 3.6 times
/// as long as the f32 step (criterion `delta_step`, dev-2c).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn step_bf16_avx2(
    s: &mut [u16],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    o: &mut [f32],
) {
    step_in::<_, AVX2_COLS>(s, q, k, v, g, beta, o, |row, delta, ki, alpha| {
        // SAFETY: this function runs only where these features exist.
        unsafe { update_row_avx2_bf16(row, delta, ki, alpha) }
    })
}

/// [`update_row`] for bf16 bits on AVX2, 16 values a pass, the bits of [`bf16_bits`]: to
/// nearest even by adding 0x7FFF plus the kept part's lowest bit, NaNs quieted, zeros and
/// subnormals to zeros of their sign.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn update_row_avx2_bf16(row: &mut [u16], delta: &[f32], ki: f32, alpha: f32) {
    use std::arch::x86_64::*;
    let n = row.len().min(delta.len());
    let (kv, av) = (_mm256_set1_ps(ki), _mm256_set1_ps(alpha));
    let round = |new: __m256| {
        let b = _mm256_castps_si256(new);
        let top = _mm256_srli_epi32::<16>(b);
        let odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
        let quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(new, new));
        let expo = _mm256_and_si256(b, _mm256_set1_epi32(0x7F80_0000));
        let tiny = _mm256_cmpeq_epi32(expo, _mm256_setzero_si256());
        let zero = _mm256_and_si256(top, _mm256_set1_epi32(0x8000));
        let r = _mm256_blendv_epi8(rounded, quiet, nan);
        _mm256_blendv_epi8(r, zero, tiny)
    };
    let mut j = 0;
    while j + 16 <= n {
        // SAFETY: j + 16 ≤ n, within both slices; unaligned loads and stores.
        unsafe {
            let p = row.as_mut_ptr().add(j);
            let bits = _mm256_loadu_si256(p as *const __m256i);
            let widen =
                |h: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
            let s0 = widen(_mm256_castsi256_si128(bits));
            let s1 = widen(_mm256_extracti128_si256::<1>(bits));
            let d = delta.as_ptr().add(j);
            let n0 = _mm256_fmadd_ps(kv, _mm256_loadu_ps(d), _mm256_mul_ps(av, s0));
            let n1 = _mm256_fmadd_ps(kv, _mm256_loadu_ps(d.add(8)), _mm256_mul_ps(av, s1));
            // Values below 2^16 pack without saturating; packs works per 128-bit lane.
            let packed = _mm256_packus_epi32(round(n0), round(n1));
            let out = _mm256_permute4x64_epi64::<0xD8>(packed);
            _mm256_storeu_si256(p as *mut __m256i, out);
        }
        j += 16;
    }
    update_row(&mut row[j..n], &delta[j..n], ki, alpha);
}

simd_fn! {
    fn step_bf16_plain(
        s: &mut [u16],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: f32,
        beta: f32,
        o: &mut [f32],
    ) {
        step_in::<_, STEP_COLS>(s, q, k, v, g, beta, o, update_row)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn step_bf16_avx512(
    s: &mut [u16],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    o: &mut [f32],
) {
    step_in::<_, STEP_COLS>(s, q, k, v, g, beta, o, |row, delta, ki, alpha| {
        // SAFETY: this function runs only where these features exist.
        unsafe { update_row_avx512_bf16(row, delta, ki, alpha) }
    })
}

/// [`update_row`] for bf16 bits, 16 values per `vcvtneps2bf16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn update_row_avx512_bf16(row: &mut [u16], delta: &[f32], ki: f32, alpha: f32) {
    use std::arch::x86_64::*;
    let n = row.len().min(delta.len());
    let (kv, av) = (_mm512_set1_ps(ki), _mm512_set1_ps(alpha));
    let mut j = 0;
    while j + 16 <= n {
        // SAFETY: j + 16 ≤ n, within both slices; unaligned loads and stores.
        unsafe {
            let p = row.as_mut_ptr().add(j);
            let bits = _mm256_loadu_si256(p as *const __m256i);
            let sj = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
            let dj = _mm512_loadu_ps(delta.as_ptr().add(j));
            let new = _mm512_fmadd_ps(kv, dj, _mm512_mul_ps(av, sj));
            let out: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(new));
            _mm256_storeu_si256(p as *mut __m256i, out);
        }
        j += 16;
    }
    update_row(&mut row[j..n], &delta[j..n], ki, alpha);
}

/// Floats of scratch [`chunked`] needs for key width `dk` and value width `dv`.
pub fn chunked_scratch(dk: usize, dv: usize) -> usize {
    CHUNK * dv + 2 * CHUNK + dk * CHUNK + 3 * CHUNK * CHUNK
}

/// Token inputs of one value head for [`chunked`]: row t of each is that token's vector.
#[derive(Debug, Clone, Copy)]
pub struct HeadRows<'a> {
    pub q: &'a [f32], // q of token t at q[t·q_stride ..][..dk]
    pub k: &'a [f32],
    pub v: &'a [f32],    // v of token t at v[t·v_stride ..][..dv]
    pub g: &'a [f32],    // log-decay of token t at g[t·gb_stride]
    pub beta: &'a [f32], // β of token t at beta[t·gb_stride]
    pub q_stride: usize,
    pub v_stride: usize,
    pub gb_stride: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Rows of one register block of [`mm`]; its columns, `NR`, are 64 with AVX-512's 32
/// registers and 16 with AVX2's 16 (at 64 the blocks spilled: the resident 35B's `fast` pp512
/// on AVX2 66.4 tok/s against 68.7-69.5 at 16; AVX-512 167-168 at 16 against 169-172).
const MR: usize = 4;

/// C [m, n] = init·C + A B for rows `a(i)` (each at least `kd` long) of A [m, kd] and B
/// [kd, n] (row stride `ldb`); C has row stride `ldc`; `init` None starts from zero. Blocks
/// of [`MR`] × `NR` accumulate in registers over the whole of `kd`, each element in the order
/// of `kd` whatever `NR` is. Always inlined, so it runs at the SIMD level of its caller.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn mm<'x, const NR: usize>(
    c: &mut [f32],
    ldc: usize,
    m: usize,
    a: impl Fn(usize) -> &'x [f32],
    b: &[f32],
    ldb: usize,
    kd: usize,
    n: usize,
    init: Option<f32>,
) {
    let mut i0 = 0;
    while i0 < m {
        let mr = MR.min(m - i0);
        let rows: [&[f32]; MR] = std::array::from_fn(|r| &a(i0 + r.min(mr - 1))[..kd]);
        let mut j0 = 0;
        while j0 < n {
            let nr = NR.min(n - j0);
            if mr == MR && nr == NR {
                let mut acc = [[0.0f32; NR]; MR];
                if let Some(f) = init {
                    for (r, accr) in acc.iter_mut().enumerate() {
                        let cr = &c[(i0 + r) * ldc + j0..][..NR];
                        for j in 0..NR {
                            accr[j] = f * cr[j];
                        }
                    }
                }
                for p in 0..kd {
                    let br = &b[p * ldb + j0..][..NR];
                    for r in 0..MR {
                        let av = rows[r][p];
                        for j in 0..NR {
                            acc[r][j] = av.mul_add(br[j], acc[r][j]);
                        }
                    }
                }
                for (r, accr) in acc.iter().enumerate() {
                    c[(i0 + r) * ldc + j0..][..NR].copy_from_slice(accr);
                }
            } else {
                for (r, row) in rows.iter().enumerate().take(mr) {
                    let cr = &mut c[(i0 + r) * ldc + j0..][..nr];
                    match init {
                        Some(f) => cr.iter_mut().for_each(|v| *v *= f),
                        None => cr.fill(0.0),
                    }
                    for (p, &av) in row.iter().enumerate() {
                        plain::axpy(av, &b[p * ldb + j0..][..nr], cr);
                    }
                }
            }
            j0 += nr;
        }
        i0 += mr;
    }
}

/// out[d] = finish(d, out[d], Σ_{j < count} w(j)·rows[j][d]) for d < dv (rows of width dv),
/// the sums kept in registers `W` columns at a time (twice [`mm`]'s `NR`).
#[inline(always)]
fn weighted_rows<const W: usize>(
    out: &mut [f32],
    rows: &[f32],
    dv: usize,
    count: usize,
    w: impl Fn(usize) -> f32,
    finish: impl Fn(usize, f32, f32) -> f32,
) {
    let mut j0 = 0;
    while j0 < dv {
        let nc = W.min(dv - j0);
        let mut acc = [0.0f32; W];
        if nc == W {
            // Whole blocks with constant bounds, so `acc` stays in registers (a slice of it
            // of run-time length went through the stack: load, FMA, store per term).
            for j in 0..count {
                let wj = w(j);
                let r: &[f32; W] = rows[j * dv + j0..][..W].try_into().expect("W values");
                for l in 0..W {
                    acc[l] = wj.mul_add(r[l], acc[l]);
                }
            }
        } else {
            for j in 0..count {
                let wj = w(j);
                let r = &rows[j * dv + j0..][..nc];
                for (a, &x) in acc[..nc].iter_mut().zip(r) {
                    *a = wj.mul_add(x, *a);
                }
            }
        }
        for (jd, o) in out[j0..j0 + nc].iter_mut().enumerate() {
            *o = finish(j0 + jd, *o, acc[jd]);
        }
        j0 += nc;
    }
}

/// All `t` tokens of one head, a chunk of [`CHUNK`] at a time (see `delta_rule_chunked`):
/// the pseudo-values v' solve a unit lower-triangular system within the chunk, outputs
/// combine the entering state with intra-chunk attention, and S advances once per chunk.
/// The products with the state (S₀ᵀk, S₀ᵀq, the update Σ k v'ᵀ) and the chunk's k·k and
/// q·k run as register-blocked matrix products ([`mm`]); the triangular solve and the
/// outputs sum rows of v' in registers. Writes o [t, dv]; `scratch` holds
/// [`chunked_scratch`] floats.
pub fn chunked(
    level: SimdLevel,
    x: &HeadRows<'_>,
    t: usize,
    s: &mut [f32],
    scratch: &mut [f32],
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match level {
        // SAFETY: the CPU has the features of these levels (checked in the guards).
        SimdLevel::Avx512 if level.is_supported() => {
            return unsafe { chunked_v512(x, t, s, scratch, o) };
        }
        SimdLevel::Avx2 if level.is_supported() => {
            return unsafe { chunked_v256(x, t, s, scratch, o) };
        }
        _ => {}
    }
    chunked_in::<16, 32>(x, t, s, scratch, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn chunked_v512(
    x: &HeadRows<'_>,
    t: usize,
    s: &mut [f32],
    scratch: &mut [f32],
    o: &mut [f32],
) {
    chunked_in::<64, 128>(x, t, s, scratch, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunked_v256(
    x: &HeadRows<'_>,
    t: usize,
    s: &mut [f32],
    scratch: &mut [f32],
    o: &mut [f32],
) {
    chunked_in::<16, 32>(x, t, s, scratch, o)
}

/// The body of [`chunked`] with `NR` columns to [`mm`]'s register blocks and `W` to
/// [`weighted_rows`]'.
#[inline(always)]
fn chunked_in<const NR: usize, const W: usize>(
    x: &HeadRows<'_>,
    t: usize,
    s: &mut [f32],
    scratch: &mut [f32],
    o: &mut [f32],
) {
    let (dk, dv) = (x.dk, x.dv);
    let q = |ti: usize| &x.q[ti * x.q_stride..][..dk];
    let k = |ti: usize| &x.k[ti * x.q_stride..][..dk];
    let v = |ti: usize| &x.v[ti * x.v_stride..][..dv];
    let (vp, rest) = scratch.split_at_mut(CHUNK * dv);
    let (gamma, rest) = rest.split_at_mut(CHUNK);
    let (kt, rest) = rest.split_at_mut(dk * CHUNK);
    let (dots, rest) = rest.split_at_mut(2 * CHUNK * CHUNK);
    let (dec, rest) = rest.split_at_mut(CHUNK * CHUNK);
    let wlast = &mut rest[..CHUNK];
    for start in (0..t).step_by(CHUNK) {
        let c = CHUNK.min(t - start);
        let oc = &mut o[start * dv..(start + c) * dv];
        let mut acc = 0.0;
        for i in 0..c {
            acc += x.g[(start + i) * x.gb_stride];
            gamma[i] = acc;
        }
        // Kᵀ [dk, c] of the chunk, then [K; Q] Kᵀ: k_i·k_j in rows 0..c, q_i·k_j after.
        for j in 0..c {
            for (a, &kv) in k(start + j).iter().enumerate() {
                kt[a * c + j] = kv;
            }
        }
        let kq = |i: usize| {
            if i < c {
                k(start + i)
            } else {
                q(start + i - c)
            }
        };
        mm::<NR>(dots, c, 2 * c, kq, kt, c, dk, c, None);
        // S₀ᵀk_i into v', S₀ᵀq_i into the outputs.
        mm::<NR>(vp, dv, c, |i| k(start + i), s, dv, dk, dv, None);
        mm::<NR>(oc, dv, c, |i| q(start + i), s, dv, dk, dv, None);
        // e^{γ_i−γ_j} for j ≤ i, once for both passes below (an exp per use was 3-4% of a
        // prefill), on the vectorizable exp (libm's, a call each, was 1.5% still).
        for i in 0..c {
            let gi = gamma[i];
            for (d, &gj) in dec[i * c..=i * c + i].iter_mut().zip(&gamma[..=i]) {
                *d = exp_act(gi - gj);
            }
        }
        // v'_i = β_i (v_i − e^{γ_i} S₀ᵀk_i − Σ_{j<i} (k_i·k_j) e^{γ_i−γ_j} v'_j), in order.
        for i in 0..c {
            let ti = start + i;
            let (beta, gi) = (x.beta[ti * x.gb_stride], gamma[i]);
            let decay0 = gi.exp();
            let (done, cur) = vp.split_at_mut(i * dv);
            let cur = &mut cur[..dv];
            let vi = v(ti);
            let kk = &dots[i * c..];
            weighted_rows::<W>(
                cur,
                done,
                dv,
                i,
                |j| kk[j] * dec[i * c + j],
                |jd, u, sum| beta * (vi[jd] - decay0 * u - sum),
            );
        }
        // o_i = e^{γ_i} S₀ᵀq_i + Σ_{j≤i} (q_i·k_j) e^{γ_i−γ_j} v'_j.
        for i in 0..c {
            let gi = gamma[i];
            let decay = gi.exp();
            let qk = &dots[(c + i) * c..];
            let oh = &mut oc[i * dv..(i + 1) * dv];
            weighted_rows::<W>(
                oh,
                vp,
                dv,
                i + 1,
                |j| qk[j] * dec[i * c + j],
                |_, w0, sum| decay * w0 + sum,
            );
        }
        // S = e^{γ_last} S + Σ_j e^{γ_last−γ_j} k_j v'_jᵀ, with the weights folded into Kᵀ.
        let last = gamma[c - 1];
        for (w, &gj) in wlast.iter_mut().zip(&gamma[..c]) {
            *w = exp_act(last - gj);
        }
        for a in 0..dk {
            for (kv, &w) in kt[a * c..(a + 1) * c].iter_mut().zip(&wlast[..c]) {
                *kv *= w;
            }
        }
        mm::<NR>(
            s,
            dv,
            dk,
            |a| &kt[a * c..(a + 1) * c],
            vp,
            dv,
            c,
            dv,
            Some(last.exp()),
        );
    }
}
