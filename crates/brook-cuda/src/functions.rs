//! The kernels' source and their functions in the loaded module.

use std::ffi::CString;

use brook_core::Result;
use cudarc::driver::{result, sys};

use crate::gpu::err;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = concat!(
    include_str!("kernels/common.cu"),
    include_str!("kernels/matvec.cu"),
    include_str!("kernels/tensor.cu"),
    include_str!("kernels/tensor_n.cu"),
    include_str!("kernels/experts_tc.cu"),
    include_str!("kernels/grouped.cu"),
    include_str!("kernels/matmul.cu"),
    include_str!("kernels/routing.cu"),
    include_str!("kernels/mixers.cu"),
    include_str!("kernels/delta.cu"),
);

/// One kernel of the loaded module.
#[derive(Debug, Clone, Copy)]
pub struct Kernel(pub(crate) sys::CUfunction);

/// The kernels of [`SOURCE`], looked up once.
#[derive(Debug)]
pub struct Kernels {
    pub qmv1: Kernel,
    pub qmv4: Kernel,
    pub qmv_sel: Kernel,
    pub qmv_swiglu: Kernel,
    pub moe_down: Kernel,
    pub qmv_tc: Kernel,
    /// qmv_tcn2, qmv_tcn4 and qmv_tcn8 (vectors a block).
    pub qmv_tcn: [Kernel; 3],
    pub swiglu_tc: Kernel,
    pub swiglu_tc_ready: Kernel,
    pub down_tc: Kernel,
    pub down_tc_ready: Kernel,
    pub moe_groups: Kernel,
    pub swiglu_tcg: Kernel,
    pub down_tcg: Kernel,
    pub down_combine: Kernel,
    pub qmm: Kernel,
    pub qmm_tcn8: Kernel,
    pub swiglu: Kernel,
    pub embed: Kernel,
    pub add_rms_norm: Kernel,
    pub topk: Kernel,
    pub topk_given: Kernel,
    pub best_rows: Kernel,
    pub top_blocks: Kernel,
    pub top_rows: Kernel,
    pub moe_count: Kernel,
    pub gather_mapped: Kernel,
    pub gather_ready: Kernel,
    pub moe_offsets: Kernel,
    pub moe_fill: Kernel,
    pub moe_combine: Kernel,
    pub conv_silu: Kernel,
    pub delta_prep: Kernel,
    pub delta_rule_32: Kernel,
    pub delta_rule_64: Kernel,
    pub delta_rule_128: Kernel,
    pub delta_rule_128_p2: Kernel,
    pub delta_rule_128_p4: Kernel,
    pub delta_rule_any: Kernel,
    pub delta_chunk_32: Kernel,
    pub delta_chunk_64: Kernel,
    pub delta_chunk_128: Kernel,
    pub delta_chunk_any: Kernel,
    pub gated_norm: Kernel,
    pub attn_prep: Kernel,
    pub attention: Kernel,
    pub attention_dec: Kernel,
}

impl Kernels {
    /// Looks every kernel up in `module` and lets those that stage in shared memory take up
    /// to `max_smem` bytes of it.
    pub(crate) fn load(module: sys::CUmodule, max_smem: i32) -> Result<Kernels> {
        let f = |n: &str| -> Result<Kernel> {
            let cn = CString::new(n).map_err(|e| err("kernel name", e))?;
            // SAFETY: module is loaded; the name is NUL-terminated.
            unsafe { result::module::get_function(module, cn) }
                .map(Kernel)
                .map_err(|e| err(&format!("finding kernel {n}"), e))
        };
        let k = Kernels {
            qmv1: f("qmv1")?,
            qmv4: f("qmv4")?,
            qmv_sel: f("qmv_sel")?,
            qmv_swiglu: f("qmv_swiglu")?,
            moe_down: f("moe_down")?,
            qmv_tc: f("qmv_tc")?,
            qmv_tcn: [f("qmv_tcn2")?, f("qmv_tcn4")?, f("qmv_tcn8")?],
            swiglu_tc: f("swiglu_tc")?,
            swiglu_tc_ready: f("swiglu_tc_ready")?,
            down_tc: f("down_tc")?,
            down_tc_ready: f("down_tc_ready")?,
            moe_groups: f("moe_groups")?,
            swiglu_tcg: f("swiglu_tcg")?,
            down_tcg: f("down_tcg")?,
            down_combine: f("down_combine")?,
            qmm: f("qmm")?,
            qmm_tcn8: f("qmm_tcn8")?,
            swiglu: f("swiglu")?,
            embed: f("embed")?,
            add_rms_norm: f("add_rms_norm")?,
            topk: f("topk")?,
            topk_given: f("topk_given")?,
            best_rows: f("best_rows")?,
            top_blocks: f("top_blocks")?,
            top_rows: f("top_rows")?,
            moe_count: f("moe_count")?,
            gather_mapped: f("gather_mapped")?,
            gather_ready: f("gather_ready")?,
            moe_offsets: f("moe_offsets")?,
            moe_fill: f("moe_fill")?,
            moe_combine: f("moe_combine")?,
            conv_silu: f("conv_silu")?,
            delta_prep: f("delta_prep")?,
            delta_rule_32: f("delta_rule_32")?,
            delta_rule_64: f("delta_rule_64")?,
            delta_rule_128: f("delta_rule_128")?,
            delta_rule_128_p2: f("delta_rule_128_p2")?,
            delta_rule_128_p4: f("delta_rule_128_p4")?,
            delta_rule_any: f("delta_rule_any")?,
            delta_chunk_32: f("delta_chunk_32")?,
            delta_chunk_64: f("delta_chunk_64")?,
            delta_chunk_128: f("delta_chunk_128")?,
            delta_chunk_any: f("delta_chunk_any")?,
            gated_norm: f("gated_norm")?,
            attn_prep: f("attn_prep")?,
            attention: f("attention")?,
            attention_dec: f("attention_dec")?,
        };
        // The kernels that may take more dynamic shared memory than the default 48 KiB.
        let large_smem = [
            k.qmv1,
            k.qmv4,
            k.qmv_sel,
            k.qmv_swiglu,
            k.moe_down,
            k.qmv_tc,
            k.qmv_tcn[0],
            k.qmv_tcn[1],
            k.qmv_tcn[2],
            k.qmm_tcn8,
            k.swiglu_tc,
            k.swiglu_tc_ready,
            k.down_tc,
            k.down_tc_ready,
            k.swiglu_tcg,
            k.down_tcg,
            k.delta_chunk_32,
            k.delta_chunk_64,
            k.delta_chunk_128,
            k.delta_chunk_any,
        ];
        for f in large_smem {
            // SAFETY: a kernel of the loaded module; the value is the device's own limit.
            unsafe {
                sys::cuFuncSetAttribute(
                    f.0,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    max_smem,
                )
            }
            .result()
            .map_err(|e| err("configuring shared memory", e))?;
        }
        Ok(k)
    }
}
