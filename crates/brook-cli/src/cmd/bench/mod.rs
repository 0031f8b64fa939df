//! `brook bench`: llama-bench-style speed rows plus what streaming needs to be judged by:
//! time to first token, peak RSS, expert-cache hit rate, bytes read per token, achieved and
//! measured disk bandwidth, the ratio of decode speed to the disk/memory limit, and a
//! decoded token's time against the larger of its read time and its compute time (CPU
//! seconds per compute thread), which shows whether reads and compute overlap.
//!
//! A list of budgets or thread counts runs each combination in a child process, so each row's
//! peak RSS is its own.

use std::time::Instant;

use anyhow::{Context, Result};
use brook_core::experts::budget;
use std::sync::Arc;

use brook_core::routing::RoutingTrace;
use brook_core::session::{Event, GenOptions, Routes};
use brook_core::text::{SamplingParams, StreamOptions, TextStream};

mod parts;
mod row;
mod tables;
use parts::{dense_bytes, gpu_row, mean_sd, model_sizes, per_step, simd_label};
pub use row::{GpuRow, Row};
use tables::print_tables;

/// Measure prefill and decode speed, memory and I/O.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  brook bench --model ./q36.brook --memory-budget 3GiB\n  brook bench --model ./q36.brook --memory-budget 2GiB,3GiB,4GiB,8GiB -r 3 --json"
)]
pub struct Args {
    #[command(flatten)]
    model: super::ModelArgs,
    /// Prompt tokens of the prefill test (0 skips it).
    #[arg(short = 'p', long, default_value_t = 512)]
    n_prompt: usize,
    /// Generated tokens of the decode test (0 skips it).
    #[arg(short = 'n', long, default_value_t = 128)]
    n_gen: usize,
    /// Tokens already in the context when the decode test starts (llama-bench's -d): they are
    /// prefilled first, untimed, so decode reads their attention cache (needs --context at
    /// least depth + n-gen + 1).
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 3)]
    repetitions: usize,
    /// Seconds spent measuring the disk's own read bandwidth, before and again after the
    /// decode test (0 skips it).
    #[arg(long, default_value_t = 3.0)]
    disk_secs: f64,
    /// One JSON object per configuration instead of tables.
    #[arg(long)]
    json: bool,
    /// Decode replays this routing trace (JSON Lines, docs/FORMAT.md; `brook trace` records
    /// or simulates one): each decoded token uses the trace's experts in every layer instead
    /// of the routers' picks, so reads, cache hits and speed are those of that routing. The
    /// prompts route as usual; the generated text is meaningless. Prefetch is off while
    /// replaying (it guesses from the routers).
    #[arg(long, value_name = "FILE")]
    routing_trace: Option<std::path::PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let longest = a.n_prompt.max(a.depth + a.n_gen + 1);
    if longest > a.model.context {
        anyhow::bail!(brook_core::Error::Invalid(format!(
            "a test needs {longest} positions of context but --context is {}: raise --context to at least {longest}, or lower --depth, --n-gen or --n-prompt",
            a.model.context
        )));
    }
    let budgets: Vec<Option<String>> = match &a.model.memory_budget {
        Some(b) => b.split(',').map(|s| Some(s.trim().to_string())).collect(),
        None => vec![None],
    };
    let threads: Vec<Option<usize>> = if a.model.threads.is_empty() {
        vec![None]
    } else {
        a.model.threads.iter().map(|&t| Some(t)).collect()
    };
    let rows = if budgets.len() > 1 || threads.len() > 1 {
        let mut rows = Vec::new();
        for b in &budgets {
            for t in &threads {
                rows.push(run_child(&a, b.as_deref(), *t)?);
                if !a.json {
                    eprintln!(
                        "done: budget {}, threads {}",
                        b.as_deref().unwrap_or("auto"),
                        t.map_or("all".to_string(), |t| t.to_string())
                    );
                }
            }
        }
        rows
    } else {
        vec![run_one(&a)?]
    };
    if a.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        print_tables(&rows);
    }
    Ok(())
}

fn run_child(a: &Args, budget: Option<&str>, threads: Option<usize>) -> Result<Row> {
    let exe = std::env::current_exe().context("finding the brook binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("bench")
        .arg("--model")
        .arg(&a.model.model)
        .arg("--json");
    cmd.args(["-p", &a.n_prompt.to_string(), "-n", &a.n_gen.to_string()]);
    cmd.args(["-d", &a.depth.to_string()]);
    cmd.args([
        "-r",
        &a.repetitions.to_string(),
        "--disk-secs",
        &a.disk_secs.to_string(),
    ]);
    cmd.args([
        "--context",
        &a.model.context.to_string(),
        "--prefill-chunk",
        &a.model.prefill_chunk.to_string(),
        "--backend",
        &a.model.backend,
    ]);
    if let Some(b) = budget {
        cmd.args(["--memory-budget", b]);
    }
    if let Some(t) = threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    if let Some(g) = &a.model.gpu_memory_budget {
        cmd.args(["--gpu-memory-budget", g]);
    }
    if let Some(n) = a.model.expert_cache {
        cmd.args(["--expert-cache", &n.to_string()]);
    }
    if a.model.no_prefetch {
        cmd.arg("--no-prefetch");
    }
    cmd.args(["--cache-eviction", &a.model.cache_eviction]);
    if a.model.fill_cache {
        cmd.arg("--fill-cache");
    }
    cmd.args(["--precision", &a.model.precision]);
    if let Some(t) = &a.routing_trace {
        cmd.arg("--routing-trace").arg(t);
    }
    let out = cmd.output().context("running a bench child")?;
    if !out.status.success() {
        anyhow::bail!(
            "bench with budget {} failed: {}",
            budget.unwrap_or("auto"),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// What the prefill and decode tests measured (see [`run_tests`]).
struct Runs {
    /// Prefill tok/s and time to first token of each repetition.
    pp: Vec<f64>,
    ttft: Vec<f64>,
    /// Decode tok/s of each repetition.
    tg: Vec<f64>,
    /// Decoded steps in all.
    steps: u64,
    /// CPU seconds of the decode tests (the prompts' prefill excluded).
    decode_cpu_s: f64,
    /// The expert cache's counters over the decode tests.
    delta: Option<brook_core::experts::CacheStats>,
    /// The GPU's counters before and after the decode tests.
    gpu: Option<(brook_core::engine::GpuStats, brook_core::engine::GpuStats)>,
    /// The disk's and the memory's bandwidths before and after the decode tests.
    disk: (f64, f64),
    mem: (super::MemReads, super::MemReads),
}

/// Runs the warm-up, the prefill tests and the decode tests of `a` on `llm` (decode replaying
/// `trace` where given), each through a session as chat and serve run it, and measures the
/// disk and memory right before and right after the decode tests.
fn run_tests(
    a: &Args,
    llm: &Arc<brook_core::session::Llm>,
    trace: Option<&Arc<RoutingTrace>>,
    threads: usize,
    path: &std::path::Path,
    container: bool,
) -> Result<Runs> {
    let model = &llm.model;
    let cfg = &model.cfg;
    // The disk's own bandwidth, measured right before and right after the decode test (the
    // disk is shared and drifts by 2x between minutes; one measurement before the prefill,
    // half a minute earlier, put the decode's read time off by as much).
    let measure_disk = || -> Result<f64> {
        Ok(if container && a.disk_secs > 0.0 {
            let c = brook_core::container::Container::open(path)?;
            brook_core::experts::files::ExpertFiles::open(&c)?.measure_bandwidth(8, a.disk_secs)?
        } else {
            0.0
        })
    };
    // The memory's read bandwidth, like the disk's, right before and right after the decode
    // test (this host's moves between 21 and 46 GB/s from one minute to the next). Not
    // between decoded tokens: reads there evicted the caches the next tokens used, and the
    // decode figure fell to 0.75-0.83 x what generate, chat and serve decoded on the same
    // model in the same sitting (docs/BENCH.md, "Faces against bench").
    let measure_mem = || super::memory_reads(model, threads, 5, 1.0);

    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut token = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % cfg.vocab_size as u64) as u32
    };
    // Every test runs through the calls chat and serve make: a session's prefill, the
    // sampler, the text stream (detokenizing and stop checks) where the model has a
    // tokenizer, greedy and past end-of-sequence ids as llama-bench runs.
    let base = GenOptions {
        sampling: Some(SamplingParams::default()),
        ignore_eos: true,
        ..Default::default()
    };
    let run = |prompt: &[u32], n: usize, routes: Routes, on_event: &mut dyn FnMut(Event)| {
        let mut session = llm.session();
        let opts = GenOptions {
            max_tokens: Some(n),
            routes,
            ..base.clone()
        };
        let mut text = llm
            .tokenizer
            .clone()
            .map(|t| TextStream::new(t, StreamOptions::default()));
        session.generate(prompt, &opts, text.as_mut(), on_event)
    };
    // Warm-up: one short prefill and a few steps (not counted).
    {
        let p: Vec<u32> = (0..8).map(|_| token()).collect();
        run(&p, 2, Routes::Router, &mut |_| {})?;
    }
    let mut pp = Vec::new();
    let mut ttft = Vec::new();
    if a.n_prompt > 0 {
        for _ in 0..a.repetitions {
            let prompt: Vec<u32> = (0..a.n_prompt).map(|_| token()).collect();
            let c = run(&prompt, 1, Routes::Router, &mut |_| {})?;
            ttft.push(c.usage.prefill_s);
            pp.push(a.n_prompt as f64 / c.usage.prefill_s.max(1e-9));
        }
    }
    let disk_before = measure_disk()?;
    let mem_before = measure_mem();
    let mut tg = Vec::new();
    let before = model.experts.stats();
    let gpu_before = llm.gpu_stats();
    let mut steps = 0u64;
    let mut decode_cpu_s = 0.0;
    if a.n_gen > 0 {
        for rep in 0..a.repetitions {
            // The depth's tokens and the first token are the prompt (its prefill untimed).
            let prompt: Vec<u32> = (0..a.depth + 1).map(|_| token()).collect();
            // A replayed trace runs on from where the last repetition left it.
            let routes = match trace {
                Some(t) => Routes::Replay {
                    trace: t.clone(),
                    start: rep * a.n_gen,
                },
                None => Routes::Router,
            };
            // CPU time from the first sampled token on (the prompt's prefill excluded).
            let mut cpu0 = None;
            let c = run(&prompt, a.n_gen, routes, &mut |e| {
                if matches!(e, Event::Token(_)) {
                    cpu0.get_or_insert_with(budget::cpu_seconds);
                }
            })?;
            decode_cpu_s += budget::cpu_seconds() - cpu0.unwrap_or_else(budget::cpu_seconds);
            tg.push(c.usage.completion_tokens as f64 / c.usage.decode_s.max(1e-9));
            steps += a.n_gen as u64 + 1;
        }
    }
    let gpu_after = llm.gpu_stats();
    let delta = match (model.experts.stats(), before) {
        (Some(after), Some(before)) => Some(after.since(&before)),
        _ => None,
    };
    let disk_after = if a.n_gen > 0 {
        measure_disk()?
    } else {
        disk_before
    };
    let mem_after = if a.n_gen > 0 {
        measure_mem()
    } else {
        mem_before.clone()
    };
    Ok(Runs {
        pp,
        ttft,
        tg,
        steps,
        decode_cpu_s,
        delta,
        gpu: gpu_before.zip(gpu_after),
        disk: (disk_before, disk_after),
        mem: (mem_before, mem_after),
    })
}

fn run_one(a: &Args) -> Result<Row> {
    // The GPU's own bandwidths, before the model takes its memory.
    let gpu_bw = if a.model.backend == "cuda" {
        Some(
            brook_cuda::gpu::Gpu::open(0, None)
                .and_then(|g| brook_cuda::gpu::measure_bandwidth(&g))?,
        )
    } else {
        None
    };
    let t0 = Instant::now();
    let opts = a.model.options()?;
    let path = a.model.path()?;
    let llm = a.model.open()?;
    let model = &llm.model;
    let open_s = t0.elapsed().as_secs_f64();
    let cfg = model.cfg.clone();
    let threads = a
        .model
        .threads
        .first()
        .copied()
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));

    let container = brook_core::container::is_container(&path);
    let (model_bytes, expert_bytes) = model_sizes(&path)?;
    let trace = a
        .routing_trace
        .as_ref()
        .map(|f| {
            RoutingTrace::read(
                f,
                cfg.num_hidden_layers,
                cfg.num_experts,
                cfg.num_experts_per_tok,
            )
            .map(Arc::new)
        })
        .transpose()?;
    if let (Some(t), Some(f), false) = (&trace, &a.routing_trace, a.json) {
        eprintln!(
            "decode replays the routing of {} ({} tokens): its text is meaningless",
            f.display(),
            t.tokens()
        );
    }
    let Runs {
        pp,
        ttft,
        tg,
        steps,
        decode_cpu_s,
        delta,
        gpu: gpu_stats,
        disk: (disk_before, disk_after),
        mem: (mem_before, mem_after),
    } = run_tests(a, &llm, trace.as_ref(), threads, &path, container)?;
    let disk_bw = (disk_before + disk_after) / 2.0;
    // The median of every read, before and after.
    let mem_bw = {
        let mut all = mem_before.clone();
        if a.n_gen > 0 {
            all.extend(&mem_after);
        }
        all.median()
    };
    let (_, peak) = budget::rss();
    let (pp_m, pp_sd) = mean_sd(&pp);
    let (tg_m, tg_sd) = mean_sd(&tg);
    let bytes_read_per_token = delta.map_or(0.0, |d| per_step(d.bytes_read, steps));
    let expert_bytes_one = expert_bytes as f64 / (cfg.num_experts * cfg.num_hidden_layers) as f64;
    let embed = (model.dense.embed_tokens.table_bytes()) as f64;
    let dense_bytes = dense_bytes(model) as f64 - embed;
    let touched =
        dense_bytes + (cfg.num_experts_per_tok * cfg.num_hidden_layers) as f64 * expert_bytes_one;
    // The disk's bandwidth for the limit: the measurement before the runs, or what the runs'
    // own reads achieved while in flight when that is more (the disk is shared, and a
    // measurement that ran low would put the limit below what was reached).
    let achieved = delta.map_or(0.0, |d| d.read_gb_s()) * 1e9;
    let limit_disk_bw = if disk_bw > 0.0 {
        disk_bw.max(achieved)
    } else {
        0.0
    };
    // The states a decoded token moves, at the decode test's middle position; the CPU's
    // fast path holds the DeltaNet states in bf16 while it decodes.
    let ssm_bytes = if a.model.backend == "cpu" && a.model.precision == "fast" {
        2
    } else {
        4
    };
    let state = cfg.decode_state_bytes(a.depth + 1 + a.n_gen / 2, ssm_bytes) as f64;
    let weights_s = touched / (mem_bw * 1e9).max(1.0);
    let mut limit_s = (touched + state) / (mem_bw * 1e9).max(1.0);
    let read_s_per_token = if limit_disk_bw > 0.0 {
        bytes_read_per_token / limit_disk_bw
    } else {
        0.0
    };
    limit_s = limit_s.max(read_s_per_token);
    let decoded = (a.n_gen * a.repetitions) as f64;
    let compute_s_per_token = if a.model.backend == "cpu" && decoded > 0.0 {
        decode_cpu_s / threads.max(1) as f64 / decoded
    } else {
        0.0
    };
    let gpu = match (gpu_stats, gpu_bw) {
        (Some((b, g)), Some(bw)) => {
            Some(gpu_row(&b, g, bw, touched + state, steps, read_s_per_token))
        }
        _ => None,
    };
    Ok(Row {
        model: a
            .model
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        model_bytes,
        budget_bytes: opts.memory_budget,
        threads,
        precision: a.model.precision.clone(),
        simd: simd_label(),
        prefetch: model.prefetch && trace.is_none(),
        expert_slots: model
            .experts
            .stats()
            .map(|_| model.experts.capacity())
            .filter(|&c| c != usize::MAX),
        expert_slots_max: model.experts.stats().map(|s| s.slots_max as usize),
        n_prompt: a.n_prompt,
        n_gen: a.n_gen,
        depth: a.depth,
        pp_tok_s: pp_m,
        pp_tok_s_sd: pp_sd,
        tg_tok_s: tg_m,
        tg_tok_s_sd: tg_sd,
        ttft_s: mean_sd(&ttft).0,
        peak_rss_bytes: peak,
        hit_rate: delta.map_or(1.0, |d| d.hit_rate()),
        demand_hit_rate: delta.map_or(1.0, |d| d.hit_rate()),
        prefetch_reads: delta.map_or(0, |d| d.prefetches),
        prefetch_used: delta.map_or(0, |d| d.prefetch_hits),
        eviction: a.model.cache_eviction.clone(),
        routing_trace: a.routing_trace.as_ref().map(|f| f.display().to_string()),
        routing_trace_tokens: trace.as_ref().map_or(0, |t| t.tokens()),
        bytes_read_per_token,
        disk_gb_s: delta.map_or(0.0, |d| d.read_gb_s()),
        disk_bw_gb_s: disk_bw / 1e9,
        disk_bw_before_gb_s: disk_before / 1e9,
        disk_bw_after_gb_s: disk_after / 1e9,
        mem_bw_gb_s: mem_bw,
        mem_bw_before_gb_s: mem_before.median(),
        mem_bw_after_gb_s: mem_after.median(),
        mem_bw_best_gb_s: mem_before.best().max(mem_after.best()),
        bytes_touched_per_token: touched,
        state_bytes_per_token: state,
        limit_tok_s: if limit_s > 0.0 { 1.0 / limit_s } else { 0.0 },
        limit_weights_tok_s: 1.0 / weights_s.max(read_s_per_token).max(1e-12),
        compute_s_per_token,
        read_s_per_token,
        open_s,
        backend: llm.engine_stats().engine,
        commit: env!("BROOK_COMMIT").to_string(),
        gpu,
    })
}
