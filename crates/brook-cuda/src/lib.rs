//! brook's CUDA backend.
//!
//! Kernels are CUDA C ([`gpu::SOURCE`], embedded in the binary) compiled with NVRTC on first
//! use for the device found and cached on disk under `BROOK_HOME/cuda`, keyed by device,
//! architecture, NVRTC version and source. The driver and NVRTC are loaded at run time, so
//! building needs no CUDA toolkit and a machine without a GPU gets a clear error, never a
//! panic. [`CudaModel`] runs the whole forward pass on the GPU with the dense core, the
//! sequence state and the routed experts in GPU memory: all of them when the GPU budget
//! holds them; else as many as fit, the rest in page-locked host memory the kernels gather
//! from over PCIe where the host budget holds them, or a cache of expert slots filled from
//! the host by asynchronous copies.

mod args;
mod batch;
mod blocks;
mod buffers;
pub mod delta;
mod engine;
pub mod experts;
mod functions;
mod given;
pub mod gpu;
pub mod grouped;
pub mod model;
pub mod nvrtc;
pub mod ops;
pub mod picks;
mod scratch;
pub mod state;
pub mod switches;
pub mod weights;

pub use model::{CudaModel, CudaOptions, cuda_options, engine_maker};

/// Is a usable CUDA GPU here? `Err` says why not (no driver, no NVRTC, no device).
pub fn probe() -> Result<String, String> {
    gpu::libraries_present()?;
    let g = gpu::Gpu::open(0, None).map_err(|e| e.to_string())?;
    Ok(format!(
        "{} (compute capability {}.{}, {} SMs)",
        g.name, g.cc.0, g.cc.1, g.sms
    ))
}
