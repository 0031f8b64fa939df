//! The section table of one expert blob and the views it gives onto blob bytes.
//!
//! A blob holds one routed expert's gate, up and down projections (weight, and for quantized
//! ones scales and biases) back to back, each section starting on a 64-byte boundary. The
//! same layout serves repack (source slices → blob), the container reader and cache slots
//! (blob bytes → [`ExpertView`] without copying). Shapes are checked against the config here.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::checkpoint::TensorSource;
use crate::config::{ModelConfig, QuantSpec};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::experts::source::ExpertView;
use crate::linear::{LinearRef, MatRef};
use crate::quant;

/// Alignment of each section inside a blob.
pub const SECTION_ALIGN: u64 = 64;

/// Largest expert blob a manifest may describe (the 80B's are about 1.7 MB).
pub const MAX_BLOB: u64 = 1 << 32;
/// The three projections of an expert, in blob order.
pub const PROJS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// One tensor slice inside an expert blob, as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    /// `gate_proj.weight`, `gate_proj.scales`, ...
    pub name: String,
    /// Safetensors dtype name.
    pub dtype: String,
    /// Per-expert shape (the stacked tensor's shape without its leading expert dimension).
    pub shape: Vec<usize>,
    /// Byte offset inside the blob.
    pub offset: u64,
    /// Byte length.
    pub size: u64,
    /// Quantization of a `.weight` section that has scales, else absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bits: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
enum ProjKind {
    Float {
        dtype: DType,
        w: Range<usize>,
    },
    Affine {
        spec: QuantSpec,
        float: DType,
        w: Range<usize>,
        s: Range<usize>,
        b: Range<usize>,
    },
}

#[derive(Debug, Clone, PartialEq)]
struct Proj {
    out: usize,
    inp: usize,
    kind: ProjKind,
}

/// The parsed layout of one layer's expert blobs.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertLayout {
    pub sections: Vec<Section>,
    /// Bytes of one blob (last section's end).
    pub blob_size: u64,
    projs: Vec<Proj>,
}

/// Name of the stacked source tensor for one section of layer `layer`.
pub fn source_name(layer: usize, section: &str) -> String {
    format!("model.layers.{layer}.mlp.switch_mlp.{section}")
}

impl ExpertLayout {
    /// Derives the layout of layer `layer`'s experts from the stacked tensors in `store`.
    pub fn from_store(store: &dyn TensorSource, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let mut sections = Vec::new();
        let mut offset = 0u64;
        for proj in PROJS {
            let quantized = store
                .info(&source_name(layer, &format!("{proj}.scales")))
                .is_some();
            let parts: &[&str] = if quantized {
                &["weight", "scales", "biases"]
            } else {
                &["weight"]
            };
            for part in parts {
                let name = source_name(layer, &format!("{proj}.{part}"));
                let info = store.require(&name)?;
                if info.shape.first() != Some(&cfg.num_experts) {
                    return Err(Error::Shape {
                        name,
                        expected: vec![cfg.num_experts],
                        got: info.shape.clone(),
                        hint: " (leading dimension must be num_experts)".into(),
                    });
                }
                let size = info.len / cfg.num_experts as u64;
                sections.push(Section {
                    name: format!("{proj}.{part}"),
                    dtype: info.dtype.name().to_string(),
                    shape: info.shape[1..].to_vec(),
                    offset,
                    size,
                    bits: None,
                    group_size: None,
                });
                offset = (offset + size).div_ceil(SECTION_ALIGN) * SECTION_ALIGN;
            }
        }
        // Fill in bits/group from the shapes, then validate everything against the config.
        let mut layout = Self::from_sections(sections.clone(), cfg, layer, true)?;
        for (sec, proj) in layout
            .sections
            .iter_mut()
            .filter(|s| s.name.ends_with(".weight"))
            .zip(&layout.projs)
        {
            if let ProjKind::Affine { spec, .. } = proj.kind {
                sec.bits = Some(spec.bits);
                sec.group_size = Some(spec.group_size);
            }
        }
        layout = Self::from_sections(layout.sections, cfg, layer, false)?;
        Ok(layout)
    }

    /// Parses and validates a section table (from a manifest or [`ExpertLayout::from_store`]),
    /// every size and offset with checked arithmetic: they come from a file.
    pub fn from_sections(
        sections: Vec<Section>,
        cfg: &ModelConfig,
        layer: usize,
        infer_spec: bool,
    ) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        let mut projs = Vec::new();
        let mut blob_size = 0u64;
        let find = |name: &str| sections.iter().find(|s| s.name == name);
        for (proj, out, inp) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
            let label = |part: &str| source_name(layer, &format!("{proj}.{part}"));
            let range = |s: &Section| -> Result<(DType, Range<usize>)> {
                let dtype = DType::parse(&s.dtype).ok_or_else(|| Error::Dtype {
                    name: label(&s.name),
                    expected: "a safetensors dtype".into(),
                    got: s.dtype.clone(),
                })?;
                let bad = || {
                    Error::Invalid(format!(
                        "section `{}` of layer {layer}: {} bytes at offset {} for {} {:?} (a corrupt manifest; re-run `brook repack`)",
                        s.name, s.size, s.offset, s.dtype, s.shape
                    ))
                };
                let bytes = s
                    .shape
                    .iter()
                    .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))
                    .ok_or_else(bad)?;
                let end = s.offset.checked_add(s.size).ok_or_else(bad)?;
                // No expert of any model is near 4 GiB; past that a manifest is corrupt.
                if bytes != s.size || end > MAX_BLOB {
                    return Err(bad());
                }
                Ok((dtype, s.offset as usize..end as usize))
            };
            let w = find(&format!("{proj}.weight")).ok_or_else(|| Error::MissingTensor {
                name: label("weight"),
                dir: Default::default(),
            })?;
            let (wdt, wr) = range(w)?;
            blob_size = blob_size.max(w.offset + w.size);
            let kind = match (
                find(&format!("{proj}.scales")),
                find(&format!("{proj}.biases")),
            ) {
                (Some(s), Some(b)) => {
                    let spec = if infer_spec {
                        quant::spec_from_shapes(&label("weight"), &w.shape, &s.shape, 0, inp)?
                    } else {
                        let spec = QuantSpec {
                            bits: w.bits.unwrap_or(0),
                            group_size: w.group_size.unwrap_or(0),
                        };
                        if let Some(reason) = quant::spec_problem(spec, inp) {
                            return Err(Error::Quantization {
                                name: label("weight"),
                                reason,
                            });
                        }
                        spec
                    };
                    let words = quant::words_per_row(inp, spec.bits);
                    let groups = inp / spec.group_size;
                    check_shape(&label("weight"), &w.shape, &[out, words])?;
                    check_shape(&label("scales"), &s.shape, &[out, groups])?;
                    check_shape(&label("biases"), &b.shape, &[out, groups])?;
                    if wdt != DType::U32 {
                        return Err(Error::Dtype {
                            name: label("weight"),
                            expected: "U32".into(),
                            got: w.dtype.clone(),
                        });
                    }
                    let (sdt, sr) = range(s)?;
                    let (bdt, br) = range(b)?;
                    if !sdt.is_float() || sdt != bdt {
                        return Err(Error::Dtype {
                            name: label("scales"),
                            expected: "a float type shared by scales and biases".into(),
                            got: format!("{sdt}/{bdt}"),
                        });
                    }
                    blob_size = blob_size.max(s.offset + s.size).max(b.offset + b.size);
                    ProjKind::Affine {
                        spec,
                        float: sdt,
                        w: wr,
                        s: sr,
                        b: br,
                    }
                }
                (None, None) => {
                    check_shape(&label("weight"), &w.shape, &[out, inp])?;
                    if !wdt.is_float() {
                        return Err(Error::Dtype {
                            name: label("weight"),
                            expected: "a float type".into(),
                            got: w.dtype.clone(),
                        });
                    }
                    ProjKind::Float { dtype: wdt, w: wr }
                }
                _ => {
                    return Err(Error::MissingTensor {
                        name: label("scales/biases"),
                        dir: Default::default(),
                    });
                }
            };
            projs.push(Proj { out, inp, kind });
        }
        Ok(ExpertLayout {
            sections,
            blob_size,
            projs,
        })
    }

    /// Moves every projection of the expert in `blob` that can take them into 16-row tiles
    /// ([`crate::linear::Order::Tiles`]), in place; read it back with
    /// [`ExpertLayout::view_as`] and `tiled` set.
    pub fn tile(&self, blob: &mut [u8]) {
        for p in &self.projs {
            if let ProjKind::Affine {
                spec,
                float,
                w,
                s,
                b,
            } = &p.kind
            {
                let (mut sc, mut bi) = (blob[s.clone()].to_vec(), blob[b.clone()].to_vec());
                let (out, inp) = (p.out, p.inp);
                if crate::linear::tile_bytes(
                    *spec,
                    *float,
                    out,
                    inp,
                    &mut blob[w.clone()],
                    &mut sc,
                    &mut bi,
                ) {
                    blob[s.clone()].copy_from_slice(&sc);
                    blob[b.clone()].copy_from_slice(&bi);
                }
            }
        }
    }

    /// The expert held in `blob` (at least `blob_size` bytes), without copying.
    pub fn view<'a>(&self, blob: &'a [u8]) -> ExpertView<'a> {
        self.view_as(blob, false)
    }

    /// [`ExpertLayout::view`] of a blob that [`ExpertLayout::tile`] moved when `tiled`.
    pub fn view_as<'a>(&self, blob: &'a [u8], tiled: bool) -> ExpertView<'a> {
        let lin = |p: &Proj| LinearRef {
            out_features: p.out,
            in_features: p.inp,
            mat: match &p.kind {
                ProjKind::Float { dtype, w } => MatRef::Float {
                    dtype: *dtype,
                    data: &blob[w.clone()],
                },
                ProjKind::Affine {
                    spec,
                    float,
                    w,
                    s,
                    b,
                } => MatRef::Affine {
                    spec: *spec,
                    float: *float,
                    packed: &blob[w.clone()],
                    scales: &blob[s.clone()],
                    biases: &blob[b.clone()],
                    order: if tiled && crate::linear::tiles_fit(*spec, p.out, p.inp) {
                        crate::linear::Order::Tiles
                    } else {
                        crate::linear::Order::Rows
                    },
                },
            },
        };
        ExpertView {
            gate_proj: lin(&self.projs[0]),
            up_proj: lin(&self.projs[1]),
            down_proj: lin(&self.projs[2]),
        }
    }

    /// Assembles expert `e`'s blob from the stacked tensors of layer `layer` in `store`.
    pub fn read_blob(
        &self,
        store: &dyn TensorSource,
        layer: usize,
        e: usize,
        out: &mut [u8],
    ) -> Result<()> {
        out[..self.blob_size as usize].fill(0);
        for s in &self.sections {
            let bytes =
                store.read_range(&source_name(layer, &s.name), e as u64 * s.size, s.size)?;
            out[s.offset as usize..(s.offset + s.size) as usize].copy_from_slice(&bytes);
        }
        Ok(())
    }
}

fn check_shape(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Shape {
            name: name.to_string(),
            expected: want.to_vec(),
            got: got.to_vec(),
            hint: " (per expert)".into(),
        })
    }
}
