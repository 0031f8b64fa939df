//! Error bounds of the kernel tests, stated from the arithmetic (see cpu_kernels.rs and
//! cpu_fast.rs for their derivation).

use brook_core::cpu::dequant_row;
use brook_core::dtype;
use brook_core::linear::{Linear, Weights, float_at};
use brook_core::quant;

pub const TOL: f32 = 2e-6;

/// Per-row magnitude of the terms the kernels sum: Σ_i |x_i|·(|s_g q_i| + |β_g|) for affine
/// weights, Σ_i |w_i x_i| for float ones.
pub fn row_scales(w: &Linear, x: &[f32]) -> Vec<f32> {
    let n = w.in_features;
    match &w.weights {
        Weights::Float { .. } => {
            let mut row = vec![0.0; n];
            (0..w.out_features)
                .map(|r| {
                    dequant_row(&w.view(), r, &mut row);
                    row.iter().zip(x).map(|(w, x)| (w * x).abs()).sum()
                })
                .collect()
        }
        Weights::Affine {
            spec,
            float,
            packed,
            scales,
            biases,
            ..
        } => {
            let words = dtype::bytes_to_u32(packed);
            let wpr = quant::words_per_row(n, spec.bits);
            let g = n / spec.group_size;
            (0..w.out_features)
                .map(|r| {
                    let row = &words[r * wpr..(r + 1) * wpr];
                    (0..n)
                        .map(|i| {
                            let gi = r * g + i / spec.group_size;
                            let s = float_at(*float, scales, gi);
                            let b = float_at(*float, biases, gi);
                            let q = quant::unpack(row, spec.bits, i) as f32;
                            x[i].abs() * ((s * q).abs() + b.abs())
                        })
                        .sum()
                })
                .collect()
        }
    }
}

pub fn assert_close(got: &[f32], want: &[f32], scale: &[f32], what: &str) {
    for (r, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= TOL * s + 1e-30,
            "{what}: row {r}: got {g}, reference {w}, error {err:e} > {TOL:e} × {s}"
        );
    }
}

/// Per row: (the int8 rounding bound E, the f32 rounding scale Σ|x|(|sq| + |β|)).
pub fn bounds(w: &Linear, x: &[f32]) -> Vec<(f32, f32)> {
    let Weights::Affine {
        spec,
        float,
        packed,
        scales,
        biases,
        ..
    } = &w.weights
    else {
        panic!("affine weights expected");
    };
    let n = w.in_features;
    let words = dtype::bytes_to_u32(packed);
    let wpr = quant::words_per_row(n, spec.bits);
    let g = n / spec.group_size;
    let d: Vec<f32> = x
        .chunks_exact(32)
        .map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0)
        .collect();
    (0..w.out_features)
        .map(|r| {
            let row = &words[r * wpr..(r + 1) * wpr];
            let (mut e, mut s_all) = (0.0f32, 0.0f32);
            for i in 0..n {
                let gi = r * g + i / spec.group_size;
                let s = float_at(*float, scales, gi);
                let b = float_at(*float, biases, gi);
                let sq = (s * quant::unpack(row, spec.bits, i) as f32).abs();
                e += d[i / 32] / 2.0 * sq;
                s_all += x[i].abs() * (sq + b.abs());
            }
            (e, s_all)
        })
        .collect()
}
