//! `brook rm`: a model out of the store.

use anyhow::Result;
use brook_core::store::Store;

use super::list::human;

/// Remove a model from the store. A Hugging Face download it came from stays in that cache.
#[derive(Debug, clap::Args)]
#[command(after_help = "Example:
  brook rm mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit")]
pub struct Args {
    /// The model's name as `brook list` shows it (org/name\[@revision\] or a folder name).
    name: String,
}

pub fn run(a: Args) -> Result<()> {
    let store = Store::from_env()?;
    let gone = store.remove(&a.name)?;
    eprintln!("removed {} ({})", gone.dir.display(), human(gone.size));
    if let Some(o) = gone.origin.as_ref().filter(|o| o.repo.is_some()) {
        eprintln!(
            "the download it was made from stays in the Hugging Face cache: {}",
            o.source.display()
        );
    }
    Ok(())
}
