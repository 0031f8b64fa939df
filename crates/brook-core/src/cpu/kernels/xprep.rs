//! Activation preparation for the decode kernels: [`XPrep`] holds x in the order a kernel
//! unpacks weights, its per-group sums (for the folded MLX bias), and the integer digits the
//! integer kernels read (AVX-512 VNNI's tiles, AVX2's rows), for the [`Precision`] chosen.

use crate::cpu::SimdLevel;

/// How the 4-bit products multiply weights with the activations: the decode matvec, and the
/// prefill matmul (which at Split24 and Fast runs an integer tile: `avx512_vnni_mm.rs` with
/// AVX-512 VNNI, `avx2_int_mm.rs` on AVX2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// `--precision exact`, the default: f32 products and sums (FMA), as the reference. Where
    /// an integer kernel exists (AVX-512 VNNI, or AVX2), 4-bit products take Split24's digits
    /// instead (it is exact too): the one-token kernels always, the forward pass's prefill
    /// through `Exec::batch_precision` with AVX-512 VNNI only (on AVX2 the f32 tile is as
    /// fast).
    #[default]
    Exact,
    /// Each activation x is written exactly to 2^-23 of its 32-element block's largest |x|
    /// as a 24-bit integer X = x·2^k (k per block), split into three signed bytes, and Σ q·X
    /// is computed with integer dot products (AVX-512 VNNI `vpdpbusd`, 64 products per
    /// instruction; on AVX2 `vpmaddubsw` + `vpmaddwd`, or AVX-VNNI's 32-product `vpdpbusd`),
    /// then scaled back in f32. The error per product is below half an f32 ulp of the
    /// block's largest activation, so results agree with [`Precision::Exact`] to f32
    /// rounding; the fixture tests hold at the same bounds. Needs AVX2 or AVX-512 VNNI;
    /// elsewhere, and for widths other than 4 bits, it runs as `Exact`.
    Split24,
    /// Lossy (`--precision fast`): each 32-element block of x is rounded to int8 with its
    /// own scale d = max|x|/127 (llama.cpp's Q8 activations), and 4-bit weights multiply it
    /// with integer dot products (one digit row where Split24 takes three). Scales, biases
    /// and the bias term Σβ·Σx stay f32 (exact Σx). Error per product ≤ |q·s|·d/2, so a
    /// row's error is bounded by Σ_blocks d_b/2 · Σ_{i∈b} |s q_i|. Needs AVX2 or AVX-512
    /// VNNI; elsewhere, and for widths other than 4 bits, the products run as `Exact`.
    /// [`crate::cpu::CpuModel`] also keeps the DeltaNet states in bf16 while it decodes at
    /// this precision ([`crate::cpu::state`]).
    Fast,
}

impl Precision {
    /// Whether results equal [`Precision::Exact`]'s up to f32 rounding (the fixture bounds).
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
    pub(crate) level: Option<SimdLevel>,
    pub(crate) x: Vec<f32>, // [n] as given
    lanes: Vec<f32>,        // [n rounded up to a lane block] x in 4-bit lane order (x86 only)
    sums: [Vec<f32>; 3],    // [n/32], [n/64], [n/128]: Σx per group; empty when n % g ≠ 0
    digits: DigitLayout,    // what `tiles` and `tcoef` hold
    tiles: Vec<i8>,         // the digits (see `DigitLayout`)
    tcoef: Vec<f32>,        // the factor of each digit row's sums
    no_avx_vnni: bool,      // the AVX2 kernels never take AVX-VNNI (`set_avx_vnni`)
}

/// Which integer kernels' digits an [`XPrep`] holds, at how many digit rows per element
/// (1 for Fast, 3 for Split24).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum DigitLayout {
    /// None: the f32 kernels run.
    #[default]
    None,
    /// AVX-512 VNNI's 16-row tiles: [n/32, nd, 32] bytes in element order, [n/32, nd] factors.
    Tiles(usize),
    /// AVX2's rows (`avx2_int.rs`): [n/64 rounded up, nd, 2, 32] bytes in the rows' even/odd
    /// nibble order, [chunks, nd, 8] factors.
    Avx2(usize),
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
            digits: DigitLayout::None,
            tiles: Vec::with_capacity(3 * (n + 32)),
            tcoef: Vec::with_capacity(3 * (n + 32) / 8),
            no_avx_vnni: false,
        }
    }

    /// Prepares `x` for the kernels of `level` at [`Precision::Exact`].
    pub fn prepare(&mut self, level: SimdLevel, x: &[f32]) {
        self.prepare_with(level, Precision::Exact, x)
    }

    /// Prepares `x` for the kernels of `level` at `precision`.
    ///
    /// Where AVX-512 VNNI exists and 32 divides the width, this writes the digits the kernels
    /// of 16-row tiles read ([`crate::linear::Order::Tiles`]): int8 at `Fast`, and Split24's
    /// exact digits otherwise (tiled matrices have no f32 kernel there). Every 4-bit matrix
    /// then takes those kernels (groups are 32, 64 or 128, so 32 divides every width), and
    /// the f32 kernels' lane order is left empty, as [`super::qmatmul::XBatch`] does; the
    /// group sums come from the digits' pass. A decode step prepares about 120 inputs on the
    /// calling thread while the others wait, and the lane order and the scalar sums took
    /// most of the ~5 µs each one cost (docs/bench/2026-11-30-to-12-02.md, "session 15").
    pub fn prepare_with(&mut self, level: SimdLevel, precision: Precision, x: &[f32]) {
        self.digits = DigitLayout::None;
        self.level = Some(level);
        self.x.clear();
        self.x.extend_from_slice(x);
        self.lanes.clear();
        let n = x.len();
        let nd = if precision == Precision::Fast { 1 } else { 3 };
        if level == SimdLevel::Avx512 && SimdLevel::has_vnni() && n.is_multiple_of(32) {
            digits_and_sums(nd, x, n, &mut self.tiles, &mut self.tcoef, &mut self.sums);
            self.digits = DigitLayout::Tiles(nd);
        } else if cfg!(target_arch = "x86_64")
            && level == SimdLevel::Avx2
            && level.is_supported()
            && n.is_multiple_of(32)
        {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level (AVX2) is supported, checked above.
            unsafe {
                super::avx2_int::prepare(nd, x, &mut self.tiles, &mut self.tcoef, &mut self.sums[0])
            };
            pair_sums(&mut self.sums, n, 1);
            self.digits = DigitLayout::Avx2(nd);
        } else {
            let s32 = &mut self.sums[0];
            s32.clear();
            if n.is_multiple_of(32) {
                s32.extend(x.chunks_exact(32).map(|c| c.iter().sum::<f32>()));
            }
            pair_sums(&mut self.sums, n, 1);
            self.fill_lanes(level);
        }
    }

    /// x in the 4-bit lane order of the f32 kernels at `level` (none for the portable ones).
    fn fill_lanes(&mut self, level: SimdLevel) {
        let (x, n) = (&self.x, self.x.len());
        let lanes = match level {
            SimdLevel::Portable => return,
            SimdLevel::Avx2 => 8,
            SimdLevel::Avx512 => 16,
        };
        // A block is `lanes` u32 words of 8 nibbles; lane j, shift k holds element 8j + k.
        // The AVX-512 kernel reads nibbles 1-6 as q·16^k (masked in place), so those elements
        // come scaled by 16^-k: exact, powers of two (but for |x| < 2^-102, which lose bits as
        // subnormals).
        let block = lanes * 8;
        let padded = n.div_ceil(block) * block;
        self.lanes.resize(padded, 0.0);
        let scaled = level == SimdLevel::Avx512;
        for (b, out) in self.lanes.chunks_exact_mut(block).enumerate() {
            for k in 0..8 {
                let f = if scaled && (1..=6).contains(&k) {
                    f32::from_bits((127 - 4 * k as u32) << 23)
                } else {
                    1.0
                };
                for j in 0..lanes {
                    let i = b * block + 8 * j + k;
                    out[k * lanes + j] = if i < n { x[i] * f } else { 0.0 };
                }
            }
        }
    }

    /// The digits of the 16-row tile kernels: (digits per element, [n/32, nd, 32] bytes,
    /// [n/32, nd] factors), where [`XPrep::prepare_with`] wrote them.
    pub(crate) fn tiles(&self) -> Option<(usize, &[i8], &[f32])> {
        match self.digits {
            DigitLayout::Tiles(nd) => Some((nd, &self.tiles[..], &self.tcoef[..])),
            _ => None,
        }
    }

    /// The digits of the AVX2 integer kernels (`avx2_int.rs`): (digits per element, whether
    /// to take AVX-VNNI's instruction, [chunks, nd, 2, 32] bytes, [chunks, nd, 8] factors),
    /// where [`XPrep::prepare_with`] wrote them.
    pub(crate) fn avx2_digits(&self) -> Option<(usize, bool, &[i8], &[f32])> {
        match self.digits {
            DigitLayout::Avx2(nd) => {
                let vnni = SimdLevel::has_avx_vnni() && !self.no_avx_vnni;
                Some((nd, vnni, &self.tiles[..], &self.tcoef[..]))
            }
            _ => None,
        }
    }

    /// Whether the AVX2 integer kernels may take AVX-VNNI's instruction where the CPU has it
    /// (the default); off, they run `vpmaddubsw` + `vpmaddwd` as on CPUs without it. For
    /// tests and benchmarks that compare the two.
    pub fn set_avx_vnni(&mut self, on: bool) {
        self.no_avx_vnni = !on;
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

/// The VNNI kernels' digits of x (rows of `n`, a multiple of 32) at `nd` digits per element
/// into `digits` [x.len()/32, nd, 32] and `coef` [x.len()/32, nd], and Σx per 32, 64 and
/// 128 elements into `sums` from the same pass (for [`XPrep`] and the prefill's `XBatch`).
/// Only called with VNNI present.
pub(crate) fn digits_and_sums(
    nd: usize,
    x: &[f32],
    n: usize,
    digits: &mut Vec<i8>,
    coef: &mut Vec<f32>,
    sums: &mut [Vec<f32>; 3],
) {
    let blocks = x.len() / 32;
    digits.clear();
    digits.resize(blocks * nd * 32, 0);
    coef.clear();
    coef.resize(blocks * nd, 0.0);
    let s32 = &mut sums[0];
    s32.clear();
    s32.resize(blocks, 0.0);
    for (((xc, out), cf), sum) in x
        .chunks_exact(32)
        .zip(digits.chunks_exact_mut(nd * 32))
        .zip(coef.chunks_exact_mut(nd))
        .zip(s32.iter_mut())
    {
        *sum = block_digits(nd, xc, out, cf);
    }
    pair_sums(sums, n, 1);
}

/// Σx per 64 and 128 elements from the 32-sums in `sums[0]`, for rows of `n` (a group never
/// straddles two rows when it divides n); empty where it does not. Each sum is `lanes`
/// values side by side (one per token in `avx2_int_mm.rs`'s layout, else 1).
pub(super) fn pair_sums(sums: &mut [Vec<f32>; 3], n: usize, lanes: usize) {
    for k in 1..3 {
        let (lo, hi) = sums.split_at_mut(k);
        let (prev, next) = (&lo[k - 1], &mut hi[0]);
        next.clear();
        if n.is_multiple_of(32 << k) {
            next.extend(
                prev.chunks_exact(2 * lanes)
                    .flat_map(|p| (0..lanes).map(move |l| p[l] + p[lanes + l])),
            );
        }
    }
}

/// The digits of one 32-element block for the VNNI kernels that broadcast activation bytes:
/// `nd` = 3 (Split24: rows d₂, d₁, d₀ of 32 bytes) or 1 (int8), in element order, into `out`
/// (32·nd bytes), and the factor each row's integer sums take into `cf` (nd). Returns Σx
/// (exact f32 sums of the block, for the folded MLX bias). Only called with VNNI present.
pub(crate) fn block_digits(nd: usize, x: &[f32], out: &mut [i8], cf: &mut [f32]) -> f32 {
    assert!(x.len() >= 32 && out.len() >= 32 * nd && cf.len() >= nd && (nd == 1 || nd == 3));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: VNNI (hence AVX-512) is present (callers); lengths asserted above.
    unsafe {
        if nd == 3 {
            let (inv, s) = super::avx512_digits::split_block(x, out);
            cf[..3].copy_from_slice(&[inv * 65536.0, inv * 256.0, inv]);
            s
        } else {
            let (d, s) = super::avx512_digits::q8_block(x, out);
            cf[0] = d;
            s
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (out, cf);
        x[..32].iter().sum()
    }
}
