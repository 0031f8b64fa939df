//! `brook demo`: brook's main job with no download. Synthesizes (once, cached in the store)
//! a random container with the real shapes of Qwen3.6-35B-A3B, streams it under a memory
//! budget, prints a short generation and the bench rows.

use std::time::Instant;

use std::io::Write;

use anyhow::Result;
use brook_core::container::repack::repack;
use brook_core::session::{Event, GenOptions};
use brook_core::synth::{self, SynthModel};
use brook_core::text::{Message, SamplingParams};

/// Run the 35B-shaped model from the SSD under a small budget: synthesize it once, generate,
/// and print benchmark rows.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  brook demo                      # Qwen3.6-35B-A3B shapes, 3 GiB budget\n  brook demo --preset qwen3-next-80b-a3b --memory-budget 4GiB"
)]
pub struct Args {
    /// Model shapes to synthesize.
    #[arg(long, default_value = "qwen3.6-35b-a3b")]
    preset: String,
    /// Memory budget to stream under.
    #[arg(long, default_value = "3GiB")]
    memory_budget: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Prompt tokens of the prefill row.
    #[arg(short = 'p', long, default_value_t = 128)]
    n_prompt: usize,
    /// Generated tokens of the decode row.
    #[arg(short = 'n', long, default_value_t = 32)]
    n_gen: usize,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

pub fn run(a: Args) -> Result<()> {
    let store = brook_core::store::Store::from_env()?;
    let dir = store
        .root()
        .join("synth")
        .join(format!("{}-4bit", a.preset));
    if !brook_core::container::is_container(&dir) {
        let s = SynthModel::new(&a.preset, 4, 0)?;
        eprintln!(
            "synthesizing a random {} container ({:.1} GB, once) in {}",
            a.preset,
            s.total_bytes() as f64 / 1e9,
            dir.display()
        );
        std::fs::create_dir_all(&dir)?;
        synth::check_free_space(&dir, s.total_bytes())?;
        let bar = super::byte_bar(s.total_bytes(), "synth");
        let t = Instant::now();
        repack(&s.repack_source(), &dir, &mut |p| {
            bar.set_length(p.bytes_total);
            bar.set_position(p.bytes_done);
        })?;
        bar.finish_and_clear();
        eprintln!("done in {:.0} s", t.elapsed().as_secs_f64());
    }
    // Caches made before synth wrote the text files get them now.
    let store_cfg = brook_core::container::Container::open(&dir)?.config;
    synth::write_text_files(&dir, &store_cfg)?;
    let args = super::ModelArgs {
        model: dir.clone(),
        memory_budget: Some(a.memory_budget.clone()),
        expert_cache: None,
        fill_cache: false,
        context: 4096,
        prefill_chunk: brook_core::model::open::PREFILL_CHUNK,
        no_prefetch: false,
        cache_eviction: "auto".into(),
        backend: "cpu".into(),
        gpu_memory_budget: None,
        threads: a.threads.into_iter().collect(),
        precision: "exact".into(),
        verify_reads: false,
    };
    let llm = args.open()?;
    let model = &llm.model;
    let total = model.cfg.num_experts * model.cfg.num_hidden_layers;
    let (slots, max) = model
        .experts
        .stats()
        .map_or((total, total), |s| (s.slots as usize, s.slots_max as usize));
    println!(
        "{} (random weights, real shapes) streaming under {}: {slots} expert slots of the {max} the budget pays for ({total} experts; the cache takes more once that pays)",
        a.preset, a.memory_budget,
    );
    let question = "Why is the sky blue?";
    let opts = GenOptions {
        max_tokens: Some(a.max_tokens),
        sampling: Some(SamplingParams::default()),
        enable_thinking: Some(false),
        ..Default::default()
    };
    let mut session = llm.session();
    println!("> {question}");
    let mut out = std::io::stdout();
    let c = session.chat(Message::new("user", question), &opts, &mut |e| {
        if let Event::Content(t) = e {
            let _ = write!(out, "{t}");
            let _ = out.flush();
        }
    })?;
    let u = c.usage;
    println!(
        "\n(greedy, random weights, so the words are noise: {} prompt tokens at {:.1} tok/s, {} tokens at {:.2} tok/s on the {} engine)",
        u.prompt_tokens,
        u.prompt_tokens as f64 / u.prefill_s.max(1e-9),
        u.completion_tokens,
        u.completion_tokens as f64 / u.decode_s.max(1e-9),
        llm.engine_stats().engine,
    );
    drop(session);
    drop(llm);
    // The bench rows, in a fresh process so peak RSS is its own.
    let exe = std::env::current_exe()?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("bench").arg("--model").arg(&dir);
    cmd.args([
        "--memory-budget",
        &a.memory_budget,
        "-r",
        "1",
        "--disk-secs",
        "2",
    ]);
    cmd.args(["-p", &a.n_prompt.to_string(), "-n", &a.n_gen.to_string()]);
    if let Some(t) = a.threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    let status = cmd.status()?;
    if !status.success() {
        anyhow::bail!("brook bench failed");
    }
    let d = dir.display();
    println!(
        "\nTalk to it (random text through the real tokenizer and template):\n  brook chat --model {d} --memory-budget {b}\nServe it (OpenAI API at /v1, web chat page at /):\n  brook serve --model {d} --memory-budget {b}",
        b = a.memory_budget
    );
    Ok(())
}
