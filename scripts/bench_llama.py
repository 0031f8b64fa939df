#!/usr/bin/env python3
"""brook against llama.cpp on the CPU, side by side in one sitting, with ratios.

Builds nothing. Give it a `llama-bench` built from llama.cpp's public source (a CPU Release
build; for an AVX2-only row on an AVX-512 machine build it with `-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON` and pass `--simd avx2`, which sets BROOK_SIMD for
brook), a GGUF with the model's shapes (`../shared/tools/gguf_synth.py`), and a brook container
of the same model. For each round it runs llama-bench, then `brook bench` at each precision,
alternating, and prints one table (markdown) with the machine, its SIMD flags, the date and
brook's commit, each run's prefill and decode speeds, brook's own decode limit, and the
ratios to llama.cpp of the same round.

    python3 scripts/bench_llama.py --llama-bench ~/llama.cpp/build/bin/llama-bench \\
        --gguf q35moe-35b-q4_0.gguf --model ~/.cache/brook/synth/qwen3.6-35b-a3b-4bit \\
        --threads 2 --rounds 2 [--simd avx2] [--precision exact,fast]

Do not run compilers or other work while it measures.
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_info():
    model, flags = "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = sorted(f for f in flags if f.startswith("avx512") or f in ("avx2", "avx_vnni", "fma"))
    return model, simd


def commit(brook):
    """The commit the brook binary was built from (`brook --version` names it), not the
    tree's: the binary may come from another build."""
    try:
        out = subprocess.run([brook, "--version"], capture_output=True, text=True, check=True)
        return out.stdout.strip().rsplit("(", 1)[-1].rstrip(")") or "?"
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run_llama(a):
    cmd = [a.llama_bench, "-m", a.gguf, "-t", str(a.threads), "-p", str(a.prompt),
           "-n", str(a.gen), "-r", str(a.reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    # llama-bench prints a JSON array; some builds print log lines around it.
    text = out.stdout[out.stdout.index("["):out.stdout.rindex("]") + 1]
    pp = tg = None
    for rec in json.loads(text):
        if rec.get("n_prompt", 0) > 0 and rec.get("n_gen", 0) == 0:
            pp = rec["avg_ts"]
        elif rec.get("n_gen", 0) > 0 and rec.get("n_prompt", 0) == 0:
            tg = rec["avg_ts"]
    build = None
    recs = json.loads(text)
    if recs:
        build = recs[0].get("build_commit")
    return {"pp": pp, "tg": tg, "build": build}


def run_brook(a, precision):
    env = dict(os.environ)
    if a.simd:
        env["BROOK_SIMD"] = a.simd
    cmd = [a.brook, "bench", "--model", a.model, "--memory-budget", a.memory_budget,
           "--threads", str(a.threads), "--precision", precision, "-p", str(a.prompt),
           "-n", str(a.gen), "-r", str(a.reps), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"brook bench failed ({out.returncode}): {out.stderr[-2000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"pp": row["pp_tok_s"], "tg": row["tg_tok_s"], "limit": row.get("limit_tok_s"),
            "simd": row.get("simd", "?")}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bench", required=True)
    p.add_argument("--gguf", required=True)
    p.add_argument("--model", required=True, help="brook container of the same model")
    p.add_argument("--brook", default=str(ROOT / "target" / "release" / "brook"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("-p", "--prompt", type=int, default=512)
    p.add_argument("-n", "--gen", type=int, default=128)
    p.add_argument("-r", "--reps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--precision", default="exact,fast")
    p.add_argument("--simd", default="", help="BROOK_SIMD for brook (e.g. avx2)")
    p.add_argument("--memory-budget", default="22GiB", help="22GiB holds the 35B resident")
    a = p.parse_args()
    for f in (a.llama_bench, a.gguf, a.model, a.brook):
        if not Path(f).exists():
            sys.exit(f"{f}: not found")

    model, flags = cpu_info()
    when = datetime.date.today().isoformat()
    rev = commit(a.brook)
    print(f"# {model}; SIMD flags: {' '.join(flags) or 'none'}; {when}; brook {rev}; "
          f"{a.threads} threads; -p {a.prompt} -n {a.gen} -r {a.reps}; BROOK_SIMD={a.simd or '(detected)'}")
    print()
    precs = [x for x in a.precision.split(",") if x]
    head = ["round", "llama.cpp tg", "llama.cpp pp"]
    for pr in precs:
        head += [f"brook {pr} tg", f"× llama", f"/ limit", f"brook {pr} pp", f"× llama"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in range(1, a.rounds + 1):
        llama = run_llama(a)
        cells = [str(r), f"{llama['tg']:.2f}", f"{llama['pp']:.1f}"]
        simd = "?"
        for pr in precs:
            b = run_brook(a, pr)
            simd = b["simd"]
            lim = f"{b['tg'] / b['limit']:.2f}" if b.get("limit") else "–"
            cells += [f"{b['tg']:.2f}", f"{b['tg'] / llama['tg']:.2f}", lim,
                      f"{b['pp']:.1f}", f"{b['pp'] / llama['pp']:.2f}"]
        print("| " + " | ".join(cells) + " |", flush=True)
    print()
    print(f"brook kernels: {simd}; llama.cpp build {llama.get('build') or '?'}")


if __name__ == "__main__":
    main()
