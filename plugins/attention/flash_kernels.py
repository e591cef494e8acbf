"""FlashAttention in Triton: the pieces the prefill and decode kernels share.

What: exact attention (``softmax(q k^T * scale) v``, causal, optional left
sliding window, GQA) without ever materialising the ``[queries, keys]``
score matrix. Keys are walked in tiles of ``BLOCK_N`` positions and folded
into a running maximum ``m``, running sum ``l`` and unnormalised output
``acc`` per query row (the online softmax of FlashAttention-2); the output
is ``acc / l`` once the last tile is in.

Why it is exact: rescaling the old ``acc`` and ``l`` by ``exp(m_old - m_new)``
whenever the maximum grows gives the same numbers as a softmax over the
whole row; only the summation order differs. Scores are kept in base 2
(``exp2``, with ``log2(e)`` folded into the scale) and accumulated in fp32
whatever the input dtype.

Where K/V come from. A tile's key rows are addressed as ``block * stride_b +
offset * stride_t``:

- packed (``PAGED=False``): the step's own ``k, v [T, Hkv, D]``; block is 0
  and offset is the token's row ``cu_seqlens[b] + pos``;
- through a block table (``PAGED=True``): a layer's cache ``[num_blocks,
  block_size, Hkv, D]``; position ``pos`` of sequence ``b`` is block
  ``block_tables[b, pos // block_size]``, offset ``pos % block_size``. The
  contiguous KV layout is the case of one block of ``max_model_len`` slots
  per sequence, so one kernel reads both layouts. When ``block_size`` is a
  multiple of ``BLOCK_N`` a tile lies in one block and the block id is one
  scalar load; otherwise it is looked up per position (any block size works).

Kernels (each with a PyTorch twin in ``flash_ref.py``):

- ``flash_prefill_kernels``: varlen prefill, from packed K/V or from the cache
  (chunked prefill and prefix-cache hits), one program per (query block,
  sequence, query head); tiles that are wholly outside the causal window are
  never visited, and tiles wholly inside skip the masking arithmetic.
- ``flash_decode_kernels``: one query token per sequence; the query heads
  that share a KV head are the rows of one tile so each K/V row is read once
  (GQA without repeating K/V); long contexts are split into partitions
  computed in parallel and merged by a reduce kernel (flash decoding).

The cache write is ``torch.Tensor.index_copy_`` at ``slot_mapping`` (see
``sdpa.write_kv``): one memory-bound copy per tensor, nothing to fuse.

Quantized KV (``QUANT``: int8 / float8_e4m3fn caches with float32 scales
``[num_blocks, block_size, Hkv]``): a tile is loaded as bytes with the scales
of its slots and dequantized in registers (``q * scale`` in fp32, cast to q's
dtype: the op order of ``dequantize_kv``) before the dot. Packed K/V (the
step's own, unquantized) never are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NO_WINDOW = 2**30  # the window passed when there is none: larger than any context, int32-safe
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _kv_slots(table_ptr, stride_btn, start, pos, valid, row0,
              BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """(block, offset) int64 [BLOCK_N] of the key positions ``pos`` = ``start + arange(BLOCK_N)``."""
    if PAGED:
        if BLOCK_SIZE % BLOCK_N == 0:
            # tiles start at multiples of BLOCK_N, so the whole tile sits in one block
            block = tl.load(table_ptr + (start // BLOCK_SIZE) * stride_btn).to(tl.int64)
            block = tl.zeros([BLOCK_N], tl.int64) + block
        else:
            block = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0).to(tl.int64)
        offset = (pos % BLOCK_SIZE).to(tl.int64)
    else:
        block = tl.zeros([BLOCK_N], tl.int64)
        offset = (row0 + pos).to(tl.int64)
    return block, offset


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, block, offset, kv_head, offs_d, load_mask,
                  stride_kb, stride_kt, stride_kh, stride_kd,
                  stride_vb, stride_vt, stride_vh, stride_vd):
    """K and V rows [BLOCK_N, D_PAD]; masked-out elements are 0 (never NaN from unused slots)."""
    k_offs = (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None] + offs_d[None, :] * stride_kd
    v_offs = (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None] + offs_d[None, :] * stride_vd
    k = tl.load(k_ptr + k_offs, mask=load_mask, other=0.0)
    v = tl.load(v_ptr + v_offs, mask=load_mask, other=0.0)
    return k, v


@triton.jit
def _dequant_kv_tile(k, v, k_scale_ptr, v_scale_ptr, block, offset, kv_head, valid,
                     stride_sb, stride_st, stride_sh, OUT_TY: tl.constexpr):
    """Quantized K and V tiles [BLOCK_N, D_PAD] times their (slot, KV head) scales, cast to OUT_TY."""
    offs = block * stride_sb + offset * stride_st + kv_head * stride_sh
    ks = tl.load(k_scale_ptr + offs, mask=valid, other=0.0)
    vs = tl.load(v_scale_ptr + offs, mask=valid, other=0.0)
    return (k.to(tl.float32) * ks[:, None]).to(OUT_TY), (v.to(tl.float32) * vs[:, None]).to(OUT_TY)


@triton.jit
def _online_softmax_update(q, k, v, visible, m_i, l_i, acc, qk_scale,
                           MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile into (m, l, acc). q [M, D]; k, v [N, D]; ``visible`` [M, N] used if MASKED."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
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


# -- host-side helpers shared by the wrappers ---------------------------------------------------------


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands would otherwise be rounded to tf32 on NVIDIA GPUs: not exact enough for a reference
    return "ieee" if dtype == torch.float32 else "tf32"


def head_dim_pad(head_dim: int) -> int:
    """The head dim a tile holds: the next power of two (>= 16 for tl.dot); extra lanes are masked."""
    return max(16, triton.next_power_of_2(head_dim))


def window_arg(sliding_window: int | None, what: str) -> int:
    """Keys at positions (p - window, p] are visible to the query at p; "no window" is NO_WINDOW."""
    if sliding_window is None:
        return NO_WINDOW
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"{what}: sliding_window must be None or an integer >= 1, got {sliding_window!r}")
    return min(sliding_window, NO_WINDOW)


def check_power_of_two(value: int, name: str, what: str, minimum: int = 16) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{what}: {name} must be a power of two >= {minimum}, got {value}")


def check_query(q: torch.Tensor, what: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"{what}: q must be [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"{what}: dtype must be one of float32, float16, bfloat16, got {q.dtype}")


def check_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str, names: str,
             quantized: bool = False) -> int:
    """K/V ([T, Hkv, D] or [num_blocks, block_size, Hkv, D]) against q; returns the GQA group size.
    ``quantized`` caches (checked by ``paged_kernels.check_scales``) need not share q's dtype."""
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
