#!/usr/bin/env python3
"""Streaming decode on simulated or recorded routing, side by side with the model's own routing.

Usage:
    python3 scripts/bench_routing.py --model DIR --budgets 2.5GiB,3GiB,4GiB,8GiB
        [--brook target/release/brook] [--routing router,realistic,strong,weak | FILE.jsonl,...]
        [-n 64] [-r 2] [--seed 1] [--json-out rows.jsonl] [-- extra brook bench flags]

For each budget, runs `brook bench -p 0 -n N -r R --json` once per routing, alternating the
routings within the budget so that each comparison is made in one sitting: `router` is the
model's own routing (near-uniform on random weights), a preset name simulates a trace of that
preset with `brook trace --simulate` (N x R tokens, so repetitions do not repeat it), and a
file replays that trace. Prints one Markdown table: decode tok/s, demand hit rate, GB read per
token, the decode limit (1 / max(bytes touched / memory bandwidth, bytes read / disk
bandwidth)) and decode / limit, with the CPU model, SIMD level, date and commit. Builds nothing;
run nothing else meanwhile.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def machine():
    cpu, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "?":
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags |= set(re.findall(r"avx512\w*|avx2", line))
    except OSError:
        pass
    simd = "AVX-512 (" + ", ".join(sorted(f for f in flags if f.startswith("avx512"))) + ")" \
        if any(f.startswith("avx512") for f in flags) else ("AVX2" if "avx2" in flags else "none")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "?"
    except OSError:
        commit = "?"
    return cpu, simd, datetime.date.today().isoformat(), commit, os.cpu_count()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", required=True, help="comma-separated --memory-budget values")
    ap.add_argument("--brook", default="target/release/brook")
    ap.add_argument("--routing", default="router,realistic")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json-out")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="brook-routing-")
    routings = []
    for r in a.routing.split(","):
        r = r.strip()
        if r == "router":
            routings.append(("router", None))
        elif os.path.exists(r):
            routings.append((os.path.basename(r), r))
        else:
            path = os.path.join(tmp, f"{r}.jsonl")
            out = run([a.brook, "trace", "--model", a.model, "--simulate", r, "--tokens",
                       str(a.n * a.r), "--seed", str(a.seed), "--out", path])
            print(out.strip(), file=sys.stderr)
            routings.append((r, path))

    rows = []
    for budget in a.budgets.split(","):
        for name, trace in routings:
            cmd = [a.brook, "bench", "--model", a.model, "--memory-budget", budget, "-p", "0",
                   "-n", str(a.n), "-r", str(a.r), "--json", *a.extra]
            if trace:
                cmd += ["--routing-trace", trace]
            row = json.loads(run(cmd).strip().splitlines()[-1])
            row["routing"] = name
            row["budget"] = budget
            rows.append(row)
            print(f"done: {budget} {name}: {row['tg_tok_s']:.2f} tok/s", file=sys.stderr)
            if a.json_out:
                with open(a.json_out, "a") as f:
                    f.write(json.dumps(row) + "\n")

    cpu, simd, date, commit, cores = machine()
    print(f"{cpu}, {cores} cores, {simd}; {date}; commit {commit}; "
          f"`brook bench -p 0 -n {a.n} -r {a.r}` {' '.join(a.extra)}")
    print()
    print("| model | budget | routing | slots | tg tok/s | demand hit rate | GB read/token "
          "| disk GB/s | limit tok/s | tg / limit |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lim = r["limit_tok_s"]
        print(f"| {r['model']} | {r['budget']} | {r['routing']} | {r.get('expert_slots') or 'all'} "
              f"| {r['tg_tok_s']:.2f} | {r['demand_hit_rate']:.3f} "
              f"| {r['bytes_read_per_token'] / 1e9:.3f} | {r['disk_bw_gb_s']:.2f} "
              f"| {lim:.2f} | {100 * r['tg_tok_s'] / lim if lim else 0:.0f}% |")


if __name__ == "__main__":
    main()
