//! Routed experts for the GPU: a slot arena, a per-layer table of expert addresses the
//! kernels index by expert id, and one of three arrangements:
//!
//! - **resident**: every expert has a slot; the table is written once.
//! - **mapped**: the experts without a slot live in page-locked host memory mapped into the
//!   GPU's address space, and the table points at them there: the kernels read them over
//!   PCIe as they compute, so the table is written once, a decode step needs no host
//!   round trip and replays as a CUDA graph. The host's bytes come out of the host budget.
//! - **streamed** (the host budget can't hold the rest): a least-frequently-used cache over
//!   the slots, filled from the host's expert source through pinned staging buffers by
//!   asynchronous copies; the table lists exactly the experts of the current batch (written
//!   before each launch). Eviction counts survive eviction; ties go to the least recently
//!   used; the experts of the batch being loaded are never evicted by it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use brook_core::experts::budget::fmt_bytes;
use brook_core::model::Model;
use brook_core::{Error, Result};
use cudarc::driver::{result, sys};

use crate::gpu::{DevBuf, Gpu, Pinned, err};

mod gather;
use crate::weights::{Mat, Placement, copy_into, place};
use gather::Gather;
pub use gather::{Guess, ReadyFlags};

/// The [`Mat`]s of one layer's experts, relative to a slot's start.
#[derive(Debug, Clone)]
pub struct ExpertMats {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
    place: [Placement; 3],
}

/// Counters of the GPU expert cache.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GpuCacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Bytes copied into GPU slots, and where mapped the expert bytes the kernels read from
    /// host memory.
    pub bytes: u64,
    /// The part of `bytes` the picks asked for (all of it but a prefetch's wrong guesses).
    pub needed: u64,
    /// Seconds the host spent waiting for expert bytes to land.
    pub wait_s: f64,
    /// Seconds the host spent staging them (copies into page-locked buffers, queued DMA).
    pub stage_s: f64,
    /// Mapped picks a prefetch had already gathered (not copied again).
    pub prefetch_used: u64,
}

const NONE: u32 = u32::MAX;
const STAGING: usize = 8;
/// Bytes of one page-locked host allocation of the mapped tier.
const HOST_CHUNK: usize = 1 << 30;

/// The expert slots of one GPU.
#[derive(Debug)]
pub struct GpuExperts {
    gpu: Arc<Gpu>,
    pub mats: Vec<ExpertMats>,
    pub slot_bytes: usize,
    pub nslots: usize,
    /// Every expert has a slot.
    pub resident: bool,
    /// Experts read from mapped host memory (0 unless mapped).
    pub mapped: usize,
    arena: DevBuf,
    /// The mapped host tier: chunks of `per_chunk` expert images.
    host: Vec<Pinned>,
    /// Where mapped: GPU slots a step's picks are gathered into from host memory.
    gather: Option<Gather>,
    /// [layers · experts] slot addresses (0: not in this launch).
    pub table: DevBuf,
    experts: usize,
    /// Picks a token makes per layer (top-k).
    k: usize,
    layers: usize,
    slot_of: Vec<u32>,
    owner: Vec<usize>,
    freq: Vec<u32>,
    last: Vec<u64>,
    tick: u64,
    lfu: BTreeSet<(u32, u64, u32)>,
    free: Vec<u32>,
    staging: Vec<(Pinned, sys::CUevent)>,
    next_stage: usize,
    /// Stage streamed experts in the order their reads land (`switches::land_order`).
    land_order: bool,
    /// Threads that stage a layer's streamed experts (`switches::stage_threads`).
    stage_threads: usize,
    /// Pinned copy of one layer's table slice, queued on the stream after its experts.
    table_stage: Pinned,
    pub stats: GpuCacheStats,
}

// SAFETY: the CUevent handles are plain driver handles used under the engine's lock.
unsafe impl Send for GpuExperts {}

impl Drop for GpuExperts {
    fn drop(&mut self) {
        for (_, ev) in &self.staging {
            // SAFETY: created in new, destroyed once.
            let _ = unsafe { result::event::destroy(*ev) };
        }
    }
}

/// Each layer's expert layout, read from expert 0 of the layer through `src`.
pub fn layouts(model: &Model) -> Result<(Vec<ExpertMats>, usize)> {
    let mut mats = Vec::new();
    let mut slot = 0;
    for l in 0..model.cfg.num_hidden_layers {
        let h = model.experts.fetch(l, &[0])?;
        let h = h
            .first()
            .ok_or_else(|| Error::Invalid(format!("layer {l} has no expert 0")))?;
        h.wait()?;
        let v = h.view();
        let what = format!("layer {l} experts");
        let g = place(&v.gate_proj, 0, &what)?;
        let u = place(&v.up_proj, g.end, &what)?;
        let d = place(&v.down_proj, u.end, &what)?;
        slot = slot.max(d.end.div_ceil(256) * 256);
        mats.push(ExpertMats {
            gate: g.mat,
            up: u.mat,
            down: d.mat,
            place: [g, u, d],
        });
    }
    Ok((mats, slot))
}

/// Host bytes the mapped tier takes for `nslots` GPU slots of `slot_bytes` among `total`
/// experts.
pub fn mapped_bytes(total: usize, nslots: usize, slot_bytes: usize) -> u64 {
    (total.saturating_sub(nslots) * slot_bytes) as u64
}

impl GpuExperts {
    /// `nslots` slots of `slot_bytes`. With a slot for every expert, loads them all now; else,
    /// where `host_bytes` of page-locked host memory hold the rest, loads those there
    /// (mapped) and an even share of every layer's experts into the slots, with room to
    /// gather the mapped ones of a step of up to `picks` picks into GPU memory.
    pub fn new(
        gpu: &Arc<Gpu>,
        model: &Model,
        mats: Vec<ExpertMats>,
        slot_bytes: usize,
        nslots: usize,
        host_bytes: Option<u64>,
        picks: usize,
    ) -> Result<GpuExperts> {
        let cfg = &model.cfg;
        let total = cfg.num_hidden_layers * cfg.num_experts;
        let nslots = nslots.min(total);
        let need = mapped_bytes(total, nslots, slot_bytes);
        let mapped = nslots < total && host_bytes.is_some_and(|b| need <= b);
        if nslots < total && !mapped {
            tracing::warn!(
                "the GPU holds {nslots} of {total} experts and the host budget ({}) not the other {}: experts stream through the host a layer at a time (slower); raise --memory-budget to at least that much more than the dense core",
                host_bytes.map_or("none".into(), fmt_bytes),
                fmt_bytes(need)
            );
        }
        let arena = gpu.alloc(nslots * slot_bytes, "expert slots")?;
        let table = gpu.zeros(total * 8, "expert table")?;
        let mut staging = Vec::with_capacity(STAGING);
        for _ in 0..STAGING {
            let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| err("creating an event", e))?;
            staging.push((Pinned::new(gpu, slot_bytes)?, ev));
        }
        let mut me = GpuExperts {
            gpu: gpu.clone(),
            mats,
            slot_bytes,
            nslots,
            resident: nslots == total,
            mapped: 0,
            arena,
            host: Vec::new(),
            gather: None,
            table,
            experts: cfg.num_experts,
            k: cfg.num_experts_per_tok,
            layers: cfg.num_hidden_layers,
            slot_of: vec![NONE; total],
            owner: vec![usize::MAX; nslots],
            freq: vec![0; total],
            last: vec![0; total],
            tick: 0,
            lfu: BTreeSet::new(),
            free: (0..nslots as u32).rev().collect(),
            staging,
            next_stage: 0,
            land_order: crate::switches::land_order(),
            stage_threads: crate::switches::stage_threads(),
            table_stage: Pinned::new(gpu, cfg.num_experts * 8)?,
            stats: GpuCacheStats::default(),
        };
        if me.resident {
            let all: Vec<usize> = (0..cfg.num_experts).collect();
            let batch = model.experts.capacity().clamp(1, cfg.num_experts);
            for l in 0..cfg.num_hidden_layers {
                for ids in all.chunks(batch) {
                    me.load(model, l, ids)?;
                }
            }
            let addrs: Vec<u64> = (0..total).map(|k| me.slot_addr(me.slot_of[k])).collect();
            me.table.write(&addrs)?;
            gpu.sync()?;
        } else if mapped && me.load_mapped(model)? {
            me.gather = Some(Gather::new(gpu, cfg, total, picks, slot_bytes)?);
        }
        Ok(me)
    }

    /// The mapped arrangement: layer l's first share of the slots' experts into GPU slots,
    /// the rest into mapped host memory, and the table written once. `Ok(false)`: the host
    /// memory could not be page-locked (nothing loaded; the caller streams instead).
    fn load_mapped(&mut self, model: &Model) -> Result<bool> {
        let (layers, e) = (model.cfg.num_hidden_layers, self.experts);
        let total = layers * e;
        let per_chunk = (HOST_CHUNK / self.slot_bytes).max(1);
        let n = total - self.nslots;
        let t = Instant::now();
        let huge = crate::switches::host_huge();
        for c in 0..n.div_ceil(per_chunk) {
            let m = per_chunk.min(n - c * per_chunk);
            let chunk = if huge {
                Pinned::new_mapped_huge(&self.gpu, m * self.slot_bytes)
            } else {
                Pinned::new_mapped(&self.gpu, m * self.slot_bytes)
            };
            match chunk {
                Ok(p) => self.host.push(p),
                Err(e) => {
                    self.host.clear();
                    tracing::warn!(
                        "could not page-lock {} of host memory for the {n} experts the GPU can't hold ({e}): they stream through the host a layer at a time instead (slower); a smaller --memory-budget skips the attempt",
                        fmt_bytes((n * self.slot_bytes) as u64)
                    );
                    return Ok(false);
                }
            }
        }
        let bases: Vec<u64> = self
            .host
            .iter()
            .map(|p| p.device_ptr())
            .collect::<Result<_>>()?;
        let mut addrs = vec![0u64; total];
        let mut next = 0usize;
        let per = model.experts.capacity().clamp(1, e);
        for l in 0..layers {
            // An even share of the slots for every layer: the synthetic and real routers
            // spread a token's picks over every layer alike.
            let on_gpu = self.nslots * (l + 1) / layers - self.nslots * l / layers;
            let gpu_ids: Vec<usize> = (0..on_gpu).collect();
            for ids in gpu_ids.chunks(per) {
                self.load(model, l, ids)?;
            }
            for &x in &gpu_ids {
                let s = self.slot_of[l * e + x];
                addrs[l * e + x] = self.slot_addr(s);
            }
            let m = self.mats[l].clone();
            let host_ids: Vec<usize> = (on_gpu..e).collect();
            for ids in host_ids.chunks(per) {
                let handles = model.experts.fetch(l, ids)?;
                for (&x, h) in ids.iter().zip(&handles) {
                    h.wait()?;
                    let v = h.view();
                    let (c, i) = (next / per_chunk, next % per_chunk);
                    next += 1;
                    let img = &mut self.host[c].as_mut_slice()
                        [i * self.slot_bytes..(i + 1) * self.slot_bytes];
                    copy_into(&v.gate_proj, &m.place[0], img);
                    copy_into(&v.up_proj, &m.place[1], img);
                    copy_into(&v.down_proj, &m.place[2], img);
                    addrs[l * e + x] = bases[c] + (i * self.slot_bytes) as u64;
                }
            }
        }
        self.mapped = next;
        self.table.write(&addrs)?;
        self.gpu.sync()?;
        tracing::info!(
            "experts: {} in GPU slots, {next} ({}) in mapped host memory, loaded in {:.1} s",
            self.nslots,
            fmt_bytes((next * self.slot_bytes) as u64),
            t.elapsed().as_secs_f64()
        );
        Ok(true)
    }

    /// Hits, misses and the expert bytes read from host memory so far: the host cache's
    /// counters, or where mapped the GPU's pick counts (read back, a synchronisation).
    pub fn counters(&self) -> Result<GpuCacheStats> {
        let Some(g) = &self.gather else {
            return Ok(self.stats);
        };
        let picks: Vec<u32> = g.counts.read()?;
        let mut c = self.stats;
        // Bytes over PCIe: every mapped pick a prefetch had not gathered, and every mapped
        // guess, right or wrong.
        let guessed: Vec<u32> = g.guess.counts.read()?;
        let (used, guessed) = guessed.split_at(self.layers);
        for (k, &n) in picks.iter().enumerate() {
            if self.slot_of[k] != NONE {
                c.hits += n as u64;
            } else {
                c.misses += n as u64;
                let img = self.mats[k / self.experts].place[2].end as u64;
                c.bytes += (n as u64 + guessed[k] as u64) * img;
                c.needed += n as u64 * img;
            }
        }
        // A prefetched pick was counted twice (as a miss and as a guess).
        for (m, &u) in self.mats.iter().zip(used) {
            c.prefetch_used += u as u64;
            c.bytes = c.bytes.saturating_sub(u as u64 * m.place[2].end as u64);
        }
        Ok(c)
    }

    /// Every expert has an address (resident or mapped): the table never changes.
    pub fn fixed(&self) -> bool {
        self.resident || self.gather.is_some()
    }

    /// Address of GPU slot `s`.
    fn slot_addr(&self, s: u32) -> u64 {
        self.arena.ptr + s as u64 * self.slot_bytes as u64
    }

    /// Address of the table slice of `layer`.
    pub fn table_of(&self, layer: usize) -> u64 {
        self.table.ptr + (layer * self.experts * 8) as u64
    }

    /// Makes experts `ids` of `layer` resident (at most `nslots`, distinct) and, unless every
    /// expert is resident, points the layer's table at exactly these.
    pub fn prepare(&mut self, model: &Model, layer: usize, ids: &[usize]) -> Result<()> {
        if self.fixed() {
            return Ok(());
        }
        if ids.len() > self.nslots {
            return Err(Error::Invalid(format!(
                "{} experts asked at once but only {} GPU slots",
                ids.len(),
                self.nslots
            )));
        }
        // Kernels queued earlier may still read the table or a slot about to be evicted, and
        // the previous table copy may still read `table_stage`: wait for them all.
        self.gpu.sync()?;
        self.load(model, layer, ids)?;
        self.table_stage.as_mut_slice().fill(0);
        for &e in ids {
            let addr = self.slot_addr(self.slot_of[layer * self.experts + e]);
            self.table_stage.as_mut_slice()[e * 8..e * 8 + 8].copy_from_slice(&addr.to_le_bytes());
        }
        // Queued, not waited for: the kernels that read the table follow it on the stream.
        // SAFETY: table_stage stays untouched until the next prepare's synchronisation; the
        // slice lies inside the table.
        unsafe {
            self.gpu.copy_in_async(
                self.table_of(layer),
                self.table_stage.ptr(),
                self.experts * 8,
            )
        }
    }

    /// Loads the missing ones of `ids` into slots, evicting the least frequently used.
    fn load(&mut self, model: &Model, layer: usize, ids: &[usize]) -> Result<()> {
        self.tick += 1;
        let mut miss = Vec::new();
        for &e in ids {
            let k = layer * self.experts + e;
            // Pin: take hits out of the eviction order while this batch loads.
            let s = self.slot_of[k];
            if s != NONE {
                self.lfu.remove(&(self.freq[k], self.last[k], s));
                self.stats.hits += 1;
            } else {
                miss.push(e);
                self.stats.misses += 1;
            }
            self.freq[k] = self.freq[k].saturating_add(1);
            self.last[k] = self.tick;
        }
        let mut slots = Vec::with_capacity(miss.len());
        for _ in &miss {
            let s = match self.free.pop() {
                Some(s) => s,
                None => {
                    let (_, _, s) = self
                        .lfu
                        .pop_first()
                        .ok_or_else(|| Error::Invalid("no GPU expert slot left to evict".into()))?;
                    let old = self.owner[s as usize];
                    self.slot_of[old] = NONE;
                    s
                }
            };
            slots.push(s);
        }
        let m = self.mats[layer].clone();
        let per = model.experts.capacity().max(1);
        for (miss, slots) in miss.chunks(per).zip(slots.chunks(per)) {
            let handles = model.experts.fetch(layer, miss)?;
            let dsts: Vec<u64> = slots.iter().map(|&s| self.slot_addr(s)).collect();
            // Every read is in flight; they are staged STAGING at a time, each with a
            // staging buffer of its own.
            for (hs, ds) in handles.chunks(STAGING).zip(dsts.chunks(STAGING)) {
                let bufs = self.next_stage;
                self.next_stage = (self.next_stage + hs.len()) % STAGING;
                let times = self.stage(&m, hs, ds, bufs)?;
                self.stats.wait_s += times.0;
                self.stats.stage_s += times.1;
            }
            self.gpu.queued_other();
            let n = m.place[2].end;
            for (&e, &s) in miss.iter().zip(slots) {
                let k = layer * self.experts + e;
                self.slot_of[k] = s;
                self.owner[s as usize] = k;
                self.stats.bytes += n as u64;
                self.stats.needed += n as u64;
            }
        }
        for &e in ids {
            let k = layer * self.experts + e;
            self.lfu
                .insert((self.freq[k], self.last[k], self.slot_of[k]));
        }
        Ok(())
    }
}

/// A staging buffer and the event recorded after its last copy to the GPU.
struct Stage<'a> {
    buf: &'a mut Pinned,
    ev: sys::CUevent,
}

// SAFETY: the event is only synchronised on and recorded by the one thread that holds the
// Stage; the driver's event calls are thread-safe.
unsafe impl Send for Stage<'_> {}

impl GpuExperts {
    /// Copies the experts of `handles` into GPU slots `dsts` through staging buffers
    /// `first`, `first + 1`, … (mod STAGING; at most STAGING of them), each staged as its
    /// read lands: on up to `stage_threads` threads (`switches::stage_threads`), since the
    /// reads of one layer tend to land together and one thread's copies into page-locked
    /// memory then run one after another while the GPU and the disk wait. Every copy is
    /// queued on the stream before this returns. Returns the threads' seconds waiting for
    /// bytes and staging them, summed over the threads.
    fn stage(
        &mut self,
        m: &ExpertMats,
        handles: &[brook_core::experts::source::ExpertHandle],
        dsts: &[u64],
        first: usize,
    ) -> Result<(f64, f64)> {
        let n = handles.len();
        let mut stages: Vec<Option<Stage<'_>>> = (0..STAGING).map(|_| None).collect();
        for (i, (buf, ev)) in self.staging.iter_mut().enumerate() {
            let j = (i + STAGING - first) % STAGING;
            if j < n {
                stages[j] = Some(Stage { buf, ev: *ev });
            }
        }
        let stages: Vec<std::sync::Mutex<Stage<'_>>> = stages
            .into_iter()
            .flatten()
            .map(std::sync::Mutex::new)
            .collect();
        let threads = self.stage_threads.clamp(1, n.max(1));
        let gpu = &self.gpu;
        let land_order = self.land_order;
        // Which expert each thread takes next: the first landed one not yet taken, else the
        // first not yet taken (waiting on it).
        let taken: Vec<std::sync::atomic::AtomicBool> = (0..n)
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect();
        let claim = || -> Option<usize> {
            use std::sync::atomic::Ordering::AcqRel;
            let free = |j: &usize| !taken[*j].load(std::sync::atomic::Ordering::Acquire);
            loop {
                let pick = land_order
                    .then(|| (0..n).filter(free).find(|&j| handles[j].landed()))
                    .flatten()
                    .or_else(|| (0..n).find(free))?;
                if !taken[pick].swap(true, AcqRel) {
                    return Some(pick);
                }
            }
        };
        let work = || -> Result<(f64, f64)> {
            if threads > 1 {
                gpu.bind()?;
            }
            let (mut wait, mut stage) = (0.0, 0.0);
            while let Some(j) = claim() {
                let t = Instant::now();
                handles[j].wait()?;
                wait += t.elapsed().as_secs_f64();
                let t = Instant::now();
                let mut st = stages[j].lock().unwrap_or_else(|p| p.into_inner());
                stage_one(gpu, m, &handles[j].view(), &mut st, dsts[j])?;
                stage += t.elapsed().as_secs_f64();
            }
            Ok((wait, stage))
        };
        if threads == 1 {
            return work();
        }
        std::thread::scope(|sc| {
            let workers: Vec<_> = (1..threads).map(|_| sc.spawn(work)).collect();
            let mut total = work();
            for w in workers {
                let r = w.join().unwrap_or_else(|_| {
                    Err(Error::Invalid("an expert staging thread panicked".into()))
                });
                total = match (total, r) {
                    (Ok(a), Ok(b)) => Ok((a.0 + b.0, a.1 + b.1)),
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
            }
            total
        })
    }
}

/// One expert `v` into staging `st` (once its last copy has run), then its copy into the
/// GPU slot at `dst` queued on the stream, and the staging's event recorded after it.
fn stage_one(
    gpu: &Gpu,
    m: &ExpertMats,
    v: &brook_core::experts::source::ExpertView<'_>,
    st: &mut Stage<'_>,
    dst: u64,
) -> Result<()> {
    // SAFETY: the event was recorded after this buffer's last copy (or never).
    unsafe { result::event::synchronize(st.ev) }.map_err(|e| err("waiting for a copy", e))?;
    let img = st.buf.as_mut_slice();
    copy_into(&v.gate_proj, &m.place[0], img);
    copy_into(&v.up_proj, &m.place[1], img);
    copy_into(&v.down_proj, &m.place[2], img);
    let n = m.place[2].end;
    // SAFETY: the staging buffer stays untouched until its event completes; the slot holds
    // slot_bytes ≥ n.
    unsafe { gpu.copy_in_async(dst, st.buf.ptr(), n)? };
    // SAFETY: live event and stream.
    unsafe { result::event::record(st.ev, gpu.stream) }.map_err(|e| err("recording an event", e))
}
