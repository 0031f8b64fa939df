//! `Precision::Fast` (int8 activations per 32-element block, VNNI) against the reference.
//!
//! Tolerance, stated from the arithmetic rather than fitted: x is rounded to X·d with
//! d = max|x_b| / 127 per block b, so each product s·q·x moves by at most |s q|·d/2, and a row
//! by at most E = Σ_b (d_b / 2)·Σ_{i∈b} |s_g q_i|. We require |y − y_ref| ≤ E plus the exact
//! kernels' f32 rounding bound (2e-6 · Σ_i |x_i|·(|s_g q_i| + |β_g|), see cpu_kernels.rs).
//! The exact path's tests are untouched: this file only holds the lossy one.

mod common;

use brook_core::cpu::testutil::{Format, Rng, random_linear};
use brook_core::cpu::{
    CpuModel, CpuOptions, CpuPool, Precision, SimdLevel, XBatch, XPrep, matvec_rows,
    qmatmul_pool_at,
};
use brook_core::dtype::DType;
use brook_core::{Logits, Model, Stage};
use common::bounds::bounds;
use common::{MODELS, Reference, argmax, fixture, int_kernels, prepare_int, rel_l2};

#[test]
fn fast_matvec_stays_within_the_int8_rounding_bound() {
    let mut rng = Rng::new(11);
    let mut xp = XPrep::new();
    let mut worst = 0.0f32;
    for kernel in int_kernels() {
        for group in [32, 64, 128] {
            for float in [DType::BF16, DType::F16, DType::F32] {
                for (out, inp) in [(7, 128), (33, 2048), (5, 96.max(group)), (1001, 512)] {
                    let inp = inp / group * group;
                    let fmt = Format::Affine {
                        bits: 4,
                        group,
                        float,
                    };
                    let w = random_linear(&mut rng, out, inp, fmt);
                    // Activations over 8 orders of magnitude, with outliers inside blocks.
                    let mut x = rng.vec(inp, 1.0);
                    for (i, v) in x.iter_mut().enumerate() {
                        *v *= 10f32.powi((i % 9) as i32 - 4);
                    }
                    let mut want = vec![0.0; out];
                    w.forward_rows(&x, &mut want);
                    prepare_int(&mut xp, kernel, Precision::Fast, &x);
                    let mut y = vec![f32::NAN; out];
                    matvec_rows(kernel.0, &w.view(), &xp, &mut y, 0..out);
                    for (r, ((g, t), (e, s))) in y.iter().zip(&want).zip(bounds(&w, &x)).enumerate()
                    {
                        let err = (g - t).abs();
                        let tol = e + 2e-6 * s + 1e-30;
                        assert!(
                            err <= tol,
                            "fast {kernel:?} g{group} {float:?} [{out}, {inp}] row {r}: got {g}, reference {t}, error {err:e} > {tol:e}"
                        );
                        worst = worst.max(err / tol);
                    }
                }
            }
        }
    }
    println!("worst error / bound: {worst:.3}");
}

/// A row's bits do not depend on the rows computed beside it (the AVX2 kernel sums four rows'
/// blocks in one register; the thread pool and the batched step cut the rows anywhere), nor,
/// on AVX2, on whether `vpmaddubsw` or AVX-VNNI's `vpdpbusd` made the integer sums.
#[test]
fn fast_matvec_rows_keep_their_bits_in_any_row_range() {
    let mut rng = Rng::new(23);
    let mut xp = XPrep::new();
    for group in [32, 64, 128] {
        let (out, inp) = (37, 2048 + 3 * 32);
        let inp = inp / group * group;
        let fmt = Format::Affine {
            bits: 4,
            group,
            float: DType::BF16,
        };
        let w = random_linear(&mut rng, out, inp, fmt);
        let x = rng.vec(inp, 1.0);
        let mut avx2_bits: Option<Vec<u32>> = None;
        for kernel in int_kernels() {
            prepare_int(&mut xp, kernel, Precision::Fast, &x);
            let mut whole = vec![f32::NAN; out];
            matvec_rows(kernel.0, &w.view(), &xp, &mut whole, 0..out);
            let bits: Vec<u32> = whole.iter().map(|v| v.to_bits()).collect();
            for range in [0..1, 1..4, 3..10, 5..6, 9..37, 34..37, 2..35] {
                let mut y = vec![f32::NAN; range.len()];
                matvec_rows(kernel.0, &w.view(), &xp, &mut y, range.clone());
                for (r, v) in range.clone().zip(&y) {
                    assert_eq!(
                        v.to_bits(),
                        bits[r],
                        "{kernel:?} g{group} row {r} in rows {range:?}: {v} against {} alone",
                        whole[r]
                    );
                }
            }
            if kernel.0 == SimdLevel::Avx2 {
                match &avx2_bits {
                    Some(b) => assert_eq!(b, &bits, "AVX2 with and without AVX-VNNI, g{group}"),
                    None => avx2_bits = Some(bits),
                }
            }
        }
    }
}

/// The int8 path is lossy but not loose: on typical activations (no outliers) its relative
/// error over a row is far below 1%, and it is not the f32 result (so the test would notice
/// the Fast path silently running as F32, and a kernel off by a nibble or a lane scale).
#[test]
fn fast_matmul_stays_within_the_int8_rounding_bound() {
    let mut rng = Rng::new(13);
    let pool = CpuPool::new(2);
    let mut xb = XBatch::new();
    let mut worst = 0.0f32;
    let mut case = 0;
    for (lvl, vnni) in int_kernels() {
        xb.set_avx_vnni(vnni);
        for group in [32, 64, 128] {
            for float in [DType::BF16, DType::F16, DType::F32] {
                // Remainders of a 16-row block and of every token tile (8, 4, 2, 1).
                let (out, inp, t) =
                    [(7, 128, 1), (33, 2048, 15), (16, 160, 3), (40, 1024, 26)][case % 4];
                case += 1;
                let inp = inp.max(group) / group * group;
                let fmt = Format::Affine {
                    bits: 4,
                    group,
                    float,
                };
                let w = random_linear(&mut rng, out, inp, fmt);
                let mut x = rng.vec(t * inp, 1.0);
                for (i, v) in x.iter_mut().enumerate() {
                    *v *= 10f32.powi((i % 5) as i32 - 2);
                }
                let mut want = vec![0.0; t * out];
                w.forward_rows(&x, &mut want);
                let mut y = vec![f32::NAN; t * out];
                let p = Precision::Fast;
                qmatmul_pool_at(&pool, lvl, p, &w.view(), &x, &mut y, &mut xb).expect("matmul");
                for (k, xt) in x.chunks_exact(inp).enumerate() {
                    let rows = k * out..(k + 1) * out;
                    for (r, ((g, v), (e, s))) in y[rows.clone()]
                        .iter()
                        .zip(&want[rows])
                        .zip(bounds(&w, xt))
                        .enumerate()
                    {
                        let err = (g - v).abs();
                        let bound = e + 2e-6 * s + 1e-30;
                        worst = worst.max(err / bound);
                        assert!(
                            err <= bound,
                            "{lvl:?} vnni {vnni} g{group} {float:?} [{out}, {inp}] token {k} row {r}: got {g}, \
                         reference {v}, error {err:e} > {bound:e}"
                        );
                    }
                }
            }
        }
    }
    println!("worst error / bound: {worst:.3}");
}

#[test]
fn fast_matvec_is_close_on_typical_activations() {
    let mut rng = Rng::new(12);
    let fmt = Format::Affine {
        bits: 4,
        group: 64,
        float: DType::BF16,
    };
    let (out, inp) = (512, 2048);
    let w = random_linear(&mut rng, out, inp, fmt);
    let x = rng.vec(inp, 1.0);
    let mut want = vec![0.0; out];
    w.forward_rows(&x, &mut want);
    let mut xp = XPrep::new();
    for kernel in int_kernels() {
        prepare_int(&mut xp, kernel, Precision::Fast, &x);
        let mut y = vec![f32::NAN; out];
        matvec_rows(kernel.0, &w.view(), &xp, &mut y, 0..out);
        let num: f64 = y
            .iter()
            .zip(&want)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        println!("fast {kernel:?} [512, 2048] q4g64: rel L2 error {rel:.2e}");
        assert!(rel < 1e-2, "{kernel:?}: rel L2 error {rel:e}");
        assert!(
            rel > 1e-7,
            "{kernel:?}: rel L2 error {rel:e}: the int8 path did not run"
        );
    }
}

/// One fixture through `CpuModel` at `precision`, one token per call so every token takes
/// the decode kernels that `Precision` changes: (logits [T, V] of the prompt, expert sets per
/// (layer, token), 16 greedy tokens after the prompt).
fn run(
    model: &Model,
    tokens: &[u32],
    precision: Precision,
    level: SimdLevel,
) -> (Vec<f32>, Vec<Vec<usize>>, Vec<u32>) {
    let o = CpuOptions {
        threads: 2,
        max_chunk: 1,
        max_context: 64,
        level: Some(level),
        precision,
        max_seqs: 1,
    };
    let mut cpu = CpuModel::new(model, o).expect("cpu");
    let mut st = cpu.new_state(64);
    let mut routes = Vec::new();
    let logits = cpu
        .forward_traced(
            &mut st,
            tokens,
            Logits::All,
            Some(&mut |s: Stage<'_>| {
                if let Stage::Routes(_, r) = s {
                    routes.extend(r.iter().map(|r| {
                        let mut e = r.experts.clone();
                        e.sort_unstable();
                        e
                    }));
                }
            }),
        )
        .expect("forward")
        .to_vec();
    let v = model.cfg.vocab_size;
    let mut next = argmax(&logits[logits.len() - v..]);
    let mut greedy = Vec::new();
    for _ in 0..16 {
        greedy.push(next);
        next = argmax(cpu.forward(&mut st, &[next], Logits::Last).expect("step"));
    }
    (logits, routes, greedy)
}

/// The fast path on every fixture against the exact one (and mlx-lm's greedy tokens). The
/// fixtures are tiny random-weight models, where a small change can flip an expert choice
/// and then move the logits a lot, so the bounds are split: on the tokens before the first
/// changed expert set, each token's logits within 5% rel L2 of the exact path (measured on
/// the mixed fixtures: at most 1.9e-2; the q4 ones flip an expert on the first token); over
/// the whole prompt, within 25% rel L2 and at most a quarter of the (layer, token) expert sets
/// changed (measured: at most 1.9e-1 and 12/80, on qwen35-q4).
#[test]
fn fast_forward_agrees_with_the_exact_path_on_every_fixture() {
    let mut levels: Vec<SimdLevel> = int_kernels().into_iter().map(|k| k.0).collect();
    levels.dedup();
    for (name, level) in MODELS
        .into_iter()
        .flat_map(|n| levels.iter().map(move |&l| (n, l)))
    {
        let model = Model::open(&fixture(name)).expect("open");
        let (v, layers) = (model.cfg.vocab_size, model.cfg.num_hidden_layers);
        let r = Reference::open(name);
        let tokens = r.ids("tokens");
        let (want, want_routes, want_greedy) = run(&model, &tokens, Precision::Exact, level);
        let (got, routes, greedy) = run(&model, &tokens, Precision::Fast, level);
        let err = rel_l2(&got, &want);
        let changed = routes
            .iter()
            .zip(&want_routes)
            .filter(|(a, b)| a != b)
            .count();
        // Tokens before the first changed expert set saw the same experts all along.
        let clean = routes
            .iter()
            .zip(&want_routes)
            .position(|(a, b)| a != b)
            .map_or(tokens.len(), |i| i / layers);
        let worst_clean = (0..clean)
            .map(|t| rel_l2(&got[t * v..(t + 1) * v], &want[t * v..(t + 1) * v]))
            .fold(0.0f64, f64::max);
        let same = greedy
            .iter()
            .zip(&want_greedy)
            .filter(|(a, b)| a == b)
            .count();
        let mlx = r.ids("greedy");
        let same_mlx = greedy.iter().zip(&mlx).filter(|(a, b)| a == b).count();
        println!(
            "{name} {level:?}: logits rel L2 {err:.2e} (worst of the {clean} tokens before any expert change {worst_clean:.2e}); \
             expert sets changed {changed}/{}; greedy same {same}/16 (exact), {same_mlx}/{} (mlx-lm)",
            routes.len(),
            mlx.len().min(16)
        );
        assert!(
            worst_clean < 2e-2,
            "{name} {level:?}: fast logits rel L2 {worst_clean:e}"
        );
        assert!(err < 0.25, "{name} {level:?}: fast logits rel L2 {err:e}");
        assert!(
            4 * changed <= routes.len(),
            "{name} {level:?}: {changed} expert sets changed"
        );
    }
}

/// A NaN in the input reaches every output, as on the exact path (through its block's int8
/// scale and through the exact Σx of the bias term).
#[test]
fn fast_matvec_propagates_nan() {
    let mut rng = Rng::new(13);
    let fmt = Format::Affine {
        bits: 4,
        group: 64,
        float: DType::BF16,
    };
    let w = random_linear(&mut rng, 8, 256, fmt);
    let mut x = rng.vec(256, 1.0);
    x[77] = f32::NAN;
    let mut xp = XPrep::new();
    for kernel in int_kernels() {
        for p in [Precision::Fast, Precision::Exact] {
            prepare_int(&mut xp, kernel, p, &x);
            let mut y = vec![0.0; 8];
            matvec_rows(kernel.0, &w.view(), &xp, &mut y, 0..8);
            assert!(y.iter().all(|v| v.is_nan()), "{kernel:?} {p:?}: {y:?}");
        }
    }
}

/// One-token fast calls keep the DeltaNet states in bf16 (half the bytes a decoded token
/// moves through them); every other reader gets f32 back: a prefill, the exact path, a saved
/// copy. On an f32 model (whose products Fast leaves exact) the only difference from the
/// exact path is that rounding: one step from the same state within 1e-2 relative L2 of the
/// logits (the states' relative error is 2⁻⁹ per value).
#[test]
fn fast_decode_holds_the_recurrent_states_in_bf16() {
    use brook_core::model::state::LayerState;
    let model = Model::open(&fixture("next-f32")).expect("open");
    let tokens = Reference::open("next-f32").ids("tokens");
    let opts = |precision| CpuOptions {
        threads: 2,
        max_chunk: 8,
        max_context: 64,
        level: None,
        precision,
        max_seqs: 1,
    };
    let mut fast = CpuModel::new(&model, opts(Precision::Fast)).expect("cpu");
    let mut exact = CpuModel::new(&model, opts(Precision::Exact)).expect("cpu");
    let mut st = fast.new_state(64);
    fast.forward(&mut st, &tokens[..8], Logits::Last)
        .expect("prefill");
    assert!(st.device.is_none(), "a prefill keeps f32 states");
    let mut st_exact = st.clone();
    let want = exact
        .forward(&mut st_exact, &tokens[8..9], Logits::Last)
        .expect("exact step")
        .to_vec();
    let got = fast
        .forward(&mut st, &tokens[8..9], Logits::Last)
        .expect("fast step")
        .to_vec();
    assert!(st.device.is_some(), "one token holds the states in bf16");
    let err = rel_l2(&got, &want);
    println!("one step with bf16 states: logits rel L2 {err:.2e}");
    assert!(err < 1e-2, "bf16 states moved the logits by {err:e}");

    // A saved copy holds the bf16 values as f32, and the host's other state is live.
    let host = st.host_copy().expect("host copy");
    let mut linear = 0;
    for l in &host.layers {
        if let LayerState::Linear { ssm, .. } = l {
            assert_eq!(ssm.len(), model.cfg.ssm_state_len());
            assert!(ssm.iter().all(|x| x.to_bits() & 0xFFFF == 0));
            linear += 1;
        }
    }
    assert!(linear > 0);
    assert_eq!(host.pos, 9);

    // A clone decodes exactly as the original.
    let mut c = st.clone();
    let a = fast
        .forward(&mut st, &tokens[9..10], Logits::Last)
        .expect("step")
        .to_vec();
    let b = fast
        .forward(&mut c, &tokens[9..10], Logits::Last)
        .expect("step")
        .to_vec();
    assert_eq!(a, b);

    // The exact path and a prefill continue from the held state in f32, alike.
    let mut e = c.clone();
    let want = exact
        .forward(&mut e, &tokens[10..12], Logits::Last)
        .expect("exact continues")
        .to_vec();
    assert!(e.device.is_none());
    let got = fast
        .forward(&mut st, &tokens[10..12], Logits::Last)
        .expect("prefill after decode")
        .to_vec();
    assert!(
        st.device.is_none(),
        "a prefill brings the states back to f32"
    );
    let err = rel_l2(&got, &want);
    assert!(err < 1e-5, "prefill after bf16 decode: {err:e}");
}
