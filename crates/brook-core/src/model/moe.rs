//! The sparse MoE block: router softmax, top-k, renormalised weights, routed SwiGLU experts
//! and the sigmoid-gated shared expert.
//!
//! Mirrors mlx-lm `qwen3_next.Qwen3NextSparseMoeBlock`. Routed experts come from an
//! [`ExpertSource`], so the same code runs with every expert resident or streamed through a
//! cache. All tokens of a call are routed first and each needed expert is fetched once for
//! the whole call.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::experts::source::{ExpertData, ExpertSource, ExpertView};
use crate::model::ops::{sigmoid, silu, softmax};
use crate::model::weights::{Expert, MoeWeights};

impl ExpertData for Expert {
    fn view(&self) -> ExpertView<'_> {
        ExpertView {
            gate_proj: self.gate_proj.view(),
            up_proj: self.up_proj.view(),
            down_proj: self.down_proj.view(),
        }
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

/// y\[H\] = down(silu(gate x) ⊙ up x).
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
