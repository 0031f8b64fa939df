//! AVX2 + FMA + F16C kernels behind [`super::qmatvec`] and [`super::qmatmul`].
//!
//! Owns the 256-bit inner loops only: 4-bit rows unpack 8 words at once (shift, mask, convert;
//! x comes pre-permuted into that lane order, see [`super::qmatvec::XPrep`]), 8-bit rows widen
//! bytes, other widths unpack a group with the portable bit reader and dot it here. No
//! allocation, no shape checks (callers checked them). Mirrors the portable kernels in
//! `qmatvec.rs`.

use std::arch::x86_64::*;
use std::ops::Range;

use super::qmatvec::{Affine, SCALE_PAD, SEG_GROUPS, XPrep, unpack_group};
use crate::dtype::DType;
use crate::linear::LinearRef;

/// Loads 8 weights of `dtype` starting at element `i` of `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load8(dtype: DType, p: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller guarantees 8 elements of `dtype` are readable at element i.
    unsafe {
        match dtype {
            DType::BF16 => {
                let h = _mm_loadu_si128(p.add(2 * i) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
            DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i) as *const __m128i)),
            _ => _mm256_loadu_ps(p.add(4 * i) as *const f32),
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Σ w_i x_i for n weights of `dtype` at `w` and n floats at `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_w(dtype: DType, w: *const u8, x: *const f32, n: usize) -> f32 {
    // SAFETY: the caller guarantees n elements at both pointers.
    unsafe {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            a0 = _mm256_fmadd_ps(load8(dtype, w, i), _mm256_loadu_ps(x.add(i)), a0);
            a1 = _mm256_fmadd_ps(load8(dtype, w, i + 8), _mm256_loadu_ps(x.add(i + 8)), a1);
            i += 16;
        }
        if i + 8 <= n {
            a0 = _mm256_fmadd_ps(load8(dtype, w, i), _mm256_loadu_ps(x.add(i)), a0);
            i += 8;
        }
        let mut acc = hsum(_mm256_add_ps(a0, a1));
        while i < n {
            acc += scale_at(dtype, w, i) * *x.add(i);
            i += 1;
        }
        acc
    }
}

/// Σ a_i b_i over two f32 slices of equal length.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    // SAFETY: n elements are in both slices.
    unsafe { dot_w(DType::F32, a.as_ptr() as *const u8, b.as_ptr(), n) }
}

/// Element `gi` of little-endian floats of `dtype` at `p`, widened.
#[inline(always)]
pub(super) unsafe fn scale_at(dtype: DType, p: *const u8, gi: usize) -> f32 {
    // SAFETY: the caller guarantees element gi is readable.
    unsafe {
        match dtype {
            DType::BF16 => {
                f32::from_bits((std::ptr::read_unaligned(p.add(2 * gi) as *const u16) as u32) << 16)
            }
            DType::F16 => {
                half::f16::from_bits(std::ptr::read_unaligned(p.add(2 * gi) as *const u16)).to_f32()
            }
            _ => f32::from_bits(std::ptr::read_unaligned(p.add(4 * gi) as *const u32)),
        }
    }
}

/// Float weights: y[r] = row r · x for every row of `data` ([y.len(), x.len()] of `dtype`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn float_rows(dtype: DType, data: &[u8], x: &[f32], y: &mut [f32]) {
    let rb = x.len() * dtype.size();
    for (r, yr) in y.iter_mut().enumerate() {
        // SAFETY: `data` holds y.len() rows of rb bytes (checked by the caller).
        *yr = unsafe { dot_w(dtype, data.as_ptr().add(r * rb), x.as_ptr(), x.len()) };
    }
}

/// Σ_i s_{g(i)} q_i x_i over n 4-bit elements, per lane; `xl` is x in 8-lane nibble order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_seg(p: *const u8, n: usize, s: *const f32, xl: *const f32, g: usize) -> __m256 {
    // SAFETY: p holds n/2 bytes, xl n rounded up to 64 floats, s n/g + 16 floats.
    unsafe {
        let per = (g / 8) as i32; // words per group
        let idx = _mm256_setr_epi32(
            0,
            1 / per,
            2 / per,
            3 / per,
            4 / per,
            5 / per,
            6 / per,
            7 / per,
        );
        let nib = _mm256_set1_epi32(15);
        let nw = n / 8;
        let mut tot = _mm256_setzero_ps();
        let mut blk = 0;
        while blk * 8 < nw {
            let rem = nw - blk * 8;
            let pw = p.add(blk * 32);
            let w = if rem >= 8 {
                _mm256_loadu_si256(pw as *const __m256i)
            } else {
                // n is a multiple of 32, so a partial block is 4 words.
                _mm256_maskload_epi32(
                    pw as *const i32,
                    _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0),
                )
            };
            let xb = xl.add(blk * 64);
            let q = |v: __m256i| _mm256_cvtepi32_ps(_mm256_and_si256(v, nib));
            let mut a0 = _mm256_mul_ps(q(w), _mm256_loadu_ps(xb));
            let mut a1 = _mm256_mul_ps(q(_mm256_srli_epi32::<4>(w)), _mm256_loadu_ps(xb.add(8)));
            a0 = _mm256_fmadd_ps(
                q(_mm256_srli_epi32::<8>(w)),
                _mm256_loadu_ps(xb.add(16)),
                a0,
            );
            a1 = _mm256_fmadd_ps(
                q(_mm256_srli_epi32::<12>(w)),
                _mm256_loadu_ps(xb.add(24)),
                a1,
            );
            a0 = _mm256_fmadd_ps(
                q(_mm256_srli_epi32::<16>(w)),
                _mm256_loadu_ps(xb.add(32)),
                a0,
            );
            a1 = _mm256_fmadd_ps(
                q(_mm256_srli_epi32::<20>(w)),
                _mm256_loadu_ps(xb.add(40)),
                a1,
            );
            a0 = _mm256_fmadd_ps(
                q(_mm256_srli_epi32::<24>(w)),
                _mm256_loadu_ps(xb.add(48)),
                a0,
            );
            a1 = _mm256_fmadd_ps(
                q(_mm256_srli_epi32::<28>(w)),
                _mm256_loadu_ps(xb.add(56)),
                a1,
            );
            let sv = _mm256_permutevar8x32_ps(
                _mm256_loadu_ps(s.add((blk * 64) >> g.trailing_zeros())),
                idx,
            );
            tot = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), sv, tot);
            blk += 1;
        }
        tot
    }
}

/// Σ_g s_g Σ_{i∈g} q_i x_i over n 8-bit elements, per lane; x in natural order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_seg(
    p: *const u8,
    n: usize,
    sd: DType,
    s: *const u8,
    x: *const f32,
    g: usize,
) -> __m256 {
    // SAFETY: p holds n bytes, x n floats, s n/g scales.
    unsafe {
        let mut tot = _mm256_setzero_ps();
        for gi in 0..n / g {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut off = gi * g;
            while off < (gi + 1) * g {
                let q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(off) as *const __m128i));
                let q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(off + 8) as *const __m128i));
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), _mm256_loadu_ps(x.add(off)), a0);
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_loadu_ps(x.add(off + 8)), a1);
                off += 16;
            }
            let sv = _mm256_set1_ps(scale_at(sd, s, gi));
            tot = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), sv, tot);
        }
        tot
    }
}

/// Affine rows `rows` of y = W x (see [`super::qmatvec::matvec_rows`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn affine_rows(a: &Affine<'_>, xp: &XPrep, y: &mut [f32], rows: Range<usize>) {
    let mut sbuf = [0.0f32; SEG_GROUPS + SCALE_PAD];
    let mut qbuf = [0.0f32; 128];
    let (g, fs, bits) = (a.group, a.float.size(), a.bits as usize);
    let gb = g * bits / 8;
    let (x, lanes, sums) = (xp.x(), xp.lanes(), xp.sums(g));
    for (yr, r) in y.iter_mut().zip(rows) {
        let (p, s, b) = a.row(r);
        // SAFETY: `check` sized the row's bytes; XPrep sized x, lanes and sums for a.n.
        unsafe {
            let mut acc = dot_w(a.float, b.as_ptr(), sums.as_ptr(), a.groups());
            let mut tot = _mm256_setzero_ps();
            for g0 in (0..a.groups()).step_by(SEG_GROUPS) {
                let ng = SEG_GROUPS.min(a.groups() - g0);
                let (e0, ne) = (g0 * g, ng * g);
                let pp = p.as_ptr().add(e0 * bits / 8);
                let sp = s.as_ptr().add(g0 * fs);
                match bits {
                    4 => {
                        for (j, o) in sbuf[..ng].iter_mut().enumerate() {
                            *o = scale_at(a.float, sp, j);
                        }
                        sbuf[ng..ng + SCALE_PAD].fill(0.0);
                        let part = q4_seg(pp, ne, sbuf.as_ptr(), lanes.as_ptr().add(e0), g);
                        tot = _mm256_add_ps(tot, part);
                    }
                    8 => {
                        let part = q8_seg(pp, ne, a.float, sp, x.as_ptr().add(e0), g);
                        tot = _mm256_add_ps(tot, part);
                    }
                    _ => {
                        for j in 0..ng {
                            let gi = g0 + j;
                            unpack_group(a.bits, &p[gi * gb..(gi + 1) * gb], &mut qbuf[..g]);
                            acc += scale_at(a.float, sp, j)
                                * dot(&qbuf[..g], &x[gi * g..(gi + 1) * g]);
                        }
                    }
                }
            }
            acc += hsum(tot);
            *yr = acc;
        }
    }
}

/// Row `r` of W as f32 into `dst`: natural order, or (`lanes`, 4-bit only) the 8-lane nibble
/// order of [`super::qmatvec::XPrep`], padded to whole 64-element blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack_row(
    w: &LinearRef<'_>,
    r: usize,
    lanes: bool,
    dst: &mut [f32],
    sbuf: &mut [f32],
) {
    let n = w.in_features;
    let Some(a) = Affine::of(w).filter(|a| lanes || a.bits == 8) else {
        super::qmatvec::dequant_row(w, r, dst);
        return;
    };
    let (p, s, b) = a.row(r);
    let (g, ng) = (a.group, a.groups());
    if !lanes {
        for gi in 0..ng {
            // SAFETY: group gi's bytes, scale and bias are inside the row (`check`).
            unsafe {
                let sv = _mm256_set1_ps(scale_at(a.float, s.as_ptr(), gi));
                let bv = _mm256_set1_ps(scale_at(a.float, b.as_ptr(), gi));
                for off in (gi * g..(gi + 1) * g).step_by(8) {
                    let q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.as_ptr().add(off) as *const _));
                    let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sv, bv);
                    _mm256_storeu_ps(dst.as_mut_ptr().add(off), v);
                }
            }
        }
        return;
    }
    assert!(ng <= UNPACK_GROUPS && dst.len() >= n.div_ceil(64) * 64);
    let (sb, bb) = sbuf.split_at_mut(UNPACK_GROUPS + SCALE_PAD);
    // SAFETY: sizes asserted above and by `check`.
    unsafe {
        for gi in 0..ng {
            sb[gi] = scale_at(a.float, s.as_ptr(), gi);
            bb[gi] = scale_at(a.float, b.as_ptr(), gi);
        }
        let per = (g / 8) as i32;
        let idx = _mm256_setr_epi32(
            0,
            1 / per,
            2 / per,
            3 / per,
            4 / per,
            5 / per,
            6 / per,
            7 / per,
        );
        let nib = _mm256_set1_epi32(15);
        let nw = n / 8;
        let mut blk = 0;
        while blk * 8 < nw {
            let pw = p.as_ptr().add(blk * 32);
            let w = if nw - blk * 8 >= 8 {
                _mm256_loadu_si256(pw as *const __m256i)
            } else {
                _mm256_maskload_epi32(
                    pw as *const i32,
                    _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0),
                )
            };
            let sv = _mm256_permutevar8x32_ps(
                _mm256_loadu_ps(sb.as_ptr().add((blk * 64) >> g.trailing_zeros())),
                idx,
            );
            let bv = _mm256_permutevar8x32_ps(
                _mm256_loadu_ps(bb.as_ptr().add((blk * 64) >> g.trailing_zeros())),
                idx,
            );
            let d = dst.as_mut_ptr().add(blk * 64);
            let mut wk = w;
            for k in 0..8 {
                let q = _mm256_cvtepi32_ps(_mm256_and_si256(wk, nib));
                _mm256_storeu_ps(d.add(8 * k), _mm256_fmadd_ps(q, sv, bv));
                wk = _mm256_srli_epi32::<4>(wk);
            }
            blk += 1;
        }
    }
}

/// Groups of one row [`unpack_row`] widens at once in lane order.
pub(super) const UNPACK_GROUPS: usize = 1024;

/// acc[a][b] = Σ_{i<n} w[a·ws + i]·x[b·xs + i] for a < rr, b < tt (each 1 or 4).
#[target_feature(enable = "avx2,fma,f16c")]
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
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    // SAFETY: the caller asserted the slices hold rr (tt) rows of n at stride ws (xs).
    unsafe {
        for a0 in (0..rr).step_by(2) {
            let mut part = [[0.0f32; 4]; 2];
            match (rr - a0 >= 2, tt) {
                (true, 4) => tile_rt::<2, 4>(wp.add(a0 * ws), ws, xp, xs, n, &mut part),
                (true, _) => tile_rt::<2, 1>(wp.add(a0 * ws), ws, xp, xs, n, &mut part),
                (false, 4) => tile_rt::<1, 4>(wp.add(a0 * ws), ws, xp, xs, n, &mut part),
                (false, _) => tile_rt::<1, 1>(wp.add(a0 * ws), ws, xp, xs, n, &mut part),
            }
            for (d, s) in acc[a0..].iter_mut().zip(&part).take(rr - a0) {
                *d = *s;
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rt<const R: usize, const T: usize>(
    w: *const f32,
    ws: usize,
    x: *const f32,
    xs: usize,
    n: usize,
    out: &mut [[f32; 4]; 2],
) {
    let mut a = [[_mm256_setzero_ps(); T]; R];
    let mut i = 0;
    // SAFETY: reads stay inside R rows of w and T rows of x, n elements each (caller).
    unsafe {
        while i + 8 <= n {
            let mut xv = [_mm256_setzero_ps(); T];
            for b in 0..T {
                xv[b] = _mm256_loadu_ps(x.add(b * xs + i));
            }
            for r in 0..R {
                let wv = _mm256_loadu_ps(w.add(r * ws + i));
                for b in 0..T {
                    a[r][b] = _mm256_fmadd_ps(wv, xv[b], a[r][b]);
                }
            }
            i += 8;
        }
        for r in 0..R {
            for b in 0..T {
                let mut s = hsum(a[r][b]);
                for j in i..n {
                    s += *w.add(r * ws + j) * *x.add(b * xs + j);
                }
                out[r][b] = s;
            }
        }
    }
}
