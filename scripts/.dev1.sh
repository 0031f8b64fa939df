set -u
export BROOK_HOME=/tmp/w/home BROOK_FIXTURES=$PWD/tests/fixtures
mkdir -p /tmp/w
nvidia-smi --query-gpu=name --format=csv,noheader
grep -m1 "model name" /proc/cpuinfo
dist/gpu/gpu-tests --test-threads 1 > /tmp/w/tests.log 2>&1; echo "tests exit $?"
grep -E "^test |replayed logits|result|panicked" /tmp/w/tests.log
t0=$(date +%s); dist/gpu/brook synth --preset qwen3.6-35b-a3b --out /tmp/w/m --container >/dev/null; echo "synth $(( $(date +%s)-t0 )) s"
python3 scripts/bench_routing.py --brook dist/gpu/brook --model /tmp/w/m --budgets 100GiB --routing router,realistic,weak -n 64 -r 2 --json-out $OUT/resident.jsonl -- --backend cuda --disk-secs 0
python3 scripts/bench_routing.py --brook dist/gpu/brook --model /tmp/w/m --budgets 100GiB --routing router,realistic,strong,weak -n 64 -r 2 --json-out $OUT/gpu4.jsonl -- --backend cuda --gpu-memory-budget 4GiB --disk-secs 0
