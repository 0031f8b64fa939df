//! A linear layer that carries its own storage format: float (F32/BF16/F16) or MLX affine
//! quantized, kept as the checkpoint's own bytes.
//!
//! Model code calls [`Linear::forward`] and never looks at the format. The bytes stay exactly
//! as stored (packed words, bf16 scales), so fast kernels read the same memory the checkpoint
//! holds and an expert read from disk into a slot is used in place through a [`LinearRef`].
//! The methods here are the plain reference path: dequantize one row at a time, dot in f32.

use crate::config::QuantSpec;
use crate::dtype::DType;
use crate::quant;

/// How an affine matrix's packed words, scales and biases are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Order {
    /// As the checkpoint stores them: row after row (MLX's own order).
    #[default]
    Rows,
    /// 4-bit only, out a multiple of 16, in a multiple of 32: blocks of 16 rows, so that one
    /// 64-byte vector holds 8 elements of each of the 16 rows (for integer dot products that
    /// leave each row's sum in its own lane). Within a 16-row block the bytes of 32-element
    /// column block c come at 256·c; in them, dword 16·j + lane holds row `lane`'s elements
    /// 8j..8j+8, byte k the element 8j+k in its low nibble and 8j+4+k in its high one. Scales
    /// and biases of a 16-row block come group after group, 16 rows each. The same bytes as
    /// [`Order::Rows`], moved: [`Linear::tile`] converts in place. See [`tiled_nibble`].
    Tiles,
}

/// Where element `i` of row `r` of a [`Order::Tiles`] matrix with `n` columns lies: (byte
/// index into the packed bytes, bit shift of its nibble).
#[inline]
pub fn tiled_nibble(n: usize, r: usize, i: usize) -> (usize, u32) {
    let (tb, lane, cb, j, w) = (r / 16, r % 16, i / 32, (i % 32) / 8, i % 8);
    (
        (tb * (n / 32) + cb) * 256 + j * 64 + lane * 4 + w % 4,
        if w < 4 { 0 } else { 4 },
    )
}

/// Where the scale (and bias) of group `g` of row `r` lies among a [`Order::Tiles`]
/// matrix's `groups` per row: an element index.
#[inline]
pub fn tiled_group(groups: usize, r: usize, g: usize) -> usize {
    (r / 16) * groups * 16 + g * 16 + r % 16
}

/// Whether a matrix of this spec and shape can take [`Order::Tiles`].
pub fn tiles_fit(spec: QuantSpec, out: usize, n: usize) -> bool {
    spec.bits == 4
        && matches!(spec.group_size, 32 | 64 | 128)
        && out.is_multiple_of(16)
        && n.is_multiple_of(32)
        && n.is_multiple_of(spec.group_size)
}

/// Reorders the bytes of a 4-bit [out, n] matrix in [`Order::Rows`] that [`tiles_fit`] into
/// [`Order::Tiles`] in place, one 16-row block at a time; returns false (touching nothing)
/// for a spec or shape that does not fit or bytes too short for it (which `check` reports).
pub fn tile_bytes(
    spec: QuantSpec,
    float: DType,
    out: usize,
    n: usize,
    packed: &mut [u8],
    scales: &mut [u8],
    biases: &mut [u8],
) -> bool {
    let (groups, fs, rb) = (n / spec.group_size.max(1), float.size(), n / 2);
    if !tiles_fit(spec, out, n)
        || packed.len() < out * rb
        || scales.len() < out * groups * fs
        || biases.len() < out * groups * fs
    {
        return false;
    }
    let mut tmp = vec![0u8; 16 * rb.max(groups * fs)];
    for tb in 0..out / 16 {
        let blk = &mut packed[tb * 16 * rb..(tb + 1) * 16 * rb];
        tmp[..blk.len()].copy_from_slice(blk);
        if crate::cpu::tile_block16(&tmp[..16 * rb], rb, blk) {
            tile_scales(tb, groups, fs, scales, biases, &mut tmp);
            continue;
        }
        for lane in 0..16 {
            for (w8, src) in tmp[lane * rb..(lane + 1) * rb].chunks_exact(4).enumerate() {
                // Word w8 holds elements 8·w8..8·w8+8 of the row, element e at bits 4e.
                let w = u32::from_le_bytes([src[0], src[1], src[2], src[3]]);
                let d = (0..4).fold(0u32, |d, k| {
                    let (lo, hi) = ((w >> (4 * k)) & 15, (w >> (4 * k + 16)) & 15);
                    d | ((lo | hi << 4) << (8 * k))
                });
                let at = (w8 / 4) * 256 + (w8 % 4) * 64 + lane * 4;
                blk[at..at + 4].copy_from_slice(&d.to_le_bytes());
            }
        }
        tile_scales(tb, groups, fs, scales, biases, &mut tmp);
    }
    true
}

/// The inverse of [`tile_bytes`]: the bytes of a tiled 4-bit [out, n] matrix written in
/// [`Order::Rows`] into `dst` (packed, scales, biases; each as long as its source), for a
/// consumer that reads the checkpoint's order (the CUDA backend's upload).
#[allow(clippy::too_many_arguments)]
pub fn untile_bytes(
    spec: QuantSpec,
    float: DType,
    out: usize,
    n: usize,
    src: [&[u8]; 3],
    dst: [&mut [u8]; 3],
) {
    let (groups, fs, rb) = (n / spec.group_size.max(1), float.size(), n / 2);
    let [packed, scales, biases] = src;
    let [dp, ds, db] = dst;
    for r in 0..out {
        let (tb, lane) = (r / 16, r % 16);
        for w8 in 0..rb / 4 {
            let at = tb * 16 * rb + (w8 / 4) * 256 + (w8 % 4) * 64 + lane * 4;
            let d =
                u32::from_le_bytes([packed[at], packed[at + 1], packed[at + 2], packed[at + 3]]);
            // Byte k of d: element k low, k+4 high; the word: element e at bits 4e.
            let w = (0..4).fold(0u32, |w, k| {
                let (lo, hi) = ((d >> (8 * k)) & 15, (d >> (8 * k + 4)) & 15);
                w | lo << (4 * k) | hi << (4 * k + 16)
            });
            dp[r * rb + 4 * w8..r * rb + 4 * w8 + 4].copy_from_slice(&w.to_le_bytes());
        }
        for g in 0..groups {
            let (src, dst) = (tiled_group(groups, r, g) * fs, (r * groups + g) * fs);
            ds[dst..dst + fs].copy_from_slice(&scales[src..src + fs]);
            db[dst..dst + fs].copy_from_slice(&biases[src..src + fs]);
        }
    }
}

/// The scales and biases of 16-row block `tb` moved to group after group (see
/// [`tile_bytes`]); `tmp` holds at least 16·groups·fs bytes.
fn tile_scales(
    tb: usize,
    groups: usize,
    fs: usize,
    scales: &mut [u8],
    biases: &mut [u8],
    tmp: &mut [u8],
) {
    for v in [scales, biases] {
        let blk = &mut v[tb * 16 * groups * fs..(tb + 1) * 16 * groups * fs];
        tmp[..blk.len()].copy_from_slice(blk);
        for lane in 0..16 {
            for g in 0..groups {
                let (src, dst) = ((lane * groups + g) * fs, (g * 16 + lane) * fs);
                blk[dst..dst + fs].copy_from_slice(&tmp[src..src + fs]);
            }
        }
    }
}

/// Owned storage of a weight matrix of logical shape [out, in].
#[derive(Debug, Clone)]
pub enum Weights {
    /// `[out, in]` floats of `dtype`, little-endian, row-major.
    Float { dtype: DType, data: Vec<u8> },
    /// MLX affine quantization.
    Affine {
        spec: QuantSpec,
        /// Float type of scales and biases.
        float: DType,
        /// `[out, in·bits/32]` little-endian u32 words.
        packed: Vec<u8>,
        /// `[out, in/group]` of `float`.
        scales: Vec<u8>,
        /// `[out, in/group]` of `float`.
        biases: Vec<u8>,
        /// The order of `packed`, `scales` and `biases`.
        order: Order,
    },
}

/// Borrowed view of a weight matrix's bytes, owned by a [`Linear`] or by an expert slot.
#[derive(Debug, Clone, Copy)]
pub enum MatRef<'a> {
    Float {
        dtype: DType,
        data: &'a [u8],
    },
    Affine {
        spec: QuantSpec,
        float: DType,
        packed: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
        order: Order,
    },
}

/// y = x · Wᵀ with W of shape [out, in]; no bias (no Qwen3-Next/3.5 projection has one).
#[derive(Debug, Clone)]
pub struct Linear {
    pub out_features: usize,
    pub in_features: usize,
    pub weights: Weights,
}

/// A borrowed linear layer: shape plus a [`MatRef`].
#[derive(Debug, Clone, Copy)]
pub struct LinearRef<'a> {
    pub out_features: usize,
    pub in_features: usize,
    pub mat: MatRef<'a>,
}

/// Element `i` of little-endian floats of `dtype`, widened exactly to f32.
#[inline]
pub fn float_at(dtype: DType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        DType::BF16 => {
            half::bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
        }
        DType::F16 => {
            half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
        }
        _ => f32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ]),
    }
}

impl Linear {
    /// The borrowed view of this layer.
    pub fn view(&self) -> LinearRef<'_> {
        let mat = match &self.weights {
            Weights::Float { dtype, data } => MatRef::Float {
                dtype: *dtype,
                data,
            },
            Weights::Affine {
                spec,
                float,
                packed,
                scales,
                biases,
                order,
            } => MatRef::Affine {
                spec: *spec,
                float: *float,
                packed,
                scales,
                biases,
                order: *order,
            },
        };
        LinearRef {
            out_features: self.out_features,
            in_features: self.in_features,
            mat,
        }
    }

    /// See [`LinearRef::row`].
    pub fn row(&self, r: usize, out: &mut [f32]) {
        self.view().row(r, out)
    }

    /// See [`LinearRef::forward`].
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        self.view().forward(x, y)
    }

    /// See [`LinearRef::forward_rows`].
    pub fn forward_rows(&self, x: &[f32], y: &mut [f32]) {
        self.view().forward_rows(x, y)
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        match &self.weights {
            Weights::Float { data, .. } => data.len(),
            Weights::Affine {
                packed,
                scales,
                biases,
                ..
            } => packed.len() + scales.len() + biases.len(),
        }
    }

    /// Moves a 4-bit matrix that [`tiles_fit`] into [`Order::Tiles`] in place (see
    /// [`tile_bytes`]); returns whether it did. Other matrices stay as they are.
    pub fn tile(&mut self) -> bool {
        let (out, n) = (self.out_features, self.in_features);
        let Weights::Affine {
            spec,
            float,
            packed,
            scales,
            biases,
            order,
        } = &mut self.weights
        else {
            return false;
        };
        if *order != Order::Rows || !tile_bytes(*spec, *float, out, n, packed, scales, biases) {
            return false;
        }
        *order = Order::Tiles;
        true
    }

    /// A linear made of the given rows of this one, in that order (a row permutation or
    /// selection; quantized rows move with their scales and biases).
    pub fn select_rows(&self, rows: &[usize]) -> Linear {
        let n = self.in_features;
        let take = |v: &[u8], per_row: usize| -> Vec<u8> {
            rows.iter()
                .flat_map(|&r| &v[r * per_row..(r + 1) * per_row])
                .copied()
                .collect()
        };
        let weights = match &self.weights {
            Weights::Float { dtype, data } => Weights::Float {
                dtype: *dtype,
                data: take(data, n * dtype.size()),
            },
            Weights::Affine {
                spec,
                float,
                packed,
                scales,
                biases,
                order,
            } => {
                assert_eq!(*order, Order::Rows, "select_rows of a tiled matrix");
                let groups = n / spec.group_size;
                Weights::Affine {
                    spec: *spec,
                    float: *float,
                    packed: take(packed, quant::words_per_row(n, spec.bits) * 4),
                    scales: take(scales, groups * float.size()),
                    biases: take(biases, groups * float.size()),
                    order: Order::Rows,
                }
            }
        };
        Linear {
            out_features: rows.len(),
            in_features: n,
            weights,
        }
    }
}

impl LinearRef<'_> {
    /// Writes row `r` of W, dequantized, into `out` (length `in_features`).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let n = self.in_features;
        match self.mat {
            MatRef::Float { dtype, data } => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = float_at(dtype, data, r * n + i);
                }
            }
            MatRef::Affine {
                spec,
                float,
                packed,
                scales,
                biases,
                order: Order::Tiles,
            } => {
                let groups = n / spec.group_size;
                for (i, o) in out.iter_mut().enumerate() {
                    let (byte, shift) = tiled_nibble(n, r, i);
                    let g = tiled_group(groups, r, i / spec.group_size);
                    let q = ((packed[byte] >> shift) & 15) as f32;
                    *o = float_at(float, scales, g) * q + float_at(float, biases, g);
                }
            }
            MatRef::Affine {
                spec,
                float,
                packed,
                scales,
                biases,
                order: Order::Rows,
            } => {
                let words = quant::words_per_row(n, spec.bits);
                let row: Vec<u32> = packed[r * words * 4..(r + 1) * words * 4]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let groups = n / spec.group_size;
                for (i, o) in out.iter_mut().enumerate() {
                    let g = r * groups + i / spec.group_size;
                    let q = quant::unpack(&row, spec.bits, i) as f32;
                    *o = float_at(float, scales, g) * q + float_at(float, biases, g);
                }
            }
        }
    }

    /// y\[out\] = W x for one input vector x\[in\].
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        self.forward_rows(x, y)
    }

    /// y[T, out] = x[T, in] Wᵀ, dequantizing each weight row once for all T inputs.
    pub fn forward_rows(&self, x: &[f32], y: &mut [f32]) {
        let (n, m) = (self.in_features, self.out_features);
        let t = x.len() / n;
        debug_assert_eq!(x.len(), t * n);
        debug_assert_eq!(y.len(), t * m);
        let mut row = vec![0.0f32; n];
        for r in 0..m {
            self.row(r, &mut row);
            for i in 0..t {
                y[i * m + r] = dot(&row, &x[i * n..(i + 1) * n]);
            }
        }
    }
}

/// Plain f32 dot product.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
