"""State-slot pools for the SSM / linear-attention op tests (a helper, not a test file)."""

from __future__ import annotations

import torch


def pool_with(states: torch.Tensor, num_slots: int, index_dtype: torch.dtype, seed: int):
    """(state_indices [B], pool [num_slots, ...]): a random pool holding ``states`` [B, ...] at distinct
    slots in shuffled order; the other rows random too."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:states.shape[0]]
    pool = torch.randn(num_slots, *states.shape[1:], generator=g).to(states.device, states.dtype)
    pool[slots] = states
    return slots.to(states.device, index_dtype), pool


def others(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows of ``pool`` no sequence owns."""
    keep = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    keep[slots.long()] = False
    return pool[keep]
