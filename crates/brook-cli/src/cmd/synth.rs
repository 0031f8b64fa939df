//! `brook synth`: a random checkpoint (or container) with a released model's real shapes.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use brook_core::container::repack::repack;
use brook_core::synth::{self, SynthModel};

/// Write a random model with the real shapes, names, dtypes and quantization of a released
/// one, to measure speed and memory at full scale without a download.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Presets: qwen3.6-35b-a3b, qwen3.5-35b-a3b, qwen3-next-80b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, tiny\n\nExamples:\n  brook synth --preset qwen3.6-35b-a3b --out ./q36-synth --container\n  brook synth --preset qwen3-next-80b-a3b --bits 8 --out ./next-synth-ckpt"
)]
pub struct Args {
    /// Model shapes to copy.
    #[arg(long)]
    preset: String,
    /// Output folder (new or empty).
    #[arg(long)]
    out: PathBuf,
    /// Bits of the quantized weights (routers stay at 8, as mlx-lm writes them).
    #[arg(long, default_value_t = 4)]
    bits: u32,
    /// Write a brook container directly instead of an MLX checkpoint.
    #[arg(long)]
    container: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(a: Args) -> Result<()> {
    let store = SynthModel::new(&a.preset, a.bits, a.seed)?;
    let start = Instant::now();
    let bar = super::byte_bar(store.total_bytes(), "synth");
    if a.container {
        synth::prepare_empty(&a.out)?;
        synth::check_free_space(&a.out, store.total_bytes())?;
        let src = store.repack_source();
        repack(&src, &a.out, &mut |p| {
            bar.set_length(p.bytes_total);
            bar.set_position(p.bytes_done);
        })?;
    } else {
        synth::write_checkpoint(&store, &a.out, synth::SHARD_BYTES, &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        })?;
    }
    bar.finish_and_clear();
    let text = synth::write_text_files(&a.out, &store.config)?;
    let secs = start.elapsed().as_secs_f64();
    let gb = store.total_bytes() as f64 / 1e9;
    eprintln!(
        "wrote {} ({} {}-bit, {gb:.2} GB) to {} in {secs:.1} s ({:.2} GB/s)",
        if a.container {
            "container"
        } else {
            "checkpoint"
        },
        a.preset,
        a.bits,
        a.out.display(),
        gb / secs.max(1e-9)
    );
    if text > 0 {
        eprintln!(
            "with the real tokenizer, chat template and generation config of its family: `brook chat --model {}` talks (random text)",
            a.out.display()
        );
    }
    Ok(())
}
