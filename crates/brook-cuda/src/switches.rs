//! The CUDA backend's environment switches, read here and nowhere else. Each turns one
//! measured mechanism off or tunes it, for profilers and for measuring a change against its
//! baseline in one binary (docs/CUDA.md, docs/BENCH.md); the defaults are what was measured
//! fastest. Unset, every switch keeps its default.

/// `BROOK_CUDA_GRAPHS=0`: no CUDA graphs (for profilers that time kernels one at a time).
pub fn graphs() -> bool {
    on_unless_0("BROOK_CUDA_GRAPHS")
}

/// `BROOK_CUDA_PDL=0`: no programmatic dependent launch (Hopper and later have it).
pub fn pdl() -> bool {
    on_unless_0("BROOK_CUDA_PDL")
}

/// `BROOK_CUDA_TC=0`: the CUDA cores' matrix kernels instead of the tensor cores' (Ampere
/// and later have them).
pub fn tensor_cores() -> bool {
    on_unless_0("BROOK_CUDA_TC")
}

/// `BROOK_CUDA_PREFETCH=0`: no prefetch of guessed experts in the mapped tier (on by
/// default since it copies at most [`prefetch_cap`] guesses: 1.8-4.7 % faster at an 8 GiB
/// GPU budget on the H100, where copying every guess was not faster than none).
pub fn prefetch() -> bool {
    on_unless_0("BROOK_CUDA_PREFETCH")
}

/// `BROOK_CUDA_RULE_PREP=0`: a `delta_prep` launch prepares a decoded token's q/k heads and
/// gates before the delta rule, instead of the rule doing it as it loads them (the same bits,
/// one launch fewer a DeltaNet layer; with [`rule_norm`], one sequence's step 396 → 421 tok/s
/// on an H100, docs/bench/2026-12-07.md; `the_rule_folding_its_prep_and_norm_keeps_the_bits_
/// of_their_launches` is its test).
pub fn rule_prep() -> bool {
    on_unless_0("BROOK_CUDA_RULE_PREP")
}

/// `BROOK_CUDA_RULE_NORM=0`: a `gated_norm` launch norms and gates a decoded token's outputs
/// after the delta rule, instead of the rule doing it with its block a whole value head (the
/// same bits, one launch fewer a DeltaNet layer; measured with [`rule_prep`]).
pub fn rule_norm() -> bool {
    on_unless_0("BROOK_CUDA_RULE_NORM")
}

/// `BROOK_CUDA_RULE_SPLIT=N` (1, 2 or 4): lanes each value column of the token-by-token
/// delta rule's state is split over at key width 128, each holding 128 / N of its rows (1:
/// the column's 128 values in one lane's registers, which spills); 4 by default (one
/// sequence's step 409 → 426 tok/s on an H100, sixteen 1906 → 1886; docs/BENCH.md). The
/// split sets the order of the rule's sums, so a process takes one throughout.
pub fn rule_split() -> usize {
    match count_switch("BROOK_CUDA_RULE_SPLIT", 1..=4, 4) {
        3 => {
            tracing::warn!("BROOK_CUDA_RULE_SPLIT=3 is not 1, 2 or 4; using 2");
            2
        }
        n => n,
    }
}

/// `BROOK_CUDA_GATEUP_SPLIT=N` (1 to 4): the most warps a gate/up tile of the tensor-core
/// SwiGLU kernel is split over, each taking a slice of the row (`ops::qmv_experts`); 4 by
/// default. The split sets the order of each row's sums, so every launch of a process
/// takes the same one.
pub fn gateup_split() -> usize {
    count_switch("BROOK_CUDA_GATEUP_SPLIT", 1..=4, 4)
}

/// `BROOK_CUDA_GROUPED=1`: a step of several sequences decodes an expert's weights once for
/// two tokens that use it (`grouped.rs`) instead of once a token and expert. Off: measured
/// slower (sixteen sequences' step 1906 → 1852 tok/s on an H100, docs/BENCH.md).
pub fn grouped() -> bool {
    on_if_1("BROOK_CUDA_GROUPED")
}

/// `BROOK_CUDA_GROUPED_GATEUP_BLOCKS` and `BROOK_CUDA_GROUPED_DOWN_BLOCKS` (1-32, default 4):
/// how many blocks an SM the grouped gate/up and down launches aim at over all their grid
/// rows (a row per group, empty ones included); the per-token down kernel ran more warps.
pub fn grouped_blocks() -> (usize, usize) {
    (
        count_switch("BROOK_CUDA_GROUPED_GATEUP_BLOCKS", 1..=32, 4),
        count_switch("BROOK_CUDA_GROUPED_DOWN_BLOCKS", 1..=32, 4),
    )
}

/// `BROOK_CUDA_PREFILL_TC=0`: a prefill chunk's products run the tiled f32 kernel (`qmm`)
/// instead of the tensor cores: the dense ones (projections, shared expert, router, a head
/// over every token) through the one-token kernels for each token (`ops::qmv_stacked_n`,
/// each weight tile decoded once for up to eight tokens), the routed experts eight of an
/// expert's pairs a tile read (`ops::qmm` with `tc`). pp512 of the 35B on an H100: 548 →
/// 4,001-4,049 tok/s (docs/BENCH.md).
pub fn prefill_tc() -> bool {
    on_unless_0("BROOK_CUDA_PREFILL_TC")
}

/// `BROOK_CUDA_SMALL_CHUNK=N` (0 to 256): chunks of 2 to N tokens run a token at a time
/// through the decode kernels (`CudaOptions::small_chunk`; 0: none), so that beside other
/// sequences they join their batched steps; [`crate::model::SMALL_CHUNK`] by default.
pub fn small_chunk() -> usize {
    count_switch("BROOK_CUDA_SMALL_CHUNK", 0..=256, crate::model::SMALL_CHUNK)
}

/// `BROOK_CUDA_PICKS=0`: whole rows of logits come back where a sampler asked for its greedy
/// pick or its most likely candidates (`Logits::Best`, `Logits::Top`), instead of the pick
/// or the candidates made on the GPU (the baseline of docs/BENCH.md's "greedy picks on the
/// GPU").
pub fn picks() -> bool {
    on_unless_0("BROOK_CUDA_PICKS")
}

/// `BROOK_CUDA_TOP=0`: a sampler that asks for its row's most likely candidates
/// (`Logits::Top`) gets its row, instead of the candidates found on the GPU (on by default
/// since measured: a 16-sequence step of sampling sequences 10.4-10.6 → 9.5 ms on an H100,
/// docs/BENCH.md).
pub fn top_candidates() -> bool {
    on_unless_0("BROOK_CUDA_TOP")
}

/// `BROOK_CUDA_LAND_ORDER=1`: streamed experts are staged for the GPU in the order their
/// reads land instead of the order they were asked for (an experiment, off until measured
/// on a GPU: written in the sixth session of 2026-12-06, whose device time ran out first;
/// `scripts/bench_streamed.sh` is its A/B).
pub fn land_order() -> bool {
    on_if_1("BROOK_CUDA_LAND_ORDER")
}

/// `BROOK_CUDA_STAGE_THREADS=N` (1 to 8): threads that copy a layer's streamed experts into
/// page-locked staging; 4 by default (the reads of a layer land together, and one thread
/// copied them one after another while the disk and the GPU waited: on an H200 host the
/// 35B streamed at 4 GiB decoded 3.56, 3.16 tok/s on one thread against 3.99, 3.53 on
/// four, alternating; `scripts/bench_streamed.sh` is the A/B, docs/BENCH.md).
pub fn stage_threads() -> usize {
    count_switch("BROOK_CUDA_STAGE_THREADS", 1..=8, 4)
}

/// `BROOK_CUDA_HOST_HUGE=1`: the mapped tier's host memory allocated on 2 MiB boundaries in
/// transparent huge pages and registered with the driver, instead of the driver's own
/// page-locked allocation (an experiment, off: docs/bench/2026-12-06.md, "The slow hosts,
/// narrowed").
pub fn host_huge() -> bool {
    on_if_1("BROOK_CUDA_HOST_HUGE")
}

/// `BROOK_CUDA_PREFETCH_CAP=N` (1 to top-k): the most mapped guesses a prefetch copies,
/// the likeliest first; 2 by default (the link carries about as much during a layer's
/// mixer, norm, router and top-k, and each wrong guess costs a copy: four were 4 % slower on
/// the 35B at 8 GiB and the 80B at 22 GiB, docs/bench/2026-12-07.md).
pub fn prefetch_cap(k: usize) -> usize {
    let k = k.max(1);
    count_switch("BROOK_CUDA_PREFETCH_CAP", 1..=k, 2.min(k))
}

/// `BROOK_CUDA_PREFETCH_BLOCKS=N` (1 to 1024): the prefetch's blocks in all, shared by the
/// guesses it copies; 16 by default (each block keeps 64 KiB in flight, and the mixer
/// beside it needs the SMs).
pub fn prefetch_blocks() -> usize {
    count_switch("BROOK_CUDA_PREFETCH_BLOCKS", 1..=1024, 16)
}

/// A switch on by default: off where `name` is "0".
fn on_unless_0(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

/// A switch off by default: on where `name` is "1".
fn on_if_1(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// A count from the environment variable `name` within `range`, else `default` (with a
/// warning where it is set but out of range or not a count).
fn count_switch(name: &str, range: std::ops::RangeInclusive<usize>, default: usize) -> usize {
    let v = std::env::var(name).ok();
    count_in(v.as_deref(), &range).unwrap_or_else(|| {
        if let Some(v) = v {
            tracing::warn!(
                "{name}={v} is not a count from {} to {}; using {default}",
                range.start(),
                range.end()
            );
        }
        default
    })
}

/// `v` as a count within `range`; `None` where unset, not a count, or outside it.
fn count_in(v: Option<&str>, range: &std::ops::RangeInclusive<usize>) -> Option<usize> {
    v?.trim()
        .parse::<usize>()
        .ok()
        .filter(|n| range.contains(n))
}

/// Blocks of a one-token gather of mapped experts whose products run beside it, on a GPU
/// of `sms` SMs: half the SMs by default (a few dozen keep PCIe busy, as each thread has
/// four 16-byte reads in flight, and the products need the rest), `BROOK_CUDA_GATHER_BLOCKS`
/// (1 to 1024) otherwise; 0 with `BROOK_CUDA_GATHER_FLAGS=0` (the products then wait for the
/// gather's end).
pub fn gather_blocks(sms: usize) -> usize {
    if !on_unless_0("BROOK_CUDA_GATHER_FLAGS") {
        return 0;
    }
    count_switch("BROOK_CUDA_GATHER_BLOCKS", 1..=1024, (sms / 2).max(1))
}

#[cfg(test)]
mod tests {
    use super::count_in;

    #[test]
    fn counts_outside_their_range_or_not_counts_are_refused() {
        let r = 1..=8;
        assert_eq!(count_in(Some("2"), &r), Some(2));
        assert_eq!(count_in(Some(" 8 "), &r), Some(8));
        assert_eq!(count_in(Some("1"), &r), Some(1));
        for bad in ["0", "9", "-1", "two", "", "2.5", "99999999999999999999999"] {
            assert_eq!(count_in(Some(bad), &r), None, "{bad:?}");
        }
        assert_eq!(count_in(None, &r), None);
    }
}
