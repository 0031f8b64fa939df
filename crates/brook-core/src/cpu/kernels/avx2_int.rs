//! AVX2 integer kernels of 4-bit matrices in rows ([`Order::Rows`]): the one-token product at
//! Split24 (exact, the default), with `vpmaddubsw` + `vpmaddwd`, or `vpdpbusd` on 256-bit
//! registers where AVX-VNNI exists; the activation digits it and Fast's kernel (int8,
//! `avx2_int8.rs`) read; and the dispatch between the two.
//!
//! Owns the row loop of y = W x: a row's 32-byte piece holds 64 elements (MLX packs element 2k
//! in the low nibble of byte k and 2k + 1 in its high one), so the low nibbles masked apart are
//! the piece's even elements and the high ones its odd, each 128-bit half one 32-element
//! block's. x comes as digits in that order ([`prepare`]), so every lane's integer sum (8
//! products) stays in its lane until it is scaled by its block's digit factor and its group's
//! scale; the one horizontal sum runs at the row's end. Two rows at a time share the digit
//! loads. Split24's digits are those of `avx512_digits.rs` (the same integers), int8's those of
//! llama.cpp's Q8 activations. No allocation, no shape checks beyond asserts (callers checked).
//!
//! [`Order::Rows`]: crate::linear::Order::Rows

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{dot_w, hsum, load8};
use super::qmatvec::{Affine, SCALE_PAD, SEG_GROUPS, widen};
use crate::dtype::DType;

/// Elements per chunk: one 32-byte piece of a 4-bit row.
pub(super) const CHUNK: usize = 64;

/// The digits of x (n a multiple of 32) for these kernels: `nd` = 3 (Split24: rows d₂, d₁, d₀
/// of X = round(x·2^(22−e)), 2^e > the block's max |x|) or 1 (int8: X = round(x/d), d = max|x|
/// / 127), into `digits` [n/64 rounded up, nd, 2, 32] (per chunk and digit row: the even
/// elements' bytes, then the odd ones', each half one block's; a missing last block is zero),
/// the factor of each digit row's sums into `coef` [chunks, nd, 8] (a block's factor in the
/// four lanes of its half), and Σx per 32 elements into `s32`. A block holding a NaN or an
/// infinity gets a NaN factor, so its rows turn NaN as the f32 kernels' would.
///
/// # Safety
/// AVX2 must be present.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn prepare(
    nd: usize,
    x: &[f32],
    digits: &mut Vec<i8>,
    coef: &mut Vec<f32>,
    s32: &mut Vec<f32>,
) {
    assert!(x.len().is_multiple_of(32) && matches!(nd, 1 | 3));
    let nc = x.len().div_ceil(CHUNK);
    digits.clear();
    digits.resize(nc * nd * CHUNK, 0);
    coef.clear();
    coef.resize(nc * nd * 8, 0.0);
    s32.clear();
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let (c, h) = (b / 2, b % 2);
        let rows = &mut digits[c * nd * CHUNK..(c + 1) * nd * CHUNK];
        // SAFETY: xb holds 32 floats; rows nd·64 bytes.
        let (cf, sum) = unsafe { block(nd, xb.as_ptr(), rows.as_mut_ptr(), h) };
        s32.push(sum);
        for (k, &f) in cf[..nd].iter().enumerate() {
            coef[(c * nd + k) * 8 + h * 4..][..4].fill(f);
        }
    }
}

/// The scaling of one 32-element block `a` (elements 8i..8i+8 in a[i]): (the multiplier that
/// takes x to its integers, each digit row's factor, Σx), or `None` (with Σx) when the block
/// holds a NaN or an infinity.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_scale(nd: usize, a: &[__m256; 4]) -> (Option<(f32, [f32; 3])>, f32) {
    // SAFETY: AVX2 is present (this function's features).
    let sum = unsafe {
        hsum(_mm256_add_ps(
            _mm256_add_ps(a[0], a[1]),
            _mm256_add_ps(a[2], a[3]),
        ))
    };
    let abs = a.map(|v| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v));
    let inf = _mm256_set1_ps(f32::INFINITY);
    // Not below infinity, or unordered (NaN).
    let bad = abs.iter().fold(0, |m, &v| {
        m | _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(v, inf))
    });
    if bad != 0 {
        return (None, sum);
    }
    let m4 = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
    let m2 = _mm_max_ps(_mm256_castps256_ps128(m4), _mm256_extractf128_ps::<1>(m4));
    let m1 = _mm_max_ps(m2, _mm_movehl_ps(m2, m2));
    let max = _mm_cvtss_f32(_mm_max_ss(m1, _mm_movehdup_ps(m1)));
    let scale = if nd == 3 {
        // As `avx512_digits::split_scale`: 2^e > max, e clamped to [−100, 127].
        let e = ((max.to_bits() >> 23) as i32 - 126).clamp(-100, 127);
        let inv = f32::from_bits(((e - 22 + 127) as u32) << 23);
        let m = f32::from_bits(((22 - e + 127) as u32) << 23);
        (m, [inv * 65536.0, inv * 256.0, inv])
    } else if max > 0.0 {
        (127.0 / max, [max / 127.0, 0.0, 0.0])
    } else {
        (0.0, [0.0; 3])
    };
    (Some(scale), sum)
}

/// One 32-element block of [`prepare`]: its digits into half `h` of the chunk's digit rows at
/// `rows`; returns (each digit row's factor, Σx).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block(nd: usize, x: *const f32, rows: *mut i8, h: usize) -> ([f32; 3], f32) {
    // SAFETY: x holds 32 floats, rows nd·64 bytes (caller).
    unsafe {
        let a = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(x.add(i)));
        let (scale, sum) = block_scale(nd, &a);
        let Some((mul, cf)) = scale else {
            return ([f32::NAN; 3], sum);
        };
        // Even and odd elements apart: shuffles give 0 2 8 10 | 4 6 12 14, the permute
        // orders them.
        let order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        let pick = |p: __m256, q: __m256, odd: bool| {
            let t = if odd {
                _mm256_shuffle_ps::<0xDD>(p, q)
            } else {
                _mm256_shuffle_ps::<0x88>(p, q)
            };
            let t = _mm256_permutevar8x32_ps(t, order);
            _mm256_cvtps_epi32(_mm256_mul_ps(t, _mm256_set1_ps(mul)))
        };
        for (half, odd) in [(0, false), (32, true)] {
            let (v0, v1) = (pick(a[0], a[1], odd), pick(a[2], a[3], odd));
            let at = |k: usize| rows.add(k * CHUNK + half + h * 16) as *mut __m128i;
            write_digits(nd, v0, v1, at);
        }
        (cf, sum)
    }
}

/// The digits of one 32-element block in element order into `out` (digit row k at
/// 32k..32k+32), as [`prepare`] computes them: (each digit row's factor, Σx). For the
/// prefill's token layout (`avx2_int_mm.rs`).
///
/// # Safety
/// AVX2 must be present; x holds 32 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn natural_block(
    nd: usize,
    x: *const f32,
    out: &mut [i8; 96],
) -> ([f32; 3], f32) {
    // SAFETY: x holds 32 floats (caller), out 96 bytes.
    unsafe {
        let a = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(x.add(i)));
        let (scale, sum) = block_scale(nd, &a);
        let Some((mul, cf)) = scale else {
            out.fill(0);
            return ([f32::NAN; 3], sum);
        };
        let v = a.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, _mm256_set1_ps(mul))));
        let o = out.as_mut_ptr();
        for half in 0..2 {
            let at = |k: usize| o.add(k * 32 + half * 16) as *mut __m128i;
            write_digits(nd, v[2 * half], v[2 * half + 1], at);
        }
        (cf, sum)
    }
}

/// The digit bytes of 16 integers (8 in each of `v0`, `v1`, in order) to `at(k)` for digit
/// row k: the integers themselves at int8, Split24's three rows otherwise.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn write_digits(nd: usize, v0: __m256i, v1: __m256i, at: impl Fn(usize) -> *mut __m128i) {
    // SAFETY: at(k) points at 16 writable bytes for k < nd (callers).
    unsafe {
        if nd == 1 {
            _mm_storeu_si128(at(0), bytes16(v0, v1));
        } else {
            let (s0, s1) = (split8(v0), split8(v1));
            for k in 0..3 {
                _mm_storeu_si128(at(k), bytes16(s0[k], s1[k]));
            }
        }
    }
}

/// The balanced digits [d₂, d₁, d₀] of X = d₂·2^16 + d₁·2^8 + d₀ for 8 integers (|X| < 2^23),
/// as `avx512_digits::split16`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn split8(v: __m256i) -> [__m256i; 3] {
    let (c128, c255) = (_mm256_set1_epi32(128), _mm256_set1_epi32(255));
    let low =
        |v: __m256i| _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(v, c128), c255), c128);
    let d0 = low(v);
    let r = _mm256_srai_epi32::<8>(_mm256_sub_epi32(v, d0));
    let d1 = low(r);
    let d2 = _mm256_srai_epi32::<8>(_mm256_sub_epi32(r, d1));
    [d2, d1, d0]
}

/// 16 integers in [−128, 127] (8 in each of `a`, `b`, in order) as 16 bytes in order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes16(a: __m256i, b: __m256i) -> __m128i {
    // packs works per 128-bit lane: a0-3 b0-3 | a4-7 b4-7, reordered to a0-7 b0-7.
    let w = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(a, b));
    let q = _mm256_packs_epi16(w, w);
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0x08>(q))
}

/// Split24's digit rows.
const D: usize = 3;

/// The kernel of `R` rows over one segment of `nel` elements (a multiple of 32) at Split24,
/// with `$dot` giving a digit row's 8 lane sums from a piece's low and high nibbles and the
/// digit row's even and odd bytes, and `$dot256` the same times 256 (for the top digit row,
/// whose sums are shifted onto the next one's). Defined twice, with and without AVX-VNNI.
macro_rules! segment_kernel {
    ($name:ident, $features:literal, $dot:ident, $dot256:ident) => {
        /// Adds to `acc[i]` row i's Σ s_g·q·x over the segment, per lane.
        ///
        /// # Safety
        /// The features must be present; `p[i]` holds nel/2 bytes, `s[i]` the segment's
        /// scales widened to f32 (plus [`SCALE_PAD`]), `dig` and `coef` the segment's chunks;
        /// `ahead` is how far ahead of each row to prefetch (a hint: it may pass the matrix).
        #[allow(clippy::too_many_arguments)]
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize>(
            p: [*const u8; R],
            nel: usize,
            g: usize,
            s: [*const f32; R],
            dig: *const i8,
            coef: *const f32,
            ahead: usize,
            acc: &mut [__m256; R],
        ) {
            // SAFETY: the caller's contract (see above); a half chunk reads 16 bytes.
            unsafe {
                let pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
                let mut step = |c: usize, half: bool| {
                    let piece = p.map(|pi| nibbles(pi.add(c * 32), half));
                    let (lo, hi) = (piece.map(|v| v.0), piece.map(|v| v.1));
                    let mut sk = [[_mm256_setzero_si256(); R]; D];
                    for (k, sk) in sk.iter_mut().enumerate() {
                        let d = dig.add((c * D + k) * CHUNK);
                        let de = _mm256_loadu_si256(d as *const _);
                        let dd = _mm256_loadu_si256(d.add(32) as *const _);
                        for i in 0..R {
                            sk[i] = if k == 0 {
                                $dot256(lo[i], hi[i], de, dd)
                            } else {
                                $dot(lo[i], hi[i], de, dd)
                            };
                        }
                    }
                    let cf = |k: usize| _mm256_loadu_ps(coef.add((c * D + k) * 8));
                    for i in 0..R {
                        let sv = match g {
                            32 => _mm256_permutevar8x32_ps(
                                _mm256_castps128_ps256(_mm_loadu_ps(s[i].add(2 * c))),
                                pair,
                            ),
                            64 => _mm256_broadcast_ss(&*s[i].add(c)),
                            _ => _mm256_broadcast_ss(&*s[i].add(c / 2)),
                        };
                        // |S| ≤ 8·15·128 per lane and digit row, so S₂·2^8 + S₁ < 2^24: exact
                        // in f32 (sk[0] holds S₂·2^8 already).
                        let s21 = _mm256_add_epi32(sk[0][i], sk[1][i]);
                        let p = _mm256_mul_ps(_mm256_cvtepi32_ps(s21), cf(1));
                        let pv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sk[2][i]), cf(2), p);
                        acc[i] = _mm256_fmadd_ps(pv, sv, acc[i]);
                    }
                };
                walk_segment(p, nel, ahead, &mut step);
            }
        }
    };
}

/// A digit row's lane sums with `vpmaddubsw` and `vpmaddwd`: [`pair_products`] added in
/// pairs into i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_madd(lo: __m256i, hi: __m256i, de: __m256i, dd: __m256i) -> __m256i {
    // SAFETY: AVX2 is present (this function's features).
    unsafe { _mm256_madd_epi16(pair_products(lo, hi, de, dd), _mm256_set1_epi16(1)) }
}

/// [`dot_madd`] times 256, in the same `vpmaddwd` (its pairs times 256 instead of 1: the
/// same integers, one shift fewer). |sum| ≤ 2·7680·256 < 2^22.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_madd_256(lo: __m256i, hi: __m256i, de: __m256i, dd: __m256i) -> __m256i {
    // SAFETY: AVX2 is present (this function's features).
    unsafe { _mm256_madd_epi16(pair_products(lo, hi, de, dd), _mm256_set1_epi16(256)) }
}

/// [`dot_vnni`] times 256.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn dot_vnni_256(lo: __m256i, hi: __m256i, de: __m256i, dd: __m256i) -> __m256i {
    // SAFETY: AVX2 and AVX-VNNI are present (this function's features).
    unsafe { _mm256_slli_epi32::<8>(dot_vnni(lo, hi, de, dd)) }
}

/// A piece's products with a digit row's bytes, two to an i16 lane (each 128-bit half one
/// block's), with `vpmaddubsw`: u4 × i8 pairs, |·| ≤ 3840, so the even and odd halves add
/// without saturating.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pair_products(lo: __m256i, hi: __m256i, de: __m256i, dd: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_maddubs_epi16(lo, de), _mm256_maddubs_epi16(hi, dd))
}

/// A piece's products with a digit row's bytes, eight to an i32 lane, with AVX-VNNI's
/// `vpdpbusd`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn dot_vnni(lo: __m256i, hi: __m256i, de: __m256i, dd: __m256i) -> __m256i {
    let s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, de);
    _mm256_dpbusd_avx_epi32(s, hi, dd)
}

/// The piece of a row at `at` (32 bytes, or 16 for a `half` chunk: the rest zero) as its low
/// nibbles (the even elements) and its high ones (the odd), one per byte.
///
/// # Safety
/// AVX2 must be present and `at` hold the bytes read.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles(at: *const u8, half: bool) -> (__m256i, __m256i) {
    let nib = _mm256_set1_epi8(0x0F);
    // SAFETY: the caller's contract.
    let v = unsafe {
        if half {
            _mm256_zextsi128_si256(_mm_loadu_si128(at as *const _))
        } else {
            _mm256_loadu_si256(at as *const _)
        }
    };
    (
        _mm256_and_si256(v, nib),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib),
    )
}

/// `step(chunk, half)` over a segment of `nel` elements (a multiple of 32) of the rows at
/// `p`: whole 64-byte lines (two chunks) of every row, each row's line `ahead` bytes on
/// prefetched first (the next rows' same line: the hardware prefetchers lose rows read side
/// by side; a hint, it may pass the matrix), then the chunks left and a last half chunk.
/// The prefetch goes to L2 (`_MM_HINT_T1`): on a Zen 4 host at 31 GB/s, AVX2 `fast` decode
/// of the resident 35B went 9.1-9.6 → 13.6-14.0 tok/s against L1 (docs/bench/2026-12-08.md);
/// a Zen 3 sitting had measured L2 4-7 % slower (docs/bench/2026-12-07.md), to be measured
/// again there.
#[inline(always)]
pub(super) fn walk_segment<const R: usize>(
    p: [*const u8; R],
    nel: usize,
    ahead: usize,
    step: &mut impl FnMut(usize, bool),
) {
    let (full, lines) = (nel / CHUNK, nel / (2 * CHUNK));
    for l in 0..lines {
        for pi in p {
            // SAFETY: a prefetch has no memory effects, wherever it points.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(pi.wrapping_add(l * 64 + ahead) as *const i8) };
        }
        step(2 * l, false);
        step(2 * l + 1, false);
    }
    for c in 2 * lines..full {
        step(c, false);
    }
    if !nel.is_multiple_of(CHUNK) {
        step(full, true);
    }
}

segment_kernel!(seg_madd, "avx2,fma,f16c", dot_madd, dot_madd_256);
segment_kernel!(seg_vnni, "avx2,fma,f16c,avxvnni", dot_vnni, dot_vnni_256);

/// Rows `rows` of y = W x for a 4-bit `a` in rows (group 32, 64 or 128, n a multiple of 32),
/// with x as [`prepare`] wrote it at `nd` digits (`digits`, `coef`) and Σx per group (`sums`);
/// `vnni` takes AVX-VNNI's instruction.
///
/// # Safety
/// AVX2 (and with `vnni`, AVX-VNNI) must be present and `a` checked.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matvec_rows(
    a: &Affine<'_>,
    nd: usize,
    vnni: bool,
    digits: &[i8],
    coef: &[f32],
    sums: &[f32],
    y: &mut [f32],
    rows: Range<usize>,
) {
    let (n, g, ng) = (a.n, a.group, a.groups());
    let nc = n.div_ceil(CHUNK);
    assert!(a.bits == 4 && n.is_multiple_of(32) && matches!(g, 32 | 64 | 128));
    assert!(digits.len() >= nc * nd * CHUNK && coef.len() >= nc * nd * 8 && sums.len() >= ng);
    assert!(y.len() == rows.len() && matches!(nd, 1 | 3));
    let x = Digits { digits, coef, sums };
    // SAFETY: the caller's contract; shapes asserted above.
    unsafe {
        match (nd, vnni) {
            (3, false) => rows_madd(a, &x, y, rows),
            (3, true) => rows_vnni(a, &x, y, rows),
            _ => super::avx2_int8::rows(a, vnni, &x, y, rows),
        }
    }
}

/// x as the row loops read it (see [`matvec_rows`]).
pub(super) struct Digits<'a> {
    pub digits: &'a [i8],
    pub coef: &'a [f32],
    pub sums: &'a [f32],
}

/// The row loop of [`matvec_rows`] at Split24 over the segment kernel `$seg`, two rows at a
/// time; each row's scales are widened once per segment, and the scales and biases of the rows
/// four ahead are prefetched with their packed bytes (separate streams the hardware
/// prefetchers also lose). Defined twice, with and without AVX-VNNI, so the kernel inlines
/// into it.
macro_rules! row_loop {
    ($name:ident, $features:literal, $seg:ident) => {
        /// # Safety
        /// As [`matvec_rows`], shapes asserted there.
        #[target_feature(enable = $features)]
        unsafe fn $name(a: &Affine<'_>, x: &Digits<'_>, y: &mut [f32], rows: Range<usize>) {
            let (g, ng, fs) = (a.group, a.groups(), a.float.size());
            let (rb, sbytes) = (a.row_bytes(), ng * fs);
            let pf = 4 * rb;
            let mut sbuf = [[0.0f32; SEG_GROUPS + SCALE_PAD]; 2];
            let mut r = rows.start;
            while r < rows.end {
                let nr = if r + 1 < rows.end { 2 } else { 1 };
                let row = |i: usize| a.row(r + i);
                for q in [a.scales, a.biases] {
                    let ahead = q.as_ptr().wrapping_add((r + 4) * sbytes);
                    for off in (0..nr * sbytes).step_by(64) {
                        // A hint only (it may pass the matrix).
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off) as *const i8);
                    }
                }
                let mut acc = [_mm256_setzero_ps(); 2];
                let mut bias = [0.0f32; 2];
                for (i, b) in bias.iter_mut().enumerate().take(nr) {
                    // SAFETY: the row holds ng biases; sums ng floats (asserted).
                    *b = unsafe { dot_w(a.float, row(i).2.as_ptr(), x.sums.as_ptr(), ng) };
                }
                for g0 in (0..ng).step_by(SEG_GROUPS) {
                    let k = SEG_GROUPS.min(ng - g0);
                    for (i, sb) in sbuf.iter_mut().enumerate().take(nr) {
                        // SAFETY: AVX2 is present; sb holds k + SCALE_PAD floats.
                        unsafe { widen_scales(a.float, &row(i).1[g0 * fs..(g0 + k) * fs], k, sb) };
                    }
                    let (e0, nel) = (g0 * g, k * g);
                    let (c0, s) = (e0 / CHUNK, [sbuf[0].as_ptr(), sbuf[1].as_ptr()]);
                    let d = x.digits[c0 * D * CHUNK..].as_ptr();
                    let cf = x.coef[c0 * D * 8..].as_ptr();
                    let p = [
                        row(0).0[e0 / 2..].as_ptr(),
                        row(nr - 1).0[e0 / 2..].as_ptr(),
                    ];
                    // SAFETY: segments start at a multiple of 512 groups, so of a chunk; the
                    // row holds nel/2 bytes from e0/2, the buffers were sized above.
                    unsafe {
                        if nr == 2 {
                            $seg::<2>(p, nel, g, s, d, cf, pf, &mut acc);
                        } else {
                            let mut one = [acc[0]];
                            $seg::<1>([p[0]], nel, g, [s[0]], d, cf, pf, &mut one);
                            acc[0] = one[0];
                        }
                    }
                }
                for (i, acc) in acc.iter().enumerate().take(nr) {
                    // SAFETY: AVX2 is present.
                    y[r - rows.start + i] = bias[i] + unsafe { hsum(*acc) };
                }
                r += nr;
            }
        }
    };
}

row_loop!(rows_madd, "avx2,fma,f16c", seg_madd);
row_loop!(rows_vnni, "avx2,fma,f16c,avxvnni", seg_vnni);

/// `k` scales of `float` from `src` widened to f32 into `out`, then [`SCALE_PAD`] zeros.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_scales(float: DType, src: &[u8], k: usize, out: &mut [f32]) {
    let whole = k / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: src holds k ≥ i + 8 elements, out k + SCALE_PAD floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), load8(float, src.as_ptr(), i)) };
    }
    let fs = float.size();
    widen(float, &src[whole * fs..k * fs], &mut out[whole..k]);
    out[k..k + SCALE_PAD].fill(0.0);
}
