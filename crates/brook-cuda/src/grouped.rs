//! The MoE of a step of several tokens with its experts grouped (kernels/grouped.cu): each
//! routed expert two tokens picked, and the shared expert of every two tokens, has its
//! weight tiles decoded once for both, two vectors to an mma, where the per-token kernels
//! (`ops::qmv_experts`, `ops::moe_down`) decode them once a token. Each token keeps the bits
//! those kernels give it alone (tests/gpu/batch.rs).

use brook_core::Result;

use crate::gpu::{Args, Gpu};
use crate::ops;
use crate::weights::Mat;

/// Picks a grouped step may have: `moe_groups` keeps two ints a pick in shared memory, 32 KiB
/// at most (under the 48 KiB any kernel may take).
pub const GROUP_PICKS: usize = 4096;

/// Where a grouped MoE works: the groups (four ints each, room for every pick alone) and
/// their count (`groups` + 16 bytes per pick), the routed experts' down outputs (a row of
/// `hidden` floats per pick) and the shared expert's (a row per token).
#[derive(Debug, Clone, Copy)]
pub struct GroupScratch {
    pub groups: u64,
    pub ey: u64,
    pub so: u64,
}

/// Whether [`moe`] takes `n` tokens of `k` picks through routed experts `m` ([gate, up,
/// down]) and the shared expert `s`: every matrix on the tensor cores, a shared expert, and
/// at most [`GROUP_PICKS`] picks.
pub fn fits(g: &Gpu, m: [Mat; 3], s: [Mat; 3], k: usize, n: usize) -> bool {
    n >= 2
        && n * k <= GROUP_PICKS
        && s.iter().all(|m| m.rows > 0)
        && ops::swiglu_tc_fits(g, m[0], m[1], [s[0], s[1]])
        && ops::down_tc_fits(g, m[2], s[2], k)
        && swiglu_smem(m[0]) <= g.max_smem as usize
        && down_smem(m[2], s[2]) <= g.max_smem as usize
}

fn swiglu_smem(gate: Mat) -> usize {
    ops::tc_smem(gate.cols as usize, 2) + 2 * ops::tc_part_bytes(4)
}

fn down_smem(down: Mat, sdown: Mat) -> usize {
    ops::tc_smem(down.cols.max(sdown.cols) as usize, 2)
}

/// out\[t\] = Σ_j wts\[t, j\]·down_{sel\[t, j\]}(h_{t, j}) + sigmoid(sg\[t·sgs\])·sdown(hs_t)
/// for `n` tokens, h and hs their SwiGLU outputs of x (`n` rows of `gate.cols`), bit for bit
/// as `ops::qmv_experts` and `ops::moe_down` give each token alone (check [`fits`] first).
/// `h` (a row of I floats per pick) and `hs` (a row per token) are written on the way.
#[allow(clippy::too_many_arguments)]
pub fn moe(
    g: &Gpu,
    m: [Mat; 3],
    s: [Mat; 3],
    tab: u64,
    sel: u64,
    wts: u64,
    k: usize,
    n: usize,
    sg: u64,
    sgs: usize,
    x: u64,
    h: u64,
    hs: u64,
    out: u64,
    w: GroupScratch,
) -> Result<()> {
    let [gate, up, down] = m;
    let nk = n * k;
    let count = w.groups + (16 * nk) as u64;
    let mut a = Args::new();
    a.arg(sel).arg(nk as i32).arg(w.groups).arg(count);
    g.launch(g.k.moe_groups, (1, 1, 1), 1024, (8 * nk) as u32, &mut a)?;
    // The shared expert's ⌈n / 2⌉ groups, then room for every pick alone.
    let ny = n.div_ceil(2) + nk;
    let sms = g.sms.max(1) as usize;
    let tiles = (gate.rows.max(s[0].rows) / 8) as usize;
    let split = ops::tc_split(sms, tiles, k + 1, gate.cols as usize, g.gateup_split);
    let (fg, fd) = g.grouped_blocks;
    let bx = tiles.div_ceil(4 / split).clamp(1, (fg * sms / ny).max(1)) as u32;
    let mut a = Args::new();
    a.arg(gate).arg(up).arg(tab).arg(k as i32).arg(n as i32);
    a.arg(s[0])
        .arg(s[1])
        .arg(split as i32)
        .arg(w.groups)
        .arg(count);
    a.arg(x).arg(h).arg(hs);
    g.launch(
        g.k.swiglu_tcg,
        (bx, ny as u32, 1),
        128,
        swiglu_smem(gate) as u32,
        &mut a,
    )?;
    let rows = down.rows as usize;
    let bx = (rows / 16).div_ceil(4).clamp(1, (fd * sms / ny).max(1)) as u32;
    let mut a = Args::new();
    a.arg(down)
        .arg(tab)
        .arg(n as i32)
        .arg(s[2])
        .arg(w.groups)
        .arg(count);
    a.arg(h).arg(hs).arg(w.ey).arg(w.so);
    g.launch(
        g.k.down_tcg,
        (bx, ny as u32, 1),
        128,
        down_smem(down, s[2]) as u32,
        &mut a,
    )?;
    let nw = ops::down_tc_warps(k);
    let mut a = Args::new();
    a.arg(w.ey).arg(w.so).arg(tab).arg(sel).arg(wts).arg(sg);
    a.arg(sgs as i32)
        .arg(k as i32)
        .arg(nw as i32)
        .arg(n as i32)
        .arg(rows as i32);
    a.arg(out);
    let total = (n * rows) as u32;
    g.launch(
        g.k.down_combine,
        (total.div_ceil(256), 1, 1),
        256,
        0,
        &mut a,
    )
}

/// Tiles of 16 rows a block of the prefill's tensor-core expert products takes (two a
/// warp), against one staging of its expert's vectors.
const QMM_BLOCK_TILES: usize = 2 * ops::QMV_WARPS;

/// The grid and dynamic shared memory of kernels/tensor_n.cu `qmm_tcn8` over `groups`
/// experts' pairs (the tensor-core form of [`ops::qmm`], which launches it: each weight tile
/// read once for eight of an expert's pairs, the same operations whatever tier holds the
/// expert), or `None` where the matrices don't take the tensor cores.
pub(crate) fn qmm_tc_launch(
    g: &Gpu,
    m1: Mat,
    m2: Mat,
    groups: usize,
) -> Option<((u32, u32, u32), u32)> {
    let smem = ops::tc_smem(m1.cols as usize, 8) + 8 * ops::tc_part_bytes(ops::QMV_WARPS);
    if !ops::tc_all(g, &[m1, m2], 16) || smem > g.max_smem as usize {
        return None;
    }
    let tiles = (m1.rows + m2.rows) as usize / 16;
    let bx = tiles.div_ceil(QMM_BLOCK_TILES).max(1) as u32;
    Some(((bx, groups as u32, 1), smem as u32))
}
