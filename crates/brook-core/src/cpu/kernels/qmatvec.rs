//! y = W x on the checkpoint's own bytes: MLX affine (2–8 bits, groups 32/64/128, BF16/F16/F32
//! scales and biases) and float (F32/BF16/F16) weights, one SIMD level per call.
//!
//! Owns the shape checks, the row dispatch and the portable kernels; the activations come
//! prepared as an [`XPrep`] (xprep.rs: x in the order a kernel unpacks weights, and per-group
//! sums of x); the x86 kernels live in `avx2.rs` / `avx512.rs`. It must not dequantize a whole matrix, allocate per
//! row, or know about models. It mirrors [`LinearRef::forward_rows`] for one input vector: the
//! per-group bias is folded into a sum of x, y_r = Σ_g (s_rg·Σ_{i∈g} q_i x_i + β_rg·Σ_{i∈g} x_i),
//! which equals Σ_i (s q_i + β) x_i up to f32 summation order.

use std::ops::Range;

use crate::cpu::SimdLevel;
use crate::cpu::kernels::pool::{Chunks, CpuPool, SharedMut};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::linear::{LinearRef, MatRef, Order};
use crate::quant;

pub use crate::cpu::kernels::xprep::{Precision, XPrep};

/// Groups whose scales are widened to f32 at once; a longer row is done in segments.
pub(crate) const SEG_GROUPS: usize = 512;
/// Padding after the widened scales, so a kernel may load one full vector past the last group.
pub(crate) const SCALE_PAD: usize = 16;

/// A checked affine matrix as the kernels read it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Affine<'a> {
    pub bits: u32,
    pub group: usize,
    pub float: DType,
    pub n: usize,         // in features
    pub packed: &'a [u8], // [out, n·bits/8]
    pub scales: &'a [u8], // [out, n/group] of `float`
    pub biases: &'a [u8], // [out, n/group] of `float`
    pub order: Order,     // Tiles: `packed`, `scales`, `biases` in 16-row blocks
}

impl<'a> Affine<'a> {
    /// The affine matrix of `w`, or `None` for a float one.
    pub fn of(w: &LinearRef<'a>) -> Option<Self> {
        match w.mat {
            MatRef::Affine {
                spec,
                float,
                packed,
                scales,
                biases,
                order,
            } => Some(Affine {
                bits: spec.bits,
                group: spec.group_size,
                float,
                n: w.in_features,
                packed,
                scales,
                biases,
                order,
            }),
            MatRef::Float { .. } => None,
        }
    }

    #[inline]
    pub fn row_bytes(&self) -> usize {
        (self.n * self.bits as usize) >> 3
    }
    /// Groups per row. Group sizes are powers of two (checked), so this is a shift: a
    /// division here, evaluated per row, cost a 4-bit row of 2048 about a fifth of its time.
    #[inline]
    pub fn groups(&self) -> usize {
        self.n >> self.group.trailing_zeros()
    }
    /// Rows the matrix's bytes hold (at least its checked row count): how far ahead of a
    /// thread's rows prefetches may reach.
    pub fn rows(&self) -> usize {
        let sb = self.groups() * self.float.size();
        (self.packed.len() / self.row_bytes())
            .min(self.scales.len() / sb)
            .min(self.biases.len() / sb)
    }
    /// (packed bytes, scale bytes, bias bytes) of row `r` ([`Order::Rows`] only).
    #[inline]
    pub fn row(&self, r: usize) -> (&[u8], &[u8], &[u8]) {
        debug_assert_eq!(self.order, Order::Rows);
        let (rb, sb) = (self.row_bytes(), self.groups() * self.float.size());
        (
            &self.packed[r * rb..(r + 1) * rb],
            &self.scales[r * sb..(r + 1) * sb],
            &self.biases[r * sb..(r + 1) * sb],
        )
    }
}

/// Checks that `w`'s bytes hold its shape, so kernels may index without bounds checks.
pub fn check(w: &LinearRef<'_>) -> Result<()> {
    let (out, n) = (w.out_features, w.in_features);
    let bad = |what: String| Err(Error::Invalid(format!("linear [{out}, {n}]: {what}")));
    match w.mat {
        MatRef::Float { dtype, data } => {
            if !dtype.is_float() {
                return bad(format!("float weights of dtype {dtype}"));
            }
            let need = out.checked_mul(n).and_then(|v| v.checked_mul(dtype.size()));
            if need.is_none_or(|need| data.len() < need) {
                return bad(format!("{} weight bytes, too few", data.len()));
            }
        }
        MatRef::Affine {
            spec,
            float,
            packed,
            scales,
            biases,
            order,
        } => {
            if let Some(p) = quant::spec_problem(spec, n) {
                return bad(p);
            }
            if order == Order::Tiles && !crate::linear::tiles_fit(spec, out, n) {
                return bad(format!(
                    "{}-bit groups of {} in 16-row tiles",
                    spec.bits, spec.group_size
                ));
            }
            if !float.is_float() {
                return bad(format!("scales of dtype {float}"));
            }
            // Checked: the shape comes from a file, and a product that wrapped would let a
            // short buffer through to kernels that index without bounds checks.
            let sb = out
                .checked_mul(n / spec.group_size)
                .and_then(|v| v.checked_mul(float.size()));
            let pb = quant::words_per_row(n, spec.bits)
                .checked_mul(out)
                .and_then(|v| v.checked_mul(4));
            let (Some(sb), Some(pb)) = (sb, pb) else {
                return bad("the shape's byte size overflows".into());
            };
            if packed.len() < pb || scales.len() < sb || biases.len() < sb {
                return bad("packed weights, scales or biases are too short".into());
            }
        }
    }
    Ok(())
}

/// Rows `rows` of y = W x, written to `y` (length `rows.len()`), at `level`.
///
/// `w` must have passed [`check`] and `xp` must be prepared at `level` from a vector of
/// `w.in_features` elements; both are asserted (a violated assertion is a bug of the caller,
/// never input-dependent once [`check`] passed).
pub fn matvec_rows(
    level: SimdLevel,
    w: &LinearRef<'_>,
    xp: &XPrep,
    y: &mut [f32],
    rows: Range<usize>,
) {
    assert_eq!(xp.level, Some(level), "XPrep prepared for another level");
    assert_eq!(xp.x.len(), w.in_features, "XPrep width");
    assert!(rows.end <= w.out_features && y.len() == rows.len());
    let level = if level.is_supported() {
        level
    } else {
        SimdLevel::Portable
    };
    match w.mat {
        MatRef::Float { dtype, data } => {
            let n = w.in_features;
            let rb = n * dtype.size();
            let data = &data[rows.start * rb..rows.end * rb];
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the level is supported (checked above) and `data` holds y.len() rows.
                SimdLevel::Avx512 => unsafe { super::avx512::float_rows(dtype, data, xp.x(), y) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                SimdLevel::Avx2 => unsafe { super::avx2::float_rows(dtype, data, xp.x(), y) },
                _ => float_rows(dtype, data, xp.x(), y),
            }
        }
        MatRef::Affine { .. } => {
            let Some(a) = Affine::of(w) else {
                unreachable!("an affine matrix")
            };
            // Where the tile digits exist (AVX-512 VNNI, 32 | n), 4-bit matrices in either
            // order take the kernels of 16-row blocks (`avx512_tiles.rs`: the same bits in
            // both): Split24 digits for the exact precisions, int8 for Fast.
            #[cfg(target_arch = "x86_64")]
            if level == SimdLevel::Avx512
                && a.bits == 4
                && matches!(a.group, 32 | 64 | 128)
                && let Some((nd, digits, coef)) = xp.tiles()
            {
                let sums = xp.sums(a.group);
                // SAFETY: tile digits exist only with VNNI and n a multiple of 32; `check`
                // guaranteed the byte lengths (and a tiled shape).
                return unsafe {
                    super::avx512_tiles::matvec_rows(&a, nd, digits, coef, sums, y, rows)
                };
            }
            // On AVX2, 4-bit rows take the integer kernels (`avx2_int.rs`) wherever their
            // digits were prepared (32 | n): Split24 for the exact precisions, int8 for Fast.
            #[cfg(target_arch = "x86_64")]
            if level == SimdLevel::Avx2
                && a.bits == 4
                && a.order == Order::Rows
                && matches!(a.group, 32 | 64 | 128)
                && let Some((nd, vnni, digits, coef)) = xp.avx2_digits()
            {
                let sums = xp.sums(a.group);
                // SAFETY: the level is supported (the digits exist only then, and AVX-VNNI
                // only where detected); `check` guaranteed the byte lengths.
                return unsafe {
                    super::avx2_int::matvec_rows(&a, nd, vnni, digits, coef, sums, y, rows)
                };
            }
            if a.order == Order::Tiles {
                return tiled_rows(w, xp, y, rows);
            }
            match level {
                // The 4-bit f32 kernel reads x in lane order, which a preparation with tile
                // digits leaves out (every 4-bit matrix takes the tiles' kernels there).
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the level is supported and `check` guaranteed the byte lengths.
                SimdLevel::Avx512 if a.bits != 4 || !xp.lanes().is_empty() => unsafe {
                    super::avx512::affine_rows(&a, xp, y, rows)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                SimdLevel::Avx2 => unsafe { super::avx2::affine_rows(&a, xp, y, rows) },
                _ => affine_rows(&a, xp, y, rows),
            }
        }
    }
}

/// [`matvec_rows`] for several tokens (`xps[t]` prepared from token t): token t's rows
/// `rows` go to `y[t * stride + rows]`. Each token gets the bits [`matvec_rows`] gives it;
/// where the tile kernels run on a tiled matrix, the weights of each block are read once for
/// several tokens (`avx512_tiles::matvec_rows_tokens`).
///
/// # Safety
/// Nothing else touches those elements of `y` during the call; `w` and every prep as
/// [`matvec_rows`] asks.
pub unsafe fn matvec_rows_tokens(
    level: SimdLevel,
    w: &LinearRef<'_>,
    xps: &[XPrep],
    y: &super::pool::SharedMut<'_, f32>,
    stride: usize,
    rows: Range<usize>,
) {
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512
        && level.is_supported()
        && xps.len() > 1
        && let Some(a) = Affine::of(w)
        && a.bits == 4
        && a.order == Order::Tiles
        && matches!(a.group, 32 | 64 | 128)
        && let Some((nd, _, _)) = xps[0].tiles()
        && xps.iter().all(|p| {
            p.level == Some(level)
                && p.x.len() == w.in_features
                && p.tiles().is_some_and(|t| t.0 == nd)
        })
    {
        assert!(rows.end <= w.out_features && rows.start <= rows.end);
        let none = super::avx512_tiles::TokenRows {
            digits: std::ptr::null(),
            coef: std::ptr::null(),
            sums: std::ptr::null(),
            y: std::ptr::null_mut(),
        };
        let mut toks = [none; 64];
        for (chunk_i, chunk) in xps.chunks(64).enumerate() {
            for (i, p) in chunk.iter().enumerate() {
                let (_, digits, coef) = p.tiles().expect("checked above");
                let ti = chunk_i * 64 + i;
                // SAFETY: the caller holds these elements of y.
                let ys = unsafe { y.slice(ti * stride + rows.start..ti * stride + rows.end) };
                toks[i] = super::avx512_tiles::TokenRows {
                    digits: digits.as_ptr(),
                    coef: coef.as_ptr(),
                    sums: p.sums(a.group).as_ptr(),
                    y: ys.as_mut_ptr(),
                };
            }
            let toks = &toks[..chunk.len()];
            // SAFETY: VNNI (the tile digits exist only with it), `w` checked by the caller,
            // each token's digits sized for n and its y slice held.
            unsafe { super::avx512_tiles::matvec_rows_tokens(&a, nd, toks, rows.clone()) };
        }
        return;
    }
    for (ti, p) in xps.iter().enumerate() {
        // SAFETY: the caller holds these elements of y.
        let ys = unsafe { y.slice(ti * stride + rows.start..ti * stride + rows.end) };
        matvec_rows(level, w, p, ys, rows.clone());
    }
}

/// Asks for the first few KiB of rows `rows` of `w` to be brought into cache, as
/// [`matvec_rows`] does when it starts on them: for a caller that knows which rows it will
/// multiply next (the one-token MoE warms an expert's up projection while its gate computes).
/// `near`: into L1 for rows about to be read; else into L2, for rows read after the current
/// run (which streams through L1).
pub(crate) fn warm(level: SimdLevel, w: &LinearRef<'_>, rows: Range<usize>, near: bool) {
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Avx512
        && level.is_supported()
        && rows.end <= w.out_features
        && let Some(a) = Affine::of(w)
    {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1};
        let (tb, end) = (rows.start / 16, rows.end.div_ceil(16));
        if a.order == Order::Tiles {
            // SAFETY: prefetches only, of addresses inside the matrix (clamped there).
            unsafe {
                match near {
                    true => super::avx512_tiles::warm::<_MM_HINT_T0>(&a, tb, end),
                    false => super::avx512_tiles::warm::<_MM_HINT_T1>(&a, tb, end),
                }
            };
        } else if near {
            super::avx512::warm_rows(&a, rows.start, rows.end);
        }
    }
    let _ = (level, w, rows, near);
}

/// [`matvec_rows`] for a matrix in 16-row tiles off the VNNI kernels (another level): each
/// row dequantized and dotted with x in f32.
fn tiled_rows(w: &LinearRef<'_>, xp: &XPrep, y: &mut [f32], rows: Range<usize>) {
    ROW_BUF.with_borrow_mut(|buf| {
        buf.resize(w.in_features, 0.0);
        for (yr, r) in y.iter_mut().zip(rows) {
            dequant_row(w, r, buf);
            *yr = dot(buf, xp.x());
        }
    });
}

thread_local! {
    /// A dequantized row for [`tiled_rows`]'s fallback (grows once per width).
    static ROW_BUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// y = W x on one thread: checks `w`, prepares x into `xp`, computes every row.
pub fn qmatvec(
    level: SimdLevel,
    w: &LinearRef<'_>,
    x: &[f32],
    y: &mut [f32],
    xp: &mut XPrep,
) -> Result<()> {
    check(w)?;
    if x.len() != w.in_features || y.len() != w.out_features {
        return Err(Error::Invalid(format!(
            "matvec [{}, {}] given x of {} and y of {}",
            w.out_features,
            w.in_features,
            x.len(),
            y.len()
        )));
    }
    xp.prepare(level, x);
    matvec_rows(level, w, xp, y, 0..w.out_features);
    Ok(())
}

/// y = W x with the rows split over `pool`'s threads (guided chunks of at least 64 rows).
pub fn qmatvec_pool(
    pool: &CpuPool,
    level: SimdLevel,
    w: &LinearRef<'_>,
    x: &[f32],
    y: &mut [f32],
    xp: &mut XPrep,
) -> Result<()> {
    qmatvec_pool_at(pool, level, Precision::Exact, w, x, y, xp)
}

/// [`qmatvec_pool`] at a chosen [`Precision`].
pub fn qmatvec_pool_at(
    pool: &CpuPool,
    level: SimdLevel,
    precision: Precision,
    w: &LinearRef<'_>,
    x: &[f32],
    y: &mut [f32],
    xp: &mut XPrep,
) -> Result<()> {
    check(w)?;
    if x.len() != w.in_features || y.len() != w.out_features {
        return Err(Error::Invalid(format!(
            "matvec [{}, {}] given x of {} and y of {}",
            w.out_features,
            w.in_features,
            x.len(),
            y.len()
        )));
    }
    xp.prepare_with(level, precision, x);
    let (ys, xp) = (SharedMut::new(y), &*xp);
    let chunks = Chunks::guided(w.out_features, pool.threads(), 64);
    pool.run(&|_| {
        while let Some(rows) = chunks.claim() {
            // SAFETY: each chunk of rows is claimed by one thread only.
            let y = unsafe { ys.slice(rows.clone()) };
            matvec_rows(level, w, xp, y, rows);
        }
    });
    Ok(())
}

/// Widens little-endian floats of `dtype` (F32/BF16/F16) into `out`.
pub(crate) fn widen(dtype: DType, src: &[u8], out: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        _ => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// Unpacks the quantized values q of one group (whole u32 words) into `out`.
#[inline]
pub(crate) fn unpack_group(bits: u32, src: &[u8], out: &mut [f32]) {
    match bits {
        4 => {
            for (o, &b) in out.chunks_exact_mut(2).zip(src) {
                o[0] = (b & 15) as f32;
                o[1] = (b >> 4) as f32;
            }
        }
        8 => {
            for (o, &b) in out.iter_mut().zip(src) {
                *o = b as f32;
            }
        }
        _ => {
            // A bit stream read through a 64-bit window refilled a byte at a time.
            let mask = (1u64 << bits) - 1;
            let (mut acc, mut have, mut next) = (0u64, 0u32, 0usize);
            for o in out.iter_mut() {
                while have < bits {
                    acc |= (src[next] as u64) << have;
                    next += 1;
                    have += 8;
                }
                *o = (acc & mask) as f32;
                acc >>= bits;
                have -= bits;
            }
        }
    }
}

/// Dot product with 8 independent partial sums, which the compiler maps to vector lanes.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn float_rows(dtype: DType, data: &[u8], x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let mut buf = [0.0f32; 256];
    for (r, yr) in y.iter_mut().enumerate() {
        let row = &data[r * n * dtype.size()..(r + 1) * n * dtype.size()];
        let mut acc = 0.0;
        for (c, xc) in x.chunks(256).enumerate() {
            let len = xc.len();
            let bytes = &row[c * 256 * dtype.size()..][..len * dtype.size()];
            widen(dtype, bytes, &mut buf[..len]);
            acc += dot(&buf[..len], xc);
        }
        *yr = acc;
    }
}

fn affine_rows(a: &Affine<'_>, xp: &XPrep, y: &mut [f32], rows: Range<usize>) {
    let (g, fs) = (a.group, a.float.size());
    let gb = g * a.bits as usize / 8;
    let (x, sums) = (xp.x(), xp.sums(g));
    let mut s = [0.0f32; SEG_GROUPS];
    let mut b = [0.0f32; SEG_GROUPS];
    let mut q = [0.0f32; 128];
    for (yr, r) in y.iter_mut().zip(rows) {
        let (packed, scales, biases) = a.row(r);
        let mut acc = 0.0;
        for g0 in (0..a.groups()).step_by(SEG_GROUPS) {
            let ng = SEG_GROUPS.min(a.groups() - g0);
            widen(a.float, &scales[g0 * fs..(g0 + ng) * fs], &mut s[..ng]);
            widen(a.float, &biases[g0 * fs..(g0 + ng) * fs], &mut b[..ng]);
            acc += dot(&b[..ng], &sums[g0..g0 + ng]);
            for j in 0..ng {
                let gi = g0 + j;
                unpack_group(a.bits, &packed[gi * gb..(gi + 1) * gb], &mut q[..g]);
                acc += s[j] * dot(&q[..g], &x[gi * g..(gi + 1) * g]);
            }
        }
        *yr = acc;
    }
}

/// Writes row `r` of W, dequantized (s·q + β, as the reference), into `out` \[in\].
///
/// `w` must have passed [`check`]. Used for embedding lookups and by the prefill matmul.
pub fn dequant_row(w: &LinearRef<'_>, r: usize, out: &mut [f32]) {
    let n = w.in_features;
    match w.mat {
        MatRef::Float { dtype, data } => {
            let rb = n * dtype.size();
            widen(dtype, &data[r * rb..(r + 1) * rb], &mut out[..n]);
        }
        MatRef::Affine {
            order: Order::Tiles,
            ..
        } => w.row(r, &mut out[..n]),
        MatRef::Affine { .. } => {
            let Some(a) = Affine::of(w) else {
                unreachable!("an affine matrix")
            };
            let (p, s, b) = a.row(r);
            let (g, fs) = (a.group, a.float.size());
            let gb = g * a.bits as usize / 8;
            let mut sb = [0.0f32; 2];
            for (gi, o) in out[..n].chunks_exact_mut(g).enumerate() {
                widen(a.float, &s[gi * fs..(gi + 1) * fs], &mut sb[..1]);
                widen(a.float, &b[gi * fs..(gi + 1) * fs], &mut sb[1..]);
                unpack_group(a.bits, &p[gi * gb..(gi + 1) * gb], o);
                for v in o.iter_mut() {
                    *v = sb[0] * *v + sb[1];
                }
            }
        }
    }
}
