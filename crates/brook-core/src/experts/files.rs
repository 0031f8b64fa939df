//! Reading expert blobs from a container's layer files: one `pread` of one stride per expert,
//! with O_DIRECT where the filesystem allows it.
//!
//! At open each layer file is probed with an aligned direct read; where that is refused
//! (tmpfs, some network filesystems) the store falls back to buffered reads followed by
//! `posix_fadvise(DONTNEED)` so streamed experts do not fill the page cache. No expert data is
//! ever mmapped.
//!
//! The files stay open for the model's life, so a container replaced or deleted on disk (a
//! `brook pull` of a newer revision swaps the folder) keeps serving the model that was opened,
//! from its open files, and says so once in the log; a file cut short in place is an error
//! naming it. With [`ExpertFiles::verifying`] every blob read is checked against its manifest
//! hash, so one overwritten in place is an error too, not garbage weights.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use crate::aligned::AlignedBuf;
use crate::container::Container;
use crate::error::{Error, Result};

#[derive(Debug)]
struct LayerFile {
    path: PathBuf,
    file: File,
    stride: u64,
    expected_len: u64,
    /// Meaningful bytes of each blob and their xxh3 by expert, when reads are verified.
    blob: usize,
    hashes: Option<Vec<u64>>,
}

/// Open handles on every layer file of a container.
#[derive(Debug)]
pub struct ExpertFiles {
    layers: Vec<LayerFile>,
    /// Whether reads bypass the page cache.
    pub direct: bool,
    /// Set once the files were found replaced or deleted on disk (logged once).
    replaced: std::sync::atomic::AtomicBool,
}

impl ExpertFiles {
    /// Opens every layer file of `c`, direct if possible.
    pub fn open(c: &Container) -> Result<Self> {
        let n = c.manifest.experts.num_experts as u64;
        let mut direct = true;
        let mut layers = Vec::new();
        for (l, info) in c.manifest.experts.layers.iter().enumerate() {
            let path = c.layer_path(l);
            let mut file = None;
            if direct {
                match open_direct(&path, info.stride) {
                    Some(f) => file = Some(f),
                    None => {
                        tracing::info!(
                            "{}: O_DIRECT refused; using buffered reads",
                            path.display()
                        );
                        direct = false;
                    }
                }
            }
            let file = match file {
                Some(f) => f,
                None => File::open(&path).map_err(|e| Error::io(&path, e))?,
            };
            layers.push(LayerFile {
                path,
                file,
                stride: info.stride,
                expected_len: info.stride * n,
                blob: info.blob_size as usize,
                hashes: None,
            });
        }
        if !direct {
            // Reopen any layer opened direct before the probe failed, so all reads agree.
            for lf in &mut layers {
                lf.file = File::open(&lf.path).map_err(|e| Error::io(&lf.path, e))?;
            }
        }
        Ok(ExpertFiles {
            layers,
            direct,
            replaced: Default::default(),
        })
    }

    /// Checks every later read against `c`'s manifest hashes when `on`.
    pub fn verifying(mut self, c: &Container, on: bool) -> Result<Self> {
        if !on {
            return Ok(self);
        }
        for (lf, info) in self.layers.iter_mut().zip(&c.manifest.experts.layers) {
            let hashes = info
                .xxh3
                .iter()
                .map(|h| u64::from_str_radix(h, 16))
                .collect::<std::result::Result<Vec<u64>, _>>()
                .map_err(|_| Error::Checkpoint {
                    path: lf.path.clone(),
                    reason: "the manifest's expert hashes are not hex; re-run `brook repack`"
                        .into(),
                })?;
            lf.hashes = Some(hashes);
        }
        Ok(self)
    }

    /// Reads expert `e` of `layer` into `buf` (one stride, page-aligned).
    pub fn read(&self, layer: usize, e: usize, buf: &mut [u8]) -> Result<()> {
        let lf = &self.layers[layer];
        let off = e as u64 * lf.stride;
        let n = lf.stride as usize;
        let mut done = 0;
        while done < n {
            match lf.file.read_at(&mut buf[done..n], off + done as u64) {
                Ok(0) => return Err(self.vanished(lf, "ended early")),
                Ok(k) => done += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&lf.path, e)),
            }
        }
        if let Some(hashes) = &lf.hashes {
            let got = xxhash_rust::xxh3::xxh3_64(&buf[..lf.blob.min(n)]);
            if hashes.get(e) != Some(&got) {
                return Err(Error::Checkpoint {
                    path: lf.path.clone(),
                    reason: format!(
                        "expert {e} does not match its hash in the manifest (the file was changed in place, or the disk returned bad data); run `brook verify` and re-run `brook repack` or `brook pull`"
                    ),
                });
            }
        }
        if !self.direct {
            // SAFETY: fd is open for the life of `lf`; the advice has no memory effects on us.
            unsafe {
                libc::posix_fadvise(
                    lf.file.as_raw_fd(),
                    off as libc::off_t,
                    n as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
        Ok(())
    }

    /// Checks that `layer`'s file still exists with its full length.
    pub fn check(&self, layer: usize) -> Result<()> {
        let lf = &self.layers[layer];
        let m = lf.file.metadata().map_err(|e| Error::io(&lf.path, e))?;
        if m.nlink() == 0
            && !self
                .replaced
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            // Our open file is whole: keep reading it. The new files are for the next start.
            tracing::warn!(
                "{} was replaced or deleted on disk; brook keeps serving the model it opened, from its open files (restart to load the new one)",
                lf.path.display()
            );
        }
        if m.len() < lf.expected_len {
            return Err(self.vanished(lf, "shrank"));
        }
        Ok(())
    }

    fn vanished(&self, lf: &LayerFile, what: &str) -> Error {
        Error::Io {
            path: lf.path.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "expert layer file {what} while the model was running; re-run `brook repack` or `brook verify`"
                ),
            ),
        }
    }
}

fn open_direct(path: &std::path::Path, stride: u64) -> Option<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()?;
    let mut probe = AlignedBuf::zeroed(stride.min(crate::aligned::ALIGN as u64 * 4) as usize);
    f.read_at(&mut probe, 0).ok()?;
    Some(f)
}

impl ExpertFiles {
    /// Measures this disk's read bandwidth for the access pattern of cache misses: random
    /// whole-expert reads from every layer file, `threads` at a time, for about `secs`
    /// seconds. Returns bytes per second.
    pub fn measure_bandwidth(&self, threads: usize, secs: f64) -> Result<f64> {
        let stop = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
        let start = std::time::Instant::now();
        let total = std::sync::atomic::AtomicU64::new(0);
        let failed = std::sync::Mutex::new(None);
        std::thread::scope(|scope| {
            for t in 0..threads.max(1) {
                let (total, failed) = (&total, &failed);
                scope.spawn(move || {
                    let max_stride = self.layers.iter().map(|l| l.stride).max().unwrap_or(0);
                    let mut buf = AlignedBuf::zeroed(max_stride as usize);
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ t as u64;
                    while std::time::Instant::now() < stop {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let layer = (x % self.layers.len() as u64) as usize;
                        let lf = &self.layers[layer];
                        let n = (lf.expected_len / lf.stride.max(1)).max(1);
                        let e = ((x >> 20) % n) as usize;
                        if let Err(err) = self.read(layer, e, &mut buf) {
                            *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(err);
                            return;
                        }
                        total.fetch_add(lf.stride, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        if let Some(err) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(err);
        }
        Ok(total.into_inner() as f64 / start.elapsed().as_secs_f64())
    }
}
