//! Times decode steps of 1..N sequences together on the CPU engine: `cargo run --release
//! --example batch_steps -- MODEL_DIR [N] [STEPS]`. Prints each batch size's step time and
//! aggregate tokens per second (the engine alone, no server, no sampling cost beyond argmax).

#[path = "steps/mod.rs"]
mod steps;

use brook_core::model::open::OpenOptions;
use brook_core::session::Llm;

fn main() -> brook_core::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&args[1]);
    let n: usize = args.get(2).map_or(4, |s| s.parse().expect("N"));
    let steps: usize = args.get(3).map_or(20, |s| s.parse().expect("STEPS"));
    // BROOK_PRECISION=fast|split24 picks the CPU engine's arithmetic (default exact).
    let precision = match std::env::var("BROOK_PRECISION").as_deref() {
        Ok("fast") => brook_core::cpu::Precision::Fast,
        Ok("split24") => brook_core::cpu::Precision::Split24,
        _ => brook_core::cpu::Precision::Exact,
    };
    let o = OpenOptions {
        max_seqs: n,
        context: 512,
        precision,
        threads: std::env::var("BROOK_THREADS")
            .ok()
            .and_then(|t| t.parse().ok()),
        ..Default::default()
    };
    let model = std::sync::Arc::new(brook_core::Model::open_with(&dir, &o)?);
    let mut fw = brook_core::engine::open(&model, &dir, &o)?;
    let only = args.get(4).is_some();
    for k in [1, n] {
        if only && k == 1 {
            continue;
        }
        steps::report(&mut fw, k, steps)?;
    }
    let _ = Llm::open; // keep the session API linked for comparison runs
    Ok(())
}
