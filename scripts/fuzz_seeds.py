#!/usr/bin/env python3
"""Writes the seed corpus of brook's fuzz targets (fuzz/corpus/TARGET/) from the test fixtures.

Run from the repository root after a fixture changes: `python3 scripts/fuzz_seeds.py`. The
seeds are small valid (and a few nearly valid) inputs; libFuzzer and the seeded CI run in
crates/brook-fuzz mutate them. Files libFuzzer adds to the corpus are kept beside them.
"""
import gzip
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
OUT = ROOT / "fuzz" / "corpus"


def put(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, meta=None):
    header, blobs, off = {}, [], 0
    if meta:
        header["__metadata__"] = meta
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


put("safetensors", "two", safetensors([("a", "F32", [2], b"\0" * 8), ("b", "BF16", [1, 3], b"\1" * 6)], {"format": "mlx"}))
put("safetensors", "quant", safetensors([("w", "U32", [2, 1], b"\2" * 8), ("w.scales", "F16", [2, 1], b"\3" * 4), ("w.biases", "F16", [2, 1], b"\4" * 4)]))
put("safetensors", "empty", safetensors([]))
# The real header of a fixture shard, with its data cut short.
shard = (FIX / "next-q4" / "model-00003-of-00003.safetensors").read_bytes()
hl = struct.unpack("<Q", shard[:8])[0]
put("safetensors", "fixture-header", shard[: 8 + hl + 64])

for fx in ["next-q4", "qwen35-q4", "next-mixed"]:
    put("config", fx, (FIX / fx / "config.json").read_bytes())

tok = json.loads(gzip.decompress((FIX / "tokenizers" / "qwen3.6" / "tokenizer.json.gz").read_bytes()))
# A small tokenizer of the same kind: the first 300 vocabulary entries and merges that stay in it.
vocab = {k: v for k, v in tok["model"]["vocab"].items() if v < 300}
merges = []
for m in tok["model"]["merges"]:
    a, b = m if isinstance(m, list) else m.split(" ")
    if a in vocab and b in vocab and a + b in vocab:
        merges.append([a, b])
small = dict(tok)
small["model"] = dict(tok["model"], vocab=vocab, merges=merges)
small["added_tokens"] = [dict(t, id=300 + i) for i, t in enumerate(tok["added_tokens"][:6])]
put("tokenizer", "small-bpe", json.dumps(small, ensure_ascii=False))

for name in ["qwen3", "qwen3.6"]:
    d = FIX / "templates" / name
    src = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").exists() else json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    put("template_source", name, src)
put("template_source", "loops", "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.role }}:{{ m.content|tojson }}{% endfor %}{{ ns.n }}")

cases = json.loads((FIX / "templates" / "qwen3.6" / "cases.json").read_text())
for i, c in enumerate(cases[:12]):
    put("template_inputs", f"case-{i}", json.dumps({"messages": c["messages"], "tools": c.get("tools"), "kwargs": c.get("kwargs", {})}, ensure_ascii=False))

chat = [
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "x"}]},
                  {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                  {"role": "tool", "tool_call_id": "c", "content": "3"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
     "chat_template_kwargs": {"enable_thinking": False}, "stop": ["\n\n"], "seed": 3, "top_k": 20, "min_p": 0.1},
]
for i, b in enumerate(chat):
    put("chat_request", f"body-{i}", json.dumps(b))
for i, b in enumerate([{"prompt": "The capital of France is", "max_tokens": 8, "echo": True},
                       {"prompt": [[1, 2, 3]], "max_tokens": 2, "stop": "x", "logprobs": 0}]):
    put("completion_request", f"body-{i}", json.dumps(b))

ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
words = [v for k, v in list(tok["model"]["vocab"].items())[1000:1040]]
seq = [ids.get("<think>", 0)] + words[:10] + [ids.get("</think>", 0)] + words[10:20] + [ids.get("<tool_call>", 0)] + words[20:30] + [ids.get("</tool_call>", 0)]
put("text_stream", "think-and-call", b"".join(struct.pack("<I", i) for i in seq))
put("text_stream", "plain", b"".join(struct.pack("<I", i) for i in words))
# manifest/fixture is the manifest of `brook repack tests/fixtures/next-q4 OUT` (the target
# opens it beside that container's files); rewrite it by hand after a container format change.
print("corpus written to", OUT)
