//! The CUDA backend against the CPU reference. Every test that needs a GPU prints why it
//! skips and passes where none is found (CI); `scripts/gpu-check.sh` runs them on a GPU.
//!
//! Tolerances: matrix kernels within 1e-5 relative L2 of `LinearRef::forward_rows` (f32
//! sums in another order; fused multiply-adds); whole-model logits within 1e-4 of mlx-lm's
//! fixtures (the Foundation bound) and 2e-5 of the reference pass, greedy tokens equal.

#[path = "../../brook-core/tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use brook_core::cpu::testutil::{Format, Rng, random_linear};
use brook_core::dtype::DType;
use brook_core::{Logits, Model};
use brook_cuda::gpu::Gpu;
use brook_cuda::weights::{Mat, upload_linear};
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
        for (rows, cols) in [(67, 384), (1, 128), (130, 768)] {
            let lin = random_linear(&mut rng, rows, cols, fmt);
            let (m, _buf) = upload_linear(&g, &lin.view(), "test").expect("upload");
            for t in [1usize, 3, 70] {
                let x = rng.vec(t * cols, 1.0);
                let mut want = vec![0.0f32; t * rows];
                lin.view().forward_rows(&x, &mut want);
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
                    let err = rel_l2(&got, &want);
                    assert!(
                        err < 1e-5,
                        "{fmt:?} {rows}x{cols} t={t} tiled={tiled}: rel err {err}"
                    );
                }
            }
        }
    }
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

fn cuda(model: &Arc<Model>, slots: Option<usize>, chunk: usize) -> CudaModel {
    CudaModel::new(
        model.clone(),
        CudaOptions {
            expert_slots: slots,
            max_chunk: chunk,
            context: 256,
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
        for chunk in [256, 7] {
            let mut g = cuda(&model, None, chunk);
            let mut st = model.new_state();
            let got = g
                .forward(&mut st, &tokens, Logits::All)
                .expect("gpu")
                .to_vec();
            let e_mlx = rel_l2(&got, &want_mlx);
            let e_ref = rel_l2(&got, &want_ref);
            eprintln!("{name} chunk {chunk}: vs mlx-lm {e_mlx:.2e}, vs reference {e_ref:.2e}");
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
        let run = |slots: Option<usize>, graphs: bool| {
            let mut g = cuda(&model, slots, 16);
            g.graphs = graphs;
            let mut st = model.new_state();
            let mut out = g
                .forward(&mut st, &tokens, Logits::All)
                .expect("prefill")
                .to_vec();
            for &t in &tokens[..4] {
                out.extend_from_slice(g.forward(&mut st, &[t], Logits::Last).expect("decode"));
            }
            (out, g.cache_stats(), g.experts.resident)
        };
        let (all, _, resident) = run(None, true);
        assert!(resident, "the default budget holds a fixture's experts");
        let (plain, _, _) = run(None, false);
        assert!(
            plain
                .iter()
                .zip(&all)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}: decoding through CUDA graphs changed the output"
        );
        for slots in [cfg.num_experts_per_tok, total / 2, total] {
            let (got, stats, _) = run(Some(slots), true);
            assert!(
                got.iter()
                    .zip(&all)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: {slots} slots changed the output"
            );
            if slots < total {
                assert!(stats.misses > 0 && stats.bytes > 0, "{name}: {stats:?}");
            }
        }
    }
}

#[test]
fn device_states_clone_download_and_continue_on_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let model = Arc::new(Model::open(&fixture("qwen35-q4")).expect("open"));
    let tokens = Reference::open("qwen35-q4").ids("tokens");
    let (a, b) = tokens.split_at(tokens.len() / 2);
    let mut g = cuda(&model, None, 256);
    let mut st = model.new_state();
    g.forward(&mut st, a, Logits::None).expect("gpu prefill");
    // A snapshot on the device, continued on the GPU; the original continued on the CPU.
    let mut snap = st.clone();
    let gpu_next = g.forward(&mut snap, b, Logits::Last).expect("gpu").to_vec();
    st.sync_host().expect("download");
    assert!(st.device.is_none());
    let cpu_next = model.forward(&mut st, b, Logits::Last, None).expect("cpu");
    let e = rel_l2(&gpu_next, &cpu_next);
    assert!(e < 2e-5, "GPU state continued on the CPU differs: {e}");
}

#[test]
fn a_full_context_is_an_error_not_a_crash() {
    if gpu().is_none() {
        return;
    }
    let model = Arc::new(Model::open(&fixture("next-q4")).expect("open"));
    let mut g = CudaModel::new(
        model.clone(),
        CudaOptions {
            context: 8,
            ..Default::default()
        },
    )
    .expect("cuda");
    let mut st = model.new_state();
    let e = g
        .forward(&mut st, &[1; 9], Logits::Last)
        .expect_err("9 tokens in a context of 8");
    assert!(e.to_string().contains("context"), "{e}");
}

#[test]
fn a_budget_too_small_names_the_minimum() {
    if gpu().is_none() {
        return;
    }
    let model = Arc::new(Model::open(&fixture("next-q4")).expect("open"));
    let e = CudaModel::new(
        model,
        CudaOptions {
            gpu_memory_budget: Some(64 << 10),
            ..Default::default()
        },
    )
    .expect_err("64 KiB");
    assert!(e.to_string().contains("budget"), "{e}");
}

/// Random weights at the real models' head sizes (DeltaNet heads of 128, attention heads of
/// 256), from a container streamed through a small host cache and a small GPU cache: every
/// kernel at those sizes, on random inputs, against the reference pass.
#[test]
fn real_head_sizes_from_a_streamed_container_match_the_reference() {
    use brook_core::container::repack::repack;
    use brook_core::model::open::OpenOptions;
    use brook_core::synth::{SynthStore, preset_config};
    if gpu().is_none() {
        return;
    }
    let mut cfg = preset_config("tiny").expect("tiny");
    let t = &mut cfg["text_config"];
    t["linear_key_head_dim"] = serde_json::json!(128);
    t["linear_value_head_dim"] = serde_json::json!(128);
    t["head_dim"] = serde_json::json!(256);
    let store = SynthStore::from_config("tiny", cfg, 4, 3).expect("synth");
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("c");
    repack(&store.repack_source(), &out, &mut |_| {}).expect("repack");
    let opts = OpenOptions {
        expert_cache: Some(32),
        ..Default::default()
    };
    let model = Arc::new(Model::open_with(&out, &opts).expect("open"));
    let mut rng = Rng::new(11);
    let tokens: Vec<u32> = (0..70).map(|_| (rng.next_u64() % 4096) as u32).collect();
    let want = model
        .forward(&mut model.new_state(), &tokens, Logits::All, None)
        .expect("reference");
    for slots in [None, Some(24)] {
        let mut g = cuda(&model, slots, 32);
        let mut st = model.new_state();
        let (p, d) = tokens.split_at(60);
        let mut got = g
            .forward(&mut st, p, Logits::All)
            .expect("prefill")
            .to_vec();
        for &tok in d {
            got.extend_from_slice(g.forward(&mut st, &[tok], Logits::All).expect("decode"));
        }
        let e = rel_l2(&got, &want);
        eprintln!("real head sizes, slots {slots:?}: rel err {e:.2e}");
        assert!(e < 2e-5, "slots {slots:?}: {e}");
    }
}
