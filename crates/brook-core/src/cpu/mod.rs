//! The fast CPU backend: SIMD kernels on the checkpoint's own bytes, a persistent thread
//! pool, and a forward pass with preallocated scratch.
//!
//! Owns everything that makes the CPU path fast; it must not change what the model computes:
//! every kernel is tested against the f32 reference in [`crate::model`] and
//! [`crate::linear::LinearRef::forward_rows`], and [`CpuModel`] reads and writes the same
//! [`crate::model::state::SeqState`] as [`crate::Model::forward`].
//!
//! Layout: `simd` (level detection); `qmatvec` / `qmatmul` (kernels, with x86 inner loops in
//! `avx2`, `avx512`, `avx512_split` for Split24, `avx512_q8` for
//! `Precision::Fast`, `avx512_mm` for prefill tiles, `avx512_vnni_mm` for prefill at
//! Split24 and Fast, and `avx512_tiles` for matrices stored in 16-row tiles); `pool`
//! (threads); `ops`, `attention`, `delta` (vectorized helpers); `exec` (projections as one
//! pool job); `mixer`, `moe`, `model` (the forward pass).

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_mm;
#[cfg(target_arch = "x86_64")]
mod avx512_q8;
#[cfg(target_arch = "x86_64")]
mod avx512_split;
#[cfg(target_arch = "x86_64")]
mod avx512_tiles;
#[cfg(target_arch = "x86_64")]
mod avx512_vnni_mm;
pub mod delta;
pub mod exec;
pub mod mixer;
pub mod model;
pub mod moe;
pub mod ops;
pub mod pool;
pub mod qmatmul;
pub mod qmatvec;
pub mod simd;
#[doc(hidden)]
pub mod testutil;
mod xprep;

pub use model::{CpuModel, CpuOptions};
pub use moe::{SwigluScratch, expert_swiglu};
pub use pool::CpuPool;
pub use qmatmul::{XBatch, qmatmul, qmatmul_at, qmatmul_pool, qmatmul_pool_at};
pub use qmatvec::{
    Precision, XPrep, check, dequant_row, matvec_rows, qmatvec, qmatvec_pool, qmatvec_pool_at,
};
pub use simd::SimdLevel;
