//! AVX-512 VNNI kernels of [`super::qmatvec::Precision::Split24`]: 4-bit rows times activations
//! held as three signed bytes each, with `vpdpbusd` integer dot products.
//!
//! Owns the digit preparation of one 32-element block (`split_chunk`), the row kernel and its
//! row loop. (Rows sharing each block's digit loads were faster in cache but slower streaming
//! from memory: once rows came in long runs, the 35B-shaped model decoded at 6.0 tok/s with
//! four rows at a time, 9.9 with two, and 11.6 with one.) No allocation, no shape checks (callers checked them).
//! Mirrors the f32 kernels in `avx512.rs`, which compute the same sums in f32; tests hold both
//! to the same bounds against the reference.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::{BlockScales, affine_rows, q4_segments, row_loop};
use super::qmatvec::{Affine, XPrep};

/// Like [`q4_seg`] with Split24 activations (see [`super::qmatvec::Precision::Split24`]):
/// per block, Σ q·X in i32 from three digit sums (6 `vpdpbusd`), then ·2^-k·s.
/// Bound: per lane and digit two dot products of 4 terms, |q·d| ≤ 15·128, so
/// |((S₂·2^8 + S₁)·2^8 + S₀)| ≤ 15360·65793 < 2^31.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_split_seg(
    p: *const u8,
    n: usize,
    mut sc: BlockScales,
    digits: *const i8,
    lane_inv: *const f32,
) -> __m512 {
    // SAFETY: p holds n/2 bytes (at most REG_GROUPS groups); digits 384 bytes and lane_inv 16
    // floats per 128-element block (rounded up).
    unsafe {
        let nib = _mm512_set1_epi8(0x0F);
        let nw = n / 8;
        let mut tot = _mm512_setzero_ps();
        let mut blk = 0;
        while blk * 16 < nw {
            let rem = nw - blk * 16;
            let w = if rem >= 16 {
                _mm512_loadu_si512(p.add(blk * 64) as *const _)
            } else {
                _mm512_maskz_loadu_epi32(((1u32 << rem) - 1) as u16, p.add(blk * 64) as *const i32)
            };
            let lo = _mm512_and_si512(w, nib);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nib);
            let d = digits.add(blk * 384);
            let ld = |k: usize| _mm512_loadu_si512(d.add(64 * k) as *const _);
            // Three independent digit sums (short dependency chains), combined in i32.
            let z = _mm512_setzero_si512();
            let a2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, ld(0)), hi, ld(1));
            let a1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, ld(2)), hi, ld(3));
            let a0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, ld(4)), hi, ld(5));
            let acc = _mm512_add_epi32(
                _mm512_add_epi32(_mm512_slli_epi32::<16>(a2), _mm512_slli_epi32::<8>(a1)),
                a0,
            );
            let f = _mm512_mul_ps(
                _mm512_cvtepi32_ps(acc),
                _mm512_loadu_ps(lane_inv.add(blk * 16)),
            );
            tot = _mm512_fmadd_ps(f, sc.next(), tot);
            blk += 1;
        }
        tot
    }
}

/// Affine 4-bit rows with Split24 activations; other widths go to [`affine_rows`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn affine_rows_split(
    a: &Affine<'_>,
    xp: &XPrep,
    y: &mut [f32],
    rows: Range<usize>,
) {
    let Some((digits, lane_inv)) = xp.split() else {
        // SAFETY: same contract as ours.
        return unsafe { affine_rows(a, xp, y, rows) };
    };
    if a.bits != 4 {
        // SAFETY: same contract as ours.
        return unsafe { affine_rows(a, xp, y, rows) };
    }
    // SAFETY: `check` sized the rows' bytes; XPrep sized digits, lane_inv and sums for a.n.
    unsafe {
        row_loop(a, xp.sums(a.group), y, rows, |p, s| {
            q4_segments(a, p, s, |pp, n, sc, e0| {
                let d = digits.as_ptr().add(e0 / 128 * 384);
                q4_split_seg(pp, n, sc, d, lane_inv.as_ptr().add(e0 / 8))
            })
        })
    }
}

/// Split24 digits of 32 activations (see [`super::qmatvec::Precision::Split24`]): with
/// 2^e > max|x| (e clamped to [−100, 127]), X = round(x·2^(22−e)) split into balanced bytes
/// X = d₂·2^16 + d₁·2^8 + d₀; the even elements' digits go to `out[0..16]` (d₂), `[128..]`
/// (d₁), `[256..]` (d₀), the odd elements' to the same offsets + 64. Returns 2^(e−22).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn split_chunk(x: &[f32], out: &mut [i8]) -> f32 {
    assert!(x.len() >= 32 && out.len() >= 336);
    // SAFETY: bounds asserted above.
    unsafe {
        let (a, b) = (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        );
        let (m, inv) = split_scale(a, b);
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for (idx, off) in [(even, 0), (odd, 64)] {
            let d = split16(_mm512_permutex2var_ps(a, idx, b), m);
            for (k, dk) in d.into_iter().enumerate() {
                _mm_storeu_si128(out.as_mut_ptr().add(off + 128 * k) as *mut __m128i, dk);
            }
        }
        inv
    }
}

/// Split24 digits of 32 activations as [`split_chunk`], in element order: `out[0..32]` d₂,
/// `[32..64]` d₁, `[64..96]` d₀ (the prefill tile's layout). Returns (2^(e−22), Σx).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn split_block(x: &[f32], out: &mut [i8]) -> (f32, f32) {
    assert!(x.len() >= 32 && out.len() >= 96);
    // SAFETY: bounds asserted above.
    unsafe {
        let (a, b) = (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        );
        let (m, inv) = split_scale(a, b);
        for (v, off) in [(a, 0), (b, 16)] {
            for (k, dk) in split16(v, m).into_iter().enumerate() {
                _mm_storeu_si128(out.as_mut_ptr().add(off + 32 * k) as *mut __m128i, dk);
            }
        }
        (inv, _mm512_reduce_add_ps(_mm512_add_ps(a, b)))
    }
}

/// The shared power of two of the 32 activations in `a` and `b`: (2^(22−e), 2^(e−22)).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn split_scale(a: __m512, b: __m512) -> (__m512, f32) {
    let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    let e = ((max.to_bits() >> 23) as i32 - 126).clamp(-100, 127);
    (
        _mm512_set1_ps(f32::from_bits(((22 - e + 127) as u32) << 23)),
        f32::from_bits(((e - 22 + 127) as u32) << 23),
    )
}

/// The balanced digits [d₂, d₁, d₀] of round(v·m) for 16 activations, as bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn split16(v: __m512, m: __m512) -> [__m128i; 3] {
    let (c128, c255) = (_mm512_set1_epi32(128), _mm512_set1_epi32(255));
    let low =
        |v: __m512i| _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);
    let big = _mm512_cvtps_epi32(_mm512_mul_ps(v, m));
    let d0 = low(big);
    let r = _mm512_srai_epi32::<8>(_mm512_sub_epi32(big, d0));
    let d1 = low(r);
    let d2 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(r, d1));
    [
        _mm512_cvtepi32_epi8(d2),
        _mm512_cvtepi32_epi8(d1),
        _mm512_cvtepi32_epi8(d0),
    ]
}
