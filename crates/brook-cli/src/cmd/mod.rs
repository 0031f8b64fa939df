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
