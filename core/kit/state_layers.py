"""What every layer with a per-sequence state (Mamba2, lightning attention, gated DeltaNet) shares.

A state layer runs its mixer ops (``lmplug.interfaces.mixer``) twice per step at most: once over
the decode rows (one token each, the step's first ``num_decodes`` sequences and tokens, the
``*_update`` ops) and once over the other rows (prefill and chunked-prefill chunks, the ``*_scan``
ops, each chunk starting from the state its slot carries). ``StateRows`` is that split: the first
state layer of a step builds it (``StateRows.of``) and keeps it on the step's context for the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmplug.interfaces.step import StepContext


@dataclass(frozen=True)
class StateRows:
    num_decode_tokens: int  # tokens [:n] are decode rows, one per sequence (sequences [:n])
    decode_slots: torch.Tensor  # [n] int32: their state slots
    prefill_slots: torch.Tensor  # [B - n] int32: the other sequences' slots
    prefill_cu: torch.Tensor  # [B - n + 1] int32: token offsets of those sequences in tokens [n:]

    @property
    def has_prefill(self) -> bool:
        return self.prefill_slots.numel() > 0

    @staticmethod
    def of(ctx: StepContext) -> StateRows:
        """The step's split, made by the first state layer that asks and kept on ``ctx``."""
        rows = ctx.__dict__.get("_state_rows")
        if rows is not None:
            return rows
        if ctx.state_slots is None:
            raise RuntimeError("a model with state layers ran a step without state slots "
                               "(the KV cache keeps no per-sequence state)")
        n = ctx.num_decodes
        cu = ctx.cu_query_lens[n:]
        rows = ctx.__dict__["_state_rows"] = StateRows(n, ctx.state_slots[:n], ctx.state_slots[n:], cu - cu[0])
        return rows


def zero_fresh_states(pools: list[dict[str, torch.Tensor]], ctx: StepContext) -> None:
    """Zero, in every state pool, the slots of the sequences this step starts (no context before
    their first chunk: a new sequence, or one recomputed after preemption). Tensor-parallel
    workers call it: only rank 0's KV cache zeroes a slot when it hands it out."""
    fresh = [i for i, (new, total) in enumerate(zip(ctx.query_lens_cpu, ctx.seq_lens_cpu)) if new == total]
    if not fresh or ctx.state_slots is None:
        return
    slots = ctx.state_slots[fresh].long()
    for layer in pools:
        for tensor in layer.values():
            tensor.index_fill_(0, slots, 0)


def run_split(rows: StateRows, decode: Callable[[slice], torch.Tensor],
              prefill: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """``decode(slice(0, n))`` over the decode tokens and ``prefill(slice(n, None))`` over the
    rest, joined along dim 0 (either part may be absent)."""
    n = rows.num_decode_tokens
    parts = []
    if n:
        parts.append(decode(slice(0, n)))
    if rows.has_prefill:
        parts.append(prefill(slice(n, None)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
