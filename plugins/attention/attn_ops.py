"""Attention math in Triton, shared by every ``flash`` and ``paged`` kernel.

What: exact attention (``softmax(q k^T * scale) v``, causal, optional left
sliding window, GQA; per layer, scores soft-capped and attention sinks in the
denominator: ``feature_args``) without ever materialising the ``[queries, keys]``
score matrix. Keys are walked in tiles of ``BLOCK_N`` positions and folded
into a running maximum ``m``, running sum ``l`` and unnormalised output
``acc`` per query row (the online softmax of FlashAttention-2,
``online_softmax_update``, over the tiles ``attend_tiles`` walks); the output
is ``acc / l`` once the last tile is in.

Why it is exact: rescaling the old ``acc`` and ``l`` by ``exp(m_old - m_new)``
whenever the maximum grows gives the same numbers as a softmax over the
whole row; only the summation order differs. Scores are kept in base 2
(``exp2``, with ``log2(e)`` folded into the scale) and accumulated in fp32
whatever the input dtype.

Where the tiles come from (block tables, packed K/V, quantized caches) is
``kv_ops``. The kernels built from these pieces:

- ``decode_ops``: one query token per sequence, the query heads of a KV head
  as the rows of one tile (GQA), split-K with a reduce; the decode of both
  backends (``flash_decode_kernels``, ``paged_kernels``);
- ``flash_prefill_kernels``: varlen prefill, one program per (query block,
  sequence, query head), skipping tiles outside the causal window;
- ``paged_prefill_kernels``: varlen prefill over the cache, one program per
  (query block, sequence, KV head) with tokens x grouped heads as rows.

The host-side pieces every wrapper shares are here too: the argument checks,
the per-architecture launch tables' lookup (``arch_entry``), the bucketing of
constexprs that follow the context length (``bucket``), and the target check the
backends run when the config is loaded (``check_triton_target``). The PyTorch
references are ``decode_ref`` and ``prefill_ref``.

Why launch tables rather than ``triton.autotune``: a table entry is chosen from
the compute capability alone (``lmplug.kit.devices.capability``), so it is
deterministic (no launch-time benchmarking, no first-step stall, the same kernel
every run) and the compile check builds exactly the configuration a GPU of that
architecture will launch, for sm_80 and sm_90, on a machine without one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention.kv_ops import dequant_kv_tile, kv_tile_slots, load_kv_tile

from lmplug.errors import ConfigError
from lmplug.kit.devices import describe
from lmplug.kit.triton_launch import (  # noqa: F401 (shared with the kernels)
    DTYPES,
    arch_entry,
    bucket,
    check_power_of_two,
    dot_precision,
    head_dim_pad,
)

LOG2E = 1.4426950408889634
LOG2E_JIT = tl.constexpr(LOG2E)  # the same inside kernels (a plain global is refused there)
NO_WINDOW = 2**30  # the window passed when there is none: larger than any context, int32-safe
MAX_HEAD_DIM = 256  # a head is one tile of head_dim_pad lanes; the launch tables cover up to 256
MIN_CAPABILITY = (8, 0)  # the oldest architecture the launch tables are built and checked for

@triton.jit
def softmax_state(M: tl.constexpr, D: tl.constexpr):
    """(acc [M, D], l [M], m [M]) of rows that have seen no key yet."""
    return tl.zeros([M, D], tl.float32), tl.zeros([M], tl.float32), tl.full([M], float("-inf"), tl.float32)


@triton.jit
def fold_sinks(l_i, m_i, sinks_ptr, heads, rows_mask, SINKS: tl.constexpr):
    """With ``SINKS``, each row's finished sum ``l`` with its attention sink joined: a key of logit
    ``sinks[head]`` and value 0, so ``exp(sink)`` (relative to the row's running max ``m``) adds to
    the denominator and nothing to the output. Rows outside ``rows_mask`` (padding, a split-K
    partition other than the first) get none. A sink more than 2^126 times every key's weight adds
    2^126: the output is then ~0 either way, and never inf / inf."""
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=rows_mask, other=float("-inf")).to(tl.float32) * LOG2E_JIT
        m_ref = tl.where(rows_mask, m_i, 0.0)  # padding rows may hold -inf: no -inf - -inf
        l_i += tl.math.exp2(tl.minimum(sink - m_ref, 126.0))
    return l_i


@triton.jit
def tanh(x):
    """tanh from exp2, stable for any |x| (1 - e over 1 + e, e = exp(-2|x|) <= 1): the interpreter
    and every target alike, with no libdevice."""
    e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E_JIT))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def online_softmax_update(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap,
                           MASKED: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold one tile into (m, l, acc). q [M, D]; k, v [N, D]; ``visible`` [M, N] used if MASKED.
    With ``SOFTCAP``, scores are soft-capped: ``softcap * tanh(s / softcap)``, both in base 2
    (``softcap`` is the cap times log2(e), as ``qk_scale`` is the scale times log2(e))."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        s = softcap * tanh(s / softcap)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no visible key keeps m = -inf: shift by 0 so exp2 gives 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_tiles(acc, l_i, m_i, q, q_pos, t_begin, t_end, kv_lo, kv_hi, window, qk_scale, softcap,
                 k_ptr, v_ptr, table_ptr, stride_btn, row0, kv_head, offs_d, d_mask,
                 stride_kb, stride_kt, stride_kh, stride_kd,
                 stride_vb, stride_vt, stride_vh, stride_vd,
                 k_scale_ptr, v_scale_ptr, stride_sb, stride_st, stride_sh,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
                 MASKED: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """Fold the key tiles ``[t_begin, t_end)`` (``BLOCK_N`` positions each) into (acc, l, m).

    The rows of ``q`` [M, D_PAD] sit at positions ``q_pos`` [M] (a GQA tile repeats a
    position once per grouped head) and see keys ``(q_pos - window, q_pos]`` among those
    that exist, ``[kv_lo, kv_hi)``; ``MASKED=False`` is for tiles every row sees whole (no
    mask arithmetic). Tiles come through ``kv_ops`` (block tables or packed K/V, dequantized
    when ``QUANT``, a ``kv_ops.QUANT_*`` code); scores soft-capped at ``softcap`` (base 2) when
    ``SOFTCAP``. Every kernel of ``flash`` and ``paged`` walks its keys with this loop.
    """
    for t in range(t_begin, t_end):
        start = tl.multiple_of(t * BLOCK_N, BLOCK_N)
        pos = start + tl.arange(0, BLOCK_N)
        # never read a key no row sees: with a window, blocks behind it may already be freed
        valid = (pos >= kv_lo) & (pos < kv_hi)
        block, offset = kv_tile_slots(table_ptr, stride_btn, start, pos, valid, row0, BLOCK_SIZE, BLOCK_N, PAGED)
        if MASKED:
            load_mask = valid[:, None] & d_mask[None, :]
            visible = (valid[None, :] & (pos[None, :] <= q_pos[:, None])
                       & (pos[None, :] > q_pos[:, None] - window))
        else:
            load_mask = d_mask[None, :]
            visible = valid[None, :]
        k, v = load_kv_tile(k_ptr, v_ptr, block, offset, kv_head, offs_d, load_mask,
                            stride_kb, stride_kt, stride_kh, stride_kd,
                            stride_vb, stride_vt, stride_vh, stride_vd)
        if QUANT:
            k, v = dequant_kv_tile(k, v, k_scale_ptr, v_scale_ptr, block, offset, kv_head, valid,
                                   stride_sb, stride_st, stride_sh, q.dtype, QUANT)
        m_i, l_i, acc = online_softmax_update(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, MASKED,
                                              PRECISION, SOFTCAP)
    return acc, l_i, m_i


# -- host-side helpers shared by the wrappers ---------------------------------------------------------


def check_triton_target(backend: str, head_dim: int, dtype: str, cap: tuple[int, int] | None,
                        max_head_dim: int | None = MAX_HEAD_DIM, kv_dtype: str = "auto") -> None:
    """Refuse, when the config is loaded, what the Triton attention kernels cannot build or launch
    on a GPU of capability ``cap`` (None: nothing to check), rather than a compile error on the
    first step: bfloat16 before sm_80, any GPU older than sm_80 (the launch tables' oldest
    entry needs its shared memory), head dims over ``max_head_dim`` (None: no limit), and a
    quantized cache under float32 queries. fp8 itself runs everywhere: it is decoded by integer ops
    (``kv_ops.fp8e4m3_to_float``). But the exact-fp32 tiles hold their operands in registers, and
    the dequantize on top spills kilobytes per thread on sm_80 and sm_90 (``make gpu-compile``);
    an 8-bit cache saves memory for 16-bit serving, so float32 with one is refused, not tuned."""
    if cap is None:
        return
    if dtype == "float32" and kv_dtype not in ("auto", dtype):
        raise ConfigError(f"kvcache.dtype: {kv_dtype!r} with dtype: float32 is not supported by attention "
                          f"backend {backend!r} (Triton kernels) on a GPU ({describe(cap)}): quantized "
                          "caches serve 16-bit models; use dtype: bfloat16 or float16, or kvcache.dtype: auto")
    if dtype == "bfloat16" and tuple(cap) < (8, 0):
        raise ConfigError(f"dtype: bfloat16 is not supported by attention backend {backend!r} (Triton "
                          f"kernels) on this GPU, {describe(cap)}: bfloat16 needs compute capability "
                          "8.0 or newer; use dtype: float16")
    if tuple(cap) < MIN_CAPABILITY:
        raise ConfigError(f"attention.backend: {backend!r} runs Triton kernels built for compute "
                          f"capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} and newer; this GPU is "
                          f"{describe(cap)}; use attention.backend: sdpa")
    if max_head_dim is not None and not 1 <= head_dim <= max_head_dim:
        raise ConfigError(f"attention.backend: {backend!r} (Triton kernels) takes head dims 1 to "
                          f"{max_head_dim}, but the model's head_dim is {head_dim} ({describe(cap)}); "
                          "use attention.backend: sdpa")


def feature_args(softcap: float | None, sinks: torch.Tensor | None, num_heads: int, device: torch.device,
                 what: str) -> tuple[float, torch.Tensor | None, bool, bool]:
    """(softcap in base 2, sinks as float32 [H], SOFTCAP, SINKS): what the kernels take for a
    layer's soft-cap (None: none) and attention sinks (None: none; else one logit per query
    head, ``LayerAttention``), checked."""
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"{what}: softcap must be None or a number > 0, got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (num_heads,) or not sinks.is_floating_point():
            got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"{what}: sinks must be a float tensor [num_heads={num_heads}], got {got}")
        if sinks.device != device:
            raise ValueError(f"{what}: sinks must be on the queries' device {device}, got {sinks.device}")
        sinks = sinks.to(torch.float32).contiguous()
    cap = float(softcap) * LOG2E if softcap is not None else 1.0
    return cap, sinks, softcap is not None, sinks is not None


def window_arg(sliding_window: int | None, what: str) -> int:
    """Keys at positions (p - window, p] are visible to the query at p; "no window" is NO_WINDOW."""
    if sliding_window is None:
        return NO_WINDOW
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"{what}: sliding_window must be None or an integer >= 1, got {sliding_window!r}")
    return min(sliding_window, NO_WINDOW)


def check_query(q: torch.Tensor, what: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"{what}: q must be [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"{what}: dtype must be one of float32, float16, bfloat16, got {q.dtype}")


def check_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str, names: str,
             quantized: bool = False) -> int:
    """K/V ([T, Hkv, D] or [num_blocks, block_size, Hkv, D]) against q; returns the GQA group size.
    ``quantized`` caches (checked by ``kv_ops.check_scales``) need not share q's dtype."""
    if k.shape != v.shape or k.dim() not in (3, 4):
        raise ValueError(f"{what}: {names} must have one shape, [..., num_kv_heads, head_dim]; "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if not quantized and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise ValueError(f"{what}: q and {names} must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{what}: q and {names} must be on one device; got {q.device}, {k.device}, {v.device}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{what}: head_dim of q ({head_dim}) and {names} ({k.shape[-1]}) differ")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{what}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def check_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, what: str) -> None:
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"{what}: block_tables and seq_lens must be int32, got {block_tables.dtype} "
                         f"and {seq_lens.dtype}")
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"{what}: block_tables must be [B, max_blocks] and seq_lens [B]; got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")


def output_for(q: torch.Tensor, out: torch.Tensor | None, what: str) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"{what}: out must be shaped and typed like q ({tuple(q.shape)} {q.dtype}), got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out
