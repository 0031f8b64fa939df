//! brook-hub: a small, blocking, resumable Hugging Face Hub client for `brook pull`.
//!
//! It lists a model repository at one revision through the Hub API, downloads every file with a
//! few threads into the shared Hugging Face cache (the layout huggingface_hub and mlx-lm read,
//! see [`cache`]), resumes interrupted files with `Range` requests, and verifies each file's size
//! and hash before it becomes visible. It knows nothing about models or containers: brook-core
//! never depends on it, and the CLI joins the two.
//!
//! ```no_run
//! use brook_hub::{Hub, HubConfig, RepoId};
//! let hub = Hub::new(HubConfig::from_env());
//! let repo = RepoId::parse("mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit")?;
//! let snapshot = hub.snapshot(&repo, "main", &|p| eprintln!("{} {}/{}", p.file, p.done, p.total))?;
//! println!("checkpoint in {}", snapshot.dir.display());
//! # Ok::<(), brook_hub::Error>(())
//! ```

pub mod api;
pub mod cache;
pub mod config;
pub mod download;
pub mod error;
mod http;
pub mod repo;

pub use api::{RepoFile, RepoListing};
pub use config::{HubConfig, Token, TokenSource};
pub use download::{FileEvent, Progress, Snapshot};
pub use error::{Error, Result};
pub use repo::RepoId;

/// A Hub client: one configuration and one connection pool, shared by the download threads.
#[derive(Debug, Clone)]
pub struct Hub {
    cfg: HubConfig,
    agent: ureq::Agent,
}

impl Hub {
    /// A client for `cfg` (see [`HubConfig::from_env`] for the usual one).
    pub fn new(cfg: HubConfig) -> Self {
        let agent = http::agent(&cfg);
        Hub { cfg, agent }
    }

    /// The configuration this client uses.
    pub fn config(&self) -> &HubConfig {
        &self.cfg
    }

    /// The files of `repo` at `revision` (a branch, tag or commit), with the commit it resolves to.
    pub fn list(&self, repo: &RepoId, revision: &str) -> Result<RepoListing> {
        api::list(self, repo, revision)
    }

    /// Downloads every file of `listing` into the cache (resuming what an earlier run left) and
    /// records `refs/{revision}`; returns the snapshot folder.
    pub fn download(
        &self,
        listing: &RepoListing,
        progress: &(dyn Fn(&Progress<'_>) + Sync),
    ) -> Result<Snapshot> {
        download::download(self, listing, progress)
    }

    /// [`Hub::list`] then [`Hub::download`].
    pub fn snapshot(
        &self,
        repo: &RepoId,
        revision: &str,
        progress: &(dyn Fn(&Progress<'_>) + Sync),
    ) -> Result<Snapshot> {
        let listing = self.list(repo, revision)?;
        self.download(&listing, progress)
    }
}
