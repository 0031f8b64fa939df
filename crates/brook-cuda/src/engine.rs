//! The [`Engine`] face of [`CudaModel`]: what the driver, sessions and the server call.

use brook_core::engine::{Caps, Engine, GpuStats, Routing, Step};
use brook_core::model::state::SeqState;
use brook_core::model::{Logits, Model};
use brook_core::{Error, Result};

use crate::model::CudaModel;
use crate::state::DeviceSeq;

impl Engine for CudaModel {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn model(&self) -> &Model {
        &self.model
    }

    fn caps(&self) -> Caps {
        Caps {
            max_chunk: self.opts.max_chunk,
            max_seqs: self.opts.max_seqs,
            // A prompt's chunk fits beside a decoded token of every other sequence.
            max_tokens: self.opts.max_chunk + self.opts.max_seqs,
            given_routes: true,
            trace: false,
        }
    }

    /// A state on the GPU already, cleared there (an ended sequence's buffers where one is
    /// kept), so a new sequence uploads nothing; the host layout if the GPU cannot make one
    /// now, which `place` then uploads (or reports why not).
    fn new_state(&self, _reserve_tokens: usize) -> SeqState {
        let made = self.gpu.bind().and_then(|()| {
            DeviceSeq::fresh(&self.gpu, &self.model.cfg, self.opts.context, &self.spares)
        });
        match made {
            Ok(d) => SeqState::held(&self.model.cfg, Box::new(d)),
            Err(e) => {
                tracing::debug!("a new sequence's state starts on the host: {e}");
                self.model.new_state()
            }
        }
    }

    fn place(&mut self, state: &mut SeqState, tokens: usize) -> Result<()> {
        self.gpu.bind()?;
        if state.pos + tokens > self.opts.context {
            return Err(Error::Invalid(format!(
                "context full: {} + {tokens} tokens exceed the context of {} (open with a larger --context)",
                state.pos, self.opts.context
            )));
        }
        let ours = state
            .device
            .as_mut()
            .is_some_and(|d| d.as_any_mut().downcast_mut::<DeviceSeq>().is_some());
        if !ours {
            state.sync_host()?;
            let (cfg, context) = (&self.model.cfg, self.opts.context);
            let d = DeviceSeq::from_host(&self.gpu, cfg, state, context, &self.spares)?;
            state.device = Some(Box::new(d));
        }
        Ok(())
    }

    fn step(&mut self, step: Step<'_, '_>) -> Result<()> {
        for s in step.seqs.iter_mut() {
            let row = match s.want {
                Logits::Best => !self.picks,
                Logits::Top(_) => !(self.picks && self.tops),
                _ => false,
            };
            if row {
                s.want = Logits::Last;
            }
        }
        // Decoded tokens and small chunks of several sequences run as batched steps where
        // the engine can (every expert resident, the router's own routes, batch.rs).
        if !matches!(step.routing, Routing::Given(_)) && self.step_rounds(step.seqs)? {
            return Ok(());
        }
        for (i, s) in step.seqs.iter_mut().enumerate() {
            self.stage_given(step.routing, i, s.tokens.len())?;
            let r = self.step_one(s.state, s.tokens, s.want, s.logits);
            if let Some(g) = &mut self.given {
                g.on = false;
            }
            r?;
        }
        Ok(())
    }

    fn gpu_stats(&self) -> Option<GpuStats> {
        let c = match self.experts.counters() {
            Ok(c) => c,
            Err(e) => {
                // The next step reports the GPU's failure; the counters fall back to the host's.
                tracing::warn!("reading the GPU's expert pick counts: {e}");
                self.experts.stats
            }
        };
        Some(GpuStats {
            device: self.gpu.name.clone(),
            budget_bytes: self.gpu.budget,
            used_bytes: self.gpu.used(),
            slots: self.experts.nslots,
            resident: self.experts.resident,
            mapped: self.experts.mapped,
            hits: c.hits,
            misses: c.misses,
            bytes_copied: c.bytes,
            bytes_needed: c.needed,
            prefetch_used: c.prefetch_used,
            syncs: self.syncs,
            batched_steps: self.batched_steps,
            hbm_gb_s: 0.0,
            h2d_gb_s: 0.0,
            expert_wait_s: c.wait_s,
            expert_stage_s: c.stage_s,
            route_wait_s: self.route_s,
        })
    }
}
