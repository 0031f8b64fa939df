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
#[path = "gpu/model.rs"]
mod model;

use std::sync::Arc;

use brook_core::cpu::testutil::{Format, Rng, random_linear};
use brook_core::dtype::DType;
use brook_core::model::delta_net::{DeltaInputs, DeltaMode, delta_rule_recurrent};
use brook_core::{Logits, Model};
use brook_cuda::delta::{DeltaRule, delta_rule};
use brook_cuda::gpu::Gpu;
use brook_cuda::weights::{Mat, copy_into, place, upload_linear};
use brook_cuda::{CudaModel, CudaOptions, ops};
use common::{MODELS, Reference, argmax, fixture, rel_l2};

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
                        ops::qmm(&g, m, Mat::NONE, 0, 0, 0, 0, 1, t, xd.ptr, yd.ptr, 1)
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

/// One MoE layer's weights for the kernel tests: 16 random experts of `fmt` ([gate, up,
/// down], h → i → h) in GPU slots of one layout behind a table, as GpuExperts makes them,
/// and a random shared expert (h → is → h) uploaded as dense matrices.
struct MoeCase {
    experts: Vec<[brook_core::linear::Linear; 3]>,
    shared: [brook_core::linear::Linear; 3],
    _slots: brook_cuda::gpu::DevBuf,
    /// One device pointer per expert.
    tab: brook_cuda::gpu::DevBuf,
    /// Where gate, up and down sit in a slot.
    placed: [brook_cuda::weights::Placement; 3],
    _shared_bufs: Vec<brook_cuda::gpu::DevBuf>,
    /// The shared expert's gate, up and down.
    sm: [Mat; 3],
}

impl MoeCase {
    fn new(g: &Arc<Gpu>, rng: &mut Rng, fmt: Format, h: usize, i: usize, is: usize) -> Self {
        let e = 16;
        let experts: Vec<[_; 3]> = (0..e)
            .map(|_| {
                [
                    random_linear(rng, i, h, fmt),
                    random_linear(rng, i, h, fmt),
                    random_linear(rng, h, i, fmt),
                ]
            })
            .collect();
        let v0 = experts[0].each_ref().map(|l| l.view());
        let pg = place(&v0[0], 0, "gate").expect("place");
        let pu = place(&v0[1], pg.end, "up").expect("place");
        let pd = place(&v0[2], pu.end, "down").expect("place");
        let slot = pd.end.div_ceil(256) * 256;
        let mut img = vec![0u8; slot * e];
        for (n, ex) in experts.iter().enumerate() {
            let dst = &mut img[n * slot..(n + 1) * slot];
            for (l, p) in ex.iter().zip([&pg, &pu, &pd]) {
                copy_into(&l.view(), p, dst);
            }
        }
        let slots = g.upload(&img, "slots").expect("slots");
        let table: Vec<u64> = (0..e).map(|n| slots.ptr + (n * slot) as u64).collect();
        let tab = g.upload(&table, "table").expect("table");
        let shared = [
            random_linear(rng, is, h, fmt),
            random_linear(rng, is, h, fmt),
            random_linear(rng, h, is, fmt),
        ];
        let (sm, bufs): (Vec<Mat>, Vec<_>) = shared
            .iter()
            .map(|l| upload_linear(g, &l.view(), "shared").expect("upload"))
            .unzip();
        MoeCase {
            experts,
            shared,
            _slots: slots,
            tab,
            placed: [pg, pu, pd],
            _shared_bufs: bufs,
            sm: [sm[0], sm[1], sm[2]],
        }
    }

    /// The decode form of the MoE for `tokens` tokens: SwiGLU in the gate/up launch, the
    /// downs and the weighted sum in the second. Device pointers: x [tokens, h], the picks
    /// `sel` and their weights `wts` [tokens, k], the shared experts' gates `sgs` floats
    /// apart. Returns the outputs [tokens, h].
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        g: &Arc<Gpu>,
        k: usize,
        tokens: usize,
        x: u64,
        sel: u64,
        wts: u64,
        sg: u64,
        sgs: usize,
    ) -> Vec<f32> {
        let [pg, pu, pd] = &self.placed;
        let (h, i, is) = (
            pd.mat.rows as usize,
            pg.mat.rows as usize,
            self.sm[0].rows as usize,
        );
        let hd = g.zeros(tokens * k * i * 4, "h").expect("h");
        let hsd = g.zeros(tokens * is * 4, "hs").expect("hs");
        let out = g.upload(&vec![f32::NAN; tokens * h], "out").expect("out");
        let tab = self.tab.ptr;
        let shared = [self.sm[0], self.sm[1]];
        ops::qmv_experts(
            g, pg.mat, pu.mat, tab, sel, k, k as i32, shared, true, tokens, x, hd.ptr, hsd.ptr,
        )
        .expect("gate/up");
        ops::moe_down(
            g, pd.mat, tab, sel, wts, k, self.sm[2], sg, hd.ptr, hsd.ptr, out.ptr, tokens, sgs,
        )
        .expect("down");
        out.read().expect("read")
    }
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// One token through routed experts (laid out in slots behind a table, as the engine does)
/// and a shared expert with the two decode launches, against the reference's products.
#[test]
fn one_token_moe_kernels_match_the_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(13);
    // The last two take the tensor-core kernels (tc_fits asserts it).
    for (bits, group, float, h, i, is, k) in [
        (4, 32, DType::BF16, 256, 512, 512, 8),
        (8, 32, DType::BF16, 128, 96, 64, 10),
        (4, 32, DType::BF16, 64, 32, 48, 3),
        (4, 64, DType::BF16, 512, 512, 512, 8),
        (4, 128, DType::F16, 1024, 512, 1024, 10),
    ] {
        let fmt = Format::Affine { bits, group, float };
        let case = MoeCase::new(&g, &mut rng, fmt, h, i, is);
        let (experts, shared, tab, sm) = (&case.experts, &case.shared, &case.tab, case.sm);
        let [pg, pu, pd] = &case.placed;
        let e = experts.len();
        let sel: Vec<i32> = (0..e as i32).filter(|n| n % 5 != 1).take(k).collect();
        assert_eq!(sel.len(), k);
        let wts = rng.vec(k, 1.0);
        let sg = rng.f32() - 0.5;
        let x = rng.vec(h, 1.0);
        // Reference: Σ w_k · down_k(silu(gate_k x) · up_k x) + sigmoid(sg) · shared.
        let ffn = |ls: [brook_core::linear::LinearRef<'_>; 3]| {
            let (mut gt, mut u) = (vec![0.0; ls[0].out_features], vec![0.0; ls[1].out_features]);
            ls[0].forward_rows(&x, &mut gt);
            ls[1].forward_rows(&x, &mut u);
            let hh: Vec<f32> = gt.iter().zip(&u).map(|(a, b)| silu(*a) * b).collect();
            let mut y = vec![0.0; h];
            ls[2].forward_rows(&hh, &mut y);
            y
        };
        let mut want = vec![0.0f32; h];
        for (n, &id) in sel.iter().enumerate() {
            let y = ffn(experts[id as usize].each_ref().map(|l| l.view()));
            for (o, v) in want.iter_mut().zip(y) {
                *o += wts[n] * v;
            }
        }
        let ys = ffn(shared.each_ref().map(|l| l.view()));
        let gate = 1.0 / (1.0 + (-sg).exp());
        for (o, v) in want.iter_mut().zip(ys) {
            *o += gate * v;
        }
        let xd = g.upload(&x, "x").expect("x");
        let seld = g.upload(&sel, "sel").expect("sel");
        let wd = g.upload(&wts, "wts").expect("wts");
        let sgd = g.upload(&[sg], "sg").expect("sg");
        // The plain form first: every gate and up output.
        let gu = g.zeros(k * 2 * i * 4, "gu").expect("gu");
        let sgu = g.zeros(2 * is * 4, "sgu").expect("sgu");
        ops::qmv_experts(
            &g,
            pg.mat,
            pu.mat,
            tab.ptr,
            seld.ptr,
            k,
            k as i32,
            [sm[0], sm[1]],
            false,
            1,
            xd.ptr,
            gu.ptr,
            sgu.ptr,
        )
        .expect("gate/up");
        let mut want_gu = Vec::new();
        for &id in &sel {
            for l in &experts[id as usize][..2] {
                let mut y = vec![0.0; i];
                l.view().forward_rows(&x, &mut y);
                want_gu.extend(y);
            }
        }
        let got_gu: Vec<f32> = gu.read().expect("read");
        assert!(rel_l2(&got_gu, &want_gu) < 1e-5, "gate/up");
        // The decode form: SwiGLU in the first launch, downs and the sum in the second, on
        // the tensor cores where they fit and on the CUDA cores.
        assert!(ops::moe_down_fits(&pd.mat, &sm[2], k));
        if group >= 64 {
            for m in [pg.mat, pu.mat, sm[0], sm[1]] {
                assert!(ops::tc_fits(&m, 8));
            }
            assert!(ops::tc_fits(&pd.mat, 16) && ops::tc_fits(&sm[2], 16));
        }
        for tc in [true, false] {
            g.use_tensor_cores(tc);
            let got = case.decode(&g, k, 1, xd.ptr, seld.ptr, wd.ptr, sgd.ptr, 0);
            let err = rel_l2(&got, &want);
            assert!(
                err < 1e-5,
                "{bits}-bit g{group} h={h} i={i} k={k} tc={tc}: rel err {err}"
            );
        }
    }
    g.use_tensor_cores(true);
}

/// Random delta-rule inputs in the engine's layout, shaped like the model's: q of norm
/// dk^-1/2 and k of norm 1 (what delta_prep leaves), g = -e^u with u in [-5, 1), β in
/// (0.12, 0.88), a random entering state, nv = 2·nk value heads.
fn delta_case(
    rng: &mut Rng,
    t: usize,
    nk: usize,
    dk: usize,
    dv: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nv, key_dim) = (2 * nk, nk * dk);
    let cd = 2 * key_dim + nv * dv;
    let mut conv = rng.vec(t * cd, 1.0);
    for row in conv.chunks_exact_mut(cd) {
        for (hh, head) in row[..2 * key_dim].chunks_exact_mut(dk).enumerate() {
            let norm = head.iter().map(|x| x * x).sum::<f32>().sqrt();
            let norm = if hh < nk {
                norm * (dk as f32).sqrt()
            } else {
                norm
            };
            head.iter_mut().for_each(|x| *x /= norm);
        }
    }
    let g = (0..t * nv)
        .map(|_| -(3.0 * rng.f32() - 2.0).exp())
        .collect();
    let beta = (0..t * nv)
        .map(|_| 1.0 / (1.0 + (-2.0 * rng.f32()).exp()))
        .collect();
    (conv, g, beta)
}

/// Both delta-rule kernels, the token-by-token one and the chunked one (64 tokens a chunk),
/// against the reference recurrence on random inputs: T within one chunk, on its edge, one
/// past it and several chunks with a ragged last one; the real head size (dk = dv = 128)
/// and smaller ones that take the other kernels (dk 64, 32 and the generic 48, with value
/// widths that leave a partial 32-column tile). Outputs and the final state within 1e-5
/// relative L2: the chunked form's decays e^(γi−γj) from cumulative sums cost up to about
/// 1e-6 (brook_core's chunked form on these inputs: at most 1.3e-6 of the recurrence; a CPU
/// emulation of this kernel: at most 1.7e-6 of an f64 recurrence).
#[test]
fn delta_rule_kernels_match_the_reference_recurrence() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(17);
    for (nk, dk, dv) in [(2, 128, 128), (1, 64, 64), (1, 32, 48), (2, 48, 40)] {
        let (nv, key_dim) = (2 * nk, nk * dk);
        let cd = 2 * key_dim + nv * dv;
        for t in [1usize, 7, 64, 65, 200, 300] {
            let (conv, gl, beta) = delta_case(&mut rng, t, nk, dk, dv);
            let s0 = rng.vec(nv * dk * dv, 0.5);
            // The reference reads q, k [T, nk, dk] and v [T, nv, dv].
            let cols = |lo: usize, n: usize| -> Vec<f32> {
                conv.chunks_exact(cd)
                    .flat_map(|r| r[lo..lo + n].to_vec())
                    .collect()
            };
            let (q, k, v) = (
                cols(0, key_dim),
                cols(key_dim, key_dim),
                cols(2 * key_dim, nv * dv),
            );
            let inputs = DeltaInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &gl,
                beta: &beta,
                nk,
                nv,
                dk,
                dv,
            };
            let (mut s_ref, mut o_ref) = (s0.clone(), vec![0.0; t * nv * dv]);
            delta_rule_recurrent(&inputs, &mut s_ref, &mut o_ref);
            let convd = g.upload(&conv, "conv").expect("conv");
            let gd = g.upload(&gl, "g").expect("g");
            let bd = g.upload(&beta, "beta").expect("beta");
            for mode in [DeltaMode::Recurrent, DeltaMode::Chunked] {
                let sd = g.upload(&s0, "state").expect("state");
                let od = g.upload(&vec![f32::NAN; t * nv * dv], "o").expect("o");
                let rule = DeltaRule {
                    conv: convd.ptr,
                    g: gd.ptr,
                    beta: bd.ptr,
                    state: sd.ptr,
                    o: od.ptr,
                    t,
                    cd,
                    nk,
                    nv,
                    dk,
                    dv,
                    seqs: 0,
                    nseq: 1,
                };
                delta_rule(&g, &rule, mode).expect("launch");
                let (o, s): (Vec<f32>, Vec<f32>) = (od.read().expect("o"), sd.read().expect("s"));
                let (eo, es) = (rel_l2(&o, &o_ref), rel_l2(&s, &s_ref));
                eprintln!("{mode:?} dk={dk} dv={dv} t={t}: output {eo:.2e}, state {es:.2e}");
                assert!(
                    eo < 1e-5 && es < 1e-5,
                    "{mode:?} nk={nk} dk={dk} dv={dv} t={t}: output {eo:.2e}, state {es:.2e}"
                );
            }
        }
    }
}
