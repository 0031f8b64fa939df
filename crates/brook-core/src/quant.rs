//! MLX affine quantization: bit packing, dequantization and quantization.
//!
//! A quantized row of `in` elements is stored as `in·bits/32` little-endian u32 words holding
//! one bit stream, element i in bits [i·bits, (i+1)·bits), lowest bits first (so at 3, 5 and 6
//! bits an element may straddle two words), with one scale s and bias β per group of
//! `group_size` consecutive elements: w_i = s·q_i + β. Mirrors `mlx/backend/cpu/quantized.cpp`
//! (`quantize`, `dequantize`); checked against `mx.quantize` output in the fixtures.

use crate::config::QuantSpec;
use crate::error::{Error, Result};

/// Bit widths MLX writes.
pub const SUPPORTED_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes MLX writes.
pub const SUPPORTED_GROUPS: [usize; 3] = [32, 64, 128];

/// Why a spec cannot describe a row of `in_features` elements, or `None` if it can.
pub fn spec_problem(spec: QuantSpec, in_features: usize) -> Option<String> {
    if !SUPPORTED_BITS.contains(&spec.bits) {
        return Some(format!("{} bits", spec.bits));
    }
    if !SUPPORTED_GROUPS.contains(&spec.group_size) {
        return Some(format!("group size {}", spec.group_size));
    }
    if !in_features.is_multiple_of(spec.group_size) {
        return Some(format!(
            "input width {in_features} is not a multiple of the group size {}",
            spec.group_size
        ));
    }
    if !(in_features * spec.bits as usize).is_multiple_of(32) {
        return Some(format!(
            "input width {in_features} at {} bits does not fill whole u32 words",
            spec.bits
        ));
    }
    None
}

/// u32 words per packed row.
pub fn words_per_row(in_features: usize, bits: u32) -> usize {
    in_features * bits as usize / 32
}

/// Element `i` of a packed row.
#[inline]
pub fn unpack(row: &[u32], bits: u32, i: usize) -> u32 {
    let bit = i * bits as usize;
    let (word, shift) = (bit / 32, (bit % 32) as u32);
    let mask = (1u32 << bits) - 1;
    let mut v = row[word] >> shift;
    if shift + bits > 32 {
        v |= row[word + 1] << (32 - shift);
    }
    v & mask
}

/// Dequantizes one packed row into `out` (length = row's element count).
pub fn dequantize_row(
    row: &[u32],
    scales: &[f32],
    biases: &[f32],
    spec: QuantSpec,
    out: &mut [f32],
) {
    for (i, o) in out.iter_mut().enumerate() {
        let g = i / spec.group_size;
        *o = scales[g] * unpack(row, spec.bits, i) as f32 + biases[g];
    }
}

/// Quantizes one row the way MLX does on the CPU, returning packed words, scales, biases.
///
/// The scale may be negative and the bias is an endpoint of the group, so the group's
/// largest-magnitude element is represented exactly.
pub fn quantize_row(w: &[f32], spec: QuantSpec) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let n = ((1u32 << spec.bits) - 1) as f32;
    let groups = w.len() / spec.group_size;
    let mut packed = vec![0u32; words_per_row(w.len(), spec.bits)];
    let mut scales = Vec::with_capacity(groups);
    let mut biases = Vec::with_capacity(groups);
    for (g, group) in w.chunks_exact(spec.group_size).enumerate() {
        let wmax = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let wmin = group.iter().copied().fold(f32::INFINITY, f32::min);
        let mut s = ((wmax - wmin) / n).max(1e-7);
        let edge = if wmin.abs() > wmax.abs() {
            wmin
        } else {
            s = -s;
            wmax
        };
        let q0 = (edge / s).round();
        let bias = if q0 != 0.0 {
            s = edge / q0;
            edge
        } else {
            0.0
        };
        for (j, &x) in group.iter().enumerate() {
            let q = ((x - bias) / s).round().clamp(0.0, n) as u32;
            let bit = (g * spec.group_size + j) * spec.bits as usize;
            let (word, shift) = (bit / 32, bit % 32);
            packed[word] |= q << shift;
            if shift + spec.bits as usize > 32 {
                packed[word + 1] |= q >> (32 - shift);
            }
        }
        scales.push(s);
        biases.push(bias);
    }
    (packed, scales, biases)
}

/// The (bits, group size) of a quantized weight, from its packed and scales shapes, as mlx-lm
/// does for modules without a `quantization` entry: group = in / scales columns,
/// bits = packed columns · 32 / in.
pub fn spec_from_shapes(
    name: &str,
    packed: &[usize],
    scales: &[usize],
    lead: usize,
    inp: usize,
) -> Result<QuantSpec> {
    let bad = |reason: String| Error::Quantization {
        name: name.to_string(),
        reason,
    };
    let (Some(&wcols), Some(&groups)) = (packed.last(), scales.last()) else {
        return Err(bad("packed weight or scales have no dimensions".into()));
    };
    if packed.len() != lead + 2 || scales.len() != lead + 2 {
        return Err(bad(format!(
            "packed weight {packed:?} and scales {scales:?} should have {} dimensions",
            lead + 2
        )));
    }
    if groups == 0 || !inp.is_multiple_of(groups) || (wcols * 32) % inp != 0 {
        return Err(bad(format!(
            "packed weight {packed:?} with scales {scales:?} cannot hold rows of {inp} elements"
        )));
    }
    let spec = QuantSpec {
        bits: (wcols * 32 / inp) as u32,
        group_size: inp / groups,
    };
    match spec_problem(spec, inp) {
        Some(reason) => Err(bad(reason)),
        None => Ok(spec),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_then_dequantize_is_close_at_every_width() {
        let w: Vec<f32> = (0..384)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        for bits in SUPPORTED_BITS {
            for group_size in SUPPORTED_GROUPS {
                let spec = QuantSpec { bits, group_size };
                let (p, s, b) = quantize_row(&w, spec);
                let mut out = vec![0.0; w.len()];
                dequantize_row(&p, &s, &b, spec, &mut out);
                // MLX snaps the scale so the group's largest-magnitude element is exact, which
                // can stretch the step; every element stays within one step of its value.
                for (g, (xs, ys)) in w.chunks(group_size).zip(out.chunks(group_size)).enumerate() {
                    for (x, y) in xs.iter().zip(ys) {
                        let tol = s[g].abs() + 1e-5;
                        assert!(
                            (x - y).abs() <= tol,
                            "bits {bits} g {group_size}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}
