//! [`CudaModel`]: the whole forward pass on the GPU, decode and prefill.
//!
//! Mirrors `CpuModel` stage for stage (embedding, per layer: norm, DeltaNet or gated
//! attention, norm, router and top-k, shared expert, routed experts, combine; final norm and
//! head). The sequence state lives in GPU memory as a [`DeviceSeq`] inside the caller's
//! `SeqState`. Host synchronisations: one per forward call (reading the logits, or the end
//! of a prefill chunk), plus one per layer when experts stream (to learn the routing).

use std::path::Path;
use std::sync::Arc;

use brook_core::config::ModelConfig;
use brook_core::engine::Engine;
use brook_core::engine::driver::drive_own;
use brook_core::experts::budget::fmt_bytes;
use brook_core::model::open::OpenOptions;
use brook_core::model::state::SeqState;
use brook_core::model::{Logits, Model};
use brook_core::{Error, Result};

use crate::experts::{GpuCacheStats, GpuExperts, layouts};
use crate::gpu::{Args, Gpu, Pinned};
use crate::ops;
use crate::scratch::Scratch;
use crate::state::{DevLayer, DeviceSeq, Graph};
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
    /// Chunks of 2 to this many tokens run one token at a time through the decode kernels
    /// (0: never), so that beside other sequences they join their batched steps (batch.rs
    /// `step_rounds`); [`SMALL_CHUNK`] by default.
    pub small_chunk: usize,
    /// Most sequences a step takes (several decoded tokens run as one batched step where
    /// every expert is resident, batch.rs).
    pub max_seqs: usize,
    /// Host memory budget (bytes) within which the engine may keep the experts the GPU
    /// can't hold in page-locked host memory, mapped so the kernels read them over PCIe with
    /// no host round trip; it counts what the process holds already and the host expert
    /// cache's slots. `None`, or too little for them all: they stream through the host's
    /// expert cache a layer at a time.
    pub host_budget: Option<u64>,
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
            small_chunk: SMALL_CHUNK,
            max_seqs: 1,
            host_budget: None,
        }
    }
}

/// The forward pass on one GPU over a [`Model`] (whose host copy supplies the experts).
#[derive(Debug)]
pub struct CudaModel {
    pub(crate) model: Arc<Model>,
    pub gpu: Arc<Gpu>,
    pub(crate) dense: DenseGpu,
    pub experts: GpuExperts,
    pub(crate) s: Scratch,
    pub(crate) opts: CudaOptions,
    host_in: Pinned,
    /// What the shorthand [`CudaModel::forward`] returns.
    out: Vec<f32>,
    /// Host synchronisations so far (for the benchmark's count per token).
    pub syncs: u64,
    /// Seconds spent waiting for streamed layers' routing (the copy back of their picks).
    pub route_s: f64,
    /// Batched steps so far (batch.rs).
    pub batched_steps: u64,
    /// Replay one-token decode steps as CUDA graphs (when every expert is resident).
    pub graphs: bool,
    /// Make greedy picks and candidates on the GPU (`Logits::Best`, `Logits::Top`) instead
    /// of handing back rows (`switches::picks`).
    pub picks: bool,
    /// Find the candidates of `Logits::Top` on the GPU (`switches::top_candidates`);
    /// otherwise such a call gets its row.
    pub tops: bool,
    /// Logits of the tokens of a small chunk that nobody asked for.
    spare: Vec<f32>,
    /// Page-locked staging the logits come back through.
    pub(crate) host_logits: crate::buffers::HostLogits,
    /// A replayed routing's experts for the step being run (made on first use).
    pub(crate) given: Option<crate::given::GivenIds>,
    /// Group a step's experts (`grouped.rs`) where its kernels fit; `switches::grouped`.
    pub grouped: bool,
    /// Buffers of the steps of several sequences (`max_seqs` > 1).
    pub(crate) batch: Option<crate::batch::BatchBufs>,
    /// Prefetch the likeliest guessed mapped experts beside the mixer (blocks.rs
    /// `prefetch_experts`, at most `switches::prefetch_cap` a layer). On unless
    /// `BROOK_CUDA_PREFETCH=0` (docs/BENCH.md, "CUDA with host memory as the second tier").
    pub prefetch: bool,
    /// A prefetch is queued for the layer being queued.
    pub(crate) prefetched: bool,
    /// A chunk's products on the tensor cores where the matrices take them: the dense ones
    /// through the one-token kernels for each token (`CudaModel::product`), the routed
    /// experts grouped by expert (`ops::qmm` with `tc`); `switches::prefill_tc`.
    pub prefill_tc: bool,
    /// Ended sequences' states, kept for the next ones (state.rs).
    pub(crate) spares: Arc<std::sync::Mutex<crate::state::Spares>>,
    /// Names this engine's scratch as decode graphs captured it: a new one whenever a buffer
    /// they use is replaced.
    id: u64,
}

/// An id no engine's scratch has had ([`CudaModel`]'s `id`).
fn fresh_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl CudaModel {
    /// Uploads the dense core, sizes the expert slots from the GPU budget (every expert
    /// resident when they fit) and compiles the kernels.
    pub fn new(model: Arc<Model>, opts: CudaOptions) -> Result<CudaModel> {
        let gpu = Gpu::open(opts.device, opts.gpu_memory_budget)?;
        let cfg = model.cfg.clone();
        if opts.max_chunk == 0 {
            return Err(Error::Invalid("max_chunk must be at least 1".into()));
        }
        if cfg.num_experts_per_tok > 32 {
            // The top-k kernel keeps pick k in lane k of one warp.
            return Err(Error::Invalid(format!(
                "the CUDA backend routes to at most 32 experts per token; this model asks for {} (use --backend cpu)",
                cfg.num_experts_per_tok
            )));
        }
        if opts.max_seqs == 0 || opts.max_seqs > MAX_SEQS {
            return Err(Error::Invalid(format!(
                "the CUDA engine takes 1 to {MAX_SEQS} sequences a step, not {}",
                opts.max_seqs
            )));
        }
        let dense = DenseGpu::upload(&gpu, &model)?;
        let s = Scratch::new(&gpu, &cfg, opts.max_chunk, opts.max_seqs)?;
        let (mats, slot_bytes) = layouts(&model)?;
        let total = cfg.num_hidden_layers * cfg.num_experts;
        let k = cfg.num_experts_per_tok;
        let nslots = match opts.expert_slots {
            Some(n) => n.clamp(k, total),
            None => {
                // Keep room for a sequence state of the full context per sequence a step
                // takes, their batch buffers and a little slack.
                let seqs = opts.max_seqs as u64;
                let batch = if seqs > 1 {
                    crate::batch::BatchBufs::bytes(&cfg, opts.max_seqs)
                } else {
                    0
                };
                let reserve = seqs * DeviceSeq::bytes(&cfg, opts.context) + batch + (64 << 20);
                let left = gpu.budget.saturating_sub(gpu.used() + reserve);
                let mut n = (left / slot_bytes as u64) as usize;
                if n < total {
                    // Room to gather a step's picks from host memory, should they be mapped.
                    n = n.saturating_sub(k * opts.max_seqs);
                }
                if n < k {
                    let need = gpu.used() + reserve + (k * slot_bytes) as u64;
                    let states = if seqs > 1 {
                        format!("the states of {seqs} sequences (--parallel)")
                    } else {
                        "the state".to_string()
                    };
                    return Err(Error::Device(format!(
                        "a GPU memory budget of {} cannot hold the dense core, {states} and {k} expert slots at a context of {}; it needs at least {} (or lower --parallel or --context)",
                        fmt_bytes(gpu.budget),
                        opts.context,
                        fmt_bytes(need)
                    )));
                }
                n.min(total)
            }
        };
        // What the host budget leaves for mapped experts: less what the process holds now
        // (the host's dense copy among it), what the host cache's slots may take, and 1 GiB.
        let host = opts.host_budget.map(|b| {
            // A source holding every expert already (a checkpoint) is in the process's size.
            let cap = model.experts.capacity();
            let cache = if cap >= total {
                0
            } else {
                (cap * slot_bytes) as u64
            };
            b.saturating_sub(
                brook_core::experts::budget::rss()
                    .0
                    .saturating_add(cache)
                    .saturating_add(1 << 30),
            )
        });
        let picks = k * opts.max_seqs;
        let experts = GpuExperts::new(&gpu, &model, mats, slot_bytes, nslots, host, picks)?;
        tracing::info!(
            "CUDA on {} (sm_{}{}, {} SMs): {} of GPU memory in use, {} expert slots of {}{}",
            gpu.name,
            gpu.cc.0,
            gpu.cc.1,
            gpu.sms,
            fmt_bytes(gpu.used()),
            experts.nslots,
            fmt_bytes(slot_bytes as u64),
            if experts.resident {
                " (every expert resident)".to_string()
            } else if experts.mapped > 0 {
                format!(
                    " (the other {} experts in mapped host memory)",
                    experts.mapped
                )
            } else {
                String::new()
            }
        );
        let host_in = Pinned::new(&gpu, (opts.max_chunk + 4) * 4)?;
        let spares = crate::state::Spares::new(opts.max_seqs.max(1));
        let kept = Arc::downgrade(&spares);
        let reclaim = move || {
            kept.upgrade()
                .is_some_and(|p| crate::state::Spares::release(&p))
        };
        gpu.set_reclaim(crate::gpu::Reclaim(Box::new(reclaim)));
        let mut m = CudaModel {
            out: Vec::new(),
            model,
            gpu,
            dense,
            experts,
            s,
            opts,
            host_in,
            syncs: 0,
            route_s: 0.0,
            batched_steps: 0,
            graphs: opts.graphs,
            picks: crate::switches::picks(),
            tops: crate::switches::top_candidates(),
            spare: Vec::new(),
            host_logits: Default::default(),
            given: None,
            grouped: crate::switches::grouped(),
            batch: None,
            prefetch: crate::switches::prefetch(),
            prefetched: false,
            prefill_tc: crate::switches::prefill_tc(),
            spares,
            id: fresh_id(),
        };
        if opts.max_seqs > 1 {
            m.batch = Some(crate::batch::BatchBufs::new(&m, opts.max_seqs)?);
        }
        Ok(m)
    }

    /// Expert cache counters.
    pub fn cache_stats(&self) -> Result<GpuCacheStats> {
        self.experts.counters()
    }

    pub(crate) fn cfg(&self) -> &ModelConfig {
        &self.model.cfg
    }

    /// Feeds `tokens` through the model on the GPU, as `Model::forward` does: a shorthand
    /// for the driver ([`brook_core::engine::Forward`]) over this engine, for tests.
    pub fn forward(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<&[f32]> {
        drive_own(self, |m| &mut m.out, state, tokens, want, None)
    }

    /// One chunk of one sequence, whose state `place` put on this GPU; appends the logits
    /// `want` asks for to `out`.
    pub(crate) fn step_one(
        &mut self,
        state: &mut SeqState,
        chunk: &[u32],
        want: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let (v, h, t) = (self.cfg().vocab_size, self.cfg().hidden_size, chunk.len());
        let replaying = self.given.as_ref().is_some_and(|g| g.on);
        if t > 1 && t <= self.opts.small_chunk && !replaying {
            return self.step_tokens(state, chunk, want, out);
        }
        let pos = state.pos;
        let dev = state
            .device
            .as_mut()
            .and_then(|d| d.as_any_mut().downcast_mut::<DeviceSeq>())
            .ok_or_else(|| Error::Invalid("lost the GPU state".into()))?;
        let replaying = self.given.as_ref().is_some_and(|g| g.on);
        let graphed = self.graphs
            && self.experts.fixed()
            && t == 1
            && matches!(want, Logits::Last | Logits::Best | Logits::Top(_))
            && !replaying;
        if graphed {
            if !self.decode_graphed(dev, chunk[0], pos)? {
                self.graphs = false;
                self.chunk(dev, chunk, pos)?;
                let last = self.s.normed.ptr;
                self.linear(self.dense.head, Mat::NONE, 1, last, self.s.logits.ptr)?;
            }
        } else {
            self.chunk(dev, chunk, pos)?;
        }
        state.pos += t;
        let head = self.dense.head;
        let rows = match want {
            Logits::All => t,
            Logits::Last | Logits::Best | Logits::Top(_) => 1,
            Logits::None => {
                self.gpu.sync()?;
                self.syncs += 1;
                return Ok(());
            }
        };
        if self.s.logits.bytes < rows * v * 4 {
            self.s.logits = self.gpu.alloc(rows * v * 4, "logits")?;
            // Decode graphs captured before wrote the old buffer: a new id has every state
            // capture its graph again (states kept for reuse hold theirs across sequences).
            self.id = fresh_id();
        }
        if !graphed {
            let x = self.s.normed.ptr + ((t - rows) * h * 4) as u64;
            self.product(head, Mat::NONE, rows, x, self.s.logits.ptr)?;
        }
        let src = self.s.logits.ptr;
        if want == Logits::All {
            self.host_logits
                .read(&self.gpu, src, rows * v, |l| out.extend_from_slice(l))?;
        } else {
            self.hand_back(src, &mut [(want, out)])?;
        }
        self.syncs += 1;
        Ok(())
    }

    /// A small chunk one token at a time (see [`CudaOptions::small_chunk`]). Each token asks
    /// for its logits so that a resident model replays the decode graph; those of the tokens
    /// `want` leaves out go to a spare buffer.
    fn step_tokens(
        &mut self,
        state: &mut SeqState,
        chunk: &[u32],
        want: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let mut spare = std::mem::take(&mut self.spare);
        let mut run = |m: &mut Self, i: usize| -> Result<()> {
            let last = i + 1 == chunk.len();
            let tok = std::slice::from_ref(&chunk[i]);
            match want {
                Logits::All => m.step_one(state, tok, Logits::Last, out),
                Logits::Last | Logits::Best | Logits::Top(_) if last => {
                    m.step_one(state, tok, want, out)
                }
                Logits::None if last => m.step_one(state, tok, Logits::None, out),
                _ => {
                    spare.clear();
                    m.step_one(state, tok, Logits::Last, &mut spare)
                }
            }
        };
        let r = (0..chunk.len()).try_for_each(|i| run(self, i));
        self.spare = spare;
        r
    }

    pub(crate) fn linear(&self, m1: Mat, m2: Mat, t: usize, x: u64, y: u64) -> Result<()> {
        ops::linear(&self.gpu, m1, m2, t, x, y)
    }

    /// A dense product of `t` tokens (m2's rows after m1's for each): one token as
    /// [`CudaModel::linear`]; several through the one-token kernels for each token with
    /// `prefill_tc` (the tensor cores where the matrices fit them, each weight tile decoded
    /// once for up to eight tokens: `ops::qmv_stacked_n`), else the tiled kernel.
    pub(crate) fn product(&self, m1: Mat, m2: Mat, t: usize, x: u64, y: u64) -> Result<()> {
        if t > 1 && self.prefill_tc {
            ops::qmv_stacked_n(&self.gpu, [m1, m2, Mat::NONE, Mat::NONE], t, x, y)
        } else {
            self.linear(m1, m2, t, x, y)
        }
    }

    pub(crate) fn norm(&self, x: u64, d: u64, w: u64, out: u64, rows: usize) -> Result<()> {
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

    pub(crate) fn swiglu(&self, gu: u64, h: u64, n: usize, i: usize) -> Result<()> {
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
        self.stage_inputs(&[token], pos0);
        let fresh = !matches!(&dev.graph, Some((id, _)) if *id == self.id);
        if fresh {
            dev.graph = None;
            let gpu = self.gpu.clone();
            let graph = Graph::capture(&gpu, "decoding without graphs", || {
                self.enqueue_inputs(1)?;
                self.enqueue_layers(dev, 1)?;
                self.linear(
                    self.dense.head,
                    Mat::NONE,
                    1,
                    self.s.normed.ptr,
                    self.s.logits.ptr,
                )
            })?;
            let Some(graph) = graph else {
                return Ok(false);
            };
            dev.graph = Some((self.id, graph));
        }
        if let Some((_, g)) = &dev.graph {
            // The engine's scratch and this state's buffers, which the graph uses, live.
            g.launch(&self.gpu, "launching the decode graph")?;
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
        self.gpu.overlap_launches(t == 1);
        // A reference count, not a copy of the config, so `self` stays free to borrow.
        let model = self.model.clone();
        let cfg = &model.cfg;
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
            self.prefetched = self.prefetch_experts(cfg, i, t)?;
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
                        cfg, t, *qkv, *z, *b, *am, *out, conv_w, a_log, dt_bias, norm, conv, ssm,
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
                    self.attention(cfg, t, *q, *k, *v, *o, q_norm, k_norm, kc, vc)?;
                }
                _ => return Err(Error::Invalid(format!("state does not fit layer {i}"))),
            }
            self.norm(x, delta, l.post_norm.ptr, normed, t)?;
            self.moe(cfg, i, t)?;
        }
        let s = &self.s;
        self.norm(s.x.ptr, s.delta.ptr, self.dense.norm.ptr, s.normed.ptr, t)?;
        Ok(())
    }
}

/// Longest prefill chunk the CUDA backend runs: what its kernels were measured and tested with
/// (docs/CUDA.md); a longer `prefill_chunk` runs as chunks of this size.
pub const MAX_CHUNK: usize = 256;

/// The default [`CudaOptions::small_chunk`]: none. With the chunk's products on the tensor
/// cores ([`CudaModel::prefill_tc`]) a chunk of 4 to 32 tokens prefills faster than its
/// tokens as decode steps (H100, resident 35B, `brook bench`: pp4 147-171 → 173-177 tok/s,
/// pp8 204-214 → 302-319, pp32 334-343 → 985-1117; pp2 a tie), and `serve --parallel 16`
/// with 32-token prompts streamed 338 → 367 tok/s alone, 1190 → 1275 sixteen at once
/// (docs/bench/2026-12-07.md, "seventh session"). `BROOK_CUDA_SMALL_CHUNK` sets another.
pub const SMALL_CHUNK: usize = 0;

/// Most sequences one step of the CUDA engine takes.
pub const MAX_SEQS: usize = 64;

/// Options of the CUDA backend from brook's open options.
///
/// `BROOK_CUDA_GRAPHS=0` in the environment turns CUDA graphs off (for profilers that time
/// kernels one launch at a time).
pub fn cuda_options(o: &OpenOptions) -> CudaOptions {
    CudaOptions {
        graphs: crate::switches::graphs(),
        small_chunk: crate::switches::small_chunk(),
        gpu_memory_budget: o.gpu_memory_budget,
        max_chunk: o.prefill_chunk.clamp(1, MAX_CHUNK),
        context: o.context.max(1),
        max_seqs: o.max_seqs.clamp(1, MAX_SEQS),
        host_budget: o
            .memory_budget
            .or_else(brook_core::experts::budget::automatic_budget),
        ..Default::default()
    }
}

/// The [`brook_core::engine::EngineMaker`] that builds a [`CudaModel`].
pub fn engine_maker() -> brook_core::engine::EngineMaker {
    brook_core::engine::EngineMaker(Arc::new(
        |model: Arc<Model>, _dir: &Path, o: &OpenOptions| {
            Ok(Box::new(CudaModel::new(model, cuda_options(o))?) as Box<dyn Engine>)
        },
    ))
}
