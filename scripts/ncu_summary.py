#!/usr/bin/env python3
"""Per-kernel time of the last step in an ncu CSV (`ncu --csv --metrics gpu__time_duration.sum
PROGRAM`): the kernels from the last launch of FIRST (default `embed`, which starts every
decode step) to the end, grouped by kernel name, largest first.

Usage: scripts/ncu_summary.py NCU.csv [FIRST]
"""
import collections
import csv
import sys


def main():
    path = sys.argv[1]
    first = sys.argv[2] if len(sys.argv) > 2 else "embed"
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        raise SystemExit(f"{path}: no kernel rows (did ncu profile anything?)")
    head, rows = rows[0], rows[1:]
    name, value, metric = (head.index(k) for k in ("Kernel Name", "Metric Value", "Metric Name"))
    grid = head.index("Grid Size") if "Grid Size" in head else None
    runs = [(r[name].split("(")[0], float(r[value].replace(",", "")) / 1e3,
             r[grid] if grid is not None else "")
            for r in rows if r[metric] == "gpu__time_duration.sum"]
    starts = [i for i, k in enumerate(runs) if k[0] == first]
    if not starts:
        raise SystemExit(f"{path}: no launch of {first}")
    last = runs[starts[-1]:]
    by = collections.defaultdict(lambda: [0, 0.0, ""])
    for k, us, g in last:
        by[k][0] += 1
        by[k][1] += us
        by[k][2] = g
    total = sum(us for _, us, _ in last)
    print(f"{len(last)} launches, {total:.1f} µs in all")
    print("| kernel | launches | µs | µs each | last grid |")
    print("|---|---:|---:|---:|---|")
    for k, (n, us, g) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n} | {us:.1f} | {us / n:.1f} | {g} |")


if __name__ == "__main__":
    main()
