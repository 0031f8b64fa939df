//! The fast CPU backend: SIMD kernels on the checkpoint's own bytes, a persistent thread
//! pool, and a forward pass with preallocated scratch.
//!
//! Owns everything that makes the CPU path fast; it must not change what the model computes:
//! every kernel is tested against the f32 reference in [`crate::model`] and
//! [`crate::linear::LinearRef::forward_rows`], and [`CpuModel`] reads and writes the same
//! [`crate::model::state::SeqState`] as [`crate::Model::forward`].
//!
//! Layout, from the top down: `engine` ([`CpuModel`], the [`crate::engine::Engine`] that
//! runs a step: embedding, the decoder layers, the head, with every buffer sized once) and
//! `state` (the fast path's bf16 recurrent states); `blocks` (a layer's parts on the kernels:
//! projections as one pool job, the mixers, the MoE); `kernels` (SIMD level, thread pool,
//! quantized products and their x86 inner loops, vectorized attention, DeltaNet and small
//! ops). Dependencies point down only.

pub mod blocks;
pub mod engine;
pub mod kernels;
pub mod state;
#[doc(hidden)]
pub mod testutil;

pub use blocks::moe::{SwigluScratch, expert_swiglu};
pub use engine::{CpuModel, CpuOptions};
pub use kernels::pool::CpuPool;
pub use kernels::qmatmul::{XBatch, qmatmul, qmatmul_at, qmatmul_pool, qmatmul_pool_at};
pub use kernels::qmatvec::{
    Precision, XPrep, check, dequant_row, matvec_rows, qmatvec, qmatvec_pool, qmatvec_pool_at,
};
pub use kernels::simd::SimdLevel;

/// Moves one 16-row block of 4-bit packed bytes (`src`, 16 rows of `rb` bytes) into 16-row
/// tiles in `dst` with AVX-512 where this CPU has it; false (nothing written) elsewhere, for
/// the caller's portable loop. See [`crate::linear::Order::Tiles`].
pub(crate) fn tile_block16(src: &[u8], rb: usize, dst: &mut [u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if SimdLevel::detect() == SimdLevel::Avx512 && rb.is_multiple_of(16) {
        // SAFETY: the level (with VBMI) was detected; the sizes are asserted inside.
        unsafe { kernels::avx512_tiles::tile_block16(src, rb, dst) };
        return true;
    }
    let _ = (src, rb, dst);
    false
}
