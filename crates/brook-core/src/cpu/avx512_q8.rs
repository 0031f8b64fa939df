//! AVX-512 VNNI kernels of [`super::qmatvec::Precision::Fast`]: 4-bit rows times activations
//! quantized to int8 per 32-element block (as llama.cpp's Q8 activations), with `vpdpbusd`.
//!
//! Owns the int8 preparation of one 32-element block (`q8_chunk`), the one-row kernel and its
//! row loop. The unsigned nibbles q ∈ [0, 15] and the signed bytes X feed
//! `vpdpbusd` as they are: one instruction per 64 products, two per 64 weight bytes (Split24
//! needs six). No allocation, no shape checks (callers checked them). Lossy: it mirrors the
//! f32 kernels in `avx512.rs` up to the int8 rounding of x, which the tests bound.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::{BlockScales, affine_rows, q4_segments, row_loop};
use super::qmatvec::{Affine, XPrep};

/// Int8 activations of 32 elements: d = max|x| / 127, X = round(x / d) ∈ [−127, 127]. The even
/// elements go to `out[0..16]`, the odd ones to `out[64..80]`; byte t of 4j.. is element
/// 8j + 2t (+1 for odd), matching the low and high nibbles of packed word j. Returns d (NaN
/// when the block holds a NaN or an infinity).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn q8_chunk(x: &[f32], out: &mut [i8]) -> f32 {
    assert!(x.len() >= 32 && out.len() >= 80);
    // SAFETY: bounds asserted above.
    unsafe {
        let (a, b) = (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        );
        let (d, m) = q8_scale(a, b);
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for (idx, off) in [(even, 0), (odd, 64)] {
            let v = _mm512_permutex2var_ps(a, idx, b);
            let q = _mm512_cvtps_epi32(_mm512_mul_ps(v, m));
            _mm_storeu_si128(
                out.as_mut_ptr().add(off) as *mut __m128i,
                _mm512_cvtepi32_epi8(q),
            );
        }
        d
    }
}

/// Int8 activations of 32 elements as [`q8_chunk`], in element order into `out[0..32]` (the
/// prefill tile's layout). Returns (d, Σx).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn q8_block(x: &[f32], out: &mut [i8]) -> (f32, f32) {
    assert!(x.len() >= 32 && out.len() >= 32);
    // SAFETY: bounds asserted above.
    unsafe {
        let (a, b) = (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        );
        let (d, m) = q8_scale(a, b);
        let q = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, m)));
        _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, q);
        let q = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, m)));
        _mm_storeu_si128(out.as_mut_ptr().add(16) as *mut __m128i, q);
        (d, _mm512_reduce_add_ps(_mm512_add_ps(a, b)))
    }
}

/// (d, 1/d as a vector) of the 32 activations in `a` and `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn q8_scale(a: __m512, b: __m512) -> (f32, __m512) {
    let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    // A NaN or infinity in the block makes d NaN, so the outputs turn NaN as the f32
    // kernels' would, instead of the block silently counting as zero.
    let (d, inv) = if !max.is_finite() {
        (f32::NAN, 0.0)
    } else if max > 0.0 {
        (max / 127.0, 127.0 / max)
    } else {
        (0.0, 0.0)
    };
    (d, _mm512_set1_ps(inv))
}

/// Affine 4-bit rows with int8 activations; other widths go to [`affine_rows`] (f32).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn affine_rows_q8(a: &Affine<'_>, xp: &XPrep, y: &mut [f32], rows: Range<usize>) {
    let Some((qx, lane_d)) = xp.q8() else {
        // SAFETY: same contract as ours.
        return unsafe { affine_rows(a, xp, y, rows) };
    };
    if a.bits != 4 {
        // SAFETY: same contract as ours.
        return unsafe { affine_rows(a, xp, y, rows) };
    }
    // One row at a time: four rows sharing each block's activations (as Split24 also did)
    // ran the 35B decode at 8.9-9.7 tok/s against 10.2-10.6 one row at a time, and the head
    // matvec at 15.8-17.6 against 19.1-21.1 GiB/s (2 threads, back to back, read 28-29 GiB/s):
    // streaming rows from DRAM, four interleaved 1 KiB streams defeat the prefetchers, and
    // the int8 activations are only two loads per block.
    // SAFETY: `check` sized the rows' bytes; XPrep sized qx, lane_d and sums for a.n.
    unsafe {
        row_loop(a, xp.sums(a.group), y, rows, |p, s| {
            q4_segments(a, p, s, |pp, n, sc, e0| {
                q4_q8_row(pp, n, sc, qx.as_ptr().add(e0), lane_d.as_ptr().add(e0 / 8))
            })
        })
    }
}

/// Σ_i s_{g(i)} q_i x̃_i per lane for one row. Per 128-element block: the row's 64 weight
/// bytes, `vpdpbusd` of the low nibbles with the even bytes and the high nibbles with the odd
/// ones (lane j = word j, 8 products, |Σ| ≤ 8·15·127), then ·d (per lane) ·s (per lane's
/// group) in f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_q8_row(
    p: *const u8,
    n: usize,
    mut sc: BlockScales,
    qx: *const i8,
    lane_d: *const f32,
) -> __m512 {
    // SAFETY: p holds n/2 bytes (at most REG_GROUPS groups); qx 128 bytes and lane_d 16 floats
    // per 128-element block (rounded up).
    unsafe {
        let nib = _mm512_set1_epi8(0x0F);
        let z = _mm512_setzero_si512();
        let nw = n / 8;
        let mut tot = _mm512_setzero_ps();
        let mut blk = 0;
        while blk * 16 < nw {
            let rem = nw - blk * 16;
            let m: __mmask16 = if rem >= 16 {
                u16::MAX
            } else {
                ((1u32 << rem) - 1) as u16
            };
            let xb = qx.add(blk * 128);
            let (ev, od) = (
                _mm512_loadu_si512(xb as *const _),
                _mm512_loadu_si512(xb.add(64) as *const _),
            );
            let w = _mm512_maskz_loadu_epi32(m, p.add(blk * 64) as *const i32);
            let lo = _mm512_and_si512(w, nib);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nib);
            let acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, ev), hi, od);
            let f = _mm512_mul_ps(
                _mm512_cvtepi32_ps(acc),
                _mm512_loadu_ps(lane_d.add(blk * 16)),
            );
            tot = _mm512_fmadd_ps(f, sc.next(), tot);
            blk += 1;
        }
        tot
    }
}
