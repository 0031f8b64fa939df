//! Whole models on the GPU: the fixtures' logits and greedy tokens, every GPU cache size,
//! replayed routing (part of the `gpu` test target).

use super::*;

/// A CUDA engine whose chunks of any length run the tiled prefill kernels (the one-token
/// path for small chunks is tested on its own).
fn cuda(model: &Arc<Model>, slots: Option<usize>, chunk: usize) -> CudaModel {
    cuda_small(model, slots, chunk, 0)
}

fn cuda_small(model: &Arc<Model>, slots: Option<usize>, chunk: usize, small: usize) -> CudaModel {
    CudaModel::new(
        model.clone(),
        CudaOptions {
            expert_slots: slots,
            max_chunk: chunk,
            context: 256,
            small_chunk: small,
            ..Default::default()
        },
    )
    .expect("cuda model")
}

/// A CUDA engine with chunks of 16 (none run a token at a time) on the tiers asked for:
/// `slots` expert slots (None: as many as the budget holds), `host` a host budget for mapped
/// experts (None: the rest stream a layer at a time).
fn cuda_tiers(
    model: &Arc<Model>,
    slots: Option<usize>,
    host: Option<u64>,
    context: usize,
) -> CudaModel {
    CudaModel::new(
        model.clone(),
        CudaOptions {
            expert_slots: slots,
            max_chunk: 16,
            context,
            small_chunk: 0,
            host_budget: host,
            ..Default::default()
        },
    )
    .expect("cuda model")
}

#[test]
fn fixtures_logits_and_greedy_tokens_match_on_the_gpu() {
    if gpu().is_none() {
        return;
    }
    for name in MODELS {
        let model = Arc::new(Model::open(&fixture(name)).expect("open"));
        let r = Reference::open(name);
        let tokens = r.ids("tokens");
        let want_mlx = r.f32("logits");
        let want_ref = model
            .forward(&mut model.new_state(), &tokens, Logits::All, None)
            .expect("reference");
        // Chunks of 7 through the tiled kernels, then one token at a time (small chunks).
        for (chunk, small) in [(256, 0), (7, 0), (7, 32)] {
            let mut g = cuda_small(&model, None, chunk, small);
            let mut st = model.new_state();
            let got = g
                .forward(&mut st, &tokens, Logits::All)
                .expect("gpu")
                .to_vec();
            let e_mlx = rel_l2(&got, &want_mlx);
            let e_ref = rel_l2(&got, &want_ref);
            eprintln!(
                "{name} chunk {chunk} (small {small}): vs mlx-lm {e_mlx:.2e}, vs reference {e_ref:.2e}"
            );
            assert!(e_mlx < 1e-4, "{name}: {e_mlx}");
            assert!(e_ref < 2e-5, "{name}: {e_ref}");
        }
        // Greedy decoding, one token at a time after the prompt.
        let want_ids = r.ids("greedy");
        let mut g = cuda(&model, None, 256);
        let mut st = model.new_state();
        let prompt = r.ids("tokens");
        let mut logits = g
            .forward(&mut st, &prompt, Logits::Last)
            .expect("prefill")
            .to_vec();
        let mut got_ids = Vec::new();
        for _ in 0..want_ids.len() {
            let next = argmax(&logits);
            got_ids.push(next);
            logits = g
                .forward(&mut st, &[next], Logits::Last)
                .expect("decode")
                .to_vec();
        }
        assert_eq!(got_ids, want_ids, "{name}: greedy tokens");
    }
}

#[test]
fn output_is_identical_for_every_gpu_cache_size() {
    if gpu().is_none() {
        return;
    }
    for name in ["next-q4", "qwen35-mixed"] {
        let model = Arc::new(Model::open(&fixture(name)).expect("open"));
        let cfg = &model.cfg;
        let total = cfg.num_hidden_layers * cfg.num_experts;
        let tokens = Reference::open(name).ids("tokens");
        // `host`: a host budget for mapped experts (None: they stream a layer at a time).
        let run = |slots: Option<usize>, graphs: bool, host: Option<u64>, prefetch: bool| {
            let mut g = cuda_tiers(&model, slots, host, 256);
            g.graphs = graphs;
            g.prefetch = prefetch;
            let mut st = model.new_state();
            let mut out = g
                .forward(&mut st, &tokens, Logits::All)
                .expect("prefill")
                .to_vec();
            for &t in &tokens[..4] {
                out.extend_from_slice(g.forward(&mut st, &[t], Logits::Last).expect("decode"));
            }
            let stats = g.cache_stats().expect("stats");
            (out, stats, g.experts.resident, g.experts.mapped)
        };
        let (all, _, resident, _) = run(None, true, None, false);
        assert!(resident, "the default budget holds a fixture's experts");
        let (plain, _, _, _) = run(None, false, None, false);
        let same = |got: &[f32]| {
            got.iter()
                .zip(&all)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        };
        assert!(
            same(&plain),
            "{name}: decoding through CUDA graphs changed the output"
        );
        for slots in [cfg.num_experts_per_tok, total / 2, total] {
            let (got, stats, _, _) = run(Some(slots), true, None, false);
            assert!(same(&got), "{name}: {slots} slots changed the output");
            if slots < total {
                assert!(stats.misses > 0 && stats.bytes > 0, "{name}: {stats:?}");
            }
            // The experts without a slot in mapped host memory, graphs on and off, the
            // prefetch of guessed experts on and off.
            for (graphs, prefetch) in [(true, false), (false, false), (true, true), (false, true)] {
                let (got, stats, _, mapped) = run(Some(slots), graphs, Some(64 << 30), prefetch);
                assert_eq!(mapped, total - slots, "{name}: {slots} slots, mapped");
                assert!(
                    same(&got),
                    "{name}: {slots} slots and mapped host experts (graphs {graphs}, prefetch {prefetch}) changed the output"
                );
                if slots < total {
                    assert!(stats.misses > 0 && stats.bytes > 0, "{name}: {stats:?}");
                }
                if slots == total / 2 {
                    assert!(stats.hits > 0, "{name}: {stats:?}");
                }
                assert!(stats.prefetch_used <= stats.misses, "{name}: {stats:?}");
                // The picks' own bytes within those copied (a prefetch's wrong guesses are
                // the rest).
                assert!(stats.needed <= stats.bytes, "{name}: {stats:?}");
                if !prefetch {
                    assert_eq!(stats.prefetch_used, 0, "{name}: {stats:?}");
                    assert_eq!(stats.needed, stats.bytes, "{name}: {stats:?}");
                }
            }
        }
        // A host budget too small for the rest streams them instead.
        let (got, _, _, mapped) = run(Some(total / 2), true, Some(0), false);
        assert_eq!(mapped, 0);
        assert!(same(&got), "{name}: streamed after a small host budget");
    }
}

/// A routing trace's tokens from `at` on, given to a call's tokens in order.
struct FromTrace<'a>(&'a brook_core::routing::RoutingTrace, usize);

impl brook_core::engine::GivenRoutes for FromTrace<'_> {
    fn experts(&self, _seq: usize, token: usize, layer: usize) -> Option<&[u32]> {
        Some(self.0.experts(self.1 + token, layer))
    }
}

/// `tokens` through `engine` with the trace's routes from `at`, in one call.
fn replayed(
    engine: &mut dyn brook_core::engine::Engine,
    st: &mut brook_core::model::state::SeqState,
    tokens: &[u32],
    trace: &brook_core::routing::RoutingTrace,
    at: usize,
    want: Logits,
) -> Vec<f32> {
    use brook_core::engine::Routing;
    use brook_core::engine::driver::{Call, drive};
    let given = FromTrace(trace, at);
    let call = Call {
        state: st,
        tokens,
        want,
        routing: Routing::Given(&given),
        trace: None,
        context: usize::MAX,
    };
    let mut out = Vec::new();
    drive(engine, call, &mut out).expect("replayed step");
    out
}

#[test]
fn a_replayed_routing_gives_the_cpus_logits_on_the_gpu_resident_and_streamed() {
    if gpu().is_none() {
        return;
    }
    use brook_core::cpu::{CpuModel, CpuOptions};
    use brook_core::routing::simulate::{SimParams, simulate};
    for name in MODELS {
        let model = Arc::new(Model::open(&fixture(name)).expect("open"));
        let cfg = model.cfg.clone();
        let (layers, e, k) = (
            cfg.num_hidden_layers,
            cfg.num_experts,
            cfg.num_experts_per_tok,
        );
        let trace = simulate(layers, e, k, 24, SimParams::WEAK, 3).expect("simulate");
        let tokens = Reference::open(name).ids("tokens");
        // A 9-token chunk in steps of 4 (the driver shifts the given routes), then 6 tokens
        // one at a time, all replayed.
        let run = |engine: &mut dyn brook_core::engine::Engine| {
            let mut st = model.new_state();
            let mut out = replayed(engine, &mut st, &tokens[..9], &trace, 0, Logits::All);
            for (i, &t) in tokens[..6].iter().enumerate() {
                out.extend(replayed(engine, &mut st, &[t], &trace, 9 + i, Logits::Last));
            }
            out
        };
        let mut cpu = CpuModel::new_shared(
            model.clone(),
            CpuOptions {
                max_chunk: 4,
                ..Default::default()
            },
        )
        .expect("cpu");
        let want = run(&mut cpu);
        let streamed = [None, Some(k), Some(layers * k)].map(|s| (s, None));
        let mapped = (Some(layers * k), Some(64u64 << 30));
        for (slots, host) in streamed.into_iter().chain([mapped]) {
            let mut g = CudaModel::new(
                model.clone(),
                CudaOptions {
                    expert_slots: slots,
                    max_chunk: 4,
                    context: 256,
                    small_chunk: 0,
                    host_budget: host,
                    ..Default::default()
                },
            )
            .expect("cuda model");
            assert_eq!(g.experts.mapped > 0, host.is_some());
            let got = run(&mut g);
            let err = rel_l2(&got, &want);
            eprintln!(
                "{name}, {slots:?} slots, host {host:?}: replayed logits vs the CPU {err:.2e}"
            );
            assert!(err < 2e-5, "{name} {slots:?}: {err}");
            if slots.is_some() {
                let s = g.cache_stats().expect("stats");
                assert!(s.misses > 0, "{name}: streamed experts were read");
            }
        }
        // The router's own logits differ: the replay is not ignored.
        let mut g = cuda(&model, None, 4);
        let mut st = model.new_state();
        let plain = g
            .forward(&mut st, &tokens[..9], Logits::All)
            .expect("plain")
            .to_vec();
        assert!(rel_l2(&plain, &want[..plain.len()]) > 1e-3, "{name}");
    }
}

/// A prefill chunk whose matrices all take the tensor cores: the dense products through the
/// one-token kernels for each token and the routed experts grouped by expert
/// (`CudaModel::prefill_tc`, kernels/tensor_n.cu `qmm_tcn8`) match the reference pass as the
/// tiled kernels do, and give the same bits with the experts resident, streamed or mapped.
#[test]
fn prefill_on_the_tensor_cores_matches_the_reference_on_every_tier() {
    if gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let model = super::batch::tensor_core_model(dir.path());
    let cfg = &model.cfg;
    let total = cfg.num_hidden_layers * cfg.num_experts;
    let vocab = cfg.vocab_size as u64;
    let mut rng = Rng::new(7);
    // Three chunks of 16 and one of 8: experts with one pair and with more than eight.
    let tokens: Vec<u32> = (0..56).map(|_| (rng.next_u64() % vocab) as u32).collect();
    let want = model
        .forward(&mut model.new_state(), &tokens, Logits::All, None)
        .expect("reference");
    let run = |slots: Option<usize>, host: Option<u64>, tc: bool| {
        let mut g = cuda_tiers(&model, slots, host, 64);
        g.prefill_tc = tc;
        let mut st = model.new_state();
        let out = g
            .forward(&mut st, &tokens, Logits::All)
            .expect("prefill")
            .to_vec();
        (out, g.experts.resident, g.experts.mapped)
    };
    let (tiles, resident, _) = run(None, None, false);
    assert!(resident, "the default budget holds the experts");
    let (tc, _, _) = run(None, None, true);
    let (e_tiles, e_tc) = (rel_l2(&tiles, &want), rel_l2(&tc, &want));
    eprintln!("prefill against the reference: tiles {e_tiles:.2e}, tensor cores {e_tc:.2e}");
    assert!(e_tiles < 2e-5, "tiles: {e_tiles:.2e}");
    assert!(e_tc < 2e-5, "tensor cores: {e_tc:.2e}");
    assert!(
        !super::batch::same_bits(&tiles, &tc),
        "the tensor-core path did not run"
    );
    for slots in [cfg.num_experts_per_tok, total / 2] {
        for host in [None, Some(64u64 << 30)] {
            let (got, resident, mapped) = run(Some(slots), host, true);
            assert!(!resident);
            assert_eq!(mapped > 0, host.is_some(), "{slots} slots, host {host:?}");
            assert!(
                super::batch::same_bits(&tc, &got),
                "{slots} slots, host {host:?}: the prefill's bits changed"
            );
        }
    }
}

/// A new sequence after an ended one takes the ended one's buffers and decode graph back,
/// cleared: its logits are bit for bit those of a state uploaded from the host. A copy made
/// into kept buffers continues as its original does, and kept buffers give way to an
/// allocation that needs their room.
#[test]
fn ended_sequences_states_are_reused_cleared_and_give_way() {
    use brook_core::engine::Engine;
    use brook_core::model::state::SeqState;
    if gpu().is_none() {
        return;
    }
    let name = MODELS[0];
    let model = Arc::new(Model::open(&fixture(name)).expect("open"));
    let prompt = Reference::open(name).ids("tokens");
    let v = model.cfg.vocab_size;
    let mut g = CudaModel::new(
        model.clone(),
        CudaOptions {
            context: 256,
            gpu_memory_budget: Some(1 << 30),
            ..Default::default()
        },
    )
    .expect("cuda model");
    // The prompt, then six greedy tokens through the decode graph: every row of logits.
    let run = |g: &mut CudaModel, st: &mut SeqState, tokens: &[u32]| -> Vec<f32> {
        let mut all = g
            .forward(st, tokens, Logits::All)
            .expect("prefill")
            .to_vec();
        for _ in 0..6 {
            let next = argmax(&all[all.len() - v..]);
            let l = g.forward(st, &[next], Logits::Last).expect("decode");
            all.extend_from_slice(l);
        }
        all
    };
    let want = run(&mut g, &mut model.new_state(), &prompt);
    let mut st = g.new_state(0);
    assert!(st.device.is_some(), "a new state starts on the GPU");
    assert!(
        run(&mut g, &mut st, &prompt) == want,
        "a new state on the GPU"
    );
    drop(st);
    let used = g.gpu.used();
    let mut st = g.new_state(0);
    assert_eq!(
        g.gpu.used(),
        used,
        "the ended sequence's buffers are taken back"
    );
    assert!(
        run(&mut g, &mut st, &prompt) == want,
        "kept buffers are cleared"
    );

    // A copy into kept buffers continues as its original.
    let mut a = g.new_state(0);
    g.forward(&mut a, &prompt, Logits::Last).expect("prefill");
    drop(st);
    let used = g.gpu.used();
    let mut b = a.clone();
    assert_eq!(g.gpu.used(), used, "the copy went into the kept buffers");
    let (ra, rb) = (run(&mut g, &mut a, &[7, 8]), run(&mut g, &mut b, &[7, 8]));
    assert!(ra == rb, "the copy continues as its original");

    // Kept buffers give way: an allocation past what the budget leaves them succeeds.
    drop(b);
    let over = (g.gpu.budget - g.gpu.used() + 1) as usize;
    let big = g
        .gpu
        .alloc(over, "a test's buffer")
        .expect("kept buffers let go");
    let host = g.new_state(0);
    assert!(
        host.device.is_none(),
        "no room: a new state starts on the host"
    );
    drop(big);
    let mut host = host;
    assert!(
        run(&mut g, &mut host, &prompt) == want,
        "a host state uploaded"
    );
}

/// A sequence's decode graph, captured over the engine's logits buffer, is captured again
/// once another call's rows of logits have replaced that buffer with a larger one: the
/// sequence goes on as its copy (whose graph is captured after) does.
#[test]
fn decode_graphs_follow_a_replaced_logits_buffer() {
    use brook_core::engine::Engine;
    if gpu().is_none() {
        return;
    }
    let name = MODELS[0];
    let model = Arc::new(Model::open(&fixture(name)).expect("open"));
    let prompt = Reference::open(name).ids("tokens");
    let mut g = cuda(&model, None, 64);
    let mut a = g.new_state(0);
    g.forward(&mut a, &prompt, Logits::Last).expect("prefill");
    let mut b = a.clone();
    let first = g
        .forward(&mut a, &[7], Logits::Last)
        .expect("decode")
        .to_vec();
    // Every row of another prompt: the logits buffer grows (a new allocation).
    let mut c = g.new_state(0);
    let rows = g.forward(&mut c, &prompt, Logits::All).expect("all rows");
    assert_eq!(rows.len(), prompt.len() * model.cfg.vocab_size);
    let went_on = g
        .forward(&mut a, &[8], Logits::Last)
        .expect("decode")
        .to_vec();
    assert!(
        g.forward(&mut b, &[7], Logits::Last).expect("copy") == first,
        "the copy's first token"
    );
    let copy = g
        .forward(&mut b, &[8], Logits::Last)
        .expect("copy")
        .to_vec();
    assert!(went_on == copy, "a graph over the old buffer was replayed");
}
