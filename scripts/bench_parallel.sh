#!/usr/bin/env bash
# Aggregate decode speed of N concurrent streams against one, as the openai Python client sees
# it, on one `brook serve --parallel N`, alternating 1 and N for ROUNDS rounds (one sitting).
#
# Usage: scripts/bench_parallel.sh BROOK MODEL "SERVE FLAGS" N [ROUNDS] [MAX_TOKENS]
#   e.g. scripts/bench_parallel.sh target/release/brook ./q36 "--memory-budget 3GiB" 4 2 128
# VOCAB bounds the prompt ids drawn (default 150000; a tiny model needs less). CURL_CHECK=1
# adds, per run, the same streams through curl (a client that costs next to nothing);
# CURL_ONLY=1 runs only those (where the openai package is not installed); SAMPLED=1 has
# the curl streams sample as the model's generation config says instead of greedily.
# Prints the machine (CPU model, AVX-512 features), the date and commit, then one line per run
# from scripts/bench_serve.py (needs the `openai` package) with the engine's steps over the run
# from /metrics: tokens a step, and how busy the engine was (the time inside its steps against
# the run's wall time) and how long it waited between steps for the streams' next tokens (their
# sampling, text and streaming; the rest of the idle time went to HTTP and scheduling).
set -euo pipefail
brook=$1 model=$2 flags=$3 n=$4 rounds=${5:-2} max=${6:-128}
here=$(cd "$(dirname "$0")" && pwd)
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) threads;" \
    "avx512: $(grep -o 'avx512[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "date: $(date -u +%F), binary: $("$brook" --version), tree: $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?')"
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
model=$(python3 -c 'import json, sys, urllib.request
print(json.load(urllib.request.urlopen(sys.argv[1] + "/models"))["data"][0]["id"])' "$url")
echo "serve --parallel $n $flags at $url"
# The engine's counters from /metrics: steps, tokens fed, seconds inside steps.
counters() {
    python3 - "${url%/v1}/metrics" <<'PY'
import sys, time, urllib.request
m = {}
for line in urllib.request.urlopen(sys.argv[1]).read().decode().splitlines():
    if line and not line.startswith("#"):
        k, v = line.rsplit(" ", 1)
        m[k] = float(v)
print(m.get("brook_engine_steps_total", 0), m.get("brook_engine_tokens_total", 0),
      m.get("brook_engine_busy_seconds_total", 0), m.get("brook_engine_gather_seconds_total", 0),
      time.time())
PY
}
for _ in $(seq "$rounds"); do
    for c in 1 "$n"; do
        if [ "${CURL_ONLY:-0}" != 1 ]; then
        before=$(counters)
        line=$(python3 "$here/bench_serve.py" --base-url "$url" --prompt-tokens 32 --vocab "${VOCAB:-150000}" \
            --max-tokens "$max" -r 1 --aggregate --concurrency "$c" | tail -1)
        # Tokens a step and how busy the engine was over the run (the rest: sampling,
        # text, HTTP, scheduling).
        engine=$(python3 -c 'import sys
a = [float(x) for x in sys.argv[1].split()]; b = [float(x) for x in sys.argv[2].split()]
steps, toks, busy, gather, wall = (y - x for x, y in zip(a, b))
print(f"{steps:.0f} steps, {toks / max(steps, 1):.1f} tokens a step, engine busy {100 * busy / wall:.0f}% ({1e3 * busy / max(steps, 1):.1f} ms a step), waiting for the streams {100 * gather / wall:.0f}% ({1e3 * gather / max(steps, 1):.2f} ms a step)")' \
            "$before" "$(counters)")
        echo "concurrency $c: $line; $engine"
        fi
        if [ "${CURL_CHECK:-0}" = 1 ] || [ "${CURL_ONLY:-0}" = 1 ]; then
            # The same streams through curl, which costs the client next to nothing: where
            # this is much faster, the Python client was the limit.
            mapfile -t bodies < <(python3 -c 'import json, random, sys
r = random.Random(7)
for _ in range(int(sys.argv[1])):
    body = {"model": sys.argv[2], "max_tokens": int(sys.argv[3]), "temperature": 0,
            "stream": True, "ignore_eos": True,
            "prompt": [r.randrange(int(sys.argv[4])) for _ in range(32)]}
    if sys.argv[5] == "1":
        del body["temperature"]
    print(json.dumps(body))' \
                "$c" "$model" "$max" "${VOCAB:-150000}" "${SAMPLED:-0}")
            before=$(counters)
            t0=$(date +%s.%N)
            pids=()
            for body in "${bodies[@]}"; do
                curl -sN "$url/completions" -H 'content-type: application/json' -d "$body" >/dev/null &
                pids+=($!)
            done
            wait "${pids[@]}"
            t1=$(date +%s.%N)
            python3 -c 'import sys
a = [float(x) for x in sys.argv[1].split()]; b = [float(x) for x in sys.argv[2].split()]
wall = float(sys.argv[4]) - float(sys.argv[3]); n = int(sys.argv[5]) * int(sys.argv[6])
steps, busy, gather = b[0] - a[0], b[2] - a[2], b[3] - a[3]
print(f"concurrency {sys.argv[5]} (curl): aggregate {n / wall:.2f} tok/s; {steps:.0f} steps, engine busy {100 * busy / wall:.0f}%, waiting for the streams {100 * gather / wall:.0f}% ({1e3 * gather / max(steps, 1):.2f} ms a step)")' \
                "$before" "$(counters)" "$t0" "$t1" "$c" "$max"
        fi
    done
done
