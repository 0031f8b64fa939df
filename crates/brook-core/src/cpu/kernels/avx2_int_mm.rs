//! AVX2 integer kernels of the prefill matmul at [`Precision::Split24`] and
//! [`Precision::Fast`] for 4-bit matrices in rows: eight tokens to a register, weights
//! broadcast, with `vpmaddubsw` + `vpmaddwd` or AVX-VNNI's `vpdpbusd`.
//!
//! Owns the tokens' digit layout ([`prepare`]: per group of eight tokens, 32-element block,
//! digit row and four elements, one 32-byte register whose lane l holds token l's four
//! activation bytes), the expansion of a few weight rows to one nibble per byte in element
//! order, and the register tile: four elements of a row broadcast to every lane multiply
//! eight tokens' bytes at once, so each (row, eight tokens) sum stays in one register with no
//! horizontal sums and no re-layout of the weights beyond the expansion. Integer sums are
//! scaled once per 32 elements by the tokens' digit factors; at int8 the scaled blocks of a
//! group add up before the row's group scale multiplies them once (Split24: per block), then
//! the MLX bias term (β·Σx per group) is added as each group ends. Without AVX-VNNI, `vpmaddubsw`
//! results of a 32-element block add in i16 (|·| ≤ 8·2·15·128 < 2^15) before one `vpmaddwd`.
//! No allocation beyond per-thread buffers that only grow; shapes are checked by
//! `qmatmul.rs`. Mirrors `avx512_vnni_mm.rs` (the same sums, in another order).
//!
//! [`Precision::Split24`]: super::Precision::Split24
//! [`Precision::Fast`]: super::Precision::Fast

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::pool::SharedMut;
use super::qmatvec::{Affine, widen};

/// Tokens per register.
const LANES: usize = 8;

/// A chunk of tokens' activations for [`matmul_rows`], as [`prepare`] wrote them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Digits<'a> {
    pub nd: usize,
    /// [t/8 rounded up][n/32][nd][8 quads][8 tokens][4] bytes.
    pub bytes: &'a [i8],
    /// [t/8][n/32][nd][8 tokens]: the factor of each digit row's sums.
    pub coef: &'a [f32],
    /// [t/8][n/g][8 tokens]: Σx per weight group (exact f32).
    pub sums: &'a [f32],
}

/// The digits of x [t, n] (n a multiple of 32) at `nd` = 3 (Split24) or 1 (int8), in the
/// layout of [`Digits`], with Σx per 32, 64 and 128 elements into `sums` (empty where the
/// group does not divide n). Missing tokens of the last group are zero. A block holding a NaN
/// or an infinity gets a NaN factor.
///
/// # Safety
/// AVX2 must be present.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn prepare(
    nd: usize,
    x: &[f32],
    n: usize,
    bytes: &mut Vec<i8>,
    coef: &mut Vec<f32>,
    sums: &mut [Vec<f32>; 3],
) {
    assert!(n.is_multiple_of(32) && n > 0 && matches!(nd, 1 | 3));
    let t = x.len() / n;
    let (nb, ntg) = (n / 32, t.div_ceil(LANES));
    bytes.clear();
    bytes.resize(ntg * nb * nd * 256, 0);
    coef.clear();
    coef.resize(ntg * nb * nd * LANES, 0.0);
    sums[0].clear();
    sums[0].resize(ntg * nb * LANES, 0.0);
    let mut block = [0i8; 96];
    for (ti, xt) in x.chunks_exact(n).enumerate() {
        let (tg, l) = (ti / LANES, ti % LANES);
        for (b, xb) in xt.chunks_exact(32).enumerate() {
            // SAFETY: xb holds 32 floats, block 96 bytes.
            let (cf, s) = unsafe { super::avx2_int::natural_block(nd, xb.as_ptr(), &mut block) };
            let at = (tg * nb + b) * nd;
            sums[0][(tg * nb + b) * LANES + l] = s;
            for d in 0..nd {
                coef[(at + d) * LANES + l] = cf[d];
                let src = &block[d * 32..(d + 1) * 32];
                let dst = &mut bytes[(at + d) * 256..(at + d + 1) * 256];
                for q in 0..8 {
                    dst[q * 32 + l * 4..][..4].copy_from_slice(&src[q * 4..q * 4 + 4]);
                }
            }
        }
    }
    // Σx per 64 and 128 elements: pairs of the previous width, lane by lane.
    super::xprep::pair_sums(sums, n, LANES);
}

thread_local! {
    /// Each thread's expanded rows (one nibble per byte, element order) and their scales and
    /// biases as f32.
    static ROWS: RefCell<(Vec<u8>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Rows of the register tile: two (int8: two rows × two token groups × two partial sums;
/// Split24: two rows × three digit rows).
const TILE_ROWS: usize = 2;

/// Writes columns `rows` of Y [t, out] = X Wᵀ for a 4-bit `a` in rows (n a multiple of 32,
/// group 32, 64 or 128) from the tokens' digits; `vnni` takes AVX-VNNI's instruction.
///
/// # Safety
/// AVX2 (and with `vnni`, AVX-VNNI) must be present; `a` must have passed `check`, `x` be
/// sized for t tokens of a.n at a.group, `y` hold t·out elements, and no other thread touch
/// Y's columns `rows`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul_rows(
    a: &Affine<'_>,
    x: Digits<'_>,
    vnni: bool,
    t: usize,
    out: usize,
    y: SharedMut<'_, f32>,
    rows: Range<usize>,
) {
    let (n, ng) = (a.n, a.groups());
    let (nb, ntg) = (n / 32, t.div_ceil(LANES));
    assert!(a.bits == 4 && n.is_multiple_of(32) && matches!(a.group, 32 | 64 | 128));
    assert!(x.bytes.len() >= ntg * nb * x.nd * 256 && x.coef.len() >= ntg * nb * x.nd * LANES);
    assert!(x.sums.len() >= ntg * ng * LANES && y.len() >= t * out && matches!(x.nd, 1 | 3));
    let rt = TILE_ROWS;
    // Rows expanded a block at a time (about 32 KiB of bytes), each token group then run
    // against the whole block: a chunk's activations (16 KiB a token group at n = 2048) are
    // read once per block instead of once per tile of rows, so a long prompt's do not stream
    // from L3 for every two rows.
    let rb = (BLOCK_BYTES / n).max(rt) / rt * rt;
    ROWS.with_borrow_mut(|(wexp, sc)| {
        if wexp.len() < rb * n {
            wexp.resize(rb * n, 0);
        }
        if sc.len() < 2 * rb * ng {
            sc.resize(2 * rb * ng, 0.0);
        }
        let mut b0 = rows.start;
        while b0 < rows.end {
            let nbr = rb.min(rows.end - b0);
            for i in 0..nbr {
                let (p, s, b) = a.row(b0 + i);
                // SAFETY: AVX2 is present; the row holds n/2 bytes, the buffer n per row.
                unsafe { expand(p, &mut wexp[i * n..(i + 1) * n]) };
                widen(a.float, s, &mut sc[i * ng..(i + 1) * ng]);
                widen(a.float, b, &mut sc[(rb + i) * ng..(rb + i + 1) * ng]);
            }
            let (sw, bw) = sc.split_at(rb * ng);
            let mut tg = 0;
            while tg < ntg {
                // Two token groups at once at int8 where two are left, else one.
                let tgs = if x.nd == 1 && ntg - tg >= 2 { 2 } else { 1 };
                let mut i0 = 0;
                while i0 < nbr {
                    let nr = rt.min(nbr - i0);
                    let w = Rows {
                        wexp: &wexp[i0 * n..],
                        sw: &sw[i0 * ng..],
                        bw: &bw[i0 * ng..],
                        n,
                        ng,
                        bpg: a.group / 32,
                    };
                    // SAFETY: rows b0+i0..b0+i0+nr were expanded above; token groups
                    // tg..tg+tgs exist in x (asserted); the columns are ours (caller).
                    unsafe { tile_rows(&w, &x, vnni, tg, tgs, nr, t, out, y, b0 + i0) };
                    i0 += nr;
                }
                tg += tgs;
            }
            b0 += nbr;
        }
    });
}

/// Expanded bytes of the rows [`matmul_rows`] takes at a time (rounded to whole tiles).
const BLOCK_BYTES: usize = 32 << 10;

/// Y's columns r0..r0+nr (nr ≤ [`TILE_ROWS`]) for token groups tg..tg+tgs from `w`'s first nr
/// rows: a whole tile, or (a short last block) one row at a time.
///
/// # Safety
/// As [`matmul_rows`]; `w` holds nr expanded rows, `x` the token groups.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rows(
    w: &Rows<'_>,
    x: &Digits<'_>,
    vnni: bool,
    tg: usize,
    tgs: usize,
    nr: usize,
    t: usize,
    out: usize,
    y: SharedMut<'_, f32>,
    r0: usize,
) {
    let rt = TILE_ROWS;
    // SAFETY: forwarded (caller); the features are present wherever `vnni` is set.
    unsafe {
        let whole = if nr == rt { rt } else { 0 };
        if whole > 0 {
            let mut acc = [[_mm256_setzero_ps(); 2]; 4];
            match (x.nd, vnni, tgs) {
                (1, false, 2) => tile_madd::<1, 2, 2, 2>(w, x, tg, &mut acc),
                (1, true, 2) => tile_vnni::<1, 2, 2, 2>(w, x, tg, &mut acc),
                (1, false, _) => tile_madd::<1, 2, 1, 2>(w, x, tg, &mut acc),
                (1, true, _) => tile_vnni::<1, 2, 1, 2>(w, x, tg, &mut acc),
                (_, false, _) => tile_madd::<3, 2, 1, 1>(w, x, tg, &mut acc),
                (_, true, _) => tile_vnni::<3, 2, 1, 1>(w, x, tg, &mut acc),
            }
            store(&acc, tg, tgs, t, out, y, r0, whole);
        }
        for i in whole..nr {
            let one = Rows {
                wexp: &w.wexp[i * w.n..],
                sw: &w.sw[i * w.ng..],
                bw: &w.bw[i * w.ng..],
                ..*w
            };
            for g in tg..tg + tgs {
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                match (x.nd, vnni) {
                    (1, false) => tile_madd::<1, 1, 1, 4>(&one, x, g, &mut acc),
                    (1, true) => tile_vnni::<1, 1, 1, 4>(&one, x, g, &mut acc),
                    (_, false) => tile_madd::<3, 1, 1, 2>(&one, x, g, &mut acc),
                    (_, true) => tile_vnni::<3, 1, 1, 2>(&one, x, g, &mut acc),
                }
                store(&acc, g, 1, t, out, y, r0 + i, 1);
            }
        }
    }
}

/// A few rows expanded for the tile: `wexp` [rows, n] nibbles as bytes, `sw`/`bw` [rows, ng]
/// scales and biases.
#[derive(Clone, Copy)]
struct Rows<'a> {
    wexp: &'a [u8],
    sw: &'a [f32],
    bw: &'a [f32],
    n: usize,
    ng: usize,
    bpg: usize,
}

/// Row `p` (n/2 packed bytes, element 2k in byte k's low nibble) as n bytes in element order.
///
/// # Safety
/// AVX2 must be present; `dst` holds 2·p.len() bytes, p.len() a multiple of 16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand(p: &[u8], dst: &mut [u8]) {
    assert!(dst.len() >= 2 * p.len() && p.len().is_multiple_of(16));
    // SAFETY: loads and stores inside p and dst (asserted).
    unsafe {
        let nib = _mm256_set1_epi8(0x0F);
        let whole = p.len() / 32;
        for i in 0..whole {
            let v = _mm256_loadu_si256(p.as_ptr().add(32 * i) as *const _);
            let lo = _mm256_and_si256(v, nib);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
            // Per 128-bit lane: bytes 0-7 and 8-15 of each half interleaved.
            let (a, b) = (_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi));
            let d = dst.as_mut_ptr().add(64 * i);
            _mm256_storeu_si256(d as *mut _, _mm256_permute2x128_si256::<0x20>(a, b));
            _mm256_storeu_si256(d.add(32) as *mut _, _mm256_permute2x128_si256::<0x31>(a, b));
        }
        if !p.len().is_multiple_of(32) {
            let v = _mm_loadu_si128(p.as_ptr().add(32 * whole) as *const _);
            let nib = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(v, nib);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), nib);
            let d = dst.as_mut_ptr().add(64 * whole);
            _mm_storeu_si128(d as *mut _, _mm_unpacklo_epi8(lo, hi));
            _mm_storeu_si128(d.add(16) as *mut _, _mm_unpackhi_epi8(lo, hi));
        }
    }
}

/// The register tile of `R` rows × eight tokens (group `tg`) at `D` digit rows, each sum kept
/// in `K` parts: `$acc` accumulates four products per lane into a block sum, `$join` adds two
/// parts, `$finish` turns a sum into i32. Defined twice, with and without AVX-VNNI.
macro_rules! tile_kernel {
    ($name:ident, $features:literal, $acc:ident, $join:ident, $finish:ident) => {
        /// `acc[r][j]` (lane l: token 8·(tg + j) + l) = Σ_blocks scale·digit factor·Σ q·X
        /// + Σ_groups β·Σx for row r, for `TG` token groups from `tg`.
        ///
        /// # Safety
        /// The features must be present; `w` holds R expanded rows, `x` groups tg..tg+TG.
        #[allow(clippy::needless_range_loop)]
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const D: usize, const R: usize, const TG: usize, const K: usize>(
            w: &Rows<'_>,
            x: &Digits<'_>,
            tg: usize,
            acc: &mut [[__m256; 2]; 4],
        ) {
            let (n, nb) = (w.n, w.n / 32);
            // SAFETY: blocks < nb, rows < R and groups < tg + TG inside the buffers (caller).
            unsafe {
                let (xs, cs) = (nb * D * 256, nb * D * LANES);
                let xb = x.bytes.as_ptr().add(tg * xs);
                let cf = x.coef.as_ptr().add(tg * cs);
                let wp = w.wexp.as_ptr();
                let mut out = [[_mm256_setzero_ps(); TG]; R];
                let mut pg = [[_mm256_setzero_ps(); TG]; R];
                let shift = w.bpg.trailing_zeros();
                for blk in 0..nb {
                    // K independent sums per (row, group, digit row), so the chains of
                    // dependent products (8 per block) overlap.
                    let mut ak = [[[[_mm256_setzero_si256(); D]; TG]; R]; K];
                    let wq = wp.add(blk * 32);
                    for q in 0..8 {
                        let mut xv = [[_mm256_setzero_si256(); D]; TG];
                        for j in 0..TG {
                            for d in 0..D {
                                let at = xb.add(j * xs + blk * D * 256 + (d * 8 + q) * 32);
                                xv[j][d] = _mm256_loadu_si256(at as *const _);
                            }
                        }
                        let ai = &mut ak[q % K];
                        for r in 0..R {
                            let at = wq.add(r * n + q * 4) as *const i32;
                            let wb = _mm256_set1_epi32(std::ptr::read_unaligned(at));
                            for j in 0..TG {
                                for d in 0..D {
                                    ai[r][j][d] = $acc(ai[r][j][d], wb, xv[j][d]);
                                }
                            }
                        }
                    }
                    let mut ai = ak[0];
                    for more in &ak[1..] {
                        for r in 0..R {
                            for j in 0..TG {
                                for d in 0..D {
                                    ai[r][j][d] = $join(ai[r][j][d], more[r][j][d]);
                                }
                            }
                        }
                    }
                    let g = blk >> shift;
                    let first = blk & (w.bpg - 1) == 0;
                    for j in 0..TG {
                        let c = |d: usize| _mm256_loadu_ps(cf.add(j * cs + (blk * D + d) * LANES));
                        for r in 0..R {
                            let a = &ai[r][j];
                            if D == 3 {
                                // |S| ≤ 32·15·128 per digit row, so S₂·2^8 + S₁ < 2^24:
                                // exact.
                                let a2 = _mm256_slli_epi32::<8>($finish(a[0]));
                                let a21 = _mm256_add_epi32(a2, $finish(a[1]));
                                let p = _mm256_mul_ps(_mm256_cvtepi32_ps(a21), c(1));
                                let p = _mm256_fmadd_ps(_mm256_cvtepi32_ps($finish(a[2])), c(2), p);
                                let s = _mm256_set1_ps(*w.sw.get_unchecked(r * w.ng + g));
                                out[r][j] = _mm256_fmadd_ps(p, s, out[r][j]);
                            } else {
                                // int8: the group's blocks summed first, scaled once below
                                // (two fewer multiplies a group at g = 64: +8-13 % in the
                                // kernel bench, one spilled accumulator touched once a group).
                                let v = _mm256_cvtepi32_ps($finish(a[0]));
                                pg[r][j] = if first {
                                    _mm256_mul_ps(v, c(0))
                                } else {
                                    _mm256_fmadd_ps(v, c(0), pg[r][j])
                                };
                            }
                        }
                    }
                    if (blk + 1) & (w.bpg - 1) == 0 {
                        // The group's int8 sums scaled (Split24's were, per block), then its
                        // MLX bias term, β·Σx.
                        for j in 0..TG {
                            let sx = x.sums.as_ptr().add(((tg + j) * w.ng + g) * LANES);
                            let sx = _mm256_loadu_ps(sx);
                            for r in 0..R {
                                if D == 1 {
                                    let s = _mm256_set1_ps(*w.sw.get_unchecked(r * w.ng + g));
                                    out[r][j] = _mm256_fmadd_ps(pg[r][j], s, out[r][j]);
                                }
                                let b = _mm256_set1_ps(*w.bw.get_unchecked(r * w.ng + g));
                                out[r][j] = _mm256_fmadd_ps(b, sx, out[r][j]);
                            }
                        }
                    }
                }
                for r in 0..R {
                    acc[r][..TG].copy_from_slice(&out[r]);
                }
            }
        }
    };
}

/// One broadcast quad's products added to the block's i16 pair sums (`vpmaddubsw`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn acc_madd(a: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x))
}

/// The block's i16 pair sums as i32 lane sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish_madd(a: __m256i) -> __m256i {
    _mm256_madd_epi16(a, _mm256_set1_epi16(1))
}

/// One broadcast quad's products added to the block's i32 sums (`vpdpbusd`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn acc_vnni(a: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(a, w, x)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish_vnni(a: __m256i) -> __m256i {
    a
}

tile_kernel!(tile_madd, "avx2,fma,f16c", acc_madd, join_16, finish_madd);
tile_kernel!(
    tile_vnni,
    "avx2,fma,f16c,avxvnni",
    acc_vnni,
    join_32,
    finish_vnni
);

/// Two partial i16 pair sums of a block joined (together at most 8 products per pair).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn join_16(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi16(a, b)
}

/// Two partial i32 sums of a block joined.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn join_32(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(a, b)
}

/// Writes rows r0..r0+nr of `acc` to Y for the tokens of groups tg..tg+tgs that exist.
///
/// # Safety
/// AVX2 must be present; as [`matmul_rows`].
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store(
    acc: &[[__m256; 2]; 4],
    tg: usize,
    tgs: usize,
    t: usize,
    out: usize,
    y: SharedMut<'_, f32>,
    r0: usize,
    nr: usize,
) {
    // SAFETY: Y's columns r0..r0+nr are ours (caller); tokens below t exist.
    unsafe {
        for j in 0..tgs {
            let base = (tg + j) * LANES;
            for (r, a) in acc.iter().enumerate().take(nr) {
                let mut lanes = [0.0f32; LANES];
                _mm256_storeu_ps(lanes.as_mut_ptr(), a[j]);
                for (l, &val) in lanes.iter().enumerate().take(t - base) {
                    y.write((base + l) * out + r0 + r, val);
                }
            }
        }
    }
}
