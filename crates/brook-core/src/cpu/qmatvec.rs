//! y = W x on the checkpoint's own bytes: MLX affine (2–8 bits, groups 32/64/128, BF16/F16/F32
//! scales and biases) and float (F32/BF16/F16) weights, one SIMD level per call.
//!
//! Owns the activation preparation ([`XPrep`]: x in the order a kernel unpacks weights, and
//! per-group sums of x), the shape checks, the row dispatch and the portable kernels; the x86
//! kernels live in `avx2.rs` / `avx512.rs`. It must not dequantize a whole matrix, allocate per
//! row, or know about models. It mirrors [`LinearRef::forward_rows`] for one input vector: the
//! per-group bias is folded into a sum of x, y_r = Σ_g (s_rg·Σ_{i∈g} q_i x_i + β_rg·Σ_{i∈g} x_i),
//! which equals Σ_i (s q_i + β) x_i up to f32 summation order.

use std::ops::Range;

use crate::cpu::SimdLevel;
use crate::cpu::pool::{Chunks, CpuPool, SharedMut};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::linear::{LinearRef, MatRef};
use crate::quant;

/// Groups whose scales are widened to f32 at once; a longer row is done in segments.
pub(crate) const SEG_GROUPS: usize = 512;
/// Padding after the widened scales, so a kernel may load one full vector past the last group.
pub(crate) const SCALE_PAD: usize = 16;

/// How the decode matvec multiplies 4-bit weights with the activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 products and sums (FMA), as the reference.
    #[default]
    F32,
    /// Each activation x is written exactly to 2^-23 of its 32-element block's largest |x|
    /// as a 24-bit integer X = x·2^k (k per block), split into three signed bytes, and Σ q·X
    /// is computed with integer dot products (AVX-512 VNNI `vpdpbusd`, 64 products per
    /// instruction), then scaled back in f32. The error per product is below half an f32 ulp
    /// of the block's largest activation, so results agree with [`Precision::F32`] to f32
    /// rounding; the fixture tests hold at the same bounds. Needs AVX-512 VNNI; elsewhere,
    /// and for widths other than 4 bits, it runs as `F32`.
    Split24,
    /// Lossy (`--precision fast`): each 32-element block of x is rounded to int8 with its
    /// own scale d = max|x|/127 (llama.cpp's Q8 activations), and 4-bit weights multiply it
    /// with `vpdpbusd`, two instructions per 64 weight bytes. Scales, biases and the bias
    /// term Σβ·Σx stay f32 (exact Σx). Error per product ≤ |q·s|·d/2, so a row's error is
    /// bounded by Σ_blocks d_b/2 · Σ_{i∈b} |s q_i|. Needs AVX-512 VNNI; elsewhere, and for
    /// widths other than 4 bits, it runs as `F32`.
    Fast,
}

impl Precision {
    /// Whether results equal [`Precision::F32`]'s up to f32 rounding (the fixture bounds).
    pub fn is_exact(self) -> bool {
        self != Precision::Fast
    }
}

/// One input vector prepared for the kernels of one [`SimdLevel`].
///
/// Preparing costs O(in) and is shared by every matrix that reads the same x. Buffers only
/// grow, so after the first call at a width no call allocates.
#[derive(Debug, Clone, Default)]
pub struct XPrep {
    level: Option<SimdLevel>,
    x: Vec<f32>,         // [n] as given
    lanes: Vec<f32>,     // [n rounded up to a lane block] x in 4-bit lane order (x86 only)
    sums: [Vec<f32>; 3], // [n/32], [n/64], [n/128]: Σx per group; empty when n % g ≠ 0
    ints: Ints,          // what `digits` and `lane_inv` hold
    digits: Vec<i8>,     // Split24: [n/128 blocks, 6, 64]; Fast: [n/128, 2, 64], vpdpbusd order
    lane_inv: Vec<f32>,  // [n/8]: the scale (2^-k, or d) of each 8-element lane's 32-block
}

/// The integer form of x an [`XPrep`] holds beside the floats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Ints {
    #[default]
    None,
    Split24,
    Q8,
}

impl XPrep {
    /// An empty preparation; the first [`XPrep::prepare`] sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// A preparation whose buffers already hold inputs of up to `n` elements.
    pub fn with_capacity(n: usize) -> Self {
        XPrep {
            level: None,
            x: Vec::with_capacity(n),
            lanes: Vec::with_capacity(n + 128),
            sums: [
                Vec::with_capacity(n / 32),
                Vec::with_capacity(n / 64),
                Vec::with_capacity(n / 128),
            ],
            ints: Ints::None,
            digits: Vec::with_capacity(n.div_ceil(128) * 384),
            lane_inv: Vec::with_capacity(n.div_ceil(128) * 16),
        }
    }

    /// Prepares `x` for the kernels of `level` at [`Precision::F32`].
    pub fn prepare(&mut self, level: SimdLevel, x: &[f32]) {
        self.prepare_with(level, Precision::F32, x)
    }

    /// Prepares `x` for the kernels of `level` at `precision`.
    pub fn prepare_with(&mut self, level: SimdLevel, precision: Precision, x: &[f32]) {
        self.ints = Ints::None;
        self.fill(level, x);
        if level == SimdLevel::Avx512 && SimdLevel::has_vnni() && x.len().is_multiple_of(32) {
            match precision {
                Precision::Split24 => self.split_digits(x),
                Precision::Fast => self.q8_digits(x),
                Precision::F32 => {}
            }
        }
    }

    fn fill(&mut self, level: SimdLevel, x: &[f32]) {
        self.level = Some(level);
        self.x.clear();
        self.x.extend_from_slice(x);
        let n = x.len();
        for (k, g) in [32usize, 64, 128].into_iter().enumerate() {
            let sums = &mut self.sums[k];
            sums.clear();
            if n.is_multiple_of(g) {
                sums.extend(x.chunks_exact(g).map(|c| c.iter().sum::<f32>()));
            }
        }
        self.lanes.clear();
        let lanes = match level {
            SimdLevel::Portable => return,
            SimdLevel::Avx2 => 8,
            SimdLevel::Avx512 => 16,
        };
        // A block is `lanes` u32 words of 8 nibbles; lane j, shift k holds element 8j + k.
        let block = lanes * 8;
        let padded = n.div_ceil(block) * block;
        self.lanes.resize(padded, 0.0);
        for (b, out) in self.lanes.chunks_exact_mut(block).enumerate() {
            for j in 0..lanes {
                for k in 0..8 {
                    let i = b * block + 8 * j + k;
                    out[k * lanes + j] = if i < n { x[i] } else { 0.0 };
                }
            }
        }
    }

    /// Writes the Split24 digits: per 32-element block X = round(x·2^k) with |X| ≤ 2^22, then
    /// X = d₂·2^16 + d₁·2^8 + d₀ with balanced digits in [−128, 127]. Block b of 128 elements
    /// holds six 64-byte rows (d₂ even, d₂ odd, d₁ even, d₁ odd, d₀ even, d₀ odd); byte 4j+t of
    /// an even row is element 8j+2t (odd: 8j+2t+1), matching the low and high nibbles of
    /// packed word j.
    fn split_digits(&mut self, x: &[f32]) {
        let n = x.len();
        let blocks = n.div_ceil(128);
        self.digits.clear();
        self.digits.resize(blocks * 384, 0);
        self.lane_inv.clear();
        self.lane_inv.resize(blocks * 16, 0.0);
        for (c, xc) in x.chunks_exact(32).enumerate() {
            let (blk, base) = (c / 4, (c % 4) * 32);
            let at = blk * 384 + base / 2;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: only called when VNNI (hence AVX-512) is present; `xc` holds 32 floats
            // and the digit rows at `at` (+64, +128, ..., +320) hold 16 bytes each.
            let inv =
                unsafe { super::avx512_split::split_chunk(xc, &mut self.digits[at..at + 336]) };
            #[cfg(not(target_arch = "x86_64"))]
            let inv = 0.0;
            for j in 0..4 {
                self.lane_inv[blk * 16 + (c % 4) * 4 + j] = inv;
            }
        }
        self.ints = Ints::Split24;
    }

    /// Writes x as int8 per 32-element block (see [`Precision::Fast`]): block b of 128
    /// elements holds two 64-byte rows (even elements, odd elements) in the order of
    /// [`XPrep::split_digits`]'s d₂ rows; `lane_inv` holds each lane's d.
    fn q8_digits(&mut self, x: &[f32]) {
        let blocks = x.len().div_ceil(128);
        self.digits.clear();
        self.digits.resize(blocks * 128, 0);
        self.lane_inv.clear();
        self.lane_inv.resize(blocks * 16, 0.0);
        for (c, xc) in x.chunks_exact(32).enumerate() {
            let at = (c / 4) * 128 + (c % 4) * 16;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: only called when VNNI (hence AVX-512) is present; `xc` holds 32 floats
            // and the rows at `at` and `at + 64` hold 16 bytes each.
            let d = unsafe { super::avx512_q8::q8_chunk(xc, &mut self.digits[at..at + 80]) };
            #[cfg(not(target_arch = "x86_64"))]
            let d = 0.0;
            self.lane_inv[c * 4..c * 4 + 4].fill(d);
        }
        self.ints = Ints::Q8;
    }

    pub(crate) fn split(&self) -> Option<(&[i8], &[f32])> {
        (self.ints == Ints::Split24).then_some((&self.digits[..], &self.lane_inv[..]))
    }

    pub(crate) fn q8(&self) -> Option<(&[i8], &[f32])> {
        (self.ints == Ints::Q8).then_some((&self.digits[..], &self.lane_inv[..]))
    }

    /// The input vector.
    pub fn x(&self) -> &[f32] {
        &self.x
    }

    pub(crate) fn lanes(&self) -> &[f32] {
        &self.lanes
    }

    /// Σx per group of `g` (32, 64 or 128).
    pub(crate) fn sums(&self, g: usize) -> &[f32] {
        match g {
            32 => &self.sums[0],
            64 => &self.sums[1],
            _ => &self.sums[2],
        }
    }
}

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
}

impl Affine<'_> {
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
    /// (packed bytes, scale bytes, bias bytes) of row `r`.
    #[inline]
    pub fn row(&self, r: usize) -> (&[u8], &[u8], &[u8]) {
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
            if data.len() < out * n * dtype.size() {
                return bad(format!("{} weight bytes, too few", data.len()));
            }
        }
        MatRef::Affine {
            spec,
            float,
            packed,
            scales,
            biases,
        } => {
            if let Some(p) = quant::spec_problem(spec, n) {
                return bad(p);
            }
            if !float.is_float() {
                return bad(format!("scales of dtype {float}"));
            }
            let sb = out * n / spec.group_size * float.size();
            if packed.len() < out * quant::words_per_row(n, spec.bits) * 4
                || scales.len() < sb
                || biases.len() < sb
            {
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
        MatRef::Affine {
            spec,
            float,
            packed,
            scales,
            biases,
        } => {
            let a = Affine {
                bits: spec.bits,
                group: spec.group_size,
                float,
                n: w.in_features,
                packed,
                scales,
                biases,
            };
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: VNNI is present (`split()` is only set when it is) and `check`
                // guaranteed the byte lengths.
                SimdLevel::Avx512 if xp.split().is_some() => unsafe {
                    super::avx512_split::affine_rows_split(&a, xp, y, rows)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: VNNI is present (`q8()` is only set when it is) and `check`
                // guaranteed the byte lengths.
                SimdLevel::Avx512 if xp.q8().is_some() => unsafe {
                    super::avx512_q8::affine_rows_q8(&a, xp, y, rows)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the level is supported and `check` guaranteed the byte lengths.
                SimdLevel::Avx512 => unsafe { super::avx512::affine_rows(&a, xp, y, rows) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                SimdLevel::Avx2 => unsafe { super::avx2::affine_rows(&a, xp, y, rows) },
                _ => affine_rows(&a, xp, y, rows),
            }
        }
    }
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

/// y = W x with the rows split over `pool`'s threads (in blocks of 16 rows).
pub fn qmatvec_pool(
    pool: &CpuPool,
    level: SimdLevel,
    w: &LinearRef<'_>,
    x: &[f32],
    y: &mut [f32],
    xp: &mut XPrep,
) -> Result<()> {
    qmatvec_pool_at(pool, level, Precision::F32, w, x, y, xp)
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
    let chunks = Chunks::new(w.out_features, 64);
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

/// Writes row `r` of W, dequantized (s·q + β, as the reference), into `out` [in].
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
            spec,
            float,
            packed,
            scales,
            biases,
        } => {
            let a = Affine {
                bits: spec.bits,
                group: spec.group_size,
                float,
                n,
                packed,
                scales,
                biases,
            };
            let (p, s, b) = a.row(r);
            let (g, fs) = (a.group, float.size());
            let gb = g * a.bits as usize / 8;
            let mut sb = [0.0f32; 2];
            for (gi, o) in out[..n].chunks_exact_mut(g).enumerate() {
                widen(float, &s[gi * fs..(gi + 1) * fs], &mut sb[..1]);
                widen(float, &b[gi * fs..(gi + 1) * fs], &mut sb[1..]);
                unpack_group(a.bits, &p[gi * gb..(gi + 1) * gb], o);
                for v in o.iter_mut() {
                    *v = sb[0] * *v + sb[1];
                }
            }
        }
    }
}
