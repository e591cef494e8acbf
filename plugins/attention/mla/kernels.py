"""Absorbed MLA decode in Triton: attention directly over paged latent rows, split-K on long contexts.

After absorption (``mla_ref.absorb_query``) every head's query lives in the
space of the cached rows ``[latent (R) | k_pe (rope)]``, and all heads share
those rows: multi-query attention with one very wide KV head. One program
takes one sequence, a tile of ``BLOCK_H`` heads and one partition of the
context, walks it ``BLOCK_N`` positions at a time (their slots through the
block table by ``kv_ops.kv_tile_slots``, as every attention kernel reads
them), reads each row once for all heads in the tile, and keeps an online
softmax in base 2 (``exp2``, ``log2(e)`` folded into the scale). The value of a
row is its latent part, so the output is the weighted latent ``[B, H, R]``; the
caller applies ``w_uv`` (``mla_ref.absorb_output``). The latent and rope parts
are loaded separately so neither width has to be a power of two (512 + 64 in V2).

Split-K: with few (sequence, head tile) programs (a batch of one: one program
per 16 heads) a long context would be walked by a handful of SMs. As in the
flash decode (``decode_ops``), the context is then cut into partitions computed
in parallel, each writing its normalised partial latent with its running max
and sum, merged by ``decode_ops.reduce_partitions``; the split count comes from
``decode_ops.plan_decode`` with the head tiles in place of KV heads, for the
SM count of the GPU (``decode_ops.num_sms``: sm_80 108, sm_90 132 where no
device is asked).

Precision: fp32 inputs take exact fp32 dot products (``input_precision="ieee"``),
as every attention kernel here does; TF32 only with ``allow_tf32`` (the ``mla``
backend's option of that name).

Launch configuration per architecture: ``MLA_TABLE``. Compilations: the context
length reaches the kernel as runtime integers only; the split count enters as
``SPLIT`` (two values) and in the reduce as a bucketed ``S_TILE`` (at most 4
values at R = 512), so a serving run compiles a bounded number of variants.

Same arguments and result as ``mla_ref.mla_decode_latent``. Its online softmax
is its own (scores from the two parts, values the latent part only), not
``attn_ops.online_softmax_update``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention.attn_ops import LOG2E, arch_entry, dot_precision
from lmplug_attention.decode_ops import MAX_SPLITS, num_sms, plan_decode, reduce_partitions
from lmplug_attention.kv_ops import kv_tile_slots

from lmplug.kit.devices import capability

# (BLOCK_H, BLOCK_N, num_warps, num_stages) per architecture (``attn_ops.arch_entry``). BLOCK_H
# is 16, the smallest tile tl.dot takes (surplus heads are masked). Compiled for each target at
# R = 512, rope = 64 (DeepSeek-V2/V3; Triton 3.9): one entry serves both, without spills
# (fp16: 128 registers, 37 KiB of shared memory; fp32: 168 registers, 73 KiB), where three
# stages took 104 KiB in fp32 (more than sm_86 / sm_89 give).
# - None: the interpreter (tests) and the fallback where no GPU is known.
MLA_TABLE: dict[tuple[int, int] | None, tuple[int, int, int, int]] = {
    None: (16, 16, 4, 2),
    (8, 0): (16, 16, 4, 2),
    (9, 0): (16, 16, 4, 2),
}


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, partition_size, num_heads,
    stride_qb, stride_qh,
    stride_cache_block, stride_cache_slot,
    stride_bt,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_mb, stride_mh, stride_ms,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_R >= KV_LORA_RANK)
    tl.static_assert(BLOCK_P >= ROPE_DIM)
    seq = tl.program_id(0).to(tl.int64)  # sequence x stride passes 2^31 in big batches and caches
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    mask_h = offs_h < num_heads
    mask_r = offs_r < KV_LORA_RANK
    mask_p = offs_p < ROPE_DIM

    # the query tile: latent part [BLOCK_H, BLOCK_R] and rope part [BLOCK_H, BLOCK_P]
    q_rows = q_ptr + seq * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(q_rows + KV_LORA_RANK + offs_p[None, :], mask=mask_h[:, None] & mask_p[None, :],
                   other=0.0)

    seq_len = tl.load(seq_lens_ptr + seq)
    # this program's keys [lo, hi): partitions are whole BLOCK_N tiles, so tiles stay aligned
    lo = split * partition_size
    hi = tl.minimum(lo + partition_size, seq_len)
    table_ptr = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        mask_n = pos < hi
        block, offset = kv_tile_slots(table_ptr, 1, start, pos, mask_n, 0, BLOCK_SIZE, BLOCK_N, True)
        row = cache_ptr + block * stride_cache_block + offset * stride_cache_slot
        # one read of each cached row serves every head of the tile
        c_lat = tl.load(row[:, None] + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        c_pe = tl.load(row[:, None] + KV_LORA_RANK + offs_p[None, :],
                       mask=mask_n[:, None] & mask_p[None, :], other=0.0)
        scores = (tl.dot(q_lat, tl.trans(c_lat), input_precision=PRECISION)
                  + tl.dot(q_pe, tl.trans(c_pe), input_precision=PRECISION))  # [BLOCK_H, BLOCK_N]
        # every tile holds a key (start < hi), so m_new is finite from the first tile on
        scores = tl.where(mask_n[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        # values = the latent part
        acc = acc * alpha[:, None] + tl.dot(p.to(c_lat.dtype), c_lat, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    # an empty partition (a sequence shorter than the longest) keeps l = 0, m = -inf: weight 0
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    io_mask = mask_h[:, None] & mask_r[None, :]
    if SPLIT:
        part = part_out_ptr + seq * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps
        tl.store(part + offs_r[None, :], acc, mask=io_mask)
        stat = seq * stride_mb + offs_h * stride_mh + split * stride_ms
        tl.store(part_max_ptr + stat, m_i, mask=mask_h)
        tl.store(part_sum_ptr + stat, l_i, mask=mask_h)
    else:
        out_rows = out_ptr + seq * stride_ob + offs_h[:, None] * stride_oh
        tl.store(out_rows + offs_r[None, :], acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def _check(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           kv_lora_rank: int, num_splits: int | None) -> None:
    if q.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"mla decode: q must be [B, H, D] and cache [N, block_size, 1, D]; got "
                         f"{tuple(q.shape)} and {tuple(cache.shape)}")
    if q.shape[-1] != cache.shape[-1] or not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"mla decode: query width {q.shape[-1]}, cache row {cache.shape[-1]} and "
                         f"kv_lora_rank {kv_lora_rank} do not fit (row = latent + rope)")
    if q.dtype != cache.dtype:
        raise ValueError(f"mla decode: q is {q.dtype}, the cache {cache.dtype}; they must match")
    block_size = cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"mla decode: block size {block_size} is not a power of two")
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError("mla decode: one block table row and one seq_len per query row")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"mla decode: num_splits must be None or in [1, {MAX_SPLITS}], got {num_splits}")


def mla_decode_latent(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, *,
                      max_seq_len: int | None = None, num_splits: int | None = None,
                      allow_tf32: bool = False) -> torch.Tensor:
    """q [B, H, R + rope] over each sequence's paged rows -> weighted latents [B, H, R].

    ``max_seq_len`` (a host int; None reads ``seq_lens``, a device sync) plans the split-K;
    ``num_splits`` forces the number of partitions (None: planned, 1: no split);
    ``allow_tf32`` lets fp32 inputs take TF32 dot products (default: exact fp32)."""
    _check(q, cache, block_tables, seq_lens, kv_lora_rank, num_splits)
    q = q.contiguous()
    batch, num_heads, width = q.shape
    rope = width - kv_lora_rank
    out = torch.empty(batch, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_h, block_n, num_warps, num_stages = arch_entry(MLA_TABLE, capability(q.device))
    head_tiles = triton.cdiv(num_heads, block_h)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    splits, partition = plan_decode(batch, head_tiles, max_seq_len, None, block_n, num_splits, num_sms(q.device))
    precision = "tf32" if allow_tf32 and q.dtype == torch.float32 else dot_precision(q.dtype)
    args = (q, cache, block_tables, seq_lens, out)
    scalars = (scale * LOG2E, partition, num_heads, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
               block_tables.stride(0), out.stride(0), out.stride(1))
    meta = {"KV_LORA_RANK": kv_lora_rank, "ROPE_DIM": rope, "BLOCK_SIZE": cache.shape[1], "BLOCK_H": block_h,
            "BLOCK_N": block_n, "BLOCK_R": max(16, triton.next_power_of_2(kv_lora_rank)),
            "BLOCK_P": max(16, triton.next_power_of_2(rope)), "PRECISION": precision,
            "num_warps": num_warps, "num_stages": num_stages}
    grid = (batch, head_tiles, splits)
    if splits == 1:
        _mla_decode_kernel[grid](*args, out, out, out, *scalars, 0, 0, 0, 0, 0, 0, SPLIT=False, **meta)
        return out
    part_out = torch.empty(batch, num_heads, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    part_max = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _mla_decode_kernel[grid](*args, part_out, part_max, part_sum, *scalars, *part_out.stride()[:3],
                             *part_max.stride(), SPLIT=True, **meta)
    return reduce_partitions(part_out, part_max, part_sum, out)
