//! Running several linear layers that read the same input as one pool job.
//!
//! Owns the choice between the matvec kernel (one token, or a short chunk row by row:
//! [`ONE_TOKEN_ROWS`]) and the matmul kernel (a longer chunk) and the row
//! split of each matrix over the pool's threads, so model code says "these projections of x"
//! and nothing about kernels or threads. It must not allocate beyond scratch that only grows
//! (tasks live in a fixed array) or know about layers. Mirrors calling
//! [`crate::linear::LinearRef::forward_rows`] once per matrix.

use std::ops::Range;

use crate::cpu::SimdLevel;
use crate::cpu::kernels::pool::{Chunks, CpuPool, SharedMut};
use crate::cpu::kernels::qmatmul::{XBatch, matmul_rows};
use crate::cpu::kernels::qmatvec::{Precision, XPrep, check, matvec_rows, matvec_rows_tokens};
use crate::error::{Error, Result};
use crate::linear::{LinearRef, MatRef, Order};

/// Matrices one [`Exec::linears`] call may run at once.
pub const MAX_TASKS: usize = 8;
/// Rows per unit of work handed to a thread.
const ROWS: usize = 32;
/// Chunks of at most this many tokens take the one-token kernels, a row each, instead of the
/// chunk kernels, whose re-layout of each weight block (`spread16`, `expand`) and token
/// tiles of 8 cost as much as the products of a few tokens: a short prompt's experts see
/// one or two tokens each. Resident 35B, dev-2c, 2026-12-05: pp8 27 → 40-50 tok/s, pp32 38 →
/// 52-63, pp128 61 → 77-79; forced AVX2 pp8 11 → 20, pp32 15 → 26 (16 tokens cost AVX2's
/// `fast` pp512 14 %).
pub const ONE_TOKEN_ROWS: usize = 8;
/// [`ONE_TOKEN_ROWS`] for 4-bit matrices in tiles with AVX-512 VNNI, whose one-token kernel
/// reads each weight block once for up to 64 tokens and gives the tile's bits
/// (tests/cpu_tiles.rs): a 512-token chunk's experts (about 16 tokens each on the 35B) then
/// skip the tile too, pp512 +5-10 % exact and +15-20 % `fast` (docs/bench/2026-12-05.md).
pub const ONE_TOKEN_ROWS_TILED: usize = 64;

/// The pool and SIMD level the forward pass runs on.
#[derive(Debug, Clone, Copy)]
pub struct Exec<'p> {
    pub pool: &'p CpuPool,
    pub level: SimdLevel,
    /// How products treat the activations (one-token matvecs; chunks: [`Exec::batch_precision`]).
    pub precision: Precision,
}

/// Work run on rows of a product as soon as they are computed: (matrix, rows, their output).
pub type Then<'a> = dyn Fn(usize, Range<usize>, &mut [f32]) + Sync + 'a;

/// Scratch for one input of [`Exec::linears`]: prepared forms of x.
#[derive(Debug, Clone, Default)]
pub struct XScratch {
    pub prep: XPrep,
    pub batch: XBatch,
    /// One prepared row per token of a row-wise call ([`Exec::linears_rowwise`]).
    pub rows: Vec<XPrep>,
}

impl Exec<'_> {
    /// The precision of chunk (prefill) products: the exact default takes Split24's integer
    /// tile where AVX-512 VNNI exists (equal to f32 up to f32 rounding, and 1.3-1.4x faster
    /// than the f32 tile: BENCH.md), and the f32 tile elsewhere.
    pub fn batch_precision(&self) -> Precision {
        match self.precision {
            Precision::Exact if self.level == SimdLevel::Avx512 && SimdLevel::has_vnni() => {
                Precision::Split24
            }
            p => p,
        }
    }

    /// For every (W, y) in `outs`: y [T, out] = x [T, in] Wᵀ, all rows of all matrices split
    /// over the pool in one job. Every W must have `in` = x.len() / T columns.
    pub fn linears(
        &self,
        x: &[f32],
        t: usize,
        s: &mut XScratch,
        outs: &mut [(LinearRef<'_>, &mut [f32])],
    ) -> Result<()> {
        self.run(x, t, s, outs, None, false)
    }

    /// [`Exec::linears`], or with `rowwise` each of the `t` rows computed by the one-token
    /// kernel (the same bits as `t` one-token calls), every block of weight rows read from
    /// memory once for all of them: a step of several sequences' single tokens.
    pub fn linears_rowwise(
        &self,
        rowwise: bool,
        x: &[f32],
        t: usize,
        s: &mut XScratch,
        outs: &mut [(LinearRef<'_>, &mut [f32])],
    ) -> Result<()> {
        self.run(x, t, s, outs, None, rowwise)
    }

    /// Each row of x (rows of n) prepared for the one-token kernels into `rows`, which only
    /// grows.
    fn prepare_rows(&self, x: &[f32], n: usize, rows: &mut Vec<XPrep>) {
        let t = x.len() / n;
        if rows.len() < t {
            rows.resize_with(t, XPrep::default);
        }
        for (p, row) in rows.iter_mut().zip(x.chunks_exact(n)) {
            p.prepare_with(self.level, self.precision, row);
        }
    }

    /// Most tokens of a chunk whose products over `outs` take the one-token kernels:
    /// [`ONE_TOKEN_ROWS_TILED`] where every matrix is 4-bit in tiles and AVX-512 VNNI runs
    /// them, else [`ONE_TOKEN_ROWS`].
    fn one_token_rows(&self, outs: &[(LinearRef<'_>, &mut [f32])]) -> usize {
        let tiled = |w: &LinearRef<'_>| matches!(w.mat, MatRef::Affine { spec, order: Order::Tiles, .. } if spec.bits == 4);
        if self.level == SimdLevel::Avx512
            && SimdLevel::has_vnni()
            && outs.iter().all(|(w, _)| tiled(w))
        {
            ONE_TOKEN_ROWS_TILED
        } else {
            ONE_TOKEN_ROWS
        }
    }

    /// [`Exec::linears`] for one token x (`in` floats) that also runs `then(i, rows, y)` on
    /// the thread that computed rows `rows` of matrix `outs[i]`, with those rows of its
    /// output, right after computing them: per-row work that would otherwise be a pool job of
    /// its own (the DeltaNet's convolution of its projected channels).
    pub fn linears_then(
        &self,
        x: &[f32],
        s: &mut XScratch,
        outs: &mut [(LinearRef<'_>, &mut [f32])],
        then: &Then<'_>,
    ) -> Result<()> {
        self.run(x, 1, s, outs, Some(then), false)
    }

    fn run(
        &self,
        x: &[f32],
        t: usize,
        s: &mut XScratch,
        outs: &mut [(LinearRef<'_>, &mut [f32])],
        then: Option<&Then<'_>>,
        rowwise: bool,
    ) -> Result<()> {
        if outs.is_empty() || t == 0 {
            return Ok(());
        }
        if outs.len() > MAX_TASKS {
            return Err(Error::Invalid(format!("{} linears in one job", outs.len())));
        }
        let n = check_outs(x, t, outs)?;
        let rowwise = (rowwise || t <= self.one_token_rows(outs)) && t > 1;
        if t == 1 {
            s.prep.prepare_with(self.level, self.precision, x);
        } else if rowwise {
            self.prepare_rows(x, n, &mut s.rows);
        } else {
            s.batch
                .prepare_with(self.level, self.batch_precision(), x, n);
        }
        let mut tasks: [Option<(LinearRef<'_>, SharedMut<'_, f32>)>; MAX_TASKS] = [None; MAX_TASKS];
        for (slot, (w, y)) in tasks.iter_mut().zip(outs.iter_mut()) {
            *slot = Some((*w, SharedMut::new(&mut y[..t * w.out_features])));
        }
        // Work units: blocks of ROWS rows, task after task.
        let mut first = [0usize; MAX_TASKS + 1];
        for (i, task) in tasks.iter().enumerate() {
            let rows = task.as_ref().map_or(0, |(w, _)| w.out_features);
            first[i + 1] = first[i] + rows.div_ceil(ROWS);
        }
        let chunks = Chunks::guided(first[MAX_TASKS], self.pool.threads(), 1);
        let (level, s) = (self.level, &*s);
        self.pool.run(&|_| {
            while let Some(units) = chunks.claim() {
                // The claim's units, one matrix at a time, as one run of rows each.
                let mut u = units.start;
                while u < units.end {
                    let i = first.partition_point(|&f| f <= u) - 1;
                    let last = units.end.min(first[i + 1]);
                    let Some((w, y)) = &tasks[i] else {
                        u = last;
                        continue;
                    };
                    let rows =
                        (u - first[i]) * ROWS..((last - first[i]) * ROWS).min(w.out_features);
                    if t == 1 {
                        // SAFETY: every unit is claimed by one thread only, so its rows are
                        // written by no other thread.
                        let ys = unsafe { y.slice(rows.clone()) };
                        matvec_rows(level, w, &s.prep, ys, rows.clone());
                        if let Some(f) = then {
                            f(i, rows, ys);
                        }
                    } else if rowwise {
                        // SAFETY: as above, every token's columns `rows` are this unit's.
                        unsafe {
                            matvec_rows_tokens(level, w, &s.rows[..t], y, w.out_features, rows)
                        };
                    } else {
                        // SAFETY: as above; matmul writes only columns `rows` of Y.
                        unsafe { matmul_rows(level, w, &s.batch, *y, rows) };
                    }
                    u = last;
                }
            }
        });
        Ok(())
    }

    /// [`Exec::linears`] for a chunk of t ≥ 1 tokens on the calling thread alone (a pool job
    /// running one whole expert per thread), with x prepared into `s`.
    pub fn linears_here(
        &self,
        x: &[f32],
        t: usize,
        s: &mut XScratch,
        outs: &mut [(LinearRef<'_>, &mut [f32])],
    ) -> Result<()> {
        if outs.is_empty() || t == 0 {
            return Ok(());
        }
        let n = check_outs(x, t, outs)?;
        if t <= self.one_token_rows(outs) {
            self.prepare_rows(x, n, &mut s.rows);
            for (w, y) in outs.iter_mut() {
                let out = w.out_features;
                let ys = SharedMut::new(&mut y[..t * out]);
                // SAFETY: this thread alone holds `y`; token i's rows 0..out go to
                // y[i·out..], which `check_outs` verified exist.
                unsafe { matvec_rows_tokens(self.level, w, &s.rows[..t], &ys, out, 0..out) };
            }
            return Ok(());
        }
        let xb = &mut s.batch;
        xb.prepare_with(self.level, self.batch_precision(), x, n);
        for (w, y) in outs.iter_mut() {
            let out = w.out_features;
            // SAFETY: this thread alone holds `y` (a unique borrow); matmul writes its T·out
            // elements, which `check_outs` verified it has.
            unsafe { matmul_rows(self.level, w, xb, SharedMut::new(&mut y[..t * out]), 0..out) };
        }
        Ok(())
    }
}

/// Checks every (W, y) of `outs` against x [t, n] and returns n.
fn check_outs(x: &[f32], t: usize, outs: &[(LinearRef<'_>, &mut [f32])]) -> Result<usize> {
    let n = x.len() / t;
    for (w, y) in outs.iter() {
        check(w)?;
        if w.in_features != n || x.len() != t * n || y.len() < t * w.out_features {
            return Err(Error::Invalid(format!(
                "linear [{}, {}] given {t} rows of {n} and an output of {}",
                w.out_features,
                w.in_features,
                y.len()
            )));
        }
    }
    Ok(n)
}
