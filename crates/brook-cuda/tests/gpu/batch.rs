//! Steps of several sequences on the GPU (issue #32): each vector, token and sequence keeps
//! the bits it gets alone, from the kernels up to whole steps through the driver.

use super::*;
use brook_core::engine::{Forward, Part};
use common::batch::{CHUNK, assert_same_bits, run};

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn dense_products_of_several_vectors_give_each_its_own_bits() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(23);
    // The first two take the tensor cores (asserted), the others the CUDA cores.
    let formats = [
        (4, 64, DType::BF16),
        (4, 128, DType::F16),
        (4, 32, DType::BF16),
        (8, 64, DType::BF16),
    ];
    for (n, (bits, group, float)) in formats.into_iter().enumerate() {
        let fmt = Format::Affine { bits, group, float };
        // A stack of four (as the DeltaNet projections), one tall matrix (a head), one wide
        // (an output projection: the eight-vector kernel's largest shared memory).
        let shapes: [&[usize]; 3] = [&[48, 16, 32, 16], &[272], &[64]];
        for (rows, cols) in shapes.into_iter().zip([1024, 2048, 4096]) {
            let lins: Vec<_> = rows
                .iter()
                .map(|&r| random_linear(&mut rng, r, cols, fmt))
                .collect();
            let up: Vec<_> = lins
                .iter()
                .map(|l| upload_linear(&g, &l.view(), "m").expect("upload"))
                .collect();
            let mut m = [Mat::NONE; 4];
            for (d, (u, _)) in m.iter_mut().zip(&up) {
                *d = *u;
            }
            assert_eq!(n < 2, m.iter().all(|m| ops::tc_fits(m, 16)), "{fmt:?}");
            let total: usize = rows.iter().sum();
            for nvec in [2usize, 3, 8, 9, 16, 24] {
                let x = rng.vec(nvec * cols, 1.0);
                let xd = g.upload(&x, "x").expect("x");
                for tc in [true, false] {
                    g.use_tensor_cores(tc);
                    let yd = g.upload(&vec![f32::NAN; nvec * total], "y").expect("y");
                    ops::qmv_stacked_n(&g, m, nvec, xd.ptr, yd.ptr).expect("launch");
                    let got: Vec<f32> = yd.read().expect("read");
                    for v in 0..nvec {
                        let xv = g.upload(&x[v * cols..(v + 1) * cols], "x").expect("x");
                        let yv = g.upload(&vec![f32::NAN; total], "y").expect("y");
                        ops::qmv_stacked(&g, m, xv.ptr, yv.ptr).expect("launch");
                        let want: Vec<f32> = yv.read().expect("read");
                        assert!(
                            same_bits(&got[v * total..(v + 1) * total], &want),
                            "{fmt:?} rows {rows:?} x {cols}, {nvec} vectors, tc {tc}: vector {v} differs from its own launch"
                        );
                    }
                }
            }
        }
    }
    g.use_tensor_cores(true);
}

#[test]
fn moe_kernels_for_several_tokens_give_each_its_own_bits() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(29);
    // The first takes the tensor-core kernels, the second the CUDA cores' (asserted).
    for (tc_shapes, (bits, group, h, i, is, k)) in [
        (true, (4, 64, 512, 512, 512, 8)),
        (false, (4, 32, 256, 512, 256, 6)),
    ] {
        let fmt = Format::Affine {
            bits,
            group,
            float: DType::BF16,
        };
        let case = MoeCase::new(&g, &mut rng, fmt, h, i, is);
        let (sm, e) = (case.sm, case.experts.len());
        let [pg, _, pd] = &case.placed;
        assert_eq!(
            tc_shapes,
            ops::tc_fits(&pd.mat, 16) && ops::tc_fits(&pg.mat, 8)
        );
        assert!(ops::moe_down_fits(&pd.mat, &sm[2], k));
        let tokens = 3;
        // Token 1 shares experts with token 0; the gates sit 5 floats apart.
        let sel: Vec<i32> = (0..tokens as i32)
            .flat_map(|t| (0..k as i32).map(move |j| (t * 3 + j * 2) % e as i32))
            .collect();
        let wts = rng.vec(tokens * k, 1.0);
        let sgs = 5;
        let sg = rng.vec(tokens * sgs, 1.0);
        let x = rng.vec(tokens * h, 1.0);
        let (xd, seld, wd, sgd) = (
            g.upload(&x, "x").expect("x"),
            g.upload(&sel, "sel").expect("sel"),
            g.upload(&wts, "wts").expect("wts"),
            g.upload(&sg, "sg").expect("sg"),
        );
        for tc in [true, false] {
            g.use_tensor_cores(tc);
            let got = case.decode(&g, k, tokens, xd.ptr, seld.ptr, wd.ptr, sgd.ptr, sgs);
            for t in 0..tokens {
                let one = |b: &brook_cuda::gpu::DevBuf, n: usize| b.ptr + (t * n * 4) as u64;
                let want = case.decode(
                    &g,
                    k,
                    1,
                    one(&xd, h),
                    one(&seld, k),
                    one(&wd, k),
                    one(&sgd, sgs),
                    0,
                );
                assert!(
                    same_bits(&got[t * h..(t + 1) * h], &want),
                    "{bits}-bit g{group} tc {tc}: token {t} differs from its own launch"
                );
            }
        }
    }
    g.use_tensor_cores(true);
}

/// A CUDA engine for `seqs` sequences a step, chunks of [`CHUNK`].
fn cuda_seqs(model: &Arc<Model>, seqs: usize) -> CudaModel {
    CudaModel::new(
        model.clone(),
        CudaOptions {
            max_chunk: CHUNK,
            context: 64,
            max_seqs: seqs,
            ..Default::default()
        },
    )
    .expect("cuda model")
}

/// Random weights whose every dense matrix and expert takes the tensor-core kernels (widths
/// of 512, 4-bit groups of 64 with bf16 scales).
fn tensor_core_model(dir: &std::path::Path) -> Arc<Model> {
    use brook_core::container::repack::repack;
    use brook_core::synth::{SynthModel, preset_config};
    let mut cfg = preset_config("tiny").expect("tiny");
    let t = &mut cfg["text_config"];
    for (key, v) in [
        ("hidden_size", 512),
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 4),
        ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128),
        ("num_attention_heads", 4),
        ("head_dim", 128),
        ("moe_intermediate_size", 512),
        ("shared_expert_intermediate_size", 512),
    ] {
        t[key] = serde_json::json!(v);
    }
    let store = SynthModel::from_config("tiny", cfg, 4, 5).expect("synth");
    let out = dir.join("c");
    repack(&store.repack_source(), &out, &mut |_| {}).expect("repack");
    Arc::new(Model::open(&out).expect("open"))
}

#[test]
fn cuda_steps_of_several_sequences_give_each_its_own_bits() {
    if gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let mut models: Vec<(String, Arc<Model>)> =
        ["qwen35-q4", "next-q4", "qwen35-mixed", "next-f32"]
            .iter()
            .map(|n| {
                (
                    n.to_string(),
                    Arc::new(Model::open(&fixture(n)).expect("open")),
                )
            })
            .collect();
    models.push(("tensor-core shapes".into(), tensor_core_model(dir.path())));
    for (name, model) in &models {
        for graphs in [true, false] {
            let mut cuda = cuda_seqs(model, 4);
            cuda.graphs = graphs;
            assert_eq!(brook_core::engine::Engine::caps(&cuda).max_seqs, 4);
            let mut fw = Forward::new(cuda);
            eprintln!("{name} graphs {graphs}: alone");
            let alone = run(&mut fw, false);
            let steps = fw.stats().steps;
            eprintln!("{name} graphs {graphs}: together");
            let together = run(&mut fw, true);
            assert_same_bits(&alone, &together, &format!("{name} graphs {graphs}"));
            assert!(fw.stats().steps - steps < steps, "{:?}", fw.stats());
            let batched = fw.gpu_stats().expect("gpu stats").batched_steps;
            assert!(batched >= 5, "{name}: {batched} batched steps");
        }
        // A one-sequence engine gives the same bits too.
        let mut fw = Forward::new(cuda_seqs(model, 1));
        let single = run(&mut fw, false);
        let mut fw = Forward::new(cuda_seqs(model, 4));
        let together = run(&mut fw, true);
        assert_same_bits(&single, &together, &format!("{name} against max_seqs 1"));
        // Half the experts in mapped host memory: batched steps gather theirs to the GPU.
        let total = model.cfg.num_hidden_layers * model.cfg.num_experts;
        let open_mapped = |max_seqs: usize| {
            CudaModel::new(
                model.clone(),
                CudaOptions {
                    max_chunk: CHUNK,
                    context: 64,
                    max_seqs,
                    expert_slots: Some(total / 2),
                    host_budget: Some(64 << 30),
                    ..Default::default()
                },
            )
            .expect("mapped")
        };
        let mapped = open_mapped(4);
        assert_eq!(mapped.experts.mapped, total - total / 2, "{name}");
        let mut fw = Forward::new(mapped);
        let got = run(&mut fw, true);
        assert_same_bits(&single, &got, &format!("{name} with mapped experts"));
        assert!(fw.gpu_stats().expect("gpu stats").batched_steps >= 5);
        // One sequence at a time, mapped: each one-token step's products run beside their
        // gather and wait on its flags (routing.cu `gather_ready`, at tensor-core shapes),
        // graphs on and off.
        for graphs in [true, false] {
            let mut mapped = open_mapped(1);
            mapped.graphs = graphs;
            let mut fw = Forward::new(mapped);
            let got = run(&mut fw, false);
            assert_same_bits(
                &single,
                &got,
                &format!("{name} with mapped experts, one sequence, graphs {graphs}"),
            );
        }
    }
}

#[test]
fn too_many_sequences_for_the_gpu_budget_is_a_clear_error() {
    if gpu().is_none() {
        return;
    }
    let model = Arc::new(Model::open(&fixture("qwen35-q4")).expect("open"));
    let open = |seqs: usize| {
        CudaModel::new(
            model.clone(),
            CudaOptions {
                gpu_memory_budget: Some(2 << 30),
                context: 100_000,
                max_seqs: seqs,
                ..Default::default()
            },
        )
    };
    // One state of 100,000 positions fits in 2 GiB; 64 do not.
    assert!(brook_cuda::state::DeviceSeq::bytes(&model.cfg, 100_000) < 1 << 30);
    open(1).expect("one sequence");
    let e = open(64).expect_err("64 sequences").to_string();
    assert!(
        e.contains("64 sequences") && e.contains("--parallel"),
        "{e}"
    );
    let e = open(0).expect_err("no sequence").to_string();
    assert!(e.contains("1 to 64 sequences"), "{e}");
}

/// Decoding deep into the context splits each head's positions over blocks (kernels/
/// mixers.cu `attention_dec`): at 4,500 positions 29 of the 32 splits hold positions, two
/// tiles of 128 each; at 300, ten splits of 32. Each decoded token's logits match the
/// reference pass, and the two sequences in one step keep the bits each gets alone.
#[test]
fn long_context_decode_matches_the_reference_alone_and_together() {
    if gpu().is_none() {
        return;
    }
    let model = Arc::new(Model::open(&fixture("next-q4")).expect("open"));
    let vocab = model.cfg.vocab_size as u64;
    let mut rng = Rng::new(43);
    let prompts: Vec<Vec<u32>> = [4500usize, 300]
        .iter()
        .map(|&n| (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect())
        .collect();
    const STEPS: usize = 3;
    let open = || {
        CudaModel::new(
            model.clone(),
            CudaOptions {
                max_chunk: 256,
                context: 4608,
                max_seqs: 2,
                ..Default::default()
            },
        )
        .expect("cuda model")
    };
    // Alone, each step against the reference pass fed the same tokens.
    let mut fw = Forward::new(open());
    let mut alone = Vec::new();
    let mut states = Vec::new();
    for p in &prompts {
        let mut st = fw.new_state(0);
        let mut rst = model.new_state();
        let mut got = fw
            .forward(&mut st, p, Logits::Last)
            .expect("prefill")
            .to_vec();
        let mut want = model
            .forward(&mut rst, p, Logits::Last, None)
            .expect("reference");
        let mut steps = Vec::new();
        let start = st.clone();
        for i in 0..STEPS {
            let e = rel_l2(&got, &want);
            assert!(e < 2e-5, "{} positions, step {i}: {e:.2e}", p.len() + i);
            let next = argmax(&want);
            steps.push((next, got.clone()));
            got = fw
                .forward(&mut st, &[next], Logits::Last)
                .expect("decode")
                .to_vec();
            want = model
                .forward(&mut rst, &[next], Logits::Last, None)
                .expect("reference");
        }
        eprintln!("{} positions: decode matches the reference", p.len());
        alone.push((steps, got));
        states.push(start);
    }
    // Again from the states after the prompts: each alone (the same bits again), then both
    // in each step, with and without CUDA graphs.
    let mut bad = Vec::new();
    for (mode, together, graphs) in [
        ("alone again", false, true),
        ("together", true, true),
        ("together, no graphs", true, false),
    ] {
        let mut cuda = open();
        cuda.graphs = graphs;
        let mut fw = Forward::new(cuda);
        let mut sts = states.to_vec();
        let mut outs: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 2];
        for i in 0..STEPS {
            let tokens: Vec<[u32; 1]> = alone.iter().map(|(s, _)| [s[i].0]).collect();
            let groups: Vec<Vec<usize>> = if together {
                vec![vec![0, 1]]
            } else {
                vec![vec![0], vec![1]]
            };
            for g in groups {
                let mut got: Vec<Vec<f32>> = vec![Vec::new(); g.len()];
                let mut parts: Vec<Part<'_>> = sts
                    .iter_mut()
                    .enumerate()
                    .filter(|(z, _)| g.contains(z))
                    .zip(got.iter_mut())
                    .map(|((z, st), out)| Part {
                        state: st,
                        tokens: &tokens[z],
                        want: Logits::Last,
                        out,
                        result: Ok(()),
                    })
                    .collect();
                fw.step_parts(&mut parts);
                for p in parts {
                    p.result.expect("step");
                }
                for (z, o) in g.into_iter().zip(got) {
                    outs[z].push(o);
                }
            }
        }
        for (z, (steps, last)) in alone.iter().enumerate() {
            for i in 0..STEPS {
                let want = if i + 1 < STEPS { &steps[i + 1].1 } else { last };
                let got = &outs[z][i];
                if !same_bits(got, want) {
                    let d = got
                        .iter()
                        .zip(want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    eprintln!("{mode}: sequence {z}, step {i}: max |difference| {d:.3e}");
                    bad.push(format!("{mode}: sequence {z}, step {i}"));
                }
            }
        }
        if together {
            assert!(fw.gpu_stats().expect("gpu stats").batched_steps >= STEPS as u64);
        }
    }
    assert!(
        bad.is_empty(),
        "logits differ from the first run alone: {bad:?}"
    );
}

/// Greedy picks made on the GPU (`Logits::Best`): the kernel against the host's `argmax` on
/// rows built for its corner cases (ties, NaN, infinities, signed zeros, a maximum in the
/// last place), launched twice over the same buffers; then through the engine (a prompt's
/// chunk, one-token steps with and without graphs, batched steps) against the argmax of the
/// logits the same steps hand back.
#[test]
fn greedy_picks_on_the_gpu_are_the_argmax_of_the_logits() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(31);
    for v in [1usize, 31, 1000, 248_320] {
        let mut rows: Vec<Vec<f32>> = Vec::new();
        let mut random = |scale: f32| rng.vec(v, scale);
        rows.push(random(4.0));
        let mut r = random(1.0);
        r[v - 1] = 9.0;
        rows.push(r);
        let mut r = random(1.0);
        for i in [v / 2, v - 1, v / 3] {
            r[i] = 7.5;
        }
        rows.push(r);
        rows.push(vec![f32::NAN; v]);
        let mut r = vec![f32::NAN; v];
        r[v / 2] = f32::NEG_INFINITY;
        rows.push(r);
        let mut r = vec![-1.0f32; v];
        r[v - 1] = 0.0;
        r[v / 2] = -0.0;
        rows.push(r);
        let mut r = random(2.0);
        r[0] = f32::NAN;
        r[v / 4] = f32::INFINITY;
        rows.push(r);
        let flat: Vec<f32> = rows.concat();
        let n = rows.len();
        let d = g.upload(&flat, "logits").expect("upload");
        let part = g.zeros(n * ops::BEST_BLOCKS * 8, "part").expect("part");
        let count = g.zeros(n * 4, "count").expect("count");
        let out = g.zeros(n * 4, "out").expect("out");
        for round in 0..2 {
            ops::best_rows(&g, d.ptr, v, n, part.ptr, count.ptr, out.ptr).expect("launch");
            let mut got = vec![0u32; n];
            g.copy_out(out.ptr, &mut got).expect("read");
            let want: Vec<u32> = rows.iter().map(|r| brook_core::model::argmax(r)).collect();
            assert_eq!(got, want, "vocabulary {v}, launch {round}");
        }
    }

    for name in ["qwen35-q4", "next-q4"] {
        let model = Arc::new(Model::open(&fixture(name)).expect("open"));
        for graphs in [true, false] {
            let mut cuda = cuda_seqs(&model, 4);
            cuda.graphs = graphs;
            let mut fw = Forward::new(cuda);
            let prompts = common::batch::prompts();
            let mut states = Vec::new();
            let mut nexts = Vec::new();
            for p in &prompts {
                // The prompt in one call (its chunks), then three tokens one at a time.
                let mut st = fw.new_state(64);
                let mut st_best = st.clone();
                let last = fw
                    .forward(&mut st, p, Logits::Last)
                    .expect("prefill")
                    .to_vec();
                let best = fw
                    .forward(&mut st_best, p, Logits::Best)
                    .expect("prefill best");
                assert_eq!(Logits::best_id(best), argmax(&last), "{name}: prompt");
                let mut next = argmax(&last);
                for i in 0..3 {
                    let mut again = st.clone();
                    let best = fw.forward(&mut again, &[next], Logits::Best).expect("best");
                    let best = Logits::best_id(best);
                    let last = fw.forward(&mut st, &[next], Logits::Last).expect("last");
                    assert_eq!(best, argmax(last), "{name} graphs {graphs}: token {i}");
                    next = best;
                }
                states.push(st);
                nexts.push(next);
            }
            // A batched step: half the sequences ask for their pick, half for their logits,
            // then the other way round, from the same states.
            let mut picks = vec![None; 4];
            let mut logits = vec![None; 4];
            for flip in [false, true] {
                let mut sts = states.clone();
                let mut outs = vec![Vec::new(); 4];
                let ids: Vec<[u32; 1]> = nexts.iter().map(|&t| [t]).collect();
                let mut parts: Vec<Part<'_>> = sts
                    .iter_mut()
                    .zip(&mut outs)
                    .zip(&ids)
                    .enumerate()
                    .map(|(i, ((state, out), id))| Part {
                        state,
                        tokens: id,
                        want: if (i % 2 == 0) ^ flip {
                            Logits::Best
                        } else {
                            Logits::Last
                        },
                        out,
                        result: Ok(()),
                    })
                    .collect();
                fw.step_parts(&mut parts);
                assert!(parts.iter().all(|p| p.result.is_ok()));
                drop(parts);
                for (i, o) in outs.iter().enumerate() {
                    if o.len() == 1 {
                        picks[i] = Some(Logits::best_id(o));
                    } else {
                        logits[i] = Some(argmax(o));
                    }
                }
            }
            assert_eq!(picks, logits, "{name} graphs {graphs}: batched");
            assert!(picks.iter().all(|p| p.is_some()));
            assert!(
                fw.gpu_stats().expect("gpu stats").batched_steps >= 2,
                "{name}"
            );
        }
    }
}

/// The most likely candidates made on the GPU (`Logits::Top`): the kernels against the host's
/// `top_candidates` on rows of ties, NaN, infinities, signed zeros and too many equal values;
/// then through the engine (a prompt, one-token steps with and without graphs, a batched
/// step beside greedy and plain sequences), each pick against the same sampler's pick from
/// the logits of the same step.
#[test]
fn candidates_on_the_gpu_pick_what_the_logits_pick() {
    use brook_core::model::{TopWant, top_candidates};
    use brook_core::text::{Sampler, SamplingParams};
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(37);
    for v in [129usize, 1000, 4097, 248_320] {
        let mut rows: Vec<Vec<f32>> = vec![rng.vec(v, 5.0)];
        let mut r = rng.vec(v, 1.0);
        for i in (0..v).step_by(v / 50 + 1) {
            r[i] = 3.25;
        }
        r[v - 1] = f32::INFINITY;
        rows.push(r);
        let mut r = vec![f32::NAN; v];
        for i in (0..v).step_by(v / 20 + 1) {
            r[i] = (i % 3) as f32 - 1.0;
        }
        r[v / 2] = -0.0;
        r[v / 3] = f32::NEG_INFINITY;
        rows.push(r);
        rows.push(vec![f32::NAN; v]);
        rows.push(vec![0.5; v]);
        let flat: Vec<f32> = rows.concat();
        let n = rows.len();
        let d = g.upload(&flat, "logits").expect("upload");
        let keys = g.zeros(n * v.div_ceil(64) * 4, "keys").expect("keys");
        let out = g.zeros(n * ops::TOP_ROW * 4, "out").expect("out");
        ops::top_rows(&g, d.ptr, v, n, keys.ptr, out.ptr).expect("launch");
        let mut got = vec![0f32; n * ops::TOP_ROW];
        g.copy_out(out.ptr, &mut got).expect("read");
        let mut want = Vec::new();
        for (ri, (row, t)) in rows.iter().zip(got.chunks_exact(ops::TOP_ROW)).enumerate() {
            let whole = top_candidates(row, &mut want);
            let (m, c) = (t[128].to_bits() as usize, t[129].to_bits());
            if c == u32::MAX {
                // Only where more than the kernel's list reach the floor.
                assert!(
                    row.iter().filter(|x| **x == 0.5).count() > 4096,
                    "v {v} row {ri}"
                );
                continue;
            }
            let pairs: Vec<(f32, u32)> = t[..2 * m]
                .chunks_exact(2)
                .map(|p| (p[0], p[1].to_bits()))
                .collect();
            assert_eq!(pairs, want, "vocabulary {v}, row {ri}");
            let every = t[130].to_bits() == 1;
            assert_eq!(every && c as usize <= ops::TOP_K, whole, "v {v} row {ri}");
        }
    }

    let params = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.95,
        seed: 5,
        ..Default::default()
    };
    let tw = TopWant {
        k: 20,
        temperature: 0.8f32.to_bits(),
    };
    let top = Logits::Top(tw);
    let mut short = 0;
    for name in ["qwen35-q4", "next-q4"] {
        let model = Arc::new(Model::open(&fixture(name)).expect("open"));
        let v = model.cfg.vocab_size;
        let sampler = Sampler::new(params.clone(), v).expect("sampler");
        assert_eq!(sampler.want(), top);
        // The pick the sampler makes from a call's output, against its pick from the row.
        let check = |out: &[f32], row: &[f32], what: &str, short: &mut usize| {
            let (mut a, mut b) = (sampler.clone(), sampler.clone());
            let mut row = row.to_vec();
            let mut out = out.to_vec();
            if out.len() != v {
                *short += 1;
            }
            for d in 0..8 {
                assert_eq!(
                    a.pick(&mut out, v, &[]),
                    b.sample(&mut row, &[]),
                    "{name} {what}: draw {d}"
                );
            }
        };
        for graphs in [true, false] {
            let mut cuda = cuda_seqs(&model, 4);
            cuda.graphs = graphs;
            // Off by default until measured (`BROOK_CUDA_TOP`); this test checks it.
            cuda.tops = true;
            let mut fw = Forward::new(cuda);
            let mut states = Vec::new();
            let mut nexts = Vec::new();
            for p in &common::batch::prompts() {
                let mut st = fw.new_state(64);
                let mut st_top = st.clone();
                let last = fw
                    .forward(&mut st, p, Logits::Last)
                    .expect("prefill")
                    .to_vec();
                let got = fw
                    .forward(&mut st_top, p, top)
                    .expect("prefill top")
                    .to_vec();
                check(&got, &last, "prompt", &mut short);
                let mut next = argmax(&last);
                for i in 0..3 {
                    let mut again = st.clone();
                    let got = fw.forward(&mut again, &[next], top).expect("top").to_vec();
                    let last = fw.forward(&mut st, &[next], Logits::Last).expect("last");
                    check(
                        &got,
                        last,
                        &format!("graphs {graphs}, token {i}"),
                        &mut short,
                    );
                    next = argmax(last);
                }
                states.push(st);
                nexts.push(next);
            }
            // One batched step: candidates, a greedy pick, logits, candidates; then every
            // sequence's logits from the same states.
            let wants = [top, Logits::Best, Logits::Last, top];
            let mut outs: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 2];
            for (round, out) in outs.iter_mut().enumerate() {
                let mut sts = states.clone();
                *out = vec![Vec::new(); 4];
                let ids: Vec<[u32; 1]> = nexts.iter().map(|&t| [t]).collect();
                let mut parts: Vec<Part<'_>> = sts
                    .iter_mut()
                    .zip(out.iter_mut())
                    .zip(&ids)
                    .zip(wants)
                    .map(|(((state, out), id), want)| Part {
                        state,
                        tokens: id,
                        want: if round == 0 { want } else { Logits::Last },
                        out,
                        result: Ok(()),
                    })
                    .collect();
                fw.step_parts(&mut parts);
                assert!(parts.iter().all(|p| p.result.is_ok()));
            }
            for (i, want) in wants.iter().enumerate() {
                let (got, row) = (&outs[0][i], &outs[1][i]);
                match want {
                    Logits::Best => assert_eq!(Logits::best_id(got), argmax(row)),
                    Logits::Last => assert!(same_bits(got, row), "{name}: batched logits"),
                    _ => check(
                        got,
                        row,
                        &format!("graphs {graphs}, batched {i}"),
                        &mut short,
                    ),
                }
            }
        }
    }
    // The fixtures' rows are ordinary: the candidates decided them (none fell back to rows).
    assert!(short >= 30, "{short} calls handed back candidates");
}
