//! The pieces of a bench row that are arithmetic on what was measured: the GPU's columns and
//! limit, the SIMD level's name, the model's sizes, means.

use anyhow::Result;
use brook_core::engine::GpuStats;

use super::GpuRow;

/// `v` per decoded step (0 when none was).
pub(super) fn per_step(v: u64, steps: u64) -> f64 {
    if steps == 0 {
        0.0
    } else {
        v as f64 / steps as f64
    }
}

/// The GPU's columns of a row from its counters before and after the decode test: `bw` is
/// its measured (HBM, host-to-device) GB/s, `touched` the bytes a token reads, `steps` the
/// decoded steps, `disk_s` a token's read time from the disk (0 where the disk was not
/// measured).
pub(super) fn gpu_row(
    b: &GpuStats,
    g: GpuStats,
    (hbm, h2d): (f64, f64),
    touched: f64,
    steps: u64,
    disk_s: f64,
) -> GpuRow {
    let copied = per_step(g.bytes_copied - b.bytes_copied, steps);
    // The link's share of the limit: what the picks asked for, not a prefetch's wrong
    // guesses (an engine that guessed nothing would still move these bytes).
    let needed = per_step(g.bytes_needed.saturating_sub(b.bytes_needed), steps);
    let n = (g.hits - b.hits) + (g.misses - b.misses);
    let lim = (touched / (hbm * 1e9).max(1.0))
        .max(needed / (h2d * 1e9).max(1.0))
        .max(disk_s);
    GpuRow {
        device: g.device,
        budget_bytes: g.budget_bytes,
        used_bytes: g.used_bytes,
        slots: g.slots,
        resident: g.resident,
        mapped: g.mapped,
        prefetched: (g.prefetch_used - b.prefetch_used) as f64
            / (g.misses - b.misses).max(1) as f64,
        hit_rate: if n == 0 {
            1.0
        } else {
            (g.hits - b.hits) as f64 / n as f64
        },
        bytes_copied_per_token: copied,
        bytes_needed_per_token: needed,
        syncs_per_token: per_step(g.syncs - b.syncs, steps),
        hbm_gb_s: hbm,
        h2d_gb_s: h2d,
        limit_tok_s: 1.0 / lim,
        expert_wait_s_per_token: (g.expert_wait_s - b.expert_wait_s) / steps.max(1) as f64,
        expert_stage_s_per_token: (g.expert_stage_s - b.expert_stage_s) / steps.max(1) as f64,
        route_wait_s_per_token: (g.route_wait_s - b.route_wait_s) / steps.max(1) as f64,
    }
}

/// The SIMD level the CPU kernels run at, as rows name it (`avx512+vnni`, `avx2+avxvnni`, …).
pub(super) fn simd_label() -> String {
    use brook_core::cpu::kernels::simd::SimdLevel;
    let l = SimdLevel::detect();
    let extra = if SimdLevel::has_vnni() {
        "+vnni"
    } else if l == SimdLevel::Avx2 && SimdLevel::has_avx_vnni() {
        "+avxvnni"
    } else {
        ""
    };
    format!("{}{extra}", l.name())
}

/// Mean and sample standard deviation (0 for fewer than two values).
pub(super) fn mean_sd(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len().max(2) - 1) as f64;
    (m, var.sqrt())
}

/// Total model bytes and routed-expert bytes (container layer files, or checkpoint files).
pub(super) fn model_sizes(dir: &std::path::Path) -> Result<(u64, u64)> {
    if brook_core::container::is_container(dir) {
        let c = brook_core::container::Container::open(dir)?;
        let n = c.manifest.experts.num_experts as u64;
        let experts: u64 = c
            .manifest
            .experts
            .layers
            .iter()
            .map(|l| l.blob_size * n)
            .sum();
        Ok((c.manifest.dense.size + experts, experts))
    } else {
        let ck = brook_core::Checkpoint::open(dir)?;
        let total: u64 = ck.files().iter().map(|f| f.file_len().unwrap_or(0)).sum();
        let experts: u64 = ck
            .tensor_names()
            .filter(|n| n.contains(".switch_mlp."))
            .filter_map(|n| brook_core::TensorSource::info(&ck, n).map(|i| i.len))
            .sum();
        Ok((total, experts))
    }
}

/// Bytes of the dense weights (the embedding table included).
pub(super) fn dense_bytes(m: &brook_core::Model) -> usize {
    let mut total = m.dense.embed_tokens.table_bytes() + m.dense.lm_head.nbytes();
    for l in &m.dense.layers {
        use brook_core::model::weights::Mixer;
        total += match &l.mixer {
            Mixer::Linear(w) => {
                w.in_proj_qkv.nbytes()
                    + w.in_proj_z.nbytes()
                    + w.in_proj_b.nbytes()
                    + w.in_proj_a.nbytes()
                    + w.out_proj.nbytes()
            }
            Mixer::Full(w) => {
                w.q_proj.nbytes() + w.k_proj.nbytes() + w.v_proj.nbytes() + w.o_proj.nbytes()
            }
        };
        let e = &l.mlp.shared_expert;
        total += l.mlp.gate.nbytes()
            + l.mlp.shared_expert_gate.nbytes()
            + e.gate_proj.nbytes()
            + e.up_proj.nbytes()
            + e.down_proj.nbytes();
    }
    total
}
