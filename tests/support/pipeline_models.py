"""Tiny random transformers checkpoints with enough layers to split into 2 and 3 pipeline stages
(a helper module, not a test file): dense Llama, Qwen2-MoE, DeepSeek-V2 (MLA + MoE), Mamba2 and
Gemma 2 (sliding and global layers alternate: per-layer indices must stay global in a stage)."""

from __future__ import annotations

from pathlib import Path

import torch

from support.hf_models import _BASE, build_hf_model

# 4 layers each: PP=2 splits them 2 + 2, PP=3 2 + 1 + 1
LAYERS = 4


def _config(name: str):
    from transformers import AutoConfig, DeepseekV2Config, Mamba2Config

    if name == "llama":
        cfg = AutoConfig.for_model("llama", **{**_BASE, "num_hidden_layers": LAYERS})
    elif name == "llama_tied":
        cfg = AutoConfig.for_model("llama", **{**_BASE, "num_hidden_layers": LAYERS, "tie_word_embeddings": True})
    elif name == "qwen2_moe":  # shared expert behind a sigmoid gate, layer 1 dense
        cfg = AutoConfig.for_model("qwen2_moe", **{
            **_BASE, "num_hidden_layers": LAYERS, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96, "norm_topk_prob": False,
            "mlp_only_layers": [1]})
    elif name == "deepseek_v2":
        from support.moe_models import _DEEPSEEK

        cfg = DeepseekV2Config(**{**_DEEPSEEK, "num_hidden_layers": LAYERS, "q_lora_rank": 48})
    elif name == "mamba2":
        torch.manual_seed(0)
        cfg = Mamba2Config(vocab_size=512, hidden_size=64, num_hidden_layers=LAYERS, expand=2, num_heads=4,
                           head_dim=32, state_size=8, n_groups=1, conv_kernel=3, chunk_size=5,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
                           tie_word_embeddings=True)
    elif name == "gemma2":  # local (window 8) and global layers alternate; soft-caps
        from support.fallback_configs import config

        spec = config("gemma2", num_hidden_layers=LAYERS, vocab_size=512)
        cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    else:
        raise KeyError(name)
    cfg._attn_implementation = "eager"
    return cfg


def save(root: Path, name: str) -> Path:
    """Build (once per ``root``) and save model ``name``; its folder."""
    path = root / f"pp_{name}"
    if not path.exists():
        build_hf_model(_config(name)).save_pretrained(path)
    return path
