"""Absorbed MLA decode in Triton: attention directly over paged latent rows.

After absorption (``mla_ref.absorb_query``) every head's query lives in the
space of the cached rows ``[latent (R) | k_pe (rope)]``, and all heads share
those rows: multi-query attention with one very wide KV head. One program
takes one sequence and a tile of ``BLOCK_H`` heads, walks the sequence's
context ``BLOCK_N`` positions at a time (their slots through the block table
by ``kv_ops.kv_tile_slots``, as every attention kernel reads them), reads each row once
for all heads in the tile, and keeps an online softmax. The value of a row is
its latent part, so the output is the weighted latent ``[B, H, R]``; the caller
applies ``w_uv`` (``mla_ref.absorb_output``). The latent and rope parts are
loaded separately so neither width has to be a power of two (512 + 64 in V2).

Same arguments and result as ``mla_ref.mla_decode_latent``. Its online softmax
is its own (scores from the two parts, values the latent part only), not
``attn_ops.online_softmax_update``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention.kv_ops import kv_tile_slots


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    scale,
    stride_qb, stride_qh,
    stride_cache_block, stride_cache_slot,
    stride_bt,
    stride_ob, stride_oh,
    num_heads,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    tl.static_assert(BLOCK_R >= KV_LORA_RANK)
    tl.static_assert(BLOCK_P >= ROPE_DIM)
    seq = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
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
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n
        mask_n = pos < seq_len
        block, offset = kv_tile_slots(block_tables_ptr + seq * stride_bt, 1, start, pos, mask_n, 0,
                                      BLOCK_SIZE, BLOCK_N, True)
        row = cache_ptr + block * stride_cache_block + offset * stride_cache_slot
        # one read of each cached row serves every head of the tile
        c_lat = tl.load(row[:, None] + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        c_pe = tl.load(row[:, None] + KV_LORA_RANK + offs_p[None, :],
                       mask=mask_n[:, None] & mask_p[None, :], other=0.0)
        scores = tl.dot(q_lat, tl.trans(c_lat)) + tl.dot(q_pe, tl.trans(c_pe))  # [BLOCK_H, BLOCK_N]
        scores = tl.where(mask_n[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(c_lat.dtype), c_lat)  # values = the latent part
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    acc = acc / l_i[:, None]
    out_rows = out_ptr + seq * stride_ob + offs_h[:, None] * stride_oh
    tl.store(out_rows + offs_r[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_h[:, None] & mask_r[None, :])


def _check(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           kv_lora_rank: int) -> None:
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


def mla_decode_latent(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, *,
                      max_seq_len: int | None = None) -> torch.Tensor:
    """q [B, H, R + rope] over each sequence's paged rows -> weighted latents [B, H, R].
    ``max_seq_len`` is accepted for parity with the reference; the kernel reads ``seq_lens``."""
    _check(q, cache, block_tables, seq_lens, kv_lora_rank)
    q = q.contiguous()
    batch, num_heads, width = q.shape
    rope = width - kv_lora_rank
    out = torch.empty(batch, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_h = 16  # tl.dot wants tiles of at least 16 rows; surplus heads are masked
    grid = (batch, triton.cdiv(num_heads, block_h))
    _mla_decode_kernel[grid](
        q, cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_heads,
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope, BLOCK_SIZE=cache.shape[1],
        BLOCK_H=block_h, BLOCK_N=16,
        BLOCK_R=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
    )
    return out
