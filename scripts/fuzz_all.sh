#!/usr/bin/env bash
# Runs every fuzz target of crates/brook-fuzz under libFuzzer for SECONDS each (default 300),
# JOBS at a time (default 2), on the stable toolchain (`cargo install cargo-fuzz`; no sanitizer,
# which needs nightly). New inputs go to fuzz/work/TARGET; crashes, timeouts (over 10 s) and
# allocations over 2 GiB to fuzz/artifacts/TARGET. Logs: fuzz/logs/TARGET.log; the last
# libFuzzer status line of each is printed at the end. Afterwards
# `scripts/fuzz_all.sh merge` folds the new inputs that add coverage into fuzz/corpus.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
targets=(safetensors manifest config tokenizer template_source template_inputs chat_request completion_request text_stream)
if [ "${1:-}" = merge ]; then
    for t in "${targets[@]}"; do
        [ -d "work/$t" ] || continue
        cargo fuzz run -s none "$t" "corpus/$t" "work/$t" -- -merge=1 >"logs/$t.merge.log" 2>&1
        echo "$t: $(ls "corpus/$t" | wc -l) corpus files"
    done
    exit 0
fi
secs="${1:-300}"
jobs="${2:-2}"
cargo fuzz build -s none
mkdir -p logs
run() {
    local t=$1
    mkdir -p "work/$t" "artifacts/$t"
    cargo fuzz run -s none "$t" "work/$t" "corpus/$t" -- -max_total_time="$secs" -timeout=10 \
        -rss_limit_mb=2048 -print_final_stats=1 >"logs/$t.log" 2>&1 || echo "$t: FAILED (see fuzz/logs/$t.log)"
}
for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
    run "$t" &
done
wait
for t in "${targets[@]}"; do
    line=$(grep -E "^#[0-9]+" "logs/$t.log" | tail -1 || true)
    execs=$(grep -E "stat::number_of_executed_units" "logs/$t.log" | awk '{print $2}' || true)
    echo "$t: ${execs:-?} executions; $line; artifacts: $(ls "artifacts/$t" | wc -l)"
done
