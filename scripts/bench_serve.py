#!/usr/bin/env python3
"""Speed of `brook serve` as an OpenAI client sees it: streamed completions, one at a time
or `--concurrency N` at once.

Usage:
    python3 scripts/bench_serve.py --base-url http://127.0.0.1:PORT/v1 \
        --prompt-tokens 512 --max-tokens 128 [-r 2] [--concurrency N] [--json]

With `--concurrency N`, each repetition starts N streams together (a process and a client
each, so that parsing the chunks does not queue on one interpreter's lock) and reports the
aggregate rate: all completion tokens over the wall time from the
first request sent to the last token received; then, while N-1 streams decode, it sends one
more request and reports its time to first token.

Needs the `openai` package (crates/brook-server/tests/python/requirements.txt pins it). The
prompt is `--prompt-tokens` random token ids sent to /v1/completions (a list of ids is a valid
OpenAI prompt), so its length is exact; `ignore_eos` (vLLM's extension, which brook takes)
makes the reply exactly `--max-tokens` tokens. Per run it prints the time to the first
streamed token and the decode rate after it: (completion tokens - 1) / (time of the last
chunk - time of the first), both on the client's clock, over HTTP and SSE. Compare with
`brook bench -p N -n M` on the same model and budget.
"""

import argparse
import json
import random
import statistics
import time

from openai import OpenAI


def one(client, model, prompt, max_tokens):
    t0 = time.perf_counter()
    first = last = None
    usage = None
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = now
            last = now
        if chunk.usage is not None:
            usage = chunk.usage
    if first is None or usage is None:
        raise SystemExit("the stream carried no text or no usage")
    n = usage.completion_tokens
    decode = (n - 1) / max(last - first, 1e-9)
    return {"ttft_s": first - t0, "decode_tok_s": decode, "completion_tokens": n,
            "prompt_tokens": usage.prompt_tokens}


def _stream(args):
    """One stream in a process of its own (`together`): its result with its start and end
    on the system's monotonic clock, which every process shares."""
    base_url, model, prompt, max_tokens = args
    c = OpenAI(base_url=base_url, api_key="none", timeout=3600)
    t0 = time.monotonic()
    r = one(c, model, prompt, max_tokens)
    r["start"], r["end"] = t0, time.monotonic()
    return r


def _pool(n):
    # A process per stream: threads of one interpreter share its lock, and parsing the
    # streamed chunks then caps the aggregate (about 450 tok/s on the GPU machine's host,
    # 2,300 on dev-2c, against 10,000 that curl took from the same server).
    import multiprocessing
    return multiprocessing.get_context("fork").Pool(n)


def together(base_url, model, prompts, max_tokens):
    """Streams all `prompts` at once, a process each; the aggregate rate and each stream's
    result."""
    with _pool(len(prompts)) as pool:
        pool.map(abs, range(len(prompts)))   # the processes are up before the clock starts
        t0 = time.monotonic()
        out = pool.map(_stream, [(base_url, model, p, max_tokens) for p in prompts])
    wall = max(r["end"] for r in out) - t0
    tokens = sum(r["completion_tokens"] for r in out)
    return {"aggregate_tok_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "mean_stream_decode_tok_s": statistics.mean(r["decode_tok_s"] for r in out),
            "max_ttft_s": max(r["ttft_s"] for r in out)}


def ttft_beside(base_url, model, prompts, prompt, max_tokens):
    """Time to first token of `prompt` sent while `prompts` stream (started first, a process
    each), once every one of them has streamed text for a second."""
    with _pool(len(prompts)) as pool:
        pending = pool.map_async(_stream, [(base_url, model, p, max_tokens) for p in prompts])
        c = OpenAI(base_url=base_url, api_key="none", timeout=3600)
        # Wait until the server runs them all: its /health counts the requests running.
        health = base_url.rsplit("/v1", 1)[0] + "/health"
        import urllib.request
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not pending.ready():
            h = json.loads(urllib.request.urlopen(health).read())
            if h.get("running", 0) >= len(prompts):
                break
            time.sleep(0.05)
        time.sleep(1.0)
        r = one(c, model, prompt, 4)
        pending.get()
    return r["ttft_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=150000, help="draw prompt ids below this")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--aggregate", action="store_true",
                    help="report the aggregate rate (tokens over wall time, prefill included) "
                         "even for one stream, to compare with --concurrency N")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key="none", timeout=3600)
    model = client.models.list().data[0].id
    rng = random.Random(1)
    # Warm-up, as brook bench does.
    one(client, model, [rng.randrange(a.vocab) for _ in range(8)], 2)
    rows = []
    if a.concurrency > 1 or a.aggregate:
        n = a.concurrency
        for _ in range(a.repetitions):
            prompts = [[rng.randrange(a.vocab) for _ in range(a.prompt_tokens)] for _ in range(n)]
            r = together(a.base_url, model, prompts, a.max_tokens)
            prompts = [[rng.randrange(a.vocab) for _ in range(a.prompt_tokens)] for _ in range(n)]
            r["ttft_beside_s"] = (ttft_beside(a.base_url, model, prompts[:-1], prompts[-1],
                                              a.max_tokens) if n > 1 else r["max_ttft_s"])
            rows.append(r)
            if not a.json:
                print(f"{n} streams: aggregate {r['aggregate_tok_s']:.2f} tok/s "
                      f"({r['tokens']} tokens in {r['wall_s']:.1f} s, per stream "
                      f"{r['mean_stream_decode_tok_s']:.2f}), ttft of one more beside "
                      f"{n - 1} decoding: {r['ttft_beside_s']:.2f} s")
        summary = {"concurrency": n,
                   "aggregate_tok_s": statistics.mean(r["aggregate_tok_s"] for r in rows),
                   "ttft_beside_s": statistics.mean(r["ttft_beside_s"] for r in rows),
                   "runs": rows}
        print(json.dumps(summary) if a.json else
              f"mean: aggregate {summary['aggregate_tok_s']:.2f} tok/s, "
              f"ttft beside {summary['ttft_beside_s']:.2f} s")
        return
    for _ in range(a.repetitions):
        prompt = [rng.randrange(a.vocab) for _ in range(a.prompt_tokens)]
        r = one(client, model, prompt, a.max_tokens)
        rows.append(r)
        if not a.json:
            print(f"ttft {r['ttft_s']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s "
                  f"({r['prompt_tokens']} prompt, {r['completion_tokens']} generated)")
    summary = {
        "ttft_s": statistics.mean(r["ttft_s"] for r in rows),
        "decode_tok_s": statistics.mean(r["decode_tok_s"] for r in rows),
        "runs": rows,
    }
    print(json.dumps(summary) if a.json else
          f"mean: ttft {summary['ttft_s']:.2f} s, decode {summary['decode_tok_s']:.2f} tok/s")


if __name__ == "__main__":
    main()
