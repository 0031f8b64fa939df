//! The model store: finished containers under `BROOK_HOME/models/`, found by name.
//!
//! `BROOK_HOME` (default `$XDG_CACHE_HOME/brook`, else `~/.cache/brook`) holds
//! `models/{org}--{name}[@revision]/`: a container plus [`ORIGIN_FILE`] saying where it came
//! from. Checkpoints are repacked in `models/.partial/{folder}-{source hash}/`, where an
//! interrupted repack of the same source resumes, and renamed into place when finished, so a
//! folder in `models/` is always a whole container. Local checkpoint folders get
//! `local--{folder name}-{path hash}`.
//!
//! This module only reads `BROOK_HOME`/`XDG_CACHE_HOME`/`HOME`, never the network (downloading is
//! brook-hub's), and prints nothing: the caller hears about repacks through [`StoreEvent`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoint;
use crate::container::repack::{RepackProgress, RepackSource, repack, write_atomic};
use crate::container::{Manifest, hash_hex, is_container};
use crate::error::{Error, Result};

/// Written beside `manifest.json` in every stored container.
pub const ORIGIN_FILE: &str = "brook-origin.json";

/// Where a stored container came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// The Hugging Face repo id, for pulled models.
    #[serde(default)]
    pub repo: Option<String>,
    #[serde(default)]
    pub revision: Option<String>,
    /// The commit the revision resolved to when pulled.
    #[serde(default)]
    pub commit: Option<String>,
    /// The checkpoint folder it was repacked from.
    pub source: PathBuf,
}

/// One container in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredModel {
    /// What to call it: `org/name[@revision]` for pulled models, else the folder name.
    pub name: String,
    /// The folder under `models/`.
    pub folder: String,
    pub dir: PathBuf,
    /// Bytes of all its files.
    pub size: u64,
    pub origin: Option<Origin>,
}

/// What the store is doing, for the caller to show.
#[derive(Debug, Clone, Copy)]
pub enum StoreEvent<'a> {
    /// A checkpoint is being repacked (or an interrupted repack resumed) into the store.
    Repacking {
        source: &'a Path,
        into: &'a Path,
    },
    Repack(RepackProgress),
}

/// A `BROOK_HOME` folder.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Store { root: root.into() }
    }

    /// The store `BROOK_HOME` names, else `$XDG_CACHE_HOME/brook`, else `~/.cache/brook`.
    pub fn from_env() -> Result<Self> {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        var("BROOK_HOME")
            .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("brook")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/brook")))
            .map(Store::new)
            .ok_or_else(|| {
                Error::Invalid("no home folder: set BROOK_HOME to a folder for models".into())
            })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn models_dir(&self) -> PathBuf {
        self.root.join("models")
    }

    /// The container folder for a model name (which need not exist yet).
    pub fn model_dir(&self, name: &str) -> Result<PathBuf> {
        Ok(self.models_dir().join(folder_name(name)?))
    }

    /// Every finished container, by folder name.
    pub fn list(&self) -> Result<Vec<StoredModel>> {
        let models = self.models_dir();
        let entries = match std::fs::read_dir(&models) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io(&models, e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(&models, e))?;
            let folder = entry.file_name().to_string_lossy().into_owned();
            if !folder.starts_with('.') && is_container(&entry.path()) {
                out.push(self.describe(&folder)?);
            }
        }
        out.sort_by(|a, b| a.folder.cmp(&b.folder));
        Ok(out)
    }

    /// The finished container called `name`, if any.
    pub fn find(&self, name: &str) -> Result<Option<StoredModel>> {
        let folder = folder_name(name)?;
        if !is_container(&self.models_dir().join(&folder)) {
            return Ok(None);
        }
        self.describe(&folder).map(Some)
    }

    /// Deletes the model `name` and any unfinished repack of it; returns what was removed.
    pub fn remove(&self, name: &str) -> Result<StoredModel> {
        let folder = folder_name(name)?;
        let dir = self.models_dir().join(&folder);
        let partials = self.partials(&folder)?;
        if !dir.exists() && partials.is_empty() {
            return Err(Error::Invalid(format!(
                "no model `{name}` in {}; `brook list` shows what is there",
                self.models_dir().display()
            )));
        }
        let gone = if dir.exists() {
            self.describe(&folder)?
        } else {
            StoredModel {
                name: name.to_string(),
                folder: folder.clone(),
                dir: dir.clone(),
                size: 0,
                origin: None,
            }
        };
        let mut size = 0;
        for d in partials.iter().chain(dir.exists().then_some(&dir)) {
            size += dir_size(d);
            std::fs::remove_dir_all(d).map_err(|e| Error::io(d, e))?;
        }
        Ok(StoredModel { size, ..gone })
    }

    /// Repacks the MLX checkpoint at `checkpoint` into the store as `name` (resuming an
    /// interrupted repack of it), unless the container there was made from the same checkpoint.
    /// Returns the container folder.
    pub fn import(
        &self,
        checkpoint: &Path,
        name: &str,
        origin: &Origin,
        events: &mut dyn FnMut(StoreEvent<'_>),
    ) -> Result<PathBuf> {
        let folder = folder_name(name)?;
        let dest = self.models_dir().join(&folder);
        let ck = Checkpoint::open(checkpoint)?;
        let src = RepackSource::from_checkpoint(&ck)?;
        if is_container(&dest) && same_source(&dest, &src) {
            write_origin(&dest, origin)?;
            return Ok(dest);
        }
        let key = hash_hex(&serde_json::to_vec(&src.identity.files).unwrap_or_default());
        let partials = self.models_dir().join(".partial");
        let partial = partials.join(format!("{folder}-{key}"));
        // Two processes opening the same checkpoint at once: the second waits for the first
        // and then finds its container.
        std::fs::create_dir_all(&partials).map_err(|e| Error::io(&partials, e))?;
        let lock_path = partials.join(format!("{folder}-{key}.lock"));
        let lock = std::fs::File::create(&lock_path).map_err(|e| Error::io(&lock_path, e))?;
        lock.lock().map_err(|e| Error::io(&lock_path, e))?;
        if is_container(&dest) && same_source(&dest, &src) {
            write_origin(&dest, origin)?;
            return Ok(dest);
        }
        events(StoreEvent::Repacking {
            source: checkpoint,
            into: &dest,
        });
        // A run killed between finishing the repack and moving it into place left a whole
        // container here: install it. One of another source (the key is a hash) is redone.
        if is_container(&partial) && !same_source(&partial, &src) {
            std::fs::remove_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
        }
        if !is_container(&partial) {
            repack(&src, &partial, &mut |p| events(StoreEvent::Repack(p)))?;
        }
        write_origin(&partial, origin)?;
        install(&partial, &dest)?;
        // Whoever waits on this lock re-checks `dest` once it has it, so the file may go now.
        let _ = std::fs::remove_file(&lock_path);
        Ok(dest)
    }

    /// The container a `--model` argument means: a container folder as it is; an MLX checkpoint
    /// folder repacked into the store on first use (announced by [`StoreEvent::Repacking`]); or
    /// the name of a stored model (`org/name[@revision]`, as `brook list` shows it).
    pub fn resolve(
        &self,
        name_or_path: &str,
        events: &mut dyn FnMut(StoreEvent<'_>),
    ) -> Result<PathBuf> {
        let path = Path::new(name_or_path);
        if path.exists() {
            if is_container(path) {
                return Ok(path.to_path_buf());
            }
            if !path.join("config.json").is_file() {
                return Err(Error::Checkpoint {
                    path: path.to_path_buf(),
                    reason: "neither a brook container (manifest.json) nor an MLX checkpoint (config.json)".into(),
                });
            }
            let source = std::fs::canonicalize(path).map_err(|e| Error::io(path, e))?;
            let origin = Origin {
                repo: None,
                revision: None,
                commit: None,
                source: source.clone(),
            };
            return self.import(path, &local_name(&source), &origin, events);
        }
        match folder_name(name_or_path).map(|f| self.models_dir().join(f)) {
            Ok(dir) if is_container(&dir) => Ok(dir),
            _ => Err(Error::Invalid(format!(
                "`{name_or_path}` is neither a path nor a model in {}; pull it with `brook pull {name_or_path}` (`brook list` shows what is there)",
                self.models_dir().display()
            ))),
        }
    }

    fn describe(&self, folder: &str) -> Result<StoredModel> {
        let dir = self.models_dir().join(folder);
        let origin: Option<Origin> =
            crate::util::read_capped(&dir.join(ORIGIN_FILE), crate::util::MAX_CONFIG)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
        let name = match origin
            .as_ref()
            .and_then(|o| o.repo.as_ref().map(|r| (r, &o.revision)))
        {
            Some((repo, Some(rev))) if rev != "main" => format!("{repo}@{rev}"),
            Some((repo, _)) => repo.clone(),
            None => folder.to_string(),
        };
        Ok(StoredModel {
            name,
            folder: folder.to_string(),
            size: dir_size(&dir),
            dir,
            origin,
        })
    }

    /// Unfinished repacks of `folder`.
    fn partials(&self, folder: &str) -> Result<Vec<PathBuf>> {
        let dir = self.models_dir().join(".partial");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Ok(Vec::new());
        };
        let prefix = format!("{folder}-");
        let mut out = Vec::new();
        for e in entries {
            let e = e.map_err(|err| Error::io(&dir, err))?;
            let n = e.file_name().to_string_lossy().into_owned();
            // The key is 16 hex digits, so `a--b-{key}` never matches a longer name `a--b-c`.
            if n.strip_prefix(&prefix).is_some_and(|k| k.len() == 16) {
                out.push(e.path());
            }
        }
        Ok(out)
    }
}

/// The folder for a model name: `org/name[@revision]` → `org--name[@revision]` (a `/` in the
/// revision becomes `--`; `@main` is dropped). A folder name as `brook list` prints it maps to
/// itself.
pub fn folder_name(name: &str) -> Result<String> {
    let bad = || {
        Error::Invalid(format!(
            "`{name}` is not a model name (expected org/name or org/name@revision)"
        ))
    };
    let (repo, rev) = match name.split_once('@') {
        Some((r, v)) => (r, Some(v)),
        None => (name, None),
    };
    let plain = |s: &str, slash: bool| {
        !s.is_empty()
            && s.split('/').all(|p| !p.is_empty() && !p.starts_with('.'))
            && s.chars().all(|c| {
                c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') || (slash && c == '/')
            })
    };
    if !plain(repo, true) || repo.matches('/').count() > 1 || !rev.is_none_or(|r| plain(r, true)) {
        return Err(bad());
    }
    let mut folder = repo.replace('/', "--");
    if let Some(r) = rev.filter(|r| *r != "main") {
        folder.push('@');
        folder.push_str(&r.replace('/', "--"));
    }
    Ok(folder)
}

/// `local--{folder name}-{hash of the canonical path}` for a checkpoint outside the Hub.
fn local_name(canonical: &Path) -> String {
    let base: String = canonical
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let base = base.trim_start_matches('.');
    let key = hash_hex(canonical.as_os_str().as_encoded_bytes());
    format!(
        "local--{}-{}",
        if base.is_empty() { "model" } else { base },
        &key[..8]
    )
}

/// Whether the container at `dir` was made from the checkpoint `src` describes.
fn same_source(dir: &Path, src: &RepackSource<'_>) -> bool {
    crate::util::read_capped(&dir.join("manifest.json"), crate::util::MAX_INDEX)
        .ok()
        .and_then(|b| serde_json::from_slice::<Manifest>(&b).ok())
        .is_some_and(|m| m.source.files == src.identity.files && m.config == src.config_json)
}

/// Writes `dir`'s origin file, unless it already says `origin`. Several processes opening
/// the same stored checkpoint at once each get here: each writes its own temporary file
/// (named by its process id and a count) and renames it over the origin, so none finds its temporary
/// file renamed away by another.
fn write_origin(dir: &Path, origin: &Origin) -> Result<()> {
    let path = dir.join(ORIGIN_FILE);
    let old: Option<Origin> = crate::util::read_capped(&path, crate::util::MAX_CONFIG)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    if old.as_ref() == Some(origin) {
        return Ok(());
    }
    let bytes = serde_json::to_vec_pretty(origin)
        .map_err(|e| Error::Invalid(format!("cannot encode {ORIGIN_FILE}: {e}")))?;
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{ORIGIN_FILE}.{}-{n}.partial", std::process::id()));
    write_atomic(&tmp, &bytes)?;
    crate::util::rename_durable(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(&path, e)
    })
}

/// Moves the finished `partial` to `dest`, replacing an older container there.
fn install(partial: &Path, dest: &Path) -> Result<()> {
    if dest.exists() {
        // One atomic exchange: a reader finds the old container or the new one, never none.
        // (A running server keeps serving the old one from its open files.)
        if crate::util::exchange(partial, dest).map_err(|e| Error::io(dest, e))? {
            return std::fs::remove_dir_all(partial).map_err(|e| Error::io(partial, e));
        }
        let mut old = dest.as_os_str().to_owned();
        old.push(format!(".old-{}", std::process::id()));
        let old = PathBuf::from(old);
        crate::util::rename_durable(dest, &old).map_err(|e| Error::io(dest, e))?;
        crate::util::rename_durable(partial, dest).map_err(|e| Error::io(dest, e))?;
        return std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e));
    }
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    crate::util::rename_durable(partial, dest).map_err(|e| Error::io(dest, e))
}

/// Bytes of every file under `dir` (symlinks not followed).
fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_folders() {
        assert_eq!(folder_name("org/m").expect("ok"), "org--m");
        assert_eq!(folder_name("org/m@main").expect("ok"), "org--m");
        assert_eq!(
            folder_name("org/m@refs/pr/1").expect("ok"),
            "org--m@refs--pr--1"
        );
        assert_eq!(folder_name("org--m@v2").expect("ok"), "org--m@v2");
        for bad in ["", "a/b/c", "../x", "a/.hidden", "a b", "org/m@", "x@../y"] {
            assert!(folder_name(bad).is_err(), "{bad}");
        }
    }
}
