"""The per-step record every attention backend reads (built once per step by the runner)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class _Preparer(Protocol):
    """What ``metadata_for`` needs of an attention backend (``AttentionBackend.prepare``; the
    attention module imports this one, so the type is spelled out here)."""

    def prepare(self, ctx: StepContext, kv: Any) -> object | None: ...


@dataclass
class StepContext:
    """Where the step's flattened tokens sit and what each sequence attends to.

    Sequences are ordered decodes first (``query_len == 1`` and some context
    cached), so kernels can take a fast path over ``[:num_decodes]``; then the
    other rows without a mask (``query_masks``), shortest query first; then masked rows.

    Shapes: T = tokens in this step, B = sequences in this step.
    """

    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    query_lens: torch.Tensor  # [B] int32, new tokens per sequence
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    cu_query_lens: torch.Tensor  # [B+1] int32, prefix sums of query_lens
    slot_mapping: torch.Tensor  # [T] int64, cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # [B, max_blocks] int32, cache blocks of each sequence
    query_lens_cpu: list[int]  # host copies, for decisions made in Python
    seq_lens_cpu: list[int]
    num_decodes: int
    # rows whose new tokens are not a plain causal chain (``ScheduledSeq.mask``; a speculative
    # draft tree is one): batch index -> bool [n, n] over that row's new tokens. Such a row's
    # tokens sit at ``positions`` (siblings may share one) but their K/V at slots start + j;
    # attention lets new token a see new token b only where mask[a, b] (plus the whole cached
    # context, and the sliding window by position). Empty when every row is causal; backends
    # without the "tree_attention" feature never see one (refused at load time)
    query_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # models with state layers (``KVCacheSpec.states``): [B] int32, each sequence's state slot
    # (``lmplug.kit.kv_extras.StateSlots.state_slot``), in step order; None otherwise
    state_slots: torch.Tensor | None = None
    # what a select stage hands the model for a row (``ScheduledSeq.inputs``: a block-diffusion
    # decoder's self-conditioning), batch index -> the stage's object; empty for plain rows
    row_inputs: dict[int, Any] = field(default_factory=dict)
    # what the attention backend derives from the fields above once per step and every layer
    # reuses (``AttentionBackend.prepare``): built on first use by ``metadata_for``, never by
    # the runner. Not an __init__ field, so ``dataclasses.replace`` (a copy moved to another
    # device) starts without it rather than sharing one built for the old device
    attn_metadata: object | None = field(default=None, init=False, repr=False, compare=False)
    _attn_key: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def metadata_for(self, backend: _Preparer, kv: Any) -> Any:
        """``backend.prepare(self, kv)``, built on the first call of the step and then reused.

        Layers share one backend object and one KV pool format, so every layer after the
        first gets the same object: the metadata is built once per step. A call by another
        backend object, or with a view of another format (dtype, quantization, pool shape,
        device), rebuilds it for that caller: one slot, holding the latest.
        """
        cache = kv.k_cache
        key = (backend, cache.dtype, cache.device, tuple(cache.shape), kv.quantized)
        if self._attn_key is None or not _same_key(self._attn_key, key):
            self.attn_metadata = backend.prepare(self, kv)
            self._attn_key = key
        return self.attn_metadata

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs


def _same_key(a: tuple, b: tuple) -> bool:
    # the backend by identity (two objects of one class may differ in options), the rest by value
    return a[0] is b[0] and a[1:] == b[1:]
