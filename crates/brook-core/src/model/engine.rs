//! [`Engine`]: a forward pass over a loaded [`Model`] that keeps its own buffers (the CPU
//! kernels, a GPU backend). Sessions and the CLI run whichever one the options chose.

use std::path::Path;
use std::sync::Arc;

use crate::error::Result;
use crate::model::open::OpenOptions;
use crate::model::state::SeqState;
use crate::model::{Logits, Model};

/// A forward pass: feeds `tokens` into `state` and returns the logits asked for ([T, V], [V]
/// or empty), as [`Model::forward`] does.
pub trait Engine: Send + std::fmt::Debug {
    fn forward(&mut self, state: &mut SeqState, tokens: &[u32], want: Logits) -> Result<&[f32]>;
    /// A short name for logs and benchmarks ("cpu", "cuda").
    fn name(&self) -> &'static str;
    /// A fresh state for `model`, with room reserved for `reserve_tokens` where the engine
    /// keeps the state on the host.
    fn new_state(&self, model: &Model, reserve_tokens: usize) -> SeqState {
        let _ = reserve_tokens;
        model.new_state()
    }
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
    pub hits: u64,
    pub misses: u64,
    /// Expert bytes copied from the host into GPU slots.
    pub bytes_copied: u64,
    /// Host waits on the GPU.
    pub syncs: u64,
    /// Device memory bandwidth (read + write of a device copy), GB/s, where measured.
    pub hbm_gb_s: f64,
    /// Pinned host-to-device copy bandwidth, GB/s, where measured.
    pub h2d_gb_s: f64,
}

impl Engine for crate::cpu::CpuModel<'static> {
    fn forward(&mut self, state: &mut SeqState, tokens: &[u32], want: Logits) -> Result<&[f32]> {
        crate::cpu::CpuModel::forward(self, state, tokens, want)
    }
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn new_state(&self, _model: &Model, reserve_tokens: usize) -> SeqState {
        crate::cpu::CpuModel::new_state(self, reserve_tokens)
    }
}

/// Builds an [`Engine`] for a model opened from `dir` with the given options. Crates that
/// brook-core cannot depend on (brook-cuda) plug their backend in through this.
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
