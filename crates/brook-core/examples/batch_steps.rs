//! Times decode steps of 1..N sequences together on the CPU engine: `cargo run --release
//! --example batch_steps -- MODEL_DIR [N] [STEPS]`. Prints each batch size's step time and
//! aggregate tokens per second (the engine alone, no server, no sampling cost beyond argmax).

use std::time::Instant;

use brook_core::Logits;
use brook_core::engine::Part;
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
    let v = model.cfg.vocab_size;
    let only = args.get(4).is_some();
    for k in [1, n] {
        if only && k == 1 {
            continue;
        }
        let mut states: Vec<_> = (0..k).map(|_| fw.new_state(512)).collect();
        let mut outs = vec![Vec::new(); k];
        // BROOK_SAME=1: every sequence feeds the same tokens, so they route alike and each
        // expert is read once for all (what sharing the experts is worth).
        let same = std::env::var_os("BROOK_SAME").is_some();
        let mut toks: Vec<u32> = (0..k as u32)
            .map(|i| if same { 100 } else { 100 + 7 * i })
            .collect();
        let mut times = Vec::new();
        for s in 0..steps + 2 {
            let t = Instant::now();
            {
                let ids: Vec<[u32; 1]> = toks.iter().map(|&t| [t]).collect();
                let mut parts: Vec<Part<'_>> = states
                    .iter_mut()
                    .zip(&ids)
                    .zip(&mut outs)
                    .map(|((state, id), out)| {
                        out.clear();
                        Part {
                            state,
                            tokens: id,
                            want: Logits::Last,
                            out,
                            result: Ok(()),
                        }
                    })
                    .collect();
                fw.step_parts(&mut parts);
                for p in parts {
                    p.result?;
                }
            }
            if s >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
            for (t, o) in toks.iter_mut().zip(&outs) {
                let mut best = 0;
                for i in 0..v {
                    if o[i] > o[best] {
                        best = i;
                    }
                }
                *t = best as u32;
            }
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!(
            "{k} sequences: step {:.1} ms (median of {steps}), aggregate {:.2} tok/s",
            med * 1e3,
            k as f64 / med
        );
    }
    let _ = Llm::open; // keep the session API linked for comparison runs
    Ok(())
}
