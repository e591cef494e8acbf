"""PagedAttention in Triton: write K/V through a slot mapping, attend through block tables.

The cache of one layer is ``[num_blocks, block_size, Hkv, D]`` (K and V alike);
a sequence's tokens live in the blocks its block table lists, in any order.
Three kernels, each with a PyTorch twin in ``paged_ref.py`` (same arguments,
same results):

- ``reshape_and_cache``: one program per new token copies its K and V rows
  into slot ``slot_mapping[t]`` (negative slots are padding and skipped).
- ``paged_decode_attention``: one program per (sequence, KV head, partition).
  The program loads the ``G`` query heads that share the KV head as the rows
  of one tile, so each K/V row is read once for the whole group (GQA without
  repeating K/V). It walks the context in tiles of ``TILE_N`` positions,
  looking up each position's block (so any power-of-two block size works and
  tiles may span several blocks) with an online softmax, so context length is
  bounded only by the block table. With few sequences and long contexts the
  context is split into partitions (split-K, "flash-decoding"): each program
  writes its partial output with its running max and sum, and
  ``_paged_decode_reduce_kernel`` merges them.
- ``paged_prefill_attention`` (in ``paged_prefill_kernels.py``): varlen queries
  over a cached prefix plus the new tokens.

Scores are kept in base 2 (``exp2`` with the scale folded into ``log2(e)``).

Quantized KV (``k_scale`` / ``v_scale`` given; int8 or float8_e4m3fn caches with
a float32 scale per (slot, KV head)): the attention kernels load the byte tile
and its scales and dequantize in registers (``q * scale`` in fp32, then q's
dtype: the op order of ``dequantize_kv``) before the dot. The quantizing write
is the PyTorch ``store_kv`` (a plain ``index_copy_`` after a per-row amax: memory
bound, nothing for a kernel to fuse).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmplug.interfaces.kvcache import KV_QMAX, store_kv

LOG2E = 1.4426950408889634
DEFAULT_PARTITION_SIZE = 512  # tokens per split-K partition
TILE_N = 64  # context positions per loop iteration
NO_WINDOW = 2**30  # the sliding window passed when there is none (int32-safe)


@triton.jit
def _kv_tile_offsets(table_ptr, stride_btn, pos, valid, kv_head, offs_d,
                     stride_cb, stride_ct, stride_ch, stride_cd, BLOCK_SIZE: tl.constexpr):
    """Element offsets [N, D] of positions ``pos`` [N] of one KV head, through a block table row."""
    block = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0).to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
    return row[:, None] + offs_d[None, :] * stride_cd


@triton.jit
def _dequant_tile(x, scale_ptr, table_ptr, stride_btn, pos, valid, kv_head,
                  stride_sb, stride_st, stride_sh, BLOCK_SIZE: tl.constexpr, OUT_TY: tl.constexpr):
    """A quantized tile x [N, D] times the scales of its (slot, KV head) [N], in fp32, cast to OUT_TY."""
    block = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0).to(tl.int64)
    offs = block * stride_sb + (pos % BLOCK_SIZE) * stride_st + kv_head * stride_sh
    scale = tl.load(scale_ptr + offs, mask=valid, other=0.0)
    return (x.to(tl.float32) * scale[:, None]).to(OUT_TY)


@triton.jit
def _attend_tile(q, k, v, mask, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: q [M, D] against a tile k, v [N, D] where ``mask`` [M, N] holds."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with nothing visible yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token
        return
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, D_PAD)[None, :]
    mask = (offs_h < num_kv_heads) & (offs_d < head_dim)
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
           + offs_h * stride_ch + offs_d * stride_cd)
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, max_ptr, sum_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, sliding_window, partition_size, num_queries_per_kv, head_dim,
    stride_qb, stride_qh, stride_qd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_op, stride_od,
    stride_mb, stride_mh, stride_mp,
    stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # keys [lo, hi): this partition's share of the window (sliding_window is huge when off)
    hi = tl.minimum(part * partition_size + partition_size, seq_len)
    lo = tl.maximum(part * partition_size, seq_len - sliding_window)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < num_queries_per_kv
    d_mask = offs_d < head_dim
    heads = kv_head * num_queries_per_kv + offs_g
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G, D]

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_btb
    for start in range(lo, hi, TILE):
        pos = start + tl.arange(0, TILE)
        valid = pos < hi
        offs = _kv_tile_offsets(table_ptr, stride_btn, pos, valid, kv_head, offs_d,
                                stride_cb, stride_ct, stride_ch, stride_cd, BLOCK_SIZE)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if QUANT:
            k = _dequant_tile(k, k_scale_ptr, table_ptr, stride_btn, pos, valid, kv_head,
                              stride_sb, stride_st, stride_sh, BLOCK_SIZE, q.dtype)
            v = _dequant_tile(v, v_scale_ptr, table_ptr, stride_btn, pos, valid, kv_head,
                              stride_sb, stride_st, stride_sh, BLOCK_SIZE, q.dtype)
        m_i, l_i, acc = _attend_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION)

    # an empty partition (past the end, or before the window) leaves l_i = 0 and stores zeros
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = (out_ptr + seq * stride_ob + heads[:, None] * stride_oh + part * stride_op
                + offs_d[None, :] * stride_od)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if SPLIT:
        stat = seq * stride_mb + heads * stride_mh + part * stride_mp
        tl.store(max_ptr + stat, m_i, mask=g_mask)
        tl.store(sum_ptr + stat, l_i, mask=g_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr, max_ptr, sum_ptr, seq_lens_ptr, out_ptr,
    partition_size, head_dim,
    stride_pb, stride_ph, stride_pp, stride_pd,
    stride_mb, stride_mh, stride_mp,
    stride_ob, stride_oh, stride_od,
    P_TILE: tl.constexpr, D_PAD: tl.constexpr,
):
    """Merge the partitions of one (sequence, head): weights exp2(m_p - m) * l_p."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_parts = tl.cdiv(tl.load(seq_lens_ptr + seq), partition_size)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < head_dim
    m_run = tl.full([], float("-inf"), tl.float32)
    den = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for p0 in range(0, num_parts, P_TILE):
        offs_p = p0 + tl.arange(0, P_TILE)
        p_mask = offs_p < num_parts
        stat = seq * stride_mb + head * stride_mh + offs_p * stride_mp
        m = tl.load(max_ptr + stat, mask=p_mask, other=float("-inf"))
        l = tl.load(sum_ptr + stat, mask=p_mask, other=0.0)
        o_ptrs = (part_out_ptr + seq * stride_pb + head * stride_ph + offs_p[:, None] * stride_pp
                  + offs_d[None, :] * stride_pd)
        o = tl.load(o_ptrs, mask=p_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_safe)
        w = tl.math.exp2(m - m_safe) * l
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        m_run = m_new
    out = acc / den
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


# -- wrappers ----------------------------------------------------------------------------------------


def check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, what: str) -> bool:
    """Whether the caches are quantized; clear errors for scales that do not fit them."""
    if k_scale is None and v_scale is None:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"{what}: give both k_scale and v_scale, or neither")
    if k_cache.dtype not in KV_QMAX or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{what}: quantized caches must be int8 or float8_e4m3fn, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if (k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_scale.shape
            or k_scale.stride() != v_scale.stride()
            or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32):
        raise ValueError(f"{what}: k_scale and v_scale must be float32 [num_blocks, block_size, Hkv] = "
                         f"{tuple(k_cache.shape[:3])} with equal strides, got {tuple(k_scale.shape)} "
                         f"{k_scale.dtype} and {tuple(v_scale.shape)} {v_scale.dtype}")
    return True


def scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple:
    """(k_scale_ptr, v_scale_ptr, strides) for a kernel launch; placeholders when unquantized."""
    if k_scale is None:
        return (k_cache, k_cache), (0, 0, 0)
    return (k_scale, v_scale), tuple(k_scale.stride())


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, what: str, quantized: bool = False) -> None:
    """Clear errors for the shapes and dtypes every paged kernel relies on."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"{what}: k_cache and v_cache must be [num_blocks, block_size, Hkv, D] with equal "
                         f"strides, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    if block_size & (block_size - 1):
        raise ValueError(f"{what}: block_size must be a power of two, got {block_size}")
    if q.shape[-1] != head_dim or q.shape[-2] % num_kv_heads:
        raise ValueError(f"{what}: q {tuple(q.shape)} needs head_dim {head_dim} and a multiple of "
                         f"{num_kv_heads} KV heads")
    if not (quantized or q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (
            torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{what}: q and the caches must share one dtype of float16, bfloat16, float32; "
                         f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"{what}: block_tables and seq_lens must be int32, got {block_tables.dtype} "
                         f"and {seq_lens.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"{what}: block_tables must be [B, max_blocks] with B = len(seq_lens) "
                         f"({seq_lens.shape[0]}), got {tuple(block_tables.shape)}")


def check_out(out: torch.Tensor | None, q: torch.Tensor, what: str) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"{what}: out must be like q ({tuple(q.shape)}, {q.dtype}, {q.device}), "
                         f"got {tuple(out.shape)}, {out.dtype}, {out.device}")
    return out


def window_arg(sliding_window: int | None) -> int:
    """The kernels' window: keys (p - window, p] are visible; "off" is a window no context reaches."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    return sliding_window or NO_WINDOW


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise be rounded to tf32 on NVIDIA GPUs
    return "ieee" if dtype == torch.float32 else "tf32"


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D] -> cache slots ``slot_mapping`` [T] of k_cache, v_cache [N, block_size, Hkv, D].

    With ``k_scale`` / ``v_scale`` (quantized caches) the write is PyTorch's ``store_kv``.
    """
    if check_scales(k_cache, v_cache, k_scale, v_scale, "reshape_and_cache"):
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        store_kv(k_cache, k_scale, k, slot_mapping.long())
        store_kv(v_cache, v_scale, v, slot_mapping.long())
        return
    if (k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]
            or k_cache.shape != v_cache.shape):
        raise ValueError(f"reshape_and_cache: k, v must be [T, Hkv, D] matching the caches' "
                         f"[num_blocks, block_size, Hkv, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride():
        raise ValueError(f"reshape_and_cache: dtypes must match the cache ({k_cache.dtype}) and the caches "
                         f"share strides; got k {k.dtype}, v {v.dtype}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"reshape_and_cache: slot_mapping must be [T={k.shape[0]}], "
                         f"got {tuple(slot_mapping.shape)}")
    if k.shape[0] == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _reshape_and_cache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim,
        *k.stride(), *v.stride(), *k_cache.stride(),
        BLOCK_SIZE=block_size, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim))


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                          device: torch.device) -> int | None:
    """Split-K only when the (sequence, KV head) programs alone would leave most of the GPU idle."""
    num_sms = 128
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if num_seqs * num_kv_heads >= num_sms or max_seq_len <= 2 * DEFAULT_PARTITION_SIZE:
        return None
    return DEFAULT_PARTITION_SIZE


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None, max_seq_len: int | None = None,
                           partition_size: int | None = None, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], block_tables [B, max_blocks] int32, seq_lens [B] int32 (each >= 1) -> [B, H, D].

    ``partition_size`` forces split-K with partitions of that many tokens (a
    power of two >= 16), 0 forbids it, ``None`` decides from the batch and
    context size. ``max_seq_len`` (host int) spares a device sync. ``out``
    ([B, H, D], q's dtype) receives the result when given. ``k_scale`` / ``v_scale``
    ([num_blocks, block_size, Hkv] float32) mark int8 / float8_e4m3fn caches.
    """
    quant = check_scales(k_cache, v_cache, k_scale, v_scale, "paged_decode_attention")
    check_cache(q, k_cache, v_cache, block_tables, seq_lens, "paged_decode_attention", quant)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    if partition_size is None:
        partition_size = choose_partition_size(batch, num_kv_heads, max_seq_len, q.device)
    elif partition_size == 0:
        partition_size = None
    elif partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"paged_decode_attention: partition_size must be 0, None or a power of two >= 16, "
                         f"got {partition_size}")
    out = check_out(out, q, "paged_decode_attention")
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    tile = TILE_N if partition_size is None else min(TILE_N, partition_size)
    meta = {"BLOCK_SIZE": block_size, "TILE": tile, "G_PAD": max(16, triton.next_power_of_2(group)),
            "D_PAD": max(16, triton.next_power_of_2(head_dim)), "DOT_PRECISION": dot_precision(q.dtype),
            "QUANT": quant}
    scale_ptrs, scale_strides = scale_args(k_cache, k_scale, v_scale)
    common = (*scale_ptrs, scale * LOG2E, window_arg(sliding_window))
    strides = (*q.stride(), *k_cache.stride(), *block_tables.stride())
    if partition_size is None:
        _paged_decode_kernel[(batch, num_kv_heads, 1)](
            q, k_cache, v_cache, block_tables, seq_lens, out, out, out, *common, max(max_seq_len, 1), group,
            head_dim, *strides, out.stride(0), out.stride(1), 0, out.stride(2), 0, 0, 0, *scale_strides,
            SPLIT=False, **meta)
        return out
    num_parts = triton.cdiv(max_seq_len, partition_size)
    part_out = torch.empty(batch, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    maxes = torch.empty(batch, num_heads, num_parts, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    _paged_decode_kernel[(batch, num_kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, maxes, sums, *common, partition_size, group,
        head_dim, *strides, *part_out.stride(), *maxes.stride(), *scale_strides, SPLIT=True, **meta)
    _paged_decode_reduce_kernel[(batch, num_heads)](
        part_out, maxes, sums, seq_lens, out, partition_size, head_dim, *part_out.stride(),
        *maxes.stride(), *out.stride(), P_TILE=min(64, triton.next_power_of_2(num_parts)),
        D_PAD=triton.next_power_of_2(head_dim))
    return out
