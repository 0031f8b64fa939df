#!/usr/bin/env bash
# The CUDA backend's environment switches (crates/brook-cuda/src/switches.rs) against each
# other in one sitting on a GPU machine: the engine alone (gpu_steps, one sequence and
# sixteen, the median step) for every set of switches in turn, ROUNDS times, then `generate`
# (64 prompt ids, 128 greedy tokens) and `bench -p 128 -n 64` with the first set and the
# last. Optional GPU tests first (TESTS: a filter for the test binary, "" for all of them;
# unset: none). The folds of the delta rule were measured with
#   scripts/bench_switches.sh DIR MODEL 2 "BROOK_CUDA_RULE_PREP=0 BROOK_CUDA_RULE_NORM=0" ""
#
# Usage: scripts/bench_switches.sh DIR MODEL ROUNDS SET [SET ...]
#   DIR: a build from `scripts/gpu-check.sh build` (brook, gpu-tests, gpu_steps);
#   MODEL: a container, e.g. from `DIR/brook synth --preset qwen3.6-35b-a3b --container`;
#   SET: switches as NAME=VALUE words ("" for the defaults).
set -euo pipefail
[ $# -ge 4 ] || {
    sed -n '2,13p' "$0"
    exit 2
}
dir=$1 model=$2 rounds=$3
shift 3
sets=("$@")
here=$(cd "$(dirname "$0")" && pwd)
echo "gpu: $(nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader)"
echo "date: $(date -u +%FT%TZ), binary: $("$dir/brook" --version)"
if [ -n "${TESTS+set}" ]; then
    for sw in "${sets[@]}"; do
        echo "== GPU tests ($TESTS) with: ${sw:-defaults}"
        # shellcheck disable=SC2086 # the switches are words on purpose
        env $sw BROOK_FIXTURES="$here/../tests/fixtures" "$dir/gpu-tests" --test-threads 1 \
            $TESTS 2>&1 | grep -E '^test result|FAILED|panicked' || true
    done
fi
for _ in $(seq "$rounds"); do
    for sw in "${sets[@]}"; do
        echo "== gpu_steps with: ${sw:-defaults}"
        # shellcheck disable=SC2086
        env $sw BROOK_BEST=1 "$dir/gpu_steps" "$model" 1,16 20 2>&1 | tail -4
    done
done
ids=$(python3 -c 'import random; random.seed(1); print(",".join(str(random.randrange(1000, 150000)) for _ in range(64)))')
for sw in "${sets[0]}" "${sets[-1]}"; do
    echo "== generate and bench with: ${sw:-defaults}"
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
