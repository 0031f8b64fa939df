//! Launchers of the matrix kernels, shared by the forward pass and the kernel tests.

use brook_core::Result;

use crate::gpu::{Args, Gpu};
use crate::weights::Mat;

/// y[v, r] = W·x[v / xdiv] over the rows of m1 then m2, one warp per row, `nvec` vectors.
/// With `sel` (a device array of expert ids), vector v uses the slot of expert sel[v] in
/// the table `tab`.
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
    let rows = (m1.rows + m2.rows) as u32;
    let mut a = Args::new();
    a.arg(m1).arg(m2).arg(tab).arg(sel).arg(xdiv).arg(x).arg(y);
    g.launch(g.k.qmv, (rows.div_ceil(4), nvec as u32, 1), 128, 0, &mut a)
}

/// The tiled product for many vectors: `t` tokens (dense), or with `tab` the (token, k)
/// pairs of each of `groups` experts (see kernels.cu `qmm`).
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
) -> Result<()> {
    let rows = (m1.rows + m2.rows) as u32;
    let mut a = Args::new();
    a.arg(m1)
        .arg(m2)
        .arg(tab)
        .arg(counts)
        .arg(offs)
        .arg(pairs)
        .arg(xdiv)
        .arg(t as i32)
        .arg(x)
        .arg(y);
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
        qmm(g, m1, m2, 0, 0, 0, 0, 1, t, x, y, 1)
    }
}
