"""Compile every Triton kernel for sm_80 and sm_90 on a machine without a GPU (``make gpu-compile``).

Why: the kernel tests run under Triton's interpreter on the CPU, which never sees the GPU
compiler: a tile that needs more shared memory than an A100 or H100 has, a dtype an
architecture cannot convert, or a configuration whose registers spill, only shows up on a
GPU. Triton compiles for a named target without one (it ships ptxas), so this tool does.

How: it calls the project's own launching wrappers (the case tables below) with small CPU
tensors inside ``target_capability((8, 0))`` / ``((9, 0))``, so each wrapper picks exactly
the launch configuration it would pick on that GPU. ``JITFunction.run`` (and
``Autotuner.run``: every config of its list) is replaced by a recorder, so nothing runs;
each launch is specialized by the installed Triton's own binder (argument types, ints equal
to 1 as constants, 16-divisibility of pointers and ints, as a real launch would), deduplicated,
and compiled with ``triton.compile`` for ``GPUTarget("cuda", arch, 32)`` in a process pool.
ptxas's verbose log gives registers and spills, ``metadata.shared`` the shared memory.

It exits 1 on a compile error, shared memory over the architecture's per-block limit, spills
over the path's budget (``SPILL_BUDGET``), or a wrapper that raises before launching; only
configurations in ``ALLOW`` (ones the engine refuses at config time) do not count. Families in
``PENDING`` (known to break the limits, each with its reason) run only when named with ``--only``.
Compiled kernels are cached by Triton under ``<lmplug cache>/triton-compile``; registers
and spills by this tool next to them, so a warm run compiles nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import itertools
import json
import multiprocessing
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from lmplug.kit.paths import cache_dir

# -- the limits --------------------------------------------------------------------------------

# opt-in maximum of dynamic shared memory per block (CUDA programming guide, compute capabilities)
SHARED_LIMIT = {80: 166912, 90: 232448}

# spill bytes (ptxas "spill stores") a path may have. 16-bit hot paths: none at all. fp32 runs
# are the exact references and tests' path, and quantized paths (int8/fp8 KV, W8A8) carry the
# dequantization in registers: a small budget, so that a tile change that spills for real
# (hundreds of bytes and up) still fails.
SPILL_BUDGET = {"hot": 0, "fp32": 256, "quantized": 256}

# (kernel name, arch, substring of the config, reason): configurations the engine refuses at
# config time, so their failure here is expected. Each needs its refusal named.
ALLOW: list[tuple[str, int, str, str]] = [
    ("_w8a8_gemm_kernel", 80, "fp8", ("W8A8Linear._path refuses fp8 below compute capability 8.9 at load "
                                      "(`kernel: triton` raises, `auto` takes the reference path)")),
]

# -- the case tables: one per kernel family; each row of the product is one wrapper call ---------

DTYPES = ("fp16", "bf16", "fp32")
HEAD_DIMS = (64, 80, 96, 128, 256)
KV_DTYPES = ("same", "int8", "fp8")  # the cache's dtype: q's, or quantized with scales
GQA = (1, 4, 8)  # query heads per KV head
# a layer's attention features (``LayerAttention``): none, Gemma 2's soft-cap, GPT-OSS's sinks, both
FEATURES = ("none", "softcap", "sinks", "softcap+sinks")
BLOCK_SIZES = (16, 32)  # KV cache block size (tokens)

CASES: dict[str, dict[str, tuple]] = {
    # attention: flash prefill without a cache (packed K/V), and over the cache
    "flash_varlen": {"dtype": DTYPES, "head_dim": HEAD_DIMS, "gqa": GQA, "features": FEATURES},
    "flash_prefill": {"dtype": DTYPES, "head_dim": HEAD_DIMS, "kv": KV_DTYPES, "gqa": GQA,
                      "block_size": BLOCK_SIZES, "features": FEATURES},
    # decode: flash's num_splits option (1: no split, None: planned from a long context)
    "flash_decode": {"dtype": DTYPES, "head_dim": HEAD_DIMS, "kv": KV_DTYPES, "gqa": GQA,
                     "block_size": BLOCK_SIZES, "splits": (1, None), "features": FEATURES},
    # paged's partition_size option: 0 never splits, None plans, 16/32 force smaller key tiles
    "paged_decode": {"dtype": DTYPES, "head_dim": HEAD_DIMS, "kv": KV_DTYPES, "gqa": GQA,
                     "block_size": BLOCK_SIZES, "partition": (0, None, 16, 32), "features": FEATURES},
    # the split-K reduce: its partition tile (S_TILE) follows the split count
    "decode_reduce": {"dtype": DTYPES, "head_dim": HEAD_DIMS, "splits": (2, 4, 8, 16, 32, 64)},
    "paged_prefill": {"dtype": DTYPES, "head_dim": HEAD_DIMS, "kv": KV_DTYPES, "gqa": GQA,
                      "block_size": BLOCK_SIZES, "features": FEATURES},
    "reshape_and_cache": {"dtype": DTYPES, "head_dim": HEAD_DIMS, "kv_heads": (1, 2, 8),
                          "block_size": BLOCK_SIZES},
    # MLA decode over latent rows: DeepSeek-V2/V3 (512 + 64), and a small test model's shape
    "mla_decode": {"dtype": DTYPES, "rank_rope": ((512, 64), (128, 32)), "block_size": BLOCK_SIZES,
                   "context": (16, 4096)},
    # fused MoE: block_m 16/32/64/128 (picked by tokens per expert, or the block_m option), top-k
    # of Mixtral (2), DeepSeek (6), Qwen3-MoE (8)
    "fused_moe": {"dtype": DTYPES, "block_m": (16, 32, 64, 128), "top_k": (2, 6, 8)},
    # W4A16: GPTQ 4/8-bit and AWQ 4-bit; contiguous groups of 32 or 128 inputs, or act-order (None:
    # groups gathered through g_idx); M <= 4 takes the GEMV, larger M the GEMM (M buckets 16/64/128)
    "w4a16": {"dtype": DTYPES, "layout": ("gptq4", "gptq8", "awq4"), "group": (None, 32, 128),
              "m": (1, 2, 4, 16, 64, 128)},
    # W8A8: int8 / fp8 operands; scale groups (0: per token x per channel; 128: DeepSeek-V3
    # blocks; 16/32/64: the other K steps block_k_for can pick); M buckets 1/16/64/128, and N wide
    # enough (8192) for the wide decode tiles
    # MXFP4 experts (GPT-OSS): x [M, K] @ W^T with W in 32-value FP4 blocks; M: decode to prefill tiles
    "mxfp4": {"dtype": DTYPES, "m": (1, 16, 64), "bias": (False, True)},
    "w8a8": {"kind": ("int8", "fp8"), "group_k": (0, 16, 32, 64, 128), "m": (1, 16, 64, 128),
             "n": (256, 8192), "out": ("fp16", "bf16", "fp32"), "bias": (False, True)},
    # linear attention and SSMs. Lightning (MiniMax, head_dim 128): block_size None is the
    # architecture's table entry, the others the wrapper's option; init: a prefill continuing a state
    "lightning_prefill": {"dtype": DTYPES, "head_dim": (64, 96, 128), "block_size": (None, 16, 32),
                          "init": (False, True)},
    "lightning_decode": {"dtype": DTYPES, "head_dim": (64, 96, 128)},
    # Mamba2's SSD (head_dim 64): d_state 64 (Zamba2) / 128 (Mamba2, Nemotron-H, Bamba), 1 or 8 B/C
    # groups; the model's chunk_size 256 runs as the kernel's largest chunk (64), 16 and 32 as themselves
    "ssd_scan": {"dtype": DTYPES, "d_state": (64, 128), "groups": (1, 8), "chunk": (16, 32, 256),
                 "init": (False, True)},
    "ssd_update": {"dtype": DTYPES, "d_state": (64, 128), "groups": (1, 8)},
    # causal conv1d of width 4 over Mamba2's xBC (2 * 4096 + 2 * 8 * 128 channels); the carried state
    # absent (fresh sequences), in x's dtype or in fp32
    "conv1d": {"dtype": DTYPES, "state": ("none", "same", "fp32"), "bias": (False, True)},
    "conv1d_update": {"dtype": DTYPES, "state": ("same", "fp32"), "bias": (False, True)},
    # gated delta rule (Qwen3-Next: Dk = Dv = 128, 2 value heads per key head): chunk sizes the
    # wrapper takes (FLA's 64 and smaller), 1 or 2 value heads per key head
    "delta_chunk": {"dtype": DTYPES, "chunk": (16, 32, 64), "group": (1, 2), "init": (False, True)},
    "delta_update": {"dtype": DTYPES, "group": (1, 2)},
    # LoRA's segment-grouped shrink / expand (lmplug_adapter.triton): K * R columns of a fused q/k/v
    # layer's slots (3 x 8, 3 x 16) and of one projection's (64), over a decode batch and a prefill
    "lora_sgmv": {"dtype": DTYPES, "kr": (24, 48, 64), "tokens": (1, 16, 256)},
}

# families the default run leaves out (``--only NAME`` compiles them): ones whose compile results are
# known to break the limits, each with the reason
PENDING: dict[str, str] = {}

# families whose 16-bit, unquantized configurations are hot paths (a spill budget of 0)
HOT = {"flash_varlen", "flash_prefill", "flash_decode", "paged_decode", "decode_reduce", "paged_prefill",
       "reshape_and_cache", "mla_decode", "fused_moe", "w4a16", "mxfp4", "lightning_prefill", "lightning_decode",
       "ssd_scan", "ssd_update", "conv1d", "conv1d_update", "delta_chunk", "delta_update", "lora_sgmv"}


def spill_path(family: str, params: dict) -> str:
    """Which ``SPILL_BUDGET`` a case is held to."""
    if params.get("kv") in ("int8", "fp8") or family == "w8a8":
        return "quantized"
    if params.get("dtype") == "fp32":
        return "fp32"
    return "hot" if family in HOT else "quantized"


# -- the wrapper calls ---------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def _dtype(name: str):
    torch = _torch()
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8,
            "fp8": torch.float8_e4m3fn}[name]


KV_HEADS = 2  # few heads: the tensors stay small; head counts only enter as ints, not as tiles
NUM_BLOCKS = 4


def _kv_cache(p: dict):
    """(k_cache, v_cache, k_scale, v_scale) of ``p``: [NUM_BLOCKS, block_size, Hkv, D]."""
    torch = _torch()
    dtype = _dtype(p["dtype"] if p["kv"] == "same" else p["kv"])
    shape = (NUM_BLOCKS, p["block_size"], KV_HEADS, p["head_dim"])
    k, v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)  # never read: nothing runs
    if p["kv"] == "same":
        return k, v, None, None
    return k, v, torch.empty(shape[:3]), torch.empty(shape[:3])


def _tables(batch: int, seq_len: int):
    torch = _torch()
    return (torch.zeros(batch, NUM_BLOCKS, dtype=torch.int32),
            torch.full((batch,), seq_len, dtype=torch.int32))


def _q(p: dict, tokens: int):
    torch = _torch()
    return torch.zeros(tokens, KV_HEADS * p["gqa"], p["head_dim"], dtype=_dtype(p["dtype"]))


def _features(p: dict) -> dict:
    """The wrapper's ``softcap`` / ``sinks`` arguments for the case's ``features``."""
    torch = _torch()
    features = p["features"].split("+")
    return {"softcap": 30.0 if "softcap" in features else None,
            "sinks": torch.zeros(KV_HEADS * p["gqa"]) if "sinks" in features else None}


def call_flash_varlen(p: dict) -> None:
    from lmplug_attention.flash.prefill_kernels import flash_varlen_attention
    torch = _torch()
    q = _q(p, 32)
    kv = torch.zeros(32, KV_HEADS, p["head_dim"], dtype=q.dtype)
    flash_varlen_attention(q, kv, kv.clone(), torch.tensor([0, 16, 32], dtype=torch.int32), 0.1, **_features(p))


def call_flash_prefill(p: dict) -> None:
    from lmplug_attention.flash.prefill_kernels import flash_prefill_with_kvcache
    torch = _torch()
    k, v, ks, vs = _kv_cache(p)
    tables, lens = _tables(2, 48)
    flash_prefill_with_kvcache(_q(p, 32), k, v, tables, torch.tensor([0, 16, 32], dtype=torch.int32), lens,
                               0.1, k_scale=ks, v_scale=vs, **_features(p))


def call_flash_decode(p: dict) -> None:
    from lmplug_attention.flash.decode_kernels import flash_decode_with_kvcache
    k, v, ks, vs = _kv_cache(p)
    tables, lens = _tables(1, 48)
    flash_decode_with_kvcache(_q(p, 1), k, v, tables, lens, 0.1, max_seq_len=8192, num_splits=p["splits"],
                              k_scale=ks, v_scale=vs, **_features(p))


def call_paged_decode(p: dict) -> None:
    from lmplug_attention.paged.kernels import paged_decode_attention
    k, v, ks, vs = _kv_cache(p)
    tables, lens = _tables(1, 48)
    paged_decode_attention(_q(p, 1), k, v, tables, lens, 0.1, max_seq_len=8192, partition_size=p["partition"],
                           k_scale=ks, v_scale=vs, **_features(p))


def call_decode_reduce(p: dict) -> None:
    from lmplug_attention.flash.decode_kernels import flash_decode_with_kvcache
    k, v, _, _ = _kv_cache({**p, "kv": "same", "gqa": 1, "block_size": 16})
    tables, lens = _tables(1, 48)
    flash_decode_with_kvcache(_q({**p, "gqa": 1}, 1), k, v, tables, lens, 0.1, max_seq_len=64 * 4096,
                              num_splits=p["splits"])


def call_paged_prefill(p: dict) -> None:
    from lmplug_attention.paged.prefill_kernels import paged_prefill_attention
    torch = _torch()
    k, v, ks, vs = _kv_cache(p)
    tables, lens = _tables(2, 48)
    paged_prefill_attention(_q(p, 32), k, v, tables, torch.tensor([0, 16, 32], dtype=torch.int32), lens, 0.1,
                            k_scale=ks, v_scale=vs, **_features(p))


def call_reshape_and_cache(p: dict) -> None:
    from lmplug_attention.kv_ops import reshape_and_cache
    torch = _torch()
    dtype = _dtype(p["dtype"])
    k = torch.zeros(8, p["kv_heads"], p["head_dim"], dtype=dtype)
    cache = torch.zeros(NUM_BLOCKS, p["block_size"], p["kv_heads"], p["head_dim"], dtype=dtype)
    reshape_and_cache(k, k.clone(), cache, cache.clone(), torch.arange(8))


def call_mla_decode(p: dict) -> None:
    from lmplug_attention.mla.kernels import mla_decode_latent
    torch = _torch()
    rank, rope = p["rank_rope"]
    dtype = _dtype(p["dtype"])
    q = torch.zeros(2, 16, rank + rope, dtype=dtype)
    cache = torch.zeros(NUM_BLOCKS, p["block_size"], 1, rank + rope, dtype=dtype)
    tables, lens = _tables(2, 48)
    mla_decode_latent(q, cache, tables, lens, 0.1, rank, max_seq_len=p["context"])


def call_fused_moe(p: dict) -> None:
    from lmplug_moe.fused_kernels import fused_experts
    torch = _torch()
    dtype = _dtype(p["dtype"])
    hidden, inter, experts, tokens = 256, 256, 8, 4  # wide enough for the largest N and K tiles
    ids = torch.arange(tokens * p["top_k"]).reshape(tokens, p["top_k"]) % experts
    fused_experts(torch.empty(tokens, hidden, dtype=dtype), ids, torch.ones(tokens, p["top_k"]),
                  torch.empty(experts, 2 * inter, hidden, dtype=dtype),
                  torch.empty(experts, hidden, inter, dtype=dtype), block_m=p["block_m"])


def call_w4a16(p: dict) -> None:
    from lmplug_quant.w4a16_kernels import w4a16_gemm
    torch = _torch()
    bits, awq = {"gptq4": (4, False), "gptq8": (8, False), "awq4": (4, True)}[p["layout"]]
    pack, k, n, group = 32 // bits, 256, 256, p["group"] or 128
    qweight = torch.empty((k, n // pack) if awq else (k // pack, n), dtype=torch.int32)
    qzeros = torch.empty(k // group, n // pack, dtype=torch.int32)
    scales = torch.empty(k // group, n, dtype=_dtype(p["dtype"]))
    g_idx = torch.arange(k, dtype=torch.int32) // group
    w4a16_gemm(torch.empty(p["m"], k, dtype=_dtype(p["dtype"])), qweight, qzeros, scales, g_idx, bits=bits,
               awq_order=awq, group_size=p["group"])


def call_mxfp4(p: dict) -> None:
    from lmplug_quant.mxfp4_kernels import linear
    torch = _torch()
    n, k, dtype = 256, 256, _dtype(p["dtype"])
    linear(torch.empty(p["m"], k, dtype=dtype), torch.empty(n, k // 32, 16, dtype=torch.uint8),
           torch.empty(n, k // 32, dtype=torch.uint8), torch.empty(n, dtype=dtype) if p["bias"] else None)


def call_w8a8(p: dict) -> None:
    from lmplug_quant.w8a8_kernels import w8a8_gemm
    torch = _torch()
    k, n, g = 256, p["n"], p["group_k"]
    kg = 1 if g == 0 else -(-k // g)
    dtype = _dtype(p["kind"])
    bias = torch.empty(n, dtype=_dtype(p["out"])) if p["bias"] else None
    w8a8_gemm(torch.empty(p["m"], k, dtype=dtype), torch.empty(p["m"], kg), torch.empty(n, k, dtype=dtype),
              torch.empty(n, kg), group_k=g, bias=bias, out_dtype=_dtype(p["out"]))


# linear attention / SSM calls: two sequences of 16 tokens (a token count that is no tile multiple
# would change nothing: lengths reach the kernels through cu_seqlens, not as arguments)
LINEAR_HEADS = 2  # key heads; as for KV_HEADS, head counts only enter as ints
MAMBA_HEADS, MAMBA_HEAD_DIM = 16, 64
CONV_CHANNELS, CONV_WIDTH = 2 * 4096 + 2 * 8 * 128, 4
DELTA_HEAD_DIM = 128


def _cu_seqlens():
    torch = _torch()
    return torch.tensor([0, 16, 32], dtype=torch.int32)


def call_lightning_prefill(p: dict) -> None:
    from lmplug_mixer.lightning_kernels import lightning_attention_prefill
    torch = _torch()
    d = p["head_dim"]
    q = torch.empty(32, LINEAR_HEADS, d, dtype=_dtype(p["dtype"]))
    init = torch.empty(2, LINEAR_HEADS, d, d) if p["init"] else None
    lightning_attention_prefill(q, q.clone(), q.clone(), torch.ones(LINEAR_HEADS), _cu_seqlens(), init,
                                block_size=p["block_size"])


def call_lightning_decode(p: dict) -> None:
    from lmplug_mixer.lightning_kernels import lightning_attention_decode
    torch = _torch()
    d = p["head_dim"]
    q = torch.empty(2, LINEAR_HEADS, d, dtype=_dtype(p["dtype"]))
    lightning_attention_decode(q, q.clone(), q.clone(), torch.ones(LINEAR_HEADS),
                               torch.empty(2, LINEAR_HEADS, d, d))


def _ssd_inputs(p: dict, tokens: int) -> tuple:
    """(x, dt, A, B, C, D, dt_bias) of ``tokens`` rows; A, D and dt_bias fp32 as mamba_ssm keeps them."""
    torch = _torch()
    dtype = _dtype(p["dtype"])
    b = torch.empty(tokens, p["groups"], p["d_state"], dtype=dtype)
    return (torch.empty(tokens, MAMBA_HEADS, MAMBA_HEAD_DIM, dtype=dtype),
            torch.empty(tokens, MAMBA_HEADS, dtype=dtype), torch.empty(MAMBA_HEADS), b, b.clone(),
            torch.empty(MAMBA_HEADS), torch.empty(MAMBA_HEADS))


def call_ssd_scan(p: dict) -> None:
    from lmplug_mixer.ssd_kernels import ssd_chunk_scan
    torch = _torch()
    x, dt, a, b, c, d, dt_bias = _ssd_inputs(p, 32)
    init = torch.empty(2, MAMBA_HEADS, MAMBA_HEAD_DIM, p["d_state"]) if p["init"] else None
    ssd_chunk_scan(x, dt, a, b, c, d, _cu_seqlens(), init, p["chunk"], dt_bias=dt_bias)


def call_ssd_update(p: dict) -> None:
    from lmplug_mixer.ssd_kernels import ssd_state_update
    torch = _torch()
    x, dt, a, b, c, d, dt_bias = _ssd_inputs(p, 2)
    ssd_state_update(torch.empty(2, MAMBA_HEADS, MAMBA_HEAD_DIM, p["d_state"]), x, dt, a, b, c, d, dt_bias)


def _conv_parts(p: dict, batch: int) -> tuple:
    """(weight, bias or None, conv_state or None) of ``p``."""
    torch = _torch()
    dtype = _dtype(p["dtype"])
    state_dtype = {"none": None, "same": dtype, "fp32": torch.float32}[p["state"]]
    state = None if state_dtype is None else torch.empty(batch, CONV_CHANNELS, CONV_WIDTH - 1, dtype=state_dtype)
    return (torch.empty(CONV_CHANNELS, CONV_WIDTH, dtype=dtype),
            torch.empty(CONV_CHANNELS, dtype=dtype) if p["bias"] else None, state)


def call_lora_sgmv(p: dict) -> None:
    from lmplug_adapter.triton_kernels import sgmv
    torch = _torch()
    dtype, tokens, slots, d_in, d_out = _dtype(p["dtype"]), p["tokens"], 4, 576, 960
    order = torch.arange(tokens, dtype=torch.int32)
    lens = [tokens // slots + (k < tokens % slots) for k in range(slots)]
    starts = [sum(lens[:k]) for k in range(slots)]
    sgmv(torch.empty(tokens, d_out, dtype=dtype), torch.empty(tokens, d_in, dtype=dtype),
         torch.empty(slots, p["kr"], d_in, dtype=dtype), torch.empty(slots, d_out, p["kr"], dtype=dtype), order,
         torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
         torch.arange(slots, dtype=torch.int32), max(lens))


def call_conv1d(p: dict) -> None:
    from lmplug_mixer.conv1d_kernels import causal_conv1d
    torch = _torch()
    weight, bias, state = _conv_parts(p, 2)
    causal_conv1d(torch.empty(32, CONV_CHANNELS, dtype=_dtype(p["dtype"])), weight, bias, _cu_seqlens(), state)


def call_conv1d_update(p: dict) -> None:
    from lmplug_mixer.conv1d_kernels import causal_conv1d_update
    torch = _torch()
    weight, bias, state = _conv_parts(p, 2)
    causal_conv1d_update(torch.empty(2, CONV_CHANNELS, dtype=_dtype(p["dtype"])), state, weight, bias)


def _delta_inputs(p: dict, tokens: int) -> tuple:
    """(q, k, v, g, beta): g fp32 (Qwen3-Next computes it in fp32), beta in the inputs' dtype."""
    torch = _torch()
    dtype = _dtype(p["dtype"])
    value_heads = LINEAR_HEADS * p["group"]
    q = torch.empty(tokens, LINEAR_HEADS, DELTA_HEAD_DIM, dtype=dtype)
    return (q, q.clone(), torch.empty(tokens, value_heads, DELTA_HEAD_DIM, dtype=dtype),
            torch.empty(tokens, value_heads), torch.empty(tokens, value_heads, dtype=dtype))


def call_delta_chunk(p: dict) -> None:
    from lmplug_mixer.delta_kernels import chunk_gated_delta_rule
    torch = _torch()
    q, k, v, g, beta = _delta_inputs(p, 32)
    init = torch.empty(2, v.shape[1], DELTA_HEAD_DIM, DELTA_HEAD_DIM) if p["init"] else None
    chunk_gated_delta_rule(q, k, v, g, beta, _cu_seqlens(), init, chunk_size=p["chunk"])


def call_delta_update(p: dict) -> None:
    from lmplug_mixer.delta_kernels import fused_recurrent_gated_delta_rule_update
    torch = _torch()
    q, k, v, g, beta = _delta_inputs(p, 2)
    fused_recurrent_gated_delta_rule_update(q, k, v, g, beta,
                                            torch.empty(2, v.shape[1], DELTA_HEAD_DIM, DELTA_HEAD_DIM))


CALLS: dict[str, Callable[[dict], None]] = {name: globals()[f"call_{name}"] for name in CASES}


def cases(family: str) -> Iterator[dict]:
    """Every row of ``CASES[family]``, in the table's order."""
    axes = CASES[family]
    for values in itertools.product(*axes.values()):
        yield dict(zip(axes, values))


def refused(params: dict, arch: int) -> str | None:
    """Why the engine refuses this attention configuration when the plan is made (the backends'
    ``check_target``), or None: only what a user can run is held to the budgets."""
    if "kv" not in params:
        return None
    from lmplug_attention.attn_ops import check_triton_target

    from lmplug.errors import ConfigError

    dtype = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[params["dtype"]]
    kv = {"same": "auto", "int8": "int8", "fp8": "fp8_e4m3"}[params["kv"]]
    try:
        check_triton_target("triton", params.get("head_dim", 64), dtype, (arch // 10, arch % 10), kv_dtype=kv)
    except ConfigError as exc:
        return str(exc)
    return None


def short(params: dict) -> str:
    """``fp16 head_dim=128 kv=int8 ...`` as a compact label."""
    parts = []
    for key, value in params.items():
        if key == "dtype":
            parts.append(str(value))
        elif isinstance(value, tuple):
            parts.append(f"{key}={'+'.join(map(str, value))}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


# -- capture: the launches a wrapper makes, specialized as a real launch would be ----------------

@dataclasses.dataclass
class Job:
    """One kernel compile: everything ``triton.compile`` needs, plus where it came from."""

    module: str
    kernel: str
    arch: int
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    family: str
    config: str
    spill_path: str
    params: dict
    cases: int = 1


def _jit_function(fn):
    """The ``JITFunction`` under autotuner / heuristics wrappers."""
    from triton.runtime.jit import JITFunction
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


_BINDERS: dict = {}


def _specialize(fn, arch: int, args: tuple, kwargs: dict, seen: dict) -> tuple[str, tuple | None]:
    """(key, (signature, constexprs, attrs, options) or None when ``key`` is in ``seen``) of one
    launch for ``sm_<arch>``: the installed Triton's own binder and packing, as
    ``JITFunction.run`` does on a GPU (ints equal to 1 become constants, pointers and ints
    divisible by 16 get ``tt.divisibility``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    if (fn, arch) not in _BINDERS:  # building a binder execs generated code: once per kernel and arch
        backend = make_backend(GPUTarget("cuda", arch, 32))
        _BINDERS[fn, arch] = backend, create_function_from_signature(fn.signature, fn.params, backend)
    backend, binder = _BINDERS[fn, arch]
    bound, specialization, options = binder(*args, **kwargs)
    launch = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    key = repr((fn.module, fn.__name__, arch, specialization, sorted(launch.items())))
    if key in seen:
        return key, None
    _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return key, (signature, constexprs, attrs, launch)


class Recorder:
    """Replaces ``JITFunction.run`` / ``Autotuner.run`` while wrappers are called: records, launches nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []  # (jit function, args, kwargs)

    def __enter__(self):
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        self._saved = JITFunction.run, Autotuner.run
        recorder = self

        def jit_run(fn, *args, grid, warmup=False, **kwargs):
            recorder.launches.append((fn, args, kwargs))

        def autotune_run(tuner, *args, **kwargs):
            fn = _jit_function(tuner.fn)
            for config in tuner.configs:  # every config the tuner may pick
                recorder.launches.append((fn, args, {**kwargs, **config.all_kwargs()}))

        JITFunction.run, Autotuner.run = jit_run, autotune_run
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        JITFunction.run, Autotuner.run = self._saved


def capture(archs: list[int], families: list[str], only: str | None) -> tuple[list[Job], list[dict]]:
    """Call every case of ``families`` for every arch; (unique jobs, rows of wrappers that raised)."""
    from lmplug.kit.devices import target_capability

    jobs: dict[str, Job] = {}
    errors = []
    skipped: dict[str, int] = {}  # family -> cases the engine refuses at plan time (``refused``)
    for family in families:
        for params in cases(family):
            config = short(params)
            for arch in archs:
                if refused(params, arch):
                    skipped[family] = skipped.get(family, 0) + 1
                    continue
                with Recorder() as rec, target_capability((arch // 10, arch % 10)):
                    try:
                        CALLS[family](params)
                        error = None
                    except Exception as exc:  # noqa: BLE001 - reported per case
                        error = f"{type(exc).__name__}: {exc}"
                # a wrapper that fails after its launches (host work on outputs that were never
                # computed) still told us its launches; one that fails before any is a failure
                if error and not rec.launches:
                    errors.append(_row(family, CALLS[family].__name__, config, arch, status="FAILED",
                                       why=f"wrapper raised: {error}"))
                for fn, args, kwargs in rec.launches:
                    fn = _jit_function(fn)
                    if only and only not in fn.__name__ and only not in family:
                        continue
                    key, spec = _specialize(fn, arch, args, kwargs, jobs)
                    if spec is None:
                        jobs[key].cases += 1
                    else:
                        jobs[key] = Job(fn.module, fn.__name__, arch, *spec, family, config,
                                        spill_path(family, params), params)
    if only:
        errors = [e for e in errors if only in e["kernel"] or only in e["family"]]
    if skipped:
        print("gpu_compile: not compiled, refused when the plan is made (float32 with a quantized KV "
              "cache): " + ", ".join(f"{family} {n}" for family, n in skipped.items()), file=sys.stderr)
    return list(jobs.values()), errors


def sample(jobs: list[Job], n: int) -> list[Job]:
    """At most ``n`` jobs per (kernel, arch), deterministic: greedily the job whose case covers the
    most (axis, value) pairs not yet covered (first in the case tables' order on ties), so that
    with ``n`` at least the longest axis every dtype, head dim, KV dtype, ... is compiled once per
    kernel; once all are covered, the rest evenly spaced over the remaining jobs."""
    groups: dict[tuple[str, int], list[Job]] = {}
    for job in jobs:
        groups.setdefault((job.kernel, job.arch), []).append(job)
    picked = []
    for group in groups.values():
        left, covered, chosen = list(group), set(), []
        while left and len(chosen) < n:
            gains = [len({(k, repr(v)) for k, v in job.params.items()} - covered) for job in left]
            if max(gains) == 0:
                want = n - len(chosen)
                step = max(len(left) / want, 1)
                chosen += [left[int(i * step)] for i in range(min(want, len(left)))]
                break
            best = left.pop(gains.index(max(gains)))
            covered |= {(k, repr(v)) for k, v in best.params.items()}
            chosen.append(best)
        picked += chosen
    return picked


# -- compile (in worker processes) ---------------------------------------------------------------

PTXAS_REGS = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_usage(log: str) -> dict | None:
    regs, spills = PTXAS_REGS.search(log), PTXAS_SPILLS.search(log)
    if not regs or not spills:
        return None
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2))}


def _ptxas_rerun(compiled, arch: int) -> dict:
    """Registers and spills of a kernel Triton took from its cache (no log): ptxas -v on its PTX."""
    from triton.backends import nvidia

    ptxas = Path(nvidia.__file__).parent / "bin" / "ptxas"
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(compiled.asm["ptx"])
        src.flush()
        out = subprocess.run([str(ptxas), "-v", f"--gpu-name={gpu}", src.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    usage = _ptxas_usage(out.stderr + out.stdout)
    if usage is None:
        raise RuntimeError(f"ptxas -v printed no resource usage: {out.stderr[-300:]}")
    return usage


def compile_job(job: Job, usage_cache: dict) -> dict:
    """Compile one job; its row (shared bytes, registers, spills, or the error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    log = io.StringIO()
    try:
        fn = _jit_function(getattr(importlib.import_module(job.module), job.kernel))
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, job.signature, job.constexprs, job.attrs),
                                      target=GPUTarget("cuda", job.arch, 32), options=job.options)
    except Exception as exc:  # noqa: BLE001 - a compile error is a row of the table
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()] or [type(exc).__name__]
        return _row(job.family, job.kernel, job.config, job.arch, job=job, status="FAILED",
                    why=f"compile error: {lines[-1][:300]}", detail=str(exc)[-4000:])
    digest = compiled.metadata.hash
    usage = _ptxas_usage(log.getvalue()) or usage_cache.get(digest) or _ptxas_rerun(compiled, job.arch)
    return _row(job.family, job.kernel, job.config, job.arch, job=job, hash=digest,
                shared=compiled.metadata.shared, seconds=round(time.perf_counter() - start, 2), **usage)


def _row(family: str, kernel: str, config: str, arch: int, job: Job | None = None, **fields) -> dict:
    row = {"family": family, "kernel": kernel, "config": config, "arch": arch}
    if job is not None:
        row.update(num_warps=job.options.get("num_warps", 4), num_stages=job.options.get("num_stages", 3),
                   cases=job.cases, spill_path=job.spill_path)
    row.update(fields)
    return row


def judge(row: dict) -> dict:
    """Set ``status`` (ok / FAILED / allowed) and ``why`` from the limits."""
    problems = [row["why"]] if row.get("status") == "FAILED" else []
    if "shared" in row and row["shared"] > SHARED_LIMIT[row["arch"]]:
        problems.append(f"shared memory {row['shared']} B > sm_{row['arch']} limit {SHARED_LIMIT[row['arch']]} B")
    if "spill_stores" in row:
        budget = SPILL_BUDGET[row["spill_path"]]
        if row["spill_stores"] > budget:
            problems.append(f"spills {row['spill_stores']} B > {row['spill_path']} budget {budget} B")
    row["why"] = "; ".join(problems)
    row["status"] = "FAILED" if problems else "ok"
    for kernel, arch, config, reason in ALLOW:
        if problems and row["kernel"] == kernel and row["arch"] == arch and config in row["config"]:
            row["status"], row["why"] = "allowed", f"{row['why']} (allowed: {reason})"
    return row


# -- the run -------------------------------------------------------------------------------------

def _usage_file() -> Path:
    return Path(os.environ["TRITON_CACHE_DIR"]) / "lmplug-resource-usage.json"


def _load_usage() -> dict:
    try:
        return json.loads(_usage_file().read_text())
    except (OSError, ValueError):
        return {}


def _worker_init(usage: dict) -> None:
    global _USAGE
    _USAGE = usage


_USAGE: dict = {}


def _compile_in_worker(job: Job) -> dict:
    return compile_job(job, _USAGE)


def compile_all(jobs: list[Job], workers: int) -> list[dict]:
    """Every job's row, printing progress (and each failure as it comes) for long runs."""
    usage = _load_usage()
    rows = []
    with contextlib.ExitStack() as stack:
        if workers <= 1:
            results = (compile_job(job, usage) for job in jobs)
        else:
            # fork: the workers compile the very kernel objects that were captured (and skip
            # importing torch again); they run no torch op, so its thread pools do not matter
            pool = stack.enter_context(ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init,
                initargs=(usage,)))
            results = pool.map(_compile_in_worker, jobs, chunksize=1)
        for row in results:
            rows.append(judge(row))
            if row["status"] == "FAILED":
                print(f"gpu_compile: FAILED {row['kernel']} [{row['config']}] sm_{row['arch']}: {row['why']}",
                      flush=True)
            if len(rows) % 50 == 0:
                print(f"gpu_compile: {len(rows)}/{len(jobs)} compiled", flush=True)
    for row in rows:
        if "hash" in row:
            usage[row["hash"]] = {k: row[k] for k in ("registers", "spill_stores", "spill_loads")}
    with contextlib.suppress(OSError):
        _usage_file().parent.mkdir(parents=True, exist_ok=True)
        _usage_file().write_text(json.dumps(usage))
    return rows


def table(rows: list[dict]) -> str:
    head = ("kernel", "config", "arch", "shared B", "regs", "spill B", "status")
    lines = []
    for r in rows:
        opts = f" w{r['num_warps']}s{r['num_stages']}" if "num_warps" in r else ""
        spill = f"{r['spill_stores']}/{r['spill_loads']}" if "spill_stores" in r else "-"
        status = r["status"] + (f": {r['why']}" if r["why"] else "")
        lines.append((r["kernel"], r["config"] + opts, f"sm_{r['arch']}", str(r.get("shared", "-")),
                      str(r.get("registers", "-")), spill, status))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head) - 1)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*line) for line in [head, *lines])


def summary(rows: list[dict], seconds: float, triton_version: str) -> dict:
    failed = [r for r in rows if r["status"] == "FAILED"]
    kinds: dict[str, int] = {}
    for r in failed:
        for why in r["why"].split("; "):
            kind = why.split(":")[0].split(" ")[0] if why else "?"
            kinds[{"compile": "compile error", "shared": "shared memory", "spills": "spills",
                   "wrapper": "wrapper raised"}.get(kind, kind)] = kinds.get(kind, 0) + 1
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return {"triton": triton_version, "compiled": len(rows), "ok": sum(r["status"] == "ok" for r in rows),
            "allowed": sum(r["status"] == "allowed" for r in rows), "failed": len(failed),
            "failures_by_kind": kinds, "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1)}


def _reexec_with(triton_path: str, argv: list[str]) -> int:
    """Run this tool again with ``triton_path`` (a ``pip install --target`` folder) first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [triton_path, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, __file__, *argv], env=env, check=False).returncode


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="compute capabilities to build for (default 80,90)")
    parser.add_argument("--only", help="only case families (CASES) or kernels whose name contains this")
    parser.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    parser.add_argument("--sample", type=int, help="at most N configurations per kernel and arch, evenly "
                                                   "spread over the case tables (default: all)")
    parser.add_argument("--json", type=Path, help="write the rows and the summary to this file")
    parser.add_argument("--triton-path", help="a folder holding another triton (pip install --target): "
                                              "run with it first on the path")
    parser.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    args = parser.parse_args(argv)
    try:
        args.archs = [int(a) for a in args.arch.split(",")]
    except ValueError:
        parser.error(f"--arch: expected comma-separated compute capabilities like 80,90, got {args.arch!r}")
    if unknown := [a for a in args.archs if a not in SHARED_LIMIT]:
        parser.error(f"--arch: no shared memory limit known for {unknown}; known: {sorted(SHARED_LIMIT)}")
    if args.jobs < 1 or (args.sample is not None and args.sample < 1):
        parser.error("--jobs and --sample must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.triton_path:
        if not (Path(args.triton_path) / "triton").is_dir():
            print(f"gpu_compile: --triton-path {args.triton_path} holds no triton package "
                  "(install one with pip install --no-deps --target FOLDER triton==VERSION)", file=sys.stderr)
            return 2
        rest = [a for i, a in enumerate(argv) if a != "--triton-path" and argv[i - 1] != "--triton-path"
                and not a.startswith("--triton-path=")]
        return _reexec_with(args.triton_path, rest)
    if "triton" in sys.modules:
        print("gpu_compile: run it as a script: triton was imported before the compile settings", file=sys.stderr)
        return 2
    # compile, do not interpret, and print ptxas -v's log (registers, spills): before triton loads;
    # the compile processes inherit these
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton-compile"))
    import triton

    start = time.perf_counter()
    # --only naming a case family captures just it; otherwise every family, filtered by kernel name
    families = [f for f in CASES if args.only and args.only in f] or [f for f in CASES if f not in PENDING]
    jobs, rows = capture(args.archs, families, args.only)
    total = len(jobs)
    if args.sample:
        jobs = sample(jobs, args.sample)
    print(f"gpu_compile: triton {triton.__version__}, {total} distinct compiles for "
          f"{', '.join(f'sm_{a}' for a in args.archs)}, compiling {len(jobs)} "
          f"({'sample of ' + str(args.sample) + ' per kernel and arch' if args.sample else 'all'}) "
          f"with {args.jobs} process(es); cache {os.environ['TRITON_CACHE_DIR']}", flush=True)
    rows = [judge(r) for r in rows] + compile_all(jobs, args.jobs)
    rows.sort(key=lambda r: (r["family"], r["kernel"], r["arch"]))
    result = summary(rows, time.perf_counter() - start, triton.__version__)
    shown = [r for r in rows if r["status"] != "ok"] if args.quiet else rows
    if shown:
        print(table(shown))
    print("gpu_compile: " + json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": result, "rows": rows}, indent=1, default=str))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
