//! The sparse MoE block: router softmax, top-k, renormalised weights, routed SwiGLU experts
//! and the sigmoid-gated shared expert.
//!
//! Mirrors mlx-lm `qwen3_next.Qwen3NextSparseMoeBlock`. Routed experts come from an
//! [`ExpertSource`], so the same code runs with every expert resident or streamed through a
//! cache. All tokens of a call are routed first and each needed expert is fetched once for
//! the whole call.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::linear::LinearRef;
use crate::model::ops::{sigmoid, silu, softmax};
use crate::model::weights::{Expert, MoeWeights};

/// Borrowed weights of one SwiGLU expert.
#[derive(Debug, Clone, Copy)]
pub struct ExpertView<'a> {
    pub gate_proj: LinearRef<'a>, // [I, H]
    pub up_proj: LinearRef<'a>,   // [I, H]
    pub down_proj: LinearRef<'a>, // [H, I]
}

/// Anything holding one expert's weights: an owned [`Expert`] or a cache slot.
pub trait ExpertData: Send + Sync + std::fmt::Debug {
    /// Blocks until the weights are in memory; an I/O error surfaces here.
    fn wait(&self) -> Result<()> {
        Ok(())
    }
    /// Whether [`ExpertData::wait`] would return at once (the read finished, or failed).
    fn landed(&self) -> bool {
        true
    }
    /// The weights. Call [`ExpertData::wait`] first to see read errors.
    fn view(&self) -> ExpertView<'_>;
}

impl ExpertData for Expert {
    fn view(&self) -> ExpertView<'_> {
        ExpertView {
            gate_proj: self.gate_proj.view(),
            up_proj: self.up_proj.view(),
            down_proj: self.down_proj.view(),
        }
    }
}

/// A fetched expert, kept alive (and, in a cache, pinned) while it is held.
pub type ExpertHandle = Arc<dyn ExpertData>;

/// Where routed experts come from.
pub trait ExpertSource: Send + Sync + std::fmt::Debug {
    /// Handles on the experts `ids` of `layer`, in the order asked. Reads that are needed
    /// start now; each handle's [`ExpertData::wait`] blocks until its expert has landed.
    fn fetch(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>>;
    /// A hint that `ids` of `layer` will probably be fetched soon.
    fn prefetch(&self, _layer: usize, _ids: &[usize]) {}
    /// Cache counters, where there is a cache.
    fn stats(&self) -> Option<crate::experts::CacheStats> {
        None
    }
    /// Most experts that can be held at once.
    fn capacity(&self) -> usize {
        usize::MAX
    }
    /// Like [`ExpertSource::fetch`], appending to `out`. Sources that can should override it
    /// so a caller with a reserved `out` allocates nothing (the CPU decode step relies on it).
    fn fetch_into(&self, layer: usize, ids: &[usize], out: &mut Vec<ExpertHandle>) -> Result<()> {
        out.extend(self.fetch(layer, ids)?);
        Ok(())
    }
}

/// Every routed expert held in memory: `[layer][expert]`.
#[derive(Debug, Default)]
pub struct ResidentExperts {
    pub layers: Vec<Vec<ExpertHandle>>,
}

impl ExpertSource for ResidentExperts {
    fn fetch(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>> {
        let mut out = Vec::with_capacity(ids.len());
        self.fetch_into(layer, ids, &mut out)?;
        Ok(out)
    }

    fn fetch_into(&self, layer: usize, ids: &[usize], out: &mut Vec<ExpertHandle>) -> Result<()> {
        for &e in ids {
            let h = self.layers.get(layer).and_then(|l| l.get(e));
            let h = h.ok_or_else(|| Error::Invalid(format!("no expert {e} in layer {layer}")))?;
            out.push(h.clone());
        }
        Ok(())
    }
}

/// The experts chosen for one token and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Routes one token: softmax over all experts, top-k, renormalised if the config says so.
pub fn route(w: &MoeWeights, cfg: &ModelConfig, x: &[f32]) -> Route {
    let mut p = vec![0.0; cfg.num_experts];
    w.gate.forward(x, &mut p);
    softmax(&mut p);
    let mut order: Vec<usize> = (0..p.len()).collect();
    // Highest probability first; equal probabilities keep the lower index first.
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order.truncate(cfg.num_experts_per_tok);
    let mut weights: Vec<f32> = order.iter().map(|&e| p[e]).collect();
    if cfg.norm_topk_prob {
        let sum: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|v| *v /= sum);
    }
    Route {
        experts: order,
        weights,
    }
}

/// y[H] = down(silu(gate x) ⊙ up x).
pub fn swiglu(e: ExpertView<'_>, x: &[f32], y: &mut [f32]) {
    let width = e.gate_proj.out_features;
    let mut g = vec![0.0; width];
    let mut u = vec![0.0; width];
    e.gate_proj.forward(x, &mut g);
    e.up_proj.forward(x, &mut u);
    for (gi, ui) in g.iter_mut().zip(&u) {
        *gi = silu(*gi) * ui;
    }
    e.down_proj.forward(&g, y);
}

/// Runs the MoE block of `layer` on x[T, H], writing out[T, H]; returns each token's route.
///
/// Each token's routed contributions are added in ascending expert id, then the shared
/// expert's, whatever the cache holds: the needed experts are fetched in ascending batches no
/// larger than the source's capacity, so every expert is read at most once per call and the
/// sums do not depend on the cache size.
pub fn forward(
    w: &MoeWeights,
    cfg: &ModelConfig,
    experts: &dyn ExpertSource,
    layer: usize,
    x: &[f32],
    out: &mut [f32],
) -> Result<Vec<Route>> {
    let h = cfg.hidden_size;
    let routes: Vec<Route> = x.chunks_exact(h).map(|xt| route(w, cfg, xt)).collect();
    let mut needed: Vec<usize> = routes
        .iter()
        .flat_map(|r| r.experts.iter().copied())
        .collect();
    needed.sort_unstable();
    needed.dedup();
    out.iter_mut().for_each(|v| *v = 0.0);
    let mut shared = vec![0.0; x.len()];
    let mut y = vec![0.0; h];
    let mut g = [0.0f32];
    let batch = experts.capacity().max(1);
    let mut batches = needed.chunks(batch);
    let mut next = batches
        .next()
        .map(|ids| (ids, experts.fetch(layer, ids)))
        .transpose_ok()?;
    // The shared expert computes while the first batch's reads are in flight.
    for (xt, st) in x.chunks_exact(h).zip(shared.chunks_exact_mut(h)) {
        swiglu(w.shared_expert.view(), xt, &mut y);
        w.shared_expert_gate.forward(xt, &mut g);
        let gs = sigmoid(g[0]);
        st.iter_mut().zip(&y).for_each(|(o, v)| *o = gs * v);
    }
    while let Some((ids, handles)) = next {
        for (&e, handle) in ids.iter().zip(&handles) {
            handle.wait()?;
            let view = handle.view();
            for ((xt, ot), r) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)).zip(&routes) {
                if let Some(k) = r.experts.iter().position(|&x| x == e) {
                    swiglu(view, xt, &mut y);
                    let we = r.weights[k];
                    ot.iter_mut().zip(&y).for_each(|(o, v)| *o += we * v);
                }
            }
        }
        drop(handles);
        next = batches
            .next()
            .map(|ids| (ids, experts.fetch(layer, ids)))
            .transpose_ok()?;
    }
    out.iter_mut().zip(&shared).for_each(|(o, s)| *o += s);
    Ok(routes)
}

trait TransposeOk<A, T> {
    fn transpose_ok(self) -> Result<Option<(A, T)>>;
}

impl<A, T> TransposeOk<A, T> for Option<(A, Result<T>)> {
    fn transpose_ok(self) -> Result<Option<(A, T)>> {
        match self {
            None => Ok(None),
            Some((a, r)) => r.map(|t| Some((a, t))),
        }
    }
}
