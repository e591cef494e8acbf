"""``sdpa``: the PyTorch reference attention, the CPU default and the ground truth.

Writes the step's K/V into the cache through the slot mapping, then runs
``torch.nn.functional.scaled_dot_product_attention`` per sequence over its
cached context. Reads both the contiguous and the paged layout (a sequence's
blocks are gathered through its block table). GQA without repeating K/V:
decode queries are grouped per KV head; prefill uses SDPA's ``enable_gqa``.
Quantized KV (kvcache ``dtype: int8 | fp8_e4m3``): writes quantize per
(token, KV head); reads dequantize only the rows of the sequence's context.
Tree attention (feature ``tree_attention``, for tree speculative decoding): a
sequence in ``ctx.tree_masks`` attends to its cached context plus the new tokens
its ancestor mask allows (``causal_mask(..., tree=...)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmplug.interfaces import AttentionBackend, Capabilities, KVLayerView, StepContext
from lmplug.interfaces.kvcache import dequantize_kv, store_kv

# the kvcache `dtype` values the first-party dense backends read
KV_DTYPES = frozenset({"auto", "int8", "fp8_e4m3"})


class SdpaAttention(AttentionBackend):
    name = "sdpa"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        kv_layouts=frozenset({"contiguous", "paged"}),
        features=frozenset({"sliding_window", "tree_attention"}),
        kv_dtypes=KV_DTYPES,
        priority=10,
    )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        write_kv(kv, k, v, ctx.slot_mapping)
        out = torch.empty_like(q)
        bs = kv.block_size
        start = 0
        for i, (qlen, seq_len) in enumerate(zip(ctx.query_lens_cpu, ctx.seq_lens_cpu)):
            ctx_k, ctx_v = context_kv(kv, ctx.block_tables[i], seq_len, bs, q.dtype)
            qi = q[start:start + qlen]
            if i in ctx.tree_masks:  # a draft tree: its full mask, built once per step
                key = (self.name, "tree", i, self.sliding_window)
                if key not in ctx.scratch:
                    ctx.scratch[key] = causal_mask(qlen, seq_len, self.sliding_window, q.device,
                                                   ctx.tree_masks[i])
                out[start:start + qlen] = self._prefill(qi, ctx_k, ctx_v, seq_len, mask=ctx.scratch[key])
            elif qlen == 1 and self.sliding_window is None:
                out[start] = self._decode(qi[0], ctx_k, ctx_v)
            else:
                out[start:start + qlen] = self._prefill(qi, ctx_k, ctx_v, seq_len)
            start += qlen
        return out

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [H, D] -> [Hkv, G, D]; k, v: [S, Hkv, D] -> [Hkv, S, D]; no mask: all S keys are visible
        hkv = self.num_kv_heads
        qg = q.view(hkv, -1, self.head_dim)
        # 4-d (a batch of one): on CPU, 3-d inputs miss SDPA's flash kernel and take the math path
        o = F.scaled_dot_product_attention(qg[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           scale=self.scale)
        return o.reshape(-1, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        # q: [L, H, D] are the last L positions of a context of seq_len keys (``mask``: given, for a tree)
        qlen = q.shape[0]
        # a whole prompt without a window is plain causal attention: no mask to build
        plain = qlen == seq_len and self.sliding_window is None and mask is None
        if not plain and mask is None:
            mask = causal_mask(qlen, seq_len, self.sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, is_causal=plain, scale=self.scale, enable_gqa=True)  # 4-d: see _decode
        return o[0].transpose(0, 1)


def write_kv(kv: KVLayerView, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V: slot s is row s of the cache flattened to [slots, Hkv, D]
    (quantized per (token, KV head), scales alongside, when the cache is)."""
    store_kv(kv.k_cache, kv.k_scale, k, slot_mapping)
    store_kv(kv.v_cache, kv.v_scale, v, slot_mapping)


def context_kv(kv: KVLayerView, block_table: torch.Tensor, seq_len: int, block_size: int,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V, [seq_len, Hkv, D] each (a view when it fits one block and
    is not quantized; quantized K/V are dequantized to ``dtype``)."""
    if seq_len <= block_size:
        b = int(block_table[0])
        rows = slice(b, b + 1)
        k, v = kv.k_cache[b, :seq_len], kv.v_cache[b, :seq_len]
    else:
        num_blocks = -(-seq_len // block_size)
        rows = block_table[:num_blocks].long()
        k = kv.k_cache.index_select(0, rows).flatten(0, 1)[:seq_len]
        v = kv.v_cache.index_select(0, rows).flatten(0, 1)[:seq_len]
    if kv.k_scale is None:
        return k, v
    ks = kv.k_scale[rows].flatten(0, 1)[:seq_len]
    vs = kv.v_scale[rows].flatten(0, 1)[:seq_len]
    dtype = dtype or torch.float32
    return dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype)


def causal_mask(qlen: int, seq_len: int, window: int | None, device: torch.device,
                tree: torch.Tensor | None = None) -> torch.Tensor:
    """[qlen, seq_len] bool, True = attend. Query i sits at position seq_len - qlen + i.

    ``tree`` (bool [qlen, qlen], ``StepContext.tree_masks``): the new tokens are a draft tree's
    root and nodes; new token i sits at position start + depth(i) (depth = its ancestors in the
    mask) and sees the cached keys [0, start) and the new tokens the mask allows; the window
    applies to those positions."""
    start = seq_len - qlen
    if tree is None:
        q_pos = torch.arange(start, seq_len, device=device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
        mask = k_pos <= q_pos
    else:
        tree = tree.to(device)
        new_pos = start + tree.sum(1) - 1  # [qlen]: root at start, a node at start + depth
        q_pos = new_pos.unsqueeze(1)
        k_pos = torch.cat([torch.arange(start, device=device), new_pos]).unsqueeze(0)
        mask = torch.cat([torch.ones(qlen, start, dtype=torch.bool, device=device), tree], 1)
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
