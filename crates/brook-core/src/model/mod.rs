//! The Qwen3-Next / Qwen3.5-MoE model: config, weights, per-sequence state and the f32 layer
//! maths (DeltaNet, attention, MoE) that the reference engine (`crate::engine::reference`)
//! runs.
//!
//! A decoder layer is: h' = h + Mixer(RMSNorm(h)); h'' = h' + MoE(RMSNorm(h')), with Mixer a
//! Gated DeltaNet or gated attention layer (MODEL.md §2.2). The maths here is the oracle every
//! fast path is tested against: plain loops in f32, allocation allowed. It must not choose a
//! forward pass; `crate::engine::open` does.

pub mod attention;
pub mod delta_net;
pub mod embedding;
pub mod moe;
pub mod open;
pub mod ops;
pub mod state;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use crate::checkpoint::{Checkpoint, TensorSource};
use crate::config::ModelConfig;
use crate::container::{self, Container};
use crate::error::{Error, Result};
use crate::experts::source::{ExpertSource, ResidentExperts};
use crate::model::delta_net::DeltaMode;
use crate::model::moe::Route;
use crate::model::state::SeqState;
use crate::model::weights::{DenseWeights, Loader};

/// Which logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Every position: [T, V].
    All,
    /// The last position only: \[V\].
    Last,
    /// The last position's greedy pick only: one float whose bits are the id [`argmax`]
    /// picks from the last position's logits ([`Logits::best_id`] reads it). A greedy
    /// decode needs nothing more, and a GPU then copies 4 bytes back instead of the whole
    /// vocabulary's logits (1 MB a sequence for a 248,320-word vocabulary). Engines that
    /// have no faster way hand back the last position's logits and the driver reduces them.
    Best,
    /// The last position's logits, or, where the engine has a faster way and they decide
    /// what a sampler of this [`TopWant`] picks ([`top_decides`]), only its
    /// [`TOP_CANDIDATES`] most likely as pairs of floats (the logit, then a float whose bits
    /// are the id), most likely first, ties to the lower id, NaN left out (fewer pairs when
    /// fewer logits are numbers). A caller tells the two apart by the length: a row is the
    /// vocabulary's length; pairs come only from a vocabulary longer than
    /// 2 × [`TOP_CANDIDATES`].
    Top(TopWant),
    /// None (prefill whose logits are not needed).
    None,
}

/// What a sampler without penalties picks from, for [`Logits::Top`]: the `k` most likely ids
/// at the temperature whose bits are `temperature` (a plain float has no `Eq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopWant {
    pub k: u32,
    pub temperature: u32,
}

/// Candidates a [`Logits::Top`] call hands back at most.
pub const TOP_CANDIDATES: usize = 64;

/// A logit's probability as the sampler weighs it: relative to the largest logit `max`, at
/// inverse temperature `inv_t` (the one rounding every path shares).
pub fn rel_prob(l: f32, max: f32, inv_t: f32) -> f32 {
    ((l - max) * inv_t).exp()
}

/// Whether `cands`, the largest logits of a row as [`Logits::Top`] orders them, decide what a
/// sampler of `want` picks from the whole row: `whole` when they are every logit of the row
/// that is a number; otherwise when their last is less likely than the `want.k`-th, so no id
/// outside them can be among the `k` kept, ties included (the sampler orders equal
/// probabilities by id).
pub fn top_decides(cands: &[(f32, u32)], whole: bool, want: TopWant) -> bool {
    if whole {
        return true;
    }
    let k = want.k as usize;
    if k == 0 || k >= cands.len() {
        return false;
    }
    let max = cands[0].0;
    if !max.is_finite() {
        // The sampler takes the first largest (argmax), which is `cands[0]`.
        return true;
    }
    let inv_t = 1.0 / f32::from_bits(want.temperature);
    let p = |l: f32| rel_prob(l, max, inv_t);
    p(cands[cands.len() - 1].0).partial_cmp(&p(cands[k - 1].0)) == Some(std::cmp::Ordering::Less)
}

/// The [`Logits::Top`] candidates of `row`: every logit that is a number, by (logit
/// descending, id ascending), the first [`TOP_CANDIDATES`] of them, into `out` (replaced).
/// Returns whether they are all of them (`whole` for [`top_decides`]).
pub fn top_candidates(row: &[f32], out: &mut Vec<(f32, u32)>) -> bool {
    // Before: a larger logit, then a lower id (NaN is left out and -0 taken as +0, so
    // `total_cmp` orders as `<` does).
    let before = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    out.clear();
    let mut numbers = 0usize;
    for (i, &l) in row.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        numbers += 1;
        let e = (if l == 0.0 { 0.0 } else { l }, i as u32);
        if out.len() == TOP_CANDIDATES {
            // Sorted: the last is the least, and most logits fall below it.
            if before(&e, &out[TOP_CANDIDATES - 1]).is_ge() {
                continue;
            }
            out.pop();
        }
        let at = out.partition_point(|x| before(x, &e).is_lt());
        out.insert(at, e);
    }
    numbers <= TOP_CANDIDATES
}

impl Logits {
    /// Floats returned for `t` tokens of a vocabulary of `v`.
    pub fn len(self, t: usize, v: usize) -> usize {
        match self {
            Logits::All => t * v,
            Logits::Last => v,
            Logits::Best => 1,
            Logits::Top(_) => v,
            Logits::None => 0,
        }
    }

    /// What one chunk of a call asking for `self` asks for: a call's last position is in
    /// its last chunk only.
    pub fn for_chunk(self, last: bool) -> Logits {
        match self {
            Logits::All => Logits::All,
            Logits::Last | Logits::Best | Logits::Top(_) if last => self,
            _ => Logits::None,
        }
    }

    /// The float a [`Logits::Best`] call returns for `id`.
    pub fn best_float(id: u32) -> f32 {
        f32::from_bits(id)
    }

    /// The id in what a [`Logits::Best`] call returned (`out[0]`); 0 for an empty `out`.
    pub fn best_id(out: &[f32]) -> u32 {
        out.first().map_or(0, |f| f.to_bits())
    }
}

/// Index of the largest logit; NaN loses to everything, ties go to the lower id (0 when
/// every logit is NaN). What greedy decoding picks, and [`Logits::Best`].
///
/// Two passes the compiler vectorizes instead of one branch per logit (a 248320-word
/// vocabulary took ~0.25 ms, about 0.4% of a fast decoded token): the largest value by
/// `f32::max`, which skips NaN, in 16 lanes; then the first 64-logit block holding it, and its
/// place there.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    const BLOCK: usize = 64;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    let best = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    logits
        .chunks(BLOCK)
        .enumerate()
        .find(|(_, c)| c.iter().fold(false, |hit, &v| hit | (v == best)))
        .and_then(|(b, c)| c.iter().position(|&v| v == best).map(|i| b * BLOCK + i))
        .unwrap_or(0) as u32
}

/// The tokens every forward pass accepts: at least one, each inside the vocabulary.
pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::Invalid("forward needs at least one token".into()));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Invalid(format!(
            "token id {bad} is out of range for a vocabulary of {vocab}"
        )));
    }
    Ok(())
}

/// Intermediate values reported to a trace callback during a forward call.
#[derive(Debug)]
pub enum Stage<'a> {
    /// The embedding output, [T, H].
    Embed(&'a [f32]),
    /// Output of decoder layer `i` (after both residual adds), [T, H].
    Layer(usize, &'a [f32]),
    /// The routes chosen in layer `i`, one per token.
    Routes(usize, &'a [Route]),
    /// After the final norm, [T, H].
    Norm(&'a [f32]),
}

/// A loaded model: config, resident dense weights and a source of routed experts.
#[derive(Debug)]
pub struct Model {
    pub cfg: ModelConfig,
    pub dense: DenseWeights,
    pub experts: Box<dyn ExpertSource>,
    pub delta_mode: DeltaMode,
    /// Route the next layer early and prefetch its likely experts.
    pub prefetch: bool,
    /// Most tokens run through the layers together.
    pub prefill_chunk: usize,
    /// Engine steps run over this model, by engine name ([`Model::count_step`]).
    pub steps: std::sync::Mutex<Vec<(&'static str, u64)>>,
}

impl Model {
    /// Loads a container or an MLX checkpoint folder with every expert resident.
    pub fn open(dir: &Path) -> Result<Self> {
        if container::is_container(dir) {
            let c = Container::open(dir)?;
            let dense = Loader::new(&c, &c.config).dense()?;
            let layers = (0..c.config.num_hidden_layers)
                .map(|l| {
                    (0..c.config.num_experts)
                        .map(|e| {
                            c.read_expert(l, e)
                                .map(|b| Arc::new(b) as crate::experts::source::ExpertHandle)
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(Model {
                dense,
                experts: Box::new(ResidentExperts { layers }),
                cfg: c.config,
                delta_mode: DeltaMode::Auto,
                prefetch: false,
                prefill_chunk: crate::model::open::PREFILL_CHUNK,
                steps: Default::default(),
            });
        }
        let ck = Checkpoint::open(dir)?;
        let cfg = ck.config.clone();
        Self::load_resident(&ck, cfg)
    }

    /// Loads every weight of `store`, experts included, into memory.
    pub fn load_resident(store: &dyn TensorSource, cfg: ModelConfig) -> Result<Self> {
        let loader = Loader::new(store, &cfg);
        let dense = loader.dense()?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| {
                (0..cfg.num_experts)
                    .map(|e| {
                        loader
                            .routed_expert(l, e)
                            .map(|x| Arc::new(x) as crate::experts::source::ExpertHandle)
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            dense,
            experts: Box::new(ResidentExperts { layers }),
            cfg,
            delta_mode: DeltaMode::Auto,
            prefetch: false,
            prefill_chunk: 256,
            steps: Default::default(),
        })
    }

    /// A fresh per-sequence state for this model.
    pub fn new_state(&self) -> SeqState {
        SeqState::new(&self.cfg)
    }

    /// Records one engine step over this model (the driver calls it).
    pub fn count_step(&self, engine: &'static str) {
        let mut c = self.steps.lock().unwrap_or_else(|p| p.into_inner());
        match c.iter_mut().find(|(n, _)| *n == engine) {
            Some((_, k)) => *k += 1,
            None => c.push((engine, 1)),
        }
    }

    /// Steps each engine has run over this model, by engine name.
    pub fn step_counts(&self) -> Vec<(String, u64)> {
        let c = self.steps.lock().unwrap_or_else(|p| p.into_inner());
        c.iter().map(|(n, k)| (n.to_string(), *k)).collect()
    }
}

/// Experts read ahead per layer by `--prefetch` (the best guesses only): about what the disk
/// reads while the next layer's mixer computes, so wrong guesses cost little disk time.
pub const PREFETCH_GUESSES: usize = 4;

impl Model {
    /// One token's residual stream `x` leaving layer `i`: routes it with layer i+1's norm and
    /// router (without that layer's mixer, which has not run yet) and asks the expert source
    /// to start reading the [`PREFETCH_GUESSES`] likeliest experts, so the reads overlap the
    /// mixer's compute. Prefill chunks (several tokens) need nearly every expert anyway and
    /// read none ahead.
    pub fn prefetch_next(&self, i: usize, x: &[f32]) {
        let h = self.cfg.hidden_size;
        let Some(next) = self.dense.layers.get(i + 1) else {
            return;
        };
        if x.len() != h {
            return;
        }
        let mut normed = vec![0.0; h];
        ops::rms_norm(
            x,
            &next.post_attention_layernorm,
            self.cfg.rms_norm_eps,
            &mut normed,
        );
        let mut ids = moe::route(&next.mlp, &self.cfg, &normed).experts;
        ids.truncate(PREFETCH_GUESSES);
        self.experts.prefetch(i + 1, &ids);
    }
}

pub(crate) fn norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        ops::rms_norm(xr, w, eps, or);
    }
}
