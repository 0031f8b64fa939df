//! Element types of stored tensors and their conversion to f32.
//!
//! Only the types MLX checkpoints use: F32, BF16 and F16 floats and U32 words of packed
//! quantized weights (plus I32/I64 for token ids in fixture files).

use std::fmt;

/// A safetensors dtype brook reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    U32,
    I32,
    I64,
    U8,
}

impl DType {
    /// Parses the safetensors dtype string; `None` for types brook does not read.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "U32" => DType::U32,
            "I32" => DType::I32,
            "I64" => DType::I64,
            "U8" => DType::U8,
            _ => return None,
        })
    }

    /// The safetensors spelling.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::U32 => "U32",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::U8 => "U8",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Converts little-endian float bytes of `dtype` to f32, appending to `out`.
///
/// Returns `false` when `dtype` is not a float type. BF16 and F16 widen exactly.
pub fn floats_to_f32(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) -> bool {
    match dtype {
        DType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        DType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        DType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        _ => return false,
    }
    true
}

/// Reads little-endian u32 words.
pub fn bytes_to_u32(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
