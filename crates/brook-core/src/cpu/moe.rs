//! The sparse MoE block on the CPU kernels: router, top-k, routed and shared SwiGLU experts.
//!
//! Owns the block's scratch ([`MoeScratch`], sized once) and its schedule: for one token,
//! three pool jobs (router + shared gate/up; routed gate/up; every expert's down projection
//! with the weighted sum done per output row; with streamed experts the router runs alone
//! first so the reads overlap the shared expert and the experts that landed); for a chunk, each needed expert runs once on
//! the tokens routed to it. Experts are fetched once per call through
//! [`ExpertSource::fetch_into`] into a reserved vector. It must not allocate in the one-token
//! path or index packed bytes. Mirrors [`crate::model::moe::forward`] (routes are identical;
//! sums differ in order only).

use crate::config::ModelConfig;
use crate::cpu::SimdLevel;
use crate::cpu::exec::{Exec, XScratch};
use crate::cpu::ops::{route_top_k, swiglu_act};
use crate::cpu::pool::{Chunks, SharedMut};
use crate::cpu::qmatvec::{XPrep, check, matvec_rows, qmatvec};
use crate::error::{Error, Result};
use crate::model::PREFETCH_GUESSES;
use crate::model::moe::{ExpertData, ExpertHandle, ExpertSource, ExpertView};
use crate::model::ops::sigmoid;
use crate::model::weights::MoeWeights;

/// Scratch of [`expert_swiglu`].
#[derive(Debug, Clone, Default)]
pub struct SwigluScratch {
    g: Vec<f32>, // [I]
    u: Vec<f32>, // [I]
    xp: XPrep,
    hp: XPrep,
}

/// y [H] = down(silu(gate x) ⊙ up x) for one expert on the calling thread (as
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
    swiglu_act(&mut scratch.g, &scratch.u);
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
    preps: Vec<XPrep>,          // [k+1] prepared activations (decode)
    xs: XScratch,               // the block input, prepared
    hs: XScratch,               // an expert's activations, prepared
    bucket: Vec<(usize, f32)>,  // [C·k] (token, weight) grouped by expert
    start: Vec<usize>,          // [E+1] bucket offsets
    cursor: Vec<usize>,         // [E] placement cursor
    xe: Vec<f32>,               // [C, H] tokens routed to one expert
    ye: Vec<f32>,               // [C, H] that expert's outputs; then the shared expert's
}

impl MoeScratch {
    pub fn new(cfg: &ModelConfig, chunk: usize) -> Self {
        let (h, e, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
        let width = cfg
            .moe_intermediate_size
            .max(cfg.shared_expert_intermediate_size);
        let rows = chunk.max(k + 1);
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
            preps: (0..=k).map(|_| XPrep::with_capacity(width)).collect(),
            xs: XScratch::default(),
            hs: XScratch::default(),
            bucket: vec![(0, 0.0); chunk * k],
            start: vec![0; e + 1],
            cursor: vec![0; e],
            xe: vec![0.0; chunk * h],
            ye: vec![0.0; chunk * h],
        }
    }
}

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
) -> Result<()> {
    let h = cfg.hidden_size;
    let t = x.len() / h;
    // A cache that cannot hold one token's k experts at once takes the batched path.
    if t == 1 && experts.capacity() >= s.k {
        decode(ex, w, cfg, experts, layer, x, out, s)
    } else {
        prefill(ex, w, cfg, experts, layer, x, t, out, s)
    }
}

/// `--prefetch` for one token: `normed` is the residual stream leaving a layer, normed with
/// the next layer's norm; routes it with that layer's router (its mixer has not run yet) and
/// hands the likeliest [`PREFETCH_GUESSES`] experts to the expert source to read while the
/// mixer computes. Uses the router scratch, which the next MoE overwrites.
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
) -> Result<()> {
    let (e_n, k, width, is) = (
        cfg.num_experts,
        s.k,
        s.width,
        cfg.shared_expert_intermediate_size,
    );
    let i_w = cfg.moe_intermediate_size;
    let sh = w.shared_expert.view();
    // Streamed experts: route first so the reads start, then compute the shared expert's
    // gate and up while they are in flight, and each routed expert as soon as it lands.
    // Resident experts: one job for the router and the shared expert.
    let streaming = experts.capacity() < cfg.num_hidden_layers * e_n;
    {
        let (hg_s, hu_s) = (&mut s.hg[k * width..], &mut s.hu[k * width..]);
        let (router, sgate) = (&mut s.router[..e_n], &mut s.sgate[..1]);
        if streaming {
            ex.linears(
                x,
                1,
                &mut s.xs,
                &mut [
                    (w.gate.view(), router),
                    (w.shared_expert_gate.view(), sgate),
                ],
            )?;
        } else {
            ex.linears(
                x,
                1,
                &mut s.xs,
                &mut [
                    (w.gate.view(), router),
                    (w.shared_expert_gate.view(), sgate),
                    (sh.gate_proj, &mut hg_s[..is]),
                    (sh.up_proj, &mut hu_s[..is]),
                ],
            )?;
        }
        route_top_k(
            &mut s.router[..e_n],
            cfg.norm_topk_prob,
            &mut s.sel[..k],
            &mut s.wts[..k],
        );
        s.handles.clear();
        experts.fetch_into(layer, &s.sel[..k], &mut s.handles)?;
        if streaming {
            ex.linears(
                x,
                1,
                &mut s.xs,
                &mut [
                    (sh.gate_proj, &mut hg_s[..is]),
                    (sh.up_proj, &mut hu_s[..is]),
                ],
            )?;
        } else {
            for hd in &s.handles {
                hd.wait()?;
            }
        }
    }
    if s.handles.len() != k {
        return Err(Error::Invalid(format!(
            "expert source returned {} of {k} experts",
            s.handles.len()
        )));
    }
    for hd in &s.handles {
        let v = hd.view();
        for m in [v.gate_proj, v.up_proj, v.down_proj] {
            check(&m)?;
        }
        if v.gate_proj.out_features != i_w || v.down_proj.in_features != i_w {
            return Err(Error::Invalid(format!(
                "an expert of layer {layer} is not {i_w} wide"
            )));
        }
    }
    let level = ex.level;
    {
        let (hg, hu) = (SharedMut::new(&mut s.hg), SharedMut::new(&mut s.hu));
        let (handles, prep) = (&s.handles, &s.xs.prep);
        // Units: (slot, block of 32 rows) of gate and up together.
        // Units are claimed in slot order, so a thread waiting for a streamed expert holds
        // up only that expert's rows.
        let per = i_w.div_ceil(32);
        let chunks = Chunks::new(handles.len() * per, 1);
        let failed = std::sync::Mutex::new(None::<Error>);
        ex.pool.run(&|_| {
            while let Some(units) = chunks.claim() {
                let (slot, r0) = (units.start / per, units.start % per * 32);
                let rows = r0..(r0 + 32).min(i_w);
                if let Err(e) = handles[slot].wait() {
                    failed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                    continue;
                }
                let v = handles[slot].view();
                let at = slot * width;
                // SAFETY: each unit is claimed once, so its rows of this slot are ours.
                let (g, u) = unsafe {
                    (
                        hg.slice(at + rows.start..at + rows.end),
                        hu.slice(at + rows.start..at + rows.end),
                    )
                };
                matvec_rows(level, &v.gate_proj, prep, g, rows.clone());
                matvec_rows(level, &v.up_proj, prep, u, rows);
            }
        });
        if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
    }
    for slot in 0..=k {
        let wd = if slot < k { i_w } else { is };
        let (g, u) = (&mut s.hg[slot * width..][..wd], &s.hu[slot * width..][..wd]);
        swiglu_act(g, u);
        s.preps[slot].prepare_with(level, ex.precision, g);
    }
    let gs = sigmoid(s.sgate[0]);
    let h = cfg.hidden_size;
    let ys = SharedMut::new(&mut out[..h]);
    let (handles, preps, wts) = (&s.handles, &s.preps, &s.wts[..k]);
    let chunks = Chunks::new(h, 64);
    ex.pool.run(&|_| {
        let mut tmp = [0.0f32; 64];
        while let Some(rows) = chunks.claim() {
            let (r0, nr) = (rows.start, rows.len());
            // SAFETY: each chunk of rows is claimed by one thread only.
            let orow = unsafe { ys.slice(rows.clone()) };
            orow.fill(0.0);
            for slot in 0..=k {
                let (down, coef) = if slot < k {
                    (handles[slot].view().down_proj, wts[slot])
                } else {
                    (sh.down_proj, gs)
                };
                matvec_rows(level, &down, &preps[slot], &mut tmp[..nr], r0..r0 + nr);
                for (a, b) in orow.iter_mut().zip(&tmp[..nr]) {
                    *a += coef * b;
                }
            }
        }
    });
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn prefill(
    ex: &Exec<'_>,
    w: &MoeWeights,
    cfg: &ModelConfig,
    experts: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    s: &mut MoeScratch,
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
        route_top_k(
            &mut s.router[ti * e_n..(ti + 1) * e_n],
            cfg.norm_topk_prob,
            &mut s.sel[ti * k..(ti + 1) * k],
            &mut s.wts[ti * k..(ti + 1) * k],
        );
    }
    // Shared expert first, into `ye`, scaled by its gate: out = γ_s · f_s(x).
    swiglu_act(&mut s.hg[..t * is], &s.hu[..t * is]);
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
        for j in 0..k {
            let e = s.sel[ti * k + j];
            s.bucket[s.cursor[e]] = (ti, s.wts[ti * k + j]);
            s.cursor[e] += 1;
        }
    }
    s.needed.clear();
    s.needed
        .extend((0..e_n).filter(|&e| s.start[e + 1] > s.start[e]));
    // Fetch in ascending batches no larger than the source holds at once (every expert read
    // at most once per chunk); each token's sum runs in ascending expert order either way.
    let batch = experts.capacity().max(1);
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
        for idx in from..to {
            let e = s.needed[idx];
            s.handles[idx - from].wait()?;
            let v = s.handles[idx - from].view();
            let (a, b) = (s.start[e], s.start[e + 1]);
            let n = b - a;
            for (r, &(ti, _)) in s.bucket[a..b].iter().enumerate() {
                s.xe[r * h..(r + 1) * h].copy_from_slice(&x[ti * h..(ti + 1) * h]);
            }
            ex.linears(
                &s.xe[..n * h],
                n,
                &mut s.xs,
                &mut [
                    (v.gate_proj, &mut s.hg[..n * i_w]),
                    (v.up_proj, &mut s.hu[..n * i_w]),
                ],
            )?;
            swiglu_act(&mut s.hg[..n * i_w], &s.hu[..n * i_w]);
            ex.linears(
                &s.hg[..n * i_w],
                n,
                &mut s.hs,
                &mut [(v.down_proj, &mut s.ye[..n * h])],
            )?;
            for (r, &(ti, we)) in s.bucket[a..b].iter().enumerate() {
                let o = &mut out[ti * h..(ti + 1) * h];
                for (oi, yi) in o.iter_mut().zip(&s.ye[r * h..(r + 1) * h]) {
                    *oi += we * yi;
                }
            }
        }
        from = to;
    }
    s.handles.clear();
    Ok(())
}
