//! The contracts between the model and where its routed experts come from: an
//! [`ExpertSource`] hands out [`ExpertHandle`]s whose [`ExpertData::view`] borrows one
//! expert's weights as an [`ExpertView`].
//!
//! They sit below both sides: the model's owned experts (`crate::model::weights::Expert`) and
//! [`ResidentExperts`] implement them, the streaming cache (`crate::experts::cache`)
//! implements them over its slots, and the engines consume them. Nothing here reads files or
//! computes.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::linear::LinearRef;

/// Borrowed weights of one SwiGLU expert.
#[derive(Debug, Clone, Copy)]
pub struct ExpertView<'a> {
    pub gate_proj: LinearRef<'a>, // [I, H]
    pub up_proj: LinearRef<'a>,   // [I, H]
    pub down_proj: LinearRef<'a>, // [H, I]
}

/// Anything holding one expert's weights: an owned [`Expert`] or a cache slot.
///
/// [`Expert`]: crate::model::weights::Expert
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
