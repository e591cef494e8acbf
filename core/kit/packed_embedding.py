"""A token embedding whose table a quant method holds (``lmplug.kit.extras.PackedWeights``).

A GGUF's ``token_embd`` is the largest tensor of a small model and, tied, also its LM head,
read at every step. Kept as a ``Linear`` ``[vocab, hidden]`` of the model's quant method, it
stays in its packed blocks: the lookup dequantizes only the step's rows
(``PackedWeights.embedding``), and a tied LM head multiplies by the same table through the
method (``Linear.forward``), so no float copy of it is ever made.
"""

from __future__ import annotations

import torch

from lmplug.interfaces.quant import QuantMethod
from lmplug.kit.layers import Linear


class QuantEmbedding(Linear):
    """``forward(ids [T]) -> [T, hidden]``; ``logits(hidden) -> [T, vocab]`` (the tied head).
    The loader fills it as the one shard ``embed_tokens``."""

    SHARD = "embed_tokens"

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, quant: QuantMethod) -> None:
        super().__init__(hidden, {self.SHARD: vocab_size}, bias=False, dtype=dtype, quant=quant)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quant.embedding(self, ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant.apply(self, hidden)
