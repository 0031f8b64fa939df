//! Random weights and inputs for the CPU kernels' tests and benchmarks.
//!
//! Owns a small deterministic generator and builders of [`Linear`] layers in every storage
//! format (any packed bits are a valid quantized matrix, so weights are random bytes with
//! random scales and biases). It must not be used by the forward pass. No reference: it only
//! feeds the comparisons against [`crate::linear::LinearRef::forward_rows`].

use crate::config::QuantSpec;
use crate::dtype::DType;
use crate::linear::{Linear, Weights};
use crate::quant;

/// xorshift64*: deterministic, dependency-free.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// `n` values uniform in [-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * scale).collect()
    }
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        for c in out.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// How a test matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Float(DType),
    Affine {
        bits: u32,
        group: usize,
        float: DType,
    },
}

/// Encodes f32 values as little-endian `dtype` bytes (rounding to nearest).
pub fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::BF16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// A random [out, inp] linear layer in `fmt`: weights of magnitude ~0.1.
pub fn random_linear(rng: &mut Rng, out: usize, inp: usize, fmt: Format) -> Linear {
    let weights = match fmt {
        Format::Float(dtype) => Weights::Float {
            dtype,
            data: encode(dtype, &rng.vec(out * inp, 0.1)),
        },
        Format::Affine { bits, group, float } => {
            let spec = QuantSpec {
                bits,
                group_size: group,
            };
            let mut packed = vec![0u8; out * quant::words_per_row(inp, bits) * 4];
            rng.fill_bytes(&mut packed);
            let groups = out * inp / group;
            let step = 0.2 / ((1u32 << bits) - 1) as f32;
            let scales: Vec<f32> = (0..groups).map(|_| step * (0.5 + rng.f32())).collect();
            Weights::Affine {
                spec,
                float,
                packed,
                scales: encode(float, &scales),
                biases: encode(float, &rng.vec(groups, 0.1)),
                order: crate::linear::Order::Rows,
            }
        }
    };
    Linear {
        out_features: out,
        in_features: inp,
        weights,
    }
}
