//! The mapped tier's gather (kernels/routing.cu `gather_mapped`, `gather_ready`): after a
//! layer's top-k, the picks whose experts live in mapped host memory are copied over PCIe
//! into GPU slots and the layer's table says where each pick is; for one token the products
//! may run beside the copy, waiting on its flags ([`ReadyFlags`]). Also the prefetch of
//! guessed picks on the side stream. Owns no placement: the slots and the mapped host memory
//! are the parent module's.

use std::sync::Arc;

use brook_core::Result;
use brook_core::config::ModelConfig;

use super::GpuExperts;
use crate::gpu::{DevBuf, Gpu};

/// The gathering of a step's mapped experts into GPU memory.
#[derive(Debug)]
pub(super) struct Gather {
    /// How often each (layer, expert) was picked, counted on the GPU (the hits and misses a
    /// mapped step can't see on the host).
    pub(super) counts: DevBuf,
    /// Slots for `picks` picks.
    scratch: DevBuf,
    picks: usize,
    /// [experts] addresses of the current layer's picks.
    step: DevBuf,
    /// The prefetch of a layer's guessed picks (top-k), beside its mixer.
    pub(super) guess: Guess,
    /// The two flags of a one-token gather the products wait on (routing.cu
    /// `gather_ready`), zeroed by the top-k before it.
    ready: DevBuf,
    /// That gather's blocks (the count each flag reaches); 0: the products wait for the
    /// gather's end instead (`BROOK_CUDA_GATHER_FLAGS=0`).
    ready_blocks: usize,
    /// Mapped guesses a prefetch copies at most, and its blocks in all
    /// ([`crate::switches::prefetch_cap`]).
    pref_cap: usize,
    pref_blocks: usize,
}

/// Buffers of a prefetch: its input, router logits, picks, weights, slots, and the table
/// and counts its gather writes (unread: the step's own gather writes the real ones; in
/// `counts[layer]` the steps count the mapped picks they found prefetched, after those
/// [layers · experts] the prefetches their guesses).
#[derive(Debug)]
pub struct Guess {
    pub normed: DevBuf,
    pub logits: DevBuf,
    pub sel: DevBuf,
    pub wts: DevBuf,
    scratch: DevBuf,
    step: DevBuf,
    pub(super) counts: DevBuf,
    /// [top-k] the expert of each guess the prefetch copied, else -1 (what the step's own
    /// gather looks its picks up in).
    copied: DevBuf,
}

impl Gather {
    /// The gather's buffers for a model of `total` (layer, expert) pairs whose steps take up to
    /// `picks` picks, experts of `slot_bytes`.
    pub(super) fn new(
        gpu: &Arc<Gpu>,
        cfg: &ModelConfig,
        total: usize,
        picks: usize,
        slot_bytes: usize,
    ) -> Result<Gather> {
        let (e, k) = (cfg.num_experts, cfg.num_experts_per_tok);
        Ok(Gather {
            counts: gpu.zeros(total * 4, "expert pick counts")?,
            scratch: gpu.alloc(picks * slot_bytes, "gathered experts")?,
            picks,
            step: gpu.zeros(e * 8, "gathered expert table")?,
            ready: gpu.zeros(ReadyFlags::WORDS * 4, "gather flags")?,
            ready_blocks: crate::switches::gather_blocks(gpu.sms.max(1) as usize),
            pref_cap: crate::switches::prefetch_cap(k),
            pref_blocks: crate::switches::prefetch_blocks(),
            guess: Guess {
                normed: gpu.alloc(cfg.hidden_size * 4, "prefetch input")?,
                logits: gpu.alloc(e * 4, "prefetch router logits")?,
                sel: gpu.zeros(k * 4, "prefetch picks")?,
                wts: gpu.alloc(k * 4, "prefetch weights")?,
                scratch: gpu.alloc(k * slot_bytes, "prefetched experts")?,
                step: gpu.alloc(e * 8, "prefetch table")?,
                counts: gpu.zeros((cfg.num_hidden_layers + total) * 4, "prefetch counts")?,
                copied: gpu.alloc(k * 4, "prefetched picks")?,
            },
        })
    }
}

/// Where one gather writes: its slots, the table of where each pick is, the pick counts, and
/// how many guesses of a prefetch it may take its picks from.
struct Pass<'a> {
    scratch: &'a DevBuf,
    step: &'a DevBuf,
    counts: u64,
    npref: usize,
    /// A prefetch: the most picks it copies, its blocks a copied pick, and where it says
    /// which it copied.
    prefetch: Option<(usize, usize, u64)>,
}

/// The flags of a one-token gather its products run beside (routing.cu `gather_ready`): two
/// words at `ptr` (the copied experts' gate and up bytes, then their down bytes), each
/// counting up to `need` (the gather's blocks).
#[derive(Debug, Clone, Copy)]
pub struct ReadyFlags {
    pub ptr: u64,
    pub need: usize,
}

impl ReadyFlags {
    /// Words the top-k before the gather zeroes.
    pub const WORDS: usize = 2;

    /// The flag of the down bytes.
    pub fn down(&self) -> u64 {
        self.ptr + 4
    }
}

impl GpuExperts {
    /// The table the products of `layer` read for the `n` picks at `sel` (the top-k kernel's
    /// output). Where mapped, counts the picks on the GPU (the hits and misses a mapped step
    /// can't see on the host), and for a step of at most the gather's picks first copies
    /// the mapped ones into GPU memory, whose table this then is.
    ///
    /// With `flags` (from [`Self::ready_flags`] for these `n` picks, zeroed since their last
    /// use) the gather counts its two phases there (every copied expert's gate and up bytes,
    /// then their down bytes) and the products run beside it, waiting on those counts.
    pub fn table_for(
        &self,
        layer: usize,
        sel: u64,
        n: usize,
        prefetched: bool,
        flags: Option<&ReadyFlags>,
    ) -> Result<u64> {
        let tab = self.table_of(layer);
        let Some(g) = &self.gather else {
            return Ok(tab);
        };
        let counts = g.counts.ptr + (layer * self.experts * 4) as u64;
        if n > g.picks {
            self.count_picks(sel, n, counts)?;
            return Ok(tab);
        }
        let npref = if prefetched { self.k } else { 0 };
        let pass = Pass {
            scratch: &g.scratch,
            step: &g.step,
            counts,
            npref,
            prefetch: None,
        };
        self.gather(layer, sel, n, &pass, &g.guess, flags)?;
        Ok(g.step.ptr)
    }

    /// The flags a one-token step of `n` picks may gather with, its products running beside
    /// the gather (see [`Self::table_for`]); `None` where nothing is gathered (resident, or
    /// streamed through the host a layer at a time), for more picks than the gather takes,
    /// or with `BROOK_CUDA_GATHER_FLAGS=0`.
    pub fn ready_flags(&self, n: usize) -> Option<ReadyFlags> {
        let g = self.gather.as_ref()?;
        (n <= g.picks && g.ready_blocks > 0).then_some(ReadyFlags {
            ptr: g.ready.ptr,
            need: g.ready_blocks,
        })
    }

    /// The prefetch's buffers, where the experts are mapped.
    pub fn guess(&self) -> Option<&Guess> {
        self.gather.as_ref().map(|g| &g.guess)
    }

    /// Gathers the first mapped ones of the guessed picks of `layer` ([`Guess::sel`], top-k,
    /// the likeliest first; at most [`crate::switches::prefetch_cap`]) into the prefetch's
    /// slots (queued wherever launches go now: the side stream).
    pub fn prefetch(&self, layer: usize) -> Result<()> {
        let Some(g) = &self.gather else {
            return Ok(());
        };
        let q = &g.guess;
        let pass = Pass {
            scratch: &q.scratch,
            step: &q.step,
            counts: q.counts.ptr + ((self.layers + layer * self.experts) * 4) as u64,
            npref: 0,
            prefetch: Some((
                g.pref_cap,
                g.pref_blocks.div_ceil(g.pref_cap).max(1),
                q.copied.ptr,
            )),
        };
        self.gather(layer, q.sel.ptr, self.k, &pass, q, None)
    }

    /// One launch of `gather_mapped`, or with `flags` of `gather_ready` (routing.cu), for
    /// the `n` picks at `sel`.
    fn gather(
        &self,
        layer: usize,
        sel: u64,
        n: usize,
        pass: &Pass<'_>,
        guess: &Guess,
        flags: Option<&ReadyFlags>,
    ) -> Result<()> {
        let place = &self.mats[layer].place;
        let img = place[2].end;
        let mut a = crate::gpu::Args::new();
        a.arg(self.table_of(layer))
            .arg(self.arena.ptr)
            .arg(self.arena.ptr + self.arena.bytes as u64)
            .arg(sel)
            .arg(n as i32)
            .arg(pass.scratch.ptr)
            .arg(self.slot_bytes as i32);
        if flags.is_some() {
            // The gate and up bytes first: their end in 16-byte pieces, rounded up.
            a.arg(place[1].end.next_multiple_of(16) as i32);
        }
        a.arg(img as i32)
            .arg(pass.step.ptr)
            .arg(pass.counts)
            .arg(guess.copied.ptr)
            .arg(guess.scratch.ptr)
            .arg(pass.npref as i32)
            .arg(guess.counts.ptr + (layer * 4) as u64);
        if let Some(f) = flags {
            a.arg(f.ptr);
            return self.gpu.launch(
                self.gpu.k.gather_ready,
                (f.need as u32, 1, 1),
                256,
                0,
                &mut a,
            );
        }
        // About 4,096 16-byte pieces a block (27 blocks an expert of the 35B): a few dozen
        // blocks keep PCIe at its full rate (50 GB/s on the H200 host). A prefetch's fewer
        // leave the SMs to the mixer beside it.
        let (cap, parts, copied) = match pass.prefetch {
            Some((cap, parts, copied)) => (cap, parts, copied),
            None => (n, (img / 16).div_ceil(4096).clamp(1, 64), 0),
        };
        a.arg(cap as i32).arg(copied);
        self.gpu.launch(
            self.gpu.k.gather_mapped,
            (parts as u32, n as u32, 1),
            256,
            0,
            &mut a,
        )
    }

    /// Counts the `n` picks at `sel` into `counts`.
    fn count_picks(&self, sel: u64, n: usize, counts: u64) -> Result<()> {
        let mut a = crate::gpu::Args::new();
        a.arg(sel).arg(n as i32).arg(counts);
        self.gpu.launch(
            self.gpu.k.moe_count,
            ((n as u32).div_ceil(256), 1, 1),
            256,
            0,
            &mut a,
        )
    }
}
