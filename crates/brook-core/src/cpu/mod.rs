//! The fast CPU backend: SIMD kernels on the checkpoint's own bytes, a persistent thread
//! pool, and a forward pass with preallocated scratch.
//!
//! Owns everything that makes the CPU path fast; it must not change what the model computes:
//! every kernel is tested against the f32 reference in [`crate::model`] and
//! [`crate::linear::LinearRef::forward_rows`], and [`CpuModel`] reads and writes the same
//! [`crate::model::state::SeqState`] as [`crate::Model::forward`].

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod pool;
pub mod qmatmul;
pub mod qmatvec;
pub mod simd;
pub use pool::CpuPool;
pub use qmatmul::{XBatch, qmatmul, qmatmul_pool};
pub use qmatvec::{XPrep, check, dequant_row, matvec_rows, qmatvec, qmatvec_pool};
pub use simd::SimdLevel;
#[doc(hidden)]
pub mod testutil;
