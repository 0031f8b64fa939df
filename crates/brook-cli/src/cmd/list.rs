//! `brook list`: the models in the store.

use anyhow::Result;
use brook_core::store::Store;

/// List the models in the store (BROOK_HOME/models): name, size on disk and source.
#[derive(Debug, clap::Args)]
#[command(after_help = "Example:
  brook list
  BROOK_HOME=/mnt/ssd/brook brook list --json")]
pub struct Args {
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let store = Store::from_env()?;
    let models = store.list()?;
    if a.json {
        let rows: Vec<serde_json::Value> = models
            .iter()
            .map(|m| {
                serde_json::json!({
                    "name": m.name, "path": m.dir, "size": m.size, "origin": m.origin,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if models.is_empty() {
        eprintln!(
            "no models in {}; get one with `brook pull org/name`",
            store.models_dir().display()
        );
        return Ok(());
    }
    let width = models
        .iter()
        .map(|m| m.name.len())
        .max()
        .unwrap_or(0)
        .max(4);
    println!("{:width$}  {:>9}  SOURCE", "NAME", "SIZE");
    for m in &models {
        let source = match &m.origin {
            Some(o) => match (&o.repo, &o.commit) {
                (Some(repo), Some(c)) => format!("{repo} @ {}", &c[..c.len().min(12)]),
                _ => o.source.display().to_string(),
            },
            None => "?".into(),
        };
        println!("{:width$}  {:>9}  {source}", m.name, human(m.size));
    }
    Ok(())
}

/// Bytes for people: `1.23 GB`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000_000 => format!("{:.1} kB", b / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.2} GB", b / 1e9),
    }
}
