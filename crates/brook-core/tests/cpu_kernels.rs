//! The CPU matvec/matmul kernels against the reference `LinearRef::forward_rows`, at every
//! SIMD level this CPU runs, over every storage format and many shapes.
//!
//! Tolerance: the kernels sum in another order than the reference (per-group sums, bias folded
//! into Σx, vector lanes), so each output may differ by f32 rounding of the terms summed. We
//! bound |y − y_ref| ≤ 2e-6 · Σ_i |x_i|·(|s_g q_i| + |β_g|) per row (for float weights
//! Σ|w_i x_i|); the worst measured ratio is 2.2e-7, and a nibble table off by 1e-3 fails.

mod common;

use brook_core::cpu::testutil::{Format, Rng, random_linear};
use brook_core::cpu::{
    CpuPool, Precision, SimdLevel, XBatch, XPrep, dequant_row, matvec_rows, qmatmul, qmatmul_at,
    qmatmul_pool, qmatmul_pool_at, qmatvec, qmatvec_pool,
};
use brook_core::dtype::DType;
use brook_core::linear::Weights;
use common::bounds::{assert_close, row_scales};

fn check_matvec(rng: &mut Rng, out: usize, inp: usize, fmt: Format) {
    let w = random_linear(rng, out, inp, fmt);
    let x = rng.vec(inp, 1.0);
    let mut want = vec![0.0; out];
    w.forward_rows(&x, &mut want);
    let scale = row_scales(&w, &x);
    let mut xp = XPrep::new();
    for level in SimdLevel::supported() {
        let mut y = vec![f32::NAN; out];
        qmatvec(level, &w.view(), &x, &mut y, &mut xp).expect("matvec");
        assert_close(
            &y,
            &want,
            &scale,
            &format!("{level:?} {fmt:?} [{out}, {inp}]"),
        );
    }
}

const FLOATS: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

#[test]
fn quantized_matvec_matches_reference_at_every_width_group_and_level() {
    let mut rng = Rng::new(1);
    let outs = [1, 7, 16, 33, 1001];
    let ins = [128, 256, 384, 1024, 2048, 4096];
    let mut case = 0;
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128] {
            for float in FLOATS {
                // Rotate through shapes so each format meets several, keeping the run short.
                for k in 0..2 {
                    case += 1;
                    let out = outs[(case + k) % outs.len()];
                    let inp = ins[(case * 7 + k) % ins.len()];
                    let inp = inp.max(group);
                    check_matvec(&mut rng, out, inp, Format::Affine { bits, group, float });
                }
                // Widths that are a multiple of 32 but not of a whole vector block.
                check_matvec(
                    &mut rng,
                    5,
                    96.max(group) / group * group + group,
                    Format::Affine { bits, group, float },
                );
            }
        }
    }
}

#[test]
fn quantized_matvec_handles_the_smallest_and_odd_block_widths() {
    let mut rng = Rng::new(2);
    for bits in [2, 3, 4, 5, 6, 8] {
        for inp in [32, 64, 96, 160, 224, 288, 32 * 33] {
            check_matvec(
                &mut rng,
                3,
                inp,
                Format::Affine {
                    bits,
                    group: 32,
                    float: DType::BF16,
                },
            );
        }
    }
}

#[test]
fn float_matvec_matches_reference_for_any_width() {
    let mut rng = Rng::new(3);
    for dtype in FLOATS {
        for (out, inp) in [
            (1, 1),
            (7, 37),
            (33, 100),
            (1001, 512),
            (16, 2053),
            (3, 4096),
        ] {
            check_matvec(&mut rng, out, inp, Format::Float(dtype));
        }
    }
}

#[test]
fn matvec_rejects_mismatched_shapes() {
    let mut rng = Rng::new(4);
    let w = random_linear(
        &mut rng,
        4,
        64,
        Format::Affine {
            bits: 4,
            group: 32,
            float: DType::BF16,
        },
    );
    let mut xp = XPrep::new();
    let mut y = vec![0.0; 4];
    assert!(qmatvec(SimdLevel::detect(), &w.view(), &[0.0; 63], &mut y, &mut xp).is_err());
    let mut short = w.clone();
    if let Weights::Affine { packed, .. } = &mut short.weights {
        packed.truncate(10);
    }
    assert!(
        qmatvec(
            SimdLevel::detect(),
            &short.view(),
            &[0.0; 64],
            &mut y,
            &mut xp
        )
        .is_err()
    );
}

#[test]
fn dequant_row_matches_reference_row() {
    let mut rng = Rng::new(5);
    for bits in [2, 3, 4, 5, 6, 8] {
        let w = random_linear(
            &mut rng,
            3,
            256,
            Format::Affine {
                bits,
                group: 64,
                float: DType::F16,
            },
        );
        let (mut a, mut b) = (vec![0.0; 256], vec![0.0; 256]);
        for r in 0..3 {
            dequant_row(&w.view(), r, &mut a);
            w.row(r, &mut b);
            assert_eq!(a, b, "bits {bits} row {r}");
        }
    }
}

fn check_matmul(rng: &mut Rng, out: usize, inp: usize, t: usize, fmt: Format, pool: &CpuPool) {
    let w = random_linear(rng, out, inp, fmt);
    let x = rng.vec(t * inp, 1.0);
    let mut want = vec![0.0; t * out];
    w.forward_rows(&x, &mut want);
    let mut scale = Vec::new();
    for xt in x.chunks_exact(inp) {
        scale.extend(row_scales(&w, xt));
    }
    let mut xb = XBatch::new();
    for level in SimdLevel::supported() {
        let what = format!("{level:?} {fmt:?} [{out}, {inp}] T={t}");
        let mut y = vec![f32::NAN; t * out];
        qmatmul(level, &w.view(), &x, &mut y, &mut xb).expect("matmul");
        assert_close(&y, &want, &scale, &what);
        let mut y = vec![f32::NAN; t * out];
        qmatmul_pool(pool, level, &w.view(), &x, &mut y, &mut xb).expect("matmul");
        assert_close(&y, &want, &scale, &format!("pool {what}"));
    }
}

#[test]
fn quantized_and_float_matmul_match_reference_for_token_chunks() {
    let mut rng = Rng::new(6);
    let pool = CpuPool::new(3);
    let mut case = 0;
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128] {
            let float = FLOATS[case % 3];
            let t = [1, 3, 4, 5, 9, 17][case % 6];
            let (out, inp) = [(7, 256), (33, 512), (16, 1024), (5, 160 / 32 * 32)][case % 4];
            let inp = inp.max(group) / group * group;
            check_matmul(
                &mut rng,
                out,
                inp,
                t,
                Format::Affine { bits, group, float },
                &pool,
            );
            case += 1;
        }
    }
    // 4-bit rows longer than one 32-group segment of scales (the AVX-512 kernels keep a
    // segment in registers), ending in a partial segment and a partial 128-element block.
    for (out, inp, group, t) in [(6, 2080, 32, 5), (5, 4096, 64, 3), (3, 4224, 128, 4)] {
        let fmt = Format::Affine {
            bits: 4,
            group,
            float: FLOATS[out % 3],
        };
        check_matmul(&mut rng, out, inp, t, fmt, &pool);
        check_matvec(&mut rng, out, inp, fmt);
    }
    // 4-bit chunks of more tokens and rows than one 4×4 tile or one 16-row block, with
    // remainders of both.
    for (out, inp, t) in [(37, 256, 40), (19, 512, 16), (8, 128, 33), (3, 384, 2)] {
        let fmt = Format::Affine {
            bits: 4,
            group: 64,
            float: FLOATS[t % 3],
        };
        check_matmul(&mut rng, out, inp, t, fmt, &pool);
    }
    for dtype in FLOATS {
        check_matmul(&mut rng, 9, 37, 6, Format::Float(dtype), &pool);
        check_matmul(&mut rng, 20, 300, 5, Format::Float(dtype), &pool);
    }
}

/// AVX2's exact prefill tile sums each (row, token) one FMA per element in element order, so
/// a token's outputs have the same bits whatever chunk it comes in: alone, first or last, in a
/// full panel of eight or a partial one, beside any rows (docs/CPU.md).
#[test]
fn avx2_exact_tile_gives_each_token_the_same_bits_in_any_chunk() {
    if !SimdLevel::Avx2.is_supported() {
        return;
    }
    let mut rng = Rng::new(31);
    let pool = CpuPool::new(3);
    for (out, inp, group) in [(53, 512, 64), (13, 2080, 32), (100, 384, 128)] {
        let fmt = Format::Affine {
            bits: 4,
            group,
            float: DType::BF16,
        };
        let w = random_linear(&mut rng, out, inp, fmt);
        let t = 37;
        let x = rng.vec(t * inp, 1.0);
        let mut whole = vec![0.0; t * out];
        let mut xb = XBatch::new();
        qmatmul_pool(&pool, SimdLevel::Avx2, &w.view(), &x, &mut whole, &mut xb).expect("mm");
        // Alone, first and last; partial panels of 1, 3, 4 and 1 tokens; whole panels.
        let parts = [
            (0, 1),
            (36, 37),
            (3, 20),
            (8, 16),
            (5, 37),
            (0, 9),
            (2, 14),
            (10, 21),
        ];
        for (a, b) in parts {
            let mut part = vec![f32::NAN; (b - a) * out];
            let xs = &x[a * inp..b * inp];
            qmatmul(SimdLevel::Avx2, &w.view(), xs, &mut part, &mut xb).expect("mm");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&part),
                bits(&whole[a * out..b * out]),
                "[{out}, {inp}] g{group}: tokens {a}..{b} alone"
            );
        }
    }
}

#[test]
fn pooled_matvec_equals_single_thread_for_any_thread_count() {
    let mut rng = Rng::new(7);
    let w = random_linear(
        &mut rng,
        1001,
        512,
        Format::Affine {
            bits: 4,
            group: 64,
            float: DType::BF16,
        },
    );
    let x = rng.vec(512, 1.0);
    let level = SimdLevel::detect();
    let mut xp = XPrep::new();
    let mut want = vec![0.0; 1001];
    qmatvec(level, &w.view(), &x, &mut want, &mut xp).expect("matvec");
    for threads in [1, 2, 3, 5] {
        let pool = CpuPool::new(threads);
        for _ in 0..50 {
            let mut y = vec![f32::NAN; 1001];
            qmatvec_pool(&pool, level, &w.view(), &x, &mut y, &mut xp).expect("matvec");
            assert_eq!(y, want, "{threads} threads");
        }
    }
}

#[test]
fn pool_reraises_a_panicking_job_and_keeps_working() {
    let pool = CpuPool::new(2);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.run(&|t| assert!(t != 1, "share 1 fails"));
    }));
    assert!(r.is_err());
    let hits = std::sync::atomic::AtomicUsize::new(0);
    pool.run(&|_| {
        hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    assert_eq!(hits.into_inner(), 2);
}

/// Activations spanning 8 orders of magnitude, with outliers.
fn spread_magnitudes(x: &mut [f32]) {
    for (i, v) in x.iter_mut().enumerate() {
        *v *= 10f32.powi((i % 9) as i32 - 4);
    }
}

#[test]
fn split24_matvec_matches_reference_on_every_integer_kernel() {
    let mut rng = Rng::new(8);
    let mut xp = XPrep::new();
    for kernel in common::int_kernels() {
        for group in [32, 64, 128] {
            for float in FLOATS {
                for (out, inp) in [(7, 128), (33, 2048), (5, 96.max(group)), (1001, 512)] {
                    let inp = inp / group * group;
                    let w = common::q4(&mut rng, out, inp, group, float);
                    let mut x = rng.vec(inp, 1.0);
                    spread_magnitudes(&mut x);
                    let mut want = vec![0.0; out];
                    w.forward_rows(&x, &mut want);
                    let scale = row_scales(&w, &x);
                    common::prepare_int(&mut xp, kernel, Precision::Split24, &x);
                    let mut y = vec![f32::NAN; out];
                    matvec_rows(kernel.0, &w.view(), &xp, &mut y, 0..out);
                    assert_close(
                        &y,
                        &want,
                        &scale,
                        &format!("split24 {kernel:?} g{group} {float:?} [{out}, {inp}]"),
                    );
                }
            }
        }
    }
}

#[test]
fn split24_matmul_matches_reference_on_every_integer_kernel() {
    let mut rng = Rng::new(9);
    let pool = CpuPool::new(3);
    let mut xb = XBatch::new();
    let mut case = 0;
    for (lvl, vnni) in common::int_kernels() {
        xb.set_avx_vnni(vnni);
        for group in [32, 64, 128] {
            for float in FLOATS {
                // Rows and tokens with remainders of a row block (16, 4, 2) and of every
                // token tile (8, 4, 2, 1), widths of one group, many groups, and a partial
                // 64-element piece.
                let (out, inp, t) =
                    [(7, 128, 1), (33, 2048, 9), (16, 160, 3), (50, 4096, 21)][case % 4];
                case += 1;
                let inp = inp.max(group) / group * group;
                let w = common::q4(&mut rng, out, inp, group, float);
                let mut x = rng.vec(t * inp, 1.0);
                spread_magnitudes(&mut x);
                let mut want = vec![0.0; t * out];
                w.forward_rows(&x, &mut want);
                let mut scale = Vec::new();
                for xt in x.chunks_exact(inp) {
                    scale.extend(row_scales(&w, xt));
                }
                let what = format!(
                    "split24 matmul {lvl:?} vnni {vnni} g{group} {float:?} [{out}, {inp}] T={t}"
                );
                let mut y = vec![f32::NAN; t * out];
                let p = Precision::Split24;
                qmatmul_at(lvl, p, &w.view(), &x, &mut y, &mut xb).expect("matmul");
                assert_close(&y, &want, &scale, &what);
                let mut y = vec![f32::NAN; t * out];
                qmatmul_pool_at(&pool, lvl, p, &w.view(), &x, &mut y, &mut xb).expect("matmul");
                assert_close(&y, &want, &scale, &format!("pool {what}"));
            }
        }
    }
}
