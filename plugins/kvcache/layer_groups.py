"""Memory accounting per layer group of the paged cache: what layers of one sliding window hold,
and what they would need if they could release the blocks that left their window.

Gemma 2 (1:1), Gemma 3 (5:1) and GPT-OSS (1:1) mix full-attention layers with sliding-window
layers (``KVCacheSpec.layer_windows``). The paged pool has one block table per sequence shared
by every layer (a block id names the same slots in each layer's ``[num_blocks, ...]`` view), so
a block is either held by a sequence in all layers or free in all of them: the window layers
keep the blocks the full layers need, and none is released early (``docs/backends.md`` says why
a per-group release needs one table per layer group). This module reports the cost: per group,
the bytes its layers hold and an upper bound of those they need (the blocks a window of ``W``
tokens can touch, ``ceil((W - 1) / block_size) + 1`` per sequence, at most what it holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroup:
    """The cached layers that attend with one window (None: full attention), and their K/V bytes."""

    window: int | None
    layers: tuple[int, ...]
    held_bytes: int  # held now by every running sequence's blocks, in these layers
    needed_bytes: int  # at most needed: the blocks inside each sequence's window, in these layers

    @property
    def releasable_bytes(self) -> int:
        """What a cache with one block table per layer group could give back now."""
        return self.held_bytes - self.needed_bytes


def layer_groups(windows: Sequence[int | None], block_size: int, layer_block_bytes: Sequence[int],
                 held_blocks: Sequence[int]) -> list[LayerGroup]:
    """The groups of ``windows`` (each cached layer's window), in order of first layer;
    ``layer_block_bytes``: one block of each layer (K and V, scales included; layers may differ in
    shape, Gemma 4); ``held_blocks``: how many blocks each running sequence holds."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    groups = []
    for window, layers in by_window.items():
        reach = None if window is None else -(-(window - 1) // block_size) + 1  # blocks one window touches
        held = sum(held_blocks)
        needed = held if reach is None else sum(min(n, reach) for n in held_blocks)
        per_block = sum(layer_block_bytes[layer] for layer in layers)
        groups.append(LayerGroup(window, tuple(layers), held * per_block, needed * per_block))
    return groups


def describe(groups: Sequence[LayerGroup]) -> str:
    """One line for the load log: each group's layers and window."""
    return "; ".join(f"{len(g.layers)} layers {'full' if g.window is None else f'window {g.window}'} "
                     f"({', '.join(map(str, g.layers[:6]))}{', ...' if len(g.layers) > 6 else ''})" for g in groups)
