#!/usr/bin/env python3
"""Per-kernel time of the last step in an ncu CSV (`ncu --csv --metrics gpu__time_duration.sum
PROGRAM`): the kernels from the last launch of FIRST (default `embed`, which starts every
decode step) to the end, grouped by kernel name, largest first. With --by-grid, grouped by
kernel name and grid, so one kernel's launches for matrices of different shapes (the DeltaNet
inputs, the output projections, the head) come apart, with each group's fastest and slowest.

Usage: scripts/ncu_summary.py [--by-grid] NCU.csv [FIRST]
"""
import collections
import csv
import sys


def main():
    by_grid = "--by-grid" in sys.argv[1:]
    args = [a for a in sys.argv[1:] if a != "--by-grid"]
    if not args:
        raise SystemExit(__doc__)
    path = args[0]
    first = args[1] if len(args) > 1 else "embed"
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
    by = collections.defaultdict(list)
    grids = {}
    for k, us, g in last:
        key = (k, g) if by_grid else k
        by[key].append(us)
        grids[key] = g
    total = sum(us for _, us, _ in last)
    print(f"{len(last)} launches, {total:.1f} µs in all")
    if by_grid:
        print("| kernel | grid | launches | µs | µs each | fastest | slowest |")
        print("|---|---|---:|---:|---:|---:|---:|")
    else:
        print("| kernel | launches | µs | µs each | last grid |")
        print("|---|---:|---:|---:|---|")
    for key, times in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        n, us = len(times), sum(times)
        if by_grid:
            print(f"| {key[0]} | {key[1]} | {n} | {us:.1f} | {us / n:.1f} | {min(times):.1f} | "
                  f"{max(times):.1f} |")
        else:
            print(f"| {key} | {n} | {us:.1f} | {us / n:.1f} | {grids[key]} |")


if __name__ == "__main__":
    main()
