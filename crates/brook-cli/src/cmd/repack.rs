//! `brook repack`: an MLX checkpoint folder to a brook container.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use brook_core::Checkpoint;
use brook_core::container::repack::{RepackSource, repack};

/// Repack an MLX checkpoint into a container (one aligned read per expert). Resumable: run
/// the same command again after an interruption and it continues where it stopped.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  brook repack ~/.cache/huggingface/hub/models--mlx-community--Qwen3.6-35B-A3B-4bit/snapshots/<rev> ./qwen3.6-35b.brook"
)]
pub struct Args {
    /// MLX checkpoint folder (single file or sharded; a Hugging Face snapshot of symlinks works).
    src: PathBuf,
    /// Output container folder: new, empty, or an unfinished repack of the same checkpoint.
    out: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let ck = Checkpoint::open(&a.src)?;
    let src = RepackSource::from_checkpoint(&ck)?;
    let start = Instant::now();
    let bar = super::byte_bar(0, "repack");
    let mut resumed = 0;
    let manifest = repack(&src, &a.out, &mut |p| {
        bar.set_length(p.bytes_total);
        bar.set_position(p.bytes_done);
        resumed = p.bytes_resumed;
    })?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    let total: u64 = manifest.dense.size
        + manifest
            .experts
            .layers
            .iter()
            .map(|l| l.stride * manifest.experts.num_experts as u64)
            .sum::<u64>();
    let written = total - resumed;
    eprintln!(
        "repacked {} into {} in {secs:.1} s: {:.2} GB written ({:.2} GB/s){}",
        a.src.display(),
        a.out.display(),
        written as f64 / 1e9,
        written as f64 / 1e9 / secs.max(1e-9),
        if resumed > 0 {
            format!(
                ", {:.2} GB kept from the interrupted run",
                resumed as f64 / 1e9
            )
        } else {
            String::new()
        }
    );
    Ok(())
}
