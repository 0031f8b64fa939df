//! The one door to the forward pass.
//!
//! Every face (the `Session` API, `chat`, `generate`, `serve`, `bench`, `demo`, `logits`)
//! computes the same way: options -> [`open`] (the only place that picks a pass) -> a
//! [`Forward`] driver that owns the shell every pass shares (token checks, the context
//! limit, chunking, which logits to keep, placing the state on the host or a device,
//! counting) -> an [`Engine`]'s per-step maths. The f32 reference
//! ([`reference`](mod@reference)) is an engine like the CPU kernels (`crate::cpu::CpuModel`)
//! and the CUDA backend (crate brook-cuda).
//!
//! A [`Step`] carries several sequences, each with its own state and position, and may be
//! told which experts each layer uses ([`Routing::Given`], a recorded routing replayed).
//! Engines say what they take in [`Caps`]; the driver never hands an engine more, and refuses
//! clearly what no engine here takes yet.
//!
//! This module must not contain layer maths (engines and `crate::model` do) nor know about
//! text, HTTP or terminals.

pub mod batch;
pub mod driver;
pub mod reference;

use std::path::Path;
use std::sync::Arc;

pub use crate::cpu::Precision;
pub use driver::{EngineStats, Forward, Part};
pub use reference::Reference;

use crate::error::{Error, Result};
use crate::model::open::{Backend, OpenOptions};
use crate::model::state::SeqState;
use crate::model::{Logits, Model, Stage};

/// One sequence's part of a [`Step`].
#[derive(Debug)]
pub struct SeqStep<'a> {
    /// The sequence's state; its `pos` is where `tokens` start.
    pub state: &'a mut SeqState,
    /// Tokens to feed: at least one, at most [`Caps::max_chunk`].
    pub tokens: &'a [u32],
    /// Which of this step's logits the engine appends to `logits`.
    pub want: Logits,
    /// Receives `want.len(tokens.len(), vocab)` floats; for [`Logits::Best`] and
    /// [`Logits::Top`] an engine without a faster way may hand back the last position's row
    /// instead (the driver reduces it to the pick; a sampler takes either).
    pub logits: &'a mut Vec<f32>,
}

/// Experts given for every (sequence, token, layer) of a step instead of the router's
/// choice: a recorded routing trace replayed.
pub trait GivenRoutes: Sync {
    /// The experts of `token` (index within the sequence's step) in MoE layer `layer`, in
    /// the router's order (exactly top-k distinct ids below the expert count; engines check);
    /// `None` leaves that token to the router.
    fn experts(&self, seq: usize, token: usize, layer: usize) -> Option<&[u32]>;
}

/// Checks given experts against the model's shape before an engine uses them.
pub fn check_given(ids: &[u32], top_k: usize, num_experts: usize, layer: usize) -> Result<()> {
    let ok = ids.len() == top_k
        && ids
            .iter()
            .enumerate()
            .all(|(i, &e)| (e as usize) < num_experts && !ids[..i].contains(&e));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "the given routing of layer {layer} is {ids:?}; the model needs {top_k} distinct experts below {num_experts}"
        )))
    }
}

/// Where a step's routed experts come from.
#[derive(Clone, Copy, Default)]
pub enum Routing<'a> {
    /// Each layer's router picks its top-k: the model as trained.
    #[default]
    Router,
    /// The experts are given ([`GivenRoutes`]); weights are the router's probabilities at the
    /// given ids, normalised as the model normalises its top-k.
    Given(&'a dyn GivenRoutes),
}

impl std::fmt::Debug for Routing<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Routing::Router => "Router",
            Routing::Given(_) => "Given",
        })
    }
}

/// A trace callback: intermediate values of a step, for tests and tools.
pub type Trace<'a> = Option<&'a mut dyn FnMut(Stage<'_>)>;

/// One forward step: a chunk of tokens of each sequence, computed together.
pub struct Step<'s, 'a> {
    /// The sequences (at most [`Caps::max_seqs`]).
    pub seqs: &'s mut [SeqStep<'a>],
    pub routing: Routing<'s>,
    /// Reports intermediate values (engines with [`Caps::trace`]); tracing may allocate.
    pub trace: Trace<'s>,
}

impl std::fmt::Debug for Step<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Step")
            .field("seqs", &self.seqs)
            .field("routing", &self.routing)
            .field("trace", &self.trace.is_some())
            .finish()
    }
}

/// What an engine takes in one [`Step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Most tokens of one sequence per step (the prefill chunk it sized its scratch for).
    pub max_chunk: usize,
    /// Most sequences per step.
    pub max_seqs: usize,
    /// Most tokens per step, summed over its sequences.
    pub max_tokens: usize,
    /// Takes [`Routing::Given`].
    pub given_routes: bool,
    /// Reports intermediate values to a trace callback.
    pub trace: bool,
}

/// A forward pass over a loaded [`Model`]: the per-step maths, with its own buffers.
///
/// The shell around a step (checks, chunking, which logits, state placement, counting) is the
/// driver's ([`Forward`]); an engine computes one [`Step`] within its [`Caps`].
pub trait Engine: Send + std::fmt::Debug {
    /// A short name for stats, logs and benchmarks: "reference", "cpu", "cuda".
    fn name(&self) -> &'static str;
    /// The model it runs.
    fn model(&self) -> &Model;
    fn caps(&self) -> Caps;
    /// A fresh state, with room reserved for `reserve_tokens` where the engine keeps the
    /// state on the host (so decoding up to there does not allocate).
    fn new_state(&self, reserve_tokens: usize) -> SeqState {
        let _ = reserve_tokens;
        self.model().new_state()
    }
    /// Puts `state` where this engine computes on it (its device, the fast path's bf16 form,
    /// or the host layout) before `tokens` tokens are fed, and checks that it fits. Fails
    /// without changing what the state means.
    fn place(&mut self, state: &mut SeqState, tokens: usize) -> Result<()>;
    /// Computes one step. On an error the sequences' states may be half-updated; the driver
    /// starts them afresh.
    fn step(&mut self, step: Step<'_, '_>) -> Result<()>;
    /// Counters of a GPU engine (cumulative since it was made).
    fn gpu_stats(&self) -> Option<GpuStats> {
        None
    }
}

/// What a GPU engine reports to benchmarks.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuStats {
    pub device: String,
    pub budget_bytes: u64,
    pub used_bytes: u64,
    /// Expert slots in GPU memory.
    pub slots: usize,
    /// Every expert has a slot.
    pub resident: bool,
    /// Experts the kernels read from mapped host memory (the host tier, no host round trip).
    #[serde(default)]
    pub mapped: usize,
    pub hits: u64,
    pub misses: u64,
    /// Expert bytes copied from the host into GPU slots, and the expert bytes the kernels
    /// read from mapped host memory.
    pub bytes_copied: u64,
    /// The part of `bytes_copied` the picks asked for: all of it, less the copies of a
    /// prefetch's wrong guesses (what a limit counts: an engine that guessed nothing would
    /// still move these).
    #[serde(default)]
    pub bytes_needed: u64,
    /// Mapped experts a prefetch had gathered before their layer asked for them.
    #[serde(default)]
    pub prefetch_used: u64,
    /// Host waits on the GPU.
    pub syncs: u64,
    /// Steps that decoded several sequences' tokens at once (one pass over the weights).
    pub batched_steps: u64,
    /// Device memory bandwidth (read + write of a device copy), GB/s, where measured.
    pub hbm_gb_s: f64,
    /// Pinned host-to-device copy bandwidth, GB/s, where measured.
    pub h2d_gb_s: f64,
    /// Seconds the host waited for streamed experts' bytes to land (from the disk or the
    /// host's cache) before staging them for the GPU.
    #[serde(default)]
    pub expert_wait_s: f64,
    /// Seconds the host spent staging streamed experts: copying them into page-locked
    /// buffers and queuing their copies to the GPU.
    #[serde(default)]
    pub expert_stage_s: f64,
    /// Seconds the host waited for a layer's routing to come back (streamed experts: one
    /// synchronisation a layer).
    #[serde(default)]
    pub route_wait_s: f64,
}

impl GpuStats {
    /// The counters since `earlier` (a snapshot of the same engine); sizes and bandwidths as
    /// now.
    pub fn since(&self, earlier: &GpuStats) -> GpuStats {
        GpuStats {
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            bytes_copied: self.bytes_copied.saturating_sub(earlier.bytes_copied),
            bytes_needed: self.bytes_needed.saturating_sub(earlier.bytes_needed),
            prefetch_used: self.prefetch_used.saturating_sub(earlier.prefetch_used),
            syncs: self.syncs.saturating_sub(earlier.syncs),
            batched_steps: self.batched_steps.saturating_sub(earlier.batched_steps),
            expert_wait_s: (self.expert_wait_s - earlier.expert_wait_s).max(0.0),
            expert_stage_s: (self.expert_stage_s - earlier.expert_stage_s).max(0.0),
            route_wait_s: (self.route_wait_s - earlier.route_wait_s).max(0.0),
            ..self.clone()
        }
    }

    /// Experts found in GPU slots / experts asked for (0 when none was asked for).
    pub fn hit_rate(&self) -> f64 {
        crate::experts::cache::hit_rate(self.hits, self.misses)
    }
}

/// The model an engine runs: borrowed (tests, benchmarks), or shared with its owner (a
/// session's `Llm`).
#[derive(Debug, Clone)]
pub enum ModelRef<'m> {
    Borrowed(&'m Model),
    Shared(Arc<Model>),
}

impl std::ops::Deref for ModelRef<'_> {
    type Target = Model;
    fn deref(&self) -> &Model {
        match self {
            ModelRef::Borrowed(m) => m,
            ModelRef::Shared(m) => m,
        }
    }
}

/// Builds the engine of a backend brook-core cannot depend on (brook-cuda) for a model
/// opened from `dir`.
pub type MakeEngine =
    dyn Fn(Arc<Model>, &Path, &OpenOptions) -> Result<Box<dyn Engine>> + Send + Sync;

/// A shareable [`MakeEngine`] for [`OpenOptions::engine`].
#[derive(Clone)]
pub struct EngineMaker(pub Arc<MakeEngine>);

impl std::fmt::Debug for EngineMaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineMaker")
    }
}

/// The one place that turns options into a forward pass: `--backend reference` (the f32
/// oracle), `cpu` (the SIMD kernels) or `cuda` (the plugged-in GPU backend), behind the
/// driver every face uses.
pub fn open(model: &Arc<Model>, dir: &Path, options: &OpenOptions) -> Result<Forward<'static>> {
    let engine: Box<dyn Engine> = match options.backend {
        Backend::Reference => Box::new(Reference::shared(model.clone())),
        Backend::Cpu => {
            let o = crate::cpu::CpuOptions::from_open(options);
            Box::new(crate::cpu::CpuModel::new_shared(model.clone(), o)?)
        }
        Backend::Cuda => match &options.engine {
            Some(make) => (make.0)(model.clone(), dir, options)?,
            None => {
                return Err(Error::Device(
                    "this program was built without the CUDA backend; use --backend cpu".into(),
                ));
            }
        },
    };
    Ok(Forward::with_context(engine, options.context))
}

/// Whether the model's dense weights should be stored in 16-row tiles when it loads: for the
/// CPU engine where AVX-512 VNNI exists (its tile kernels need it; elsewhere the row order's
/// kernels run). Model loading asks here, so it never needs to know the CPU engine.
pub fn tiles_dense(options: &OpenOptions) -> bool {
    options.backend == Backend::Cpu
        && crate::cpu::SimdLevel::detect() == crate::cpu::SimdLevel::Avx512
        && crate::cpu::SimdLevel::has_vnni()
}
