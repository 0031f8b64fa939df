//! The gated delta rule of one DeltaNet value head: the recurrent step (decode) and the
//! chunked form (prefill, `delta/chunked.rs`), on a state S [dk, dv] of f32 (the step also on
//! bf16 bits).
//!
//! Owns the state arithmetic only; the caller normalises q and k, computes the log-decay g
//! and β, and runs heads in parallel. It must not allocate (scratch comes from the caller).
//! Mirrors [`crate::model::delta_net::delta_rule_recurrent`] and `delta_rule_chunked`:
//! the step reads S once for u₀ = Sᵀk and w₀ = Sᵀq and writes it once, using
//! u = αu₀, δ = β(v − u), S' = αS + kδᵀ and o = S'ᵀq = αw₀ + (k·q)δ, which is the reference's
//! decay–read–update–read sequence in one trip through memory instead of four passes.

use crate::cpu::SimdLevel;
use crate::cpu::kernels::ops::{plain, simd_fn};

mod chunked;
pub use chunked::{HeadRows, chunked, chunked_scratch};

/// Value columns [`step`] gathers at once (two accumulators of this many floats, in L1): a
/// whole row of S at dv = 128.
const STEP_COLS: usize = 128;
/// [`STEP_COLS`] for [`step_bf16`]'s AVX2 form: u and w of 32 columns each take 8 of AVX2's 16
/// registers.
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
    /// One token: S \[dk, dv\] ← e^g·S + k δᵀ with δ = β(v − e^g·Sᵀk); o \[dv\] = Sᵀq after the
    /// update. Done `STEP_COLS` value columns at a time, row after row: u = Sᵀk and w = Sᵀq
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
