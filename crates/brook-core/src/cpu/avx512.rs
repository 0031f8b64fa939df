//! AVX-512 (F, BW, VL, VBMI) kernels behind [`super::qmatvec`] and [`super::qmatmul`].
//!
//! Owns the 512-bit inner loops only: 4-bit rows unpack 16 words at once and turn nibbles into
//! floats with one `vpermps` table lookup (x comes pre-permuted into that lane order, see
//! [`super::qmatvec::XPrep`]); 8-bit rows widen bytes; 2/3/5/6-bit rows gather each 8 values'
//! bytes into a qword with `vpermb` and cut them out with `vpmultishiftqb`. No allocation, no
//! shape checks (callers checked them). Mirrors the portable kernels in `qmatvec.rs`.

use std::arch::x86_64::*;
use std::ops::Range;

use super::qmatvec::{Affine, SCALE_PAD, SEG_GROUPS, XPrep};
use crate::dtype::DType;
use crate::linear::{LinearRef, MatRef};

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
unsafe fn dot_w_vec(dtype: DType, w: *const u8, x: *const f32, n: usize) -> __m512 {
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
unsafe fn widen(dtype: DType, src: *const u8, out: &mut [f32]) {
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

/// Asks for row `r + AHEAD` of `a` to be brought into cache while row r computes: streaming
/// rows from DRAM, the hardware prefetcher alone left a single thread at ~7 GB/s against an
/// 18 GB/s read baseline.
#[inline(always)]
fn prefetch_row(a: &Affine<'_>, r: usize, end: usize) {
    const AHEAD: usize = 8;
    if r + AHEAD >= end {
        return;
    }
    let (p, s, b) = a.row(r + AHEAD);
    for line in (0..p.len()).step_by(64) {
        // SAFETY: prefetching has no memory effects; the address is inside `p`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.as_ptr().add(line) as *const i8) };
    }
    for q in [s, b] {
        for line in (0..q.len()).step_by(64) {
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(q.as_ptr().add(line) as *const i8) };
        }
    }
}

/// Prefetches the first rows of a range, which `prefetch_row` would only reach after they
/// are needed (a decode step runs many short ranges: 32-row units of 512-row experts).
#[inline(always)]
fn warm_rows(a: &Affine<'_>, start: usize, end: usize) {
    for r in start..end.min(start + 4) {
        let (p, s, b) = a.row(r);
        for q in [p, s, b] {
            for line in (0..q.len()).step_by(64) {
                // SAFETY: prefetching has no memory effects; the address is inside `q`.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(q.as_ptr().add(line) as *const i8) };
            }
        }
    }
}

/// Scale `gi` of a row's scales of `dtype`, widened.
#[inline(always)]
unsafe fn scale_at(dtype: DType, p: *const u8, gi: usize) -> f32 {
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

/// Σ_i s_{g(i)} q_i x_i over n 4-bit elements, per lane. `s` holds the segment's scales as
/// f32 (plus [`SCALE_PAD`] readable floats), `xl` x in 16-lane nibble order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn q4_seg(
    p: *const u8,
    n: usize,
    s: *const f32,
    xl: *const f32,
    g: usize,
    idx: __m512i,
) -> __m512 {
    // SAFETY: p holds n/2 bytes, xl n rounded up to 128 floats, s n/g + 16 floats.
    unsafe {
        let lut = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
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
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(w), lut),
                _mm512_loadu_ps(xb.add(16)),
            );
            macro_rules! step {
                ($acc:ident, $k:literal) => {
                    $acc = _mm512_fmadd_ps(
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $k }>(w), lut),
                        _mm512_loadu_ps(xb.add(16 * $k)),
                        $acc,
                    );
                };
            }
            step!(a0, 2);
            step!(a1, 3);
            step!(a0, 4);
            step!(a1, 5);
            step!(a0, 6);
            step!(a1, 7);
            let sv = _mm512_permutexvar_ps(
                idx,
                _mm512_loadu_ps(s.add((blk * 128) >> g.trailing_zeros())),
            );
            tot = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sv, tot);
            blk += 1;
        }
        tot
    }
}

/// Like [`q4_seg`] with Split24 activations (see [`super::qmatvec::Precision::Split24`]):
/// per block, Σ q·X in i32 from three digit sums (6 `vpdpbusd`), then ·2^-k·s.
/// Bound: per lane and digit two dot products of 4 terms, |q·d| ≤ 15·128, so
/// |((S₂·2^8 + S₁)·2^8 + S₀)| ≤ 15360·65793 < 2^31.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_split_seg(
    p: *const u8,
    n: usize,
    s: *const f32,
    digits: *const i8,
    lane_inv: *const f32,
    g: usize,
    idx: __m512i,
) -> __m512 {
    // SAFETY: p holds n/2 bytes; digits 384 bytes and lane_inv 16 floats per 128-element block
    // (rounded up); s n/g + 16 floats.
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
            let sv = _mm512_permutexvar_ps(
                idx,
                _mm512_loadu_ps(s.add((blk * 128) >> g.trailing_zeros())),
            );
            tot = _mm512_fmadd_ps(f, sv, tot);
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
    let (g, fs) = (a.group, a.float.size());
    let sums = xp.sums(g);
    // SAFETY: the level's features are enabled in this function.
    let idx = unsafe { _mm512_div_lanes((g / 8) as i32) };
    let (start, end) = (rows.start, rows.end);
    warm_rows(a, start, end);
    let mut r = start;
    if a.groups() <= QUAD_GROUPS {
        let mut sb = [[0.0f32; QUAD_GROUPS + SCALE_PAD]; 4];
        while r + 4 <= end {
            for i in 0..4 {
                prefetch_row(a, r + i, end);
            }
            // SAFETY: `check` sized the rows' bytes; XPrep sized digits, lane_inv and sums.
            unsafe {
                let rows4: [(&[u8], &[u8], &[u8]); 4] = std::array::from_fn(|i| a.row(r + i));
                for (i, (_, sc, _)) in rows4.iter().enumerate() {
                    widen(a.float, sc.as_ptr(), &mut sb[i][..a.groups()]);
                }
                let p4 = std::array::from_fn(|i| rows4[i].0.as_ptr());
                let s4 = std::array::from_fn(|i| sb[i].as_ptr());
                let tot = q4_split_rows4(p4, a.n, s4, digits.as_ptr(), lane_inv.as_ptr(), g, idx);
                for i in 0..4 {
                    let bias = dot_w_vec(a.float, rows4[i].2.as_ptr(), sums.as_ptr(), a.groups());
                    y[r - start + i] = _mm512_reduce_add_ps(_mm512_add_ps(bias, tot[i]));
                }
            }
            r += 4;
        }
    }
    let mut sbuf = [0.0f32; SEG_GROUPS + SCALE_PAD];
    for (yr, r) in y[r - start..].iter_mut().zip(r..end) {
        prefetch_row(a, r, end);
        let (p, s, b) = a.row(r);
        // SAFETY: `check` sized the row's bytes; XPrep sized digits, lane_inv and sums for a.n.
        unsafe {
            let mut tot = dot_w_vec(a.float, b.as_ptr(), sums.as_ptr(), a.groups());
            for g0 in (0..a.groups()).step_by(SEG_GROUPS) {
                let ng = SEG_GROUPS.min(a.groups() - g0);
                let e0 = g0 * g;
                widen(a.float, s.as_ptr().add(g0 * fs), &mut sbuf[..ng]);
                sbuf[ng..ng + SCALE_PAD].fill(0.0);
                let part = q4_split_seg(
                    p.as_ptr().add(e0 / 2),
                    ng * g,
                    sbuf.as_ptr(),
                    digits.as_ptr().add(e0 / 128 * 384),
                    lane_inv.as_ptr().add(e0 / 8),
                    g,
                    idx,
                );
                tot = _mm512_add_ps(tot, part);
            }
            *yr = _mm512_reduce_add_ps(tot);
        }
    }
}

/// Groups per row up to which four rows are done at once (their scales widened side by side).
const QUAD_GROUPS: usize = 256;

/// Four rows of [`q4_split_seg`] sharing each block's activation digits: the digits are
/// loaded once for four rows, which took the kernel off the load ports (one row at a time it
/// issued nine 64-byte loads per 64 bytes of weights).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_split_rows4(
    p: [*const u8; 4],
    n: usize,
    s: [*const f32; 4],
    digits: *const i8,
    lane_inv: *const f32,
    g: usize,
    idx: __m512i,
) -> [__m512; 4] {
    // SAFETY: each p[i] holds n/2 bytes, each s[i] n/g + 16 floats; digits 384 bytes and
    // lane_inv 16 floats per 128-element block (rounded up).
    unsafe {
        let nib = _mm512_set1_epi8(0x0F);
        let z = _mm512_setzero_si512();
        let gs = g.trailing_zeros();
        let nw = n / 8;
        let mut tot = [_mm512_setzero_ps(); 4];
        let mut blk = 0;
        while blk * 16 < nw {
            let rem = nw - blk * 16;
            let m: __mmask16 = if rem >= 16 {
                u16::MAX
            } else {
                ((1u32 << rem) - 1) as u16
            };
            let dp = digits.add(blk * 384);
            let d: [__m512i; 6] =
                std::array::from_fn(|k| _mm512_loadu_si512(dp.add(64 * k) as *const _));
            let li = _mm512_loadu_ps(lane_inv.add(blk * 16));
            for i in 0..4 {
                let w = _mm512_maskz_loadu_epi32(m, p[i].add(blk * 64) as *const i32);
                let lo = _mm512_and_si512(w, nib);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nib);
                let a2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, d[0]), hi, d[1]);
                let a1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, d[2]), hi, d[3]);
                let a0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, d[4]), hi, d[5]);
                let acc = _mm512_add_epi32(
                    _mm512_add_epi32(_mm512_slli_epi32::<16>(a2), _mm512_slli_epi32::<8>(a1)),
                    a0,
                );
                let f = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), li);
                let sv = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(s[i].add((blk * 128) >> gs)));
                tot[i] = _mm512_fmadd_ps(f, sv, tot[i]);
            }
            blk += 1;
        }
        tot
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
        let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        let e = ((max.to_bits() >> 23) as i32 - 126).clamp(-100, 127);
        let m = _mm512_set1_ps(f32::from_bits(((22 - e + 127) as u32) << 23));
        let inv = f32::from_bits(((e - 22 + 127) as u32) << 23);
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        let (c128, c255) = (_mm512_set1_epi32(128), _mm512_set1_epi32(255));
        let low =
            |v: __m512i| _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);
        for (idx, off) in [(even, 0), (odd, 64)] {
            let v = _mm512_permutex2var_ps(a, idx, b);
            let big = _mm512_cvtps_epi32(_mm512_mul_ps(v, m));
            let d0 = low(big);
            let r = _mm512_srai_epi32::<8>(_mm512_sub_epi32(big, d0));
            let d1 = low(r);
            let d2 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(r, d1));
            let o = out.as_mut_ptr().add(off);
            _mm_storeu_si128(o as *mut __m128i, _mm512_cvtepi32_epi8(d2));
            _mm_storeu_si128(o.add(128) as *mut __m128i, _mm512_cvtepi32_epi8(d1));
            _mm_storeu_si128(o.add(256) as *mut __m128i, _mm512_cvtepi32_epi8(d0));
        }
        inv
    }
}

/// Lanes j / per, as 32-bit indices.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn _mm512_div_lanes(per: i32) -> __m512i {
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
    let mut sbuf = [0.0f32; SEG_GROUPS + SCALE_PAD];
    let (g, fs, bits) = (a.group, a.float.size(), a.bits as usize);
    let (x, lanes, sums) = (xp.x(), xp.lanes(), xp.sums(g));
    // Lane j holds word j, 8 elements; a group spans g/8 words. SAFETY: features enabled here.
    let idx = unsafe { _mm512_div_lanes((g / 8) as i32) };
    let end = rows.end;
    warm_rows(a, rows.start, end);
    for (yr, r) in y.iter_mut().zip(rows) {
        prefetch_row(a, r, end);
        let (p, s, b) = a.row(r);
        // SAFETY: `check` sized the row's bytes; XPrep sized x, lanes and sums for a.n.
        unsafe {
            let mut tot = dot_w_vec(a.float, b.as_ptr(), sums.as_ptr(), a.groups());
            for g0 in (0..a.groups()).step_by(SEG_GROUPS) {
                let ng = SEG_GROUPS.min(a.groups() - g0);
                let (e0, ne) = (g0 * g, ng * g);
                let pp = p.as_ptr().add(e0 * bits / 8);
                let sp = s.as_ptr().add(g0 * fs);
                let part = match bits {
                    4 => {
                        widen(a.float, sp, &mut sbuf[..ng]);
                        sbuf[ng..ng + SCALE_PAD].fill(0.0);
                        q4_seg(pp, ne, sbuf.as_ptr(), lanes.as_ptr().add(e0), g, idx)
                    }
                    8 => q8_seg(pp, ne, a.float, sp, x.as_ptr().add(e0), g),
                    _ => qgen_seg(pp, ne, bits, a.float, sp, x.as_ptr().add(e0), g),
                };
                tot = _mm512_add_ps(tot, part);
            }
            *yr = _mm512_reduce_add_ps(tot);
        }
    }
}

/// Row `r` of W as f32 into `dst`: natural order, or (`lanes`, 4-bit only) the 16-lane nibble
/// order of [`super::qmatvec::XPrep`], padded to whole 128-element blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn unpack_row(
    w: &LinearRef<'_>,
    r: usize,
    lanes: bool,
    dst: &mut [f32],
    sbuf: &mut [f32],
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
        MatRef::Affine {
            spec,
            float,
            packed,
            scales,
            biases,
        } => Affine {
            bits: spec.bits,
            group: spec.group_size,
            float,
            n,
            packed,
            scales,
            biases,
        },
    };
    let (p, s, b) = a.row(r);
    let (g, bits, ng) = (a.group, a.bits as usize, a.groups());
    if lanes {
        assert!(bits == 4 && ng <= UNPACK_GROUPS && dst.len() >= n.div_ceil(128) * 128);
        let (sb, bb) = sbuf.split_at_mut(UNPACK_GROUPS + SCALE_PAD);
        // SAFETY: sizes asserted above and by `check`.
        unsafe {
            widen(a.float, s.as_ptr(), &mut sb[..ng]);
            widen(a.float, b.as_ptr(), &mut bb[..ng]);
            q4_unpack_lanes(p.as_ptr(), n, sb, bb, g, dst.as_mut_ptr());
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

/// Groups of one row [`unpack_row`] widens at once in lane order.
pub(super) const UNPACK_GROUPS: usize = 1024;

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

/// Dequantizes one 4-bit row of n elements into `dst` in 16-lane nibble order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn q4_unpack_lanes(p: *const u8, n: usize, s: &[f32], b: &[f32], g: usize, dst: *mut f32) {
    // SAFETY: p holds n/2 bytes, s and b n/g + 16 floats, dst n rounded up to 128 floats.
    unsafe {
        let lut = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let idx = _mm512_div_lanes((g / 8) as i32);
        let nw = n / 8;
        let mut blk = 0;
        while blk * 16 < nw {
            let rem = nw - blk * 16;
            let w = if rem >= 16 {
                _mm512_loadu_si512(p.add(blk * 64) as *const _)
            } else {
                _mm512_maskz_loadu_epi32(((1u32 << rem) - 1) as u16, p.add(blk * 64) as *const i32)
            };
            let sv = _mm512_permutexvar_ps(
                idx,
                _mm512_loadu_ps(s.as_ptr().add((blk * 128) >> g.trailing_zeros())),
            );
            let bv = _mm512_permutexvar_ps(
                idx,
                _mm512_loadu_ps(b.as_ptr().add((blk * 128) >> g.trailing_zeros())),
            );
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
    for r in 0..R {
        for b in 0..T {
            out[r][b] = _mm512_reduce_add_ps(a[r][b]);
        }
    }
}
