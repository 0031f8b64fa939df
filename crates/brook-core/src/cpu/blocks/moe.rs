//! The sparse MoE block on the CPU kernels: router, top-k, routed and shared SwiGLU experts.
//!
//! Owns the block's scratch ([`MoeScratch`], sized once) and its schedule. For one token: the
//! router alone (so streamed reads start), then one pool job (`Schedule`) in which the
//! shared expert's gate/up and each routed expert's run as soon as they are in memory and each
//! expert's down projection as soon as its activations are ready, into its own output row;
//! the weighted sum is taken in slot order after. For a chunk
//! (`moe/chunk.rs`), each needed expert runs once on the tokens routed to it, whole on one
//! thread (threads claim experts), into its tokens' bucket positions; each token's sum is
//! taken after, in ascending expert order. Experts are fetched once per call
//! through [`ExpertSource::fetch_into`] into a reserved vector. It must not allocate in the
//! one-token path or index packed bytes. Mirrors [`crate::model::moe::forward`] (routes are identical;
//! sums differ in order only).

use std::sync::Mutex;

use crate::config::ModelConfig;
use crate::cpu::SimdLevel;
use crate::cpu::blocks::exec::{Exec, XScratch};
use crate::cpu::kernels::ops::{route_given, route_top_k, swiglu_act};
use crate::cpu::kernels::pool::SharedMut;
use crate::cpu::kernels::qmatvec::{XPrep, check, matvec_rows, qmatvec, warm};
use crate::engine::{GivenRoutes, check_given};
use crate::error::{Error, Result};
use crate::experts::source::{ExpertData, ExpertHandle, ExpertSource, ExpertView};
use crate::model::PREFETCH_GUESSES;
use crate::model::ops::sigmoid;
use crate::model::weights::MoeWeights;

mod chunk;
mod schedule;
use chunk::Lane;
use schedule::{Schedule, SlotCounters, Unit};

/// Scratch of [`expert_swiglu`].
#[derive(Debug, Clone, Default)]
pub struct SwigluScratch {
    g: Vec<f32>, // [I]
    u: Vec<f32>, // [I]
    xp: XPrep,
    hp: XPrep,
}

/// y \[H\] = down(silu(gate x) ⊙ up x) for one expert on the calling thread (as
/// [`crate::model::moe::swiglu`]). Buffers in `scratch` grow to the expert's width once.
pub fn expert_swiglu(
    level: SimdLevel,
    e: ExpertView<'_>,
    x: &[f32],
    y: &mut [f32],
    scratch: &mut SwigluScratch,
) -> Result<()> {
    let width = e.gate_proj.out_features;
    scratch.g.resize(width, 0.0);
    scratch.u.resize(width, 0.0);
    qmatvec(level, &e.gate_proj, x, &mut scratch.g, &mut scratch.xp)?;
    check(&e.up_proj)?;
    if e.up_proj.out_features != width || e.up_proj.in_features != x.len() {
        return Err(Error::Invalid(
            "expert up_proj does not match gate_proj".into(),
        ));
    }
    matvec_rows(level, &e.up_proj, &scratch.xp, &mut scratch.u, 0..width);
    swiglu_act(level, &mut scratch.g, &scratch.u);
    qmatvec(level, &e.down_proj, &scratch.g, y, &mut scratch.hp)
}

/// Preallocated buffers of the MoE block for chunks of up to `chunk` tokens.
#[derive(Debug, Default)]
pub struct MoeScratch {
    k: usize,
    width: usize,               // max(I, Is)
    router: Vec<f32>,           // [C, E] logits, then probabilities
    pub sel: Vec<usize>,        // [C, k] chosen experts, best first
    pub wts: Vec<f32>,          // [C, k] their weights
    sgate: Vec<f32>,            // [C] shared-expert gate logits
    needed: Vec<usize>,         // [≤ E] distinct experts of the call, ascending
    handles: Vec<ExpertHandle>, // [≤ E] fetched, parallel to `needed` (decode: to `sel`)
    hg: Vec<f32>,               // [C or k+1, width] gate outputs, then activations
    hu: Vec<f32>,               // [C or k+1, width] up outputs
    preps: Vec<XPrep>,          // [seqs·(k+1)] prepared activations (decode)
    hmap: Vec<usize>,           // [seqs·k] decode: each (token, rank)'s entry in `handles`
    xs: XScratch,               // the block input, prepared
    hs: XScratch,               // an expert's activations, prepared
    bucket: Vec<usize>,         // [C·k] tokens grouped by expert
    start: Vec<usize>,          // [E+1] bucket offsets
    cursor: Vec<usize>,         // [E] placement cursor
    ye: Vec<f32>,               // [C·k or k+1, H] expert outputs (prefill: in bucket order)
    slots: Vec<(usize, f32)>,   // [C·k] per token, (bucket position, weight) by ascending expert
    lanes: Vec<Mutex<Lane>>,    // [threads] prefill: one expert at a time per thread
    sched: Vec<SlotCounters>,   // [seqs·(k+1)] one-token schedule counters
}

impl MoeScratch {
    /// Scratch for chunks of up to `chunk` tokens and one-token steps of up to `seqs`
    /// sequences together.
    pub fn new(cfg: &ModelConfig, chunk: usize, seqs: usize) -> Self {
        let (h, e, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
        let width = cfg
            .moe_intermediate_size
            .max(cfg.shared_expert_intermediate_size);
        let slots = seqs.max(1) * (k + 1);
        let rows = chunk.max(slots);
        MoeScratch {
            k,
            width,
            router: vec![0.0; chunk * e],
            sel: vec![0; chunk * k],
            wts: vec![0.0; chunk * k],
            sgate: vec![0.0; chunk],
            needed: Vec::with_capacity(e),
            handles: Vec::with_capacity(e),
            hg: vec![0.0; rows * width],
            hu: vec![0.0; rows * width],
            preps: (0..slots).map(|_| XPrep::with_capacity(width)).collect(),
            hmap: vec![0; slots],
            xs: XScratch::default(),
            hs: XScratch::default(),
            bucket: vec![0; chunk * k],
            start: vec![0; e + 1],
            cursor: vec![0; e],
            ye: vec![0.0; (chunk * k).max(slots) * h],
            slots: vec![(0, 0.0); chunk * k],
            lanes: Vec::new(),
            sched: (0..slots).map(|_| SlotCounters::default()).collect(),
        }
    }
}

/// Routes given for a block's tokens instead of the router's (a replayed routing), with the
/// index of the sequence they belong to.
pub type Given<'a> = Option<(&'a dyn GivenRoutes, usize)>;

/// out [T, H] = MoE(x [T, H]) of `layer`; the routes are left in `s.sel` / `s.wts`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    ex: &Exec<'_>,
    w: &MoeWeights,
    cfg: &ModelConfig,
    experts: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    out: &mut [f32],
    s: &mut MoeScratch,
    given: Given<'_>,
) -> Result<()> {
    let h = cfg.hidden_size;
    let t = x.len() / h;
    // A cache that cannot hold one token's k experts at once takes the batched path.
    if t == 1 && experts.capacity() >= s.k {
        decode(ex, w, cfg, experts, layer, x, out, s, given)
    } else {
        chunk::prefill(ex, w, cfg, experts, layer, x, t, out, s, given)
    }
}

/// out [n, H] = MoE(x [n, H]) for `n` single tokens of different sequences, routed by the
/// routers: one job for all of them, each expert read once however many tokens chose it, and
/// each token's result the bits of [`forward`] on it alone (the one-token schedule's products
/// and sums per token). Where the expert source cannot hold all their experts at once, the
/// tokens go one at a time.
#[allow(clippy::too_many_arguments)]
pub fn forward_tokens(
    ex: &Exec<'_>,
    w: &MoeWeights,
    cfg: &ModelConfig,
    experts: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    out: &mut [f32],
    s: &mut MoeScratch,
) -> Result<()> {
    let h = cfg.hidden_size;
    let n = x.len() / h;
    let fits = n * (s.k + 1) <= s.preps.len() && experts.capacity() >= n * s.k;
    if n > 1 && fits {
        return decode(ex, w, cfg, experts, layer, x, out, s, None);
    }
    for (xt, ot) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        forward(ex, w, cfg, experts, layer, xt, ot, s, None)?;
    }
    Ok(())
}

/// Token `ti`'s experts and weights into `s.sel` / `s.wts` from the router's logits in
/// `s.router`: the given experts when there are, else the router's top-k.
fn route(
    s: &mut MoeScratch,
    cfg: &ModelConfig,
    layer: usize,
    ti: usize,
    given: Given<'_>,
) -> Result<()> {
    let (e_n, k) = (cfg.num_experts, s.k);
    let p = &mut s.router[ti * e_n..(ti + 1) * e_n];
    let (sel, wts) = (
        &mut s.sel[ti * k..(ti + 1) * k],
        &mut s.wts[ti * k..(ti + 1) * k],
    );
    match given.and_then(|(g, seq)| g.experts(seq, ti, layer)) {
        Some(ids) => {
            check_given(ids, k, e_n, layer)?;
            route_given(p, cfg.norm_topk_prob, ids, sel, wts);
        }
        None => route_top_k(p, cfg.norm_topk_prob, sel, wts),
    }
    Ok(())
}

/// `--prefetch` for one token: `normed` is the residual stream entering `layer` (the embedding
/// for layer 0), normed with its MoE norm; routes it with its router (its mixer has not run
/// yet) and hands the likeliest [`PREFETCH_GUESSES`] experts to the expert source to read
/// while the mixer computes. Uses the router scratch, which the next MoE overwrites.
pub fn prefetch_next(
    ex: &Exec<'_>,
    next: &MoeWeights,
    cfg: &ModelConfig,
    experts: &dyn ExpertSource,
    layer: usize,
    normed: &[f32],
    s: &mut MoeScratch,
) -> Result<()> {
    let (e_n, g) = (cfg.num_experts, PREFETCH_GUESSES.min(s.k));
    let router = &mut s.router[..e_n];
    ex.linears(
        normed,
        1,
        &mut s.xs,
        &mut [(next.gate.view(), &mut *router)],
    )?;
    route_top_k(router, false, &mut s.sel[..g], &mut s.wts[..g]);
    experts.prefetch(layer, &s.sel[..g]);
    Ok(())
}

/// The one-token MoE for `n` ≥ 1 tokens (x [n, H]; `given` only for one): slot
/// t·(k+1) + j is token t's routed expert of rank j (j < k) or its shared expert (j = k).
#[allow(clippy::too_many_arguments)]
fn decode(
    ex: &Exec<'_>,
    w: &MoeWeights,
    cfg: &ModelConfig,
    experts: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    out: &mut [f32],
    s: &mut MoeScratch,
    given: Given<'_>,
) -> Result<()> {
    let (e_n, k, width, is) = (
        cfg.num_experts,
        s.k,
        s.width,
        cfg.shared_expert_intermediate_size,
    );
    let (i_w, h) = (cfg.moe_intermediate_size, cfg.hidden_size);
    let n = x.len() / h;
    let (kk, slots) = (k + 1, n * (k + 1));
    let sh = w.shared_expert.view();
    // Route first, so a streamed layer's reads start before anything else computes; the
    // shared expert's gate and up are units of the expert job below, which runs them while
    // the reads are in flight (and, resident, beside the routed experts).
    let mut routers = [
        (w.gate.view(), &mut s.router[..n * e_n]),
        (w.shared_expert_gate.view(), &mut s.sgate[..n]),
    ];
    ex.linears_rowwise(n > 1, x, n, &mut s.xs, &mut routers)?;
    for ti in 0..n {
        route(s, cfg, layer, ti, given)?;
    }
    // Each expert once, however many tokens chose it.
    s.needed.clear();
    for (i, &e) in s.sel[..n * k].iter().enumerate() {
        s.hmap[i] = match s.needed.iter().position(|&d| d == e) {
            Some(p) => p,
            None => {
                s.needed.push(e);
                s.needed.len() - 1
            }
        };
    }
    s.handles.clear();
    experts.fetch_into(layer, &s.needed, &mut s.handles)?;
    if s.handles.len() != s.needed.len() {
        return Err(Error::Invalid(format!(
            "expert source returned {} of {} experts",
            s.handles.len(),
            s.needed.len()
        )));
    }
    gate_up_ready(&w.shared_expert, layer, is)?;
    let level = ex.level;
    // Threads per token: with several tokens there are that many more experts to share out,
    // so units grow (fewer claims; the rows' results do not depend on how they are split).
    let threads = ex.pool.threads().div_ceil(n);
    let (gu_rows, down_rows) = (
        unit_rows(i_w, threads, 32, 256),
        unit_rows(h, threads, 64, 1024),
    );
    let (per, per_shared) = (i_w.div_ceil(gu_rows), is.div_ceil(gu_rows));
    let per_down = h.div_ceil(down_rows);
    let sched = Schedule::new(&mut s.sched[..slots], k, per, per_shared, per_down);
    {
        let (hg, hu) = (SharedMut::new(&mut s.hg), SharedMut::new(&mut s.hu));
        let (preps, ys) = (SharedMut::new(&mut s.preps), SharedMut::new(&mut s.ye));
        let (handles, hmap, prec) = (&s.handles, &s.hmap, ex.precision);
        let (one, rows_prep) = (&s.xs.prep, &s.xs.rows);
        // Token t's prepared input.
        let prep = |t: usize| if n == 1 { one } else { &rows_prep[t] };
        let routed = |slot: usize| slot % kk < k;
        let handle = |slot: usize| &handles[hmap[slot / kk * k + slot % kk]];
        // The rows of a gate/up or a down unit, and a unit's first rows asked into L2.
        let gu = |slot: usize, block: usize| {
            let wide = if routed(slot) { i_w } else { is };
            block * gu_rows..((block + 1) * gu_rows).min(wide)
        };
        let down = |block: usize| block * down_rows..((block + 1) * down_rows).min(h);
        let down_of = |slot: usize| {
            if routed(slot) {
                handle(slot).view().down_proj
            } else {
                sh.down_proj
            }
        };
        let warm_unit = |unit: &Unit| match *unit {
            Unit::GateUp(slot, block) => {
                let v = if routed(slot) {
                    gate_up_ready(&**handle(slot), layer, i_w).ok()
                } else {
                    Some(sh)
                };
                for m in v.iter().flat_map(|v| [&v.gate_proj, &v.up_proj]) {
                    warm(level, m, gu(slot, block), false);
                }
            }
            Unit::Down(slot, block) => warm(level, &down_of(slot), down(block), false),
            Unit::Wait | Unit::Done => {}
        };
        ex.pool.run(&|_| {
            // The shared experts are always in memory.
            let landed = |slot: usize| !routed(slot) || handle(slot).landed();
            let mut next: Option<Unit> = None;
            loop {
                let unit = match next.take() {
                    Some(u) => u,
                    None => sched.claim(landed, true),
                };
                // Claim the unit after this one now, where one can start, and ask for its
                // first rows while this one computes: a unit is a short run (half of an
                // expert's matrix, or two halves), which would otherwise start on misses.
                if matches!(unit, Unit::GateUp(..) | Unit::Down(..)) {
                    next = Some(sched.claim(landed, false))
                        .filter(|u| matches!(u, Unit::GateUp(..) | Unit::Down(..)));
                    next.iter().for_each(warm_unit);
                }
                match unit {
                    Unit::Done => return,
                    // Another thread holds the last open work; sleep on a read it waits for
                    // rather than spin (its error, if any, is reported by that thread).
                    Unit::Wait => match handles.iter().find(|hd| !hd.landed()) {
                        Some(hd) => drop(hd.wait()),
                        None => std::thread::yield_now(),
                    },
                    Unit::GateUp(slot, block) => {
                        let (at, wide) = (slot * width, if routed(slot) { i_w } else { is });
                        let rows = gu(slot, block);
                        let v = if routed(slot) {
                            match gate_up_ready(&**handle(slot), layer, i_w) {
                                Ok(v) => v,
                                Err(e) => {
                                    sched.fail(e);
                                    return;
                                }
                            }
                        } else {
                            sh
                        };
                        // SAFETY: each (slot, block) is claimed once, so these rows are ours.
                        let (g, u) = unsafe {
                            (
                                hg.slice(at + rows.start..at + rows.end),
                                hu.slice(at + rows.start..at + rows.end),
                            )
                        };
                        // The up rows' start comes into L1 while the gate's compute.
                        warm(level, &v.up_proj, rows.clone(), true);
                        let xp = prep(slot / kk);
                        matvec_rows(level, &v.gate_proj, xp, g, rows.clone());
                        matvec_rows(level, &v.up_proj, xp, u, rows);
                        if sched.gate_up_done(slot) {
                            // SAFETY: the slot's gate/up blocks are all done and its down
                            // blocks are not claimable until `prepared`, so we hold it alone.
                            let (g, u, xp) = unsafe {
                                (
                                    hg.slice(at..at + wide),
                                    hu.slice(at..at + wide),
                                    &mut preps.slice(slot..slot + 1)[0],
                                )
                            };
                            swiglu_act(level, g, u);
                            xp.prepare_with(level, prec, g);
                            sched.prepared(slot);
                        }
                    }
                    Unit::Down(slot, block) => {
                        let (rows, down) = (down(block), down_of(slot));
                        // SAFETY: (slot, block) is claimed once; the slot's prep was written
                        // before `prepared` (published by it) and is only read from now on.
                        let (y, xp) = unsafe {
                            (
                                ys.slice(slot * h + rows.start..slot * h + rows.end),
                                &preps.slice(slot..slot + 1)[0],
                            )
                        };
                        matvec_rows(level, &down, xp, y, rows);
                    }
                }
            }
        });
    }
    if let Some(e) = sched.into_error() {
        return Err(e);
    }
    // Each token's weighted sum, in slot order (routed by rank, then the shared expert), so
    // the result does not depend on which reads landed first.
    for t in 0..n {
        let gs = sigmoid(s.sgate[t]);
        let o = &mut out[t * h..(t + 1) * h];
        o.fill(0.0);
        for j in 0..=k {
            let coef = if j < k { s.wts[t * k + j] } else { gs };
            for (a, b) in o.iter_mut().zip(&s.ye[(t * kk + j) * h..][..h]) {
                *a += coef * b;
            }
        }
    }
    Ok(())
}

/// Rows of one unit of the one-token MoE: a thread's share of a matrix of `rows` rows,
/// between `lo` and `hi`. Each unit streams its rows from one place; units of 32 gate/up and
/// 64 down rows (a 16-64 KiB run each, the two threads alternating through every matrix) ran
/// the resident 35B's experts at half the dense matrices' rate per byte, and its fast decode
/// 12-30% slower than a thread's share (docs/bench/2026-11-30-to-12-02.md, "session 7").
fn unit_rows(rows: usize, threads: usize, lo: usize, hi: usize) -> usize {
    rows.div_ceil(threads.max(1)).clamp(lo, hi)
}

/// Waits for an expert (routed, or the shared one) and checks it is a `width`-wide expert the
/// kernels can run.
fn gate_up_ready<'a>(hd: &'a dyn ExpertData, layer: usize, width: usize) -> Result<ExpertView<'a>> {
    hd.wait()?;
    let v = hd.view();
    for m in [v.gate_proj, v.up_proj, v.down_proj] {
        check(&m)?;
    }
    if v.gate_proj.out_features != width || v.down_proj.in_features != width {
        return Err(Error::Invalid(format!(
            "an expert of layer {layer} is not {width} wide"
        )));
    }
    Ok(v)
}
