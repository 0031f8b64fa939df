//! Routed experts in GPU memory: a slot arena, a per-layer table of slot addresses the
//! kernels index by expert id, and (when not every expert fits) a least-frequently-used
//! cache over the slots, filled from the host's expert source through pinned staging
//! buffers by asynchronous copies.
//!
//! The table a launch sees lists exactly the experts that launch computes: every expert when
//! all are resident (written once), else the experts of the current batch (written before
//! each launch). Eviction counts survive eviction; ties go to the least recently used; the
//! experts of the batch being loaded are never evicted by it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use brook_core::model::Model;
use brook_core::{Error, Result};
use cudarc::driver::{result, sys};

use crate::gpu::{DevBuf, Gpu, Pinned, err};
use crate::weights::{Mat, Placement, copy_into, place};

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
    /// Bytes copied into GPU slots.
    pub bytes: u64,
    /// Seconds the host spent waiting for expert bytes and staging them.
    pub load_s: f64,
}

const NONE: u32 = u32::MAX;
const STAGING: usize = 8;

/// The expert slots of one GPU.
#[derive(Debug)]
pub struct GpuExperts {
    gpu: Arc<Gpu>,
    pub mats: Vec<ExpertMats>,
    pub slot_bytes: usize,
    pub nslots: usize,
    /// Every expert has a slot and the table never changes.
    pub resident: bool,
    arena: DevBuf,
    /// [layers · experts] slot addresses (0: not in this launch).
    pub table: DevBuf,
    experts: usize,
    slot_of: Vec<u32>,
    owner: Vec<usize>,
    freq: Vec<u32>,
    last: Vec<u64>,
    tick: u64,
    lfu: BTreeSet<(u32, u64, u32)>,
    free: Vec<u32>,
    staging: Vec<(Pinned, sys::CUevent)>,
    next_stage: usize,
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

impl GpuExperts {
    /// `nslots` slots of `slot_bytes`; with a slot for every expert, loads them all now.
    pub fn new(
        gpu: &Arc<Gpu>,
        model: &Model,
        mats: Vec<ExpertMats>,
        slot_bytes: usize,
        nslots: usize,
    ) -> Result<GpuExperts> {
        let cfg = &model.cfg;
        let total = cfg.num_hidden_layers * cfg.num_experts;
        let nslots = nslots.min(total);
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
            arena,
            table,
            experts: cfg.num_experts,
            slot_of: vec![NONE; total],
            owner: vec![usize::MAX; nslots],
            freq: vec![0; total],
            last: vec![0; total],
            tick: 0,
            lfu: BTreeSet::new(),
            free: (0..nslots as u32).rev().collect(),
            staging,
            next_stage: 0,
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
            let addrs: Vec<u64> = (0..total)
                .map(|k| me.arena.ptr + me.slot_of[k] as u64 * slot_bytes as u64)
                .collect();
            me.table.write(&addrs)?;
            gpu.sync()?;
        }
        Ok(me)
    }

    /// Address of the table slice of `layer`.
    pub fn table_of(&self, layer: usize) -> u64 {
        self.table.ptr + (layer * self.experts * 8) as u64
    }

    /// Makes experts `ids` of `layer` resident (at most `nslots`, distinct) and, unless every
    /// expert is resident, points the layer's table at exactly these.
    pub fn prepare(&mut self, model: &Model, layer: usize, ids: &[usize]) -> Result<()> {
        if self.resident {
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
        let stage = self.table_stage.as_mut_slice();
        stage.fill(0);
        for &e in ids {
            let s = self.slot_of[layer * self.experts + e];
            let addr = self.arena.ptr + s as u64 * self.slot_bytes as u64;
            stage[e * 8..e * 8 + 8].copy_from_slice(&addr.to_le_bytes());
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
        let t = Instant::now();
        let m = self.mats[layer].clone();
        let per = model.experts.capacity().max(1);
        for (miss, slots) in miss.chunks(per).zip(slots.chunks(per)) {
            let handles = model.experts.fetch(layer, miss)?;
            for ((&e, h), &s) in miss.iter().zip(&handles).zip(slots) {
                h.wait()?;
                let v = h.view();
                let (buf, ev) = &mut self.staging[self.next_stage];
                self.next_stage = (self.next_stage + 1) % STAGING;
                // SAFETY: the event was recorded after this buffer's last copy (or never).
                unsafe { result::event::synchronize(*ev) }
                    .map_err(|e| err("waiting for a copy", e))?;
                let img = buf.as_mut_slice();
                copy_into(&v.gate_proj, &m.place[0], img);
                copy_into(&v.up_proj, &m.place[1], img);
                copy_into(&v.down_proj, &m.place[2], img);
                let dst = self.arena.ptr + s as u64 * self.slot_bytes as u64;
                let n = m.place[2].end;
                // SAFETY: the staging buffer stays untouched until its event completes; the
                // slot holds slot_bytes ≥ n.
                unsafe { self.gpu.copy_in_async(dst, buf.ptr(), n)? };
                self.gpu.queued_other();
                // SAFETY: live event and stream.
                unsafe { result::event::record(*ev, self.gpu.stream) }
                    .map_err(|e| err("recording an event", e))?;
                let k = layer * self.experts + e;
                self.slot_of[k] = s;
                self.owner[s as usize] = k;
                self.stats.bytes += n as u64;
            }
        }
        self.stats.load_s += t.elapsed().as_secs_f64();
        for &e in ids {
            let k = layer * self.experts + e;
            self.lfu
                .insert((self.freq[k], self.last[k], self.slot_of[k]));
        }
        Ok(())
    }
}
