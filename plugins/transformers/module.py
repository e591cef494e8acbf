"""The fallback's model module: a transformers causal LM over lmplug's flattened step.

The step's tokens run as one batch row (``input_ids [1, T]``, ``position_ids [1, T]``, no HF
cache); each attention layer reaches lmplug's attention backend and KV cache through
``attention.STEP``. Parameters keep their HF names under ``hf.``, so ``weight_target`` is a prefix.
"""

from __future__ import annotations

from typing import Any

import torch
from lmplug_transformers.attention import NAME, STEP, Step, register

from lmplug.api import AttentionBackend, KVLayerView, StepContext


def build_hf_model(hf_config: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """transformers' causal LM for this ``config.json``, with lmplug's attention and no masks."""
    import transformers

    register(transformers)
    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "transformers_version")}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME, dtype=dtype)
    return model.to(dtype).eval()


class TransformersCausalLM(torch.nn.Module):

    # lmplug embeddings: forward returns the final-norm hidden states, which pooling reads
    final_hidden_states = True
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, attention: AttentionBackend) -> None:
        super().__init__()
        self.hf = build_hf_model(hf_config, dtype)
        self.decoder = getattr(self.hf, self.hf.base_model_prefix)
        self.base_model_prefix = self.hf.base_model_prefix  # a headless checkpoint's names lack it
        self.attention = attention
        self.kv_views: list[KVLayerView] = []
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        # the final-logit transforms HF's causal-LM heads apply after lm_head
        self.logit_scale = hf_config.get("logit_scale")  # Cohere: logits * scale
        self.logits_scaling = hf_config.get("logits_scaling")  # Granite: logits / scaling
        self.softcap = hf_config.get("final_logit_softcapping")  # Gemma 2/3
        self._params = {name for name, _ in self.hf.named_parameters(remove_duplicate=False)}

    def bind_kv(self, views: list[KVLayerView]) -> None:
        self.kv_views = views

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        token = STEP.set(Step(ctx, self.kv_views, self.attention))
        try:
            out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            STEP.reset(token)
        return out.last_hidden_state[0]  # [T, h]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.lm_head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def weight_target(self, name: str) -> tuple[str, str | None] | None:
        if name == "lm_head.weight" and self.tied:
            return None  # the embedding's
        if name in self._params:
            return f"hf.{name}", None
        return None if "rotary_emb" in name else (f"hf.{name}", None)  # the loader names unused ones

    def checkpoint_name(self, path: str, shard: str | None) -> str:
        return path.removeprefix("hf.")
