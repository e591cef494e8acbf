"""The target's output matrix [V, h], however the target holds it.

A Llama-family target keeps its LM head as a plain tensor (``lm_head``), shares its embedding's
table (tied), or, with a quant method that takes packed blocks (a GGUF read without
dequantizing), holds it packed inside a ``Linear`` whose ``weight`` is not a float matrix. Draft
heads that multiply by the head themselves (EAGLE's draft vocabulary, the trainers) need the
float rows: ``plain_head`` gives the tensor when there is one, ``head_matrix`` always gives one.
"""

from __future__ import annotations

import torch


def plain_head(model: torch.nn.Module) -> torch.Tensor | None:
    """The target's LM head as a float [V, h] tensor it already holds (tied: the embedding's), or None."""
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(getattr(model, "embed_tokens", None), "weight", None)
    elif not isinstance(head, torch.Tensor):
        head = getattr(head, "weight", None)
    if isinstance(head, torch.Tensor) and head.is_floating_point() and head.dim() == 2:
        return head
    return None


@torch.no_grad()
def head_matrix(model: torch.nn.Module) -> torch.Tensor:
    """The target's LM head [V, h]: ``plain_head``, or read back through the model's own
    ``compute_logits`` (row v = the logits of the basis vectors at column v), e.g. packed blocks."""
    head = plain_head(model)
    if head is not None:
        return head
    norm = model.norm.weight
    eye = torch.eye(model.config.hidden_size, dtype=norm.dtype, device=norm.device)
    return model.compute_logits(eye).T.contiguous()
