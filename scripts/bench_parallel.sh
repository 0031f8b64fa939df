#!/usr/bin/env bash
# Aggregate decode speed of N concurrent streams against one, as the openai Python client sees
# it, on one `brook serve --parallel N`, alternating 1 and N for ROUNDS rounds (one sitting).
#
# Usage: scripts/bench_parallel.sh BROOK MODEL "SERVE FLAGS" N [ROUNDS] [MAX_TOKENS]
#   e.g. scripts/bench_parallel.sh target/release/brook ./q36 "--memory-budget 3GiB" 4 2 128
# Prints the machine (CPU model, AVX-512 features), the date and commit, then one line per run
# from scripts/bench_serve.py (needs the `openai` package).
set -euo pipefail
brook=$1 model=$2 flags=$3 n=$4 rounds=${5:-2} max=${6:-128}
here=$(cd "$(dirname "$0")" && pwd)
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) threads;" \
    "avx512: $(grep -o 'avx512[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "date: $(date -u +%F), commit: $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?')"
log=$(mktemp)
# shellcheck disable=SC2086
"$brook" serve --model "$model" --port 0 --parallel "$n" $flags >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 900); do
    grep -q 'brook serve: model' "$log" && break
    kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
    sleep 1
done
url=$(grep -o 'http://[0-9.:]*/v1' "$log" | head -1)
echo "serve --parallel $n $flags at $url"
for _ in $(seq "$rounds"); do
    for c in 1 "$n"; do
        python3 "$here/bench_serve.py" --base-url "$url" --prompt-tokens 32 \
            --max-tokens "$max" -r 1 --aggregate --concurrency "$c" | tail -1 | sed "s/^/concurrency $c: /"
    done
done
