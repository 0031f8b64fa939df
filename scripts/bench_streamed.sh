#!/usr/bin/env bash
# The CUDA backend with its experts streamed from the disk (the host tier too small to hold
# them), in one sitting on a GPU machine: the GPU tests of the streamed paths, then `brook
# bench` with the staging on one thread, on four (the default), and on four in the order the
# reads land (`BROOK_CUDA_STAGE_THREADS`, `BROOK_CUDA_LAND_ORDER`: docs/CUDA.md), alternating.
# Each row: decode speed against the disk limit bench computes (#30 asks at most 1.25 x),
# and where each token's time went on the host.
#
# Usage: scripts/bench_streamed.sh DIR MODEL [ROUNDS] [GPU_BUDGET] [HOST_BUDGET]
#   DIR: a build from `scripts/gpu-check.sh build` (brook, gpu-tests);
#   MODEL: a container, e.g. from `DIR/brook synth --preset qwen3.6-35b-a3b --container`;
#   budgets: 4GiB and 3GiB by default (the 35B then reads about 0.48 GB a token).
set -euo pipefail
dir=$1 model=$2 rounds=${3:-2} gpu=${4:-4GiB} host=${5:-3GiB}
here=$(cd "$(dirname "$0")" && pwd)
echo "gpu: $(nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader)"
echo "date: $(date -u +%FT%TZ), binary: $("$dir/brook" --version)"
echo "== GPU tests of the model (every cache size, streamed and resident)"
BROOK_FIXTURES="$here/../tests/fixtures" "$dir/gpu-tests" --test-threads 1 model::
show() {
    python3 -c 'import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    g = d["gpu"]
    ms = 1e3 / max(d["tg_tok_s"], 1e-9)
    print(sys.argv[1], "tg %.2f tok/s, limit %.2f (%.2f x); a token %.1f ms: disk busy %.1f,"
          " host waiting for bytes %.1f, staging %.1f, waiting for routing %.1f; %.3f GB read a"
          " token at %.2f GB/s (disk measured %.2f); GPU hits %.3f, host hits %.3f" % (
              d["tg_tok_s"], d["limit_tok_s"], d["limit_tok_s"] / max(d["tg_tok_s"], 1e-9), ms,
              d["read_s_per_token"] * 1e3, g.get("expert_wait_s_per_token", 0) * 1e3,
              g.get("expert_stage_s_per_token", 0) * 1e3,
              g.get("route_wait_s_per_token", 0) * 1e3, d["bytes_read_per_token"] / 1e9,
              d["disk_gb_s"], d["disk_bw_gb_s"], g["hit_rate"], d["demand_hit_rate"]))' "$1"
}
for _ in $(seq "$rounds"); do
    for env in "BROOK_CUDA_STAGE_THREADS=1" "BROOK_CUDA_STAGE_THREADS=4" \
        "BROOK_CUDA_LAND_ORDER=1"; do
        # shellcheck disable=SC2086
        env $env "$dir/brook" bench --model "$model" --backend cuda --gpu-memory-budget "$gpu" \
            --memory-budget "$host" -p 0 -n 32 -r 1 --json 2>/dev/null | show "$env:"
    done
done
