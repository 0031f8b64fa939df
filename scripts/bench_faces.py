#!/usr/bin/env python3
"""Every face a user runs against `brook bench`, on one model and budget, in one sitting.

Usage:
    python3 scripts/bench_faces.py --model DIR --memory-budget 3GiB [--brook target/release/brook]
        [-p 512] [-n 128] [--rounds 1] [--backend cpu] [-- extra brook flags]

Runs, in turn and `--rounds` times (alternating the programs): `brook bench -p P -n N -d P -r 1`
(its decode after P tokens of context, as the faces decode after their P-token prompt);
`brook generate --prompt-tokens <P ids> --max-tokens N --ignore-eos --json`; the same with a
text prompt of about P tokens (`--prompt TEXT`: the conversation path, template, snapshot and
text stream, without a terminal); `brook serve` with
scripts/bench_serve.py (the official openai client, streamed) against it; `brook chat` driven
through stdin with a prompt of about P tokens and `/stats`. Prints one table: decode tok/s and
time to first token of each face, and each face's ratio to bench's. The python running this
needs the `openai` package for the serve row (crates/brook-server/tests/python/requirements.txt).
Builds nothing; run nothing else meanwhile.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def bench(a, common):
    # `-d p`: the decode test runs after p tokens of context, as the faces decode after their
    # p-token prompt (attention reads p more positions a token).
    out = run([a.brook, "bench", *common, "-p", str(a.p), "-n", str(a.n), "-d", str(a.p),
               "-r", "1", "--disk-secs", "0", "--json"])
    row = json.loads(out.strip().splitlines()[-1])
    return {"decode": row["tg_tok_s"], "ttft": row["ttft_s"], "engine": row.get("backend")}


def generate(a, common, ids):
    out = run([a.brook, "generate", *common, "--prompt-tokens", ",".join(map(str, ids)),
               "--max-tokens", str(a.n), "--temperature", "0", "--ignore-eos", "--json"])
    v = json.loads(out)
    return {"decode": v["decode_tok_s"], "ttft": v["ttft_s"], "engine": v["engine"]["engine"],
            "peak_rss": v["peak_rss_bytes"]}


def serve(a, common):
    p = subprocess.Popen([a.brook, "serve", *common, "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
        m = re.search(r"http://([0-9.:]+)/", line)
        if not m:
            sys.exit(f"brook serve printed no address: {line!r}")
        out = run([sys.executable, os.path.join(HERE, "bench_serve.py"), "--base-url",
                   f"http://{m.group(1)}/v1", "--prompt-tokens", str(a.p), "--max-tokens",
                   str(a.n), "-r", "1", "--json"])
        v = json.loads(out)
        import urllib.request
        health = json.load(urllib.request.urlopen(f"http://{m.group(1)}/health"))
        return {"decode": v["decode_tok_s"], "ttft": v["ttft_s"],
                "engine": health["engine"]["engine"]}
    finally:
        p.kill()
        p.wait()


def generate_text(a, common, text):
    # The conversation path (template, snapshot, text stream) without a terminal.
    out = run([a.brook, "generate", *common, "--prompt", text, "--max-tokens", str(a.n),
               "--temperature", "0", "--ignore-eos", "--json"])
    v = json.loads(out)
    return {"decode": v["decode_tok_s"], "ttft": v["ttft_s"], "engine": v["engine"]["engine"],
            "prompt_tokens": v["prompt_tokens"]}


def chat(a, common, text):
    out = run([a.brook, "chat", *common, "--max-tokens", str(a.n), "--temperature", "0",
               "--ignore-eos"], input=f"{text}\n/stats\n")
    m = re.search(r"prompt (\d+) tokens \((\d+) reused\) at ([0-9.]+) tok/s; answer (\d+) "
                  r"tokens at ([0-9.]+) tok/s.*the (\w+) engine", out)
    if not m:
        sys.exit(f"no /stats line in chat's output:\n{out[-2000:]}")
    prompt, rate = int(m.group(1)), float(m.group(3))
    return {"decode": float(m.group(5)), "ttft": prompt / rate, "engine": m.group(6),
            "prompt_tokens": prompt}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-budget", required=True)
    ap.add_argument("--brook", default="target/release/brook")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    common = ["--model", a.model, "--memory-budget", a.memory_budget, "--backend", a.backend,
              *a.extra]
    rng = random.Random(7)
    ids = [rng.randrange(150000) for _ in range(a.p)]
    # About p tokens of English-like text (the template adds a few).
    words = ["river", "stone", "light", "water", "cloud", "green", "north", "quiet", "table",
             "paper", "seven", "music", "field", "glass", "storm", "bread"]
    text = " ".join(rng.choice(words) for _ in range(a.p - 16))
    faces = {"bench": [], "generate": [], "generate-text": [], "serve": [], "chat": []}
    for _ in range(a.rounds):
        faces["bench"].append(bench(a, common))
        faces["generate"].append(generate(a, common, ids))
        faces["generate-text"].append(generate_text(a, common, text))
        faces["serve"].append(serve(a, common))
        faces["chat"].append(chat(a, common, text))
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip()
    simd = subprocess.run(["sh", "-c", "grep -o 'avx512[a-z_]*' /proc/cpuinfo | sort -u | "
                           "tr '\\n' ' '"], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    print(f"model {os.path.basename(a.model.rstrip('/'))}, budget {a.memory_budget}, "
          f"backend {a.backend}, -p {a.p} -n {a.n}, {a.rounds} round(s); {cpu}; "
          f"AVX-512: {simd or 'none'}; {time.strftime('%Y-%m-%d')}; commit {commit}")
    b_dec = sum(r["decode"] for r in faces["bench"]) / len(faces["bench"])
    b_ttft = sum(r["ttft"] for r in faces["bench"]) / len(faces["bench"])
    print("| face | engine | decode tok/s | × bench | time to first token s | × bench |")
    print("|---|---|---:|---:|---:|---:|")
    for name, rows in faces.items():
        dec = sum(r["decode"] for r in rows) / len(rows)
        ttft = sum(r["ttft"] for r in rows) / len(rows)
        note = f" ({rows[0]['prompt_tokens']}-token prompt)" if "prompt_tokens" in rows[0] else ""
        print(f"| {name} | {rows[0]['engine']} | {dec:.2f} | {dec / b_dec:.2f} | "
              f"{ttft:.2f}{note} | {ttft / b_ttft:.2f} |")
    print(json.dumps(faces), file=sys.stderr)


if __name__ == "__main__":
    main()
