//! AVX-512 VNNI kernels of 4-bit matrices in 16-row tiles ([`Order::Tiles`]): the one-token
//! product at Split24 (exact, the default) and Fast, and the prefill tile's block of rows.
//!
//! Owns the 16-row block loop of y = W x: one 64-byte vector holds 8 elements of each of 16
//! rows, its low and high nibbles masked apart give two registers of four bytes per row, and
//! one `vpdpbusd` per register and digit row multiplies them with four of x's bytes
//! broadcast, so every row's sum stays in its own lane: no horizontal sums, no re-layout, and
//! the weights stream as one sequential run. Digit sums are scaled once per 32 elements (as
//! in `avx512_vnni_mm.rs`), weight scales and MLX biases once per group as 16-lane vectors.
//! No allocation, no shape checks (callers checked them). Mirrors `avx512_vnni_mm.rs`, whose
//! one-token tile computes the same sums, to the bit, from [`Order::Rows`].
//!
//! [`Order::Tiles`]: crate::linear::Order::Tiles
//! [`Order::Rows`]: crate::linear::Order::Rows

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx512::scale_at;
use super::avx512_vnni_mm::{nibble_ctl, words16};
use super::qmatvec::Affine;
use crate::dtype::DType;
use crate::linear::Order;

/// 16 scales (or biases) of `float` starting at element `i` of `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load16(float: DType, p: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees 16 elements of `float` at element i.
    unsafe {
        match float {
            DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.add(2 * i) as *const _),
            ))),
            DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * i) as *const _)),
            _ => _mm512_loadu_ps(p.add(4 * i) as *const f32),
        }
    }
}

/// y for the 16 rows of tile block `tb`: D = 3 digit rows (Split24) or 1 (int8).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn block<const D: usize>(
    a: &Affine<'_>,
    tb: usize,
    digits: *const i8,
    coef: *const f32,
    sums: *const f32,
) -> __m512 {
    let (n, ng) = (a.n, a.groups());
    let (nb, bpg) = (n / 32, a.group / 32);
    // SAFETY: block tb's n/32 · 256 bytes and its 16·ng scales and biases exist (`check`,
    // out a multiple of 16); digits hold D·32 bytes and coef D floats per 32-block, sums ng.
    unsafe {
        let wp = a.packed.as_ptr().add(tb * nb * 256);
        let nib = _mm512_set1_epi8(0x0F);
        let mut acc = _mm512_setzero_ps();
        for g in 0..ng {
            let mut p = _mm512_setzero_ps();
            for blk in g * bpg..(g + 1) * bpg {
                let w = wp.add(blk * 256);
                let s = dots::<D>(digits.add(blk * D * 32), |j| {
                    _mm_prefetch::<_MM_HINT_T0>(w.add(4096 + 64 * j) as *const i8);
                    let v = _mm512_loadu_si512(w.add(64 * j) as *const _);
                    (
                        _mm512_and_si512(v, nib),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib),
                    )
                });
                p = digit_sums::<D>(s, coef.add(blk * D), p);
            }
            // The float steps of `avx512_vnni_mm::tile` for one token, in its order, so a
            // matrix gives the same bits in tiles as in rows (experts are tiled only when
            // resident, and the cache must not change results).
            let gi = (tb * ng + g) * 16;
            acc = _mm512_fmadd_ps(p, load16(a.float, a.scales.as_ptr(), gi), acc);
            let b = load16(a.float, a.biases.as_ptr(), gi);
            acc = _mm512_fmadd_ps(b, _mm512_set1_ps(*sums.add(g)), acc);
        }
        acc
    }
}

/// [`block`] for 16 rows r0..r0+nr (nr ≤ 16, missing rows zero) of a 4-bit `a` in
/// [`Order::Rows`]: each 32-byte piece of the 16 rows is transposed in registers
/// (`avx512_vnni_mm::words16`) and its words' nibbles spread to bytes with `vpmultishiftqb`,
/// then multiplied exactly as [`block`] does, so the same matrix gives the same bits in
/// either order (an expert streamed into a slot stays in rows; resident ones go into tiles).
/// Each group's 16 scales and biases are gathered from the rows as the group ends ([`gather16`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_block<const D: usize>(
    a: &Affine<'_>,
    r0: usize,
    nr: usize,
    digits: *const i8,
    coef: *const f32,
    sums: *const f32,
) -> __m512 {
    let (n, bpg, rb) = (a.n, a.group / 32, a.row_bytes());
    // SAFETY: rows r0..r0+nr hold rb bytes each (`check`; loads masked to them); digits,
    // coef and sums are sized for n (caller); sw/bw hold 16 per group.
    unsafe {
        let (ctl_lo, ctl_hi, nib) = (nibble_ctl(0), nibble_ctl(16), _mm512_set1_epi8(0x0F));
        let base = a.packed.as_ptr().add(r0 * rb);
        // Row r0's scales and biases; the rows' lie `stride` bytes apart.
        let (groups, stride) = (a.groups(), a.groups() * a.float.size());
        let (s0, b0) = (
            a.scales.as_ptr().add(r0 * stride),
            a.biases.as_ptr().add(r0 * stride),
        );
        let mut acc = _mm512_setzero_ps();
        let mut p = _mm512_setzero_ps();
        for c in 0..n.div_ceil(64) {
            let m: __mmask32 = if n / 2 - c * 32 >= 32 {
                u32::MAX
            } else {
                0xFFFF
            };
            let ld = |r: usize| {
                if r < nr {
                    _mm256_maskz_loadu_epi8(m, base.add(r * rb + c * 32) as *const i8)
                } else {
                    _mm256_setzero_si256()
                }
            };
            if c % 2 == 0 {
                // The next 16 rows' line c/2, one per row: sixteen row streams 1 KiB apart
                // are more than the hardware prefetchers follow (the head ran at half speed).
                for r in 0..16 {
                    let p = base.wrapping_add((16 + r) * rb + c * 32);
                    _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
                }
            }
            let o = words16(ld);
            for h in 0..2 {
                let blk = 2 * c + h;
                if blk * 32 >= n {
                    break;
                }
                let s = dots::<D>(digits.add(blk * D * 32), |j| {
                    let ow = o[4 * h + j];
                    (
                        _mm512_and_si512(_mm512_multishift_epi64_epi8(ctl_lo, ow), nib),
                        _mm512_and_si512(_mm512_multishift_epi64_epi8(ctl_hi, ow), nib),
                    )
                });
                p = digit_sums::<D>(s, coef.add(blk * D), p);
                if (blk + 1) % bpg == 0 {
                    let g = blk / bpg;
                    let sg = gather16(a.float, s0, stride, g, groups, nr);
                    let b = gather16(a.float, b0, stride, g, groups, nr);
                    acc = _mm512_fmadd_ps(p, sg, acc);
                    acc = _mm512_fmadd_ps(b, _mm512_set1_ps(*sums.add(g)), acc);
                    p = _mm512_setzero_ps();
                }
            }
        }
        acc
    }
}

/// Group `g`'s scale (or bias) of rows r < `nr` whose group-0 elements lie `stride` bytes
/// apart from `p` on, widened to f32 (lanes from `nr` on are 0): one gather of 4-byte words
/// instead of 16 scalar loads. A 16-bit value is read with its neighbour inside the row (the
/// next group's, or for the last group the previous one's), so nothing past the row is read;
/// a row of one group takes the scalar loads. Exact widening, as [`scale_at`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn gather16(
    float: DType,
    p: *const u8,
    stride: usize,
    g: usize,
    groups: usize,
    nr: usize,
) -> __m512 {
    // SAFETY: rows r < nr hold `groups` elements of `float` at p + r·stride (caller); every
    // lane reads 4 bytes inside its row (see above); masked lanes read nothing.
    unsafe {
        let k: __mmask16 = if nr >= 16 { 0xFFFF } else { (1u16 << nr) - 1 };
        let rows = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(stride as i32),
        );
        let zero = _mm512_setzero_si512();
        if float.size() == 4 {
            let w = _mm512_mask_i32gather_epi32::<1>(zero, k, rows, p.add(4 * g) as *const _);
            return _mm512_castsi512_ps(w);
        }
        if groups < 2 {
            let mut v = [0.0f32; 16];
            for (r, x) in v.iter_mut().enumerate().take(nr) {
                *x = scale_at(float, p.add(r * stride), g);
            }
            return _mm512_loadu_ps(v.as_ptr());
        }
        // The value in the low half (with the next) or, for the last group, the high half.
        let last = g + 1 == groups;
        let at = if last { 2 * g - 2 } else { 2 * g };
        let w = _mm512_mask_i32gather_epi32::<1>(zero, k, rows, p.add(at) as *const _);
        let low = if last { _mm512_srli_epi32::<16>(w) } else { w };
        match float {
            DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(low)),
            _ => _mm512_cvtph_ps(_mm512_cvtepi32_epi16(low)),
        }
    }
}

/// One 32-element block's integer sums for 16 rows: `nibbles(j)` gives the rows' elements
/// 8j..8j+4 and 8j+4..8j+8 as bytes (lane r: row r), each multiplied with the matching four
/// bytes of every digit row of `d` (D rows of 32) broadcast; s[k] holds digit row k's sums
/// over the low and the high halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn dots<const D: usize>(
    d: *const i8,
    mut nibbles: impl FnMut(usize) -> (__m512i, __m512i),
) -> [[__m512i; 2]; D] {
    // SAFETY: d holds D·32 bytes (caller).
    unsafe {
        let bc = |k: usize| _mm512_set1_epi32(std::ptr::read_unaligned(d.add(k) as *const i32));
        let mut s = [[_mm512_setzero_si512(); 2]; D];
        for j in 0..4 {
            let (lo, hi) = nibbles(j);
            for (k, sk) in s.iter_mut().enumerate() {
                sk[0] = _mm512_dpbusd_epi32(sk[0], lo, bc(32 * k + 8 * j));
                sk[1] = _mm512_dpbusd_epi32(sk[1], hi, bc(32 * k + 8 * j + 4));
            }
        }
        s
    }
}

/// p plus one 32-element block's digit sums (`s[k]`: digit row k's two halves) scaled by
/// their factors `coef[k]`, in the float steps of `avx512_vnni_mm::tile`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn digit_sums<const D: usize>(s: [[__m512i; 2]; D], coef: *const f32, p: __m512) -> __m512 {
    // SAFETY: coef holds D factors (caller).
    unsafe {
        let c = |k: usize| _mm512_set1_ps(*coef.add(k));
        if D == 3 {
            // |S| ≤ 32·15·128 per digit row, so S₂·2^8 + S₁ < 2^24: exact in f32.
            let s2 = _mm512_add_epi32(s[0][0], s[0][1]);
            let s1 = _mm512_add_epi32(s[1][0], s[1][1]);
            let s21 = _mm512_add_epi32(_mm512_slli_epi32::<8>(s2), s1);
            let p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s21), c(1), p);
            let s0 = _mm512_add_epi32(s[2][0], s[2][1]);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), c(2), p)
        } else {
            let s0 = _mm512_add_epi32(s[0][0], s[0][1]);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), c(0), p)
        }
    }
}

/// Rows `rows` of y = W x for a 4-bit `a` (group 32, 64 or 128, n a multiple of 32) in either
/// order, with x as `nd` digit rows per 32-element block (`digits` [n/32, nd, 32], `coef`
/// [n/32, nd]) and Σx per group (`sums`); y holds rows.len() elements. Tiles: a range that
/// cuts a 16-row block computes the whole block and keeps its part. Both orders give the
/// same bits.
///
/// # Safety
/// AVX-512 VNNI must be present and `a` checked; the digit buffers sized for a.n.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn matvec_rows(
    a: &Affine<'_>,
    nd: usize,
    digits: &[i8],
    coef: &[f32],
    sums: &[f32],
    y: &mut [f32],
    rows: Range<usize>,
) {
    let (nb, ng) = (a.n / 32, a.groups());
    assert!(digits.len() >= nb * nd * 32 && coef.len() >= nb * nd && sums.len() >= ng);
    assert!(y.len() == rows.len() && matches!(nd, 1 | 3));
    if a.order == Order::Rows {
        let mut r0 = rows.start;
        while r0 < rows.end {
            let nr = 16.min(rows.end - r0);
            let (d, c, su) = (digits.as_ptr(), coef.as_ptr(), sums.as_ptr());
            // SAFETY: asserted above; rows r0..r0+nr exist (rows.end ≤ out).
            unsafe {
                let v = if nd == 3 {
                    rows_block::<3>(a, r0, nr, d, c, su)
                } else {
                    rows_block::<1>(a, r0, nr, d, c, su)
                };
                let m = ((1u32 << nr) - 1) as u16;
                _mm512_mask_storeu_ps(y.as_mut_ptr().add(r0 - rows.start), m, v);
            }
            r0 += nr;
        }
        return;
    }
    let mut tb = rows.start / 16;
    // SAFETY: prefetches only; every address lies inside the matrix's bytes.
    unsafe { warm::<_MM_HINT_T0>(a, tb, rows.end.div_ceil(16)) };
    while tb * 16 < rows.end {
        // SAFETY: asserted above; block tb holds rows of the matrix (rows.end ≤ out, a
        // multiple of 16).
        let v = unsafe {
            if nd == 3 {
                block::<3>(a, tb, digits.as_ptr(), coef.as_ptr(), sums.as_ptr())
            } else {
                block::<1>(a, tb, digits.as_ptr(), coef.as_ptr(), sums.as_ptr())
            }
        };
        let (lo, hi) = ((tb * 16).max(rows.start), (tb * 16 + 16).min(rows.end));
        if lo == tb * 16 && hi == lo + 16 {
            // SAFETY: y[lo - rows.start..][..16] is inside y.
            unsafe { _mm512_storeu_ps(y.as_mut_ptr().add(lo - rows.start), v) };
        } else {
            let mut all = [0.0f32; 16];
            // SAFETY: a 16-float array.
            unsafe { _mm512_storeu_ps(all.as_mut_ptr(), v) };
            y[lo - rows.start..hi - rows.start].copy_from_slice(&all[lo - tb * 16..hi - tb * 16]);
        }
        tb += 1;
    }
}

/// [`block`] for `T` tokens at once: each 64-byte vector of weights is loaded and split into
/// nibbles once and multiplied with every token's digits, and each token's sums go through
/// exactly [`block`]'s steps in its order, so token t's result has the bits [`block`] gives
/// it alone. Several sequences' single tokens share one read of the weights this way.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn block_tokens<const D: usize, const T: usize>(
    a: &Affine<'_>,
    tb: usize,
    digits: [*const i8; T],
    coef: [*const f32; T],
    sums: [*const f32; T],
) -> [__m512; T] {
    let (n, ng) = (a.n, a.groups());
    let (nb, bpg) = (n / 32, a.group / 32);
    // SAFETY: as [`block`], for each token's digits, factors and sums.
    unsafe {
        let wp = a.packed.as_ptr().add(tb * nb * 256);
        let nib = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); T];
        for g in 0..ng {
            let mut p = [_mm512_setzero_ps(); T];
            for blk in g * bpg..(g + 1) * bpg {
                let w = wp.add(blk * 256);
                let mut s = [[[_mm512_setzero_si512(); 2]; D]; T];
                for j in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(w.add(4096 + 64 * j) as *const i8);
                    let v = _mm512_loadu_si512(w.add(64 * j) as *const _);
                    let lo = _mm512_and_si512(v, nib);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
                    for (t, st) in s.iter_mut().enumerate() {
                        let d = digits[t].add(blk * D * 32);
                        let bc = |k: usize| {
                            _mm512_set1_epi32(std::ptr::read_unaligned(d.add(k) as *const i32))
                        };
                        for (k, sk) in st.iter_mut().enumerate() {
                            sk[0] = _mm512_dpbusd_epi32(sk[0], lo, bc(32 * k + 8 * j));
                            sk[1] = _mm512_dpbusd_epi32(sk[1], hi, bc(32 * k + 8 * j + 4));
                        }
                    }
                }
                for t in 0..T {
                    p[t] = digit_sums::<D>(s[t], coef[t].add(blk * D), p[t]);
                }
            }
            let gi = (tb * ng + g) * 16;
            let sc = load16(a.float, a.scales.as_ptr(), gi);
            let b = load16(a.float, a.biases.as_ptr(), gi);
            for t in 0..T {
                acc[t] = _mm512_fmadd_ps(p[t], sc, acc[t]);
                acc[t] = _mm512_fmadd_ps(b, _mm512_set1_ps(*sums[t].add(g)), acc[t]);
            }
        }
        acc
    }
}

/// One token's prepared activations for [`matvec_rows_tokens`]: its digits, their factors
/// and its Σx per group, and where its rows of y go.
#[derive(Clone, Copy)]
pub(super) struct TokenRows {
    pub digits: *const i8,
    pub coef: *const f32,
    pub sums: *const f32,
    /// rows.len() floats.
    pub y: *mut f32,
}

/// [`matvec_rows`] of a tiled 4-bit `a` for several tokens, `T` at a time (the rest one by
/// one): each token's y gets the bits [`matvec_rows`] gives it alone.
///
/// # Safety
/// As [`matvec_rows`] for every token (digits of `nd` rows sized for a.n, y of rows.len()
/// floats no one else touches during the call); `a` in [`Order::Tiles`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn matvec_rows_tokens(
    a: &Affine<'_>,
    nd: usize,
    tokens: &[TokenRows],
    rows: Range<usize>,
) {
    assert!(a.order == Order::Tiles && matches!(nd, 1 | 3));
    // Four tokens a pass at either digit count: at Split24 (6 accumulators a token) four
    // decode each block once where two decoded it twice, and a step of four sequences on
    // the 35B went 107-114 → 103-106 ms (dev-2c, AVX-512, alternating; docs/BENCH.md).
    const PER: usize = 4;
    let mut tb = rows.start / 16;
    // SAFETY: prefetches only; every address lies inside the matrix's bytes.
    unsafe { warm::<_MM_HINT_T0>(a, tb, rows.end.div_ceil(16)) };
    while tb * 16 < rows.end {
        let (lo, hi) = ((tb * 16).max(rows.start), (tb * 16 + 16).min(rows.end));
        let store = |v: __m512, y: *mut f32| {
            let mut all = [0.0f32; 16];
            // SAFETY: a 16-float array; y holds rows.len() floats (caller), of which
            // lo-rows.start..hi-rows.start are this block's.
            unsafe {
                _mm512_storeu_ps(all.as_mut_ptr(), v);
                std::ptr::copy_nonoverlapping(
                    all.as_ptr().add(lo - tb * 16),
                    y.add(lo - rows.start),
                    hi - lo,
                );
            }
        };
        let mut t0 = 0;
        // SAFETY: as the caller promised for every token.
        unsafe {
            while t0 + PER <= tokens.len() {
                let tk: &[TokenRows; PER] = tokens[t0..t0 + PER].try_into().expect("PER tokens");
                let (digits, coef, sums) = (
                    tk.each_ref().map(|t| t.digits),
                    tk.each_ref().map(|t| t.coef),
                    tk.each_ref().map(|t| t.sums),
                );
                let v = if nd == 3 {
                    block_tokens::<3, PER>(a, tb, digits, coef, sums)
                } else {
                    block_tokens::<1, PER>(a, tb, digits, coef, sums)
                };
                for (v, t) in v.into_iter().zip(tk) {
                    store(v, t.y);
                }
                t0 += PER;
            }
            for t in &tokens[t0..] {
                let v = if nd == 3 {
                    block::<3>(a, tb, t.digits, t.coef, t.sums)
                } else {
                    block::<1>(a, tb, t.digits, t.coef, t.sums)
                };
                store(v, t.y);
            }
        }
        tb += 1;
    }
}

/// Asks for the first bytes of tile blocks `tb..end` (weights, and the first block's scales
/// and biases): [`block`] prefetches 4 KiB ahead of itself, so a range would otherwise start
/// on demand misses, and a decode step runs hundreds of short ranges (an expert's units).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn warm<const HINT: i32>(a: &Affine<'_>, tb: usize, end: usize) {
    let bb = a.n / 32 * 256;
    let w = &a.packed[(tb * bb).min(a.packed.len())..(end * bb).min(a.packed.len())];
    for off in (0..w.len().min(4096)).step_by(64) {
        // SAFETY: a hint; the address is inside `w`.
        unsafe { _mm_prefetch::<HINT>(w.as_ptr().add(off) as *const i8) };
    }
    let sb = 16 * a.groups() * a.float.size();
    for q in [a.scales, a.biases] {
        let q = &q[(tb * sb).min(q.len())..((tb + 1) * sb).min(q.len())];
        for off in (0..q.len().min(512)).step_by(64) {
            // SAFETY: as above.
            unsafe { _mm_prefetch::<HINT>(q.as_ptr().add(off) as *const i8) };
        }
    }
}

/// The prefill tile's block of rows r0..r0+16 (r0 a multiple of 16) from a tiled `a`, in the
/// layout of `avx512_vnni_mm::relayout16`: register kq of `wt` holds in lane r the four
/// elements 4kq..4kq+4 of row r0+r as bytes; `sw`/`bw` each group's 16 scales/biases.
///
/// # Safety
/// AVX-512 must be present, `a` tiled and checked; `wt` holds n/4 registers of 64 bytes and
/// `sw`, `bw` 16·groups floats each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn spread16(
    a: &Affine<'_>,
    r0: usize,
    wt: &mut [u8],
    sw: &mut [f32],
    bw: &mut [f32],
) {
    let (nb, ng, tb) = (a.n / 32, a.groups(), r0 / 16);
    assert!(r0.is_multiple_of(16) && wt.len() >= nb * 512 && sw.len() >= 16 * ng);
    assert!(bw.len() >= 16 * ng);
    // SAFETY: block tb's bytes exist (`check`); stores stay inside the sizes asserted above.
    unsafe {
        let nib = _mm512_set1_epi8(0x0F);
        let wp = a.packed.as_ptr().add(tb * nb * 256);
        for r in 0..nb * 4 {
            let v = _mm512_loadu_si512(wp.add(64 * r) as *const _);
            let d = wt.as_mut_ptr().add(128 * r);
            _mm512_storeu_si512(d as *mut _, _mm512_and_si512(v, nib));
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib);
            _mm512_storeu_si512(d.add(64) as *mut _, hi);
        }
        for g in 0..ng {
            let gi = (tb * ng + g) * 16;
            _mm512_storeu_ps(
                sw.as_mut_ptr().add(16 * g),
                load16(a.float, a.scales.as_ptr(), gi),
            );
            _mm512_storeu_ps(
                bw.as_mut_ptr().add(16 * g),
                load16(a.float, a.biases.as_ptr(), gi),
            );
        }
    }
}

/// The packed bytes of one 16-row block moved from [`Order::Rows`] (`src`: 16 rows of `rb`
/// bytes, rb a multiple of 16) to [`Order::Tiles`] (`dst`, as many bytes): per 32-byte piece
/// of the rows, a 16×8 transpose of words (`avx512_vnni_mm::words16`), then each word's
/// nibbles regrouped with two `vpmultishiftqb`: byte k takes element k low and k+4 high.
///
/// # Safety
/// AVX-512 (with VBMI) must be present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2")]
pub(crate) unsafe fn tile_block16(src: &[u8], rb: usize, dst: &mut [u8]) {
    assert!(rb.is_multiple_of(16) && src.len() >= 16 * rb && dst.len() >= 16 * rb);
    // Byte k of a word: bits 4k.. (element k, kept low) and 4k+12.. (element k+4, kept high).
    let (ctl_lo, ctl_hi, low) = (nibble_ctl(0), nibble_ctl(12), _mm512_set1_epi8(0x0F));
    let words = rb / 4;
    // SAFETY: loads stay inside each row's rb bytes (masked for a last 16-byte piece); stores
    // stay below words/4 · 256 = 16·rb bytes of dst.
    unsafe {
        for c in 0..rb.div_ceil(32) {
            let m: __mmask32 = if rb - c * 32 >= 32 { u32::MAX } else { 0xFFFF };
            let ld = |r: usize| {
                _mm256_maskz_loadu_epi8(m, src.as_ptr().add(r * rb + c * 32) as *const i8)
            };
            let o = words16(ld);
            for (w, &o) in o.iter().enumerate() {
                let w8 = c * 8 + w;
                if w8 < words {
                    let x = _mm512_multishift_epi64_epi8(ctl_lo, o);
                    let y = _mm512_multishift_epi64_epi8(ctl_hi, o);
                    let v = _mm512_or_si512(_mm512_and_si512(x, low), _mm512_andnot_si512(low, y));
                    let at = (w8 / 4) * 256 + (w8 % 4) * 64;
                    _mm512_storeu_si512(dst.as_mut_ptr().add(at) as *mut _, v);
                }
            }
        }
    }
}
