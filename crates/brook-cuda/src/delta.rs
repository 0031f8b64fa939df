//! Launchers of the gated delta rule (kernels/mixers.cu and delta.cu), shared by the
//! DeltaNet block and the kernel tests: `delta_rule_*` runs the recurrence a token at a time
//! (decode), `delta_chunk_*` a chunk of 64 tokens at a time (prefill). They mirror brook_core's
//! `delta_rule_recurrent` and `delta_rule_chunked` and read the buffers blocks.rs fills. The
//! q/k head norms and gates (`delta_prep`) and the gated norm (`gated_norm`) run as launches
//! before and after the rule, or inside a token-by-token rule's own launch
//! (`switches::rule_prep`, `switches::rule_norm`).

use brook_core::model::delta_net::DeltaMode;
use brook_core::{Error, Result};

use crate::gpu::{Args, Gpu};

/// Tokens per chunk of `delta_chunk_*` (kernels/delta.cu `DC_C`).
const CHUNK_TOKENS: usize = 64;
/// Value columns per block of `delta_chunk_*` (`DC_BV`) and per block of `delta_rule_*`.
const COLS: usize = 32;
/// Threads per block of `delta_chunk_*` (`DC_THREADS`).
const CHUNK_THREADS: u32 = 256;
/// Row strides of A and M and of the pseudo-values in its shared memory (`DC_A`, `DC_VP`).
const STRIDE_A: usize = CHUNK_TOKENS + 1;
const STRIDE_VP: usize = 36;

/// One call's device buffers and shapes.
#[derive(Debug, Clone, Copy)]
pub struct DeltaRule {
    pub conv: u64,  // [t, cd] f32: q at kh·dk, k at nk·dk + kh·dk, v at 2·nk·dk + h·dv
    pub g: u64,     // [t, nv] f32 log-decay (≤ 0)
    pub beta: u64,  // [t, nv] f32
    pub state: u64, // [nv, dk, dv] f32 (row = key dim), advanced in place
    pub o: u64,     // [t, nv, dv] f32
    pub t: usize,
    pub cd: usize,
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
    /// Several sequences of one token each (0: one sequence, `state`): a device table of two
    /// pointers per sequence, the second its state; sequence z's inputs and outputs are
    /// token z's. Always the recurrent kernel.
    pub seqs: u64,
    /// Sequences in `seqs`.
    pub nseq: usize,
    /// The conv output's q and k heads still to be normalised and β and g still to be made
    /// (into `beta` and `g`) from these inputs; `None`: done already.
    pub prep: Option<DeltaPrep>,
    /// Whether a recurrent launch does that preparation itself (`Gpu::rule_prep`: the same
    /// bits as the separate `delta_prep` launch, one launch fewer a DeltaNet layer).
    pub prep_in_rule: bool,
    /// The outputs normed and gated (`gated_norm`) into `y`; `None`: only `o` is written.
    pub norm: Option<GatedNorm>,
    /// Whether a recurrent launch norms its outputs itself, a block a value head
    /// (`Gpu::rule_norm`: the same bits as the `gated_norm` launch, one launch fewer).
    pub norm_in_rule: bool,
}

impl DeltaRule {
    /// Tokens the launch covers: `t`, or one a sequence in `seqs`.
    fn tokens(&self) -> usize {
        if self.seqs != 0 {
            self.nseq.max(1)
        } else {
            self.t
        }
    }
}

/// The inputs of the gated norm (kernels/mixers.cu `GatedNorm`): device pointers to z (`zs`
/// floats a token apart, value head h's gate at h·dv), the norm's weight and the output y
/// ([t, nv, dv]), and ε.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GatedNorm {
    pub z: u64,
    pub w: u64,
    pub y: u64,
    pub eps: f32,
    pub zs: i32,
}

impl crate::args::KernelArg for GatedNorm {}

/// The inputs of the q/k head norms and the gates (kernels/mixers.cu `DeltaPrep`): device
/// pointers to b and a (`bs` floats a token apart, value head h at h), A_log and dt_bias.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct DeltaPrep {
    pub b: u64,
    pub a: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub bs: i32,
}

impl crate::args::KernelArg for DeltaPrep {}

/// `delta_prep` over `p`'s tokens (or its sequences' one token each): the conv output's q
/// and k heads normalised in place, β and g written.
fn prep_launch(g: &Gpu, p: &DeltaRule, pr: &DeltaPrep) -> Result<()> {
    let mut a = Args::new();
    a.arg(p.conv)
        .arg(pr.b)
        .arg(pr.a)
        .arg(pr.a_log)
        .arg(pr.dt_bias)
        .arg(p.beta)
        .arg(p.g)
        .arg(p.cd as i32)
        .arg(p.nk as i32)
        .arg(p.nv as i32)
        .arg(p.dk as i32)
        .arg(pr.bs);
    g.launch(g.k.delta_prep, (p.tokens() as u32, 1, 1), 256, 0, &mut a)
}

/// Bytes of dynamic shared memory `delta_chunk_*` takes at key width `dk` (the layout of
/// kernels/delta.cu `dc_smem`): q and k rows of a chunk and the transposed state tile at
/// row stride dk + 4 (dk | 1 in the generic kernel), A and M, v' twice, γ, β and decays.
/// 136,960 bytes at dk = 128.
pub fn chunk_smem_bytes(dk: usize) -> usize {
    let ks = if matches!(dk, 32 | 64 | 128) {
        dk + 4
    } else {
        dk | 1
    };
    let c = CHUNK_TOKENS;
    ((2 * c + COLS) * ks + 2 * c * STRIDE_A + 2 * c * STRIDE_VP + 3 * c) * 4
}

/// Advances the state over `p.t` tokens and writes their outputs. `Auto` takes the chunked
/// kernel for more than one token, except where its shared memory exceeds what the device
/// allows a block (dk above 279 on an H100/H200; dk = 128 on GPUs that allow 99 KiB, such as
/// the RTX 30 and 40 series): the recurrent kernel computes the same rule there, only
/// slower. `Chunked` insists, and says so when it cannot.
pub fn delta_rule(g: &Gpu, p: &DeltaRule, mode: DeltaMode) -> Result<()> {
    if p.t == 0 {
        return Ok(());
    }
    let smem = chunk_smem_bytes(p.dk);
    let fits = smem <= g.max_smem as usize;
    let chunked = match mode {
        _ if p.seqs != 0 => false,
        DeltaMode::Recurrent => false,
        DeltaMode::Auto => p.t > 1 && fits,
        DeltaMode::Chunked if !fits => {
            return Err(Error::Device(format!(
                "the chunked delta rule at key width {} needs {smem} bytes of shared memory per block; this GPU allows {}: use the recurrent form",
                p.dk, g.max_smem
            )));
        }
        DeltaMode::Chunked => true,
    };
    let mut in_rule = DeltaPrep::default();
    if let Some(pr) = &p.prep {
        if p.prep_in_rule && !chunked {
            in_rule = *pr;
        } else {
            prep_launch(g, p, pr)?;
        }
    }
    let mut a = Args::new();
    a.arg(p.conv)
        .arg(p.g)
        .arg(p.beta)
        .arg(p.state)
        .arg(p.o)
        .arg(p.t as i32)
        .arg(p.cd as i32)
        .arg(p.nk as i32)
        .arg(p.nv as i32)
        .arg(p.dk as i32)
        .arg(p.dv as i32);
    let nz = if p.seqs != 0 { p.nseq.max(1) } else { 1 };
    let grid = (p.nv as u32, p.dv.div_ceil(COLS) as u32, nz as u32);
    if chunked {
        let f = match p.dk {
            32 => g.k.delta_chunk_32,
            64 => g.k.delta_chunk_64,
            128 => g.k.delta_chunk_128,
            _ => g.k.delta_chunk_any,
        };
        g.launch(f, grid, CHUNK_THREADS, smem as u32, &mut a)?;
        return norm_after(g, p);
    }
    // A block a value head when it norms its own outputs: at most 256 threads with a
    // column's whole state in each lane's registers (more would not fit an SM's register
    // file), 1024 with it split over two or four lanes (`switches::rule_split`).
    let (f, split) = match (p.dk, g.rule_split()) {
        (32, _) => (g.k.delta_rule_32, 1),
        (64, _) => (g.k.delta_rule_64, 1),
        (128, 4) => (g.k.delta_rule_128_p4, 4),
        (128, 2) => (g.k.delta_rule_128_p2, 2),
        (128, _) => (g.k.delta_rule_128, 1),
        _ => (g.k.delta_rule_any, 1),
    };
    let head_threads = p.dv.div_ceil(32) * 32;
    let most = if split > 1 { 1024 } else { 256 };
    let norm_in = p
        .norm
        .filter(|_| p.norm_in_rule && head_threads * split <= most);
    a.arg(p.seqs).arg(in_rule).arg(norm_in.unwrap_or_default());
    if norm_in.is_some() {
        let grid = (p.nv as u32, 1, nz as u32);
        let smem = (2 * p.dk + head_threads) * 4;
        let threads = (head_threads * split) as u32;
        return g.launch(f, grid, threads, smem as u32, &mut a);
    }
    let threads = (COLS * split) as u32;
    g.launch(f, grid, threads, (2 * p.dk * 4) as u32, &mut a)?;
    norm_after(g, p)
}

/// `gated_norm` over the rule's outputs `o` into the norm's `y`, where there is a norm.
fn norm_after(g: &Gpu, p: &DeltaRule) -> Result<()> {
    let Some(n) = &p.norm else { return Ok(()) };
    let rows = (p.tokens() * p.nv) as i32;
    let mut a = Args::new();
    a.arg(p.o)
        .arg(n.z)
        .arg(n.w)
        .arg(n.y)
        .arg(rows)
        .arg(p.dv as i32)
        .arg(n.eps)
        .arg(p.nv as i32)
        .arg(n.zs);
    g.launch(
        g.k.gated_norm,
        ((rows as u32).div_ceil(4), 1, 1),
        128,
        0,
        &mut a,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_shared_memory_follows_the_kernel_layout() {
        // q, k (64 rows) and the state tile (32 rows) at stride 132; A and M; v' twice; 3·64.
        assert_eq!(
            chunk_smem_bytes(128),
            (160 * 132 + 2 * 64 * 65 + 2 * 64 * 36 + 192) * 4
        );
        assert_eq!(chunk_smem_bytes(128), 136_960);
        // The generic kernel's odd stride.
        assert_eq!(
            chunk_smem_bytes(48),
            (160 * 49 + 2 * 64 * 65 + 2 * 64 * 36 + 192) * 4
        );
        // Within an H200's 227 KiB at dk = 256, so the real models never fall back.
        assert!(chunk_smem_bytes(256) < 226 << 10);
    }
}
