#!/usr/bin/env python3
"""Generate brook's reference fixtures under tests/fixtures/ with mlx / mlx-lm.

What it makes (everything under tests/fixtures/ is deleted and rebuilt):

* Eight tiny random MLX checkpoints, one folder each:
  next-{f32,q4,q8,mixed}    model_type qwen3_next   (flat config)
  qwen35-{f32,q4,q8,mixed}  model_type qwen3_5_moe  (nested text_config)
  Each is produced the way `mlx_lm.convert` produces a checkpoint:
    1. a random *Hugging Face layout* checkpoint (zero-centred norm offsets,
       conv1d [C, 1, K], per-expert / fused-expert tensors, plus a few
       `mtp.*` and `model.visual.*` tensors) is written to a temp folder
       together with its config.json and generation_config.json;
    2. it is loaded with `mlx_lm.utils.load_model`, which runs the model's own
       `sanitize` (expert stacking/splitting, conv axis move, +1 on the
       zero-centred norms, `language_model.` prefix, dropping mtp/vision);
    3. float parameters are cast to the target dtype exactly as convert does
       (including the model's `cast_predicate`);
    4. quantized variants go through `mlx_lm.utils.quantize_model` (the
       model's own `quant_predicate` for q4/q8, a per-module recipe for mixed);
    5. `mlx_lm.utils.save_model` + `save_config` write the folder
       (next-q4 and qwen35-f32 are split into several shards with mlx-lm's
       own `make_shards`, given a small size limit).
  Tokenizer files and the README model card that convert also writes are not
  produced (there is no tokenizer for a random vocabulary).

* Per model folder, `reference.safetensors` + `reference.json`: float32 CPU
  forward passes of the *stored* checkpoint (loaded back with mlx-lm, every
  floating parameter cast to float32, packed uint32 left alone): per-layer
  hidden states, logits, prefill+decode logits, and a 16-token greedy
  continuation with its top1-top2 margins.

* `quant/quant.safetensors`: mx.quantize / dequantize / quantized_matmul
  vectors for bits {2,3,4,5,6,8} x group sizes {32,64,128}, plus a bf16 case.

Run (from the repository root):

    python3 -m venv .venv-fixtures
    .venv-fixtures/bin/pip install -r scripts/requirements-fixtures.txt
    .venv-fixtures/bin/python scripts/make_fixtures.py

Everything is seeded; two runs give byte-identical files (with the pinned
versions, on CPU). See tests/fixtures/README.md for the file-by-file layout.
"""

import os

# Keep CPU use modest and the arithmetic reproducible.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse
import copy
import functools
import json
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

import mlx.core as mx
import mlx_lm
import mlx_lm.utils as mlu
from mlx.utils import tree_flatten, tree_map, tree_map_with_path
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

mx.set_default_device(mx.cpu)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

PROMPT_LEN = 20
PREFILL_LEN = 12
GEN_LEN = 16
MIN_MARGIN = 1e-3
BASE_PROMPT_SEED = 20250101

# --------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------

H = 128  # hidden_size
N_LAYERS = 4
NQ, NKV, HD = 4, 2, 64  # attention heads, kv heads, head_dim
NK, NV, DK, DV = 2, 8, 32, 48  # DeltaNet key heads, value heads, dims
CONV_K = 4
N_EXP, TOPK, MOE_I, SHARED_I = 8, 3, 64, 96
ROPE_THETA = 10000
PARTIAL_ROTARY = 0.25
EPS = 1e-6

ARCHS = {
    "next": dict(vocab=1001, bos=998, eos=1000, gen_eos=[1000, 998], seed=1),
    "qwen35": dict(vocab=1003, bos=1000, eos=1000, gen_eos=[1002, 1000], seed=2),
}


def source_config(arch, dtype):
    """The HF-style config.json of the (random) source checkpoint."""
    a = ARCHS[arch]
    if arch == "next":
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": a["bos"],
            "decoder_sparse_step": 1,
            "eos_token_id": a["eos"],
            "full_attention_interval": 2,
            "head_dim": HD,
            "hidden_act": "silu",
            "hidden_size": H,
            "initializer_range": 0.02,
            "intermediate_size": 192,
            "linear_conv_kernel_dim": CONV_K,
            "linear_key_head_dim": DK,
            "linear_num_key_heads": NK,
            "linear_num_value_heads": NV,
            "linear_value_head_dim": DV,
            "max_position_embeddings": 4096,
            "mlp_only_layers": [],
            "model_type": "qwen3_next",
            "moe_intermediate_size": MOE_I,
            "norm_topk_prob": True,
            "num_attention_heads": NQ,
            "num_experts": N_EXP,
            "num_experts_per_tok": TOPK,
            "num_hidden_layers": N_LAYERS,
            "num_key_value_heads": NKV,
            "output_router_logits": False,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "rms_norm_eps": EPS,
            "rope_scaling": None,
            "rope_theta": ROPE_THETA,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": SHARED_I,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "transformers_version": "4.57.0.dev0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": a["vocab"],
        }
    # Qwen3.5 MoE: nested, like Qwen3.5/3.6-35B-A3B's config.json.
    # norm_topk_prob is absent on purpose (real configs omit it; mlx-lm
    # defaults it to true).
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
        for i in range(N_LAYERS)
    ]
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 997,
        "model_type": "qwen3_5_moe",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "bos_token_id": a["bos"],
            "dtype": dtype,
            "eos_token_id": a["eos"],
            "full_attention_interval": 4,
            "head_dim": HD,
            "hidden_act": "silu",
            "hidden_size": H,
            "initializer_range": 0.02,
            "layer_types": layer_types,
            "linear_conv_kernel_dim": CONV_K,
            "linear_key_head_dim": DK,
            "linear_num_key_heads": NK,
            "linear_num_value_heads": NV,
            "linear_value_head_dim": DV,
            "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 4096,
            "model_type": "qwen3_5_moe_text",
            "moe_intermediate_size": MOE_I,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "num_attention_heads": NQ,
            "num_experts": N_EXP,
            "num_experts_per_tok": TOPK,
            "num_hidden_layers": N_LAYERS,
            "num_key_value_heads": NKV,
            "output_router_logits": False,
            "rms_norm_eps": EPS,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [3, 3, 2],
                "partial_rotary_factor": PARTIAL_ROTARY,
                "rope_theta": ROPE_THETA,
                "rope_type": "default",
            },
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": SHARED_I,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": a["vocab"],
        },
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 998,
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "model_type": "qwen3_5_moe",
            "num_heads": 2,
            "out_hidden_size": H,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": 996,
        "vision_start_token_id": 995,
    }


def generation_config(arch):
    a = ARCHS[arch]
    return {
        "bos_token_id": a["bos"],
        "do_sample": False,
        "eos_token_id": a["gen_eos"],
        "pad_token_id": a["eos"],
    }


# --------------------------------------------------------------------------
# Random source weights (Hugging Face layout)
# --------------------------------------------------------------------------


class Rand:
    """Seeded generator: every tensor gets its own key from (seed, name)."""

    def __init__(self, seed):
        self.seed = seed

    def key(self, name):
        return mx.random.key(zlib.crc32(f"{self.seed}:{name}".encode()))

    def normal(self, name, shape, std, mean=0.0):
        x = mx.random.normal(shape, key=self.key(name))
        return (mean + std * x).astype(mx.float32)

    def uniform(self, name, shape, lo, hi):
        return mx.random.uniform(lo, hi, shape, key=self.key(name)).astype(
            mx.float32
        )

    def linear(self, name, out_dim, in_dim, gain=1.0):
        # N(0, gain^2 / in_features): keeps activations O(1).
        return self.normal(name, (out_dim, in_dim), gain / in_dim**0.5)

    def zc_norm(self, name, dim):
        # HF zero-centred RMSNorm weight: the offset w in x * (1 + w).
        return self.normal(name, (dim,), 0.1)


ROUTER_GAIN = 3.0  # router logits ~ N(0, 9): expert choice is never a near-tie
LM_HEAD_GAIN = 2.0  # logits ~ N(0, 4): clear greedy margins


def hf_weights(arch):
    """Random float32 weights with Hugging Face names and layouts."""
    r = Rand(ARCHS[arch]["seed"])
    V = ARCHS[arch]["vocab"]
    interval = 2 if arch == "next" else 4
    pre = "model." if arch == "next" else "model.language_model."
    key_dim, value_dim = NK * DK, NV * DV
    conv_dim = 2 * key_dim + value_dim
    w = {}

    def add(name, arr):
        w[name] = arr

    add(pre + "embed_tokens.weight", r.normal(pre + "embed_tokens.weight", (V, H), 1.0))
    for i in range(N_LAYERS):
        p = f"{pre}layers.{i}."
        add(p + "input_layernorm.weight", r.zc_norm(p + "input_layernorm.weight", H))
        add(
            p + "post_attention_layernorm.weight",
            r.zc_norm(p + "post_attention_layernorm.weight", H),
        )
        if (i + 1) % interval != 0:
            la = p + "linear_attn."
            if arch == "next":
                add(
                    la + "in_proj_qkvz.weight",
                    r.linear(la + "in_proj_qkvz", 2 * key_dim + 2 * value_dim, H),
                )
                add(la + "in_proj_ba.weight", r.linear(la + "in_proj_ba", 2 * NV, H))
            else:
                add(
                    la + "in_proj_qkv.weight",
                    r.linear(la + "in_proj_qkv", 2 * key_dim + value_dim, H),
                )
                add(la + "in_proj_z.weight", r.linear(la + "in_proj_z", value_dim, H))
                add(la + "in_proj_b.weight", r.linear(la + "in_proj_b", NV, H))
                add(la + "in_proj_a.weight", r.linear(la + "in_proj_a", NV, H))
            # HF depthwise conv layout [C, 1, K]
            add(
                la + "conv1d.weight",
                r.normal(la + "conv1d", (conv_dim, 1, CONV_K), CONV_K**-0.5),
            )
            add(la + "A_log", r.uniform(la + "A_log", (NV,), 0.0, 1.5))
            add(la + "dt_bias", r.uniform(la + "dt_bias", (NV,), -1.5, 0.5))
            # Gated norm: plain weight (not zero-centred), around 1.
            add(la + "norm.weight", r.normal(la + "norm", (DV,), 0.1, mean=1.0))
            add(la + "out_proj.weight", r.linear(la + "out_proj", H, value_dim))
        else:
            sa = p + "self_attn."
            add(sa + "q_proj.weight", r.linear(sa + "q_proj", NQ * HD * 2, H))
            add(sa + "k_proj.weight", r.linear(sa + "k_proj", NKV * HD, H))
            add(sa + "v_proj.weight", r.linear(sa + "v_proj", NKV * HD, H))
            add(sa + "o_proj.weight", r.linear(sa + "o_proj", H, NQ * HD))
            add(sa + "q_norm.weight", r.zc_norm(sa + "q_norm", HD))
            add(sa + "k_norm.weight", r.zc_norm(sa + "k_norm", HD))
        m = p + "mlp."
        add(m + "gate.weight", r.linear(m + "gate", N_EXP, H, gain=ROUTER_GAIN))
        if arch == "next":
            for e in range(N_EXP):
                ep = f"{m}experts.{e}."
                add(ep + "gate_proj.weight", r.linear(ep + "gate_proj", MOE_I, H))
                add(ep + "up_proj.weight", r.linear(ep + "up_proj", MOE_I, H))
                add(ep + "down_proj.weight", r.linear(ep + "down_proj", H, MOE_I))
        else:
            # Fused, no ".weight" suffix: gate rows then up rows.
            add(
                m + "experts.gate_up_proj",
                r.normal(m + "experts.gate_up_proj", (N_EXP, 2 * MOE_I, H), H**-0.5),
            )
            add(
                m + "experts.down_proj",
                r.normal(m + "experts.down_proj", (N_EXP, H, MOE_I), MOE_I**-0.5),
            )
        s = m + "shared_expert."
        add(s + "gate_proj.weight", r.linear(s + "gate_proj", SHARED_I, H))
        add(s + "up_proj.weight", r.linear(s + "up_proj", SHARED_I, H))
        add(s + "down_proj.weight", r.linear(s + "down_proj", H, SHARED_I))
        add(m + "shared_expert_gate.weight", r.linear(m + "shared_expert_gate", 1, H))
    add(pre + "norm.weight", r.zc_norm(pre + "norm.weight", H))
    add("lm_head.weight", r.linear("lm_head", V, H, gain=LM_HEAD_GAIN))

    # Tensors that mlx-lm's sanitize drops: MTP head (both families) and,
    # for Qwen3.5, the vision tower.
    add("mtp.fc.weight", r.linear("mtp.fc", H, 2 * H))
    add("mtp.norm.weight", r.zc_norm("mtp.norm", H))
    add("mtp.pre_fc_norm_embedding.weight", r.zc_norm("mtp.pre_fc_norm_embedding", H))
    if arch == "qwen35":
        add(
            "model.visual.patch_embed.proj.weight",
            r.normal("model.visual.patch_embed", (32, 3, 2, 4, 4), 0.1),
        )
        add("model.visual.blocks.0.norm1.weight", r.normal("model.visual.n1", (32,), 0.1, 1.0))
    return w


# --------------------------------------------------------------------------
# Conversion (mirrors mlx_lm.convert)
# --------------------------------------------------------------------------


def mixed_predicate(path, module):
    """Per-module recipe for the *-mixed fixtures.

    Returning True means "use quantize_model's default group/bits" (and no
    per-module entry is written to config.json); a dict is written as a
    per-module override.
    """
    aff = lambda g, b: {"group_size": g, "bits": b, "mode": "affine"}  # noqa: E731
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return aff(64, 8)  # routers
    if ".switch_mlp." in path:
        return aff(32, 3)  # routed experts
    if ".shared_expert." in path:
        return aff(32, 2)
    if ".self_attn." in path:
        return aff(128, 6)
    if ".linear_attn." in path:
        if path.endswith(("in_proj_ba", "in_proj_a", "in_proj_b")):
            return True  # falls back to the default (4 bits)
        return aff(64, 5)
    if path.endswith("embed_tokens"):
        return aff(32, 8)
    if path.endswith("lm_head"):
        return aff(64, 6)
    return True


# precision -> (dtype, quantization args or None)
PRECISIONS = {
    "f32": ("float32", None),
    "q4": ("bfloat16", dict(group_size=64, bits=4, quant_predicate=None)),
    "q8": ("bfloat16", dict(group_size=64, bits=8, quant_predicate=None)),
    # Defaults differ on purpose: with default group 64 mlx-lm leaves
    # shared_expert.down_proj (input 96) unquantized even though the recipe
    # asks for group 32; with default group 32 it is quantized.
    "mixed": None,
}
MIXED_DEFAULTS = {
    "next": dict(group_size=64, bits=4, quant_predicate=mixed_predicate),
    "qwen35": dict(group_size=32, bits=4, quant_predicate=mixed_predicate),
}

# Folders saved as several shards, and the shard size limit in bytes.
SHARDED = {"next-q4": 400_000, "qwen35-f32": 3_000_000}


class _ByteLimit(int):
    """mlx-lm's make_shards takes a size in GiB (`max_file_size_gb << 30`).

    This int subclass makes `<< 30` a no-op, so the limit is in bytes and the
    tiny fixtures are split with mlx-lm's own make_shards / save_model.
    """

    def __lshift__(self, other):
        return int(self)


def save_checkpoint(out_dir, model, shard_bytes=None):
    if shard_bytes is None:
        mlu.save_model(out_dir, model)
        return
    orig = mlu.make_shards
    mlu.make_shards = functools.partial(orig, max_file_size_gb=_ByteLimit(shard_bytes))
    try:
        mlu.save_model(out_dir, model)
    finally:
        mlu.make_shards = orig


def convert(arch, precision, out_dir, tmp_root):
    """Build one fixture folder the way `mlx_lm.convert` would."""
    if precision == "mixed":
        dtype, qargs = "bfloat16", MIXED_DEFAULTS[arch]
    else:
        dtype, qargs = PRECISIONS[precision]

    # 1. Source checkpoint in HF layout.
    src = Path(tmp_root) / f"src-{arch}-{precision}"
    src.mkdir(parents=True)
    with open(src / "config.json", "w") as f:
        json.dump(source_config(arch, dtype), f, indent=2)
    with open(src / "generation_config.json", "w") as f:
        json.dump(generation_config(arch), f, indent=2)
    mx.save_safetensors(str(src / "model.safetensors"), hf_weights(arch))

    # 2. Load (runs sanitize) exactly as convert's load() does.
    model, config = mlu.load_model(src)

    # 3. Cast floats to the conversion dtype (convert's set_dtype).
    mx_dtype = getattr(mx, dtype)
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(k, v):
        if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(mx_dtype)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))

    # 4. Quantize.
    if qargs is not None:
        model, config = mlu.quantize_model(
            model,
            config,
            qargs["group_size"],
            qargs["bits"],
            mode="affine",
            quant_predicate=qargs["quant_predicate"],
        )

    # 5. Save.
    name = out_dir.name
    save_checkpoint(out_dir, model, SHARDED.get(name))
    mlu.save_config(config, config_path=out_dir / "config.json")
    shutil.copy(src / "generation_config.json", out_dir / "generation_config.json")

    for k, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            assert bool(mx.all(mx.isfinite(v)).item()), f"non-finite {k}"


# --------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------


def to_float32(model):
    def f(x):
        return x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x

    model.update(tree_map(f, model.parameters()))
    mx.eval(model.parameters())


def text_model(model):
    """The module holding `.model` (embed/layers/norm) and `.lm_head`."""
    return model.language_model if hasattr(model, "language_model") else model


def layerwise(model, tokens):
    """Re-run the TextModel.__call__ loop, keeping every intermediate."""
    tm = text_model(model)
    inner = tm.model
    cache = model.make_cache()
    inputs = tokens[None]
    h = inner.embed_tokens(inputs)
    out = {"hidden.embed": h[0]}
    fa_mask = create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        mask = ssm_mask if layer.is_linear else fa_mask
        h = layer(h, mask=mask, cache=c)
        out[f"hidden.layer.{i}"] = h[0]
    normed = inner.norm(h)
    out["hidden.norm"] = normed[0]
    out["logits_from_layers"] = tm.lm_head(normed)[0]
    mx.eval(out)
    return out


def top2_margin(row):
    v = np.sort(np.asarray(row, dtype=np.float32))
    return float(v[-1] - v[-2])


def greedy(model, tokens):
    cache = model.make_cache()
    logits = model(tokens[None], cache=cache)[0, -1]
    gen, margins = [], []
    for step in range(GEN_LEN):
        mx.eval(logits)
        tok = int(mx.argmax(logits).item())
        gen.append(tok)
        margins.append(top2_margin(logits))
        if step + 1 < GEN_LEN:
            logits = model(mx.array([[tok]], dtype=mx.int32), cache=cache)[0, -1]
    return gen, margins


def mlx_lm_greedy(model, tokens):
    out = []
    for (tok, _), _n in zip(generate_step(tokens, model, max_tokens=GEN_LEN), range(GEN_LEN)):
        out.append(int(tok.item()) if hasattr(tok, "item") else int(tok))
    return out


def prefill_decode(model, tokens):
    cache = model.make_cache()
    rows = [model(tokens[None, :PREFILL_LEN], cache=cache)[0]]
    for t in range(PREFILL_LEN, PROMPT_LEN):
        rows.append(model(tokens[None, t : t + 1], cache=cache)[0])
    out = mx.concatenate(rows, axis=0)
    mx.eval(out)
    return out


def reference(folder, arch, precision, log):
    model, config = mlu.load_model(folder)
    to_float32(model)
    vocab = ARCHS[arch]["vocab"]
    seed = BASE_PROMPT_SEED
    tries = []
    while True:
        tokens = mx.random.randint(
            0, vocab, (PROMPT_LEN,), key=mx.random.key(seed)
        ).astype(mx.int32)
        gen, margins = greedy(model, tokens)
        if min(margins) >= MIN_MARGIN:
            break
        tries.append((seed, min(margins)))
        seed += 1

    lw = layerwise(model, tokens)
    logits = model(tokens[None], cache=model.make_cache())[0]
    mx.eval(logits)
    np_logits = np.asarray(logits)
    assert np.array_equal(np.asarray(lw["logits_from_layers"]), np_logits), (
        "layer-by-layer replay differs from the model's own forward"
    )
    pd = prefill_decode(model, tokens)
    np_pd = np.asarray(pd)
    pd_rel = float(np.max(np.abs(np_pd - np_logits)) / np.max(np.abs(np_logits)))
    assert gen[0] == int(np.argmax(np_logits[-1]))
    gen_lm = mlx_lm_greedy(model, tokens)
    assert gen_lm == gen, f"mlx-lm generate_step greedy {gen_lm} != {gen}"

    tensors = {
        "tokens": tokens,
        "hidden.embed": lw["hidden.embed"],
        **{f"hidden.layer.{i}": lw[f"hidden.layer.{i}"] for i in range(N_LAYERS)},
        "hidden.norm": lw["hidden.norm"],
        "logits": logits,
        "prefill_decode.logits": pd,
        "greedy": mx.array(gen, dtype=mx.int32),
        "greedy_margin": mx.array(margins, dtype=mx.float32),
    }
    for k, v in tensors.items():
        if mx.issubdtype(v.dtype, mx.floating):
            assert v.dtype == mx.float32, k
            assert bool(mx.all(mx.isfinite(v)).item()), f"non-finite {k}"
    mx.save_safetensors(str(folder / "reference.safetensors"), tensors)

    notes = (
        "float32 CPU forward of the stored checkpoint (loaded with "
        "mlx_lm.utils.load_model, all floating parameters incl. scales/biases "
        "cast to float32). hidden.layer.i = output of decoder layer i in one "
        f"full pass with a fresh cache. prefill_decode: {PREFILL_LEN} tokens "
        "in one call then one token at a time. greedy checked equal to "
        "mlx_lm.generate.generate_step with its own cache. "
        f"prompt = mx.random.randint(0, {vocab}, ({PROMPT_LEN},), "
        f"key=mx.random.key({seed}))."
    )
    if tries:
        notes += " Rejected prompt seeds (min margin < 1e-3): " + ", ".join(
            f"{s} ({m:.2e})" for s, m in tries
        )
    info = {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "arch": config["model_type"],
        "precision": precision,
        "prompt_len": PROMPT_LEN,
        "prefill_len": PREFILL_LEN,
        "prompt_seed": seed,
        "tokens": [int(t) for t in np.asarray(tokens)],
        "greedy": gen,
        "greedy_margin": [round(m, 6) for m in margins],
        "min_greedy_margin": round(min(margins), 6),
        "max_abs_logit": round(float(np.max(np.abs(np_logits))), 6),
        "prefill_decode_max_rel_err": pd_rel,
        "notes": notes,
    }
    with open(folder / "reference.json", "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    log(
        f"{folder.name:13s} seed={seed} min_margin={min(margins):.4f} "
        f"max|logit|={info['max_abs_logit']:.3f} prefill/decode rel err={pd_rel:.2e} "
        f"greedy={gen}"
    )
    return info, np_logits


# --------------------------------------------------------------------------
# Quantization vectors
# --------------------------------------------------------------------------


def quant_fixture(out_dir):
    out_dir.mkdir(parents=True)
    kw, kx = mx.random.split(mx.random.key(7))
    w = mx.random.normal((5, 384), key=kw).astype(mx.float32)
    x = mx.random.normal((3, 384), key=kx).astype(mx.float32)
    t = {"w": w, "x": x}
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            p = f"q{bits}g{gs}"
            wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
            t[p + ".weight"] = wq
            t[p + ".scales"] = s
            t[p + ".biases"] = b
            t[p + ".deq"] = mx.dequantize(wq, s, b, group_size=gs, bits=bits)
            t[p + ".y"] = mx.quantized_matmul(
                x, wq, s, b, transpose=True, group_size=gs, bits=bits
            )
    wq, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    assert s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16
    t["q4g64bf16.weight"] = wq
    t["q4g64bf16.scales"] = s
    t["q4g64bf16.biases"] = b
    # Exact: bf16 scales/biases widened to f32, s*q+b in f32.
    t["q4g64bf16.deq"] = mx.dequantize(
        wq, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=4
    )
    # What MLX itself returns for bf16 inputs (result rounded to bf16).
    t["q4g64bf16.deq_bf16"] = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(
        mx.float32
    )
    mx.eval(t)
    mx.save_safetensors(str(out_dir / "quant.safetensors"), t)


# --------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args()
    out = args.out
    log = functools.partial(print, flush=True)

    # Regenerate from scratch (README.md is kept: it is written by hand).
    readme = out / "README.md"
    keep = readme.read_text() if readme.exists() else None
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if keep is not None:
        readme.write_text(keep)

    log(f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}")
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("next", "qwen35"):
            f32_logits = None
            for precision in ("f32", "q4", "q8", "mixed"):
                folder = out / f"{arch}-{precision}"
                convert(arch, precision, folder, tmp)
                info, logits = reference(folder, arch, precision, log)
                summary[folder.name] = info
                if precision == "f32":
                    f32_logits, f32_tokens = logits, info["tokens"]
                elif info["tokens"] == f32_tokens:
                    rel = np.max(np.abs(logits - f32_logits)) / np.max(np.abs(f32_logits))
                    log(f"{'':13s} max |logits - f32 logits| / max|f32 logits| = {rel:.3f}")
    quant_fixture(out / "quant")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"total size of {out}: {total} bytes ({total / 2**20:.2f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
