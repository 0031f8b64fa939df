//! MLX affine dequantization and products at every bit width and group size, against
//! `mx.dequantize` and `mx.quantized_matmul` outputs recorded in tests/fixtures/quant.

mod common;

use brook_core::config::QuantSpec;
use brook_core::dtype::DType;
use brook_core::linear::{LinearRef, MatRef};
use brook_core::safetensors::SafeFile;

fn load(f: &SafeFile, name: &str) -> (DType, Vec<usize>, Vec<u8>) {
    let info = f.tensors.get(name).unwrap_or_else(|| panic!("no {name}"));
    (info.dtype, info.shape.clone(), f.read(info).expect("read"))
}

fn floats(f: &SafeFile, name: &str) -> Vec<f32> {
    let (dt, _, b) = load(f, name);
    let mut out = Vec::new();
    brook_core::dtype::floats_to_f32(dt, &b, &mut out);
    out
}

#[test]
fn dequantize_and_matmul_match_mlx_at_every_width() {
    let f = SafeFile::open(&common::fixture("quant/quant.safetensors")).expect("open");
    let x = floats(&f, "x"); // [3, 384]
    let mut checked = 0;
    for bits in [2u32, 3, 4, 5, 6, 8] {
        for group_size in [32usize, 64, 128] {
            for suffix in ["", "bf16"] {
                let p = format!("q{bits}g{group_size}{suffix}");
                if !f.tensors.contains_key(&format!("{p}.weight")) {
                    continue;
                }
                let (_, wshape, packed) = load(&f, &format!("{p}.weight"));
                let (float, _, scales) = load(&f, &format!("{p}.scales"));
                let (_, _, biases) = load(&f, &format!("{p}.biases"));
                let lin = LinearRef {
                    out_features: wshape[0],
                    in_features: 384,
                    mat: MatRef::Affine {
                        spec: QuantSpec { bits, group_size },
                        float,
                        packed: &packed,
                        scales: &scales,
                        biases: &biases,
                        order: brook_core::linear::Order::Rows,
                    },
                };
                let deq = floats(&f, &format!("{p}.deq"));
                let mut row = vec![0.0; 384];
                for r in 0..wshape[0] {
                    lin.row(r, &mut row);
                    for (a, b) in row.iter().zip(&deq[r * 384..(r + 1) * 384]) {
                        // MLX fuses the multiply-add: 1 ulp apart at most.
                        assert!(
                            (a - b).abs() <= 4e-7 * b.abs().max(1.0),
                            "{p} row {r}: {a} vs {b}"
                        );
                    }
                }
                if let Some(y) = f
                    .tensors
                    .get(&format!("{p}.y"))
                    .map(|_| floats(&f, &format!("{p}.y")))
                {
                    let mut got = vec![0.0; 3 * wshape[0]];
                    lin.forward_rows(&x, &mut got);
                    let err = common::rel_l2(&got, &y);
                    assert!(err < 1e-5, "{p}: rel L2 {err:e}");
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 19, "every width × group plus the bf16 variant");
}

#[test]
fn quantize_row_reproduces_mlx_bits() {
    // brook's quantizer (used by `synth`) follows MLX's CPU algorithm exactly.
    let f = SafeFile::open(&common::fixture("quant/quant.safetensors")).expect("open");
    let w = floats(&f, "w");
    for bits in [2u32, 3, 4, 5, 6, 8] {
        for group_size in [32usize, 64, 128] {
            let p = format!("q{bits}g{group_size}");
            let (_, _, packed) = load(&f, &format!("{p}.weight"));
            let scales = floats(&f, &format!("{p}.scales"));
            let spec = QuantSpec { bits, group_size };
            let words = 384 * bits as usize / 32;
            for r in 0..5 {
                let (q, s, _) = brook_core::quant::quantize_row(&w[r * 384..(r + 1) * 384], spec);
                let want: Vec<u32> = packed[r * words * 4..(r + 1) * words * 4]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                assert_eq!(q, want, "{p} row {r}");
                let gs = 384 / group_size;
                assert_eq!(
                    s,
                    scales[r * gs..(r + 1) * gs].to_vec(),
                    "{p} row {r} scales"
                );
            }
        }
    }
}
