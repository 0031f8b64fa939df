//! Launchers of the matrix kernels, shared by the forward pass and the kernel tests.

use brook_core::{Error, Result};

use crate::gpu::{Args, Gpu};
use crate::weights::Mat;

/// Warps per block of the matrix-vector kernels.
pub(crate) const QMV_WARPS: usize = 8;

/// Bytes of shared memory for `n` activations in the kernels' padded layout (4 floats of
/// padding after every 32; kernels/matvec.cu `pad`).
fn padded_bytes(n: usize) -> usize {
    (n + n / 32 * 4 + 4) * 4
}

/// Shared memory for activations of `cols`, or an error naming the limit.
fn smem_for(g: &Gpu, cols: usize) -> Result<u32> {
    let b = padded_bytes(cols);
    if b > g.max_smem as usize {
        return Err(Error::Device(format!(
            "a matrix with {cols} columns needs {b} bytes of shared memory per block; this GPU allows {}",
            g.max_smem
        )));
    }
    Ok(b as u32)
}

/// Whether the tensor-core kernels (kernels/tensor.cu) take `m` with its rows in tiles of
/// `tile`: 4-bit codes with bf16 or f16 scales in groups of 64 or 128, a width that is a
/// multiple of 512 (four 128-column chunks a load round), 16-byte aligned parts. An empty
/// matrix fits anything.
pub fn tc_fits(m: &Mat, tile: i32) -> bool {
    m.rows == 0
        || (m.bits == 4
            && (m.stype == 1 || m.stype == 2)
            && (m.group == 64 || m.group == 128)
            && m.cols % 512 == 0
            && m.rows % tile == 0
            && [m.w, m.s, m.b].iter().all(|a| a % 16 == 0))
}

/// Whether every matrix of `ms` fits [`tc_fits`] in the format of the first (the kernels are
/// instantiated for one scale type and group size per launch) and the GPU uses tensor cores.
pub(crate) fn tc_all(g: &Gpu, ms: &[Mat], tile: i32) -> bool {
    let first = ms[0];
    g.tensor_cores()
        && ms.iter().all(|m| {
            tc_fits(m, tile) && (m.rows == 0 || (m.stype == first.stype && m.group == first.group))
        })
}

/// Bytes of the tensor-core kernels' staged B fragments a chunk of 128 columns (tensor.cu
/// `TC_CHUNK_U4` uint4): four signed-byte digits a value and a power of two per 64 columns.
const TC_CHUNK_BYTES: usize = 33 * 16;

/// Shared memory of the tensor-core kernels for `nvec` vectors of `cols` activations: the B
/// fragments ([`TC_CHUNK_BYTES`] a chunk of 128 columns) and the sums per 64 columns.
pub(crate) fn tc_smem(cols: usize, nvec: usize) -> usize {
    nvec * (cols / 128 * TC_CHUNK_BYTES + cols / 64 * 4)
}

/// Warps per tile of the tensor-core kernels (at most `max`, a power of two): the tile's
/// load rounds (512 columns each) split over warps until the tiles of all `nvec` vectors
/// give the GPU 16 warps per SM, so a small matrix still reads from every SM.
pub(crate) fn tc_split(sms: usize, tiles: usize, nvec: usize, cols: usize, max: usize) -> usize {
    let rounds = cols / 512;
    let mut s = 1;
    while 2 * s <= max && rounds.is_multiple_of(2 * s) && tiles * nvec * s < sms * 16 {
        s *= 2;
    }
    s
}

/// Shared memory for tc_tiles' partial sums: two buffers of 16 floats per warp.
pub(crate) fn tc_part_bytes(warps: usize) -> usize {
    2 * warps * 16 * 4
}

/// Warps of a `down_tc` block for `k` routed experts and the shared one (at most 12: the
/// kernel's register budget).
pub(crate) fn down_tc_warps(k: usize) -> usize {
    (k + 1).min(12)
}

/// The dense matrix-vector kernel for `rw` rows per warp step.
fn qmv_kernel(g: &Gpu, rw: i32) -> crate::gpu::Kernel {
    if rw == 4 { g.k.qmv4 } else { g.k.qmv1 }
}

/// Rows per warp step (4 when every resident block gets a step of 4, else 1 to spread a
/// small matrix over more warps) and the blocks along x for `rows` of each of `nvec` vectors.
fn geometry(g: &Gpu, rows: usize, nvec: usize) -> (i32, u32) {
    geometry_for(g.sms.max(1) as usize, rows, nvec)
}

fn geometry_for(sms: usize, rows: usize, nvec: usize) -> (i32, u32) {
    let rw = if rows * nvec >= 2 * sms * QMV_WARPS * 4 {
        4
    } else {
        1
    };
    (rw as i32, blocks_for(sms, rows, rw, nvec))
}

/// Blocks along x for `rows` of each of `nvec` vectors taken `rw` rows per warp step: one
/// step each, at most two blocks resident per SM in all (the kernels stride over the rest).
fn blocks_for(sms: usize, rows: usize, rw: usize, nvec: usize) -> u32 {
    let per_vec = (2 * sms / nvec.max(1)).max(1);
    rows.div_ceil(QMV_WARPS * rw).clamp(1, per_vec) as u32
}

/// y[v, r] = W·x[v / xdiv] over the rows of m1 then m2, `nvec` vectors. With `sel` (a
/// device array of expert ids), vector v uses the slot of expert sel\[v\] in the table `tab`.
#[allow(clippy::too_many_arguments)]
pub fn qmv(
    g: &Gpu,
    m1: Mat,
    m2: Mat,
    tab: u64,
    sel: u64,
    xdiv: i32,
    nvec: usize,
    x: u64,
    y: u64,
) -> Result<()> {
    if sel != 0 {
        return qmv_experts(
            g,
            m1,
            m2,
            tab,
            sel,
            nvec,
            xdiv,
            [Mat::NONE; 2],
            false,
            1,
            x,
            y,
            0,
            None,
        );
    }
    stacked(g, [m1, m2, Mat::NONE, Mat::NONE], xdiv, nvec, x, y)
}

/// y[v] = [m0; m1; m2; m3]·x[v / xdiv] for `nvec` vectors: on the tensor cores where every
/// matrix fits them, else on the CUDA cores.
fn stacked(g: &Gpu, m: [Mat; 4], xdiv: i32, nvec: usize, x: u64, y: u64) -> Result<()> {
    let rows = m.iter().map(|m| m.rows as usize).sum::<usize>();
    let cols = m[0].cols as usize;
    let mut a = Args::new();
    for m in m {
        a.arg(m);
    }
    a.arg(xdiv);
    let tc_bytes = tc_smem(cols, 1) + tc_part_bytes(QMV_WARPS);
    if tc_all(g, &m, 16) && tc_bytes <= g.max_smem as usize {
        let sms = g.sms.max(1) as usize;
        let tiles = rows / 16;
        let split = tc_split(sms, tiles, nvec, cols, QMV_WARPS);
        let bx = tiles
            .div_ceil(QMV_WARPS / split)
            .clamp(1, (2 * sms / nvec.max(1)).max(1)) as u32;
        a.arg(split as i32).arg(x).arg(y);
        let grid = (bx, nvec as u32, 1);
        return g.launch(g.k.qmv_tc, grid, 256, tc_bytes as u32, &mut a);
    }
    a.arg(x).arg(y);
    let smem = smem_for(g, cols)?;
    let (rw, bx) = geometry(g, rows, nvec);
    g.launch(qmv_kernel(g, rw), (bx, nvec as u32, 1), 256, smem, &mut a)
}

/// y = [m0; m1; m2; m3]·x for one vector: up to four matrices that read the same input in
/// one launch (their outputs follow each other in y).
pub fn qmv_stacked(g: &Gpu, m: [Mat; 4], x: u64, y: u64) -> Result<()> {
    stacked(g, m, 1, 1, x, y)
}

/// The most vectors a block of `qmv_tcn` takes (kernels/tensor_n.cu: qmv_tcn2, 4 and 8).
const TCN: usize = 8;

/// [`qmv_stacked`] for `nvec` vectors (x\[v\] and y\[v\] one after another: `cols` and the
/// stack's rows apart), each vector's outputs bit for bit those of [`qmv_stacked`] on it
/// alone: the same kernel family with the same split of each row, the tensor-core kernel
/// reading each weight tile once for up to eight vectors.
pub fn qmv_stacked_n(g: &Gpu, m: [Mat; 4], nvec: usize, x: u64, y: u64) -> Result<()> {
    if nvec <= 1 {
        return stacked(g, m, 1, 1, x, y);
    }
    let rows = m.iter().map(|m| m.rows as usize).sum::<usize>();
    let cols = m[0].cols as usize;
    let sms = g.sms.max(1) as usize;
    let tc_bytes = tc_smem(cols, 1) + tc_part_bytes(QMV_WARPS);
    let mut a = Args::new();
    for m in m {
        a.arg(m);
    }
    if tc_all(g, &m, 16) && tc_bytes <= g.max_smem as usize {
        // The split of the one-vector launch, whatever the number of vectors.
        let tiles = rows / 16;
        let split = tc_split(sms, tiles, 1, cols, QMV_WARPS);
        // The smallest kernel that holds the vectors (every vector it has room for is
        // computed, present or not), eight a block beyond; it lays out room for all of them.
        let nv = nvec.next_power_of_two().min(TCN);
        let kernel = g.k.qmv_tcn[nv.trailing_zeros() as usize - 1];
        let groups = nvec.div_ceil(nv);
        let n_bytes = tc_smem(cols, nv) + nv * tc_part_bytes(QMV_WARPS);
        if n_bytes <= g.max_smem as usize {
            let bx = tiles
                .div_ceil(QMV_WARPS / split)
                .clamp(1, (sms / groups).max(1)) as u32;
            a.arg(nvec as i32).arg(split as i32).arg(x).arg(y);
            let grid = (bx, groups as u32, 1);
            return g.launch(kernel, grid, 256, n_bytes as u32, &mut a);
        }
        let bx = tiles
            .div_ceil(QMV_WARPS / split)
            .clamp(1, (2 * sms / nvec).max(1)) as u32;
        a.arg(1i32).arg(split as i32).arg(x).arg(y);
        return g.launch(
            g.k.qmv_tc,
            (bx, nvec as u32, 1),
            256,
            tc_bytes as u32,
            &mut a,
        );
    }
    a.arg(1i32).arg(x).arg(y);
    let smem = smem_for(g, cols)?;
    let (rw, _) = geometry(g, rows, 1);
    let bx = blocks_for(sms, rows, rw as usize, nvec);
    g.launch(qmv_kernel(g, rw), (bx, nvec as u32, 1), 256, smem, &mut a)
}

/// Routed experts and, in the same launch, the shared expert: vector v < nsel is expert
/// sel\[v\] (rows of m1 then m2, through the slot table) times x\[v / xdiv\] into y[v, ·]; with
/// `shared` rows, the shared expert's [gate; up] times x\[0\] into `ys`. With `swiglu`, m1
/// and m2 (and the shared pair) are gate and up projections and the outputs are
/// silu(gate·x)·(up·x): m1.rows values per vector.
///
/// With `swiglu`, `tokens` tokens in one launch: token i's selection (nsel ids), input,
/// routed outputs and shared output each follow token i − 1's, and each token's values are
/// bit for bit those of a launch for it alone. Without, `tokens` must be 1.
#[allow(clippy::too_many_arguments)]
pub fn qmv_experts(
    g: &Gpu,
    m1: Mat,
    m2: Mat,
    tab: u64,
    sel: u64,
    nsel: usize,
    xdiv: i32,
    shared: [Mat; 2],
    swiglu: bool,
    tokens: usize,
    x: u64,
    y: u64,
    ys: u64,
    ready: Option<(u64, usize)>,
) -> Result<()> {
    let srows = (shared[0].rows + shared[1].rows) as usize;
    let rows = ((m1.rows + m2.rows) as usize).max(srows);
    let nvec = nsel + usize::from(srows > 0);
    let tokens = tokens.max(1);
    if tokens > 1 && !swiglu {
        return Err(Error::Invalid(
            "the experts' plain products take one token a launch".into(),
        ));
    }
    let per = nvec as i32;
    let ny = (nvec * tokens) as u32;
    let sms = g.sms.max(1) as usize;
    // The three kernels' arguments start alike: the matrices, the slot table, the picks.
    let mut a = Args::new();
    a.arg(m1).arg(m2).arg(tab).arg(sel).arg(nsel as i32);
    if swiglu && swiglu_tc_fits(g, m1, m2, shared) {
        let tc_bytes = swiglu_tc_smem(m1);
        // Tiles of 8 gate and 8 up rows, four warps a block, up to four blocks per SM.
        // The split of one token's launch (each row's sums in its order); the blocks along
        // x shared by every token's vectors, so a block takes more tiles per staged input.
        let tiles = (m1.rows as usize).max(shared[0].rows as usize) / 8;
        let split = tc_split(sms, tiles, nvec, m1.cols as usize, g.gateup_split);
        let bx = tiles
            .div_ceil(4 / split)
            .clamp(1, (4 * sms / (nvec * tokens).max(1)).max(1)) as u32;
        a.arg(per).arg(shared[0]).arg(shared[1]).arg(split as i32);
        a.arg(x).arg(y).arg(ys);
        ready_args(&mut a, ready, tokens)?;
        let grid = (bx, ny, 1);
        let kernel = if ready.is_some() {
            g.k.swiglu_tc_ready
        } else {
            g.k.swiglu_tc
        };
        return g.launch(kernel, grid, 128, tc_bytes as u32, &mut a);
    }
    let smem = smem_for(g, m1.cols as usize)?;
    // The CUDA cores' two kernels differ in one argument: vectors a token (SwiGLU, two gate
    // and two up rows per warp step) or the input's divisor.
    let (kernel, bx, ny, differs) = if swiglu {
        let bx = blocks_for(sms, m1.rows as usize, 2, nvec * tokens);
        (g.k.qmv_swiglu, bx, ny, per)
    } else {
        (
            g.k.qmv_sel,
            blocks_for(sms, rows, 1, nvec),
            nvec as u32,
            xdiv,
        )
    };
    a.arg(differs)
        .arg(shared[0])
        .arg(shared[1])
        .arg(x)
        .arg(y)
        .arg(ys);
    g.launch(kernel, (bx, ny, 1), 256, smem, &mut a)
}

/// Whether [`qmv_experts`] runs gate `m1` and up `m2` with the shared expert's on the
/// tensor cores (swiglu_tc).
pub fn swiglu_tc_fits(g: &Gpu, m1: Mat, m2: Mat, shared: [Mat; 2]) -> bool {
    tc_all(g, &[m1, m2, shared[0], shared[1]], 8) && swiglu_tc_smem(m1) <= g.max_smem as usize
}

fn swiglu_tc_smem(m1: Mat) -> usize {
    tc_smem(m1.cols as usize, 1) + tc_part_bytes(4)
}

/// Whether [`moe_down`] runs on the tensor cores (down_tc) for `k` experts.
pub fn down_tc_fits(g: &Gpu, down: Mat, sdown: Mat, k: usize) -> bool {
    tc_all(g, &[down, sdown], 16)
        && down.rows == sdown.rows
        && down_tc_smem(down, sdown, k) <= g.max_smem as usize
}

fn down_tc_smem(down: Mat, sdown: Mat, k: usize) -> usize {
    tc_smem(down.cols as usize, k) + tc_smem(sdown.cols as usize, 1) + down_tc_warps(k) * 16 * 4
}

/// The tensor-core expert kernels' last two arguments: the flags of a gather running beside
/// them (one token only) and the count each reaches, or none.
fn ready_args(a: &mut Args, ready: Option<(u64, usize)>, tokens: usize) -> Result<()> {
    if ready.is_some() && tokens > 1 {
        return Err(Error::Invalid(
            "a gather's flags serve one token's products".into(),
        ));
    }
    let (ptr, need) = ready.unwrap_or((0, 0));
    a.arg(ptr).arg(need as i32);
    Ok(())
}

/// Whether [`moe_down`] takes these down projections for `k` experts: 4- or 8-bit codes in
/// 8-byte units within a group, and the activations within 48 KiB of shared memory.
pub fn moe_down_fits(down: &Mat, sdown: &Mat, k: usize) -> bool {
    let unit = |m: &Mat| {
        (m.bits == 4 || m.bits == 8)
            && (m.cols * m.bits) % 64 == 0
            && (m.group * m.bits) % 64 == 0
            && m.group.count_ones() == 1
            && m.w.is_multiple_of(8)
    };
    let smem = padded_bytes(k * down.cols as usize + sdown.cols as usize);
    unit(down) && unit(sdown) && down.rows == sdown.rows && k <= 32 && smem <= 48 << 10
}

/// One token's MoE output in one launch (see kernels/matvec.cu `moe_down`): the down projections
/// of the routed experts' SwiGLU outputs `h` (\[k\]\[I\]) and the shared expert's `hs`, weighted
/// by the router and the shared expert's sigmoid gate `sg`, into `out`. Check
/// [`moe_down_fits`] first.
///
/// `tokens` tokens in one launch, each token's selection, weights, inputs and output after
/// the previous token's and its gate `sg_stride` floats after; each token's output is bit for
/// bit that of a launch for it alone.
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    g: &Gpu,
    down: Mat,
    tab: u64,
    sel: u64,
    wts: u64,
    k: usize,
    sdown: Mat,
    sg: u64,
    h: u64,
    hs: u64,
    out: u64,
    tokens: usize,
    sg_stride: usize,
    ready: Option<(u64, usize)>,
) -> Result<()> {
    let ny = tokens.max(1) as u32;
    let mut a = Args::new();
    a.arg(down).arg(tab).arg(sel).arg(wts).arg(k as i32);
    a.arg(sdown)
        .arg(sg)
        .arg(sg_stride as i32)
        .arg(h)
        .arg(hs)
        .arg(out);
    let warps = down_tc_warps(k);
    if down_tc_fits(g, down, sdown, k) {
        let tc_bytes = down_tc_smem(down, sdown, k);
        ready_args(&mut a, ready, tokens)?;
        // A block a tile for one token; with many tokens about four blocks per SM in all,
        // each taking several tiles for one staging of its token's inputs.
        let tiles = down.rows as usize / 16;
        let sms = g.sms.max(1) as usize;
        let bx = tiles.min((4 * sms).div_ceil(ny as usize)).max(1);
        return g.launch(
            if ready.is_some() {
                g.k.down_tc_ready
            } else {
                g.k.down_tc
            },
            (bx as u32, ny, 1),
            (warps * 32) as u32,
            tc_bytes as u32,
            &mut a,
        );
    }
    if ready.is_some() {
        return Err(Error::Invalid(
            "the CUDA cores' down kernel can't wait on a gather's flags".into(),
        ));
    }
    let smem = padded_bytes(k * down.cols as usize + sdown.cols as usize) as u32;
    g.launch(
        g.k.moe_down,
        ((down.rows as u32).div_ceil(8), ny, 1),
        256,
        smem,
        &mut a,
    )
}

/// The tiled product for many vectors: `t` tokens (dense), or with `tab` the (token, k)
/// pairs of each of `groups` experts (see kernels/matmul.cu `qmm`); with `tc`, experts whose
/// matrices take the tensor cores run their pairs eight at a time there instead
/// (`grouped::qmm_tc_launch`).
#[allow(clippy::too_many_arguments)]
pub fn qmm(
    g: &Gpu,
    m1: Mat,
    m2: Mat,
    tab: u64,
    counts: u64,
    offs: u64,
    pairs: u64,
    xdiv: i32,
    t: usize,
    x: u64,
    y: u64,
    groups: usize,
    tc: bool,
) -> Result<()> {
    let rows = (m1.rows + m2.rows) as u32;
    let mut a = Args::new();
    a.arg(m1)
        .arg(m2)
        .arg(tab)
        .arg(counts)
        .arg(offs)
        .arg(pairs)
        .arg(xdiv);
    let tc = (tc && tab != 0)
        .then(|| crate::grouped::qmm_tc_launch(g, m1, m2, groups))
        .flatten();
    if let Some((grid, smem)) = tc {
        // Its one split of a row (the whole row a warp) where the tiles take `t`.
        a.arg(1i32).arg(x).arg(y);
        return g.launch(g.k.qmm_tcn8, grid, 256, smem, &mut a);
    }
    a.arg(t as i32).arg(x).arg(y);
    g.launch(
        g.k.qmm,
        (rows.div_ceil(64), (t as u32).div_ceil(64), groups as u32),
        256,
        0,
        &mut a,
    )
}

/// y[t, :] = W·x[t, :] for `t` rows (m2's rows follow m1's): the warp-per-row kernel for one
/// token, the tiled one for more.
pub fn linear(g: &Gpu, m1: Mat, m2: Mat, t: usize, x: u64, y: u64) -> Result<()> {
    if t == 1 {
        qmv(g, m1, m2, 0, 0, 1, 1, x, y)
    } else {
        qmm(g, m1, m2, 0, 0, 0, 0, 1, t, x, y, 1, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_adds_four_floats_per_32_and_a_spare() {
        assert_eq!(padded_bytes(0), 16);
        assert_eq!(padded_bytes(32), (32 + 4 + 4) * 4);
        assert_eq!(padded_bytes(2048), (2048 + 256 + 4) * 4);
    }

    #[test]
    fn large_matrices_take_four_rows_a_step_and_at_most_two_blocks_per_sm() {
        // The H200's 132 SMs: the 35B's DeltaNet projections and head, its router, and the
        // output projection.
        assert_eq!(geometry_for(132, 12352, 1), (4, 264));
        assert_eq!(geometry_for(132, 248320, 1), (4, 264));
        assert_eq!(geometry_for(132, 257, 1), (1, 33));
        assert_eq!(geometry_for(132, 2048, 1), (1, 256));
        // Several vectors share the resident blocks.
        assert_eq!(geometry_for(132, 1024, 9), (4, 29));
        assert_eq!(geometry_for(4, 1, 1), (1, 1));
    }

    #[test]
    fn the_tensor_core_kernels_take_4_bit_groups_of_64_or_128_with_16_bit_scales() {
        let m = |group, stype, rows, cols| Mat {
            rows,
            cols,
            bits: 4,
            group,
            stype,
            ..Mat::NONE
        };
        assert!(tc_fits(&m(64, 1, 12352, 2048), 16));
        assert!(tc_fits(&m(128, 2, 512, 4096), 8));
        assert!(tc_fits(&Mat::NONE, 16));
        assert!(!tc_fits(&m(32, 1, 512, 2048), 16), "group 32");
        assert!(!tc_fits(&m(64, 0, 512, 2048), 16), "f32 scales");
        assert!(!tc_fits(&m(64, 1, 520, 2048), 16), "rows not in tiles");
        assert!(
            !tc_fits(&m(64, 1, 512, 2304), 16),
            "width not a multiple of 512"
        );
        assert!(
            !tc_fits(
                &Mat {
                    bits: 8,
                    ..m(64, 1, 512, 2048)
                },
                16
            ),
            "8-bit"
        );
        assert!(
            !tc_fits(
                &Mat {
                    s: 8,
                    ..m(64, 1, 512, 2048)
                },
                16
            ),
            "unaligned scales"
        );
        // 33 uint4 (528 bytes) a chunk of 128 values and one sum per 64.
        assert_eq!(tc_smem(2048, 1), 16 * 528 + 32 * 4);
        assert_eq!(down_tc_warps(8), 9);
        // H200 (132 SMs): the head needs no split; the 35B's DeltaNet projections (772
        // tiles) take 4 warps a tile, its output projection (128 tiles of 4096) 8, and the
        // experts' gate/up (64 tiles of 9 vectors) 4.
        assert_eq!(tc_split(132, 15520, 1, 2048, 8), 1);
        assert_eq!(tc_split(132, 772, 1, 2048, 8), 4);
        assert_eq!(tc_split(132, 128, 1, 4096, 8), 8);
        assert_eq!(tc_split(132, 64, 9, 2048, 4), 4);
        assert_eq!(tc_split(132, 64, 9, 512, 4), 1);
        assert_eq!(down_tc_warps(20), 12);
    }

    #[test]
    fn the_fused_down_kernel_takes_4_and_8_bit_power_of_two_groups_that_fit() {
        let m = |bits, group, cols| Mat {
            rows: 2048,
            cols,
            bits,
            group,
            ..Mat::NONE
        };
        assert!(moe_down_fits(&m(4, 64, 512), &m(4, 64, 512), 8));
        assert!(moe_down_fits(&m(8, 32, 512), &m(4, 64, 512), 10));
        assert!(!moe_down_fits(&m(3, 64, 512), &m(4, 64, 512), 8));
        assert!(!moe_down_fits(&m(4, 48, 480), &m(4, 64, 512), 8));
        // Activations beyond 48 KiB of shared memory.
        assert!(!moe_down_fits(&m(4, 64, 2048), &m(4, 64, 2048), 8));
        let mut other = m(4, 64, 512);
        other.rows = 1024;
        assert!(!moe_down_fits(&m(4, 64, 512), &other, 8));
    }
}
