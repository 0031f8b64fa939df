//! Helpers shared by the integration tests: fixture paths and reading reference tensors.
#![allow(dead_code)]

pub mod batch;
pub mod bounds;

use std::path::PathBuf;

use brook_core::dtype::{self, DType};
use brook_core::safetensors::SafeFile;

/// Every model fixture made by `scripts/make_fixtures.py`.
pub const MODELS: [&str; 8] = [
    "next-f32",
    "next-q4",
    "next-q8",
    "next-mixed",
    "qwen35-f32",
    "qwen35-q4",
    "qwen35-q8",
    "qwen35-mixed",
];

/// The fixtures folder: `BROOK_FIXTURES` when set (test binaries run on another machine, as
/// scripts/gpu-check.sh does), else the repository's.
pub fn fixtures() -> PathBuf {
    match std::env::var_os("BROOK_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

pub fn fixture(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// Reference tensors of one fixture (`reference.safetensors`).
pub struct Reference(pub SafeFile);

impl Reference {
    pub fn open(name: &str) -> Self {
        Reference(SafeFile::open(&fixture(name).join("reference.safetensors")).expect("reference"))
    }

    pub fn f32(&self, name: &str) -> Vec<f32> {
        let info = self
            .0
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("no {name}"));
        let bytes = self.0.read(info).expect("read");
        let mut out = Vec::new();
        assert!(
            dtype::floats_to_f32(info.dtype, &bytes, &mut out),
            "{name} not float"
        );
        out
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        let info = self
            .0
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(info.dtype, DType::I32);
        let bytes = self.0.read(info).expect("read");
        bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32)
            .collect()
    }
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[path = "rewrite.rs"]
pub mod rewrite;

#[path = "chat_model.rs"]
mod chat_model;
#[allow(unused_imports)] // not every test binary builds the chat model
pub use chat_model::chat_model;

/// The integer one-token kernels this CPU runs, as (level, AVX-VNNI): AVX-512 VNNI's tiles,
/// and AVX2's rows with `vpmaddubsw` and, where the CPU has it, AVX-VNNI's `vpdpbusd`.
pub fn int_kernels() -> Vec<(brook_core::cpu::SimdLevel, bool)> {
    use brook_core::cpu::SimdLevel;
    let mut v = Vec::new();
    if SimdLevel::has_vnni() {
        v.push((SimdLevel::Avx512, false));
    }
    if cfg!(target_arch = "x86_64") && SimdLevel::Avx2.is_supported() {
        v.push((SimdLevel::Avx2, false));
        if SimdLevel::has_avx_vnni() {
            v.push((SimdLevel::Avx2, true));
        }
    }
    v
}

/// `x` prepared for the integer kernel `(level, avx_vnni)` of [`int_kernels`] at `precision`.
pub fn prepare_int(
    xp: &mut brook_core::cpu::XPrep,
    (level, avx_vnni): (brook_core::cpu::SimdLevel, bool),
    precision: brook_core::cpu::Precision,
    x: &[f32],
) {
    xp.set_avx_vnni(avx_vnni);
    xp.prepare_with(level, precision, x);
}

/// A random 4-bit affine matrix [out, inp] with groups of `group` and scales of `float`.
pub fn q4(
    rng: &mut brook_core::cpu::testutil::Rng,
    out: usize,
    inp: usize,
    group: usize,
    float: DType,
) -> brook_core::linear::Linear {
    use brook_core::cpu::testutil::{Format, random_linear};
    random_linear(
        rng,
        out,
        inp,
        Format::Affine {
            bits: 4,
            group,
            float,
        },
    )
}
