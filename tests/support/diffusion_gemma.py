"""A tiny random DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``) saved as a
checkpoint folder: the reference the DiffusionGemma model and the denoising stage are tested on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CANVAS = 4
TEXT: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "sliding_window": 8, "num_experts": 4, "top_k_experts": 2,
    "moe_intermediate_size": 32, "max_position_embeddings": 256, "final_logit_softcapping": 30.0,
    "layer_types": ["sliding_attention", "full_attention", "full_attention"], "eos_token_id": 1,
}
VISION = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}


def build_diffusion_gemma(path: Path, canvas: int = CANVAS, seed: int = 0) -> Any:
    """A random ``DiffusionGemmaForBlockDiffusion`` saved under ``path`` (eval, fp32): norms,
    layer scalars and router scales randomised (ones would hide a loader that drops them),
    projections wide enough that the logits are far from uniform."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    cfg = DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION, canvas_length=canvas)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "vision" in name:
                continue
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")) or ("norm" in name and p.dim() == 1):
                p.copy_(0.6 + 0.8 * torch.rand_like(p))
            elif p.dim() >= 2 and "embed" not in name:
                p.normal_(0, 0.15)
        model.model.decoder.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    return model


