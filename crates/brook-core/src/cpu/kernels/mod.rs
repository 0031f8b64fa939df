//! The CPU engine's kernels: SIMD level detection, the thread pool, the quantized products
//! (`qmatvec` one token, `qmatmul` a chunk, `xprep` their activation forms) with their x86
//! inner loops (`avx2`, `avx512*`), and the vectorized helpers of attention, the DeltaNet
//! rule and the small ops. Each is tested against the f32 reference on random inputs.
//!
//! Kernels never see files, configs, caches or sequence states: they take slices and shapes.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_int;
#[cfg(target_arch = "x86_64")]
mod avx2_int8;
#[cfg(target_arch = "x86_64")]
mod avx2_int_mm;
#[cfg(target_arch = "x86_64")]
mod avx2_mm;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_attention;
#[cfg(target_arch = "x86_64")]
mod avx512_digits;
#[cfg(target_arch = "x86_64")]
mod avx512_mm;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_tiles;
#[cfg(target_arch = "x86_64")]
mod avx512_vnni_mm;
pub mod delta;
pub mod fpenv;
pub mod ops;
pub mod pool;
pub mod qmatmul;
pub mod qmatvec;
pub mod simd;
mod xprep;
