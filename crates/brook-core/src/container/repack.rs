//! `repack`: an MLX checkpoint (or any [`TensorSource`]) to a container, streaming and
//! resumable.
//!
//! Memory stays bounded: dense tensors are copied in chunks of at most [`COPY_CHUNK`] bytes and
//! experts one blob at a time. Progress is kept in `.brook-repack.json` (rewritten atomically
//! after every finished file); each file is written as `*.partial` and renamed when complete,
//! so a run killed at any moment redoes at most the file it was writing, and the result is
//! byte-identical to an uninterrupted run. `manifest.json` is written last, by rename: a
//! folder without it is never taken for a container, and one with it holds nothing else.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::aligned::AlignedBuf;
use crate::checkpoint::{Checkpoint, TensorSource};
use crate::config::ModelConfig;
use crate::container::layout::ExpertLayout;
use crate::container::{
    DenseInfo, ExpertsInfo, FORMAT, LayerInfo, Manifest, STRIDE_ALIGN, SourceFile, SourceIdentity,
    VERSION, hash_hex, layer_file,
};
use crate::error::{Error, Result};
use crate::safetensors::{TensorSpec, header_prefix};

/// Largest piece of a dense tensor held in memory at once.
pub const COPY_CHUNK: u64 = 16 << 20;
/// The progress file of an unfinished repack.
pub const STATE_FILE: &str = ".brook-repack.json";
/// Files copied beside the weights when the source has them.
pub const COPIED_FILES: [&str; 9] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
];

/// What to repack: tensors plus the metadata that goes into the manifest.
pub struct RepackSource<'a> {
    pub store: &'a dyn TensorSource,
    pub config: ModelConfig,
    pub config_json: serde_json::Value,
    pub generation_config: Option<serde_json::Value>,
    pub identity: SourceIdentity,
    /// Files to copy into the container (absolute paths).
    pub extra_files: Vec<PathBuf>,
}

impl std::fmt::Debug for RepackSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RepackSource")
            .field("identity", &self.identity)
            .finish()
    }
}

impl<'a> RepackSource<'a> {
    /// The source description of an opened MLX checkpoint folder.
    pub fn from_checkpoint(ck: &'a Checkpoint) -> Result<Self> {
        let dir = ck.dir();
        let read_json = |name: &str| -> Result<Option<serde_json::Value>> {
            let p = dir.join(name);
            if !p.is_file() {
                return Ok(None);
            }
            let bytes = crate::util::read_capped(&p, crate::util::MAX_CONFIG)
                .map_err(|e| Error::io(&p, e))?;
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| Error::Json {
                    path: p,
                    reason: format!("not valid JSON: {e}"),
                })
        };
        let mut files = Vec::new();
        for f in ck.files() {
            files.push(SourceFile {
                name: f
                    .path()
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                size: f.file_len()?,
                header_xxh3: hash_hex(&f.header_bytes()?),
            });
        }
        let name = std::fs::canonicalize(dir)
            .unwrap_or_else(|_| dir.to_path_buf())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(RepackSource {
            store: ck,
            config: ck.config.clone(),
            config_json: read_json("config.json")?.unwrap_or_default(),
            generation_config: read_json("generation_config.json")?,
            identity: SourceIdentity { name, files },
            extra_files: COPIED_FILES
                .iter()
                .map(|n| dir.join(n))
                .filter(|p| p.is_file())
                .collect(),
        })
    }
}

/// Progress of a repack, reported after every expert and dense chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepackProgress {
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Bytes skipped because an earlier run finished them.
    pub bytes_resumed: u64,
}

/// `.brook-repack.json`: what an interrupted run finished.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct RepackState {
    identity: SourceIdentity,
    config_xxh3: String,
    dense: Option<DenseInfo>,
    layers: Vec<Option<LayerInfo>>,
}

/// Repacks `src` into the container folder `out`, resuming an unfinished run there.
pub fn repack(
    src: &RepackSource<'_>,
    out: &Path,
    progress: &mut dyn FnMut(RepackProgress),
) -> Result<Manifest> {
    let cfg = &src.config;
    let layouts = (0..cfg.num_hidden_layers)
        .map(|l| ExpertLayout::from_store(src.store, cfg, l))
        .collect::<Result<Vec<_>>>()?;
    let dense_names: Vec<String> = src
        .store
        .names()
        .into_iter()
        .filter(|n| !n.contains(".mlp.switch_mlp."))
        .collect();
    let config_xxh3 = hash_hex(&serde_json::to_vec(&src.config_json).unwrap_or_default());
    if let Some(m) = recover_finished(out, &src.identity)? {
        return Ok(m);
    }
    let mut state = prepare_output(out, &src.identity, &config_xxh3, cfg.num_hidden_layers)?;

    let dense_bytes: u64 = dense_names
        .iter()
        .filter_map(|n| src.store.info(n))
        .map(|i| i.len)
        .sum();
    let stride = |l: &ExpertLayout| l.blob_size.div_ceil(STRIDE_ALIGN) * STRIDE_ALIGN;
    let expert_bytes: u64 = layouts
        .iter()
        .map(|l| stride(l) * cfg.num_experts as u64)
        .sum();
    let mut p = RepackProgress {
        bytes_done: 0,
        bytes_total: dense_bytes + expert_bytes,
        bytes_resumed: 0,
    };
    // A resumed run trusts only the files it finds whole: a state file that lists a file
    // missing or of another size (deleted, or cut short by a full disk) redoes that file.
    let len_of = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
    if let Some(d) = &state.dense
        && len_of(&out.join(&d.file)) != Some(d.size)
    {
        tracing::warn!("{}: not as the repack state says; writing it again", d.file);
        state.dense = None;
    }
    for (l, layout) in layouts.iter().enumerate() {
        let size = stride(layout) * cfg.num_experts as u64;
        if let Some(info) = &state.layers[l]
            && (len_of(&out.join(&info.file)) != Some(size) || info.stride != stride(layout))
        {
            tracing::warn!(
                "{}: not as the repack state says; writing it again",
                info.file
            );
            state.layers[l] = None;
        }
    }
    let left = if state.dense.is_none() {
        dense_bytes
    } else {
        0
    } + layouts
        .iter()
        .zip(&state.layers)
        .filter(|(_, done)| done.is_none())
        .map(|(l, _)| stride(l) * cfg.num_experts as u64)
        .sum::<u64>();
    crate::util::ensure_free_space(out, left, "the repack").map_err(|e| Error::io(out, e))?;

    if state.dense.is_none() {
        state.dense = Some(write_dense(src.store, &dense_names, out, &mut p, progress)?);
        save_state(out, &state)?;
    } else {
        p.bytes_done += dense_bytes;
        p.bytes_resumed += dense_bytes;
        progress(p);
    }
    std::fs::create_dir_all(out.join("experts")).map_err(|e| Error::io(out.join("experts"), e))?;
    for (l, layout) in layouts.iter().enumerate() {
        let size = stride(layout) * cfg.num_experts as u64;
        if state.layers[l].is_some() {
            p.bytes_done += size;
            p.bytes_resumed += size;
            progress(p);
            continue;
        }
        let info = write_layer(
            src.store,
            cfg,
            l,
            layout,
            stride(layout),
            out,
            &mut p,
            progress,
        )?;
        state.layers[l] = Some(info);
        save_state(out, &state)?;
    }

    let mut copied = Vec::new();
    for f in &src.extra_files {
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        copy_atomic(f, &out.join(&name))?;
        copied.push(name);
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        config: src.config_json.clone(),
        generation_config: src.generation_config.clone(),
        source: src.identity.clone(),
        dense: state
            .dense
            .clone()
            .ok_or_else(|| Error::Invalid("dense.safetensors was not written".into()))?,
        experts: ExpertsInfo {
            num_experts: cfg.num_experts,
            alignment: STRIDE_ALIGN,
            layers: state.layers.iter().flatten().cloned().collect(),
        },
        copied_files: copied,
    };
    let bytes = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| Error::Invalid(format!("cannot encode manifest: {e}")))?;
    // The manifest goes down whole before the state file goes, and is renamed into place
    // after: a run killed at any point leaves either an unfinished repack (a state file, or
    // no state file beside a whole `manifest.json.partial`, which the next run renames) or
    // the finished container with nothing else in the folder.
    let mpath = out.join("manifest.json");
    write_synced(&partial(&mpath), &bytes)?;
    let state_path = out.join(STATE_FILE);
    if let Err(e) = std::fs::remove_file(&state_path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        return Err(Error::io(&state_path, e));
    }
    sync_dir(out);
    crate::util::rename_durable(&partial(&mpath), &mpath).map_err(|e| Error::io(&mpath, e))?;
    Ok(manifest)
}

/// A repack of `identity` killed after its state file went but before its manifest was
/// renamed into place: finishes it and returns the manifest; `None` for anything else.
fn recover_finished(out: &Path, identity: &SourceIdentity) -> Result<Option<Manifest>> {
    let mpath = out.join("manifest.json");
    let tmp = partial(&mpath);
    if out.join(STATE_FILE).exists() || mpath.exists() || !tmp.is_file() {
        return Ok(None);
    }
    let Ok(text) = crate::util::read_capped(&tmp, crate::util::MAX_INDEX) else {
        return Ok(None);
    };
    match serde_json::from_slice::<Manifest>(&text) {
        Ok(m) if m.source == *identity => {
            crate::util::rename_durable(&tmp, &mpath).map_err(|e| Error::io(&mpath, e))?;
            tracing::info!("finished the repack in {}", out.display());
            Ok(Some(m))
        }
        _ => Ok(None),
    }
}

/// Checks the output folder: new, empty, or this same repack's unfinished output.
fn prepare_output(
    out: &Path,
    identity: &SourceIdentity,
    config_xxh3: &str,
    layers: usize,
) -> Result<RepackState> {
    let fresh = RepackState {
        identity: identity.clone(),
        config_xxh3: config_xxh3.to_string(),
        dense: None,
        layers: vec![None; layers],
    };
    if !out.exists() {
        std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
        save_state(out, &fresh)?;
        return Ok(fresh);
    }
    if out.join("manifest.json").exists() {
        return Err(Error::Checkpoint {
            path: out.to_path_buf(),
            reason: "already holds a finished container; remove it or choose another folder".into(),
        });
    }
    let state_path = out.join(STATE_FILE);
    if state_path.is_file() {
        let text = crate::util::read_capped(&state_path, crate::util::MAX_INDEX)
            .map_err(|e| Error::io(&state_path, e))?;
        match serde_json::from_slice::<RepackState>(&text) {
            Ok(s)
                if s.identity == *identity
                    && s.config_xxh3 == config_xxh3
                    && s.layers.len() == layers =>
            {
                tracing::info!("resuming repack in {}", out.display());
                return Ok(s);
            }
            Ok(_) => {
                return Err(Error::Checkpoint {
                    path: out.to_path_buf(),
                    reason: "holds an unfinished repack of a different checkpoint; remove it or choose another folder".into(),
                });
            }
            Err(_) => {
                // A state file cut short by a crash: nothing it lists can be trusted.
                tracing::warn!("unreadable {STATE_FILE}; starting the repack over");
                save_state(out, &fresh)?;
                return Ok(fresh);
            }
        }
    }
    // A run that died writing its first state file leaves at most that file's `.partial`.
    let entries: Vec<PathBuf> = std::fs::read_dir(out)
        .map_err(|e| Error::io(out, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    let own = |p: &PathBuf| p.is_file() && *p == partial(&state_path);
    if entries.iter().all(own) {
        for p in &entries {
            let _ = std::fs::remove_file(p);
        }
    } else {
        return Err(Error::Checkpoint {
            path: out.to_path_buf(),
            reason: "is not empty and is not an unfinished brook repack; refusing to write into it"
                .into(),
        });
    }
    save_state(out, &fresh)?;
    Ok(fresh)
}

fn save_state(out: &Path, s: &RepackState) -> Result<()> {
    let bytes = serde_json::to_vec(s).map_err(|e| Error::Invalid(format!("state: {e}")))?;
    write_atomic(&out.join(STATE_FILE), &bytes)
}

/// Writes `bytes` to `path` through a temporary file, fsync and rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = partial(path);
    write_synced(&tmp, bytes)?;
    crate::util::rename_durable(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Writes `bytes` to `path` and flushes them to the disk; a failure removes the file.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let written = File::create(path).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written {
        // A full disk leaves no half-written file behind.
        let _ = std::fs::remove_file(path);
        return Err(Error::io(path, e));
    }
    Ok(())
}

fn copy_atomic(from: &Path, to: &Path) -> Result<()> {
    let bytes = crate::util::read_capped(from, crate::util::MAX_TOKENIZER)
        .map_err(|e| Error::io(from, e))?;
    write_atomic(to, &bytes)
}

fn partial(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

fn sync_dir(dir: &Path) {
    crate::util::sync_dir(dir);
}

fn write_dense(
    store: &dyn TensorSource,
    names: &[String],
    out: &Path,
    p: &mut RepackProgress,
    progress: &mut dyn FnMut(RepackProgress),
) -> Result<DenseInfo> {
    let specs: Vec<TensorSpec> = names
        .iter()
        .map(|n| {
            let i = store.require(n)?;
            Ok(TensorSpec {
                name: n.clone(),
                dtype: i.dtype,
                shape: i.shape.clone(),
            })
        })
        .collect::<Result<_>>()?;
    let meta = BTreeMap::from([("format".to_string(), "brook-dense".to_string())]);
    let (prefix, order) = header_prefix(&specs, &meta)?;
    let path = out.join("dense.safetensors");
    let tmp = partial(&path);
    let io = |e| Error::io(&tmp, e);
    let mut w = HashingWriter::new(File::create(&tmp).map_err(io)?);
    w.write_all(&prefix).map_err(io)?;
    for spec in &order {
        let len = store.require(&spec.name)?.len;
        let mut off = 0;
        while off < len {
            let n = COPY_CHUNK.min(len - off);
            w.write_all(&store.read_range(&spec.name, off, n)?)
                .map_err(io)?;
            off += n;
            p.bytes_done += n;
            progress(*p);
        }
    }
    let (file, hash, size) = w.finish().map_err(io)?;
    file.sync_all().map_err(io)?;
    crate::util::rename_durable(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    Ok(DenseInfo {
        file: "dense.safetensors".into(),
        size,
        xxh3: format!("{hash:016x}"),
    })
}

#[allow(clippy::too_many_arguments)]
fn write_layer(
    store: &dyn TensorSource,
    cfg: &ModelConfig,
    layer: usize,
    layout: &ExpertLayout,
    stride: u64,
    out: &Path,
    p: &mut RepackProgress,
    progress: &mut dyn FnMut(RepackProgress),
) -> Result<LayerInfo> {
    let file = layer_file(layer);
    let path = out.join(&file);
    let tmp = partial(&path);
    let io = |e| Error::io(&tmp, e);
    // Blobs are whole 16 KiB multiples in page-aligned memory, so they can bypass the page
    // cache (one copy fewer, and a 40 GB repack does not evict everything else).
    let mut w = open_direct_or_buffered(&tmp)?;
    let mut blob = AlignedBuf::zeroed(stride as usize);
    let mut hashes = Vec::with_capacity(cfg.num_experts);
    for e in 0..cfg.num_experts {
        layout.read_blob(store, layer, e, &mut blob)?;
        hashes.push(hash_hex(&blob[..layout.blob_size as usize]));
        w.write_all(&blob).map_err(io)?;
        p.bytes_done += stride;
        progress(*p);
    }
    w.sync_all().map_err(io)?;
    crate::util::rename_durable(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    Ok(LayerInfo {
        file,
        stride,
        blob_size: layout.blob_size,
        sections: layout.sections.clone(),
        xxh3: hashes,
    })
}

/// Creates `path` for writing with O_DIRECT where the filesystem allows it (tmpfs does not).
fn open_direct_or_buffered(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let direct = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    match direct {
        Ok(f) => Ok(f),
        Err(_) => File::create(path).map_err(|e| Error::io(path, e)),
    }
}

/// A buffered writer that hashes and counts what passes through.
struct HashingWriter {
    inner: BufWriter<File>,
    hasher: xxhash_rust::xxh3::Xxh3,
    len: u64,
}

impl HashingWriter {
    fn new(f: File) -> Self {
        HashingWriter {
            inner: BufWriter::with_capacity(8 << 20, f),
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            len: 0,
        }
    }
    fn finish(self) -> std::io::Result<(File, u64, u64)> {
        let hash = self.hasher.digest();
        let f = self.inner.into_inner().map_err(|e| e.into_error())?;
        Ok((f, hash, self.len))
    }
}

impl Write for HashingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
