//! The fast CPU backend: SIMD kernels on the checkpoint's own bytes, a persistent thread
//! pool, and a forward pass with preallocated scratch.
//!
//! Owns everything that makes the CPU path fast; it must not change what the model computes:
//! every kernel is tested against the f32 reference in [`crate::model`] and
//! [`crate::linear::LinearRef::forward_rows`], and [`CpuModel`] reads and writes the same
//! [`crate::model::state::SeqState`] as [`crate::Model::forward`].
//!
//! Layout: `simd` (level detection); `qmatvec` / `qmatmul` (kernels, with x86 inner loops in
//! `avx2`, `avx512`, `avx512_digits` (activation bytes for Split24 and `Precision::Fast`),
//! `avx512_mm` for the f32 prefill tile, `avx512_vnni_mm` for prefill at Split24 and Fast, and
//! `avx512_tiles` for matrices stored in 16-row tiles; `avx512_attention` for attention's
//! scores and weighted sums); `pool`
//! (threads); `ops`, `attention`, `delta` (vectorized helpers); `exec` (projections as one
//! pool job); `mixer`, `moe`, `model` (the forward pass); `state` (the fast path's bf16
//! recurrent states).

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_attention;
#[cfg(target_arch = "x86_64")]
mod avx512_digits;
#[cfg(target_arch = "x86_64")]
mod avx512_mm;
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
pub mod state;
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

/// Moves one 16-row block of 4-bit packed bytes (`src`, 16 rows of `rb` bytes) into 16-row
/// tiles in `dst` with AVX-512 where this CPU has it; false (nothing written) elsewhere, for
/// the caller's portable loop. See [`crate::linear::Order::Tiles`].
pub(crate) fn tile_block16(src: &[u8], rb: usize, dst: &mut [u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if SimdLevel::detect() == SimdLevel::Avx512 && rb.is_multiple_of(16) {
        // SAFETY: the level (with VBMI) was detected; the sizes are asserted inside.
        unsafe { avx512_tiles::tile_block16(src, rb, dst) };
        return true;
    }
    let _ = (src, rb, dst);
    false
}
