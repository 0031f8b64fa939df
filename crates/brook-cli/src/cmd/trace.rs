//! `brook trace`: routing traces for judging expert caches (docs/FORMAT.md, "Routing traces").

use std::path::PathBuf;

use anyhow::{Context, Result};
use brook_core::routing::RoutingTrace;
use brook_core::routing::replay::{Policy, hit_rate};
use brook_core::routing::simulate::{SimParams, simulate};

/// Write a simulated routing trace for a model's shape, or read one, and say how caches of
/// given sizes would do on it.
#[derive(Debug, clap::Args)]
#[command(
    group(clap::ArgGroup::new("source").required(true).args(["simulate", "trace"])),
    after_help = "Examples:\n  brook trace --model ./q36.brook --simulate realistic --tokens 256 --out q36-realistic.jsonl\n  brook trace --model ./q36.brook --trace q36-realistic.jsonl --compare 320,2048,3413"
)]
pub struct Args {
    /// Model (container, checkpoint or store name) whose layers, experts and top-k the trace
    /// has.
    #[arg(long)]
    model: PathBuf,
    /// Simulate routing with a preset's reuse: realistic (the statistics published for
    /// Qwen3-30B-A3B), strong, weak or uniform.
    #[arg(long, value_name = "PRESET")]
    simulate: Option<String>,
    /// Read a trace file instead (JSON Lines, one line per decoded token).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Decoded tokens to simulate.
    #[arg(long, default_value_t = 256)]
    tokens: usize,
    /// Seed of the simulation (the same seed gives the same trace).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write the trace.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Cache sizes (expert slots) to replay the trace through: the demand hit rate of
    /// Belady's optimum, LRU (brook's cache) and LFU at each.
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    compare: Vec<usize>,
}

pub fn run(a: Args) -> Result<()> {
    let path = super::pull::resolve_model(&a.model)?;
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
            a.seed,
        )?,
        (None, Some(file)) => RoutingTrace::read(file, layers, experts, k)?,
        (None, None) => unreachable!("clap requires --simulate or --trace"),
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
        println!("| slots | of all experts | Belady | LRU (brook) | LFU | LRU / Belady |");
        println!("|---:|---:|---:|---:|---:|---:|");
        for &n in &a.compare {
            let rate = |p| hit_rate(&trace, n, p).with_context(|| format!("--compare {n}"));
            let (b, lru, lfu) = (
                rate(Policy::Belady)?,
                rate(Policy::Lru)?,
                rate(Policy::Lfu)?,
            );
            println!(
                "| {n} | {:.1}% | {:.3} | {lru:.3} | {lfu:.3} | {:.2} |",
                100.0 * n as f64 / (layers * experts) as f64,
                b,
                if b > 0.0 { lru / b } else { 1.0 }
            );
        }
    }
    Ok(())
}
