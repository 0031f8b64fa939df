//! Writing a synthetic model as an MLX checkpoint folder (shards cut as mlx-lm cuts them,
//! index, config), and the folder and free-space checks the writers share.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use super::SynthModel;
use crate::checkpoint::TensorSource;
use crate::config::canonical_name;
use crate::error::{Error, Result};

/// Largest shard mlx-lm writes (`MAX_FILE_SIZE_GB = 5`).
pub const SHARD_BYTES: u64 = 5 << 30;

/// Writes `store` as an MLX checkpoint folder (shards, index, config, generation config).
/// `progress(done, total)` is called as bytes are written.
pub fn write_checkpoint(
    store: &SynthModel,
    out: &Path,
    shard_bytes: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    use std::io::Write;
    prepare_empty(out)?;
    check_free_space(out, store.total_bytes())?;
    let mut names: Vec<(String, String)> = store
        .names()
        .into_iter()
        .map(|n| (store.stored_name(&n), n))
        .collect();
    names.sort();
    // Greedy cut in key order, as mlx-lm's make_shards.
    let mut shards: Vec<Vec<(String, String)>> = vec![Vec::new()];
    let mut size = 0;
    for (stored, canon) in names {
        let len = store.tensors[&canon].info.len;
        if size + len > shard_bytes && !shards.last().is_some_and(Vec::is_empty) {
            shards.push(Vec::new());
            size = 0;
        }
        size += len;
        if let Some(s) = shards.last_mut() {
            s.push((stored, canon));
        }
    }
    let n = shards.len();
    let total = store.total_bytes();
    let mut done = 0;
    let mut weight_map = serde_json::Map::new();
    let meta = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        let specs: Vec<crate::safetensors::TensorSpec> = shard
            .iter()
            .map(|(stored, canon)| {
                let info = &store.tensors[canon].info;
                crate::safetensors::TensorSpec {
                    name: stored.clone(),
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                }
            })
            .collect();
        let (prefix, order) = crate::safetensors::header_prefix(&specs, &meta)?;
        let path = out.join(&file);
        let tmp = out.join(format!("{file}.partial"));
        let io = |e| Error::io(&tmp, e);
        let mut w =
            std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&tmp).map_err(io)?);
        w.write_all(&prefix).map_err(io)?;
        for spec in &order {
            let canon = canonical_name(&spec.name);
            let len = store.tensors[canon].info.len;
            let mut off = 0;
            while off < len {
                let n = (32u64 << 20).min(len - off);
                w.write_all(&store.read_range(canon, off, n)?).map_err(io)?;
                off += n;
                done += n;
                progress(done, total);
            }
            weight_map.insert(spec.name.clone(), Value::String(file.clone()));
        }
        let f = w.into_inner().map_err(|e| io(e.into_error()))?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    }
    let mut sorted: Vec<(String, Value)> = weight_map.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let index = json!({
        "metadata": {"total_size": total},
        "weight_map": Value::Object(sorted.into_iter().collect()),
    });
    let write_json = |name: &str, v: &Value| -> Result<()> {
        let bytes = serde_json::to_vec_pretty(v).map_err(|e| Error::Invalid(e.to_string()))?;
        crate::container::repack::write_atomic(&out.join(name), &bytes)
    };
    write_json("model.safetensors.index.json", &index)?;
    write_json("generation_config.json", &store.generation_config())?;
    write_json("config.json", &store.config_json)?;
    Ok(())
}

/// Creates `out` or checks that it is empty.
pub fn prepare_empty(out: &Path) -> Result<()> {
    if out.exists() {
        let mut it = std::fs::read_dir(out).map_err(|e| Error::io(out, e))?;
        if it.next().is_some() {
            return Err(Error::Checkpoint {
                path: out.to_path_buf(),
                reason: "is not empty; choose a new folder".into(),
            });
        }
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))
}

/// Refuses to start a write of `need` bytes where the filesystem has less free space.
pub fn check_free_space(dir: &Path, need: u64) -> Result<()> {
    let Some(free) = free_space(dir) else {
        return Ok(());
    };
    if free < need {
        return Err(Error::Checkpoint {
            path: dir.to_path_buf(),
            reason: format!(
                "needs {:.1} GB but the filesystem has {:.1} GB free",
                need as f64 / 1e9,
                free as f64 / 1e9
            ),
        });
    }
    Ok(())
}

/// Free bytes on the filesystem holding `dir`, if the OS tells.
pub fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into a zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}
