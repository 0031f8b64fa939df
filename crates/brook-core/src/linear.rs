//! A linear layer that carries its own storage format: float (f32) or MLX affine quantized.
//!
//! The model code calls [`Linear::forward`] and never looks at the format. This is the plain
//! reference path: it dequantizes one row at a time and takes a dot product in f32, in the
//! order a reader would write it. Fast kernels are tested against it.

use crate::config::QuantSpec;
use crate::quant;

/// Storage of a weight matrix of logical shape [out, in].
#[derive(Debug, Clone)]
pub enum Weights {
    /// `[out, in]` f32, row-major.
    Float(Vec<f32>),
    /// MLX affine quantization.
    Affine {
        spec: QuantSpec,
        /// `[out, in·bits/32]` packed words.
        packed: Vec<u32>,
        /// `[out, in/group]` f32 (widened exactly from the stored bf16/f16/f32).
        scales: Vec<f32>,
        /// `[out, in/group]` f32.
        biases: Vec<f32>,
    },
}

/// y = x · Wᵀ with W of shape [out, in]; no bias (no Qwen3-Next/3.5 projection has one).
#[derive(Debug, Clone)]
pub struct Linear {
    pub out_features: usize,
    pub in_features: usize,
    pub weights: Weights,
}

impl Linear {
    /// Writes row `r` of W, dequantized, into `out` (length `in_features`).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let n = self.in_features;
        match &self.weights {
            Weights::Float(w) => out.copy_from_slice(&w[r * n..(r + 1) * n]),
            Weights::Affine {
                spec,
                packed,
                scales,
                biases,
            } => {
                let words = quant::words_per_row(n, spec.bits);
                let groups = n / spec.group_size;
                quant::dequantize_row(
                    &packed[r * words..(r + 1) * words],
                    &scales[r * groups..(r + 1) * groups],
                    &biases[r * groups..(r + 1) * groups],
                    *spec,
                    out,
                );
            }
        }
    }

    /// y[out] = W x for one input vector x[in].
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        debug_assert_eq!(x.len(), self.in_features);
        debug_assert_eq!(y.len(), self.out_features);
        let mut row = vec![0.0f32; self.in_features];
        for (r, yr) in y.iter_mut().enumerate() {
            self.row(r, &mut row);
            *yr = dot(&row, x);
        }
    }

    /// y[T, out] = x[T, in] Wᵀ, dequantizing each weight row once for all T inputs.
    pub fn forward_rows(&self, x: &[f32], y: &mut [f32]) {
        let (n, m) = (self.in_features, self.out_features);
        let t = x.len() / n;
        debug_assert_eq!(y.len(), t * m);
        let mut row = vec![0.0f32; n];
        for r in 0..m {
            self.row(r, &mut row);
            for i in 0..t {
                y[i * m + r] = dot(&row, &x[i * n..(i + 1) * n]);
            }
        }
    }

    /// Bytes the weights occupy as stored in an MLX checkpoint with `float_bytes`-wide floats.
    pub fn stored_bytes(&self, float_bytes: usize) -> usize {
        match &self.weights {
            Weights::Float(w) => w.len() * float_bytes,
            Weights::Affine { packed, scales, .. } => {
                packed.len() * 4 + 2 * scales.len() * float_bytes
            }
        }
    }
}

/// Plain f32 dot product.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

impl Linear {
    /// A linear made of the given rows of this one, in that order (a row permutation or
    /// selection; quantized rows move with their scales and biases).
    pub fn select_rows(&self, rows: &[usize]) -> Linear {
        let n = self.in_features;
        let weights = match &self.weights {
            Weights::Float(w) => Weights::Float(
                rows.iter()
                    .flat_map(|&r| &w[r * n..(r + 1) * n])
                    .copied()
                    .collect(),
            ),
            Weights::Affine {
                spec,
                packed,
                scales,
                biases,
            } => {
                let words = quant::words_per_row(n, spec.bits);
                let groups = n / spec.group_size;
                let take = |v: &[f32]| -> Vec<f32> {
                    rows.iter()
                        .flat_map(|&r| &v[r * groups..(r + 1) * groups])
                        .copied()
                        .collect()
                };
                Weights::Affine {
                    spec: *spec,
                    packed: rows
                        .iter()
                        .flat_map(|&r| &packed[r * words..(r + 1) * words])
                        .copied()
                        .collect(),
                    scales: take(scales),
                    biases: take(biases),
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
