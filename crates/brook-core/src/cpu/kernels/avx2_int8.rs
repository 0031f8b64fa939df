//! The AVX2 one-token product of 4-bit matrices in rows ([`Order::Rows`]) at Fast (int8
//! activations), four rows a pass: `vpmaddubsw` (or AVX-VNNI's `vpdpbusd`) products of each row,
//! summed per 32-element block across the four rows' registers by horizontal adds, so the
//! block sums of four rows share one register and one conversion, scaling and FMA where each
//! row took its own (the int8 products are few enough that those were a third of the work):
//! on plain AVX2 the 8192 × 2048 kernel bench went 31.0 → 34.4 GiB/s on one thread, decode of
//! the resident 35B 2.6-5 % faster (docs/bench/2026-12-04.md); with AVX-VNNI the same as the
//! two-rows kernel. Split24 keeps `avx2_int.rs`'s two-rows kernel (its three digit rows would
//! take three such reductions, as dear as the scalings they save: 6 % slower). The activation
//! digits, the pieces' nibbles, the products, the segment walk and the dispatch are
//! `avx2_int.rs`'s; the integer sums are the same on both instruction sets, so are the bits.
//!
//! [`Order::Rows`]: crate::linear::Order::Rows

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{load8, scale_at};
use super::avx2_int::{CHUNK, Digits, dot_vnni, nibbles, pair_products, walk_segment};
use super::qmatvec::{Affine, SCALE_PAD, SEG_GROUPS};
use crate::dtype::DType;

/// Rows `rows` of y = W x for a 4-bit `a` in rows with int8 digits `x` (shapes asserted by
/// `avx2_int::matvec_rows`); `vnni` takes AVX-VNNI's instruction.
///
/// # Safety
/// AVX2 (and with `vnni`, AVX-VNNI) must be present and `a` checked.
pub(super) unsafe fn rows(
    a: &Affine<'_>,
    vnni: bool,
    x: &Digits<'_>,
    y: &mut [f32],
    rows: Range<usize>,
) {
    // SAFETY: the caller's contract.
    unsafe {
        if vnni {
            rows_vnni(a, x, y, rows)
        } else {
            rows_madd(a, x, y, rows)
        }
    }
}

/// Rows a kernel call takes: their block sums share one register after [`red_madd`] or
/// [`red_vnni`].
const ROWS: usize = 4;

/// The least distance in bytes the row loop prefetches ahead of each row: two passes of a
/// down projection's short rows (256 bytes) are 2 KiB, less time than a DRAM read takes
/// (resident 35B, `BROOK_SIMD=avx2`, `fast`: 30.4-30.8 tok/s at two passes, 31.1-31.2 at
/// 4 KiB, 30.7-31.2 at 8 and 16 KiB; dev-2c, 2026-12-05).
const PREFETCH_MIN: usize = 4096;

/// A segment's scales as [`widen_scales`] lays them out, aligned so that a group's four (16
/// bytes at a multiple of 16) read as one `__m128`.
#[repr(C, align(32))]
struct Scales([f32; ROWS * SEG_GROUPS + SCALE_PAD]);

/// The kernel of [`ROWS`] rows over one segment of `nel` elements (a multiple of 32). Per
/// chunk, `$dot` gives each row's products in lanes and `$reduce` sums them per 32-element
/// block into one register, [rows' sums of the chunk's first block | of its second], which
/// the digit factors (`coef` holds them in that layout) and the rows' group scales scale into
/// `acc`, laid out the same way: one conversion, multiplication and FMA for four rows where
/// each row took its own. A row's arithmetic is the same whichever rows share its register.
/// Defined twice, with and without AVX-VNNI.
macro_rules! segment_kernel {
    ($name:ident, $features:literal, $dot:ident, $reduce:ident) => {
        /// Adds to `acc` the rows' Σ s_g·q·x over the segment, per block half (see above).
        ///
        /// # Safety
        /// The features must be present; `p[i]` holds nel/2 bytes, `st` the segment's scales
        /// widened to f32 by [`widen_scales`] (four a group, plus [`SCALE_PAD`]) in
        /// [`Scales`] (aligned), `dig` and
        /// `coef` the segment's chunks (int8: one digit row); `ahead` is how far ahead of each row to prefetch (a
        /// hint: it may pass the matrix).
        #[allow(clippy::too_many_arguments)]
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const G: usize>(
            p: [*const u8; ROWS],
            nel: usize,
            st: *const f32,
            dig: *const i8,
            coef: *const f32,
            ahead: usize,
            acc: &mut __m256,
        ) {
            // SAFETY: the caller's contract (see above); a half chunk reads 16 bytes.
            unsafe {
                let mut step = |c: usize, half: bool| {
                    let piece = p.map(|pi| nibbles(pi.add(c * 32), half));
                    let (lo, hi) = (piece.map(|v| v.0), piece.map(|v| v.1));
                    let d = dig.add(c * CHUNK);
                    let de = _mm256_loadu_si256(d as *const _);
                    let dd = _mm256_loadu_si256(d.add(32) as *const _);
                    let s = $reduce([0, 1, 2, 3].map(|i| $dot(lo[i], hi[i], de, dd)));
                    let cf = _mm256_loadu_ps(coef.add(c * 8));
                    // The rows' scales of each block's group.
                    let sv = match G {
                        32 => _mm256_loadu_ps(st.add(2 * ROWS * c)),
                        64 => _mm256_broadcast_ps(&*(st.add(ROWS * c) as *const __m128)),
                        _ => _mm256_broadcast_ps(&*(st.add(ROWS * (c / 2)) as *const __m128)),
                    };
                    let pv = _mm256_mul_ps(_mm256_cvtepi32_ps(s), cf);
                    *acc = _mm256_fmadd_ps(pv, sv, *acc);
                };
                walk_segment(p, nel, ahead, &mut step);
            }
        }
    };
}

/// Four rows' [`pair_products`] lanes summed per block: two `vphaddw` levels (|·| ≤ 4·7680 <
/// 2^15, no wrap), then `vpmaddwd` adds the last pairs into i32: [rows' first block | second].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn red_madd(t: [__m256i; ROWS]) -> __m256i {
    let (a, b) = (_mm256_hadd_epi16(t[0], t[1]), _mm256_hadd_epi16(t[2], t[3]));
    _mm256_madd_epi16(_mm256_hadd_epi16(a, b), _mm256_set1_epi16(1))
}

/// Four rows' [`dot_vnni`] lanes summed per block (`vphaddd` twice): the same integers as
/// [`red_madd`], in the same layout.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn red_vnni(t: [__m256i; ROWS]) -> __m256i {
    let (a, b) = (_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
    _mm256_hadd_epi32(a, b)
}

segment_kernel!(seg_madd, "avx2,fma,f16c", pair_products, red_madd);
segment_kernel!(seg_vnni, "avx2,fma,f16c,avxvnni", dot_vnni, red_vnni);

/// The row loop of [`rows`] over the segment kernel `$seg`, [`ROWS`] rows at a time
/// (the last call's missing rows repeat its last row, their sums unused); the rows' scales are
/// widened once per segment, their bias terms (Σ_g b_g·Σx_g) go into the same register as
/// their products ([`bias_terms`]), and the packed bytes, scales and biases of the rows two
/// passes ahead (at least [`PREFETCH_MIN`] bytes) are prefetched (four rows read side by
/// side lose the hardware prefetchers; one pass ahead decoded 3-4 % slower than the two-rows
/// kernel). A pass's own cost counts: an
/// expert's down projection has rows of 8 groups, where a bias dot product per row and slices
/// recomputed per row took as long as the products (the 2048 × 512 kernel bench ran at 55 %
/// of the 512 × 2048 one's speed). Defined twice, with and without AVX-VNNI, so the kernel
/// inlines into it.
macro_rules! row_loop {
    ($name:ident, $features:literal, $seg:ident) => {
        /// # Safety
        /// As [`rows`], shapes asserted there.
        #[target_feature(enable = $features)]
        unsafe fn $name(a: &Affine<'_>, x: &Digits<'_>, y: &mut [f32], rows: Range<usize>) {
            let (g, ng, fs) = (a.group, a.groups(), a.float.size());
            let (rb, sbytes) = (a.row_bytes(), ng * fs);
            assert!(a.packed.len() >= rows.end * rb && a.scales.len() >= rows.end * sbytes);
            assert!(a.biases.len() >= rows.end * sbytes);
            let (pk, sc, bi) = (a.packed.as_ptr(), a.scales.as_ptr(), a.biases.as_ptr());
            let pf = (2 * ROWS * rb).max(PREFETCH_MIN);
            let ahead_rows = pf / rb;
            let mut st = Scales([0.0; ROWS * SEG_GROUPS + SCALE_PAD]);
            let mut r = rows.start;
            while r < rows.end {
                let nr = ROWS.min(rows.end - r);
                let at = [r, r + 1.min(nr - 1), r + 2.min(nr - 1), r + 3.min(nr - 1)];
                for q in [sc, bi] {
                    let ahead = q.wrapping_add((r + ahead_rows) * sbytes);
                    for off in (0..nr * sbytes).step_by(64) {
                        // A hint only (it may pass the matrix).
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off) as *const i8);
                    }
                }
                let mut acc = _mm256_setzero_ps();
                for g0 in (0..ng).step_by(SEG_GROUPS) {
                    let k = SEG_GROUPS.min(ng - g0);
                    let (e0, nel) = (g0 * g, k * g);
                    let c0 = e0 / CHUNK;
                    // SAFETY: rows below rows.end hold rb packed bytes and sbytes of scales
                    // and of biases (asserted); segments start at a multiple of 512 groups, so
                    // of a chunk; st holds ROWS·k + SCALE_PAD floats, the sums ng floats.
                    unsafe {
                        let src = at.map(|ri| sc.add(ri * sbytes + g0 * fs));
                        widen_scales(a.float, src, k, &mut st.0);
                        let bsrc = at.map(|ri| bi.add(ri * sbytes + g0 * fs));
                        acc = bias_terms(a.float, bsrc, x.sums[g0..g0 + k].as_ptr(), k, acc);
                        let d = x.digits[c0 * CHUNK..].as_ptr();
                        let cf = x.coef[c0 * 8..].as_ptr();
                        let p = at.map(|ri| pk.add(ri * rb + e0 / 2));
                        let st = st.0.as_ptr();
                        match g {
                            32 => $seg::<32>(p, nel, st, d, cf, pf, &mut acc),
                            64 => $seg::<64>(p, nel, st, d, cf, pf, &mut acc),
                            _ => $seg::<128>(p, nel, st, d, cf, pf, &mut acc),
                        }
                    }
                }
                // Each row's two halves.
                let mut halves = [0.0f32; 8];
                // SAFETY: 8 floats.
                unsafe { _mm256_storeu_ps(halves.as_mut_ptr(), acc) };
                for (i, yi) in y[r - rows.start..r - rows.start + nr]
                    .iter_mut()
                    .enumerate()
                {
                    *yi = halves[i] + halves[ROWS + i];
                }
                r += nr;
            }
        }
    };
}

row_loop!(rows_madd, "avx2,fma,f16c", seg_madd);
row_loop!(rows_vnni, "avx2,fma,f16c,avxvnni", seg_vnni);

/// The four rows' group of `i..i + 8` from `src` (8 values of `float` at each), transposed:
/// [groups i, i + 4 | i + 1, i + 5 | i + 2, i + 6 | i + 3, i + 7], each register [the rows' four
/// of the first group | of the second]. Always inlined into the row loops, whose AVX2 it
/// takes (as are [`widen_scales`] and [`bias_terms`]: called, they ran 16 % of a decode).
///
/// # Safety
/// AVX2 must be present; each `src[i]` holds i + 8 elements.
#[inline(always)]
unsafe fn transpose8(float: DType, src: [*const u8; ROWS], i: usize) -> [__m256; 4] {
    // SAFETY: each src holds i + 8 elements (caller); AVX2 is present where this inlines
    // (the row loops).
    unsafe {
        let v = src.map(|s| load8(float, s, i));
        let (t0, t1) = (
            _mm256_unpacklo_ps(v[0], v[1]),
            _mm256_unpackhi_ps(v[0], v[1]),
        );
        let (t2, t3) = (
            _mm256_unpacklo_ps(v[2], v[3]),
            _mm256_unpackhi_ps(v[2], v[3]),
        );
        [
            _mm256_shuffle_ps::<0x44>(t0, t2),
            _mm256_shuffle_ps::<0xEE>(t0, t2),
            _mm256_shuffle_ps::<0x44>(t1, t3),
            _mm256_shuffle_ps::<0xEE>(t1, t3),
        ]
    }
}

/// `k` scales of `float` of each of [`ROWS`] rows (`src[i]`) widened to f32 into `out` a
/// group at a time, the rows' four side by side ([`ROWS`]·k floats), then [`SCALE_PAD`]
/// zeros.
///
/// # Safety
/// AVX2 must be present; each `src[i]` holds k elements, `out` ROWS·k + SCALE_PAD floats.
#[inline(always)]
unsafe fn widen_scales(float: DType, src: [*const u8; ROWS], k: usize, out: &mut [f32]) {
    let whole = k / 8 * 8;
    let o = out.as_mut_ptr();
    for i in (0..whole).step_by(8) {
        // SAFETY: each src holds k ≥ i + 8 elements, out ROWS·k + SCALE_PAD floats.
        unsafe {
            let [u0, u1, u2, u3] = transpose8(float, src, i);
            let at = o.add(ROWS * i);
            _mm256_storeu_ps(at, _mm256_permute2f128_ps::<0x20>(u0, u1));
            _mm256_storeu_ps(at.add(8), _mm256_permute2f128_ps::<0x20>(u2, u3));
            _mm256_storeu_ps(at.add(16), _mm256_permute2f128_ps::<0x31>(u0, u1));
            _mm256_storeu_ps(at.add(24), _mm256_permute2f128_ps::<0x31>(u2, u3));
        }
    }
    for j in whole..k {
        for (i, &s) in src.iter().enumerate() {
            // SAFETY: j < k elements at s.
            out[ROWS * j + i] = unsafe { scale_at(float, s, j) };
        }
    }
    out[ROWS * k..ROWS * k + SCALE_PAD].fill(0.0);
}

/// `acc` plus the four rows' bias terms over `k` groups, b_g (of `float`, from `src[i]`) times
/// Σx of group g (`sums`), in [`rows`]' layout: row i's terms in lanes i and 4 + i.
///
/// # Safety
/// AVX2 must be present; each `src[i]` holds k elements, `sums` k floats.
#[inline(always)]
unsafe fn bias_terms(
    float: DType,
    src: [*const u8; ROWS],
    sums: *const f32,
    k: usize,
    mut acc: __m256,
) -> __m256 {
    let whole = k / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: each src holds k ≥ i + 8 elements, sums k floats.
        unsafe {
            let u = transpose8(float, src, i);
            let s = _mm256_loadu_ps(sums.add(i));
            for (j, u) in u.into_iter().enumerate() {
                let j = j as i32;
                let pick = _mm256_setr_epi32(j, j, j, j, j + 4, j + 4, j + 4, j + 4);
                acc = _mm256_fmadd_ps(u, _mm256_permutevar8x32_ps(s, pick), acc);
            }
        }
    }
    let mut tail = [0.0f32; 8];
    for j in whole..k {
        for (i, &b) in src.iter().enumerate() {
            // SAFETY: j < k elements at b and at sums.
            tail[i] = unsafe { scale_at(float, b, j).mul_add(*sums.add(j), tail[i]) };
        }
    }
    // SAFETY: 8 floats; AVX2 is present where this inlines (the row loops).
    unsafe { _mm256_add_ps(acc, _mm256_loadu_ps(tail.as_ptr())) }
}
