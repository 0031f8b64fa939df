//! The MoE block for a chunk of tokens (prefill): routes for every token, the shared expert
//! over the chunk, then each needed routed expert once on the tokens routed to it, whole on
//! one thread (threads claim experts, [`Lane`] holds a thread's buffers), into its tokens'
//! bucket positions; each token's weighted sum is taken after, in ascending expert order, so
//! the result is the same at every cache size and thread count. Split out of `moe.rs`, whose
//! scratch it uses.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::MoeScratch;
use crate::config::ModelConfig;
use crate::cpu::blocks::exec::{Exec, XScratch};
use crate::cpu::kernels::ops::swiglu_act;
use crate::cpu::kernels::pool::{Chunks, SharedMut};
use crate::error::{Error, Result};
use crate::experts::source::{ExpertData, ExpertHandle, ExpertSource};
use crate::model::ops::sigmoid;
use crate::model::weights::MoeWeights;

/// Tokens of one expert a prefill lane computes at once (more are done in turns).
const LANE_TOKENS: usize = 64;

/// One thread's buffers for whole experts in prefill: its tokens' inputs, gate and up
/// outputs, and their prepared forms.
#[derive(Debug, Default)]
pub(super) struct Lane {
    xe: Vec<f32>, // [LANE_TOKENS, H]
    hg: Vec<f32>, // [LANE_TOKENS, I]
    hu: Vec<f32>, // [LANE_TOKENS, I]
    xa: XScratch,
    xh: XScratch,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn prefill(
    ex: &Exec<'_>,
    w: &MoeWeights,
    cfg: &ModelConfig,
    experts: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    s: &mut MoeScratch,
    given: super::Given<'_>,
) -> Result<()> {
    let (h, e_n, k) = (cfg.hidden_size, cfg.num_experts, s.k);
    let (i_w, is) = (
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    );
    let sh = w.shared_expert.view();
    ex.linears(
        x,
        t,
        &mut s.xs,
        &mut [
            (w.gate.view(), &mut s.router[..t * e_n]),
            (sh.gate_proj, &mut s.hg[..t * is]),
            (sh.up_proj, &mut s.hu[..t * is]),
            (w.shared_expert_gate.view(), &mut s.sgate[..t]),
        ],
    )?;
    for ti in 0..t {
        super::route(s, cfg, layer, ti, given)?;
    }
    // Shared expert first, into `ye`, scaled by its gate: out = γ_s · f_s(x).
    swiglu_act(ex.level, &mut s.hg[..t * is], &s.hu[..t * is]);
    ex.linears(
        &s.hg[..t * is],
        t,
        &mut s.hs,
        &mut [(sh.down_proj, &mut out[..t * h])],
    )?;
    for ti in 0..t {
        let gs = sigmoid(s.sgate[ti]);
        out[ti * h..(ti + 1) * h].iter_mut().for_each(|v| *v *= gs);
    }
    // Bucket (token, weight) by expert: counts, offsets, then placement.
    s.start.iter_mut().for_each(|v| *v = 0);
    for &e in &s.sel[..t * k] {
        s.start[e + 1] += 1;
    }
    for e in 0..e_n {
        s.start[e + 1] += s.start[e];
    }
    s.cursor.copy_from_slice(&s.start[..e_n]);
    for ti in 0..t {
        let slots = &mut s.slots[ti * k..(ti + 1) * k];
        for (j, slot) in slots.iter_mut().enumerate() {
            let e = s.sel[ti * k + j];
            s.bucket[s.cursor[e]] = ti;
            *slot = (s.cursor[e], s.wts[ti * k + j]);
            s.cursor[e] += 1;
        }
        // Bucket positions grow with the expert id: ascending expert order.
        slots.sort_unstable_by_key(|&(pos, _)| pos);
    }
    s.needed.clear();
    s.needed
        .extend((0..e_n).filter(|&e| s.start[e + 1] > s.start[e]));
    let threads = ex.pool.threads();
    if s.lanes.len() < threads {
        s.lanes.resize_with(threads, || {
            Mutex::new(Lane {
                xe: vec![0.0; LANE_TOKENS * h],
                hg: vec![0.0; LANE_TOKENS * i_w],
                hu: vec![0.0; LANE_TOKENS * i_w],
                ..Lane::default()
            })
        });
    }
    // Fetch in ascending batches no larger than the source holds at once (every expert read
    // at most once per chunk). Each thread claims whole experts and computes them alone
    // (no pool job per matrix: at ~16 tokens an expert's rows split over threads ran at two
    // thirds of one thread's rate), writing each token's output at its bucket position.
    let batch = experts.capacity().max(1);
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    let ye = SharedMut::new(&mut s.ye[..t * k * h]);
    let mut from = 0;
    while from < s.needed.len() {
        let to = (from + batch).min(s.needed.len());
        s.handles.clear();
        experts.fetch_into(layer, &s.needed[from..to], &mut s.handles)?;
        if s.handles.len() != to - from {
            return Err(Error::Invalid(
                "expert source returned too few experts".into(),
            ));
        }
        let next = AtomicUsize::new(from);
        let (needed, handles, start, bucket, lanes) =
            (&s.needed, &s.handles, &s.start, &s.bucket, &s.lanes);
        ex.pool.run(&|tid| {
            let mut lane = lanes[tid].lock().unwrap_or_else(|p| p.into_inner());
            loop {
                let idx = next.fetch_add(1, Ordering::Relaxed);
                if idx >= to {
                    break;
                }
                let e = needed[idx];
                let (a, b) = (start[e], start[e + 1]);
                let r = whole_expert(
                    ex,
                    &handles[idx - from],
                    x,
                    h,
                    &bucket[a..b],
                    &mut lane,
                    |p| {
                        // SAFETY: expert e alone owns bucket positions a..b, so these rows of
                        // `ye` are written by this thread only.
                        unsafe { ye.slice((a + p.start) * h..(a + p.end) * h) }
                    },
                );
                if let Err(err) = r {
                    failed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(err);
                    break;
                }
            }
        });
        if let Some(err) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(err);
        }
        from = to;
    }
    // Each token's sum in ascending expert order (the order is part of the result: the same
    // at every cache size and thread count), tokens split over the threads.
    let (outs, ye, slots) = (SharedMut::new(&mut out[..t * h]), &s.ye, &s.slots);
    let chunks = Chunks::new(t, 4);
    ex.pool.run(&|_| {
        while let Some(tokens) = chunks.claim() {
            for ti in tokens {
                // SAFETY: token ti's row of `out` belongs to this claim alone.
                let o = unsafe { outs.slice(ti * h..(ti + 1) * h) };
                for &(pos, we) in &slots[ti * k..(ti + 1) * k] {
                    for (oi, yi) in o.iter_mut().zip(&ye[pos * h..(pos + 1) * h]) {
                        *oi += we * yi;
                    }
                }
            }
        }
    });
    s.handles.clear();
    Ok(())
}

/// One routed expert over its tokens (`rows`: its tokens in bucket order) on the calling
/// thread, LANE_TOKENS at a time: gather, gate and up, SwiGLU, down into `ye(tokens)`.
fn whole_expert<'y>(
    ex: &Exec<'_>,
    handle: &ExpertHandle,
    x: &[f32],
    h: usize,
    rows: &[usize],
    lane: &mut Lane,
    ye: impl Fn(std::ops::Range<usize>) -> &'y mut [f32],
) -> Result<()> {
    handle.wait()?;
    let v = handle.view();
    let iw = v.gate_proj.out_features;
    let Lane { xe, hg, hu, xa, xh } = lane;
    for p in (0..rows.len()).step_by(LANE_TOKENS) {
        let n = LANE_TOKENS.min(rows.len() - p);
        for (r, &ti) in rows[p..p + n].iter().enumerate() {
            xe[r * h..(r + 1) * h].copy_from_slice(&x[ti * h..(ti + 1) * h]);
        }
        ex.linears_here(
            &xe[..n * h],
            n,
            xa,
            &mut [
                (v.gate_proj, &mut hg[..n * iw]),
                (v.up_proj, &mut hu[..n * iw]),
            ],
        )?;
        swiglu_act(ex.level, &mut hg[..n * iw], &hu[..n * iw]);
        ex.linears_here(&hg[..n * iw], n, xh, &mut [(v.down_proj, ye(p..p + n))])?;
    }
    Ok(())
}
