//! `brook generate`: one-shot generation from token ids.

use std::time::Instant;

use anyhow::Result;
use brook_core::Logits;

/// Generate tokens after a prompt.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  brook generate --model ./Qwen3-Next-tiny --prompt-tokens 1,2,3 --max-tokens 16 --temperature 0 --json"
)]
pub struct Args {
    #[command(flatten)]
    model: super::ModelArgs,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    prompt_tokens: String,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Print one JSON object with the generated ids and timings.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    if a.temperature != 0.0 {
        anyhow::bail!(brook_core::Error::Invalid(
            "only --temperature 0 (greedy) is available from token ids for now".into()
        ));
    }
    let prompt = super::parse_tokens(&a.prompt_tokens)?;
    let model = a.model.open()?;
    let eos = model.cfg.eos_token_ids.clone();
    let mut state = model.new_state();
    let start = Instant::now();
    let mut logits = model.forward(&mut state, &prompt, Logits::Last, None)?;
    let ttft = start.elapsed().as_secs_f64();
    let mut tokens = Vec::with_capacity(a.max_tokens);
    let mut finish = "length";
    while tokens.len() < a.max_tokens {
        let next = argmax(&logits);
        tokens.push(next);
        if eos.contains(&next) {
            finish = "stop";
            break;
        }
        if tokens.len() == a.max_tokens {
            break;
        }
        logits = model.forward(&mut state, &[next], Logits::Last, None)?;
    }
    let total = start.elapsed().as_secs_f64();
    if a.json {
        let (_, peak) = brook_core::experts::budget::rss();
        let out = serde_json::json!({
            "tokens": tokens,
            "prompt_tokens": prompt.len(),
            "finish_reason": finish,
            "ttft_s": ttft,
            "total_s": total,
            "peak_rss_bytes": peak,
            "cache": model.experts.stats(),
        });
        println!("{out}");
    } else {
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        println!("{}", ids.join(","));
    }
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
