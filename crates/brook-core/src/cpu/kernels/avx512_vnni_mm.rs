//! AVX-512 VNNI kernels of the prefill matmul at [`Precision::Split24`] and
//! [`Precision::Fast`]: 4-bit weights re-laid sixteen rows to a register, times each token's
//! activations as signed bytes, with `vpdpbusd`.
//!
//! Owns the re-layout of a block of 16 weight rows (register kq, lane r: row r's elements
//! 4kq..4kq+4 as four bytes) with the block's scales and biases as 16-lane vectors, the
//! register tile that multiplies one such block with D digit rows of up to eight tokens, and
//! the loop over a thread's rows. One `vpdpbusd` broadcasts four of a token's activation bytes
//! against 16 rows × 4 weights, so a tile needs no horizontal sums: each token's 16 results
//! come out as one vector. Digit sums are scaled once per 32 elements and the weight scale and
//! MLX bias once per group. No shape checks (`qmatmul.rs` checked them); buffers are per
//! thread and only grow. Mirrors the f32 tile in `avx512_mm.rs`, which computes the same sums
//! in f32. `avx512_tiles.rs` computes one token's products in the same order (to the bit).
//!
//! [`Precision::Split24`]: super::Precision::Split24
//! [`Precision::Fast`]: super::Precision::Fast

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::avx512::scale_at;
use super::pool::SharedMut;
use super::qmatvec::Affine;
use crate::linear::Order;

/// Activation bytes of a chunk of tokens for [`matmul_rows`]: per token, per 32-element
/// block, `nd` rows of 32 signed bytes in element order, and per (token, block, digit) the
/// factor that digit's integer sums are scaled by.
#[derive(Debug, Clone, Copy)]
pub(super) struct Digits<'a> {
    pub nd: usize,
    pub bytes: &'a [i8], // [t][n/32][nd][32]
    pub coef: &'a [f32], // [t][n/32][nd]
    pub sums: &'a [f32], // [t][n/g]: Σx per weight group (exact f32)
}

/// One row's packed bytes, scales and biases.
type RowBytes<'a> = (&'a [u8], &'a [u8], &'a [u8]);

thread_local! {
    /// Each thread's re-laid row block: 16·n weight bytes, then 2·16·(n/g) f32 scales/biases.
    static BLOCK: RefCell<(Vec<u8>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Writes columns `rows` of Y [t, out] = X Wᵀ for a 4-bit `a` (n a multiple of 32, group 32,
/// 64 or 128) from the tokens' digits.
///
/// # Safety
/// AVX-512 VNNI must be present; `a` must have passed `check`, `x` be sized for t tokens of
/// a.n at a.group, `y` hold t·out elements, and no other thread touch Y's columns `rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn matmul_rows(
    a: &Affine<'_>,
    x: Digits<'_>,
    t: usize,
    out: usize,
    y: SharedMut<'_, f32>,
    rows: Range<usize>,
) {
    let (n, ng) = (a.n, a.groups());
    assert!(a.bits == 4 && n % 32 == 0 && matches!(a.group, 32 | 64 | 128));
    assert!(x.bytes.len() >= t * n * x.nd && x.sums.len() >= t * ng && y.len() >= t * out);
    BLOCK.with_borrow_mut(|(wt, sc)| {
        if wt.len() < n.div_ceil(64) * 16 * 64 {
            wt.resize(n.div_ceil(64) * 16 * 64, 0);
        }
        if sc.len() < 2 * 16 * ng {
            sc.resize(2 * 16 * ng, 0.0);
        }
        let (sw, bw) = sc.split_at_mut(16 * ng);
        let mut r0 = rows.start;
        while r0 < rows.end {
            let nr = 16.min(rows.end - r0);
            // SAFETY: rows r0..r0+nr exist (`check`, rows ⊆ out); the buffers were sized above.
            unsafe {
                if a.order == Order::Tiles {
                    tiled16(a, r0, nr, wt, sw, bw)
                } else {
                    relayout16(a, r0, nr, wt, sw, bw)
                }
            };
            // The next block's bytes into L2 while this one computes: an expert's rows come
            // from DRAM once per chunk, as sixteen row streams (a tiled block is one run).
            if a.order == Order::Tiles {
                let next = (r0 + nr).div_ceil(16) * 16;
                if next < rows.end {
                    let p = &a.packed[next * n / 2..(next + 16) * n / 2];
                    for off in (0..p.len()).step_by(64) {
                        // SAFETY: a prefetch of an address inside the next block's bytes.
                        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.as_ptr().add(off) as *const i8) };
                    }
                }
            }
            for r in (r0 + nr..(r0 + nr + 16).min(rows.end)).filter(|_| a.order == Order::Rows) {
                let p = a.row(r).0;
                for off in (0..p.len()).step_by(64) {
                    // SAFETY: a prefetch of an address inside row r's bytes.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.as_ptr().add(off) as *const i8) };
                }
            }
            let mut t0 = 0;
            while t0 < t {
                let left = t - t0;
                // SAFETY: tokens t0..t0+tt and rows r0..r0+nr are inside X and Y (asserted),
                // and those columns of Y are ours (caller).
                let tt = unsafe {
                    match (x.nd, left) {
                        (1, 8..) => tile::<1, 8>(wt, sw, bw, x, a, t0, out, y, r0, nr),
                        (1, 4..) => tile::<1, 4>(wt, sw, bw, x, a, t0, out, y, r0, nr),
                        (1, 2..) => tile::<1, 2>(wt, sw, bw, x, a, t0, out, y, r0, nr),
                        (1, _) => tile::<1, 1>(wt, sw, bw, x, a, t0, out, y, r0, nr),
                        (_, 4..) => tile::<3, 4>(wt, sw, bw, x, a, t0, out, y, r0, nr),
                        (_, 2..) => tile::<3, 2>(wt, sw, bw, x, a, t0, out, y, r0, nr),
                        (_, _) => tile::<3, 1>(wt, sw, bw, x, a, t0, out, y, r0, nr),
                    }
                };
                t0 += tt;
            }
            r0 += nr;
        }
    });
}

/// The scales and biases of rows r0..r0+nr (nr ≤ 16) of a row-order `a` as f32, group
/// after group, 16 rows each (missing rows zero), into `sw` and `bw` (16·groups each).
fn scales16(a: &Affine<'_>, r0: usize, nr: usize, sw: &mut [f32], bw: &mut [f32]) {
    let ng = a.groups();
    for r in 0..16 {
        let row = (r < nr).then(|| a.row(r0 + r));
        for gi in 0..ng {
            let (s, b) = match row {
                // SAFETY: group gi's scale and bias are inside the row (`check`).
                Some((_, s, b)) => unsafe {
                    (
                        scale_at(a.float, s.as_ptr(), gi),
                        scale_at(a.float, b.as_ptr(), gi),
                    )
                },
                None => (0.0, 0.0),
            };
            sw[gi * 16 + r] = s;
            bw[gi * 16 + r] = b;
        }
    }
}

/// [`relayout16`] for a tiled `a`: a whole aligned block spreads its nibbles in place
/// (`avx512_tiles::spread16`); a block a range cuts (no caller does) goes element by element.
///
/// # Safety
/// As [`relayout16`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn tiled16(
    a: &Affine<'_>,
    r0: usize,
    nr: usize,
    wt: &mut [u8],
    sw: &mut [f32],
    bw: &mut [f32],
) {
    if r0.is_multiple_of(16) && nr == 16 {
        // SAFETY: forwarded; `matmul_rows` sized the buffers for n and its groups.
        return unsafe { super::avx512_tiles::spread16(a, r0, wt, sw, bw) };
    }
    let (n, ng) = (a.n, a.groups());
    for r in 0..16 {
        for i in 0..n {
            let q = if r < nr {
                let (byte, shift) = crate::linear::tiled_nibble(n, r0 + r, i);
                (a.packed[byte] >> shift) & 15
            } else {
                0
            };
            wt[(i / 4) * 64 + r * 4 + i % 4] = q;
        }
        for g in 0..ng {
            let (s, b) = if r < nr {
                let at = crate::linear::tiled_group(ng, r0 + r, g) * a.float.size();
                (
                    crate::linear::float_at(a.float, &a.scales[at..], 0),
                    crate::linear::float_at(a.float, &a.biases[at..], 0),
                )
            } else {
                (0.0, 0.0)
            };
            sw[g * 16 + r] = s;
            bw[g * 16 + r] = b;
        }
    }
}

/// Rows r0..r0+nr (nr ≤ 16) of `a` re-laid: `wt` register kq (64 bytes) holds in lane r the
/// four nibbles of row r0+r's elements 4kq..4kq+4 as bytes (missing rows zero); `sw`/`bw`
/// hold each group's 16 scales/biases as f32.
///
/// Per 64 elements: sixteen 32-byte row pieces are transposed into eight registers of one
/// packed word per row (unpacks of dwords and qwords, then one two-source qword permute),
/// and each word's eight nibbles are spread to two registers of bytes with `vpmultishiftqb`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn relayout16(
    a: &Affine<'_>,
    r0: usize,
    nr: usize,
    wt: &mut [u8],
    sw: &mut [f32],
    bw: &mut [f32],
) {
    let n = a.n;
    let rows: [Option<RowBytes<'_>>; 16] = std::array::from_fn(|r| (r < nr).then(|| a.row(r0 + r)));
    scales16(a, r0, nr, sw, bw);
    let nkq = n / 4;
    let (ctl_lo, ctl_hi) = (nibble_ctl(0), nibble_ctl(16));
    let nib = _mm512_set1_epi8(0x0F);
    // SAFETY: each load reads at most the row's n/2 bytes (masked at the end); stores stay
    // below n/4 registers of 64 bytes, which `wt` holds.
    unsafe {
        for c in 0..n.div_ceil(64) {
            let bytes = (n / 2 - c * 32).min(32);
            let m: __mmask32 = if bytes == 32 {
                u32::MAX
            } else {
                (1u32 << bytes) - 1
            };
            let ld = |r: usize| match rows[r] {
                Some((p, _, _)) => _mm256_maskz_loadu_epi8(m, p.as_ptr().add(c * 32) as *const i8),
                None => _mm256_setzero_si256(),
            };
            let o = words16(ld);
            for (word, &o) in o.iter().enumerate() {
                let kq = c * 16 + 2 * word;
                if kq < nkq {
                    let lo = _mm512_and_si512(_mm512_multishift_epi64_epi8(ctl_lo, o), nib);
                    let hi = _mm512_and_si512(_mm512_multishift_epi64_epi8(ctl_hi, o), nib);
                    let d = wt.as_mut_ptr().add(kq * 64);
                    _mm512_storeu_si512(d as *mut _, lo);
                    _mm512_storeu_si512(d.add(64) as *mut _, hi);
                }
            }
        }
    }
}

/// Columns r0..r0+nr of Y for tokens t0..t0+TT (or fewer when fewer are left; returns how
/// many): per 32-element block, D digit sums per token in i32 (8 `vpdpbusd` each, lane r:
/// Σ q·X over the block, |Σ| ≤ 32·15·128 < 2^31), scaled in f32 by the block's digit factors,
/// then by each group's scales and plus its biases times Σx.
///
/// # Safety
/// As [`matmul_rows`], with `wt`/`sw`/`bw` from [`relayout16`] of the same rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const D: usize, const TT: usize>(
    wt: &[u8],
    sw: &[f32],
    bw: &[f32],
    x: Digits<'_>,
    a: &Affine<'_>,
    t0: usize,
    out: usize,
    y: SharedMut<'_, f32>,
    r0: usize,
    nr: usize,
) -> usize {
    let (n, ng) = (a.n, a.groups());
    let (nb, bpg) = (n / 32, a.group / 32);
    let (xs, cs) = (nb * D * 32, nb * D);
    // SAFETY: blocks < nb, tokens < t0 + TT ≤ t (the caller's match), groups < ng: all
    // inside the buffers asserted in `matmul_rows`.
    unsafe {
        let wp = wt.as_ptr();
        let xb = x.bytes.as_ptr().add(t0 * xs);
        let cf = x.coef.as_ptr().add(t0 * cs);
        let su = x.sums.as_ptr().add(t0 * ng);
        let mut acc = [_mm512_setzero_ps(); TT];
        for g in 0..ng {
            let mut p = [_mm512_setzero_ps(); TT];
            for blk in g * bpg..(g + 1) * bpg {
                let mut ai = [[_mm512_setzero_si512(); D]; TT];
                for kq in 0..8 {
                    let w = _mm512_loadu_si512(wp.add((blk * 8 + kq) * 64) as *const _);
                    for (t, at) in ai.iter_mut().enumerate() {
                        for (d, ad) in at.iter_mut().enumerate() {
                            let q = xb.add(t * xs + (blk * D + d) * 32 + kq * 4);
                            let xv = _mm512_set1_epi32(std::ptr::read_unaligned(q as *const i32));
                            *ad = _mm512_dpbusd_epi32(*ad, w, xv);
                        }
                    }
                }
                for (t, (pt, at)) in p.iter_mut().zip(&ai).enumerate() {
                    let c = |d: usize| _mm512_set1_ps(*cf.add(t * cs + blk * D + d));
                    if D == 3 {
                        // d₂'s and d₁'s sums joined in i32 (|S₂·2^8 + S₁| ≤ 61440·257 < 2^24,
                        // so also exact in f32), weighted by d₁'s factor: 15% faster than
                        // converting and scaling all three (kernels bench, T = 512).
                        let a21 = _mm512_add_epi32(_mm512_slli_epi32::<8>(at[0]), at[1]);
                        *pt = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a21), c(1), *pt);
                        *pt = _mm512_fmadd_ps(_mm512_cvtepi32_ps(at[2]), c(2), *pt);
                    } else {
                        for (d, ad) in at.iter().enumerate() {
                            *pt = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*ad), c(d), *pt);
                        }
                    }
                }
            }
            let (s, b) = (
                _mm512_loadu_ps(sw.as_ptr().add(g * 16)),
                _mm512_loadu_ps(bw.as_ptr().add(g * 16)),
            );
            for (t, (at, pt)) in acc.iter_mut().zip(&p).enumerate() {
                *at = _mm512_fmadd_ps(*pt, s, *at);
                *at = _mm512_fmadd_ps(b, _mm512_set1_ps(*su.add(t * ng + g)), *at);
            }
        }
        let m: __mmask16 = ((1u32 << nr) - 1) as u16;
        for (t, at) in acc.iter().enumerate() {
            let at_row = (t0 + t) * out + r0;
            let ys = y.slice(at_row..at_row + nr);
            _mm512_mask_storeu_ps(ys.as_mut_ptr(), m, *at);
        }
    }
    TT
}

/// Word w of each of 16 rows' 32-byte pieces (`ld(r)`: row r's piece) as register w, lane r:
/// a 16×8 transpose of dwords (unpacks of dwords and qwords, then one two-source qword
/// permute per register).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(super) unsafe fn words16(ld: impl Fn(usize) -> __m256i) -> [__m512i; 8] {
    let z: [__m512i; 8] =
        std::array::from_fn(|i| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld(i)), ld(i + 8)));
    let t: [__m512i; 8] = std::array::from_fn(|j| {
        if j % 2 == 0 {
            _mm512_unpacklo_epi32(z[j], z[j + 1])
        } else {
            _mm512_unpackhi_epi32(z[j - 1], z[j])
        }
    });
    // u[m] / v[m]: words m and m+4 of rows 0-3 and 8-11 / 4-7 and 12-15.
    let half = |t0: __m512i, t1: __m512i, t2: __m512i, t3: __m512i| {
        [
            _mm512_unpacklo_epi64(t0, t2),
            _mm512_unpackhi_epi64(t0, t2),
            _mm512_unpacklo_epi64(t1, t3),
            _mm512_unpackhi_epi64(t1, t3),
        ]
    };
    let u = half(t[0], t[1], t[2], t[3]);
    let v = half(t[4], t[5], t[6], t[7]);
    let idx_lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let idx_hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    std::array::from_fn(|w| {
        let (m4, idx) = if w < 4 { (w, idx_lo) } else { (w - 4, idx_hi) };
        _mm512_permutex2var_epi64(u[m4], idx, v[m4])
    })
}

/// The `vpmultishiftqb` control that gives byte k of each dword the 8 bits of that dword
/// starting at bit `off` + 4k: with `off` = 0 its nibbles 0-3 (elements 0-3) in the low
/// halves, with 16 nibbles 4-7, with 12 nibbles 4-7 in the high halves.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn nibble_ctl(off: u8) -> __m512i {
    let mut c = [0u8; 8];
    for k in 0..4 {
        c[k] = off + 4 * k as u8;
        c[4 + k] = 32 + off + 4 * k as u8;
    }
    _mm512_set1_epi64(i64::from_le_bytes(c))
}
