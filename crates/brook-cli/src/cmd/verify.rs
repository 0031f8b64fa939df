//! `brook verify`: check a container's hashes, and optionally every byte against its source.

use std::path::PathBuf;

use anyhow::Result;
use brook_core::container::Container;
use brook_core::container::verify::verify;
use brook_core::{Checkpoint, TensorSource};

/// Verify a container: manifest, sizes, every expert's hash; with --source, every byte.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  brook verify ./qwen3.6-35b.brook --source ./Qwen3.6-35B-A3B-4bit"
)]
pub struct Args {
    /// Container folder.
    container: PathBuf,
    /// The MLX checkpoint it was made from, to compare every byte.
    #[arg(long)]
    source: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let c = Container::open(&a.container)?;
    let src = a.source.as_deref().map(Checkpoint::open).transpose()?;
    let bar = super::byte_bar(0, "verify");
    let report = verify(
        &c,
        src.as_ref().map(|s| s as &dyn TensorSource),
        &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        },
    )?;
    bar.finish_and_clear();
    if let Some(first) = report.mismatches.first() {
        // A bad model file: exit 3, like any other (docs: exit codes).
        anyhow::bail!(brook_core::Error::Checkpoint {
            path: a.container.clone(),
            reason: format!(
                "verification failed: {first} ({} problem(s) in total, {} experts checked); re-run `brook repack` (or `brook pull`) to rebuild it",
                report.mismatches.len(),
                report.experts_checked
            ),
        });
    }
    println!(
        "ok: {} experts and the dense file, {:.2} GB checked{}",
        report.experts_checked,
        report.bytes_checked as f64 / 1e9,
        if src.is_some() {
            ", identical to the source"
        } else {
            ""
        }
    );
    Ok(())
}
