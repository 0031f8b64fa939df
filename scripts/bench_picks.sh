#!/usr/bin/env bash
# Greedy picks and sampling candidates made on the GPU against whole rows of logits, in one
# sitting on a GPU machine (docs/CUDA.md, `Logits::Best` and `Logits::Top`): the GPU tests
# of both, the engine alone (gpu_steps), `generate` sampling with Qwen's generation config
# (the same seed must give the same tokens both ways), and `serve` with sampled streams
# through curl. Each pair runs `BROOK_CUDA_PICKS=0` (rows) then the build's own choice
# (picks and candidates on the GPU; `BROOK_CUDA_TOP=1` is the default, named for the log).
#
# Usage: scripts/bench_picks.sh DIR MODEL [ROUNDS]
#   DIR: a build from `scripts/gpu-check.sh build` (brook, gpu-tests, gpu_steps);
#   MODEL: a container, e.g. from `DIR/brook synth --preset qwen3.6-35b-a3b --container`.
set -euo pipefail
dir=$1 model=$2 rounds=${3:-2}
here=$(cd "$(dirname "$0")" && pwd)
echo "gpu: $(nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader)"
echo "date: $(date -u +%FT%TZ), binary: $("$dir/brook" --version)"
echo "== GPU tests of the picks and candidates"
BROOK_FIXTURES="$here/../tests/fixtures" "$dir/gpu-tests" --test-threads 1 greedy_picks candidates
ids=$(python3 -c 'import random; random.seed(1); print(",".join(str(random.randrange(1000, 150000)) for _ in range(512)))')
gen() {
    env "$@" "$dir/brook" generate --model "$model" --backend cuda --prompt-tokens "$ids" \
        --max-tokens 256 --ignore-eos --temperature 1 --top-k 20 --top-p 0.95 --seed 3 --json \
        2>/dev/null | python3 -c 'import hashlib, json, sys
d = json.loads(sys.stdin.read().strip().splitlines()[-1])
toks = ",".join(map(str, d["tokens"])).encode()
print(" ".join(sys.argv[1:]), "decode", round(d["decode_tok_s"], 1), "tok/s, tokens",
      hashlib.sha256(toks).hexdigest()[:16])' "$@"
}
for _ in $(seq "$rounds"); do
    for env in "BROOK_CUDA_PICKS=0" "BROOK_CUDA_TOP=1"; do
        echo "== $env"
        env "$env" BROOK_TOP=1 "$dir/gpu_steps" "$model" 1,4,16 20 | tail -3
        gen "$env"
    done
done
for env in "BROOK_CUDA_PICKS=0" "BROOK_CUDA_TOP=1"; do
    echo "== serve, sampled streams, $env"
    env "$env" SAMPLED=1 CURL_ONLY=1 "$here/bench_parallel.sh" "$dir/brook" "$model" \
        "--backend cuda" 16 "$rounds" 256 | tail -$((2 * rounds))
done
