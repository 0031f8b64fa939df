//! Steps of several sequences (issue #32): each sequence's logits are the bits it gets alone,
//! whatever runs beside it, on the CPU engine at every SIMD level and precision this CPU runs
//! and on the reference engine; and sessions generating on several threads at once through
//! the batcher produce the tokens they produce one at a time, in steps that hold several
//! sequences.

mod common;

use brook_core::cpu::{CpuModel, CpuOptions, Precision, SimdLevel};
use brook_core::engine::{Engine, Forward, Part, Reference};
use brook_core::model::open::OpenOptions;
use brook_core::session::{GenOptions, Llm};
use brook_core::text::SamplingParams;
use brook_core::{Logits, Model};
use common::batch::{CHUNK, assert_same_bits, run};
use common::{MODELS, fixture};

/// Every (level, precision) this CPU runs.
fn variants() -> Vec<(SimdLevel, Precision)> {
    let mut v = Vec::new();
    for l in SimdLevel::supported() {
        for p in [Precision::Exact, Precision::Split24, Precision::Fast] {
            v.push((l, p));
        }
    }
    v
}

#[test]
fn cpu_steps_of_several_sequences_give_each_its_own_bits() {
    for (name, tiles) in ["qwen35-q4", "next-q4", "qwen35-mixed", "next-f32"]
        .into_iter()
        .flat_map(|m| [(m, false), (m, true)])
    {
        let mut model = Model::open(&fixture(name)).expect("open");
        if tiles {
            // The dense weights in 16-row tiles, as the CPU engine loads them on AVX-512
            // VNNI: single tokens then share each block's read (`matvec_rows_tokens`).
            model.dense.tile();
        }
        for (level, precision) in variants() {
            let opts = CpuOptions {
                threads: 2,
                max_chunk: CHUNK,
                max_context: 64,
                level: Some(level),
                precision,
                max_seqs: 4,
            };
            let cpu = CpuModel::new(&model, opts).expect("cpu");
            assert_eq!(cpu.caps().max_seqs, 4);
            let mut fw = Forward::new(cpu);
            let alone = run(&mut fw, false);
            let steps = fw.stats().steps;
            let together = run(&mut fw, true);
            assert_same_bits(
                &alone,
                &together,
                &format!("{name} tiles {tiles} {level:?} {precision:?}"),
            );
            // The same parts took fewer steps: several sequences shared steps.
            assert!(fw.stats().steps - steps < steps, "{:?}", fw.stats());
        }
    }
}

#[test]
fn reference_steps_of_several_sequences_give_each_its_own_bits() {
    for name in MODELS.iter().take(2) {
        let model = Model::open(&fixture(name)).expect("open");
        let mut fw = Forward::new(Reference::new(&model));
        let alone = run(&mut fw, false);
        let together = run(&mut fw, true);
        assert_same_bits(&alone, &together, name);
    }
}

#[test]
fn a_step_beyond_the_engine_is_split_and_bad_parts_fail_alone() {
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let opts = CpuOptions {
        threads: 2,
        max_chunk: CHUNK,
        max_context: 64,
        max_seqs: 2,
        ..Default::default()
    };
    let mut fw = Forward::with_context(Box::new(CpuModel::new(&model, opts).expect("cpu")), 8);
    let mut states: Vec<_> = (0..4).map(|_| fw.new_state(8)).collect();
    let v = model.cfg.vocab_size as u32;
    let toks: [&[u32]; 4] = [&[1], &[2, 3], &[v], &[1, 2, 3, 4, 5]];
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); 4];
    let mut parts: Vec<Part<'_>> = states
        .iter_mut()
        .zip(toks)
        .zip(&mut outs)
        .map(|((state, tokens), out)| Part {
            state,
            tokens,
            want: Logits::Last,
            out,
            result: Ok(()),
        })
        .collect();
    fw.step_parts(&mut parts);
    let errs: Vec<String> = parts
        .iter()
        .map(|p| {
            p.result
                .as_ref()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        })
        .collect();
    drop(parts);
    assert!(errs[0].is_empty() && errs[1].is_empty(), "{errs:?}");
    assert!(
        errs[2].contains("vocab") || errs[2].contains("token"),
        "{}",
        errs[2]
    );
    assert!(errs[3].contains("1 to 4"), "{}", errs[3]);
    assert_eq!(outs[0].len(), model.cfg.vocab_size);
    assert_eq!(outs[1].len(), model.cfg.vocab_size);
    assert_eq!((states[0].pos, states[1].pos, states[2].pos), (1, 2, 0));
    // The context limit applies per part.
    let mut st = fw.new_state(8);
    st.pos = 0;
    let mut out = Vec::new();
    let mut p = [Part {
        state: &mut st,
        tokens: &[1, 2, 3, 4],
        want: Logits::Last,
        out: &mut out,
        result: Ok(()),
    }];
    fw.step_parts(&mut p);
    p[0].result.as_ref().expect("4 of 8");
    let [Part { state, .. }] = p;
    let mut q = [Part {
        state,
        tokens: &[1, 2, 3, 4, 5][..4],
        want: Logits::Last,
        out: &mut Vec::new(),
        result: Ok(()),
    }];
    fw.step_parts(&mut q);
    q[0].result.as_ref().expect("8 of 8");
    let [Part { state, .. }] = q;
    let mut r = [Part {
        state,
        tokens: &[1],
        want: Logits::Last,
        out: &mut Vec::new(),
        result: Ok(()),
    }];
    fw.step_parts(&mut r);
    let e = r[0]
        .result
        .as_ref()
        .expect_err("past the context")
        .to_string();
    assert!(e.contains("context full"), "{e}");
}

fn greedy(max: usize) -> GenOptions {
    GenOptions {
        sampling: Some(SamplingParams::default()),
        max_tokens: Some(max),
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn sessions_on_several_threads_batch_and_generate_what_they_generate_alone() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = common::chat_model(dir.path());
    let open = |seqs| {
        let o = OpenOptions {
            context: 256,
            prefill_chunk: 8,
            max_seqs: seqs,
            threads: Some(2),
            ..Default::default()
        };
        std::sync::Arc::new(Llm::open(&path, o).expect("open"))
    };
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| {
            (0..(3 + 7 * i))
                .map(|j| (j * 13 + i * 5) % 200 + 1)
                .collect()
        })
        .collect();
    let alone_llm = open(1);
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut s = alone_llm.session();
            s.generate(p, &greedy(12), None, &mut |_| {})
                .expect("alone")
                .tokens
        })
        .collect();
    let llm = open(4);
    let together: Vec<Vec<u32>> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let llm = llm.clone();
                sc.spawn(move || {
                    let mut s = llm.session();
                    s.generate(p, &greedy(12), None, &mut |_| {})
                        .expect("together")
                        .tokens
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert_eq!(alone, together);
    let st = llm.engine_stats();
    assert_eq!(st.forward_calls, alone_llm.engine_stats().forward_calls);
    assert!(
        st.steps < alone_llm.engine_stats().steps,
        "no step held several sequences: {st:?}"
    );
}

#[test]
fn a_batch_api_caller_adds_and_removes_sequences_between_steps() {
    use brook_core::session::{FinishReason, SeqEvent};
    let dir = tempfile::tempdir().expect("tmp");
    let path = common::chat_model(dir.path());
    let o = OpenOptions {
        context: 256,
        prefill_chunk: 8,
        max_seqs: 4,
        threads: Some(2),
        ..Default::default()
    };
    let llm = std::sync::Arc::new(Llm::open(&path, o).expect("open"));
    let prompts: [Vec<u32>; 3] = [(1..20).collect(), vec![7, 3, 9], (40..52).collect()];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            llm.session()
                .generate(p, &greedy(10), None, &mut |_| {})
                .expect("alone")
                .tokens
        })
        .collect();
    let mut b = llm.batch();
    assert!(b.add(&[], &greedy(1)).is_err());
    assert!(b.add(&[u32::MAX], &greedy(1)).is_err());
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let mut finished = [None; 3];
    let ids = [b.add(&prompts[0], &greedy(10)).expect("add")];
    let mut id_of = vec![(ids[0], 0usize)];
    let mut extra = None;
    for step in 0.. {
        if step == 2 {
            // Two more join while the first reads its prompt; one is cancelled later.
            id_of.push((b.add(&prompts[1], &greedy(10)).expect("add"), 1));
            let e = b.add(&prompts[2], &greedy(10)).expect("add");
            id_of.push((e, 2));
            extra = Some(e);
        }
        if step == 6 {
            assert!(b.remove(extra.expect("added")));
            assert!(!b.remove(extra.expect("added")));
        }
        if b.is_empty() {
            break;
        }
        for (id, ev) in b.step().expect("step") {
            let i = id_of.iter().find(|(x, _)| *x == id).expect("known id").1;
            match ev {
                SeqEvent::Token { token, finish } => {
                    got[i].push(token);
                    finished[i] = finish;
                }
                SeqEvent::Prefilled(n) => assert!(n <= 8),
                SeqEvent::Failed(e) => panic!("{e}"),
            }
        }
    }
    assert_eq!(got[0], alone[0]);
    assert_eq!(got[1], alone[1]);
    // The cancelled one generated a prefix of its tokens alone, then nothing.
    assert!(!got[2].is_empty() && got[2].len() < 10, "{:?}", got[2]);
    assert_eq!(got[2][..], alone[2][..got[2].len()]);
    assert_eq!(finished[..2], [Some(FinishReason::Length); 2]);
    assert!(llm.engine_stats().steps > 0);
}

#[test]
fn a_budget_too_small_for_the_parallel_states_says_so() {
    use brook_core::checkpoint::Checkpoint;
    use brook_core::container::repack::{RepackSource, repack};
    use brook_core::model::open::state_bytes;
    let dir = tempfile::tempdir().expect("tmp");
    let c = dir.path().join("c");
    let ck = Checkpoint::open(&fixture("qwen35-q4")).expect("open");
    repack(
        &RepackSource::from_checkpoint(&ck).expect("src"),
        &c,
        &mut |_| {},
    )
    .expect("repack");
    let cfg = Model::open(&fixture("qwen35-q4"))
        .expect("open")
        .cfg
        .clone();
    let (context, chunk) = (1 << 20, 512);
    // Half of what sixteen states take: sixteen do not fit, one (a sixteenth) does.
    let budget = state_bytes(&cfg, context, chunk, 16) / 2;
    let o = |seqs| OpenOptions {
        context,
        prefill_chunk: chunk,
        max_seqs: seqs,
        memory_budget: Some(budget),
        ..Default::default()
    };
    Model::open_with(&c, &o(1)).expect("one state fits");
    let e = Model::open_with(&c, &o(16))
        .expect_err("sixteen states do not")
        .to_string();
    assert!(e.contains("--parallel") && e.contains("too small"), "{e}");
}
