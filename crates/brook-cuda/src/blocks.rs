//! The blocks of one layer on the GPU, queued by [`CudaModel`]: the Gated DeltaNet mixer,
//! gated attention with the KV cache, and the MoE block (router, top-k, shared expert and
//! routed experts, streamed ones made resident first).

use brook_core::Result;
use brook_core::config::ModelConfig;

use crate::delta::{self, DeltaPrep, DeltaRule, GatedNorm};
use crate::experts::ReadyFlags;
use crate::gpu::{Args, DevBuf};
use crate::model::CudaModel;
use crate::ops;
use crate::scratch::ATT_SPLITS;
use crate::weights::Mat;

impl CudaModel {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn delta_net(
        &self,
        cfg: &ModelConfig,
        t: usize,
        qkv: Mat,
        z: Mat,
        b: Mat,
        am: Mat,
        out: Mat,
        conv_w: &DevBuf,
        a_log: &DevBuf,
        dt_bias: &DevBuf,
        norm: &DevBuf,
        conv: &DevBuf,
        ssm: &DevBuf,
    ) -> Result<()> {
        let s = &self.s;
        let g = &self.gpu;
        let (nk, nv, dk, dv) = (
            cfg.linear_num_key_heads as i32,
            cfg.linear_num_value_heads as i32,
            cfg.linear_key_head_dim as i32,
            cfg.linear_value_head_dim as i32,
        );
        let cd = cfg.conv_dim() as i32;
        let (zp, bp, ap) = if t == 1 {
            // One launch: [qkv; z; b; a] follow each other in the qkv scratch.
            ops::qmv_stacked(g, [qkv, z, b, am], s.normed.ptr, s.qkv.ptr)?;
            let zp = s.qkv.ptr + cd as u64 * 4;
            let bp = zp + z.rows as u64 * 4;
            (zp, bp, bp + nv as u64 * 4)
        } else {
            self.product(qkv, Mat::NONE, t, s.normed.ptr, s.qkv.ptr)?;
            self.product(z, Mat::NONE, t, s.normed.ptr, s.z.ptr)?;
            self.product(b, Mat::NONE, t, s.normed.ptr, s.b.ptr)?;
            self.product(am, Mat::NONE, t, s.normed.ptr, s.a.ptr)?;
            (s.z.ptr, s.b.ptr, s.a.ptr)
        };
        let mut a = Args::new();
        a.arg(s.qkv.ptr)
            .arg(conv.ptr)
            .arg(conv_w.ptr)
            .arg(s.conv.ptr)
            .arg(t as i32)
            .arg(cd)
            .arg(cfg.linear_conv_kernel_dim as i32)
            .arg(cd)
            .arg(0u64);
        g.launch(
            g.k.conv_silu,
            ((cd as u32).div_ceil(128), 1, 1),
            128,
            0,
            &mut a,
        )?;
        let rule = DeltaRule {
            conv: s.conv.ptr,
            g: s.g.ptr,
            beta: s.beta.ptr,
            state: ssm.ptr,
            o: s.o.ptr,
            t,
            cd: cd as usize,
            nk: nk as usize,
            nv: nv as usize,
            dk: dk as usize,
            dv: dv as usize,
            seqs: 0,
            nseq: 1,
            prep: Some(DeltaPrep {
                b: bp,
                a: ap,
                a_log: a_log.ptr,
                dt_bias: dt_bias.ptr,
                bs: nv,
            }),
            prep_in_rule: g.rule_prep,
            norm: Some(GatedNorm {
                z: zp,
                w: norm.ptr,
                y: s.y.ptr,
                eps: cfg.rms_norm_eps,
                zs: nv * dv,
            }),
            norm_in_rule: g.rule_norm,
        };
        delta::delta_rule(g, &rule, self.model.delta_mode)?;
        self.product(out, Mat::NONE, t, s.y.ptr, s.delta.ptr)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        cfg: &ModelConfig,
        t: usize,
        q: Mat,
        k: Mat,
        v: Mat,
        o: Mat,
        q_norm: &DevBuf,
        k_norm: &DevBuf,
        kc: &DevBuf,
        vc: &DevBuf,
    ) -> Result<()> {
        let s = &self.s;
        let g = &self.gpu;
        let (nq, nkv, hd) = (
            cfg.num_attention_heads as i32,
            cfg.num_key_value_heads as i32,
            cfg.head_dim as i32,
        );
        let gated = cfg.attn_output_gate as i32;
        let (kp, vp) = if t == 1 {
            // One launch: [q; k; v] follow each other in the qg scratch.
            ops::qmv_stacked(g, [q, k, v, Mat::NONE], s.normed.ptr, s.qg.ptr)?;
            let kp = s.qg.ptr + q.rows as u64 * 4;
            (kp, kp + k.rows as u64 * 4)
        } else {
            self.product(q, Mat::NONE, t, s.normed.ptr, s.qg.ptr)?;
            self.product(k, Mat::NONE, t, s.normed.ptr, s.k.ptr)?;
            self.product(v, Mat::NONE, t, s.normed.ptr, s.v.ptr)?;
            (s.k.ptr, s.v.ptr)
        };
        let mut a = Args::new();
        a.arg(s.qg.ptr)
            .arg(kp)
            .arg(vp)
            .arg(q_norm.ptr)
            .arg(k_norm.ptr)
            .arg(s.inv_freq.ptr)
            .arg(s.meta.ptr)
            .arg(s.q.ptr)
            .arg(s.gate.ptr)
            .arg(kc.ptr)
            .arg(vc.ptr)
            .arg(nq)
            .arg(nkv)
            .arg(hd)
            .arg(cfg.rotary_dim as i32)
            .arg(gated)
            .arg(cfg.rms_norm_eps)
            .arg(0i64)
            .arg(0u64);
        g.launch(
            g.k.attn_prep,
            (t as u32, (nq + nkv) as u32, 1),
            64,
            (hd * 4) as u32,
            &mut a,
        )?;
        let scale = 1.0f32 / (hd as f32).sqrt();
        let mut a = Args::new();
        a.arg(s.q.ptr)
            .arg(s.gate.ptr)
            .arg(kc.ptr)
            .arg(vc.ptr)
            .arg(s.meta.ptr)
            .arg(s.att.ptr)
            .arg(nq)
            .arg(nkv)
            .arg(hd)
            .arg(gated)
            .arg(scale)
            .arg(0u64);
        let smem = ((hd + 128) * 4) as u32;
        if t == 1 {
            // A decoded token: its positions split over blocks (batch.rs the same).
            a.arg(s.att_part.ptr).arg(s.att_count.ptr);
            g.launch(
                g.k.attention_dec,
                (ATT_SPLITS as u32, nq as u32, 1),
                128,
                smem,
                &mut a,
            )?;
        } else {
            g.launch(g.k.attention, (t as u32, nq as u32, 1), 128, smem, &mut a)?;
        }
        self.product(o, Mat::NONE, t, s.att.ptr, s.delta.ptr)
    }

    /// Where the experts are mapped, a one-token step not replaying a routing, and the
    /// prefetch is on: guesses the picks of `layer` before its mixer runs (the stream
    /// entering the layer, normed by its post-mixer norm, through its router and top-k) and
    /// gathers the likeliest mapped ones (at most `switches::prefetch_cap`) on the side
    /// stream while the mixer computes, so that the link, idle during the mixer, carries
    /// them; the MoE block takes the right guesses from there. On the synthetic 35B such
    /// guesses name 87% of the picks (docs/bench/2026-11-30-to-12-02.md, "Prefetch, again");
    /// copying only the first two keeps the wrong ones' cost small.
    /// Says whether it queued one.
    pub(crate) fn prefetch_experts(
        &self,
        cfg: &ModelConfig,
        layer: usize,
        t: usize,
    ) -> Result<bool> {
        let replaying = self.given.as_ref().is_some_and(|g| g.on);
        let Some(q) = self
            .experts
            .guess()
            .filter(|_| self.prefetch && t == 1 && !replaying)
        else {
            return Ok(false);
        };
        let l = &self.dense.layers[layer];
        let (normed, logits, sel, wts) = (q.normed.ptr, q.logits.ptr, q.sel.ptr, q.wts.ptr);
        self.norm(self.s.x.ptr, 0, l.post_norm.ptr, normed, 1)?;
        self.gpu.fork()?;
        let queued = (|| {
            self.linear(l.router, Mat::NONE, 1, normed, logits)?;
            self.topk(1, logits, cfg.num_experts, None, sel, wts, None)?;
            self.experts.prefetch(layer)
        })();
        let joined = self.gpu.join_record();
        queued?;
        joined?;
        Ok(true)
    }

    /// The top-k of `rows` rows of router logits at `logits` (`stride` floats apart): expert
    /// ids to `sel`, their weights to `wts` ([rows][k] each). `given`: a replayed routing's
    /// [rows][k] ids on the GPU, taken instead of the largest logits. `zero`: flags of the
    /// gather that follows, set to 0 first ([`ReadyFlags`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn topk(
        &self,
        rows: usize,
        logits: u64,
        stride: usize,
        given: Option<u64>,
        sel: u64,
        wts: u64,
        zero: Option<&ReadyFlags>,
    ) -> Result<()> {
        let cfg = self.cfg();
        let e = cfg.num_experts;
        let mut a = Args::new();
        a.arg(logits)
            .arg(e as i32)
            .arg(stride as i32)
            .arg(cfg.num_experts_per_tok as i32)
            .arg(cfg.norm_topk_prob as i32);
        if let Some(ptr) = given {
            a.arg(ptr);
        }
        a.arg(sel).arg(wts);
        a.arg(zero.map_or(0, |f| f.ptr))
            .arg(zero.map_or(0, |_| ReadyFlags::WORDS) as i32);
        let kernel = if given.is_some() {
            self.gpu.k.topk_given
        } else {
            self.gpu.k.topk
        };
        self.gpu
            .launch(kernel, (rows as u32, 1, 1), 32, (e * 4) as u32, &mut a)
    }

    /// The MoE block of `layer` on `normed`, writing `delta`.
    pub(crate) fn moe(&mut self, cfg: &ModelConfig, layer: usize, t: usize) -> Result<()> {
        let l = &self.dense.layers[layer];
        let (router, sgate, sup, sdown, seg) = (
            l.router,
            l.shared_gate,
            l.shared_up,
            l.shared_down,
            l.shared_expert_gate,
        );
        let (e, k, i, is) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        let (normed, rlog, sel, wts) = (
            self.s.normed.ptr,
            self.s.rlog.ptr,
            self.s.sel.ptr,
            self.s.wts.ptr,
        );
        let sg = if t == 1 {
            self.linear(router, seg, 1, normed, rlog)?;
            rlog + e as u64 * 4
        } else {
            self.product(router, Mat::NONE, t, normed, rlog)?;
            self.product(seg, Mat::NONE, t, normed, self.s.sg.ptr)?;
            self.s.sg.ptr
        };
        // A replayed routing's experts for this layer: [t][k] ids on the GPU.
        let given = self
            .given
            .as_ref()
            .filter(|g| g.on && g.tokens == t)
            .map(|g| g.dev.ptr + (layer * t * k * 4) as u64);
        let m = self.experts.mats[layer].clone();
        let fused = t == 1 && ops::moe_down_fits(&m.down, &sdown, k);
        // One token's mapped experts: the products run beside their gather, waiting on its
        // flags (both on the tensor cores, whose _ready forms wait on them).
        let flags = self.experts.ready_flags(k).filter(|_| {
            fused
                && ops::swiglu_tc_fits(&self.gpu, m.gate, m.up, [sgate, sup])
                && ops::down_tc_fits(&self.gpu, m.down, sdown, k)
        });
        self.topk(t, rlog, e, given, sel, wts, flags.as_ref())?;
        let prefetched = std::mem::take(&mut self.prefetched);
        if prefetched {
            self.gpu.join_wait()?;
        }
        let tab = self
            .experts
            .table_for(layer, sel, t * k, prefetched, flags.as_ref())?;
        let (gu, hb, ey) = (self.s.gu.ptr, self.s.h.ptr, self.s.ey.ptr);
        if t == 1 && !self.experts.fixed() {
            // Replayed routes too are read back from the GPU, as the router's would be, so a
            // replay waits as a real routing does.
            let mut ids = vec![0i32; k];
            let t0 = std::time::Instant::now();
            self.gpu.copy_out(sel, &mut ids)?;
            self.route_s += t0.elapsed().as_secs_f64();
            self.syncs += 1;
            let mut ids: Vec<usize> = ids.iter().map(|&x| x as usize).collect();
            ids.sort_unstable();
            ids.dedup();
            self.experts.prepare(&self.model, layer, &ids)?;
        }
        if fused {
            // Two launches: every gate/up with SwiGLU (routed and shared), then every down
            // projection and the weighted sum.
            let sh = self.s.sh.ptr;
            ops::qmv_experts(
                &self.gpu,
                m.gate,
                m.up,
                tab,
                sel,
                k,
                k as i32,
                [sgate, sup],
                true,
                1,
                normed,
                hb,
                sh,
                flags.map(|f| (f.ptr, f.need)),
            )?;
            return ops::moe_down(
                &self.gpu,
                m.down,
                tab,
                sel,
                wts,
                k,
                sdown,
                sg,
                hb,
                sh,
                self.s.delta.ptr,
                1,
                0,
                flags.map(|f| (f.down(), f.need)),
            );
        }
        self.product(sgate, sup, t, normed, self.s.sgu.ptr)?;
        self.swiglu(self.s.sgu.ptr, self.s.sh.ptr, t, is)?;
        self.product(sdown, Mat::NONE, t, self.s.sh.ptr, self.s.sout.ptr)?;
        if t == 1 {
            ops::qmv(&self.gpu, m.gate, m.up, tab, sel, k as i32, k, normed, gu)?;
            self.swiglu(gu, hb, k, i)?;
            ops::qmv(&self.gpu, m.down, Mat::NONE, tab, sel, 1, k, hb, ey)?;
        } else {
            let (counts, offs, fill, pairs) = (
                self.s.counts.ptr,
                self.s.offs.ptr,
                self.s.fill.ptr,
                self.s.pairs.ptr,
            );
            self.s.counts.zero()?;
            let n = (t * k) as i32;
            let mut a = Args::new();
            a.arg(sel).arg(n).arg(counts);
            self.gpu.launch(
                self.gpu.k.moe_count,
                ((n as u32).div_ceil(256), 1, 1),
                256,
                0,
                &mut a,
            )?;
            let mut a = Args::new();
            a.arg(counts).arg(e as i32).arg(offs).arg(fill);
            self.gpu
                .launch(self.gpu.k.moe_offsets, (1, 1, 1), 32, 0, &mut a)?;
            let mut a = Args::new();
            a.arg(sel).arg(n).arg(offs).arg(fill).arg(pairs);
            self.gpu.launch(
                self.gpu.k.moe_fill,
                ((n as u32).div_ceil(256), 1, 1),
                256,
                0,
                &mut a,
            )?;
            let batches: Vec<Vec<usize>> = if self.experts.fixed() {
                vec![Vec::new()]
            } else {
                let mut c = vec![0i32; e];
                self.gpu.copy_out(counts, &mut c)?;
                self.syncs += 1;
                let needed: Vec<usize> = (0..e).filter(|&x| c[x] > 0).collect();
                needed
                    .chunks(self.experts.nslots.max(1))
                    .map(|b| b.to_vec())
                    .collect()
            };
            for ids in &batches {
                if !self.experts.fixed() {
                    self.experts.prepare(&self.model, layer, ids)?;
                }
                let (g, tc) = (&self.gpu, self.prefill_tc);
                ops::qmm(
                    g, m.gate, m.up, tab, counts, offs, pairs, k as i32, t, normed, gu, e, tc,
                )?;
                self.swiglu(gu, hb, t * k, i)?;
                ops::qmm(
                    g,
                    m.down,
                    Mat::NONE,
                    tab,
                    counts,
                    offs,
                    pairs,
                    1,
                    t,
                    hb,
                    ey,
                    e,
                    tc,
                )?;
            }
        }
        self.combine(t, sg, 1)
    }

    /// delta[t] = Σ_k wts[t, k]·ey[t·k + k] + sigmoid(sg[t·sg_stride])·sout[t] for `t` tokens.
    pub(crate) fn combine(&self, t: usize, sg: u64, sg_stride: usize) -> Result<()> {
        let cfg = self.cfg();
        let (k, h) = (cfg.num_experts_per_tok, cfg.hidden_size);
        let s = &self.s;
        let mut a = Args::new();
        a.arg(s.ey.ptr)
            .arg(s.wts.ptr)
            .arg(s.sout.ptr)
            .arg(sg)
            .arg(s.delta.ptr)
            .arg(t as i32)
            .arg(k as i32)
            .arg(h as i32)
            .arg(sg_stride as i32);
        let total = (t * h) as u32;
        self.gpu.launch(
            self.gpu.k.moe_combine,
            (total.div_ceil(256), 1, 1),
            256,
            0,
            &mut a,
        )
    }
}
