//! Times decode steps of 1..N sequences together on the CUDA engine, every expert resident:
//! `cargo run --release -p brook-cuda --example gpu_steps -- MODEL_DIR [N,N,...] [STEPS]`.
//! Prints each batch size's step time and aggregate tokens per second (the engine alone: no
//! server, no sampling beyond argmax).

#[path = "../../brook-core/examples/steps/mod.rs"]
mod steps;

use brook_core::model::open::{Backend, OpenOptions};

fn main() -> brook_core::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&args[1]);
    let sizes: Vec<usize> = args
        .get(2)
        .map_or("1,2,4,8,16", |s| s.as_str())
        .split(',')
        .map(|s| s.parse().expect("N,N,..."))
        .collect();
    let steps: usize = args.get(3).map_or(20, |s| s.parse().expect("STEPS"));
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
