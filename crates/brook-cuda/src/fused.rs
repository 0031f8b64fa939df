//! One-launch forms of a decoded token's launches, each with the bits of the launches it
//! replaces: the router with its top-k (kernels/routing.cu `qmv1_topk`), and a projection
//! with the residual add and RMS norm that follows it in its last block (common.cu
//! `norm_tail`, taken by `qmv_tc` and `down_tc`).

use brook_core::Result;

use crate::gpu::{Args, Gpu};
use crate::ops::{QMV_WARPS, geometry, smem_for, tc_all, tc_part_bytes, tc_smem};
use crate::weights::Mat;

/// One token's top-k: `e` experts, `k` picks (renormalised if `norm`) into `sel` and `wts`,
/// and `zero` words of a gather's flags at `zero.0` set to 0 first (kernels/routing.cu).
#[derive(Debug, Clone, Copy)]
pub struct TopK {
    pub e: usize,
    pub k: usize,
    pub norm: bool,
    pub sel: u64,
    pub wts: u64,
    pub zero: (u64, i32),
}

/// [`qmv_stacked`] of one token's router rows with its top-k in the same launch (the last
/// block to finish picks: kernels/routing.cu `qmv1_topk`), the bits of the two launches.
/// `done`: a device word at 0, left at 0. Returns false, queueing nothing, where the rows
/// take the tensor cores or the experts are more than 512 (then launch the two).
pub fn qmv_topk(g: &Gpu, m: [Mat; 4], x: u64, y: u64, done: u64, tk: &TopK) -> Result<bool> {
    let rows = m.iter().map(|m| m.rows as usize).sum::<usize>();
    let cols = m[0].cols as usize;
    let tc_bytes = tc_smem(cols, 1) + tc_part_bytes(QMV_WARPS);
    if (tc_all(g, &m, 16) && tc_bytes <= g.max_smem as usize) || tk.e > 512 || rows < tk.e {
        return Ok(false);
    }
    let mut a = Args::new();
    for m in m {
        a.arg(m);
    }
    a.arg(x)
        .arg(y)
        .arg(done)
        .arg(tk.e as i32)
        .arg(tk.k as i32)
        .arg(tk.norm as i32)
        .arg(tk.sel)
        .arg(tk.wts)
        .arg(tk.zero.0)
        .arg(tk.zero.1);
    let smem = smem_for(g, cols)?;
    let (rw, bx) = geometry(g, rows, 1);
    let f = g.k.qmv_topk[usize::from(rw == 4)];
    g.launch(f, (bx, 1, 1), 256, smem, &mut a)?;
    Ok(true)
}

/// The residual add and RMS norm a one-token projection's last block runs after it (x +=
/// the projection's output; out = rms_norm(x)·w over h values); kernels/common.cu
/// `NormTail`. All zeros: none.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NormTail {
    /// A device word at 0, left at 0: the kernel's finished blocks.
    pub done: u64,
    pub x: u64,
    pub w: u64,
    pub out: u64,
    pub h: i32,
    pub eps: f32,
}
