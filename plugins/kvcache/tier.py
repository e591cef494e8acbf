"""``BlockTier``: the paged pool's link to a KV connector (a host-memory or disk tier of blocks).

Write-through: each full block the engine computes is registered under its prefix hash
(``BlockManager``) and copied, K/V and scales of every layer, into the connector as it is
registered (``save``). Read: a new prompt whose leading blocks are not in the pool any more
gets the following ones from the connector (``load``), checked against the pool's shapes and
dtypes, before the step that would compute them; the first block the connector cannot give
ends the hit, and the rest is computed.
"""

from __future__ import annotations

import logging

import torch

from lmplug.api import KVBlockFormat, KVConnector

logger = logging.getLogger(__name__)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # CPU copies of float8 go through a byte view (as the pool's block copies do)
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class BlockTier:
    def __init__(self, connector: KVConnector, fmt: KVBlockFormat, pool: torch.Tensor,
                 scales: torch.Tensor | None) -> None:
        self.connector = connector
        self.format = fmt
        self.pool, self.scales = pool, scales  # [L, 1|2, N, bs, H, D] and [L, 1|2, N, bs, H] or None
        self.blocks_saved = 0
        self.blocks_loaded = 0
        connector.open(fmt)

    def payload(self, block: int) -> dict[str, torch.Tensor]:
        out = {"kv": _bytes(self.pool[:, :, block]).to("cpu", copy=True)}
        if self.scales is not None:
            out["scales"] = self.scales[:, :, block].to("cpu", copy=True)
        return out

    def save(self, registered: list[tuple[int, int]]) -> None:
        for block, key in registered:
            if not self.connector.contains(key):
                self.connector.put(key, self.payload(block))
                self.blocks_saved += 1

    def load(self, loads: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Fill ``loads`` (block, key) in order from the connector; the leading ones filled."""
        done = []
        for block, key in loads:
            payload = self.connector.get(key)
            if payload is None or not self._fits(payload, key):
                break
            _bytes(self.pool[:, :, block]).copy_(payload["kv"])
            if self.scales is not None:
                self.scales[:, :, block].copy_(payload["scales"])
            done.append((block, key))
        self.blocks_loaded += len(done)
        return done

    def _fits(self, payload: dict[str, torch.Tensor], key: int) -> bool:
        want = {"kv": (tuple(self.pool[:, :, 0].shape), _bytes(self.pool).dtype)}
        if self.scales is not None:
            want["scales"] = (tuple(self.scales[:, :, 0].shape), self.scales.dtype)
        got = {name: (tuple(t.shape), t.dtype) for name, t in payload.items() if isinstance(t, torch.Tensor)}
        if got != want:
            logger.warning("kvconnector %s: block %032x does not fit this pool (%s, expected %s); "
                           "computing it instead", self.connector.name, key, got, want)
            return False
        return True
