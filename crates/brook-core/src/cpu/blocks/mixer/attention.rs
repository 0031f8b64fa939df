//! The gated attention mixer on the CPU kernels (split from `mixer.rs`, which holds the
//! scratch both mixers share and the DeltaNet): projections as one pool job, per-head q/k
//! norms and RoPE, the KV cache appended, attention split over (token, head) units for one
//! token and (token, kv head) for more. Mirrors [`crate::model::attention::forward`].

use std::ops::Range;

use super::{MixerScratch, SeqRows};
use crate::config::ModelConfig;
use crate::cpu::blocks::exec::Exec;
use crate::cpu::kernels::attention::attend;
use crate::cpu::kernels::ops::{rms_norm, rope, rope_angles, sigmoid_gate};
use crate::cpu::kernels::pool::{Chunks, SharedMut};
use crate::error::Result;
use crate::model::weights::AttentionWeights;

/// One gated attention layer on x [T, H] at positions pos0.. → out [T, H], appending to the
/// KV cache.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    ex: &Exec<'_>,
    w: &AttentionWeights,
    cfg: &ModelConfig,
    inv_freq: &[f64],
    keys: &mut Vec<f32>,
    values: &mut Vec<f32>,
    pos0: usize,
    x: &[f32],
    out: &mut [f32],
    s: &mut MixerScratch,
) -> Result<()> {
    let t = x.len() / cfg.hidden_size;
    let mut seq = [SeqRows {
        rows: 0..t,
        pos: pos0,
        state: (keys, values),
    }];
    attention_seqs(ex, w, cfg, inv_freq, &mut seq, x, out, false, s)
}

/// An attention layer's KV cache of one sequence: keys and values [pos, nkv, hd].
pub type KvState<'a> = (&'a mut Vec<f32>, &'a mut Vec<f32>);

/// [`attention`] for several sequences at once, as [`super::delta_net_seqs`]: shared projections,
/// then each sequence's attention over its own cache.
#[allow(clippy::too_many_arguments)]
pub fn attention_seqs(
    ex: &Exec<'_>,
    w: &AttentionWeights,
    cfg: &ModelConfig,
    inv_freq: &[f64],
    seqs: &mut [SeqRows<KvState<'_>>],
    x: &[f32],
    out: &mut [f32],
    rowwise: bool,
    s: &mut MixerScratch,
) -> Result<()> {
    let t = x.len() / cfg.hidden_size;
    let (nq, nkv, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let qw = nq * hd * if cfg.attn_output_gate { 2 } else { 1 };
    let mut projections = [
        (w.q_proj.view(), &mut s.qg[..t * qw]),
        (w.k_proj.view(), &mut s.kk[..t * nkv * hd]),
        (w.v_proj.view(), &mut s.vv[..t * nkv * hd]),
    ];
    ex.linears_rowwise(rowwise, x, t, &mut s.xs, &mut projections)?;
    for q in seqs.iter_mut() {
        let (keys, values) = (&mut *q.state.0, &mut *q.state.1);
        attention_core(ex, w, cfg, inv_freq, keys, values, q.pos, q.rows.clone(), s);
    }
    let ys = &s.y[..t * nq * hd];
    let mut o = [(w.o_proj.view(), out)];
    ex.linears_rowwise(rowwise, ys, t, &mut s.ys, &mut o)
}

/// Attention after the projections for one sequence's tokens in scratch rows `rows`, at
/// positions pos0..: q/k norms and RoPE, the cache appended, attention (gated) into those
/// rows of `s.y`.
#[allow(clippy::too_many_arguments)]
fn attention_core(
    ex: &Exec<'_>,
    w: &AttentionWeights,
    cfg: &ModelConfig,
    inv_freq: &[f64],
    keys: &mut Vec<f32>,
    values: &mut Vec<f32>,
    pos0: usize,
    rows: Range<usize>,
    s: &mut MixerScratch,
) {
    let (r0, t) = (rows.start, rows.len());
    let (nq, nkv, hd, level) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        ex.level,
    );
    let gated = cfg.attn_output_gate;
    let qw = nq * hd * if gated { 2 } else { 1 };
    let per_head = qw / nq;
    let eps = cfg.rms_norm_eps;
    for ti in r0..r0 + t {
        let cs = &mut s.rot[..2 * inv_freq.len()];
        rope_angles(pos0 + ti - r0, inv_freq, cs);
        for head in 0..nq {
            let src = &s.qg[ti * qw + head * per_head..][..per_head];
            let dst = (ti * nq + head) * hd;
            rms_norm(level, &src[..hd], &w.q_norm, eps, &mut s.q[dst..dst + hd]);
            rope(&mut s.q[dst..dst + hd], cs);
            if gated {
                s.gate[dst..dst + hd].copy_from_slice(&src[hd..]);
            }
        }
        for head in 0..nkv {
            let at = (ti * nkv + head) * hd;
            // The head is normalised into this sequence's rows of `y` (free until attention
            // fills them) and copied back.
            let tmp = &mut s.y[r0 * nq * hd..][..hd];
            rms_norm(level, &s.kk[at..at + hd], &w.k_norm, eps, tmp);
            s.kk[at..at + hd].copy_from_slice(tmp);
            rope(&mut s.kk[at..at + hd], cs);
        }
    }
    keys.extend_from_slice(&s.kk[r0 * nkv * hd..(r0 + t) * nkv * hd]);
    values.extend_from_slice(&s.vv[r0 * nkv * hd..(r0 + t) * nkv * hd]);
    let need = pos0 + t;
    if need > s.score_cap {
        // Past the context reserved at construction: grow (amortized), allocating once.
        s.score_cap = need.next_power_of_two();
        s.scores.resize(s.threads * (nq / nkv) * s.score_cap, 0.0);
    }
    let (scale, group, cap) = ((hd as f32).powf(-0.5), nq / nkv, s.score_cap);
    // A unit is `hp` query heads of one token sharing a kv head, which read each cached key
    // and value once for all of them: every head of the kv head for a chunk, and for one
    // token as many as still leave a unit for every thread (the most dividing `group`).
    let hp = if t > 1 {
        group
    } else {
        let per_kv = s.threads.div_ceil(nkv.max(1));
        (1..=group / per_kv.max(1))
            .rev()
            .find(|d| group % d == 0)
            .unwrap_or(1)
    };
    let (att, sc) = (
        SharedMut::new(&mut s.y[r0 * nq * hd..(r0 + t) * nq * hd]),
        SharedMut::new(&mut s.scores[..]),
    );
    let q = &s.q[r0 * nq * hd..(r0 + t) * nq * hd];
    let gate = &s.gate[r0 * nq * hd..(r0 + t) * nq * hd];
    let (keys, values) = (&keys[..], &values[..]);
    let units = Chunks::new(t * nq / hp, 1);
    ex.pool.run(&|tid| {
        // SAFETY: thread `tid` owns score rows tid·hp..; each unit is claimed by one thread
        // only, and so are its heads' output rows.
        let scores = unsafe { sc.slice(tid * hp * cap..(tid + 1) * hp * cap) };
        while let Some(us) = units.claim() {
            let (ti, h0) = (us.start * hp / nq, us.start * hp % nq);
            let rows = (ti * nq + h0) * hd..(ti * nq + h0 + hp) * hd;
            // SAFETY: this unit's rows are ours alone (see above).
            let o = unsafe { att.slice(rows.clone()) };
            attend(
                level,
                &q[rows.clone()],
                hd,
                keys,
                values,
                nkv,
                h0 / group,
                pos0 + ti + 1,
                scale,
                scores,
                o,
            );
            if gated {
                sigmoid_gate(level, o, &gate[rows]);
            }
        }
    });
}
