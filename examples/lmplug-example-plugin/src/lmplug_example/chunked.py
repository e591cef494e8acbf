"""``chunked``: attention over K/V chunks with an online softmax, in plain PyTorch.

The FlashAttention recurrence without a kernel: keys and values are read from
the cache ``chunk_size`` positions at a time, and a running maximum, running
sum and running output are rescaled as each chunk arrives, so the scores of a
sequence never exist all at once. Peak memory per sequence is
O(query_len x chunk_size) instead of O(query_len x context): long contexts on
small machines. Accumulates in float32 whatever the model dtype.

Reads both KV layouts through the block table (slot ``s`` = block
``s // block_size``, offset ``s % block_size``), supports GQA without
repeating K/V, and skips chunks that lie entirely before a sliding window.
"""

from __future__ import annotations

import torch
from pydantic import Field

from lmplug.api import AttentionBackend, BackendOptions, Capabilities, KVLayerView, StepContext


class ChunkedOptions(BackendOptions):
    chunk_size: int = Field(
        default=256, ge=1, le=65536, description="keys per chunk: the peak-memory knob"
    )


class ChunkedAttention(AttentionBackend):
    name = "chunked"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        kv_layouts=frozenset({"contiguous", "paged"}),
        features=frozenset({"sliding_window"}),
        priority=1,  # below the first-party backends: `backend: auto` never picks it
    )
    Options = ChunkedOptions

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: KVLayerView,
        ctx: StepContext,
    ) -> torch.Tensor:
        # the step's new K/V go to their slots first: they are part of the context read below
        kv.k_cache.view(-1, *k.shape[1:]).index_copy_(0, ctx.slot_mapping, k)
        kv.v_cache.view(-1, *v.shape[1:]).index_copy_(0, ctx.slot_mapping, v)
        out = torch.empty_like(q)
        starts = ctx.cu_query_lens.tolist()
        for i, (query_len, seq_len) in enumerate(zip(ctx.query_lens_cpu, ctx.seq_lens_cpu)):
            rows = slice(starts[i], starts[i] + query_len)
            out[rows] = self._sequence(q[rows], kv, ctx.block_tables[i], seq_len).to(q.dtype)
        return out

    def _sequence(
        self, q: torch.Tensor, kv: KVLayerView, block_table: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        query_len, num_heads, head_dim = q.shape
        group = num_heads // self.num_kv_heads
        # q: [L, H, D] -> [Hkv, G, L, D]: the G query heads of one KV head attend together
        qg = q.float().view(query_len, self.num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        run_max = torch.full(qg.shape[:3], float("-inf"), device=q.device)  # [Hkv, G, L]
        run_sum = torch.zeros(qg.shape[:3], device=q.device)
        acc = torch.zeros_like(qg)  # [Hkv, G, L, D]
        chunk = self.options.chunk_size
        for start in range(self._first_key(seq_len, query_len), seq_len, chunk):
            pos = torch.arange(start, min(start + chunk, seq_len), device=q.device)
            keys, values = self._read(kv, block_table, pos)  # [Hkv, C, D] each
            scores = torch.einsum("hgld,hcd->hglc", qg, keys) * self.scale
            scores = scores.masked_fill(~self._visible(q_pos, pos), float("-inf"))
            new_max = torch.maximum(run_max, scores.amax(dim=-1))
            # a row that has seen no visible key yet keeps max -inf; shift by 0 to avoid inf - inf
            shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            probs = torch.exp(scores - shift[..., None])
            rescale = torch.exp(run_max - shift)
            run_sum = run_sum * rescale + probs.sum(dim=-1)
            acc = acc * rescale[..., None] + torch.einsum("hglc,hcd->hgld", probs, values)
            run_max = new_max
        out = acc / run_sum[..., None]
        return out.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim)

    def _first_key(self, seq_len: int, query_len: int) -> int:
        """The earliest key any query of this step can see (0 without a sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, seq_len - query_len - self.sliding_window + 1)

    def _visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[L, C] bool: causal, and inside the window when there is one."""
        visible = k_pos[None, :] <= q_pos[:, None]
        if self.sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
        return visible

    def _read(
        self, kv: KVLayerView, block_table: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = kv.block_size
        slots = block_table.long()[pos // bs] * bs + pos % bs
        keys = kv.k_cache.view(-1, *kv.k_cache.shape[2:])[slots]  # [C, Hkv, D]
        values = kv.v_cache.view(-1, *kv.v_cache.shape[2:])[slots]
        return keys.float().transpose(0, 1), values.float().transpose(0, 1)
