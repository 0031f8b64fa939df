//! The AVX2 f32 prefill tile (exact precision, 4-bit rows): Y = X Wᵀ in outer-product form.
//!
//! The batch is prepared once as panels of eight tokens: panel p holds, for each element k of
//! the 4-bit lane order ([`super::qmatmul::XBatch`]), tokens 8p..8p+8's values in one 32-byte
//! vector. A block of weight rows is unpacked to f32 in the same lane order (as the dot-product
//! tile did), and the kernel broadcasts one weight of each of up to six rows and multiplies it
//! with two panels' vectors: twelve accumulators, each (row, eight tokens), two loads and six
//! broadcasts per twelve FMAs. An odd number of panels ends with three at once, three rows a
//! call (nine accumulators): one panel alone has six, too few to cover the FMA's latency, and
//! ran at half to two thirds of the pairs' rate on a Zen 3 core, where an expert's 17-24
//! tokens are three panels. The dot-product form it replaces loaded a weight vector and
//! four token vectors from L2 per eight FMAs (2048 × 2048 × 512 tokens on one core: 29
//! Gelem/s, against 39-45 for this one; docs/bench/2026-12-06.md).
//!
//! Every (row, token) sum runs over the elements in the same order, one FMA each, whatever
//! the chunk's size, the token's place in it or the rows beside it: the tile is
//! batch-invariant.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::cpu::kernels::pool::SharedMut;
use crate::linear::LinearRef;

/// Tokens in a panel (one f32 vector).
pub(super) const PANEL: usize = 8;
/// Rows of one kernel call.
const MR: usize = 6;
/// Row groups of one block (its rows stay in L2 while every panel passes).
const GROUPS: usize = 8;
/// Elements of a panel chunk every row group of a block takes before the next (2 × 8 KiB).
const KB: usize = 256;

/// f32 elements of the weight tile for rows of `npad`: a block of GROUPS·MR rows, at most
/// 384 KiB.
pub(super) fn tile_len(npad: usize) -> usize {
    (GROUPS * MR * npad).min(96 * 1024).max(npad)
}

/// Writes x [t, n] into `panels` as ⌈t/8⌉ panels of [npad][8]: element k of the 4-bit lane
/// order (64-element blocks; position 8·kk + j holds element 8·j + kk), zero past n and
/// past the last token.
pub(super) fn prepare(x: &[f32], t: usize, n: usize, npad: usize, panels: &mut Vec<f32>) {
    let np = t.div_ceil(PANEL);
    panels.clear();
    panels.resize(np * npad * PANEL, 0.0);
    for (p, panel) in panels.chunks_exact_mut(npad * PANEL).enumerate() {
        for j in 0..PANEL.min(t - p * PANEL) {
            let xr = &x[(p * PANEL + j) * n..][..n];
            for (b, blk) in xr.chunks(64).enumerate() {
                let out = &mut panel[b * 64 * PANEL..];
                for (i, &v) in blk.iter().enumerate() {
                    let pos = (i % 8) * 8 + i / 8;
                    out[pos * PANEL + j] = v;
                }
            }
        }
    }
}

/// Y's columns `rows` for the t tokens of `panels` (prepared by [`prepare`] at `npad`), with
/// `tile` (≥ npad f32) and `sbuf` as [`super::avx2::unpack_row`]'s buffers.
///
/// # Safety
/// AVX2 and FMA must be present. `w` must be a 4-bit affine matrix in row order that passed
/// [`super::qmatvec::check`], `panels` hold ⌈t/8⌉ panels of npad ≥ in_features elements, `y`
/// t·out elements, and no other thread touch Y's columns `rows` meanwhile.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul_rows(
    w: &LinearRef<'_>,
    panels: &[f32],
    npad: usize,
    t: usize,
    out: usize,
    y: SharedMut<'_, f32>,
    rows: Range<usize>,
    tile: &mut [f32],
    sbuf: &mut [f32],
) {
    let np = t.div_ceil(PANEL);
    assert!(panels.len() >= np * npad * PANEL && y.len() >= t * out && rows.end <= out);
    let rb = (tile.len() / npad).clamp(1, GROUPS * MR);
    let rb = if rb >= MR { rb / MR * MR } else { rb };
    let mut r0 = rows.start;
    while r0 < rows.end {
        let nr = rb.min(rows.end - r0);
        for i in 0..nr {
            // SAFETY: forwarded (4-bit lane order; the tile holds nr rows of npad).
            unsafe { super::avx2::unpack_row(w, r0 + i, true, &mut tile[i * npad..], sbuf) };
        }
        let mut p = 0;
        while p < np {
            // Panels in pairs; an odd count's last three together, in rows of three (a
            // lone panel's six accumulators ran at half to two thirds of the pairs' rate).
            let pp = match np - p {
                3 => 3,
                1 => 1,
                _ => 2,
            };
            let pass = Pass {
                tile,
                npad,
                nr,
                x: panels[p * npad * PANEL..].as_ptr(),
                tokens: (t - p * PANEL).min(pp * PANEL),
                at: p * PANEL * out + r0,
                out,
            };
            // SAFETY: the tile holds nr rows of npad elements and the panels pp panels of
            // npad from p (asserted above); Y's columns r0..r0+nr are ours; AVX2 and FMA are
            // present.
            unsafe {
                if pp == 3 {
                    pass.run::<{ 3 * PANEL }>(&y, three);
                } else if pp == 2 {
                    pass.run::<{ 2 * PANEL }>(&y, few::<2>);
                } else {
                    pass.run::<{ 2 * PANEL }>(&y, few::<1>);
                }
            }
            p += pp;
        }
        r0 += nr;
    }
}

/// One pass of a block's rows over up to three panels from `x`.
struct Pass<'t> {
    tile: &'t [f32],
    npad: usize,
    /// Rows of the block in the tile.
    nr: usize,
    x: *const f32,
    /// Tokens of these panels.
    tokens: usize,
    /// Y's index of the first token's first column.
    at: usize,
    out: usize,
}

/// The kernels of one row group: (rows, weights, panels, elements, its partial sums).
type Group<const W: usize> =
    unsafe fn(usize, *const f32, usize, *const f32, Range<usize>, &mut [[f32; W]; MR]);

impl Pass<'_> {
    /// Runs `group` on every row group, a chunk of elements at a time, and writes Y.
    ///
    /// # Safety
    /// As [`matmul_rows`]'s, for this pass's rows, panels and columns.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const W: usize>(&self, y: &SharedMut<'_, f32>, group: Group<W>) {
        let (npad, nr) = (self.npad, self.nr);
        let mut acc = [[[0.0f32; W]; MR]; GROUPS];
        // A chunk of the panels' elements stays in L1 while every row group of the block
        // takes it; each (row, token) sum still runs over the elements in order.
        let mut k0 = 0;
        while k0 < npad {
            let k1 = (k0 + KB).min(npad);
            for (gi, acc) in acc.iter_mut().enumerate().take(nr.div_ceil(MR)) {
                let i = gi * MR;
                let wp = self.tile[i * npad..].as_ptr();
                // SAFETY: forwarded; the tile holds rows i..i + rr.
                unsafe { group(MR.min(nr - i), wp, npad, self.x, k0..k1, acc) };
            }
            k0 = k1;
        }
        // Token by token, each a run of consecutive columns (row by row, every store went
        // to another token's row: 6 % of the tile's time).
        for b in 0..self.tokens {
            let at = self.at + b * self.out;
            // SAFETY: these columns belong to the caller's rows alone; `slice` checks they
            // are inside Y.
            let yr = unsafe { y.slice(at..at + nr) };
            for (i, v) in yr.iter_mut().enumerate() {
                *v = acc[i / MR][i % MR][b];
            }
        }
    }
}

/// A row group of `rr` rows over P (one or two) panels.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn few<const P: usize>(
    rr: usize,
    w: *const f32,
    n: usize,
    x: *const f32,
    ks: Range<usize>,
    acc: &mut [[f32; 2 * PANEL]; MR],
) {
    // SAFETY: forwarded.
    unsafe {
        match rr {
            6 => kernel::<6, P, { 2 * PANEL }>(w, n, x, n, ks, acc),
            5 => kernel::<5, P, { 2 * PANEL }>(w, n, x, n, ks, acc),
            4 => kernel::<4, P, { 2 * PANEL }>(w, n, x, n, ks, acc),
            3 => kernel::<3, P, { 2 * PANEL }>(w, n, x, n, ks, acc),
            2 => kernel::<2, P, { 2 * PANEL }>(w, n, x, n, ks, acc),
            _ => kernel::<1, P, { 2 * PANEL }>(w, n, x, n, ks, acc),
        }
    }
}

/// A row group over three panels, three rows a call.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn three(
    rr: usize,
    w: *const f32,
    n: usize,
    x: *const f32,
    ks: Range<usize>,
    acc: &mut [[f32; 3 * PANEL]; MR],
) {
    let (a, b) = acc.split_at_mut(3);
    // SAFETY: forwarded; the second call's rows 3.. exist where rr > 3.
    unsafe {
        three_rows(rr.min(3), w, n, x, ks.clone(), a);
        if rr > 3 {
            three_rows(rr - 3, w.add(3 * n), n, x, ks, b);
        }
    }
}

/// `rr` (1 to 3) rows over three panels.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn three_rows(
    rr: usize,
    w: *const f32,
    n: usize,
    x: *const f32,
    ks: Range<usize>,
    acc: &mut [[f32; 3 * PANEL]],
) {
    // SAFETY: forwarded.
    unsafe {
        match rr {
            3 => kernel::<3, 3, { 3 * PANEL }>(w, n, x, n, ks, acc),
            2 => kernel::<2, 3, { 3 * PANEL }>(w, n, x, n, ks, acc),
            _ => kernel::<1, 3, { 3 * PANEL }>(w, n, x, n, ks, acc),
        }
    }
}

/// acc[r][8q + j] += Σ_{k ∈ ks} w[r·ws + k] · x[q·8·n + 8k + j] for r < R, q < P, one FMA
/// per k in order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const R: usize, const P: usize, const W: usize>(
    w: *const f32,
    ws: usize,
    x: *const f32,
    n: usize,
    ks: Range<usize>,
    acc: &mut [[f32; W]],
) {
    const { assert!(P * PANEL <= W) };
    assert!(acc.len() >= R);
    let mut a = [[_mm256_setzero_ps(); P]; R];
    // SAFETY: the caller guarantees R rows of ≥ ks.end weights at stride ws and P panels of
    // n ≥ ks.end.
    unsafe {
        for (ar, acc) in a.iter_mut().zip(acc.iter()) {
            for (q, v) in ar.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(acc.as_ptr().add(q * PANEL));
            }
        }
        for k in ks {
            let mut xv = [_mm256_setzero_ps(); P];
            for (q, v) in xv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(x.add(q * n * PANEL + k * PANEL));
            }
            for (r, ar) in a.iter_mut().enumerate() {
                let b = _mm256_broadcast_ss(&*w.add(r * ws + k));
                for (q, v) in ar.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(b, xv[q], *v);
                }
            }
        }
        for (ar, out) in a.iter().zip(acc.iter_mut()) {
            for (q, v) in ar.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(q * PANEL), *v);
            }
        }
    }
}
