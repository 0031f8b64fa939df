//! Sequence states in GPU memory ([`DeviceSeq`]): what the CUDA engine keeps inside a
//! `SeqState` while it holds it, with the captured decode graph that runs over its buffers,
//! and the ended sequences' states kept for the next ones (`Spares`).

use std::sync::{Arc, Mutex, Weak};

use brook_core::config::{LayerKind, ModelConfig};
use brook_core::model::state::{DeviceState, LayerState, SeqState};
use brook_core::{Error, Result};

use crate::gpu::{DevBuf, Gpu};

/// A sequence's state in GPU memory: per DeltaNet layer its conv rows and recurrent state,
/// per attention layer a key and a value cache of `context` positions.
#[derive(Debug)]
pub struct DeviceSeq {
    gpu: Arc<Gpu>,
    pub(crate) layers: Vec<DevLayer>,
    context: usize,
    kv_row: usize,
    /// The captured one-token decode step over this state's buffers, with the id of the
    /// engine whose scratch it uses.
    pub(crate) graph: Option<(u64, Graph)>,
    /// Where the buffers go when the sequence ends (nowhere once the engine is gone).
    spares: Weak<Mutex<Spares>>,
}

/// The states of ended sequences, buffers and decode graph whole, kept by an engine for its
/// next sequences: a new request then costs clearing two buffers a DeltaNet layer on the
/// stream, not 80 allocations, 60 MB of zeros written on the host and copied over (the 35B)
/// and a graph captured again. At most `cap` are kept; the engine lets the GPU drop them
/// when an allocation would otherwise fail (`Gpu::set_reclaim`).
#[derive(Debug, Default)]
pub(crate) struct Spares {
    held: Vec<Spare>,
    cap: usize,
}

#[derive(Debug)]
struct Spare {
    layers: Vec<DevLayer>,
    context: usize,
    graph: Option<(u64, Graph)>,
}

impl Spares {
    /// A pool that keeps up to `cap` states.
    pub(crate) fn new(cap: usize) -> Arc<Mutex<Spares>> {
        Arc::new(Mutex::new(Spares {
            held: Vec::new(),
            cap,
        }))
    }

    /// Lets go of every state kept; says whether there was one.
    pub(crate) fn release(pool: &Mutex<Spares>) -> bool {
        // Taken out under the lock, freed after it (freeing waits for the stream).
        let held = std::mem::take(&mut pool.lock().unwrap_or_else(|p| p.into_inner()).held);
        !held.is_empty()
    }

    /// A kept state of `context` positions, if any.
    fn take(pool: &Mutex<Spares>, context: usize) -> Option<Spare> {
        let mut p = pool.lock().unwrap_or_else(|p| p.into_inner());
        let i = p.held.iter().position(|s| s.context == context)?;
        Some(p.held.swap_remove(i))
    }
}

impl Drop for DeviceSeq {
    fn drop(&mut self) {
        let Some(pool) = self.spares.upgrade() else {
            return;
        };
        let mut p = pool.lock().unwrap_or_else(|p| p.into_inner());
        if p.held.len() < p.cap && !self.layers.is_empty() {
            p.held.push(Spare {
                layers: std::mem::take(&mut self.layers),
                context: self.context,
                graph: self.graph.take(),
            });
        }
    }
}

/// An instantiated CUDA graph. It holds its GPU, so the context it was made in outlives it
/// wherever it is kept (a state kept for reuse may be the last holder of the GPU).
#[derive(Debug)]
pub(crate) struct Graph {
    pub(crate) graph: cudarc::driver::sys::CUgraph,
    pub(crate) exec: cudarc::driver::sys::CUgraphExec,
    gpu: Arc<Gpu>,
}

// SAFETY: plain driver handles, used under the engine's lock.
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}

impl Graph {
    /// Records what `queue` puts on `gpu`'s stream as an instantiated graph. `Ok(None)` (the
    /// reason logged, `then` saying what runs instead): the work could not be captured or
    /// instantiated, nothing ran, and it is to run unrecorded. `Err`: the capture could not
    /// start.
    pub(crate) fn capture(
        gpu: &Arc<Gpu>,
        then: &str,
        queue: impl FnOnce() -> Result<()>,
    ) -> Result<Option<Graph>> {
        use cudarc::driver::{result, sys};
        let stream = gpu.stream;
        // SAFETY: a live stream; relaxed mode lets other threads use the driver meanwhile.
        unsafe {
            result::stream::begin_capture(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .map_err(|e| crate::gpu::err("starting a graph capture", e))?;
        let queued = queue();
        // SAFETY: ends the capture begun above, whatever happened in between.
        let graph = unsafe { result::stream::end_capture(stream) };
        let graph = match (queued, graph) {
            (Ok(()), Ok(g)) => g,
            (q, g) => {
                if let Ok(g) = g {
                    // SAFETY: destroy the graph we own.
                    let _ = unsafe { result::graph::destroy(g) };
                }
                tracing::warn!("CUDA graph capture failed ({q:?}); {then}");
                return Ok(None);
            }
        };
        // SAFETY: a graph just captured.
        match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(exec) => Ok(Some(Graph {
                graph,
                exec,
                gpu: gpu.clone(),
            })),
            Err(e) => {
                // SAFETY: destroy the graph we own.
                let _ = unsafe { result::graph::destroy(graph) };
                tracing::warn!("CUDA graph instantiation failed ({e}); {then}");
                Ok(None)
            }
        }
    }

    /// Queues one replay on `gpu`'s stream (`what` names it in an error); the buffers it was
    /// captured over must be alive.
    pub(crate) fn launch(&self, gpu: &Gpu, what: &str) -> Result<()> {
        gpu.queued_other();
        // SAFETY: an instantiated graph; its buffers live (the caller's contract).
        unsafe { cudarc::driver::result::graph::launch(self.exec, gpu.stream) }
            .map_err(|e| crate::gpu::err(what, e))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // In its own context, which the held GPU keeps alive (any thread may drop a graph).
        let _ = self.gpu.bind();
        // SAFETY: created once by instantiate/end_capture, destroyed once.
        unsafe {
            let _ = cudarc::driver::result::graph::exec_destroy(self.exec);
            let _ = cudarc::driver::result::graph::destroy(self.graph);
        }
    }
}

#[derive(Debug)]
pub(crate) enum DevLayer {
    Linear { conv: DevBuf, ssm: DevBuf },
    Full { k: DevBuf, v: DevBuf },
}

impl DeviceSeq {
    pub(crate) fn new(gpu: &Arc<Gpu>, cfg: &ModelConfig, context: usize) -> Result<DeviceSeq> {
        let (conv, ssm) = (cfg.conv_state_len(), cfg.ssm_state_len());
        let kv_row = cfg.num_key_value_heads * cfg.head_dim;
        let layers = cfg
            .layer_types
            .iter()
            .map(|k| {
                Ok(match k {
                    LayerKind::Linear => DevLayer::Linear {
                        conv: gpu.zeros(conv * 4, "DeltaNet state")?,
                        ssm: gpu.zeros(ssm * 4, "DeltaNet state")?,
                    },
                    LayerKind::Full => DevLayer::Full {
                        k: gpu.alloc(context * kv_row * 4, "KV cache")?,
                        v: gpu.alloc(context * kv_row * 4, "KV cache")?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceSeq {
            gpu: gpu.clone(),
            layers,
            context,
            kv_row,
            graph: None,
            spares: Weak::new(),
        })
    }

    /// A cleared state for a new sequence of `context` positions: a kept one from `spares`
    /// (its recurrent states zeroed on the stream, its graph kept) or new buffers. It goes
    /// back to `spares` when the sequence ends.
    pub(crate) fn fresh(
        gpu: &Arc<Gpu>,
        cfg: &ModelConfig,
        context: usize,
        spares: &Arc<Mutex<Spares>>,
    ) -> Result<DeviceSeq> {
        let mut d = match Spares::take(spares, context) {
            Some(s) => {
                for l in &s.layers {
                    if let DevLayer::Linear { conv, ssm } = l {
                        conv.zero()?;
                        ssm.zero()?;
                    }
                }
                DeviceSeq {
                    gpu: gpu.clone(),
                    layers: s.layers,
                    context,
                    kv_row: cfg.num_key_value_heads * cfg.head_dim,
                    graph: s.graph,
                    spares: Weak::new(),
                }
            }
            None => DeviceSeq::new(gpu, cfg, context)?,
        };
        d.spares = Arc::downgrade(spares);
        Ok(d)
    }

    /// Bytes a state of `context` positions takes (for planning).
    pub fn bytes(cfg: &ModelConfig, context: usize) -> u64 {
        let (conv, ssm) = (cfg.conv_state_len(), cfg.ssm_state_len());
        let kv = 2 * context * cfg.num_key_value_heads * cfg.head_dim;
        cfg.layer_types
            .iter()
            .map(|k| match k {
                LayerKind::Linear => ((conv + ssm) * 4) as u64,
                LayerKind::Full => (kv * 4) as u64,
            })
            .sum()
    }

    /// Uploads a host state (into buffers from `spares` where it keeps some).
    pub(crate) fn from_host(
        gpu: &Arc<Gpu>,
        cfg: &ModelConfig,
        st: &SeqState,
        context: usize,
        spares: &Arc<Mutex<Spares>>,
    ) -> Result<Self> {
        if st.pos > context {
            return Err(Error::Invalid(format!(
                "the state holds {} tokens, more than the context of {context}",
                st.pos
            )));
        }
        let d = DeviceSeq::fresh(gpu, cfg, context, spares)?;
        for (i, (dl, hl)) in d.layers.iter().zip(&st.layers).enumerate() {
            match (dl, hl) {
                (DevLayer::Linear { conv, ssm }, LayerState::Linear { conv: hc, ssm: hs })
                    if hc.len() * 4 == conv.bytes && hs.len() * 4 == ssm.bytes =>
                {
                    conv.write(hc)?;
                    ssm.write(hs)?;
                }
                (DevLayer::Full { k, v }, LayerState::Full { keys, values })
                    if keys.len() == st.pos * d.kv_row && values.len() == keys.len() =>
                {
                    k.write(keys)?;
                    v.write(values)?;
                }
                _ => {
                    return Err(Error::Invalid(format!(
                        "state does not fit layer {i}: make it with new_state"
                    )));
                }
            }
        }
        Ok(d)
    }
}

impl DeviceState for DeviceSeq {
    /// Copies the recurrent states and the first `pos` rows of each KV cache (the rest is
    /// not written yet), into buffers of the same sizes.
    fn duplicate(&self, pos: usize) -> Result<Box<dyn DeviceState>> {
        self.gpu.bind()?;
        let t0 = std::time::Instant::now();
        let kv_bytes = pos.min(self.context) * self.kv_row * 4;
        // A kept state's buffers (and graph) where the engine has one, else new ones.
        let spare = (self.spares.upgrade()).and_then(|p| Spares::take(&p, self.context));
        let reused = spare.is_some();
        let (layers, graph) = match spare {
            Some(s) => (s.layers, s.graph),
            None => {
                let alloc = |b: &DevBuf| self.gpu.alloc(b.bytes, "a copy of a sequence state");
                let layers = (self.layers.iter())
                    .map(|l| {
                        Ok(match l {
                            DevLayer::Linear { conv, ssm } => DevLayer::Linear {
                                conv: alloc(conv)?,
                                ssm: alloc(ssm)?,
                            },
                            DevLayer::Full { k, v } => DevLayer::Full {
                                k: alloc(k)?,
                                v: alloc(v)?,
                            },
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                (layers, None)
            }
        };
        let copy = |to: &DevBuf, from: &DevBuf, used: usize| -> Result<()> {
            if to.bytes != from.bytes {
                return Err(Error::Invalid(
                    "a kept sequence state has another layout".into(),
                ));
            }
            if used > 0 {
                self.gpu.copy_dd(to.ptr, from.ptr, used.min(from.bytes))?;
            }
            Ok(())
        };
        for (to, from) in layers.iter().zip(&self.layers) {
            match (to, from) {
                (DevLayer::Linear { conv, ssm }, DevLayer::Linear { conv: c, ssm: s }) => {
                    copy(conv, c, c.bytes)?;
                    copy(ssm, s, s.bytes)?;
                }
                (DevLayer::Full { k, v }, DevLayer::Full { k: k0, v: v0 }) => {
                    copy(k, k0, kv_bytes)?;
                    copy(v, v0, kv_bytes)?;
                }
                _ => {
                    return Err(Error::Invalid(
                        "a kept sequence state has another layout".into(),
                    ));
                }
            }
        }
        self.gpu.sync()?;
        tracing::debug!(
            pos,
            ms = t0.elapsed().as_secs_f64() * 1e3,
            reused,
            "copied a GPU sequence state"
        );
        Ok(Box::new(DeviceSeq {
            gpu: self.gpu.clone(),
            layers,
            context: self.context,
            kv_row: self.kv_row,
            graph,
            spares: self.spares.clone(),
        }))
    }

    fn holds_every_layer(&self) -> bool {
        true
    }

    fn download(&self, layers: &mut [LayerState], pos: usize) -> Result<()> {
        self.gpu.bind()?;
        for (dl, hl) in self.layers.iter().zip(layers.iter_mut()) {
            match (dl, hl) {
                (DevLayer::Linear { conv, ssm }, LayerState::Linear { conv: hc, ssm: hs }) => {
                    *hc = conv.read()?;
                    *hs = ssm.read()?;
                }
                (DevLayer::Full { k, v }, LayerState::Full { keys, values }) => {
                    let n = pos * self.kv_row;
                    keys.resize(n, 0.0);
                    values.resize(n, 0.0);
                    self.gpu.copy_out(k.ptr, keys)?;
                    self.gpu.copy_out(v.ptr, values)?;
                }
                _ => return Err(Error::Invalid("state layout changed".into())),
            }
        }
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
