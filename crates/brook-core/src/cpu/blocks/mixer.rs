//! The token mixers on the CPU kernels: Gated DeltaNet and gated attention, one layer each.
//!
//! Owns their scratch ([`MixerScratch`], sized once for a chunk of tokens) and schedule:
//! projections as one pool job, the causal conv split over channels (for one token inside the
//! projections' job, on the rows each thread just computed), the delta rule split over value
//! heads (recurrent for one token, chunked for more); attention in `mixer/attention.rs`. A call
//! may hold several sequences' rows ([`SeqRows`]), each mixed on its own state. It reads and writes the reference
//! state layout (conv [K−1, conv_dim] oldest first, ssm [nv, dk, dv], keys/values
//! [pos, nkv, hd]) and must not allocate while the KV cache and score buffers have room.
//! Mirrors [`crate::model::delta_net::forward`] and [`crate::model::attention::forward`].

use std::ops::Range;

use crate::config::ModelConfig;
use crate::cpu::blocks::exec::{Exec, XScratch};
use crate::cpu::kernels::delta::{self, HeadRows};
use crate::cpu::kernels::fpenv::FlushSubnormals;
use crate::cpu::kernels::ops::{gated_rms_norm, mul_acc, rms_norm_scaled_inplace, silu_inplace};
use crate::cpu::kernels::pool::{Chunks, SharedMut};
use crate::error::{Error, Result};
use crate::model::ops::{sigmoid, softplus};
use crate::model::weights::DeltaNetWeights;

mod attention;
pub use attention::{KvState, attention, attention_seqs};

/// Buffers of both mixers for chunks of up to `chunk` tokens.
#[derive(Debug, Default)]
pub struct MixerScratch {
    chunk: usize,
    threads: usize,
    qkv: Vec<f32>,      // [C, conv_dim] pre-activation
    z: Vec<f32>,        // [C, nv·dv]
    b: Vec<f32>,        // [C, nv]
    a: Vec<f32>,        // [C, nv]
    conv: Vec<f32>,     // [C, conv_dim] after conv + SiLU; q, k normalised in place
    beta: Vec<f32>,     // [C, nv]
    g: Vec<f32>,        // [C, nv] log-decay
    o: Vec<f32>,        // [nv, C, dv] delta-rule output, head-major
    y: Vec<f32>,        // [C, nv·dv] after the gated norm; attention: [C, nq·hd]
    dscratch: Vec<f32>, // [threads, per-thread delta scratch]
    dper: usize,
    qg: Vec<f32>,     // [C, q_proj out]
    kk: Vec<f32>,     // [C, nkv·hd]
    vv: Vec<f32>,     // [C, nkv·hd]
    q: Vec<f32>,      // [C, nq·hd] normalised, rotated
    gate: Vec<f32>,   // [C, nq·hd]
    scores: Vec<f32>, // [threads, nq/nkv, score_cap]
    rot: Vec<f32>,    // [rotary_dim] cos and sin of one position's angles
    score_cap: usize,
    xs: XScratch,
    ys: XScratch,
}

impl MixerScratch {
    pub fn new(cfg: &ModelConfig, chunk: usize, threads: usize, context: usize) -> Self {
        let (nv, dv, dk) = (
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.linear_key_head_dim,
        );
        let cd = cfg.conv_dim();
        let (nq, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let qw = nq * hd * if cfg.attn_output_gate { 2 } else { 1 };
        // One token's step also holds its key head's normalised q and k.
        let dper = (2 * dk).max(delta::chunked_scratch(dk, dv));
        MixerScratch {
            chunk,
            threads,
            qkv: vec![0.0; chunk * cd],
            z: vec![0.0; chunk * nv * dv],
            b: vec![0.0; chunk * nv],
            a: vec![0.0; chunk * nv],
            conv: vec![0.0; chunk * cd],
            beta: vec![0.0; chunk * nv],
            g: vec![0.0; chunk * nv],
            o: vec![0.0; nv * chunk * dv],
            y: vec![0.0; chunk * (nv * dv).max(nq * hd)],
            dscratch: vec![0.0; threads * dper],
            dper,
            qg: vec![0.0; chunk * qw],
            kk: vec![0.0; chunk * nkv * hd],
            vv: vec![0.0; chunk * nkv * hd],
            q: vec![0.0; chunk * nq * hd],
            gate: vec![0.0; chunk * nq * hd],
            scores: vec![0.0; threads * (nq / nkv.max(1)).max(1) * context],
            rot: vec![0.0; cfg.rotary_dim / 2 * 2],
            score_cap: context,
            xs: XScratch::default(),
            ys: XScratch::default(),
        }
    }
}

/// A DeltaNet layer's recurrent state [nv, dk, dv]: f32, or bf16 bits (the fast path's
/// one-token steps, see [`crate::cpu::state`]).
#[derive(Debug)]
pub enum Ssm<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

/// One Gated DeltaNet layer on x [T, H] → out [T, H]; `conv_t` is conv1d transposed to
/// [K, conv_dim]. A bf16 state takes one token at a time.
#[allow(clippy::too_many_arguments)]
pub fn delta_net(
    ex: &Exec<'_>,
    w: &DeltaNetWeights,
    cfg: &ModelConfig,
    conv_t: &[f32],
    conv_state: &mut [f32],
    ssm: Ssm<'_>,
    x: &[f32],
    out: &mut [f32],
    s: &mut MixerScratch,
) -> Result<()> {
    let t = x.len() / cfg.hidden_size;
    let cd = cfg.conv_dim();
    if t == 1 {
        check_bf16(&ssm, 1)?;
        let kk = cfg.linear_conv_kernel_dim;
        let (level, nv, dv) = (
            ex.level,
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
        );
        {
            let (cv, state) = (
                SharedMut::new(&mut s.conv[..cd]),
                SharedMut::new(&mut *conv_state),
            );
            let mut projections = [
                (w.in_proj_qkv.view(), &mut s.qkv[..cd]),
                (w.in_proj_z.view(), &mut s.z[..nv * dv]),
                (w.in_proj_b.view(), &mut s.b[..nv]),
                (w.in_proj_a.view(), &mut s.a[..nv]),
            ];
            // One token: each run of projected channels goes through the causal depthwise
            // conv + SiLU on the thread that computed it, inside the projections' job; q and
            // k are normalised by the delta rule's job, per head.
            let conv_now = |i: usize, ch: Range<usize>, y: &mut [f32]| {
                if i == 0 {
                    let y: &[f32] = y;
                    // SAFETY: each run of qkv rows is computed by one thread only, which
                    // alone touches those channels of the state and of the conv output.
                    unsafe { conv_channels(level, conv_t, cd, kk, 1, ch, &state, |_| y, &cv) };
                }
            };
            ex.linears_then(x, &mut s.xs, &mut projections, &conv_now)?;
        }
        delta_core(ex, w, cfg, conv_t, conv_state, ssm, 0..1, true, s)?;
    } else {
        check_bf16(&ssm, t)?;
        delta_projections(ex, w, cfg, x, t, false, s)?;
        delta_core(ex, w, cfg, conv_t, conv_state, ssm, 0..t, false, s)?;
    }
    let (nv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
    ex.linears(
        &s.y[..t * nv * dv],
        t,
        &mut s.ys,
        &mut [(w.out_proj.view(), out)],
    )
}

/// One sequence's part of a several-sequence mixer call: its rows of the call's input and
/// its state for the layer.
#[derive(Debug)]
pub struct SeqRows<S> {
    pub rows: Range<usize>,
    /// Position of the first row's token.
    pub pos: usize,
    pub state: S,
}

/// A DeltaNet layer's state of one sequence: the conv window and the recurrent state.
pub type DeltaState<'a> = (&'a mut [f32], Ssm<'a>);

/// [`delta_net`] for several sequences at once: x [T, H] holds their rows (each `rows` of
/// `seqs`); the projections read each weight once for all of them (`rowwise`: with the
/// one-token kernel per row, the bits of one-token calls), then each sequence's conv and
/// delta rule runs on its own state.
#[allow(clippy::too_many_arguments)]
pub fn delta_net_seqs(
    ex: &Exec<'_>,
    w: &DeltaNetWeights,
    cfg: &ModelConfig,
    conv_t: &[f32],
    seqs: &mut [SeqRows<DeltaState<'_>>],
    x: &[f32],
    out: &mut [f32],
    rowwise: bool,
    s: &mut MixerScratch,
) -> Result<()> {
    let t = x.len() / cfg.hidden_size;
    for q in seqs.iter() {
        check_bf16(&q.state.1, q.rows.len())?;
    }
    delta_projections(ex, w, cfg, x, t, rowwise, s)?;
    for q in seqs.iter_mut() {
        let (conv, ssm) = (&mut *q.state.0, reborrow(&mut q.state.1));
        delta_core(ex, w, cfg, conv_t, conv, ssm, q.rows.clone(), false, s)?;
    }
    let (nv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
    let ys = &s.y[..t * nv * dv];
    ex.linears_rowwise(rowwise, ys, t, &mut s.ys, &mut [(w.out_proj.view(), out)])
}

fn reborrow<'b>(ssm: &'b mut Ssm<'_>) -> Ssm<'b> {
    match ssm {
        Ssm::F32(v) => Ssm::F32(v),
        Ssm::Bf16(v) => Ssm::Bf16(v),
    }
}

fn check_bf16(ssm: &Ssm<'_>, t: usize) -> Result<()> {
    if t > 1 && matches!(ssm, Ssm::Bf16(_)) {
        return Err(Error::Invalid(
            "a bf16 DeltaNet state takes one token at a time".into(),
        ));
    }
    Ok(())
}

/// The four input projections of x [t, H] into the scratch's rows 0..t.
fn delta_projections(
    ex: &Exec<'_>,
    w: &DeltaNetWeights,
    cfg: &ModelConfig,
    x: &[f32],
    t: usize,
    rowwise: bool,
    s: &mut MixerScratch,
) -> Result<()> {
    let (nv, dv, cd) = (
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
        cfg.conv_dim(),
    );
    let mut projections = [
        (w.in_proj_qkv.view(), &mut s.qkv[..t * cd]),
        (w.in_proj_z.view(), &mut s.z[..t * nv * dv]),
        (w.in_proj_b.view(), &mut s.b[..t * nv]),
        (w.in_proj_a.view(), &mut s.a[..t * nv]),
    ];
    ex.linears_rowwise(rowwise, x, t, &mut s.xs, &mut projections)
}

/// The DeltaNet after its projections for the tokens in scratch rows `rows` of one sequence:
/// conv + SiLU (unless `conv_done`: one token whose conv ran inside the projections' job),
/// q/k normalisation, gates, the delta rule on the sequence's state and the gated norm, into
/// those rows of `s.y`.
#[allow(clippy::too_many_arguments)]
fn delta_core(
    ex: &Exec<'_>,
    w: &DeltaNetWeights,
    cfg: &ModelConfig,
    conv_t: &[f32],
    conv_state: &mut [f32],
    ssm: Ssm<'_>,
    rows: Range<usize>,
    conv_done: bool,
    s: &mut MixerScratch,
) -> Result<()> {
    let (r0, t) = (rows.start, rows.len());
    let (nk, nv, dk, dv) = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    );
    let (cd, kk, key_dim, level) = (
        cfg.conv_dim(),
        cfg.linear_conv_kernel_dim,
        nk * dk,
        ex.level,
    );
    let inv_scale = (dk as f32).powf(-0.5);
    let eps = 1e-6 / dk as f32;
    if !conv_done {
        // Causal depthwise conv + SiLU over [state (K−1 rows); qkv (T rows)], split by
        // channel in runs of whole heads; for a chunk, each run then normalises its q and k
        // heads — q = l2(q)/√dk, k = l2(k) (as rms norms with ε/dk). One token's q and k are
        // normalised by the delta rule's job below, per head.
        let (cv, state) = (
            SharedMut::new(&mut s.conv[r0 * cd..(r0 + t) * cd]),
            SharedMut::new(conv_state),
        );
        let qkv = &s.qkv[r0 * cd..(r0 + t) * cd];
        let chunks = Chunks::new(cd.div_ceil(dk), (512 / dk).max(1));
        ex.pool.run(&|_| {
            while let Some(hs) = chunks.claim() {
                let ch = hs.start * dk..(hs.end * dk).min(cd);
                let new = |j: usize| &qkv[j * cd + ch.start..j * cd + ch.end];
                // SAFETY: each run of channels is claimed by one thread only.
                unsafe { conv_channels(level, conv_t, cd, kk, t, ch.clone(), &state, new, &cv) };
                if t == 1 {
                    continue;
                }
                for ti in 0..t {
                    // SAFETY: as above.
                    let o = unsafe { cv.slice(ti * cd + ch.start..ti * cd + ch.end) };
                    for (j, head) in o.chunks_mut(dk).enumerate() {
                        let c0 = ch.start + j * dk;
                        if c0 + dk <= key_dim {
                            rms_norm_scaled_inplace(level, head, eps, inv_scale * inv_scale);
                        } else if c0 + dk <= 2 * key_dim {
                            rms_norm_scaled_inplace(level, head, eps, inv_scale);
                        }
                    }
                }
            }
        });
    }
    // The gates (one token: per head in the delta rule's job).
    let (a0, b0) = (&s.a[r0 * nv..(r0 + t) * nv], &s.b[r0 * nv..(r0 + t) * nv]);
    let gate = |i: usize| -w.A_log[i % nv].exp() * softplus(a0[i] + w.dt_bias[i % nv]);
    if t > 1 {
        for i in 0..t * nv {
            s.beta[r0 * nv + i] = sigmoid(b0[i]);
            s.g[r0 * nv + i] = gate(i);
        }
    }

    let (r, chunk, dper) = (nv / nk, s.chunk, s.dper);
    // One of the two is the state, the other empty.
    let bf16 = matches!(ssm, Ssm::Bf16(_));
    let (st, st16) = match ssm {
        Ssm::F32(v) => (SharedMut::new(v), SharedMut::new(&mut [][..])),
        Ssm::Bf16(v) => (SharedMut::new(&mut [][..]), SharedMut::new(v)),
    };
    let o = SharedMut::new(&mut s.o[..]);
    let ds = SharedMut::new(&mut s.dscratch[..]);
    let conv = &s.conv[r0 * cd..(r0 + t) * cd];
    let (g, beta) = (
        &s.g[r0 * nv..(r0 + t) * nv],
        &s.beta[r0 * nv..(r0 + t) * nv],
    );
    let z = &s.z[r0 * nv * dv..(r0 + t) * nv * dv];
    let y = SharedMut::new(&mut s.y[r0 * nv * dv..(r0 + t) * nv * dv]);
    let eps_n = cfg.rms_norm_eps;
    let heads = Chunks::new(nv, 1);
    ex.pool.run(&|tid| {
        // The decays drive products into the subnormals, which cost Intel cores a microcode
        // assist each (kernels/fpenv.rs).
        let _flush = FlushSubnormals::new();
        // SAFETY: thread `tid` owns scratch slot `tid`, and each head is claimed by one
        // thread only, so its state and output slices are too.
        let scratch = unsafe { ds.slice(tid * dper..(tid + 1) * dper) };
        while let Some(hs) = heads.claim() {
            let h = hs.start;
            let kh = h / r;
            let at = h * dk * dv..(h + 1) * dk * dv;
            // SAFETY: see above.
            let oh = unsafe { o.slice((h * chunk + r0) * dv..(h * chunk + r0 + t) * dv) };
            if t == 1 {
                // q = l2(q)/√dk, k = l2(k) of the head's key head, as the chunks' conv job
                // does in place (here a copy: two value heads share a key head).
                let (q, rest) = scratch.split_at_mut(dk);
                let (k, _) = rest.split_at_mut(dk);
                q.copy_from_slice(&conv[kh * dk..][..dk]);
                rms_norm_scaled_inplace(level, q, eps, inv_scale * inv_scale);
                k.copy_from_slice(&conv[key_dim + kh * dk..][..dk]);
                rms_norm_scaled_inplace(level, k, eps, inv_scale);
                let v = &conv[2 * key_dim + h * dv..][..dv];
                let (gh, bh) = (gate(h), sigmoid(b0[h]));
                if bf16 {
                    // SAFETY: see above.
                    let sh = unsafe { st16.slice(at) };
                    delta::step_bf16(level, sh, q, k, v, gh, bh, oh);
                } else {
                    // SAFETY: see above.
                    let sh = unsafe { st.slice(at) };
                    delta::step(level, sh, q, k, v, gh, bh, oh);
                }
            } else {
                let rows = HeadRows {
                    q: &conv[kh * dk..],
                    k: &conv[key_dim + kh * dk..],
                    v: &conv[2 * key_dim + h * dv..],
                    g: &g[h..],
                    beta: &beta[h..],
                    q_stride: cd,
                    v_stride: cd,
                    gb_stride: nv,
                    dk,
                    dv,
                };
                // SAFETY: see above (an f32 state: checked before the call).
                let sh = unsafe { st.slice(at) };
                delta::chunked(level, &rows, t, sh, scratch, oh);
            }
            // The head's gated norm, token by token, into its columns of y.
            for ti in 0..t {
                let zh = &z[(ti * nv + h) * dv..][..dv];
                // SAFETY: y's columns of head h are written by this thread only.
                let yh = unsafe { y.slice((ti * nv + h) * dv..(ti * nv + h + 1) * dv) };
                gated_rms_norm(level, &oh[ti * dv..][..dv], zh, &w.norm, eps_n, yh);
            }
        }
    });
    Ok(())
}

/// Causal depthwise conv + SiLU of channels `ch` for `t` tokens into rows 0..t of `out`
/// ([t, cd]): row i = SiLU(Σ_m conv_t[m]·src(i + m)) over the K taps, where src(r) is row r
/// of the state (r < K−1) or `new(r − (K−1))`, token j's channels `ch`; then the state's
/// channels `ch` move on to the last K−1 rows of [state; new tokens], oldest first.
///
/// # Safety
/// The caller alone touches channels `ch` of `state` and of `out` during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn conv_channels<'a>(
    level: crate::cpu::SimdLevel,
    conv_t: &[f32],
    cd: usize,
    kk: usize,
    t: usize,
    ch: Range<usize>,
    state: &SharedMut<'_, f32>,
    new: impl Fn(usize) -> &'a [f32],
    out: &SharedMut<'_, f32>,
) {
    let past = kk - 1;
    let at = |row: usize| row * cd + ch.start..row * cd + ch.end;
    for ti in 0..t {
        // SAFETY: the caller holds these channels (see above).
        let o = unsafe { out.slice(at(ti)) };
        o.fill(0.0);
        for m in 0..kk {
            let r = ti + m;
            let src = if r < past {
                // SAFETY: as above (row r's channels, read only here).
                unsafe { state.slice(at(r)) }
            } else {
                new(r - past)
            };
            mul_acc(level, &conv_t[at(m)], src, o);
        }
        silu_inplace(level, o);
    }
    // Row r's source (row t + r of [state; new]) is always later, so ascending r is in place.
    for r in 0..past {
        let src = t + r;
        // SAFETY: as above.
        let dst = unsafe { state.slice(at(r)) };
        if src < past {
            // SAFETY: as above; rows src > r are not written before this read.
            dst.copy_from_slice(unsafe { state.slice(at(src)) });
        } else {
            dst.copy_from_slice(new(src - past));
        }
    }
}
