"""Drafters propose tokens for speculative decoding; the core's verifier accepts or rejects."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from lmplug.interfaces.common import BackendOptions, Capabilities

if TYPE_CHECKING:
    from lmplug.engine.sequence import Sequence


@dataclass
class DraftProposal:
    token_ids: list[list[int]]  # per sequence, up to k proposed tokens
    probs: list[torch.Tensor] | None = None  # per sequence [k, vocab] draft distributions (sampling)


class Drafter(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions) -> None:
        self.options = options

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: int) -> DraftProposal:
        """Propose up to ``num_tokens`` next tokens for each sequence."""
