//! [`CudaModel`]: the whole forward pass on the GPU, decode and prefill.
//!
//! Mirrors `CpuModel` stage for stage (embedding, per layer: norm, DeltaNet or gated
//! attention, norm, router and top-k, shared expert, routed experts, combine; final norm and
//! head). The sequence state lives in GPU memory as a [`DeviceSeq`] inside the caller's
//! `SeqState`. Host synchronisations: one per forward call (reading the logits, or the end
//! of a prefill chunk), plus one per layer when experts stream (to learn the routing).

use std::path::Path;
use std::sync::Arc;

use brook_core::config::{LayerKind, ModelConfig};
use brook_core::model::engine::Engine;
use brook_core::model::open::OpenOptions;
use brook_core::model::state::{DeviceState, LayerState, SeqState};
use brook_core::model::{Logits, Model};
use brook_core::{Error, Result};

use crate::experts::{GpuCacheStats, GpuExperts, layouts};
use crate::gpu::{Args, DevBuf, Gpu, Pinned, fmt_gib};
use crate::ops;
use crate::weights::{DenseGpu, Mat, MixerGpu};

/// How a [`CudaModel`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// GPU ordinal.
    pub device: usize,
    /// Ceiling on GPU memory; `None` uses what is free.
    pub gpu_memory_budget: Option<u64>,
    /// Exact number of GPU expert slots (overrides the budget's choice).
    pub expert_slots: Option<usize>,
    /// Tokens per prefill chunk.
    pub max_chunk: usize,
    /// Longest sequence a state holds.
    pub context: usize,
    /// Capture decode steps as CUDA graphs where possible.
    pub graphs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            gpu_memory_budget: None,
            expert_slots: None,
            max_chunk: 256,
            context: 4096,
            graphs: true,
        }
    }
}

/// Scratch for chunks of up to `c` tokens.
#[derive(Debug)]
struct Scratch {
    x: DevBuf,
    normed: DevBuf,
    delta: DevBuf,
    // DeltaNet
    qkv: DevBuf,
    conv: DevBuf,
    z: DevBuf,
    b: DevBuf,
    a: DevBuf,
    beta: DevBuf,
    g: DevBuf,
    o: DevBuf,
    y: DevBuf,
    // attention
    qg: DevBuf,
    k: DevBuf,
    v: DevBuf,
    q: DevBuf,
    gate: DevBuf,
    att: DevBuf,
    // MoE
    rlog: DevBuf,
    sel: DevBuf,
    wts: DevBuf,
    counts: DevBuf,
    offs: DevBuf,
    fill: DevBuf,
    pairs: DevBuf,
    gu: DevBuf,
    h: DevBuf,
    ey: DevBuf,
    sgu: DevBuf,
    sh: DevBuf,
    sout: DevBuf,
    sg: DevBuf,
    // inputs and outputs
    tokens: DevBuf,
    meta: DevBuf,
    logits: DevBuf,
    inv_freq: DevBuf,
}

impl Scratch {
    fn new(gpu: &Arc<Gpu>, cfg: &ModelConfig, c: usize) -> Result<Scratch> {
        let f = |n: usize, what: &str| gpu.alloc(n * 4, what);
        let h = cfg.hidden_size;
        let (nv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
        let cd = cfg.conv_dim();
        let (nq, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (e, k, i) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
        );
        let is = cfg.shared_expert_intermediate_size;
        let inv: Vec<f64> = (0..cfg.rotary_dim / 2)
            .map(|j| cfg.rope_theta.powf(-2.0 * j as f64 / cfg.rotary_dim as f64))
            .collect();
        Ok(Scratch {
            x: f(c * h, "activations")?,
            normed: f(c * h, "activations")?,
            delta: f(c * h, "activations")?,
            // One-token steps put z after qkv, a after b, k after the queries and the shared
            // expert's gate after the router logits (one launch each pair).
            qkv: f(c * cd + nv * dv, "DeltaNet scratch")?,
            conv: f(c * cd, "DeltaNet scratch")?,
            z: f(c * nv * dv, "DeltaNet scratch")?,
            b: f(c * nv + nv, "DeltaNet scratch")?,
            a: f(c * nv, "DeltaNet scratch")?,
            beta: f(c * nv, "DeltaNet scratch")?,
            g: f(c * nv, "DeltaNet scratch")?,
            o: f(c * nv * dv, "DeltaNet scratch")?,
            y: f(c * nv * dv, "DeltaNet scratch")?,
            qg: f(c * nq * hd * 2 + nkv * hd, "attention scratch")?,
            k: f(c * nkv * hd, "attention scratch")?,
            v: f(c * nkv * hd, "attention scratch")?,
            q: f(c * nq * hd, "attention scratch")?,
            gate: f(c * nq * hd, "attention scratch")?,
            att: f(c * nq * hd, "attention scratch")?,
            rlog: f(c * e + 1, "router scratch")?,
            sel: f(c * k, "router scratch")?,
            wts: f(c * k, "router scratch")?,
            counts: f(e, "router scratch")?,
            offs: f(e, "router scratch")?,
            fill: f(e, "router scratch")?,
            pairs: f(c * k, "router scratch")?,
            gu: f(c * k * 2 * i, "expert scratch")?,
            h: f(c * k * i, "expert scratch")?,
            ey: f(c * k * h, "expert scratch")?,
            sgu: f(c * 2 * is, "shared expert scratch")?,
            sh: f(c * is, "shared expert scratch")?,
            sout: f(c * h, "shared expert scratch")?,
            sg: f(c, "shared expert scratch")?,
            tokens: f(c, "tokens")?,
            meta: f(4, "positions")?,
            logits: f(cfg.vocab_size, "logits")?,
            inv_freq: gpu.upload(&inv, "RoPE frequencies")?,
        })
    }
}

/// A sequence's state in GPU memory: per DeltaNet layer its conv rows and recurrent state,
/// per attention layer a key and a value cache of `context` positions.
#[derive(Debug)]
pub struct DeviceSeq {
    gpu: Arc<Gpu>,
    layers: Vec<DevLayer>,
    context: usize,
    kv_row: usize,
    /// The captured one-token decode step over this state's buffers, with the id of the
    /// engine whose scratch it uses.
    graph: Option<(u64, Graph)>,
}

/// An instantiated CUDA graph.
#[derive(Debug)]
struct Graph {
    graph: cudarc::driver::sys::CUgraph,
    exec: cudarc::driver::sys::CUgraphExec,
}

// SAFETY: plain driver handles, used under the engine's lock.
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created once by instantiate/end_capture, destroyed once.
        unsafe {
            let _ = cudarc::driver::result::graph::exec_destroy(self.exec);
            let _ = cudarc::driver::result::graph::destroy(self.graph);
        }
    }
}

#[derive(Debug)]
enum DevLayer {
    Linear { conv: DevBuf, ssm: DevBuf },
    Full { k: DevBuf, v: DevBuf },
}

impl DeviceSeq {
    fn new(gpu: &Arc<Gpu>, cfg: &ModelConfig, context: usize) -> Result<DeviceSeq> {
        let conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim();
        let ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim;
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
        })
    }

    /// Bytes a state of `context` positions takes (for planning).
    fn bytes(cfg: &ModelConfig, context: usize) -> u64 {
        let conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim();
        let ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim;
        let kv = 2 * context * cfg.num_key_value_heads * cfg.head_dim;
        cfg.layer_types
            .iter()
            .map(|k| match k {
                LayerKind::Linear => ((conv + ssm) * 4) as u64,
                LayerKind::Full => (kv * 4) as u64,
            })
            .sum()
    }

    /// Uploads a host state.
    fn from_host(gpu: &Arc<Gpu>, cfg: &ModelConfig, st: &SeqState, context: usize) -> Result<Self> {
        if st.pos > context {
            return Err(Error::Invalid(format!(
                "the state holds {} tokens, more than the context of {context}",
                st.pos
            )));
        }
        let d = DeviceSeq::new(gpu, cfg, context)?;
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
    fn duplicate(&self) -> Result<Box<dyn DeviceState>> {
        self.gpu.bind()?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let copy = |b: &DevBuf| -> Result<DevBuf> {
                let n = self.gpu.alloc(b.bytes, "a copy of a sequence state")?;
                self.gpu.copy_dd(n.ptr, b.ptr, b.bytes)?;
                Ok(n)
            };
            layers.push(match l {
                DevLayer::Linear { conv, ssm } => DevLayer::Linear {
                    conv: copy(conv)?,
                    ssm: copy(ssm)?,
                },
                DevLayer::Full { k, v } => DevLayer::Full {
                    k: copy(k)?,
                    v: copy(v)?,
                },
            });
        }
        self.gpu.sync()?;
        Ok(Box::new(DeviceSeq {
            gpu: self.gpu.clone(),
            layers,
            context: self.context,
            kv_row: self.kv_row,
            graph: None,
        }))
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

/// The forward pass on one GPU over a [`Model`] (whose host copy supplies the experts).
#[derive(Debug)]
pub struct CudaModel {
    model: Arc<Model>,
    pub gpu: Arc<Gpu>,
    dense: DenseGpu,
    pub experts: GpuExperts,
    s: Scratch,
    opts: CudaOptions,
    host_in: Pinned,
    logits: Vec<f32>,
    /// Host synchronisations so far (for the benchmark's count per token).
    pub syncs: u64,
    /// Replay one-token decode steps as CUDA graphs (when every expert is resident).
    pub graphs: bool,
    id: u64,
}

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl CudaModel {
    /// Uploads the dense core, sizes the expert slots from the GPU budget (every expert
    /// resident when they fit) and compiles the kernels.
    pub fn new(model: Arc<Model>, opts: CudaOptions) -> Result<CudaModel> {
        let gpu = Gpu::open(opts.device, opts.gpu_memory_budget)?;
        let cfg = model.cfg.clone();
        if opts.max_chunk == 0 {
            return Err(Error::Invalid("max_chunk must be at least 1".into()));
        }
        let dense = DenseGpu::upload(&gpu, &model)?;
        let s = Scratch::new(&gpu, &cfg, opts.max_chunk)?;
        let (mats, slot_bytes) = layouts(&model)?;
        let total = cfg.num_hidden_layers * cfg.num_experts;
        let k = cfg.num_experts_per_tok;
        let nslots = match opts.expert_slots {
            Some(n) => n.clamp(k, total),
            None => {
                // Keep room for one sequence state of the full context and a little slack.
                let reserve = DeviceSeq::bytes(&cfg, opts.context) + (64 << 20);
                let left = gpu.budget.saturating_sub(gpu.used() + reserve);
                let n = (left / slot_bytes as u64) as usize;
                if n < k {
                    let need = gpu.used() + reserve + (k * slot_bytes) as u64;
                    return Err(Error::Device(format!(
                        "a GPU memory budget of {} cannot hold the dense core, the state and {k} expert slots; it needs at least {}",
                        fmt_gib(gpu.budget),
                        fmt_gib(need)
                    )));
                }
                n.min(total)
            }
        };
        let experts = GpuExperts::new(&gpu, &model, mats, slot_bytes, nslots)?;
        tracing::info!(
            "CUDA on {} (sm_{}{}, {} SMs): {} of GPU memory in use, {} expert slots of {}{}",
            gpu.name,
            gpu.cc.0,
            gpu.cc.1,
            gpu.sms,
            fmt_gib(gpu.used()),
            experts.nslots,
            fmt_gib(slot_bytes as u64),
            if experts.resident {
                " (every expert resident)"
            } else {
                ""
            }
        );
        let host_in = Pinned::new(&gpu, (opts.max_chunk + 4) * 4)?;
        Ok(CudaModel {
            logits: vec![0.0; cfg.vocab_size],
            model,
            gpu,
            dense,
            experts,
            s,
            opts,
            host_in,
            syncs: 0,
            graphs: opts.graphs,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Expert cache counters.
    pub fn cache_stats(&self) -> GpuCacheStats {
        self.experts.stats
    }

    fn cfg(&self) -> &ModelConfig {
        &self.model.cfg
    }

    /// Feeds `tokens` through the model on the GPU, as `Model::forward` does.
    pub fn forward(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<&[f32]> {
        self.gpu.bind()?;
        let (v, c) = (self.cfg().vocab_size, self.opts.max_chunk);
        brook_core::model::check_tokens(tokens, v)?;
        if state.pos + tokens.len() > self.opts.context {
            return Err(Error::Invalid(format!(
                "context full: {} + {} tokens exceed the context of {} (open with a larger --context)",
                state.pos,
                tokens.len(),
                self.opts.context
            )));
        }
        let ours = state
            .device
            .as_mut()
            .is_some_and(|d| d.as_any_mut().downcast_mut::<DeviceSeq>().is_some());
        if !ours {
            state.sync_host()?;
            let d = DeviceSeq::from_host(&self.gpu, &self.model.cfg, state, self.opts.context)?;
            state.device = Some(Box::new(d));
        }
        let n_logits = want.len(tokens.len(), v);
        if self.logits.len() < n_logits {
            self.logits.resize(n_logits, 0.0);
        }
        let chunks = tokens.len().div_ceil(c);
        for (ci, chunk) in tokens.chunks(c).enumerate() {
            let dev = state
                .device
                .as_mut()
                .and_then(|d| d.as_any_mut().downcast_mut::<DeviceSeq>())
                .ok_or_else(|| Error::Invalid("lost the GPU state".into()))?;
            let graphed = self.graphs
                && self.experts.resident
                && chunk.len() == 1
                && matches!(want, Logits::Last);
            let res = match graphed {
                true => match self.decode_graphed(dev, chunk[0], state.pos) {
                    Ok(true) => Ok(()),
                    Ok(false) => {
                        self.graphs = false;
                        self.chunk(dev, chunk, state.pos).and_then(|_| {
                            let last = self.s.normed.ptr;
                            self.linear(self.dense.head, Mat::NONE, 1, last, self.s.logits.ptr)
                        })
                    }
                    Err(e) => Err(e),
                },
                false => self.chunk(dev, chunk, state.pos),
            };
            if let Err(e) = res {
                // The device state may be half-updated: drop it and say so.
                state.device = None;
                state.pos = 0;
                for l in &mut state.layers {
                    *l = match l {
                        LayerState::Linear { conv, ssm } => LayerState::Linear {
                            conv: vec![0.0; conv.len()],
                            ssm: vec![0.0; ssm.len()],
                        },
                        LayerState::Full { .. } => LayerState::Full {
                            keys: Vec::new(),
                            values: Vec::new(),
                        },
                    };
                }
                return Err(e);
            }
            let t = chunk.len();
            state.pos += t;
            let head = self.dense.head;
            let h = self.cfg().hidden_size;
            match want {
                Logits::All => {
                    let need = t * v;
                    if self.s.logits.bytes < need * 4 {
                        self.s.logits = self.gpu.alloc(need * 4, "logits")?;
                    }
                    self.linear(head, Mat::NONE, t, self.s.normed.ptr, self.s.logits.ptr)?;
                    let at = ci * c * v;
                    self.gpu
                        .copy_out(self.s.logits.ptr, &mut self.logits[at..at + need])?;
                    self.syncs += 1;
                }
                Logits::Last if ci + 1 == chunks => {
                    if !graphed {
                        let last = self.s.normed.ptr + ((t - 1) * h * 4) as u64;
                        self.linear(head, Mat::NONE, 1, last, self.s.logits.ptr)?;
                    }
                    self.gpu
                        .copy_out(self.s.logits.ptr, &mut self.logits[..v])?;
                    self.syncs += 1;
                }
                _ => {
                    self.gpu.sync()?;
                    self.syncs += 1;
                }
            }
        }
        Ok(&self.logits[..n_logits])
    }

    fn linear(&self, m1: Mat, m2: Mat, t: usize, x: u64, y: u64) -> Result<()> {
        ops::linear(&self.gpu, m1, m2, t, x, y)
    }

    fn norm(&self, x: u64, d: u64, w: u64, out: u64, rows: usize) -> Result<()> {
        let cfg = self.cfg();
        let mut a = Args::new();
        a.arg(x)
            .arg(d)
            .arg(w)
            .arg(out)
            .arg(cfg.hidden_size as i32)
            .arg(cfg.rms_norm_eps);
        self.gpu
            .launch(self.gpu.k.add_rms_norm, (rows as u32, 1, 1), 512, 0, &mut a)
    }

    fn swiglu(&self, gu: u64, h: u64, n: usize, i: usize) -> Result<()> {
        let mut a = Args::new();
        a.arg(gu).arg(h).arg(n as i32).arg(i as i32);
        let total = (n * i) as u32;
        self.gpu.launch(
            self.gpu.k.swiglu,
            (total.div_ceil(256), 1, 1),
            256,
            0,
            &mut a,
        )
    }

    /// Writes the tokens and the start position into pinned memory (the previous call ended
    /// with a synchronisation, so the buffer is free).
    fn stage_inputs(&mut self, tokens: &[u32], pos0: usize) {
        let buf = self.host_in.as_mut_slice();
        for (i, &tok) in tokens.iter().enumerate() {
            buf[4 * i..4 * i + 4].copy_from_slice(&(tok as i32).to_le_bytes());
        }
        let m = 4 * self.opts.max_chunk;
        buf[m..m + 4].copy_from_slice(&(pos0 as i32).to_le_bytes());
    }

    /// Queues the copies of the staged inputs to the GPU.
    fn enqueue_inputs(&self, t: usize) -> Result<()> {
        let m = 4 * self.opts.max_chunk;
        // SAFETY: pinned host memory untouched until the next call's start, which follows
        // this call's final synchronisation; device buffers are large enough.
        unsafe {
            self.gpu
                .copy_in_async(self.s.tokens.ptr, self.host_in.ptr(), 4 * t)?;
            self.gpu
                .copy_in_async(self.s.meta.ptr, self.host_in.ptr().add(m), 4)
        }
    }

    /// One decode step (every expert resident, last logits) replayed from the state's CUDA
    /// graph, captured on first use: the inputs' copies, every layer and the head.
    /// `Ok(false)`: the step could not be captured (logged); nothing ran, run it plainly.
    fn decode_graphed(&mut self, dev: &mut DeviceSeq, token: u32, pos0: usize) -> Result<bool> {
        use cudarc::driver::{result, sys};
        self.stage_inputs(&[token], pos0);
        let fresh = !matches!(&dev.graph, Some((id, _)) if *id == self.id);
        if fresh {
            dev.graph = None;
            // SAFETY: a live stream; relaxed mode lets other threads use the driver meanwhile.
            unsafe {
                result::stream::begin_capture(
                    self.gpu.stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                )
            }
            .map_err(|e| crate::gpu::err("starting a graph capture", e))?;
            let queued = self.enqueue_inputs(1).and_then(|_| {
                self.enqueue_layers(dev, 1)?;
                self.linear(
                    self.dense.head,
                    Mat::NONE,
                    1,
                    self.s.normed.ptr,
                    self.s.logits.ptr,
                )
            });
            // SAFETY: ends the capture begun above, whatever happened in between.
            let graph = unsafe { result::stream::end_capture(self.gpu.stream) };
            let graph = match (queued, graph) {
                (Ok(()), Ok(g)) => g,
                (q, g) => {
                    if let Ok(g) = g {
                        // SAFETY: destroy the graph we own.
                        let _ = unsafe { result::graph::destroy(g) };
                    }
                    tracing::warn!("CUDA graph capture failed ({q:?}); decoding without graphs");
                    return Ok(false);
                }
            };
            // SAFETY: a graph just captured.
            let exec =
                unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
            let exec = match exec {
                Ok(x) => x,
                Err(e) => {
                    // SAFETY: destroy the graph we own.
                    let _ = unsafe { result::graph::destroy(graph) };
                    tracing::warn!(
                        "CUDA graph instantiation failed ({e}); decoding without graphs"
                    );
                    return Ok(false);
                }
            };
            dev.graph = Some((self.id, Graph { graph, exec }));
        }
        let exec = dev.graph.as_ref().map(|(_, g)| g.exec);
        if let Some(exec) = exec {
            // SAFETY: an instantiated graph whose buffers (engine scratch, this state) live.
            unsafe { result::graph::launch(exec, self.gpu.stream) }
                .map_err(|e| crate::gpu::err("launching the decode graph", e))?;
        }
        Ok(true)
    }

    /// One chunk of at most `max_chunk` tokens at positions `pos0..`.
    fn chunk(&mut self, dev: &mut DeviceSeq, tokens: &[u32], pos0: usize) -> Result<()> {
        self.stage_inputs(tokens, pos0);
        self.enqueue_inputs(tokens.len())?;
        self.enqueue_layers(dev, tokens.len())
    }

    /// Queues embedding, every layer and the final norm for `t` staged tokens.
    fn enqueue_layers(&mut self, dev: &mut DeviceSeq, t: usize) -> Result<()> {
        let cfg = self.model.cfg.clone();
        let s = &self.s;
        let mut a = Args::new();
        a.arg(self.dense.embed).arg(s.tokens.ptr).arg(s.x.ptr);
        self.gpu
            .launch(self.gpu.k.embed, (t as u32, 1, 1), 256, 0, &mut a)?;
        let (x, normed, delta) = (s.x.ptr, s.normed.ptr, s.delta.ptr);
        for i in 0..cfg.num_hidden_layers {
            let l = &self.dense.layers[i];
            let d = if i == 0 { 0 } else { delta };
            self.norm(x, d, l.input_norm.ptr, normed, t)?;
            match (&l.mixer, &dev.layers[i]) {
                (
                    MixerGpu::Delta {
                        qkv,
                        z,
                        b,
                        a: am,
                        out,
                        conv_w,
                        a_log,
                        dt_bias,
                        norm,
                    },
                    DevLayer::Linear { conv, ssm },
                ) => {
                    self.delta_net(
                        &cfg, t, *qkv, *z, *b, *am, *out, conv_w, a_log, dt_bias, norm, conv, ssm,
                    )?;
                }
                (
                    MixerGpu::Attn {
                        q,
                        k,
                        v,
                        o,
                        q_norm,
                        k_norm,
                    },
                    DevLayer::Full { k: kc, v: vc },
                ) => {
                    self.attention(&cfg, t, *q, *k, *v, *o, q_norm, k_norm, kc, vc)?;
                }
                _ => return Err(Error::Invalid(format!("state does not fit layer {i}"))),
            }
            self.norm(x, delta, l.post_norm.ptr, normed, t)?;
            self.moe(&cfg, i, t)?;
        }
        let s = &self.s;
        self.norm(s.x.ptr, s.delta.ptr, self.dense.norm.ptr, s.normed.ptr, t)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn delta_net(
        &self,
        cfg: &ModelConfig,
        t: usize,
        qkv: Mat,
        z: Mat,
        b: Mat,
        am: Mat,
        out: Mat,
        conv_w: &DevBuf,
        a_log: &DevBuf,
        dt_bias: &DevBuf,
        norm: &DevBuf,
        conv: &DevBuf,
        ssm: &DevBuf,
    ) -> Result<()> {
        let s = &self.s;
        let g = &self.gpu;
        let (nk, nv, dk, dv) = (
            cfg.linear_num_key_heads as i32,
            cfg.linear_num_value_heads as i32,
            cfg.linear_key_head_dim as i32,
            cfg.linear_value_head_dim as i32,
        );
        let cd = cfg.conv_dim() as i32;
        let (zp, ap) = if t == 1 {
            self.linear(qkv, z, 1, s.normed.ptr, s.qkv.ptr)?;
            self.linear(b, am, 1, s.normed.ptr, s.b.ptr)?;
            (s.qkv.ptr + cd as u64 * 4, s.b.ptr + nv as u64 * 4)
        } else {
            self.linear(qkv, Mat::NONE, t, s.normed.ptr, s.qkv.ptr)?;
            self.linear(z, Mat::NONE, t, s.normed.ptr, s.z.ptr)?;
            self.linear(b, Mat::NONE, t, s.normed.ptr, s.b.ptr)?;
            self.linear(am, Mat::NONE, t, s.normed.ptr, s.a.ptr)?;
            (s.z.ptr, s.a.ptr)
        };
        let mut a = Args::new();
        a.arg(s.qkv.ptr)
            .arg(conv.ptr)
            .arg(conv_w.ptr)
            .arg(s.conv.ptr)
            .arg(t as i32)
            .arg(cd)
            .arg(cfg.linear_conv_kernel_dim as i32);
        g.launch(
            g.k.conv_silu,
            ((cd as u32).div_ceil(128), 1, 1),
            128,
            0,
            &mut a,
        )?;
        let mut a = Args::new();
        a.arg(s.conv.ptr)
            .arg(s.b.ptr)
            .arg(ap)
            .arg(a_log.ptr)
            .arg(dt_bias.ptr)
            .arg(s.beta.ptr)
            .arg(s.g.ptr)
            .arg(cd)
            .arg(nk)
            .arg(nv)
            .arg(dk);
        g.launch(g.k.delta_prep, (t as u32, 1, 1), 256, 0, &mut a)?;
        let f = match dk {
            32 => g.k.delta_rule_32,
            64 => g.k.delta_rule_64,
            128 => g.k.delta_rule_128,
            _ => g.k.delta_rule_any,
        };
        let mut a = Args::new();
        a.arg(s.conv.ptr)
            .arg(s.g.ptr)
            .arg(s.beta.ptr)
            .arg(ssm.ptr)
            .arg(s.o.ptr)
            .arg(t as i32)
            .arg(cd)
            .arg(nk)
            .arg(nv)
            .arg(dk)
            .arg(dv);
        g.launch(
            f,
            (nv as u32, (dv as u32).div_ceil(32), 1),
            32,
            (2 * dk * 4) as u32,
            &mut a,
        )?;
        let rows = t as i32 * nv;
        let mut a = Args::new();
        a.arg(s.o.ptr)
            .arg(zp)
            .arg(norm.ptr)
            .arg(s.y.ptr)
            .arg(rows)
            .arg(dv)
            .arg(cfg.rms_norm_eps);
        g.launch(
            g.k.gated_norm,
            ((rows as u32).div_ceil(4), 1, 1),
            128,
            0,
            &mut a,
        )?;
        self.linear(out, Mat::NONE, t, s.y.ptr, s.delta.ptr)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        cfg: &ModelConfig,
        t: usize,
        q: Mat,
        k: Mat,
        v: Mat,
        o: Mat,
        q_norm: &DevBuf,
        k_norm: &DevBuf,
        kc: &DevBuf,
        vc: &DevBuf,
    ) -> Result<()> {
        let s = &self.s;
        let g = &self.gpu;
        let (nq, nkv, hd) = (
            cfg.num_attention_heads as i32,
            cfg.num_key_value_heads as i32,
            cfg.head_dim as i32,
        );
        let gated = cfg.attn_output_gate as i32;
        let kp = if t == 1 {
            self.linear(q, k, 1, s.normed.ptr, s.qg.ptr)?;
            s.qg.ptr + q.rows as u64 * 4
        } else {
            self.linear(q, Mat::NONE, t, s.normed.ptr, s.qg.ptr)?;
            self.linear(k, Mat::NONE, t, s.normed.ptr, s.k.ptr)?;
            s.k.ptr
        };
        self.linear(v, Mat::NONE, t, s.normed.ptr, s.v.ptr)?;
        let mut a = Args::new();
        a.arg(s.qg.ptr)
            .arg(kp)
            .arg(s.v.ptr)
            .arg(q_norm.ptr)
            .arg(k_norm.ptr)
            .arg(s.inv_freq.ptr)
            .arg(s.meta.ptr)
            .arg(s.q.ptr)
            .arg(s.gate.ptr)
            .arg(kc.ptr)
            .arg(vc.ptr)
            .arg(nq)
            .arg(nkv)
            .arg(hd)
            .arg(cfg.rotary_dim as i32)
            .arg(gated)
            .arg(cfg.rms_norm_eps);
        g.launch(
            g.k.attn_prep,
            (t as u32, (nq + nkv) as u32, 1),
            64,
            (hd * 4) as u32,
            &mut a,
        )?;
        let scale = 1.0f32 / (hd as f32).sqrt();
        let mut a = Args::new();
        a.arg(s.q.ptr)
            .arg(s.gate.ptr)
            .arg(kc.ptr)
            .arg(vc.ptr)
            .arg(s.meta.ptr)
            .arg(s.att.ptr)
            .arg(nq)
            .arg(nkv)
            .arg(hd)
            .arg(gated)
            .arg(scale);
        g.launch(
            g.k.attention,
            (t as u32, nq as u32, 1),
            128,
            ((hd + 128) * 4) as u32,
            &mut a,
        )?;
        self.linear(o, Mat::NONE, t, s.att.ptr, s.delta.ptr)
    }

    /// The MoE block of `layer` on `normed`, writing `delta`.
    fn moe(&mut self, cfg: &ModelConfig, layer: usize, t: usize) -> Result<()> {
        let l = &self.dense.layers[layer];
        let (router, sgate, sup, sdown, seg) = (
            l.router,
            l.shared_gate,
            l.shared_up,
            l.shared_down,
            l.shared_expert_gate,
        );
        let (e, k, i, is, h) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
            cfg.hidden_size,
        );
        let (normed, rlog, sel, wts) = (
            self.s.normed.ptr,
            self.s.rlog.ptr,
            self.s.sel.ptr,
            self.s.wts.ptr,
        );
        let sg = if t == 1 {
            self.linear(router, seg, 1, normed, rlog)?;
            rlog + e as u64 * 4
        } else {
            self.linear(router, Mat::NONE, t, normed, rlog)?;
            self.linear(seg, Mat::NONE, t, normed, self.s.sg.ptr)?;
            self.s.sg.ptr
        };
        let mut a = Args::new();
        a.arg(rlog)
            .arg(e as i32)
            .arg(k as i32)
            .arg(cfg.norm_topk_prob as i32)
            .arg(sel)
            .arg(wts);
        self.gpu.launch(
            self.gpu.k.topk,
            (t as u32, 1, 1),
            32,
            (e * 4) as u32,
            &mut a,
        )?;
        // The shared expert is queued first: it runs while streamed experts load.
        self.linear(sgate, sup, t, normed, self.s.sgu.ptr)?;
        self.swiglu(self.s.sgu.ptr, self.s.sh.ptr, t, is)?;
        self.linear(sdown, Mat::NONE, t, self.s.sh.ptr, self.s.sout.ptr)?;
        let m = self.experts.mats[layer].clone();
        let tab = self.experts.table_of(layer);
        let (gu, hb, ey) = (self.s.gu.ptr, self.s.h.ptr, self.s.ey.ptr);
        if t == 1 {
            if !self.experts.resident {
                let mut ids = vec![0i32; k];
                self.gpu.copy_out(sel, &mut ids)?;
                self.syncs += 1;
                let mut ids: Vec<usize> = ids.iter().map(|&x| x as usize).collect();
                ids.sort_unstable();
                ids.dedup();
                self.experts.prepare(&self.model, layer, &ids)?;
            }
            ops::qmv(&self.gpu, m.gate, m.up, tab, sel, k as i32, k, normed, gu)?;
            self.swiglu(gu, hb, k, i)?;
            ops::qmv(&self.gpu, m.down, Mat::NONE, tab, sel, 1, k, hb, ey)?;
        } else {
            let (counts, offs, fill, pairs) = (
                self.s.counts.ptr,
                self.s.offs.ptr,
                self.s.fill.ptr,
                self.s.pairs.ptr,
            );
            self.s.counts.zero()?;
            let n = (t * k) as i32;
            let mut a = Args::new();
            a.arg(sel).arg(n).arg(counts);
            self.gpu.launch(
                self.gpu.k.moe_count,
                ((n as u32).div_ceil(256), 1, 1),
                256,
                0,
                &mut a,
            )?;
            let mut a = Args::new();
            a.arg(counts).arg(e as i32).arg(offs).arg(fill);
            self.gpu
                .launch(self.gpu.k.moe_offsets, (1, 1, 1), 32, 0, &mut a)?;
            let mut a = Args::new();
            a.arg(sel).arg(n).arg(offs).arg(fill).arg(pairs);
            self.gpu.launch(
                self.gpu.k.moe_fill,
                ((n as u32).div_ceil(256), 1, 1),
                256,
                0,
                &mut a,
            )?;
            let batches: Vec<Vec<usize>> = if self.experts.resident {
                vec![Vec::new()]
            } else {
                let mut c = vec![0i32; e];
                self.gpu.copy_out(counts, &mut c)?;
                self.syncs += 1;
                let needed: Vec<usize> = (0..e).filter(|&x| c[x] > 0).collect();
                needed
                    .chunks(self.experts.nslots.max(1))
                    .map(|b| b.to_vec())
                    .collect()
            };
            for ids in &batches {
                if !self.experts.resident {
                    self.experts.prepare(&self.model, layer, ids)?;
                }
                ops::qmm(
                    &self.gpu, m.gate, m.up, tab, counts, offs, pairs, k as i32, t, normed, gu, e,
                )?;
                self.swiglu(gu, hb, t * k, i)?;
                ops::qmm(
                    &self.gpu,
                    m.down,
                    Mat::NONE,
                    tab,
                    counts,
                    offs,
                    pairs,
                    1,
                    t,
                    hb,
                    ey,
                    e,
                )?;
            }
        }
        let mut a = Args::new();
        a.arg(ey)
            .arg(wts)
            .arg(self.s.sout.ptr)
            .arg(sg)
            .arg(self.s.delta.ptr)
            .arg(t as i32)
            .arg(k as i32)
            .arg(h as i32);
        let total = (t * h) as u32;
        self.gpu.launch(
            self.gpu.k.moe_combine,
            (total.div_ceil(256), 1, 1),
            256,
            0,
            &mut a,
        )
    }
}

impl Engine for CudaModel {
    fn forward(&mut self, state: &mut SeqState, tokens: &[u32], want: Logits) -> Result<&[f32]> {
        CudaModel::forward(self, state, tokens, want)
    }
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn gpu_stats(&self) -> Option<brook_core::model::engine::GpuStats> {
        let c = self.experts.stats;
        Some(brook_core::model::engine::GpuStats {
            device: self.gpu.name.clone(),
            budget_bytes: self.gpu.budget,
            used_bytes: self.gpu.used(),
            slots: self.experts.nslots,
            resident: self.experts.resident,
            hits: c.hits,
            misses: c.misses,
            bytes_copied: c.bytes,
            syncs: self.syncs,
            hbm_gb_s: 0.0,
            h2d_gb_s: 0.0,
        })
    }
}

/// Options of the CUDA backend from brook's open options.
///
/// `BROOK_CUDA_GRAPHS=0` in the environment turns CUDA graphs off (for profilers that time
/// kernels one launch at a time).
pub fn cuda_options(o: &OpenOptions) -> CudaOptions {
    CudaOptions {
        graphs: std::env::var("BROOK_CUDA_GRAPHS").map_or(true, |v| v != "0"),
        gpu_memory_budget: o.gpu_memory_budget,
        max_chunk: o.prefill_chunk.max(1),
        context: o.context.max(1),
        ..Default::default()
    }
}

/// The [`brook_core::model::engine::EngineMaker`] that builds a [`CudaModel`].
pub fn engine_maker() -> brook_core::model::engine::EngineMaker {
    brook_core::model::engine::EngineMaker(Arc::new(
        |model: Arc<Model>, _dir: &Path, o: &OpenOptions| {
            Ok(Box::new(CudaModel::new(model, cuda_options(o))?) as Box<dyn Engine>)
        },
    ))
}
