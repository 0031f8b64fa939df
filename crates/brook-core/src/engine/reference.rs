//! [`Reference`]: the f32 reference pass as an engine (`--backend reference`).
//!
//! Plain loops in f32 over `crate::model`'s layer maths, allocation allowed: the oracle the
//! CPU and CUDA engines are tested against, itself tested against mlx-lm's fixtures. A
//! decoder layer reads as mlx-lm's `DecoderLayer.__call__` in qwen3_next.py:
//! `h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))`.

use crate::engine::{Caps, Engine, Forward, ModelRef, Step, Trace};
use crate::error::{Error, Result};
use crate::model::moe::{self, Route};
use crate::model::state::{LayerState, SeqState};
use crate::model::weights::{LayerWeights, Mixer};
use crate::model::{Logits, Model, Stage, attention, delta_net, norm_rows};

/// The reference pass over a model.
#[derive(Debug)]
pub struct Reference<'m> {
    model: ModelRef<'m>,
}

impl<'m> Reference<'m> {
    pub fn new(model: &'m Model) -> Self {
        Reference {
            model: ModelRef::Borrowed(model),
        }
    }
}

impl Reference<'static> {
    pub fn shared(model: std::sync::Arc<Model>) -> Self {
        Reference {
            model: ModelRef::Shared(model),
        }
    }
}

impl Engine for Reference<'_> {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn model(&self) -> &Model {
        &self.model
    }

    fn caps(&self) -> Caps {
        Caps {
            max_chunk: self.model.prefill_chunk.max(1),
            // Sequences run one after another: any number.
            max_seqs: usize::MAX,
            max_tokens: usize::MAX,
            given_routes: false,
            trace: true,
        }
    }

    fn place(&mut self, state: &mut SeqState, _tokens: usize) -> Result<()> {
        state.sync_host()
    }

    fn step(&mut self, step: Step<'_, '_>) -> Result<()> {
        let Step {
            seqs, mut trace, ..
        } = step;
        for s in seqs.iter_mut() {
            let logits = chunk(&self.model, s.state, s.tokens, s.want, &mut trace)?;
            s.logits.extend_from_slice(&logits);
        }
        Ok(())
    }
}

/// Embedding, every decoder layer, the final norm and the logits asked for, for one chunk.
fn chunk(
    model: &Model,
    state: &mut SeqState,
    tokens: &[u32],
    want: Logits,
    trace: &mut Trace<'_>,
) -> Result<Vec<f32>> {
    let cfg = &model.cfg;
    let (h, v, t) = (cfg.hidden_size, cfg.vocab_size, tokens.len());
    let mut x = vec![0.0; t * h]; // [T, H] residual stream
    for (row, &tok) in x.chunks_exact_mut(h).zip(tokens) {
        model.dense.embed_tokens.row(tok as usize, row)?;
    }
    if let Some(f) = trace.as_mut() {
        f(Stage::Embed(&x));
    }
    let pos = state.pos;
    let mut normed = vec![0.0; t * h]; // [T, H]
    let mut delta = vec![0.0; t * h]; // [T, H] a sub-block's output
    for (i, (layer, ls)) in model.dense.layers.iter().zip(&mut state.layers).enumerate() {
        let bufs = (&mut normed[..], &mut delta[..]);
        let routes = decoder_layer(model, i, layer, ls, pos, &mut x, bufs)?;
        if model.prefetch {
            model.prefetch_next(i, &x);
        }
        if let Some(f) = trace.as_mut() {
            f(Stage::Routes(i, &routes));
            f(Stage::Layer(i, &x));
        }
    }
    state.pos += t;
    norm_rows(&x, &model.dense.norm, cfg.rms_norm_eps, &mut normed);
    if let Some(f) = trace.as_mut() {
        f(Stage::Norm(&normed));
    }
    let rows = match want {
        Logits::All => &normed[..],
        Logits::Last | Logits::Best | Logits::Top(_) => &normed[(t - 1) * h..],
        Logits::None => return Ok(Vec::new()),
    };
    let mut logits = vec![0.0; rows.len() / h * v]; // [rows, V]
    model.dense.lm_head.forward_rows(rows, &mut logits);
    Ok(logits)
}

/// `x += mixer(norm(x)); x += moe(norm(x))` for layer `i`, with the chunk's `normed` and
/// `delta` scratch; returns the routes it took.
fn decoder_layer(
    model: &Model,
    i: usize,
    layer: &LayerWeights,
    ls: &mut LayerState,
    pos: usize,
    x: &mut [f32],
    (normed, delta): (&mut [f32], &mut [f32]),
) -> Result<Vec<Route>> {
    let cfg = &model.cfg;
    let eps = cfg.rms_norm_eps;
    norm_rows(x, &layer.input_layernorm, eps, normed);
    match (&layer.mixer, ls) {
        (Mixer::Linear(w), LayerState::Linear { conv, ssm }) => {
            delta_net::forward(w, cfg, conv, ssm, normed, model.delta_mode, delta)
        }
        (Mixer::Full(w), LayerState::Full { keys, values }) => {
            attention::forward(w, cfg, keys, values, pos, normed, delta)
        }
        _ => return Err(Error::Invalid(format!("state does not fit layer {i}"))),
    }
    add(x, delta);
    norm_rows(x, &layer.post_attention_layernorm, eps, normed);
    let experts = model.experts.as_ref();
    let routes = moe::forward(&layer.mlp, cfg, experts, i, normed, delta)?;
    add(x, delta);
    Ok(routes)
}

fn add(x: &mut [f32], d: &[f32]) {
    x.iter_mut().zip(d).for_each(|(a, b)| *a += b);
}

impl Model {
    /// The reference pass through the driver: feeds `tokens` into `state` and returns the
    /// logits asked for, reporting intermediate values to `trace`. A shorthand for tests and
    /// tools that want the oracle itself; faces open their engine with [`crate::engine::open`].
    pub fn forward(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        trace: Trace<'_>,
    ) -> Result<Vec<f32>> {
        Ok(Forward::reference(self)
            .forward_traced(state, tokens, want, trace)?
            .to_vec())
    }
}
