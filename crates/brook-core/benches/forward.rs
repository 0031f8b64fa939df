//! Decode and prefill speed of `CpuModel` at the full Qwen3.6-35B-A3B shapes (synthetic
//! 4-bit weights from `brook synth`'s generator), printed as tokens per second.
//!
//! RAM holds the dense weights (~1.3 GB) and, per layer, k = 8 routed experts: the expert
//! source hands out its i-th resident expert for the i-th id asked, so every decode step reads
//! 8 distinct experts per layer, the same bytes as the real model (working set ≫ L3), while
//! the box needs ~2 GB instead of 20. Weights bytes per decoded token are printed beside the
//! speed, so GB/s = bytes × tok/s. Run: `cargo bench -p brook-core --bench forward`
//! (env BROOK_BENCH_THREADS, BROOK_BENCH_PROMPT, BROOK_BENCH_DECODE, BROOK_BENCH_PRECISION=split24).

use std::sync::Arc;
use std::time::Instant;

use brook_core::cpu::{CpuModel, CpuOptions, Precision};
use brook_core::model::delta_net::DeltaMode;
use brook_core::model::moe::{ExpertHandle, ExpertSource};
use brook_core::model::weights::Loader;
use brook_core::synth::SynthStore;
use brook_core::{Logits, Model, Result};

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
    let store = SynthStore::new("qwen3.6-35b-a3b", 4, 7)?;
    let cfg = store.config.clone();
    let loader = Loader::new(&store, &cfg);
    let dense = loader.dense()?;
    let k = cfg.num_experts_per_tok;
    let experts = (0..cfg.num_hidden_layers)
        .map(|l| {
            (0..k)
                .map(|e| {
                    loader
                        .routed_expert(l, e)
                        .map(|x| Arc::new(x) as ExpertHandle)
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
    };
    let per_token = (dense_bytes + expert_bytes) as f64 / 1e9;
    println!(
        "synthesized in {:.1} s; weights read per decoded token: {per_token:.3} GB",
        t0.elapsed().as_secs_f64()
    );
    let precision = match std::env::var("BROOK_BENCH_PRECISION").as_deref() {
        Ok("split24") => Precision::Split24,
        _ => Precision::F32,
    };
    let opts = CpuOptions {
        threads,
        max_chunk: 512,
        max_context: prompt + decode + 8,
        level: None,
        precision,
    };
    let mut cpu = CpuModel::new(&model, opts)?;
    println!(
        "{} threads, {:?}, {precision:?}",
        cpu.threads(),
        cpu.level()
    );
    let tokens: Vec<u32> = (0..prompt as u32).map(|i| (i * 7919) % 200_000).collect();
    let mut st = cpu.new_state(prompt + decode + 8);
    let t = Instant::now();
    let logits = cpu.forward(&mut st, &tokens, Logits::Last)?;
    let pp = prompt as f64 / t.elapsed().as_secs_f64();
    let mut next = argmax(logits);
    println!("prefill {prompt} tokens: {pp:.2} tok/s");
    // One warm-up step, then timed steps.
    next = argmax(cpu.forward(&mut st, &[next], Logits::Last)?);
    let t = Instant::now();
    for _ in 0..decode {
        next = argmax(cpu.forward(&mut st, &[next], Logits::Last)?);
    }
    let tg = decode as f64 / t.elapsed().as_secs_f64();
    println!(
        "decode {decode} tokens: {tg:.2} tok/s = {:.1} GB/s of weights",
        tg * per_token
    );
    Ok(())
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}
