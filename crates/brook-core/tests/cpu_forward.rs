//! `CpuModel` against the reference `Model::forward` and mlx-lm's fixtures, at every SIMD
//! level this CPU runs.
//!
//! Tolerances: logits within 1e-4 relative L2 of mlx-lm (the bound, as the reference
//! test) and within 1e-5 of the reference forward pass (they differ only in f32 summation
//! order); greedy tokens and every layer's expert choice identical.

mod common;

use brook_core::cpu::{CpuModel, CpuOptions, Precision, SimdLevel};
use brook_core::experts::source::{ExpertHandle, ExpertSource, ResidentExperts};
use brook_core::model::moe::Route;
use brook_core::model::state::LayerState;
use brook_core::{Logits, Model, Stage};
use common::{MODELS, Reference, argmax, fixture, rel_l2};

fn opts(level: SimdLevel, threads: usize, max_chunk: usize) -> CpuOptions {
    CpuOptions {
        threads,
        max_chunk,
        max_context: 64,
        level: Some(level),
        precision: Precision::Exact,
        max_seqs: 1,
    }
}

/// Every (level, precision) this CPU runs: each level at F32, plus Split24 where VNNI exists.
fn variants() -> Vec<(SimdLevel, Precision)> {
    let mut v: Vec<_> = SimdLevel::supported()
        .map(|l| (l, Precision::Exact))
        .collect();
    if SimdLevel::has_vnni() {
        v.push((SimdLevel::Avx512, Precision::Split24));
    }
    v
}

fn routes_of(model: &Model, tokens: &[u32]) -> Vec<Vec<Route>> {
    let mut out = Vec::new();
    model
        .forward(
            &mut model.new_state(),
            tokens,
            Logits::None,
            Some(&mut |s: Stage<'_>| {
                if let Stage::Routes(_, r) = s {
                    out.push(r.to_vec());
                }
            }),
        )
        .expect("reference forward");
    out
}

#[test]
fn logits_and_expert_choices_match_the_reference_on_every_fixture() {
    for (name, tiles) in MODELS.iter().flat_map(|m| [(*m, false), (*m, true)]) {
        let mut model = Model::open(&fixture(name)).expect("open");
        let r = Reference::open(name);
        let tokens = r.ids("tokens");
        let want = model
            .forward(&mut model.new_state(), &tokens, Logits::All, None)
            .expect("reference");
        let want_routes = routes_of(&model, &tokens);
        // The same against the weights in 16-row tiles (the layout `Model::open_with` gives
        // the CPU backend where VNNI exists), whatever this CPU runs.
        if tiles && model.dense.tile() == 0 {
            continue;
        }
        for (level, precision) in variants() {
            for (threads, chunk) in [(1, 64), (2, 7), (2, 2)] {
                let o = CpuOptions {
                    precision,
                    ..opts(level, threads, chunk)
                };
                let mut cpu = CpuModel::new(&model, o).expect("cpu");
                let mut st = cpu.new_state(64);
                let mut routes: Vec<Vec<Route>> = Vec::new();
                let logits = cpu
                    .forward_traced(
                        &mut st,
                        &tokens,
                        Logits::All,
                        Some(&mut |s: Stage<'_>| {
                            if let Stage::Routes(i, r) = s {
                                // Chunks report a layer's routes piecewise.
                                if routes.len() <= i {
                                    routes.push(Vec::new());
                                }
                                routes[i].extend_from_slice(r);
                            }
                        }),
                    )
                    .expect("cpu forward")
                    .to_vec();
                let what = format!(
                    "{name} {level:?} {precision:?} {threads}t chunk {chunk} tiles {tiles}"
                );
                let err_ref = rel_l2(&logits, &want);
                let err_mlx = rel_l2(&logits, &r.f32("logits"));
                assert!(err_ref < 1e-5, "{what}: vs reference rel L2 {err_ref:e}");
                assert!(err_mlx < 1e-4, "{what}: vs mlx-lm rel L2 {err_mlx:e}");
                assert_eq!(routes.len(), want_routes.len(), "{what}");
                for (i, (got, exp)) in routes.iter().zip(&want_routes).enumerate() {
                    for (t, (g, e)) in got.iter().zip(exp).enumerate() {
                        assert_eq!(g.experts, e.experts, "{what}: layer {i} token {t} experts");
                    }
                }
                if threads == 1 && chunk == 64 {
                    println!(
                        "{what}: logits rel L2 {err_ref:.1e} vs reference, {err_mlx:.1e} vs mlx-lm"
                    );
                }
            }
        }
    }
}

#[test]
fn greedy_tokens_match_mlx_lm_for_16_steps() {
    for (name, (level, precision)) in MODELS
        .iter()
        .flat_map(|m| variants().into_iter().map(move |v| (*m, v)))
    {
        let model = Model::open(&fixture(name)).expect("open");
        let r = Reference::open(name);
        let want = r.ids("greedy");
        let o = CpuOptions {
            precision,
            ..opts(level, 2, 8)
        };
        let mut cpu = CpuModel::new(&model, o).expect("cpu");
        let mut st = cpu.new_state(64);
        let mut next = argmax(
            cpu.forward(&mut st, &r.ids("tokens"), Logits::Last)
                .expect("prefill"),
        );
        let mut got = Vec::new();
        for _ in 0..want.len() {
            got.push(next);
            next = argmax(cpu.forward(&mut st, &[next], Logits::Last).expect("step"));
        }
        assert_eq!(got, want, "{name} {level:?} {precision:?}");
    }
}

#[test]
fn states_move_between_the_reference_and_the_cpu_path() {
    for name in ["next-mixed", "qwen35-q4"] {
        let model = Model::open(&fixture(name)).expect("open");
        let tokens = Reference::open(name).ids("tokens");
        let full = model
            .forward(&mut model.new_state(), &tokens, Logits::All, None)
            .expect("full");
        let v = model.cfg.vocab_size;
        let mut cpu = CpuModel::new(&model, opts(SimdLevel::detect(), 2, 64)).expect("cpu");
        // Reference prefill, CPU decode.
        let mut st = model.new_state();
        model
            .forward(&mut st, &tokens[..12], Logits::None, None)
            .expect("prefill");
        for (i, &t) in tokens[12..].iter().enumerate() {
            let got = cpu
                .forward(&mut st, &[t], Logits::Last)
                .expect("step")
                .to_vec();
            let err = rel_l2(&got, &full[(12 + i) * v..(13 + i) * v]);
            assert!(err < 1e-5, "{name}: reference→cpu step {i}: {err:e}");
        }
        // CPU prefill, reference decode.
        let mut st = cpu.new_state(32);
        cpu.forward(&mut st, &tokens[..12], Logits::None)
            .expect("prefill");
        for (i, &t) in tokens[12..].iter().enumerate() {
            let got = model
                .forward(&mut st, &[t], Logits::Last, None)
                .expect("step");
            let err = rel_l2(&got, &full[(12 + i) * v..(13 + i) * v]);
            assert!(err < 1e-5, "{name}: cpu→reference step {i}: {err:e}");
        }
    }
}

#[test]
fn long_prompt_crossing_delta_chunks_matches_the_reference() {
    for name in ["next-f32", "qwen35-mixed"] {
        let model = Model::open(&fixture(name)).expect("open");
        let tokens = Reference::open(name).ids("tokens");
        let long: Vec<u32> = tokens.iter().cycle().take(150).copied().collect();
        let mut st_ref = model.new_state();
        let want = model
            .forward(&mut st_ref, &long, Logits::All, None)
            .expect("reference");
        for chunk in [150, 100] {
            let mut cpu = CpuModel::new(&model, opts(SimdLevel::detect(), 2, chunk)).expect("cpu");
            let mut st = cpu.new_state(8);
            let got = cpu
                .forward(&mut st, &long, Logits::All)
                .expect("cpu")
                .to_vec();
            let err = rel_l2(&got, &want);
            assert!(err < 1e-5, "{name} chunk {chunk}: rel L2 {err:e}");
            for (a, b) in st.layers.iter().zip(&st_ref.layers) {
                if let (LayerState::Linear { ssm: sa, .. }, LayerState::Linear { ssm: sb, .. }) =
                    (a, b)
                {
                    let err = rel_l2(sa, sb);
                    assert!(err < 1e-5, "{name} chunk {chunk}: state rel L2 {err:e}");
                }
            }
        }
    }
}

#[test]
fn bad_tokens_and_foreign_states_are_errors() {
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let mut cpu = CpuModel::new(&model, opts(SimdLevel::detect(), 1, 8)).expect("cpu");
    let mut st = cpu.new_state(8);
    assert!(cpu.forward(&mut st, &[], Logits::Last).is_err());
    assert!(cpu.forward(&mut st, &[u32::MAX], Logits::Last).is_err());
    let other = Model::open(&fixture("next-q4")).expect("open");
    let mut foreign = other.new_state();
    assert!(cpu.forward(&mut foreign, &[1], Logits::Last).is_err());
}

/// An expert source that holds at most two experts at once, like a small streaming cache.
#[derive(Debug)]
struct SmallCache(Box<dyn ExpertSource>);

impl ExpertSource for SmallCache {
    fn fetch(&self, layer: usize, ids: &[usize]) -> brook_core::Result<Vec<ExpertHandle>> {
        assert!(ids.len() <= 2, "fetched {} experts at once", ids.len());
        self.0.fetch(layer, ids)
    }
    fn capacity(&self) -> usize {
        2
    }
}

#[test]
fn output_identical_across_expert_cache_sizes() {
    let name = "qwen35-q4";
    let mut model = Model::open(&fixture(name)).expect("open");
    let tokens = Reference::open(name).ids("tokens");
    let run = |model: &Model| {
        let mut cpu = CpuModel::new(model, opts(SimdLevel::detect(), 2, 8)).expect("cpu");
        let mut st = cpu.new_state(32);
        let mut out = cpu
            .forward(&mut st, &tokens, Logits::All)
            .expect("prefill")
            .to_vec();
        out.extend_from_slice(cpu.forward(&mut st, &[3], Logits::Last).expect("step"));
        out
    };
    let want = run(&model);
    let experts = std::mem::replace(&mut model.experts, Box::new(ResidentExperts::default()));
    model.experts = Box::new(SmallCache(experts));
    let got = run(&model);
    assert!(
        rel_l2(&got, &want) < 1e-6,
        "rel L2 {:e}",
        rel_l2(&got, &want)
    );
}
