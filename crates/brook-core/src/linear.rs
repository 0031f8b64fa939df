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
            } => MatRef::Affine {
                spec: *spec,
                float: *float,
                packed,
                scales,
                biases,
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
            } => {
                let groups = n / spec.group_size;
                Weights::Affine {
                    spec: *spec,
                    float: *float,
                    packed: take(packed, quant::words_per_row(n, spec.bits) * 4),
                    scales: take(scales, groups * float.size()),
                    biases: take(biases, groups * float.size()),
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

    /// y[out] = W x for one input vector x[in].
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
