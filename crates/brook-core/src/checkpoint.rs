//! MLX checkpoint folders: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, possibly as symlinks into a Hugging Face cache snapshot.
//!
//! Owns the map from canonical tensor names to file extents and the checkpoint-level quirks:
//! the Qwen3.5 `language_model.` prefix is removed, vision (`vision_tower.*`, `model.visual.*`)
//! and multi-token-prediction (`mtp.*`) tensors are ignored as mlx-lm's `sanitize` drops them,
//! and raw Hugging Face checkpoints (not converted by mlx-lm) are recognised and refused with
//! what to do. Tensor bytes are read on demand; nothing is mapped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::{ModelConfig, canonical_name};
use crate::error::{Error, Result};
use crate::safetensors::{SafeFile, TensorInfo};

/// Anything that serves tensors by canonical name: a checkpoint or a container.
pub trait TensorSource {
    /// The folder the tensors come from, for error messages.
    fn dir(&self) -> &Path;
    /// Location and type of tensor `name`, if present.
    fn info(&self, name: &str) -> Option<&TensorInfo>;
    /// Reads `len` bytes of tensor `name` starting `offset` bytes into it.
    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Vec<u8>>;
    /// Fills `buf` with bytes of tensor `name` starting `offset` bytes into it.
    fn read_range_into(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        let bytes = self.read_range(name, offset, buf.len() as u64)?;
        buf.copy_from_slice(&bytes);
        Ok(())
    }
    /// Canonical names of every tensor served, sorted.
    fn names(&self) -> Vec<String>;
    /// Reads all bytes of tensor `name`.
    fn read(&self, name: &str) -> Result<Vec<u8>> {
        let len = self.require(name)?.len;
        self.read_range(name, 0, len)
    }
    /// Like [`TensorSource::info`] but a missing tensor is an error naming it.
    fn require(&self, name: &str) -> Result<&TensorInfo> {
        self.info(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.dir().to_path_buf(),
        })
    }
}

/// An opened MLX checkpoint folder.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<SafeFile>,
    /// Canonical name → (index into `files`, name as stored).
    index: BTreeMap<String, (usize, String)>,
    pub config: ModelConfig,
}

/// Whether a stored tensor is one brook ignores (vision tower, MTP head).
pub fn is_ignored(name: &str) -> bool {
    let c = canonical_name(name);
    c.starts_with("vision_tower")
        || c.starts_with("model.visual")
        || c.starts_with("visual.")
        || name.contains("mtp.")
}

impl Checkpoint {
    /// Opens `dir`, reading config.json and every shard's header.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                reason: "not a folder (expected an MLX checkpoint folder or a brook container)"
                    .into(),
            });
        }
        let config = ModelConfig::from_dir(dir)?;
        let names = shard_names(dir)?;
        let mut files = Vec::with_capacity(names.len());
        let mut index = BTreeMap::new();
        for name in &names {
            let file = SafeFile::open(&dir.join(name))?;
            for tensor in file.tensors.keys() {
                if is_ignored(tensor) {
                    continue;
                }
                let canon = canonical_name(tensor).to_string();
                if let Some((other, _)) = index.insert(canon.clone(), (files.len(), tensor.clone()))
                {
                    return Err(Error::Checkpoint {
                        path: dir.to_path_buf(),
                        reason: format!(
                            "tensor `{tensor}` appears in both {} and {name}",
                            names[other]
                        ),
                    });
                }
            }
            files.push(file);
        }
        let ck = Checkpoint {
            dir: dir.to_path_buf(),
            files,
            index,
            config,
        };
        ck.refuse_unconverted()?;
        Ok(ck)
    }

    /// Canonical names of every tensor brook uses, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The safetensors files, in the order they were opened.
    pub fn files(&self) -> &[SafeFile] {
        &self.files
    }

    /// The file holding canonical tensor `name` and the name it has there.
    pub fn locate(&self, name: &str) -> Option<(&SafeFile, &str)> {
        self.index
            .get(name)
            .map(|(f, stored)| (&self.files[*f], stored.as_str()))
    }

    fn refuse_unconverted(&self) -> Result<()> {
        let raw = self.index.keys().find(|k| {
            k.starts_with("model.language_model.")
                || k.contains(".mlp.experts.")
                || (k.ends_with("conv1d.weight")
                    && self
                        .info(k)
                        .is_some_and(|i| i.shape.len() == 3 && i.shape[2] != 1))
        });
        match raw {
            Some(k) => Err(Error::Checkpoint {
                path: self.dir.clone(),
                reason: format!(
                    "this looks like a Hugging Face checkpoint, not an MLX one (tensor `{k}`); convert it first with `mlx_lm.convert --hf-path ... -q` or use an mlx-community checkpoint"
                ),
            }),
            None => Ok(()),
        }
    }
}

impl TensorSource for Checkpoint {
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn names(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }

    fn info(&self, name: &str) -> Option<&TensorInfo> {
        let (f, stored) = self.index.get(name)?;
        self.files[*f].tensors.get(stored)
    }

    fn read_range(&self, name: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut buf = crate::aligned::zeroed_vec(len as usize);
        self.read_range_into(name, offset, &mut buf)?;
        Ok(buf)
    }

    fn read_range_into(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        let info = self.require(name)?;
        let (f, _) = &self.index[name];
        let len = buf.len() as u64;
        if offset + len > info.len {
            return Err(Error::Invalid(format!(
                "read of {len} bytes at {offset} past the end of tensor `{name}` ({} bytes)",
                info.len
            )));
        }
        self.files[*f].read_into(info.offset + offset, buf)
    }
}

/// The safetensors files of a checkpoint folder, from its index or by listing.
fn shard_names(dir: &Path) -> Result<Vec<String>> {
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.is_file() {
        let text = crate::util::read_capped_string(&index_path, crate::util::MAX_INDEX)
            .map_err(|e| Error::io(&index_path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: index_path.clone(),
            reason: format!("not valid JSON: {e}"),
        })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Json {
                path: index_path.clone(),
                reason: "no `weight_map` object".into(),
            })?;
        let mut names: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        names.sort();
        names.dedup();
        for n in &names {
            if n.contains('/') || n.contains("..") {
                return Err(Error::Json {
                    path: index_path.clone(),
                    reason: format!("shard name `{n}` is not a plain file name"),
                });
            }
            let p = dir.join(n);
            if !p.is_file() {
                return Err(Error::Checkpoint {
                    path: p,
                    reason: "shard listed in model.safetensors.index.json is missing (interrupted download?)".into(),
                });
            }
        }
        return Ok(names);
    }
    let mut names = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // mlx-lm loads `model*.safetensors`; other safetensors files in the folder are not weights.
        if name.starts_with("model") && name.ends_with(".safetensors") && entry.path().is_file() {
            names.push(name);
        }
    }
    names.sort();
    if names.is_empty() {
        return Err(Error::Checkpoint {
            path: dir.to_path_buf(),
            reason: "no model*.safetensors files and no model.safetensors.index.json".into(),
        });
    }
    Ok(names)
}
