"""Multi-head latent attention in PyTorch: the CPU path and the reference the Triton kernel is tested against.

The cache holds one row per token, ``[latent (R) | k_pe (rope)]``, shared by all
heads: ``cache [num_blocks, block_size, 1, R + rope]``, read through block
tables (the contiguous layout is one block per sequence). ``kv_b_proj`` arrives
split per head: ``w_uk [H, nope, R]`` makes keys, ``w_uv [H, V, R]`` values.

- ``write_latent``: store the step's rows at ``slot_mapping`` (negative slots skipped).
- ``mla_prefill_attention``: the expanded form. Each sequence's cached latent is
  expanded to per-head K = [latent w_uk^T | k_pe] and V = latent w_uv^T, then
  causal SDPA: cheap for the new tokens of a prompt, which would expand anyway.
- ``absorb_query`` / ``mla_decode_latent`` / ``absorb_output``: the absorbed
  decode. Because ``q_nope . (c w_uk^T) = (q_nope w_uk) . c``, the query moves
  into latent space once per token and attention scores and sums the cached
  rows directly (MQA with one KV head of width R + rope); the weighted latent
  leaves through ``w_uv``. Nothing per head is ever built from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lmplug_attention.kv_ref import gather_context
from lmplug_attention.sdpa import causal_mask


def write_latent(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """latent [T, R], k_pe [T, rope] -> rows ``slot_mapping`` of cache [N, block_size, 1, R + rope]."""
    rows = torch.cat([latent, k_pe], dim=-1).to(cache.dtype)  # [T, R + rope]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows)


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, nope] . w_uk [H, nope, R] -> [B, H, R + rope]: the query in cache-row space."""
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
    return torch.cat([q_latent, q_pe], dim=-1)


def absorb_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out_latent [B, H, R] . w_uv [H, V, R]^T -> [B, H, V]."""
    return torch.einsum("bhr,hvr->bhv", out_latent, w_uv)


def mla_decode_latent(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, *,
                      max_seq_len: int | None = None) -> torch.Tensor:
    """q [B, H, R + rope] over each sequence's cached rows -> softmax-weighted latents [B, H, R]."""
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    rows = gather_context(cache, block_tables, max_seq_len)[:, :, 0]  # [B, S, R + rope]
    pos = torch.arange(max_seq_len, device=q.device)
    visible = pos.unsqueeze(0) < seq_lens.to(q.device).long().unsqueeze(1)  # [B, S]
    # slots past a sequence's end hold stale rows; zero them so 0 x NaN cannot leak in
    rows = rows.masked_fill(~visible[..., None], 0)
    scores = torch.einsum("bhd,bsd->bhs", q.float(), rows.float()) * scale
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bhs,bsr->bhr", probs, rows[..., :kv_lora_rank].float()).to(q.dtype)


def mla_decode_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                         w_uv: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, *, decode_latent=mla_decode_latent,
                         max_seq_len: int | None = None) -> torch.Tensor:
    """The absorbed decode, one query token per sequence: [B, H, nope], [B, H, rope] -> [B, H, V].
    ``decode_latent`` is this module's ``mla_decode_latent`` or the Triton kernel's."""
    q = absorb_query(q_nope, q_pe, w_uk)
    out_latent = decode_latent(q, cache, block_tables, seq_lens, scale, w_uk.shape[-1],
                               max_seq_len=max_seq_len)
    return absorb_output(out_latent, w_uv)


def expand_kv(rows: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached rows [S, R + rope] -> per-head K [H, S, nope + rope] and V [H, S, V]."""
    rank = w_uk.shape[-1]
    latent, k_pe = rows[:, :rank], rows[:, rank:]
    k_nope = torch.einsum("sr,hnr->hsn", latent, w_uk)
    v = torch.einsum("sr,hvr->hsv", latent, w_uv)
    k = torch.cat([k_nope, k_pe.unsqueeze(0).expand(k_nope.shape[0], -1, -1)], dim=-1)
    return k, v


def mla_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                          w_uv: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                          cu_query_lens: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Varlen queries, the last query_len positions of seq_len each: [T, H, nope|rope] -> [T, H, V]."""
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    starts = cu_query_lens.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        rows = gather_context(cache, block_tables[i:i + 1], seq_len)[0, :, 0]  # [S, R + rope]
        k, v = expand_kv(rows.to(q_nope.dtype), w_uk, w_uv)
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).transpose(0, 1)  # [H, L, nope + rope]
        query_len = end - start
        # 4-d (a batch of one): on CPU, 3-d inputs miss SDPA's flash kernel and take the math path
        if query_len == seq_len:  # nothing cached: plain causal attention
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
        else:
            mask = causal_mask(query_len, seq_len, None, q.device)
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)
        out[start:end] = o[0].transpose(0, 1)  # [L, H, V]
    return out
