//! The expert container: a folder laid out so one routed expert is one aligned read.
//!
//! `manifest.json` (written last, by atomic rename) describes everything; `dense.safetensors`
//! holds the resident tensors in their original bytes under canonical names;
//! `experts/layer-NNN.bin` holds `num_experts × stride` bytes, expert e's blob at `e × stride`.
//! docs/FORMAT.md is the specification; this module reads it and checks it at open, so a
//! truncated layer file or a corrupt manifest is refused before any token runs.

pub mod layout;
pub mod repack;
pub mod verify;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::aligned::AlignedBuf;
use crate::checkpoint::TensorSource;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::experts::source::{ExpertData, ExpertView};
use crate::safetensors::{SafeFile, TensorInfo};
pub use layout::{ExpertLayout, Section};

/// The `format` field of every manifest.
pub const FORMAT: &str = "brook-container";
/// The version this build writes and reads.
pub const VERSION: u32 = 1;
/// Expert strides are rounded up to this (Linux O_DIRECT and Apple's 16 KiB pages).
pub const STRIDE_ALIGN: u64 = 16 * 1024;

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// The source's config.json, verbatim.
    pub config: serde_json::Value,
    /// The source's generation_config.json, if it had one.
    #[serde(default)]
    pub generation_config: Option<serde_json::Value>,
    pub source: SourceIdentity,
    pub dense: DenseInfo,
    pub experts: ExpertsInfo,
    /// Other files copied from the source (tokenizer, chat template, configs).
    #[serde(default)]
    pub copied_files: Vec<String>,
}

/// What the container was made from, so `verify --source` can tell it is the same checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceIdentity {
    /// How the source was named when repacked (a folder name or `synth:PRESET`).
    pub name: String,
    /// Each weight file: name, size and the xxh3-64 of its safetensors header.
    pub files: Vec<SourceFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    pub name: String,
    pub size: u64,
    pub header_xxh3: String,
}

/// `dense.safetensors`: size and xxh3-64 of the whole file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseInfo {
    pub file: String,
    pub size: u64,
    pub xxh3: String,
}

/// The routed experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertsInfo {
    pub num_experts: usize,
    /// Alignment every stride is a multiple of.
    pub alignment: u64,
    pub layers: Vec<LayerInfo>,
}

/// One `experts/layer-NNN.bin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerInfo {
    pub file: String,
    /// Bytes from one expert's blob to the next; a multiple of `alignment`.
    pub stride: u64,
    /// Meaningful bytes of each blob; the rest of the stride is zero.
    pub blob_size: u64,
    pub sections: Vec<Section>,
    /// xxh3-64 of each expert's `blob_size` bytes, lowercase hex, by expert index.
    pub xxh3: Vec<String>,
}

/// Lowercase hex of an xxh3-64 digest.
pub fn hash_hex(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// The per-layer file name.
pub fn layer_file(layer: usize) -> String {
    format!("experts/layer-{layer:03}.bin")
}

/// An opened, checked container.
#[derive(Debug)]
pub struct Container {
    dir: PathBuf,
    pub manifest: Manifest,
    pub config: ModelConfig,
    dense: SafeFile,
    /// Parsed section table per layer.
    pub layouts: Vec<Arc<ExpertLayout>>,
}

/// Whether `dir` holds a finished container (a manifest).
pub fn is_container(dir: &Path) -> bool {
    dir.join("manifest.json").is_file()
}

impl Container {
    /// Opens `dir`, checking the manifest, the dense file and every layer file's size.
    pub fn open(dir: &Path) -> Result<Self> {
        let mpath = dir.join("manifest.json");
        let bad = |reason: String| Error::Json {
            path: mpath.clone(),
            reason: format!("{reason}; re-run `brook repack` to rebuild the container"),
        };
        let text = crate::util::read_capped(&mpath, crate::util::MAX_INDEX)
            .map_err(|e| Error::io(&mpath, e))?;
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| bad(format!("corrupt container manifest: {e}")))?;
        if manifest.format != FORMAT {
            return Err(bad(format!(
                "`format` is `{}`, not `{FORMAT}`",
                manifest.format
            )));
        }
        if manifest.version != VERSION {
            return Err(bad(format!(
                "container format version {} (this brook reads version {VERSION})",
                manifest.version
            )));
        }
        let config = ModelConfig::from_json(&manifest.config)?;
        let ex = &manifest.experts;
        for name in [&manifest.dense.file]
            .into_iter()
            .chain(ex.layers.iter().map(|l| &l.file))
            .chain(&manifest.copied_files)
        {
            if !crate::util::is_confined(name) {
                return Err(bad(format!(
                    "file name `{name}` points outside the container (absolute, `..` or empty)"
                )));
            }
        }
        if !ex.alignment.is_power_of_two() || ex.alignment > 1 << 20 {
            return Err(bad(format!(
                "expert alignment {} is not a power of two up to 1 MiB",
                ex.alignment
            )));
        }
        if ex.num_experts != config.num_experts || ex.layers.len() != config.num_hidden_layers {
            return Err(bad(format!(
                "manifest lists {} layers of {} experts, config says {} of {}",
                ex.layers.len(),
                ex.num_experts,
                config.num_hidden_layers,
                config.num_experts
            )));
        }
        let dense_path = dir.join(&manifest.dense.file);
        let dense_len = std::fs::metadata(&dense_path)
            .map_err(|e| Error::io(&dense_path, e))?
            .len();
        if dense_len != manifest.dense.size {
            return Err(Error::Checkpoint {
                path: dense_path,
                reason: format!(
                    "is {dense_len} bytes, the manifest says {} (truncated or replaced)",
                    manifest.dense.size
                ),
            });
        }
        let dense = SafeFile::open(&dense_path)?;
        let mut layouts = Vec::with_capacity(ex.layers.len());
        for (l, info) in ex.layers.iter().enumerate() {
            let layout = ExpertLayout::from_sections(info.sections.clone(), &config, l, false)?;
            // Repack pads each blob to the next multiple of the alignment and no further.
            if !info.stride.is_multiple_of(ex.alignment)
                || info.stride < layout.blob_size
                || info.stride - layout.blob_size >= ex.alignment
                || info.blob_size != layout.blob_size
                || info.xxh3.len() != ex.num_experts
            {
                return Err(bad(format!(
                    "layer {l}: inconsistent stride, blob size or hash list"
                )));
            }
            let path = dir.join(&info.file);
            let want = info.stride * ex.num_experts as u64;
            let got = std::fs::metadata(&path)
                .map_err(|e| Error::io(&path, e))?
                .len();
            if got != want {
                return Err(Error::Checkpoint {
                    path,
                    reason: format!(
                        "layer file is {got} bytes, expected {want} ({} experts × stride {}); truncated? re-run `brook repack`",
                        ex.num_experts, info.stride
                    ),
                });
            }
            layouts.push(Arc::new(layout));
        }
        Ok(Container {
            dir: dir.to_path_buf(),
            manifest,
            config,
            dense,
            layouts,
        })
    }

    /// Path of layer `layer`'s expert file.
    pub fn layer_path(&self, layer: usize) -> PathBuf {
        self.dir.join(&self.manifest.experts.layers[layer].file)
    }

    /// The file holding the dense tensors.
    pub fn dense_path(&self) -> PathBuf {
        self.dir.join(&self.manifest.dense.file)
    }

    /// Reads expert `e` of `layer` into a new buffer (buffered I/O; the streaming store uses
    /// its own direct reads).
    pub fn read_expert(&self, layer: usize, e: usize) -> Result<ExpertBlob> {
        let info = &self.manifest.experts.layers[layer];
        let mut buf = AlignedBuf::zeroed(info.stride as usize);
        let path = self.layer_path(layer);
        let f = File::open(&path).map_err(|er| Error::io(&path, er))?;
        f.read_exact_at(&mut buf, e as u64 * info.stride)
            .map_err(|er| Error::io(&path, er))?;
        Ok(ExpertBlob {
            layout: self.layouts[layer].clone(),
            bytes: buf,
        })
    }
}

impl TensorSource for Container {
    fn dir(&self) -> &Path {
        &self.dir
    }
    fn names(&self) -> Vec<String> {
        self.dense.tensors.keys().cloned().collect()
    }
    fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.dense.tensors.get(name)
    }
    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
        let info = self.require(name)?;
        if offset.checked_add(len).is_none_or(|end| end > info.len) {
            return Err(Error::Invalid(format!(
                "read past the end of tensor `{name}`"
            )));
        }
        let mut buf = crate::aligned::zeroed_vec(len as usize);
        self.dense.read_into(info.offset + offset, &mut buf)?;
        Ok(buf)
    }
}

/// One expert's blob in memory, with the layout to view it.
#[derive(Debug)]
pub struct ExpertBlob {
    pub layout: Arc<ExpertLayout>,
    pub bytes: AlignedBuf,
}

impl ExpertData for ExpertBlob {
    fn view(&self) -> ExpertView<'_> {
        self.layout.view(&self.bytes)
    }
}
