//! The learned likelihood of reuse behind [`Eviction::Reuse`](super::Eviction::Reuse): the
//! cache's model of which experts a layer's next turn will ask for again.

use crate::routing::replay::{REUSE_CLASSES, Uses};

/// The learned likelihood of reuse behind [`Eviction::Reuse`]: each layer's turns (demand
/// requests), each expert's uses, and for each class of expert (turns since its last use,
/// uses in the last window) how often the layer's next turn asked for it.
#[derive(Debug)]
pub(super) struct ReuseModel {
    /// [layer] requests made so far: the index of the layer's next turn.
    turns: Vec<usize>,
    /// [layer][expert].
    uses: Vec<Vec<Uses>>,
    /// [class] (asked for, seen), from a prior of one in two.
    table: Vec<(f64, f64)>,
    /// The layer whose request is being served, if one is.
    serving: Option<usize>,
    /// Experts a one-token request asks for (top-k; 0: unknown). Only requests of at most
    /// that many teach the table: a prefill turn asks for many experts that no decoded
    /// token wanted, and learning from a 512-expert warm-up made the rule evict the experts
    /// about to return (docs/bench/2026-12-04.md).
    pub(super) top_k: usize,
}

impl ReuseModel {
    pub(super) fn new(layers: usize, experts: usize) -> Self {
        ReuseModel {
            turns: vec![0; layers],
            uses: vec![vec![Uses::default(); experts]; layers],
            table: vec![(1.0, 2.0); REUSE_CLASSES],
            serving: None,
            top_k: 0,
        }
    }

    /// A request of `layer` for `ids` starts: learn how each class of the layer's experts
    /// came back.
    pub(super) fn begin(&mut self, layer: usize, ids: &[usize]) {
        self.serving = Some(layer);
        if self.top_k > 0 && ids.len() > self.top_k {
            return;
        }
        let now = self.turns[layer];
        for (e, u) in self.uses[layer].iter().enumerate() {
            // Every expert seen, the long unused ones too (they share the oldest class): a
            // class never learned would keep its prior of one in two and its experts forever.
            if let Some(c) = u.class_at(now) {
                let cell = &mut self.table[c];
                cell.1 += 1.0;
                if ids.contains(&e) {
                    cell.0 += 1.0;
                }
            }
        }
    }

    /// The request of `layer` for `ids` was served.
    pub(super) fn end(&mut self, layer: usize, ids: &[usize]) {
        let now = self.turns[layer];
        for &e in ids {
            self.uses[layer][e].used(now);
        }
        self.turns[layer] += 1;
        self.serving = None;
    }

    /// (likelihood that expert `e` of `layer` is asked for at the layer's next turn, how
    /// near that turn is: lower is further).
    pub(super) fn score(&self, layer: usize, e: usize) -> (f64, usize) {
        let n = self.turns.len();
        let next = self.turns[layer] + usize::from(self.serving == Some(layer));
        let p = self.uses[layer][e].class_at(next).map_or(0.0, |c| {
            let (h, t) = self.table[c];
            h / t
        });
        // Layers after the one being served come first, then those before it, then it.
        let near = match self.serving {
            Some(s) => (layer + n - s) % n,
            None => 0,
        };
        let near = if near == 0 { n } else { near };
        (p, n - near)
    }
}
