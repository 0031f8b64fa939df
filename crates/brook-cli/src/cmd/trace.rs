//! `brook trace`: routing traces for judging expert caches (docs/FORMAT.md, "Routing traces").

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use brook_core::routing::RoutingTrace;
use brook_core::routing::replay::{Policy, hit_rate};
use brook_core::routing::simulate::{SimParams, simulate};
use brook_core::session::{GenOptions, Routes};
use brook_core::text::Message;

/// Record the routing of a real generation, simulate one for a model's shape, or read one,
/// and say how caches of given sizes would do on it.
#[derive(Debug, clap::Args)]
#[command(
    group(clap::ArgGroup::new("source").required(true).args(["simulate", "trace", "prompt", "prompt_tokens"])),
    after_help = "Examples:\n  brook trace --model ./q36.brook --prompt 'Write a story about a lighthouse.' --max-tokens 512 --out q36-story.jsonl\n  brook trace --model ./q36.brook --simulate realistic --tokens 256 --out q36-realistic.jsonl\n  brook trace --model ./q36.brook --trace q36-story.jsonl --compare 320,2048,3413\n  brook bench --model ./q36.brook --memory-budget 3GiB --routing-trace q36-story.jsonl"
)]
pub struct Args {
    /// The model (container, checkpoint or store name) whose layers, experts and top-k the
    /// trace has; recording runs it (`--backend cpu` or `reference`: the engines that report
    /// their routes).
    #[command(flatten)]
    model: super::ModelArgs,
    /// Record a generation from this prompt, through the model's chat template.
    #[arg(long, conflicts_with = "prompt_tokens")]
    prompt: Option<String>,
    /// Record a generation from these comma-separated token ids.
    #[arg(long)]
    prompt_tokens: Option<String>,
    /// Tokens to generate when recording (one trace line each).
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: super::SamplingArgs,
    /// Simulate routing with a preset's reuse: realistic (the statistics published for
    /// Qwen3-30B-A3B), strong, weak or uniform (`--seed` picks the trace).
    #[arg(long, value_name = "PRESET")]
    simulate: Option<String>,
    /// Read a trace file instead (JSON Lines, one line per decoded token).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Decoded tokens to simulate.
    #[arg(long, default_value_t = 256)]
    tokens: usize,
    /// Where to write the trace.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Cache sizes (expert slots) to replay the trace through: the demand hit rate of
    /// Belady's optimum, LRU (brook's cache), LFU and the learned-reuse rule at each.
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    compare: Vec<usize>,
}

pub fn run(a: Args) -> Result<()> {
    let path = a.model.path()?;
    let cfg = if brook_core::container::is_container(&path) {
        brook_core::container::Container::open(&path)?.config
    } else {
        brook_core::ModelConfig::from_dir(&path)?
    };
    let (layers, experts, k) = (
        cfg.num_hidden_layers,
        cfg.num_experts,
        cfg.num_experts_per_tok,
    );
    let trace = match (&a.simulate, &a.trace) {
        (Some(preset), _) => simulate(
            layers,
            experts,
            k,
            a.tokens,
            SimParams::preset(preset)?,
            a.sampling.seed.unwrap_or(1),
        )?,
        (None, Some(file)) => RoutingTrace::read(file, layers, experts, k)?,
        (None, None) => record(&a, RoutingTrace::new(layers, experts, k)?)?,
    };
    if let Some(out) = &a.out {
        trace.save(out)?;
    }
    let r = trace.reuse();
    println!(
        "{} tokens, {layers} layers x {experts} experts, top-{k}: {:.1}% of picks repeat at the next token, {:.1}% within 8, median reuse distance {} tokens{}",
        trace.tokens(),
        100.0 * r.at_next_token,
        100.0 * r.within_8_tokens,
        r.median_distance,
        a.out
            .as_ref()
            .map_or(String::new(), |o| format!("; written to {}", o.display()))
    );
    if !a.compare.is_empty() {
        println!(
            "| slots | of all experts | Belady | LRU (brook) | LFU | reuse | LRU / Belady | reuse / Belady |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
        for &n in &a.compare {
            let rate = |p| hit_rate(&trace, n, p).with_context(|| format!("--compare {n}"));
            let (b, lru, lfu, reuse) = (
                rate(Policy::Belady)?,
                rate(Policy::Lru)?,
                rate(Policy::Lfu)?,
                rate(Policy::Reuse)?,
            );
            let of_b = |x: f64| if b > 0.0 { x / b } else { 1.0 };
            println!(
                "| {n} | {:.1}% | {b:.3} | {lru:.3} | {lfu:.3} | {reuse:.3} | {:.2} | {:.2} |",
                100.0 * n as f64 / (layers * experts) as f64,
                of_b(lru),
                of_b(reuse)
            );
        }
    }
    Ok(())
}

/// Generates from `--prompt` or `--prompt-tokens`, recording each decoded token's routing into
/// `empty`.
fn record(a: &Args, empty: RoutingTrace) -> Result<RoutingTrace> {
    if a.model.backend == "cuda" {
        anyhow::bail!(
            "recording a routing runs on --backend cpu or reference (the engines that report their routes); the trace then replays on any backend with `brook bench --routing-trace`"
        );
    }
    let llm = a.model.open()?;
    let trace = Arc::new(Mutex::new(empty));
    let mut opts = GenOptions {
        max_tokens: Some(a.max_tokens),
        sampling: Some(a.sampling.params(&llm)),
        ignore_eos: a.sampling.ignore_eos,
        routes: Routes::Record(trace.clone()),
        ..Default::default()
    };
    opts.stop.clone_from(&a.sampling.stop);
    let mut session = llm.session();
    let c = match (&a.prompt, &a.prompt_tokens) {
        (_, Some(ids)) => session.generate(&super::parse_tokens(ids)?, &opts, None, &mut |_| {})?,
        (Some(p), None) => session.chat(Message::new("user", p.clone()), &opts, &mut |_| {})?,
        (None, None) => unreachable!("clap requires a source"),
    };
    eprintln!(
        "recorded {} decoded tokens ({:.2} tok/s){}",
        c.tokens.len(),
        c.usage.completion_tokens as f64 / c.usage.decode_s.max(1e-9),
        if c.content.is_empty() {
            String::new()
        } else {
            format!(": {:?}", c.content.chars().take(200).collect::<String>())
        }
    );
    drop(session);
    let t = std::mem::replace(
        &mut *trace.lock().unwrap_or_else(|p| p.into_inner()),
        RoutingTrace::new(1, 1, 1)?,
    );
    if t.tokens() == 0 {
        anyhow::bail!("the generation decoded no tokens: nothing to record");
    }
    Ok(t)
}
