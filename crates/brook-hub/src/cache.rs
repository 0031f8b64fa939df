//! The Hugging Face cache layout, written so huggingface_hub, transformers and mlx-lm find and
//! reuse what brook downloads (and brook reuses theirs).
//!
//! ```text
//! $HF_HUB_CACHE/models--{org}--{name}/
//!   blobs/{etag}               file contents; etag = sha256 for LFS files, git sha1 otherwise
//!   blobs/{etag}.incomplete    a download in progress, appended to on resume
//!   snapshots/{commit}/{path}  relative symlinks: ../../blobs/{etag} (one more ../ per folder)
//!   refs/{revision}            the commit hash a branch or tag resolved to, no newline
//! ```
//!
//! Sources: the Hub's "Hub Local Cache" reference (huggingface/hub-docs, docs/hub/local-cache.md:
//! folder naming, blobs by etag, relative `../../blobs/{hash}` links, refs holding a 40-hex
//! commit) and huggingface_hub's `file_download.py` (`blob_path + ".incomplete"` opened for append
//! and resumed with `Range`, `_create_symlink` using `os.path.relpath`,
//! `_cache_commit_hash_for_specific_revision` writing the ref with `write_text`, no newline).
//! Each blob is downloaded under `$HF_HUB_CACHE/.locks/models--{org}--{name}/{etag}.lock`, held
//! with `flock(LOCK_EX)` as the `filelock` package huggingface_hub uses does, so brook and Python
//! never write the same `.incomplete` file at once. Not written: `.no_exist/` (brook lists the
//! repository instead of probing for optional files).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::repo::{RepoId, is_commit};

/// One repository's folder in the cache.
#[derive(Debug, Clone)]
pub struct RepoCache {
    dir: PathBuf,
}

impl RepoCache {
    /// `{cache_dir}/models--{org}--{name}`.
    pub fn new(cache_dir: &Path, repo: &RepoId) -> Self {
        RepoCache {
            dir: cache_dir.join(repo.cache_folder()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blob_path(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(etag)
    }

    /// Where a download of `etag` accumulates until it is verified.
    pub fn incomplete_path(&self, etag: &str) -> PathBuf {
        self.dir.join("blobs").join(format!("{etag}.incomplete"))
    }

    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.dir.join("snapshots").join(commit)
    }

    /// Waits for and takes the cross-process lock on downloading `etag`; released on drop.
    pub fn lock(&self, etag: &str) -> Result<BlobLock> {
        let folder = self.dir.file_name().unwrap_or_default();
        let root = self.dir.parent().unwrap_or(&self.dir);
        let path = root
            .join(".locks")
            .join(folder)
            .join(format!("{etag}.lock"));
        let dir = path.parent().unwrap_or(root);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        let flock = |op| {
            // SAFETY: the descriptor belongs to `file`, which is open for this whole call.
            let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
            if rc == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        if flock(libc::LOCK_EX | libc::LOCK_NB).is_err() {
            tracing::info!("waiting for another process downloading {}", path.display());
            loop {
                match flock(libc::LOCK_EX) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(Error::io(&path, e)),
                }
            }
        }
        Ok(BlobLock { _file: file })
    }

    /// The symlink standing for `file` in the snapshot of `commit`.
    pub fn pointer_path(&self, commit: &str, file: &str) -> PathBuf {
        self.snapshot_dir(commit).join(file)
    }

    /// The commit `revision` last resolved to, if recorded (a commit hash resolves to itself).
    pub fn read_ref(&self, revision: &str) -> Option<String> {
        if is_commit(revision) {
            return Some(revision.to_string());
        }
        let text = std::fs::read_to_string(self.dir.join("refs").join(revision)).ok()?;
        let commit = text.trim();
        is_commit(commit).then(|| commit.to_string())
    }

    /// Records that `revision` resolves to `commit` (nothing to record when it is the commit).
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<()> {
        if revision == commit || self.read_ref(revision).as_deref() == Some(commit) {
            return Ok(());
        }
        let path = self.dir.join("refs").join(revision);
        let dir = path.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        // Unique per writer: two pulls in one process (or two processes) may record the
        // same ref at once, and each must rename its own file.
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".{}.{n}.tmp", std::process::id()));
        std::fs::write(&tmp, commit).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        sync_parent(&path);
        Ok(())
    }

    /// Points `snapshots/{commit}/{file}` at `blobs/{etag}` by a relative link, replacing
    /// whatever was there.
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<()> {
        let pointer = self.pointer_path(commit, file);
        let target = link_target(file, etag);
        if std::fs::read_link(&pointer).is_ok_and(|t| t == target) {
            return Ok(());
        }
        let dir = pointer.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let name = pointer
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(
            ".{}.{}.{n}.link",
            name.unwrap_or_default(),
            std::process::id()
        ));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &pointer).map_err(|e| Error::io(&pointer, e))?;
        sync_parent(&pointer);
        Ok(())
    }
}

/// A held download lock (closing the file releases it).
#[derive(Debug)]
pub struct BlobLock {
    _file: File,
}

/// `../../blobs/{etag}` from `snapshots/{commit}/`, one more `../` per folder in `file`.
pub fn link_target(file: &str, etag: &str) -> PathBuf {
    let depth = file.matches('/').count();
    PathBuf::from(format!("{}blobs/{etag}", "../".repeat(depth + 2)))
}

/// Makes a rename into `path`'s folder durable (the folder's entries synced to disk); some
/// filesystems cannot sync a folder, which is ignored.
pub(crate) fn sync_parent(path: &Path) {
    if let Some(d) = path.parent().and_then(|p| std::fs::File::open(p).ok()) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn links_are_relative_and_resolve_to_the_blob() {
        let dir = tempfile::tempdir().expect("tempdir");
        let repo = RepoId::parse("org/m").expect("repo");
        let cache = RepoCache::new(dir.path(), &repo);
        std::fs::create_dir_all(cache.blob_path("e").parent().expect("parent")).expect("mkdir");
        std::fs::write(cache.blob_path("e"), b"hi").expect("write");
        cache.link(C, "sub/dir/f.json", "e").expect("link");
        cache.link(C, "top.json", "e").expect("link");
        cache.link(C, "top.json", "e").expect("relink is a no-op");
        let p = cache.pointer_path(C, "sub/dir/f.json");
        assert_eq!(
            std::fs::read_link(&p).expect("symlink"),
            PathBuf::from("../../../../blobs/e")
        );
        assert_eq!(std::fs::read(&p).expect("follow"), b"hi");
        assert_eq!(
            std::fs::read(cache.pointer_path(C, "top.json")).expect("follow"),
            b"hi"
        );
    }

    #[test]
    fn refs_hold_the_bare_commit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = RepoCache::new(dir.path(), &RepoId::parse("m").expect("repo"));
        cache.write_ref("main", C).expect("write");
        cache.write_ref("refs/pr/1", C).expect("write nested");
        let path = dir.path().join("models--m/refs/main");
        assert_eq!(std::fs::read_to_string(path).expect("read"), C);
        assert_eq!(cache.read_ref("refs/pr/1").as_deref(), Some(C));
        assert_eq!(cache.read_ref(C).as_deref(), Some(C));
        assert_eq!(cache.read_ref("dev"), None);
    }
}
