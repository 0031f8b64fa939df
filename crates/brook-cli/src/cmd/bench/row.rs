//! The rows `brook bench` prints or writes as JSON: one configuration's figures
//! ([`Row`]) and a GPU run's ([`GpuRow`]).

use serde::{Deserialize, Serialize};

/// One configuration's results.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub model: String,
    pub model_bytes: u64,
    pub budget_bytes: Option<u64>,
    pub threads: usize,
    /// `--precision` of the run (exact, split24, fast).
    #[serde(default)]
    pub precision: String,
    /// The CPU kernels' SIMD level (`BROOK_SIMD` caps it) and whether AVX-512 VNNI (`+vnni`)
    /// or AVX-VNNI (`+avxvnni`) is used.
    #[serde(default)]
    pub simd: String,
    pub prefetch: bool,
    /// Expert slots in use at the end of the run.
    pub expert_slots: Option<usize>,
    /// Slots the budget pays for (the cache grows to them once that pays; `--fill-cache`).
    #[serde(default)]
    pub expert_slots_max: Option<usize>,
    pub n_prompt: usize,
    pub n_gen: usize,
    /// Context tokens before the decode test (`--depth`).
    #[serde(default)]
    pub depth: usize,
    pub pp_tok_s: f64,
    pub pp_tok_s_sd: f64,
    pub tg_tok_s: f64,
    pub tg_tok_s_sd: f64,
    pub ttft_s: f64,
    pub peak_rss_bytes: u64,
    /// The decode test's demand hit rate (the same figure as `demand_hit_rate`; kept for
    /// scripts).
    pub hit_rate: f64,
    /// Experts found in memory when a decoded token asked for them (whether a prefetch or an
    /// earlier request brought them) / experts asked for.
    #[serde(default)]
    pub demand_hit_rate: f64,
    /// Experts read ahead by the prefetch during the decode test, and how many of those a
    /// token then asked for.
    #[serde(default)]
    pub prefetch_reads: u64,
    #[serde(default)]
    pub prefetch_used: u64,
    /// `--cache-eviction` of the run.
    #[serde(default)]
    pub eviction: String,
    /// The routing trace decode replayed (`--routing-trace`), and its tokens.
    #[serde(default)]
    pub routing_trace: Option<String>,
    #[serde(default)]
    pub routing_trace_tokens: usize,
    pub bytes_read_per_token: f64,
    /// Achieved read bandwidth while reads were in flight during decode.
    pub disk_gb_s: f64,
    /// The disk's own bandwidth for whole-expert random reads: the mean of the measurements
    /// right before and right after the decode test.
    pub disk_bw_gb_s: f64,
    /// Those two measurements.
    #[serde(default)]
    pub disk_bw_before_gb_s: f64,
    #[serde(default)]
    pub disk_bw_after_gb_s: f64,
    /// Memory read bandwidth over the resident weights: the median of a second of plain
    /// reads of the head right before and one right after the decode test (after the prefill
    /// alone when there is no decode).
    pub mem_bw_gb_s: f64,
    /// The medians of the reads before and after the decode test.
    #[serde(default)]
    pub mem_bw_before_gb_s: f64,
    #[serde(default)]
    pub mem_bw_after_gb_s: f64,
    /// The fastest single read (not used for the limit).
    #[serde(default)]
    pub mem_bw_best_gb_s: f64,
    /// Weight bytes one decoded token touches.
    pub bytes_touched_per_token: f64,
    /// Sequence-state bytes a decoded token moves besides the weights, at the decode test's
    /// middle position: the DeltaNet states read and written (bf16 on the CPU's fast path,
    /// else f32), the attention caches read (`ModelConfig::decode_state_bytes`).
    #[serde(default)]
    pub state_bytes_per_token: f64,
    /// Decode limit: 1 / max((weight + state bytes) / memory bandwidth, bytes read / disk
    /// bandwidth), the disk's being the larger of the measurement and what the run's reads
    /// achieved. (Rows written before 2026-12-05 left the state bytes out.)
    pub limit_tok_s: f64,
    /// The same limit over the weight bytes alone, as rows before the state bytes counted.
    #[serde(default)]
    pub limit_weights_tok_s: f64,
    /// Compute time of a decoded token: the process's CPU seconds during decode per token,
    /// divided by the compute threads (waits for reads use no CPU; spinning workers and the
    /// I/O threads count, so this errs high). CPU backend only.
    #[serde(default)]
    pub compute_s_per_token: f64,
    /// Disk time of a decoded token: bytes read / the limit's disk bandwidth.
    #[serde(default)]
    pub read_s_per_token: f64,
    pub open_s: f64,
    /// "cpu", "cuda" or "reference".
    #[serde(default)]
    pub backend: String,
    /// The commit the binary was built from (`unknown` outside a git checkout).
    #[serde(default)]
    pub commit: String,
    /// GPU figures when a GPU backend ran.
    #[serde(default)]
    pub gpu: Option<GpuRow>,
}

/// A GPU run's figures: decode counters per token and the device's measured bandwidths.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GpuRow {
    pub device: String,
    pub budget_bytes: u64,
    pub used_bytes: u64,
    pub slots: usize,
    pub resident: bool,
    /// Experts in mapped host memory, which the kernels read over PCIe.
    #[serde(default)]
    pub mapped: usize,
    pub hit_rate: f64,
    /// Where mapped: the share of the GPU's misses in decode that a prefetch had gathered.
    #[serde(default)]
    pub prefetched: f64,
    /// Expert bytes copied host → GPU per decoded token (where mapped: read over PCIe by
    /// the kernels).
    pub bytes_copied_per_token: f64,
    /// The part of those the picks asked for (less a prefetch's wrong guesses): what the
    /// limit counts.
    #[serde(default)]
    pub bytes_needed_per_token: f64,
    /// Host waits on the GPU per decoded token.
    pub syncs_per_token: f64,
    /// Device copy bandwidth (read + write), GB/s, measured in this run.
    pub hbm_gb_s: f64,
    /// Pinned host → device bandwidth, GB/s, measured in this run.
    pub h2d_gb_s: f64,
    /// 1 / max((weight + state bytes) / HBM, needed / PCIe, disk reads / disk (as the row's
    /// limit)).
    pub limit_tok_s: f64,
    /// Streamed experts, per decoded token: seconds the host waited for their bytes to
    /// land, seconds it spent staging them for the GPU, and seconds it waited for the
    /// layers' routing to come back (the rest of a token is the GPU's work and the host's
    /// own turns).
    #[serde(default)]
    pub expert_wait_s_per_token: f64,
    #[serde(default)]
    pub expert_stage_s_per_token: f64,
    #[serde(default)]
    pub route_wait_s_per_token: f64,
}
