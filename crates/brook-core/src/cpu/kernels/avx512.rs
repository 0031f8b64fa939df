//! AVX-512 (F, BW, VL, VBMI) matvec kernels behind [`super::qmatvec`], and the loads, widening
//! and prefetch helpers that `avx512_mm.rs` (the f32 prefill tile) shares. On AVX-512 VNNI the
//! 4-bit products go to `avx512_vnni_mm.rs` and `avx512_tiles.rs` instead.
//!
//! Owns the 512-bit inner loops only: 4-bit rows unpack 16 words at once and turn nibbles into
//! floats with one `vpermps` table lookup (x comes pre-permuted into that lane order, see
//! [`super::qmatvec::XPrep`]); 8-bit rows widen bytes; 2/3/5/6-bit rows gather each 8 values'
//! bytes into a qword with `vpermb` and cut them out with `vpmultishiftqb`. No allocation, no
//! shape checks (callers checked them). Mirrors the portable kernels in `qmatvec.rs`.

use std::arch::x86_64::*;
use std::ops::Range;

use super::qmatvec::{Affine, SEG_GROUPS, XPrep};
use crate::dtype::DType;

/// Loads 16 weights of `dtype` starting at element `i` of `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn load16(dtype: DType, p: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller guarantees 16 elements of `dtype` are readable at element i.
    unsafe {
        match dtype {
            DType::BF16 => {
                let h = _mm256_loadu_si256(p.add(2 * i) as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.add(2 * i) as *const __m256i)),
            _ => _mm512_loadu_ps(p.add(4 * i) as *const f32),
        }
    }
}

/// Like [`load16`] for the first `len` (< 16) elements; the other lanes are zero.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn load_tail(dtype: DType, p: *const u8, i: usize, len: usize) -> __m512 {
    let m: __mmask16 = ((1u32 << len) - 1) as u16;
    // SAFETY: masked loads touch only the first `len` elements, which the caller guarantees.
    unsafe {
        match dtype {
            DType::BF16 => {
                let h = _mm256_maskz_loadu_epi16(m, p.add(2 * i) as *const i16);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            DType::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.add(2 * i) as *const i16)),
            _ => _mm512_maskz_loadu_ps(m, p.add(4 * i) as *const f32),
        }
    }
}

/// Σ w_i x_i for n weights of `dtype` at `w` and n floats at `x`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn dot_w(dtype: DType, w: *const u8, x: *const f32, n: usize) -> f32 {
    // SAFETY: forwarded.
    unsafe { _mm512_reduce_add_ps(dot_w_vec(dtype, w, x, n)) }
}

/// [`dot_w`] left as 16 lane sums, so a caller can fold it into its own final reduction (a
/// row's bias term Σβ·Σx took 5% of a decode step as a separate reduction).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn dot_w_vec(dtype: DType, w: *const u8, x: *const f32, n: usize) -> __m512 {
    // SAFETY: the caller guarantees n elements at both pointers.
    unsafe {
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            a0 = _mm512_fmadd_ps(load16(dtype, w, i), _mm512_loadu_ps(x.add(i)), a0);
            a1 = _mm512_fmadd_ps(load16(dtype, w, i + 16), _mm512_loadu_ps(x.add(i + 16)), a1);
            i += 32;
        }
        while i < n {
            let len = (n - i).min(16);
            let m: __mmask16 = ((1u32 << len) - 1) as u16;
            let xv = _mm512_maskz_loadu_ps(m, x.add(i));
            let wv = if len == 16 {
                load16(dtype, w, i)
            } else {
                load_tail(dtype, w, i, len)
            };
            a0 = _mm512_fmadd_ps(wv, xv, a0);
            i += len;
        }
        _mm512_add_ps(a0, a1)
    }
}

/// Widens n floats of `dtype` at `src` into `out`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn widen(dtype: DType, src: *const u8, out: &mut [f32]) {
    let n = out.len();
    let mut i = 0;
    // SAFETY: the caller guarantees n elements at `src`; stores stay inside `out`.
    unsafe {
        while i + 16 <= n {
            _mm512_storeu_ps(out.as_mut_ptr().add(i), load16(dtype, src, i));
            i += 16;
        }
        if i < n {
            let m: __mmask16 = ((1u32 << (n - i)) - 1) as u16;
            let v = load_tail(dtype, src, i, n - i);
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, v);
        }
    }
}

/// Float weights: y[r] = row r · x for every row of `data` ([y.len(), x.len()] of `dtype`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn float_rows(dtype: DType, data: &[u8], x: &[f32], y: &mut [f32]) {
    let rb = x.len() * dtype.size();
    for (r, yr) in y.iter_mut().enumerate() {
        // SAFETY: `data` holds y.len() rows of rb bytes (checked by the caller).
        *yr = unsafe { dot_w(dtype, data.as_ptr().add(r * rb), x.as_ptr(), x.len()) };
    }
}

/// Weight bytes the prefetches run ahead of the kernel, into L1 (T0). In rows this was a
/// fixed 8: 8 KiB ahead for a 2048-wide 4-bit row but only 2 KiB for an expert's 512-wide
/// down projection, whose 64-row units then ran mostly on demand misses. Once rows came in
/// long runs (guided chunks), 4 KiB into L1 beat 8 KiB into L2 on the head matvec (2 threads,
/// f32: 20-21 against 17-18.5 GiB/s; 2, 3 and 6 KiB and NTA hints fell between).
const AHEAD_BYTES: usize = 4 << 10;

/// Rows of `a` that make up [`AHEAD_BYTES`].
#[inline(always)]
fn ahead(a: &Affine<'_>) -> usize {
    (AHEAD_BYTES / a.row_bytes().max(1)).clamp(1, 64)
}

/// Asks for the row [`AHEAD_BYTES`] past row r to be brought into cache while row r computes:
/// streaming rows from DRAM, the hardware prefetcher alone left a single thread at ~7 GB/s
/// against an 18 GB/s read baseline.
#[inline(always)]
pub(super) fn prefetch_row(a: &Affine<'_>, r: usize, end: usize) {
    let ah = ahead(a);
    if r + ah >= end {
        return;
    }
    let (p, s, b) = a.row(r + ah);
    for line in (0..p.len()).step_by(64) {
        // SAFETY: prefetching has no memory effects; the address is inside `p`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.as_ptr().add(line) as *const i8) };
    }
    for q in [s, b] {
        for line in (0..q.len()).step_by(64) {
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(q.as_ptr().add(line) as *const i8) };
        }
    }
}

/// Prefetches the first [`AHEAD_BYTES`] of a range, which `prefetch_row` would only reach
/// after they are needed (a decode step runs many short ranges: 32-row units of 512-row
/// experts).
#[inline(always)]
pub(super) fn warm_rows(a: &Affine<'_>, start: usize, end: usize) {
    for r in start..end.min(start + ahead(a)) {
        let (p, s, b) = a.row(r);
        for q in [p, s, b] {
            for line in (0..q.len()).step_by(64) {
                // SAFETY: prefetching has no memory effects; the address is inside `q`.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(q.as_ptr().add(line) as *const i8) };
            }
        }
    }
}

/// Scale `gi` of a row's scales of `dtype`, widened.
#[inline(always)]
pub(super) unsafe fn scale_at(dtype: DType, p: *const u8, gi: usize) -> f32 {
    // SAFETY: the caller guarantees element gi is inside the row's scales.
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

/// Groups of a row whose scales a 4-bit kernel holds in two registers ([`seg_scales`]); a
/// longer row is done in segments of this many groups.
pub(super) const REG_GROUPS: usize = 32;

/// The widened scales of `ng` (1..=[`REG_GROUPS`]) groups at `s` as two vectors (groups 0-15,
/// 16-31; those past `ng` are zero). The kernels pick each block's scales out of them with
/// [`BlockScales`]: widening them into a buffer and loading each block's 16 lanes back from
/// it at an 8-byte offset defeated store-to-load forwarding, a stall in every block, which
/// held the 4-bit kernels to about half the memory bandwidth.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn seg_scales(dtype: DType, s: *const u8, ng: usize) -> (__m512, __m512) {
    // SAFETY: the caller guarantees `ng` scales of `dtype` at `s`.
    unsafe {
        let lo = if ng >= 16 {
            load16(dtype, s, 0)
        } else {
            load_tail(dtype, s, 0, ng)
        };
        let hi = match ng {
            32.. => load16(dtype, s, 16),
            17..=31 => load_tail(dtype, s, 16, ng - 16),
            _ => _mm512_setzero_ps(),
        };
        (lo, hi)
    }
}

/// Each 128-element block's per-lane scales out of [`seg_scales`]' two registers: lane j of
/// block b holds word j (8 elements) of the block, whose group is b·128/g + j/(g/8).
#[derive(Clone, Copy)]
pub(super) struct BlockScales {
    lo: __m512,
    hi: __m512,
    idx: __m512i,
    step: __m512i,
}

impl BlockScales {
    /// For group size `g` (32, 64 or 128) and a segment's scales.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
    pub(super) unsafe fn new(g: usize, (lo, hi): (__m512, __m512)) -> Self {
        // SAFETY: features enabled here.
        unsafe {
            BlockScales {
                lo,
                hi,
                idx: _mm512_div_lanes((g / 8) as i32),
                step: _mm512_set1_epi32((128 / g) as i32),
            }
        }
    }

    /// The next block's scales.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
    pub(super) unsafe fn next(&mut self) -> __m512 {
        let v = _mm512_permutex2var_ps(self.lo, self.idx, self.hi);
        self.idx = _mm512_add_epi32(self.idx, self.step);
        v
    }
}

/// Σ_i s_{g(i)} q_i x_i over n 4-bit elements (at most [`REG_GROUPS`] groups), per lane; `xl`
/// is x in 16-lane nibble order, shifts 1-6 scaled by 16^-k ([`XPrep`]).
///
/// Nibbles 0 and 7 become floats by a `vpermps` table lookup (7 after a shift); nibbles 1-6
/// are masked in place, q·16^k, and converted as they stand, exactly (four significant
/// bits), which the pre-scaled x undoes exactly. Shifts and lookups share the shuffle pipes,
/// which with all eight nibbles looked up (seven shifts, eight lookups per 64 bytes) held
/// the kernel to about 60% of what its eight FMAs allow; this mix balances the pipes (25%
/// faster in L2).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn q4_seg(p: *const u8, n: usize, mut sc: BlockScales, xl: *const f32) -> __m512 {
    // SAFETY: p holds n/2 bytes, xl n rounded up to 128 floats.
    unsafe {
        let lut = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let mask: [__m512i; 7] = std::array::from_fn(|k| _mm512_set1_epi32(0xF << (4 * k)));
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
            let xb = xl.add(blk * 128);
            let mut a0 = _mm512_mul_ps(_mm512_permutexvar_ps(w, lut), _mm512_loadu_ps(xb));
            let mut a1 = _mm512_mul_ps(
                _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(w), lut),
                _mm512_loadu_ps(xb.add(112)),
            );
            macro_rules! step {
                ($acc:ident, $k:literal) => {
                    $acc = _mm512_fmadd_ps(
                        _mm512_cvtepu32_ps(_mm512_and_si512(w, mask[$k])),
                        _mm512_loadu_ps(xb.add(16 * $k)),
                        $acc,
                    );
                };
            }
            step!(a0, 1);
            step!(a1, 2);
            step!(a0, 3);
            step!(a1, 4);
            step!(a0, 5);
            step!(a1, 6);
            tot = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sc.next(), tot);
            blk += 1;
        }
        tot
    }
}

/// Lanes j / per, as 32-bit indices.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn _mm512_div_lanes(per: i32) -> __m512i {
    let mut v = [0i32; 16];
    let shift = per.trailing_zeros();
    for (j, e) in v.iter_mut().enumerate() {
        *e = (j as i32) >> shift;
    }
    // SAFETY: reads 16 i32 from a local array.
    unsafe { _mm512_loadu_si512(v.as_ptr() as *const _) }
}

/// Σ_g s_g Σ_{i∈g} q_i x_i over n 8-bit elements, per lane; x in natural order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn q8_seg(
    p: *const u8,
    n: usize,
    sd: DType,
    s: *const u8,
    x: *const f32,
    g: usize,
) -> __m512 {
    // SAFETY: p holds n bytes, x n floats, s n/g scales.
    unsafe {
        let (mut t0, mut t1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for gi in 0..n / g {
            let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut off = gi * g;
            while off < (gi + 1) * g {
                let q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(off) as *const __m128i));
                let q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(off + 16) as *const __m128i));
                a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), _mm512_loadu_ps(x.add(off)), a0);
                a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_loadu_ps(x.add(off + 16)), a1);
                off += 32;
            }
            let sv = _mm512_set1_ps(scale_at(sd, s, gi));
            if gi % 2 == 0 {
                t0 = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sv, t0);
            } else {
                t1 = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sv, t1);
            }
        }
        _mm512_add_ps(t0, t1)
    }
}

/// Like [`q8_seg`] for any width `bits` ≤ 8: each 32 values (4·bits bytes) are spread so
/// qword k holds values 8k..8k+7, then `vpmultishiftqb` cuts value m from bit m·bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn qgen_seg(
    p: *const u8,
    n: usize,
    bits: usize,
    sd: DType,
    s: *const u8,
    x: *const f32,
    g: usize,
) -> __m512 {
    let (mut pidx, mut ctrl) = ([0u8; 32], [0u8; 32]);
    for q in 0..4 {
        for m in 0..8 {
            pidx[q * 8 + m] = (q * bits + m) as u8;
            ctrl[q * 8 + m] = (m * bits) as u8;
        }
    }
    let chunk = 4 * bits; // bytes per 32 values
    let lmask: __mmask32 = if chunk >= 32 {
        u32::MAX
    } else {
        (1u32 << chunk) - 1
    };
    // SAFETY: p holds n·bits/8 bytes (masked loads read only `chunk` bytes per 32 values),
    // x n floats, s n/g scales; the index arrays are local.
    unsafe {
        let pidx = _mm256_loadu_si256(pidx.as_ptr() as *const __m256i);
        let ctrl = _mm256_loadu_si256(ctrl.as_ptr() as *const __m256i);
        let vmask = _mm256_set1_epi8(((1u32 << bits) - 1) as u8 as i8);
        let mut tot = _mm512_setzero_ps();
        for gi in 0..n / g {
            let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut off = gi * g;
            while off < (gi + 1) * g {
                let raw = _mm256_maskz_loadu_epi8(lmask, p.add(off * bits / 8) as *const i8);
                let spread = _mm256_permutexvar_epi8(pidx, raw);
                let q = _mm256_and_si256(_mm256_multishift_epi64_epi8(ctrl, spread), vmask);
                let lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
                let hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(q)));
                a0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x.add(off)), a0);
                a1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x.add(off + 16)), a1);
                off += 32;
            }
            let sv = _mm512_set1_ps(scale_at(sd, s, gi));
            tot = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sv, tot);
        }
        tot
    }
}

/// Affine rows `rows` of y = W x (see [`super::qmatvec::matvec_rows`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn affine_rows(a: &Affine<'_>, xp: &XPrep, y: &mut [f32], rows: Range<usize>) {
    let (g, fs, bits) = (a.group, a.float.size(), a.bits as usize);
    let (x, lanes) = (xp.x(), xp.lanes());
    // SAFETY: `check` sized the rows' bytes; XPrep sized x, lanes and sums for a.n.
    unsafe {
        row_loop(a, xp.sums(g), y, rows, |p, s| {
            if bits == 4 {
                return q4_segments(a, p, s, |pp, n, sc, e0| {
                    q4_seg(pp, n, sc, lanes.as_ptr().add(e0))
                });
            }
            let mut tot = _mm512_setzero_ps();
            for g0 in (0..a.groups()).step_by(SEG_GROUPS) {
                let ng = SEG_GROUPS.min(a.groups() - g0);
                let (e0, ne) = (g0 * g, ng * g);
                let pp = p.as_ptr().add(e0 * bits / 8);
                let sp = s.as_ptr().add(g0 * fs);
                let part = match bits {
                    8 => q8_seg(pp, ne, a.float, sp, x.as_ptr().add(e0), g),
                    _ => qgen_seg(pp, ne, bits, a.float, sp, x.as_ptr().add(e0), g),
                };
                tot = _mm512_add_ps(tot, part);
            }
            tot
        })
    }
}

/// The row loop every AVX-512 affine kernel shares: y[i] = row `rows.start + i`'s bias term
/// Σ_g β_g·Σx_g (from `sums`, x's per-group sums) plus `part(packed, scales)`, the row's
/// Σ s·q·x as 16 lane sums; rows are prefetched ahead (across the end of `rows`, up to the
/// matrix's last row).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn row_loop(
    a: &Affine<'_>,
    sums: &[f32],
    y: &mut [f32],
    rows: Range<usize>,
    part: impl Fn(&[u8], &[u8]) -> __m512,
) {
    warm_rows(a, rows.start, rows.end);
    let limit = a.rows();
    for (yr, r) in y.iter_mut().zip(rows) {
        prefetch_row(a, r, limit);
        let (p, s, b) = a.row(r);
        // SAFETY: the caller guarantees `sums` holds a row's groups.
        let bias = unsafe { dot_w_vec(a.float, b.as_ptr(), sums.as_ptr(), a.groups()) };
        *yr = _mm512_reduce_add_ps(_mm512_add_ps(bias, part(p, s)));
    }
}

/// A 4-bit row's Σ s·q·x as 16 lane sums, in segments of [`REG_GROUPS`] groups:
/// `seg(packed bytes from element e0, elements, the segment's scales, e0)` for each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn q4_segments(
    a: &Affine<'_>,
    p: &[u8],
    s: &[u8],
    seg: impl Fn(*const u8, usize, BlockScales, usize) -> __m512,
) -> __m512 {
    let (g, fs) = (a.group, a.float.size());
    let mut tot = _mm512_setzero_ps();
    for g0 in (0..a.groups()).step_by(REG_GROUPS) {
        let ng = REG_GROUPS.min(a.groups() - g0);
        let e0 = g0 * g;
        // SAFETY: `p` and `s` are a checked 4-bit row's packed bytes and scales.
        let sc = unsafe { BlockScales::new(g, seg_scales(a.float, s.as_ptr().add(g0 * fs), ng)) };
        // SAFETY: as above; e0 / 2 < p.len().
        tot = _mm512_add_ps(tot, seg(unsafe { p.as_ptr().add(e0 / 2) }, ng * g, sc, e0));
    }
    tot
}
