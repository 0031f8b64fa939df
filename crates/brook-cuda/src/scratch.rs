//! The CUDA engine's scratch: device buffers for one prefill chunk, sized once.

use std::sync::Arc;

use brook_core::Result;
use brook_core::config::ModelConfig;

use crate::gpu::{DevBuf, Gpu};

/// Blocks a head of a decoded token's attention is split into (kernels/mixers.cu
/// `attention_dec`): each takes a 32th of the visible positions, rounded up to 32.
pub(crate) const ATT_SPLITS: usize = 32;

/// Scratch for chunks of up to `c` tokens and steps of up to `seqs` sequences of one token
/// (batch.rs: their stacked projections keep each token's rows together).
#[derive(Debug)]
pub(crate) struct Scratch {
    pub(crate) x: DevBuf,
    pub(crate) normed: DevBuf,
    pub(crate) delta: DevBuf,
    // DeltaNet
    pub(crate) qkv: DevBuf,
    pub(crate) conv: DevBuf,
    pub(crate) z: DevBuf,
    pub(crate) b: DevBuf,
    pub(crate) a: DevBuf,
    pub(crate) beta: DevBuf,
    pub(crate) g: DevBuf,
    pub(crate) o: DevBuf,
    pub(crate) y: DevBuf,
    // attention
    pub(crate) qg: DevBuf,
    pub(crate) k: DevBuf,
    pub(crate) v: DevBuf,
    pub(crate) q: DevBuf,
    pub(crate) gate: DevBuf,
    pub(crate) att: DevBuf,
    /// The decode attention's splits ([`ATT_SPLITS`] a head and sequence, each its max, sum
    /// and head_dim outputs) and a counter a head and sequence (kernels/mixers.cu
    /// `attention_dec`).
    pub(crate) att_part: DevBuf,
    pub(crate) att_count: DevBuf,
    // MoE
    pub(crate) rlog: DevBuf,
    pub(crate) sel: DevBuf,
    pub(crate) wts: DevBuf,
    pub(crate) counts: DevBuf,
    pub(crate) offs: DevBuf,
    pub(crate) fill: DevBuf,
    pub(crate) pairs: DevBuf,
    /// A batched step's expert groups (kernels/grouped.cu `moe_groups`): four ints a group,
    /// room for every pick alone, then their count.
    pub(crate) groups: DevBuf,
    pub(crate) gu: DevBuf,
    pub(crate) h: DevBuf,
    pub(crate) ey: DevBuf,
    pub(crate) sgu: DevBuf,
    pub(crate) sh: DevBuf,
    pub(crate) sout: DevBuf,
    pub(crate) sg: DevBuf,
    // inputs and outputs
    pub(crate) tokens: DevBuf,
    pub(crate) meta: DevBuf,
    pub(crate) logits: DevBuf,
    /// The greedy picks of up to `seqs` rows of logits (`picks::best_rows`): a key a block of
    /// a row, a counter a row (zero between launches) and the ids.
    pub(crate) best_part: DevBuf,
    pub(crate) best_count: DevBuf,
    pub(crate) best: DevBuf,
    /// The most likely candidates of up to `seqs` rows (`picks::top_rows`): a key a 64-value
    /// block of a row, then `picks::TOP_ROW` floats a row.
    pub(crate) top_keys: DevBuf,
    pub(crate) top: DevBuf,
    pub(crate) inv_freq: DevBuf,
}

impl Scratch {
    pub(crate) fn new(gpu: &Arc<Gpu>, cfg: &ModelConfig, c: usize, seqs: usize) -> Result<Scratch> {
        let c = c.max(seqs);
        let f = |n: usize, what: &str| gpu.alloc(n * 4, what);
        let h = cfg.hidden_size;
        let (nv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
        let cd = cfg.conv_dim();
        let (nq, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (e, k, i) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
        );
        let is = cfg.shared_expert_intermediate_size;
        let inv = brook_core::cpu::kernels::ops::rope_inv_freq(cfg);
        Ok(Scratch {
            x: f(c * h, "activations")?,
            normed: f(c * h, "activations")?,
            delta: f(c * h, "activations")?,
            // One-token steps put z, b and a after qkv, k and v after the queries and the
            // shared expert's gate after the router logits (one launch each).
            qkv: f(
                (c * cd + nv * dv + 2 * nv).max(seqs * (cd + nv * dv + 2 * nv)),
                "DeltaNet scratch",
            )?,
            conv: f(c * cd, "DeltaNet scratch")?,
            z: f(c * nv * dv, "DeltaNet scratch")?,
            b: f(c * nv + nv, "DeltaNet scratch")?,
            a: f(c * nv, "DeltaNet scratch")?,
            beta: f(c * nv, "DeltaNet scratch")?,
            g: f(c * nv, "DeltaNet scratch")?,
            o: f(c * nv * dv, "DeltaNet scratch")?,
            y: f(c * nv * dv, "DeltaNet scratch")?,
            qg: f(
                (c * nq * hd * 2 + 2 * nkv * hd).max(seqs * (2 * nq * hd + 2 * nkv * hd)),
                "attention scratch",
            )?,
            k: f(c * nkv * hd, "attention scratch")?,
            v: f(c * nkv * hd, "attention scratch")?,
            q: f(c * nq * hd, "attention scratch")?,
            gate: f(c * nq * hd, "attention scratch")?,
            att: f(c * nq * hd, "attention scratch")?,
            att_part: f(
                seqs.max(1) * nq * ATT_SPLITS * (hd + 2),
                "attention scratch",
            )?,
            att_count: gpu.zeros(seqs.max(1) * nq * 4, "attention scratch")?,
            rlog: f((c * e + 1).max(seqs * (e + 1)), "router scratch")?,
            sel: f(c * k, "router scratch")?,
            wts: f(c * k, "router scratch")?,
            counts: f(e, "router scratch")?,
            offs: f(e, "router scratch")?,
            fill: f(e, "router scratch")?,
            pairs: f(c * k, "router scratch")?,
            groups: f(4 * c * k + 1, "router scratch")?,
            gu: f(c * k * 2 * i, "expert scratch")?,
            h: f(c * k * i, "expert scratch")?,
            ey: f(c * k * h, "expert scratch")?,
            sgu: f(c * 2 * is, "shared expert scratch")?,
            sh: f(c * is, "shared expert scratch")?,
            sout: f(c * h, "shared expert scratch")?,
            sg: f(c, "shared expert scratch")?,
            tokens: f(c, "tokens")?,
            meta: f(4, "positions")?,
            logits: f(cfg.vocab_size, "logits")?,
            best_part: gpu.alloc(seqs.max(1) * crate::picks::BEST_BLOCKS * 8, "greedy picks")?,
            best_count: gpu.zeros(seqs.max(1) * 4, "greedy picks")?,
            best: f(seqs.max(1), "greedy picks")?,
            top_keys: f(seqs.max(1) * cfg.vocab_size.div_ceil(64), "candidates")?,
            top: f(seqs.max(1) * crate::picks::TOP_ROW, "candidates")?,
            inv_freq: gpu.upload(&inv, "RoPE frequencies")?,
        })
    }
}
