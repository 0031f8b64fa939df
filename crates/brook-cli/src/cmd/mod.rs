//! One module per subcommand, plus what they share.

pub mod generate;
pub mod logits;

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
