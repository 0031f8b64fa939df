//! Downloading a listing into the cache: a few files at once, each resumed, verified, then moved
//! into place.
//!
//! Per file, as huggingface_hub's `_download_to_tmp_and_move` does: a blob already in the cache
//! with the right size is only linked; otherwise bytes are appended to `blobs/{etag}.incomplete`,
//! starting with `Range: bytes={len}-` when an earlier run left some, from
//! `{endpoint}/{repo}/resolve/{commit}/{path}` (the commit, not the branch, so every file comes
//! from the same commit). A dropped connection is retried from where it stopped; when retries
//! run out the partial file stays for the next run. A finished file must have the listed size and
//! hash (sha256 for LFS files, the git blob sha1 otherwise) before it is renamed to
//! `blobs/{etag}`; a mismatch removes it. Then `snapshots/{commit}/{path}` is linked to it.
//! All of this happens under the blob's lock (see [`crate::cache`]).

use std::cmp::Reverse;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use sha1::Digest;

use crate::Hub;
use crate::api::{RepoFile, RepoListing};
use crate::cache::RepoCache;
use crate::error::{Error, Result};
use crate::http::{self, Subject};
use crate::repo::{RepoId, quote};

/// A finished download: the snapshot folder holds every file of the listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub repo: RepoId,
    pub revision: String,
    pub commit: String,
    /// `$HF_HUB_CACHE/models--{org}--{name}/snapshots/{commit}`.
    pub dir: PathBuf,
    pub files: usize,
    /// Bytes of all files.
    pub bytes: u64,
    /// Bytes received over the network by this call (the rest was cached or resumed).
    pub fetched: u64,
}

/// What just happened to one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileEvent {
    /// Already complete in the cache; nothing to download.
    Cached,
    /// Download starting, keeping `resumed_from` bytes an earlier attempt left.
    Started { resumed_from: u64 },
    /// More bytes arrived.
    Bytes,
    /// The connection dropped; trying again (attempt `n` of the configured retries).
    Retrying { attempt: u32 },
    /// All bytes are in; checking size and hash.
    Verifying,
    /// Verified and in place.
    Done,
}

/// A progress report: one file's state and the whole download's.
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    pub file: &'a str,
    pub event: FileEvent,
    pub file_done: u64,
    pub file_total: u64,
    /// Bytes of all files that are done or on disk, including cached and resumed ones.
    pub done: u64,
    pub total: u64,
}

/// Bytes read from the network per `read` call.
const CHUNK: usize = 1 << 20;

/// One download of a listing.
struct Run<'a> {
    hub: &'a Hub,
    listing: &'a RepoListing,
    cache: RepoCache,
    progress: &'a (dyn Fn(&Progress<'_>) + Sync),
    done: AtomicU64,
    fetched: AtomicU64,
    /// Set by the first failure: no new file is started after it.
    stop: AtomicBool,
}

pub(crate) fn download(
    hub: &Hub,
    listing: &RepoListing,
    progress: &(dyn Fn(&Progress<'_>) + Sync),
) -> Result<Snapshot> {
    if hub.config().offline {
        return Err(Error::Offline);
    }
    let cache = RepoCache::new(&hub.config().cache_dir, &listing.repo);
    let blobs = cache.blob_path("");
    std::fs::create_dir_all(&blobs).map_err(|e| Error::io(&blobs, e))?;
    check_space(&cache, listing)?;
    let run = Run {
        hub,
        listing,
        cache,
        progress,
        done: AtomicU64::new(0),
        fetched: AtomicU64::new(0),
        stop: AtomicBool::new(false),
    };
    let mut order: Vec<&RepoFile> = listing.files.iter().collect();
    // Largest first, so the long transfers overlap with the rest.
    order.sort_by_key(|f| Reverse(f.size));
    let next = AtomicUsize::new(0);
    let errors = Mutex::new(Vec::new());
    let threads = hub.config().threads.clamp(1, order.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                while !run.stop.load(Ordering::Relaxed) {
                    let Some(f) = order.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    if let Err(e) = run.file(f) {
                        run.stop.store(true, Ordering::Relaxed);
                        errors.lock().unwrap_or_else(|p| p.into_inner()).push(e);
                    }
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = errors.into_iter().next() {
        return Err(e);
    }
    run.cache.write_ref(&listing.revision, &listing.commit)?;
    Ok(Snapshot {
        repo: listing.repo.clone(),
        revision: listing.revision.clone(),
        commit: listing.commit.clone(),
        dir: run.cache.snapshot_dir(&listing.commit),
        files: listing.files.len(),
        bytes: listing.total_size(),
        fetched: run.fetched.load(Ordering::Relaxed),
    })
}

impl Run<'_> {
    /// Makes `f` present and linked in the snapshot.
    fn file(&self, f: &RepoFile) -> Result<()> {
        let commit = &self.listing.commit;
        let blob = self.cache.blob_path(f.etag());
        let _lock = self.cache.lock(f.etag())?;
        if std::fs::metadata(&blob).is_ok_and(|m| m.is_file() && m.len() == f.size) {
            self.done.fetch_add(f.size, Ordering::Relaxed);
            self.report(f, FileEvent::Cached, f.size);
            return self.cache.link(commit, &f.path, f.etag());
        }
        let part = self.cache.incomplete_path(f.etag());
        let mut counted = Counted {
            run: self,
            bytes: 0,
        };
        let cfg = self.hub.config();
        let mut attempt = 0;
        loop {
            match self.fetch(f, &part, &mut counted) {
                Ok(()) => break,
                Err(e) if e.is_transient() && attempt < cfg.retries => {
                    attempt += 1;
                    tracing::warn!("{}: {e}; retry {attempt} of {}", f.path, cfg.retries);
                    self.report(f, FileEvent::Retrying { attempt }, counted.bytes);
                    std::thread::sleep(cfg.retry_delay * 2u32.saturating_pow(attempt - 1));
                }
                Err(e) => return Err(e),
            }
        }
        std::fs::rename(&part, &blob).map_err(|e| Error::io(&blob, e))?;
        crate::cache::sync_parent(&blob);
        self.cache.link(commit, &f.path, f.etag())?;
        self.report(f, FileEvent::Done, f.size);
        Ok(())
    }

    /// One attempt: appends the missing bytes of `f` to `part`, then verifies the whole file.
    fn fetch(&self, f: &RepoFile, part: &Path, counted: &mut Counted<'_, '_>) -> Result<()> {
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(part)
            .map_err(|e| Error::io(part, e))?;
        let mut have = file.metadata().map_err(|e| Error::io(part, e))?.len();
        if have > f.size {
            file.set_len(0).map_err(|e| Error::io(part, e))?;
            have = 0;
        }
        let mut hash = FileHash::new(f);
        hash.update_from_file(&mut file, part, have)?;
        counted.set(have);
        self.report(f, FileEvent::Started { resumed_from: have }, have);
        if have < f.size {
            have = self.stream(f, &mut file, part, have, &mut hash, counted)?;
        }
        if have < f.size {
            let url = self.resolve_url(f);
            let reason = format!("connection closed after {have} of {} bytes", f.size);
            return Err(http::network(&url, &reason));
        }
        self.report(f, FileEvent::Verifying, have);
        file.sync_all().map_err(|e| Error::io(part, e))?;
        drop(file);
        let bad = if have != f.size {
            Some(format!(
                "{have} bytes received, the listing says {}",
                f.size
            ))
        } else {
            hash.mismatch()
        };
        if let Some(reason) = bad {
            let _ = std::fs::remove_file(part);
            counted.set(0);
            return Err(Error::Integrity {
                file: f.path.clone(),
                reason,
            });
        }
        Ok(())
    }

    /// Requests the bytes from `have` on and appends them; returns the new length.
    fn stream(
        &self,
        f: &RepoFile,
        file: &mut File,
        part: &Path,
        mut have: u64,
        hash: &mut FileHash,
        counted: &mut Counted<'_, '_>,
    ) -> Result<u64> {
        let url = self.resolve_url(f);
        let what = Subject {
            repo: self.listing.repo.as_str(),
            revision: &self.listing.revision,
        };
        let (resp, meta) = http::get(self.hub, &url, have)?;
        let resp = http::check(self.hub, resp, &url, what)?;
        self.check_headers(f, &url, &meta)?;
        if have > 0 {
            if resp.status().as_u16() == 206 {
                check_content_range(&resp, &url, have)?;
            } else {
                // The server ignored the Range header: start over, as huggingface_hub does.
                file.set_len(0).map_err(|e| Error::io(part, e))?;
                *hash = FileHash::new(f);
                have = 0;
                counted.set(0);
            }
        }
        let mut body = resp.into_body().into_reader();
        let mut buf = vec![0u8; CHUNK];
        while have <= f.size {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    let reason = format!("{e} after {have} of {} bytes", f.size);
                    return Err(http::network(&url, &reason));
                }
            };
            file.write_all(&buf[..n]).map_err(|e| Error::io(part, e))?;
            hash.update(&buf[..n]);
            have += n as u64;
            self.fetched.fetch_add(n as u64, Ordering::Relaxed);
            counted.set(have);
            self.report(f, FileEvent::Bytes, have);
        }
        Ok(have)
    }

    /// The Hub's headers must agree with the listing it gave.
    fn check_headers(&self, f: &RepoFile, url: &str, meta: &http::FileHeaders) -> Result<()> {
        let protocol = |reason: String| Error::Protocol {
            url: url.to_string(),
            reason,
        };
        if let Some(c) = meta.commit.as_deref().filter(|c| *c != self.listing.commit) {
            let want = &self.listing.commit;
            return Err(protocol(format!("X-Repo-Commit is {c}, asked for {want}")));
        }
        if let Some(s) = meta.size.filter(|s| *s != f.size) {
            return Err(protocol(format!(
                "X-Linked-Size is {s}, the listing says {}",
                f.size
            )));
        }
        if let Some(e) = meta.etag.as_deref().filter(|e| *e != f.etag()) {
            tracing::warn!(
                "{}: ETag {e} differs from the listing's {}",
                f.path,
                f.etag()
            );
        }
        Ok(())
    }

    fn resolve_url(&self, f: &RepoFile) -> String {
        let l = self.listing;
        let endpoint = &self.hub.config().endpoint;
        format!(
            "{endpoint}/{}/resolve/{}/{}",
            l.repo,
            l.commit,
            quote(&f.path, true)
        )
    }

    fn report(&self, f: &RepoFile, event: FileEvent, file_done: u64) {
        (self.progress)(&Progress {
            file: &f.path,
            event,
            file_done,
            file_total: f.size,
            done: self.done.load(Ordering::Relaxed),
            total: self.listing.total_size(),
        });
    }
}

/// Keeps the run's `done` counter in step with one file's bytes on disk.
struct Counted<'r, 'a> {
    run: &'r Run<'a>,
    bytes: u64,
}

impl Counted<'_, '_> {
    fn set(&mut self, bytes: u64) {
        if bytes >= self.bytes {
            self.run
                .done
                .fetch_add(bytes - self.bytes, Ordering::Relaxed);
        } else {
            self.run
                .done
                .fetch_sub(self.bytes - bytes, Ordering::Relaxed);
        }
        self.bytes = bytes;
    }
}

/// A 206 must start where we asked: `Content-Range: bytes {from}-{end}/{total}`.
fn check_content_range(resp: &http::Response, url: &str, from: u64) -> Result<()> {
    let range = http::header(resp, "content-range").unwrap_or_default();
    let start = range
        .strip_prefix("bytes ")
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.trim().parse::<u64>().ok());
    if start != Some(from) {
        return Err(Error::Protocol {
            url: url.to_string(),
            reason: format!("asked for bytes from {from}, got Content-Range `{range}`"),
        });
    }
    Ok(())
}

/// The hash a file must have: sha256 of the content for LFS files, else git's blob sha1
/// (`sha1("blob {size}\0" + content)`, which is what `blobId` is).
enum FileHash {
    Lfs(sha2::Sha256, String),
    Git(sha1::Sha1, String),
}

impl FileHash {
    fn new(f: &RepoFile) -> Self {
        match &f.sha256 {
            Some(want) => FileHash::Lfs(sha2::Sha256::new(), want.to_ascii_lowercase()),
            None => {
                let mut h = sha1::Sha1::new();
                h.update(format!("blob {}\0", f.size).as_bytes());
                FileHash::Git(h, f.blob_id.to_ascii_lowercase())
            }
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            FileHash::Lfs(h, _) => h.update(bytes),
            FileHash::Git(h, _) => h.update(bytes),
        }
    }

    /// Hashes the first `len` bytes already in `file` (kept from an interrupted run).
    fn update_from_file(&mut self, file: &mut File, path: &Path, len: u64) -> Result<()> {
        use std::io::{Seek, SeekFrom};
        file.seek(SeekFrom::Start(0))
            .map_err(|e| Error::io(path, e))?;
        let mut buf = vec![0u8; CHUNK];
        let mut left = len;
        while left > 0 {
            let n = buf.len().min(left as usize);
            file.read_exact(&mut buf[..n])
                .map_err(|e| Error::io(path, e))?;
            self.update(&buf[..n]);
            left -= n as u64;
        }
        Ok(())
    }

    /// `None` when the hash is the expected one, else the reason.
    fn mismatch(self) -> Option<String> {
        let (got, want, kind) = match self {
            FileHash::Lfs(h, want) => (hex(&h.finalize()), want, "sha256"),
            FileHash::Git(h, want) => (hex(&h.finalize()), want, "git sha1"),
        };
        (got != want).then(|| format!("{kind} is {got}, the Hub lists {want}"))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Refuses to start when the disk cannot hold what is left to download.
fn check_space(cache: &RepoCache, listing: &RepoListing) -> Result<()> {
    let needed: u64 = listing
        .files
        .iter()
        .filter(|f| !cache.blob_path(f.etag()).is_file())
        .map(|f| {
            let part = std::fs::metadata(cache.incomplete_path(f.etag())).map_or(0, |m| m.len());
            f.size.saturating_sub(part)
        })
        .sum();
    let dir = cache.blob_path("");
    match free_bytes(&dir) {
        Some(free) if free < needed => Err(Error::DiskFull {
            path: dir,
            needed: Some(needed),
            free: Some(free),
        }),
        _ => Ok(()),
    }
}

/// Bytes an unprivileged user may still write on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` points to writable memory of the right
    // type; statvfs only writes into it and we read it only when it reports success.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    // The field types differ by platform (u32 blocks on macOS), hence the casts.
    #[allow(clippy::unnecessary_cast)]
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}
