set -u
export BROOK_HOME=/tmp/w/home BROOK_FIXTURES=$PWD/tests/fixtures
mkdir -p /tmp/w
dist/gpu/gpu-tests --test-threads 1 > /tmp/w/tests.log 2>&1; echo "tests exit $?"
grep -E "replayed logits|result|panicked" /tmp/w/tests.log
dist/gpu/brook synth --preset qwen3.6-35b-a3b --out /tmp/w/m --container >/dev/null
python3 scripts/bench_routing.py --brook dist/gpu/brook --model /tmp/w/m --budgets 100GiB --routing router,realistic,strong,weak -n 64 -r 2 --json-out $OUT/gpu4.jsonl -- --backend cuda --gpu-memory-budget 4GiB --disk-secs 0 >/dev/null
python3 scripts/bench_routing.py --brook dist/gpu/brook --model /tmp/w/m --budgets 100GiB --routing router,realistic -n 64 -r 2 --json-out $OUT/gpu8.jsonl -- --backend cuda --gpu-memory-budget 8GiB --disk-secs 0 >/dev/null
echo done
