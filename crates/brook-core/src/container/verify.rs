//! `verify`: checks a container's every byte against its own hashes, and optionally against
//! the checkpoint it was made from.
//!
//! Opening the container already checks the manifest and every file's size. Here each
//! expert blob is hashed (and its padding checked to be zero), the dense file is hashed, and
//! with a source every dense tensor and expert section is compared byte for byte.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::aligned::AlignedBuf;
use crate::checkpoint::TensorSource;
use crate::container::layout::source_name;
use crate::container::{Container, hash_hex};
use crate::error::{Error, Result};

/// One problem found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Layer and expert, or `None` for the dense file.
    pub expert: Option<(usize, usize)>,
    pub what: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.expert {
            Some((l, e)) => write!(f, "layer {l} expert {e}: {}", self.what),
            None => write!(f, "dense: {}", self.what),
        }
    }
}

/// What `verify` found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    pub experts_checked: usize,
    pub bytes_checked: u64,
    /// Every problem, in file order; the first is the first bad layer and expert.
    pub mismatches: Vec<Mismatch>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.mismatches.is_empty()
    }
}

/// Verifies `c`; with `source`, also compares every byte with it. `progress(done, total)`.
pub fn verify(
    c: &Container,
    source: Option<&dyn TensorSource>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<VerifyReport> {
    let m = &c.manifest;
    let total: u64 = m.dense.size
        + m.experts
            .layers
            .iter()
            .map(|l| l.stride * m.experts.num_experts as u64)
            .sum::<u64>();
    let mut r = VerifyReport::default();
    verify_dense(c, source, &mut r)?;
    r.bytes_checked += m.dense.size;
    progress(r.bytes_checked, total);
    for (l, info) in m.experts.layers.iter().enumerate() {
        let path = c.layer_path(l);
        let f = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let mut blob = AlignedBuf::zeroed(info.stride as usize);
        let layout = &c.layouts[l];
        for e in 0..m.experts.num_experts {
            f.read_exact_at(&mut blob, e as u64 * info.stride)
                .map_err(|er| Error::io(&path, er))?;
            let bytes = &blob[..info.blob_size as usize];
            let bad = |what: String| Mismatch {
                expert: Some((l, e)),
                what,
            };
            if hash_hex(bytes) != info.xxh3[e] {
                r.mismatches
                    .push(bad("content hash differs from the manifest".into()));
            } else if blob[info.blob_size as usize..].iter().any(|&b| b != 0) {
                r.mismatches
                    .push(bad("padding after the blob is not zero".into()));
            }
            if let Some(src) = source {
                for s in &layout.sections {
                    let want =
                        src.read_range(&source_name(l, &s.name), e as u64 * s.size, s.size)?;
                    if want[..] != blob[s.offset as usize..(s.offset + s.size) as usize] {
                        r.mismatches
                            .push(bad(format!("section {} differs from the source", s.name)));
                        break;
                    }
                }
            }
            r.experts_checked += 1;
            r.bytes_checked += info.stride;
            progress(r.bytes_checked, total);
        }
    }
    Ok(r)
}

fn verify_dense(
    c: &Container,
    source: Option<&dyn TensorSource>,
    r: &mut VerifyReport,
) -> Result<()> {
    let path = c.dir().join(&c.manifest.dense.file);
    let f = File::open(&path).map_err(|e| Error::io(&path, e))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 16 << 20];
    let mut off = 0u64;
    while off < c.manifest.dense.size {
        let n = (buf.len() as u64).min(c.manifest.dense.size - off) as usize;
        f.read_exact_at(&mut buf[..n], off)
            .map_err(|e| Error::io(&path, e))?;
        hasher.update(&buf[..n]);
        off += n as u64;
    }
    if format!("{:016x}", hasher.digest()) != c.manifest.dense.xxh3 {
        r.mismatches.push(Mismatch {
            expert: None,
            what: "dense.safetensors hash differs from the manifest".into(),
        });
    }
    let Some(src) = source else { return Ok(()) };
    let mine = c.names();
    let theirs: Vec<String> = src
        .names()
        .into_iter()
        .filter(|n| !n.contains(".mlp.switch_mlp."))
        .collect();
    if mine != theirs {
        r.mismatches.push(Mismatch {
            expert: None,
            what: format!(
                "the source has {} dense tensors, the container {}",
                theirs.len(),
                mine.len()
            ),
        });
        return Ok(());
    }
    for name in &mine {
        let (a, b) = (c.require(name)?, src.require(name)?);
        if a.dtype != b.dtype || a.shape != b.shape || !same_bytes(c, src, name, a.len)? {
            r.mismatches.push(Mismatch {
                expert: None,
                what: format!("tensor `{name}` differs from the source"),
            });
            break;
        }
    }
    Ok(())
}

/// Whether tensor `name` has the same bytes in both stores, compared 16 MiB at a time so the
/// largest tensor (the 254 MB embedding of the 35B) is never held whole.
fn same_bytes(a: &dyn TensorSource, b: &dyn TensorSource, name: &str, len: u64) -> Result<bool> {
    const CHUNK: u64 = 16 << 20;
    let mut off = 0;
    while off < len {
        let n = CHUNK.min(len - off);
        if a.read_range(name, off, n)? != b.read_range(name, off, n)? {
            return Ok(false);
        }
        off += n;
    }
    Ok(true)
}
