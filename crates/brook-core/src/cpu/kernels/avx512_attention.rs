//! AVX-512 attention: q·k scores for blocks of four query heads by four cached positions, and
//! the values' weighted sums for eight heads at a time.
//!
//! Owns the two loops of [`super::attention::attend`] at [`SimdLevel::Avx512`]. One dot
//! product alone needs two loads per FMA (a chunk of q and one of k), more than the core
//! loads in a cycle; in a block, the four keys' and four queries' chunks serve 16 FMAs, so the
//! loop runs at the FMA rate. Every score is the same computation whichever block or edge
//! computes it (16 partial sums over the chunks in order, then added pairwise), so a head's
//! scores do not depend on its company. Scores differ from [`super::ops::plain::dot`] in the
//! final additions only; the weighted sums are those of the plain loop, to the bit.
//!
//! [`SimdLevel::Avx512`]: super::SimdLevel::Avx512

use std::arch::x86_64::*;

use super::attention::{Ahead, BLOCK};

/// The sum of v's 16 lanes: halves added pairwise (8, 4, 2, 1 lanes apart).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
fn hsum(v: __m512) -> f32 {
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)))
}

/// acc[i][j] = Σ_c q_{g0+i}[c] · k_{p0+j}[c] as 16 partial sums, for G heads and P positions.
///
/// # Safety
/// AVX-512 F; qs holds (g0+G)·hd floats, keys (p0+P-1)·stride + hd; hd a multiple of 16.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn block<const G: usize, const P: usize>(
    qs: *const f32,
    hd: usize,
    keys: *const f32,
    stride: usize,
    g0: usize,
    p0: usize,
) -> [[__m512; P]; G] {
    let mut acc = [[_mm512_setzero_ps(); P]; G];
    // SAFETY: every load is inside the bounds the caller guarantees.
    unsafe {
        for c in (0..hd).step_by(16) {
            let k: [__m512; P] =
                std::array::from_fn(|j| _mm512_loadu_ps(keys.add((p0 + j) * stride + c)));
            for (i, row) in acc.iter_mut().enumerate() {
                let q = _mm512_loadu_ps(qs.add((g0 + i) * hd + c));
                for (a, kj) in row.iter_mut().zip(&k) {
                    *a = _mm512_fmadd_ps(q, *kj, *a);
                }
            }
        }
    }
    acc
}

/// scores [heads, visible] = scale · q_g·k_p for the heads of `qs` [heads, hd] and the
/// positions p < visible of `keys` (rows `stride` apart, from the kv head's first element).
///
/// # Safety
/// AVX-512 F must be present; hd a multiple of 16; keys holds (visible-1)·stride + hd floats
/// and scores heads·visible.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn scores(
    qs: &[f32],
    hd: usize,
    keys: &[f32],
    stride: usize,
    visible: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let heads = qs.len() / hd;
    assert!(hd.is_multiple_of(16) && scores.len() >= heads * visible);
    assert!(visible == 0 || keys.len() >= (visible - 1) * stride + hd);
    let (q, k) = (qs.as_ptr(), keys.as_ptr());
    let (g4, p4) = (heads / 4 * 4, visible / 4 * 4);
    // SAFETY: the asserts above bound every block's loads; stores index inside scores.
    unsafe {
        for p0 in (0..p4).step_by(4) {
            for g0 in (0..g4).step_by(4) {
                let acc = block::<4, 4>(q, hd, k, stride, g0, p0);
                for (i, row) in acc.iter().enumerate() {
                    for (j, a) in row.iter().enumerate() {
                        scores[(g0 + i) * visible + p0 + j] = hsum(*a) * scale;
                    }
                }
            }
            for g in g4..heads {
                let acc = block::<1, 4>(q, hd, k, stride, g, p0);
                for (j, a) in acc[0].iter().enumerate() {
                    scores[g * visible + p0 + j] = hsum(*a) * scale;
                }
            }
        }
        for p in p4..visible {
            for g in 0..heads {
                let acc = block::<1, 1>(q, hd, k, stride, g, p);
                scores[g * visible + p] = hsum(acc[0][0]) * scale;
            }
        }
    }
}

/// outs [heads, hd] = Σ_p w_gp v_p for heads in eights (`scores` [heads, visible] the weights,
/// `values` rows `stride` apart from the kv head's first element): per block of
/// [`BLOCK`] positions and 32 dimensions, each value chunk is loaded
/// once into registers for the eight heads' 16 accumulators (the plain loop folded the load
/// into every head's FMA: three loads for two FMAs). Each output is summed over p in order
/// with one FMA a term, as `attention::weigh` sums it, to the bit.
///
/// # Safety
/// AVX-512 F; heads a multiple of 8, hd of 32; values holds (visible-1)·stride + hd floats.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn weigh8(
    scores: &[f32],
    visible: usize,
    values: &[f32],
    stride: usize,
    outs: &mut [f32],
    hd: usize,
) {
    let heads = outs.len() / hd;
    assert!(heads.is_multiple_of(8) && hd.is_multiple_of(32));
    assert!(scores.len() >= heads * visible);
    assert!(visible == 0 || values.len() >= (visible - 1) * stride + hd);
    let (v, o) = (values.as_ptr(), outs.as_mut_ptr());
    // SAFETY: the asserts bound every load and store.
    unsafe {
        for g0 in (0..heads).step_by(8) {
            let sc = scores.as_ptr().add(g0 * visible);
            for p0 in (0..visible).step_by(BLOCK) {
                let end = (p0 + BLOCK).min(visible);
                let mut ahead = Ahead::new(p0, visible, hd / 32);
                for d in (0..hd).step_by(32) {
                    ahead.fetch(values, stride, hd);
                    let mut acc = [[_mm512_setzero_ps(); 2]; 8];
                    if p0 > 0 {
                        for (g, a) in acc.iter_mut().enumerate() {
                            let at = o.add((g0 + g) * hd + d);
                            *a = [_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16))];
                        }
                    }
                    for p in p0..end {
                        let row = v.add(p * stride + d);
                        let (v0, v1) = (_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16)));
                        for (g, a) in acc.iter_mut().enumerate() {
                            let s = _mm512_set1_ps(*sc.add(g * visible + p));
                            a[0] = _mm512_fmadd_ps(s, v0, a[0]);
                            a[1] = _mm512_fmadd_ps(s, v1, a[1]);
                        }
                    }
                    for (g, a) in acc.iter().enumerate() {
                        let at = o.add((g0 + g) * hd + d);
                        _mm512_storeu_ps(at, a[0]);
                        _mm512_storeu_ps(at.add(16), a[1]);
                    }
                }
            }
        }
    }
}
