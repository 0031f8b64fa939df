//! The gated delta rule of one DeltaNet value head: the recurrent step (decode) and the
//! chunked form (prefill), on an f32 state S [dk, dv].
//!
//! Owns the state arithmetic only; the caller normalises q and k, computes the log-decay g
//! and β, and runs heads in parallel. It must not allocate (scratch comes from the caller).
//! Mirrors [`crate::model::delta_net::delta_rule_recurrent`] and `delta_rule_chunked`:
//! the step reads S once for u₀ = Sᵀk and w₀ = Sᵀq and writes it once, using
//! u = αu₀, δ = β(v − u), S' = αS + kδᵀ and o = S'ᵀq = αw₀ + (k·q)δ, which is the reference's
//! decay–read–update–read sequence in one trip through memory instead of four passes.

use crate::cpu::SimdLevel;
use crate::cpu::ops::{plain, simd_fn};
use crate::model::delta_net::CHUNK;

/// Floats of scratch [`step`] needs for value width `dv`.
pub fn step_scratch(dv: usize) -> usize {
    3 * dv
}

simd_fn! {
    /// One token: S [dk, dv] ← e^g·S + k δᵀ with δ = β(v − e^g·Sᵀk); o [dv] = Sᵀq after the
    /// update. Done 16 value columns at a time: a column block of S (dk × 16 floats, 8 KiB at
    /// dk = 128) is read for u and w, then updated while still in L1, so S crosses the memory
    /// bus once each way per token (30 layers × 2 MiB of state at 35B). `scratch` is unused
    /// (kept for [`step_scratch`] callers).
    pub fn step(
        s: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: f32,
        beta: f32,
        o: &mut [f32],
        scratch: &mut [f32],
    ) {
        let _ = scratch;
        let (dk, dv) = (k.len(), v.len());
        let alpha = g.exp();
        let kq = plain::dot(k, q);
        let mut j0 = 0;
        while j0 < dv {
            let nj = (dv - j0).min(16);
            let (mut u, mut w) = ([0.0f32; 16], [0.0f32; 16]);
            for i in 0..dk {
                let row = &s[i * dv + j0..i * dv + j0 + nj];
                for j in 0..nj {
                    u[j] = row[j].mul_add(k[i], u[j]);
                    w[j] = row[j].mul_add(q[i], w[j]);
                }
            }
            let mut delta = [0.0f32; 16];
            for j in 0..nj {
                delta[j] = beta * (v[j0 + j] - alpha * u[j]);
                o[j0 + j] = alpha * w[j] + kq * delta[j];
            }
            for i in 0..dk {
                let row = &mut s[i * dv + j0..i * dv + j0 + nj];
                for j in 0..nj {
                    row[j] = k[i].mul_add(delta[j], alpha * row[j]);
                }
            }
            j0 += nj;
        }
    }
}

/// Floats of scratch [`chunked`] needs for value width `dv`.
pub fn chunked_scratch(dv: usize) -> usize {
    CHUNK * dv + CHUNK
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

simd_fn! {
    /// All `t` tokens of one head, a chunk of [`CHUNK`] at a time (see `delta_rule_chunked`):
    /// the pseudo-values v' solve a unit lower-triangular system within the chunk, outputs
    /// combine the entering state with intra-chunk attention, and S advances once per chunk.
    /// Writes o [t, dv]; `scratch` holds [`chunked_scratch`] floats.
    pub fn chunked(x: &HeadRows<'_>, t: usize, s: &mut [f32], scratch: &mut [f32], o: &mut [f32]) {
        let (dk, dv) = (x.dk, x.dv);
        let q = |ti: usize| &x.q[ti * x.q_stride..][..dk];
        let k = |ti: usize| &x.k[ti * x.q_stride..][..dk];
        let v = |ti: usize| &x.v[ti * x.v_stride..][..dv];
        let (vp, rest) = scratch.split_at_mut(CHUNK * dv);
        let gamma = &mut rest[..CHUNK];
        for start in (0..t).step_by(CHUNK) {
            let c = CHUNK.min(t - start);
            let oc = &mut o[start * dv..(start + c) * dv];
            let mut acc = 0.0;
            for i in 0..c {
                acc += x.g[(start + i) * x.gb_stride];
                gamma[i] = acc;
            }
            // S₀ᵀk_i and S₀ᵀq_i for the whole chunk, reading each state row once.
            vp[..c * dv].fill(0.0);
            oc.fill(0.0);
            for a in 0..dk {
                let row = &s[a * dv..(a + 1) * dv];
                for i in 0..c {
                    plain::axpy(k(start + i)[a], row, &mut vp[i * dv..(i + 1) * dv]);
                    plain::axpy(q(start + i)[a], row, &mut oc[i * dv..(i + 1) * dv]);
                }
            }
            for i in 0..c {
                let ti = start + i;
                let beta = x.beta[ti * x.gb_stride];
                let decay0 = gamma[i].exp();
                let (done, cur) = vp.split_at_mut(i * dv);
                let cur = &mut cur[..dv];
                for (jd, vpj) in cur.iter_mut().enumerate() {
                    *vpj = beta * (v(ti)[jd] - decay0 * *vpj);
                }
                for j in 0..i {
                    let a_ij = beta * plain::dot(k(ti), k(start + j)) * (gamma[i] - gamma[j]).exp();
                    plain::axpy(-a_ij, &done[j * dv..(j + 1) * dv], cur);
                }
            }
            for i in 0..c {
                let ti = start + i;
                let oh = &mut oc[i * dv..(i + 1) * dv];
                plain::scale(gamma[i].exp(), oh);
                for j in 0..=i {
                    let w = plain::dot(q(ti), k(start + j)) * (gamma[i] - gamma[j]).exp();
                    plain::axpy(w, &vp[j * dv..(j + 1) * dv], oh);
                }
            }
            let last = gamma[c - 1];
            let decay = last.exp();
            for a in 0..dk {
                let row = &mut s[a * dv..(a + 1) * dv];
                plain::scale(decay, row);
                for j in 0..c {
                    let w = (last - gamma[j]).exp() * k(start + j)[a];
                    plain::axpy(w, &vp[j * dv..(j + 1) * dv], row);
                }
            }
        }
    }
}
