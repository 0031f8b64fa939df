//! What a step hands back of its logits: the rows, or reduced on the GPU to what a sampler
//! needs (`Logits::Best`: the greedy pick, `best_rows`; `Logits::Top`: the most likely
//! candidates, `top_blocks` and `top_rows`, kernels/routing.cu), so that 4 bytes or half a
//! kilobyte a sequence cross PCIe instead of a vocabulary's floats. One place for the
//! one-token steps (model.rs) and the batched ones (batch.rs).

use brook_core::model::Logits;
use brook_core::{Error, Result};

use crate::gpu::{Args, Gpu};
use crate::model::CudaModel;

/// Blocks a row of logits is split into for its greedy pick ([`best_rows`]).
pub const BEST_BLOCKS: usize = 32;

/// The greedy pick of each of `rows` rows of `v` logits at `logits` into `out` (a u32 a row:
/// `brook_core::model::argmax`'s index), through `part` ([`BEST_BLOCKS`] u64 a row) and
/// `count` (a u32 a row, zero before and after every launch).
pub fn best_rows(
    g: &Gpu,
    logits: u64,
    v: usize,
    rows: usize,
    part: u64,
    count: u64,
    out: u64,
) -> Result<()> {
    let v = i32::try_from(v)
        .map_err(|_| Error::Invalid(format!("a vocabulary of {v} is too large for the GPU")))?;
    let mut a = Args::new();
    a.arg(logits).arg(v).arg(part).arg(count).arg(out);
    g.launch(
        g.k.best_rows,
        (BEST_BLOCKS as u32, rows as u32, 1),
        256,
        0,
        &mut a,
    )
}

/// Candidates a row of [`top_rows`] holds (kernels/routing.cu `TOP_K`), as many as
/// `brook_core::model::TOP_CANDIDATES`.
pub const TOP_K: usize = 64;
/// Floats a row of [`top_rows`]'s output takes: [`TOP_K`] (value, index bits) pairs, then the
/// pairs written, the values that reached the row's floor (`u32::MAX`: too many, nothing
/// decided) and whether the floor took every value that is a number, each as a float's bits.
pub const TOP_ROW: usize = 2 * TOP_K + 4;
/// The most 64-value blocks a row of [`top_rows`] may have (twice kernels/routing.cu
/// `TOP_LIST`).
pub const TOP_MAX_BLOCKS: usize = 8192;

/// Whether [`top_rows`] takes rows of `v` logits, and hands back fewer floats than a row.
pub fn top_fits(v: usize) -> bool {
    v > 2 * TOP_K && v.div_ceil(64) <= TOP_MAX_BLOCKS
}

/// The [`TOP_K`] most likely candidates of each of `rows` rows of `v` logits at `logits` into
/// `out` ([`TOP_ROW`] floats a row), through `bkey` (a u32 a 64-value block of a row).
pub fn top_rows(g: &Gpu, logits: u64, v: usize, rows: usize, bkey: u64, out: u64) -> Result<()> {
    if !top_fits(v) {
        return Err(Error::Invalid(format!(
            "rows of {v} logits are outside what the GPU's candidate kernel takes"
        )));
    }
    let nb = v.div_ceil(64);
    let mut a = Args::new();
    a.arg(logits).arg(v as i32).arg(nb as i32).arg(bkey);
    let grid = ((nb * 32).div_ceil(256) as u32, rows as u32, 1);
    g.launch(g.k.top_blocks, grid, 256, 0, &mut a)?;
    let mut a = Args::new();
    a.arg(logits)
        .arg(v as i32)
        .arg(nb as i32)
        .arg(bkey)
        .arg(out);
    g.launch(g.k.top_rows, (rows as u32, 1, 1), 1024, 0, &mut a)
}

/// The candidates in one row of [`top_rows`]'s output (`row`: [`TOP_ROW`] floats) as a
/// `Logits::Top` call hands them back (value, index bits pairs), where they decide what a
/// sampler of `want` picks (`brook_core::model::top_decides`); `None` where they don't.
pub fn top_pairs(row: &[f32], want: brook_core::model::TopWant) -> Option<&[f32]> {
    let (m, c, every) = (
        row[2 * TOP_K].to_bits() as usize,
        row[2 * TOP_K + 1].to_bits(),
        row[2 * TOP_K + 2].to_bits() == 1,
    );
    if c == u32::MAX || m > TOP_K {
        return None;
    }
    let pairs = &row[..2 * m];
    let mut cands = [(0.0f32, 0u32); TOP_K];
    for (c, p) in cands.iter_mut().zip(pairs.chunks_exact(2)) {
        *c = (p[0], p[1].to_bits());
    }
    let whole = every && c as usize <= TOP_K;
    brook_core::model::top_decides(&cands[..m], whole, want).then_some(pairs)
}

/// What [`CudaModel::reduced`] makes of rows of logits on the GPU.
#[derive(Debug, Clone, Copy)]
enum Reduce {
    /// The greedy pick ([`best_rows`]).
    Best,
    /// The most likely candidates ([`top_rows`]).
    Top,
}

impl CudaModel {
    /// Appends to each of `parts` (`want`, `out`; part z is row z of the rows of logits at
    /// `logits`) what it asked for: its greedy pick, its candidates where they decide its
    /// pick, else its row (`Logits::Last`, and `Logits::Top` where they don't or the
    /// vocabulary is outside [`top_fits`]); nothing for `Logits::None`. Returns once the
    /// stream has reached this point.
    pub(crate) fn hand_back(
        &mut self,
        logits: u64,
        parts: &mut [(Logits, &mut Vec<f32>)],
    ) -> Result<()> {
        let (n, v) = (parts.len(), self.cfg().vocab_size);
        let tops = top_fits(v);
        let mut row: Vec<bool> = parts
            .iter()
            .map(|(want, _)| match want {
                Logits::Last | Logits::All => true,
                Logits::Top(_) => !tops,
                Logits::Best | Logits::None => false,
            })
            .collect();
        let best = parts.iter().any(|(want, _)| *want == Logits::Best);
        if best {
            self.reduced(Reduce::Best, logits, n, |ids| {
                for ((want, out), &id) in parts.iter_mut().zip(ids) {
                    if *want == Logits::Best {
                        out.push(id);
                    }
                }
            })?;
        }
        let top = tops && parts.iter().any(|(want, _)| matches!(want, Logits::Top(_)));
        if top {
            self.reduced(Reduce::Top, logits, n, |all| {
                let rows = all.chunks_exact(TOP_ROW);
                for (((want, out), t), r) in parts.iter_mut().zip(rows).zip(&mut row) {
                    if let Logits::Top(w) = *want {
                        match top_pairs(t, w) {
                            Some(pairs) => out.extend_from_slice(pairs),
                            None => *r = true,
                        }
                    }
                }
            })?;
        }
        if row.iter().any(|&r| r) {
            self.host_logits.read(&self.gpu, logits, n * v, |all| {
                let mut outs: Vec<_> = parts
                    .iter_mut()
                    .zip(&row)
                    .map(|((_, out), &r)| r.then_some(&mut **out))
                    .collect();
                crate::buffers::spread_rows(all, v, &mut outs);
            })?;
        } else if !best && !top {
            self.gpu.sync()?;
        }
        Ok(())
    }

    /// Reduces each of `rows` rows of logits at `logits` on the GPU as `r` says and hands
    /// `take` what comes back: a float a row whose bits are the pick, or [`TOP_ROW`] floats a
    /// row ([`top_pairs`] reads one); the rows stay where they are.
    fn reduced(
        &mut self,
        r: Reduce,
        logits: u64,
        rows: usize,
        take: impl FnOnce(&[f32]),
    ) -> Result<()> {
        let (s, g) = (&self.s, &self.gpu);
        let v = self.model.cfg.vocab_size;
        let (src, floats) = match r {
            Reduce::Best => {
                let (part, count) = (s.best_part.ptr, s.best_count.ptr);
                best_rows(g, logits, v, rows, part, count, s.best.ptr)?;
                (s.best.ptr, rows)
            }
            Reduce::Top => {
                top_rows(g, logits, v, rows, s.top_keys.ptr, s.top.ptr)?;
                (s.top.ptr, rows * TOP_ROW)
            }
        };
        self.host_logits.read(&self.gpu, src, floats, take)
    }
}
