//! The CUDA backend against the CPU reference. Every test that needs a GPU prints why it
//! skips and passes where none is found (CI); `scripts/gpu-check.sh` runs them on a GPU.
//!
//! Tolerances: matrix kernels within 1e-6 of `LinearRef::forward_rows` relative to the size
//! of the terms summed (Σ|w·x| per output: f32 sums in another order can differ by 1e-3 of
//! an output that cancels to near zero, and did on random rows; 1e-7 measured on the CPU
//! for another order) or 1e-5 relative L2 where outputs are not that small (the delta rule's
//! outputs and state against the reference recurrence too); whole-model logits within 1e-4
//! of mlx-lm's fixtures (the Foundation bound) and 2e-5 of the reference pass, greedy tokens
//! equal.
//!
//! One test target in several files (`gpu/`): `scripts/gpu-check.sh build` ships it as one
//! prebuilt executable to GPU machines that have no Rust toolchain.

#[path = "../../brook-core/tests/common/mod.rs"]
mod common;

#[path = "gpu/batch.rs"]
mod batch;
#[path = "gpu/layers.rs"]
mod layers;
#[path = "gpu/model.rs"]
mod model;
#[path = "gpu/picks.rs"]
mod picks;

use std::sync::Arc;

use brook_core::cpu::testutil::{Format, Rng, random_linear};
use brook_core::dtype::DType;
use brook_core::model::delta_net::{DeltaInputs, DeltaMode, delta_rule_recurrent};
use brook_core::{Logits, Model};
use brook_cuda::delta::{DeltaRule, delta_rule};
use brook_cuda::gpu::{Gpu, Pinned};
use brook_cuda::weights::{Mat, copy_into, place, upload_linear};
use brook_cuda::{CudaModel, CudaOptions, ops};
use common::{MODELS, Reference, argmax, fixture, rel_l2};
use layers::{MoeCase, MoeIn};

/// The GPU, or `None` (with the reason printed) where there is none.
fn gpu() -> Option<Arc<Gpu>> {
    match Gpu::open(0, None) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipping: {e}");
            None
        }
    }
}

/// Σ_c |w[r, c]·x[i, c]| for every output (i, r): the scale of an f32 sum's rounding.
fn term_sizes(l: &brook_core::linear::LinearRef<'_>, x: &[f32]) -> Vec<f32> {
    let (n, m) = (l.in_features, l.out_features);
    let t = x.len() / n;
    let mut out = vec![0.0f32; t * m];
    let mut row = vec![0.0f32; n];
    for r in 0..m {
        l.row(r, &mut row);
        for i in 0..t {
            let xs = &x[i * n..(i + 1) * n];
            out[i * m + r] = row.iter().zip(xs).map(|(a, b)| (a * b).abs()).sum();
        }
    }
    out
}

/// ‖got − want‖ / ‖size‖.
fn err_vs_size(got: &[f32], want: &[f32], size: &[f32]) -> f64 {
    let d: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let s: f64 = size.iter().map(|v| (*v as f64).powi(2)).sum();
    (d / s.max(1e-30)).sqrt()
}

fn formats() -> Vec<Format> {
    let mut v = vec![
        Format::Float(DType::F32),
        Format::Float(DType::BF16),
        Format::Float(DType::F16),
    ];
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128] {
            v.push(Format::Affine {
                bits,
                group,
                float: DType::BF16,
            });
        }
    }
    v.push(Format::Affine {
        bits: 4,
        group: 64,
        float: DType::F16,
    });
    v.push(Format::Affine {
        bits: 8,
        group: 64,
        float: DType::F32,
    });
    v
}

#[test]
fn without_a_gpu_cuda_is_a_clear_error() {
    if brook_cuda::probe().is_ok() {
        eprintln!("skipping: this machine has a GPU");
        return;
    }
    let model = Arc::new(Model::open(&fixture("next-q4")).expect("open"));
    let e = CudaModel::new(model, CudaOptions::default()).expect_err("no GPU here");
    let msg = e.to_string();
    assert!(msg.starts_with("GPU: "), "{msg}");
    assert!(msg.contains("--backend cpu"), "{msg}");
}

/// Page-locked host memory both ways the mapped tier takes it (the driver's allocation, and
/// huge pages registered with it: `BROOK_CUDA_HOST_HUGE=1`): the GPU reads what the host
/// wrote through the copy engine and through the mapped address.
#[test]
fn mapped_host_memory_reads_back_both_ways() {
    let Some(g) = gpu() else { return };
    // Not a whole number of huge pages.
    let bytes = (3 << 20) + 4096;
    for huge in [false, true] {
        let mut p = if huge {
            Pinned::new_mapped_huge(&g, bytes)
        } else {
            Pinned::new_mapped(&g, bytes)
        }
        .expect("page-locked memory");
        for (i, b) in p.as_mut_slice().iter_mut().enumerate() {
            *b = (i * 7 + (i >> 10)) as u8;
        }
        let d = g.zeros(bytes, "copy").expect("device memory");
        // SAFETY: p holds `bytes` page-locked bytes, d as many; copy_out waits for the stream.
        unsafe { g.copy_in_async(d.ptr, p.ptr(), bytes) }.expect("copy in");
        let mut back = vec![0u8; bytes];
        g.copy_out(d.ptr, &mut back).expect("copy out");
        assert!(
            back == p.as_slice(),
            "huge pages {huge}: the copy engine's bytes differ"
        );
        let d2 = g.zeros(bytes, "copy").expect("device memory");
        g.copy_dd(d2.ptr, p.device_ptr().expect("mapped address"), bytes)
            .expect("copy from the mapped address");
        g.copy_out(d2.ptr, &mut back).expect("copy out");
        assert!(
            back == p.as_slice(),
            "huge pages {huge}: the mapped address's bytes differ"
        );
    }
}

#[test]
fn matrix_kernels_match_the_reference_on_random_inputs() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(7);
    for fmt in formats() {
        // (9, 8448): several rounds of the fast kernel's loads per lane.
        for (rows, cols) in [(67, 384), (1, 128), (130, 768), (9, 8448)] {
            let lin = random_linear(&mut rng, rows, cols, fmt);
            let (m, _buf) = upload_linear(&g, &lin.view(), "test").expect("upload");
            for t in [1usize, 3, 70] {
                let x = rng.vec(t * cols, 1.0);
                let mut want = vec![0.0f32; t * rows];
                lin.view().forward_rows(&x, &mut want);
                let size = term_sizes(&lin.view(), &x);
                let xd = g.upload(&x, "x").expect("x");
                let yd = g.upload(&vec![f32::NAN; t * rows], "y").expect("y");
                // Both kernels at every t: one warp per row per vector, and the tiled one.
                for tiled in [false, true] {
                    if tiled {
                        ops::qmm(&g, m, Mat::NONE, 0, 0, 0, 0, 1, t, xd.ptr, yd.ptr, 1, false)
                    } else {
                        ops::qmv(&g, m, Mat::NONE, 0, 0, 1, t, xd.ptr, yd.ptr)
                    }
                    .expect("launch");
                    let got: Vec<f32> = yd.read().expect("read");
                    let err = err_vs_size(&got, &want, &size);
                    assert!(
                        err < 1e-6,
                        "{fmt:?} {rows}x{cols} t={t} tiled={tiled}: rel err {err}"
                    );
                }
            }
        }
    }
}

/// The tensor-core kernels (4-bit, groups of 64 or 128, bf16 or f16 scales, widths a
/// multiple of 512) against the reference, and the CUDA-core kernels on the same inputs:
/// one matrix for 1 and 3 vectors, and four stacked in one launch.
#[test]
fn tensor_core_kernels_match_the_reference_on_random_inputs() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(17);
    let formats = [
        (64, DType::BF16),
        (128, DType::BF16),
        (64, DType::F16),
        (128, DType::F16),
    ];
    for (group, float) in formats {
        let fmt = Format::Affine {
            bits: 4,
            group,
            float,
        };
        // Tiles split over 1, 4, 2 and 8 warps, and (34816 rows) more tiles than warps.
        for (rows, cols) in [
            (16, 512),
            (48, 2048),
            (272, 1024),
            (1024, 4096),
            (34816, 512),
        ] {
            let lin = random_linear(&mut rng, rows, cols, fmt);
            let (m, _buf) = upload_linear(&g, &lin.view(), "test").expect("upload");
            assert!(
                ops::tc_fits(&m, 16),
                "{fmt:?} {rows}x{cols} should take the tensor cores"
            );
            for t in [1usize, 3] {
                let x = rng.vec(t * cols, 1.0);
                let mut want = vec![0.0f32; t * rows];
                lin.view().forward_rows(&x, &mut want);
                let size = term_sizes(&lin.view(), &x);
                let xd = g.upload(&x, "x").expect("x");
                for tc in [true, false] {
                    g.use_tensor_cores(tc);
                    let yd = g.upload(&vec![f32::NAN; t * rows], "y").expect("y");
                    ops::qmv(&g, m, Mat::NONE, 0, 0, 1, t, xd.ptr, yd.ptr).expect("launch");
                    let got: Vec<f32> = yd.read().expect("read");
                    let err = err_vs_size(&got, &want, &size);
                    assert!(
                        err < 1e-6,
                        "{fmt:?} {rows}x{cols} t={t} tc={tc}: rel err {err}"
                    );
                }
            }
        }
        let cols = 1024;
        let lins: Vec<_> = [32, 16, 64, 48]
            .iter()
            .map(|&r| random_linear(&mut rng, r, cols, fmt))
            .collect();
        let up: Vec<_> = lins
            .iter()
            .map(|l| upload_linear(&g, &l.view(), "m").expect("upload"))
            .collect();
        let x = rng.vec(cols, 1.0);
        let (mut want, mut size) = (Vec::new(), Vec::new());
        for l in &lins {
            let mut y = vec![0.0; l.view().out_features];
            l.view().forward_rows(&x, &mut y);
            want.extend(y);
            size.extend(term_sizes(&l.view(), &x));
        }
        let xd = g.upload(&x, "x").expect("x");
        for tc in [true, false] {
            g.use_tensor_cores(tc);
            let yd = g.upload(&vec![f32::NAN; want.len()], "y").expect("y");
            let m = [up[0].0, up[1].0, up[2].0, up[3].0];
            ops::qmv_stacked(&g, m, xd.ptr, yd.ptr).expect("launch");
            let got: Vec<f32> = yd.read().expect("read");
            let err = err_vs_size(&got, &want, &size);
            assert!(err < 1e-6, "{fmt:?} stacked tc={tc}: rel err {err}");
        }
    }
    g.use_tensor_cores(true);
}

#[test]
fn two_matrices_in_one_launch_stack_their_rows() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(9);
    let fmt = Format::Affine {
        bits: 4,
        group: 64,
        float: DType::BF16,
    };
    let (a, b) = (
        random_linear(&mut rng, 96, 256, fmt),
        random_linear(&mut rng, 96, 256, fmt),
    );
    let (ma, _ba) = upload_linear(&g, &a.view(), "a").expect("a");
    let (mb, _bb) = upload_linear(&g, &b.view(), "b").expect("b");
    for t in [1usize, 5] {
        let x = rng.vec(t * 256, 1.0);
        let (mut ya, mut yb) = (vec![0.0; t * 96], vec![0.0; t * 96]);
        a.view().forward_rows(&x, &mut ya);
        b.view().forward_rows(&x, &mut yb);
        let want: Vec<f32> = (0..t)
            .flat_map(|i| {
                ya[i * 96..(i + 1) * 96]
                    .iter()
                    .chain(&yb[i * 96..(i + 1) * 96])
                    .copied()
                    .collect::<Vec<_>>()
            })
            .collect();
        let xd = g.upload(&x, "x").expect("x");
        let yd = g.upload(&vec![f32::NAN; t * 192], "y").expect("y");
        ops::linear(&g, ma, mb, t, xd.ptr, yd.ptr).expect("launch");
        let got: Vec<f32> = yd.read().expect("read");
        assert!(rel_l2(&got, &want) < 1e-5);
    }
}

#[test]
fn four_matrices_of_mixed_formats_in_one_launch_stack_their_rows() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(11);
    let cols = 2048;
    let fmts = [
        Format::Affine {
            bits: 4,
            group: 64,
            float: DType::BF16,
        },
        Format::Affine {
            bits: 8,
            group: 64,
            float: DType::BF16,
        },
        Format::Float(DType::BF16),
        Format::Affine {
            bits: 6,
            group: 64,
            float: DType::BF16,
        },
    ];
    let rows = [33, 16, 7, 5];
    let lins: Vec<_> = fmts
        .iter()
        .zip(rows)
        .map(|(&f, r)| random_linear(&mut rng, r, cols, f))
        .collect();
    let up: Vec<_> = lins
        .iter()
        .map(|l| upload_linear(&g, &l.view(), "m").expect("upload"))
        .collect();
    let x = rng.vec(cols, 1.0);
    let mut want = Vec::new();
    for l in &lins {
        let mut y = vec![0.0; l.view().out_features];
        l.view().forward_rows(&x, &mut y);
        want.extend(y);
    }
    let xd = g.upload(&x, "x").expect("x");
    let yd = g.upload(&vec![f32::NAN; want.len()], "y").expect("y");
    ops::qmv_stacked(&g, [up[0].0, up[1].0, up[2].0, up[3].0], xd.ptr, yd.ptr).expect("launch");
    let got: Vec<f32> = yd.read().expect("read");
    let err = rel_l2(&got, &want);
    assert!(err < 1e-5, "rel err {err}");
}
