//! One module per subcommand, plus what they share.

pub mod generate;
pub mod logits;
pub mod repack;
pub mod synth;
pub mod verify;

use anyhow::Result;
use brook_core::Error;

/// Parses a comma-separated list of token ids such as `1,2,3`.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>().map_err(|_| {
                Error::Invalid(format!("`{t}` is not a token id (expected e.g. 1,2,3)"))
            })
        })
        .collect::<Result<Vec<_>, Error>>()
        .and_then(|v| {
            if v.is_empty() {
                Err(Error::Invalid("no token ids given".into()))
            } else {
                Ok(v)
            }
        })
        .map_err(Into::into)
}

/// A progress bar over bytes with rate and ETA, hidden when stderr is not a terminal.
pub fn byte_bar(total: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr_with_hz(4),
    );
    let style = indicatif::ProgressStyle::with_template(
        "{msg:10} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}

/// Flags shared by every command that runs a model.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model: a brook container, or an MLX checkpoint folder (loaded whole).
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// Hard ceiling on memory, e.g. 3GiB or 2500M; default: from the cgroup limit and free memory.
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// Number of expert slots, overriding the budget's choice (for experiments).
    #[arg(long, value_name = "N")]
    pub expert_cache: Option<usize>,
    /// Longest sequence (prompt + generation) to size the state for.
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Prefetch the next layer's likely experts (experimental).
    #[arg(long)]
    pub prefetch: bool,
    /// Compute backend.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "reference", "cuda"])]
    pub backend: String,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

impl ModelArgs {
    /// Library open options from the flags.
    pub fn options(&self) -> Result<brook_core::model::open::OpenOptions> {
        if self.backend == "cuda" {
            return Err(Error::Invalid(
                "--backend cuda: this build has no CUDA backend yet; use --backend cpu".into(),
            )
            .into());
        }
        Ok(brook_core::model::open::OpenOptions {
            memory_budget: self
                .memory_budget
                .as_deref()
                .map(brook_core::experts::budget::parse_size)
                .transpose()?,
            expert_cache: self.expert_cache,
            context: self.context,
            prefetch: self.prefetch,
            ..Default::default()
        })
    }

    /// Opens the model.
    pub fn open(&self) -> Result<brook_core::Model> {
        Ok(brook_core::Model::open_with(&self.model, &self.options()?)?)
    }
}
