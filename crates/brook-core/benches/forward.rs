//! Decode and prefill speed of `CpuModel` at the full Qwen3.6-35B-A3B shapes (synthetic
//! 4-bit weights from `brook synth`'s generator), printed as tokens per second.
//!
//! RAM holds the dense weights (~1.3 GB) and, per layer, k = 8 routed experts: the expert
//! source hands out its i-th resident expert for the i-th id asked, so every decode step reads
//! 8 distinct experts per layer, the same bytes as the real model (working set ≫ L3), while
//! the box needs ~2 GB instead of 20. Weights bytes per decoded token are printed beside the
//! speed, so GB/s = bytes × tok/s, and beside the memory read bandwidth measured in the same
//! run. Run: `cargo bench -p brook-core --bench forward` (env BROOK_BENCH_THREADS, BROOK_BENCH_TILES,
//! BROOK_BENCH_PROMPT, BROOK_BENCH_DECODE, and BROOK_BENCH_PRECISION: a list of f32, split24,
//! fast run back to back in one process; each later one is compared with the first, over the
//! whole run (errors compound) and one decode step at a time from the same state).

use std::sync::Arc;
use std::time::Instant;

use brook_core::cpu::kernels::pool::{SharedMut, split};
use brook_core::cpu::{CpuModel, CpuOptions, CpuPool, Precision};
use brook_core::experts::source::{ExpertHandle, ExpertSource};
use brook_core::model::delta_net::DeltaMode;
use brook_core::model::weights::Loader;
use brook_core::synth::SynthModel;
use brook_core::text::argmax;
use brook_core::{Logits, Model, Result, Stage};

// As the brook binary: everything from 2 MiB on, on huge pages.
#[global_allocator]
static ALLOC: brook_core::aligned::HugePageAlloc = brook_core::aligned::HugePageAlloc;

/// `w`'s bytes moved into blocks of at least 2 MiB, so they sit on huge pages as brook's
/// expert slots do (an expert's matrices are smaller than a huge page each).
fn on_huge_pages(w: &mut brook_core::linear::Linear) {
    if let brook_core::linear::Weights::Affine {
        packed,
        scales,
        biases,
        ..
    } = &mut w.weights
    {
        for v in [packed, scales, biases] {
            let mut h = Vec::with_capacity(v.len().max(2 << 20));
            h.extend_from_slice(v);
            *v = h;
        }
    }
}

/// k resident experts per layer, handed out by position in the request.
#[derive(Debug)]
struct Positional(Vec<Vec<ExpertHandle>>);

impl ExpertSource for Positional {
    fn fetch(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>> {
        let mut out = Vec::with_capacity(ids.len());
        self.fetch_into(layer, ids, &mut out)?;
        Ok(out)
    }
    fn fetch_into(&self, layer: usize, ids: &[usize], out: &mut Vec<ExpertHandle>) -> Result<()> {
        let l = &self.0[layer];
        out.extend((0..ids.len()).map(|i| l[i % l.len()].clone()));
        Ok(())
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    let threads = env("BROOK_BENCH_THREADS", 2);
    let (prompt, decode) = (
        env("BROOK_BENCH_PROMPT", 128),
        env("BROOK_BENCH_DECODE", 16),
    );
    let t0 = Instant::now();
    let store = SynthModel::new("qwen3.6-35b-a3b", 4, 7)?;
    let cfg = store.config.clone();
    let loader = Loader::new(&store, &cfg);
    let mut dense = loader.dense()?;
    // As `Model::open_with` gives the CPU backend where VNNI exists, with every expert
    // resident; BROOK_BENCH_TILES=0 keeps the checkpoint's row order.
    let tiles = env("BROOK_BENCH_TILES", 1) == 1
        && brook_core::engine::tiles_dense(&brook_core::model::open::OpenOptions::default());
    if tiles {
        println!("{} dense matrices in 16-row tiles", dense.tile());
    }
    let k = cfg.num_experts_per_tok;
    let experts = (0..cfg.num_hidden_layers)
        .map(|l| {
            (0..k)
                .map(|e| {
                    loader.routed_expert(l, e).map(|mut x| {
                        if tiles {
                            for m in [&mut x.gate_proj, &mut x.up_proj, &mut x.down_proj] {
                                m.tile();
                            }
                        }
                        for m in [&mut x.gate_proj, &mut x.up_proj, &mut x.down_proj] {
                            on_huge_pages(m);
                        }
                        Arc::new(x) as ExpertHandle
                    })
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let expert_bytes: usize = experts
        .iter()
        .flatten()
        .map(|e| {
            let v = e.view();
            [v.gate_proj, v.up_proj, v.down_proj]
                .iter()
                .map(|m| match m.mat {
                    brook_core::linear::MatRef::Affine {
                        packed,
                        scales,
                        biases,
                        ..
                    } => packed.len() + scales.len() + biases.len(),
                    brook_core::linear::MatRef::Float { data, .. } => data.len(),
                })
                .sum::<usize>()
        })
        .sum();
    let mut dense_bytes = dense.lm_head.nbytes();
    for l in &dense.layers {
        dense_bytes += l.mlp.gate.nbytes() + l.mlp.shared_expert_gate.nbytes();
        let se = &l.mlp.shared_expert;
        dense_bytes += se.gate_proj.nbytes() + se.up_proj.nbytes() + se.down_proj.nbytes();
        dense_bytes += match &l.mixer {
            brook_core::model::weights::Mixer::Linear(w) => {
                w.in_proj_qkv.nbytes()
                    + w.in_proj_z.nbytes()
                    + w.in_proj_b.nbytes()
                    + w.in_proj_a.nbytes()
                    + w.out_proj.nbytes()
            }
            brook_core::model::weights::Mixer::Full(w) => {
                w.q_proj.nbytes() + w.k_proj.nbytes() + w.v_proj.nbytes() + w.o_proj.nbytes()
            }
        };
    }
    let model = Model {
        cfg,
        dense,
        experts: Box::new(Positional(experts)),
        delta_mode: DeltaMode::Auto,
        prefetch: false,
        prefill_chunk: 512,
        steps: Default::default(),
    };
    let per_token = (dense_bytes + expert_bytes) as f64 / 1e9;
    println!(
        "synthesized in {:.1} s; weights read per decoded token: {per_token:.3} GB",
        t0.elapsed().as_secs_f64()
    );
    let bw = read_bandwidth(threads);
    println!(
        "memory read, {threads} threads, same run: {bw:.1} GB/s; limit {:.2} tok/s",
        bw / per_token
    );
    let list = std::env::var("BROOK_BENCH_PRECISION").unwrap_or_else(|_| "f32".into());
    let tokens: Vec<u32> = (0..prompt as u32).map(|i| (i * 7919) % 200_000).collect();
    let parse = |name: &str| match name {
        "split24" => Precision::Split24,
        "fast" => Precision::Fast,
        _ => Precision::Exact,
    };
    let first_precision = parse(list.split(',').next().unwrap_or(""));
    let mut first: Option<Run> = None;
    for name in list.split(',') {
        let precision = parse(name);
        let opts = CpuOptions {
            threads,
            max_chunk: 512,
            max_context: prompt + decode + 8,
            level: None,
            precision,
            max_seqs: 1,
        };
        let mut cpu = CpuModel::new(&model, opts)?;
        let run = run(
            &mut cpu,
            &tokens,
            decode,
            first.as_ref().map(|f| &f.greedy[..]),
        )?;
        println!(
            "{} threads, {:?}, {precision:?}: prefill {prompt} tokens: {:.2} tok/s; decode {decode} tokens: {:.2} tok/s = {:.1} GB/s of weights = {:.0}% of the limit",
            cpu.threads(),
            cpu.level(),
            run.pp,
            run.tg,
            run.tg * per_token,
            100.0 * run.tg * per_token / bw
        );
        if let Some(f) = &first {
            let same = run
                .argmax
                .iter()
                .zip(&f.argmax)
                .filter(|(a, b)| a == b)
                .count();
            let changed = run
                .routes
                .iter()
                .zip(&f.routes)
                .filter(|(a, b)| a != b)
                .count();
            println!(
                "  vs {list_first}: logits rel L2 after the prompt {:.2e}, max over decode steps {:.2e}; \
                 greedy token same at {same}/{} teacher-forced steps; expert sets changed {changed}/{} (layer, token)",
                rel_l2(&run.logits[0], &f.logits[0]),
                run.logits
                    .iter()
                    .zip(&f.logits)
                    .map(|(a, b)| rel_l2(a, b))
                    .fold(0.0, f64::max),
                run.argmax.len(),
                run.routes.len(),
                list_first = list.split(',').next().unwrap_or("")
            );
        }
        if first.is_none() {
            first = Some(run);
        } else {
            let mut exact = CpuModel::new(
                &model,
                CpuOptions {
                    precision: first_precision,
                    ..opts
                },
            )?;
            let a = step_agreement(&mut exact, &mut cpu, &tokens, decode.min(16))?;
            println!(
                "  one step from the same state ({} steps along the {list_first} greedy path): logits rel L2 mean {:.2e} max {:.2e}; greedy token same {}/{}; expert sets changed {}/{} (layer, step)",
                a.steps,
                a.mean,
                a.max,
                a.same,
                a.steps,
                a.changed,
                a.sets,
                list_first = list.split(',').next().unwrap_or("")
            );
        }
    }
    println!(
        "memory read again after the runs: {:.1} GB/s",
        read_bandwidth(threads)
    );
    Ok(())
}

/// How one decode step of another precision compares with the first, both from the same
/// state (so errors do not compound over steps, and on random weights over routing flips).
struct Agreement {
    steps: usize,
    mean: f64,
    max: f64,
    same: usize,
    changed: usize,
    sets: usize,
}

/// Prefills `tokens` on `exact`, then for `steps` greedy steps runs one step of `other` from
/// a copy of the same state and compares logits, argmax and every layer's expert set.
fn step_agreement(
    exact: &mut CpuModel<'_>,
    other: &mut CpuModel<'_>,
    tokens: &[u32],
    steps: usize,
) -> Result<Agreement> {
    let mut st = exact.new_state(tokens.len() + steps + 8);
    let mut next = argmax(exact.forward(&mut st, tokens, Logits::Last)?);
    let mut a = Agreement {
        steps,
        mean: 0.0,
        max: 0.0,
        same: 0,
        changed: 0,
        sets: 0,
    };
    for _ in 0..steps {
        let mut copy = st.clone();
        let (lo, ro) = traced_step(other, &mut copy, next)?;
        let (le, re) = traced_step(exact, &mut st, next)?;
        let e = rel_l2(&lo, &le);
        a.mean += e / steps as f64;
        a.max = a.max.max(e);
        a.same += usize::from(argmax(&lo) == argmax(&le));
        a.changed += ro.iter().zip(&re).filter(|(x, y)| x != y).count();
        a.sets += re.len();
        next = argmax(&le);
    }
    Ok(a)
}

/// One traced decode step: (logits, sorted expert set per layer).
fn traced_step(
    cpu: &mut CpuModel<'_>,
    st: &mut brook_core::model::state::SeqState,
    tok: u32,
) -> Result<(Vec<f32>, Vec<Vec<usize>>)> {
    let mut routes = Vec::new();
    let l = cpu
        .forward_traced(
            st,
            &[tok],
            Logits::Last,
            Some(&mut |s: Stage<'_>| {
                if let Stage::Routes(_, r) = s {
                    for rt in r {
                        let mut e = rt.experts.clone();
                        e.sort_unstable();
                        routes.push(e);
                    }
                }
            }),
        )?
        .to_vec();
    Ok((l, routes))
}

/// What one precision's run produced.
struct Run {
    pp: f64,
    tg: f64,
    logits: Vec<Vec<f32>>, // [after the prompt, after each decode step] last-token logits
    argmax: Vec<u32>,      // their argmax
    greedy: Vec<u32>,      // the tokens fed in decode
    routes: Vec<Vec<usize>>, // [(layer, token) of the prompt] expert sets, sorted
}

/// Times prefill and decode; the decode feeds `forced` tokens when given (another run's
/// greedy tokens, so two precisions see the same inputs), else its own greedy choices. The
/// prompt's expert choices come from a second, traced prefill (not timed).
fn run(
    cpu: &mut CpuModel<'_>,
    tokens: &[u32],
    decode: usize,
    forced: Option<&[u32]>,
) -> Result<Run> {
    let mut st = cpu.new_state(tokens.len() + decode + 8);
    let t = Instant::now();
    let l0 = cpu.forward(&mut st, tokens, Logits::Last)?.to_vec();
    let pp = tokens.len() as f64 / t.elapsed().as_secs_f64();
    let (mut logits, mut argmaxes, mut greedy) = (vec![l0.clone()], vec![argmax(&l0)], Vec::new());
    let mut next = argmax(&l0);
    // One warm-up step, then timed steps.
    next = argmax(cpu.forward(&mut st, &[next], Logits::Last)?);
    let t = Instant::now();
    for i in 0..decode {
        let feed = forced.map_or(next, |f| f[i]);
        greedy.push(feed);
        let l = cpu.forward(&mut st, &[feed], Logits::Last)?;
        next = argmax(l);
        argmaxes.push(next);
        logits.push(l.to_vec());
    }
    let tg = decode as f64 / t.elapsed().as_secs_f64();
    let mut routes = Vec::new();
    let mut st = cpu.new_state(tokens.len() + 8);
    cpu.forward_traced(
        &mut st,
        tokens,
        Logits::None,
        Some(&mut |s: Stage<'_>| {
            if let Stage::Routes(_, r) = s {
                for rt in r {
                    let mut e = rt.experts.clone();
                    e.sort_unstable();
                    routes.push(e);
                }
            }
        }),
    )?;
    Ok(Run {
        pp,
        tg,
        logits,
        argmax: argmaxes,
        greedy,
        routes,
    })
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        d += ((x - y) as f64).powi(2);
        n += (*y as f64).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
}

/// GB/s of summing a 512 MiB f32 buffer on `threads` threads (best of 3), the bound a
/// decode step's weight reads are measured against.
fn read_bandwidth(threads: usize) -> f64 {
    let buf = vec![1.0f32; 128 << 20];
    let pool = CpuPool::new(threads);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let mut parts = [0.0f32; 64];
        let out = SharedMut::new(&mut parts);
        let t = Instant::now();
        pool.run(&|i| {
            let r = split(buf.len(), i, threads, 1 << 16);
            let mut acc = [0.0f32; 16];
            for c in buf[r].chunks_exact(16) {
                for l in 0..16 {
                    acc[l] += c[l];
                }
            }
            // SAFETY: each thread writes only its own element.
            unsafe { out.write(i, acc.iter().sum()) };
        });
        best = best.max((buf.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(&parts);
    }
    best
}
