//! A step of several sequences on [`CpuModel`] (issue #32's batched decoding): the row
//! layout, which products run together, and each sequence's mixer on its own state. Split
//! from `engine.rs`, whose one-sequence path it mirrors; docs/CPU.md, "Steps of several
//! sequences", says why each sequence keeps its bits.

use super::{CpuModel, Span};
use crate::cpu::blocks::exec::Exec;
use crate::cpu::blocks::mixer::{self, Ssm};
use crate::cpu::blocks::moe;
use crate::cpu::kernels::ops::{add, rms_norm_rows};
use crate::cpu::state::Bf16Ssm;
use crate::engine::{Routing, SeqStep};
use crate::error::{Error, Result};
use crate::model::state::{LayerState, SeqState};
use crate::model::weights::Mixer;
use crate::model::{Logits, Model};

impl CpuModel<'_> {
    /// A step of several sequences: their rows go through the layers together, single tokens
    /// first. Every result is what the sequence would get in a step of its own: the single
    /// tokens' products take the one-token kernel row by row (each weight block read from
    /// memory once for all of them) and their MoE the one-token path; each chunk's products
    /// and MoE run on its rows alone; every sequence's mixer runs on its own state. So the
    /// bits do not depend on what runs beside a sequence (tests/cpu_batch.rs).
    pub(super) fn step_seqs(
        &mut self,
        seqs: &mut [SeqStep<'_>],
        routing: Routing<'_>,
    ) -> Result<()> {
        let model_ref = self.model.clone();
        let model: &Model = &model_ref;
        let (h, cfg) = (model.cfg.hidden_size, &model.cfg);
        let total: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let chunks = seqs.iter().filter(|s| s.tokens.len() > 1).count();
        let singles = seqs.len() - chunks;
        if seqs.len() > self.opts.max_seqs
            || total > self.x.len() / h
            || seqs.iter().any(|s| s.tokens.len() > self.opts.max_chunk)
        {
            return Err(Error::Invalid(format!(
                "a step of {} sequences and {total} tokens exceeds the engine's {} sequences of at most {} tokens",
                seqs.len(),
                self.opts.max_seqs,
                self.opts.max_chunk
            )));
        }
        self.rows.clear();
        let mut at = 0;
        for pass in [true, false] {
            for (i, s) in seqs.iter().enumerate() {
                let n = s.tokens.len();
                if (n == 1) == pass {
                    self.rows.push(Span {
                        seq: i,
                        rows: at..at + n,
                    });
                    at += n;
                }
            }
        }
        let ex = Exec {
            pool: &self.pool,
            level: self.level,
            precision: self.opts.precision,
        };
        let (x, normed, delta) = (
            &mut self.x[..total * h],
            &mut self.normed[..total * h],
            &mut self.delta[..total * h],
        );
        for sp in &self.rows {
            let s = &seqs[sp.seq];
            for (row, &tok) in x[sp.rows.start * h..sp.rows.end * h]
                .chunks_exact_mut(h)
                .zip(s.tokens)
            {
                model.dense.embed_tokens.row(tok as usize, row)?;
            }
        }
        // The groups of rows whose products run together: the single tokens (the one-token
        // kernels, row by row), then every chunk (the chunk kernels, whose rows do not mix).
        let groups: Vec<std::ops::Range<usize>> = [0..singles, singles..self.rows.len()]
            .into_iter()
            .filter(|g| !g.is_empty())
            .collect();
        let eps = cfg.rms_norm_eps;
        // Each single token starts reading its layer's likely experts while the mixers run, as
        // a step of its own does (`Pass::prefetch`); a chunk needs nearly every expert anyway.
        let prefetch = model.prefetch && singles > 0 && matches!(routing, Routing::Router);
        for (i, layer) in model.dense.layers.iter().enumerate() {
            if prefetch {
                let rows = 0..self.rows[singles - 1].rows.end * h;
                let ln = &layer.post_attention_layernorm;
                rms_norm_rows(
                    ex.level,
                    &x[rows.clone()],
                    ln,
                    eps,
                    &mut normed[rows.clone()],
                );
                let experts = model.experts.as_ref();
                for row in normed[rows].chunks_exact(h) {
                    moe::prefetch_next(&ex, &layer.mlp, cfg, experts, i, row, &mut self.moe)?;
                }
            }
            rms_norm_rows(ex.level, x, &layer.input_layernorm, eps, normed);
            for g in &groups {
                let rows = self.rows[g.start].rows.start..self.rows[g.end - 1].rows.end;
                let rowwise = g.start < singles && g.len() > 1;
                let (xn, out) = (
                    &normed[rows.start * h..rows.end * h],
                    &mut delta[rows.start * h..rows.end * h],
                );
                let spans = &self.rows[g.clone()];
                let mix = MixerArgs {
                    layer: i,
                    cfg,
                    conv_t: &self.conv_t[i],
                    inv_freq: &self.inv_freq,
                    rowwise,
                };
                group_mixer(&ex, &layer.mixer, &mix, seqs, spans, xn, out, &mut self.mix)?;
            }
            add(ex.level, delta, x);
            rms_norm_rows(ex.level, x, &layer.post_attention_layernorm, eps, normed);
            let experts = model.experts.as_ref();
            match routing {
                // Each group in one pass: the single tokens as one job of the one-token
                // schedule (each expert read once for all of them), the chunks through the
                // chunk path over all their rows (the MoE holds no state).
                Routing::Router => {
                    for g in &groups {
                        let rows =
                            self.rows[g.start].rows.start * h..self.rows[g.end - 1].rows.end * h;
                        let (xn, out) = (&normed[rows.clone()], &mut delta[rows]);
                        let (mlp, moe) = (&layer.mlp, &mut self.moe);
                        if g.start < singles {
                            moe::forward_tokens(&ex, mlp, cfg, experts, i, xn, out, moe)?;
                        } else {
                            moe::forward(&ex, mlp, cfg, experts, i, xn, out, moe, None)?;
                        }
                    }
                }
                // A replayed routing names each sequence's experts: one part at a time.
                Routing::Given(gr) => {
                    for sp in &self.rows {
                        let rows = sp.rows.start * h..sp.rows.end * h;
                        let (xn, out) = (&normed[rows.clone()], &mut delta[rows]);
                        let given = Some((gr, sp.seq));
                        moe::forward(
                            &ex,
                            &layer.mlp,
                            cfg,
                            experts,
                            i,
                            xn,
                            out,
                            &mut self.moe,
                            given,
                        )?;
                    }
                }
            }
            add(ex.level, delta, x);
        }
        rms_norm_rows(ex.level, x, &model.dense.norm, eps, normed);
        for s in seqs.iter_mut() {
            s.state.pos += s.tokens.len();
        }
        // The head: the single tokens' logits together, row by row; each chunk's apart (only
        // the rows it wants).
        let head = Head {
            model,
            spans: &self.rows,
            singles,
        };
        head.logits(&ex, &groups, normed, seqs, &mut self.logits, &mut self.head)?;
        Ok(())
    }
}

/// What a group's mixer needs beside the rows: the layer, the model's shapes, the conv
/// weights transposed (DeltaNet) and RoPE's frequencies (attention), and whether the group's
/// single tokens run the one-token kernels row by row.
struct MixerArgs<'a> {
    layer: usize,
    cfg: &'a crate::config::ModelConfig,
    conv_t: &'a [f32],
    inv_freq: &'a [f64],
    rowwise: bool,
}

/// One group's mixer of layer `m.layer`: each sequence of `spans` on its own state, its rows
/// of `xn` (the group's rows, from the first span's) into the same rows of `out`.
#[allow(clippy::too_many_arguments)]
fn group_mixer(
    ex: &Exec<'_>,
    mixer: &Mixer,
    m: &MixerArgs<'_>,
    seqs: &mut [SeqStep<'_>],
    spans: &[Span],
    xn: &[f32],
    out: &mut [f32],
    mix: &mut crate::cpu::blocks::mixer::MixerScratch,
) -> Result<()> {
    // Each sequence of the group, in sequence order, with its rows within the group.
    let base = spans.first().map_or(0, |sp| sp.rows.start);
    let parts = seqs.iter_mut().enumerate().filter_map(|(si, s)| {
        let sp = spans.iter().find(|sp| sp.seq == si)?;
        Some((sp.rows.start - base..sp.rows.end - base, s))
    });
    match mixer {
        Mixer::Linear(w) => {
            let mut states = Vec::with_capacity(spans.len());
            for (rows, s) in parts {
                let SeqState {
                    pos,
                    layers,
                    device,
                } = &mut *s.state;
                let held = Bf16Ssm::in_slot(device);
                let LayerState::Linear { conv, ssm } = &mut layers[m.layer] else {
                    return Err(Error::Invalid(format!(
                        "state does not fit layer {}",
                        m.layer
                    )));
                };
                let ssm = match held {
                    Some(hd) => Ssm::Bf16(&mut hd.layers[m.layer]),
                    None => Ssm::F32(ssm),
                };
                states.push(mixer::SeqRows {
                    rows,
                    pos: *pos,
                    state: (&mut conv[..], ssm),
                });
            }
            mixer::delta_net_seqs(ex, w, m.cfg, m.conv_t, &mut states, xn, out, m.rowwise, mix)?;
        }
        Mixer::Full(w) => {
            let mut states = Vec::with_capacity(spans.len());
            for (rows, s) in parts {
                let st = &mut *s.state;
                let pos = st.pos;
                let LayerState::Full { keys, values } = &mut st.layers[m.layer] else {
                    return Err(Error::Invalid(format!(
                        "state does not fit layer {}",
                        m.layer
                    )));
                };
                states.push(mixer::SeqRows {
                    rows,
                    pos,
                    state: (keys, values),
                });
            }
            mixer::attention_seqs(
                ex,
                w,
                m.cfg,
                m.inv_freq,
                &mut states,
                xn,
                out,
                m.rowwise,
                mix,
            )?;
        }
    }
    Ok(())
}

/// The head of a several-sequence step: the final norm's rows (`normed`) of every sequence
/// whose part wants logits, onto its `logits`.
struct Head<'a> {
    model: &'a Model,
    /// The step's row layout, its first `singles` the single tokens.
    spans: &'a [Span],
    singles: usize,
}

impl Head<'_> {
    /// The single tokens' logits together, row by row; each chunk's apart (only the rows it
    /// wants), through `logits` as scratch.
    fn logits(
        &self,
        ex: &Exec<'_>,
        groups: &[std::ops::Range<usize>],
        normed: &[f32],
        seqs: &mut [SeqStep<'_>],
        logits: &mut Vec<f32>,
        head_buf: &mut crate::cpu::blocks::exec::XScratch,
    ) -> Result<()> {
        let singles = self.singles;
        let h = self.model.cfg.hidden_size;
        let (v, head) = (self.model.cfg.vocab_size, self.model.dense.lm_head.view());
        for g in groups {
            let first = &self.spans[g.start];
            if g.start < singles {
                let n = g.len();
                if logits.len() < n * v {
                    logits.resize(n * v, 0.0);
                }
                let xs = &normed[first.rows.start * h..(first.rows.start + n) * h];
                let out = &mut [(head, &mut logits[..n * v])];
                ex.linears_rowwise(n > 1, xs, n, head_buf, out)?;
                for (j, sp) in self.spans[g.clone()].iter().enumerate() {
                    let s = &mut seqs[sp.seq];
                    if s.want != Logits::None {
                        s.logits.extend_from_slice(&logits[j * v..(j + 1) * v]);
                    }
                }
            } else {
                for sp in &self.spans[g.clone()] {
                    let s = &mut seqs[sp.seq];
                    let rows = match s.want {
                        Logits::All => sp.rows.clone(),
                        Logits::Last | Logits::Best | Logits::Top(_) => {
                            sp.rows.end - 1..sp.rows.end
                        }
                        Logits::None => continue,
                    };
                    let n = rows.len();
                    if logits.len() < n * v {
                        logits.resize(n * v, 0.0);
                    }
                    ex.linears(
                        &normed[rows.start * h..rows.end * h],
                        n,
                        head_buf,
                        &mut [(head, &mut logits[..n * v])],
                    )?;
                    s.logits.extend_from_slice(&logits[..n * v]);
                }
            }
        }
        Ok(())
    }
}
