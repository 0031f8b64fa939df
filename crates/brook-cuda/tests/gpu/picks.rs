//! Greedy picks and sampling candidates made on the GPU (`Logits::Best`, `Logits::Top`,
//! src/picks.rs): the kernels against the host's reductions, and each sequence's pick
//! through the engine against the pick from its logits.

use super::*;
use batch::{cuda_seqs, same_bits};
use brook_core::engine::{Forward, Part};
use brook_cuda::picks;

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
        let part = g.zeros(n * picks::BEST_BLOCKS * 8, "part").expect("part");
        let count = g.zeros(n * 4, "count").expect("count");
        let out = g.zeros(n * 4, "out").expect("out");
        for round in 0..2 {
            picks::best_rows(&g, d.ptr, v, n, part.ptr, count.ptr, out.ptr).expect("launch");
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
        let out = g.zeros(n * picks::TOP_ROW * 4, "out").expect("out");
        picks::top_rows(&g, d.ptr, v, n, keys.ptr, out.ptr).expect("launch");
        let mut got = vec![0f32; n * picks::TOP_ROW];
        g.copy_out(out.ptr, &mut got).expect("read");
        let mut want = Vec::new();
        for (ri, (row, t)) in rows
            .iter()
            .zip(got.chunks_exact(picks::TOP_ROW))
            .enumerate()
        {
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
            assert_eq!(every && c as usize <= picks::TOP_K, whole, "v {v} row {ri}");
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
            // On unless `BROOK_CUDA_TOP=0`; this test checks it either way.
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
