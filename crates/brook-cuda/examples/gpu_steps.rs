//! Times decode steps of 1..N sequences together on the CUDA engine, every expert resident:
//! `cargo run --release -p brook-cuda --example gpu_steps -- MODEL_DIR [N,N,...] [STEPS]`.
//! Prints each batch size's step time and aggregate tokens per second (the engine alone: no
//! server, no sampling beyond argmax).

#[path = "../../brook-core/examples/steps/mod.rs"]
mod steps;

use brook_core::model::open::{Backend, OpenOptions};

fn main() -> brook_core::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let usage =
        || brook_core::Error::Invalid("usage: gpu_steps MODEL_DIR [N,N,...] [STEPS]".into());
    let dir = std::path::PathBuf::from(args.get(1).ok_or_else(usage)?);
    let sizes: Vec<usize> = args
        .get(2)
        .map_or("1,2,4,8,16", |s| s.as_str())
        .split(',')
        .map(|s| s.parse().map_err(|_| usage()))
        .collect::<Result<_, _>>()?;
    let steps: usize = match args.get(3) {
        Some(s) => s.parse().map_err(|_| usage())?,
        None => 20,
    };
    let o = OpenOptions {
        backend: Backend::Cuda,
        engine: Some(brook_cuda::engine_maker()),
        expert_cache: Some(512),
        max_seqs: sizes.iter().copied().max().unwrap_or(1),
        context: 512,
        ..Default::default()
    };
    let model = std::sync::Arc::new(brook_core::Model::open_with(&dir, &o)?);
    let mut fw = brook_core::engine::open(&model, &dir, &o)?;
    for k in sizes {
        steps::report(&mut fw, k, steps)?;
    }
    Ok(())
}
