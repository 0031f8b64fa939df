//! Steps of several sequences on the GPU (issue #32): each vector, token and sequence keeps
//! the bits it gets alone, from the kernels up to whole steps through the driver.

use super::*;
use brook_core::engine::{Forward, Part};
use common::batch::{CHUNK, assert_same_bits, run};

pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
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
        let tokens = 5;
        // Tokens share experts, some three or four ways (the grouped kernels pair a shared
        // expert's picks two at a time; the fifth token's shared expert is alone); the gates
        // sit 5 floats apart.
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
        let all = MoeIn {
            k,
            tokens,
            x: xd.ptr,
            sel: seld.ptr,
            wts: wd.ptr,
            sg: sgd.ptr,
            sgs,
        };
        g.use_tensor_cores(true);
        let grouped = case.decode_grouped(&g, all);
        assert_eq!(
            grouped.is_some(),
            tc_shapes,
            "the grouped kernels take tensor-core shapes"
        );
        for tc in [true, false] {
            g.use_tensor_cores(tc);
            let got = case.decode(&g, all);
            for t in 0..tokens {
                let one = |b: &brook_cuda::gpu::DevBuf, n: usize| b.ptr + (t * n * 4) as u64;
                let alone = MoeIn {
                    k,
                    tokens: 1,
                    x: one(&xd, h),
                    sel: one(&seld, k),
                    wts: one(&wd, k),
                    sg: one(&sgd, sgs),
                    sgs: 0,
                };
                let want = case.decode(&g, alone);
                assert!(
                    same_bits(&got[t * h..(t + 1) * h], &want),
                    "{bits}-bit g{group} tc {tc}: token {t} differs from its own launch"
                );
                if let Some(grouped) = grouped.as_ref().filter(|_| tc) {
                    assert!(
                        same_bits(&grouped[t * h..(t + 1) * h], &want),
                        "{bits}-bit g{group}: token {t} grouped differs from its own launch"
                    );
                }
            }
        }
    }
    g.use_tensor_cores(true);
}

/// A CUDA engine for `seqs` sequences a step, chunks of [`CHUNK`], each of at most 32 tokens
/// a token at a time (joining the other sequences' batched steps: batch.rs `step_rounds`).
pub(crate) fn cuda_seqs(model: &Arc<Model>, seqs: usize) -> CudaModel {
    CudaModel::new(
        model.clone(),
        CudaOptions {
            max_chunk: CHUNK,
            context: 64,
            max_seqs: seqs,
            small_chunk: 32,
            ..Default::default()
        },
    )
    .expect("cuda model")
}

/// Random weights whose every dense matrix and expert takes the tensor-core kernels (widths
/// of 512, 4-bit groups of 64 with bf16 scales).
pub(crate) fn tensor_core_model(dir: &std::path::Path) -> Arc<Model> {
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
            // The experts grouped (grouped.rs, where the kernels take the shapes) with graphs,
            // a token at a time without.
            cuda.grouped = graphs;
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
        let mut cuda = cuda_seqs(model, 4);
        cuda.grouped = true;
        let mut fw = Forward::new(cuda);
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
                    small_chunk: 32,
                    expert_slots: Some(total / 2),
                    host_budget: Some(64 << 30),
                    ..Default::default()
                },
            )
            .expect("mapped")
        };
        let mut mapped = open_mapped(4);
        mapped.grouped = true;
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
