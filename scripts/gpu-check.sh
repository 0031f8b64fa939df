#!/usr/bin/env bash
# The CUDA backend's tests and benchmarks in one call, on a machine with an NVIDIA GPU and
# no Rust toolchain. Build the binaries on any x86-64 Linux machine with Rust first:
#
#   scripts/gpu-check.sh build [DIR]    # writes DIR/brook, DIR/gpu-tests, DIR/gpu_steps and
#                                       # DIR/link_bw (DIR: dist/gpu), and DIR.tgz holding them
#
# (with PTX_FOR="NVIDIA H100 80GB HBM3=9.0;NVIDIA H200=9.0" and an NVRTC on LD_LIBRARY_PATH,
# also DIR/cuda: the kernels compiled for those GPUs, which `run` puts in the GPU machine's
# cache, saving it the compile where its NVRTC version matches; docs/CUDA.md)
#
# then copy the repository (with dist/gpu, or only dist/gpu.tgz where the copy's size is
# limited: `run` unpacks it when dist/gpu is missing) to the GPU machine and, from its root, run
#
#   scripts/gpu-check.sh run [WORKDIR] [MODELS]
#
# which runs the GPU tests against the fixtures (a failed test makes the script exit 1), synthesizes each model of MODELS (default
# "qwen3.6-35b-a3b qwen3-next-80b-a3b") as a container in WORKDIR (default /tmp/brook-gpu;
# needs about 45 GB free for the 80B, one model at a time), benchmarks it with every
# expert resident in GPU memory and streamed under GPU budgets of 2, 4 and 8 GiB, and
# prints a table per model; with every expert resident it also times batched steps of 1, 2,
# 4, 8 and 16 sequences (gpu_steps, the engine alone; STEPS_SIZES changes them, "" skips);
# NCU_SEQS=N adds each kernel's time in a step of N sequences (ncu, graphs off;
# scripts/ncu_summary.py), DEPTHS="0 4096 ..." resident decode after that many tokens of
# context, SERVE_STREAMS=N the server's aggregate for N streams against one
# (scripts/bench_parallel.sh, needs the openai module: `pip install --no-index --find-links
# dist/wheels --target /tmp/py openai` and PYTHONPATH=/tmp/py where nothing can be fetched).
# BENCH_ARGS changes the bench flags (default -p 512 -n 64 -r 2),
# BUDGETS the budgets (default "resident 8GiB 4GiB 2GiB"), RESULTS_DIR keeps the JSON rows,
# KEEP_MODEL=1 reuses a container already in WORKDIR (from an earlier run of the same model)
# and adds to its rows, SKIP_TESTS=1 runs the benchmarks only.
# BINS lists build directories to compare (default dist/gpu): each one's tests run, and each
# budget is benchmarked with every build back to back, so a change is measured against its
# baseline in one call (e.g. build the baseline into dist/base first, then
# BINS="dist/base dist/gpu").
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
build)
    out=${2:-dist/gpu}
    cargo build --release -p brook-cli
    cargo build --release -p brook-cuda --example gpu_steps --example link_bw
    exe=$(cargo test --release -p brook-cuda --test gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="gpu": print(m["executable"])' | tail -1)
    mkdir -p "$out"
    cp target/release/brook "$out/brook"
    cp "$exe" "$out/gpu-tests"
    cp target/release/examples/gpu_steps "$out/gpu_steps"
    cp target/release/examples/link_bw "$out/link_bw"
    strip "$out/brook" "$out/gpu-tests" "$out/gpu_steps" "$out/link_bw" 2>/dev/null || true
    # PTX_FOR="NAME=MAJOR.MINOR;...": the kernels compiled here for those GPUs too (NVRTC on
    # LD_LIBRARY_PATH), into $out/cuda, which `run` puts in the GPU machine's cache.
    rm -rf "$out/cuda"
    if [ -n "${PTX_FOR:-}" ]; then
        cargo build --release -p brook-cuda --example ptx_cache
        IFS=';' read -ra gpus <<<"$PTX_FOR"
        BROOK_HOME="$out/home.tmp" target/release/examples/ptx_cache "${gpus[@]}"
        mv "$out/home.tmp/cuda" "$out/cuda" && rm -rf "$out/home.tmp"
    fi
    tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
    echo "built $out/brook, $out/gpu-tests, $out/gpu_steps and $out/link_bw$([ -d "$out/cuda" ] && echo " and $out/cuda"); all in $out.tgz"
    ;;
run)
    work=${2:-/tmp/brook-gpu}
    models=${3:-qwen3.6-35b-a3b qwen3-next-80b-a3b}
    bench_args=${BENCH_ARGS:--p 512 -n 64 -r 2}
    mkdir -p "$work"
    export BROOK_HOME="$work/home" BROOK_FIXTURES="$PWD/tests/fixtures"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    bins=${BINS:-dist/gpu}
    for b in $bins; do
        if [ ! -x "$b/brook" ] && [ -f "$b.tgz" ]; then
            tar xzf "$b.tgz" -C "$(dirname "$b")"
        fi
        # Kernels compiled for this GPU at build time (PTX_FOR), used where the NVRTC matches.
        if [ -d "$b/cuda" ]; then
            mkdir -p "$BROOK_HOME/cuda" && cp -n "$b/cuda/"*.ptx "$BROOK_HOME/cuda/" 2>/dev/null || true
        fi
    done
    first=${bins%% *}
    failed=0
    for b in $bins; do
        [ "${SKIP_TESTS:-0}" = 1 ] && break
        echo "== GPU tests ($b)"
        status=0
        "$b/gpu-tests" --test-threads 1 >"$work/tests.log" 2>&1 || status=$?
        grep -E "^test |rel err|vs mlx|result|panicked|skipping" "$work/tests.log" || true
        if [ "$status" != 0 ]; then
            echo "GPU tests FAILED ($b, exit $status); full log: $work/tests.log"
            failed=1
        fi
    done
    # A failed test fails the script, after the benchmarks (which still say how fast).
    trap '[ "$failed" = 0 ] || exit 1' EXIT
    for m in $models; do
        if [ "${KEEP_MODEL:-0}" = 1 ] && [ "$(cat "$work/model.name" 2>/dev/null)" = "$m" ]; then
            echo "== reusing the $m container"
        else
            rm -rf "$work/model" "$work/model.name"
            echo "== synth $m"
            "$first/brook" synth --preset "$m" --out "$work/model" --container >/dev/null
            echo "$m" >"$work/model.name"
        fi
        rows="$work/$m.jsonl"
        [ "${KEEP_MODEL:-0}" = 1 ] || : >"$rows"
        for budget in ${BUDGETS:-resident 8GiB 4GiB 2GiB}; do
            flags=()
            [ "$budget" != resident ] && flags=(--gpu-memory-budget "$budget")
            for b in $bins; do
                echo "== bench $m $budget ($b)"
                # shellcheck disable=SC2086
                if "$b/brook" bench --model "$work/model" --backend cuda "${flags[@]}" \
                    $bench_args --json >"$work/row.json"; then
                    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r["build"]=sys.argv[2]; print(json.dumps(r))' \
                        "$work/row.json" "$b" >>"$rows"
                else
                    echo "bench failed for budget $budget ($b)"
                fi
                if [ "$budget" = resident ] && [ -x "$b/gpu_steps" ] && [ -n "${STEPS_SIZES-1,2,4,8,16}" ]; then
                    echo "== batched steps $m ($b)"
                    "$b/gpu_steps" "$work/model" "${STEPS_SIZES-1,2,4,8,16}" 20 2>/dev/null || echo "gpu_steps failed ($b)"
                    if [ -n "${NCU_SEQS:-}" ] && command -v ncu >/dev/null; then
                        # One metric: ncu replays nothing (more metrics replay every kernel,
                        # too slow with the model in GPU memory).
                        echo "== kernels of a step of $NCU_SEQS sequences $m ($b)"
                        BROOK_CUDA_GRAPHS=0 timeout 300 ncu --cache-control none --clock-control none \
                            --csv --metrics gpu__time_duration.sum "$b/gpu_steps" "$work/model" \
                            "$NCU_SEQS" 1 >"$work/ncu.csv" 2>/dev/null &&
                            python3 scripts/ncu_summary.py --by-grid "$work/ncu.csv" || echo "ncu failed ($b)"
                    fi
                fi
                if [ "$budget" = resident ] && [ -n "${DEPTHS:-}" ]; then
                    # Decode deep in the context: each depth prefilled untimed, then 64 tokens.
                    for d in $DEPTHS; do
                        printf '== depth %s %s (%s): ' "$d" "$m" "$b"
                        "$b/brook" bench --model "$work/model" --backend cuda -p 0 -n 64 -d "$d" \
                            -r 1 --disk-secs 0 --context $((d + 128)) --json 2>/dev/null |
                            python3 -c 'import json,sys; r=json.load(sys.stdin); print("tg %.1f tok/s" % r["tg_tok_s"])' ||
                            echo "failed"
                    done
                fi
                if [ "$budget" = resident ] && [ -n "${SERVE_STREAMS:-}" ]; then
                    # Through the server with the openai client (PYTHONPATH or an installed
                    # openai; wheels: dist/wheels), SERVE_STREAMS against one, one round.
                    if python3 -c 'import openai' 2>/dev/null; then
                        echo "== serve, $SERVE_STREAMS streams against one $m ($b)"
                        timeout 300 scripts/bench_parallel.sh "$b/brook" "$work/model" "--backend cuda" \
                            "$SERVE_STREAMS" 1 128 || echo "bench_parallel failed ($b)"
                    else
                        echo "no openai module: the serve benchmark is skipped"
                    fi
                fi
            done
        done
        python3 - "$rows" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| build | model | GPU budget | slots | pp t/s | TTFT s | tg t/s | hit | GB copied/tok | syncs/tok | HBM GB/s | H2D GB/s | disk GB/s | limit tok/s | tg/limit | host RSS GB |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    g = r.get("gpu") or {}
    lim = g.get("limit_tok_s", 0) or 1e-9
    print(f'| {r["build"]} | {r["model"]} | {g.get("budget_bytes",0)/2**30:.1f} GiB | {g.get("slots")}{" (all)" if g.get("resident") else ""}{" +%d mapped" % g["mapped"] if g.get("mapped") else ""} | {r["pp_tok_s"]:.1f} | {r["ttft_s"]:.3f} | {r["tg_tok_s"]:.1f} | {100*g.get("hit_rate",0):.1f}% | {g.get("bytes_copied_per_token",0)/1e9:.3f} | {g.get("syncs_per_token",0):.1f} | {g.get("hbm_gb_s",0):.0f} | {g.get("h2d_gb_s",0):.1f} | {r["disk_bw_gb_s"]:.2f} | {lim:.1f} | {100*r["tg_tok_s"]/lim:.0f}% | {r["peak_rss_bytes"]/1e9:.2f} |')
PY
        [ -n "${RESULTS_DIR:-}" ] && cp "$rows" "$RESULTS_DIR/"
    done
    ;;
*)
    echo "usage: scripts/gpu-check.sh build [DIR] | run [WORKDIR] [MODELS]" >&2
    exit 2
    ;;
esac
