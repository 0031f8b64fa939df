//! Steps of several sequences on the GPU: one decoded token of each, every layer's weights
//! read once for all of them.
//!
//! Each sequence keeps the bits it gets alone: the dense products run the one-token kernels
//! with the one-token split of every row (the tensor-core kernel takes up to eight vectors a
//! block and runs each through the same operations, ops.rs `qmv_stacked_n`); the experts run
//! per token, or with `CudaModel::grouped` decode each weight tile once for two tokens that
//! use it (grouped.rs); the norms, top-k and the mixers run per token as in a one-token
//! step, the mixers on each sequence's own state through a table of state pointers
//! (kernels/mixers.cu). The step, with the copies of its tokens, positions and table,
//! replays as one CUDA graph per number of sequences.

use brook_core::engine::SeqStep;
use brook_core::model::Logits;
use brook_core::{Error, Result};

use crate::delta::{self, DeltaPrep, DeltaRule, GatedNorm};
use crate::gpu::{Args, DevBuf, Pinned};
use crate::grouped;
use crate::model::CudaModel;
use crate::ops;
use crate::scratch::ATT_SPLITS;
use crate::state::{DevLayer, DeviceSeq, Graph};
use crate::weights::{Mat, MixerGpu};

/// Buffers of the steps of several sequences, sized for `cap` of them.
#[derive(Debug)]
pub(crate) struct BatchBufs {
    /// The captured step for n sequences at `graphs[n]`. First, so the graphs go before the
    /// buffers (and the context the last buffer may take with it).
    graphs: Vec<Option<Graph>>,
    cap: usize,
    /// Staging: tokens (`cap` i32), positions (`cap` i32), then the state table.
    host: Pinned,
    metas: DevBuf,
    /// [layer][sequence][2] device pointers: a DeltaNet layer's conv and recurrent states,
    /// an attention layer's key and value caches.
    table: DevBuf,
    logits: DevBuf,
}

impl BatchBufs {
    pub(crate) fn new(m: &CudaModel, cap: usize) -> Result<BatchBufs> {
        let cfg = m.cfg();
        let layers = cfg.num_hidden_layers;
        Ok(BatchBufs {
            cap,
            host: Pinned::new(&m.gpu, 8 * cap + 16 * layers * cap)?,
            metas: m.gpu.alloc(4 * cap, "positions")?,
            table: m.gpu.alloc(16 * layers * cap, "state table")?,
            logits: m.gpu.alloc(4 * cap * cfg.vocab_size, "logits")?,
            graphs: (0..=cap).map(|_| None).collect(),
        })
    }

    /// GPU memory these buffers take for `cap` sequences (for planning).
    pub(crate) fn bytes(cfg: &brook_core::config::ModelConfig, cap: usize) -> u64 {
        (8 * cap + 16 * cfg.num_hidden_layers * cap + 4 * cap * cfg.vocab_size) as u64
    }
}

impl CudaModel {
    /// Whether [`CudaModel::step_batch`] takes a step of one token from each of these
    /// sequences: two or more, and every expert at a fixed address (resident or mapped).
    pub(crate) fn batchable(&self, n: usize) -> bool {
        n >= 2 && self.batch.is_some() && self.experts.fixed()
    }

    /// Runs a step's parts of one token and its small chunks (those a sequence alone runs a
    /// token at a time, [`crate::CudaOptions::small_chunk`]) as rounds of batched steps:
    /// round r takes token r of every such part that has one, so each token meets the
    /// kernels it meets alone. Longer chunks run one at a time. `Ok(false)`: nothing ran,
    /// as fewer than two parts could share a round or the experts stream.
    pub(crate) fn step_rounds(&mut self, seqs: &mut [SeqStep<'_>]) -> Result<bool> {
        let small = self.opts.small_chunk.max(1);
        let wise = |s: &SeqStep<'_>| s.tokens.len() <= small;
        if !self.batchable(seqs.iter().filter(|s| wise(s)).count()) {
            return Ok(false);
        }
        let rounds = seqs
            .iter()
            .filter(|s| wise(s))
            .map(|s| s.tokens.len())
            .max();
        for r in 0..rounds.unwrap_or(0) {
            let mut round: Vec<SeqStep<'_>> = seqs
                .iter_mut()
                .filter(|s| wise(s) && s.tokens.len() > r)
                .map(|s| {
                    let last = r + 1 == s.tokens.len();
                    // Every token of a call that asked for all; else `Logits::for_chunk`'s rule,
                    // a round being one token.
                    let want = match s.want {
                        Logits::All => Logits::Last,
                        w => w.for_chunk(last),
                    };
                    SeqStep {
                        state: &mut *s.state,
                        tokens: &s.tokens[r..r + 1],
                        want,
                        logits: &mut *s.logits,
                    }
                })
                .collect();
            if let [one] = &mut round[..] {
                // Alone in its round: the one-token step (its CUDA graph), the same bits.
                let want = if one.want == Logits::None {
                    Logits::Last
                } else {
                    one.want
                };
                let mut spare = Vec::new();
                let out = if one.want == Logits::None {
                    &mut spare
                } else {
                    &mut *one.logits
                };
                self.step_one(one.state, one.tokens, want, out)?;
            } else {
                self.step_batch(&mut round)?;
            }
        }
        for s in seqs.iter_mut().filter(|s| !wise(s)) {
            self.step_one(s.state, s.tokens, s.want, s.logits)?;
        }
        Ok(true)
    }

    /// One decoded token for each of `seqs` (states placed on this GPU, one token each).
    pub(crate) fn step_batch(&mut self, seqs: &mut [SeqStep<'_>]) -> Result<()> {
        let n = seqs.len();
        let layers = self.model.cfg.num_hidden_layers;
        let Some(mut b) = self.batch.take() else {
            return Err(Error::Invalid(
                "this CUDA engine takes one sequence a step".into(),
            ));
        };
        let r = (|| {
            if n > b.cap {
                return Err(Error::Invalid(format!(
                    "{n} sequences in one step; this engine was opened for {}",
                    b.cap
                )));
            }
            // Stage the tokens, positions and state pointers.
            let cap = b.cap;
            let buf = b.host.as_mut_slice();
            for (z, s) in seqs.iter_mut().enumerate() {
                let (tok, pos) = (s.tokens[0], s.state.pos);
                buf[4 * z..4 * z + 4].copy_from_slice(&(tok as i32).to_le_bytes());
                let m = 4 * cap + 4 * z;
                buf[m..m + 4].copy_from_slice(&(pos as i32).to_le_bytes());
                let dev = s
                    .state
                    .device
                    .as_mut()
                    .and_then(|d| d.as_any_mut().downcast_mut::<DeviceSeq>())
                    .ok_or_else(|| Error::Invalid("lost the GPU state".into()))?;
                for (i, l) in dev.layers.iter().enumerate() {
                    let (p0, p1) = match l {
                        DevLayer::Linear { conv, ssm } => (conv.ptr, ssm.ptr),
                        DevLayer::Full { k, v } => (k.ptr, v.ptr),
                    };
                    let at = 8 * cap + 16 * (i * cap + z);
                    buf[at..at + 8].copy_from_slice(&p0.to_le_bytes());
                    buf[at + 8..at + 16].copy_from_slice(&p1.to_le_bytes());
                }
            }
            let graphed = self.graphs && b.graphs[n].is_some();
            if !graphed && self.graphs {
                b.graphs[n] = self.capture_batch(&b, n, layers);
                // A capture that failed once fails again: run unrecorded from now on, as the
                // one-sequence steps do.
                self.graphs = b.graphs[n].is_some();
            }
            match &b.graphs[n] {
                // Over the engine's scratch and `b`, which live.
                Some(g) if self.graphs => g.launch(&self.gpu, "launching a batched step")?,
                _ => self.enqueue_batch(&b, n, layers)?,
            }
            let mut parts: Vec<(Logits, &mut Vec<f32>)> =
                seqs.iter_mut().map(|s| (s.want, &mut *s.logits)).collect();
            self.hand_back(b.logits.ptr, &mut parts)?;
            self.syncs += 1;
            self.batched_steps += 1;
            for s in seqs.iter_mut() {
                s.state.pos += 1;
            }
            Ok(())
        })();
        self.batch = Some(b);
        r
    }

    /// The batched step for `n` sequences as a CUDA graph, or `None` (logged) when capture
    /// fails: then it runs unrecorded.
    fn capture_batch(&mut self, b: &BatchBufs, n: usize, layers: usize) -> Option<Graph> {
        let then = "batched steps run unrecorded";
        let gpu = self.gpu.clone();
        Graph::capture(&gpu, then, || self.enqueue_batch(b, n, layers)).unwrap_or_else(|e| {
            tracing::warn!("{e}; {then}");
            None
        })
    }

    /// Queues the staged inputs' copies, every layer and the head for `n` sequences.
    fn enqueue_batch(&self, b: &BatchBufs, n: usize, layers: usize) -> Result<()> {
        let cap = b.cap;
        // SAFETY: pinned host memory untouched until this step's final synchronisation; the
        // device buffers hold `cap` sequences.
        unsafe {
            let h = b.host.ptr();
            self.gpu.copy_in_async(self.s.tokens.ptr, h, 4 * n)?;
            self.gpu.copy_in_async(b.metas.ptr, h.add(4 * cap), 4 * n)?;
            self.gpu
                .copy_in_async(b.table.ptr, h.add(8 * cap), 16 * layers * cap)?;
        }
        self.gpu.overlap_launches(true);
        let s = &self.s;
        let g = &self.gpu;
        let mut a = Args::new();
        a.arg(self.dense.embed).arg(s.tokens.ptr).arg(s.x.ptr);
        g.launch(g.k.embed, (n as u32, 1, 1), 256, 0, &mut a)?;
        let (x, normed, delta) = (s.x.ptr, s.normed.ptr, s.delta.ptr);
        for i in 0..layers {
            let l = &self.dense.layers[i];
            let tab = b.table.ptr + (16 * i * cap) as u64;
            let d = if i == 0 { 0 } else { delta };
            self.norm(x, d, l.input_norm.ptr, normed, n)?;
            self.mixer_batch(&l.mixer, b, n, tab)?;
            self.norm(x, delta, l.post_norm.ptr, normed, n)?;
            self.moe_batch(i, n)?;
        }
        self.norm(x, delta, self.dense.norm.ptr, normed, n)?;
        let head = [self.dense.head, Mat::NONE, Mat::NONE, Mat::NONE];
        ops::qmv_stacked_n(g, head, n, normed, b.logits.ptr)
    }

    /// Layer mixer for `n` sequences of one token, each on its own state (`tab`: this
    /// layer's rows of the state table), reading `normed` and writing `delta`.
    fn mixer_batch(&self, mixer: &MixerGpu, b: &BatchBufs, n: usize, tab: u64) -> Result<()> {
        let model = self.model.clone();
        let cfg = &model.cfg;
        let s = &self.s;
        let g = &self.gpu;
        let (normed, delta) = (s.normed.ptr, s.delta.ptr);
        match mixer {
            MixerGpu::Delta {
                qkv,
                z,
                b: bm,
                a: am,
                out,
                conv_w,
                a_log,
                dt_bias,
                norm,
            } => {
                let (nk, nv, dk, dv) = (
                    cfg.linear_num_key_heads,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                );
                let cd = cfg.conv_dim();
                // Each token's [qkv; z; b; a] row, `stride` floats apart.
                let stride = (qkv.rows + z.rows + bm.rows + am.rows) as usize;
                ops::qmv_stacked_n(g, [*qkv, *z, *bm, *am], n, normed, s.qkv.ptr)?;
                let zp = s.qkv.ptr + (cd * 4) as u64;
                let bp = zp + (z.rows as u64) * 4;
                let ap = bp + (bm.rows as u64) * 4;
                let mut a = Args::new();
                a.arg(s.qkv.ptr)
                    .arg(0u64)
                    .arg(conv_w.ptr)
                    .arg(s.conv.ptr)
                    .arg(1i32)
                    .arg(cd as i32)
                    .arg(cfg.linear_conv_kernel_dim as i32)
                    .arg(stride as i32)
                    .arg(tab);
                let grid = ((cd as u32).div_ceil(128), 1, n as u32);
                g.launch(g.k.conv_silu, grid, 128, 0, &mut a)?;
                let rule = DeltaRule {
                    conv: s.conv.ptr,
                    g: s.g.ptr,
                    beta: s.beta.ptr,
                    state: 0,
                    o: s.o.ptr,
                    t: 1,
                    cd,
                    nk,
                    nv,
                    dk,
                    dv,
                    seqs: tab,
                    nseq: n,
                    prep: Some(DeltaPrep {
                        b: bp,
                        a: ap,
                        a_log: a_log.ptr,
                        dt_bias: dt_bias.ptr,
                        bs: stride as i32,
                    }),
                    prep_in_rule: g.rule_prep,
                    norm: Some(GatedNorm {
                        z: zp,
                        w: norm.ptr,
                        y: s.y.ptr,
                        eps: cfg.rms_norm_eps,
                        zs: stride as i32,
                    }),
                    norm_in_rule: g.rule_norm,
                };
                delta::delta_rule(g, &rule, model.delta_mode)?;
                ops::qmv_stacked_n(
                    g,
                    [*out, Mat::NONE, Mat::NONE, Mat::NONE],
                    n,
                    s.y.ptr,
                    delta,
                )?;
            }
            MixerGpu::Attn {
                q,
                k,
                v,
                o,
                q_norm,
                k_norm,
            } => {
                let (nq, nkv, hd) = (
                    cfg.num_attention_heads as i32,
                    cfg.num_key_value_heads as i32,
                    cfg.head_dim as i32,
                );
                let stride = (q.rows + k.rows + v.rows) as i64;
                ops::qmv_stacked_n(g, [*q, *k, *v, Mat::NONE], n, normed, s.qg.ptr)?;
                let kp = s.qg.ptr + (q.rows as u64) * 4;
                let vp = kp + (k.rows as u64) * 4;
                let gated = cfg.attn_output_gate as i32;
                let mut a = Args::new();
                a.arg(s.qg.ptr)
                    .arg(kp)
                    .arg(vp)
                    .arg(q_norm.ptr)
                    .arg(k_norm.ptr)
                    .arg(s.inv_freq.ptr)
                    .arg(b.metas.ptr)
                    .arg(s.q.ptr)
                    .arg(s.gate.ptr)
                    .arg(0u64)
                    .arg(0u64)
                    .arg(nq)
                    .arg(nkv)
                    .arg(hd)
                    .arg(cfg.rotary_dim as i32)
                    .arg(gated)
                    .arg(cfg.rms_norm_eps)
                    .arg(stride)
                    .arg(tab);
                let grid = (1, (nq + nkv) as u32, n as u32);
                g.launch(g.k.attn_prep, grid, 64, (hd * 4) as u32, &mut a)?;
                let scale = 1.0f32 / (hd as f32).sqrt();
                let mut a = Args::new();
                a.arg(s.q.ptr)
                    .arg(s.gate.ptr)
                    .arg(0u64)
                    .arg(0u64)
                    .arg(b.metas.ptr)
                    .arg(s.att.ptr)
                    .arg(nq)
                    .arg(nkv)
                    .arg(hd)
                    .arg(gated)
                    .arg(scale)
                    .arg(tab)
                    .arg(s.att_part.ptr)
                    .arg(s.att_count.ptr);
                // Each sequence's positions split as they are alone (blocks.rs).
                let smem = ((hd + 128) * 4) as u32;
                let grid = (ATT_SPLITS as u32, nq as u32, n as u32);
                g.launch(g.k.attention_dec, grid, 128, smem, &mut a)?;
                ops::qmv_stacked_n(
                    g,
                    [*o, Mat::NONE, Mat::NONE, Mat::NONE],
                    n,
                    s.att.ptr,
                    delta,
                )?;
            }
        }
        Ok(())
    }

    /// The MoE block of `layer` for `n` tokens, each as the one-token path runs it (blocks.rs
    /// `moe`: fused where the kernels fit, else the plain products and the combination).
    fn moe_batch(&self, layer: usize, n: usize) -> Result<()> {
        let cfg = self.cfg();
        let l = &self.dense.layers[layer];
        let (e, k, i, is) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        let s = &self.s;
        let g = &self.gpu;
        let stack = [l.router, l.shared_expert_gate, Mat::NONE, Mat::NONE];
        ops::qmv_stacked_n(g, stack, n, s.normed.ptr, s.rlog.ptr)?;
        self.topk(n, s.rlog.ptr, e + 1, None, s.sel.ptr, s.wts.ptr, None)?;
        let tab = self
            .experts
            .table_for(layer, s.sel.ptr, n * k, false, None)?;
        let m = self.experts.mats[layer].clone();
        let sg = s.rlog.ptr + (e * 4) as u64;
        let (mats, shared) = (
            [m.gate, m.up, m.down],
            [l.shared_gate, l.shared_up, l.shared_down],
        );
        if self.grouped && grouped::fits(g, mats, shared, k, n) {
            let w = grouped::GroupScratch {
                groups: s.groups.ptr,
                ey: s.ey.ptr,
                so: s.sout.ptr,
            };
            return grouped::moe(
                g,
                mats,
                shared,
                tab,
                s.sel.ptr,
                s.wts.ptr,
                k,
                n,
                sg,
                e + 1,
                s.normed.ptr,
                s.h.ptr,
                s.sh.ptr,
                s.delta.ptr,
                w,
            );
        }
        if !ops::moe_down_fits(&m.down, &l.shared_down, k) {
            let shared = [l.shared_gate, l.shared_up, Mat::NONE, Mat::NONE];
            ops::qmv_stacked_n(g, shared, n, s.normed.ptr, s.sgu.ptr)?;
            self.swiglu(s.sgu.ptr, s.sh.ptr, n, is)?;
            let sdown = [l.shared_down, Mat::NONE, Mat::NONE, Mat::NONE];
            ops::qmv_stacked_n(g, sdown, n, s.sh.ptr, s.sout.ptr)?;
            // Vector j of token t is its expert sel[t·k + j] on x[t].
            let nk = n * k;
            ops::qmv(
                g,
                m.gate,
                m.up,
                tab,
                s.sel.ptr,
                k as i32,
                nk,
                s.normed.ptr,
                s.gu.ptr,
            )?;
            self.swiglu(s.gu.ptr, s.h.ptr, nk, i)?;
            ops::qmv(
                g,
                m.down,
                Mat::NONE,
                tab,
                s.sel.ptr,
                1,
                nk,
                s.h.ptr,
                s.ey.ptr,
            )?;
            return self.combine(n, sg, e + 1);
        }
        ops::qmv_experts(
            g,
            m.gate,
            m.up,
            tab,
            s.sel.ptr,
            k,
            k as i32,
            [l.shared_gate, l.shared_up],
            true,
            n,
            s.normed.ptr,
            s.h.ptr,
            s.sh.ptr,
            None,
        )?;
        ops::moe_down(
            g,
            m.down,
            tab,
            s.sel.ptr,
            s.wts.ptr,
            k,
            l.shared_down,
            sg,
            s.h.ptr,
            s.sh.ptr,
            s.delta.ptr,
            n,
            e + 1,
            None,
        )
    }
}
