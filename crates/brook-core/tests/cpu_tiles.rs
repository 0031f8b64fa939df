//! Matrices in 16-row tiles (`Order::Tiles`): the move keeps every row, and the kernels that
//! read tiles match the reference at every level and precision, at the bounds of
//! cpu_kernels.rs (exact: Split24 digits) and cpu_fast.rs (int8).

mod common;

use brook_core::config::QuantSpec;
use brook_core::cpu::testutil::{Format, Rng, random_linear};
use brook_core::cpu::{
    CpuPool, Precision, SimdLevel, XBatch, XPrep, matvec_rows, qmatmul_at, qmatmul_pool_at,
    qmatvec_pool_at,
};
use brook_core::dtype::DType;
use brook_core::linear::{Linear, Order, Weights, untile_bytes};
use brook_core::model::Model;
use brook_core::model::open::OpenOptions;
use common::bounds::{TOL, assert_close, bounds, row_scales};
use common::{fixture, q4};

const FLOATS: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

fn tiled(w: &Linear) -> Linear {
    let mut t = w.clone();
    assert!(
        t.tile(),
        "[{}, {}] should tile",
        w.out_features,
        w.in_features
    );
    t
}

fn order(w: &Linear) -> Order {
    match &w.weights {
        Weights::Affine { order, .. } => *order,
        Weights::Float { .. } => Order::Rows,
    }
}

/// Activations over 8 orders of magnitude, with outliers inside blocks.
fn spread(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x = rng.vec(n, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        *v *= 10f32.powi((i % 9) as i32 - 4);
    }
    x
}

/// The exact bound (`scale`), or with int8 activations the int8 rounding bound plus it
/// (`fast`: per output, from `bounds`).
fn assert_within(y: &[f32], want: &[f32], scale: &[f32], fast: Option<&[(f32, f32)]>, what: &str) {
    let Some(fast) = fast else {
        return assert_close(y, want, scale, what);
    };
    for (r, ((g, w), (e, s))) in y.iter().zip(want).zip(fast).enumerate() {
        let tol = e + TOL * s + 1e-30;
        assert!((g - w).abs() <= tol, "{what}: output {r}: {g} vs {w}");
    }
}

/// Shapes with one and many 16-row blocks, one and many groups.
fn shapes(group: usize) -> [(usize, usize); 3] {
    [(16, group.max(32)), (48, 2048), (160, 384 / group * group)]
}

#[test]
fn tiles_hold_every_row_go_back_and_refuse_what_does_not_fit() {
    let mut rng = Rng::new(21);
    for group in [32, 64, 128] {
        for float in FLOATS {
            for (out, inp) in shapes(group) {
                let w = q4(&mut rng, out, inp, group, float);
                let t = tiled(&w);
                assert_eq!(order(&t), Order::Tiles);
                assert_eq!(t.nbytes(), w.nbytes());
                let (mut a, mut b) = (vec![0.0; inp], vec![0.0; inp]);
                for r in 0..out {
                    w.row(r, &mut a);
                    t.row(r, &mut b);
                    assert_eq!(a, b, "g{group} {float:?} [{out}, {inp}] row {r}");
                }
                // Tiling twice changes nothing.
                let mut again = t.clone();
                assert!(!again.tile());
                // And the way back (the CUDA upload's) restores the checkpoint's bytes.
                let (
                    Weights::Affine {
                        packed,
                        scales,
                        biases,
                        ..
                    },
                    Weights::Affine {
                        packed: tp,
                        scales: ts,
                        biases: tbi,
                        ..
                    },
                ) = (&w.weights, &t.weights)
                else {
                    unreachable!("affine")
                };
                let mut back = [
                    vec![0u8; packed.len()],
                    vec![0u8; scales.len()],
                    vec![0u8; biases.len()],
                ];
                let [bp, bs, bb] = &mut back;
                let spec = QuantSpec {
                    bits: 4,
                    group_size: group,
                };
                untile_bytes(spec, float, out, inp, [tp, ts, tbi], [bp, bs, bb]);
                assert_eq!(
                    [&back[0], &back[1], &back[2]],
                    [packed, scales, biases],
                    "g{group} {float:?} [{out}, {inp}] back"
                );
            }
        }
    }
    let mut rng = Rng::new(22);
    let fmt = |bits, group| Format::Affine {
        bits,
        group,
        float: DType::BF16,
    };
    for (out, inp, f) in [
        (33, 256, fmt(4, 64)), // rows not a multiple of 16
        (32, 256, fmt(8, 64)), // 8 bits
        (32, 256, Format::Float(DType::F32)),
    ] {
        let mut w = random_linear(&mut rng, out, inp, f);
        assert!(!w.tile(), "{f:?} [{out}, {inp}]");
        assert_eq!(order(&w), Order::Rows);
    }
}

#[test]
fn tiled_matvec_matches_reference_at_every_level_and_precision() {
    let mut rng = Rng::new(23);
    let pool = CpuPool::new(3);
    let mut xp = XPrep::new();
    for group in [32, 64, 128] {
        for float in FLOATS {
            for (out, inp) in shapes(group) {
                let w = q4(&mut rng, out, inp, group, float);
                let t = tiled(&w);
                let x = spread(&mut rng, inp);
                let mut want = vec![0.0; out];
                w.forward_rows(&x, &mut want);
                let scale = row_scales(&w, &x);
                let fast = bounds(&w, &x);
                let mut precisions = vec![Precision::Exact];
                if SimdLevel::has_vnni() {
                    precisions.extend([Precision::Split24, Precision::Fast]);
                }
                for level in SimdLevel::supported() {
                    for &p in &precisions {
                        let what = format!("{level:?} {p:?} g{group} {float:?} [{out}, {inp}]");
                        let mut y = vec![f32::NAN; out];
                        qmatvec_pool_at(&pool, level, p, &t.view(), &x, &mut y, &mut xp)
                            .expect("matvec");
                        // A row range that cuts 16-row blocks on both ends.
                        let cut = 5..out - 3;
                        let mut yc = vec![f32::NAN; cut.len()];
                        matvec_rows(level, &t.view(), &xp, &mut yc, cut.clone());
                        assert_eq!(&yc[..], &y[cut], "{what}: a cut range");
                        let int8 = p == Precision::Fast && level == SimdLevel::Avx512;
                        assert_within(&y, &want, &scale, int8.then_some(&fast[..]), &what);
                    }
                }
            }
        }
    }
}

#[test]
fn rows_and_tiles_give_the_same_bits_where_vnni_exists() {
    // An expert streamed into a slot stays in rows, a resident one goes into tiles: the
    // cache must not change results, so both orders must sum alike to the bit.
    if !SimdLevel::has_vnni() {
        return;
    }
    let mut rng = Rng::new(25);
    let mut xp = XPrep::new();
    for group in [32, 64, 128] {
        for float in FLOATS {
            for (out, inp) in shapes(group) {
                let w = q4(&mut rng, out, inp, group, float);
                let t = tiled(&w);
                let x = spread(&mut rng, inp);
                for p in [Precision::Exact, Precision::Split24, Precision::Fast] {
                    xp.prepare_with(SimdLevel::Avx512, p, &x);
                    let (mut yr, mut yt) = (vec![f32::NAN; out], vec![f32::NAN; out]);
                    matvec_rows(SimdLevel::Avx512, &w.view(), &xp, &mut yr, 0..out);
                    matvec_rows(SimdLevel::Avx512, &t.view(), &xp, &mut yt, 0..out);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&yr),
                        bits(&yt),
                        "{p:?} g{group} {float:?} [{out}, {inp}]"
                    );
                }
            }
        }
    }
}

#[test]
fn tiled_matmul_matches_reference_at_every_level_and_precision() {
    let mut rng = Rng::new(24);
    let pool = CpuPool::new(3);
    let mut xb = XBatch::new();
    let mut case = 0;
    for group in [32, 64, 128] {
        for float in FLOATS {
            let (out, inp) = shapes(group)[case % 3];
            // Token counts with remainders of every token tile (8, 4, 2, 1).
            let t = [1, 3, 15, 21][case % 4];
            case += 1;
            let w = q4(&mut rng, out, inp, group, float);
            let tw = tiled(&w);
            let x = spread(&mut rng, t * inp);
            let mut want = vec![0.0; t * out];
            w.forward_rows(&x, &mut want);
            let (mut scale, mut fast) = (Vec::new(), Vec::new());
            for xt in x.chunks_exact(inp) {
                scale.extend(row_scales(&w, xt));
                fast.extend(bounds(&w, xt));
            }
            let mut precisions = vec![Precision::Exact];
            if SimdLevel::has_vnni() {
                precisions.extend([Precision::Split24, Precision::Fast]);
            }
            for level in SimdLevel::supported() {
                for &p in &precisions {
                    let what = format!("{level:?} {p:?} g{group} {float:?} [{out}, {inp}] T={t}");
                    let mut y = vec![f32::NAN; t * out];
                    qmatmul_at(level, p, &tw.view(), &x, &mut y, &mut xb).expect("matmul");
                    let mut yp = vec![f32::NAN; t * out];
                    qmatmul_pool_at(&pool, level, p, &tw.view(), &x, &mut yp, &mut xb)
                        .expect("matmul");
                    assert_eq!(y, yp, "{what}: pool");
                    let int8 = p == Precision::Fast && level == SimdLevel::Avx512;
                    assert_within(&y, &want, &scale, int8.then_some(&fast[..]), &what);
                }
            }
        }
    }
}

#[test]
fn a_model_opened_for_the_cpu_holds_its_projections_in_tiles_where_vnni_exists() {
    let model = Model::open_with(&fixture("qwen35-q4"), &OpenOptions::default()).expect("open");
    let d = &model.dense;
    let want = if SimdLevel::has_vnni() && SimdLevel::detect() == SimdLevel::Avx512 {
        Order::Tiles
    } else {
        Order::Rows
    };
    let se = &d.layers[0].mlp.shared_expert;
    assert_eq!(order(&se.gate_proj), want); // [96, 128]
    assert_eq!(order(&se.up_proj), want);
    // Neither the head of 1003 rows nor the 8-bit router can take tiles.
    assert_eq!(order(&d.lm_head), Order::Rows);
    assert_eq!(order(&d.layers[0].mlp.gate), Order::Rows);
}

#[test]
fn short_chunks_get_the_chunk_tiles_bits_from_the_one_token_kernel_where_vnni_exists() {
    // Chunks of up to ONE_TOKEN_ROWS tokens (ONE_TOKEN_ROWS_TILED on tiles) take the
    // one-token kernel at the one-token precision; with VNNI that must not change a bit of
    // what the chunk tile (at the chunk precision, Split24 for exact) gives.
    use brook_core::cpu::blocks::exec::{ONE_TOKEN_ROWS, ONE_TOKEN_ROWS_TILED};
    if !SimdLevel::has_vnni() {
        return;
    }
    let mut rng = Rng::new(26);
    let (mut xb, mut xp) = (XBatch::new(), XPrep::new());
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for group in [32, 64, 128] {
        for float in FLOATS {
            for (out, inp) in shapes(group) {
                let w = q4(&mut rng, out, inp, group, float);
                for w in [tiled(&w), w] {
                    for t in [1, 2, 3, ONE_TOKEN_ROWS, 17, ONE_TOKEN_ROWS_TILED] {
                        let x = spread(&mut rng, t * inp);
                        for (chunk, one) in [
                            (Precision::Split24, Precision::Exact),
                            (Precision::Fast, Precision::Fast),
                        ] {
                            let mut y = vec![f32::NAN; t * out];
                            qmatmul_at(SimdLevel::Avx512, chunk, &w.view(), &x, &mut y, &mut xb)
                                .expect("matmul");
                            for (ti, xt) in x.chunks_exact(inp).enumerate() {
                                xp.prepare_with(SimdLevel::Avx512, one, xt);
                                let mut yr = vec![f32::NAN; out];
                                matvec_rows(SimdLevel::Avx512, &w.view(), &xp, &mut yr, 0..out);
                                assert_eq!(
                                    bits(&y[ti * out..(ti + 1) * out]),
                                    bits(&yr),
                                    "{one:?} g{group} {float:?} [{out}, {inp}] t{t} {:?}",
                                    order(&w)
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
