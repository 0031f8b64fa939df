//! `brook pull`: an MLX checkpoint from the Hugging Face Hub into the model store.
//!
//! The download lands in the shared Hugging Face cache (so mlx-lm and huggingface_hub reuse it),
//! then is repacked into `BROOK_HOME/models/`. Both halves resume: run the same command again
//! after an interruption.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Result;
use brook_core::store::{Origin, Store, StoreEvent};
use brook_hub::{FileEvent, Hub, HubConfig, Progress, RepoId, RepoListing, Snapshot};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget};

use super::list::human;

/// Download an MLX checkpoint from the Hugging Face Hub and repack it into the model store.
/// Resumable: run the same command again after an interruption.
#[derive(Debug, clap::Args)]
#[command(after_help = "Example:
  brook pull mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit
  brook pull mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit --revision <commit>
  brook generate --model mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit --prompt 'Hello'

Environment: HF_TOKEN (private or gated repos; else HF_TOKEN_PATH or $HF_HOME/token),
HF_ENDPOINT, HF_HOME, HF_HUB_CACHE (where downloads go), BROOK_HOME (the model store).")]
pub struct Args {
    /// Hugging Face repo id: org/name.
    repo: String,
    /// Branch, tag or commit hash to download.
    #[arg(long, default_value = "main")]
    revision: String,
    /// Files downloaded at once.
    #[arg(long, default_value_t = 4, value_name = "N")]
    jobs: usize,
}

pub fn run(a: Args) -> Result<()> {
    let repo = RepoId::parse(&a.repo)?;
    let mut cfg = HubConfig::from_env();
    cfg.threads = a.jobs.max(1);
    let hub = Hub::new(cfg);
    let store = Store::from_env()?;
    let name = match a.revision.as_str() {
        "main" => repo.to_string(),
        rev => format!("{repo}@{rev}"),
    };
    let listing = hub.list(&repo, &a.revision)?;
    let commit = &listing.commit;
    if let Some(m) = store.find(&name)?
        && m.origin.as_ref().and_then(|o| o.commit.as_ref()) == Some(commit)
    {
        eprintln!(
            "{name} is up to date (commit {}) in {}",
            &commit[..12],
            m.dir.display()
        );
        return Ok(());
    }
    eprintln!(
        "pulling {repo} at {} ({} files, {}) into {}",
        &commit[..12],
        listing.files.len(),
        human(listing.total_size()),
        hub.config().cache_dir.display()
    );
    let snap = download(&hub, &listing)?;
    let reused = snap.bytes.saturating_sub(snap.fetched);
    eprintln!(
        "downloaded {} ({} fetched{})",
        snap.dir.display(),
        human(snap.fetched),
        if reused > 0 {
            format!(", {} already there", human(reused))
        } else {
            String::new()
        }
    );
    let origin = Origin {
        repo: Some(repo.to_string()),
        revision: Some(a.revision.clone()),
        commit: Some(snap.commit.clone()),
        source: snap.dir.clone(),
    };
    let dir = import(&store, &snap.dir, &name, &origin)?;
    eprintln!("ready: {} (use it as --model {name})", dir.display());
    Ok(())
}

/// Downloads with one bar for the whole pull and one per file in flight.
fn download(hub: &Hub, listing: &RepoListing) -> Result<Snapshot> {
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(4));
    let total = multi.add(super::byte_bar(listing.total_size(), "total"));
    let bars: Mutex<HashMap<String, ProgressBar>> = Mutex::default();
    let progress = |p: &Progress<'_>| {
        total.set_position(p.done);
        let mut bars = bars.lock().unwrap_or_else(|e| e.into_inner());
        match p.event {
            FileEvent::Cached => {}
            FileEvent::Retrying { attempt } => {
                multi.suspend(|| {
                    eprintln!("{}: connection lost, resuming (retry {attempt})", p.file)
                });
            }
            FileEvent::Done => {
                if let Some(b) = bars.remove(p.file) {
                    b.finish_and_clear();
                    multi.remove(&b);
                }
            }
            _ => {
                let bar = bars.entry(p.file.to_string()).or_insert_with(|| {
                    multi.insert_before(&total, super::byte_bar(p.file_total, short(p.file)))
                });
                bar.set_position(p.file_done);
            }
        }
    };
    let result = hub.download(listing, &progress);
    for (_, b) in bars.into_inner().unwrap_or_else(|e| e.into_inner()) {
        b.abandon();
    }
    total.finish_and_clear();
    Ok(result?)
}

/// Repacks the snapshot into the store with a progress bar.
fn import(store: &Store, snapshot: &Path, name: &str, origin: &Origin) -> Result<PathBuf> {
    let bar = super::byte_bar(0, "repack");
    let dir = store.import(snapshot, name, origin, &mut |e| match e {
        StoreEvent::Repacking { into, .. } => {
            bar.suspend(|| eprintln!("repacking into {}", into.display()));
        }
        StoreEvent::Repack(p) => {
            bar.set_length(p.bytes_total);
            bar.set_position(p.bytes_done);
        }
    })?;
    bar.finish_and_clear();
    Ok(dir)
}

/// A file name cut to fit the bar's label.
fn short(path: &str) -> &str {
    let name = path.rsplit('/').next().unwrap_or(path);
    match name.char_indices().nth(24) {
        Some((i, _)) => &name[..i],
        None => name,
    }
}

/// `--model` as given when it is a path (or cannot be a model name, so that opening it says
/// what is missing), else the stored model of that name (`brook list`).
pub fn resolve_model(model: &Path) -> Result<PathBuf> {
    let name = model.to_string_lossy();
    if model.exists() || brook_core::store::folder_name(&name).is_err() {
        return Ok(model.to_path_buf());
    }
    Ok(Store::from_env()?.resolve(&name, &mut |_| {})?)
}

/// Exit status of a Hub error: 2 bad name or access, 3 bad download, 4 disk, 5 network or Hub.
pub fn exit_code(e: &brook_hub::Error) -> u8 {
    use brook_hub::Error as E;
    match e {
        E::InvalidRepoId(_)
        | E::RepoNotFound { .. }
        | E::RevisionNotFound { .. }
        | E::Gated { .. }
        | E::Unauthorized { .. }
        | E::Offline => 2,
        E::Integrity { .. } => 3,
        E::DiskFull { .. } | E::Io { .. } => 4,
        E::Http { .. } | E::Network { .. } | E::Protocol { .. } => 5,
    }
}
