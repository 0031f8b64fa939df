//! The token embedding table [V, H]: held in memory, or read from the model file one row per
//! token.
//!
//! Owns the choice and the row reads. A decoded token needs one row of the table (about 1.2 KB
//! of the 35B's 286 MB), so a container's table stays on disk and each lookup reads the row's
//! packed words, scales and biases with three `pread`s into a buffer kept for the purpose (no
//! allocation per token). A checkpoint loaded whole, and a table the output head shares
//! (tied embeddings), stay resident. Mirrors [`crate::linear::Linear::row`]: a row read from
//! disk dequantizes to the same floats as the resident row.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::cpu::kernels::qmatvec::{check, dequant_row};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::linear::{Linear, LinearRef, MatRef, Weights};
use crate::model::weights::Layout;

/// The token embedding table.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// Every row in memory.
    Resident(Linear),
    /// Rows read from the model file as they are needed.
    Rows(Arc<EmbeddingRows>),
}

impl Embedding {
    /// Rows (the vocabulary size).
    pub fn out_features(&self) -> usize {
        match self {
            Embedding::Resident(l) => l.out_features,
            Embedding::Rows(r) => r.out,
        }
    }

    /// Writes token `r`'s row, dequantized, into `out` (length `in_features`).
    pub fn row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        if r >= self.out_features() {
            return Err(Error::Invalid(format!(
                "token id {r} is outside the embedding table ({} rows)",
                self.out_features()
            )));
        }
        match self {
            Embedding::Resident(l) => {
                dequant_row(&l.view(), r, out);
                Ok(())
            }
            Embedding::Rows(rows) => rows.row(r, out),
        }
    }

    /// Bytes held in memory.
    pub fn nbytes(&self) -> usize {
        match self {
            Embedding::Resident(l) => l.nbytes(),
            Embedding::Rows(r) => r.row_bytes(),
        }
    }

    /// Bytes of the whole table, wherever it is.
    pub fn table_bytes(&self) -> usize {
        match self {
            Embedding::Resident(l) => l.nbytes(),
            Embedding::Rows(r) => r.row_bytes() * r.out,
        }
    }

    /// The whole table in memory: the resident one, or read from disk now (for a backend
    /// that keeps its own copy, such as a GPU's).
    pub fn load(&self) -> Result<std::borrow::Cow<'_, Linear>> {
        match self {
            Embedding::Resident(l) => Ok(std::borrow::Cow::Borrowed(l)),
            Embedding::Rows(r) => r.read_all().map(std::borrow::Cow::Owned),
        }
    }
}

/// How a row is stored.
#[derive(Debug, Clone, Copy)]
enum RowFormat {
    Float(DType),
    Affine {
        spec: crate::config::QuantSpec,
        float: DType,
    },
}

/// An embedding table left in its file: where each of its tensors starts and how many bytes a
/// row takes in each (weights, then scales and biases when quantized).
#[derive(Debug)]
pub struct EmbeddingRows {
    path: PathBuf,
    file: File,
    out: usize,
    inp: usize,
    format: RowFormat,
    /// (absolute offset of the tensor, bytes per row), for the weights, scales and biases.
    parts: Vec<(u64, usize)>,
    buf: Mutex<Vec<u8>>,
}

impl EmbeddingRows {
    /// The table of `layout` [out, inp], whose tensors lie in the file at `path`.
    pub(crate) fn open(path: &Path, layout: &Layout, out: usize, inp: usize) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let format = match layout {
            Layout::Float { dtype, .. } => RowFormat::Float(*dtype),
            Layout::Affine { spec, float, .. } => RowFormat::Affine {
                spec: *spec,
                float: *float,
            },
        };
        // (absolute offset, bytes per row) of each tensor.
        let parts: Vec<(u64, usize)> = layout
            .tensors()
            .iter()
            .map(|t| (t.1.offset, t.1.len as usize / out.max(1)))
            .collect();
        let rows = EmbeddingRows {
            path: path.to_path_buf(),
            file,
            out,
            inp,
            format,
            buf: Mutex::new(vec![0; parts.iter().map(|p| p.1).sum()]),
            parts,
        };
        // The kernels must take this format (checked once, on the row buffer).
        check(&rows.view(&rows.buf.lock().unwrap_or_else(|p| p.into_inner())))?;
        Ok(rows)
    }

    /// Bytes of one row, all parts together.
    pub fn row_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.1).sum()
    }

    /// One row laid out part after part in `buf`, as a one-row matrix.
    fn view<'a>(&self, buf: &'a [u8]) -> LinearRef<'a> {
        let mat = match self.format {
            RowFormat::Float(dtype) => MatRef::Float { dtype, data: buf },
            RowFormat::Affine { spec, float } => {
                let (w, s) = (self.parts[0].1, self.parts[1].1);
                MatRef::Affine {
                    spec,
                    float,
                    packed: &buf[..w],
                    scales: &buf[w..w + s],
                    biases: &buf[w + s..],
                    order: crate::linear::Order::Rows,
                }
            }
        };
        LinearRef {
            out_features: 1,
            in_features: self.inp,
            mat,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Error::Safetensors {
                    path: self.path.clone(),
                    reason: format!(
                        "file ended while reading an embedding row at offset {offset} (truncated? run `brook verify`)"
                    ),
                }
            } else {
                Error::io(&self.path, e)
            }
        })
    }

    /// Reads and dequantizes row `r` (< the table's rows) into `out`.
    fn row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        let mut buf = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let mut at = 0;
        for &(offset, len) in &self.parts {
            self.read_at(&mut buf[at..at + len], offset + (r * len) as u64)?;
            at += len;
        }
        dequant_row(&self.view(&buf), 0, out);
        Ok(())
    }

    /// The whole table, read into memory.
    fn read_all(&self) -> Result<Linear> {
        let mut parts = Vec::with_capacity(self.parts.len());
        for &(offset, len) in &self.parts {
            let mut v = vec![0u8; len * self.out];
            self.read_at(&mut v, offset)?;
            parts.push(v);
        }
        let weights = match self.format {
            RowFormat::Float(dtype) => Weights::Float {
                dtype,
                data: parts.remove(0),
            },
            RowFormat::Affine { spec, float } => {
                let biases = parts.pop().unwrap_or_default();
                let scales = parts.pop().unwrap_or_default();
                Weights::Affine {
                    spec,
                    float,
                    packed: parts.pop().unwrap_or_default(),
                    scales,
                    biases,
                    order: crate::linear::Order::Rows,
                }
            }
        };
        Ok(Linear {
            out_features: self.out,
            in_features: self.inp,
            weights,
        })
    }
}
