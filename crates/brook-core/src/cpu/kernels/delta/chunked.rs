//! The chunked form of the gated delta rule (prefill): a chunk of [`CHUNK`] tokens of one head
//! at a time, its products with the state and within the chunk as register-blocked matrix
//! products. Mirrors [`crate::model::delta_net`]'s `delta_rule_chunked`; the one-token step
//! is in the parent module.

use crate::cpu::SimdLevel;
use crate::cpu::kernels::ops::{exp_act, plain};
use crate::model::delta_net::CHUNK;

/// Floats of scratch [`chunked`] needs for key width `dk` and value width `dv`.
pub fn chunked_scratch(dk: usize, dv: usize) -> usize {
    CHUNK * dv + 2 * CHUNK + dk * CHUNK + 3 * CHUNK * CHUNK
}

/// Token inputs of one value head for [`chunked`]: row t of each is that token's vector.
#[derive(Debug, Clone, Copy)]
pub struct HeadRows<'a> {
    pub q: &'a [f32], // q of token t at q[t·q_stride ..][..dk]
    pub k: &'a [f32],
    pub v: &'a [f32],    // v of token t at v[t·v_stride ..][..dv]
    pub g: &'a [f32],    // log-decay of token t at g[t·gb_stride]
    pub beta: &'a [f32], // β of token t at beta[t·gb_stride]
    pub q_stride: usize,
    pub v_stride: usize,
    pub gb_stride: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Rows of one register block of [`mm`]; its columns, `NR`, are 64 with AVX-512's 32
/// registers and 16 with AVX2's 16 (at 64 the blocks spilled: the resident 35B's `fast` pp512
/// on AVX2 66.4 tok/s against 68.7-69.5 at 16; AVX-512 167-168 at 16 against 169-172).
const MR: usize = 4;

/// C [m, n] = init·C + A B for rows `a(i)` (each at least `kd` long) of A [m, kd] and B
/// [kd, n] (row stride `ldb`); C has row stride `ldc`; `init` None starts from zero. Blocks
/// of [`MR`] × `NR` accumulate in registers over the whole of `kd`, each element in the order
/// of `kd` whatever `NR` is. Always inlined, so it runs at the SIMD level of its caller.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn mm<'x, const NR: usize>(
    c: &mut [f32],
    ldc: usize,
    m: usize,
    a: impl Fn(usize) -> &'x [f32],
    b: &[f32],
    ldb: usize,
    kd: usize,
    n: usize,
    init: Option<f32>,
) {
    let mut i0 = 0;
    while i0 < m {
        let mr = MR.min(m - i0);
        let rows: [&[f32]; MR] = std::array::from_fn(|r| &a(i0 + r.min(mr - 1))[..kd]);
        let mut j0 = 0;
        while j0 < n {
            let nr = NR.min(n - j0);
            if mr == MR && nr == NR {
                let mut acc = [[0.0f32; NR]; MR];
                if let Some(f) = init {
                    for (r, accr) in acc.iter_mut().enumerate() {
                        let cr = &c[(i0 + r) * ldc + j0..][..NR];
                        for j in 0..NR {
                            accr[j] = f * cr[j];
                        }
                    }
                }
                for p in 0..kd {
                    let br = &b[p * ldb + j0..][..NR];
                    for r in 0..MR {
                        let av = rows[r][p];
                        for j in 0..NR {
                            acc[r][j] = av.mul_add(br[j], acc[r][j]);
                        }
                    }
                }
                for (r, accr) in acc.iter().enumerate() {
                    c[(i0 + r) * ldc + j0..][..NR].copy_from_slice(accr);
                }
            } else {
                for (r, row) in rows.iter().enumerate().take(mr) {
                    let cr = &mut c[(i0 + r) * ldc + j0..][..nr];
                    match init {
                        Some(f) => cr.iter_mut().for_each(|v| *v *= f),
                        None => cr.fill(0.0),
                    }
                    for (p, &av) in row.iter().enumerate() {
                        plain::axpy(av, &b[p * ldb + j0..][..nr], cr);
                    }
                }
            }
            j0 += nr;
        }
        i0 += mr;
    }
}

/// out[d] = finish(d, out[d], Σ_{j < count} w(j)·rows\[j\]\[d\]) for d < dv (rows of width dv),
/// the sums kept in registers `W` columns at a time (twice [`mm`]'s `NR`).
#[inline(always)]
fn weighted_rows<const W: usize>(
    out: &mut [f32],
    rows: &[f32],
    dv: usize,
    count: usize,
    w: impl Fn(usize) -> f32,
    finish: impl Fn(usize, f32, f32) -> f32,
) {
    let mut j0 = 0;
    while j0 < dv {
        let nc = W.min(dv - j0);
        let mut acc = [0.0f32; W];
        if nc == W {
            // Whole blocks with constant bounds, so `acc` stays in registers (a slice of it
            // of run-time length went through the stack: load, FMA, store per term).
            for j in 0..count {
                let wj = w(j);
                let r: &[f32; W] = rows[j * dv + j0..][..W].try_into().expect("W values");
                for l in 0..W {
                    acc[l] = wj.mul_add(r[l], acc[l]);
                }
            }
        } else {
            for j in 0..count {
                let wj = w(j);
                let r = &rows[j * dv + j0..][..nc];
                for (a, &x) in acc[..nc].iter_mut().zip(r) {
                    *a = wj.mul_add(x, *a);
                }
            }
        }
        for (jd, o) in out[j0..j0 + nc].iter_mut().enumerate() {
            *o = finish(j0 + jd, *o, acc[jd]);
        }
        j0 += nc;
    }
}

/// All `t` tokens of one head, a chunk of [`CHUNK`] at a time (see `delta_rule_chunked`):
/// the pseudo-values v' solve a unit lower-triangular system within the chunk, outputs
/// combine the entering state with intra-chunk attention, and S advances once per chunk.
/// The products with the state (S₀ᵀk, S₀ᵀq, the update Σ k v'ᵀ) and the chunk's k·k and
/// q·k run as register-blocked matrix products (`mm`); the triangular solve and the
/// outputs sum rows of v' in registers. Writes o [t, dv]; `scratch` holds
/// [`chunked_scratch`] floats.
pub fn chunked(
    level: SimdLevel,
    x: &HeadRows<'_>,
    t: usize,
    s: &mut [f32],
    scratch: &mut [f32],
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match level {
        // SAFETY: the CPU has the features of these levels (checked in the guards).
        SimdLevel::Avx512 if level.is_supported() => {
            return unsafe { chunked_v512(x, t, s, scratch, o) };
        }
        SimdLevel::Avx2 if level.is_supported() => {
            return unsafe { chunked_v256(x, t, s, scratch, o) };
        }
        _ => {}
    }
    chunked_in::<16, 32>(x, t, s, scratch, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn chunked_v512(
    x: &HeadRows<'_>,
    t: usize,
    s: &mut [f32],
    scratch: &mut [f32],
    o: &mut [f32],
) {
    chunked_in::<64, 128>(x, t, s, scratch, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunked_v256(
    x: &HeadRows<'_>,
    t: usize,
    s: &mut [f32],
    scratch: &mut [f32],
    o: &mut [f32],
) {
    chunked_in::<16, 32>(x, t, s, scratch, o)
}

/// The body of [`chunked`] with `NR` columns to [`mm`]'s register blocks and `W` to
/// [`weighted_rows`]'.
#[inline(always)]
fn chunked_in<const NR: usize, const W: usize>(
    x: &HeadRows<'_>,
    t: usize,
    s: &mut [f32],
    scratch: &mut [f32],
    o: &mut [f32],
) {
    let (dk, dv) = (x.dk, x.dv);
    let q = |ti: usize| &x.q[ti * x.q_stride..][..dk];
    let k = |ti: usize| &x.k[ti * x.q_stride..][..dk];
    let v = |ti: usize| &x.v[ti * x.v_stride..][..dv];
    let (vp, rest) = scratch.split_at_mut(CHUNK * dv);
    let (gamma, rest) = rest.split_at_mut(CHUNK);
    let (kt, rest) = rest.split_at_mut(dk * CHUNK);
    let (dots, rest) = rest.split_at_mut(2 * CHUNK * CHUNK);
    let (dec, rest) = rest.split_at_mut(CHUNK * CHUNK);
    let wlast = &mut rest[..CHUNK];
    for start in (0..t).step_by(CHUNK) {
        let c = CHUNK.min(t - start);
        let oc = &mut o[start * dv..(start + c) * dv];
        let mut acc = 0.0;
        for i in 0..c {
            acc += x.g[(start + i) * x.gb_stride];
            gamma[i] = acc;
        }
        // Kᵀ [dk, c] of the chunk, then [K; Q] Kᵀ: k_i·k_j in rows 0..c, q_i·k_j after.
        for j in 0..c {
            for (a, &kv) in k(start + j).iter().enumerate() {
                kt[a * c + j] = kv;
            }
        }
        let kq = |i: usize| {
            if i < c {
                k(start + i)
            } else {
                q(start + i - c)
            }
        };
        mm::<NR>(dots, c, 2 * c, kq, kt, c, dk, c, None);
        // S₀ᵀk_i into v', S₀ᵀq_i into the outputs.
        mm::<NR>(vp, dv, c, |i| k(start + i), s, dv, dk, dv, None);
        mm::<NR>(oc, dv, c, |i| q(start + i), s, dv, dk, dv, None);
        // e^{γ_i−γ_j} for j ≤ i, once for both passes below (an exp per use was 3-4% of a
        // prefill), on the vectorizable exp (libm's, a call each, was 1.5% still).
        for i in 0..c {
            let gi = gamma[i];
            for (d, &gj) in dec[i * c..=i * c + i].iter_mut().zip(&gamma[..=i]) {
                *d = exp_act(gi - gj);
            }
        }
        // v'_i = β_i (v_i − e^{γ_i} S₀ᵀk_i − Σ_{j<i} (k_i·k_j) e^{γ_i−γ_j} v'_j), in order.
        for i in 0..c {
            let ti = start + i;
            let (beta, gi) = (x.beta[ti * x.gb_stride], gamma[i]);
            let decay0 = gi.exp();
            let (done, cur) = vp.split_at_mut(i * dv);
            let cur = &mut cur[..dv];
            let vi = v(ti);
            let kk = &dots[i * c..];
            weighted_rows::<W>(
                cur,
                done,
                dv,
                i,
                |j| kk[j] * dec[i * c + j],
                |jd, u, sum| beta * (vi[jd] - decay0 * u - sum),
            );
        }
        // o_i = e^{γ_i} S₀ᵀq_i + Σ_{j≤i} (q_i·k_j) e^{γ_i−γ_j} v'_j.
        for i in 0..c {
            let gi = gamma[i];
            let decay = gi.exp();
            let qk = &dots[(c + i) * c..];
            let oh = &mut oc[i * dv..(i + 1) * dv];
            weighted_rows::<W>(
                oh,
                vp,
                dv,
                i + 1,
                |j| qk[j] * dec[i * c + j],
                |_, w0, sum| decay * w0 + sum,
            );
        }
        // S = e^{γ_last} S + Σ_j e^{γ_last−γ_j} k_j v'_jᵀ, with the weights folded into Kᵀ.
        let last = gamma[c - 1];
        for (w, &gj) in wlast.iter_mut().zip(&gamma[..c]) {
            *w = exp_act(last - gj);
        }
        for a in 0..dk {
            for (kv, &w) in kt[a * c..(a + 1) * c].iter_mut().zip(&wlast[..c]) {
                *kv *= w;
            }
        }
        mm::<NR>(
            s,
            dv,
            dk,
            |a| &kt[a * c..(a + 1) * c],
            vp,
            dv,
            c,
            dv,
            Some(last.exp()),
        );
    }
}
