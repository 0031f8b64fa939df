//! [`CpuModel`]: the forward pass on the fast CPU kernels, with every buffer sized once.
//!
//! Owns the thread pool, the scratch for chunks of up to `max_chunk` tokens and the per-layer
//! data derived at construction (conv weights transposed to [K, conv_dim], RoPE frequencies).
//! It borrows a [`Model`] (config, dense weights, expert source) and reads and writes the same
//! [`SeqState`] as [`Model::forward`], so a sequence can move between the two paths. A
//! one-token call allocates nothing once the state's KV cache has room (see
//! [`CpuModel::new_state`]). It must not index packed bytes (the kernels do) nor change the
//! model's arithmetic: it mirrors [`Model::forward`] and is tested against it and against
//! mlx-lm's fixtures.

use crate::config::LayerKind;
use crate::cpu::blocks::exec::{Exec, XScratch};
use crate::cpu::blocks::mixer::{self, MixerScratch, Ssm};
use crate::cpu::blocks::moe::{self, MoeScratch};
use crate::cpu::kernels::ops::{add, rms_norm_rows};
use crate::cpu::kernels::qmatvec::check;
use crate::cpu::state::Bf16Ssm;
use crate::cpu::{CpuPool, Precision, SimdLevel};
use crate::engine::driver::drive_own;
use crate::engine::{Caps, Engine, ModelRef, Routing, Step, Trace};
use crate::error::{Error, Result};
use crate::model::moe::Route;
use crate::model::state::{LayerState, SeqState};
use crate::model::weights::{AttentionWeights, DeltaNetWeights, LayerWeights, Mixer};
use crate::model::{Logits, Model, Stage};

mod seqs;

/// How [`CpuModel`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuOptions {
    /// Threads, the caller included.
    pub threads: usize,
    /// Tokens per prefill chunk; longer calls are split. Scratch grows with it.
    pub max_chunk: usize,
    /// Positions the attention score buffers hold before growing (and the default KV
    /// reservation of [`CpuModel::new_state`]).
    pub max_context: usize,
    /// SIMD level; `None` detects the best.
    pub level: Option<SimdLevel>,
    /// Most sequences one step computes together (a server's parallel slots).
    pub max_seqs: usize,
    /// How decode matvecs treat activations ([`Precision::Exact`] unless chosen).
    pub precision: Precision,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_chunk: 256,
            max_context: 4096,
            level: None,
            max_seqs: 1,
            precision: Precision::Exact,
        }
    }
}

impl CpuOptions {
    /// The CPU engine's options for a model opened with `o`.
    pub fn from_open(o: &crate::model::open::OpenOptions) -> Self {
        CpuOptions {
            max_chunk: o.prefill_chunk,
            max_context: o.context,
            precision: o.precision,
            threads: o.threads.map_or(Self::default().threads, |t| t.max(1)),
            max_seqs: o.max_seqs.max(1),
            ..Default::default()
        }
    }
}

/// The fast CPU forward pass over a [`Model`].
#[derive(Debug)]
pub struct CpuModel<'m> {
    model: ModelRef<'m>,
    pool: CpuPool,
    level: SimdLevel,
    opts: CpuOptions,
    conv_t: Vec<Vec<f32>>, // per layer: [K, conv_dim] (empty for attention layers)
    inv_freq: Vec<f64>,    // [rotary_dim / 2]
    x: Vec<f32>,           // [C, H] residual stream
    normed: Vec<f32>,      // [C, H]
    delta: Vec<f32>,       // [C, H] a sub-block's output
    mix: MixerScratch,
    moe: MoeScratch,
    head: XScratch,
    logits: Vec<f32>, // [V] or [T, V]
    out: Vec<f32>,    // what the shorthand [`CpuModel::forward`] returns
    rows: Vec<Span>,  // a several-sequence step's row layout
}

/// Where one sequence of a several-sequence step sits in the step's rows.
#[derive(Debug, Clone)]
struct Span {
    seq: usize,
    rows: std::ops::Range<usize>,
}

impl CpuModel<'static> {
    /// Like [`CpuModel::new`] for a model shared through an `Arc`.
    pub fn new_shared(model: std::sync::Arc<Model>, opts: CpuOptions) -> Result<Self> {
        Self::build(ModelRef::Shared(model), opts)
    }
}

impl<'m> CpuModel<'m> {
    /// Checks every resident weight once and sizes all scratch.
    pub fn new(model: &'m Model, opts: CpuOptions) -> Result<Self> {
        Self::build(ModelRef::Borrowed(model), opts)
    }

    fn build(model_ref: ModelRef<'m>, opts: CpuOptions) -> Result<Self> {
        let model: &Model = &model_ref;
        let cfg = &model.cfg;
        if opts.max_chunk == 0 {
            return Err(Error::Invalid("max_chunk must be at least 1".into()));
        }
        let d = &model.dense;
        if let crate::model::embedding::Embedding::Resident(e) = &d.embed_tokens {
            check(&e.view())?;
        }
        check(&d.lm_head.view())?;
        for l in &d.layers {
            let mut mats = vec![l.mlp.gate.view(), l.mlp.shared_expert_gate.view()];
            let se = &l.mlp.shared_expert;
            mats.extend([se.gate_proj.view(), se.up_proj.view(), se.down_proj.view()]);
            match &l.mixer {
                Mixer::Linear(w) => mats.extend([
                    w.in_proj_qkv.view(),
                    w.in_proj_z.view(),
                    w.in_proj_b.view(),
                    w.in_proj_a.view(),
                    w.out_proj.view(),
                ]),
                Mixer::Full(w) => mats.extend([
                    w.q_proj.view(),
                    w.k_proj.view(),
                    w.v_proj.view(),
                    w.o_proj.view(),
                ]),
            }
            for m in &mats {
                check(m)?;
            }
        }
        let (cd, kk) = (cfg.conv_dim(), cfg.linear_conv_kernel_dim);
        let conv_t = d
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(w) => (0..kk * cd)
                    .map(|i| w.conv1d[(i % cd) * kk + i / cd])
                    .collect(),
                Mixer::Full(_) => Vec::new(),
            })
            .collect();
        let pool = CpuPool::new(opts.threads);
        // A step holds one sequence's chunk, or a chunk beside other sequences' single tokens.
        let c = opts.max_chunk.saturating_add(opts.max_seqs.max(1) - 1);
        let h = cfg.hidden_size;
        Ok(CpuModel {
            level: opts.level.unwrap_or_else(SimdLevel::detect),
            mix: MixerScratch::new(cfg, c, pool.threads(), opts.max_context),
            moe: MoeScratch::new(cfg, c, opts.max_seqs),
            pool,
            opts,
            conv_t,
            inv_freq: crate::cpu::kernels::ops::rope_inv_freq(cfg),
            x: vec![0.0; c * h],
            normed: vec![0.0; c * h],
            delta: vec![0.0; c * h],
            head: XScratch::default(),
            logits: vec![0.0; cfg.vocab_size],
            out: Vec::new(),
            rows: Vec::with_capacity(opts.max_seqs),
            model: model_ref.clone(),
        })
    }

    /// The SIMD level in use.
    pub fn level(&self) -> SimdLevel {
        self.level
    }

    /// Threads in use.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// A fresh sequence state (the reference layout) whose KV caches have room for
    /// `reserve_tokens` positions, so decoding up to there never allocates.
    pub fn new_state(&self, reserve_tokens: usize) -> SeqState {
        let cfg = &self.model.cfg;
        let mut st = SeqState::new(cfg);
        let per = cfg.num_key_value_heads * cfg.head_dim;
        for l in &mut st.layers {
            if let LayerState::Full { keys, values } = l {
                keys.reserve(reserve_tokens * per);
                values.reserve(reserve_tokens * per);
            }
        }
        st
    }

    /// Feeds `tokens` through the model, advancing `state`, and returns the logits asked for
    /// (\[T, V\], \[V\] or empty), exactly as [`Model::forward`] does: a shorthand for the driver
    /// ([`crate::engine::Forward`]) over this engine, for tests and benchmarks.
    pub fn forward(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<&[f32]> {
        self.forward_traced(state, tokens, want, None)
    }

    /// [`CpuModel::forward`] reporting intermediate values (per chunk of at most `max_chunk`
    /// tokens) to `trace`. Tracing allocates; plain forward calls do not.
    pub fn forward_traced(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        trace: Trace<'_>,
    ) -> Result<&[f32]> {
        drive_own(self, |m| &mut m.out, state, tokens, want, trace)
    }

    /// The logits `want` asks of the chunk whose normed rows `chunk` left in `normed`.
    fn head(&mut self, c: usize, want: Logits, out: &mut Vec<f32>) -> Result<()> {
        let (h, v) = (self.model.cfg.hidden_size, self.model.cfg.vocab_size);
        let rows = match want {
            Logits::All => c,
            Logits::Last | Logits::Best | Logits::Top(_) => 1,
            Logits::None => return Ok(()),
        };
        if self.logits.len() < rows * v {
            self.logits.resize(rows * v, 0.0);
        }
        let ex = Exec {
            pool: &self.pool,
            level: self.level,
            precision: self.opts.precision,
        };
        let head = self.model.dense.lm_head.view();
        let x = &self.normed[(c - rows) * h..c * h];
        ex.linears(
            x,
            rows,
            &mut self.head,
            &mut [(head, &mut self.logits[..rows * v])],
        )?;
        out.extend_from_slice(&self.logits[..rows * v]);
        Ok(())
    }

    fn check_state(&self, state: &mut SeqState) -> Result<()> {
        let cfg = &self.model.cfg;
        let fresh = |i: usize| {
            Error::Invalid(format!(
                "state does not fit layer {i}: make it with new_state"
            ))
        };
        let SeqState {
            pos,
            layers,
            device,
        } = state;
        let held = Bf16Ssm::in_slot(device).map(|h| &h.layers);
        if layers.len() != cfg.num_hidden_layers || held.is_some_and(|h| h.len() != layers.len()) {
            return Err(fresh(layers.len()));
        }
        let (conv, ssm) = (cfg.conv_state_len(), cfg.ssm_state_len());
        let kv = *pos * cfg.num_key_value_heads * cfg.head_dim;
        for (i, (l, kind)) in layers.iter().zip(&cfg.layer_types).enumerate() {
            let ok = match (l, kind) {
                (LayerState::Linear { conv: c, ssm: s }, LayerKind::Linear) => {
                    let s_len = held.map_or(s.len(), |h| h[i].len());
                    c.len() == conv && s_len == ssm
                }
                (LayerState::Full { keys, values }, LayerKind::Full) => {
                    keys.len() == kv && values.len() == kv
                }
                _ => false,
            };
            if !ok {
                return Err(fresh(i));
            }
        }
        Ok(())
    }

    /// One chunk: embeddings through the final norm, leaving [c, H] normed rows in `normed`.
    fn chunk(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        given: moe::Given<'_>,
        trace: &mut Trace<'_>,
    ) -> Result<()> {
        // A cheap handle (a reference copy or an Arc count), so `self`'s scratch stays free.
        let model_ref = self.model.clone();
        let model: &Model = &model_ref;
        let (h, t) = (model.cfg.hidden_size, tokens.len());
        let mut pass = Pass {
            ex: Exec {
                pool: &self.pool,
                level: self.level,
                precision: self.opts.precision,
            },
            model,
            x: &mut self.x[..t * h],
            normed: &mut self.normed[..t * h],
            delta: &mut self.delta[..t * h],
            mix: &mut self.mix,
            moe: &mut self.moe,
            pos: state.pos,
            given,
        };
        for (row, &tok) in pass.x.chunks_exact_mut(h).zip(tokens) {
            model.dense.embed_tokens.row(tok as usize, row)?;
        }
        if let Some(f) = trace.as_mut() {
            f(Stage::Embed(pass.x));
        }
        let SeqState { layers, device, .. } = state;
        let mut held = Bf16Ssm::in_slot(device);
        for (i, (layer, ls)) in model.dense.layers.iter().zip(layers).enumerate() {
            let mixer = match (&layer.mixer, ls) {
                (Mixer::Linear(w), LayerState::Linear { conv, ssm }) => MixerState::Delta {
                    w,
                    conv_t: &self.conv_t[i],
                    conv,
                    ssm: match held.as_mut() {
                        Some(h) => Ssm::Bf16(&mut h.layers[i]),
                        None => Ssm::F32(ssm),
                    },
                },
                (Mixer::Full(w), LayerState::Full { keys, values }) => MixerState::Attention {
                    w,
                    inv_freq: &self.inv_freq,
                    keys,
                    values,
                },
                _ => return Err(Error::Invalid(format!("state does not fit layer {i}"))),
            };
            pass.decoder_layer(i, layer, mixer)?;
            if let Some(f) = trace.as_mut() {
                f(Stage::Routes(i, &pass.routes(t)));
                f(Stage::Layer(i, pass.x));
            }
        }
        state.pos += t;
        rms_norm_rows(
            pass.ex.level,
            pass.x,
            &model.dense.norm,
            model.cfg.rms_norm_eps,
            pass.normed,
        );
        if let Some(f) = trace.as_mut() {
            f(Stage::Norm(pass.normed));
        }
        Ok(())
    }
}

/// One layer's mixer with its weights and the sequence's state for it.
enum MixerState<'a> {
    Delta {
        w: &'a DeltaNetWeights,
        conv_t: &'a [f32],   // [K, conv_dim]
        conv: &'a mut [f32], // [K-1, conv_dim]
        ssm: Ssm<'a>,        // [nv, dk, dv]
    },
    Attention {
        w: &'a AttentionWeights,
        inv_freq: &'a [f64],      // [rotary_dim / 2]
        keys: &'a mut Vec<f32>,   // [pos, nkv, hd]
        values: &'a mut Vec<f32>, // [pos, nkv, hd]
    },
}

/// What the layers of one chunk share: the kernels' executor, the residual stream and the
/// scratch, all sized once by [`CpuModel`].
struct Pass<'a> {
    ex: Exec<'a>,
    model: &'a Model,
    x: &'a mut [f32],      // [t, H] residual stream
    normed: &'a mut [f32], // [t, H]
    delta: &'a mut [f32],  // [t, H] a sub-block's output
    mix: &'a mut MixerScratch,
    moe: &'a mut MoeScratch,
    /// Position of the chunk's first token.
    pos: usize,
    /// Routes given instead of the routers' (a replayed routing).
    given: moe::Given<'a>,
}

impl Pass<'_> {
    /// `x += mixer(input_layernorm(x)); x += moe(post_attention_layernorm(x))`, as mlx-lm's
    /// `DecoderLayer.__call__`.
    fn decoder_layer(
        &mut self,
        i: usize,
        layer: &LayerWeights,
        mixer: MixerState<'_>,
    ) -> Result<()> {
        // The prefetch guesses from the router, which a given routing overrides: its reads
        // would be wasted there.
        if self.model.prefetch && self.x.len() == self.model.cfg.hidden_size && self.given.is_none()
        {
            self.prefetch(i, layer)?;
        }
        self.norm(&layer.input_layernorm);
        self.mixer(mixer)?;
        add(self.ex.level, self.delta, self.x);
        self.norm(&layer.post_attention_layernorm);
        let experts = self.model.experts.as_ref();
        let cfg = &self.model.cfg;
        moe::forward(
            &self.ex,
            &layer.mlp,
            cfg,
            experts,
            i,
            self.normed,
            self.delta,
            self.moe,
            self.given,
        )?;
        add(self.ex.level, self.delta, self.x);
        Ok(())
    }

    /// `normed = rms_norm(x) * w`.
    fn norm(&mut self, w: &[f32]) {
        let eps = self.model.cfg.rms_norm_eps;
        rms_norm_rows(self.ex.level, self.x, w, eps, self.normed);
    }

    /// `delta = mixer(normed)`, advancing the mixer's state.
    fn mixer(&mut self, m: MixerState<'_>) -> Result<()> {
        let (ex, cfg) = (&self.ex, &self.model.cfg);
        match m {
            MixerState::Delta {
                w,
                conv_t,
                conv,
                ssm,
            } => mixer::delta_net(
                ex,
                w,
                cfg,
                conv_t,
                conv,
                ssm,
                self.normed,
                self.delta,
                self.mix,
            ),
            MixerState::Attention {
                w,
                inv_freq,
                keys,
                values,
            } => mixer::attention(
                ex,
                w,
                cfg,
                inv_freq,
                keys,
                values,
                self.pos,
                self.normed,
                self.delta,
                self.mix,
            ),
        }
    }

    /// Starts reading the layer's likely experts, guessed from the stream entering it (the
    /// embedding for layer 0), while its mixer computes. One token only: a chunk needs nearly
    /// every expert anyway.
    fn prefetch(&mut self, i: usize, layer: &LayerWeights) -> Result<()> {
        self.norm(&layer.post_attention_layernorm);
        let (experts, cfg) = (self.model.experts.as_ref(), &self.model.cfg);
        moe::prefetch_next(&self.ex, &layer.mlp, cfg, experts, i, self.normed, self.moe)
    }

    /// The routes the last layer took, one per token (tracing only: allocates).
    fn routes(&self, t: usize) -> Vec<Route> {
        let k = self.model.cfg.num_experts_per_tok;
        (0..t)
            .map(|ti| Route {
                experts: self.moe.sel[ti * k..(ti + 1) * k].to_vec(),
                weights: self.moe.wts[ti * k..(ti + 1) * k].to_vec(),
            })
            .collect()
    }
}

impl Engine for CpuModel<'_> {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn model(&self) -> &Model {
        &self.model
    }

    fn caps(&self) -> Caps {
        Caps {
            max_chunk: self.opts.max_chunk,
            max_seqs: self.opts.max_seqs.max(1),
            max_tokens: self.x.len() / self.model.cfg.hidden_size,
            given_routes: true,
            trace: true,
        }
    }

    fn new_state(&self, reserve_tokens: usize) -> SeqState {
        CpuModel::new_state(self, reserve_tokens)
    }

    fn place(&mut self, state: &mut SeqState, tokens: usize) -> Result<()> {
        if self.opts.precision == Precision::Fast && tokens == 1 {
            // One token at a time, the fast path keeps the recurrent states in bf16.
            Bf16Ssm::hold(state)?;
        } else {
            state.sync_host()?;
        }
        self.check_state(state)
    }

    fn step(&mut self, step: Step<'_, '_>) -> Result<()> {
        let Step {
            seqs,
            routing,
            mut trace,
        } = step;
        if seqs.len() > 1 {
            if trace.is_some() {
                return Err(Error::Invalid("tracing takes one sequence per step".into()));
            }
            return self.step_seqs(seqs, routing);
        }
        for (i, s) in seqs.iter_mut().enumerate() {
            let given = match routing {
                Routing::Given(g) => Some((g, i)),
                Routing::Router => None,
            };
            self.chunk(s.state, s.tokens, given, &mut trace)?;
            self.head(s.tokens.len(), s.want, s.logits)?;
        }
        Ok(())
    }
}
