//! The timing loop of the examples batch_steps (CPU) and brook-cuda's gpu_steps (CUDA): decode
//! steps of k sequences together through `Forward::step_parts`, each feeding its argmax.

use std::time::Instant;

use brook_core::Logits;
use brook_core::engine::{Forward, Part};

/// Times `steps` decode steps of `k` sequences (after two warm-up steps) and prints the
/// median step time and the aggregate tokens per second. `BROOK_SAME=1`: every sequence
/// feeds the same tokens, so they route alike and each expert is read once for all (what
/// sharing the experts is worth). `BROOK_NO_LOGITS=1`: no step hands back logits (every
/// sequence feeds its first token again), which says what reading them to the host costs.
/// `BROOK_BEST=1`: each sequence asks for its greedy pick alone (`Logits::Best`), as a greedy
/// session does; `BROOK_TOP=1`: for its most likely candidates (`Logits::Top`, top-k 20 at
/// temperature 1), as a session sampling with Qwen's generation config does (each feeds its
/// most likely token either way).
pub fn report(fw: &mut Forward<'_>, k: usize, steps: usize) -> brook_core::Result<f64> {
    let v = fw.engine().model().cfg.vocab_size;
    let mut states: Vec<_> = (0..k).map(|_| fw.new_state(512)).collect();
    let mut outs = vec![Vec::new(); k];
    let same = std::env::var_os("BROOK_SAME").is_some();
    let want = if std::env::var_os("BROOK_NO_LOGITS").is_some() {
        Logits::None
    } else if std::env::var_os("BROOK_BEST").is_some() {
        Logits::Best
    } else if std::env::var_os("BROOK_TOP").is_some() {
        // What Qwen's generation config samples with: top-k 20 at temperature 1.
        Logits::Top(brook_core::model::TopWant {
            k: 20,
            temperature: 1.0f32.to_bits(),
        })
    } else {
        Logits::Last
    };
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
                        want,
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
        for (t, o) in toks.iter_mut().zip(&outs).filter(|(_, o)| !o.is_empty()) {
            *t = match want {
                Logits::Best => Logits::best_id(o),
                // Candidates, most likely first (or the row where they decided nothing).
                Logits::Top(_) if o.len() != v => o[1].to_bits(),
                _ => brook_core::model::argmax(o),
            };
        }
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    println!(
        "{k} sequences: step {:.1} ms (median of {steps}), aggregate {:.2} tok/s",
        med * 1e3,
        k as f64 / med
    );
    Ok(med)
}
