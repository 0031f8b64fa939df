#!/usr/bin/env bash
# The delta rule's two folds (docs/CUDA.md, docs/bench/2026-12-07.md) against the launches
# they replace, in one sitting on a GPU machine: the GPU test of their bits, then the engine
# alone (gpu_steps, one sequence and sixteen) with both folds off, both on, each alone and
# both on with the two-warp gate/up split, alternating, and `generate` and `bench` with both
# off and both on. BASE adds a build of the code before them (its gpu_steps) to each round.
#
# Usage: scripts/bench_rule_folds.sh DIR MODEL [ROUNDS] [BASE]
#   DIR, BASE: builds from `scripts/gpu-check.sh build` (brook, gpu-tests, gpu_steps);
#   MODEL: a container, e.g. from `DIR/brook synth --preset qwen3.6-35b-a3b --container`.
set -euo pipefail
dir=$1 model=$2 rounds=${3:-2} base=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
off="BROOK_CUDA_RULE_PREP=0 BROOK_CUDA_RULE_NORM=0"
on="BROOK_CUDA_RULE_PREP=1 BROOK_CUDA_RULE_NORM=1"
echo "gpu: $(nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader)"
echo "date: $(date -u +%FT%TZ), binary: $("$dir/brook" --version)"
echo "== GPU test of the folds' bits"
BROOK_FIXTURES="$here/../tests/fixtures" "$dir/gpu-tests" --test-threads 1 the_rule_folding
steps() {
    local bin=$1
    shift
    echo "== $bin $*"
    # shellcheck disable=SC2068 # the switches are words on purpose
    env $@ BROOK_BEST=1 "$bin/gpu_steps" "$model" 1,16 20 2>&1 | tail -4
}
for _ in $(seq "$rounds"); do
    [ -n "$base" ] && steps "$base"
    steps "$dir" "$off"
    steps "$dir" "$on"
    steps "$dir" "BROOK_CUDA_RULE_PREP=1 BROOK_CUDA_RULE_NORM=0"
    steps "$dir" "BROOK_CUDA_RULE_PREP=0 BROOK_CUDA_RULE_NORM=1"
    steps "$dir" "$on BROOK_CUDA_GATEUP_SPLIT=2"
done
ids=$(python3 -c 'import random; random.seed(1); print(",".join(str(random.randrange(1000, 150000)) for _ in range(64)))')
for sw in "$off" "$on"; do
    echo "== generate and bench: $sw"
    # shellcheck disable=SC2086
    env $sw "$dir/brook" generate --model "$model" --backend cuda --prompt-tokens "$ids" \
        --max-tokens 128 --ignore-eos --temperature 0 --json 2>/dev/null |
        python3 -c 'import json, sys
d = json.loads(sys.stdin.read().strip().splitlines()[-1])
print("generate decode", round(d["decode_tok_s"], 1), "tok/s, ttft", round(d["ttft_s"], 3), "s")'
    # shellcheck disable=SC2086
    env $sw "$dir/brook" bench --model "$model" --backend cuda -p 128 -n 64 -r 1 --disk-secs 0 \
        2>&1 | grep -E 'pp128|tg64'
done
