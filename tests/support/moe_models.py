"""Tiny random MoE checkpoints built by transformers (a helper module, not a test file):
Mixtral / Qwen2-MoE / Qwen3-MoE (``TinyMoE``) and DeepSeek-V2/V3 (``TinyDeepseek``), their
transformers-5 stacked-expert form (``save_stacked``), and HF's greedy loop as the reference.
Shared by the parity tests (tests/plugins/models), the MoE quant tests and the tensor-parallel tests."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from lmplug import LLM
from support.hf_models import _BASE, build_hf_model

MOE_SPECS: dict[str, dict] = {
    # 8 experts, top-2, renormalised; the experts are intermediate_size wide
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
    # shared expert behind a sigmoid gate, raw top-k weights, layer 1 dense (mlp_only_layers)
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96,
                  "norm_topk_prob": False, "mlp_only_layers": [1]},
    # q/k norm, renormalised top-k, no shared expert
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 48, "norm_topk_prob": True, "head_dim": 16},
}


def make_moe_config(name: str):
    from transformers import AutoConfig

    spec = {**_BASE, **MOE_SPECS[name]}
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    cfg._attn_implementation = "eager"
    return cfg


class TinyMoE:
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.hf = build_hf_model(make_moe_config(name))
        self.path = root / name
        self.hf.save_pretrained(self.path)
        self.config = json.loads((self.path / "config.json").read_text())
        self._llms: dict[str, LLM] = {}

    def llm(self, **overrides) -> LLM:
        key = json.dumps(overrides, sort_keys=True)
        if key not in self._llms:
            self._llms[key] = LLM(str(self.path), dtype="float32", device="cpu", max_model_len=256, **overrides)
        return self._llms[key]

    def stacked_llm(self) -> LLM:
        """An LLM over the same model saved with transformers 5's stacked expert tensors."""
        if "stacked" not in self._llms:
            self._llms["stacked"] = LLM(str(save_stacked(self.hf, self.path.with_name(self.name + "_v5"))),
                                        dtype="float32", device="cpu", max_model_len=256)
        return self._llms["stacked"]


def save_stacked(hf, path: Path) -> Path:
    """Save ``hf`` as transformers keeps it in memory (no conversion to per-expert tensors) and
    check the folder really holds stacked experts only."""
    from safetensors import safe_open

    hf.save_pretrained(path, save_original_format=False)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        stacked = [n for n in names if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
        assert stacked and not [n for n in names if ".experts.0." in n], names
        e, two_i, h = f.get_slice(next(n for n in stacked if n.endswith("gate_up_proj"))).get_shape()
        assert h == hf.config.hidden_size and two_i % 2 == 0 and e > 1  # [E, 2I, h]
    return path


@torch.no_grad()
def hf_greedy_loop(hf, ids: list[int], n: int) -> list[int]:
    """n greedy tokens: one forward over the prompt, then one per token on HF's KV cache."""
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(torch.tensor([ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        cache = out.cache if cache_kw == "cache" else out.past_key_values
        out = hf(torch.tensor([[tokens[-1]]]), use_cache=True, **{cache_kw: cache})
    return tokens


_DEEPSEEK: dict = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    # MLA: latent 32 + shared rope key 8 cached per token; per head nope 16, rope 8, v 12
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    # MoE: 8 routed experts, top-2, one shared; layer 0 dense
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "routed_scaling_factor": 1.5,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}

DEEPSEEK_SPECS: dict[str, dict] = {
    "q_lora": {"q_lora_rank": 48},
    "no_q_lora": {"q_lora_rank": None},  # V2-Lite: a plain q_proj
    "yarn": {"q_lora_rank": 48, "rope_scaling": YARN},
    # DeepSeek-V3: the same MLA; sigmoid routing with a correction bias over expert groups
    "v3": {"model_type": "deepseek_v3", "q_lora_rank": 48, "num_key_value_heads": 4, "n_group": 2,
           "topk_group": 1, "norm_topk_prob": True},
}


class TinyDeepseek:
    def __init__(self, name: str, root: Path) -> None:
        from transformers import DeepseekV2Config, DeepseekV3Config

        self.name = name
        spec = {**_DEEPSEEK, **DEEPSEEK_SPECS[name]}
        config_cls = DeepseekV3Config if spec.pop("model_type", None) == "deepseek_v3" else DeepseekV2Config
        cfg = config_cls(**spec)
        cfg._attn_implementation = "eager"
        self.hf = build_hf_model(cfg)
        self.path = root / name
        self.hf.save_pretrained(self.path)
        self.config = json.loads((self.path / "config.json").read_text())
        self._llms: dict[str, LLM] = {}

    def llm(self, **overrides) -> LLM:
        key = json.dumps(overrides, sort_keys=True)
        if key not in self._llms:
            self._llms[key] = LLM(str(self.path), dtype="float32", device="cpu", max_model_len=256,
                                  **overrides)
        return self._llms[key]
