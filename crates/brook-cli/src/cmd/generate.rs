//! `brook generate`: one-shot generation from a prompt (text, stdin or token ids).

use std::io::{Read, Write};
use std::time::Instant;

use anyhow::Result;
use brook_core::Error;
use brook_core::session::{Event, GenOptions};
use brook_core::text::Message;

/// Generate a reply to a prompt. The prompt goes through the model's chat template unless
/// --raw is given or --prompt-tokens supplies ids directly.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  brook generate --model ./q36.brook --prompt 'Why is the sky blue?'\n  echo 'Summarize: ...' | brook generate --model ./q36.brook --max-tokens 200\n  brook generate --model ./tiny --prompt-tokens 1,2,3 --max-tokens 16 --temperature 0 --json"
)]
pub struct Args {
    #[command(flatten)]
    model: super::ModelArgs,
    /// Prompt text (default: read standard input).
    #[arg(long, conflicts_with = "prompt_tokens")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids (no tokenizer needed).
    #[arg(long)]
    prompt_tokens: Option<String>,
    /// Use the prompt text as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// System prompt (chat template only).
    #[arg(long)]
    system: Option<String>,
    /// Let the model think first (templates with enable_thinking).
    #[arg(long)]
    think: Option<bool>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: super::SamplingArgs,
    /// Print one JSON object with text, tokens and timings.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let llm = a.model.open()?;
    let mut opts = GenOptions {
        max_tokens: Some(a.max_tokens),
        enable_thinking: a.think,
        sampling: Some(a.sampling.params(&llm)),
        ignore_eos: a.sampling.ignore_eos,
        ..Default::default()
    };
    opts.stop.clone_from(&a.sampling.stop);
    let mut session = llm.session();
    let start = Instant::now();
    let stream = !a.json;
    let mut out = std::io::stdout();
    let mut on_event = |e: Event| {
        if !stream {
            return;
        }
        match e {
            Event::Content(t) => {
                let _ = write!(out, "{t}");
                let _ = out.flush();
            }
            Event::Reasoning(t) => {
                let _ = write!(std::io::stderr(), "{t}");
            }
            Event::ToolCall(c) => {
                let _ = writeln!(out, "\n[tool call {}: {}]", c.name, c.arguments);
            }
            _ => {}
        }
    };
    let completion = if let Some(ids) = &a.prompt_tokens {
        let ids = super::parse_tokens(ids)?;
        if stream {
            // No tokenizer is needed for ids: stream ids instead of text.
            let c = session.generate(&ids, &opts, None, &mut |_| {})?;
            let s: Vec<String> = c.tokens.iter().map(u32::to_string).collect();
            println!("{}", s.join(","));
            c
        } else {
            session.generate(&ids, &opts, None, &mut |_| {})?
        }
    } else {
        let prompt = match &a.prompt {
            Some(p) => p.clone(),
            None => {
                let mut s = String::new();
                std::io::stdin().read_to_string(&mut s)?;
                s
            }
        };
        if prompt.trim().is_empty() {
            return Err(Error::Invalid(
                "the prompt is empty (give --prompt or pipe text in)".into(),
            )
            .into());
        }
        if a.raw {
            let ids = llm.tokenizer()?.encode(&prompt, false)?;
            let mut ts = brook_core::text::TextStream::new(
                llm.tokenizer()?.clone(),
                brook_core::text::StreamOptions {
                    stop_ids: llm.stop_ids(&opts),
                    stop_strings: opts.stop.clone(),
                    parse_reasoning: false,
                    ..Default::default()
                },
            );
            session.generate(&ids, &opts, Some(&mut ts), &mut on_event)?
        } else {
            if let Some(sys) = &a.system {
                session.set_messages(vec![Message::new("system", sys.clone())]);
            }
            session.chat(Message::new("user", prompt), &opts, &mut on_event)?
        }
    };
    if stream && a.prompt_tokens.is_none() {
        println!();
    }
    let total = start.elapsed().as_secs_f64();
    let u = completion.usage;
    if a.json {
        let (_, peak) = brook_core::experts::budget::rss();
        let out = serde_json::json!({
            "text": completion.content,
            "reasoning": completion.reasoning,
            "tool_calls": completion.tool_calls.iter().map(|c| serde_json::json!({"id": c.id, "name": c.name, "arguments": c.arguments})).collect::<Vec<_>>(),
            "tokens": completion.tokens,
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "finish_reason": completion.finish,
            "ttft_s": u.prefill_s,
            "prefill_tok_s": u.prompt_tokens as f64 / u.prefill_s.max(1e-9),
            "decode_tok_s": u.completion_tokens as f64 / u.decode_s.max(1e-9),
            "total_s": total,
            "peak_rss_bytes": peak,
            "cache": llm.model.experts.stats(),
            "engine": llm.engine_stats(),
        });
        println!("{out}");
    } else {
        eprintln!(
            "prompt: {} tokens, {:.2} tok/s | generation: {} tokens, {:.2} tok/s",
            u.prompt_tokens,
            u.prompt_tokens as f64 / u.prefill_s.max(1e-9),
            u.completion_tokens,
            u.completion_tokens as f64 / u.decode_s.max(1e-9)
        );
    }
    Ok(())
}
