//! Reading and writing safetensors files without mapping them.
//!
//! The header is parsed and checked in full at open, as strictly as Hugging Face's own parser:
//! every tensor's byte length against dtype × shape (checked products), every extent inside
//! the file, and the extents tiling the data section exactly (no overlap, no gap, nothing
//! after the last tensor), so a truncated, malformed or crafted file is refused with its name
//! before any tensor is used. Tensor bytes are read
//! with positioned reads; nothing is mmapped, so expert data never pollutes the page cache
//! through this path. Mirrors the format as `safetensors` (huggingface) specifies it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Header larger than this is refused: real headers of 100k-tensor checkpoints are a few MB.
const MAX_HEADER: u64 = 256 << 20;

/// Where one tensor lives in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the first element in the file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open safetensors file with its parsed header.
#[derive(Debug)]
pub struct SafeFile {
    path: PathBuf,
    file: File,
    /// Tensor name → location, sorted by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The `__metadata__` string map.
    pub metadata: BTreeMap<String, String>,
    /// Bytes before the data section: the 8-byte length plus the JSON header.
    pub header_len: u64,
}

impl SafeFile {
    /// Opens `path` and validates its header against the file length.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let bad = |reason: String| Error::Safetensors {
            path: path.to_path_buf(),
            reason,
        };
        if file_len < 8 {
            return Err(bad(format!(
                "file is {file_len} bytes, shorter than the 8-byte header length (truncated?)"
            )));
        }
        let mut len_bytes = [0u8; 8];
        file.read_exact_at(&mut len_bytes, 0)
            .map_err(|e| Error::io(path, e))?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER || 8 + header_len > file_len {
            return Err(bad(format!(
                "header length {header_len} does not fit in a file of {file_len} bytes (truncated or not safetensors)"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| Error::io(path, e))?;
        let header: Value = serde_json::from_slice(&header)
            .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let Value::Object(entries) = header else {
            return Err(bad("header is not a JSON object".into()));
        };
        let data_start = 8 + header_len;
        let data_len = file_len - data_start;
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, entry) in entries {
            if name == "__metadata__" {
                if let Value::Object(m) = entry {
                    for (k, v) in m {
                        if let Value::String(s) = v {
                            metadata.insert(k, s);
                        }
                    }
                }
                continue;
            }
            let info = parse_entry(&name, &entry, data_len).map_err(bad)?;
            tensors.insert(
                name,
                TensorInfo {
                    offset: data_start + info.offset,
                    ..info
                },
            );
        }
        check_layout(&tensors, data_start, data_len).map_err(bad)?;
        Ok(SafeFile {
            path: path.to_path_buf(),
            file,
            tensors,
            metadata,
            header_len: data_start,
        })
    }

    /// The raw header bytes (length prefix and JSON), e.g. to fingerprint the file.
    pub fn header_bytes(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; self.header_len as usize];
        self.read_into(0, &mut buf)?;
        Ok(buf)
    }

    /// The file's length in bytes.
    pub fn file_len(&self) -> Result<u64> {
        Ok(self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, e))?
            .len())
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the raw bytes of a tensor described by `info`.
    pub fn read(&self, info: &TensorInfo) -> Result<Vec<u8>> {
        let mut buf = crate::aligned::zeroed_vec(info.len as usize);
        self.read_into(info.offset, &mut buf)?;
        Ok(buf)
    }

    /// Reads `buf.len()` bytes at absolute offset `offset`.
    pub fn read_into(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Error::Safetensors {
                    path: self.path.clone(),
                    reason: format!(
                        "file ended while reading {} bytes at offset {offset} (truncated?)",
                        buf.len()
                    ),
                }
            } else {
                Error::io(&self.path, e)
            }
        })
    }
}

/// The tensors' extents (absolute offsets) must tile `data_start..data_start + data_len`:
/// sorted by offset, each begins where the previous ended, the last ends at the file's end.
fn check_layout(
    tensors: &BTreeMap<String, TensorInfo>,
    data_start: u64,
    data_len: u64,
) -> Result<(), String> {
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .map(|(n, t)| (t.offset - data_start, t.len, n.as_str()))
        .collect();
    spans.sort_unstable();
    let mut at = 0u64;
    let mut prev = "the header";
    for (begin, len, name) in spans {
        if begin < at {
            return Err(format!(
                "tensor `{name}` (bytes {begin}..{}) overlaps `{prev}`, which ends at {at}",
                begin + len
            ));
        }
        if begin > at {
            return Err(format!(
                "{} bytes between `{prev}` and tensor `{name}` belong to no tensor",
                begin - at
            ));
        }
        at = begin + len;
        prev = name;
    }
    if at != data_len {
        return Err(format!(
            "the data section has {data_len} bytes but its tensors cover {at} (trailing bytes, or a file that is not what its header says)"
        ));
    }
    Ok(())
}

fn parse_entry(name: &str, entry: &Value, data_len: u64) -> Result<TensorInfo, String> {
    let dtype_s = entry
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("tensor `{name}` has no dtype"))?;
    let dtype = DType::parse(dtype_s)
        .ok_or_else(|| format!("tensor `{name}` has dtype {dtype_s}, which brook does not read"))?;
    let shape = entry
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("tensor `{name}` has no shape"))?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| format!("tensor `{name}` has a non-integer dimension"))?;
    let offs = entry
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
        .ok_or_else(|| format!("tensor `{name}` has no valid data_offsets"))?;
    let (begin, end) = offs;
    let numel = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| format!("tensor `{name}` shape {shape:?} overflows"))?;
    let want = numel
        .checked_mul(dtype.size() as u64)
        .ok_or_else(|| format!("tensor `{name}` is too large"))?;
    if end < begin || end - begin != want {
        return Err(format!(
            "tensor `{name}` spans bytes {begin}..{end} but {dtype_s} {shape:?} needs {want}"
        ));
    }
    if end > data_len {
        return Err(format!(
            "tensor `{name}` ends at byte {end} of the data section, which has only {data_len} bytes (truncated file)"
        ));
    }
    Ok(TensorInfo {
        dtype,
        shape,
        offset: begin,
        len: want,
    })
}

/// One tensor to write: name, dtype, shape and its little-endian bytes.
#[derive(Debug, Clone)]
pub struct TensorOut<'a> {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

/// The name, dtype and shape of a tensor to be written; its bytes follow in name order.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// The bytes that open a safetensors file holding `specs` (sorted by name by this function):
/// the 8-byte header length and the JSON header, space-padded so data starts 8-aligned.
/// Returns the prefix and the specs in the order their data must follow.
pub fn header_prefix(
    specs: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<TensorSpec>)> {
    let mut sorted = specs.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let m = metadata
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        header.insert("__metadata__".into(), Value::Object(m));
    }
    let mut offset = 0u64;
    for t in &sorted {
        let end = offset + (t.shape.iter().product::<usize>() * t.dtype.size()) as u64;
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&Value::Object(header))
        .map_err(|e| Error::Invalid(format!("cannot encode header: {e}")))?;
    while (8 + json.len()) % 8 != 0 {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok((out, sorted))
}

/// Writes tensors to `path` atomically (a temporary file renamed into place).
///
/// Tensors are stored sorted by name, with `metadata` as the `__metadata__` map.
pub fn write(
    path: &Path,
    tensors: &[TensorOut<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    for t in tensors {
        let want = t.shape.iter().product::<usize>() * t.dtype.size();
        if want != t.data.len() {
            return Err(Error::Invalid(format!(
                "tensor `{}`: {} bytes given for {} {:?}",
                t.name,
                t.data.len(),
                t.dtype,
                t.shape
            )));
        }
    }
    let (prefix, order) = header_prefix(&specs, metadata)?;
    let tmp = path.with_extension("safetensors.partial");
    let io = |e| Error::io(&tmp, e);
    let mut f = std::io::BufWriter::new(File::create(&tmp).map_err(io)?);
    f.write_all(&prefix).map_err(io)?;
    for spec in &order {
        let t = tensors
            .iter()
            .find(|t| t.name == spec.name)
            .map(|t| t.data)
            .unwrap_or_default();
        f.write_all(t).map_err(io)?;
    }
    let f = f.into_inner().map_err(|e| io(e.into_error()))?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    Ok(())
}

/// f32 values as little-endian bytes, for [`write`](fn@write).
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
