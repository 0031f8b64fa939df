//! Replayed routings on the GPU ([`Routing::Given`]): the experts a step was given, staged
//! for the top-k kernel's replay form.

use brook_core::engine::{Routing, check_given};
use brook_core::{Error, Result};

use crate::gpu::{DevBuf, Pinned};
use crate::model::CudaModel;

/// The experts a step was given ([`Routing::Given`]), [layer][token][k], on the host and on
/// the GPU.
#[derive(Debug)]
pub(crate) struct GivenIds {
    /// The step in flight has given routes.
    pub(crate) on: bool,
    /// Tokens of the step in flight.
    pub(crate) tokens: usize,
    pub(crate) ids: Vec<i32>,
    host: Pinned,
    pub(crate) dev: DevBuf,
}

impl CudaModel {
    /// Puts sequence `seq`'s given experts of a `t`-token step on the GPU ([layer][token][k])
    /// when `routing` gives them; a step's tokens are all given or none.
    pub(crate) fn stage_given(&mut self, routing: Routing<'_>, seq: usize, t: usize) -> Result<()> {
        let Routing::Given(g) = routing else {
            return Ok(());
        };
        let cfg = self.model.cfg.clone();
        let (layers, k, e) = (
            cfg.num_hidden_layers,
            cfg.num_experts_per_tok,
            cfg.num_experts,
        );
        if self.given.is_none() {
            let n = layers * self.opts.max_chunk * k;
            self.given = Some(GivenIds {
                on: false,
                tokens: 0,
                ids: Vec::with_capacity(n),
                host: Pinned::new(&self.gpu, n * 4)?,
                dev: self.gpu.alloc(n * 4, "given routes")?,
            });
        }
        let given = self.given.as_mut().expect("made above");
        given.ids.clear();
        let mut mixed = false;
        for layer in 0..layers {
            for tok in 0..t {
                match g.experts(seq, tok, layer) {
                    Some(ids) => {
                        check_given(ids, k, e, layer)?;
                        given.ids.extend(ids.iter().map(|&x| x as i32));
                    }
                    None => mixed = true,
                }
            }
        }
        if given.ids.is_empty() {
            return Ok(());
        }
        if mixed {
            return Err(Error::Invalid(
                "the cuda engine replays a routing for every token of a step or for none".into(),
            ));
        }
        let bytes = given.ids.len() * 4;
        for (d, x) in given.host.as_mut_slice()[..bytes]
            .chunks_exact_mut(4)
            .zip(&given.ids)
        {
            d.copy_from_slice(&x.to_le_bytes());
        }
        // SAFETY: pinned memory untouched until the next step, which follows this step's
        // final synchronisation; the device buffer holds max_chunk tokens' ids.
        unsafe {
            self.gpu
                .copy_in_async(given.dev.ptr, given.host.ptr(), bytes)?;
        }
        (given.on, given.tokens) = (true, t);
        Ok(())
    }
}
