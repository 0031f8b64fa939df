//! AVX-512 kernels of the prefill matmul: unpacking weight rows to f32 and the 4×4
//! (rows × tokens) dot-product register tile.
//!
//! Owns only these inner loops; the blocking over rows and tokens lives in `qmatmul.rs`. No
//! allocation, no shape checks (callers checked them). Mirrors `dequant_row` and the portable
//! tile in `qmatmul.rs`.

use std::arch::x86_64::*;

use super::avx512::{BlockScales, REG_GROUPS, scale_at, seg_scales, widen};
use super::qmatvec::Affine;
use crate::linear::{LinearRef, MatRef};
/// Row `r` of W as f32 into `dst`: natural order, or (`lanes`, 4-bit only) the 16-lane nibble
/// order of [`super::qmatvec::XPrep`], padded to whole 128-element blocks. (`_sbuf` is the
/// AVX2 path's scale buffer; this one keeps a row's scales in registers.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn unpack_row(
    w: &LinearRef<'_>,
    r: usize,
    lanes: bool,
    dst: &mut [f32],
    _sbuf: &mut [f32],
) {
    let n = w.in_features;
    let a = match w.mat {
        MatRef::Float { dtype, data } => {
            // SAFETY: `check` guarantees row r's n elements exist.
            unsafe {
                widen(
                    dtype,
                    data.as_ptr().add(r * n * dtype.size()),
                    &mut dst[..n],
                )
            };
            return;
        }
        MatRef::Affine { .. } => match Affine::of(w) {
            Some(a) => a,
            None => unreachable!("an affine matrix"),
        },
    };
    let (p, s, b) = a.row(r);
    let (g, bits, ng) = (a.group, a.bits as usize, a.groups());
    if lanes {
        assert!(bits == 4 && dst.len() >= n.div_ceil(128) * 128);
        let fs = a.float.size();
        for g0 in (0..ng).step_by(REG_GROUPS) {
            let m = REG_GROUPS.min(ng - g0);
            let e0 = g0 * g;
            // SAFETY: sizes asserted above and by `check`; e0 is a multiple of 128 (32 groups
            // of at least 32), so the segment starts a lane block of `dst`.
            unsafe {
                let sc = BlockScales::new(g, seg_scales(a.float, s.as_ptr().add(g0 * fs), m));
                let bc = BlockScales::new(g, seg_scales(a.float, b.as_ptr().add(g0 * fs), m));
                q4_unpack_lanes(
                    p.as_ptr().add(e0 / 2),
                    m * g,
                    sc,
                    bc,
                    dst.as_mut_ptr().add(e0),
                );
            }
        }
        return;
    }
    let fs = a.float.size();
    for gi in 0..ng {
        // SAFETY: group gi's bytes, scale and bias are inside the row (`check`).
        unsafe {
            let sv = _mm512_set1_ps(scale_at(a.float, s.as_ptr(), gi));
            let bv = _mm512_set1_ps(scale_at(a.float, b.as_ptr(), gi));
            let _ = fs;
            let mut off = gi * g;
            while off < (gi + 1) * g {
                let (lo, hi) = if bits == 8 {
                    let q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.as_ptr().add(off) as *const _));
                    let q1 =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(p.as_ptr().add(off + 16) as *const _));
                    (_mm512_cvtepi32_ps(q0), _mm512_cvtepi32_ps(q1))
                } else {
                    unpack32(p.as_ptr().add(off * bits / 8), bits)
                };
                let d = dst.as_mut_ptr().add(off);
                _mm512_storeu_ps(d, _mm512_fmadd_ps(lo, sv, bv));
                _mm512_storeu_ps(d.add(16), _mm512_fmadd_ps(hi, sv, bv));
                off += 32;
            }
        }
    }
}

/// 32 values of `bits` ≤ 8 bits at `p` (4·bits bytes) as two vectors of 16, natural order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn unpack32(p: *const u8, bits: usize) -> (__m512, __m512) {
    let (mut pidx, mut ctrl) = ([0u8; 32], [0u8; 32]);
    for q in 0..4 {
        for m in 0..8 {
            pidx[q * 8 + m] = (q * bits + m) as u8;
            ctrl[q * 8 + m] = (m * bits) as u8;
        }
    }
    let chunk = 4 * bits;
    let lmask: __mmask32 = if chunk >= 32 {
        u32::MAX
    } else {
        (1u32 << chunk) - 1
    };
    // SAFETY: the masked load reads only the 4·bits bytes the caller guarantees.
    unsafe {
        let raw = _mm256_maskz_loadu_epi8(lmask, p as *const i8);
        let spread = _mm256_permutexvar_epi8(_mm256_loadu_si256(pidx.as_ptr() as *const _), raw);
        let sh =
            _mm256_multishift_epi64_epi8(_mm256_loadu_si256(ctrl.as_ptr() as *const _), spread);
        let q = _mm256_and_si256(sh, _mm256_set1_epi8(((1u32 << bits) - 1) as u8 as i8));
        (
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q))),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(q))),
        )
    }
}

/// Dequantizes n elements (at most [`REG_GROUPS`] groups) of a 4-bit row into `dst` in
/// 16-lane nibble order, each block's scales and biases picked out of registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn q4_unpack_lanes(
    p: *const u8,
    n: usize,
    mut sc: BlockScales,
    mut bc: BlockScales,
    dst: *mut f32,
) {
    // SAFETY: p holds n/2 bytes, dst n rounded up to 128 floats.
    unsafe {
        let lut = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let nw = n / 8;
        let mut blk = 0;
        while blk * 16 < nw {
            let rem = nw - blk * 16;
            let w = if rem >= 16 {
                _mm512_loadu_si512(p.add(blk * 64) as *const _)
            } else {
                _mm512_maskz_loadu_epi32(((1u32 << rem) - 1) as u16, p.add(blk * 64) as *const i32)
            };
            let (sv, bv) = (sc.next(), bc.next());
            let d = dst.add(blk * 128);
            macro_rules! step {
                ($k:literal) => {
                    let q = _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $k }>(w), lut);
                    _mm512_storeu_ps(d.add(16 * $k), _mm512_fmadd_ps(q, sv, bv));
                };
            }
            step!(0);
            step!(1);
            step!(2);
            step!(3);
            step!(4);
            step!(5);
            step!(6);
            step!(7);
            blk += 1;
        }
    }
}

/// acc[a][b] = Σ_{i<n} w[a·ws + i]·x[b·xs + i] for a < rr, b < tt (each 1 or 4).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile(
    w: &[f32],
    ws: usize,
    x: &[f32],
    xs: usize,
    n: usize,
    rr: usize,
    tt: usize,
    acc: &mut [[f32; 4]; 4],
) {
    let (w, x) = (w.as_ptr(), x.as_ptr());
    // SAFETY: the caller asserted the slices hold rr (tt) rows of n at stride ws (xs).
    unsafe {
        match (rr, tt) {
            (4, 4) => tile_rt::<4, 4>(w, ws, x, xs, n, acc),
            (4, _) => tile_rt::<4, 1>(w, ws, x, xs, n, acc),
            (_, 4) => tile_rt::<1, 4>(w, ws, x, xs, n, acc),
            _ => tile_rt::<1, 1>(w, ws, x, xs, n, acc),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn tile_rt<const R: usize, const T: usize>(
    w: *const f32,
    ws: usize,
    x: *const f32,
    xs: usize,
    n: usize,
    out: &mut [[f32; 4]; 4],
) {
    let mut a = [[_mm512_setzero_ps(); T]; R];
    let mut i = 0;
    // SAFETY: reads stay inside R rows of w and T rows of x, n elements each (caller).
    unsafe {
        while i < n {
            let m: __mmask16 = if n - i >= 16 {
                u16::MAX
            } else {
                ((1u32 << (n - i)) - 1) as u16
            };
            let mut xv = [_mm512_setzero_ps(); T];
            for b in 0..T {
                xv[b] = _mm512_maskz_loadu_ps(m, x.add(b * xs + i));
            }
            for r in 0..R {
                let wv = _mm512_maskz_loadu_ps(m, w.add(r * ws + i));
                for b in 0..T {
                    a[r][b] = _mm512_fmadd_ps(wv, xv[b], a[r][b]);
                }
            }
            i += 16;
        }
    }
    if R == 4 && T == 4 {
        let mut v = [_mm512_setzero_ps(); 16];
        for r in 0..R {
            for b in 0..T {
                v[r * 4 + b] = a[r][b];
            }
        }
        // SAFETY: features enabled here.
        let sums = unsafe { reduce16(&v) };
        let mut flat = [0.0f32; 16];
        // SAFETY: 16 floats into a local array.
        unsafe { _mm512_storeu_ps(flat.as_mut_ptr(), sums) };
        for r in 0..4 {
            out[r].copy_from_slice(&flat[r * 4..r * 4 + 4]);
        }
        return;
    }
    for r in 0..R {
        for b in 0..T {
            out[r][b] = _mm512_reduce_add_ps(a[r][b]);
        }
    }
}

/// Lane j of the result = the sum of the 16 lanes of v[j]: four rounds of shuffles and adds
/// (45 instructions) instead of 16 separate reductions (about 160), which cost a third of a
/// tile's time on the 512-wide rows of an expert's down projection.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
    // Within each 128-bit lane: pairs of elements of v[2i] and v[2i+1] summed.
    let c: [__m512; 8] = std::array::from_fn(|i| {
        let (x, y) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
    });
    // Each 128-bit lane now holds the lane-local sums of v[4i..4i+4], in order.
    let d: [__m512; 4] = std::array::from_fn(|i| {
        let (x, y) = (c[2 * i], c[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        )
    });
    // Fold the four 128-bit lanes of each d together, twice.
    let fold = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    };
    let e0 = fold(d[0], d[1]);
    let e1 = fold(d[2], d[3]);
    fold(e0, e1)
}
