//! Y = X Wᵀ for a chunk of tokens (prefill): X [T, in] → Y [T, out], on the checkpoint's bytes.
//!
//! Owns the token batch preparation ([`XBatch`]) and the blocked loop: a block of weight rows
//! is unpacked once into an f32 tile on the stack (≤ 128 KiB, so it stays in L2) and then
//! multiplied with every token of the chunk by a register-tiled 4×4 (rows × tokens) kernel.
//! 4-bit rows are unpacked in the same lane order as the x86 matvec and the tokens are
//! permuted to match, so no interleave is needed. On AVX2 the tokens are prepared as panels
//! of eight instead and 4-bit rows take the outer-product tile of `avx2_mm.rs`. At [`Precision::Split24`] and
//! [`Precision::Fast`] on AVX-512 VNNI, 4-bit matrices instead take the integer tile of
//! `avx512_vnni_mm.rs` on the batch's activation digits. It must not allocate per call for
//! widths up to 32768 or know about models. It mirrors [`crate::linear::LinearRef::forward_rows`], which
//! also dequantizes each row once for all tokens.

use std::cell::RefCell;
use std::ops::Range;

use crate::cpu::SimdLevel;
use crate::cpu::kernels::pool::{Chunks, CpuPool, SharedMut};
use crate::cpu::kernels::qmatvec::{Affine, Precision, check, dequant_row, dot};
use crate::error::{Error, Result};
use crate::linear::{LinearRef, MatRef, Order};

/// f32 elements of the per-thread weight tile.
const TILE: usize = 32 * 1024;
/// f32 elements after the tile for one row's widened scales and biases (1024 groups each,
/// plus a vector of padding).
const SCALE_BUF: usize = 2 * (1024 + 16);

/// A chunk of input rows prepared for [`matmul_rows`] at one [`SimdLevel`].
#[derive(Debug, Clone, Default)]
pub struct XBatch {
    level: Option<SimdLevel>,
    t: usize,
    n: usize,
    x: Vec<f32>,      // [t, n]
    lanes: Vec<f32>,  // [t, npad]: each row in the 4-bit lane order of `level`
    panels: Vec<f32>, // AVX2: [⌈t/8⌉, npad, 8], the lane order's panels of eight tokens
    npad: usize,
    nd: usize,       // digits per element in `digits`: 0 (none), 1 (Fast) or 3 (Split24)
    digits: Vec<i8>, // [t, n/32, nd, 32]: each 32-block's digits in element order
    coef: Vec<f32>,  // [t, n/32, nd]: the factor of each digit's sums
    sums: [Vec<f32>; 3], // [t, n/g] for g = 32, 64, 128: Σx per group (empty if g ∤ n)
    avx2: bool,      // digits, coef and sums in the AVX2 kernels' token layout instead
    no_avx_vnni: bool, // the AVX2 kernels never take AVX-VNNI (`set_avx_vnni`)
}

impl XBatch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Prepares x [t, n] (t = x.len() / n) for f32 products.
    pub fn prepare(&mut self, level: SimdLevel, x: &[f32], n: usize) {
        self.prepare_with(level, Precision::Exact, x, n)
    }

    /// Prepares x [t, n] (t = x.len() / n) for products at `precision`: Split24 and Fast add
    /// the activation digits of an integer tile (AVX-512 VNNI's, or AVX2's) where this CPU
    /// has it and 32 divides n.
    pub fn prepare_with(&mut self, level: SimdLevel, precision: Precision, x: &[f32], n: usize) {
        let t = x.len() / n.max(1);
        self.nd = 0;
        self.avx2 = false;
        if precision != Precision::Exact && n.is_multiple_of(32) {
            let nd = if precision == Precision::Fast { 1 } else { 3 };
            let xs = &x[..t * n];
            if level == SimdLevel::Avx512 && SimdLevel::has_vnni() {
                let (d, c) = (&mut self.digits, &mut self.coef);
                super::xprep::digits_and_sums(nd, xs, n, d, c, &mut self.sums);
                self.nd = nd;
            } else if cfg!(target_arch = "x86_64")
                && level == SimdLevel::Avx2
                && level.is_supported()
                && n > 0
            {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 is supported (checked above).
                unsafe {
                    let (d, c) = (&mut self.digits, &mut self.coef);
                    super::avx2_int_mm::prepare(nd, xs, n, d, c, &mut self.sums)
                };
                self.nd = nd;
                self.avx2 = true;
            }
        }
        self.level = Some(level);
        self.t = t;
        self.n = n;
        self.x.clear();
        self.x.extend_from_slice(&x[..t * n]);
        let lanes = lanes_of(level);
        self.lanes.clear();
        self.panels.clear();
        // With digits, every 4-bit matrix the lane order serves takes the integer tile.
        if lanes == 0 || self.nd > 0 {
            self.npad = n;
            return;
        }
        let block = lanes * 8;
        self.npad = n.div_ceil(block) * block;
        #[cfg(target_arch = "x86_64")]
        if level == SimdLevel::Avx2 && level.is_supported() {
            super::avx2_mm::prepare(&x[..t * n], t, n, self.npad, &mut self.panels);
            return;
        }
        self.lanes.resize(t * self.npad, 0.0);
        for (xr, out) in x
            .chunks_exact(n)
            .zip(self.lanes.chunks_exact_mut(self.npad))
        {
            for (b, ob) in out.chunks_exact_mut(block).enumerate() {
                for j in 0..lanes {
                    for k in 0..8 {
                        let i = b * block + 8 * j + k;
                        ob[k * lanes + j] = if i < n { xr[i] } else { 0.0 };
                    }
                }
            }
        }
    }

    /// Whether the AVX2 integer kernels may take AVX-VNNI's instruction where the CPU has it
    /// (the default); off, they run `vpmaddubsw` + `vpmaddwd` as on CPUs without it. For
    /// tests and benchmarks that compare the two.
    pub fn set_avx_vnni(&mut self, on: bool) {
        self.no_avx_vnni = !on;
    }

    /// Tokens prepared.
    pub fn tokens(&self) -> usize {
        self.t
    }
}

/// Vector lanes of the 4-bit lane order at `level`, 0 for natural order.
fn lanes_of(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Portable => 0,
        SimdLevel::Avx2 => 8,
        SimdLevel::Avx512 => 16,
    }
}

/// Writes rows `rows` of Y [T, out] = X Wᵀ through `y`.
///
/// # Safety
/// No other thread may touch Y's columns `rows` meanwhile. `w` must have passed [`check`],
/// `xb` be prepared at `level` from rows of `w.in_features`, and `y` hold T·out elements
/// (asserted).
pub unsafe fn matmul_rows(
    level: SimdLevel,
    w: &LinearRef<'_>,
    xb: &XBatch,
    y: SharedMut<'_, f32>,
    rows: Range<usize>,
) {
    let (n, out, t) = (w.in_features, w.out_features, xb.t);
    assert!(xb.level == Some(level) && xb.n == n && y.len() >= t * out);
    assert!(rows.end <= out);
    let level = if level.is_supported() {
        level
    } else {
        SimdLevel::Portable
    };
    #[cfg(target_arch = "x86_64")]
    if xb.avx2
        && level == SimdLevel::Avx2
        && let Some(a) = Affine::of(w)
        && a.bits == 4
        && a.order == Order::Rows
        && let Some(k) = [32, 64, 128].iter().position(|&g| g == a.group)
    {
        let x = super::avx2_int_mm::Digits {
            nd: xb.nd,
            bytes: &xb.digits,
            coef: &xb.coef,
            sums: &xb.sums[k],
        };
        let vnni = SimdLevel::has_avx_vnni() && !xb.no_avx_vnni;
        // SAFETY: the AVX2 digits are only prepared where AVX2 runs (AVX-VNNI where
        // detected); `w` passed `check`, the batch holds t tokens of n = 32·blocks and Y
        // t·out elements (asserted above); the caller gave us columns `rows` alone.
        unsafe { super::avx2_int_mm::matmul_rows(&a, x, vnni, t, out, y, rows) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if xb.nd > 0
        && !xb.avx2
        && level == SimdLevel::Avx512
        && let Some(a) = Affine::of(w)
        && a.bits == 4
        && let Some(k) = [32, 64, 128].iter().position(|&g| g == a.group)
    {
        let x = super::avx512_vnni_mm::Digits {
            nd: xb.nd,
            bytes: &xb.digits,
            coef: &xb.coef,
            sums: &xb.sums[k],
        };
        // SAFETY: digits are only prepared with VNNI present; `w` passed `check`, the batch
        // holds t tokens of n = 32·blocks and Y t·out elements (asserted above); the caller
        // gave us columns `rows` alone.
        unsafe { super::avx512_vnni_mm::matmul_rows(&a, x, t, out, y, rows) };
        return;
    }
    // A tiled matrix off the VNNI path takes rows dequantized in natural order.
    let lane_order = matches!(w.mat, MatRef::Affine { spec, order: Order::Rows, .. } if spec.bits == 4)
        && lanes_of(level) > 0
        && !(xb.lanes.is_empty() && xb.panels.is_empty())
        && xb.npad <= TILE;
    let (xs, stride) = if lane_order {
        (&xb.lanes[..], xb.npad)
    } else {
        (&xb.x[..], n)
    };
    // AVX2's batch comes as panels of eight tokens (no lane-order rows), for its own tile.
    let panels = lane_order && !xb.panels.is_empty();
    TILE_BUF.with_borrow_mut(|buf| {
        // Kept per thread: a fresh zeroed 128 KiB array per call cost 7% of a prefill.
        let need = if panels {
            avx2_tile_len(stride)
        } else {
            TILE.max(stride)
        } + SCALE_BUF;
        if buf.len() < need {
            buf.resize(need, 0.0);
        }
        #[cfg(target_arch = "x86_64")]
        if panels {
            let at = buf.len() - SCALE_BUF;
            let (tile, sbuf) = buf.split_at_mut(at);
            // SAFETY: panels are only prepared where AVX2 runs; `w` is a 4-bit row-order
            // matrix that passed `check`, the panels hold t tokens of npad ≥ n and Y t·out
            // elements (asserted above); the caller gave us columns `rows` alone.
            unsafe {
                super::avx2_mm::matmul_rows(w, &xb.panels, xb.npad, t, out, y, rows, tile, sbuf)
            };
            return;
        }
        // SAFETY: forwarded from our caller.
        unsafe { blocked(level, w, xs, stride, lane_order, t, out, y, rows, buf) };
    });
}

/// The AVX2 panel tile's weight tile for rows of `npad`.
fn avx2_tile_len(npad: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    return super::avx2_mm::tile_len(npad);
    #[cfg(not(target_arch = "x86_64"))]
    npad
}

thread_local! {
    /// Each thread's weight tile (grows once to the widest row block it met).
    static TILE_BUF: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The blocked loop of [`matmul_rows`] with its tile.
///
/// # Safety
/// As [`matmul_rows`].
#[allow(clippy::too_many_arguments)]
unsafe fn blocked(
    level: SimdLevel,
    w: &LinearRef<'_>,
    xs: &[f32],
    stride: usize,
    lane_order: bool,
    t: usize,
    out: usize,
    y: SharedMut<'_, f32>,
    rows: Range<usize>,
    buf: &mut [f32],
) {
    let (tile, sbuf) = buf.split_at_mut(buf.len() - SCALE_BUF);
    let rb = (tile.len() / stride).clamp(1, 16);
    let mut r0 = rows.start;
    while r0 < rows.end {
        let nr = rb.min(rows.end - r0);
        for i in 0..nr {
            let dst = &mut tile[i * stride..(i + 1) * stride];
            unpack_row(level, w, r0 + i, lane_order, dst, sbuf);
        }
        let mut t0 = 0;
        while t0 < t {
            let tt = if t - t0 >= 4 { 4 } else { 1 };
            let mut i = 0;
            while i < nr {
                let rr = if nr - i >= 4 { 4 } else { 1 };
                let mut acc = [[0.0f32; 4]; 4];
                tile_dot(
                    level,
                    &tile[i * stride..],
                    stride,
                    &xs[t0 * stride..],
                    stride,
                    rr,
                    tt,
                    &mut acc,
                );
                for (a, accr) in acc.iter().enumerate().take(rr) {
                    for (b, &v) in accr.iter().enumerate().take(tt) {
                        // SAFETY: column r0+i+a belongs to `rows`, which the caller gave to us
                        // alone; the index is inside Y (asserted above).
                        unsafe { y.write((t0 + b) * out + r0 + i + a, v) };
                    }
                }
                i += rr;
            }
            t0 += tt;
        }
        r0 += nr;
    }
}

/// Row `r` of W as f32 into `dst` (natural order, or 4-bit lane order when `lanes`).
fn unpack_row(
    level: SimdLevel,
    w: &LinearRef<'_>,
    r: usize,
    lanes: bool,
    dst: &mut [f32],
    sbuf: &mut [f32],
) {
    if let MatRef::Affine {
        order: Order::Tiles,
        ..
    } = w.mat
    {
        return dequant_row(w, r, dst);
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is supported (checked by the caller) and `w` passed `check`.
        SimdLevel::Avx512 => unsafe { super::avx512_mm::unpack_row(w, r, lanes, dst, sbuf) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { super::avx2::unpack_row(w, r, lanes, dst, sbuf) },
        _ => {
            debug_assert!(!lanes);
            dequant_row(w, r, dst)
        }
    }
}

/// acc[a][b] = Σ_i w[a·ws + i] x[b·xs + i] over `ws`... for a < rr, b < tt (each 1 or 4).
#[allow(clippy::too_many_arguments)]
fn tile_dot(
    level: SimdLevel,
    w: &[f32],
    ws: usize,
    x: &[f32],
    xs: usize,
    rr: usize,
    tt: usize,
    acc: &mut [[f32; 4]; 4],
) {
    let n = ws.min(xs);
    assert!(w.len() >= (rr - 1) * ws + n && x.len() >= (tt - 1) * xs + n);
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: bounds asserted above; the level is supported.
        SimdLevel::Avx512 => unsafe { super::avx512_mm::tile(w, ws, x, xs, n, rr, tt, acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { super::avx2::tile(w, ws, x, xs, n, rr, tt, acc) },
        _ => {
            for a in 0..rr {
                for b in 0..tt {
                    acc[a][b] = dot(&w[a * ws..a * ws + n], &x[b * xs..b * xs + n]);
                }
            }
        }
    }
}

/// Y [T, out] = X [T, in] Wᵀ on one thread.
pub fn qmatmul(
    level: SimdLevel,
    w: &LinearRef<'_>,
    x: &[f32],
    y: &mut [f32],
    xb: &mut XBatch,
) -> Result<()> {
    qmatmul_at(level, Precision::Exact, w, x, y, xb)
}

/// [`qmatmul`] at a chosen [`Precision`].
pub fn qmatmul_at(
    level: SimdLevel,
    precision: Precision,
    w: &LinearRef<'_>,
    x: &[f32],
    y: &mut [f32],
    xb: &mut XBatch,
) -> Result<()> {
    check_shapes(w, x, y)?;
    xb.prepare_with(level, precision, x, w.in_features);
    // SAFETY: one thread writes every column.
    unsafe { matmul_rows(level, w, xb, SharedMut::new(y), 0..w.out_features) };
    Ok(())
}

/// Y [T, out] = X [T, in] Wᵀ with the rows split over `pool`'s threads.
pub fn qmatmul_pool(
    pool: &CpuPool,
    level: SimdLevel,
    w: &LinearRef<'_>,
    x: &[f32],
    y: &mut [f32],
    xb: &mut XBatch,
) -> Result<()> {
    qmatmul_pool_at(pool, level, Precision::Exact, w, x, y, xb)
}

/// [`qmatmul_pool`] at a chosen [`Precision`].
pub fn qmatmul_pool_at(
    pool: &CpuPool,
    level: SimdLevel,
    precision: Precision,
    w: &LinearRef<'_>,
    x: &[f32],
    y: &mut [f32],
    xb: &mut XBatch,
) -> Result<()> {
    check_shapes(w, x, y)?;
    xb.prepare_with(level, precision, x, w.in_features);
    let (ys, xb) = (SharedMut::new(y), &*xb);
    // Long runs first, as the engine claims them (`Exec::linears`), in units of 16 rows so
    // every run starts where a single thread's 16-row blocks do.
    let chunks = Chunks::guided(w.out_features.div_ceil(16), pool.threads(), 1);
    pool.run(&|_| {
        while let Some(u) = chunks.claim() {
            let rows = u.start * 16..(u.end * 16).min(w.out_features);
            // SAFETY: each chunk of rows (columns of Y) is claimed by one thread only.
            unsafe { matmul_rows(level, w, xb, ys, rows) };
        }
    });
    Ok(())
}

fn check_shapes(w: &LinearRef<'_>, x: &[f32], y: &mut [f32]) -> Result<()> {
    check(w)?;
    let (n, out) = (w.in_features, w.out_features);
    if n == 0 || !x.len().is_multiple_of(n) || y.len() != x.len() / n * out {
        return Err(Error::Invalid(format!(
            "matmul [{out}, {n}] given x of {} and y of {}",
            x.len(),
            y.len()
        )));
    }
    Ok(())
}
